"""The checks behind tests/test_activation_triton.py, run in a subprocess with TRITON_INTERPRET=1
(Triton's CPU interpreter must be chosen before triton is imported, and must not leak into the
other tests' process). Each check compares the SwiGLU kernels (kernels/triton_activation.py)
with the torch path on CPU (activation.swiglu_fwd_torch / swiglu_bwd_torch, the reference):
forward out and sig, backward d_gate and d_up, as int32 bits (tests/swiglu_cases.same_bits:
−0.0 counts, a NaN's payload does not), on the adversarial inputs of tests/swiglu_cases.py.
What the interpreter shows: the kernels' sequence of IEEE operations (numpy runs each one,
correctly rounded, in float64 or fp32 as typed) is the torch path's. What it cannot: code
generation (fma contraction, flush-to-zero, the division's lowering): the PTX test in
tests/test_activation_triton.py checks that; the GPU run, tests/test_cuda_backward.py.
Prints one JSON object {check name: "ok" or the failure}: the named checks, or all.
Run by hand: TRITON_INTERPRET=1 .venv/bin/python tests/activation_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("activation_triton_checks.py needs TRITON_INTERPRET=1")

import triton
import triton.language as tl
import triton_interpreter_compat  # noqa: F401 - numpy >= 2.3: before any launch
from kernel_helpers import LaunchRecorder, run_checks
from swiglu_cases import HARD_ULPS, cases, describe_diff, hard_gate_distances, same_bits

from rlkernel.kernels import elementwise as ew
from rlkernel.kernels import triton_activation as ta
from rlkernel.kernels import triton_elementwise as tew
from rlkernel.kernels.activation import swiglu_bwd_torch, swiglu_fwd_torch

CHECKS = {}
# numpy warns when the interpreter casts a NaN to int64 (exp64's n of a NaN input: the result
# is replaced by the NaN afterwards, as in the torch path), widens a signalling NaN or overflows
# to ±Inf (IEEE results, the same in the torch path).
warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _same(got: torch.Tensor, want: torch.Tensor, what: str, *inputs: torch.Tensor) -> None:
    assert same_bits(got, want), f"{what}: {describe_diff(got, want, *inputs)}"


def _fwd_same(gate: torch.Tensor, up: torch.Tensor, **launch) -> tuple[torch.Tensor, ...]:
    """Kernel (out, sig) == torch path (out, sig), bitwise; returns the kernel's."""
    out, sig = ta.swiglu_fwd(gate, up, **launch)
    want_out, want_sig = swiglu_fwd_torch(gate, up)
    _same(sig, want_sig, "sig", gate)
    _same(out, want_out, "out", gate, up)
    return out, sig


def _bwd_same(dh, gate, up, sig, **launch) -> tuple[torch.Tensor, ...]:
    """Kernel (d_gate, d_up) == torch path's, bitwise; returns the kernel's."""
    d_gate, d_up = ta.swiglu_bwd(dh, gate, up, sig, **launch)
    want_dg, want_du = swiglu_bwd_torch(dh, gate, up, sig)
    _same(d_gate, want_dg, "d_gate", dh, gate, up, sig)
    _same(d_up, want_du, "d_up", dh, gate, up, sig)
    return d_gate, d_up


@check
def constants_are_the_elementwise_ones():
    assert tew.COEF.value == tuple(ew._EXP_COEF) and len(tew.COEF.value) == 14
    assert (tew.LOG2E.value, tew.LN2_HI.value, tew.LN2_LO.value) == (ew._LOG2E, ew._LN2_HI,
                                                                     ew._LN2_LO)


@check
def hard_gates_are_near_fp32_midpoints():
    """Each hard gate's float64 σ (torch path, before rounding) is within HARD_ULPS float64 ulps
    of a midpoint between fp32 numbers; some exactly on one (a tie)."""
    d = hard_gate_distances()
    assert int(d.max()) <= HARD_ULPS and int((d == 0).sum()) > 0, d.max()


