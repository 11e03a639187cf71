"""Adversarial accumulators for the rounding tests of rlkernel/numerics/fixedpoint.py: int64
[m, N_COLS] CPU tensors whose exact sums sit where rounding to fp32 can go wrong.

Shared by tests/fixedpoint_triton_checks.py (the Triton kernel under the interpreter vs
round_fp32_torch), tests/test_cuda.py (the kernel on a GPU vs round_fp32_torch on the CPU) and
tests/test_fixedpoint.py (round_fp32_torch vs a Fraction oracle on `exact_values`). An integer v
counts units of 2**-149 (fixedpoint's module doc): fp32 max is (2**24 − 1)·2**253 units, the
smallest normal 2**23, a value needs rounding from 2**24 (25 significant bits) up.
Double words (`word_cases`, for fixedpoint.round_double_words): float64 [2, m] pairs (hi, lo)
inside that function's contract (finite multiples of 2**-149, |hi| < 2**150) whose sum sits at
the same hazards, and `word_accumulator`, the accumulator holding hi + lo built from Python
integers (the digit path's input, what add_double_words_ gives onto zeros).
Does not: import triton or touch a GPU (pure torch/Python, seeded: the same cases everywhere).
"""

from __future__ import annotations

import fractions
import math
import random

import torch

from rlkernel.numerics import fixedpoint as fx

D = fx.DIGIT_BITS
MASK = (1 << D) - 1
FP32_MAX = ((1 << 24) - 1) << 253      # in units of 2**-149
TOP_FIELD = 31 * (fx.N_DIGITS - 1)      # bit of the top digit's unit


def digits(v: int) -> list[int]:
    """The normalised digits of integer v (least significant first, top digit signed)."""
    out = []
    for _ in range(fx.N_DIGITS - 1):
        out.append(v & MASK)    # Python's & and >> on negative ints: two's complement, floor
        v >>= D
    return out + [v]


def unnormalise(ds: list[int], rng: random.Random, spread: int = 30) -> list[int]:
    """The same value with random carries moved between neighbouring digits: lower digits leave
    [0, 2**31) (above it and negative), as in a sum or difference of accumulators. A carry is
    below 2**spread, so digits stay below 2**(spread + 32): spread <= 30 keeps them in int64."""
    ds = list(ds)
    for i in range(fx.N_DIGITS - 1):
        k = rng.randint(-(1 << spread), 1 << spread)
        ds[i] += k << D
        ds[i + 1] -= k
    return ds


def rows(values: list[int], rng: random.Random, counts=(0, 0, 0)) -> list[list[int]]:
    """Each value as its normalised row and as an unnormalised one (same sum)."""
    out = []
    for v in values:
        ds = digits(v)
        out.append(ds + list(counts))
        out.append(unnormalise(ds, rng) + list(counts))
    return out


def _tie_values(rng: random.Random) -> list[int]:
    """Exact ties (25 significant bits ending in 1: (2M + 1)·2**p) at every rounding position p,
    M odd and even (ties to even go up and down), M = 2**24 − 1 (the carry to 2**24), each
    alone, just below, and with one sticky bit: just under the tie bit, at the bottom of the
    two-digit window, at the top and bottom of the digits below it, and at random."""
    out = []
    for p in range(254):
        top = (p + 24) // D                                # top digit of the value
        lows = {p - 1, D * (top - 1), D * (top - 1) - 1, 0, rng.randrange(max(p, 1))}
        for m in (rng.randrange(1 << 23, 1 << 24) | 1, rng.randrange(1 << 23, 1 << 24) & ~1,
                  (1 << 24) - 1):
            tie = (2 * m + 1) << p
            sign = -1 if (p + m) % 2 else 1
            out += [sign * tie, sign * (tie - 1)]
            out += [sign * (tie + (1 << j)) for j in sorted(lows) if 0 <= j < p]
    return out


