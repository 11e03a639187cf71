"""Causal GQA attention backward on CUDA (Triton): dQ, dK, dV recomputed from the forward's lse.

The contract is kernels/attention.py's module doc (DESIGN.md §1 "Attention", "Backward"); this
file is its CUDA implementation, built on FlashAttention-2's recomputation (Dao 2023, §3.1,
Algorithm 2): nothing of size Tq × Tk is ever stored.
    s_tj = (q_t·k_j)·scale     the forward's dot (same operands, same dtype, same scale multiply)
    p_tj = exp(s_tj − lse_t)   (tl.exp; 0 where key j is invisible to query t)
    delta_t = Σ_d dO_td·O_td   (fp32 products, summed d = 0..D−1 by a dot with ones)
    ds_tj = p_tj·(dO_t·v_j − delta_t)
    dQ_t = scale·Σ_j ds_tj·k_j      dV_j = Σ_t p_tj·dO_t      dK_j = scale·Σ_t ds_tj·q_t
Three kernels:
- `_delta_kernel`: delta [S, Hq, Tq] fp32, one row per query (0 for a padding slot).
- `_dq_kernel`: one program per tile of rows (t, g) of one KV head's G query heads, like the
  forward. It walks the forward's absolute 64-key blocks in order and continues ONE fp32
  accumulator per element through them (`acc = dot(ds, k, acc)`, input_precision="ieee": one
  multiply-add per key, keys ascending), so dQ_t is a fixed chain over the keys the query
  sees. An invisible key inside a visited block adds ds = 0 times a finite key, which leaves the
  accumulator's bits unchanged (it starts at +0.0 and an add of ±0 can never make it −0.0), so
  which other rows share the tile — batch, padding, a CP rank's query subset, a chunked or
  decode layout — cannot change a bit. Keys at or past kv_len are never loaded (NaN there is
  harmless); keys below kv_len must be finite, as in the forward.
- `_dkv_partials_kernel`: the token reduction over queries. One program per (64-key tile,
  sample × KV head, group of leaves); for each leaf (TOKEN_LEAF = 16 absolute positions of one
  sample, read through a position -> slot map) and each query head g of the group it writes the
  leaf partials Σ_{t in leaf} ds_tj·q_t and Σ_t p_tj·dO_t [64, D] as fp32 dots over the 16
  queries (input_precision="ieee": a multiply-add chain in position order starting at +0.0).
  An absent position is loaded as zeros and adds nothing (the same argument as above), so a leaf
  partial depends only on that leaf's queries: it is the same on every CP rank and in every
  layout. A (leaf, key tile) pair no query of the leaf sees (causality, kv_len, no query at all)
  is not computed; its partial is written as exact zeros. (Finite q and dO are assumed, as in
  the forward: with an Inf in a present query's row, 0·Inf = NaN may land on keys it does not
  see, on other keys than the CPU reference's, which never skips a pair.)
The host adds the leaf partials EXACTLY (numerics/fixedpoint.py; order-free, so CP ranks that hold
other leaves give the same sum), sums the accumulator over `tok.comm` and rounds once
(`TokenSum.round_exact`), then sums the G heads of each group by `tree_sum_halving` and across
`kv_comm` as the CPU path does, and multiplies dK by scale last.

Chunking (why memory is O(L), never O(L²)): keys are cut into chunks of whole 64-key blocks
(and, when one block of every sample is already too big, samples into chunks) so that a chunk
holds at most `acc_elems` results [2 (dK, dV), samples, Hq, keys, D]; for each chunk one exact
accumulator (104 bytes per result) lives, and the leaf partials of `rows` = buf_elems // chunk
leaves at a time are written into one reused fp32 buffer and added to it. Only leaves that can
see the chunk (leaf >= first key // 16) are visited. The chunk cut depends on (S, Hq, D, the
largest kv_len) only, so every CP rank runs the same collectives.
Peak device memory beyond the inputs, out, lse and d_out, an upper bound (`peak_bytes`; bytes;
c = 2·S_c·Hq·K_c·D <= acc_elems unless one 64-key block of one sample exceeds it; rows·c <=
max(buf_elems, c)):
    4·S·Hq·Tq (delta) + 4·S·(16·n_leaves + 1) (slot map) + 4·S·Hq·Tq·D (dQ, fp32)
  + 8·S·Hq·Tk·D (per-head dK, dV) + 8·S·Hq·Tk·D (head-tree levels) + 8·S·Hkv·Tk·D (dK·scale,
    and the kv_comm gather's copies when TP replicates the KV head: ×kv_comm.size)
  + 4·rows·c (partial buffer) + 6·104·c (accumulator, the comm's copy, round_fp32's temporaries)
With the defaults (acc_elems = 2^19, buf_elems = 2^26) the chunk part is at most ~0.55 GiB.
For one 32k-token sample with 4 query heads, 1 KV head, D = 128: ~0.9 GiB in all, where one
fp32 [Tq, Tk] score matrix alone is 4 GiB (tests/test_cuda_attention_bwd.py measures it).

bf16 q/k/v (the forward's other dtype): s uses the bf16 tensor-core dot as in the forward, every
other product runs in fp32 ("ieee") on exactly converted operands; gradients are returned in
the inputs' dtype, rounded once from fp32. In `_dkv_partials_kernel` the s dot has 16 rows, where
the forward's bf16 tiles have >= 64 (possibly another tensor-core instruction on the H200, not
measured): invariance holds (the shape never changes), but the recomputed s may differ from the
forward's in the last bit for bf16. fp32 s is the forward's bit for bit (the same multiply-add chain over D).
Cost: the contract's 16-position leaves make the dK/dV partials 2·Hq·D values per (leaf, key a
leaf sees), ≈ Hq·D·L²/16 for a causal sample of L tokens (16× the dot outputs of a plain
dK/dV), each written once and read once by the fixed-point kernel; the dQ kernel recomputes s
and dp (7 matmul-sized dots in all where FlashAttention-2 with atomics has 5).
Kernels launch with enable_fp_fusion=False, as the forward does: no mul+add is contracted
differently between kernels or tiles. Tiles come from literal tables; none changes a bit on the
GPU (tests/test_cuda_attention_bwd.py checks every row).
Does not: run on CPU tensors (kernels/attention.py's torch code is the reference there; under
TRITON_INTERPRET=1 these kernels run on CPU tensors for tests/test_attention_bwd_triton.py),
communicate other than through `tok.comm` / `kv_comm`, or take fp16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.distributed.comm import Comm
from rlkernel.distributed.tokensum import TokenSum
from rlkernel.kernels.triton_attention import query_rows
from rlkernel.kernels.triton_util import check_cuda, device_ctx
from rlkernel.numerics import fixedpoint as fx
from rlkernel.numerics.trees import tree_sum_halving
from rlkernel.spec import CUDA_ATTN_KV_BLOCK, TOKEN_LEAF

KV_BLOCK = CUDA_ATTN_KV_BLOCK
"""The forward's absolute key block (64): dQ walks these blocks in order; key chunks are whole blocks."""
ACC_ELEMS = 1 << 19
"""Results per exact-accumulator chunk: 2^19 · 104 bytes = 52 MiB of int64 digits."""
BUF_ELEMS = 1 << 26
"""fp32 leaf partials per step (256 MiB buffer): bounds the leaves added per fixed-point call."""

