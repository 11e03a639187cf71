"""Token-stream layouts: how a batch of sequences is laid out for one forward pass.

Every per-token op (linears, norms, MLP) runs on a flat stream [L, ...]; attention runs per sample
on [S, heads, T, D]. A `StreamLayout` says which stream row holds each (sample, slot) and at which
absolute position, so the same model code serves the trainer's packed microbatches, the rollout's
prefill and its one-token decode steps. `to_samples` / `to_stream` move rows between the two
layouts with exact (copy-only) forward and backward: every stream row appears at most once.
Does not: decide packing (rlkernel/data/packing.py) or CP placement (rlkernel/distributed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from rlkernel.kernels.slots import (SlotMoves, gather_slots, run_slot_map, scatter_slots,
                                   slot_moves)
from rlkernel.spec import TOKEN_LEAF


class PackedSegments(NamedTuple):
    """A packed causal stream cut into the segments of a variable-length (cu_seqlens) attention
    call (FlashAttention-2, Dao 2023, its varlen entry point; torch.nn.attention.varlen):
    `StreamLayout.packed_segments`."""

    cu_seqlens: torch.Tensor
    """[N + 1] int32: segment boundaries, 0 first and the stream's row count last."""
    max_len: int
    """Rows of the longest segment (host int: flash's max_q and max_k)."""
    owned: torch.Tensor | None
    """[L] bool: rows holding some sample's live slot; None when every row does."""
    n_rows: int
    """L, the stream's rows (host int)."""


