"""The checks behind tests/test_adamw_triton.py, run in a subprocess with TRITON_INTERPRET=1: the
fused AdamW kernel (kernels/triton_adamw.adamw_) against adamw_cases.cuda_reference, the torch-op
sequence of train/optimizer.AdamW spelt on the CPU with the semantics PyTorch's CUDA kernels give
it — each Python scalar rounded to fp32 first, the division by the scalar bc2 as a product with
fp32(1) / fp32(bc2) (an fp32 division on the host), every op one correctly rounded fp32 result,
subnormals kept — and against the CPU path (kernels/adamw.adamw_rounded_, which
tests/test_kernels_adamw.py holds to the same reference), compared as int32 bits after every
step. The interpreter shows the operation
sequence and the host scalars; the PTX test in tests/test_adamw_triton.py shows code generation
(div.rn, sqrt.rn, no fma, no .ftz); tests/test_cuda_adamw.py runs both on a GPU.
Prints one JSON object {check name: "ok" or the failure}. Run by hand:
TRITON_INTERPRET=1 .venv/bin/python tests/adamw_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import math
import sys
import warnings

import numpy as np
import torch

from adamw_cases import HPS, cuda_reference, grad, state
from kernel_helpers import LaunchRecorder, interpreted_checks, n_diff, run_checks
from swiglu_cases import describe_diff, same_bits

CHECKS, check = interpreted_checks(__file__)

import triton_interpreter_compat  # noqa: F401 - numpy >= 2.3: before any launch

from rlkernel.distributed.comm import Comm
from rlkernel.kernels import adamw
from rlkernel.kernels import triton_adamw as ta
from rlkernel.train import optimizer
from rlkernel.train.optimizer import AdamW, AdamWParams
from rlkernel.train.zero import ZeroAdamW

# g·g of the 1e30 gradients overflows to +Inf, as it does on the GPU.
warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)

SIZES = (1, 1000, ta.BLOCK, 2 * ta.BLOCK + 37)   # under a block, exactly one, a ragged tail


def _run_kernel(p, m, v, grads, hp: AdamWParams, lrs, update=ta.adamw_) -> list:
    """The kernel's (p, m, v) after each step, from copies; lrs: one rate per step. update: the
    kernel, or adamw.adamw_rounded_ (the CPU path)."""
    p, m, v = p.clone(), m.clone(), v.clone()
    out = []
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        decay = 1.0 - lr * hp.weight_decay if hp.weight_decay else None
        s = adamw.step_scalars(hp.beta1, hp.beta2, hp.eps, math.sqrt(1.0 - hp.beta2 ** t),
                               lr / (1.0 - hp.beta1 ** t), decay)
        update(p, g, m, v, s)
        out.append((p.clone(), m.clone(), v.clone()))
    return out


def _run_reference(p, m, v, grads, hp: AdamWParams, lrs, **variant) -> list:
    out = []
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        p, m, v = cuda_reference(p, g, m, v, t, lr, hp, **variant)
        out.append((p, m, v))
    return out


def _diffs(got: list, want: list) -> int:
    return sum(n_diff(a, b) for step_g, step_w in zip(got, want) for a, b in zip(step_g, step_w))


def _assert_same(got: list, want: list, what, any_nan: bool = False) -> None:
    """Bitwise per step and tensor; any_nan: a NaN equals any NaN (swiglu_cases.same_bits: its
    sign and payload are the CPU's here — x86 makes −NaN — and no GPU's, which has one NaN)."""
    for t, (step_g, step_w) in enumerate(zip(got, want), start=1):
        for name, a, b in zip("pmv", step_g, step_w):
            if any_nan:
                assert same_bits(a, b), f"{what}: step {t}, {name}: {describe_diff(a, b)}"
            d = n_diff(a, b)
            assert any_nan or d == 0, f"{what}: step {t}, {name}: {d} of {a.numel()} differ"


def _case(n: int, seed: int, steps: int = 4):
    p, m, v = state(n, seed)
    return p, m, v, [grad(n, seed + 100 + t) for t in range(steps)]


@check
def kernel_equals_the_cuda_op_sequence():
    """4 steps, three hyperparameter sets (default; weight decay; other betas, ε and λ), sizes
    under a block, one block, a ragged tail; a rate that changes every step: same p, m, v bits."""
    for hp in HPS:
        for n in SIZES:
            p, m, v, grads = _case(n, n)
            lrs = [hp.lr * (1 + 0.5 * t) for t in range(len(grads))]
            _assert_same(_run_kernel(p, m, v, grads, hp, lrs),
                         _run_reference(p, m, v, grads, hp, lrs), (hp, n))


@check
def kernel_equals_the_cpu_path():
    """The kernel == kernels/adamw.adamw_rounded_ (what AdamW.step runs on CPU tensors), the
    cases of kernel_equals_the_cuda_op_sequence plus ±Inf/NaN gradients: same p, m, v bits,
    NaN at the same places (a NaN's sign and payload are the hardware's: numpy's fp32 ops here
    pass another operand's NaN on than the CPU path's float64 ones, and a GPU has one NaN)."""
    for hp in HPS:
        for n in SIZES:
            p, m, v, grads = _case(n, n + 1)
            grads[1][::7] = float("inf")
            grads[2][3::11] = float("-inf")
            grads[3][5::13] = float("nan")
            lrs = [hp.lr * (1 + 0.5 * t) for t in range(len(grads))]
            _assert_same(_run_kernel(p, m, v, grads, hp, lrs),
                         _run_kernel(p, m, v, grads, hp, lrs, adamw.adamw_rounded_), (hp, n),
                         any_nan=True)


@check
def moments_from_zero_as_the_optimizer_starts():
    """From m = v = 0 (AdamW's start), 3 steps with weight decay, zero and subnormal gradients."""
    hp = HPS[1]
    n = 3 * ta.BLOCK + 5
    p = state(n, 7)[0]
    zeros = torch.zeros(n)
    grads = [grad(n, 8), torch.zeros(n), grad(n, 9) * 2.0**-100]
    lrs = [hp.lr] * 3
    _assert_same(_run_kernel(p, zeros, zeros, grads, hp, lrs),
                 _run_reference(p, zeros, zeros, grads, hp, lrs), "from zero")


@check
def nonfinite_gradients_give_the_reference_bytes():
    """±Inf and NaN gradients (the optimizer does not skip them): the same NaN places, the same
    bits elsewhere (±Inf included)."""
    hp = HPS[1]
    p, m, v, grads = _case(500, 3, steps=2)
    grads[0][::7] = float("inf")
    grads[0][3::11] = float("-inf")
    grads[1][::13] = float("nan")
    lrs = [hp.lr] * 2
    _assert_same(_run_kernel(p, m, v, grads, hp, lrs), _run_reference(p, m, v, grads, hp, lrs),
                 "non-finite", any_nan=True)


@check
def empty_tensor_launches_nothing():
    with LaunchRecorder.swapped_in(ta, "_adamw_kernel") as rec:
        e = torch.zeros(0)
        ta.adamw_(e, e.clone(), e.clone(), e.clone(),
                  adamw.step_scalars(0.9, 0.999, 1e-8, 0.5, 1.0, None))
    assert rec.launches == []


@check
def launches_disable_fp_fusion():
    """Launched with enable_fp_fusion=False (the interpreter ignores the flag, so it is read off
    the launch) and the decay multiply compiled out without weight decay."""
    p, m, v, grads = _case(100, 1, steps=1)
    with LaunchRecorder.swapped_in(ta, "_adamw_kernel") as rec:
        for decay in (None, 0.99):
            ta.adamw_(p, grads[0], m, v, adamw.step_scalars(0.9, 0.999, 1e-8, 0.5, 1.0, decay))
    assert [kw["enable_fp_fusion"] for _, kw in rec.launches] == [False, False]
    assert [kw["DECAY"] for _, kw in rec.launches] == [False, True]


@check
def optimizer_step_runs_the_kernel_with_its_scalars():
    """AdamW.step with the kernel forced on for CPU tensors (the dispatch predicate patched):
    3 steps with weight decay, a changing rate, two tensors (one 2-D) == the CUDA reference; one
    launch per tensor per step; AdamW.step left on the CPU path gives the same bytes. The torch
    ops (_step_torch) differ: torch divides by bc2, and its fp32 CPU sqrt is not always
    correctly rounded."""
    hp = HPS[1]
    shapes = {"w": (33, 70), "b": (999,)}
    init = {k: state(math.prod(s), i)[0].reshape(s) for i, (k, s) in enumerate(shapes.items())}
    grads = [{k: grad(math.prod(s), 10 * t + i).reshape(s)
              for i, (k, s) in enumerate(shapes.items())} for t in range(3)]
    lrs = [hp.lr, 2 * hp.lr, 0.5 * hp.lr]
    fused, cpu, plain = AdamW(init, hp), AdamW(init, hp), AdamW(init, hp)
    saved = optimizer._kernel_takes
    optimizer._kernel_takes = lambda p: True
    try:
        with LaunchRecorder.swapped_in(ta, "_adamw_kernel") as rec:
            for gs, lr in zip(grads, lrs):
                fused.step(gs, lr=lr)
                plain._step_torch(gs, lr=lr)
    finally:
        optimizer._kernel_takes = saved
    assert len(rec.launches) == 3 * len(shapes)
    with LaunchRecorder.swapped_in(ta, "_adamw_kernel") as rec:
        for gs, lr in zip(grads, lrs):
            cpu.step(gs, lr=lr)
    assert rec.launches == []
    for k, s in shapes.items():
        z = torch.zeros(s)
        want = _run_reference(init[k], z, z, [gs[k] for gs in grads], hp, lrs)[-1]
        got = (fused.master[k], fused.exp_avg[k], fused.exp_avg_sq[k])
        _assert_same([got], [want], k)
        _assert_same([(cpu.master[k], cpu.exp_avg[k], cpu.exp_avg_sq[k])], [got], ("cpu", k))
    assert sum(n_diff(fused.master[k], plain.master[k]) for k in shapes) > 0


@check
def strided_master_is_updated_in_place_as_the_contiguous_one():
    """A master cloned from a transposed tensor (strided, as are its zeros_like moments) stepped
    through the kernel (forced on for CPU tensors), 3 steps with weight decay and a transposed
    gradient: p, m, v == the same state held contiguous, bitwise, and still strided afterwards.
    The kernel reads only contiguous tensors, so optimizer._fused_update steps contiguous copies
    and must write them back into the strided tensors. Control: the steps change the master's
    bytes (a copy that is never written back would leave them as they were)."""
    hp = HPS[1]
    t0 = state(48 * 70, 21)[0].reshape(48, 70)
    grads = [grad(48 * 70, 60 + t).reshape(48, 70).t() for t in range(3)]   # strided too
    lrs = [hp.lr, 2 * hp.lr, 0.5 * hp.lr]
    strided, flat = AdamW({"t": t0.t()}, hp), AdamW({"t": t0.t().contiguous()}, hp)
    tensors = (strided.master["t"], strided.exp_avg["t"], strided.exp_avg_sq["t"])
    assert not any(t.is_contiguous() for t in tensors)
    saved = optimizer._kernel_takes
    optimizer._kernel_takes = lambda p: True
    try:
        with LaunchRecorder.swapped_in(ta, "_adamw_kernel") as rec:
            for g, lr in zip(grads, lrs):
                strided.step({"t": g}, lr=lr)
                flat.step({"t": g.contiguous()}, lr=lr)
    finally:
        optimizer._kernel_takes = saved
    assert len(rec.launches) == 2 * 3                        # both took the kernel every step
    got = (strided.master["t"], strided.exp_avg["t"], strided.exp_avg_sq["t"])
    assert all(a is b and not a.is_contiguous() for a, b in zip(got, tensors))
    _assert_same([got], [(flat.master["t"], flat.exp_avg["t"], flat.exp_avg_sq["t"])], "t")
    assert n_diff(strided.master["t"], t0.t()) > 0


@check
def zero_chunks_at_unaligned_offsets_equal_the_whole_tensor():
    """ZeroAdamW ranks 0..2 of DP 3 (chunk views of the gradient starting at odd element
    offsets), kernel forced on: each rank's chunks == that slice of the whole-tensor reference."""
    hp = HPS[2]
    n = 2 * ta.BLOCK + 37                  # ⌈n / 3⌉ = 1379: rank offsets 1379, 2758
    init = {"w": state(n, 5)[0]}
    grads = [{"w": grad(n, 50 + t)} for t in range(3)]
    z = torch.zeros(n)
    want = _run_reference(init["w"], z, z, [gs["w"] for gs in grads], hp, [hp.lr] * 3)[-1]
    saved = optimizer._kernel_takes
    optimizer._kernel_takes = lambda p: True
    try:
        for rank in range(3):
            opt = ZeroAdamW(init, hp, Comm("dp", None, (0, 1, 2), rank))
            for gs in grads:
                opt.step(gs)
            got = (opt.inner.master["w"], opt.inner.exp_avg["w"], opt.inner.exp_avg_sq["w"])
            _assert_same([got], [tuple(opt.chunk("w", t) for t in want)], f"rank {rank}")
    finally:
        optimizer._kernel_takes = saved


@check
def negative_control_other_semantics_give_other_bytes():
    """Each plausible other spelling changes bits on these inputs, so the equalities above can
    fail: sqrt(v) divided by bc2 (CPU torch's way), 1 / bc2 rounded from float64, mul+add
    contracted (an fma), subnormals flushed (.ftz). Restored, the reference matches again."""
    hp = HPS[1]
    p, m, v, grads = _case(2 * ta.BLOCK + 37, 11)
    lrs = [hp.lr] * len(grads)
    got = _run_kernel(p, m, v, grads, hp, lrs)
    for variant in ("true_div", "inv_from_f64", "contract", "ftz"):
        assert _diffs(got, _run_reference(p, m, v, grads, hp, lrs, **{variant: True})) > 0, variant
    _assert_same(got, _run_reference(p, m, v, grads, hp, lrs), "restored")


@check
def negative_control_kernel_fed_the_float64_reciprocal_differs():
    """The kernel given inv = fp32(1 / bc2) (rounded from float64, not torch's fp32 division):
    other bytes at step 1 (β2 = 0.999, where the two differ), so the host division matters."""
    hp = HPS[0]
    p, m, v, grads = _case(1000, 12, steps=1)
    s = adamw.step_scalars(hp.beta1, hp.beta2, hp.eps, math.sqrt(1.0 - hp.beta2),
                           hp.lr / (1.0 - hp.beta1), None)
    wrong = s._replace(inv_bc2_sqrt=float(np.float32(1.0 / math.sqrt(1.0 - hp.beta2))))
    assert wrong.inv_bc2_sqrt != s.inv_bc2_sqrt
    want = _run_reference(p, m, v, grads, hp, [hp.lr])
    pw, mw, vw = p.clone(), m.clone(), v.clone()
    ta.adamw_(pw, grads[0], mw, vw, wrong)
    assert _diffs([(pw, mw, vw)], want) > 0
    _assert_same(_run_kernel(p, m, v, grads, hp, [hp.lr]), want, "restored")


@check
def bad_arguments_are_refused():
    """fp64, bf16, mismatched shapes, a non-contiguous tensor: ValueError."""
    s = adamw.step_scalars(0.9, 0.999, 1e-8, 0.5, 1.0, None)
    x = torch.zeros(8, 4)
    bad = [(x.double(), x, x, x), (x, x.bfloat16(), x, x), (x, x, torch.zeros(32), x),
           (x, x, x, torch.zeros(4, 8).t())]
    for args in bad:
        try:
            ta.adamw_(*(a.clone() for a in args), s)
        except ValueError:
            continue
        raise AssertionError(f"accepted {[(a.dtype, tuple(a.shape)) for a in args]}")


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
