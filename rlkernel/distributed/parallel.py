"""Parallel context and the autograd pairs that move activations between layouts.

`ParallelCtx` is what a model layer receives instead of reading a global world (STYLE.md §4):
its TP group, the TP ranks sharing its KV head, its CP group, and how its token reductions are
finished (distributed/tokensum.py).
`ParallelCtx.single()` is the one-process context; TP1 and TP8 run the same code paths.

Autograd pairs (forward ↔ backward), every sum finished by the canonical tree (comm.py):
- enter_tp: copy ↔ tree all-reduce over TP (no SP); all-gather ↔ tree reduce-scatter (SP).
  The column-parallel backward hands in its *local virtual-shard subtree* of dX; this finishes it.
- exit_row: tree all-reduce ↔ copy (no SP); tree reduce-scatter ↔ all-gather (SP).
- gather_vocab: all-gather of vocab-sharded logits along the vocab dim ↔ own slice.
- select_vocab_owner: exact owner pick of vocab-parallel embedding rows ↔ owner mask.
- sp_scatter: own sequence slice ↔ all-gather.
- cp_gather_stream: all-gather of CP-local streams into the logical stream ↔ own rows; the
  consumer (attention) finishes its own token reduction, so every rank already holds the whole grad.
CP layout: a stream of L rows (L a multiple of `stream_multiple`, so cuts fall between leaves) is
cut into 2·CP equal segments; CP rank r holds segments r and 2·CP−1−r (zig-zag, causal load balance, as
Megatron's CP), in that order, as its local stream.
Does not: create groups (topology.py) or shard parameters (model/sharding.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlkernel.distributed.comm import Comm
from rlkernel.distributed.tokensum import GradSink, TokenSum
from rlkernel.spec import TOKEN_LEAF


@dataclass(frozen=True)
class ParallelCtx:
    """tp: TP group; kv: TP ranks replicating this rank's KV head (size 1 if KV heads are split);
    cp: CP group; sp: sequence parallel on; tok: token reductions of the CP-local stream (other
    tokens on the CP ranks); tok_sp: of SP slices (other tokens on the TP×CP ranks; == tok when
    sp is off)."""

    tp: Comm
    kv: Comm
    cp: Comm
    sp: bool
    tok: TokenSum
    tok_sp: TokenSum
    dp: Comm = field(default_factory=lambda: Comm.single("dp"))
    """The DP group (same tp_rank and cp_rank); only native mode's SUM all-reduce uses it."""

    @classmethod
    def single(cls, sink: GradSink | None = None) -> "ParallelCtx":
        """The one-process context, with `sink` (default: a fresh one-process GradSink), so a
        one-process policy accumulates its gradients exactly like a distributed one."""
        tok = TokenSum(Comm.single("tokens"), "dp_cp", sink or GradSink.single())
        return cls(Comm.single("tp"), Comm.single("kv"), Comm.single("cp"), False, tok, tok)


