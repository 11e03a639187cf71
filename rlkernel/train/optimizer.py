"""AdamW on fp32 master weights with exact-norm gradient clipping.

The gradient norm is the exact sum of squares (rlkernel/numerics/exact.py): the same bits for any
sharding or order. Clipping multiplies every gradient by one fp32 coefficient
max_norm / (norm + 1e-6) when it is below 1 (as torch.nn.utils.clip_grad_norm_). AdamW
(Loshchilov & Hutter, arXiv 1711.05101; the update of torch.optim.AdamW) is written with separate
elementwise ops — no fused lerp/addcmul/addcdiv, whose vector and scalar paths may round
differently — so an element's update never depends on the shard it sits in. Every op is one
correctly rounded fp32 result, with the scalars rounded to fp32 first (kernels/adamw.py defines
the bytes, NUMERICS_VERSION 9): on CUDA one fused Triton kernel per tensor
(kernels/triton_adamw.py, one pass over p, g, m, v instead of 13-14 launches; torch's own CUDA
ops differ from it in 0.15-4.3 % of masters, measured on an H200), on CPU the same sequence in
float64 torch ops rounded once per op (kernels/adamw.adamw_rounded_: the kernel's bytes, on any
vector ISA; torch's fp32 CPU sqrt is not correctly rounded). `_step_torch` keeps torch's own fp32
ops, the CPU bytes before version 9, for benchmarks and negative controls.
The model's weights are the masters rounded to the parameter dtype.
Does not: shard optimizer state (train/zero.py wraps this class for that) or schedule the
learning rate (step() takes each update's rate; rlkernel/train/schedule.py computes it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rlkernel.distributed.comm import Comm
from rlkernel.kernels import adamw
from rlkernel.numerics.exact import ExactSumOfSquares


@dataclass(frozen=True)
class AdamWParams:
    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass(frozen=True)
class GradStats:
    """Exact pre-clip gradient norm (float64), the applied clip coefficient, non-finite params
    (sorted) and, for each, the global ranks whose gradient shard held NaN/Inf."""

    norm: float
    clip_coef: float
    nonfinite: tuple[str, ...]
    nonfinite_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)


def grad_norm(grads: dict[str, torch.Tensor], counted: set[str] | None = None,
              comm: Comm | None = None, parts: dict[str, torch.Tensor] | None = None
              ) -> tuple[float, dict[str, tuple[int, ...]]]:
    """Exact L2 norm of all gradients (float64) and the tensors holding NaN/Inf: name -> the
    global ranks where they do (sorted by name; every rank gets the same answer).

    Sharded runs: each rank adds the tensors in `counted` (each logical element exactly once
    over the job) and the integer bins of every rank in `comm` are added as integers. `parts`:
    the piece of each counted tensor this rank adds (ZeRO chunks; default the whole tensor);
    non-finite values are looked for in whole tensors all the same.
    """
    acc = ExactSumOfSquares()
    bad: set[str] = set()
    for name, g in grads.items():
        if counted is None or name in counted:
            part = g if parts is None else parts[name]
            acc.add_(part, name)
            if part is not g and not torch.isfinite(g).all():
                bad.add(name)
        elif not torch.isfinite(g).all():
            bad.add(name)
    bad.update(acc.nonfinite_names)
    if comm is None or comm.size == 1:
        rank = 0 if comm is None else comm.ranks[0]
        return acc.norm(), {n: (rank,) for n in sorted(bad)}
    total = torch.stack(comm.all_gather(acc.to_tensor(), "grad-norm-bins")).sum(0)
    per_rank = comm.all_gather_object(sorted(bad), "grad-nonfinite-names")
    where = {n: tuple(comm.ranks[i] for i, names in enumerate(per_rank) if n in names)
             for n in sorted(set().union(*per_rank))}
    return ExactSumOfSquares.from_tensor(total).norm(), where


def _triton_adamw():
    from rlkernel.kernels import triton_adamw  # lazy: CPU installs need no triton
    return triton_adamw


def _kernel_takes(p: torch.Tensor) -> bool:
    """Whether the fused kernel updates this master: every CUDA one (the kernel defines CUDA's
    bytes; tests patch this to run it under the interpreter)."""
    return p.is_cuda


def _update_contiguous(update, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor,
                       v: torch.Tensor, scalars: adamw.AdamWScalars) -> None:
    """One tensor's update by `update` (the kernel or kernels/adamw.adamw_rounded_, which read
    contiguous tensors only): a strided master or moment is updated in contiguous copies written
    back (every layout of a tensor must take the definition)."""
    flat = [t if t.is_contiguous() else t.contiguous() for t in (p, m, v)]
    update(flat[0], g.contiguous(), flat[1], flat[2], scalars)   # g is only read
    for t, c in zip((p, m, v), flat):
        if c is not t:
            t.copy_(c)


class AdamW:
    """AdamW over named fp32 masters [same shapes as the parameters]."""

    def __init__(self, masters: dict[str, torch.Tensor], hp: AdamWParams) -> None:
        self.hp = hp
        self.master = {n: t.detach().to(torch.float32).clone() for n, t in masters.items()}
        self.exp_avg = {n: torch.zeros_like(t) for n, t in self.master.items()}
        self.exp_avg_sq = {n: torch.zeros_like(t) for n, t in self.master.items()}
        self.steps = 0

    def clip(self, grads: dict[str, torch.Tensor], max_norm: float, counted: set[str] | None = None,
             comm: Comm | None = None, parts: dict[str, torch.Tensor] | None = None) -> GradStats:
        """Scale grads in place to norm <= max_norm (0 = no clipping); returns the exact stats.
        counted/comm/parts: as grad_norm."""
        norm, bad = grad_norm(grads, counted, comm, parts)
        coef = 1.0
        if max_norm > 0 and math.isfinite(norm):
            coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            g0 = next(iter(grads.values()))
            c32 = torch.tensor(coef, dtype=torch.float32, device=g0.device)
            for g in grads.values():
                g.mul_(c32)
        return GradStats(norm, coef, tuple(bad), bad)

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor], lr: float | None = None) -> None:
        """One AdamW update of every master from fp32 grads (same names), every op correctly
        rounded (kernels/adamw.py).

        lr: this update's learning rate (a Python float, e.g. from train/schedule.py; the same on
        every rank); None: the constant hp.lr. On CUDA each tensor is one fused kernel
        (kernels/triton_adamw.py, one pass instead of 13-14), elsewhere
        kernels/adamw.adamw_rounded_ (the same bytes); a strided master or moment through
        contiguous copies.
        """
        self._step(grads, lr, torch_ops=False)

    @torch.no_grad()
    def _step_torch(self, grads: dict[str, torch.Tensor], lr: float | None = None) -> None:
        """`step` through torch's own fp32 ops on every device: not correctly rounded (CPU:
        true division by bc2 and torch's fp32 sqrt, the CPU bytes before NUMERICS_VERSION 9; on
        CUDA what benchmarks/bench_adamw.py times and counts the kernel's differences from)."""
        self._step(grads, lr, torch_ops=True)

    def _step(self, grads: dict[str, torch.Tensor], lr: float | None, torch_ops: bool) -> None:
        hp = self.hp
        lr = hp.lr if lr is None else lr
        self.steps += 1
        bc1 = 1.0 - hp.beta1 ** self.steps
        bc2_sqrt = math.sqrt(1.0 - hp.beta2 ** self.steps)
        step_size = lr / bc1
        decay = 1.0 - lr * hp.weight_decay if hp.weight_decay else None
        scalars = adamw.step_scalars(hp.beta1, hp.beta2, hp.eps, bc2_sqrt, step_size, decay)
        for n, p in self.master.items():
            g = grads[n].to(torch.float32)
            m, v = self.exp_avg[n], self.exp_avg_sq[n]
            if not torch_ops:
                update = _triton_adamw().adamw_ if _kernel_takes(p) else adamw.adamw_rounded_
                _update_contiguous(update, p, g, m, v, scalars)
                continue
            m.mul_(hp.beta1).add_(g * (1.0 - hp.beta1))
            v.mul_(hp.beta2).add_((g * g) * (1.0 - hp.beta2))
            denom = (torch.sqrt(v) / bc2_sqrt) + hp.eps
            if decay is not None:
                p.mul_(decay)
            p.sub_((m / denom) * step_size)

    @torch.no_grad()
    def load_state(self, masters, exp_avg, exp_avg_sq, steps: int) -> None:
        """Restore masters/moments (same names and shapes, this rank's shards) and the step count."""
        for n in self.master:
            self.master[n].copy_(masters[n])
            self.exp_avg[n].copy_(exp_avg[n])
            self.exp_avg_sq[n].copy_(exp_avg_sq[n])
        self.steps = steps

    def weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The masters by name (whole tensors): what Qwen3ForCausalLM.load_master_shards rounds
        to the parameter dtype `dtype` (the same interface as train/zero.ZeroAdamW)."""
        return self.master

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Masters and moments by name, for checkpoints and audits."""
        out = {f"master/{n}": t for n, t in self.master.items()}
        out.update({f"exp_avg/{n}": t for n, t in self.exp_avg.items()})
        out.update({f"exp_avg_sq/{n}": t for n, t in self.exp_avg_sq.items()})
        return out
