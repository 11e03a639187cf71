"""The fused AdamW kernel (kernels/triton_adamw.py) on a GPU: AdamW.step through the kernel ==
through the torch ops on CUDA (AdamW._step_torch), bitwise — p, m, v after each of 3 steps with
weight decay and a changing rate, on tensors with edge values (±0, subnormals, 1e30, ±Inf, NaN);
the same through ZeroAdamW chunks at unaligned offsets; and the torch ops on CUDA == their
semantics as spelt on the CPU (tests/adamw_cases.cuda_reference: fp32 scalars, the reciprocal
multiply), which is what the interpreter checks hold the kernel to.
Skipped without CUDA (CI has no GPU). Run on the GPU machine (about 10 s):
    PYTHONPATH=. python3 -m pytest -q tests/test_cuda_adamw.py
"""

from __future__ import annotations

import math

import pytest
import torch

from adamw_cases import cuda_reference, grad, state
from rlkernel.distributed.comm import Comm
from rlkernel.train.optimizer import AdamW, AdamWParams
from rlkernel.train.zero import ZeroAdamW

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = "cuda"
HP = AdamWParams(lr=3e-4, weight_decay=0.1)
LRS = (3e-4, 6e-4, 1e-4)
# Under a block, exactly one (2048), ragged tails, 2-D/3-D, one over 2**20 elements.
SHAPES = {"one": (1,), "small": (1000,), "block": (2048,), "ragged": (4133,),
          "w": (300, 257), "cube": (3, 5, 7), "big": ((1 << 20) + 3,)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.int32)


def _n_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    assert a.shape == b.shape and a.dtype == b.dtype
    return int((_bits(a) != _bits(b)).sum())


def _inputs(shapes: dict, nonfinite: bool = True):
    """(masters, exp_avg, exp_avg_sq, [grads per step]) on CUDA, with edge values (adamw_cases)
    and, if nonfinite, ±Inf/NaN gradients at strided places in step 2."""
    init, ma, mv, grads = {}, {}, {}, [{}, {}, {}]
    for i, (n, s) in enumerate(shapes.items()):
        p, m, v = (t.reshape(s).to(DEV) for t in state(math.prod(s), i))
        init[n], ma[n], mv[n] = p, m, v
        for t in range(3):
            grads[t][n] = grad(math.prod(s), 100 * t + i).reshape(s).to(DEV)
        if nonfinite:
            g = grads[1][n].view(-1)
            g[::97] = float("inf")
            g[5::89] = float("-inf")
            g[11::83] = float("nan")
    return init, ma, mv, grads


def _pair(init, ma, mv):
    """Two AdamW from the same state: one steps through the kernel, one through the torch ops."""
    a, b = AdamW(init, HP), AdamW(init, HP)
    for o in (a, b):
        o.load_state(init, ma, mv, 0)
    return a, b


def _count_kernel_calls(monkeypatch) -> list:
    from rlkernel.kernels import triton_adamw as ta
    calls = []
    real = ta.adamw_

    def counting(p, *args):
        calls.append(p.numel())
        return real(p, *args)
    monkeypatch.setattr(ta, "adamw_", counting)
    return calls


def test_kernel_step_equals_the_torch_ops_on_cuda(monkeypatch):
    """3 steps (weight decay 0.1, rates 3e-4, 6e-4, 1e-4) of every shape, moments from edge
    values; step 2 has ±Inf/NaN gradients: p, m, v bitwise equal after every step (NaNs too: the
    GPU makes one NaN). The kernel ran once per tensor per step."""
    calls = _count_kernel_calls(monkeypatch)
    init, ma, mv, grads = _inputs(SHAPES)
    fused, ops = _pair(init, ma, mv)
    for t, (gs, lr) in enumerate(zip(grads, LRS), start=1):
        fused.step(gs, lr=lr)
        ops._step_torch(gs, lr=lr)
        for name, a, b in (("p", fused.master, ops.master), ("m", fused.exp_avg, ops.exp_avg),
                           ("v", fused.exp_avg_sq, ops.exp_avg_sq)):
            bad = {n: _n_diff(a[n], b[n]) for n in SHAPES if _n_diff(a[n], b[n])}
            assert not bad, f"step {t}, {name}: differing elements per tensor {bad}"
    assert len(calls) == 3 * len(SHAPES)