@triton.jit
def _exp64_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(Y + offs, tew.exp64(tl.load(X + offs, mask=ok, other=0.0)), mask=ok)


def _exp64_inputs() -> torch.Tensor:
    """float64 x: uniform over [−750, 715] (the clamps, the subnormal results below −708), the
    range-reduction boundaries k·ln2 and (k − ½)·ln2 for every n exp64 can reach, each with
    its float64 neighbours up to 3 ulps away, |x| log-uniform down to 2**-60, the clamp edges
    ±709 / ±745, ±0, ±Inf, NaN, and random bit patterns."""
    g = torch.Generator().manual_seed(3)
    k = torch.arange(-1080, 1026, dtype=torch.float64)
    bounds = torch.cat([k * ew._LN2, (k - 0.5) * ew._LN2]).view(torch.int64)
    near = torch.cat([(bounds + d).view(torch.float64) for d in range(-3, 4)])
    small = torch.exp2(torch.rand(2000, generator=g, dtype=torch.float64) * 66 - 60)
    edges = torch.tensor([709.0, -709.0, 745.0, -745.0, 0.0, -0.0, math.inf, -math.inf, math.nan],
                         dtype=torch.float64)
    edges = torch.cat([(edges.view(torch.int64) + d).view(torch.float64) for d in (-1, 0, 1)])
    rand_bits = torch.randint(-2**63, 2**63 - 1, (2000,), generator=g, dtype=torch.int64)
    return torch.cat([torch.rand(20000, generator=g, dtype=torch.float64) * 1465 - 750, near,
                      small, -small, edges, rand_bits.view(torch.float64)])


@check
def exp64_equals_the_torch_path_in_float64():
    """The kernels' exp (`triton_elementwise.exp64`, launched alone) == elementwise.exp64
    bitwise in float64 (NaN positions equal). σ's rounding to fp32 hides a slip of a few float64 ulps in exp except for
    gates near an fp32 midpoint, and the hard gates cannot cover every n of the range reduction:
    e.g. r computed as xc − (n·ln2_hi + n·ln2_lo) changes ~90% of exp64 values in [−104, 17]
    and no fp32 σ of 2·10**7 random gates there; this comparison sees it."""
    x = _exp64_inputs()
    y = torch.empty_like(x)
    _exp64_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    want = ew.exp64(x)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(y), nan), "NaN positions differ"
    bad = torch.nonzero(y.view(torch.int64)[~nan] != want.view(torch.int64)[~nan]).flatten()
    assert bad.numel() == 0, (f"{bad.numel()} of {x.numel()} differ, e.g. x "
                              f"{x[~nan][bad[:4]].tolist()}: {y[~nan][bad[:4]].tolist()} vs "
                              f"{want[~nan][bad[:4]].tolist()}")


@check
def forward_adversarial_values():
    gate, up, _ = cases()
    _fwd_same(gate, up)


@check
def backward_adversarial_values():
    gate, up, dh = cases()
    _, sig = swiglu_fwd_torch(gate, up)
    _bwd_same(dh, gate, up, sig)


@check
def every_gate_value_meets_every_kind_of_up_and_dh():
    """The gate set shifted against up/dh by 1..4 places, so each gate meets other specials."""
    gate, up, dh = cases()
    for s in range(1, 5):
        u, d = up.roll(s), dh.roll(-s)
        _, sig = _fwd_same(gate, u)
        _bwd_same(d, gate, u, sig)


