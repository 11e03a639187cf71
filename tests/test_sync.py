"""The weight sync split over ranks (rlkernel/weights/sync.py, hashing.py; issue 12 item 3).

Properties, each on real gloo ranks (rlkernel.distributed.launch, 2 or 3 spawned processes):
  split hashing — state_hashes(tensors, comm) on every rank == state_hashes(tensors) (serial),
    byte for byte, for 2 and 3 ranks, with fewer chunks than ranks and with empty tensors; a
    rank that digests nothing makes every rank raise naming it, a rank that digests wrongly
    changes exactly the tensors it owns chunks of (so the equality above rests on every rank's
    work), and ranks holding different shapes raise;
  sync at TP2 = rollout TP2 — a clean sync passes without the engine's read-back collective; a
    flipped bit in one rank's received copy or in one rank's loaded shard is named with the
    tensor and the rank (every rank then takes the read-back path together); a stale engine on
    every rank is named as the previous version.
Rank bodies are module-level (pickled by name); they write what they saw under tmp_path and the
assertions run here. One launch per world size for the hashing, one for the sync.

Run: `.venv/bin/python -m pytest -q tests/test_sync.py` (about half a minute on 2 cores).
"""

from __future__ import annotations

import os
import pathlib
import pickle

import pytest
import torch
import torch.distributed as dist

from rlkernel.distributed.comm import Comm
from rlkernel.distributed.launch import launch
from rlkernel.weights import hashing
from rlkernel.weights.hashing import state_hashes
from rlkernel.weights.sync import merge_problems, sync_weights

T = "model.layers.0.mlp.up_proj.weight"                  # TP-sharded (rows), held in bf16
NORM = "model.layers.1.post_attention_layernorm.weight"  # replicated on every TP rank, fp32
CHUNK = 64  # bytes: small chunks, so the tensors below make many hashing tasks


# ---------------------------------------------------------------------------------------------
# split hashing


def _tensors() -> dict[str, torch.Tensor]:
    """The same tensors on every rank: several chunks each, one chunk, none (empty), 0-d, a
    non-contiguous view, bf16 / fp32 / int64 / bool."""
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(9, 12, generator=g)
    return {"bf16": torch.randn(10, 7, generator=g).to(torch.bfloat16),   # 140 B: 3 chunks
            "scalar": torch.tensor(-0.0),
            "empty": torch.zeros(0, 3),
            "ints": torch.arange(33, dtype=torch.int64) * 977,            # 264 B: 5 chunks
            "view": wide[:, ::2],                                         # 216 B: 4 chunks
            "flags": torch.arange(50) % 3 == 0,
            "small": torch.randn(5, generator=g)}                         # 20 B: 1 chunk


def _split_hash_rank(rank: int, out: str, world: int) -> None:
    hashing.HASH_CHUNK_BYTES = CHUNK  # this process only (a spawned rank)
    comm = Comm("world", dist.group.WORLD, range(world), rank)
    tensors = _tensors()
    res: dict[str, object] = {"split": state_hashes(tensors, comm),
                              "serial": state_hashes(tensors),
                              "one": state_hashes({"small": tensors["small"]}, comm)}
    # Negative controls, each the same calls on every rank so the group stays in step.
    real_tasks, real_digest = hashing._my_tasks, hashing._chunk_digest
    if rank == 1:   # digests nothing
        hashing._my_tasks = lambda tasks, r, size: []
    try:
        state_hashes(tensors, comm)
        res["skipped"] = "no error"
    except ValueError as e:
        res["skipped"] = str(e)
    hashing._my_tasks = real_tasks
    if rank == 1:   # digests something else in place of its chunks
        hashing._chunk_digest = lambda flat, span: bytes(32)
    res["wrong"] = state_hashes(tensors, comm)
    hashing._chunk_digest = real_digest
    other = dict(tensors, ints=tensors["ints"].reshape(3, 11)) if rank == world - 1 else tensors
    try:
        state_hashes(other, comm)
        res["layout"] = "no error"
    except ValueError as e:
        res["layout"] = str(e)
    pathlib.Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(res))


