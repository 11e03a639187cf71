"""The checks behind tests/test_shard_matmul_triton.py, under TRITON_INTERPRET=1: the fused
virtual-TP shard tree (kernels/triton_shard_matmul.py) gives the unfused path's bytes — per
shard `bmm` chains, projections added in order, the pairwise tree over shards — for the
row-parallel forward and the column-parallel dX (1 to 3 projections, 1 to 8 shards, ragged K
tails, the k/v projections' unequal floor-bound shards), bf16 and fp32 operands, any tile; a
sequential sum over the shards differs (control); bad input is refused; kernels/matmul.py's
linears pick the fused kernel exactly where `worth_fusing` says (on stand-in CUDA tensors).
Every comparison runs under `sequential_dot` (numpy's matmul, the interpreter's dot, rounds by
operand shape, which two kernels with other tiles would expose); the GPU's tensor-core bits are
tests/test_cuda_shard_matmul.py's. Prints {check: "ok" or the failure}. Run by hand:
TRITON_INTERPRET=1 .venv/bin/python tests/shard_matmul_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

from kernel_helpers import LaunchRecorder, interpreted_checks, run_checks

CHECKS, check = interpreted_checks(__file__)

import triton_interpreter_compat  # noqa: F401,E402 - numpy >= 2.3: before any launch
from triton_interpreter_compat import sequential_dot  # noqa: E402

from rlkernel.kernels import triton_matmul as tm  # noqa: E402
from rlkernel.kernels import triton_shard_matmul as tsm  # noqa: E402
from rlkernel.kernels import matmul as mm  # noqa: E402
from rlkernel.kernels.matmul import virtual_shard_rows  # noqa: E402
from rlkernel.numerics.trees import tree_sum  # noqa: E402

SMALL = (16, 16, 1, 1, 2)   # interpreter tile: (BLOCK_M, BLOCK_N, warps, stages, GROUP_M)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _unfused(dys, ws, shard_rows):
    """kernels/matmul.py's column backward loop on the Triton `bmm` chains."""
    return mm.column_dx_by_shards(dys, ws, shard_rows, product=tm.matmul)


@check
def row_parallel_equals_the_partials_tree():
    """S = 1, 2, 4, 8; K = S·40 (a ragged BLOCK_K tail in every shard) and S·64; M, N odd."""
    with sequential_dot():
        for dtype in (torch.bfloat16, torch.float32):
            for s in (1, 2, 4, 8):
                for ks in (40, 64):
                    x = _randn(19, s * ks, seed=s + ks, dtype=dtype)
                    w = _randn(21, s * ks, seed=100 + s + ks, dtype=dtype)
                    want = tree_sum(tm.row_parallel_partials(x, w, s), 0)
                    got = tsm.row_parallel_nt(x, w, s)
                    assert _same(got, want), (dtype, s, ks)


@check
def column_dx_equals_the_unfused_loop():
    """q, k, v-like projections (32, 12, 12 rows: k/v shards of 1 or 2 rows by floor bounds),
    gate/up-like (two of 40), one projection; 8, 4 and 2 local shards (a TP rank's rows)."""
    with sequential_dot():
        for dtype in (torch.bfloat16, torch.float32):
            for rows in ((32, 12, 12), (40, 40), (48,)):
                dys = [_randn(23, n, seed=i + n, dtype=dtype) for i, n in enumerate(rows)]
                ws = [_randn(n, 27, seed=50 + i + n, dtype=dtype) for i, n in enumerate(rows)]
                for s in (8, 4, 2):
                    # the first s of 8 virtual shards, as TP rank 0 of 8/s holds them
                    sr = [[(a, b) for a, b in virtual_shard_rows(n)[:s]] for n in rows]
                    top = [max(b for _, b in r) for r in sr]
                    d = [dy[:, :t] for dy, t in zip(dys, top)]
                    v = [w[:t] for w, t in zip(ws, top)]
                    assert tsm.fusable([[r[j] for r in sr] for j in range(s)])
                    assert _same(tsm.column_dx(d, v, sr), _unfused(d, v, sr)), (rows, s)


