"""The CUDA kernels of exact fixed-point sums (rlkernel/numerics/triton_fixedpoint.py) under
TRITON_INTERPRET=1 (Triton on the CPU): the accumulation kernel's accumulator == the torch path's
(fixedpoint.accumulate_ on CPU, the reference), bytewise (torch.equal on the int64 columns, after
both normalise), and the rounding kernel's fp32 == fixedpoint.round_fp32_torch's (as int32), for
every case below; `add_double_words_` against exact Python integers; `round_double_words`'s
fp32 == the digit path's rounding of hi + lo (and the CPU reference), and its compiled PTX
(cvt.rn.f32.f64, no .ftz; compiled in this process, no interpreter). The checks live in
tests/fixedpoint_triton_checks.py and run in one subprocess (the interpreter is chosen before
triton is imported, and must not leak into this process); each test asserts its check's result.
On a GPU: tests/test_cuda.py.
Run: .venv/bin/python -m pytest -q tests/test_fixedpoint_triton.py (needs triton installed; the
k > 2**13 check is marked slow: add -m slow).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kernel_helpers import NEEDS_TRITON, check_ok as _ok, run_interpreted_checks, sm90_ptx

pytestmark = NEEDS_TRITON

_CHECKS = Path(__file__).with_name("fixedpoint_triton_checks.py")


def _run(*names: str) -> dict[str, str]:
    return run_interpreted_checks(_CHECKS, *names)


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    return _run()


def test_constants_match_the_torch_path(results):
    """N_COLS, N_DIGITS and the flush length SEG == fixedpoint's N_COLS, N_DIGITS, _BIN_ROWS."""
    _ok(results, "n_cols_match")


def test_every_exponent_bin_subnormals_and_signed_zeros(results):
    """kernel == torch for x [64, 260], column j around 2**(j − 140): subnormals up to 2**119,
    so every float64 bin and all ten digits are used; +0.0 and −0.0 columns."""
    _ok(results, "every_exponent_bin")


def test_random_bit_patterns(results):
    """kernel == torch for 96 x 200 uniformly random fp32 bit patterns (NaN payloads, ±Inf,
    subnormals, both signs)."""
    _ok(results, "random_bit_patterns")


def test_nan_and_infinities_are_counted_per_value(results):
    """kernel == torch, and the flag columns count values: Inf twice, +Inf with −Inf in one
    element, NaN beside finite values, fp32-max values beside an Inf kept in the digits."""
    _ok(results, "nonfinite_values")


def test_nonfinite_counts_add_over_flushes_and_calls(results):
    """kernel == torch when NaN/±Inf sit in several 8-row flushes and the accumulator already
    holds counts: each flush adds its counts to the row's (bytes, and the expected counts)."""
    _ok(results, "nonfinite_counts_add_over_flushes_and_calls")


def test_row_parts_give_the_single_pass_bytes_negative_control_dropped_part(results):
    """Rows cut into parts (few columns) == the single pass == the torch path; a part left out
    differs."""
    _ok(results, "row_parts_give_the_single_pass_bytes")
    _ok(results, "row_parts_negative_control_a_dropped_part_differs")


def test_one_row(results):
    """kernel == torch for k = 1."""
    _ok(results, "one_row")


def test_several_bin_flushes(results):
    """kernel == torch for k = 2·64 + 37 rows flushed every 64 rows (seg=64): two flushes into
    the accumulator row, then a tail shorter than the unroll."""
    _ok(results, "more_rows_than_a_short_bin_flush")


@pytest.mark.slow
def test_more_rows_than_one_bin_flush():
    """kernel == torch for k = 2·2**13 + 37 rows at the real flush length, with bin sums next to
    the 2**52-unit exactness bound (about a minute under the interpreter)."""
    _ok(_run("more_rows_than_a_bin_flush"), "more_rows_than_a_bin_flush")


def test_non_contiguous_values(results):
    """kernel == torch for x with strides (1, k) and for a slice with strides (3·cols, 2)."""
    _ok(results, "non_contiguous_values")


