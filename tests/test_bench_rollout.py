"""benchmarks/bench_rollout.py --profile runs, and its trace summary counts what it should.

Properties: the CPU smoke run (tiny preset, two batch sizes, both engine arms) writes one profile
per (batch, arm) with every token generated, every engine phase label seen once per step that
reaches it, and no kernels; on a hand-made CUDA-shaped trace, `profile_trace.summarize` sums
kernel time, counts launches, gives each kernel to the label its launch falls in, and takes
children's time out of a host op's self time.
Run: `PYTHONPATH=. .venv/bin/python -m pytest -q tests/test_bench_rollout.py` (about 15 s).
"""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_rollout, profile_trace


def test_profile_smoke_cpu(tmp_path):
    out = tmp_path / "p.json"
    bench_rollout.main(["--device", "cpu", "--preset", "tiny", "--profile", "--profile-batches",
                        "1", "3", "--profile-prompt", "8", "--profile-new", "4",
                        "--out", str(out)])
    runs = json.loads(out.read_text())["profile"]
    assert [(r["arm"], r["seqs"]) for r in runs] == [("invariant", 1), ("native", 1),
                                                     ("invariant", 3), ("native", 3)]
    for r in runs:
        assert r["output_tokens"] == r["seqs"] * 4 and r["steps"] == 4
        assert {n: p["calls"] for n, p in r["phases"].items()} == {
            "rollout.metadata": 4, "rollout.hidden": 4, "rollout.logprobs": 4,
            "rollout.sample": 4}
        assert r["kernels"] == 0 and r["device_over_wall"] is None
        assert 0 < len(r["top_cpu_ops"]) <= 25


def _ev(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid,
            "args": args}


def test_summarize_synthetic_cuda_trace():
    events = [
        _ev("user_annotation", "rollout.hidden", 0, 100),
        _ev("cpu_op", "aten::mm", 10, 30),
        _ev("cuda_runtime", "cudaLaunchKernel", 20, 5, correlation=7),
        _ev("cuda_driver", "cuLaunchKernelEx", 50, 5, correlation=8),
        _ev("user_annotation", "rollout.sample", 200, 50),
        _ev("cuda_runtime", "cudaLaunchKernel", 210, 5, correlation=9),
        _ev("cuda_runtime", "cudaLaunchKernel", 300, 5, correlation=10),     # outside the labels
        _ev("kernel", "gemm", 30, 40, tid=7, correlation=7),
        _ev("kernel", "triton_norm", 80, 10, tid=7, correlation=8),
        _ev("kernel", "gemm", 220, 40, tid=7, correlation=9),
        _ev("kernel", "fill", 310, 10, tid=7, correlation=10),
        _ev("gpu_memcpy", "Memcpy HtoD", 5, 1, tid=7, correlation=11),
        _ev("gpu_user_annotation", "rollout.hidden", 30, 60, tid=7),
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {}},
    ]
    s = profile_trace.summarize(events, 400e-6, "rollout.")
    assert s["kernels"] == 4 and s["memcpys"] == 1
    assert abs(s["device_s"] - 100e-6) < 1e-12 and abs(s["device_over_wall"] - 0.25) < 1e-9
    assert s["top_kernels"][0] == {"name": "gemm", "count": 2, "total_ms": pytest.approx(0.08)}
    ph = s["phases"]
    assert ph["rollout.hidden"]["kernels"] == 2 and ph["rollout.sample"]["kernels"] == 1
    assert ph["rollout.hidden"]["device_ms"] == pytest.approx(0.05)
    assert ph["rollout.sample"]["device_ms"] == pytest.approx(0.04)
    assert ph["(outside the labels)"]["kernels"] == 1
    assert ph["rollout.hidden"]["host_ms"] == pytest.approx(0.1)
    ops = {o["name"]: o for o in s["top_cpu_ops"]}
    assert ops["rollout.hidden"]["self_ms"] == pytest.approx(0.065)    # minus mm and cuLaunch
    assert ops["aten::mm"]["self_ms"] == pytest.approx(0.025)
    assert abs(s["host_outside_ops_s"] - (400 - 155) * 1e-6) < 1e-12
