"""Canonical reduction trees: one fixed binary tree of IEEE adds, whatever the layout.

`tree_sum` reduces a dimension pairwise (adjacent pairs, level by level; an odd last element is
carried up unchanged). For a power-of-two length that is the complete binary tree, so any aligned
block of 2**k leaves is a subtree: a rank that owns such a block can reduce it locally and a tree
collective can finish the same tree (DESIGN.md §1, virtual-TP trees).
`tree_combine` is the same tree over a list of tensors with optional holes (absent leaves are
skipped, never replaced by a zero, so the sign of a zero never depends on who owns what).
`tree_sum_halving` is the top-down halving tree: for a length that is not a power of two it is
the tree whose top levels still cut the dim into any 2**k equal parts (GQA query heads split over
the TP ranks that replicate their KV head, e.g. 12 heads as 2 × 6 or 4 × 3).

Does not: communicate. The distributed halves live in rlkernel/distributed/.
"""

from __future__ import annotations

from typing import Sequence

import torch


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum `x` over `dim` by the canonical pairwise tree; the dim is removed.

    Shapes: x [..., n, ...] -> [...]; dtype kept. Every add is a separate elementwise kernel, so the
    result of each output element depends only on the values reduced, not on the other elements.
    """
    x = x.movedim(dim, -1)
    while x.shape[-1] > 1:
        n = x.shape[-1]
        even = n - (n % 2)
        s = x[..., 0:even:2] + x[..., 1:even:2]
        x = torch.cat([s, x[..., even:]], dim=-1) if n % 2 else s
    return x[..., 0]


def tree_sum_halving(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum `x` over `dim` by the top-down halving tree; the dim is removed.

    Shapes: x [..., n, ...] (n >= 1) -> [...]; dtype kept. sum(a..b) = sum(first ⌈n/2⌉) +
    sum(last ⌊n/2⌋), recursively. Why not `tree_sum`: when 2**k divides n, the top k levels of
    this tree cut the dim into 2**k equal contiguous parts, so holders of those parts can reduce
    them locally and finish with `tree_combine` over the 2**k partials (in order) — the same bits
    for every such split. The bottom-up `tree_sum` has that property only when each part's length
    is a power of two (it pairs heads 4 and 5 of 12, across the 6|6 cut). For a power-of-two n both
    are the complete binary tree, so they agree bit for bit there.
    """
    n = x.shape[dim]
    if n < 1:
        raise ValueError(f"tree_sum_halving: cannot sum an empty dim (length {n})")
    if n & (n - 1) == 0:
        return tree_sum(x, dim)   # the complete binary tree: identical, and vectorised
    m = (n + 1) // 2
    return tree_sum_halving(x.narrow(dim, 0, m), dim) + tree_sum_halving(x.narrow(dim, m, n - m), dim)


def tree_combine(leaves: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Sum a list of same-shaped tensors by the canonical pairwise tree over their indices.

    `None` marks an absent leaf; a node with one present child passes it up unchanged. Returns
    None when every leaf is absent. Leaf i of a list of length 2**k pairs with i ^ 1 first, so the
    result equals tree_sum(stack(leaves), 0) when no leaf is absent.
    """
    level: list[torch.Tensor | None] = list(leaves)
    if not level:
        return None
    while len(level) > 1:
        nxt: list[torch.Tensor | None] = []
        for i in range(0, len(level) - 1, 2):
            a, b = level[i], level[i + 1]
            nxt.append(a if b is None else b if a is None else a + b)
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def tree_sum_subtrees(x: torch.Tensor, groups: int, dim: int = 0) -> torch.Tensor:
    """Reduce `x` over `dim` in `groups` aligned subtrees, keeping one partial per group.

    Shapes: x [..., n, ...] with n % groups == 0 and n // groups a power of two -> [..., groups, ...].
    tree_sum of the result over that dim equals tree_sum(x, dim) bitwise when n is a power of two:
    this is what a rank owning `n // groups` leaves sends to a tree collective.
    """
    n = x.shape[dim]
    per = n // groups
    if n % groups or per & (per - 1):
        raise ValueError(f"tree_sum_subtrees: {n} leaves cannot form {groups} aligned power-of-two "
                         "subtrees")
    x = x.movedim(dim, -1)
    x = x.reshape(*x.shape[:-1], groups, per)
    return tree_sum(x, -1).movedim(-1, dim)
