"""Tests for the canonical pairwise trees (numerics/trees.py) (DESIGN.md §1, §5 "Unit").

Checked two ways: against a float64 oracle with a tolerance, and against itself under batch /
offset / shard / rank-split changes bitwise (`assert_bitwise`), each with a negative control that
shows the stock torch path differs. Helpers and in-process thread ranks: tests/kernel_helpers.py.

Run: .venv/bin/python -m pytest -q tests/test_kernels_trees.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_helpers import (
    assert_bitwise,
    assert_stock_differs,
    bits,
    randn,
)

from rlkernel.numerics.trees import tree_combine, tree_sum, tree_sum_halving, tree_sum_subtrees

# ================================================================== trees


def np_tree_sum(vals: list) -> np.float32:
    """Reference canonical tree in numpy fp32: adjacent pairs level by level, odd last carried."""
    level = [np.float32(v) for v in vals]
    while len(level) > 1:
        nxt = [np.float32(level[i] + level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def test_tree_sum_equals_reference_pairwise_tree_for_every_length_1_to_40():
    """tree_sum(x, 0)[c] == the reference adjacent-pairs tree over x[:, c] (numpy fp32) for n=1..40."""
    for n in range(1, 41):
        x = randn(n, 5, seed=n, scale=1e3) * torch.exp(randn(n, 5, seed=100 + n, scale=3))
        got = tree_sum(x, 0)
        ref = torch.tensor([float(np_tree_sum(x[:, c].tolist())) for c in range(5)], dtype=torch.float32)
        assert_bitwise(got, ref)


def test_tree_sum_any_dim_and_column_subset_bitwise():
    """tree_sum over dim d == tree_sum of movedim(d,-1); and output column c is the same whether
    the other columns are present or not (tree_sum(x[:, :k]) == tree_sum(x)[:k]).
    (No failing stock control for the column-subset part: torch.sum over dim 0 is column-invariant
    here too; the order controls are in the left-to-right / torch.sum / TP2 test below.)"""
    x = randn(3, 13, 7, seed=5)
    assert_bitwise(tree_sum(x, 1), tree_sum(x.movedim(1, -1), -1))
    assert_bitwise(tree_sum(x, 0), tree_sum(x.movedim(0, -1), -1))
    y = randn(64, 100, seed=6)
    for k in (1, 7, 64):
        assert_bitwise(tree_sum(y[:, :k], 0), tree_sum(y, 0)[:k])


@pytest.mark.parametrize("n", [8, 16, 64, 128])
def test_tree_sum_of_subtree_partials_equals_tree_sum_for_1_2_4_8_groups(n):
    """tree_sum(tree_sum_subtrees(x, g), 0) == tree_sum(x, 0) bitwise for g in 1, 2, 4, 8:
    the same bytes whether computed as 1, 2, 4 or 8 partial groups (virtual TP / CP)."""
    x = randn(n, 257, seed=n) * torch.exp(randn(n, 257, seed=n + 1, scale=4))
    full = tree_sum(x, 0)
    for g in (1, 2, 4, 8):
        parts = tree_sum_subtrees(x, g, 0)
        assert parts.shape == (g, 257)
        assert_bitwise(tree_sum(parts, 0), full)
        assert_bitwise(tree_combine(list(parts)), full)
    # other dims too
    xt = x.t().contiguous()
    assert_bitwise(tree_sum(tree_sum_subtrees(xt, 4, dim=1), 1), full)


def test_tree_sum_subtrees_rejects_unaligned_groups():
    """Groups that do not form aligned power-of-two subtrees raise ValueError."""
    with pytest.raises(ValueError):
        tree_sum_subtrees(torch.zeros(12), 2)   # 6 per group: not a power of two
    with pytest.raises(ValueError):
        tree_sum_subtrees(torch.zeros(8), 3)    # 8 % 3


def test_negative_control_left_to_right_torch_sum_and_tp2_shaped_tree_differ_from_tree():
    """Negative control for the tree properties: for 8 partials, a left-to-right sum, torch.sum and
    a TP2-shaped reduction (each of 2 ranks sums its 4 shards left to right, then the two are added)
    all differ from the canonical tree in some elements."""
    p = randn(8, 1000, seed=7)
    tree = tree_sum(p, 0)
    ltr = p[0].clone()
    for i in range(1, 8):
        ltr = ltr + p[i]
    tp2 = (((p[0] + p[1]) + p[2]) + p[3]) + (((p[4] + p[5]) + p[6]) + p[7])
    assert_stock_differs(ltr, tree)
    assert_stock_differs(p.sum(0), tree)
    assert_stock_differs(tp2, tree)


def test_tree_combine_without_holes_equals_tree_sum_of_stack():
    """tree_combine(list of n tensors) == tree_sum(stack, 0) for every n in 1..17; [] -> None."""
    assert tree_combine([]) is None
    for n in range(1, 18):
        xs = [randn(4, 6, seed=1000 + n * 31 + i) for i in range(n)]
        assert_bitwise(tree_combine(xs), tree_sum(torch.stack(xs), 0))


def test_tree_combine_holes_are_skipped_not_zero():
    """A hole is skipped, never replaced by +0.0: combine([-0.0, None]) is -0.0 (a zero leaf would
    give -0.0 + 0.0 = +0.0); all holes -> None; one present leaf passes up unchanged."""
    neg0 = torch.tensor([-0.0])
    assert bits(tree_combine([neg0, None])) == bits(neg0)
    assert bits(tree_combine([None, None, neg0, None, None])) == bits(neg0)
    assert bits(neg0 + torch.tensor([0.0])) != bits(neg0)  # why skipping matters
    assert tree_combine([None, None, None]) is None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats(-2.0**100, 2.0**100, width=32)),
                min_size=1, max_size=33))
def test_tree_combine_with_holes_matches_reference(vals):
    """tree_combine over scalars with holes == reference tree where a node with one present child
    passes it up (numpy fp32)."""
    def ref(level):
        while len(level) > 1:
            nxt = []
            for i in range(0, len(level) - 1, 2):
                a, b = level[i], level[i + 1]
                nxt.append(a if b is None else b if a is None else np.float32(a + b))
            if len(level) % 2:
                nxt.append(level[-1])
            level = nxt
        return level[0]
    leaves = [None if v is None else torch.tensor([v], dtype=torch.float32) for v in vals]
    got = tree_combine(leaves)
    r = ref([None if v is None else np.float32(v) for v in vals])
    if r is None:
        assert got is None
    else:
        assert bits(got) == bits(torch.tensor([float(r)], dtype=torch.float32))


def test_tree_combine_of_rank_subtrees_with_holes_equals_full_combine():
    """Ranks owning aligned leaf blocks each tree_combine their block (holes inside); combining the
    rank results == tree_combine of all leaves (holes are skipped identically)."""
    n = 16
    leaves = [None if i in (1, 4, 5, 6, 7, 13) else randn(3, seed=50 + i) for i in range(n)]
    full = tree_combine(leaves)
    for ranks in (2, 4, 8):
        per = n // ranks
        parts = [tree_combine(leaves[r * per:(r + 1) * per]) for r in range(ranks)]
        assert_bitwise(tree_combine(parts), full)




def np_halving_sum(vals: list) -> np.float32:
    """Reference halving tree in numpy fp32: first ⌈n/2⌉ + last ⌊n/2⌋, recursively."""
    if len(vals) == 1:
        return np.float32(vals[0])
    m = (len(vals) + 1) // 2
    return np.float32(np_halving_sum(vals[:m]) + np_halving_sum(vals[m:]))


def test_tree_sum_halving_equals_reference_and_tree_sum_at_powers_of_two():
    """tree_sum_halving over n = 1..40 == the numpy fp32 halving tree, bitwise; for n a power of
    two it == tree_sum (both the complete binary tree)."""
    for n in range(1, 41):
        x = randn(n, 5, seed=200 + n, scale=1e3)
        got = tree_sum_halving(x, 0)
        want = [np_halving_sum(x[:, j].tolist()) for j in range(5)]
        assert torch.equal(bits(got), bits(torch.tensor(np.array(want, dtype=np.float32)))), n
        if n & (n - 1) == 0:
            assert_bitwise(got, tree_sum(x, 0))
    with pytest.raises(ValueError):
        tree_sum_halving(torch.zeros(0, 3), 0)


@pytest.mark.parametrize("n", [12, 24, 6, 40])
def test_tree_sum_halving_of_equal_power_of_two_parts_equals_whole(n):
    """For every 2**k dividing n (GQA heads of a group split over the TP ranks replicating its KV
    head: 12 = 2×6 = 4×3): tree_combine of tree_sum_halving over each equal part == the halving
    tree over all n, bitwise, on any dim."""
    x = randn(7, n, 3, seed=300 + n, scale=1e3)
    whole = tree_sum_halving(x, 1)
    parts = 1
    while n % parts == 0:
        per = n // parts
        assert_bitwise(tree_combine([tree_sum_halving(x[:, i * per:(i + 1) * per], 1)
                                     for i in range(parts)]), whole)
        parts *= 2


def test_negative_control_pairwise_tree_sum_is_not_split_invariant_for_12_as_2x6():
    """Negative control (the issue-10 GQA bug): the bottom-up tree_sum over 12 heads != the tree of
    two tree_sums over 6 + 6 (it pairs across the cut), so the old head sum changed with TP."""
    x = randn(12, 4096, seed=400, scale=1e3)
    assert_stock_differs(tree_combine([tree_sum(x[:6], 0), tree_sum(x[6:], 0)]), tree_sum(x, 0))
