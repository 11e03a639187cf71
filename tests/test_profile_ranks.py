"""benchmarks/profile_ranks.py on the CPU: a two-rank `rlk run --cp 2` (tiny model, one step)
under cProfile in every process; each rank's profile is read back and its phases and
collectives printed (so a GPU call that profiles CP2 cannot fail on the script)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_cp2_run_is_profiled_on_both_ranks(tmp_path):
    p = subprocess.run([sys.executable, "benchmarks/profile_ranks.py", "--top", "5", "--",
                        "--steps", "1", "--cp", "2", "--max-response-len", "16",
                        "--allow-dirty", "--run-dir", str(tmp_path / "r")], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("== rank process") == 2, p.stdout[-3000:]
    assert p.stdout.count("-- collectives") == 2 and "comm.py" in p.stdout
    assert "runner/loop.py" in p.stdout and (tmp_path / "r" / "evidence.json").exists()
