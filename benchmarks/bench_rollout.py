"""Rollout throughput on one GPU (issue 12, items 1-2): the invariant engine, the native engine
and transformers `generate` in the same process, on the same random weights.

Item 1 (the small-model serving benchmark, as nano-vllm's bench.py and vLLM's throughput bench
run it): `--n-seqs` sequences with prompt and output lengths uniform in [--len-lo, --len-hi]
(fixed seed), random prompt ids, EOS ignored (every sample generates its full length).
Reported: output tokens / wall seconds of one `generate` call over all sequences, for
  invariant  RolloutEngine with rlkernel.model.ops.InvariantOps (the product),
  native     the same engine with NativeOps (stock torch ops: cuBLAS, SDPA),
  *-eager    either engine with decode_graphs="eager" (no CUDA graphs: the before/after of
             rollout/cuda_graphs.py; the plain arms replay a graph per decode batch bucket),
  hf         transformers Qwen3ForCausalLM.generate in bf16 (sdpa attention), all prompts in one
             left-padded batch, max_new_tokens = the longest output; its tok/s counts the same
             useful tokens as the engines (tokens past a sample's length are waste it pays for).
Item 2 (GRPO shape): --grpo-prompts prompts × --grpo-samples samples × --grpo-new new tokens
(prompt length --grpo-prompt-len), invariant engine, with and without prefix sharing: tok/s,
the KV pool's peak (blocks in use × bytes per block) and torch's peak allocated memory.
Every arm runs a small warm-up generate first (Triton compiles), then is timed once; with
--keep-state the engines keep their state across calls and `prepare` it for the timed call
before the clock starts (vLLM and nano-vllm capture their graphs at start-up too); without,
graphs are captured inside the timed call (graph_capture_s says how long that took).
--profile (why is the invariant engine slow?): instead of the above, for each --profile-seqs
count (alias --profile-batches; default 32) and each engine arm of --arms, one generate of that
many distinct prompts of --profile-prompt tokens and --profile-new new tokens (EOS ignored) runs
once as a warm-up (compiles) and once under torch.profiler (CPU + CUDA); reported per run: wall
time, engine steps, tok/s, device time / wall time (low = host-bound), kernel launches per step,
the top kernels by device time, the top host ops by self time, and the time in the engine's
phases (record_function labels rollout.metadata / hidden / logprobs / sample; see
benchmarks/profile_trace.py). The profiled wall time includes the profiler's own cost per op and
launch; the warm-up's (unprofiled, but with any compiling) bounds it from the other side.

Results are written to --out after every arm, so a run stopped by a time limit keeps what it
measured; --time-limit-s skips arms not yet started past that many seconds.
Run (repository root, on the GPU machine; --parts / --arms / --grpo-sharing split the work into
runs that each fit a time budget; the throughput is not known yet, so start with --quick):
    PYTHONPATH=. python3 benchmarks/bench_rollout.py --quick --out rollout_quick.json
    PYTHONPATH=. python3 benchmarks/bench_rollout.py --parts serve --time-limit-s 300 --out s.json
    PYTHONPATH=. python3 benchmarks/bench_rollout.py --parts grpo --grpo-sharing on --out g1.json
    PYTHONPATH=. python3 benchmarks/bench_rollout.py --parts grpo --grpo-sharing off --out g0.json
    PYTHONPATH=. python3 benchmarks/bench_rollout.py --profile --out rollout_profile.json
Does not: measure anything meaningful without CUDA (`--device cpu --preset tiny` is a logic smoke
run), or check tokens (tests/test_cuda_rollout.py does, bitwise).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from benchmarks import profile_trace
from benchmarks.common import dump, env, require_cuda
from rlkernel.model.checkpoint import init_weights
from rlkernel.model.config import PRESETS
from rlkernel.model.ops import InvariantOps, NativeOps
from rlkernel.rollout.engine import Request, RolloutEngine, SamplingParams

_OPS = {"invariant": InvariantOps, "native": NativeOps}
_ENGINE_ARMS = ("invariant", "native", "invariant-eager", "native-eager")
"""Engine arms: an op set, with decode steps on CUDA graphs (the default) or `-eager`."""


def _arm(arm: str) -> tuple[type, str]:
    """(op set, decode_graphs mode) of an engine arm."""
    ops, _, eager = arm.partition("-")
    return _OPS[ops], "eager" if eager else "auto"


def _serve_requests(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[Request]:
    """n requests, prompt and output lengths uniform in [lo, hi], random ids (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(lo, hi + 1, (1,), generator=g))
        m = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append(Request(i, tuple(torch.randint(0, vocab, (p,), generator=g).tolist()), m))
    return out


