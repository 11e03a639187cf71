"""SwiGLU forward and backward on CUDA (Triton): the torch path's bits, in one pass each.

What: `swiglu_fwd(gate, up) -> (out, sig)` and `swiglu_bwd(dh, gate, up, sig) -> (d_gate, d_up)`
for fp32 tensors of one shape, one program per BLOCK consecutive elements. Training keeps no
sig: the forward skips its store and the backward recomputes σ from gate (the same bits; the
float64 chain costs less than an fp32 [L, I] written, kept and read back: 400 MB per layer at
qwen3-1.7b's 6,144 columns and 16k tokens).
Why: kernels/activation.py's torch path runs σ as dozens of float64 elementwise launches
(kernels/elementwise.py's exp64 Horner chain: ~190 ms of a 1.74 s H200 training step); here
each element is read once and written once, and its value is the same as before.
Algorithm (per element, the torch path's sequence of IEEE-754 operations, in its order):
    x  = −float64(g);  xc = min(max(x, −745), 709)
    n  = floor(xc·LOG2E + 0.5);  r = (xc − n·LN2_HI) − n·LN2_LO
    p  = c13;  p = p·r + c_k for k = 12 … 0                 (c_k = 1/k!, elementwise._EXP_COEF)
    e  = (p·2**h)·2**(n−h),  h = floor(n/2), each 2**· built from exponent bits, clamped to
         [−1022, 1023];  e = inf where x > 709, 0 where x < −745, x where x is NaN
    σ  = fp32(1 / (1 + e))                                   (one rounding, from float64)
    out = (g·σ)·u;  d_up = dh·(g·σ);  d_gate = ((dh·u)·σ)·(1 + g·(1 − σ))    (fp32)
Each step is one correctly rounded IEEE op on the GPU (float64 add/sub/mul, div.rn.f64, floor,
exact conversions and integer ops; no libdevice call, so no flush-to-zero), and the kernels
launch with enable_fp_fusion=False, so no mul+add is contracted into an fma: each element's
bits are the torch path's. Exact steps may be spelt differently: the clamps as
tl.maximum/minimum, floor(n/2) as an arithmetic shift, −x as a sign-bit flip (Triton's unary
minus is 0 − x, which turns −0.0 into +0.0). exp64 and the sign flip are the shared jit helpers
of kernels/triton_elementwise.py (constants from kernels/elementwise.py, one source); a Python
float in a binary op with a float64 tensor becomes a float64 constant (the PTX test checks
each), whereas e.g. tl.fma(p, r, c) would round c to fp32 first.
An element depends only on its own inputs, so the result is batch-invariant by construction.
Source: Shazeer, "GLU Variants Improve Transformer" (2020); exp: Cody & Waite range reduction.

Outputs may be stored rounded to bf16 (out_dtype): the MLP's linears take them at that rounding
point anyway (kernels/mlp.py), so no fp32 copy is written and read back to be cast.
Does not: broadcast (shapes must match), take input dtypes other than fp32, keep strides (inputs
are made contiguous; outputs are contiguous), or provide autograd (kernels/activation.py does).
NaN payloads are not part of the contract (NaN positions are): which NaN a NaN·NaN product
returns is the hardware's and the compiler's choice, and NVIDIA GPUs return a canonical NaN.
Tests: tests/test_activation_triton.py (TRITON_INTERPRET=1: bitwise vs the CPU torch path on
adversarial inputs; the compiled PTX: no fma, no ftz, exact constants);
tests/test_cuda_backward.py (on a GPU: CUDA kernels == CPU torch path, batch invariance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.triton_elementwise import exp64, neg64
from rlkernel.kernels.triton_util import check_cuda, device_ctx, launch

BLOCK = 1024
"""Elements per program (any value gives the same bits: elements are independent)."""
NUM_WARPS = 4

@triton.jit
def _sigmoid32(g):
    """elementwise.sigmoid32 of an fp32 tensor: 1 / (1 + exp64(−g)) in float64, rounded once."""
    # torch's neg flips the sign bit; Triton's unary minus is 0 − x (+0 for +0, NaN unsigned).
    e = exp64(neg64(g.to(tl.float64)))
    return (1.0 / (1.0 + e)).to(tl.float32)           # float64 `/` lowers to div.rn.f64


@triton.jit
def _grads(dh, g, u, sig):
    """(d_gate, d_up) in fp32, associated as the torch path writes them."""
    return ((dh * u) * sig) * (1.0 + g * (1.0 - sig)), dh * (g * sig)


@triton.jit
def _fwd_kernel(G, U, OUT, SIG, n, BLOCK: tl.constexpr, STORE_SIG: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0)
    u = tl.load(U + offs, mask=ok, other=0.0)
    sig = _sigmoid32(g)
    # A bf16 OUT: the fp32 value rounded to nearest even by the store (torch's cast).
    tl.store(OUT + offs, ((g * sig) * u).to(OUT.dtype.element_ty), mask=ok)
    if STORE_SIG:
        tl.store(SIG + offs, sig, mask=ok)


@triton.jit
def _bwd_kernel(DH, G, U, SIG, DG, DU, n, BLOCK: tl.constexpr, LOAD_SIG: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    dh = tl.load(DH + offs, mask=ok, other=0.0)
    g = tl.load(G + offs, mask=ok, other=0.0)
    u = tl.load(U + offs, mask=ok, other=0.0)
    if LOAD_SIG:
        sig = tl.load(SIG + offs, mask=ok, other=0.0)
    else:
        sig = _sigmoid32(g)           # the forward's σ again: the same bits, no [n] fp32 kept
    d_gate, d_up = _grads(dh, g, u, sig)
    tl.store(DG + offs, d_gate.to(DG.dtype.element_ty), mask=ok)   # bf16: rounded, as OUT
    tl.store(DU + offs, d_up.to(DU.dtype.element_ty), mask=ok)


def _check(what: str, *ts: torch.Tensor) -> None:
    check_cuda(what, *ts)
    for t in ts:
        if t.dtype != torch.float32:
            raise ValueError(f"{what}: float32 tensors expected, got {t.dtype}")
        if t.shape != ts[0].shape:
            raise ValueError(f"{what}: shapes differ, {tuple(ts[0].shape)} vs {tuple(t.shape)}")


def _check_out(what: str, out_dtype: torch.dtype) -> None:
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{what}: out_dtype must be float32 or bfloat16, got {out_dtype}")


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, block: int = BLOCK,
               num_warps: int = NUM_WARPS, keep_sig: bool = True,
               out_dtype: torch.dtype = torch.float32
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out = silu(gate)·up, sig = σ(gate)), shaped like gate (contiguous); sig fp32, None when
    keep_sig is False (the backward recomputes it: `swiglu_bwd` with sig None); out fp32, or
    with out_dtype bf16 the fp32 value rounded to nearest even (the next linear's rounding
    point, taken by the store: `.to(torch.bfloat16)`'s bytes).

    Raises ValueError unless gate and up are fp32 CUDA tensors of one shape (and out_dtype fp32
    or bf16).
    """
    _check("swiglu", gate, up)
    _check_out("swiglu", out_dtype)
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g, dtype=out_dtype)
    sig = torch.empty_like(g) if keep_sig else None
    n = g.numel()
    if n:
        with device_ctx(g):
            launch(_fwd_kernel, (triton.cdiv(n, block),),
                   g, u, out, g if sig is None else sig, n, BLOCK=block, STORE_SIG=keep_sig,
                   num_warps=num_warps, enable_fp_fusion=False)
    return out, sig


