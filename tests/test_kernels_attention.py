"""Tests for block attention forward/backward (kernels/attention.py) (DESIGN.md §1, §5 "Unit").

Checked two ways: against a float64 oracle with a tolerance, and against itself under batch /
offset / shard / rank-split changes bitwise (`assert_bitwise`), each with a negative control that
shows the stock torch path differs. Helpers and in-process thread ranks: tests/kernel_helpers.py.

bf16 q/k/v (bf16 runs, NUMERICS_VERSION 4 and 5): the same invariances bitwise, float64 oracles with
bf16 bounds, and checks that P and the backward's dO, P, dS are rounded (the fp32 kernel rounded
once at the end differs).
Run: .venv/bin/python -m pytest -q tests/test_kernels_attention.py
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import (
    INF,
    NAN,
    assert_bitwise,
    assert_near,
    assert_stock_differs,
    cp_tree,
    randn,
    run_ranks,
)

from rlkernel.distributed.parallel import cp_segments
from rlkernel.distributed.tokensum import TokenSum
from rlkernel.kernels.attention import attention, attention_backward, attention_forward
from rlkernel.spec import TOKEN_LEAF

# ================================================================== attention

HQ, HKV, HD = 4, 2, 16
SCALE = 1.0 / math.sqrt(HD)


def _pack(lengths, tq=None, tk=None, seed=70, fill=NAN, hq=HQ, leaf=TOKEN_LEAF):
    """Samples packed in one stream as the trainer packs them (each starting at a multiple of
    `leaf`: TOKEN_LEAF, the CPU's, or the CUDA kernels' CUDA_TOKEN_LEAF): per-sample padded
    q/k/v, q_pos, kv_len, q_idx (stream row of each query).

    Padding q/k/v slots are `fill` (NaN: they must not matter). Returns (q, k, v, q_pos, kv_len,
    q_idx, stream_len (a multiple of 256), per-sample clean q/k/v list)."""
    s_ = len(lengths)
    tq = tq or max(lengths)
    tk = tk or tq
    q = torch.full((s_, hq, tq, HD), fill)
    k = torch.full((s_, HKV, tk, HD), fill)
    v = torch.full((s_, HKV, tk, HD), fill)
    q_pos = torch.full((s_, tq), -1, dtype=torch.long)
    q_idx = torch.full((s_, tq), -1, dtype=torch.long)
    off = 0
    samples = []
    for i, n in enumerate(lengths):
        qs, ks, vs = (randn(h, n, HD, seed=seed + 10 * i + j) for j, h in enumerate((hq, HKV, HKV)))
        q[i, :, :n], k[i, :, :n], v[i, :, :n] = qs, ks, vs
        q_pos[i, :n] = torch.arange(n)
        q_idx[i, :n] = off + torch.arange(n)
        off += -(-n // leaf) * leaf
        samples.append((qs, ks, vs))
    stream_len = -(-off // 256) * 256
    return q, k, v, q_pos, torch.tensor(lengths), q_idx, stream_len, samples


def _attn_oracle64(q, k, v):
    """Causal GQA attention of one sample in float64: q [Hq, n, D], k/v [Hkv, n, D] -> [Hq, n, D]."""
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    n = q.shape[1]
    s = (q @ k.transpose(-1, -2)) * SCALE
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -INF)
    return torch.softmax(s, -1) @ v


def test_attention_forward_and_backward_vs_float64_packed_stream():
    """attention() on 3 samples of lengths 37, 20, 71 (NaN in every padding slot) matches float64
    causal GQA attention: out within 2e-6,
    dQ/dK/dV within 1e-5 of max|ref|; padding query rows are 0 and padding key slots get 0 grads."""
    lengths = [37, 20, 71]
    q, k, v, q_pos, kv_len, q_idx, _, samples = _pack(lengths)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    d_out = randn(*q.shape, seed=71)
    out = attention(q, k, v, q_pos, kv_len, SCALE)
    out.backward(d_out)
    for i, (n, (qs, ks, vs)) in enumerate(zip(lengths, samples)):
        q64, k64, v64 = (t.double().requires_grad_() for t in (qs, ks, vs))
        o64 = _attn_oracle64(q64, k64, v64)
        o64.backward(d_out[i, :, :n].double())
        assert_near(out[i, :, :n], o64, atol=2e-6)
        assert_bitwise(out[i, :, n:].detach(), torch.zeros_like(out[i, :, n:]))
        for got, ref in ((q.grad[i, :, :n], q64.grad), (k.grad[i, :, :n], k64.grad),
                         (v.grad[i, :, :n], v64.grad)):
            assert_near(got, ref, atol=1e-5 * float(ref.abs().max()))
        for gr in (q.grad, k.grad, v.grad):
            assert bool((gr[i, :, n:] == 0).all())  # value check (±0), not an invariance claim


def _ours(q, k, v, q_pos, kv_len):
    return attention_forward(q, k, v, q_pos, kv_len, SCALE)[0]


def _stock_sdpa(q, k, v, q_pos, kv_len):
    """torch SDPA in the same layout: boolean mask from q_pos/kv_len, K/V repeated per query head.
    NaN garbage is zeroed first (stock attention would spread NaN from masked slots) and padding
    query rows attend to everything (stock softmax of an all-masked row is NaN)."""
    j = torch.arange(k.shape[2], device=k.device)
    vis = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_len[:, None, None])
    vis = vis | (q_pos[:, :, None] < 0)
    g = q.shape[1] // k.shape[1]
    kk, vv = (torch.nan_to_num(t.repeat_interleave(g, 1)) for t in (k, v))
    return F.scaled_dot_product_attention(torch.nan_to_num(q), kk, vv, attn_mask=vis[:, None])


def _prefill_chunked_decode(fwd, n=75, c=40, cache=96):
    """One sample of n tokens three ways: (full prefill, chunked prefill — queries [0,c) with keys
    [0,c), then [c,n) with keys [0,n) —, decode — query p alone against a `cache`-slot KV cache
    holding keys [0,p] and NaN beyond, kv_len = p+1 — stacked over p). Each [1, Hq, n, D]."""
    q, k, v, q_pos, kv_len, *_ = _pack([n], seed=72)
    full = fwd(q, k, v, q_pos, kv_len)
    c1 = fwd(q[:, :, :c], k[:, :, :c], v[:, :, :c], q_pos[:, :c], torch.tensor([c]))
    c2 = fwd(q[:, :, c:], k, v, q_pos[:, c:], kv_len)
    cache_k = torch.full((1, HKV, cache, HD), NAN)
    cache_v = torch.full((1, HKV, cache, HD), NAN)
    dec = []
    for p in range(n):
        cache_k[:, :, p], cache_v[:, :, p] = k[:, :, p], v[:, :, p]
        dec.append(fwd(q[:, :, p:p + 1], cache_k, cache_v, torch.tensor([[p]]), torch.tensor([p + 1])))
    return full, torch.cat([c1, c2], 2), torch.cat(dec, 2)


def _alone_and_batched(fwd, n=50):
    """A sample of n tokens alone (S=1, exact length) and inside batches of lengths [n, 90, 13] and
    [90, 13, n] (padded to 90 slots, NaN garbage in padding): (alone, [its rows in each batch])."""
    alone = _pack([n], seed=73)
    out_alone = fwd(*alone[:5])
    qs, ks, vs = alone[7][0]
    batched = []
    for order in ([n, 90, 13], [90, 13, n]):
        q, k, v, q_pos, kv_len, *_ = _pack(order, seed=74)
        i = order.index(n)
        q[i, :, :n], k[i, :, :n], v[i, :, :n] = qs, ks, vs
        batched.append(fwd(q, k, v, q_pos, kv_len)[i:i + 1, :, :n])
    return out_alone, batched


def test_attention_prefill_equals_chunked_prefill_equals_decode_with_nan_cache_slots():
    """For one sample of 75 tokens, the query at position p gives the same bytes in a full prefill,
    a chunked prefill (queries [0,40) with keys [0,40), then [40,75) with keys [0,75)) and a decode
    (one query at p, 96-slot KV cache, kv_len = p+1, slots beyond kv_len NaN), for every p; the
    lse of the decode equals the prefill's too."""
    full, chunked, decoded = _prefill_chunked_decode(_ours)
    assert_bitwise(chunked, full)
    assert_bitwise(decoded, full)
    q, k, v, q_pos, kv_len, *_ = _pack([75], seed=72)
    full_lse = attention_forward(q, k, v, q_pos, kv_len, SCALE)[1]
    cache_k = torch.cat([k, torch.full((1, HKV, 21, HD), NAN)], 2)
    cache_v = torch.cat([v, torch.full((1, HKV, 21, HD), NAN)], 2)
    for p in (0, 15, 16, 74):
        lse = attention_forward(q[:, :, p:p + 1], cache_k, cache_v, torch.tensor([[p]]),
                                torch.tensor([p + 1]), SCALE)[1]
        assert_bitwise(lse, full_lse[..., p:p + 1])


