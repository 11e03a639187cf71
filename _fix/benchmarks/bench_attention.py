"""Invariant Triton attention (fixed 64-key blocks at absolute positions) vs stock SDPA.

Qwen3-8B heads: 32 query / 8 KV heads, head_dim 128, bf16. Prefill: one causal sequence of 2k and
8k tokens. Decode: batch 64, one new token against a 2k / 4k / 8k KV cache. Ratio = SDPA time /
ours (>= 1: ours faster). SDPA gets GQA natively (enable_gqa) when its flash path accepts it,
otherwise K/V expanded beforehand (outside the timing). Also one fp32 row (the model's path).
Run: PYTHONPATH=. python3 benchmarks/bench_attention.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import dump, env, median_ms, require_cuda

HQ, HKV, D = 32, 8, 128


def _sdpa(q, k, v, causal, backend=SDPBackend.FLASH_ATTENTION):
    """A timed SDPA closure and how GQA was handled."""
    try:
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        def f():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return f, "enable_gqa"
    except RuntimeError:
        g = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

        def f():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
        return f, "expanded"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    require_cuda()
    from rlkernel.kernels.triton_attention import attention_forward
    torch.manual_seed(0)
    rows = []
    sc = 1 / math.sqrt(D)
    for t in (2048, 8192):
        q = torch.randn(1, HQ, t, D, device="cuda").bfloat16()
        k = torch.randn(1, HKV, t, D, device="cuda").bfloat16()
        v = torch.randn(1, HKV, t, D, device="cuda").bfloat16()
        pos = torch.arange(t, device="cuda")[None]
        lens = torch.tensor([t], device="cuda")
        f_ref, how = _sdpa(q, k, v, True)
        t_ref = median_ms(f_ref)
        t_inv = median_ms(lambda: attention_forward(q, k, v, pos, lens, sc))
        flops = 4.0 * HQ * D * t * (t + 1) / 2
        for cfg in ((128, 8, 3), (64, 4, 2), (64, 4, 3), (128, 4, 2)):
            try:
                tv = median_ms(lambda: attention_forward(q, k, v, pos, lens, sc, tile=cfg), rep_ms=100)
                print(f"   tile {cfg}: {tv:.3f} ms x{t_ref / tv:.3f}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"   tile {cfg}: error {repr(e)[:150]}", flush=True)
        rows.append({"case": f"prefill {t}", "sdpa_ms": t_ref, "ours_ms": t_inv, "sdpa": how,
                     "ratio": t_ref / t_inv, "ours_tflops": flops / t_inv / 1e9,
                     "sdpa_tflops": flops / t_ref / 1e9})
        print(f"prefill T={t}: SDPA flash ({how}) {t_ref:.3f} ms | ours {t_inv:.3f} ms "
              f"x{t_ref / t_inv:.3f} ({flops / t_inv / 1e9:.0f} TFLOP/s)", flush=True)
    for ctx in (2048, 4096, 8192):
        b = 64
        q = torch.randn(b, HQ, 1, D, device="cuda").bfloat16()
        k = torch.randn(b, HKV, ctx, D, device="cuda").bfloat16()
        v = torch.randn(b, HKV, ctx, D, device="cuda").bfloat16()
        pos = torch.full((b, 1), ctx - 1, device="cuda")
        lens = torch.full((b,), ctx, device="cuda")
        f_ref, how = _sdpa(q, k, v, False)
        t_ref = median_ms(f_ref)
        t_inv = median_ms(lambda: attention_forward(q, k, v, pos, lens, sc))
        gb = 2.0 * b * HKV * ctx * D * 2 / 1e9
        rows.append({"case": f"decode b64 ctx{ctx}", "sdpa_ms": t_ref, "ours_ms": t_inv,
                     "sdpa": how, "ratio": t_ref / t_inv, "ours_TBps": gb / t_inv})
        print(f"decode b=64 ctx={ctx}: SDPA flash ({how}) {t_ref:.3f} ms | ours {t_inv:.3f} ms "
              f"x{t_ref / t_inv:.3f} (KV read {gb / t_inv:.2f} TB/s)", flush=True)
    # fp32 (the model's invariant path) vs SDPA's fp32 memory-efficient kernel, prefill 2k
    t = 2048
    q = torch.randn(1, HQ, t, D, device="cuda")
    k = torch.randn(1, HKV, t, D, device="cuda")
    v = torch.randn(1, HKV, t, D, device="cuda")
    f_ref, how = _sdpa(q, k, v, True, SDPBackend.EFFICIENT_ATTENTION)
    t_ref = median_ms(f_ref)
    t_inv = median_ms(lambda: attention_forward(q, k, v, torch.arange(t, device="cuda")[None],
                                                torch.tensor([t], device="cuda"), sc))
    rows.append({"case": "prefill 2048 fp32", "sdpa_ms": t_ref, "ours_ms": t_inv, "sdpa": how,
                 "ratio": t_ref / t_inv})
    print(f"prefill fp32 T=2048: SDPA efficient ({how}) {t_ref:.3f} ms | ours {t_inv:.3f} ms "
          f"x{t_ref / t_inv:.3f}", flush=True)
    dump(args.out, {"env": env(), "rows": rows})


if __name__ == "__main__":
    main()
