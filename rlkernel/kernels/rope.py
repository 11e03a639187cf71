"""RoPE tables and rotation (Su et al., "RoFormer", arXiv 2104.09864; Qwen3's rotate-half layout).

The cos/sin tables are computed once per (head_dim, theta) by one code path — Python's `math` on
each float64 angle, rounded to fp32 — so a position's row never depends on how many positions a
caller asked for, nor on the torch vector path. Tables grow in place as longer sequences appear.
Rotation is elementwise: q·cos + rotate_half(q)·sin, so plain autograd is exact here (no
reductions: the tables are constants broadcast over heads). `rope` is the training entry: on
CUDA one Triton pass forward and one backward (kernels/triton_rope.py) with the bytes of
`apply_rope` and of its autograd backward; elsewhere `apply_rope` under autograd.
Does not: support RoPE scaling variants (config.py rejects them).
"""

from __future__ import annotations

import math

import torch


class RopeTable:
    """Cached fp32 cos/sin rows [positions, head_dim] for one (head_dim, theta)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim = head_dim
        self.theta = theta
        half = head_dim // 2
        self.inv_freq = [1.0 / (theta ** (2 * i / head_dim)) for i in range(half)]
        self.cos = torch.empty(0, head_dim, dtype=torch.float32)
        self.sin = torch.empty(0, head_dim, dtype=torch.float32)
        self._dev: tuple[torch.Tensor, torch.Tensor] | None = None   # cos/sin on a device

    def _extend(self, n: int) -> None:
        start = self.cos.shape[0]
        rows_c, rows_s = [], []
        for p in range(start, n):
            ang = [p * f for f in self.inv_freq]
            c = [math.cos(a) for a in ang]
            s = [math.sin(a) for a in ang]
            rows_c.append(c + c)
            rows_s.append(s + s)
        self.cos = torch.cat([self.cos, torch.tensor(rows_c, dtype=torch.float64).float()])
        self.sin = torch.cat([self.sin, torch.tensor(rows_s, dtype=torch.float64).float()])

    def lookup(self, positions: torch.Tensor,
               bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows for integer positions [...] -> [..., head_dim] fp32 each (pos < 0 -> row 0).

        bound: a host-known int > every position; given, the lookup is a gather on the positions'
        device from a copy of the table there (the same values), with no host sync.
        """
        pos = positions.clamp(min=0)
        if bound is not None:
            if bound > self.cos.shape[0]:
                self._extend(max(bound, 2 * self.cos.shape[0], 256))
            dev = positions.device
            if self._dev is None or self._dev[0].device != dev or self._dev[0].shape != self.cos.shape:
                self._dev = (self.cos.to(dev), self.sin.to(dev))
            return self._dev[0][pos], self._dev[1][pos]
        need = int(pos.max().item()) + 1 if pos.numel() else 0
        if need > self.cos.shape[0]:
            self._extend(max(need, 2 * self.cos.shape[0], 256))
        pc = pos.cpu()
        return self.cos[pc].to(positions.device), self.sin[pc].to(positions.device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [L, heads, D] by per-token cos/sin [L, D] (rotate-half pairing i ↔ i + D/2)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


class _Rope(torch.autograd.Function):
    """apply_rope with its forward and backward as kernels/triton_rope.py passes (CUDA, fp32)."""

    @staticmethod
    def forward(ctx, x, cos, sin, out_dtype):
        from rlkernel.kernels import triton_rope
        ctx.save_for_backward(cos, sin)
        return triton_rope.rope_pass(x, cos, sin, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, dy):
        from rlkernel.kernels import triton_rope
        cos, sin = ctx.saved_tensors
        return triton_rope.rope_pass(dy, cos, sin, backward=True), None, None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`apply_rope(x, cos, sin).to(out_dtype)` for autograd passes: x [L, heads, D], cos/sin
    [L, D] -> [L, heads, D] in out_dtype (fp32, or bf16: a bf16 run's rounding point of q and k),
    the same bytes forward and backward (the cast's backward widens the gradient exactly); on
    CUDA (fp32 x and tables, constant tables) one Triton pass each way instead of ~13 torch
    launches and the cast's two."""
    if (x.is_cuda and x.dtype == torch.float32 and cos.dtype == torch.float32
            and sin.dtype == torch.float32 and not (cos.requires_grad or sin.requires_grad)
            and out_dtype in (torch.float32, torch.bfloat16)):
        return _Rope.apply(x, cos, sin, out_dtype)
    return apply_rope(x, cos, sin).to(out_dtype)
