"""benchmarks/bench_stand_in_rank.py on the CPU: its comm double's primitives, and one stood-in
rank of TP2, CP2 and TP2×CP2 training two steps of the tiny model (so a GPU call measuring
qwen3-8b's TP2 rank cannot fail on the script), every weight of a stood-in CP rank getting a
gradient."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.bench_stand_in_rank import StandInComm, run, stand_in_ctx, stood_in_policy
from benchmarks.bench_train_step import _samples

from rlkernel.distributed.comm import INT_SLICED_MIN_ELEMS, SLICED_MIN_ELEMS, Comm
from rlkernel.model.config import preset
from rlkernel.numerics.fixedpoint import N_COLS
from rlkernel.train.losses import LossCoefs, invariant_exp
from rlkernel.train.step import compute_gradients, gradients


def test_stand_in_comm_other_ranks_hold_zeros():
    c = StandInComm("tp", 3, rank=1)
    t = torch.arange(1.0, 7.0).reshape(2, 3)
    got = c.all_gather(t, "g")
    assert torch.equal(got[1], t) and not got[0].any() and not got[2].any()
    assert [x.shape for x in got] == [t.shape] * 3
    chunks = [torch.full((2,), float(r + 1)) for r in range(3)]
    recv = c.all_to_all(chunks, "a2a")
    assert torch.equal(recv[1], chunks[1]) and not recv[0].any() and not recv[2].any()
    assert c.all_gather_object({"n": 4}, "o") == [{"n": 4}] * 3
    ints = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    assert torch.equal(c.sum_ints(ints, "s"), ints)
    # The collectives built on them run their own code: a tree sum with zeros is the partial.
    p = torch.randn(5000)
    assert torch.equal(c.tree_all_reduce(p, "tree").view(torch.int32), (p + 0.0).view(torch.int32))
    with pytest.raises(TypeError, match="int64"):
        c.sum_ints(t, "s")


def test_stand_in_comm_sliced_int_sum_finishes_every_slice_from_this_ranks_values():
    # By slices, every rank's slice is finished here from this rank's integers and the others'
    # zeros: the whole result is this rank's share (not zeros where another rank finishes).
    c = StandInComm("dp_cp", 2)
    t = torch.randint(0, 1 << 20, (1 << 14 | 1, N_COLS), dtype=torch.int64)   # odd: a pad row
    seen = []

    def finish(rows):
        seen.append(rows.shape[0])
        return rows[:, 0].clone()

    got = c.sum_ints_finished(t, "fin", finish)
    assert torch.equal(got, t[:, 0]) and seen == [(t.shape[0] + 1) // 2] * 2


@pytest.mark.parametrize("rank", [0, 2])
def test_stand_in_comm_sliced_pick_is_this_ranks_values_where_it_owns_them(rank):
    # select_owner by slices (more than two ranks, at least SLICED_MIN_ELEMS): each slice's
    # owner map is its own ([a, b)), and this rank's values sit at its place among the parts.
    c = StandInComm("tp", 4, rank)
    n = SLICED_MIN_ELEMS + 3                    # not a multiple of 4: a pad
    t = torch.randn(n)
    owner = torch.randint(0, 4, (n,))
    assert torch.equal(c.select_owner(t, owner, "pick"),
                       torch.where(owner == rank, t, torch.zeros_like(t)))


def test_stand_in_comm_finishes_words_cut_along_their_columns():
    # finish_words cuts [2, n] double words along dim 1 (from INT_SLICED_MIN_ELEMS columns).
    c = StandInComm("dp_cp", 2)
    words = torch.randn(2, INT_SLICED_MIN_ELEMS + 1, dtype=torch.float64)
    got = c.finish_words(words, "w", lambda parts: sum(p[0] + p[1] for p in parts))
    assert torch.equal(got, words[0] + words[1])

def _grads_of_stood_in_rank(tp: int, cp: int) -> dict[str, torch.Tensor]:
    cfg = preset("tiny")
    policy = stood_in_policy(cfg, stand_in_ctx(cfg, tp, cp), torch.device("cpu"))
    batch = _samples(4, 16, 112, cfg.vocab_size, 1)
    compute_gradients(policy, None, batch, temperature=1.0,
                      coefs=LossCoefs(0.2, 0.0, 0.0, "k3"), micro_batch_tokens=1024, pad_id=0,
                      exp=invariant_exp)
    return gradients(policy)


def test_stood_in_cp_rank_gets_a_gradient_for_every_weight(monkeypatch):
    # Control: finishing only this rank's slices (the plain Comm's cut) leaves the weights whose
    # sums the other CP rank finishes (K/V projections: their dK/dV rows) with zero gradients.
    grads = _grads_of_stood_in_rank(2, 2)
    assert all(g.abs().max() > 0 for g in grads.values()), [
        n for n, g in grads.items() if not g.any()]
    monkeypatch.setattr(StandInComm, "_finish_slices", Comm._finish_slices)
    zero = [n for n, g in _grads_of_stood_in_rank(2, 2).items() if not g.any()]
    assert zero and all("k_proj" in n or "v_proj" in n or "k_norm" in n for n in zero), zero


@pytest.mark.parametrize("tp,cp,micro", [(2, 1, 0), (1, 2, 0), (2, 2, 2)])
def test_stood_in_rank_trains_two_steps(tp, cp, micro):
    r = run("tiny", tp, cp, samples=4, prompt_len=8, response_len=24, steps=2,
            micro_samples=micro, recompute=False, kl=micro > 0, dev=torch.device("cpu"))
    assert len(r["step_s"]) == 2 and all(t > 0 for t in r["step_s"])
    assert all(math.isfinite(n) and n > 0 for n in r["grad_norms"])
    assert r["peak_gib"] is None and r["peak_bytes_per_rank_param"] is None   # JSON null on CPU
    full = run("tiny", 1, 1, samples=4, prompt_len=8, response_len=24, steps=1,
               micro_samples=0, recompute=False, kl=False, dev=torch.device("cpu"))
    # The rank holds its TP shard: fewer elements than the whole model at TP2, all at TP1.
    assert (r["rank_param_elems"] < full["rank_param_elems"]) == (tp > 1)


@pytest.mark.parametrize("args,says", [
    (["--tp", "3"], "--tp 3: must divide virtual_tp"),
    (["--cp", "3"], "--cp 3: must divide virtual_cp"),
    (["--tp", "0"], "--tp 0: must be an integer >= 1"),
    (["--steps", "0"], "--steps 0: must be an integer >= 1"),
    (["--samples", "0"], "--samples 0: must be an integer >= 1"),
    (["--micro-samples", "9"], "--micro-samples 9: must be in [0, --samples 2]"),
    (["--model", "nosuch"], "--model 'nosuch': not a preset; allowed: tiny"),
])
def test_bad_input_is_refused_before_any_work(monkeypatch, capsys, args, says):
    # Exit 2 with the flag, its value and what is allowed, as `rlk run` refuses them.
    from benchmarks import bench_stand_in_rank as b
    monkeypatch.setattr(b, "run", lambda *a, **k: pytest.fail("ran with bad input"))
    monkeypatch.setattr("sys.argv", ["bench_stand_in_rank.py", "--model", "tiny", "--device",
                                     "cpu", "--samples", "2", *args])
    with pytest.raises(SystemExit) as e:
        b.main()
    assert e.value.code == 2 and says in capsys.readouterr().err
