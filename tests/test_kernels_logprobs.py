"""Tests for the vocab-sharded log-softmax, logprobs and entropy (kernels/logprobs.py) (DESIGN.md §1, §5 "Unit").

Checked two ways: against a float64 oracle with a tolerance, and against itself under batch /
offset / shard / rank-split changes bitwise (`assert_bitwise`), each with a negative control that
shows the stock torch path differs. Helpers and in-process thread ranks: tests/kernel_helpers.py.

Run: .venv/bin/python -m pytest -q tests/test_kernels_logprobs.py
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import (
    assert_bitwise,
    assert_near,
    assert_stock_differs,
    gen,
    randn,
)

from rlkernel.kernels.logprobs import (
    _shard_stats,
    log_softmax,
    merge_shard_stats,
    token_logprobs_entropy,
)
from rlkernel.spec import VIRTUAL_TP

# ================================================================== logprobs


def test_log_softmax_and_token_logprobs_entropy_vs_float64():
    """log_softmax(logits, T), token logprob and entropy agree with float64 (abs err <= 2e-5 for
    logprobs, 5e-5 for entropy) for T in {1.0, 0.7}; logprob == log_softmax gathered, bitwise."""
    N, V = 32, 4096
    logits = randn(N, V, seed=56, scale=3)
    tgt = torch.randint(0, V, (N,), generator=gen(57))
    for T in (1.0, 0.7):
        z64 = logits.double() / T
        ls64 = torch.log_softmax(z64, -1)
        ent64 = -(ls64.exp() * ls64).sum(-1)
        ls = log_softmax(logits, T)
        lp, ent = token_logprobs_entropy(logits, tgt, T)
        assert_near(ls, ls64, atol=2e-5)
        assert_near(lp, ls64.gather(1, tgt[:, None])[:, 0], atol=2e-5)
        assert_near(ent, ent64, atol=5e-5)
        assert_bitwise(lp, ls.gather(1, tgt[:, None])[:, 0])
    with pytest.raises(ValueError):
        log_softmax(randn(2, 12, seed=0), 1.0)  # 12 % 8 shards


def test_token_logprobs_entropy_backward_vs_float64():
    """d(Σ g_lp·logprob + g_ent·entropy)/dlogits agrees with float64 autograd (<= 1e-5 of max|ref|)."""
    N, V, T = 16, 1024, 0.8
    logits = randn(N, V, seed=58, scale=3).requires_grad_()
    tgt = torch.randint(0, V, (N,), generator=gen(59))
    g_lp, g_ent = randn(N, seed=60), randn(N, seed=61)
    lp, ent = token_logprobs_entropy(logits, tgt, T)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    l64 = logits.detach().double().requires_grad_()
    ls = torch.log_softmax(l64 / T, -1)
    lp64 = ls.gather(1, tgt[:, None])[:, 0]
    ent64 = -(ls.exp() * ls).sum(-1)
    ((lp64 * g_lp.double()).sum() + (ent64 * g_ent.double()).sum()).backward()
    assert_near(logits.grad, l64.grad, atol=1e-5 * float(l64.grad.abs().max()))


def test_logprobs_row_alone_equals_row_in_batch_and_at_offset():
    """For a row r: log_softmax row, logprob, entropy and the logits grad row alone == in a batch of
    7 / 64 == at offset +17, bitwise.
    No failing stock control: torch.log_softmax rows are batch-invariant on this CPU (searched
    V in 7..18992, batch 1..257, offsets, misaligned storage)."""
    N, V = 81, 2048
    logits = randn(N, V, seed=62, scale=4)
    tgt = torch.randint(0, V, (N,), generator=gen(63))
    g_lp, g_ent = randn(N, seed=64), randn(N, seed=65)

    def run(sl):
        lg = logits[sl].clone().requires_grad_()
        lp, ent = token_logprobs_entropy(lg, tgt[sl], 0.9)
        ((lp * g_lp[sl]).sum() + (ent * g_ent[sl]).sum()).backward()
        return log_softmax(logits[sl], 0.9), lp.detach(), ent.detach(), lg.grad

    ref = run(slice(17, 81))
    shifted = run(slice(0, 81))
    for m in (1, 7):
        got = run(slice(17, 17 + m))
        for a, b in zip(got, ref):
            assert_bitwise(a, b[:m])
    for a, b in zip(shifted, ref):
        assert_bitwise(a[17:], b)


def test_vocab_parallel_merge_equals_canonical_tree_for_tp_1_2_4_8():
    """Merging the 8 per-shard (max, sumexp, Σe·z) stats as TP=t ranks (each rank merges its 8/t
    aligned shards with merge_shard_stats, then the t rank results are merged) == the canonical
    merge of all 8, bitwise, for t in 1, 2, 4, 8."""
    z = randn(32, 4096, seed=66, scale=3)
    m, s, t_ = _shard_stats(z, VIRTUAL_TP)
    full = merge_shard_stats(m, s, t_)
    for tp in (1, 2, 4, 8):
        per = VIRTUAL_TP // tp
        ranks = [merge_shard_stats(m[:, r * per:(r + 1) * per], s[:, r * per:(r + 1) * per],
                                   t_[:, r * per:(r + 1) * per]) for r in range(tp)]
        got = merge_shard_stats(*(torch.stack([rk[i] for rk in ranks], -1) for i in range(3)))
        for a, b in zip(got, full):
            assert_bitwise(a, b)


def test_negative_control_stock_vocab_parallel_logsumexp_changes_with_tp():
    """Negative control: stock vocab-parallel lse (each TP rank torch.logsumexp over its vocab slice,
    ranks combined with torch.logsumexp) differs between TP=1 and TP=2 / TP=8 for some rows."""
    z = randn(32, 4096, seed=66, scale=3)
    tp1 = torch.logsumexp(z, -1)
    for tp in (2, 8):
        per = 4096 // tp
        tpx = torch.logsumexp(torch.stack([torch.logsumexp(z[:, r * per:(r + 1) * per], -1)
                                           for r in range(tp)], -1), -1)
        assert_stock_differs(tpx, tp1)


