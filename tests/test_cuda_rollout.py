"""The paged rollout engine on CUDA (Triton kernels, KV block 64): bitwise invariance of one
sample's tokens and logprob bits, rollout == trainer, and no host sync per token.

Same properties as tests/test_rollout_engine.py, on the GPU backend (identity is promised within
a backend, so CUDA results are compared with CUDA results only): alone == in batches of 7, 8,
9, 16, 17, 257 == admitted late == shuffled physical blocks == shared prompt or not == other
token budgets and prefill chunks == a tight pool (preemption); trainer logprobs == rollout
logprobs. Negative controls: stock ops (`--mode native`: cuBLAS, SDPA) change the bytes with
the batch. Host syncs during `generate` are counted with torch's sync debug mode: at most one
per host check (every check_every steps) plus a fixed number per call, never one per token.
Run (GPU machine, repository root):
    PYTHONPATH=.:tests python3 -m pytest -q tests/test_cuda_rollout.py
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from rollout_helpers import CFG, PAD, W, bits, engine, group, requests, sp
from rlkernel.model.checkpoint import init_weights
from rlkernel.model.ops import InvariantOps, NativeOps
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.rollout.cuda_graphs import Pads
from rlkernel.train.step import TrainSample, trainer_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = "cuda"
TARGET = requests(1, start=500, lo=70, hi=140)[0]     # 70-139 prompt tokens: 2-3 blocks of 64
SP = sp(16)


def _target(ops, batch, row, **kw):
    reqs = batch[:row] + [TARGET] + batch[row:]
    e = engine(ops, DEV, **kw)
    return bits(e.generate(reqs, SP)[row]), e.stats


@functools.lru_cache(maxsize=None)
def _alone(ops):
    return bits(engine(ops, DEV).generate([TARGET], SP)[0])


@pytest.mark.parametrize("size", [7, 8, 9, 16, 17, 257])
def test_cuda_target_alone_equals_in_batch(size):
    got, _ = _target(InvariantOps, requests(size - 1, start=0, lo=3, hi=200), size // 2)
    assert len(got[0]) == 16 and got == _alone(InvariantOps)


def test_cuda_control_stock_ops_change_with_batch():
    got, _ = _target(NativeOps, requests(256, start=0, lo=3, hi=200), 128)
    assert got != _alone(NativeOps)


@pytest.mark.parametrize("kw", [dict(max_seqs=3, max_step_tokens=96),
                                dict(block_shuffle_seed=1), dict(block_shuffle_seed=2, kv_blocks=9),
                                dict(prefill_chunk=5), dict(max_step_tokens=70),
                                dict(check_every=1)])
def test_cuda_schedule_and_placement_do_not_change_bytes(kw):
    """admitted late (max_seqs=3), shuffled / tight pools (preemption), chunking, budgets and
    the host-check period: the target's bytes == alone."""
    got, stats = _target(InvariantOps, requests(11, start=30, lo=3, hi=200), 7, **kw)
    if "max_seqs" in kw:
        step, _, running = next(a for a in stats["admissions"] if a[1] == 7)
        assert step > 0 and running > 0
    if "kv_blocks" in kw:
        assert stats["preemptions"] > 0
    assert got == _alone(InvariantOps)


def _groups(ops, share):
    reqs = group(6, 150, start=200, seed=3) + requests(4, start=300) + group(6, 150, 210, seed=4)
    e = engine(ops, DEV, prefix_sharing=share)
    return [bits(c) for c in e.generate(reqs, SP)], e.stats


def test_cuda_shared_prefix_or_not():
    shared, st = _groups(InvariantOps, True)
    plain, _ = _groups(InvariantOps, False)
    assert st["blocks_saved"] == 2 * 5 * 2 and shared == plain


def test_cuda_control_shared_prefix_stock_ops_differ():
    assert _groups(NativeOps, True)[0] != _groups(NativeOps, False)[0]


