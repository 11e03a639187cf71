"""kernels/mlp.py: the SwiGLU MLP as one autograd node has the bytes of the separate ops it fuses
(matmul.column_parallel_linear for gate/up, activation.swiglu, matmul.row_parallel_linear for
down): output, dX and the three dW, fp32 and bf16 compute, 1 / 2 / 8 local virtual-TP shards,
on the CPU and (when present) on a GPU, where the SwiGLU kernels store the bf16 activation and
its gradients rounded themselves. Control: rounding the activation's gradient (not only dY) in
the separate path moves dX. Also: frozen subsets of (x, W_gate, W_up, W_down) get the separate
ops' gradients; the CPU SwiGLU halves (swiglu_rounded / swiglu_grads_rounded) return the torch
path rounded to out_dtype; an x of another width is refused; the native arm's MLP is
transformers' Qwen3MLP on CPU, bitwise. The whole-model check is in tests/test_train_step.py.

Run: `.venv/bin/python -m pytest -q tests/test_mlp.py` (a few seconds).
"""

from __future__ import annotations

import re

import pytest
import torch

from rlkernel.kernels.activation import swiglu
from rlkernel.kernels.matmul import column_parallel_linear, row_parallel_linear
from rlkernel.kernels.mlp import swiglu_mlp

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _inputs(device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    m, h, inter = 256, 64, 96
    x = torch.randn(m, h, generator=g)
    ws = [(torch.randn(*shape, generator=g) * 0.2).bfloat16().float()
          for shape in ((inter, h), (inter, h), (h, inter))]
    dy = torch.randn(m, h, generator=g)
    return [t.to(device) for t in (x, *ws, dy)]


def _grads(fn, x, ws, dy):
    x = x.clone().requires_grad_(True)
    ws = [w.clone().requires_grad_(True) for w in ws]
    y = fn(x, *ws)
    y.backward(dy)
    return [t.view(torch.int32).clone() for t in (y.detach(), x.grad, *(w.grad for w in ws))]


def _separate(shards, cd, swiglu_fn=swiglu):
    def fn(x, wg, wu, wd):
        g, u = column_parallel_linear(x, [wg, wu], local_shards=shards, compute_dtype=cd)
        return row_parallel_linear(swiglu_fn(g, u), wd, local_shards=shards, compute_dtype=cd)
    return fn


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cd", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shards", [1, 2, 8])
def test_fused_mlp_equals_the_separate_ops(device, cd, shards):
    """Output, dX, dW_gate, dW_up, dW_down of swiglu_mlp == the separate ops', bitwise."""
    x, wg, wu, wd, dy = _inputs(device)
    fused = _grads(lambda x, a, b, c: swiglu_mlp(x, a, b, c, local_shards=shards,
                                                 compute_dtype=cd), x, (wg, wu, wd), dy)
    sep = _grads(_separate(shards, cd), x, (wg, wu, wd), dy)
    for name, a, b in zip(("y", "dx", "dw_gate", "dw_up", "dw_down"), fused, sep):
        assert torch.equal(a, b), (name, int((a != b).sum()))


@pytest.mark.parametrize("device", DEVICES)
def test_control_an_extra_rounding_of_the_activation_gradient_moves_dx(device):
    """The comparison above can fail: a separate path that also rounds SwiGLU's incoming
    gradient to bf16 (down's dX, fp32 in the fused node) gives other dX bytes."""
    x, wg, wu, wd, dy = _inputs(device)

    class _RoundGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return g.bfloat16().float()

    fused = _grads(lambda x, a, b, c: swiglu_mlp(x, a, b, c, compute_dtype=torch.bfloat16),
                   x, (wg, wu, wd), dy)
    ctl = _grads(_separate(8, torch.bfloat16, lambda g, u: _RoundGrad.apply(swiglu(g, u))),
                 x, (wg, wu, wd), dy)
    assert torch.equal(fused[0], ctl[0]) and not torch.equal(fused[1], ctl[1])


# Each non-empty subset of (x, w_gate, w_up, w_down) that requires a gradient, by index.
_NEEDS = [tuple(i for i in range(4) if mask >> i & 1) for mask in range(1, 16)]


@pytest.mark.parametrize("needs", _NEEDS, ids=lambda n: "-".join("x g u d".split()[i] for i in n))
def test_fused_mlp_gradients_follow_requires_grad_as_the_separate_ops_do(needs):
    """With only some of x, w_gate, w_up, w_down requiring a gradient (frozen weights), the
    fused node gives each of them the separate ops' gradient, bitwise, and the others none
    (needs_input_grad read at the right positions: a frozen w_up must not take w_down's
    gradient away, nor a frozen w_down give it one). The all-trainable subset is the
    comparison above; a frozen tensor must get no gradient on either side."""
    x, wg, wu, wd, dy = _inputs("cpu")

    def run(fn):
        ts = [t.clone().requires_grad_(i in needs) for i, t in enumerate((x, wg, wu, wd))]
        fn(*ts).backward(dy)
        return [None if t.grad is None else t.grad.view(torch.int32) for t in ts]
    fused = run(lambda x, a, b, c: swiglu_mlp(x, a, b, c, local_shards=2,
                                              compute_dtype=torch.bfloat16))
    sep = run(_separate(2, torch.bfloat16))
    for i, (a, b) in enumerate(zip(fused, sep)):
        assert (a is None) == (b is None) == (i not in needs), (i, needs)
        assert a is None or torch.equal(a, b), (i, int((a != b).sum()))


