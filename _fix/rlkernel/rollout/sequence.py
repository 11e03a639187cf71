"""One request's bookkeeping inside the rollout engine: counts and a block table, no tensors.

The token *values* of a sequence live on the engine's device (the runner's token buffer, row
`slot`); the host only counts them. That is what lets the engine run without a host sync per
token: the scheduler needs how many tokens a sequence has and how many of them have K/V in the
cache, never which tokens they are (STYLE.md §8: sequence / block manager / scheduler are plain
Python; the model runner is the only part with tensors).
Does not: hold token ids that were sampled, or decide anything (rollout/scheduler.py does).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Sequence:
    """A sample being generated.

    slot: its row in the engine's device buffers (index of the request in the `generate` call).
    sample_id: global sample id (keys the sampling noise). prompt: prompt token ids.
    max_new: max_new_tokens of the call. n_generated: tokens sampled so far (host-known count).
    n_computed: leading positions whose K/V are in the cache. blocks: block table, global block
    ids in logical order (logical block b covers positions [b·B, (b+1)·B)).
    finished: retired (max_new reached, or an EOS seen at a host check).
    """

    slot: int
    sample_id: int
    prompt: tuple[int, ...]
    max_new: int
    n_generated: int = 0
    n_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    finished: bool = False

    @property
    def num_tokens(self) -> int:
        """Prompt + sampled tokens: the next token to sample sits at this position."""
        return len(self.prompt) + self.n_generated

    @property
    def prefilling(self) -> bool:
        """Prompt K/V not complete yet (another sample of the same prompt should wait to share)."""
        return self.n_computed < len(self.prompt)

    @property
    def capacity(self) -> int:
        """Positions this sequence may ever hold: prompt + max_new (the last sampled token's
        K/V is never needed, but a preempted sequence recomputes up to num_tokens - 1)."""
        return len(self.prompt) + self.max_new
