"""Tests for rlkernel.numerics.exact: exact, order/split-independent sum of squares and L2 norm.

Oracles: math.fsum over float64 squares (each fp32 square is exact in float64, fsum is correctly
rounded) and, for small cases, fractions.Fraction. Equality is always on float.hex: no tolerance.
"""

from __future__ import annotations

import math
import random
import time
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkernel.numerics import exact as exact_mod
from rlkernel.numerics.exact import (
    ExactSumOfSquares,
    exact_l2_norm,
    exact_sum,
    float_hex,
)

FLT_MAX = float(torch.finfo(torch.float32).max)
FLT_TINY = float(torch.finfo(torch.float32).tiny)  # smallest normal, 2**-126
FLT_SUB_MIN = 2.0**-149  # smallest subnormal
FLT_SUB_MAX = 2.0**-126 - 2.0**-149  # largest subnormal


def oracle_norm(values) -> float:
    return math.sqrt(math.fsum([float(v) ** 2 for v in values]))


def values_of(*tensors: torch.Tensor) -> list[float]:
    out: list[float] = []
    for t in tensors:
        out.extend(t.detach().float().reshape(-1).tolist())
    return out


def acc_of(*tensors: torch.Tensor) -> ExactSumOfSquares:
    acc = ExactSumOfSquares()
    for t in tensors:
        acc.add_(t)
    return acc


def wide_range_fp32(n: int, seed: int) -> torch.Tensor:
    """fp32 values with uniformly random bit patterns over every finite exponent (0..254)."""
    g = torch.Generator().manual_seed(seed)
    exp = torch.randint(0, 255, (n,), generator=g, dtype=torch.int32)
    man = torch.randint(0, 1 << 23, (n,), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int32)
    return ((sign << 31) | (exp << 23) | man).view(torch.float32)


def adversarial_fp32() -> torch.Tensor:
    vals = [
        FLT_MAX, -FLT_MAX, 3.4e38, -3.0e38, 1e-38, -1e-38, 1e-45, -1e-45, FLT_SUB_MIN,
        FLT_SUB_MAX, FLT_TINY, 0.0, -0.0, 1.0, -1.0, 1e-20, 1e20, 3.0, 0.1, 1e-30, 1e30,
        2.0**-27, 2.0**-27, 65504.0, 1.5,
    ]
    return torch.tensor(vals, dtype=torch.float32)


# ------------------------------------------------------------------ agreement with oracles


def test_random_normal_matches_fsum_oracle():
    g = torch.Generator().manual_seed(0)
    shapes = [((64, 33), 0), ((1000,), -3), ((7,), 4)]
    ts = [torch.randn(s, generator=g) * 10.0**e for s, e in shapes]
    got = exact_l2_norm(ts)
    assert float_hex(got) == float_hex(oracle_norm(values_of(*ts)))


def test_adversarial_and_whole_range_match_oracle():
    adv = adversarial_fp32()
    assert float_hex(exact_l2_norm([adv])) == float_hex(oracle_norm(values_of(adv)))
    wide = wide_range_fp32(20_000, seed=1)
    assert bool(torch.isfinite(wide).all())
    assert float_hex(exact_l2_norm([wide])) == float_hex(oracle_norm(values_of(wide)))
    # Only tiny values: the result is tiny but still correctly rounded (no flush to zero).
    tiny = torch.tensor([1e-45, 2e-45, 1e-40, FLT_SUB_MAX, -1e-45], dtype=torch.float32)
    acc = acc_of(tiny)
    assert acc.sum_of_squares() > 0.0
    assert float_hex(acc.sum_of_squares()) == float_hex(math.fsum(v * v for v in values_of(tiny)))
    assert float_hex(acc.norm()) == float_hex(oracle_norm(values_of(tiny)))