def test_attention_sample_alone_equals_sample_in_batch_with_other_lengths():
    """A sample's output alone (S=1, exact length) == the same sample in a batch with samples of
    lengths 90 and 13, at batch index 0 or 2, padded to 90 slots with NaN garbage, bitwise."""
    alone, batched = _alone_and_batched(_ours)
    for b in batched:
        assert_bitwise(b, alone)


def test_negative_control_stock_sdpa_prefill_vs_chunked_vs_decode_and_alone_vs_batch():
    """Negative control, same inputs as the two tests above: torch SDPA gives different bytes for
    full prefill vs chunked prefill, full prefill vs decode, and a sample alone vs inside each of
    the padded batches; eager softmax(QKᵀ·scale)·V also differs between prefill and decode."""
    full, chunked, decoded = _prefill_chunked_decode(_stock_sdpa)
    assert_stock_differs(chunked, full)
    assert_stock_differs(decoded, full)
    alone, batched = _alone_and_batched(_stock_sdpa)
    for b in batched:
        assert_stock_differs(b, alone)

    def eager(q, k, v, q_pos, kv_len):
        j = torch.arange(k.shape[2])
        vis = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_len[:, None, None])
        g = q.shape[1] // k.shape[1]
        kk, vv = (torch.nan_to_num(t.repeat_interleave(g, 1)) for t in (k, v))
        s = (q @ kk.transpose(-1, -2)) * SCALE
        return torch.softmax(s.masked_fill(~vis[:, None], -INF), -1) @ vv

    full, _, decoded = _prefill_chunked_decode(eager)
    assert_stock_differs(decoded, full)