def _edge_values(rng: random.Random) -> list[int]:
    """fp32 range edges: subnormals (exact) and the first rounded values; fp32 max, the tie
    above it (rounds to 2**277: Inf), neighbours; the top digit's unit and far beyond (top
    digits 2**31, 2**32 and multiples of 2**33, where the window top << 31 wraps int64 to a
    negative number or to 0); values straddling digit boundaries."""
    out = [1, 2, 3, 5, (1 << 23) - 1, 1 << 23, (1 << 23) + 1, (1 << 24) - 1, 1 << 24,
           (1 << 24) + 1, (1 << 24) + 2, (1 << 24) + 3, (1 << 25) + 2, (1 << 25) + 6,
           (1 << 25) + 1]
    out += [rng.randrange(1, 1 << 23) for _ in range(20)]
    half_ulp_above_max = ((1 << 25) - 1) << 252
    out += [FP32_MAX, FP32_MAX - 1, FP32_MAX + 1, half_ulp_above_max, half_ulp_above_max - 1,
            half_ulp_above_max + 1, 1 << 277, (1 << 277) - 1, 1 << TOP_FIELD,
            (1 << TOP_FIELD) + 12345, (1 << 300) + 1, ((1 << 31) - 1) << TOP_FIELD,
            1 << (TOP_FIELD + 31), 1 << (TOP_FIELD + 32), (3 << (TOP_FIELD + 32)) + 9,
            1 << (TOP_FIELD + 33), 5 << (TOP_FIELD + 33), 1 << (TOP_FIELD + 40)]
    for b in range(D, D * fx.N_DIGITS, D):                  # around each digit boundary
        for sh in (-25, -24, -13, -1, 0):
            if b + sh >= 0:
                out += [((1 << 24) + 1) << (b + sh), (((1 << 25) - 1) << (b + sh)) + 1,
                        (1 << (b + sh + 24)) - 1]
    return out + [-v for v in out]


def exact_values(seed: int = 0) -> list[int]:
    """Integers (units of 2**-149) at the rounding hazards: ties with and without sticky bits
    at every position, and the fp32 range edges (see the two helpers)."""
    rng = random.Random(seed)
    return _tie_values(rng) + _edge_values(rng)


def _tensor(rows_: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows_, dtype=torch.int64)


def _wide(k: int, m: int, g: torch.Generator) -> torch.Tensor:
    """fp32 [k, m]: randn·2**[−150, 128), so subnormal, huge (some Inf after the product: fine,
    they are counted) and every binade in between."""
    x = torch.randn(k, m, generator=g)
    return x * torch.exp2(torch.randint(-150, 128, (k, m), generator=g).float())


CASES = ("ties_and_sticky_bits", "fp32_range_edges", "random_digits", "sums_of_accumulators",
         "zeros", "nonfinite_counts", "large_with_tail")


