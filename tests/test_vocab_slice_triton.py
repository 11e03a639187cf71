"""The vocab-parallel LM head's Triton kernels on a TP rank's vocab slice, without a GPU: under
TRITON_INTERPRET=1 (Triton on the CPU), the fused statistics (`triton_logprobs.
linear_shard_stats`) and the d-logits pass (`triton_dlogits.dlogits`) given a slice's local
targets and live column count (`logprobs._vocab_slice`) give, concatenated over TP 2/4/8 ranks,
the full vocabulary's bytes — with a padded vocabulary's live bound inside a slice and past
whole slices — and a negative control. The checks live in tests/vocab_slice_triton_checks.py
and run in one subprocess (the interpreter is chosen before triton is imported).
On a GPU: tests/test_cuda.py -k vocab_parallel_fused (end to end, the GPU's dot order).
Run: PYTHONPATH=. .venv/bin/python -m pytest -q tests/test_vocab_slice_triton.py (needs triton;
about 20 s).
"""

from __future__ import annotations

from kernel_helpers import NEEDS_TRITON, check_ok as _ok, checks_fixture

pytestmark = NEEDS_TRITON
results = checks_fixture("vocab_slice_triton_checks.py")


def test_stats_of_vocab_slices_are_the_full_vocabularys(results):
    """m, s, t of the ranks' slices concatenated == the full vocabulary's; z_target from the
    owner only (−inf elsewhere); a dead slice gives (−inf, 0, 0); fp32 and bf16 operands."""
    _ok(results, "stats_of_vocab_slices_are_the_full_vocabularys")


def test_dlogits_of_vocab_slices_are_the_full_vocabularys(results):
    """The ranks' d-logits slices concatenated == the full d-logits, fp32 / bf16, with and
    without the entropy term."""
    _ok(results, "dlogits_of_vocab_slices_are_the_full_vocabularys")


def test_negative_control_global_targets_on_a_slice_differ(results):
    """Global targets on a slice (offset forgotten), or a slice's columns all live past a padded
    vocabulary's end: the bytes differ."""
    _ok(results, "negative_control_global_targets_on_a_slice_differ")


def test_fused_stats_kernel_does_not_spill_as_launched():
    """ptxas (sm_90a) of `_linear_stats_kernel` as `linear_shard_stats` launches it for a
    qwen3-1.7b LM head in bf16 (16,384 tokens, hidden 2048, vocab 151,936 in 8 shards, tile
    LINEAR_STATS_TILES[bf16]): no spills. (With the target's z picked after the chunk's
    statistics, z's tile lived on past them: 56 bytes of spill stores a thread at 255
    registers.)"""
    import torch
    from kernel_helpers import FakeTensor, sm90_registers

    from rlkernel.kernels import triton_logprobs as tlp
    from rlkernel.kernels.triton_matmul import BLOCK_K

    n, k, v, shards, live = 16384, 2048, 151936, 8, 151669
    br, warps, stages = tlp.LINEAR_STATS_TILES[torch.bfloat16]
    f32 = torch.float32
    args = [FakeTensor(torch.bfloat16), FakeTensor(torch.bfloat16), FakeTensor(torch.int64),
            *[FakeTensor(f32) for _ in range(4)], n, k, v // shards, live, k, 1, k, 1, 1.0]
    kw = dict(BR=br, C=tlp.VOCAB_CHUNK, LOG_C=tlp._LOG_CHUNK, BLOCK_K=BLOCK_K[torch.bfloat16],
              PREC="tf32", num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    regs, spill = sm90_registers(tlp._linear_stats_kernel, args, kw)
    assert spill == 0, (regs, spill)
