"""Adversarial accumulators for the rounding tests of rlkernel/numerics/fixedpoint.py: int64
[m, N_COLS] CPU tensors whose exact sums sit where rounding to fp32 can go wrong.

Shared by tests/fixedpoint_triton_checks.py (the Triton kernel under the interpreter vs
round_fp32_torch), tests/test_cuda.py (the kernel on a GPU vs round_fp32_torch on the CPU) and
tests/test_fixedpoint.py (round_fp32_torch vs a Fraction oracle on `exact_values`). An integer v
counts units of 2**-149 (fixedpoint's module doc): fp32 max is (2**24 − 1)·2**253 units, the
smallest normal 2**23, a value needs rounding from 2**24 (25 significant bits) up.
Does not: import triton or touch a GPU (pure torch/Python, seeded: the same cases everywhere).
"""

from __future__ import annotations

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