def test_sum_of_squares_matches_fsum_and_large_values_do_not_overflow():
    big = torch.full((1000,), FLT_MAX, dtype=torch.float32)
    acc = acc_of(big)
    vals = values_of(big)
    assert float_hex(acc.sum_of_squares()) == float_hex(math.fsum(v * v for v in vals))
    assert math.isfinite(acc.norm())
    assert float_hex(acc.norm()) == float_hex(oracle_norm(vals))


def test_zeros_and_negative_zeros_and_empty():
    assert float_hex(acc_of(torch.tensor([0.0, -0.0, 0.0])).norm()) == float_hex(0.0)
    assert ExactSumOfSquares().norm() == 0.0
    assert exact_l2_norm([]) == 0.0
    acc = acc_of(torch.empty(0), torch.empty(3, 0, dtype=torch.bfloat16))
    assert acc.norm() == 0.0 and acc.nonfinite == {"nan": 0, "posinf": 0, "neginf": 0}


def test_bf16_and_fp16_inputs():
    g = torch.Generator().manual_seed(2)
    b = (torch.randn(5000, generator=g) * 1e3).to(torch.bfloat16)
    wide_b = wide_range_fp32(5000, seed=3).to(torch.bfloat16)  # rounds; huge ones become inf
    wide_b = wide_b[torch.isfinite(wide_b)]
    h = (torch.randn(3000, generator=g) * 100).to(torch.float16)
    h_sub = torch.tensor([6e-8, -6e-8, 1e-5, 65504.0], dtype=torch.float16)
    for t in (b, wide_b, h, h_sub):
        assert float_hex(exact_l2_norm([t])) == float_hex(oracle_norm(values_of(t)))
    mixed = [b, h, adversarial_fp32()]
    assert float_hex(exact_l2_norm(mixed)) == float_hex(oracle_norm(values_of(*mixed)))


def test_fraction_oracle_and_single_rounding_half_even():
    # 1 + 2**-54 + 2**-54 is exactly halfway between 1 and 1 + 2**-52: ties to even gives 1.0.
    # One more 2**-298 (the square of the smallest subnormal) tips it up. A left-to-right float64
    # sum of the squares returns 1.0 in both cases: only a single rounding of the exact total gets
    # the second one right.
    half = torch.tensor([1.0, 2.0**-27, -(2.0**-27)], dtype=torch.float32)
    above = torch.tensor([1.0, 2.0**-27, -(2.0**-27), FLT_SUB_MIN], dtype=torch.float32)
    for t, want in ((half, 1.0), (above, 1.0 + 2.0**-52)):
        exact = sum((Fraction(v) ** 2 for v in values_of(t)), Fraction(0))
        assert float(exact) == want
        got = acc_of(t).sum_of_squares()
        assert float_hex(got) == float_hex(want)
        naive = 0.0
        for v in values_of(t):
            naive += v * v
        assert naive == 1.0
    adv = adversarial_fp32()
    exact = sum((Fraction(v) ** 2 for v in values_of(adv)), Fraction(0))
    assert float_hex(acc_of(adv).sum_of_squares()) == float_hex(float(exact))


fp32_lists = st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=60)


@settings(max_examples=150, deadline=None)
@given(fp32_lists)
def test_hypothesis_matches_oracle(vals):
    t = torch.tensor(vals, dtype=torch.float32)
    assert float_hex(exact_l2_norm([t])) == float_hex(oracle_norm(vals))


@settings(max_examples=100, deadline=None)
@given(fp32_lists, st.randoms(use_true_random=False))
def test_hypothesis_permutation_and_split_give_same_limbs(vals, rnd):
    t = torch.tensor(vals, dtype=torch.float32)
    whole = acc_of(t).to_tensor()
    perm = list(range(len(vals)))
    rnd.shuffle(perm)
    shuffled = t[torch.tensor(perm, dtype=torch.long)] if vals else t
    cuts = sorted(rnd.randint(0, len(vals)) for _ in range(rnd.randint(0, 4)))
    pieces = [shuffled[a:b] for a, b in zip([0] + cuts, cuts + [len(vals)])]
    accs = [acc_of(p) for p in pieces]
    rnd.shuffle(accs)
    merged = ExactSumOfSquares()
    for a in accs:
        merged.merge_(a)
    assert torch.equal(merged.to_tensor(), whole)


