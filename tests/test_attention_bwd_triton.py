"""The CUDA attention backward's Triton kernels (rlkernel/kernels/triton_attention_bwd.py) under
TRITON_INTERPRET=1 (Triton on the CPU), against a float64 autograd oracle and against themselves
under batch / CP / Tq / TP / chunk changes, bitwise, with a negative control. The checks live in
tests/attention_bwd_triton_checks.py and run in one subprocess (the interpreter is chosen before
triton is imported, and must not leak into this process); each test asserts its check's result.
On a GPU: tests/test_cuda_attention_bwd.py (the same properties with the GPU's dot orders).
Run: PYTHONPATH=. .venv/bin/python -m pytest -q tests/test_attention_bwd_triton.py (needs triton;
about 2 min).
"""

from __future__ import annotations

from kernel_helpers import NEEDS_TRITON, check_ok as _ok, checks_fixture

pytestmark = NEEDS_TRITON
results = checks_fixture("attention_bwd_triton_checks.py")


def test_packed_batch_vs_float64(results):
    """3 packed samples with NaN padding: dQ/dK/dV within 1e-5·max|ref| of float64 autograd;
    padding query rows and key slots past kv_len are +0.0."""
    _ok(results, "packed_batch_vs_float64")


def test_kv_len_below_positions_and_cp_offset_layout_vs_float64(results):
    """kv_len below the query positions (NaN keys past it); a layout whose slot t holds position
    40 + t with a missing leaf: within 1e-5·max|ref| of float64."""
    _ok(results, "kv_len_below_positions_and_cp_offset_layout_vs_float64")


def test_leaf_whose_last_query_is_a_tile_first_key_vs_float64(results):
    """A leaf whose only query that sees a key tile sits at the tile's first key (a 129-token
    sample; kv_len 65 under 80 queries): within 1e-5·max|ref| of float64."""
    _ok(results, "leaf_whose_last_query_is_a_tile_first_key_vs_float64")


def test_sample_alone_equals_sample_in_batch(results):
    """A sample's dQ/dK/dV alone (exact length) == its rows in the padded batch, bitwise."""
    _ok(results, "sample_alone_equals_sample_in_batch")


def test_cp_zigzag_ranks_give_single_process_bytes(results):
    """CP = 2 zig-zag query leaves, exact sums joined over the CP group: dK/dV and the ranks' dQ
    rows == single-process bytes; control: adding the ranks' rounded dK in fp32 differs."""
    _ok(results, "cp_zigzag_ranks_give_single_process_bytes")


def test_tq_split_into_two_calls_gives_the_full_bytes(results):
    """Queries split over two calls of other Tq (chunked-prefill layout): the full call's bytes."""
    _ok(results, "tq_split_into_two_calls_gives_the_full_bytes")


def test_kv_head_replicated_over_tp_ranks_gives_single_process_bytes(results):
    """6 query heads on one KV head split 3 + 3 over two TP ranks (kv_comm): single-process
    dK/dV bytes, each rank's dQ rows."""
    _ok(results, "kv_head_replicated_over_tp_ranks_gives_single_process_bytes")


def test_chunk_sizes_tiles_and_the_fallback_change_no_bit(results):
    """Sample/key chunks of the double words, key/column tiles, and every dK/dV program through
    the per-leaf fallback (force_flag): same bytes."""
    _ok(results, "chunk_sizes_tiles_and_the_fallback_change_no_bit")


def test_key_slots_past_every_kv_len_round_to_plus_zero_in_any_chunking(results):
    """Key slots past every kv_len: +0.0, and the other slots' bytes, whether the words are
    rounded straight into the result or copied chunk by chunk."""
    _ok(results, "key_slots_past_every_kv_len_round_to_plus_zero_in_any_chunking")


def test_decode_row_dq_equals_prefill_row(results):
    """A query alone against a NaN-padded KV cache has its prefill row's dQ bytes."""
    _ok(results, "decode_row_dq_equals_prefill_row")


