"""Token embedding lookup with a canonical, atomics-free weight gradient (torch ops; CPU or CUDA).

Forward is a row gather (exact). Backward: for each vocab row, the gradients of the tokens with that
id are summed by the canonical token reduction (distributed/tokensum.py) — in order inside each
leaf of TOKEN_LEAF tokens, the leaf partials added exactly (DESIGN.md §1 "Embedding grads").
Within a leaf, the i-th token of every leaf is added in one `index_put_` whose (leaf, id) indices
are all distinct, so no add ever races another. Only the rows present on this rank are
materialised per leaf.
Does not: shard the vocab (rlkernel/distributed adds vocab-parallel masking).
"""

from __future__ import annotations

import torch

from rlkernel.distributed.tokensum import TokenSum, leaves_of
from rlkernel.numerics import fixedpoint as fx


def accumulate_embedding_grad_(acc: torch.Tensor, ids: torch.Tensor, dy: torch.Tensor,
                               offset: int = 0) -> torch.Tensor:
    """acc [vocab, H, N_COLS] += the exact sum of the leaf partials of this rank's vocab rows
    [offset, offset + vocab). ids [L] long, dy [L, H] fp32 (a local stream of whole leaves).
    Tokens outside the range contribute nothing. Returns acc."""
    vocab = acc.shape[0]
    leaves = leaves_of(dy.shape[0])
    n_tok, h = dy.shape
    m = n_tok // leaves
    local = ids - offset
    inside = (local >= 0) & (local < vocab)
    present = torch.unique(local[inside])
    sink = present.numel()                              # out-of-range tokens land in a dropped row
    compact = torch.searchsorted(present, local.clamp(min=0))
    compact = torch.where(inside, compact, torch.full_like(compact, sink))
    cl = compact.reshape(leaves, m)
    dyl = dy.to(torch.float32).reshape(leaves, m, h)
    part = torch.zeros(leaves, sink + 1, h, dtype=torch.float32, device=dy.device)
    leaf_idx = torch.arange(leaves, device=dy.device)
    for i in range(m):
        part.index_put_((leaf_idx, cl[:, i]), dyl[:, i], accumulate=True)
    rows = fx.accumulate_(fx.zeros((sink, h), dy.device), part[:, :sink])
    acc.index_add_(0, present, rows)    # integer adds: exact
    return acc


def embedding_grad(ids: torch.Tensor, dy: torch.Tensor, vocab: int, offset: int = 0,
                   tok: TokenSum | None = None) -> torch.Tensor:
    """Canonical dW [vocab, H] fp32 of this rank's vocab rows [offset, offset + vocab), finished
    across `tok.comm` (ids [L] long, dy [L, H] fp32: this rank's local stream)."""
    tok = tok or TokenSum.single()
    acc = accumulate_embedding_grad_(fx.zeros((vocab, dy.shape[1]), dy.device), ids, dy, offset)
    return fx.round_fp32(tok.comm.sum_ints(acc, "token-sum-embedding"))


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, w, offset, tok):
        ctx.save_for_backward(ids)
        # The parameter itself (not a copy) keys the gradient sink's accumulator.
        ctx.w, ctx.offset, ctx.tok = w, offset, tok
        local = ids - offset
        inside = (local >= 0) & (local < w.shape[0])
        rows = w[local.clamp(0, w.shape[0] - 1)].to(torch.float32)
        return torch.where(inside[:, None], rows, torch.zeros_like(rows))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (ids,) = ctx.saved_tensors
        tok = ctx.tok or TokenSum.single()
        if tok.finish_now(ctx.w, lambda a, b, acc: accumulate_embedding_grad_(
                acc, ids, dy, ctx.offset + a), "token-sum-embedding"):
            return None, None, None, None
        acc = accumulate_embedding_grad_(tok.accumulator(ctx.w), ids, dy, ctx.offset)
        return None, tok.result(ctx.w, acc, "token-sum-embedding"), None, None


def embed(ids: torch.Tensor, w: torch.Tensor, *, offset: int = 0,
          tok: TokenSum | None = None) -> torch.Tensor:
    """Rows of this rank's vocab shard w [V_local, H] for ids [L] -> [L, H] fp32.

    Rows of ids outside [offset, offset + V_local) are 0 (another TP rank owns them; the model
    picks the owner's row exactly). Canonical gradient, see module doc.
    """
    return _Embedding.apply(ids, w, offset, tok)
