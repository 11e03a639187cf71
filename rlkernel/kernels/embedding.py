"""Token embedding lookup with a canonical, atomics-free weight gradient (CPU).

Forward is a row gather (exact). Backward: for each vocab row, the gradients of the tokens with that
id are summed in the canonical token order — in order inside each fine leaf of the microbatch
stream, then the pairwise tree over leaves (DESIGN.md §1 "Embedding grads"). Within a leaf, the
i-th token of every leaf is added in one `index_put_` whose (leaf, id) indices are all distinct,
so no add ever races another. Only the rows present in the microbatch are materialised.
Does not: shard the vocab (rlkernel/dist adds vocab-parallel masking).
"""

from __future__ import annotations

import torch

from rlkernel.kernels.matmul import TOKEN_LEAVES
from rlkernel.numerics.trees import tree_sum


def embedding_grad(ids: torch.Tensor, dy: torch.Tensor, vocab: int,
                   leaves: int = TOKEN_LEAVES) -> torch.Tensor:
    """Canonical dW of an embedding. ids [L] long, dy [L, H] fp32 -> [vocab, H] fp32."""
    n_tok, h = dy.shape
    if n_tok % leaves:
        raise ValueError(f"token tree: stream length {n_tok} is not a multiple of {leaves} leaves")
    m = n_tok // leaves
    present, compact = torch.unique(ids, return_inverse=True)
    cl = compact.reshape(leaves, m)
    dyl = dy.to(torch.float32).reshape(leaves, m, h)
    part = torch.zeros(leaves, present.numel(), h, dtype=torch.float32, device=dy.device)
    leaf_idx = torch.arange(leaves, device=dy.device)
    for i in range(m):
        part.index_put_((leaf_idx, cl[:, i]), dyl[:, i], accumulate=True)
    out = torch.zeros(vocab, h, dtype=torch.float32, device=dy.device)
    out[present] = tree_sum(part, 0)
    return out


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.vocab = w.shape[0]
        ctx.w_dtype = w.dtype
        return w[ids].to(torch.float32)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (ids,) = ctx.saved_tensors
        return None, embedding_grad(ids, dy, ctx.vocab).to(ctx.w_dtype)


def embed(ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rows of w [V, H] for ids [L] long -> [L, H] fp32 (canonical gradient, see module doc)."""
    return _Embedding.apply(ids, w)
