"""Weight gradients dW = dYᵀ·X of the linears on CUDA (Triton): the token-leaf partials are
produced and added inside one kernel, never written out per leaf.

What it computes: the same exact sum as the reference path (kernels/matmul.py
`token_leaf_partials` + numerics/fixedpoint.py `accumulate_`), added into the same fixed-point
accumulator: for every element (n, k), the TOKEN_LEAF-token partials p_l = Σ_{t in leaf l}
dy[t, n]·x[t, k] (one tensor-core dot per leaf, fp32 accumulation; for fp32 operands the fma chain
over the leaf's tokens in order), summed exactly over the leaves l of the call.

Why: the reference path writes 4 bytes × (tokens / 16) per weight element and reads them back into
the exact accumulator — on an H200, a qwen3-0.6b step of 4,096 tokens spent 709 ms of 1.74 s
there (docs/BENCHMARKS.md), and the traffic grows with tokens × parameters.

Algorithm, per output tile [BLOCK_N, BLOCK_K] (one program): walk the leaves in order; for each,
p = dot(dyᵀ[tile rows, leaf], x[leaf, tile cols]) in fp32, then add p exactly into a float64
double-word (hi, lo) per element with Knuth's TwoSum (TAOCP vol. 2, §4.2.2): s = hi + p and its
exact error e; hi = s; lo = lo + e, whose own TwoSum error must be 0. Every value here is a
multiple of 2**-149 (an fp32 partial is), so hi + lo is the exact sum as long as every lo addition
was exact (the check), i.e. unless the leaf partials of one element span ~2**95 or are not finite.
At the end hi and lo are each cut into three fp32 words (h1 = fp32(v), h2 = fp32(v − h1),
h3 = fp32(v − h1 − h2); every subtraction is exact in float64) and the cut is checked (the
remainder after h3 is 0, so subnormal flushing or |v| >= 2**128 cannot pass). The six fp32 rows
[6, N, K] then go into the accumulator with fixedpoint.accumulate_ (6 values per element instead
of one per leaf). A tile where any check failed writes zeros there and is flagged: it is
recomputed by the same kernel in EMIT mode, which stores its per-leaf partials (the same dot of
the same operands) for the reference accumulator. Either way the accumulator receives the exact
sum of the same partials, so the result never depends on which tiles took which path (and so not
on the tile, the call's other leaves, CP/DP/microbatch layout), and is bytewise the reference
path's whenever the dot gives the bits of the reference's `bmm` (tests/test_cuda_grad_weight.py).
Launched with enable_fp_fusion=False: a contracted mul+add would break TwoSum's exactness.

Does not: run on CPU (kernels/matmul.py keeps the reference and dispatches here), round, or
communicate (distributed/tokensum.py sums accumulators over ranks and rounds once).
Tests: TRITON_INTERPRET=1 via tests/test_grad_weight_triton.py; on a GPU
tests/test_cuda_grad_weight.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.triton_matmul import operand_dtype
from rlkernel.kernels.triton_util import check_cuda, device_ctx
from rlkernel.numerics import triton_fixedpoint as tfx
from rlkernel.spec import TOKEN_LEAF

WORDS = 6
"""fp32 words per element handed to the accumulator: three for hi, three for lo."""
# (BLOCK_N, BLOCK_K, num_warps, num_stages): speed only (the sum is exact whatever the tile).
TILE = (64, 64, 4, 3)
OUT_ELEMS = 1 << 26        # bound on the [WORDS, rows, K] fp32 words of one launch (1.5 GiB)
EMIT_TILES = 64            # flagged tiles recomputed per EMIT launch (bounds the scratch)


@triton.jit
def _two_sum(a, b):
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


@triton.jit
def _cut3(v):
    """v (float64) as h1 + h2 + h3 (fp32) and whether that is exact."""
    h1 = v.to(tl.float32)
    r1 = v - h1.to(tl.float64)
    h2 = r1.to(tl.float32)
    r2 = r1 - h2.to(tl.float64)
    h3 = r2.to(tl.float32)
    r3 = r2 - h3.to(tl.float64)
    return h1, h2, h3, r3 == 0.0


@triton.jit
def _dw_kernel(DY, X, OUT, FLAGS, TILES, L, N, K,
               s_dl, s_dn, s_xl, s_xk, s_ow, s_on,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LEAF: tl.constexpr,
               PREC: tl.constexpr, EMIT: tl.constexpr, FORCE_FLAG: tl.constexpr):
    pid = tl.program_id(0)
    if EMIT:
        tile = tl.load(TILES + pid)
    else:
        tile = pid
    num_k = tl.cdiv(K, BLOCK_K)
    pn = tile // num_k
    pk = tile % num_k
    rn = (pn * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = (pk * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    rt = tl.arange(0, LEAF).to(tl.int64)
    n_ok = rn < N
    k_ok = rk < K
    a_ptr = DY + rn[:, None] * s_dn + rt[None, :] * s_dl          # dyᵀ tile [BLOCK_N, LEAF]
    b_ptr = X + rt[:, None] * s_xl + rk[None, :] * s_xk           # x tile [LEAF, BLOCK_K]
    hi = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float64)
    lo = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float64)
    bad = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    # EMIT scratch: [leaves, flagged tiles, BLOCK_N, BLOCK_K], so rows of one leaf are contiguous.
    e_ptr = OUT + pid * (BLOCK_N * BLOCK_K) + tl.arange(0, BLOCK_N)[:, None] * BLOCK_K \
        + tl.arange(0, BLOCK_K)[None, :]
    e_step = tl.num_programs(0).to(tl.int64) * (BLOCK_N * BLOCK_K)
    a_step = (tl.zeros([], dtype=tl.int64) + s_dl) * LEAF     # int64: L·stride may pass 2**31
    b_step = (tl.zeros([], dtype=tl.int64) + s_xl) * LEAF
    for _ in range(0, L, LEAF):
        a = tl.load(a_ptr, mask=n_ok[:, None], other=0.0)
        b = tl.load(b_ptr, mask=k_ok[None, :], other=0.0)
        a_ptr += a_step
        b_ptr += b_step
        p = tl.dot(a, b, input_precision=PREC)
        if EMIT:
            tl.store(e_ptr, p)
            e_ptr += e_step
        else:
            hi, e = _two_sum(hi, p.to(tl.float64))
            lo, e2 = _two_sum(lo, e)
            bad |= (e2 != 0.0).to(tl.int32)        # NaN != 0: non-finite partials flag too
    if not EMIT:
        h1, h2, h3, ok_h = _cut3(hi)
        l1, l2, l3, ok_l = _cut3(lo)
        bad |= (ok_h & ok_l).to(tl.int32) ^ 1
        good = (tl.max(bad) == 0) & (FORCE_FLAG == 0)
        o = OUT + rn[:, None] * s_on + rk[None, :]
        m = n_ok[:, None] & k_ok[None, :]
        tl.store(o, tl.where(good, h1, 0.0), mask=m)
        tl.store(o + s_ow, tl.where(good, h2, 0.0), mask=m)
        tl.store(o + 2 * s_ow, tl.where(good, h3, 0.0), mask=m)
        tl.store(o + 3 * s_ow, tl.where(good, l1, 0.0), mask=m)
        tl.store(o + 4 * s_ow, tl.where(good, l2, 0.0), mask=m)
        tl.store(o + 5 * s_ow, tl.where(good, l3, 0.0), mask=m)
        tl.store(FLAGS + tile, (good == 0).to(tl.int32))


def _launch(a, b, out, flags, tiles, grid, tile, emit, force_flag):
    bn, bk, warps, stages = tile
    prec = "ieee" if a.dtype == torch.float32 else "tf32"   # "tf32" is ignored for 16-bit dots
    with device_ctx(a):
        _dw_kernel[grid](a, b, out, flags, tiles, a.shape[0], a.shape[1], b.shape[1],
                         a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                         out.stride(0) if not emit else 0, b.shape[1],
                         BLOCK_N=bn, BLOCK_K=bk, LEAF=TOKEN_LEAF, PREC=prec, EMIT=emit,
                         FORCE_FLAG=int(force_flag), num_warps=warps, num_stages=stages,
                         enable_fp_fusion=False)


def _redo_flagged(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, flagged: torch.Tensor,
                  tile) -> None:
    """acc += the flagged tiles' exact sums through the reference accumulator: the kernel in
    EMIT mode stores each tile's per-leaf partials, accumulate_ adds them (acc [N, K, N_COLS])."""
    bn, bk = tile[0], tile[1]
    n, k = a.shape[1], b.shape[1]
    leaves = a.shape[0] // TOKEN_LEAF
    num_k = triton.cdiv(k, bk)
    flat = acc.view(-1, tfx.N_COLS)
    for i in range(0, flagged.numel(), EMIT_TILES):
        ids = flagged[i:i + EMIT_TILES].to(torch.int32).contiguous()
        nf = ids.numel()
        scratch = torch.empty(leaves, nf, bn, bk, dtype=torch.float32, device=a.device)
        _launch(a, b, scratch, ids, ids, (nf,), tile, True, False)
        rows = (ids // num_k).long()[:, None, None] * bn + torch.arange(bn, device=a.device)[:, None]
        cols = (ids % num_k).long()[:, None, None] * bk + torch.arange(bk, device=a.device)
        live = ((rows < n) & (cols < k)).reshape(-1)
        idx = (rows * k + cols).reshape(-1)[live]
        part = torch.zeros(nf * bn * bk, tfx.N_COLS, dtype=torch.int64, device=a.device)
        part[live] = flat[idx]
        tfx.accumulate_(part, scratch.view(leaves, -1))
        flat[idx] = part[live]


def accumulate_grad_weight_(acc: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, *,
                            tile: tuple[int, int, int, int] = TILE,
                            force_flag: bool = False) -> tuple[torch.Tensor, int]:
    """acc += the exact sum over the TOKEN_LEAF leaves of dy [L, N], x [L, K] of their dWᵀ
    partials, in place (acc int64 [N, K, N_COLS], contiguous; L a multiple of TOKEN_LEAF).

    Operands in `operand_dtype(dy, x)` (bf16 on the tensor cores, else the fp32 fma chain).
    Returns (acc, number of tiles that took the EMIT path). `tile` (BLOCK_N, BLOCK_K, warps,
    stages) and `force_flag` (every tile through the EMIT path; tests) never change a bit.
    One host sync per call (to learn which tiles, if any, were flagged).
    Raises ValueError on devices, shapes or an accumulator of the wrong form.
    """
    check_cuda("grad weight", acc, dy, x)
    n_tok, n = dy.shape
    k = x.shape[1]
    if x.shape[0] != n_tok or n_tok % TOKEN_LEAF:
        raise ValueError(f"grad weight: dy {tuple(dy.shape)} and x {tuple(x.shape)} need one "
                         f"token count, a multiple of TOKEN_LEAF={TOKEN_LEAF}")
    if acc.dtype != torch.int64 or tuple(acc.shape) != (n, k, tfx.N_COLS) \
            or not acc.is_contiguous():
        raise ValueError(f"grad weight: contiguous int64 [{n}, {k}, {tfx.N_COLS}] accumulator "
                         f"expected, got {acc.dtype} {tuple(acc.shape)}")
    if n_tok == 0 or n == 0 or k == 0:
        return acc, 0
    dt = operand_dtype(dy, x)
    a, b = dy.to(dt), x.to(dt)
    bn = tile[0]
    rows = max(bn, (OUT_ELEMS // (WORDS * k)) // bn * bn)   # whole tiles per launch
    redone = 0
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        ac, aa = acc[r0:r1], a[:, r0:r1]
        n_tiles = triton.cdiv(r1 - r0, bn) * triton.cdiv(k, tile[1])
        out = torch.empty(WORDS, r1 - r0, k, dtype=torch.float32, device=a.device)
        flags = torch.empty(n_tiles, dtype=torch.int32, device=a.device)
        _launch(aa, b, out, flags, flags, (n_tiles,), tile, False, force_flag)
        tfx.accumulate_(ac.view(-1, tfx.N_COLS), out.view(WORDS, -1))
        flagged = torch.nonzero(flags).flatten()
        if flagged.numel():
            _redo_flagged(ac, aa, b, flagged, tile)
            redone += flagged.numel()
    return acc, redone
