"""Rollout invariance, bitwise, with stock-path negative controls.

Chain: (a) a sample's tokens and logprobs are the same bytes generated alone, as row 0 of a batch
of 16 and as row 11; (b) prefill == chunked prefill (any chunk size) == decode, so the same
sample generated with different prefill chunking is identical; (c) the trainer's recomputed
logprobs of the rollout's tokens (packed microbatch, no KV cache) equal the rollout's bytes.
Hence rollout logprobs == trainer logprobs whatever the batch. Each has a control with the stock
ops (`--mode native`), which must differ.
"""

from __future__ import annotations

import torch

from rlkernel.model.checkpoint import init_weights
from rlkernel.model.config import tiny
from rlkernel.model.layout import packed_layout, to_samples, to_stream
from rlkernel.model.ops import InvariantOps, NativeOps
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.rollout.engine import Request, RolloutEngine, SamplingParams
from rlkernel.train.step import TrainSample, trainer_logprobs

CFG = tiny()
W = init_weights(CFG, 0)
SP = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=24, seed=11, eos_id=256)


def _engine(ops, chunk=None, live_vocab=None) -> RolloutEngine:
    e = RolloutEngine(CFG, ops, torch.bfloat16, pad_id=257, prefill_chunk=chunk,
                      live_vocab=live_vocab)
    e.load_weights(W)
    return e


def _requests(n: int, start: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(start + 1)
    return [Request(start + i, tuple(torch.randint(32, 127, (int(torch.randint(3, 30, (1,),
            generator=g)),), generator=g).tolist())) for i in range(n)]


def _bits(c) -> tuple[list[int], list[int]]:
    return c.response_ids, c.logprob_tensor().view(torch.int32).tolist()


def _batch_variants(ops):
    target = _requests(1, start=100)[0]
    others = _requests(15, start=0)
    eng = _engine(ops)
    alone = eng.generate([target], SP)[0]
    row0 = eng.generate([target] + others, SP)[0]
    row11 = eng.generate(others[:11] + [target] + others[11:], SP)[11]
    return alone, row0, row11


def test_sample_identical_alone_in_batch16_and_at_row11():
    """tokens and logprob bits of one sample: alone == row 0 of 16 == row 11 of 16."""
    alone, row0, row11 = _batch_variants(InvariantOps)
    assert len(alone.response_ids) > 1
    assert _bits(alone) == _bits(row0) == _bits(row11)


def test_control_stock_ops_change_with_batch():
    """negative control: with stock ops samples' bits change with the batch — of the 16 samples
    of the batch, some generated alone differ from their row. (Any one sample may happen to
    agree: bf16 runs round q, k, v, which absorbs some last-bit differences; the target of the
    test above does agree since attention rounds to bf16.)"""
    reqs = _requests(1, start=100) + _requests(15, start=0)
    eng = _engine(NativeOps)
    batch = eng.generate(reqs, SP)
    differ = sum(_bits(eng.generate([r], SP)[0]) != _bits(c) for r, c in zip(reqs, batch))
    assert differ >= 4, differ


def test_prefill_chunked_prefill_and_decode_identical():
    """whole-prompt prefill == chunked prefill (chunks 1, 3, 7) for every sample, bitwise."""
    reqs = _requests(6, start=40)
    base = [_bits(c) for c in _engine(InvariantOps).generate(reqs, SP)]
    for chunk in (1, 3, 7):
        got = [_bits(c) for c in _engine(InvariantOps, chunk).generate(reqs, SP)]
        assert got == base, f"prefill chunk {chunk}"


def _trainer_logprobs(ops, completions, live_vocab=None) -> list[list[int]]:
    model = Qwen3ForCausalLM(CFG, ops, torch.bfloat16, live_vocab=live_vocab)
    model.load_tensors(W)
    samples = [TrainSample(c.sample_id, c.prompt_ids, tuple(c.response_ids), c.logprob_tensor(),
                           0.0) for c in completions]
    return [lp.view(torch.int32).tolist()
            for lp in trainer_logprobs(model, samples, SP.temperature, 257)]


def test_trainer_recompute_equals_rollout_logprobs():
    """trainer logprobs (packed, no cache) == rollout logprobs (KV-cache decode), bitwise."""
    comps = _engine(InvariantOps).generate(_requests(8, start=7), SP)
    assert _trainer_logprobs(InvariantOps, comps) == [_bits(c)[1] for c in comps]


def test_control_stock_trainer_differs_from_rollout():
    """negative control: stock ops' trainer logprobs differ from their rollout logprobs."""
    comps = _engine(NativeOps).generate(_requests(8, start=7), SP)
    assert _trainer_logprobs(NativeOps, comps) != [_bits(c)[1] for c in comps]


def test_padded_vocab_never_samples_masked_ids_and_trainer_equals_rollout():
    """A tokenizer with 200 of the model's 264 ids (live_vocab=200): no sampled id is >= 200, and
    the trainer's logprobs (same rule) == the rollout's, bitwise. Control: without the rule the
    same engine samples ids >= 200 (the ones a tokenizer cannot decode)."""
    reqs = _requests(8, start=7)
    comps = _engine(InvariantOps, live_vocab=200).generate(reqs, SP)
    ids = [t for c in comps for t in c.response_ids]
    assert len(ids) > 50 and max(ids) < 200
    assert _trainer_logprobs(InvariantOps, comps, 200) == [_bits(c)[1] for c in comps]
    unmasked = _engine(InvariantOps).generate(reqs, SP)
    assert max(t for c in unmasked for t in c.response_ids) >= 200


def test_layout_attention_bounds_are_the_tensors_maxima_and_survive_to(monkeypatch):
    """StreamLayout.attention_bounds == (q_pos.max(), kv_len.max()) for packed, chunked and
    CP-local layouts (what the CUDA attention backward would otherwise read with a sync); the
    layout `to` returns carries them without reading its (moved) tensors again; an empty
    layout gives (-1, 0)."""
    from rlkernel.model.layout import StreamLayout, chunk_layout, cp_local_layout
    lay = packed_layout([[1, 2, 3], [4, 5], list(range(7, 40))], 0, multiple=64)
    lays = [lay, chunk_layout([[1, 2], [3]], [5, 40], 0),
            cp_local_layout(lay, torch.arange(16, 48))]
    for lay_ in lays:
        assert lay_.attention_bounds() == (int(lay_.q_pos.max()), int(lay_.kv_len.max()))
    assert lays[2].attention_bounds()[0] < lay.attention_bounds()[0]      # local positions
    moved = lay.to("meta")      # a device whose tensors hold no values: reading them fails
    assert moved.q_pos.device.type == "meta" and moved.attention_bounds() == (32, 33)
    e = torch.zeros(0, dtype=torch.long)
    assert StreamLayout(e, e, e.view(0, 0), e.view(0, 0), e).attention_bounds() == (-1, 0)


def test_layout_moves_are_cached_per_index_tensor_and_stream_rows():
    """StreamLayout.moves (the per-pass cache of to_samples / to_stream's index tensors) keys on
    the index tensor and the stream's row count: one q_idx with n and n + 4 rows gives two
    SlotMoves, each sending empty slots to its own dump row (n_rows); a repeated call returns
    the cached one; to_samples / to_stream with the layout give the bytes and shapes they give
    without it."""
    lay = packed_layout([[1, 2, 3], [4, 5]], 257)
    n = lay.tokens.shape[0]
    a, b = lay.moves(lay.q_idx, n), lay.moves(lay.q_idx, n + 4)
    assert lay.moves(lay.q_idx, n) is a and (a.n_rows, b.n_rows) == (n, n + 4)
    empty = ~a.valid.reshape(-1)
    assert bool(empty.any())
    assert a.scatter[empty].tolist() == [n] * int(empty.sum())
    assert b.scatter[empty].tolist() == [n + 4] * int(empty.sum())
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(0))
    slots = to_samples(x, lay.q_idx, lay)
    assert torch.equal(slots.view(torch.int32), to_samples(x, lay.q_idx).view(torch.int32))
    for rows in (n, n + 4):
        got = to_stream(slots, lay.q_idx, rows, lay)
        assert got.shape == (rows, 3)
        assert torch.equal(got.view(torch.int32),
                           to_stream(slots, lay.q_idx, rows).view(torch.int32))


