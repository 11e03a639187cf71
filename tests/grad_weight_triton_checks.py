"""The checks behind tests/test_grad_weight_triton.py, run in a subprocess with TRITON_INTERPRET=1:
the fused dW kernel (rlkernel/kernels/triton_grad_weight.py) must leave the accumulator bytewise
equal to the reference path (kernels/matmul.py `token_leaf_partials` on CPU + fixedpoint's torch
`accumulate_`), and so round to the same fp32 gradient.

The interpreter's dot is numpy's matmul (no defined order), so the operands are chosen so that every
leaf dot is exact in fp32 in any order: small integers times a power of two that is constant
within a leaf (the scale varies from leaf to leaf, which is what the exactness logic is about).
What is checked is the kernel's logic — TwoSum into (hi, lo), the fp32 cut, the flag, the EMIT
recompute of flagged tiles, edge tiles, a non-zero starting accumulator — not the GPU's
tensor-core bits (tests/test_cuda_grad_weight.py does that).
Prints one JSON object {check name: "ok" or the failure}.
Run by hand: TRITON_INTERPRET=1 .venv/bin/python tests/grad_weight_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("grad_weight_triton_checks.py needs TRITON_INTERPRET=1")

import triton_interpreter_compat  # noqa: F401 - numpy >= 2.3: before any launch
from kernel_helpers import run_checks

from rlkernel.kernels import matmul as mm
from rlkernel.kernels import triton_grad_weight as tgw
from rlkernel.numerics import fixedpoint as fx
from rlkernel.spec import TOKEN_LEAF

CHECKS = {}
SMALL = (16, 16, 1, 1)     # interpreter tile: few programs, fast


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


@check
def wide_range_is_exact_through_the_lo_word():
    """Element (3, 5) gets leaf partials 1, 2**-24, 2**-80 (exact sum 1 + 2**-24 + 2**-80 rounds
    up to 1 + 2**-23; in float64 the 2**-80 is lost and the tie rounds to 1.0): exact without a
    recompute, through the lo word; the naive float64 sum gives other bytes there (the control:
    a kernel that dropped lo would fail this check). Other elements span up to ~2**90."""
    dy, x = _operands(8, 40, 24, 20, seed=1)
    _plant(dy, x, 3, 5, [1.0, 2.0**-24, 2.0**-80])
    assert _same(dy, x) == 0
    want = fx.round_fp32(_reference(dy, x))
    assert want[3, 5].item() == 1.0 + 2.0**-23
    assert _naive64(dy, x)[3, 5].item() == 1.0, "control: the naive float64 sum is not wrong here"


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
def sums_past_the_fp32_range_stay_exact():
    """Partials near the fp32 maximum whose exact sum is 2**129: the double word and the digits
    hold it (no recompute); it rounds to +Inf as the reference does."""
    dy = torch.full((4 * TOKEN_LEAF, 17), 2.0**62)
    x = torch.full((4 * TOKEN_LEAF, 19), 2.0**61)
    assert _same(dy, x) == 0
    assert torch.isinf(fx.round_fp32(_reference(dy, x))).all()


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


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
