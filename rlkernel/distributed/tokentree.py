"""The canonical token tree split across ranks (CP zig-zag groups, SP slices).

A microbatch stream of L tokens (L % TOKEN_LEAVES == 0) has TOKEN_LEAVES fine leaves of
m = L / TOKEN_LEAVES tokens. Its tree is cut into `n_segments` aligned subtrees (segments) of
TOKEN_LEAVES / n_segments leaves. A rank owns whole segments and holds their tokens, in order,
as its local stream. It reduces each owned segment locally (tokens in order inside a leaf, the
pairwise tree over the segment's leaves), the segment values are all-gathered, and every rank
finishes the same tree over the segments in global order — so every token reduction equals the
single-process tree bit for bit, for every CP/SP layout (DESIGN.md §1, "Backward").

Layouts: CP size C gives 2C segments; CP rank r owns segments r and 2C−1−r (zig-zag, causal load
balance, as Megatron's CP). With SP over t TP ranks (t ≥ 2) every CP segment is cut into t/2
sub-segments and TP rank j of CP rank r owns sub-segment j of its first segment (j < t/2) or
j − t/2 of its second.
Does not: move activations (rlkernel/distributed/parallel.py does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkernel.distributed.comm import Comm
from rlkernel.numerics.trees import tree_combine, tree_sum
from rlkernel.spec import TOKEN_LEAVES


def cp_segments(cp: int, cp_rank: int) -> tuple[int, int]:
    """Global segment ids (of 2·cp) owned by CP rank `cp_rank`, in local-stream order."""
    return (cp_rank, 2 * cp - 1 - cp_rank)


def sp_segments(cp: int, cp_rank: int, tp: int, tp_rank: int) -> tuple[int, ...]:
    """Segment ids (of cp·tp, t ≥ 2) owned by (cp_rank, tp_rank) under SP; cp_segments if tp == 1."""
    if tp == 1:
        return cp_segments(cp, cp_rank)
    half = tp // 2
    a, b = cp_segments(cp, cp_rank)
    base = a if tp_rank < half else b
    return (base * half + tp_rank % half,)


@dataclass(frozen=True)
class TokenTree:
    """How this rank's local token stream sits in the canonical tree, and who finishes it.

    comm: the ranks that together hold the whole stream (each exactly once).
    n_segments: aligned subtrees the stream is cut into.
    owned: per comm rank, its global segment ids in local-stream order.
    """

    comm: Comm
    n_segments: int
    owned: tuple[tuple[int, ...], ...]

    @classmethod
    def single(cls) -> "TokenTree":
        return cls(Comm.single("tokens"), 1, ((0,),))

    @property
    def mine(self) -> tuple[int, ...]:
        return self.owned[self.comm.rank]

    @property
    def leaves_per_segment(self) -> int:
        return TOKEN_LEAVES // self.n_segments

    @property
    def local_leaves(self) -> int:
        return self.leaves_per_segment * len(self.mine)

    def global_leaf(self, local_leaf: int) -> int:
        """Global leaf index of local leaf `local_leaf`."""
        per = self.leaves_per_segment
        return self.mine[local_leaf // per] * per + local_leaf % per

    def finish(self, leaf_partials: torch.Tensor, op: str) -> torch.Tensor:
        """Sum of per-leaf partials [local_leaves, ...] over the whole stream -> [...], identical
        on every rank of `comm`."""
        per = self.leaves_per_segment
        seg = tree_sum(leaf_partials.reshape(len(self.mine), per, *leaf_partials.shape[1:]), 1)
        parts = self.comm.all_gather(seg, op)
        by_id: list[torch.Tensor | None] = [None] * self.n_segments
        for r, p in enumerate(parts):
            for k, sid in enumerate(self.owned[r]):
                by_id[sid] = p[k]
        return tree_sum(torch.stack(by_id), 0)  # type: ignore[arg-type]

    def finish_sparse(self, leaves: list[list[torch.Tensor | None]], shape, device, op: str):
        """Per item (e.g. per sample), the tree over global leaves where absent leaves are skipped.

        leaves: per item, a list of `local_leaves` entries (tensor of `shape` or None).
        Returns per item the finished tensor (zeros of `shape` if every leaf is absent).
        """
        n_items = len(leaves)
        per = self.leaves_per_segment
        vals = torch.zeros((n_items, len(self.mine)) + tuple(shape), device=device)
        present = torch.zeros(n_items, len(self.mine), dtype=torch.bool)
        for i, item in enumerate(leaves):
            for k in range(len(self.mine)):
                v = tree_combine(item[k * per:(k + 1) * per])
                if v is not None:
                    vals[i, k] = v
                    present[i, k] = True
        all_vals = self.comm.all_gather(vals, op + ":values")
        all_present = self.comm.all_gather(present, op + ":present")
        out = []
        for i in range(n_items):
            by_id: list[torch.Tensor | None] = [None] * self.n_segments
            for r in range(self.comm.size):
                for k, sid in enumerate(self.owned[r]):
                    if all_present[r][i, k]:
                        by_id[sid] = all_vals[r][i, k]
            tot = tree_combine(by_id)
            out.append(tot if tot is not None else torch.zeros(shape, device=device))
        return torch.stack(out)
