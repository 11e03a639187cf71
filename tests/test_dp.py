"""Data parallelism: gradients that depend on neither the DP size nor the microbatch size (issue 14).

The matrix: (DP, TP, CP) ∈ {(1,1,1), (2,1,1), (4,1,1), (8,1,1), (2,2,1), (2,1,2), (2,2,2)} × a
microbatch of 1 sample / 4 samples / the whole step (--micro-batch-tokens 40 / 144 / 4096 on the
batch below), each on real gloo processes (tests/topology_probe.py), against DP1/TP1/CP1 with the
whole step in one microbatch (in this process). On EVERY rank: the per-token logprobs of the
rows it holds, every gradient (reassembled to logical tensors), the exact gradient norm, loss and
entropy, and every weight after two ZeRO-1 AdamW updates are compared by bytes. Chain:
(dp, tp, cp, mb) == (1, 1, 1, whole) for every cell, hence any two cells agree.
Negative control: --mode native (fp32 autograd accumulation per microbatch, SUM all-reduce over
CP and DP) differs between DP1 and DP2, and between microbatch sizes at DP1.
Also: ZeRO-1 memory per rank falls with DP; `rlk run` evidence of DP1/DP2/DP4 and another
--micro-batch-tokens is IDENTICAL under `rlk compare` (native: DIFFERENT); a run resumes at
another DP size bit for bit.

CI runs a representative subset; the whole matrix:
`.venv/bin/python -m pytest -q -m "slow or not slow" tests/test_dp.py`.
"""

from __future__ import annotations

import pytest
import torch
from cli_helpers import with_flags
from test_topology_run import assert_steps_sound
from topology_probe import Job, assert_same_bytes, run_layout, single_process

from rlkernel.cli import main
from rlkernel.data.packing import pack_by_budget
from rlkernel.model.checkpoint import init_weights
from rlkernel.model.config import tiny
from rlkernel.train.step import TrainSample

MODEL = tiny().replace(num_key_value_heads=2)
"""8 query / 2 KV heads (TP2 splits the KV heads), tied embeddings."""
LENGTHS = [(11, 27), (5, 30), (23, 9), (8, 31), (3, 12), (14, 26), (9, 20), (17, 15)]
"""(prompt, response) of the 8 samples: totals 38, 35, 32, 39, 15, 40, 29, 32 tokens."""
MICRO = {"1 sample": 40, "4 samples": 144, "whole step": 4096}
"""--micro-batch-tokens giving microbatches of 1 sample / 4 samples / the whole step at DP1."""


def _batch() -> list[TrainSample]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i, (p, r) in enumerate(LENGTHS):
        prompt = tuple(torch.randint(32, 127, (p,), generator=g).tolist())
        resp = tuple(torch.randint(0, 264, (r,), generator=g).tolist())
        old = -4.0 - torch.rand(r, generator=g)
        out.append(TrainSample(i, prompt, resp, old.float(), float(torch.randn(1, generator=g))))
    return out


def _job(micro: str, model=MODEL) -> Job:
    return Job(mcfg=model, policy_w=init_weights(model, 0), ref_w=init_weights(model, 1),
               samples=_batch(), steps=2, micro_batch_tokens=MICRO[micro], pad_id=257)


def test_micro_settings_make_the_named_microbatches():
    """At DP1 the three settings pack the 8 samples as 8 × 1, 2 × 4 and 1 × 8 samples."""
    totals = [p + r for p, r in LENGTHS]
    assert [len(g) for g in pack_by_budget(totals, MICRO["1 sample"])] == [1] * 8
    assert [len(g) for g in pack_by_budget(totals, MICRO["4 samples"])] == [4, 4]
    assert [len(g) for g in pack_by_budget(totals, MICRO["whole step"])] == [8]


@pytest.fixture(scope="module")
def baseline():
    return single_process(_job("whole step"))


