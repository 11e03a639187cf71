"""The topology matrix: every (TP, CP, SP) layout gives the bytes of TP1/CP1, on gloo/CPU.

For each topology the same GQA Qwen3 (tiny() with 8 query / 2 KV heads, tied embeddings, so TP2
splits the KV heads and TP4/TP8 replicate them) and the same batch run two training steps on real
processes (tests/topology_probe.py). On EVERY rank: the per-token logprobs of the loss rows it
holds, every parameter gradient (reassembled to logical tensors), the exact gradient norm, loss
and entropy, and all weights after two AdamW updates are compared with the TP1/CP1 run (in this
process, no process group) by bytes. Chain: (t,c,sp) == (1,1,off) for every layout, hence any two
layouts agree (e.g. TP2/CP4 == TP4/CP2). TP1 gradients match float64 transformers for random
shapes in tests/test_shape_property.py and for tiny() in tests/test_reference.py.
Negative control: the same probe with stock ops/collectives (--mode native) differs.

CI runs a representative subset, with KV-head replication at TP4; the full matrix:
`.venv/bin/python -m pytest -q -m slow tests/test_topology.py`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from topology_probe import Job, assert_same_bytes, run_layout, single_process

from rlkernel.model.checkpoint import init_weights
from rlkernel.model.config import tiny
from rlkernel.train.step import TrainSample

MODEL = tiny().replace(num_key_value_heads=2)
"""8 query / 2 KV heads: TP > 2 replicates each KV head over TP/2 ranks (issue 10 item 8)."""


def _batch() -> list[TrainSample]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i, (p, r) in enumerate([(11, 17), (5, 30), (23, 9), (8, 21), (3, 12), (14, 26)]):
        prompt = tuple(torch.randint(32, 127, (p,), generator=g).tolist())
        resp = tuple(torch.randint(0, 264, (r,), generator=g).tolist())
        old = -4.0 - torch.rand(r, generator=g)
        out.append(TrainSample(i, prompt, resp, old.float(), float(torch.randn(1, generator=g))))
    return out


JOB = Job(mcfg=MODEL, policy_w=init_weights(MODEL, 0), ref_w=init_weights(MODEL, 1),
          samples=_batch(), steps=2, micro_batch_tokens=96, pad_id=257)
JOB_BF16 = dataclasses.replace(JOB, param_dtype=torch.bfloat16)
"""The same probe with bf16 parameters (fp32 masters and moments): the bf16 path's rounding
points in every layout (tests/test_cuda_dist.py runs it on the GPU)."""


def _run(tmp_path, tp: int, cp: int, sp: bool, mode: str = "invariant",
         recompute: bool = False) -> list[dict]:
    out = tmp_path / f"probe-{tp}-{cp}-{int(sp)}-{mode}-{int(recompute)}"
    out.mkdir()
    return run_layout(out, JOB, tp, cp, sp, mode, recompute)


@pytest.fixture(scope="module")
def baseline():
    return single_process(JOB)


# (2, 1, False): the non-SP TP all-reduces (mutation testing found them uncovered without it).
CI_SUBSET = [(2, 1, False), (2, 1, True), (1, 2, False), (2, 2, True), (4, 2, True)]
FULL = [(2, 1, False), (2, 1, True), (1, 2, False), (2, 2, True), (4, 1, True), (1, 4, False),
        (4, 2, True), (2, 4, False), (8, 1, True), (1, 1, False)]


def test_ci_subset_replicates_kv_heads():
    """CI_SUBSET holds a layout with TP > KV heads (KV heads replicated across TP ranks)."""
    assert any(tp > MODEL.num_key_value_heads for tp, _, _ in CI_SUBSET)


def _assert_optimizer_split_over_cp(records: list[dict], cp: int) -> None:
    """ZeRO-1 over DP × CP (train/zero.py): the ranks of one tp_rank hold disjoint chunks of
    that TP shard's fp32 masters and moments — their bytes add up to the same total for every
    tp_rank's group size, and each holds at most ⌈1/CP⌉ of it (plus per-tensor rounding)."""
    by_tp: dict[int, list[int]] = {}
    for r in records:
        by_tp.setdefault(r["where"][0], []).append(r["optimizer_bytes"])
    n_tensors = len(records[0]["weights"])
    for held in by_tp.values():
        assert len(held) == cp
        assert all(b <= sum(held) / cp + 12 * n_tensors for b in held), held


