"""Triton jit helpers: kernels/elementwise.py's exp sequence, operation for operation, exact
negation, and the pairwise tree over a tile's rows (`tree_rows`). Shared by the Triton kernels that must give the torch path's bits (SwiGLU:
kernels/triton_activation.py; LM-head d logits: kernels/triton_dlogits.py).

exp64(x), float64 -> float64 (elementwise.exp64):
    xc = min(max(x, −745), 709);  n = floor(xc·LOG2E + 0.5);  r = (xc − n·LN2_HI) − n·LN2_LO
    p  = c13;  p = p·r + c_k for k = 12 … 0                 (c_k = 1/k!, elementwise._EXP_COEF)
    e  = (p·2**h)·2**(n−h),  h = floor(n/2), each 2**· built from exponent bits, clamped to
         [−1022, 1023];  e = inf where x > 709, 0 where x < −745, x where x is NaN
exp32(x) = fp32(exp64(float64(x))) (elementwise.exp32: one rounding).
log64(x), float64 -> float64 (elementwise.log64): subnormals scaled by 2**64; m·2**e from the
    exponent bits with m in [√2/2, √2); f = (m − 1)/(m + 1) (div.rn.f64); s = 1/25,
    s = s·f² + 1/k for k = 23, 21, …, 1;  y = (e·LN2_HI + (2f)·s) + e·LN2_LO; 0 -> −inf,
    +inf -> +inf, x < 0 -> NaN, NaN -> x. log32(x) = fp32(log64(float64(x))).
neg32 / neg64: −x as a sign-bit flip, as torch's neg. rotate_half: RoPE's rotation of a tile.
bf16_rtne: fp32 -> bf16 as torch's CPU cast, in integer ops.
Pitfalls these helpers encode (each changes bits if undone):
- Triton's unary minus is 0 − x: −(+0.0) gives +0.0 and a NaN loses its sign; use neg32/neg64.
- A Python float in a binary op with a float64 tensor becomes a float64 constant (exact), but
  tl.fma(p, r, c) or a constant passed where fp32 is inferred rounds it to fp32 first.
- A Python float in a comparison is rounded to fp32 first (√2 moves): log64 compares with
  float64 tensors (tl.full).
- Callers launch with enable_fp_fusion=False: otherwise p·r + c contracts into an fma.
- floor(n/2) is an arithmetic shift of the int64 n; clamps are tl.maximum/minimum (exact).
Every step is one correctly rounded IEEE op on the GPU (float64 add/sub/mul, floor, exact
conversions and integer ops; no libdevice call, so no flush-to-zero).
Constants come from kernels/elementwise.py (one source). Does not: launch anything.
Tests: tests/test_activation_triton.py, tests/test_dlogits_triton.py (interpreter and PTX).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlkernel.kernels import elementwise as ew

# constexpr: a jitted function may read only constexpr globals. Python floats used in a float64
# op become float64 constants, so these are the elementwise module's exact doubles.
LOG2E = tl.constexpr(ew._LOG2E)
LN2_HI = tl.constexpr(ew._LN2_HI)
LN2_LO = tl.constexpr(ew._LN2_LO)
COEF = tl.constexpr(tuple(ew._EXP_COEF))
_N_COEF = tl.constexpr(len(ew._EXP_COEF))
SQRT2 = tl.constexpr(ew._SQRT2)
# log64's odd-series coefficients 1/k, k = 23, 21, ..., 1 (after the initial 1/25): the Python
# doubles elementwise.log64 adds, in its order.
LOG_COEF = tl.constexpr(tuple(1.0 / k for k in range(23, 0, -2)))
_N_LOG = tl.constexpr(len(range(23, 0, -2)))
_MIN_NORMAL = tl.constexpr(2.2250738585072014e-308)
_SIGN64 = tl.constexpr(-(1 << 63))        # the float64 sign bit, as int64
_SIGN32 = tl.constexpr(-(1 << 31))        # the fp32 sign bit, as int32


@triton.jit
def pow2(k):
    """2.0**k as float64 for int64 k (clamped to [-1022, 1023], as exp64 does), from its bits."""
    k = tl.minimum(tl.maximum(k, -1022), 1023)
    return ((k + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def exp64(x):
    """elementwise.exp64 of a float64 tensor, operation for operation."""
    xc = tl.minimum(tl.maximum(x, -745.0), 709.0)
    n = tl.floor(xc * LOG2E + 0.5)
    r = (xc - n * LN2_HI) - n * LN2_LO
    p = tl.full(r.shape, COEF[_N_COEF - 1], tl.float64)
    for i in tl.static_range(_N_COEF - 2, -1, -1):
        p = p * r + COEF[i]
    ni = n.to(tl.int64)
    half = ni >> 1                                     # floor(ni / 2): arithmetic shift
    y = (p * pow2(half)) * pow2(ni - half)
    y = tl.where(x > 709.0, float("inf"), y)
    y = tl.where(x < -745.0, 0.0, y)
    return tl.where(x != x, x, y)                     # noqa: PLR0124 - the NaN test


@triton.jit
def exp32(x):
    """elementwise.exp32 of an fp32 tensor: exp64 in float64, rounded once to fp32."""
    return exp64(x.to(tl.float64)).to(tl.float32)


@triton.jit
def log64(x):
    """elementwise.log64 of a float64 tensor, operation for operation (exact steps may be spelt
    differently: the selects as tl.where, the exponent as an arithmetic shift of positive bits)."""
    # A float constant in a comparison is rounded to fp32 first (√2 would move): compare with
    # float64 tensors instead.
    tiny = x < tl.full(x.shape, _MIN_NORMAL, tl.float64)
    xs = tl.where(tiny, x * 18446744073709551616.0, x)
    xs = tl.where(xs > 0, xs, 1.0)
    xs = tl.where(xs == float("inf"), 1.0, xs)
    bits = xs.to(tl.int64, bitcast=True)
    e = (bits >> 52) - 1023                            # xs > 0: the sign bit is clear
    m = ((bits & ((1 << 52) - 1)) | (1023 << 52)).to(tl.float64, bitcast=True)
    big = m > tl.full(m.shape, SQRT2, tl.float64)
    m = tl.where(big, m * 0.5, m)
    e = e + big.to(tl.int64) - tl.where(tiny, 64, 0).to(tl.int64)
    f = (m - 1.0) / (m + 1.0)                          # float64 `/` lowers to div.rn.f64
    f2 = f * f
    s = tl.full(f.shape, 1.0 / 25.0, tl.float64)
    for i in tl.static_range(_N_LOG):
        s = s * f2 + LOG_COEF[i]
    ef = e.to(tl.float64)
    y = (ef * LN2_HI + ((2.0 * f) * s)) + ef * LN2_LO
    y = tl.where(x == 0, float("-inf"), y)
    y = tl.where(x == float("inf"), float("inf"), y)
    y = tl.where(x < 0, float("nan"), y)
    return tl.where(x != x, x, y)                     # noqa: PLR0124 - the NaN test


@triton.jit
def log32(x):
    """elementwise.log32 of an fp32 tensor: log64 in float64, rounded once to fp32."""
    return log64(x.to(tl.float64)).to(tl.float32)


@triton.jit
def tree_rows(v, BR: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr):
    """Pairwise tree over the last dim of v [BR, C] (C = 2**LOG_C; adjacent pairs, level by
    level, as numerics.trees.tree_sum) -> [BR]: each level is elementwise IEEE adds of the
    same two values, so a row's bits never depend on the tile or the warp layout."""
    for lvl in tl.static_range(LOG_C):
        a, b = tl.split(tl.reshape(v, (BR, C >> (lvl + 1), 2)))
        v = a + b
    return tl.reshape(v, (BR,))


