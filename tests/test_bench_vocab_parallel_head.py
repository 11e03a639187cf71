"""benchmarks/bench_vocab_parallel_head.py on CPU: the smoke mode runs both arms at every TP and
writes a record per (tokens, TP), so the GPU call that measures them cannot fail on the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_smoke_run_times_both_arms_at_every_tp(tmp_path):
    out = tmp_path / "head.json"
    p = subprocess.run([sys.executable, "benchmarks/bench_vocab_parallel_head.py", "--device", "cpu",
                        "--tokens", "32", "--hidden", "16", "--vocab", "512", "--live", "500",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tokens"], r["tp"]) for r in rows] == [(32, t) for t in (1, 2, 4, 8)]
    assert all(r[arm]["ms"] > 0 for r in rows for arm in ("fused", "gathered"))