def swiglu_bwd(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
               sig: torch.Tensor | None = None, block: int = BLOCK,
               num_warps: int = NUM_WARPS, out_dtype: torch.dtype = torch.float32
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) of out = silu(gate)·up given dh = d out and the forward's sig, or with sig
    None σ(gate) recomputed in the kernel (the same bits: a float64 Horner chain per element is
    cheaper than reading and keeping an fp32 [n]); fp32, or with out_dtype bf16 rounded to
    nearest even by the stores (the gate/up linear's rounding point of dY).

    Raises ValueError unless all are fp32 CUDA tensors of one shape (and out_dtype fp32 or bf16).
    """
    ts = (dh, gate, up) if sig is None else (dh, gate, up, sig)
    _check("swiglu backward", *ts)
    _check_out("swiglu backward", out_dtype)
    dh, g, u = (t.contiguous() for t in (dh, gate, up))
    s = g if sig is None else sig.contiguous()        # unread when recomputed
    d_gate, d_up = torch.empty_like(g, dtype=out_dtype), torch.empty_like(g, dtype=out_dtype)
    n = g.numel()
    if n:
        with device_ctx(g):
            launch(_bwd_kernel, (triton.cdiv(n, block),),
                   dh, g, u, s, d_gate, d_up, n, BLOCK=block, LOAD_SIG=sig is not None,
                   num_warps=num_warps, enable_fp_fusion=False)
    return d_gate, d_up
