"""The SwiGLU Triton kernels (rlkernel/kernels/triton_activation.py) without a GPU.

1. Under TRITON_INTERPRET=1 (Triton on the CPU): forward (out, sig) and backward (d_gate, d_up)
   == the torch path on CPU (activation.swiglu_fwd_torch / swiglu_bwd_torch), bitwise (NaN
   payloads aside: tests/swiglu_cases.same_bits), on adversarial inputs (tests/swiglu_cases.py),
   with negative controls; and the kernels' exp alone (`_exp64`) == elementwise.exp64 in float64,
   which sees slips that σ's rounding to fp32 hides; training's way (no σ kept, recomputed in
   the backward) and the bf16 stores (the MLP's rounding points) give the same bytes. The checks live in
   tests/activation_triton_checks.py and run in one subprocess (the interpreter is chosen before
   triton is imported); each test asserts one.
2. The code the GPU would run: both kernels compiled for sm_90 (PTX, no device needed) contain
   no fma and no flush-to-zero, round every float64 op to nearest, divide with div.rn.f64, and
   carry elementwise.py's constants as exact doubles (the σ-recomputing backward too), and the
   bf16 stores round to nearest even; control: with fp fusion on, fma appears.
On a GPU: tests/test_cuda_backward.py (CUDA kernels == CPU torch path, batch invariance).
Run: PYTHONPATH=. .venv/bin/python -m pytest -q tests/test_activation_triton.py (needs triton;
about 10 s).
"""

from __future__ import annotations

import re

from kernel_helpers import NEEDS_TRITON, check_ok as _ok, checks_fixture, ptx_double, sm90_ptx

pytestmark = NEEDS_TRITON
results = checks_fixture("activation_triton_checks.py")


def test_kernel_constants_are_the_elementwise_module_constants(results):
    """The kernels' Horner coefficients and ln2/log2 e constants are elementwise.py's."""
    _ok(results, "constants_are_the_elementwise_ones")


def test_hard_gates_are_hard_to_round(results):
    """The hard-to-round gates of tests/swiglu_cases.py are within 2048 float64 ulps of an fp32
    rounding midpoint before σ's rounding (so a float64 slip shows in fp32 bits)."""
    _ok(results, "hard_gates_are_near_fp32_midpoints")


def test_kernel_exp_equals_the_torch_exp64_in_float64(results):
    """The kernel's _exp64 == elementwise.exp64 bitwise in float64 on ~52k x: uniform over
    [−750, 715], every range-reduction boundary ±3 ulps, tiny |x|, the clamp edges, specials
    (σ's fp32 rounding hides few-ulp slips there that this sees)."""
    _ok(results, "exp64_equals_the_torch_path_in_float64")


def test_forward_equals_torch_path_on_adversarial_gates(results):
    """out and sig == torch path for ±0, subnormals, the σ underflow region, the exp64 clamp
    edges ±1..3 ulps, ±fp32 max, ±Inf, NaNs, exp range-reduction boundaries ±2 ulps,
    hard-to-round gates, random normals and bit patterns (up with specials)."""
    _ok(results, "forward_adversarial_values")


def test_backward_equals_torch_path_on_adversarial_values(results):
    """d_gate and d_up == torch path on the same gates, with up and dh holding specials and dh
    spanning 2**±40."""
    _ok(results, "backward_adversarial_values")


def test_every_gate_meets_every_kind_of_up_and_dh(results):
    """up and dh rolled by 1..4 against the gates: forward and backward == torch path."""
    _ok(results, "every_gate_value_meets_every_kind_of_up_and_dh")


def test_tails_empty_inputs_and_launch_shapes(results):
    """Lengths 1, 7, 1023, 1025, 2051 and 0 == torch path; BLOCK 128/4096 with 1/8 warps give
    the default launch's bytes."""
    _ok(results, "lengths_not_a_multiple_of_the_block_and_launch_shapes")


def test_shapes_and_non_contiguous_inputs(results):
    """[60, 97], [3, 20, 97], a transposed gate, column- and row-strided up / dh == torch path."""
    _ok(results, "shapes_and_non_contiguous_inputs")


def test_recomputed_sigma_gives_the_kept_sigmas_bytes(results):
    """The forward without its sig store and the backward recomputing σ (training's way) ==
    the kept-sig kernels, bitwise; control: a sig one ulp off changes d_gate."""
    _ok(results, "recomputed_sigma_gives_the_kept_sigmas_bytes")


def test_bf16_stores_are_the_fp32_results_rounded(results):
    """out_dtype bf16: out, d_gate, d_up == the fp32 results through Triton's conversion,
    bitwise; control: the fp32 results have bits past bf16; fp16 refused."""
    _ok(results, "bf16_stores_are_the_fp32_results_rounded")


