"""benchmarks/bench_stand_in_rank.py on the CPU: its comm double's primitives, and one stood-in
rank of TP2, CP2 and TP2×CP2 training two steps of the tiny model (so a GPU call measuring
qwen3-8b's TP2 rank cannot fail on the script)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.bench_stand_in_rank import StandInComm, run

from rlkernel.numerics.fixedpoint import N_COLS


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


def test_stand_in_comm_sliced_int_sum_finishes_this_ranks_slice():
    # By slices, rank 0 finishes its rows of every rank's integers (its own + zeros) and
    # receives the other ranks' finished slices as zeros: the shapes and the work of rank 0.
    c = StandInComm("dp_cp", 2)
    t = torch.randint(0, 1 << 20, (1 << 14, N_COLS), dtype=torch.int64)
    got = c.sum_ints_finished(t, "fin", lambda rows: rows[:, 0].clone())
    half = t.shape[0] // 2
    assert got.shape == (t.shape[0],)
    assert torch.equal(got[:half], t[:half, 0]) and not got[half:].any()


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
