"""Continuous batching: which sequences feed which tokens in the next engine step. No tensors.

Iteration-level scheduling (Orca, Yu et al., OSDI 2022, §3: sequences join and leave the batch
every step) under a per-step token budget, with prefill chunks and decodes in one step (chunked
prefill; decodes first so running samples keep moving). A step entry says: sequence s feeds its
positions [start, start + n); when start + n reaches its token count, the step samples its next
token. The plan never changes a byte of any sample: every kernel is row-invariant and reads keys
at absolute positions, so a sample's bytes do not depend on which step, batch or chunk its
positions were computed in, or on whether they were computed twice (preemption recomputes).

Order of a step: (1) running sequences in admission order, each its next chunk (a decode is a
chunk of 1), preempting the most recently admitted sequence when blocks run out (its blocks are
freed and it goes back to the front of the queue, to be recomputed: vLLM's recompute preemption,
Kwon et al. 2023 §4.5); (2) waiting sequences are admitted while the budget, the sequence limit
and the free blocks allow. A waiting sample whose prompt another running sample is still
prefilling waits for it, so the prompt is prefilled once and shared (block_manager.py).
Does not: sample, read token values, or touch the device.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rlkernel.rollout.block_manager import BlockManager
from rlkernel.rollout.sequence import Sequence


@dataclass(frozen=True)
class Chunk:
    """Sequence `seq` feeds positions [start, start + n); `samples`: the step samples its next
    token (start + n == seq.num_tokens)."""

    seq: Sequence
    start: int
    n: int
    samples: bool


@dataclass
class StepPlan:
    """One engine step: the chunks, and the block copies (src, dst) to do before it runs."""

    chunks: list[Chunk]
    copies: list[tuple[int, int]]

    @property
    def is_decode(self) -> bool:
        """Every chunk feeds one token and samples, and no block is copied first."""
        return (bool(self.chunks) and not self.copies
                and all(c.n == 1 and c.samples for c in self.chunks))


class Scheduler:
    """Waiting and running queues over one BlockManager.

    max_step_tokens: tokens fed per step (all chunks together), >= 1. max_seqs: sequences in the
    running batch, >= 1. prefill_chunk: max tokens one sequence feeds per step (None: budget).
    """

    def __init__(self, seqs: list[Sequence], blocks: BlockManager, max_step_tokens: int,
                 max_seqs: int, prefill_chunk: int | None = None) -> None:
        self.waiting: deque[Sequence] = deque(seqs)
        self.running: list[Sequence] = []
        self.bm = blocks
        self.max_step_tokens, self.max_seqs = max_step_tokens, max_seqs
        self.prefill_chunk = prefill_chunk or max_step_tokens
        self.preemptions = 0
        self.steps = 0
        self.admissions: list[tuple[int, int, int]] = []
        """(step, slot, sequences already running) of every admission, in order."""

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_tokens - seq.n_computed, budget, self.prefill_chunk)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.release(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def schedule(self) -> StepPlan:
        budget = self.max_step_tokens
        chunks: list[Chunk] = []
        copies: list[tuple[int, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk_len(seq, budget)
            while not self.bm.can_write(seq, seq.n_computed, n):
                victim = self.running[-1]          # latest admitted; never one already planned
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                copies += self.bm.prepare_write(seq, seq.n_computed, n)
                chunks.append(Chunk(seq, seq.n_computed, n, seq.n_computed + n == seq.num_tokens))
                budget -= n
                i += 1
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting.popleft()
            shared = self.bm.lookup(seq)
            if (self.bm.share and len(shared) * self.bm.block < len(seq.prompt)
                    and any(r.prefilling and r.prompt == seq.prompt for r in self.running)):
                skipped.append(seq)                # share the prompt once it is computed
                continue
            self.bm.attach(seq, shared)
            n = self._chunk_len(seq, budget)
            if not self.bm.can_write(seq, seq.n_computed, n):
                self.bm.release(seq)
                self.bm.shared_refs -= len(shared)
                self.waiting.appendleft(seq)
                break
            copies += self.bm.prepare_write(seq, seq.n_computed, n)
            self.admissions.append((self.steps, seq.slot, len(self.running)))
            self.running.append(seq)
            chunks.append(Chunk(seq, seq.n_computed, n, seq.n_computed + n == seq.num_tokens))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        self.steps += 1
        return StepPlan(chunks, copies)

    def postprocess(self, plan: StepPlan) -> list[Sequence]:
        """Advance the counts of a step that ran; retire sequences that reached max_new.
        Returns the sequences retired."""
        done = []
        for c in plan.chunks:
            c.seq.n_computed = c.start + c.n
            if c.start < len(c.seq.prompt):        # only prompt blocks are ever registered
                self.bm.register(c.seq)
            if c.samples:
                c.seq.n_generated += 1
                if c.seq.n_generated >= c.seq.max_new:
                    done.append(c.seq)
        for seq in done:
            self.retire(seq)
        return done

    def retire(self, seq: Sequence) -> None:
        """Finished (max_new reached, or an EOS found at a host check): free its blocks now."""
        if seq.finished:
            return
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:                  # preempted after its EOS was sampled
            self.waiting.remove(seq)
        self.bm.release(seq)
