"""benchmarks/bench_int_sum.py on CPU with gloo ranks: the three forms of the exact gradient sum
(integer all-reduce, integer slices, double words by slices) are checked bytewise equal and
timed at every size (one padded: no world size divides it), so the GPU call that measures them
cannot fail on the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_run_checks_and_times_the_three_forms(tmp_path):
    out = tmp_path / "int_sum.json"
    p = subprocess.run([sys.executable, "benchmarks/bench_int_sum.py", "--world", "3",
                        "--sizes", "4096,5001", "--reps", "1", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert (rec["world"], rec["backend"]) == (3, "gloo")
    assert [r["elements"] for r in rec["rows"]] == [4096, 5001]
    for r in rec["rows"]:
        assert r["all_reduce_ms"] > 0 and r["sliced_ms"] > 0 and r["words_ms"] > 0
        assert r["words_bytes_sent"] < r["sliced_bytes_sent"] < r["all_reduce_bytes_sent"]
    assert "5001 elements" in p.stdout
