"""The checks behind tests/test_shard_sum_triton.py, under TRITON_INTERPRET=1: the one-pass
virtual-shard sum (kernels/triton_matmul.shard_tree_sum) == numerics.trees.tree_sum(p, 0), as
int32 bits (NaN positions only). Prints {check: "ok" or the failure}. Run by hand:
TRITON_INTERPRET=1 .venv/bin/python tests/shard_sum_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import sys

import torch

from kernel_helpers import interpreted_checks, run_checks

CHECKS, check = interpreted_checks(__file__)

import triton_interpreter_compat  # noqa: F401 - numpy >= 2.3: before any launch

from rlkernel.kernels import triton_matmul as tm
from rlkernel.numerics.trees import tree_sum


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.isnan() & b.isnan()
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | nan).all())


def _partials(s: int, m: int, n: int, g: torch.Generator) -> torch.Tensor:
    """Partials spanning 2**±60 with cancellation, ±0, ±inf and NaN sprinkled in."""
    p = torch.randn(s, m, n, generator=g) * 2.0 ** torch.randint(-60, 60, (s, m, n), generator=g)
    p[0, 0, :3] = torch.tensor([0.0, -0.0, float("inf")])
    p[-1, 0, :3] = torch.tensor([-0.0, -0.0, float("-inf")])
    p[-1, 1, 0] = float("nan")
    p[0, 1, 1] = float("inf")
    p[:, 2, 0] = torch.tensor([1.0, -1.0] * (s // 2) if s > 1 else [1.0])
    return p


@check
def one_pass_equals_tree_sum():
    """S = 1, 2, 4, 8, 16, 64; M·N not a multiple of the block (rows 3..37)."""
    g = torch.Generator().manual_seed(0)
    for s in (1, 2, 4, 8, 16, 64):
        for m, n in ((3, 5), (37, 129), (8, 1024)):
            p = _partials(s, m, n, g)
            assert _same(tm.shard_tree_sum(p), tree_sum(p, 0)), (s, m, n)


@check
def negative_control_sequential_sum_differs():
    """A left-to-right sum of the 8 partials gives other bits on some elements."""
    g = torch.Generator().manual_seed(1)
    p = torch.randn(8, 64, 64, generator=g)
    seq = p[0].clone()
    for i in range(1, 8):
        seq = seq + p[i]
    assert not _same(tm.shard_tree_sum(p), seq)


@check
def bad_input_is_refused():
    for p in (torch.randn(3, 4, 4), torch.randn(8, 4, 4).double(), torch.randn(128, 2, 2)):
        try:
            tm.shard_tree_sum(p)
        except ValueError:
            continue
        raise AssertionError(f"accepted {p.dtype} {tuple(p.shape)}")


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
