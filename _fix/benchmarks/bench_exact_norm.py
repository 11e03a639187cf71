"""Exact sum of squares (Triton, integer limbs; rlkernel/kernels/triton_exact.py) vs
torch.linalg.vector_norm, fp32, 10M and 250M elements.

Ratio = torch time / ours (the throughput ratio; goal >= 0.7). "ours" is the kernel plus the
on-device limb sum (what ExactSumOfSquares.add_ launches); "ours+host" adds the host read of the
limbs and the Python fold to an exact integer (once per optimizer step in practice).
Run: PYTHONPATH=. python3 benchmarks/bench_exact_norm.py [--out FILE.json]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import dump, env, median_ms, require_cuda


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    require_cuda()
    from rlkernel.kernels import triton_exact as te
    from rlkernel.numerics.exact import ExactSumOfSquares
    rows = []
    for n in (10_000_000, 250_000_000):
        x = torch.randn(n, device="cuda") * 1e-2        # gradient-like magnitudes
        t_ref = median_ms(lambda: torch.linalg.vector_norm(x))
        t_ours = median_ms(lambda: te.sum_squares_limbs(x))

        for warps, per_sm in ((8, 8), (4, 16), (2, 16), (2, 32)):
            tv = median_ms(lambda: te.sum_squares_limbs(x, num_warps=warps, programs_per_sm=per_sm))
            print(f"   num_warps={warps} programs/SM={per_sm}: {tv:.4f} ms x{t_ref / tv:.3f}",
                  flush=True)

        def full():
            acc = ExactSumOfSquares()
            acc.add_(x)
            return acc.to_tensor()
        t_full = median_ms(full)
        rows.append({"n": n, "torch_ms": t_ref, "ours_ms": t_ours, "ours_host_ms": t_full,
                     "ratio": t_ref / t_ours, "ours_GBps": 4 * n / t_ours / 1e6})
        print(f"n={n:>11,d}: vector_norm {t_ref:.4f} ms | exact {t_ours:.4f} ms "
              f"x{t_ref / t_ours:.3f} ({4 * n / t_ours / 1e6:.0f} GB/s) | +host {t_full:.4f} ms",
              flush=True)
        del x
    wide = torch.randn(10_000_000, device="cuda") * torch.rand(10_000_000, device="cuda") ** 20
    t_ref = median_ms(lambda: torch.linalg.vector_norm(wide))
    t_ours = median_ms(lambda: te.sum_squares_limbs(wide))
    rows.append({"n": 10_000_000, "data": "randn*rand^20 (wide exponent range)", "torch_ms": t_ref,
                 "ours_ms": t_ours, "ratio": t_ref / t_ours})
    print(f"wide-range 10M: vector_norm {t_ref:.4f} ms | exact {t_ours:.4f} ms x{t_ref / t_ours:.3f}",
          flush=True)
    dump(args.out, {"env": env(), "rows": rows})


if __name__ == "__main__":
    main()
