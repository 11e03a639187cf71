"""The checks behind tests/test_norm_triton.py, run in a subprocess with TRITON_INTERPRET=1: the
training backward (kernels/triton_norm.rms_backward) against kernels/norm.py's torch ops, and the
inference RMSNorm(+RoPE) kernel (kernels/triton_norm.rms_norm_apply) against the separate CUDA
passes it replaces — the statistics kernel (`rms_stats`), then x̂·w and kernels/rope.apply_rope
as torch ops — compared as int32 bits. The interpreter shows the operation sequence; the PTX
test in tests/test_norm_triton.py shows code generation (no fma, correctly rounded div/sqrt).
Prints one JSON object {check name: "ok" or the failure}. Run by hand:
TRITON_INTERPRET=1 .venv/bin/python tests/norm_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import sys

import torch

from kernel_helpers import interpreted_checks, run_checks

CHECKS, check = interpreted_checks(__file__)

import triton
import triton.language as tl
import triton_interpreter_compat  # noqa: F401 - numpy >= 2.3: before any launch

from rlkernel.kernels import triton_norm as tn
from rlkernel.kernels.rope import RopeTable, apply_rope


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _unfused(x, w, eps, cos=None, sin=None):
    y = tn.rms_stats(x, eps)[1] * w
    return y if cos is None else apply_rope(y, cos, sin)


def _rows(n: int, h: int, g: torch.Generator) -> torch.Tensor:
    """Random rows with a zero row, huge and tiny rows, and one with a single nonzero entry."""
    x = torch.randn(n, h, generator=g) * torch.logspace(-3, 3, n)[:, None]
    x[0] = 0.0
    x[1] = 1e30
    x[2] = 1e-30
    x[3] = 0.0
    x[3, h // 3] = -2.5
    return x


@check
def weight_applied_in_the_kernel_equals_the_separate_passes():
    """(x̂)·w in one pass == rms_stats then x̂ * w, hidden widths 1024, 1000 (padded tree), 96."""
    g = torch.Generator().manual_seed(0)
    for h in (1024, 1000, 96):
        x = _rows(37, h, g)
        w = torch.randn(h, generator=g)
        assert _same(tn.rms_norm_apply(x, w, 1e-6), _unfused(x, w, 1e-6)), h


@check
def training_forward_pass_equals_the_stats_then_product():
    """rms_forward's (r, x̂, x̂·w) in one pass == rms_stats then x̂ * w as a torch op, bitwise:
    hidden widths 1024, 1000 (padded tree), 96 and Q/K heads [L, 16, 128]; control: the product
    reassociated as x·(r·w) differs; a weight of the wrong width or dtype is refused."""
    g = torch.Generator().manual_seed(7)
    for shape in ((37, 1024), (37, 1000), (37, 96), (9, 16, 128)):
        h = shape[-1]
        x = _rows(torch.Size(shape[:-1]).numel(), h, g).reshape(shape)
        w = torch.randn(h, generator=g)
        r, xh, y = tn.rms_forward(x, w, 1e-6)
        r2, xh2 = tn.rms_stats(x, 1e-6)
        assert _same(r, r2) and _same(xh, xh2) and _same(y, xh2 * w), shape
        assert not _same(y, x * (r[..., None] * w)), shape
    for w in (torch.ones(95), torch.ones(96, dtype=torch.float64)):
        try:
            tn.rms_forward(torch.randn(4, 96), w, 1e-6)
        except ValueError:
            continue
        raise AssertionError(f"accepted a weight {w.dtype} {tuple(w.shape)}")


@check
def qk_norm_and_rope_equal_the_separate_passes():
    """Per-head norm + RoPE (Qwen3 Q/K: heads 16 and 8, D 128 and 64, positions up to 40k) ==
    rms_stats, x̂ * w, apply_rope; a token's rows alone == in a batch."""
    g = torch.Generator().manual_seed(1)
    for heads, d in ((16, 128), (8, 128), (4, 64)):
        table = RopeTable(d, 1e6)
        pos = torch.tensor([0, 1, 5, 511, 512, 4097, 39999, 7])
        cos, sin = table.lookup(pos)
        x = _rows(len(pos) * heads, d, g).view(len(pos), heads, d)
        w = torch.randn(d, generator=g)
        got = tn.rms_norm_apply(x, w, 1e-6, cos, sin)
        assert _same(got, _unfused(x, w, 1e-6, cos, sin)), (heads, d)
        one = tn.rms_norm_apply(x[3:4], w, 1e-6, cos[3:4], sin[3:4])
        assert _same(one, got[3:4]), "alone vs batch"


