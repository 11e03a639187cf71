"""GRPO group-normalised advantages (Shao et al., DeepSeekMath, arXiv 2402.03300 §4.1).

A_i = (r_i − mean(group)) / (std(group) + eps), std with Bessel's correction (as TRL's GRPO).
The deviations r_i − mean and the variance are computed exactly (rationals: every float is one)
and rounded once, so a group of equal rewards gets exactly 0 — not the ±1e-13 that rounding the
mean first leaves (fsum([0.1] * 3) / 3 = 0.10000000000000002 ≠ 0.1) — and every rank computes
the same bits from the same rewards in the same order.
Does not: scale by anything but the group statistics (no length or batch normalisation).
Tests: `.venv/bin/python -m pytest -q tests/test_grpo.py`.
"""

from __future__ import annotations

import math
from fractions import Fraction


def _to_float(x: Fraction) -> float:
    """Correctly rounded float of an exact rational; ±inf beyond the float64 range."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def group_advantages(rewards: list[float], group_size: int, eps: float = 1e-4) -> list[float]:
    """Advantages for rewards laid out as consecutive groups of `group_size` samples.

    rewards: finite floats, len a multiple of group_size. Returns one float per reward:
    round(r_i − mean) / (sqrt(round(var)) + eps), where r_i − mean and var (Bessel) are exact
    before their one rounding; a group of one sample, or of equal rewards, gets exactly 0.0.
    A group whose variance or a deviation overflows float64 (|rewards| past ~1e154) is computed
    scaled by a power of two (_scaled): the same formula, as if float64 had no exponent limit,
    so the result is always finite; other groups never take that path (their bits are as before).
    Raises ValueError if len(rewards) is not a multiple of group_size or a reward is not finite.
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not form groups of {group_size}")
    bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise ValueError(f"reward of sample {bad[0]} is {rewards[bad[0]]!r}; rewards must be "
                         "finite")
    out: list[float] = []
    for g in range(0, len(rewards), group_size):
        grp = [Fraction(r) for r in rewards[g:g + group_size]]
        if group_size == 1:
            out.append(0.0)
            continue
        mean = sum(grp, Fraction(0)) / group_size
        dev = [r - mean for r in grp]                       # exact: 0 for equal rewards
        var = sum((d * d for d in dev), Fraction(0)) / (group_size - 1)
        std = math.sqrt(_to_float(var))
        adv = [_to_float(d) / (std + eps) for d in dev]
        if not all(map(math.isfinite, adv)) or math.isinf(std):
            adv = _scaled(dev, var, eps)
        out.extend(adv)
    return out


_SCALED_TOP = 500
"""_scaled brings the largest |deviation| to about 2**_SCALED_TOP: its square summed over a
group (at most 2**1002 · group size) stays within float64, and eps · 2**-k stays normal."""


def _scaled(dev: list[Fraction], var: Fraction, eps: float) -> list[float]:
    """The advantages of a group whose variance or a deviation is beyond float64 (|rewards|
    past about 1e154: var = inf made every advantage 0, or inf / inf = NaN). Deviations,
    variance and eps are scaled by 2**-k, exactly (a power of two), so each of the formula's
    roundings (deviation, variance, sqrt, + eps, /) gives the bits it would give with an
    unbounded float64 exponent: the result is that formula's, in [-(n-1)/sqrt(n), +...]."""
    top = max(abs(d) for d in dev)
    k = max(0, top.numerator.bit_length() - top.denominator.bit_length() - _SCALED_TOP)
    scale = Fraction(1, 2**k)
    std = math.sqrt(_to_float(var * scale * scale))
    return [_to_float(d * scale) / (std + math.ldexp(eps, -k)) for d in dev]