# ------------------------------------------------------------------ order / split invariance


def test_same_bits_under_permutation_split_merge_and_transport():
    adv = adversarial_fp32()
    g = torch.Generator().manual_seed(4)
    data = torch.cat([adv, wide_range_fp32(3000, seed=5), torch.randn(3000, generator=g)])
    ref = acc_of(data)
    ref_t, ref_hex = ref.to_tensor(), float_hex(ref.norm())
    assert ref_hex == float_hex(oracle_norm(values_of(data)))
    rng = random.Random(6)
    n = data.numel()
    for trial in range(8):
        perm = torch.randperm(n, generator=g)
        x = data[perm]
        cuts = sorted(rng.sample(range(1, n), rng.randint(1, 40)))
        pieces = [x[a:b] for a, b in zip([0] + cuts, cuts + [n])]
        # one accumulator, pieces added in shuffled order, some as 2-D views
        one = ExactSumOfSquares()
        order = list(range(len(pieces)))
        rng.shuffle(order)
        for i in order:
            p = pieces[i]
            one.add_(p.reshape(1, -1) if i % 2 else p, name=f"p{i}")
        assert torch.equal(one.to_tensor(), ref_t)
        assert float_hex(one.norm()) == ref_hex
        # one accumulator per piece, merged left-to-right vs as a balanced tree
        accs = [acc_of(p) for p in pieces]
        chain = ExactSumOfSquares()
        for a in reversed(accs):
            chain.merge_(a)
        level = accs
        while len(level) > 1:
            nxt = []
            for j in range(0, len(level) - 1, 2):
                level[j].merge_(level[j + 1])
                nxt.append(level[j])
            if len(level) % 2:
                nxt.append(level[-1])
            level = nxt
        assert torch.equal(chain.to_tensor(), ref_t)
        assert torch.equal(level[0].to_tensor(), ref_t)
        # "ranks": elementwise integer sum of to_tensor(), as all_reduce(SUM) would do
        ranks = [acc_of(*pieces[r :: 5]) for r in range(5)]
        summed = torch.stack([r.to_tensor() for r in ranks]).sum(0)
        back = ExactSumOfSquares.from_tensor(summed)
        assert torch.equal(back.to_tensor(), ref_t)
        assert float_hex(back.norm()) == ref_hex
        assert float_hex(back.sum_of_squares()) == float_hex(ref.sum_of_squares())


def test_tiny_chunks_and_early_folds_do_not_change_bits(monkeypatch):
    data = torch.cat([adversarial_fp32(), wide_range_fp32(500, seed=7)])
    ref = acc_of(data).to_tensor()
    monkeypatch.setattr(exact_mod, "_CHUNK", 7)
    monkeypatch.setattr(exact_mod, "_MAX_PENDING", 10)
    assert torch.equal(acc_of(data).to_tensor(), ref)
    assert torch.equal(acc_of(data.flip(0).reshape(5, -1).t()).to_tensor(), ref)


def test_to_tensor_fixed_length_limbs_bounded_and_1024_rank_sum():
    empty = ExactSumOfSquares().to_tensor()
    full = acc_of(torch.full((4096,), -FLT_MAX), torch.tensor([float("nan")])).to_tensor()
    assert empty.shape == full.shape == (exact_mod.TENSOR_LEN,)
    assert empty.dtype == full.dtype == torch.int64
    limbs = full[: exact_mod.TENSOR_LEN - 3]
    assert bool((limbs >= 0).all()) and bool((limbs < 2**32).all())
    # 1024 identical ranks: the elementwise sum stays exact and equals 1024 merges (10 doublings).
    finite = acc_of(torch.full((4096,), -FLT_MAX), wide_range_fp32(100, seed=8))
    summed = finite.to_tensor() * 1024
    assert bool((summed >= 0).all())
    merged = acc_of(torch.full((4096,), -FLT_MAX), wide_range_fp32(100, seed=8))
    for _ in range(10):
        merged.merge_(ExactSumOfSquares.from_tensor(merged.to_tensor()))
    back = ExactSumOfSquares.from_tensor(summed)
    assert torch.equal(back.to_tensor(), merged.to_tensor())
    assert float_hex(back.sum_of_squares()) == float_hex(merged.sum_of_squares())
    vals = values_of(torch.full((4096,), -FLT_MAX), wide_range_fp32(100, seed=8))
    squares = [v * v for v in vals]
    assert float_hex(back.sum_of_squares()) == float_hex(math.fsum(squares * 1024))


