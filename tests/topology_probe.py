"""Run training steps of one Qwen3 config on real gloo processes and record what EVERY rank computed.

Shared by tests/test_topology.py (the topology matrix), tests/test_dp.py (the DP × microbatch
matrix) and tests/test_shape_property.py (random model shapes × topologies). `run_layout` starts
dp·tp·cp processes (rlkernel.distributed.launch); each rank runs `steps` steps of
compute_gradients + exact-norm clip + (ZeRO-1) AdamW on a fixed batch and pickles its own record:
    per step: per-token logprobs of the loss rows this rank holds (keyed by sample and position),
    every gradient reassembled to its logical tensor, the exact grad norm, loss and entropy;
    after the steps: the exported weights.
`assert_same_bytes` compares each rank's record with a baseline by bytes (int32 views, hex of
floats), never with a tolerance; every logical token must be held by some (DP, CP) rank of each
TP rank. `single_process` runs the same steps in this process (DP1/TP1/CP1, no process group),
the baseline.

Footgun: `probe` is pickled by reference for spawned ranks, so this module must stay importable
as `topology_probe` (pytest puts tests/ on sys.path, and spawn passes sys.path to children).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch

from rlkernel.config import RunConfig
from rlkernel.distributed.comm import Comm
from rlkernel.distributed.launch import cuda_backend, launch
from rlkernel.model.config import Qwen3Config
from rlkernel.model.ops import ops_for
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.model.sharding import logical_tensor
from rlkernel.train.losses import LossCoefs, invariant_exp
from rlkernel.train.optimizer import AdamWParams
from rlkernel.train.step import compute_gradients, dp_share, gradients, microbatches
from rlkernel.train import zero
from rlkernel.train.zero import ZeroAdamW

T = 0.7
COEFS = LossCoefs(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, kl_estimator="k3")


@dataclass(frozen=True)
class Job:
    """One probe: model, weights (logical fp32 tensors), batch, and the step settings."""

    mcfg: Qwen3Config
    policy_w: dict
    ref_w: dict
    samples: list
    steps: int = 2
    micro_batch_tokens: int = 96
    pad_id: int = 257
    param_dtype: torch.dtype = torch.float32   # bf16: the bf16 path (bf16 weights, fp32 masters)


def _logical_grads(model: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    # copy: a TP1 "reassembly" may be the .grad tensor itself, which clip then scales in place
    return {n: logical_tensor(n, model.pc.tp.all_gather(g, f"grad:{n}"), model.cfg).to(
            "cpu", copy=True) for n, g in gradients(model).items()}


@torch.no_grad()
def _token_logprobs(policy: Qwen3ForCausalLM, job: Job) -> dict[tuple[int, int], torch.Tensor]:
    """{(sample index, position of the row): fp32 logprob} of the loss rows this rank holds, from
    the layouts compute_gradients runs (train.step.dp_share + microbatches)."""
    out = {}
    share = list(dp_share(len(job.samples), policy.pc.dp))
    for lay, (targets, mask, _, _, who), _ in microbatches(
            [job.samples[i] for i in share], job.micro_batch_tokens, job.pad_id, policy.pc, share):
        lp, _ = policy.token_logprobs(policy.hidden(lay), targets.to(policy.device), T)
        for row in mask.nonzero(as_tuple=True)[0].tolist():
            out[(int(who[row]), int(lay.positions[row]))] = lp[row].to("cpu", copy=True)
    return out


def _steps(policy, ref, job: Job, exp, opt, counted, world_comm) -> dict:
    record: dict = {"steps": []}
    for _ in range(job.steps):
        lps = _token_logprobs(policy, job)
        stats = compute_gradients(policy, ref, job.samples, temperature=T, coefs=COEFS,
                                  micro_batch_tokens=job.micro_batch_tokens, pad_id=job.pad_id,
                                  exp=exp)
        grads = _logical_grads(policy)
        gs = opt.clip(gradients(policy), 1.0, counted, world_comm)
        record["steps"].append({"grads": grads, "norm": gs.norm, "loss": stats.loss,
                                "entropy": stats.entropy, "logprobs": lps})
        opt.step(gradients(policy))
        policy.load_master_shards(opt.weights(policy.param_dtype))
    record["weights"] = policy.export_tensors()
    return record


def _models(job: Job, mode: str, pc, recompute: bool, device: str = "cpu"):
    ops = ops_for(mode)
    policy = Qwen3ForCausalLM(job.mcfg, ops, job.param_dtype, pc).to(device)
    policy.load_tensors(job.policy_w)
    policy.recompute = recompute
    ref = Qwen3ForCausalLM(job.mcfg, ops, job.param_dtype, pc).to(device)
    ref.load_tensors(job.ref_w)
    ref.requires_grad_(False)
    return policy, ref


def probe(rank: int, cfg: RunConfig, job: Job, out_dir: str) -> None:
    """One rank of a launched job: `job.steps` training steps; writes out_dir/rank{rank}.pkl."""
    import torch.distributed as dist

    from rlkernel.distributed import comm as comm_mod
    from rlkernel.distributed import tokensum
    from rlkernel.distributed.context import build_contexts
    from rlkernel.distributed.topology import Topology, build_comms

    # The tiny model's partials are far below the threshold of tree_all_reduce's sliced form;
    # take it for every partial, so layouts of more than two TP ranks run it in the model (two
    # ranks always take the gathered form).
    comm_mod.SLICED_MIN_ELEMS = 0
    # Likewise a split embedding accumulator never hands over to the whole one here (a random
    # model's tokens touch most of the tiny vocabulary): layouts run the split and union paths;
    # the hand-over is tests/test_sink_direct_kernels.py's.
    tokensum.SPLIT_MAX_FRACTION = 1.0
    topo = Topology.from_config(cfg, rank, dist.get_world_size())
    comms = build_comms(topo)
    pc, _ = build_contexts(topo, comms, job.mcfg)
    policy, ref = _models(job, cfg.mode, pc, cfg.recompute, cfg.device)
    exp = invariant_exp if cfg.mode == "invariant" else torch.exp
    opt, counted = zero.build({n: p.detach() for n, p in policy.logical_params().items()},
                              AdamWParams(lr=1e-3), comms, topo, job.mcfg)
    record = _steps(policy, ref, job, exp, opt, counted, comms.world)
    record["where"] = (topo.tp_rank, topo.cp_rank, topo.dp_rank)
    record["optimizer_bytes"] = opt.optimizer_bytes()
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(record, f)


def run_layout(out_dir, job: Job, tp: int, cp: int, sp: bool, mode: str = "invariant",
               recompute: bool = False, device: str = "cpu", dp: int = 1) -> list[dict]:
    """Every rank's record of `job` on dp·tp·cp real processes (rank order); on CUDA one GPU per
    rank, the process group carrying CUDA tensors over NCCL and CPU tensors over gloo — or, with
    RLK_SHARE_GPUS=1, ranks sharing the GPUs and everything over gloo (launch.cuda_backend)."""
    dtype = "bf16" if job.param_dtype == torch.bfloat16 else "fp32"
    cfg = RunConfig(dp=dp, tp=tp, cp=cp, sp=sp, mode=mode, dtype=dtype, recompute=recompute,
                    device=device, n_prompts=len(job.samples), n_samples_per_prompt=1)
    backend = cuda_backend() if device == "cuda" else "gloo"
    world = dp * tp * cp
    launch(probe, (cfg, job, str(out_dir)), world_size=world, backend=backend, timeout_s=300)
    out = []
    for r in range(world):
        with open(f"{out_dir}/rank{r}.pkl", "rb") as f:
            out.append(pickle.load(f))
    return out


def single_process(job: Job, mode: str = "invariant", device: str = "cpu") -> dict:
    """The record of `job` in this process: DP1/TP1/CP1, no process group."""
    from rlkernel.distributed.parallel import ParallelCtx
    from rlkernel.distributed.topology import single_comms

    comms = single_comms()
    policy, ref = _models(job, mode, ParallelCtx.single(), False, device)
    exp = invariant_exp if mode == "invariant" else torch.exp
    opt = ZeroAdamW({n: p.detach() for n, p in policy.logical_params().items()},
                    AdamWParams(lr=1e-3), Comm.single("dp"))
    record = _steps(policy, ref, job, exp, opt, set(policy.logical_params()), comms.world)
    record["where"] = (0, 0, 0)   # (tp_rank, cp_rank, dp_rank), as a launched rank records it
    record["optimizer_bytes"] = opt.optimizer_bytes()
    return record


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (fp32 compared as int32, so -0.0 != +0.0 and NaN == NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def assert_same_bytes(got: list[dict], want: dict, label: str) -> None:
    """Every rank's record == `want` by bytes: per-token logprobs of the rows it holds (and every
    token held by one (DP, CP) rank of each TP rank), gradients, norm, loss, entropy, final
    weights."""
    for rank, g_rec in enumerate(got):
        where = f"{label} rank {rank} (tp_rank, cp_rank) = {g_rec['where']}"
        for s, (g, w) in enumerate(zip(g_rec["steps"], want["steps"], strict=True)):
            bad_lp = [k for k, v in g["logprobs"].items() if not bits_equal(v, w["logprobs"][k])]
            assert not bad_lp, f"{where} step {s}: per-token logprobs differ at {bad_lp[:8]} " \
                               f"({len(bad_lp)} of {len(g['logprobs'])})"
            bad = [n for n in w["grads"] if not bits_equal(g["grads"][n], w["grads"][n])]
            assert not bad, f"{where} step {s}: {len(bad)} of {len(w['grads'])} gradients " \
                            f"differ: {bad}"
            assert g["norm"].hex() == w["norm"].hex(), f"{where} step {s}: grad norm"
            assert g["loss"].hex() == w["loss"].hex(), f"{where} step {s}: loss"
            assert g["entropy"].hex() == w["entropy"].hex(), f"{where} step {s}: entropy"
        bad = [n for n in want["weights"] if not bits_equal(g_rec["weights"][n], want["weights"][n])]
        assert not bad, f"{where}: weights after the updates differ: {bad}"
    tp_ranks = {r["where"][0] for r in got}
    for t in tp_ranks:
        for s, w in enumerate(want["steps"]):
            held = set().union(*(r["steps"][s]["logprobs"] for r in got if r["where"][0] == t))
            assert held == set(w["logprobs"]), f"{label} tp_rank {t} step {s}: the DP/CP ranks " \
                f"hold {len(held)} loss tokens, the baseline {len(w['logprobs'])}"
