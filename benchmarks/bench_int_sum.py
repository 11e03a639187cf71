"""The DP/CP weight-gradient exchange: an exact integer accumulator summed over ranks and rounded.

Two forms of the same result (rlkernel/distributed/comm.py), timed in one job on the same
accumulators (int64 [n, fixedpoint.N_COLS], 104 bytes an element):
- `all_reduce`: `round_fp32(sum_ints(acc))` — one integer all-reduce, then every rank rounds
  every element (the form used until the thirty-sixth session);
- `sliced`: `sum_ints_finished(acc, round_fp32)` — all-to-all of 1/size of the rows, summed
  and rounded by their rank, the fp32 slices all-gathered;
- `words`: `tokensum.words_finished(words)` — the same sums held as float64 double words
  [2, n] (16 bytes an element, as the CUDA dW kernel leaves them), sent by slices as words and
  made digits only by the rank that rounds each slice.
The three results are checked bytewise equal before timing. Reported per size: median ms of
rank 0 (each timed call starts behind a barrier), the ratios sliced / all_reduce and words /
all_reduce, and the bytes each form sends per rank (ring all-reduce 2·(size−1)/size of the
accumulator; sliced (size−1)/size of it plus (size−1)/size of the fp32 result; words
(size−1)/size of 16 + 4 bytes an element).
Sizes: elements per call — 2**21 is GradSink's finishing bucket, 2**23 a direct-mode chunk
(tokensum.py).
Run (repository root):
    CPU, gloo ranks:  PYTHONPATH=. python3 benchmarks/bench_int_sum.py [--world 2] [--out F]
    GPUs, NCCL (one rank a GPU):  ... --device cuda --world 2
    one GPU shared by the ranks (gloo through host memory): RLK_SHARE_GPUS=1 ... --device cuda
Does not: time the accumulation itself (benchmarks/bench_dp_accumulation.py).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import torch

SIZES = (1 << 16, 1 << 21, 1 << 23)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str, reps: int) -> float:
    """Median ms of fn() over reps calls, each after a barrier (one warm-up call first)."""
    import torch.distributed as dist
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _rank(rank: int, device: str, sizes: list[int], reps: int, out: str) -> None:
    import torch.distributed as dist

    from rlkernel.distributed.comm import Comm
    from rlkernel.distributed.tokensum import words_finished
    from rlkernel.numerics import fixedpoint as fx
    world = dist.get_world_size()
    comm = Comm("world", dist.group.WORLD, range(world), rank)
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else "cpu"
    rows = []
    for n in sizes:
        g = torch.Generator().manual_seed(rank)
        vals = torch.randn(n, generator=g) * 1e-3
        # double words (hi, lo) as the dW kernel leaves them; their digits for the int forms
        words = torch.stack([vals.double(), (vals * 2.0**-30).double()]).to(dev)
        acc = fx.add_double_words_(fx.zeros((n,), dev), words)
        a = fx.round_fp32(comm.sum_ints(acc, "check-all-reduce"))
        b = comm.sum_ints_finished(acc, "check-sliced", fx.round_fp32)
        c = words_finished(comm, words, "check-words")
        if not (torch.equal(a.view(torch.int32), b.view(torch.int32))
                and torch.equal(a.view(torch.int32), c.view(torch.int32))):
            raise SystemExit(f"bench_int_sum: the three forms differ at {n} elements")
        t_ar = _timed(lambda: fx.round_fp32(comm.sum_ints(acc, "all-reduce")), device, reps)
        t_sl = _timed(lambda: comm.sum_ints_finished(acc, "sliced", fx.round_fp32), device, reps)
        t_w = _timed(lambda: words_finished(comm, words, "words"), device, reps)
        acc_bytes = acc.numel() * 8
        rows.append({"elements": n, "all_reduce_ms": t_ar, "sliced_ms": t_sl, "words_ms": t_w,
                     "sliced_over_all_reduce": t_sl / t_ar, "words_over_all_reduce": t_w / t_ar,
                     "all_reduce_bytes_sent": 2 * (world - 1) * acc_bytes // world,
                     "sliced_bytes_sent": (world - 1) * (acc_bytes + 4 * n) // world,
                     "words_bytes_sent": (world - 1) * (16 + 4) * n // world})
        del acc, a, b, c, words
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps(rows))


def main() -> None:
    from rlkernel.distributed.launch import cuda_backend, launch
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)),
                    help="elements per call, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    backend = cuda_backend() if a.device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as d:
        res = pathlib.Path(d) / "rows.json"
        launch(_rank, (a.device, sizes, a.reps, str(res)), world_size=a.world, backend=backend,
               timeout_s=600)
        rows = json.loads(res.read_text())
    for r in rows:
        print(f"{r['elements']:>9} elements: all-reduce {r['all_reduce_ms']:9.2f} ms | sliced "
              f"{r['sliced_ms']:9.2f} ms ({r['sliced_over_all_reduce']:.2f}x) | words "
              f"{r['words_ms']:9.2f} ms ({r['words_over_all_reduce']:.2f}x) | MiB sent "
              f"{r['all_reduce_bytes_sent'] / 2**20:.0f} / {r['sliced_bytes_sent'] / 2**20:.0f} / "
              f"{r['words_bytes_sent'] / 2**20:.0f}", flush=True)
    record = {"world": a.world, "device": a.device, "backend": backend,
              "torch": torch.__version__, "rows": rows}
    if a.device == "cuda":
        record["gpu"] = torch.cuda.get_device_name(0)
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
