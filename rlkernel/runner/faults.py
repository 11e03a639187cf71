"""Fault injection for tests: `RLK_FAULT=<spec>` makes one run misbehave on purpose.

A test hook, never a flag (it is not in `rlk run --help` and not in the manifest's config): the
tests of issues 5 and 10 (tests/test_faults.py) set it to prove that every fault is caught,
named and recorded. With RLK_FAULT unset or empty every hook is a no-op that returns at once.

Spec: `KIND:ACTION:key=value:...` (one fault per run):

    sync:flip-bit|drop|shape|dtype:step=S:tensor=NAME[:rank=R][:index=I][:bit=B]
        between export and reload at step S, on rank R (default: every rank), corrupt the
        received copy of tensor NAME: flip bit B (default 0) of element I (default 0), drop it,
        give it a wrong shape (same bytes: 2-D+ flattened, 1-D made a row), or a wrong dtype
        (bf16 <-> fp32).
    engine:stale:step=S[:rank=R]
        at step S, rank R's (default: every rank's) rollout engine ignores the weight load and
        keeps serving the weights it had (the stale-weights bug).
    engine:flip-bit:step=S:tensor=NAME[:rank=R][:index=I][:bit=B]
        at step S, right after a good load, flip bit B (default 0) of element I (default 0) of
        rank R's own rollout-engine parameter NAME (its shard as held: fp32 holding bf16 values,
        so bits 0-14 are ones that rounding to bf16 would hide; the forward still reads them).
    grad:nan|inf:step=S:tensor=NAME[:rank=R]
        after backward at step S, set the first element of rank R's gradient shard of NAME to
        NaN or +Inf (default: every rank).
    rank:raise|kill|hang:step=S:rank=R[:where=step|collective]
        at step S, after backward and before the gradient-norm collective, rank R raises
        InjectedFault (a RuntimeError: what a bug looks like), SIGKILLs itself, or hangs (sleeps
        until killed, outside any collective: a reward function that never returns): where=step
        (default) right there, between collectives; where=collective (kill only) inside the next
        collective (after its signature exchange, during the data exchange; multi-rank runs).

`check(steps, world)` rejects an invalid spec (FaultSpecError, a ValueError naming the field and
what is allowed) before any process starts; a tensor name is checked at the hook (the model is
known only there).

Footgun: where=collective patches torch.distributed.all_gather in the dying process (the one
module global this file touches); that process is killed inside its next collective call.
Does not: detect anything (the audit, the exact norm and the launcher do).
Tests: `.venv/bin/python -m pytest -q tests/test_faults.py`.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

ENV = "RLK_FAULT"

_ACTIONS = {"sync": ("flip-bit", "drop", "shape", "dtype"), "grad": ("nan", "inf"),
            "rank": ("raise", "kill", "hang"), "engine": ("stale", "flip-bit")}
# Keys and required keys by kind, or by "kind:action" where an action differs from its kind.
_KEYS = {"sync": {"step", "tensor", "rank", "index", "bit"}, "grad": {"step", "tensor", "rank"},
         "rank": {"step", "rank", "where"}, "engine:stale": {"step", "rank"},
         "engine:flip-bit": {"step", "tensor", "rank", "index", "bit"}}
_REQUIRED = {"sync": {"step", "tensor"}, "grad": {"step", "tensor"}, "rank": {"step", "rank"},
             "engine:stale": {"step"}, "engine:flip-bit": {"step", "tensor"}}
_WHERE = ("step", "collective")


class FaultSpecError(ValueError):
    """RLK_FAULT is malformed; the message names the field and what is allowed."""


class InjectedFault(RuntimeError):
    """Raised by a rank on `rank:raise`: stands for a bug in that rank."""


@dataclass(frozen=True)
class Fault:
    """One parsed RLK_FAULT spec. rank None = every rank."""

    spec: str
    kind: str
    action: str
    step: int
    rank: int | None = None
    tensor: str | None = None
    where: str = "step"
    index: int = 0
    bit: int = 0

    def fires(self, kind: str, step: int, rank: int) -> bool:
        return self.kind == kind and self.step == step and self.rank in (None, rank)


def _bad(spec: str, what: str) -> FaultSpecError:
    return FaultSpecError(f"{ENV}={spec!r}: {what}")


def parse(spec: str) -> Fault:
    """Parse one spec (see module doc). Raises FaultSpecError."""
    parts = spec.split(":")
    kind = parts[0]
    if kind not in _ACTIONS:
        raise _bad(spec, f"unknown fault kind {kind!r}; allowed: {', '.join(_ACTIONS)}")
    if len(parts) < 2 or parts[1] not in _ACTIONS[kind]:
        got = parts[1] if len(parts) > 1 else ""
        raise _bad(spec, f"unknown {kind} action {got!r}; allowed: {', '.join(_ACTIONS[kind])}")
    what = f"{kind}:{parts[1]}" if f"{kind}:{parts[1]}" in _KEYS else kind
    fields: dict[str, str] = {}
    for item in parts[2:]:
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise _bad(spec, f"{item!r} is not key=value")
        if key not in _KEYS[what]:
            raise _bad(spec, f"unknown key {key!r} for {what}; "
                             f"allowed: {', '.join(sorted(_KEYS[what]))}")
        if key in fields:
            raise _bad(spec, f"key {key!r} given twice")
        fields[key] = value
    missing = sorted(_REQUIRED[what] - set(fields))
    if missing:
        raise _bad(spec, f"{what} faults need {', '.join(missing)}=...")
    ints = {}
    for key in ("step", "rank", "index", "bit"):
        if key in fields:
            if not (fields[key].isascii() and fields[key].isdigit()):
                raise _bad(spec, f"{key}={fields[key]!r} must be an integer >= 0")
            ints[key] = int(fields[key])
    where = fields.get("where", "step")
    if where not in _WHERE:
        raise _bad(spec, f"where={where!r}; allowed: {', '.join(_WHERE)}")
    if kind == "rank" and parts[1] in ("raise", "hang") and where != "step":
        raise _bad(spec, f"rank:{parts[1]} happens where=step only")
    return Fault(spec, kind, parts[1], ints["step"], ints.get("rank"), fields.get("tensor"),
                 where, ints.get("index", 0), ints.get("bit", 0))


@functools.cache
def _parse_cached(spec: str) -> Fault:
    return parse(spec)


def active() -> Fault | None:
    """The fault RLK_FAULT asks for, or None when it is unset or empty. Raises FaultSpecError."""
    spec = os.environ.get(ENV, "")
    return _parse_cached(spec) if spec else None


def check(steps: int, world: int) -> None:
    """Reject RLK_FAULT before a run starts: malformed, a step or rank the run never reaches,
    or where=collective on a one-process run (it has no collectives). No-op when unset."""
    f = active()
    if f is None:
        return
    if f.step >= steps:
        raise _bad(f.spec, f"step={f.step} is never reached: the run has --steps {steps} "
                           f"(steps 0..{steps - 1})")
    if f.rank is not None and f.rank >= world:
        raise _bad(f.spec, f"rank={f.rank} does not exist: the run has {world} rank(s)")
    if f.where == "collective" and world == 1:
        raise _bad(f.spec, "where=collective needs a multi-rank run (--tp/--cp > 1)")


def _named(f: Fault, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    if f.tensor not in tensors:
        some = ", ".join(list(tensors)[:3])
        raise _bad(f.spec, f"tensor {f.tensor!r} is not a parameter of this model (e.g. {some})")
    return tensors[f.tensor]


def _flip_bit(f: Fault, t: torch.Tensor) -> None:
    """Flip bit `f.bit` (from the least significant) of element `f.index` of contiguous `t`."""
    size = t.element_size()
    if f.index >= t.numel() or f.bit >= 8 * size:
        raise _bad(f.spec, f"index={f.index}, bit={f.bit}: {f.tensor} has {t.numel()} "
                           f"elements of {8 * size} bits")
    raw = t.view(-1).view(torch.uint8)  # little-endian: byte bit // 8 holds the bit
    with torch.no_grad():
        raw[f.index * size + f.bit // 8] ^= 1 << (f.bit % 8)


def _sigkill(f: Fault, rank: int, step: int) -> None:
    # The line lets a test (or a person) see when the rank died: its peers' timeout runs from here.
    print(f"{ENV}: rank {rank} SIGKILLs itself at step {step} (where={f.where})", file=sys.stderr,
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# the hooks (one call site each in rlkernel/runner/loop.py)


def tamper(step: int, rank: int) -> Callable[[dict[str, torch.Tensor]], None] | None:
    """The `tamper` argument of sync_weights for this step and rank (None: leave the copy)."""
    f = active()
    if f is None or not f.fires("sync", step, rank):
        return None

    def corrupt(received: dict[str, torch.Tensor]) -> None:
        t = _named(f, received)
        if f.action == "drop":
            del received[f.tensor]
        elif f.action == "dtype":
            received[f.tensor] = t.to(torch.float32 if t.dtype != torch.float32 else torch.bfloat16)
        elif f.action == "shape":
            received[f.tensor] = t.reshape(-1) if t.dim() > 1 else t.reshape(1, -1)
        else:
            _flip_bit(f, t)  # received copies are contiguous
    return corrupt


def load(step: int, rank: int) -> Callable[[object, dict[str, torch.Tensor]], None] | None:
    """The `load` argument of sync_weights for this step and rank (None: a normal load)."""
    f = active()
    if f is None or not f.fires("engine", step, rank):
        return None

    def misbehave(engine, received: dict[str, torch.Tensor]) -> None:
        if f.action == "stale":
            return  # the load is dropped: the engine keeps the weights it had
        engine.load_weights(received)
        _flip_bit(f, _named(f, engine.held_weights()))  # the engine's own parameter, in place
    return misbehave


def corrupt_grads(step: int, rank: int, grads: dict[str, torch.Tensor]) -> None:
    """Put NaN/Inf into the first element of this rank's gradient shard of the named tensor."""
    f = active()
    if f is None or not f.fires("grad", step, rank):
        return
    g = _named(f, grads)
    with torch.no_grad():
        g[(0,) * g.dim()] = float("nan") if f.action == "nan" else float("inf")


def maybe_die(step: int, rank: int) -> None:
    """Raise InjectedFault, or SIGKILL this process now or inside its next collective."""
    f = active()
    if f is None or not f.fires("rank", step, rank):
        return
    if f.action == "raise":
        # Announced as the kill and hang faults are, so a test can time the stop from here.
        print(f"{ENV}: rank {rank} raises at step {step}", file=sys.stderr, flush=True)
        raise InjectedFault(f"{ENV}: rank {rank} raised at step {step} ({f.spec})")
    if f.action == "hang":
        print(f"{ENV}: rank {rank} hangs at step {step}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    if f.where == "step":
        _sigkill(f, rank, step)
    import torch.distributed as dist

    real, calls = dist.all_gather, []

    def all_gather_then_die(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # rlkernel.distributed.comm: signature exchanged, data exchange in flight
            _sigkill(f, rank, step)
        return real(*args, **kwargs)

    dist.all_gather = all_gather_then_die