def _grpo_requests(prompts: int, samples: int, plen: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(prompts):
        ids = tuple(torch.randint(0, vocab, (plen,), generator=g).tolist())
        out += [Request(j * samples + k, ids) for k in range(samples)]
    return out


def _sp(max_new: int) -> SamplingParams:
    # eos_id -1 is never sampled: EOS ignored, every sample runs to its length.
    return SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new, seed=0, eos_id=-1)


def _engine(cfg, weights, arm: str, args, **kw) -> RolloutEngine:
    ops, graphs = _arm(arm)
    e = RolloutEngine(cfg, ops, torch.bfloat16, pad_id=0, device=torch.device(args.device),
                      max_seqs=args.max_seqs, max_step_tokens=args.max_step_tokens,
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      decode_graphs=graphs, keep_state=args.keep_state, **kw)
    e.load_weights(weights)
    e.generate(_serve_requests(4, 16, 32, cfg.vocab_size, 99), _sp(16))      # warm-up
    return e


def _timed(engine: RolloutEngine, reqs, max_new: int) -> dict:
    cuda = engine.model.device.type == "cuda"
    prepare_s = None
    if engine.keep_state:              # a serving engine's start-up: pool and graphs, untimed
        t0 = time.perf_counter()
        engine.prepare(reqs, _sp(max_new))
        _sync("cuda" if cuda else "cpu")
        prepare_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    comps = engine.generate(reqs, _sp(max_new))
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n_out = sum(len(c.response_ids) for c in comps)
    expect = sum(r.max_new_tokens or max_new for r in reqs)
    assert n_out == expect, f"{n_out} tokens generated, {expect} expected (EOS must be ignored)"
    st = engine.stats
    return {"seconds": dt, "output_tokens": n_out, "tok_per_s": n_out / dt,
            "steps": st["steps"], "preemptions": st["preemptions"],
            "graph_steps": st["graph_steps"], "graph_buckets": st["graph_buckets"],
            "graph_capture_s": st["graph_capture_s"], "kept_state": st["kept_state"],
            "prepare_s": prepare_s, "pool_blocks": st["pool_blocks"], "peak_blocks": st["peak_blocks"],
            "blocks_saved": st["blocks_saved"], "cow_copies": st["cow_copies"],
            "peak_kv_pool_bytes": st["peak_kv_bytes_per_rank"],
            "peak_allocated_over_weights_bytes": (torch.cuda.max_memory_allocated() - base
                                                  if cuda else None)}


def _hf_generate(cfg, weights, reqs, device: str) -> dict:
    import transformers
    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "torch_dtype")}
    hcfg = transformers.Qwen3Config(**d)
    hcfg._attn_implementation = "sdpa"
    m = transformers.Qwen3ForCausalLM(hcfg).to(torch.bfloat16)
    sd = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    m.load_state_dict(sd, strict=False)
    m = m.to(device).eval()
    longest = max(len(r.prompt_ids) for r in reqs)
    ids = torch.zeros(len(reqs), longest, dtype=torch.long)
    mask = torch.zeros(len(reqs), longest, dtype=torch.long)
    for i, r in enumerate(reqs):                       # left padding
        ids[i, longest - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, longest - len(r.prompt_ids):] = 1
    ids, mask = ids.to(device), mask.to(device)
    max_new = max(r.max_new_tokens for r in reqs)
    # min_new_tokens = max_new_tokens masks EOS until the end: EOS ignored, as for the engines.
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
    with torch.no_grad():
        m.generate(input_ids=ids[:4, -16:], attention_mask=mask[:4, -16:], max_new_tokens=8,
                   min_new_tokens=8, **kw)
        _sync(device)
        t0 = time.perf_counter()
        out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                         min_new_tokens=max_new, **kw)
        _sync(device)
    dt = time.perf_counter() - t0
    useful = sum(r.max_new_tokens for r in reqs)
    return {"seconds": dt, "output_tokens": useful, "tok_per_s": useful / dt,
            "generated_incl_waste": int(out.shape[0] * (out.shape[1] - longest)),
            "note": "one padded batch, max_new_tokens = longest output; tok/s counts useful tokens"}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _profile(cfg, weights, arm: str, n: int, args) -> dict:
    """One generate of n distinct prompts, warm-up then under torch.profiler (module doc)."""
    reqs = _grpo_requests(n, 1, args.profile_prompt, cfg.vocab_size, args.seed + 2)
    eng = _engine(cfg, weights, arm, args)
    t0 = time.perf_counter()
    eng.generate(reqs, _sp(args.profile_new))
    _sync(args.device)
    warm = time.perf_counter() - t0
    acts = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        comps = eng.generate(reqs, _sp(args.profile_new))
        _sync(args.device)
        wall = time.perf_counter() - t0
    n_tok = sum(len(c.response_ids) for c in comps)
    assert n_tok == n * args.profile_new, f"{n_tok} tokens, EOS must be ignored"
    steps = eng.stats["steps"]
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(os.path.join(d, "trace.json"))
        events = profile_trace.load(os.path.join(d, "trace.json"))
    summary = profile_trace.summarize(events, wall, "rollout.")
    return {"arm": arm, "seqs": n, "prompt": args.profile_prompt, "new": args.profile_new,
            "warmup_s": warm, "wall_s": wall, "steps": steps, "output_tokens": n_tok,
            "graph_steps": eng.stats["graph_steps"], "graph_buckets": eng.stats["graph_buckets"],
            "tok_per_s": n_tok / wall, "kernels_per_step": summary["kernels"] / steps, **summary}


