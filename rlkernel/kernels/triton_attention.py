"""Causal GQA attention forward over fixed KV blocks at absolute positions (Triton, CUDA backend).

Same contract as kernels/attention.py (DESIGN.md §1 "Attention"), with this backend's block size
KV_BLOCK = 64: for a query at absolute position p of sample s, block b covers keys
[b·64, (b+1)·64) of s; blocks are visited in order, one online-softmax update each
(Milakov & Gimelshein 2018; Dao et al., FlashAttention, 2022):
    s_j = (q·k_j)·scale  (visible: j <= p and j < kv_len[s]; others -inf)
    m' = max(m, max_j s_j);  p_j = exp(s_j - m');  α = exp(m - m')
    l' = l·α + dot(p, 1);  acc' = acc·α + dot(p, V)
A block in which a query sees no key leaves (m, l, acc) untouched (select, not add). Both sums
over the block's keys are `tl.dot`s, whose per-element order is the key order within the block
whatever the tile (fp32: one fma per key, ascending; bf16: tensor cores, whose per-element bits
depend on the K order only on the H200 — re-tested by tests/test_cuda.py), and the row max is
exact. So a query's bits depend only on q, its position, kv_len, and the keys it sees: prefill,
chunked prefill, KV-cache decode and any batch agree byte for byte (the kernel launches with
enable_fp_fusion=False, so no mul+add is contracted differently in the two block loops), and the row tile may change
between calls (decode uses a smaller one). Masked keys inside a visited block add p = 0
products; decode never loads slots at or beyond kv_len (NaN there is harmless).
Precision: fp32 q/k/v use fp32 fma dots (input_precision="ieee"); bf16 q/k/v use bf16 tensor-core
dots with p rounded to bf16 for both P·V and the row sum l (consistent normaliser).
Rows (t, g) of one KV head's G query heads share a tile, so decode reads each K/V block once per
KV head. Split-KV decode is not used (batch × KV heads already fill the GPU at batch 64).
Returns lse = m + log(l) in the [S, Hkv, G, Tq] layout of kernels/attention.py, from which the
backward (kernels/triton_attention_bwd.py) recomputes p = exp(s − lse) with this kernel's s.

`attention_forward_packed` runs it on the packed token streams themselves (varlen, as
FlashAttention-2's cu_seqlens entry point): sample s's slots are rows q_rows[s] + t / key rows
k_rows[s] + j (PACKED, `sample_base`), empty slots are neither read nor written.
`paged_attention_forward` runs the same kernel with K/V read through a block table (paged KV
cache of the rollout engine): only the addresses change (PAGED is a compile-time switch).
Does not: backward (kernels/triton_attention_bwd.py), CP gathering.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.attention import check_packed
from rlkernel.kernels.triton_util import check_cuda, device_ctx, launch
from rlkernel.spec import CUDA_ATTN_KV_BLOCK

KV_BLOCK = CUDA_ATTN_KV_BLOCK
"""Keys per online-softmax block on the CUDA backend (absolute positions)."""

# dtype -> [(max rows Tq·G, (BLOCK_M, num_warps, num_stages)), ...]; first row that fits.
# bf16 decode rows (Tq·G <= 16) take a 16-row tile: paged decode at qwen3-0.6b heads on an H200,
# 256 samples x 1k keys 0.51 -> 0.33 ms, 128 x 2k 0.48 -> 0.32 ms, 16 x 1k 0.092 -> 0.080 ms
# against (64, 4, 2); each of the 10 tiles probed gave the same bytes (tests/test_cuda.py
# checks the table's tiles against each other).
_TILES = {
    torch.bfloat16: [(16, (16, 4, 2)), (64, (64, 4, 2)), (1 << 62, (128, 8, 3))],
    torch.float32: [(16, (16, 4, 1)), (1 << 62, (32, 8, 1))],
}
# fp32 rows > 16: 8 warps made the model's fp32 forward 2.2x faster than (32, 4, 1) at rollout
# prefill pieces (128 samples x 64 queries, ctx 512, qwen3-0.6b heads), same bytes for every
# tile swept (benchmarks/bench_attention.py --fp32-sweep; docs/BENCHMARKS.md).


@triton.jit
def _block_base(kbase, vbase, TABLE, s, s_ts, s_tb, s_ks, s_vs, j0, j,
                BLOCK_N: tl.constexpr, PAGED: tl.constexpr):
    """K/V base pointers of the key block starting at j0 and the key offsets inside it."""
    if PAGED:
        blk = tl.load(TABLE + s * s_ts + (j0 // BLOCK_N) * s_tb).to(tl.int64)
        return kbase + blk * s_ks, vbase + blk * s_vs, tl.arange(0, BLOCK_N).to(tl.int64)
    else:
        return kbase, vbase, j.to(tl.int64)


@triton.jit
def sample_base(ROWS, s, stride, PACKED: tl.constexpr):
    """Element offset of sample s's first row: s·stride in a per-sample tensor [S, ...], or
    ROWS[s]·stride in a packed token stream (PACKED: sample s's slots are the stream's rows
    ROWS[s], ROWS[s] + 1, ...; stride is then the stream's row stride)."""
    if PACKED:
        return tl.load(ROWS + s).to(tl.int64) * stride
    else:
        return s * stride


@triton.jit
def query_rows(QPOS, KVLEN, s_ps, s_pt, Tq, Tk, HKV, n_tiles,
               G: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's tile of rows r = (t, g) of one KV head's G query heads, latest tiles first:
    (s int64, hk, t, g, row_ok, pos, kvl, last visible key per row (−1: none), hi = the end of
    the keys the tile visits). Shared by the forward and triton_attention_bwd's dQ kernel."""
    tile = n_tiles - 1 - tl.program_id(0)          # longest (latest) query tiles first
    sh = tl.program_id(1)
    s = (sh // HKV).to(tl.int64)
    hk = sh % HKV
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)     # row = (t, g) of this KV head's G heads
    t = r // G
    row_ok = t < Tq
    pos = tl.load(QPOS + s * s_ps + t.to(tl.int64) * s_pt, mask=row_ok, other=-1)
    kvl = tl.load(KVLEN + s).to(tl.int32)
    last = tl.minimum(pos.to(tl.int32), kvl - 1)    # last visible key per row (-1: none)
    hi = tl.minimum(tl.max(last, 0) + 1, Tk)
    return s, hk, t, r % G, row_ok, pos, kvl, last, hi


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, QPOS, KVLEN, TABLE, QROWS, KROWS,
                     s_qs, s_qh, s_qt, s_qd, s_ks, s_kh, s_kt, s_kd,
                     s_vs, s_vh, s_vt, s_vd, s_os, s_oh, s_ot, s_od,
                     s_ls, s_lh, s_lg, s_lt, s_ps, s_pt, s_ts, s_tb,
                     Tq, Tk, HKV, n_tiles, scale,
                     G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, PREC: tl.constexpr, PAGED: tl.constexpr,
                     PACKED: tl.constexpr):
    # PAGED: K/V are block pools [blocks, BLOCK_N, Hkv, D] (s_ks = the block stride) and key
    # block b of sample s is pool block TABLE[s, b]; otherwise K/V are [S, Hkv, Tk, D]. PACKED:
    # Q/O are token streams [Lq, Hq, D] and K/V [Lk, Hkv, D], sample s's slots from rows
    # QROWS[s] / KROWS[s] on (s_qs = s_qt, ... the row strides). Only the addresses differ: the
    # same blocks are visited in the same order with the same operations.
    s, hk, t, g, row_ok, pos, kvl, last, hi = query_rows(QPOS, KVLEN, s_ps, s_pt, Tq, Tk, HKV,
                                                         n_tiles, G, BLOCK_M)
    dd = tl.arange(0, D)
    head = (hk * G + g).to(tl.int64)
    # Rows with no query (pos < 0) are not read (in a stream their slot names no row of theirs)
    # and are zeroed at the end: no other row's value changes with what they hold.
    live = row_ok & (pos >= 0)
    q = tl.load(Q + sample_base(QROWS, s, s_qs, PACKED) + head[:, None] * s_qh
                + t.to(tl.int64)[:, None] * s_qt + dd[None, :] * s_qd,
                mask=live[:, None], other=0.0)
    if PAGED:
        kbase = K + hk.to(tl.int64) * s_kh
        vbase = V + hk.to(tl.int64) * s_vh
    else:
        kbase = K + sample_base(KROWS, s, s_ks, PACKED) + hk.to(tl.int64) * s_kh
        vbase = V + sample_base(KROWS, s, s_vs, PACKED) + hk.to(tl.int64) * s_vh
    ones = tl.full((BLOCK_N, 16), 1.0, dtype=tl.float32).to(Q.dtype.element_ty)
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    # Blocks that every live row sees whole: the same ops without masks or selects (all-true
    # masks and selects change no value). None in a tile without a live row (hi = 0 there): its
    # unmasked loads would read keys past kv_len, in a packed stream other samples' rows or
    # rows past the stream's end.
    n_full = (tl.minimum(tl.min(tl.where(live, last, 1 << 30), 0), hi - 1) + 1) // BLOCK_N
    for j0 in range(0, n_full * BLOCK_N, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        kb, vb, jj = _block_base(kbase, vbase, TABLE, s, s_ts, s_tb, s_ks, s_vs, j0, j,
                                 BLOCK_N, PAGED)
        k = tl.load(kb + jj[None, :] * s_kt + dd[:, None] * s_kd)                   # [D, BN]
        sc = tl.dot(q, k, input_precision=PREC) * scale
        m_new = tl.maximum(m, tl.max(sc, 1))
        p = tl.exp(sc - m_new[:, None]).to(Q.dtype.element_ty)
        alpha = tl.exp(m - m_new)
        v = tl.load(vb + jj[:, None] * s_vt + dd[None, :] * s_vd)                   # [BN, D]
        psum = tl.max(tl.dot(p, ones, input_precision=PREC), 1)
        pv = tl.dot(p, v, input_precision=PREC)
        l = l * alpha + psum
        acc = acc * alpha[:, None] + pv
        m = m_new
    for j0 in range(n_full * BLOCK_N, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        k_ok = j < kvl
        kb, vb, jj = _block_base(kbase, vbase, TABLE, s, s_ts, s_tb, s_ks, s_vs, j0, j,
                                 BLOCK_N, PAGED)
        k = tl.load(kb + jj[None, :] * s_kt + dd[:, None] * s_kd,
                    mask=k_ok[None, :], other=0.0)                             # [D, BN]
        qk = tl.dot(q, k, input_precision=PREC)                                # [BM, BN]
        vis = (j[None, :] <= pos[:, None]) & k_ok[None, :]
        sc = tl.where(vis, qk * scale, float("-inf"))
        row_any = tl.max(vis.to(tl.int32), 1) > 0
        m_new = tl.maximum(m, tl.max(sc, 1))
        m_safe = tl.where(row_any, m_new, 0.0)
        p = tl.exp(sc - m_safe[:, None]).to(Q.dtype.element_ty)
        alpha = tl.exp(tl.where(row_any, m - m_safe, 0.0))
        v = tl.load(vb + jj[:, None] * s_vt + dd[None, :] * s_vd,
                    mask=k_ok[:, None], other=0.0)                             # [BN, D]
        psum = tl.max(tl.dot(p, ones, input_precision=PREC), 1)                # 16 equal columns
        pv = tl.dot(p, v, input_precision=PREC)
        l = tl.where(row_any, l * alpha + psum, l)
        acc = tl.where(row_any[:, None], acc * alpha[:, None] + pv, acc)
        m = tl.where(row_any, m_new, m)
    has = live & (l > 0)
    l_safe = tl.where(has, l, 1.0)
    out = tl.where(has[:, None], tl.math.div_rn(acc, l_safe[:, None]), 0.0)
    lse = tl.where(has, m + tl.log(l_safe), 0.0)
    # A stream's empty slots are other samples' rows (or past the stream): not written (the
    # caller zeroes the stream); a per-sample output's empty slots get their zeros here.
    o_ok = live if PACKED else row_ok
    tl.store(O + sample_base(QROWS, s, s_os, PACKED) + head[:, None] * s_oh
             + t.to(tl.int64)[:, None] * s_ot + dd[None, :] * s_od, out.to(O.dtype.element_ty),
             mask=o_ok[:, None])
    tl.store(LSE + s * s_ls + hk.to(tl.int64) * s_lh + g.to(tl.int64) * s_lg
             + t.to(tl.int64) * s_lt, lse, mask=row_ok)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      kv_len: torch.Tensor, scale: float,
                      tile: tuple[int, int, int] | None = None):
    """Invariant causal GQA attention forward on CUDA.

    q [S, Hq, Tq, D], k/v [S, Hkv, Tk, D]: one dtype, float32 or bfloat16, any strides; D a power
    of two in [16, 256]; q_pos [S, Tq] long (−1 = empty slot, output 0); kv_len [S] long.
    Returns (out [S, Hq, Tq, D] in q's dtype, token-major in memory (out.transpose(1, 2) is
    contiguous), lse [S, Hkv, G, Tq] fp32; 0 where no key is seen).
    `tile` = (BLOCK_M, num_warps, num_stages) overrides the table (tests). ValueError on bad input.
    """
    check_cuda("attention", q, k, v, q_pos, kv_len)
    if (q.dim() != 4 or k.dim() != 4 or (k.shape[0], k.shape[3]) != (q.shape[0], q.shape[3])
            or v.shape != k.shape):
        raise ValueError(f"attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} do not form a GQA problem")
    s_, hq, tq, d = q.shape
    # Token-major memory ([S, Tq, Hq, D] viewed as [S, Hq, Tq, D]): the stream order o_proj
    # reads, so the model's way back to the stream is a reshape, not a transposing copy.
    out = torch.empty(s_, tq, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    return _launch(q, k, v, q_pos, kv_len, scale, tile, (s_, hq, tq, d, k.shape[1], k.shape[2]),
                   q.stride(), k.stride(), v.stride(), out, out.stride(), None)


def stream_strides(x: torch.Tensor) -> tuple[int, int, int, int]:
    """The kernels' (sample, head, slot, dim) strides of a token stream x [L, H, D] whose samples
    start at given rows: the sample stride is the row stride (`sample_base` multiplies it by
    the sample's first row)."""
    return x.stride(0), x.stride(1), x.stride(0), x.stride(2)


def attention_forward_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             q_rows: torch.Tensor, k_rows: torch.Tensor, q_pos: torch.Tensor,
                             kv_len: torch.Tensor, tk: int, scale: float,
                             tile: tuple[int, int, int] | None = None):
    """`attention_forward` reading each sample's rows of the packed token streams in place (as
    FlashAttention-2's varlen entry point reads cu_seqlens; Dao 2023): no per-sample copy.

    q [Lq, Hq, D], k/v [Lk, Hkv, D] (any strides, one dtype); slot t < n_s of sample s is query
    row q_rows[s] + t and key slot j < kv_len[s] key row k_rows[s] + j, where n_s is the count of
    q_pos[s]'s slots >= 0, which come first (empty slots −1 after them); tk >= every kv_len
    (host int: the key slots of the per-sample problem). The same bytes as `attention_forward`
    on the gathered per-sample tensors: only addresses differ.
    Returns (out [Lq, Hq, D] in q's dtype, rows no query slot names +0.0; lse [S, Hkv, G, Tq]).
    ValueError on bad input (shapes; the row maps are the caller's contract, not checked: a
    check would sync the host). q_rows / k_rows may have any strides (a column view such as
    idx[:, 0] included): the kernels read a contiguous copy (`sample_base` indexes ROWS[s])."""
    check_cuda("attention", q, k, v, q_rows, k_rows, q_pos, kv_len)
    check_packed("attention", q, k, v, q_rows, k_rows, q_pos, kv_len)
    s_, tq = q_pos.shape
    hq, d = q.shape[1], q.shape[2]
    out = torch.zeros(q.shape[0], hq, d, dtype=q.dtype, device=q.device)
    return _launch(q, k, v, q_pos, kv_len, scale, tile, (s_, hq, tq, d, k.shape[1], tk),
                   stream_strides(q), stream_strides(k), stream_strides(v), out,
                   stream_strides(out), None, (q_rows.contiguous(), k_rows.contiguous()))


def paged_attention_forward(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                            table: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor,
                            scale: float, tile: tuple[int, int, int] | None = None):
    """`attention_forward` with keys read through a block table (vLLM's PagedAttention, Kwon et
    al. 2023 §4.1): k_pool/v_pool [blocks, KV_BLOCK, Hkv, D], table [S, nb] long (pool block
    of each sample's key block b; only blocks below ceil(kv_len / KV_BLOCK) are read). Same
    blocks, same order, same operations as `attention_forward` on the gathered keys, so the
    same bytes. ValueError on bad input (a pool block size other than KV_BLOCK included)."""
    check_cuda("paged attention", q, k_pool, v_pool, table, q_pos, kv_len)
    if (k_pool.dim() != 4 or k_pool.shape[1] != KV_BLOCK or v_pool.shape != k_pool.shape
            or k_pool.shape[3] != q.shape[3] or table.dim() != 2
            or table.shape[0] != q.shape[0]):
        raise ValueError(f"paged attention: q {tuple(q.shape)}, pools {tuple(k_pool.shape)} / "
                         f"{tuple(v_pool.shape)}, table {tuple(table.shape)}: pools must be "
                         f"[blocks, {KV_BLOCK}, Hkv, D] and the table [S, nb]")
    sk, sv = k_pool.stride(), v_pool.stride()
    s_, hq, tq, d = q.shape
    out = torch.empty(s_, tq, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    # Kernel stride order (sample/block, head, position, dim) from the pool's (block, pos, head, dim).
    return _launch(q, k_pool, v_pool, q_pos, kv_len, scale, tile,
                   (s_, hq, tq, d, k_pool.shape[2], table.shape[1] * KV_BLOCK), q.stride(),
                   (sk[0], sk[2], sk[1], sk[3]), (sv[0], sv[2], sv[1], sv[3]), out, out.stride(),
                   table)


def _launch(q, k, v, q_pos, kv_len, scale, tile, dims, sq, sk, sv, out, so, table,
            rows=None):
    """Checks, then one forward launch. dims = (S, Hq, Tq, D, Hkv, Tk); sq/sk/sv/so the
    kernel's (sample, head, slot, dim) strides of q, k, v, out; rows = (q_rows, k_rows) of
    packed streams, or None."""
    if q.dtype not in _TILES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attention: q/k/v must share dtype float32 or bfloat16, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    s_, hq, tq, d, hkv, tk = dims
    if hkv == 0 or hq % hkv:
        raise ValueError(f"attention: {hq} query heads are not a multiple of {hkv} KV heads")
    if d & (d - 1) or not 16 <= d <= 256:
        raise ValueError(f"attention: head_dim {d} must be a power of two in [16, 256]")
    if tuple(q_pos.shape) != (s_, tq) or tuple(kv_len.shape) != (s_,):
        raise ValueError(f"attention: q_pos {tuple(q_pos.shape)} / kv_len {tuple(kv_len.shape)} "
                         f"do not match S={s_}, Tq={tq}")
    g = hq // hkv
    lse = torch.empty(s_, hkv, g, tq, dtype=torch.float32, device=q.device)
    if s_ * hq * tq * d == 0:
        return out, lse
    rows_n = tq * g
    if tile is None:
        tile = next(cfg for max_rows, cfg in _TILES[q.dtype] if rows_n <= max_rows)
    bm, warps, stages = tile
    n_tiles = triton.cdiv(rows_n, bm)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"   # precision applies to fp32 dots only
    paged = table is not None
    tb = table if paged else kv_len                         # unused pointer when not paged
    st = table.stride() if paged else (0, 0)
    q_rows, k_rows = rows if rows is not None else (kv_len, kv_len)   # unused unless packed
    with device_ctx(q):
        launch(_attn_fwd_kernel, (n_tiles, s_ * hkv),
               q, k, v, out, lse, q_pos, kv_len, tb, q_rows, k_rows, *sq, *sk, *sv, *so,
               *lse.stride(), *q_pos.stride(), *st, tq, tk, hkv, n_tiles, float(scale), G=g, D=d,
               BLOCK_M=bm, BLOCK_N=KV_BLOCK, PREC=prec, PAGED=paged, PACKED=rows is not None,
               num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return out, lse
