"""Weight sync with an audit: export → serialise → reload into the rollout engine → compare hashes.

After every update the trainer exports its logical weights (parameter dtype), they travel as one
safetensors blob (what a real sync would send), the rollout engine loads them, and both sides hash
every logical tensor (SHA-256 over dtype, shape and bytes). Any difference — a flipped bit, a
missing tensor, a wrong shape or dtype — is named and fails the audit; nothing is silently
tolerated. The version is the Merkle root over the per-tensor hashes.
Does not: move weights between processes (rlkernel/distributed) or decide what to do on failure (loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import safetensors.torch
import torch

from rlkernel.weights.hashing import compare_hashes, state_hashes, version_hash


@dataclass(frozen=True)
class SyncAudit:
    """Trainer-side hashes, version, and the problems found on the rollout side (empty = ok)."""

    version: str
    tensor_hashes: dict[str, str]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def record(self) -> dict:
        return {"version": self.version, "tensor_hashes": self.tensor_hashes,
                "weight_audit": {"ok": self.ok, "problems": list(self.problems)}}


def sync_weights(exported: dict[str, torch.Tensor], engine,
                 tamper: Callable[[dict[str, torch.Tensor]], None] | None = None) -> SyncAudit:
    """Send `exported` to `engine` (load_weights / exported_weights) and audit the result.

    `tamper` is a test hook applied to the received tensors before loading (fault injection,
    rlkernel/runner/faults.py). A load that raises (e.g. wrong shape) is recorded as a problem,
    not propagated.
    """
    hashes = state_hashes(exported)
    blob = safetensors.torch.save({n: t.contiguous() for n, t in exported.items()})
    loaded = safetensors.torch.load(blob)
    # safetensors returns names sorted; restore the canonical order (extras last) before hashing.
    received = {n: loaded[n] for n in exported if n in loaded}
    received.update({n: t for n, t in loaded.items() if n not in received})
    if tamper is not None:
        tamper(received)
    problems = [f"tensor {n!r} arrived as {_meta(received[n])}, expected {_meta(t)}"
                for n, t in exported.items()
                if n in received and (received[n].dtype, received[n].shape) != (t.dtype, t.shape)]
    rejected = False
    try:
        engine.load_weights(received)
    except (ValueError, RuntimeError) as e:
        problems.append(f"rollout engine rejected the weights: {e}")
        rejected = True
    # Export even after a rejected load: under rollout TP the export is a collective, and a rank
    # whose copy was bad must make the same calls as its peers (or they would wait for it).
    loaded = state_hashes(engine.exported_weights())
    if not rejected:
        problems += compare_hashes(hashes, loaded)
    problems += compare_hashes(hashes, state_hashes(received))
    return SyncAudit(version_hash(hashes), hashes, tuple(dict.fromkeys(problems)))


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
