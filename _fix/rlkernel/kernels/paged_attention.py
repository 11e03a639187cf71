"""Invariant causal GQA attention over a paged KV cache: keys read through a block table.

A sample's key block b (positions [b·B, (b+1)·B)) is pool block table[s, b] (vLLM's
PagedAttention, Kwon et al., SOSP 2023, §4.1). The result is byte-identical to
kernels/attention.py on the keys gathered in logical order, because the same blocks are visited
in the same order with the same operations:
- CUDA: the Triton forward kernel of kernels/triton_attention.py, compiled with PAGED (only the
  K/V addresses change; the pool's block size must be its KV_BLOCK);
- CPU (and anything else): gather the blocks in table order (`gather_blocks`), then
  kernels/attention.py's forward.
Shapes: q [S, Hq, Tq, D]; k_pool, v_pool [blocks, B, Hkv, D]; table [S, nb] long; q_pos [S, Tq]
long (−1 = empty slot); kv_len [S] long; tk (int) = keys each row may see (<= nb·B, host-known).
Does not: write the cache (rollout/kv_cache.py), backward (rollout only), CP (the cache
reassembles CP-sharded blocks by gathering).
"""

from __future__ import annotations

import torch

from rlkernel.kernels.attention import attention


def gather_blocks(pool: torch.Tensor, table: torch.Tensor, tk: int) -> torch.Tensor:
    """Keys of each row in logical order: pool [blocks, B, Hkv, D], table [S, nb] ->
    [S, Hkv, tk, D] (a copy; positions at or past a row's kv_len hold whatever the block held)."""
    return pool[table].flatten(1, 2)[:, :tk].transpose(1, 2)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    table: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor, scale: float,
                    tk: int) -> torch.Tensor:
    """Attention of q over each row's paged keys: [S, Hq, Tq, D] in q's dtype (see module doc).
    ValueError from the kernel on shapes or dtypes it cannot take."""
    if q.is_cuda:
        from rlkernel.kernels import triton_attention
        if k_pool.shape[1] == triton_attention.KV_BLOCK:
            return triton_attention.paged_attention_forward(q, k_pool, v_pool, table, q_pos,
                                                            kv_len, scale)[0]
    return attention(q, gather_blocks(k_pool, table, tk), gather_blocks(v_pool, table, tk),
                     q_pos, kv_len, scale)
