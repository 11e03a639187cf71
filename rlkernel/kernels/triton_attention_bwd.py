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
  accumulator per element through them (`acc = dot(ds, k, acc)`), so dQ_t is a fixed chain
  over the keys the query sees, in key-block order (fp32: input_precision="ieee", one
  multiply-add per key, keys ascending; bf16: the tensor cores, whose per-element bits depend
  on the K order only). An invisible key inside a visited block adds ds = 0 times a finite key,
  which leaves the accumulator's bits unchanged (it starts at +0.0 and an add of ±0 can never
  make it −0.0), so which other rows share the tile — batch, padding, a CP rank's query subset,
  a chunked or decode layout — cannot change a bit. Keys at or past kv_len are never loaded (NaN
  there is harmless); keys below kv_len must be finite, as in the forward.
- `_dkv_kernel`: the token reduction over queries, with its exact sum inside. One program per
  (64-key tile, output columns, sample × query head) and per gradient (KIND: dK or dV). It walks
  the leaves (CUDA_DKV_LEAF = 64 absolute positions of one sample — a divisor of the packer's
  CUDA stream leaf, so a CP rank holds whole ones —, read through a position -> slot map)
  that can see the tile, in order; for each it forms the leaf partials Σ_{t in leaf} ds_tj·q_t
  (dK) or Σ_t p_tj·dO_t (dV) [64, D] as one dot over the leaf's queries (the dot's K dimension,
  position order), and adds them EXACTLY, in three tiers (every value is a multiple of 2**-149,
  so each tier's words are the exact sum unless its check fails): (1) a first pass into one
  float64 word hi per element whose every add must be exact (numerics/triton_fixedpoint.py
  `add_exact_or_nan`: s − hi == p and s − p == hi, else NaN; half the float64 work of a TwoSum
  pair, as in the dW pass); (2) the programs it flagged, again (a RETRY launch over the same
  grid, the others return at once: no host sync), into a double word (hi, lo) by Knuth's TwoSum
  with every lo addition checked exact (`add_word_checked`: a span of ~2**100); (3) a program
  still flagged (NaN/Inf, |hi| >= 2**150, a wider span) is recomputed in EMIT mode, its
  per-leaf partials stored and added by the exponent-bin accumulator. No per-leaf partial is
  written otherwise. An absent position is loaded as zeros and adds nothing (the same argument
  as above), so a leaf partial depends only on that leaf's queries: the same on every CP rank
  and in every layout. A (leaf, key tile) pair no query of the leaf sees is skipped (adds
  nothing). The host rounds each element's exact sum once: on one
  rank directly from the words (`fixedpoint.round_double_words`), otherwise through exact
  digits summed over `tok.comm` (the CP ranks holding the other leaves: integers, order-free;
  `TokenSum.round_exact`), the same bytes either way; then it sums the G heads of each group by
  `tree_sum_halving` and across `kv_comm` as the CPU path does, and multiplies dK by scale last. The bytes never depend on
  which programs took which path (the same exact sum of the same partials).

Precision. fp32 q/k/v: every dot is input_precision="ieee" (multiply-add chains in position or
key order). bf16 q/k/v (NUMERICS_VERSION 5): every dot
runs on the tensor cores with fp32 accumulation, as FlashAttention-2's backward does —
s = q·kᵀ (the forward's operands), dp = dO·vᵀ with dO rounded to bf16 (the output gradient's
rounding point), P (recomputed from lse, fp32) rounded to bf16 before P·dO (dV), and dS rounded to
bf16 before dS·k (dQ) and dSᵀ·q (dK); delta, exp, p, ds and every accumulation stay fp32, and
dQ, dK, dV are rounded to bf16 once at the end. The dK/dV kernel forms sᵀ = k·qᵀ with the keys as
rows (its tile), the dQ kernel s = q·kᵀ with the queries as rows; both are per-element functions
of the same operands in one fixed D order, so neither depends on the layout.

Chunking (why memory is O(L), never O(L²)): a chunk holds at most `words_elems` results
[samples, Hq, keys, D] of one gradient — whole samples with every key block when one sample's
fit (`chunk_shape`), else every sample and fewer whole 64-key blocks, else one block of fewer
samples; its double words (16 bytes per result) are rounded, through digits DIGIT_ELEMS results
at a time when other ranks' sums are to be added. Chunks of whole samples whose blocks reach Tk
(the training case) are rounded straight into their rows of the result, the key slots at or
past a sample's kv_len computed as +0.0 by the kernel; other chunks are copied into a zeroed
result. The chunk cut depends on (S, Hq, D, Tk, the largest kv_len) only, so every CP rank runs
the same collectives.
Peak device memory beyond the inputs, out, lse and d_out, an upper bound (`peak_bytes`; bytes;
c = S_c·Hq·K_c·D <= words_elems unless one 64-key block of one sample exceeds it):
    4·S·Hq·Tq (delta) + 4·S·(64·n_leaves + 1) (slot map) + 4·S·Hq·Tq·D (dQ, fp32)
  + 8·S·Hq·Tk·D (per-head dK, dV) + 8·S·Hq·Tk·D (head-tree levels) + 8·S·Hkv·Tk·D (dK·scale,
    and the kv_comm gather's copies when TP replicates the KV head: ×kv_comm.size)
  + 32·c (double words of both kinds) + 4·c (a chunk's fp32 result)
  + 6·104·min(c, DIGIT_ELEMS) (digits, the comm's copy, round_fp32's temporaries)
  + EMIT_BYTES (the fallback's partials, if any)
For one 32k-token sample with 4 query heads, 1 KV head, D = 128 the bound is 2.4 GiB (it counts
the digits and the fallback, which one rank with no flagged program never allocates); measured on
an H200: 0.56 GiB with one kind's words held (before the second words buffer: 256 MiB more now),
where one fp32 [Tq, Tk] score matrix alone is 4 GiB (tests/test_cuda_attention_bwd.py measures it).
Cost: the exact additions, 2·Hq·D per (leaf, key a leaf sees) ≈ Hq·D·L²/64 checked float64
adds for a causal sample of L tokens (a retried program pays its TwoSum pairs on top), bound the
dK/dV kernel (float64 units); the dots are the tensor cores' (bf16) or the CUDA cores' (fp32).
Kernels launch with enable_fp_fusion=False, as the forward does: no mul+add is contracted
differently between kernels or tiles (and TwoSum stays exact). Tiles come from literal tables;
none changes a bit on the GPU (tests/test_cuda_attention_bwd.py checks every row).
Packed streams (`attention_backward_packed`, the backward of
triton_attention.attention_forward_packed): q, out, dO are token streams [Lq, Hq, D] and k, v
[Lk, Hkv, D] whose sample s starts at row q_rows[s] / k_rows[s] (`sample_base`); the three
kernels read those rows in place and dQ is stored into a zeroed stream at the live rows only
(an empty slot's row belongs to another sample). dK and dV leave the head tree per sample
[S, Hkv, Tk, D] and are rounded and scattered to their rows (the one copy left of the
per-sample path's gathers and scatters). Same operations on the same values: the same bytes.
Does not: run on CPU tensors (kernels/attention.py's torch code is the reference there; under
TRITON_INTERPRET=1 these kernels run on CPU tensors for tests/test_attention_bwd_triton.py),
communicate other than through `tok.comm` / `kv_comm`, or take fp16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.distributed.comm import Comm
from rlkernel.distributed.tokensum import TokenSum, words_finished
from rlkernel.kernels.attention import check_packed, key_slot_map
from rlkernel.kernels.slots import scatter_slots, slot_moves
from rlkernel.kernels.triton_attention import query_rows, sample_base, stream_strides
from rlkernel.kernels.triton_util import INTERPRET, check_cuda, device_ctx, launch
from rlkernel.numerics import fixedpoint as fx
from rlkernel.numerics import triton_fixedpoint as tfx
from rlkernel.numerics.trees import tree_sum_halving
from rlkernel.spec import CUDA_ATTN_KV_BLOCK, CUDA_DKV_LEAF

KV_BLOCK = CUDA_ATTN_KV_BLOCK
"""The forward's absolute key block (64): dQ walks these blocks in order; key chunks are whole blocks."""
WORDS_ELEMS = 1 << 24
"""dK or dV results per chunk: their float64 double words take 16 bytes each (256 MiB; both
kinds' words are held at once: 512 MiB)."""
DIGIT_ELEMS = 1 << 21
"""Results turned into exact digits (104 bytes each: 208 MiB) and rounded per step."""
_DIGIT_BLOCK = 4096 if INTERPRET else tfx.BLOCK
"""Lanes per program of the digit conversion (speed only): the CPU interpreter pays per program."""
EMIT_BYTES = 1 << 28
"""Bound on the per-leaf partials of the flagged programs redone at once (256 MiB)."""

# dtype -> [(max rows Tq·G, (BLOCK_M, num_warps, num_stages)), ...] of the dQ kernel; first fit.
# bf16 keeps BLOCK_M >= 64 and warps % 4 == 0 like the forward (its s dot is the forward's).
_DQ_TILES = {
    torch.float32: [(16, (16, 4, 1)), (1 << 62, (32, 8, 1))],
    torch.bfloat16: [(1 << 62, (64, 4, 1))],   # 4 warps: -12 % of the backward at 4,096 tokens
}
# dtype -> (BLOCK_N keys, D_TILE output columns per program, num_warps, num_stages) of dK/dV.
# BLOCK_N: any power of two (a tile past a chunk's width computes keys it does not store).
# bf16: 4 warps since the first pass keeps one float64 word (4,096 tokens, 32/8 heads on an
# H200: 4.55 ms against 6.47 at 8 warps; 128-key tiles at 8 warps 4.56 against 3.92,
# docs/BENCHMARKS.md); every tile gives the same bytes.
_KV_TILES = {torch.float32: (64, 128, 8, 1), torch.bfloat16: (64, 128, 4, 1)}
_DELTA_TILE = (32, 4)   # (BLOCK_M rows, num_warps)


@triton.jit
def _delta_kernel(O, DO, QPOS, DELTA, QROWS, s_os, s_oh, s_ot, s_od, s_gs, s_gh, s_gt, s_gd,
                  s_ps, s_pt, s_es, s_eh, s_et, Tq, HQ,
                  D: tl.constexpr, BLOCK_M: tl.constexpr, PACKED: tl.constexpr):
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
    o = tl.load(O + sample_base(QROWS, s, s_os, PACKED) + h * s_oh + tt * s_ot + dd[None, :] * s_od,
                mask=live[:, None], other=0.0).to(tl.float32)
    # dO at its rounding point (the output's dtype, q's), as the other kernels read it.
    do = tl.load(DO + sample_base(QROWS, s, s_gs, PACKED) + h * s_gh + tt * s_gt
                 + dd[None, :] * s_gd,
                 mask=live[:, None], other=0.0).to(O.dtype.element_ty).to(tl.float32)
    ones = tl.full((D, 16), 1.0, dtype=tl.float32)
    delta = tl.max(tl.dot(o * do, ones, input_precision="ieee"), 1)   # 16 equal columns
    tl.store(DELTA + s * s_es + h * s_eh + t.to(tl.int64) * s_et, delta, mask=t < Tq)


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, QPOS, KVLEN, QROWS, KROWS,
               s_qs, s_qh, s_qt, s_qd, s_ks, s_kh, s_kt, s_kd, s_vs, s_vh, s_vt, s_vd,
               s_gs, s_gh, s_gt, s_gd, s_ls, s_lh, s_lt, s_es, s_eh, s_et,
               s_os, s_oh, s_ot, s_od, s_ps, s_pt,
               Tq, Tk, HKV, n_tiles, scale,
               G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, PREC: tl.constexpr, BF16: tl.constexpr,
               PACKED: tl.constexpr):
    # PACKED: Q, DO, DQ token streams [Lq, Hq, D] and K, V [Lk, Hkv, D], sample s from rows
    # QROWS[s] / KROWS[s] (the forward's `sample_base`): only addresses differ.
    s, hk, t, g, row_ok, pos, kvl, _, hi = query_rows(QPOS, KVLEN, s_ps, s_pt, Tq, Tk, HKV,
                                                      n_tiles, G, BLOCK_M)
    head = (hk * G + g).to(tl.int64)
    live = row_ok & (pos >= 0)
    dd = tl.arange(0, D)
    tt = t.to(tl.int64)
    # Padding slots are not read (zeros): no NaN garbage enters the dots. dO in q's dtype: the
    # bf16 rounding point of the output's gradient (exact for fp32).
    q = tl.load(Q + sample_base(QROWS, s, s_qs, PACKED) + head[:, None] * s_qh
                + tt[:, None] * s_qt + dd[None, :] * s_qd, mask=live[:, None], other=0.0)
    do = tl.load(DO + sample_base(QROWS, s, s_gs, PACKED) + head[:, None] * s_gh
                 + tt[:, None] * s_gt + dd[None, :] * s_gd,
                 mask=live[:, None], other=0.0).to(Q.dtype.element_ty)
    lse = tl.load(LSE + s * s_ls + head * s_lh + tt * s_lt, mask=live, other=0.0)
    delta = tl.load(DELTA + s * s_es + head * s_eh + tt * s_et, mask=live, other=0.0)
    kbase = K + sample_base(KROWS, s, s_ks, PACKED) + hk.to(tl.int64) * s_kh
    vbase = V + sample_base(KROWS, s, s_vs, PACKED) + hk.to(tl.int64) * s_vh
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for j0 in range(0, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        k_ok = j < kvl
        jj = j.to(tl.int64)
        kt = tl.load(kbase + jj[None, :] * s_kt + dd[:, None] * s_kd,
                     mask=k_ok[None, :], other=0.0)                            # [D, BN]
        vt = tl.load(vbase + jj[None, :] * s_vt + dd[:, None] * s_vd,
                     mask=k_ok[None, :], other=0.0)                            # [D, BN]
        qk = tl.dot(q, kt, input_precision=PREC)                               # the forward's
        vis = (j[None, :] <= pos[:, None]) & k_ok[None, :]
        p = tl.where(vis, tl.exp(qk * scale - lse[:, None]), 0.0)
        dp = tl.dot(do, vt, input_precision=PREC)
        ds = tl.where(vis, p * (dp - delta[:, None]), 0.0)
        if BF16:
            # dS rounded to bf16 (a rounding point): the tensor cores continue the fp32 chain.
            acc = tl.dot(ds.to(tl.bfloat16), tl.trans(kt), acc)
        else:
            acc = tl.dot(ds, tl.trans(kt), acc, input_precision="ieee")
    dq = tl.where(live[:, None], acc * scale, 0.0)
    # A stream's empty slots are not its rows: left as the caller's zeros (forward's o_ok).
    dq_ok = live if PACKED else row_ok
    tl.store(DQ + sample_base(QROWS, s, s_os, PACKED) + head[:, None] * s_oh
             + tt[:, None] * s_ot + dd[None, :] * s_od, dq.to(DQ.dtype.element_ty),
             mask=dq_ok[:, None])


@triton.jit
def _dkv_kernel(Q, K, V, DO, LSE, DELTA, SLOT, KVLEN, OUT, FLAGS, PIDS, QROWS, KROWS,
                s_qs, s_qh, s_qt, s_qd, s_ks, s_kh, s_kt, s_kd, s_vs, s_vh, s_vt, s_vd,
                s_gs, s_gh, s_gt, s_gd, s_ls, s_lh, s_lt, s_es, s_eh, s_et, s_ms, s_mp,
                s_ow, s0, j0, width, n_tiles_k, n_leaves, HQ, scale,
                G: tl.constexpr, D: tl.constexpr, DT: tl.constexpr, LEAF: tl.constexpr,
                BLOCK_N: tl.constexpr, KIND: tl.constexpr, PREC: tl.constexpr,
                BF16: tl.constexpr, EMIT: tl.constexpr, RETRY: tl.constexpr,
                FORCE_FLAG: tl.constexpr, PACKED: tl.constexpr):
    # One program: BLOCK_N keys [jt, jt + BLOCK_N) x output columns [d0, d0 + DT) of one query
    # head h of sample s; KIND 0 = dK (Σ_t ds·q), 1 = dV (Σ_t p·dO), over every leaf that sees
    # the keys. First pass (neither EMIT nor RETRY): the leaf partials are added into a float64
    # word hi that must stay exact (tfx.add_exact_or_nan: an inexact add makes it NaN); OUT
    # [2, S_c, Hq, width, D] gets (hi, 0), FLAGS[pid] whether it did not hold (then zeros).
    # RETRY (launched over every program; the unflagged return at once): the flagged programs
    # again, into the double word (hi, lo) by checked TwoSums (tfx.add_word_checked, exact over
    # a spread of ~2**100), rewriting their words and flags. EMIT (programs PIDS[i] still
    # flagged): OUT [n_leaves, n, BLOCK_N, DT] fp32 gets each leaf's partial at row f.
    i = tl.program_id(0)
    if EMIT:
        pid = tl.load(PIDS + i)
    else:
        pid = i
    if RETRY:
        if tl.load(FLAGS + pid) == 0:
            return
    n_dt: tl.constexpr = D // DT
    tile = pid % n_tiles_k
    rest = pid // n_tiles_k
    dt = rest % n_dt
    sh = rest // n_dt
    h = sh % HQ
    s = (s0 + sh // HQ).to(tl.int64)
    head = h.to(tl.int64)
    hk = (h // G).to(tl.int64)
    jt = j0 + tile * BLOCK_N                       # absolute first key of this tile
    jn = jt + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, D)
    do_ = dt * DT + tl.arange(0, DT)               # output columns
    ii = tl.arange(0, LEAF)
    kvl = tl.load(KVLEN + s).to(tl.int32)
    k_ok = jn < kvl
    jj = jn.to(tl.int64)
    # PACKED: Q, DO token streams [Lq, Hq, D] and K, V [Lk, Hkv, D] (`_dq_kernel`).
    qs0 = sample_base(QROWS, s, s_qs, PACKED)
    gs0 = sample_base(QROWS, s, s_gs, PACKED)
    kb = tl.load(K + sample_base(KROWS, s, s_ks, PACKED) + hk * s_kh + jj[:, None] * s_kt
                 + dd[None, :] * s_kd, mask=k_ok[:, None], other=0.0)          # [BN, D]
    if KIND == 0:
        vb = tl.load(V + sample_base(KROWS, s, s_vs, PACKED) + hk * s_vh + jj[:, None] * s_vt
                     + dd[None, :] * s_vd, mask=k_ok[:, None], other=0.0)      # [BN, D]
    hi = tl.zeros((BLOCK_N, DT), dtype=tl.float64)
    if RETRY:
        lo = tl.zeros((BLOCK_N, DT), dtype=tl.float64)
        n_inexact = tl.zeros((BLOCK_N, DT), dtype=tl.int32)
    e_ptr = OUT + i * (BLOCK_N * DT) + tl.arange(0, BLOCK_N)[:, None] * DT \
        + tl.arange(0, DT)[None, :]
    e_step = tl.zeros([], dtype=tl.int64) + s_ow          # int64: n_leaves·stride may pass 2**31
    # Leaves below jt // LEAF hold positions < jt only: they see no key of the tile.
    for f in range(jt // LEAF, n_leaves):
        p_abs = f * LEAF + ii                                                  # positions
        slot = tl.load(SLOT + s * s_ms + p_abs.to(tl.int64) * s_mp)
        here = slot >= 0
        tq = tl.where(here, slot, 0).to(tl.int64)
        # The pair is live iff some query of the leaf sees a key of the tile.
        seen = tl.max(tl.where(here, tl.minimum(p_abs, kvl - 1), -1), 0)
        if jt <= seen:
            q = tl.load(Q + qs0 + head * s_qh + tq[:, None] * s_qt + dd[None, :] * s_qd,
                        mask=here[:, None], other=0.0)                         # [LEAF, D]
            lse = tl.load(LSE + s * s_ls + head * s_lh + tq * s_lt, mask=here, other=0.0)
            st = tl.dot(kb, tl.trans(q), input_precision=PREC)                 # [BN, LEAF]
            vis = here[None, :] & (jn[:, None] <= p_abs[None, :]) & k_ok[:, None]
            pt = tl.where(vis, tl.exp(st * scale - lse[None, :]), 0.0)
            if KIND == 1:
                dov = tl.load(DO + gs0 + head * s_gh + tq[:, None] * s_gt
                              + do_[None, :] * s_gd, mask=here[:, None],
                              other=0.0).to(Q.dtype.element_ty)                # [LEAF, DT]
                # Leaf sums: the LEAF queries are the dot's K dim, in position order.
                if BF16:
                    part = tl.dot(pt.to(tl.bfloat16), dov)
                else:
                    part = tl.dot(pt, dov, input_precision="ieee")
            else:
                do = tl.load(DO + gs0 + head * s_gh + tq[:, None] * s_gt
                             + dd[None, :] * s_gd, mask=here[:, None],
                             other=0.0).to(Q.dtype.element_ty)                 # [LEAF, D]
                delta = tl.load(DELTA + s * s_es + head * s_eh + tq * s_et, mask=here,
                                other=0.0)
                dpt = tl.dot(vb, tl.trans(do), input_precision=PREC)           # [BN, LEAF]
                dst = tl.where(vis, pt * (dpt - delta[None, :]), 0.0)
                if DT == D:
                    qo = q
                else:
                    qo = tl.load(Q + qs0 + head * s_qh + tq[:, None] * s_qt
                                 + do_[None, :] * s_qd, mask=here[:, None], other=0.0)
                if BF16:
                    part = tl.dot(dst.to(tl.bfloat16), qo)
                else:
                    part = tl.dot(dst, qo, input_precision="ieee")
            if EMIT:
                tl.store(e_ptr + f * e_step, part)
            elif RETRY:
                hi, lo, n_inexact = tfx.add_word_checked(hi, lo, n_inexact, part.to(tl.float64))
            else:
                hi = tfx.add_exact_or_nan(hi, part.to(tl.float64))
    if not EMIT:
        if RETRY:
            bad = (tfx.words_exact(hi, n_inexact) == 0).to(tl.int32)
        else:
            bad = (tfx.word_in_range(hi) == 0).to(tl.int32)
        good = (tl.max(bad) == 0) & (FORCE_FLAG == 0)
        o = OUT + (sh.to(tl.int64) * width + (jn - j0).to(tl.int64))[:, None] * D \
            + do_[None, :].to(tl.int64)
        m = ((jn - j0) < width)[:, None] & (do_[None, :] < D)
        tl.store(o, tl.where(good, hi, 0.0), mask=m)
        if RETRY:
            tl.store(o + s_ow, tl.where(good, lo, 0.0), mask=m)
        else:
            tl.store(o + s_ow, tl.zeros((BLOCK_N, DT), dtype=tl.float64), mask=m)
        tl.store(FLAGS + pid, (good == 0).to(tl.int32))


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
    _check_dtypes(q, k, v, d)
    g = hq // k.shape[1]
    if (out.shape != q.shape or d_out.shape != q.shape
            or tuple(lse.shape) != (s_, k.shape[1], g, tq) or lse.dtype != torch.float32):
        raise ValueError(f"attention backward: out {tuple(out.shape)}, d_out "
                         f"{tuple(d_out.shape)}, lse {tuple(lse.shape)} {lse.dtype} do not "
                         f"match q {tuple(q.shape)} (lse fp32 [S, Hkv, G, Tq])")
    if tuple(q_pos.shape) != (s_, tq) or tuple(kv_len.shape) != (s_,):
        raise ValueError(f"attention backward: q_pos {tuple(q_pos.shape)} / kv_len "
                         f"{tuple(kv_len.shape)} do not match S={s_}, Tq={tq}")


def _strides(x: torch.Tensor, rows) -> tuple[int, ...]:
    """The kernels' (sample, head, slot, dim) strides of x: its own [S, H, T, D] ones, or a
    packed stream's [L, H, D] (rows given: triton_attention.stream_strides)."""
    return x.stride() if rows is None else stream_strides(x)


def _rows_args(rows, q_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The QROWS / KROWS pointers: the packed streams' first rows, or any tensor (unread)."""
    return rows if rows is not None else (q_pos, q_pos)


def _check_dtypes(q, k, v, d: int) -> None:
    if q.dtype not in _DQ_TILES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attention backward: q/k/v must share dtype float32 or bfloat16, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if d & (d - 1) or not 16 <= d <= 256:
        raise ValueError(f"attention backward: head_dim {d} must be a power of two in [16, 256]")


def _delta(out, d_out, q_pos, rows=None) -> torch.Tensor:
    """delta [S, Hq, Tq] fp32 = Σ_d dO·O per query (module doc); 0 for padding slots. rows:
    (q_rows, k_rows) when out and d_out are packed streams [Lq, Hq, D]."""
    s_, tq = q_pos.shape
    hq, d = out.shape[1], out.shape[-1]          # [S, Hq, Tq, D] or a stream [Lq, Hq, D]
    delta = torch.empty(s_, hq, tq, dtype=torch.float32, device=out.device)
    bm, warps = _DELTA_TILE
    launch(_delta_kernel, (triton.cdiv(tq, bm), s_ * hq),
           out, d_out, q_pos, delta, _rows_args(rows, q_pos)[0], *_strides(out, rows),
           *_strides(d_out, rows), *q_pos.stride(), *delta.stride(), tq, hq, D=d, BLOCK_M=bm,
           PACKED=rows is not None, num_warps=warps, enable_fp_fusion=False)
    return delta


def _dq(q, k, v, d_out, lse, delta, q_pos, kv_len, scale, tile,
        dtype: torch.dtype = torch.float32, rows=None, tk: int = 0) -> torch.Tensor:
    """dQ [S, Hq, Tq, D] (module doc, `_dq_kernel`) in `dtype` and q's memory order: the fp32
    result, or its rounding to bf16 done by the kernel's store (round to nearest even, as
    torch's cast: the same bytes without an fp32 copy). rows = (q_rows, k_rows): q, d_out
    [Lq, Hq, D] and k, v [Lk, Hkv, D] are packed streams of tk key slots; dQ is then a stream
    [Lq, Hq, D], +0.0 in rows no query slot names."""
    s_, hq, tq, d, hkv, tk = _dims(q, k, q_pos, rows, tk)
    g = hq // hkv
    dq = torch.empty_like(q, dtype=dtype) if rows is None else torch.zeros_like(q, dtype=dtype)
    bm, warps, stages = tile or _pick(_DQ_TILES[q.dtype], tq * g)
    n_tiles = triton.cdiv(tq * g, bm)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"   # precision applies to fp32 dots only
    launch(_dq_kernel, (n_tiles, s_ * hkv),
           q, k, v, d_out, lse, delta, dq, q_pos, kv_len, *_rows_args(rows, q_pos),
           *_strides(q, rows), *_strides(k, rows), *_strides(v, rows), *_strides(d_out, rows),
           *lse.stride(), *delta.stride(), *_strides(dq, rows), *q_pos.stride(), tq, tk, hkv,
           n_tiles, float(scale), G=g, D=d, BLOCK_M=bm, BLOCK_N=KV_BLOCK, PREC=prec,
           BF16=q.dtype == torch.bfloat16, PACKED=rows is not None, num_warps=warps,
           num_stages=stages, enable_fp_fusion=False)
    return dq


def _dims(q, k, q_pos, rows, tk: int) -> tuple[int, int, int, int, int, int]:
    """(S, Hq, Tq, D, Hkv, Tk) of the per-sample problem: from q [S, Hq, Tq, D] and k
    [S, Hkv, Tk, D], or from packed streams q [Lq, Hq, D], k [Lk, Hkv, D], q_pos [S, Tq] and
    the key slots tk (rows given)."""
    if rows is None:
        return (*q.shape, k.shape[1], k.shape[2])
    return q_pos.shape[0], q.shape[1], q_pos.shape[1], q.shape[2], k.shape[1], tk


def slot_map(q_pos: torch.Tensor, n_leaves: int) -> torch.Tensor:
    """[S, LEAF·n_leaves + 1] int32 (LEAF = CUDA_DKV_LEAF): slot t of the query at absolute
    position p of sample s, or −1.

    q_pos [S, Tq] long (−1 = padding; positions of one sample distinct, < LEAF·n_leaves). The
    last column collects the padding slots and is never read. Lets a kernel read a leaf's
    queries in position order whatever the layout (CP subsets, chunks, decode rows)."""
    s_, tq = q_pos.shape
    width = n_leaves * CUDA_DKV_LEAF
    slot = torch.full((s_, width + 1), -1, dtype=torch.int32, device=q_pos.device)
    at = torch.where(q_pos >= 0, q_pos, torch.full_like(q_pos, width))
    slots = torch.arange(tq, dtype=torch.int32, device=q_pos.device).expand(s_, tq)
    slot.scatter_(1, at, slots)
    slot[:, width] = -1
    return slot


def chunk_shape(s_: int, hq: int, d: int, tk_eff: int, words_elems: int) -> tuple[int, int]:
    """(samples, keys) of one chunk of the dK or dV double words, at most `words_elems` results
    [samples, hq, keys, d] unless one 64-key block of one sample exceeds it: every key block
    (up to tk_eff) of as many samples as fit — so a chunk's results are whole rows of the
    per-head result and are rounded straight into it —, else every sample and keys a multiple
    of KV_BLOCK, else one block of as many samples as fit. Depends on shapes and the largest
    kv_len only (the same on every CP rank)."""
    per_key = hq * d
    keys_all = triton.cdiv(tk_eff, KV_BLOCK) * KV_BLOCK
    if keys_all * per_key <= words_elems:
        return min(s_, words_elems // (keys_all * per_key)), keys_all
    keys = words_elems // (s_ * per_key) // KV_BLOCK * KV_BLOCK
    if keys >= KV_BLOCK:
        return s_, keys
    return max(1, words_elems // (KV_BLOCK * per_key)), KV_BLOCK


def peak_bytes(s_: int, hq: int, hkv: int, tq: int, tk: int, d: int, n_leaves: int,
               words_elems: int = WORDS_ELEMS, kv_ranks: int = 1) -> int:
    """Upper bound of `attention_backward`'s peak device memory beyond its inputs, in bytes (the
    module doc's formula; tk is the keys the chunks cover, kv_ranks the kv_comm size)."""
    sc, kc = chunk_shape(s_, hq, d, tk, words_elems)
    c = sc * hq * kc * d
    return (4 * s_ * hq * tq + 4 * s_ * (CUDA_DKV_LEAF * n_leaves + 1) + 4 * s_ * hq * tq * d
            + 16 * s_ * hq * tk * d + 8 * s_ * hkv * tk * d * kv_ranks
            + 32 * c + 4 * c + 6 * 104 * min(c, DIGIT_ELEMS) + EMIT_BYTES)


def _kv_tile(dtype: torch.dtype, d: int, tile) -> tuple[int, int, int, int]:
    bn, dt, warps, stages = tile or _KV_TILES[dtype]
    return bn, min(dt, d), warps, stages


def _launch_dkv(args, out, flags, pids, kind: int, s0: int, j0: int, width: int, n_tiles_k: int,
                n_leaves: int, grid: int, tile, emit: bool, force_flag: bool,
                retry: bool = False) -> None:
    """One `_dkv_kernel` launch of `grid` programs (module doc): the first pass, its `retry`
    (over the same grid, flags and words) or `emit`; args = (q, k, v, d_out, lse_h, delta,
    slot, kv_len, scale, rows) (rows: `_dq`'s)."""
    q, k, v, d_out, lse_h, delta, slot, kv_len, scale, rows = args
    hq, d = lse_h.shape[1], q.shape[-1]
    bn, dt, warps, stages = tile
    prec = "ieee" if q.dtype == torch.float32 else "tf32"   # precision applies to fp32 dots only
    s_ow = out.stride(0)
    launch(_dkv_kernel, (grid,),
           q, k, v, d_out, lse_h, delta, slot, kv_len, out, flags, pids, *_rows_args(rows, slot),
           *_strides(q, rows), *_strides(k, rows), *_strides(v, rows), *_strides(d_out, rows),
           *lse_h.stride(), *delta.stride(), *slot.stride(), s_ow, s0, j0, width, n_tiles_k,
           n_leaves, hq, float(scale), G=hq // k.shape[1], D=d, DT=dt, LEAF=CUDA_DKV_LEAF,
           BLOCK_N=bn, KIND=kind, PREC=prec, BF16=q.dtype == torch.bfloat16, EMIT=emit, RETRY=retry,
           FORCE_FLAG=int(force_flag), PACKED=rows is not None, num_warps=warps, num_stages=stages,
           enable_fp_fusion=False)


def _program_rows(pids: torch.Tensor, n_tiles_k: int, n_dt: int, bn: int, dt: int, width: int,
                  d: int) -> torch.Tensor:
    """[n, bn, dt] long: the flat element of [S_c·Hq, width, D] each (key, column) of programs
    `pids` covers, or −1 past the chunk's width."""
    tile = pids % n_tiles_k
    rest = pids // n_tiles_k
    col0 = (rest % n_dt) * dt
    sh = rest // n_dt
    key = tile[:, None] * bn + torch.arange(bn, device=pids.device)          # [n, bn]
    flat = (sh[:, None, None] * width + key[:, :, None]) * d \
        + col0[:, None, None] + torch.arange(dt, device=pids.device)
    return torch.where((key < width)[:, :, None], flat, torch.full_like(flat, -1))


def _redo_flagged(args, flagged: torch.Tensor, kind: int, s0: int, j0: int, width: int,
                  n_tiles_k: int, n_leaves: int, tile) -> tuple[torch.Tensor, ...]:
    """Exact digits of the programs whose TwoSum check failed: each one's per-leaf partials
    (the same dots, EMIT mode) added by the bin accumulator. Returns (flat element indices [m],
    digits [m, N_COLS]) of their elements inside the chunk."""
    q = args[0]
    bn, dt, _, _ = tile
    d = q.shape[-1]
    per = max(1, EMIT_BYTES // (4 * max(1, n_leaves) * bn * dt))
    idx_all, dig_all = [], []
    for a in range(0, flagged.numel(), per):
        ids = flagged[a:a + per].to(torch.int32).contiguous()
        scratch = torch.zeros(max(1, n_leaves), ids.numel(), bn, dt, dtype=torch.float32,
                              device=q.device)
        _launch_dkv(args, scratch, ids, ids, kind, s0, j0, width, n_tiles_k, n_leaves,
                    ids.numel(), tile, True, False)
        rows = _program_rows(ids.long(), n_tiles_k, d // dt, bn, dt, width, d).reshape(-1)
        dig = fx.accumulate_(fx.zeros((rows.numel(),), q.device),
                             scratch.view(scratch.shape[0], -1))
        live = rows >= 0
        idx_all.append(rows[live])
        dig_all.append(dig[live])
    return torch.cat(idx_all), torch.cat(dig_all)


def _words_to_fp32(words: torch.Tensor, fix, tok: TokenSum, op: str,
                   out: torch.Tensor | None = None, as_words: bool = False) -> torch.Tensor:
    """[m] fp32 (written into `out`, a contiguous fp32 [m], if given): per element the exact sum
    hi + lo of `words` [2, m] (plus, for the flat indices of `fix` = (indices, digits) or None,
    those digits), summed over `tok.comm` and rounded once.
    Over several ranks (or with a fix) in slices of DIGIT_ELEMS elements (the cut depends on m
    only: every rank of the group makes the same collective calls): with `as_words` (a late
    sink's pass, where no rank has a fix: every rank passes the same) the slices are summed as
    words (`tokensum.words_finished`: 16 bytes an element sent, the digits made by the rank
    that rounds them), else through the exact digits; on one rank without a fix,
    `fixedpoint.round_double_words`. The same bytes every way."""
    m = words.shape[1]
    if fix is None and tok.comm.size == 1:
        # One rank holds every query: no integer all-reduce, so the words are rounded directly
        # (round-to-odd, then RN: the bytes of the digit path, without its 104-byte digits).
        return fx.round_double_words(words, out=out)
    if out is None:
        out = torch.empty(m, dtype=torch.float32, device=words.device)
    for a in range(0, m, DIGIT_ELEMS):
        b = min(m, a + DIGIT_ELEMS)
        if as_words and fix is None:
            out[a:b] = words_finished(tok.comm, words[:, a:b], op)
            continue
        acc = tfx.add_double_words_(fx.zeros((b - a,), words.device), words[:, a:b],
                                    block=_DIGIT_BLOCK)
        if fix is not None:
            idx, dig = fix
            sel = (idx >= a) & (idx < b)
            acc.index_add_(0, idx[sel] - a, dig[sel])      # integer digits: exact
        out[a:b] = tok.round_exact(acc, op)
    return out


def _dkv_per_head(q, k, v, d_out, lse, delta, q_pos, kv_len, scale, tok, n_leaves, tk_eff,
                  words_elems, tile, force_flag=False, rows=None, tk: int = 0) -> torch.Tensor:
    """[2, S, Hq, Tk, D] fp32: per query head, Σ over queries of ds·q (0) and p·dO (1) by the
    token reduction (leaf partials added exactly inside `_dkv_kernel`, summed over `tok.comm`,
    rounded once). rows, tk: `_dq`'s (packed streams in, the per-sample result out)."""
    s_, hq, _, d, _, tk = _dims(q, k, q_pos, rows, tk)
    if tk_eff == 0:
        return torch.zeros(2, s_, hq, tk, d, dtype=torch.float32, device=q.device)
    tile = _kv_tile(q.dtype, d, tile)
    bn, dt = tile[0], tile[1]
    args = (q, k, v, d_out, lse, delta, slot_map(q_pos, n_leaves), kv_len, scale, rows)
    sc, kc = chunk_shape(s_, hq, d, tk_eff, words_elems)
    # Chunks of whole samples whose keys cover every slot (tk_eff rounded up to a block reaches
    # Tk: the usual training case) round straight into their rows of out — no zero fill, no
    # copy; slots at or past a sample's kv_len get +0.0 from the kernel itself.
    direct = kc >= tk
    span = tk if direct else tk_eff
    out = (torch.empty if direct else torch.zeros)(2, s_, hq, tk, d, dtype=torch.float32,
                                                   device=q.device)
    # Both kinds' words at once, so one host sync per chunk reads both kinds' flags — or none:
    # with a late sink the count of third-tier programs is left on the device for the caller's
    # one check after the mini-batch (GradSink "Late activation flags"), which runs it again if
    # any is counted; the words of such a program are then not its exact sum.
    late = tok.late_counter(q.device)
    words = torch.empty(2, 2, sc * hq * min(kc, span) * d, dtype=torch.float64, device=q.device)
    for s0 in range(0, s_, sc):
        s1 = min(s_, s0 + sc)
        for j0 in range(0, span, kc):
            width = min(kc, span - j0)
            n_tiles_k = triton.cdiv(width, bn)
            grid = n_tiles_k * (d // dt) * (s1 - s0) * hq
            w = words[:, :, :(s1 - s0) * hq * width * d]
            flags = torch.empty(2, grid, dtype=torch.int32, device=q.device)
            for kind in (0, 1):
                for retry in (False, True):   # the checked tier for what the first pass flagged
                    _launch_dkv(args, w[kind], flags[kind], flags[kind], kind, s0, j0, width,
                                n_tiles_k, n_leaves, grid, tile, False, force_flag, retry)
            if late is not None:
                late.add_(torch.count_nonzero(flags))
                flagged = None
            else:
                flagged = torch.nonzero(flags)      # [n, 2] (kind, program): the chunk's one sync
            for kind in (0, 1):
                fix = None
                if flagged is not None and flagged.numel():   # rare: split the programs by kind
                    ids = flagged[flagged[:, 0] == kind, 1]
                    fix = _redo_flagged(args, ids, kind, s0, j0, width, n_tiles_k, n_leaves,
                                        tile) if ids.numel() else None
                rows = out[kind, s0:s1]
                res = _words_to_fp32(w[kind], fix, tok, "token-sum-attention-dkv",
                                     out=rows.view(-1) if direct else None,
                                     as_words=late is not None)
                if not direct:
                    rows[:, :, j0:j0 + width] = res.view(s1 - s0, hq, width, d)
    return out


def leaf_partials(q, k, v, out, lse, d_out, q_pos, kv_len, scale,
                  kv_tile=None) -> torch.Tensor:
    """[n_leaves, 2, S, Hq, Tk, D] fp32: every leaf partial the backward adds for dK (0, before
    the head tree and ·scale) and dV (1) — the kernel in EMIT mode (tests: their exact sum is the
    backward's, a plain fp32 sum depends on the order)."""
    _check(q, k, v, out, lse, d_out, q_pos, kv_len)
    s_, hq, tq, d = q.shape
    tk = k.shape[2]
    n_leaves = int(q_pos.max()) // CUDA_DKV_LEAF + 1
    lse_h = lse.reshape(s_, hq, tq)
    tile = _kv_tile(q.dtype, d, kv_tile)
    bn, dt = tile[0], tile[1]
    args = (q, k, v, d_out, lse_h, _delta(out, d_out, q_pos), slot_map(q_pos, n_leaves),
            kv_len, scale, None)
    n_tiles_k = triton.cdiv(tk, bn)
    grid = n_tiles_k * (d // dt) * s_ * hq
    res = torch.zeros(n_leaves, 2, s_ * hq * tk * d, device=q.device)
    pids = torch.arange(grid, dtype=torch.int32, device=q.device)
    rows = _program_rows(pids.long(), n_tiles_k, d // dt, bn, dt, tk, d).reshape(-1)
    live = rows >= 0
    for kind in (0, 1):
        scratch = torch.zeros(n_leaves, grid, bn, dt, device=q.device)
        _launch_dkv(args, scratch, pids, pids, kind, 0, 0, tk, n_tiles_k, n_leaves, grid, tile,
                    True, False)
        res[:, kind, rows[live]] = scratch.view(n_leaves, -1)[:, live]
    return res.view(n_leaves, 2, s_, hq, tk, d)


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, d_out: torch.Tensor, q_pos: torch.Tensor,
                       kv_len: torch.Tensor, scale: float, tok: TokenSum | None = None,
                       kv_comm: Comm | None = None, *, words_elems: int = WORDS_ELEMS,
                       dq_tile: tuple[int, int, int] | None = None,
                       kv_tile: tuple[int, int, int, int] | None = None,
                       force_flag: bool = False, bounds: tuple[int, int] | None = None):
    """(dQ, dK, dV) of invariant causal GQA attention on CUDA (module doc; FlashAttention-2 §3.1).

    q [S, Hq, Tq, D], k/v [S, Hkv, Tk, D]: one dtype, float32 or bfloat16, any strides; D a power
    of two in [16, 256]; out [S, Hq, Tq, D] and lse [S, Hkv, G, Tq] fp32 from
    triton_attention.attention_forward on the same inputs; d_out like out (any float dtype);
    q_pos [S, Tq] long (−1 = padding; a sample's positions distinct); kv_len [S] long; scale the
    forward's. tok: the token reduction's group (CP ranks holding the other queries; default one
    rank); kv_comm: the TP ranks replicating this KV head (kernels/attention.attention).
    words_elems: the dK / dV chunk size (module doc); dq_tile / kv_tile override the tile tables;
    force_flag sends every dK/dV program through the per-leaf fallback (tests) — none of these
    changes a bit. bounds: (q_pos.max(), kv_len.max()) as host ints, if the caller knows them
    (they must be those values); None reads them, a host sync. Returns dQ like q, dK and dV like
    k, in q's dtype and each in its input's memory order.
    ValueError on bad input. Syncs the host once per dK/dV chunk (which programs of its two
    kinds, if any, failed the exactness check of both the first pass and its retry) — except
    under a late gradient sink (`tok.sink`, GradSink "Late activation flags"), which is handed
    their count instead —, and once more without `bounds`.
    """
    _check(q, k, v, out, lse, d_out, q_pos, kv_len)
    if q.shape[0] == 0 or q.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq, dk, dv = _backward(q, k, v, out, lse, d_out, q_pos, kv_len, scale, tok, kv_comm,
                           words_elems, dq_tile, kv_tile, force_flag, bounds, None, k.shape[2])
    return dq, _like(dk, k), _like(dv, v)


def attention_backward_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, d_out: torch.Tensor,
                              q_rows: torch.Tensor, k_rows: torch.Tensor, q_pos: torch.Tensor,
                              kv_len: torch.Tensor, tk: int, scale: float,
                              tok: TokenSum | None = None, kv_comm: Comm | None = None, *,
                              words_elems: int = WORDS_ELEMS,
                              dq_tile: tuple[int, int, int] | None = None,
                              kv_tile: tuple[int, int, int, int] | None = None,
                              force_flag: bool = False, bounds: tuple[int, int] | None = None):
    """`attention_backward` on packed token streams, the backward of
    triton_attention.attention_forward_packed (its q, k, v, q_rows, k_rows, q_pos, kv_len, tk,
    scale; out [Lq, Hq, D] and lse from it; d_out like out): each sample's rows are read in
    place, dQ is written in place. Returns dQ [Lq, Hq, D], dK / dV [Lk, Hkv, D] in q's dtype,
    +0.0 in rows no slot names; the bytes of `attention_backward` on the gathered per-sample
    tensors, scattered back to the streams. ValueError on bad input; host syncs as there."""
    check_cuda("attention backward", q, k, v, out, lse, d_out, q_rows, k_rows, q_pos, kv_len)
    check_packed("attention backward", q, k, v, q_rows, k_rows, q_pos, kv_len)
    _check_dtypes(q, k, v, q.shape[-1])
    s_, tq = q_pos.shape
    hq, hkv = q.shape[1], k.shape[1]
    if (out.shape != q.shape or d_out.shape != q.shape or hq % hkv
            or tuple(lse.shape) != (s_, hkv, hq // hkv, tq) or lse.dtype != torch.float32):
        raise ValueError(f"attention backward: out {tuple(out.shape)}, d_out "
                         f"{tuple(d_out.shape)}, lse {tuple(lse.shape)} {lse.dtype} do not "
                         f"match q {tuple(q.shape)} (lse fp32 [S, Hkv, G, Tq])")
    if s_ == 0 or hq == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    rows = (q_rows.contiguous(), k_rows.contiguous())    # sample_base reads ROWS[s]: stride 1
    dq, dk, dv = _backward(q, k, v, out, lse, d_out, q_pos, kv_len, scale, tok, kv_comm,
                           words_elems, dq_tile, kv_tile, force_flag, bounds, rows, tk)
    return dq, _to_rows(dk, k, k_rows, kv_len), _to_rows(dv, v, k_rows, kv_len)


def _backward(q, k, v, out, lse, d_out, q_pos, kv_len, scale, tok, kv_comm, words_elems,
              dq_tile, kv_tile, force_flag, bounds, rows, tk):
    """(dQ in q's dtype and layout, dK·scale and dV [S, Hkv, Tk, D] fp32): the module doc's
    three kernels, then the G heads of each group by the halving tree."""
    tok = tok or TokenSum.single()
    s_, hq, tq, d, hkv, tk = _dims(q, k, q_pos, rows, tk)
    g = hq // hkv
    lse_h = lse.reshape(s_, hq, tq)
    if bounds is not None:
        top_pos, top_len = bounds
    elif tq:
        top_pos, top_len = torch.stack([q_pos.max(), kv_len.max()]).tolist()
    else:
        top_pos, top_len = -1, int(kv_len.max())
    n_leaves = max(0, top_pos) // CUDA_DKV_LEAF + 1
    tk_eff = max(0, min(tk, top_len))
    with device_ctx(q):
        delta = _delta(out, d_out, q_pos, rows) if tq \
            else torch.zeros(s_, hq, 0, device=q.device)
        dq = _dq(q, k, v, d_out, lse_h, delta, q_pos, kv_len, scale, dq_tile, q.dtype, rows,
                 tk) if tq else torch.zeros_like(q)
        dkv = _dkv_per_head(q, k, v, d_out, lse_h, delta, q_pos, kv_len, scale, tok, n_leaves,
                            tk_eff, words_elems, kv_tile, force_flag, rows, tk)
    # The G heads of each group by the halving tree, as kernels/attention.py does: this rank's
    # equal part locally, then across the TP ranks replicating the KV head.
    dkv = tree_sum_halving(dkv.view(2, s_, hkv, g, tk, d), 3)
    dk, dv = dkv[0], dkv[1]
    if kv_comm is not None and kv_comm.size > 1:
        dv = kv_comm.tree_all_reduce(dv, "attention-kv-head-tree-dv")
        dk = kv_comm.tree_all_reduce(dk, "attention-kv-head-tree-dk")
    return dq, dk * scale, dv


def _to_rows(x: torch.Tensor, ref: torch.Tensor, k_rows: torch.Tensor,
             kv_len: torch.Tensor) -> torch.Tensor:
    """x [S, Hkv, Tk, D] as a stream like ref [Lk, Hkv, D] (its dtype): key slot j < kv_len[s]
    at row k_rows[s] + j, other rows +0.0 (one rounding copy and kernels/slots.py's scatter,
    no host sync)."""
    s_, hkv, tk, d = x.shape
    rows = torch.empty(s_, tk, hkv, d, dtype=ref.dtype, device=x.device)
    rows.copy_(x.transpose(1, 2))
    return scatter_slots(rows, slot_moves(key_slot_map(k_rows, kv_len, tk), ref.shape[0]))


def _like(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """x in ref's dtype and memory order (one rounding copy, or x itself when both already
    match): a gradient laid out like its input needs no transposing copy on its way back to
    the token stream."""
    if x.dtype == ref.dtype and x.stride() == ref.stride():
        return x
    return torch.empty_like(ref).copy_(x)
