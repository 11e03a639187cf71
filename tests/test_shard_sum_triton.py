"""The row-parallel linears' one-pass virtual-shard sum (kernels/triton_matmul.shard_tree_sum)
without a GPU: under TRITON_INTERPRET=1 (tests/shard_sum_triton_checks.py) it equals
numerics.trees.tree_sum(p, 0) bitwise for S = 1 … 64 and ragged sizes, a sequential sum differs
(control), bad input is refused. On a GPU the linears' tests (tests/test_cuda.py) cover it.
"""

from __future__ import annotations


import pytest
from kernel_helpers import NEEDS_TRITON, check_ok as _ok, checks_fixture

pytestmark = NEEDS_TRITON
results = checks_fixture("shard_sum_triton_checks.py")


@pytest.mark.parametrize("name", ["one_pass_equals_tree_sum",
                                  "negative_control_sequential_sum_differs",
                                  "bad_input_is_refused"])
def test_shard_sum(results, name):
    _ok(results, name)
