"""The paged, continuously batched rollout engine keeps every sample's bytes (issue 12, item 4).

Property, for one target sample: its token ids and the int32 bits of its logprobs are the same
generated alone and (a) in batches of 7, 8, 9, 16, 17 and 257, (b) admitted late into a running
batch, (c) with its KV in other physical blocks, (d) with its prompt's blocks shared with its
GRPO group or not, (e) under other per-step token budgets and prefill chunk sizes, (f) preempted
and recomputed, (g) with the host checking EOS every step or rarely; and (h) equal to a dense-KV
reference loop; (i) the trainer's recomputed logprobs equal the rollout's under all of that.
Pool sizing: kv_blocks, or gpu_memory_utilization × free device memory (stood in on CPU), with
a ValueError naming the numbers when one sequence cannot fit.
Each invariance has a negative control that must differ: the stock ops (`--mode native`), or for
(c) a cache that reads blocks in physical instead of logical order.
Run: `.venv/bin/python -m pytest -q tests/test_rollout_engine.py` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import functools

import pytest
import torch

from rollout_helpers import CFG, PAD, W, bits, engine, group, requests, sp
from rlkernel.model.layout import chunk_layout
from rlkernel.model.ops import InvariantOps, NativeOps
from rlkernel.model.qwen3 import KVCache, Qwen3ForCausalLM
from rlkernel.rollout.engine import Request, RolloutEngine
from rlkernel.rollout.kv_cache import PagedKVCache
from rlkernel.rollout.sampler import sample_tokens
from rlkernel.train.step import TrainSample, trainer_logprobs

TARGET = requests(1, start=500, lo=20, hi=40)[0]      # 20-39 prompt tokens: 2-3 KV blocks
SP = sp(10)


def _target_in(ops, batch: list, row: int, sp_=SP, **kw):
    """The target's bytes generated at `row` of `batch` (the other requests around it)."""
    reqs = batch[:row] + [TARGET] + batch[row:]
    e = engine(ops, **kw)
    return bits(e.generate(reqs, sp_)[row]), e.stats


@functools.lru_cache(maxsize=None)
def _alone(ops, max_new: int = 10):
    return bits(engine(ops).generate([TARGET], sp(max_new))[0])