def test_cuda_trainer_equals_rollout():
    """trainer logprobs (packed, no cache, CUDA) == rollout logprobs of a shared, preempting,
    shuffled run: 0 byte mismatches."""
    reqs = group(4, 100, start=400) + requests(6, start=410, lo=3, hi=200)
    e = engine(InvariantOps, DEV, kv_blocks=8, block_shuffle_seed=5, max_step_tokens=200)
    comps = e.generate(reqs, SP)
    model = Qwen3ForCausalLM(CFG, InvariantOps, torch.bfloat16).to(DEV)
    model.load_tensors(W)
    samples = [TrainSample(c.sample_id, c.prompt_ids, tuple(c.response_ids), c.logprob_tensor(),
                           0.0) for c in comps]
    got = [lp.view(torch.int32).tolist()
           for lp in trainer_logprobs(model, samples, SP.temperature, PAD)]
    assert got == [bits(c)[1] for c in comps]


def test_cuda_reference_policy_held_in_bf16_equals_fp32_storage():
    """The reference policy of `rlk run` (no grad, 2-D weights held in bf16 by
    hold_matmul_weights, half their bytes) gives the logprobs of the same model holding fp32
    tensors, and of the policy's autograd pass, bitwise. Control: one weight element moved by
    one bf16 ulp changes the logprobs, so the comparison can fail."""
    reqs = group(3, 60, start=900) + requests(5, start=910, lo=3, hi=120)
    comps = engine(InvariantOps, DEV).generate(reqs, SP)
    samples = [TrainSample(c.sample_id, c.prompt_ids, tuple(c.response_ids), c.logprob_tensor(),
                           0.0) for c in comps]

    def model(hold: bool, weights=W, grad: bool = False):
        m = Qwen3ForCausalLM(CFG, InvariantOps, torch.bfloat16).to(DEV)
        m.load_tensors(weights)
        m.requires_grad_(grad)
        if hold:
            m.hold_matmul_weights()
        return m

    def lps(m):
        with torch.set_grad_enabled(any(p.requires_grad for p in m.parameters())):
            return [lp.view(torch.int32).tolist()
                    for lp in trainer_logprobs(m, samples, SP.temperature, PAD)]
    held, plain = model(True), model(False)
    assert lps(held) == lps(plain) == lps(model(False, grad=True))
    size = {n: p.element_size() for n, p in held.named_parameters()}
    assert all(size[n] == (2 if p.dim() == 2 else 4) for n, p in held.named_parameters())
    name = "model.layers.0.mlp.up_proj.weight"
    w2 = dict(W)
    w2[name] = W[name].clone()
    bits16 = w2[name].to(torch.bfloat16).view(torch.int16)
    bits16[0, 0] += 1
    w2[name] = bits16.view(torch.bfloat16).float()
    assert lps(model(True, w2)) != lps(held)


