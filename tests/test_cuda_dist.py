"""The model end to end on two GPUs over NCCL: every layout gives the bytes of TP1/CP1 (issue 10.1).

Two chains, each with a native-mode negative control:
1. The topology probe (tests/topology_probe.py: two training steps of test_topology's fixed batch)
   on CUDA, one GPU per rank, process group `cpu:gloo,cuda:nccl`: TP2, CP2, TP2+SP and DP2 give, on
   every rank, the per-token logprobs, every gradient, the exact grad norm, loss, entropy and the
   weights after two AdamW updates of the TP1 run (one GPU, no process group), bytewise. Hence
   any two of them agree.
2. `rlk run --device cuda` (tiny model, 2 steps) at TP1 (rollout decode on CUDA graphs), TP1
   with --enforce-eager, TP1 with --keep-rollout-state (pool and graphs kept across steps),
   TP2/rollout-TP2, CP2/rollout-CP2,
   TP2+SP/rollout-TP1 and DP2 with smaller microbatches: `rlk compare` says IDENTICAL for each against TP1 (sampled tokens, grad
   norms, every tensor hash after every update) and every step has 0 train/rollout logprob
   mismatches over a non-zero number of compared tokens.
The probe runs with fp32 and with bf16 parameters (the bf16 path: bf16 weights into the
tensor-core kernels, fp32 masters).
TP2×CP2 (four ranks) is checked by the probe too: over NCCL on four GPUs, the ranks sharing the
GPUs over gloo on fewer.
Skipped without a CUDA device (CPU CI). Run on a two-GPU machine:
    PYTHONPATH=. python3 -m pytest -q tests/test_cuda_dist.py
On a one-GPU machine the same tests run with the two ranks sharing the GPU (RLK_SHARE_GPUS=1:
CUDA tensors over gloo, staged through host memory; rlkernel/distributed/launch.py): the
kernels, shard trees and collectives' trees of every layout are checked, NCCL is not.
"""

from __future__ import annotations

import json

import pytest
import torch

from rlkernel.cli import main
from rlkernel.distributed.topology import SHARE_GPUS_ENV
from test_topology import JOB, JOB_BF16
from topology_probe import assert_same_bytes, run_layout, single_process

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHARED = torch.cuda.device_count() < 2
"""One GPU: the ranks share it (gloo for CUDA tensors)."""

LAYOUTS = [(1, 2, 1, False), (1, 1, 2, False), (1, 2, 1, True), (2, 1, 1, False)]
"""(dp, tp, cp, sp) on two ranks; DP2 runs ZeRO-1 and sums the exact gradient accumulators over
NCCL (int64)."""
JOBS = {"fp32": JOB, "bf16": JOB_BF16}


@pytest.fixture(scope="module", autouse=True)
def _ranks_share_one_gpu():
    """RLK_SHARE_GPUS=1 for this module when there is one GPU (spawned ranks inherit it)."""
    with pytest.MonkeyPatch.context() as mp:
        if SHARED:
            mp.setenv(SHARE_GPUS_ENV, "1")
        yield


@pytest.fixture(scope="module")
def baselines():
    return {name: single_process(job, device="cuda") for name, job in JOBS.items()}


@pytest.mark.parametrize("dtype", list(JOBS))
@pytest.mark.parametrize("dp,tp,cp,sp", LAYOUTS)
def test_cuda_layout_matches_tp1_on_two_gpus(tmp_path, baselines, dp, tp, cp, sp, dtype):
    """On every rank: per-token logprobs, every gradient, grad norm, loss, entropy and the weights
    after 2 AdamW steps at (dp, tp, cp, sp) on 2 GPUs over NCCL (or two ranks sharing one GPU)
    == the TP1 run on one GPU, bytes, with fp32 and with bf16 parameters."""
    got = run_layout(tmp_path, JOBS[dtype], tp, cp, sp, device="cuda", dp=dp)
    assert_same_bytes(got, baselines[dtype], f"cuda {dtype} DP{dp}/TP{tp}/CP{cp}/SP{sp}")