@pytest.mark.parametrize("size", [7, 8, 9, 16, 17, 257])
def test_target_alone_equals_target_in_batch(size):
    """(a) alone == row size//2 of a batch of `size` (other prompts 3-29 tokens), bitwise."""
    others = requests(size - 1, start=0)
    got, _ = _target_in(InvariantOps, others, size // 2)
    assert len(got[0]) == 10
    assert got == _alone(InvariantOps)


def test_control_stock_ops_change_with_batch():
    """Negative control for (a): with stock ops the target's logprob bits in a batch of 16
    differ from alone."""
    got, _ = _target_in(NativeOps, requests(15, start=0), 8)
    assert got != _alone(NativeOps)


def _late(ops):
    # max_seqs=3: the target (row 7) waits until running samples finish, then joins others.
    return _target_in(ops, requests(11, start=30), 7, max_seqs=3, max_step_tokens=64)


def test_admitted_late_into_running_batch():
    """(b) admitted at a later step into a batch already running other samples == alone."""
    got, stats = _late(InvariantOps)
    step, _, running = next(a for a in stats["admissions"] if a[1] == 7)
    assert step > 0 and running > 0
    assert got == _alone(InvariantOps)


def test_control_admitted_late_stock_ops_differ():
    got, _ = _late(NativeOps)
    assert got != _alone(NativeOps)


def test_kv_in_other_physical_blocks():
    """(c) shuffled free lists (seeds 1, 2) and a tight pool place the target's KV in other
    physical blocks; its bytes == alone."""
    others = requests(12, start=60)
    for kw in (dict(block_shuffle_seed=1), dict(block_shuffle_seed=2, kv_blocks=40)):
        got, _ = _target_in(InvariantOps, others, 5, **kw)
        assert got == _alone(InvariantOps), kw


def test_control_reading_blocks_in_physical_order_differs(monkeypatch):
    """Negative control for (c): a cache that reads a row's blocks in physical order (sorted
    block table) instead of logical order changes the target's bytes under a shuffled pool."""
    set_step = PagedKVCache.set_step
    monkeypatch.setattr(PagedKVCache, "set_step",
                        lambda self, s, table, tk: set_step(self, s, table.sort(1).values, tk))
    got, _ = _target_in(InvariantOps, requests(12, start=60), 5, block_shuffle_seed=1)
    assert got != _alone(InvariantOps)


def _group_run(ops, share: bool):
    # Two GRPO groups of 6 (prompt 37 tokens: 2 full blocks + 1 partial) around 4 singles.
    reqs = group(6, 37, start=200, seed=3) + requests(4, start=300) + group(6, 37, 210, seed=4)
    e = engine(ops, prefix_sharing=share)
    return [bits(c) for c in e.generate(reqs, SP)], e.stats, reqs


def test_shared_prefix_or_not_and_alone():
    """(d) every sample's bytes are the same with prefix sharing, without it, and generated
    alone; sharing saves blocks (the group's full prompt blocks are held once) and copies the
    partial last block on each sharer's first write."""
    shared, st, reqs = _group_run(InvariantOps, True)
    plain, st0, _ = _group_run(InvariantOps, False)
    assert shared == plain
    e = engine(InvariantOps)
    for i in (0, 5, 10, 15):
        assert bits(e.generate([reqs[i]], SP)[0]) == shared[i]
    assert st["shared_block_refs"] == 2 * 5 * 3 and st["cow_copies"] == 2 * 5
    assert st["blocks_saved"] == 20 and st0["blocks_saved"] == 0
    assert st["peak_blocks"] < st0["peak_blocks"]


def test_control_shared_prefix_stock_ops_differ():
    """Negative control for (d): with stock ops a sharer (which computes only the prompt's last
    token) gets other bytes than when it prefills the whole prompt itself."""
    assert _group_run(NativeOps, True)[0] != _group_run(NativeOps, False)[0]


BUDGETS = [dict(max_step_tokens=5), dict(max_step_tokens=23, prefill_chunk=7),
           dict(prefill_chunk=1), dict(prefill_chunk=3, max_seqs=4)]


def _budgets(ops):
    reqs = requests(6, start=80)
    base = [bits(c) for c in engine(ops).generate(reqs, SP)]
    return base, [[bits(c) for c in engine(ops, **kw).generate(reqs, SP)] for kw in BUDGETS]


def test_token_budget_and_prefill_chunk_do_not_change_bytes():
    """(e) per-step token budgets 5 / 23 / 8192 and prefill chunks 1 / 3 / 7 / whole give every
    sample the same bytes."""
    base, others = _budgets(InvariantOps)
    for kw, got in zip(BUDGETS, others):
        assert got == base, kw


def test_control_budget_stock_ops_differ():
    base, others = _budgets(NativeOps)
    assert any(got != base for got in others)


def _preempted(ops):
    reqs = requests(8, start=120, lo=10, hi=30)
    e = engine(ops, kv_blocks=6)                # 6 blocks of 16: about two sequences at once
    got = [bits(c) for c in e.generate(reqs, SP)]
    return got, [bits(c) for c in engine(ops).generate(reqs, SP)], e.stats


def test_preemption_recompute_keeps_bytes():
    """(f) a pool too small for the batch preempts and recomputes; every sample == ample pool."""
    got, ample, stats = _preempted(InvariantOps)
    assert stats["preemptions"] > 0
    assert got == ample


def test_control_preemption_stock_ops_differ():
    got, ample, stats = _preempted(NativeOps)
    assert stats["preemptions"] > 0 and got != ample


def test_eos_on_device_and_host_check_period():
    """(g) EOS decided on the device: a response stops at its first EOS (finish 'eos') with the
    same leading bytes as without EOS; checking the flags every step or every 1000 steps gives
    the same bytes (a later check only retires the sample later)."""
    reqs = requests(5, start=150)
    free = [bits(c) for c in engine(InvariantOps).generate(reqs, SP)]
    eos = free[2][0][3]                                   # sample 2's 4th token
    runs = [[bits(c) for c in engine(InvariantOps, check_every=k).generate(reqs, sp(10, eos))]
            for k in (1, 1000)]
    assert runs[0] == runs[1]
    for (toks, lps, reason), (ftoks, flps, _) in zip(runs[0], free):
        n = ftoks.index(eos) + 1 if eos in ftoks else len(ftoks)
        assert (toks, lps) == (ftoks[:n], flps[:n])
        assert reason == ("eos" if eos in ftoks else "length")
    assert runs[0][2][2] == "eos" and len(runs[0][2][0]) <= 4


def _dense_reference(reqs, sp_):
    """The pre-paging engine's loop: one static batch, dense per-sample KVCache, whole-prompt
    prefill, then decode; sampling on the same canonical logprobs."""
    model = Qwen3ForCausalLM(CFG, InvariantOps, torch.bfloat16)
    model.load_tensors(W)
    cache = KVCache(CFG, len(reqs), 64 + sp_.max_new_tokens, "cpu")
    chunks, fed = [list(r.prompt_ids) for r in reqs], [0] * len(reqs)
    out = [([], []) for _ in reqs]
    with torch.no_grad():
        for _ in range(sp_.max_new_tokens):
            lay = chunk_layout(chunks, fed, PAD)
            h = model.hidden(lay, cache)
            rows = lay.q_idx[torch.arange(len(reqs)), torch.tensor([len(c) - 1 for c in chunks])]
            logp = model.next_token_logprobs(h[rows], sp_.temperature)
            fed = [f + len(c) for f, c in zip(fed, chunks)]
            toks = sample_tokens(logp, seed=sp_.seed, sample_ids=torch.tensor(
                [r.sample_id for r in reqs]), positions=torch.tensor(fed), top_p=sp_.top_p)
            for i, t in enumerate(toks.tolist()):
                out[i][0].append(t)
                out[i][1].append(int(logp[i, t].view(torch.int32)))
            chunks = [[t] for t in toks.tolist()]
    return [(t, lp, "length") for t, lp in out]


def test_paged_equals_dense_kv_reference():
    """(h) the paged engine (shuffled blocks, chunked, shared group prompt) == a dense-KV static
    batch loop, every sample, bitwise (eos id 999 is never sampled: same lengths)."""
    reqs = requests(5, start=170) + group(3, 21, start=180)
    sp_ = sp(8, eos=999)
    paged = engine(InvariantOps, block_shuffle_seed=3, prefill_chunk=5).generate(reqs, sp_)
    assert [bits(c) for c in paged] == _dense_reference(reqs, sp_)


def _trainer(completions) -> list[list[int]]:
    model = Qwen3ForCausalLM(CFG, InvariantOps, torch.bfloat16)
    model.load_tensors(W)
    samples = [TrainSample(c.sample_id, c.prompt_ids, tuple(c.response_ids), c.logprob_tensor(),
                           0.0) for c in completions]
    return [lp.view(torch.int32).tolist()
            for lp in trainer_logprobs(model, samples, SP.temperature, PAD)]


def test_trainer_equals_rollout_with_sharing_preemption_and_shuffle():
    """(i) trainer logprobs (packed, no cache) == rollout logprobs of a run that shares group
    prompts, preempts (tight pool) and places blocks shuffled: 0 byte mismatches."""
    reqs = group(4, 33, start=400) + requests(4, start=410)
    e = engine(InvariantOps, kv_blocks=7, block_shuffle_seed=5, max_step_tokens=40)
    comps = e.generate(reqs, SP)
    assert e.stats["preemptions"] > 0 and e.stats["blocks_saved"] > 0
    assert _trainer(comps) == [bits(c)[1] for c in comps]


def test_pool_too_small_names_the_numbers():
    """kv_blocks below one sequence's need: one ValueError, before any work, naming the sample,
    its positions, the blocks it needs and the pool."""
    reqs = [TARGET]
    need = -(-(len(TARGET.prompt_ids) + 9) // 16)
    with pytest.raises(ValueError) as e:
        engine(InvariantOps, kv_blocks=need - 1).generate(reqs, SP)
    msg = str(e.value)
    for part in (f"sample {TARGET.sample_id}", f"{len(TARGET.prompt_ids)} prompt",
                 f"{need} blocks of 16 positions", f"kv_blocks={need - 1}"):
        assert part in msg, (part, msg)
    assert bits(engine(InvariantOps, kv_blocks=need).generate(reqs, SP)[0]) == _alone(InvariantOps)


def _per_block() -> int:
    """Bytes of one KV block of the tiny model on CPU (all layers, K and V, bf16: the engine's
    bf16 parameters round k and v to bf16, and the pool stores them so)."""
    return PagedKVCache.bytes_per_block(CFG.num_hidden_layers, 16, CFG.num_key_value_heads,
                                        CFG.head_dim, torch.bfloat16)


def _with_free(e, free: int):
    """Engine `e` (CPU) sizing its pool as on CUDA, from `free` bytes of free device memory."""
    e._free_bytes = lambda: free
    return e


def test_gpu_memory_utilization_sizes_the_pool_and_keeps_bytes():
    """With F·free bytes the pool is floor(F·free / bytes per block) blocks (capped at what the
    call can use): F = 0.06 of 100.99 blocks' bytes == 6 blocks, tight enough to preempt; every
    sample's bytes == the CPU default pool (every sequence at once). The flag is a memory knob
    only, as kv_blocks is (test_preemption_recompute_keeps_bytes, test_kv_in_other_physical_blocks)."""
    reqs = requests(8, start=120, lo=10, hi=30)
    free = 101 * _per_block() - 1
    tight = _with_free(engine(InvariantOps, gpu_memory_utilization=0.06), free)
    got = [bits(c) for c in tight.generate(reqs, SP)]
    assert tight.stats["pool_blocks"] == 6 and tight.stats["preemptions"] > 0
    ample = _with_free(engine(InvariantOps, gpu_memory_utilization=1.0), free)
    assert [bits(c) for c in ample.generate(reqs, SP)] == got
    assert ample.stats["pool_blocks"] < 100 and ample.stats["preemptions"] == 0  # capped at use
    cpu = engine(InvariantOps, gpu_memory_utilization=0.06)                       # no stand-in:
    assert [bits(c) for c in cpu.generate(reqs, SP)] == got                       # CPU ignores F
    assert cpu.stats["pool_blocks"] == ample.stats["pool_blocks"]


def test_pool_too_small_under_gpu_memory_utilization_names_flag_and_bytes():
    """F·free below one sequence's blocks: one ValueError naming --gpu-memory-utilization and its
    value, the free bytes, the bytes the sequence needs and the bytes the pool has, and the fixes
    (raise the flag, lower --max-response-len); one byte more per block of F·free runs it."""
    need = -(-(len(TARGET.prompt_ids) + 9) // 16)
    pb = _per_block()
    free = 2 * need * pb - 2                     # 0.5 · free = need blocks' bytes - 1
    with pytest.raises(ValueError) as e:
        _with_free(engine(InvariantOps, gpu_memory_utilization=0.5), free).generate([TARGET], SP)
    msg = str(e.value)
    for part in (f"sample {TARGET.sample_id}", f"{need} blocks of 16 positions",
                 f"= {need * pb} bytes per sequence", f"{need - 1} blocks = {(need - 1) * pb} "
                 f"bytes available", f"--gpu-memory-utilization 0.5 × {free} bytes free",
                 "raise --gpu-memory-utilization", "lower --max-response-len"):
        assert part in msg, (part, msg)
    ok = _with_free(engine(InvariantOps, gpu_memory_utilization=0.5), free + 2)
    assert bits(ok.generate([TARGET], SP)[0]) == _alone(InvariantOps)


def test_engine_default_is_the_run_default():
    """RolloutEngine's gpu_memory_utilization default == RunConfig's (rlk run passes its value)."""
    import inspect

    from rlkernel.config import RunConfig
    from rlkernel.rollout.engine import RolloutEngine

    default = inspect.signature(RolloutEngine).parameters["gpu_memory_utilization"].default
    assert default == RunConfig().gpu_memory_utilization == 0.5


@pytest.mark.parametrize("kw, words", [
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization=0.0 must be a fraction in (0, 1]"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5"),
    (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization=nan"),
    (dict(max_seqs=0), "max_seqs=0 must be an integer >= 1"),
    (dict(max_step_tokens=2.5), "max_step_tokens=2.5"),
    (dict(kv_blocks=0), "kv_blocks=0 must be an integer >= 1 or None"),
    (dict(prefill_chunk=-3), "prefill_chunk=-3"),
    (dict(check_every=True), "check_every=True"),
])
def test_bad_engine_settings_are_refused(kw, words):
    with pytest.raises(ValueError) as e:
        engine(InvariantOps, **kw)
    assert words in str(e.value)


def test_per_request_length_cap():
    """Request.max_new_tokens caps each sample on its own: a sample capped at 4 is the first 4
    tokens (and logprob bits) of the same sample with the call's cap of 10; cap 0 is refused."""
    reqs = requests(3, start=190)
    full = [bits(c) for c in engine(InvariantOps).generate(reqs, sp(10, eos=999))]
    capped = [Request(r.sample_id, r.prompt_ids, m) for r, m in zip(reqs, (4, None, 7))]
    got = [bits(c) for c in engine(InvariantOps).generate(capped, sp(10, eos=999))]
    for (t, lp, _), (ft, flp, _), n in zip(got, full, (4, 10, 7)):
        assert (t, lp) == (ft[:n], flp[:n])
    with pytest.raises(ValueError, match="sample 190: max_new_tokens=0 must be an integer >= 1"):
        engine(InvariantOps).generate([Request(190, (1, 2), 0)], SP)


def test_load_rounds_fp32_weights_to_bf16_in_the_held_dtype():
    """load_weights of fp32 tensors that bf16 cannot hold (W·(1 + 2**-10)): a bf16 engine holds
    every parameter as its bf16 rounding — 2-D weights in bf16, norm weights in fp32 holding bf16
    values — and held_form (what the weight audit compares with) gives those bytes. Control: the
    loaded norm weights were not bf16 values (the rounding did something)."""
    w32 = {n: t.float() * (1 + 2.0**-10) for n, t in W.items()}
    e = RolloutEngine(CFG, InvariantOps, torch.bfloat16, pad_id=PAD)
    e.load_weights(w32)
    held = e.held_weights()
    assert set(held) == set(w32)
    for n, t in w32.items():
        h, want = held[n], t.to(torch.bfloat16).float()
        assert h.dtype == (torch.bfloat16 if t.dim() == 2 else torch.float32), n
        assert torch.equal(h.float().view(torch.int32), want.view(torch.int32)), n
        form = e.held_form(n, t)
        assert form.dtype == h.dtype and torch.equal(form.float().view(torch.int32),
                                                     want.view(torch.int32)), n
    norm = "model.norm.weight"
    assert not torch.equal(w32[norm].view(torch.int32), held[norm].view(torch.int32))
