"""The RL loop of `rlk run`: rollout → rewards/advantages → train → AdamW → weight export +
reload + audit → evidence, once per step (DESIGN.md §2), on one process or on dp·tp·cp ranks.

Every rank runs the same loop on its shards; rank 0 writes the evidence and calls the reward
function (rewards are broadcast, so every rank computes advantages from the same list); when all
steps are done rank 0 keeps the final weights in RUN/final (rlkernel/runner/export.py).
Everything that can be checked is checked before the first step (model, tokenizer, every prompt
of every step). Each step's evidence is written atomically as soon as the step ends.
Does not: decide the topology (config + distributed/topology.py) or create the run directory (cli.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import pathlib
import signal
import threading
import time

import torch

from rlkernel.config import RunConfig, model_flag_error
from rlkernel.data.chat import load_chat_template
from rlkernel.data.rewards import load_reward, score_on_rank0
from rlkernel.data.tasks import prompt_source
from rlkernel.data.tokenizer import TokenizerError, load_tokenizer
from rlkernel.distributed.context import build_contexts
from rlkernel.distributed.parallel import ParallelCtx
from rlkernel.distributed.topology import launcher_world_size
from rlkernel.model.checkpoint import CheckpointError, init_weights, load_checkpoint
from rlkernel.model.config import tiny
from rlkernel.model.ops import ops_for
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.model.sharding import local_tensor, logical_tensor
from rlkernel.numerics.exact import exact_sum, float_hex
from rlkernel.rollout.engine import Request, RolloutEngine, SamplingParams
from rlkernel.runner import faults
from rlkernel.runner.checkpointing import (Checkpoint, ResumeError, check_state, inputs_digest,
                                            latest_checkpoint, save_checkpoint)
from rlkernel.runner.evidence import EvidenceWriter, Progress
from rlkernel.runner.inputs import read_twice_problem
from rlkernel.runner.watch import NullWatch, RunWatch, completion_rows
from rlkernel.runner.export import save_final_weights
from rlkernel.train.grpo import group_advantages
from rlkernel.train.losses import LossCoefs, invariant_exp
from rlkernel.train.optimizer import AdamWParams
from rlkernel.train import zero
from rlkernel.train.zero import ZeroAdamW
from rlkernel.train.ppo import UpdatePlan, train_on_rollout
from rlkernel.train.step import TrainSample
from rlkernel.weights.sync import merge_problems, sync_weights


class RunAborted(ValueError):
    """The run stopped on a failed check (audit, non-finite gradient, --require-updates)."""


_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class InputError(ValueError):
    """A bad input the run finds only once it has started, before its first step: the --model
    checkpoint's contents, a prompt's token count. A usage error (rlk run exits 2), named by
    the flag it came in through."""


def _load_model(cfg: RunConfig):
    if cfg.model is None:
        mcfg = tiny()
        return mcfg, init_weights(mcfg, cfg.model_seed)
    try:
        return load_checkpoint(cfg.model)
    except CheckpointError as e:
        raise InputError(model_flag_error(cfg.model, str(e))) from None


def _load_tokenizer(cfg: RunConfig, mcfg):
    try:
        return load_tokenizer(cfg.model, vocab_size=mcfg.vocab_size,
                              eos_token_id=mcfg.eos_token_id)
    except TokenizerError as e:   # the CLI refuses it first (runner/inputs.py); ranks see it here
        raise InputError(model_flag_error(cfg.model, str(e))) from None


def _encode_all(cfg: RunConfig, source, tok, chat=None,
                max_positions: int | None = None) -> list[list[list[int]]]:
    """Token ids of every prompt of every step, through the chat template `chat` when given;
    InputError naming the prompt (`--prompts FILE:LINE` for a file's) if one is unusable. A
    too-long prompt's hint names the flags that fit the run's longest prompt, or says it cannot
    fit the model's `max_positions` (max_position_embeddings) with this --max-response-len."""
    out, too_long = [], None
    for step in range(cfg.steps):
        batch = []
        for p in source.batch(step):
            name = (f"--prompts {p.where}: prompt" if p.where
                    else f"prompt {p.index} (evidence step {step})")
            ids = tok.encode(p.text if chat is None else chat.render(p.text))
            if not ids:
                raise InputError(f"{name} encodes to no tokens")
            if len(ids) > cfg.max_prompt_len and too_long is None:
                too_long = (name, len(ids))
            batch.append(ids)
        out.append(batch)
    if too_long is not None:   # named after every prompt is read: the hint is the run's longest
        longest = max(len(ids) for batch in out for ids in batch)
        need = longest + cfg.max_response_len    # one whole sample fits one microbatch
        head = (f"{too_long[0]} has {too_long[1]} tokens, more than --max-prompt-len "
                f"{cfg.max_prompt_len}; the longest prompt of the run's {cfg.steps} step(s) has "
                f"{longest}")
        if max_positions is not None and need > max_positions:
            raise InputError(f"{head}, and {longest} + --max-response-len {cfg.max_response_len}"
                             f" = {need} passes the model's max_position_embeddings "
                             f"{max_positions}: with this --max-response-len a prompt fits in "
                             f"{max_positions - cfg.max_response_len} tokens at most")
        budget = ("" if need <= cfg.micro_batch_tokens else
                  f", and --micro-batch-tokens {need} or more (now {cfg.micro_batch_tokens}: "
                  f"{longest} + --max-response-len {cfg.max_response_len} tokens must fit one "
                  "microbatch)")
        give = "a new run needs" if cfg.resume else "give"    # a resume keeps its flags
        raise InputError(f"{head}: {give} --max-prompt-len {longest} or more{budget}")
    return out


def _describe_model(cfg: RunConfig, mcfg) -> str:
    where = cfg.model if cfg.model else f"embedded tiny Qwen3 (--model-seed {cfg.model_seed})"
    return (f"{where}: {mcfg.num_hidden_layers} layers, hidden {mcfg.hidden_size}, "
            f"vocab {mcfg.vocab_size}")


def _describe_prompts(cfg: RunConfig) -> str:
    """The start-up line's data: the prompts' source and the reward that scores them."""
    data = cfg.prompts if cfg.prompts else "built-in arithmetic task"
    return f"{data} ({cfg.reward or 'exact-match'} reward)"


def _describe_device(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    return "cpu"


def _few(names: list[str], limit: int = 8) -> str:
    """Names for a one-line message: the first `limit`, then how many more."""
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")


def _tokens_hash(completions) -> str:
    payload = json.dumps([[c.sample_id, c.response_ids] for c in completions]).encode()
    return hashlib.sha256(payload).hexdigest()


def run_loop(cfg: RunConfig, run_dir: pathlib.Path, writer: EvidenceWriter,
             read: dict | None = None) -> None:
    """Run cfg.steps RL steps, recording init and per-step evidence through `writer`.

    One process when dp·tp·cp == 1 (and not under torchrun), else dp·tp·cp ranks
    (rlkernel/distributed/launch.py). `read`: {"prompts": PromptSource.describe(), "reward":
    RewardFn.describe()} as `rlk run` read them before any work; every rank's own reads must
    give the same hashes (runner/inputs.read_twice_problem; None: only the ranks' reads are
    held to each other).
    Raises ValueError (bad inputs, before any step; InputError when an input changed since
    `read`), RunAborted (a failed check, after the failing
    step's evidence is written; also a rank lost to a signal or a hang), or the launcher's
    RankFailure naming the rank that raised.
    """
    world = cfg.train_world_size
    faults.check(cfg.steps, world)  # test hook: reject a bad RLK_FAULT before anything starts
    if world == 1 and launcher_world_size() is None:
        from rlkernel.distributed.topology import Topology, single_comms
        _run(cfg, Topology(world=1, rank=0), single_comms(), writer, pathlib.Path(run_dir),
             read)
        return
    from rlkernel.distributed.launch import RankFailure, cuda_backend, launch
    from rlkernel.distributed.topology import dist_timeout_s
    # On CUDA the group must carry CPU tensors too (collective signatures, audit problem lists,
    # exact-norm limbs): NCCL alone rejects them.
    backend = cuda_backend() if cfg.device == "cuda" else "gloo"
    try:
        launch(_rank_main, (cfg, str(run_dir), writer.manifest, read), world_size=world,
               backend=backend, timeout_s=dist_timeout_s())
    except RankFailure as e:
        if e.error_type:  # the rank raised: its error (and traceback) goes up unchanged
            raise
        raise RunAborted(str(e)) from e  # lost (signal, exit) or hung: one line, evidence kept
    finally:
        writer.adopt()


def _rank_main(rank: int, cfg: RunConfig, run_dir: str, manifest: dict,
               read: dict | None) -> None:
    """One rank of a multi-process run (module-level: the launcher pickles it by name)."""
    import torch.distributed as dist

    from rlkernel.distributed.topology import Topology, build_comms
    topo = Topology.from_config(cfg, rank, dist.get_world_size())
    comms = build_comms(topo)
    writer = None
    if rank == 0:
        if cfg.resume:
            upto = latest_checkpoint(pathlib.Path(cfg.resume)).next_step
            writer = EvidenceWriter.resume(run_dir, manifest, upto, Progress(total=cfg.steps))
        else:
            writer = EvidenceWriter(run_dir, manifest, Progress(total=cfg.steps))
    _run(cfg, topo, comms, writer, pathlib.Path(run_dir), read)
    if writer is not None and not writer.complete:
        writer.finish({"steps": writer.n_steps})


def _peak_gpu_mem_gib(dev: torch.device, comms) -> float | None:
    """The step's peak allocated GPU memory in GiB, max over ranks (None on CPU); resets the
    peak so that every step reports its own. Collective on CUDA: call on every rank."""
    if dev.type != "cuda":
        return None
    mine = torch.cuda.max_memory_allocated(dev) / 2**30
    torch.cuda.reset_peak_memory_stats(dev)
    return max(comms.world.all_gather_object(mine, "peak-gpu-mem"))


def _stop(topo, msg: str) -> None:
    """End the run on a failed check (decided identically on every rank): rank 0, which has just
    written the evidence, raises RunAborted; the others return quietly, so the launcher never
    stops rank 0 before the failing step's record is on disk."""
    if topo.rank == 0:
        raise RunAborted(msg)


def _reference_policy(cfg, mcfg, ops, pdtype, train_pc, live, dev, tensors):
    """The frozen initial policy the KL term is measured against, or None at --kl-coef 0: no KL
    term, so neither its memory nor its forward pass per microbatch (TRL's GRPO does the same at
    beta = 0); the evidence's kl is then null. Inference only, so bf16 runs hold its 2-D
    weights in bf16 (half their bytes; the same logprobs)."""
    if not cfg.kl_coef:
        return None
    ref = Qwen3ForCausalLM(mcfg, ops, pdtype, train_pc, live).to(dev)
    ref.load_tensors(tensors)
    ref.requires_grad_(False)
    ref.hold_matmul_weights()
    return ref


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


def _opt_state(opt: ZeroAdamW, policy: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """Logical (unsharded) fp32 masters and moments, reassembled from every DP × CP rank's
    chunks (ZeroAdamW.state_tensors) and every TP rank's shard. Collective."""
    out = {}
    for key, t in opt.state_tensors().items():      # "master/<param>", "exp_avg/<param>", ...
        parts = policy.pc.tp.all_gather(t, f"ckpt:{key}")
        out[key] = logical_tensor(key.split("/", 1)[1], parts, policy.cfg)
    return out


def _restore(opt: ZeroAdamW, policy: Qwen3ForCausalLM, ck: Checkpoint, topo) -> None:
    """Load a checkpoint's logical state as this rank's shards and chunks (any topology)."""
    check_state(ck, policy.cfg)   # rank 0's CLI checked it; the other ranks come straight here

    def shards(kind):
        return {n: local_tensor(n, ck.tensors[f"{kind}/{n}"], policy.cfg, topo.tp, topo.tp_rank)
                for n in opt.master}
    try:
        opt.load_state(shards("master"), shards("exp_avg"), shards("exp_avg_sq"), ck.opt_steps)
    except KeyError as e:
        raise ResumeError(f"{ck.path}: checkpoint lacks tensor {e}") from None
    policy.load_master_shards(opt.weights(policy.param_dtype))


def _watch(cfg: RunConfig, writer: EvidenceWriter | None, run_dir: pathlib.Path):
    """Rank 0's RunWatch (console + metrics files), a NullWatch elsewhere."""
    if writer is None:
        return NullWatch()
    start = latest_checkpoint(pathlib.Path(cfg.resume)).next_step if cfg.resume else 0
    if writer.progress is not None:
        console = writer.progress.console
    else:
        from rich.console import Console
        console = Console(stderr=True, highlight=False)
    return RunWatch(cfg, run_dir, console, start)


def _run(cfg: RunConfig, topo, comms, writer: EvidenceWriter | None,
         run_dir: pathlib.Path, read: dict | None) -> None:
    watch = _watch(cfg, writer, run_dir)
    try:
        _run_steps(cfg, topo, comms, writer, run_dir, watch, read)
    finally:
        watch.close()


def _run_steps(cfg: RunConfig, topo, comms, writer: EvidenceWriter | None,
               run_dir: pathlib.Path, watch, read: dict | None) -> None:
    ops = ops_for(cfg.mode)
    exp = invariant_exp if cfg.mode == "invariant" else torch.exp
    pdtype = _DTYPES[cfg.dtype]
    watch.phase(f"loading {cfg.model or 'the embedded tiny model'}")
    mcfg, tensors = _load_model(cfg)
    tok = _load_tokenizer(cfg, mcfg)
    source = prompt_source(cfg.prompts, n_prompts_per_step=cfg.n_prompts, steps=cfg.steps,
                           seed=cfg.seed, input_key=cfg.input_key, label_key=cfg.label_key)
    chat = load_chat_template(cfg.model) if cfg.apply_chat_template else None
    encoded = _encode_all(cfg, source, tok, chat, mcfg.max_position_embeddings)
    reward_fn = load_reward(cfg.reward)
    changed = read_twice_problem(cfg, comms.world.all_gather_object(
        ({"prompts": source.describe(), "reward": reward_fn.describe()}, read), "inputs-read"))
    if changed is not None:
        raise InputError(changed)
    if topo.world > 1:
        train_pc, roll_pc = build_contexts(topo, comms, mcfg)
    else:
        train_pc, roll_pc = ParallelCtx.single(), ParallelCtx.single()

    dev = torch.device(cfg.device)
    # Padded vocabulary (embedding rows past the tokenizer's ids): those ids get probability 0
    # in rollout and trainer alike (kernels/logprobs.py), so they are never sampled.
    live = min(tok.vocab_size, mcfg.vocab_size)   # the byte tokenizer's reserved ids may exceed it
    policy = Qwen3ForCausalLM(mcfg, ops, pdtype, train_pc, live).to(dev)
    if cfg.mode == "invariant":   # weights held once in bf16, fp32 gradients beside them
        policy.hold_matmul_weights()
    policy.load_tensors(tensors)
    policy.recompute = cfg.recompute
    ref = _reference_policy(cfg, mcfg, ops, pdtype, train_pc, live, dev, tensors)
    engine = RolloutEngine(mcfg, ops, pdtype, pad_id=tok.pad_id, device=dev, pc=roll_pc,
                           live_vocab=live, gpu_memory_utilization=cfg.gpu_memory_utilization,
                           decode_graphs="eager" if cfg.enforce_eager else "auto",
                           keep_state=cfg.keep_rollout_state)
    rollout = _Rollout(engine, topo, comms)
    opt, counted = zero.build({n: p.detach() for n, p in policy.logical_params().items()},
                              AdamWParams(cfg.lr, cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps,
                                          cfg.weight_decay), comms, topo, mcfg)
    coefs = LossCoefs(cfg.clip_eps, cfg.kl_coef, cfg.entropy_coef, cfg.kl_estimator,
                      cfg.clip_eps_low, cfg.clip_eps_high)
    plan = UpdatePlan.from_config(cfg)
    sp = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_response_len, cfg.seed, tok.eos_id)
    watch.startup(model=_describe_model(cfg, mcfg),
                  n_params=sum(t.numel() for t in tensors.values()),
                  tokenizer=type(tok).__name__, prompts=_describe_prompts(cfg), world=topo.world,
                  device=_describe_device(dev))

    def audit_sync(tamper=None, load=None, previous=None):
        t0 = time.perf_counter()
        exported = policy.export_tensors(on_device=True)
        export_s = time.perf_counter() - t0
        # Over the world: every rank holds this same export (TP all-gathers it, DP and CP
        # replicas hold the same bytes), so the hashing splits over all of them; the world
        # holds every rollout group, so all agree on whether to take the failure path.
        a = sync_weights(exported, engine, tamper, load, previous, comm=comms.world)
        problems = comms.world.all_gather_object(list(a.problems), "audit-problems")
        return dataclasses.replace(a, problems=merge_problems(problems),
                                   timings={"trainer_export_s": export_s, **a.timings})

    start = 0
    if cfg.resume:
        ck = latest_checkpoint(pathlib.Path(cfg.resume))
        _restore(opt, policy, ck, topo)
        start = ck.next_step
    audit = audit_sync()
    if cfg.resume:
        if audit.version != ck.version:
            raise ResumeError(f"{ck.path}: restored weights have version {audit.version[:12]}, "
                              f"the checkpoint recorded {ck.version[:12]}")
    elif writer is not None:
        writer.record_init(audit.record())
    if not audit.ok:
        return _stop(topo, f"initial weight sync failed: {audit.problems[0]}")
    version = audit.version
    for step in range(start, cfg.steps):
        watch.step_started(step)
        watch.phase("rollout")
        t0 = time.perf_counter()
        prompts = source.batch(step)
        g = cfg.n_samples_per_prompt
        requests = [Request((step * cfg.n_prompts + j) * g + k, tuple(encoded[step][j]))
                    for j in range(len(prompts)) for k in range(g)]
        completions = rollout.generate(requests, sp)
        t1 = time.perf_counter()
        watch.phase("reward")
        # Rank 0 scores, in sample order, and broadcasts (a user reward need not be deterministic).
        rewards = score_on_rank0(reward_fn, [(prompts[i // g].text, tok.decode(c.response_ids),
                                              prompts[i // g].label, c.sample_id)
                                             for i, c in enumerate(completions)],
                                 topo.rank, comms.world)
        t_reward = time.perf_counter()
        adv = group_advantages(rewards, g)
        if not cfg.kl_coef and not cfg.entropy_coef and not any(adv):
            watch.zero_gradient(step)
        samples = [TrainSample(c.sample_id, c.prompt_ids, tuple(c.response_ids),
                               c.logprob_tensor(), a) for c, a in zip(completions, adv)]

        def after_backward(grads, step=step):
            faults.corrupt_grads(step, topo.rank, grads)  # test hook (RLK_FAULT); no-op unset
            faults.maybe_die(step, topo.rank)  # test hook (RLK_FAULT); no-op when unset

        done = train_on_rollout(
            policy, ref, opt, samples, plan, first_update=step * plan.updates_per_step,
            temperature=cfg.temperature, coefs=coefs, micro_batch_tokens=cfg.micro_batch_tokens,
            pad_id=tok.pad_id, exp=exp, counted=counted, comm=comms.world,
            after_backward=after_backward,
            on_update=lambda i, n: watch.phase(f"train, update {i + 1}/{n}"))
        gstats, skipped = done.grad, done.skipped
        watch.phase("sync")
        t2 = time.perf_counter()
        # tamper, load: test hooks (RLK_FAULT), None when unset; `version` is what the engine
        # served until now, so a stale engine is named as such.
        audit = audit_sync(faults.tamper(step, topo.rank), faults.load(step, topo.rank), version)
        t3 = time.perf_counter()
        peak = _peak_gpu_mem_gib(dev, comms)
        rec = {
            "step": step,
            "grad_norm": gstats.norm, "grad_norm_hex": float_hex(gstats.norm),
            "grad_clip_coef": gstats.clip_coef,
            "grad_nonfinite": list(gstats.nonfinite), "update_skipped": skipped,
            "nonfinite_ranks": {n: list(r) for n, r in gstats.nonfinite_ranks.items()},
            **audit.record(), "version_changed": audit.version != version,
            "tokens_hash": _tokens_hash(completions),
            "n_samples": len(completions), "n_response_tokens": done.n_response_tokens,
            "logprob_mismatches": done.logprob_mismatches,
            "logprob_tokens": done.logprob_tokens,   # (trainer, rollout) pairs actually compared
            "rewards": rewards, "reward_mean": exact_sum(rewards) / len(rewards),
            "loss": done.mean("loss"), "pg_loss": done.mean("pg_loss"), "kl": done.mean("kl"),
            "entropy": done.mean("entropy"),
            "clip_frac": done.clip_frac, "lr": done.updates[0].lr,
            "timings": {"rollout_s": t1 - t0, "reward_s": t_reward - t1,
                        "train_s": t2 - t_reward, "export_audit_s": t3 - t2,
                        "step_s": t3 - t0, "sync": audit.timings},
            # How the step ran, not what it computed (not compared): microbatches depend on
            # --micro-batch-tokens and --dp, the peak memory on the device.
            "resources": {"peak_gpu_mem_gib": peak, "microbatches_rank0": done.n_microbatches},
        }
        if plan.updates_per_step > 1:  # every optimizer update of the step, in order
            rec["updates"] = [u.record() for u in done.updates]
        with _signals_deferred():   # the step's evidence, metrics and checkpoint land together
            stop = _finish_step(cfg, topo, writer, watch, run_dir, opt, policy, rec, done,
                                audit, version, completion_rows(
                                    step, prompts, completions,
                                    [tok.decode(c.response_ids) for c in completions],
                                    rewards, adv, g))
        if stop:
            return
        version = audit.version
    # Keep the weights after the last step for `rlk export`: every rank exports (an all-gather
    # under TP), rank 0 writes RUN/final.
    final = policy.export_tensors()
    if topo.rank == 0:
        save_final_weights(run_dir, mcfg, final, step=cfg.steps - 1, version=version)


def _nonfinite_loss(cfg, rec: dict) -> str | None:
    """The stop message when step `rec`'s loss is not finite, else None. The loss is a metric
    (the update comes from per-token gradients, which can stay finite), but a NaN or inf loss
    means a coefficient times its term left fp32 — e.g. --kl-coef 3e38 with a KL of 4: the
    step is recorded, then the run stops, as the run's numbers no longer mean anything. Not
    asked of a step whose update was skipped for a non-finite gradient (`--on-nonfinite`)."""
    loss = rec["loss"]
    if loss is None or math.isfinite(loss):
        return None
    terms = ", ".join(f"{k} {rec[k]!r}" for k in ("pg_loss", "kl", "entropy")
                      if rec.get(k) is not None)
    return (f"evidence step {rec['step']}: the loss is {loss!r} ({terms}; --kl-coef "
            f"{cfg.kl_coef!r}, --entropy-coef {cfg.entropy_coef!r}): a term times its "
            "coefficient overflows fp32; lower that coefficient")


@contextlib.contextmanager
def _signals_deferred():
    """Hold SIGINT/SIGTERM/SIGHUP (main thread only; `rlk run` unwinds on all three) until the
    block ends: a Ctrl-C, kill or closed terminal just after a step's line is printed must not
    leave that step recorded without its checkpoint. A signal that
    arrives meanwhile is re-raised, to the handler that was in place, when the block ends; an
    ignored signal stays ignored. (A thread signal mask would not do: the kernel may deliver
    the signal to another thread, e.g. a torch worker, and Python still runs it at once.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    held = {}
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) not in (signal.SIG_IGN, None):
            held[sig] = signal.signal(sig, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(pending):
            signal.raise_signal(sig)


def _finish_step(cfg, topo, writer, watch, run_dir, opt, policy, rec, done, audit, version,
                 rows):
    """Record step rec (evidence, metrics, completions), run the end-of-step checks, and save
    the checkpoint when one is due. Returns whether the run stops here (`_stop`: rank 0 raises
    RunAborted, the other ranks get True)."""
    step, gstats, skipped = rec["step"], done.grad, rec["update_skipped"]
    if writer is not None:
        writer.record_step(rec)
    watch.record(rec, rows)
    if done.diverged:
        _stop(topo, f"evidence step {step}: the update made {_few(done.diverged)} non-finite; "
                    "the run diverged (lower --lr, or --clip-grad)")
        return True
    # a skipped update's loss may be non-finite with its gradient: --on-nonfinite decides that
    overflow = None if skipped else _nonfinite_loss(cfg, rec)
    if overflow is not None:
        _stop(topo, overflow)
        return True
    if skipped and cfg.on_nonfinite == "stop":
        where = _few([f"{n} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})"
                      for n, r in gstats.nonfinite_ranks.items()])
        _stop(topo, f"evidence step {step}: non-finite gradient in {where}; update not "
                    "applied, run stopped (--on-nonfinite stop)")
        return True
    if not audit.ok:
        _stop(topo, f"evidence step {step}: weight sync audit failed: "
                    f"{'; '.join(audit.problems)}")
        return True
    if cfg.require_updates and not skipped and audit.version == version:
        why = ("the gradient was exactly 0: every advantage was 0 (each group's rewards "
               "equal) and the KL and entropy terms gave nothing (coefficients 0, or a "
               "saturated softmax: a tiny --temperature makes every sampled logprob 0)"
               if gstats.norm == 0.0
               else f"the update was below {cfg.dtype} resolution (raise --lr?)")
        _stop(topo, f"evidence step {step}: --require-updates: the weight version did not "
                    f"change after the update: {why}")
        return True
    if cfg.save_every and (step + 1) % cfg.save_every == 0:
        state = _opt_state(opt, policy)
        if topo.rank == 0:
            save_checkpoint(run_dir, step + 1, opt.steps, state, audit.version,
                            settings=cfg.resume_settings(),
                            inputs=inputs_digest(writer.manifest.get("inputs")))
    return False
