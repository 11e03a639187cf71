"""CUDA attention backward (rlkernel/kernels/triton_attention_bwd.py) on the GPU, fp32 and bf16.

Bitwise, each layout running its own forward as training does: a sample's dQ/dK/dV alone == in a
packed batch with NaN padding; CP zig-zag query leaves over 2 and 4 ranks and a Tq split (two
calls of other Tq) == one call, dK/dV joined by the exact sum over the group; TP ranks sharing a
KV head (kv_comm) == one rank; a decode row's dQ == its prefill row; every tile of the tables and
any chunk size == the defaults; the public attention() autograd == the kernel called directly;
token-major inputs (the model's) == contiguous ones, with out token-major and each gradient laid
out like its input, and dQ rounded by the kernel's store == torch's cast of the fp32 dQ; the
packed-stream entry points (each sample's rows read in place) == the per-sample calls.
Against float64 autograd with a tolerance (fp32: 1e-5·max|ref| per gradient; bf16: relative norm
2e-2, the forward's bf16 output feeds delta). Memory: one 32k-token sample (4 query heads, 1 KV
head, D = 128, fp32) peaks within `peak_bytes` and below a quarter of one fp32 [Tq, Tk] matrix,
its dQ rows / last keys' dK, dV within tolerance of float64.
Negative controls: stock SDPA (flash, bf16) dK of the queries in two halves, added, differs from
the unsplit dK; fp32 sums of the kernel's own leaf partials in two orders differ (the exact sum
does not). The alone-vs-batch SDPA control is in tests/test_cuda_backward.py.
Ranks run one after another (kernel_helpers.run_ranks_sequentially): autograd runs all CUDA
backwards of a device on one thread, and the kernel is called directly here anyway; real NCCL
ranks run in tests/test_cuda_dist.py.
Skipped without CUDA. Run on the GPU machine:
    PYTHONPATH=. python3 -m pytest -q tests/test_cuda_attention_bwd.py
"""

from __future__ import annotations

import functools
import math
import time

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import attention_oracle64, n_diff, run_ranks_sequentially

from rlkernel.distributed.parallel import cp_segments
from rlkernel.distributed.tokensum import TokenSum
from rlkernel.spec import CUDA_DKV_LEAF as TOKEN_LEAF  # the kernel's leaf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = "cuda"
HQ, HKV, D = 8, 2, 128
SCALE = 1.0 / math.sqrt(D)
LENGTHS = [300, 200, 129]
"""Packed samples: none a multiple of 64 or 16, so partial blocks and leaves occur."""
DTYPES = [torch.float32, torch.bfloat16]
NAN = float("nan")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (−0.0 vs +0.0 and NaN payloads count), same shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {4: torch.int32, 2: torch.int16, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert _same(a, b), f"{what}: {n_diff(a.float(), b.float())} of {a.numel()} elements differ"


def _randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, device=DEV, generator=g).to(dtype)