# ------------------------------------------------------------------ negative controls


def test_negative_control_naive_sums_depend_on_order():
    data = torch.cat([adversarial_fp32(), wide_range_fp32(20_000, seed=9)])
    data = data[(data.abs() < 1e18) & (data.abs() > 1e-18)]  # keep naive fp32 squares finite
    g = torch.Generator().manual_seed(10)
    perms = [torch.randperm(data.numel(), generator=g) for _ in range(6)]
    naive = {float_hex(float(torch.sum(data[p] * data[p]))) for p in perms}
    assert len(naive) > 1, "naive fp32 sum of squares did not depend on order: control is void"
    # per-piece norms combined in different orders (what a sharded optimizer would naively do)
    pieces = list(data.split(997))
    norms = [float(torch.linalg.vector_norm(p.double())) for p in pieces]
    combos = set()
    rng = random.Random(11)
    for _ in range(6):
        rng.shuffle(norms)
        s = 0.0
        for v in norms:
            s += v * v
        combos.add(float_hex(math.sqrt(s)))
    assert len(combos) > 1, "naive per-piece combination did not depend on order: control is void"
    exact = {float_hex(acc_of(data[p]).norm()) for p in perms}
    exact |= {float_hex(acc_of(*reversed(pieces)).norm())}
    assert len(exact) == 1


# ------------------------------------------------------------------ non-finite values


def test_nonfinite_counted_named_and_nan_or_inf_result():
    nan_neg = torch.tensor([1.0], dtype=torch.float32)
    nan_neg.view(torch.int32)[0] = -1  # 0xFFFFFFFF: a negative NaN with a full payload
    acc = ExactSumOfSquares()
    acc.add_(torch.tensor([1.0, float("nan"), float("inf"), 2.0]), name="w1")
    acc.add_(torch.tensor([3.0, 4.0]), name="ok")
    acc.add_(torch.tensor([float("-inf"), float("-inf")], dtype=torch.bfloat16), name="w2")
    acc.add_(nan_neg)  # unnamed: recorded by add_ index
    acc.add_(torch.tensor([float("inf")], dtype=torch.float16), name="w3")
    assert acc.nonfinite == {"nan": 2, "posinf": 2, "neginf": 2}
    assert acc.nonfinite_names == ["w1", "w2", "#3", "w3"]
    assert math.isnan(acc.sum_of_squares()) and math.isnan(acc.norm())
    # counts travel through to_tensor/from_tensor and merge; names stay local
    back = ExactSumOfSquares.from_tensor(torch.stack([acc.to_tensor(), acc.to_tensor()]).sum(0))
    assert back.nonfinite == {"nan": 4, "posinf": 4, "neginf": 4}
    assert back.nonfinite_names == [] and math.isnan(back.norm())
    clean = acc_of(torch.ones(3))
    clean.merge_(acc)
    assert clean.nonfinite == acc.nonfinite and clean.nonfinite_names == acc.nonfinite_names
    assert math.isnan(clean.norm())
    # IEEE: a NaN wins; without one, an infinite element gives +inf (never "nan")
    assert exact_l2_norm({"a": torch.ones(2), "b": torch.tensor([float("inf")])}) == math.inf
    assert exact_l2_norm([torch.tensor([float("-inf")], dtype=torch.bfloat16)]) == math.inf
    assert math.isnan(exact_l2_norm([torch.tensor([float("inf"), float("nan")])]))
    inf_only = ExactSumOfSquares.from_tensor(
        torch.stack([acc_of(torch.tensor([3.0, float("inf")])).to_tensor(),
                     acc_of(torch.tensor([float("-inf")])).to_tensor()]).sum(0))
    assert inf_only.sum_of_squares() == math.inf and inf_only.norm() == math.inf
    # the finite part is still exact: it is kept apart from the counters
    only_inf = acc_of(torch.tensor([2.0, float("inf")]))
    assert torch.equal(only_inf.to_tensor()[:-3], acc_of(torch.tensor([2.0])).to_tensor()[:-3])


