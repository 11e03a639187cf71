"""Tests for the vocab-sharded log-softmax, logprobs and entropy (kernels/logprobs.py) (DESIGN.md §1, §5 "Unit").

Checked two ways: against a float64 oracle with a tolerance, and against itself under batch /
offset / shard / rank-split changes bitwise (`assert_bitwise`), each with a negative control that
shows the stock torch path differs. Helpers and in-process thread ranks: tests/kernel_helpers.py.

Run: .venv/bin/python -m pytest -q tests/test_kernels_logprobs.py
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from kernel_helpers import (
    assert_bitwise,
    bits,
    assert_near,
    assert_stock_differs,
    gen,
    n_diff,
    randn,
    run_ranks,
)
from torch.utils._python_dispatch import TorchDispatchMode

from rlkernel.kernels import logprobs as logprobs_mod
from rlkernel.kernels.logprobs import (
    _div_t,
    _shard_stats,
    linear_token_logprobs_entropy,
    log_softmax,
    merge_shard_stats,
    token_logprobs_entropy,
)
from rlkernel.kernels.matmul import column_parallel_linear, linear_nt
from rlkernel.model.ops import NativeOps
from rlkernel.numerics.trees import tree_combine
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



def _quotient_oracle(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = logits / T as the correctly rounded fp32 quotient of fp32 logits and fp32(T): the
    float64 quotient of two fp32 values rounded once to fp32 (exact: 53 >= 2·24 + 2 bits, so the
    double rounding is innocuous)."""
    t32 = float(torch.tensor(temperature, dtype=torch.float32))
    return (logits.double() / t32).float()


@pytest.mark.parametrize("live", [None, 3001])
def test_temperature_is_the_correctly_rounded_fp32_quotient_logits_over_t(live):
    """DESIGN.md §1: temperature is applied as `logits / T` in fp32. For T in {0.7, 0.6, 1.3}:
    log_softmax(logits, T) == log_softmax(z, 1.0), token_logprobs_entropy(logits, y, T) ==
    token_logprobs_entropy(z, y, 1.0) and the fused linear_token_logprobs_entropy(h, w, y, T) ==
    token_logprobs_entropy(z(h·wᵀ), y, 1.0), all bitwise, where z is the correctly rounded
    quotient (`_quotient_oracle`) and T = 1.0 divides exactly; also with a padded vocabulary.
    (Trainer/rollout agreement and the float64 tolerance tests hold for any consistent scaling,
    e.g. multiplying by 1/T; this pins the spec's operation.)"""
    N, H, V = 32, 24, 4096
    logits = randn(N, V, seed=156, scale=4)
    tgt = torch.randint(0, V if live is None else live, (N,), generator=gen(157))
    h, w = randn(N, H, seed=158), randn(V, H, seed=159, scale=0.5)
    for T in (0.7, 0.6, 1.3):
        z = _quotient_oracle(logits, T)
        assert_bitwise(log_softmax(logits, T, live_vocab=live), log_softmax(z, 1.0, live_vocab=live))
        for a, b in zip(token_logprobs_entropy(logits, tgt, T, live_vocab=live),
                        token_logprobs_entropy(z, tgt, 1.0, live_vocab=live)):
            assert_bitwise(a, b)
        zf = _quotient_oracle(linear_nt(h, w), T)
        for a, b in zip(linear_token_logprobs_entropy(h, w, tgt, T, live_vocab=live),
                        token_logprobs_entropy(zf, tgt, 1.0, live_vocab=live)):
            assert_bitwise(a.detach(), b)


def test_negative_control_reciprocal_temperature_changes_log_softmax_bits():
    """Negative control: z = logits · fp32(1/T) (what torch's CUDA `x / scalar` computes) gives
    other log-softmax bytes than logits / T for these inputs, so the test above can tell them."""
    logits = randn(32, 4096, seed=156, scale=4)
    for T in (0.7, 0.6, 1.3):
        assert_stock_differs(log_softmax(logits * (1.0 / T), 1.0), log_softmax(logits, T))


