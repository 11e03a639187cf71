"""The train step's logprob comparison (rlkernel/train/step.py): `logprob_compared` (the evidence's
`logprob_tokens`) counts the (trainer, rollout) pairs actually compared, not the planned count;
under CP the mismatch, compared and clipped counts cover every CP rank's tokens (2 gloo ranks);
the CUDA stream alignment changes no CPU gradient bit; the attention output reaching o_proj in
bf16 (no widened copy) changes none either, nor does the MLP as one autograd node (kernels/mlp.py).

Run: `.venv/bin/python -m pytest -q tests/test_train_step.py`.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from rlkernel.config import RunConfig
from rlkernel.distributed.comm import Comm
from rlkernel.distributed.launch import launch
from rlkernel.distributed.parallel import ParallelCtx
from rlkernel.model.checkpoint import init_weights
from rlkernel.model.config import tiny
from rlkernel.model.ops import InvariantOps
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.rollout.engine import Request, RolloutEngine, SamplingParams
from rlkernel.train import step as step_mod
from rlkernel.train.losses import LossCoefs, invariant_exp
from rlkernel.train.step import TrainSample, compute_gradients, gradients, microbatches

CFG = tiny()
W = init_weights(CFG, 0)
SP = SamplingParams(temperature=0.8, top_p=1.0, max_new_tokens=8, seed=3, eos_id=256)


def _model(pc: ParallelCtx | None = None) -> Qwen3ForCausalLM:
    m = Qwen3ForCausalLM(CFG, InvariantOps, torch.bfloat16, pc)
    m.load_tensors(W)
    return m


def _samples() -> list[TrainSample]:
    eng = RolloutEngine(CFG, InvariantOps, torch.bfloat16, pad_id=257)
    eng.load_weights(W)
    reqs = [Request(i, tuple(range(40 + i, 47 + 2 * i))) for i in range(3)]
    return [TrainSample(c.sample_id, c.prompt_ids, tuple(c.response_ids), c.logprob_tensor(), 0.5)
            for c in eng.generate(reqs, SP)]


def _stats(samples, pc: ParallelCtx | None = None):
    ref = _model(pc).requires_grad_(False)
    return compute_gradients(_model(pc), ref, samples, temperature=SP.temperature,
                             coefs=LossCoefs(0.2, 0.0, 0.0, "k1"), micro_batch_tokens=512,
                             pad_id=257,
                             exp=invariant_exp)


def test_no_reference_policy_at_kl_coef_0_changes_no_gradient_bit():
    """--kl-coef 0 keeps no reference policy (rlk run passes ref=None, as TRL does at beta 0):
    every gradient, the loss and the entropy have the bytes of the run with a reference, and
    kl is None (not measured) instead of a number. Control: kl_coef 0.1 with the reference
    moves the gradients, so the comparison can fail; kl_coef > 0 without one is refused."""
    samples = _samples()

    def run(ref, kl_coef=0.0):
        pol = _model()
        st = compute_gradients(pol, ref, samples, temperature=SP.temperature,
                               coefs=LossCoefs(0.2, kl_coef, 0.01, "k1"),
                               micro_batch_tokens=512, pad_id=257, exp=invariant_exp)
        return st, {n: p.grad.view(torch.int32).clone() for n, p in pol.named_parameters()}
    with_ref, g_ref = run(_model().requires_grad_(False))
    without, g_none = run(None)
    assert without.kl is None and isinstance(with_ref.kl, float)
    assert dataclasses.replace(with_ref, kl=None) == without
    assert g_ref.keys() == g_none.keys() and all(torch.equal(g_ref[n], g_none[n]) for n in g_ref)
    _, g_kl = run(_model().requires_grad_(False), kl_coef=0.1)
    assert any(not torch.equal(g_kl[n], g_none[n]) for n in g_none)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs the reference logprobs"):
        run(None, kl_coef=0.1)


def test_cuda_stream_alignment_changes_no_cpu_gradient_bit(monkeypatch):
    """The packer's CUDA alignment (spec.stream_leaf: samples at multiples of CUDA_TOKEN_LEAF,
    CP/SP cuts at its multiples) on the CPU backend, whose token reductions keep TOKEN_LEAF
    leaves: every gradient and stat has the bytes of the CPU alignment, and the layout really
    moved (sample 1 starts at row 128 instead of 16·k). So the CUDA alignment logic is covered
    by the CPU path, and padding/alignment never enters a number."""
    from rlkernel.spec import CUDA_TOKEN_LEAF, TOKEN_LEAF

    samples = _samples()
    pc = ParallelCtx.single()
    lay16 = microbatches(samples, 512, 257, pc)[0][0]
    lay64 = microbatches(samples, 512, 257, pc, leaf=CUDA_TOKEN_LEAF)[0][0]
    first = [int(lay.q_idx[1, 0]) for lay in (lay16, lay64)]
    assert first[0] % TOKEN_LEAF == 0 and first[1] == CUDA_TOKEN_LEAF != first[0]

    def run():
        pol = _model()
        st = compute_gradients(pol, None, samples, temperature=SP.temperature,
                               coefs=LossCoefs(0.2, 0.0, 0.01, "k1"), micro_batch_tokens=512,
                               pad_id=257, exp=invariant_exp)
        return st, {n: p.grad.view(torch.int32).clone() for n, p in pol.named_parameters()}
    st16, g16 = run()
    monkeypatch.setattr(step_mod, "stream_leaf", lambda device_type: CUDA_TOKEN_LEAF)
    st64, g64 = run()
    assert st16 == st64
    assert all(torch.equal(g16[n], g64[n]) for n in g16)


def test_stream_multiple_and_packed_len_hold_whole_leaves_of_both_sizes():
    """stream_multiple = 2·CP·max(leaf, TOKEN_LEAF·TP under SP): at CP4 with the CUDA leaf 1024,
    under SP at TP8 (16·8 = 128) 2·4·128 = 1024, and at SP TP16 with the CUDA leaf 2·4·256; packed_len aligns every sample to the leaf and
    pads to the multiple; a leaf that is not a multiple of TOKEN_LEAF is refused, and so is a
    multiple that is not a multiple of the leaf."""
    from rlkernel.distributed.parallel import stream_multiple
    from rlkernel.model.layout import packed_len, sample_offsets
    from rlkernel.spec import CUDA_TOKEN_LEAF, TOKEN_LEAF

    base = ParallelCtx.single()
    cp4 = dataclasses.replace(base, cp=Comm("cp", None, range(4), 0))
    sp8 = dataclasses.replace(cp4, tp=Comm("tp", None, range(8), 0), sp=True)
    assert stream_multiple(base) == 2 * TOKEN_LEAF
    sp16 = dataclasses.replace(sp8, tp=Comm("tp", None, range(16), 0))
    assert stream_multiple(cp4, CUDA_TOKEN_LEAF) == 1024
    assert stream_multiple(sp8, CUDA_TOKEN_LEAF) == 1024 == stream_multiple(sp8)
    assert stream_multiple(sp16, CUDA_TOKEN_LEAF) == 2048
    assert sample_offsets([70, 1, 64], CUDA_TOKEN_LEAF) == [0, 128, 256]
    assert sample_offsets([70, 1, 64], 64) == [0, 128, 192]
    assert packed_len([70, 1, 64], 512, CUDA_TOKEN_LEAF) == 512
    assert packed_len([70, 1, 64], 16) == 80 + 16 + 64
    with pytest.raises(ValueError, match="stream leaf 24"):
        sample_offsets([5], 24)
    with pytest.raises(ValueError, match="multiple 64 is not a multiple of the stream leaf 128"):
        packed_len([5], 64, CUDA_TOKEN_LEAF)


@pytest.mark.parametrize("leaf", [16, 64, 128])
def test_loss_rows_and_row_samples_follow_the_layout_of_the_leaf(leaf):
    """Per microbatch row, at either stream leaf: the loss mask, target ids and the row's
    mini-batch sample index (what the per-sample loss weights are gathered by) sit exactly on the
    rows that predict a response token in the packed layout (lay.q_idx of each sample: rows
    p − 1 .. p + r − 2), mask and index agree (index −1 elsewhere), and the samples start at
    multiples of the leaf."""
    samples = _samples()
    index = [7, 3, 5]
    (lay, (targets, mask, _, _, who), _), = microbatches(samples, 512, 257,
                                                         ParallelCtx.single(), index, leaf=leaf)
    want_who = torch.full_like(who, -1)
    want_tgt = torch.zeros_like(targets)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        assert int(lay.q_idx[i, 0]) % leaf == 0
        rows = lay.q_idx[i, p - 1:p + r - 1]
        want_who[rows] = index[i]
        want_tgt[rows] = torch.tensor(s.response_ids)
    assert torch.equal(who, want_who)
    assert torch.equal(mask, want_who >= 0)
    assert torch.equal(targets, want_tgt)
    if leaf != 16:     # control: the layout really differs from the CPU leaf's
        lay16 = microbatches(samples, 512, 257, ParallelCtx.single(), index)[0][0]
        assert not torch.equal(lay16.q_idx, lay.q_idx)


def test_the_step_packs_with_the_backends_stream_leaf(monkeypatch):
    """spec.stream_leaf: CUDA_TOKEN_LEAF for "cuda", TOKEN_LEAF otherwise; compute_gradients and
    rollout_mismatches pack their microbatches with stream_leaf of the policy's device (patched
    to CUDA's here: every sample starts at a multiple of 128). Control: unpatched, on the CPU, a
    sample starts off a multiple of 128."""
    from rlkernel.spec import CUDA_TOKEN_LEAF, TOKEN_LEAF, stream_leaf

    assert stream_leaf("cuda") == CUDA_TOKEN_LEAF == 128
    assert stream_leaf("cpu") == TOKEN_LEAF == 16
    samples = _samples()
    starts: list[int] = []
    real = step_mod.microbatches

    def spy(*args, **kw):
        mbs = real(*args, **kw)
        for lay, _, _ in mbs:
            starts.extend(int(lay.q_idx[i, 0]) for i in range(lay.n_samples))
        return mbs

    monkeypatch.setattr(step_mod, "microbatches", spy)

    def run():
        starts.clear()
        pol = _model()
        compute_gradients(pol, None, samples, temperature=SP.temperature,
                          coefs=LossCoefs(0.2, 0.0, 0.01, "k1"), micro_batch_tokens=512,
                          pad_id=257, exp=invariant_exp)
        n_cg = len(starts)
        step_mod.rollout_mismatches(pol, samples, temperature=SP.temperature,
                                    micro_batch_tokens=512, pad_id=257)
        assert n_cg == len(samples) == len(starts) - n_cg
        return list(starts)

    assert any(x % CUDA_TOKEN_LEAF for x in run()), "control: CPU starts all multiples of 128"
    monkeypatch.setattr(step_mod, "stream_leaf", lambda device_type: CUDA_TOKEN_LEAF)
    assert all(x % CUDA_TOKEN_LEAF == 0 for x in run())


def test_logprob_compared_counts_the_compared_pairs(monkeypatch):
    """every response token compared once -> compared == N, 0 mismatches; a layout that compares
    one token fewer per sample (loss_rows mutated) -> compared == N − samples, N unchanged."""
    samples = _samples()
    n = sum(len(s.response_ids) for s in samples)
    st = _stats(samples)
    assert (st.n_tokens, st.logprob_compared, st.logprob_mismatches) == (n, n, 0)

    real = step_mod.loss_rows

    def drop_last_row_of_each_sample(group, lay):
        targets, mask, old, adv = real(group, lay)
        rows = mask.nonzero(as_tuple=True)[0]
        ends = torch.cumsum(torch.tensor([len(s.response_ids) for s in group]), 0) - 1
        mask[rows[ends]] = False
        return targets, mask, old, adv

    monkeypatch.setattr(step_mod, "loss_rows", drop_last_row_of_each_sample)
    st = _stats(samples)
    assert st.n_tokens == n and st.logprob_compared == n - len(samples)


def _changed(samples) -> tuple[list[TrainSample], int, int]:
    """The samples with every third response token's rollout logprob changed (k = its index over
    all response tokens): k % 6 == 0 one ulp down (a byte mismatch whose ratio rounds to ~1: not
    clipped), k % 6 == 3 one nat down (ratio e > 1 + ε with advantage 0.5: clipped).
    Returns (samples, tokens changed, tokens pushed past the clip)."""
    out, k, n_changed, n_far = [], 0, 0, 0
    for s in samples:
        old = s.rollout_logprobs.clone()
        for j in range(old.numel()):
            if k % 6 == 0:
                old[j] = torch.nextafter(old[j], torch.tensor(float("-inf")))
                n_changed += 1
            elif k % 6 == 3:
                old[j] = old[j] - 1.0
                n_changed += 1
                n_far += 1
            k += 1
        out.append(dataclasses.replace(s, rollout_logprobs=old))
    return out, n_changed, n_far


def _cp2_rank(rank: int, samples: list[TrainSample], out_dir: str) -> None:
    """One of 2 CP ranks (gloo): compute_gradients on `samples`; pickles its StepStats."""
    import torch.distributed as dist

    from rlkernel.distributed.context import build_contexts
    from rlkernel.distributed.topology import Topology, build_comms

    topo = Topology.from_config(RunConfig(cp=2), rank, dist.get_world_size())
    pc, _ = build_contexts(topo, build_comms(topo), CFG)
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(_stats(samples, pc), f)


def _changed_rows_per_cp_rank(samples, changed, cp: int) -> list[int]:
    """Per CP rank: loss rows it holds (train.step.microbatches) whose rollout logprob bytes
    differ between `samples` and `changed` (layout only: no process group needed)."""
    counts = []
    for r in range(cp):
        pc = dataclasses.replace(ParallelCtx.single(), cp=Comm("cp", None, range(cp), r))
        n = 0
        for (_, a, _), (_, b, _) in zip(microbatches(samples, 512, 257, pc),
                                        microbatches(changed, 512, 257, pc)):
            mask, old_a, old_b = a[1], a[2], b[2]
            n += int((old_a[mask].view(torch.int32) != old_b[mask].view(torch.int32)).sum())
        counts.append(n)
    return counts


def test_cp2_mismatch_compared_and_clipped_counts_cover_every_cp_rank(tmp_path):
    """Rollout logprobs of every third response token changed (n of them, f of those past the
    clip): TP1 compute_gradients reports mismatches == n, compared == N, clipped == f; at CP=2
    (2 gloo ranks) EVERY rank reports the same (mismatches, compared, clipped, n_tokens) — the
    evidence's counts are over all active tokens, whatever CP. Control: each CP rank holds some
    changed tokens (rank 0 holds k0 with 0 < k0 < n), so a count of one rank's tokens only
    would not be n."""
    samples = _samples()
    n_tok = sum(len(s.response_ids) for s in samples)
    changed, n, f = _changed(samples)
    per_rank = _changed_rows_per_cp_rank(samples, changed, 2)
    assert sum(per_rank) == n and all(0 < k < n for k in per_rank), per_rank
    st = _stats(changed)
    assert (st.n_tokens, st.logprob_mismatches, st.logprob_compared, st.n_clipped) == \
        (n_tok, n, n_tok, f)
    launch(_cp2_rank, (changed, str(tmp_path)), world_size=2, backend="gloo", timeout_s=120)
    for r in range(2):
        with open(tmp_path / f"rank{r}.pkl", "rb") as fh:
            got = pickle.load(fh)
        assert (got.n_tokens, got.logprob_mismatches, got.logprob_compared, got.n_clipped) == \
            (n_tok, n, n_tok, f), f"CP rank {r}"


def _step_bits(samples):
    """Stats and gradients (int32 bits) of one bf16 step without a reference policy."""
    pol = _model()
    st = compute_gradients(pol, None, samples, temperature=SP.temperature,
                           coefs=LossCoefs(0.2, 0.0, 0.01, "k1"), micro_batch_tokens=512,
                           pad_id=257, exp=invariant_exp)
    return st, {n: g.view(torch.int32).clone() for n, g in gradients(pol).items()}


def test_attention_output_into_o_proj_without_a_widened_copy_changes_no_bit(monkeypatch):
    """bf16 runs hand attention's bf16 output to o_proj as it is (o_proj's backward rounds dX to
    bf16, dO's rounding point) instead of widening it to fp32 for o_proj to round back: every
    gradient and stat has the bytes of the widening path (the code before 2026-12-05), which
    really ran (o_proj saw fp32 inputs then, bf16 now)."""
    from rlkernel.kernels import matmul as matmul_mod

    samples = _samples()
    seen: list[torch.dtype] = []
    real = matmul_mod._RowParallelLinear.forward

    def watched(ctx, x, *rest):
        seen.append(x.dtype)
        return real(ctx, x, *rest)

    monkeypatch.setattr(matmul_mod._RowParallelLinear, "forward", staticmethod(watched))
    st_new, g_new = _step_bits(samples)
    assert torch.bfloat16 in seen                      # o_proj's x: the bf16 attention output
    seen.clear()
    for name in ("attention", "attention_packed"):   # the old path: the output widened
        def widened(*args, _op=getattr(InvariantOps, name), **kw):
            return _op(*args, **kw).to(torch.float32)
        monkeypatch.setattr(InvariantOps, name, staticmethod(widened))
    st_old, g_old = _step_bits(samples)
    assert torch.bfloat16 not in seen
    assert st_new == st_old and g_new.keys() == g_old.keys()
    assert all(torch.equal(g_new[n], g_old[n]) for n in g_new)


def _separate_mlp(x, w_gate, w_up, w_down, local_shards, pc, dtype=torch.float32):
    """The MLP as the three ops it fuses (kernels/mlp.py's reference)."""
    g, u = InvariantOps.col(x, [w_gate, w_up], None, local_shards, pc, dtype)
    return InvariantOps.row(InvariantOps.swiglu(g, u), w_down, local_shards, pc, dtype)


def test_fused_mlp_is_bitwise_the_separate_linears_and_swiglu(monkeypatch):
    """The MLP as one autograd node (kernels/mlp.py) against gate/up column-parallel, SwiGLU
    and down row-parallel as separate ops: every gradient and stat of a bf16 step has the same
    bytes, and the fused node really ran (its backward counted). Control: the separate path
    with SwiGLU's output not rounded before down (an fp32 down product) moves the gradients."""
    from rlkernel.kernels import mlp as mlp_mod

    samples = _samples()
    calls = {"backward": 0}
    real = mlp_mod._SwiGLUMLP.backward

    def counted(ctx, dy):
        calls["backward"] += 1
        return real(ctx, dy)

    monkeypatch.setattr(mlp_mod._SwiGLUMLP, "backward", staticmethod(counted))
    st_fused, g_fused = _step_bits(samples)
    assert calls["backward"] == CFG.num_hidden_layers
    monkeypatch.setattr(InvariantOps, "mlp", staticmethod(_separate_mlp))
    st_sep, g_sep = _step_bits(samples)
    assert st_fused == st_sep and g_fused.keys() == g_sep.keys()
    assert all(torch.equal(g_fused[n], g_sep[n]) for n in g_fused)

    def unrounded(x, w_gate, w_up, w_down, local_shards, pc, dtype=torch.float32):
        g, u = InvariantOps.col(x, [w_gate, w_up], None, local_shards, pc, dtype)
        return InvariantOps.row(InvariantOps.swiglu(g, u), w_down, local_shards, pc,
                                torch.float32)
    monkeypatch.setattr(InvariantOps, "mlp", staticmethod(unrounded))
    _, g_ctl = _step_bits(samples)
    assert any(not torch.equal(g_ctl[n], g_fused[n]) for n in g_fused)


def test_swiglu_mlp_refuses_weights_that_do_not_form_an_mlp():
    from rlkernel.kernels.mlp import swiglu_mlp
    x, wg, wd = torch.zeros(16, 8), torch.zeros(12, 8), torch.zeros(8, 12)
    with pytest.raises(ValueError, match="expected gate and up"):
        swiglu_mlp(x, wg, torch.zeros(12, 7), wd)
    with pytest.raises(ValueError, match="expected gate and up"):
        swiglu_mlp(x, wg, wg, torch.zeros(12, 8))
    with pytest.raises(ValueError, match="compute dtype"):
        swiglu_mlp(x, wg, wg, wd, compute_dtype=torch.float16)


def _flaky_attention(monkeypatch, passes: list[bool], flag: bool = True) -> None:
    """Patch the CPU attention backward to act like a CUDA one whose dV words met a third-tier
    program (kernels/triton_attention_bwd.py): under a late sink it counts one late flag and
    returns a wrong dV (the words are not the exact sum); under an eager sink it is the real
    backward. Each call appends whether its sink was late to `passes`; flag=False counts
    nothing (a rank whose kernels all checked exact)."""
    from rlkernel.kernels import attention

    real = attention.attention_backward

    def flaky(q, k, v, out, lse, d_out, q_pos, kv_len, scale, tok, kv_comm):
        dq, dk, dv = real(q, k, v, out, lse, d_out, q_pos, kv_len, scale, tok, kv_comm)
        late = tok.late_counter(dv.device)
        passes.append(late is not None)
        if late is not None and flag:
            late.add_(1)
            dv = dv + 1.0
        return dq, dk, dv

    monkeypatch.setattr(attention, "attention_backward", flaky)


def _grads_and_stats(samples, pc: ParallelCtx | None = None, mbt: int = 512):
    pol = _model(pc)
    st = compute_gradients(pol, None, samples, temperature=SP.temperature,
                           coefs=LossCoefs(0.2, 0.0, 0.01, "k1"), micro_batch_tokens=mbt,
                           pad_id=257, exp=invariant_exp)
    return st, {n: g.view(torch.int32).clone() for n, g in step_mod.gradients(pol).items()}


@pytest.mark.parametrize("mbt", [512, 32])
def test_a_late_activation_flag_runs_the_mini_batch_again_with_the_same_bytes(monkeypatch, mbt):
    """The trainer's first pass opens the sink late (no host sync per attention backward); a
    kernel that counted a late flag makes compute_gradients run the whole mini-batch again with
    every flag resolved on the spot: the stats and every gradient have the bytes of a run that
    never flagged, in direct mode (one microbatch) and persistent mode (several, mbt 32). A
    run that flags nothing runs once, late. Control: with the check skipped (late_flagged
    patched to False) the first pass's wrong dV reaches the gradients."""
    samples = _samples()
    clean_passes: list[bool] = []
    _flaky_attention(monkeypatch, clean_passes, flag=False)
    st0, g0 = _grads_and_stats(samples, mbt=mbt)
    n_calls = len(clean_passes)
    assert all(clean_passes)                                   # one late pass, nothing redone
    assert (n_calls > CFG.num_hidden_layers) == (mbt == 32)   # several microbatches at 32
    passes: list[bool] = []
    _flaky_attention(monkeypatch, passes)
    st, g = _grads_and_stats(samples, mbt=mbt)
    assert passes == [True] * n_calls + [False] * n_calls      # late, then eager
    assert st == st0 and g.keys() == g0.keys()
    assert all(torch.equal(g[n], g0[n]) for n in g0)
    monkeypatch.setattr(InvariantOps, "late_flagged", staticmethod(lambda model: False))
    _, bad = _grads_and_stats(samples, mbt=mbt)
    assert any(not torch.equal(bad[n], g0[n]) for n in g0), "control: the wrong dV is harmless"


def _late_cp2_rank(rank: int, samples: list[TrainSample], out_dir: str) -> None:
    """One of 2 CP ranks (gloo): only rank 1's attention counts a late flag; both ranks must
    run the mini-batch again (the check is collective). Pickles (passes, stats, grads)."""
    import torch.distributed as dist

    from rlkernel.distributed.context import build_contexts
    from rlkernel.distributed.topology import Topology, build_comms

    topo = Topology.from_config(RunConfig(cp=2), rank, dist.get_world_size())
    pc, _ = build_contexts(topo, build_comms(topo), CFG)
    passes: list[bool] = []
    with pytest.MonkeyPatch.context() as mp:
        _flaky_attention(mp, passes, flag=rank == 1)
        st, g = _grads_and_stats(samples, pc)
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump((passes, st, g), f)


def test_a_late_flag_on_one_cp_rank_makes_every_rank_run_again(tmp_path):
    """CP=2 (2 gloo ranks), a late flag on rank 1 only: both ranks run the mini-batch a second
    time, eagerly (no rank hangs in the other's collectives), and each ends with the gradients
    and stats of the one-process run that never flagged."""
    samples = _samples()
    st0, g0 = _grads_and_stats(samples)
    launch(_late_cp2_rank, (samples, str(tmp_path)), world_size=2, backend="gloo",
           timeout_s=120)
    for r in range(2):
        with open(tmp_path / f"rank{r}.pkl", "rb") as fh:
            passes, st, g = pickle.load(fh)
        half = len(passes) // 2
        assert half and passes == [True] * half + [False] * half, (r, passes)
        assert st == st0, f"CP rank {r}"
        assert all(torch.equal(g[n], g0[n]) for n in g0), f"CP rank {r}"


def _uneven(samples: list[TrainSample]) -> list[TrainSample]:
    """The samples with their responses cut to 8, 5 and 3 tokens (rollout logprobs cut alike:
    a token's logprob depends only on the tokens before it): unequal lengths, so
    seq-mean-token-mean weighs each sample's terms by its own 1/R_s."""
    return [dataclasses.replace(s, response_ids=s.response_ids[:r],
                                rollout_logprobs=s.rollout_logprobs[:r])
            for s, r in zip(samples, (8, 5, 3))]


def test_counts_and_loss_terms_of_every_microbatch_reach_the_stats(monkeypatch):
    """Several microbatches (micro_batch_tokens 32) of samples with changed rollout logprobs
    (`_changed`: n mismatches, f of them clipped, N tokens): the step's mismatch, compared and
    clipped counts are n, N and f — every microbatch's, read once at the end — and loss,
    pg_loss and entropy under seq-mean-token-mean (unequal responses) have the bytes of the
    one-microbatch step, so each microbatch's per-token terms stay paired with its own
    samples; rollout_mismatches over the same microbatches counts n of N. Control: the same
    terms paired with the samples in reverse order give another loss."""
    changed, n, f = _changed(_uneven(_samples()))
    n_tok = sum(len(s.response_ids) for s in changed)

    def run(mbt):
        return compute_gradients(_model(), None, changed, temperature=SP.temperature,
                                 coefs=LossCoefs(0.2, 0.0, 0.01, "k1"), micro_batch_tokens=mbt,
                                 pad_id=257, exp=invariant_exp, agg="seq-mean-token-mean")
    one, several = run(512), run(32)
    assert (one.n_microbatches, several.n_microbatches) == (1, 2)
    for st in (one, several):
        assert (st.logprob_mismatches, st.logprob_compared, st.n_clipped, st.n_tokens) == \
            (n, n_tok, f, n_tok)
    assert dataclasses.replace(several, n_microbatches=1) == one
    for mbt in (32, 512):
        assert step_mod.rollout_mismatches(_model(), changed, temperature=SP.temperature,
                                           micro_batch_tokens=mbt, pad_id=257) == (n, n_tok)
    real = step_mod.aggregate
    monkeypatch.setattr(step_mod, "aggregate",
                        lambda values, sample_of, *a: real(values, sample_of[::-1], *a))
    assert run(32).loss != several.loss, "control: the pairing of terms and samples is unseen"


def test_a_native_step_runs_its_mini_batch_once(monkeypatch):
    """NativeOps (stock kernels, nothing checked) never asks for a second pass: one run of the
    mini-batch's forwards and backwards per compute_gradients. Control: an InvariantOps step
    whose late check answers True runs it twice (the count sees a second pass)."""
    from rlkernel.model.ops import NativeOps

    calls: list[bool] = []
    real = step_mod._backward_passes

    def counted(*args):
        calls.append(True)
        return real(*args)
    monkeypatch.setattr(step_mod, "_backward_passes", counted)
    samples = _samples()

    def run(pol):
        pol.load_tensors(W)
        calls.clear()
        compute_gradients(pol, None, samples, temperature=SP.temperature,
                          coefs=LossCoefs(0.2, 0.0, 0.01, "k1"), micro_batch_tokens=32,
                          pad_id=257, exp=invariant_exp)
        return len(calls)
    assert run(Qwen3ForCausalLM(CFG, NativeOps, torch.float32)) == 1
    monkeypatch.setattr(InvariantOps, "late_flagged", staticmethod(lambda model: True))
    assert run(Qwen3ForCausalLM(CFG, InvariantOps, torch.bfloat16)) == 2, "control"
