"""Exact fixed-point sums (rlkernel/numerics/fixedpoint.py): correct rounding and order freedom.

1. round_fp32(accumulate_(...)) is the exact sum of the values rounded once to fp32
   (round-half-even), checked against Python Fractions for normal, huge, tiny (subnormal), random
   bit patterns and cancelling values.
2. The result is a function of the multiset of values: any order, any grouping into
   accumulators that are then added as integers (what microbatches and DP/CP ranks do) give
   the same bytes. Negative control: fp32 sums of the same groups differ.
3. Zero is +0.0; NaN/±Inf follow IEEE; an fp32-overflowing sum is ±Inf.
4. round_double_words (a float64 pair hi + lo rounded once: TwoSum, round to odd, cast) ==
   round_fp32 of the accumulator holding hi + lo, bitwise, on the double-word cases of
   tests/fixedpoint_round_cases.py (and == the Fraction oracle); the plain cast of hi + lo
   (double rounding) is the negative control.

Run: .venv/bin/python -m pytest -q tests/test_fixedpoint.py
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from rlkernel.numerics import fixedpoint as fx


def _fp32_of(q: Fraction) -> float:
    """The fp32 nearest to an exact rational (ties to even), as a Python float."""
    if q == 0:
        return 0.0
    sign, a = (-1 if q < 0 else 1), abs(q)
    e = math.floor(math.log2(a))
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    ulp = Fraction(2) ** max(e - 23, -149)
    n, r = divmod(a / ulp, 1)
    n = int(n)
    if r > Fraction(1, 2) or (r == Fraction(1, 2) and n % 2):
        n += 1
    v = n * ulp
    return sign * math.inf if v >= Fraction(2) ** 128 else sign * float(v)


def _reference(col: list[float]) -> float:
    if any(math.isnan(v) for v in col) or (math.inf in col and -math.inf in col):
        return math.nan
    if math.inf in col or -math.inf in col:
        return math.inf if math.inf in col else -math.inf
    return _fp32_of(sum((Fraction(v) for v in col), Fraction(0)))


def _same(got: torch.Tensor, want: float) -> bool:
    if math.isnan(want):
        return bool(torch.isnan(got))
    return got.view(torch.int32).item() == torch.tensor(want).view(torch.int32).item()


def _cases():
    g = torch.Generator().manual_seed(0)
    yield "normal", torch.randn(37, 9, generator=g)
    yield "wide", torch.randn(37, 9, generator=g) * torch.exp(torch.randn(37, 9, generator=g) * 30)
    yield "subnormal", torch.randn(37, 9, generator=g) * 1e-42
    yield "huge", torch.randn(5, 9, generator=g) * 3e38
    bits = torch.randint(-2**31, 2**31 - 1, (23, 9), generator=g, dtype=torch.int64)
    yield "bit patterns", bits.to(torch.int32).view(torch.float32).clone()
    x = torch.randn(20, 9, generator=g)
    yield "cancelling", torch.cat([x, -x, torch.full((1, 9), 2.0**-140)])


@pytest.mark.parametrize("name,x", list(_cases()), ids=[c[0] for c in _cases()])
def test_exact_sum_is_the_rational_sum_rounded_once(name, x):
    """exact_sum_fp32(x)[j] == fp32(Σ_i x[i, j] computed in rationals), ties to even, bitwise."""
    got = fx.exact_sum_fp32(x)
    bad = [j for j in range(x.shape[1]) if not _same(got[j], _reference(x[:, j].tolist()))]
    assert not bad, f"{name}: columns {bad} are not the correctly rounded exact sum"


def test_any_order_and_grouping_gives_the_same_bytes():
    """Accumulating a shuffled x in groups of 1, 7, 64 rows into separate accumulators, then
    adding the accumulators (int64 sum, as ranks do), == one accumulator over x, bitwise.
    Negative control: fp32 sums of the same groups differ from the fp32 sum of x."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 50, generator=g) * torch.exp(torch.randn(300, 50, generator=g) * 8)
    want = fx.exact_sum_fp32(x)
    perm = torch.randperm(300, generator=g)
    for size in (1, 7, 64):
        accs = [fx.accumulate_(fx.zeros((50,)), x[perm[i:i + size]]) for i in range(0, 300, size)]
        got = fx.round_fp32(torch.stack(accs).sum(0))
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), size
    naive = torch.stack([x[perm[i:i + 7]].sum(0) for i in range(0, 300, 7)]).sum(0)
    assert not torch.equal(naive.view(torch.int32), x.sum(0).view(torch.int32))


