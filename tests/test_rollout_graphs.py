"""Decode steps on the CUDA-graph path keep every sample's bytes (issue 12, item 4: "with CUDA
graphs or eager").

On CPU the graph path runs in mode "padded": each decode step's metadata padded to its bucket and
written into static buffers, then run eagerly on them — everything a captured graph replays
except the capture itself (tests/test_cuda_rollout.py compares real graphs with eager on the GPU).
Property: tokens and logprob bits of every sample are the same in modes "eager" and "padded",
with batches that pad (late admission; caps that shrink the batch 9 → 4 over buckets 12, 8, 6,
4), prefix sharing and copy-on-write steps and one-token prefill steps (run eagerly between graph
steps), EOS and top-p; beyond the samples, every real row of the token/logprob/EOS buffers and
every KV block but the dump block hold the same bytes (padding rows write only the dump row and
dump block). The non-finite check counts real rows only: a NaN padding row raises nothing, a NaN
real row on a graph step raises the host check's ValueError. Negative control: padding rows whose
K/V go to a real slot instead of the dump slot change samples, so the comparison can fail.
A hypothesis property test draws small rollouts (prompts, GRPO group, batch cap, budget,
sharing, top-p) and checks the same equality (it also fails on that control's mutation).
Run: `.venv/bin/python -m pytest -q tests/test_rollout_graphs.py` (about 20 s on 2 cores).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from rollout_helpers import bits, engine, group, requests, sp
from rlkernel.model.ops import InvariantOps
from rlkernel.rollout import cuda_graphs
from rlkernel.rollout import engine as engine_mod
from rlkernel.rollout.cuda_graphs import Pads, bucket, pad_decode
from rlkernel.rollout.engine import Request
from rlkernel.rollout.kv_cache import PagedKVCache
from rlkernel.rollout.scheduler import Chunk, StepPlan


def _run(mode: str, reqs, sp_, **kw):
    e = engine(InvariantOps, decode_graphs=mode, **kw)
    return [bits(c) for c in e.generate(reqs, sp_)], e.stats


def _run_state(mode: str, reqs, sp_, poison=None, **kw):
    """_run plus the call's device state at its end: the token/logprob/EOS buffers (row n: the
    dump row) and the KV cache, caught where generate hands them to _decode_graphs. poison(e):
    changes the engine before the call."""
    e = engine(InvariantOps, decode_graphs=mode, **kw)
    if poison:
        poison(e)
    seen = {}
    make = e._decode_graphs

    def spy(cache, bufs, *a):
        seen.update(cache=cache, bufs=bufs)
        return make(cache, bufs, *a)
    e._decode_graphs = spy
    out = [bits(c) for c in e.generate(reqs, sp_)]
    return out, e.stats, seen["bufs"], seen["cache"]


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_bucket_is_the_smallest_that_fits():
    assert [bucket(b) for b in (1, 2, 3, 5, 9, 12, 13, 257)] == [1, 2, 3, 6, 12, 12, 16, 384]
    assert all(b <= bucket(b) < 1.5 * b + 1 for b in range(1, 4097))
    with pytest.raises(ValueError, match="4097 sequences.*largest 4096"):
        bucket(4097)


def test_mode_is_checked_before_any_work():
    with pytest.raises(ValueError, match="decode_graphs='graphs'.*auto, eager, padded"):
        engine(InvariantOps, decode_graphs="graphs")


def test_auto_is_eager_on_cpu():
    """decode_graphs="auto" (the default) captures nothing off CUDA: the steps run eagerly."""
    reqs, sp_ = requests(3, start=40), sp(3)
    auto, st = _run("auto", reqs, sp_)
    assert st["graph_steps"] == 0 and st["graph_buckets"] == [] and st["steps"] > 1
    assert auto == _run("eager", reqs, sp_)[0]


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
    assert out["positions"].tolist() == [7, 5, 0]
    assert out["sample_ids"].tolist() == [10, 11, 0] and out["sample_pos"].tolist() == [8, 6, 0]
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


def test_a_batch_beyond_the_largest_bucket_runs_eagerly(monkeypatch):
    """With buckets up to 2 rows, decode steps of 3+ sequences run eagerly (same bytes), never
    a ValueError mid-generate; steps of 1-2 sequences still take the graph path."""
    monkeypatch.setattr(cuda_graphs, "BUCKETS", (1, 2))
    # two samples stop after 3 tokens, so the last steps decode 2 sequences
    reqs = [Request(r.sample_id, r.prompt_ids, 3 if i < 2 else None)
            for i, r in enumerate(requests(4, start=40))]
    sp_ = sp(12, eos=-1, top_p=0.9)
    eager, _ = _run("eager", reqs, sp_)
    padded, st = _run("padded", reqs, sp_, max_seqs=4)
    assert padded == eager
    assert 0 < st["graph_steps"] < st["steps"] and max(st["graph_buckets"]) <= 2, st


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


def test_one_token_prefill_chunks_run_eagerly():
    """prefill_chunk=1: steps whose chunks are all one token, some of them prompt tokens that
    sample nothing (no row to sample: not decode), run eagerly between graph steps."""
    sp_ = sp(6, eos=100, top_p=0.9)
    reqs = requests(6, start=40, lo=3, hi=10)
    kw = {"prefill_chunk": 1, "max_seqs": 3}
    eager, _ = _run("eager", reqs, sp_, **kw)
    padded, st = _run("padded", reqs, sp_, **kw)
    assert padded == eager and 0 < st["graph_steps"] < st["steps"]


def test_control_padding_into_a_real_slot_changes_samples(monkeypatch):
    """Negative control: padding rows that write their K/V into slot 0 (a real sequence's first
    key) instead of the dump slot change that sequence's later tokens or logprobs."""
    sp_ = sp(12, eos=100, top_p=0.9)
    reqs = requests(9, start=40)                                  # 9 rows pad to 12
    eager, _ = _run("eager", reqs, sp_)
    fill = Pads.fill
    monkeypatch.setattr(Pads, "fill", lambda self, key: 0 if key == "slots"
                        else fill(self, key))
    padded, st = _run("padded", reqs, sp_)
    assert st["graph_steps"] > 0
    assert padded != eager