def _print_profile(r: dict, top: int = 12) -> None:
    ratio = "-" if r["device_over_wall"] is None else f"{r['device_over_wall']:.3f}"
    print(f"== {r['arm']} {r['seqs']} seqs x (prompt {r['prompt']} + {r['new']} new): "
          f"wall {r['wall_s']:.2f} s (warm-up {r['warmup_s']:.2f} s), {r['steps']} steps "
          f"({r['graph_steps']} on CUDA graphs, buckets {r['graph_buckets']}) "
          f"({1e3 * r['wall_s'] / r['steps']:.1f} ms/step), {r['tok_per_s']:.0f} tok/s; device "
          f"{r['device_s']:.2f} s = {ratio} of wall; {r['kernels']} kernels "
          f"({r['kernels_per_step']:.0f}/step), {r['memcpys']} memcpys; host outside any op "
          f"{r['host_outside_ops_s']:.2f} s", flush=True)
    for name, p in sorted(r["phases"].items()):
        print(f"  phase {name:22s} calls {p['calls']:5d}  host {p['host_ms']:9.1f} ms  "
              f"kernels {p['kernels']:7d}  device {p['device_ms']:9.1f} ms")
    for k in r["top_kernels"][:top]:
        print(f"  kernel {k['total_ms']:9.1f} ms {k['count']:7d}x  {k['name'][:80]}")
    for o in r["top_cpu_ops"][:top]:
        print(f"  host   {o['self_ms']:9.1f} ms self {o['total_ms']:9.1f} ms total "
              f"{o['count']:7d}x  {o['name'][:60]}")


