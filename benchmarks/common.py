"""Shared helpers of the benchmark scripts: timing (median of repeats), environment record.

Run any script on a CUDA machine from the repository root, e.g.
    PYTHONPATH=. python3 benchmarks/bench_matmul.py --out matmul.json
Does not: run without CUDA (each script exits with a message).
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time

import torch


def require_cuda() -> None:
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA device")


def median_ms(fn, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median wall time of fn() in ms over repeats (triton.testing.do_bench: CUDA events)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def cpu_median_ms(fn, reps: int = 5) -> float:
    """Median wall time of fn() in ms over `reps` runs after one warm-up (the CPU smoke modes)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def env() -> dict:
    import triton
    p = torch.cuda.get_device_properties(0)
    return {"device": p.name, "sms": p.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}


def dump(path: str | None, obj: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
