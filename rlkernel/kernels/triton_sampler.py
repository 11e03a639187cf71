"""The rollout sampler's exponential race on CUDA (Triton): rollout/sampler.py's tokens, in one pass.

What: `race(logprobs, seed_state, sample_ids, positions, cut_p, cut_id) -> (tokens, bad)` draws
one token per row of canonical logprobs [S, V] exactly as rollout/sampler.sample_tokens does
with torch ops, and flags the rows `sampler.invalid_rows` would flag.
Why: the torch sampler runs the counter hash and two float64 log chains as ~120 elementwise
launches per 2**21-element chunk, each a full pass over [S, V] float64/int64 temporaries
(on an H200 decode step at 256 rows: ~4,000 launches and 25 ms of a 37 ms step); here each
logprob is read once.
Algorithm (per element (s, t), the torch path's IEEE and integer operations, in its order):
    h  = mix(mix(mix(seed + G) ^ sample_id + G) ^ position + G)         (host: the first mix)
    h_t = mix((h ^ t) + G);  u = (float64(h_t >>> 12) + 0.5)·2**-52  (splitmix64 finalizer mix)
    q  = −log64(u);  score = float64(logp) − log64(q)                 (kernels/elementwise.py)
    kept (top-p < 1) iff p > cut_p or (p = cut_p and t <= cut_id), p = exp64(float64(logp)):
         the prefix of the order (p desc, id asc) that sampler._top_p_keep_mask keeps, given by
         its last member (cut_p, cut_id), which the caller computes (sampler._top_p_cut)
    token = the smallest t with score = max over kept t (the exponential race, ties to the
            smallest id); a row holding a NaN gets id V (the torch path's argmax of a NaN row).
Each row's V ids are cut into SPLIT-id pieces; a program reduces one piece to (max score,
smallest id at it, NaN/+inf/finite seen) and a second kernel reduces a row's pieces in order:
max and min are exact, so the split changes no result. Every float step is one correctly
rounded IEEE op (float64 add/sub/mul, div.rn.f64; launches use enable_fp_fusion=False: no fma),
int64 arithmetic wraps as torch's does, and an element depends only on (its logprob, seed,
sample id, position, id): batch-invariant by construction.
Sources: exponential race as in vLLM's sampler; splitmix64 (Steele, Lea & Flood 2014).

Does not: compute the top-p cut (a sort: rollout/sampler.py), validate values (the engine reads
`bad` at its host checks), or run without CUDA (except under TRITON_INTERPRET=1).
Tests: tests/test_sampler_triton.py (interpreter: == the torch sampler bitwise; PTX);
tests/test_cuda_rollout.py (on a GPU: == the CPU torch sampler).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.triton_elementwise import exp64, log64, neg64
from rlkernel.kernels.triton_util import check_cuda, device_ctx, launch

SPLIT = 4096
"""Vocab ids per program (any multiple of BLOCK_V gives the same tokens)."""
BLOCK_V = 1024

# splitmix64 constants as signed int64 (rollout/sampler.py holds the unsigned originals).
_G = tl.constexpr(0x9E3779B97F4A7C15 - (1 << 64))
_M1 = tl.constexpr(0xBF58476D1CE4E5B9 - (1 << 64))
_M2 = tl.constexpr(0x94D049BB133111EB - (1 << 64))


@triton.jit
def _lshr(z, K: tl.constexpr):
    """Logical right shift of int64 bits (`>>` is arithmetic: mask the sign copies)."""
    return (z >> K) & ((1 << (64 - K)) - 1)


@triton.jit
def _mix(z):
    """splitmix64 finalizer on int64 (multiplication wraps modulo 2**64)."""
    z = (z ^ _lshr(z, 30)) * _M1
    z = (z ^ _lshr(z, 27)) * _M2
    return z ^ _lshr(z, 31)


@triton.jit
def row_state(h_seed, sample_id, position):
    """A row's hash state before the token id: mix(mix(h_seed ^ sample_id + G) ^ position + G)."""
    h = _mix((h_seed ^ sample_id) + _G)
    return _mix((h ^ position) + _G)


@triton.jit
def race_scores(lp, h, ids):
    """float64(logp) − log64(−log64(u)) for float64 lp and int64 ids of one row (state h)."""
    k = _lshr(_mix((h ^ ids) + _G), 12)                 # < 2**52: exact in float64
    u = (k.to(tl.float64) + 0.5) * 2.220446049250313e-16   # 2**-52
    return lp - log64(neg64(log64(u)))


