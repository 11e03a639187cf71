"""Inputs and the op-by-op oracle of AdamW's bytes (kernels/adamw.py: the fused CUDA kernel
kernels/triton_adamw.py and the CPU spelling adamw.adamw_rounded_ compute them); used by
tests/test_kernels_adamw.py (CPU), tests/adamw_triton_checks.py (interpreter) and
tests/test_cuda_adamw.py (GPU).

`cuda_reference`: one AdamW step of train/optimizer.AdamW's torch-op sequence spelt on the CPU
with the semantics PyTorch's CUDA kernels give it — each Python scalar rounded to fp32 first, the
division by the Python scalar bc2 as a product with fp32(1) / fp32(bc2) (an fp32 division on the
host, aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu), every op one correctly rounded fp32
result (`op_rn`), subnormals kept; with variants for negative controls. Written apart from
adamw.adamw_rounded_ (one op_rn per op, not its in-place float64 buffers), so that the tests'
equality with it checks the library's spelling rather than repeats it.
`state(n, seed)` / `grad(n, seed)`: (p, m, v) and gradients with edge values (±0, subnormals,
values to 1e38, v = 0 beside m ≠ 0, gradients whose square overflows).
Does not: run anything (no triton import).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from rlkernel.train.optimizer import AdamWParams

TINY = 2.0**-126           # smallest normal fp32
HPS = (AdamWParams(lr=1e-3), AdamWParams(lr=3e-4, weight_decay=0.1),
       AdamWParams(lr=0.05, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.01))


def s32(x) -> torch.Tensor:
    """A 0-dim fp32 tensor of x rounded to fp32 (numpy's cast: round to nearest even)."""
    return torch.tensor(np.float32(x))


def flush(x: torch.Tensor) -> torch.Tensor:
    """Subnormals to a zero of their sign (what an .ftz instruction does to inputs and results)."""
    return torch.where(x.abs() < TINY, x * 0.0, x)


def op_rn(f, *xs) -> torch.Tensor:
    """The correctly rounded fp32 result of f on fp32 operands: f in float64, rounded once to
    fp32 (double rounding is harmless for +, −, ×, ÷ and √ when the wide format has at least
    2·24 + 2 bits; Figueroa 1995). Not torch's fp32 CPU kernels: this torch's fp32 sqrt is not
    correctly rounded (test_kernels_adamw.py: test_reference_ops_are_correctly_rounded)."""
    return f(*(x.double() for x in xs)).float()


def cuda_reference(p, g, m, v, t: int, lr: float, hp: AdamWParams, *, true_div=False,
                   inv_from_f64=False, contract=False, ftz=False):
    """(p, m, v) after AdamW step t, new tensors, with CUDA's semantics (module doc), each op one
    fp32 rounding (`op_rn`). Variants, for the negative controls: `true_div` divides sqrt(v) by
    fp32(bc2); `inv_from_f64` rounds 1 / bc2 from float64; `contract` rounds each mul+add once
    (from float64, as an fma does bar rare double roundings); `ftz` flushes every op's
    subnormals."""
    bc2 = math.sqrt(1.0 - hp.beta2 ** t)
    step_size = lr / (1.0 - hp.beta1 ** t)
    inv = s32(1.0 / bc2) if inv_from_f64 else s32(np.float32(1.0) / np.float32(bc2))
    fl = flush if ftz else (lambda x: x)
    g, m, v, p = (fl(x) for x in (g, m, v, p))

    def mul(a, b):
        return fl(op_rn(torch.mul, a, b))

    def mul_add(a, b, c):
        if contract:
            return op_rn(lambda a, b, c: a * b + c, a, b, c)
        return fl(op_rn(torch.add, mul(a, b), c))

    m = mul_add(m, s32(hp.beta1), mul(g, s32(1.0 - hp.beta1)))
    v = mul_add(v, s32(hp.beta2), mul(mul(g, g), s32(1.0 - hp.beta2)))
    root = fl(op_rn(torch.sqrt, v))
    if true_div:
        denom = fl(op_rn(torch.add, fl(op_rn(torch.div, root, s32(bc2))), s32(hp.eps)))
    else:
        denom = mul_add(root, inv, s32(hp.eps))
    if hp.weight_decay:
        p = mul(p, s32(1.0 - lr * hp.weight_decay))
    return fl(op_rn(torch.sub, p, mul(fl(op_rn(torch.div, m, denom)), s32(step_size)))), m, v


def state(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(p, m, v) with edge values: zeros of both signs, subnormal moments and masters, large
    values, v = 0 beside m ≠ 0 (denominator ε alone), v subnormal."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.randn(n, generator=gen).square() * 1e-6
    edge = {0: (0.0, 0.0, 0.0), 1: (-0.0, -0.0, 0.0), 2: (2e-45, -3e-42, 1e-40),
            3: (1e30, 1e20, 1e38), 4: (-1e-39, 5e-39, 0.0), 5: (3.5, -1e-41, 2e-44),
            6: (-2.0, 1e-3, 0.0)}
    for i, (a, b, c) in edge.items():
        if i < n:
            p[i], m[i], v[i] = a, b, c
    return p, m, v


def grad(n: int, seed: int) -> torch.Tensor:
    """Gradients over 2**-140 .. 2**40 (subnormal to large) with zeros of both signs and 1e30
    (g·g overflows to +Inf)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-140, 40, (n,), generator=gen).float())
    g = torch.randn(n, generator=gen) * scale
    for i, x in enumerate((0.0, -0.0, 1e-45, -3e-40, 1e30, 0.0, -1e-44)):
        if i < n:
            g[(7 * i + 3) % n] = x
    return g
