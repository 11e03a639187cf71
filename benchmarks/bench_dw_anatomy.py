"""Where the exact dW pass's time goes (issue 11): the double-word kernel of
rlkernel/kernels/triton_grad_weight.py taken apart into variants that keep its loop and tile but
drop or change one part, timed in one process on the same operands:

- `full`: the production kernel (`_double_words`: dot per 128-token leaf, TwoSum into the words);
- `mma`: the same loads and dots, the leaf partials summed in fp32 (no float64 at all);
- `cvt_add`: the dots, each partial converted to float64 and added plainly (no TwoSum);
- `f64_only`: no loads or dots in the loop: a partial made from one fp32 multiply per leaf,
  then the production TwoSum (`add_word`): the float64 work alone;
- `pipelined`: `full` with the next leaf's dot issued before this leaf's float64 adds (whether
  the tensor cores and the float64 units overlap inside one program);
- `tma`: `full` with the operand tiles fetched by TMA descriptors instead of pointer loads.

- `pair32_tma`: `check_tma` with the words in an fp32 pair (h, l): Knuth's TwoSum h + p = s + e,
  then l + e checked exact, and h + l turned into one float64 word (checked exact) after the
  last leaf — fp32 operations only in the loop (no fp32 -> float64 conversion per leaf); exact
  while no partial is below ~2**-24 of the running sum (the float64 word: 2**-29).
- `check`, `check_tma`: the production first pass's exactness test
  (triton_fixedpoint.add_exact_or_nan: s = hi + p is exact iff s − hi == p and s − p == hi;
  an inexact add leaves NaN in hi, which flags its tile — no error word, no int32 flag tile;
  until the thirty-second session this copy kept an int32 flag tile and spilled at 64 × 128);
  `check_f64_only` its float64 work alone; `check_asm_tma`: `check_tma` with that test
  written as one PTX block (the two comparisons joined by `setp`'s `.or`, one 64-bit select:
  Triton's `tl.where(a | b, nan, s)` compiles to two chained selects, four FSEL an element in
  the loop's SASS, which issues ~13 instructions an element and leaf; this one ~11 with the same
  132 registers — compiled on the CPU, thirty-fifth session; not yet timed).

Only the exact variants (`full`, `pipelined`, `tma`, `check`, `check_tma`, `pair32_tma`) compute the
production words (where no add is inexact: the benchmark's operands); they are checked bytewise equal
to `full` before timing (so a faster variant is a candidate, not a different sum). cuBLAS's
`dy.t() @ x` is the scale. Speed only; nothing here is used by the model.
`--leaf 256`: the same variants with 256-token leaf partials (a speed study of a longer leaf;
not the spec's sum).
Run (repository root, one GPU, < 1 min):
    PYTHONPATH=. python3 benchmarks/bench_dw_anatomy.py [--modes full,tma] [--tiles 64x64x4x3]
        [--leaf 256] [--out FILE.json]
Does not: run without CUDA.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.common import dump, env, median_ms, require_cuda
from rlkernel.numerics import triton_fixedpoint as tfx

LEAF = 128
MODES = {"full": 0, "mma": 1, "cvt_add": 2, "f64_only": 3, "pipelined": 4, "tma": 5,
         "check": 6, "check_tma": 7, "check_f64_only": 8, "pair32_tma": 9, "check_asm_tma": 10}
EXACT = ("full", "pipelined", "tma", "check", "check_tma", "pair32_tma", "check_asm_tma")
SHAPES = ((16384, 6144, 2048), (16384, 2048, 2048))
TILES = ((64, 64, 4, 3), (64, 64, 8, 3), (128, 64, 8, 3), (64, 128, 8, 3), (128, 64, 4, 3),
         (128, 128, 8, 2))


@triton.jit
def _pair32_add(h, l, p):
    # (h, l) += p in fp32: TwoSum (exact unless s overflows: then e is NaN), then l + e checked
    # exact as triton_fixedpoint.add_exact_or_nan checks (NaN otherwise, which stays NaN)
    s = h + p
    bp = s - h
    e = (h - (s - bp)) + (p - bp)
    t = l + e
    return s, tl.where(((t - l) != e) | ((t - e) != l), float("nan"), t)


@triton.jit
def _pair32_word(h, l):
    # the float64 word h + l, NaN where that add is inexact (h, l over 53 bits apart) or l NaN
    h64 = h.to(tl.float64)
    l64 = l.to(tl.float64)
    w = h64 + l64
    return tl.where(((w - h64) != l64) | ((w - l64) != h64), float("nan"), w)


@triton.jit
def _add_exact_or_nan_asm(hi, p):
    # triton_fixedpoint.add_exact_or_nan written as one PTX block: the two comparisons joined
    # by setp's own .or and one selp.f64 (Triton's tl.where(a | b, nan, s) became two chained
    # selp.b64: four FSEL an element in SASS; a 32-bit select of the high word alone was tried:
    # one SEL but a register move and 144 registers); the same float64 operations, so the same
    # words and the same flagged tiles
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .f64 s, d1, d2;
        .reg .pred bad;
        add.rn.f64 s, $1, $2;
        sub.rn.f64 d1, s, $1;
        sub.rn.f64 d2, s, $2;
        setp.neu.f64 bad, d1, $2;
        setp.neu.or.f64 bad, d2, $1, bad;
        selp.f64 $0, 0d7FF8000000000000, s, bad;
        }""",
        constraints="=d,d,d", args=[hi, p], dtype=tl.float64, is_pure=True, pack=1)


