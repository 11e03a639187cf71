#!/usr/bin/env bash
# Issue 11 at the seeds' scale, on two GPUs (nvidia-h200-x2), in device-time-sized parts:
#   item7  qwen3-1.7b (random, seed 0), 2 steps x 2 prompts x 4 samples x 512 response tokens
#          (8,192 logprobs) at TP1 (one GPU), TP2 and CP2 (two GPUs); the rollout runs as one
#          replica per GPU at rollout TP1 (CUDA-graph decode; rollout TP is eager and slow), which
#          cannot change a byte (samples are keyed by sample id). `rlk compare` TP1 vs TP2 and
#          TP1 vs CP2 must say IDENTICAL; every step 0 logprob mismatches.
#   item3  qwen3-8b (random, seed 0), one RL step at TP2, one microbatch per rank (direct mode:
#          no persistent gradient words), --recompute.
#   head   benchmarks/bench_vocab_parallel_head.py at qwen3-1.7b and qwen3-8b hidden sizes.
# Peak GPU memory per run: summarize_runs.py (evidence `resources.peak_gpu_mem_gib`, max over
# ranks). Triton's cache is warm after the first run, so later runs compile less.
# RLK_ARGS: more `rlk run` flags for every run. With one GPU, RLK_SHARE_GPUS=1 runs the two-rank
# layouts with both ranks on it (validation only; rlkernel/distributed/launch.py) — then give
# RLK_ARGS="--gpu-memory-utilization 0.2" so that the ranks' KV pools leave room for each other.
# Usage (repository root): bash benchmarks/validate_scale.sh OUTDIR item7|item3|head
set -uo pipefail
out=${1:?usage: validate_scale.sh OUTDIR item7|item3|head}
part=${2:?usage: validate_scale.sh OUTDIR item7|item3|head}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
rlk() { python3 -m rlkernel.cli "$@"; }
common=(--device cuda --allow-dirty --temperature 0.7 --top-p 0.95 --entropy-coef 0.001
        --kl-coef 0.01 --require-updates ${RLK_ARGS:-})

model_dir() {   # preset -> a seeded random checkpoint (cached under /tmp)
  local m=/tmp/rlk-$1-seed0
  [ -f "$m/config.json" ] || rlk init-model --preset "$1" --seed 0 --out "$m" >/dev/null
  echo "$m"
}

case $part in
  item7)
    m=$(model_dir qwen3-1.7b)
    args=(--model "$m" --steps 2 --n-prompts 2 --n-samples-per-prompt 4
          --max-response-len 512 "${common[@]}")
    for layout in "tp1:" "tp2:--tp 2" "cp2:--cp 2"; do
      name=${layout%%:*}
      echo "== rlk run $name"
      # shellcheck disable=SC2086
      timeout "${RLK_TIMEOUT:-240}" python3 -m rlkernel.cli run "${args[@]}" ${layout#*:} \
        --run-dir "$out/$name" 2>&1 | tail -3
    done
    for other in tp2 cp2; do
      echo "== rlk compare tp1 $other"
      rlk compare --quiet "$out/tp1" "$out/$other"
      echo "exit $?"
    done
    python3 benchmarks/summarize_runs.py "$out"/tp1 "$out"/tp2 "$out"/cp2 ;;
  item3)
    m=$(model_dir qwen3-8b)
    echo "== rlk run tp2 (qwen3-8b)"
    timeout "${RLK_TIMEOUT:-480}" python3 -m rlkernel.cli run --model "$m" --steps 1 \
      --n-prompts 2 --n-samples-per-prompt 4 --max-response-len 512 --tp 2 --recompute \
      --micro-batch-tokens 65536 "${common[@]}" --run-dir "$out/8b-tp2" 2>&1 | tail -4
    python3 benchmarks/summarize_runs.py "$out/8b-tp2" ;;
  head)
    python3 benchmarks/bench_vocab_parallel_head.py --hidden 2048 --out "$out/head_1.7b.json"
    python3 benchmarks/bench_vocab_parallel_head.py --hidden 4096 --tokens 16384 \
      --out "$out/head_8b.json" ;;
  *) echo "unknown part $part (item7|item3|head)" >&2; exit 2 ;;
esac
