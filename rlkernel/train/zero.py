"""ZeRO stage 1: AdamW's fp32 masters and moments sharded across the DP × CP ranks of a TP rank.

Every DP replica and every CP rank of it holds the same gradients (the GradSink sums them over
DP × CP — over the whole world for SP-sharded norm weights — as exact integers,
distributed/tokensum.py), so optimizer state need not be replicated across them: rank r of the D·C
ranks of one tp_rank ("dp_cp", in group order) keeps, for each parameter (its TP shard
flattened), the elements [r·c, min((r+1)·c, n)) with c = ⌈n / (D·C)⌉ — masters, exp_avg and
exp_avg_sq — updates them with the ordinary elementwise AdamW (train/optimizer.py; the chunks are
contiguous 1-D, so on CUDA they take its fused kernel), and the updated weights, rounded to the
parameter dtype (bf16 by default), are all-gathered so every rank computes with the whole
tensor. Optimizer memory per rank is 3 · 4 bytes · n / (D·C) per parameter (Rajbhandari et al.,
"ZeRO", arXiv 1910.02054, stage 1; sharding over data- and context-parallel ranks together is
what Megatron-LM's distributed optimizer does). `build` makes it for a topology, with the set of
parameters this rank counts in the gradient norm.

Why the bits cannot depend on D or C: AdamW is elementwise (an element's update reads only its
own gradient, master and moments, and the step count), clipping multiplies every element by one
fp32 coefficient, and that coefficient comes from the exact gradient norm, whose integer bins are
added across ranks (numerics/exact.py) — each logical element is counted once, in whichever
chunk holds it. Checkpoints hold logical tensors (gathered here over DP × CP, in the loop over
TP), so a run resumes at any DP or CP size bit for bit.
Does not: reduce gradients (the sink did), or shard gradients or parameters (stages 2/3).
Tests: `.venv/bin/python -m pytest -q tests/test_dp.py tests/test_topology.py`.
"""

from __future__ import annotations

import torch

from rlkernel.distributed.comm import Comm
from rlkernel.model.sharding import counts_for_norm
from rlkernel.train.optimizer import AdamW, AdamWParams, GradStats



class ZeroAdamW:
    """AdamW over this rank's chunks of named parameters (module doc).

    params: this rank's local (TP-shard) fp32 tensors by name, the initial masters. dp: the
    group whose ranks hold the same gradients and split the state (the DP × CP ranks of one
    tp_rank in a run; Comm.single: the chunk is the whole tensor).
    """

    def __init__(self, params: dict[str, torch.Tensor], hp: AdamWParams, dp: Comm) -> None:
        self.dp = dp
        self.shapes = {n: tuple(t.shape) for n, t in params.items()}
        self._bounds = {}
        for n, t in params.items():
            per = -(-t.numel() // dp.size)
            self._bounds[n] = (min(dp.rank * per, t.numel()), min((dp.rank + 1) * per, t.numel()),
                               per)
        self.inner = AdamW({n: self.chunk(n, t) for n, t in params.items()}, hp)

    @property
    def hp(self) -> AdamWParams:
        return self.inner.hp

    @property
    def steps(self) -> int:
        return self.inner.steps

    @property
    def master(self) -> dict[str, torch.Tensor]:
        """This rank's fp32 master chunks (1-D) by name."""
        return self.inner.master

    def chunk(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a full local tensor `t` of parameter `name`: a 1-D view."""
        a, b, _ = self._bounds[name]
        return t.reshape(-1)[a:b]

    def clip(self, grads: dict[str, torch.Tensor], max_norm: float,
             counted: set[str] | None = None, comm: Comm | None = None) -> GradStats:
        """Exact norm over this rank's chunks of the `counted` tensors (None: all), integer bins
        added over `comm` (the world); every gradient (whole tensors) scaled in place by the clip
        coefficient; non-finite values looked for in whole tensors (optimizer.grad_norm)."""
        parts = {n: self.chunk(n, g) for n, g in grads.items()}
        return self.inner.clip(grads, max_norm, counted, comm, parts)

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor], lr: float | None = None) -> None:
        """One AdamW update of this rank's chunks from the full local gradients."""
        self.inner.step({n: self.chunk(n, g) for n, g in grads.items()}, lr=lr)

    def _gather(self, chunks: dict[str, torch.Tensor], dtype: torch.dtype,
                op: str) -> dict[str, torch.Tensor]:
        """Full local tensors from every DP rank's chunk, as `dtype` values (one all-gather). The
        wire carries raw bytes (uint8): exact, and gloo gathers no 16-bit dtypes."""
        parts = []
        for n, c in chunks.items():
            per = self._bounds[n][2]
            buf = torch.zeros(per, dtype=dtype, device=c.device)
            buf[:c.numel()] = c.to(dtype)
            parts.append(buf.view(torch.uint8))
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
        every = self.dp.all_gather(flat, op)
        size = torch.empty((), dtype=dtype).element_size()
        out, i = {}, 0
        for n in chunks:
            per = self._bounds[n][2] * size
            whole = torch.cat([e[i:i + per] for e in every]).view(dtype)
            shape = self.shapes[n]
            out[n] = whole[:torch.Size(shape).numel()].reshape(shape)
            i += per
        return out

    def weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every parameter's full local tensor: the masters rounded to `dtype` (the parameter
        dtype), gathered over the group, held as fp32 (what Qwen3ForCausalLM.load_master_shards
        expects; rounding again is a no-op). Collective over the group."""
        return {n: t.to(torch.float32)
                for n, t in self._gather(self.master, dtype, "zero-weights").items()}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Masters and moments as full local fp32 tensors ("master/<name>", "exp_avg/<name>",
        "exp_avg_sq/<name>"), gathered over the group (checkpoints). Collective over it."""
        out = {}
        for kind, d in (("master", self.inner.master), ("exp_avg", self.inner.exp_avg),
                        ("exp_avg_sq", self.inner.exp_avg_sq)):
            for n, t in self._gather(d, torch.float32, f"zero-state:{kind}").items():
                out[f"{kind}/{n}"] = t
        return out

    @torch.no_grad()
    def load_state(self, masters, exp_avg, exp_avg_sq, steps: int) -> None:
        """Restore from full local tensors by name (any DP or CP size wrote them) and the step
        count."""
        self.inner.load_state({n: self.chunk(n, t) for n, t in masters.items()},
                              {n: self.chunk(n, t) for n, t in exp_avg.items()},
                              {n: self.chunk(n, t) for n, t in exp_avg_sq.items()}, steps)

    def optimizer_bytes(self) -> int:
        """Bytes of fp32 masters and moments this rank holds."""
        return 3 * 4 * sum(t.numel() for t in self.inner.master.values())


def build(params: dict[str, torch.Tensor], hp: AdamWParams, comms, topo,
          cfg) -> tuple[ZeroAdamW, set[str]]:
    """The run's optimizer for this rank and the parameters it counts in the gradient norm.

    params: the policy's local (TP-shard) tensors by name; comms/topo: this rank's
    distributed/topology Comms and Topology; cfg: the model's Qwen3Config. The state is split
    over `comms.dp_cp` (module doc); every rank of that group counts its own chunk of each
    tensor its TP rank counts (model/sharding.counts_for_norm: a tensor replicated over TP
    counts on its first holder), so each logical element enters the norm once over the world.
    Collective: none (the group exists already).
    """
    opt = ZeroAdamW(params, hp, comms.dp_cp)
    counted = {n for n in params if counts_for_norm(n, cfg, topo.tp, topo.tp_rank)}
    return opt, counted
