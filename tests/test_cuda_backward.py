"""CUDA backward: bitwise invariance of the gradients under batch composition and CP/head splits.

tests/test_cuda.py checks the CUDA forward bytewise and the backward against float64 only; these
tests hold the backward to the same standard as the CPU kernel tests (tests/test_kernels_*.py),
on CUDA tensors, through the same kernel entry points:
- attention: a sample's dQ/dK/dV alone == in a packed 3-sample batch, through autograd (the
  Triton backward, kernels/triton_attention_bwd.py; its CP/Tq/TP splits, tiles, chunking and
  memory: tests/test_cuda_attention_bwd.py, ranks run one after another; real NCCL ranks:
  tests/test_cuda_dist.py — thread ranks cannot run it, because autograd runs every CUDA
  backward of one device on one worker thread, so two thread-ranks inside backward deadlock);
- RMSNorm and SwiGLU: a row's dX alone == in a batch == at an offset;
- SwiGLU's Triton kernels (kernels/triton_activation.py) == the CPU torch path, forward and
  backward, on [4096, 3072] with the adversarial values of tests/swiglu_cases.py, and the torch
  path run on CUDA == the CPU one (NaN payloads aside: swiglu_cases.same_bits);
- column-parallel dX (the fp32 Triton chain + virtual-TP tree): row r alone == in a batch of 257;
- LM-head d logits (kernels/triton_dlogits.py) == the CPU torch path on [512, 151936] with the
  special rows of tests/dlogits_cases.py, fp32 and bf16, from z and from the logits, and through
  token_logprobs_entropy's autograd; a row alone == in the batch, any row chunking.
Negative controls: stock SDPA autograd (alone vs batched), cuBLAS dX (batch 1 vs 257), stock
silu(g)·u and the d-logits torch path run on CUDA (vs the CPU torch path) differ.
Skipped without CUDA. Run on the GPU machine: PYTHONPATH=. python3 -m pytest -q tests/test_cuda_backward.py
"""

from __future__ import annotations

import pytest
import torch

import torch.nn.functional as F
from dlogits_cases import dlogits_case
from kernel_helpers import assert_bitwise, n_diff, randn
from swiglu_cases import cases, describe_diff, same_bits

from rlkernel.kernels import logprobs as logprobs_mod
from rlkernel.kernels.activation import swiglu, swiglu_bwd_torch, swiglu_fwd_torch
from rlkernel.kernels.logprobs import (_div_t, _dlogits, _dlogits_by_rows, _forward_stats,
                                       token_logprobs_entropy)
from rlkernel.kernels.matmul import column_parallel_dx
from rlkernel.spec import VIRTUAL_TP
from test_kernels_attention import (ATTN_LENGTHS, _attn_grads, _pack,
                                    stock_sdpa_grads_alone_and_batched)
from test_kernels_elementwise_norm import assert_rms_rows_invariant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda"


def _cuda(*ts):
    return tuple(t.to(DEV) for t in ts)


def _packed_args():
    q, k, v, q_pos, kv_len, q_idx, sl, _ = _pack(ATTN_LENGTHS, seed=76)
    d_out = randn(*q.shape, seed=77)
    q, k, v, q_pos, kv_len, q_idx, d_out = _cuda(q, k, v, q_pos, kv_len, q_idx, d_out)
    return (q, k, v, q_pos, kv_len, q_idx, sl, d_out), q_idx


def test_cuda_attention_grads_of_a_sample_alone_equal_its_grads_in_the_packed_batch():
    """dQ/dK/dV (and the output) of each sample alone (S=1) == its rows in the 3-sample packed
    batch, on CUDA, bitwise."""
    args, q_idx = _packed_args()
    ref = _attn_grads(*args, q_idx >= 0)
    for i, n in enumerate(ATTN_LENGTHS):
        got = _attn_grads(*args, q_idx >= 0, slice(i, i + 1))
        for a, b in zip(got, ref):
            assert a.is_cuda
            assert_bitwise(a[0, :, :n], b[i, :, :n])