@check
def tiles_change_no_bit():
    with sequential_dot():
        x = _randn(37, 8 * 40, seed=1, dtype=torch.bfloat16)
        w = _randn(45, 8 * 40, seed=2, dtype=torch.bfloat16)
        bounds = [[(j * 40, (j + 1) * 40)] for j in range(8)]
        ref = tsm.shard_tree_matmul(x, w, bounds, b_kmajor=True, tile=SMALL)
        for tile in ((32, 16, 1, 1, 1), (16, 64, 1, 1, 8), (64, 64, 4, 2, 8)):
            got = tsm.shard_tree_matmul(x, w, bounds, b_kmajor=True, tile=tile)
            assert _same(got, ref), tile


@check
def tma_fetches_equal_pointer_loads():
    """16-bit operands with K ranges on BLOCK_K multiples take the flat TMA kernel (one loop over
    every chunk); the nested kernel with TMA (flat=False) and with pointer loads (use_tma=False)
    give the same bytes, row-parallel and column dX; unequal shards take the nested kernel."""
    with sequential_dot():
        x = _randn(37, 8 * 64, seed=5, dtype=torch.bfloat16)
        w = _randn(45, 8 * 64, seed=6, dtype=torch.bfloat16)
        bounds = [[(j * 64, (j + 1) * 64)] for j in range(8)]
        with LaunchRecorder.swapped_in(tsm, "_shard_tree_flat_kernel") as flat:
            auto = tsm.shard_tree_matmul(x, w, bounds, b_kmajor=True, tile=SMALL)
        assert len(flat.launches) == 1, "the flat TMA kernel did not run"
        with LaunchRecorder.swapped_in(tsm, "_shard_tree_kernel") as rec:
            nested = tsm.shard_tree_matmul(x, w, bounds, b_kmajor=True, tile=SMALL, flat=False)
        assert rec.launches[0][1]["TMA"] is True
        plain = tsm.shard_tree_matmul(x, w, bounds, b_kmajor=True, tile=SMALL, use_tma=False)
        assert _same(auto, plain) and _same(nested, plain)
        dys = [_randn(30, 128, seed=7, dtype=torch.bfloat16), _randn(30, 64, seed=8,
                                                                       dtype=torch.bfloat16)]
        ws = [_randn(128, 48, seed=9, dtype=torch.bfloat16), _randn(64, 48, seed=10,
                                                                      dtype=torch.bfloat16)]
        # projection 1's two shards both read its 64 rows, as ranks sharing a KV head may not;
        # any non-empty ranges are a valid input of the kernel
        sr = [[(0, 64), (64, 128)], [(0, 64), (0, 64)]]
        with LaunchRecorder.swapped_in(tsm, "_shard_tree_flat_kernel") as flat:
            a = tsm.column_dx(dys, ws, sr, tile=SMALL)
        assert len(flat.launches) == 1, "the flat TMA kernel did not run"
        b = tsm.column_dx(dys, ws, sr, tile=SMALL, use_tma=False)
        c = tsm.column_dx(dys, ws, sr, tile=SMALL, flat=False)
        assert _same(a, b) and _same(a, c) and _same(a, _unfused(dys, ws, sr))
        # unequal ranges across shards (the flat kernel's period does not exist): nested kernel
        sr = [[(0, 64), (64, 128)], [(0, 64), (0, 128)]]
        assert tsm._flat_period(torch.bfloat16, [[r[j] for r in sr] for j in range(2)]) is None
        dys[1], ws[1] = torch.cat([dys[1], dys[1]], 1), torch.cat([ws[1], ws[1]])
        assert _same(tsm.column_dx(dys, ws, sr, tile=SMALL), _unfused(dys, ws, sr))


@check
def random_configs_equal_the_unfused_loop():
    """12 random configurations — shards 1/2/4/8, 1-3 projections, each projection's shard
    rows either whole 64-row chunks (the flat TMA kernel) or any length (the pointer kernel),
    bf16 or fp32, M and K odd, a random tile — fused == the unfused loop bytewise."""
    rng = torch.Generator().manual_seed(2026)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    with sequential_dot():
        for case in range(12):
            s, p = pick((1, 2, 4, 8)), pick((1, 2, 3))
            dtype = pick((torch.bfloat16, torch.bfloat16, torch.float32))
            whole = bool(pick((True, False)))
            lens = [64 * pick((1, 2)) if whole else pick((1, 5, 17, 40)) for _ in range(p)]
            m, k = pick((1, 9, 33)), pick((8, 24, 40))
            dys = [_randn(m, s * n, seed=100 * case + i, dtype=dtype) for i, n in enumerate(lens)]
            ws = [_randn(s * n, k, seed=100 * case + 50 + i, dtype=dtype)
                  for i, n in enumerate(lens)]
            sr = [[(j * n, (j + 1) * n) for j in range(s)] for n in lens]
            tile = pick((SMALL, (32, 16, 1, 1, 1), (16, 32, 2, 2, 4)))
            got = tsm.column_dx(dys, ws, sr, tile=tile)
            assert _same(got, _unfused(dys, ws, sr)), (case, s, p, dtype, lens, m, k, tile)