def test_zero_nonfinite_and_overflow():
    """An exact zero sum is +0.0 (also of -0.0 values); NaN if a NaN or both infinities were
    added; ±Inf for one infinity; a finite sum beyond fp32 is ±Inf; shapes are kept."""
    x = torch.tensor([[-0.0, 1.0, math.nan, math.inf, math.inf, 3e38, -3e38],
                      [-0.0, -1.0, 1.0, 1.0, -math.inf, 3e38, -3e38]])
    got = fx.exact_sum_fp32(x)
    assert got[0].view(torch.int32).item() == 0 and got[1].view(torch.int32).item() == 0
    assert torch.isnan(got[2]) and torch.isnan(got[4]) and got[3].item() == math.inf
    assert got[5].item() == math.inf and got[6].item() == -math.inf
    acc = fx.zeros((2, 3))
    assert fx.round_fp32(fx.accumulate_(acc, torch.ones(4, 2, 3))).shape == (2, 3)


def test_random_small_sums_match_the_reference():
    """Random lengths (1..40) and magnitudes: every column is the correctly rounded sum."""
    rnd = random.Random(5)
    g = torch.Generator().manual_seed(5)
    for _ in range(30):
        n = rnd.randint(1, 40)
        x = torch.randn(n, 6, generator=g) * 10.0 ** rnd.randint(-40, 38)
        got = fx.exact_sum_fp32(x)
        for j in range(6):
            assert _same(got[j], _reference(x[:, j].tolist()))


def test_bad_accumulators_are_refused():
    """A non-int64 accumulator or mismatched value shape raises ValueError."""
    with pytest.raises(ValueError):
        fx.accumulate_(torch.zeros(3, fx.N_COLS), torch.ones(2, 3))
    with pytest.raises(ValueError):
        fx.accumulate_(fx.zeros((3,)), torch.ones(2, 4))
    with pytest.raises(ValueError):
        fx.round_fp32(torch.zeros(3, 2, dtype=torch.int64))


def test_nonfinite_counts_depend_only_on_the_multiset():
    """The NaN/+Inf/−Inf columns count values, so one accumulator over x == the integer sum of
    accumulators over single rows, bytewise (digits AND counts), and the digits keep the finite
    values that sit beside an Inf (here 3e38 in the top bin). Rows: 2 x +Inf, +Inf with −Inf,
    NaN, finite."""
    x = torch.tensor([[math.inf, math.inf, math.nan, 3e38],
                      [math.inf, -math.inf, 1.0, 3e38],
                      [3e38, 2.0, math.nan, -1.0]])
    one = fx.accumulate_(fx.zeros((4,)), x)
    rows = fx.normalise_(torch.stack([fx.accumulate_(fx.zeros((4,)), x[i:i + 1])
                                      for i in range(3)]).sum(0))
    assert torch.equal(one, rows)
    assert one[:, fx.N_DIGITS:].tolist() == [[0, 2, 0], [0, 1, 1], [2, 0, 0], [0, 0, 0]]
    finite = fx.accumulate_(fx.zeros((4,)), torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0))
    assert torch.equal(one[:, :fx.N_DIGITS], finite[:, :fx.N_DIGITS])


def test_digits_below_the_rounding_window_break_a_tie():
    """1 + 2**-24 is a tie (rounds to even: 1.0); adding 2**-100, which lands in a digit below
    the two-digit rounding window, makes the exact sum just above the tie, so it must round up
    to 1 + 2**-23 (the low digits are sticky bits). Both signs; == the Fraction oracle, bitwise."""
    for sign in (1.0, -1.0):
        x = sign * torch.tensor([[1.0], [2.0**-24], [2.0**-100]])
        got = fx.exact_sum_fp32(x)
        assert _same(got[0], _reference(x[:, 0].tolist()))
        assert _same(got[0], sign * (1.0 + 2.0**-23))
        assert _same(fx.exact_sum_fp32(x[:2])[0], sign * 1.0)     # the tie alone: to even


