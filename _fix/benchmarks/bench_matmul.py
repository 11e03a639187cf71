"""Batch-invariant Triton matmul vs cuBLAS (F.linear), bf16 in / bf16 out, Qwen3-8B shapes.

Prints, per (M, layer), the median time of each and the throughput ratio cuBLAS_time / ours
(>= 1 means ours is faster). "ours" is triton_matmul.linear_nt as dispatched (pointer kernel
below TMA_MIN_M rows, persistent TMA kernel from there); the "tma" column forces the TMA kernel.
Checks that row 0 does not change with M and that the TMA kernel gives the pointer kernel's bytes. `--sweep` also times candidate tiles at M >= 1024
(and checks they give identical bytes: the tile may be tuned without changing any result).
Run: PYTHONPATH=. python3 benchmarks/bench_matmul.py [--sweep] [--out FILE.json]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import dump, env, median_ms, require_cuda

LAYERS = {"q/o 4096x4096": (4096, 4096), "gate/up 12288x4096": (12288, 4096),
          "down 4096x12288": (4096, 12288), "lm_head 151936x4096": (151936, 4096)}
MS = (1, 64, 1024, 8192)
SWEEP_PTR = [(128, 256, 8, 3, 8), (128, 256, 8, 4, 8), (256, 128, 8, 3, 8), (128, 128, 8, 4, 8),
             (128, 128, 4, 4, 8)]
SWEEP_SMALL = [(64, 64, 4, 4, 8), (64, 128, 4, 4, 8), (64, 32, 4, 4, 8), (64, 256, 4, 3, 8)]
SWEEP_TMA = [(128, 256, 8, 3, 8), (128, 256, 8, 4, 8), (128, 128, 8, 4, 8), (256, 128, 8, 3, 8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    require_cuda()
    from rlkernel.kernels import triton_matmul as tm
    torch.manual_seed(0)
    rows, sweep = [], []
    for name, (n, k) in LAYERS.items():
        w = torch.randn(n, k, device="cuda").bfloat16()
        x_all = torch.randn(max(MS), k, device="cuda").bfloat16()
        row0 = tm.linear_nt(x_all[:1], w, out_dtype=torch.bfloat16)[0]
        for m in MS:
            x = x_all[:m]
            flops = 2.0 * m * n * k
            t_ref = median_ms(lambda: F.linear(x, w))
            ours = tm.linear_nt(x, w, out_dtype=torch.bfloat16)
            t_ptr = median_ms(lambda: tm.linear_nt(x, w, out_dtype=torch.bfloat16))
            rec = {"layer": name, "M": m, "N": n, "K": k, "cublas_ms": t_ref, "ptr_ms": t_ptr,
                   "cublas_tflops": flops / t_ref / 1e9, "ptr_tflops": flops / t_ptr / 1e9,
                   "ratio_ptr": t_ref / t_ptr, "row0_same_as_M1": bool(torch.equal(ours[0], row0)),
                   "cublas_row0_same_as_M1": bool(torch.equal(F.linear(x, w)[0],
                                                              F.linear(x[:1], w)[0]))}
            try:
                tma = tm.linear_nt_tma(x, w)
                ours = tm.matmul(x, w.t(), out_dtype=torch.bfloat16)     # pointer kernel bytes
                rec["tma_ms"] = median_ms(lambda: tm.linear_nt_tma(x, w))
                rec["ratio_tma"] = t_ref / rec["tma_ms"]
                rec["tma_same_bytes"] = bool(torch.equal(tma.view(torch.int16),
                                                         ours.view(torch.int16)))
            except Exception as e:  # noqa: BLE001 - report and go on
                rec["tma_error"] = repr(e)[:300]
            rows.append(rec)
            print(f"{name:22s} M={m:5d}  cuBLAS {t_ref:8.3f} ms {rec['cublas_tflops']:6.1f} TF | "
                  f"ours {t_ptr:8.3f} ms x{rec['ratio_ptr']:.3f} | "
                  f"tma {rec.get('tma_ms', float('nan')):8.3f} ms x{rec.get('ratio_tma', 0):.3f} "
                  f"same={rec.get('tma_same_bytes')} row0={rec['row0_same_as_M1']} "
                  f"cublas_row0={rec['cublas_row0_same_as_M1']}", flush=True)
            if args.sweep:
                base = ours.view(torch.int16)
                cands = ([("ptr", c) for c in SWEEP_PTR] + [("tma", c) for c in SWEEP_TMA]
                         if m >= 1024 else [("ptr", c) for c in SWEEP_SMALL])
                for kind, cfg in cands:
                    try:
                        if kind == "ptr":
                            f = lambda: tm.linear_nt(x, w, out_dtype=torch.bfloat16, tile=cfg)  # noqa: E731
                        else:
                            f = lambda: tm.linear_nt_tma(x, w, tile=cfg)  # noqa: E731
                        same = bool(torch.equal(f().view(torch.int16), base))
                        t = median_ms(f, rep_ms=100)
                        sweep.append({"layer": name, "M": m, "kind": kind, "tile": cfg, "ms": t,
                                      "ratio": t_ref / t, "same_bytes": same})
                        print(f"   sweep {kind} {cfg}: {t:8.3f} ms x{t_ref / t:.3f} same={same}",
                              flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"   sweep {kind} {cfg}: error {repr(e)[:200]}", flush=True)
        del w, x_all
        torch.cuda.empty_cache()
    # fp32 (the model's path: fma chain) vs cuBLAS fp32, one shape
    x = torch.randn(1024, 4096, device="cuda")
    w = torch.randn(4096, 4096, device="cuda")
    t_ref = median_ms(lambda: F.linear(x, w))
    t_f32 = median_ms(lambda: tm.linear_nt(x, w))
    fp32 = {"M": 1024, "N": 4096, "K": 4096, "cublas_fp32_ms": t_ref, "ieee_fma_ms": t_f32,
            "ratio": t_ref / t_f32}
    print(f"fp32 1024x4096x4096: cuBLAS {t_ref:.3f} ms, ours (fma chain) {t_f32:.3f} ms "
          f"x{t_ref / t_f32:.3f}", flush=True)
    dump(args.out, {"env": env(), "rows": rows, "sweep": sweep, "fp32": fp32})


if __name__ == "__main__":
    main()
