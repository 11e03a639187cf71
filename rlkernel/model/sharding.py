"""How each logical Qwen3 parameter is split across TP ranks (one table, STYLE.md §9).

- column-parallel (q/k/v, gate/up, embedding and LM head rows = vocab-parallel): dim 0 split into
  TP equal contiguous parts — rank r owns virtual-TP shards [r·8/t, (r+1)·8/t);
- row-parallel (o_proj, down_proj): dim 1 split the same way;
- k/v when TP exceeds the KV heads: rank r holds its KV head whole (replicated over t/Hkv ranks)
  but *owns* (for the dX tree) only rows [r·N/t, (r+1)·N/t) of the logical tensor;
- norms: replicated.
`local_tensor` cuts a logical tensor for a rank; `logical_tensor` reassembles it from all ranks'
shards (exact, rank order). Does not: communicate by itself (the caller passes the gathered list).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkernel.model.config import Qwen3Config


@dataclass(frozen=True)
class Shard:
    """kind: 'rows' | 'cols' | 'kv' | 'replicated'; start/stop along the split dim (this rank);
    own0/own1: rows this rank owns for the virtual-TP dX tree, relative to its local rows."""

    kind: str
    start: int
    stop: int
    own0: int = 0
    own1: int = 0


def kv_replicas(cfg: Qwen3Config, tp: int) -> int:
    """TP ranks that hold each KV head (1 when the KV heads are split)."""
    return max(1, tp // cfg.num_key_value_heads)


def shard_of(name: str, cfg: Qwen3Config, tp: int, r: int) -> Shard:
    """This rank's part of logical parameter `name` (Hugging Face name)."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name
    if leaf in ("o_proj", "down_proj"):
        k = cfg.q_size if leaf == "o_proj" else cfg.intermediate_size
        return Shard("cols", r * k // tp, (r + 1) * k // tp)
    if leaf in ("k_proj", "v_proj"):
        n = cfg.kv_size
        if tp <= cfg.num_key_value_heads:
            return Shard("rows", r * n // tp, (r + 1) * n // tp, 0, n // tp)
        rep = kv_replicas(cfg, tp)
        head = r // rep
        d = cfg.head_dim
        own0 = r * n // tp - head * d
        return Shard("kv", head * d, (head + 1) * d, own0, own0 + n // tp)
    if leaf in ("q_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"):
        n = {"q_proj": cfg.q_size, "gate_proj": cfg.intermediate_size,
             "up_proj": cfg.intermediate_size}.get(leaf, cfg.vocab_size)
        return Shard("rows", r * n // tp, (r + 1) * n // tp, 0, n // tp)
    return Shard("replicated", 0, 0)


def local_tensor(name: str, t: torch.Tensor, cfg: Qwen3Config, tp: int, r: int) -> torch.Tensor:
    """This rank's shard of logical tensor `t`."""
    s = shard_of(name, cfg, tp, r)
    if s.kind in ("rows", "kv"):
        return t[s.start:s.stop]
    if s.kind == "cols":
        return t[:, s.start:s.stop]
    return t


def logical_tensor(name: str, parts: list[torch.Tensor], cfg: Qwen3Config) -> torch.Tensor:
    """Reassemble a logical tensor from every TP rank's shard (rank order)."""
    tp = len(parts)
    kind = shard_of(name, cfg, tp, 0).kind
    if kind == "rows":
        return torch.cat(parts, 0)
    if kind == "cols":
        return torch.cat(parts, 1)
    if kind == "kv":
        return torch.cat(parts[::kv_replicas(cfg, tp)], 0)
    return parts[0]


def counts_for_norm(name: str, cfg: Qwen3Config, tp: int, r: int) -> bool:
    """Whether this TP rank's copy of `name` counts in the global gradient norm (each logical
    element exactly once: replicated tensors on rank 0, replicated KV heads on their first rank)."""
    kind = shard_of(name, cfg, tp, r).kind
    if kind == "replicated":
        return r == 0
    if kind == "kv":
        return r % kv_replicas(cfg, tp) == 0
    return True