def test_a_full_bin_flush_at_the_top_of_a_bin_stays_exact():
    """2**15 − 1 values at the top of float64 bin 7 (fp32 field 127, significand all ones) and
    one odd multiple of the bin's unit (field 112): their exact sum needs 54 bits, so the
    per-bin float64 sums are only exact if each flush holds few enough rows (_BIN_ROWS). The
    result == the Fraction oracle, bitwise, and == the integer sum of the values' one-row
    accumulators."""
    big, tiny = (2.0 - 2.0**-23), (1.0 + 2.0**-23) * 2.0**-15
    x = torch.full(((1 << 15), 1), big)
    x[-1, 0] = tiny
    want = Fraction(big) * ((1 << 15) - 1) + Fraction(tiny)
    got = fx.exact_sum_fp32(x)
    assert _same(got[0], _fp32_of(want))
    acc = fx.accumulate_(fx.zeros((1,)), x)
    ref = fx.normalise_(fx.accumulate_(fx.zeros((1,)), x[:1]) * ((1 << 15) - 1)
                        + fx.accumulate_(fx.zeros((1,)), x[-1:]))
    assert torch.equal(acc, ref)


def test_an_accumulator_beyond_the_top_digit_rounds_to_infinity():
    """A sum of accumulators (more than 2**33 fp32-max values) whose top digit reaches 2**31
    is beyond every fp32: ±Inf, not the digits below it. Also top digits of 2**32 and of
    multiples of 2**33, where the two-digit window (top << 31) would wrap int64 to a negative
    number or to 0 (so an over-range test that only looked from 2**33 or 2**34 up gives −Inf
    or ±0.0 there)."""
    tops = [1 << 31, 1 << 32, (1 << 32) + 7, 1 << 33, 3 << 33, 1 << 40]
    acc = fx.zeros((2 * len(tops),))
    acc[:, fx.N_DIGITS - 1] = torch.tensor([v for t in tops for v in (t, -t)])
    acc[:, 3] = 12345
    got = fx.round_fp32(acc)
    assert got.tolist() == [math.inf, -math.inf] * len(tops)


def test_negative_nonfinite_counts_mean_none():
    """A difference of accumulators can hold negative NaN/+Inf/−Inf counts: only a count > 0
    means that value was added (the rule of the CUDA kernel, tests/fixedpoint_round_cases.py),
    so those rows round their finite digits (here 1.0), or follow the positive count."""
    acc = fx.accumulate_(fx.zeros((5,)), torch.ones(1, 5))
    acc[:, fx.N_DIGITS:] = torch.tensor([[-1, -2, -1], [0, -1, 0], [0, 0, -3], [0, -1, 1],
                                         [-1, 1, 0]])
    assert fx.round_fp32(acc).tolist() == [1.0, 1.0, 1.0, -math.inf, math.inf]


def test_a_top_digit_of_minus_2_63_rounds_to_minus_infinity():
    """The top digit −2**63 with zeros below is its own negation in int64, so the magnitude's top
    digit reads negative: that sum (|sum| = 2**63 top-digit units) is beyond fp32, −Inf (it was
    −0.0). With a non-zero digit below, the magnitude's top digit wraps to 2**63 − 1: −Inf too."""
    acc = fx.zeros((2,))
    acc[:, fx.N_DIGITS - 1] = -2**63
    acc[1, 0] = 5
    assert fx.round_fp32(acc).tolist() == [-math.inf, -math.inf]


def test_round_fp32_torch_at_the_rounding_hazards_is_the_fraction_oracle():
    """round_fp32_torch (the reference of the CUDA rounding kernel) == the Fraction oracle,
    bitwise, for every value of tests/fixedpoint_round_cases.exact_values — ties at every
    rounding position with and without sticky bits (in the window and in the digits below),
    subnormals, fp32 max and the tie above it, values across digit boundaries, both signs —
    each as normalised digits and with carries moved between digits."""
    import fixedpoint_round_cases as rc
    values = rc.exact_values()
    rows = torch.tensor(rc.rows(values, random.Random(3)), dtype=torch.int64)
    got = fx.round_fp32_torch(rows).view(torch.int32).tolist()
    want = [torch.tensor(_fp32_of(Fraction(v, 2**149))).view(torch.int32).item() for v in values]
    assert got[0::2] == want and got[1::2] == want