def test_dkv_is_the_exact_sum_of_leaf_partials_negative_control_fp32_order(results):
    """dK/dV == exact sum of the kernel's leaf partials (any leaf order) + head tree; control:
    fp32 sums of the partials in two leaf orders differ."""
    _ok(results, "dkv_is_the_exact_sum_of_leaf_partials_negative_control_fp32_order")


def test_bf16_packed_batch_vs_float64_and_alone_equals_in_batch(results):
    """bf16 inputs: within 2e-2 relative norm of float64; a sample alone == in the batch."""
    _ok(results, "bf16_packed_batch_vs_float64_and_alone_equals_in_batch")


def test_summation_orders_with_a_sequential_dot(results):
    """tl.dot made a multiply-add chain (K ascending): dQ == one chain over keys ascending across
    blocks, dK/dV == per-leaf chains in position order, added exactly, halving tree over 4 heads,
    dK·scale last (scale 0.3), bitwise, also with one-block chunks; p = 1 exactly (q or k zero,
    lse 0). Controls: the chains reversed differ."""
    _ok(results, "summation_orders_with_a_sequential_dot")


def test_bf16_rounding_points_of_p_and_ds_with_a_sequential_dot(results):
    """bf16 with a sequential dot and p exact or constant: dQ, dK, dV == sums rebuilt with P
    rounded to bf16 before P·dO and dS before dS·K and dSᵀ·Q, bitwise; controls: unrounded
    differs."""
    _ok(results, "bf16_rounding_points_of_p_and_ds_with_a_sequential_dot")


def test_keys_past_kv_len_stay_out_of_dq_where_exp_overflows(results):
    """kv_len below the positions with scores near −100 (exp(0 − lse) = Inf for a key loaded as
    0): finite gradients within 1e-4·max|ref| of float64."""
    _ok(results, "keys_past_kv_len_stay_out_of_dq_where_exp_overflows")


def test_dv_rounds_the_exact_sum_through_lo_and_the_flagged_fallback(results):
    """Planted dV leaf partials through the three tiers: exact in the first pass's one word;
    flagged there and kept exactly in the retry's (hi, lo); flagged by an inexact lo addition
    too, so its program (only it) takes the per-leaf fallback. The sums just past an fp32 tie
    round up, as the first pass's word, hi + lo in float64 or a dropped lo check would not."""
    _ok(results, "dv_rounds_the_exact_sum_through_lo_and_the_flagged_fallback")


def test_dkv_sums_at_the_double_word_bound_are_flagged(results):
    """With TOP_F64_BITS lowered to 2**128, a dV sum of 1.5·2**128 flags its program (and only
    it); the bytes (+Inf) equal the unflagged run's under the real bound."""
    _ok(results, "dkv_sums_at_the_double_word_bound_are_flagged")


def test_bad_arguments_are_refused(results):
    """fp16, heads not a multiple of the KV heads, a wrong lse shape: ValueError."""
    _ok(results, "bad_arguments_are_refused")


def test_fp32_d_out_is_read_at_the_bf16_rounding_point(results):
    """bf16 q/k/v, an fp32 d_out whose extra bits every rounding drops: the bytes of the bf16
    d_out (delta reads dO at its rounding point too); control: the extra bits are real."""
    _ok(results, "fp32_d_out_is_read_at_the_bf16_rounding_point")


def test_token_major_layout_and_the_bf16_store_change_no_bit(results):
    """bf16 q/k/v/d_out token-major in memory == contiguous, bitwise (out, dQ, dK, dV), out
    token-major and each gradient laid out like its input; dQ rounded by the kernel's store ==
    the fp32 dQ through Triton's conversion; control: the fp32 dQ differs from its rounding."""
    _ok(results, "token_major_layout_and_the_bf16_store_change_no_bit")
