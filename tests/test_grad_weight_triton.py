"""The fused dW kernel (rlkernel/kernels/triton_grad_weight.py) under TRITON_INTERPRET=1 (Triton
on the CPU): its accumulator == the reference path's (token-leaf partials + the torch exact
accumulator), bytewise, for narrow, wide (through the lo word) and extreme (flagged, redone)
ranges of leaf partials, an inexact add onto a small running sum (seen only by
add_exact_or_nan's second comparison), non-finite partials, sums past the fp32 range, forced recomputes, edge
tiles, strided operands, a non-zero starting accumulator, other tiles, several launches and
EMIT batches, sums at the double-word bound (lowered to 2**129); with the control that the wide
case's naive float64 sum is wrong; and the launch arguments the interpreter cannot show (fp
fusion off, "ieee" fp32 dots, bf16 operands kept bf16); `rounded_grad_weight` (the double words
rounded straight to fp32) == the digit path's rounding, or None when a tile is flagged, and a
one-rank direct GradSink with that words_rows hook == the digit-only path (flagged and forced
chunks take the digits). The checks live in
tests/grad_weight_triton_checks.py and run in one subprocess. On a GPU:
tests/test_cuda_grad_weight.py (the tensor cores' bits against the reference's `bmm`).
Run: PYTHONPATH=. .venv/bin/python -m pytest -q tests/test_grad_weight_triton.py (needs triton;
about 30 s).
"""

from __future__ import annotations

import re

import pytest
import torch

from kernel_helpers import NEEDS_TRITON, check_ok as _ok, checks_fixture, sm90_ptx

pytestmark = NEEDS_TRITON
results = checks_fixture("grad_weight_triton_checks.py")


def test_narrow_range_needs_no_recompute(results):
    """Leaf scales within 2**±4: kernel == reference, no tile redone."""
    _ok(results, "narrow_range_needs_no_recompute")


def test_one_inexact_add_is_retried_and_exact(results):
    """Partials 1, 2**-24, 2**-80 in one element: exact (rounds up to 1 + 2**-23) through the
    checked retry of that tile alone, no recompute; control: the naive float64 sum gives 1.0
    there."""
    _ok(results, "one_inexact_add_is_retried_and_exact")


def test_small_then_large_inexact_add_is_retried_and_exact(results):
    """Partials 2**-80, 1, 2**-24 in one element: the add of 1 onto 2**-80 is inexact, seen only
    by add_exact_or_nan's second comparison (s - p == hi); retried (tile 0 alone, no EMIT),
    the exact sum's bytes (1 + 2**-23) in the accumulator and rounded_grad_weight; control: the
    naive float64 sum gives 1.0."""
    _ok(results, "small_then_large_inexact_add_is_retried_and_exact")


def test_two_inexact_adds_are_retried_and_exact(results):
    """Partials 1, 2**-80, 2**-81 in one element and wide leaf scales elsewhere: the flagged
    tiles are retried with the checked lo word (no EMIT path); bytes == reference."""
    _ok(results, "two_inexact_adds_are_retried_and_exact")


def test_a_lone_flagged_tile_is_retried_in_place(results):
    """Only the last tile holds an element with two inexact adds: the retry launch redoes that
    tile (TILES = [5]), no EMIT; bytes == reference (accumulator and rounded)."""
    _ok(results, "a_lone_flagged_tile_is_retried_in_place")

def test_extreme_range_takes_the_emit_path(results):
    """Partials 2**100, 1.5·2**46, 2**-100: the double word cannot hold them; exactly one tile is
    flagged and redone from its per-leaf partials; bytes == reference."""
    _ok(results, "extreme_range_takes_the_emit_path")


def test_nonfinite_partials_take_the_emit_path(results):
    """Inf/NaN operands: flagged tiles, the reference's NaN/Inf counts; +Inf and −Inf partials
    of one element in two leaves: NaN, the tiles flagged."""
    _ok(results, "nonfinite_partials_take_the_emit_path")
    _ok(results, "opposite_infinities_in_two_leaves_are_nan")


def test_sums_past_the_fp32_range_stay_exact(results):
    """An exact sum of 2**129: held by the double word and the digits, no recompute; rounds to
    +Inf as the reference does."""
    _ok(results, "sums_past_the_fp32_range_stay_exact")


def test_sums_at_the_double_word_bound_take_the_emit_path(results):
    """With TOP_F64_BITS lowered to 2**129: sums of exactly ±2**129 flag every tile (redone, same
    bytes), sums of ±2**128 flag none."""
    _ok(results, "sums_at_the_double_word_bound_take_the_emit_path")


