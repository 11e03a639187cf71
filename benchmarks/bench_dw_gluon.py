"""A Gluon version of the dW first pass (issue 11, item 1; measured, not used by the model):
each leaf's wgmma issued asynchronously and the previous leaf's exact float64 adds done while
it runs, against the Triton kernel (rlkernel/kernels/triton_grad_weight.py `_dw_kernel`, TMA
tiles: the production first pass) and cuBLAS, in one process, on the same bf16 operands.

The kernel below computes exactly the Triton first pass (not EMIT, not RETRY, TMA operands): per
output tile [BLOCK_N, BLOCK_K] and 128-token leaf the partial p = dot(dyᵀ, x) — one chain of
wgmma k16 steps, fp32 accumulation, k ascending, the instructions `tl.dot` emits for that tile —
then hi += p in float64 checked exact (else NaN, as triton_fixedpoint.add_exact_or_nan); a tile
whose adds were all exact writes (hi, 0) and flag 0, any other zeros (CARRY: its words
untouched) and flag 1. Operand tiles come by TMA into a ring of STAGES shared buffers. No
accumulator of a dot in flight is carried by the loop: ptxas serializes the wgmma chain when a
phi copies one (warning C7514); the partial a loop iteration carries is always complete.

Before timing, every case checks Gluon == Triton, words (as int64) and flags: gradient-like
operands, edge tiles, one leaf, a quarter of the tokens scaled 2**-40 in half of dy's columns
(those tiles flag), a carried sum (with and without flags), every tile forced. Prints JSON.
Needs an sm_90 GPU and Triton's Gluon (Triton >= 3.5). Usage:
    PYTHONPATH=. python3 benchmarks/bench_dw_gluon.py [--tokens 16384] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from benchmarks.common import dump, env, median_ms, require_cuda
from rlkernel.kernels import triton_grad_weight as tgw
from rlkernel.spec import CUDA_TOKEN_LEAF

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:        # an older Triton: main() refuses to run
    HAVE_GLUON = False


STAGES = 3          # shared-memory ring of leaf operand tiles (speed only)
WARPS = 4           # one warpgroup: wgmma's M = 64 rows of the tile

if HAVE_GLUON:
    @gluon.jit
    def _add_exact_or_nan(hi, p):
        # triton_fixedpoint.add_exact_or_nan on a fp32 partial: the same float64 operations
        p64 = p.to(gl.float64)
        t = hi + p64
        return gl.where(((t - hi) != p64) | ((t - p64) != hi), float("nan"), t)

    @gluon.jit
    def _refill(ad, bd, a_s, b_s, bars, done, STAGES: gl.constexpr, n_leaves, pn, pk,
                LEAF: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        # Leaf `done`'s dot has completed: its stage takes leaf done + STAGES, if any.
        s = done % STAGES
        ahead = done + STAGES
        live = ahead < n_leaves
        mbarrier.expect(bars.index(s), ad.block_type.nbytes + bd.block_type.nbytes, pred=live)
        tma.async_copy_global_to_shared(ad, [ahead * LEAF, pn * BLOCK_N], bars.index(s),
                                        a_s.index(s), pred=live)
        tma.async_copy_global_to_shared(bd, [ahead * LEAF, pk * BLOCK_K], bars.index(s),
                                        b_s.index(s), pred=live)

    @gluon.jit
    def _first_pass_kernel(ad, bd, OUT, FLAGS, L, N, K, s_ow,
                           BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, LEAF: gl.constexpr,
                           STAGES: gl.constexpr, CARRY: gl.constexpr,
                           FORCE_FLAG: gl.constexpr):
        # ad: TMA descriptor of dy [L, N], block [LEAF, BLOCK_N]; bd: of x [L, K], block
        # [LEAF, BLOCK_K]. OUT: [2, N, K] float64 words (hi at OUT, lo at OUT + s_ow).
        tile = gl.program_id(0)
        num_k = gl.cdiv(K, BLOCK_K)
        pn = tile // num_k
        pk = tile % num_k
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_K, 16])
        a_s = gl.allocate_shared_memory(ad.dtype, [STAGES, LEAF, BLOCK_N], ad.layout)
        b_s = gl.allocate_shared_memory(bd.dtype, [STAGES, LEAF, BLOCK_K], bd.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        n_leaves = L // LEAF
        nbytes: gl.constexpr = ad.block_type.nbytes + bd.block_type.nbytes
        for i in gl.static_range(STAGES):          # the ring's first fill
            live = i < n_leaves
            mbarrier.expect(bars.index(i), nbytes, pred=live)
            tma.async_copy_global_to_shared(ad, [i * LEAF, pn * BLOCK_N], bars.index(i),
                                            a_s.index(i), pred=live)
            tma.async_copy_global_to_shared(bd, [i * LEAF, pk * BLOCK_K], bars.index(i),
                                            b_s.index(i), pred=live)

        rows = pn * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        cols = pk * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, mma))
        o = OUT + rows.to(gl.int64)[:, None] * K + cols[None, :]
        m = (rows < N)[:, None] & (cols < K)[None, :]
        if CARRY:
            hi = gl.load(o, mask=m, other=0.0)
            lo = gl.load(o + s_ow, mask=m, other=0.0)
        else:
            hi = gl.zeros([BLOCK_N, BLOCK_K], gl.float64, mma)
        zero = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, mma)

        mbarrier.wait(bars.index(0), 0)
        p = warpgroup_mma(a_s.index(0).permute((1, 0)), b_s.index(0), zero, use_acc=False)
        _refill(ad, bd, a_s, b_s, bars, 0, STAGES, n_leaves, pn, pk, LEAF, BLOCK_N, BLOCK_K)
        for i in range(1, n_leaves):
            s = i % STAGES
            mbarrier.wait(bars.index(s), (i // STAGES) & 1)
            # Leaf i's dot runs on the tensor cores while leaf i - 1's partial p is added. No
            # accumulator of a dot in flight is carried by the loop (ptxas would serialize the
            # wgmma for the phi's copy of it): p is always a completed partial.
            tok = warpgroup_mma(a_s.index(s).permute((1, 0)), b_s.index(s), zero,
                                use_acc=False, is_async=True)
            hi = _add_exact_or_nan(hi, p)
            p = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
            _refill(ad, bd, a_s, b_s, bars, i, STAGES, n_leaves, pn, pk, LEAF, BLOCK_N, BLOCK_K)
        hi = _add_exact_or_nan(hi, p)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        # NaN (an inexact add, a non-finite partial) and |hi| >= 2**150 fail this test.
        top = gl.full([], (1023 + 150) << 52, gl.int64).to(gl.float64, bitcast=True)
        bad = (gl.abs(hi) < top) == 0
        n_bad = gl.sum(gl.sum(bad.to(gl.int32), 1), 0)
        good = (n_bad == 0) & (FORCE_FLAG == 0)
        if CARRY:
            gl.store(o, hi, mask=m & good)
            gl.store(o + s_ow, lo, mask=m & good)
        else:
            gl.store(o, gl.where(good, hi, 0.0), mask=m)
            gl.store(o + s_ow, gl.zeros([BLOCK_N, BLOCK_K], gl.float64, mma), mask=m)
        gl.store(FLAGS + tile, (good == 0).to(gl.int32))


def descriptors(a: torch.Tensor, b: torch.Tensor, tile):
    """Gluon TMA descriptors of dy [L, N] (block [LEAF, BLOCK_N]) and x [L, K] (block [LEAF,
    BLOCK_K]) with their default NVMMA shared layouts."""
    bn, bk = tile[0], tile[1]
    dt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    la = gl.NVMMASharedLayout.get_default_for([CUDA_TOKEN_LEAF, bn], dt)
    lb = gl.NVMMASharedLayout.get_default_for([CUDA_TOKEN_LEAF, bk], dt)
    return (TensorDescriptor.from_tensor(a, [CUDA_TOKEN_LEAF, bn], la),
            TensorDescriptor.from_tensor(b, [CUDA_TOKEN_LEAF, bk], lb))


def first_pass(a, b, out, flags, grid, tile, force_flag: bool, carry: bool, desc=None,
               stages: int = STAGES) -> None:
    """Launch the first pass over `grid` tiles (BLOCK_N = 64, 4 warps; 16-bit TMA-aligned a, b):
    out [2, N, K] float64 words, flags [tiles] int32, as `triton_grad_weight._launch(...,
    emit=False)` with TMA operands does. `desc`: `descriptors(a, b, tile)` made once for
    several launches; `stages` the ring's depth (speed only)."""
    bn, bk = tile[0], tile[1]
    ad, bd = desc if desc is not None else descriptors(a, b, tile)
    _first_pass_kernel[grid](ad, bd, out, flags, a.shape[0], a.shape[1], b.shape[1],
                             out.stride(0), BLOCK_N=bn, BLOCK_K=bk, LEAF=CUDA_TOKEN_LEAF,
                             STAGES=stages, CARRY=carry, FORCE_FLAG=int(force_flag),
                             num_warps=WARPS, enable_fp_fusion=False)


