"""Decode steps on the CUDA-graph path keep every sample's bytes (issue 12, item 4: "with CUDA
graphs or eager").

On CPU the graph path runs in mode "padded": each decode step's metadata padded to its bucket and
written into static buffers, then run eagerly on them — everything a captured graph replays
except the capture itself (tests/test_cuda_rollout.py compares real graphs with eager on the GPU).
Property: tokens and logprob bits of every sample are the same in modes "eager" and "padded",
with batches that pad (9 → 12 rows), prefix sharing and copy-on-write steps (run eagerly between
graph steps), late admission, EOS and top-p. Negative control: padding rows whose K/V go to a
real slot instead of the dump slot change samples, so the comparison can fail.
Run: `.venv/bin/python -m pytest -q tests/test_rollout_graphs.py` (about 30 s on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from rollout_helpers import bits, engine, group, requests, sp
from rlkernel.model.ops import InvariantOps
from rlkernel.rollout import cuda_graphs
from rlkernel.rollout.cuda_graphs import Pads, bucket, pad_decode
from rlkernel.rollout.scheduler import Chunk, StepPlan


def _run(mode: str, reqs, sp_, **kw):
    e = engine(InvariantOps, decode_graphs=mode, **kw)
    return [bits(c) for c in e.generate(reqs, sp_)], e.stats


def test_bucket_is_the_smallest_that_fits():
    assert [bucket(b) for b in (1, 2, 3, 5, 9, 12, 13, 257)] == [1, 2, 3, 6, 12, 12, 16, 384]
    assert all(b <= bucket(b) < 1.5 * b + 1 for b in range(1, 4097))
    with pytest.raises(ValueError, match="4097 sequences.*largest 4096"):
        bucket(4097)


def test_mode_is_checked_before_any_work():
    with pytest.raises(ValueError, match="decode_graphs='graphs'.*auto, eager, padded"):
        engine(InvariantOps, decode_graphs="graphs")


def test_pad_decode_fills_padding_rows():
    pads = Pads(n=5, width=40, max_new=12, dump_slot=99 * 16, zero_block=98, table_width=3)
    arrays = {"src": torch.tensor([7, 45]), "positions": torch.tensor([7, 5]),
              "q_idx": torch.tensor([[0], [1]]), "q_pos": torch.tensor([[7], [5]]),
              "kv_len": torch.tensor([8, 6]), "slots": torch.tensor([[23], [37]]),
              "table": torch.tensor([[1], [2]]), "rows": torch.tensor([0, 1]),
              "sample_ids": torch.tensor([10, 11]), "sample_pos": torch.tensor([8, 6]),
              "tok_dst": torch.tensor([8, 46]), "lp_dst": torch.tensor([0, 12]),
              "slots_sampled": torch.tensor([0, 1])}
    out = pad_decode(arrays, 3, pads)
    assert out["src"].tolist() == [7, 45, 200]               # dump row n=5, position 0
    assert out["q_idx"].tolist() == [[0], [1], [2]] and out["rows"].tolist() == [0, 1, 2]
    assert out["kv_len"].tolist() == [8, 6, 1] and out["q_pos"].tolist() == [[7], [5], [0]]
    assert out["slots"].tolist() == [[23], [37], [99 * 16]]
    assert out["table"].tolist() == [[1, 98, 98], [2, 98, 98], [98, 98, 98]]
    assert out["tok_dst"].tolist() == [8, 46, 200] and out["lp_dst"].tolist() == [0, 12, 60]
    assert out["slots_sampled"].tolist() == [0, 1, 5] and out["real"].tolist() == [1, 1, 0]
    with pytest.raises(ValueError, match="does not fit 1 rows"):
        pad_decode(arrays, 1, pads)


def test_is_decode_needs_one_token_samples_and_no_copies():
    from rlkernel.rollout.sequence import Sequence
    s = Sequence(0, 0, (1, 2, 3), 4)
    one = Chunk(s, 2, 1, True)
    assert cuda_graphs.is_decode(StepPlan([one], []))
    assert not cuda_graphs.is_decode(StepPlan([one], [(0, 1)]))
    assert not cuda_graphs.is_decode(StepPlan([Chunk(s, 0, 3, True)], []))
    assert not cuda_graphs.is_decode(StepPlan([Chunk(s, 2, 1, False)], []))
    assert not cuda_graphs.is_decode(StepPlan([], []))


_MIXED = requests(7, start=40) + group(3, 21, start=90) + requests(2, start=60, lo=30, hi=45)


@pytest.mark.parametrize("kw", [{}, {"max_seqs": 5, "max_step_tokens": 48}],
                         ids=["all-at-once", "late-admission"])
def test_padded_graph_steps_equal_eager(kw):
    """12 samples (9 distinct prompts, a GRPO group of 3 sharing its prompt blocks), EOS and
    top-p: every sample's bytes equal eager; most steps took the graph path, with padding."""
    sp_ = sp(12, eos=100, top_p=0.9)
    eager, st_e = _run("eager", _MIXED, sp_, **kw)
    padded, st_p = _run("padded", _MIXED, sp_, **kw)
    assert padded == eager
    assert st_e["graph_steps"] == 0 and st_e["graph_buckets"] == []
    assert st_p["graph_steps"] >= st_p["steps"] // 2
    assert any(r[2] == "eos" for r in eager) and any(r[2] == "length" for r in eager)
    if kw:
        # (step, slot, running) of each admission: some joined a batch already decoding
        assert any(step > 0 and running > 1 for step, _, running in st_p["admissions"])


def test_control_padding_into_a_real_slot_changes_samples(monkeypatch):
    """Negative control: padding rows that write their K/V into slot 0 (a real sequence's first
    key) instead of the dump slot change that sequence's later tokens or logprobs."""
    sp_ = sp(12, eos=100, top_p=0.9)
    reqs = requests(9, start=40)                                  # 9 rows pad to 12
    eager, _ = _run("eager", reqs, sp_)
    fill = Pads.fill
    monkeypatch.setattr(Pads, "fill", lambda self, key, i: 0 if key == "slots"
                        else fill(self, key, i))
    padded, st = _run("padded", reqs, sp_)
    assert st["graph_steps"] > 0
    assert padded != eager
