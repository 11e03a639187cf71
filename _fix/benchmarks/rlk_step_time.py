"""Step-time ratio invariant / native of two `rlk run` directories (evidence.json), plus the
train/rollout logprob mismatch counts of each.

Step 0 includes Triton compilation and CUDA warm-up, so the ratio is reported per step and for
the steps after the first. Run:
    PYTHONPATH=. python3 benchmarks/rlk_step_time.py RUN_INVARIANT RUN_NATIVE [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib

from benchmarks.common import dump


def _steps(run: str) -> list[dict]:
    ev = json.loads((pathlib.Path(run) / "evidence.json").read_text())
    steps = ev.get("steps", ev)
    return [s for s in steps if isinstance(s, dict) and "step" in s]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("invariant")
    ap.add_argument("native")
    ap.add_argument("--out")
    a = ap.parse_args()
    inv, nat = _steps(a.invariant), _steps(a.native)
    rows = []
    for si, sn in zip(inv, nat):
        ti, tn = si["timings"], sn["timings"]
        rows.append({"step": si["step"], "invariant": ti, "native": tn,
                     "ratio_step": ti["step_s"] / tn["step_s"],
                     "ratio_rollout": ti["rollout_s"] / tn["rollout_s"],
                     "ratio_train": ti["train_s"] / tn["train_s"],
                     "mismatch_invariant": f"{si['logprob_mismatches']}/{si['logprob_tokens']}",
                     "mismatch_native": f"{sn['logprob_mismatches']}/{sn['logprob_tokens']}",
                     "grad_norm_invariant": si.get("grad_norm"), "grad_norm_native": sn.get("grad_norm")})
        r = rows[-1]
        print(f"step {r['step']}: step {ti['step_s']:.2f}s / {tn['step_s']:.2f}s = x{r['ratio_step']:.2f}"
              f" (rollout x{r['ratio_rollout']:.2f}, train x{r['ratio_train']:.2f}); mismatches "
              f"invariant {r['mismatch_invariant']}, native {r['mismatch_native']}", flush=True)
    dump(a.out, {"rows": rows})


if __name__ == "__main__":
    main()
