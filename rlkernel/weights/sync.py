"""Weight sync with an audit: export → copy to the rollout engine → load → compare.

After every update the trainer exports its logical weights (parameter dtype); the engine, which
runs in the trainer's processes, receives its own copy of each tensor (a copy on the device the
weights live on: no serialisation, no trip through host memory), loads it, and every rank checks,
naming each tensor it finds wrong:
  transit — the received copy has the trainer's dtype, shape and bytes (a byte comparison; a
            differing tensor is hashed on this failure path to name what arrived);
  version — what the engine computes with after the load has the trainer's bytes, tensor by
            tensor, and so the trainer's per-tensor SHA-256 and version (the Merkle root over
            them). Success path, no collective but one small exchange: each rank compares its
            own parameters (its TP shards and its own copies of replicated tensors, the very
            tensors its forward reads, in their storage dtype) byte for byte with what loading
            the trainer's export puts there (engine.held_form); the ranks' verdicts are
            gathered, and when every rank of every rollout group holds exactly that, the
            engine's logical weights are the export (a held dtype must represent every exported
            value, and the export is in the engine's parameter dtype: one --dtype for both).
            Failure path, entered by every rank alike when any rank flags a tensor or rejects
            the load: the engine's read-back over rollout TP (this rank's view, never rounded
            into a value it does not hold) is compared with the export; a tensor that differs is
            hashed, so the problem names the version found (and says so when it is the one
            served before: a load that did not happen);
  reload  — on the failure path, for each tensor the version check flags, whether this rank's
            own shard is, byte for byte, what loading the received copy puts there: names the
            rank at fault.
Nothing is silently tolerated. Cost per step: one SHA-256 pass over the trainer's logical
weights split over the ranks that hold them (`comm`: rank r digests every size-th 8 MiB chunk
on a thread pool and the 32-byte digests are exchanged, weights/hashing.py; the hashes go into
the evidence), one device copy and two byte comparisons (received copy; held parameters), the
ranks' verdicts (one all_gather_object of a bool); the read-back all-gather, hashing of the
engine's tensors and the reload check run only on the failure path.
Which ranks hash what: each chunk of the export is read on one rank only, so the evidence's
hashes are of the ranks' exports taken together; they are one tensor set because every rank
of the world holds the same export (TP all-gathers it; DP and CP replicas hold the bytes the
optimizer's gathers gave them), an invariant this audit does not check across ranks.
Does not: move weights between processes (rlkernel/distributed) or decide what to do on failure (loop).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from rlkernel.weights.hashing import (compare_hashes, same_bytes, state_hashes, tensor_hash,
                                      version_hash)


@dataclass(frozen=True)
class SyncAudit:
    """Trainer-side hashes, version, and the problems found on the rollout side (empty = ok)."""

    version: str
    tensor_hashes: dict[str, str]
    problems: tuple[str, ...]
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent on this rank, in order: trainer_hash_s (hashing: this rank's share of the
    chunk digests and their exchange), copy_load_s (the transfer: the engine's copy and its
    load), engine_check_s (this rank's parameters against the export, and the exchange of the
    ranks' verdicts), failure_path_s (the engine's read-back over rollout TP, hashing what
    differs and the version/reload checks; 0.0 when no rank flagged anything), check_s (the
    received copy's bytes against the export)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def record(self) -> dict:
        return {"version": self.version, "tensor_hashes": self.tensor_hashes,
                "weight_audit": {"ok": self.ok, "problems": list(self.problems)}}


def sync_weights(exported: dict[str, torch.Tensor], engine,
                 tamper: Callable[[dict[str, torch.Tensor]], None] | None = None,
                 load: Callable[[object, dict[str, torch.Tensor]], None] | None = None,
                 previous: str | None = None, comm=None) -> SyncAudit:
    """Send `exported` (the trainer's logical weights, canonical order) to `engine` and audit,
    on this rank, what the engine computes with afterwards (module doc: transit, version, reload).

    `engine` provides load_weights(tensors), exported_weights() (logical tensors it computes
    with; a collective under rollout TP), held_weights() (this rank's own parameters, the
    tensors its forward reads) and held_form(name, t) (what load_weights puts into
    held_weights()[name] from logical t): rlkernel/rollout/engine.py.
    `previous`: the version the engine served before this sync, so that a version check that
    finds it says the engine kept serving it (the stale-weights bug).
    `comm`: a rlkernel.distributed.comm.Comm over ranks that all hold this same `exported` and
    that include every rank of this engine's rollout group (the loop passes the world); None
    for a one-rank engine. Collective over it: the hashing is split over its ranks and they
    agree on whether to take the failure path. ValueError for an engine over several rollout
    TP/CP ranks without a comm of several ranks (its ranks could disagree on the read-back
    collective and wait forever).
    Test hooks (rlkernel/runner/faults.py), None in real runs: `tamper(received)` corrupts the
    received copy before loading; `load(engine, received)` stands in for
    engine.load_weights(received).
    A load that raises ValueError/RuntimeError is recorded as a problem, not propagated; the
    engine is then half loaded, so its reload and version checks are skipped (every rank still
    takes the failure path: under rollout TP the read-back is a collective that the peers make).
    Returns: the trainer's version and hashes and the problems found (empty = ok).
    """
    _check_comm(engine, comm)
    clock = _Clock()
    hashes = state_hashes(exported, comm)
    version = version_hash(hashes)
    clock.lap("trainer_hash_s")
    # The transfer: the engine gets a copy it owns (the trainer may update its tensors next).
    received = {n: t.clone() for n, t in exported.items()}
    if tamper is not None:
        tamper(received)
    problems = [f"tensor {n!r} arrived as {_meta(received[n])}, expected {_meta(t)}"
                for n, t in exported.items() if n in received and not _same_meta(received[n], t)]
    rejected = False
    try:
        if load is None:
            engine.load_weights(received)
        else:
            load(engine, received)
    except (ValueError, RuntimeError) as e:
        problems.append(f"rollout engine rejected the weights: {e}")
        rejected = True
    clock.lap("copy_load_s")
    # Every rank checks its own parameters, the tensors its forward reads; all of them right on
    # every rank is exactly the engine computing with the trainer's version (module doc).
    flagged = rejected or _held_differs(engine, exported)
    if comm is not None and comm.size > 1:
        flagged = any(comm.all_gather_object(flagged, "sync-engine-verdicts"))
    clock.lap("engine_check_s")
    if flagged:  # the same decision on every rank: the read-back below is a collective
        held = engine.exported_weights()
        # Equal bytes are equal hashes: only a tensor that differs needs its own SHA-256.
        found = _received_hashes(held, exported, hashes)
        if not rejected:
            problems += _version_problems(hashes, version, found, previous)
            # The version check saw this rank's own copy of every tensor, so where it passes
            # every parameter here is right; only a tensor it flags needs this rank's shard checked.
            sent = {n: t for n, t in received.items() if n in exported
                    and _same_meta(t, exported[n]) and found.get(n) != hashes[n]}
            problems += _reload_problems(engine, sent, version)
    clock.lap("failure_path_s")
    problems += compare_hashes(hashes, _received_hashes(received, exported, hashes))
    clock.lap("check_s")
    return SyncAudit(version, hashes, tuple(dict.fromkeys(problems)), clock.laps)


def _check_comm(engine, comm) -> None:
    """ValueError when `engine` spans several rollout ranks and `comm` cannot make its ranks
    take the same path (sync_weights' `comm`)."""
    pc = getattr(getattr(engine, "model", None), "pc", None)
    ranks = 1 if pc is None else pc.tp.size * pc.cp.size
    if ranks > 1 and (comm is None or comm.size < ranks):
        raise ValueError(f"sync_weights: the engine spans {ranks} rollout TP/CP ranks, so the "
                         f"sync needs a comm over all of them (got "
                         f"{'None' if comm is None else f'{comm.size} ranks'})")


def _held_differs(engine, exported: dict[str, torch.Tensor]) -> bool:
    """Whether any of this rank's engine parameters is not, byte for byte, what loading
    `exported` puts there (held_form), or the engine holds other tensors or another order, or
    holds a tensor in a dtype that cannot represent every value of the exported one (held_form
    would round: equal bytes would then not mean the trainer's values)."""
    held = engine.held_weights()
    if list(held) != list(exported):
        return True
    if any(torch.promote_types(exported[n].dtype, h.dtype) != h.dtype for n, h in held.items()):
        return True
    try:
        return any(not same_bytes(h, engine.held_form(n, exported[n]).to(h.device))
                   for n, h in held.items())
    except (ValueError, RuntimeError):  # a tensor the engine cannot take: the failure path says
        return True


class _Clock:
    """Named wall-clock laps (seconds) of one sync, for the evidence's timings."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._t
        self._t = now


_DETAILED = 3  # tensors described in full per problem line; the rest are counted


def _received_hashes(received: dict[str, torch.Tensor], exported: dict[str, torch.Tensor],
                     hashes: dict[str, str]) -> dict[str, str]:
    """Per-tensor hashes of `received` (the engine's copy or read-back, in its order): the
    trainer's hash where the bytes are the trainer's (compared exactly, no hashing), else the
    tensor's own SHA-256."""
    return {n: hashes[n] if n in exported and same_bytes(t.to(exported[n].device), exported[n])
            else tensor_hash(t) for n, t in received.items()}


def _reload_problems(engine, sent: dict[str, torch.Tensor], version: str) -> list[str]:
    """One line if any of this rank's engine parameters named in `sent` (received tensors of
    the right dtype and shape) is not, byte for byte, what loading them puts there."""
    if not sent:
        return []
    held = engine.held_weights()
    bad = [n for n, t in sent.items()
           if n in held and not same_bytes(held[n], engine.held_form(n, t).to(held[n].device))]
    if not bad:
        return []
    # Hashed only here, on the failure path: they name the bytes for a person comparing runs.
    shown = [f"{n!r} (holds shard hash {tensor_hash(held[n])[:16]}..., the load gives "
             f"{tensor_hash(engine.held_form(n, sent[n]))[:16]}...)" for n in bad[:_DETAILED]]
    return [f"rollout engine parameters differ from the weights sent to it (version "
            f"{version[:16]}...) in {len(bad)} of {len(held)} tensors on this rank: "
            f"{_listing(shown, len(bad))}"]


def _version_problems(hashes: dict[str, str], version: str, found: dict[str, str],
                      previous: str | None) -> list[str]:
    """One line if the engine's logical weights are not the trainer's version."""
    found_version = version_hash(found)
    if found_version == version:
        return []
    stale = (" (the version before this sync: the engine kept serving it)"
             if found_version == previous else "")
    diffs = compare_hashes(hashes, found)
    n_bad = sum(1 for n in set(hashes) | set(found) if hashes.get(n) != found.get(n))
    return [f"rollout engine computes with weight version {found_version[:16]}...{stale}, "
            f"expected {version[:16]}...: {n_bad} of {len(hashes)} tensors differ: "
            f"{_listing(diffs[:_DETAILED], len(diffs))}"]


def _listing(shown: list[str], total: int) -> str:
    more = total - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def _same_meta(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype, a.shape) == (b.dtype, b.shape)


def _meta(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"


def merge_problems(per_rank: list[list[str]]) -> tuple[str, ...]:
    """One list of the audit problems of every rank (rank order, duplicates once); on more than
    one rank each problem names the ranks that found it: "... (rank 1)", "... (ranks 0, 2)"."""
    where: dict[str, list[int]] = {}
    for rank, problems in enumerate(per_rank):
        for p in problems:
            where.setdefault(p, []).append(rank)
    if len(per_rank) == 1:
        return tuple(where)
    return tuple(f"{p} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})"
                 for p, r in where.items())
