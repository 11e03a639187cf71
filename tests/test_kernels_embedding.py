"""Tests for the embedding lookup and its canonical gradient (kernels/embedding.py) (DESIGN.md §1, §5 "Unit").

Checked two ways: against a float64 oracle with a tolerance, and against itself under batch /
offset / shard / rank-split changes bitwise (`assert_bitwise`), each with a negative control that
shows the stock torch path differs. Helpers and in-process thread ranks: tests/kernel_helpers.py.
The sparse gradient (only the (leaf, id) partials that occur, summed per id by
fixedpoint.accumulate_segments_) is checked against a copy of the dense algorithm it replaced:
equal partials and equal int64 accumulators (torch.equal), a negative control, and a bound on
the largest tensor it creates. Its CUDA path (the segmented Triton kernel) runs here only under
TRITON_INTERPRET=1 (tests/embedding_triton_checks.py, skipped without triton).

Run: .venv/bin/python -m pytest -q tests/test_kernels_embedding.py
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import (
    NEEDS_TRITON,
    assert_bitwise,
    assert_stock_differs,
    assert_within_sum_bound,
    check_ok,
    checks_fixture,
    cp_local_rows,
    cp_tree,
    gen,
    randn,
    run_ranks,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rlkernel.kernels.embedding import (
    accumulate_embedding_grad_,
    embed,
    embedding_grad,
    leaf_partials,
)
from rlkernel.numerics import fixedpoint as fx
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




# ============================================== sparse leaf partials == the dense algorithm
# accumulate_embedding_grad_ makes only the (leaf, id) partials that occur and adds each id's
# into its row with fixedpoint.accumulate_segments_. The oracle is the algorithm it replaced
# (a copy, kept here): dense partials [leaves, present ids + 1, H], one accumulate_ over leaves.


def _dense_partials(ids, dy, offset, vocab, positions=None):
    """The replaced algorithm's partials: (part [leaves, present + 1, H] fp32, present ids);
    column c of leaf l = Σ of leaf l's dy rows with id present[c], in `positions` order
    (default 0..15); the last column collects out-of-range tokens."""
    leaves = dy.shape[0] // TOKEN_LEAF
    local = ids - offset
    inside = (local >= 0) & (local < vocab)
    present = torch.unique(local[inside])
    sink = present.numel()
    compact = torch.searchsorted(present, local.clamp(min=0))
    compact = torch.where(inside, compact, torch.full_like(compact, sink))
    cl = compact.reshape(leaves, TOKEN_LEAF)
    dyl = dy.to(torch.float32).reshape(leaves, TOKEN_LEAF, dy.shape[1])
    part = torch.zeros(leaves, sink + 1, dy.shape[1])
    leaf_idx = torch.arange(leaves)
    for i in positions or range(TOKEN_LEAF):
        part.index_put_((leaf_idx, cl[:, i]), dyl[:, i], accumulate=True)
    return part, present


def _dense_accumulate(acc, ids, dy, offset=0, positions=None):
    """The replaced accumulate_embedding_grad_ (oracle): acc += normalised exact Σ over leaves of
    the dense partials, added into the present rows with an int64 index_add_."""
    part, present = _dense_partials(ids, dy, offset, acc.shape[0], positions)
    rows = fx.accumulate_(fx.zeros((present.numel(), dy.shape[1])), part[:, :-1])
    return acc.index_add_(0, present, rows)


def _stream(case: str, seed: int):
    """(ids [L], dy [L, H], vocab, offset) of a named case."""
    g = gen(seed)
    h = 6
    if case == "single leaf":
        ids, vocab, offset = torch.randint(0, 5, (TOKEN_LEAF,), generator=g), 5, 0
    elif case == "repeats in a leaf":
        ids, vocab, offset = torch.randint(0, 4, (20 * TOKEN_LEAF,), generator=g), 8, 0
    elif case == "one id in every leaf":
        ids = torch.randint(0, 30, (40 * TOKEN_LEAF,), generator=g)
        ids[3::TOKEN_LEAF] = ids[9::TOKEN_LEAF] = 7                 # id 7 twice in every leaf
        vocab, offset = 30, 0
    elif case == "tp shard":
        ids, vocab, offset = torch.randint(0, 60, (32 * TOKEN_LEAF,), generator=g), 15, 20
    elif case == "padding id":
        ids, vocab, offset = torch.randint(0, 20, (24 * TOKEN_LEAF,), generator=g), 21, 0
        ids.view(-1, TOKEN_LEAF)[:, 11:] = 20                       # pad tail of every leaf
    elif case == "one id fills a leaf":     # a rank per position of that leaf (16 passes)
        ids, vocab, offset = torch.randint(0, 9, (6 * TOKEN_LEAF,), generator=g), 9, 0
        ids[2 * TOKEN_LEAF:3 * TOKEN_LEAF] = 4
    elif case == "no id in the shard":
        ids, vocab, offset = torch.randint(0, 10, (4 * TOKEN_LEAF,), generator=g), 5, 10
    else:
        assert case == "wide magnitudes"
        ids, vocab, offset = torch.randint(0, 12, (48 * TOKEN_LEAF,), generator=g), 12, 0
    dy = randn(ids.numel(), h, seed=seed + 1)
    if case == "padding id":
        dy[ids == 20] = 0.0
        dy[(ids == 20).nonzero()[::2, 0]] = -0.0
    if case == "wide magnitudes":   # leaf partials spanning ~2**240: only exact sums keep them
        dy *= torch.exp2(torch.randint(-120, 120, (ids.numel(), 1), generator=g).float())
        dy[5, 0], dy[40, 1], dy[41, 1] = float("nan"), float("inf"), float("-inf")
    return ids, dy, vocab, offset


CASES = ["single leaf", "repeats in a leaf", "one id in every leaf", "tp shard", "padding id",
         "wide magnitudes", "one id fills a leaf", "no id in the shard"]


@pytest.mark.parametrize("case", CASES)
def test_sparse_leaf_partials_are_the_dense_partials(case):
    """leaf_partials' P row of each occurring (leaf, id) pair == the dense partial
    part[leaf, id] of the replaced algorithm, bitwise, and every other dense partial is +0.0
    (scattering P into zeros gives the dense tensor back); offsets/rows list each id's pairs."""
    ids, dy, vocab, offset = _stream(case, seed=60)
    part, present = _dense_partials(ids, dy, offset, vocab)
    p, offsets, rows = leaf_partials(ids, dy, offset, vocab)
    local = ids - offset
    inside = (local >= 0) & (local < vocab)
    leaves = ids.numel() // TOKEN_LEAF
    keys = torch.unique(local[inside] * leaves + torch.arange(ids.numel())[inside] // TOKEN_LEAF)
    pair_id, pair_leaf = keys // leaves, keys % leaves
    assert torch.equal(rows, present)
    assert torch.equal(torch.repeat_interleave(rows, offsets.diff()), pair_id)
    dense = torch.zeros_like(part[:, :-1])
    dense[pair_leaf, torch.searchsorted(present, pair_id)] = p
    assert_bitwise(dense, part[:, :-1])


@pytest.mark.parametrize("case", CASES)
def test_accumulate_equals_the_dense_algorithm(case):
    """From a zero accumulator: accumulate_embedding_grad_ == the dense algorithm, torch.equal on
    the int64 columns. Onto an accumulator holding a previous microbatch (not normalised): the
    same value (equal once both are carry-normalised: the new path adds into the row and leaves
    it normalised, the old one index_add_-ed a normalised sum), rows of absent ids keep their
    bytes, and the rounded fp32 gradients are equal bitwise."""
    ids, dy, vocab, offset = _stream(case, seed=61)
    h = dy.shape[1]
    want = _dense_accumulate(fx.zeros((vocab, h)), ids, dy, offset)
    assert torch.equal(accumulate_embedding_grad_(fx.zeros((vocab, h)), ids, dy, offset), want)
    prev = randn(3, vocab, h, seed=62)
    acc0 = fx.accumulate_(fx.zeros((vocab, h)), prev)
    acc0 = acc0 + fx.accumulate_(fx.zeros((vocab, h)), -prev[:1])   # not normalised
    got = accumulate_embedding_grad_(acc0.clone(), ids, dy, offset)
    old = _dense_accumulate(acc0.clone(), ids, dy, offset)
    assert torch.equal(fx.normalise_(got.clone()), fx.normalise_(old.clone()))
    local = ids - offset
    absent = torch.ones(vocab, dtype=torch.bool)
    absent[local[(local >= 0) & (local < vocab)]] = False
    assert torch.equal(got[absent], acc0[absent])
    assert_bitwise(fx.round_fp32(got), fx.round_fp32(old))


@pytest.mark.parametrize("case", ["tp shard", "wide magnitudes", "padding id"])
def test_embedding_grad_autograd_and_row_chunks_equal_the_dense_algorithm(case):
    """embedding_grad(ids, dy, V, offset) == round_fp32(dense algorithm) bitwise; so is the
    autograd weight gradient of embed(ids, w, offset=...); and row chunks [a, b) (what
    GradSink.finish_now asks for: a zero accumulator, offset + a) == rows a..b of the dense
    accumulator, torch.equal."""
    ids, dy, vocab, offset = _stream(case, seed=63)
    h = dy.shape[1]
    acc = _dense_accumulate(fx.zeros((vocab, h)), ids, dy, offset)
    want = fx.round_fp32(acc)
    assert_bitwise(embedding_grad(ids, dy, vocab, offset=offset), want)
    w = randn(vocab, h, seed=64).requires_grad_()
    embed(ids, w, offset=offset).backward(dy)
    assert_bitwise(w.grad, want)
    for a in range(0, vocab, 4):
        b = min(vocab, a + 4)
        got = accumulate_embedding_grad_(fx.zeros((b - a, h)), ids, dy, offset + a)
        assert torch.equal(got, acc[a:b]), (a, b)


def test_negative_control_other_leaf_orders_and_plain_index_add_differ():
    """The bitwise comparisons can fail. Crafted stream (H = 1): leaf 0 has id 1 at positions
    0..2 with 1, 2**-24, 2**-24 (in order an fp32 sum is 1.0; reversed it is 1 + 2**-23), and
    leaves 1, 2 each add 2**-24 to id 2 after a 1.0 in leaf 0. Then the dense algorithm with
    the positions reversed gives other accumulator bytes than accumulate_embedding_grad_; a
    plain fp32 index_add_ over all tokens gives another fp32 row 2 than embedding_grad (1.0
    against the exact 1 + 2**-23 of the leaf partials); in order, the oracle matches."""
    ids = torch.zeros(3 * TOKEN_LEAF, dtype=torch.long)
    dy = torch.zeros(3 * TOKEN_LEAF, 1)
    ids[:3], dy[:3, 0] = 1, torch.tensor([1.0, 2.0**-24, 2.0**-24])
    ids[3], dy[3, 0] = 2, 1.0
    ids[TOKEN_LEAF], dy[TOKEN_LEAF, 0] = 2, 2.0**-24
    ids[2 * TOKEN_LEAF], dy[2 * TOKEN_LEAF, 0] = 2, 2.0**-24
    got = accumulate_embedding_grad_(fx.zeros((3, 1)), ids, dy)
    assert torch.equal(got, _dense_accumulate(fx.zeros((3, 1)), ids, dy))
    backwards = range(TOKEN_LEAF - 1, -1, -1)
    reversed_ = _dense_accumulate(fx.zeros((3, 1)), ids, dy, positions=backwards)
    assert not torch.equal(got, reversed_)
    stock = torch.zeros(3, 1).index_add_(0, ids, dy)
    assert_stock_differs(stock[2], embedding_grad(ids, dy, 3)[2])
    assert embedding_grad(ids, dy, 3)[2].item() == 1.0 + 2.0**-23


class _LargestTensor(TorchDispatchMode):
    """Records the largest new storage (bytes) an aten op returns while active (outputs that
    alias an input, i.e. views and in-place results, allocate nothing and are skipped)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _largest(fn) -> int:
    with _LargestTensor() as mode:
        fn()
    return mode.largest


def test_memory_no_tensor_of_the_dense_size():
    """1,024 leaves (16,384 tokens) over a 150,000-row vocab, H = 8 (~15k distinct ids): no
    tensor accumulate_embedding_grad_ creates exceeds max(P's 4·H·(L + 1) bytes, the CPU
    segment path's float64 bins, 128 bytes per element of min(G·H, 2**18)) — the dense
    partials would be 4·leaves·(G + 1)·H (~490 MB), over 30x that. Negative control: on a
    smaller case (256 leaves, 20,000 rows, H = 4) the same measure sees the dense algorithm's
    partials (>= 4·leaves·(G + 1)·H) and the new path stays under its bound."""
    def bound(ids, h, vocab):
        g = torch.unique(ids[ids < vocab]).numel()
        return max(4 * h * (ids.numel() + 1), 128 * min(g * h, fx._SEGMENT_ELEMS)), g

    ids = torch.randint(0, 150_000, (1024 * TOKEN_LEAF,), generator=gen(70))
    dy = randn(ids.numel(), 8, seed=71)
    lim, g = bound(ids, 8, 150_000)
    acc = fx.zeros((150_000, 8))
    seen = _largest(lambda: accumulate_embedding_grad_(acc, ids, dy))
    assert seen <= lim < 4 * 1024 * (g + 1) * 8 // 30, (seen, lim, g)

    ids = torch.randint(0, 20_000, (256 * TOKEN_LEAF,), generator=gen(72))
    dy = randn(ids.numel(), 4, seed=73)
    lim, g = bound(ids, 4, 20_000)
    dense = 4 * 256 * (g + 1) * 4
    acc, acc_old = fx.zeros((20_000, 4)), fx.zeros((20_000, 4))
    assert _largest(lambda: _dense_accumulate(acc_old, ids, dy)) >= dense > lim
    assert _largest(lambda: accumulate_embedding_grad_(acc, ids, dy)) <= lim


results = checks_fixture("embedding_triton_checks.py")


@NEEDS_TRITON
def test_segmented_kernel_on_leaf_partials_equals_the_dense_algorithm(results):
    """Under TRITON_INTERPRET=1 only (no GPU): triton_fixedpoint.accumulate_segments_ of
    leaf_partials == the dense algorithm's accumulator for every case above, and == the CPU path
    onto a non-normalised accumulator with H = 140 over several column blocks."""
    check_ok(results, "leaf_partial_segments_equal_the_dense_algorithm")
    check_ok(results, "leaf_partial_segments_onto_an_accumulator_over_column_blocks")