@pytest.mark.parametrize("dtype", list(JOBS))
def test_cuda_tp2_cp2_matches_tp1_on_four_ranks(tmp_path, monkeypatch, baselines, dtype):
    """TP2×CP2 (four ranks: TP's sums and CP's K/V exchange and exact dK/dV sums together) ==
    the TP1 run, bytes, as above; the ranks share the GPUs when there are fewer than four."""
    if torch.cuda.device_count() < 4:
        monkeypatch.setenv(SHARE_GPUS_ENV, "1")
    got = run_layout(tmp_path, JOBS[dtype], 2, 2, False, device="cuda")
    assert_same_bytes(got, baselines[dtype], f"cuda {dtype} TP2/CP2")


def test_cuda_control_native_tp2_differs(tmp_path):
    """Negative control: stock ops + NCCL SUM all-reduces at TP2 differ from native TP1 (same
    computation: gradients agree to fp32 rounding, not bitwise)."""
    one = single_process(JOB, "native", device="cuda")
    two = run_layout(tmp_path, JOB, 2, 1, False, "native", device="cuda")
    with pytest.raises(AssertionError):
        assert_same_bytes(two, one, "cuda native")
    g1, g2 = one["steps"][0]["grads"], two[0]["steps"][0]["grads"]
    for n in g1:
        assert ((g1[n] - g2[n]).norm() / g1[n].norm().clamp(min=1e-30)).item() < 1e-4, n


RUN = ["--steps", "2", "--require-updates", "--device", "cuda", "--temperature", "0.7",
       "--top-p", "0.95", "--max-response-len", "32", "--kl-coef", "0.01", "--allow-dirty",
       # ranks sharing a GPU size their KV pools from the memory free when each starts
       *(["--gpu-memory-utilization", "0.3"] if SHARED else [])]
E2E = {"tp1-eager": ["--enforce-eager"],       # rollout decode without CUDA graphs
       "tp1-kept": ["--keep-rollout-state"],   # pool and graphs kept from step to step
       "tp2-rtp2": ["--tp", "2", "--rollout-tp", "2"],
       "cp2-rcp2": ["--cp", "2", "--rollout-cp", "2"],
       "tp2-sp": ["--tp", "2", "--sp"],
       "dp2-micro": ["--dp", "2", "--micro-batch-tokens", "300"]}


def _rlk(tmp_path, name: str, *extra: str) -> str:
    d = str(tmp_path / name)
    assert main(["run", *RUN, "--run-dir", d, *extra]) == 0
    with open(f"{d}/evidence.json") as f:
        for s in json.load(f)["steps"]:
            assert s["logprob_tokens"] > 0 and s["logprob_mismatches"] == 0, (name, s)
            assert s["weight_audit"]["ok"] and s["version_changed"], name
    return d


def test_cuda_rlk_run_identical_across_layouts_on_two_gpus(tmp_path, capsys):
    """rlk run on CUDA: TP1 --enforce-eager, TP2/rollout-TP2, CP2/rollout-CP2, TP2+SP,
    DP2/--micro-batch-tokens 300 each == TP1 with CUDA-graph decode (rlk compare
    IDENTICAL: tokens, grad norms, every tensor hash), 0 logprob mismatches in every run."""
    base = _rlk(tmp_path, "tp1")
    for name, extra in E2E.items():
        other = _rlk(tmp_path, name, *extra)
        capsys.readouterr()
        assert main(["compare", base, other]) == 0, name
        assert capsys.readouterr().out.rstrip().endswith("IDENTICAL"), name


def test_cuda_rlk_run_control_native_tp2_differs(tmp_path, capsys):
    """Negative control: rlk run --mode native on CUDA, TP1 vs TP2/rollout-TP2: compare says
    DIFFERENT (exit 1)."""
    native = ["--mode", "native", "--dtype", "fp32"]
    a = str(tmp_path / "n1")
    b = str(tmp_path / "n2")
    assert main(["run", *RUN, "--run-dir", a, *native]) == 0
    assert main(["run", *RUN, "--run-dir", b, *native, "--tp", "2", "--rollout-tp", "2"]) == 0
    capsys.readouterr()
    assert main(["compare", a, b]) == 1
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("DIFFERENT")
