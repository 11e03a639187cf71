"""One rank of a TP/CP layout on one GPU, the other ranks stood in for: its peak memory and step
time, for layouts whose GPUs are not at hand (issue 11, items 3 and 7: qwen3-8b at TP2,
qwen3-1.7b at TP2 and CP2, on two H200s).

Rank 0 of a TP × CP layout builds its model shard and runs the training step (forward,
backward, exact finish, clipped norm, AdamW on fp32 masters, weights back to bf16) of the
invariant arm exactly as in `rlk run`, but every collective goes through `StandInComm`: the
other ranks are taken to hold zeros (an all-gather returns this rank's tensor and zeros of its
shape for the others; an all-to-all returns this rank's own chunk and zeros; an integer sum
returns this rank's integers; an object gather returns this rank's object for every rank; a
sum finished by slices finishes every rank's slice here, from this rank's values and zeros).
So the rank allocates and computes what it would in the layout — its parameter shard, its CP
stream, the gathered K/V, the received slices of every finishing collective — with finite
values throughout, and every gradient is this rank's own share of it (a sum with zeros adds
nothing): the norms printed are not the layout's, and are 0 where this rank's tokens carry no
gradient (a short sample's CP share holding only prompt tokens). What it is not: the contract
(nothing is compared), nor the interconnect's time (no byte leaves the GPU; add NCCL's time for
the layout's collectives), nor exactly a rank's compute (it finishes every rank's slices).
Prints one line; `--out FILE` writes the results as JSON.

Run (repository root, CUDA machine):
    PYTHONPATH=. python3 benchmarks/bench_stand_in_rank.py --model qwen3-8b --tp 2 \
        --samples 8 --prompt-len 64 --response-len 512
`--device cpu` (with `--model tiny`) only checks that the script runs: no memory figure
(null in the JSON) and CPU step times that say nothing about a GPU.
Does not: run rollout, the weight sync, DP (a DP replica's rank holds what a DP1 rank holds,
less ZeRO-1's optimizer shards), or SP.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import torch

from benchmarks.bench_train_step import _samples, _sync
from benchmarks.common import dump, env, require_cuda
from rlkernel.config import ConfigError
from rlkernel.distributed.comm import Comm
from rlkernel.distributed.parallel import ParallelCtx
from rlkernel.distributed.tokensum import GradSink, TokenSum
from rlkernel.distributed.topology import validate_topology
from rlkernel.model.config import PRESETS, param_shapes, preset
from rlkernel.model.ops import ops_for
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.model.sharding import kv_replicas
from rlkernel.train.losses import LossCoefs, invariant_exp
from rlkernel.train.optimizer import AdamW, AdamWParams
from rlkernel.train.step import compute_gradients, gradients

PAD = 0


class StandInComm(Comm):
    """Rank `rank` of a group of `size` whose other ranks hold zeros (tensors) and this rank's
    objects. Only the primitives are replaced; every collective built on them (tree
    all-reduce, sliced sums, owner picks, finishing words) runs its own code on their results."""

    def __init__(self, name: str, size: int, rank: int = 0) -> None:
        super().__init__(name, None, tuple(range(size)), rank)

    def _validate(self, op: str, t: torch.Tensor | None) -> None:
        self._calls += 1             # no other rank to compare call signatures with

    def _staged(self, t: torch.Tensor) -> bool:
        return False

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t if r == self.rank else torch.zeros_like(t) for r in range(self.size)]

    def all_gather_object(self, obj: Any, op: str) -> list[Any]:
        self._validate(op, None)
        return [obj] * self.size

    def _all_to_all(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        own = chunks[self.rank].contiguous()
        return [own if r == self.rank
                else torch.zeros_like(c, memory_format=torch.contiguous_format)
                for r, c in enumerate(chunks)]

    def _finish_slices(self, t: torch.Tensor, dim: int, op: str, finish) -> torch.Tensor:
        """Every rank's slice finished here, as its rank would finish it given the zeros: else
        the slices other ranks finish would come back as zeros, and a weight whose sums they
        own (a CP rank's dK/dV rows) would get none of this rank's gradient. The finishing work
        is `size` ranks'."""
        self._validate(f"{op}:slices", t)
        n = t.shape[dim]
        t = self._padded(t, dim)
        per = t.shape[dim] // self.size
        finished = []
        for r, own in enumerate(t.split(per, dim)):
            parts = [own if q == self.rank else torch.zeros_like(own) for q in range(self.size)]
            finished.append(finish(parts, r * per, (r + 1) * per))
        return torch.cat(finished)[:n]     # as all_gather_cat joins the finished slices

    def sum_ints(self, t: torch.Tensor, op: str, *, inplace: bool = False) -> torch.Tensor:
        if t.dtype != torch.int64:
            raise TypeError(f"sum_ints({op!r}) expects int64, got {t.dtype}")
        self._validate(op, t)
        return t if inplace else t.contiguous().clone()


def _comm(name: str, size: int) -> Comm:
    return StandInComm(name, size) if size > 1 else Comm.single(name)


def stand_in_ctx(cfg, tp: int, cp: int) -> ParallelCtx:
    """Rank 0's training context of a TP × CP layout (DP1, no SP), as
    distributed/context.build_contexts builds it, every group a StandInComm."""
    tp_c, cp_c = _comm("tp", tp), _comm("cp", cp)
    sink = GradSink({"dp_cp": cp_c, "world": _comm("world", tp * cp)})
    tok = TokenSum(cp_c, "dp_cp", sink)
    return ParallelCtx(tp_c, _comm("kv", kv_replicas(cfg, tp)), cp_c, False, tok, tok)


@torch.no_grad()
def load_random(policy: Qwen3ForCausalLM, dev: torch.device, seed: int = 0) -> None:
    """Random weights made one logical tensor at a time on `dev` (norm weights 1, the rest
    N(0, 0.02²)), each cut to this rank's shard (`local_param`): an 8B model's logical fp32
    weights (33 GB) never exist at once, on the host or the device."""
    g = torch.Generator(device=dev).manual_seed(seed)
    for name, p in policy.logical_params().items():
        shape = param_shapes(policy.cfg)[name]
        t = (torch.ones(shape, device=dev) if len(shape) == 1
             else torch.randn(shape, device=dev, generator=g) * 0.02)
        p.copy_(policy.local_param(name, t))
        del t


def stood_in_policy(cfg, pc: ParallelCtx, dev: torch.device) -> Qwen3ForCausalLM:
    """The invariant bf16 model of `pc`'s rank on `dev`, its 2-D weights held in bf16 (as
    `rlk run` trains and keeps its reference policy), random weights (`load_random`)."""
    policy = Qwen3ForCausalLM(cfg, ops_for("invariant"), torch.bfloat16, pc).to(dev)
    policy.hold_matmul_weights()
    load_random(policy, dev)
    return policy


def run(model: str, tp: int, cp: int, samples: int, prompt_len: int, response_len: int,
        steps: int, micro_samples: int, recompute: bool, kl: bool,
        dev: torch.device) -> dict:
    """Build rank 0 of the layout and time `steps` training steps; returns the step times, the
    peak memory of the device (GiB) and the rank's parameter elements."""
    cfg = preset(model)
    pc = stand_in_ctx(cfg, tp, cp)
    batch = _samples(samples, prompt_len, response_len, cfg.vocab_size, 1)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    policy = stood_in_policy(cfg, pc, dev)
    policy.recompute = recompute
    ref = stood_in_policy(cfg, pc, dev).requires_grad_(False) if kl else None
    opt = AdamW({n: p.detach() for n, p in policy.logical_params().items()},
                AdamWParams(lr=1e-6))
    per = [len(s.prompt_ids) + len(s.response_ids) + 128 for s in batch]
    budget = sum(per) if not micro_samples else sum(per[:micro_samples])
    times, norms = [], []
    for _ in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        compute_gradients(policy, ref, batch, temperature=1.0,
                          coefs=LossCoefs(0.2, 0.01 if kl else 0.0, 0.0, "k3"),
                          micro_batch_tokens=budget, pad_id=PAD, exp=invariant_exp)
        grads = gradients(policy)
        norms.append(opt.clip(grads, 1.0).norm)
        opt.step(grads)
        policy.load_master_shards(opt.weights(torch.bfloat16))
        _sync(dev)
        times.append(time.perf_counter() - t0)
    cuda = dev.type == "cuda"
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    # What stays between steps: weights, fp32 gradients, masters and moments (+ caches).
    resident = torch.cuda.memory_allocated() / 2**30 if cuda else None
    n_local = sum(p.numel() for p in policy.logical_params().values())
    return {"model": model, "tp": tp, "cp": cp, "samples": samples,
            "tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in batch),
            "micro_samples": micro_samples, "recompute": recompute, "kl": kl,
            "step_s": times, "warm_step_s": min(times[1:]) if len(times) > 1 else times[0],
            "grad_norms": norms, "peak_gib": peak, "resident_gib": resident,
            "rank_param_elems": n_local,
            "peak_bytes_per_rank_param": None if peak is None else peak * 2**30 / n_local}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--model", default="qwen3-8b", help="a preset (tiny, qwen3-0.6b, ...)")
    ap.add_argument("--tp", type=int, default=2, help="the layout's TP degree")
    ap.add_argument("--cp", type=int, default=1, help="the layout's CP degree")
    ap.add_argument("--samples", type=int, default=8, help="samples in the mini-batch")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens a sample")
    ap.add_argument("--response-len", type=int, default=512, help="response tokens a sample")
    ap.add_argument("--steps", type=int, default=2, help="steps timed (the first compiles)")
    ap.add_argument("--micro-samples", type=int, default=0,
                    help="samples per microbatch (0: all in one, direct mode)")
    ap.add_argument("--recompute", action="store_true",
                    help="recompute each layer's activations in the backward (--recompute)")
    ap.add_argument("--kl", action="store_true", help="keep and run a reference policy too")
    ap.add_argument("--device", default="cuda", help="cpu only to smoke-test the script")
    ap.add_argument("--out", help="write the results to this JSON file")
    a = ap.parse_args()
    for flag, v in (("--samples", a.samples), ("--prompt-len", a.prompt_len),
                    ("--response-len", a.response_len), ("--steps", a.steps)):
        if v < 1:
            ap.error(f"{flag} {v}: must be an integer >= 1")
    if not 0 <= a.micro_samples <= a.samples:
        ap.error(f"--micro-samples {a.micro_samples}: must be in [0, --samples {a.samples}]")
    if a.model not in PRESETS:
        ap.error(f"--model {a.model!r}: not a preset; allowed: {', '.join(PRESETS)}")
    cfg = preset(a.model)
    try:        # the layouts `rlk run` accepts for this model (CP1 rollout: not stood in)
        validate_topology(a.tp, a.cp, False, 1, 1, world=None,
                          num_attention_heads=cfg.num_attention_heads,
                          num_key_value_heads=cfg.num_key_value_heads,
                          vocab_size=cfg.vocab_size, intermediate_size=cfg.intermediate_size)
    except ConfigError as e:
        ap.error(str(e))
    dev = torch.device(a.device)
    if dev.type == "cuda":
        require_cuda()
    r = run(a.model, a.tp, a.cp, a.samples, a.prompt_len, a.response_len, a.steps,
            a.micro_samples, a.recompute, a.kl, dev)
    r["env"] = env() if dev.type == "cuda" else {"device": "cpu"}
    dump(a.out, r)
    memory = ("no memory figure on the CPU" if r["peak_gib"] is None else
              f"peak {r['peak_gib']:.2f} GiB ({r['peak_bytes_per_rank_param']:.1f} B per rank "
              f"parameter element), {r['resident_gib']:.2f} GiB held between steps")
    print(f"{a.model} TP{a.tp} CP{a.cp} rank 0 stood in: warm step {r['warm_step_s']:.3f} s "
          f"(steps {[round(t, 3) for t in r['step_s']]}), {memory}, "
          f"{r['rank_param_elems']:,} elements on the rank, grad norms {r['grad_norms']}",
          flush=True)


if __name__ == "__main__":
    main()