def _out_of_time(args, t_start: float, result: dict, what: str) -> bool:
    if args.time_limit_s is not None and time.perf_counter() - t_start > args.time_limit_s:
        result["skipped"].append(what)
        print("skipped (time limit):", what, flush=True)
        return True
    return False


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    ap.add_argument("--parts", nargs="+", default=["serve", "grpo"], choices=["serve", "grpo"])
    ap.add_argument("--arms", nargs="+", default=["invariant", "native", "hf"],
                    choices=[*_ENGINE_ARMS, "hf"],
                    help="engine arms decode on CUDA graphs; *-eager arms without (before/after)")
    ap.add_argument("--n-seqs", type=int, default=256)
    ap.add_argument("--len-lo", type=int, default=100)
    ap.add_argument("--len-hi", type=int, default=1024)
    ap.add_argument("--grpo-prompts", type=int, default=64)
    ap.add_argument("--grpo-samples", type=int, default=8)
    ap.add_argument("--grpo-new", type=int, default=512)
    ap.add_argument("--grpo-prompt-len", type=int, default=256)
    ap.add_argument("--grpo-sharing", nargs="+", default=["on", "off"], choices=["on", "off"],
                    help="prefix sharing arms of the GRPO shape (one per run keeps runs short)")
    ap.add_argument("--time-limit-s", type=float, default=None,
                    help="skip arms not yet started once this many seconds have passed")
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--max-step-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--quick", action="store_true",
                    help="32 sequences of 64-256 tokens; GRPO 8 x 8 x 128 (a smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1,
                    help="timed generate calls per engine arm (the last one is reported, all "
                         "their seconds under 'repeats'): the first can include Triton compiles "
                         "of shapes the warm-up did not reach")
    ap.add_argument("--keep-state", action="store_true",
                    help="engines keep KV pool, buffers and decode graphs across calls; "
                         "`prepare` (pool + every graph, reported as prepare_s) runs untimed "
                         "before each timed generate, as a serving engine's start-up")
    ap.add_argument("--profile", action="store_true",
                    help="profile one generate per --profile-seqs count instead (module doc)")
    ap.add_argument("--profile-seqs", "--profile-batches", nargs="+", type=int, default=[32])
    ap.add_argument("--profile-prompt", type=int, default=64)
    ap.add_argument("--profile-new", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="cpu: a logic smoke run (--preset tiny)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda":
        require_cuda()
    if args.quick:
        args.n_seqs, args.len_lo, args.len_hi = 32, 64, 256
        args.grpo_prompts, args.grpo_new, args.grpo_prompt_len = 8, 128, 128
    t_start = time.perf_counter()
    cfg = PRESETS[args.preset]()
    weights = init_weights(cfg, 0)
    result = {"env": env() if args.device == "cuda" else {"device": "cpu"}, "args": vars(args),
              "skipped": []}
    if args.profile:
        profiles = []
        for n in args.profile_seqs:
            for arm in [a for a in args.arms if a in _ENGINE_ARMS]:
                if _out_of_time(args, t_start, result, f"profile {arm} {n}"):
                    continue
                profiles.append(_profile(cfg, weights, arm, n, args))
                _print_profile(profiles[-1])
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                dump(args.out, {**result, "profile": profiles})
        return
    if "serve" in args.parts:
        reqs = _serve_requests(args.n_seqs, args.len_lo, args.len_hi, cfg.vocab_size, args.seed)
        serve = {}
        for arm in args.arms:
            if _out_of_time(args, t_start, result, f"serve {arm}"):
                continue
            if arm == "hf":
                serve[arm] = _hf_generate(cfg, weights, reqs, args.device)
            else:
                eng = _engine(cfg, weights, arm, args)
                runs = [_timed(eng, reqs, args.len_hi) for _ in range(args.repeat)]
                serve[arm] = {**runs[-1], "repeats": [r["seconds"] for r in runs]}
                del eng
            if args.device == "cuda":
                torch.cuda.empty_cache()
            print(arm, f"{serve[arm]['tok_per_s']:.0f} tok/s", flush=True)
            dump(args.out, {**result, "serve": serve})          # partial results survive a kill
        for arm in ("invariant-eager", "native-eager"):
            base = arm.split("-")[0]
            if arm in serve and base in serve:
                serve[f"{base}_graphs_over_eager"] = (serve[base]["tok_per_s"]
                                                      / serve[arm]["tok_per_s"])
        if "invariant" in serve and "native" in serve:
            serve["invariant_over_native"] = serve["invariant"]["tok_per_s"] / serve["native"]["tok_per_s"]
        result["serve"] = serve
    if "grpo" in args.parts:
        reqs = _grpo_requests(args.grpo_prompts, args.grpo_samples, args.grpo_prompt_len,
                              cfg.vocab_size, args.seed + 1)
        grpo = {}
        for arm in args.grpo_sharing:
            name = "shared" if arm == "on" else "unshared"
            if _out_of_time(args, t_start, result, f"grpo {name}"):
                continue
            eng = _engine(cfg, weights, "invariant", args, prefix_sharing=arm == "on")
            runs = [_timed(eng, reqs, args.grpo_new) for _ in range(args.repeat)]
            grpo[name] = {**runs[-1], "repeats": [r["seconds"] for r in runs]}
            del eng
            if args.device == "cuda":
                torch.cuda.empty_cache()
            print("grpo", name, f"{grpo[name]['tok_per_s']:.0f} tok/s", flush=True)
            dump(args.out, {**result, "grpo": grpo})
        result["grpo"] = grpo
    dump(args.out, result)
    print(result)


if __name__ == "__main__":
    main()
