"""The sampler's Triton race (rlkernel/kernels/triton_sampler.py) without a GPU.

1. Under TRITON_INTERPRET=1 (Triton on the CPU; checks in tests/sampler_triton_checks.py, one
   subprocess): tokens == the torch sampler (rollout/sampler.py) at top-p 1 and < 1 (tied
   logprobs, −inf ids, several pieces per row), flags == invalid_rows, per-element race scores
   and the Triton log64 == the torch float64 sequences in bits, split and batch invariance, and
   negative controls (another seed; a top-p cut without its id).
2. The code the GPU would run: the piece kernel compiled for sm_90 (PTX, no device needed)
   has no fma and no flush-to-zero, rounds every float64 op to nearest, divides with
   div.rn.f64 only, and carries log64's and exp64's constants as exact doubles; control: with
   fp fusion on, fma appears.
On a GPU: tests/test_cuda_rollout.py (CUDA race == CPU torch sampler; the engine's bytes).
Run: PYTHONPATH=. .venv/bin/python -m pytest -q tests/test_sampler_triton.py (needs triton;
about a minute).
"""

from __future__ import annotations

import re

from kernel_helpers import NEEDS_TRITON, check_ok as _ok, checks_fixture, ptx_double, sm90_ptx

pytestmark = NEEDS_TRITON
results = checks_fixture("sampler_triton_checks.py")


def test_log64_equals_the_torch_log64(results):
    """Triton log64 == elementwise.log64 in float64 bits, √2 fold, subnormals and specials."""
    _ok(results, "log64_equals_the_torch_log64")


def test_race_scores_equal_the_torch_scores(results):
    """Per-element race scores (hash, uniform, two log64s) == the torch sampler's, in bits."""
    _ok(results, "race_scores_equal_the_torch_scores")


def test_race_tokens_equal_the_torch_sampler(results):
    """Tokens == sample_tokens' torch ops (not the race, which sample_tokens itself dispatches
    to under the interpreter) for top-p 1 … 1e-9, tied logprobs and tied scores, −inf ids,
    several pieces per row."""
    _ok(results, "race_tokens_equal_the_torch_sampler")


def test_flags_equal_invalid_rows(results):
    """bad == invalid_rows (NaN, +inf, all −inf rows); NaN rows draw id V."""
    _ok(results, "flags_equal_invalid_rows_and_nan_rows_draw_v")


def test_sample_tokens_on_the_race_validates(results):
    """sample_tokens(validate=True) on race-drawn rows refuses NaN, +inf, no-finite and
    unnormalised rows as the torch path does; valid rows: the race's tokens."""
    _ok(results, "sample_tokens_on_the_race_validates")


def test_split_and_batch_change_no_token(results):
    """Any piece/block split, and a row alone or in batches of 7 and 13: the same tokens."""
    _ok(results, "pieces_blocks_and_batch_change_no_token")


def test_negative_controls_differ(results):
    """Another seed, or a top-p cut without its id, gives other tokens (the checks can fail)."""
    _ok(results, "negative_controls_differ")


def _ptx(fusion: bool) -> str:
    """PTX of the piece kernel as `race` launches it (top-p on: every path), for sm_90."""
    from rlkernel.kernels import triton_sampler as ts
    types = ["*fp32", "i64", "*i64", "*i64", "*fp64", "*i64", "*fp64", "*i64", "*i32", "i32",
             "i32", "i64", "constexpr", "constexpr", "constexpr"]
    consts = {"SPLIT_": ts.SPLIT, "BLOCK": ts.BLOCK_V, "TOP_P": True}
    return sm90_ptx(ts._piece_kernel, types, consts, 4, fusion)


def test_compiled_ptx_has_no_fma_no_ftz_and_exact_constants():
    """sm_90 PTX of the piece kernel (enable_fp_fusion=False, as launched): no fma, no .ftz, no
    .approx; float64 add/sub/mul all .rn; the only divisions are log64's div.rn.f64; log64's
    series 1/k, √2, 2**64 and exp64's Taylor coefficients are exact doubles in the code.
    Control: compiled with fp fusion on, fma appears."""
    from rlkernel.kernels import elementwise as ew
    ptx = _ptx(False)
    assert "fma" not in ptx and ".ftz" not in ptx and ".approx" not in ptx
    assert not re.search(r"\b(add|sub|mul)\.f64\b", ptx)
    assert set(re.findall(r"\bdiv\.\w+\.f64\b", ptx)) == {"div.rn.f64"}
    for c in (*[1.0 / k for k in range(25, 0, -2)], ew._SQRT2, 2.0**64, *ew._EXP_COEF[2:],
              ew._LN2_HI, ew._LN2_LO):
        assert ptx_double(c) in ptx, c
    assert "fma.rn.f64" in _ptx(True)
