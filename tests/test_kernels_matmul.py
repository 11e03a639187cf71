"""Tests for the batch-invariant matmul, column-/row-parallel linears and the exact token-sum dW
(kernels/matmul.py) (DESIGN.md §1, §5 "Unit").

Checked two ways: against a float64 oracle with a tolerance, and against itself under batch /
offset / shard / rank-split changes bitwise (`assert_bitwise`), each with a negative control that
shows the stock torch path differs. Helpers and in-process thread ranks: tests/kernel_helpers.py.

Run: .venv/bin/python -m pytest -q tests/test_kernels_matmul.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import (
    assert_bitwise,
    assert_near,
    assert_stock_differs,
    assert_within_sum_bound,
    cp_local_rows,
    cp_tree,
    n_diff,
    randn,
    run_ranks,
)

from rlkernel.kernels import matmul as matmul_mod
from rlkernel.kernels.matmul import (
    column_parallel_dx,
    column_parallel_linear,
    linear_nt,
    row_parallel_linear,
    row_parallel_nt,
    row_parallel_partials,
    seq_matmul,
    accumulate_grad_weight_,
    grad_weight,
    token_grad_weight,
    token_leaf_partials,
    virtual_shard_rows,
)
from rlkernel.numerics import fixedpoint as fx
from rlkernel.numerics.trees import tree_combine, tree_sum
from rlkernel.spec import TOKEN_LEAF, VIRTUAL_TP

# ================================================================== matmul

K_MM, N_MM = 128, 256  # stock fp32 GEMM changes row 0 / split columns at these shapes
M_SIZES = (1, 7, 64, 200, 257)


def _mm_inputs(seed=10):
    return randn(257 + 17, K_MM, seed=seed), randn(N_MM, K_MM, seed=seed + 1)


def test_seq_matmul_vs_float64_oracle_within_summation_bound():
    """seq_matmul(a, b) - a@b (float64) <= γ_K Σ_k |a_ik b_kj| elementwise, and the typical relative
    error is ~1e-7; batch dims broadcast; K = 0 gives zeros; K mismatch raises ValueError."""
    a, b = randn(3, 33, 200, seed=11), randn(200, 50, seed=12)
    got = seq_matmul(a, b)
    ref = a.double() @ b.double()
    assert got.shape == (3, 33, 50) and got.dtype == torch.float32
    assert_within_sum_bound(got, ref, a.double().abs() @ b.double().abs(), 200)
    rel = ((got.double() - ref).abs() / ref.abs().clamp_min(1e-3)).median()
    assert float(rel) < 1e-6
    assert_bitwise(seq_matmul(torch.zeros(4, 0), torch.zeros(0, 3)), torch.zeros(4, 3))
    with pytest.raises(ValueError):
        seq_matmul(torch.zeros(2, 3), torch.zeros(4, 5))


@pytest.mark.parametrize("kernel", ["linear_nt", "row_parallel_nt", "column_parallel_dx"])
def test_matmul_row_at_batch_1_equals_row_at_batch_M_and_at_offset_17(kernel):
    """Output row r is byte-identical for M in {1, 7, 64, 200, 257} (row r at batch M1 == row r at
    batch M2) and when the input rows are shifted down by 17 (row r == row r+17 of the batch with
    17 other rows in front)."""
    x, w = _mm_inputs()
    fn = {"linear_nt": lambda a: linear_nt(a, w),
          "row_parallel_nt": lambda a: row_parallel_nt(a, w),
          "column_parallel_dx": lambda a: column_parallel_dx(a, w.t().contiguous())}[kernel]
    big = fn(x[17:17 + 257])
    shifted = fn(x[:17 + 257])
    for m in M_SIZES:
        assert_bitwise(fn(x[17:17 + m]), big[:m])
    assert_bitwise(shifted[17:], big)


def test_negative_control_stock_matmul_row0_changes_with_M_and_offset():
    """Negative control: stock x @ w.t() and F.linear: row 0 at batch 1 != row 0 at batch M for every
    M in {7, 64, 200, 257}; row 0 alone != the same row at offset 17 (batch of 18); and for the
    column-parallel dX shape, stock dy @ w row 0 at batch 1 != at batch 64."""
    x, w = _mm_inputs()
    r1, f1 = (x[17:18] @ w.t())[0], F.linear(x[17:18], w)[0]
    for m in M_SIZES[1:]:
        assert_stock_differs(r1, (x[17:17 + m] @ w.t())[0])
        assert_stock_differs(f1, F.linear(x[17:17 + m], w)[0])
    assert_stock_differs(r1, (x[:18] @ w.t())[17])
    wt = w.t().contiguous()
    assert_stock_differs((x[17:18] @ wt)[0], (x[17:17 + 64] @ wt)[0])


def test_linear_nt_columns_identical_when_N_is_split():
    """linear_nt(x, w)[:, cols] == linear_nt(x, w[cols]) for 8 equal shards and uneven splits
    (8|248, 250|6, 5|128|123): column j's bytes do not depend on which other columns exist."""
    x, w = _mm_inputs()
    x = x[:64]
    full = linear_nt(x, w)
    for cuts in ([32 * i for i in range(9)], [0, 8, 256], [0, 250, 256], [0, 5, 133, 256]):
        parts = torch.cat([linear_nt(x, w[a:b]) for a, b in zip(cuts, cuts[1:])], 1)
        assert_bitwise(parts, full)