def _attn_grads(q, k, v, q_pos, kv_len, q_idx, sl, d_out, qsel, rows=slice(None), **kw):
    """(out, dQ, dK, dV) of attention() for the queries selected by qsel (others become padding).
    q_idx/sl (the stream layout) only decide qsel: the kernel's leaves come from positions."""
    qq, kk, vv = (t[rows].clone().requires_grad_() for t in (q, k, v))
    pos = torch.where(qsel[rows], q_pos[rows], -1)
    out = attention(qq, kk, vv, pos, kv_len[rows], SCALE, **kw)
    out.backward(d_out[rows])
    return out.detach(), qq.grad, kk.grad, vv.grad


ATTN_LENGTHS = [100, 90, 66]  # leaf-aligned in a 512-row stream


def test_attention_sample_grads_alone_equal_grads_in_the_packed_batch():
    """Each sample's dQ/dK/dV computed alone (S=1) == its grads in the 3-sample packed batch,
    bitwise."""
    q, k, v, q_pos, kv_len, q_idx, sl, _ = _pack(ATTN_LENGTHS, seed=76)
    d_out = randn(*q.shape, seed=77)
    args = (q, k, v, q_pos, kv_len, q_idx, sl, d_out)
    ref = _attn_grads(*args, q_idx >= 0)
    for i, n in enumerate(ATTN_LENGTHS):
        got = _attn_grads(*args, q_idx >= 0, slice(i, i + 1))
        for a, b in zip(got, ref):
            assert_bitwise(a[0, :, :n], b[i, :, :n])


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_grads_on_zigzag_cp_ranks_equal_single_process_bytes(cp):
    """GQA attention (4 query heads, 2 KV heads) under CP: each of cp in-process ranks holds only the
    queries of its zig-zag segments (whole leaves; others padding), all keys, and tok=its
    TokenSum; then on every rank dK and dV == the single-process grads, and its queries' dQ and
    outputs == the single-process rows, bitwise."""
    q, k, v, q_pos, kv_len, q_idx, sl, _ = _pack(ATTN_LENGTHS, seed=76)
    d_out = randn(*q.shape, seed=77)
    args = (q, k, v, q_pos, kv_len, q_idx, sl, d_out)
    ref_out, ref_dq, ref_dk, ref_dv = _attn_grads(*args, q_idx >= 0)
    seg = sl // (2 * cp)

    def mine(r):
        segment = torch.div(q_idx, seg, rounding_mode="floor")
        return torch.isin(segment, torch.tensor(cp_segments(cp, r))) & (q_idx >= 0)

    def rank(r, comm):
        return _attn_grads(*args, mine(r), tok=cp_tree(comm, cp))

    for r, (out, dq, dk, dv) in enumerate(run_ranks(cp, rank)):
        sel = mine(r)[:, None, :, None].expand_as(out)
        assert bool(sel.any())
        assert_bitwise(out[sel], ref_out[sel])
        assert_bitwise(dq[sel], ref_dq[sel])
        for gk, rk in ((dk, ref_dk), (dv, ref_dv)):
            for i, n in enumerate(ATTN_LENGTHS):
                assert_bitwise(gk[i, :, :n], rk[i, :, :n])