def test_cuda_no_host_sync_per_token():
    """Host syncs in one generate of 16 samples × 64 tokens (about 64 decode steps), counted by
    torch.cuda.set_sync_debug_mode: at most 2 per host check (one every check_every steps, and
    one at the end) + 8 (prompt upload, result download) + 4 per CUDA graph captured.
    Control: with check_every=1 there are at least as many syncs as steps."""
    reqs = requests(16, start=600, lo=3, hi=60)
    counts = {}
    for k in (32, 1):
        e = engine(InvariantOps, DEV, check_every=k)
        e.generate(reqs, sp(8))                                   # warm-up (compiles)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                e.generate(reqs, sp(64, eos=-1))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[k] = (sum("synchroniz" in str(x.message) for x in w), e.stats["steps"])
    syncs, steps = counts[32]
    # + 4 per CUDA graph captured (torch.cuda.graph synchronizes around a capture)
    captures = len(e.stats["graph_buckets"])
    assert steps >= 64 and syncs <= 2 * (steps // 32 + 1) + 8 + 4 * captures, counts
    assert counts[1][0] >= counts[1][1], counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tq", [1, 5, 64])
def test_cuda_paged_kernel_equals_dense_kernel(dtype, tq):
    """The Triton kernel reading K/V through a block table == the same kernel on the blocks
    gathered in logical order, bitwise (out and lse), for decode (Tq=1), short and full chunks,
    fp32 and bf16. Control: a table in another block order changes the output."""
    from rlkernel.kernels.paged_attention import gather_blocks
    from rlkernel.kernels.triton_attention import (KV_BLOCK, attention_forward,
                                                   paged_attention_forward)
    g = torch.Generator(device=DEV).manual_seed(tq)
    s_, hq, hkv, d, nb, blocks = 4, 16, 8, 128, 5, 23
    q = torch.randn(s_, hq, tq, d, generator=g, device=DEV).to(dtype)
    kp = torch.randn(blocks, KV_BLOCK, hkv, d, generator=g, device=DEV).to(dtype)
    vp = torch.randn(blocks, KV_BLOCK, hkv, d, generator=g, device=DEV).to(dtype)
    table = torch.randperm(blocks, generator=g, device=DEV)[:s_ * nb].view(s_, nb)
    kv_len = torch.tensor([nb * KV_BLOCK, 3 * KV_BLOCK + 7, 65, tq + 1], device=DEV)
    q_pos = torch.stack([torch.arange(int(n) - tq, int(n), device=DEV) for n in kv_len])
    q_pos[2, 0] = -1
    tk = nb * KV_BLOCK
    dense = attention_forward(q, gather_blocks(kp, table, tk), gather_blocks(vp, table, tk),
                              q_pos, kv_len, d ** -0.5)
    paged = paged_attention_forward(q, kp, vp, table, q_pos, kv_len, d ** -0.5)
    for a, b in zip(dense, paged):
        assert torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                           b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32))
    other = paged_attention_forward(q, kp, vp, table.roll(1, 1), q_pos, kv_len, d ** -0.5)[0]
    assert not torch.equal(other, paged[0])


def test_cuda_engine_paged_kernel_equals_gather():
    """The engine with the paged kernel == the engine gathering blocks for the dense kernel,
    every sample, bitwise (shared prompts, shuffled blocks)."""
    reqs = group(4, 100, start=700) + requests(8, start=710, lo=3, hi=200)
    runs = [[bits(c) for c in engine(InvariantOps, DEV, paged_kernel=pk,
                                     block_shuffle_seed=7).generate(reqs, SP)]
            for pk in (True, False)]
    assert runs[0] == runs[1]


_GRAPH_REQS = group(4, 100, start=800) + requests(9, start=810, lo=3, hi=200)   # 13 -> 16 rows


def _graph_run(mode: str, **kw):
    e = engine(InvariantOps, DEV, decode_graphs=mode, **kw)
    return [bits(c) for c in e.generate(_GRAPH_REQS, sp(24, eos=100, top_p=0.9))], e.stats


@pytest.mark.parametrize("kw", [{}, dict(max_seqs=5, max_step_tokens=200)],
                         ids=["all-at-once", "late-admission"])
def test_cuda_graphs_equal_eager(kw):
    """Decode steps replayed from CUDA graphs (padded to their bucket; shared prompt blocks with
    copy-on-write steps run eagerly in between) == eager, every sample, bitwise."""
    graphs, st = _graph_run("auto", **kw)
    eager, st_e = _graph_run("eager", **kw)
    assert graphs == eager
    assert st["graph_steps"] > st["steps"] // 2 and st["graph_buckets"], st
    assert st_e["graph_steps"] == 0


_W2 = init_weights(CFG, 1)
_KEPT_CALLS = [(W, _GRAPH_REQS), (W, requests(5, start=830, lo=3, hi=90)),
               (_W2, requests(11, start=850, lo=3, hi=150))]


_OLD: list[torch.Tensor] = []


def _rebind(e, w) -> None:
    """A wrong weight load: each parameter rebound to a new tensor instead of copied into. The
    old tensors are kept alive (in _OLD), so the graphs read the old weights, not freed memory
    (which, reused by the allocator, gives non-finite rows: the engine raises on those)."""
    m = e.model
    for name, p in m.logical_params().items():
        _OLD.append(p.data)
        p.data = m.local_param(name, w[name]).to(p.device, copy=True)


