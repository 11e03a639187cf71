"""Token embedding lookup with a canonical, atomics-free weight gradient (torch ops; CPU or CUDA).

Forward is a row gather (exact). Backward: for each vocab row, the gradients of the tokens with that
id are summed by the canonical token reduction (distributed/tokensum.py) — in order inside each
leaf of TOKEN_LEAF tokens, the leaf partials added exactly (DESIGN.md §1 "Embedding grads").
Within a pair (leaf, id), the r-th token of every pair is added in one pass that writes distinct
rows, so no add ever races another. Only the (leaf, id) pairs that occur are
materialised (at most one per token), and each id's pairs go into its accumulator row in one
segmented exact sum: memory O(L·H), not O(leaves · distinct ids · H).
Does not: shard the vocab (rlkernel/distributed adds vocab-parallel masking).
"""

from __future__ import annotations

import torch

from rlkernel.distributed.tokensum import TokenSum, leaves_of
from rlkernel.numerics import fixedpoint as fx
from rlkernel.spec import TOKEN_LEAF


def accumulate_embedding_grad_(acc: torch.Tensor, ids: torch.Tensor, dy: torch.Tensor,
                               offset: int = 0) -> torch.Tensor:
    """acc [vocab, H, N_COLS] += the exact sum of the leaf partials of this rank's vocab rows
    [offset, offset + vocab). ids [L] long, dy [L, H] (a local stream of whole leaves).
    Tokens outside the range contribute nothing. Returns acc.

    Leaf partial P[l, v] = the fp32 sum of leaf l's dy rows with id v, in position order from
    0.0. Only the (leaf, id) pairs that occur are made: `leaf_partials`, one row each. Then each
    id's pairs are added exactly into its row of acc (`fixedpoint.accumulate_segments_`: one
    Triton launch on CUDA); the rows of the ids present leave carry-normalised, the others are
    untouched. Memory beyond acc and dy: P, 4·H·(pairs + 1) <= 4·H·(L + 1) bytes; int64 index
    tensors of L entries (< 100·L bytes); the dy[:, i] slice an index_put_ reads (4·H·L/16);
    an fp32 copy of dy (4·H·L) if dy is bf16/fp16; on CPU the segment path's bounded
    temporaries (~80 MB, fixedpoint.accumulate_segments_torch_). At qwen3-1.7b's 16,384 tokens
    and H = 2048: P <= 128 MiB (the dense partials were ~100 GiB). Never [leaves, ids, H] nor
    [vocab, H] floats.
    """
    return fx.accumulate_segments_(acc, *leaf_partials(ids, dy, offset, acc.shape[0]))


def leaf_partials(ids: torch.Tensor, dy: torch.Tensor, offset: int,
                  vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The leaf partials of the ids in [offset, offset + vocab) as segments: (P [pairs, H] fp32,
    offsets [G + 1], rows [G]) — one row of P per (leaf, id) pair that occurs, sorted by (id,
    leaf); the pairs of local id rows[g] (ascending) are P[offsets[g]:offsets[g + 1]].
    P's row of (l, v) = the sum of leaf l's dy rows with id v, added in position order onto 0.0.
    A token's rank is its place among its pair's tokens in position order; the rank-r tokens of
    every pair are added in one gather-add-scatter (one token per pair each time, so no two
    adds meet), r = 0, 1, ...: as many passes as the most repeated id of a leaf has tokens,
    not one sort-based `index_put_` per leaf position. Tokens outside the range are not added.
    One host sync (the pair count and the tokens per rank)."""
    leaves = leaves_of(dy.shape[0])
    n_tok, h = dy.shape
    local = ids - offset
    inside = (local >= 0) & (local < vocab)
    leaf = torch.arange(n_tok, device=dy.device) // TOKEN_LEAF
    # Key (id, leaf) as one integer; out-of-range tokens share the largest key (no pair of P).
    key = torch.where(inside, local * leaves + leaf, torch.full_like(local, vocab * leaves))
    keys, pair = torch.unique(key, return_inverse=True)
    by_pair = torch.sort(pair, stable=True).indices       # pairs grouped, positions ascending
    counts = torch.bincount(pair, minlength=keys.numel())
    first = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(pair)
    rank[by_pair] = torch.arange(n_tok, device=dy.device) - first[pair[by_pair]]
    # a pair lies in one leaf, so ranks are < TOKEN_LEAF; outside tokens get TOKEN_LEAF (never added)
    rank = torch.where(inside, rank, torch.full_like(rank, TOKEN_LEAF))
    by_rank = torch.sort(rank * keys.numel() + pair).indices          # rank-major, then pair
    per_rank = torch.bincount(rank, minlength=TOKEN_LEAF + 1)[:TOKEN_LEAF]
    n_pairs_t = (keys < vocab * leaves).sum().view(1)
    host = torch.cat([n_pairs_t, per_rank]).tolist()
    n_pairs, per_rank = host[0], host[1:]
    dyf = dy.to(torch.float32)
    part = torch.zeros(keys.numel(), h, dtype=torch.float32, device=dy.device)
    at = 0
    for size in per_rank:
        if size == 0:       # ranks are dense from 0: the first empty one ends them
            break
        tok = by_rank[at:at + size]
        dest = pair[tok]
        # a gather, an add and a scatter to distinct rows, not index_add_: CUDA's fp32 atomic
        # add flushes subnormals to zero, torch's add does not
        part.index_copy_(0, dest, part.index_select(0, dest) + dyf.index_select(0, tok))
        at += size
    rows, counts = torch.unique_consecutive(keys[:n_pairs] // leaves, return_counts=True)
    offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=dy.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return part[:n_pairs], offsets, rows


def _accumulate_rows_(acc: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                      dy: torch.Tensor, offset: int) -> torch.Tensor:
    """acc [R, H, N_COLS] += the exact sums of the leaf partials of the local rows `rows`
    (ascending long [R], a superset of the local ids present in ids - offset), row i of acc for
    local row rows[i]: `accumulate_embedding_grad_`'s sums, on a compact accumulator."""
    vocab = int(rows[-1]) + 1 if rows.numel() else 0
    part, offsets, present = leaf_partials(ids, dy, offset, vocab)
    return fx.accumulate_segments_(acc, part, offsets, torch.searchsorted(rows, present))


def embedding_grad(ids: torch.Tensor, dy: torch.Tensor, vocab: int, offset: int = 0,
                   tok: TokenSum | None = None) -> torch.Tensor:
    """Canonical dW [vocab, H] fp32 of this rank's vocab rows [offset, offset + vocab), finished
    across `tok.comm` (ids [L] long, dy [L, H] fp32: this rank's local stream)."""
    tok = tok or TokenSum.single()
    acc = accumulate_embedding_grad_(fx.zeros((vocab, dy.shape[1]), dy.device), ids, dy, offset)
    return tok.comm.sum_ints_finished(acc, "token-sum-embedding", fx.round_fp32)


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
        if tok.add_split_rows(ctx.w, lambda rows, acc: _accumulate_rows_(acc, rows, ids, dy,
                                                                         ctx.offset)):
            return None, None, None, None
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
    if tok is not None and torch.is_grad_enabled() and w.requires_grad:
        # A tied weight's sink can then finish the LM head's dense dW directly and keep only
        # these rows' exact sums for the lookup's backward (tokensum.GradSink.note_rows).
        tok.note_rows(w, ids, offset)
    return _Embedding.apply(ids, w, offset, tok)