def _run(tmp_path, dp: int, tp: int, cp: int, micro: str, mode: str = "invariant",
         sp: bool = False) -> list[dict]:
    out = tmp_path / f"dp{dp}-tp{tp}-cp{cp}-{micro.replace(' ', '')}-{mode}"
    out.mkdir()
    return run_layout(out, _job(micro), tp, cp, sp, mode, dp=dp)


MATRIX = [(dp, tp, cp, micro) for dp, tp, cp in [(1, 1, 1), (2, 1, 1), (4, 1, 1), (8, 1, 1),
                                                  (2, 2, 1), (2, 1, 2), (2, 2, 2)]
          for micro in MICRO]
CI_SUBSET = [(2, 1, 1, "whole step"), (4, 1, 1, "1 sample"), (2, 2, 1, "4 samples"),
             (1, 1, 1, "1 sample")]


@pytest.mark.parametrize("dp,tp,cp,micro", CI_SUBSET)
def test_dp_matrix_ci_subset_matches_dp1_whole_step(tmp_path, baseline, dp, tp, cp, micro):
    """On every rank: per-token logprobs, every gradient, grad norm, loss/entropy, weights after
    2 AdamW steps == (DP1, TP1, CP1, whole step in one microbatch), bytes."""
    assert_same_bytes(_run(tmp_path, dp, tp, cp, micro), baseline,
                      f"DP{dp}/TP{tp}/CP{cp}/{micro}")


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp,cp,micro", [m for m in MATRIX if m not in CI_SUBSET])
def test_dp_matrix_full_matches_dp1_whole_step(tmp_path, baseline, dp, tp, cp, micro):
    """The rest of the issue-14 matrix (run with -m slow): == (DP1, TP1, CP1, whole step), bytes."""
    assert_same_bytes(_run(tmp_path, dp, tp, cp, micro), baseline,
                      f"DP{dp}/TP{tp}/CP{cp}/{micro}")


def test_an_untied_embedding_is_summed_over_its_looked_up_rows_only(monkeypatch):
    """With several microbatches the untied model's sink declares the embedding lookup-only and
    holds no whole [V, H] accumulator for it, only the split over the rows looked up (the
    hand-over threshold raised, as the tiny vocabulary would pass it); the gradients equal the
    whole step's. (Bytes alone cannot tell: the whole accumulator gives the same ones.)"""
    from rlkernel.distributed import tokensum

    monkeypatch.setattr(tokensum, "SPLIT_MAX_FRACTION", 1.0)
    model = MODEL.replace(tie_word_embeddings=False)
    seen = []
    real = tokensum.GradSink.finish

    def finish(self):
        seen.append((set(self._sparse), set(self._acc), set(self._split)))
        return real(self)
    monkeypatch.setattr(tokensum.GradSink, "finish", finish)
    one = _grads_one_process("1 sample", model=model)
    emb = "model.embed_tokens.weight"
    assert seen[-1][0] == {emb} and emb not in seen[-1][1] and emb in seen[-1][2]
    assert _differing(one, _grads_one_process("whole step", model=model)) == []


@pytest.mark.parametrize("micro", ["1 sample", "whole step"])
def test_untied_embedding_split_over_dp_and_cp_matches_the_whole_step(tmp_path, micro):
    """An untied model (the embedding a lookup-only weight: its sums kept over the looked-up
    rows only, summed over the union of the DP × CP ranks' rows) at DP2 × CP2 with one sample
    per microbatch (persistent mode) or one microbatch per rank (direct mode: the split made
    at the lookup's backward over the union) == its DP1 whole-step run, bytes, on every
    rank."""
    model = MODEL.replace(tie_word_embeddings=False)
    want = single_process(_job("whole step", model))
    out = tmp_path / "untied"
    out.mkdir()
    got = run_layout(out, _job(micro, model), 1, 2, False, dp=2)
    assert_same_bytes(got, want, f"untied DP2/CP2/{micro}")


