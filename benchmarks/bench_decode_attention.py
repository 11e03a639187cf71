"""Paged decode attention (the rollout's decode step) against stock SDPA, and its tile table.

What: for qwen3-0.6b heads (16 query / 8 KV heads, head_dim 128, bf16) and one query per sample
(tq = 1) at shapes of the serving benchmark, the time of kernels/triton_attention's paged
forward with the table's tile and with each tile of TILES (and whether its output bytes equal
the table's), and of SDPA (flash, GQA) on the same keys gathered into a dense [S, Hkv, T, D]
tensor beforehand (outside the timing: a lower bound for any paged kernel). Median times
(benchmarks/common.median_ms); KV blocks are a random permutation of the pool.
Run (repository root, GPU machine):
    PYTHONPATH=. python3 benchmarks/bench_decode_attention.py [--out decode_attn.json]
Does not: time prefill (benchmarks/bench_attention.py) or check values against a reference
(tests/test_cuda.py does, and the tile table's bytes).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import dump, env, median_ms, require_cuda
from rlkernel.kernels import triton_attention as ta

SHAPES = ((256, 32), (256, 1024), (128, 2048), (16, 1024))
"""(samples, keys per sample)."""
TILES = ((16, 1, 1), (16, 2, 1), (16, 2, 2), (16, 4, 1), (16, 4, 2), (16, 4, 3), (16, 8, 2),
         (32, 4, 2), (32, 4, 3), (32, 8, 3), (64, 4, 2))
HQ, HKV, D = 16, 8, 128


def _shape(s: int, ctx: int) -> dict:
    dev, blk = "cuda", ta.KV_BLOCK
    nb = -(-ctx // blk)
    pool = s * nb + 1
    kp = torch.randn(pool, blk, HKV, D, device=dev, dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    table = torch.randperm(pool - 1, device=dev)[:s * nb].view(s, nb)
    q = torch.randn(s, HQ, 1, D, device=dev, dtype=torch.bfloat16)
    qpos = torch.full((s, 1), ctx - 1, device=dev, dtype=torch.long)
    kvl = torch.full((s,), ctx, device=dev, dtype=torch.long)
    scale = D ** -0.5

    def paged(tile=None):
        return ta.paged_attention_forward(q, kp, vp, table, qpos, kvl, scale, tile=tile)[0]

    base = paged().view(torch.int16)
    row = {"samples": s, "keys": ctx, "kv_gb": s * ctx * HKV * D * 2 * 2 / 1e9,
           "table_ms": median_ms(paged), "tiles": {}}
    for tile in TILES:
        row["tiles"][str(tile)] = {"ms": median_ms(lambda: paged(tile)),
                                   "same_bytes": bool(torch.equal(paged(tile).view(torch.int16),
                                                                  base))}
    k = kp[table].flatten(1, 2).transpose(1, 2).contiguous()
    v = vp[table].flatten(1, 2).transpose(1, 2).contiguous()
    row["sdpa_dense_ms"] = median_ms(
        lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=scale))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    require_cuda()
    rows = []
    for s, ctx in SHAPES:
        rows.append(_shape(s, ctx))
        r = rows[-1]
        best = min(r["tiles"].items(), key=lambda kv: kv[1]["ms"])
        print(f"{s} x {ctx}: table {r['table_ms']:.3f} ms, best tile {best[0]} "
              f"{best[1]['ms']:.3f} ms, SDPA dense {r['sdpa_dense_ms']:.3f} ms; all tiles same "
              f"bytes: {all(t['same_bytes'] for t in r['tiles'].values())}", flush=True)
    dump(args.out, {"env": env(), "rows": rows})


if __name__ == "__main__":
    main()
