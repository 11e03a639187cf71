"""Tests for rlkernel.rollout.sampler: batch invariance, exact hash, distribution, top-p rules."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from rlkernel.rollout.sampler import (
    _argmax_lowest_id,
    _counter_uniform_reference,
    _top_p_keep_mask,
    counter_uniform,
    sample_tokens,
    sampled_logprobs,
)

V = 1000


def _logprobs(gen: torch.Generator, s: int, v: int = V, scale: float = 3.0) -> torch.Tensor:
    logits = torch.randn(s, v, generator=gen, dtype=torch.float32) * scale
    return torch.log_softmax(logits, dim=-1)


def _ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


# ---------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.3])
def test_token_independent_of_batch_row_and_size(top_p):
    gen = torch.Generator().manual_seed(0)
    seed, steps = 1234, 8
    target = _logprobs(gen, steps)  # the sample's rows at positions 0..7
    sid, t_row = 42, 11
    alone, row0, row11 = [], [], []
    for t in range(steps):
        lp = target[t : t + 1]
        alone.append(sample_tokens(lp, seed=seed, sample_ids=_ids(sid), positions=_ids(t), top_p=top_p))

        for row, sink in ((0, row0), (t_row, row11)):
            batch = _logprobs(gen, 16)
            batch[row] = lp[0]
            sids = torch.randint(0, 10_000, (16,), generator=gen)
            sids[row] = sid
            pos = torch.randint(0, 500, (16,), generator=gen)
            pos[row] = t
            toks = sample_tokens(batch, seed=seed, sample_ids=sids, positions=pos, top_p=top_p)
            sink.append(toks[row : row + 1])

            u_batch = counter_uniform(seed, sids, pos, V)
            u_alone = counter_uniform(seed, _ids(sid), _ids(t), V)
            assert torch.equal(u_batch[row : row + 1], u_alone)
    alone, row0, row11 = torch.cat(alone), torch.cat(row0), torch.cat(row11)
    assert torch.equal(alone, row0)
    assert torch.equal(alone, row11)


def test_chunking_does_not_change_tokens(monkeypatch):
    import rlkernel.rollout.sampler as sm

    gen = torch.Generator().manual_seed(3)
    lp = _logprobs(gen, 37, 300)
    sids, pos = torch.arange(37) * 7, torch.arange(37) % 5
    ref = sample_tokens(lp, seed=9, sample_ids=sids, positions=pos, top_p=0.8)
    monkeypatch.setattr(sm, "_CHUNK_ELEMS", 300 * 4)  # 4 rows per chunk
    got = sample_tokens(lp, seed=9, sample_ids=sids, positions=pos, top_p=0.8)
    assert torch.equal(ref, got)


def test_negative_control_stock_multinomial_depends_on_batch():
    """The stock path (one generator per batch + multinomial) is NOT invariant: the test above can fail."""
    gen = torch.Generator().manual_seed(0)
    steps = 8
    target = _logprobs(gen, steps, scale=0.5)  # high entropy: draws differ whenever the RNG stream does
    others = _logprobs(gen, 15 * steps, scale=0.5)

    def stock(lp: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(1234)  # seeded once per batch, as a stock engine does
        return torch.multinomial(lp.exp(), 1, generator=g)[:, 0]

    alone = torch.stack([stock(target[t : t + 1])[0] for t in range(steps)])
    results = {}
    for row in (0, 11):
        toks = []
        for t in range(steps):
            batch = others[t * 15 : (t + 1) * 15]
            batch = torch.cat([batch[:row], target[t : t + 1], batch[row:]])
            toks.append(stock(batch)[row])
        results[row] = torch.stack(toks)
    assert not (torch.equal(alone, results[0]) and torch.equal(alone, results[11]))


# ---------------------------------------------------------------- the hash itself


def test_counter_uniform_matches_reference():
    rng = random.Random(7)
    big = [0, 1, 2**31 - 1, 2**32, 2**53 + 1, 2**62, 2**63 - 1, -1, -(2**63)]
    vocab = 64
    for trial in range(40):
        seed = rng.choice([rng.randrange(0, 2**64), rng.randrange(-(2**70), 2**70), rng.choice(big)])
        s = 5
        sids = [rng.choice([rng.randrange(-(2**63), 2**63), rng.choice(big), rng.randrange(100)]) for _ in range(s)]
        poss = [rng.choice([rng.randrange(-(2**63), 2**63), rng.choice(big), rng.randrange(4096)]) for _ in range(s)]
        u = counter_uniform(seed, torch.tensor(sids), torch.tensor(poss), vocab)
        assert u.dtype == torch.float64 and u.shape == (s, vocab)
        ref = torch.tensor(
            [[_counter_uniform_reference(seed, a, b, t) for t in range(vocab)] for a, b in zip(sids, poss)],
            dtype=torch.float64,
        )
        assert torch.equal(u, ref), trial
    # large token ids
    u = counter_uniform(5, _ids(3), _ids(9), 200_003)
    for t in (0, 1, 65_535, 151_935, 200_002):
        assert u[0, t].item() == _counter_uniform_reference(5, 3, 9, t)


def test_reference_is_exact_and_in_open_interval():
    # u = (k + 0.5) * 2**-52 exactly, with k the top 52 bits of the hash.
    for args in [(0, 0, 0, 0), (1, 2, 3, 4), (2**64 - 1, 2**63 - 1, -5, 17)]:
        u = _counter_uniform_reference(*args)
        f = Fraction(u) * 2**52 - Fraction(1, 2)
        assert f.denominator == 1 and 0 <= f < 2**52
    u = counter_uniform(0, torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert abs(u.mean().item() - 0.5) < 0.005
    # extremes of the mapping stay strictly inside (0, 1)
    assert (0 + 0.5) * 2.0**-52 > 0 and ((2**52 - 1) + 0.5) * 2.0**-52 < 1


def test_noise_changes_with_seed_position_sample_and_token():
    base = counter_uniform(1, _ids(5), _ids(10), 512)
    for other in (
        counter_uniform(2, _ids(5), _ids(10), 512),
        counter_uniform(1, _ids(5), _ids(11), 512),
        counter_uniform(1, _ids(6), _ids(10), 512),
    ):
        assert not torch.equal(base, other)
        assert (base == other).sum().item() <= 1  # essentially independent
    assert torch.equal(counter_uniform(1 + 2**64, _ids(5), _ids(10), 512), base)  # seed is mod 2**64
    assert base.unique().numel() == 512  # distinct across token ids
    # swapped sample/position must not collide
    assert not torch.equal(counter_uniform(1, _ids(10), _ids(5), 512), base)


# ---------------------------------------------------------------- distribution and top-p


def _fixed_dist_logprobs(probs, n):
    lp = torch.log_softmax(torch.log(torch.tensor(probs, dtype=torch.float32)), dim=-1)
    return lp.expand(n, -1).contiguous()


def test_distribution_matches_probabilities():
    probs = [0.4, 0.25, 0.2, 0.1, 0.05]
    n = 40_000
    lp = _fixed_dist_logprobs(probs, n)
    toks = sample_tokens(lp, seed=77, sample_ids=torch.arange(n), positions=torch.zeros(n, dtype=torch.int64), top_p=1.0)
    counts = torch.bincount(toks, minlength=5)
    for i, p in enumerate(probs):
        se = math.sqrt(p * (1 - p) / n)
        assert abs(counts[i].item() / n - p) < 5 * se, (i, counts.tolist())
    # same along positions of one sample
    toks = sample_tokens(lp, seed=78, sample_ids=torch.zeros(n, dtype=torch.int64), positions=torch.arange(n), top_p=1.0)
    counts = torch.bincount(toks, minlength=5)
    for i, p in enumerate(probs):
        assert abs(counts[i].item() / n - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_top_p_excludes_and_renormalises():
    probs = [0.05, 0.5, 0.03, 0.25, 0.17]  # order: 1, 3, 4, 0, 2
    n = 20_000
    lp = _fixed_dist_logprobs(probs, n)
    kw = dict(seed=5, sample_ids=torch.arange(n), positions=torch.full((n,), 3))
    toks = sample_tokens(lp, top_p=0.7, **kw)  # before-mass: 0, .5, .75 -> keep {1, 3}
    counts = torch.bincount(toks, minlength=5)
    assert counts[[0, 2, 4]].sum().item() == 0
    frac = counts[1].item() / n  # renormalised: 0.5 / 0.75
    assert abs(frac - 2 / 3) < 5 * math.sqrt((2 / 9) / n)
    for tiny in (1e-300, 1e-9, 0.3, 0.49):
        toks = sample_tokens(lp, top_p=tiny, **kw)
        assert bool((toks == 1).all()), tiny  # top token always kept, alone


def test_top_p_ties_broken_by_token_id():
    n = 2000
    # tokens 1 and 3 tie exactly (equal logits -> bit-equal logprobs)
    logits = torch.tensor([0.0, 2.0, 1.0, 2.0], dtype=torch.float32)
    lp = torch.log_softmax(logits, -1).expand(n, -1).contiguous()
    assert lp[0, 1].item() == lp[0, 3].item()
    kw = dict(seed=11, sample_ids=torch.arange(n), positions=torch.zeros(n, dtype=torch.int64))
    toks = sample_tokens(lp, top_p=0.2, **kw)  # p(1)=p(3)~0.42: only the first of the tie survives
    assert bool((toks == 1).all())
    toks = sample_tokens(lp, top_p=0.5, **kw)  # both tied tokens kept, token 2 not
    assert set(toks.tolist()) == {1, 3}
    # permuted vocab: the tie winner is always the smaller id
    lp2 = lp[:, [3, 0, 2, 1]].contiguous()  # ids 0 and 3 tie now
    assert bool((sample_tokens(lp2, top_p=0.2, **kw) == 0).all())


def test_top_p_mask_exact_boundaries():
    p = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.25, 0.25, 0.5]], dtype=torch.float64)
    keep = _top_p_keep_mask(p, 0.5)
    assert keep.tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    keep = _top_p_keep_mask(p, 0.75)  # before-mass 0.75 is not < 0.75: the second tied token goes
    assert keep.tolist() == [[True, True, False], [True, True, False], [True, False, True]]
    keep = _top_p_keep_mask(p, 0.7500000000000001)
    assert keep.tolist() == [[True, True, True]] * 3
    # rows with identical probabilities: keep order is purely by id
    q = torch.full((1, 8), 0.125, dtype=torch.float64)
    assert _top_p_keep_mask(q, 0.3).tolist() == [[True, True, True] + [False] * 5]


def test_top_p_ties_kept_by_id_in_wide_rows():
    """A row of 1000 equal probabilities keeps exactly ids 0..n-1, n from the integer rule
    (i·round(p·2**60) < ceil(top_p·2**60)): the tie order is the id order at any width. Fails if
    the sort is not stable (torch's unstable CPU sort reorders ties in rows wider than 16)."""
    v, p, top_p = 1000, 1e-3, 0.3
    fixed, bound = round(p * 2.0**60), math.ceil(top_p * 2.0**60)
    n = sum(1 for i in range(v) if i * fixed < bound)
    keep = _top_p_keep_mask(torch.full((3, v), p, dtype=torch.float64), top_p)
    assert keep.tolist() == [[True] * n + [False] * (v - n)] * 3, keep.sum(-1)


def test_argmax_ties_to_smallest_id():
    s = torch.tensor([[1.0, 3.0, 3.0, 2.0], [float("-inf"), 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]], dtype=torch.float64)
    assert _argmax_lowest_id(s).tolist() == [1, 1, 0]


def test_neg_inf_never_chosen():
    n = 5000
    lp = torch.log_softmax(torch.tensor([0.0, float("-inf"), 0.0, float("-inf")]), -1).expand(n, -1).contiguous()
    toks = sample_tokens(lp, seed=1, sample_ids=torch.arange(n), positions=torch.zeros(n, dtype=torch.int64), top_p=1.0)
    assert set(toks.tolist()) == {0, 2}


def test_sampled_logprobs_gather():
    gen = torch.Generator().manual_seed(2)
    lp = _logprobs(gen, 6, 50)
    toks = sample_tokens(lp, seed=3, sample_ids=torch.arange(6), positions=torch.arange(6), top_p=0.95)
    got = sampled_logprobs(lp, toks)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.stack([lp[i, toks[i]] for i in range(6)]))
    with pytest.raises(ValueError):
        sampled_logprobs(lp, torch.tensor([0, 1, 2, 3, 4, 50]))
    with pytest.raises(ValueError):
        sampled_logprobs(lp, torch.tensor([0, 1]))


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan")])
def test_invalid_top_p(bad):
    lp = torch.log_softmax(torch.zeros(2, 4), -1)
    with pytest.raises(ValueError, match=repr(bad) if not math.isnan(bad) else "nan"):
        sample_tokens(lp, seed=0, sample_ids=_ids(0, 1), positions=_ids(0, 0), top_p=bad)


def test_shape_validation():
    lp = torch.log_softmax(torch.zeros(2, 4), -1)
    with pytest.raises(ValueError):
        sample_tokens(lp, seed=0, sample_ids=_ids(0, 1, 2), positions=_ids(0, 0), top_p=1.0)
    with pytest.raises(ValueError):
        sample_tokens(lp, seed=0, sample_ids=_ids(0, 1), positions=_ids(0), top_p=1.0)
    with pytest.raises(ValueError):
        sample_tokens(lp[0], seed=0, sample_ids=_ids(0), positions=_ids(0), top_p=1.0)
    with pytest.raises(ValueError):
        counter_uniform(0, _ids(0, 1), _ids(0), 4)
    with pytest.raises(ValueError):
        sample_tokens(torch.full((1, 3), float("-inf")), seed=0, sample_ids=_ids(0), positions=_ids(0), top_p=1.0)
    with pytest.raises(TypeError):
        counter_uniform(0, torch.tensor([0.5]), _ids(0), 4)
    with pytest.raises(ValueError, match="non-empty vocabulary"):   # no rows: no counter_uniform
        sample_tokens(torch.zeros(0, 0), seed=0, sample_ids=_ids(), positions=_ids(), top_p=1.0)