def cases(seed: int = 0) -> dict[str, torch.Tensor]:
    """name -> int64 [m, N_COLS] CPU accumulator rows (see the module doc)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = {"ties_and_sticky_bits": _tensor(rows(_tie_values(rng), rng)),
           "fp32_range_edges": _tensor(rows(_edge_values(rng), rng))}

    # Random digits: per row a top digit index and per digit a range — normalised, moderately
    # or far outside [0, 2**31) (unnormalised, negative), or any int64 (carries wrap int64 as
    # in torch: the kernel must wrap alike).
    rand = []
    ranges = [(0, MASK), (-(1 << 40), 1 << 40), (-(1 << 62), 1 << 62), (-(1 << 63), (1 << 63) - 1)]
    for _ in range(1500):
        top = rng.randrange(fx.N_DIGITS)
        lo, hi = ranges[rng.choice((0, 0, 1, 1, 2, 3))]
        ds = [rng.randint(lo, hi) if i <= top else 0 for i in range(fx.N_DIGITS)]
        if rng.random() < 0.3:
            ds[top] = rng.randint(-5, 5)
        rand.append(ds + [0, 0, 0])
    # A top digit of −2**63 (normalised, or after a carry of −1) is its own int64 negation.
    wrap = [digits(0)[:-1] + [-(1 << 63)], [5] + digits(0)[1:-1] + [-(1 << 63)],
            digits(0)[:-2] + [-(1 << 31), -(1 << 63) + 1]]
    out["random_digits"] = _tensor(rand + [w + [0, 0, 0] for w in wrap])

    # Sums and differences of real accumulators (what ranks' all-reduces give): unnormalised
    # digits, negative lower digits, counts from NaN/Inf values; plus a − a (zero, top −1).
    x = _wide(6, 400, g)
    x[0, ::37], x[1, ::41], x[2, ::43] = float("nan"), float("inf"), float("-inf")
    a = [fx.accumulate_(fx.zeros((400,)), x[i:i + 2]) for i in range(0, 6, 2)]
    b = fx.accumulate_(fx.zeros((400,)), -x[1:4])
    out["sums_of_accumulators"] = torch.cat([a[0] + a[1], a[0] + a[1] + a[2] + b, a[2] - a[0],
                                             3 * b - a[1], a[1] + fx.accumulate_(
                                                 fx.zeros((400,)), -x[2:4])])

    # Zeros and would-be negative zeros: the zero row, zero spelt with carries (a digit of
    # k·2**31 and −k above it; top digit −1 and 2**31 below it), a negative sum (top digit < 0)
    # plus the sum of the same values negated, and the smallest values of either sign (±2**-149,
    # not zero).
    v = _wide(3, 50, g).abs() + 1e-30
    neg = fx.accumulate_(fx.zeros((50,)), -v)
    pos = fx.accumulate_(fx.zeros((50,)), v)
    zero_rows = [digits(0) + [0, 0, 0]]
    zero_rows += [unnormalise(digits(0), rng, s) + [0, 0, 0] for s in (0, 1, 20, 30)
                  for _ in range(8)]
    for i in range(fx.N_DIGITS - 1):
        z = digits(0)
        z[i], z[i + 1] = 1 << D, -1
        zero_rows.append(z + [0, 0, 0])
    zero_rows += [digits(v) + [0, 0, 0] for v in (1, -1, 2, -2)]
    assert (neg[:, fx.N_DIGITS - 1] < 0).all()
    out["zeros"] = torch.cat([_tensor(zero_rows), neg + pos, pos + neg + neg + pos])

    # NaN/+Inf/−Inf counts alone and mixed, with zero, finite, negative and out-of-range digits;
    # negative counts (a difference of accumulators) mean none.
    fin = [0, 1, -1, 3 << 100, -(5 << 200), FP32_MAX, 1 << (TOP_FIELD + 31),
           -(1 << (TOP_FIELD + 40))]
    cnt = [(n, p, q) for n in (0, 1, 2, -1) for p in (0, 1, 3, -2) for q in (0, 1, -1)]
    out["nonfinite_counts"] = _tensor([row for c in cnt for row in rows(fin, rng, c)])

    # A large shape whose length is no multiple of any block: real sums of wide values.
    m = 20_011
    big = fx.accumulate_(fx.zeros((m,)), _wide(3, m, g))
    out["large_with_tail"] = big + fx.accumulate_(fx.zeros((m,)), _wide(2, m, g))
    assert tuple(out) == CASES
    return out


# ------------------------------------------------------------------------------ double words
TINY = 2.0**-149
WORD_TOP = 2.0**150          # |hi| bound of the contract (triton_fixedpoint.TOP_F64_BITS)
_T = float(((1 << 25) - 1) << 103)   # 2**128·(1 − 2**-25): fp32's overflow threshold (a tie)
_MAX = float(((1 << 24) - 1) << 104)  # fp32 max


def units(v: float) -> int:
    """v, a float64 multiple of 2**-149, as its exact integer number of 2**-149 units."""
    f = fractions.Fraction(v) * 2**149
    assert f.denominator == 1, v
    return f.numerator


def word_accumulator(words: torch.Tensor) -> torch.Tensor:
    """int64 [m, N_COLS]: per column of words [2, m] the normalised digits of the exact integer
    hi + lo (units of 2**-149, Python ints), counts 0 — the accumulator the digit path rounds."""
    pairs = words.t().tolist()
    return _tensor([digits(units(hi) + units(lo)) + [0, 0, 0] for hi, lo in pairs])


def random_words(m: int, seed: int, top: float = WORD_TOP) -> torch.Tensor:
    """[2, m + 5] float64 whose first m columns are (hi, lo) pairs of multiples of 2**-149 with
    |hi| < top: the largest float64 below the bound with lo 0 and ±2**-149, both signs;
    ±2**-149; ±0.0; 1 and 2**-80; then random hi = ±s·2**e, s a 53-bit significand, e uniform
    over the whole range, and lo 0 or ±s'·2**e', e' <= e (the 5 extra columns are zeros: a row
    stride that is not m)."""
    top = math.nextafter(top, 0.0)
    fixed = [(top, 0.0), (-top, 0.0), (top, -TINY), (-top, TINY), (top, TINY), (-top, -TINY),
             (TINY, 0.0), (-TINY, -TINY), (0.0, 0.0), (-0.0, -0.0), (1.0, 2.0**-80),
             (-1.0, 2.0**-80)]
    g = torch.Generator().manual_seed(seed)
    n = m - len(fixed)
    top_e = math.frexp(top)[1] - 53                       # s·2**top_e < 2**frexp(top)[1]
    sig = torch.randint(2**52, 2**53, (2, n), generator=g, dtype=torch.int64).double()
    e_hi = torch.randint(-149, top_e + 1, (n,), generator=g)
    e_lo = -149 + ((e_hi + 150) * torch.rand(n, generator=g)).long()
    sign = torch.randint(0, 2, (2, n), generator=g).double() * 2 - 1
    hi = sign[0] * torch.ldexp(sig[0], e_hi.double())
    lo = sign[1] * torch.ldexp(sig[1], e_lo.double()) * (torch.rand(n, generator=g) < 0.8)
    words = torch.zeros(2, m + 5, dtype=torch.float64)
    words[:, :len(fixed)] = torch.tensor(fixed, dtype=torch.float64).t()
    words[0, len(fixed):m], words[1, len(fixed):m] = hi, lo
    return words


def two_sum_words(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the dW kernel keeps per element: fp32 x [k, m] added in order into a float64 double
    word with TwoSum (lo += each error, that addition's own error checked zero) ->
    (words [2, m], ok [m]: every check held and |hi| < 2**150, so hi + lo is the exact sum),
    on x's device."""
    hi = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
    lo = torch.zeros_like(hi)
    ok = torch.ones(x.shape[1], dtype=torch.bool, device=x.device)
    for row in x.double():
        hi, err = fx.two_sum(hi, row)
        lo, err2 = fx.two_sum(lo, err)
        ok &= err2 == 0
    return torch.stack([hi, lo]), ok & (hi.abs() < WORD_TOP)


