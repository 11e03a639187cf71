"""Peak extra GPU memory of token logprobs + entropy: fused LM head (no logits) vs materialised
logits, for 64 and 256 samples x 512 tokens at vocab 151,936 (hidden 1024, Qwen3-0.6B; fp32).

Extra = peak allocated during the call minus what was allocated before it (inputs, weights).
The materialised path is measured where it fits; its logits alone are tokens x vocab x 4 bytes.
Run: PYTHONPATH=. python3 benchmarks/bench_logprob_memory.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import dump, env, require_cuda

V, H = 151936, 1024


def _peak_extra(fn) -> tuple[float, float]:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**30, dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    require_cuda()
    from rlkernel.kernels.logprobs import linear_token_logprobs_entropy, token_logprobs_entropy
    from rlkernel.kernels.matmul import linear_nt
    torch.manual_seed(0)
    w = torch.randn(V, H, device="cuda") * 0.02
    rows = []
    for samples in (64, 256):
        n = samples * 512
        h = torch.randn(n, H, device="cuda")
        tg = torch.randint(0, V, (n,), device="cuda")
        with torch.no_grad():
            fused_gb, fused_s = _peak_extra(lambda: linear_token_logprobs_entropy(h, w, tg, 1.0))
            rec = {"samples": samples, "tokens": n, "fused_extra_GiB": fused_gb,
                   "fused_s": fused_s, "logits_GiB": n * V * 4 / 2**30}
            try:
                mat_gb, mat_s = _peak_extra(
                    lambda: token_logprobs_entropy(linear_nt(h, w), tg, 1.0))
                rec.update(materialised_extra_GiB=mat_gb, materialised_s=mat_s)
            except torch.OutOfMemoryError:
                rec["materialised_extra_GiB"] = "OOM"
                torch.cuda.empty_cache()
        rows.append(rec)
        print(f"{samples} samples x 512 tokens: fused extra {fused_gb:.4f} GiB ({fused_s:.2f} s) | "
              f"materialised extra {rec['materialised_extra_GiB']} GiB "
              f"(logits alone {rec['logits_GiB']:.1f} GiB)", flush=True)
        del h, tg
        torch.cuda.empty_cache()
    dump(args.out, {"env": env(), "rows": rows})


if __name__ == "__main__":
    main()
