set -x
export PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 150 python3 benchmarks/bench_grad_weight.py --leaf-sweep --leaves 128,256 --out $OUT/leaf.json > $OUT/leaf.log 2>&1
timeout 240 python3 benchmarks/bench_train_step.py --model qwen3-1.7b --samples 16 --prompt-len 64 --response-len 960 --steps 3 --no-kl --native-micro-samples 4 --arms invariant,native --kernel-sites --out $OUT/step.json > $OUT/step.log 2>&1
timeout 170 python3 -m pytest -v -rf --timeout 160 tests/test_cuda_grad_weight.py -k direct tests/test_cuda_backward.py > $OUT/tests.log 2>&1
tail -5 $OUT/leaf.log $OUT/tests.log; grep -E "warm step|ratio" $OUT/step.log
