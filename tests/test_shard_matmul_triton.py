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


def test_tma_ok_refuses_what_tma_cannot_fetch_as_the_pointer_loads_do():
    """`_tma_ok` (the shard tree's choice of TMA descriptors, on CPU tensors: no kernel runs):
    aligned contiguous bf16 and fp16 operands with K ranges cut at BLOCK_K pass; each refusal
    case breaks one condition alone — fp32 operands, a K range ending off a BLOCK_K multiple
    (TMA would fill its ragged tail from the next range), a base 2 bytes past a 16-byte
    boundary, inner stride 2, 40-byte rows — for A and for B."""
    import torch

    from rlkernel.kernels import triton_shard_matmul as tsm
    bk = 64
    ok = torch.zeros(64, 256, dtype=torch.bfloat16)
    assert ok.data_ptr() % 16 == 0, "the CPU allocator's alignment this test assumes"
    bounds = [[(0, 128)], [(128, 256)]]
    assert tsm._tma_ok(ok, ok, bounds, bk) and tsm._tma_ok(ok.half(), ok.half(), bounds, bk)
    assert not tsm._tma_ok(ok.float(), ok.float(), bounds, bk), "fp32"
    assert not tsm._tma_ok(ok, ok, [[(0, 100)], [(100, 256)]], bk), "ragged K range"
    off = torch.zeros(1 + 64 * 256, dtype=torch.bfloat16)[1:].view(64, 256)
    strided = torch.zeros(64, 512, dtype=torch.bfloat16)[:, ::2]
    narrow = torch.zeros(64, 20, dtype=torch.bfloat16)
    assert off.data_ptr() % 16 == 2 and strided.stride() == (512, 2)
    for name, t in (("base", off), ("inner stride", strided), ("rows", narrow)):
        assert not tsm._tma_aligned(t), name
        assert not tsm._tma_ok(t, ok, bounds, bk) and not tsm._tma_ok(ok, t, bounds, bk), name
