"""The updates of one RL step: --ppo-epochs passes over --mini-batches mini-batches of the rollout.

Order (the same for every topology, so the topology matrix still holds):
  for epoch e in 0..E-1:
    for mini-batch m in 0..M-1:     # samples[m·n/M : (m+1)·n/M], cut from the logical sample order
      gradients of the mini-batch loss (train/step.py: normalised once over the whole mini-batch)
      exact norm, clip (train/optimizer.py), AdamW with the scheduled rate (train/schedule.py)
Old logprobs are always the rollout's (PPO, Schulman et al., arXiv 1707.06347 §3: the
importance ratio is against the policy that sampled), so after the first update the ratio
moves and the clip range acts. With E = M = 1 this is exactly the one on-policy update.

The train/rollout logprob audit of the evidence needs the trainer's logprobs at the rollout's
weights for every token: the first update sees mini-batch 0 at those weights; mini-batches
1..M-1 are checked by one forward pass without gradient before the first update (M > 1 only).

A non-finite gradient skips its update and every later update of the step (the same decision on
every rank: the exact norm's non-finite report is global); an update that makes a master weight
non-finite ends the step's updates too (the loop then stops the run).
Does not: roll out, compute advantages or write evidence (rlkernel/runner/loop.py).
Tests: `.venv/bin/python -m pytest -q tests/test_ppo.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlkernel.distributed.comm import Comm
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.numerics.exact import exact_sum, float_hex
from rlkernel.train.losses import LossCoefs
from rlkernel.train.optimizer import AdamW, GradStats
from rlkernel.train.zero import ZeroAdamW
from rlkernel.train.schedule import learning_rate
from rlkernel.train.step import (StepStats, TrainSample, compute_gradients, gradients,
                                 rollout_mismatches)


@dataclass(frozen=True)
class UpdatePlan:
    """How one RL step updates the policy. ppo_epochs, mini_batches >= 1; loss_agg in
    config.LOSS_AGGS; clip_grad >= 0 (0: no clipping); lr > 0 the base rate; lr_warmup_steps,
    lr_schedule, total_updates: the schedule over the run's optimizer updates."""

    ppo_epochs: int = 1
    mini_batches: int = 1
    loss_agg: str = "token-mean"
    clip_grad: float = 1.0
    lr: float = 1e-5
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"
    total_updates: int = 1

    @property
    def updates_per_step(self) -> int:
        return self.ppo_epochs * self.mini_batches

    @classmethod
    def from_config(cls, cfg) -> "UpdatePlan":
        """From a RunConfig."""
        return cls(cfg.ppo_epochs, cfg.mini_batches, cfg.loss_agg, cfg.clip_grad, cfg.lr,
                   cfg.lr_warmup_steps, cfg.lr_schedule, cfg.total_updates)


@dataclass(frozen=True)
class Update:
    """One optimizer update: where it sits, its rate, loss stats, exact gradient stats, and
    whether it was applied (False: non-finite gradient)."""

    epoch: int
    mini_batch: int
    lr: float
    stats: StepStats
    grad: GradStats
    applied: bool

    def record(self) -> dict:
        """The evidence entry of this update (every value deterministic: compared by rlk compare)."""
        return {"epoch": self.epoch, "mini_batch": self.mini_batch, "lr": self.lr,
                "grad_norm": self.grad.norm, "grad_norm_hex": float_hex(self.grad.norm),
                "grad_clip_coef": self.grad.clip_coef, "applied": self.applied,
                "loss": self.stats.loss, "pg_loss": self.stats.pg_loss, "kl": self.stats.kl,
                "entropy": self.stats.entropy, "n_tokens": self.stats.n_tokens,
                "n_clipped": self.stats.n_clipped}