# dtype -> [(max rows Tq·G, (BLOCK_M, num_warps, num_stages)), ...] of the dQ kernel; first fit.
# bf16 keeps BLOCK_M >= 64 and warps % 4 == 0 like the forward (its s dot is the forward's).
_DQ_TILES = {
    torch.float32: [(16, (16, 4, 1)), (1 << 62, (32, 8, 1))],
    torch.bfloat16: [(1 << 62, (64, 8, 1))],
}
# dtype -> (BLOCK_N keys per program, LEAVES per program, num_warps, num_stages) of the partials.
_KV_TILES = {torch.float32: (64, 2, 8, 1), torch.bfloat16: (64, 2, 8, 1)}
_DELTA_TILE = (32, 4)   # (BLOCK_M rows, num_warps)


@triton.jit
def _delta_kernel(O, DO, QPOS, DELTA, s_os, s_oh, s_ot, s_od, s_gs, s_gh, s_gt, s_gd,
                  s_ps, s_pt, s_es, s_eh, s_et, Tq, HQ,
                  D: tl.constexpr, BLOCK_M: tl.constexpr):
    # delta_t = Σ_d dO_td·O_td: fp32 products, summed by a dot with ones (ieee: one add per d,
    # d ascending, whatever BLOCK_M). Padding slots (pos < 0) are never read and get 0.
    sh = tl.program_id(1)
    s = (sh // HQ).to(tl.int64)
    h = (sh % HQ).to(tl.int64)
    t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pos = tl.load(QPOS + s * s_ps + t.to(tl.int64) * s_pt, mask=t < Tq, other=-1)
    live = (t < Tq) & (pos >= 0)
    dd = tl.arange(0, D)
    tt = t.to(tl.int64)[:, None]
    o = tl.load(O + s * s_os + h * s_oh + tt * s_ot + dd[None, :] * s_od,
                mask=live[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + s * s_gs + h * s_gh + tt * s_gt + dd[None, :] * s_gd,
                 mask=live[:, None], other=0.0).to(tl.float32)
    ones = tl.full((D, 16), 1.0, dtype=tl.float32)
    delta = tl.max(tl.dot(o * do, ones, input_precision="ieee"), 1)   # 16 equal columns
    tl.store(DELTA + s * s_es + h * s_eh + t.to(tl.int64) * s_et, delta, mask=t < Tq)


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, QPOS, KVLEN,
               s_qs, s_qh, s_qt, s_qd, s_ks, s_kh, s_kt, s_kd, s_vs, s_vh, s_vt, s_vd,
               s_gs, s_gh, s_gt, s_gd, s_ls, s_lh, s_lt, s_es, s_eh, s_et,
               s_os, s_oh, s_ot, s_od, s_ps, s_pt,
               Tq, Tk, HKV, n_tiles, scale,
               G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    s, hk, t, g, row_ok, pos, kvl, _, hi = query_rows(QPOS, KVLEN, s_ps, s_pt, Tq, Tk, HKV,
                                                      n_tiles, G, BLOCK_M)
    head = (hk * G + g).to(tl.int64)
    live = row_ok & (pos >= 0)
    dd = tl.arange(0, D)
    tt = t.to(tl.int64)
    # Padding slots are not read (zeros): no NaN garbage enters the dots.
    q = tl.load(Q + s * s_qs + head[:, None] * s_qh + tt[:, None] * s_qt + dd[None, :] * s_qd,
                mask=live[:, None], other=0.0)
    do = tl.load(DO + s * s_gs + head[:, None] * s_gh + tt[:, None] * s_gt + dd[None, :] * s_gd,
                 mask=live[:, None], other=0.0).to(tl.float32)
    lse = tl.load(LSE + s * s_ls + head * s_lh + tt * s_lt, mask=live, other=0.0)
    delta = tl.load(DELTA + s * s_es + head * s_eh + tt * s_et, mask=live, other=0.0)
    kbase = K + s * s_ks + hk.to(tl.int64) * s_kh
    vbase = V + s * s_vs + hk.to(tl.int64) * s_vh
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for j0 in range(0, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        k_ok = j < kvl
        jj = j.to(tl.int64)
        kt = tl.load(kbase + jj[None, :] * s_kt + dd[:, None] * s_kd,
                     mask=k_ok[None, :], other=0.0)                            # [D, BN]
        vt = tl.load(vbase + jj[None, :] * s_vt + dd[:, None] * s_vd,
                     mask=k_ok[None, :], other=0.0).to(tl.float32)             # [D, BN]
        qk = tl.dot(q, kt, input_precision=PREC)                               # the forward's
        vis = (j[None, :] <= pos[:, None]) & k_ok[None, :]
        p = tl.where(vis, tl.exp(qk * scale - lse[:, None]), 0.0)
        dp = tl.dot(do, vt, input_precision="ieee")
        ds = tl.where(vis, p * (dp - delta[:, None]), 0.0)
        acc = tl.dot(ds, tl.trans(kt).to(tl.float32), acc, input_precision="ieee")
    dq = tl.where(live[:, None], acc * scale, 0.0)
    tl.store(DQ + s * s_os + head[:, None] * s_oh + tt[:, None] * s_ot + dd[None, :] * s_od,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkv_partials_kernel(Q, K, V, DO, LSE, DELTA, SLOT, KVLEN, BUF,
                         s_qs, s_qh, s_qt, s_qd, s_ks, s_kh, s_kt, s_kd, s_vs, s_vh, s_vt, s_vd,
                         s_gs, s_gh, s_gt, s_gd, s_ls, s_lh, s_lt, s_es, s_eh, s_et, s_ms, s_mp,
                         s_bf, s_bw, s_bs, s_bh, s_bj, s_bd,
                         s0, j0, width, f0, f1, HKV, scale,
                         G: tl.constexpr, D: tl.constexpr, LEAF: tl.constexpr,
                         BLOCK_N: tl.constexpr, LEAVES: tl.constexpr, PREC: tl.constexpr):
    # BUF [rows, 2, S_c, Hq, width, D] fp32: row f - f0, [0] = Σ ds·q (dK), [1] = Σ p·dO (dV).
    sl = tl.program_id(1) // HKV
    s = (s0 + sl).to(tl.int64)
    hk = tl.program_id(1) % HKV
    jt = j0 + tl.program_id(0) * BLOCK_N            # absolute first key of this tile
    j = jt + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, D)
    ii = tl.arange(0, LEAF)
    kvl = tl.load(KVLEN + s).to(tl.int32)
    k_ok = j < kvl
    jj = j.to(tl.int64)
    kt = tl.load(K + s * s_ks + hk.to(tl.int64) * s_kh + jj[None, :] * s_kt + dd[:, None] * s_kd,
                 mask=k_ok[None, :], other=0.0)                                # [D, BN]
    vt = tl.load(V + s * s_vs + hk.to(tl.int64) * s_vh + jj[None, :] * s_vt + dd[:, None] * s_vd,
                 mask=k_ok[None, :], other=0.0).to(tl.float32)                 # [D, BN]
    col = (j - j0).to(tl.int64)
    in_chunk = (j - j0) < width
    out = BUF + sl.to(tl.int64) * s_bs + col[:, None] * s_bj + dd[None, :].to(tl.int64) * s_bd
    for li in range(LEAVES):
        f = f0 + tl.program_id(2) * LEAVES + li
        if f < f1:
            p_abs = f * LEAF + ii                                              # positions
            slot = tl.load(SLOT + s * s_ms + p_abs.to(tl.int64) * s_mp)
            here = slot >= 0
            tq = tl.where(here, slot, 0).to(tl.int64)
            # The pair is live iff some query of the leaf sees a key of the tile.
            seen = tl.max(tl.where(here, tl.minimum(p_abs, kvl - 1), -1), 0)
            row = out + (f - f0).to(tl.int64) * s_bf
            for g in range(G):
                head = (hk * G + g).to(tl.int64)
                pk = tl.zeros((BLOCK_N, D), dtype=tl.float32)
                pv = tl.zeros((BLOCK_N, D), dtype=tl.float32)
                if jt <= seen:
                    q = tl.load(Q + s * s_qs + head * s_qh + tq[:, None] * s_qt
                                + dd[None, :] * s_qd, mask=here[:, None], other=0.0)    # [16, D]
                    do = tl.load(DO + s * s_gs + head * s_gh + tq[:, None] * s_gt
                                 + dd[None, :] * s_gd, mask=here[:, None],
                                 other=0.0).to(tl.float32)
                    lse = tl.load(LSE + s * s_ls + head * s_lh + tq * s_lt, mask=here, other=0.0)
                    delta = tl.load(DELTA + s * s_es + head * s_eh + tq * s_et, mask=here,
                                    other=0.0)
                    qk = tl.dot(q, kt, input_precision=PREC)                   # the forward's
                    vis = here[:, None] & (j[None, :] <= p_abs[:, None]) & k_ok[None, :]
                    p = tl.where(vis, tl.exp(qk * scale - lse[:, None]), 0.0)
                    dp = tl.dot(do, vt, input_precision="ieee")
                    ds = tl.where(vis, p * (dp - delta[:, None]), 0.0)
                    # Leaf sums: 16 queries = the dots' K dim, position order.
                    pv = tl.dot(tl.trans(p), do, input_precision="ieee")
                    pk = tl.dot(tl.trans(ds), q.to(tl.float32), input_precision="ieee")
                tl.store(row + head * s_bh, pk, mask=in_chunk[:, None])
                tl.store(row + s_bw + head * s_bh, pv, mask=in_chunk[:, None])


def _pick(table, rows):
    return next(cfg for max_rows, cfg in table if rows <= max_rows)


def _check(q, k, v, out, lse, d_out, q_pos, kv_len) -> None:
    """ValueError unless the tensors form the forward's problem (kernels/triton_attention.py)."""
    check_cuda("attention backward", q, k, v, out, lse, d_out, q_pos, kv_len)
    s_, hq, tq, d = q.shape
    if (k.dim() != 4 or v.shape != k.shape or (k.shape[0], k.shape[3]) != (s_, d)
            or hq % k.shape[1]):
        raise ValueError(f"attention backward: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} do not form a GQA problem")
    if q.dtype not in _DQ_TILES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attention backward: q/k/v must share dtype float32 or bfloat16, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if d & (d - 1) or not 16 <= d <= 256:
        raise ValueError(f"attention backward: head_dim {d} must be a power of two in [16, 256]")
    g = hq // k.shape[1]
    if (out.shape != q.shape or d_out.shape != q.shape
            or tuple(lse.shape) != (s_, k.shape[1], g, tq) or lse.dtype != torch.float32):
        raise ValueError(f"attention backward: out {tuple(out.shape)}, d_out "
                         f"{tuple(d_out.shape)}, lse {tuple(lse.shape)} {lse.dtype} do not "
                         f"match q {tuple(q.shape)} (lse fp32 [S, Hkv, G, Tq])")
    if tuple(q_pos.shape) != (s_, tq) or tuple(kv_len.shape) != (s_,):
        raise ValueError(f"attention backward: q_pos {tuple(q_pos.shape)} / kv_len "
                         f"{tuple(kv_len.shape)} do not match S={s_}, Tq={tq}")


def _delta(out, d_out, q_pos) -> torch.Tensor:
    """delta [S, Hq, Tq] fp32 = Σ_d dO·O per query (module doc); 0 for padding slots."""
    s_, hq, tq, d = out.shape
    delta = torch.empty(s_, hq, tq, dtype=torch.float32, device=out.device)
    bm, warps = _DELTA_TILE
    _delta_kernel[(triton.cdiv(tq, bm), s_ * hq)](
        out, d_out, q_pos, delta, *out.stride(), *d_out.stride(), *q_pos.stride(),
        *delta.stride(), tq, hq, D=d, BLOCK_M=bm, num_warps=warps, enable_fp_fusion=False)
    return delta


def _dq(q, k, v, d_out, lse, delta, q_pos, kv_len, scale, tile) -> torch.Tensor:
    """dQ [S, Hq, Tq, D] fp32 (module doc, `_dq_kernel`)."""
    s_, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = hq // hkv
    dq = torch.empty(s_, hq, tq, d, dtype=torch.float32, device=q.device)
    bm, warps, stages = tile or _pick(_DQ_TILES[q.dtype], tq * g)
    n_tiles = triton.cdiv(tq * g, bm)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"   # precision applies to fp32 dots only
    _dq_kernel[(n_tiles, s_ * hkv)](
        q, k, v, d_out, lse, delta, dq, q_pos, kv_len,
        *q.stride(), *k.stride(), *v.stride(), *d_out.stride(), *lse.stride(), *delta.stride(),
        *dq.stride(), *q_pos.stride(), tq, tk, hkv, n_tiles, float(scale),
        G=g, D=d, BLOCK_M=bm, BLOCK_N=KV_BLOCK, PREC=prec,
        num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return dq


def slot_map(q_pos: torch.Tensor, n_leaves: int) -> torch.Tensor:
    """[S, 16·n_leaves + 1] int32: slot t of the query at absolute position p of sample s, or −1.

    q_pos [S, Tq] long (−1 = padding; positions of one sample distinct, < 16·n_leaves). The
    last column collects the padding slots and is never read. Lets a kernel read a leaf's
    queries in position order whatever the layout (CP subsets, chunks, decode rows)."""
    s_, tq = q_pos.shape
    width = n_leaves * TOKEN_LEAF
    slot = torch.full((s_, width + 1), -1, dtype=torch.int32, device=q_pos.device)
    at = torch.where(q_pos >= 0, q_pos, torch.full_like(q_pos, width))
    slots = torch.arange(tq, dtype=torch.int32, device=q_pos.device).expand(s_, tq)
    slot.scatter_(1, at, slots)
    slot[:, width] = -1
    return slot


def chunk_shape(s_: int, hq: int, d: int, tk_eff: int, acc_elems: int) -> tuple[int, int]:
    """(samples, keys) of one exact-accumulator chunk: keys a multiple of KV_BLOCK, at most
    `acc_elems` results [2, samples, hq, keys, d] unless one block of one sample exceeds it.
    Depends on shapes and the largest kv_len only (the same on every CP rank)."""
    per_key = 2 * hq * d
    keys = acc_elems // (s_ * per_key) // KV_BLOCK * KV_BLOCK
    if keys >= KV_BLOCK:
        return s_, min(keys, triton.cdiv(tk_eff, KV_BLOCK) * KV_BLOCK)
    return max(1, acc_elems // (KV_BLOCK * per_key)), KV_BLOCK


def peak_bytes(s_: int, hq: int, hkv: int, tq: int, tk: int, d: int, n_leaves: int,
               acc_elems: int = ACC_ELEMS, buf_elems: int = BUF_ELEMS, kv_ranks: int = 1) -> int:
    """Upper bound of `attention_backward`'s peak device memory beyond its inputs, in bytes (the
    module doc's formula; tk is the keys the chunks cover, kv_ranks the kv_comm size)."""
    sc, kc = chunk_shape(s_, hq, d, tk, acc_elems)
    c = 2 * sc * hq * kc * d
    rows = max(1, buf_elems // c)
    return (4 * s_ * hq * tq + 4 * s_ * (TOKEN_LEAF * n_leaves + 1) + 4 * s_ * hq * tq * d
            + 16 * s_ * hq * tk * d + 8 * s_ * hkv * tk * d * kv_ranks
            + 4 * rows * c + 6 * 104 * c)


def _launch_partials(q, k, v, d_out, lse, delta, slot, kv_len, scale, part, s0, j0, f0, f1,
                     tile) -> None:
    """Leaf partials of leaves [f0, f1) x keys [j0, j0 + width) of samples [s0, s0 + S_c) into
    part [f1 - f0, 2, S_c, Hq, width, D] fp32 (`_dkv_partials_kernel`)."""
    hq, d = q.shape[1], q.shape[3]
    hkv = k.shape[1]
    width = part.shape[4]
    bn, leaves, warps, stages = tile or _KV_TILES[q.dtype]
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(width, bn), part.shape[2] * hkv, triton.cdiv(f1 - f0, leaves))
    _dkv_partials_kernel[grid](
        q, k, v, d_out, lse, delta, slot, kv_len, part,
        *q.stride(), *k.stride(), *v.stride(), *d_out.stride(), *lse.stride(), *delta.stride(),
        *slot.stride(), *part.stride(), s0, j0, width, f0, f1, hkv, float(scale),
        G=hq // hkv, D=d, LEAF=TOKEN_LEAF, BLOCK_N=bn, LEAVES=leaves, PREC=prec,
        num_warps=warps, num_stages=stages, enable_fp_fusion=False)


def _dkv_per_head(q, k, v, d_out, lse, delta, q_pos, kv_len, scale, tok, n_leaves, tk_eff,
                  acc_elems, buf_elems, tile) -> torch.Tensor:
    """[2, S, Hq, Tk, D] fp32: per query head, Σ over queries of ds·q (0) and p·dO (1) by the
    token reduction (leaf partials, exact sum over leaves and `tok.comm`, rounded once)."""
    s_, hq, _, d = q.shape
    tk = k.shape[2]
    out = torch.zeros(2, s_, hq, tk, d, dtype=torch.float32, device=q.device)
    if tk_eff == 0:
        return out
    slot = slot_map(q_pos, n_leaves)
    sc, kc = chunk_shape(s_, hq, d, tk_eff, acc_elems)
    rows = max(1, buf_elems // (2 * sc * hq * kc * d))
    buf = torch.empty(rows * 2 * sc * hq * kc * d, dtype=torch.float32, device=q.device)
    for s0 in range(0, s_, sc):
        s1 = min(s_, s0 + sc)
        for j0 in range(0, tk_eff, kc):
            width = min(kc, tk_eff - j0)
            shape = (2, s1 - s0, hq, width, d)
            acc = fx.zeros(shape, q.device)
            # Leaves below j0 // 16 hold positions < j0 only: they see no key of this chunk.
            for f0 in range(j0 // TOKEN_LEAF, n_leaves, rows):
                f1 = min(n_leaves, f0 + rows)
                part = buf[:(f1 - f0) * acc[..., 0].numel()].view(f1 - f0, *shape)
                _launch_partials(q, k, v, d_out, lse, delta, slot, kv_len, scale, part,
                                 s0, j0, f0, f1, tile)
                fx.accumulate_(acc, part)
            out[:, s0:s1, :, j0:j0 + width] = tok.round_exact(acc, "token-sum-attention-dkv")
    return out


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, d_out: torch.Tensor, q_pos: torch.Tensor,
                       kv_len: torch.Tensor, scale: float, tok: TokenSum | None = None,
                       kv_comm: Comm | None = None, *, acc_elems: int = ACC_ELEMS,
                       buf_elems: int = BUF_ELEMS, dq_tile: tuple[int, int, int] | None = None,
                       kv_tile: tuple[int, int, int, int] | None = None):
    """(dQ, dK, dV) of invariant causal GQA attention on CUDA (module doc; FlashAttention-2 §3.1).

    q [S, Hq, Tq, D], k/v [S, Hkv, Tk, D]: one dtype, float32 or bfloat16, any strides; D a power
    of two in [16, 256]; out [S, Hq, Tq, D] and lse [S, Hkv, G, Tq] fp32 from
    triton_attention.attention_forward on the same inputs; d_out like out (any float dtype);
    q_pos [S, Tq] long (−1 = padding; a sample's positions distinct); kv_len [S] long; scale the
    forward's. tok: the token reduction's group (CP ranks holding the other queries; default one
    rank); kv_comm: the TP ranks replicating this KV head (kernels/attention.attention).
    acc_elems / buf_elems: chunk sizes (module doc; never change a bit); dq_tile / kv_tile
    override the tile tables (tests). Returns dQ like q, dK and dV like k, in q's dtype.
    ValueError on bad input. Syncs the host once (largest position and kv_len).
    """
    _check(q, k, v, out, lse, d_out, q_pos, kv_len)
    tok = tok or TokenSum.single()
    s_, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = hq // hkv
    if s_ == 0 or hq == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    lse_h = lse.reshape(s_, hq, tq)
    if tq:
        top_pos, top_len = torch.stack([q_pos.max(), kv_len.max()]).tolist()
    else:
        top_pos, top_len = -1, int(kv_len.max())
    n_leaves = max(0, top_pos) // TOKEN_LEAF + 1
    tk_eff = max(0, min(tk, top_len))
    with device_ctx(q):
        delta = _delta(out, d_out, q_pos) if tq else torch.zeros(s_, hq, 0, device=q.device)
        dq = _dq(q, k, v, d_out, lse_h, delta, q_pos, kv_len, scale, dq_tile) if tq \
            else torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = _dkv_per_head(q, k, v, d_out, lse_h, delta, q_pos, kv_len, scale, tok, n_leaves,
                            tk_eff, acc_elems, buf_elems, kv_tile)
    # The G heads of each group by the halving tree, as kernels/attention.py does: this rank's
    # equal part locally, then across the TP ranks replicating the KV head.
    dkv = tree_sum_halving(dkv.view(2, s_, hkv, g, tk, d), 3)
    dk, dv = dkv[0], dkv[1]
    if kv_comm is not None and kv_comm.size > 1:
        dv = kv_comm.tree_all_reduce(dv, "attention-kv-head-tree-dv")
        dk = kv_comm.tree_all_reduce(dk, "attention-kv-head-tree-dk")
    dk = dk * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
