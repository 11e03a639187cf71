"""Exact fixed-point sums on CUDA (Triton): `accumulate_` (acc += Σ over dim 0 of x, the integer
that rlkernel/numerics/fixedpoint.py's torch path `_add_chunk`, the CPU reference, adds) and
`round_fp32` (an accumulator's sum rounded once to fp32, the bytes of fixedpoint.round_fp32_torch),
each in one pass.

Why: the torch path runs a float64 index_add_ and a Python loop over active bins with a host sync
per chunk; called on every token-leaf partial of every weight it made a qwen3-0.6b training step
on an H200 ~10x slower. Here one program owns BLOCK elements (one per thread lane) and walks the
k rows of x [k, m] itself: no atomics, no temporaries, no host sync.

Fast path first (FAST, the default; `fast=False` skips it): the program adds each of its columns
into a float64 double word (hi, lo) with TwoSum (`two_sum`, Knuth, TAOCP vol. 2 §4.2.2), every lo
addition checked exact (its own TwoSum error is 0). Every value is a multiple of 2**-149, so then
hi + lo is the exact sum; `flush_double_word` adds both words' integers to the digits
(`add_f64`: a float64 multiple of 2**-149 below 2**150 is ±mant·2**sh units, placed at digit
sh // 31). If any column of the program failed (a span of ~2**100, NaN/Inf, |hi| >= 2**150), the
program runs the bins below over the same rows instead: either way the same integer. Cost per
value: one conversion and ~13 float64 operations, against ~80 mostly integer instructions in
the bins (214 -> 73 ms of accumulate per qwen3-0.6b step on an H200). `add_double_words_` takes
double words made elsewhere (kernels/triton_grad_weight.py) into an accumulator.
`accumulate_segments_` is the same sum over segments of rows (CSR offsets) into per-segment
accumulator rows, one launch (the embedding gradient: each id's leaf partials into its row):
its `_segments_kernel` runs `_accumulate_rows`, the plain kernel's whole body, once per (segment,
block of columns), so a segment's bytes are those `accumulate_` gives it, fast path or bins.
Bin path, per element (the same two stages as `_add_chunk`, fixedpoint.py's docstring has the
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

Rounding (`round_fp32`, `_round_kernel`). Why: the torch path is ~100 strided int64 ops over the
[m, 13] accumulator (two carry passes of 9 steps, gathers, masks); a qwen3-0.6b step on an H200
spent ~2.3 s of 8.5 s in them (every weight-gradient chunk and attention dK/dV sum is rounded).
Here a lane owns one row: it loads the 13 columns once, and in registers repeats the torch path's
steps in the same int64 arithmetic (so even digits whose carries wrap int64 give the same bytes):
normalise; sign = top digit < 0; |sum| = normalise(−digits); the top non-zero digit t >= 1 and
the window (digit t, digit t − 1) < 2**62 with the digits below as sticky bits; round to 24
significant bits, half to even; over-range (top digit >= 2**31, or < 0 after the negation wrapped)
-> Inf. The fp32 is then built from integers (`_fp32_bits`), not by the torch path's float64
product and cast: both give the one fp32 equal to q·2**e (exact: at most 24 significant bits,
>= 2**-149) or Inf beyond 2**128, and integers cannot meet a device's flush-to-zero of subnormals
or an inexact ldexp/exp2. Then −, and NaN/±Inf from the counts as the module doc of fixedpoint.py
says. Exact zero is +0.0 by construction (all digits 0 once normalised: not negative, q = 0).
`fixedpoint.normalise_` gets no kernel: on CUDA only the torch references and tests call it.

Rounding a double word (`round_double_words`, `_round_words_kernel`). Why: where one rank holds
all the leaves of a weight (direct mode, scope group of one: distributed/tokensum.py), no
integers are to be added to the dW kernel's double words, so the digits were only a way to
round them — 2.43 ms plus zeroing a 104-byte accumulator per element at 6144×2048 on an H200,
against 0.12 ms for a float cast. Here a lane reads (hi, lo), takes (s, e) = TwoSum, rounds s
to odd (one bit-pattern step toward e when e != 0 and s's last bit is 0) and converts with
cvt.rn.f32.f64: Boldo & Melquiond's round-to-odd theorem makes that the one rounding of
hi + lo (fixedpoint.round_double_words_torch says why, and is the reference). The conversion
instruction is used, not `_fp32_bits`: its rounding is the point, and a PTX test pins it to
round-to-nearest without .ftz (so fp32 subnormals survive).

Does not: run on CPU (fixedpoint.py is the reference and dispatches here for CUDA tensors; under
TRITON_INTERPRET=1 the kernels run on CPU tensors for tests), take other dtypes than fp32 (the
caller converts bf16/fp16 exactly), or communicate. BLOCK/num_warps change speed, never bits.
Tests: TRITON_INTERPRET=1 via tests/test_fixedpoint_triton.py (rounding cases:
tests/fixedpoint_round_cases.py; also the PTX of `_round_words_kernel`); on a GPU
tests/test_cuda.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.triton_util import check_cuda, device_ctx, launch

N_DIGITS = 10
N_COLS = N_DIGITS + 3   # must equal fixedpoint.N_COLS (asserted by the tests)
SEG = 1 << 13           # rows per float64 bin flush: keeps every bin sum exact (see above)
BLOCK = 128             # elements per program, one per lane of its num_warps warps
NUM_WARPS = 4
UNROLL = 8              # rows loaded per loop step: loads in flight hide DRAM latency
MIN_PROGRAMS = 512      # accumulate_ cuts the rows into parts below this many column programs
PART_ROWS = 64          # ... of at least this many rows each (speed only: the same bytes)
TOP_F64_BITS = tl.constexpr((1023 + 150) << 52)   # 2**150 as float64 bits: add_f64's bound


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
def _add_bin(s, J: tl.constexpr, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9):
    """Digits += the exact float64 sum s of bin J (an integer multiple of 2**UNIT below 2**52)."""
    UNIT: tl.constexpr = 16 * J - 150 + (J == 0)        # log2 u_J = max(16J, 1) − 150
    Q: tl.constexpr = (UNIT + 149) // 31                 # digit of u_J
    R: tl.constexpr = (UNIT + 149) % 31                  # bit of u_J within that digit
    # 2**-UNIT written into the exponent field: exact (|UNIT| <= 149, a normal float64).
    scale = tl.full([], (1023 - UNIT) << 52, tl.int64).to(tl.float64, bitcast=True)
    n = (s * scale).to(tl.int64)                         # exact: |n| < 2**52
    return _add_scaled(n, Q, R, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)


@triton.jit
def _add_scaled(n, q, r, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9):
    """Digits += n·2**(31·q + r) for a signed int64 |n| < 2**53, r in [0, 31), q <= 7 (q, r
    constexpr or per-element): n's low 31 bits and the rest, shifted by r, spread over digits
    q, q+1, q+2 (every part < 2**62)."""
    lo = (n & 0x7FFFFFFF) << r                           # < 2**61
    hi = (n >> 31) << r                                  # signed, |hi| < 2**53
    a0 = lo & 0x7FFFFFFF
    a1 = (lo >> 31) + (hi & 0x7FFFFFFF)
    a2 = hi >> 31
    d0 = _put_at(d0, 0, q, a0, a1, a2)
    d1 = _put_at(d1, 1, q, a0, a1, a2)
    d2 = _put_at(d2, 2, q, a0, a1, a2)
    d3 = _put_at(d3, 3, q, a0, a1, a2)
    d4 = _put_at(d4, 4, q, a0, a1, a2)
    d5 = _put_at(d5, 5, q, a0, a1, a2)
    d6 = _put_at(d6, 6, q, a0, a1, a2)
    d7 = _put_at(d7, 7, q, a0, a1, a2)
    d8 = _put_at(d8, 8, q, a0, a1, a2)
    d9 = _put_at(d9, 9, q, a0, a1, a2)
    return d0, d1, d2, d3, d4, d5, d6, d7, d8, d9


@triton.jit
def _put_at(d, i: tl.constexpr, q, a0, a1, a2):
    """Digit i of a contribution (a0, a1, a2) at digits (q, q+1, q+2); a constexpr q folds."""
    return d + tl.where(q == i, a0, 0) + tl.where(q + 1 == i, a1, 0) + tl.where(q + 2 == i, a2, 0)


@triton.jit
def _load_digits(row, live):
    """The 10 digit columns of accumulator rows (pointers `row`), carry-normalised."""
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
    return _carry(d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)


@triton.jit
def _store_digits(row, live, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9):
    """Carry-normalise the digits and write them back to the rows' digit columns."""
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


