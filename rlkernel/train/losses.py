"""Per-token RL loss terms: PPO-clip policy loss, KL to the reference policy, entropy bonus.

Everything is elementwise per response token; the step normalises once by the logical count of
response tokens (DESIGN.md §1 "no CP loss multiplier"), so the backward of the loss needs no
reduction at all: each token's gradient coefficient is mask / N.
Sources: PPO-clip (Schulman et al., arXiv 1707.06347 §3); KL estimators k1/k2/k3 (J. Schulman,
"Approximating KL Divergence", 2020; k3 as used by GRPO, arXiv 2402.03300 eq. 4).
Does not: reduce, normalise or call backward (train/step.py does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkernel.kernels.elementwise import exp32


class _Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = exp32(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


def invariant_exp(x: torch.Tensor) -> torch.Tensor:
    """exp with a path-independent forward (kernels/elementwise.py) and exact backward g·y."""
    return _Exp.apply(x)


@dataclass(frozen=True)
class LossCoefs:
    """clip_eps > 0, kl_coef >= 0, entropy_coef >= 0, kl_estimator in {k1, k2, k3}.

    clip_eps_low / clip_eps_high (None = clip_eps) clip the ratio to [1 - low, 1 + high]:
    DAPO's decoupled clip (Yu et al. 2025, arXiv 2503.14476 §3.1). RunConfig keeps the lower one
    in [0, 1) (a bound 1 - low <= 0 never acts) and the upper one finite >= 0.
    """

    clip_eps: float
    kl_coef: float
    entropy_coef: float
    kl_estimator: str
    clip_eps_low: float | None = None
    clip_eps_high: float | None = None

    @property
    def clip_low(self) -> float:
        return self.clip_eps if self.clip_eps_low is None else self.clip_eps_low

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


def kl_terms(lp: torch.Tensor, ref_lp: torch.Tensor, estimator: str, exp=invariant_exp):
    """Per-token KL(π‖π_ref) estimate from logprobs [N] (fp32) of the sampled tokens -> [N]."""
    if estimator == "k1":
        return lp - ref_lp
    if estimator == "k2":
        d = lp - ref_lp
        return 0.5 * (d * d)
    if estimator == "k3":
        d = ref_lp - lp
        return (exp(d) - d) - 1.0
    raise ValueError(f"--kl-estimator {estimator!r} is not known; allowed: k1, k2, k3")


def token_losses(lp, old_lp, ref_lp, entropy, adv, c: LossCoefs, exp=invariant_exp):
    """(total, pg, kl, clipped) per token [N]: three fp32 tensors (kl None without ref_lp) and a
    bool mask.

    lp: current-policy logprobs (differentiable); old_lp: the rollout's logprobs; ref_lp: the
    reference policy's, or None when kl_coef is 0 and no reference policy is kept (as TRL does
    at beta = 0; ValueError if kl_coef > 0); entropy: per-token entropy (differentiable); adv:
    per-token advantage.
    total = pg + kl_coef·kl − entropy_coef·entropy, pg = −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A).
    clipped: the clipped term is strictly the smaller one, so the token's policy gradient is 0
    (the "clip fraction" of PPO implementations counts these tokens).
    """
    ratio = exp(lp - old_lp)
    unclipped = ratio * adv
    clipped_obj = torch.clamp(ratio, 1.0 - c.clip_low, 1.0 + c.clip_high) * adv
    pg = -torch.minimum(unclipped, clipped_obj)
    if ref_lp is None and c.kl_coef:
        raise ValueError(f"token_losses: kl_coef={c.kl_coef} needs the reference logprobs")
    kl = None if ref_lp is None else kl_terms(lp, ref_lp, c.kl_estimator, exp)
    total = pg
    if c.kl_coef:
        total = total + c.kl_coef * kl
    if c.entropy_coef:
        total = total - c.entropy_coef * entropy
    return total, pg, kl, (clipped_obj < unclipped).detach()
