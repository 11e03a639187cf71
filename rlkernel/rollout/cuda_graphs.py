"""CUDA graphs for the rollout engine's decode steps: one graph per batch-size bucket.

Why: a decode step of the invariant engine is ~125 kernel launches per layer driven from Python;
measured on one H200 (qwen3-0.6b, 32 sequences) the device was busy 11 % of the step's wall time
(docs/BENCHMARKS.md, "Rollout engine profile"). Replaying a captured graph launches the whole
step — model pass, log-softmax, sampler, the scatters into the call's token/logprob buffers — as
one graph (vLLM's and nano-vllm's decode graphs; PyTorch `torch.cuda.CUDAGraph`).

A decode step of B sequences runs on the graph of the smallest bucket Bp >= B (BUCKETS: powers
of two and their 1.5× steps, so a padded step does at most a third more rows). Its static index
buffers hold the step's metadata (the engine's `_step_metadata`, the same function as the eager
step) padded to Bp rows and to the call's widest block table; each step writes them with one
pinned host→device copy, then replays.
Why the bytes do not move: every kernel is row-invariant, so padding rows (a pad token at
position 0 attending to one zero key, writing its K/V to the dump block and its token, logprob and
EOS flag to the buffers' dump row) change no other row; the paged attention kernel reads only a
row's blocks below ceil(kv_len / block), so the wider table is never read past them; the RoPE
lookup reads rows by position; and a replay runs the captured kernels with the shapes and
arguments of the eager run that preceded the capture. Tests compare tokens and logprob bytes of
graph and eager rollouts (tests/test_cuda_rollout.py) and, on any device, of the padded static
path run eagerly (mode "padded") against the plain eager engine (tests/test_rollout_graphs.py).
Lifetime: that of the engine state they point into (the KV pool and the token/logprob buffers:
one `generate` call, or many for an engine with keep_state, rollout/engine.py); a bucket is
captured the first time a step needs it, right after running that step eagerly on the same
static buffers (the warm-up that compiles the Triton kernels and does the step's real work —
capturing records kernels, it runs nothing), or all at once by `prepare` on padding rows only.
The graphs share one memory pool.
Does not: capture steps that prefill or copy blocks (copy-on-write), or any step under rollout
TP or CP (their collectives check call signatures on the host); those run eagerly.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
from torch.profiler import record_function

MODES = ("auto", "eager", "padded")
"""Engine `decode_graphs` settings: "auto" (CUDA graphs for decode on CUDA at rollout TP = CP = 1,
eager elsewhere), "eager" (never; `rlk run --enforce-eager`), "padded" (the graph path's padded
static-buffer steps, run eagerly without capture, on any device: tests check its bytes on CPU)."""

BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
           1536, 2048, 3072, 4096)
"""Decode batch sizes that get a graph; a step of B sequences pads to the smallest >= B."""

_KEYS_1D = ("src", "positions", "kv_len", "rows", "sample_ids", "sample_pos", "tok_dst",
            "lp_dst", "slots_sampled", "real")
_KEYS_2D = ("q_idx", "q_pos", "slots")     # [Bp, 1]: one query per decode row
_ROW_KEYS = ("q_idx", "rows")               # a padding row's own stream row: arange, not a fill


def check_mode(mode: str) -> str:
    """`mode` if it is one of MODES, else ValueError naming the allowed ones."""
    if mode not in MODES:
        raise ValueError(f"decode_graphs={mode!r}: allowed: {', '.join(MODES)}")
    return mode


def bucket(b: int) -> int:
    """Rows of the graph that runs a decode step of `b` >= 1 sequences. ValueError past the
    largest bucket."""
    for n in BUCKETS:
        if n >= b:
            return n
    raise ValueError(f"decode batch of {b} sequences: no CUDA graph bucket (largest "
                     f"{BUCKETS[-1]}); lower max_seqs")


def is_decode(plan) -> bool:
    """A decode step (StepPlan.is_decode) whose batch a bucket holds (a larger one, beyond
    BUCKETS[-1] sequences, runs eagerly)."""
    return plan.is_decode and len(plan.chunks) <= BUCKETS[-1]


class Pads:
    """Where padding rows point: the dump row of the token/logprob/EOS buffers (row `n` of
    buffers with n + 1 rows), the KV cache's dump slot and zero block, and the call's widths."""

    def __init__(self, n: int, width: int, max_new: int, dump_slot: int, zero_block: int,
                 table_width: int) -> None:
        self.n, self.width, self.max_new = n, width, max_new
        self.dump_slot, self.zero_block, self.table_width = dump_slot, zero_block, table_width

    def fill(self, key: str) -> int:
        """Padding value of `key` in every padding row (q_idx and rows: the row itself, not
        here)."""
        return {"src": self.n * self.width, "positions": 0, "kv_len": 1,
                "sample_ids": 0, "sample_pos": 0, "tok_dst": self.n * self.width,
                "lp_dst": self.n * self.max_new, "slots_sampled": self.n, "real": 0,
                "q_pos": 0, "slots": self.dump_slot}[key]


def pad_decode(arrays: dict[str, torch.Tensor], bp: int, pads: Pads) -> dict[str, torch.Tensor]:
    """A decode step's host metadata (engine `_step_metadata`: B rows, one query each) padded to
    `bp` rows and the table to pads.table_width columns; adds `real` [bp] (1 = a real row).
    ValueError if the step is not decode-shaped or does not fit."""
    b = arrays["src"].shape[0]
    table = arrays["table"]
    if (b > bp or arrays["q_idx"].shape != (b, 1) or arrays["rows"].shape != (b,)
            or table.shape[1] > pads.table_width):
        raise ValueError(f"pad_decode: a step of {b} rows, q_idx {tuple(arrays['q_idx'].shape)}, "
                         f"table {tuple(table.shape)} does not fit {bp} rows × "
                         f"{pads.table_width} blocks")
    src = dict(arrays, real=torch.ones(b, dtype=torch.long))
    out = {}
    for key in _KEYS_1D + _KEYS_2D:
        a = src[key].reshape(b)
        tail = (torch.arange(b, bp) if key in _ROW_KEYS
                else torch.full((bp - b,), pads.fill(key), dtype=torch.long))
        out[key] = torch.cat([a, tail]).reshape((bp, 1) if key in _KEYS_2D else (bp,))
    t = torch.full((bp, pads.table_width), pads.zero_block, dtype=torch.long)
    t[:b, :table.shape[1]] = table
    out["table"] = t
    return out


def _no_rows() -> dict[str, torch.Tensor]:
    """Host metadata of a decode step with no sequence (pad_decode then fills every row)."""
    out = {k: torch.zeros(0, dtype=torch.long) for k in _KEYS_1D if k != "real"}
    out.update({k: torch.zeros(0, 1, dtype=torch.long) for k in _KEYS_2D},
               table=torch.zeros(0, 0, dtype=torch.long))
    return out


def split_flat(flat: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Views of consecutive pieces of the 1-D `flat`, one per name, in `shapes`' order."""
    out, off = {}, 0
    for k, s in shapes.items():
        n = math.prod(s)
        out[k] = flat[off:off + n].view(s)
        off += n
    return out