def test_several_launches_and_emit_batches_change_no_bit(results):
    """OUT_ELEMS lowered to four launches of one tile row, EMIT_TILES to 2: an extreme element in
    the third launch and a forced recompute of every tile == reference, onto a non-zero acc."""
    _ok(results, "several_launches_and_emit_batches_change_no_bit")


def test_launch_arguments(results):
    """enable_fp_fusion=False on every launch; fp32 operands as fp32 with "ieee" precision, bf16
    as bf16, mixed as fp32 (what the interpreter cannot show numerically)."""
    _ok(results, "launch_arguments")


def test_forced_emit_gives_the_same_bytes(results):
    """Every tile through the EMIT path: the same accumulator."""
    _ok(results, "forced_emit_gives_the_same_bytes")


def test_edge_tiles_odd_shapes_and_one_leaf(results):
    _ok(results, "edge_tiles_odd_shapes_and_one_leaf")


def test_onto_a_nonzero_accumulator_and_strided_operands(results):
    _ok(results, "onto_a_nonzero_accumulator_and_strided_operands")


def test_tiles_never_change_bytes(results):
    _ok(results, "tiles_never_change_bytes")


def test_retry_all_leaves_clean_tiles_untouched(results):
    """The every-tile retry (no host sync) returns at once on a clean tile (a sentinel in its
    words survives) and recomputes a flagged one (== the first pass's words, flag cleared)."""
    _ok(results, "retry_all_leaves_clean_tiles_untouched")


def test_deferred_retry_all_takes_the_callers_use_tma(results):
    """rounded_grad_weight_deferred's first pass and every-tile retry (RETRY_ALL) both get the
    caller's use_tma (a spy on _launch) and fetch by TMA exactly when it is True (the launches'
    TMA), the retry recomputing a planted tile either way; bytes == the digit path's."""
    _ok(results, "deferred_retry_all_takes_the_callers_use_tma")


def test_rounded_grad_weight_is_the_digit_path_rounding(results):
    """rounded_grad_weight == round_fp32(accumulator) == round_fp32(reference), bytewise: narrow
    and wide scales, the lo-word element (rounds up to 1 + 2**-23), sums past fp32 (+Inf), edge
    tiles, strided operands, other tiles, bf16 and mixed operands, no token (+0.0)."""
    _ok(results, "rounded_is_the_digit_path_rounding")


def test_rounded_grad_weight_is_none_when_a_tile_is_flagged(results):
    """An extreme element, a NaN operand, forced flags: None; four launches (OUT_ELEMS lowered):
    the digit path's bytes, or None with an extreme element in the third."""
    _ok(results, "rounded_is_none_when_a_tile_is_flagged")


def test_words_deferred_hold_the_digit_path_sum(results):
    """words_grad_weight_deferred (a chunk's words sent over several ranks): their digits ==
    the kernel's accumulator == the reference's, rounded == rounded_grad_weight, count 0 —
    scales, the lo-word element, bf16, four launches; an extreme element counts 1 tile, forced
    flags every tile; no token: zero words."""
    _ok(results, "words_deferred_hold_the_digit_path_sum")


def test_direct_sink_words_path_equals_the_digit_path(results):
    """One-rank direct sink in 16-row chunks with the words_rows hook: the flagged chunk takes
    add_rows (digits), the others are rounded from the words; forced flags: all digits; bytes
    == the digit-only direct path == the reference."""
    _ok(results, "direct_sink_words_path_equals_the_digit_path")


def test_bad_arguments_are_refused(results):
    """Token counts that differ or are not whole leaves, accumulators of the wrong shape or
    layout: ValueError (rounded_grad_weight too, for the token counts)."""
    _ok(results, "bad_arguments_are_refused")


def test_tma_fetches_equal_pointer_loads(results):
    """bf16 operands with aligned rows are fetched by TMA descriptors in every launch and give
    the pointer loads' bytes (edge tiles included); unaligned ones keep the pointer loads."""
    _ok(results, "tma_fetches_equal_pointer_loads")


def test_carried_words_over_microbatches_equal_the_digit_path(results):
    """A persistent sink carrying the double words over calls of 3, 1 and 4 leaves (and 1 and 8
    calls, and a two-rank group): the digit reference's bytes, an inexact add in a later call
    retried from the carried words (control: dropping its error rounds to 1.0)."""
    _ok(results, "carried_words_over_microbatches_equal_the_digit_path")


def test_carried_first_pass_flags_no_tile_where_every_add_is_exact(results):
    """Carried nonzero words and exact adds: the carried first pass flags no tile, the words ==
    one call's."""
    _ok(results, "carried_first_pass_flags_no_tile_where_every_add_is_exact")


