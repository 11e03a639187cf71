"""Qwen3 dense causal LM built from an op set (invariant kernels or stock torch).

Reads like the architecture (Qwen3 technical report, arXiv 2505.09388; HF `modeling_qwen3.py`):
embedding → N × [RMSNorm → attention (q/k/v proj, per-head Q/K RMSNorm, RoPE, GQA, o_proj) +
residual → RMSNorm → SwiGLU MLP + residual] → final RMSNorm → LM head (tied or not).
Parameter names equal the Hugging Face names, so load/export/hash walk one table.
Parameters are fp32 tensors that hold exactly the run's parameter dtype values (bf16 by default):
the trainer and the rollout engine compute on identical values, and weight gradients are fp32.
Shapes: L = stream rows, S = samples, T = slots per sample, H = hidden, D = head_dim.
Does not: shard (rlkernel/dist applies TP/CP from outside), sample, or own an optimizer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rlkernel.kernels.rope import RopeTable, apply_rope
from rlkernel.model.config import Qwen3Config, param_shapes
from rlkernel.model.layout import StreamLayout, to_samples, to_stream


class KVCache:
    """Per-layer K/V of every sample at absolute positions: [S, Hkv, capacity, D] fp32, zeroed."""

    def __init__(self, cfg: Qwen3Config, n_samples: int, capacity: int,
                 device: torch.device | str = "cpu", kv_heads: int | None = None) -> None:
        shape = (n_samples, kv_heads or cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device) for _ in range(cfg.num_hidden_layers)]
        self.capacity = capacity


class _Weight(nn.Module):
    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape))


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, ops, layer: int) -> None:
        super().__init__()
        self.cfg, self.ops, self.layer = cfg, ops, layer
        self.q_proj = _Weight(cfg.q_size, cfg.hidden_size)
        self.k_proj = _Weight(cfg.kv_size, cfg.hidden_size)
        self.v_proj = _Weight(cfg.kv_size, cfg.hidden_size)
        self.o_proj = _Weight(cfg.hidden_size, cfg.q_size)
        self.q_norm = _Weight(cfg.head_dim)
        self.k_norm = _Weight(cfg.head_dim)

    def forward(self, x: torch.Tensor, lay: StreamLayout, cos, sin, cache: KVCache | None):
        c, ops = self.cfg, self.ops
        n = x.shape[0]
        q = ops.col_linear(x, self.q_proj.weight).view(n, c.num_attention_heads, c.head_dim)
        k = ops.col_linear(x, self.k_proj.weight).view(n, c.num_key_value_heads, c.head_dim)
        v = ops.col_linear(x, self.v_proj.weight).view(n, c.num_key_value_heads, c.head_dim)
        q = apply_rope(ops.rms_norm(q, self.q_norm.weight, c.rms_norm_eps), cos, sin)
        k = apply_rope(ops.rms_norm(k, self.k_norm.weight, c.rms_norm_eps), cos, sin)
        qs = to_samples(q, lay.q_idx).transpose(1, 2)            # [S, Hq, T, D]
        ks = to_samples(k, lay.q_idx).transpose(1, 2)            # [S, Hkv, T, D]
        vs = to_samples(v, lay.q_idx).transpose(1, 2)
        if cache is not None:
            ks, vs = self._write_cache(cache, ks, vs, lay)
        scale = 1.0 / math.sqrt(c.head_dim)
        o = ops.attention(qs, ks, vs, lay.q_pos, lay.kv_len, scale, lay.q_idx, lay.stream_len)
        o = to_stream(o.transpose(1, 2), lay.q_idx, n).reshape(n, c.q_size)
        return ops.row_linear(o, self.o_proj.weight)

    def _write_cache(self, cache: KVCache, ks, vs, lay: StreamLayout):
        kc, vc = cache.k[self.layer], cache.v[self.layer]
        valid = lay.q_pos >= 0
        s_idx, t_idx = valid.nonzero(as_tuple=True)
        pos = lay.q_pos[s_idx, t_idx]
        kc[s_idx, :, pos] = ks[s_idx, :, t_idx].detach()
        vc[s_idx, :, pos] = vs[s_idx, :, t_idx].detach()
        tk = int(lay.kv_len.max().item())
        return kc[:, :, :tk], vc[:, :, :tk]


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config, ops) -> None:
        super().__init__()
        self.ops = ops
        self.gate_proj = _Weight(cfg.intermediate_size, cfg.hidden_size)
        self.up_proj = _Weight(cfg.intermediate_size, cfg.hidden_size)
        self.down_proj = _Weight(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        h = ops.swiglu(ops.col_linear(x, self.gate_proj.weight), ops.col_linear(x, self.up_proj.weight))
        return ops.row_linear(h, self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, ops, layer: int) -> None:
        super().__init__()
        self.ops, self.eps = ops, cfg.rms_norm_eps
        self.input_layernorm = _Weight(cfg.hidden_size)
        self.self_attn = Attention(cfg, ops, layer)
        self.post_attention_layernorm = _Weight(cfg.hidden_size)
        self.mlp = MLP(cfg, ops)

    def forward(self, x, lay, cos, sin, cache):
        x = x + self.self_attn(self.ops.rms_norm(x, self.input_layernorm.weight, self.eps),
                               lay, cos, sin, cache)
        return x + self.mlp(self.ops.rms_norm(x, self.post_attention_layernorm.weight, self.eps))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config, ops) -> None:
        super().__init__()
        self.embed_tokens = _Weight(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, i) for i in range(cfg.num_hidden_layers))
        self.norm = _Weight(cfg.hidden_size)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 causal LM. `hidden` runs the decoder on a StreamLayout; `token_logprobs` the head."""

    def __init__(self, cfg: Qwen3Config, ops, param_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.cfg, self.ops, self.param_dtype = cfg, ops, param_dtype
        self.model = Qwen3Model(cfg, ops)
        if not cfg.tie_word_embeddings:
            self.lm_head = _Weight(cfg.vocab_size, cfg.hidden_size)
        self.rope = RopeTable(cfg.head_dim, cfg.rope_theta)

    # -- weights -----------------------------------------------------------------------------
    def logical_params(self) -> dict[str, nn.Parameter]:
        """Parameters by Hugging Face name, in canonical order (config.param_shapes)."""
        named = dict(self.named_parameters())
        return {name: named[name] for name in param_shapes(self.cfg)}

    @torch.no_grad()
    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy logical tensors in (rounded to param_dtype, held as fp32). Names/shapes must match."""
        params = self.logical_params()
        if set(tensors) != set(params):
            missing = sorted(set(params) - set(tensors))
            extra = sorted(set(tensors) - set(params))
            raise ValueError(f"load_tensors: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, p in params.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"load_tensors: {name} has shape {tuple(t.shape)}, "
                                 f"expected {tuple(p.shape)}")
            p.copy_(t.to(self.param_dtype).to(torch.float32))

    @torch.no_grad()
    def export_tensors(self) -> dict[str, torch.Tensor]:
        """Logical weights in param_dtype on the CPU (exact: parameters hold param_dtype values)."""
        return {n: p.detach().to(self.param_dtype).cpu().clone()
                for n, p in self.logical_params().items()}

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    # -- forward -----------------------------------------------------------------------------
    def hidden(self, lay: StreamLayout, cache: KVCache | None = None) -> torch.Tensor:
        """Final-normed hidden states of every stream row: [L, H] fp32."""
        lay = lay.to(self.device)
        cos, sin = self.rope.lookup(lay.positions)
        x = self.ops.embed(lay.tokens, self.model.embed_tokens.weight)
        for layer in self.model.layers:
            x = layer(x, lay, cos, sin, cache)
        return self.ops.rms_norm(x, self.model.norm.weight, self.cfg.rms_norm_eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head: [N, H] -> [N, V] fp32 (vocab-parallel column linear)."""
        return self.ops.col_linear(h, self.lm_head_weight())

    def token_logprobs(self, h: torch.Tensor, targets: torch.Tensor, temperature: float):
        """(logprobs [N], entropy [N]) of `targets` [N] under softmax(logits(h) / temperature)."""
        return self.ops.token_logprobs_entropy(self.logits(h), targets, temperature)

    def next_token_logprobs(self, h: torch.Tensor, temperature: float) -> torch.Tensor:
        """Full canonical log-softmax of logits(h) / T: [N, V] fp32 (rollout sampling)."""
        return self.ops.log_softmax(self.logits(h), temperature)