class _Pair(torch.autograd.Function):
    """y = fwd(x), dx = bwd(dy): one layout move and its autograd partner."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g.contiguous()), None, None


def collective_pair(x: torch.Tensor, fwd, bwd) -> torch.Tensor:
    """Apply `fwd` to x, with `bwd` as its backward (both callables on one tensor)."""
    return _Pair.apply(x, fwd, bwd)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t.view_as(t)


def stream_multiple(pc: ParallelCtx, leaf: int = TOKEN_LEAF) -> int:
    """What a packed stream's length must be a multiple of under pc's CP/SP layout, so that every
    CP segment holds whole leaves of `leaf` (the backend's spec.stream_leaf: the matmul token
    reductions') and every SP slice whole TOKEN_LEAF leaves (norm weights):
    2·CP · max(leaf, TOKEN_LEAF · (TP under SP)) — powers of two, so a multiple of both."""
    return 2 * pc.cp.size * max(leaf, TOKEN_LEAF * (pc.tp.size if pc.sp else 1))


def cp_segments(cp: int, cp_rank: int) -> tuple[int, int]:
    """Segment ids (of 2·cp) held by CP rank `cp_rank`, in local-stream order (zig-zag)."""
    return (cp_rank, 2 * cp - 1 - cp_rank)


def rows_of_rank(t: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """This rank's equal slice of t along `dim` (rank order)."""
    n = t.shape[dim] // comm.size
    return t.narrow(dim, comm.rank * n, n).contiguous()


def cp_assemble(pc: ParallelCtx, parts: list[torch.Tensor]) -> torch.Tensor:
    """Logical stream from every CP rank's local stream (each: its segments in local order)."""
    n_seg = 2 * pc.cp.size
    by_id: list[torch.Tensor | None] = [None] * n_seg
    for r, p in enumerate(parts):
        segs = p.chunk(2, 0)
        for k, sid in enumerate(cp_segments(pc.cp.size, r)):
            by_id[sid] = segs[k]
    return torch.cat(by_id, 0)  # type: ignore[arg-type]


def cp_local_rows(pc: ParallelCtx, full: torch.Tensor) -> torch.Tensor:
    """This CP rank's local stream rows (its two zig-zag segments) of a logical-stream tensor."""
    if pc.cp.size == 1:
        return full
    segs = full.chunk(2 * pc.cp.size, 0)
    a, b = cp_segments(pc.cp.size, pc.cp.rank)
    return torch.cat([segs[a], segs[b]], 0)


def enter_tp(x: torch.Tensor, pc: ParallelCtx) -> torch.Tensor:
    tp = pc.tp
    if pc.sp:
        return collective_pair(x, lambda t: tp.all_gather_cat(t, "sp-gather", 0),
                               lambda g: tp.tree_reduce_scatter(g, "sp-reduce-scatter-dx", 0))
    # Applied at TP=1 too, so every topology builds the same autograd graph.
    return collective_pair(x, _identity, lambda g: tp.tree_all_reduce(g, "tp-all-reduce-dx"))


def exit_row(partial: torch.Tensor, pc: ParallelCtx) -> torch.Tensor:
    tp = pc.tp
    if pc.sp:
        return collective_pair(partial,
                               lambda t: tp.tree_reduce_scatter(t, "sp-reduce-scatter-y", 0),
                               lambda g: tp.all_gather_cat(g, "sp-gather-dy", 0))
    return collective_pair(partial, lambda t: tp.tree_all_reduce(t, "tp-all-reduce-y"), _identity)


def gather_vocab(z: torch.Tensor, pc: ParallelCtx) -> torch.Tensor:
    tp = pc.tp
    return collective_pair(z, lambda t: tp.all_gather_cat(t, "vocab-gather", 1),
                           lambda g: rows_of_rank(g, tp, 1))


def select_vocab_owner(x: torch.Tensor, owner: torch.Tensor, pc: ParallelCtx) -> torch.Tensor:
    """x [L, H] of every TP rank -> the owner rank's rows (owner [L] long), exact."""
    tp = pc.tp
    owner = owner.unsqueeze(-1).expand_as(x).contiguous()
    mine = owner == tp.rank
    return collective_pair(x, lambda t: tp.select_owner(t, owner, "vocab-owner"),
                           lambda g: g * mine.to(g.dtype))


def sp_scatter(x: torch.Tensor, pc: ParallelCtx) -> torch.Tensor:
    if not pc.sp:
        return x
    tp = pc.tp
    return collective_pair(x, lambda t: rows_of_rank(t, tp, 0),
                           lambda g: tp.all_gather_cat(g, "sp-scatter-bwd", 0))


def cp_gather_stream(x: torch.Tensor, pc: ParallelCtx) -> torch.Tensor:
    if pc.cp.size == 1:
        return x
    # The consumer (attention) finishes its token sum, so every rank holds the whole gradient.
    return collective_pair(x, lambda t: cp_assemble(pc, pc.cp.all_gather(t, "cp-gather")),
                           lambda g: cp_local_rows(pc, g))