def test_negative_control_stock_matmul_columns_change_when_N_is_split():
    """Negative control: stock x @ w.t() with N split (1|255, 8|248 or 7|249) != unsplit (M = 64).

    Which split changes bits depends on the CPU's BLAS: on some AVX512 machines only the 1-column
    split (a GEMV path) differs, on others every split; at least one must differ."""
    x, w = _mm_inputs()
    x = x[:64]
    full = x @ w.t()
    diffs = [n_diff(torch.cat([x @ w[:c].t(), x @ w[c:].t()], 1), full) for c in (1, 8, 7)]
    assert max(diffs) > 0, f"negative control: stock torch did not differ for any N split ({diffs})"


def test_seq_matmul_chunking_of_rows_does_not_change_bits(monkeypatch):
    """seq_matmul / token_grad_weight cut work into chunks above _CHUNK_ELEMS; forcing tiny
    chunks gives the same bytes as no chunking. (Internal knob: no stock analogue to control.)"""
    a, b = randn(2, 37, 40, seed=13), randn(40, 29, seed=14)
    dy, x = randn(256, 24, seed=15), randn(256, 16, seed=16)
    ref, ref_dw = seq_matmul(a, b), token_grad_weight(dy, x)
    monkeypatch.setattr(matmul_mod, "_CHUNK_ELEMS", 64)
    assert_bitwise(seq_matmul(a, b), ref)
    assert_bitwise(token_grad_weight(dy, x), ref_dw)