@pytest.mark.parametrize("cd", [torch.float32, torch.bfloat16])
def test_swiglu_rounded_helpers_are_the_torch_path_rounded_to_the_compute_dtype(cd):
    """On the CPU, activation.swiglu_rounded / swiglu_grads_rounded (the fused node's SwiGLU
    halves) return tensors of out_dtype holding swiglu_fwd_torch / swiglu_bwd_torch's fp32
    results cast to it, bitwise (fp32: the unrounded results). Control: those fp32 results
    have bits past bf16, so the bf16 comparison sees a missing rounding."""
    from rlkernel.kernels.activation import (swiglu_bwd_torch, swiglu_fwd_torch,
                                             swiglu_grads_rounded, swiglu_rounded)
    from rlkernel.kernels.elementwise import sigmoid32
    g = torch.Generator().manual_seed(3)
    gate, up, dh = (torch.randn(64, 96, generator=g) * 3 for _ in range(3))
    out32 = swiglu_fwd_torch(gate, up)[0]
    grads32 = swiglu_bwd_torch(dh, gate, up, sigmoid32(gate))
    got = (swiglu_rounded(gate, up, cd), *swiglu_grads_rounded(dh, gate, up, cd))
    for a, want in zip(got, (out32, *grads32)):
        assert a.dtype == cd, a.dtype
        assert torch.equal(a.float().view(torch.int32), want.to(cd).float().view(torch.int32))
    if cd == torch.bfloat16:
        assert all(not torch.equal(w.to(cd).float(), w) for w in (out32, *grads32))


def test_swiglu_mlp_refuses_an_input_of_another_width():
    """x whose last dimension is not the weights' H: ValueError naming the shapes (as for
    weights that do not form an MLP), not a matmul error from inside the node. Control: the
    same weights with x [M, H] run."""
    wg, wd = torch.zeros(16, 8), torch.zeros(8, 16)
    for width in (7, 9, 16):
        with pytest.raises(ValueError, match="expected gate and up"):
            swiglu_mlp(torch.zeros(16, width), wg, wg, wd)
    assert swiglu_mlp(torch.zeros(16, 8), wg, wg, wd).shape == (16, 8)


@pytest.mark.parametrize("shape", [(2, 16, 8), (8,)])
def test_swiglu_mlp_refuses_an_input_that_is_not_2d(shape):
    """x [B, T, H] or [H] (the docstring says [M, H]): ValueError naming its shape, not a
    matmul error with unrelated shapes (3-D) or an IndexError (1-D)."""
    wg, wd = torch.zeros(16, 8), torch.zeros(8, 16)
    want = f"x {shape} is {len(shape)}-D; expected x [M, H]"
    with pytest.raises(ValueError, match=re.escape(want)):
        swiglu_mlp(torch.zeros(shape), wg, wg, wd)


def _hf_grads(ref, x, ws, dy):
    """Output, dX and the gate/up/down dW (int32 bits) of transformers' Qwen3MLP `ref` with
    its weights set to ws."""
    for lin, w in zip((ref.gate_proj, ref.up_proj, ref.down_proj), ws):
        lin.weight = torch.nn.Parameter(w.clone())
    x = x.clone().requires_grad_(True)
    y = ref(x)
    y.backward(dy)
    return [t.view(torch.int32).clone() for t in (y.detach(), x.grad, ref.gate_proj.weight.grad,
                                                   ref.up_proj.weight.grad,
                                                   ref.down_proj.weight.grad)]


def test_native_mlp_on_cpu_is_transformers_qwen3_mlp():
    """--mode native's MLP (model/ops.NativeOps.mlp, the stock arm) on CPU tensors is
    transformers' Qwen3MLP, down_proj(silu(gate_proj(x)) * up_proj(x)), on the same weights:
    output, dX and the three dW bitwise, for an fp32 and a bf16 compute dtype (the CPU arm
    stays fp32). Control: gate and up swapped in the reference give other bytes."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    from rlkernel.distributed.parallel import ParallelCtx
    from rlkernel.model.ops import NativeOps
    from rlkernel.spec import VIRTUAL_TP
    x, wg, wu, wd, dy = _inputs("cpu")
    ref = Qwen3MLP(transformers.Qwen3Config(hidden_size=64, intermediate_size=96,
                                            hidden_act="silu"))
    want = _hf_grads(ref, x, (wg, wu, wd), dy)
    pc = ParallelCtx.single()
    for cd in (torch.float32, torch.bfloat16):
        ours = _grads(lambda x, a, b, c: NativeOps.mlp(x, a, b, c, VIRTUAL_TP, pc, cd),
                      x, (wg, wu, wd), dy)
        for name, a, b in zip(("y", "dx", "dw_gate", "dw_up", "dw_down"), ours, want):
            assert torch.equal(a, b), (cd, name, int((a != b).sum()))
    swapped = _hf_grads(ref, x, (wu, wg, wd), dy)
    assert not torch.equal(want[0], swapped[0])
