"""Exact fixed-point sums on CUDA: the Triton kernels (rlkernel/numerics/triton_fixedpoint.py) vs
the torch paths on the same GPU, in one process.

Accumulation (issue 14): the kernel vs fixedpoint.accumulate_torch_ (float64 index_add_ bins, a
host sync per chunk; what accumulate_ ran on CUDA before) vs a plain fp32 `x.sum(0)` (what native
mode's autograd does).

Shapes: x [k, m] fp32 leaf partials of a weight slice, summed over dim 0 into an int64
[m, N_COLS] accumulator: [64, 3_000_000] (the headline), [256, 1_000_000], [8, 3_000_000], each
with narrow (randn·1e-3) and wide (randn·2**[-60, 20)) magnitudes. Before timing, the kernel's
accumulator is checked bytewise against the torch path's (an exact integer: they must agree).
Also a sweep of the kernel's launch shapes (BLOCK, num_warps), which change speed only.

Rounding: triton_fixedpoint.round_fp32 (one pass per row) vs fixedpoint.round_fp32_torch (~100
strided int64 ops; what round_fp32 ran on CUDA before: ~2.3 s of an 8.5 s qwen3-0.6b step) on
int64 [m, N_COLS] accumulators, m = 1024·1024, 1024·3072 (qwen3-0.6b projection / MLP weights)
and 2**24: "normalised" (one accumulator of x [8, m] wide values, as accumulate_ leaves it) and
"sum of 4" (four such accumulators added, unnormalised, as after an all-reduce). The fp32 bytes
are checked identical (int32 views) before timing; ratio torch path / kernel; kernel GB/s for
the 104 bytes read and 4 written per row; a launch sweep.
Run (repository root, one GPU, < 2 min): PYTHONPATH=. python3 benchmarks/bench_fixedpoint.py
[--out FILE.json] [--only accumulate|round]. Does not: run without CUDA, time the callers
(matmul/norm/embedding grads, the token-sum sinks).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import dump, env, median_ms, require_cuda

SHAPES = ((64, 3_000_000), (256, 1_000_000), (8, 3_000_000))
LAUNCHES = ((32, 1), (64, 2), (128, 4), (256, 8))
ROUND_ROWS = (1024 * 1024, 1024 * 3072, 1 << 24)
ROUND_LAUNCHES = ((64, 2), (128, 4), (256, 4), (256, 8), (512, 8))


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


def _round_row(m: int, summed: bool) -> dict:
    from rlkernel.numerics import fixedpoint as fx
    from rlkernel.numerics import triton_fixedpoint as tfx
    acc = tfx.accumulate_(fx.zeros((m,), "cuda"), _values(8, m, True))
    if summed:   # four ranks' accumulators added: digits leave [0, 2**31)
        for seed in (1, 2, 3):
            acc += tfx.accumulate_(fx.zeros((m,), "cuda"), -_values(8 + seed, m, True))
    want, got = fx.round_fp32_torch(acc), tfx.round_fp32(acc)
    identical = torch.equal(want.view(torch.int32), got.view(torch.int32))
    assert identical, f"round [{m}] summed={summed}: kernel and torch path disagree"
    t_torch = median_ms(lambda: fx.round_fp32_torch(acc), warmup_ms=10, rep_ms=100)
    t_kernel = median_ms(lambda: tfx.round_fp32(acc))
    sweep = {}
    for block, warps in ROUND_LAUNCHES:
        sweep[f"{block}x{warps}"] = median_ms(
            lambda b=block, w=warps: tfx.round_fp32(acc, block=b, num_warps=w))
    gbytes = m * (fx.N_COLS * 8 + 4) / 1e9
    row = {"m": m, "summed": summed, "identical": identical, "torch_path_ms": t_torch,
           "kernel_ms": t_kernel, "torch_path_over_kernel": t_torch / t_kernel,
           "kernel_GBps": gbytes / t_kernel * 1e3, "launch_sweep_ms": sweep}
    print(f"round [{m:,}, {fx.N_COLS}] {'sum of 4' if summed else 'normalised'}: torch path "
          f"{t_torch:.3f} ms | kernel {t_kernel:.3f} ms ({row['kernel_GBps']:.0f} GB/s) || "
          f"torch/kernel x{row['torch_path_over_kernel']:.1f} | identical {identical}", flush=True)
    print("   launch (BLOCK x warps) ms: " + ", ".join(f"{n} {t:.3f}" for n, t in sweep.items()),
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--only", choices=("accumulate", "round"))
    args = ap.parse_args()
    require_cuda()
    info = env()
    print(info, flush=True)
    rows = [] if args.only == "round" else [_row(k, m, wide) for k, m in SHAPES
                                            for wide in (False, True)]
    round_rows = [] if args.only == "accumulate" else [_round_row(m, summed) for m in ROUND_ROWS
                                                       for summed in (False, True)]
    dump(args.out, {"env": info, "rows": rows, "round_rows": round_rows})


if __name__ == "__main__":
    main()