@triton.jit
def _flush(row, live, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15,
           n_nan, n_pinf, n_ninf):
    """Accumulator rows (pointers `row`, N_COLS int64 each) += the 16 bin sums and the counts."""
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _load_digits(row, live)
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
    _store_digits(row, live, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    tl.store(row + 10, tl.load(row + 10, mask=live, other=0) + n_nan.to(tl.int64), mask=live)
    tl.store(row + 11, tl.load(row + 11, mask=live, other=0) + n_pinf.to(tl.int64), mask=live)
    tl.store(row + 12, tl.load(row + 12, mask=live, other=0) + n_ninf.to(tl.int64), mask=live)


@triton.jit
def two_sum(a, b):
    """(s, e): s = fl(a + b) and its exact rounding error e = a + b − s (Knuth's TwoSum, TAOCP
    vol. 2 §4.2.2; needs round-to-nearest and no mul+add contraction: launch with
    enable_fp_fusion=False)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


@triton.jit
def two_sum_sorted(a, b):
    """(s, e) of `two_sum` (the same two values: s = fl(a + b) and its exact error are unique;
    a zero error may differ in sign, which `add_word` does not read) by Dekker's Fast2Sum on
    the operands ordered by magnitude (Dekker 1971; exact when |big| >= |small|, round to
    nearest): one compare and three float64 adds instead of six adds, the ordering done by
    integer selects. Launch with enable_fp_fusion=False."""
    swap = tl.abs(a) < tl.abs(b)
    big = tl.where(swap, b, a)
    small = tl.where(swap, a, b)
    s = big + small
    return s, small - (s - big)


@triton.jit
def add_word(hi, lo, n_inexact, p):
    """(hi, lo, n_inexact) after adding the float64 tile p exactly into the double words (hi, lo)
    while at most one add per element is inexact: hi, e = TwoSum(hi, p); a nonzero error e is
    stored in lo (the last one; with at most one, the only one), and n_inexact (int32) counts
    them. `words_exact` says whether hi + lo is still the exact sum (n_inexact <= 1, hi in
    range).

    Why one error slot: fl(hi + p) is exact unless p has bits below ulp(hi), i.e. unless the
    leaf partial is ~2**-29 of the running sum or smaller, which is rare (zeros, the usual
    padding and prompt partials, are exact). Adding every e into lo by a second checked TwoSum
    cost six more float64 ops per leaf and element — most of the passes that call this — to
    cover what a tile's fallback covers. An element with two inexact adds flags its tile; a
    NaN/inf partial makes e NaN and hi non-finite, which `words_exact` refuses. The words are
    those of the old two-TwoSum scheme whenever neither flags (lo = 0 + e + 0 … = e).
    The error comes from `two_sum_sorted`: the same e as `two_sum`, two float64 ops fewer
    (3.5 % of the dW pass on an H200, docs/BENCHMARKS.md).
    Launch with enable_fp_fusion=False (TwoSum)."""
    hi, e = two_sum_sorted(hi, p)
    nz = e != 0.0
    return hi, tl.where(nz, e, lo), n_inexact + nz.to(tl.int32)


@triton.jit
def add_exact_or_nan(hi, p):
    """hi += p (float64 tiles) where the add must be exact: s = fl(hi + p) is exact iff
    s − hi == p and s − p == hi; an element whose add is inexact becomes NaN, and stays NaN
    (NaN + p is NaN, and fails the check again), so `word_in_range` refuses it at the end. No
    error word is kept.

    Why both differences: of hi and p, the one larger in magnitude gives an exact difference
    (Dekker's Fast2Sum lemma, round to nearest), so an inexact add fails that comparison
    whichever operand is larger; one comparison alone can pass an inexact add (hi = 1 + 2**-52,
    p = 2**53: s − hi rounds back to p). A NaN or infinite p fails one of them (NaN compares
    unequal; inf − inf is NaN). Against `add_word`: no magnitude ordering and no error slot —
    on an H200 the float64 work of the dW pass halves (docs/BENCHMARKS.md) — and an element
    with one inexact add flags its tile for the checked retry (`add_word_checked`), which
    gives the same words `add_word` did. The flag in hi rather than an int32 tile saves a
    [tile] int32 of registers (the dW first pass and the attention dK/dV pass, whose
    double-word tiles are large). Launch with enable_fp_fusion=False."""
    s = hi + p
    inexact = ((s - hi) != p) | ((s - p) != hi)
    return tl.where(inexact, float("nan"), s)


@triton.jit
def word_in_range(hi):
    """Per element: whether hi is finite and |hi| < 2**150 (TOP_F64_BITS), the words' bound —
    `words_exact` for a word built by `add_exact_or_nan` (NaN there: an inexact add)."""
    top = tl.full([], TOP_F64_BITS, tl.int64).to(tl.float64, bitcast=True)
    return tl.abs(hi) < top


@triton.jit
def add_word_checked(hi, lo, n_inexact, p):
    """As `add_word`, but every error goes into lo through a second TwoSum whose own error must
    be 0 (a failed lo add counts 2, past what `words_exact` accepts): slower (six more float64
    ops), and exact over a far wider spread of partials (up to ~2**100). The retry tier for
    tiles that `add_word` flagged."""
    hi, e = two_sum(hi, p)
    lo, e2 = two_sum(lo, e)
    return hi, lo, n_inexact + 2 * (e2 != 0.0).to(tl.int32)


@triton.jit
def words_exact(hi, n_inexact):
    """Per element: whether the double word that `add_word` built holds its exact sum within
    add_f64's range (|hi| < 2**150, finite; at most one inexact add)."""
    return (n_inexact <= 1) & word_in_range(hi)


@triton.jit
def add_f64(v, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9):
    """Digits += v exactly: v a finite float64, an integer multiple of 2**-149 below 2**150
    (TOP_F64_BITS) in magnitude (sums of fp32 values are multiples of 2**-149); q <= 7, so a2 lands in
    digit 9 at most. v = ±mant·2**(e − 1075) with a 53-bit mant, i.e.
    ±mant·2**sh units of 2**-149, sh = e − 926 (mant >> −sh when sh < 0: those bits are 0); the
    signed n = ±mant goes in at digit q = sh // 31, bit r = sh % 31, as `_add_bin` does."""
    bits = v.to(tl.int64, bitcast=True)
    e = (bits >> 52) & 0x7FF
    mant = tl.where(e > 0, (bits & 0xFFFFFFFFFFFFF) | 0x10000000000000, 0)
    sh = e - 926
    mant = tl.where(sh < 0, mant >> tl.minimum(-sh, 63), mant)
    sh = tl.maximum(sh, 0)
    n = tl.where(bits < 0, -mant, mant)
    return _add_scaled(n, sh // 31, sh % 31, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)


@triton.jit
def flush_double_word(row, live, hi, lo):
    """Accumulator rows (pointers `row`, N_COLS int64 each) += hi + lo, two finite float64
    multiples of 2**-149 (a checked double word: `two_sum` errors all exact); counts unchanged."""
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _load_digits(row, live)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = add_f64(hi, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = add_f64(lo, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    _store_digits(row, live, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)


@triton.jit
def _accumulate_kernel(X, ACC, k, m, s_k, s_m, N_COLS: tl.constexpr, SEG: tl.constexpr,
                       BLOCK: tl.constexpr, UNROLL: tl.constexpr, FAST: tl.constexpr):
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = cols < m
    row = ACC + cols * N_COLS
    sk = tl.zeros([], dtype=tl.int64) + s_k              # int64: UNROLL·s_k must not wrap
    _accumulate_rows(X + cols * s_m, row, live, k, sk, SEG, BLOCK, UNROLL, FAST)


@triton.jit
def _segments_kernel(X, ACC, OFFS, DEST, m, n_blocks, s_k, s_m, N_COLS: tl.constexpr,
                     SEG: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
                     FAST: tl.constexpr):
    # One program per (segment g, block of BLOCK columns), on one grid axis (a CUDA grid's
    # second axis stops at 65535): rows [OFFS[g], OFFS[g + 1]) of x into accumulator row DEST[g].
    pid = tl.program_id(0).to(tl.int64)
    g = pid // n_blocks
    cols = (pid % n_blocks) * BLOCK + tl.arange(0, BLOCK)
    first = tl.load(OFFS + g)                             # int64: first * s_k cannot wrap
    k = tl.load(OFFS + g + 1) - first
    if k > 0:   # an empty segment leaves its row's bytes alone (no carry pass), as the torch path
        live = cols < m
        row = ACC + (tl.load(DEST + g) * m + cols) * N_COLS
        sk = tl.zeros([], dtype=tl.int64) + s_k
        _accumulate_rows(X + first * sk + cols * s_m, row, live, k, sk, SEG, BLOCK, UNROLL, FAST)


@triton.jit
def _accumulate_rows(ptr, row, live, k, sk, SEG: tl.constexpr, BLOCK: tl.constexpr,
                     UNROLL: tl.constexpr, FAST: tl.constexpr):
    """Accumulator rows (pointers `row`, N_COLS int64 each) += the exact sum of the k values a
    lane reads at `ptr`, `ptr + sk`, ... (int64 sk; lanes where `live`): the double-word fast
    path, else (a lane of the block failed it) the bins. The body of both kernels above."""
    todo = k                                              # rows left for the bin path
    if FAST:
        # Fast path: every column's values added into a float64 double word (hi, lo) with
        # TwoSum, each lo addition checked exact; taken when no column of the program failed.
        lim = tl.where(live, k, 0)
        hi = tl.zeros([BLOCK], dtype=tl.float64)
        lo = tl.zeros([BLOCK], dtype=tl.float64)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        p = ptr
        for start in range(0, k, UNROLL):
            for u in tl.static_range(UNROLL):
                x = tl.load(p + u * sk, mask=start + u < lim, other=0.0)
                hi, e = two_sum(hi, x.to(tl.float64))
                lo, e2 = two_sum(lo, e)
                bad |= (e2 != 0.0).to(tl.int32)           # NaN/Inf make e2 NaN: bad too
            p += UNROLL * sk
        top = tl.full([], TOP_F64_BITS, tl.int64).to(tl.float64, bitcast=True)
        bad |= (tl.abs(hi) >= top).to(tl.int32)           # add_f64's range (> 2**22 fp32 maxima)
        if tl.max(bad, 0) == 0:
            flush_double_word(row, live, hi, lo)
            todo = todo * 0
    for seg in range(0, todo, SEG):
        end = tl.minimum(seg + SEG, todo)
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


@triton.jit
def _double_word_kernel(W, ACC, m, s_w, N_COLS: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = cols < m
    hi = tl.load(W + cols, mask=live, other=0.0)
    lo = tl.load(W + s_w + cols, mask=live, other=0.0)
    flush_double_word(ACC + cols * N_COLS, live, hi, lo)


def add_double_words_(acc: torch.Tensor, words: torch.Tensor, block: int = BLOCK,
                      num_warps: int = NUM_WARPS) -> torch.Tensor:
    """acc [m, N_COLS] int64 (contiguous) += words[0] + words[1] exactly, in place; returns acc,
    normalised. words [2, m] float64 (rows contiguous): per element a double word (hi, lo) of
    finite multiples of 2**-149 with |hi| < 2**150 whose sum is the value to add — what a
    checked TwoSum accumulation leaves (kernels/triton_grad_weight.py); the caller guarantees
    it (values outside it would be added wrongly, not refused). No host sync."""
    check_cuda("fixedpoint double words", acc, words)
    m = acc.shape[0]
    if (words.dtype != torch.float64 or tuple(words.shape) != (2, m)
            or words.stride(1) != 1):
        raise ValueError(f"fixedpoint double words: float64 [2, {m}] with contiguous rows "
                         f"expected, got {words.dtype} {tuple(words.shape)}")
    if acc.dtype != torch.int64 or acc.dim() != 2 or acc.shape[1] != N_COLS \
            or not acc.is_contiguous():
        raise ValueError(f"fixedpoint double words: contiguous int64 [m, {N_COLS}] accumulator "
                         f"expected, got {acc.dtype} {tuple(acc.shape)}")
    if m:
        with device_ctx(acc):
            launch(_double_word_kernel, (triton.cdiv(m, block),),
                   words, acc, m, words.stride(0), N_COLS=N_COLS, BLOCK=block, num_warps=num_warps)
    return acc


def accumulate_(acc: torch.Tensor, x: torch.Tensor, block: int = BLOCK,
                num_warps: int = NUM_WARPS, seg: int = SEG, fast: bool = True,
                min_programs: int = MIN_PROGRAMS) -> torch.Tensor:
    """acc [m, N_COLS] int64 (contiguous) += the exact sum of x [k, m] fp32 over dim 0, in place;
    returns acc, normalised (fixedpoint.normalise_'s form). Any strides of x. No host sync.
    `block`/`num_warps` (launch), `seg` (rows per bin flush: a multiple of UNROLL up to SEG,
    smaller only to test flushes cheaply under the interpreter), `fast` (try the double-word
    path first; False: bins only) and `min_programs` never change a bit.

    When the columns alone make fewer than `min_programs` programs (a norm weight's [leaves, H]
    partials: 16 programs walking 1,024 rows, or one walking 16,384), the rows are cut into parts
    of at least PART_ROWS, each summed exactly into its own accumulator by one segmented launch,
    and the parts' integers added into acc (`_add_parts`): integer sums are exact in any order,
    and the normal form is unique, so the bytes are those of the single pass."""
    k, m = _check_values("fixedpoint accumulate", x, seg, acc)
    if acc.dtype != torch.int64 or tuple(acc.shape) != (m, N_COLS) or not acc.is_contiguous():
        raise ValueError(f"fixedpoint accumulate: contiguous int64 [{m}, {N_COLS}] accumulator "
                         f"expected, got {acc.dtype} {tuple(acc.shape)}")
    if k == 0 or m == 0:
        return acc
    blocks = triton.cdiv(m, block)
    parts = min(k // PART_ROWS, triton.cdiv(min_programs, blocks))
    if parts > 1:
        return _add_parts(acc, x, parts, block, num_warps, seg, fast)
    with device_ctx(x):
        launch(_accumulate_kernel, (blocks,),
               x, acc, k, m, x.stride(0), x.stride(1), N_COLS=N_COLS, SEG=seg, BLOCK=block,
               UNROLL=UNROLL, FAST=fast, num_warps=num_warps, enable_fp_fusion=False)
    return acc


@triton.jit
def _parts_kernel(X, ACC, k, step, parts, m, n_blocks, s_k, s_m, N_COLS: tl.constexpr,
                  SEG: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
                  FAST: tl.constexpr):
    # One program per (part g, block of BLOCK columns): rows [g·step, (g + 1)·step) of x (the
    # last part to k) into accumulator row g. The bounds are computed here, not read from
    # offsets made on the device: building those took a blocking host-to-device copy per call.
    pid = tl.program_id(0).to(tl.int64)
    g = pid // n_blocks
    cols = (pid % n_blocks) * BLOCK + tl.arange(0, BLOCK)
    first = g * step
    n = tl.where(g == parts - 1, k - first, step)
    live = cols < m
    sk = tl.zeros([], dtype=tl.int64) + s_k
    _accumulate_rows(X + first * sk + cols * s_m, ACC + (g * m + cols) * N_COLS, live, n, sk,
                     SEG, BLOCK, UNROLL, FAST)


@triton.jit
def _add_digits_kernel(S, ACC, m, N_COLS: tl.constexpr, BLOCK: tl.constexpr):
    """ACC rows += S rows (int64 digit and count columns), carry-normalised."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = cols < m
    row, srow = ACC + cols * N_COLS, S + cols * N_COLS
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _load_digits(row, live)
    _store_digits(row, live, d0 + tl.load(srow + 0, mask=live, other=0),
                  d1 + tl.load(srow + 1, mask=live, other=0),
                  d2 + tl.load(srow + 2, mask=live, other=0),
                  d3 + tl.load(srow + 3, mask=live, other=0),
                  d4 + tl.load(srow + 4, mask=live, other=0),
                  d5 + tl.load(srow + 5, mask=live, other=0),
                  d6 + tl.load(srow + 6, mask=live, other=0),
                  d7 + tl.load(srow + 7, mask=live, other=0),
                  d8 + tl.load(srow + 8, mask=live, other=0),
                  d9 + tl.load(srow + 9, mask=live, other=0))
    for c in tl.static_range(10, N_COLS):      # the NaN / +Inf / -Inf counts after the digits
        tl.store(row + c, tl.load(row + c, mask=live, other=0)
                 + tl.load(srow + c, mask=live, other=0), mask=live)


def _add_parts(acc: torch.Tensor, x: torch.Tensor, parts: int, block: int, num_warps: int,
               seg: int, fast: bool) -> torch.Tensor:
    """`accumulate_` over `parts` row ranges at once (see there): each range's exact sum in its
    own zeroed accumulator (one launch), their integers summed (each digit of a normalised part
    is below 2**31, so parts · 2**31 stays far from int64's range), added into acc and
    normalised. No host sync. (A kernel looping over the parts per column block in place of
    torch's sum made the path 25.7 ms per qwen3-1.7b step on an H200 against < 3.5 ms: a Q/K
    norm's 128 columns are one program.)"""
    k, m = x.shape
    rows = torch.zeros(parts, m, N_COLS, dtype=torch.int64, device=x.device)
    n_blocks = triton.cdiv(m, block)
    with device_ctx(x):
        launch(_parts_kernel, (parts * n_blocks,),
               x, rows, k, k // parts, parts, m, n_blocks, x.stride(0), x.stride(1), N_COLS=N_COLS,
               SEG=seg, BLOCK=block, UNROLL=UNROLL, FAST=fast, num_warps=num_warps,
               enable_fp_fusion=False)
        launch(_add_digits_kernel, (n_blocks,),
               rows.sum(0), acc, m, N_COLS=N_COLS, BLOCK=block, num_warps=num_warps)
    return acc


def accumulate_segments_(acc: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                         dest: torch.Tensor, block: int = BLOCK, num_warps: int = NUM_WARPS,
                         seg: int = SEG, fast: bool = True) -> torch.Tensor:
    """Segmented `accumulate_`, one launch: for every segment g, acc[dest[g]] [m, N_COLS] += the
    exact sum of rows offsets[g] .. offsets[g + 1] − 1 of x [n, m] fp32 (any strides), in place;
    returns acc [r, m, N_COLS] int64 (contiguous). Rows of a non-empty segment leave normalised,
    an empty segment's row and rows that are no segment's dest are not touched. offsets int64
    [G + 1] (contiguous, non-decreasing, 0 .. n), dest int64 [G] (contiguous, distinct rows in
    [0, r)): the caller guarantees these values (checking them needs a host sync;
    fixedpoint.accumulate_segments_ does) — a repeated dest would race, an index out of range
    reads or writes out of bounds. No host sync. Launch arguments as `accumulate_`: no bit."""
    n, m = _check_values("fixedpoint segments", x, seg, acc, offsets, dest)
    if acc.dtype != torch.int64 or acc.dim() != 3 or tuple(acc.shape[1:]) != (m, N_COLS) \
            or not acc.is_contiguous():
        raise ValueError(f"fixedpoint segments: contiguous int64 [r, {m}, {N_COLS}] accumulator "
                         f"expected, got {acc.dtype} {tuple(acc.shape)}")
    g = dest.numel()
    if (offsets.dtype != torch.int64 or dest.dtype != torch.int64 or dest.dim() != 1
            or tuple(offsets.shape) != (g + 1,) or not offsets.is_contiguous()
            or not dest.is_contiguous()):
        raise ValueError(f"fixedpoint segments: contiguous int64 offsets [G + 1] and dest [G] "
                         f"expected, got {offsets.dtype} {tuple(offsets.shape)} and {dest.dtype} "
                         f"{tuple(dest.shape)}")
    if n == 0 or m == 0 or g == 0:
        return acc
    n_blocks = triton.cdiv(m, block)
    with device_ctx(x):
        launch(_segments_kernel, (g * n_blocks,),
               x, acc, offsets, dest, m, n_blocks, x.stride(0), x.stride(1), N_COLS=N_COLS, SEG=seg,
               BLOCK=block, UNROLL=UNROLL, FAST=fast, num_warps=num_warps, enable_fp_fusion=False)
    return acc


def _check_values(what: str, x: torch.Tensor, seg: int, *others: torch.Tensor) -> tuple[int, int]:
    """The checks both accumulate wrappers make of the values x (fp32 [k, m]), the flush length
    `seg` and the devices; (k, m). ValueError naming `what`."""
    check_cuda(what, x, *others)
    if seg % UNROLL or not 0 < seg <= SEG:
        raise ValueError(f"{what}: seg {seg} must be a multiple of {UNROLL} in [{UNROLL}, {SEG}]")
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"{what}: fp32 [k, m] expected, got {x.dtype} {tuple(x.shape)}")
    return x.shape[0], x.shape[1]


# ------------------------------------------------------------------------------------ rounding
ROUND_BLOCK = 128       # accumulator rows per program of the rounding kernel, one per lane
ROUND_WARPS = 4
# fp32 bit patterns as int32 (constexpr: a jitted function may read only constexpr globals).
_F32_INF = tl.constexpr(0x7F800000)
_F32_NINF = tl.constexpr(-8388608)      # 0xFF800000
_F32_NAN = tl.constexpr(0x7FC00000)     # the quiet NaN torch writes for float("nan")
_F32_SIGN = tl.constexpr(-2147483648)   # 0x80000000


@triton.jit
def _bit_length(x):
    """Bit length of int64 x in [0, 2**53) (0 for 0), exactly as fixedpoint._bit_length: the
    exponent field of x as float64 (an exact conversion below 2**53), read from the bits.
    x < 0 gives 0 (the callers select such lanes away, as the torch path does)."""
    e = (x.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1022
    return tl.where(x > 0, e, 0)


@triton.jit
def _scan(I: tl.constexpr, d, d_below, t, hi, lo, rest, seen):
    """One step (digit I >= 2, upwards) of the search for the top non-zero digit t: if digit I
    is non-zero it becomes the window's top (hi = d, lo = d_below = digit I − 1) and `rest`
    (sticky: a non-zero digit below I − 1) is `seen`, which then takes in digit I − 1."""
    top = d != 0
    t = tl.where(top, I, t)
    hi = tl.where(top, d, hi)
    lo = tl.where(top, d_below, lo)
    rest = tl.where(top, seen, rest)
    seen = seen | (d_below != 0)
    return t, hi, lo, rest, seen


@triton.jit
def _round_up(q, half, sticky):
    """1 where the 24-bit q rounds up: round-half-even — the first dropped bit `half` is set and
    a lower dropped bit (`sticky`) is, or q is odd (a tie goes to even). int64 0/1 inputs."""
    return half & (sticky | (q & 1))


@triton.jit
def _fp32_bits(q, e2):
    """fp32 bit pattern (int32) of q·2**e2 for int64 q in [0, 2**24], e2 in [-149, 287]: built
    from integers, no float arithmetic (no ldexp/exp2, no reliance on how a float64 -> float32
    cast treats subnormals on the device). The value is an integer number of 2**-149 units with
    at most 24 significant bits, so it is an fp32 exactly, or beyond the range (>= 2**128): +Inf,
    as the torch path's exact float64 product cast to float32 gives."""
    n = _bit_length(q)       # 1..24 bits; 25 for 2**24 (a rounding carry: frac 0, e one up)
    e = e2 + n - 1                                       # q·2**e2 in [2**e, 2**(e+1))
    frac = (q << tl.maximum(24 - n, 0)) & 0x7FFFFF      # significand without its leading 1
    normal = ((e + 127) << 23) | frac                    # e in [-126, 127]
    sub = q << tl.minimum(e2 + 149, 23)                  # e < -126: q·2**(e2+149) < 2**23 units
    bits = tl.where(e > 127, _F32_INF, tl.where(e >= -126, normal, sub))
    return tl.where(q == 0, 0, bits).to(tl.int32)


@triton.jit
def _round_digits(d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, n_nan, n_pinf, n_ninf,
                  BLOCK: tl.constexpr):
    """fp32 [BLOCK]: the exact sums held by digits d0..d9 (int64 [BLOCK], any digits) and the
    NaN/+Inf/−Inf counts, each rounded once (fixedpoint.round_fp32_torch's steps)."""
    # The torch path's steps, in the same int64 arithmetic (wrapping alike on absurd digits):
    # normalise, sign = top digit, |sum| = normalise(−digits).
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _carry(d0, d1, d2, d3, d4, d5, d6, d7, d8, d9)
    neg = d9 < 0
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = _carry(
        tl.where(neg, -d0, d0), tl.where(neg, -d1, d1), tl.where(neg, -d2, d2),
        tl.where(neg, -d3, d3), tl.where(neg, -d4, d4), tl.where(neg, -d5, d5),
        tl.where(neg, -d6, d6), tl.where(neg, -d7, d7), tl.where(neg, -d8, d8),
        tl.where(neg, -d9, d9))
    # Window = digits (t, t − 1), t = max(top non-zero digit, 1); rest = a non-zero digit below.
    t = tl.full([BLOCK], 1, tl.int64)
    hi, lo = d1, d0
    rest = tl.zeros([BLOCK], tl.int1)
    seen = d0 != 0
    t, hi, lo, rest, seen = _scan(2, d2, d1, t, hi, lo, rest, seen)
    t, hi, lo, rest, seen = _scan(3, d3, d2, t, hi, lo, rest, seen)
    t, hi, lo, rest, seen = _scan(4, d4, d3, t, hi, lo, rest, seen)
    t, hi, lo, rest, seen = _scan(5, d5, d4, t, hi, lo, rest, seen)
    t, hi, lo, rest, seen = _scan(6, d6, d5, t, hi, lo, rest, seen)
    t, hi, lo, rest, seen = _scan(7, d7, d6, t, hi, lo, rest, seen)
    t, hi, lo, rest, seen = _scan(8, d8, d7, t, hi, lo, rest, seen)
    t, hi, lo, rest, seen = _scan(9, d9, d8, t, hi, lo, rest, seen)
    # Only the top digit can be >= 2**31 (or < 0: it wrapped when negated): beyond every fp32.
    over = (hi >> 31) != 0
    hi = tl.where(over, 0, hi)
    window = (hi << 31) + lo                              # < 2**62
    nbits = tl.where(hi > 0, _bit_length(hi) + 31, _bit_length(lo))
    s = tl.maximum(nbits - 24, 0)                         # bits dropped below 24 significant ones
    sm1 = tl.maximum(s - 1, 0)                            # clamped before shifting, as torch does
    q = window >> s
    half = tl.where(s > 0, (window >> sm1) & 1, 0)
    one = tl.full([BLOCK], 1, tl.int64)
    sticky = ((s > 1) & ((window & ((one << sm1) - 1)) != 0)) | rest
    q += _round_up(q, half, sticky.to(tl.int64))          # q <= 2**24
    bits = _fp32_bits(q, s + (t - 1) * 31 - 149)
    bits = tl.where(over, _F32_INF, bits)
    # −val (also −Inf). An exact zero has all digits 0 once normalised, so it is not `neg`,
    # q = 0 and it stays +0.0 (the torch path's explicit zero rule holds without a select).
    bits = tl.where(neg, bits | _F32_SIGN, bits)
    pinf = n_pinf > 0
    ninf = n_ninf > 0
    bits = tl.where(pinf, _F32_INF, bits)
    bits = tl.where(ninf, _F32_NINF, bits)
    bits = tl.where((n_nan > 0) | (pinf & ninf), _F32_NAN, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_kernel(ACC, OUT, m, s_m, s_c, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = rows < m
    p = ACC + rows * s_m
    s_c = tl.zeros([], dtype=tl.int64) + s_c             # int64: 12·s_c must not wrap int32
    d0 = tl.load(p + 0 * s_c, mask=live, other=0)
    d1 = tl.load(p + 1 * s_c, mask=live, other=0)
    d2 = tl.load(p + 2 * s_c, mask=live, other=0)
    d3 = tl.load(p + 3 * s_c, mask=live, other=0)
    d4 = tl.load(p + 4 * s_c, mask=live, other=0)
    d5 = tl.load(p + 5 * s_c, mask=live, other=0)
    d6 = tl.load(p + 6 * s_c, mask=live, other=0)
    d7 = tl.load(p + 7 * s_c, mask=live, other=0)
    d8 = tl.load(p + 8 * s_c, mask=live, other=0)
    d9 = tl.load(p + 9 * s_c, mask=live, other=0)
    n_nan = tl.load(p + 10 * s_c, mask=live, other=0)
    n_pinf = tl.load(p + 11 * s_c, mask=live, other=0)
    n_ninf = tl.load(p + 12 * s_c, mask=live, other=0)
    out = _round_digits(d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, n_nan, n_pinf, n_ninf, BLOCK)
    tl.store(OUT + rows, out, mask=live)


@triton.jit
def _round_words_sum_kernel(W, OUT, m, n_parts, s_p, s_w, BLOCK: tl.constexpr):
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = cols < m
    z = tl.zeros([BLOCK], tl.int64)
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = z, z, z, z, z, z, z, z, z, z
    s_p = tl.zeros([], dtype=tl.int64) + s_p             # int64: P·s_p may pass 2**31
    for r in range(n_parts):
        base = W + r * s_p
        hi = tl.load(base + cols, mask=live, other=0.0)
        lo = tl.load(base + s_w + cols, mask=live, other=0.0)
        d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = add_f64(hi, d0, d1, d2, d3, d4, d5, d6, d7,
                                                         d8, d9)
        d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 = add_f64(lo, d0, d1, d2, d3, d4, d5, d6, d7,
                                                         d8, d9)
    out = _round_digits(d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, z, z, z, BLOCK)
    tl.store(OUT + cols, out, mask=live)


def round_words_sum(words: torch.Tensor, block: int = ROUND_BLOCK,
                    num_warps: int = ROUND_WARPS) -> torch.Tensor:
    """words [P, 2, m] float64 (each part's rows contiguous) -> fp32 [m]: per element the exact
    sum of the P double words hi + lo, rounded once — bytewise round_fp32 of the digits that
    P `add_double_words_` passes leave (the sum of several ranks' dW words, distributed/
    tokensum.py), in one pass: the digits live in registers (10 int64 a lane), so the 104-byte
    accumulator is never written. Contract of `add_double_words_` for every word (not checked);
    the digits hold P < 2**20 parts' sums without a carry pass. No host sync. Raises ValueError
    for another dtype or layout, or a non-CUDA tensor (any device under TRITON_INTERPRET=1)."""
    check_cuda("fixedpoint round words sum", words)
    if words.dtype != torch.float64 or words.dim() != 3 or words.shape[1] != 2 \
            or words.stride(2) != 1 or words.shape[0] >= 1 << 20:
        raise ValueError(f"fixedpoint round words sum: float64 [P, 2, m] (P < 2**20) with "
                         f"contiguous rows expected, got {words.dtype} {tuple(words.shape)}")
    m = words.shape[2]
    out = torch.empty(m, dtype=torch.float32, device=words.device)
    if m == 0:
        return out
    with device_ctx(words):
        launch(_round_words_sum_kernel, (triton.cdiv(m, block),), words, out, m, words.shape[0],
               words.stride(0), words.stride(1), BLOCK=block, num_warps=num_warps)
    return out


def round_fp32(acc: torch.Tensor, block: int = ROUND_BLOCK,
               num_warps: int = ROUND_WARPS) -> torch.Tensor:
    """acc int64 [m, N_COLS] (any strides; any digits, e.g. a sum of accumulators) -> fp32 [m]:
    each row's exact sum rounded once, the bytes of fixedpoint.round_fp32_torch. One pass: a
    row's 13 columns are read once, carried, rounded and the fp32 written; acc is not modified.
    No host sync. `block`/`num_warps` change speed, never bits.
    Raises ValueError for another dtype or shape, or a non-CUDA tensor (any device under
    TRITON_INTERPRET=1)."""
    check_cuda("fixedpoint round", acc)
    if acc.dtype != torch.int64 or acc.dim() != 2 or acc.shape[1] != N_COLS:
        raise ValueError(f"fixedpoint round: int64 [m, {N_COLS}] accumulator expected, got "
                         f"{acc.dtype} {tuple(acc.shape)}")
    m = acc.shape[0]
    out = torch.empty(m, dtype=torch.float32, device=acc.device)
    if m == 0:
        return out
    with device_ctx(acc):
        launch(_round_kernel, (triton.cdiv(m, block),),
               acc, out, m, acc.stride(0), acc.stride(1), BLOCK=block, num_warps=num_warps)
    return out


# ------------------------------------------------------------------- rounding a double word
WORDS_BLOCK = 1024      # elements per program of round_double_words (8 per lane at 4 warps)
WORDS_WARPS = 4
_F64_NEG_ZERO = tl.constexpr(-(1 << 63))   # −0.0 as int64 bits


@triton.jit
def _round_words_kernel(W, OUT, m, s_w, BLOCK: tl.constexpr):
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = cols < m
    hi = tl.load(W + cols, mask=live, other=0.0)
    lo = tl.load(W + s_w + cols, mask=live, other=0.0)
    # s = RN64(hi + lo), e exact; then round to odd: an inexact s with an even last bit moves
    # one unit toward e (int64 bit patterns are monotone in magnitude, e's sign says which way).
    s, e = two_sum(hi, lo)
    bits = s.to(tl.int64, bitcast=True)
    toward = tl.where((bits ^ e.to(tl.int64, bitcast=True)) < 0, -1, 1)
    bits += tl.where((e != 0.0) & ((bits & 1) == 0), toward, 0)
    bits = tl.where(bits == _F64_NEG_ZERO, 0, bits)     # hi = lo = −0.0: the zero is +0.0
    # cvt.rn.f32.f64 (no .ftz: tests/test_fixedpoint_triton.py reads the PTX): round-half-even
    # to fp32, subnormals and overflow to ±Inf as IEEE says.
    out = bits.to(tl.float64, bitcast=True).to(tl.float32)
    tl.store(OUT + cols, out, mask=live)


def round_double_words(words: torch.Tensor, block: int = WORDS_BLOCK,
                       num_warps: int = WORDS_WARPS,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """words [2, m] float64 (rows contiguous, any row stride) -> fp32 [m]: per element the exact
    hi + lo rounded once to fp32, round-half-even, ±Inf past the range, an exact zero +0.0 —
    bytewise `round_fp32(add_double_words_(zeros, words))`, in one pass and without the
    104-byte accumulator. Same contract as `add_double_words_` (finite multiples of 2**-149,
    |hi| < 2**150: a checked TwoSum accumulation; not checked here). Method and why it is the
    direct rounding: fixedpoint.round_double_words_torch, the CPU reference (same steps).
    No host sync. `block`/`num_warps` change speed, never bits. `out`: a contiguous fp32 [m]
    on the words' device to write into (returned), instead of a new tensor. Launched with
    enable_fp_fusion=False (TwoSum). Raises ValueError for another dtype, shape or layout (of
    words or out), or a non-CUDA tensor (any device under TRITON_INTERPRET=1)."""
    check_cuda("fixedpoint round double words", words)
    if words.dtype != torch.float64 or words.dim() != 2 or words.shape[0] != 2 \
            or words.stride(1) != 1:
        raise ValueError(f"fixedpoint round double words: float64 [2, m] with contiguous rows "
                         f"expected, got {words.dtype} {tuple(words.shape)}")
    m = words.shape[1]
    if out is None:
        out = torch.empty(m, dtype=torch.float32, device=words.device)
    elif (out.dtype != torch.float32 or out.shape != (m,) or not out.is_contiguous()
          or out.device != words.device):
        raise ValueError(f"fixedpoint round double words: out must be a contiguous fp32 [{m}] "
                         f"on {words.device}, got {out.dtype} {tuple(out.shape)} on "
                         f"{out.device}")
    if m:
        with device_ctx(words):
            launch(_round_words_kernel, (triton.cdiv(m, block),),
                   words, out, m, words.stride(0), BLOCK=block, num_warps=num_warps,
                   enable_fp_fusion=False)
    return out
