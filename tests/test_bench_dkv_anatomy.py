"""benchmarks/bench_dkv_anatomy.py's variants still apply to the production attention backward:
each substitution occurs exactly once in rlkernel/kernels/triton_attention_bwd.py's source
(a kernel edit that moves one of its lines fails here, not on the GPU), and each variant module
imports with the change in it. The timing itself needs a GPU (docs/BENCHMARKS.md)."""

from __future__ import annotations

import inspect

from kernel_helpers import NEEDS_TRITON

pytestmark = NEEDS_TRITON


def test_every_variant_changes_exactly_its_lines_and_imports(tmp_path):
    from benchmarks import bench_dkv_anatomy as ba
    from rlkernel.kernels import triton_attention_bwd as tb
    src = inspect.getsource(tb)
    assert set(ba.VARIANTS) == {"full", "cvt_add", "mma", "leaf128", "leaf128_w8", "asm_check"}
    for name, (subs, _) in ba.VARIANTS.items():
        for old, _new in subs:
            assert src.count(old) == 1, (name, old)
        mod = ba._variant_module(name, subs, tmp_path)
        body = inspect.getsource(mod)
        for old, new in subs:
            assert new in body and (old not in body or old in new), (name, old)
        assert mod.CUDA_DKV_LEAF == (128 if name.startswith("leaf128") else tb.CUDA_DKV_LEAF)
        assert callable(mod.attention_backward)
