"""The CUDA attention backward's Triton kernels (rlkernel/kernels/triton_attention_bwd.py) under
TRITON_INTERPRET=1 (Triton on the CPU), against a float64 autograd oracle and against themselves
under batch / CP / Tq / TP / chunk changes, bitwise, with a negative control. The checks live in
tests/attention_bwd_triton_checks.py and run in one subprocess (the interpreter is chosen before
triton is imported, and must not leak into this process); each test asserts its check's result.
PTX for sm_90 compiled on the CPU: dQ's bf16 store rounds to nearest even (the interpreter
truncates, so only the PTX shows it).
On a GPU: tests/test_cuda_attention_bwd.py (the same properties with the GPU's dot orders).
Run: PYTHONPATH=. .venv/bin/python -m pytest -q tests/test_attention_bwd_triton.py (needs triton;
about 2 min).
"""

from __future__ import annotations

from kernel_helpers import NEEDS_TRITON, check_ok as _ok, checks_fixture, sm90_ptx

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


def test_cp_zigzag_ranks_in_a_late_sink_sum_the_words(results):
    """CP = 2 with a late gradient sink on each rank (the trainer's first pass): the dK/dV
    chunks go over the ranks as double words (Comm.finish_words), never as digits, also cut
    in several slices, and dK/dV == the single-process bytes on every rank, its dQ rows too;
    no late flag counted. Without a late sink every chunk goes as digits."""
    _ok(results, "cp_zigzag_ranks_in_a_late_sink_sum_the_words")


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


def test_late_sink_counts_third_tier_programs_instead_of_syncing(results):
    """A late gradient sink takes the count of third-tier programs instead of a host-side
    redo (the value is then wrong: control); the retry tier's fixes stay on the device."""
    _ok(results, "late_sink_counts_third_tier_programs_instead_of_syncing")


def test_late_sink_counts_every_third_tier_program_of_both_kinds_over_the_chunks(results):
    """Every program forced to the third tier is counted under a late sink: both kinds, every
    program, over every chunk — the number the eager run redoes on the host."""
    _ok(results, "late_sink_counts_every_third_tier_program_of_both_kinds_over_the_chunks")


def test_dkv_sums_at_the_double_word_bound_are_flagged(results):
    """With TOP_F64_BITS lowered to 2**128, a dV sum of 1.5·2**128 flags its program (and only
    it); the bytes (+Inf) equal the unflagged run's under the real bound."""
    _ok(results, "dkv_sums_at_the_double_word_bound_are_flagged")


def test_opposite_infinite_dv_partials_in_two_leaves_are_nan(results):
    """+Inf and −Inf dV partials of one element in two leaves: NaN, the first pass's program
    flagged."""
    _ok(results, "opposite_infinite_dv_partials_in_two_leaves_are_nan")


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


def test_fp32_token_major_gradients_keep_the_inputs_memory_order(results):
    """fp32 q/k/v/d_out token-major == contiguous, bitwise (dQ, dK, dV), each gradient laid out
    like its input."""
    _ok(results, "fp32_token_major_gradients_keep_the_inputs_memory_order")

def test_no_queries_give_gradients_like_the_inputs(results):
    """Tq = 0, bf16 token-major inputs: an empty dQ in q's dtype and memory order, dK and dV +0
    in k's / v's."""
    _ok(results, "no_queries_give_gradients_like_the_inputs")


def test_packed_streams_give_the_per_sample_bytes(results):
    """Packed-stream attention (each sample's rows read and written in place, NaN in every row
    no slot names): out, lse, dQ, dK, dV == the per-sample calls' bytes, +0.0 elsewhere, fp32
    and bf16, and for a CP-like query subset on its own rows; control: key rows one off differ."""
    _ok(results, "packed_streams_give_the_per_sample_bytes")



def test_packed_kernels_touch_no_row_past_the_streams_ends(results):
    """Packed streams ending at a short sample's last row, guard rows after each: the packed
    forward and backward load and store no address in the guard rows (the forward's tiles of
    empty slots alone ran its unmasked whole-block loop over keys past kv_len), with the
    per-sample bytes; control: the read of q's last row is seen."""
    _ok(results, "packed_kernels_touch_no_row_past_the_streams_ends")


def test_packed_row_maps_of_any_strides_give_the_per_sample_bytes(results):
    """q_rows / k_rows as column views of the slot maps (stride Tq): the per-sample bytes, as
    with contiguous row maps (read as contiguous they name the wrong rows)."""
    _ok(results, "packed_row_maps_of_any_strides_give_the_per_sample_bytes")


