"""Host time of the small calls a training step makes thousands of times, with the device busy.

The invariant step issues ~14,000 launches; on a slow host it is host-bound (docs/BENCHMARKS.md,
twenty-seventh and twenty-ninth sessions). This measures, per call, the host microseconds of:
a 1k-element torch add, a trivial Triton launch, a TMA descriptor made on the host, a CUDA event
recorded / queried, the dW kernel launched by Triton's usual path, by triton_util.launch and by
its compiled launcher alone, the production `_launch` wrapper (TMA descriptors, pointer loads),
a whole carried dW call (kernels/triton_grad_weight.py), and a 4-byte device-to-host copy into
pinned memory both ways the gradient sink makes it (a fresh pinned tensor; a slice of a pinned
buffer). Each op runs N times behind a long `torch.cuda._sleep`, so a call that waits for the
device shows up twice: as host time near the sleep, and as `waited` (the sleep's end event had
passed when the calls returned).
Run (repository root, CUDA machine):
    PYTHONPATH=. python3 benchmarks/bench_host_ops.py [--calls 200] [--out host_ops.json]
Does not: time the device side of any op (bench_train_step.py --trace does that in a step).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import dump, env, require_cuda


def _ops(dev: torch.device) -> dict:
    """name -> a no-argument call of one small host operation on `dev`."""
    import triton
    import triton.language as tl

    @triton.jit
    def _touch(x, n, a, b, c, d, e, f, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)

    a = torch.zeros(1024, device=dev)
    b = torch.zeros(1024, device=dev)
    counts = torch.zeros(1024, dtype=torch.int32, device=dev)
    mirror = torch.empty(1024, dtype=torch.int32, pin_memory=True)
    bf = torch.zeros(4096, 2048, dtype=torch.bfloat16, device=dev)

    def fresh_pinned():
        torch.empty(1, dtype=torch.int32, pin_memory=True).copy_(counts[3].view(1),
                                                                 non_blocking=True)

    def pinned_slice():
        mirror[3:4].copy_(counts[3].view(1), non_blocking=True)

    def event_record():
        torch.cuda.Event().record()
    ev = torch.cuda.Event()
    ev.record()

    def descriptor():
        from triton.tools.tensor_descriptor import TensorDescriptor
        TensorDescriptor.from_tensor(bf, [128, 64])
    from rlkernel.kernels import triton_grad_weight as tgw
    dy, xw = (torch.randn(256, 256, device=dev).to(torch.bfloat16) for _ in range(2))
    words = torch.zeros(2, 256, 256, dtype=torch.float64, device=dev)
    count = torch.zeros((), dtype=torch.int32, device=dev)
    flags = torch.empty(16, dtype=torch.int32, device=dev)

    def dw_launch(use_tma: bool):
        return lambda: tgw._launch(dy, xw, words, flags, flags, (16,), tgw.TILE, False, False,
                                   use_tma=use_tma, carry=True)
    usual, direct, floor = _dw_launch_paths(tgw, dy, xw, words, flags)
    return {"torch add 1k": lambda: a + b,
            "dW kernel, Triton's usual launch": usual,
            "dW kernel, triton_util.launch": direct,
            "dW kernel, compiled launcher alone": floor,
            "dW _launch wrapper, TMA descriptors": dw_launch(True),
            "dW _launch wrapper, pointer loads": dw_launch(False),
            "dW carry call (2 launches)": lambda: tgw.carry_grad_weight_deferred(
                words, dy, xw, count=count),
            "triton launch (8 args)": lambda: _touch[(1,)](a, 1024, 1, 2, 3, 4, 5, 6, BLOCK=1024),
            "tma descriptor": descriptor,
            "event record": event_record,
            "event query": ev.query,
            "d2h 4 B, fresh pinned": fresh_pinned,
            "d2h 4 B, pinned slice": pinned_slice}


def _cycles_per_ms() -> float:
    """GPU clock cycles a millisecond, from a timed `torch.cuda._sleep` (no NVML needed)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / start.elapsed_time(end)


def _dw_launch_paths(tgw, dy, xw, words, flags):
    """The dW kernel's carried pass (pointer loads) launched three ways on the same arguments,
    the kernel compiled first: Triton's usual path (`fn[grid](...)`, JITFunction.run), the
    project's (kernels/triton_util.launch: Triton's binder and cache key, then the compiled
    kernel's launcher), and the launcher alone with the arguments bound once (the floor)."""
    from rlkernel.kernels.triton_util import launch
    jf = tgw._dw_kernel
    bn, bk, warps, stages = tgw.TILE[:4]
    args = (dy, xw, dy, xw, words, flags, flags, flags, dy.shape[0], dy.shape[1], xw.shape[1],
            dy.stride(0), dy.stride(1), xw.stride(0), xw.stride(1), words.stride(0),
            words.stride(1))
    kw = dict(BLOCK_N=bn, BLOCK_K=bk, LEAF=tgw.CUDA_TOKEN_LEAF, PREC="tf32", EMIT=False,
              RETRY=False, FORCE_FLAG=0, RETRY_ALL=False, TMA=False, CARRY=True, COUNTED=False,
              num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    k = jf[(16,)](*args, **kw)           # compiled and cached by the usual path
    binder = jf.device_caches[torch.cuda.current_device()][4]
    values = tuple(binder(*args, **kw)[0].values())     # the arguments in the kernel's order
    stream = torch.cuda.current_stream().cuda_stream
    return (lambda: jf[(16,)](*args, **kw), lambda: launch(jf, (16,), *args, **kw),
            lambda: k.run(16, 1, 1, stream, k.function, k.packed_metadata, None, None, None,
                          *values))


def _timed(fn, calls: int, sleep_cycles: int) -> dict:
    """Host µs per call of fn (after a warm-up call) with the device busy: the calls are issued
    behind a `_sleep` of sleep_cycles; waited = the sleep was over when they returned."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    done = torch.cuda.Event()
    done.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) * 1e6 / calls
    waited = done.query()
    torch.cuda.synchronize()
    return {"host_us": us, "waited": waited}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--sleep-ms", type=float, default=300.0,
                    help="device time to keep the GPU busy while the calls are issued")
    ap.add_argument("--out")
    a = ap.parse_args()
    require_cuda()
    dev = torch.device("cuda")
    cycles = int(a.sleep_ms * _cycles_per_ms())
    res = {"env": env(), "calls": a.calls, "sleep_ms": a.sleep_ms, "ops": {}}
    for name, fn in _ops(dev).items():
        r = _timed(fn, a.calls, cycles)
        res["ops"][name] = r
        print(f"{name:26s} {r['host_us']:9.1f} us a call"
              + ("   (WAITED for the device)" if r["waited"] else ""), flush=True)
    dump(a.out, res)


if __name__ == "__main__":
    main()
