"""The checks behind tests/test_fixedpoint_triton.py, run in a subprocess with TRITON_INTERPRET=1
(Triton's CPU interpreter must be chosen before triton is imported, and must not leak into the
other tests' process). Each check compares the Triton kernel's accumulator with the torch path's
(fixedpoint.accumulate_ on CPU, the reference), bytewise with torch.equal on the int64 columns;
the round_* checks compare the rounding kernel's fp32 with fixedpoint.round_fp32_torch's as int32
(cases: tests/fixedpoint_round_cases.py).
Prints one JSON object {check name: "ok" or the failure}: the named checks, or all but SLOW.
Does not: run without the interpreter.
Run by hand: TRITON_INTERPRET=1 .venv/bin/python tests/fixedpoint_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import contextlib
import fractions
import functools
import math
import os
import struct
import sys
import warnings

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("fixedpoint_triton_checks.py needs TRITON_INTERPRET=1")

import triton_interpreter_compat  # noqa: F401 - numpy >= 2.3: before any launch
from kernel_helpers import LaunchRecorder, run_checks
# Imported after the TRITON_INTERPRET check; fixedpoint_round_cases sits in tests/, this
# script's folder (so on sys.path).
import fixedpoint_round_cases as rc
import triton
import triton.language as tl

from rlkernel.numerics import fixedpoint as fx
from rlkernel.numerics import triton_fixedpoint as tfx

INF, NAN = float("inf"), float("nan")
SLOW = {"more_rows_than_a_bin_flush"}
CHECKS = {}
# numpy warns when the interpreter widens a signalling-NaN fp32 to float64; the kernel counts
# that value as NaN and never adds it, so the warning says nothing about the result.
warnings.filterwarnings("ignore", "invalid value encountered in cast", RuntimeWarning)
# ... and when round_double_words' float64 -> fp32 cast overflows to ±Inf, as it must.
warnings.filterwarnings("ignore", "overflow encountered in cast", RuntimeWarning)


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _same_as_torch(x: torch.Tensor, acc0: torch.Tensor | None = None, **launch) -> torch.Tensor:
    """Kernel(acc0 + x) == torch path(acc0 + x), bytewise; returns the accumulator."""
    m = x[0].numel()
    acc0 = fx.zeros((m,)) if acc0 is None else acc0
    want = fx.accumulate_(acc0.clone(), x)
    got = tfx.accumulate_(acc0.clone(), x.reshape(x.shape[0], m), **launch)
    assert torch.equal(got, want), f"columns {torch.nonzero((got != want).any(1)).flatten()[:8]}"
    return got


def _every_bin(k: int, cols: int = 260, seed: int = 0) -> torch.Tensor:
    """x [k, cols]: column j drawn around 2**(j − 140) (jitter x2**±3), so columns 0..~13 are
    subnormal and every exponent bin decides some column; column 0 is +0.0, column 1 ±0.0."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.arange(cols, dtype=torch.float64) - 140)
    jitter = torch.exp2(torch.randint(-3, 4, (k, cols), generator=g).double())
    x = (torch.randn(k, cols, generator=g, dtype=torch.float64) * scale * jitter).float()
    x[:, 0] = 0.0
    x[::2, 1] = -0.0
    return x


@check
def n_cols_match():
    assert tfx.N_COLS == fx.N_COLS and tfx.N_DIGITS == fx.N_DIGITS and tfx.SEG == fx._BIN_ROWS


@check
def every_exponent_bin():
    acc = _same_as_torch(_every_bin(64))
    assert (acc[:, 2:fx.N_DIGITS] != 0).any()           # the high digits were really used


@check
def random_bit_patterns():
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-2**31, 2**31, (96, 200), generator=g, dtype=torch.int64)
    _same_as_torch(bits.to(torch.int32).view(torch.float32))


@check
def nonfinite_values():
    col = [[INF, INF, NAN, 3e38, -INF, INF, 1.0, NAN],        # element j: column j
           [INF, -INF, 1.0, 3e38, -INF, NAN, 2.0, 5e-45],
           [3e38, 2.0, NAN, -1.0, -INF, -INF, 3.0, -3e38]]
    acc = _same_as_torch(torch.tensor(col))
    assert acc[:, fx.N_DIGITS:].tolist() == [[0, 2, 0], [0, 1, 1], [2, 0, 0], [0, 0, 0],
                                             [0, 0, 3], [1, 1, 1], [0, 0, 0], [1, 0, 0]]


@check
def nonfinite_counts_add_over_flushes_and_calls():
    """The NaN/+Inf/−Inf counts of a flush are ADDED to the accumulator's (8-row flushes, an
    accumulator that already holds counts), not written over them."""
    x = _every_bin(40, cols=6, seed=8)
    for r, c, v in ((1, 0, -INF), (9, 0, -INF), (33, 0, -INF), (2, 1, INF), (17, 1, INF),
                    (3, 2, NAN), (25, 2, NAN), (4, 3, -INF), (12, 3, INF), (30, 3, NAN)):
        x[r, c] = v
    acc0 = fx.accumulate_(fx.zeros((6,)), torch.tensor([[-INF, INF, NAN, -INF, 1.0, -INF]]))
    acc = _same_as_torch(x, acc0, seg=8)
    assert acc[:, fx.N_DIGITS:].tolist() == [[0, 0, 4], [0, 3, 0], [3, 0, 0], [1, 1, 2],
                                             [0, 0, 0], [0, 0, 1]]