@pytest.mark.parametrize("tp,hq", [(2, 4), (4, 4), (2, 12), (4, 12)])
def test_attention_kv_head_replicated_over_tp_ranks_gives_single_process_bytes(tp, hq):
    """One KV head shared by hq query heads, TP = tp ranks each holding hq/tp query heads and a
    replica of the KV head: with kv_comm over those ranks, every rank's dK and dV ==
    single-process bytes (head tree finished across ranks, then scaled), and its heads' out/dQ ==
    the matching rows. hq = 12 gives 6 or 3 heads per rank (issue 10: 24 query / 2 KV heads at
    TP4), parts a bottom-up pairwise head tree would cut across."""
    hkv = 1
    q, k, v, q_pos, kv_len, q_idx, sl, _ = _pack(ATTN_LENGTHS, seed=86, hq=hq)
    k, v = k[:, :hkv].contiguous(), v[:, :hkv].contiguous()
    d_out = randn(*q.shape, seed=87)
    ref_out, ref_dq, ref_dk, ref_dv = _attn_grads(q, k, v, q_pos, kv_len, q_idx, sl, d_out, q_idx >= 0)
    per = hq // tp

    def rank(r, comm):
        hs = slice(r * per, (r + 1) * per)
        return _attn_grads(q[:, hs], k, v, q_pos, kv_len, q_idx, sl, d_out[:, hs], q_idx >= 0, kv_comm=comm)

    for r, (out, dq, dk, dv) in enumerate(run_ranks(tp, rank)):
        hs = slice(r * per, (r + 1) * per)
        assert_bitwise(out, ref_out[:, hs])
        assert_bitwise(dq, ref_dq[:, hs])
        assert_bitwise(dk, ref_dk)
        assert_bitwise(dv, ref_dv)