def _owned_by(world: int, rank: int) -> set[str]:
    """Tensors with at least one chunk that `rank` of `world` digests (chunks numbered in order)."""
    tasks = [name for name, t in _tensors().items()
             for _ in range(-(-t.numel() * t.element_size() // CHUNK))]
    return set(tasks[rank::world])


@pytest.mark.parametrize("world", [2, 3])
def test_split_hashing_equals_serial_hashing_and_every_rank_counts(tmp_path, monkeypatch, world):
    """On `world` gloo ranks: state_hashes(tensors, comm) == state_hashes(tensors) on every rank
    (also for one chunk over `world` ranks). Controls: rank 1 digesting nothing → ValueError on
    every rank naming rank 1 and the count; rank 1 digesting zeros → exactly the tensors it owns
    chunks of hash differently; the last rank holding another shape → ValueError naming it."""
    monkeypatch.setattr(hashing, "HASH_CHUNK_BYTES", CHUNK)
    serial = state_hashes(_tensors())
    assert len(_owned_by(world, 1)) >= 2 and _owned_by(world, 1) != set(serial)  # a real split
    launch(_split_hash_rank, (str(tmp_path), world), world_size=world, timeout_s=30)
    res = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    n_tasks = len([1 for t in _tensors().values()
                   for _ in range(-(-t.numel() * t.element_size() // CHUNK))])
    for r, got in enumerate(res):
        assert got["serial"] == serial, f"rank {r}"
        assert got["split"] == serial, f"rank {r}"
        assert got["one"] == {"small": serial["small"]}, f"rank {r}"
        assert got["skipped"] == (f"state_hashes: rank 1 of world sent 0 chunk digests, expected "
                                  f"{len(range(1, n_tasks, world))}"), f"rank {r}"
        differ = {n for n in serial if got["wrong"][n] != serial[n]}
        assert differ == _owned_by(world, 1), f"rank {r}"
        assert got["layout"] == (f"state_hashes: rank {world - 1} of world holds other tensors "
                                 "(names, dtypes or shapes) than rank 0"), f"rank {r}"


# ---------------------------------------------------------------------------------------------
# the sync at TP2 = rollout TP2


def _versions():
    """Three versions of the tiny model's weights (bf16), every tensor different."""
    from rlkernel.model.checkpoint import init_weights
    from rlkernel.model.config import tiny

    v0 = init_weights(tiny(), 0)
    return [{n: (t.float() + k * 2.0 ** -4).to(torch.bfloat16) for n, t in v0.items()}
            for k in range(5)]


def _sync_tp2_rank(rank: int, out: str) -> None:
    from rlkernel.distributed.context import build_contexts
    from rlkernel.distributed.topology import Topology, build_comms
    from rlkernel.model.config import tiny
    from rlkernel.model.ops import ops_for
    from rlkernel.model.qwen3 import Qwen3ForCausalLM
    from rlkernel.rollout.engine import RolloutEngine
    from rlkernel.runner import faults

    cfg, ops = tiny(), ops_for("invariant")
    topo = Topology(world=2, rank=rank, tp=2, rollout_tp=2)
    comms = build_comms(topo)
    train_pc, roll_pc = build_contexts(topo, comms, cfg)
    policy = Qwen3ForCausalLM(cfg, ops, torch.bfloat16, train_pc)
    engine = RolloutEngine(cfg, ops, torch.bfloat16, pad_id=0, pc=roll_pc)
    read_backs = []
    real_read_back = engine.exported_weights
    engine.exported_weights = lambda: read_backs.append(1) or real_read_back()

    # Which elements of T this rank's engine holds: the flips below land in rank 1's shard, or
    # in rank 0's only.
    from rlkernel.model.sharding import local_tensor
    held_idx = set(local_tensor(T, torch.arange(128 * 64).reshape(128, 64), cfg, 2, rank)
                   .reshape(-1).tolist())
    res: dict[str, object] = {"holds_5000": 5000 in held_idx, "holds_0": 0 in held_idx}

    previous = None
    scenarios = [("clean", None),
                 ("received, rank 1's shard", f"sync:flip-bit:step=1:tensor={T}:rank=1:index=5000"),
                 ("received, rank 0's shard", f"sync:flip-bit:step=2:tensor={T}:rank=1:index=0"),
                 ("engine shard", f"engine:flip-bit:step=3:tensor={T}:rank=1:index=100:bit=3"),
                 ("engine norm", f"engine:flip-bit:step=4:tensor={NORM}:rank=1:index=2:bit=3"),
                 ("stale everywhere", "engine:stale:step=5")]
    versions = _versions()
    versions.append(versions[0])  # step 5 loads v0 again, the engine stays at v4 (stale)
    for step, (label, spec) in enumerate(scenarios):
        os.environ[faults.ENV] = spec or ""
        policy.load_tensors(versions[step])
        exported = policy.export_tensors(on_device=True)
        del read_backs[:]
        a = sync_weights(exported, engine, faults.tamper(step, rank), faults.load(step, rank),
                         previous, comm=comms.world)
        problems = merge_problems(comms.world.all_gather_object(list(a.problems), "problems"))
        res[label] = {"problems": problems, "read_backs": len(read_backs),
                      "hashes_serial": a.tensor_hashes == state_hashes(exported),
                      "version": a.version, "previous": previous, "timings": list(a.timings)}
        # What the engine serves after a fault is not the new version; re-sync it cleanly.
        os.environ[faults.ENV] = ""
        if step < len(scenarios) - 1:
            b = sync_weights(exported, engine, comm=comms.world)
            assert b.ok, b.problems
            previous = b.version
    try:                       # refused before any collective: no rank waits for the other
        sync_weights(exported, engine)
        res["no_comm"] = None
    except ValueError as e:
        res["no_comm"] = str(e)
    pathlib.Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(res))


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync_tp2")
    launch(_sync_tp2_rank, (str(out),), world_size=2, timeout_s=60)
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(2)]


def _by_kind(problems) -> dict[str, str]:
    """{"transit" | "version" | "reload": the problem line}; at most one line per kind."""
    kinds = {"tensor ": "transit", "rollout engine computes with": "version",
             "rollout engine parameters differ": "reload"}
    out: dict[str, str] = {}
    for p in problems:
        kind = next(k for s, k in kinds.items() if p.startswith(s))
        assert kind not in out, problems
        out[kind] = p
    return out


def test_tp2_sync_clean_needs_no_read_back_and_hashes_are_serial(tp2):
    """Clean sync at TP2 = rollout TP2: ok on both ranks, the engine's read-back collective is
    never called, the recorded hashes == the serial state_hashes of the export on both ranks,
    and the timings are the documented laps (SyncAudit.timings)."""
    assert tp2[0]["holds_0"] and not tp2[0]["holds_5000"]
    assert tp2[1]["holds_5000"] and not tp2[1]["holds_0"]
    for r in tp2:
        c = r["clean"]
        assert c["problems"] == () and c["read_backs"] == 0 and c["hashes_serial"]
        assert c["timings"] == ["trainer_hash_s", "copy_load_s", "engine_check_s",
                                "failure_path_s", "check_s"]
    assert tp2[0]["clean"]["version"] == tp2[1]["clean"]["version"]


def test_tp2_flipped_bit_in_one_ranks_received_copy_is_named_with_tensor_and_rank(tp2):
    """Rank 1's received copy of T has a flipped bit. In rank 1's shard: transit (rank 1) and
    the version both ranks' engines compute with (ranks 0, 1: both see rank 1's shard) are
    named, each naming T, and no reload line (the load did put the received bytes there); both
    ranks took the read-back path. In rank 0's shard only: rank 1 never loads that element, so
    only the transit line (rank 1), and no read-back on either rank."""
    own = _by_kind(tp2[0]["received, rank 1's shard"]["problems"])
    assert set(own) == {"transit", "version"}
    assert own["transit"].startswith(f"tensor {T!r} differs: expected hash ")
    assert own["transit"].endswith("(rank 1)")
    assert own["version"].endswith("(ranks 0, 1)") and "1 of 24 tensors differ" in own["version"]
    assert all(T in p for p in own.values())
    other = tp2[0]["received, rank 0's shard"]["problems"]
    assert len(other) == 1 and other[0].startswith(f"tensor {T!r} differs: expected hash ")
    assert other[0].endswith("(rank 1)")
    for r in tp2:
        assert r["received, rank 1's shard"]["read_backs"] == 1
        assert r["received, rank 0's shard"]["read_backs"] == 0
        assert r["received, rank 1's shard"]["problems"] == tp2[0]["received, rank 1's shard"][
            "problems"]


@pytest.mark.parametrize("label,name,version_ranks", [("engine shard", T, "(ranks 0, 1)"),
                                                      ("engine norm", NORM, "(rank 1)")])
def test_tp2_flipped_bit_in_one_ranks_loaded_shard_is_named_with_tensor_and_rank(
        tp2, label, name, version_ranks):
    """After a good load, a bit of rank 1's own parameter flips (its shard of T, or its copy of
    a replicated fp32 norm below bf16 precision): no transit line; a version line from the ranks
    whose view holds it and a reload line from rank 1, both naming the tensor; both ranks read
    back (the decision is the same everywhere, so nobody hangs)."""
    got = _by_kind(tp2[0][label]["problems"])
    assert set(got) == {"version", "reload"}, got
    assert got["version"].endswith(version_ranks) and "1 of 24 tensors differ" in got["version"]
    assert got["reload"].endswith("(rank 1)") and "in 1 of 24 tensors on this rank" in got["reload"]
    assert all(name in p for p in got.values())
    assert [r[label]["read_backs"] for r in tp2] == [1, 1]


def test_tp2_stale_engine_is_named_as_the_previous_version(tp2):
    """Every rank's engine ignores the load: one version line, from both ranks, names the
    version found as the one served before this sync; each rank adds its reload line (its own
    shard hashes, so one line per rank)."""
    s = tp2[0]["stale everywhere"]
    version, *reload = s["problems"]
    assert version.startswith(
        f"rollout engine computes with weight version {s['previous'][:16]}... (the version "
        f"before this sync: the engine kept serving it), expected {s['version'][:16]}...: ")
    assert version.endswith("(ranks 0, 1)")
    assert [p[-8:] for p in reload] == ["(rank 0)", "(rank 1)"]
    assert all(p.startswith("rollout engine parameters differ from the weights sent to it")
               for p in reload)


def test_tp2_sync_without_a_comm_is_refused_on_every_rank(tp2):
    """An engine over 2 rollout TP ranks synced with comm None: ValueError on both ranks before
    any collective (they could otherwise disagree on the failure path's read-back and hang)."""
    for r in tp2:
        assert r["no_comm"] is not None and "spans 2 rollout TP/CP ranks" in r["no_comm"]
