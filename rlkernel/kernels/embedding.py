"""Token embedding lookup with a canonical, atomics-free weight gradient (torch ops; CPU or CUDA).

Forward is a row gather (exact). Backward: for each vocab row, the gradients of the tokens with that
id are summed in the canonical token order — in order inside each fine leaf of the microbatch
stream, then the pairwise tree over leaves (DESIGN.md §1 "Embedding grads"). Within a leaf, the
i-th token of every leaf is added in one `index_put_` whose (leaf, id) indices are all distinct,
so no add ever races another. Only the rows present in the microbatch are materialised.
Does not: shard the vocab (rlkernel/distributed adds vocab-parallel masking).
"""

from __future__ import annotations

import torch

from rlkernel.distributed.tokentree import TokenTree


def embedding_grad(ids: torch.Tensor, dy: torch.Tensor, vocab: int, offset: int = 0,
                   tree: TokenTree | None = None) -> torch.Tensor:
    """Canonical dW of this rank's vocab rows [offset, offset + vocab).

    ids [L] long, dy [L, H] fp32 (this rank's local stream) -> [vocab, H] fp32. Tokens outside
    the range contribute nothing. The rows present anywhere in the stream (union over `tree`'s
    ranks) are materialised per leaf.
    """
    tree = tree or TokenTree.single()
    leaves = tree.local_leaves
    n_tok, h = dy.shape
    if n_tok % leaves:
        raise ValueError(f"token tree: stream length {n_tok} is not a multiple of {leaves} leaves")
    m = n_tok // leaves
    local = ids - offset
    inside = (local >= 0) & (local < vocab)
    mine = torch.unique(local[inside]).cpu()
    everyone = tree.comm.all_gather_object(mine.tolist(), "embedding-rows")
    present = torch.tensor(sorted(set().union(*everyone)), dtype=torch.long).to(ids.device)
    sink = present.numel()                              # out-of-range tokens land in a dropped row
    compact = torch.searchsorted(present, local.clamp(min=0))
    compact = torch.where(inside, compact, torch.full_like(compact, sink))
    cl = compact.reshape(leaves, m)
    dyl = dy.to(torch.float32).reshape(leaves, m, h)
    part = torch.zeros(leaves, sink + 1, h, dtype=torch.float32, device=dy.device)
    leaf_idx = torch.arange(leaves, device=dy.device)
    for i in range(m):
        part.index_put_((leaf_idx, cl[:, i]), dyl[:, i], accumulate=True)
    out = torch.zeros(vocab, h, dtype=torch.float32, device=dy.device)
    out[present] = tree.finish(part[:, :sink], "token-tree-embedding")
    return out


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, w, offset, tree):
        ctx.save_for_backward(ids)
        ctx.vocab, ctx.offset, ctx.tree, ctx.w_dtype = w.shape[0], offset, tree, w.dtype
        local = ids - offset
        inside = (local >= 0) & (local < w.shape[0])
        rows = w[local.clamp(0, w.shape[0] - 1)].to(torch.float32)
        return torch.where(inside[:, None], rows, torch.zeros_like(rows))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (ids,) = ctx.saved_tensors
        g = embedding_grad(ids, dy, ctx.vocab, ctx.offset, ctx.tree).to(ctx.w_dtype)
        return None, g, None, None


def embed(ids: torch.Tensor, w: torch.Tensor, *, offset: int = 0,
          tree: TokenTree | None = None) -> torch.Tensor:
    """Rows of this rank's vocab shard w [V_local, H] for ids [L] -> [L, H] fp32.

    Rows of ids outside [offset, offset + V_local) are 0 (another TP rank owns them; the model
    picks the owner's row exactly). Canonical gradient, see module doc.
    """
    return _Embedding.apply(ids, w, offset, tree)
