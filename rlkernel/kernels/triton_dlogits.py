"""d loss / d logits of the token logprobs and entropy on CUDA (Triton): the torch path's bits,
in one pass.

What: `dlogits(z, targets, lse, ent, g_lp, g_ent, T, out)` writes d logits [N, V] (fp32 or bf16)
for z = logits / T and the forward's lse, entropy [N]; one program per row block × vocab block.
With from_logits=True it reads the raw logits instead and forms z = logits / T (div_rn), −inf
for ids >= live_vocab, as kernels/logprobs._div_t does (the fused LM head's recomputed logits).
Why: kernels/logprobs._dlogits runs exp as ~40 float64 torch launches per row chunk (~88 ms of a
1.38 s qwen3-0.6b H200 step); here each logit is read once and d logit written once.
Algorithm (per element, logprobs._dlogits's sequence of IEEE-754 operations, in its order):
    logp = z − lse;  p = fp32(exp64(float64(logp)))           (kernels/triton_elementwise.exp32)
    dz = −(g_lp·p);  dz = dz + g_lp at the target column      (scatter_add_'s fp32 add)
    pl = p·(logp + ent) where p > 0 else +0;  dz = dz − g_ent·pl       (only when g_ent is given)
    d logit = dz / T (div_rn: torch's CPU fp32 division); bf16 output: rounded to nearest even
    from the bits (triton_elementwise.bf16_rtne, torch's CPU cast)
−(g_lp·p) is a sign-bit flip (neg32: Triton's unary minus 0 − x would give +0 for +0), so a
masked id (z = −inf, p = 0) gets the torch path's signed zero. Launched with
enable_fp_fusion=False (no mul+add contracted into an fma); fp32 `/` is spelt div_rn (Triton's
`/` lowers to the approximate div.full.f32). Each element depends only on its own z and its
row's scalars, so the result is batch-invariant by construction and any tiling gives the same
bits. Note: the torch path run on CUDA is *not* the reference: its `dz / T` multiplies by 1/T.

Does not: take dtypes other than fp32 for z and the row vectors (targets: int64), write
non-unit column strides, or check that targets lie in [0, V) (the torch path's scatter would
raise). NaN payloads and NaN signs are not part of the contract (NaN positions are): LLVM may
spell −(g_lp·p) as (−g_lp)·p, exact on every other value, and NVIDIA GPUs return a canonical NaN.
Tests: tests/test_dlogits_triton.py (TRITON_INTERPRET=1: bitwise vs the CPU torch path; the
compiled PTX); tests/test_cuda_backward.py (on a GPU: == CPU torch path, batch invariance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.triton_elementwise import bf16_rtne, exp32, neg32
from rlkernel.kernels.triton_util import check_cuda, device_ctx, launch

BLOCK_R, BLOCK_V, NUM_WARPS = 4, 512, 4
"""Rows × vocab ids per program (any tile gives the same bits: elements are independent)."""


@triton.jit
def _dz(z, hit, lse, ent, g_lp, g_ent, temp, HAS_ENT: tl.constexpr):
    """logprobs._dlogits of z [BR, BV] (hit: the target column) with row scalars [BR, 1]."""
    logp = z - lse
    p = exp32(logp)
    dz = neg32(g_lp * p)
    dz = tl.where(hit, dz + g_lp, dz)
    if HAS_ENT:
        pl = tl.where(p > 0, p * (logp + ent), 0.0)
        dz = dz - g_ent * pl
    return tl.math.div_rn(dz, temp)


@triton.jit
def _dlogits_kernel(Z, TGT, LSE, ENT, GLP, GENT, OUT, n_rows, V, n_live, s_zr, s_or, temp,
                    BR: tl.constexpr, BV: tl.constexpr, HAS_ENT: tl.constexpr,
                    FROM_LOGITS: tl.constexpr):
    nvb = tl.cdiv(V, BV)
    pid = tl.program_id(0)
    rows = (pid // nvb) * BR + tl.arange(0, BR)
    cols = (pid % nvb) * BV + tl.arange(0, BV)
    r_ok = rows < n_rows
    ok = r_ok[:, None] & (cols < V)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(Z + r64 * s_zr + cols[None, :], mask=ok, other=0.0)
    if FROM_LOGITS:     # logprobs._div_t: div_rn, then −inf past the live vocabulary (a select)
        x = tl.where(cols[None, :] < n_live, tl.math.div_rn(x, temp), float("-inf"))
    tgt = tl.load(TGT + rows, mask=r_ok, other=-1)[:, None]
    lse = tl.load(LSE + rows, mask=r_ok, other=0.0)[:, None]
    ent = tl.load(ENT + rows, mask=r_ok, other=0.0)[:, None]
    g_lp = tl.load(GLP + rows, mask=r_ok, other=0.0)[:, None]
    g_ent = g_lp
    if HAS_ENT:
        g_ent = tl.load(GENT + rows, mask=r_ok, other=0.0)[:, None]
    dz = _dz(x, cols[None, :] == tgt, lse, ent, g_lp, g_ent, temp, HAS_ENT)
    if OUT.dtype.element_ty == tl.bfloat16:
        dz = bf16_rtne(dz)
    tl.store(OUT + r64 * s_or + cols[None, :], dz, mask=ok)


def _check(z, targets, rows, out) -> None:
    check_cuda("d logits", z, targets, *rows, out)
    n = z.shape[0] if z.dim() == 2 else -1
    if z.dim() != 2 or z.dtype != torch.float32:
        raise ValueError(f"d logits: [N, V] float32 z expected, got {tuple(z.shape)} {z.dtype}")
    if targets.dtype != torch.int64 or tuple(targets.shape) != (n,):
        raise ValueError(f"d logits: targets [{n}] int64 expected, got {tuple(targets.shape)} "
                         f"{targets.dtype}")
    for t in rows:
        if t.dtype != torch.float32 or tuple(t.shape) != (n,):
            raise ValueError(f"d logits: [{n}] float32 row values expected, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if out.dtype not in (torch.float32, torch.bfloat16) or out.shape != z.shape \
            or (out.numel() and out.stride(1) != 1):
        raise ValueError(f"d logits: out must be float32 or bfloat16 {tuple(z.shape)} with unit "
                         f"column stride, got {tuple(out.shape)} {out.dtype} {out.stride()}")


def dlogits(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
            g_lp: torch.Tensor, g_ent: torch.Tensor | None, temperature: float,
            out: torch.Tensor, *, from_logits: bool = False, live_vocab: int | None = None,
            block_r: int = BLOCK_R, block_v: int = BLOCK_V,
            num_warps: int = NUM_WARPS) -> torch.Tensor:
    """logprobs._dlogits(z, targets, lse, ent, g_lp, g_ent, T) rounded to out's dtype, written
    into `out`, bitwise; returns out.

    z [N, V] fp32 (any row stride), targets [N] int64 (a target outside [0, V), held by another
    vocab-parallel rank, adds to no column), lse, ent, g_lp, g_ent [N] fp32
    (g_ent None: no entropy term), out [N, V] fp32 or bf16 with unit column stride (any row
    stride: a row slice of a larger buffer). from_logits: z holds logits and the kernel forms
    logprobs._div_t(logits, T, live_vocab) itself (live_vocab a column count in [0, V]).
    ValueError on bad input.
    """
    vecs = [lse, ent, g_lp] + ([] if g_ent is None else [g_ent])
    _check(z, targets, vecs, out)
    n, v = z.shape
    if not n or not v:
        return out
    if z.stride(1) != 1:
        z = z.contiguous()
    targets, *vecs = (t.contiguous() for t in (targets, *vecs))   # autograd's may be expanded
    lse, ent, g_lp = vecs[:3]
    g_ent = vecs[3] if g_ent is not None else g_lp               # dummy pointer when unused
    live = v if live_vocab is None else live_vocab
    grid = (triton.cdiv(n, block_r) * triton.cdiv(v, block_v),)
    with device_ctx(z):
        launch(_dlogits_kernel, grid,
               z, targets, lse, ent, g_lp, g_ent, out, n, v, live, z.stride(0), out.stride(0),
               float(temperature), BR=block_r, BV=block_v, HAS_ENT=len(vecs) == 4,
               FROM_LOGITS=from_logits, num_warps=num_warps, enable_fp_fusion=False)
    return out
