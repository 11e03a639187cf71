"""The checks behind tests/test_rope_triton.py, run in a subprocess with TRITON_INTERPRET=1: the
RoPE training passes (kernels/triton_rope.rope_pass) against kernels/rope.apply_rope's torch ops
forward and torch autograd's backward of them, compared as int32 bits (signed zeros count).
Prints one JSON object {check name: "ok" or the failure}. Run by hand:
TRITON_INTERPRET=1 .venv/bin/python tests/rope_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import sys

import torch

from kernel_helpers import interpreted_checks, run_checks

CHECKS, check = interpreted_checks(__file__)

import triton_interpreter_compat  # noqa: F401 - numpy >= 2.3: before any launch
from triton_interpreter_compat import triton_bf16

from rlkernel.kernels import triton_rope as tr
from rlkernel.kernels.rope import RopeTable, apply_rope

VALS = torch.tensor([0.0, -0.0, 1.5, -2.25, 1e-40, -3e38, 7.0, -1e-3])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _cases():
    """(x, cos, sin, dy): signed zeros, subnormals and huge values drawn per element (the sign
    of a zero gradient is what the backward's "+ 0" decides), and real tables at positions to
    40k with random x, for Qwen3's D = 128 and D = 64, 8 and 6 (a padded tile)."""
    g = torch.Generator().manual_seed(0)
    pick = lambda *shape: VALS[torch.randint(0, len(VALS), shape, generator=g)]   # noqa: E731
    out = [(pick(40, 3, d), pick(40, d), pick(40, d), pick(40, 3, d)) for d in (8, 6)]
    for d, heads in ((128, 16), (64, 4)):
        cos, sin = RopeTable(d, 1e6).lookup(torch.randint(0, 40000, (37,), generator=g))
        out.append((torch.randn(37, heads, d, generator=g), cos, sin,
                    torch.randn(37, heads, d, generator=g)))
    return out


@check
def forward_equals_apply_rope():
    for x, cos, sin, _ in _cases():
        assert _same(tr.rope_pass(x, cos, sin), apply_rope(x, cos, sin)), tuple(x.shape)


@check
def backward_equals_torch_autograd():
    """dx == torch autograd's gradient of apply_rope, bitwise, zeros' signs included."""
    for x, cos, sin, dy in _cases():
        xr = x.clone().requires_grad_(True)
        apply_rope(xr, cos, sin).backward(dy)
        assert _same(tr.rope_pass(dy, cos, sin, backward=True), xr.grad), tuple(x.shape)


@check
def backward_negative_control_without_the_zero_add():
    """The check above can fail: dy·cos + rotᵀ(dy·sin) without autograd's "+ 0" keeps −0.0
    where autograd gives +0.0."""
    x, cos, sin, dy = _cases()[0]
    xr = x.clone().requires_grad_(True)
    apply_rope(xr, cos, sin).backward(dy)
    half = x.shape[-1] // 2
    u = dy * sin[:, None]
    plain = dy * cos[:, None] + torch.cat([u[..., half:], -u[..., :half]], -1)
    g = xr.grad
    assert not _same(plain, g)
    assert bool(((plain == g) | (plain.isnan() & g.isnan())).all())    # zeros' signs only


@check
def rope_autograd_entry_on_cpu_is_apply_rope():
    """kernels/rope.rope on CPU tensors is apply_rope under autograd (the same bytes both ways)."""
    from rlkernel.kernels.rope import rope
    x, cos, sin, dy = _cases()[2]
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = rope(a, cos, sin), apply_rope(b, cos, sin)
    ya.backward(dy)
    yb.backward(dy)
    assert _same(ya.detach(), yb.detach()) and _same(a.grad, b.grad)


@check
def bf16_out_is_the_fp32_result_rounded_and_a_bf16_gradient_is_widened_exactly():
    """out_dtype bf16: the fp32 forward's values through Triton's own fp32 -> bf16 conversion
    (the interpreter truncates; the GPU rounds to nearest even as torch's cast does, checked in
    tests/test_cuda.py); backward of a bf16 dy (no subnormals: the interpreter flushes them
    when it widens) == backward of the same values in fp32, bitwise.
    Control: the fp32 result has bits past bf16."""
    for x, cos, sin, dy in _cases():
        y32 = tr.rope_pass(x, cos, sin)
        y16 = tr.rope_pass(x, cos, sin, out_dtype=torch.bfloat16)
        assert y16.dtype == torch.bfloat16 and _same(y16.float(), triton_bf16(y32))
        # bf16 subnormals left out: the interpreter's bf16 -> fp32 widening flushes them (the
        # GPU's cvt.f32.bf16 is exact: tests/test_rope_triton.py reads it in the PTX).
        d16 = dy.bfloat16()
        d16 = torch.where(d16.float().abs() < torch.finfo(torch.float32).tiny, 0.0, d16)
        assert _same(tr.rope_pass(d16, cos, sin, backward=True),
                     tr.rope_pass(d16.float(), cos, sin, backward=True)), tuple(x.shape)
    x, cos, sin, _ = _cases()[2]
    assert not _same(tr.rope_pass(x, cos, sin), triton_bf16(tr.rope_pass(x, cos, sin)))


@check
def rope_autograd_entry_takes_out_dtype_on_both_paths():
    """rope(x, cos, sin, bf16) on CPU tensors is apply_rope(x, cos, sin).to(bf16) under autograd:
    a bf16 result with its bytes, and x's fp32 gradient of a bf16 dy with its bytes. The CUDA
    path's autograd function (`_Rope`, run here on CPU tensors by the interpreter) hands
    out_dtype to its forward pass: a bf16 result with the bytes of rope_pass(out_dtype=bf16),
    and for a bf16 dy x's fp32 gradient == the backward pass of dy. Control: the fp32 result has
    bits past bf16 (a result left in fp32 would not have these bytes)."""
    from rlkernel.kernels.rope import _Rope, rope
    x, cos, sin, dy = _cases()[2]
    d16 = dy.bfloat16()           # normal values only: the interpreter flushes bf16 subnormals
    assert bool((d16.float().abs() >= torch.finfo(torch.float32).tiny).all())
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = rope(a, cos, sin, torch.bfloat16), apply_rope(b, cos, sin).to(torch.bfloat16)
    assert ya.dtype == yb.dtype == torch.bfloat16 and _same(ya.detach().float(),
                                                            yb.detach().float())
    ya.backward(d16)
    yb.backward(d16)
    assert a.grad.dtype == torch.float32 and _same(a.grad, b.grad)
    c = x.clone().requires_grad_(True)
    yc = _Rope.apply(c, cos, sin, torch.bfloat16)
    assert yc.dtype == torch.bfloat16
    assert _same(yc.detach().float(), tr.rope_pass(x, cos, sin, out_dtype=torch.bfloat16).float())
    yc.backward(d16)
    assert c.grad.dtype == torch.float32
    assert _same(c.grad, tr.rope_pass(d16, cos, sin, backward=True))
    assert not _same(tr.rope_pass(x, cos, sin), yc.detach().float())


@check
def bad_input_is_refused():
    """Odd D, non-fp32 x (a bf16 x outside the backward), tables of another length, an fp16
    out_dtype: ValueError."""
    for x, cos, kw in ((torch.randn(4, 2, 7), torch.randn(4, 7), {}),
                       (torch.randn(4, 2, 8).double(), torch.randn(4, 8), {}),
                       (torch.randn(4, 2, 8).bfloat16(), torch.randn(4, 8), {}),
                       (torch.randn(4, 2, 8), torch.randn(4, 8), {"out_dtype": torch.float16}),
                       (torch.randn(4, 2, 8), torch.randn(5, 8), {})):
        try:
            tr.rope_pass(x, cos, cos, **kw)
        except ValueError:
            continue
        raise AssertionError(f"accepted x {tuple(x.shape)} {x.dtype}, cos {tuple(cos.shape)} "
                             f"{kw}")


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
