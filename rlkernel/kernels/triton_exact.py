"""Exact sum of squares of fp32 data on CUDA (Triton): the integer that
rlkernel/numerics/exact.py's ExactSumOfSquares accumulates, in one pass over the data.

Why exact: a fp32 square is exact in float64 (48-bit significand) and a multiple of 2**-298, so
the sum of squares is an integer in units of 2**-298; every split, order and rank count gives
that same integer, and to_tensor() of it is the same bytes as the CPU accumulator's.
Algorithm, per tile of TILE = 4096 elements (a ReproBLAS-style fold, Demmel, Nguyen & Ahrens,
TOMS 46(3) 2020, made exact by running as many folds as the tile's exponent range needs):
  1. mag = bits & 0x7fffffff; the tile's max and min nonzero exponent fields give T (every
     square < 2**T) and the lowest bit any square can have; NaN/±Inf are counted and zeroed
     (a rare branch taken only when the tile's max is non-finite).
  2. q = x·x in float64 (exact). For fold k = 0, 1, ..., u_k = 2**(T − W(k+1)) with W = 40:
        piece = (r + C_k) − C_k,  C_k = 1.5·2**52·u_k   (round r to a multiple of u_k, exact)
        r = r − piece                                     (exact rounding error)
     until u_k is at or below the lowest bit (then r = 0 for every element).
  3. Σ piece over the tile is exact in float64 (|piece| <= 2**W·u_k, 4096 of them < 2**53·u_k),
     so S_k / u_k is an exact integer; it is cut into 32-bit limbs at bit position
     T − W(k+1) + 298 (+64 guard bits) and added to the program's int64 limb vector.
Per-program limb vectors are summed as integers (torch.sum on int64: exact, associative).
Cost per element: one convert, one multiply and 3 float64 adds per fold (usually 2–4 folds),
plus one add per fold for the tile sum — compute-bound on float64, not on 64-bit integers.

Does not: name tensors, round, or take float64 input (numerics/exact.py does all three).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.triton_util import check_cuda, device_ctx, launch

TILE = 4096
FOLD_BITS = 40          # W: fold width; W + log2(TILE) <= 52 keeps every tile sum exact
N_LIMBS = 32            # 32-bit limbs of the per-program total, least significant first
GUARD_BITS = 64         # limb 0 holds bit position −64 (units of 2**-298): folds may go below
N_COUNTERS = 3          # nan, +inf, -inf


@triton.jit
def _sumsq_kernel(X, LIMBS, COUNTS, n, TILE: tl.constexpr, W: tl.constexpr,
                  N_LIMBS: tl.constexpr, GUARD: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    idx = tl.arange(0, N_LIMBS)
    limbs = tl.zeros((N_LIMBS,), dtype=tl.int64)
    cidx = tl.arange(0, 4)
    cnt = tl.zeros((4,), dtype=tl.int64)                  # nan, +inf, -inf, unused
    offs = tl.arange(0, TILE)
    for start in range(pid * TILE, n, nprog * TILE):
        o = offs.to(tl.int64) + start
        x = tl.load(X + o, mask=o < n, other=0.0)
        bits = x.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        mx = tl.max(mag, 0)
        if mx >= 0x7F800000:
            c_nan = tl.sum((mag > 0x7F800000).to(tl.int64), 0)
            c_pinf = tl.sum((bits == 0x7F800000).to(tl.int64), 0)
            c_ninf = tl.sum((bits == -8388608).to(tl.int64), 0)     # 0xFF800000 as int32
            cnt += tl.where(cidx == 0, c_nan, 0) + tl.where(cidx == 1, c_pinf, 0) \
                + tl.where(cidx == 2, c_ninf, 0)
            fin = mag < 0x7F800000
            x = tl.where(fin, x, 0.0)
            mag = tl.where(fin, mag, 0)
            mx = tl.max(mag, 0)
        if mx > 0:
            e_hi = tl.maximum(mx >> 23, 1)
            e_lo = tl.maximum(tl.min(tl.where(mag > 0, mag, 0x7F800000), 0) >> 23, 1)
            top = 2 * e_hi - 252                   # every square < 2**top
            low = 2 * e_lo - 300                   # every square is a multiple of 2**low
            xd = x.to(tl.float64)
            r = xd * xd
            ulp = top - W
            while ulp + W > low:                   # fold until u_k is at or below the low bit
                c = (((ulp + 52 + 1023).to(tl.int64) << 52) | (1 << 51)).to(tl.float64,
                                                                               bitcast=True)
                piece = (r + c) - c
                r = r - piece
                ssum = tl.sum(piece, 0)
                scale = ((1023 - ulp).to(tl.int64) << 52).to(tl.float64, bitcast=True)
                v = (ssum * scale).to(tl.int64)    # exact integer multiple of 2**ulp
                q = ulp + 298 + GUARD              # bit position of v's unit in the limbs
                li = q >> 5
                sh = (q & 31).to(tl.int64)
                a0 = (v & ((1 << (32 - sh)) - 1)) << sh
                rest = v >> (32 - sh)
                b0 = rest & 0xFFFFFFFF
                b1 = rest >> 32
                limbs += tl.where(idx == li, a0, 0) + tl.where(idx == li + 1, b0, 0) \
                    + tl.where(idx == li + 2, b1, 0)
                ulp -= W
    tl.store(LIMBS + pid * N_LIMBS + idx, limbs)
    tl.store(COUNTS + pid * 3 + cidx, cnt, mask=cidx < 3)


_SM_COUNT: dict[int, int] = {}
# (num_warps, programs per SM) for small / big inputs: measured on the H200 (docs/BENCHMARKS.md).
_BIG = 1 << 25
_LAUNCH = {False: (4, 8), True: (2, 32)}


def _programs(x: torch.Tensor, n: int, per_sm: int) -> int:
    if x.is_cuda:
        dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if dev not in _SM_COUNT:
            _SM_COUNT[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
        cap = per_sm * _SM_COUNT[dev]
    else:
        cap = 4
    return max(1, min(cap, triton.cdiv(n, TILE)))


def sum_squares_limbs(x: torch.Tensor, num_warps: int | None = None,
                      programs_per_sm: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact Σ x² of a fp32 CUDA tensor as device tensors (limbs [N_LIMBS] int64, counts [3]).

    total = Σ_i limbs[i]·2**(32·i − GUARD_BITS) in units of 2**-298 (an exact non-negative
    integer; limbs are signed and unnormalised); counts = (nan, +inf, −inf), whose elements are
    left out of the total. Any shape; every element is read once. No host synchronisation.
    Launch shape: `_LAUNCH` by size unless given (the total is exact, so it never changes a bit).
    """
    check_cuda("exact norm", x)
    if x.dtype != torch.float32:
        raise ValueError(f"exact norm: float32 expected, got {x.dtype}")
    flat = x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    if n == 0:
        z = torch.zeros(N_LIMBS, dtype=torch.int64, device=x.device)
        return z, torch.zeros(N_COUNTERS, dtype=torch.int64, device=x.device)
    big = n >= _BIG
    num_warps = num_warps or _LAUNCH[big][0]
    progs = _programs(x, n, programs_per_sm or _LAUNCH[big][1])
    limbs = torch.empty(progs, N_LIMBS, dtype=torch.int64, device=x.device)
    counts = torch.empty(progs, N_COUNTERS, dtype=torch.int64, device=x.device)
    with device_ctx(x):
        launch(_sumsq_kernel, (progs,),
               flat, limbs, counts, n, TILE=TILE, W=FOLD_BITS, N_LIMBS=N_LIMBS, GUARD=GUARD_BITS,
               num_warps=num_warps)
    return limbs.sum(0), counts.sum(0)


def limbs_to_int(limbs: torch.Tensor) -> int:
    """The exact total (units of 2**-298) of a [N_LIMBS] int64 limb vector (or a sum of them)."""
    total = sum(int(v) << (32 * i) for i, v in enumerate(limbs.cpu().tolist()))
    if total < 0 or total & ((1 << GUARD_BITS) - 1):
        raise AssertionError("exact norm: limb total is not a non-negative multiple of the unit")
    return total >> GUARD_BITS