@triton.jit
def _piece_kernel(LP, s_lp, SID, POS, CUT_P, CUT_ID, BEST, ARG, FLAGS, V, n_pieces, h_seed,
                  SPLIT_: tl.constexpr, BLOCK: tl.constexpr, TOP_P: tl.constexpr):
    row = tl.program_id(0)
    piece = tl.program_id(1)
    h = row_state(h_seed, tl.load(SID + row), tl.load(POS + row))
    if TOP_P:
        cut_p = tl.load(CUT_P + row)
        cut_id = tl.load(CUT_ID + row)
    best = tl.full((), float("-inf"), tl.float64)
    arg = tl.full((), 0, tl.int64) + V
    nan_seen = tl.full((), 0, tl.int32)
    inf_seen = tl.full((), 0, tl.int32)
    fin_seen = tl.full((), 0, tl.int32)
    base = LP + row.to(tl.int64) * s_lp
    for v0 in range(piece * SPLIT_, (piece + 1) * SPLIT_, BLOCK):
        ids = v0 + tl.arange(0, BLOCK).to(tl.int64)
        ok = ids < V
        x = tl.load(base + ids, mask=ok, other=float("-inf"))
        nan_seen |= tl.max((x != x).to(tl.int32), 0)   # noqa: PLR0124 - the NaN test
        inf_seen |= tl.max((x == float("inf")).to(tl.int32), 0)
        fin_seen |= tl.max((ok & (x == x) & (x != float("inf")) & (x != float("-inf")))
                           .to(tl.int32), 0)
        lp = x.to(tl.float64)
        score = race_scores(lp, h, ids)
        if TOP_P:
            p = exp64(lp)
            keep = (p > cut_p) | ((p == cut_p) & (ids <= cut_id))
            score = tl.where(keep, score, float("-inf"))
        score = tl.where(ok, score, float("-inf"))
        m = tl.max(score, 0)
        a = tl.min(tl.where(ok & (score == m), ids, V), 0)
        arg = tl.where(m > best, a, tl.where(m == best, tl.minimum(arg, a), arg))
        best = tl.maximum(best, m)
    out = row * n_pieces + piece
    tl.store(BEST + out, best)
    tl.store(ARG + out, arg)
    tl.store(FLAGS + out, nan_seen * 4 + inf_seen * 2 + fin_seen)


@triton.jit
def _rows_kernel(BEST, ARG, FLAGS, TOK, BAD, V, n_pieces, P2: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, P2)
    ok = j < n_pieces
    b = tl.load(BEST + row * n_pieces + j, mask=ok, other=float("-inf"))
    a = tl.load(ARG + row * n_pieces + j, mask=ok, other=V)
    f = tl.load(FLAGS + row * n_pieces + j, mask=ok, other=0)
    m = tl.max(b, 0)
    tok = tl.min(tl.where(ok & (b == m), a, V), 0)
    nan = tl.max(f & 4, 0) != 0
    bad = nan | (tl.max(f & 2, 0) != 0) | (tl.max(f & 1, 0) == 0)
    tl.store(TOK + row, tl.where(nan, V, tok))
    tl.store(BAD + row, bad.to(tl.int8))


def race(logprobs: torch.Tensor, seed_state: int, sample_ids: torch.Tensor,
         positions: torch.Tensor, cut: tuple[torch.Tensor, torch.Tensor] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [S] int64, bad [S] bool) for logprobs [S, V] (fp32, unit stride along V) on CUDA.

    seed_state: sampler._seed_state(seed) as a signed int64 value; sample_ids, positions [S]
    int64 on the logprobs' device; cut: (cut_p [S] float64, cut_id [S] int64) from
    sampler._top_p_cut for top-p < 1, or None (every id kept). bad: a NaN or +inf in the row,
    or no finite entry (sampler.invalid_rows). ValueError on shapes or dtypes it cannot take.
    """
    check_cuda("sampler", logprobs, sample_ids, positions)
    if logprobs.dim() != 2 or logprobs.dtype != torch.float32:
        raise ValueError(f"sampler: [S, V] float32 logprobs expected, got "
                         f"{tuple(logprobs.shape)} {logprobs.dtype}")
    s, v = logprobs.shape
    if logprobs.stride(1) != 1:
        logprobs = logprobs.contiguous()
    dev = logprobs.device
    tok = torch.empty(s, dtype=torch.int64, device=dev)
    bad = torch.empty(s, dtype=torch.int8, device=dev)
    if s == 0:
        return tok, bad.bool()
    pieces = triton.cdiv(v, SPLIT)
    best = torch.empty(s, pieces, dtype=torch.float64, device=dev)
    arg = torch.empty(s, pieces, dtype=torch.int64, device=dev)
    flags = torch.empty(s, pieces, dtype=torch.int32, device=dev)
    cut_p, cut_id = cut if cut is not None else (best, arg)     # unread without top-p
    with device_ctx(logprobs):
        launch(_piece_kernel, (s, pieces),
               logprobs, logprobs.stride(0), sample_ids, positions, cut_p, cut_id, best, arg, flags,
               v, pieces, seed_state, SPLIT_=SPLIT, BLOCK=BLOCK_V, TOP_P=cut is not None,
               num_warps=4, enable_fp_fusion=False)
        launch(_rows_kernel, (s,),
               best, arg, flags, tok, bad, v, pieces, P2=triton.next_power_of_2(pieces),
               num_warps=1)
    return tok, bad.bool()