@dataclass(frozen=True)
class StreamLayout:
    """Layout of one forward pass.

    tokens [L] long: the stream (padding rows hold any valid id).
    positions [L] long: absolute position of each row in its own sequence (padding: 0).
    q_idx [S, T] long: stream row of slot t of sample s, −1 for empty slots.
    q_pos [S, T] long: absolute position of that slot, −1 for empty slots.
    kv_len [S] long: keys of each sample visible after this pass (cache length for decode).
    kv_idx [S, Tk] long: row of key slot t in the *logical* stream (CP gathers it); None = q_idx.
        Under CP, q_idx indexes this rank's local rows, kv_idx the logical ones.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    q_idx: torch.Tensor
    q_pos: torch.Tensor
    kv_len: torch.Tensor
    kv_idx: torch.Tensor | None = None
    pos_bound: int | None = None
    """Host-known bound > every position (None: read from `positions`, a host sync on CUDA)."""
    dense_causal: bool = False
    """Host-known: slot t of every sample holds position t (t < kv_len, −1 after) and the keys
    are this pass's own slots, so plain causal masking is the whole mask (stock SDPA may then
    take its flash path; the invariant kernels do not look at it)."""
    _moves: dict = field(default_factory=dict, compare=False, repr=False)
    """Per-pass cache of `moves`' index tensors (every layer reuses them) and of
    `attention_bounds`."""

    def moves(self, idx: torch.Tensor, n_rows: int) -> "SlotMoves":
        """The index tensors `to_samples` / `to_stream` derive from idx (this layout's q_idx or
        keys_idx) for a stream of n_rows rows, computed once per pass instead of per call."""
        key = (id(idx), n_rows)        # idx is one of this layout's own tensors: a stable id
        if key not in self._moves:
            self._moves[key] = slot_moves(idx, n_rows)
        return self._moves[key]

    def attention_bounds(self) -> tuple[int, int]:
        """(largest q_pos, largest kv_len) as host ints (-1 / 0 when empty): what the CUDA
        attention backward sizes its leaves and key range by. Computed once per layout, free on
        host tensors; `to` carries them over, so a layout moved to the GPU costs no sync."""
        if "bounds" not in self._moves:
            top_pos = int(self.q_pos.max()) if self.q_pos.numel() else -1
            top_len = int(self.kv_len.max()) if self.kv_len.numel() else 0
            self._moves["bounds"] = (top_pos, top_len)
        return self._moves["bounds"]

    @property
    def n_samples(self) -> int:
        return self.q_idx.shape[0]

    @property
    def keys_idx(self) -> torch.Tensor:
        return self.q_idx if self.kv_idx is None else self.kv_idx

    def to(self, device: torch.device) -> "StreamLayout":
        """The same layout with its index tensors on `device`."""
        if self.tokens.device == torch.device(device):
            return self
        def mv(t):
            return None if t is None else upload(t, device)
        # The positions' bound, known here on the host, spares the RoPE lookup its device read.
        bound = self.pos_bound
        if bound is None and self.positions.device.type == "cpu":
            bound = int(self.positions.max().clamp(min=0)) + 1 if self.positions.numel() else 1
        moved = StreamLayout(mv(self.tokens), mv(self.positions), mv(self.q_idx), mv(self.q_pos),
                             mv(self.kv_len), mv(self.kv_idx), bound, self.dense_causal)
        moved._moves["bounds"] = self.attention_bounds()   # read here, before the move
        rows = self.packed_rows()
        moved._moves["packed"] = None if rows is None else (mv(rows[0]), mv(rows[1]), rows[2])
        seg = self.packed_segments()
        moved._moves["segments"] = None if seg is None else seg._replace(
            cu_seqlens=mv(seg.cu_seqlens), owned=mv(seg.owned))
        for idx, new in ((self.q_idx, moved.q_idx), (self.kv_idx, moved.kv_idx)):
            if idx is not None:
                moved._moves[("prefix", id(new))] = self.slots_are_prefix(idx)
        return moved

    def slots_are_prefix(self, idx: torch.Tensor) -> bool:
        """Host-known: slot t of sample s is stream row s·T + t for every slot of idx [S, T]
        (one of this layout's own index tensors): equal-length samples packed back to back, as
        a training microbatch of one response length is. Their slot view is then the stream's
        first S·T rows reshaped, and `to_samples` / `to_stream` need no gather or scatter.
        Free on host tensors (`to` carries it over); False for a layout built on the device
        without it (a rollout step: reading it would sync)."""
        key = ("prefix", id(idx))
        if key not in self._moves:
            self._moves[key] = (not idx.is_cuda and idx.numel() > 0 and torch.equal(
                idx.reshape(-1), torch.arange(idx.numel(), dtype=idx.dtype)))
        return self._moves[key]

    def packed_rows(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Host-known: (q_rows [S], k_rows [S] long, tk) when every sample's slots are one run
        of consecutive stream rows — query slot t < n_s is row q_rows[s] + t with n_s the slots
        whose q_pos >= 0, which come first, and key slot j < kv_len[s] is row k_rows[s] + j of
        the key stream (tk = keys_idx's slots) — as the packer lays out a training microbatch
        (and CP's local rows keep it); else None. Then attention can read the streams in place
        (kernels/attention.attention_packed) instead of gathering per-sample copies. Free on
        host tensors (`to` carries it); None for a layout built on the device (a rollout step:
        reading it would sync)."""
        if "packed" not in self._moves:
            self._moves["packed"] = _packed_rows(self)
        return self._moves["packed"]

    def packed_segments(self) -> PackedSegments | None:
        """Host-known: this pass's stream as the segments of one variable-length causal
        attention call, when a sample's keys are its own queries' rows in this stream: a
        `dense_causal` layout, no CP key gather (kv_idx None), `packed_rows` whose query and
        key runs agree and hold kv_len[s] rows each, with strictly increasing starts. Segment s
        runs from sample s's first row to the next sample's (the last: to the stream's end), so
        it holds the sample's live rows and then any padding rows; causal masking keeps every
        live query from those padding keys. Rows before the first sample, if any, form a
        leading segment owned by no sample. Else None. Free on host tensors (`to` carries it);
        None for a layout built on the device."""
        if "segments" not in self._moves:
            self._moves["segments"] = _packed_segments(self)
        return self._moves["segments"]


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t on `device`. A CPU tensor bound for a GPU is copied from pinned memory without blocking
    the host: a copy from pageable memory waits for the device's queue to drain first (a host
    sync per tensor moved: 8 per microbatch layout, docs/BENCHMARKS.md). The caching host
    allocator keeps the pinned block until the copy has run."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _run_starts(idx: torch.Tensor, count: torch.Tensor) -> torch.Tensor | None:
    """[S] first rows if idx [S, T]'s first count[s] slots of each sample are consecutive rows
    (and any later ones −1), else None."""
    first = idx[:, 0].clamp(min=0)
    inside = torch.arange(idx.shape[1])[None, :] < count[:, None]
    return first if torch.equal(idx, run_slot_map(first, inside)) else None


def _packed_rows(lay: StreamLayout):
    if lay.q_idx.is_cuda or lay.q_idx.numel() == 0 or lay.keys_idx.shape[1] == 0:
        return None
    n_q = (lay.q_pos >= 0).sum(1)
    if not torch.equal(lay.q_idx >= 0, lay.q_pos >= 0) or n_q.numel() != lay.kv_len.numel():
        return None
    n_k = (lay.keys_idx >= 0).sum(1)
    if bool((n_k < lay.kv_len).any()):
        return None
    q_rows = _run_starts(lay.q_idx, n_q)
    k_rows = _run_starts(lay.keys_idx, n_k)
    if q_rows is None or k_rows is None:
        return None
    return q_rows, k_rows, lay.keys_idx.shape[1]