def test_to_samples_copies_every_bit_of_a_valid_row_and_fills_empty_slots_with_plus_zero():
    """to_samples is a copy: a valid slot holds its stream row's bits (−0.0 and a NaN payload
    included) and an empty slot +0.0 — not −0.0, not the row its clamped index points at.
    Control: a product by the validity mask, a would-be shortcut, turns −0.0·1 into −0.0 but
    the empty slot of a NaN row into NaN."""
    lay = packed_layout([[1, 2, 3], [4, 5]], 257)
    n = lay.tokens.shape[0]
    x = torch.full((n, 2), -0.0)
    x[:, 1] = torch.tensor(0x7FC01234, dtype=torch.int32).view(torch.float32)   # a NaN payload
    slots = to_samples(x, lay.q_idx, lay)
    valid = lay.q_idx >= 0
    assert bool((~valid).any())
    bits = slots.view(torch.int32)
    assert torch.equal(bits[valid], x[lay.q_idx[valid]].view(torch.int32))
    assert bits[~valid].eq(0).all()
    masked = x[lay.q_idx.clamp(min=0)] * valid.unsqueeze(-1)
    assert not torch.equal(masked.view(torch.int32), bits)


def test_to_samples_and_to_stream_gradients_are_the_slot_copies():
    """The backward of to_samples scatters each valid slot's gradient to its stream row and of
    to_stream gathers it (the layout.py Functions, which run no boolean indexing: no CUDA host
    sync): bytewise the boolean-index formula, −0.0 and the +0 of rows no slot names included
    (the padding rows, which the dump row of empty slots must not reach)."""
    lay = packed_layout([[1, 2, 3], [4, 5, 6, 7, 8]], 257)
    n = lay.tokens.shape[0]
    q_idx = lay.q_idx
    valid = q_idx >= 0
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, generator=g).requires_grad_(True)
    dy = torch.randn(q_idx.shape + (3,), generator=g)
    s0, t0 = valid.nonzero()[0].tolist()
    dy[s0, t0] = -0.0             # one valid slot; the empty ones keep values that must not land
    to_samples(x, q_idx, lay).backward(dy)
    want = torch.zeros(n, 3)
    want[q_idx[valid]] = dy[valid]
    assert torch.equal(x.grad.view(torch.int32), want.view(torch.int32))
    unread = torch.ones(n, dtype=torch.bool)
    unread[q_idx[valid]] = False
    assert bool(unread.any()) and not bool(x.grad[unread].view(torch.int32).any())
    slots = torch.randn(q_idx.shape + (3,), generator=g).requires_grad_(True)
    dx = torch.randn(n + 2, 3, generator=g)
    dx[q_idx[valid][0]] = -0.0
    to_stream(slots, q_idx, n + 2, lay).backward(dx)
    want = torch.zeros(q_idx.shape + (3,))
    want[valid] = dx[q_idx[valid]]
    assert torch.equal(slots.grad.view(torch.int32), want.view(torch.int32))
    assert torch.equal(slots.grad[~valid], torch.zeros_like(slots.grad[~valid]))