def _pack(lengths, dtype, hq=HQ, hkv=HKV, tk=None, seed=0):
    """Samples as the trainer packs them (each starting at a multiple of TOKEN_LEAF in the
    stream): per-sample padded q/k/v with NaN in every padding slot, q_pos, kv_len, q_idx (stream
    row of each query), the stream length (a multiple of 512 = 2·CP·64 at CP4) and d_out (random everywhere)."""
    s_, tq = len(lengths), max(lengths)
    tk = tk or tq
    q = torch.full((s_, hq, tq, D), NAN, device=DEV, dtype=dtype)
    k = torch.full((s_, hkv, tk, D), NAN, device=DEV, dtype=dtype)
    v = torch.full((s_, hkv, tk, D), NAN, device=DEV, dtype=dtype)
    q_pos = torch.full((s_, tq), -1, dtype=torch.long, device=DEV)
    q_idx = torch.full((s_, tq), -1, dtype=torch.long, device=DEV)
    off = 0
    for i, n in enumerate(lengths):
        q[i, :, :n] = _randn(hq, n, D, seed=seed + 10 * i, dtype=dtype)
        k[i, :, :n] = _randn(hkv, n, D, seed=seed + 10 * i + 1, dtype=dtype)
        v[i, :, :n] = _randn(hkv, n, D, seed=seed + 10 * i + 2, dtype=dtype)
        q_pos[i, :n] = torch.arange(n, device=DEV)
        q_idx[i, :n] = off + torch.arange(n, device=DEV)
        off += -(-n // TOKEN_LEAF) * TOKEN_LEAF
    kv_len = torch.tensor(lengths, device=DEV)
    return q, k, v, q_pos, kv_len, q_idx, -(-off // 512) * 512, _randn(*q.shape, seed=seed + 99,
                                                                       dtype=dtype)


def _grads(q, k, v, q_pos, kv_len, d_out, **kw):
    """(out, dq, dk, dv): the Triton forward, then the Triton backward on its out/lse."""
    from rlkernel.kernels.triton_attention import attention_forward
    from rlkernel.kernels.triton_attention_bwd import attention_backward
    out, lse = attention_forward(q, k, v, q_pos, kv_len, SCALE)
    return (out, *attention_backward(q, k, v, out, lse, d_out, q_pos, kv_len, SCALE, **kw))


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_attention_bwd_vs_float64(dtype):
    """3 packed samples (lengths 300, 200, 129; 320 key slots, NaN past kv_len and in padding):
    dQ/dK/dV vs float64 autograd of the same masked attention. fp32: every element within
    1e-5·max|ref|; bf16: relative norm < 2e-2. Padding query rows and keys past kv_len: +0.0."""
    q, k, v, q_pos, kv_len, _, _, d_out = _pack(LENGTHS, dtype, tk=320, seed=1)
    _, dq, dk, dv = _grads(q, k, v, q_pos, kv_len, d_out)
    ref = attention_oracle64(q, k, v, q_pos, kv_len, d_out, SCALE)
    for got, want in zip((dq, dk, dv), ref[1:]):
        assert got.dtype == dtype and torch.isfinite(got).all()
        if dtype == torch.float32:
            err = float((got.double() - want).abs().max())
            assert err <= 1e-5 * float(want.abs().max()), err
        else:
            assert _rel(got, want) < 2e-2
    pad = (q_pos < 0)[:, None, :, None].expand_as(dq)
    assert bool((dq[pad].float().view(torch.int32) == 0).all())
    past = (torch.arange(320, device=DEV)[None, :] >= kv_len[:, None])[:, None, :, None]
    for t in (dk, dv):
        assert bool((t[past.expand_as(t)].float().view(torch.int32) == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_attention_bwd_sample_alone_equals_sample_in_batch(dtype):
    """Each sample's out/dQ/dK/dV alone (S = 1, Tq = Tk = its length, its own forward) == its rows
    in the padded 3-sample batch, bitwise."""
    q, k, v, q_pos, kv_len, _, _, d_out = _pack(LENGTHS, dtype, seed=2)
    ref = _grads(q, k, v, q_pos, kv_len, d_out)
    for i, n in enumerate(LENGTHS):
        got = _grads(*(t[i:i + 1, :, :n] for t in (q, k, v)), q_pos[i:i + 1, :n],
                     kv_len[i:i + 1], d_out[i:i + 1, :, :n])
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            _assert_same(a[0], b[i, :, :n], f"sample {i} {name}")


def _cp_pos(q_pos, q_idx, sl, cp, r):
    seg = torch.div(q_idx, sl // (2 * cp), rounding_mode="floor")
    mine = torch.isin(seg, torch.tensor(cp_segments(cp, r), device=DEV)) & (q_idx >= 0)
    return torch.where(mine, q_pos, -1)


@pytest.mark.parametrize("dtype,cp,late", [(torch.float32, 2, False), (torch.float32, 4, False),
                                            (torch.bfloat16, 2, False), (torch.bfloat16, 2, True)])
def test_cuda_attention_bwd_cp_zigzag_ranks_give_single_process_bytes(dtype, cp, late):
    """CP = cp ranks, each holding the queries of its zig-zag segments (whole leaves; the others
    padding), every key, tok = the CP group: each rank's dK/dV == the single-process bytes, its
    out/dQ rows == the single-process rows. `late`: each rank's tok holds a late gradient sink
    (the trainer's first pass), so the dK/dV chunks go over the ranks as double words
    (Comm.finish_words) — the same bytes, no late flag counted."""
    from rlkernel.distributed import tokensum
    q, k, v, q_pos, kv_len, q_idx, sl, d_out = _pack(LENGTHS, dtype, seed=3)
    ref = _grads(q, k, v, q_pos, kv_len, d_out)
    pos = [_cp_pos(q_pos, q_idx, sl, cp, r) for r in range(cp)]

    def rank(r, c):
        sink = None
        if late:
            sink = tokensum.GradSink({"dp_cp": c, "world": c})
            sink.begin({}, late=True)
        got = _grads(q, k, v, pos[r], kv_len, d_out, tok=TokenSum(c, sink=sink))
        assert sink is None or int(sink.late_counter(q.device)) == 0
        return got
    res = run_ranks_sequentially(cp, rank)
    for r, (out, dq, dk, dv) in enumerate(res):
        sel = (pos[r] >= 0)[:, None, :, None].expand_as(dq)
        assert bool(sel.any())
        _assert_same(out[sel], ref[0][sel], f"rank {r} out")
        _assert_same(dq[sel], ref[1][sel], f"rank {r} dq")
        _assert_same(dk, ref[2], f"rank {r} dk")
        _assert_same(dv, ref[3], f"rank {r} dv")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_attention_bwd_tq_split_gives_the_full_bytes(dtype):
    """One 300-token sample's queries in two calls, [0, 128) (Tq 128) and [128, 300) (slot t =
    position 128 + t), every key in both, exact sums joined over a 2-rank group: dK/dV == the
    one-call bytes, out/dQ == its rows."""
    q, k, v, q_pos, kv_len, _, _, d_out = _pack([300], dtype, seed=4)
    ref = _grads(q, k, v, q_pos, kv_len, d_out)
    cuts = [(0, 128), (128, 300)]

    def part(r, comm):
        a, b = cuts[r]
        return _grads(q[:, :, a:b], k, v, q_pos[:, a:b], kv_len, d_out[:, :, a:b],
                      tok=TokenSum(comm))

    for (a, b), (out, dq, dk, dv) in zip(cuts, run_ranks_sequentially(2, part)):
        _assert_same(out, ref[0][:, :, a:b], "out")
        _assert_same(dq, ref[1][:, :, a:b], "dq")
        _assert_same(dk, ref[2], "dk")
        _assert_same(dv, ref[3], "dv")


@pytest.mark.parametrize("tp,hq", [(2, 4), (4, 4), (2, 12), (4, 12)])
def test_cuda_attention_bwd_kv_head_replicated_over_tp_ranks(tp, hq):
    """One KV head shared by hq query heads, TP = tp ranks with hq/tp heads each and kv_comm over
    them (12 heads: 6 + 6 or 3 + 3 + 3 + 3, the halving tree's parts): every rank's dK/dV ==
    single-process bytes, its heads' out/dQ == the matching rows (fp32)."""
    q, k, v, q_pos, kv_len, _, _, d_out = _pack(LENGTHS, torch.float32, hq=hq, hkv=1, seed=5)
    ref = _grads(q, k, v, q_pos, kv_len, d_out)
    per = hq // tp

    def rank(r, comm):
        h = slice(r * per, (r + 1) * per)
        return _grads(q[:, h], k, v, q_pos, kv_len, d_out[:, h], kv_comm=comm)

    for r, (out, dq, dk, dv) in enumerate(run_ranks_sequentially(tp, rank)):
        h = slice(r * per, (r + 1) * per)
        _assert_same(out, ref[0][:, h], "out")
        _assert_same(dq, ref[1][:, h], "dq")
        _assert_same(dk, ref[2], "dk")
        _assert_same(dv, ref[3], "dv")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_attention_bwd_decode_row_dq_equals_prefill_row(dtype):
    """The query at position p alone (Tq 1; a 384-slot KV cache, NaN past kv_len = p + 1; its own
    forward) has the out and dQ bytes of its row in the prefill, p in 0, 63, 64, 65, 200, 299."""
    q, k, v, q_pos, kv_len, _, _, d_out = _pack([300], dtype, seed=6)
    ref = _grads(q, k, v, q_pos, kv_len, d_out)
    for p in (0, 63, 64, 65, 200, 299):
        kc = torch.full((1, HKV, 384, D), NAN, device=DEV, dtype=dtype)
        vc = torch.full((1, HKV, 384, D), NAN, device=DEV, dtype=dtype)
        kc[:, :, :p + 1], vc[:, :, :p + 1] = k[:, :, :p + 1], v[:, :, :p + 1]
        row = slice(p, p + 1)
        out, dq, _, _ = _grads(q[:, :, row], kc, vc, q_pos[:, row],
                               torch.tensor([p + 1], device=DEV), d_out[:, :, row])
        _assert_same(out, ref[0][:, :, row], f"out {p}")
        _assert_same(dq, ref[1][:, :, row], f"dq {p}")


_EXTRA_DQ_TILES = {torch.float32: [(16, 4, 1), (32, 4, 1), (64, 8, 1)],
                   torch.bfloat16: [(64, 8, 1), (128, 8, 1)]}
# (BLOCK_N keys, D_TILE columns, warps, stages). bf16 keeps key tiles of whole 64-row wgmma
# tiles (the key tile is the M of every dK/dV dot); a 128-key tile may straddle a chunk's end.
_EXTRA_KV_TILES = {torch.float32: [(64, 64, 8, 1), (32, 128, 4, 1), (64, 128, 4, 2),
                                   (128, 64, 8, 1)],
                   torch.bfloat16: [(64, 64, 8, 1), (64, 128, 8, 1), (64, 128, 4, 2),
                                    (128, 128, 8, 1)]}


def _tile_variants(dtype) -> list[tuple[str, object]]:
    """(keyword, value) cases of the every-tile test; "dq_table" stands for every dQ tile of
    the kernel's own table (read at run time: the module needs Triton)."""
    cases = [("dq_table", None)]
    cases += [("dq_tile", cfg) for cfg in _EXTRA_DQ_TILES[dtype]]
    cases += [("kv_tile", cfg) for cfg in _EXTRA_KV_TILES[dtype]]
    # Chunks of one 64-key block of one sample, then of one block of every sample.
    return cases + [("words_elems", HQ * D * 64), ("words_elems", HQ * D * 64 * len(LENGTHS)),
                    ("force_flag", True)]


_TILE_CASES = [(dt, name, value) for dt in DTYPES for name, value in _tile_variants(dt)]


@functools.cache
def _tile_case_ref(dtype):
    """The packed batch of the every-tile test and its default-tile grads (one per dtype)."""
    q, k, v, q_pos, kv_len, _, _, d_out = _pack(LENGTHS, dtype, seed=7)
    return (q, k, v, q_pos, kv_len, d_out), _grads(q, k, v, q_pos, kv_len, d_out)


@pytest.mark.parametrize("dtype,name,value", _TILE_CASES,
                         ids=[f"{str(dt).split('.')[1]}-{n}-{v}" for dt, n, v in _TILE_CASES])
def test_cuda_attention_bwd_every_tile_and_chunk_size_gives_the_same_bits(dtype, name, value):
    """Every dQ tile of the table and a few others (bf16: BLOCK_M >= 64, warps % 4 == 0, the
    forward's rule), dK/dV tiles with other key / column tiles (128-key tiles past a chunk's
    end), warps and stages, chunks of the double words down to one 64-key block of one sample,
    and every dK/dV program through the per-leaf fallback (force_flag): the default bytes. One
    case per test, so a GPU call cut short still reports the cases it ran (each compiles)."""
    from rlkernel.kernels import triton_attention_bwd as tb
    (q, k, v, q_pos, kv_len, d_out), ref = _tile_case_ref(dtype)
    variants = [{"dq_tile": cfg} for _, cfg in tb._DQ_TILES[dtype]] if name == "dq_table" \
        else [{name: value}]
    for kw in variants:
        got = _grads(q, k, v, q_pos, kv_len, d_out, **kw)
        for what, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            _assert_same(a, b, f"{kw} {what}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_attention_bwd_retry_tier_keeps_the_fallback_bytes(dtype):
    """A d_out spread over 2**-60..1 (one random scale per 64-query leaf) makes many first-pass
    dK/dV adds inexact in one float64 word: those programs take the checked (hi, lo) retry, and
    the result equals every program through the per-leaf fallback (force_flag), bitwise. The
    control: the first pass did flag programs here (else the retry was not exercised), and
    fewer flags reach the fallback than the first pass raised."""
    from rlkernel.kernels import triton_attention_bwd as tb
    q, k, v, q_pos, kv_len, _, _, d_out = _pack(LENGTHS, dtype, seed=11)
    g = torch.Generator(device=DEV).manual_seed(5)
    leaves = -(-d_out.shape[2] // TOKEN_LEAF)
    scale = torch.exp2(-torch.randint(0, 61, (d_out.shape[0], 1, leaves, 1), generator=g,
                                      device=DEV).float())
    d_out = (d_out.float() * scale.repeat_interleave(TOKEN_LEAF, 2)[:, :, :d_out.shape[2]]) \
        .to(dtype)
    first, redone, real_launch, real_redo = [], [], tb._launch_dkv, tb._redo_flagged

    def spy_launch(*a, **kw):
        real_launch(*a, **kw)
        if not a[12] and not (a[14] if len(a) > 14 else kw.get("retry", False)):
            first.append(int(a[2].sum()))

    def spy_redo(a, flagged, *rest, **kw):
        redone.append(flagged.numel())
        return real_redo(a, flagged, *rest, **kw)

    tb._launch_dkv, tb._redo_flagged = spy_launch, spy_redo
    try:
        got = _grads(q, k, v, q_pos, kv_len, d_out)
    finally:
        tb._launch_dkv, tb._redo_flagged = real_launch, real_redo
    ref = _grads(q, k, v, q_pos, kv_len, d_out, force_flag=True)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        _assert_same(a, b, name)
    assert sum(first) > 0, "no first-pass program was flagged: the retry tier went untested"
    assert sum(redone) < sum(first), (first, redone)


def test_cuda_autograd_attention_runs_the_triton_backward():
    """kernels/attention.attention on CUDA tensors: autograd's dQ/dK/dV == attention_backward
    called directly on the forward's out/lse, bitwise (fp32, packed batch)."""
    from rlkernel.kernels.attention import attention
    q, k, v, q_pos, kv_len, _, _, d_out = _pack(LENGTHS, torch.float32, seed=8)
    ref = _grads(q, k, v, q_pos, kv_len, d_out)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = attention(qq, kk, vv, q_pos, kv_len, SCALE)
    out.backward(d_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out.detach(), qq.grad, kk.grad, vv.grad),
                          ref):
        _assert_same(a, b, name)


def test_cuda_attention_bwd_32k_tokens_memory_and_accuracy():
    """One 32768-token sample, 4 query heads, 1 KV head, D = 128, fp32: the backward's peak extra
    memory (torch.cuda.max_memory_allocated over the call) is within `peak_bytes` and below a
    quarter of one fp32 [Tq, Tk] matrix (4 GiB); dQ of the last 64 queries and dK/dV of the last
    64 keys (every query that sees them) within 1e-5·max|ref| of float64. Prints time and peak."""
    from rlkernel.kernels import triton_attention_bwd as tb
    from rlkernel.kernels.triton_attention import attention_forward
    t, hq = 32768, 4
    q, k, v = (_randn(1, h, t, D, seed=20 + i) for i, h in enumerate((hq, 1, 1)))
    d_out = _randn(1, hq, t, D, seed=23)
    q_pos = torch.arange(t, device=DEV)[None]
    kv_len = torch.tensor([t], device=DEV)
    out, lse = attention_forward(q, k, v, q_pos, kv_len, SCALE)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    dq, dk, dv = tb.attention_backward(q, k, v, out, lse, d_out, q_pos, kv_len, SCALE)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    bound = tb.peak_bytes(1, hq, 1, t, t, D, t // TOKEN_LEAF)
    print(f"\n32k backward: {secs:.3f} s, peak extra {peak / 2**30:.3f} GiB "
          f"(bound {bound / 2**30:.3f} GiB; one [Tq, Tk] fp32 matrix {t * t * 4 / 2**30:.0f} GiB)")
    assert peak <= bound, (peak, bound)
    assert peak < t * t * 4 // 4
    # float64 references that need only a slice: the last 64 queries see every key; the last 64
    # keys are seen only by the last 64 queries.
    w = 64
    q64, k64, v64 = q[0, :, -w:].double(), k[0, 0].double(), v[0, 0].double()
    s = q64 @ k64.T * SCALE                                                  # [hq, w, t]
    s = s.masked_fill(torch.arange(t, device=DEV)[None, None, :]
                      > torch.arange(t - w, t, device=DEV)[None, :, None], float("-inf"))
    p = torch.softmax(s, -1)
    g = d_out[0, :, -w:].double()
    dp = g @ v64.T
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    want = {"dq": (ds @ k64) * SCALE, "dk": torch.einsum("hqj,hqd->jd", ds[..., -w:], q64) * SCALE,
            "dv": torch.einsum("hqj,hqd->jd", p[..., -w:], g)}
    got = {"dq": dq[0, :, -w:], "dk": dk[0, 0, -w:], "dv": dv[0, 0, -w:]}
    for name, ref in want.items():
        err = float((got[name].double() - ref).abs().max())
        assert err <= 1e-5 * float(ref.abs().max()), (name, err)


def test_cuda_negative_control_stock_sdpa_dk_of_two_query_halves_differs():
    """Negative control for the CP / Tq-split tests: torch SDPA (flash, bf16) dK of the queries
    in two halves (d_out zeroed outside each half), added, != the dK of all queries at once."""
    q, k, v = (_randn(1, 8, 1024, D, seed=30 + i, dtype=torch.bfloat16) for i in range(3))
    d_out = _randn(1, 8, 1024, D, seed=33, dtype=torch.bfloat16)

    def dk(rows):
        kk = k.clone().requires_grad_()
        g = torch.zeros_like(d_out)
        g[:, :, rows] = d_out[:, :, rows]
        F.scaled_dot_product_attention(q, kk, v, is_causal=True).backward(g)
        return kk.grad.float()

    assert n_diff(dk(slice(0, 512)) + dk(slice(512, 1024)), dk(slice(0, 1024))) > 0


def test_cuda_negative_control_fp32_sum_of_leaf_partials_depends_on_order():
    """The kernel's own leaf partials (fp32, packed batch): their exact sum is the same in leaf
    order and reversed, and equals the backward's dK/dV before the head tree; a plain fp32 sum in
    the two orders differs (so an order-dependent reduction would fail the CP test)."""
    from rlkernel.kernels import triton_attention_bwd as tb
    from rlkernel.kernels.triton_attention import attention_forward
    from rlkernel.numerics import fixedpoint as fx
    from rlkernel.numerics.trees import tree_sum_halving
    q, k, v, q_pos, kv_len, _, _, d_out = _pack(LENGTHS, torch.float32, seed=9)
    out, lse = attention_forward(q, k, v, q_pos, kv_len, SCALE)
    _, dk, dv = tb.attention_backward(q, k, v, out, lse, d_out, q_pos, kv_len, SCALE)
    s_, hq, tq, _ = q.shape
    tk = k.shape[2]
    part = tb.leaf_partials(q, k, v, out, lse, d_out, q_pos, kv_len, SCALE)
    n_leaves = part.shape[0]
    exact = fx.exact_sum_fp32(part)
    _assert_same(fx.exact_sum_fp32(part.flip(0)), exact, "exact sum reversed")
    heads = tree_sum_halving(exact.view(2, s_, HKV, hq // HKV, tk, D), 3)
    _assert_same(heads[0] * SCALE, dk, "dk")
    _assert_same(heads[1], dv, "dv")
    fwd, rev = torch.zeros_like(exact), torch.zeros_like(exact)
    for i in range(n_leaves):
        fwd = fwd + part[i]
        rev = rev + part[n_leaves - 1 - i]
    assert n_diff(fwd, rev) > 0


def _token_major(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def test_cuda_token_major_layout_and_the_bf16_dq_store_change_no_bit():
    """bf16, 3 packed samples: q/k/v/d_out laid out token-major (the model's view of the token
    stream) give the contiguous inputs' out, dQ, dK, dV bitwise, out is token-major in memory and
    each gradient laid out like its input; dQ rounded to bf16 by the kernel's store == the fp32
    dQ rounded by torch's cast (both round to nearest even). Control: the fp32 dQ has bits past
    bf16."""
    from rlkernel.kernels import triton_attention_bwd as tb
    from rlkernel.kernels.triton_attention import attention_forward
    q, k, v, q_pos, kv_len, _, _, d_out = _pack(LENGTHS, torch.bfloat16, seed=7)
    runs = []
    for args in ((q, k, v, d_out), tuple(_token_major(t) for t in (q, k, v, d_out))):
        res = _grads(*args[:3], q_pos, kv_len, args[3])
        assert res[0].transpose(1, 2).is_contiguous()
        assert all(g.stride() == a.stride() for g, a in zip(res[1:], args[:3]))
        runs.append(res)
    for a, b, what in zip(*runs, ("out", "dq", "dk", "dv")):
        _assert_same(a, b, what)
    out, lse = attention_forward(q, k, v, q_pos, kv_len, SCALE)
    delta = tb._delta(out, d_out, q_pos)
    args = (q, k, v, d_out, lse.reshape(q.shape[0], HQ, -1), delta, q_pos, kv_len, SCALE, None)
    dq32, dq16 = tb._dq(*args), tb._dq(*args, torch.bfloat16)
    _assert_same(dq16, dq32.bfloat16(), "dq store vs torch cast")
    assert n_diff(dq32, dq16.float()) > 0


def _stream(x: torch.Tensor, idx: torch.Tensor, n_rows: int) -> torch.Tensor:
    """x [S, H, T, D] as a token stream [n_rows, H, D] (slot (s, t) at row idx[s, t] >= 0), NaN
    in every other row: a kernel that read one would poison its result."""
    out = torch.full((n_rows, x.shape[1], x.shape[3]), NAN, dtype=x.dtype, device=DEV)
    s_i, t_i = (idx >= 0).nonzero(as_tuple=True)
    out[idx[s_i, t_i]] = x[s_i, :, t_i]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_packed_streams_give_the_per_sample_bytes(dtype):
    """The packed-stream entry points (each sample's rows of the token streams read and written
    in place: attention_forward_packed / attention_backward_packed) on 3 samples, the query
    stream packed in reverse order and the key stream in sample order (k_rows != q_rows), NaN
    in every row no slot names, the row maps column views of the slot maps (stride Tq): out,
    lse, dQ, dK, dV == the per-sample calls' bytes at their rows and +0.0 in every other row,
    with the real tile tables; and through kernels/attention.attention_packed's autograd.
    Control: key rows one off differ."""
    from rlkernel.kernels.attention import attention_packed
    from rlkernel.kernels.triton_attention import attention_forward, attention_forward_packed
    from rlkernel.kernels.triton_attention_bwd import attention_backward_packed
    lengths = [320, 64, 200]          # the 64-token sample's empty slots name the 320's rows
    q, k, v, q_pos, kv_len, k_idx, n_k, d_out = _pack(lengths, dtype, seed=11)
    idx = torch.full_like(q_pos, -1)
    off = 0
    for s_ in reversed(range(len(lengths))):
        idx[s_, :lengths[s_]] = off + torch.arange(lengths[s_], device=DEV)
        off += -(-lengths[s_] // TOKEN_LEAF) * TOKEN_LEAF
    n = off + TOKEN_LEAF
    rows, k_rows = idx[:, 0], k_idx[:, 0]
    assert not rows.is_contiguous() and bool((rows != k_rows).any())
    qs, gs = _stream(q, idx, n), _stream(d_out, idx, n)
    ks, vs = _stream(k, k_idx, n_k), _stream(v, k_idx, n_k)
    out, lse = attention_forward(q, k, v, q_pos, kv_len, SCALE)
    from rlkernel.kernels.triton_attention_bwd import attention_backward
    want = (out, *attention_backward(q, k, v, out, lse, d_out, q_pos, kv_len, SCALE))
    out_p, lse_p = attention_forward_packed(qs, ks, vs, rows, k_rows, q_pos, kv_len, q.shape[2],
                                            SCALE)
    _assert_same(lse_p, lse, "lse")
    got = (out_p, *attention_backward_packed(qs, ks, vs, out_p, lse_p, gs, rows, k_rows, q_pos,
                                             kv_len, q.shape[2], SCALE))
    qq, kk, vv = (t.clone().requires_grad_() for t in (qs, ks, vs))
    o_auto = attention_packed(qq, kk, vv, rows, k_rows, q_pos, kv_len, q.shape[2], SCALE)
    o_auto.backward(gs)
    for what, a, b, c, at in zip(("out", "dq", "dk", "dv"), got, want,
                                 (o_auto.detach(), qq.grad, kk.grad, vv.grad),
                                 (idx, idx, k_idx, k_idx)):
        named = torch.zeros(a.shape[0], dtype=torch.bool, device=DEV)
        named[at[at >= 0]] = True
        s_i, t_i = (at >= 0).nonzero(as_tuple=True)
        _assert_same(a[at[s_i, t_i]], b[s_i, :, t_i], what)
        assert bool((a[~named].float().view(torch.int32) == 0).all()), f"{what}: not +0.0"
        _assert_same(c, a, f"{what} through autograd")
    assert int((k_rows + kv_len).max()) < n_k                # k_rows + 1 stays in the stream
    off1 = attention_forward_packed(qs.nan_to_num(), ks.nan_to_num(), vs.nan_to_num(), rows,
                                    k_rows + 1, q_pos, kv_len, q.shape[2], SCALE)[0]
    base = attention_forward_packed(qs.nan_to_num(), ks.nan_to_num(), vs.nan_to_num(), rows,
                                    k_rows, q_pos, kv_len, q.shape[2], SCALE)[0]
    assert n_diff(off1.float(), base.float()) > 0
