"""Several updates per rollout batch (issue 13 item 4): epochs, mini-batches, decoupled clip,
loss aggregation, LR schedule — and the topology contract still holds for all of them.

Chains checked here:
  1. schedule: learning_rate == the float64 closed form (warmup k/W, cosine, linear), exactly.
  2. aggregation: agg_weights/aggregate == the definitions on small integers, exactly; aggregate is
     the same bits for any split of the tokens (ranks) and any order.
     (Gradients of each --loss-agg == float64 transformers: tests/test_reference.py.)
  3. train_on_rollout with E epochs x M mini-batches == compute_gradients/clip/AdamW applied by
     hand in the documented order, bitwise; with E = M = 1 == the old single on-policy update.
  4. with one on-policy update the clip range cannot act (weights bitwise equal for any eps);
     with --ppo-epochs 2 the ratio moves, tokens get clipped and eps changes the weights.
  5. topology: the probe with E=2, M=2, seq-mean-token-mean, clip [0.8, 1.28], cosine LR with
     warmup at TP2/CP2/SP (4 gloo ranks) == TP1: every update's grad norm, loss, KL, entropy,
     clip count and the weights after the step, bytes; and end to end, `rlk run --tp 2 --cp 2`
     vs `rlk run` with those flags: `rlk compare` IDENTICAL, 0 logprob mismatches over all tokens.

Run: `.venv/bin/python -m pytest -q tests/test_ppo.py`.
"""

from __future__ import annotations

import json
import math
import pickle
import random

import pytest
import torch

from rlkernel.cli import main
from rlkernel.config import RunConfig
from rlkernel.distributed.launch import launch
from rlkernel.model.checkpoint import init_weights
from rlkernel.model.config import tiny
from rlkernel.model.ops import InvariantOps, ops_for
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.numerics.exact import exact_sum
from rlkernel.train.losses import LossCoefs, invariant_exp
from rlkernel.train.optimizer import AdamW, AdamWParams
from rlkernel.train.ppo import UpdatePlan, mini_batches, train_on_rollout
from rlkernel.train.schedule import learning_rate
from rlkernel.train.step import (TrainSample, agg_weights, aggregate, compute_gradients, gradients,
                                 trainer_logprobs)

T = 0.7
PAD = 257
COEFS = LossCoefs(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, kl_estimator="k3",
                  clip_eps_low=0.2, clip_eps_high=0.28)
PLAN = UpdatePlan(ppo_epochs=2, mini_batches=2, loss_agg="seq-mean-token-mean", clip_grad=1.0,
                  lr=1e-3, lr_warmup_steps=1, lr_schedule="cosine", total_updates=8)


# ---------------------------------------------------------------------------------------------
# 1. schedule


def test_schedule_matches_closed_form():
    """warmup k/W, then constant / linear (1-p) / cosine (1+cos(pi p))/2, p=(k-1-W)/(T-W)."""
    base, total, w = 3e-4, 10, 3
    for k in range(1, total + 1):
        p = (k - 1 - w) / (total - w)
        want = {"constant": base, "linear": base * (1.0 - p),
                "cosine": base * (0.5 * (1.0 + math.cos(math.pi * p)))}
        for sched, v in want.items():
            got = learning_rate(base, k, total, w, sched)
            assert got == (base * k / w if k <= w else v), (sched, k)
    assert learning_rate(3e-4, 1, 5) == 3e-4  # no warmup, constant: exactly --lr
    assert learning_rate(1e-3, 4, 10, 3, "cosine") == 1e-3  # first update after warmup: full rate
    assert 0 < learning_rate(1e-3, 10, 10, 3, "cosine") < learning_rate(1e-3, 9, 10, 3, "cosine")
    for bad in [(0, 5, 0, "constant"), (6, 5, 0, "constant"), (1, 5, 5, "constant"),
                (1, 5, 0, "step")]:
        with pytest.raises(ValueError):
            learning_rate(1e-3, *bad)


# ---------------------------------------------------------------------------------------------
# 2. aggregation