def test_accumulator_that_already_holds_values(results):
    """kernel == torch when acc already holds a negative sum (top digit < 0), and when its
    digits are not normalised (a sum of three accumulators)."""
    _ok(results, "accumulator_that_already_holds_values")


def test_many_calls_in_sequence(results):
    """After each of 5 calls (k = 1, 9, 33, 2, 17) kernel acc == torch acc; and the 5 calls ==
    one call on their concatenation."""
    _ok(results, "many_calls_in_sequence")


def test_launch_shape_changes_no_bit(results):
    """BLOCK 32 / 128 / 256 and an 8-row flush give the same bytes."""
    _ok(results, "launch_shape_changes_no_bit")


def test_reversed_rows_same_bytes_negative_control_fp32_sum_differs(results):
    """kernel(x reversed) == kernel(x) == torch(x); negative control: torch.sum in fp32 of the
    same rows reversed changes bytes (so an order-dependent kernel would fail the equality)."""
    _ok(results, "order_changes_no_bit_but_changes_fp32_sums")


def test_bad_arguments_are_refused(results):
    """Shape mismatch, float64 values, a float or a non-contiguous accumulator: ValueError."""
    _ok(results, "bad_arguments_are_refused")


# ------------------------------------------------------------------- rounding (round_fp32)
# Each: the rounding kernel's fp32 == fixedpoint.round_fp32_torch's, compared as int32
# (torch.equal), and the input accumulator unchanged. Cases: tests/fixedpoint_round_cases.py.

def test_round_ties_with_and_without_sticky_bits(results):
    """Exact ties (2M + 1)·2**p at every rounding position p (M odd, even, 2**24 − 1: the carry
    to the next binade), just below them, and with a sticky bit just under the tie bit, at the
    bottom of the two-digit window, at the top/bottom of the digits below it; both signs; each
    normalised and with carries moved between digits."""
    _ok(results, "round_ties_and_sticky_bits")


def test_round_fp32_range_edges_subnormals_and_overflow(results):
    """Subnormal results (exact), the first rounded values above 2**24 units, fp32 max and the
    tie above it (to +Inf), the top digit's unit and beyond (Inf), values across every digit
    boundary; both signs, normalised and not."""
    _ok(results, "round_fp32_range_edges")


def test_round_random_digits_unnormalised_and_int64_wrapping(results):
    """1500 rows of random digits: normalised, outside [0, 2**31) by up to 2**40 / 2**62 (so
    negative lower digits), or any int64 (the carries wrap int64 as in torch); random top digit
    index; and top digits of −2**63 (their own negation: −Inf)."""
    _ok(results, "round_random_digits")


def test_round_sums_and_differences_of_accumulators(results):
    """Sums of 2 and 4 real accumulators (wide values with NaN/±Inf), differences (negative
    counts and digits), and a + accumulate(−values) (exact zeros)."""
    _ok(results, "round_sums_of_accumulators")


def test_round_zeros_are_plus_zero(results):
    """Zero however spelt (carries moved between digits, top digit −1 over 2**31, a negative
    sum plus its negation) is +0.0, as in the torch path; ±2**-149 beside them."""
    _ok(results, "round_zeros")


def test_round_nonfinite_counts_alone_and_mixed(results):
    """Every combination of NaN (0, 1, 2, −1), +Inf (0, 1, 3, −2), −Inf (0, 1, −1) counts with
    zero, finite, negative and out-of-range digits."""
    _ok(results, "round_nonfinite_counts")


def test_round_large_shape_with_a_tail(results):
    """20_011 rows (no multiple of any BLOCK): sums of two accumulators of wide values."""
    _ok(results, "round_large_with_tail")


def test_round_launch_shapes_and_strides_change_no_bit(results):
    """BLOCK 32/256 with 1/8 warps, a column-major copy, a row-strided slice, one row, no row."""
    _ok(results, "round_launch_shapes_strides_and_shapes")


