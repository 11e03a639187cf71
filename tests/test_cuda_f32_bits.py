"""The dW and dK/dV first passes' fp32 → float64 widening by moving bits
(numerics/triton_fixedpoint.py `f32_bits_in_f64`, `add_f32_exact_or_nan`, `scale_words`), on the
GPU, where the interpreter cannot speak for the compiled code (an arithmetic shift of int32, p − p
not folded to 0, the device's NaN bits).

Exhaustive: every one of the 2**32 fp32 bit patterns widened == the conversion times 2**-896,
bitwise, for each finite value (subnormals and ±0.0 included), and not finite for each ±Inf and
NaN. Random: 2**27 (word, partial) pairs — words that are sums of fp32 values (multiples of
2**-149 up to 2**150), partials drawn near the word's size (borderline exactness) or from every
bit pattern — added in the scaled domain and scaled back == `add_exact_or_nan` of the word and
the converted partial, NaN in the same places. Negative control: the bits moved without the
non-finite OR make every ±Inf and NaN finite.
Skipped without CUDA. Run on the GPU machine:
    PYTHONPATH=. python3 -m pytest -q tests/test_cuda_f32_bits.py
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():   # before the Triton modules: CPU installs have no triton
    pytest.skip("needs a CUDA device", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from rlkernel.numerics import triton_fixedpoint as tfx  # noqa: E402

DEV = "cuda"
CHUNK = 1 << 28      # bit patterns per launch (2 GiB of float64 out)
BLOCK = 1024


@triton.jit
def _widen(P, Q, MOVE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    p = tl.load(P + i)
    if MOVE:
        q = tfx.f32_bits_in_f64(p)
    else:   # the control: without the OR of p − p
        b = p.to(tl.int32, bitcast=True)
        high = (b >> 3) & -1879048193
        low = (b << 29).to(tl.uint32, bitcast=True).to(tl.int64)
        q = ((high.to(tl.int64) << 32) | low).to(tl.float64, bitcast=True)
    tl.store(Q + i, q)


@triton.jit
def _both_adds(H, P, S, U, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(H + i)
    p = tl.load(P + i)
    scaled = tfx.add_f32_exact_or_nan(tfx.scale_words(h, False), p)
    tl.store(S + i, tfx.scale_words(scaled, True))
    tl.store(U + i, tfx.add_exact_or_nan(h, p.to(tl.float64)))


def _patterns(start: int) -> torch.Tensor:
    """fp32 values whose bits are start .. start + CHUNK − 1."""
    x = torch.arange(start, start + CHUNK, device=DEV, dtype=torch.int64)
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32).view(torch.float32)


def test_every_fp32_bit_pattern_widens_to_the_scaled_conversion():
    wrong = finite_from_nonfinite = nonfinite = 0
    for start in range(0, 1 << 32, CHUNK):
        p = _patterns(start)
        q = torch.empty(CHUNK, dtype=torch.float64, device=DEV)
        _widen[(CHUNK // BLOCK,)](p, q, MOVE=True, BLOCK=BLOCK)
        fin = torch.isfinite(p)
        want = p[fin].double() * 2.0**-896
        wrong += int((q[fin].view(torch.int64) != want.view(torch.int64)).sum())
        finite_from_nonfinite += int(torch.isfinite(q[~fin]).sum())
        nonfinite += int((~fin).sum())
        del p, q, fin, want
    assert nonfinite == 2**24      # field 255: ±Inf and the NaNs of both signs
    assert wrong == 0 and finite_from_nonfinite == 0, (wrong, finite_from_nonfinite)


def test_negative_control_without_the_or_nonfinite_values_turn_finite():
    p = torch.tensor([float("inf"), float("-inf"), float("nan")], device=DEV)
    p = torch.cat([p, torch.zeros(BLOCK - 3, device=DEV)])
    q = torch.empty(BLOCK, dtype=torch.float64, device=DEV)
    _widen[(1,)](p, q, MOVE=False, BLOCK=BLOCK)
    assert bool(torch.isfinite(q[:3]).all())
    _widen[(1,)](p, q, MOVE=True, BLOCK=BLOCK)
    assert not bool(torch.isfinite(q[:3]).any())


def test_the_scaled_add_is_the_unscaled_add():
    g = torch.Generator(device=DEV).manual_seed(0)
    n = 1 << 25

    def ints(lo: int, hi: int, dtype=torch.int64) -> torch.Tensor:
        return torch.randint(lo, hi, (n,), device=DEV, generator=g, dtype=dtype)

    flagged = kept = 0
    for r in range(4):
        # words: up to 53 significant bits at exponents from -149 up (sums of fp32 values)
        h = torch.ldexp((ints(0, 2**53) >> ints(0, 53)).double(), ints(-149, 97).double())
        h = h * (ints(0, 2) * 2 - 1)
        if r % 2:   # partials near the word's size: the adds at the edge of exactness
            near = h * torch.tensor([1.0, -1.0, 0.5, -2.0], device=DEV)[ints(0, 4)]
            p = (near.float().view(torch.int32) ^ ints(0, 4, torch.int32)).view(torch.float32)
        else:       # any fp32 bit pattern: subnormals, Inf and NaN among them
            p = ints(-2**31, 2**31 - 1, torch.int32).view(torch.float32)
        s, u = torch.empty_like(h), torch.empty_like(h)
        _both_adds[(n // BLOCK,)](h, p, s, u, BLOCK=BLOCK, enable_fp_fusion=False)
        assert torch.equal(s.isnan(), u.isnan())
        ok = ~u.isnan()
        assert torch.equal(s[ok].view(torch.int64), u[ok].view(torch.int64))
        flagged += int((~ok).sum())
        kept += int(ok.sum())
    assert flagged > n // 8 and kept > n // 8, (flagged, kept)
