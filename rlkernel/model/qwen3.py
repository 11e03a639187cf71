"""Qwen3 dense causal LM built from an op set (invariant kernels or stock torch), TP/CP/SP-aware.

Reads like the architecture (Qwen3 technical report, arXiv 2505.09388; HF `modeling_qwen3.py`):
embedding → N × [RMSNorm → attention (q/k/v proj, per-head Q/K RMSNorm, RoPE, GQA, o_proj) +
residual → RMSNorm → SwiGLU MLP + residual] → final RMSNorm → LM head (tied or not).
Parameter names equal the Hugging Face names; each rank holds its TP shard (model/sharding.py),
and every layer receives the ParallelCtx as an argument — TP1 and TP8 run the same code.
Parameters are fp32 tensors holding exactly the run's parameter dtype values (bf16 by default):
trainer and rollout compute on identical values, and weight gradients are fp32. A model may
hold its 2-D weights in the compute dtype instead (`hold_matmul_weights`: the same values; the
rollout engine, the reference policy and the invariant trainer's policy do, the latter keeping
fp32 gradients in `.main_grad`). A bf16 model
rounds each linear's input activation and incoming gradient to bf16 (`compute_dtype_for`,
kernels/matmul.py) and attention's q, k, v (kernels/attention.py, Precision): the rounding points
are part of the model, so rollout and trainer share them.
Shapes: L = global stream rows, Lc = this CP rank's rows, Ls = its SP slice (Lc without SP),
S = samples, T = slots per sample, H = hidden, D = head_dim; head counts are local to the rank.
Does not: sample, own an optimizer, or move weights between engines.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlkernel.distributed.comm import Comm
from rlkernel.distributed.parallel import ParallelCtx
from rlkernel.kernels.matmul import rounding_point
from rlkernel.kernels.rope import RopeTable
from rlkernel.model.config import VIRTUAL_TP, Qwen3Config, param_shapes
from rlkernel.model.layout import StreamLayout, slots_are_views, to_samples, to_stream
from rlkernel.model.sharding import (dx_shard_rows, kv_replicas, local_tensor, logical_tensor,
                                     shard_of)
from rlkernel.spec import ATTN_KV_BLOCK
from rlkernel.weights.hashing import same_bytes


class KVCache:
    """Per-layer K/V of every sample at absolute positions: [S, Hkv_local, capacity, D] fp32.

    With a CP group (`comm`, rollout CP) the cache is token-sharded: the rank r stores the
    positions of KV blocks b with b % P == r (zeros elsewhere), and `read` reassembles the prefix
    by an exact owner pick — attention then visits the same keys in the same blocks.
    """

    def __init__(self, cfg: Qwen3Config, n_samples: int, capacity: int,
                 device: torch.device | str = "cpu", kv_heads: int | None = None,
                 comm: Comm | None = None) -> None:
        shape = (n_samples, kv_heads or cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device) for _ in range(cfg.num_hidden_layers)]
        self.capacity = capacity
        self.comm = comm or Comm.single("kv-cache")

    def _owner(self, pos: torch.Tensor) -> torch.Tensor:
        return torch.div(pos, ATTN_KV_BLOCK, rounding_mode="floor") % self.comm.size

    def write(self, layer: int, s_idx, pos, k, v) -> None:
        """Store k/v rows [n, Hkv, D] of (sample s_idx[i], position pos[i]) this rank owns."""
        mine = self._owner(pos) == self.comm.rank
        s_idx, pos = s_idx[mine], pos[mine]
        # Stored fp32: bf16 k/v (bf16 runs) widen exactly.
        self.k[layer][s_idx, :, pos] = k[mine].detach().to(torch.float32)
        self.v[layer][s_idx, :, pos] = v[mine].detach().to(torch.float32)

    def attend(self, layer: int, ops, qs, ks, vs, lay: StreamLayout, scale: float, pc,
               dtype: torch.dtype = torch.float32):
        """Store this pass's keys/values ks, vs [S, Hkv, T, D] (slot t of sample s at position
        lay.q_pos[s, t]), then `ops.attention` of qs [S, Hq, T, D] over every sample's keys of
        positions [0, max kv_len) in the compute `dtype`. The interface the paged cache
        (rollout/kv_cache.py) shares."""
        valid = lay.q_pos >= 0
        s_idx, t_idx = valid.nonzero(as_tuple=True)
        pos = lay.q_pos[s_idx, t_idx]
        self.write(layer, s_idx, pos, ks[s_idx, :, t_idx], vs[s_idx, :, t_idx])
        k, v = self.read(layer, int(lay.kv_len.max().item()))
        # Stored fp32; the values are the attention dtype's (bf16 runs: exact narrowing).
        return ops.attention(qs, k.to(qs.dtype), v.to(qs.dtype), lay.q_pos, lay.kv_len, scale,
                             pc, dtype)

    def read(self, layer: int, tk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of positions [0, tk) of every sample: [S, Hkv, tk, D] each."""
        k, v = self.k[layer][:, :, :tk], self.v[layer][:, :, :tk]
        if self.comm.size == 1:
            return k, v
        owner = self._owner(torch.arange(tk, device=k.device))[None, None, :, None].expand_as(k)
        return (self.comm.select_owner(k.contiguous(), owner.contiguous(), "kv-cache-k"),
                self.comm.select_owner(v.contiguous(), owner.contiguous(), "kv-cache-v"))


