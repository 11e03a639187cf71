"""Exact fixed-point accumulation on CUDA (Triton): `acc += Σ over dim 0 of x`, the integer that
rlkernel/numerics/fixedpoint.py's torch path (`_add_chunk`, the CPU reference) adds, in one pass.

Why: the torch path runs a float64 index_add_ and a Python loop over active bins with a host sync
per chunk; called on every token-leaf partial of every weight it made a qwen3-0.6b training step
on an H200 ~10x slower. Here one program owns BLOCK elements (one per thread lane) and walks the
k rows of x [k, m] itself: no atomics, no temporaries, no host sync.

Algorithm, per element (the same two stages as `_add_chunk`, fixedpoint.py's docstring has the
representation):
  1. Each value goes by its exponent field f to float64 register bin j = f >> 4 (16 bins). All
     values of bin j are integer multiples of u_j = 2**(max(16j, 1) − 150) below 2**39·u_j, so up
     to SEG = 2**13 of them sum exactly in float64 (|sum| < 2**52·u_j), in any order. NaN/±Inf
     (field 255) are counted per value into the three flag columns and left out of the bins.
  2. Every SEG rows and at the end (`_flush`): read the element's accumulator row, carry-normalise
     it, add each bin's exact integer n_j = sum_j / u_j (times 2**-unit built from the exponent
     bits: exact; torch.ldexp on CUDA was measured inexact) split into base-2**31 digits at digit
     q = (unit + 149) // 31, shift r = (unit + 149) % 31, carry-normalise again and write back.
     The accumulator leaves normalised (digits 0..8 in [0, 2**31), top digit signed), i.e. the
     unique form `fixedpoint.normalise_` gives, so it is bytewise the torch path's.
Bounds (int64): a loaded row is normalised first (its digits < 2**31 except the signed top).
|n_j| < 2**52; its low part (n_j & MASK) << r < 2**61 and high part (n_j >> 31) << r, |.| < 2**51,
add < 2**31, < 2**32 and <= 2**20 to digits q, q+1, q+2. At most 16 bins add to a digit: < 2**36,
so no digit nears 2**63 before the next carry pass. Flag counts are int32 per segment (<= SEG).
Cost per value (SASS for sm_90, BLOCK 128, 4 warps: 70-72 registers, no spills): ~86 instructions,
16 of them float64 adds (one compare, two selects and an add per bin); UNROLL = 8 row loads are
issued before they are used.

Does not: run on CPU (fixedpoint.py is the reference and dispatches here for CUDA tensors; under
TRITON_INTERPRET=1 the kernel runs on CPU tensors for tests), take other dtypes than fp32 (the
caller converts bf16/fp16 exactly), or communicate. BLOCK/num_warps change speed, never bits.
Tests: TRITON_INTERPRET=1 via tests/test_fixedpoint_triton.py; on a GPU tests/test_cuda.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.triton_util import check_cuda, device_ctx

N_DIGITS = 10
N_COLS = N_DIGITS + 3   # must equal fixedpoint.N_COLS (asserted by the tests)
SEG = 1 << 13           # rows per float64 bin flush: keeps every bin sum exact (see above)
BLOCK = 128             # elements per program, one per lane of its num_warps warps
NUM_WARPS = 4
UNROLL = 8              # rows loaded per loop step: loads in flight hide DRAM latency


@triton.jit
def _carry1(lo, hi):
    """(lo, hi) -> (lo mod 2**31, hi + floor(lo / 2**31)): `>>` on int64 is arithmetic."""
    return lo & 0x7FFFFFFF, hi + (lo >> 31)


@triton.jit
def _carry(d0, d1, d2, d3, d4, d5, d6, d7, d8, d9):
    """Carry-normalise 10 int64 digits (base 2**31) as fixedpoint.normalise_ does: digits 0..8
    to [0, 2**31), the top one signed. The form is unique for a value: equal values, equal bytes."""
    d0, d1 = _carry1(d0, d1)
    d1, d2 = _carry1(d1, d2)
    d2, d3 = _carry1(d2, d3)
    d3, d4 = _carry1(d3, d4)
    d4, d5 = _carry1(d4, d5)
    d5, d6 = _carry1(d5, d6)
    d6, d7 = _carry1(d6, d7)
    d7, d8 = _carry1(d7, d8)
    d8, d9 = _carry1(d8, d9)
    return d0, d1, d2, d3, d4, d5, d6, d7, d8, d9


@triton.jit
def _put(d, I: tl.constexpr, Q: tl.constexpr, a0, a1, a2):
    """Digit I of a contribution (a0, a1, a2) at digits (Q, Q+1, Q+2): resolved at compile time."""
    if I == Q:
        d += a0
    if I == Q + 1:
        d += a1
    if I == Q + 2:
        d += a2
    return d


@triton.jit
def _add_bin(s, J: tl.constexpr, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9):
    """Digits += the exact float64 sum s of bin J (an integer multiple of 2**UNIT below 2**52)."""
    UNIT: tl.constexpr = 16 * J - 150 + (J == 0)        # log2 u_J = max(16J, 1) − 150
    Q: tl.constexpr = (UNIT + 149) // 31                 # digit of u_J
    R: tl.constexpr = (UNIT + 149) % 31                  # bit of u_J within that digit
    # 2**-UNIT written into the exponent field: exact (|UNIT| <= 149, a normal float64).
    scale = tl.full([], (1023 - UNIT) << 52, tl.int64).to(tl.float64, bitcast=True)
    n = (s * scale).to(tl.int64)                         # exact: |n| < 2**52
    lo = (n & 0x7FFFFFFF) << R                           # < 2**61
    hi = (n >> 31) << R                                  # signed, |hi| < 2**51
    a0 = lo & 0x7FFFFFFF
    a1 = (lo >> 31) + (hi & 0x7FFFFFFF)
    a2 = hi >> 31
    d0 = _put(d0, 0, Q, a0, a1, a2)
    d1 = _put(d1, 1, Q, a0, a1, a2)
    d2 = _put(d2, 2, Q, a0, a1, a2)
    d3 = _put(d3, 3, Q, a0, a1, a2)
    d4 = _put(d4, 4, Q, a0, a1, a2)
    d5 = _put(d5, 5, Q, a0, a1, a2)
    d6 = _put(d6, 6, Q, a0, a1, a2)
    d7 = _put(d7, 7, Q, a0, a1, a2)
    d8 = _put(d8, 8, Q, a0, a1, a2)
    d9 = _put(d9, 9, Q, a0, a1, a2)
    return d0, d1, d2, d3, d4, d5, d6, d7, d8, d9


@triton.jit
def _flush(row, live, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15,
           n_nan, n_pinf, n_ninf):
    """Accumulator rows (pointers `row`, N_COLS int64 each) += the 16 bin sums and the counts."""
    d0 = tl.load(row + 0, mask=live, other=0)
    d1 = tl.load(row + 1, mask=live, other=0)
    d2 = tl.load(row + 2, mask=live, other=0)
    d3 = tl.load(row + 3, mask=live, other=0)
    d4 = tl.load(row + 4, mask=live, other=0)
    d5 = tl.load(row + 5, mask=live, other=0)
    d6 = tl.load(row + 6, mask=live, other=0)
    d7 = tl.load(row + 7, mask=live, other=0)
    d8 = tl.load(row + 8, mask=live, other=0)
    d9 = tl.load(row + 9, mask=live, other=0)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _carry(d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b0, 0, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b1, 1, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b2, 2, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b3, 3, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b4, 4, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b5, 5, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b6, 6, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b7, 7, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b8, 8, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b9, 9, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b10, 10, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b11, 11, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b12, 12, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b13, 13, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b14, 14, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _add_bin(b15, 15, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _carry(d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    tl.store(row + 0, d0, mask=live)
    tl.store(row + 1, d1, mask=live)
    tl.store(row + 2, d2, mask=live)
    tl.store(row + 3, d3, mask=live)
    tl.store(row + 4, d4, mask=live)
    tl.store(row + 5, d5, mask=live)
    tl.store(row + 6, d6, mask=live)
    tl.store(row + 7, d7, mask=live)
    tl.store(row + 8, d8, mask=live)
    tl.store(row + 9, d9, mask=live)
    tl.store(row + 10, tl.load(row + 10, mask=live, other=0) + n_nan.to(tl.int64), mask=live)
    tl.store(row + 11, tl.load(row + 11, mask=live, other=0) + n_pinf.to(tl.int64), mask=live)
    tl.store(row + 12, tl.load(row + 12, mask=live, other=0) + n_ninf.to(tl.int64), mask=live)


@triton.jit
def _accumulate_kernel(X, ACC, k, m, s_k, s_m, N_COLS: tl.constexpr, SEG: tl.constexpr,
                       BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = cols < m
    row = ACC + cols * N_COLS
    sk = tl.zeros([], dtype=tl.int64) + s_k              # int64: UNROLL·s_k must not wrap
    ptr = X + cols * s_m                                  # row `start` of x, advanced by sk
    for seg in range(0, k, SEG):
        end = tl.minimum(seg + SEG, k)
        lim = tl.where(live, end, 0)                      # row r of an element is read iff r < lim
        zero = tl.zeros([BLOCK], dtype=tl.float64)
        b0, b1, b2, b3, b4, b5, b6, b7 = zero, zero, zero, zero, zero, zero, zero, zero
        b8, b9, b10, b11, b12, b13, b14, b15 = zero, zero, zero, zero, zero, zero, zero, zero
        n_nan = tl.zeros([BLOCK], dtype=tl.int32)
        n_pinf = tl.zeros([BLOCK], dtype=tl.int32)
        n_ninf = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(seg, end, UNROLL):
            for u in tl.static_range(UNROLL):
                # Rows past `end` read as +0.0: bin 0 gains nothing.
                x = tl.load(ptr + u * sk, mask=start + u < lim, other=0.0)
                bits = x.to(tl.int32, bitcast=True)
                mag = bits & 0x7FFFFFFF
                n_nan += (mag > 0x7F800000).to(tl.int32)
                n_pinf += (bits == 0x7F800000).to(tl.int32)
                n_ninf += (bits == -8388608).to(tl.int32)      # 0xFF800000 as int32
                j = tl.where(mag < 0x7F800000, mag >> 27, 16)  # bin = field >> 4; Inf/NaN: none
                v = x.to(tl.float64)
                b0 += tl.where(j == 0, v, 0.0)
                b1 += tl.where(j == 1, v, 0.0)
                b2 += tl.where(j == 2, v, 0.0)
                b3 += tl.where(j == 3, v, 0.0)
                b4 += tl.where(j == 4, v, 0.0)
                b5 += tl.where(j == 5, v, 0.0)
                b6 += tl.where(j == 6, v, 0.0)
                b7 += tl.where(j == 7, v, 0.0)
                b8 += tl.where(j == 8, v, 0.0)
                b9 += tl.where(j == 9, v, 0.0)
                b10 += tl.where(j == 10, v, 0.0)
                b11 += tl.where(j == 11, v, 0.0)
                b12 += tl.where(j == 12, v, 0.0)
                b13 += tl.where(j == 13, v, 0.0)
                b14 += tl.where(j == 14, v, 0.0)
                b15 += tl.where(j == 15, v, 0.0)
            ptr += UNROLL * sk
        _flush(row, live, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15,
               n_nan, n_pinf, n_ninf)


def accumulate_(acc: torch.Tensor, x: torch.Tensor, block: int = BLOCK,
                num_warps: int = NUM_WARPS, seg: int = SEG) -> torch.Tensor:
    """acc [m, N_COLS] int64 (contiguous) += the exact sum of x [k, m] fp32 over dim 0, in place;
    returns acc, normalised (fixedpoint.normalise_'s form). Any strides of x. No host sync.
    `block`/`num_warps` (launch) and `seg` (rows per bin flush: a multiple of UNROLL up to SEG,
    smaller only to test flushes cheaply under the interpreter) never change a bit."""
    check_cuda("fixedpoint accumulate", acc, x)
    if seg % UNROLL or not 0 < seg <= SEG:
        raise ValueError(f"fixedpoint accumulate: seg {seg} must be a multiple of {UNROLL} "
                         f"in [{UNROLL}, {SEG}]")
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"fixedpoint accumulate: fp32 [k, m] expected, got {x.dtype} "
                         f"{tuple(x.shape)}")
    k, m = x.shape
    if acc.dtype != torch.int64 or tuple(acc.shape) != (m, N_COLS) or not acc.is_contiguous():
        raise ValueError(f"fixedpoint accumulate: contiguous int64 [{m}, {N_COLS}] accumulator "
                         f"expected, got {acc.dtype} {tuple(acc.shape)}")
    if k == 0 or m == 0:
        return acc
    with device_ctx(x):
        _accumulate_kernel[(triton.cdiv(m, block),)](
            x, acc, k, m, x.stride(0), x.stride(1), N_COLS=N_COLS, SEG=seg, BLOCK=block,
            UNROLL=UNROLL, num_warps=num_warps)
    return acc