class _Bucket:
    """Static device buffers of one bucket (views into one int64 tensor) and its graph."""

    def __init__(self, bp: int, table_width: int, device: torch.device) -> None:
        shapes = {k: (bp,) for k in _KEYS_1D}
        shapes.update({k: (bp, 1) for k in _KEYS_2D}, table=(bp, table_width))
        self.flat = torch.zeros(sum(math.prod(s) for s in shapes.values()), dtype=torch.long,
                                device=device)
        self.views = split_flat(self.flat, shapes)
        self.graph: torch.cuda.CUDAGraph | None = None

    def write(self, arrays: dict[str, torch.Tensor]) -> None:
        host = torch.cat([arrays[k].reshape(-1) for k in self.views])
        if self.flat.is_cuda:
            host = host.pin_memory()     # async copy: no host sync; the pinned block is kept
        self.flat.copy_(host, non_blocking=self.flat.is_cuda)   # alive until the copy is done


class DecodeGraphs:
    """Runs an engine's decode steps on padded static buffers, replaying one CUDA graph per
    bucket (`capture`), or eagerly on the same padded buffers (`capture=False`, mode "padded").

    body(t, tk, pos_bound): the engine's step on index tensors t (the keys of pad_decode) — model
    pass, log-softmax, sampling, scatters into the call's buffers, all on the device.
    metadata(plan): the step's host metadata (engine `_step_metadata` arrays).
    """

    def __init__(self, body: Callable[[dict, int, int], None],
                 metadata: Callable[[object], dict[str, torch.Tensor]], pads: Pads, block: int,
                 device: torch.device, capture: bool) -> None:
        self.body, self.metadata, self.pads = body, metadata, pads
        self.block, self.device, self.capture = block, torch.device(device), capture
        self.buckets: dict[int, _Bucket] = {}
        self.pool = None
        self.stream: torch.cuda.Stream | None = None
        self.steps = 0
        self.capture_s = 0.0
        """Host seconds spent capturing graphs (each capture waits for the device first)."""

    def step(self, plan) -> None:
        """Run one decode step (is_decode(plan)) of len(plan.chunks) sequences."""
        bp = bucket(len(plan.chunks))
        bk = self._bucket(bp)
        with record_function("rollout.metadata"):
            bk.write(pad_decode(self.metadata(plan), bp, self.pads))
        self.steps += 1
        if bk.graph is not None:
            with record_function("rollout.graph_replay"):
                bk.graph.replay()
            return
        self._eager(bk)
        if self.capture:
            self._capture(bk)

    def prepare(self, rows: int) -> None:
        """Make every bucket up to bucket(rows) ready before any step needs it (a serving
        engine's start-up; vLLM captures its decode graphs when it starts): each runs one step
        of padding rows only (which write nothing but the dump row and dump block) eagerly,
        then is captured (`capture`). ValueError past the largest bucket."""
        top = bucket(rows)
        for bp in [b for b in BUCKETS if b <= top]:
            bk = self._bucket(bp)
            if bk.graph is not None:
                continue
            bk.write(pad_decode(_no_rows(), bp, self.pads))
            self._eager(bk)
            if self.capture:
                self._capture(bk)

    def _bucket(self, bp: int) -> _Bucket:
        bk = self.buckets.get(bp)
        if bk is None:
            bk = self.buckets[bp] = _Bucket(bp, self.pads.table_width, self.device)
        return bk

    def _eager(self, bk: _Bucket) -> None:
        self.body(bk.views, self.pads.table_width * self.block, self.pads.width)

    def _capture(self, bk: _Bucket) -> None:
        # The eager run just before compiled every kernel at these shapes; capture only records.
        # Not `torch.cuda.graph`: on entry it empties torch's device and pinned-host caches (and
        # may run gc), which the next steps then pay for again in fresh allocations — per
        # bucket, per call. The side stream and the capture calls are the ones it makes.
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            g.capture_begin(*(() if self.pool is None else (self.pool,)))
            try:
                self._eager(bk)
            finally:
                g.capture_end()
        self.pool = g.pool()
        bk.graph = g
        self.capture_s += time.perf_counter() - t0

    @property
    def used(self) -> list[int]:
        """Buckets that ran a step (each captured once, unless capture is off), ascending."""
        return sorted(self.buckets)