@pytest.mark.slow
def test_dp2_tp2_cp2_with_sp_matches_dp1(tmp_path, baseline):
    """DP2 × TP2 × CP2 with sequence parallelism (norm weights reduced over the whole world),
    one sample per microbatch == the baseline, bytes."""
    assert_same_bytes(_run(tmp_path, 2, 2, 2, "1 sample", sp=True), baseline, "DP2/TP2/CP2/SP")


def test_control_native_dp_and_microbatch_size_change_the_bytes(tmp_path):
    """Negative control: stock ops with fp32 autograd accumulation per microbatch and SUM
    all-reduces: DP2 != DP1 (same microbatches), and DP1 with 1-sample microbatches != DP1 with
    the whole step — while the gradients still agree to fp32 rounding (1e-4 relative)."""
    one = single_process(_job("whole step"), "native")
    two = _run(tmp_path, 2, 1, 1, "whole step", "native")
    with pytest.raises(AssertionError):
        assert_same_bytes(two, one, "native DP2")
    small = single_process(_job("1 sample"), "native")
    with pytest.raises(AssertionError):
        assert_same_bytes([small], one, "native 1-sample microbatches")
    g1, g2 = one["steps"][0]["grads"], two[0]["steps"][0]["grads"]
    for n in g1:
        assert ((g1[n] - g2[n]).norm() / g1[n].norm().clamp(min=1e-30)).item() < 1e-4, n


def test_zero1_optimizer_memory_per_rank_falls_with_dp(tmp_path, baseline):
    """ZeRO-1: the fp32 masters and moments (12 bytes per element) a rank holds at DP2 are half
    of DP1's (up to the per-tensor rounding of ⌈n/2⌉), and the ranks' chunks cover every element
    once; the weights after the two updates are DP1's (bytes)."""
    two = _run(tmp_path, 2, 1, 1, "4 samples")
    total = sum(t.numel() for t in baseline["weights"].values()) * 12
    assert baseline["optimizer_bytes"] == total
    assert sum(r["optimizer_bytes"] for r in two) == total
    for r in two:
        assert r["optimizer_bytes"] <= total / 2 + 12 * len(baseline["weights"])
    assert_same_bytes(two, baseline, "DP2 ZeRO-1")


# ---------------------------------------------------------------------------------------------
# in one process: the microbatch size, and the GradSink's guards

def _grads_one_process(micro: str, mode: str = "invariant", dtype=torch.float32,
                       model=MODEL) -> dict:
    from rlkernel.model.ops import ops_for
    from rlkernel.model.qwen3 import Qwen3ForCausalLM
    from rlkernel.train.losses import LossCoefs, invariant_exp
    from rlkernel.train.step import compute_gradients, gradients

    job = _job(micro, model)
    policy = Qwen3ForCausalLM(model, ops_for(mode), dtype)
    policy.load_tensors(job.policy_w)
    ref = Qwen3ForCausalLM(model, ops_for(mode), dtype)
    ref.load_tensors(job.ref_w)
    ref.requires_grad_(False)
    compute_gradients(policy, ref, job.samples, temperature=0.7,
                      coefs=LossCoefs(0.2, 0.05, 0.01, "k3"),
                      micro_batch_tokens=job.micro_batch_tokens, pad_id=257,
                      exp=invariant_exp if mode == "invariant" else torch.exp)
    return {n: g.clone() for n, g in gradients(policy).items()}


def _differing(a: dict, b: dict) -> list[str]:
    return [n for n in a if not torch.equal(a[n].view(torch.int32), b[n].view(torch.int32))]


