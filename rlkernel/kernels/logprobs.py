"""Vocab-sharded log-softmax: token logprobs and entropy of logits / T, with backward (CPU).

z = logits / T in fp32 (the same division in rollout and trainer, DESIGN.md §3). The vocab is cut
into VIRTUAL_TP equal shards; per shard, in a fixed order: m = max z, s = Σ exp(z − m) and
t = Σ exp(z − m)·z (pairwise trees over the shard). Shards merge by the pairwise tree with
    m = max(m₁, m₂);  s = s₁·e^{m₁−m} + s₂·e^{m₂−m};  t likewise,
so a vocab-parallel TP group can merge rank subtrees with a tree all-reduce and get the same bits.
Then lse = m + log s, logprob(y) = z_y − lse, entropy = lse − t/s.
Backward (per token, elementwise; p = exp(z − lse)):
    dz = g_lp·(onehot(y) − p) − g_ent·p·(z − lse + H);   dlogits = dz / T
Does not: materialise less than [tokens, vocab] (the fused CUDA kernel does), communicate.
"""

from __future__ import annotations

import torch

from rlkernel.kernels.elementwise import exp32, log32
from rlkernel.spec import VIRTUAL_TP
from rlkernel.numerics.trees import tree_sum


def _shard_stats(z: torch.Tensor, shards: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, v = z.shape
    if v % shards:
        raise ValueError(f"log-softmax: vocab {v} is not a multiple of {shards} vocab shards")
    zs = z.reshape(n, shards, v // shards)
    m = zs.amax(-1)
    e = exp32(zs - m[..., None])
    return m, tree_sum(e, -1), tree_sum(e * zs, -1)


def _merge(a, b):
    (m1, s1, t1), (m2, s2, t2) = a, b
    m = torch.maximum(m1, m2)
    f1, f2 = exp32(m1 - m), exp32(m2 - m)
    return m, s1 * f1 + s2 * f2, t1 * f1 + t2 * f2


def merge_shard_stats(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor):
    """Pairwise-tree merge over the shard dim (last) of per-shard (max, sumexp, Σe·z) -> [N] each."""
    level = [(m[..., i], s[..., i], t[..., i]) for i in range(m.shape[-1])]
    while len(level) > 1:
        nxt = [_merge(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def _forward_stats(z: torch.Tensor, shards: int):
    m, s, t = merge_shard_stats(*_shard_stats(z, shards))
    lse = m + log32(s)
    ent = lse - t / s
    return lse, ent


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, shards: int):
        z = logits.to(torch.float32) / temperature
        lse, ent = _forward_stats(z, shards)
        lp = z.gather(1, targets[:, None])[:, 0] - lse
        ctx.save_for_backward(z, targets, lse, ent)
        ctx.temperature = temperature
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor, g_ent: torch.Tensor):
        z, targets, lse, ent = ctx.saved_tensors
        logp = z - lse[:, None]
        p = exp32(logp)
        dz = -(g_lp[:, None] * p)
        dz.scatter_add_(1, targets[:, None], g_lp[:, None])
        if g_ent is not None:
            dz = dz - g_ent[:, None] * (p * (logp + ent[:, None]))
        return dz / ctx.temperature, None, None, None


def token_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                           shards: int = VIRTUAL_TP) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of `targets` and entropy under softmax(logits / temperature).

    logits [N, V] fp32, targets [N] long, temperature > 0 -> (logprobs [N] fp32, entropy [N] fp32)
    in nats. Differentiable in `logits`.
    """
    return _TokenLogprobs.apply(logits, targets, float(temperature), shards)


def log_softmax(logits: torch.Tensor, temperature: float, shards: int = VIRTUAL_TP) -> torch.Tensor:
    """Canonical log-softmax of logits / T over the full vocab: [N, V] fp32 -> [N, V] fp32.

    Element y equals token_logprobs_entropy(...)[0] for target y, bitwise (same z and lse).
    """
    z = logits.to(torch.float32) / float(temperature)
    lse, _ = _forward_stats(z, shards)
    return z - lse[:, None]