@check
def lengths_not_a_multiple_of_the_block_and_launch_shapes():
    """Lengths 1, 7, 1023, 1025, 2·1024 + 3 (tails) and 0; BLOCK 128 / 4096 with 1 / 8 warps give
    the same bytes as the default launch."""
    gate, up, dh = cases()
    for n in (1, 7, 1023, 1025, 2 * 1024 + 3):
        out, sig = _fwd_same(gate[:n], up[:n])
        _bwd_same(dh[:n], gate[:n], up[:n], sig)
    out, sig = ta.swiglu_fwd(gate, up)
    grads = ta.swiglu_bwd(dh, gate, up, sig)
    for block, warps in ((128, 1), (4096, 8)):
        o2, s2 = ta.swiglu_fwd(gate, up, block=block, num_warps=warps)
        g2 = ta.swiglu_bwd(dh, gate, up, sig, block=block, num_warps=warps)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                   for a, b in zip((out, sig, *grads), (o2, s2, *g2))), (block, warps)
    empty = torch.empty(0, 5)
    assert [t.shape for t in ta.swiglu_fwd(empty, empty)] == [(0, 5), (0, 5)]
    assert [t.shape for t in ta.swiglu_bwd(empty, empty, empty, empty)] == [(0, 5), (0, 5)]


@check
def shapes_and_non_contiguous_inputs():
    """[L, I] and [B, L, I] shapes; a transposed gate, a column-strided up and a row-strided dh
    (the wrapper copies them contiguous): the torch path's bytes, in the input's shape."""
    n = 60 * 97
    gate, up, dh = cases(n_min=2 * n)
    g2, u2, d2 = (t[:n].reshape(60, 97) for t in (gate, up, dh))
    _, sig = _fwd_same(g2, u2)
    _bwd_same(d2, g2, u2, sig)
    _fwd_same(g2.reshape(3, 20, 97), u2.reshape(3, 20, 97))
    gt = g2.t()                                                    # [97, 60], strides (1, 97)
    ut = up[:2 * n].reshape(97, 120)[:, ::2]                       # [97, 60], strides (120, 2)
    dt = dh[:2 * n].reshape(194, 60)[::2]                          # [97, 60], strides (120, 1)
    out, sig = _fwd_same(gt, ut)
    assert out.shape == (97, 60) and out.is_contiguous()
    _bwd_same(dt, gt, ut, sig)


@check
def recomputed_sigma_gives_the_kept_sigmas_bytes():
    """Training keeps no sig: the forward without its store gives the same out (and None for
    sig), and the backward recomputing σ(gate) gives the d_gate, d_up of the backward reading
    the kept sig, bitwise, on the adversarial cases, a tail length and an empty input. Control:
    a sig off by one ulp changes d_gate, so the comparison can fail."""
    gate, up, dh = cases()
    for n in (gate.numel(), 1025):
        g, u, d = gate[:n], up[:n], dh[:n]
        out, sig = ta.swiglu_fwd(g, u)
        out2, none = ta.swiglu_fwd(g, u, keep_sig=False)
        assert none is None and same_bits(out2, out)
        for a, b in zip(ta.swiglu_bwd(d, g, u), ta.swiglu_bwd(d, g, u, sig)):
            assert same_bits(a, b)
    empty = torch.empty(0, 5)
    assert [t.shape for t in ta.swiglu_bwd(empty, empty, empty)] == [(0, 5), (0, 5)]
    g, u, d = gate[:4096], up[:4096], dh[:4096]
    _, sig = ta.swiglu_fwd(g, u)
    bumped = torch.nextafter(sig, torch.full_like(sig, 2.0))
    assert not same_bits(ta.swiglu_bwd(d, g, u, bumped)[0], ta.swiglu_bwd(d, g, u)[0])


@check
def bf16_stores_are_the_fp32_results_rounded():
    """out_dtype bf16 (the MLP's rounding points): out, d_gate, d_up == the fp32 kernels' values
    through Triton's own fp32 -> bf16 conversion, bitwise (the interpreter truncates where the
    GPU rounds to nearest even as torch does: tests/test_activation_triton.py reads cvt.rn in the
    PTX and tests/test_mlp.py compares with torch on a GPU). Control: the fp32 results have
    bits past bf16. An fp16 out_dtype is refused."""
    from triton_interpreter_compat import triton_bf16
    gate, up, dh = cases()
    out32, _ = ta.swiglu_fwd(gate, up, keep_sig=False)
    out16, _ = ta.swiglu_fwd(gate, up, keep_sig=False, out_dtype=torch.bfloat16)
    assert out16.dtype == torch.bfloat16 and same_bits(out16.float(), triton_bf16(out32))
    g32 = ta.swiglu_bwd(dh, gate, up)
    g16 = ta.swiglu_bwd(dh, gate, up, out_dtype=torch.bfloat16)
    for a, b in zip(g16, g32):
        assert a.dtype == torch.bfloat16 and same_bits(a.float(), triton_bf16(b))
    finite = out32.isfinite()
    assert not same_bits(out32[finite], triton_bf16(out32)[finite])
    for call in (lambda: ta.swiglu_fwd(gate, up, out_dtype=torch.float16),
                 lambda: ta.swiglu_bwd(dh, gate, up, out_dtype=torch.float16)):
        try:
            call()
        except ValueError:
            continue
        raise AssertionError("accepted an fp16 out_dtype")