@check
def negative_control_sequential_shard_sum_differs():
    """Adding the 8 shard partials left to right gives other bytes on some element, so the
    equality checks above can fail."""
    with sequential_dot():
        x = _randn(64, 8 * 64, seed=3)
        w = _randn(64, 8 * 64, seed=4)
        p = tm.row_parallel_partials(x, w, 8)
        seq = p[0]
        for i in range(1, 8):
            seq = seq + p[i]
        assert not _same(tsm.row_parallel_nt(x, w, 8), seq)


@check
def bad_input_is_refused():
    x, w = torch.randn(4, 64), torch.randn(5, 64)
    cases = [
        lambda: tsm.shard_tree_matmul(x, w, [[(0, 32)], [(32, 32)]], b_kmajor=True),  # empty
        lambda: tsm.shard_tree_matmul(x, w, [[(0, 20)]] * 3, b_kmajor=True),          # S = 3
        lambda: tsm.shard_tree_matmul(x, w, [[(0, 80)]], b_kmajor=True),              # > K
        lambda: tsm.shard_tree_matmul(x, w.t(), [[(0, 64)]], b_kmajor=True),          # shape
        lambda: tsm.shard_tree_matmul(x, w, [[(0, 8)] * 4], b_kmajor=True),           # P = 4
        lambda: tsm.row_parallel_nt(x, w, 3),
        lambda: tsm.column_dx([x], [w], [[(0, 4)]]),                                  # N_i
        lambda: tsm.column_dx([x], [w.t()], [[(0, 70)]]),                             # rows
    ]
    for i, case in enumerate(cases):
        try:
            case()
        except ValueError:
            continue
        raise AssertionError(f"case {i} accepted")
    assert not tsm.fusable([[(0, 4)], [(4, 4)]])
    # the model's dispatch: 16-bit with whole-chunk shards only (qwen3-1.7b's q/k/v and
    # down_proj: yes; an 18,992-row vocab shard, fp32: no)
    qkv = [[(s * 256, s * 256 + 256), (2048 + s * 128, 2048 + s * 128 + 128),
            (3072 + s * 128, 3072 + s * 128 + 128)] for s in range(8)]
    assert tsm.worth_fusing(torch.bfloat16, qkv)
    assert tsm.worth_fusing(torch.bfloat16, [[(s * 768, (s + 1) * 768)] for s in range(8)])
    assert not tsm.worth_fusing(torch.float32, qkv)
    assert not tsm.worth_fusing(torch.bfloat16, [[(s * 18992, (s + 1) * 18992)] for s in range(8)])
    assert tsm.fusable([[(0, 4), (0, 1)], [(4, 8), (1, 2)]])


@check
def flat_kernel_three_projections_of_unequal_lengths():
    """q/k/v-like column dX on the flat TMA kernel: 2 shards of 128, 64 and 64 rows (whole
    BLOCK_K chunks: the period is 4 chunks, the projections end at chunks 2, 3 and 4), so the
    second range's end (E1) is a fold point of its own: (p0 + p1) + p2, not p0 + a p1 chain run
    on into p2; == the unfused loop."""
    with sequential_dot():
        rows = (256, 128, 128)
        dys = [_randn(20, n, seed=60 + n, dtype=torch.bfloat16) for n in rows]
        ws = [_randn(n, 24, seed=70 + n, dtype=torch.bfloat16) for n in rows]
        sr = [virtual_shard_rows(n, 2) for n in rows]
        assert tsm._flat_period(torch.bfloat16, [[r[j] for r in sr] for j in range(2)]) \
            == (4, [2, 3, 4])
        with LaunchRecorder.swapped_in(tsm, "_shard_tree_flat_kernel") as flat:
            got = tsm.column_dx(dys, ws, sr, tile=SMALL)
        assert len(flat.launches) == 1, "the flat TMA kernel did not run"
        assert _same(got, _unfused(dys, ws, sr))