def test_microbatch_size_does_not_change_a_gradient_bit_in_one_process():
    """compute_gradients with microbatches of 1 sample, 4 samples and the whole step: every
    gradient identical (int32 views), bf16 parameters. Negative control: --mode native (fp32
    autograd accumulation per microbatch) changes gradient bytes between 1 sample and the whole
    step."""
    whole = _grads_one_process("whole step", dtype=torch.bfloat16)
    for micro in ("1 sample", "4 samples"):
        assert _differing(_grads_one_process(micro, dtype=torch.bfloat16), whole) == [], micro
    assert _differing(_grads_one_process("1 sample", "native"),
                      _grads_one_process("whole step", "native"))


def _sink_spy(monkeypatch) -> list[tuple[bool, set, set]]:
    """Record (direct, names with a persistent accumulator or kept leaf partials — a norm
    weight's, GradSink.add_later —, names finished in the backward) at every GradSink.finish."""
    from rlkernel.distributed import tokensum

    seen: list[tuple[bool, set, set]] = []
    orig = tokensum.GradSink.finish

    def finish(self):
        seen.append((self.direct, set(self._acc) | set(self._later), set(self._done)))
        return orig(self)

    monkeypatch.setattr(tokensum.GradSink, "finish", finish)
    return seen


@pytest.mark.parametrize("tied", [True, False])
def test_one_microbatch_finishes_weights_in_their_backward_with_the_same_bytes(monkeypatch, tied):
    """Direct mode (one microbatch per rank): every weight's gradient is finished inside its
    backward and no mini-batch accumulator is kept — the tied embedding too (the lookup and the
    LM head both add to it: the head finishes every row and keeps an accumulator of the looked-up
    rows only, which the lookup completes; tokensum.GradSink.note_rows); 1-sample microbatches
    keep an accumulator for every weight. The gradients are identical (int32 views), also when
    direct mode cuts every weight into 64-element row chunks (the embedding's vocab rows
    included). Untied: the lookup's rows pass half the tiny vocabulary, so the embedding is
    finished by direct chunks like lm_head; with that threshold raised, it is split over the
    rows looked up (GradSink._direct_split) — the same bytes."""
    from rlkernel.distributed import tokensum

    model = MODEL.replace(tie_word_embeddings=tied)
    seen = _sink_spy(monkeypatch)
    split: list[set] = []
    real_finish = tokensum.GradSink.finish     # the spy's wrapper: records the split weights

    def finish(self):
        split.append(set(self._split))
        return real_finish(self)
    monkeypatch.setattr(tokensum.GradSink, "finish", finish)
    whole = _grads_one_process("whole step", model=model)
    keep = {"model.embed_tokens.weight"} if tied else set()
    assert ("lm_head.weight" in whole) is not tied
    assert seen[-1] == (True, set(), set(whole))
    assert split[-1] == keep
    one = _grads_one_process("1 sample", model=model)
    assert seen[-1] == (False, set(one), set())
    assert _differing(one, whole) == []
    monkeypatch.setattr(tokensum, "DIRECT_CHUNK_ELEMS", 64)
    assert _differing(_grads_one_process("whole step", model=model), whole) == []
    monkeypatch.setattr(tokensum, "SPLIT_MAX_FRACTION", 1.0)
    assert _differing(_grads_one_process("whole step", model=model), whole) == []
    assert split[-1] == {"model.embed_tokens.weight"} and not seen[-1][1]


def test_direct_mode_refuses_a_weight_finished_twice():
    """A weight that reaches a second kernel in a direct-mode mini-batch (a use that was not
    declared in `keep`) raises instead of losing one use's gradient."""
    from rlkernel.distributed.tokensum import GradSink

    sink = GradSink.single()
    w = torch.nn.Parameter(torch.zeros(4))
    sink.begin({"w": w}, direct=True)
    sink.finish_direct(w, "dp_cp", lambda a, b, acc: None, "test")
    with pytest.raises(RuntimeError, match="second kernel"):
        sink.finish_direct(w, "dp_cp", lambda a, b, acc: None, "test")
    with pytest.raises(RuntimeError, match="finished directly"):
        sink.accumulator(w, "dp_cp")
    assert torch.equal(sink.finish()["w"], torch.zeros(4))