@pytest.mark.parametrize("rows_elems", [1 << 25, 3 * 1024])
def test_token_logprobs_entropy_backward_vs_float64(monkeypatch, rows_elems):
    """d(Σ g_lp·logprob + g_ent·entropy)/dlogits agrees with float64 autograd (<= 1e-5 of max|ref|),
    with per-row g_lp, g_ent, whether d logits is one chunk or chunks of 3 rows with a 1-row tail
    (logprobs.ROWS_ELEMS): a chunk that took another chunk's rows of g or the statistics fails."""
    monkeypatch.setattr(logprobs_mod, "ROWS_ELEMS", rows_elems)
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


@pytest.mark.parametrize("live", [None, 3001, 100])
def test_vocab_parallel_merge_equals_canonical_tree_for_tp_1_2_4_8(live):
    """Merging the 8 per-shard (max, sumexp, Σe·z) stats as TP=t ranks (each rank merges its 8/t
    aligned shards with merge_shard_stats, then the t rank results are merged) == the canonical
    merge of all 8, bitwise, for t in 1, 2, 4, 8 — also with a padded vocabulary (ids >= live
    masked by global id: part of one shard, or 7 whole shards)."""
    z = _div_t(randn(32, 4096, seed=66, scale=3), 1.0, live)
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




# ================================================================== padded vocabularies


@pytest.mark.parametrize("live", [3001, 4095, 100, 1])
def test_padded_vocab_ids_past_live_vocab_have_probability_zero_vs_float64(live):
    """With live_vocab = n < V: log_softmax is −inf at every id >= n; the live part, the token
    logprobs, the entropy and d/dlogits agree with float64 on the first n columns alone (the same
    tolerances as the unpadded test); the masked columns' gradient is exactly 0; logprob ==
    log_softmax gathered, bitwise."""
    N, V, T = 16, 4096, 0.7
    logits = randn(N, V, seed=70, scale=3).requires_grad_()
    tgt = torch.randint(0, live, (N,), generator=gen(71))
    g_lp, g_ent = randn(N, seed=72), randn(N, seed=73)
    ls = log_softmax(logits.detach(), T, live_vocab=live)
    lp, ent = token_logprobs_entropy(logits, tgt, T, live_vocab=live)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    assert bool((ls[:, live:] == float("-inf")).all())
    assert_bitwise(lp, ls.gather(1, tgt[:, None])[:, 0])
    assert bool((logits.grad[:, live:] == 0).all())

    l64 = logits.detach()[:, :live].double().requires_grad_()
    ls64 = torch.log_softmax(l64 / T, -1)
    lp64 = ls64.gather(1, tgt[:, None])[:, 0]
    ent64 = -(ls64.exp() * ls64).sum(-1)
    ((lp64 * g_lp.double()).sum() + (ent64 * g_ent.double()).sum()).backward()
    assert_near(ls[:, :live], ls64, atol=2e-5)
    assert_near(lp, lp64, atol=2e-5)
    assert_near(ent, ent64, atol=5e-5)
    assert_near(logits.grad[:, :live], l64.grad, atol=1e-5 * float(l64.grad.abs().max()) + 1e-30)


