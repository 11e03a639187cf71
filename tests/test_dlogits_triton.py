"""The d-logits Triton kernel (rlkernel/kernels/triton_dlogits.py) without a GPU.

1. Under TRITON_INTERPRET=1 (Triton on the CPU): d logits == the torch path on CPU
   (logprobs._dlogits_by_rows), bitwise (NaN payloads aside: swiglu_cases.same_bits), fp32 and
   bf16 out, on the inputs of tests/dlogits_cases.py, with negative controls. The checks live in
   tests/dlogits_triton_checks.py and run in one subprocess (the interpreter is chosen before
   triton is imported); each test asserts one.
2. The code the GPU would run: the kernel compiled for sm_90 (PTX, no device needed) contains no
   fma and no flush-to-zero, rounds every float add/sub/mul to nearest, divides with div.rn.f32
   only, and carries elementwise.py's exp constants as exact doubles; control: with fp fusion
   on, fma appears.
On a GPU: tests/test_cuda_backward.py (CUDA kernel == CPU torch path, batch invariance).
Run: PYTHONPATH=. .venv/bin/python -m pytest -q tests/test_dlogits_triton.py (needs triton;
about 15 s).
"""

from __future__ import annotations

import re

import pytest
from kernel_helpers import NEEDS_TRITON, check_ok as _ok, checks_fixture, ptx_double, sm90_ptx

pytestmark = NEEDS_TRITON
results = checks_fixture("dlogits_triton_checks.py")


def test_equals_torch_path_over_temperatures_masks_entropy_and_dtypes(results):
    """T ∈ {1, 0.7, 1e-3} × live_vocab ∈ {V, V − 37} × g_ent given / None × fp32 / bf16 out ==
    the CPU torch path, on rows with p underflow, exp64's clamp and zero branches, fp32
    overflow of p, zero / −0 / huge / subnormal g_lp and g_ent, first / last / masked targets,
    V = 1000 (not a multiple of the vocab block)."""
    _ok(results, "equals_torch_path_over_temperatures_masks_entropy_and_dtypes")


def test_the_cases_reach_every_branch(results):
    """The reference output holds +0 and −0 at masked ids, zeros at live ids, subnormals, ±Inf
    and NaN (so the bitwise check covers them)."""
    _ok(results, "the_cases_reach_every_branch")


def test_from_logits_equals_div_t_then_torch_path(results):
    """from_logits=True (z = logits / T and the live-vocab mask formed in the kernel) == the
    torch path on logprobs._div_t's z; live_vocab V, V − 37 and 1."""
    _ok(results, "from_logits_equals_div_t_then_torch_path")


def test_one_row_tiny_vocabularies_and_empty(results):
    """N = 1 at V = 1000, 1; N = 3, V = 3; N = 5, V = 513 == torch path; N = 0 writes nothing."""
    _ok(results, "one_row_tiny_vocabularies_and_empty")


def test_launch_shapes_and_strides_give_the_same_bytes(results):
    """Other tiles and warps, a row-strided or transposed z, out as a slice of a larger buffer
    (nothing written outside it), an expanded g_lp: the torch path's bytes."""
    _ok(results, "launch_shapes_and_strides_give_the_same_bytes")


def test_bf16_rounding_is_torch_cpu_cast(results):
    """triton_elementwise.bf16_rtne == torch's fp32 -> bf16 cast on specials, every rounding tie
    and its neighbours, and the overflow edge (the interpreter's own cast truncates)."""
    _ok(results, "bf16_rounding_is_torch_cpu_cast")


def test_bad_arguments_are_refused(results):
    """float64 z, 1-D z, int32 or short targets, float64 or short row values, fp16 / mis-shaped /
    column-strided out: ValueError."""
    _ok(results, "bad_arguments_are_refused")


def test_launch_disables_fp_fusion(results):
    """The wrapper launches with enable_fp_fusion=False."""
    _ok(results, "launch_disables_fp_fusion")


def test_negative_control_other_formulas_differ(results):
    """fp32 exp, Triton's unary minus, a reassociated entropy term and dz·(1/T) each change
    bytes (so the bitwise checks can fail); restored, the kernel matches again."""
    _ok(results, "negative_control_other_formulas_differ")


# ------------------------------------------------------------------ compiled code (PTX)

def _ptx(out: str, fusion: bool) -> str:
    """PTX of the kernel (entropy term on, z formed from logits) for sm_90, compiled on the CPU;
    out: the output's element type ("fp32" or "bf16")."""
    from rlkernel.kernels import triton_dlogits as td
    types = ["*fp32", "*i64", "*fp32", "*fp32", "*fp32", "*fp32", f"*{out}", "i32", "i32",
             "i32", "i32", "i32", "fp32", "constexpr", "constexpr", "constexpr", "constexpr"]
    consts = {"BR": td.BLOCK_R, "BV": td.BLOCK_V, "HAS_ENT": True, "FROM_LOGITS": True}
    return sm90_ptx(td._dlogits_kernel, types, consts, td.NUM_WARPS, fusion)


@pytest.mark.parametrize("out", ["fp32", "bf16"])
def test_compiled_ptx_has_no_fma_no_ftz_and_exact_float64_constants(out):
    """sm_90 PTX as launched (enable_fp_fusion=False): no fma, no .ftz, no .approx; every float
    add/sub/mul rounds to nearest (.rn: ptxas may not contract it); every division is
    div.rn.f32 (logits / T and dz / T; Triton's `/` would be div.full.f32); exp's float64 ->
    fp32 rounding is cvt.rn.f32.f64; each Horner coefficient and ln2 / log2 e constant of
    elementwise.py appears as its exact double (the ln2 parts possibly negated: LLVM turns
    x − n·c into x + n·(−c), and neg32(g_lp·p) into (−g_lp)·p, exact rewrites in IEEE
    arithmetic); no float -> bf16 cvt (bf16_rtne rounds in integer ops). Control: compiled
    with fp fusion on, the kernel contains fma."""
    from rlkernel.kernels import elementwise as ew
    ptx = _ptx(out, False)
    assert "fma" not in ptx and ".ftz" not in ptx and ".approx" not in ptx
    assert not re.search(r"\b(add|sub|mul)\.f(32|64)\b", ptx)
    divs = re.findall(r"\bdiv\.[\w.]*f(?:32|64)\b", ptx)
    assert divs and set(divs) == {"div.rn.f32"}, set(divs)
    assert "cvt.rn.f32.f64" in ptx and "bf16.f32" not in ptx
    for c in (*ew._EXP_COEF, ew._LOG2E):
        assert ptx_double(c) in ptx, c
    for c in (ew._LN2_HI, ew._LN2_LO):   # LLVM spells xc − n·c as xc + n·(−c): the same IEEE ops
        assert ptx_double(c) in ptx or ptx_double(-c) in ptx, c
    assert "fma.rn.f64" in _ptx(out, True)
