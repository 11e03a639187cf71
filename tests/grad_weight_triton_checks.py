"""The checks behind tests/test_grad_weight_triton.py, run in a subprocess with TRITON_INTERPRET=1:
the fused dW kernel (rlkernel/kernels/triton_grad_weight.py) must leave the accumulator bytewise
equal to the reference path (kernels/matmul.py `token_leaf_partials` on CPU + fixedpoint's torch
`accumulate_`), and so round to the same fp32 gradient.

The interpreter's dot is numpy's matmul (no defined order), so the operands are chosen so that every
leaf dot is exact in fp32 in any order: small integers times a power of two that is constant
within a leaf (the scale varies from leaf to leaf, which is what the exactness logic is about).
What is checked is the kernel's logic — TwoSum into (hi, lo), the fp32 cut, the flag, the EMIT
recompute of flagged tiles, edge tiles, a non-zero starting accumulator, the double words
rounded directly (`rounded_grad_weight`) and the direct sink's words_rows hook that uses them —
not the GPU's tensor-core bits (tests/test_cuda_grad_weight.py does that).
Prints one JSON object {check name: "ok" or the failure}.
Run by hand: TRITON_INTERPRET=1 .venv/bin/python tests/grad_weight_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("grad_weight_triton_checks.py needs TRITON_INTERPRET=1")

import triton
import triton.language as tl
import triton_interpreter_compat  # noqa: F401 - numpy >= 2.3: before any launch
from kernel_helpers import LaunchRecorder, run_checks

from rlkernel.distributed import tokensum
from rlkernel.distributed.comm import Comm
from rlkernel.kernels import matmul as mm
from rlkernel.kernels import triton_grad_weight as tgw
from rlkernel.numerics import fixedpoint as fx
from rlkernel.numerics import triton_fixedpoint as tfx
from rlkernel.spec import CUDA_TOKEN_LEAF as TOKEN_LEAF  # the kernel's leaf

_BIG = 66 - (TOKEN_LEAF.bit_length() - 1)
"""dy = 2**_BIG times x = 2**61: a leaf partial of TOKEN_LEAF such products is 2**127 (fp32 max
range), four leaves 2**129."""

CHECKS = {}
SMALL = (16, 16, 1, 1)     # interpreter tile: few programs, fast
# numpy warns when round_double_words' float64 -> fp32 cast overflows to +Inf, as it must.
warnings.filterwarnings("ignore", "overflow encountered in cast", RuntimeWarning)


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _operands(leaves: int, n: int, k: int, scale_bits: int, seed: int):
    """dy [L, N], x [L, K] fp32: integers in [-8, 8) times 2**s_l, s_l uniform in
    [-scale_bits, scale_bits] per leaf (dy and x get independent scales), so each leaf dot is
    exact in fp32 whatever the order, and leaf partials of one element span up to 4·scale_bits
    bits."""
    g = torch.Generator().manual_seed(seed)
    tok = leaves * TOKEN_LEAF

    def one(cols):
        ints = torch.randint(-8, 8, (tok, cols), generator=g).float()
        s = torch.randint(-scale_bits, scale_bits + 1, (leaves,), generator=g).float()
        return ints * torch.exp2(s).repeat_interleave(TOKEN_LEAF)[:, None]
    return one(n), one(k)


def _reference(dy, x, acc0=None):
    acc = fx.zeros((dy.shape[1], x.shape[1])) if acc0 is None else acc0.clone()
    return fx.accumulate_(acc, mm.token_leaf_partials(dy, x, dy.shape[0] // TOKEN_LEAF))


def _same(dy, x, acc0=None, **kw) -> int:
    """Kernel == reference bytewise (accumulator and rounded gradient); returns tiles redone."""
    want = _reference(dy, x, acc0)
    acc = fx.zeros((dy.shape[1], x.shape[1])) if acc0 is None else acc0.clone()
    got, redone = tgw.accumulate_grad_weight_(acc, dy, x, tile=kw.pop("tile", SMALL), **kw)
    assert torch.equal(got, want), f"elements {torch.nonzero((got != want).any(-1))[:6].tolist()}"
    assert torch.equal(fx.round_fp32(got).view(torch.int32), fx.round_fp32(want).view(torch.int32))
    return redone


def _naive64(dy, x) -> torch.Tensor:
    """The leaf partials summed in float64 and rounded to fp32: what a kernel without the lo word
    and without the exactness check would give."""
    parts = mm.token_leaf_partials(dy, x, dy.shape[0] // TOKEN_LEAF).double()
    return parts.sum(0).float()


def _unholdable(leaves: int):
    """(dy, x, the digit reference's fp32 bits) of a [50, 40] weight over `leaves` leaves whose
    element (37, 21) gets the partials 2**100, 1.5·2**46, 2**-100 (leaves 0..2): no double word
    holds their sum, so its tile must leave the words for the digits."""
    dy, x = _operands(leaves, 50, 40, 12, seed=10)
    _plant(dy, x, 37, 21, [2.0**100, 1.5 * 2.0**46, 2.0**-100])
    return dy, x, fx.round_fp32(_reference(dy, x)).view(torch.int32)


@check
def narrow_range_needs_no_recompute():
    dy, x = _operands(6, 40, 24, 4, seed=0)
    assert _same(dy, x) == 0


def _plant(dy, x, row: int, col: int, values) -> None:
    """Make leaf l's partial of element (row, col) exactly values[l]: one token of the leaf
    carries it (dy) against a 1 (x); every other token is 0 in that row/column, so
    every other partial stays a single exact product; later leaves give 0."""
    dy[:, row] = 0.0
    x[:, col] = 0.0
    for leaf, v in enumerate(values):
        x[leaf * TOKEN_LEAF] = 0.0        # so the row's other elements get plain partials
        dy[leaf * TOKEN_LEAF, row] = v
        x[leaf * TOKEN_LEAF, col] = 1.0


def _retried_alone_and_exact(values):
    """Element (3, 5) of narrow-scale operands (seed 1: no other inexact add) planted with leaf
    partials `values` whose exact sum rounds to 1 + 2**-23 and whose naive float64 sum rounds to
    1.0 (asserted: the control): the accumulator == the reference bytewise, through the first
    pass and the checked retry of tile (0, 0) alone (no EMIT). Returns (dy, x)."""
    dy, x = _operands(8, 40, 24, 4, seed=1)
    _plant(dy, x, 3, 5, values)
    with LaunchRecorder.swapped_in(tgw, "_dw_kernel") as rec:
        assert _same(dy, x) == 0
    modes = [(kw["RETRY"], kw["EMIT"]) for _, kw in rec.launches]
    assert modes == [(False, False), (True, False)], modes
    assert rec.launches[1][0][6].tolist() == [0], rec.launches[1][0][6]   # tile (0, 0) alone
    want = fx.round_fp32(_reference(dy, x))
    assert want[3, 5].item() == 1.0 + 2.0**-23
    assert _naive64(dy, x)[3, 5].item() == 1.0, "control: the naive float64 sum is not wrong here"
    return dy, x


@check
def one_inexact_add_is_retried_and_exact():
    """Element (3, 5) gets leaf partials 1, 2**-24, 2**-80 (exact sum 1 + 2**-24 + 2**-80 rounds
    up to 1 + 2**-23; in float64 the 2**-80 is lost and the tie rounds to 1.0): one inexact add,
    which the first pass (tfx.add_exact_or_nan, no error word) flags, so its tile alone is
    retried with the checked lo word — no EMIT — and the bytes are the reference's; the naive float64 sum
    gives other bytes there (the control: a kernel that kept the first pass's words would fail
    this check). Other elements span up to ~2**20 (no inexact add)."""
    _retried_alone_and_exact([1.0, 2.0**-24, 2.0**-80])


@check
def small_then_large_inexact_add_is_retried_and_exact():
    """Element (3, 5) gets leaf partials 2**-80, then 1, then 2**-24: the running sum is small
    when the large partial arrives, so fl(2**-80 + 1) = 1 passes add_exact_or_nan's first comparison
    (s − hi == p) and only its second (s − p == hi) sees that 2**-80 was lost (Dekker: the
    larger operand, here p, gives the exact difference). The tile must be flagged and retried
    with the checked lo word (tile 0 alone, no EMIT); the exact sum 1 + 2**-24 + 2**-80 rounds
    up to 1 + 2**-23, what the accumulator and rounded_grad_weight give, bytewise == the exact
    reference. Keeping the first pass's words instead (the lost 2**-80: 1 + 2**-24, a tie) rounds
    to 1.0, as the naive float64 sum does (the control)."""
    hi, p = 2.0**-80, 1.0
    s = hi + p                    # Python float64: the kernel's first-pass add, by hand
    assert s - hi == p and s - p != hi, "the case must pass the first comparison alone"
    dy, x = _retried_alone_and_exact([2.0**-80, 1.0, 2.0**-24])
    _rounded_same(dy, x)
    assert tgw.rounded_grad_weight(dy, x, tile=SMALL)[3, 5].item() == 1.0 + 2.0**-23


@check
def two_inexact_adds_are_retried_and_exact():
    """Element (3, 5) gets 1, 2**-80, 2**-81 (two inexact adds),
    and the other elements span up to ~2**90 (wide: many elements with several inexact adds):
    the flagged tiles are retried with the checked lo word, none reaches the EMIT path, and the
    accumulator is the reference's."""
    dy, x = _operands(8, 40, 24, 20, seed=1)
    _plant(dy, x, 3, 5, [1.0, 2.0**-80, 2.0**-81])
    with LaunchRecorder.swapped_in(tgw, "_dw_kernel") as rec:
        assert _same(dy, x) == 0
    modes = [(kw["RETRY"], kw["EMIT"]) for _, kw in rec.launches]
    assert modes[0] == (False, False) and (True, False) in modes, modes
    assert not any(emit for _, emit in modes), modes


@check
def a_lone_flagged_tile_is_retried_in_place():
    """Narrow leaf scales (no inexact add) but element (35, 20), in the last of the 6 tiles: 1,
    2**-80, 2**-81 flag that tile alone; the retry launch lists it (TILES = [5]) and redoes that
    tile, not the first one (no EMIT); bytes == reference, and rounded_grad_weight's too."""
    dy, x = _operands(8, 40, 24, 4, seed=13)
    _plant(dy, x, 35, 20, [1.0, 2.0**-80, 2.0**-81])
    with LaunchRecorder.swapped_in(tgw, "_dw_kernel") as rec:
        assert _same(dy, x) == 0
        _rounded_same(dy, x)
    modes = [(kw["RETRY"], kw["EMIT"]) for _, kw in rec.launches]
    assert modes[:2] == [(False, False), (True, False)], modes
    assert rec.launches[1][0][6].tolist() == [5], rec.launches[1][0][6]
    assert not any(emit for _, emit in modes), modes

@check
def retry_all_leaves_clean_tiles_untouched():
    """The retry launched over every tile (RETRY_ALL, rounded_grad_weight_deferred's: no host
    list of flagged tiles) returns at once where a tile's flag is 0 — its words keep whatever
    they held (a sentinel here) — and recomputes, checked, where it is 1: that tile's words ==
    the first pass's, its flag cleared."""
    dy, x = _operands(4, 40, 24, 4, seed=21)
    a, b = dy.contiguous(), x.contiguous()
    words, flags = tgw._double_words(a, b, SMALL, False)
    assert not bool(flags.any())
    sentinel = torch.full_like(words, 12345.0)
    kept = sentinel.clone()
    kept_flags = flags.clone()
    kept_flags[3] = 1                    # tile 3 alone asks for a retry
    tgw._launch(a, b, kept, kept_flags, kept_flags, (flags.numel(),), SMALL, False, False,
                retry_all=True)
    bn, bk = SMALL[0], SMALL[1]
    num_k = triton.cdiv(b.shape[1], bk)
    r, c = (3 // num_k) * bn, (3 % num_k) * bk
    redone = torch.zeros_like(kept, dtype=torch.bool)
    redone[:, r:r + bn, c:c + bk] = True
    assert torch.equal(kept[~redone], sentinel[~redone])
    assert torch.equal(kept[redone], words[redone]) and kept_flags.tolist() == [0] * flags.numel()


@check
def deferred_retry_all_takes_the_callers_use_tma():
    """rounded_grad_weight_deferred passes its use_tma to both of its launches, the first pass
    and the every-tile retry (RETRY_ALL): a spy on tgw._launch sees the caller's value in each,
    and the kernel launches record TMA == use_tma (the operands allow TMA: bf16, 48-byte rows),
    for use_tma True and False. Element (3, 5) holds the small-then-large partials 2**-80, 1,
    2**-24, so the RETRY_ALL launch really recomputes tile 0 (with TMA fetches, then with
    pointer loads): no tile left flagged and the digit path's bytes, 1 + 2**-23 there, either
    way."""
    dy, x = _operands(8, 40, 24, 4, seed=1)
    _plant(dy, x, 3, 5, [2.0**-80, 1.0, 2.0**-24])
    a, b = dy.bfloat16(), x.bfloat16()       # exact: small integers times powers of two
    want = fx.round_fp32(_reference(a, b)).view(torch.int32)
    real = tgw._launch
    calls = []

    def spy(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append((bound.arguments["retry_all"], bound.arguments["use_tma"]))
        return real(*args, **kwargs)
    for use_tma in (True, False):
        calls.clear()
        tgw._launch = spy
        try:
            with LaunchRecorder.swapped_in(tgw, "_dw_kernel") as rec:
                out, flagged = tgw.rounded_grad_weight_deferred(a, b, tile=SMALL, use_tma=use_tma)
        finally:
            tgw._launch = real
        assert calls == [(False, use_tma), (True, use_tma)], (use_tma, calls)
        got = [(kw["RETRY_ALL"], kw["TMA"]) for _, kw in rec.launches]
        assert got == [(False, use_tma), (True, use_tma)], (use_tma, got)
        assert int(flagged) == 0 and out[3, 5].item() == 1.0 + 2.0**-23, use_tma
        assert torch.equal(out.view(torch.int32), want), use_tma


@check
def extreme_range_takes_the_emit_path():
    """Element (1, 1) gets leaf partials 2**100, 1.5·2**46, 2**-100: the second's rounding error
    lands in lo, and the third cannot be added to lo exactly, so its tile is flagged and redone
    from its per-leaf partials; the accumulator is still the reference's."""
    dy, x = _operands(8, 40, 24, 12, seed=2)
    _plant(dy, x, 1, 1, [2.0**100, 1.5 * 2.0**46, 2.0**-100])
    assert _same(dy, x) == 1


@check
def nonfinite_partials_take_the_emit_path():
    dy, x = _operands(4, 35, 20, 3, seed=3)
    dy[5, 3] = float("inf")
    dy[40, 30] = float("nan")
    x[20, 7] = float("-inf")
    assert _same(dy, x) > 0


@check
def opposite_infinities_in_two_leaves_are_nan():
    """Row 0's partials are +Inf in leaf 0 and −Inf in leaf 1, every other partial 0: the sum is
    NaN (the reference's flag counts), and the first pass flags the tiles (+Inf + −Inf is NaN
    in its word). A widening that made the Infs finite (the thirty-fourth session's bit move
    without its non-finite OR: ±2**128, which cancel to 0 exactly) would pass every other
    check here."""
    dy = torch.zeros(2 * TOKEN_LEAF, 9)
    x = torch.ones(2 * TOKEN_LEAF, 11)
    dy[0, 0] = dy[TOKEN_LEAF, 0] = float("inf")
    x[TOKEN_LEAF] = -1.0
    assert _same(dy, x) > 0
    assert torch.isnan(fx.round_fp32(_reference(dy, x))[0]).all()


@check
def sums_past_the_fp32_range_stay_exact():
    """Partials near the fp32 maximum whose exact sum is 2**129: the double word and the digits
    hold it (no recompute); it rounds to +Inf as the reference does."""
    dy = torch.full((4 * TOKEN_LEAF, 17), 2.0**_BIG)
    x = torch.full((4 * TOKEN_LEAF, 19), 2.0**61)
    assert _same(dy, x) == 0
    assert torch.isinf(fx.round_fp32(_reference(dy, x))).all()


@check
def sums_at_the_double_word_bound_take_the_emit_path():
    """|hi| >= triton_fixedpoint.TOP_F64_BITS flags a tile (add_double_words_ is exact only below
    it). Sums of 2**150 need 2**22 leaves of fp32 maxima, so the bound is lowered to 2**129:
    sums of exactly 2**129 (x > 0) and −2**129 (x < 0), each in whole tiles, flag all 4 tiles and
    are redone, bytes == reference; sums of ±2**128 (below it) flag none."""
    dy = torch.full((4 * TOKEN_LEAF, 17), 2.0**_BIG)
    x = torch.full((4 * TOKEN_LEAF, 19), 2.0**61)
    x[:, 16:] *= -1                                   # the second tile column sums to −2**129
    real = tfx.TOP_F64_BITS
    try:
        tfx.TOP_F64_BITS = tl.constexpr((1023 + 129) << 52)
        assert _same(dy, x) == 4
        assert _same(dy, x / 2) == 0
    finally:
        tfx.TOP_F64_BITS = real


@check
def several_launches_and_emit_batches_change_no_bit():
    """The row split (OUT_ELEMS: one launch per run of whole tile rows) and the EMIT batches
    (EMIT_TILES flagged tiles per recompute) change no bit: lowered to 16·K elements (N = 50:
    four launches of one tile row, the last 2 rows) and 2 tiles per batch, onto a non-zero
    accumulator, with an extreme element in the third launch (1 tile redone) and with every
    tile forced (3 per launch: batches of 2 and 1), == reference."""
    dy, x = _operands(4, 50, 40, 12, seed=10)
    _plant(dy, x, 37, 21, [2.0**100, 1.5 * 2.0**46, 2.0**-100])
    acc0 = _reference(*_operands(4, 50, 40, 30, seed=11))
    real = tgw.OUT_ELEMS, tgw.EMIT_TILES
    try:
        tgw.OUT_ELEMS, tgw.EMIT_TILES = 16 * 40, 2
        assert _same(dy, x, acc0) == 1
        assert _same(dy, x, acc0, force_flag=True) == 4 * 3
    finally:
        tgw.OUT_ELEMS, tgw.EMIT_TILES = real


@check
def launch_arguments():
    """What the interpreter cannot show (its dot is numpy's matmul, it ignores fp fusion), checked
    as launch arguments: every launch has enable_fp_fusion=False (a forced flag goes through the
    retry, then EMIT); fp32 operands go in as fp32
    with input_precision "ieee" (the reference's fp32 fma chain, not tf32); bf16 dy and x go in
    as bf16 (the tensor cores), mixed bf16/fp32 as fp32 (operand_dtype); bytes == reference."""
    rec = LaunchRecorder(tgw._dw_kernel)
    tgw._dw_kernel = rec
    try:
        dy, x = _operands(2, 20, 18, 3, seed=12)
        for a, b, force in ((dy, x, True), (dy.bfloat16(), x.bfloat16(), False),
                            (dy.bfloat16(), x, False)):
            _same(a, b, force_flag=force)
    finally:
        tgw._dw_kernel = rec.kernel
    assert all(kw["enable_fp_fusion"] is False for _, kw in rec.launches)
    got = [(args[0].dtype, args[1].dtype, kw["PREC"], kw["RETRY"], kw["EMIT"])
           for args, kw in rec.launches]
    f32, b16 = torch.float32, torch.bfloat16
    assert got == [(f32, f32, "ieee", False, False), (f32, f32, "ieee", True, False),
                   (f32, f32, "ieee", False, True), (b16, b16, "tf32", False, False),
                   (f32, f32, "ieee", False, False)], got


@check
def tma_fetches_equal_pointer_loads():
    """16-bit operands with 16-byte aligned rows take TMA descriptors (TMA=True in every launch:
    first pass, retry, EMIT) and give the pointer loads' bytes and the reference's, edge tiles
    (40 rows, 24 columns at 16 × 16 tiles) included; unaligned ones (20 columns) keep the
    pointer loads."""
    dy, x = _operands(3, 40, 24, 6, seed=13)
    a, b = dy.bfloat16(), x.bfloat16()
    with LaunchRecorder.swapped_in(tgw, "_dw_kernel") as rec:
        _same(a, b)
        _same(a, b, force_flag=True)
        _rounded_same(a, b)
    assert rec.launches and all(kw["TMA"] is True for _, kw in rec.launches), \
        [kw["TMA"] for _, kw in rec.launches]
    with LaunchRecorder.swapped_in(tgw, "_dw_kernel") as rec:
        _same(a, b, use_tma=False)
        _same(a, b, force_flag=True, use_tma=False)
        _same(a[:, :20].contiguous(), b)   # 40-byte rows: no TMA
    assert rec.launches and all(kw["TMA"] is False for _, kw in rec.launches)
    acc_t, _ = tgw.accumulate_grad_weight_(fx.zeros((40, 24)), a, b, tile=SMALL)
    acc_p, _ = tgw.accumulate_grad_weight_(fx.zeros((40, 24)), a, b, tile=SMALL, use_tma=False)
    assert torch.equal(acc_t, acc_p)


@check
def forced_emit_gives_the_same_bytes():
    dy, x = _operands(5, 37, 29, 10, seed=4)
    assert _same(dy, x, force_flag=True) == 3 * 2


@check
def edge_tiles_odd_shapes_and_one_leaf():
    for leaves, n, k in ((1, 1, 1), (1, 17, 33), (3, 70, 5), (2, 16, 16)):
        dy, x = _operands(leaves, n, k, 6, seed=leaves + n)
        _same(dy, x)
        _same(dy, x, force_flag=True)


@check
def onto_a_nonzero_accumulator_and_strided_operands():
    dy, x = _operands(4, 30, 22, 8, seed=5)
    acc0 = _reference(*_operands(4, 30, 22, 30, seed=6))
    _same(dy, x, acc0)
    _same(dy, x, acc0, force_flag=True)
    big_dy, big_x = _operands(4, 60, 44, 8, seed=7)
    _same(big_dy[:, ::2], big_x[:, 1::2])


@check
def tiles_never_change_bytes():
    dy, x = _operands(4, 50, 40, 12, seed=8)
    _same(dy, x)
    _same(dy, x, force_flag=True)
    _same(dy, x, tile=(32, 16, 1, 1))
    _same(dy, x, tile=(16, 32, 1, 1))


# ---------------------------------------------------- rounding the double words directly
def _rounded_same(dy, x, **kw) -> None:
    """rounded_grad_weight == round_fp32 of the kernel's accumulator onto zeros == round_fp32 of
    the reference's, bytewise (int32 views)."""
    tile = kw.pop("tile", SMALL)
    got = tgw.rounded_grad_weight(dy, x, tile=tile, **kw)
    assert got is not None, "a tile was flagged"
    acc = tgw.accumulate_grad_weight_(fx.zeros((dy.shape[1], x.shape[1])), dy, x, tile=tile)[0]
    want = fx.round_fp32(acc).view(torch.int32)
    assert torch.equal(want, fx.round_fp32(_reference(dy, x)).view(torch.int32))
    bad = torch.nonzero(got.view(torch.int32) != want)
    assert bad.numel() == 0, f"elements {bad[:6].tolist()}"


@check
def rounded_is_the_digit_path_rounding():
    """rounded_grad_weight (the double words rounded by round_double_words) gives the digit
    path's fp32 bytes: narrow and wide leaf scales, an element that needs the lo word (1,
    2**-24, 2**-80: rounds up to 1 + 2**-23), sums past the fp32 range (+Inf), edge tiles and
    odd shapes, strided operands, other tiles, bf16 and mixed operands; no token: +0.0."""
    for leaves, n, k, bits, seed in ((6, 40, 24, 4, 20), (8, 40, 24, 20, 21), (1, 17, 33, 6, 22),
                                     (3, 70, 5, 6, 23), (2, 16, 16, 6, 24)):
        _rounded_same(*_operands(leaves, n, k, bits, seed))
    dy, x = _operands(8, 40, 24, 20, seed=1)
    _plant(dy, x, 3, 5, [1.0, 2.0**-24, 2.0**-80])
    _rounded_same(dy, x)
    assert tgw.rounded_grad_weight(dy, x, tile=SMALL)[3, 5].item() == 1.0 + 2.0**-23
    _rounded_same(torch.full((4 * TOKEN_LEAF, 17), 2.0**_BIG), torch.full((4 * TOKEN_LEAF, 19),
                                                                         2.0**61))
    big_dy, big_x = _operands(4, 60, 44, 8, seed=7)
    _rounded_same(big_dy[:, ::2], big_x[:, 1::2])
    dy, x = _operands(4, 50, 40, 12, seed=8)
    for tile in ((32, 16, 1, 1), (16, 32, 1, 1)):
        _rounded_same(dy, x, tile=tile)
    _rounded_same(dy.bfloat16(), x.bfloat16())
    _rounded_same(dy.bfloat16(), x)
    empty = tgw.rounded_grad_weight(dy[:0], x[:0])
    assert empty.shape == (50, 40) and not empty.view(torch.int32).any()


@check
def rounded_is_none_when_a_tile_is_flagged():
    """None (the caller takes the digits) when any tile is flagged: an extreme element (2**100,
    1.5·2**46, 2**-100), a non-finite operand, every tile forced; with OUT_ELEMS lowered to four
    launches, an extreme element in the third launch gives None and none gives the digit path's
    bytes (the launches' rows put together)."""
    dy, x = _operands(8, 40, 24, 12, seed=2)
    _plant(dy, x, 1, 1, [2.0**100, 1.5 * 2.0**46, 2.0**-100])
    assert tgw.rounded_grad_weight(dy, x, tile=SMALL) is None
    dy, x = _operands(4, 35, 20, 3, seed=3)
    assert tgw.rounded_grad_weight(dy, x, tile=SMALL, force_flag=True) is None
    dy[40, 30] = float("nan")
    assert tgw.rounded_grad_weight(dy, x, tile=SMALL) is None
    real = tgw.OUT_ELEMS
    try:
        tgw.OUT_ELEMS = 16 * 40
        dy, x = _operands(4, 50, 40, 12, seed=10)
        _rounded_same(dy, x)
        _plant(dy, x, 37, 21, [2.0**100, 1.5 * 2.0**46, 2.0**-100])
        assert tgw.rounded_grad_weight(dy, x, tile=SMALL) is None
    finally:
        tgw.OUT_ELEMS = real


@check
def words_deferred_hold_the_digit_path_sum():
    """words_grad_weight_deferred's words (what a chunk sends over several ranks) hold the
    digit path's exact sum: their digits (fixedpoint.add_double_words_, torch path) == the
    kernel's accumulator == the reference's, and rounded == rounded_grad_weight, with a flag
    count of 0 — narrow and wide scales, the lo-word element, edge tiles, bf16, and four
    launches (OUT_ELEMS lowered: the launches' rows put together along dim 1); an extreme
    element counts 1 flagged tile, forced flags count every tile; no token: zero words."""
    def same(dy, x):
        words, flagged = tgw.words_grad_weight_deferred(dy, x, tile=SMALL)
        assert int(flagged) == 0 and words.shape == (2, dy.shape[1], x.shape[1])
        acc = tgw.accumulate_grad_weight_(fx.zeros((dy.shape[1], x.shape[1])), dy, x,
                                          tile=SMALL)[0]
        digits = fx.add_double_words_(fx.zeros((words[0].numel(),)), words.view(2, -1))
        assert torch.equal(digits.view(acc.shape), acc)
        assert torch.equal(acc, _reference(dy, x))
        rounded = tgw.rounded_grad_weight(dy, x, tile=SMALL)
        assert torch.equal(fx.round_double_words(words).view(torch.int32),
                           rounded.view(torch.int32))
    for leaves, n, k, bits, seed in ((6, 40, 24, 4, 20), (8, 40, 24, 20, 21), (1, 17, 33, 6, 22)):
        same(*_operands(leaves, n, k, bits, seed))
    dy, x = _operands(8, 40, 24, 20, seed=1)
    _plant(dy, x, 3, 5, [1.0, 2.0**-24, 2.0**-80])
    same(dy, x)
    same(dy.bfloat16(), x.bfloat16())
    real = tgw.OUT_ELEMS
    try:
        tgw.OUT_ELEMS = 16 * 40
        dy, x = _operands(4, 50, 40, 12, seed=10)
        same(dy, x)
        _plant(dy, x, 37, 21, [2.0**100, 1.5 * 2.0**46, 2.0**-100])
        assert int(tgw.words_grad_weight_deferred(dy, x, tile=SMALL)[1]) == 1
    finally:
        tgw.OUT_ELEMS = real
    dy, x = _operands(4, 35, 20, 3, seed=3)
    forced = tgw.words_grad_weight_deferred(dy, x, tile=SMALL, force_flag=True)[1]
    assert int(forced) == 3 * 2          # every tile of [35, 20] at 16 x 16
    empty, flagged = tgw.words_grad_weight_deferred(dy[:0], x[:0])
    assert empty.shape == (2, 35, 20) and not empty.any() and int(flagged) == 0


def _direct(dy, x, words: bool, force_flag: bool = False):
    """w's gradient through a one-rank direct sink (DIRECT_CHUNK_ELEMS set by the caller):
    add_rows = the fused kernel's accumulate, words_rows = rounded_grad_weight (if `words`).
    Returns (gradient, [rows of the chunks add_rows ran], [rows words_rows rounded])."""
    w = torch.nn.Parameter(torch.zeros(dy.shape[1], x.shape[1]))
    sink = tokensum.GradSink.single()
    sink.begin({"w": w}, direct=True)
    adds, rounded = [], []

    def add_rows(a, b, acc):
        adds.append((a, b))
        tgw.accumulate_grad_weight_(acc, dy[:, a:b], x, tile=SMALL)

    def words_rows(a, b):
        out = tgw.rounded_grad_weight(dy[:, a:b], x, tile=SMALL, force_flag=force_flag)
        if out is not None:
            rounded.append((a, b))
        return out

    def deferred(a, b):      # the flag count left unread: the sink redoes a flagged chunk
        out, flagged = tgw.rounded_grad_weight_deferred(dy[:, a:b], x, tile=SMALL,
                                                        force_flag=force_flag)
        if not int(flagged):
            rounded.append((a, b))
        return out, flagged
    hook = {False: None, True: words_rows, "deferred": deferred}[words]
    assert tokensum.TokenSum(Comm.single("tokens"), sink=sink).finish_now(
        w, add_rows, "dw", words_rows=hook)
    return sink.finish()["w"], adds, rounded


@check
def direct_sink_words_path_equals_the_digit_path():
    """A one-rank direct sink (distributed/tokensum.py) over the [50, 40] weight in chunks of 16
    rows (DIRECT_CHUNK_ELEMS = 640) with the kernel's words_rows hook: the chunk holding the
    planted row 37 is flagged and goes through add_rows (digits), the three others are rounded
    from the double words; with force_flag every chunk goes through add_rows. The gradient ==
    the digit-only direct path == the persistent reference, bytewise, each way; and so with the
    deferred hook (rounded_grad_weight_deferred: flag counts read by the sink, the flagged
    chunk redone by add_rows)."""
    dy, x, want = _unholdable(4)
    real = tokensum.DIRECT_CHUNK_ELEMS
    try:
        tokensum.DIRECT_CHUNK_ELEMS = 16 * 40
        got, adds, rounded = _direct(dy, x, words=True)
        assert adds == [(32, 48)] and rounded == [(0, 16), (16, 32), (48, 50)], (adds, rounded)
        assert torch.equal(got.view(torch.int32), want)
        got, adds, rounded = _direct(dy, x, words=True, force_flag=True)
        assert len(adds) == 4 and rounded == []
        assert torch.equal(got.view(torch.int32), want)
        got, adds, _ = _direct(dy, x, words=False)
        assert len(adds) == 4 and torch.equal(got.view(torch.int32), want)
        for force in (False, True):      # rounded_grad_weight_deferred through GradSink._defer
            got, adds, rounded = _direct(dy, x, words="deferred", force_flag=force)
            assert (adds, rounded) == (([(32, 48)], [(0, 16), (16, 32), (48, 50)]) if not force
                                       else ([(0, 16), (16, 32), (32, 48), (48, 50)], []))
            assert torch.equal(got.view(torch.int32), want)
    finally:
        tokensum.DIRECT_CHUNK_ELEMS = real


# ---------------------------------------------- double words carried over microbatches
class _PairComm:
    """A two-rank scope group whose other rank adds nothing: GradSink.finish then takes the
    multi-rank path (words added to digits, the integers summed)."""
    size = 2

    def sum_ints(self, t, op, *, inplace=False):
        return t

    def sum_ints_finished(self, t, op, finish):
        return finish(t.reshape(-1, t.shape[-1])).reshape(t.shape[:-1])

    def all_gather_object(self, obj, op):     # the other rank holds its sums as this one
        return [obj, obj]

    def finish_words(self, words, op, finish):
        flat = words.reshape(words.shape[0], -1)
        return finish([flat, torch.zeros_like(flat)]).reshape(words.shape[1:])


class _NotYet:
    """A CUDA event that has not passed until waited for: GradSink._defer's flag counts then
    stay unread until finish (as behind a busy GPU queue)."""

    def query(self):
        return False

    def synchronize(self):
        pass


def _carried(dy, x, cuts, *, force_flag=False, groups=None, late=False, late_sink=False):
    """w's gradient through a persistent GradSink (several microbatches: the stream cut at the
    token rows `cuts`), each call through kernels/matmul.py `_carry_words` (the kernel at the
    SMALL tile), the digit path once it says the weight is in digits; returns (gradient, names
    held in digits before finish, per call: launches with tiles left, or "digits"). late: every
    flag count read only at the end (`_NotYet`), so later calls continue the words. late_sink:
    the sink opened late (the trainer's first pass): returns (gradient, digits, lefts,
    late_flagged), the gradient None when flagged (its caller runs the mini-batch again)."""
    n, k = dy.shape[1], x.shape[1]
    w = torch.nn.Parameter(torch.zeros(n, k))
    sink = tokensum.GradSink(groups or {s: Comm.single(s) for s in tokensum.SCOPES})
    sink.begin({"w": w}, late=late_sink)
    if late:
        sink._defer = lambda flagged, redo: sink._pending.append((_NotYet(), flagged, redo))
    tok = tokensum.TokenSum(Comm.single("tokens"), sink=sink)
    lefts = []
    real_carry, real_redo = tgw.carry_grad_weight_deferred, tgw.redo_into_digits_

    def carry(words, a, b, **kw):
        launches, flagged = real_carry(words, a, b, tile=SMALL, force_flag=force_flag, **kw)
        lefts.append(len(tgw.flagged_tiles(launches)))
        return launches, flagged
    tgw.carry_grad_weight_deferred = carry
    tgw.redo_into_digits_ = lambda acc, a, b, left: real_redo(acc, a, b, left, tile=SMALL)
    try:
        bounds = [0, *cuts, dy.shape[0]]
        for a, b in zip(bounds, bounds[1:]):     # kernels/matmul.py grad_weight's CUDA path
            if not mm._carry_words(dy[a:b], x[a:b], w, tok):
                lefts.append("digits")
                tgw.accumulate_grad_weight_(tok.accumulator(w), dy[a:b], x[a:b], tile=SMALL)
        sink._resolve(0)    # flags read late (GradSink._defer) land before finish's listing
    finally:
        tgw.carry_grad_weight_deferred, tgw.redo_into_digits_ = real_carry, real_redo
    digits = sorted(sink._acc)
    if late_sink:
        assert not sink._pending, "a late sink queued a deferred chunk"
        flagged = sink.late_flagged()
        return None if flagged else sink.finish()["w"], digits, lefts, flagged
    return sink.finish()["w"], digits, lefts


@check
def carried_words_over_microbatches_equal_the_digit_path():
    """A persistent sink over 8 leaves cut into calls of 3, 1 and 4 leaves (microbatches): the
    words carried from call to call (kernels/triton_grad_weight.py carry_grad_weight_deferred) round to
    the digit reference's bytes, with element (3, 5)'s partials 1, 2**-24 (first call) and
    2**-80 (second: an inexact add, the checked retry from the carried words) — whose exact sum
    rounds up to 1 + 2**-23 while dropping the error rounds to 1.0 (the control) — and no
    weight moved to digits; so with one call and with eight; and with a two-rank scope group
    (finish adds the words to digits before the integer sum)."""
    dy, x = _operands(8, 40, 24, 4, seed=1)
    _plant(dy, x, 3, 5, [1.0, 0.0, 0.0, 2.0**-24, 2.0**-80])
    want = fx.round_fp32(_reference(dy, x))
    assert want[3, 5].item() == 1.0 + 2.0**-23 and _naive64(dy, x)[3, 5].item() == 1.0
    want = want.view(torch.int32)
    for cuts in ([3 * TOKEN_LEAF, 4 * TOKEN_LEAF], [], [i * TOKEN_LEAF for i in range(1, 8)]):
        with LaunchRecorder.swapped_in(tgw, "_dw_kernel") as rec:
            got, digits, lefts = _carried(dy, x, cuts)
        assert digits == [] and set(lefts) == {0}, (cuts, digits, lefts)
        assert torch.equal(got.view(torch.int32), want), cuts
        modes = [(kw["CARRY"], kw["RETRY"]) for _, kw in rec.launches]
        assert set(modes) == {(True, False), (True, True)}, modes   # the retry carried, too
    pair = {"dp_cp": _PairComm(), "world": Comm.single("world")}
    got, digits, _ = _carried(dy, x, [3 * TOKEN_LEAF], groups=pair)
    assert digits == [] and torch.equal(got.view(torch.int32), want)


@check
def carried_first_pass_flags_no_tile_where_every_add_is_exact():
    """Narrow leaf scales (no inexact add), the words carried over two calls of 3 leaves: the
    second call's first pass (CARRY, not RETRY) continues the nonzero words with no tile
    flagged, its count is 0 and the words == one call over all 6 leaves. A first pass that
    misread its carried words (the thirty-fourth session's scaled words read unscaled) flags
    every tile, and the every-tile retry redoes them from the stored words — the same bytes,
    so only the first pass's flags show it."""
    dy, x = _operands(6, 40, 24, 4, seed=0)
    a, b = tgw._operands(dy, x)
    whole, whole_flags = tgw._double_words(a, b, SMALL, False)
    cut = 3 * TOKEN_LEAF
    words, flags = tgw._double_words(a[:cut], b[:cut], SMALL, False)
    assert not bool(whole_flags.any()) and not bool(flags.any())
    assert bool((words[0] != 0).all(-1).any())          # nonzero carried words in every tile row
    first_flags = []
    real = tgw._launch

    def spy(*args, **kw):
        real(*args, **kw)
        if kw.get("carry") and not (kw.get("retry") or kw.get("retry_all")):
            first_flags.append(args[3].clone())         # flags as the first pass left them
    tgw._launch = spy
    try:
        _, left = tgw.carry_grad_weight_deferred(words, dy[cut:], x[cut:], tile=SMALL)
    finally:
        tgw._launch = real
    assert len(first_flags) == 1 and first_flags[0].tolist() == [0] * flags.numel(), first_flags
    assert int(left) == 0 and torch.equal(words, whole)


@check
def carried_words_move_to_digits_where_a_tile_cannot_hold_its_sum():
    """Element (37, 21)'s partials 2**100, 1.5·2**46, 2**-100 in three calls: no double word
    holds their sum, so the third call leaves that tile (its words untouched), the weight moves
    to digits (the words added there) and the tile's partials of that call are added by the
    EMIT path; later calls go to the digits. Bytes == the digit reference; with every tile
    forced through that path from the first call, too."""
    dy, x, want = _unholdable(6)
    got, digits, lefts = _carried(dy, x, [TOKEN_LEAF, 2 * TOKEN_LEAF, 4 * TOKEN_LEAF])
    assert digits == ["w"] and lefts[:2] == [0, 0] and lefts[2] >= 1, lefts
    assert lefts[3:] == ["digits"], lefts
    assert torch.equal(got.view(torch.int32), want)
    got, digits, lefts = _carried(dy, x, [2 * TOKEN_LEAF], force_flag=True)
    assert digits == ["w"] and lefts == [1, "digits"], lefts
    assert torch.equal(got.view(torch.int32), want)


@check
def carried_words_flags_read_late_give_the_same_bytes():
    """As above with every flag count read only at the end (a busy GPU queue: the sink's
    deferred chunks): the calls after the flagged one continue the words, the flagged tile's
    partials of its call are added to digits when its count is read; the same bytes."""
    dy, x, want = _unholdable(6)
    got, digits, lefts = _carried(dy, x, [TOKEN_LEAF, 2 * TOKEN_LEAF, 4 * TOKEN_LEAF], late=True)
    assert digits == ["w"] and lefts[:2] == [0, 0] and lefts[2] >= 1, lefts
    assert "digits" not in lefts, lefts
    assert torch.equal(got.view(torch.int32), want)


@check
def carried_words_in_a_late_sink_count_the_tile_for_a_second_pass():
    """The trainer's first pass (a late sink): the kernel counts the tile that cannot hold its
    sum into the sink's late tile counter and nothing is deferred or moved to digits, so
    late_flagged says to run the mini-batch again; the clean operands of the first check flag
    nothing in a late sink and finish with the digit reference's bytes. Control: the same
    unholdable operands in a sink that is not late move w to digits instead."""
    dy, x, _ = _unholdable(6)
    cuts = [TOKEN_LEAF, 2 * TOKEN_LEAF, 4 * TOKEN_LEAF]
    _, digits, lefts, flagged = _carried(dy, x, cuts, late_sink=True)
    assert flagged and digits == [] and lefts[2] >= 1 and "digits" not in lefts, lefts
    assert _carried(dy, x, cuts)[1] == ["w"]                  # control: eager moves to digits
    dy, x = _operands(8, 40, 24, 4, seed=1)
    got, digits, lefts, flagged = _carried(dy, x, [3 * TOKEN_LEAF], late_sink=True)
    assert not flagged and digits == [] and set(lefts) == {0}
    assert torch.equal(got.view(torch.int32), fx.round_fp32(_reference(dy, x)).view(torch.int32))


@check
def carried_words_count_the_flags_of_every_launch():
    """OUT_ELEMS lowered to four launches of one tile row (N = 50): the element whose tile
    cannot hold its sum (row 37) lies in the third launch, not the last; the flag count that
    carry_grad_weight_deferred leaves on the device must add every launch's flags (one counting
    only the last launch's would be 0, the redo skipped and that tile's partials of the third
    call lost). The weight moves to digits; bytes == the digit reference."""
    dy, x, want = _unholdable(6)
    real = tgw.OUT_ELEMS
    try:
        tgw.OUT_ELEMS = 16 * 40
        got, digits, lefts = _carried(dy, x, [TOKEN_LEAF, 2 * TOKEN_LEAF, 4 * TOKEN_LEAF])
    finally:
        tgw.OUT_ELEMS = real
    assert digits == ["w"] and lefts[:2] == [0, 0] and lefts[2] == 1, lefts
    assert torch.equal(got.view(torch.int32), want)


@check
def carried_words_of_a_split_weight_join_its_rows_at_finish():
    """A kept (tied) weight split in a persistent sink (rows 3, 17, 30 noted): its dense use
    carries the double words over two calls (kernels/matmul.py `_carry_words`, no digits), the
    sparse use adds its own partials into the split accumulator of those rows, and finish adds
    the words' sums of exactly those rows (GradSink._held_rows from words) before rounding them:
    bytes == the digit reference with the sparse partials added to those rows. Controls: the
    dense part alone and the sparse part alone differ on those rows."""
    dy, x = _operands(4, 40, 24, 4, seed=3)
    rows = torch.tensor([3, 17, 30])
    extra = _operands(1, 3 * 24, 1, 4, seed=4)[0][:1].view(1, 3, 24)   # sparse partials
    w = torch.nn.Parameter(torch.zeros(40, 24))
    sink = tokensum.GradSink({s: Comm.single(s) for s in tokensum.SCOPES})
    sink.begin({"w": w}, keep={"w"})
    tok = tokensum.TokenSum(Comm.single("tokens"), sink=sink)
    sink.note_rows(w, rows.flip(0), 0, "dp_cp")
    real = tgw.carry_grad_weight_deferred
    tgw.carry_grad_weight_deferred = lambda words, a, b, **kw: real(words, a, b, tile=SMALL, **kw)
    try:
        for a, b in ((0, TOKEN_LEAF), (TOKEN_LEAF, 4 * TOKEN_LEAF)):
            assert mm._carry_words(dy[a:b], x[a:b], w, tok)
    finally:
        tgw.carry_grad_weight_deferred = real
    assert sink.add_split_rows(w, lambda r, acc: (r.tolist() == rows.tolist()
                                                   and fx.accumulate_(acc, extra)))
    assert sorted(sink._words) == ["w"] and sink._acc == {}
    got = sink.finish()["w"].view(torch.int32)
    ref = _reference(dy, x)
    dense = fx.round_fp32(ref).view(torch.int32)
    sub = ref[rows].contiguous()
    fx.accumulate_(sub, extra)
    ref[rows] = sub
    want = fx.round_fp32(ref).view(torch.int32)
    assert torch.equal(got, want)
    assert (dense[rows] != want[rows]).any(1).all(), "control: the sparse part changes each row"
    assert not torch.equal(fx.round_fp32(fx.accumulate_(fx.zeros((3, 24)), extra)).view(
        torch.int32), want[rows]), "control: the dense part matters"


@check
def carried_words_refuse_bad_words():
    dy, x = _operands(2, 8, 8, 1, seed=9)
    for words in (torch.zeros(2, 8, 8), torch.zeros(2, 8, 9, dtype=torch.float64),
                  torch.zeros(2, 8, 16, dtype=torch.float64)[:, :, :8]):
        try:
            tgw.carry_grad_weight_deferred(words, dy, x)
        except ValueError:
            continue
        raise AssertionError(f"accepted words {words.dtype} {tuple(words.shape)}")


@check
def bad_arguments_are_refused():
    dy, x = _operands(2, 8, 8, 1, seed=9)
    for acc, a, b in ((fx.zeros((8, 8)), dy[:-1], x[:-1]), (fx.zeros((8, 9)), dy, x),
                      (fx.zeros((8, 8))[:, ::1, :-1], dy, x), (fx.zeros((8, 8)), dy, x[:16])):
        try:
            tgw.accumulate_grad_weight_(acc, a, b)
        except ValueError:
            continue
        raise AssertionError(f"accepted acc {tuple(acc.shape)} dy {tuple(a.shape)} x {tuple(b.shape)}")
    for a, b in ((dy[:-1], x[:-1]), (dy, x[:16])):
        try:
            tgw.rounded_grad_weight(a, b)
        except ValueError:
            continue
        raise AssertionError(f"rounded_grad_weight accepted dy {tuple(a.shape)} x {tuple(b.shape)}")


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
