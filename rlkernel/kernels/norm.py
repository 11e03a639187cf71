"""Invariant RMSNorm over the last dim (hidden RMSNorm and Qwen3's per-head Q/K norm).

Forward per token: r = 1/sqrt(tree_sum(x²)/H + eps); y = (x·r)·w — the mean of squares is the
pairwise tree over H (kernels/matmul.py explains why elementwise steps are path-independent), so
a token's output never depends on other tokens. Backward:
    dx = r·(g − x̂·tree_sum(g·x̂)/H),  g = dy·w,  x̂ = x·r          (per token)
    dw = token reduction (distributed/tokensum.py): per leaf of TOKEN_LEAF tokens the sum in
         order (per head, for the per-head norm), then every (leaf, head) partial added exactly
         and rounded once — so however TP splits the heads (24 heads as 6 or 3 per rank) or
         CP/SP/DP split the tokens, the same exact sum; KV heads replicated over TP ranks count
         once (their first holder adds them).
Algorithm: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019).
Devices: the per-token statistic r, x̂ and the weight product run in one Triton pass on CUDA
(kernels/triton_norm.py) and in torch ops on CPU; so does the backward's dx and per-leaf dW
partials (one pass on CUDA, the bytes of the torch ops); the exact dW sums are the token
reduction on either device.
`rms_norm_inference` (no autograd: rollout steps) is one Triton pass on CUDA with the weight
applied, and with Qwen3's Q/K norms the RoPE rotation too: the same bytes.
Does not: communicate.
"""

from __future__ import annotations

import torch

from rlkernel.distributed.comm import Comm
from rlkernel.distributed.tokensum import TokenSum, leaves_of
from rlkernel.spec import TOKEN_LEAF
from rlkernel.kernels.elementwise import rsqrt32
from rlkernel.kernels.rope import apply_rope
from rlkernel.numerics import fixedpoint as fx
from rlkernel.numerics.trees import tree_sum


def _leaf_sums(v: torch.Tensor) -> torch.Tensor:
    """Per-leaf sums of v [L, ...] (TOKEN_LEAF tokens in order inside a leaf) -> [L/TOKEN_LEAF, ...]."""
    vl = v.reshape(leaves_of(v.shape[0]), -1, *v.shape[1:])
    acc = vl[:, 0].clone()
    for i in range(1, vl.shape[1]):
        acc.add_(vl[:, i])
    return acc


def _rms_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, x̂) as torch ops (the CPU path; CUDA runs kernels/triton_norm.py, `_forward_rows`)."""
    h = x.shape[-1]
    ms = tree_sum(x * x, -1) / h
    r = rsqrt32(ms + eps)
    return r, x * r[..., None]


def _forward_rows(x: torch.Tensor, w: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(r, x̂, y = x̂·w) of fp32 x [..., H] and w [H]: one Triton pass on CUDA
    (kernels/triton_norm.rms_forward, the same bytes), torch ops elsewhere."""
    if x.is_cuda:
        from rlkernel.kernels import triton_norm
        return triton_norm.rms_forward(x, w, eps)
    r, xh = _rms_stats(x, eps)
    return r, xh, xh * w


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps, tok, head_comm, replicas):
        r, xh, y = _forward_rows(x.to(torch.float32), w.to(torch.float32), eps)
        ctx.save_for_backward(xh, r, w)
        # The parameter itself keys the gradient sink (saved tensors may be recomputed copies).
        ctx.tok, ctx.head_comm, ctx.replicas, ctx.param = tok, head_comm, replicas, w
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xh, r, w = ctx.saved_tensors
        heads = ctx.head_comm
        want_dw = ctx.needs_input_grad[1]
        # A KV head replicated over `replicas` TP ranks is added by its first holder only.
        adds = want_dw and (heads is None or heads.rank % ctx.replicas == 0)
        dx, part = _backward_rows(dy, xh, r, w.to(torch.float32), adds)
        dw = None
        if want_dw:
            tok, h = ctx.tok or TokenSum.single(), xh.shape[-1]

            def add(a: int, b: int, acc: torch.Tensor) -> None:
                if part is not None:
                    fx.accumulate_(acc, part[:, a:b])

            if tok.finish_now(ctx.param, add, "token-sum-norm", heads):
                pass
            elif part is not None and tok.add_later(ctx.param, part, heads):
                pass    # persistent mode: added with the next microbatches' partials, at once
            else:
                acc = tok.accumulator(ctx.param, heads)
                add(0, h, acc)
                dw = tok.result(ctx.param, acc, "token-sum-norm", heads)
        return dx, dw, None, None, None, None


def _backward_rows(dy: torch.Tensor, xh: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                   want_part: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, every (leaf, head) partial of dy·x̂ [leaves·heads, H] or None): one Triton pass on
    CUDA (kernels/triton_norm.rms_backward, the same bytes), torch ops elsewhere."""
    if xh.is_cuda and dy.dtype == torch.float32:
        from rlkernel.kernels import triton_norm
        return triton_norm.rms_backward(dy, xh, r, w, TOKEN_LEAF, want_part)
    return _backward_rows_torch(dy, xh, r, w, want_part)


def _backward_rows_torch(dy: torch.Tensor, xh: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                         want_part: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_backward_rows` as torch ops on any device (the CPU path; on CUDA the reference of the
    Triton pass)."""
    g = dy * w
    h = xh.shape[-1]
    dx = r[..., None] * (g - xh * (tree_sum(g * xh, -1) / h)[..., None])
    part = None
    if want_part:
        per_tok = (dy * xh).reshape(xh.shape[0], -1, h)   # [L, heads or 1, H]
        part = _leaf_sums(per_tok).reshape(-1, h)          # every (leaf, head)
    return dx, part


def rms_norm_inference(x: torch.Tensor, w: torch.Tensor, eps: float,
                       cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`rms_norm`'s forward without autograd, then kernels/rope.apply_rope(·, cos, sin) when cos
    and sin are given (x [L, heads, D]), then `.to(out_dtype)` (fp32 or bf16: a linear's rounding
    point): the same bytes as the separate ops, on CUDA in one Triton pass
    (kernels/triton_norm.rms_norm_apply), elsewhere the composition. x fp32, w fp32 [H]."""
    if x.is_cuda and w.dtype == torch.float32:
        from rlkernel.kernels import triton_norm
        return triton_norm.rms_norm_apply(x.to(torch.float32), w, eps, cos, sin, out_dtype)
    y = _forward_rows(x.to(torch.float32), w.to(torch.float32), eps)[2]   # _RMSNorm.forward's
    return (y if cos is None else apply_rope(y, cos, sin)).to(out_dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, *, tok: TokenSum | None = None,
             head_comm: Comm | None = None, replicas: int = 1) -> torch.Tensor:
    """RMSNorm over the last dim. x [L, H] or [L, heads, D] fp32, w [H] or [D] -> same shape, fp32.

    dim 0 must be this rank's token stream when a weight gradient is taken (a multiple of
    TOKEN_LEAF rows); dW goes through `tok` (distributed/tokensum.py). Per-head norms (Q/K norm)
    add their heads into the same exact sum, across `head_comm` (TP), KV heads replicated over
    `replicas` ranks counted once. Raises ValueError on a stream that is not whole leaves.
    """
    return _RMSNorm.apply(x, w, eps, tok, head_comm, replicas)