def test_negative_control_stock_attention_dk_changes_with_cp_query_split_and_head_split():
    """Negative control for the CP / KV-replicated grad tests: float32 torch autograd of eager causal
    attention — dK of the full query set != dK(first-half queries) + dK(second-half queries); and
    with one KV head shared by 4 query heads, dK over all heads != dK(heads 0-1) + dK(heads 2-3)."""
    n = 100
    qs, ks, vs = (randn(h, n, HD, seed=78 + j) for j, h in enumerate((HQ, 1, 1)))
    d_out = randn(HQ, n, HD, seed=81)

    def dk(rows, heads=slice(None)):
        kk = ks.clone().requires_grad_()
        q = qs[heads]
        s = (q @ kk.expand(q.shape[0], n, HD).transpose(-1, -2)) * SCALE
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -INF)
        o = torch.softmax(s, -1) @ vs.expand(q.shape[0], n, HD)
        (o[:, rows] * d_out[heads][:, rows]).sum().backward()
        return kk.grad

    full = dk(slice(0, 100))
    assert_stock_differs(dk(slice(0, 50)) + dk(slice(50, 100)), full)
    assert_stock_differs(dk(slice(0, 100), slice(0, 2)) + dk(slice(0, 100), slice(2, 4)), full)


def stock_sdpa_grads_alone_and_batched(q, k, v, q_pos, kv_len, d_out, i: int):
    """(dQ, dK, dV) of sample i's n = kv_len[i] rows from torch SDPA autograd, computed alone
    (exact length) and inside the packed batch: (alone tuple [Hq|Hkv, n, D], batched tuple)."""
    n = int(kv_len[i])

    def grads(qq, kk, vv, pos, kl, do):
        qq, kk, vv = (t.clone().requires_grad_() for t in (qq, kk, vv))
        _stock_sdpa(qq, kk, vv, pos, kl).backward(do)
        return qq.grad[..., :n, :], kk.grad[..., :n, :], vv.grad[..., :n, :]

    batched = grads(q, k, v, q_pos, kv_len, d_out)
    alone = grads(q[i:i + 1, :, :n], k[i:i + 1, :, :n], v[i:i + 1, :, :n], q_pos[i:i + 1, :n],
                  kv_len[i:i + 1], d_out[i:i + 1, :, :n])
    return tuple(a[0] for a in alone), tuple(b[i] for b in batched)


def test_negative_control_stock_sdpa_grads_of_a_sample_alone_vs_in_the_packed_batch():
    """Negative control for the alone-vs-batch grad test: torch SDPA autograd (same packed inputs)
    gives different dQ/dK/dV bytes for the 66-token sample alone (exact length) vs in the batch."""
    q, k, v, q_pos, kv_len, q_idx, sl, _ = _pack(ATTN_LENGTHS, seed=76)
    alone, batched = stock_sdpa_grads_alone_and_batched(q, k, v, q_pos, kv_len,
                                                        randn(*q.shape, seed=77), 2)
    for a, b in zip(alone, batched):
        assert_stock_differs(a, b)


# ------------------------------------------------------------------ bf16 (NUMERICS_VERSION 4, 5)

def _ours_bf16(q, k, v, q_pos, kv_len):
    return attention_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), q_pos, kv_len, SCALE)[0]


def test_bf16_attention_prefill_chunked_decode_and_batch_invariant():
    """bf16 q/k/v (P rounded to bf16, output bf16): prefill == chunked prefill == decode over a
    NaN-padded cache, and a sample alone == in batches, bitwise — the fp32 path's invariances."""
    full, chunked, decoded = _prefill_chunked_decode(_ours_bf16)
    assert full.dtype == torch.bfloat16
    assert_bitwise(chunked, full)
    assert_bitwise(decoded, full)
    alone, batched = _alone_and_batched(_ours_bf16)
    for b in batched:
        assert_bitwise(b, alone)