def _packed_segments(lay: StreamLayout) -> PackedSegments | None:
    rows = lay.packed_rows()
    if rows is None or not lay.dense_causal or lay.kv_idx is not None:
        return None
    q_rows, k_rows, _ = rows
    n_q = (lay.q_pos >= 0).sum(1)
    if not torch.equal(q_rows, k_rows) or not torch.equal(n_q, lay.kv_len):
        return None
    n_rows = lay.tokens.shape[0]
    starts, counts = q_rows.tolist(), n_q.tolist()
    ends = starts[1:] + [n_rows]
    if any(e <= s or s + c > e for s, c, e in zip(starts, counts, ends)):
        return None                                # starts not increasing, or past the end
    cuts = ([0] if starts[0] > 0 else []) + starts + [n_rows]
    owned = None
    if sum(counts) < n_rows:                       # padding or leading rows: no sample's
        owned = torch.zeros(n_rows, dtype=torch.bool)
        owned[lay.q_idx[lay.q_idx >= 0]] = True
    return PackedSegments(torch.tensor(cuts, dtype=torch.int32),
                          max(b - a for a, b in zip(cuts, cuts[1:])), owned, n_rows)


def _check_leaf(leaf: int) -> None:
    if leaf < TOKEN_LEAF or leaf % TOKEN_LEAF:
        raise ValueError(f"stream leaf {leaf} is not a positive multiple of TOKEN_LEAF={TOKEN_LEAF}")


