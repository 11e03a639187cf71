"""How each logical Qwen3 parameter is split across TP ranks (one table, STYLE.md §9).

- column-parallel (q/k/v, gate/up, embedding and LM head rows = vocab-parallel): dim 0 split into
  TP equal contiguous parts — rank r owns virtual-TP shards [r·8/t, (r+1)·8/t);
- row-parallel (o_proj, down_proj): dim 1 split the same way;
- k/v when TP exceeds the KV heads: rank r holds its KV head whole (replicated over t/Hkv ranks)
  but *owns* (for the dX tree) only rows [⌊r·N/t⌋, ⌊(r+1)·N/t⌋) of the logical tensor;
- norms: replicated.
The dX tree of a column-parallel weight cuts its N logical rows into VIRTUAL_TP virtual shards by
`kernels.matmul.virtual_shard_rows` (floor bounds, so N = kv_heads·head_dim need not be a multiple
of 8); `dx_shard_rows` gives a rank the local rows of each shard it owns.
`local_tensor` cuts a logical tensor for a rank; `logical_tensor` reassembles it from all ranks'
shards (exact, rank order). Does not: communicate by itself (the caller passes the gathered list).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkernel.kernels.matmul import virtual_shard_rows
from rlkernel.model.config import VIRTUAL_TP, Qwen3Config


@dataclass(frozen=True)
class Shard:
    """kind: 'rows' | 'cols' | 'kv' | 'replicated'; start/stop along the split dim (this rank)."""

    kind: str
    start: int
    stop: int


def kv_replicas(cfg: Qwen3Config, tp: int) -> int:
    """TP ranks that hold each KV head (1 when the KV heads are split)."""
    return max(1, tp // cfg.num_key_value_heads)


_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")


def _leaf(name: str) -> str:
    return name.rsplit(".", 2)[-2] if name.endswith(".weight") else name


def _rows(leaf: str, cfg: Qwen3Config) -> int:
    return {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size,
            "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}.get(
                leaf, cfg.vocab_size)


def shard_of(name: str, cfg: Qwen3Config, tp: int, r: int) -> Shard:
    """This rank's part of logical parameter `name` (Hugging Face name)."""
    leaf = _leaf(name)
    if leaf in ("o_proj", "down_proj"):
        k = cfg.q_size if leaf == "o_proj" else cfg.intermediate_size
        return Shard("cols", r * k // tp, (r + 1) * k // tp)
    if leaf in ("k_proj", "v_proj") and tp > cfg.num_key_value_heads:
        head, d = r // kv_replicas(cfg, tp), cfg.head_dim
        return Shard("kv", head * d, (head + 1) * d)
    if leaf in _COLUMN:
        n = _rows(leaf, cfg)
        return Shard("rows", r * n // tp, (r + 1) * n // tp)
    return Shard("replicated", 0, 0)


def dx_shard_rows(name: str, cfg: Qwen3Config, tp: int, r: int) -> tuple[tuple[int, int], ...]:
    """Local (start, stop) rows of each of the VIRTUAL_TP/tp virtual shards TP rank r owns in the
    dX tree of column-parallel weight `name`: virtual shard v (v = r·8/t + s) holds the logical
    rows virtual_shard_rows(N)[v], here shifted to this rank's local tensor. For a replicated KV
    head those rows lie inside the head, so the ranks sharing a head own disjoint parts of it.
    Raises ValueError for a parameter that is not column-parallel.
    """
    leaf = _leaf(name)
    if leaf not in _COLUMN:
        raise ValueError(f"dx_shard_rows: {name} is not a column-parallel weight")
    per = VIRTUAL_TP // tp
    start = shard_of(name, cfg, tp, r).start
    bounds = virtual_shard_rows(_rows(leaf, cfg))[r * per:(r + 1) * per]
    return tuple((a - start, b - start) for a, b in bounds)


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