@pytest.mark.parametrize("tp,cp,sp", CI_SUBSET)
def test_layout_matches_tp1_cp1(tmp_path, baseline, tp, cp, sp):
    """On every rank: per-token logprobs, every gradient, grad norm, loss/entropy, weights after
    2 AdamW steps == (1,1,off), bytes; with the optimizer state split over the CP ranks."""
    records = _run(tmp_path, tp, cp, sp)
    assert_same_bytes(records, baseline, f"TP{tp}/CP{cp}/SP{sp}")
    _assert_optimizer_split_over_cp(records, cp)
    if tp == cp == 1:
        assert records[0]["optimizer_bytes"] == baseline["optimizer_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("tp,cp,sp", [t for t in FULL if t not in CI_SUBSET])
def test_full_matrix_matches_tp1_cp1(tmp_path, baseline, tp, cp, sp):
    """The rest of the matrix of issue 3 (run with -m slow); (1,1,off) on one launched process
    == the in-process baseline."""
    assert_same_bytes(_run(tmp_path, tp, cp, sp), baseline, f"TP{tp}/CP{cp}/SP{sp}")


def test_recompute_matches_tp1_cp1(tmp_path, baseline):
    """--recompute (activation checkpointing) at TP2/CP2/SP == (1,1,off) without it, bytes."""
    assert_same_bytes(_run(tmp_path, 2, 2, True, recompute=True), baseline, "recompute")


def test_control_native_layouts_differ(tmp_path):
    """negative control: stock ops + SUM collectives give different bytes at TP4/CP1 (KV heads
    replicated, the vocab-parallel stock log-softmax) vs TP1."""
    one = single_process(JOB, "native")
    four = _run(tmp_path, 4, 1, False, "native")
    with pytest.raises(AssertionError):
        assert_same_bytes(four, one, "native")
    # Still the same computation: gradients and the per-token logprobs (at TP4 Megatron's
    # vocab-parallel form, NativeOps.linear_token_logprobs) agree to fp32 rounding, not bitwise.
    g1, g4 = one["steps"][0]["grads"], four[0]["steps"][0]["grads"]
    for n in g1:
        assert ((g1[n] - g4[n]).norm() / g1[n].norm().clamp(min=1e-30)).item() < 1e-4, n
    lp1, lp4 = one["steps"][0]["logprobs"], four[0]["steps"][0]["logprobs"]
    assert set(lp1) == set(lp4)
    assert max(abs(float(lp1[k]) - float(lp4[k])) for k in lp1) < 1e-5
    assert abs(one["steps"][0]["entropy"] - four[0]["steps"][0]["entropy"]) < 1e-5


@pytest.mark.parametrize("tp,cp,sp", [(2, 1, True), (1, 2, False)])
def test_bf16_layout_matches_bf16_tp1_cp1(tmp_path, tp, cp, sp):
    """bf16 parameters: every rank's logprobs, gradients, norm, loss, entropy and bf16 weights
    after 2 AdamW steps == the bf16 TP1/CP1 run, bytes. Control: the bf16 run is not the fp32
    one (the rounding points act), so the comparison is of the bf16 path."""
    base = single_process(JOB_BF16)
    assert base["weights"]["model.embed_tokens.weight"].dtype == torch.bfloat16
    fp32 = single_process(JOB)
    assert any(not torch.equal(base["weights"][n].float(), fp32["weights"][n])
               for n in base["weights"])
    out = tmp_path / f"bf16-{tp}-{cp}-{int(sp)}"
    out.mkdir()
    assert_same_bytes(run_layout(out, JOB_BF16, tp, cp, sp), base, f"bf16 TP{tp}/CP{cp}/SP{sp}")


def test_bf16_control_native_tp2_differs(tmp_path):
    """negative control for the bf16 layouts: stock ops + SUM collectives at TP2 with bf16
    parameters differ from stock TP1 by bytes."""
    one = single_process(JOB_BF16, "native")
    out = tmp_path / "bf16-native"
    out.mkdir()
    with pytest.raises(AssertionError):
        assert_same_bytes(run_layout(out, JOB_BF16, 2, 1, False, "native"), one, "bf16 native")