@check
def bad_arguments_are_refused():
    x = torch.ones(4, 3)
    for args in ((x, torch.ones(3, 4)), (x.double(), x.double()), (x, x.bfloat16())):
        try:
            ta.swiglu_fwd(*args)
        except ValueError:
            continue
        raise AssertionError(f"accepted {[(a.dtype, tuple(a.shape)) for a in args]}")
    try:
        ta.swiglu_bwd(x, x, x, torch.ones(4))
    except ValueError:
        return
    raise AssertionError("accepted a sig of another shape")


@check
def launches_disable_fp_fusion():
    """Both wrappers launch with enable_fp_fusion=False (the PTX test shows what it changes)."""
    fwd, bwd = LaunchRecorder(ta._fwd_kernel), LaunchRecorder(ta._bwd_kernel)
    ta._fwd_kernel, ta._bwd_kernel = fwd, bwd
    try:
        x = torch.ones(5)
        ta.swiglu_bwd(x, x, x, ta.swiglu_fwd(x, x)[1])
    finally:
        ta._fwd_kernel, ta._bwd_kernel = fwd.kernel, bwd.kernel
    assert [kw.get("enable_fp_fusion") for _, kw in fwd.launches + bwd.launches] \
        == [False, False]


@triton.jit
def _sigmoid_fp32(g):
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _sigmoid_exp_rounded(g):
    e = tew.exp64(-(g.to(tl.float64))).to(tl.float32).to(tl.float64)   # e rounded to fp32
    return (1.0 / (1.0 + e)).to(tl.float32)


@triton.jit
def _grads_reassociated(dh, g, u, sig):
    return (dh * (u * sig)) * (1.0 + g * (1.0 - sig)), (dh * g) * sig


@check
def negative_control_other_roundings_differ():
    """The check can fail: σ in fp32 (tl.exp, fp32 add and divide), or σ with exp rounded to
    fp32 before 1/(1 + e) (two roundings instead of one), in place of the kernel's `_sigmoid32`,
    and the gradients with other associations (dh·(u·σ), (dh·g)·σ) in place of `_grads`, each
    give other bytes than the torch path on the adversarial inputs; restored, they match."""
    gate, up, dh = cases()
    want_out, want_sig = swiglu_fwd_torch(gate, up)
    want = swiglu_bwd_torch(dh, gate, up, want_sig)
    real_sig, real_grads = ta._sigmoid32, ta._grads
    try:
        for name, fake in (("fp32 sigmoid", _sigmoid_fp32), ("exp rounded", _sigmoid_exp_rounded)):
            ta._sigmoid32 = fake
            out, sig = ta.swiglu_fwd(gate, up)
            assert not same_bits(sig, want_sig), f"{name}: same sig bytes"
            assert not same_bits(out, want_out), f"{name}: same out bytes"
        ta._sigmoid32 = real_sig
        ta._grads = _grads_reassociated
        got = ta.swiglu_bwd(dh, gate, up, want_sig)
        assert not same_bits(got[0], want[0]) and not same_bits(got[1], want[1]), "reassociated"
    finally:
        ta._sigmoid32, ta._grads = real_sig, real_grads
    _fwd_same(gate, up)                                     # restored
    _bwd_same(dh, gate, up, want_sig)


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