@check
def row_parts_give_the_single_pass_bytes():
    """accumulate_ with its rows cut into parts (few columns: the norm weights' case) == the
    single pass (min_programs=0) == the torch path, bitwise: every exponent bin, NaN/±Inf
    counts, a remainder part, onto an accumulator that already holds values; and the parts
    path is really taken (spied)."""
    calls = []
    real = tfx._add_parts

    def spy(*a, **k):
        calls.append(a[2])
        return real(*a, **k)
    x = _every_bin(64 * 9 + 37, cols=130, seed=12)
    x[5, 3], x[300, 3], x[301, 4], x[600, 5] = INF, -INF, NAN, NAN
    acc0 = fx.accumulate_(fx.zeros((130,)), _every_bin(3, cols=130, seed=13))
    tfx._add_parts = spy
    try:
        got = tfx.accumulate_(acc0.clone(), x)
    finally:
        tfx._add_parts = real
    assert calls == [9], calls                                # 9 parts of >= 64 rows
    one = tfx.accumulate_(acc0.clone(), x, min_programs=0)
    assert torch.equal(got, one)
    assert torch.equal(got, fx.accumulate_torch_(acc0.clone(), x))
    assert got[3, fx.N_DIGITS:].tolist() == [0, 1, 1] and got[4, fx.N_DIGITS] == 1
    assert torch.equal(tfx.accumulate_(acc0.clone(), x, fast=False, seg=16), one)   # bins path


@check
def row_parts_negative_control_a_dropped_part_differs():
    """The comparison above can fail: the parts path with its last part's rows left out gives
    other bytes."""
    x = _every_bin(64 * 4, cols=40, seed=14)
    want = tfx.accumulate_(fx.zeros((40,)), x, min_programs=0)
    got = tfx._add_parts(fx.zeros((40,)), x[:64 * 3], 3, tfx.BLOCK, tfx.NUM_WARPS, tfx.SEG, True)
    assert not torch.equal(got, want)
    assert torch.equal(got, tfx.accumulate_(fx.zeros((40,)), x[:64 * 3], min_programs=0))


@check
def one_row():
    _same_as_torch(_every_bin(1))


def _near_the_flush_bound(k: int) -> torch.Tensor:
    """x [k, 40]: column 0 the largest value of bin 7 (field 127), positive, with an odd multiple
    of the bin's unit every 64th row, so a flush of SEG rows sums to just below the 2**52-unit
    bound; column 1 the same in bin 15 (field 254, −fp32 max); column 2 the smallest subnormal."""
    x = _every_bin(k, cols=40, seed=2)
    odd = (torch.arange(k) % 64) == 63
    for c, field, sign in ((0, 127, 1.0), (1, 254, -1.0)):
        top = sign * (2.0 - 2.0**-23) * 2.0 ** (field - 127)
        low = sign * (1.0 + 2.0**-23) * 2.0 ** (field - 15 - 127)   # field 16j, odd significand
        x[:, c] = torch.where(odd, torch.tensor(low), torch.tensor(top)).float()
    x[:, 2] = 2.0**-149
    return x


@check
def more_rows_than_a_bin_flush():
    """k = 2·SEG + 37 rows: three flushes of the real segment (~1 min under the interpreter)."""
    _same_as_torch(_near_the_flush_bound(2 * tfx.SEG + 37))


@check
def more_rows_than_a_short_bin_flush():
    """The same flush logic with 64-row segments: k = 2·64 + 37 (two full flushes and a tail)."""
    _same_as_torch(_near_the_flush_bound(2 * 64 + 37), seg=64)


@check
def non_contiguous_values():
    base = _every_bin(48, cols=90, seed=3)
    _same_as_torch(base.t().contiguous().t())               # strides (1, 48)
    _same_as_torch(base[::3, ::2])                          # strides (270, 2)


@check
def accumulator_that_already_holds_values():
    g = torch.Generator().manual_seed(4)
    prior = -torch.exp2(torch.randint(-149, 120, (5, 80), generator=g).float())
    acc0 = fx.accumulate_(fx.zeros((80,)), prior)           # negative sums: top digit < 0
    assert (acc0[:, fx.N_DIGITS - 1] < 0).all()
    x = _every_bin(24, cols=80, seed=5)
    _same_as_torch(x, acc0)
    _same_as_torch(x, acc0 + acc0 + fx.accumulate_(fx.zeros((80,)), x))   # un-normalised digits


@check
def many_calls_in_sequence():
    acc_t, acc_k = fx.zeros((70,)), fx.zeros((70,))
    parts = [_every_bin(n, cols=70, seed=10 + n) for n in (1, 9, 33, 2, 17)]
    for p in parts:
        fx.accumulate_(acc_t, p)
        tfx.accumulate_(acc_k, p)
        assert torch.equal(acc_k, acc_t)
    assert torch.equal(acc_k, tfx.accumulate_(fx.zeros((70,)), torch.cat(parts)))


@check
def launch_shape_changes_no_bit():
    x = _every_bin(20, cols=100, seed=6)
    want = tfx.accumulate_(fx.zeros((100,)), x)
    for launch in ({"block": 32}, {"block": 256}, {"seg": 8}):
        assert torch.equal(tfx.accumulate_(fx.zeros((100,)), x, **launch), want), launch


@check
def order_changes_no_bit_but_changes_fp32_sums():
    x = _every_bin(40, cols=120, seed=7)[:, 20:]             # finite, well inside fp32
    rev = tfx.accumulate_(fx.zeros((100,)), x.flip(0))
    assert torch.equal(rev, _same_as_torch(x))
    assert not torch.equal(x.sum(0).view(torch.int32), x.flip(0).sum(0).view(torch.int32))


@check
def bad_arguments_are_refused():
    for acc, x in ((fx.zeros((3,)), torch.ones(2, 4)), (fx.zeros((3,)), torch.ones(2, 3).double()),
                   (torch.zeros(3, fx.N_COLS), torch.ones(2, 3)),
                   (fx.zeros((6,))[::2], torch.ones(2, 3))):
        try:
            tfx.accumulate_(acc, x)
        except ValueError:
            continue
        raise AssertionError(f"accepted {acc.dtype} {tuple(acc.shape)} / {x.dtype} {tuple(x.shape)}")


