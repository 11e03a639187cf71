"""The two op sets the model is built from: invariant kernels, or stock torch (`--mode native`).

Both take and return fp32 tensors in the same layouts, so the model code is identical and the cost
of invariance is measured side by side (DESIGN.md §2). Native ops are what a user would otherwise
run: BLAS matmul, torch RMSNorm arithmetic, F.silu, SDPA, torch.log_softmax, autograd backward.
Does not: choose a device backend (CUDA kernels plug in behind InvariantOps later).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlkernel.kernels import activation, attention, embedding, logprobs, matmul, norm


class InvariantOps:
    """Invariant CPU kernels (rlkernel/kernels): every element a fixed op sequence."""

    name = "invariant"
    embed = staticmethod(embedding.embed)
    rms_norm = staticmethod(norm.rms_norm)
    col_linear = staticmethod(matmul.column_parallel_linear)
    row_linear = staticmethod(matmul.row_parallel_linear)
    swiglu = staticmethod(activation.swiglu)
    token_logprobs_entropy = staticmethod(logprobs.token_logprobs_entropy)
    log_softmax = staticmethod(logprobs.log_softmax)

    @staticmethod
    def attention(q, k, v, q_pos, kv_len, scale, q_idx=None, stream_len=None):
        return attention.attention(q, k, v, q_pos, kv_len, scale, q_idx, stream_len)


class NativeOps:
    """Stock torch ops with autograd: the baseline users would otherwise run."""

    name = "native"

    @staticmethod
    def embed(ids, w):
        return F.embedding(ids, w).to(torch.float32)

    @staticmethod
    def rms_norm(x, w, eps):
        var = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(var + eps))

    @staticmethod
    def col_linear(x, w):
        return F.linear(x, w)

    row_linear = col_linear

    @staticmethod
    def swiglu(g, u):
        return F.silu(g) * u

    @staticmethod
    def attention(q, k, v, q_pos, kv_len, scale, q_idx=None, stream_len=None):
        g = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
        j = torch.arange(k.shape[2])
        vis = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_len[:, None, None])
        row = vis.any(-1)
        vis = vis | ~row[:, :, None]          # keep SDPA finite on empty slots; zeroed below
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=vis[:, None], scale=scale)
        return out * row[:, None, :, None]

    @staticmethod
    def token_logprobs_entropy(logits, targets, temperature):
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        lp = logp.gather(1, targets[:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)
        return lp, ent

    @staticmethod
    def log_softmax(logits, temperature):
        return torch.log_softmax(logits.float() / temperature, dim=-1)


def ops_for(mode: str):
    """Op set for `--mode` ('invariant' | 'native'); ValueError otherwise."""
    if mode == "invariant":
        return InvariantOps
    if mode == "native":
        return NativeOps
    raise ValueError(f"--mode {mode!r} is not known; allowed: invariant, native")
