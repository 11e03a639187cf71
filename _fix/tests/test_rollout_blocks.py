"""Paged-KV bookkeeping and the continuous-batching scheduler, without a model (no tensors).

Properties: the free list, reference counts and copy-on-write keep every block held by exactly
the sequences that use it and return it when the last one lets go; prompt prefixes are shared
only on an exact token match and only once computed; a step never feeds more than its token
budget nor runs more than max_seqs sequences; sequences join as soon as blocks and budget allow
and leave (freeing blocks) the step they finish; a short pool preempts instead of failing.
Run: `.venv/bin/python -m pytest -q tests/test_rollout_blocks.py`.
"""

from __future__ import annotations

import pytest

from rlkernel.rollout.block_manager import BlockManager
from rlkernel.rollout.scheduler import Scheduler
from rlkernel.rollout.sequence import Sequence


def _seq(slot, prompt, max_new=4):
    return Sequence(slot, 100 + slot, tuple(prompt), max_new)


def _drive(sched: Scheduler, max_steps: int = 10_000, retired: list | None = None):
    """Run the scheduler as the engine does (every planned chunk 'computed'); yield plans.
    retired: gets, per step, the slots that finished in it."""
    for _ in range(max_steps):
        if not sched.has_work():
            return
        plan = sched.schedule()
        yield plan
        done = sched.postprocess(plan)
        if retired is not None:
            retired.append([s.slot for s in done])
    raise AssertionError("scheduler made no progress")


def test_alloc_free_refcount_and_copy_on_write():
    """Blocks come from the free list, return to it when no sequence holds them; a write into a
    block two sequences hold copies it first (the writer gets a fresh block, the other keeps
    the original)."""
    bm = BlockManager(6, 4)
    a = _seq(0, range(10))
    assert bm.can_write(a, 0, 10)
    assert bm.prepare_write(a, 0, 10) == []
    assert len(a.blocks) == 3 and bm.used == 3
    a.n_computed = 10
    bm.register(a)                       # blocks [0,4), [4,8) full; [8,10) = the whole prompt
    b = _seq(1, range(10))
    shared = bm.lookup(b)
    assert shared == a.blocks
    bm.attach(b, shared)
    assert b.n_computed == 9             # the last prompt token is recomputed for its logits
    assert [bm.ref[x] for x in a.blocks] == [2, 2, 2] and bm.used == 3
    copies = bm.prepare_write(b, 9, 1)   # first write lands in the shared block 2: copy it
    assert copies == [(a.blocks[2], b.blocks[2])] and b.blocks[2] != a.blocks[2]
    assert b.blocks[:2] == a.blocks[:2] and bm.ref[a.blocks[2]] == 1 and bm.used == 4
    bm.release(a)
    assert bm.used == 3 and all(bm.ref[x] == 1 for x in b.blocks)
    bm.release(b)
    assert bm.used == 0 and bm.registry == {} and sorted(sum(map(list, bm.free), [])) == list(range(6))


def test_prefix_lookup_is_exact_and_only_after_compute():
    """Lookup matches the exact prompt prefix (a different token in block 1 shares block 0 only)
    and only blocks whose K/V are computed are offered."""
    bm = BlockManager(8, 4)
    a = _seq(0, range(12))
    bm.prepare_write(a, 0, 12)
    assert bm.lookup(_seq(1, range(12))) == []          # nothing computed yet
    a.n_computed = 6
    bm.register(a)
    assert bm.lookup(_seq(1, range(12))) == a.blocks[:1]
    a.n_computed = 12
    bm.register(a)
    assert bm.lookup(_seq(1, range(12))) == a.blocks
    other = list(range(12))
    other[5] = 99
    assert bm.lookup(_seq(2, other)) == a.blocks[:1]
    assert bm.lookup(_seq(3, range(11))) == a.blocks[:2]   # its last block is [8, 11): no match
    assert BlockManager(8, 4, share=False).lookup(_seq(1, range(12))) == []


def test_shuffled_free_list_places_blocks_elsewhere():
    """block_shuffle permutes placement (what the engine's placement test relies on)."""
    tables = []
    for seed in (None, 1, 2):
        bm = BlockManager(16, 4, shuffle_seed=seed)
        s = _seq(0, range(30))
        bm.prepare_write(s, 0, 30)
        tables.append(s.blocks)
    assert tables[0] == list(range(8)) and len({tuple(t) for t in tables}) == 3