def _operands(tokens: int, n: int, k: int, seed: int, tiny: float = 0.0):
    """bf16 dy [T, N] (a per-token scale of 2**-12..2**2, as a loss's gradients), x [T, K]; with
    `tiny`, the first quarter of the tokens scaled by it in the first half of dy's columns (a
    sample whose gradients are tiny: those tiles flag)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.exp2(torch.randint(-12, 3, (tokens, 1), generator=g, device="cuda").float())
    dy = torch.randn(tokens, n, generator=g, device="cuda") * scale
    if tiny:
        dy[: tokens // 4, : n // 2] *= tiny
    x = torch.randn(tokens, k, generator=g, device="cuda")
    return dy.to(torch.bfloat16), x.to(torch.bfloat16)


def _pass(a, b, tile, gluon: bool, words=None, force=False, stages=STAGES):
    """(words [2, N, K] float64, flags [tiles] int32) of one first pass (carried when words)."""
    n, k = a.shape[1], b.shape[1]
    tiles = triton.cdiv(n, tile[0]) * triton.cdiv(k, tile[1])
    carry = words is not None
    out = words.clone() if carry else torch.empty(2, n, k, dtype=torch.float64, device="cuda")
    flags = torch.empty(tiles, dtype=torch.int32, device="cuda")
    if gluon:
        first_pass(a, b, out, flags, (tiles,), tile, force, carry, stages=stages)
    else:
        tgw._launch(a, b, out, flags, flags, (tiles,), tile, False, force, carry=carry)
    return out, flags


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.view(torch.int64) if x.dtype == torch.float64 else x,
                       y.view(torch.int64) if y.dtype == torch.float64 else y)


def check(tile) -> list[dict]:
    """Gluon == Triton (words and flags, bitwise) over the cases of the module doc."""
    rows = []
    cases = [("gradient-like", 2048, 512, 640, 0.0, False, False),
             ("odd shape", 384, 200, 72, 0.0, False, False),
             ("one leaf", 128, 128, 64, 0.0, False, False),
             ("tiny sample 2**-40", 1024, 256, 256, 2.0 ** -40, False, False),
             ("carried", 1024, 256, 320, 0.0, True, False),
             ("carried, tiny", 1024, 256, 320, 2.0 ** -40, True, False),
             ("forced", 512, 256, 128, 0.0, False, True)]
    for name, t, n, k, tiny, carry, force in cases:
        a, b = _operands(t, n, k, seed=len(rows), tiny=tiny)
        start = None
        if carry:
            a0, b0 = _operands(t, n, k, seed=100 + len(rows))
            start, _ = _pass(a0, b0, tile, False)
        wg, fg = _pass(a, b, tile, True, start, force)
        wt, ft = _pass(a, b, tile, False, start, force)
        row = {"case": name, "tokens": t, "n": n, "k": k, "same_words": _same(wg, wt),
               "same_flags": _same(fg, ft), "flagged": int(ft.sum())}
        rows.append(row)
    return rows


def timing(tokens: int, tile) -> list[dict]:
    """Median ms of one first pass (outputs preallocated) per shape; cuBLAS dyᵀ·x for scale."""
    rows = []
    for n, k in ((6144, 2048), (2048, 6144), (2048, 2048)):
        a, b = _operands(tokens, n, k, seed=7)
        tiles = triton.cdiv(n, tile[0]) * triton.cdiv(k, tile[1])
        out = torch.empty(2, n, k, dtype=torch.float64, device="cuda")
        flags = torch.empty(tiles, dtype=torch.int32, device="cuda")
        desc = descriptors(a, b, tile)
        row = {"tokens": tokens, "n": n, "k": k,
               "same": all(_same(u, v) for u, v in zip(_pass(a, b, tile, True),
                                                      _pass(a, b, tile, False))),
               "cublas_ms": median_ms(lambda: a.t() @ b),
               "triton_ms": median_ms(lambda: tgw._launch(a, b, out, flags, flags, (tiles,),
                                                          tile, False, False))}
        for st in (2, 3, 4):
            row[f"gluon_s{st}_ms"] = median_ms(lambda: first_pass(
                a, b, out, flags, (tiles,), tile, False, False, desc, stages=st))
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    require_cuda()
    if not HAVE_GLUON:
        raise SystemExit("this benchmark needs Triton's Gluon (triton.experimental.gluon)")
    res = env()
    for tile in (tgw.TILE, (64, 128, 4, 3)):
        key = "x".join(map(str, tile))
        res[f"check_{key}"] = check(tile)
        res[f"timing_{key}"] = timing(a.tokens, tile)
        print(json.dumps({key: res[f"timing_{key}"]}), flush=True)
    print(json.dumps({k: v for k, v in res.items() if k.startswith("check")}))
    dump(a.out, res)


if __name__ == "__main__":
    main()