def test_bf16_attention_vs_float64_and_its_rounding_points():
    """bf16 attention on 3 packed samples against float64 attention on the same bf16 values:
    out within 3·2^-8·max|v| (P and the output rounded to bf16), dQ/dK/dV within 2^-5 of
    max|ref| (dO, P·dO terms and the results in bf16); grads come back bf16. The rounding of P
    is real: the fp32 kernel on the same values, rounded once at the end, differs somewhere."""
    lengths = [37, 20, 71]
    q, k, v, q_pos, kv_len, _, _, samples = _pack(lengths)
    q, k, v = (t.bfloat16().requires_grad_() for t in (q, k, v))
    d_out = randn(*q.shape, seed=71).bfloat16()
    out = attention(q, k, v, q_pos, kv_len, SCALE)
    out.backward(d_out)
    assert out.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16
    for i, (n, (qs, ks, vs)) in enumerate(zip(lengths, samples)):
        q64, k64, v64 = (t.bfloat16().double().requires_grad_() for t in (qs, ks, vs))
        o64 = _attn_oracle64(q64, k64, v64)
        o64.backward(d_out[i, :, :n].double())
        assert_near(out[i, :, :n], o64, atol=3 * 2**-8 * float(v64.detach().abs().max()))
        for got, ref in ((q.grad[i, :, :n], q64.grad), (k.grad[i, :, :n], k64.grad),
                         (v.grad[i, :, :n], v64.grad)):
            assert_near(got, ref, atol=2**-5 * float(ref.abs().max()))
    once = attention_forward(q.detach().float(), k.detach().float(), v.detach().float(), q_pos,
                             kv_len, SCALE)[0].bfloat16()
    assert not torch.equal(once.view(torch.int16), out.detach().view(torch.int16))
    # The backward's rounding points (dO, P before P·dO, dS) are real too: the fp32 backward on
    # the same values and the bf16 forward's out/lse, rounded once at the end, differs.
    _, lse = attention_forward(q.detach(), k.detach(), v.detach(), q_pos, kv_len, SCALE)
    grads32 = attention_backward(q.detach().float(), k.detach().float(), v.detach().float(),
                                 out.detach().float(), lse, d_out.float(), q_pos, kv_len, SCALE,
                                 TokenSum.single(), None)
    for g32, g in zip(grads32, (q.grad, k.grad, v.grad)):
        assert not torch.equal(g32.bfloat16().view(torch.int16), g.view(torch.int16))


def test_bf16_backward_rounds_an_fp32_d_out_at_its_rounding_point():
    """bf16 q/k/v with an fp32 d_out (the backward's public contract allows any float dtype):
    dQ/dK/dV == those of d_out rounded to bf16 first, bitwise (dO's rounding point, delta's
    products included). Control: the fp32 backward (no rounding point) on the same two d_outs
    differs, so the d_outs really differ where it matters."""
    q, k, v, q_pos, kv_len, *_ = _pack([37, 20], fill=0.0)
    d32 = randn(*q.shape, seed=72)
    assert not torch.equal(d32.bfloat16().float(), d32)

    def grads(dtype, d_out):
        qd, kd, vd = (t.to(dtype) for t in (q, k, v))
        out, lse = attention_forward(qd, kd, vd, q_pos, kv_len, SCALE)
        return attention_backward(qd, kd, vd, out, lse, d_out, q_pos, kv_len, SCALE,
                                  TokenSum.single(), None)

    for a, b in zip(grads(torch.bfloat16, d32), grads(torch.bfloat16, d32.bfloat16())):
        assert_bitwise(a, b)
    for a, b in zip(grads(torch.float32, d32), grads(torch.float32, d32.bfloat16().float())):
        assert_stock_differs(a, b)


def test_bf16_rounding_point_helper_rounds_to_nearest_even():
    """attention._bf16, every bf16 rounding point of the CPU attention (forward P, backward P
    and dS): round-to-nearest-even, ties to the even neighbour, not truncation (which Triton's
    interpreter does) — fixed values, both signs, subnormal and overflow edges."""
    from rlkernel.kernels.attention import _bf16

    ulp = 2.0**-7
    cases = [(1 + ulp / 2 + ulp / 8, 1 + ulp), (1 + ulp / 2, 1.0), (1 + 1.5 * ulp, 1 + 2 * ulp),
             (1 + ulp / 4, 1.0), (-(1 + ulp / 2 + ulp / 8), -(1 + ulp)), (2.0**-133 * 1.75, 2.0**-132),
             (3.4e38, float("inf"))]
    x = torch.tensor([c[0] for c in cases], dtype=torch.float32)
    want = torch.tensor([c[1] for c in cases], dtype=torch.float32)
    assert_bitwise(_bf16(x), want)


