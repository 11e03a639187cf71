#!/usr/bin/env bash
# Run the CUDA tests and the kernel benchmarks on a GPU machine, logs and JSON into DIR.
# Usage (repository root): bash benchmarks/run_all.sh DIR [--sweep]
set -uo pipefail
out=${1:?usage: run_all.sh DIR [--sweep]}
sweep=${2:-}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda)" | tee -a "$out/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 200 python3 -m pytest -q -rf --tb=short tests/test_cuda.py 2>&1 | tail -60 | tee "$out/test_cuda.log"
fi
timeout 90 python3 benchmarks/bench_attention.py --out "$out/attention.json" 2>&1 | tee -a "$out/bench.log"
timeout 60 python3 benchmarks/bench_exact_norm.py --out "$out/exact_norm.json" 2>&1 | tee -a "$out/bench.log"
timeout 90 python3 benchmarks/bench_fixedpoint.py --out "$out/fixedpoint.json" 2>&1 | tee -a "$out/bench.log"
timeout 90 python3 benchmarks/bench_elementwise.py --out "$out/elementwise.json" 2>&1 | tee -a "$out/bench.log"
timeout 90 python3 benchmarks/bench_logprob_memory.py --out "$out/logprob_memory.json" 2>&1 | tee -a "$out/bench.log"
timeout 240 python3 benchmarks/bench_adamw.py $sweep --out "$out/adamw.json" 2>&1 | tee -a "$out/bench.log"
timeout 240 python3 benchmarks/bench_matmul.py $sweep --out "$out/matmul.json" 2>&1 | tee -a "$out/bench.log"
