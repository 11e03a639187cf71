"""An engine that keeps its state across `generate` calls (keep_state: KV pool, token/logprob
buffers, decode graphs; issue 12, a serving engine's lifetime) gives every sample the bytes a
fresh engine gives it.

On CPU the graph path runs in mode "padded" (tests/test_rollout_graphs.py explains it); the
GPU test in tests/test_cuda_rollout.py does the same with captured graphs and a weight load
between calls. Checked: a sequence of calls of different sizes, sampling params and caps (some
reuse the kept state, some outgrow it) equals a fresh engine per call, in modes "padded" and
"eager"; `prepare` (padding-only steps that make every bucket) writes nothing a sample reads
and leaves every later call's bytes alone; reuse and growth are where they should be; bad use
is refused. Negative control: a kept state whose buffers are not reset between calls (the
previous call's tokens left in place) changes samples, so the comparison can fail.
Run: `.venv/bin/python -m pytest -q tests/test_rollout_state.py` (about 30 s on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from rollout_helpers import bits, engine, group, requests, sp
from rlkernel.model.ops import InvariantOps
from rlkernel.rollout import engine as engine_mod
from rlkernel.rollout.engine import Request

# (requests, sampling params) of consecutive calls: the second fits the first's rounded-up
# state (reuse), the third changes the sampling params (new graphs on the same state), the
# fourth outgrows it (more sequences and longer prompts: a new state), the fifth fits again.
_CALLS = [
    (requests(5, start=10), sp(8, eos=100, top_p=0.9)),
    (requests(3, start=30, lo=3, hi=12), sp(8, eos=100, top_p=0.9)),
    (requests(4, start=50), sp(6, eos=-1, top_p=1.0)),
    (requests(6, start=70, lo=40, hi=70) + group(3, 21, start=90), sp(10, eos=100, top_p=0.9)),
    (requests(2, start=110), sp(8, eos=100, top_p=0.9)),
]


def _fresh(mode: str, reqs, sp_, **kw):
    return [bits(c) for c in engine(InvariantOps, decode_graphs=mode, **kw).generate(reqs, sp_)]


@pytest.mark.parametrize("mode", ["padded", "eager"])
def test_kept_state_calls_equal_fresh_engines(mode):
    kept = engine(InvariantOps, decode_graphs=mode, keep_state=True, kv_blocks=64)
    states = []
    for reqs, sp_ in _CALLS:
        assert [bits(c) for c in kept.generate(reqs, sp_)] == _fresh(mode, reqs, sp_)
        assert kept.stats["kept_state"]
        states.append(kept._kept)
    assert states[1] is states[0] and states[2] is states[0]      # reused (sp change included)
    assert states[3] is not states[0] and states[4] is states[3]  # outgrown, then reused
    assert (states[0].rows, states[3].rows) == (8, 16)            # powers of two of 5 and 9
    if mode == "padded":
        assert kept.stats["graph_steps"] > 0


def test_prepare_writes_nothing_a_sample_reads():
    """prepare makes every bucket up to 6 rows (5 sequences) by steps of padding rows only: afterwards every
    real row of the buffers is as `_reset` leaves it and every KV block but the dump block is
    still zeros; the calls that follow equal fresh engines, and none of them makes a bucket."""
    kept = engine(InvariantOps, decode_graphs="padded", keep_state=True, kv_blocks=64)
    reqs, sp_ = _CALLS[0]
    kept.prepare(reqs, sp_)
    st = kept._kept
    assert st.graphs.used == [1, 2, 3, 4, 6] and st.graphs.steps == 0
    n = st.rows
    assert torch.equal(st.bufs.tokens[:n], torch.full_like(st.bufs.tokens[:n], 257))
    assert not st.bufs.logprobs[:n].any() and not st.bufs.done[:n].any()
    assert not bool(st.bufs.bad)
    assert st.bufs.logprobs[n].any() or st.bufs.tokens[n].ne(257).any()   # padding rows ran
    for pool in (*st.cache.k, *st.cache.v):
        assert not pool[:st.cache.dump_block].any()
    for reqs, sp_ in _CALLS[:3]:
        assert [bits(c) for c in kept.generate(reqs, sp_)] == _fresh("padded", reqs, sp_)
        assert kept._kept is st
        if sp_.eos_id == 100:                      # the graphs prepare made (same sp)
            assert st.graphs.used == [1, 2, 3, 4, 6]


def test_prepare_and_keep_state_refuse_bad_use():
    with pytest.raises(ValueError, match="prepare needs keep_state=True"):
        engine(InvariantOps).prepare(*_CALLS[0])
    kept = engine(InvariantOps, keep_state=True, kv_blocks=64)
    with pytest.raises(ValueError, match="empty prompt"):
        kept.prepare([Request(3, ())], _CALLS[0][1])
    kept.prepare([], _CALLS[0][1])                    # nothing to prepare for
    assert kept._kept is None
    kept.generate(*_CALLS[0])
    kept.release()
    assert kept._kept is None
    assert [bits(c) for c in kept.generate(*_CALLS[1])] == _fresh("eager", *_CALLS[1])


def test_control_buffers_not_reset_change_samples(monkeypatch):
    """Negative control: without zeroing the kept EOS flags between calls, the slots that met
    EOS in the last call are retired early in the next one (at its first host check: every
    step here), and samples change."""
    kept = engine(InvariantOps, decode_graphs="padded", keep_state=True, kv_blocks=64,
                  check_every=1)
    reqs, sp_ = _CALLS[0]
    first = [bits(c) for c in kept.generate(reqs, sp_)]
    assert any(r[2] == "eos" for r in first)
    reset = engine_mod.RolloutEngine._reset

    def stale(self, st, seqs):                 # everything but the EOS flags
        done = st.bufs.done.clone()
        reset(self, st, seqs)
        st.bufs.done.copy_(done)
    monkeypatch.setattr(engine_mod.RolloutEngine, "_reset", stale)
    sp_long = sp(8, eos=-1, top_p=0.9)
    assert [bits(c) for c in kept.generate(reqs, sp_long)] != _fresh("padded", reqs, sp_long)
    monkeypatch.setattr(engine_mod.RolloutEngine, "_reset", reset)
    assert [bits(c) for c in kept.generate(reqs, sp_long)] == _fresh("padded", reqs, sp_long)
