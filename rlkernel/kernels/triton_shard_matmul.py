"""The virtual-TP shard tree of a linear fused into one matmul kernel (CUDA, Triton): the
row-parallel forward y = x·wᵀ and the column-parallel dX = Σ_i dY_i·W_i (DESIGN.md §1,
"fuse trees into kernels rather than materialising partials").

What it computes: exactly what kernels/matmul.py computes through `_bmm_kernel` partials and
torch adds — for each of the S local virtual shards (S in 1, 2, 4, 8), each projection's
partial is one sequential-K accumulator over the shard's K range [k0, k1) in BLOCK_K chunks
from k0 (zero-padded tail), the projections' partials of a shard are added in projection order
(p0 + p1, then + p2), and the S shard values are summed by the complete pairwise tree
(numerics/trees.tree_sum: (0+1), (2+3), …). Every step is the same fp32 operation on the same
two values, so the bytes are those of the unfused path (tests/test_cuda_shard_matmul.py; under
the interpreter tests/shard_matmul_triton_checks.py), and TP rank r's local subtree is still an
aligned subtree of the canonical tree.

Why: the unfused path writes S fp32 [M, N] partials per projection and reads them back for the
adds — at qwen3-1.7b, 16k tokens, 8 shards × 3 projections of [16k, 2048] fp32 for one q/k/v dX
(3 GiB of traffic for 0.3 TFLOP of tensor-core work); here each output tile's tree lives in
registers and the output is written once.

How: one program per output tile walks the shards in order; a pairwise-summation stack (a
binary counter on the shard index: a finished node of level j waits in slot j until its right
sibling is done) keeps at most log2(S) finished subtrees live. The projections of a column dX
are one concatenated operand pair (dY_cat [M, ΣN_i], W_cat [ΣN_i, K]) with a K range per
(shard, projection), so the body is one loop whatever P is. An unrolled tree (one inlined chain
per shard and projection) was tried first: ptxas gave it 255 registers and KiBs of spills at 8
shards, the scheduler hoisting every chain's bounds and setup. 16-bit operands whose K ranges
fall on BLOCK_K multiples are fetched by TMA descriptors (no per-element address registers);
the rest by masked pointer loads. The chunks are the same either way (TMA's zero fill past M
and N is the masks' zeros).

Does not: handle a shard with an empty K range (the unfused path skips those leaves, which an
add of zeros would not match for −0.0; `fusable` refuses them and kernels/matmul.py keeps its
path), run on CPU, or communicate (the TP tree all-reduce finishes the local subtree).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import triton
import triton.language as tl

from rlkernel.kernels.triton_matmul import BLOCK_K, operand_dtype
from rlkernel.kernels.triton_util import cast, check_cuda, device_ctx, launch

MAX_PROJECTIONS = 3
SHARD_COUNTS = (1, 2, 4, 8)

# (dtype) -> (BLOCK_M, BLOCK_N, num_warps, num_stages, GROUP_M): speed only (the chains do not
# depend on the tile, tests/test_cuda_shard_matmul.py).
TILES = {
    torch.bfloat16: (64, 64, 4, 3, 8),
    torch.float16: (64, 64, 4, 3, 8),
    torch.float32: (64, 64, 4, 2, 8),
}
FLAT_MAX_CHUNKS = 8
"""Chunks (of BLOCK_K) per shard up to which the model's linears take the flat kernel
(`worth_fusing(long_shards=False)` for the row-parallel forward, `column_dx`'s kernel choice). Longer shards are where it loses (H200, 16k tokens, docs/BENCHMARKS.md): down_proj's
8 × 768 forward ran 1.55 ms fused against 1.17 ms for the unfused `bmm` partials + one-pass
sum, gate/up's dX 3.40 ms flat against 2.37 ms for the nested kernel at LONG_TILE — the
128×64 or 64×64 tiles that keep five accumulators in registers cost more than the partials'
traffic saves once a shard's chain is long. The choice changes speed only."""
LONG_TILE = (128, 128, 8, 3, 8)
"""The nested kernel's tile for a column dX with long shards (ptxas spills a little; measured
fastest)."""
POINTER_TILES = {   # 16-bit operands without TMA: narrower (address registers; ptxas: no spill)
    torch.bfloat16: (128, 32, 8, 3, 8),
    torch.float16: (128, 32, 8, 3, 8),
    torch.float32: (64, 64, 4, 2, 8),
}


@triton.jit
def _chain(A, B, lda, ldb, k0, k1, m0, n0, M, N, TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           PREC: tl.constexpr):
    # One sequential-K accumulator over K rows [k0, k1): A[m, k] (row-major, lda), B[k, n] at
    # B + n·ldb + k (B_KMAJOR) or B + k·ldb + n; with TMA, A and B are descriptors.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        for kc in range(k0, k1, BLOCK_K):
            x = A.load([m0, kc])
            if B_KMAJOR:
                acc = tl.dot(x, B.load([n0, kc]).T, acc)
            else:
                acc = tl.dot(x, B.load([kc, n0]), acc)
    else:
        rm = m0 + tl.arange(0, BLOCK_M)
        rn = n0 + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm[:, None] < M
        n_ok = rn[None, :] < N
        a_rows = A + rm.to(tl.int64)[:, None] * lda
        for kc in range(k0, k1, BLOCK_K):
            kk = kc + rk
            k_ok = kk < k1
            kl = kk.to(tl.int64)
            x = tl.load(a_rows + kl[None, :], mask=m_ok & k_ok[None, :], other=0.0)
            if B_KMAJOR:
                y = tl.load(B + rn.to(tl.int64)[None, :] * ldb + kl[:, None],
                            mask=k_ok[:, None] & n_ok, other=0.0)
            else:
                y = tl.load(B + kl[:, None] * ldb + rn.to(tl.int64)[None, :],
                            mask=k_ok[:, None] & n_ok, other=0.0)
            acc = tl.dot(x, y, acc, input_precision=PREC)
    return acc


@triton.jit
def _tile_origin(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped launch order (L2 reuse), as _bmm_kernel: it decides only which tile a program owns.
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    m0 = (first_m + (pid % per_group) % group_m) * BLOCK_M
    return m0, ((pid % per_group) // group_m) * BLOCK_N


@triton.jit
def _fold(s, v, lvl0, lvl1, lvl2):
    # Pairwise stack: shard s (value v) closes the subtrees whose right edge it is (s odd: a
    # pair; s % 4 == 3: a quad; s % 8 == 7: the eight); left operand = the earlier subtree.
    # Returns the node just finished and the slots of the left nodes still waiting.
    if s % 2 == 1:
        v = lvl0 + v
        if s % 4 == 3:
            v = lvl1 + v
            if s % 8 == 7:
                v = lvl2 + v
            else:
                lvl2 = v
        else:
            lvl1 = v
    else:
        lvl0 = v
    return v, lvl0, lvl1, lvl2


@triton.jit
def _store(Y, v, m0, n0, M, N, ldy, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    y = Y + rm.to(tl.int64)[:, None] * ldy + rn.to(tl.int64)[None, :]
    tl.store(y, v, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _shard_tree_kernel(Y, BOUNDS, A, B, lda, ldb, M, N, ldy, S, P,
                       TMA: tl.constexpr, B_KMAJOR: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       PREC: tl.constexpr):
    m0, n0 = _tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    v = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    lvl0 = v
    lvl1 = v
    lvl2 = v
    for s in range(0, S):
        row = BOUNDS + s * (2 * P)
        v = _chain(A, B, lda, ldb, tl.load(row), tl.load(row + 1), m0, n0, M, N, TMA, B_KMAJOR,
                   BLOCK_M, BLOCK_N, BLOCK_K, PREC)
        for i in range(1, P):   # the shard's other projections, added in order
            v = v + _chain(A, B, lda, ldb, tl.load(row + 2 * i), tl.load(row + 2 * i + 1), m0,
                           n0, M, N, TMA, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K, PREC)
        v, lvl0, lvl1, lvl2 = _fold(s, v, lvl0, lvl1, lvl2)
    _store(Y, v, m0, n0, M, N, ldy, BLOCK_M, BLOCK_N)


@triton.jit
def _shard_tree_flat_kernel(Y, A, B, M, N, ldy, n_chunks, LP, E0, E1,
                            B_KMAJOR: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr):
    # The K ranges laid end to end (shard by shard, projections in order), every range whole
    # BLOCK_K chunks and every shard the same LP chunks with its projections ending at chunks
    # E0 <= E1 <= LP of the period: ONE loop over all chunks, so the TMA pipeline never drains
    # between ranges (the per-range loops of _shard_tree_kernel restart it 8-24 times per tile,
    # with ranges as short as 2 chunks). At a range's last chunk its accumulator is folded into
    # the shard's partial (the first range: taken as is), at a shard's last into the stack.
    m0, n0 = _tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = zero
    v = zero
    lvl0 = zero
    lvl1 = zero
    lvl2 = zero
    for c in range(0, n_chunks):
        x = A.load([m0, c * BLOCK_K])
        if B_KMAJOR:
            acc = tl.dot(x, B.load([n0, c * BLOCK_K]).T, acc)
        else:
            acc = tl.dot(x, B.load([c * BLOCK_K, n0]), acc)
        r = c % LP + 1                      # chunks of the current shard done
        if (r == E0) | (r == E1) | (r == LP):
            if r == E0:
                v = acc
            else:
                v = v + acc
            acc = zero
            if r == LP:
                v, lvl0, lvl1, lvl2 = _fold(c // LP, v, lvl0, lvl1, lvl2)
    _store(Y, v, m0, n0, M, N, ldy, BLOCK_M, BLOCK_N)


def _period(shard_bounds, block_k: int) -> tuple[int, list[int]] | None:
    """(chunks per shard, the chunk at which each range ends within its shard) when the ranges
    laid end to end fit `_shard_tree_flat_kernel`: every range whole BLOCK_K chunks, and range i
    the same length in every shard; else None."""
    lens = [b - a for a, b in shard_bounds[0]]
    if any([b - a for a, b in sb] != lens for sb in shard_bounds) or any(n % block_k for n in lens):
        return None
    ends, at = [], 0
    for n in lens:
        at += n // block_k
        ends.append(at)
    return at, ends


def _tma_aligned(t: torch.Tensor) -> bool:
    """A 2-D operand TMA can describe: unit inner stride, 16-byte aligned rows and base."""
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 \
        and t.data_ptr() % 16 == 0


def _end_to_end(a_pieces, b_pieces, b_kmajor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The K ranges' pieces of A [M, k] and B laid end to end (one copy each), in the order
    given: the flat kernel's operand layout."""
    return torch.cat(a_pieces, 1), torch.cat(b_pieces, 1 if b_kmajor else 0)


def _flat(a: torch.Tensor, b: torch.Tensor, period: tuple[int, list[int]], shards: int,
          b_kmajor: bool, tile) -> torch.Tensor | None:
    """Y of `_shard_tree_flat_kernel` for 16-bit a [M, K], b whose K ranges already lie end to
    end from K = 0 (period = `_period` of them, `shards` periods); None where TMA cannot take
    the operands (16-byte aligned rows and bases)."""
    if not (_tma_aligned(a) and _tma_aligned(b)):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor
    lp, ends = period
    e0, e1 = (ends + [lp, lp])[:2]
    bk = BLOCK_K[a.dtype]
    m = a.shape[0]
    n = b.shape[0] if b_kmajor else b.shape[1]
    bm, bn, warps, stages, group_m = tile or TILES[a.dtype]
    y = torch.empty(m, n, dtype=torch.float32, device=a.device)
    ad = TensorDescriptor.from_tensor(a, [bm, bk])
    bd = TensorDescriptor.from_tensor(b, [bn, bk] if b_kmajor else [bk, bn])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    with device_ctx(a):
        launch(_shard_tree_flat_kernel, grid,
               y, ad, bd, m, n, y.stride(0), lp * shards, lp, e0, e1, B_KMAJOR=b_kmajor, BLOCK_M=bm,
               BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages)
    return y


def _flat_period(dtype: torch.dtype, shard_bounds) -> tuple[int, list[int]] | None:
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    return _period(shard_bounds, BLOCK_K[dtype])


def worth_fusing(dtype: torch.dtype, shard_bounds, *, long_shards: bool = True) -> bool:
    """Whether kernels/matmul.py should call `row_parallel_nt` / `column_dx` for operands of
    `dtype` with these [S][P] K ranges: `fusable`, 16-bit, and every range whole BLOCK_K chunks
    of one length per projection (a TMA path exists: the flat kernel, the nested one at
    LONG_TILE, or the unfused partials for long row-parallel shards). Ragged shards — a
    vocab shard of 18,992 rows, k/v shards of a few rows — would take the pointer kernel, which
    ran the LM head's dX far slower than the per-shard `bmm` loop it replaces; fp32 keeps that
    loop too. `long_shards=False` (the row-parallel forward) also refuses shards longer than
    FLAT_MAX_CHUNKS, where the unfused partials are faster. Speed only: every path gives the
    same bytes."""
    if not fusable(shard_bounds):
        return False
    period = _flat_period(dtype, shard_bounds)
    return period is not None and (long_shards or period[0] <= FLAT_MAX_CHUNKS)


def fusable(shard_bounds: Sequence[Sequence[tuple[int, int]]]) -> bool:
    """Whether `shard_tree_matmul` takes these bounds ([S][P] K ranges): S in SHARD_COUNTS,
    1 to MAX_PROJECTIONS ranges per shard, every range non-empty (the unfused path skips empty
    ones)."""
    return (len(shard_bounds) in SHARD_COUNTS
            and 1 <= len(shard_bounds[0]) <= MAX_PROJECTIONS
            and all(len(sb) == len(shard_bounds[0]) and all(b > a for a, b in sb)
                    for sb in shard_bounds))


@functools.lru_cache(maxsize=256)
def _bounds_table(flat: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    # int32 [S·P·2] on the device, made once per layer shape (a host copy per call would cost
    # more than some of the launches it feeds).
    return torch.tensor([k for rng in flat for k in rng], dtype=torch.int32, device=device)


def _tma_ok(a: torch.Tensor, b: torch.Tensor, shard_bounds, block_k: int) -> bool:
    """Whether TMA fetches give these operands the pointer loads' chunks: 16-bit, every K range
    cut at multiples of BLOCK_K (no ragged tail for TMA to fill from the next range), unit inner
    strides, 16-byte aligned rows and bases."""
    if a.dtype not in (torch.bfloat16, torch.float16):
        return False
    if any(k0 % block_k or k1 % block_k for sb in shard_bounds for k0, k1 in sb):
        return False
    return _tma_aligned(a) and _tma_aligned(b)


def shard_tree_matmul(a: torch.Tensor, b: torch.Tensor,
                      shard_bounds: Sequence[Sequence[tuple[int, int]]], *, b_kmajor: bool,
                      tile: tuple[int, int, int, int, int] | None = None,
                      use_tma: bool | None = None, flat: bool = True) -> torch.Tensor:
    """Y [M, N] fp32 = tree over shards s of (Σ_i in order of A[:, k0:k1] · B[k0:k1, :]),
    (k0, k1) = shard_bounds[s][i] (module doc: the unfused path's bytes).

    a [M, K]; b [N, K] (B[k, n] = b[n, k]: a linear's weight) when b_kmajor, else b [K, N];
    one 16-bit dtype or fp32 (taken in `operand_dtype`), one CUDA device. `tile` overrides
    TILES / POINTER_TILES, `use_tma` the choice of TMA fetches (default: where `_tma_ok`;
    False: pointer loads only) and `flat=False` turns off the one-loop TMA kernel (default:
    where `_period` allows it); none changes a bit (tests). Raises ValueError when the bounds
    are not `fusable` or out of range, or the shapes disagree.
    """
    if not fusable(shard_bounds):
        raise ValueError(f"shard tree matmul: bounds {shard_bounds}; need S in {SHARD_COUNTS} "
                         f"shards of 1 to {MAX_PROJECTIONS} non-empty K ranges each")
    check_cuda("shard tree matmul", a, b)
    dt = operand_dtype(a, b)
    a = cast(a, dt)
    b = cast(b, dt)
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    kb, n = (b.shape[1], b.shape[0]) if b_kmajor else (b.shape[0], b.shape[1])
    m, k = a.shape
    if a.dim() != 2 or b.dim() != 2 or kb != k \
            or any(not 0 <= k0 < k1 <= k for sb in shard_bounds for k0, k1 in sb):
        raise ValueError(f"shard tree matmul: A {tuple(a.shape)}, B {tuple(b.shape)} "
                         f"(b_kmajor={b_kmajor}) do not share K, or bounds {shard_bounds} leave "
                         f"[0, {k})")
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=torch.float32, device=a.device)
    period = _flat_period(a.dtype, shard_bounds) if flat and use_tma is not False else None
    if period is not None:
        order = [rng for sb in shard_bounds for rng in sb]
        if order[0][0] != 0 or any(x[1] != y[0] for x, y in zip(order, order[1:])):
            # lay the ranges end to end (the column dX gathers its own: column_dx)
            a, b = _end_to_end([a[:, k0:k1] for k0, k1 in order],
                               [b[:, k0:k1] if b_kmajor else b[k0:k1] for k0, k1 in order],
                               b_kmajor)
        y = _flat(a, b, period, len(shard_bounds), b_kmajor, tile)
        if y is not None:
            return y
    y = torch.empty(m, n, dtype=torch.float32, device=a.device)
    s, p = len(shard_bounds), len(shard_bounds[0])
    bounds = _bounds_table(tuple(tuple(rng) for sb in shard_bounds for rng in sb), a.device)
    bk = BLOCK_K[dt]
    tma = _tma_ok(a, b, shard_bounds, bk) if use_tma is None else use_tma
    bm, bn, warps, stages, group_m = tile or (TILES if tma else POINTER_TILES)[dt]
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        aa = TensorDescriptor.from_tensor(a, [bm, bk])
        bb = TensorDescriptor.from_tensor(b, [bn, bk] if b_kmajor else [bk, bn])
    else:
        aa, bb = a, b
    prec = "ieee" if dt == torch.float32 else "tf32"   # "tf32" is ignored for 16-bit dots
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    with device_ctx(a):
        launch(_shard_tree_kernel, grid,
               y, bounds, aa, bb, a.stride(0), b.stride(0), m, n, y.stride(0), s, p, TMA=tma,
               B_KMAJOR=b_kmajor, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, PREC=prec,
               num_warps=warps, num_stages=stages)
    return y


def row_parallel_nt(x: torch.Tensor, w: torch.Tensor, shards: int) -> torch.Tensor:
    """The local subtree of x [M, K] @ w [N, K]ᵀ over `shards` equal K shards -> [M, N] fp32:
    the bytes of shard_sum(row_parallel_partials(x, w, shards)), fused (kernels/matmul.py keeps
    the unfused partials where `worth_fusing(long_shards=False)` says no). ValueError unless
    K % shards == 0 with K >= shards and shards in SHARD_COUNTS."""
    k = x.shape[-1]
    if shards not in SHARD_COUNTS or k % shards or k < shards:
        raise ValueError(f"row-parallel linear: K={k} in {shards} shards; need shards in "
                         f"{SHARD_COUNTS} dividing K")
    ks = k // shards
    return shard_tree_matmul(x, w, [[(s * ks, (s + 1) * ks)] for s in range(shards)],
                             b_kmajor=True)


def column_dx(dys: Sequence[torch.Tensor], ws: Sequence[torch.Tensor],
              shard_rows: Sequence[Sequence[tuple[int, int]]], **kw) -> torch.Tensor:
    """dX [M, K] fp32 = the local subtree over shards of the projections' dY_i[:, rows]·W_i[rows]
    (shard_rows[i][s] = rows of W_i in local shard s; kernels/matmul.py's column backward gives
    the same bytes). dys [M, N_i], ws [N_i, K] (one dtype). Shards longer than FLAT_MAX_CHUNKS
    take the nested kernel at LONG_TILE (speed only). The operands are copied once: for
    the flat TMA kernel gathered shard by shard (each shard's rows of every projection, in
    order), else concatenated (dY_cat [M, ΣN_i], W_cat [ΣN_i, K], rows shifted by the rows
    before). `kw` as shard_tree_matmul. ValueError unless `fusable` or when the shapes
    disagree."""
    if len(dys) != len(ws) or len(shard_rows) != len(ws) or not ws:
        raise ValueError(f"column dX: {len(dys)} dY, {len(ws)} weights, {len(shard_rows)} "
                         "shard-row lists; one each per projection")
    check_cuda("column dX", *dys, *ws)
    for dy, w in zip(dys, ws):
        if dy.dim() != 2 or w.dim() != 2 or dy.shape[1] != w.shape[0] or w.shape[1] != ws[0].shape[1]:
            raise ValueError(f"column dX: dY {tuple(dy.shape)} and W {tuple(w.shape)} do not "
                             "match [M, N_i] @ [N_i, K]")
    if any(not 0 <= r0 <= r1 <= w.shape[0] for rows, w in zip(shard_rows, ws) for r0, r1 in rows):
        raise ValueError(f"column dX: shard rows {shard_rows} leave the weights' rows "
                         f"{[w.shape[0] for w in ws]}")
    per_shard = [[tuple(shard_rows[i][s]) for i in range(len(ws))]
                 for s in range(len(shard_rows[0]))]
    period = _flat_period(operand_dtype(dys[0], ws[0]), per_shard) \
        if fusable(per_shard) and kw.get("flat", True) and kw.get("use_tma") is not False \
        else None
    if period is not None and period[0] > FLAT_MAX_CHUNKS and "tile" not in kw:
        kw = {**kw, "tile": LONG_TILE, "flat": False}
    elif period is not None:
        # gathered straight into the flat kernel's order: shard by shard, projections in order
        dt = operand_dtype(dys[0], ws[0])
        order = [(i, r0, r1) for sb in per_shard for i, (r0, r1) in enumerate(sb)]
        a, b = _end_to_end([cast(dys[i][:, r0:r1], dt) for i, r0, r1 in order],
                           [cast(ws[i][r0:r1], dt) for i, r0, r1 in order], False)
        y = _flat(a, b, period, len(per_shard), False, kw.get("tile"))
        if y is not None:
            return y
    offs = [0]
    for w in ws[:-1]:
        offs.append(offs[-1] + w.shape[0])
    bounds = [[(offs[i] + shard_rows[i][s][0], offs[i] + shard_rows[i][s][1])
               for i in range(len(ws))] for s in range(len(shard_rows[0]))]
    a = dys[0] if len(dys) == 1 else torch.cat(list(dys), 1)
    b = ws[0] if len(ws) == 1 else torch.cat(list(ws), 0)
    return shard_tree_matmul(a, b, bounds, b_kmajor=False, **{**kw, "flat": False})
