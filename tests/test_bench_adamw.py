"""benchmarks/bench_adamw.py on CPU: the smoke mode runs (the CPU AdamW.step, torch ops and
torch.optim.AdamW arms on the tiny preset, and the differing elements counted) and the default
shapes are qwen3-1.7b's (310 tensors, 1,720,574,976 elements: what the CUDA run times). Run: `.venv/bin/python -m pytest -q tests/test_bench_adamw.py`.
"""

from __future__ import annotations

import json
import math

from benchmarks import bench_adamw


def test_qwen3_1_7b_shapes_are_the_models():
    sh = bench_adamw.shapes("qwen3-1.7b")
    assert len(sh) == 310 and sum(math.prod(s) for s in sh.values()) == 1_720_574_976


def test_cpu_smoke_run_writes_every_cpu_arm(tmp_path):
    out = tmp_path / "adamw.json"
    got = bench_adamw.main(["--device", "cpu", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == got["rows"]
    assert [r["arm"].split(" (")[0] for r in got["rows"]] == [
        "float64 ops rounded per op", "torch ops", "torch.optim.AdamW(fused=True)"]
    assert got["differing_elements_vs_torch_ops"]["master"] > 0
    assert all(r["ms"] > 0 for r in got["rows"]) and got["preset"] == "tiny"