@check
def flat_kernel_bounds_off_zero_or_with_gaps_are_laid_end_to_end():
    """shard_tree_matmul's flat path with whole-chunk ranges that do not start at K = 0, or leave
    a gap: the ranges are copied end to end first; == pointer loads (no copy) and the loop."""
    with sequential_dot():
        x = _randn(19, 256, seed=11, dtype=torch.bfloat16)
        w = _randn(21, 256, seed=12, dtype=torch.bfloat16)
        for bounds in ([[(64, 128)], [(128, 192)]], [[(0, 64)], [(128, 192)]]):
            with LaunchRecorder.swapped_in(tsm, "_shard_tree_flat_kernel") as flat:
                got = tsm.shard_tree_matmul(x, w, bounds, b_kmajor=True, tile=SMALL)
            assert len(flat.launches) == 1, "the flat TMA kernel did not run"
            want = _unfused([x], [w.t()], [[sb[0] for sb in bounds]])
            assert _same(got, want), bounds
            plain = tsm.shard_tree_matmul(x, w, bounds, b_kmajor=True, tile=SMALL, use_tma=False)
            assert _same(got, plain), bounds


@check
def long_row_parallel_shards_take_the_partials_tree():
    """Shards longer than FLAT_MAX_CHUNKS chunks (8 × 576 bf16 columns): the model's
    row-parallel forward is not worth fusing there (worth_fusing(long_shards=False); the
    dispatch check runs it through kernels/matmul.py), while the column dX still is; fused
    anyway (tsm.row_parallel_nt, the flat kernel), the bytes are the pairwise tree's."""
    ks = (tsm.FLAT_MAX_CHUNKS + 1) * tm.BLOCK_K[torch.bfloat16]
    long = [[(s * ks, (s + 1) * ks)] for s in range(8)]
    assert not tsm.worth_fusing(torch.bfloat16, long, long_shards=False)
    assert tsm.worth_fusing(torch.bfloat16, long)
    with sequential_dot():
        x = _randn(5, 8 * ks, seed=13, dtype=torch.bfloat16)
        w = _randn(7, 8 * ks, seed=14, dtype=torch.bfloat16)
        with LaunchRecorder.swapped_in(tsm, "_shard_tree_flat_kernel") as flat:
            got = tsm.row_parallel_nt(x, w, 8)
        assert len(flat.launches) == 1, "the flat kernel did not run"
        p = tm.row_parallel_partials(x, w, 8)
        assert _same(got, tree_sum(p, 0))
        seq = p[0]
        for i in range(1, 8):
            seq = seq + p[i]
        assert not _same(got, seq), "control: the sequential shard sum is not different here"


