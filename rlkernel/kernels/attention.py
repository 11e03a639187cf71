"""Causal GQA attention over fixed KV blocks at absolute positions, forward and backward.

Forward, per query (one online-softmax update per block, blocks in order; Milakov & Gimelshein,
"Online normalizer calculation for softmax", 2018; Dao et al., FlashAttention, 2022):
    block b covers keys [b·B, (b+1)·B) of the query's own sequence, B = ATTN_KV_BLOCK;
    s = (q·k, sequential over D)·scale; masked keys -> −inf;  m' = max(m, max s)
    p = exp(s − m');  l = l·e^{m−m'} + tree_sum(p);  acc = acc·e^{m−m'} + Σ_j p_j·v_j (in key order)
A key contributes only if it is visible (key ≤ query position and < kv_len): invisible keys are
*skipped* with a select, never added as a zero, and a block with no visible key leaves the state
untouched. So a query's bits depend only on its own q, the keys at positions ≤ its own and B:
prefill, chunked prefill, KV-cache decode, any batch and any padding give identical bytes.
Backward (recompute, p = exp(s − lse)): dQ reduces over keys in the same block/key order; dK and
dV reduce over queries, which is a token reduction (distributed/tokensum.py): queries are summed
in position order inside each leaf of TOKEN_LEAF positions of their own sample (leaf = position
// TOKEN_LEAF, so packing never moves a query to another leaf), the leaf partials added exactly
over this rank's leaves and the CP ranks' (`tok.exact_sum`) and rounded once, then the G query
heads of a GQA group by the halving tree (numerics/trees.tree_sum_halving). Why halving: when TP exceeds the KV heads, the rep = TP/Hkv
ranks sharing a KV head hold G/rep consecutive query heads each (e.g. 24 query / 2 KV heads at
TP4: 12 heads as 6 + 6), and only the halving tree has those equal parts as subtrees for every
G, so each rank reduces its part locally and `kv_comm` finishes the same tree. (When the group
spans 2**k whole virtual-TP shards, its top k levels are those shards; for a power-of-two G it is
the plain pairwise tree, so such models keep their bits.)
Layout: per-sample padded [S, heads, T, D], which rlkernel/model gathers from the token stream;
or, `attention_packed`, the packed streams themselves with each sample's first row (varlen
attention, as FlashAttention-2's cu_seqlens entry point): the same bytes, no per-sample copies
on CUDA (the kernels read and write each sample's rows in place).
Devices: on CPU both directions are the torch code below (the reference); on CUDA both dispatch to
Triton kernels with the CUDA block size 64: the forward to kernels/triton_attention.py, the
backward to kernels/triton_attention_bwd.py (FlashAttention-2 recomputation from lse, the same
leaf partials and exact sums, memory O(L)). The CUDA bits differ from the CPU's (other block
size, fused dots) but obey the same invariances.
Precision: q, k, v come in fp32 or bf16 (bf16 runs round them in the model, model/qwen3.py).
With bf16 the products accumulate in fp32, P is rounded to bf16 before P·V and the row sum l
(the CUDA kernel's tensor-core dots take bf16 P; the CPU rounds P the same way and widens it),
m, l and lse stay fp32 and the output is rounded to bf16 once. The backward (FlashAttention-2's
rounding points, NUMERICS_VERSION 5) takes dO in bf16, recomputes P from lse and rounds it to
bf16 before P·dO (dV), rounds dS to bf16 before dS·K (dQ) and dSᵀ·Q (dK), keeps delta, P, dS
and every accumulation in fp32 and rounds dQ, dK, dV to bf16 once at the end. Every rounding is
elementwise, so none moves a bit with batch, layout or rank.
Does not: communicate (CP gathers K/V in rlkernel/distributed).
"""

from __future__ import annotations

import torch

from rlkernel.kernels.elementwise import exp32, log32
from rlkernel.kernels.matmul import seq_matmul
from rlkernel.kernels.slots import (SlotMoves, gather_slots, run_slot_map, scatter_slots,
                                   slot_moves)
from rlkernel.distributed.comm import Comm
from rlkernel.distributed.tokensum import TokenSum
from rlkernel.numerics.trees import tree_sum, tree_sum_halving
from rlkernel.spec import ATTN_KV_BLOCK, TOKEN_LEAF

_NEG_INF = float("-inf")