def sample_offsets(lengths: list[int], leaf: int = TOKEN_LEAF) -> list[int]:
    """Stream row where each sample starts in a packed stream: samples back to back, each
    starting at a multiple of `leaf` (spec.stream_leaf of the backend: so a token leaf never
    holds two samples). ValueError for a leaf that is not a multiple of TOKEN_LEAF."""
    _check_leaf(leaf)
    out, off = [], 0
    for n in lengths:
        out.append(off)
        off += -(-n // leaf) * leaf
    return out


def packed_len(lengths: list[int], multiple: int, leaf: int = TOKEN_LEAF) -> int:
    """Rows of the packed stream of samples of `lengths`: the leaf-aligned samples, padded at the
    end to a positive multiple of `multiple` (itself a multiple of `leaf`; ValueError)."""
    _check_leaf(leaf)
    if multiple < 1 or multiple % leaf:
        raise ValueError(f"packed_len: multiple {multiple} is not a multiple of the stream "
                         f"leaf {leaf}")
    used = sum(-(-n // leaf) * leaf for n in lengths)
    return max(1, -(-used // multiple)) * multiple


def packed_layout(seqs: list[list[int]], pad_id: int, multiple: int = TOKEN_LEAF,
                  leaf: int = TOKEN_LEAF) -> StreamLayout:
    """Training (and CP prefill) layout: sample i starts at row sample_offsets(..., leaf)[i] (a
    multiple of `leaf`), padding fills the gaps and the end up to packed_len(lengths, multiple,
    leaf) rows. The alignment never changes a number: kernels are row-invariant and reduce over
    sample-relative leaves, and padding rows add exact zeros.

    seqs: token ids per sample (positions start at 0 each). Padding rows hold pad_id at position
    0 and belong to no sample: they never shift a real token, and their gradient rows are zero.
    """
    stream_len = packed_len([len(s) for s in seqs], multiple, leaf)
    t_max = max(len(s) for s in seqs)
    tokens = torch.full((stream_len,), pad_id, dtype=torch.long)
    positions = torch.zeros(stream_len, dtype=torch.long)
    q_idx = torch.full((len(seqs), t_max), -1, dtype=torch.long)
    q_pos = torch.full((len(seqs), t_max), -1, dtype=torch.long)
    for i, (s, off) in enumerate(zip(seqs, sample_offsets([len(s) for s in seqs], leaf))):
        n = len(s)
        tokens[off:off + n] = torch.tensor(s, dtype=torch.long)
        positions[off:off + n] = torch.arange(n)
        q_idx[i, :n] = torch.arange(off, off + n)
        q_pos[i, :n] = torch.arange(n)
    kv_len = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    return StreamLayout(tokens, positions, q_idx, q_pos, kv_len, dense_causal=True)


def chunk_layout(chunks: list[list[int]], starts: list[int], pad_id: int) -> StreamLayout:
    """Rollout layout: sample s feeds `chunks[s]` at positions starts[s] .. (one row block each).

    Used for prefill (starts = 0), chunked prefill and decode (one token per sample). The stream is
    [S · T] with T = the longest chunk; short chunks are padded at their end.
    """
    s_n = len(chunks)
    t = max(1, max(len(c) for c in chunks))
    tokens = torch.full((s_n * t,), pad_id, dtype=torch.long)
    positions = torch.zeros(s_n * t, dtype=torch.long)
    q_idx = torch.full((s_n, t), -1, dtype=torch.long)
    q_pos = torch.full((s_n, t), -1, dtype=torch.long)
    for i, (c, st) in enumerate(zip(chunks, starts)):
        n = len(c)
        rows = torch.arange(i * t, i * t + n)
        tokens[rows] = torch.tensor(c, dtype=torch.long)
        positions[rows] = torch.arange(st, st + n)
        q_idx[i, :n] = rows
        q_pos[i, :n] = torch.arange(st, st + n)
    kv_len = torch.tensor([st + len(c) for c, st in zip(chunks, starts)], dtype=torch.long)
    return StreamLayout(tokens, positions, q_idx, q_pos, kv_len)


class _ToSamples(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mv: SlotMoves) -> torch.Tensor:
        ctx.mv = mv
        return gather_slots(x, mv)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        # A stream row is read by one slot at most: its gradient is that slot's, copied.
        return scatter_slots(dy, ctx.mv), None


class _ToStream(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, mv: SlotMoves) -> torch.Tensor:
        ctx.mv = mv
        return scatter_slots(y, mv)

    @staticmethod
    def backward(ctx, dx: torch.Tensor):
        return gather_slots(dx, ctx.mv), None


def _moves_of(idx: torch.Tensor, n_rows: int, lay: StreamLayout | None) -> SlotMoves:
    return lay.moves(idx, n_rows) if lay is not None else slot_moves(idx, n_rows)


def _prefix(idx: torch.Tensor, n_rows: int, lay: StreamLayout | None) -> bool:
    return lay is not None and idx.numel() <= n_rows and lay.slots_are_prefix(idx)


def slots_are_views(lay: StreamLayout, n_q_rows: int, n_k_rows: int) -> bool:
    """Whether `to_samples` of lay's query slots (a stream of n_q_rows) and of its key slots
    (n_k_rows) are both views, and `to_stream` a reshape: no copies at all."""
    return _prefix(lay.q_idx, n_q_rows, lay) and _prefix(lay.keys_idx, n_k_rows, lay)


def to_samples(x: torch.Tensor, q_idx: torch.Tensor,
               lay: StreamLayout | None = None) -> torch.Tensor:
    """Stream rows [L, ...] -> per-sample slots [S, T, ...] (empty slots 0). Exact both ways.
    lay: the layout q_idx belongs to (its index tensors are then derived once per pass; when
    its slots are the stream's first rows in order, the result is a view of x: no copy)."""
    if _prefix(q_idx, x.shape[0], lay):
        m = q_idx.numel()
        return (x if m == x.shape[0] else x[:m]).view(q_idx.shape + x.shape[1:])
    return _ToSamples.apply(x, _moves_of(q_idx, x.shape[0], lay))


def to_stream(y: torch.Tensor, q_idx: torch.Tensor, n_rows: int,
              lay: StreamLayout | None = None) -> torch.Tensor:
    """Per-sample slots [S, T, ...] -> stream rows [n_rows, ...] (rows no slot maps to: 0).
    When lay's slots are the stream's first rows in order: y's rows in order (one copy when y
    is a strided view), then the +0 padding rows."""
    if _prefix(q_idx, n_rows, lay):
        rows = y.reshape((-1,) + y.shape[2:])
        pad = n_rows - rows.shape[0]
        return rows if pad == 0 else torch.cat([rows, rows.new_zeros((pad,) + rows.shape[1:])])
    return _ToStream.apply(y, _moves_of(q_idx, n_rows, lay))


def cp_local_layout(lay: StreamLayout, local_rows: torch.Tensor) -> StreamLayout:
    """This CP rank's view of a packed training layout.

    local_rows [Lc] long: logical-stream rows this rank holds, in local order (its zig-zag
    segments). Tokens/positions are cut to those rows; each sample's query slots keep the
    positions held here (q_idx -> local row); keys stay logical (kv_idx).
    """
    n = lay.tokens.shape[0]
    local_of = torch.full((n,), -1, dtype=torch.long)
    local_of[local_rows] = torch.arange(local_rows.numel())
    here = (lay.q_idx >= 0) & (local_of[lay.q_idx.clamp(min=0)] >= 0)
    t_loc = max(1, int(here.sum(1).max().item()))
    s_n = lay.q_idx.shape[0]
    q_idx = torch.full((s_n, t_loc), -1, dtype=torch.long)
    q_pos = torch.full((s_n, t_loc), -1, dtype=torch.long)
    for s in range(s_n):
        slots = here[s].nonzero(as_tuple=True)[0]
        k = slots.numel()
        q_idx[s, :k] = local_of[lay.q_idx[s, slots]]
        q_pos[s, :k] = lay.q_pos[s, slots]
    return StreamLayout(lay.tokens[local_rows], lay.positions[local_rows], q_idx, q_pos,
                        lay.kv_len, lay.q_idx)
