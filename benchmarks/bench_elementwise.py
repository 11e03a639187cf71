"""SwiGLU forward + backward: the Triton kernels (rlkernel/kernels/triton_activation.py) vs the
torch path they replace (activation.swiglu_fwd_torch / swiglu_bwd_torch: ~40 float64 elementwise
launches for σ, ~190 ms of a 1.74 s qwen3 training step on an H200) vs stock silu(g)·u in fp32
and in bf16 (what native mode runs; not bitwise reproducible).

Each arm runs one forward (out, and σ or silu(g) kept for the backward) and one backward
(d_gate, d_up), as autograd would: ours = swiglu_fwd + swiglu_bwd; torch path = the same two as
torch ops; stock = F.silu(g)·u, then dh·silu(g) and aten.silu_backward(dh·u, g). Before timing,
the kernels' four outputs are checked bytewise against the torch path's (int32 views).
Shapes [tokens, intermediate]: [4096, 3072] (qwen3-0.6b), [16384, 3072], [4096, 12288] (8B).
Ratios: torch path / ours (the saving), ours / stock fp32 and ours / stock bf16 (the price).
Run (repository root, one GPU, < 1 min): PYTHONPATH=. python3 benchmarks/bench_elementwise.py
[--out FILE.json]. `--device cpu` is a smoke mode (a small shape, the torch path vs stock ops,
wall-clock medians; no Triton arm). Does not: time autograd bookkeeping or the linears around it.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import cpu_median_ms, dump, env, median_ms, require_cuda

CUDA_SHAPES = ((4096, 3072), (16384, 3072), (4096, 12288))
CPU_SHAPES = ((64, 1024),)


def _torch_path(g, u, dh):
    from rlkernel.kernels.activation import swiglu_bwd_torch, swiglu_fwd_torch
    out, sig = swiglu_fwd_torch(g, u)
    return (out, sig, *swiglu_bwd_torch(dh, g, u, sig))


def _ours(g, u, dh):
    from rlkernel.kernels import triton_activation as ta
    out, sig = ta.swiglu_fwd(g, u)
    return (out, sig, *ta.swiglu_bwd(dh, g, u, sig))


def _stock(g, u, dh):
    s = F.silu(g)
    return s * u, dh * s, torch.ops.aten.silu_backward(dh * u, g)


def _row(m: int, n: int, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(m + n)
    g, u, dh = (torch.randn(m, n, device=device, generator=gen) * s for s in (4.0, 1.0, 1e-3))
    g16, u16, dh16 = g.bfloat16(), u.bfloat16(), dh.bfloat16()
    timer = median_ms if device == "cuda" else cpu_median_ms
    row = {"m": m, "n": n, "device": device,
           "torch_path_ms": timer(lambda: _torch_path(g, u, dh)),
           "stock_fp32_ms": timer(lambda: _stock(g, u, dh)),
           "stock_bf16_ms": timer(lambda: _stock(g16, u16, dh16))}
    line = (f"[{m}, {n}] {device}: torch path {row['torch_path_ms']:.3f} ms | stock fp32 "
            f"{row['stock_fp32_ms']:.3f} ms | stock bf16 {row['stock_bf16_ms']:.3f} ms")
    if device == "cuda":
        identical = all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                        for a, b in zip(_ours(g, u, dh), _torch_path(g, u, dh)))
        assert identical, f"[{m}, {n}]: kernels and torch path disagree"
        ours = median_ms(lambda: _ours(g, u, dh))
        row.update(identical=identical, ours_ms=ours,
                   torch_path_over_ours=row["torch_path_ms"] / ours,
                   ours_over_stock_fp32=ours / row["stock_fp32_ms"],
                   ours_over_stock_bf16=ours / row["stock_bf16_ms"])
        line += (f" | ours {ours:.3f} ms || torch path/ours x{row['torch_path_over_ours']:.1f}, "
                 f"ours/stock fp32 x{row['ours_over_stock_fp32']:.2f}, ours/stock bf16 "
                 f"x{row['ours_over_stock_bf16']:.2f} | identical {identical}")
    print(line, flush=True)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        require_cuda()
        info = env()
        print(info, flush=True)
    else:
        info = {"device": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads()}
    rows = [_row(m, n, args.device)
            for m, n in (CUDA_SHAPES if args.device == "cuda" else CPU_SHAPES)]
    dump(args.out, {"env": info, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