def test_carried_words_move_to_digits_where_a_tile_cannot_hold_its_sum(results):
    """2**100, 1.5·2**46, 2**-100 over three calls: the third leaves its tile, the weight moves
    to digits with that call's partials added there; forced from the first call too: the
    reference's bytes."""
    _ok(results, "carried_words_move_to_digits_where_a_tile_cannot_hold_its_sum")


def test_carried_words_flags_read_late_give_the_same_bytes(results):
    """Flag counts read only at the end: later calls continue the words, the flagged tile is
    added to digits late; the same bytes."""
    _ok(results, "carried_words_flags_read_late_give_the_same_bytes")



def test_carried_words_in_a_late_sink_count_the_tile_for_a_second_pass(results):
    """The trainer's late first pass: an unholdable tile is counted in the sink's late tile
    counter (no deferred chunk, no digits) and late_flagged says run again; clean operands
    flag nothing and round to the digit reference; control: an eager sink moves to digits."""
    _ok(results, "carried_words_in_a_late_sink_count_the_tile_for_a_second_pass")

def test_carried_words_count_the_flags_of_every_launch(results):
    """Four launches (OUT_ELEMS lowered), the tile that cannot hold its sum in the third: the
    deferred flag count adds every launch's flags, so the weight moves to digits with that
    tile's partials; the reference's bytes."""
    _ok(results, "carried_words_count_the_flags_of_every_launch")


def test_carried_words_of_a_split_weight_join_its_rows_at_finish(results):
    """A split (tied) weight whose dense sum is held in carried words: finish adds the words'
    sums of the noted rows to the sparse use's row accumulator; the reference's bytes."""
    _ok(results, "carried_words_of_a_split_weight_join_its_rows_at_finish")


def test_carried_words_refuse_bad_words(results):
    """fp32 words, the wrong shape, non-contiguous words: ValueError."""
    _ok(results, "carried_words_refuse_bad_words")


def test_tma_aligned_refuses_what_tma_cannot_describe():
    """`_tma_aligned` (the dW kernel's choice of TMA descriptors, on CPU tensors: no kernel
    runs): an aligned contiguous bf16 (and fp16) operand passes; each refusal case breaks one
    condition alone, the others holding — a base one bf16 element (2 bytes) past a 16-byte
    boundary, inner stride 2 (every other column), fp32 elements (rows still 16-byte multiples),
    40-byte rows — and `_descriptors` keeps the pointer loads (TMA False, the tensors
    themselves) for each, and wherever use_tma is False."""
    from rlkernel.kernels import triton_grad_weight as tgw
    tile = (16, 16, 1, 1)
    ok = torch.zeros(128, 24, dtype=torch.bfloat16)            # 48-byte rows
    assert ok.data_ptr() % 16 == 0, "the CPU allocator's alignment this test assumes"
    assert tgw._tma_aligned(ok) and tgw._tma_aligned(ok.half())
    assert tgw._descriptors(ok, ok, tile, True)[2] is True
    buf = torch.zeros(1 + 128 * 24, dtype=torch.bfloat16)
    off = buf[1:].view(128, 24)                                # base at +2 bytes
    strided = torch.zeros(128, 48, dtype=torch.bfloat16)[:, ::2]
    wide = torch.zeros(128, 24, dtype=torch.float32)           # 96-byte rows, 4-byte elements
    narrow = torch.zeros(128, 20, dtype=torch.bfloat16)        # 40-byte rows
    assert buf.data_ptr() % 16 == 0 and off.data_ptr() % 16 == 2 and off.stride() == (24, 1)
    assert strided.stride() == (48, 2) and strided.data_ptr() % 16 == 0
    assert wide.stride() == (24, 1) and wide.data_ptr() % 16 == 0
    for name, t in (("base", off), ("inner stride", strided), ("fp32", wide), ("rows", narrow)):
        assert tgw._tma_aligned(t) is False, name
        for a, b in ((t, ok), (ok, t)):
            got = tgw._descriptors(a, b, tile, True)
            assert got[2] is False and got[0] is a and got[1] is b, name
    assert tgw._descriptors(wide, wide, tile, True)[2] is False         # fp32 pair: pointer loads
    assert tgw._descriptors(ok, ok, tile, False) == (ok, ok, False)


