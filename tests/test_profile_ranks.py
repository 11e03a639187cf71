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


def test_a_rank_dumps_its_profile_when_it_reports_done(tmp_path):
    """The helper writes a rank's profile when the rank sends the launcher its {"ok": True}
    report, before any exit hook: on CUDA the launcher stopped ranks whose teardown outlasted
    GRACE_S, and an exit-time dump was never written. A process that reports and then leaves
    by os._exit (no exit hook) still leaves its profile."""
    code = ("import multiprocessing as mp, os\n"
            "r, w = mp.Pipe(duplex=False)\n"
            "w.send({'rank': 0, 'ok': True})\n"
            "w.send({'rank': 0, 'ok': True})\n"
            "os._exit(0)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "RLK_PROFILE_DIR": str(tmp_path),
                            "PYTHONPATH": str(ROOT / "benchmarks" / "rank_profile")})
    assert p.returncode == 0, p.stderr
    assert [f.suffix for f in tmp_path.iterdir()] == [".prof"]
    # Control: without RLK_PROFILE_DIR the helper does nothing
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**{k: v for k, v in os.environ.items() if k != "RLK_PROFILE_DIR"},
                            "PYTHONPATH": str(ROOT / "benchmarks" / "rank_profile")}, cwd=tmp_path)
    assert p.returncode == 0 and len(list(tmp_path.iterdir())) == 1
