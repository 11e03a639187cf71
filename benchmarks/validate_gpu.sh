#!/usr/bin/env bash
# GPU validation of the contract (docs/VALIDATION.md): the CUDA test files, then `rlk run` on a
# random qwen3-0.6b checkpoint at TP1, TP2/rollout-TP2, CP2/rollout-CP2 and DP2 (ZeRO-1, 1-sample
# microbatches; invariant) and TP1 vs TP2, TP1 vs DP2 (native controls), each pair compared with
# `rlk compare` (peak GPU memory of rank 0 per run: summarize_runs.py). Needs two GPUs for the
# multi-rank parts (four for tp2-cp2, asked for only by name). RLK_LAYOUTS picks a subset of the
# runs (names as below). Usage (repository root):
#   bash benchmarks/validate_gpu.sh OUTDIR [tests|runs|all]
set -uo pipefail
out=${1:?usage: validate_gpu.sh OUTDIR [tests|runs|all]}
what=${2:-all}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
rlk() { python3 -m rlkernel.cli "$@"; }

if [ "$what" != runs ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_backward.py \
    tests/test_cuda_attention_bwd.py tests/test_cuda_adamw.py tests/test_cuda_dist.py 2>&1 | tee "$out/cuda_tests.txt" | tail -15
fi
[ "$what" = tests ] && exit 0

model=${RLK_MODEL_DIR:-/tmp/qwen3-0.6b-seed0}
if [ ! -f "$model/config.json" ]; then
  rlk init-model --preset qwen3-0.6b --seed 0 --out "$model" >/dev/null
fi
args=(--model "$model" --device cuda --steps 2 --require-updates --temperature 0.7 --top-p 0.95
      --max-response-len 64 --n-prompts 4 --n-samples-per-prompt 4 --kl-coef 0.01
      --entropy-coef 0.001 --allow-dirty ${RLK_ARGS:-})
runs=$out/runs
rm -rf "$runs"; mkdir -p "$runs"
declare -A layouts=([tp1]="" [tp2-rtp2]="--tp 2 --rollout-tp 2" [cp2-rcp2]="--cp 2 --rollout-cp 2"
                    [dp2]="--dp 2 --micro-batch-tokens 320" [dp2-whole]="--dp 2"
                    [tp2-cp2]="--tp 2 --cp 2 --rollout-tp 2 --rollout-cp 2"
                    [native-tp1]="--mode native" [native-tp2]="--mode native --tp 2 --rollout-tp 2"
                    [native-dp2]="--mode native --dp 2 --micro-batch-tokens 320")
names=${RLK_LAYOUTS:-tp1 tp2-rtp2 cp2-rcp2 dp2 native-tp1 native-tp2 native-dp2}
for name in $names; do
  echo "== rlk run $name"
  # shellcheck disable=SC2086
  timeout "${RLK_TIMEOUT:-300}" python3 -m rlkernel.cli run "${args[@]}" ${layouts[$name]} \
    --run-dir "$runs/$name" 2>&1 | tail -4
done
{
  for pair in "tp1 tp2-rtp2" "tp1 cp2-rcp2" "tp1 dp2" "tp1 dp2-whole" "tp1 tp2-cp2" \
              "native-tp1 native-tp2" "native-tp1 native-dp2"; do
    set -- $pair
    [ -d "$runs/$1" ] && [ -d "$runs/$2" ] || continue
    echo "== rlk compare $1 $2"
    rlk compare "$runs/$1" "$runs/$2" | tail -12
    echo "exit ${PIPESTATUS[0]}"
  done
  python3 benchmarks/summarize_runs.py "$runs"/*
} 2>&1 | tee "$out/validation.txt"