# ------------------------------------------------------------------ accumulate_segments_

def _per_segment(acc0: torch.Tensor, x: torch.Tensor, offsets: list[int],
                 dest: list[int]) -> torch.Tensor:
    """The definition: one accumulate_ per non-empty segment onto its row of a copy of acc0."""
    want = acc0.clone()
    for g, d in enumerate(dest):
        if offsets[g + 1] > offsets[g]:
            fx.accumulate_(want[d], x[offsets[g]:offsets[g + 1]])
    return want


@pytest.mark.parametrize("elems", [fx._SEGMENT_ELEMS, 24, 1])
def test_segments_equal_one_accumulate_per_segment(monkeypatch, elems):
    """accumulate_segments_(acc0, x, offsets, dest) == an accumulate_ per segment onto acc0's
    rows dest[g], bitwise (torch.equal on the int64 columns): 9 segments of 0..23 rows
    (several empty), dest scrambled, rows [r, 2, 3] (values [n, 2, 3]), wide values with
    NaN/±Inf, acc0 a non-normalised sum of accumulators whose untouched rows keep their bytes;
    also with the rounds cut into chunks of 24 accumulator elements (4 segments) and of one
    segment. A bf16 x equals its exact fp32 conversion."""
    monkeypatch.setattr(fx, "_SEGMENT_ELEMS", elems)
    g = torch.Generator().manual_seed(31)
    lens = [3, 0, 23, 1, 0, 7, 8, 0, 2]
    offsets = [0] + torch.tensor(lens).cumsum(0).tolist()
    dest = [4, 9, 0, 7, 2, 11, 1, 5, 8]
    n, r = offsets[-1], 12
    x = torch.randn(n, 2, 3, generator=g) * torch.exp2(torch.randint(-100, 100, (n, 2, 3),
                                                                     generator=g).float())
    x[5, 0, 1], x[6, 1, 2], x[7, 1, 2] = math.nan, math.inf, -math.inf
    acc0 = fx.accumulate_(fx.zeros((r, 2, 3)), torch.randn(4, r, 2, 3, generator=g))
    acc0 = acc0 + fx.accumulate_(fx.zeros((r, 2, 3)), -torch.randn(3, r, 2, 3, generator=g))
    got = fx.accumulate_segments_(acc0.clone(), x, torch.tensor(offsets), torch.tensor(dest))
    assert torch.equal(got, _per_segment(acc0, x, offsets, dest))
    untouched = [d for d, k in zip(dest, lens) if k == 0] + [3, 6, 10]
    assert torch.equal(got[untouched], acc0[untouched])
    xb = x.bfloat16()
    got = fx.accumulate_segments_(acc0.clone(), xb, torch.tensor(offsets), torch.tensor(dest))
    assert torch.equal(got, _per_segment(acc0, xb.float(), offsets, dest))


def test_segments_negative_control_fp32_segment_sums_differ():
    """The comparison can fail: summing each segment in fp32 first (in row order) and
    accumulating that one value gives other bytes on values whose fp32 sum rounds (1, 2**-24,
    2**-24 in one segment: fp32 1.0, exactly 1 + 2**-23)."""
    x = torch.tensor([[1.0], [2.0**-24], [2.0**-24], [3.0]])
    offsets, dest = [0, 3, 4], [1, 0]
    got = fx.accumulate_segments_(fx.zeros((2, 1)), x, torch.tensor(offsets), torch.tensor(dest))
    fp32 = fx.zeros((2, 1))
    for s, d in enumerate(dest):
        part = torch.zeros(1, 1)
        for row in x[offsets[s]:offsets[s + 1]]:
            part = part + row                              # fp32, in row order
        fx.accumulate_(fp32[d], part)
    assert not torch.equal(got, fp32)
    assert fx.round_fp32(got)[1, 0].item() == 1.0 + 2.0**-23


