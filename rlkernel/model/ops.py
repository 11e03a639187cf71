"""The two op sets the model is built from: invariant kernels + canonical-tree collectives, or
stock torch + stock collectives (`--mode native`).

Both take the same arguments (including the ParallelCtx) and return fp32 tensors in the same
layouts, so the model code is identical and the cost of invariance is measured side by side
(DESIGN.md §2). Native is what a user would otherwise run: BLAS matmul, torch RMSNorm
arithmetic, F.silu, SDPA, torch.log_softmax, autograd backward, and SUM all-reduces whose order
belongs to the backend; its token-partial gradients are summed after backward (`sync_grads`),
over CP, then DP (and TP where TP ranks hold different tokens or heads), per microbatch as
autograd accumulates them — what DP training normally does.
Does not: choose a device backend (CUDA kernels plug in behind the kernel functions).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlkernel.distributed import parallel as par
from rlkernel.distributed.comm import Comm
from rlkernel.distributed.parallel import ParallelCtx
from rlkernel.distributed.parallel import collective_pair as pair
from rlkernel.kernels import (activation, attention, embedding, logprobs, matmul, mlp, norm,
                              paged_attention)
from rlkernel.kernels.rope import apply_rope, rope
from rlkernel.model import varlen
from rlkernel.model.layout import StreamLayout, to_samples, to_stream
from rlkernel.spec import VIRTUAL_TP


class InvariantOps:
    """Invariant kernels (rlkernel/kernels) and tree collectives (rlkernel/distributed)."""

    name = "invariant"
    packed_attention = True
    """`attention_packed` reads the token streams in place (no per-sample gathers)."""
    swiglu = staticmethod(activation.swiglu)
    token_logprobs_entropy = staticmethod(logprobs.token_logprobs_entropy)
    log_softmax = staticmethod(logprobs.log_softmax)
    gather_vocab = staticmethod(par.gather_vocab)
    cp_gather = staticmethod(par.cp_gather_stream)
    sp_scatter = staticmethod(par.sp_scatter)

    @staticmethod
    def linear_token_logprobs(h, w, targets, temperature, pc: ParallelCtx, live_vocab=None,
                              dtype=torch.float32):
        """Fused vocab-parallel LM head + logprobs at any TP: the unfused path's bytes, without
        [L, V] logits kept or gathered (h: this rank's rows, the SP slice under SP; w: its
        vocab slice)."""
        return logprobs.linear_token_logprobs_entropy(
            par.enter_tp(h, pc), w, targets, temperature, shards=VIRTUAL_TP // pc.tp.size,
            tok=pc.tok, live_vocab=live_vocab, compute_dtype=dtype, vocab_comm=pc.tp)

    @staticmethod
    def embed(ids, w, offset, pc: ParallelCtx, dtype=torch.float32):
        """Rows [L, H] fp32 (every compute dtype: the residual stream is fp32)."""
        x = embedding.embed(ids, w, offset=offset, tok=pc.tok)
        if pc.tp.size > 1:
            x = par.select_vocab_owner(x, torch.div(ids, w.shape[0], rounding_mode="floor"), pc)
        return par.sp_scatter(x, pc)

    @staticmethod
    def norm(x, w, eps, tok, head_comm=None, replicas=1, out_dtype=torch.float32):
        """RMSNorm [..., H] fp32. out_dtype: what an inference pass may return (bf16: the next
        linear's rounding point, taken in the same kernel); autograd passes return fp32."""
        if not needs_grad(x, w):      # rollout steps: one pass (the same bytes)
            return norm.rms_norm_inference(x, w, eps, out_dtype=out_dtype)
        return norm.rms_norm(x, w, eps, tok=tok, head_comm=head_comm, replicas=replicas)

    @staticmethod
    def norm_rope(x, w, eps, cos, sin, tok, head_comm=None, replicas=1, out_dtype=torch.float32):
        """Per-head RMSNorm, then RoPE (Qwen3's Q/K path): x [L, heads, D] -> same, fp32 values
        returned in out_dtype (bf16: attention's rounding point of q and k, taken by the RoPE
        pass itself; its backward widens the gradient exactly)."""
        if not needs_grad(x, w):
            return norm.rms_norm_inference(x, w, eps, cos, sin, out_dtype)
        return rope(norm.rms_norm(x, w, eps, tok=tok, head_comm=head_comm, replicas=replicas),
                    cos, sin, out_dtype)

    @staticmethod
    def col(x, ws, shard_rows, local_shards, pc: ParallelCtx, dtype=torch.float32):
        return matmul.column_parallel_linear(par.enter_tp(x, pc), ws, shard_rows=shard_rows,
                                             local_shards=local_shards, tok=pc.tok,
                                             compute_dtype=dtype)

    @staticmethod
    def row(x, w, local_shards, pc: ParallelCtx, dtype=torch.float32):
        return par.exit_row(matmul.row_parallel_linear(x, w, local_shards=local_shards,
                                                       tok=pc.tok, compute_dtype=dtype), pc)

    @staticmethod
    def mlp(x, w_gate, w_up, w_down, local_shards, pc: ParallelCtx, dtype=torch.float32):
        """down(swiglu(gate(x), up(x))): `col`, `swiglu` and `row`'s bytes in one autograd node
        (kernels/mlp.py: the bf16 rounding points of the activation and of its gradients taken
        by the SwiGLU kernels' stores)."""
        return par.exit_row(mlp.swiglu_mlp(par.enter_tp(x, pc), w_gate, w_up, w_down,
                                           local_shards=local_shards, tok=pc.tok,
                                           compute_dtype=dtype), pc)

    @staticmethod
    def attention(q, k, v, q_pos, kv_len, scale, pc: ParallelCtx, dtype=torch.float32,
                  dense_causal=False, bounds=None):
        """Invariant attention on fp32 q/k/v (the compute dtype has no rounding point here);
        bounds: StreamLayout.attention_bounds of q_pos/kv_len (spares the backward a sync)."""
        return attention.attention(q, k, v, q_pos, kv_len, scale, tok=pc.tok, kv_comm=pc.kv,
                                   bounds=bounds)

    @staticmethod
    def attention_packed(q, k, v, rows, q_pos, kv_len, scale, pc: ParallelCtx, bounds=None, *,
                         lay=None, dtype=torch.float32):
        """Invariant attention reading the token streams in place: q [Lq, Hq, D], k/v
        [Lk, Hkv, D], rows = StreamLayout.packed_rows(); returns the output stream [Lq, Hq, D]
        (kernels/attention.attention_packed: `attention`'s bytes without the per-sample copies).
        lay, dtype: the native arm's (unused: the kernels read rows, and the compute dtype has
        no rounding point here)."""
        q_rows, k_rows, tk = rows
        return attention.attention_packed(q, k, v, q_rows, k_rows, q_pos, kv_len, tk, scale,
                                          tok=pc.tok, kv_comm=pc.kv, bounds=bounds)

    @staticmethod
    def begin_grads(model, direct: bool = False, late: bool = False) -> None:
        """Zero the gradients and open the policy's GradSink: until `sync_grads`, every weight
        gradient of every backward is added exactly into it (distributed/tokensum.py).
        direct: every rank runs one microbatch in this mini-batch, so weights are finished in
        their backward (no persistent accumulators) except a tied embedding, which two kernels
        (lookup and LM head) add to. An untied embedding's only use is its lookup: either mode
        keeps its sums over the rows looked up only (GradSink `sparse`). late: the sink takes
        late activation flags (GradSink doc); the caller then asks `late_flagged`."""
        model.zero_grad(set_to_none=True)
        for p in model.logical_params().values():
            p.main_grad = None
        sink = model.pc.tok.sink
        if sink is not None:
            emb = {"model.embed_tokens.weight"}
            tied = model.cfg.tie_word_embeddings
            sink.begin(model.logical_params(), direct=direct, keep=emb if tied else set(),
                       sparse=set() if tied else emb, late=late)

    @staticmethod
    def late_flagged(model) -> bool:
        """Whether the mini-batch since `begin_grads(late=True)` must run again: a kernel on
        some rank counted a late activation flag (GradSink.late_flagged; collective over the
        world group). Call after the last backward, before `sync_grads`."""
        sink = model.pc.tok.sink
        return sink is not None and sink.late_flagged()

    @staticmethod
    def paged_attention(q, k_pool, v_pool, table, q_pos, kv_len, scale, tk, pc: ParallelCtx):
        """Rollout attention through a block table (no gradient, no CP): the bytes of
        `attention` on the gathered keys (kernels/paged_attention.py)."""
        return paged_attention.paged_attention(q, k_pool, v_pool, table, q_pos, kv_len, scale, tk)

    @staticmethod
    def sync_grads(model) -> None:
        """Close the sink: its exact sums over every microbatch and rank, rounded once, become
        the parameters' fp32 gradients — `.grad` of an fp32-held parameter, `.main_grad` of a
        weight held in bf16 (Qwen3ForCausalLM.hold_matmul_weights; torch keeps a .grad in its
        parameter's dtype, and an fp32 gradient beside a bf16 weight is Megatron's main_grad).
        train/step.gradients reads either. Raises RuntimeError if autograd left a gradient of
        its own on a parameter (a use that bypassed the kernels, which the sink would miss)."""
        sink = model.pc.tok.sink
        if sink is None or not sink.open:
            return
        grads = sink.finish()
        for n, p in model.logical_params().items():
            if p.grad is not None:
                raise RuntimeError(f"{n}: autograd accumulated a gradient outside the kernels")
            if p.dtype == torch.float32:
                p.grad = grads.get(n)
            else:
                p.main_grad = grads.get(n)


def needs_grad(*ts: torch.Tensor) -> bool:
    """Whether autograd records an op on these tensors now (else: inference passes)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


# -- stock collectives with autograd (native mode) -----------------------------------------------
def _all_reduce(t: torch.Tensor, comm: Comm) -> torch.Tensor:
    t = t.contiguous().clone()
    if comm.size > 1:
        dist.all_reduce(t, group=comm.group)
    return t


def _all_gather(t: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    if comm.size == 1:
        return t
    out = [torch.empty_like(t.contiguous()) for _ in range(comm.size)]
    dist.all_gather(out, t.contiguous(), group=comm.group)
    return torch.cat(out, dim)


def _reduce_scatter(t: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    return par.rows_of_rank(_all_reduce(t, comm), comm, dim)


def _sum_over(t: torch.Tensor, comm: Comm) -> torch.Tensor:
    """SUM all-reduce of per-rank terms into an output every rank then uses whole and alike
    (logprobs, entropy of a replicated loss): each term's gradient is the sum's, as it
    arrives (no reduction back)."""
    return pair(t, lambda x: _all_reduce(x, comm), lambda g: g)


def _sum_shared(t: torch.Tensor, comm: Comm) -> torch.Tensor:
    """SUM all-reduce into a value each rank uses only with its own slice (the softmax
    denominator): the loss's gradient of it is the sum of every rank's part, all-reduced."""
    return pair(t, lambda x: _all_reduce(x, comm), lambda g: _all_reduce(g, comm))


def _vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                             tp: Comm, live_vocab: int | None):
    """(logprobs [N], entropy [N]) of `targets` (global ids) from this rank's vocab slice of
    the logits [N, V/TP], as Megatron-LM computes its vocab-parallel cross entropy (Shoeybi et
    al., arXiv 1909.08053, §3: a MAX all-reduce of the row maxima, SUM all-reduces of Σ exp,
    of the target's term from the rank holding it, and here of Σ p·log p for the entropy),
    differentiable through torch autograd. fp32; ids >= live_vocab get −inf as in log_softmax."""
    z = logits.float() / temperature
    v = z.shape[1]
    off = tp.rank * v
    if live_vocab is not None and live_vocab < v * tp.size:
        ids = torch.arange(off, off + v, device=z.device)
        z = torch.where(ids < live_vocab, z, torch.full_like(z, float("-inf")))
    m = z.detach().amax(-1, keepdim=True)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp.group)
    zs = z - m
    logp = zs - _sum_shared(zs.exp().sum(-1), tp).log()[:, None]
    local = targets - off
    held = (local >= 0) & (local < v)
    pick = logp.gather(1, local.clamp(0, v - 1)[:, None])[:, 0]
    lp = _sum_over(torch.where(held, pick, torch.zeros_like(pick)), tp)
    p = logp.exp()
    plogp = p * torch.where(p > 0, logp, torch.zeros_like(logp))
    return lp, -_sum_over(plogp.sum(-1), tp)


def _native_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """What the stock arm computes in: the compute dtype on CUDA (bf16 cuBLAS, flash SDPA: what
    GPU users run); fp32 on CPU, where nobody trains in bf16 and the arm is the control."""
    return dtype if x.is_cuda else torch.float32


def _linear(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """F.linear in the native dtype. bf16 on CUDA: the cuBLAS bf16 GEMM with its bf16 output,
    which stays the residual stream's dtype (as transformers and Megatron keep activations);
    the fp32-held weight is cast per product, so its gradient arrives in fp32."""
    dtype = _native_dtype(x, dtype)
    if dtype == torch.float32:
        return F.linear(x, w.to(torch.float32))     # a bf16-held weight: the same values
    return F.linear(x.to(dtype), w.to(dtype))


class NativeOps:
    """Stock torch ops and SUM collectives: the baseline users would otherwise run. On CUDA with
    a bf16 compute dtype the activations stay bf16 between ops (embedding, residual adds,
    SwiGLU, RoPE, attention output, logits), with RMSNorm statistics and the log-softmax in
    fp32, as in transformers' Qwen3; on CPU every op is fp32 (the control)."""

    name = "native"
    packed_attention = True
    """`attention_packed`: flash varlen attention on the streams where it can run (CUDA, a
    dense causal pass without CP), else the per-sample gathers around SDPA."""

    @staticmethod
    def swiglu(g, u):
        return F.silu(g) * u

    @staticmethod
    def mlp(x, w_gate, w_up, w_down, local_shards, pc: ParallelCtx, dtype=torch.float32):
        g, u = NativeOps.col(x, [w_gate, w_up], None, local_shards, pc, dtype)
        return NativeOps.row(NativeOps.swiglu(g, u), w_down, local_shards, pc, dtype)

    @staticmethod
    def token_logprobs_entropy(logits, targets, temperature, live_vocab=None):
        logp = NativeOps.log_softmax(logits, temperature, live_vocab)
        lp = logp.gather(1, targets[:, None])[:, 0]
        p = logp.exp()
        # masked ids: 0 · −inf is NaN, in the value and (through where) in the gradient
        ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
        return lp, ent

    @staticmethod
    def linear_token_logprobs(h, w, targets, temperature, pc: ParallelCtx, live_vocab=None,
                              dtype=torch.float32):
        """LM head + logprobs as stock stacks compute them: at TP1 the logits and torch's
        log-softmax (transformers); at TP > 1 Megatron's vocab-parallel form on each rank's
        logits slice, never gathering the vocabulary (`_vocab_parallel_logprobs`)."""
        (logits,) = NativeOps.col(h, [w], None, None, pc, dtype)
        if pc.tp.size == 1:
            return NativeOps.token_logprobs_entropy(logits, targets, temperature, live_vocab)
        return _vocab_parallel_logprobs(logits, targets, temperature, pc.tp, live_vocab)

    @staticmethod
    def log_softmax(logits, temperature, live_vocab=None):
        z = logits.float() / temperature
        if live_vocab is not None and live_vocab < z.shape[-1]:   # the same rule as invariant
            pad = z.new_full((*z.shape[:-1], z.shape[-1] - live_vocab), float("-inf"))
            z = torch.cat([z[..., :live_vocab], pad], -1)
        return torch.log_softmax(z, dim=-1)

    @staticmethod
    def gather_vocab(z, pc):
        if pc.tp.size == 1:
            return z
        # Every TP rank computes the same loss on the gathered logits: its grad is replicated.
        tp = pc.tp
        return pair(z, lambda t: _all_gather(t, tp, 1), lambda g: par.rows_of_rank(g, tp, 1))

    @staticmethod
    def cp_gather(x, pc):
        if pc.cp.size == 1:
            return x
        cp = pc.cp
        return pair(x, lambda t: par.cp_assemble(pc, list(_all_gather(t, cp, 0).chunk(cp.size, 0))),
                    lambda g: par.cp_local_rows(pc, _all_reduce(g, cp)))

    @staticmethod
    def sp_scatter(x, pc):
        if not pc.sp:
            return x
        tp = pc.tp
        return pair(x, lambda t: par.rows_of_rank(t, tp, 0), lambda g: _all_gather(g, tp, 0))

    @staticmethod
    def embed(ids, w, offset, pc: ParallelCtx, dtype=torch.float32):
        local = ids - offset
        inside = (local >= 0) & (local < w.shape[0])
        x = F.embedding(local.clamp(0, w.shape[0] - 1), w).to(_native_dtype(w, dtype))
        x = x * inside[:, None]
        if pc.tp.size > 1:
            tp = pc.tp
            x = pair(x, lambda t: _all_reduce(t, tp), lambda g: g)
        return NativeOps.sp_scatter(x, pc)

    @staticmethod
    def norm(x, w, eps, tok, head_comm=None, replicas=1, out_dtype=torch.float32):
        """RMSNorm in x's dtype, statistics in fp32: bf16 rows (CUDA) are normalised in fp32 and
        rounded to bf16 before the weight (bf16) multiplies them, as transformers does; for
        fp32 rows every cast is a no-op."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w.to(x.dtype) * y.to(x.dtype)

    @staticmethod
    def norm_rope(x, w, eps, cos, sin, tok, head_comm=None, replicas=1, out_dtype=None):
        """out_dtype: ignored (the stream's dtype: bf16 on CUDA, as attention takes it)."""
        y = NativeOps.norm(x, w, eps, tok)
        return apply_rope(y, cos.to(y.dtype), sin.to(y.dtype))

    @staticmethod
    def col(x, ws, shard_rows, local_shards, pc: ParallelCtx, dtype=torch.float32):
        tp = pc.tp
        if pc.sp:
            x = pair(x, lambda t: _all_gather(t, tp, 0), lambda g: _reduce_scatter(g, tp, 0))
        elif tp.size > 1:
            x = pair(x, lambda t: t.view_as(t), lambda g: _all_reduce(g, tp))
        return tuple(_linear(x, w, dtype) for w in ws)

    @staticmethod
    def row(x, w, local_shards, pc: ParallelCtx, dtype=torch.float32):
        y, tp = _linear(x, w, dtype), pc.tp
        if pc.sp:
            return pair(y, lambda t: _reduce_scatter(t, tp, 0), lambda g: _all_gather(g, tp, 0))
        return pair(y, lambda t: _all_reduce(t, tp), lambda g: g) if tp.size > 1 else y

    @staticmethod
    def attention(q, k, v, q_pos, kv_len, scale, pc: ParallelCtx, dtype=torch.float32,
                  dense_causal=False, bounds=None):
        """SDPA in the compute dtype (bf16 on CUDA: q/k/v rounded, bf16 output). A dense
        causal layout (StreamLayout.dense_causal: training passes) uses is_causal, which lets
        SDPA take the flash kernel; every other layout passes the explicit mask."""
        dtype = _native_dtype(q, dtype)
        # GQA inside SDPA (as transformers calls it), not K/V copied to every query head
        gqa = q.shape[1] != k.shape[1]
        if dense_causal and q.shape[2] == k.shape[2]:
            out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype),
                                                 is_causal=True, scale=scale, enable_gqa=gqa)
            return out * (q_pos >= 0)[:, None, :, None]
        j = torch.arange(k.shape[2], device=q.device)
        vis = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_len[:, None, None])
        row = vis.any(-1)
        vis = vis | ~row[:, :, None]          # keep SDPA finite on empty slots; zeroed below
        out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype),
                                             attn_mask=vis[:, None], scale=scale,
                                             enable_gqa=gqa)
        return out * row[:, None, :, None]

    @staticmethod
    def attention_packed(q, k, v, rows, q_pos, kv_len, scale, pc: ParallelCtx, bounds=None, *,
                         lay: StreamLayout, dtype=torch.float32):
        """Attention of packed streams as users with remove-padding run it: q [Lq, Hq, D], k/v
        [Lk, Hkv, D] (bf16 on a bf16 CUDA run) -> the output stream [Lq, Hq, D] in the native
        dtype (bf16 there; rows no sample holds +0). Where `varlen.usable` on lay's
        `packed_segments` (CUDA, sm80+, a dense causal pass whose keys are its own rows: no CP),
        one FlashAttention-2 varlen call (Dao 2023; torch.nn.attention.varlen.varlen_attn) reads
        the streams without per-sample copies. Otherwise (CPU, CP, other layouts, no varlen in
        this torch) the gather path, bytes and all: `to_samples` of q, k, v, `attention` (SDPA)
        and `to_stream`. rows: StreamLayout.packed_rows() (the invariant arm's; lay holds it)."""
        seg, flash_dtype = lay.packed_segments(), _native_dtype(q, dtype)
        if varlen.usable(q, k, seg, scale, flash_dtype):
            return varlen.flash_varlen_attention(q, k, v, seg, scale, flash_dtype)
        qs = to_samples(q, lay.q_idx, lay).transpose(1, 2)              # [S, Hq, T, D]
        ks = to_samples(k, lay.keys_idx, lay).transpose(1, 2)           # [S, Hkv, Tk, D]
        vs = to_samples(v, lay.keys_idx, lay).transpose(1, 2)
        o = NativeOps.attention(qs, ks, vs, q_pos, kv_len, scale, pc, dtype, lay.dense_causal,
                                bounds)
        return to_stream(o.transpose(1, 2), lay.q_idx, q.shape[0], lay)

    @staticmethod
    def begin_grads(model, direct: bool = False, late: bool = False) -> None:
        model.zero_grad(set_to_none=True)

    @staticmethod
    def late_flagged(model) -> bool:
        """Never: the stock kernels check nothing."""
        return False

    @staticmethod
    def sync_grads(model) -> None:
        """Sum the token-partial gradients the stock path leaves on each rank (backend order)."""
        pc = model.pc
        for name, p in model.logical_params().items():
            if p.grad is None:
                continue
            g = p.grad
            if pc.cp.size > 1:
                dist.all_reduce(g, group=pc.cp.group)
            if pc.dp.size > 1:
                dist.all_reduce(g, group=pc.dp.group)
            leaf = name.rsplit(".", 2)[-2]
            if leaf in ("q_norm", "k_norm") and pc.tp.size > 1:
                dist.all_reduce(g, group=pc.tp.group)
            elif leaf in ("k_proj", "v_proj") and pc.kv.size > 1:
                dist.all_reduce(g, group=pc.kv.group)
            elif "layernorm" in name or name == "model.norm.weight":
                if pc.sp:
                    dist.all_reduce(g, group=pc.tp.group)


def ops_for(mode: str):
    """Op set for `--mode` ('invariant' | 'native'); ValueError otherwise."""
    if mode == "invariant":
        return InvariantOps
    if mode == "native":
        return NativeOps
    raise ValueError(f"--mode {mode!r} is not known; allowed: invariant, native")