@dataclass(frozen=True)
class StepUpdates:
    """Everything one RL step's updates produced. `diverged`: parameters made non-finite by an
    update (the same list on every rank); `logprob_mismatches` over `logprob_tokens` (trainer,
    rollout) pairs actually compared, all at the rollout's weights; `n_response_tokens` the
    step's response tokens (equal to logprob_tokens when every token was compared once)."""

    updates: list[Update]
    logprob_mismatches: int
    logprob_tokens: int
    n_response_tokens: int
    diverged: list[str]

    @property
    def skipped(self) -> bool:
        """True when an update was not applied (non-finite gradient)."""
        return any(not u.applied for u in self.updates)

    @property
    def grad(self) -> GradStats:
        """The step's headline gradient stats: those of the skipped update if any, else of the
        first update (the on-policy gradient at the rollout's weights)."""
        bad = [u for u in self.updates if not u.applied]
        return (bad[0] if bad else self.updates[0]).grad

    def mean(self, field: str) -> float | None:
        """Exact mean over the updates of one StepStats field (loss, pg_loss, kl, entropy);
        None where the field was not measured (kl without a reference policy)."""
        vals = [getattr(u.stats, field) for u in self.updates]
        if any(v is None for v in vals):
            return None
        return exact_sum(vals) / len(self.updates)

    @property
    def clip_frac(self) -> float:
        """Clipped tokens / tokens, over all updates (integers, divided once)."""
        return (sum(u.stats.n_clipped for u in self.updates)
                / sum(u.stats.n_tokens for u in self.updates))

    @property
    def n_microbatches(self) -> int:
        return sum(u.stats.n_microbatches for u in self.updates)


def mini_batches(samples: list[TrainSample], m: int) -> list[list[TrainSample]]:
    """`samples` (logical order) cut into m equal contiguous mini-batches.

    Raises ValueError when m does not divide len(samples).
    """
    n = len(samples)
    if m < 1 or n % m:
        raise ValueError(f"--mini-batches {m}: must divide the {n} samples of a step")
    k = n // m
    return [samples[i * k:(i + 1) * k] for i in range(m)]


def train_on_rollout(policy: Qwen3ForCausalLM, ref: Qwen3ForCausalLM | None, opt: AdamW | ZeroAdamW,
                     samples: list[TrainSample], plan: UpdatePlan, *, first_update: int,
                     temperature: float, coefs: LossCoefs, micro_batch_tokens: int, pad_id: int,
                     exp, counted: set[str] | None = None, comm: Comm | None = None,
                     after_backward: Callable[[dict[str, torch.Tensor]], None] | None = None,
                     on_update: Callable[[int, int], None] | None = None) -> StepUpdates:
    """Run the step's updates (module doc) on policy/opt; policy's weights follow the masters.

    first_update: 0-based index in the run of this step's first update (step · updates per step),
    for the LR schedule. counted/comm: as AdamW.clip (sharded runs). after_backward(grads): a
    hook on each update's gradients before the norm (the loop's fault injection). on_update(i, n):
    progress, before update i of n. Collective over the policy's groups and `comm`: every rank
    must call it with the same samples. Raises ValueError as compute_gradients.
    """
    batches = mini_batches(samples, plan.mini_batches)
    n = plan.updates_per_step
    mismatches = compared = 0
    if len(batches) > 1:  # checked now, while the policy still has the rollout's weights
        mismatches, compared = rollout_mismatches(
            policy, [s for b in batches[1:] for s in b], temperature=temperature,
            micro_batch_tokens=micro_batch_tokens, pad_id=pad_id)
    updates: list[Update] = []
    diverged: list[str] = []
    for i in range(n):
        e, m = divmod(i, plan.mini_batches)
        if on_update is not None:
            on_update(i, n)
        stats = compute_gradients(policy, ref, batches[m], temperature=temperature, coefs=coefs,
                                  micro_batch_tokens=micro_batch_tokens, pad_id=pad_id, exp=exp,
                                  agg=plan.loss_agg)
        if i == 0:
            mismatches += stats.logprob_mismatches
            compared += stats.logprob_compared
        grads = gradients(policy)
        if after_backward is not None:
            after_backward(grads)
        gstats = opt.clip(grads, plan.clip_grad, counted, comm)
        lr = learning_rate(plan.lr, first_update + i + 1, plan.total_updates,
                           plan.lr_warmup_steps, plan.lr_schedule)
        applied = not gstats.nonfinite
        updates.append(Update(e, m, lr, stats, gstats, applied))
        if not applied:
            break
        opt.step(grads, lr=lr)
        policy.load_master_shards(opt.weights(policy.param_dtype))
        mine = [name for name, t in opt.master.items() if not torch.isfinite(t).all()]
        everyone = [mine] if comm is None or comm.size == 1 else \
            comm.all_gather_object(mine, "diverged-weights")
        diverged = sorted(set().union(*map(set, everyone)))
        if diverged:
            break
    return StepUpdates(updates, mismatches, compared, sum(len(s.response_ids) for s in samples),
                       diverged)
