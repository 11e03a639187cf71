"""The log-softmax finish kernel (rlkernel/kernels/triton_logprobs.finish_stats) without a GPU.

1. Under TRITON_INTERPRET=1 (Triton on the CPU): (lse, entropy) == the torch path on CPU
   (logprobs.merge_shard_stats, lse = m + log32(s), entropy = lse − t/s), bitwise (NaN payloads
   aside: swiglu_cases.same_bits), on random, real and adversarial per-shard stats
   (tests/logprobs_finish_cases.py) for 1, 2, 3, 5, 8, 16 shards, with negative controls. The
   checks live in tests/logprobs_finish_triton_checks.py and run in one subprocess (the
   interpreter is chosen before triton is imported); each test asserts one.
2. The code the GPU would run: the kernel compiled for sm_90 (PTX, no device needed) contains no
   fma and no flush-to-zero, rounds every float add/sub/mul to nearest, divides with div.rn
   only, takes the max with NaN propagation (torch.maximum's), and carries elementwise.py's exp
   and log constants as exact doubles; control: with fp fusion on, fma appears.
On a GPU: tests/test_cuda.py (CUDA kernel == CPU torch path on the same stats).
Run: PYTHONPATH=. .venv/bin/python -m pytest -q tests/test_logprobs_finish_triton.py (needs
triton; about 15 s).
"""

from __future__ import annotations

import re

import pytest
from kernel_helpers import NEEDS_TRITON, check_ok as _ok, checks_fixture, ptx_double, sm90_ptx

pytestmark = NEEDS_TRITON
results = checks_fixture("logprobs_finish_triton_checks.py")


def test_equals_torch_path_on_random_and_real_stats(results):
    """Shard counts 1, 2, 3, 5, 7, 8, 16, 64: random stats and the CPU shard statistics of
    random logits (scales 0.3 … 30, a padded vocabulary's masked tail) == the torch path."""
    _ok(results, "equals_torch_path_on_random_and_real_stats")


def test_equals_torch_path_on_adversarial_stats(results):
    """Masked shards and an all-masked row (m = −inf), s = 0, huge and subnormal s, maxima
    from ±1e30 to ±1e-30 and past exp64's clamp, ±Inf and NaN in m, s, t, ±0 maxima, and rows
    mixing them, at 1, 2, 3, 5, 8, 16 shards == the torch path."""
    _ok(results, "equals_torch_path_on_adversarial_stats")


def test_the_cases_reach_every_branch(results):
    """The reference holds lse −inf, +inf and NaN, entropy NaN and ±Inf, and mostly finite rows
    (so the bitwise checks cover them)."""
    _ok(results, "the_cases_reach_every_branch")


def test_row_alone_equals_row_in_batch(results):
    """Row i alone == row i in a batch of 7 / 257 (program edges included); other row tiles and
    warps give the same bytes."""
    _ok(results, "row_alone_equals_row_in_batch")


def test_strided_empty_and_cpu_dispatch(results):
    """Column-sliced stats == contiguous; N = 0 gives empty outputs; logprobs._finish_stats on
    CPU tensors is the torch path."""
    _ok(results, "strided_empty_and_cpu_dispatch")


def test_kernel_log64_equals_the_torch_log64_in_float64(results):
    """triton_elementwise.log64 == elementwise.log64 bitwise in float64 on specials,
    subnormals, the √2 fold and powers of two ±3 ulps, and 20k random positive doubles."""
    _ok(results, "log64_equals_the_torch_path_in_float64")


def test_bad_arguments_are_refused(results):
    """float64, 1-D, mismatched shapes or dtypes, zero shards: ValueError."""
    _ok(results, "bad_arguments_are_refused")


def test_launch_disables_fp_fusion(results):
    """The wrapper launches with enable_fp_fusion=False."""
    _ok(results, "launch_disables_fp_fusion")


def test_negative_control_other_trees_and_roundings_differ(results):
    """A left-to-right merge (5, 8 shards), fp32 exp and fp32 log each change bytes (so the
    bitwise checks can fail); restored, the kernel matches again."""
    _ok(results, "negative_control_other_trees_and_roundings_differ")


# ------------------------------------------------------------------ compiled code (PTX)

def _ptx(shards: int, fusion: bool) -> str:
    """PTX of the finish kernel for `shards` shards for sm_90, compiled on the CPU."""
    from rlkernel.kernels import triton_logprobs as tlp
    log_p = (shards - 1).bit_length()
    consts = {"BR": tlp.FINISH_ROWS, "P": 1 << log_p, "LOG_P": log_p, "SHARDS": shards}
    return sm90_ptx(tlp._finish_kernel, ["*fp32"] * 5 + ["i32"] + ["constexpr"] * 4, consts,
                    tlp.FINISH_WARPS, fusion)


@pytest.mark.parametrize("shards", [5, 8])
def test_compiled_ptx_has_no_fma_no_ftz_and_exact_float64_constants(shards):
    """sm_90 PTX as launched (enable_fp_fusion=False): no fma, no .ftz, no .approx; every float
    add/sub/mul rounds to nearest (.rn: ptxas may not contract it); the divisions are
    div.rn.f32 (t / s; Triton's `/` would be div.full.f32) and div.rn.f64 (log64's f); the
    shard max is max.NaN.f32 (torch.maximum propagates NaN; plain max.f32 drops it); float64 ->
    fp32 is cvt.rn.f32.f64; exp's Horner coefficients, log2 e, √2 and log's series
    coefficients appear as exact doubles (ln2's parts possibly negated: LLVM spells x − n·c as
    x + n·(−c), the same IEEE ops). Control: compiled with fp fusion on, the kernel has fma."""
    from rlkernel.kernels import elementwise as ew
    from rlkernel.kernels import triton_elementwise as tew
    ptx = _ptx(shards, False)
    assert "fma" not in ptx and ".ftz" not in ptx and ".approx" not in ptx
    assert not re.search(r"\b(add|sub|mul)\.f(32|64)\b", ptx)
    divs = re.findall(r"\bdiv\.[\w.]*f(?:32|64)\b", ptx)
    assert set(divs) == {"div.rn.f32", "div.rn.f64"}, set(divs)
    assert "max.NaN.f32" in ptx and not re.search(r"\bmax\.f32\b", ptx)
    assert "cvt.rn.f32.f64" in ptx
    for c in (*ew._EXP_COEF, ew._LOG2E, ew._SQRT2, 1.0 / 25.0, *tew.LOG_COEF.value):
        assert ptx_double(c) in ptx, c
    for c in (ew._LN2_HI, ew._LN2_LO):
        assert ptx_double(c) in ptx or ptx_double(-c) in ptx, c
    assert "fma.rn.f64" in _ptx(shards, True)