@check
def odd_bounds_are_neither_fusable_nor_worth_fusing():
    """worth_fusing implies fusable: 3 shards, 4 projections, empty ranges (whole-chunk periods
    of their own) are not worth fusing; shards with different projection counts are refused."""
    for bounds in ([[(0, 64)]] * 3, [[(0, 64)] * 4] * 2, [[(0, 0)], [(0, 0)]],
                   [[(0, 64), (64, 64)], [(64, 128), (128, 128)]]):
        assert not tsm.worth_fusing(torch.bfloat16, bounds), bounds
    ragged = [[(0, 64), (64, 128)], [(128, 192)]]
    assert not tsm.fusable(ragged)
    x, w = torch.randn(4, 192).bfloat16(), torch.randn(5, 192).bfloat16()
    try:
        tsm.shard_tree_matmul(x, w, ragged, b_kmajor=True)
    except ValueError:
        pass
    else:
        raise AssertionError("shards of 2 and 1 ranges accepted")


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA, so that kernels/matmul.py's dispatch (behind
    `x.is_cuda`) runs here; the kernels it picks are stubs (`_dispatch`)."""

    @property
    def is_cuda(self):
        return True


@contextlib.contextmanager
def _dispatch():
    """kernels/matmul.py with every kernel its linears pick stubbed to say which path it is:
    "fused" (triton_shard_matmul's row_parallel_nt / column_dx, chosen by its real
    worth_fusing) or "unfused" (the partials + shard_sum, the per-shard loop)."""
    fused = types.SimpleNamespace(worth_fusing=tsm.worth_fusing,
                                  row_parallel_nt=lambda *a, **k: "fused",
                                  column_dx=lambda *a, **k: "fused")
    stubs = {"_shard_kernel": lambda: fused, "row_parallel_partials": lambda *a: "partials",
             "shard_sum": lambda p: "unfused", "seq_matmul": lambda a, b: "part",
             "tree_combine": lambda parts: "unfused",
             "column_dx_by_shards": lambda *a, **k: "unfused",
             "_triton": lambda: types.SimpleNamespace(column_dx_partials=lambda *a: "partials")}
    real = {k: getattr(mm, k) for k in stubs}
    try:
        for k, v in stubs.items():
            setattr(mm, k, v)
        yield
    finally:
        for k, v in real.items():
            setattr(mm, k, v)


def _column_backward(dys, ws, shard_rows, cd, on_cuda=True):
    """kernels/matmul.py `_ColumnParallelLinear.backward` on a stand-in ctx: dX only."""
    x = torch.zeros(dys[0].shape[0], ws[0].shape[1], dtype=cd)
    x = x.as_subclass(_OnCuda) if on_cuda else x
    ctx = types.SimpleNamespace(saved_tensors=(x, *ws), cd=cd, shard_rows=shard_rows, tok=None,
                                params=ws, needs_input_grad=(True,) + (False,) * (3 + len(ws)))
    return mm._ColumnParallelLinear.backward(ctx, *dys)[0]


@check
def model_linears_dispatch_to_the_fused_tree_where_worth_it():
    """kernels/matmul.py's linears on (stand-in) CUDA tensors call the fused shard tree for bf16
    operands with whole-chunk shards only: row_parallel_nt, column_parallel_dx and the column
    linear's backward (its [P][S] shard rows taken per shard: q/k/v-like); fp32, mixed dtypes,
    ragged chunks, fewer rows than shards (empty shards, which the fused kernel refuses) and CPU
    tensors keep the unfused path."""
    b16, f32 = torch.bfloat16, torch.float32

    def t(*shape, dtype=b16):
        return torch.zeros(*shape, dtype=dtype).as_subclass(_OnCuda)
    with _dispatch():
        assert mm.row_parallel_nt(t(4, 8 * 64), t(3, 8 * 64), 8) == "fused"
        assert mm.row_parallel_nt(t(4, 2 * 64), t(3, 2 * 64), 2) == "fused"
        assert mm.row_parallel_nt(t(4, 8 * 64, dtype=f32), t(3, 8 * 64, dtype=f32), 8) == "unfused"
        assert mm.row_parallel_nt(t(4, 8 * 64), t(3, 8 * 64, dtype=f32), 8) == "unfused"
        assert mm.row_parallel_nt(t(4, 8 * 40), t(3, 8 * 40), 8) == "unfused"
        long = 8 * (tsm.FLAT_MAX_CHUNKS + 1) * 64      # shards past the flat kernel's gain
        assert mm.row_parallel_nt(t(4, long), t(3, long), 8) == "unfused"
        assert mm.column_parallel_dx(t(4, long), t(long, 16)) == "fused"
        assert mm.row_parallel_nt(torch.zeros(4, 512, dtype=b16), torch.zeros(3, 512, dtype=b16),
                                  8) == "unfused"                       # a CPU tensor
        assert mm.column_parallel_dx(t(4, 512), t(512, 16)) == "fused"
        assert mm.column_parallel_dx(t(4, 512, dtype=f32), t(512, 16, dtype=f32)) == "unfused"
        assert mm.column_parallel_dx(t(4, 5), t(5, 16)) == "unfused"    # 3 of 8 shards empty
        assert mm.column_parallel_dx(t(4, 8 * 40), t(8 * 40, 16)) == "unfused"
        rows = (1024, 512, 512)                          # 8 shards of 128, 64, 64 rows
        sr = tuple(virtual_shard_rows(n) for n in rows)
        for cd, want in ((b16, "fused"), (f32, "unfused")):
            dys = [t(4, n, dtype=cd) for n in rows]
            ws = [t(n, 16, dtype=cd) for n in rows]
            assert _column_backward(dys, ws, sr, cd) == want, cd
        cpu = [torch.zeros(4, n, dtype=b16) for n in rows], [torch.zeros(n, 16, dtype=b16)
                                                            for n in rows]
        assert _column_backward(*cpu, sr, b16, on_cuda=False) == "unfused"   # CPU tensors


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