@check
def bf16_output_is_the_rounded_fp32_output():
    """out_dtype bf16 == the fp32 result rounded by torch's cast (round to nearest even), with
    and without RoPE, values spanning the bf16 range and ties."""
    g = torch.Generator().manual_seed(3)
    x = _rows(40, 1000, g)
    w = torch.randn(1000, generator=g) * 1e3
    got = tn.rms_norm_apply(x, w, 1e-6, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    want = tn.rms_norm_apply(x, w, 1e-6).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    table = RopeTable(128, 1e6)
    cos, sin = table.lookup(torch.arange(5))
    xh = _rows(5 * 8, 128, g).view(5, 8, 128)
    wh = torch.randn(128, generator=g)
    got = tn.rms_norm_apply(xh, wh, 1e-6, cos, sin, out_dtype=torch.bfloat16)
    want = _unfused(xh, wh, 1e-6, cos, sin).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@triton.jit
def _reassociated(X, W, Y, n_rows, H, inv_h_num, eps, HP: tl.constexpr, LOG_HP: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HP)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < H)
    off = rows[:, None] * H + cols[None, :]
    x = tl.load(X + off, mask=ok, other=0.0)
    r = tn._rstd(x, inv_h_num, eps, BLOCK_R, HP, LOG_HP)
    tl.store(Y + off, x * (r[:, None] * tl.load(W + cols)[None, :]), mask=ok)


@check
def negative_control_reassociated_product_differs():
    """x·(r·w) instead of (x·r)·w: other bits on some elements (the comparison sees one
    rounding)."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(64, 128, generator=g), torch.randn(128, generator=g)
    y = torch.empty_like(x)
    _reassociated[(4,)](x, w, y, 64, 128, 128.0, 1e-6, HP=128, LOG_HP=7, BLOCK_R=16)
    assert not _same(y, _unfused(x, w, 1e-6)), "reassociation changed no bit"


@check
def bad_input_is_refused():
    """Non-fp32, mismatched weight, RoPE with a non-power-of-two D or wrong cos shape: ValueError."""
    x = torch.randn(4, 2, 96)
    for args in ((x.double(), torch.ones(96), 1e-6), (x, torch.ones(95), 1e-6),
                 (x, torch.ones(96), 1e-6, torch.ones(4, 96), torch.ones(4, 96)),
                 (torch.randn(4, 2, 64), torch.ones(64), 1e-6, torch.ones(3, 64),
                  torch.ones(3, 64))):
        try:
            tn.rms_norm_apply(*args)
        except ValueError:
            continue
        raise AssertionError(f"accepted {[getattr(a, 'shape', a) for a in args]}")


def _bwd_inputs(n: int, heads: int, h: int, g: torch.Generator):
    """(dy, x̂, r, w) of the training norm's backward: x̂, r from the statistics kernel on rows
    like _rows; dy with zeros, -0.0 and a wide spread."""
    x = _rows(n * heads, h, g).view(n, heads, h) if heads > 1 else _rows(n, h, g)
    r, xh = tn.rms_stats(x, 1e-6)
    dy = torch.randn(x.shape, generator=g) * torch.logspace(-4, 4, x.numel() // h).view(
        *x.shape[:-1], 1)
    dy.view(-1, h)[5] = 0.0
    dy.view(-1, h)[6] = -0.0
    dy.view(-1, h)[7, ::3] = -0.0
    return dy, xh, r, torch.randn(h, generator=g)


def _bwd_reference(dy, xh, r, w, inv_h=None):
    """kernels/norm.py's torch-op backward (its CPU path, what CUDA runs as torch ops), with
    `/ H` as the multiply by fp32 1/H that CUDA's division by a CPU scalar does (inv_h given)."""
    from rlkernel.kernels import norm
    if inv_h is None:
        return norm._backward_rows(dy, xh, r, w, True)
    from rlkernel.numerics.trees import tree_sum
    g_ = dy * w
    dx = r[..., None] * (g_ - xh * (tree_sum(g_ * xh, -1) * inv_h)[..., None])
    return dx, norm._leaf_sums((dy * xh).reshape(xh.shape[0], -1, xh.shape[-1])).reshape(
        -1, xh.shape[-1])


def _inv(h: int) -> torch.Tensor:
    return torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(h), dtype=torch.float32)


@check
def backward_equals_the_torch_ops():
    """rms_backward's dx and per-leaf partials == the torch ops, bitwise: hidden widths 1024
    (norm.py's own code: 1/1024 is exact, so a true division is the same), 1000 and 96 (the
    padded tree; CUDA's reciprocal multiply), Q/K heads (16 × 128, 8 × 64); 48 tokens = 3
    leaves of 16."""
    from rlkernel.spec import TOKEN_LEAF
    g = torch.Generator().manual_seed(4)
    for heads, h in ((1, 1024), (1, 1000), (1, 96), (16, 128), (8, 64)):
        dy, xh, r, w = _bwd_inputs(48, heads, h, g)
        dx, part = tn.rms_backward(dy, xh, r, w, TOKEN_LEAF, True)
        want_dx, want_part = _bwd_reference(dy, xh, r, w, None if h & (h - 1) == 0 else _inv(h))
        assert _same(dx, want_dx), (heads, h, "dx")
        assert part.shape == want_part.shape and _same(part, want_part), (heads, h, "part")
        dx2, none = tn.rms_backward(dy, xh, r, w, TOKEN_LEAF, False)
        assert none is None and _same(dx2, dx)


