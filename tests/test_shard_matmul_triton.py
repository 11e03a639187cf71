"""The fused virtual-TP shard tree of the linears (kernels/triton_shard_matmul.py) without a GPU:
under TRITON_INTERPRET=1 (tests/shard_matmul_triton_checks.py) it gives the unfused path's bytes
for the row-parallel forward and the column-parallel dX, for any tile; a sequential shard sum
differs (control); bad input is refused; kernels/matmul.py's linears take the fused kernel
exactly where worth_fusing says. tests/test_cuda_shard_matmul.py has the GPU's bits.
"""

from __future__ import annotations

import pytest
from kernel_helpers import NEEDS_TRITON, check_ok as _ok, checks_fixture

pytestmark = NEEDS_TRITON
results = checks_fixture("shard_matmul_triton_checks.py")


@pytest.mark.parametrize("name", ["row_parallel_equals_the_partials_tree",
                                  "column_dx_equals_the_unfused_loop",
                                  "tiles_change_no_bit",
                                  "tma_fetches_equal_pointer_loads",
                                  "random_configs_equal_the_unfused_loop",
                                  "negative_control_sequential_shard_sum_differs",
                                  "bad_input_is_refused",
                                  "flat_kernel_three_projections_of_unequal_lengths",
                                  "flat_kernel_bounds_off_zero_or_with_gaps_are_laid_end_to_end",
                                  "long_row_parallel_shards_take_the_partials_tree",
                                  "odd_bounds_are_neither_fusable_nor_worth_fusing",
                                  "model_linears_dispatch_to_the_fused_tree_where_worth_it"])
def test_shard_matmul(results, name):
    _ok(results, name)
