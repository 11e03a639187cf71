"""An engine that keeps its state across `generate` calls (keep_state: KV pool, token/logprob
buffers, decode graphs; issue 12, a serving engine's lifetime) gives every sample the bytes a
fresh engine gives it.

On CPU the graph path runs in mode "padded" (tests/test_rollout_graphs.py explains it); the
GPU test in tests/test_cuda_rollout.py does the same with captured graphs and a weight load
between calls. Checked: a sequence of calls of different sizes, sampling params and caps (some
reuse the kept state, some outgrow it) equals a fresh engine per call, in modes "padded" and
"eager"; `prepare` (padding-only steps that make every bucket) writes nothing a sample reads
and leaves every later call's bytes alone; reuse and growth are where they should be (each
dimension alone: sequences, positions, new tokens, KV blocks; exact powers of two; graphs remade
for each recorded sampling param and only for those; the pool's whole budget, sized after the
old pool is freed; a call after a failed one starts clean); bad use is refused. Negative control: a kept state whose buffers are not reset between calls (the
previous call's tokens left in place) changes samples, so the comparison can fail.
Run: `.venv/bin/python -m pytest -q tests/test_rollout_state.py` (about 60 s on 2 cores).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout_helpers import W, bits, engine, group, requests, sp
from rlkernel.model.ops import InvariantOps
from rlkernel.rollout import engine as engine_mod
from rlkernel.rollout.engine import Request
from rlkernel.rollout.kv_cache import PagedKVCache

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


# -- added by mutation testing (branch mut-keepstate): each test below fails on a mutant of the
# keep_state code that the tests above let through.

def _fixed(n: int, start: int, length: int):
    """n requests (ids start..) with prompts of exactly `length` tokens."""
    return requests(n, start=start, lo=length, hi=length + 1)


def _fresh_run(mode: str, reqs, sp_, **kw):
    e = engine(InvariantOps, decode_graphs=mode, **kw)
    return [bits(c) for c in e.generate(reqs, sp_)], e.stats


def test_kept_sizes_are_the_smallest_powers_of_two():
    """_pow2 is the smallest power of two >= x (a power of two stays itself); a kept state of 4
    sequences, 13 positions and 6 new tokens is 4 rows, 16 wide, 8 new tokens; an engine
    without keep_state keeps nothing."""
    assert [engine_mod._pow2(x) for x in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 32]
    reqs, sp_ = _fixed(4, 300, 7), sp(6, eos=-1)
    kept = engine(InvariantOps, keep_state=True, kv_blocks=64)
    kept.generate(reqs, sp_)
    st = kept._kept
    assert (st.rows, st.width, st.max_new) == (4, 16, 8)
    assert tuple(st.bufs.tokens.shape) == (5, 16) and tuple(st.bufs.logprobs.shape) == (5, 8)
    plain = engine(InvariantOps, kv_blocks=64)
    plain.generate(reqs, sp_)
    assert plain._kept is None and not plain.stats["kept_state"]


def test_calls_at_the_kept_sizes_reuse_the_state():
    """A call exactly as large as the kept state (4 rows, 16 positions, 8 new tokens; or the
    CPU default pool's 1 block for 16 written positions) reuses it, with fresh-engine bytes."""
    for kw, first, second in ((dict(kv_blocks=64), (_fixed(3, 320, 7), 6), (_fixed(4, 330, 8), 8)),
                              ({}, (_fixed(1, 340, 9), 8), (_fixed(1, 350, 9), 8))):
        kept = engine(InvariantOps, decode_graphs="padded", keep_state=True, **kw)
        states = []
        for reqs, m in (first, second):
            sp_ = sp(m, eos=-1)
            assert [bits(c) for c in kept.generate(reqs, sp_)] == _fresh("padded", reqs, sp_,
                                                                         **kw)
            states.append(kept._kept)
        assert states[1] is states[0]


# (first call, second call, engine keywords): the second outgrows the first's rounded-up state
# in one dimension only — sequences (1 -> rows 1; 3), positions (9 -> 16; 18), new tokens (24
# positions -> 32 wide, 4 new; 13 positions, 8 new), or, with the CPU default pool (the first
# call's 1 block), KV blocks (17 positions -> 1 block, 32 wide; 29 positions -> 2 blocks).
_OUTGROW = {
    "sequences": ((_fixed(1, 400, 5), 4), (_fixed(3, 410, 5), 4), dict(kv_blocks=64)),
    "positions": ((_fixed(2, 420, 5), 4), (_fixed(2, 430, 14), 4), dict(kv_blocks=64)),
    "new_tokens": ((_fixed(2, 440, 20), 4), (_fixed(2, 450, 5), 8), dict(kv_blocks=64)),
    "blocks": ((_fixed(1, 460, 13), 4), (_fixed(1, 470, 25), 4), {}),
}


@pytest.mark.parametrize("dim", list(_OUTGROW))
def test_a_call_outgrowing_one_dimension_gets_a_new_state(dim):
    (reqs1, m1), (reqs2, m2), kw = _OUTGROW[dim]
    kept = engine(InvariantOps, decode_graphs="padded", keep_state=True, **kw)
    sp1, sp2 = sp(m1, eos=-1), sp(m2, eos=-1)
    assert [bits(c) for c in kept.generate(reqs1, sp1)] == _fresh("padded", reqs1, sp1, **kw)
    first = kept._kept
    # The state is chosen before the call runs: a reused pool too small for the call's longest
    # sequence would not raise but never finish (the scheduler cannot place it).
    assert kept._state_for(kept._sequences(reqs2, sp2), sp2) is not first
    assert [bits(c) for c in kept.generate(reqs2, sp2)] == _fresh("padded", reqs2, sp2, **kw)
    assert kept._kept is not first


def test_kept_pool_is_what_the_call_can_use_sized_without_the_old_pool():
    """keep_state sizes its pool like a per-call one: what the call that makes it can use,
    within the budget (kv_blocks, or F·free on CUDA, stood in on CPU) — the whole budget would
    starve a trainer sharing the GPU; a call that outgrows the state frees the old pool before
    sizing the new one (free memory here = 20 blocks minus the kept pool's: sized with the old
    pool still held, the second call's pool would get 4 blocks, too few for its longest
    sequence's 5, instead of 10)."""
    reqs, sp_ = _CALLS[0]
    kept = engine(InvariantOps, keep_state=True, kv_blocks=64)
    kept.generate(reqs, sp_)
    plain = engine(InvariantOps, kv_blocks=64)
    plain.generate(reqs, sp_)
    assert kept.stats["pool_blocks"] == plain.stats["pool_blocks"] < 64
    e = engine(InvariantOps, keep_state=True, gpu_memory_utilization=0.5)
    per = PagedKVCache.bytes_per_block(e.cfg.num_hidden_layers, e.block, e._kv_heads(),
                                       e.cfg.head_dim, e.model.compute_dtype)
    e._free_bytes = lambda: (20 - (e._kept.cache.blocks + 2 if e._kept else 0)) * per
    for reqs, sp_ in (_CALLS[0], _CALLS[3]):                  # the second outgrows the first
        assert [bits(c) for c in e.generate(reqs, sp_)] == _fresh("eager", reqs, sp_)
        assert e.stats["pool_blocks"] == 10 and e.stats["kept_state"]


_SP_CHANGES = {"temperature": 1.3, "top_p": 0.5, "seed": 12, "eos_id": -1, "max_new_tokens": 6}


@pytest.mark.parametrize("field", list(_SP_CHANGES))
def test_each_recorded_sampling_param_remakes_the_graphs(field):
    """A kept state's decode graphs are remade when any one sampling param they record changes
    (temperature, top_p, seed, eos_id) and only then (not for max_new_tokens), for the state's
    full size (a later, larger call on the same params uses them); per call the samples and
    graph steps equal a fresh engine's."""
    base = sp(8, eos=100, top_p=0.9)
    changed = dataclasses.replace(base, **{field: _SP_CHANGES[field]})
    kept = engine(InvariantOps, decode_graphs="padded", keep_state=True, kv_blocks=64)
    calls = [(requests(5, start=10), base), (requests(5, start=10)[3:], changed),  # 13: EOS
             (requests(5, start=510), changed)]
    graphs = []
    for reqs, sp_ in calls:
        want, stats = _fresh_run("padded", reqs, sp_)
        assert [bits(c) for c in kept.generate(reqs, sp_)] == want
        assert kept.stats["graph_steps"] == stats["graph_steps"] > 0
        graphs.append(kept._kept.graphs)
    assert (graphs[1] is graphs[0]) == (field == "max_new_tokens") and graphs[2] is graphs[1]
    assert _fresh("padded", *calls[1]) != _fresh("padded", calls[1][0], base)   # it matters


def test_prepare_stops_at_max_seqs():
    """prepare makes the buckets of at most max_seqs sequences (a step never runs more)."""
    kept = engine(InvariantOps, decode_graphs="padded", keep_state=True, kv_blocks=64,
                  max_seqs=2)
    reqs, sp_ = _CALLS[0]
    kept.prepare(reqs, sp_)
    assert kept._kept.graphs.used == [1, 2]
    assert [bits(c) for c in kept.generate(reqs, sp_)] == _fresh("padded", reqs, sp_,
                                                                 max_seqs=2)
    assert kept._kept.graphs.used == [1, 2]


def test_a_call_after_a_failed_one_starts_clean():
    """A call that raises on non-finite logprobs (a NaN norm weight in layer 0's MLP: NaN K/V
    in layer 1 of the kept pool, the non-finite flag set) leaves a kept state that the next
    call, with good weights, reuses: it resets the flag and reads none of the stale NaN keys."""
    kept = engine(InvariantOps, decode_graphs="padded", keep_state=True, kv_blocks=64)
    reqs, sp_ = _CALLS[0]
    name = "model.layers.0.post_attention_layernorm.weight"
    kept.load_weights({**W, name: torch.full_like(W[name], float("nan"))})
    with pytest.raises(ValueError, match="logprobs contain NaN"):
        kept.generate(reqs, sp_)
    st = kept._kept
    assert bool(st.bufs.bad) and any(bool(p.isnan().any()) for p in st.cache.k)
    kept.load_weights(W)
    for reqs, sp_ in _CALLS[:2]:
        assert [bits(c) for c in kept.generate(reqs, sp_)] == _fresh("padded", reqs, sp_)
        assert kept._kept is st
