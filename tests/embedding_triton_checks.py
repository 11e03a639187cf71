"""The check behind test_kernels_embedding.py's interpreter test, run in a subprocess with
TRITON_INTERPRET=1: the CUDA path of the embedding gradient — kernels/embedding.leaf_partials,
then the segmented exact-sum kernel (triton_fixedpoint.accumulate_segments_) — against the dense
algorithm it replaced (the oracle copy in test_kernels_embedding.py) and the CPU path, with
torch.equal on the int64 accumulators. Only the interpreter runs it here: no GPU was used.
Prints one JSON object {check name: "ok" or the failure}. Run by hand:
TRITON_INTERPRET=1 .venv/bin/python tests/embedding_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import sys
import warnings

import torch

from kernel_helpers import interpreted_checks, randn, run_checks

CHECKS, check = interpreted_checks(__file__)

import triton_interpreter_compat  # noqa: F401 - numpy >= 2.3: before any launch
from test_kernels_embedding import CASES, _dense_accumulate, _stream

from rlkernel.kernels.embedding import accumulate_embedding_grad_, leaf_partials
from rlkernel.numerics import fixedpoint as fx
from rlkernel.numerics import triton_fixedpoint as tfx

# numpy warns on the interpreter's float ops with NaN/Inf inputs (the kernel counts those values
# and never adds them), so the warning says nothing about the result.
warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)


@check
def leaf_partial_segments_equal_the_dense_algorithm():
    """For every case of test_kernels_embedding (repeats in a leaf, one id in every leaf, a TP
    shard, a padding id, one leaf, wide magnitudes with NaN/±Inf, which take the bins; H = 6):
    the kernel's accumulator from zero == the dense algorithm's."""
    for case in CASES:
        ids, dy, vocab, offset = _stream(case, seed=80)
        want = _dense_accumulate(fx.zeros((vocab, dy.shape[1])), ids, dy, offset)
        got = tfx.accumulate_segments_(fx.zeros((vocab, dy.shape[1])),
                                       *leaf_partials(ids, dy, offset, vocab))
        assert torch.equal(got, want), case


@check
def leaf_partial_segments_onto_an_accumulator_over_column_blocks():
    """The TP-shard case with H = 140 at BLOCK 64 (two column blocks and a tail per segment):
    from zero == the dense algorithm; onto an accumulator holding non-normalised digits == the
    CPU path (accumulate_embedding_grad_ on CPU tensors)."""
    ids, _, vocab, offset = _stream("tp shard", seed=82)
    dy = randn(ids.numel(), 140, seed=83)
    segments = leaf_partials(ids, dy, offset, vocab)
    got = tfx.accumulate_segments_(fx.zeros((vocab, 140)), *segments, block=64, num_warps=2)
    assert torch.equal(got, _dense_accumulate(fx.zeros((vocab, 140)), ids, dy, offset))
    acc0 = fx.accumulate_(fx.zeros((vocab, 140)), randn(2, vocab, 140, seed=81))
    acc0 = acc0 + acc0                                          # digits not normalised
    got = tfx.accumulate_segments_(acc0.clone(), *segments, block=64, num_warps=2)
    assert torch.equal(got, accumulate_embedding_grad_(acc0.clone(), ids, dy, offset))

if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