def test_agg_weights_are_the_definitions():
    """token-mean 1/N; seq-mean-token-sum 1/S; seq-mean-token-mean 1/(S R_s); empty sample 0."""
    lengths = [3, 5, 0, 2]  # N = 10, S = 3
    assert agg_weights(lengths, "token-mean") == [1 / 10] * 4
    assert agg_weights(lengths, "seq-mean-token-sum") == [1 / 3] * 4
    assert agg_weights(lengths, "seq-mean-token-mean") == [1 / 9, 1 / 15, 0.0, 1 / 6]
    with pytest.raises(ValueError, match="no response tokens"):
        agg_weights([0, 0], "token-mean")
    with pytest.raises(ValueError, match="--loss-agg"):
        agg_weights([1], "sum")


def test_aggregate_is_exact_and_split_invariant():
    """aggregate == the definition in exact fractions rounded once per division; any token
    order (any split over ranks) gives the same bits."""
    rng = random.Random(0)
    lengths = [7, 1, 12, 4]
    sample_of = [s for s, r in enumerate(lengths) for _ in range(r)]
    values = [rng.uniform(-1, 1) * 10 ** rng.randint(-8, 8) for _ in sample_of]
    want = {
        "token-mean": math.fsum(values) / sum(lengths),
        "seq-mean-token-sum": math.fsum(values) / 4,
        "seq-mean-token-mean": math.fsum(
            math.fsum(v for v, s in zip(values, sample_of) if s == k) / r
            for k, r in enumerate(lengths)) / 4,
    }
    for agg, w in want.items():
        assert aggregate(values, sample_of, lengths, agg).hex() == w.hex(), agg
        order = list(range(len(values)))
        for _ in range(5):
            rng.shuffle(order)
            got = aggregate([values[i] for i in order], [sample_of[i] for i in order], lengths, agg)
            assert got.hex() == w.hex(), agg