def _visible(q_pos: torch.Tensor, kv_len: torch.Tensor, j0: int, n: int) -> torch.Tensor:
    """[S, Tq, n] bool: key j0+i visible to each query."""
    j = torch.arange(j0, j0 + n, device=q_pos.device)
    return (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_len[:, None, None])


def _scores(qg: torch.Tensor, kb: torch.Tensor, scale: float, vis: torch.Tensor) -> torch.Tensor:
    s = seq_matmul(qg, kb.transpose(-1, -2)) * scale
    return torch.where(vis, s, torch.full_like(s, _NEG_INF))


def _skip_sum(acc: torch.Tensor, w: torch.Tensor, x: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    """acc + Σ_j w[..., j]·x[..., j, :] in j order, adding only where vis[..., j] (in place)."""
    for j in range(w.shape[-1]):
        cand = acc + w[..., j:j + 1] * x[..., j, :].unsqueeze(-2)
        acc = torch.where(vis[..., j:j + 1], cand, acc)
    return acc


def _blocks(tk: int) -> range:
    return range(0, tk, ATTN_KV_BLOCK)


def attention_forward(q, k, v, q_pos, kv_len, scale):
    """Returns (out [S, Hq, Tq, D], lse [S, Hkv, G, Tq]) — see module doc.

    CUDA tensors run the Triton kernel of kernels/triton_attention.py (its own KV block size).
    """
    if q.is_cuda:
        from rlkernel.kernels import triton_attention
        return triton_attention.attention_forward(q, k, v, q_pos, kv_len, scale)
    dtype = _check_dtype(q, k, v)
    q, k, v = (t.to(torch.float32) for t in (q, k, v))       # exact: bf16 values widened
    s_, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(s_, hkv, g, tq, d)
    dev = q.device
    m = torch.full((s_, hkv, g, tq), _NEG_INF, device=dev)
    l = torch.zeros(s_, hkv, g, tq, device=dev)
    acc = torch.zeros(s_, hkv, g, tq, d, device=dev)
    for j0 in _blocks(tk):
        n = min(ATTN_KV_BLOCK, tk - j0)
        vis = _visible(q_pos, kv_len, j0, n)[:, None, None]          # [S,1,1,Tq,n]
        kb = k[:, :, None, j0:j0 + n]                                  # [S,Hkv,1,n,D]
        vb = v[:, :, None, j0:j0 + n]
        s = _scores(qg, kb, scale, vis)
        row = vis.any(-1)                                              # [S,1,1,Tq]
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(row, m_new, torch.zeros_like(m_new))
        p = exp32(s - m_safe[..., None])
        if dtype == torch.bfloat16:      # the rounding point of P, as the CUDA kernel's bf16 dots
            p = _bf16(p)
        alpha = exp32(torch.where(row, m - m_safe, torch.zeros_like(m)))
        pv = _skip_sum(torch.zeros_like(acc), p, vb.unsqueeze(-3).squeeze(-3).expand(
            s_, hkv, g, n, d), vis.expand(s_, hkv, g, tq, n))
        l = torch.where(row, l * alpha + tree_sum(p, -1), l)
        acc = torch.where(row[..., None], acc * alpha[..., None] + pv, acc)
        m = torch.where(row, m_new, m)
    has = l > 0
    out = torch.where(has[..., None], acc / torch.where(has, l, torch.ones_like(l))[..., None],
                      torch.zeros_like(acc))
    lse = torch.where(has, m + log32(torch.where(has, l, torch.ones_like(l))), torch.zeros_like(l))
    return out.reshape(s_, hq, tq, d).to(dtype), lse


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (round-to-nearest-even) and widened back to fp32 exactly."""
    return x.to(torch.bfloat16).to(torch.float32)


def _check_dtype(q, k, v) -> torch.dtype:
    """The dtype q, k and v share (float32 or bfloat16); ValueError otherwise."""
    if q.dtype not in (torch.float32, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attention: q/k/v must share dtype float32 or bfloat16, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    return q.dtype


def _sum_over_queries(w, x, q_pos, tok: TokenSum):
    """Σ over queries of w[..., t, j]·x[..., t, :] by the canonical token reduction.

    w [S,H,G,Tq,Tk], x [S,H,G,Tq,D], q_pos [S,Tq] (absolute position, −1 = none) -> [S,H,G,Tk,D]:
    per sample, queries in position order inside each leaf of TOKEN_LEAF positions (absent
    positions skipped), then every leaf partial of every rank of `tok.comm` added exactly.
    """
    s_, h, g, tq, tk = w.shape
    d = x.shape[-1]
    dev = w.device
    valid = q_pos >= 0
    nf = int(q_pos.amax().item()) // TOKEN_LEAF + 1 if bool(valid.any()) else 1
    width = nf * TOKEN_LEAF
    sl = torch.where(valid, q_pos, torch.full_like(q_pos, width))       # padding -> dump slot
    wq = torch.zeros(s_, h, g, width + 1, tk, device=dev)
    xq = torch.zeros(s_, h, g, width + 1, d, device=dev)
    wq.scatter_(3, sl[:, None, None, :, None].expand(s_, h, g, tq, tk), w)
    xq.scatter_(3, sl[:, None, None, :, None].expand(s_, h, g, tq, d), x)
    present = torch.zeros(s_, width + 1, dtype=torch.bool, device=dev)
    present.scatter_(1, sl, valid)
    wq = wq[:, :, :, :width].reshape(s_, h, g, nf, TOKEN_LEAF, tk)
    xq = xq[:, :, :, :width].reshape(s_, h, g, nf, TOKEN_LEAF, d)
    present = present[:, :width].reshape(s_, nf, TOKEN_LEAF)
    acc = torch.zeros(s_, h, g, nf, tk, d, device=dev)
    for i in range(TOKEN_LEAF):
        cand = acc + wq[..., i, :, None] * xq[..., i, None, :]
        acc = torch.where(present[:, None, None, :, i, None, None], cand, acc)
    # A leaf with no query here is all zeros, which adds nothing to an exact sum.
    return tok.exact_sum(acc.movedim(3, 0), "token-sum-attention")


def attention_backward(q, k, v, out, lse, d_out, q_pos, kv_len, scale, tok: TokenSum,
                       kv_comm: Comm | None):
    """(dQ, dK, dV) by this file's torch ops — the reference (module doc's Backward). Shapes as
    `attention`, out/lse from `attention_forward`. Any device; on CUDA `_Attention` runs
    kernels/triton_attention_bwd.py instead (benchmarks/bench_attention.py times both there).
    Memory: O(Tq·Tk) (p and ds of every block, per-leaf partials [S, Hkv, G, n_leaves, Tk, D]).
    bf16 q/k/v (and out, d_out): d_out rounded to bf16, computed in fp32 on the exactly widened
    values, p recomputed from lse and rounded to bf16 before dV, ds rounded to bf16 before dQ and
    dK, dQ/dK/dV rounded once to bf16 at the end (the CUDA backward's rounding points, whose
    tensor-core dots the CPU does not emulate)."""
    dtype = _check_dtype(q, k, v)
    q, k, v, out = (t.to(torch.float32) for t in (q, k, v, out))
    s_, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(s_, hkv, g, tq, d)
    # dO at its rounding point (q's dtype), then widened exactly.
    dog = d_out.reshape(s_, hkv, g, tq, d).to(dtype).to(torch.float32)
    og = out.reshape(s_, hkv, g, tq, d)
    delta = tree_sum(dog * og, -1)
    dq = torch.zeros_like(qg)
    p_all, ds_all = [], []
    for j0 in _blocks(tk):
        n = min(ATTN_KV_BLOCK, tk - j0)
        vis = _visible(q_pos, kv_len, j0, n)[:, None, None].expand(s_, hkv, g, tq, n)
        kb = k[:, :, None, j0:j0 + n].expand(s_, hkv, g, n, d)
        vb = v[:, :, None, j0:j0 + n].expand(s_, hkv, g, n, d)
        s = _scores(qg, kb, scale, vis)
        p = exp32(s - lse[..., None])
        p = torch.where(vis, p, torch.zeros_like(p))
        dp = seq_matmul(dog, vb.transpose(-1, -2))
        ds = torch.where(vis, p * (dp - delta[..., None]), torch.zeros_like(p))
        if dtype == torch.bfloat16:   # the rounding points of P (for dV) and dS (dQ, dK)
            p, ds = _bf16(p), _bf16(ds)
        dq = _skip_sum(dq, ds, kb, vis)
        p_all.append(p)
        ds_all.append(ds)
    dq = dq * scale
    p_all = torch.cat(p_all, -1)
    ds_all = torch.cat(ds_all, -1)
    # Token reduction per query head first, then the heads of a GQA group by the halving
    # tree: this rank's equal part of the group locally, then across the TP ranks
    # replicating this KV head (rank order = head order), which finish the same tree.
    dv = tree_sum_halving(_sum_over_queries(p_all, dog, q_pos, tok), 2)
    dk = tree_sum_halving(_sum_over_queries(ds_all, qg, q_pos, tok), 2)
    if kv_comm is not None and kv_comm.size > 1:
        dv = kv_comm.tree_all_reduce(dv, "attention-kv-head-tree-dv")
        dk = kv_comm.tree_all_reduce(dk, "attention-kv-head-tree-dk")
    dk = dk * scale
    return dq.reshape(s_, hq, tq, d).to(dtype), dk.to(dtype), dv.to(dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, kv_len, scale, tok, kv_comm, bounds):
        out, lse = attention_forward(q, k, v, q_pos, kv_len, scale)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, kv_len)
        ctx.scale, ctx.bounds = scale, bounds
        ctx.tok, ctx.kv_comm = tok or TokenSum.single(), kv_comm
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, q_pos, kv_len = ctx.saved_tensors
        if q.is_cuda:
            from rlkernel.kernels import triton_attention_bwd
            dq, dk, dv = triton_attention_bwd.attention_backward(
                q, k, v, out, lse, d_out, q_pos, kv_len, ctx.scale, ctx.tok, ctx.kv_comm,
                bounds=ctx.bounds)
        else:
            dq, dk, dv = attention_backward(q, k, v, out, lse, d_out, q_pos, kv_len, ctx.scale,
                                            ctx.tok, ctx.kv_comm)
        return dq, dk, dv, None, None, None, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              kv_len: torch.Tensor, scale: float, tok: TokenSum | None = None,
              kv_comm: Comm | None = None, bounds: tuple[int, int] | None = None
              ) -> torch.Tensor:
    """Invariant causal GQA attention.

    q [S, Hq, Tq, D], k/v [S, Hkv, Tk, D], one dtype: fp32, or bf16 (bf16 runs: products
    accumulate in fp32, P is rounded to bf16 before P·V and the row sum, the output is rounded to
    bf16, and so are dQ, dK, dV; softmax statistics stay fp32); q_pos [S, Tq] long absolute
    positions (−1 = padding slot, output 0); kv_len [S] long valid keys per sample;
    scale = 1/sqrt(D) (float).
    Under CP, q holds this rank's queries only (whole leaves of TOKEN_LEAF positions of each
    sample) and `tok.comm` is the CP group that holds the others; k/v hold whole sequences.
    `kv_comm`: the TP ranks replicating this KV head (a power-of-two count), in head order, each
    holding 1/kv_comm.size of the group's heads. `bounds`: (q_pos.max(), kv_len.max()) as host
    ints when the caller knows them (model/layout.StreamLayout.attention_bounds; they must be
    those values), which spares the CUDA backward its host sync. Returns [S, Hq, Tq, D] in q's
    dtype. ValueError for q/k/v of other or mixed dtypes.
    """
    return _Attention.apply(q, k, v, q_pos, kv_len, float(scale), tok, kv_comm, bounds)


class _AttentionPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_rows, k_rows, q_pos, kv_len, tk, scale, tok, kv_comm, bounds):
        if q.is_cuda:
            from rlkernel.kernels import triton_attention
            out, lse = triton_attention.attention_forward_packed(q, k, v, q_rows, k_rows, q_pos,
                                                                 kv_len, tk, scale)
        else:
            qm, km = _packed_moves(q, k, q_rows, k_rows, q_pos, kv_len, tk)
            out_s, lse = attention_forward(_to_slots(q, qm), _to_slots(k, km), _to_slots(v, km),
                                           q_pos, kv_len, scale)
            out = scatter_slots(out_s.transpose(1, 2), qm)
        ctx.save_for_backward(q, k, v, out, lse, q_rows, k_rows, q_pos, kv_len)
        ctx.tk, ctx.scale, ctx.bounds = tk, scale, bounds
        ctx.tok, ctx.kv_comm = tok or TokenSum.single(), kv_comm
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, q_rows, k_rows, q_pos, kv_len = ctx.saved_tensors
        if q.is_cuda:
            from rlkernel.kernels import triton_attention_bwd
            dq, dk, dv = triton_attention_bwd.attention_backward_packed(
                q, k, v, out, lse, d_out, q_rows, k_rows, q_pos, kv_len, ctx.tk, ctx.scale,
                ctx.tok, ctx.kv_comm, bounds=ctx.bounds)
        else:
            qm, km = _packed_moves(q, k, q_rows, k_rows, q_pos, kv_len, ctx.tk)
            grads = attention_backward(
                _to_slots(q, qm), _to_slots(k, km), _to_slots(v, km), _to_slots(out, qm), lse,
                _to_slots(d_out, qm), q_pos, kv_len, ctx.scale, ctx.tok, ctx.kv_comm)
            dq, dk, dv = (scatter_slots(g.transpose(1, 2), m) for g, m in zip(grads, (qm, km, km)))
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def key_slot_map(k_rows: torch.Tensor, kv_len: torch.Tensor, tk: int) -> torch.Tensor:
    """kernels/slots.run_slot_map of a packed key stream's tk key slots (valid below
    kv_len)."""
    j = torch.arange(tk, device=kv_len.device)
    return run_slot_map(k_rows, j[None, :] < kv_len[:, None])


def _packed_moves(q, k, q_rows, k_rows, q_pos, kv_len, tk) -> tuple[SlotMoves, SlotMoves]:
    """The slot moves of a packed problem's query and key streams."""
    return (slot_moves(run_slot_map(q_rows, q_pos >= 0), q.shape[0]),
            slot_moves(key_slot_map(k_rows, kv_len, tk), k.shape[0]))


