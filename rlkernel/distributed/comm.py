"""Deterministic collectives over one process group, with call validation.

Every floating-point reduction across ranks is finished by the *canonical tree*, never by the
backend's reduce: ranks exchange their aligned-subtree partials with an all-gather (exact bytes),
and every rank sums them by the same pairwise tree (rlkernel/numerics/trees.py), so all ranks hold
identical bits and the result equals the single-process tree (DESIGN.md §1). All-gathers
concatenate in logical (rank) order. The one backend reduction used is `sum_ints`, a SUM of
integers (exact fixed-point gradient accumulators): integer addition is associative, so the
backend's order cannot change the result. `sum_ints_finished` sums such accumulators by slices
and finishes (rounds) each slice on one rank, about half an all-reduce's bytes; `finish_words`
does the same with sums held as float64 double words (16 bytes an element, not 104).

Each call first exchanges a signature — call counter, operation name, shape, dtype — and raises
CollectiveMismatch naming both sides if any rank is making a different call, instead of hanging
or silently mixing tensors. Every wait is bounded by the process group's timeout.
A `Comm` of size 1 (`Comm.single`) runs the same code paths without a process group, so TP=1 and
TP=8 execute the same model code.
Does not: create groups or processes (rlkernel/distributed/topology.py, launch.py).
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from rlkernel.numerics.trees import tree_combine

_SIG_LEN = 14
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
           torch.bool, torch.uint8, torch.int16, torch.int8]


SLICED_MIN_ELEMS = 1 << 20
"""Partials of at least this many elements take tree_all_reduce's sliced form on more than two
ranks (below it, one gather's latency beats two calls' bandwidth: a decode step's rows)."""

INT_SLICED_MIN_ELEMS = 1 << 12
"""Integer accumulators of at least this many elements (4,096 elements: 416 KiB of fixed-point
digits) are summed and finished by slices in `sum_ints_finished`; below it one all-reduce's
latency wins (a norm weight's gradient)."""


def _summed(parts: list[torch.Tensor]) -> torch.Tensor:
    """Σ parts (at least two) into a new tensor: the received buffers are left as they came
    (a double's all-to-all may hand back views of shared state)."""
    total = parts[0] + parts[1]
    for part in parts[2:]:
        total += part
    return total


class CollectiveMismatch(RuntimeError):
    """Ranks of one group made different collective calls (order, op, shape or dtype)."""


class Comm:
    """A process group seen from one rank: `rank` in [0, size), `ranks` the global ranks in order."""

    def __init__(self, name: str, group: Any, ranks: Sequence[int], rank: int) -> None:
        self.name = name
        self.group = group
        self.ranks = tuple(ranks)
        self.rank = rank
        self.size = len(self.ranks)
        self._calls = 0
        self._cpu_signatures: bool | None = None   # decided at the first checked call
        self._gloo_cuda: bool | None = None        # decided at the first CUDA payload

    @classmethod
    def single(cls, name: str = "local") -> "Comm":
        """A one-rank group: collectives are local copies and the trees run over one partial."""
        return cls(name, None, (0,), 0)

    # -- validation -------------------------------------------------------------------------
    def _signature(self, op: str, t: torch.Tensor | None) -> torch.Tensor:
        sig = torch.zeros(_SIG_LEN, dtype=torch.int64)
        sig[0] = self._calls
        sig[1] = zlib.crc32(op.encode())
        if t is not None:
            sig[2] = t.dim()
            sig[3] = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 99
            for i, s in enumerate(t.shape[:_SIG_LEN - 4]):
                sig[4 + i] = s
        return sig

    def _describe(self, sig: torch.Tensor) -> str:
        nd = int(sig[2])
        return f"call #{int(sig[0])} op-crc {int(sig[1])} shape {tuple(int(x) for x in sig[4:4 + nd])}"

    def _validate(self, op: str, t: torch.Tensor | None) -> None:
        self._calls += 1
        if self.size == 1:
            return
        mine = self._signature(op, t)
        dev = self._signature_device(t)
        got = [torch.empty_like(mine, device=dev) for _ in range(self.size)]
        dist.all_gather(got, mine.to(dev), group=self.group)
        for r, s in enumerate(torch.stack(got).cpu()):   # one device-to-host copy, not size
            if not torch.equal(s, mine):
                raise CollectiveMismatch(
                    f"{self.name} group {self.ranks}: rank {self.ranks[self.rank]} called {op!r} "
                    f"({self._describe(mine)}) but rank {self.ranks[r]} made a different call "
                    f"({self._describe(s)})")

    def _signature_device(self, t: torch.Tensor | None) -> torch.device:
        """Where call signatures are exchanged: on the CPU whenever the group has a CPU backend
        (gloo; GPU runs use "cpu:gloo,cuda:nccl"), so checking one never waits for the GPU —
        read back from the device, each check was a host sync that drained the GPU's queue
        before every collective; on the payload's device only for a group without one (a
        bare NCCL group)."""
        if t is None or t.device.type == "cpu":
            return torch.device("cpu")
        if self._cpu_signatures is None:
            self._cpu_signatures = "cpu:" in self._backend_config()
        return torch.device("cpu") if self._cpu_signatures else t.device

    def _backend_config(self) -> str:
        config = getattr(dist, "get_backend_config", None)
        try:
            return config(self.group) if config is not None else ""
        except (RuntimeError, ValueError):
            return ""

    def _staged(self, t: torch.Tensor) -> bool:
        """Whether CUDA payloads go through host memory: when the group carries CUDA tensors
        over gloo ("cpu:gloo,cuda:gloo": ranks sharing a GPU, launch.cuda_backend), so that
        every collective runs gloo's CPU path, the one the CPU topology matrix exercises.
        Copies move bytes unchanged."""
        if t.device.type != "cuda":
            return False
        if self._gloo_cuda is None:
            self._gloo_cuda = "cuda:gloo" in self._backend_config()
        return self._gloo_cuda

    # -- collectives ------------------------------------------------------------------------
    def all_gather(self, t: torch.Tensor, op: str) -> list[torch.Tensor]:
        """Every rank's `t` (same shape and dtype everywhere), in rank order. Exact."""
        self._validate(op, t)
        t = t.contiguous()
        if self.size == 1:
            return [t]
        if self._staged(t):
            return [p.to(t.device) for p in self._all_gather(t.cpu())]
        return self._all_gather(t)

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.group)
        return out

    def all_gather_cat(self, t: torch.Tensor, op: str, dim: int = 0) -> torch.Tensor:
        """Concatenation of every rank's `t` along `dim`, in rank order (logical order)."""
        parts = self.all_gather(t, op)
        return parts[0] if self.size == 1 else torch.cat(parts, dim=dim)

    def all_gather_object(self, obj: Any, op: str) -> list[Any]:
        """Every rank's picklable `obj`, in rank order."""
        self._validate(op, None)
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_to_all(self, chunks: Sequence[torch.Tensor], op: str) -> list[torch.Tensor]:
        """chunks[j] (one per rank, every rank the same shapes in the same order) goes to rank j;
        returns what every rank sent to this one, in rank order. Exact. The call signature
        checked is chunk 0's."""
        if len(chunks) != self.size:
            raise ValueError(f"all_to_all({op!r}): {len(chunks)} chunks for {self.size} ranks")
        self._validate(op, chunks[0])
        if self.size == 1:
            return [chunks[0].contiguous()]
        if self._staged(chunks[0]):
            return [c.to(chunks[0].device) for c in self._all_to_all([c.cpu() for c in chunks])]
        return self._all_to_all(chunks)

    def _all_to_all(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if chunks[0].device.type == "cpu":
            # gloo has only the single-tensor form in some torch builds (2.11: "Backend gloo
            # does not support alltoall"): the chunks travel as one flat tensor, split by size
            flat = torch.cat([c.reshape(-1) for c in chunks])
            sizes = [c.numel() for c in chunks]   # out[i] is shaped as chunks[i]
            got = torch.empty(sum(sizes), dtype=flat.dtype)
            dist.all_to_all_single(got, flat, sizes, sizes, group=self.group)
            return [g.view(c.shape) for g, c in zip(got.split(sizes), chunks)]
        out = [torch.empty_like(c, memory_format=torch.contiguous_format) for c in chunks]
        dist.all_to_all(out, [c.contiguous() for c in chunks], group=self.group)
        return out

    def tree_all_reduce(self, partial: torch.Tensor, op: str) -> torch.Tensor:
        """Pairwise-tree sum of every rank's partial (rank r = leaf r); identical bits on all ranks.

        Each rank's partial must be its aligned subtree of the canonical tree, so the result
        equals the single-process tree over all leaves. The tree is elementwise, so it can be
        cut anywhere: on more than two ranks and at least SLICED_MIN_ELEMS elements, each rank
        receives every rank's 1/size slice (all-to-all), sums its slice by the tree, and the
        sums are all-gathered — 2·(size−1)/size of the partial's bytes per rank, a ring
        all-reduce's traffic, where gathering every partial moves size−1 times them (DESIGN.md,
        collectives on GPUs). The same bits either way (tests/test_dist.py).
        """
        if not self._sliced_pays(partial):
            return tree_combine(self.all_gather(partial, op))
        return self._by_slices(partial, op, lambda parts, a, b: tree_combine(parts))

    def _sliced_pays(self, t: torch.Tensor) -> bool:
        """Whether an elementwise combination over ranks of t moves fewer bytes by slices
        (all-to-all, combine, all-gather) than by gathering every rank's t: more than two ranks
        and at least SLICED_MIN_ELEMS elements (below it one call's latency wins)."""
        return self.size > 2 and t.numel() >= max(SLICED_MIN_ELEMS, self.size)

    def _by_slices(self, t: torch.Tensor, op: str, combine) -> torch.Tensor:
        """An elementwise combination of every rank's t over its flat elements
        (`_finish_slices`: `combine(parts, a, b)` gives the result's elements [a, b))."""
        return self._finish_slices(t.reshape(-1), 0, op, combine).reshape(t.shape)

    def _finish_slices(self, t: torch.Tensor, dim: int, op: str, finish) -> torch.Tensor:
        """An elementwise combination of every rank's t along `dim` (its n elements; other
        dims are an element's columns), by slices: rank r receives every rank's elements
        [a, b) = [r·c, (r+1)·c), c = ⌈n/size⌉ (all-to-all), `finish(received parts in rank
        order, a, b)` gives the result's elements [a, b) (dim 0 of what it returns), and those
        are all-gathered: the result's [n, ...]. The pad past n is finished and dropped."""
        n = t.shape[dim]
        t = self._padded(t, dim)
        per = t.shape[dim] // self.size
        a = self.rank * per
        mine = finish(self.all_to_all(list(t.split(per, dim)), f"{op}:slices"), a, a + per)
        return self.all_gather_cat(mine, f"{op}:finished")[:n]

    def _padded(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """t zero-padded along `dim` to size · ⌈n/size⌉ (n = t.shape[dim]): `_finish_slices`'s
        cut; t itself when size divides n."""
        short = -t.shape[dim] % self.size
        if not short:
            return t
        pad = list(t.shape)
        pad[dim] = short
        return torch.cat([t, t.new_zeros(pad)], dim)

    def sum_ints(self, t: torch.Tensor, op: str, *, inplace: bool = False) -> torch.Tensor:
        """Elementwise SUM of an int64 tensor over the group, identical on every rank; exact in
        any order (the caller keeps values far from int64 overflow). Returns a new tensor, or
        with `inplace` (t contiguous) t itself, overwritten; `t` itself in a one-rank group.
        Raises TypeError for other dtypes, ValueError for a non-contiguous `inplace` tensor."""
        if t.dtype != torch.int64:
            raise TypeError(f"sum_ints({op!r}) expects int64, got {t.dtype}")
        if inplace and not t.is_contiguous():
            raise ValueError(f"sum_ints({op!r}, inplace=True) needs a contiguous tensor")
        self._validate(op, t)
        if self.size == 1:
            return t
        out = t if inplace else t.contiguous().clone()
        if self._staged(out):
            host = out.cpu()
            dist.all_reduce(host, op=dist.ReduceOp.SUM, group=self.group)
            out.copy_(host)
            return out
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def sum_ints_finished(self, t: torch.Tensor, op: str,
                          finish: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """finish(the elementwise SUM of t over the group), identical on every rank.

        t: int64 [*S, C], C integer columns per element (fixedpoint's N_COLS digits and
        counts); finish: int64 [n, C] -> [n] (any dtype), elementwise over rows (e.g.
        fixedpoint.round_fp32). Returns [*S]. The same values as finish(sum_ints(t)) — integer
        sums are exact in any order — computed by slices at INT_SLICED_MIN_ELEMS elements and
        more: rank r receives every rank's rows [r·c, (r+1)·c), c = ⌈n/size⌉ (all-to-all), sums
        and finishes them, and the finished slices are all-gathered. Per rank that sends
        (size−1)/size of t's bytes plus the finished values', where a (ring) all-reduce sends
        2·(size−1)/size of t's bytes and every rank then finishes every row: at fp32 results of
        13-column accumulators, 54 % of the bytes and 1/size of the rounding, for a transient
        of (size+1)/size of t's size (the received rows and their sum). Why: the DP/CP
        weight-gradient sums are the largest collective of an invariant step (104 bytes a
        parameter element against a bf16 all-reduce's 2). TypeError for other dtypes."""
        if t.dtype != torch.int64:
            raise TypeError(f"sum_ints_finished({op!r}) expects int64, got {t.dtype}")
        shape, cols = t.shape[:-1], t.shape[-1]
        n = math.prod(shape)
        if self.size == 1 or n < max(INT_SLICED_MIN_ELEMS, self.size):
            return finish(self.sum_ints(t, op).reshape(n, cols)).reshape(shape)
        return self._finish_slices(t.reshape(n, cols), 0, op,
                                   lambda parts, a, b: finish(_summed(parts))).reshape(shape)

    def finish_words(self, words: torch.Tensor, op: str,
                     finish: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        """finish(every rank's words), elementwise, identical on every rank.

        words: [W, *S], W values an element (the dW kernel's float64 double words hi, lo:
        W = 2); finish: a list of [W, m] tensors, one a rank in rank order -> [m], elementwise
        over the m columns (e.g. the exact sum of every rank's double words, rounded once).
        Returns [*S]. By slices at INT_SLICED_MIN_ELEMS elements and more: rank r receives
        every rank's columns [r·c, (r+1)·c), c = ⌈n/size⌉ (all-to-all), finishes them, and the
        finished slices are all-gathered; below it every rank gathers every rank's words and
        finishes them all. Why: a weight gradient held as double words is sent as its 16 bytes
        an element, where its digits (`sum_ints_finished`) are 104 — (size−1)/size · (16 + 4)
        bytes an element a rank, the digits made only on the rank that finishes them."""
        lead, shape = words.shape[0], words.shape[1:]
        n = math.prod(shape)
        flat = words.reshape(lead, n)
        if self.size == 1:
            return finish([flat]).reshape(shape)
        if n < max(INT_SLICED_MIN_ELEMS, self.size):
            return finish(self.all_gather(flat, op)).reshape(shape)
        return self._finish_slices(flat, 1, op, lambda parts, a, b: finish(parts)).reshape(shape)

    def tree_reduce_scatter(self, partial: torch.Tensor, op: str, dim: int = 0) -> torch.Tensor:
        """This rank's equal slice along `dim` (rank order) of tree_all_reduce(partial): each
        rank receives only its slice of every rank's partial (all-to-all) and sums those by the
        tree, (size−1)/size of the partial's bytes per rank. ValueError unless size divides
        the dim."""
        n = partial.shape[dim] // self.size
        if n * self.size != partial.shape[dim]:
            raise ValueError(f"tree_reduce_scatter({op!r}): dim {dim} of {tuple(partial.shape)} "
                             f"does not split into {self.size} equal slices")
        if self.size == 1:
            return self.tree_all_reduce(partial, op)
        return tree_combine(self.all_to_all(list(partial.split(n, dim)), op))

    def select_owner(self, t: torch.Tensor, owner: torch.Tensor, op: str) -> torch.Tensor:
        """Element-wise pick the value of the rank named by `owner` (int64, t's shape) — exact.

        Used where exactly one rank holds a value (vocab-parallel lookups, target logits), so no
        sum with zeros can flip the sign of a zero. Large picks go by slices, as
        tree_all_reduce's (the pick is elementwise too).
        """
        owner = owner.to(t.device)
        if self._sliced_pays(t):
            own = self._padded(owner.reshape(-1), 0)
            return self._by_slices(t, op, lambda parts, a, b: torch.stack(parts).gather(
                0, own[a:b].unsqueeze(0))[0])
        parts = self.all_gather(t, op)
        if self.size == 1:
            return parts[0]
        stacked = torch.stack(parts)
        return stacked.gather(0, owner.unsqueeze(0))[0]
