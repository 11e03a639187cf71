"""RoPE rotation for the CUDA training path (Triton): forward and backward in one pass each.

What it computes: for x [L, heads, D] fp32 and per-token cos/sin rows [L, D] (kernels/rope.py's
tables, rotate-half pairing i <-> i + D/2; Su et al., arXiv 2104.09864):
    forward   y = x·cos + rot(x)·sin,          rot(x) = [−x₂, x₁]
    backward  dx = (dy·cos + rotᵀ(dy·sin)) + 0,  rotᵀ(u) = [u₂, −u₁]
with the bytes of kernels/rope.apply_rope's torch ops and of torch autograd's backward of them:
each product and each sum one fp32 rounding (enable_fp_fusion=False, no fma), negation a sign
flip. The "+ 0" is autograd's: x reaches the rotation through two slices, each of whose
backward is a zero-filled tensor, and adding their +0.0 turns a −0.0 gradient into +0.0.

Why: the rotation as torch ops is 5 launches per call forward (negation, concatenation, two
products, a sum) and ~8 backward (two products, a negation, two zero-filled slice gradients and
their sums), for the Q and the K of every layer; here one launch each, reading x (or dy) and
the tables once.

The forward may store its result rounded to bf16 (a bf16 run's rounding point of q and k, which
the model would otherwise take in a cast pass of its own), and the backward then takes the bf16
gradient, widened exactly as it is loaded; both are the bytes of the separate cast.
Does not: compute the tables (kernels/rope.RopeTable), run on CPU (kernels/rope.rope keeps the
torch ops there; under TRITON_INTERPRET=1 CPU tensors are accepted for tests), or take other
dtypes than fp32 and bf16.
Tests: TRITON_INTERPRET=1 via tests/test_rope_triton.py; on a GPU tests/test_cuda.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.triton_elementwise import neg32, rotate_half
from rlkernel.kernels.triton_util import check_cuda, device_ctx, launch


@triton.jit
def _rope_kernel(X, COS, SIN, Y, n_rows, heads, D, BLOCK_R: tl.constexpr, DP: tl.constexpr,
                 BACKWARD: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, DP)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < D)
    half = D // 2
    first = cols[None, :] < half
    partner = tl.where(cols < half, cols + half, cols - half)
    base = rows[:, None] * D
    tok = (rows // heads)[:, None] * D
    x = tl.load(X + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)   # bf16 dy: exact
    xp = tl.load(X + base + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    c = tl.load(COS + tok + cols[None, :], mask=ok, other=0.0)
    if BACKWARD:
        up = xp * tl.load(SIN + tok + partner[None, :], mask=ok, other=0.0)   # (dy·sin) there
        y = (x * c + tl.where(first, up, neg32(up))) + 0.0
    else:
        y = rotate_half(x, xp, c, tl.load(SIN + tok + cols[None, :], mask=ok, other=0.0), first)
    tl.store(Y + base + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)   # bf16 Y: RNE


def rope_pass(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              backward: bool = False, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The rotation of x [L, heads, D] fp32 by cos/sin [L, D] fp32 on CUDA (module doc), or with
    backward=True its gradient for dy = x (fp32, or bf16: widened exactly as it is loaded). D
    even. Returns a new contiguous tensor of x's shape in out_dtype: fp32, or bf16 — the fp32
    result rounded to nearest even by the store, the bytes of `.to(torch.bfloat16)` on it (a bf16
    run's rounding point of q and k, taken here instead of in a pass of its own).
    ValueError on other dtypes or shapes."""
    check_cuda("rope", x, cos, sin)
    x_ok = x.dtype == torch.float32 or (backward and x.dtype == torch.bfloat16)
    if (x.dim() != 3 or x.shape[-1] % 2 or tuple(cos.shape) != (x.shape[0], x.shape[-1])
            or cos.shape != sin.shape or not x_ok
            or {t.dtype for t in (cos, sin)} != {torch.float32}
            or out_dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"rope: x [L, heads, D] (D even; fp32, or bf16 for the backward), "
                         f"cos/sin [L, D] fp32 and an fp32/bf16 out_dtype expected, got "
                         f"x {x.dtype} {tuple(x.shape)}, cos {cos.dtype} {tuple(cos.shape)}, "
                         f"sin {sin.dtype} {tuple(sin.shape)}, out_dtype {out_dtype}")
    xc, cc, sc = x.contiguous(), cos.contiguous(), sin.contiguous()
    y = torch.empty(xc.shape, dtype=out_dtype, device=xc.device)
    n_rows, d = xc.shape[0] * xc.shape[1], xc.shape[2]
    if n_rows == 0:
        return y
    dp = triton.next_power_of_2(d)
    block_r = max(1, 4096 // dp)
    with device_ctx(x):
        launch(_rope_kernel, (triton.cdiv(n_rows, block_r),),
               xc, cc, sc, y, n_rows, xc.shape[1], d, BLOCK_R=block_r, DP=dp, BACKWARD=backward,
               num_warps=4, enable_fp_fusion=False)
    return y