def test_cuda_negative_control_stock_sdpa_grads_alone_vs_batched_differ():
    """Negative control: torch SDPA autograd on CUDA gives other dQ/dK/dV bytes for the 66-token
    sample alone than inside the padded batch."""
    (q, k, v, q_pos, kv_len, _, _, d_out), _ = _packed_args()
    alone, batched = stock_sdpa_grads_alone_and_batched(q, k, v, q_pos, kv_len, d_out, 2)
    assert sum(n_diff(a, b) for a, b in zip(alone, batched)) > 0


@pytest.mark.parametrize("shape", [(300, 1024), (300, 8, 128)])
def test_cuda_rms_norm_dx_of_a_row_alone_equals_in_batch_and_at_offset(shape):
    """RMSNorm forward and dX on CUDA: rows at batch 1, 7, 64 == the same rows inside a 283-row
    batch == shifted by 17 rows, bitwise."""
    assert_rms_rows_invariant(*_cuda(randn(*shape, seed=33),
                                     1 + randn(shape[-1], seed=34, scale=0.1),
                                     randn(*shape, seed=35)))


def _swiglu_autograd(g, u, dh):
    """(out, d_gate, d_up) of swiglu(g, u) through autograd with incoming gradient dh."""
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    h = swiglu(gg, uu)
    h.backward(dh)
    return h.detach(), gg.grad, uu.grad