def test_padded_vocab_fused_lm_head_equals_unfused_and_native_follows_the_rule():
    """linear_token_logprobs_entropy(h, W, live_vocab=n) == token_logprobs_entropy(h @ Wᵀ, n),
    forward and d(h, W), bitwise (W's masked rows get exactly 0); the stock path (`--mode native`)
    applies the same rule: −inf past n, finite entropy and no NaN gradient."""
    N, H, V, n, T = 128, 32, 512, 300, 0.9
    h = randn(N, H, seed=74).requires_grad_()
    w = randn(V, H, seed=75, scale=0.3).requires_grad_()
    tgt = torch.randint(0, n, (N,), generator=gen(76))
    lp, ent = linear_token_logprobs_entropy(h, w, tgt, T, live_vocab=n)
    (lp.sum() + 0.3 * ent.sum()).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    (logits,) = column_parallel_linear(h, [w])
    lp2, ent2 = token_logprobs_entropy(logits, tgt, T, live_vocab=n)
    (lp2.sum() + 0.3 * ent2.sum()).backward()
    for a, b in ((lp, lp2), (ent, ent2), (gh, h.grad), (gw, w.grad)):
        assert_bitwise(a, b)
    assert bool((gw[n:] == 0).all())

    logits = linear_nt(h.detach(), w.detach()).requires_grad_()
    nl = NativeOps.log_softmax(logits, T, live_vocab=n)
    nlp, nent = NativeOps.token_logprobs_entropy(logits, tgt, T, live_vocab=n)
    (nlp.sum() + 0.3 * nent.sum()).backward()
    assert bool((nl[:, n:] == float("-inf")).all()) and bool(torch.isfinite(nent).all())
    assert bool(torch.isfinite(logits.grad).all()) and bool((logits.grad[:, n:] == 0).all())
    assert_near(nlp, lp, atol=2e-5)


def test_padded_vocab_rejects_a_live_vocab_outside_1_to_v():
    for bad in (0, 4097, -3, True):
        with pytest.raises(ValueError, match="live_vocab"):
            log_softmax(randn(2, 4096, seed=0), 1.0, live_vocab=bad)


