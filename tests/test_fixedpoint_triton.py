"""The CUDA kernel of exact fixed-point accumulation (rlkernel/numerics/triton_fixedpoint.py)
under TRITON_INTERPRET=1 (Triton on the CPU): its accumulator == the torch path's
(fixedpoint.accumulate_ on CPU, the reference), bytewise (torch.equal on the int64 columns, after
both normalise), for every case below. The checks live in tests/fixedpoint_triton_checks.py and
run in one subprocess (the interpreter is chosen before triton is imported, and must not leak into
this process); each test asserts its check's result. On a GPU: tests/test_cuda.py.
Run: .venv/bin/python -m pytest -q tests/test_fixedpoint_triton.py (needs triton installed; the
k > 2**13 check is marked slow: add -m slow).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs triton (interpreter)")

_CHECKS = Path(__file__).with_name("fixedpoint_triton_checks.py")


def _run(*names: str) -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(_CHECKS.parent.parent),
                                                       os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, str(_CHECKS), *names], env=env, capture_output=True,
                       text=True, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    return _run()


def _ok(results: dict[str, str], name: str) -> None:
    assert results.get(name) == "ok", results.get(name, f"check {name} did not run")


def test_constants_match_the_torch_path(results):
    """N_COLS, N_DIGITS and the flush length SEG == fixedpoint's N_COLS, N_DIGITS, _BIN_ROWS."""
    _ok(results, "n_cols_match")


def test_every_exponent_bin_subnormals_and_signed_zeros(results):
    """kernel == torch for x [64, 260], column j around 2**(j − 140): subnormals up to 2**119,
    so every float64 bin and all ten digits are used; +0.0 and −0.0 columns."""
    _ok(results, "every_exponent_bin")


def test_random_bit_patterns(results):
    """kernel == torch for 96 x 200 uniformly random fp32 bit patterns (NaN payloads, ±Inf,
    subnormals, both signs)."""
    _ok(results, "random_bit_patterns")


def test_nan_and_infinities_are_counted_per_value(results):
    """kernel == torch, and the flag columns count values: Inf twice, +Inf with −Inf in one
    element, NaN beside finite values, fp32-max values beside an Inf kept in the digits."""
    _ok(results, "nonfinite_values")


def test_nonfinite_counts_add_over_flushes_and_calls(results):
    """kernel == torch when NaN/±Inf sit in several 8-row flushes and the accumulator already
    holds counts: each flush adds its counts to the row's (bytes, and the expected counts)."""
    _ok(results, "nonfinite_counts_add_over_flushes_and_calls")


def test_one_row(results):
    """kernel == torch for k = 1."""
    _ok(results, "one_row")


def test_several_bin_flushes(results):
    """kernel == torch for k = 2·64 + 37 rows flushed every 64 rows (seg=64): two flushes into
    the accumulator row, then a tail shorter than the unroll."""
    _ok(results, "more_rows_than_a_short_bin_flush")


@pytest.mark.slow
def test_more_rows_than_one_bin_flush():
    """kernel == torch for k = 2·2**13 + 37 rows at the real flush length, with bin sums next to
    the 2**52-unit exactness bound (about a minute under the interpreter)."""
    _ok(_run("more_rows_than_a_bin_flush"), "more_rows_than_a_bin_flush")


def test_non_contiguous_values(results):
    """kernel == torch for x with strides (1, k) and for a slice with strides (3·cols, 2)."""
    _ok(results, "non_contiguous_values")


def test_accumulator_that_already_holds_values(results):
    """kernel == torch when acc already holds a negative sum (top digit < 0), and when its
    digits are not normalised (a sum of three accumulators)."""
    _ok(results, "accumulator_that_already_holds_values")


def test_many_calls_in_sequence(results):
    """After each of 5 calls (k = 1, 9, 33, 2, 17) kernel acc == torch acc; and the 5 calls ==
    one call on their concatenation."""
    _ok(results, "many_calls_in_sequence")


def test_launch_shape_changes_no_bit(results):
    """BLOCK 32 / 128 / 256 and an 8-row flush give the same bytes."""
    _ok(results, "launch_shape_changes_no_bit")


def test_reversed_rows_same_bytes_negative_control_fp32_sum_differs(results):
    """kernel(x reversed) == kernel(x) == torch(x); negative control: torch.sum in fp32 of the
    same rows reversed changes bytes (so an order-dependent kernel would fail the equality)."""
    _ok(results, "order_changes_no_bit_but_changes_fp32_sums")


def test_bad_arguments_are_refused(results):
    """Shape mismatch, float64 values, a float or a non-contiguous accumulator: ValueError."""
    _ok(results, "bad_arguments_are_refused")
