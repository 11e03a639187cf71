"""Exact fixed-point accumulation on CUDA (issue 14): the Triton kernel
(rlkernel/numerics/triton_fixedpoint.py) vs the torch path on the same GPU
(fixedpoint.accumulate_torch_: float64 index_add_ bins, a host sync per chunk; what
accumulate_ ran on CUDA before) vs a plain fp32 `x.sum(0)` (what native mode's autograd does).

Shapes: x [k, m] fp32 leaf partials of a weight slice, summed over dim 0 into an int64
[m, N_COLS] accumulator: [64, 3_000_000] (the headline), [256, 1_000_000], [8, 3_000_000], each
with narrow (randn·1e-3) and wide (randn·2**[-60, 20)) magnitudes. Before timing, the kernel's
accumulator is checked bytewise against the torch path's (an exact integer: they must agree).
Also a sweep of the kernel's launch shapes (BLOCK, num_warps), which change speed only.
Run (repository root, one GPU, < 60 s): PYTHONPATH=. python3 benchmarks/bench_fixedpoint.py
[--out FILE.json]. Does not: run without CUDA, time the callers (matmul/norm/embedding grads).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import dump, env, median_ms, require_cuda

SHAPES = ((64, 3_000_000), (256, 1_000_000), (8, 3_000_000))
LAUNCHES = ((32, 1), (64, 2), (128, 4), (256, 8))


def _values(k: int, m: int, wide: bool) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(k, m, device="cuda", generator=g)
    if not wide:
        return x * 1e-3
    e = torch.randint(-60, 20, (k, m), device="cuda", generator=g, dtype=torch.int32)
    return x * torch.exp2(e.float())     # powers of two: the product is exact


def _row(k: int, m: int, wide: bool) -> dict:
    from rlkernel.numerics import fixedpoint as fx
    from rlkernel.numerics import triton_fixedpoint as tfx
    x = _values(k, m, wide)
    acc_t = fx.accumulate_torch_(fx.zeros((m,), "cuda"), x)
    acc_k = tfx.accumulate_(fx.zeros((m,), "cuda"), x)
    identical = torch.equal(acc_t, acc_k)
    assert identical, f"[{k}, {m}] wide={wide}: kernel and torch path disagree"
    t_torch = median_ms(lambda: fx.accumulate_torch_(acc_t, x), warmup_ms=10, rep_ms=100)
    t_kernel = median_ms(lambda: tfx.accumulate_(acc_k, x))
    t_sum = median_ms(lambda: x.sum(0))
    sweep = {}
    for block, warps in LAUNCHES:
        sweep[f"{block}x{warps}"] = median_ms(
            lambda b=block, w=warps: tfx.accumulate_(acc_k, x, block=b, num_warps=w))
    gbytes = (x.numel() * 4 + 2 * m * fx.N_COLS * 8) / 1e9     # x read, accumulator read+write
    row = {"k": k, "m": m, "wide": wide, "identical": identical, "torch_path_ms": t_torch,
           "kernel_ms": t_kernel, "sum_ms": t_sum, "kernel_over_sum": t_kernel / t_sum,
           "torch_path_over_kernel": t_torch / t_kernel, "kernel_GBps": gbytes / t_kernel * 1e3,
           "launch_sweep_ms": sweep}
    print(f"x [{k}, {m:,}] {'wide' if wide else 'narrow'}: torch path {t_torch:.2f} ms | kernel "
          f"{t_kernel:.3f} ms ({row['kernel_GBps']:.0f} GB/s) | x.sum(0) {t_sum:.3f} ms || "
          f"kernel/sum x{row['kernel_over_sum']:.2f}, torch/kernel x{row['torch_path_over_kernel']:.0f}"
          f" | identical {identical}", flush=True)
    print("   launch (BLOCK x warps) ms: " + ", ".join(f"{n} {t:.3f}" for n, t in sweep.items()),
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    require_cuda()
    info = env()
    print(info, flush=True)
    rows = [_row(k, m, wide) for k, m in SHAPES for wide in (False, True)]
    dump(args.out, {"env": info, "rows": rows})


if __name__ == "__main__":
    main()
