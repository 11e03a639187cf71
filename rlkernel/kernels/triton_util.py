"""Small helpers shared by the Triton wrappers (rlkernel/kernels/triton_*.py).

`check_cuda` rejects tensors the kernels cannot read; `device_ctx` makes the tensor's GPU current
for the launch; `launch` launches a compiled kernel with less host time than `fn[grid](...)`;
`f32` / `f32_reciprocal` are the host-side fp32 scalars PyTorch's CUDA ops use.
With TRITON_INTERPRET=1 (Triton's CPU interpreter, used to check kernel logic on a machine
without a GPU) CPU tensors are accepted. Does not: compile anything itself (a first launch
takes Triton's usual path).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def check_cuda(what: str, *ts: torch.Tensor) -> None:
    """ValueError unless every tensor is on one CUDA device (any device under the interpreter)."""
    devs = {t.device for t in ts}
    if len(devs) != 1:
        raise ValueError(f"{what}: tensors on different devices {sorted(map(str, devs))}")
    if not INTERPRET and not ts[0].is_cuda:
        raise ValueError(f"{what}: CUDA tensors expected, got {ts[0].device}")


def f32(x: float) -> float:
    """x rounded to the nearest fp32 (as PyTorch casts a Python scalar for an fp32 op), as a
    Python float."""
    return torch.tensor(x, dtype=torch.float32).item()


def f32_reciprocal(x: float) -> float:
    """fp32(1) / fp32(x), an fp32 division, as a Python float: what PyTorch's CUDA division of
    an fp32 tensor by a Python scalar multiplies by (aten/src/ATen/native/cuda/
    BinaryDivTrueKernel.cu), so a kernel that mirrors such a division passes this. Cached by
    x's exact bits (a norm's backward asks for the same width hundreds of times a step; -0.0
    and 0.0 stay apart)."""
    return _f32_reciprocal_of_bits(float(x).hex())


@functools.lru_cache(maxsize=256)
def _f32_reciprocal_of_bits(bits: str) -> float:
    x = float.fromhex(bits)
    return (torch.tensor(1.0, dtype=torch.float32) / torch.tensor(x, dtype=torch.float32)).item()


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`: t itself when it already is (what Tensor.to returns then, without the
    call's host cost: thousands of such calls a step), else a rounded copy."""
    return t if t.dtype == dtype else t.to(dtype)


_MISSING = object()


def launch(fn, grid: tuple[int, ...], *args, **kwargs):
    """fn[grid](*args, **kwargs) — a Triton JIT kernel launched on the current device and stream
    — with less host time once fn is compiled for these arguments: Triton's own binder
    specialises the arguments and its own cache key finds the compiled kernel, whose launcher is
    called directly. What this skips of JITFunction.run is per-call Python that changes nothing
    here: the launch hooks (empty chains, yet each launch built their metadata and called both),
    the device lookup's lazy-init checks, the grid's canonical form. Anything else takes the
    usual path: the interpreter, a kernel not compiled yet (or compiling), a grid function,
    pre-run hooks, launch hooks that are set, or a global the kernel read that has changed
    since it was compiled (the usual path raises then). Same kernel, same arguments, same
    stream: the same launch. Why: a step of the invariant trainer makes ~6,700 Triton launches.
    Measured (docs/BENCHMARKS.md, thirtieth session, one H100 host): the dW kernel 26.1 µs by
    the usual path, 25.7 µs by this one — Triton's binder, which both run, is the cost, so the
    saving is small (~3 ms a step). Returns what fn[grid](...) returns (the compiled kernel)."""
    from triton import knobs
    if INTERPRET or callable(grid) or getattr(fn, "pre_run_hooks", True) \
            or knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls:
        return fn[grid](*args, **kwargs)
    device = torch._C._cuda_getDevice()
    caches = fn.device_caches.get(device)
    if caches is None:
        return fn[grid](*args, **kwargs)
    kernel_cache, key_cache, _, _, binder = caches
    from triton.runtime.jit import compute_cache_key
    # the options JITFunction.run adds before binding (so the same cache key)
    opts = {**kwargs, "debug": kwargs.get("debug", fn.debug) or knobs.runtime.debug,
            "instrumentation_mode": knobs.compilation.instrumentation_mode}
    bound, spec, options = binder(*args, **opts)
    kernel = kernel_cache.get(compute_cache_key(key_cache, spec, options))
    if kernel is None or hasattr(kernel, "result") or any(
            g.get(name, _MISSING) != val for (name, _), (val, g) in fn.used_global_vals.items()):
        return fn[grid](*args, **kwargs)
    g0, g1, g2 = (*grid, 1, 1)[:3]
    kernel.run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(device), kernel.function,
               kernel.packed_metadata, None, None, None, *bound.values())
    return kernel


def device_ctx(t: torch.Tensor):
    """Context that makes t's CUDA device current (a no-op for CPU tensors and for a tensor
    on the current device: the usual case, where the device switch cost host time on every
    launch — ~7,300 of them a step at qwen3-1.7b in four microbatches)."""
    # torch._C._cuda_getDevice: current_device() without its lazy-init checks (~3 µs a call on a
    # slow host); a CUDA tensor exists, so CUDA is initialised.
    if not t.is_cuda or t.device.index == torch._C._cuda_getDevice():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)