def test_bad_arguments_are_refused(results):
    """Mismatched shapes, float64, bf16: ValueError."""
    _ok(results, "bad_arguments_are_refused")


def test_launches_disable_fp_fusion(results):
    """Both kernels are launched with enable_fp_fusion=False."""
    _ok(results, "launches_disable_fp_fusion")


def test_negative_control_fp32_sigmoid_two_roundings_and_reassociated_grads_differ(results):
    """fp32 σ, σ with exp rounded to fp32 first, and reassociated gradients each change bytes
    (so the bitwise checks can fail); restored, the kernels match again."""
    _ok(results, "negative_control_other_roundings_differ")


# ------------------------------------------------------------------ compiled code (PTX)

def _ptx(kernel, fusion: bool, sig: bool = True, bf16_out: tuple[str, ...] = ()) -> str:
    """PTX of a kernel (fp32 pointers — bf16 for those named in bf16_out —, then n, BLOCK and
    its STORE_SIG / LOAD_SIG flag) for sm_90, compiled on the CPU."""
    *ptrs, n, block, flag = kernel.arg_names
    types = {p: "*bf16" if p in bf16_out else "*fp32" for p in ptrs}
    return sm90_ptx(kernel, {**types, n: "i64", block: "constexpr", flag: "constexpr"},
                    {block: 1024, flag: sig}, 4, fusion)


def test_compiled_bf16_stores_round_to_nearest_even():
    """The forward storing a bf16 OUT and the backward storing bf16 DG / DU (the MLP's rounding
    points) convert with cvt.rn.bf16.f32 — torch's round to nearest even —, no other mode, and
    keep the fp32 kernels' other properties (no fma, no .ftz); the fp32 stores convert
    nothing to bf16 (control)."""
    from rlkernel.kernels import triton_activation as ta
    for ptx in (_ptx(ta._fwd_kernel, False, sig=False, bf16_out=("OUT",)),
                _ptx(ta._bwd_kernel, False, sig=False, bf16_out=("DG", "DU"))):
        assert "cvt.rn.bf16.f32" in ptx and "fma" not in ptx and ".ftz" not in ptx
        assert not re.search(r"cvt\.r[zmp]\.bf16", ptx)
    assert "bf16" not in _ptx(ta._fwd_kernel, False, sig=False)


def test_compiled_ptx_has_no_fma_no_ftz_and_exact_float64_constants():
    """sm_90 PTX of both kernels as launched (enable_fp_fusion=False): no fma, no .ftz; every
    float64 add/sub/mul rounds to nearest (.rn: ptxas may not contract it); the forward's one
    division is div.rn.f64 and its float64 → fp32 conversion cvt.rn.f32.f64; each Horner
    coefficient and ln2 / log2 e constant of elementwise.py appears as its exact double; the
    same for the backward that recomputes σ (training keeps no sig).
    Control: the forward compiled with fp fusion on contains fma."""
    from rlkernel.kernels import elementwise as ew
    from rlkernel.kernels import triton_activation as ta
    fwd, bwd = _ptx(ta._fwd_kernel, False), _ptx(ta._bwd_kernel, False)
    for ptx in (fwd, bwd):
        assert "fma" not in ptx and ".ftz" not in ptx and ".approx" not in ptx
        assert not re.search(r"\b(add|sub|mul)\.f64\b", ptx)
        assert not re.search(r"\b(add|sub|mul)\.f32\b", ptx)
    assert re.findall(r"\bdiv\.\w+\.f64\b", fwd) and set(re.findall(r"\bdiv\.\w+\.f64\b", fwd)) \
        == {"div.rn.f64"}
    assert "div" not in bwd and "cvt.rn.f32.f64" in fwd
    # The backward that recomputes σ (training: no sig kept) compiles the forward's σ.
    bwd_sig = _ptx(ta._bwd_kernel, False, sig=False)
    assert "fma" not in bwd_sig and ".ftz" not in bwd_sig and ".approx" not in bwd_sig
    assert not re.search(r"\b(add|sub|mul)\.f(32|64)\b", bwd_sig)
    assert set(re.findall(r"\bdiv\.\w+\.f64\b", bwd_sig)) == {"div.rn.f64"}
    for ptx in (fwd, bwd_sig):
        assert "cvt.rn.f32.f64" in ptx
        for c in (*ew._EXP_COEF, ew._LOG2E, ew._LN2_HI, ew._LN2_LO):
            assert ptx_double(c) in ptx, c
    assert "fma.rn.f64" in _ptx(ta._fwd_kernel, True)
