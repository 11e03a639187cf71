"""One TP rank's LM head + token logprobs/entropy, forward and backward: the vocab-parallel fused
path (statistics all-gathered, no logits kept) against the gathered path it replaced at TP > 1
(column-parallel logits slice, all-gather of [N, V] fp32 logits, log-softmax over the full
vocabulary on every rank). Peak extra GPU memory and time per rank, TP = 1, 2, 4, 8.

One GPU stands in for rank 0 of each TP group: its collectives return copies of its own tensors
(`_OwnCopies`), so the shapes, memory and kernels are rank 0's and no interconnect time is
counted (the fused path moves 3·shards + 1 floats per token, the gathered path N·V·4 bytes).
The bytes of the fused path against TP1 are the tests' job (tests/test_cuda.py,
tests/test_kernels_logprobs.py), not this script's.
Run: PYTHONPATH=. python3 benchmarks/bench_vocab_parallel_head.py [--tokens 16384 4096]
     [--hidden 2048] [--out FILE.json]   (`--device cpu` with a small --vocab/--hidden: a smoke
     run of the script's logic, times only)
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import dump, env, require_cuda
from rlkernel.distributed.comm import Comm


class _OwnCopies(Comm):
    """Rank 0 of a `size`-rank group whose peers hold tensors of its shapes: gathers return
    copies of this rank's tensor (the memory and shapes of the real collective)."""

    def __init__(self, size: int) -> None:
        super().__init__("bench-tp", None, tuple(range(size)), 0)

    def all_gather(self, t, op):
        return [t.contiguous().clone() for _ in range(self.size)]


def _fused(h, w, tg, tp, live):
    from rlkernel.kernels.logprobs import linear_token_logprobs_entropy
    return linear_token_logprobs_entropy(h, w, tg, 1.0, shards=8 // tp, live_vocab=live,
                                         compute_dtype=torch.bfloat16, vocab_comm=_OwnCopies(tp))


def _gathered(h, w, tg, tp, live):
    from rlkernel.distributed.parallel import collective_pair, rows_of_rank
    from rlkernel.kernels.logprobs import token_logprobs_entropy
    from rlkernel.kernels.matmul import column_parallel_linear
    comm = _OwnCopies(tp)
    (z,) = column_parallel_linear(h, [w], local_shards=8 // tp, compute_dtype=torch.bfloat16)
    logits = collective_pair(z, lambda t: comm.all_gather_cat(t, "vocab-gather", 1),
                             lambda g: rows_of_rank(g, comm, 1))
    return token_logprobs_entropy(logits, tg, 1.0, live_vocab=live)


def _measure(path, n: int, hidden: int, vocab: int, live: int, tp: int, dev: str) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(vocab // tp, hidden, device=dev, generator=g) * 0.02).bfloat16()
    w = w.float().requires_grad_(True)
    h = torch.randn(n, hidden, device=dev, generator=g).requires_grad_(True)
    tg = torch.randint(0, live, (n,), device=dev, generator=g)
    cuda = dev == "cuda"

    def step():
        lp, ent = path(h, w, tg, tp, live)
        (lp.sum() + 0.01 * ent.sum()).backward()
        h.grad = w.grad = None
        if cuda:
            torch.cuda.synchronize()

    step()                                   # compiles
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    rec = {"ms": 1e3 * min(times)}
    if cuda:
        rec["extra_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 4096])
    ap.add_argument("--hidden", type=int, default=2048, help="2048: qwen3-1.7b; 4096: qwen3-8b")
    ap.add_argument("--vocab", type=int, default=151936, help="rows of the LM head (Qwen3's)")
    ap.add_argument("--live", type=int, default=151669, help="tokenizer ids (Qwen3's)")
    ap.add_argument("--device", default="cuda", help="cpu only to smoke-test the script")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.vocab < 64 or args.vocab % 64:
        ap.error(f"--vocab {args.vocab}: must be a positive multiple of 64 (8 virtual shards "
                 f"split over up to TP 8)")
    if not 1 <= args.live <= args.vocab:
        ap.error(f"--live {args.live}: must be in [1, --vocab {args.vocab}]")
    if min(args.tokens) < 1 or args.hidden < 1:
        ap.error("--tokens and --hidden must be >= 1")
    if args.device == "cuda":
        require_cuda()
    rows = []
    for n in args.tokens:
        for tp in (1, 2, 4, 8):
            rec = {"tokens": n, "tp": tp}
            for name, path in (("fused", _fused), ("gathered", _gathered)):
                try:
                    rec[name] = _measure(path, n, args.hidden, args.vocab, args.live, tp,
                                         args.device)
                except torch.OutOfMemoryError:
                    rec[name] = "OOM"
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            rows.append(rec)
            print(rec, flush=True)
    dump(args.out, {"env": env() if args.device == "cuda" else {"device": "cpu"},
                    "hidden": args.hidden, "vocab": args.vocab, "live": args.live, "rows": rows})


if __name__ == "__main__":
    main()