# 9 distinct prompts whose caps shrink the batch 9, 8, 7, 6, 5, 4 (buckets 12, 8, 8, 6, 6, 4:
# most decode steps pad). eos=26: the first sample (slot 0) and the last (slot n-1, request 2
# moved to the end) sample it at their second token, in a step of 9 rows padded to 12.
_CAPS = [6, 14, 9, 14, 11, 5, 14, 12, 14]
_SHRINK = [Request(r.sample_id, r.prompt_ids, m) for r, m in zip(requests(9, start=40), _CAPS)]
_SHRINK = _SHRINK[:2] + _SHRINK[3:] + _SHRINK[2:3]
_SP_SHRINK = sp(14, eos=26, top_p=0.9)


def test_padding_rows_write_only_the_dump_row_and_dump_block():
    """Not only the returned samples: every real row of the token/logprob/EOS buffers (prompt
    cells, tokens past an EOS, cells never sampled) and every KV block but the dump block (the
    zero block included, which must stay zeros) hold the same bytes after a padded run as after
    an eager one. Padding rows did run (they wrote the dump row, which eager never touches), and
    the first and last slots set their EOS flags in padded steps."""
    eager, _, be, ce = _run_state("eager", _SHRINK, _SP_SHRINK)
    padded, st, bp_, cp_ = _run_state("padded", _SHRINK, _SP_SHRINK)
    n = len(_SHRINK)
    assert padded == eager and st["graph_steps"] >= st["steps"] - 1
    assert st["graph_buckets"] == [4, 6, 8, 12]
    assert [r[2] for r in eager[:1] + eager[-1:]] == ["eos", "eos"]
    assert len(eager[0][0]) == len(eager[-1][0]) == 2
    assert torch.equal(bp_.tokens[:n], be.tokens[:n])
    assert torch.equal(_i32(bp_.logprobs[:n]), _i32(be.logprobs[:n]))
    assert torch.equal(bp_.done[:n], be.done[:n]) and bool(be.done[0]) and bool(be.done[n - 1])
    assert not bool(bp_.bad) and not bool(be.bad)
    keep = ce.blocks + 1                          # every block but the dump (index blocks + 1)
    for a, b in zip(ce.k + ce.v, cp_.k + cp_.v):
        assert torch.equal(_i32(a[:keep]), _i32(b[:keep]))
        assert not bool(b[cp_.zero_block].any())
    assert bool(bp_.logprobs[n].ne(0).any()) and not bool(be.logprobs[n].ne(0).any())


class _NaNZeroBlock(PagedKVCache):
    """The zero block holds NaN values (keys stay zero: a NaN score would end as an empty row,
    attention's `l > 0` test, not as NaN): only a row that attends to it below its kv_len reads
    them into a result — at rollout CP = 1 only a padding row (kv_len 1, a table of zero
    blocks)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        for pool in self.v:
            pool[self.zero_block] = float("nan")


def test_nonfinite_padding_rows_are_not_flagged(monkeypatch):
    """The non-finite check counts real rows only: with a NaN zero block the padding rows'
    logprobs are NaN (the dump row shows it), yet the padded run raises nothing and its samples
    equal the eager run's with and without the NaN block."""
    clean, _, _, _ = _run_state("eager", _SHRINK, _SP_SHRINK)
    monkeypatch.setattr(engine_mod, "PagedKVCache", _NaNZeroBlock)
    eager, _, _, _ = _run_state("eager", _SHRINK, _SP_SHRINK)
    padded, st, bufs, _ = _run_state("padded", _SHRINK, _SP_SHRINK)
    assert padded == eager == clean and st["graph_steps"] > 0
    assert bool(bufs.logprobs[len(_SHRINK)].isnan().any()) and not bool(bufs.bad)


