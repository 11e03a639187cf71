"""Tests for the embedding lookup and its canonical gradient (kernels/embedding.py) (DESIGN.md §1, §5 "Unit").

Checked two ways: against a float64 oracle with a tolerance, and against itself under batch /
offset / shard / rank-split changes bitwise (`assert_bitwise`), each with a negative control that
shows the stock torch path differs. Helpers and in-process thread ranks: tests/kernel_helpers.py.

Run: .venv/bin/python -m pytest -q tests/test_kernels_embedding.py
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import (
    assert_bitwise,
    assert_stock_differs,
    assert_within_sum_bound,
    cp_local_rows,
    cp_tree,
    gen,
    randn,
    run_ranks,
)

from rlkernel.kernels.embedding import embed, embedding_grad
from rlkernel.spec import TOKEN_LEAF

# ================================================================== embedding


def test_embed_forward_is_exact_gather_and_grad_is_canonical():
    """embed(ids, w) == w[ids] bitwise; its autograd weight grad == embedding_grad(ids, dy, V)
    bitwise, has w's dtype, is within γ_{TOKEN_LEAF+1} Σ|dy| of the float64 index_add oracle (only
    the in-leaf adds round; leaves add exactly), and rows of ids that do not occur are exactly
    +0.0."""
    V, H, L = 50, 24, 512
    ids = torch.randint(0, 40, (L,), generator=gen(47))
    w = randn(V, H, seed=48).requires_grad_()
    dy = randn(L, H, seed=49)
    y = embed(ids, w)
    assert_bitwise(y, w.detach()[ids])
    y.backward(dy)
    ref_grad = embedding_grad(ids, dy, V)
    assert_bitwise(w.grad, ref_grad)
    oracle = torch.zeros(V, H, dtype=torch.float64).index_add_(0, ids, dy.double())
    absref = torch.zeros(V, H, dtype=torch.float64).index_add_(0, ids, dy.double().abs())
    assert_within_sum_bound(ref_grad, oracle, absref, TOKEN_LEAF + 1)
    assert_bitwise(ref_grad[40:], torch.zeros(10, H))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_embedding_grad_on_zigzag_cp_ranks_equals_single_process_bytes(cp):
    """embedding_grad(ids_local, dy_local, V, tok=tok) on each of cp in-process ranks (zig-zag
    segments: every rank adds its own leaves exactly, the integer accumulators are summed over the
    ranks) == embedding_grad of the whole stream, on every rank, bitwise."""
    V, H, L = 30, 16, 512
    ids = torch.randint(0, V, (L,), generator=gen(50))
    dy = randn(L, H, seed=51)
    full = embedding_grad(ids, dy, V)

    def rank(r, comm):
        rows = cp_local_rows(L, cp, r)
        return embedding_grad(ids[rows], dy[rows], V, tok=cp_tree(comm, cp))

    for got in run_ranks(cp, rank):
        assert_bitwise(got, full)


def test_embedding_vocab_shards_are_slices_of_the_full_grad_and_lookup():
    """A vocab shard [o, o+Vl) (TP vocab-parallel): embed(ids, w[o:o+Vl], offset=o) == w[ids] for ids
    in the shard and exactly +0.0 elsewhere; embedding_grad(ids, dy, Vl, offset=o) == rows o.. of
    the full embedding_grad, bitwise. (No failing stock control: a row gather is exact, and CPU
    index_add_ restricted to a shard's rows adds each row's tokens in the same order.)"""
    V, H, L = 40, 8, 256
    ids = torch.randint(0, V, (L,), generator=gen(56))
    w, dy = randn(V, H, seed=57), randn(L, H, seed=58)
    full = embedding_grad(ids, dy, V)
    for o, vl in ((0, 10), (10, 10), (20, 20)):
        inside = (ids >= o) & (ids < o + vl)
        y = embed(ids, w[o:o + vl], offset=o)
        assert_bitwise(y[inside], w[ids[inside]])
        assert_bitwise(y[~inside], torch.zeros(int((~inside).sum()), H))
        assert_bitwise(embedding_grad(ids, dy, vl, offset=o), full[o:o + vl])


def test_negative_control_stock_index_add_embedding_grad_changes_with_cp_split():
    """Negative control: stock index_add_ over the whole stream != tree of per-piece index_add_ (CP=2)."""
    V, H, L = 30, 16, 512
    ids = torch.randint(0, V, (L,), generator=gen(50))
    dy = randn(L, H, seed=51)
    full = torch.zeros(V, H).index_add_(0, ids, dy)
    halves = [torch.zeros(V, H).index_add_(0, ids[r * 256:(r + 1) * 256], dy[r * 256:(r + 1) * 256])
              for r in range(2)]
    assert_stock_differs(halves[0] + halves[1], full)


def test_embedding_grad_row_unaffected_by_unrelated_tokens():
    """Row v of embedding_grad depends only on the tokens with id v (values and positions): changing
    the ids and dY of every other token leaves row v's bytes unchanged.
    (No failing stock control: CPU index_add_ also adds a row's tokens in index order.)"""
    V, H, L = 40, 16, 256
    ids = torch.randint(0, V, (L,), generator=gen(52))
    dy = randn(L, H, seed=53)
    v = int(ids[5])
    other = ids != v
    ids2 = ids.clone()
    ids2[other] = torch.randint(0, V, (int(other.sum()),), generator=gen(54))
    ids2[other & (ids2 == v)] = (v + 1) % V
    dy2 = dy.clone()
    dy2[other] = randn(int(other.sum()), H, seed=55)
    assert_bitwise(embedding_grad(ids2, dy2, V)[v], embedding_grad(ids, dy, V)[v])