def test_cp_pools_hold_block_b_on_rank_b_mod_p():
    """Rollout CP: logical block b of every sequence comes from pool b % P."""
    bm = BlockManager(5, 4, pools=2)
    s = _seq(0, range(30))
    bm.prepare_write(s, 0, 30)
    assert [x // 5 for x in s.blocks] == [b % 2 for b in range(8)]
    assert bm.blocks_for(30) == [4, 4] and bm.blocks_for(5) == [1, 1] and bm.blocks_for(4) == [1, 0]


@pytest.mark.parametrize("kw", [dict(blocks_per_pool=0, block=4), dict(blocks_per_pool=4, block=0),
                                dict(blocks_per_pool=4, block=4, pools=0)])
def test_bad_pool_shape_is_refused(kw):
    with pytest.raises(ValueError, match="must all be >= 1"):
        BlockManager(**kw)


def test_token_budget_and_max_seqs_hold_every_step():
    """No step feeds more than max_step_tokens or runs more than max_seqs sequences, every
    position of every sequence is fed exactly once (no preemption here), and each sequence
    samples max_new tokens."""
    seqs = [_seq(i, range(3 + 5 * i), max_new=6) for i in range(7)]
    sched = Scheduler(seqs, BlockManager(100, 4, share=False), max_step_tokens=9, max_seqs=3)
    fed = {s.slot: [] for s in seqs}
    mixed = False
    for plan in _drive(sched):
        assert sum(c.n for c in plan.chunks) <= 9
        assert len(sched.running) <= 3
        for c in plan.chunks:
            fed[c.seq.slot] += range(c.start, c.start + c.n)
        mixed |= any(c.n == 1 for c in plan.chunks) and any(c.n > 1 for c in plan.chunks)
    for s in seqs:
        assert fed[s.slot] == list(range(len(s.prompt) + 5)) and s.n_generated == 6
    assert mixed, "a step should mix a prefill chunk with decodes"
    assert sched.bm.used == 0


def test_sequences_join_when_others_leave():
    """max_seqs=2: the third sequence is admitted in the step right after one finishes, into
    a batch that is still running (continuous batching, not a static batch)."""
    seqs = [_seq(0, range(4), max_new=2), _seq(1, range(4), max_new=8), _seq(2, range(4), 3)]
    sched = Scheduler(seqs, BlockManager(100, 4, share=False), max_step_tokens=64, max_seqs=2)
    retired: list[list[int]] = []
    list(_drive(sched, retired=retired))
    adm = {slot: (step, running) for step, slot, running in sched.admissions}
    finish_0 = next(i for i, r in enumerate(retired) if 0 in r)
    assert finish_0 == 1 and adm[2] == (finish_0 + 1, 1)
    assert adm[0] == (0, 0) and adm[1] == (0, 1)


def test_short_pool_preempts_and_still_finishes():
    """A pool of 4 blocks where one sequence needs 3: two are admitted (2 blocks each), the later
    one is preempted when the first needs its third block (recomputed later); none
    fails, and all finish with every block returned."""
    seqs = [_seq(i, range(6), max_new=7) for i in range(4)]
    sched = Scheduler(seqs, BlockManager(4, 4, share=False), max_step_tokens=64, max_seqs=4)
    list(_drive(sched))
    assert sched.preemptions > 0
    assert all(s.finished and s.n_generated == 7 for s in seqs) and sched.bm.used == 0


def test_group_prompt_is_prefilled_once():
    """Eight samples of one prompt: the prompt's positions are fed once (the others feed only
    its last token, to sample), their full blocks are shared, and each sharer copies the
    partial last block at its first write."""
    prompt = range(10)                        # blocks [0,4) [4,8) full, [8,10) partial
    seqs = [_seq(i, prompt, max_new=3) for i in range(8)]
    sched = Scheduler(seqs, BlockManager(100, 4), max_step_tokens=256, max_seqs=8)
    prompt_fed = 0
    for plan in _drive(sched):
        prompt_fed += sum(max(0, min(c.start + c.n, 10) - c.start) for c in plan.chunks)
    assert prompt_fed == 10 + 7 * 1
    assert sched.bm.shared_refs == 7 * 3 and sched.bm.cow_copies == 7


def test_retire_removes_a_waiting_sequence_and_frees_nothing_twice():
    """An EOS found for a preempted (waiting) sequence retires it from the queue."""
    seqs = [_seq(0, range(6), max_new=7), _seq(1, range(6), max_new=7)]
    sched = Scheduler(seqs, BlockManager(10, 4), max_step_tokens=64, max_seqs=1)
    sched.postprocess(sched.schedule())
    assert seqs[1] in sched.waiting
    sched.retire(seqs[1])
    assert seqs[1].finished and seqs[1] not in sched.waiting and sched.bm.used == 2
    list(_drive(sched))
    assert seqs[0].n_generated == 7 and seqs[1].n_generated == 0 and sched.bm.used == 0
