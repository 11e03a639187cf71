"""Paged K/V storage: per layer a pool of fixed-size blocks, read through per-row block tables.

Layout per layer: k, v [blocks + 2, B, Hkv, D] in the attention's dtype (bf16 for bf16 runs,
whose model rounds k and v to bf16 before attention; fp32 otherwise), so values are stored
exactly. Index `blocks` is a block of zeros (read
for positions this CP rank does not store), `blocks + 1` a dump that takes the writes of empty
query slots. The runner (rollout/engine.py) sets, before every forward, each attention row's
write slots and block table (`set_step`); `attend` writes the step's keys and attends over each
row's keys in logical order: through the block table (kernels/paged_attention.py: the Triton
kernel reads pool blocks in table order on CUDA) or on the blocks gathered in table order, so
position j sits at index j exactly as in the dense cache (vLLM PagedAttention, Kwon et al. 2023
§4.1). Entries at or past a row's kv_len may hold stale values from a block's earlier owner:
attention never reads them into a result (it skips keys at or past kv_len with a select,
kernels/attention.py; the Triton kernel does not load them).
Rollout CP: each rank stores only the blocks b with b % P == its rank (the block manager's pool);
`attend` reassembles a row's prefix by an exact owner pick across the CP group, then runs the
dense kernel.
No host sync: writes are index_copy_ into fixed slots, reads a gather; no data-dependent shapes.
Does not: decide placement (rollout/block_manager.py) or attend.
"""

from __future__ import annotations

import torch

from rlkernel.distributed.comm import Comm
from rlkernel.kernels.paged_attention import gather_blocks


class PagedKVCache:
    """blocks: physical blocks on this rank; block: positions per block (B). fused: attend
    through the block table (kernels/paged_attention.py) where the op set allows, instead of
    gathering the blocks first (same bytes; tests compare the two)."""

    def __init__(self, n_layers: int, blocks: int, block: int, kv_heads: int, head_dim: int,
                 device: torch.device | str = "cpu", comm: Comm | None = None,
                 fused: bool = True, dtype: torch.dtype = torch.float32) -> None:
        shape = (blocks + 2, block, kv_heads, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.blocks, self.block = blocks, block
        self.zero_block, self.dump_block = blocks, blocks + 1
        self.comm = comm or Comm.single("paged-kv-cache")
        self.slots = self.table = None
        self.tk = 0
        self.fused = fused

    @staticmethod
    def bytes_per_block(n_layers: int, block: int, kv_heads: int, head_dim: int,
                        dtype: torch.dtype = torch.float32) -> int:
        """K and V of one block over all layers, in `dtype` (the pool's)."""
        return n_layers * 2 * block * kv_heads * head_dim * dtype.itemsize

    def set_step(self, slots: torch.Tensor, table: torch.Tensor, tk: int) -> None:
        """slots [S, T] long: storage row (block · B + offset) of each query slot's K/V (the dump
        for empty slots and positions another CP rank stores); table [S, nb] long: local block of
        each logical block of each row (the zero block where absent); tk: keys to return (the
        longest kv_len of the step, host-known)."""
        self.slots, self.table, self.tk = slots, table, tk

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """Copy-on-write: for each (src, dst) row of pairs [n, 2] long, block dst := block src."""
        for pool in (*self.k, *self.v):
            pool.index_copy_(0, pairs[:, 1], pool.index_select(0, pairs[:, 0]))

    def attend(self, layer: int, ops, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
               lay, scale: float, pc, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Write this step's keys/values ks, vs [S, Hkv, T, D] (slot t of row s at slots[s, t]),
        then attend qs [S, Hq, T, D] over every row's keys of positions [0, kv_len): through the
        block table when the op set has `paged_attention` and the cache is not CP-sharded, else
        on the blocks gathered in logical order (the dense kernel). Returns [S, Hq, T, D].
        dtype: the model's compute dtype (what `ops.attention` computes in)."""
        for pool, x in ((self.k[layer], ks), (self.v[layer], vs)):
            flat = pool.view(-1, pool.shape[2], pool.shape[3])
            rows = x.detach().transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])
            flat.index_copy_(0, self.slots.reshape(-1), rows.to(pool.dtype))
        paged = getattr(ops, "paged_attention", None)
        if self.fused and paged is not None and self.comm.size == 1:
            return paged(qs, self.k[layer], self.v[layer], self.table, lay.q_pos, lay.kv_len,
                         scale, self.tk, pc)
        k, v = (gather_blocks(p, self.table, self.tk) for p in (self.k[layer], self.v[layer]))
        if self.comm.size > 1:
            pos = torch.arange(self.tk, device=k.device)
            owner = torch.div(pos, self.block, rounding_mode="floor") % self.comm.size
            owner = owner[None, None, :, None].expand_as(k).contiguous()
            # The owner pick moves fp32 (exact both ways): the collective keeps the dtype it
            # was tested with on gloo and NCCL, whatever the pool's dtype.
            k, v = (self.comm.select_owner(t.to(torch.float32).contiguous(), owner, op).to(t.dtype)
                    for t, op in ((k, "paged-kv-k"), (v, "paged-kv-v")))
        return ops.attention(qs, k, v, lay.q_pos, lay.kv_len, scale, pc, dtype)
