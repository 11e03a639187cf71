"""Invariant SwiGLU, silu(gate)·up, with its exact elementwise backward (any device).

silu(g) = g·σ(g) with σ from kernels/elementwise.py (torch.sigmoid/silu could differ by an ulp
between the vectorised body and the scalar tail). Backward, per element:
    d_up = dh·silu(g);  d_gate = dh·up·σ(g)·(1 + g·(1 − σ(g)))
Source: Shazeer, "GLU Variants Improve Transformer" (2020).
Devices: CUDA tensors run the fused Triton kernels (kernels/triton_activation.py: one pass
forward, one backward), which perform the torch path's IEEE operations in the same order, so
they give its bits; CPU tensors run the torch path below (the reference), as torch elementwise
ops (float64 for σ). An element's bits depend only on its own inputs on either device.
Does not: broadcast gate against up on CUDA (the kernels take one shape).
"""

from __future__ import annotations

import torch

from rlkernel.kernels.elementwise import sigmoid32


def _triton():
    from rlkernel.kernels import triton_activation  # lazy: CPU installs need no triton
    return triton_activation


def swiglu_fwd_torch(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate)·up, σ(gate)) by torch ops on any device: the reference sequence."""
    sig = sigmoid32(gate)
    return (gate * sig) * up, sig


def swiglu_bwd_torch(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                     sig: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) by torch ops on any device: the reference sequence."""
    d_up = dh * (gate * sig)
    d_gate = ((dh * up) * sig) * (1.0 + gate * (1.0 - sig))
    return d_gate, d_up


class _SwiGLU(torch.autograd.Function):
    """Keeps gate and up only: the backward recomputes σ(gate) (the same bits) rather than
    holding an fp32 σ per element between the passes (a third of the MLP's saved activations)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return swiglu_rounded(gate, up, torch.float32)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        gate, up = ctx.saved_tensors
        return swiglu_grads_rounded(dh, gate, up, torch.float32)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up. gate, up [L, I] fp32 -> [L, I] fp32."""
    return _SwiGLU.apply(gate, up)


def swiglu_rounded(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """silu(gate)·up without autograd, rounded to out_dtype (fp32: unrounded; bf16: the next
    linear's rounding point, on CUDA taken by the kernel's store). gate, up [L, I] fp32."""
    if gate.is_cuda:
        return _triton().swiglu_fwd(gate, up, keep_sig=False, out_dtype=out_dtype)[0]
    return swiglu_fwd_torch(gate, up)[0].to(out_dtype)


def swiglu_grads_rounded(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                         out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) of silu(gate)·up for dh (fp32), σ recomputed, each rounded to out_dtype
    (bf16: the gate/up linear's rounding point of dY, on CUDA taken by the kernel's stores)."""
    if dh.is_cuda:
        return _triton().swiglu_bwd(dh, gate, up, out_dtype=out_dtype)
    d_gate, d_up = swiglu_bwd_torch(dh, gate, up, sigmoid32(gate))
    return d_gate.to(out_dtype), d_up.to(out_dtype)
