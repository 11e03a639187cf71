"""Token reductions of a backward pass: exact sums over sample-relative token leaves.

Every reduction over tokens in the backward — dW = dYᵀ·X of every linear, RMSNorm and Q/K-norm
weights, embedding rows, attention dK/dV over queries — is defined the same way:
  - a *leaf* is TOKEN_LEAF consecutive tokens of ONE sample, at sample-relative positions
    [j·TOKEN_LEAF, (j+1)·TOKEN_LEAF) (the packer starts every sample at a multiple of TOKEN_LEAF
    and CP/SP cut streams only there, so a rank always holds whole leaves);
  - inside a leaf, tokens are summed in position order in fp32 (the kernel's sequential loop);
  - the leaf partials are added EXACTLY (rlkernel/numerics/fixedpoint.py) and rounded once.
Exact addition is associative, so the result depends only on the set of (sample, leaf) partials:
not on which microbatch, CP/SP rank or DP rank held a leaf, nor on packing or padding (a padding
row adds exact zeros). That is why weight gradients are invariant to DP size and microbatch size
as well as to TP/CP/SP (DESIGN.md §1, the "exact fixed-point accumulation" step).

`TokenSum` is what a kernel receives: the group holding the other tokens of its stream (`comm`)
and, in training, the `GradSink` of the policy. A kernel asks `accumulator(w)` for the integer
accumulator of weight w, adds its leaf partials with `fixedpoint.accumulate_`, and calls
`result(w, acc)`: with an open sink the accumulator *is* the sink's (it keeps growing over every
microbatch of the mini-batch) and the kernel returns no gradient to autograd; without one, the
accumulator is summed over `comm` and rounded, and the kernel returns that fp32 gradient.
`GradSink.finish` ends a mini-batch: per scope, one integer sum of the accumulators over the
ranks that hold the other tokens (DP × CP, or the whole world where TP ranks hold different
tokens or heads: SP-sharded norm weights, Q/K-norm head sums) and one rounding per element —
`Comm.sum_ints_finished`: each rank sums and rounds a slice of the elements, about half an
integer all-reduce's bytes. A CUDA linear's dW that every rank holds as the dW kernel's float64
double words goes as those words instead (`words_finished`: `Comm.finish_words`, 16 bytes an
element; the rank that rounds a slice adds every rank's words exactly).
Does not: move activations (rlkernel/distributed/parallel.py) or choose leaves (data/packing.py).
Tests: `.venv/bin/python -m pytest -q tests/test_fixedpoint.py tests/test_kernels_matmul.py`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from rlkernel.distributed.comm import CollectiveMismatch, Comm
from rlkernel.numerics import fixedpoint as fx
from rlkernel.spec import TOKEN_LEAF

SCOPES = ("dp_cp", "world")
"""Groups a weight's accumulator is summed over at the end of a mini-batch (topology groups)."""


def leaves_of(n_tokens: int) -> int:
    """Leaves of a local token stream of n_tokens rows (a multiple of TOKEN_LEAF; ValueError)."""
    if n_tokens % TOKEN_LEAF:
        raise ValueError(f"token leaves: a stream of {n_tokens} rows is not a multiple of "
                         f"TOKEN_LEAF={TOKEN_LEAF} (streams are packed in whole leaves)")
    return n_tokens // TOKEN_LEAF