def test_round_negative_control_other_rounding_modes_differ(results):
    """The kernel with ties-away-from-zero or truncation in place of round-half-even gives other
    bytes on the ties case (so the bytewise check can fail); restored, it matches again."""
    _ok(results, "round_negative_control_other_rounding_modes_differ")


def test_round_bad_arguments_are_refused(results):
    """A float accumulator, 12 columns, a 3-D accumulator: ValueError."""
    _ok(results, "round_bad_arguments_are_refused")


def test_two_sum_sorted_gives_two_sums_words_negative_control_unordered(results):
    """add_word's Fast2Sum on sorted operands == Knuth's TwoSum bit for bit (sum and error,
    and the pair is the exact sum); without the ordering the errors differ."""
    _ok(results, "two_sum_sorted_gives_two_sums_words")
    _ok(results, "two_sum_sorted_negative_control_unordered_fast2sum_differs")


def test_add_exact_flags_exactly_the_inexact_adds_negative_control_one_difference(results):
    """add_exact_or_nan (the dW first pass's and dK/dV's add): the rounded sum, NaN exactly
    where it is inexact (Fraction), NaN/inf operands flagged; checking only s − hi == p misses
    1 + 2**-52 plus 2**53."""
    _ok(results, "add_exact_flags_exactly_the_inexact_adds")
    _ok(results, "add_exact_negative_control_one_difference_misses_an_inexact_add")


def test_fast_path_holds_what_a_float64_sum_loses(results):
    """The double-word path: columns needing the lo word (1, 2**-24, 2**-80 rounds up to
    1 + 2**-23) == torch and == the bins-only kernel (fast=False)."""
    _ok(results, "fast_path_holds_what_a_float64_sum_loses")


def test_fast_path_negative_control_a_plain_float64_sum_differs(results):
    """With TwoSum replaced by a plain float64 add the bytes change (the path is taken and the
    check can fail); bins-only is unaffected."""
    _ok(results, "fast_path_negative_control_a_plain_float64_sum_differs")


def test_fast_path_programs_mixed_with_the_bin_path(results):
    """Blocks that fall back to the bins (a 2**200-span column, a NaN) beside fast blocks,
    onto a non-zero accumulator, at two block sizes: == torch."""
    _ok(results, "fast_path_programs_mixed_with_the_bin_path")


def test_fast_path_large_magnitudes_and_cancellation(results):
    _ok(results, "fast_path_large_magnitudes_and_cancellation")


def test_fast_path_bound_sends_programs_to_the_bins(results):
    """|hi| >= TOP_F64_BITS sends a program to the bins: with the bound lowered to 2**129 and the
    double-word flush spied, sums of exactly ±2**129 get torch's bytes, sums of ±2**128 take the
    fast path (the spy adds nothing); restored: == torch."""
    _ok(results, "fast_path_bound_sends_programs_to_the_bins")


def test_fast_path_reads_no_dead_lane(results):
    """Lanes past the last column read nothing: a view whose rows continue with NaN still takes
    the fast path (flush spied); restored: == torch."""
    _ok(results, "fast_path_reads_no_dead_lane")


def test_accumulate_launches_disable_fp_fusion(results):
    """accumulate_ launches with enable_fp_fusion=False, fast path or not."""
    _ok(results, "accumulate_launches_disable_fp_fusion")


def test_round_words_sum_is_the_digit_path_rounding(results):
    """round_words_sum (P ranks' double words summed and rounded in one pass) == round_fp32 of
    P add_double_words_ passes' digits == that of the exact integer sum, P = 1, 2, 3, 5,
    cancellations,
    ±Inf, strided stacks, two launch shapes; control: a float64 sum rounds otherwise; bad
    layouts refused."""
    _ok(results, "round_words_sum_is_the_digit_path_rounding")


def test_double_words_add_exactly(results):
    """add_double_words_: acc + hi + lo == the exact integer's normalised digits (Python ints),
    counts unchanged, for |hi| up to just below TOP_F64_BITS, ±2**-149, ±0, random words over
    the whole range with lo of either sign; row-strided words; BLOCK 128 and 32."""
    _ok(results, "double_words_add_exactly")


