"""The cost of DP- and microbatch-invariant gradients (issue 14), on the CPU.

Three measurements, each printed and (with --out) written as JSON:
1. One weight gradient dW = dYᵀ·X over a stream (kernel level, one process): stock BLAS
   (`dy.t() @ x`, what native mode's autograd runs), our leaf partials alone (16 tokens per leaf,
   sequential fp32), and partials + the exact fixed-point accumulation + the one rounding — the
   whole canonical token reduction. Median of repeats.
2. A training step's gradients of the tiny model at DP1 and DP2 (gloo processes), whole-step
   and 72-token microbatches (one sample each): compute_gradients in --mode invariant (every
   gradient into the GradSink, integer all-reduce over DP at the end) vs --mode native (fp32
   autograd accumulation, SUM all-reduce over DP); the time inside the exact accumulator
   (fixedpoint.accumulate_ + round_fp32) within the invariant step; and the end-of-mini-batch
   reduction alone (sink finish vs native sync_grads), medians of rank 0.
3. Memory of the canonical order: the sink's accumulators are fixedpoint.N_COLS int64 per
   parameter element (vs 4 bytes of an fp32 .grad), held for a mini-batch; accumulate_'s
   transient float64 bins per chunk; and what that is per rank for the qwen3 presets (0.6b, 1.7b,
   8b) at TP1 and TP8.

Run (repository root, CPU): PYTHONPATH=. .venv/bin/python benchmarks/bench_dp_accumulation.py
[--out FILE.json] [--repeats N]. On a shared 2-core machine expect ±20% between runs.
Does not: touch the GPU (the CUDA kernels' cost is benchmarks/run_all.sh's job; the CUDA exact
accumulator alone: benchmarks/bench_fixedpoint.py).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import tempfile
import time

import torch

from rlkernel.numerics import fixedpoint as fx

REPEATS = 5


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_kernel(repeats: int) -> list[dict]:
    from rlkernel.kernels.matmul import accumulate_grad_weight_, token_leaf_partials
    from rlkernel.spec import TOKEN_LEAF

    rows = []
    for n, k, length in ((128, 64, 2048), (512, 512, 1024)):
        g = torch.Generator().manual_seed(0)
        dy = torch.randn(length, n, generator=g) * 1e-3
        x = torch.randn(length, k, generator=g)
        t_blas = _median_s(lambda: dy.t() @ x, repeats)
        t_part = _median_s(lambda: token_leaf_partials(dy, x, length // TOKEN_LEAF), repeats)

        def exact():
            return fx.round_fp32(accumulate_grad_weight_(fx.zeros((n, k)), dy, x))
        t_exact = _median_s(exact, repeats)
        row = {"N": n, "K": k, "tokens": length, "blas_ms": 1e3 * t_blas,
               "leaf_partials_ms": 1e3 * t_part, "partials_exact_ms": 1e3 * t_exact,
               "exact_over_partials": t_exact / t_part, "exact_over_blas": t_exact / t_blas}
        rows.append(row)
        print(f"dW [{n}x{k}] over {length} tokens: BLAS {row['blas_ms']:.2f} ms | leaf partials "
              f"{row['leaf_partials_ms']:.2f} ms | partials + exact sum {row['partials_exact_ms']:.2f}"
              f" ms (x{row['exact_over_partials']:.2f} of the partials, x{row['exact_over_blas']:.0f}"
              " of BLAS)", flush=True)
    return rows


def _batch():
    from rlkernel.train.step import TrainSample

    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(16):
        p, r = 12 + i % 5, 20 + (7 * i) % 30
        out.append(TrainSample(i, tuple(torch.randint(32, 127, (p,), generator=g).tolist()),
                               tuple(torch.randint(0, 264, (r,), generator=g).tolist()),
                               -4.0 - torch.rand(r, generator=g), float(torch.randn(1, generator=g))))
    return out


def _step_rank(rank: int, mode: str, dp: int, micro: int, repeats: int, out: str) -> None:
    """One rank: `repeats` timed compute_gradients on the same batch; the reduction timed apart."""
    import torch.distributed as dist

    from rlkernel.config import RunConfig
    from rlkernel.distributed.context import build_contexts
    from rlkernel.distributed.topology import Topology, build_comms
    from rlkernel.model.checkpoint import init_weights
    from rlkernel.model.config import tiny
    from rlkernel.model.ops import ops_for
    from rlkernel.model.qwen3 import Qwen3ForCausalLM
    from rlkernel.train.losses import LossCoefs, invariant_exp
    from rlkernel.train.step import compute_gradients

    cfg = RunConfig(dp=dp, mode=mode)
    topo = Topology.from_config(cfg, rank, dist.get_world_size())
    mcfg = tiny()
    pc, _ = build_contexts(topo, build_comms(topo), mcfg)
    ops = ops_for(mode)
    policy = Qwen3ForCausalLM(mcfg, ops, torch.bfloat16, pc)
    policy.load_tensors(init_weights(mcfg, 0))
    ref = Qwen3ForCausalLM(mcfg, ops, torch.bfloat16, pc)
    ref.load_tensors(init_weights(mcfg, 1))
    ref.requires_grad_(False)
    sync_s: list[float] = []
    real_sync = ops.sync_grads

    def timed_sync(model):
        t0 = time.perf_counter()
        real_sync(model)
        sync_s.append(time.perf_counter() - t0)
    ops.sync_grads = staticmethod(timed_sync)
    # Time spent inside the exact accumulator (fixedpoint.accumulate_ and round_fp32; callers
    # reach them through the module, so wrapping the module attributes sees every call).
    exact = [0.0]
    real_acc, real_round = fx.accumulate_, fx.round_fp32

    def timed(fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                exact[0] += time.perf_counter() - t0
        return wrapper
    fx.accumulate_, fx.round_fp32 = timed(real_acc), timed(real_round)
    samples = _batch()
    step_s, exact_s = [], []
    try:
        for _ in range(repeats + 1):
            exact[0] = 0.0
            t0 = time.perf_counter()
            compute_gradients(policy, ref, samples, temperature=0.7,
                              coefs=LossCoefs(0.2, 0.05, 0.01, "k3"), micro_batch_tokens=micro,
                              pad_id=257, exp=invariant_exp if mode == "invariant" else torch.exp)
            step_s.append(time.perf_counter() - t0)
            exact_s.append(exact[0])
    finally:
        ops.sync_grads = staticmethod(real_sync)
        fx.accumulate_, fx.round_fp32 = real_acc, real_round
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump({"step_s": statistics.median(step_s[1:]),
                         "sync_s": statistics.median(sync_s[1:]),
                         "exact_s": statistics.median(exact_s[1:])}, f)


def bench_steps(repeats: int) -> list[dict]:
    from rlkernel.distributed.launch import launch

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for dp, micro in ((1, 4096), (2, 4096), (1, 72)):
            got = {}
            for mode in ("invariant", "native"):
                path = os.path.join(d, f"{mode}-{dp}-{micro}.pkl")
                launch(_step_rank, (mode, dp, micro, repeats, path), world_size=dp,
                       timeout_s=900)
                with open(path, "rb") as f:
                    got[mode] = pickle.load(f)
            inv, nat = got["invariant"], got["native"]
            row = {"dp": dp, "micro_batch_tokens": micro, "invariant_step_s": inv["step_s"],
                   "native_step_s": nat["step_s"], "invariant_exact_s": inv["exact_s"],
                   "invariant_reduce_s": inv["sync_s"], "native_reduce_s": nat["sync_s"]}
            row["step_ratio"] = row["invariant_step_s"] / row["native_step_s"]
            row["exact_share"] = row["invariant_exact_s"] / row["invariant_step_s"]
            rows.append(row)
            print(f"tiny model, 16 samples, DP{dp}, --micro-batch-tokens {micro}: "
                  f"compute_gradients invariant {row['invariant_step_s']:.2f} s (of which exact "
                  f"accumulation + rounding {row['invariant_exact_s']:.2f} s = "
                  f"{100 * row['exact_share']:.0f}%) vs native {row['native_step_s']:.2f} s "
                  f"(x{row['step_ratio']:.1f}); end-of-mini-batch gradient reduction: sink finish "
                  f"(int64 all-reduce + rounding) {1e3 * row['invariant_reduce_s']:.1f} ms vs "
                  f"native SUM all-reduce {1e3 * row['native_reduce_s']:.1f} ms", flush=True)
    return rows


def bench_memory() -> dict:
    """Accumulator bytes per rank for the presets: N_COLS int64 per element of the parameters a
    rank holds (its TP shard: params / TP), for the whole mini-batch, next to 4-byte fp32 grads,
    ZeRO-1's optimizer state (12 bytes / DP) and bf16 weights (2 bytes)."""
    from rlkernel.model.config import param_shapes, qwen3_0_6b, qwen3_1_7b, qwen3_8b, tiny

    per_elem = fx.N_COLS * 8
    out = {"accumulator_bytes_per_element": per_elem, "fp32_grad_bytes_per_element": 4,
           "bins_bytes_per_chunk_element": 8 * 16, "chunk_elements": "<= 2**22 values"}
    gib = 2 ** 30
    for name, cfg in (("tiny", tiny()), ("qwen3-0.6b", qwen3_0_6b()),
                      ("qwen3-1.7b", qwen3_1_7b()), ("qwen3-8b", qwen3_8b())):
        n = sum(torch.Size(s).numel() for s in param_shapes(cfg).values())
        row = {"params": n}
        for tp in (1, 8):
            row[f"tp{tp}_accumulators_GiB"] = n / tp * per_elem / gib
            row[f"tp{tp}_fp32_grads_GiB"] = n / tp * 4 / gib
        row["dp8_tp1_zero1_optimizer_GiB"] = n * 12 / 8 / gib
        out[name] = row
        print(f"{name}: {n:,} parameters -> exact accumulators per rank {row['tp1_accumulators_GiB']:.1f}"
              f" GiB at TP1, {row['tp8_accumulators_GiB']:.1f} GiB at TP8 (fp32 grads: "
              f"{row['tp1_fp32_grads_GiB']:.1f} / {row['tp8_fp32_grads_GiB']:.2f} GiB; ZeRO-1 "
              f"optimizer state at DP8 TP1: {row['dp8_tp1_zero1_optimizer_GiB']:.1f} GiB)",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = {"env": {"torch": torch.__version__, "python": platform.python_version(),
                      "cpus": os.cpu_count(), "threads": torch.get_num_threads()},
              "kernel": bench_kernel(args.repeats), "steps": bench_steps(args.repeats),
              "memory": bench_memory()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
