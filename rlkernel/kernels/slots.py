"""Moves between a token stream [L, ...] and per-sample slots [S, T, ...] through a slot map.

A slot map idx [S, T] names the stream row of slot t of sample s (−1 = empty slot). The moves are
copies only (a gather and a masked fill, a zero fill and an index copy), so they change no bit,
and use no boolean indexing, so no host sync on CUDA. Used by the model's layouts
(model/layout.py `to_samples` / `to_stream`) and by attention on packed streams
(kernels/attention.py: the CPU path and dK/dV's way back to the stream).
Does not: decide the map (model/layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotMoves:
    """Index tensors of one slot map idx [S, T] (−1 = empty) and a stream of n_rows rows:
    gather [S·T] (stream row of each slot, empty -> 0), valid [S, T] and its negation empty,
    scatter [S·T] (stream row of each slot, empty -> the dump row n_rows)."""

    idx: torch.Tensor
    gather: torch.Tensor
    valid: torch.Tensor
    scatter: torch.Tensor
    n_rows: int
    empty: torch.Tensor


def slot_moves(idx: torch.Tensor, n_rows: int) -> SlotMoves:
    """The SlotMoves of idx [S, T] and a stream of n_rows rows."""
    valid = idx >= 0
    return SlotMoves(idx, idx.clamp(min=0).reshape(-1), valid,
                     torch.where(valid, idx, torch.full_like(idx, n_rows)).reshape(-1), n_rows,
                     ~valid)


def gather_slots(x: torch.Tensor, mv: SlotMoves) -> torch.Tensor:
    """[S, T, ...] slot view of stream rows x [n_rows, ...]: valid slots copy their row, empty
    ones +0. A gather and a masked fill, not boolean indexing: no data-dependent shape, so no host
    sync on CUDA (the rollout decode loop, the training backward)."""
    if x.shape[0] == 0:
        return x.new_zeros(mv.idx.shape + x.shape[1:])
    rows = x[mv.gather].view(mv.idx.shape + x.shape[1:])
    # in place on the fresh gather, with the mask of the layout: two launches, not three (a
    # zero scalar and a where), four times per layer and microbatch in training
    return rows.masked_fill_(mv.empty.view(mv.empty.shape + (1,) * (x.dim() - 1)), 0)


def scatter_slots(y: torch.Tensor, mv: SlotMoves) -> torch.Tensor:
    """Stream rows [n_rows, ...] of the slot view y [S, T, ...]: each valid slot's values at its
    row, rows no slot names +0. Empty slots land in an extra dump row (dropped): no boolean
    indexing, no host sync."""
    out = y.new_zeros((mv.n_rows + 1,) + y.shape[2:])
    out.index_copy_(0, mv.scatter, y.reshape((-1,) + y.shape[2:]))
    return out[:mv.n_rows]


def run_slot_map(first: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The slot map [S, T] of samples whose valid slots are consecutive stream rows from
    first[s] [S]: first[s] + t where valid [S, T], −1 elsewhere."""
    t = torch.arange(valid.shape[1], device=valid.device)
    return torch.where(valid, first[:, None] + t, torch.full_like(valid, -1, dtype=torch.long))