# ------------------------------------------------------------------- rounding (round_fp32)
@functools.cache
def _round_cases() -> dict[str, torch.Tensor]:
    return rc.cases()


def _round_same_as_torch(acc: torch.Tensor, **launch) -> torch.Tensor:
    """Kernel round of acc [m, N_COLS] == fixedpoint.round_fp32_torch(acc), bytewise (int32
    views: −0.0 and NaN payloads count), and acc is left as it was; returns the kernel's fp32."""
    before = acc.clone()
    want = fx.round_fp32_torch(acc)
    got = tfx.round_fp32(acc, **launch)
    assert torch.equal(acc, before), "the kernel modified its input"
    bad = torch.nonzero(got.view(torch.int32) != want.view(torch.int32)).flatten()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (
        f"{bad.numel()} rows differ, e.g. {bad[:4].tolist()}: kernel {got[bad[:4]].tolist()} "
        f"torch {want[bad[:4]].tolist()}")
    return got


def _case_checks(prefix: str, names, cases, same) -> None:
    """Register one check per case name: `same(cases()[name])`, named prefix + name."""
    for name in names:
        def fn(name=name):
            same(cases()[name])
        fn.__name__ = prefix + name
        check(fn)


_case_checks("round_", rc.CASES, _round_cases, _round_same_as_torch)


@check
def round_launch_shapes_strides_and_shapes():
    """BLOCK 32/256 with 1/8 warps, a column-major copy (strides (1, m)), every other row of a
    slice (strides (26, 1)) and a single row give the torch path's bytes."""
    acc = _round_cases()["sums_of_accumulators"]
    for block, warps in ((32, 1), (256, 8)):
        _round_same_as_torch(acc, block=block, num_warps=warps)
    _round_same_as_torch(acc.t().contiguous().t())
    _round_same_as_torch(acc[1::2])
    _round_same_as_torch(acc[5:6])
    assert tfx.round_fp32(acc[:0]).shape == (0,)


@triton.jit
def _pair_sums(A, B, S, E, S2, E2, n, SORTED_ONLY_UNSORTED: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    a = tl.load(A + i, mask=ok)
    b = tl.load(B + i, mask=ok)
    s, e = tfx.two_sum(a, b)
    if SORTED_ONLY_UNSORTED:    # Fast2Sum without the ordering: the negative control
        s2 = a + b
        e2 = b - (s2 - a)
    else:
        s2, e2 = tfx.two_sum_sorted(a, b)
    tl.store(S + i, s, mask=ok)
    tl.store(E + i, e, mask=ok)
    tl.store(S2 + i, s2, mask=ok)
    tl.store(E2 + i, e2, mask=ok)


def _sum_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """float64 pairs (a, b) that stress an error-free sum: signed zeros, subnormals, equal
    magnitudes of opposite sign, ties (1 + 2**-53), spreads past 2**53 either way round, and
    random values over a wide exponent range (both orders of every pair)."""
    tiny, big = 2.0**-1074, 2.0**1000
    a = [0.0, -0.0, 0.0, -0.0, tiny, -tiny, 1.0, 1.0, 2.0**-53, 1.0, 3.0, -3.0, big, 1e-300,
         1.0 + 2.0**-52, 2.0**-60, 5e-324 * 3, 1.5]
    b = [0.0, 0.0, -0.0, -0.0, tiny, 3 * tiny, 2.0**-53, -1.0, 1.0, 2.0**-80, -3.0, 3.0, 1.0,
         1e300, -(2.0**-53), 1.0, -tiny, -1.5 * (1 - 2.0**-52)]
    g = torch.Generator().manual_seed(5)
    r = torch.randn(2, 4000, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-70, 70, (2, 4000), generator=g).double())
    x = torch.cat([torch.tensor([a, b], dtype=torch.float64), r], 1)
    return torch.cat([x[0], x[1]]), torch.cat([x[1], x[0]])


def _pair_results(unsorted: bool = False):
    a, b = _sum_pairs()
    out = [torch.empty_like(a) for _ in range(4)]
    _pair_sums[(triton.cdiv(a.numel(), 256),)](a, b, *out, a.numel(),
                                                SORTED_ONLY_UNSORTED=unsorted, BLOCK=256)
    return [t.view(torch.int64) for t in out]


@check
def two_sum_sorted_gives_two_sums_words():
    """tfx.two_sum_sorted (Fast2Sum on operands ordered by magnitude, what add_word uses) ==
    tfx.two_sum (Knuth's TwoSum), bitwise in the sum and in every nonzero error, on every
    pair; and s + e is the exact sum (Fraction)."""
    s, e, s2, e2 = _pair_results()
    assert torch.equal(s, s2), f"sums differ at {torch.nonzero(s != s2).flatten()[:8]}"
    # A zero error may carry the other sign (0 + -0: TwoSum gives +0, Fast2Sum -0); add_word
    # only asks e != 0, so its words are the same. Every nonzero error is the same bits.
    zero = (e.view(torch.float64) == 0) & (e2.view(torch.float64) == 0)
    diff = (e != e2) & ~zero
    assert not diff.any(), f"errors differ at {torch.nonzero(diff).flatten()[:8]}"
    assert zero.sum() > 10 and (e != e2).any()     # the signed-zero cases are in the data
    a, b = _sum_pairs()
    for i in range(0, a.numel(), 97):
        sv, ev = s2[i:i + 1].view(torch.float64).item(), e2[i:i + 1].view(torch.float64).item()
        assert fractions.Fraction(sv) + fractions.Fraction(ev) == \
            fractions.Fraction(a[i].item()) + fractions.Fraction(b[i].item()), i


@check
def two_sum_sorted_negative_control_unordered_fast2sum_differs():
    """Fast2Sum without the ordering loses the error where |a| < |b| (e.g. 2**-53 + 1): the
    check above can fail."""
    s, e, s2, e2 = _pair_results(unsorted=True)
    assert torch.equal(s, s2) and not torch.equal(e, e2)