def _dw_ptx(tma: bool, carry: bool, retry: bool, fusion: bool = False,
            retry_all: bool = False) -> str:
    from rlkernel.kernels import triton_grad_weight as tgw
    ce = dict(BLOCK_N=64, BLOCK_K=64, LEAF=128, PREC="tf32", EMIT=False, RETRY=retry,
              FORCE_FLAG=0, RETRY_ALL=retry_all, TMA=tma, CARRY=carry, COUNTED=retry_all)
    desc = "tensordesc<bf16[128, 64]>" if tma else "*bf16"
    kinds = {"DY": "*bf16", "X": "*bf16", "AD": desc, "BD": desc, "OUT": "*fp64",
             "FLAGS": "*i32", "TILES": "*i32", "COUNT": "*i32"}
    types = {n: "constexpr" if n in ce else kinds.get(n, "i32") for n in tgw._dw_kernel.arg_names}
    return sm90_ptx(tgw._dw_kernel, types, ce, 4, fusion)


@NEEDS_TRITON
@pytest.mark.parametrize("tma,carry,retry,retry_all", [
    (True, True, False, False), (True, True, True, False), (True, True, True, True),
    (False, True, False, False), (True, False, False, False)])
def test_compiled_ptx_of_the_dw_pass(tma, carry, retry, retry_all):
    """sm_90 PTX as launched (enable_fp_fusion=False) of the first pass and its checked retry
    (over listed tiles, or over all of them as carry_grad_weight_deferred launches it), with
    TMA tiles and carried words: TMA bulk loads where asked (none otherwise), the carried
    words loaded as float64, no fused multiply-add in float64 (the exact adds' checks need
    every add rounded alone); a retry over all tiles adds its flags to the caller's count
    (COUNTED, an atomic add), the others do not."""
    ptx = _dw_ptx(tma, carry, retry, retry_all=retry_all)
    assert bool(re.search(r"(atom|red)\.global\S*\.add", ptx)) == retry_all
    assert ("cp.async.bulk.tensor" in ptx) == tma
    assert bool(re.search(r"ld\.global(\.v\d)?\.b64", ptx)) == carry
    assert "fma.rn.f64" not in ptx
    assert "wgmma.mma_async" in ptx


@NEEDS_TRITON
def test_the_first_dw_pass_keeps_its_tile_in_registers():
    """ptxas (sm_90a) of the first pass as `carry_grad_weight_deferred` and
    `rounded_grad_weight_deferred` launch it at a qwen3-1.7b down_proj (16,384 tokens, dy
    [L, 6144], x [L, 2048] bf16 by TMA): no spills, carried or not, at the table's tile and at
    64 x 128 (one m64n128 wgmma a k-step). (The carried lo, which the first pass never changes,
    was loaded and kept live through the leaf loop, with an int32 flag tile beside hi: 255
    registers and 160 bytes of spill stores a thread, carried; 172 registers direct. The
    carried hi's pointers, when they were the stores' too, stayed live through the loop: 80
    bytes of spills at 64 x 128.) Its carried words load hi only; the checked retry, which
    changes lo, loads both (the retry's PTX has twice the first pass's float64 loads)."""
    from kernel_helpers import FakeTensor, fake_descriptor, sm90_as_launched, sm90_registers

    from rlkernel.kernels import triton_grad_weight as tgw
    n_tok, n, k = 16384, 6144, 2048
    bf, f64, i32 = torch.bfloat16, torch.float64, torch.int32

    def launch(carry: bool, retry_all: bool, tile=(64, 64, 4, 3)) -> tuple[list, dict]:
        bn, bk, warps, stages = tile
        args = [FakeTensor(bf), FakeTensor(bf), fake_descriptor(bf, [n_tok, n], [128, bn]),
                fake_descriptor(bf, [n_tok, k], [128, bk]), FakeTensor(f64), FakeTensor(i32),
                FakeTensor(i32), FakeTensor(i32), n_tok, n, k, n, 1, k, 1, n * k, k]
        kw = dict(BLOCK_N=bn, BLOCK_K=bk, LEAF=128, PREC="tf32", EMIT=False, RETRY=retry_all,
                  FORCE_FLAG=0, RETRY_ALL=retry_all, TMA=True, CARRY=carry, COUNTED=retry_all,
                  num_warps=warps, num_stages=stages, enable_fp_fusion=False)
        return args, kw

    for tile in ((64, 64, 4, 3), (64, 128, 4, 2)):
        for carry in (True, False):
            regs, spill = sm90_registers(tgw._dw_kernel, *launch(carry, False, tile))
            assert spill == 0 and regs < 255, (tile, carry, regs, spill)
    loads = [len(re.findall(r"ld\.global(?:\.\w+)*\.b64",
                            sm90_as_launched(tgw._dw_kernel, *launch(True, retry))))
             for retry in (False, True)]
    assert loads[0] > 0 and loads[1] == 2 * loads[0], loads