_INTERPRETED_FUSED_CHECK = textwrap.dedent("""
    from triton_interpreter_compat import sequential_dot  # numpy >= 2.3: before any launch
    import torch
    from rlkernel.kernels import triton_logprobs as tlp
    from rlkernel.kernels import triton_matmul as tmm
    from rlkernel.kernels.logprobs import _div_t
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(8, 32, generator=g), torch.randn(2048, 32, generator=g) * 0.3
    # A layout comparison (the fused kernel against the logits kernel, tile against tile): dots
    # as sequential chains, numpy's matmul rounds by shape (tests/triton_interpreter_compat.py).
    with sequential_dot():
        for tile in (tlp.LINEAR_STATS_TILES[torch.bfloat16], (64, 8, 2)):
            for live in (1500, 300, 129, 1):
                tgt = torch.randint(0, live, (8,), generator=g)
                tgt[0] = live          # one masked target: its logprob must be -inf
                fused = tlp.linear_shard_stats(h, w, tgt, 0.7, 8, live, tile=tile)
                unfused = tlp.shard_stats(_div_t(tmm.linear_nt(h, w), 0.7, live), 1.0, 8, tgt)
                for a, b in zip(fused, unfused):
                    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (tile, live)
                m, s, t, zt = fused
                dead = [k for k in range(8) if k * 256 >= live]
                assert (m[:, dead] == float("-inf")).all() and (s[:, dead] == 0).all(), live
                assert (t[:, dead] == 0).all() and zt[0] == float("-inf"), live
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")
def test_padded_vocab_triton_fused_kernel_masks_by_global_id_under_interpreter():
    """TRITON_INTERPRET=1 (Triton on the CPU): the fused LM-head kernel's statistics with
    live_vocab == the materialised kernel's on z masked by _div_t, bitwise; shards wholly past
    live_vocab are (−inf, 0, 0) and a masked target's z is −inf. (CUDA: tests/test_cuda.py.)"""
    tests = os.path.dirname(os.path.abspath(__file__))   # triton_interpreter_compat
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.path.dirname(tests),
                                                       os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-c", _INTERPRETED_FUSED_CHECK], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def _lm_head_grads(h0, w0, tgt, fused, cd, g_lp, g_ent, live=300, temperature=0.9):
    """(lp, entropy, dh, dW) of Σ g_lp·logprob + g_ent·entropy through the fused LM head, or
    through column_parallel_linear(h, [W], cd) -> token_logprobs_entropy (unfused)."""
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    if fused:
        lp, ent = linear_token_logprobs_entropy(h, w, tgt, temperature, live_vocab=live,
                                                compute_dtype=cd)
    else:
        (logits,) = column_parallel_linear(h, [w], compute_dtype=cd)
        lp, ent = token_logprobs_entropy(logits, tgt, temperature, live_vocab=live)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("rows_elems", [1 << 25, 3 * 512])
def test_bf16_fused_lm_head_equals_unfused_bf16_linear_and_row_chunking_changes_nothing(
        monkeypatch, rows_elems):
    """compute_dtype=bf16: the fused LM head == column_parallel_linear(h, [W], bf16) fed to
    token_logprobs_entropy, forward and d(h, W), bitwise — the same rounding points (h before
    the product, d logits before dh/dW) — whether d logits is computed in one chunk or in
    chunks of 3 rows (logprobs.ROWS_ELEMS). Negative control: the fp32 LM head differs."""
    monkeypatch.setattr(logprobs_mod, "ROWS_ELEMS", rows_elems)
    N, H, V = 64, 32, 512
    h0 = randn(N, H, seed=84)
    w0 = randn(V, H, seed=85, scale=0.3).bfloat16().float()
    tgt = torch.randint(0, 300, (N,), generator=gen(86))

    def run(fused, cd):
        return _lm_head_grads(h0, w0, tgt, fused, cd, 1.0, 0.3)

    got = run(True, torch.bfloat16)
    for a, b in zip(got, run(False, torch.bfloat16)):
        assert_bitwise(a, b)
    assert all(n_diff(a, b) > 0 for a, b in zip(got, run(True, torch.float32)))


@pytest.mark.parametrize("cd", [torch.float32, torch.bfloat16])
def test_fused_lm_head_row_chunks_with_per_row_loss_weights_change_no_bit(monkeypatch, cd):
    """Per-row loss weights (Σ a_i·logprob_i + b_i·entropy_i, a and b distinct per row) and a W
    that holds no bf16 value: the fused LM head's lp, entropy, dh and dW are the same bytes with
    d logits in one chunk and in chunks of 3 rows with a 1-row tail (logprobs.ROWS_ELEMS), and
    equal the unfused column_parallel_linear(h, [W], cd) -> token_logprobs_entropy path in one
    chunk, bitwise. (Uniform weights could not tell a chunk that read another chunk's rows of
    g_lp/g_ent; a bf16-valued W could not tell a backward that skips rounding W.)"""
    N, H, V = 64, 32, 512
    h0 = randn(N, H, seed=171)
    w0 = randn(V, H, seed=172, scale=0.3)
    assert n_diff(w0, w0.bfloat16().float()) > 0
    a, b = randn(N, seed=173), randn(N, seed=174)
    tgt = torch.randint(0, 300, (N,), generator=gen(175))

    def run(fused, rows_elems):
        monkeypatch.setattr(logprobs_mod, "ROWS_ELEMS", rows_elems)
        return _lm_head_grads(h0, w0, tgt, fused, cd, a, b)

    want = run(False, 1 << 25)
    for fused, rows_elems in ((True, 1 << 25), (True, 3 * V), (False, 3 * V)):
        for x, y in zip(run(fused, rows_elems), want):
            assert_bitwise(x, y)


# ================================================================== vocab-parallel fused LM head


def _vocab_parallel_grads(tp, h0, w0, tgt, cd, g_lp, g_ent, live, temperature=0.9):
    """(lp, entropy, dh partial, dW slice) of every rank when `tp` thread ranks each hold the
    vocab slice [r·V/tp, (r+1)·V/tp) of W and run the fused LM head with vocab_comm."""
    v_loc = w0.shape[0] // tp

    def rank(r, comm):
        h = h0.clone().requires_grad_()
        w = w0[r * v_loc:(r + 1) * v_loc].clone().requires_grad_()
        lp, ent = linear_token_logprobs_entropy(h, w, tgt, temperature, shards=VIRTUAL_TP // tp,
                                                live_vocab=live, compute_dtype=cd,
                                                vocab_comm=comm)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    return run_ranks(tp, rank)


@pytest.mark.parametrize("cd", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("live", [None, 300, 100])
def test_vocab_parallel_fused_lm_head_equals_tp1_for_tp_2_4_8(cd, live):
    """The fused LM head with the vocab split over TP = 2, 4, 8 thread ranks (each rank its
    slice of W, its local virtual shards, the statistics all-gathered): every rank's logprobs and
    entropy, the canonical tree over the ranks' dh partials (what parallel.enter_tp finishes)
    and the ranks' dW slices laid end to end == the TP1 fused path == the unfused path on
    full-vocab logits, bitwise; with per-row loss weights, targets on every rank, and padded
    vocabularies whose bound falls inside a rank's slice (300) or leaves whole slices dead (100:
    ranks with no live id). Negative control: the ranks' dh partials added by a stock SUM
    (left to right, as an all-reduce may) differ from TP1 at TP4 and TP8 (where more than two
    ranks hold live ids)."""
    N, H, V = 64, 32, 512
    h0 = randn(N, H, seed=181)
    w0 = randn(V, H, seed=182, scale=0.3)
    a, b = randn(N, seed=183), randn(N, seed=184)
    tgt = torch.randint(0, V, (N,), generator=gen(185))
    tgt[:8] = torch.arange(0, V, V // 8)   # a target at the start of every virtual shard
    want = _lm_head_grads(h0, w0, tgt, False, cd, a, b, live=live)
    for x, y in zip(_lm_head_grads(h0, w0, tgt, True, cd, a, b, live=live), want):
        assert_bitwise(x, y)
    for tp in (2, 4, 8):
        ranks = _vocab_parallel_grads(tp, h0, w0, tgt, cd, a, b, live)
        for lp, ent, _, _ in ranks:
            assert_bitwise(lp, want[0])
            assert_bitwise(ent, want[1])
        assert_bitwise(tree_combine([r[2] for r in ranks]), want[2])
        assert_bitwise(torch.cat([r[3] for r in ranks]), want[3])
        if tp > 2 and live != 100:   # at 100 the dead slices' partials are zeros: any order
            assert_stock_differs(torch.stack([r[2] for r in ranks]).sum(0), want[2])


@pytest.mark.parametrize("cd", [torch.float32, torch.bfloat16])
def test_vocab_parallel_dlogits_add_no_zero_to_rows_whose_target_is_elsewhere(cd):
    """A rank whose slice does not hold a row's target adds nothing at that row, not +0.0: with
    one live id (every other id dead: d logit −0.0 with positive loss weights), every target 0
    and W's row 0 negative, TP1's dh is −0.0 in every element; TP 2 and 8 must give those signs
    (an added +0.0 on the dead slices turns their partials, and the tree, to +0.0). The check
    that TP1 is all −0.0 shows the test can see the difference."""
    N, H, V = 64, 32, 512
    w0 = randn(V, H, seed=211).abs()
    w0[0] = -w0[0]
    h0 = randn(N, H, seed=212)
    a, b = randn(N, seed=213).abs(), randn(N, seed=214).abs()
    tgt = torch.zeros(N, dtype=torch.long)
    want = _lm_head_grads(h0, w0, tgt, True, cd, a, b, live=1)
    assert bool((bits(want[2]) == bits(torch.tensor(-0.0))).all())
    for tp in (2, 8):
        ranks = _vocab_parallel_grads(tp, h0, w0, tgt, cd, a, b, 1)
        assert_bitwise(tree_combine([r[2] for r in ranks]), want[2])


def test_vocab_parallel_statistics_are_gathered_in_virtual_shard_order():
    """_gather_vocab_stats on TP = 2, 4, 8 thread ranks returns (m, s, t) [N, 8] equal, column
    by column, to the per-shard statistics of the full row (shard k in column k), and the target
    logit of the rank that holds it. (A mirrored order would give the same merged bytes — the
    merge is symmetric — so the order itself is pinned here, for trees where it matters.)"""
    N, V = 16, 512
    z = _div_t(randn(N, V, seed=221, scale=3), 1.0)
    tgt = torch.randint(0, V, (N,), generator=gen(222))
    full = _shard_stats(z, VIRTUAL_TP)
    for tp in (2, 4, 8):
        v = V // tp

        def rank(r, comm):
            zr = z[:, r * v:(r + 1) * v]
            m, s, t = _shard_stats(zr, VIRTUAL_TP // tp)
            local = tgt - r * v
            held = (local >= 0) & (local < v)
            zy = torch.where(held, zr.gather(1, local.clamp(0, v - 1)[:, None])[:, 0],
                             float("-inf"))
            return logprobs_mod._gather_vocab_stats(comm, v, tgt, m, s, t, zy)

        for got in run_ranks(tp, rank):
            for a, b in zip(got[:3], full):
                assert_bitwise(a, b)
            assert_bitwise(got[3], z.gather(1, tgt[:, None])[:, 0])


class _LargestPerToken(TorchDispatchMode):
    """The most elements of any op output with one row per token (first dim `rows`) while
    active: logits-like tensors; weight-shaped ones (dW accumulators) are not per token."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows, self.largest = rows, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == self.rows:
                self.largest = max(self.largest, t.numel())
        return out


def test_vocab_parallel_fused_lm_head_never_forms_full_vocab_logits():
    """At TP = 2 and 4 no op of the fused LM head's forward or backward, on any rank, produces a
    per-token tensor (N rows) larger than [N, V/TP] (its own logits slice): the full-vocabulary
    logits are neither formed nor gathered, and nothing else of that size exists (the float64
    temporaries of the exact exp included). Controls: TP1 does produce
    [N, V]-sized tensors (so the measure sees them), and so does the unfused vocab-parallel path
    at TP2 (column-parallel logits, gathered)."""
    N, H, V = 64, 16, 512
    h0, w0 = randn(N, H, seed=191), randn(V, H, seed=192, scale=0.3)
    tgt = torch.randint(0, V, (N,), generator=gen(193))
    g = torch.ones(N)

    def largest(tp, fused):
        def rank(r, comm):
            v_loc = V // tp
            h = h0.clone().requires_grad_()
            w = w0[r * v_loc:(r + 1) * v_loc].clone().requires_grad_()
            with _LargestPerToken(N) as seen:
                if fused:
                    lp, ent = linear_token_logprobs_entropy(
                        h, w, tgt, 0.9, shards=VIRTUAL_TP // tp, vocab_comm=comm)
                else:
                    (z,) = column_parallel_linear(h, [w], local_shards=VIRTUAL_TP // tp)
                    lp, ent = token_logprobs_entropy(gather_vocab_with(comm, z), tgt, 0.9)
                ((lp * g).sum() + ent.sum()).backward()
            return seen.largest
        return max(run_ranks(tp, rank))

    assert largest(1, True) >= N * V
    assert largest(2, False) >= N * V
    for tp in (2, 4):
        assert largest(tp, True) <= N * V // tp, tp


def gather_vocab_with(comm, z):
    """parallel.gather_vocab's autograd pair on a bare Comm (the unfused path's vocab gather)."""
    from rlkernel.distributed.parallel import collective_pair, rows_of_rank
    return collective_pair(z, lambda t: comm.all_gather_cat(t, "vocab-gather", 1),
                           lambda g: rows_of_rank(g, comm, 1))


@pytest.mark.parametrize("bad", [512, 517, -1])
def test_fused_lm_head_rejects_a_target_outside_the_vocabulary(bad):
    """A target outside [0, V) is a ValueError naming it (TP1 and a TP2 slice alike); it would
    get logprob −inf and no gradient term on every rank (the unfused path's gather raises)."""
    h, w = randn(16, 8, seed=1), randn(512, 8, seed=2)
    tgt = torch.zeros(16, dtype=torch.long)
    tgt[5] = bad
    with pytest.raises(ValueError, match=f"target {bad} at row 5 is not a token id of the 512"):
        linear_token_logprobs_entropy(h, w, tgt, 1.0)

    def rank(r, comm):
        with pytest.raises(ValueError, match=f"target {bad} at row 5"):
            linear_token_logprobs_entropy(h, w[r * 256:(r + 1) * 256], tgt, 1.0, shards=4,
                                          vocab_comm=comm)
    run_ranks(2, rank)


def test_vocab_parallel_fused_lm_head_rejects_shards_that_do_not_divide_the_slice():
    """A slice whose rows do not divide into the local virtual shards is a ValueError naming
    both, before any work."""
    with pytest.raises(ValueError, match="100 vocab rows do not divide into 8"):
        linear_token_logprobs_entropy(randn(16, 8, seed=1), randn(100, 8, seed=2),
                                      torch.zeros(16, dtype=torch.long), 1.0)


def test_model_trainer_head_at_tp2_is_the_vocab_parallel_fused_path(monkeypatch):
    """Qwen3ForCausalLM.token_logprobs (what the trainer and the topology matrix run) at TP2 on
    thread ranks: never gathers the vocab (InvariantOps.gather_vocab raises here), and its
    logprobs, entropy, d h (finished across TP) and each rank's LM-head gradient slice equal the
    TP1 model's, bitwise. The topology matrix compares whole runs; this pins which path they
    take, since the old gathered path gives the same bytes with [L, V] logits on every rank."""
    from rlkernel.distributed.comm import Comm
    from rlkernel.distributed.parallel import ParallelCtx
    from rlkernel.distributed.tokensum import TokenSum
    from rlkernel.model.checkpoint import init_weights
    from rlkernel.model.config import tiny
    from rlkernel.model.ops import InvariantOps
    from rlkernel.model.qwen3 import Qwen3ForCausalLM

    cfg = tiny()
    weights = init_weights(cfg, 3)
    n = 48
    h0 = randn(n, cfg.hidden_size, seed=201)
    tgt = torch.randint(0, cfg.vocab_size, (n,), generator=gen(202))
    a, b = randn(n, seed=203), randn(n, seed=204)

    def run(pc):
        model = Qwen3ForCausalLM(cfg, InvariantOps, torch.bfloat16, pc)
        model.load_tensors(weights)
        h = h0.clone().requires_grad_()
        lp, ent = model.token_logprobs(h, tgt, 0.8)
        ((lp * a).sum() + (ent * b).sum()).backward()
        return lp.detach(), ent.detach(), h.grad, model.lm_head_weight().grad

    want = run(None)

    def rank(r, comm):
        tok = TokenSum(Comm.single("tokens"))
        return run(ParallelCtx(comm, Comm.single("kv"), Comm.single("cp"), False, tok, tok))

    def no_gather(*_):
        raise AssertionError("the trainer's LM head gathered the vocabulary")
    monkeypatch.setattr(InvariantOps, "gather_vocab", staticmethod(no_gather))
    ranks = run_ranks(2, rank)
    for r, (lp, ent, dh, dw) in enumerate(ranks):
        assert_bitwise(lp, want[0])
        assert_bitwise(ent, want[1])
        assert_bitwise(dh, want[2])
        v = cfg.vocab_size // 2
        assert_bitwise(dw, want[3][r * v:(r + 1) * v])
