"""Paged-KV bookkeeping: a free list of fixed-size blocks, reference counts, prompt-prefix sharing
and copy-on-write. Plain Python, no tensors.

A block holds B consecutive positions of one sequence, B = the attention's KV block at absolute
positions (spec.ATTN_KV_BLOCK on CPU, CUDA_ATTN_KV_BLOCK on CUDA), so logical block b of a sequence
is exactly the attention's block b. Which *physical* block holds it is bookkeeping only: attention
reads a sequence's keys through its block table in logical order (vLLM's PagedAttention, Kwon et
al., SOSP 2023, §4.2-4.4: block table, free list, reference counts, copy-on-write).

Prefix sharing: a block is registered under the exact prompt prefix it ends (a tuple of token ids,
so no hash can collide) once its K/V are computed; a later sample with the same prompt takes the
registered blocks by reference instead of computing them. K/V bytes depend only on (weights,
tokens, positions) — every kernel is row-invariant — so a shared block holds the bytes the sample
would have computed itself. The block with the prompt's last token may be partial: a sharer
recomputes that one token (its logits are needed to sample), and its first write into a block
that another sequence also holds copies the block first (copy-on-write).
Rollout CP: P pools, logical block b lives in pool b % P (the CP rank that stores it); the manager
tracks every pool on every rank, so all ranks make the same decisions.
Does not: touch tensors (the runner copies blocks the plan names), or decide what runs.
"""

from __future__ import annotations

import random
from collections import deque

from rlkernel.rollout.sequence import Sequence


class BlockManager:
    """Free lists, reference counts and the prefix registry of one `generate` call.

    blocks_per_pool: physical blocks per CP rank (>= 1). block: positions per block. pools: the
    rollout-CP size. Global block id = pool · blocks_per_pool + local index. shuffle_seed: permute
    each free list (tests: physical placement must not change a byte). share: prefix sharing on.
    """

    def __init__(self, blocks_per_pool: int, block: int, pools: int = 1,
                 shuffle_seed: int | None = None, share: bool = True) -> None:
        if blocks_per_pool < 1 or block < 1 or pools < 1:
            raise ValueError(f"BlockManager: blocks_per_pool {blocks_per_pool}, block {block}, "
                             f"pools {pools} must all be >= 1")
        self.n, self.block, self.pools, self.share = blocks_per_pool, block, pools, share
        self.free: list[deque[int]] = []
        for p in range(pools):
            ids = list(range(p * blocks_per_pool, (p + 1) * blocks_per_pool))
            if shuffle_seed is not None:
                random.Random(shuffle_seed * 1009 + p).shuffle(ids)
            self.free.append(deque(ids))
        self.ref = [0] * (pools * blocks_per_pool)
        self.registry: dict[tuple[int, ...], int] = {}
        self.key_of: dict[int, tuple[int, ...]] = {}
        self.peak_used = 0
        self.shared_refs = 0      # blocks taken by reference instead of allocated
        self.cow_copies = 0

    # -- queries -----------------------------------------------------------------------------
    def pool_of(self, logical: int) -> int:
        return logical % self.pools

    def local(self, block_id: int) -> int:
        """Index of a global block id inside its pool's storage."""
        return block_id % self.n

    @property
    def used(self) -> int:
        return self.pools * self.n - sum(len(f) for f in self.free)

    def blocks_for(self, positions: int) -> list[int]:
        """Blocks per pool that a sequence of `positions` positions needs on its own."""
        need = [0] * self.pools
        for b in range(-(-positions // self.block)):
            need[self.pool_of(b)] += 1
        return need

    def _needs(self, seq: Sequence, start: int, n: int) -> list[int]:
        """New blocks per pool to write positions [start, start + n): blocks past the table and
        copies of blocks another sequence also holds."""
        need = [0] * self.pools
        for b in range(start // self.block, (start + n - 1) // self.block + 1):
            if b >= len(seq.blocks) or self.ref[seq.blocks[b]] > 1:
                need[self.pool_of(b)] += 1
        return need

    def can_write(self, seq: Sequence, start: int, n: int) -> bool:
        return all(k <= len(f) for k, f in zip(self._needs(seq, start, n), self.free))

    def prefix_key(self, seq: Sequence, b: int) -> tuple[int, ...] | None:
        """Registry key of the sequence's logical block b: the prompt prefix it ends (None past
        the prompt: generated tokens are never shared)."""
        if b * self.block >= len(seq.prompt):
            return None
        return seq.prompt[:min((b + 1) * self.block, len(seq.prompt))]

    def lookup(self, seq: Sequence) -> list[int]:
        """Registered blocks covering the longest shareable prefix of seq's prompt."""
        if not self.share:
            return []
        out = []
        for b in range(-(-len(seq.prompt) // self.block)):
            bid = self.registry.get(self.prefix_key(seq, b))
            if bid is None:
                break
            out.append(bid)
        return out

    # -- changes -----------------------------------------------------------------------------
    def _take(self, pool: int) -> int:
        bid = self.free[pool].popleft()
        self.ref[bid] = 1
        return bid

    def attach(self, seq: Sequence, shared: list[int]) -> None:
        """Give an empty sequence the shared prefix blocks; its cached count becomes what they
        cover, but at most num_tokens - 1 (the last token is always fed, to get its logits)."""
        assert not seq.blocks and seq.n_computed == 0
        for bid in shared:
            self.ref[bid] += 1
        self.shared_refs += len(shared)
        seq.blocks = list(shared)
        seq.n_computed = min(len(shared) * self.block, len(seq.prompt), seq.num_tokens - 1)

    def prepare_write(self, seq: Sequence, start: int, n: int) -> list[tuple[int, int]]:
        """Make positions [start, start + n) writable: allocate blocks past the table, copy shared
        ones. Returns the (source, destination) block copies the runner must do before the write.
        Call only after can_write."""
        copies = []
        for b in range(start // self.block, (start + n - 1) // self.block + 1):
            if b >= len(seq.blocks):
                seq.blocks.append(self._take(self.pool_of(b)))
            elif self.ref[seq.blocks[b]] > 1:
                src = seq.blocks[b]
                self.ref[src] -= 1
                seq.blocks[b] = self._take(self.pool_of(b))
                copies.append((src, seq.blocks[b]))
                self.cow_copies += 1
        self.peak_used = max(self.peak_used, self.used)
        return copies

    def register(self, seq: Sequence) -> None:
        """Offer the sequence's computed prompt blocks for sharing."""
        if not self.share:
            return
        for b, bid in enumerate(seq.blocks):
            if bid in self.key_of:
                continue
            key = self.prefix_key(seq, b)
            if key is None or seq.n_computed < len(key):
                return
            if key not in self.registry:
                self.registry[key] = bid
                self.key_of[bid] = key

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references; a block nobody holds returns to its free list."""
        for bid in seq.blocks:
            self.ref[bid] -= 1
            if self.ref[bid] == 0:
                key = self.key_of.pop(bid, None)
                if key is not None:
                    del self.registry[key]
                self.free[bid // self.n].append(bid)
        seq.blocks = []
        seq.n_computed = 0