def test_grad_sink_refuses_foreign_tensors_and_mixed_scopes_and_stray_autograd_grads():
    """The sink keys accumulators by parameter: a tensor that is not one, or one weight reduced
    over two scopes, raises RuntimeError; sync_grads raises when autograd left a .grad of its
    own (a use of a weight that bypassed the kernels)."""
    from rlkernel.distributed.tokensum import GradSink
    from rlkernel.model.ops import InvariantOps
    from rlkernel.model.qwen3 import Qwen3ForCausalLM

    sink = GradSink.single()
    w = torch.nn.Parameter(torch.zeros(3))
    sink.begin({"w": w})
    sink.accumulator(w, "dp_cp")
    with pytest.raises(RuntimeError, match="not a parameter"):
        sink.accumulator(torch.zeros(3), "dp_cp")
    with pytest.raises(RuntimeError, match="reduced over dp_cp and world"):
        sink.accumulator(w, "world")
    assert set(sink.finish()) == {"w"} and not sink.open
    policy = Qwen3ForCausalLM(MODEL, InvariantOps, torch.float32)
    InvariantOps.begin_grads(policy)
    w0 = policy.model.norm.weight
    (w0 * 2).sum().backward()          # autograd's own accumulation, not through a kernel
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        InvariantOps.sync_grads(policy)


def test_grad_sink_finishes_in_buckets_to_the_exact_sums(monkeypatch):
    """GradSink.finish cuts accumulators into buckets (small tensors share one, large ones are
    cut, an empty one is skipped): with 7-element buckets each gradient still == the exact sum of
    what was accumulated (fixedpoint.exact_sum_fp32), bytes, shapes kept, canonical order."""
    from rlkernel.distributed import tokensum
    from rlkernel.numerics import fixedpoint as fx

    monkeypatch.setattr(tokensum, "_BUCKET_ROWS", 7)
    assert tokensum._buckets([("a", 12), ("b", 2), ("c", 0), ("d", 15)]) == [
        [("a", 0, 7)], [("a", 7, 12), ("b", 0, 2)], [("d", 0, 7)], [("d", 7, 14)], [("d", 14, 15)]]
    params = {"a": torch.zeros(3, 4), "b": torch.zeros(2), "c": torch.zeros(0, 4),
              "d": torch.zeros(5, 3)}
    sink = tokensum.GradSink.single()
    sink.begin(params)
    g = torch.Generator().manual_seed(0)
    want = {}
    for n, p in params.items():
        x = torch.randn(9, *p.shape, generator=g)
        fx.accumulate_(sink.accumulator(p, "dp_cp"), x)
        want[n] = fx.exact_sum_fp32(x)
    got = sink.finish()
    assert list(got) == list(params)
    assert all(torch.equal(got[n].view(torch.int32), want[n].view(torch.int32)) for n in params)


# ---------------------------------------------------------------------------------------------
# `rlk run` end to end: evidence, compare, resume

RUN = ["--steps", "2", "--require-updates", "--temperature", "0.7", "--max-response-len", "16",
       "--kl-coef", "0.01", "--n-prompts", "2", "--n-samples-per-prompt", "4", "--allow-dirty",
       "--lr", "1e-3", "--max-prompt-len", "24"]


def _rlk_run(tmp_path, name: str, *extra: str) -> str:
    d = str(tmp_path / name)
    assert main(["run", *RUN, "--run-dir", d, *extra]) == 0
    return d