def _swiglu_inputs(m: int, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up, dh [m, i] fp32 on the CPU: row r of gate is randn·10**(−3 + 5.5·r/(m − 1))
    (σ from near-linear to saturated); the first elements hold tests/swiglu_cases.py's
    adversarial (gate, up, dh) triples."""
    gate = randn(m, i, seed=60) * torch.logspace(-3, 2.5, m)[:, None]
    up, dh = randn(m, i, seed=61), randn(m, i, seed=62)
    for t, c in zip((gate, up, dh), cases()):
        t.view(-1)[:c.numel()] = c[:t.numel()]
    return gate, up, dh


def test_cuda_swiglu_triton_and_cuda_torch_path_equal_cpu_torch_path():
    """gate, up, dh [4096, 3072] (adversarial values first): on CUDA, swiglu through autograd
    (the Triton kernels) gives out, d_gate, d_up == the CPU torch path's (swiglu_fwd_torch /
    swiglu_bwd_torch), the Triton forward's sig == the CPU sig, and the torch path run on CUDA
    tensors (float64 ops on the GPU) == the CPU torch path, each bitwise but for NaN payloads
    (swiglu_cases.same_bits). Negative control: stock silu(g)·u on CUDA differs from it."""
    from rlkernel.kernels import triton_activation
    gate, up, dh = _swiglu_inputs(4096, 3072)
    out_c, sig_c = swiglu_fwd_torch(gate, up)
    want = (out_c, sig_c, *swiglu_bwd_torch(dh, gate, up, sig_c))
    g, u, d = _cuda(gate, up, dh)
    out, d_gate, d_up = _swiglu_autograd(g, u, d)
    sig = triton_activation.swiglu_fwd(g, u)[1]
    out_t, sig_t = swiglu_fwd_torch(g, u)
    for arm, got in (("triton", (out, sig, d_gate, d_up)),
                     ("cuda torch path", (out_t, sig_t, *swiglu_bwd_torch(d, g, u, sig_t)))):
        for name, a, b in zip(("out", "sig", "d_gate", "d_up"), got, want):
            assert same_bits(a.cpu(), b), f"{arm} {name}: {describe_diff(a.cpu(), b, gate, up)}"
    assert not same_bits((F.silu(g) * u).cpu(), out_c)


@pytest.mark.parametrize("i", [3072, 1000])
def test_cuda_swiglu_grads_of_a_row_alone_equal_in_batch(i):
    """SwiGLU forward, d_gate and d_up on CUDA (the Triton kernels): rows at batch 1 and 7 ==
    inside a 300-row batch; rows 0 and 299 alone == in the batch (i = 1000: rows straddle the
    kernel's 1024-element blocks); adversarial values in the first rows."""
    g, u, dh = _cuda(*_swiglu_inputs(300, i))

    def fwd_bwd(rows):
        return _swiglu_autograd(g[rows], u[rows], dh[rows])

    ref = fwd_bwd(slice(0, 300))
    for start, m in ((5, 1), (5, 7), (0, 1), (299, 1)):
        for a, b in zip(fwd_bwd(slice(start, start + m)), ref):
            assert_bitwise(a, b[start:start + m])


@pytest.mark.parametrize("n,k", [(3072, 1024), (1536, 1024)])
def test_cuda_column_parallel_dx_row_alone_equals_row_in_batch(n, k):
    """Column-parallel dX = dY·W (fp32 Triton chain, virtual-TP tree) on CUDA: row r at batch 1,
    7, 64 == row r inside a 257-row batch == shifted by 17 rows, bitwise."""
    dy, w = _cuda(randn(274, n, seed=50), randn(n, k, seed=51, scale=0.05))
    big = column_parallel_dx(dy[17:], w)
    shifted = column_parallel_dx(dy, w)
    for m in (1, 7, 64):
        assert_bitwise(column_parallel_dx(dy[17:17 + m], w), big[:m])
    assert_bitwise(shifted[17:], big)


def test_cuda_negative_control_cublas_dx_row_changes_with_batch():
    """Negative control: stock dY @ W on CUDA (cuBLAS, bf16 and fp32): row 0 at batch 1 differs
    from row 0 at batch 257 for at least one dtype (the REFERENCES.md measurement: bf16 at M ≥ 64)."""
    diffs = []
    for dt in (torch.bfloat16, torch.float32):
        dy, w = _cuda(randn(257, 4096, seed=52).to(dt), randn(4096, 4096, seed=53).to(dt))
        diffs.append(n_diff((dy[:1] @ w).float(), (dy @ w)[:1].float()))
    assert max(diffs) > 0, diffs


# ------------------------------------------------------------------ LM head d logits
_DL_N, _DL_V, _DL_LIVE, _DL_T = 512, 151936, 151669, 0.7


@pytest.fixture(scope="module")
def dl_case():
    """tests/dlogits_cases.dlogits_case(512, 151936, T = 0.7, live 151669) on the GPU (z, lse
    and entropy from the CUDA forward), and the same tensors copied to the CPU."""
    cuda = dlogits_case(_DL_N, _DL_V, _DL_T, _DL_LIVE, seed=11, device=DEV)
    return cuda, tuple(t.cpu() for t in cuda)


def _dl(case, dtype, rows=slice(None), from_logits=False):
    """logprobs._dlogits_by_rows over `rows` of a case, from z or from the logits."""
    logits, z, tg, lse, ent, g_lp, g_ent = (t[rows] for t in case)
    x = logits if from_logits else z
    return _dlogits_by_rows(lambda a, b: x[a:b], x.shape[1], tg, lse, ent, g_lp, g_ent, _DL_T,
                            dtype, live_vocab=_DL_LIVE if from_logits else None,
                            from_logits=from_logits)


def test_cuda_dlogits_triton_equals_cpu_torch_path(dl_case):
    """d logits of 512 rows × 151936 ids (live 151669, T = 0.7, g_ent given; the special rows of
    tests/dlogits_cases.py first: p underflow, exp64's clamp, ±0 / huge / subnormal g): on CUDA
    (logprobs._dlogits_by_rows -> kernels/triton_dlogits.py, in row chunks), from z and from
    the logits, fp32 and bf16 out == the CPU torch path, bitwise but for NaN payloads
    (swiglu_cases.same_bits). Negative control: the torch path run on CUDA tensors differs
    (torch's CUDA x / T multiplies by 1/T)."""
    cuda, cpu = dl_case
    want = _dl(cpu, torch.float32)
    for dt in (torch.float32, torch.bfloat16):
        for from_logits in (False, True):
            got = _dl(cuda, dt, from_logits=from_logits).cpu()
            assert same_bits(got, want.to(dt)), \
                f"{dt} from_logits={from_logits}: {describe_diff(got.float(), want.to(dt).float())}"
    _, z, tg, lse, ent, g_lp, g_ent = (t[:16] for t in cuda)
    assert not same_bits(_dlogits(z, tg, lse, ent, g_lp, g_ent, _DL_T).cpu(), want[:16])


def test_cuda_dlogits_of_a_row_alone_equal_in_batch(dl_case, monkeypatch):
    """d logits on CUDA, from z and from the logits, fp32 and bf16: rows 0, 3, 100, 511 alone
    (N = 1) and rows 5..11 (N = 7) == the same rows inside the 512-row batch, and the batch in
    3-row chunks (logprobs.ROWS_ELEMS) == in the default chunks, bitwise."""
    cuda, _ = dl_case
    for dt in (torch.float32, torch.bfloat16):
        for fl in (False, True):
            ref = _dl(cuda, dt, from_logits=fl)
            for start, m in ((0, 1), (3, 1), (100, 1), (_DL_N - 1, 1), (5, 7)):
                assert_bitwise(_dl(cuda, dt, slice(start, start + m), fl), ref[start:start + m])
            with monkeypatch.context() as mp:
                mp.setattr(logprobs_mod, "ROWS_ELEMS", 3 * _DL_V)
                assert_bitwise(_dl(cuda, dt, from_logits=fl), ref)


def test_cuda_token_logprobs_backward_equals_cpu_torch_path(dl_case):
    """token_logprobs_entropy on CUDA (the first 64 rows: special g_lp / g_ent included; live
    151669, T = 0.7) through autograd with loss Σ g_lp·logprob + g_ent·entropy: d logits ==
    the CPU torch path on the CUDA forward's z, lse and entropy, bitwise but for NaN payloads."""
    cuda, _ = dl_case
    logits = cuda[0][:64].clone().requires_grad_()
    tg, g_lp, g_ent = cuda[2][:64], cuda[5][:64], cuda[6][:64]
    lp, ent = token_logprobs_entropy(logits, tg, _DL_T, live_vocab=_DL_LIVE)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    z = _div_t(logits.detach(), _DL_T, _DL_LIVE)
    lse, ent_f = _forward_stats(z, VIRTUAL_TP)
    zc = z.cpu()
    want = _dlogits_by_rows(lambda a, b: zc[a:b], _DL_V, tg.cpu(), lse.cpu(), ent_f.cpu(),
                            g_lp.cpu(), g_ent.cpu(), _DL_T, torch.float32)
    got = logits.grad.cpu()
    assert same_bits(got, want), describe_diff(got, want)


def _tiny_sink_grads(monkeypatch, dtype, tied: bool):
    """(grads(micro_batch_tokens) -> every gradient of the tiny model (tied or not) on CUDA over
    4 fixed samples, the GradSink's (split names, accumulator names, direct) at each finish,
    the tokens one sample counts toward the budget)."""
    from rlkernel.distributed import tokensum
    from rlkernel.model.checkpoint import init_weights
    from rlkernel.model.config import preset
    from rlkernel.model.ops import ops_for
    from rlkernel.model.qwen3 import Qwen3ForCausalLM
    from rlkernel.train.losses import LossCoefs, invariant_exp
    from rlkernel.train.step import TrainSample, compute_gradients

    cfg = preset("tiny").replace(tie_word_embeddings=tied)
    weights = init_weights(cfg, 0)
    samples = [TrainSample(i, tuple(range(1, 9)), tuple(range(10 + i, 30 + i)),
                           torch.full((20,), -2.0), 1.0 if i % 2 else -1.0) for i in range(4)]
    seen = []
    real = tokensum.GradSink.finish

    def spy(self):
        seen.append((set(self._split), set(self._acc), self.direct))
        return real(self)
    monkeypatch.setattr(tokensum.GradSink, "finish", spy)

    def grads(budget):
        pol = Qwen3ForCausalLM(cfg, ops_for("invariant"), dtype).to(DEV)
        pol.load_tensors({k: v.to(DEV) for k, v in weights.items()})
        compute_gradients(pol, None, samples, temperature=1.0,
                          coefs=LossCoefs(0.2, 0.0, 0.01, "k3"), micro_batch_tokens=budget,
                          pad_id=0, exp=invariant_exp)
        return {n: p.grad.clone() for n, p in pol.logical_params().items()}
    return grads, seen, len(samples[0].prompt_ids) + len(samples[0].response_ids)


def _differing(a: dict, b: dict) -> list[str]:
    return [n for n in a if not torch.equal(a[n].view(torch.int32), b[n].view(torch.int32))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_embedding_split_in_direct_mode_gives_the_persistent_bytes(monkeypatch, dtype):
    """The tiny tied model on CUDA: one microbatch (direct mode: the LM head's dW finishes every
    row from its double words and keeps exact partials of the looked-up rows, the lookup adds
    into them; tokensum.GradSink.note_rows) == two and four microbatches (persistent: the head's
    sum carried in words, the lookups into a growing accumulator of their rows) == two
    microbatches with the split off (the whole-weight accumulator), every gradient bytewise;
    the split really ran where asked (no embedding accumulator) and not where it was off."""
    from rlkernel.distributed import tokensum

    grads, seen, per = _tiny_sink_grads(monkeypatch, dtype, tied=True)
    emb = "model.embed_tokens.weight"
    one = grads(4 * per)                        # all four samples: one microbatch
    two = grads(2 * per)                        # two samples each: two microbatches
    four = grads(per)                           # one each: the split rows grow three times
    with monkeypatch.context() as mp:           # the kept weight's whole-weight accumulator
        mp.setattr(tokensum.GradSink, "note_rows", lambda self, *a, **k: None)
        whole = grads(2 * per)
    assert seen[0][:2] == ({emb}, set()), seen
    assert all(sp == {emb} and emb not in acc for sp, acc, _ in seen[1:3]), seen   # head: words
    assert emb in seen[3][1] and not seen[3][0], seen
    for other in (two, four, whole):
        assert _differing(one, other) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_untied_embedding_split_in_direct_mode_gives_the_chunked_bytes(monkeypatch, dtype):
    """The tiny model untied on CUDA: one microbatch (direct mode: the lookup's backward splits
    the lookup-only embedding over its looked-up rows, GradSink._direct_split, since
    2026-12-05) == the same with SPLIT_MAX_FRACTION 0 (no split: finish_direct's row chunks, the
    path before) == two and four microbatches (persistent: the rows' accumulator grows), every
    gradient bytewise; the split ran where asked and not where it was off."""
    from rlkernel.distributed import tokensum

    grads, seen, per = _tiny_sink_grads(monkeypatch, dtype, tied=False)
    emb = "model.embed_tokens.weight"
    one = grads(4 * per)
    with monkeypatch.context() as mp:
        mp.setattr(tokensum, "SPLIT_MAX_FRACTION", 0.0)
        chunked = grads(4 * per)
    two, four = grads(2 * per), grads(per)
    assert seen[0] == ({emb}, set(), True), seen
    assert seen[1] == (set(), set(), True), seen
    assert all(sp == {emb} and emb not in acc and not d for sp, acc, d in seen[2:]), seen
    for other in (chunked, two, four):
        assert _differing(one, other) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_late_dkv_flags_give_the_eager_bytes_and_a_flagged_pass_runs_again(monkeypatch, dtype):
    """The tiny model on CUDA, one and two microbatches: the trainer's late first pass (the
    attention dK/dV flags counted on the device, no host sync per layer: GradSink "Late
    activation flags") == the eager pass (late_counter off: the flags read per chunk), every
    gradient bytewise; with every dK/dV program forced to the third tier in the late pass only
    (force_flag), compute_gradients counts them, runs the mini-batch again eagerly and ends
    with the same bytes. Control: the forced late pass alone (its check skipped) leaves
    gradients that differ — the words of a third-tier program are not its exact sum."""
    from rlkernel.distributed import tokensum
    from rlkernel.kernels import triton_attention_bwd as tb
    from rlkernel.model.ops import InvariantOps

    grads, seen, per = _tiny_sink_grads(monkeypatch, dtype, tied=True)
    real_launch = tb._launch_dkv

    def forced_when_late(args, out, flags, pids, kind, s0, j0, width, n_tiles_k, n_leaves,
                         grid, tile, emit, force_flag, retry=False):
        late = args[0].is_cuda and _late_now[0]
        real_launch(args, out, flags, pids, kind, s0, j0, width, n_tiles_k, n_leaves, grid,
                    tile, emit, force_flag or (late and not emit), retry)

    _late_now = [False]
    real_counter = tokensum.GradSink.late_counter

    def counter(self, device):
        c = real_counter(self, device)
        _late_now[0] = c is not None
        return c
    for budget in (4 * per, 2 * per):
        late = grads(budget)
        with monkeypatch.context() as mp:
            mp.setattr(tokensum.GradSink, "late_counter", lambda self, device: None)
            eager = grads(budget)
        assert _differing(late, eager) == []
        with monkeypatch.context() as mp:
            mp.setattr(tokensum.GradSink, "late_counter", counter)
            mp.setattr(tb, "_launch_dkv", forced_when_late)
            redone = grads(budget)
            assert _differing(late, redone) == []
            mp.setattr(InvariantOps, "late_flagged", staticmethod(lambda model: False))
            wrong = grads(budget)
        assert _differing(late, wrong), "control: the forced third tier changed nothing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_late_dw_tiles_give_the_eager_bytes_and_a_flagged_pass_runs_again(monkeypatch, dtype):
    """The tiny model on CUDA, one and two microbatches: the trainer's late first pass (dW
    tiles its double words could not hold counted in the sink's late tile counter: no copy,
    event or wait per dW call, GradSink.flag_count/_defer) == the eager pass (the sink not
    late: each call's count read behind its event), every gradient bytewise; with every dW
    tile forced flagged in the late pass only (carried words and direct-mode rounded words),
    compute_gradients sees the count, runs the mini-batch again eagerly and ends with the same
    bytes. Control: the forced late pass alone (its check skipped) leaves gradients that
    differ — a flagged tile's words miss that call's partials."""
    from rlkernel.distributed import tokensum
    from rlkernel.kernels import triton_grad_weight as tgw
    from rlkernel.model.ops import InvariantOps

    grads, _, per = _tiny_sink_grads(monkeypatch, dtype, tied=True)
    real_carry, real_rounded = tgw.carry_grad_weight_deferred, tgw.rounded_grad_weight_deferred
    real_count, real_begin = tokensum.GradSink.flag_count, tokensum.GradSink.begin
    late_now = [False]

    def begin(self, *a, **k):
        late_now[0] = bool(k.get("late", False))
        return real_begin(self, *a, **k)

    def carry(words, dy, x, **kw):
        return real_carry(words, dy, x, **{**kw, "force_flag": late_now[0]})

    def rounded(dy, x, **kw):
        return real_rounded(dy, x, **{**kw, "force_flag": late_now[0]})
    for budget in (4 * per, 2 * per):
        late = grads(budget)
        with monkeypatch.context() as mp:     # eager: the sink never opened late
            mp.setattr(tokensum.GradSink, "begin",
                       lambda self, *a, **k: real_begin(self, *a, **{**k, "late": False}))
            eager = grads(budget)
        assert _differing(late, eager) == []
        with monkeypatch.context() as mp:
            counted = []
            mp.setattr(tokensum.GradSink, "begin", begin)
            mp.setattr(tokensum.GradSink, "flag_count",
                       lambda self, d: counted.append(self.late) or real_count(self, d))
            mp.setattr(tgw, "carry_grad_weight_deferred", carry)
            mp.setattr(tgw, "rounded_grad_weight_deferred", rounded)
            redone = grads(budget)
            assert _differing(late, redone) == []
            assert (True in counted) == (budget == 2 * per)   # carried words: persistent only
            mp.setattr(InvariantOps, "late_flagged", staticmethod(lambda model: False))
            wrong = grads(budget)
        assert _differing(late, wrong), "control: the forced dW flags changed nothing"