def _tie_words(rng: random.Random) -> list[tuple[float, float]]:
    """fp32 ties at every binade 2**E that has them (E >= -125: below, a midpoint is no
    multiple of 2**-149), M odd, even and 2**24 − 1 (the carry): hi = the midpoint with lo 0,
    ±2**-149 and ±a tiny multiple u; hi = midpoint ∓ d (d far above u, exact in float64)
    with lo = ±d ± u, so s = RN64(hi + lo) is the midpoint and only e decides; and hi = the
    midpoint's float64 neighbour (an odd s) with lo back toward it by u or by half a float64
    unit (a float64 tie: s rounds to the even midpoint, e keeps the side), so a rounding that
    moved an odd s too would land on the midpoint."""
    out = []
    for e in range(-125, 128):
        ulp = 2.0 ** (e - 23)
        u = 2.0 ** max(e - 92, -149)
        d = 2.0 ** max(e - 40, -140)
        q = 2.0 ** (e - 52)                               # float64 unit at the midpoint
        for m in (rng.randrange(1 << 23, 1 << 24) | 1, rng.randrange(1 << 23, 1 << 24) & ~1,
                  (1 << 24) - 1):
            mid = (m + 0.5) * ulp
            out += [(mid, lo) for lo in (0.0, TINY, -TINY, u, -u)]
            out += [(mid - d, d + t) for t in (0.0, u, -u)]
            out += [(mid + d, -d + t) for t in (0.0, u, -u)]
            if e - 53 >= -149:                            # q / 2 a multiple of 2**-149
                out += [(mid + q, -u), (mid - q, u), (mid + q, -q / 2), (mid - q, q / 2)]
    return out


def _power_of_two_words() -> list[tuple[float, float]]:
    """hi = 2**E with lo of the other sign: the tie below 2**E (2**E − 2**(E−25): to 2**E, whose
    significand is even), a unit u either side of it, −2**-149, the predecessor itself; and the
    tie above (2**E + 2**(E−24): to 2**E) with u either side."""
    out = []
    for e in range(-124, 128):
        p, half_below, half_above = 2.0**e, 2.0 ** (e - 25), 2.0 ** (e - 24)
        u = 2.0 ** max(e - 77, -149)
        out += [(p, -half_below), (p, -half_below - u), (p, -half_below + u), (p, -TINY),
                (p, -2 * half_below), (p, half_above), (p, half_above + u), (p, half_above - u)]
    return out


def _small_words(rng: random.Random) -> list[tuple[float, float]]:
    """Results in fp32's subnormal range and at 2**-149 (exact there: every multiple of 2**-149
    below 2**-125 is an fp32), up to the smallest normal, and a tiny lo under large hi."""
    out = [(TINY, 0.0), (0.0, TINY), (TINY, TINY), (3 * TINY, -TINY), (2 * TINY, -TINY),
           (2.0**-126 - TINY, TINY), (2.0**-126, -TINY), (2.0**-126, TINY),
           (2.0**-125, -TINY), (2.0**-125 - TINY, 0.0), (2.0**-100, -2.0**-100 + TINY),
           (2.0**60, TINY), (1.0 + 2.0**-24, TINY), (1.0 + 2.0**-24, -TINY)]
    for _ in range(200):
        a, b = rng.randrange(1 << 24), rng.randrange(-(1 << 23), 1 << 23)
        out.append((a * TINY, b * TINY))
    return out