def test_segments_bad_arguments_are_refused():
    """ValueError for: a 1-D, float or non-contiguous accumulator; values of other rows; int32
    offsets; offsets of the wrong length, not starting at 0, not ending at n, decreasing; dest
    repeated or outside [0, r)."""
    x, acc = torch.ones(4, 3), fx.zeros((5, 3))
    off, dst = torch.tensor([0, 1, 4]), torch.tensor([2, 0])
    bad = [(fx.zeros((3,)), x, off, dst), (acc.float(), x, off, dst),
           (fx.zeros((3, 5)).transpose(0, 1), x, off, dst), (acc, torch.ones(4, 2), off, dst),
           (acc, x, off.int(), dst), (acc, x, off[:2], dst), (acc, x, torch.tensor([1, 1, 4]), dst),
           (acc, x, torch.tensor([0, 1, 3]), dst), (acc, x, torch.tensor([0, 3, 1, 4]),
                                                    torch.tensor([0, 1, 2])),
           (acc, x, off, torch.tensor([2, 2])), (acc, x, off, torch.tensor([5, 0])),
           (acc, x, off, torch.tensor([-1, 0]))]
    for a, v, o, d in bad:
        with pytest.raises(ValueError):
            fx.accumulate_segments_(a, v, o, d)


# --------------------------------------------------------------- round_double_words (CPU)
def _words_cases():
    import fixedpoint_round_cases as rc
    return rc.word_cases()


@pytest.mark.parametrize("case", ["ties", "powers_of_two", "subnormal_and_tiny", "fp32_range_top",
                                  "zeros", "two_sum_accumulations", "random_words"])
def test_round_double_words_is_the_digit_path_rounding(case):
    """round_double_words(words) == round_fp32(accumulator of hi + lo), bitwise (int32 views:
    +0.0 for every exact zero, −0.0 words included), for: fp32 ties at every binade with lo 0,
    ±2**-149, ±u, reached through lo or from hi's float64 neighbour; powers of two with lo of
    the other sign (the tie below, either side of it); subnormal results and 2**-149; fp32 max,
    the overflow tie 2**128·(1 − 2**-25) and around it; zeros; TwoSum accumulations of random
    fp32 values as the dW kernel makes them; random words over the whole range; each negated."""
    import fixedpoint_round_cases as rc
    words = _words_cases()[case]
    want = fx.round_fp32_torch(rc.word_accumulator(words)).view(torch.int32)
    got = fx.round_double_words(words).view(torch.int32)
    bad = torch.nonzero(got != want).flatten()
    assert bad.numel() == 0, f"{bad.numel()} differ, e.g. words {words[:, bad[:3]].t().tolist()}"


def test_round_double_words_at_the_hazards_is_the_fraction_oracle():
    """On the ties, powers-of-two and range-top cases, round_double_words == the Fraction
    oracle's fp32 of hi + lo (so the digit path it is compared with above is not wrong alike)."""
    import fixedpoint_round_cases as rc
    cases = _words_cases()
    words = torch.cat([cases[c] for c in ("ties", "powers_of_two", "fp32_range_top")], 1)
    got = fx.round_double_words(words).view(torch.int32).tolist()
    want = [torch.tensor(_fp32_of(Fraction(rc.units(hi) + rc.units(lo), 2**149)))
            .view(torch.int32).item() for hi, lo in words.t().tolist()]
    assert got == want


def test_round_double_words_negative_control_a_plain_cast_rounds_twice():
    """(hi + lo).to(float32) rounds twice: hi = 1 + 2**-24 (an fp32 tie), lo = 2**-149 sums in
    float64 to the tie, which goes to even (1.0); the exact sum is above it: 1 + 2**-23. On the
    ties case the plain cast differs in thousands of elements, round_double_words in none."""
    words = torch.tensor([[1.0 + 2.0**-24], [2.0**-149]], dtype=torch.float64)
    assert (words[0] + words[1]).float().item() == 1.0
    assert fx.round_double_words(words).item() == 1.0 + 2.0**-23
    import fixedpoint_round_cases as rc
    ties = _words_cases()["ties"]
    want = fx.round_fp32_torch(rc.word_accumulator(ties)).view(torch.int32)
    assert int(((ties[0] + ties[1]).float().view(torch.int32) != want).sum()) > 1000


