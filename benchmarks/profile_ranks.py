"""Where the ranks of a multi-rank `rlk run` spend their time: runs the job with every process
under cProfile (benchmarks/rank_profile/sitecustomize.py) and prints, per rank process, the
functions with the most cumulative time among the collectives (rlkernel/distributed/comm.py,
torch.distributed) and the step's own phases, plus the process's total.

Run (repository root): PYTHONPATH=. python3 benchmarks/profile_ranks.py [--top N] -- RLK_RUN_ARGS
e.g. ... -- --model M --device cuda --cp 2 --rollout-cp 2 --steps 2 --run-dir /tmp/r
(with RLK_SHARE_GPUS=1 on one GPU). cProfile slows Python-heavy code, so the times are for
attribution, not for the step table. Does not: profile the GPU (benchmarks/profile_trace.py).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import pstats
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PHASES = ("train/step.py", "runner/loop.py", "rollout/engine.py", "weights/")
COLLECTIVES = ("distributed/comm.py", "distributed/tokensum.py", "torch/distributed/")


def _rows(st: pstats.Stats, files: tuple[str, ...], top: int
          ) -> list[tuple[float, float, int, str]]:
    """[(cumulative s, own s, calls, 'file:line(function)')] of the functions of `files` in one
    profile, by cumulative time (module bodies left out)."""
    rows = []
    for (file, line, fn), (_, calls, own, cum, _) in st.stats.items():
        if fn != "<module>" and any(w in file for w in files):
            short = file.split("site-packages/")[-1].split("rlkernel/")[-1]
            rows.append((cum, own, calls, f"{short}:{line}({fn})"))
    rows.sort(reverse=True)
    return rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then `rlk run` arguments")
    a = ap.parse_args()
    args = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "RLK_PROFILE_DIR": d,
               "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks" / "rank_profile"),
                                              str(ROOT), os.environ.get("PYTHONPATH", "")])}
        p = subprocess.run([sys.executable, "-m", "rlkernel.cli", "run", *args], env=env,
                           cwd=ROOT)
        profiles = sorted(pathlib.Path(d).glob("*.prof"))
        print(f"rlk run exit {p.returncode}; {len(profiles)} process profiles")
        for prof in profiles:
            st = pstats.Stats(str(prof))
            if not any(k[2] == "_rank_main" for k in st.stats):
                continue                   # the launcher and helper processes: no rank ran
            total = max(v[3] for v in st.stats.values())
            print(f"\n== rank process {prof.stem}: {total:.1f} s profiled")
            for title, files in (("phases", PHASES), ("collectives", COLLECTIVES)):
                print(f"-- {title}\n{'cum s':>9} {'own s':>9} {'calls':>8}  function")
                for cum, own, calls, name in _rows(st, files, a.top):
                    print(f"{cum:9.2f} {own:9.2f} {calls:8d}  {name}")
    sys.exit(p.returncode)


if __name__ == "__main__":
    main()
