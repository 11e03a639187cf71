"""Fused AdamW update of CUDA fp32 masters (Triton): one pass per tensor, every op correctly
rounded.

What it computes, per element of an fp32 master p, its fp32 gradient g and fp32 moments m, v, in
place (step t, learning rate lr, weight decay λ), in train/optimizer.py's op order:
    m ← m·β1 + g·(1 − β1)
    v ← v·β2 + (g·g)·(1 − β2)
    d ← sqrt(v)·inv + ε,                 inv = 1 / sqrt(1 − β2^t)   (see "bytes" below)
    p ← p·(1 − lr·λ)                     (only when λ ≠ 0: decoupled decay, before the update)
    p ← p − (m / d)·(lr / (1 − β1^t))
AdamW (Loshchilov & Hutter, arXiv 1711.05101) in the form torch.optim.AdamW updates it.

Why: AdamW.step's torch ops are 13 elementwise kernels per tensor (14 with weight decay), each
reading and writing whole fp32 tensors; at qwen3-1.7b (1.72 B parameters, 310 tensors) that is
4,030 launches and ~51 ms per step on an H200. This kernel reads p, g, m, v once and writes
p, m, v once (28 bytes per element), one launch per tensor.

Bytes (NUMERICS_VERSION 8 on CUDA, on every backend since 9: kernels/adamw.py defines them and
its `adamw_rounded_` spells them for CPU tensors; tests/adamw_cases.cuda_reference is the oracle):
- A Python scalar operand is rounded to fp32 before use, as torch's CUDA kernels do: β1, 1 − β1,
  β2, 1 − β2, ε, 1 − lr·λ and lr / (1 − β1^t) are formed in Python (float64), then rounded once
  to fp32 (adamw.step_scalars).
- `sqrt(v) / bc2` is a product with inv = fp32(1) / fp32(bc2), divided on the host in fp32, as
  torch's CUDA division by a Python scalar does (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu).
- Every other op is one IEEE fp32 rounding to nearest: products and sums apart (launched with
  enable_fp_fusion=False, so no mul+add is contracted into an fma), m / d is div.rn
  (tl.math.div_rn; Triton's `/` is approximate), sqrt is sqrt.rn (tl.math.sqrt_rn), and
  subnormals are kept (no .ftz; tests/test_adamw_triton.py reads the sm_90 PTX).
torch's own op sequence on CUDA is not this: on an H200 (torch 2.11) its masters differ from
these for 0.15-4.3 % of elements after a step, its moments not at all
(tests/test_cuda_adamw.py; benchmarks/bench_adamw.py at qwen3-1.7b's shapes), while none of its
sqrt, tensor/tensor division, scalar product or sum deviated from the correctly rounded result
on 4 M values — so the difference lies in how it applies a scalar to the update (the division
by bc2 or the added ε; not pinned down). The kernel, used for every CUDA master, defines CUDA's
bytes; CPU tensors take kernels/adamw.adamw_rounded_ (float64 ops rounded once: the same bytes),
not this kernel and not torch's fp32 CPU ops (those divide by the scalar, and torch 2.13's fp32
CPU sqrt is not always correctly rounded: AVX2, tests/adamw_triton_checks.py).

Does not: clip or compute norms (optimizer.AdamW.clip), read non-contiguous tensors (the optimizer
passes contiguous copies of those and writes them back), take dtypes other
than fp32, offer amsgrad/maximize, or update several tensors in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.adamw import AdamWScalars, check_operands
from rlkernel.kernels.triton_util import check_cuda, device_ctx, launch

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _fp32(x):
    # A no-op on the GPU (scalar arguments arrive as fp32). The CPU interpreter passes Python
    # floats, and would make one below 2**-126 a float64 constant and the arithmetic float64.
    return tl.cast(x, tl.float32)


@triton.jit
def _adamw_kernel(P, G, M, V, n, beta1, c1, beta2, c2, inv_bc2, eps, decay, step_size,
                  DECAY: tl.constexpr, BLOCK: tl.constexpr):
    # int64 offsets: one tensor may hold more than 2**31 elements.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + offs, mask=ok)
    m = tl.load(M + offs, mask=ok) * _fp32(beta1) + g * _fp32(c1)
    v = tl.load(V + offs, mask=ok) * _fp32(beta2) + (g * g) * _fp32(c2)
    tl.store(M + offs, m, mask=ok)
    tl.store(V + offs, v, mask=ok)
    denom = tl.math.sqrt_rn(v) * _fp32(inv_bc2) + _fp32(eps)
    p = tl.load(P + offs, mask=ok)
    if DECAY:
        p = p * _fp32(decay)
    tl.store(P + offs, p - tl.math.div_rn(m, denom) * _fp32(step_size), mask=ok)


def adamw_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
           s: AdamWScalars) -> None:
    """One AdamW update in place of master p and moments m (exp_avg), v (exp_avg_sq) from
    gradient g: fp32, contiguous, one shape (any), one CUDA device (any device under
    TRITON_INTERPRET=1), not overlapping; s from adamw.step_scalars. Correctly rounded ops (module
    doc). Raises ValueError for another dtype, shape, layout or device."""
    check_cuda("adamw", p, g, m, v)
    check_operands(p, g, m, v)
    n = p.numel()
    if n == 0:
        return
    decay = s.decay is not None
    with device_ctx(p):
        launch(_adamw_kernel, (triton.cdiv(n, BLOCK),),
               p, g, m, v, n, s.beta1, s.one_minus_beta1, s.beta2, s.one_minus_beta2,
               s.inv_bc2_sqrt, s.eps, s.decay if decay else 1.0, s.step_size, DECAY=decay,
               BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False)
