"""Elementwise transcendental functions that give the same bits for an element wherever it sits.

Why not torch.exp / torch.log: on CPU, torch runs the vectorised (SLEEF) body of a tensor and a
scalar libm loop on the tail and on per-thread chunk ends, and the two may differ by an ulp. Which
elements land in the tail depends on the tensor's size and the thread count, so a logit's exp
would depend on batch size. Here every function is a fixed sequence of IEEE-754 add, mul, div,
floor, comparisons and integer bit operations, each correctly rounded on every code path: the
result of an element depends only on its own value. Work is done in float64 so the final fp32
result is almost always the correctly rounded one (accuracy ~1e-15 relative before rounding).

The functions are torch ops, so they run on CPU or CUDA tensors alike (float64 math on the GPU as
well); the Triton kernels carry their own copies of these sequences.
Does not: provide autograd (see kernels/ ops that use these).
"""

from __future__ import annotations

import torch

_LOG2E = 1.4426950408889634
# ln2 split so that n * _LN2_HI is exact for |n| < 2**20 (Cody & Waite range reduction).
_LN2_HI = 0.6931471803691238
_LN2_LO = 1.9082149292705877e-10
_LN2 = 0.6931471805599453
_SQRT2 = 1.4142135623730951
# Taylor coefficients 1/k! for exp on |r| <= ln2/2 (k = 0..13): truncation error < 2e-16.
_EXP_COEF = [1.0 / float(__import__("math").factorial(k)) for k in range(14)]


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2.0**n as float64 for integer-valued int64 n in [-1022, 1023], built from the exponent bits."""
    return torch.bitwise_left_shift(n + 1023, 52).view(torch.float64)


def exp64(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for a float64 tensor; same shape, float64. -inf -> 0, +inf -> inf, NaN -> NaN.

    Algorithm: n = round(x·log2 e), r = x − n·ln2 (two-part ln2), exp(r) by Horner on its Taylor
    series, scaled by 2**n in two exact steps (so results down to fp32 subnormals are kept).
    """
    x = x.to(torch.float64)
    xc = torch.clamp(x, -745.0, 709.0)
    n = torch.floor(xc * _LOG2E + 0.5)
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_COEF[-1])
    for c in reversed(_EXP_COEF[:-1]):
        p = p * r + c
    ni = n.to(torch.int64)
    half = torch.div(ni, 2, rounding_mode="floor")
    y = p * _pow2(torch.clamp(half, -1022, 1023)) * _pow2(torch.clamp(ni - half, -1022, 1023))
    y = torch.where(x > 709.0, torch.full_like(y, float("inf")), y)
    y = torch.where(x < -745.0, torch.zeros_like(y), y)
    return torch.where(torch.isnan(x), x, y)


def log64(x: torch.Tensor) -> torch.Tensor:
    """Natural log of a float64 tensor of positive normal numbers; 0 -> -inf, inf -> inf, <0 -> NaN.

    Algorithm: x = m·2**e with m in [sqrt(2)/2, sqrt(2)) from the exponent bits; log m = 2·atanh(f),
    f = (m−1)/(m+1), |f| < 0.172, by its odd series to f**25; log x = e·ln2 + log m.
    Subnormal inputs are scaled by 2**64 first.
    """
    x = x.to(torch.float64)
    tiny = x < 2.2250738585072014e-308
    xs = torch.where(tiny, x * 18446744073709551616.0, x)
    xs = torch.where(xs > 0, xs, torch.ones_like(xs))
    xs = torch.where(torch.isinf(xs), torch.ones_like(xs), xs)
    bits = xs.view(torch.int64)
    e = torch.bitwise_right_shift(bits, 52) - 1023
    m = torch.bitwise_or(torch.bitwise_and(bits, (1 << 52) - 1), 1023 << 52).view(torch.float64)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)
    e = e + big.to(torch.int64) - torch.where(tiny, 64, 0)
    f = (m - 1.0) / (m + 1.0)
    f2 = f * f
    s = torch.full_like(f, 1.0 / 25.0)
    for k in range(23, 0, -2):
        s = s * f2 + 1.0 / k
    ef = e.to(torch.float64)
    y = (ef * _LN2_HI + (2.0 * f * s)) + ef * _LN2_LO
    y = torch.where(x == 0, torch.full_like(y, float("-inf")), y)
    y = torch.where(torch.isinf(x) & (x > 0), torch.full_like(y, float("inf")), y)
    y = torch.where(x < 0, torch.full_like(y, float("nan")), y)
    return torch.where(torch.isnan(x), x, y)


def exp32(x: torch.Tensor) -> torch.Tensor:
    """exp of an fp32 tensor, returned as fp32 (one rounding from the float64 result)."""
    return exp64(x.to(torch.float64)).to(torch.float32)


def log32(x: torch.Tensor) -> torch.Tensor:
    """log of an fp32 tensor, returned as fp32 (one rounding from the float64 result)."""
    return log64(x.to(torch.float64)).to(torch.float32)


def sigmoid32(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(−x)) of an fp32 tensor, as fp32, computed in float64 and rounded once."""
    return (1.0 / (1.0 + exp64(-x.to(torch.float64)))).to(torch.float32)


def rsqrt32(x: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(x) of an fp32 tensor as fp32: two float64 ops, rounded once. torch's float64 CPU
    sqrt is one ulp off for some values (AVX2, torch 2.13), which changes no fp32 result: a √ up
    to 2 float64 ulps off gives the same bits for every fp32 x
    (tests/test_kernels_elementwise_norm.py)."""
    return (1.0 / torch.sqrt(x.to(torch.float64))).to(torch.float32)