def test_row_parallel_nt_equals_tree_over_partials_computed_as_1_2_4_8_groups():
    """row_parallel_nt(x, w) == tree_sum(row_parallel_partials) == tree over t groups for t in
    1, 2, 4, 8, where group g owns K slice g (8/t aligned virtual shards), sums its shards locally
    with row_parallel_nt(.., shards=8/t), and the group results are tree-summed (TP=t)."""
    x, w = randn(40, 128, seed=17), randn(96, 128, seed=18)
    full = row_parallel_nt(x, w)
    assert_bitwise(tree_sum(row_parallel_partials(x, w), 0), full)
    for t in (1, 2, 4, 8):
        kg = 128 // t
        groups = [row_parallel_nt(x[:, g * kg:(g + 1) * kg], w[:, g * kg:(g + 1) * kg], shards=8 // t)
                  for g in range(t)]
        assert_bitwise(tree_sum(torch.stack(groups), 0), full)
        assert_bitwise(tree_combine(groups), full)
    with pytest.raises(ValueError):
        row_parallel_nt(randn(2, 12, seed=0), randn(3, 12, seed=1))


@pytest.mark.parametrize("n", [96, 12])
def test_column_parallel_dx_equals_tree_over_1_2_4_8_rank_groups(n):
    """column_parallel_dx(dy, w) == tree over t groups (t = 1, 2, 4, 8), group g owning the rows
    virtual_shard_rows(N, t)[g] and computing column_parallel_dx(dy[:, rows], w[rows], 8/t)
    locally (TP=t) — also for N = 12, not a multiple of the 8 virtual shards (k/v projections of
    kv_heads·head_dim = 1·12: shards of 1 or 2 rows)."""
    dy, w = randn(40, n, seed=19), randn(n, 72, seed=20)
    full = column_parallel_dx(dy, w)
    for t in (1, 2, 4, 8):
        groups = [column_parallel_dx(dy[:, a:b], w[a:b], shards=8 // t)
                  for a, b in virtual_shard_rows(n, t)]
        assert_bitwise(tree_combine(groups), full)
    with pytest.raises(ValueError):
        column_parallel_dx(dy[:, :0], w[:0])


@pytest.mark.parametrize("n", [3, 5])
def test_column_parallel_dx_skips_empty_shards_so_a_negative_zero_stays(n):
    """N < 8 rows leave virtual shards empty: they are absent leaves of the tree, never +0.0
    added, so dY = −0.0 gives dX = −0.0 exactly (as the tree over the non-empty shards and every
    TP grouping of them does); adding an empty shard as +0.0 would give +0.0."""
    dy, w = torch.full((2, n), -0.0), torch.ones(n, 4)
    full = column_parallel_dx(dy, w)
    assert_bitwise(full, torch.full((2, 4), -0.0))
    for t in (1, 2, 4, 8):
        groups = [column_parallel_dx(dy[:, a:b], w[a:b], shards=8 // t) if b > a else None
                  for a, b in virtual_shard_rows(n, t)]
        assert_bitwise(tree_combine(groups), full)


def test_virtual_shard_rows_are_the_same_cut_at_every_tp():
    """virtual_shard_rows(N, 8): floor bounds, sizes differing by at most one, empty shards when
    N < 8; the aligned block of 8/t shards of rank r starts at ⌊r·N/t⌋ for every t | 8; and a
    block of exactly N/t rows cut locally into 8/t shards gives the global bounds shifted."""
    assert virtual_shard_rows(12) == ((0, 1), (1, 3), (3, 4), (4, 6), (6, 7), (7, 9), (9, 10),
                                      (10, 12))
    assert virtual_shard_rows(3) == ((0, 0), (0, 0), (0, 1), (1, 1), (1, 1), (1, 2), (2, 2),
                                     (2, 3))
    for n in range(1, 70):
        b = virtual_shard_rows(n)
        assert b[0][0] == 0 and b[-1][1] == n
        assert all(x[1] == y[0] for x, y in zip(b, b[1:]))
        assert max(y - x for x, y in b) - min(y - x for x, y in b) <= 1
        for t in (1, 2, 4, 8):
            per = 8 // t
            for r in range(t):
                assert b[r * per][0] == r * n // t
                if n % t == 0:
                    local = virtual_shard_rows(n // t, per)
                    assert tuple((x + r * n // t, y + r * n // t) for x, y in local) == \
                        b[r * per:(r + 1) * per]
    with pytest.raises(ValueError):
        virtual_shard_rows(-1)


def test_negative_control_stock_tp_split_of_the_reduction_dimension_changes_bits():
    """Negative control: stock matmul with the reduced dim split over TP=1 vs TP=2 ranks (each rank
    one GEMM over its slice, rank results tree-summed) differ — for x@wᵀ over K and dy@w over N."""
    x, w = randn(40, 128, seed=17), randn(96, 128, seed=18)
    tp1 = x @ w.t()
    tp2 = x[:, :64] @ w[:, :64].t() + x[:, 64:] @ w[:, 64:].t()
    assert_stock_differs(tp1, tp2)
    dy, w2 = randn(40, 96, seed=19), randn(96, 72, seed=20)
    assert_stock_differs(dy @ w2, dy[:, :48] @ w2[:48] + dy[:, 48:] @ w2[48:])


def test_row_parallel_and_column_dx_vs_float64_oracle():
    """row_parallel_nt and column_parallel_dx are within the γ_K summation bound of float64."""
    x, w = randn(40, 128, seed=21), randn(96, 128, seed=22)
    assert_within_sum_bound(row_parallel_nt(x, w), x.double() @ w.double().t(),
                            x.double().abs() @ w.double().abs().t(), 128)
    dy = randn(40, 96, seed=23)
    assert_within_sum_bound(column_parallel_dx(dy, w), dy.double() @ w.double(),
                            dy.double().abs() @ w.double().abs(), 96)


L_TOK = 512  # stream length: 32 leaves of TOKEN_LEAF = 16 tokens


def _dw_inputs():
    return randn(L_TOK, 48, seed=24), randn(L_TOK, 40, seed=25)


def _leaf_acc(dy, x):
    """The exact accumulator of a stream's dW (the integer state a rank sends)."""
    return accumulate_grad_weight_(fx.zeros((dy.shape[1], x.shape[1])), dy, x)


def test_token_grad_weight_is_the_exact_sum_of_leaf_partials_rounded_once_and_float64():
    """token_grad_weight(dy, x) == fixedpoint.exact_sum_fp32(token_leaf_partials(dy, x, L/16))
    bitwise (each leaf: 16 tokens in order), has shape [N, K], is within γ_{16} Σ|terms| of float64
    dyᵀx (only the in-leaf fp32 adds round; the exact sum and its one rounding add ≤ u); a stream
    that is not whole leaves raises ValueError."""
    dy, x = _dw_inputs()
    dw = token_grad_weight(dy, x)
    parts = token_leaf_partials(dy, x, L_TOK // TOKEN_LEAF)
    assert parts.shape == (L_TOK // TOKEN_LEAF, 48, 40) and dw.shape == (48, 40)
    assert_bitwise(dw, fx.exact_sum_fp32(parts))
    assert_within_sum_bound(dw, dy.double().t() @ x.double(),
                            dy.double().abs().t() @ x.double().abs(), TOKEN_LEAF + 1)
    with pytest.raises(ValueError):
        token_grad_weight(dy[:100], x[:100])


def test_token_dw_of_any_grouping_and_order_of_whole_leaves_equals_the_stream():
    """dW is a function of the SET of leaves: cutting the stream's 32 leaves into any groups
    (microbatches of 1, 3, 4 or 32 leaves, or DP/CP ranks), shuffling their order, accumulating
    each group separately and adding the integer accumulators gives the stream's bytes.
    Negative control: the same groups summed as fp32 partials per group (what per-microbatch
    accumulation does) differ from the ungrouped fp32 sum."""
    dy, x = _dw_inputs()
    full = token_grad_weight(dy, x)
    leaves = L_TOK // TOKEN_LEAF
    perm = torch.randperm(leaves, generator=torch.Generator().manual_seed(3)).tolist()
    for size in (1, 3, 4, leaves):
        groups = [perm[i:i + size] for i in range(0, leaves, size)]
        total = fx.zeros((48, 40))
        for g in groups:
            rows = torch.cat([torch.arange(j * TOKEN_LEAF, (j + 1) * TOKEN_LEAF) for j in g])
            total += _leaf_acc(dy[rows], x[rows])
        assert_bitwise(fx.round_fp32(total), full)
    parts = token_leaf_partials(dy, x, leaves)
    whole = parts.sum(0)
    grouped = torch.stack([parts[i:i + 3].sum(0) for i in range(0, leaves, 3)]).sum(0)
    assert_stock_differs(whole, grouped)


def test_negative_control_stock_dw_changes_with_cp_split():
    """Negative control: stock dyᵀ @ x over the whole stream != tree over the CP=2 (and 4) ranks'
    stock dy_rᵀ @ x_r, each rank holding its zig-zag segments (the layout CP really uses)."""
    dy, x = _dw_inputs()
    full = dy.t() @ x
    for cp in (2, 4):
        rows = [cp_local_rows(L_TOK, cp, r) for r in range(cp)]
        assert_stock_differs(tree_sum(torch.stack([dy[i].t() @ x[i] for i in rows]), 0), full)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_grad_weight_on_zigzag_cp_ranks_equals_single_process_bytes(cp):
    """grad_weight(dy_local, x_local, w, tok) on each of cp in-process ranks (zig-zag segments,
    accumulators summed over the ranks as integers) == token_grad_weight(dy, x) of the whole
    stream, on every rank, bitwise; the same through row_parallel_linear(.., tok=tok)'s dW."""
    dy, x = _dw_inputs()
    w = randn(48, 40, seed=27, scale=0.2)
    ref = token_grad_weight(dy, x)

    def rank(r, comm):
        rows = cp_local_rows(L_TOK, cp, r)
        tok = cp_tree(comm, cp)
        direct = grad_weight(dy[rows], x[rows], w, tok)
        ww = w.clone().requires_grad_()
        row_parallel_linear(x[rows], ww, tok=tok).backward(dy[rows])
        return direct, ww.grad

    for direct, via_linear in run_ranks(cp, rank):
        assert_bitwise(direct, ref)
        assert_bitwise(via_linear, ref)


def test_token_dw_identical_for_streams_differing_only_in_padding_rows_x():
    """Two streams of equal length whose last 100 rows are padding (dY = 0) and differ only in those
    rows' X values give identical dW bytes; so does the stream cut before its all-padding leaves.

    No failing stock control: stock dyᵀ @ x also gives identical bytes here (the GEMM's order does
    not depend on values, and 0·x adds an exact ±0), so this test has no negative twin."""
    dy, x = _dw_inputs()
    dy = dy.clone()
    dy[-100:] = 0.0
    x2 = x.clone()
    x2[-100:] = randn(100, 40, seed=26, scale=1e4)
    assert_bitwise(token_grad_weight(dy, x), token_grad_weight(dy, x2))
    assert_bitwise(token_grad_weight(dy[:416], x[:416]), token_grad_weight(dy, x))


@pytest.mark.parametrize("which", ["column", "row"])
def test_parallel_linear_autograd_vs_float64_and_equals_the_invariant_kernels(which):
    """column_parallel_linear(x, [w]) / row_parallel_linear(x, w) (single process: all 8 virtual
    shards local, no token-tree communicator): forward and backward (dX, dW) agree with float64
    torch autograd (max error <= 1e-5 of max|ref|, median relative error < 1e-6), and are bitwise
    the invariant kernels: y = linear_nt / row_parallel_nt; dX = column_parallel_dx(dy, w)
    (column) or linear_nt(dy, wᵀ) (row); dW = token_grad_weight(dy, x)."""
    L, K, N = 256, 64, 48
    x = randn(L, K, seed=27).requires_grad_()
    w = randn(N, K, seed=28, scale=0.2).requires_grad_()
    dy = randn(L, N, seed=29)
    if which == "column":
        (y,) = column_parallel_linear(x, [w])
    else:
        y = row_parallel_linear(x, w)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 @ w64.t()
    y64.backward(dy.double())
    for got, ref in ((y.detach(), y64.detach()), (x.grad, x64.grad), (w.grad, w64.grad)):
        assert_near(got, ref, atol=1e-5 * float(ref.abs().max()))
        rel = ((got.double() - ref).abs() / ref.abs().clamp_min(1e-2)).median()
        assert float(rel) < 1e-6
    xd, wd = x.detach(), w.detach()
    if which == "column":
        assert_bitwise(y.detach(), linear_nt(xd, wd))
        assert_bitwise(x.grad, column_parallel_dx(dy, wd))
    else:
        assert_bitwise(y.detach(), row_parallel_nt(xd, wd))
        assert_bitwise(x.grad, linear_nt(dy, wd.t()))
    assert_bitwise(w.grad, token_grad_weight(dy, xd))


def _fused_column_grads(x, ws, dys, **kw):
    xx = x.clone().requires_grad_()
    wws = [w.clone().requires_grad_() for w in ws]
    ys = column_parallel_linear(xx, wws, **kw)
    torch.autograd.backward(ys, dys)
    return [y.detach() for y in ys], xx.grad, [w.grad for w in wws]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_fused_column_parallel_linear_tp_ranks_tree_to_the_tp1_bytes(tp):
    """Fused projections (q, k, v sharing x): TP rank j of tp holds rows j of each weight and
    local_shards = 8/tp; its outputs are the matching column slices of the TP1 outputs, its dW
    the matching row slices, and the tree over ranks of its local dX subtrees == the TP1 dX —
    all bitwise. TP1 dX is within 1e-5·max|ref| of float64. (Negative control: stock dy@w with N
    split over TP ranks differs — test_negative_control_stock_tp_split_of_the_reduction_dimension.)"""
    L, K = 128, 40
    ns = (64, 16, 16)
    x = randn(L, K, seed=90)
    ws = [randn(n, K, seed=91 + i, scale=0.3) for i, n in enumerate(ns)]
    dys = [randn(L, n, seed=95 + i) for i, n in enumerate(ns)]
    ys1, dx1, dws1 = _fused_column_grads(x, ws, dys)
    ref_dx = sum(dy.double() @ w.double() for dy, w in zip(dys, ws))
    assert_near(dx1, ref_dx, atol=1e-5 * float(ref_dx.abs().max()))
    rank_dx = []
    for j in range(tp):
        sl = [slice(j * n // tp, (j + 1) * n // tp) for n in ns]
        ys, dx, dws = _fused_column_grads(x, [w[s] for w, s in zip(ws, sl)],
                                          [dy[:, s] for dy, s in zip(dys, sl)],
                                          local_shards=VIRTUAL_TP // tp)
        for a, b, s in zip(ys, ys1, sl):
            assert_bitwise(a, b[:, s])
        for a, b, s in zip(dws, dws1, sl):
            assert_bitwise(a, b[s])
        rank_dx.append(dx)
    assert_bitwise(tree_sum(torch.stack(rank_dx), 0), dx1)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_fused_column_parallel_linear_with_a_replicated_12_row_kv_head_trees_to_the_tp1_bytes(tp):
    """q (64 rows) + k, v of one KV head with head_dim 12 (12 rows: not a multiple of the 8
    virtual shards): TP1 dX (default shard_rows: virtual_shard_rows, shards of 1 or 2 k/v rows)
    is within 1e-5·max|ref| of float64 — no row dropped — and TP rank j of tp, holding q rows j
    and the whole KV head (replicated) but owning only its virtual shards' k/v rows
    (shard_rows = virtual_shard_rows(12)[j·8/tp : (j+1)·8/tp]), returns a local dX subtree; the
    tree over ranks == TP1 dX, bitwise."""
    L, K = 128, 24
    ns = (64, 12, 12)
    x = randn(L, K, seed=190)
    ws = [randn(n, K, seed=191 + i, scale=0.3) for i, n in enumerate(ns)]
    dys = [randn(L, n, seed=195 + i) for i, n in enumerate(ns)]
    _, dx1, _ = _fused_column_grads(x, ws, dys)
    ref_dx = sum(dy.double() @ w.double() for dy, w in zip(dys, ws))
    assert_near(dx1, ref_dx, atol=1e-5 * float(ref_dx.abs().max()))
    per = VIRTUAL_TP // tp
    rank_dx = []
    for j in range(tp):
        q_rows = slice(j * 64 // tp, (j + 1) * 64 // tp)
        kv_rows = virtual_shard_rows(12)[j * per:(j + 1) * per]
        _, dx, _ = _fused_column_grads(
            x, [ws[0][q_rows], ws[1], ws[2]], [dys[0][:, q_rows], dys[1], dys[2]],
            shard_rows=[virtual_shard_rows(64 // tp, per), kv_rows, kv_rows], local_shards=per)
        rank_dx.append(dx)
    assert_bitwise(tree_combine(rank_dx), dx1)
    with pytest.raises(ValueError):   # a range outside the weight's rows
        column_parallel_linear(x, [ws[1]], shard_rows=[[(0, 13)]], local_shards=1)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_row_parallel_linear_tp_ranks_tree_to_the_tp1_bytes(tp):
    """row_parallel_linear: TP rank j holding K slice j with local_shards = 8/tp returns its subtree;
    the tree over ranks == the TP1 output; its dX is the K slice j of the TP1 dX and its dW the
    column slice j of the TP1 dW — bitwise. (Negative control: stock x@wᵀ with K split over TP
    ranks differs — test_negative_control_stock_tp_split_of_the_reduction_dimension.)"""
    L, K, N = 128, 64, 24
    x, w, dy = randn(L, K, seed=100), randn(N, K, seed=101, scale=0.2), randn(L, N, seed=102)

    def run(xs, ws, **kw):
        xx, wwt = xs.clone().requires_grad_(), ws.clone().requires_grad_()
        y = row_parallel_linear(xx, wwt, **kw)
        y.backward(dy)
        return y.detach(), xx.grad, wwt.grad

    y1, dx1, dw1 = run(x, w)
    kj = K // tp
    outs = []
    for j in range(tp):
        y, dx, dw = run(x[:, j * kj:(j + 1) * kj], w[:, j * kj:(j + 1) * kj], local_shards=VIRTUAL_TP // tp)
        assert_bitwise(dx, dx1[:, j * kj:(j + 1) * kj])
        assert_bitwise(dw, dw1[:, j * kj:(j + 1) * kj])
        outs.append(y)
    assert_bitwise(tree_sum(torch.stack(outs), 0), y1)




# ================================================================== bf16 compute dtype


def _linear_grads(which, x, w, dy, **kw):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = column_parallel_linear(x, [w], **kw)[0] if which == "column" else \
        row_parallel_linear(x, w, **kw)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("which", ["column", "row"])
def test_bf16_compute_dtype_is_the_fp32_chain_on_rounded_operands(which):
    """compute_dtype=bf16 (--dtype bf16) rounds x before the forward product and dY before the
    dX and dW products, and nothing else: y, dX, dW are bitwise the fp32 kernels fed x.bf16() and
    dy.bf16() (on CPU a bf16×bf16 product is exact in fp32, so the sequential chain is the same).
    Negative control: without the rounding points (fp32 compute) y, dX and dW all differ."""
    L, K, N = 64, 64, 48
    x, dy = randn(L, K, seed=61), randn(L, N, seed=62)
    w = randn(N, K, seed=63, scale=0.2).bfloat16().float()        # a bf16 model's weights
    got = _linear_grads(which, x, w, dy, compute_dtype=torch.bfloat16)
    want = _linear_grads(which, x.bfloat16().float(), w, dy.bfloat16().float())
    for g, r in zip(got, want):
        assert_bitwise(g, r)
    fp32 = _linear_grads(which, x, w, dy)
    assert all(n_diff(g, r) > 0 for g, r in zip(got, fp32))


@pytest.mark.parametrize("which", ["column", "row"])
def test_bf16_compute_dtype_rounds_weights_that_hold_no_bf16_value(which):
    """A bf16 run's parameters hold bf16 values, but one whose low bits changed (a fault, a
    bit flip: test_faults) must compute as its bf16 rounding: with fp32 weights that are not
    bf16 values, y, dX and dW of compute_dtype=bf16 are bitwise the fp32 kernels fed x, w and
    dy rounded to bf16 (the column case fuses two weights, as gate/up). Negative controls: the
    weights really are not bf16 values, and their fp16 rounding is another tensor (so rounding
    w to any other 16-bit format, or not at all, would fail the equality)."""
    L, K = 64, 64
    ns = (48, 40) if which == "column" else (48,)
    x = randn(L, K, seed=161)
    ws = [randn(n, K, seed=162 + i, scale=0.2) for i, n in enumerate(ns)]
    dys = [randn(L, n, seed=165 + i) for i, n in enumerate(ns)]
    bf = [t.bfloat16().float() for t in ws]
    for w, wb in zip(ws, bf):
        assert n_diff(w, wb) > 0 and n_diff(w.half().float(), wb) > 0

    def grads(x, ws, dys, **kw):
        xx, wws = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
        ys = column_parallel_linear(xx, wws, **kw) if which == "column" else \
            (row_parallel_linear(xx, wws[0], **kw),)
        torch.autograd.backward(ys, dys)
        return [y.detach() for y in ys] + [xx.grad] + [w.grad for w in wws]

    got = grads(x, ws, dys, compute_dtype=torch.bfloat16)
    want = grads(x.bfloat16().float(), bf, [dy.bfloat16().float() for dy in dys])
    for g, r in zip(got, want):
        assert_bitwise(g, r)


def test_bf16_compute_dtype_batch_invariant_and_vs_float64():
    """bf16 compute keeps batch invariance (row 0 alone == row 0 in a batch of 257, bitwise) and
    stays within bf16 rounding of the float64 product (relative 2**-7 per operand: the bound
    |y − y64| <= 2·2**-8·Σ|x||w| + fp32 summation error)."""
    x, w = randn(257, 96, seed=64), randn(40, 96, seed=65).bfloat16().float()
    (full,) = column_parallel_linear(x, [w], compute_dtype=torch.bfloat16)
    (one,) = column_parallel_linear(x[:1], [w], compute_dtype=torch.bfloat16)
    assert_bitwise(one[0], full[0])
    ref = x.double() @ w.double().t()
    bound = 2 * 2.0 ** -8 * (x.double().abs() @ w.double().abs().t()) + 1e-5
    assert bool(((full.double() - ref).abs() <= bound).all())


def test_native_arm_on_cpu_stays_fp32_under_a_bf16_compute_dtype():
    """--mode native's linears and attention (model/ops.NativeOps) compute in the compute dtype
    only on CUDA; on CPU tensors a bf16 compute dtype leaves them the fp32 stock ops, bitwise
    (docs/ARCHITECTURE.md "Native mode": the CPU control stays fp32). Negative control: the
    same stock ops on bf16-rounded operands give other bytes here."""
    from rlkernel.distributed.parallel import ParallelCtx
    from rlkernel.model.ops import NativeOps
    pc = ParallelCtx.single()
    x, w = randn(32, 64, seed=181), randn(48, 64, seed=182, scale=0.2)
    (col,) = NativeOps.col(x, [w], None, VIRTUAL_TP, pc, torch.bfloat16)
    row = NativeOps.row(x, w, VIRTUAL_TP, pc, torch.bfloat16)
    for got in (col, row):
        assert got.dtype == torch.float32
        assert_bitwise(got, F.linear(x, w))
    assert n_diff(F.linear(x.bfloat16(), w.bfloat16()).float(), F.linear(x, w)) > 0
    q, k, v = randn(1, 4, 24, 16, seed=183), randn(1, 2, 24, 16, seed=184), randn(1, 2, 24, 16,
                                                                                    seed=185)
    q_pos, kv_len = torch.arange(24)[None], torch.tensor([24])
    att = [NativeOps.attention(q, k, v, q_pos, kv_len, 0.25, pc, cd, dense_causal=dense)
           for dense in (False, True) for cd in (torch.bfloat16, torch.float32)]
    assert_bitwise(att[0], att[1])
    assert_bitwise(att[2], att[3])
    kk, vv = (t.repeat_interleave(2, dim=1) for t in (k, v))
    bf = F.scaled_dot_product_attention(q.bfloat16(), kk.bfloat16(), vv.bfloat16(),
                                        is_causal=True, scale=0.25).float()
    assert n_diff(bf, att[3]) > 0


def test_compute_dtype_outside_the_allowed_set_is_refused():
    """float16 (or any dtype but fp32/bf16) is refused before any work, naming the choices."""
    x, w = randn(16, 8, seed=66), randn(4, 8, seed=67)
    with pytest.raises(ValueError, match="float16.*allowed: torch.float32, torch.bfloat16"):
        column_parallel_linear(x, [w], compute_dtype=torch.float16)
    with pytest.raises(ValueError, match="float16"):
        row_parallel_linear(x, w, compute_dtype=torch.float16)