def _to_slots(x: torch.Tensor, mv: SlotMoves) -> torch.Tensor:
    """Stream x [L, H, D] -> per-sample [S, H, T, D] (empty slots +0.0)."""
    return gather_slots(x, mv).transpose(1, 2)


def check_packed(what: str, q, k, v, q_rows, k_rows, q_pos, kv_len) -> None:
    """ValueError unless q [Lq, Hq, D], k/v [Lk, Hkv, D], q_rows / k_rows / kv_len [S] and
    q_pos [S, Tq] form a packed problem."""
    s_ = q_pos.shape[0] if q_pos.dim() == 2 else -1
    if (q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k.shape[2] != q.shape[2]
            or q_pos.dim() != 2 or tuple(q_rows.shape) != (s_,)
            or tuple(k_rows.shape) != (s_,) or tuple(kv_len.shape) != (s_,)):
        raise ValueError(f"{what}: streams q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, q_rows {tuple(q_rows.shape)}, k_rows "
                         f"{tuple(k_rows.shape)}, q_pos {tuple(q_pos.shape)}, kv_len "
                         f"{tuple(kv_len.shape)} do not form a packed GQA problem "
                         f"([Lq, Hq, D], [Lk, Hkv, D], [S], [S], [S, Tq], [S])")


def attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_rows: torch.Tensor,
                     k_rows: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor, tk: int,
                     scale: float, tok: TokenSum | None = None, kv_comm: Comm | None = None,
                     bounds: tuple[int, int] | None = None) -> torch.Tensor:
    """`attention` on packed token streams: q [Lq, Hq, D], k/v [Lk, Hkv, D] (one dtype, fp32 or
    bf16), where slot t of sample s (q_pos[s, t] >= 0; the valid slots come first) is query
    row q_rows[s] + t and key slot j < kv_len[s] is key row k_rows[s] + j (q_rows, k_rows [S]
    long); tk (host int) >= every kv_len, the per-sample problem's key slots. Returns the output
    stream [Lq, Hq, D] (+0.0 in rows no query slot names); the gradients reach q, k, v's rows
    the same way (+0.0 elsewhere). The bytes of `attention` on the gathered per-sample tensors
    scattered back: on CPU it is that (kernels/slots.py's moves around the reference); on CUDA
    the Triton kernels read and write each sample's rows in place (no gather or scatter copies
    but dK/dV's scatter). The row maps are the caller's contract (model/layout.StreamLayout.
    packed_rows checks them on the host). ValueError for mismatched shapes or dtypes."""
    check_packed("attention_packed", q, k, v, q_rows, k_rows, q_pos, kv_len)
    _check_dtype(q, k, v)
    return _AttentionPacked.apply(q, k, v, q_rows, k_rows, q_pos, kv_len, int(tk), float(scale),
                                  tok, kv_comm, bounds)
