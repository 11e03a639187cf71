"""The fused LM head + log-softmax statistics kernel (kernels/triton_logprobs.py
`linear_shard_stats`) at the training step's shape, per tile, against cuBLAS's bf16 h @ wᵀ alone.

qwen3-1.7b's head: 16,384 tokens × hidden 2048 × vocab 151,936 (8 vocab shards of 18,992),
bf16 operands. Each tile's four outputs are compared bytewise with the table tile's
(LINEAR_STATS_TILES) before it is timed: a tile is speed only. cuBLAS forms the logits and nothing
else (no statistics), so its time is a floor, not a like-for-like arm.
Run (repository root, CUDA machine): PYTHONPATH=. python3 benchmarks/bench_lm_head_stats.py
    [--tokens N] [--out FILE.json]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import dump, env, median_ms, require_cuda

TILES = ((64, 8, 2), (64, 8, 3), (64, 4, 3), (128, 8, 2), (128, 8, 3), (128, 4, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out")
    a = ap.parse_args()
    require_cuda()
    from rlkernel.kernels import triton_logprobs as tlp
    from rlkernel.spec import VIRTUAL_TP
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, generator=g, device="cuda").bfloat16()
    w = (torch.randn(a.vocab, a.hidden, generator=g, device="cuda") * 0.02).bfloat16()
    tg = torch.randint(0, a.vocab, (a.tokens,), generator=g, device="cuda")

    def run(tile):
        return tlp.linear_shard_stats(h, w, tg, 1.0, VIRTUAL_TP, tile=tile)

    ref = run(tlp.LINEAR_STATS_TILES[torch.bfloat16])
    rows = [{"case": "cublas h @ w.t() bf16 (logits only)",
             "ms": median_ms(lambda: torch.matmul(h, w.t()))}]
    for tile in TILES:
        try:
            got = run(tile)
            same = all(torch.equal(x.view(torch.int32), y.view(torch.int32))
                       for x, y in zip(got, ref))
            ms = median_ms(lambda tile=tile: run(tile))
        except Exception as e:  # noqa: BLE001  (a tile that does not compile or fit)
            rows.append({"tile": tile, "error": repr(e)[:200]})
            continue
        rows.append({"tile": tile, "ms": ms, "same_bytes": same})
        print(rows[-1], flush=True)
    dump(a.out, {"env": env(), "tokens": a.tokens, "hidden": a.hidden, "vocab": a.vocab,
                 "rows": rows})


if __name__ == "__main__":
    main()