def test_packed_bad_arguments_are_refused(results):
    """The packed forward and backward refuse row maps or kv_len not [S], a 4-d q, v unlike k,
    k's head_dim unlike q's: ValueError."""
    _ok(results, "packed_bad_arguments_are_refused")


def _dq_ptx(dq: str) -> str:
    """PTX of `_dq_kernel` for sm_90 (compiled on the CPU) with bf16 q/k/v/d_out and a dQ
    pointer of type dq, as `_dq` launches it (fp fusion off, G = 1, D = 64)."""
    from rlkernel.kernels import triton_attention_bwd as tb
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "LSE": "*fp32",
            "DELTA": "*fp32", "DQ": dq, "QPOS": "*i64", "KVLEN": "*i64", "QROWS": "*i64",
            "KROWS": "*i64"}
    consts = {"G": 1, "D": 64, "BLOCK_M": 64, "BLOCK_N": tb.KV_BLOCK, "PREC": "tf32",
              "BF16": True, "PACKED": False}
    types = {n: ptrs.get(n) or ("constexpr" if n in consts else "fp32" if n == "scale"
                                else "i64" if n.startswith("s_") else "i32")
             for n in tb._dq_kernel.arg_names}
    return sm90_ptx(tb._dq_kernel, types, consts, 4, False)


def test_compiled_bf16_dq_store_rounds_to_nearest_even():
    """dQ stored in bf16 by `_dq_kernel` (the bf16 run's dQ) converts with cvt.rn.bf16.f32 —
    round to nearest even, torch's cast, which the interpreter cannot show (it truncates) —
    never a truncating or other-mode cvt: every bf16 conversion of the kernel is .rn, and the
    bf16 store adds .rn conversions to those of dS's rounding point. Control: the fp32 store
    has only dS's."""
    import re
    rn = r"cvt\.rn\.bf16(x2)?\.f32"
    bf, f32 = _dq_ptx("*bf16"), _dq_ptx("*fp32")
    for ptx in (bf, f32):
        assert not re.search(r"cvt\.r[zmp]\w*\.bf16", ptx) and ".ftz" not in ptx
    assert len(re.findall(rn, bf)) > len(re.findall(rn, f32)) > 0


def _packed_ptx(kernel, packed: bool, extra: dict | None = None) -> str:
    """PTX for sm_90 of one of the attention kernels with bf16 tensors, PACKED on or off."""
    fp32 = {"LSE", "DELTA", "OUT", "FLAGS"}
    i64 = {"QPOS", "KVLEN", "QROWS", "KROWS", "TABLE", "SLOT", "PIDS"}
    consts = {"G": 2, "D": 64, "BLOCK_M": 64, "BLOCK_N": 64, "PREC": "tf32", "BF16": True,
              "PAGED": False, "PACKED": packed, **(extra or {})}
    types = {}
    for n in kernel.arg_names:
        if n in consts:
            types[n] = "constexpr"
        elif n.isupper() and n not in ("HKV", "HQ"):
            types[n] = ("*fp32" if n in fp32 else "*i32" if n in ("FLAGS", "PIDS", "SLOT")
                        else "*i64" if n in i64 else "*bf16")
        else:
            types[n] = "fp32" if n == "scale" else "i64" if n.startswith("s_") else "i32"
    consts = {n: v for n, v in consts.items() if n in kernel.arg_names}
    return sm90_ptx(kernel, types, consts, 4, False)


def test_packed_variants_compile_for_sm90_and_read_the_row_offsets():
    """Every attention kernel with PACKED on compiles for sm_90 (the interpreter cannot show
    it) and loads more 64-bit words than with PACKED off: the samples' first rows (QROWS,
    KROWS), which the off variant never reads."""
    import re

    from rlkernel.kernels import triton_attention as ta
    from rlkernel.kernels import triton_attention_bwd as tb
    dkv = {"DT": 64, "LEAF": tb.CUDA_DKV_LEAF, "KIND": 0, "EMIT": False, "RETRY": False,
           "FORCE_FLAG": 0}
    for kernel, extra in ((ta._attn_fwd_kernel, None), (tb._delta_kernel, None),
                          (tb._dq_kernel, None), (tb._dkv_kernel, dkv)):
        on, off = (_packed_ptx(kernel, p, extra) for p in (True, False))
        loads = [len(re.findall(r"ld\.global(\.\w+)*\.[us]64|ld\.global(\.\w+)*\.b64", x))
                 for x in (on, off)]
        assert loads[0] > loads[1], (kernel.__name__, loads)
