"""The RMSNorm Triton kernels (kernels/triton_norm.py) without a GPU: the training backward
(`rms_backward`) and the inference RMSNorm(+RoPE) kernel (`rms_norm_apply`).

1. Under TRITON_INTERPRET=1 (checks in tests/norm_triton_checks.py, one subprocess): the fused
   pass == the separate CUDA passes it replaces (statistics kernel, x̂ * w, apply_rope), bitwise,
   for hidden widths 1024/1000/96 and Q/K heads with RoPE at positions to 40k; alone == batch;
   a reassociated product differs (control); bad input refused. The backward's dx and per-leaf
   dW partials == kernels/norm.py's torch ops (hidden 1024/1000/96, Q/K heads), a leaf alone ==
   in the stream, rows of signed zeros whose sums are −0.0 (an expected failure until the
   kernel's −0.0 identities are real −0.0: Triton makes the literal +0.0); controls: a true
   division by H (the CPU op, not CUDA's reciprocal multiply), reversed token order and a +0.0
   identity differ.
2. PTX for sm_90 (no device): no fma, no flush-to-zero, division and square root correctly
   rounded (div.rn / sqrt.rn); control: with fp fusion on, fma appears.
On a GPU: tests/test_cuda_rollout.py (rollout == trainer logprobs: the rollout runs this kernel,
the trainer's autograd passes the separate ones).
"""

from __future__ import annotations

import pytest

from kernel_helpers import NEEDS_TRITON, check_ok as _ok, checks_fixture, sm90_ptx

pytestmark = NEEDS_TRITON
results = checks_fixture("norm_triton_checks.py")


def test_weight_applied_in_the_kernel_equals_the_separate_passes(results):
    _ok(results, "weight_applied_in_the_kernel_equals_the_separate_passes")


def test_training_forward_pass_equals_the_stats_then_product(results):
    _ok(results, "training_forward_pass_equals_the_stats_then_product")


def test_qk_norm_and_rope_equal_the_separate_passes(results):
    _ok(results, "qk_norm_and_rope_equal_the_separate_passes")


def test_bf16_output_is_the_rounded_fp32_output(results):
    _ok(results, "bf16_output_is_the_rounded_fp32_output")


def test_negative_control_reassociated_product_differs(results):
    _ok(results, "negative_control_reassociated_product_differs")


def test_bad_input_is_refused(results):
    _ok(results, "bad_input_is_refused")


def test_backward_equals_the_torch_ops(results):
    _ok(results, "backward_equals_the_torch_ops")


def test_backward_rows_alone_equal_the_batch(results):
    _ok(results, "backward_rows_alone_equal_the_batch")


def test_backward_negative_controls_true_division_and_reversed_tokens_differ(results):
    _ok(results, "backward_negative_controls_true_division_and_reversed_tokens_differ")


def test_backward_signed_zero_rows_keep_minus_zero(results):
    """Rows of signed zeros whose mean tree and partials are −0.0: dx and the partials == the
    torch ops (the check's docstring). Kills a +0.0 padding of the tree or a +0.0 start of the
    partial, which the random rows of the other checks cannot see."""
    _ok(results, "backward_signed_zero_rows_keep_minus_zero")


def test_backward_bad_input_is_refused(results):
    _ok(results, "backward_bad_input_is_refused")


def test_backward_ptx_has_no_fma_and_no_ftz():
    """sm_90 PTX of the training backward as launched (the partials on): no fma, no .ftz, no
    .approx, and the -0.0 constant present. Control: fp fusion on gives fma."""
    from rlkernel.kernels import triton_norm as tn
    types = ["*fp32"] * 6 + ["i32"] * 3 + ["fp32"] + ["constexpr"] * 4
    consts = {"HP": 1024, "LOG_HP": 10, "LEAF": 16, "WANT_PART": True}
    ptx = sm90_ptx(tn._bwd_kernel, types, consts, 4, False)
    assert "fma" not in ptx and ".ftz" not in ptx and ".approx" not in ptx
    assert "0f80000000" in ptx      # the -0.0 identity survived compilation (a literal did not)
    assert "fma.rn.f32" in sm90_ptx(tn._bwd_kernel, types, consts, 4, True)


def _ptx(fusion: bool) -> str:
    """PTX of the RoPE variant of the apply kernel for sm_90, compiled on the CPU."""
    from rlkernel.kernels import triton_norm as tn
    types = ["*fp32"] * 5 + ["i32"] * 3 + ["fp32"] * 2 + ["constexpr"] * 5
    consts = {"HP": 128, "LOG_HP": 7, "BLOCK_R": 32, "ROPE": True, "OUT_BF16": False}
    return sm90_ptx(tn._apply_kernel, types, consts, 4, fusion)


def test_training_forward_ptx_has_no_fma_and_rounded_div_sqrt():
    """sm_90 PTX of the training forward pass with the weight product (APPLY): no fma, .ftz or
    .approx; div.rn.f32 and sqrt.rn.f32 present; control: fp fusion on gives fma."""
    import re
    from rlkernel.kernels import triton_norm as tn
    types = ["*fp32"] * 5 + ["i32"] * 2 + ["fp32"] * 2 + ["constexpr"] * 4
    consts = {"HP": 2048, "LOG_HP": 11, "BLOCK_R": 2, "APPLY": True}
    ptx = sm90_ptx(tn._rms_kernel, types, consts, 4, False)
    assert "fma" not in ptx and ".ftz" not in ptx and ".approx" not in ptx
    assert re.search(r"\bdiv\.rn\.f32\b", ptx) and re.search(r"\bsqrt\.rn\.f32\b", ptx)
    assert "mul.rn.f32" in ptx or "mul.f32" in ptx


def test_compiled_ptx_has_no_fma_no_ftz_and_rounded_div_sqrt():
    """sm_90 PTX of the RoPE variant as launched: no fma/.ftz/.approx; div.rn.f32 and
    sqrt.rn.f32 present. Control: fp fusion on gives fma."""
    import re
    ptx = _ptx(False)
    assert "fma" not in ptx and ".ftz" not in ptx and ".approx" not in ptx
    assert re.search(r"\bdiv\.rn\.f32\b", ptx) and re.search(r"\bsqrt\.rn\.f32\b", ptx)
    assert "fma.rn.f32" in _ptx(True)