# ------------------------------------------------------------- segments (accumulate_segments_)
# Each: the segmented kernel's accumulator == a torch-path accumulate_ per segment onto the same
# rows == fixedpoint.accumulate_segments_ on CPU, torch.equal on all columns.

def test_segments_match_the_torch_path(results):
    """8 segments onto 12 rows of a non-normalised accumulator (empty segments first, middle,
    last; 1, 3, 37 and 14 rows; dest scrambled), wide values with a span only the bins hold and
    NaN/±Inf: == torch at BLOCK 128 and 32, an 8-row flush, bins only, a column-major x; rows
    of no non-empty segment keep their bytes; G = 0 and n = 0 change nothing."""
    _ok(results, "segments_match_the_torch_path")


def test_segments_take_the_fast_path_and_the_bins(results):
    """With the double-word flush spied, exactly the (segment, column block) programs holding
    the wide span or NaN/±Inf added (the bins); every other one took the fast path."""
    _ok(results, "segments_take_the_fast_path_and_the_bins")


def test_segments_negative_control_a_plain_float64_sum_differs(results):
    """With TwoSum replaced by a plain float64 add the segmented kernel's bytes change (the
    comparison can fail); restored, == torch."""
    _ok(results, "segments_negative_control_a_plain_float64_sum_differs")


def test_segments_launch_disables_fp_fusion(results):
    """accumulate_segments_ launches with enable_fp_fusion=False, fast path or not."""
    _ok(results, "segments_launch_disables_fp_fusion")


def test_segments_bad_arguments_are_refused(results):
    """Wrong accumulator rank/dtype/width/contiguity, float64 values, int32 or mis-sized
    offsets/dest, a bad flush length: ValueError."""
    _ok(results, "segments_bad_arguments_are_refused")


def test_segments_kernel_compiles_for_sm90():
    """The segmented kernel compiles for sm_90 on the CPU, as the wrapper launches it (FAST, no
    fp fusion): the interpreter above runs it as Python and checks no Triton typing (e.g. of the
    int64 segment bounds or the `if k > 0` around the body). Both paths are in the one binary
    (the bins are the runtime fallback): its PTX holds the TwoSum float64 adds."""
    from rlkernel.numerics import triton_fixedpoint as tfx
    ptrs = {"X": "*fp32", "ACC": "*i64", "OFFS": "*i64", "DEST": "*i64"}
    ints = {a: "i32" for a in ("m", "n_blocks", "s_k", "s_m")}
    consts = {"N_COLS": tfx.N_COLS, "SEG": tfx.SEG, "BLOCK": tfx.BLOCK, "UNROLL": tfx.UNROLL,
              "FAST": True}
    ptx = sm90_ptx(tfx._segments_kernel, {**ptrs, **ints, **dict.fromkeys(consts, "constexpr")},
                   consts, tfx.NUM_WARPS, fusion=False)
    assert ".entry _segments_kernel" in ptx and "add.rn.f64" in ptx


def test_parts_kernel_compiles_for_sm90():
    """The row parts' kernel (bounds computed in the kernel, no offsets) compiles for sm_90 as
    `_add_parts` launches it, with the TwoSum float64 adds of the shared body."""
    from rlkernel.numerics import triton_fixedpoint as tfx
    ptrs = {"X": "*fp32", "ACC": "*i64"}
    ints = {a: "i32" for a in ("k", "step", "parts", "m", "n_blocks", "s_k", "s_m")}
    consts = {"N_COLS": tfx.N_COLS, "SEG": tfx.SEG, "BLOCK": tfx.BLOCK, "UNROLL": tfx.UNROLL,
              "FAST": True}
    ptx = sm90_ptx(tfx._parts_kernel, {**ptrs, **ints, **dict.fromkeys(consts, "constexpr")},
                   consts, tfx.NUM_WARPS, fusion=False)
    assert ".entry _parts_kernel" in ptx and "add.rn.f64" in ptx


