"""Invariant SwiGLU, silu(gate)·up, with its exact elementwise backward (any device).

silu(g) = g·σ(g) with σ from kernels/elementwise.py (torch.sigmoid/silu could differ by an ulp
between the vectorised body and the scalar tail). Backward, per element:
    d_up = dh·silu(g);  d_gate = dh·up·σ(g)·(1 + g·(1 − σ(g)))
Source: Shazeer, "GLU Variants Improve Transformer" (2020).
Runs as torch elementwise ops on whatever device the tensors live on (CPU or CUDA); there is no
fused Triton kernel for it yet.
"""

from __future__ import annotations

import torch

from rlkernel.kernels.elementwise import sigmoid32


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        sig = sigmoid32(gate)
        ctx.save_for_backward(gate, up, sig)
        return (gate * sig) * up

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        gate, up, sig = ctx.saved_tensors
        d_up = dh * (gate * sig)
        d_gate = ((dh * up) * sig) * (1.0 + gate * (1.0 - sig))
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up. gate, up [L, I] fp32 -> [L, I] fp32."""
    return _SwiGLU.apply(gate, up)