def test_rlk_run_dp1_dp2_dp4_and_another_microbatch_size_are_identical(tmp_path, capsys):
    """`rlk run` at DP1 (whole step per microbatch), DP2 (--micro-batch-tokens 40: one sample
    each) and DP4: `rlk compare` says IDENTICAL (gradient norms, sampled tokens, every
    parameter hash after each update, rewards, losses), 0 train/rollout logprob mismatches."""
    a = _rlk_run(tmp_path, "dp1")
    b = _rlk_run(tmp_path, "dp2", "--dp", "2", "--micro-batch-tokens", "40")
    c = _rlk_run(tmp_path, "dp4", "--dp", "4")
    assert_steps_sound(a, b, c)
    capsys.readouterr()
    assert main(["compare", a, c]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("IDENTICAL") and "tensor_hashes       identical" in out
    assert main(["compare", a, b]) == 0


def test_control_rlk_run_native_dp1_vs_dp2_differs(tmp_path, capsys):
    """Negative control: the same pair in --mode native differs; compare names the grad norm."""
    a = _rlk_run(tmp_path, "n-dp1", "--mode", "native", "--dtype", "fp32")
    b = _rlk_run(tmp_path, "n-dp2", "--mode", "native", "--dtype", "fp32", "--dp", "2")
    capsys.readouterr()
    assert main(["compare", a, b]) == 1
    out = capsys.readouterr().out
    assert "grad_norm" in out and out.rstrip().splitlines()[-1].startswith("DIFFERENT")


def test_resume_at_another_dp_size_is_identical_to_the_uninterrupted_run(tmp_path, capsys):
    """A DP2 run checkpointed after step 1 and resumed at DP4 with other microbatches, and a DP4
    one resumed at DP1, both == the uninterrupted DP1 run (rlk compare IDENTICAL): checkpoints
    hold logical masters and moments, gathered from every DP chunk and TP shard."""
    whole = _rlk_run(tmp_path, "whole")
    part = str(tmp_path / "part")
    assert main(["run", *with_flags(RUN, "--steps", "1"), "--run-dir", part, "--dp", "2",
                 "--save-every", "1"]) == 0
    assert main(["run", "--resume", part, "--dp", "4", "--micro-batch-tokens", "64",
                 "--steps", "2", "--allow-dirty"]) == 0
    capsys.readouterr()
    assert main(["compare", whole, part]) == 0
    part2 = str(tmp_path / "part2")
    assert main(["run", *with_flags(RUN, "--steps", "1"), "--run-dir", part2, "--dp", "4",
                 "--save-every", "1"]) == 0
    assert main(["run", "--resume", part2, "--steps", "2", "--dp", "1", "--allow-dirty"]) == 0
    capsys.readouterr()
    assert main(["compare", whole, part2]) == 0


# ---------------------------------------------------------------------------------------------
# torchrun: two agents on one machine (as two nodes) == the spawned run


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_agents_dp2_tp2_equals_the_spawned_run(tmp_path, capsys):
    """Two torchrun agents (--nnodes 2 --nproc-per-node 2, node ranks 0 and 1, static rendezvous
    on 127.0.0.1) running `rlk run --dp 2 --tp 2` — DP replica 0 on node 0, replica 1 on node 1 —
    == the same run started by rlk itself (4 spawned processes): rlk compare IDENTICAL."""
    import os
    import subprocess
    import sys

    bin_dir = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(bin_dir, "torchrun")):
        pytest.skip(f"no torchrun next to {sys.executable}")
    d = str(tmp_path / "torchrun")
    port = _free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)

    def agent(node: int) -> subprocess.Popen:
        return subprocess.Popen(
            [os.path.join(bin_dir, "torchrun"), "--nnodes", "2", "--nproc-per-node", "2",
             "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--no-python", os.path.join(bin_dir, "rlk"), "run", *RUN, "--dp", "2", "--tp", "2",
             "--run-dir", d],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    agents = [agent(0), agent(1)]
    try:
        outs = [a.communicate(timeout=600)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert [a.returncode for a in agents] == [0, 0], outs
    spawned = _rlk_run(tmp_path, "spawned", "--dp", "2", "--tp", "2")
    capsys.readouterr()
    assert main(["compare", d, spawned]) == 0
    assert capsys.readouterr().out.rstrip().endswith("IDENTICAL")