# ----------------------------------------------------- rounding double words (round_double_words)
# Each: the kernel's fp32 == round_fp32_torch of the accumulator holding hi + lo (Python
# integers) == fixedpoint.round_double_words_torch, as int32. Cases: fixedpoint_round_cases.py.

def test_round_words_fp32_ties_at_every_binade(results):
    """Midpoints (M odd, even, 2**24 − 1) at every binade from 2**-125 up, with lo 0, ±2**-149,
    ±u; reached through lo (hi = mid ∓ d, lo = ±d ± u); from hi's float64 neighbour, lo back
    by u or half a float64 unit; both signs."""
    _ok(results, "round_words_ties")


def test_round_words_powers_of_two_with_lo_of_the_other_sign(results):
    _ok(results, "round_words_powers_of_two")


def test_round_words_subnormal_results_and_the_smallest_unit(results):
    _ok(results, "round_words_subnormal_and_tiny")


def test_round_words_around_fp32_max_and_the_overflow_tie(results):
    """fp32 max ± 2**-149, 2**128·(1 − 2**-25) (to +Inf) directly or through lo, just below it
    (to max), hi up to the contract's bound, cancellation from 2**149 to one unit."""
    _ok(results, "round_words_fp32_range_top")


def test_round_words_zeros_are_plus_zero(results):
    """hi = lo = −0.0, ±0.0 mixed, hi = −lo: +0.0, as the digit path gives."""
    _ok(results, "round_words_zeros")


def test_round_words_two_sum_accumulations_of_random_fp32(results):
    """Double words made as the dW kernel makes them from 64 random fp32 values per element
    (wide scales, exact cancellation, ties broken by a tail)."""
    _ok(results, "round_words_two_sum_accumulations")


def test_round_words_random_words(results):
    _ok(results, "round_words_random_words")


def test_round_words_equal_the_digit_kernels(results):
    """== round_fp32(add_double_words_(zeros, words)), those two kernels run, on a sample."""
    _ok(results, "round_words_equal_the_digit_kernels")


def test_round_words_launch_shapes_and_strides(results):
    _ok(results, "round_words_launch_shapes_and_strides")


def test_round_words_negative_control_without_the_error_word(results):
    """With TwoSum's error dropped (no round to odd: the cast of RN64(hi + lo)) the kernel
    gives other bytes on the ties, as does the plain (hi + lo).to(float32)."""
    _ok(results, "round_words_negative_control_without_the_error_word")


def test_round_words_launches_disable_fp_fusion(results):
    _ok(results, "round_words_launches_disable_fp_fusion")


def test_round_words_bad_arguments_are_refused(results):
    _ok(results, "round_words_bad_arguments_are_refused")


def test_round_words_compiled_ptx_rounds_to_nearest_without_ftz():
    """sm_90 PTX of _round_words_kernel as launched (enable_fp_fusion=False): the fp32 comes from
    cvt.rn.f32.f64 — round-half-even — with no .ftz anywhere, so fp32 subnormal results are
    kept (a flush would turn 2**-149 into 0); no other rounding mode, no fma; TwoSum's float64
    adds and subtracts all round to nearest (add.rn.f64 / sub.rn.f64, never a bare add.f64)."""
    from rlkernel.numerics import triton_fixedpoint as tfx
    ptx = sm90_ptx(tfx._round_words_kernel, ["*fp64", "*fp32", "i32", "i32", "constexpr"],
                   {"BLOCK": tfx.WORDS_BLOCK}, tfx.WORDS_WARPS, False)
    cvts = set(re.findall(r"\bcvt\.[\w.]*f32\.f64\b", ptx))
    assert cvts == {"cvt.rn.f32.f64"}, cvts
    assert ".ftz" not in ptx and "fma" not in ptx and ".approx" not in ptx
    assert not re.search(r"\b(add|sub|mul)\.f(32|64)\b", ptx)
    assert "add.rn.f64" in ptx and "sub.rn.f64" in ptx
