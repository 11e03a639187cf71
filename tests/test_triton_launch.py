"""kernels/triton_util.launch: the direct launch of a compiled Triton kernel, on CPU with stand-ins.

Properties: a kernel compiled for the arguments' specialisation (Triton's binder and cache key)
is launched through its own launcher with the grid padded to three dimensions, the current raw
stream, its function and packed metadata, no launch metadata or hooks, and the bound argument
values in order; everything else takes the usual `fn[grid](...)` path — a kernel not compiled
for these arguments (the cache key differs: another constexpr), one still compiling, launch hooks
that are set, pre-run hooks, a callable grid, a changed global the kernel read, the interpreter,
an object that is not a JIT function. The options JITFunction.run adds before binding (debug,
instrumentation mode) reach the binder, so the cache key is the one the usual path stored. On
the GPU every CUDA test launches through it (tests/test_cuda_*.py: the bytes), and
tests/test_cuda_backward.py checks it against fn[grid] on a real kernel.
Also triton_util.cast (the tensor itself when its dtype matches) and f32_reciprocal's cache
(keyed by bits: -0.0 and 0.0 apart).
Run: `.venv/bin/python -m pytest -q tests/test_triton_launch.py` (about 2 s).
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

from triton import knobs  # noqa: E402
from triton.runtime.jit import compute_cache_key  # noqa: E402

from rlkernel.kernels import triton_util  # noqa: E402

GLOBAL_SEEN = 3


class _Kernel:
    """A compiled kernel: records launcher calls."""

    def __init__(self):
        self.calls, self.function, self.packed_metadata = [], "fn-handle", ("meta",)

    def run(self, *args):
        self.calls.append(args)


class _Jit:
    """A JITFunction as `launch` reads it: binder, caches, hooks, globals, fn[grid]."""

    def __init__(self):
        self.pre_run_hooks, self.debug = [], False
        self.kernel_cache, self.key_cache = {}, {}
        self.device_caches = {0: (self.kernel_cache, self.key_cache, None, None, self.bind)}
        self.used_global_vals = {}
        self.usual = []
        self.bound_options = []

    def bind(self, x, n, BLOCK, **options):
        self.bound_options.append(dict(options))
        spec = [("*fp32", "D"), ("i32", ""), ("constexpr", BLOCK)]
        return {"x": x, "n": n, "BLOCK": BLOCK}, spec, options

    def compile_for(self, block: int) -> _Kernel:
        _, spec, opts = self.bind(None, 0, block, **_run_options())
        self.bound_options.clear()
        k = _Kernel()
        self.kernel_cache[compute_cache_key(self.key_cache, spec, opts)] = k
        return k

    def __getitem__(self, grid):
        return lambda *a, **k: self.usual.append((grid, a, k)) or "usual"


def _run_options() -> dict:
    return {"num_warps": 4, "debug": False or knobs.runtime.debug,
            "instrumentation_mode": knobs.compilation.instrumentation_mode}


@pytest.fixture
def cuda_like(monkeypatch):
    monkeypatch.setattr(triton_util, "INTERPRET", False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1000 + d, raising=False)


def test_a_compiled_kernel_is_launched_directly(cuda_like):
    fn = _Jit()
    k = fn.compile_for(64)
    out = triton_util.launch(fn, (5,), "x-ptr", 7, BLOCK=64, num_warps=4)
    assert out is k and fn.usual == []
    assert k.calls == [(5, 1, 1, 1000, "fn-handle", ("meta",), None, None, None, "x-ptr", 7, 64)]
    assert fn.bound_options[-1]["debug"] is False and "instrumentation_mode" in fn.bound_options[-1]
    triton_util.launch(fn, (2, 3), "x-ptr", 7, BLOCK=64, num_warps=4)
    assert k.calls[-1][:3] == (2, 3, 1)


def test_anything_else_takes_the_usual_path(cuda_like, monkeypatch):
    fn = _Jit()
    k = fn.compile_for(64)
    args = ("x-ptr", 7)
    assert triton_util.launch(fn, (5,), *args, BLOCK=32, num_warps=4) == "usual"   # not compiled
    fn.kernel_cache[next(iter(fn.kernel_cache))] = types.SimpleNamespace(result=lambda: k)
    assert triton_util.launch(fn, (5,), *args, BLOCK=64, num_warps=4) == "usual"   # compiling
    fn.compile_for(64)
    assert triton_util.launch(fn, lambda meta: (1,), *args, BLOCK=64, num_warps=4) == "usual"
    fn.pre_run_hooks.append(print)
    assert triton_util.launch(fn, (5,), *args, BLOCK=64, num_warps=4) == "usual"
    fn.pre_run_hooks.clear()
    fn.used_global_vals = {("GLOBAL_SEEN", 0): (2, globals())}     # compiled when it was 2
    assert triton_util.launch(fn, (5,), *args, BLOCK=64, num_warps=4) == "usual"
    fn.used_global_vals = {("GLOBAL_SEEN", 0): (3, globals())}
    assert triton_util.launch(fn, (5,), *args, BLOCK=64, num_warps=4) is not None
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        hook.add(print)
        try:
            assert triton_util.launch(fn, (5,), *args, BLOCK=64, num_warps=4) == "usual"
        finally:
            hook.remove(print)
    fn.used_global_vals = {("NOT_THERE_ANY_MORE", 0): (3, globals())}   # a global deleted
    assert triton_util.launch(fn, (5,), *args, BLOCK=64, num_warps=4) == "usual"
    fn.used_global_vals = {}
    assert triton_util.launch(object.__new__(_Plain), (5,), *args) == "plain"   # not a JIT fn
    monkeypatch.setattr(triton_util, "INTERPRET", True)
    assert triton_util.launch(fn, (5,), *args, BLOCK=64, num_warps=4) == "usual"
    assert len(fn.usual) == 9
    assert fn.usual[0] == ((5,), args, {"BLOCK": 32, "num_warps": 4})   # the caller's kwargs


class _Plain:
    def __getitem__(self, grid):
        return lambda *a, **k: "plain"


def test_the_current_device_picks_the_caches_and_the_stream(cuda_like, monkeypatch):
    """On device 1 the direct path reads device 1's compiled kernels and launches on device 1's
    current stream (not device 0's)."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    fn = _Jit()
    k = fn.compile_for(64)
    fn.device_caches = {1: fn.device_caches[0]}
    triton_util.launch(fn, (5,), "x-ptr", 7, BLOCK=64, num_warps=4)
    assert k.calls[-1][3] == 1001


def test_a_callers_debug_option_reaches_the_binder(cuda_like):
    """A caller's debug=True is bound as given (its kernel is another compilation: the usual
    path here), not replaced by the function's default."""
    fn = _Jit()
    fn.compile_for(64)
    assert triton_util.launch(fn, (5,), "x-ptr", 7, BLOCK=64, num_warps=4, debug=True) == "usual"
    assert fn.bound_options[-1]["debug"] is True


def test_cast_returns_the_tensor_itself_when_its_dtype_matches():
    t = torch.ones(3)
    assert triton_util.cast(t, torch.float32) is t
    b = triton_util.cast(t, torch.bfloat16)
    assert b.dtype == torch.bfloat16 and b is not t and torch.equal(b.float(), t)


def test_f32_reciprocal_cache_keeps_signed_zeros_apart():
    import math
    assert triton_util.f32_reciprocal(0.0) == math.inf
    assert triton_util.f32_reciprocal(-0.0) == -math.inf
    assert triton_util.f32_reciprocal(0.0) == math.inf
    assert triton_util.f32_reciprocal(3.0) == torch.tensor(1 / 3, dtype=torch.float32).item()
