"""Weight sync + audit (rlkernel/weights/sync.py) on one GPU or TP GPUs: time per sync, split
into its parts, against the previous design measured in the same process.
The weights stay on the GPU: the engine gets a device copy, each rank compares its own engine
parameters byte for byte with what loading the export puts there, and only the trainer's export
is hashed (8 MiB chunks on a thread pool, each copied to the host inside its task; under TP each
rank digests every TP-th chunk and the digests are exchanged).

For each preset: a policy and a rollout engine on the GPU with the same random weights (bf16
parameters), then `repeats` syncs of the trainer's export into the engine: the median total and
the median of each lap (SyncAudit.timings plus the trainer's export), summed into three columns:
transfer (trainer export, copy + load), hashing (this rank's chunks + the digest exchange),
checks (engine parameters + the verdict exchange, received copy; the failure path, 0 when
clean). "previous" times what the sync did before this version on the same export: a
safetensors serialise/deserialise round trip and three serial SHA-256 passes (TP1 only).
Finally a flipped bit in the engine's received copy must be named by the audit.

Run (repository root, on the GPU machine):
    PYTHONPATH=. python3 benchmarks/bench_weight_sync.py [--presets qwen3-0.6b qwen3-1.7b] [--out F]
    PYTHONPATH=. python3 benchmarks/bench_weight_sync.py --tp 2 --presets qwen3-8b   # 2 GPUs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import safetensors.torch
import torch

from benchmarks.common import dump, env, require_cuda
from rlkernel.model.checkpoint import init_weights
from rlkernel.model.config import PRESETS
from rlkernel.model.ops import InvariantOps
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.rollout.engine import RolloutEngine
from rlkernel.weights.hashing import tensor_hash
from rlkernel.weights.sync import sync_weights


def _previous_design(exported: dict[str, torch.Tensor]) -> float:
    """Seconds for what the old sync did besides load/export: blob round trip + 3 serial hashes."""
    t0 = time.perf_counter()
    blob = safetensors.torch.save({n: t.contiguous() for n, t in exported.items()})
    received = safetensors.torch.load(blob)
    for d in (exported, received, exported):
        for t in d.values():
            tensor_hash(t)
    return time.perf_counter() - t0


def _flip_is_named(policy, engine, comm) -> bool:
    """Whether a flipped bit in element 0 of the first tensor's received copy (every rank) is
    named by the audit gathered over every rank (rank 0's shard holds the element)."""
    name = next(iter(policy.logical_params()))

    def flip(received: dict[str, torch.Tensor]) -> None:
        received[name].view(torch.int16).view(-1)[0] ^= 1

    audit = sync_weights(policy.export_tensors(on_device=True), engine, flip, comm=comm)
    problems = [p for ps in (comm.all_gather_object(list(audit.problems), "bench-flip")
                             if comm is not None else [audit.problems]) for p in ps]
    return bool(problems) and any(name in p for p in problems)


def _models(cfg, train_pc=None, roll_pc=None):
    """Policy and rollout engine on this rank's GPU with the same random weights (bf16)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    weights = init_weights(cfg, 0)
    policy = Qwen3ForCausalLM(cfg, InvariantOps, torch.bfloat16, train_pc).to(dev)
    policy.load_tensors(weights)
    engine = RolloutEngine(cfg, InvariantOps, torch.bfloat16, pad_id=0, device=dev, pc=roll_pc)
    return policy, engine


def _measure(preset: str, policy, engine, repeats: int, previous: bool, comm=None) -> dict:
    """Median sync + audit over `repeats` syncs, split into laps; the old design's cost when
    `previous`; whether a flipped bit is named. comm: the ranks' world (TP), None on one GPU."""
    totals, laps = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        exported = policy.export_tensors(on_device=True)
        export_s = time.perf_counter() - t0
        audit = sync_weights(exported, engine, comm=comm)
        torch.cuda.synchronize()
        totals.append(time.perf_counter() - t0)
        laps.append({"trainer_export_s": export_s, **audit.timings})
        assert audit.ok, audit.problems
    row = {
        "preset": preset, "params": sum(t.numel() for t in exported.values()),
        "bytes": sum(t.numel() * t.element_size() for t in exported.values()), "repeats": repeats,
        "sync_audit_s": statistics.median(totals),
        "laps_s": {k: statistics.median(lap[k] for lap in laps) for k in laps[0]},
        "transfer_s": statistics.median(lap["trainer_export_s"] + lap["copy_load_s"]
                                        for lap in laps),
        "hashing_s": statistics.median(lap["trainer_hash_s"] for lap in laps),
        "checks_s": statistics.median(lap["engine_check_s"] + lap["failure_path_s"]
                                      + lap["check_s"] for lap in laps),
    }
    if previous:
        host = {n: t.cpu() for n, t in exported.items()}   # the old path exported to the host
        row["previous_serialise_and_hash_s"] = min(_previous_design(host) for _ in range(2))
        del host
    del exported
    row["flipped_bit_named"] = _flip_is_named(policy, engine, comm)
    row["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def bench(preset: str, repeats: int) -> dict:
    policy, engine = _models(PRESETS[preset]())
    return _measure(preset, policy, engine, repeats, previous=True)


def _tp_rank(rank: int, preset: str, repeats: int, tp: int, out_dir: str) -> None:
    """One rank of a TP = rollout TP = `tp` sync (the export's all-gather over NCCL, the hashing
    split over the `tp` ranks); writes its row to out_dir/rank<r>.json."""
    from rlkernel.distributed.context import build_contexts
    from rlkernel.distributed.topology import Topology, build_comms
    cfg = PRESETS[preset]()
    topo = Topology(world=tp, rank=rank, tp=tp, rollout_tp=tp)
    comms = build_comms(topo)
    train_pc, roll_pc = build_contexts(topo, comms, cfg)
    policy, engine = _models(cfg, train_pc, roll_pc)
    row = _measure(preset, policy, engine, repeats, previous=False, comm=comms.world)
    dump(f"{out_dir}/rank{rank}.json", {**row, "tp": tp, "rank": rank})


def bench_tp(preset: str, repeats: int, tp: int) -> dict:
    """The TP sync on `tp` GPUs: every rank's row (the sync is as slow as its slowest rank)."""
    import json
    import tempfile

    from rlkernel.distributed.launch import launch
    with tempfile.TemporaryDirectory() as d:
        launch(_tp_rank, (preset, repeats, tp, d), world_size=tp, backend="cpu:gloo,cuda:nccl",
               timeout_s=1800)
        ranks = [json.load(open(f"{d}/rank{r}.json")) for r in range(tp)]
    return {"preset": preset, "tp": tp,
            "sync_audit_s": max(r["sync_audit_s"] for r in ranks), "ranks": ranks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["qwen3-0.6b", "qwen3-1.7b"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1,
                    help="trainer TP = rollout TP over this many GPUs (ranks spawned here)")
    ap.add_argument("--out")
    a = ap.parse_args()
    require_cuda()
    if a.tp > torch.cuda.device_count():
        sys.exit(f"--tp {a.tp} needs {a.tp} GPUs, this machine has {torch.cuda.device_count()}")
    rows = []
    for p in a.presets:
        torch.cuda.reset_peak_memory_stats()
        row = bench(p, a.repeats) if a.tp == 1 else bench_tp(p, a.repeats, a.tp)
        print(row, flush=True)
        rows.append(row)
        dump(a.out, {"env": env(), "rows": rows})   # keep what finished if a later preset fails
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