def test_attention_refuses_mixed_dtypes():
    q, k, v, q_pos, kv_len, *_ = _pack([5])
    with pytest.raises(ValueError, match="share dtype float32 or bfloat16, got torch.bfloat16, torch.float32"):
        attention_forward(q.bfloat16(), k, v, q_pos, kv_len, SCALE)


def _to_stream(x: torch.Tensor, idx: torch.Tensor, n_rows: int) -> torch.Tensor:
    """x [S, H, T, D] as a token stream [n_rows, H, D]: slot (s, t) at row idx[s, t] (>= 0), NaN
    in every row no slot names."""
    out = torch.full((n_rows, x.shape[1], x.shape[3]), NAN, dtype=x.dtype)
    s_i, t_i = (idx >= 0).nonzero(as_tuple=True)
    out[idx[s_i, t_i]] = x[s_i, :, t_i]
    return out


def _runs(lengths, order, gap: int, tq: int) -> torch.Tensor:
    """[S, tq] slot map: sample s's first lengths[s] slots one run of rows, the samples placed
    in `order` with `gap` unnamed rows after each."""
    idx = torch.full((len(lengths), tq), -1, dtype=torch.long)
    off = 0
    for s_ in order:
        idx[s_, :lengths[s_]] = off + torch.arange(lengths[s_])
        off += lengths[s_] + gap
    return idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_packed_on_cpu_is_attention_on_the_gathered_samples(dtype):
    """kernels/attention.attention_packed (the model's packed path; on CPU copies around the
    reference) on streams of 3 samples (lengths 40, 9, 25; tk = 40): the query stream holds them
    back to back in the order 2, 0, 1 and ends at sample 1's last row (its empty slots name
    rows past the end; sample 2's name sample 0's rows), the key stream in the order 1, 2, 0
    with 3 unnamed rows after each (k_rows != q_rows; sample 2's key slots past its kv_len name
    sample 0's rows); NaN in every unnamed row. Output and
    dQ/dK/dV == attention() on the per-sample tensors, bitwise, at each slot's row; +0.0 in
    every row no slot names. Shapes that do not form the problem: ValueError."""
    from rlkernel.kernels.attention import attention_packed
    lengths = [40, 9, 25]
    q, k, v, q_pos, kv_len, _, _, _ = _pack(lengths, seed=140)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    d_out = randn(*q.shape, seed=141).to(dtype)
    tq = q.shape[2]
    qi, ki = _runs(lengths, [2, 0, 1], 0, tq), _runs(lengths, [1, 2, 0], 3, tq)
    nq, nk = int(qi.max()) + 1, int(ki.max()) + 4
    qs, gs = _to_stream(q, qi, nq), _to_stream(d_out, qi, nq)
    ks, vs = (_to_stream(t, ki, nk).requires_grad_() for t in (k, v))
    qs.requires_grad_()
    out = attention_packed(qs, ks, vs, qi[:, 0], ki[:, 0], q_pos, kv_len, tq, SCALE)
    out.backward(gs)
    want = _attn_grads(q, k, v, q_pos, kv_len, None, None, d_out, q_pos >= 0)
    for got, ref, idx in ((out.detach(), want[0], qi), (qs.grad, want[1], qi),
                          (ks.grad, want[2], ki), (vs.grad, want[3], ki)):
        assert got.dtype == dtype
        s_i, t_i = (idx >= 0).nonzero(as_tuple=True)
        assert_bitwise(got[idx[s_i, t_i]].float(), ref[s_i, :, t_i].float())
        named = torch.zeros(got.shape[0], dtype=torch.bool)
        named[idx[s_i, t_i]] = True
        assert bool((got[~named].float().view(torch.int32) == 0).all()), "not +0.0"
    rows = qi[:, 0]
    for bad in ({"q": qs[None]}, {"v": vs[:-1]}, {"q_rows": rows[:2]}, {"k_rows": rows[None]},
                {"kv_len": kv_len[:2]}):
        args = {"q": qs, "k": ks, "v": vs, "q_rows": rows, "k_rows": ki[:, 0], "q_pos": q_pos,
                "kv_len": kv_len, "tk": tq, "scale": SCALE, **bad}
        with pytest.raises(ValueError):
            attention_packed(**args)