@check
def backward_rows_alone_equal_the_batch():
    """One leaf's rows alone give that leaf's dx rows and partial (a token never depends on the
    others), and a stream that is not whole leaves still gets dx when no partial is asked
    (and a partial is refused)."""
    from rlkernel.spec import TOKEN_LEAF
    g = torch.Generator().manual_seed(5)
    dy, xh, r, w = _bwd_inputs(48, 8, 64, g)
    dx, part = tn.rms_backward(dy, xh, r, w, TOKEN_LEAF, True)
    dx1, part1 = tn.rms_backward(dy[16:32], xh[16:32], r[16:32], w, TOKEN_LEAF, True)
    assert _same(dx1, dx[16:32]) and _same(part1, part[8:16])
    dx2, _ = tn.rms_backward(dy[:21], xh[:21], r[:21], w, TOKEN_LEAF, False)
    assert _same(dx2, dx[:21])
    try:
        tn.rms_backward(dy[:21], xh[:21], r[:21], w, TOKEN_LEAF, True)
    except ValueError as e:
        assert "21 tokens" in str(e)
    else:
        raise AssertionError("a partial of 21 tokens was accepted")


@check
def backward_negative_controls_true_division_and_reversed_tokens_differ():
    """The comparisons can fail: at H = 1000 a true division by H (the CPU ops) gives other dx
    bits than CUDA's reciprocal multiply the kernel mirrors, and the leaf's tokens summed in
    reverse order give other partial bits."""
    from rlkernel.spec import TOKEN_LEAF
    g = torch.Generator().manual_seed(6)
    dy, xh, r, w = _bwd_inputs(48, 1, 1000, g)
    dx, part = tn.rms_backward(dy, xh, r, w, TOKEN_LEAF, True)
    assert not _same(dx, _bwd_reference(dy, xh, r, w)[0])
    rev = torch.flip((dy * xh).view(3, TOKEN_LEAF, 1000), [1]).sum(1)
    assert not _same(part, rev)


@check
def backward_signed_zero_rows_keep_minus_zero():
    """A leaf (tokens 16..31) whose dy rows are zeros signed so that every g·x̂ = dy·w·x̂ is
    −0.0: the mean tree's sum is −0.0 (and so every partial Σ dy·x̂ where w > 0), which only an
    additive identity of −0.0 keeps — the tree's padding past H (H = 1000, 96: padded trees) and
    the partial's start in the kernel; +0.0 there would turn them into +0.0. dx and the partials
    == the torch ops, bitwise, for one head and for 4 heads. Controls: the data reaches those
    signs — the same partials plus +0.0, and dx from the mean tree plus +0.0, give other bits.
    Fails today (tests/test_norm_triton.py marks it xfail): Triton turns the kernel's literal
    −0.0 into +0.0."""
    from rlkernel.numerics.trees import tree_sum
    from rlkernel.spec import TOKEN_LEAF
    g = torch.Generator().manual_seed(8)
    for heads, h in ((1, 1000), (1, 96), (4, 96)):
        dy, xh, r, w = _bwd_inputs(48, heads, h, g)
        leaf = slice(TOKEN_LEAF, 2 * TOKEN_LEAF)
        assert (xh[leaf] != 0).all() and (w != 0).all()
        dy[leaf] = torch.copysign(torch.zeros_like(xh[leaf]), -(w * xh[leaf]))
        dx, part = tn.rms_backward(dy, xh, r, w, TOKEN_LEAF, True)
        inv = _inv(h)
        want_dx, want_part = _bwd_reference(dy, xh, r, w, inv)
        assert _same(dx, want_dx), (heads, h, "dx")
        assert _same(part, want_part), (heads, h, "part")
        assert not _same(want_part + 0.0, want_part), (heads, h, "control: no -0.0 partial")
        g_ = dy * w
        q = tree_sum(g_ * xh, -1) * inv + 0.0
        assert not _same(r[..., None] * (g_ - xh * q[..., None]), want_dx), (heads, h, "control")


@check
def backward_bad_input_is_refused():
    """dy shaped unlike x̂, a non-fp32 dy, a wrong weight width: ValueError."""
    from rlkernel.spec import TOKEN_LEAF
    dy, xh, r, w = _bwd_inputs(16, 1, 96, torch.Generator().manual_seed(7))
    for args in ((dy[:, :95], xh, r, w), (dy.double(), xh, r, w), (dy, xh, r, w[:95])):
        try:
            tn.rms_backward(*args, TOKEN_LEAF, True)
        except ValueError:
            continue
        raise AssertionError(f"accepted {[tuple(a.shape) for a in args]}")


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
