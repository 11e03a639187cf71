"""Weight gradients dW = dYᵀ·X of the linears on CUDA (Triton): the token-leaf partials are
produced and added inside one kernel, never written out per leaf.

What it computes: the same exact sum as the reference path (kernels/matmul.py
`token_leaf_partials` with leaves of CUDA_TOKEN_LEAF = 128 tokens + numerics/fixedpoint.py
`accumulate_`), added into the same fixed-point accumulator: for every element (n, k), the
128-token partials p_l = Σ_{t in leaf l} dy[t, n]·x[t, k] (one 128-deep tensor-core dot per
leaf, fp32 accumulation; for fp32 operands the fma chain over the leaf's tokens in order), summed
exactly over the leaves l of the call. (The leaf was 16 tokens before NUMERICS_VERSION 6 and 64
before 7: the exact additions per leaf and element bound this kernel — docs/BENCHMARKS.md.)

Why: the reference path writes 4 bytes × (tokens / 16) per weight element and reads them back into
the exact accumulator — on an H200, a qwen3-0.6b step of 4,096 tokens spent 709 ms of 1.74 s
there (docs/BENCHMARKS.md), and the traffic grows with tokens × parameters.

Algorithm, per output tile [BLOCK_N, BLOCK_K] (one program): walk the leaves in order; for each,
p = dot(dyᵀ[tile rows, leaf], x[leaf, tile cols]) in fp32, then hi += p in float64 with the add
checked exact (numerics/triton_fixedpoint.py `add_exact_or_nan`: s − hi == p and s − p == hi,
Dekker's Fast2Sum lemma; no error word; an inexact add leaves NaN in hi). (One difference from
the operand of larger magnitude, ordered by an integer compare, was tried: a third fewer float64
ops, 22 more registers, and a 2-4 % slower training step on an H100 — the pass is bound by
latency, not by its float64 throughput; docs/BENCHMARKS.md.) Every value here is a multiple of
2**-149 (an fp32 partial is), so hi is the exact sum unless a check fails: an inexact add (p
below ulp(hi), i.e. a leaf partial ~2**-29 of the running sum or smaller — a whole leaf of tiny
gradients: on the CPU, one sample of four at 2**-20 of the others' scale gives 8 % of 64×64
tiles one such add, at 2**-25 every tile several), a partial that is not finite, or a sum past
2**150 (the digit conversion's range). (Until the ninth session the first pass was `add_word`:
Knuth's TwoSum with one nonzero error kept in lo, the same words whenever it did not flag, twice
the float64 work — docs/BENCHMARKS.md; before that, every error through a second checked TwoSum:
now the retry tier below.) Operand tiles come by TMA descriptors where the operands allow
(16-bit, 16-byte aligned rows), else by pointer loads: the same tiles either way. The double
words are written out ([2, N, K] float64: 16 bytes per element, against 4 per element and leaf
before) and a second pass (numerics/triton_fixedpoint.py `add_double_words_`) adds both words'
exact integers to the digits. (Adding them in this kernel's epilogue was tried: on the H200 it
gave wrong bytes for bf16 tiles and ran 2.7x slower, register pressure of ten int64 digits per
element of a 2-D tile; not pursued.) A tile where any check failed writes zeros and is flagged:
the same kernel runs it again in RETRY mode, every error added into lo by a checked TwoSum
(`add_word_checked`: exact over a spread of ~2**100, so a sample whose gradients are 2**-30 of
the others' costs a retry, not the bins); a tile still flagged is recomputed in EMIT mode, which
stores its per-leaf partials (the same dot of the same operands) for the bin accumulator
(`accumulate_`) to add. Either way the accumulator receives the exact sum of the same partials,
so the result never depends on which tiles took which path (and so not on the tile, the call's
other leaves, CP/DP/microbatch layout), and is bytewise the reference path's whenever the dot
gives the bits of the reference's `bmm` (tests/test_cuda_grad_weight.py).
Launched with enable_fp_fusion=False: a contracted mul+add would break the exact adds' checks.
Direct rounding (`rounded_grad_weight`): where no other rank's integers are to be added (direct
mode with a scope group of one rank, distributed/tokensum.py), the double words are rounded to
fp32 straight away (numerics/fixedpoint.py `round_double_words`: one pass, no accumulator), the
bytes the digits would round to; if a tile is still flagged after its retry, the caller takes
the digit path above for those rows. `rounded_grad_weight_deferred` leaves that flag count on
the device (no host sync; distributed/tokensum.py GradSink reads it later, behind an event).

Does not: run on CPU (kernels/matmul.py keeps the reference and dispatches here), round an
accumulator, or communicate (distributed/tokensum.py sums accumulators over ranks and rounds
once).
Tests: TRITON_INTERPRET=1 via tests/test_grad_weight_triton.py; on a GPU
tests/test_cuda_grad_weight.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.triton_matmul import operand_dtype
from rlkernel.kernels.triton_util import cast, check_cuda, device_ctx, launch
from rlkernel.numerics import triton_fixedpoint as tfx
from rlkernel.spec import CUDA_TOKEN_LEAF

# (BLOCK_N, BLOCK_K, num_warps, num_stages[, maxnreg]): speed only (the sum is exact whatever
# the tile).
TILE = (64, 64, 4, 3)      # the fastest of the H200 sweeps (docs/BENCHMARKS.md)
EMIT_TILES = 64            # flagged tiles recomputed per EMIT launch (bounds the scratch)
OUT_ELEMS = 1 << 26        # bound on the elements of one launch's [2, rows, K] double words (1 GiB)


@triton.jit
def _dw_kernel(DY, X, AD, BD, OUT, FLAGS, TILES, COUNT, L, N, K,
               s_dl, s_dn, s_xl, s_xk, s_ow, s_or,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LEAF: tl.constexpr,
               PREC: tl.constexpr, EMIT: tl.constexpr, RETRY: tl.constexpr,
               FORCE_FLAG: tl.constexpr, RETRY_ALL: tl.constexpr, TMA: tl.constexpr,
               CARRY: tl.constexpr, COUNTED: tl.constexpr):
    # AD, BD: TMA descriptors of DY [L, N] (block [LEAF, BLOCK_N]) and X (block [LEAF,
    # BLOCK_K]) when TMA, else unused; TMA's zero fill past N and K is the masks' zeros.
    # CARRY (not EMIT): the words start from what OUT holds (a sum carried over microbatches)
    # and a flagged tile leaves them untouched, so its retry starts from them again.
    # COUNTED (with RETRY_ALL): each retried tile also adds its final flag to COUNT (int32 []),
    # so the caller's flag count needs no reduction launch of its own.
    # s_ow: OUT's stride from hi to lo; s_or: its row stride (K) for the carried words' loads.
    pid = tl.program_id(0)
    if RETRY_ALL:       # a retry launched over every tile (no host sync): the clean ones leave
        tile = pid
        if tl.load(FLAGS + tile) == 0:
            return
    elif EMIT or RETRY:   # the listed (flagged) tiles only
        tile = tl.load(TILES + pid)
    else:
        tile = pid
    num_k = tl.cdiv(K, BLOCK_K)
    pn = tile // num_k
    pk = tile % num_k
    rn = (pn * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = (pk * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    rt = tl.arange(0, LEAF).to(tl.int64)
    n_ok = rn < N
    k_ok = rk < K
    a_ptr = DY + rn[:, None] * s_dn + rt[None, :] * s_dl          # dyᵀ tile [BLOCK_N, LEAF]
    b_ptr = X + rt[:, None] * s_xl + rk[None, :] * s_xk           # x tile [LEAF, BLOCK_K]
    o = OUT + rn[:, None] * K + rk[None, :]
    m = n_ok[:, None] & k_ok[None, :]
    # The first pass never changes lo: under CARRY it is neither loaded nor stored (a [tile]
    # float64 live through the loop was 64 registers a thread, and ptxas spilled at 255), and
    # its inexact adds mark hi NaN instead of an int32 flag tile.
    FIRST: tl.constexpr = not (EMIT or RETRY)
    # The carried words are read through pointers of their own (row stride s_or, equal to K
    # but not known to be): built from K they were the stores' pointers too, computed once and
    # kept live through the leaf loop — 14 registers a thread at 64 x 64, and 80 bytes of
    # spills at 64 x 128 (ptxas, sm_90a; tests/test_grad_weight_triton.py).
    o_in = OUT + rn[:, None] * s_or + rk[None, :]
    if CARRY:
        hi = tl.load(o_in, mask=m, other=0.0)
    else:
        hi = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float64)
    if CARRY and RETRY:
        lo = tl.load(o_in + s_ow, mask=m, other=0.0)
    else:
        lo = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float64)
    n_inexact = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    # EMIT scratch (OUT): [leaves, flagged tiles, BLOCK_N, BLOCK_K] fp32, a leaf's rows contiguous.
    e_ptr = OUT + pid * (BLOCK_N * BLOCK_K) + tl.arange(0, BLOCK_N)[:, None] * BLOCK_K \
        + tl.arange(0, BLOCK_K)[None, :]
    e_step = tl.num_programs(0).to(tl.int64) * (BLOCK_N * BLOCK_K)
    a_step = (tl.zeros([], dtype=tl.int64) + s_dl) * LEAF     # int64: L·stride may pass 2**31
    b_step = (tl.zeros([], dtype=tl.int64) + s_xl) * LEAF
    for t0 in range(0, L, LEAF):
        if TMA:
            a = AD.load([t0, pn * BLOCK_N]).T
            b = BD.load([t0, pk * BLOCK_K])
        else:
            a = tl.load(a_ptr, mask=n_ok[:, None], other=0.0)
            b = tl.load(b_ptr, mask=k_ok[None, :], other=0.0)
            a_ptr += a_step
            b_ptr += b_step
        p = tl.dot(a, b, input_precision=PREC)
        if EMIT:
            tl.store(e_ptr, p)
            e_ptr += e_step
        elif RETRY:
            hi, lo, n_inexact = tfx.add_word_checked(hi, lo, n_inexact, p.to(tl.float64))
        else:
            hi = tfx.add_exact_or_nan(hi, p.to(tl.float64))
    if not EMIT:
        if FIRST:
            bad = (tfx.word_in_range(hi) == 0).to(tl.int32)
        else:
            bad = (tfx.words_exact(hi, n_inexact) == 0).to(tl.int32)
        good = (tl.max(bad) == 0) & (FORCE_FLAG == 0)
        if CARRY:
            tl.store(o, hi, mask=m & good)
            if RETRY:
                tl.store(o + s_ow, lo, mask=m & good)
        else:
            tl.store(o, tl.where(good, hi, 0.0), mask=m)
            tl.store(o + s_ow, tl.where(good, lo, 0.0), mask=m)
        tl.store(FLAGS + tile, (good == 0).to(tl.int32))
        if COUNTED:
            tl.atomic_add(COUNT, (good == 0).to(tl.int32))


def _tma_aligned(t: torch.Tensor) -> bool:
    """A 16-bit 2-D operand TMA can describe: unit inner stride, 16-byte aligned rows and base."""
    return t.element_size() == 2 and t.stride(1) == 1 \
        and (t.stride(0) * 2) % 16 == 0 and t.data_ptr() % 16 == 0


def _descriptors(a, b, tile, use_tma: bool):
    """(AD, BD, TMA) for `_dw_kernel`: TMA descriptors of 16-bit operands that allow them
    (-9 % time on an H200, docs/BENCHMARKS.md; the same tiles, so the same bytes), else the
    plain pointers and pointer loads."""
    if not (use_tma and _tma_aligned(a) and _tma_aligned(b)):
        return a, b, False
    from triton.tools.tensor_descriptor import TensorDescriptor
    bn, bk = tile[0], tile[1]
    return (TensorDescriptor.from_tensor(a, [CUDA_TOKEN_LEAF, bn]),
            TensorDescriptor.from_tensor(b, [CUDA_TOKEN_LEAF, bk]), True)


def _launch(a, b, out, flags, tiles, grid, tile, emit, force_flag, retry=False, retry_all=False,
            use_tma=True, carry=False, count=None, desc=None):
    # desc: `_descriptors(a, b, tile, use_tma)` made by the caller for several launches on the
    # same operands (a pass and its retry: one pair of TMA descriptors made on the host, not two)
    bn, bk, warps, stages, *cap = tile      # cap: an optional register cap a thread (maxnreg)
    prec = "ieee" if a.dtype == torch.float32 else "tf32"   # "tf32" is ignored for 16-bit dots
    ad, bd, tma = desc if desc is not None else _descriptors(a, b, tile, use_tma)
    with device_ctx(a):
        launch(_dw_kernel, grid,
               a, b, ad, bd, out, flags, tiles, flags if count is None else count, a.shape[0],
               a.shape[1], b.shape[1], a.stride(0), a.stride(1), b.stride(0), b.stride(1),
               0 if emit else out.stride(0), 0 if emit else out.stride(1), BLOCK_N=bn,
               BLOCK_K=bk, LEAF=CUDA_TOKEN_LEAF,
               PREC=prec, EMIT=emit, RETRY=retry or retry_all, FORCE_FLAG=int(force_flag),
               RETRY_ALL=retry_all, TMA=tma, CARRY=carry, COUNTED=retry_all and count is not None,
               num_warps=warps, num_stages=stages, enable_fp_fusion=False,
               **({"maxnreg": cap[0]} if cap else {}))


def _retry_flagged(a, b, words, flags, tile, force_flag, use_tma) -> torch.Tensor:
    """The flagged tiles of a `_double_words` launch again, every error through
    the checked lo (tfx.add_word_checked), into the same words and flags; returns the tiles
    still flagged (int64, on the device). One host sync (which tiles were flagged)."""
    flagged = torch.nonzero(flags).flatten()
    if flagged.numel():
        ids = flagged.to(torch.int32)
        _launch(a, b, words, flags, ids, (ids.numel(),), tile, False, force_flag, retry=True,
                use_tma=use_tma)
        flagged = flagged[flags[flagged] != 0]
    return flagged


def _redo_flagged(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, flagged: torch.Tensor,
                  tile, use_tma: bool) -> None:
    """acc += the flagged tiles' exact sums through the bin accumulator: the kernel in EMIT
    mode stores each tile's per-leaf partials, accumulate_ adds them (acc [N, K, N_COLS])."""
    bn, bk = tile[0], tile[1]
    n, k = a.shape[1], b.shape[1]
    leaves = a.shape[0] // CUDA_TOKEN_LEAF
    num_k = triton.cdiv(k, bk)
    flat = acc.view(-1, tfx.N_COLS)
    for i in range(0, flagged.numel(), EMIT_TILES):
        ids = flagged[i:i + EMIT_TILES].to(torch.int32).contiguous()
        nf = ids.numel()
        scratch = torch.empty(leaves, nf, bn, bk, dtype=torch.float32, device=a.device)
        _launch(a, b, scratch, ids, ids, (nf,), tile, True, False, use_tma=use_tma)
        rows = (ids // num_k).long()[:, None, None] * bn + torch.arange(bn, device=a.device)[:, None]
        cols = (ids % num_k).long()[:, None, None] * bk + torch.arange(bk, device=a.device)
        live = ((rows < n) & (cols < k)).reshape(-1)
        idx = (rows * k + cols).reshape(-1)[live]
        part = torch.zeros(nf * bn * bk, tfx.N_COLS, dtype=torch.int64, device=a.device)
        part[live] = flat[idx]
        tfx.accumulate_(part, scratch.view(leaves, -1))
        flat[idx] = part[live]


def _operands(dy: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x in `operand_dtype(dy, x)`; ValueError unless both hold one token count, a multiple
    of CUDA_TOKEN_LEAF."""
    if x.shape[0] != dy.shape[0] or dy.shape[0] % CUDA_TOKEN_LEAF:
        raise ValueError(f"grad weight: dy {tuple(dy.shape)} and x {tuple(x.shape)} need one "
                         f"token count, a multiple of CUDA_TOKEN_LEAF={CUDA_TOKEN_LEAF}")
    dt = operand_dtype(dy, x)
    return cast(dy, dt), cast(x, dt)


def _double_words(a: torch.Tensor, b: torch.Tensor, tile, force_flag: bool, use_tma: bool = True,
                  desc=None):
    """One launch of the double-word pass over all rows of a [L, n], b [L, K] (n·K within
    OUT_ELEMS): words [2, n, K] float64 (a flagged tile's elements 0) and flags [tiles] int32,
    no host sync. The row cut of launches is `_launch_rows`."""
    bn, bk = tile[0], tile[1]
    n, k = a.shape[1], b.shape[1]
    n_tiles = triton.cdiv(n, bn) * triton.cdiv(k, bk)
    words = torch.empty(2, n, k, dtype=torch.float64, device=a.device)
    flags = torch.empty(n_tiles, dtype=torch.int32, device=a.device)
    _launch(a, b, words, flags, flags, (n_tiles,), tile, False, force_flag, use_tma=use_tma,
            desc=desc)
    return words, flags


def _launch_rows(n: int, k: int, tile) -> list[tuple[int, int]]:
    """Row ranges [r0, r1) of the launches over n rows of K columns: whole tile rows, at most
    OUT_ELEMS elements each (one tile row at least)."""
    bn = tile[0]
    rows = max(bn, OUT_ELEMS // k // bn * bn)
    return [(r0, min(n, r0 + rows)) for r0 in range(0, n, rows)]


def accumulate_grad_weight_(acc: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, *,
                            tile: tuple[int, int, int, int] = TILE,
                            force_flag: bool = False,
                            use_tma: bool = True) -> tuple[torch.Tensor, int]:
    """acc += the exact sum over the CUDA_TOKEN_LEAF leaves of dy [L, N], x [L, K] of their dWᵀ
    partials, in place (acc int64 [N, K, N_COLS], contiguous; L a multiple of CUDA_TOKEN_LEAF).

    Operands in `operand_dtype(dy, x)` (bf16 on the tensor cores, else the fp32 fma chain).
    Returns (acc, number of tiles that took the EMIT path). `tile` (BLOCK_N, BLOCK_K, warps,
    stages), `force_flag` (every tile through the EMIT path; tests) and `use_tma` (False: the
    pointer loads even where TMA descriptors could fetch the tiles; tests) never change a bit.
    One host sync per call (to learn which tiles, if any, were flagged).
    Raises ValueError on devices, shapes or an accumulator of the wrong form.
    """
    check_cuda("grad weight", acc, dy, x)
    n_tok, n = dy.shape
    k = x.shape[1]
    a, b = _operands(dy, x)
    if acc.dtype != torch.int64 or tuple(acc.shape) != (n, k, tfx.N_COLS) \
            or not acc.is_contiguous():
        raise ValueError(f"grad weight: contiguous int64 [{n}, {k}, {tfx.N_COLS}] accumulator "
                         f"expected, got {acc.dtype} {tuple(acc.shape)}")
    if n_tok == 0 or n == 0 or k == 0:
        return acc, 0
    redone = 0
    for r0, r1 in _launch_rows(n, k, tile):
        ac, aa = acc[r0:r1], a[:, r0:r1]
        words, flags = _double_words(aa, b, tile, force_flag, use_tma)
        flagged = _retry_flagged(aa, b, words, flags, tile, force_flag, use_tma)
        tfx.add_double_words_(ac.view(-1, tfx.N_COLS), words.view(2, -1))
        if flagged.numel():
            _redo_flagged(ac, aa, b, flagged, tile, use_tma)
            redone += flagged.numel()
    return acc, redone


def carry_grad_weight_deferred(words: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, *,
                               count: torch.Tensor | None = None,
                               tile: tuple[int, int, int, int] = TILE, force_flag: bool = False,
                               use_tma: bool = True
                               ) -> tuple[list[tuple[int, int, torch.Tensor]], torch.Tensor]:
    """words += the exact sum over the CUDA_TOKEN_LEAF leaves of dy [L, N], x [L, K] of their
    dWᵀ partials, in place, where the words can hold it, with no host sync: words [2, N, K]
    float64 (contiguous) is a pair (hi, lo) per element whose exact sum hi + lo is a persistent
    mini-batch sum, as `accumulate_grad_weight_`'s first pass and retry make it, continued from
    what it holds.

    Returns (launches, flagged): launches [(r0, r1, flags int32 [tiles])] per launch of rows
    [r0, r1), and flagged ([] int32, on the device) the count of tiles that could not take this
    call's partials even through the checked retry (usually 0) — their words are left as they
    were before the call. `count`: a zeroed int32 [] tensor on the device to add that count
    into and return (the gradient sink's slot, GradSink.flag_count: no allocation or
    reduction launch per call); default a new one. If it is not 0 the caller moves the sum to digits (the words added to
    an accumulator, `tfx.add_double_words_`) and adds those tiles' partials there
    (`flagged_tiles`, `redo_into_digits_`). The exact sum is the same either way, so the
    rounded gradient is the digit path's, bytewise, whatever the microbatches
    (tests/grad_weight_triton_checks.py).

    Why: the digit accumulator of the persistent path costs 104 bytes per element and a pass
    reading and writing it per microbatch (on an H200, qwen3-0.6b at four microbatches:
    `add_double_words_` 340 ms of a 1.48 s step against 80 ms for the dW kernels themselves,
    docs/BENCHMARKS.md); words are 16 bytes and the kernel continues them. The retry runs over
    every tile (RETRY_ALL, as in `rounded_grad_weight_deferred`): a list of flagged tiles read
    by the host was a drained GPU queue per linear. `tile`, `force_flag` (every tile flagged)
    and `use_tma` as in accumulate_grad_weight_. Raises ValueError on devices, shapes or words
    of the wrong form."""
    check_cuda("grad weight", words, dy, x)
    n_tok, n = dy.shape
    k = x.shape[1]
    a, b = _operands(dy, x)
    if words.dtype != torch.float64 or tuple(words.shape) != (2, n, k) \
            or not words.is_contiguous():
        raise ValueError(f"grad weight: contiguous float64 [2, {n}, {k}] words expected, got "
                         f"{words.dtype} {tuple(words.shape)}")
    flagged = _count_or_new(count, dy.device)
    launches = []
    if n_tok == 0 or n == 0 or k == 0:
        return launches, flagged
    bn, bk = tile[0], tile[1]
    for r0, r1 in _launch_rows(n, k, tile):
        aa, ww = a[:, r0:r1], words[:, r0:r1]
        n_tiles = triton.cdiv(r1 - r0, bn) * triton.cdiv(k, bk)
        flags = torch.empty(n_tiles, dtype=torch.int32, device=a.device)
        desc = _descriptors(aa, b, tile, use_tma)
        _launch(aa, b, ww, flags, flags, (n_tiles,), tile, False, force_flag, use_tma=use_tma,
                carry=True, desc=desc)
        _launch(aa, b, ww, flags, flags, (n_tiles,), tile, False, force_flag, retry_all=True,
                use_tma=use_tma, carry=True, count=flagged, desc=desc)
        launches.append((r0, r1, flags))
    return launches, flagged


def _count_or_new(count: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The caller's flag counter (int32 [] on `device`; ValueError otherwise), or a new zero one."""
    if count is None:
        return torch.zeros((), dtype=torch.int32, device=device)
    if count.dtype != torch.int32 or count.dim() != 0 or count.device != device:
        raise ValueError(f"grad weight: the flag count must be an int32 [] tensor on {device}, "
                         f"got {count.dtype} {tuple(count.shape)} on {count.device}")
    return count


def flagged_tiles(launches: list[tuple[int, int, torch.Tensor]]
                  ) -> list[tuple[int, int, torch.Tensor]]:
    """[(r0, r1, flagged tile ids int64)] of `carry_grad_weight_deferred`'s launches that left
    any tile flagged (usually []), for `redo_into_digits_`. One host sync per launch."""
    left = []
    for r0, r1, flags in launches:
        ids = torch.nonzero(flags).flatten()
        if ids.numel():
            left.append((r0, r1, ids))
    return left


def redo_into_digits_(acc: torch.Tensor, dy: torch.Tensor, x: torch.Tensor,
                      left: list[tuple[int, int, torch.Tensor]], *,
                      tile: tuple[int, int, int, int] = TILE, use_tma: bool = True) -> None:
    """acc [N, K, N_COLS] += the exact sums of dy, x's partials over the tiles `left` that
    `carry_grad_weight_deferred` (same dy, x, tile) could not hold, through the bin accumulator (EMIT
    path); the words' own sum must already be in acc."""
    a, b = _operands(dy, x)
    for r0, r1, flagged in left:
        _redo_flagged(acc[r0:r1], a[:, r0:r1], b, flagged, tile, use_tma)


def rounded_grad_weight_deferred(dy: torch.Tensor, x: torch.Tensor, *,
                                 tile: tuple[int, int, int, int] = TILE,
                                 force_flag: bool = False,
                                 use_tma: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(dW [N, K] fp32, flagged [] int32) of dy [L, N], x [L, K] (L a multiple of
    CUDA_TOKEN_LEAF), with no host sync: dW rounded once straight from the double words —
    bytewise round_fp32 of what `accumulate_grad_weight_` adds to a zero accumulator — valid
    only if `flagged`, the count of tiles still flagged after their checked retry, is 0 (a
    double word that cannot hold its sum: the caller then takes the digit path for these rows,
    distributed/tokensum.py GradSink.finish_direct).

    Why: with no other rank's integers to add (direct mode, a scope group of one), the digits
    and their 104-byte accumulator were only a way to round; fixedpoint.round_double_words
    rounds the pair itself (one pass reading 16 bytes per element). The retry runs over every
    tile (the clean ones return at once, RETRY_ALL) rather than over a list the host reads:
    the host sync per call it saves was a drained GPU queue per linear. `tile`, `force_flag`
    (every tile flagged; tests) and `use_tma` as in accumulate_grad_weight_. Raises ValueError on devices or
    shapes."""
    check_cuda("grad weight", dy, x)
    n, k = dy.shape[1], x.shape[1]
    flagged = torch.zeros((), dtype=torch.int32, device=dy.device)
    parts = [tfx.round_double_words(words.view(2, -1)).view(r1 - r0, k)
             for r0, r1, words in _checked_words(dy, x, tile, force_flag, use_tma, flagged)]
    if not parts:
        return torch.zeros(n, k, dtype=torch.float32, device=dy.device), flagged
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), flagged


def words_grad_weight_deferred(dy: torch.Tensor, x: torch.Tensor, *,
                               tile: tuple[int, int, int, int] = TILE,
                               force_flag: bool = False,
                               use_tma: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(words float64 [2, N, K], flagged [] int32) of dy [L, N], x [L, K] (L a multiple of
    CUDA_TOKEN_LEAF), with no host sync: per element a double word (hi, lo) whose exact sum is
    the exact sum over the leaves of their dWᵀ partials — what `accumulate_grad_weight_` adds
    to the digits — valid only if `flagged`, the count of tiles still flagged after their
    checked retry, is 0 (a flagged tile's words are 0).

    Why: summed over several ranks, a chunk of dW travels as these 16 bytes an element and is
    made digits only on the rank that rounds it (distributed/tokensum.py `words_finished`),
    where its digits were 104 bytes an element made and sent by every rank. `tile`,
    `force_flag` and `use_tma` as in accumulate_grad_weight_. Raises ValueError on devices or
    shapes."""
    check_cuda("grad weight", dy, x)
    n, k = dy.shape[1], x.shape[1]
    flagged = torch.zeros((), dtype=torch.int32, device=dy.device)
    parts = [words for _, _, words in _checked_words(dy, x, tile, force_flag, use_tma, flagged)]
    if not parts:
        return torch.zeros(2, n, k, dtype=torch.float64, device=dy.device), flagged
    return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)), flagged


def _checked_words(dy: torch.Tensor, x: torch.Tensor, tile, force_flag: bool, use_tma: bool,
                   flagged: torch.Tensor):
    """Per launch of dy, x's rows (`_launch_rows`): (r0, r1, words float64 [2, r1 - r0, K]) after
    the first pass and the checked retry over every tile (RETRY_ALL: the clean ones return at
    once; no host sync), the tiles still flagged added to `flagged` (int32 [] on the device).
    Nothing for an empty product."""
    n_tok, n = dy.shape
    k = x.shape[1]
    a, b = _operands(dy, x)
    if n_tok == 0 or n == 0 or k == 0:
        return
    for r0, r1 in _launch_rows(n, k, tile):
        aa = a[:, r0:r1]
        desc = _descriptors(aa, b, tile, use_tma)
        words, flags = _double_words(aa, b, tile, force_flag, use_tma, desc)
        _launch(aa, b, words, flags, flags, (flags.numel(),), tile, False, force_flag,
                retry_all=True, use_tma=use_tma, count=flagged, desc=desc)
        yield r0, r1, words


def rounded_grad_weight(dy: torch.Tensor, x: torch.Tensor, *,
                        tile: tuple[int, int, int, int] = TILE,
                        force_flag: bool = False, use_tma: bool = True) -> torch.Tensor | None:
    """`rounded_grad_weight_deferred`'s dW, or None when a tile was still flagged after its
    retry (the caller then takes the digit path). One host sync (the flag count)."""
    out, flagged = rounded_grad_weight_deferred(dy, x, tile=tile, force_flag=force_flag,
                                                use_tma=use_tma)
    return None if int(flagged) else out
