"""The RoPE training passes (kernels/triton_rope.py) without a GPU.

1. Under TRITON_INTERPRET=1 (checks in tests/rope_triton_checks.py, one subprocess): the forward
   == kernels/rope.apply_rope and the backward == torch autograd's gradient of it, bitwise with
   signed zeros, subnormals and huge values, D = 128/64/8/6 (a padded tile); control: without
   autograd's "+ 0" zeros keep the wrong sign; rope() on CPU is apply_rope (a bf16 out_dtype:
   apply_rope then the cast; the CUDA path's autograd function hands out_dtype to its pass);
   bad input refused.
   The bf16 store of the forward == Triton's own conversion of its fp32 result, and a bf16
   gradient == its fp32 widening, bitwise.
2. PTX for sm_90 (no device): no fma, no flush-to-zero in either pass, the backward's "+ 0"
   kept; control: fp fusion on gives fma in the forward. The bf16 store rounds to nearest
   even (cvt.rn.bf16.f32, torch's rounding).
On a GPU: tests/test_cuda.py (the passes against torch's CUDA ops and autograd).
"""

from __future__ import annotations

import pytest
from kernel_helpers import NEEDS_TRITON, check_ok as _ok, checks_fixture, sm90_ptx

pytestmark = NEEDS_TRITON
results = checks_fixture("rope_triton_checks.py")


@pytest.mark.parametrize("name", [
    "forward_equals_apply_rope",
    "backward_equals_torch_autograd",
    "backward_negative_control_without_the_zero_add",
    "rope_autograd_entry_on_cpu_is_apply_rope",
    "bf16_out_is_the_fp32_result_rounded_and_a_bf16_gradient_is_widened_exactly",
    "rope_autograd_entry_takes_out_dtype_on_both_paths",
    "bad_input_is_refused",
])
def test_interpreted(results, name):
    """One check of tests/rope_triton_checks.py (its docstring says what it holds)."""
    _ok(results, name)


def _ptx(backward: bool, fusion: bool, x: str = "*fp32", y: str = "*fp32") -> str:
    from rlkernel.kernels import triton_rope as tr
    types = [x, "*fp32", "*fp32", y] + ["i32"] * 3 + ["constexpr"] * 3
    return sm90_ptx(tr._rope_kernel, types, {"BLOCK_R": 32, "DP": 128, "BACKWARD": backward},
                    4, fusion)


def test_compiled_ptx_has_no_fma_and_no_ftz():
    """No fma / .ftz in either pass; the backward keeps its "+ 0" (one add of 0f00000000 per
    product pair: the compiler may not fold x + 0.0, which is not x for x = -0.0)."""
    for backward in (False, True):
        ptx = _ptx(backward, False)
        assert "fma" not in ptx and ".ftz" not in ptx, backward
    lines = _ptx(True, False).splitlines()
    zero_adds = sum("add.rn.f32" in ln and "0f00000000" in ln for ln in lines)
    assert zero_adds and 2 * zero_adds == sum("mul.rn.f32" in ln for ln in lines)
    assert "fma.rn.f32" in _ptx(False, True)


def test_compiled_bf16_store_rounds_to_nearest_even_and_a_bf16_gradient_widens_exactly():
    """The forward storing bf16 (a bf16 run's rounding point of q and k) converts with
    cvt.rn.bf16.f32 — round to nearest even, torch's cast — never a truncating or other-mode
    cvt; the backward loading a bf16 gradient widens it with cvt.f32.bf16 (exact, subnormals
    included: no .ftz; the interpreter's widening flushes them, so this is where the subnormal
    case is checked) and still has no fma. Control: the fp32 store has no
    bf16 conversion."""
    fwd = _ptx(False, False, y="*bf16")
    assert "cvt.rn.bf16.f32" in fwd and "fma" not in fwd and ".ftz" not in fwd
    assert not any(m in fwd for m in ("cvt.rz.bf16", "cvt.rm.bf16", "cvt.rp.bf16"))
    bwd = _ptx(True, False, x="*bf16")
    assert "cvt.f32.bf16" in bwd          # exact (subnormals too: no .ftz anywhere)
    assert "fma" not in bwd and ".ftz" not in bwd and "cvt.rn.bf16.f32" not in bwd
    assert "bf16" not in _ptx(False, False)