def test_nonfinite_real_row_on_a_graph_step_raises(monkeypatch):
    """A real row's NaN logprobs on a graph step are flagged, and the run ends in the host
    check's ValueError (not in an out-of-range token id: a NaN row's draw is id V). The final
    hidden state of rows at position P is made NaN, P = the longest prompt: no prefill feeds it,
    and every prompt differs (no copy-on-write step), so only decode steps see the NaN — on
    the graph path in mode "padded", which ran before the raise."""
    reqs = requests(9, start=40)
    pos = max(len(r.prompt_ids) for r in reqs)

    def poison(e):
        hidden = e.model.hidden

        def nan_at_pos(lay, cache=None):
            return torch.where((lay.positions == pos)[:, None], float("nan"), hidden(lay, cache))
        e.model.hidden = nan_at_pos
    steps = []
    step = cuda_graphs.DecodeGraphs.step
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "step",
                        lambda self, plan: (steps.append(len(plan.chunks)), step(self, plan)))
    for mode in ("eager", "padded"):
        with pytest.raises(ValueError, match="logprobs contain NaN"):
            _run_state(mode, reqs, sp(12), poison=poison)
    assert steps and steps[0] == 9


@settings(max_examples=10, deadline=None, derandomize=True)
@given(n=st.integers(1, 13), shared=st.integers(0, 4), max_seqs=st.integers(1, 16),
       budget=st.sampled_from([8, 40, 8192]), sharing=st.booleans(),
       top_p=st.sampled_from([1.0, 0.9]), seed=st.integers(0, 99))
def test_property_padded_graph_steps_equal_eager(n, shared, max_seqs, budget, sharing, top_p,
                                                 seed):
    """Random small rollouts — n distinct prompts plus a GRPO group of `shared` samples, any
    running-batch cap (buckets 1..16, padding or not), step budget, prefix sharing on or off,
    top-p — give every sample the same bytes through the padded graph path as eagerly."""
    reqs = requests(n, start=2000 + 50 * seed, lo=3, hi=40)
    if shared:
        reqs += group(shared, 18, start=5000 + 50 * seed, seed=seed)
    sp_ = sp(6, eos=100, top_p=top_p)
    kw = dict(max_seqs=max_seqs, max_step_tokens=budget, prefix_sharing=sharing)
    eager, _ = _run("eager", reqs, sp_, **kw)
    padded, st_p = _run("padded", reqs, sp_, **kw)
    assert padded == eager
    assert st_p["graph_steps"] > 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 5), st.integers(0, 40)),
                min_size=1, max_size=24), st.sampled_from([16, 64]), st.integers(1, 3000))
def test_property_decode_metadata_equals_the_piece_by_piece_metadata(rows, block, n_blocks):
    """The decode fast path of _step_metadata (engine._decode_metadata: CP 1, one sampled token
    per chunk, no copies) gives the general path's arrays — every key, dtype, shape and value —
    and the same tk / pos_bound / sample count, for random positions (block edges included),
    generated counts, slots and block ids (taken mod the pool size as the general path does)."""
    from types import SimpleNamespace

    from rlkernel.distributed.comm import Comm
    from rlkernel.rollout.sequence import Sequence
    chunks = []
    for i, (pos, extra, gen) in enumerate(rows):
        blocks = [(i * 97 + 13 * b) for b in range(pos // block + 1 + extra)]
        seq = Sequence(slot=(i * 7) % 50, sample_id=1000 - i, prompt=tuple(range(pos + 1 - min(gen, pos))),
                       max_new=64, n_generated=min(gen, pos), blocks=blocks)
        chunks.append(Chunk(seq, pos, 1, True))
    plan = StepPlan(chunks, [])
    cache = SimpleNamespace(zero_block=n_blocks, dump_block=n_blocks + 1, blocks=n_blocks)
    cp = Comm.single("cp")
    fast = engine_mod._step_metadata(plan, block, cache, cp, 400, 64)
    slow = engine_mod._piece_metadata(plan, block, cache, cp, 400, 64)
    assert set(fast.arrays) == set(slow.arrays)
    for k, a in slow.arrays.items():
        b = fast.arrays[k]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), k
    assert (fast.tk, fast.pos_bound, fast.n_sample) == (slow.tk, slow.pos_bound, slow.n_sample)