@triton.jit
def _leaf(a_ptr, b_ptr, ad, bd, t0, n0, k0, n_ok, k_ok, TMA: tl.constexpr):
    if TMA:
        a = ad.load([t0, n0]).T
        b = bd.load([t0, k0])
    else:
        a = tl.load(a_ptr, mask=n_ok[:, None], other=0.0)
        b = tl.load(b_ptr, mask=k_ok[None, :], other=0.0)
    return tl.dot(a, b)


@triton.jit
def _anatomy_kernel(DY, X, AD, BD, OUT, L, N, K, s_dl, s_dn, s_xl, s_xk, s_ow,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
                    LEAF_T: tl.constexpr = 128):
    tile = tl.program_id(0)
    num_k = tl.cdiv(K, BLOCK_K)
    pn = tile // num_k
    pk = tile % num_k
    rn = (pn * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = (pk * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    rt = tl.arange(0, LEAF_T).to(tl.int64)
    n_ok = rn < N
    k_ok = rk < K
    a_ptr = DY + rn[:, None] * s_dn + rt[None, :] * s_dl
    b_ptr = X + rt[:, None] * s_xl + rk[None, :] * s_xk
    a_step = (tl.zeros([], dtype=tl.int64) + s_dl) * LEAF_T
    b_step = (tl.zeros([], dtype=tl.int64) + s_xl) * LEAF_T
    hi = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float64)
    lo = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float64)
    n_inexact = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    n0 = pn * BLOCK_N
    k0 = pk * BLOCK_K
    if MODE == 3 or MODE == 8:
        base = tl.load(X + rn[:, None] * 0 + rk[None, :] * s_xk, mask=k_ok[None, :], other=1.0).to(tl.float32)
        f = base * 0.0 + 1.0
        for _ in range(0, L, LEAF_T):
            f = f * 1.0009765625
            if MODE == 3:
                hi, lo, n_inexact = tfx.add_word(hi, lo, n_inexact, (base * f).to(tl.float64))
            else:
                hi = tfx.add_exact_or_nan(hi, (base * f).to(tl.float64))
    elif MODE == 9:
        h32 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        l32 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for t0 in range(0, L, LEAF_T):
            p = _leaf(a_ptr, b_ptr, AD, BD, t0, n0, k0, n_ok, k_ok, True)
            h32, l32 = _pair32_add(h32, l32, p)
        hi = _pair32_word(h32, l32)
    elif MODE == 4:
        p = _leaf(a_ptr, b_ptr, AD, BD, 0, n0, k0, n_ok, k_ok, False)
        a_ptr += a_step
        b_ptr += b_step
        for t0 in range(LEAF_T, L, LEAF_T):
            q = _leaf(a_ptr, b_ptr, AD, BD, t0, n0, k0, n_ok, k_ok, False)
            a_ptr += a_step
            b_ptr += b_step
            hi, lo, n_inexact = tfx.add_word(hi, lo, n_inexact, p.to(tl.float64))
            p = q
        hi, lo, n_inexact = tfx.add_word(hi, lo, n_inexact, p.to(tl.float64))
    else:
        for t0 in range(0, L, LEAF_T):
            p = _leaf(a_ptr, b_ptr, AD, BD, t0, n0, k0, n_ok, k_ok,
                      (MODE == 5) | (MODE == 7) | (MODE == 10))
            a_ptr += a_step
            b_ptr += b_step
            if MODE == 1:
                acc += p
            elif MODE == 2:
                hi += p.to(tl.float64)
            elif MODE == 6 or MODE == 7:
                hi = tfx.add_exact_or_nan(hi, p.to(tl.float64))
            elif MODE == 10:
                hi = _add_exact_or_nan_asm(hi, p.to(tl.float64))
            else:
                hi, lo, n_inexact = tfx.add_word(hi, lo, n_inexact, p.to(tl.float64))
    o = OUT + rn[:, None] * K + rk[None, :]
    m = n_ok[:, None] & k_ok[None, :]
    if MODE == 1:
        tl.store(o, acc.to(tl.float64), mask=m)
    else:
        if MODE >= 6 and MODE != 9:     # the production first pass's flag
            good = tl.max((tfx.word_in_range(hi) == 0).to(tl.int32)) == 0
        else:
            good = tl.max((tfx.words_exact(hi, n_inexact) == 0).to(tl.int32)) == 0
        tl.store(o, tl.where(good, hi, 0.0), mask=m)
        tl.store(o + s_ow, tl.where(good, lo, 0.0), mask=m)