class GradSink:
    """Exact weight-gradient accumulators of one mini-batch, over microbatches and ranks.

    groups: {"dp_cp": Comm, "world": Comm} of this rank (topology groups, rank order = layout).
    Between `begin` and `finish` the sink is open: kernels add leaf partials to the accumulator
    of each weight (int64 [*w.shape, fixedpoint.N_COLS]) instead of returning a gradient. The
    CUDA dW kernel keeps a weight's sum as float64 double words instead (`words`: [2,
    *w.shape], 16 bytes per element against 104, continued by the kernel microbatch after
    microbatch with no digit pass); a weight moves from words to digits — the words' exact sum
    added to a new accumulator — when another kernel asks for its accumulator or a tile cannot
    hold its sum in words (learnt from a flag count read later, as a deferred chunk's below:
    `TokenSum.defer_carry`), and `finish` rounds words directly (a scope group of one rank),
    sums them over the ranks as words (`words_finished`) where every rank of the group holds
    the weight in words, or adds them to digits first. The same exact sum every way, so the
    same bytes.
    Direct mode (`begin(direct=True)`, when every rank's share of the mini-batch is ONE
    microbatch): a weight's leaves are all in the one backward that reaches it, so its kernel
    finishes the gradient there (`finish_direct`: row chunks summed over the scope group and
    rounded) and the sink keeps only the fp32 result — no 104-byte accumulator per element lives
    for the mini-batch. The bytes are those of the persistent path (same exact sum, rounded once).
    With a scope group of one rank, a kernel that holds a chunk's exact sum as float64 double
    words (the CUDA dW: kernels/triton_grad_weight.py) rounds them directly
    (fixedpoint.round_double_words) and no accumulator is made for that chunk. Such a kernel may
    leave its exactness flag on the device (a deferred chunk): the sink copies it to pinned host
    memory behind a CUDA event and reads it only once the event has passed (at the latest
    PENDING_LAG chunks later, or in `finish`), redoing a flagged chunk by the digit path then —
    so the backward never waits for the GPU to drain. The bytes are the same either way.
    Weights used more than once per forward (`keep`, e.g. tied embeddings) stay persistent —
    except a kept weight whose second use touches only a few rows that are known before the
    first use's backward (the tied embedding: the lookup's ids, `note_rows` at its forward):
    the dense use (the LM head's dW) finishes every row directly and also adds its partials
    of the noted rows — over a scope group of several ranks, of the union of every rank's
    noted rows (all-gathered ids), since each rank's head partials of a row another rank
    looked up belong to that row's sum too — into a small accumulator of those rows only; the
    sparse use (the lookup's backward) adds into that one (`add_split_rows`); `finish` sums it
    over the scope group and rounds it over those rows, written over their direct rounding.
    The same exact sum of the same partials, rounded once: the persistent path's bytes,
    without its [V, H, N_COLS] accumulator (32 GB at qwen3-1.7b, on every DP/CP rank).
    In persistent mode (several microbatches) such a weight is split too, over any scope group
    (`finish` sums the ranks' rows over their union, below): the dense use keeps
    its sum as usual (words on CUDA), the sparse uses add into an accumulator over the rows
    noted so far (grown, digits copied, when a later lookup brings new rows), and `finish` adds
    the dense sum's rows into it before rounding them — instead of moving the whole weight to
    digits at the first lookup's backward; once the rows noted pass SPLIT_MAX_FRACTION of the
    weight's, it takes its whole accumulator after all (the split digits added there).
    Weights whose only use is a row lookup (`sparse`: an untied embedding) take the same split
    in either mode with no dense use at all, over any scope group: each rank's accumulator
    covers the rows its lookups noted, and `finish` sums them over the union of every rank's
    rows (all-gathered ids) — rows no rank looked up get +0.0, as the whole accumulator rounds
    its zeros to. A vocab-sized [V, H, N_COLS] accumulator (qwen3-8b: 32 GB per rank at TP2)
    becomes one of the rows the mini-batch's tokens touch; past SPLIT_MAX_FRACTION on any rank
    of the group, every rank takes the whole accumulator after all. In direct mode the split is
    made at the (one) lookup's backward over the union of the group's rows at once
    (`_direct_split`); past SPLIT_MAX_FRACTION there, the weight is finished by
    `finish_direct`'s chunks instead (no accumulator lives beyond one chunk). Same bytes on
    every path: the same exact sums, rounded once.
    Late activation flags (`begin(late=True)`): a kernel whose exact activation sum (attention
    dK/dV, kernels/triton_attention_bwd.py) failed its device-side check — a third-tier
    program, which needs the host — may, instead of syncing the host to fix it there, add the
    count of such programs to `late_counter` and go on with a value that is then not the exact
    sum; so does the CUDA dW kernel for a tile whose double words could not take a call's
    partials even through its checked retry (`flag_count` hands it the late tile counter, and
    `_defer` keeps no chunk to redo: no copy, event or wait per dW call). The caller reads the
    counts once, after the mini-batch's last backward
    (`late_flagged`, one host sync and a world gather of the counts) and, if any rank counted one,
    discards the mini-batch and runs it again with late=False (train/step.py). Nothing read
    before that check leaves the sink, so the bytes are those of a run that never deferred.
    Third-tier programs need NaN/Inf, |sum| >= 2**150 or a spread past ~2**100 among one
    element's leaf partials: a diverged run (NaN gradients) pays its backward twice a step.
    """

    def __init__(self, groups: dict[str, Comm]) -> None:
        missing = [s for s in SCOPES if s not in groups]
        if missing:
            raise ValueError(f"GradSink: no group for scope(s) {missing}")
        self.groups = groups
        self.open = False
        self._names: dict[int, str] = {}
        self._acc: dict[str, torch.Tensor] = {}
        self._words: dict[str, torch.Tensor] = {}   # float64 [2, *shape]: carried double words
        self._scope: dict[str, str] = {}
        self._done: dict[str, torch.Tensor] = {}
        self.direct = False
        self._keep: frozenset[str] = frozenset()
        self._sparse: frozenset[str] = frozenset()   # lookup-only weights (class doc)
        self._params: dict[str, torch.Tensor] = {}
        self._rows: dict[str, tuple[torch.Tensor, str]] = {}    # noted rows, scope (split weights)
        self._split: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # rows, their accumulator
        self._whole: set[str] = set()     # kept weights whose split grew into the whole weight
        self._pending: deque = deque()    # (event or None, flag count, redo) of deferred chunks
        self._copies: dict[int, tuple[int, torch.Tensor]] = {}   # id(w) -> (w._version, copy)
        self._slots: list[tuple[torch.Tensor, torch.Tensor]] = []   # (device, pinned host) counters
        self._next_slot = 0
        self._slot_host: dict[int, torch.Tensor] = {}   # id(handed-out counter) -> its host mirror
        self.late = False
        self._late_count: torch.Tensor | None = None   # int64 [] on the device (late flags)
        self._late_tiles: torch.Tensor | None = None   # int32 [] on the device (late dW tiles)
        self._later: dict[str, list[torch.Tensor]] = {}   # name -> leaf partials not yet added
        self._later_bytes: dict[str, int] = {}

    @classmethod
    def single(cls) -> "GradSink":
        """The sink of a one-process run."""
        return cls({s: Comm.single(s) for s in SCOPES})

    def begin(self, params: dict[str, torch.Tensor], *, direct: bool = False,
              keep: frozenset[str] | set[str] = frozenset(),
              sparse: frozenset[str] | set[str] = frozenset(), late: bool = False) -> None:
        """Open the sink for a mini-batch of `params` (name -> parameter, canonical order).

        direct: every rank of both scope groups runs exactly one microbatch (one backward) in
        this mini-batch, so gradients may be finished inside it (class doc); `keep`: names that
        stay persistent anyway (used more than once per forward); `sparse`: names used only by
        a row lookup (class doc: split over the rows noted in persistent mode); `late`:
        activation kernels may count failed exactness checks in `late_counter` instead of
        syncing the host (class doc; the caller must then call `late_flagged`). All ranks must
        agree."""
        self._names = {id(p): n for n, p in params.items()}
        self._params = dict(params)
        self._order = list(params)
        self._acc, self._words, self._scope, self._done = {}, {}, {}, {}
        self._rows, self._split, self._whole = {}, {}, set()
        self.direct, self._keep, self._sparse = direct, frozenset(keep), frozenset(sparse)
        self._pending.clear()    # a backward that raised may have left some (and their operands)
        self._copies = {}
        self._next_slot, self._slot_host = 0, {}
        self.late, self._late_count, self._late_tiles = late, None, None
        self._later, self._later_bytes = {}, {}
        self.open = True

    def late_counter(self, device: torch.device) -> torch.Tensor | None:
        """The open sink's int64 [] count of late activation flags on `device` (class doc): a
        kernel adds the number of programs whose exact sum it could not finish without the
        host. None when the sink is closed or not late: the kernel must finish them now."""
        if not (self.open and self.late):
            return None
        return self._counter("_late_count", torch.int64, device, "late flags")

    def late_flagged(self) -> bool:
        """Whether any rank's kernels counted a late activation flag or a late dW tile
        (`flag_count`) in this mini-batch (one host read of the counts, then their sum over the
        world group, so every rank answers the same). Call after the last backward and before
        `finish`; collective over the world group when the sink is late (every rank's is:
        `begin` takes the same `late` on all)."""
        if not (self.open and self.late):
            return False
        counts = [c.to(torch.int64) for c in (self._late_count, self._late_tiles) if c is not None]
        n = int(sum(counts)) if counts else 0
        world = self.groups["world"]
        if world.size > 1:
            n = sum(world.all_gather_object(n, "grad-sink:late-flags"))
        return n != 0

    def compute_copy(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Parameter w in `dtype` (e.g. bf16 for the tensor cores), cast once per mini-batch in
        persistent mode and reused by every microbatch's forward and backward; w itself
        elsewhere — direct mode (one microbatch: the copies would only raise the peak by 2 bytes
        per parameter for the one backward that reuses them) or a closed sink — is cast by the
        caller. Returns None then. A copy made before w changed in place (its version counter)
        is made again.

        Why: a linear rounds its fp32-held weight at the forward and again at the backward of
        every microbatch (two casts of every weight per microbatch: ~3,900 launches per step at
        qwen3-0.6b and four microbatches, docs/BENCHMARKS.md); the values are the same each time
        (the weight holds values of `dtype` already), so the bytes of every product are too.
        Memory: the copies live until `finish` (2 bytes per parameter for bf16)."""
        if not self.open or self.direct or w.dtype == dtype:
            return None
        held = self._copies.get(id(w))
        if held is None or held[0] != w._version:
            held = (w._version, w.detach().to(dtype))
            self._copies[id(w)] = held
        return held[1]

    def _name(self, w: torch.Tensor) -> str:
        name = self._names.get(id(w))
        if name is None:
            raise RuntimeError("GradSink: a kernel reported a gradient for a tensor that is not a "
                               "parameter of the model being trained")
        return name

    def is_direct(self, w: torch.Tensor) -> bool:
        """Whether w's kernel finishes its gradient itself (`finish_direct`) in this mini-batch:
        a weight not kept, or a kept one whose sparse rows were noted (its dense use, once)."""
        if not (self.open and self.direct):
            return False
        name = self._name(w)
        return name not in self._keep or (name in self._rows and name not in self._done)

    def note_rows(self, w: torch.Tensor, ids: torch.Tensor, offset: int, scope: str) -> None:
        """A kept or lookup-only weight's sparse use will add to w's rows ids - offset only
        (ids long, any order and repeats; those outside [0, rows of w) are another rank's: the
        lookup's ids of a vocab shard at `offset`), reduced over `scope`: w is finished split
        (class doc) instead of through an accumulator of all its rows. Call before the dense
        use's backward (the lookup's forward); several calls add rows. Every rank of the scope
        group must note w's rows in the same mini-batches (the union is a collective).
        RuntimeError once the dense use has finished w."""
        name = self._names.get(id(w))   # None: not a trained parameter (a frozen model's)
        if name is None or not self.open or name in self._whole:
            return
        # Both modes split at any scope group: finish (or, for a kept weight in direct mode,
        # its dense use) sums the ranks' rows over their union.
        if not (name in self._keep or name in self._sparse):
            return
        if name in self._done:
            raise RuntimeError(f"GradSink: rows of {name} noted after its dense use finished it")
        # Only here, past the checks: the mask is a host sync on CUDA, which the forward of a
        # model with no embedding to train need not pay.
        local = ids.reshape(-1) - offset
        rows = local[(local >= 0) & (local < w.shape[0])]
        if name in self._rows:
            if self._rows[name][1] != scope:
                raise RuntimeError(f"GradSink: {name} reduced over {self._rows[name][1]} and "
                                   f"{scope}")
            rows = torch.cat([self._rows[name][0], rows])
        self._rows[name] = (torch.unique(rows), scope)

    def add_split_rows(self, w: torch.Tensor, add_at) -> bool:
        """The sparse use of a split weight (`note_rows`): `add_at(rows, acc)` adds this rank's
        leaf partials of w's rows `rows` (ascending long [R]) into acc int64 [R, *w.shape[1:],
        N_COLS]; returns True. False (nothing done) for a weight that is not split. RuntimeError
        when the dense use has not run yet (its partials of these rows would be lost)."""
        name = self._names.get(id(w))   # a foreign tensor is the other paths' to refuse
        if self.open and name in self._rows and not self.direct:
            self._grow_split(name, w)
        elif (self.open and self.direct and name in self._sparse and name in self._rows
              and name not in self._split and not self._direct_split(name, w)):
            return False      # too many rows: finish_direct's chunks (the kernel's next path)
        if name in self._split:
            add_at(*self._split[name])
            return True
        if self.open and name in self._rows:
            raise RuntimeError(f"GradSink: the sparse use of {name} reached the sink before its "
                               "dense use (the split path needs the dense use first)")
        return False

    def _direct_split(self, name: str, w: torch.Tensor) -> bool:
        """Direct mode, a lookup-only weight at its lookup's backward: a zero split accumulator
        over the union of the scope group's noted rows (the same on every rank: each adds its
        partials there, `finish` sums them), True; or, when that union passes
        SPLIT_MAX_FRACTION of the weight's rows, no split on any rank (False: the rows are
        dropped, finish_direct's transient chunks cost less than such an accumulator).
        Collective over the scope group (every rank's one lookup backward reaches it)."""
        rows = self._noted_union(name)
        if rows.numel() > SPLIT_MAX_FRACTION * w.shape[0]:
            del self._rows[name]
            return False
        self._split[name] = (rows, fx.zeros((rows.numel(), *w.shape[1:]), w.device))
        return True

    def _noted_union(self, name: str) -> torch.Tensor:
        """Direct mode: the union of the scope group's noted rows of `name` (this rank's own on
        a group of one), kept as its noted rows and returned. Collective over the group."""
        rows, scope = self._rows[name]
        comm = self.groups[scope]
        if comm.size > 1:
            rows = _union_rows(comm, rows, f"grad-sink:split:{name}:rows")
            self._rows[name] = (rows, scope)
        return rows

    def _grow_split(self, name: str, w: torch.Tensor) -> None:
        """Persistent mode: the split accumulator of `name` over every row noted so far (the
        rows of all microbatches' lookups: a superset of the last one's), the digits already
        added to the old rows copied to their new places (integers: exact) — or, past
        SPLIT_MAX_FRACTION of the weight's rows, no split any more (its whole accumulator)."""
        rows, scope = self._rows[name]
        old = self._split.get(name)
        if old is not None and old[0].numel() == rows.numel():   # rows only grow: the same set
            return
        if rows.numel() > SPLIT_MAX_FRACTION * w.shape[0]:
            # As large as the weight, nearly: its whole accumulator, the split digits added to
            # their rows (integers: exact); the lookups add there from now on.
            acc = self.accumulator(w, scope)
            if old is not None:
                acc[old[0]] += old[1]
            self._split.pop(name, None)
            del self._rows[name]
            self._whole.add(name)
            return
        acc = fx.zeros((rows.numel(), *w.shape[1:]), w.device)
        if old is not None:
            acc[torch.searchsorted(rows, old[0])] = old[1]
        self._split[name] = (rows, acc)

    def finish_direct(self, w: torch.Tensor, scope: str, add_rows, op: str,
                      words_rows=None, add_rows_at=None, word_rows=None) -> None:
        """Finish parameter w's gradient now (direct mode): for row chunks [a, b) of w (at most
        DIRECT_CHUNK_ELEMS elements; the cut depends on w's shape only, so every rank of the
        group runs the same collectives), `add_rows(a, b, acc)` adds this rank's leaf partials of
        those rows into a zero accumulator int64 [b - a, *w.shape[1:], N_COLS]; the chunk is
        summed over the scope group (integers: exact) and rounded once into an fp32 gradient the
        sink keeps. RuntimeError for a weight finished twice (a second use in the same backward
        would be lost: such weights belong in `keep`).
        `words_rows(a, b)` (optional, e.g. the CUDA dW kernel's double words): the same exact
        sum of this rank's partials of rows [a, b), rounded once — fp32 [b - a, *w.shape[1:]] —
        or None when it cannot hold it (a flagged tile), or (those rows, flag count [] int on
        the device) when it has not read its flags: a deferred chunk (`_defer`), redone by
        add_rows later — possibly after this returns, so add_rows must stay valid — if the
        count is not 0. Used only when the scope group is this rank alone (no integers of other
        ranks to add): a chunk it returns needs no accumulator; a None chunk takes add_rows.
        Same bytes either way (the same exact sum, rounded once).
        `add_rows_at(rows, acc)`: as add_rows for the rows `rows` (ascending long [R]) into acc
        [R, ...]; needed for a split weight (`note_rows`), whose noted rows it fills (RuntimeError
        without it).
        `word_rows(a, b)` (optional, the CUDA dW kernel): (double words float64 [2, b - a,
        *w.shape[1:]] holding this rank's exact sum of rows [a, b) — valid only if the flag
        count, [] int on the device, is 0 —, that count). Used over a scope group of several
        ranks in a late sink (`begin(late=True)`): the words are summed over the group as
        words (`words_finished`: 16 bytes an element sent, not the digits' 104) and the count
        joins the late tile counter — a count anywhere runs the mini-batch again with a sink
        that is not late, which takes add_rows. Same bytes: the same integers summed."""
        name = self._name(w)
        if name in self._done:
            raise RuntimeError(f"GradSink: {name} reached a second kernel in one direct-mode "
                               "mini-batch; a weight used more than once per forward must be "
                               "kept persistent (begin(keep=...))")
        comm = self.groups[scope]
        out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
        n = w.shape[0]   # parameters are at least 1-D
        rows = max(1, DIRECT_CHUNK_ELEMS // max(1, math.prod(w.shape[1:])))
        for a in range(0, n, rows):
            b = min(n, a + rows)
            if word_rows is not None and comm.size > 1 and self.late:
                words, flagged = word_rows(a, b)
                self._defer(flagged, None)      # late: joins the late tile counter
                out[a:b] = words_finished(comm, words, op)
                continue
            if words_rows is not None and comm.size == 1:
                vals = words_rows(a, b)
                if isinstance(vals, tuple):     # (rows, flag count still on the device)
                    out[a:b] = vals[0]
                    self._defer(vals[1], lambda a=a, b=b: self._digits_into(
                        out, a, b, add_rows, comm, op))
                    continue
                if vals is not None:
                    out[a:b] = vals
                    continue
            self._digits_into(out, a, b, add_rows, comm, op)
        if name in self._rows:
            noted = self._rows[name][1]
            if add_rows_at is None or noted != scope:
                raise RuntimeError(f"GradSink: {name} is split (rows noted over {noted}) but its "
                                   f"dense use over {scope} gave no add_rows_at")
            # Every rank's dense partials of a row another rank looked up must join that row's
            # exact sum too (its direct rounding above is written over at finish).
            rows = self._noted_union(name)
            acc = fx.zeros((rows.numel(), *w.shape[1:]), w.device)
            add_rows_at(rows, acc)
            self._split[name] = (rows, acc)
        self._done[name] = out
        self._scope[name] = scope

    @staticmethod
    def _digits_into(out: torch.Tensor, a: int, b: int, add_rows, comm: Comm, op: str) -> None:
        """out[a:b] = rows [a, b) by the digit path: add_rows into a zero accumulator, summed
        over comm, rounded once."""
        acc = fx.zeros((b - a, *out.shape[1:]), out.device)
        add_rows(a, b, acc)
        out[a:b] = comm.sum_ints_finished(acc, f"{op}:direct", fx.round_fp32)

    def flag_count(self, device: torch.device) -> torch.Tensor:
        """A zeroed int32 [] counter on `device` for a deferred chunk's flag count, which a
        kernel adds its flagged tiles into (kernels/triton_grad_weight.py
        `carry_grad_weight_deferred`): on CUDA one slot of a buffer of SLOT_CHUNK counters
        zeroed once per mini-batch, mirrored in pinned host memory, so `_defer` copies one
        element behind its event instead of making and reducing tensors per chunk (~800 chunks
        a step at qwen3-0.6b, four microbatches). Elsewhere a new zero tensor. A late sink
        (`begin(late=True)`) hands out its one late tile counter instead, which `late_flagged`
        reads after the mini-batch (`_defer`): not zeroed per chunk, and never deferred."""
        if self.open and self.late:
            return self._late_tile_counter(device)
        if device.type != "cuda":
            return torch.zeros((), dtype=torch.int32, device=device)
        chunk, j = divmod(self._next_slot, SLOT_CHUNK)
        if chunk == len(self._slots) or self._slots[chunk][0].device != device:
            if chunk < len(self._slots):    # another device: a counter of its own
                return torch.zeros((), dtype=torch.int32, device=device)
            self._slots.append((torch.empty(SLOT_CHUNK, dtype=torch.int32, device=device),
                                torch.empty(SLOT_CHUNK, dtype=torch.int32, pin_memory=True)))
        dev, host = self._slots[chunk]
        if j == 0:      # first use of this buffer in the mini-batch (finish resolved the last)
            dev.zero_()
        self._next_slot += 1
        slot = dev[j]
        self._slot_host[id(slot)] = host[j:j + 1]
        return slot

    def _late_tile_counter(self, device: torch.device) -> torch.Tensor:
        """The late sink's int32 [] count of dW tiles whose words could not take a call's
        partials (created at 0 on first use; RuntimeError for a second device)."""
        return self._counter("_late_tiles", torch.int32, device, "late dW tiles")

    def _counter(self, attr: str, dtype: torch.dtype, device: torch.device,
                 what: str) -> torch.Tensor:
        """The mini-batch's [] counter held in `attr`, made at 0 on `device` on first use;
        RuntimeError when asked for on another device in the same mini-batch."""
        c = getattr(self, attr)
        if c is None:
            c = torch.zeros((), dtype=dtype, device=device)
            setattr(self, attr, c)
        elif c.device != device:
            raise RuntimeError(f"GradSink: {what} on {device} and {c.device} in one mini-batch")
        return c

    def _defer(self, flagged: torch.Tensor, redo) -> None:
        """Queue a deferred chunk: `redo()` runs if its flag count `flagged` ([] int, on the
        chunk's device) turns out nonzero. On CUDA the count is copied to pinned memory behind
        an event (no host sync now); then every chunk whose event has passed is resolved, and
        the oldest ones are waited for while more than PENDING_LAG are queued (their redo keeps
        the kernel's operands alive).
        A late sink queues nothing: the count joins its late tile counter (`flag_count` handed
        that counter itself to the kernel, so usually there is nothing to add) and redo is
        dropped — if `late_flagged` finds any count, the caller runs the whole mini-batch again
        with a sink that is not late (class doc, "Late activation flags"), so no partial of a
        flagged chunk is needed. Why: a copy, an event and its queries per chunk (~800 a step
        at qwen3-1.7b, four microbatches) were host time of a host-bound step, and a wait on
        the oldest event drained the GPU queue behind it."""
        if self.open and self.late:
            counter = self._late_tile_counter(flagged.device)
            if flagged is not counter:
                counter.add_(flagged.to(counter.dtype))
            return
        if flagged.is_cuda:
            host = self._slot_host.pop(id(flagged), None)
            if host is None:
                host = torch.empty((), dtype=flagged.dtype, pin_memory=True)
                host.copy_(flagged, non_blocking=True)
            else:   # a flag_count slot: its element of the pinned mirror
                host.copy_(flagged.view(1), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((event, host, redo))
        else:
            self._pending.append((None, flagged, redo))
        self._resolve(PENDING_LAG)

    def _resolve(self, keep: int) -> None:
        """Resolve queued chunks in order: those whose flag is readable without waiting, then
        (waiting on their events) the oldest until at most `keep` remain."""
        while self._pending:
            event, count, redo = self._pending[0]
            passed = event is None or event.query()
            if not passed and len(self._pending) <= keep:
                return
            self._pending.popleft()
            if not passed:
                event.synchronize()     # the oldest, waited for beyond the lag (or at finish)
            if int(count):
                with torch.no_grad():   # finish may run with grad mode on (sync_grads)
                    redo()

    def _claim(self, name: str, scope: str) -> bool:
        """Whether `name` already has a mini-batch sum (digits or words) over `scope`;
        RuntimeError for a weight finished directly or reduced over another scope."""
        if name in self._done:
            raise RuntimeError(f"GradSink: {name} was finished directly and reached another "
                               "kernel in the same mini-batch")
        if name not in self._scope:
            return False
        if self._scope[name] != scope:
            raise RuntimeError(f"GradSink: {name} reduced over {self._scope[name]} and {scope}")
        return True

    def accumulator(self, w: torch.Tensor, scope: str) -> torch.Tensor:
        """The mini-batch accumulator of parameter w (created at zero on first use; a weight
        held in double words so far moves to digits here: the words' exact sum added to the
        new accumulator, the words dropped). A weight must be reduced over one scope throughout
        (RuntimeError otherwise, or for a foreign tensor)."""
        name = self._name(w)
        claimed = self._claim(name, scope)
        if name in self._words:
            self._acc[name] = _digits_of(self._words.pop(name).view(2, -1)).view(
                *w.shape, fx.N_COLS)
        elif not claimed or name not in self._acc:   # new, or only partials held (add_later)
            self._acc[name] = fx.zeros(w.shape, w.device)
            self._scope[name] = scope
        later = self._later.pop(name, None)
        if later:       # the partials add_later kept, in one exact pass (integers: any order)
            self._later_bytes.pop(name, None)
            fx.accumulate_(self._acc[name].view(-1, fx.N_COLS),
                           torch.cat([p.reshape(p.shape[0], -1) for p in later]))
        return self._acc[name]

    def add_later(self, w: torch.Tensor, part: torch.Tensor, scope: str) -> bool:
        """Persistent mode: keep the leaf partials `part` [k, *w.shape] fp32 of parameter w (a
        fresh tensor the caller no longer writes) to be added exactly with the next ones in one
        pass — when w's accumulator is asked for, when its kept partials pass LATER_BYTES, at
        the latest in `finish` — instead of one accumulate pass per microbatch; returns True.
        False (nothing kept: the caller adds now) when the sink is closed or direct. The exact
        sum is the same whenever its partials are added, so are the bytes. Why: a norm weight's
        pass is four launches for a few KiB (RMSNorm and Q/K-norm weights: ~450 passes, ~1,800
        launches a step at qwen3-1.7b in four microbatches, a host-bound step). Errors as
        `accumulator`."""
        if not self.open or self.direct:
            return False
        name = self._name(w)
        self._claim(name, scope)         # a weight finished directly, or another scope: raises
        self._scope[name] = scope
        self._later.setdefault(name, []).append(part)
        held = self._later_bytes.get(name, 0) + part.numel() * part.element_size()
        self._later_bytes[name] = held
        if held >= LATER_BYTES:
            self.accumulator(w, scope)
        return True

    def words(self, w: torch.Tensor, scope: str) -> torch.Tensor | None:
        """The mini-batch double words of parameter w: float64 [2, *w.shape] (created at zero
        on first use), an exact sum hi + lo per element that the CUDA dW kernel continues
        microbatch after microbatch (kernels/triton_grad_weight.py `carry_grad_weight_deferred`), 16
        bytes per element against the accumulator's 104; `finish` rounds or sums them like
        accumulators. None when w's sum is already held in digits (`accumulator`: another
        kernel added to it, or a tile the words could not hold moved it there). Errors as
        `accumulator`."""
        name = self._name(w)
        if not self._claim(name, scope):
            self._words[name] = torch.zeros((2, *w.shape), dtype=torch.float64, device=w.device)
            self._scope[name] = scope
        return self._words.get(name)

    def finish(self) -> dict[str, torch.Tensor]:
        """Close the sink: sum every accumulator over its scope's ranks (integers: exact, any
        order), round each element once. Returns fp32 gradients by name, canonical order;
        parameters no kernel touched on any rank get none. Collective over both scope groups.

        Memory: accumulators are all-reduced in place and freed as they are rounded, in buckets
        of at most _BUCKET_ROWS elements (small tensors share one, large ones are cut), so the
        transient beyond the accumulators themselves is a few bucket copies, not a second set."""
        for n in list(self._later):     # kept partials into their accumulators (add_later)
            self.accumulator(self._params[n], self._scope[n])
        self.open = False
        self._copies = {}
        self._resolve(0)    # every deferred chunk exact before any gradient leaves the sink
        out: dict[str, torch.Tensor] = {}
        later: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # rows written over `out`
        if not self.direct:
            for n in self._order:
                if n in self._sparse or n in self._keep:
                    self._finish_split(n, out, later)
        for scope in SCOPES:
            comm, op = self.groups[scope], f"grad-sink:{scope}"
            if comm.size == 1:
                self._round_own_words(scope, out)
            # Every rank must reduce the same list in the same buckets; the signature check of
            # each collective catches a rank whose kernels saw another set of weights.
            names = [n for n in self._order if self._scope.get(n) == scope
                     and (n in self._acc or n in self._words)]
            for n in names:
                shape, dev = self._held(n)
                if math.prod(shape) == 0:   # e.g. a TP rank that owns no row of it
                    out[n] = torch.zeros(shape, device=dev)
            as_words = self._words_everywhere(names, comm, op)
            sizes = [(n, math.prod(self._held(n)[0])) for n in names]
            for bucket in _buckets([z for z in sizes if z[0] in as_words], _WORD_BUCKET_ELEMS):
                vals = words_finished(comm, torch.cat(
                    [self._words[n].view(2, -1)[:, a:b] for n, a, b in bucket], 1), op)
                self._store_bucket(bucket, vals, out)
            for bucket in _buckets([z for z in sizes if z[0] not in as_words]):
                self._finish_bucket(bucket, comm, op, out)
        self._acc, self._words = {}, {}
        for n in self._order:    # direct mode's splits, over the union of rows already
            if n in self._split:
                rows, acc = self._split[n]
                comm = self.groups[self._rows[n][1]]
                if n not in self._done:   # lookup-only: rows no rank looked up get +0.0
                    w = self._params[n]
                    self._done[n] = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
                self._done[n][rows] = comm.sum_ints_finished(acc, f"grad-sink:split:{n}",
                                                             fx.round_fp32)
        for n, (rows, vals) in later.items():
            out[n][rows] = vals
        out.update(self._done)
        self._done, self._rows, self._split = {}, {}, {}
        return {n: out[n] for n in self._order if n in out}

    def _round_own_words(self, scope: str, out: dict[str, torch.Tensor]) -> None:
        """Over a scope group of this rank alone, every weight held in double words is rounded
        straight into its gradient, one pass per weight (fixedpoint.round_double_words: the
        digits' bytes) and freed: nothing to all-reduce, so no bucket cut (one launch per
        weight, not per 2M elements: ~850 at qwen3-1.7b)."""
        for n in self._order:
            if self._scope.get(n) == scope and n in self._words and n not in self._acc:
                words = self._words.pop(n)
                out[n] = fx.round_double_words(
                    words, out=torch.empty(words.shape[1:], dtype=torch.float32,
                                           device=words.device))

    def _finish_split(self, name: str, out: dict[str, torch.Tensor],
                      later: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A split weight at `finish` in persistent mode (class doc), before the buckets: its
        rows' exact sums — the lookups' split digits plus, for a kept (tied) weight, its dense
        use's sums of the same rows — summed over the scope group's union of rows and rounded:
        into out[name] (zeros elsewhere) for a lookup-only weight, into later[name] for a kept
        one (written over the buckets' rounding of its dense sums). When any rank of the group
        holds the whole accumulator, this rank's split is added into its own whole one, which
        the buckets finish. Collective over the scope group (the same calls on every rank,
        whatever each one's state). RuntimeError when no lookup of a lookup-only weight reached
        this rank's sink."""
        dense = name in self._keep
        if name in self._rows:
            scope = self._rows[name][1]
        elif name in self._whole:
            scope = self._scope[name]
        elif dense:                       # never looked up here: its dense sums are all there is
            return
        else:
            raise RuntimeError(f"GradSink: {name} is a lookup-only weight but no lookup of it "
                               "reached this rank's sink in the mini-batch")
        if dense and self._scope.get(name, scope) != scope:
            raise RuntimeError(f"GradSink: {name} is split (rows noted over {scope}) but its "
                               f"dense use reduced over {self._scope[name]}")
        comm, op = self.groups[scope], f"grad-sink:split:{name}"
        whole = name in self._whole
        if comm.size > 1:
            whole = any(comm.all_gather_object(whole, f"{op}:whole"))
        if name not in self._split:       # whole here: the buckets finish it
            self._rows.pop(name, None)
            return
        rows, acc = self._split.pop(name)
        w = self._params[name]
        del self._rows[name]
        if whole:                         # another rank went whole: so does this one
            self.accumulator(w, scope)[rows] += acc
            return
        union = _union_rows(comm, rows, f"{op}:rows") if comm.size > 1 else rows
        held = fx.zeros((union.numel(), *w.shape[1:]), w.device)
        held[torch.searchsorted(union, rows)] = acc
        has_dense = dense and (name in self._acc or name in self._words)
        if has_dense:
            held += self._held_rows(name, union)
        vals = comm.sum_ints_finished(held, op, fx.round_fp32)
        if has_dense:
            later[name] = (union, vals)
            return
        grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        grad[union] = vals
        out[name] = grad

    def _held_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Digits int64 [R, *shape[1:], N_COLS] of the rows `rows` of a weight's mini-batch sum
        (words or digits); RuntimeError for a split weight whose dense use never came."""
        if name in self._words:
            words = self._words[name]
            picked = words[:, rows].reshape(2, -1)
            return _digits_of(picked).view(rows.numel(), *words.shape[2:], fx.N_COLS)
        if name in self._acc:
            return self._acc[name][rows]
        raise RuntimeError(f"GradSink: {name} is split (rows noted) but its dense use never "
                           "reached the sink")

    def _held(self, name: str) -> tuple[torch.Size, torch.device]:
        """(gradient shape, device) of a weight's mini-batch sum, digits or words."""
        if name in self._words:
            return self._words[name].shape[1:], self._words[name].device
        return self._acc[name].shape[:-1], self._acc[name].device

    def _words_everywhere(self, names: list[str], comm: Comm, op: str) -> set[str]:
        """Of `names` (the same list on every rank of comm), those every rank holds in double
        words (none over a group of one: `_round_own_words` rounded them): summed as words
        (`words_finished`), the others as digits — a rank holding words where another holds
        digits adds them to digits (`_finish_bucket`). Collective over comm (host values only:
        which weights are words is known on the host, so no device sync)."""
        if comm.size == 1 or not names:
            return set()
        held = comm.all_gather_object((names, [n in self._words for n in names]),
                                      f"{op}:as-words")
        for r, (theirs, _) in enumerate(held):
            if theirs != names:
                raise CollectiveMismatch(
                    f"GradSink.finish over {comm.name} {comm.ranks}: rank {comm.ranks[comm.rank]} "
                    f"finishes {len(names)} weights, rank {comm.ranks[r]} {len(theirs)} "
                    f"(first difference: {_first_difference(names, theirs)})")
        return {n for i, n in enumerate(names) if all(h[1][i] for h in held)}

    def _finish_bucket(self, bucket: list[tuple[str, int, int]], comm: Comm, op: str,
                       out: dict[str, torch.Tensor]) -> None:
        """Sum over comm and round one bucket of (name, first element, end) slices of the sums
        as digits: double-word slices added to digits first (a transient bucket of them) to
        be summed as integers with the other ranks'."""
        flats = [self._acc[n].view(-1, fx.N_COLS)[a:b] if n not in self._words
                 else _digits_of(self._words[n].view(2, -1)[:, a:b]) for n, a, b in bucket]
        flat = flats[0] if len(flats) == 1 else torch.cat(flats)
        self._store_bucket(bucket, comm.sum_ints_finished(flat, op, fx.round_fp32), out)

    def _store_bucket(self, bucket: list[tuple[str, int, int]], vals: torch.Tensor,
                      out: dict[str, torch.Tensor]) -> None:
        """The bucket's rounded values `vals` (fp32, its slices in order) into out, freeing each
        weight's sum once its last slice is in."""
        i = 0
        for n, a, b in bucket:
            shape, dev = self._held(n)
            if n not in out:
                out[n] = torch.empty(shape, dtype=torch.float32, device=dev)
            out[n].view(-1)[a:b] = vals[i:i + b - a]
            i += b - a
            if b == math.prod(shape):     # fully rounded: free it before the next bucket
                self._acc.pop(n, None)
                self._words.pop(n, None)


def _first_difference(a: list[str], b: list[str]) -> str:
    """The first position where two name lists differ, as 'i: x vs y' (a missing name: None)."""
    i = next(i for i in range(max(len(a), len(b)))
             if i >= len(a) or i >= len(b) or a[i] != b[i])
    return f"{i}: {a[i] if i < len(a) else None} vs {b[i] if i < len(b) else None}"


def _union_rows(comm: Comm, rows: torch.Tensor, op: str) -> torch.Tensor:
    """Ascending union of every rank's row ids (ascending long [R_r] each, R_r may differ):
    the counts, then the ids padded to the largest count with -1, all-gathered."""
    counts = comm.all_gather(torch.tensor([rows.numel()], device=rows.device), f"{op}:counts")
    most = int(max(int(c) for c in counts))
    padded = torch.full((most,), -1, dtype=rows.dtype, device=rows.device)
    padded[:rows.numel()] = rows
    every = torch.cat(comm.all_gather(padded, op))
    return torch.unique(every[every >= 0])


def _digits_of(words: torch.Tensor) -> torch.Tensor:
    """A new accumulator int64 [m, N_COLS] holding the exact sums of double words [2, m]
    (float64; only the CUDA dW kernel makes words, tests make them on the CPU)."""
    return fx.add_double_words_(fx.zeros((words.shape[1],), words.device), words)


def _round_words_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """fp32 [m]: the exact sum of every rank's double words (float64 [2, m] each, rank order)
    rounded once — the digits of each added (integers: any order), then round_fp32; one
    rank's pair is rounded straight from its words, CUDA parts in one pass with the digits
    in registers (triton_fixedpoint.round_words_sum). The same bytes every way."""
    if len(parts) == 1:
        return fx.round_double_words(parts[0])
    if parts[0].is_cuda:
        from rlkernel.numerics import triton_fixedpoint as tfx
        return tfx.round_words_sum(torch.stack(parts))
    acc = fx.zeros((parts[0].shape[1],), parts[0].device)
    for words in parts:
        fx.add_double_words_(acc, words)
    return fx.round_fp32(acc)


def words_finished(comm: Comm, words: torch.Tensor, op: str) -> torch.Tensor:
    """fp32 [*S]: the exact sum over comm's ranks of each rank's double words float64 [2, *S]
    (per element hi + lo, fixedpoint.add_double_words_'s contract), rounded once — the bytes
    of rounding the sum of every rank's digits of them, sent as the words
    (`Comm.finish_words`: 16 bytes an element, where the digits are 104). Collective."""
    return comm.finish_words(words, f"{op}:words", _round_words_sum)


_BUCKET_ROWS = 1 << 21
"""Accumulator elements per finishing all-reduce (218 MB of int64 digits)."""
_WORD_BUCKET_ELEMS = 1 << 22
"""Double-word elements per finishing exchange (64 MB of words; the rank that rounds a slice
makes its digits: 218 MB at two ranks)."""
DIRECT_CHUNK_ELEMS = 1 << 23
"""Gradient elements finished per chunk in direct mode (a transient 872 MB accumulator)."""
SPLIT_MAX_FRACTION = 0.5
"""Persistent mode: a split weight whose noted rows pass this fraction of its rows takes its whole
accumulator instead (a growing row accumulator would then cost as much, and its growth copies)."""
LATER_BYTES = 8 << 20
"""Leaf partials GradSink.add_later keeps per weight before adding them (8 MiB: four microbatches
of a 2,048-wide norm's 16-token leaves at 4,096 tokens; ~1 GiB over qwen3-1.7b's 113 norms)."""
PENDING_LAG = 8
"""Deferred direct chunks (GradSink._defer) queued at most before the oldest is waited for."""
SLOT_CHUNK = 1024
"""Flag counters per device buffer of GradSink.flag_count (a new buffer when one runs out)."""


def _buckets(sizes: list[tuple[str, int]], limit: int = 0) -> list[list[tuple[str, int, int]]]:
    """Cut tensors of `sizes` (name, elements), in order, into buckets of at most `limit`
    (default _BUCKET_ROWS) elements: (name, first element, end) slices; a tensor larger than a
    bucket is cut."""
    limit = limit or _BUCKET_ROWS
    out: list[list[tuple[str, int, int]]] = [[]]
    room = limit
    for name, n in sizes:
        a = 0
        while a < n:
            if room == 0:
                out.append([])
                room = limit
            b = min(n, a + room)
            out[-1].append((name, a, b))
            room -= b - a
            a = b
    return [b for b in out if b]


@dataclass(frozen=True)
class TokenSum:
    """How a kernel's token reductions are finished (see module doc).

    comm: the ranks that hold the other tokens of this stream (CP, or TP×CP for SP slices).
    scope: the GradSink scope of weights reduced through this TokenSum ("dp_cp" or "world").
    sink: the policy's GradSink in training passes; None elsewhere.
    """

    comm: Comm
    scope: str = "dp_cp"
    sink: GradSink | None = field(default=None, compare=False)

    @classmethod
    def single(cls) -> "TokenSum":
        return cls(Comm.single("tokens"))

    def _scope_for(self, heads: Comm | None) -> str:
        return "world" if heads is not None and heads.size > 1 else self.scope

    def finish_now(self, w: torch.Tensor, add_rows, op: str, heads: Comm | None = None,
                   words_rows=None, add_rows_at=None, word_rows=None) -> bool:
        """In the open sink's direct mode, finish w's gradient here (GradSink.finish_direct with
        `add_rows(a, b, acc)` adding this rank's leaf partials of w's rows [a, b), the optional
        `words_rows(a, b)` -> those rows rounded, or None, `add_rows_at(rows, acc)` for a
        split weight's noted rows, and `word_rows(a, b)` -> (those rows' double words, flag
        count)) and return True: the kernel then returns no gradient to autograd. False
        (nothing done) otherwise."""
        if self.sink is None or not self.sink.is_direct(w):
            return False
        self.sink.finish_direct(w, self._scope_for(heads), add_rows, op, words_rows, add_rows_at,
                                word_rows)
        return True

    def note_rows(self, w: torch.Tensor, ids: torch.Tensor, offset: int) -> None:
        """GradSink.note_rows of the open sink, over this TokenSum's scope (else nothing)."""
        if self.sink is not None and self.sink.open:
            self.sink.note_rows(w, ids, offset, self.scope)

    def add_split_rows(self, w: torch.Tensor, add_at) -> bool:
        """GradSink.add_split_rows of the sink (False without one)."""
        return self.sink is not None and self.sink.add_split_rows(w, add_at)

    def accumulator(self, w: torch.Tensor, heads: Comm | None = None) -> torch.Tensor:
        """Integer accumulator [*w.shape, N_COLS] for w's gradient: the open sink's (persistent)
        or a fresh zero one. `heads`: the TP group when w sums over heads that TP splits."""
        if self.sink is not None and self.sink.open:
            return self.sink.accumulator(w, self._scope_for(heads))
        return fx.zeros(w.shape, w.device)

    def words(self, w: torch.Tensor, heads: Comm | None = None) -> torch.Tensor | None:
        """The open sink's double words for w's gradient (GradSink.words: float64 [2, *w.shape],
        persistent over the mini-batch), or None: no open sink, or w's sum is held in digits."""
        if self.sink is not None and self.sink.open:
            return self.sink.words(w, self._scope_for(heads))
        return None

    def add_later(self, w: torch.Tensor, part: torch.Tensor, heads: Comm | None = None) -> bool:
        """GradSink.add_later of the sink over this TokenSum's scope (False without one: the
        caller adds its partials now)."""
        return self.sink is not None and self.sink.add_later(w, part, self._scope_for(heads))

    def late_counter(self, device: torch.device) -> torch.Tensor | None:
        """GradSink.late_counter of the sink (None without one: finish flagged programs now)."""
        return None if self.sink is None else self.sink.late_counter(device)

    def flag_count(self, device: torch.device) -> torch.Tensor:
        """A zeroed int32 [] flag counter for `defer_carry` (GradSink.flag_count; a new zero
        tensor without an open sink)."""
        if self.sink is not None and self.sink.open:
            return self.sink.flag_count(device)
        return torch.zeros((), dtype=torch.int32, device=device)

    def defer_carry(self, w: torch.Tensor, flagged: torch.Tensor, redo,
                    heads: Comm | None = None) -> None:
        """After a kernel continued the open sink's words for w (`words`) leaving its flag count
        `flagged` ([] int, on the device) unread: `redo(acc)` runs with w's accumulator
        (`GradSink.accumulator`: the words moved to digits) once the count is read and found
        nonzero — later, as the sink's deferred chunks (GradSink._defer), at the latest in
        `finish`. RuntimeError without an open sink."""
        sink, scope = self.sink, self._scope_for(heads)
        if sink is None or not sink.open:
            raise RuntimeError("TokenSum.defer_carry: no open gradient sink")
        sink._defer(flagged, lambda: redo(sink.accumulator(w, scope)))

    def result(self, w: torch.Tensor, acc: torch.Tensor, op: str,
               heads: Comm | None = None) -> torch.Tensor | None:
        """What the kernel returns as w's gradient: None with an open sink (it holds acc), else
        acc summed over `comm` (and `heads`) and rounded: fp32 of w's shape, in w's dtype."""
        if self.sink is not None and self.sink.open:
            return None
        if heads is not None and heads.size > 1:
            acc = heads.sum_ints(acc, op + ":heads")
        return self.comm.sum_ints_finished(acc, op, fx.round_fp32).to(w.dtype)

    def exact_sum(self, partials: torch.Tensor, op: str) -> torch.Tensor:
        """Exact sum over dim 0 of this rank's leaf partials and over every rank of `comm`,
        rounded once: [n, *S] fp32 -> [*S] fp32, identical on every rank (activation gradients,
        e.g. attention dK/dV; never kept in the sink)."""
        acc = fx.accumulate_(fx.zeros(partials.shape[1:], partials.device), partials)
        return self.round_exact(acc, op)

    def round_exact(self, acc: torch.Tensor, op: str) -> torch.Tensor:
        """This rank's exact accumulator acc (int64 [*S, N_COLS], e.g. from
        `fixedpoint.accumulate_` of its leaf partials) summed over every rank of `comm` and
        rounded once: fp32 [*S], identical on every rank. For kernels that accumulate in chunks
        (kernels/triton_attention_bwd.py); collective over `comm`."""
        return self.comm.sum_ints_finished(acc, op, fx.round_fp32)