def _kept_runs(rebind: bool = False):
    """keep_state engine: prepare (every bucket captured on padding rows), then three calls
    with a weight load before the third; per call the samples of a fresh eager engine with the
    same weights alongside."""
    e = engine(InvariantOps, DEV, keep_state=True)
    sp_ = sp(24, eos=100, top_p=0.9)
    e.prepare(_GRAPH_REQS, sp_)
    got, want = [], []
    for w, reqs in _KEPT_CALLS:
        if w is not W:
            _rebind(e, w) if rebind else e.load_weights(w)
        got.append([bits(c) for c in e.generate(reqs, sp_)])
        fresh = engine(InvariantOps, DEV, decode_graphs="eager")
        fresh.load_weights(w)
        want.append([bits(c) for c in fresh.generate(reqs, sp_)])
        assert e.stats["kept_state"] and e.stats["graph_capture_s"] == 0.0, e.stats
        assert e.stats["graph_steps"] > 0
    return got, want


def test_cuda_kept_state_with_graphs_equals_fresh_eager_engines():
    """An engine keeping its KV pool, buffers and CUDA graphs across calls (graphs captured up
    front by `prepare`, none during the calls; new weights loaded in place between calls) ==
    a fresh eager engine per call, every sample, bitwise."""
    got, want = _kept_runs()
    assert got == want


def test_cuda_control_weights_rebound_leave_graphs_stale():
    """Negative control: a weight load that rebinds the parameters to new tensors (instead of
    copying into them) leaves the kept graphs reading the old weights: the call after it
    differs from a fresh engine with the new weights."""
    try:
        got, want = _kept_runs(rebind=True)
    finally:
        _OLD.clear()
    assert got[:2] == want[:2] and got[2] != want[2]


def test_cuda_control_graph_padding_into_a_real_slot_differs(monkeypatch):
    """Negative control: padding rows of the graphs writing their K/V into slot 0 (a real
    sequence's key) instead of the dump slot change samples."""
    eager, _ = _graph_run("eager")
    fill = Pads.fill
    monkeypatch.setattr(Pads, "fill", lambda self, key: 0 if key == "slots"
                        else fill(self, key))
    graphs, st = _graph_run("auto")
    assert st["graph_steps"] > 0 and graphs != eager


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_cuda_triton_sampler_equals_cpu_torch_sampler(top_p):
    """The Triton race on CUDA (kernels/triton_sampler.py) draws the CPU torch sampler's tokens
    on Qwen3-size rows (V = 151,936: 38 pieces per row), 64 rows with peaked, flat, tied and
    padded-vocabulary logprobs, and flags the rows invalid_rows flags (NaN, +inf, all −inf).
    Control: the CPU sampler at another seed differs on most rows."""
    from rlkernel.rollout import sampler
    g = torch.Generator().manual_seed(0)
    rows, v = 64, 151936
    lp = torch.log_softmax(torch.randn(rows, v, generator=g) * torch.linspace(0.5, 12, rows)[:, None], -1)
    lp[1] = torch.log_softmax(torch.randint(0, 4, (v,), generator=g).float(), -1)   # ties
    lp[2, 151669:] = float("-inf")
    sid = torch.randint(-2**62, 2**62, (rows,), generator=g)
    pos = torch.randint(0, 40000, (rows,), generator=g)
    kw = dict(seed=7, sample_ids=sid, positions=pos, top_p=top_p)
    tok, bad = sampler.draw(lp.to(DEV), **kw)
    want = sampler.sample_tokens(lp, validate=False, **kw)
    assert torch.equal(tok.cpu(), want) and not bool(bad.any())
    other = sampler.sample_tokens(lp, validate=False, **{**kw, "seed": 8})
    assert int((other != want).sum()) >= rows // 2
    lp[3, 5], lp[4, 9], lp[5] = float("nan"), float("inf"), float("-inf")
    _, bad = sampler.draw(lp.to(DEV), **kw)
    assert torch.equal(bad.cpu(), sampler.invalid_rows(lp))
