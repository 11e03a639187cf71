"""One table row per `rlk run` directory: per step the grad norm (hex), logprob mismatches over
compared tokens, whether the weights changed, step timings and peak GPU memory (when recorded).

Run: PYTHONPATH=. python3 benchmarks/summarize_runs.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import json
import pathlib
import sys


def _row(run: pathlib.Path, s: dict) -> str:
    t = s.get("timings", {})
    mem = s.get("resources", {}).get("peak_gpu_mem_gib")
    return (f"| {run.name} | {s['step']} | {s['grad_norm_hex']} | "
            f"{s['logprob_mismatches']}/{s['logprob_tokens']} | {s['version'][:12]} | "
            f"{t.get('rollout_s', 0):.2f} | {t.get('train_s', 0):.2f} | "
            f"{t.get('export_audit_s', 0):.2f} | {t.get('step_s', 0):.2f} | "
            f"{'' if mem is None else f'{mem:.2f}'} |")


def main(dirs: list[str]) -> None:
    print("| run | step | grad norm (hex) | mismatches/tokens | version | rollout s | train s | "
          "sync+audit s | step s | peak GiB/GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in map(pathlib.Path, dirs):
        ev = d / "evidence.json"
        if not ev.exists():
            print(f"| {d.name} | (no evidence) |||||||||")
            continue
        for s in json.loads(ev.read_text())["steps"]:
            print(_row(d, s))


if __name__ == "__main__":
    main(sys.argv[1:])
