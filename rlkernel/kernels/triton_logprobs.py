"""Vocab-sharded log-softmax statistics on CUDA (Triton), and the fused LM head + logprobs.

Contract of kernels/logprobs.py (DESIGN.md §1 "Vocab-parallel log-softmax"): z = logits / T in
fp32 (correctly rounded division, the same bits as torch's `/`); the vocab is cut into `shards`
equal virtual shards; per shard, in a fixed order, m = max z, s = Σ e^{z−m}, t = Σ e^{z−m}·z;
shards merge by the pairwise tree (kernels/logprobs.merge_shard_stats), so a vocab-parallel
TP group can finish the same tree. The CUDA order inside a shard: chunks of
VOCAB_CHUNK = 128 consecutive ids, in id order; per chunk m_c (exact max), s_c and t_c by the
pairwise tree (reshape/split levels: layout-independent); chunks merged sequentially,
    m' = max(m, m_c);  s = s·e^{m−m'} + s_c·e^{m_c−m'};  t likewise.
Every value is per token, so a token's bits never depend on the other tokens. A padded
vocabulary's ids >= live_vocab are -inf in z (the fused kernel masks by global id; the
materialised path receives z already masked by kernels/logprobs._div_t).

`finish_stats(m, s, t)` finishes the per-shard statistics in one launch: merge_shard_stats's
tree (pairs (0, 1), (2, 3), … level by level, an odd last entry carried up), each merge
logprobs._merge's ops (exp32 of the max differences: triton_elementwise, float64 Horner), then
lse = m + log32(s), entropy = lse − t/s (div_rn: torch's division). The same bits as those torch
ops on CPU, which on CUDA were hundreds of tiny launches per call. A merged max of ±0 may carry
either sign (max.NaN.f32 and torch.maximum need not agree there): it reaches the outputs only
through exp(±0) = 1 and ±0 + log s, where the sign vanishes. Tests:
tests/test_logprobs_finish_triton.py (interpreter, PTX), tests/test_cuda.py (GPU == CPU).
`shard_stats(logits, T, shards)` reads materialised logits. `linear_shard_stats(h, w, T, ...)`
is the fused form: each program computes its [rows × 128] logits tile with the batch-invariant
matmul chain of kernels/triton_matmul.py (fp32: BLOCK_K = 32, `acc = dot(x, wᵀ, acc)`, the same
per-element fma sequence; bf16: the tensor-core dot over the same K blocks), applies the same chunk statistics, and keeps the target's z.
Every kernel here launches with enable_fp_fusion=False (no mul+add contracted into an fma), so
each statistic is the written sequence of IEEE ops in both kernels. z is div_rn(logit, T); the
materialised paths form it with `div_scalar` (torch's CUDA `x / T` multiplies by 1/T instead).
So fused and unfused paths give identical bytes, and the [tokens × vocab] logits never exist:
extra memory is O(tokens × shards), flat in the vocabulary and tiny in the number of samples.

Does not: materialise the log-softmax (kernels/logprobs.py does, for rollout sampling), fuse
the backward (kernels/logprobs.py recomputes logits per call), or communicate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.triton_elementwise import exp32, log32, tree_rows
from rlkernel.kernels.triton_matmul import BLOCK_K
from rlkernel.kernels.triton_util import check_cuda, device_ctx, launch
from rlkernel.spec import CUDA_VOCAB_CHUNK

VOCAB_CHUNK = CUDA_VOCAB_CHUNK
"""Vocab ids per sequential chunk inside a shard (CUDA backend's vocab block)."""
_LOG_CHUNK = 7


@triton.jit
def _chunk_update(z, m, s, t, BR: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr):
    """Merge one chunk of z [BR, C] (masked ids = -inf) into the running (m, s, t) [BR]."""
    m_c = tl.max(z, 1)
    live = m_c > float("-inf")
    m_cs = tl.where(live, m_c, 0.0)
    e = tl.exp(z - m_cs[:, None])                        # masked ids -> exp(-inf) = 0
    ez = tl.where(e > 0, e * z, 0.0)                     # no 0 * -inf
    s_c = tree_rows(e, BR, C, LOG_C)
    t_c = tree_rows(ez, BR, C, LOG_C)
    m_new = tl.maximum(m, m_c)
    m_ns = tl.where(m_new > float("-inf"), m_new, 0.0)
    f_old = tl.exp(m - m_ns)                             # m = -inf -> 0
    f_c = tl.exp(m_c - m_ns)
    s = tl.where(live, s * f_old + s_c * f_c, s)
    t = tl.where(live, t * f_old + t_c * f_c, t)
    m = tl.where(live, m_new, m)
    return m, s, t


@triton.jit
def _stats_kernel(L, TGT, M_OUT, S_OUT, T_OUT, ZT_OUT, n_rows, V, shard_len, s_lr, temp,
                  BR: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr, HAS_TGT: tl.constexpr):
    shard = tl.program_id(0)
    rows = tl.program_id(1) * BR + tl.arange(0, BR)
    r_ok = rows < n_rows
    m = tl.full((BR,), float("-inf"), tl.float32)
    s = tl.zeros((BR,), tl.float32)
    t = tl.zeros((BR,), tl.float32)
    zt = tl.full((BR,), float("-inf"), tl.float32)
    if HAS_TGT:
        tgt = tl.load(TGT + rows, mask=r_ok, other=-1)
    v0 = shard * shard_len
    for c0 in range(0, shard_len, C):
        cols = v0 + c0 + tl.arange(0, C)
        ok = r_ok[:, None] & (cols[None, :] < v0 + shard_len)
        x = tl.load(L + rows.to(tl.int64)[:, None] * s_lr + cols[None, :], mask=ok, other=0.0)
        z = tl.where(ok, tl.math.div_rn(x, temp), float("-inf"))
        m, s, t = _chunk_update(z, m, s, t, BR, C, LOG_C)
        if HAS_TGT:
            zt = tl.maximum(zt, tl.max(tl.where(cols[None, :] == tgt[:, None], z, float("-inf")), 1))
    out = rows.to(tl.int64) * tl.num_programs(0) + shard
    tl.store(M_OUT + out, m, mask=r_ok)
    tl.store(S_OUT + out, s, mask=r_ok)
    tl.store(T_OUT + out, t, mask=r_ok)
    if HAS_TGT:
        tl.store(ZT_OUT + out, zt, mask=r_ok)


@triton.jit
def _linear_stats_kernel(X, W, TGT, M_OUT, S_OUT, T_OUT, ZT_OUT, n_rows, K, shard_len, n_live,
                         s_xr, s_xk, s_wv, s_wk, temp,
                         BR: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr,
                         BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    shard = tl.program_id(0)
    rows = tl.program_id(1) * BR + tl.arange(0, BR)
    r_ok = rows < n_rows
    rk = tl.arange(0, BLOCK_K)
    m = tl.full((BR,), float("-inf"), tl.float32)
    s = tl.zeros((BR,), tl.float32)
    t = tl.zeros((BR,), tl.float32)
    zt = tl.full((BR,), float("-inf"), tl.float32)
    tgt = tl.load(TGT + rows, mask=r_ok, other=-1)
    v0 = shard * shard_len
    x_rows = X + rows.to(tl.int64)[:, None] * s_xr
    for c0 in range(0, shard_len, C):
        cols = v0 + c0 + tl.arange(0, C)
        c_ok = cols < v0 + shard_len
        w_cols = W + cols.to(tl.int64)[None, :] * s_wv
        # The logits tile: the chain of triton_matmul._bmm_kernel for the operands' dtype (same
        # BLOCK_K, same dot form; bf16 on the tensor cores, whose bits depend on the K order only).
        acc = tl.zeros((BR, C), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            xa = tl.load(x_rows + kk.to(tl.int64)[None, :] * s_xk, mask=r_ok[:, None] & k_ok[None, :],
                         other=0.0)
            wb = tl.load(w_cols + kk.to(tl.int64)[:, None] * s_wk, mask=k_ok[:, None] & c_ok[None, :],
                         other=0.0)
            acc = tl.dot(xa, wb, acc, input_precision=PREC)
        # ids >= n_live (a padded vocabulary's rows past the tokenizer) are -inf, as in _div_t
        ok = r_ok[:, None] & (c_ok & (cols < n_live))[None, :]
        z = tl.where(ok, tl.math.div_rn(acc, temp), float("-inf"))
        # The target's z first: z's tile then dies inside _chunk_update (ptxas sm_90a: 56 bytes
        # of spill stores a thread at 255 registers the other way round, none this way).
        zt = tl.maximum(zt, tl.max(tl.where(cols[None, :] == tgt[:, None], z, float("-inf")), 1))
        m, s, t = _chunk_update(z, m, s, t, BR, C, LOG_C)
    out = rows.to(tl.int64) * tl.num_programs(0) + shard
    tl.store(M_OUT + out, m, mask=r_ok)
    tl.store(S_OUT + out, s, mask=r_ok)
    tl.store(T_OUT + out, t, mask=r_ok)
    tl.store(ZT_OUT + out, zt, mask=r_ok)


@triton.jit
def _div_kernel(X, Y, n, temp, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + o, mask=o < n, other=0.0)
    tl.store(Y + o, tl.math.div_rn(x, temp), mask=o < n)


def div_scalar(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """x / T correctly rounded (div_rn, the statistics kernels' division): fp32 CUDA, any shape."""
    check_cuda("log-softmax", x)
    if x.dtype != torch.float32:
        raise ValueError(f"log-softmax: float32 logits expected, got {x.dtype}")
    xc = x.contiguous()
    y = torch.empty_like(xc)
    n = xc.numel()
    if n:
        with device_ctx(x):
            launch(_div_kernel, (triton.cdiv(n, 4096),),
                   xc, y, n, float(temperature), BLOCK=4096, num_warps=8)
    return y


def _outs(n: int, shards: int, dev) -> list[torch.Tensor]:
    return [torch.empty(n, shards, dtype=torch.float32, device=dev) for _ in range(4)]


def shard_stats(logits: torch.Tensor, temperature: float, shards: int,
                targets: torch.Tensor | None = None):
    """Per-shard (m, s, t) of z = logits / T, each [N, shards] fp32, and z at `targets`.

    logits [N, V] fp32 on CUDA with unit stride along V, V % shards == 0; targets [N] long or
    None. Returns (m, s, t, z_target [N] or None). ValueError on bad input.
    """
    check_cuda("log-softmax", logits)
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"log-softmax: [N, V] float32 logits expected, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    n, v = logits.shape
    if v % shards:
        raise ValueError(f"log-softmax: vocab {v} is not a multiple of {shards} vocab shards")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    m, s, t, zt = _outs(n, shards, logits.device)
    if n:
        br = 4
        tgt = targets if targets is not None else m   # dummy pointer when unused
        with device_ctx(logits):
            launch(_stats_kernel, (shards, triton.cdiv(n, br)),
                   logits, tgt, m, s, t, zt, n, v, v // shards, logits.stride(0),
                   float(temperature), BR=br, C=VOCAB_CHUNK, LOG_C=_LOG_CHUNK,
                   HAS_TGT=targets is not None, num_warps=4, enable_fp_fusion=False)
    return m, s, t, (zt.amax(1) if targets is not None else None)


LINEAR_STATS_TILES = {torch.bfloat16: (128, 8, 3), torch.float32: (64, 8, 2)}
"""Operand dtype -> (BR rows, num_warps, num_stages) of `_linear_stats_kernel`: speed only (a
row's statistics are per-row chains). bf16: the fastest of benchmarks/bench_lm_head_stats.py's
sweep (27 ms against 77 for (64, 8, 2) at qwen3-1.7b's 16k-token step, same bytes); fp32 keeps
the tile it was measured with."""


def linear_shard_stats(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor,
                       temperature: float, shards: int, live_vocab: int | None = None,
                       tile: tuple[int, int, int] | None = None):
    """Fused LM head + statistics: as `shard_stats` of z = h @ wᵀ / T with z = -inf for ids >=
    live_vocab (logprobs._div_t), bitwise, without forming the logits.

    h [N, K], w [V, K] (any strides; both float32 or both bfloat16: the logits are the bytes of
    triton_matmul.linear_nt for that dtype), targets [N] long (column indices of w; one outside
    [0, V), as for a vocab slice whose rank does not hold that target, matches no column and
    gives z_target −inf), V % shards == 0, live_vocab in [0, V] or None (= V; 0: a slice with no
    live id, every statistic (−inf, 0, 0)); `tile` None = LINEAR_STATS_TILES[h.dtype]. Returns
    (m, s, t [N, shards] fp32, z_target [N] fp32).
    """
    check_cuda("fused logprobs", h, w, targets)
    if h.dtype != w.dtype or h.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"fused logprobs: h and w must both be float32 or both bfloat16, got "
                         f"{h.dtype}, {w.dtype}")
    n, k = h.shape
    v = w.shape[0]
    if w.shape[1] != k or v % shards or tuple(targets.shape) != (n,):
        raise ValueError(f"fused logprobs: h {tuple(h.shape)}, w {tuple(w.shape)}, targets "
                         f"{tuple(targets.shape)} (vocab must divide into {shards} shards)")
    n_live = v if live_vocab is None else live_vocab
    m, s, t, zt = _outs(n, shards, h.device)
    if n:
        br, warps, stages = tile or LINEAR_STATS_TILES[h.dtype]
        with device_ctx(h):
            launch(_linear_stats_kernel, (shards, triton.cdiv(n, br)),
                   h, w, targets, m, s, t, zt, n, k, v // shards, n_live,
                   h.stride(0), h.stride(1), w.stride(0), w.stride(1), float(temperature),
                   BR=br, C=VOCAB_CHUNK, LOG_C=_LOG_CHUNK, BLOCK_K=BLOCK_K[h.dtype],
                   PREC="ieee" if h.dtype == torch.float32 else "tf32",   # ignored for bf16 dots
                   num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return m, s, t, zt.amax(1)


@triton.jit
def _merge(m1, s1, t1, m2, s2, t2):
    """logprobs._merge of two shards' (m, s, t), operation for operation."""
    m = tl.maximum(m1, m2, propagate_nan=tl.PropagateNan.ALL)      # torch.maximum: NaN wins
    m_safe = tl.where((m == float("inf")) | (m == float("-inf")), 0.0, m)
    f1 = exp32(m1 - m_safe)
    f2 = exp32(m2 - m_safe)
    return m, s1 * f1 + s2 * f2, t1 * f1 + t2 * f2


@triton.jit
def _tree_merge(m, s, t, BR: tl.constexpr, P: tl.constexpr, LOG_P: tl.constexpr,
                SHARDS: tl.constexpr):
    """logprobs.merge_shard_stats over the last dim of m, s, t [BR, P] (shards in columns
    [0, SHARDS), P the next power of two): level by level, pairs (0, 1), (2, 3), ... merged and
    an odd last one carried up unmerged -> [BR] each."""
    for lvl in tl.static_range(LOG_P):
        m1, m2 = tl.split(tl.reshape(m, (BR, P >> (lvl + 1), 2)))
        s1, s2 = tl.split(tl.reshape(s, (BR, P >> (lvl + 1), 2)))
        t1, t2 = tl.split(tl.reshape(t, (BR, P >> (lvl + 1), 2)))
        mm, sm, tm = _merge(m1, s1, t1, m2, s2, t2)
        # pair i merges iff its right entry 2i + 1 is one of the level's ceil(SHARDS / 2**lvl)
        # entries; else the left one is carried up (the odd last) or unused
        pair = (2 * tl.arange(0, P >> (lvl + 1)) + 1 < (SHARDS + (1 << lvl) - 1) >> lvl)[None, :]
        m = tl.where(pair, mm, m1)
        s = tl.where(pair, sm, s1)
        t = tl.where(pair, tm, t1)
    return tl.reshape(m, (BR,)), tl.reshape(s, (BR,)), tl.reshape(t, (BR,))


@triton.jit
def _finish_kernel(M, S, T, LSE, ENT, n_rows, BR: tl.constexpr, P: tl.constexpr,
                   LOG_P: tl.constexpr, SHARDS: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    r_ok = rows < n_rows
    cols = tl.arange(0, P)
    ok = r_ok[:, None] & (cols < SHARDS)[None, :]
    off = rows.to(tl.int64)[:, None] * SHARDS + cols[None, :]
    m = tl.load(M + off, mask=ok, other=float("-inf"))
    s = tl.load(S + off, mask=ok, other=0.0)
    t = tl.load(T + off, mask=ok, other=0.0)
    m, s, t = _tree_merge(m, s, t, BR, P, LOG_P, SHARDS)
    lse = m + log32(s)
    tl.store(LSE + rows, lse, mask=r_ok)
    tl.store(ENT + rows, lse - tl.math.div_rn(t, s), mask=r_ok)   # torch's t / s: div.rn


FINISH_ROWS, FINISH_WARPS = 32, 4
"""Rows per program and warps of `finish_stats` (any tile gives the same bits: rows are
independent)."""


def finish_stats(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor, *,
                 block_r: int = FINISH_ROWS, num_warps: int = FINISH_WARPS):
    """(lse, entropy) [N] fp32 of per-shard stats m, s, t [N, shards] fp32: the bits of
    logprobs.merge_shard_stats, then lse = m + log32(s), entropy = lse − t / s, in one launch.

    Any shard count >= 1 (the torch tree's odd carries included). ValueError on bad input.
    """
    check_cuda("log-softmax finish", m, s, t)
    if m.dim() != 2 or m.dtype != torch.float32 or m.shape[1] < 1 \
            or any(x.shape != m.shape or x.dtype != m.dtype for x in (s, t)):
        raise ValueError(f"log-softmax finish: m, s, t [N, shards >= 1] float32 expected, got "
                         f"{[(tuple(x.shape), x.dtype) for x in (m, s, t)]}")
    n, shards = m.shape
    m, s, t = (x.contiguous() for x in (m, s, t))
    lse, ent = (torch.empty(n, dtype=torch.float32, device=m.device) for _ in range(2))
    if n:
        log_p = (shards - 1).bit_length()
        with device_ctx(m):
            launch(_finish_kernel, (triton.cdiv(n, block_r),),
                   m, s, t, lse, ent, n, BR=block_r, P=1 << log_p, LOG_P=log_p, SHARDS=shards,
                   num_warps=num_warps, enable_fp_fusion=False)
    return lse, ent