def test_bf16_grads_and_strided_masters(monkeypatch):
    """bf16 gradients (cast to fp32 first, as the torch path does) and a non-contiguous
    gradient take the kernel; a master cloned from a transposed parameter (strided) keeps the
    torch ops. All == the torch ops, bitwise, over 3 steps."""
    calls = _count_kernel_calls(monkeypatch)
    init, ma, mv, grads = _inputs({"w": (64, 48), "b": (1000,)}, nonfinite=False)
    init["t"] = torch.randn(48, 64, device=DEV).t()          # strided master
    ma["t"], mv["t"] = torch.zeros(64, 48, device=DEV), torch.zeros(64, 48, device=DEV)
    for gs in grads:
        gs["w"] = gs["w"].bfloat16()
        gs["b"] = torch.stack([gs["b"], gs["b"]], 1)[:, 0]   # stride 2
        gs["t"] = torch.randn(64, 48, device=DEV)
    fused, ops = _pair(init, ma, mv)
    assert not fused.master["t"].is_contiguous()
    for gs, lr in zip(grads, LRS):
        fused.step(gs, lr=lr)
        ops._step_torch(gs, lr=lr)
    for a, b in ((fused.master, ops.master), (fused.exp_avg, ops.exp_avg),
                 (fused.exp_avg_sq, ops.exp_avg_sq)):
        assert all(_n_diff(a[n], b[n]) == 0 for n in init)
    assert len(calls) == 3 * 2                                # "t" never took the kernel


def test_zero_chunks_through_the_kernel_equal_the_torch_ops():
    """ZeroAdamW ranks 0..2 of DP 3 (chunks of 4133 and 300·257 elements start at unaligned
    offsets; no collective runs in step): 3 steps through the kernel == through the torch ops,
    bitwise, and == that slice of a whole-tensor AdamW."""
    shapes = {"ragged": (4133,), "w": (300, 257)}
    init, _, _, grads = _inputs(shapes)
    whole = AdamW(init, HP)
    for gs, lr in zip(grads, LRS):
        whole._step_torch(gs, lr=lr)
    for rank in range(3):
        dp = Comm("dp", None, (0, 1, 2), rank)
        fused, ops = ZeroAdamW(init, HP, dp), ZeroAdamW(init, HP, dp)
        for gs, lr in zip(grads, LRS):
            fused.step(gs, lr=lr)
            ops.inner._step_torch({n: ops.chunk(n, g) for n, g in gs.items()}, lr=lr)
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            a, b, w = (getattr(o, kind) for o in (fused.inner, ops.inner, whole))
            for n in shapes:
                assert _n_diff(a[n], b[n]) == 0, (rank, kind, n)
                assert _n_diff(a[n], fused.chunk(n, w[n])) == 0, (rank, kind, n)


def test_torch_ops_on_cuda_are_the_spelt_semantics():
    """The torch ops on CUDA == adamw_cases.cuda_reference on the CPU (fp32 scalars, sqrt(v)
    times fp32(1) / fp32(bc2), correctly rounded ops, subnormals kept), bitwise over 3 steps
    with edge values (finite: the CPU's NaN signs are not the GPU's): the semantics the
    interpreter checks hold the kernel to are CUDA's. Controls: true division by bc2 and
    flushed subnormals give other bytes on the same inputs."""
    shapes = {"ragged": (4133,), "w": (300, 257)}
    init, ma, mv, grads = _inputs(shapes, nonfinite=False)
    ops = _pair(init, ma, mv)[1]
    want = {n: (init[n].cpu(), ma[n].cpu(), mv[n].cpu()) for n in shapes}
    other = dict.fromkeys(("true_div", "ftz"), 0)
    for t, (gs, lr) in enumerate(zip(grads, LRS), start=1):
        prev, want = want, {}
        for n in shapes:
            p, m, v = prev[n]
            g = gs[n].cpu()
            want[n] = cuda_reference(p, g, m, v, t, lr, HP)
            for variant in other:
                alt = cuda_reference(p, g, m, v, t, lr, HP, **{variant: True})
                other[variant] += _n_diff(alt[0], want[n][0])
        ops._step_torch(gs, lr=lr)
        for n in shapes:
            for name, got, w in zip("pmv", (ops.master[n], ops.exp_avg[n], ops.exp_avg_sq[n]),
                                    want[n]):
                assert _n_diff(got.cpu(), w) == 0, (t, n, name, _n_diff(got.cpu(), w))
    assert all(other.values()), other