@triton.jit
def _exact_flags(A, B, S, F, n, ONE_SIDED: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    a = tl.load(A + i, mask=ok)
    b = tl.load(B + i, mask=ok)
    if ONE_SIDED:       # the negative control: only s - hi == p
        s = a + b
        f = ((s - a) != b).to(tl.int32) * 2
    else:               # the flag is the NaN the inexact add leaves in the sum
        s = tfx.add_exact_or_nan(a, b)
        f = (s != s).to(tl.int32) * 2
    tl.store(S + i, s, mask=ok)
    tl.store(F + i, f, mask=ok)


def _exact_results(one_sided: bool = False):
    a, b = _sum_pairs()
    a = torch.cat([a, torch.tensor([1.0 + 2.0**-52, 1.0, 1.0, math.inf, 2.0**149], dtype=torch.float64)])
    b = torch.cat([b, torch.tensor([2.0**53, math.nan, math.inf, -math.inf, 2.0**149], dtype=torch.float64)])
    s, f = torch.empty_like(a), torch.empty(a.numel(), dtype=torch.int32)
    _exact_flags[(triton.cdiv(a.numel(), 256),)](a, b, s, f, a.numel(), ONE_SIDED=one_sided,
                                                 BLOCK=256)
    return a, b, s, f


@check
def add_exact_flags_exactly_the_inexact_adds():
    """tfx.add_exact_or_nan: the sum is a + b rounded (bitwise) where that is exact and NaN
    exactly where a + b is not exact (Fraction), on the stress pairs both ways round, plus
    1 + 2**-52 with 2**53 (one difference alone passes it), NaN and infinite operands (always
    flagged) and 2**149 + 2**149 (exact)."""
    a, b, s, f = _exact_results()
    kept = f == 0
    assert torch.equal(s[kept].view(torch.int64), (a + b)[kept].view(torch.int64))
    for i in range(a.numel()):
        x, y = a[i].item(), b[i].item()
        if math.isfinite(x) and math.isfinite(y) and math.isfinite(x + y):
            exact = fractions.Fraction(x) + fractions.Fraction(y) == fractions.Fraction(x + y)
        else:
            exact = False
        assert int(f[i]) == (0 if exact else 2), (i, x, y, int(f[i]))
    assert int((f == 2).sum()) > 100 and int((f == 0).sum()) > 100


@check
def add_exact_negative_control_one_difference_misses_an_inexact_add():
    """With only s − hi == p checked, 1 + 2**-52 plus 2**53 (inexact: the sum rounds to
    2**53 + 2) passes: the second comparison is what catches it."""
    a, b, s, f = _exact_results(one_sided=True)
    i = a.numel() - 5
    assert (a[i].item(), b[i].item()) == (1.0 + 2.0**-52, 2.0**53)
    assert int(f[i]) == 0
    assert fractions.Fraction(a[i].item()) + fractions.Fraction(b[i].item()) != \
        fractions.Fraction(s[i].item())


@triton.jit
def _one_sum(a, b):
    """A broken TwoSum: the rounded sum with error 0 (what a plain float64 sum would keep)."""
    return a + b, (a + b) * 0.0


def _needs_lo(k: int = 24, cols: int = 300, seed: int = 11) -> torch.Tensor:
    """x [k, cols] fp32 that the double-word path holds: column j has values 1, 2**-24, 2**-80
    (exact sum rounds up to 1 + 2**-23, a float64 sum loses the 2**-80) times 2**(j % 40 - 20),
    the other rows randn·2**-30 scaled alike (a span well under the double word's ~2**100)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2((torch.arange(cols) % 40 - 20).double())
    x = torch.randn(k, cols, generator=g, dtype=torch.float64) * 2.0**-30
    x[:3] = torch.tensor([1.0, 2.0**-24, 2.0**-80], dtype=torch.float64)[:, None]
    return (x * scale).float()


@check
def fast_path_holds_what_a_float64_sum_loses():
    """Columns that need the lo word: kernel == torch (and == the bins-only kernel); rounded,
    column 0 is 1 + 2**-23 exactly."""
    x = _needs_lo()
    x[3:, 20] = 0.0                                          # column 20: 1 + 2**-24 + 2**-80
    acc = _same_as_torch(x)
    assert torch.equal(acc, tfx.accumulate_(fx.zeros((x.shape[1],)), x, fast=False))
    assert fx.round_fp32(acc)[20].item() == 1.0 + 2.0**-23     # column 20: scale 2**0


@check
def fast_path_negative_control_a_plain_float64_sum_differs():
    """The check can fail, and the fast path is really taken: with TwoSum replaced by a plain
    float64 add (error dropped), the same data gives other accumulator bytes; bins-only
    (fast=False) is unaffected by the swap."""
    x = _needs_lo()
    want = fx.accumulate_(fx.zeros((x.shape[1],)), x)
    real = tfx.two_sum
    try:
        tfx.two_sum = _one_sum
        got = tfx.accumulate_(fx.zeros((x.shape[1],)), x)
        assert not torch.equal(got, want), "a plain float64 sum gave the same bytes"
        assert torch.equal(tfx.accumulate_(fx.zeros((x.shape[1],)), x, fast=False), want)
    finally:
        tfx.two_sum = real
    _same_as_torch(x)                                        # restored


@check
def fast_path_programs_mixed_with_the_bin_path():
    """One block of 128 columns has a column only the bins hold (2**100, 1.5·2**46, 2**-100),
    another a NaN; the other blocks take the fast path; all == torch, onto a non-zero
    accumulator, also at BLOCK 32."""
    x = _needs_lo(cols=520)
    x[:3, 5] = torch.tensor([2.0**100, 1.5 * 2.0**46, 2.0**-100])
    x[7, 300] = float("nan")
    acc0 = _same_as_torch(_needs_lo(cols=520, seed=12))
    _same_as_torch(x, acc0)
    _same_as_torch(x, acc0, block=32, num_warps=1)


@check
def fast_path_large_magnitudes_and_cancellation():
    """Sums near the fp32 maximum (hi up to ~2**133), exact cancellation to 0 and to a single
    subnormal: == torch."""
    big = torch.full((40, 6), 3.0e38)
    big[:, 1] = -3.0e38
    big[::2, 2] *= -1                                           # cancels to exactly 0
    big[:, 3] = torch.tensor([3.0e38, -3.0e38] * 20)
    big[0, 3] = 1e-45                                           # leaves one subnormal
    big[:, 4] = 1e-45
    big[:, 5] = torch.arange(40).float() * 2.0**100
    _same_as_torch(big)


@triton.jit
def _no_flush(row, live, hi, lo):
    """A spy double-word flush that adds nothing: a program that took the fast path leaves its
    accumulator rows as they were (its bins are skipped), one that took the bins does not."""


@contextlib.contextmanager
def _flush_spied(top_bits: int | None = None):
    """The double-word flush replaced by `_no_flush` (and the fast path's bound TOP_F64_BITS by
    `top_bits`, float64 bits, if given) for the block; restored after."""
    real_top, real_flush = tfx.TOP_F64_BITS, tfx.flush_double_word
    try:
        tfx.flush_double_word = _no_flush
        if top_bits is not None:
            tfx.TOP_F64_BITS = tl.constexpr(top_bits)
        yield
    finally:
        tfx.TOP_F64_BITS, tfx.flush_double_word = real_top, real_flush


def _spied(x: torch.Tensor, top_bits: int | None = None, **launch) -> torch.Tensor:
    """accumulate_(zeros, x) with the double-word flush spied (`_flush_spied`)."""
    with _flush_spied(top_bits):
        return tfx.accumulate_(fx.zeros((x.shape[1],)), x, **launch)


@check
def fast_path_bound_sends_programs_to_the_bins():
    """|hi| >= TOP_F64_BITS sends a program to the bins (add_f64 is exact only below it). Sums
    of 2**150 need 2**22 fp32 maxima, so the bound is lowered to 2**129 and the flush spied
    (`_spied`), BLOCK 32: columns summing to exactly +2**129 and to −2**129 (at the bound; one
    program each) get torch's bytes (bins), columns of ±2**128 (below it) get nothing (the fast
    path was taken, so the spy can tell). Restored: == torch."""
    x = torch.full((4, 96), 2.0**127)
    x[:, 32:64] *= -1
    x[:, 64:] = 2.0**126
    x[:, 65::2] *= -1
    got = _spied(x, (1023 + 129) << 52, block=32, num_warps=1)
    want = fx.accumulate_(fx.zeros((96,)), x)
    assert torch.equal(got[:64], want[:64]), "a sum at the bound took the double-word path"
    assert not got[64:].any(), "control: sums below the bound did not take the fast path"
    _same_as_torch(x, block=32, num_warps=1)


@check
def fast_path_reads_no_dead_lane():
    """Lanes past the last column read nothing: x [4, 20] a view whose rows continue with NaN,
    BLOCK 32 (lanes 20..31 dead); with the flush spied (`_spied`) the program still takes the
    fast path (nothing added), so no NaN was read (an unmasked read would send it to the bins,
    and on a GPU could read past the allocation)."""
    buf = torch.full((4, 40), NAN)
    buf[:, :20] = 1.0
    x = buf[:, :20]
    assert not _spied(x, block=32, num_warps=1).any(), "a dead lane's value reached the path choice"
    _same_as_torch(x, block=32, num_warps=1)


@check
def accumulate_launches_disable_fp_fusion():
    """accumulate_ launches its kernel with enable_fp_fusion=False, fast path or not (each float64
    add then rounds on its own, add.rn.f64, as TwoSum needs; the interpreter ignores the flag,
    so the argument is what can be checked here)."""
    rec = LaunchRecorder(tfx._accumulate_kernel)
    tfx._accumulate_kernel = rec
    try:
        x = _needs_lo(k=8, cols=20)
        for fast in (True, False):
            tfx.accumulate_(fx.zeros((20,)), x, fast=fast)
    finally:
        tfx._accumulate_kernel = rec.kernel
    assert [kw.get("enable_fp_fusion") for _, kw in rec.launches] == [False, False]


@check
def double_words_add_exactly():
    """add_double_words_ (the dW kernel's second pass) adds hi + lo exactly: onto an accumulator
    holding sums of both signs and NaN/±Inf counts, the result == the digits of the exact
    integer (Python ints: acc + hi/2**-149 + lo/2**-149, normalised), counts unchanged; words
    with rows not contiguous to each other (row stride m + 5), at BLOCK 128 and 32, |hi| up to
    the largest float64 below TOP_F64_BITS (so a bound past add_f64's range fails here)."""
    m = 300
    top = struct.unpack("<d", struct.pack("<q", tfx.TOP_F64_BITS.value))[0]
    words = rc.random_words(m, seed=14, top=top)[:, :m]
    x = -_every_bin(6, cols=m, seed=13)
    x[:, ::2] *= -1
    x[0, 7], x[1, 8], x[2, 9] = NAN, INF, -INF
    acc0 = fx.accumulate_(fx.zeros((m,)), x)
    want = acc0.clone()
    for i in range(m):
        n = sum(int(d) << (31 * j) for j, d in enumerate(acc0[i, :fx.N_DIGITS].tolist()))
        n += rc.units(words[0, i].item()) + rc.units(words[1, i].item())
        want[i, :fx.N_DIGITS] = torch.tensor(rc.digits(n))
    for launch in ({}, {"block": 32, "num_warps": 1}):
        got = tfx.add_double_words_(acc0.clone(), words, **launch)
        bad = torch.nonzero((got != want).any(1)).flatten()
        assert bad.numel() == 0, (f"{launch}: elements {bad[:6].tolist()}, words "
                                  f"{words[:, bad[:3]].t().tolist()}")


@check
def round_words_sum_is_the_digit_path_rounding():
    """round_words_sum (several ranks' double words summed and rounded in one pass, digits in
    registers) == round_fp32_torch of the digits P add_double_words_ passes leave (the torch
    path of tokensum._round_words_sum) == round_fp32_torch of the exact integer sum's digits
    (Python ints), for P =
    1, 2, 3 and 5 parts of random words over the whole range (both signs, ±2**-149, ±0.0, the
    largest float64 below the bound), parts that cancel to exact zero (+0.0) and to a sum past
    fp32 (±Inf), a part stride wider than the words (a strided stack), at BLOCK 128 and 32.
    Control: rounding the float64 sum of the parts' hi + lo differs. Bad layouts: ValueError."""
    m = 300
    top = struct.unpack("<d", struct.pack("<q", tfx.TOP_F64_BITS.value))[0]
    for p in (1, 2, 3, 5):
        parts = torch.stack([rc.random_words(m, seed=40 + p * 7 + r, top=top / 8)[:, :m]
                             for r in range(p)])
        parts[:, :, 5] = 0.0
        parts[0, 0, 5], parts[-1, 0, 5] = 2.0**-60, -2.0**-60 if p > 1 else 0.0
        parts[:, :, 6] = 0.0
        parts[0, 0, 6], parts[-1, 1, 6] = 1.0 + 2.0**-24, 2.0**-100   # a tie only in float64
        acc = fx.zeros((m,))
        for w in parts:
            fx.add_double_words_torch_(acc, w)
        want = fx.round_fp32_torch(acc).view(torch.int32)
        exact = [sum(rc.units(parts[r, j, i].item()) for r in range(p) for j in (0, 1))
                 for i in range(m)]
        ints = torch.tensor([rc.digits(n) + [0, 0, 0] for n in exact], dtype=torch.int64)
        assert torch.equal(fx.round_fp32_torch(ints).view(torch.int32), want)
        for launch in ({}, {"block": 32, "num_warps": 1}):
            got = tfx.round_words_sum(parts, **launch).view(torch.int32)
            bad = torch.nonzero(got != want).flatten()
            assert bad.numel() == 0, (p, launch, bad[:6].tolist())
        wide = torch.zeros(p, 2, m + 7, dtype=torch.float64)
        wide[:, :, :m] = parts
        assert torch.equal(tfx.round_words_sum(wide[:, :, :m]).view(torch.int32), want)
        if p > 1:
            plain = (parts[:, 0] + parts[:, 1]).sum(0).float()
            assert plain[6].item() == 1.0 and want[6].item() == torch.tensor(
                1.0 + 2.0**-23).view(torch.int32).item(), "control: a float64 sum rounded alike"
    assert tfx.round_words_sum(torch.zeros(2, 2, 0, dtype=torch.float64)).shape == (0,)
    for bad in (torch.zeros(2, 3, 4, dtype=torch.float64), torch.zeros(2, 2, 4),
                torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 2, 4).double()[:, :, ::2]):
        try:
            tfx.round_words_sum(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad.dtype} {tuple(bad.shape)} {bad.stride()}")


# ------------------------------------------------------------------- segments (accumulate_segments_)
# Each: the segmented kernel's accumulator == one torch-path accumulate_ per segment onto the
# same rows (and == fixedpoint.accumulate_segments_, the CPU path), torch.equal on all columns.

def _segments_same_as_torch(x: torch.Tensor, offsets: list[int], dest: list[int],
                            acc0: torch.Tensor, **launch) -> torch.Tensor:
    """Segmented kernel(acc0, x) == per-segment torch accumulate_ == CPU accumulate_segments_,
    bytewise (rows of no non-empty segment keep acc0's bytes); returns the kernel's acc."""
    off, dst = torch.tensor(offsets), torch.tensor(dest)
    want = acc0.clone()
    for g, d in enumerate(dest):
        if offsets[g + 1] > offsets[g]:
            fx.accumulate_(want[d], x[offsets[g]:offsets[g + 1]])
    assert torch.equal(fx.accumulate_segments_(acc0.clone(), x, off, dst), want), "CPU path"
    got = tfx.accumulate_segments_(acc0.clone(), x, off, dst, **launch)
    bad = torch.nonzero((got != want).flatten(1).any(1)).flatten()
    assert bad.numel() == 0, f"{launch}: accumulator rows {bad.tolist()} differ"
    return got


def _segment_case() -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    """x [60, 150] wide values (`_every_bin`, a column's span within the double word), 8
    segments onto 12 accumulator rows in scrambled order: empty ones (first, middle, last), one
    row, 3 rows, 37 rows (> UNROLL and no multiple of it), 14 rows; segment 4 (rows 4..40) holds
    2**100, 1.5·2**46 and 2**-100 in column 5 (a span no double word holds: its first block
    must take the bins), segment 5 a NaN, +Inf
    and −Inf in column 140 (its second block). acc0: a sum of two accumulators (digits not
    normalised) in every row, so an untouched row is checked bytewise too."""
    cols = 150
    x = _every_bin(60, cols=cols, seed=21)
    x[10, 5], x[11, 5], x[12, 5] = 2.0**100, 1.5 * 2.0**46, 2.0**-100
    x[41, 140], x[42, 140], x[43, 140] = NAN, INF, -INF
    offsets = [0, 0, 1, 1, 4, 41, 46, 60, 60]
    dest = [3, 7, 0, 11, 5, 2, 9, 6]
    r = 12
    acc0 = fx.accumulate_(fx.zeros((r, cols)), torch.randn(3, r, cols) * 2.0**40)
    acc0 += fx.accumulate_(fx.zeros((r, cols)), -torch.randn(2, r, cols) * 2.0**-40)
    return x, offsets, dest, acc0


@check
def segments_match_the_torch_path():
    """kernel == torch for `_segment_case` at BLOCK 128 (two column blocks, a tail) and 32, an
    8-row flush (the 37-row segment's bins flush five times), bins only (fast=False), and for
    a non-contiguous x (a column-major copy); G = 0 and n = 0 leave acc unchanged."""
    x, offsets, dest, acc0 = _segment_case()
    for launch in ({}, {"block": 32, "num_warps": 1}, {"seg": 8}, {"fast": False}):
        _segments_same_as_torch(x, offsets, dest, acc0, **launch)
    _segments_same_as_torch(x.t().contiguous().t(), offsets, dest, acc0)
    empty = torch.zeros(1, dtype=torch.int64)
    assert torch.equal(tfx.accumulate_segments_(acc0.clone(), x[:0], empty,
                                                empty[:0]), acc0)
    assert torch.equal(tfx.accumulate_segments_(acc0.clone(), x[:0], torch.zeros(3).long(),
                                                torch.tensor([1, 2])), acc0)


@check
def segments_take_the_fast_path_and_the_bins():
    """Both paths of a segment are taken: with the double-word flush spied (`_flush_spied`: a
    program that took the fast path adds nothing), BLOCK 128, the (segment, block) programs that
    hold the 2**100..2**-100 span or the NaN/±Inf get torch's bytes (the bins), every other
    non-empty segment's rows keep acc0 (the fast path was taken); restored: == torch."""
    x, offsets, dest, acc0 = _segment_case()
    with _flush_spied():
        got = tfx.accumulate_segments_(acc0.clone(), x, torch.tensor(offsets),
                                       torch.tensor(dest))
    want = _segments_same_as_torch(x, offsets, dest, acc0)
    binned = {(5, 0), (2, 1)}                       # (dest row, column block) of the bins
    for d in range(acc0.shape[0]):
        for b, cols in enumerate((slice(0, 128), slice(128, 150))):
            ref = want if (d, b) in binned else acc0
            assert torch.equal(got[d, cols], ref[d, cols]), f"row {d} block {b}"
    assert not torch.equal(want[5, :128], acc0[5, :128]), "control: the segment added nothing"


@check
def segments_negative_control_a_plain_float64_sum_differs():
    """The check can fail: with TwoSum replaced by a plain float64 add, segments of columns
    that need the lo word (`_needs_lo`) give other bytes than torch; restored: == torch."""
    x = _needs_lo(k=24, cols=40)
    offsets, dest = [0, 3, 10, 24], [2, 0, 1]
    acc0 = fx.zeros((3, 40))
    real = tfx.two_sum
    try:
        tfx.two_sum = _one_sum
        got = tfx.accumulate_segments_(acc0.clone(), x, torch.tensor(offsets),
                                       torch.tensor(dest))
    finally:
        tfx.two_sum = real
    want = fx.accumulate_segments_(acc0.clone(), x, torch.tensor(offsets), torch.tensor(dest))
    assert not torch.equal(got, want), "a plain float64 sum gave the same bytes"
    _segments_same_as_torch(x, offsets, dest, acc0)


@check
def segments_launch_disables_fp_fusion():
    """accumulate_segments_ launches with enable_fp_fusion=False, fast path or not."""
    x, offsets, dest, acc0 = _needs_lo(k=8, cols=20), [0, 3, 8], [1, 0], fx.zeros((2, 20))
    with LaunchRecorder.swapped_in(tfx, "_segments_kernel") as rec:
        for fast in (True, False):
            tfx.accumulate_segments_(acc0.clone(), x, torch.tensor(offsets), torch.tensor(dest),
                                     fast=fast)
    assert [kw.get("enable_fp_fusion") for _, kw in rec.launches] == [False, False]


@check
def segments_bad_arguments_are_refused():
    """A 2-D or float accumulator, rows of another width, float64 values, int32 offsets or
    dest, offsets of the wrong length, a non-contiguous accumulator, seg 12: ValueError."""
    x, off, dst = torch.zeros(4, 5), torch.tensor([0, 2, 4]), torch.tensor([1, 0])
    acc = fx.zeros((3, 5))
    bad = [(fx.zeros((5,)), x, off, dst, {}), (acc.float(), x, off, dst, {}),
           (fx.zeros((3, 6)), x, off, dst, {}), (acc, x.double(), off, dst, {}),
           (acc, x, off.int(), dst, {}), (acc, x, off, dst.int(), {}),
           (acc, x, off[:2], dst, {}), (fx.zeros((5, 3)).transpose(0, 1), x, off, dst, {}),
           (acc, x, off, dst, {"seg": 12})]
    for i, (a, v, o, d, kw) in enumerate(bad):
        try:
            tfx.accumulate_segments_(a, v, o, d, **kw)
        except ValueError:
            continue
        raise AssertionError(f"case {i} accepted")


# ------------------------------------------------------- rounding double words (round_double_words)
@functools.cache
def _word_cases() -> dict[str, torch.Tensor]:
    return rc.word_cases()


def _words_same_as_digits(words: torch.Tensor, **launch) -> torch.Tensor:
    """round_double_words(words) == round_fp32_torch of the accumulator holding hi + lo (Python
    integers, rc.word_accumulator) == the CPU reference fixedpoint.round_double_words_torch,
    bytewise (int32 views: −0.0 counts); returns the kernel's fp32. (The accumulator is what
    add_double_words_ gives, `double_words_add_exactly`, and round_fp32's kernel rounds it as
    round_fp32_torch does, the round_* checks; `round_words_equal_the_digit_kernels` runs that
    chain of kernels itself on a sample: the interpreter is too slow for all of it.)"""
    want = fx.round_fp32_torch(rc.word_accumulator(words)).view(torch.int32)
    got = tfx.round_double_words(words, **launch)
    bad = torch.nonzero(got.view(torch.int32) != want).flatten()
    assert bad.numel() == 0, (f"{bad.numel()} differ from the digit path, e.g. words "
                              f"{words[:, bad[:3]].t().tolist()}: {got[bad[:3]].tolist()}")
    assert torch.equal(fx.round_double_words_torch(words).view(torch.int32), want)
    return got


_case_checks("round_words_", rc.WORD_CASES, _word_cases, _words_same_as_digits)


@check
def round_words_equal_the_digit_kernels():
    """round_double_words == round_fp32(add_double_words_(zeros, words)), both digit-path
    kernels run, on every 8th element of each double-word case."""
    words = torch.cat([w[:, ::8] for w in _word_cases().values()], 1)
    acc = tfx.add_double_words_(fx.zeros((words.shape[1],)), words)
    want = tfx.round_fp32(acc).view(torch.int32)
    assert torch.equal(_words_same_as_digits(words).view(torch.int32), want)


@check
def round_words_launch_shapes_and_strides():
    """BLOCK 32/128 with 1/4 warps, a row stride that is not m (words[:, :m] of [2, m + 5]),
    one element and none, and `out` (a slice of a larger buffer) give the digit path's bytes;
    a bad `out` is refused."""
    words = _word_cases()["two_sum_accumulations"]
    for block, warps in ((32, 1), (128, 4)):
        _words_same_as_digits(words, block=block, num_warps=warps)
    wide = torch.zeros(2, words.shape[1] + 5, dtype=torch.float64)
    wide[:, :words.shape[1]] = words
    _words_same_as_digits(wide[:, :words.shape[1]])
    _words_same_as_digits(words[:, 7:8])
    assert tfx.round_double_words(words[:, :0]).shape == (0,)
    # Into a given fp32 [m] (a slice of a larger buffer): the same bytes, that tensor returned,
    # nothing around it written; an out of another shape, dtype or layout: ValueError.
    m = words.shape[1]
    buf = torch.full((m + 2,), -7.0)
    got = tfx.round_double_words(words, out=buf[1:m + 1])
    assert got.data_ptr() == buf[1:].data_ptr()
    assert torch.equal(got.view(torch.int32), _words_same_as_digits(words).view(torch.int32))
    assert buf[0].item() == -7.0 and buf[-1].item() == -7.0
    for bad in (torch.empty(m + 1), torch.empty(m, dtype=torch.float64),
                torch.empty(2 * m)[::2]):
        try:
            tfx.round_double_words(words, out=bad)
        except ValueError as e:
            assert "out must be" in str(e)
        else:
            raise AssertionError(f"out {bad.dtype} {tuple(bad.shape)} was accepted")


@check
def round_words_negative_control_without_the_error_word():
    """The check can fail: with TwoSum's error dropped (`_one_sum`: no round-to-odd step, i.e.
    the plain cast of RN64(hi + lo)) the kernel gives other bytes on the ties case, as does
    the plain cast (hi + lo).to(float32); restored, it matches again."""
    words = _word_cases()["ties"]
    want = fx.round_double_words_torch(words).view(torch.int32)
    assert not torch.equal((words[0] + words[1]).float().view(torch.int32), want)
    real = tfx.two_sum
    try:
        tfx.two_sum = _one_sum
        got = tfx.round_double_words(words).view(torch.int32)
        assert not torch.equal(got, want), "the kernel without the error word gave the same bytes"
    finally:
        tfx.two_sum = real
    _words_same_as_digits(words)                             # restored


@check
def round_words_launches_disable_fp_fusion():
    """round_double_words launches with enable_fp_fusion=False (TwoSum's adds round on their own;
    the interpreter ignores the flag, so the argument is what can be checked here)."""
    with LaunchRecorder.swapped_in(tfx, "_round_words_kernel") as rec:
        tfx.round_double_words(_word_cases()["zeros"])
    assert [kw.get("enable_fp_fusion") for _, kw in rec.launches] == [False]


@check
def round_words_bad_arguments_are_refused():
    """float32 words, [3, m], [2, m] with strided rows, 1-D: ValueError."""
    w = _word_cases()["zeros"]
    for bad in (w.float(), torch.zeros(3, 4, dtype=torch.float64), w[:, ::2], w[0]):
        try:
            tfx.round_double_words(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad.dtype} {tuple(bad.shape)} {bad.stride()}")


@triton.jit
def _round_up_ties_away(q, half, sticky):
    return half


@triton.jit
def _round_up_truncate(q, half, sticky):
    return half * 0


@check
def round_negative_control_other_rounding_modes_differ():
    """The check can fail: the kernel with its round-half-even decision (`_round_up`) replaced
    by ties-away-from-zero, or by truncation, gives other bytes on the ties case, and the same
    int32 comparison reports them."""
    acc = _round_cases()["ties_and_sticky_bits"]
    want = fx.round_fp32_torch(acc).view(torch.int32)
    real = tfx._round_up
    try:
        for mode, fake in (("ties away", _round_up_ties_away), ("truncate", _round_up_truncate)):
            tfx._round_up = fake
            got = tfx.round_fp32(acc).view(torch.int32)
            assert not torch.equal(got, want), f"{mode} rounding gave the same bytes"
    finally:
        tfx._round_up = real
    _round_same_as_torch(acc)                               # restored


@check
def round_bad_arguments_are_refused():
    for acc in (torch.zeros(3, fx.N_COLS), torch.zeros(3, fx.N_COLS - 1, dtype=torch.int64),
                fx.zeros((2, 3))):
        try:
            tfx.round_fp32(acc)
        except ValueError:
            continue
        raise AssertionError(f"accepted {acc.dtype} {tuple(acc.shape)}")


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:], skip=SLOW)
