"""Parallel context and the autograd pairs that move activations between layouts.

`ParallelCtx` is what a model layer receives instead of reading a global world (STYLE.md §4):
its TP group, the TP ranks sharing its KV head, its CP group, and the token trees of its streams.
`ParallelCtx.single()` is the one-process context; TP1 and TP8 run the same code paths.

Autograd pairs (forward ↔ backward), every sum finished by the canonical tree (comm.py):
- enter_tp: copy ↔ tree all-reduce over TP (no SP); all-gather ↔ tree reduce-scatter (SP).
  The column-parallel backward hands in its *local virtual-shard subtree* of dX; this finishes it.
- exit_row: tree all-reduce ↔ copy (no SP); tree reduce-scatter ↔ all-gather (SP).
- gather_vocab: all-gather of vocab-sharded logits along the vocab dim ↔ own slice.
- select_vocab_owner: exact owner pick of vocab-parallel embedding rows ↔ owner mask.
- sp_scatter: own sequence slice ↔ all-gather.
- cp_gather_stream: all-gather of CP-local streams into the logical stream ↔ own rows; the
  consumer (attention) finishes its own token tree, so every rank already holds the whole grad.
Does not: create groups (topology.py) or shard parameters (model/sharding.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkernel.dist.comm import Comm
from rlkernel.dist.tokentree import TokenTree


@dataclass(frozen=True)
class ParallelCtx:
    """tp: TP group; kv: TP ranks replicating this rank's KV head (size 1 if KV heads are split);
    cp: CP group; sp: sequence parallel on; tok: token tree of the CP-local stream (finished over
    cp); tok_sp: token tree of SP slices (finished over tp×cp; == tok when sp is off)."""

    tp: Comm
    kv: Comm
    cp: Comm
    sp: bool
    tok: TokenTree
    tok_sp: TokenTree

    @classmethod
    def single(cls) -> "ParallelCtx":
        tree = TokenTree.single()
        return cls(Comm.single("tp"), Comm.single("kv"), Comm.single("cp"), False, tree, tree)


class _EnterTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pc: ParallelCtx):
        ctx.pc = pc
        if pc.sp:
            return pc.tp.all_gather_cat(x, "sp-gather", 0)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        pc = ctx.pc
        if pc.sp:
            return pc.tp.tree_reduce_scatter(g.contiguous(), "sp-reduce-scatter-dx", 0), None
        return pc.tp.tree_all_reduce(g.contiguous(), "tp-all-reduce-dx"), None


class _ExitRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, pc: ParallelCtx):
        ctx.pc = pc
        if pc.sp:
            return pc.tp.tree_reduce_scatter(partial, "sp-reduce-scatter-y", 0)
        return pc.tp.tree_all_reduce(partial, "tp-all-reduce-y")

    @staticmethod
    def backward(ctx, g):
        pc = ctx.pc
        if pc.sp:
            return pc.tp.all_gather_cat(g.contiguous(), "sp-gather-dy", 0), None
        return g, None


class _GatherVocab(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, pc: ParallelCtx):
        ctx.pc, ctx.n = pc, z.shape[1]
        return pc.tp.all_gather_cat(z, "vocab-gather", 1)

    @staticmethod
    def backward(ctx, g):
        r, n = ctx.pc.tp.rank, ctx.n
        return g[:, r * n:(r + 1) * n].contiguous(), None


class _SelectOwner(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner, pc: ParallelCtx):
        ctx.save_for_backward(owner)
        ctx.pc = pc
        return pc.tp.select_owner(x, owner, "vocab-owner")

    @staticmethod
    def backward(ctx, g):
        (owner,) = ctx.saved_tensors
        mine = (owner == ctx.pc.tp.rank).to(g.dtype)
        return g * mine, None, None


class _SPScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pc: ParallelCtx):
        ctx.pc = pc
        n = x.shape[0] // pc.tp.size
        return x[pc.tp.rank * n:(pc.tp.rank + 1) * n].clone()

    @staticmethod
    def backward(ctx, g):
        return ctx.pc.tp.all_gather_cat(g.contiguous(), "sp-scatter-bwd", 0), None


class _CPGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pc: ParallelCtx):
        ctx.pc, ctx.n = pc, x.shape[0]
        return cp_assemble(pc, pc.cp.all_gather(x.contiguous(), "cp-gather"))

    @staticmethod
    def backward(ctx, g):
        return cp_local_rows(ctx.pc, g), None


def cp_assemble(pc: ParallelCtx, parts: list[torch.Tensor]) -> torch.Tensor:
    """Logical stream from every CP rank's local stream (each: its segments in local order)."""
    n_seg = 2 * pc.cp.size
    by_id: list[torch.Tensor | None] = [None] * n_seg
    for r, p in enumerate(parts):
        segs = p.chunk(2, 0)
        for k, sid in enumerate(_cp_owned(pc.cp.size, r)):
            by_id[sid] = segs[k]
    return torch.cat(by_id, 0)  # type: ignore[arg-type]


def _cp_owned(cp: int, r: int) -> tuple[int, int]:
    return (r, 2 * cp - 1 - r)


def cp_local_rows(pc: ParallelCtx, full: torch.Tensor) -> torch.Tensor:
    """This CP rank's local stream rows (its two zig-zag segments) of a logical-stream tensor."""
    if pc.cp.size == 1:
        return full
    segs = full.chunk(2 * pc.cp.size, 0)
    a, b = _cp_owned(pc.cp.size, pc.cp.rank)
    return torch.cat([segs[a], segs[b]], 0)


def enter_tp(x: torch.Tensor, pc: ParallelCtx) -> torch.Tensor:
    return _EnterTP.apply(x, pc)


def exit_row(partial: torch.Tensor, pc: ParallelCtx) -> torch.Tensor:
    return _ExitRow.apply(partial, pc)


def gather_vocab(z: torch.Tensor, pc: ParallelCtx) -> torch.Tensor:
    return _GatherVocab.apply(z, pc)


def select_vocab_owner(x: torch.Tensor, owner: torch.Tensor, pc: ParallelCtx) -> torch.Tensor:
    """x [L, H] of every TP rank -> the owner rank's rows (owner [L] long), exact."""
    return _SelectOwner.apply(x, owner.unsqueeze(-1).expand_as(x).contiguous(), pc)


def sp_scatter(x: torch.Tensor, pc: ParallelCtx) -> torch.Tensor:
    return _SPScatter.apply(x, pc) if pc.sp else x


def cp_gather_stream(x: torch.Tensor, pc: ParallelCtx) -> torch.Tensor:
    return _CPGather.apply(x, pc) if pc.cp.size > 1 else x
