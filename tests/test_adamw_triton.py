"""The fused AdamW kernel (kernels/triton_adamw.py) without a GPU, and the CPU optimizer path.

1. Under TRITON_INTERPRET=1 (checks in tests/adamw_triton_checks.py, one subprocess): the kernel
   == the torch-op sequence of train/optimizer.AdamW spelt with CUDA's semantics on the CPU
   (tests/adamw_cases.cuda_reference), bitwise, over several steps, with and without weight
   decay, on edge values and sizes around the block; == the CPU path
   (kernels/adamw.adamw_rounded_); through AdamW.step (a strided master too: written back in
   place) and ZeroAdamW chunks;
   negative controls: true division by bc2, the float64 reciprocal, fma contraction and
   flushed subnormals each give other bytes.
2. PTX for sm_90 (no device): div.rn.f32 and sqrt.rn.f32, no .ftz, no fma, nothing .approx;
   control: fp fusion on gives fma.
3. CPU: AdamW.step and ZeroAdamW.step on CPU tensors give cuda_reference's bytes (the kernel's,
   NUMERICS_VERSION 9: kernels/adamw.adamw_rounded_; tests/test_kernels_adamw.py holds it in
   detail), AdamW._step_torch the torch ops as they were before the kernel, and none imports
   triton (a fresh interpreter where `import triton` fails).
On a GPU: tests/test_cuda_adamw.py (kernel == torch ops on CUDA).
Run: `.venv/bin/python -m pytest -q tests/test_adamw_triton.py` (about 30 s).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kernel_helpers import NEEDS_TRITON, check_ok as _ok, checks_fixture, sm90_ptx

results = checks_fixture("adamw_triton_checks.py")
ROOT = Path(__file__).resolve().parent.parent


@NEEDS_TRITON
@pytest.mark.parametrize("name", [
    "kernel_equals_the_cuda_op_sequence",
    "kernel_equals_the_cpu_path",
    "moments_from_zero_as_the_optimizer_starts",
    "nonfinite_gradients_give_the_reference_bytes",
    "empty_tensor_launches_nothing",
    "launches_disable_fp_fusion",
    "optimizer_step_runs_the_kernel_with_its_scalars",
    "strided_master_is_updated_in_place_as_the_contiguous_one",
    "zero_chunks_at_unaligned_offsets_equal_the_whole_tensor",
    "negative_control_other_semantics_give_other_bytes",
    "negative_control_kernel_fed_the_float64_reciprocal_differs",
    "bad_arguments_are_refused",
])
def test_interpreted(results, name):
    """One check of tests/adamw_triton_checks.py (its docstring says what it holds)."""
    _ok(results, name)


def _ptx(fusion: bool, decay: bool, n_type: str = "i32") -> str:
    from rlkernel.kernels import triton_adamw as ta
    types = ["*fp32"] * 4 + [n_type] + ["fp32"] * 8 + ["constexpr"] * 2
    return sm90_ptx(ta._adamw_kernel, types, {"DECAY": decay, "BLOCK": ta.BLOCK}, ta.NUM_WARPS,
                    fusion)


@NEEDS_TRITON
@pytest.mark.parametrize("decay,n_type", [(True, "i32"), (False, "i64")])
def test_compiled_ptx_rounds_div_and_sqrt_without_ftz_or_fma(decay, n_type):
    """sm_90 PTX as launched (enable_fp_fusion=False), with and without the decay multiply, for
    an i32 and an i64 length: div.rn.f32 and sqrt.rn.f32 (torch's `/` and sqrt on CUDA), no
    .ftz anywhere (subnormals kept), no fma (every product rounded alone), no .approx; the
    products and sums are mul.rn/add.rn/sub.rn or their default-rounding spellings. Control:
    fusion on contracts them into fma.rn.f32."""
    ptx = _ptx(False, decay, n_type)
    assert re.search(r"\bdiv\.rn\.f32\b", ptx) and re.search(r"\bsqrt\.rn\.f32\b", ptx)
    assert ".ftz" not in ptx and "fma" not in ptx and ".approx" not in ptx
    assert not re.search(r"\b(div|sqrt)\.(full|approx)", ptx)
    assert "fma.rn.f32" in _ptx(True, decay, n_type)


_CPU_SCRIPT = textwrap.dedent('''
    import importlib.abc, json, math, sys

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError("triton is not installed here (blocked by the test)")
    sys.meta_path.insert(0, NoTriton())
    sys.path.insert(0, "tests")

    import torch
    from adamw_cases import cuda_reference
    from rlkernel.distributed.comm import Comm
    from rlkernel.train.optimizer import AdamW, AdamWParams
    from rlkernel.train.zero import ZeroAdamW

    def old_step(ms, ma, mv, grads, hp, lr, steps):
        # AdamW.step's torch ops before the fused kernel (main 563ba3c): _step_torch's bytes
        bc1 = 1.0 - hp.beta1 ** steps
        bc2_sqrt = math.sqrt(1.0 - hp.beta2 ** steps)
        for n, p in ms.items():
            g = grads[n].to(torch.float32)
            m = ma[n].mul_(hp.beta1).add_(g * (1.0 - hp.beta1))
            v = mv[n].mul_(hp.beta2).add_((g * g) * (1.0 - hp.beta2))
            denom = (torch.sqrt(v) / bc2_sqrt) + hp.eps
            if hp.weight_decay:
                p.mul_(1.0 - lr * hp.weight_decay)
            p.sub_((m / denom) * (lr / bc1))

    gen = torch.Generator().manual_seed(0)
    init = {"w": torch.randn(37, 41, generator=gen), "b": torch.randn(1001, generator=gen)}
    hp = AdamWParams(lr=1e-3, weight_decay=0.1)
    opt, zero, ops = AdamW(init, hp), ZeroAdamW(init, hp, Comm.single()), AdamW(init, hp)
    ms = {n: t.clone() for n, t in init.items()}
    ma = {n: torch.zeros_like(t) for n, t in init.items()}
    mv = {n: torch.zeros_like(t) for n, t in init.items()}
    ref = {n: (t.clone(), torch.zeros_like(t), torch.zeros_like(t)) for n, t in init.items()}
    for t, lr in enumerate((1e-3, 2e-3, 5e-4), start=1):
        grads = {n: torch.randn(x.shape, generator=gen) * 10.0 ** (t - 3) for n, x in init.items()}
        opt.step(grads, lr=lr)
        zero.step(grads, lr=lr)
        ops._step_torch(grads, lr=lr)
        old_step(ms, ma, mv, grads, hp, lr, t)
        ref = {n: cuda_reference(ref[n][0], grads[n], ref[n][1], ref[n][2], t, lr, hp)
               for n in init}
    bits = lambda x: x.reshape(-1).view(torch.int32)
    same = lambda states: all(torch.equal(bits(a[n]), bits(b[n])) for a, b in states for n in init)
    want = [{n: ref[n][k].reshape(init[n].shape) for n in init} for k in range(3)]
    zero_state = (zero.master, zero.inner.exp_avg, zero.inner.exp_avg_sq)
    print(json.dumps({
        "step": same(zip((opt.master, opt.exp_avg, opt.exp_avg_sq), want)),
        "zero": same(zip(zero_state, ({n: w[n].reshape(-1) for n in init} for w in want))),
        "torch_ops": same(zip((ops.master, ops.exp_avg, ops.exp_avg_sq), (ms, ma, mv))),
        "torch_ops_differ": not same([(ops.master, opt.master)]),
        "triton": sorted(m for m in sys.modules
                         if m.split(".")[0] == "triton" or m.endswith("triton_adamw"))}))
''')


def test_cpu_step_is_correctly_rounded_and_imports_no_triton():
    """In a fresh interpreter where `import triton` fails (CI has no triton): AdamW.step and
    ZeroAdamW.step (DP 1) on CPU, 3 steps with weight decay and a changing rate, ==
    adamw_cases.cuda_reference (the kernel's bytes), bitwise (p, m, v); AdamW._step_torch == the
    torch ops as they were before the kernel, and its masters differ from step's (the CPU bytes
    before NUMERICS_VERSION 9); no triton module and no kernels/triton_adamw was imported."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _CPU_SCRIPT], capture_output=True, text=True,
                         cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"step": True, "zero": True, "torch_ops": True, "torch_ops_differ": True,
                   "triton": []}, got
