"""The checks behind tests/test_attention_bwd_triton.py: the CUDA attention backward's Triton kernels
(rlkernel/kernels/triton_attention_bwd.py) run by Triton's CPU interpreter (TRITON_INTERPRET=1,
chosen before triton is imported, so this runs in its own process).

What the interpreter can show: the kernels' logic (masks, leaf gathering, skips, chunking, the
exact sums) against a float64 autograd oracle, and the structural invariances that hold for any
dot whose element depends only on its own row, column and operand shape: a sample's bytes alone
vs in a batch, the CP split of the query leaves, a Tq split, the TP head split, the chunk sizes.
bf16 runs with the interpreter's bf16 dot made exact (tests/triton_interpreter_compat.py).
What it cannot: the GPU's dot orders. numpy's matmul, which the interpreter uses, may round an
element differently for another operand shape or memory alignment (seen with numpy 2.4), so
every check that compares two layouts bitwise runs with tl.dot replaced by a sequential
multiply-add chain per element (`triton_interpreter_compat.sequential_dot`: an element depends on its row, column and
K order only, the property the GPU's dots have); one check also uses it to pin the summation
orders the module doc names (keys ascending in dQ, positions ascending in a leaf, dK scaled last);
tests/test_cuda_attention_bwd.py checks the same properties on the GPU with the real tables.
The forward here is the Triton forward (also interpreted); where layouts change, the backward is
given the full run's out/lse rows so that only the backward is under test.
Ranks run one after another (kernel_helpers.run_ranks_sequentially), not as threads: the
interpreter keeps its launch state in globals.
Prints one JSON object {check name: "ok" or the failure}: the named checks, or all.
Run by hand: TRITON_INTERPRET=1 .venv/bin/python tests/attention_bwd_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import warnings

import numpy as np
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("attention_bwd_triton_checks.py needs TRITON_INTERPRET=1")

import triton_interpreter_compat  # noqa: F401 - before any launch
from triton_interpreter_compat import sequential_dot, triton_bf16 as _triton_bf16
import triton
import triton.language as tl
from kernel_helpers import (
    NAN,
    ReplayComm,
    assert_bitwise,
    assert_near,
    attention_oracle64,
    n_diff,
    randn,
    run_checks,
    run_ranks_sequentially,
)
from test_kernels_attention import _pack as _pack_cpu

from rlkernel.distributed import tokensum
from rlkernel.distributed.parallel import cp_segments
from rlkernel.distributed.tokensum import TokenSum
from rlkernel.kernels import triton_attention as ta
from rlkernel.kernels import triton_attention_bwd as tb
from rlkernel.numerics import fixedpoint as fx
from rlkernel.numerics import triton_fixedpoint as tfx
from rlkernel.numerics.trees import tree_sum_halving

D = 16
SCALE = 1.0 / math.sqrt(D)
TOL = 1e-5
"""Oracle tolerance, relative to max|ref| of each gradient: fp32 sums of at most ~100 terms of
O(1) products keep the error near 1e-6 of that (measured: < 3e-7)."""
CHECKS = {}
# The forward's row max over a padding row of NaN garbage warns in numpy; that row is zeroed.
warnings.filterwarnings("ignore", "All-NaN slice encountered", RuntimeWarning)
# exp(s − lse) of a masked pair may overflow in numpy; tl.where selects 0 there.
warnings.filterwarnings("ignore", "overflow encountered in exp", RuntimeWarning)


LEAF = tb.CUDA_DKV_LEAF
"""The kernels' leaf: samples are packed at its multiples, as the trainer does on CUDA."""


def _pack(lengths, **kw):
    return _pack_cpu(lengths, leaf=LEAF, **kw)


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _fwd(q, k, v, q_pos, kv_len):
    return ta.attention_forward(q, k, v, q_pos, kv_len, SCALE)


def _bwd(q, k, v, out, lse, d_out, q_pos, kv_len, **kw):
    return tb.attention_backward(q, k, v, out, lse, d_out, q_pos, kv_len, SCALE, **kw)


def _assert_plus_zero(t: torch.Tensor) -> None:
    assert bool((t.contiguous().view(torch.int32) == 0).all()), "not all +0.0"


@functools.cache
def packed():
    """3 packed samples (lengths 100, 90, 66; NaN in every padding slot), d_out, and the full
    forward/backward (the backward with the sequential dot, as the layout checks that compare
    with it): (inputs tuple, out, lse, d_out, (dq, dk, dv))."""
    q, k, v, q_pos, kv_len, q_idx, sl, _ = _pack([100, 90, 66], seed=76)
    d_out = randn(*q.shape, seed=77)
    out, lse = _fwd(q, k, v, q_pos, kv_len)
    with sequential_dot():
        grads = _bwd(q, k, v, out, lse, d_out, q_pos, kv_len)
    return (q, k, v, q_pos, kv_len, q_idx, sl), out, lse, d_out, grads


@functools.cache
def small():
    """2 packed samples (lengths 70, 41) in a 256-row stream, and their full backward."""
    q, k, v, q_pos, kv_len, q_idx, sl, _ = _pack([70, 41], seed=90)
    d_out = randn(*q.shape, seed=91)
    out, lse = _fwd(q, k, v, q_pos, kv_len)
    with sequential_dot():
        grads = _bwd(q, k, v, out, lse, d_out, q_pos, kv_len)
    return (q, k, v, q_pos, kv_len, q_idx, sl), out, lse, d_out, grads


def _near_oracle(q, k, v, q_pos, kv_len, d_out, out, grads) -> None:
    ref = attention_oracle64(q, k, v, q_pos, kv_len, d_out, SCALE)
    here = (q_pos >= 0)[:, None, :, None]
    assert_near(torch.where(here, out, 0.0), ref[0], atol=2e-6)
    for got, want in zip(grads, ref[1:]):
        assert_near(got, want, atol=TOL * float(want.abs().max()))
    _assert_plus_zero(grads[0][~here.expand_as(grads[0])])
    jk = torch.arange(k.shape[2])[None, None, :, None] >= kv_len[:, None, None, None]
    for t in grads[1:]:
        _assert_plus_zero(t[jk.expand_as(t)])


@check
def packed_batch_vs_float64():
    """3 packed samples, NaN garbage in padding: dQ/dK/dV within TOL·max|ref| of float64;
    padding query rows and key slots past kv_len are +0.0."""
    (q, k, v, q_pos, kv_len, *_), out, _, d_out, grads = packed()
    _near_oracle(q, k, v, q_pos, kv_len, d_out, out, grads)


@check
def kv_len_below_positions_and_cp_offset_layout_vs_float64():
    """Sample 0: 71 queries, kv_len 50 (queries 50..70 see keys < 50), keys 50..90 NaN. Sample 1:
    slot t holds position 40 + t (a chunk/CP layout: keys 0..39 have no query here), positions
    48..63 absent (a leaf another rank holds), 91 keys. Both within TOL of float64."""
    tq, tk = 51, 91
    q = randn(2, 4, tq, D, seed=1)
    k, v = randn(2, 2, tk, D, seed=2), randn(2, 2, tk, D, seed=3)
    k[0, :, 50:], v[0, :, 50:] = NAN, NAN
    q_pos = torch.stack([torch.arange(20, 71), torch.arange(40, 91)])
    q_pos[1, 8:24] = -1
    q[1, :, 8:24] = NAN
    kv_len = torch.tensor([50, 91])
    d_out = randn(*q.shape, seed=4)
    out, lse = _fwd(q, k, v, q_pos, kv_len)
    _near_oracle(q, k, v, q_pos, kv_len, d_out, out, _bwd(q, k, v, out, lse, d_out, q_pos, kv_len))


@check
def leaf_whose_last_query_is_a_tile_first_key_vs_float64():
    """The (leaf, key tile) pairs whose only seeing query sits at the tile's first key (the
    `jt <= seen` boundary): sample 0 has 129 tokens (leaf 2 holds position 128 alone); sample 1
    has 80 queries and kv_len 65 (leaf 1 sees key 64 only; keys past it NaN). Within TOL of
    float64, padding +0.0."""
    q, k, v, q_pos, kv_len, *_ = _pack([129, 80], seed=351)
    kv_len[1] = 65
    k[1, :, 65:], v[1, :, 65:] = NAN, NAN
    d_out = randn(*q.shape, seed=352)
    out, lse = _fwd(q, k, v, q_pos, kv_len)
    _near_oracle(q, k, v, q_pos, kv_len, d_out, out, _bwd(q, k, v, out, lse, d_out, q_pos, kv_len))


