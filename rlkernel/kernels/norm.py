"""Invariant RMSNorm over the last dim (hidden RMSNorm and Qwen3's per-head Q/K norm).

Forward per token: r = 1/sqrt(tree_sum(x²)/H + eps); y = (x·r)·w — the mean of squares is the
pairwise tree over H (kernels/matmul.py explains why elementwise steps are path-independent), so
a token's output never depends on other tokens. Backward:
    dx = r·(g − x̂·tree_sum(g·x̂)/H),  g = dy·w,  x̂ = x·r          (per token)
    dw = token tree over the stream (fine leaves, in order inside a leaf), then — for the per-head
         norm — the pairwise tree over all heads in head order: TP ranks all-gather their heads'
         sums first, so the tree is the same however TP splits the heads (24 heads as 6 or 3
         per rank included).
Algorithm: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019).
Devices: the per-token statistic r runs in the Triton kernel on CUDA (kernels/triton_norm.py) and in
torch ops on CPU; the rest (scaling, backward, the dW trees) is torch ops on either device.
Does not: communicate.
"""

from __future__ import annotations

import torch

from rlkernel.distributed.comm import Comm
from rlkernel.distributed.tokentree import TokenTree
from rlkernel.kernels.elementwise import rsqrt32
from rlkernel.numerics.trees import tree_sum


def _leaf_sums(v: torch.Tensor, leaves: int) -> torch.Tensor:
    """Per-leaf sums of v [L, ...] (tokens in order inside a leaf) -> [leaves, ...]."""
    n_tok = v.shape[0]
    if n_tok % leaves:
        raise ValueError(f"token tree: stream length {n_tok} is not a multiple of {leaves} leaves")
    vl = v.reshape(leaves, n_tok // leaves, *v.shape[1:])
    acc = vl[:, 0].clone()
    for i in range(1, vl.shape[1]):
        acc.add_(vl[:, i])
    return acc


def _head_tree(per_head: torch.Tensor, comm: Comm | None, replicas: int) -> torch.Tensor:
    """Sum [heads_local, D] over all heads of `comm`: gather every rank's heads in rank (= head)
    order, then one pairwise tree over all of them, so the split never shapes the tree.

    With KV heads replicated over `replicas` consecutive ranks, each head is taken once.
    """
    if comm is None or comm.size == 1:
        return tree_sum(per_head, 0)
    parts = comm.all_gather(per_head.contiguous(), "norm-head-tree")
    return tree_sum(torch.cat(parts[::replicas], 0), 0)


def _rms_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:   # the Triton kernel (kernels/triton_norm.py): same tree, CUDA bits
        from rlkernel.kernels import triton_norm
        return triton_norm.rms_stats(x, eps)
    h = x.shape[-1]
    ms = tree_sum(x * x, -1) / h
    r = rsqrt32(ms + eps)
    return r, x * r[..., None]


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps, tree, head_comm, replicas):
        x = x.to(torch.float32)
        r, xh = _rms_stats(x, eps)
        ctx.save_for_backward(xh, r, w)
        ctx.tree, ctx.head_comm, ctx.replicas = tree, head_comm, replicas
        return xh * w.to(torch.float32)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xh, r, w = ctx.saved_tensors
        g = dy * w.to(torch.float32)
        h = xh.shape[-1]
        dx = r[..., None] * (g - xh * (tree_sum(g * xh, -1) / h)[..., None])
        dw = None
        if ctx.needs_input_grad[1]:
            per_tok = (dy * xh).reshape(xh.shape[0], -1, h)   # [L, heads or 1, H]
            tree = ctx.tree or TokenTree.single()
            per_head = tree.finish(_leaf_sums(per_tok, tree.local_leaves), "token-tree-norm")
            dw = _head_tree(per_head, ctx.head_comm, ctx.replicas).to(w.dtype)
        return dx, dw, None, None, None, None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, *, tree: TokenTree | None = None,
             head_comm: Comm | None = None, replicas: int = 1) -> torch.Tensor:
    """RMSNorm over the last dim. x [L, H] or [L, heads, D] fp32, w [H] or [D] -> same shape, fp32.

    dim 0 must be this rank's token stream when a weight gradient is taken (its length a multiple
    of `tree`'s local leaves). Per-head norms (Q/K norm) sum their heads by the pairwise tree
    across `head_comm` (TP), KV heads replicated over `replicas` ranks counted once.
    """
    return _RMSNorm.apply(x, w, eps, tree, head_comm, replicas)
