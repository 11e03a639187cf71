#!/usr/bin/env bash
# `rlk run` on the GPU with a random qwen3-0.6b checkpoint, both modes, 2 steps; step-time ratio.
# Default run settings (4 prompts x 4 samples, 64 response tokens) plus a small entropy bonus, so
# that the update is non-zero even though a random model earns no reward.
# Usage (repository root): bash benchmarks/run_rlk.sh DIR   (run dirs and a summary JSON in DIR)
set -uo pipefail
out=${1:?usage: run_rlk.sh DIR}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
model=${RLK_MODEL_DIR:-/tmp/qwen3-0.6b-seed0}
if [ ! -f "$model/config.json" ]; then
  python3 -m rlkernel.cli init-model --preset qwen3-0.6b --seed 0 --out "$model"
fi
for mode in invariant native; do
  rm -rf "$out/run_$mode"
  timeout "${RLK_TIMEOUT:-300}" python3 -m rlkernel.cli run --model "$model" \
    --device cuda --mode "$mode" --steps 2 --run-dir "$out/run_$mode" --allow-dirty \
    --entropy-coef 0.001 ${RLK_ARGS:-} 2>&1 | tail -25
done
python3 benchmarks/rlk_step_time.py "$out/run_invariant" "$out/run_native" --out "$out/rlk_step_time.json"