@check
def sample_alone_equals_sample_in_batch():
    """Each sample's dQ/dK/dV alone (S=1, Tq = Tk = its length) == its rows in the padded
    3-sample batch, bitwise (the backward given the batch's out/lse rows)."""
    with sequential_dot():
        (q, k, v, q_pos, kv_len, *_), out, lse, d_out, ref = packed()
        for i, n in enumerate([100, 90, 66]):
            got = _bwd(*(t[i:i + 1, :, :n] for t in (q, k, v, out)), lse[i:i + 1, ..., :n],
                       d_out[i:i + 1, :, :n], q_pos[i:i + 1, :n], kv_len[i:i + 1])
            for a, b in zip(got, ref):
                assert_bitwise(a[0], b[i, :, :n])


def _cp_rank_sel(q_idx, sl, cp, r):
    seg = torch.div(q_idx, sl // (2 * cp), rounding_mode="floor")
    return torch.isin(seg, torch.tensor(cp_segments(cp, r))) & (q_idx >= 0)


@check
def cp_zigzag_ranks_give_single_process_bytes():
    """CP = 2 (zig-zag segments of whole leaves; each rank's other queries are padding, its
    tok = the CP group): on every rank dK/dV == the single-process bytes and its own dQ rows ==
    the single-process rows. Negative control: the ranks' dK rounded separately and added in fp32
    differ from the single-process dK."""
    with sequential_dot():
        (q, k, v, q_pos, kv_len, q_idx, sl), out, lse, d_out, ref = small()
        pos = [torch.where(_cp_rank_sel(q_idx, sl, 2, r), q_pos, -1) for r in range(2)]
        assert all(bool((p >= 0).any()) for p in pos)
        res = run_ranks_sequentially(2, lambda r, c: _bwd(q, k, v, out, lse, d_out, pos[r], kv_len,
                                                          tok=TokenSum(c)))
        for r, (dq, dk, dv) in enumerate(res):
            sel = (pos[r] >= 0)[:, None, :, None].expand_as(dq)
            assert_bitwise(dq[sel], ref[0][sel])
            assert_bitwise(dk, ref[1])
            assert_bitwise(dv, ref[2])
        alone = [_bwd(q, k, v, out, lse, d_out, p, kv_len)[1] for p in pos]
        assert n_diff(alone[0] + alone[1], ref[1]) > 0, "control: fp32 sum of rank results matched"


def _cp_sums(late: bool, digit_elems: int = 0) -> dict[str, int]:
    """CP = 2 as above, each rank's tok holding a gradient sink opened late or not (no sink);
    dK/dV == the single-process bytes on every rank, its dQ rows too, no late flag counted.
    Returns the calls of Comm.finish_words (words) and TokenSum.round_exact (digits) per rank
    pass. digit_elems: tb.DIGIT_ELEMS for the run (slices of a chunk)."""
    calls = {"words": 0, "digits": 0}
    real_words, real_round, real_elems = ReplayComm.finish_words, TokenSum.round_exact, \
        tb.DIGIT_ELEMS

    def spy_words(self, *a, **kw):
        calls["words"] += 1
        return real_words(self, *a, **kw)

    def spy_round(self, *a, **kw):
        calls["digits"] += 1
        return real_round(self, *a, **kw)

    def rank(r, comm):
        sink = None
        if late:
            sink = tokensum.GradSink({"dp_cp": comm, "world": comm})
            sink.begin({}, late=True)
        got = _bwd(q, k, v, out, lse, d_out, pos[r], kv_len, tok=TokenSum(comm, sink=sink))
        assert sink is None or int(sink.late_counter(torch.device("cpu"))) == 0
        return got
    ReplayComm.finish_words, TokenSum.round_exact = spy_words, spy_round
    tb.DIGIT_ELEMS = digit_elems or real_elems
    try:
        with sequential_dot():
            (q, k, v, q_pos, kv_len, q_idx, sl), out, lse, d_out, ref = small()
            pos = [torch.where(_cp_rank_sel(q_idx, sl, 2, r), q_pos, -1) for r in range(2)]
            res = run_ranks_sequentially(2, rank)
    finally:
        ReplayComm.finish_words, TokenSum.round_exact = real_words, real_round
        tb.DIGIT_ELEMS = real_elems
    for r, (dq, dk, dv) in enumerate(res):
        sel = (pos[r] >= 0)[:, None, :, None].expand_as(dq)
        assert_bitwise(dq[sel], ref[0][sel])
        assert_bitwise(dk, ref[1])
        assert_bitwise(dv, ref[2])
    return calls


@check
def cp_zigzag_ranks_in_a_late_sink_sum_the_words():
    """CP = 2, each rank's tok holding a late gradient sink (the trainer's first pass): the
    dK/dV chunks are summed over the ranks as double words (Comm.finish_words), never as
    digits (round_exact), the single-process bytes — also with DIGIT_ELEMS = 96, so a chunk
    goes in several slices (each slice its own words). Without a late sink (no sink, or the
    second pass) every chunk goes as digits: a rank with a flagged program must take the
    digits, and so must every other rank, at the same collectives."""
    late = _cp_sums(late=True)
    assert late["digits"] == 0 and late["words"] > 0, late
    sliced = _cp_sums(late=True, digit_elems=96)
    assert sliced["digits"] == 0 and sliced["words"] > 2 * late["words"], (sliced, late)
    eager = _cp_sums(late=False)
    assert eager["words"] == 0 and eager["digits"] > 0, eager


@check
def tq_split_into_two_calls_gives_the_full_bytes():
    """Queries [0, 64) in one call (Tq 64: one whole leaf) and [64, 70) in another (slot t =
    position 64 + t),
    every key in both, the exact sums joined over a 2-rank group: dK/dV == the full call's, dQ rows
    == its rows (dQ tile pinned: the interpreter's numpy dot may round by operand shape)."""
    with sequential_dot():
        (q, k, v, q_pos, kv_len, *_), out, lse, d_out, _ = small()
        q, k, v, out, lse, d_out, q_pos, kv_len = (t[:1] for t in (q, k, v, out, lse, d_out, q_pos,
                                                                    kv_len))
        tile = (16, 4, 1)
        full = _bwd(q, k, v, out, lse, d_out, q_pos, kv_len, dq_tile=tile)
        cuts = [(0, LEAF), (LEAF, 70)]

        def part(r, comm):
            a, b = cuts[r]
            return _bwd(q[:, :, a:b], k, v, out[:, :, a:b], lse[..., a:b], d_out[:, :, a:b],
                        q_pos[:, a:b], kv_len, tok=TokenSum(comm), dq_tile=tile)

        for (a, b), (dq, dk, dv) in zip(cuts, run_ranks_sequentially(2, part)):
            assert_bitwise(dq, full[0][:, :, a:b])
            assert_bitwise(dk, full[1])
            assert_bitwise(dv, full[2])


@check
def kv_head_replicated_over_tp_ranks_gives_single_process_bytes():
    """One KV head shared by 6 query heads; TP = 2 ranks hold 3 heads each and a replica of the
    KV head (kv_comm over them): dK/dV == single-process bytes (the halving tree's 3 + 3 split),
    each rank's dQ == its heads' rows."""
    with sequential_dot():
        q, k, v, q_pos, kv_len, *_ = _pack([70, 41], seed=92, hq=6)
        k, v = k[:, :1].contiguous(), v[:, :1].contiguous()
        d_out = randn(*q.shape, seed=93)
        out, lse = _fwd(q, k, v, q_pos, kv_len)
        full = _bwd(q, k, v, out, lse, d_out, q_pos, kv_len)

        def rank(r, comm):
            h = slice(3 * r, 3 * r + 3)
            return _bwd(q[:, h], k, v, out[:, h], lse[:, :, h], d_out[:, h], q_pos, kv_len,
                        kv_comm=comm)

        for r, (dq, dk, dv) in enumerate(run_ranks_sequentially(2, rank)):
            assert_bitwise(dq, full[0][:, 3 * r:3 * r + 3])
            assert_bitwise(dk, full[1])
            assert_bitwise(dv, full[2])


@check
def chunk_sizes_tiles_and_the_fallback_change_no_bit():
    """Double-word chunks of one key block of one sample (words_elems 4096: sample and key
    chunks) and of two blocks, dK/dV tiles of 32 and 128 keys (a 128-key tile straddles a
    one-block chunk's end) and of 8 output columns, every program
    through the per-leaf fallback (force_flag: EMIT partials + exponent bins), the host-known
    bounds (the layout's, no sync): the default bytes."""
    with sequential_dot():
        (q, k, v, q_pos, kv_len, *_), out, lse, d_out, ref = small()
        bounds = (int(q_pos.max()), int(kv_len.max()))
        for kw in ({"words_elems": 4096}, {"words_elems": 1 << 13}, {"kv_tile": (32, 16, 4, 1)},
                   {"kv_tile": (64, 8, 4, 1)}, {"kv_tile": (128, 16, 4, 1)},
                   {"kv_tile": (128, 16, 4, 1), "words_elems": 4096},
                   {"kv_tile": (128, 16, 4, 1), "force_flag": True}, {"force_flag": True},
                   {"force_flag": True, "words_elems": 4096}, {"bounds": bounds},
                   {"bounds": bounds, "force_flag": True, "words_elems": 4096}):
            got = _bwd(q, k, v, out, lse, d_out, q_pos, kv_len, **kw)
            for a, b in zip(got, ref):
                assert_bitwise(a, b)


@check
def key_slots_past_every_kv_len_round_to_plus_zero_in_any_chunking():
    """The samples of `small` with 26 more key slots (NaN) than any kv_len reaches: dK/dV of
    the first slots are `small`'s bytes and the extra slots +0.0, whether the double words are
    rounded straight into the result (chunks of whole samples covering every slot: the default
    and one sample per chunk) or chunk by chunk through a copy (key chunks of one block)."""
    (q, k, v, q_pos, kv_len, *_), out, lse, d_out, ref = small()
    tk = k.shape[2]
    pad = torch.full((*k.shape[:2], 26, D), NAN)
    k2, v2 = torch.cat([k, pad], 2), torch.cat([v, pad], 2)
    per_sample = q.shape[1] * D * 128                      # every key block of one sample
    with sequential_dot():
        for kw in ({}, {"words_elems": per_sample}, {"words_elems": 4096}):
            dq, dk, dv = _bwd(q, k2, v2, out, lse, d_out, q_pos, kv_len, **kw)
            assert_bitwise(dq, ref[0])
            for got, want in ((dk, ref[1]), (dv, ref[2])):
                assert_bitwise(got[:, :, :tk], want)
                _assert_plus_zero(got[:, :, tk:])


@check
def decode_row_dq_equals_prefill_row():
    """The query at position p alone (Tq 1, a 96-slot KV cache with NaN past kv_len = p + 1) has
    the dQ bytes of its row in the full backward, for p in 0, 15, 16, 63, 64, 69."""
    with sequential_dot():
        (q, k, v, q_pos, kv_len, *_), out, lse, d_out, _ = small()
        tile = (16, 4, 1)
        full = _bwd(q[:1], k[:1], v[:1], out[:1], lse[:1], d_out[:1], q_pos[:1], kv_len[:1],
                    dq_tile=tile)[0]
        cache_k = torch.full((1, 2, 96, D), NAN)
        cache_v = torch.full((1, 2, 96, D), NAN)
        cache_k[:, :, :70], cache_v[:, :, :70] = k[:1, :, :70], v[:1, :, :70]
        for p in (0, 15, 16, 63, 64, 69):
            ck, cv = cache_k.clone(), cache_v.clone()
            ck[:, :, p + 1:], cv[:, :, p + 1:] = NAN, NAN
            row = slice(p, p + 1)
            dq = _bwd(q[:1, :, row], ck, cv, out[:1, :, row], lse[:1, ..., row], d_out[:1, :, row],
                      torch.tensor([[p]]), torch.tensor([p + 1]), dq_tile=tile)[0]
            assert_bitwise(dq, full[:, :, row])


@check
def dkv_is_the_exact_sum_of_leaf_partials_negative_control_fp32_order():
    """The kernel's leaf partials of 2 packed samples (200 and 90 tokens: 4 and 2 leaves),
    added exactly and rounded once, then the head tree (and ·scale for dK), are the backward's
    dK/dV bytes; their exact sum does not change when the leaves are reversed. Negative
    control: a plain fp32 sum of the same partials in leaf order and in reverse order differ (so
    an order-dependent sum would fail the CP test)."""
    q, k, v, q_pos, kv_len, *_ = _pack([200, 90], seed=96)
    d_out = randn(*q.shape, seed=97)
    out, lse = _fwd(q, k, v, q_pos, kv_len)
    with sequential_dot():
        ref = _bwd(q, k, v, out, lse, d_out, q_pos, kv_len)
        s_, hq, tq, _ = q.shape
        tk = k.shape[2]
        n_leaves = int(q_pos.max()) // LEAF + 1
        part = tb.leaf_partials(q, k, v, out, lse, d_out, q_pos, kv_len, SCALE)
        assert part.shape[0] == n_leaves == 4
        exact = fx.exact_sum_fp32(part)
        assert_bitwise(fx.exact_sum_fp32(part.flip(0)), exact)
        heads = tree_sum_halving(exact.view(2, s_, 2, 2, tk, D), 3)
        assert_bitwise(heads[0] * SCALE, ref[1])
        assert_bitwise(heads[1], ref[2])
        fwd, rev = torch.zeros_like(exact), torch.zeros_like(exact)
        for i in range(n_leaves):
            fwd = fwd + part[i]
            rev = rev + part[n_leaves - 1 - i]
        assert n_diff(fwd, rev) > 0, "control: fp32 sums in two leaf orders matched"


@check
def bf16_packed_batch_vs_float64_and_alone_equals_in_batch():
    """bf16 q/k/v/d_out (the interpreter's bf16 dot widened exactly by triton_interpreter_compat,
    so the logic is checked, not the tensor cores' rounding): dQ/dK/dV in bf16 within 2e-2
    relative norm of float64 (the forward's bf16 out feeds delta; measured ~4e-3), padding rows
    +0.0; each sample alone (exact length) == its batch rows, bitwise."""
    with sequential_dot():
        q, k, v, q_pos, kv_len, *_ = _pack([70, 41, 33], seed=94)
        q, k, v = (t.bfloat16() for t in (q, k, v))
        d_out = randn(*q.shape, seed=95).bfloat16()
        out, lse = _fwd(q, k, v, q_pos, kv_len)
        grads = _bwd(q, k, v, out, lse, d_out, q_pos, kv_len)
        ref = attention_oracle64(q, k, v, q_pos, kv_len, d_out, SCALE)
        for got, want in zip(grads, ref[1:]):
            assert got.dtype == torch.bfloat16
            assert float((got.double() - want).norm() / want.norm()) < 2e-2
        pad = (q_pos < 0)[:, None, :, None].expand_as(grads[0])
        _assert_plus_zero(grads[0][pad].float())
        for i, n in enumerate([70, 41, 33]):
            alone = _bwd(*(t[i:i + 1, :, :n] for t in (q, k, v, out)), lse[i:i + 1, ..., :n],
                         d_out[i:i + 1, :, :n], q_pos[i:i + 1, :n], kv_len[i:i + 1])
            for a, b in zip(alone, grads):
                assert_bitwise(a[0].float(), b[i, :, :n].float())


def _chain(terms):
    """fp32 sum of `terms` in the order given, from +0.0."""
    acc = torch.zeros_like(terms[0])
    for t in terms:
        acc = acc + t
    return acc


@check
def summation_orders_with_a_sequential_dot():
    """With tl.dot made one multiply-add chain per element (K ascending: numpy's matmul, which the
    interpreter uses, has no documented order), the kernels' bytes are the orders of the module
    doc, rebuilt here from fp32 products: dQ_t = scale·(one chain over keys ascending, through
    all 64-key blocks); per 64-position leaf (LEAF) a chain over its queries in position order; the
    leaves added exactly; the 4 query heads by the halving tree; dK times scale last (scale 0.3,
    no power of two). q = 0 (for dQ, dV) or k = 0 (for dK, dV) and lse = 0 make p = exp(0) = 1
    exactly, so no exp needs reproducing. 150 keys (3 blocks), position 37 absent and positions
    129..143 absent (leaf 2 holds 128, which sees only the first key of a tile, and 144..149);
    default chunks, chunks of one key block, and the per-leaf fallback. Negative controls: the
    chains reversed (keys descending, positions descending) give other bytes."""
    n, hq, scale = 150, 4, 0.3
    q_pos = torch.arange(n)[None]
    q_pos[0, 37] = -1
    q_pos[0, 129:144] = -1
    kv_len = torch.tensor([n])
    out, d_out = randn(1, hq, n, D, seed=301), randn(1, hq, n, D, seed=302)
    lse = torch.zeros(1, 1, hq, n)
    here = q_pos[0] >= 0
    vis = (torch.arange(n)[None, :] <= torch.arange(n)[:, None]) & here[:, None]    # [t, j]
    leaves = [range(LEAF * f, min(n, LEAF * f + LEAF)) for f in range(math.ceil(n / LEAF))]
    for zero in ("q", "k"):
        q = randn(1, hq, n, D, seed=303)
        k, v = randn(1, 1, n, D, seed=304), randn(1, 1, n, D, seed=305)
        (q if zero == "q" else k).zero_()
        with sequential_dot():
            runs = [tb.attention_backward(q, k, v, out, lse, d_out, q_pos, kv_len, scale, **kw)
                    for kw in ({}, {"words_elems": 4096}, {"force_flag": True})]
        delta = _chain([out[0, ..., d] * d_out[0, ..., d] for d in range(D)])           # [h, t]
        dp = _chain([d_out[0, :, :, None, d] * v[0, 0, None, None, :, d] for d in range(D)])
        ds = torch.where(vis, dp - delta[..., None], torch.zeros(()))                  # [h, t, j]
        p = vis.float().expand(hq, n, n)
        dq_terms = [ds[..., j, None] * k[0, 0, j] for j in range(n)]
        want_dq = torch.where(here[:, None], _chain(dq_terms) * scale, torch.zeros(()))
        part_k = [_chain([ds[:, t, :, None] * q[0, :, t, None] for t in ts]) for ts in leaves]
        part_v = [_chain([p[:, t, :, None] * d_out[0, :, t, None] for t in ts]) for ts in leaves]
        want_dk = tree_sum_halving(fx.exact_sum_fp32(torch.stack(part_k)), 0) * scale
        want_dv = tree_sum_halving(fx.exact_sum_fp32(torch.stack(part_v)), 0)
        for dq, dk, dv in runs:
            if zero == "q":
                assert_bitwise(dq[0], want_dq)
            else:
                assert_bitwise(dk[0, 0], want_dk)
            assert_bitwise(dv[0, 0], want_dv)
        if zero == "q":
            rev = torch.where(here[:, None], _chain(dq_terms[::-1]) * scale, torch.zeros(()))
            assert n_diff(rev, want_dq) > 0, "control: dQ keys descending gave the same bytes"
        rev_v = [_chain([p[:, t, :, None] * d_out[0, :, t, None] for t in reversed(ts)])
                 for ts in leaves]
        assert n_diff(tree_sum_halving(fx.exact_sum_fp32(torch.stack(rev_v)), 0), want_dv) > 0, \
            "control: leaf positions descending gave the same dV bytes"


@check
def bf16_rounding_points_of_p_and_ds_with_a_sequential_dot():
    """bf16 q/k/v/out/d_out, 2 query heads on 2 KV heads (G = 1: no head tree), tl.dot one
    multiply-add chain per element (bf16 widened exactly): the bytes are those of the module doc's
    rounding points (Triton's own fp32 -> bf16 conversion, `_triton_bf16`), rebuilt from exact
    products and fp32 chains. Run 1 (q = 0, v = 0, k random):
    head 0 has lse 0, so p = 1 and ds_tj = −delta_t: dQ_t = bf16(scale·chain_j bf16(ds_tj)·k_j)
    (the outer rounding the kernel's store, Triton's conversion too);
    head 1 has lse −0.0048, so p = exp(0.0048) (not a bf16 value): dV_j = bf16(exact Σ_leaves
    chain_t bf16(p)·dO_t). Run 2 (k = 0, v = 0, q random, lse 0): dK_j = bf16(scale·exact
    Σ_leaves chain_t bf16(ds_tj)·q_t). 130 queries (3 leaves). Controls: the same sums without
    the P or the dS rounding give other bytes."""
    n, scale, lse1 = 130, 0.3, -0.0048
    q_pos, kv_len = torch.arange(n)[None], torch.tensor([n])
    vis = (torch.arange(n)[None, :] <= torch.arange(n)[:, None]).float()     # [t, j]
    leaves = [range(LEAF * f, min(n, LEAF * f + LEAF)) for f in range(math.ceil(n / LEAF))]
    out = randn(1, 2, n, D, seed=331).bfloat16()
    d_out = randn(1, 2, n, D, seed=332).bfloat16()
    do32 = d_out.float()[0]
    delta = _chain([out.float()[0, ..., d] * do32[..., d] for d in range(D)])     # [h, t]
    p1 = torch.exp(torch.tensor(-lse1))
    p1_bf = _triton_bf16(p1)
    assert p1_bf.item() != p1.item()
    zeros = torch.zeros(1, 2, n, D).bfloat16()

    def token_sum(w, x):      # w [t, j], x [t, D] -> [j, D]: leaf chains, exact over leaves
        part = [_chain([w[t, :, None] * x[t] for t in ts]) for ts in leaves]
        return fx.exact_sum_fp32(torch.stack(part))

    def dq_want(ds, k_h):     # ds [t] on the visible pairs -> [t, D], rounded as the kernel's
        # store rounds dQ (Triton's conversion: the interpreter's truncation here)
        return _triton_bf16(_chain([(vis[:, j] * ds)[:, None] * k_h[j] for j in range(n)]) * scale)

    lse = torch.zeros(1, 2, 1, n)
    lse[:, 1] = lse1
    k = randn(1, 2, n, D, seed=333).bfloat16()
    with sequential_dot():
        dq, _, dv = tb.attention_backward(zeros, k, zeros, out, lse, d_out, q_pos, kv_len, scale)
    ds0 = -delta[0]
    assert_bitwise(dq[0, 0].float(), dq_want(_triton_bf16(ds0), k.float()[0, 0]))
    assert_bitwise(dv[0, 1], token_sum(vis * p1_bf, do32[1]).bfloat16())
    assert n_diff(dq_want(ds0, k.float()[0, 0]),
                  dq_want(_triton_bf16(ds0), k.float()[0, 0])) > 0, \
        "control: dS unrounded gave the same dQ bytes"
    assert n_diff(token_sum(vis * p1, do32[1]).bfloat16(),
                  token_sum(vis * p1_bf, do32[1]).bfloat16()) > 0, \
        "control: P unrounded gave the same dV bytes"

    q = randn(1, 2, n, D, seed=334).bfloat16()
    with sequential_dot():
        _, dk, _ = tb.attention_backward(q, zeros, zeros, out, torch.zeros(1, 2, 1, n), d_out,
                                         q_pos, kv_len, scale)
    for h in range(2):
        ds = -delta[h]
        want = (token_sum(vis * _triton_bf16(ds)[:, None], q.float()[0, h]) * scale)
        assert_bitwise(dk[0, h], want.bfloat16())
        assert n_diff((token_sum(vis * ds[:, None], q.float()[0, h]) * scale).bfloat16(),
                      want.bfloat16()) > 0, "control: dS unrounded gave the same dK bytes"


@check
def keys_past_kv_len_stay_out_of_dq_where_exp_overflows():
    """kv_len 40 below positions up to 79 (keys past it NaN) and every score near −100, so
    lse ≈ −100 and exp(s − lse) of a key loaded as 0 would be Inf (Inf·0 = NaN in dQ): all
    gradients finite and within 1e-4·max|ref| of float64 (|s| ≈ 100 rounds s to ~1e-5)."""
    tq = 80
    q = randn(1, 2, tq, D, seed=311, scale=0.05)
    k = randn(1, 1, tq, D, seed=312, scale=0.05)
    v = randn(1, 1, tq, D, seed=313)
    q[..., 0] += 20.0
    k[..., 0] -= 20.0
    k[:, :, 40:], v[:, :, 40:] = NAN, NAN
    q_pos, kv_len = torch.arange(tq)[None], torch.tensor([40])
    d_out = randn(1, 2, tq, D, seed=314)
    out, lse = _fwd(q, k, v, q_pos, kv_len)
    assert float(lse.max()) < -90
    grads = _bwd(q, k, v, out, lse, d_out, q_pos, kv_len)
    ref = attention_oracle64(q, k, v, q_pos, kv_len, d_out, SCALE)
    for got, want in zip(grads, ref[1:]):
        assert bool(torch.isfinite(got).all()), "a non-finite gradient"
        assert_near(got, want, atol=1e-4 * float(want.abs().max()))


def _planted_dv(partials_per_sample, n_leaves, seed):
    """q = 0 and lse = 0 make p = 1 for every visible pair, so with d_out zero in column 0 except
    at the first query of each leaf (d_out[s, 0, LEAF·f, 0] = partials[s][f]) the dV leaf
    partials of key 0, column 0 are exactly those values (a single term each); v and out are 0
    in column 0, so dp and delta, and dK, stay finite and small. Returns the backward's
    arguments."""
    s_, n = len(partials_per_sample), n_leaves * LEAF
    q = torch.zeros(s_, 1, n, D)
    k, v = randn(s_, 1, n, D, seed=seed), randn(s_, 1, n, D, seed=seed + 1)
    out, d_out = randn(s_, 1, n, D, seed=seed + 2), randn(s_, 1, n, D, seed=seed + 3)
    d_out[..., 0] = 0.0
    v[..., 0], out[..., 0] = 0.0, 0.0          # dp and delta never see column 0 (finite dK)
    for s, parts in enumerate(partials_per_sample):
        for f, x in enumerate(parts):
            d_out[s, 0, LEAF * f, 0] = x
    lse = torch.zeros(s_, 1, 1, n)
    q_pos = torch.arange(n).expand(s_, n).contiguous()
    return q, k, v, out, lse, d_out, q_pos, torch.full((s_,), n)


def _bwd_seeing_flags(args, first=None, **kw):
    """(the `_redo_flagged` calls as (kind, flagged program ids), the backward's grads). With a
    list `first`, each first-pass launch appends (kind, the program ids it flagged) to it."""
    seen, real, real_launch = [], tb._redo_flagged, tb._launch_dkv

    def spy(a, flagged, kind, *rest, **kws):
        seen.append((kind, flagged.tolist()))
        return real(a, flagged, kind, *rest, **kws)

    def spy_launch(a, out, flags, pids, kind, s0, j0, width, n_tiles_k, n_leaves, grid, tile,
                   emit, force_flag, retry=False):
        real_launch(a, out, flags, pids, kind, s0, j0, width, n_tiles_k, n_leaves, grid, tile,
                    emit, force_flag, retry)
        if first is not None and not emit and not retry:
            first.append((kind, torch.nonzero(flags).flatten().tolist()))

    tb._redo_flagged, tb._launch_dkv = spy, spy_launch
    try:
        return seen, _bwd(*args, **kw)
    finally:
        tb._redo_flagged, tb._launch_dkv = real, real_launch


@check
def dv_rounds_the_exact_sum_through_lo_and_the_flagged_fallback():
    """dV[key 0, column 0] from planted leaf partials (p = 1 exactly), three one-sample calls
    through the three tiers: A: 1, 2**-24, -2**-53, -2**-53, 2**-52, 2**-120 — the first
    pass's add of -2**-53 to 1 + 2**-24 is inexact (flagged), and in the retry TwoSum leaves
    hi = 1 + 2**-24 + 2**-52, lo = -2**-52 with the last lo addition inexact (2**-120 lost), so
    its program, and only it, is redone (per-leaf partials + exponent bins + digits); B: 1, 2**-24, 2**-80 — inexact in
    one float64 word (the first pass flags it), exact in the retry's (hi, lo), so the retry's
    words are rounded directly (`fixedpoint.round_double_words`); C: 1, 2**-24, 2**-30 — exact
    in the first pass's word, nothing flagged at all. The exact sums of A and B round up to
    1 + 2**-23, which a kernel that dropped the lo check (A: hi + lo is a tie, rounds to 1.0),
    trusted the first pass's word (B: fl(hi + 2**-80) is a tie) or a host that rounded hi + lo
    in float64 first (B: a tie again) would miss; force_flag gives the same bytes. Controls:
    those wrong roundings really give 1.0 here."""
    want = 1.0 + 2.0**-23
    # first_dv: key tiles whose keys see a partial below ulp of an earlier leaf's running sum
    # (tile j sees leaves j.. only; A's tiles 1-4 meet 2**-120 after 2**-24, B's tile 1 2**-80)
    plants = [([1.0, 2.0**-24, -2.0**-53, -2.0**-53, 2.0**-52, 2.0**-120], want, [0, 1, 2, 3, 4],
               [(1, [0])]),
              ([1.0, 2.0**-24, 2.0**-80], want, [0, 1], []),
              ([1.0, 2.0**-24, 2.0**-30], 1.0 + 2.0**-24 + 2.0**-30, [], [])]
    for parts, exact, first_dv, flags in plants:
        args = _planted_dv([parts], len(parts), seed=321)
        first = []
        seen, grads = _bwd_seeing_flags(args, first)
        got = grads[2][0, 0, 0, 0].item()
        assert got == torch.tensor(exact, dtype=torch.float64).float().item(), got
        assert first == [(0, []), (1, first_dv)], first   # dK's programs stay exact
        assert seen == flags, seen                # (dV, program 0 = key tile 0) or none
        for a, b in zip(_bwd(*args, force_flag=True), grads):
            assert_bitwise(a, b)
    first_word_b = torch.tensor(1.0 + 2.0**-24, dtype=torch.float64) + 2.0**-80
    assert first_word_b.float().item() == 1.0
    no_check = torch.tensor([[1.0 + 2.0**-24 + 2.0**-52], [-2.0**-52]], dtype=torch.float64)
    assert fx.round_double_words(no_check).item() == 1.0
    words_b = torch.tensor([1.0 + 2.0**-24, 2.0**-80], dtype=torch.float64)
    assert fx.round_double_words(words_b[:, None]).item() == want
    assert (words_b[0] + words_b[1]).float().item() == 1.0


@check
def late_sink_counts_third_tier_programs_instead_of_syncing():
    """Under a late gradient sink (GradSink.begin(late=True), as the trainer's first pass) the
    backward never reads the flags on the host: plant A's one third-tier program (dV, key tile
    0) is counted in the sink's late counter and not redone, so dV[0, 0] is not the exact sum's
    1 + 2**-23 (why the trainer then runs the mini-batch again) and `late_flagged` says so; the retry tier still fixes plant B's first-pass flags on the device
    (count 0, the eager bytes), and plant C flags nothing (count 0, the eager bytes). Control:
    the eager run of A redoes the program and gets 1 + 2**-23."""
    from rlkernel.distributed.comm import Comm
    from rlkernel.distributed.tokensum import GradSink
    for parts, count in (([1.0, 2.0**-24, -2.0**-53, -2.0**-53, 2.0**-52, 2.0**-120], 1),
                         ([1.0, 2.0**-24, 2.0**-80], 0), ([1.0, 2.0**-24, 2.0**-30], 0)):
        args = _planted_dv([parts], len(parts), seed=321)
        _, eager = _bwd_seeing_flags(args)
        sink = GradSink.single()
        sink.begin({}, late=True)
        tok = TokenSum(Comm.single("tokens"), sink=sink)
        seen, late = _bwd_seeing_flags(args, tok=tok)
        assert seen == [], seen                       # no host-side redo under a late sink
        counter = sink.late_counter(torch.device("cpu"))
        assert int(counter) == count and sink.late_flagged() == bool(count), int(counter)
        if count:
            assert eager[2][0, 0, 0, 0].item() == 1.0 + 2.0**-23
            assert late[2][0, 0, 0, 0].item() != 1.0 + 2.0**-23, "control: late = eager"
            for a, b in ((late[0], eager[0]), (late[1], eager[1])):
                assert_bitwise(a, b)                  # dQ and dK had nothing flagged
        else:
            for a, b in zip(late, eager):
                assert_bitwise(a, b)
        sink.begin({})                                # not late: no counter, never flagged
        assert sink.late_counter(torch.device("cpu")) is None and not sink.late_flagged()


@check
def late_sink_counts_every_third_tier_program_of_both_kinds_over_the_chunks():
    """force_flag sends every dK and dV program to the third tier: under a late sink the
    counter ends at the number of programs the eager run redoes on the host — both kinds, every
    program of a chunk (not one per kind), added over the chunks (words_elems 4096: several) —
    and the late run redoes none. Control: the eager run redoes programs of both kinds, several
    per call, in more than one chunk, so a count of one kind, of one program per kind or of
    the last chunk only would differ."""
    from rlkernel.distributed.comm import Comm
    from rlkernel.distributed.tokensum import GradSink
    (q, k, v, q_pos, kv_len, *_), out, lse, d_out, _ = small()
    args = (q, k, v, out, lse, d_out, q_pos, kv_len)
    kw = {"force_flag": True, "words_elems": 4096}
    seen, _ = _bwd_seeing_flags(args, **kw)
    kinds = [kind for kind, _ in seen]
    assert kinds.count(0) > 1 and kinds.count(1) > 1, kinds      # both kinds, several chunks
    assert all(len(ids) > 1 for _, ids in seen), seen
    sink = GradSink.single()
    sink.begin({}, late=True)
    tok = TokenSum(Comm.single("tokens"), sink=sink)
    seen_late, _ = _bwd_seeing_flags(args, tok=tok, **kw)
    assert seen_late == [], seen_late
    counted = int(sink.late_counter(torch.device("cpu")))
    assert counted == sum(len(ids) for _, ids in seen), (counted, seen)
    assert sink.late_flagged()


@check
def dkv_sums_at_the_double_word_bound_are_flagged():
    """|hi| >= triton_fixedpoint.TOP_F64_BITS flags a dK/dV program (the digits are exact only
    below it). Sums of 2**150 need 2**22 leaves of fp32 maxima, so the bound is lowered to 2**128:
    dV leaf partials 1.5·2**127, 1.5·2**127 (p = 1, as `_planted_dv`) sum to 1.5·2**128 and flag
    key tile 0 of dV (redone: +Inf, the exact sum rounded); under the real bound nothing is
    flagged and the bytes are the same."""
    args = _planted_dv([[1.5 * 2.0**127, 1.5 * 2.0**127]], 2, seed=341)
    real_top = tfx.TOP_F64_BITS
    tfx.TOP_F64_BITS = tl.constexpr((1023 + 128) << 52)
    try:
        seen_low, low = _bwd_seeing_flags(args)
    finally:
        tfx.TOP_F64_BITS = real_top
    seen_real, grads = _bwd_seeing_flags(args)
    assert seen_low == [(1, [0])] and seen_real == [], (seen_low, seen_real)
    assert low[2][0, 0, 0, 0].item() == float("inf")
    for a, b in zip(low, grads):
        assert_bitwise(a, b)


@check
def opposite_infinite_dv_partials_in_two_leaves_are_nan():
    """dV leaf partials +Inf and −Inf of key 0, column 0 in two leaves (p = 1, as `_planted_dv`):
    the sum is NaN, and the first pass flags dV's key tile 0 (a widening that made the Infs
    finite — the thirty-fourth session's bit move without its non-finite OR — cancelled them
    to 0 exactly and passed every other check here)."""
    args = _planted_dv([[float("inf"), float("-inf")]], 2, seed=351)
    first = []
    _, grads = _bwd_seeing_flags(args, first)
    assert math.isnan(grads[2][0, 0, 0, 0].item()), grads[2][0, 0, 0, 0]
    assert any(kind == 1 and 0 in ids for kind, ids in first), first


@check
def fp32_d_out_is_read_at_the_bf16_rounding_point():
    """bf16 q/k/v with an fp32 d_out = a bf16 value times (1 + 2**-10): its extra bits are below
    a quarter of a bf16 ulp, so truncation (the interpreter's fp32 -> bf16) and round-to-nearest-
    even (the GPU's) both give the bf16 value back. The backward then equals the one given that
    bf16 d_out, bitwise: every kernel — delta included — reads dO at its rounding point. Control:
    the fp32 d_out does differ from the bf16 one."""
    q, k, v, q_pos, kv_len, *_ = _pack([70, 41], seed=98)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    base = randn(*q.shape, seed=99).bfloat16()
    d32 = base.float() * (1 + 2.0**-10)                # exact: 8 + 10 significant bits
    assert n_diff(d32, base.float()) > 0, "control: the fp32 d_out has no extra bits"
    out, lse = _fwd(q, k, v, q_pos, kv_len)
    with sequential_dot():
        got = _bwd(q, k, v, out, lse, d32, q_pos, kv_len)
        want = _bwd(q, k, v, out, lse, base, q_pos, kv_len)
    for a, b in zip(got, want):
        assert_bitwise(a.float(), b.float())


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """t [S, H, T, D] with the same values, laid out [S, T, H, D] in memory (the model's view of
    the token stream)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@check
def token_major_layout_and_the_bf16_store_change_no_bit():
    """bf16 q/k/v/d_out laid out token-major (as the model hands them over) against the same
    values contiguous: out, dQ, dK, dV bitwise equal, out token-major in memory either way and
    each gradient in its input's memory order. dQ rounded by the kernel's store == the fp32 dQ
    through Triton's own conversion, bitwise (on the GPU: == torch's cast, checked there).
    Control: the fp32 dQ does differ from its bf16 rounding."""
    with sequential_dot():
        q, k, v, q_pos, kv_len, *_ = _pack([70, 41], seed=96)
        q, k, v = (t.bfloat16() for t in (q, k, v))
        d_out = randn(*q.shape, seed=97).bfloat16()
        runs = []
        for qq, kk, vv, dd in ((q, k, v, d_out), tuple(_token_major(t) for t in (q, k, v, d_out))):
            out, lse = _fwd(qq, kk, vv, q_pos, kv_len)
            assert out.transpose(1, 2).is_contiguous()
            grads = _bwd(qq, kk, vv, out, lse, dd, q_pos, kv_len)
            for g, ref in zip(grads, (qq, kk, vv)):
                assert g.dtype == torch.bfloat16 and g.stride() == ref.stride(), (
                    g.stride(), ref.stride())
            runs.append((out, *grads))
        for a, b in zip(*runs):
            assert_bitwise(a.float(), b.float())
        out, lse = _fwd(q, k, v, q_pos, kv_len)
        delta = tb._delta(out, d_out, q_pos)
        args = (q, k, v, d_out, lse.reshape(q.shape[0], q.shape[1], -1), delta, q_pos, kv_len,
                SCALE, None)
        dq32 = tb._dq(*args)
        dq16 = tb._dq(*args, torch.bfloat16)
        assert dq32.dtype == torch.float32 and dq16.dtype == torch.bfloat16
        # The interpreter's fp32 -> bf16 truncates (`_triton_bf16`); the GPU's store rounds to
        # nearest even as torch does: tests/test_cuda_attention_bwd.py checks it there.
        assert_bitwise(dq16.float(), _triton_bf16(dq32))
        assert n_diff(dq32, dq16.float()) > 0, "control: fp32 dQ has no bits past bf16"


@check
def fp32_token_major_gradients_keep_the_inputs_memory_order():
    """fp32 q/k/v/d_out laid out token-major against the same values contiguous: dQ, dK, dV
    bitwise equal, each in its input's memory order (dK and dV already have k's / v's dtype
    here: no rounding copy, yet no contiguous result handed back either). Control: token-major
    k's strides are not the contiguous ones."""
    with sequential_dot():
        q, k, v, q_pos, kv_len, *_ = _pack([70, 41], seed=100)
        d_out = randn(*q.shape, seed=101)
        runs = []
        for qq, kk, vv, dd in ((q, k, v, d_out), tuple(_token_major(t) for t in (q, k, v, d_out))):
            out, lse = _fwd(qq, kk, vv, q_pos, kv_len)
            grads = _bwd(qq, kk, vv, out, lse, dd, q_pos, kv_len)
            for g, ref in zip(grads, (qq, kk, vv)):
                assert g.dtype == torch.float32 and g.stride() == ref.stride(), (
                    g.stride(), ref.stride())
            runs.append(grads)
        for a, b in zip(*runs):
            assert_bitwise(a, b)
        assert _token_major(k).stride() != k.stride()


