"""GRPO advantages (rlkernel/train/grpo.py): equal rewards give exactly 0, others match a float64
oracle and, bit for bit, the exact formula rounded once (a float std is told apart), and the bits
do not depend on where a group sits in the batch.

Run: `.venv/bin/python -m pytest -q tests/test_grpo.py`.
"""

from __future__ import annotations

import math
import statistics
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rlkernel.train.grpo import group_advantages

finite = st.floats(allow_nan=False, allow_infinity=False)


def test_three_equal_rewards_of_a_tenth_give_exact_zeros():
    """The reported case: [0.1]*3 gave about -1.4e-13 (mean rounded first); now 0.0 exactly."""
    assert group_advantages([0.1, 0.1, 0.1], 3) == [0.0, 0.0, 0.0]


@settings(max_examples=200, deadline=None)
@given(rewards=st.lists(st.tuples(finite, st.integers(1, 16)), min_size=1, max_size=6))
def test_equal_reward_groups_give_exactly_zero(rewards):
    """Any finite r repeated g times (several groups of one size g) -> every advantage is +0.0."""
    g = rewards[0][1]
    flat = [r for r, _ in rewards for _ in range(g)]
    adv = group_advantages(flat, g)
    assert len(adv) == len(flat)
    assert all(a == 0.0 and math.copysign(1.0, a) == 1.0 for a in adv), adv


@settings(max_examples=200, deadline=None)
@given(grp=st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=16),
       other=st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=16))
@example(grp=[349526.125, 349526.0625, 349526.09628022125], other=[0.0, 0.0])
def test_advantages_match_float64_oracle_and_do_not_depend_on_neighbours(grp, other):
    """Within 1e-9 of (r − mean) / (stdev + 1e-4), and a group's bits are the same alone or after
    another group. The oracle's mean is an exact fraction: a float64 mean of rewards near 3.5e5
    that differ by 0.06 is off by up to ulp/2 = 2.9e-11, which r − mean turns into a 1e-9-relative
    error of the oracle itself (hypothesis found [349526.125, 349526.0625, 349526.09628022125])."""
    n = len(grp)
    other = (other * n)[:n]
    alone = group_advantages(grp, n)
    mean, std = sum(map(Fraction, grp)) / n, statistics.stdev(grp)
    for a, r in zip(alone, grp):
        want = float((Fraction(r) - mean) / (Fraction(std) + Fraction(1e-4)))
        assert abs(a - want) <= 1e-9 * (1 + abs(a))
    after = group_advantages(other + grp, n)[n:]
    assert [a.hex() for a in after] == [a.hex() for a in alone]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages([1.0, 0.0], 3)
    with pytest.raises(ValueError, match="sample 1 .*nan.*finite"):
        group_advantages([1.0, math.nan], 2)
    assert group_advantages([5.0, -3.0], 1) == [0.0, 0.0]


def _exact_formula(rewards: list[float], n: int, eps: float = 1e-4) -> list[float]:
    """The documented formula, restated with rationals: (r_i − mean) and the Bessel variance are
    exact and each rounded once to float64; std = sqrt(that float64)."""
    out = []
    for g in range(0, len(rewards), n):
        grp = [Fraction(r) for r in rewards[g:g + n]]
        mean = sum(grp, Fraction(0)) / n
        var = sum(((r - mean) ** 2 for r in grp), Fraction(0)) / (n - 1)
        std = math.sqrt(float(var))
        out.extend(float(r - mean) / (std + 1e-4) for r in grp)
    return out


# Groups of typical rewards where a float std (two-pass, rounded mean) is 1 ulp off the exact one.
ULP_GROUPS = [[0.7, 0.1, 0.3, 0.9, 0.5, 0.2, 0.8, 0.6], [1 / 3, 2 / 3, 1.0, 0.0]]


@settings(max_examples=200, deadline=None)
@given(rewards=st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0, 1 / 3, -0.7, 3.0]),
                        min_size=2, max_size=16))
@example(rewards=ULP_GROUPS[0])
@example(rewards=ULP_GROUPS[1])
def test_advantage_bits_equal_the_exact_deviation_and_variance_rounded_once(rewards):
    """group_advantages(r, n) == the exact formula (rationals, one rounding each), compared as
    float64 hex — no tolerance (ARCHITECTURE.md "Advantages": deviations and variance are exact
    rationals rounded once). A float mean or std (torch.std, statistics.stdev) agrees only within
    a tolerance, so test_advantages_match_float64_oracle_... cannot tell it from the exact one."""
    n = len(rewards)
    got = group_advantages(rewards, n)
    assert [a.hex() for a in got] == [a.hex() for a in _exact_formula(rewards, n)]


def test_negative_control_float_std_gives_other_advantage_bits():
    """Negative control for the test above: the same formula with torch.std's float64 std (the
    usual GRPO code) gives different advantage bits on ULP_GROUPS, so those examples can tell a
    float std from the exact one."""
    import torch

    for grp in ULP_GROUPS:
        n = len(grp)
        mean = sum((Fraction(r) for r in grp), Fraction(0)) / n
        std = float(torch.tensor(grp, dtype=torch.float64).std())
        stock = [float(Fraction(r) - mean) / (std + 1e-4) for r in grp]
        assert [a.hex() for a in stock] != [a.hex() for a in _exact_formula(grp, n)], grp


@pytest.mark.parametrize("grp,want", [
    # var = 2e600 overflowed to inf: both advantages were 0 (the group's signal lost)
    ([1e300, -1e300], [0.7071067811865475, -0.7071067811865475]),
    ([1e155, 0.0], [0.7071067811865476, -0.7071067811865476]),
    # a deviation beyond float64 (2.27e308): inf / inf made the first advantage NaN
    ([1.7e308, -1.7e308, -1.7e308], [1.1547005383792515, -0.5773502691896257,
                                     -0.5773502691896257]),
    ([1.7976931348623157e308] * 3 + [-1.7976931348623157e308], [0.5, 0.5, 0.5, -1.5]),
])
def test_huge_finite_rewards_give_finite_advantages(grp, want):
    """Direct callers may pass any finite rewards (rlk run caps them at 1e100): a group whose
    variance or deviation overflows float64 gets the formula's value, finite, not 0 or NaN."""
    got = group_advantages(grp, len(grp))
    assert all(map(math.isfinite, got)) and got == want, got


@pytest.mark.parametrize("grp", ULP_GROUPS + [[0.7, 0.1, 0.3, 0.9], [1.0, 0.0, 0.0, 0.0, 2.5]])
@pytest.mark.parametrize("k", [520, 900, 1000])   # eps · 2**-k stays a normal float
def test_huge_rewards_give_the_bits_of_the_formula_without_an_exponent_limit(grp, k):
    """Rewards r · 2**k (exact) beyond float64's squares give, bit for bit, the advantages of r
    with eps · 2**-k: the formula's roundings are all scale-free under powers of two, so this is
    what it gives as if float64 had no exponent limit, and a 2**k-scaled group takes the
    overflow path only where the plain one cannot be computed."""
    n = len(grp)
    big = [math.ldexp(r, k) for r in grp]
    want = group_advantages(grp, n, eps=math.ldexp(1e-4, -k))
    assert [a.hex() for a in group_advantages(big, n)] == [a.hex() for a in want]
