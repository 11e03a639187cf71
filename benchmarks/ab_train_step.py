"""A/B of the training step between two builds, run alternately in one machine session.

A host-bound step's warm times spread by ±15 % between runs of one build (docs/BENCHMARKS.md,
twenty-third session), so two builds are compared only when their runs alternate on the same
machine: round r runs the old tree, then the new one, each as a fresh process of its own
`benchmarks/bench_train_step.py` with the same arguments. Reported per build and arm: the warm
steps (each run's steps after its first) pooled over rounds, their mean and min, the new/old
ratios of both, and whether every run's first gradient norm is the same float (`repr`: the
same bits) — a change meant to be speed-only must keep it.

Usage (repository root; OLD: a tree of the old commit with its rlkernel/ and benchmarks/,
e.g. `git archive cec1d16 rlkernel benchmarks | tar -x -C ab_old`, kept untracked so it
travels to the GPU machine):
    python3 benchmarks/ab_train_step.py --old ab_old --rounds 3 --out ab.json -- \\
        --model qwen3-1.7b --samples 16 --prompt-len 64 --response-len 960 --no-kl \\
        --arms invariant,native --invariant-micro-samples 4 --native-micro-samples 4
Everything after `--` goes to bench_train_step.py unchanged (not --out).
Raises SystemExit naming the run that failed; the JSON keeps the runs done before it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(tree: pathlib.Path, bench_args: list[str], timeout: float) -> dict:
    """One bench_train_step.py process of `tree` (its own rlkernel first on the path); its
    JSON."""
    with tempfile.TemporaryDirectory() as d:
        out = pathlib.Path(d) / "r.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
        try:
            p = subprocess.run([sys.executable, str(tree / "benchmarks" / "bench_train_step.py"),
                                *bench_args, "--out", str(out)], env=env, cwd=tree,
                               capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"ab_train_step: {tree} ran past --timeout {timeout} s") from None
        if p.returncode != 0 or not out.is_file():
            raise SystemExit(f"ab_train_step: {tree} exited {p.returncode}:\n{p.stderr[-3000:]}")
        return json.loads(out.read_text())


def summarize(runs: dict[str, list[dict]]) -> dict:
    """{"arms": {arm: {build: {warm, mean, min}, ratio_mean, ratio_min}}, "first_grad_norms":
    {build: [...]}, "same_first_grad_norm": bool} from `runs` = {"old": [bench JSON, ...],
    "new": [...]} (every run's arms; warm = each run's step times after its first)."""
    arms = sorted({a for rs in runs.values() for r in rs for a in r["arms"]})
    table = {}
    for arm in arms:
        row = {}
        for build, rs in runs.items():
            warm = [t for r in rs if arm in r["arms"] for t in r["arms"][arm]["step_s"][1:]]
            row[build] = {"warm": warm, "mean": math.fsum(warm) / len(warm) if warm else None,
                          "min": min(warm) if warm else None}
        if all(row[b]["mean"] for b in ("old", "new")):
            row["ratio_mean"] = row["new"]["mean"] / row["old"]["mean"]
            row["ratio_min"] = row["new"]["min"] / row["old"]["min"]
        table[arm] = row
    norms = {b: [repr(r["arms"][a]["first_grad_norm"]) for r in rs for a in sorted(r["arms"])
                 if a.startswith("invariant")] for b, rs in runs.items()}
    every = [n for ns in norms.values() for n in ns]
    return {"arms": table, "first_grad_norms": norms,
            "same_first_grad_norm": bool(every) and len(set(every)) == 1}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, type=pathlib.Path,
                    help="tree of the old build (rlkernel/ and benchmarks/)")
    ap.add_argument("--new", type=pathlib.Path, default=ROOT, help="default: this tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv[:cut])
    bench_args = argv[cut + 1:]
    if any(x == "--out" or x.startswith("--out=") for x in bench_args):
        ap.error("give --out before --, not to bench_train_step.py")
    if a.timeout <= 0:
        ap.error(f"--timeout {a.timeout}: must be > 0 seconds")
    out_dir = pathlib.Path(a.out).absolute().parent
    if pathlib.Path(a.out).is_dir() or not out_dir.is_dir():
        ap.error(f"--out {a.out}: needs a file name in an existing directory")
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}: must be at least 1")
    for tree in (a.old, a.new):
        if not (tree / "benchmarks" / "bench_train_step.py").is_file():
            ap.error(f"{tree}: no benchmarks/bench_train_step.py (a tree of rlkernel/ and "
                     "benchmarks/ is expected)")
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(a.rounds):
        for build, tree in (("old", a.old), ("new", a.new)):
            runs[build].append(_run(tree.resolve(), bench_args, a.timeout))
            res = {"old": str(a.old), "new": str(a.new), "bench_args": bench_args,
                   "rounds_done": r + (build == "new"), "runs": runs, **summarize(runs)}
            pathlib.Path(a.out).write_text(json.dumps(res, indent=1))
    for arm, row in res["arms"].items():
        line = ", ".join(f"{b} mean {row[b]['mean']:.3f} s min {row[b]['min']:.3f} s "
                         f"({len(row[b]['warm'])} warm steps)" for b in ("old", "new")
                         if row[b]["mean"] is not None)
        ratio = (f"; new/old {row['ratio_mean']:.3f} at the means, {row['ratio_min']:.3f} at "
                 "the mins" if "ratio_mean" in row else "")
        print(f"{arm}: {line}{ratio}")
    print(f"first grad norm the same in every invariant run: {res['same_first_grad_norm']} "
          f"{sorted(set(n for ns in res['first_grad_norms'].values() for n in ns))}")


if __name__ == "__main__":
    main()