def test_mini_batches_are_contiguous_in_sample_order():
    xs = list(range(12))
    assert mini_batches(xs, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert mini_batches(xs, 1) == [xs]
    with pytest.raises(ValueError, match="--mini-batches 5"):
        mini_batches(xs, 5)


# ---------------------------------------------------------------------------------------------
# single-process helpers


def _batch(n: int = 4, seed: int = 7) -> list[TrainSample]:
    """Random prompts/responses, old logprobs around the tiny model's (-4 .. -5), advantages ~N(0,1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = int(torch.randint(3, 12, (1,), generator=g)), int(torch.randint(4, 16, (1,), generator=g))
        prompt = tuple(torch.randint(32, 127, (p,), generator=g).tolist())
        resp = tuple(torch.randint(0, 264, (r,), generator=g).tolist())
        old = -4.0 - torch.rand(r, generator=g)
        out.append(TrainSample(i, prompt, resp, old.float(), float(torch.randn(1, generator=g))))
    return out


def _models(seed: int = 0):
    mcfg = tiny()
    policy = Qwen3ForCausalLM(mcfg, InvariantOps, torch.float32)
    policy.load_tensors(init_weights(mcfg, seed))
    ref = Qwen3ForCausalLM(mcfg, InvariantOps, torch.float32)
    ref.load_tensors(init_weights(mcfg, seed + 1))
    ref.requires_grad_(False)
    opt = AdamW({n: p.detach() for n, p in policy.logical_params().items()}, AdamWParams(lr=1e-3))
    return policy, ref, opt


def _on_policy(policy, samples):
    """The samples with old logprobs = the policy's own (what the rollout engine reports)."""
    lps = trainer_logprobs(policy, samples, T, PAD)
    return [TrainSample(s.sample_id, s.prompt_ids, s.response_ids, lp, s.advantage)
            for s, lp in zip(samples, lps)]


def _train(policy, ref, opt, samples, plan, coefs=COEFS, first_update=0):
    return train_on_rollout(policy, ref, opt, samples, plan, first_update=first_update,
                            temperature=T, coefs=coefs, micro_batch_tokens=96, pad_id=PAD,
                            exp=invariant_exp)


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _same_weights(a: dict, b: dict) -> list[str]:
    return [n for n in a if not _bits(a[n], b[n])]


# ---------------------------------------------------------------------------------------------
# 3. the loop is the documented order


def test_epochs_and_mini_batches_follow_the_documented_order():
    """train_on_rollout(E=2, M=2) == by hand: for e, for m: grads of mini-batch m
    (seq-mean-token-mean), exact clip, AdamW at learning_rate(k) — bitwise, every update."""
    samples = _batch()
    p1, r1, o1 = _models()
    done = _train(p1, r1, o1, samples, PLAN, first_update=4)
    p2, r2, o2 = _models()
    halves = [samples[:2], samples[2:]]
    for k in range(4):
        stats = compute_gradients(p2, r2, halves[k % 2], temperature=T, coefs=COEFS,
                                  micro_batch_tokens=96, pad_id=PAD, exp=invariant_exp,
                                  agg="seq-mean-token-mean")
        grads = gradients(p2)
        gs = o2.clip(grads, 1.0)
        lr = learning_rate(1e-3, 4 + k + 1, 8, 1, "cosine")
        o2.step(grads, lr=lr)
        p2.load_master_shards(o2.master)
        u = done.updates[k]
        assert (u.epoch, u.mini_batch) == divmod(k, 2)
        assert u.grad.norm.hex() == gs.norm.hex() and u.lr == lr and u.applied
        assert u.stats == stats  # floats compared by ==: exact, and none is NaN here
    assert _same_weights(p1.export_tensors(), p2.export_tensors()) == []
    assert len(done.updates) == 4 and not done.skipped and done.diverged == []
    assert done.mean("kl") == exact_sum(u.stats.kl for u in done.updates) / 4


def test_one_update_is_the_old_on_policy_step():
    """E = M = 1, token-mean, constant LR == compute_gradients + clip + AdamW.step(): bitwise."""
    samples = _batch()
    plan = UpdatePlan(lr=1e-3, total_updates=1)
    p1, r1, o1 = _models()
    done = _train(p1, r1, o1, samples, plan, coefs=LossCoefs(0.2, 0.05, 0.01, "k3"))
    p2, r2, o2 = _models()
    stats = compute_gradients(p2, r2, samples, temperature=T, coefs=LossCoefs(0.2, 0.05, 0.01, "k3"),
                              micro_batch_tokens=96, pad_id=PAD, exp=invariant_exp)
    grads = gradients(p2)
    gs = o2.clip(grads, 1.0)
    o2.step(grads)
    p2.load_master_shards(o2.master)
    assert done.updates[0].stats == stats and done.grad.norm.hex() == gs.norm.hex()
    assert done.logprob_mismatches == stats.logprob_mismatches
    assert _same_weights(p1.export_tensors(), p2.export_tensors()) == []


# ---------------------------------------------------------------------------------------------
# 4. the clip range acts only with several updates


def _after(plan, eps_low, eps_high):
    policy, ref, opt = _models()
    samples = _on_policy(policy, _batch())
    coefs = LossCoefs(0.2, 0.0, 0.0, "k1", eps_low, eps_high)
    done = _train(policy, ref, opt, samples, plan, coefs=coefs)
    return done, policy.export_tensors()


def test_clip_cannot_act_on_one_update_and_acts_on_several():
    """One on-policy update: 0 mismatches, so the ratio is exactly 1 and even eps 0.01 clips
    nothing (clamp(1, 1-eps, 1+eps) == 1 for every eps: the weights cannot depend on it).
    --ppo-epochs 2: the second pass clips tokens and a tighter eps changes the weights."""
    d1, _ = _after(UpdatePlan(lr=1e-2, total_updates=1), 0.01, 0.01)
    assert d1.logprob_mismatches == 0 and d1.clip_frac == 0.0

    two = UpdatePlan(ppo_epochs=2, lr=1e-2, total_updates=2)
    d3, w3 = _after(two, 0.2, 0.2)
    d4, w4 = _after(two, 0.01, 0.01)
    assert d3.updates[0].stats.n_clipped == 0 and d4.updates[0].stats.n_clipped == 0
    assert d4.updates[1].stats.n_clipped > d3.updates[1].stats.n_clipped
    assert d4.updates[1].grad.norm != d3.updates[1].grad.norm
    assert _same_weights(w3, w4) != []


def test_mini_batch_mismatch_audit_covers_every_token_at_rollout_weights():
    """M = 2 on-policy: all tokens are checked at the rollout's weights (0 mismatches), though
    mini-batch 1 is trained after the policy moved."""
    policy, ref, opt = _models()
    samples = _on_policy(policy, _batch())
    done = _train(policy, ref, opt, samples, UpdatePlan(mini_batches=2, lr=1e-2, total_updates=2))
    assert done.logprob_tokens == sum(len(s.response_ids) for s in samples)
    assert done.logprob_mismatches == 0
    assert done.updates[1].stats.logprob_mismatches > 0  # the policy had moved by then


# ---------------------------------------------------------------------------------------------
# 5. topology: gloo ranks


def _probe(rank: int, cfg: RunConfig, out_path: str) -> None:
    """One rank: one RL step's updates (PLAN, COEFS) on the fixed batch; rank 0 pickles the result."""
    import torch.distributed as dist

    from rlkernel.distributed.context import build_contexts
    from rlkernel.distributed.topology import Topology, build_comms
    from rlkernel.model.sharding import counts_for_norm

    topo = Topology.from_config(cfg, rank, dist.get_world_size())
    comms = build_comms(topo)
    mcfg = tiny()
    pc, _ = build_contexts(topo, comms, mcfg)
    policy = Qwen3ForCausalLM(mcfg, ops_for("invariant"), torch.float32, pc)
    policy.load_tensors(init_weights(mcfg, 0))
    ref = Qwen3ForCausalLM(mcfg, ops_for("invariant"), torch.float32, pc)
    ref.load_tensors(init_weights(mcfg, 1))
    ref.requires_grad_(False)
    opt = AdamW({n: p.detach() for n, p in policy.logical_params().items()}, AdamWParams(lr=1e-3))
    counted = {n for n in policy.logical_params()
               if topo.cp_rank == 0 and counts_for_norm(n, mcfg, topo.tp, topo.tp_rank)}
    done = train_on_rollout(policy, ref, opt, _batch(), PLAN, first_update=4, temperature=T,
                            coefs=COEFS, micro_batch_tokens=96, pad_id=PAD, exp=invariant_exp,
                            counted=counted, comm=comms.world)
    weights = policy.export_tensors()
    if rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump({"updates": [u.record() for u in done.updates],
                         "mismatches": done.logprob_mismatches, "weights": weights}, f)


def _run_probe(tmp_path, tp: int, cp: int, sp: bool) -> dict:
    cfg = RunConfig(tp=tp, cp=cp, sp=sp, dtype="fp32")
    out = tmp_path / f"ppo-{tp}-{cp}-{int(sp)}.pkl"
    launch(_probe, (cfg, str(out)), world_size=tp * cp, backend="gloo", timeout_s=300)
    with open(out, "rb") as f:
        return pickle.load(f)


def test_epochs_mini_batches_at_tp2_cp2_sp_match_tp1(tmp_path):
    """E=2 x M=2, seq-mean-token-mean, clip [0.8, 1.28], cosine+warmup: TP2/CP2/SP == TP1 in every
    update record (grad norm hex, lr, loss, KL, entropy, clipped tokens) and every weight, bytes."""
    one = _run_probe(tmp_path, 1, 1, False)
    four = _run_probe(tmp_path, 2, 2, True)
    assert len(one["updates"]) == 4
    assert sum(u["n_clipped"] for u in one["updates"]) > 0  # the clip path is exercised
    for k, (a, b) in enumerate(zip(one["updates"], four["updates"])):
        for key, v in a.items():
            same = v.hex() == b[key].hex() if isinstance(v, float) else v == b[key]
            assert same, f"update {k}: {key} {v!r} vs {b[key]!r}"
    assert one["mismatches"] == four["mismatches"]
    assert _same_weights(one["weights"], four["weights"]) == []


FLAGS = ["--steps", "1", "--n-prompts", "2", "--n-samples-per-prompt", "2",
         "--max-response-len", "8", "--kl-coef", "0.01", "--ppo-epochs", "2", "--mini-batches",
         "2", "--loss-agg", "seq-mean-token-mean", "--clip-eps-high", "0.28", "--lr", "1e-3",
         "--lr-warmup-steps", "2", "--lr-schedule", "cosine", "--dtype", "fp32", "--allow-dirty"]


def test_rlk_run_cp2_rollout_tp2_equals_tp1_with_several_updates(tmp_path, capsys):
    """`rlk run` with FLAGS at CP2 / rollout TP2 (2 gloo ranks) and at TP1: compare IDENTICAL
    (the step records its 4 updates' grad norms and rates), 0 train/rollout mismatches over
    every response token."""
    a, b = str(tmp_path / "tp1"), str(tmp_path / "cp2")
    assert main(["run", *FLAGS, "--run-dir", a]) == 0
    assert main(["run", *FLAGS, "--cp", "2", "--rollout-tp", "2", "--run-dir", b]) == 0
    (s,) = json.loads((tmp_path / "tp1" / "evidence.json").read_text())["steps"]
    assert [(u["epoch"], u["mini_batch"]) for u in s["updates"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [u["lr"] for u in s["updates"]] == [learning_rate(1e-3, k, 4, 2, "cosine")
                                               for k in range(1, 5)]
    assert all(u["grad_norm_hex"] == u["grad_norm"].hex() for u in s["updates"])
    assert s["logprob_mismatches"] == 0 and s["logprob_tokens"] == s["n_response_tokens"]
    assert s["version_changed"] is True
    # Only rank 0 writes the watch files: one metrics line, one completion per sample.
    assert len((tmp_path / "cp2" / "metrics.jsonl").read_text().splitlines()) == 1
    assert len((tmp_path / "cp2" / "completions.jsonl").read_text().splitlines()) == 4
    capsys.readouterr()
    assert main(["compare", "--quiet", a, b]) == 0
    assert capsys.readouterr().out == "IDENTICAL\n"


def test_resume_mid_schedule_equals_the_uninterrupted_run(tmp_path, capsys):
    """2 steps x 2 mini-batches, linear LR with warmup, a checkpoint after step 0: drop step 1
    (and leave a torn metrics line, as a crash would), `rlk run --resume` == the uninterrupted
    run (the schedule continues from the step cursor), and metrics.jsonl holds steps 0, 1 once."""
    import shutil

    flags = ["--steps", "2", "--n-prompts", "2", "--n-samples-per-prompt", "2",
             "--max-response-len", "8", "--kl-coef", "0.01", "--mini-batches", "2", "--lr", "1e-3",
             "--lr-warmup-steps", "1", "--lr-schedule", "linear", "--dtype", "fp32",
             "--save-every", "1", "--allow-dirty"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["run", *flags, "--run-dir", str(a)]) == 0
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step-000002")
    ev = json.loads((b / "evidence.json").read_text())
    ev["steps"], ev["complete"] = ev["steps"][:1], False
    (b / "evidence.json").write_text(json.dumps(ev))
    with open(b / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "loss": 0.')
    assert main(["run", "--resume", str(b), "--allow-dirty"]) == 0
    capsys.readouterr()
    assert main(["compare", "--quiet", str(a), str(b)]) == 0
    assert capsys.readouterr().out == "IDENTICAL\n"
    assert [json.loads(ln)["step"] for ln in (b / "metrics.jsonl").read_text().splitlines()] == [0, 1]
