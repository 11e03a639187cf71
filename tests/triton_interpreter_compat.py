"""Make Triton's CPU interpreter (TRITON_INTERPRET=1) usable with numpy >= 2.3: import this module
before launching a kernel under the interpreter.

Why: the interpreter holds every scalar as a 1-element numpy array and converts it for Python's
`range` with `int(array)`, which numpy 2.3+ refuses for arrays of ndim > 0 ("only 0-dimensional
arrays can be converted to Python scalars"), so any kernel loop with a runtime bound
(`for j0 in range(0, hi, BLOCK_N)`) fails (seen with triton 3.6 and numpy 2.4). The shim adds,
after the interpreter's own per-launch patch of `tl.tensor`, an `__index__` that takes the single
element with `.item()`; the interpreter's patch scope restores both on exit (last in, first out).
Second fix: the interpreter stores bfloat16 tensors as their raw uint16 bits and `tl.dot` runs
np.matmul on those bits (a bf16 dot returns ~1e10 garbage; `.to` conversions give bf16 values,
but fp32 -> bf16 truncates where the GPU rounds to nearest even).
The shim widens bf16 dot operands exactly to float32 first (the bits shifted into the top half),
so a bf16 dot is a float32 matmul of the exact values: the GPU's tensor cores are not emulated
(they may round differently), but kernel logic around a bf16 dot can be checked.
Changes nothing else and nothing outside the interpreter. Does not: touch compiled (GPU) runs.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as _interp

_original = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor, scope) -> None:
    _original(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


if getattr(_interp._patch_lang_tensor, "__module__", None) != __name__:
    _interp._patch_lang_tensor = _patch_lang_tensor


def _widen_bf16(x):
    if x.dtype.scalar == tl.bfloat16:
        bits = (x.data.astype(np.uint32) << 16).view(np.float32)
        return _interp.TensorHandle(bits, tl.float32)
    return x


_original_dot = _interp.InterpreterBuilder.create_dot


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    return _original_dot(self, _widen_bf16(a), _widen_bf16(b), d, input_precision,
                         max_num_imprecise_acc)


if getattr(_interp.InterpreterBuilder.create_dot, "__module__", None) != __name__:
    _interp.InterpreterBuilder.create_dot = _create_dot


def _chain_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """tl.dot as one chain per output element: acc = d, then acc = acc + a_k·b_k for k ascending
    (fp32 product, fp32 add)."""
    a32 = _widen_bf16(a).data.astype(np.float32)
    b32 = _widen_bf16(b).data.astype(np.float32)
    acc = d.data.astype(np.float32).copy()
    for i in range(a32.shape[-1]):
        acc = acc + a32[..., :, i:i + 1] * b32[..., i:i + 1, :]
    return _interp.TensorHandle(acc.astype(np.float32), d.dtype.scalar)


@contextlib.contextmanager
def sequential_dot():
    """Within the block, the interpreter's tl.dot is `_chain_dot`: an element then depends on its
    row, column and K order only (the property the GPU's dots have), where numpy's matmul may
    round an element by operand shape and memory alignment (numpy 2.4). Layout comparisons
    (one kernel against another, one tile against another) run under it."""
    real = _interp.InterpreterBuilder.create_dot
    _interp.InterpreterBuilder.create_dot = _chain_dot
    try:
        yield
    finally:
        _interp.InterpreterBuilder.create_dot = real


@triton.jit
def _to_bf16_kernel(X, Y, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i, mask=i < N).to(tl.bfloat16), mask=i < N)


def triton_bf16(x: torch.Tensor) -> torch.Tensor:
    """x fp32 -> fp32 values of Triton's `.to(tl.bfloat16)`, the kernels' rounding points (the
    interpreter truncates, unlike torch's and the GPU's round-to-nearest-even: so the expected
    bytes take the conversion from Triton itself; tests/test_cuda*.py check the GPU's rounding
    against torch's)."""
    flat = x.contiguous().reshape(-1)
    y = torch.empty(flat.shape, dtype=torch.bfloat16)
    _to_bf16_kernel[(triton.cdiv(flat.numel(), 1024),)](flat, y, flat.numel(), BLOCK=1024)
    return y.float().reshape(x.shape)
