"""The AdamW update with every op correctly rounded: its fp32 scalars, and its CPU spelling.

One definition of AdamW's bytes on every backend (NUMERICS_VERSION 9). Per element of an fp32
master p, gradient g and moments m, v, in train/optimizer.py's op order:
    m ← m·β1 + g·(1 − β1)
    v ← v·β2 + (g·g)·(1 − β2)
    d ← sqrt(v)·inv + ε,                 inv = fp32(1) / fp32(sqrt(1 − β2^t))
    p ← p·(1 − lr·λ)                     (only when λ ≠ 0)
    p ← p − (m / d)·(lr / (1 − β1^t))
with the scalars rounded to fp32 first (`step_scalars`: what torch's CUDA ops do to a Python
scalar), each product, sum, quotient and square root one IEEE fp32 rounding to nearest even, no
fused multiply-add, subnormals kept. On CUDA kernels/triton_adamw.py runs it; `adamw_rounded_`
here is the same sequence in torch ops for any other device (the CPU), so the CPU's bytes are
the CUDA kernel's and depend on no vector ISA.

How the CPU gets each fp32 op correctly rounded: the op runs in float64 on the fp32 operands and
its result is rounded once to fp32. For +, −, ×, ÷ and √ that single rounding of a correctly
rounded float64 result is the correctly rounded fp32 one (53 ≥ 2·24 + 2 bits; Figueroa, "When is
double rounding innocuous?", 1995). Why not torch's fp32 ops: torch 2.13's fp32 CPU sqrt (AVX2)
is one ulp off for ~16 % of values, and which values may depend on the vector path (an AVX-512
or scalar loop may round others). torch's float64 CPU sqrt is not correctly rounded either (one
float64 ulp off for 1.3 % of values, AVX2), which cannot reach the fp32 result: for y = √x of an
fp32 x, y in [2^e, 2^(e+1)), an fp32 rounding boundary is M = (2k+1)·2^(e−24), so M² is an odd
multiple of 2^(2e−48) and x an even one; |x − M²| ≥ 2^(2e−48), and |y − M| = |x − M²| / (y + M)
> 2^(e−50), 4 float64 ulps of y. A float64 square root less than 4 ulps off rounds to the
correct fp32 (tests/test_kernels_adamw.py: against numpy's IEEE sqrt and Decimal). A NaN's sign
and payload are the hardware's (a GPU has one NaN), not part of the bytes promised.
Tensors are updated in chunks of CHUNK elements so the float64 temporaries stay small; the
chunking cannot change a byte (every element is its own computation).
Does not: clip, take dtypes other than fp32, or import triton (CPU installs have none).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlkernel.kernels.triton_util import f32, f32_reciprocal

CHUNK = 1 << 20
"""Elements per float64 pass of `adamw_rounded_` (about 8 MB per float64 temporary)."""


class AdamWScalars(NamedTuple):
    """One step's scalars as torch's CUDA ops use them: Python floats that hold fp32 values."""

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    inv_bc2_sqrt: float      # fp32(1) / fp32(bc2_sqrt), an fp32 division
    eps: float
    decay: float | None      # fp32(1 − lr·λ); None: no weight decay (no multiply at all)
    step_size: float


def step_scalars(beta1: float, beta2: float, eps: float, bc2_sqrt: float, step_size: float,
                 decay: float | None) -> AdamWScalars:
    """The fp32 scalars of one step from the Python floats the torch ops receive: bc2_sqrt =
    sqrt(1 − β2^t), step_size = lr / (1 − β1^t), decay = 1 − lr·λ (None without weight decay).
    1 − β1 and 1 − β2 are formed here in float64, as the torch path writes them."""
    return AdamWScalars(f32(beta1), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2),
                        f32_reciprocal(bc2_sqrt), f32(eps), None if decay is None else f32(decay),
                        f32(step_size))


def check_operands(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
    """ValueError unless p, g, m, v are contiguous fp32 tensors of one shape (both spellings'
    operands)."""
    for name, t in (("p", p), ("g", g), ("m", m), ("v", v)):
        if t.dtype != torch.float32 or t.shape != p.shape or not t.is_contiguous():
            raise ValueError(f"adamw: {name} must be contiguous fp32 of shape {tuple(p.shape)}, "
                             f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}")


def _update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamWScalars,
            a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, r32: torch.Tensor) -> None:
    """One chunk in place (1-D fp32 views): every op in float64 on fp32 values and rounded once
    to fp32 (`rn`). a, b, c: float64 scratch, r32: fp32 scratch, each of the chunk's size (fresh
    8 MB tensors per op would cost ~5x in page faults)."""
    def rn(x: torch.Tensor) -> torch.Tensor:          # x rounded to fp32 in place (held float64)
        return x.copy_(r32.copy_(x))

    a.copy_(g)                                        # a = g (exact)
    rn(b.copy_(m).mul_(s.beta1))                      # b = m·β1
    rn(torch.mul(a, s.one_minus_beta1, out=c))        # c = g·(1 − β1)
    m.copy_(rn(b.add_(c)))                            # b = m ← m·β1 + g·(1 − β1)
    rn(a.mul_(a))                                     # a = g·g
    rn(a.mul_(s.one_minus_beta2))                     # a = (g·g)·(1 − β2)
    rn(c.copy_(v).mul_(s.beta2))                      # c = v·β2
    v.copy_(rn(c.add_(a)))                            # c = v ← v·β2 + (g·g)·(1 − β2)
    rn(torch.sqrt(c, out=a))                          # a = sqrt(v)
    rn(a.mul_(s.inv_bc2_sqrt))                        # a = sqrt(v)·inv
    rn(a.add_(s.eps))                                 # a = d = sqrt(v)·inv + ε
    rn(b.div_(a))                                     # b = m / d
    rn(b.mul_(s.step_size))                           # b = (m / d)·(lr / (1 − β1^t))
    c.copy_(p)
    if s.decay is not None:
        rn(c.mul_(s.decay))                           # c = p·(1 − lr·λ)
    p.copy_(c.sub_(b))                                # p ← c − b (copy_ rounds it once)


def adamw_rounded_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                   s: AdamWScalars) -> None:
    """One AdamW update in place of master p and moments m (exp_avg), v (exp_avg_sq) from
    gradient g, each op correctly rounded (module doc): the bytes of kernels/triton_adamw.adamw_.
    fp32, contiguous, one shape, one device, not overlapping; s from `step_scalars`. Raises
    ValueError for another dtype, shape or layout."""
    check_operands(p, g, m, v)
    n = p.numel()
    k = min(n, CHUNK)
    scratch = [torch.empty(k, dtype=torch.float64, device=p.device) for _ in range(3)]
    scratch.append(torch.empty(k, dtype=torch.float32, device=p.device))
    flat = [t.view(-1) for t in (p, g, m, v)]
    for i in range(0, n, CHUNK):
        j = min(i + CHUNK, n)
        _update(*(t[i:j] for t in flat), s, *(t[:j - i] for t in scratch))