def _range_top_words() -> list[tuple[float, float]]:
    """Around fp32's top: max ± tiny, the overflow tie T = 2**128·(1 − 2**-25) reached directly
    or through lo (to +Inf), just below it (to max), 2**128 minus 2**103 (= T) and a bit more;
    hi up to the contract's bound; sums cancelling from 2**149 down to one unit."""
    big = math.nextafter(WORD_TOP, 0.0)
    return [(_MAX, 0.0), (_MAX, TINY), (_MAX, -TINY), (_MAX, 2.0**103), (_T, 0.0), (_T, -TINY),
            (_T, TINY), (_T - 2.0**80, 2.0**80), (_T - 2.0**80, 2.0**80 - 2.0**28),
            (2.0**128, -2.0**103), (2.0**128, -2.0**103 - 2.0**60), (2.0**128, 0.0),
            (1.5 * 2.0**149, -2.0**149), (big, 0.0), (big, -big), (2.0**149, -2.0**149 + TINY),
            (2.0**140, -2.0**140 + 2.0**20), (big, -2.0**149)]


def _zero_words() -> list[tuple[float, float]]:
    """Exact zeros however spelt: ±0.0 in either word, hi = −lo at several magnitudes."""
    out = [(0.0, 0.0), (-0.0, -0.0), (0.0, -0.0), (-0.0, 0.0)]
    for v in (TINY, 1.0, _MAX, 2.0**149, 3.0 * 2.0**-140):
        out += [(v, -v), (-v, v)]
    return out


def _accumulated_words(seed: int) -> torch.Tensor:
    """Double words as the dW kernel makes them (`two_sum_words`) from 64 fp32 values per column:
    randn at a per-column scale 2**[−120, 100] with per-value jitter 2**[−30, 30], columns whose
    values cancel in pairs (all or but one), and columns of 1, 2**-24 and a small tail (ties
    broken by the tail); only columns whose checks held."""
    g = torch.Generator().manual_seed(seed)
    k, m = 64, 3000
    scale = torch.exp2(torch.randint(-120, 101, (1, m), generator=g).double())
    jitter = torch.exp2(torch.randint(-30, 31, (k, m), generator=g).double())
    x = (torch.randn(k, m, generator=g, dtype=torch.float64) * scale * jitter).float()
    x[k // 2:, :300] = -x[:k // 2, :300]                  # cancel exactly to 0
    x[k // 2:, 300:600] = -x[:k // 2, 300:600]
    x[0, 300:600] = 2.0**-149                              # cancel to a single unit
    x[:, 600:700] = 0.0
    x[0, 600:700], x[1, 600:700] = 1.0, 2.0**-24          # a tie ...
    x[2, 600:700] = torch.randn(100, generator=g) * 2.0**-60   # ... broken by a tail
    words, ok = two_sum_words(x)
    assert ok.float().mean() > 0.9
    return words[:, ok]


WORD_CASES = ("ties", "powers_of_two", "subnormal_and_tiny", "fp32_range_top", "zeros",
              "two_sum_accumulations", "random_words")


def word_cases(seed: int = 0) -> dict[str, torch.Tensor]:
    """name -> float64 [2, m] CPU double words (module doc), each case with its negation."""
    rng = random.Random(seed)

    def both(pairs):
        w = torch.tensor(pairs, dtype=torch.float64).t()
        return torch.cat([w, -w], 1)

    out = {"ties": both(_tie_words(rng)), "powers_of_two": both(_power_of_two_words()),
           "subnormal_and_tiny": both(_small_words(rng)),
           "fp32_range_top": both(_range_top_words()), "zeros": both(_zero_words())}
    acc = _accumulated_words(seed)
    out["two_sum_accumulations"] = torch.cat([acc, -acc], 1)
    out["random_words"] = torch.cat([random_words(1000, seed + 1)[:, :1000],
                                     random_words(1000, seed + 2, top=2.0**129)[:, :1000]], 1)
    for name, w in out.items():   # the contract: finite multiples of 2**-149, |hi| < 2**150
        assert torch.isfinite(w).all() and (w[0].abs() < WORD_TOP).all(), name
        for v in w.flatten().tolist():
            units(v)                                   # asserts a multiple of 2**-149
    assert tuple(out) == WORD_CASES
    return out
