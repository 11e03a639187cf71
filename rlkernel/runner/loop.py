"""The RL loop of `rlk run`: rollout → rewards/advantages → train → AdamW → weight export +
reload + audit → evidence, once per step (DESIGN.md §2), on one process or on tp·cp ranks.

Every rank runs the same loop on its shards; rank 0 writes the evidence. Everything that can be
checked is checked before the first step (model, tokenizer, every prompt of every step). Each
step's evidence is written atomically as soon as the step ends.
Does not: decide the topology (config + dist/topology.py) or create the run directory (cli.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import time

import torch

from rlkernel.config import RunConfig
from rlkernel.data.tasks import prompt_source, reward
from rlkernel.data.tokenizer import load_tokenizer
from rlkernel.dist.context import build_contexts
from rlkernel.dist.parallel import ParallelCtx
from rlkernel.model.checkpoint import init_weights, load_checkpoint
from rlkernel.model.config import tiny
from rlkernel.model.ops import ops_for
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.model.sharding import counts_for_norm
from rlkernel.numerics.exact import exact_sum, float_hex
from rlkernel.rollout.engine import Request, RolloutEngine, SamplingParams
from rlkernel.runner.evidence import EvidenceWriter, Progress
from rlkernel.train.grpo import group_advantages
from rlkernel.train.losses import LossCoefs, invariant_exp
from rlkernel.train.optimizer import AdamW, AdamWParams
from rlkernel.train.step import TrainSample, compute_gradients, gradients
from rlkernel.weights.sync import sync_weights


class RunAborted(ValueError):
    """The run stopped on a failed check (audit, non-finite gradient, --require-updates)."""


_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _load_model(cfg: RunConfig):
    if cfg.model is None:
        mcfg = tiny()
        return mcfg, init_weights(mcfg, cfg.model_seed)
    return load_checkpoint(cfg.model)


def _encode_all(cfg: RunConfig, source, tok) -> list[list[list[int]]]:
    """Token ids of every prompt of every step; ValueError naming the prompt if one is unusable."""
    out = []
    for step in range(cfg.steps):
        batch = []
        for p in source.batch(step):
            ids = tok.encode(p.text)
            if not ids:
                raise ValueError(f"prompt {p.index} encodes to no tokens")
            if len(ids) > cfg.max_prompt_len:
                raise ValueError(f"prompt {p.index} has {len(ids)} tokens, more than "
                                 f"--max-prompt-len {cfg.max_prompt_len}")
            batch.append(ids)
        out.append(batch)
    return out


def _tokens_hash(completions) -> str:
    payload = json.dumps([[c.sample_id, c.response_ids] for c in completions]).encode()
    return hashlib.sha256(payload).hexdigest()


def run_loop(cfg: RunConfig, run_dir: pathlib.Path, writer: EvidenceWriter) -> None:
    """Run cfg.steps RL steps, recording init and per-step evidence through `writer`.

    One process when tp·cp == 1 (and not under torchrun), else tp·cp ranks (rlkernel/dist/launch).
    Raises ValueError (bad inputs, before any step), RunAborted (a failed check, after the failing
    step's evidence is written), or the launcher's RankFailure naming the failing rank.
    """
    world = cfg.tp * cfg.cp
    if world == 1 and not all(v in os.environ for v in _TORCHRUN_VARS):
        from rlkernel.dist.topology import Topology, single_comms
        _run(cfg, Topology(world=1, rank=0), single_comms(), writer)
        return
    from rlkernel.dist.launch import launch
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    try:
        launch(_rank_main, (cfg, str(run_dir), writer.manifest), world_size=world,
               backend=backend, timeout_s=float(os.environ.get("RLK_DIST_TIMEOUT_S", "300")))
    finally:
        writer.adopt()


def _rank_main(rank: int, cfg: RunConfig, run_dir: str, manifest: dict) -> None:
    """One rank of a multi-process run (module-level: the launcher pickles it by name)."""
    import torch.distributed as dist

    from rlkernel.dist.topology import Topology, build_comms
    topo = Topology.from_config(cfg, rank, dist.get_world_size())
    comms = build_comms(topo)
    writer = EvidenceWriter(run_dir, manifest, Progress(total=cfg.steps)) if rank == 0 else None
    _run(cfg, topo, comms, writer)
    if writer is not None and not writer.complete:
        writer.finish({"steps": writer.n_steps})


class _Rollout:
    """Rollout replicas over the world: replica d generates its contiguous share of the samples."""

    def __init__(self, engine: RolloutEngine, topo, comms) -> None:
        self.engine, self.topo, self.comms = engine, topo, comms

    def generate(self, requests: list[Request], sp: SamplingParams):
        n_rep, d = self.topo.rollout_dp, self.topo.rollout_dp_rank
        per = -(-len(requests) // n_rep)
        mine = requests[d * per:(d + 1) * per]
        done = self.engine.generate(mine, sp) if mine else []
        lead = self.topo.rank % self.topo.rollout_size == 0
        parts = self.comms.world.all_gather_object(done if lead else None, "rollout-results")
        return [c for p in parts if p is not None for c in p]


def _run(cfg: RunConfig, topo, comms, writer: EvidenceWriter | None) -> None:
    ops = ops_for(cfg.mode)
    exp = invariant_exp if cfg.mode == "invariant" else torch.exp
    pdtype = _DTYPES[cfg.dtype]
    mcfg, tensors = _load_model(cfg)
    tok = load_tokenizer(cfg.model, vocab_size=mcfg.vocab_size, eos_token_id=mcfg.eos_token_id)
    source = prompt_source(cfg.prompts, n_prompts_per_step=cfg.n_prompts, steps=cfg.steps,
                           seed=cfg.seed)
    encoded = _encode_all(cfg, source, tok)
    if topo.world > 1:
        train_pc, roll_pc = build_contexts(topo, comms, mcfg)
    else:
        train_pc = roll_pc = ParallelCtx.single()

    dev = torch.device(cfg.device)
    policy = Qwen3ForCausalLM(mcfg, ops, pdtype, train_pc).to(dev)
    policy.load_tensors(tensors)
    policy.recompute = cfg.recompute
    ref = Qwen3ForCausalLM(mcfg, ops, pdtype, train_pc).to(dev)
    ref.load_tensors(tensors)
    ref.requires_grad_(False)
    engine = RolloutEngine(mcfg, ops, pdtype, pad_id=tok.pad_id, device=dev, pc=roll_pc)
    rollout = _Rollout(engine, topo, comms)
    opt = AdamW({n: p.detach() for n, p in policy.logical_params().items()},
                AdamWParams(cfg.lr, cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps, cfg.weight_decay))
    counted = {n for n in policy.logical_params()
               if topo.cp_rank == 0 and counts_for_norm(n, mcfg, topo.tp, topo.tp_rank)}
    coefs = LossCoefs(cfg.clip_eps, cfg.kl_coef, cfg.entropy_coef, cfg.kl_estimator)
    sp = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_response_len, cfg.seed, tok.eos_id)

    def audit_sync():
        a = sync_weights(policy.export_tensors(), engine)
        problems = comms.world.all_gather_object(list(a.problems), "audit-problems")
        merged = tuple(dict.fromkeys(p for ps in problems for p in ps))
        return a.__class__(a.version, a.tensor_hashes, merged)

    audit = audit_sync()
    if writer is not None:
        writer.record_init(audit.record())
    if not audit.ok:
        raise RunAborted(f"initial weight sync failed: {audit.problems[0]}")
    version = audit.version
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        prompts = source.batch(step)
        g = cfg.n_samples_per_prompt
        requests = [Request((step * cfg.n_prompts + j) * g + k, tuple(encoded[step][j]))
                    for j in range(len(prompts)) for k in range(g)]
        completions = rollout.generate(requests, sp)
        t1 = time.perf_counter()
        rewards = [reward(tok.decode(c.response_ids), prompts[i // g].label)
                   for i, c in enumerate(completions)]
        adv = group_advantages(rewards, g)
        samples = [TrainSample(c.sample_id, c.prompt_ids, tuple(c.response_ids),
                               c.logprob_tensor(), a) for c, a in zip(completions, adv)]
        stats = compute_gradients(policy, ref, samples, temperature=cfg.temperature, coefs=coefs,
                                  token_budget=cfg.token_budget, pad_id=tok.pad_id, exp=exp)
        grads = gradients(policy)
        gstats = opt.clip(grads, cfg.clip_grad, counted, comms.world)
        skipped = bool(gstats.nonfinite)
        if not skipped:
            opt.step(grads)
            policy.load_master_shards(opt.master)
        t2 = time.perf_counter()
        audit = audit_sync()
        t3 = time.perf_counter()
        rec = {
            "step": step,
            "grad_norm": gstats.norm, "grad_norm_hex": float_hex(gstats.norm),
            "grad_clip_coef": gstats.clip_coef,
            "grad_nonfinite": list(gstats.nonfinite), "update_skipped": skipped,
            **audit.record(), "version_changed": audit.version != version,
            "tokens_hash": _tokens_hash(completions),
            "n_samples": len(completions), "n_response_tokens": stats.n_tokens,
            "n_microbatches": stats.n_microbatches,
            "logprob_mismatches": stats.logprob_mismatches, "logprob_tokens": stats.n_tokens,
            "rewards": rewards, "reward_mean": exact_sum(rewards) / len(rewards),
            "loss": stats.loss, "pg_loss": stats.pg_loss, "kl": stats.kl, "entropy": stats.entropy,
            "timings": {"rollout_s": t1 - t0, "train_s": t2 - t1, "export_audit_s": t3 - t2,
                        "step_s": t3 - t0},
        }
        if writer is not None:
            writer.record_step(rec)
        if skipped:
            raise RunAborted(f"step {step}: non-finite gradient in {', '.join(gstats.nonfinite)}; "
                             "update not applied")
        if not audit.ok:
            raise RunAborted(f"step {step}: weight sync audit failed: {'; '.join(audit.problems)}")
        if cfg.require_updates and audit.version == version:
            raise RunAborted(f"step {step}: --require-updates: the weight version did not change "
                             "after the update (raise --lr?)")
        version = audit.version