# ------------------------------------------------------------------ errors and helpers


def test_rejects_unsupported_inputs():
    acc = ExactSumOfSquares()
    with pytest.raises(TypeError, match="float64"):
        acc.add_(torch.ones(3, dtype=torch.float64))
    for dt in (torch.int32, torch.int64, torch.bool, torch.complex64):
        with pytest.raises(TypeError):
            acc.add_(torch.ones(3, dtype=dt))
    with pytest.raises(TypeError):
        acc.add_([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        acc.merge_(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ExactSumOfSquares.from_tensor(torch.zeros(5, dtype=torch.int64))
    with pytest.raises(TypeError):
        ExactSumOfSquares.from_tensor(torch.zeros(exact_mod.TENSOR_LEN, dtype=torch.float32))
    bad = torch.zeros(exact_mod.TENSOR_LEN, dtype=torch.int64)
    bad[0] = -1
    with pytest.raises(ValueError):
        ExactSumOfSquares.from_tensor(bad)


def test_accepts_views_grads_and_scalars():
    base = torch.randn(30, 40, requires_grad=True)
    view = base[::3, 5:17].t()  # non-contiguous
    scalar = torch.tensor(-7.25)
    got = exact_l2_norm({"v": view, "s": scalar})
    assert float_hex(got) == float_hex(oracle_norm(values_of(view, scalar)))


def test_dict_and_list_agree():
    g = torch.Generator().manual_seed(12)
    d = {f"t{i}": torch.randn(i + 1, generator=g) for i in range(10)}
    assert float_hex(exact_l2_norm(d)) == float_hex(exact_l2_norm(list(d.values())[::-1]))


def test_exact_sum_and_float_hex():
    vals = [1e16, 1.0, -1e16, 0.1] * 5
    assert exact_sum(vals) == math.fsum(vals)
    assert float_hex(exact_sum(vals)) == float_hex(exact_sum(list(reversed(vals))))
    assert exact_sum([1e308, 1e308, -1e308]) == 1e308  # fsum alone raises here
    assert exact_sum([1e308, 1e308]) == math.inf and exact_sum([-1e308, -1e308]) == -math.inf
    assert math.isnan(exact_sum([math.inf, -math.inf])) and math.isnan(exact_sum([1.0, math.nan]))
    assert exact_sum([math.inf, 1e308, 1e308]) == math.inf
    assert exact_sum([]) == 0.0
    assert float_hex(1.0) == "0x1.0000000000000p+0" and float_hex(-0.0) == "-0x0.0p+0"


# ------------------------------------------------------------------ scale


def test_large_tensor_is_fast_and_exact():
    g = torch.Generator().manual_seed(13)
    x = torch.randn(5_000_000, generator=g)
    x[::100_003] = wide_range_fp32(x[::100_003].numel(), seed=14)
    acc_of(x[:1000])  # warm-up of torch's kernels
    t0 = time.perf_counter()
    acc = ExactSumOfSquares()
    acc.add_(x)
    got = acc.norm()
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0
    want = math.sqrt(math.fsum(x.double().square().tolist()))
    assert float_hex(got) == float_hex(want)