def compute_dtype_for(param_dtype: torch.dtype) -> torch.dtype:
    """The linears' operand dtype for a parameter dtype: bf16 runs compute bf16×bf16 products
    with fp32 accumulation (kernels/matmul.py rounding points); any other runs in fp32."""
    return torch.bfloat16 if param_dtype == torch.bfloat16 else torch.float32


class _Weight(nn.Module):
    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape))


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, ops, pc: ParallelCtx, layer: int,
                 cd: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg, self.ops, self.pc, self.layer, self.cd = cfg, ops, pc, layer, cd
        tp = pc.tp.size
        self.heads = cfg.num_attention_heads // tp
        self.kv_heads = max(1, cfg.num_key_value_heads // tp)
        self.kv_rep = kv_replicas(cfg, tp)
        d = cfg.head_dim
        self.q_proj = _Weight(self.heads * d, cfg.hidden_size)
        self.k_proj = _Weight(self.kv_heads * d, cfg.hidden_size)
        self.v_proj = _Weight(self.kv_heads * d, cfg.hidden_size)
        self.o_proj = _Weight(cfg.hidden_size, self.heads * d)
        self.q_norm = _Weight(d)
        self.k_norm = _Weight(d)
        # Rows of each virtual shard in the dX tree (k/v: kv_heads·D rows need not split in 8
        # equal parts, and a replicated KV head is owned in disjoint parts by its ranks).
        self.dx_rows = tuple(dx_shard_rows(f"self_attn.{n}.weight", cfg, tp, pc.tp.rank)
                             for n in ("q_proj", "k_proj", "v_proj"))

    def forward(self, x: torch.Tensor, lay: StreamLayout, cos, sin, cache):
        c, ops, pc = self.cfg, self.ops, self.pc
        shards = VIRTUAL_TP // pc.tp.size
        q, k, v = ops.col(x, [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight],
                          self.dx_rows, shards, pc, self.cd)              # [Lc, heads·D]
        n = q.shape[0]
        # bf16 runs: q and k leave RoPE rounded to bf16 (attention's rounding point, below).
        q = ops.norm_rope(q.view(n, self.heads, c.head_dim), self.q_norm.weight,
                          c.rms_norm_eps, cos, sin, pc.tok, pc.tp, 1, self.cd)
        k = ops.norm_rope(k.view(n, self.kv_heads, c.head_dim), self.k_norm.weight,
                          c.rms_norm_eps, cos, sin, pc.tok, pc.tp, self.kv_rep, self.cd)
        v = v.view(n, self.kv_heads, c.head_dim)
        if lay.kv_idx is not None:                # CP-split pass: K/V of the logical stream
            k, v = ops.cp_gather(k, pc), ops.cp_gather(v, pc)           # [L, kv_heads, D]
        k_all, v_all = k, v
        scale = 1.0 / math.sqrt(c.head_dim)
        rows = lay.packed_rows() if cache is None and ops.packed_attention else None
        if rows is not None and not slots_are_views(lay, n, k_all.shape[0]):
            # Each sample's rows read and written in place. Invariant arm
            # (kernels/attention.attention_packed): the bytes of the per-sample path below
            # without its gathers and scatters. Native arm: flash varlen attention where it
            # runs (CUDA, no CP), else exactly the per-sample path below.
            o = ops.attention_packed(*(rounding_point(t, self.cd) for t in (q, k_all, v_all)),
                                     rows, lay.q_pos, lay.kv_len, scale, pc,
                                     lay.attention_bounds(), lay=lay, dtype=self.cd)
            return ops.row(o.reshape(n, self.heads * c.head_dim), self.o_proj.weight, shards,
                           pc, self.cd)
        qs = to_samples(q, lay.q_idx, lay).transpose(1, 2)               # [S, heads, T, D]
        ks = to_samples(k_all, lay.keys_idx, lay).transpose(1, 2)       # [S, kv_heads, T, D]
        vs = to_samples(v_all, lay.keys_idx, lay).transpose(1, 2)
        # bf16 runs: q, k, v rounded to bf16 here (the attention kernels' tensor-core operands;
        # the KV cache stores these bf16 values; q and k arrive rounded by RoPE, so only v is
        # cast here); the backward of a cast widens the gradient.
        qs, ks, vs = (rounding_point(t, self.cd) for t in (qs, ks, vs))
        if cache is not None and lay.kv_idx is None:
            # The cache stores this pass's keys and attends over every key of each row (a
            # paged cache may read them through its block table instead of a dense copy).
            o = cache.attend(self.layer, ops, qs, ks, vs, lay, scale, pc, self.cd)
        else:
            if cache is not None:
                ks, vs = self._write_cache(cache, ks, vs, lay)
            o = ops.attention(qs, ks, vs, lay.q_pos, lay.kv_len, scale, pc, self.cd,
                              lay.dense_causal and cache is None, lay.attention_bounds())
        # bf16 runs: o stays bf16 into o_proj (its rounding point of x is then the identity, and
        # its backward rounds dX to bf16: dO's rounding point).
        o = to_stream(o.transpose(1, 2), lay.q_idx, n, lay).reshape(n, self.heads * c.head_dim)
        return ops.row(o, self.o_proj.weight, shards, pc, self.cd)

    def _write_cache(self, cache: KVCache, ks, vs, lay: StreamLayout):
        # CP prefill: every key of the prompt arrived by the CP gather; store the owned blocks
        # and attend to the gathered keys directly.
        valid = lay.kv_idx >= 0
        s_idx, j = valid.nonzero(as_tuple=True)
        cache.write(self.layer, s_idx, j, ks[s_idx, :, j], vs[s_idx, :, j])
        return ks, vs


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config, ops, pc: ParallelCtx,
                 cd: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.ops, self.pc, self.cd = ops, pc, cd
        inter = cfg.intermediate_size // pc.tp.size
        self.gate_proj = _Weight(inter, cfg.hidden_size)
        self.up_proj = _Weight(inter, cfg.hidden_size)
        self.down_proj = _Weight(cfg.hidden_size, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.mlp(x, self.gate_proj.weight, self.up_proj.weight,
                            self.down_proj.weight, VIRTUAL_TP // self.pc.tp.size, self.pc,
                            self.cd)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, ops, pc: ParallelCtx, layer: int,
                 cd: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.ops, self.pc, self.eps = ops, pc, cfg.rms_norm_eps
        self.input_layernorm = _Weight(cfg.hidden_size)
        self.self_attn = Attention(cfg, ops, pc, layer, cd)
        self.post_attention_layernorm = _Weight(cfg.hidden_size)
        self.mlp = MLP(cfg, ops, pc, cd)

    def forward(self, x, lay, cos, sin, cache):
        norm, tree = self.ops.norm, self.pc.tok_sp
        # An inference pass may return the normed rows already rounded to the compute dtype
        # (the QKV and gate/up linears' rounding point; autograd passes round in the linears).
        # Under SP the rows go through the SP all-gather first, which moves fp32.
        cd = torch.float32 if self.pc.sp else self.self_attn.cd
        x = x + self.self_attn(norm(x, self.input_layernorm.weight, self.eps, tree,
                                    out_dtype=cd), lay, cos, sin, cache)
        return x + self.mlp(norm(x, self.post_attention_layernorm.weight, self.eps, tree,
                                 out_dtype=cd))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config, ops, pc: ParallelCtx,
                 cd: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed_tokens = _Weight(cfg.vocab_size // pc.tp.size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, pc, i, cd)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = _Weight(cfg.hidden_size)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 causal LM. `hidden` runs the decoder on a StreamLayout; `token_logprobs` the head."""

    def __init__(self, cfg: Qwen3Config, ops, param_dtype: torch.dtype = torch.bfloat16,
                 pc: ParallelCtx | None = None, live_vocab: int | None = None) -> None:
        """live_vocab: ids the tokenizer has (None: all cfg.vocab_size); the log-softmax gives the
        padded rows past it probability 0 (kernels/logprobs.py). ValueError outside [1, vocab]."""
        super().__init__()
        self.pc = pc or ParallelCtx.single()
        self.cfg, self.ops, self.param_dtype = cfg, ops, param_dtype
        if live_vocab is not None and not (isinstance(live_vocab, int)
                                           and 1 <= live_vocab <= cfg.vocab_size):
            raise ValueError(f"live_vocab {live_vocab!r}: must be an integer in [1, "
                             f"{cfg.vocab_size}] (the model's vocab_size)")
        self.live_vocab = None if live_vocab == cfg.vocab_size else live_vocab
        self.compute_dtype = compute_dtype_for(param_dtype)
        self.model = Qwen3Model(cfg, ops, self.pc, self.compute_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _Weight(cfg.vocab_size // self.pc.tp.size, cfg.hidden_size)
        self.rope = RopeTable(cfg.head_dim, cfg.rope_theta)
        self.recompute = False
        """Activation checkpointing of each decoder layer (training passes only)."""

    # -- weights -----------------------------------------------------------------------------
    def logical_params(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by Hugging Face name, in canonical order (config.param_shapes)."""
        named = dict(self.named_parameters())
        return {name: named[name] for name in param_shapes(self.cfg)}

    @torch.no_grad()
    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy in logical (unsharded) tensors: this rank keeps its shard, rounded to param_dtype
        and held in the parameter's storage dtype (`local_param`). Names and logical shapes must
        match (ValueError otherwise)."""
        params = self.logical_params()
        shapes = param_shapes(self.cfg)
        if set(tensors) != set(params):
            missing = sorted(set(params) - set(tensors))
            extra = sorted(set(tensors) - set(params))
            raise ValueError(f"load_tensors: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, p in params.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(shapes[name]):
                raise ValueError(f"load_tensors: {name} has shape {tuple(t.shape)}, "
                                 f"expected {tuple(shapes[name])}")
            p.copy_(self.local_param(name, t))

    def local_param(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The value `load_tensors` gives this rank's parameter `name` from logical tensor `t`:
        its TP shard, rounded to param_dtype, in the parameter's storage dtype (fp32, or the
        compute dtype for weights `hold_matmul_weights` moved; on t's device). The weight audit
        compares the parameter with it byte for byte, so load and audit share this definition."""
        shard = local_tensor(name, t, self.cfg, self.pc.tp.size, self.pc.tp.rank)
        return shard.to(self.param_dtype).to(self.get_parameter(name).dtype)

    @torch.no_grad()
    def hold_matmul_weights(self) -> None:
        """Store the 2-D weights (linears, embedding, LM head) in the compute dtype (bf16 runs)
        instead of fp32: the model then feeds each product the weight itself rather than
        rounding an fp32 copy at every call (7 launches per layer and ~2.6 GB of traffic per
        decode step at 0.6B; two casts per weight per training step), in half the memory. The
        values are unchanged — param_dtype bf16 already holds bf16 values — so every product's
        bytes are too. Norm weights stay fp32 (elementwise fp32 math). A no-op for fp32 runs.
        Used by the rollout engine, the reference policy and the invariant trainer's policy,
        whose fp32 weight gradients then live in `.main_grad` (InvariantOps.sync_grads: the
        sink's exact sums, which never pass through autograd). Not for stock-op training:
        torch autograd would accumulate bf16 gradients into bf16-held weights."""
        if self.compute_dtype == torch.float32:
            return
        for p in self.logical_params().values():
            if p.dim() == 2:
                p.data = p.data.to(self.compute_dtype)

    @torch.no_grad()
    def load_master_shards(self, masters: dict[str, torch.Tensor]) -> None:
        """Set this rank's parameters from its fp32 master shards, rounded to param_dtype."""
        for name, p in self.logical_params().items():
            p.copy_(masters[name].to(self.param_dtype).to(torch.float32))

    @torch.no_grad()
    def export_tensors(self, as_held: bool = False,
                       on_device: bool = False) -> dict[str, torch.Tensor]:
        """Logical weights in param_dtype (copies this model does not share), reassembled from
        every TP rank's shard; a tensor replicated across TP ranks (norms, shared KV heads) from
        its first holder. On the CPU, or with `on_device` on the model's device (the weight sync:
        no round trip through host memory).

        With `as_held`, the weights exactly as this rank computes with them (the rollout audit):
        replicated tensors from this rank's own copy, and a tensor holding a value param_dtype
        cannot represent exported as held (fp32), never rounded into a weight it is not.
        Collective over TP.
        """
        tp, r = self.pc.tp.size, self.pc.tp.rank
        out = {}
        for n, p in self.logical_params().items():
            parts = self.pc.tp.all_gather(p.detach(), f"export:{n}")
            if as_held:
                kind = shard_of(n, self.cfg, tp, r).kind
                first = {"replicated": 0, "kv": r - r % kv_replicas(self.cfg, tp)}.get(kind, r)
                parts[first] = parts[r]  # logical_tensor reads each replica group's first copy
            held = logical_tensor(n, parts, self.cfg)
            t = held.to(self.param_dtype)
            # A flipped low bit of an fp32 parameter rounds back to the loaded bf16 weight, yet
            # the forward computes with it: only an exact conversion may stand for the tensor.
            if as_held and not same_bytes(t.to(held.dtype), held):
                t = held
            out[n] = t.clone() if on_device else t.cpu().clone()
        return out

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # -- forward -----------------------------------------------------------------------------
    def hidden(self, lay: StreamLayout, cache=None) -> torch.Tensor:
        """Final-normed hidden states of this rank's rows: [Ls, H] (SP slice under SP), fp32
        (native mode on CUDA: the compute dtype, its residual stream's).
        cache: a KVCache, or rollout/kv_cache.PagedKVCache (anything with `attend`)."""
        lay = lay.to(self.device)
        cos, sin = self.rope.lookup(lay.positions, lay.pos_bound)
        w = self.model.embed_tokens.weight
        x = self.ops.embed(lay.tokens, w, self.pc.tp.rank * w.shape[0], self.pc,
                           self.compute_dtype)
        for layer in self.model.layers:
            if self.recompute and cache is None and torch.is_grad_enabled():
                # Backward re-runs the layer with the same layout, kernels and collectives
                # (in the same order on every rank), so the recomputed bytes are the same.
                x = checkpoint(layer, x, lay, cos, sin, None, use_reentrant=False)
            else:
                x = layer(x, lay, cos, sin, cache)
        return self.ops.norm(x, self.model.norm.weight, self.cfg.rms_norm_eps, self.pc.tok_sp)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head over the full vocab: [Ls, H] -> [Lc, V] (vocab-parallel, gathered), fp32
        (native mode on CUDA: the compute dtype; its log-softmax widens to fp32)."""
        shards = VIRTUAL_TP // self.pc.tp.size
        (z,) = self.ops.col(h, [self.lm_head_weight()], None, shards, self.pc, self.compute_dtype)
        return self.ops.gather_vocab(z, self.pc)

    def token_logprobs(self, h: torch.Tensor, targets: torch.Tensor, temperature: float):
        """(logprobs [Lc], entropy [Lc]) of `targets` [Lc] under softmax(logits(h) / temperature)
        over the ids < live_vocab."""
        fused = getattr(self.ops, "linear_token_logprobs", None)
        if fused is not None:   # the same bytes without [L, V] logits, at any TP
            return fused(h, self.lm_head_weight(), targets, temperature, self.pc,
                         live_vocab=self.live_vocab, dtype=self.compute_dtype)
        return self.ops.token_logprobs_entropy(self.logits(h), targets, temperature,
                                               live_vocab=self.live_vocab)

    def next_token_logprobs(self, h: torch.Tensor, temperature: float) -> torch.Tensor:
        """Full canonical log-softmax of logits(h) / T: [N, V] fp32 (rollout sampling); ids >=
        live_vocab are −inf, so the sampler never draws them."""
        return self.ops.log_softmax(self.logits(h), temperature, live_vocab=self.live_vocab)