@triton.jit
def bf16_rtne(x):
    """An fp32 tensor rounded to bfloat16 as torch's CPU cast (c10 round_to_nearest_even), in
    integer ops: NaN -> 0x7FC0, otherwise round to nearest, ties to even, from the bits (±Inf,
    overflow to ±Inf and subnormals included). The same bits as cvt.rn.bf16.f32 on finite values;
    spelt out because the interpreter's own fp32 -> bf16 cast truncates."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    r = tl.where(x != x, 0x7FC0, r)                   # noqa: PLR0124 - the NaN test
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def neg64(x):
    """−x of a float64 tensor as torch's neg: the sign bit flipped (−0.0 for +0.0)."""
    return (x.to(tl.int64, bitcast=True) ^ _SIGN64).to(tl.float64, bitcast=True)


@triton.jit
def neg32(x):
    """−x of an fp32 tensor as torch's neg: the sign bit flipped (−0.0 for +0.0)."""
    return (x.to(tl.int32, bitcast=True) ^ _SIGN32).to(tl.float32, bitcast=True)


@triton.jit
def rotate_half(y, yp, cos, sin, first):
    """kernels/rope.apply_rope's y·cos + rot(y)·sin, rot(y) = [−y₂, y₁], per element: yp is
    y at the partner column (i ± D/2), `first` true in the first half. Each product and the
    sum one fp32 rounding (launch with enable_fp_fusion=False). The rollout's norm+RoPE pass
    and the trainer's RoPE pass both call this, so their bytes cannot drift apart."""
    return y * cos + tl.where(first, neg32(yp), yp) * sin
