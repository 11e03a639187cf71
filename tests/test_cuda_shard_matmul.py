"""The fused virtual-TP shard tree (rlkernel/kernels/triton_shard_matmul.py) on the GPU, bf16
(tensor cores) and fp32 operands: the unfused path's bytes (per-shard `bmm` partials, the
projections added in order, the pairwise tree) for the row-parallel forward and the
column-parallel dX at model-like shapes — 8, 4, 2, 1 local shards, q/k/v with k/v shards of
unequal floor-bound rows, ragged K tails, shards short (the flat kernel) and long (the unfused
partials, the nested kernel at LONG_TILE) — for every tile tried, TMA or pointer loads; an output row is the same at
M = 1 and inside a batch of 300 (batch invariance); the column-parallel linear's autograd dX is
the unfused loop's. Negative control: the 8 shard partials summed left to right differ.
Skipped without CUDA. Run on the GPU machine:
    PYTHONPATH=. python3 -m pytest -q tests/test_cuda_shard_matmul.py
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():   # before the Triton modules: CPU installs have no triton
    pytest.skip("needs a CUDA device", allow_module_level=True)

from rlkernel.kernels import matmul as mm  # noqa: E402
from rlkernel.kernels import triton_matmul as tm  # noqa: E402
from rlkernel.kernels import triton_shard_matmul as tsm  # noqa: E402
from rlkernel.numerics.trees import tree_sum  # noqa: E402

DEV = "cuda"
TILES = ((128, 64, 8, 3, 8), (64, 64, 4, 3, 8), (64, 128, 4, 3, 8), (128, 64, 4, 2, 1))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32),
                                              b.contiguous().view(torch.int32))


def _randn(*shape, seed: int, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def _unfused(dys, ws, shard_rows):
    """kernels/matmul.py's column backward loop on the Triton `bmm` chains."""
    return mm.column_dx_by_shards(dys, ws, shard_rows, product=tm.matmul)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,n", [(1000, 2048, 2048), (300, 8 * 100, 777), (64, 6144, 1024)])
def test_row_parallel_fused_is_the_partials_tree(dtype, m, k, n):
    x = _randn(m, k, seed=m + k, dtype=dtype)
    w = _randn(n, k, seed=n, dtype=dtype, scale=k ** -0.5)
    for s in (8, 4, 2, 1):
        want = tree_sum(tm.row_parallel_partials(x, w, s), 0)
        assert _same(tsm.row_parallel_nt(x, w, s), want), s
        assert _same(mm.row_parallel_nt(x, w, s), want), s      # the dispatch takes it
    ks = k // 8
    bounds = [[(j * ks, (j + 1) * ks)] for j in range(8)]
    want = tsm.row_parallel_nt(x, w, 8)
    for tile in TILES:
        for tma in (None, False):   # TMA where _tma_ok allows it, then pointer loads
            got = tsm.shard_tree_matmul(x, w, bounds, b_kmajor=True, tile=tile, use_tma=tma)
            assert _same(got, want), (tile, tma)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,k", [((2048, 1024, 1024), 2048), ((1536, 1536), 1024),
                                    ((6144, 6144), 512), ((96, 12, 12), 130)])
def test_column_dx_fused_is_the_unfused_loop(dtype, rows, k):
    m = 700
    dys = [_randn(m, n, seed=i + n, dtype=dtype) for i, n in enumerate(rows)]
    ws = [_randn(n, k, seed=50 + i + n, dtype=dtype, scale=n ** -0.5) for i, n in enumerate(rows)]
    for s in (8, 4, 2):
        sr = [mm.virtual_shard_rows(n)[:s] for n in rows]     # TP rank 0's local shards
        top = [max(b for _, b in r) for r in sr]
        d = [dy[:, :t] for dy, t in zip(dys, top)]
        v = [w[:t] for w, t in zip(ws, top)]
        want = _unfused(d, v, sr)
        assert _same(tsm.column_dx(d, v, sr), want), s
        if s == 8:
            for tile in TILES:
                for tma in (None, False):   # TMA where _tma_ok allows it, then pointer loads
                    got = tsm.column_dx(d, v, sr, tile=tile, use_tma=tma)
                    assert _same(got, want), (tile, tma)


def test_rows_do_not_depend_on_the_batch():
    x = _randn(300, 2048, seed=3)
    w = _randn(1024, 2048, seed=4, scale=2048 ** -0.5)
    full = tsm.row_parallel_nt(x, w, 8)
    assert _same(tsm.row_parallel_nt(x[:1], w, 8)[0], full[0])
    assert _same(tsm.row_parallel_nt(x[131:200], w, 8), full[131:200])
    dys = [_randn(300, 512, seed=5)]
    ws = [_randn(512, 1024, seed=6, scale=512 ** -0.5)]
    sr = [mm.virtual_shard_rows(512)]
    full = tsm.column_dx(dys, ws, sr)
    assert _same(tsm.column_dx([dys[0][7:8]], ws, sr)[0], full[7])


def test_column_parallel_linear_autograd_dx_is_the_unfused_loop(monkeypatch):
    """The linear's backward (kernels/matmul.py) takes the fused kernel for q/k/v-like weights;
    with the kernel refused (fusable -> False) the old loop runs: the same dX bytes."""
    x = _randn(256, 512, seed=7, dtype=torch.float32)
    ws = [_randn(n, 512, seed=8 + n, scale=512 ** -0.5) for n in (256, 64, 64)]
    dys = [_randn(256, n, seed=20 + n, dtype=torch.float32) for n in (256, 64, 64)]

    def dx() -> torch.Tensor:
        xx = x.clone().requires_grad_(True)
        ys = mm.column_parallel_linear(xx, ws, compute_dtype=torch.bfloat16)
        torch.autograd.backward(ys, dys)
        return xx.grad

    fused = dx()
    monkeypatch.setattr(tsm, "fusable", lambda bounds: False)
    assert _same(dx(), fused)


def test_negative_control_sequential_shard_sum_differs():
    x = _randn(512, 2048, seed=9)
    w = _randn(512, 2048, seed=10, scale=2048 ** -0.5)
    p = tm.row_parallel_partials(x, w, 8)
    seq = p[0]
    for i in range(1, 8):
        seq = seq + p[i]
    assert not _same(tsm.row_parallel_nt(x, w, 8), seq)
