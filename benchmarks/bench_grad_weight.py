"""Weight gradients dW = dYᵀ·X on CUDA: the fused kernel (rlkernel/kernels/triton_grad_weight.py:
leaf partials made and added inside one kernel) vs the reference path it replaces (per-leaf
partials from the `bmm` kernel, written out, then the fixed-point accumulate kernel) vs cuBLAS
(`dy.t() @ x` in the operands' dtype: what native mode's autograd runs), in
one process on the same operands. Both exact paths are checked bytewise equal before timing.

Shapes (tokens, N, K): qwen3-0.6b / 1.7b projections and MLP weights at 4,096 tokens, and the
0.6b MLP at 16,384 tokens; bf16 operands (the bf16 path) and one fp32 row. Ratio = cuBLAS time /
ours (1.0 = as fast as what users run). Also the tiles of the fused kernel (speed only).
Run (repository root, one GPU, < 2 min):
    PYTHONPATH=. python3 benchmarks/bench_grad_weight.py [--out FILE.json] [--quick]
`--carry-sweep`: the persistent mode's carried pass at qwen3-1.7b shapes for several tiles.
Does not: run without CUDA, time the rounding or the cross-rank sums (same for both paths).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import dump, env, median_ms, require_cuda

SHAPES = ((4096, 1024, 1024), (4096, 3072, 1024), (4096, 1024, 3072), (4096, 2048, 2048),
          (4096, 6144, 2048), (16384, 3072, 1024))
TILES = ((64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3), (64, 64, 8, 3), (128, 128, 8, 2))


def _operands(t: int, n: int, k: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(t + n + k)
    scale = torch.exp2(torch.randint(-12, 3, (t, 1), generator=g, device="cuda").float())
    dy = (torch.randn(t, n, generator=g, device="cuda") * scale).to(dtype)
    return dy, torch.randn(t, k, generator=g, device="cuda").to(dtype)


def _row(t: int, n: int, k: int, dtype: torch.dtype, tiles: bool) -> dict:
    from rlkernel.kernels import triton_grad_weight as tgw
    from rlkernel.kernels import triton_matmul as tmm
    from rlkernel.numerics import fixedpoint as fx
    from rlkernel.numerics import triton_fixedpoint as tfx
    from rlkernel.spec import CUDA_TOKEN_LEAF

    dy, x = _operands(t, n, k, dtype)
    acc = fx.zeros((n, k), "cuda")
    leaves = t // CUDA_TOKEN_LEAF   # the fused kernel's leaf
    rows = max(1, (1 << 28) // (leaves * k))        # the reference's 1 GiB partial chunks

    def fused():
        acc.zero_()
        tgw.accumulate_grad_weight_(acc, dy, x)

    def reference():
        acc.zero_()
        for i in range(0, n, rows):
            parts = tmm.token_leaf_partials(dy[:, i:i + rows], x, leaves)
            tfx.accumulate_(acc[i:i + rows].view(-1, fx.N_COLS), parts.view(leaves, -1))

    def cublas():
        torch.matmul(dy.t(), x)

    fused()
    got = acc.clone()
    reference()
    assert torch.equal(got, acc), f"fused != reference at {(t, n, k)}"
    row = {"tokens": t, "n": n, "k": k, "dtype": str(dtype).split(".")[-1],
           "fused_ms": median_ms(fused), "reference_ms": median_ms(reference),
           "cublas_ms": median_ms(cublas)}
    row["ratio_cublas_over_fused"] = row["cublas_ms"] / row["fused_ms"]
    row["speedup_over_reference"] = row["reference_ms"] / row["fused_ms"]
    if tiles:
        row["tiles_ms"] = {str(tl): median_ms(lambda tl=tl: tgw.accumulate_grad_weight_(
            acc.zero_(), dy, x, tile=tl)) for tl in TILES}
    print(row, flush=True)
    return row


LEAF_SHAPES = ((16384, 2048, 2048), (16384, 6144, 2048), (16384, 2048, 6144))


def _leaf_row(t: int, n: int, k: int, leaves: tuple[int, ...]) -> dict:
    """The fused kernel's double-word pass alone (no digits) at other leaf lengths than the
    spec's, against cuBLAS, the digit pass + rounding of the persistent and multi-rank paths,
    and the direct rounding of the double words that one-rank direct mode runs instead
    (round_double_words): what a longer leaf saves (speed study; bits not compared)."""
    from rlkernel.kernels import triton_grad_weight as tgw
    from rlkernel.numerics import fixedpoint as fx
    from rlkernel.numerics import triton_fixedpoint as tfx
    from rlkernel.spec import CUDA_TOKEN_LEAF
    import triton

    dy, x = _operands(t, n, k, torch.bfloat16)
    bn, bk = tgw.TILE[0], tgw.TILE[1]
    n_tiles = triton.cdiv(n, bn) * triton.cdiv(k, bk)
    words = torch.empty(2, n, k, dtype=torch.float64, device="cuda")
    flags = torch.empty(4 * n_tiles, dtype=torch.int32, device="cuda")
    acc = fx.zeros((n, k), "cuda")
    row = {"tokens": t, "n": n, "k": k, "cublas_ms": median_ms(lambda: torch.matmul(dy.t(), x))}

    every = torch.arange(4 * n_tiles, dtype=torch.int32, device="cuda")

    def launch(leaf, tile, retry=False, carry=False):
        # retry=True: every tile in RETRY mode, i.e. every error through the checked lo word
        # (the scheme of the first pass before add_word; the cost of the retry tier).
        # carry=True: the words continue what they hold (the persistent mode's microbatches,
        # carry_grad_weight_deferred's first pass).
        bn_, bk_, warps, stages = tile
        grid = (triton.cdiv(n, bn_) * triton.cdiv(k, bk_),)
        # TMA descriptors (the model's path) at the kernel's own leaf; pointer loads otherwise.
        ad, bd, tma = tgw._descriptors(dy, x, tile, leaf == CUDA_TOKEN_LEAF)
        tgw._dw_kernel[grid](dy, x, ad, bd, words, flags, every, flags, t, n, k,
                             dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
                             words.stride(0), words.stride(1), BLOCK_N=bn_, BLOCK_K=bk_,
                             LEAF=leaf,
                             PREC="tf32", EMIT=False, RETRY=retry, FORCE_FLAG=0,
                             RETRY_ALL=False, TMA=tma, CARRY=carry, COUNTED=False,
                             num_warps=warps,
                             num_stages=stages, enable_fp_fusion=False)

    for leaf in leaves:
        row[f"words_leaf{leaf}_ms"] = median_ms(lambda leaf=leaf: launch(leaf, tgw.TILE))
        row[f"flagged_leaf{leaf}"] = int(flags[:n_tiles].sum())
        words.zero_()    # carried from zeros: the same sums, the carried pass's loads and stores
        row[f"words_carry_leaf{leaf}_ms"] = median_ms(
            lambda leaf=leaf: launch(leaf, tgw.TILE, carry=True))
        row[f"words_checked_leaf{leaf}_ms"] = median_ms(
            lambda leaf=leaf: launch(leaf, tgw.TILE, retry=True))
        row[f"flagged_checked_leaf{leaf}"] = int(flags[:n_tiles].sum())
    if (n, k) == (6144, 2048):
        for leaf in (64, 128):
            for tile in ((128, 64, 8, 3), (64, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)):
                try:
                    row[f"tile{tile}_leaf{leaf}_ms"] = median_ms(
                        lambda leaf=leaf, tile=tile: launch(leaf, tile))
                except Exception as e:   # e.g. out of shared memory / registers
                    row[f"tile{tile}_leaf{leaf}_ms"] = repr(e)[:80]
    row["digits_and_round_ms"] = median_ms(lambda: (
        tfx.add_double_words_(acc.zero_().view(-1, fx.N_COLS), words.view(2, -1)),
        tfx.round_fp32(acc.view(-1, fx.N_COLS))))
    row["round_words_ms"] = median_ms(lambda: tfx.round_double_words(words.view(2, -1)))
    row["cast_words_ms"] = median_ms(lambda: (words[0] + words[1]).float())
    print(row, flush=True)
    return row


# qwen3-1.7b's weights as the dW kernel sees them, per microbatch of 4,096 tokens: (N, K,
# launches) — q, k, v, o, gate, up, down per layer (28 layers), and the tied LM head / embedding.
CARRY_SHAPES = ((2048, 2048, 56), (1024, 2048, 56), (6144, 2048, 56), (2048, 6144, 28),
                (151936, 2048, 1))
CARRY_TILES = ((64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 1), (64, 64, 8, 3), (64, 64, 8, 2),
               (128, 64, 8, 2), (64, 128, 8, 2), (64, 64, 4, 2, 128), (64, 64, 4, 1, 128))


def _carry_sweep(t: int = 4096, tiles=CARRY_TILES) -> dict:
    """`carry_grad_weight_deferred` (first pass + the retry launch over every tile: what the
    persistent sink runs per linear per microbatch) at qwen3-1.7b's dW shapes for each tile of
    `tiles` (default CARRY_TILES): ms per call, ms per microbatch weighted by the launches, the
    words bytewise equal across tiles (the tile is speed only), and cuBLAS's bf16 dW for
    scale."""
    from rlkernel.kernels import triton_grad_weight as tgw
    out = {"tokens": t, "shapes": [], "per_microbatch_ms": {}}
    totals = {str(tl): 0.0 for tl in tiles}
    cublas_total = 0.0
    for n, k, count in CARRY_SHAPES:
        dy, x = _operands(t, n, k, torch.bfloat16)
        words = torch.zeros(2, n, k, dtype=torch.float64, device="cuda")
        row = {"n": n, "k": k, "launches": count,
               "cublas_ms": median_ms(lambda: torch.matmul(dy.t(), x))}
        cublas_total += count * row["cublas_ms"]
        ref = None
        for tl in tiles:
            words.zero_()
            try:
                _, flagged = tgw.carry_grad_weight_deferred(words, dy, x, tile=tl)
            except Exception as e:     # out of shared memory / registers
                row[str(tl)] = repr(e)[:80]
                totals[str(tl)] = float("nan")
                continue
            assert int(flagged) == 0, (n, k, tl)
            if ref is None:
                ref = words.clone()
            assert torch.equal(words, ref), f"tile {tl} changed the words at {(n, k)}"
            ms = median_ms(lambda tl=tl: tgw.carry_grad_weight_deferred(words, dy, x, tile=tl))
            row[str(tl)] = ms
            totals[str(tl)] += count * ms
        del words, ref, dy, x
        torch.cuda.empty_cache()
        print(row, flush=True)
        out["shapes"].append(row)
    out["per_microbatch_ms"] = totals
    out["cublas_per_microbatch_ms"] = cublas_total
    print({"per_microbatch_ms": totals, "cublas": cublas_total}, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="two shapes, no tile sweep")
    ap.add_argument("--leaf-sweep", action="store_true",
                    help="the double-word pass at leaf lengths --leaves (1.7b shapes, 16k tokens)")
    ap.add_argument("--leaves", default="16,32,64,128", help="leaf lengths for --leaf-sweep")
    ap.add_argument("--carry-sweep", action="store_true",
                    help="the persistent carried pass at qwen3-1.7b shapes for CARRY_TILES")
    ap.add_argument("--tiles", help="--carry-sweep's tiles instead of CARRY_TILES: "
                    "BNxBKxWARPSxSTAGES[xMAXNREG],... (the first is the bytes' reference)")
    a = ap.parse_args()
    require_cuda()
    if a.carry_sweep:
        tiles = CARRY_TILES if not a.tiles else tuple(
            tuple(int(v) for v in tl.split("x")) for tl in a.tiles.split(","))
        dump(a.out, {"env": env(), "carry_sweep": _carry_sweep(tiles=tiles)})
        return
    if a.leaf_sweep:
        leaves = tuple(int(v) for v in a.leaves.split(","))
        dump(a.out, {"env": env(), "leaf_rows": [_leaf_row(*s, leaves) for s in LEAF_SHAPES]})
        return
    shapes = SHAPES[:2] if a.quick else SHAPES
    rows = [_row(*s, torch.bfloat16, tiles=(not a.quick and i == 1)) for i, s in enumerate(shapes)]
    rows.append(_row(4096, 1024, 1024, torch.float32, tiles=False))
    dump(a.out, {"env": env(), "rows": rows})


if __name__ == "__main__":
    main()
