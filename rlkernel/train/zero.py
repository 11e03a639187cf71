"""ZeRO stage 1: AdamW's fp32 masters and moments sharded across the DP group.

Every DP replica holds the same gradients (the GradSink sums them over DP as exact integers,
distributed/tokensum.py), so optimizer state need not be replicated: DP rank r of D keeps, for
each parameter (its TP shard flattened), the elements [r·c, min((r+1)·c, n)) with c = ⌈n / D⌉ —
masters, exp_avg and exp_avg_sq — updates them with the ordinary elementwise AdamW
(train/optimizer.py; the chunks are contiguous 1-D, so on CUDA they take its fused kernel), and
the updated weights, rounded to the parameter dtype (bf16 by default), are all-gathered so every
replica computes with the whole tensor. Optimizer memory per rank is
3 · 4 bytes · n / D per parameter (Rajbhandari et al., "ZeRO", arXiv 1910.02054, stage 1).

Why the bits cannot depend on D: AdamW is elementwise (an element's update reads only its own
gradient, master and moments, and the step count), clipping multiplies every element by one fp32
coefficient, and that coefficient comes from the exact gradient norm, whose integer bins are
added across ranks (numerics/exact.py) — each logical element is counted once, in whichever
chunk holds it. Checkpoints hold logical tensors (gathered here over DP, in the loop over TP), so
a run resumes at any DP size bit for bit.
Does not: reduce gradients (the sink did), or shard gradients or parameters (stages 2/3).
Tests: `.venv/bin/python -m pytest -q tests/test_dp.py`.
"""

from __future__ import annotations

import torch

from rlkernel.distributed.comm import Comm
from rlkernel.train.optimizer import AdamW, AdamWParams, GradStats



class ZeroAdamW:
    """AdamW over this DP rank's chunks of named parameters (module doc).

    params: this rank's local (TP-shard) fp32 tensors by name, the initial masters. dp: the DP
    group (Comm.single for DP 1: the chunk is the whole tensor).
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
        dtype), gathered over DP, held as fp32 (what Qwen3ForCausalLM.load_master_shards
        expects; rounding again is a no-op). Collective over DP."""
        return {n: t.to(torch.float32)
                for n, t in self._gather(self.master, dtype, "zero-weights").items()}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Masters and moments as full local fp32 tensors ("master/<name>", "exp_avg/<name>",
        "exp_avg_sq/<name>"), gathered over DP (checkpoints). Collective over DP."""
        out = {}
        for kind, d in (("master", self.inner.master), ("exp_avg", self.inner.exp_avg),
                        ("exp_avg_sq", self.inner.exp_avg_sq)):
            for n, t in self._gather(d, torch.float32, f"zero-state:{kind}").items():
                out[f"{kind}/{n}"] = t
        return out

    @torch.no_grad()
    def load_state(self, masters, exp_avg, exp_avg_sq, steps: int) -> None:
        """Restore from full local tensors by name (any DP size wrote them) and the step count."""
        self.inner.load_state({n: self.chunk(n, t) for n, t in masters.items()},
                              {n: self.chunk(n, t) for n, t in exp_avg.items()},
                              {n: self.chunk(n, t) for n, t in exp_avg_sq.items()}, steps)

    def optimizer_bytes(self) -> int:
        """Bytes of fp32 masters and moments this rank holds."""
        return 3 * 4 * sum(t.numel() for t in self.inner.master.values())