@check
def no_queries_give_gradients_like_the_inputs():
    """Tq = 0 (no query rows in this call: the backward's own no-query branch), bf16 q/k/v/d_out
    token-major: dQ is empty in q's dtype and memory order, dK and dV +0 in k's / v's dtype and
    memory order, as the calls with queries return them (token_major_layout_... above).
    Control: q's strides are not those of a fresh tensor of its shape."""
    q, k, v, q_pos, kv_len, *_ = _pack([70, 41], seed=98)
    q, k, v = (_token_major(t.bfloat16()) for t in (q, k, v))
    q0, q_pos0 = q[:, :, :0], q_pos[:, :0]
    d_out0 = _token_major(randn(*q.shape, seed=99).bfloat16())[:, :, :0]
    lse0 = torch.zeros(q.shape[0], k.shape[1], q.shape[1] // k.shape[1], 0)
    assert q0.stride() != torch.empty(q0.shape).stride()
    dq, dk, dv = _bwd(q0, k, v, torch.zeros_like(q0), lse0, d_out0, q_pos0, kv_len)
    assert dq.shape == q0.shape and dq.dtype == torch.bfloat16 and dq.stride() == q0.stride()
    for g, ref in ((dk, k), (dv, v)):
        assert g.dtype == torch.bfloat16 and g.stride() == ref.stride(), (g.dtype, g.stride())
        _assert_plus_zero(g.float())


def _stream(x: torch.Tensor, idx: torch.Tensor, n_rows: int, fill=NAN) -> torch.Tensor:
    """x [S, H, T, D] as a token stream [n_rows, H, D]: slot (s, t) at row idx[s, t] (>= 0),
    every other row `fill` (NaN: a kernel that reads it poisons its result)."""
    out = torch.full((n_rows, x.shape[1], x.shape[3]), fill, dtype=x.dtype)
    s_i, t_i = (idx >= 0).nonzero(as_tuple=True)
    out[idx[s_i, t_i]] = x[s_i, :, t_i]
    return out


def _rows_of(stream: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the stream's rows at idx's valid slots [n, H, D], every other row) of a stream result."""
    named = torch.zeros(stream.shape[0], dtype=torch.bool)
    named[idx[idx >= 0]] = True
    return stream[idx[idx >= 0]], stream[~named]


def _reversed_rows(q_idx: torch.Tensor) -> torch.Tensor:
    """q_idx's slot map with the samples placed in the stream in reverse order (LEAF-aligned):
    the kernels run sample 0 first, so a store past a sample's slots would land on rows an
    earlier-run sample already wrote (and be seen), not on rows a later one overwrites."""
    out = torch.full_like(q_idx, -1)
    off = 0
    for s_ in reversed(range(q_idx.shape[0])):
        n = int((q_idx[s_] >= 0).sum())
        out[s_, :n] = off + torch.arange(n)
        off += -(-n // LEAF) * LEAF
    return out


def _packed_run(q, k, v, d_out, q_pos, kv_len, q_idx, k_idx, n_q, n_k, tile=None, **kw):
    """Forward and backward through the packed-stream entry points on streams built from the
    per-sample tensors (NaN in every row no slot names): (out, lse, dq, dk, dv) streams. tile:
    the forward's and dQ's (BLOCK_M, warps, stages)."""
    q_rows, k_rows = q_idx[:, 0].clamp(min=0), k_idx[:, 0].clamp(min=0)
    qs, ks, vs, gs = (_stream(q, q_idx, n_q), _stream(k, k_idx, n_k), _stream(v, k_idx, n_k),
                      _stream(d_out, q_idx, n_q))
    out, lse = ta.attention_forward_packed(qs, ks, vs, q_rows, k_rows, q_pos, kv_len,
                                           k.shape[2], SCALE, tile)
    grads = tb.attention_backward_packed(qs, ks, vs, out, lse, gs, q_rows, k_rows, q_pos, kv_len,
                                         k.shape[2], SCALE, dq_tile=tile, **kw)
    return (out, lse, *grads)


def _same_as_per_sample(packed_res, q, k, v, d_out, q_pos, kv_len, q_idx, k_idx) -> None:
    """Every packed result == the per-sample call's, bitwise, at its rows; +0.0 elsewhere."""
    out_p, lse_p, dq_p, dk_p, dv_p = packed_res
    out, lse = _fwd(q, k, v, q_pos, kv_len)
    dq, dk, dv = _bwd(q, k, v, out, lse, d_out, q_pos, kv_len)
    assert_bitwise(lse_p, lse)
    k_live = torch.where(torch.arange(k.shape[2])[None, :] < kv_len[:, None], k_idx, -1)
    for got, want, idx in ((out_p, out, q_idx), (dq_p, dq, q_idx), (dk_p, dk, k_live),
                           (dv_p, dv, k_live)):
        assert got.dtype == want.dtype
        at, rest = _rows_of(got, idx)
        s_i, t_i = (idx >= 0).nonzero(as_tuple=True)
        assert_bitwise(at.float(), want[s_i, :, t_i].float())
        _assert_plus_zero(rest.float())


@check
def packed_streams_give_the_per_sample_bytes():
    """The packed-stream entry points (attention_forward_packed / attention_backward_packed:
    each sample's rows read and written in place) on 3 samples of lengths 128, 64, 100 packed
    in reverse order (`_reversed_rows`: the 64-token sample's 64 empty slots name the rows of
    the 128-token one; gaps after the others), NaN in every row no slot names: out, lse, dQ, dK, dV == the
    per-sample calls' bytes at their rows, +0.0 in every other row — fp32 and bf16 (the
    interpreter's exact bf16 dot). Also a CP-like query stream holding positions 64..127 of
    each sample only, on its own rows, against the full key stream. Control: key rows one off
    (k_rows + 1) change the output."""
    with sequential_dot():
        q, k, v, q_pos, kv_len, q_idx, sl, _ = _pack([128, 64, 100], seed=120)
        q_idx = _reversed_rows(q_idx)
        d_out = randn(*q.shape, seed=121)
        # One row tile per sample (and KV head), run in sample order: a store into an empty
        # slot's row would clobber the rows of the sample placed after it, written already.
        whole = (q.shape[2] * q.shape[1] // k.shape[1], 4, 1)
        for dt, tile in ((torch.float32, whole), (torch.float32, None), (torch.bfloat16, None)):
            qq, kk, vv, gg = (t.to(dt) for t in (q, k, v, d_out))
            res = _packed_run(qq, kk, vv, gg, q_pos, kv_len, q_idx, q_idx, sl, sl, tile)
            _same_as_per_sample(res, qq, kk, vv, gg, q_pos, kv_len, q_idx, q_idx)
        # Queries of positions 64.. only (a CP rank's leaf), packed back to back on new rows.
        part = q_pos >= 64
        n_part = part.sum(1)
        tq = int(n_part.max())
        qp = torch.full((3, tq), -1, dtype=torch.long)
        qi = torch.full((3, tq), -1, dtype=torch.long)
        q2 = torch.full((3, q.shape[1], tq, q.shape[3]), NAN)
        g2 = torch.full_like(q2, NAN)
        for s_ in range(3):
            n = int(n_part[s_])
            qp[s_, :n] = q_pos[s_, part[s_]]
            qi[s_, :n] = torch.arange(n)
            q2[s_, :, :n] = q[s_][:, part[s_]]
            g2[s_, :, :n] = d_out[s_][:, part[s_]]
        qi = _reversed_rows(qi)
        res = _packed_run(q2, k, v, g2, qp, kv_len, qi, q_idx, int(qi.max()) + LEAF, sl)
        _same_as_per_sample(res, q2, k, v, g2, qp, kv_len, qi, q_idx)
        ks, vs = _stream(k, q_idx, sl, 0.0), _stream(v, q_idx, sl, 0.0)
        q_rows, k_rows, tk = q_idx[:, 0], q_idx[:, 0], k.shape[2]
        qs = _stream(q, q_idx, sl)      # k_rows + 1 stays inside the stream: the last sample
        assert int((k_rows + kv_len).max()) < sl                 # ends before its last row
        base = ta.attention_forward_packed(qs, ks, vs, q_rows, k_rows, q_pos, kv_len, tk,
                                           SCALE)[0]
        off1 = ta.attention_forward_packed(qs, ks, vs, q_rows, k_rows + 1, q_pos, kv_len, tk,
                                           SCALE)[0]
        assert n_diff(base, off1) > 0, "control: key rows one off gave the same output"



@contextlib.contextmanager
def _accesses_in(ranges):
    """Yields a list that gets one entry ("load" / "store") per interpreted memory access (mask
    on) with an address in one of ranges [(lo, hi) bytes]: the interpreter reads and writes
    CPU tensors in place, so an access past a tensor's end is seen here, where the GPU would
    read or write another tensor's memory (or fault)."""
    ib = triton.runtime.interpreter.InterpreterBuilder
    load, store = ib.create_masked_load, ib.create_masked_store
    hits = []

    def seen(ptrs, mask, what):
        at = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape).astype(bool)]
        if any(bool(((at >= lo) & (at < hi)).any()) for lo, hi in ranges):
            hits.append(what)

    def masked_load(self, ptrs, mask, other, *rest):
        seen(ptrs, mask, "load")
        return load(self, ptrs, mask, other, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        seen(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *rest)
    ib.create_masked_load, ib.create_masked_store = masked_load, masked_store
    try:
        yield hits
    finally:
        ib.create_masked_load, ib.create_masked_store = load, store


def _guarded(x: torch.Tensor, n_guard: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """x [L, ...] copied into the first L rows of a NaN buffer of L + n_guard rows: (that view,
    the guard rows' byte range)."""
    buf = torch.full((x.shape[0] + n_guard,) + x.shape[1:], NAN, dtype=x.dtype)
    buf[:x.shape[0]] = x
    lo = buf.data_ptr() + x.shape[0] * buf.stride(0) * buf.element_size()
    return buf[:x.shape[0]], (lo, buf.data_ptr() + buf.numel() * buf.element_size())


@check
def packed_kernels_touch_no_row_past_the_streams_ends():
    """Streams that end at the last row of a short sample (lengths 128, 40 packed in order: the
    40-token sample's 88 empty query slots and its key slots past kv_len name rows past the
    end), each stream a view of a buffer with NaN guard rows after it: the packed forward and
    backward (fp32 and bf16) neither load nor store an address in the guard rows of q, k, v,
    out or dO, and give the per-sample bytes. (The forward's unmasked whole-block loop, run by a
    tile of empty slots only, read the short sample's keys 40..127: rows past the end.)
    Control: the forward's read of q's last row (the row before the guard) is seen."""
    with sequential_dot():
        q, k, v, q_pos, kv_len, q_idx, _, _ = _pack([128, 40], seed=160)
        d_out = randn(*q.shape, seed=161)
        n = int(q_idx.max()) + 1
        rows, tk = q_idx[:, 0].contiguous(), k.shape[2]
        for dt in (torch.float32, torch.bfloat16):
            qq, kk, vv, gg = (t.to(dt) for t in (q, k, v, d_out))
            (qs, gq), (ks, gk), (vs, gv), (ds, gd) = (_guarded(_stream(t, q_idx, n), q.shape[2])
                                                      for t in (qq, kk, vv, gg))
            with _accesses_in([gq, gk, gv, gd]) as hits:
                out, lse = ta.attention_forward_packed(qs, ks, vs, rows, rows, q_pos, kv_len, tk,
                                                       SCALE)
            assert not hits, f"forward {dt}: {sorted(set(hits))} past the streams' ends"
            out, go = _guarded(out, q.shape[2])
            with _accesses_in([gq, gk, gv, gd, go]) as hits:
                grads = tb.attention_backward_packed(qs, ks, vs, out, lse, ds, rows, rows, q_pos,
                                                     kv_len, tk, SCALE)
            assert not hits, f"backward {dt}: {sorted(set(hits))} past the streams' ends"
            _same_as_per_sample((out, lse, *grads), qq, kk, vv, gg, q_pos, kv_len, q_idx, q_idx)
        with _accesses_in([(gq[0] - qs.stride(0) * qs.element_size(), gq[0])]) as hits:
            ta.attention_forward_packed(qs, ks, vs, rows, rows, q_pos, kv_len, tk, SCALE)
        assert "load" in hits, "control: the read of q's last row was not seen"



@check
def packed_row_maps_of_any_strides_give_the_per_sample_bytes():
    """q_rows / k_rows given as column views of the slot maps (q_idx[:, 0]: stride Tq, not 1;
    the key rows another layout's): the packed forward and backward give the per-sample bytes,
    as with contiguous row maps (the kernels index ROWS[s]; a strided view read as contiguous
    would give sample 1 the rows of sample 0's slots)."""
    with sequential_dot():
        q, k, v, q_pos, kv_len, q_idx, sl, _ = _pack([128, 40], seed=180)
        k_idx = _reversed_rows(q_idx)
        d_out = randn(*q.shape, seed=181)
        qs, gs = _stream(q, q_idx, sl), _stream(d_out, q_idx, sl)
        ks, vs = _stream(k, k_idx, sl), _stream(v, k_idx, sl)
        q_rows, k_rows = q_idx[:, 0], k_idx[:, 0]
        assert q_rows.stride(0) == k_rows.stride(0) == q.shape[2] > 1
        out, lse = ta.attention_forward_packed(qs, ks, vs, q_rows, k_rows, q_pos, kv_len,
                                               k.shape[2], SCALE)
        grads = tb.attention_backward_packed(qs, ks, vs, out, lse, gs, q_rows, k_rows, q_pos,
                                             kv_len, k.shape[2], SCALE)
        _same_as_per_sample((out, lse, *grads), q, k, v, d_out, q_pos, kv_len, q_idx, k_idx)


@check
def packed_bad_arguments_are_refused():
    """attention_forward_packed / attention_backward_packed refuse, with ValueError, streams and
    row maps that do not form a packed problem: q_rows or k_rows not [S], kv_len not [S], a
    per-sample (4-d) q, v unlike k, k's head_dim unlike q's."""
    q, k, v, q_pos, kv_len, q_idx, _, _ = _pack([70, 41], seed=170)
    n = int(q_idx.max()) + 1
    qs, ks, vs = (_stream(t, q_idx, n, 0.0) for t in (q, k, v))
    rows = q_idx[:, 0]
    base = {"q": qs, "k": ks, "v": vs, "q_rows": rows, "k_rows": rows, "q_pos": q_pos,
            "kv_len": kv_len}
    out, lse = ta.attention_forward_packed(**base, tk=k.shape[2], scale=SCALE)
    bad = [{"q_rows": rows[:1]}, {"k_rows": rows[None]}, {"kv_len": kv_len[:1]}, {"q": q},
           {"v": vs[:-1]}, {"k": ks[..., :8], "v": vs[..., :8]}]
    for change in bad:
        args = {**base, **change}
        for name, call in (("forward", lambda: ta.attention_forward_packed(
                **args, tk=k.shape[2], scale=SCALE)),
                           ("backward", lambda: tb.attention_backward_packed(
                **args, out=out, lse=lse, d_out=out, tk=k.shape[2], scale=SCALE))):
            try:
                call()
            except ValueError:
                continue
            raise AssertionError(f"{name} accepted {sorted(change)}")


@check
def bad_arguments_are_refused():
    """fp16, a head count not a multiple of the KV heads, a wrong lse shape: ValueError."""
    (q, k, v, q_pos, kv_len, *_), out, lse, d_out, _ = small()
    bad = [{"q": q.half(), "k": k.half(), "v": v.half()},
           {"q": q[:, :3], "out": out[:, :3], "d_out": d_out[:, :3]}, {"lse": lse[..., :5]}]
    base = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "d_out": d_out, "q_pos": q_pos,
            "kv_len": kv_len}
    for change in bad:
        args = {**base, **change}
        try:
            tb.attention_backward(scale=SCALE, **args)
        except ValueError:
            continue
        raise AssertionError(f"accepted {sorted(change)}")


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
