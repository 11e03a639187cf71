"""The linears' virtual-TP shard tree on CUDA: fused into one kernel (rlkernel/kernels/
triton_shard_matmul.py) vs the unfused path it replaces (`bmm` partials per shard and
projection, written out, then torch adds and the one-pass shard sum) vs cuBLAS (what native
mode runs: one bf16 matmul, no tree), in one process on the same operands. The fused and unfused
outputs are checked bytewise equal before timing; other tiles of the fused kernel are timed
(and byte-checked) too, and the nested-loop kernel (one pipelined loop per K range, flat=False)
that the flat one replaced.

Shapes: qwen3-1.7b at 16,384 tokens (the issue's training batch), TP1 (8 local shards):
o_proj forward (K 2048 -> N 2048), down_proj forward (6144 -> 2048), the q/k/v dX (three
projections of 2048/1024/1024 rows -> 2048) and the gate/up dX (two of 6144 -> 2048).
Ratio = cuBLAS time / fused (1.0 = as fast as what users run).
Run (repository root, one GPU, < 2 min):
    PYTHONPATH=. python3 benchmarks/bench_shard_matmul.py [--out FILE.json] [--tokens N]
Does not: run without CUDA, time the TP all-reduce (the same for both paths).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import dump, env, median_ms, require_cuda

TILES = ((128, 64, 8, 3, 8), (64, 64, 4, 3, 8), (128, 128, 8, 3, 8), (64, 128, 4, 3, 8),
         (128, 64, 4, 4, 8))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _time_fused(name, fused, tile_fused, unfused, cublas, want, nested) -> dict:
    assert _same(nested(), want), f"nested kernel != unfused, {name}"
    row = {"case": name, "fused_ms": median_ms(fused), "unfused_ms": median_ms(unfused),
           "cublas_ms": median_ms(cublas), "nested_kernel_ms": median_ms(nested)}
    row["ratio_cublas_over_fused"] = row["cublas_ms"] / row["fused_ms"]
    row["speedup_over_unfused"] = row["unfused_ms"] / row["fused_ms"]
    tiles = {}
    for tile in TILES:
        try:
            same = _same(tile_fused(tile), want)
            tiles[str(tile)] = {"ms": median_ms(lambda tile=tile: tile_fused(tile)), "same": same}
        except Exception as e:   # e.g. out of shared memory / registers
            tiles[str(tile)] = repr(e)[:100]
    row["tiles"] = tiles
    print(row, flush=True)
    return row


def _row_parallel(t: int, k: int, n: int) -> dict:
    from rlkernel.kernels import matmul as mm
    from rlkernel.kernels import triton_matmul as tm
    from rlkernel.kernels import triton_shard_matmul as tsm
    g = torch.Generator(device="cuda").manual_seed(t + k + n)
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    ks = k // 8
    bounds = [[(s * ks, (s + 1) * ks)] for s in range(8)]
    want = mm.shard_sum(tm.row_parallel_partials(x, w, 8))
    got = tsm.row_parallel_nt(x, w, 8)
    assert _same(got, want), f"fused != unfused, row-parallel {(t, k, n)}"
    return _time_fused(f"row-parallel fwd {t}x{k} -> {n}", lambda: tsm.row_parallel_nt(x, w, 8),
                       lambda tile: tsm.shard_tree_matmul(x, w, bounds, b_kmajor=True,
                                                          tile=tile),
                       lambda: mm.shard_sum(tm.row_parallel_partials(x, w, 8)),
                       lambda: torch.matmul(x, w.t()), want,
                       lambda: tsm.shard_tree_matmul(x, w, bounds, b_kmajor=True, flat=False))


def _column_dx(t: int, rows: tuple[int, ...], k: int) -> dict:
    from rlkernel.kernels import triton_shard_matmul as tsm
    from rlkernel.kernels.matmul import column_dx_by_shards, virtual_shard_rows
    g = torch.Generator(device="cuda").manual_seed(t + sum(rows) + k)
    dys = [torch.randn(t, n, device="cuda", generator=g).bfloat16() for n in rows]
    ws = [(torch.randn(n, k, device="cuda", generator=g) / n ** 0.5).bfloat16() for n in rows]
    sr = [virtual_shard_rows(n) for n in rows]
    want = column_dx_by_shards(dys, ws, sr)
    assert _same(tsm.column_dx(dys, ws, sr), want), f"fused != unfused, column dX {rows}"
    dy_cat, w_cat = torch.cat(dys, 1), torch.cat(ws, 0)
    return _time_fused(f"column dX {t}x{rows} -> {k}", lambda: tsm.column_dx(dys, ws, sr),
                       lambda tile: tsm.column_dx(dys, ws, sr, tile=tile),
                       lambda: column_dx_by_shards(dys, ws, sr),
                       lambda: torch.matmul(dy_cat, w_cat), want,
                       lambda: tsm.column_dx(dys, ws, sr, flat=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--tokens", type=int, default=16384)
    a = ap.parse_args()
    require_cuda()
    t = a.tokens
    rows = []
    for fn, args in ((_row_parallel, (t, 2048, 2048)), (_row_parallel, (t, 6144, 2048)),
                     (_column_dx, (t, (2048, 1024, 1024), 2048)),
                     (_column_dx, (t, (6144, 6144), 2048))):
        rows.append(fn(*args))
        dump(a.out, {"env": env(), "rows": rows})


if __name__ == "__main__":
    main()