def test_add_double_words_torch_path_adds_the_exact_integers():
    """fixedpoint.add_double_words_ on the CPU (the torch path: how the rank that rounds a
    slice of several ranks' double words makes their digits) == the digits of the exact integer
    hi + lo (Python ints, fixedpoint_round_cases.word_accumulator): random words over the whole
    range below 2**150 with both signs, ±2**-149, ±0.0 and the largest float64 below the bound;
    every hazard case of round_double_words; onto an accumulator already holding sums of both
    signs and NaN/±Inf counts (counts unchanged, digits the sum); strided words; and the pair
    added twice == 2·(hi + lo). Control: a float64 sum hi + lo first loses the lo of 1 + 2**-80.
    Other dtypes or shapes: ValueError."""
    import fixedpoint_round_cases as rc
    words = torch.cat([rc.random_words(900, seed=s)[:, :900] for s in (1, 2)]
                      + list(_words_cases().values()), 1)
    m = words.shape[1]
    want = rc.word_accumulator(words)
    assert torch.equal(fx.add_double_words_(fx.zeros((m,)), words), want)
    x = torch.randn(7, m) * 2.0**40
    x[0, 3], x[1, 4], x[2, 5] = float("nan"), float("inf"), float("-inf")
    base = fx.accumulate_(fx.zeros((m,)), x)
    got = fx.add_double_words_(base.clone(), words)
    assert torch.equal(got[:, fx.N_DIGITS:], base[:, fx.N_DIGITS:])
    assert torch.equal(fx.normalise_(base[:, :fx.N_DIGITS] + want[:, :fx.N_DIGITS]),
                       got[:, :fx.N_DIGITS])
    wide = torch.zeros(2, m, 3, dtype=torch.float64)
    wide[:, :, 1] = words
    assert torch.equal(fx.add_double_words_(fx.zeros((m,)), wide[:, :, 1]), want)
    twice = fx.add_double_words_(fx.add_double_words_(fx.zeros((m,)), words), words)
    assert torch.equal(fx.normalise_(twice), fx.normalise_(want * 2))
    lost = torch.tensor([[1.0], [2.0**-80]], dtype=torch.float64)
    summed = torch.stack([lost.sum(0), torch.zeros(1, dtype=torch.float64)])
    assert not torch.equal(fx.add_double_words_(fx.zeros((1,)), lost),
                           fx.add_double_words_(fx.zeros((1,)), summed))
    f64 = torch.float64
    for acc, w in ((fx.zeros((3,)), torch.zeros(2, 3)),
                   (fx.zeros((3,)), torch.zeros(2, 4, dtype=f64)),
                   (fx.zeros((3,)), torch.zeros(3, 3, dtype=f64)),
                   (torch.zeros(3, 13), torch.zeros(2, 3, dtype=f64)),
                   (fx.zeros((3, 1)), torch.zeros(2, 3, dtype=f64))):
        with pytest.raises(ValueError, match="add_double_words_"):
            fx.add_double_words_(acc, w)


def test_round_double_words_shapes_strides_and_bad_arguments():
    """[2, *S] -> [*S] for N-d and strided words (the same bytes as the contiguous [2, m]);
    float32 words, a first dimension of 3 or a 0-d tensor: ValueError; `out` of the result's
    shape is written and returned, one of another shape, dtype or layout refused."""
    words = _words_cases()["two_sum_accumulations"][:, :600]
    flat = fx.round_double_words(words).view(torch.int32)
    assert torch.equal(fx.round_double_words(words.reshape(2, 20, 30)).view(torch.int32),
                       flat.reshape(20, 30))
    wide = torch.zeros(2, 600, 3, dtype=torch.float64)
    wide[:, :, 1] = words
    assert torch.equal(fx.round_double_words(wide[:, :, 1]).view(torch.int32), flat)
    for bad in (words.float(), torch.zeros(3, 4, dtype=torch.float64),
                torch.tensor(1.0, dtype=torch.float64)):
        with pytest.raises(ValueError):
            fx.round_double_words(bad)
    into = torch.full((20, 30), -7.0)
    assert fx.round_double_words(words.reshape(2, 20, 30), out=into) is into
    assert torch.equal(into.view(torch.int32), flat.reshape(20, 30))
    for bad in (torch.empty(600), torch.empty(20, 30, dtype=torch.float64),
                torch.empty(30, 20).t()):
        with pytest.raises(ValueError, match="out must be"):
            fx.round_double_words(words.reshape(2, 20, 30), out=bad)