def _alloc(size: int, align: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def run_variant(mode: str, dy: torch.Tensor, x: torch.Tensor, tile, leaf: int = LEAF
                ) -> torch.Tensor:
    """The words [2, N, K] float64 of one variant (only full/pipelined/tma are the sum), with
    leaf partials of `leaf` tokens (LEAF, the spec's, or another for a speed study)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    bn, bk, warps, stages = tile
    n, k = dy.shape[1], x.shape[1]
    out = torch.empty(2, n, k, dtype=torch.float64, device="cuda")
    ad = TensorDescriptor.from_tensor(dy, [leaf, bn])
    bd = TensorDescriptor.from_tensor(x, [leaf, bk])
    grid = (triton.cdiv(n, bn) * triton.cdiv(k, bk),)
    _anatomy_kernel[grid](dy, x, ad, bd, out, dy.shape[0], n, k, dy.stride(0), dy.stride(1),
                          x.stride(0), x.stride(1), out.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                          MODE=MODES[mode], LEAF_T=leaf, num_warps=warps,
                          num_stages=stages, enable_fp_fusion=False)
    return out


def _operands(t: int, n: int, k: int):
    g = torch.Generator(device="cuda").manual_seed(t + n + k)
    dy = torch.randn(t, n, generator=g, device="cuda").to(torch.bfloat16)
    return dy, torch.randn(t, k, generator=g, device="cuda").to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated variants")
    ap.add_argument("--tiles", default=",".join("x".join(map(str, t)) for t in TILES),
                    help="comma-separated BLOCK_NxBLOCK_KxWARPSxSTAGES")
    ap.add_argument("--leaf", type=int, default=LEAF,
                    help="tokens per leaf partial (128, the spec's; e.g. 256 for a speed study: "
                         "then the exact variants are compared with `check_tma` at that leaf)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.leaf not in (16, 32, 64, 128, 256):
        ap.error(f"--leaf {args.leaf}: one of 16, 32, 64, 128, 256")
    modes = args.modes.split(",")
    try:
        tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    except ValueError:
        ap.error(f"--tiles {args.tiles!r}: expected e.g. 64x64x4x3,128x64x8x3")
    if any(len(t) != 4 for t in tiles):
        ap.error(f"--tiles {args.tiles!r}: four numbers per tile (BLOCK_N, BLOCK_K, warps, stages)")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; allowed: {', '.join(MODES)}")
    require_cuda()
    triton.set_allocator(_alloc)
    from rlkernel.kernels import triton_grad_weight as tgw
    rows = []
    for t, n, k in SHAPES:
        dy, x = _operands(t, n, k)
        ref = (tgw._double_words(dy, x, tgw.TILE, False)[0] if args.leaf == LEAF else
               run_variant("check_tma", dy, x, tgw.TILE, args.leaf))
        cublas = median_ms(lambda: dy.t() @ x)
        for tile in tiles:
            row = {"tokens": t, "n": n, "k": k, "tile": list(tile), "leaf": args.leaf,
                   "cublas_ms": cublas}
            for mode in modes:
                try:
                    out = run_variant(mode, dy, x, tile, args.leaf)
                    if mode in EXACT:
                        row[f"{mode}_same_bytes"] = bool(torch.equal(
                            out.view(torch.int64), ref.view(torch.int64)))
                    row[f"{mode}_ms"] = median_ms(
                        lambda m=mode: run_variant(m, dy, x, tile, args.leaf))
                except Exception as exc:  # a tile a variant cannot compile is a row entry
                    row[f"{mode}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(row, flush=True)
            rows.append(row)
    dump(args.out, {"env": env(), "rows": rows})


if __name__ == "__main__":
    main()
