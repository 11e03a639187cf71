"""Training step (forward + backward + exact norm + AdamW) time, invariant vs native, one process.

The step is what `rlk run` does per update (train/step.compute_gradients, AdamW on fp32 masters,
weights rounded back to the parameter dtype), on random weights and random token ids: S samples
of P prompt + R response tokens, one microbatch (the whole batch, direct mode), TP1, one GPU.
Both arms run in this process on the same weights and samples; the ratio invariant / native is
the cost of invariance. `--profile` adds the top CUDA kernels of one invariant step (torch
profiler), grouped by kernel name, to find what dominates; `--kernel-sites` the device time of
one step by the rlkernel code that launched it (each kernel tied to its launch call); `--trace`
the host ops and where the device idled; `--sync-sites` the host syncs by call site;
`--host-profile` the host's Python time of one step by function and by package (cProfile);
`--host-sample` the same by stack samples (no per-call cost: where a host-bound step's time goes);
`--launch-stats` Triton's launches and the launcher's host time by kernel.
Run (repository root, CUDA machine):
    PYTHONPATH=. python3 benchmarks/bench_train_step.py --model qwen3-0.6b --samples 16 \
        --prompt-len 64 --response-len 448 --out train_step.json [--profile]
Does not: run rollout or the weight sync (bench_rollout.py, bench_weight_sync.py).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import dump, env, require_cuda
from rlkernel.model.checkpoint import init_weights
from rlkernel.model.config import preset
from rlkernel.model.ops import ops_for
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.train.losses import LossCoefs, invariant_exp
from rlkernel.train.optimizer import AdamW, AdamWParams
from rlkernel.train.step import TrainSample, compute_gradients, gradients

PAD = 0


def _samples(n: int, p: int, r: int, vocab: int, seed: int,
             ragged: bool = False) -> list[TrainSample]:
    """n samples of p prompt and r response tokens; ragged: responses ending at an EOS, of
    lengths drawn uniformly from [r/2, r] (seeded), as rollouts end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, min(vocab, 32000), (n, p + r), generator=g)
    lens = (torch.randint(max(1, r // 2), r + 1, (n,), generator=g).tolist() if ragged
            else [r] * n)
    return [TrainSample(i, tuple(ids[i, :p].tolist()), tuple(ids[i, p:p + m].tolist()),
                        torch.full((m,), -2.0), 1.0 if i % 2 else -1.0)
            for i, m in enumerate(lens)]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _host_share(r: dict) -> str:
    """When the host returned from the warm step, and its share of the step. Not a host-bound
    test: the step reads the clipped gradient norm on the host before the optimizer, a sync, so
    the host returns near the step's end (~98 % on an H100 in both arms, twenty-eighth session)
    whichever side set the pace; `--trace`'s idle attribution and `--host-profile` tell that."""
    h, t = r["warm_host_issue_s"], r["warm_step_s"]
    return f"host returned after {h:.3f} s ({100 * h / t:.0f} % of it)"


def _arm(mode: str, cfg, weights, samples, steps: int, recompute: bool, profile: bool,
         dev: torch.device, micro_samples: int = 0, kl: bool = True, trace: bool = False,
         sync_sites: bool = False, kernel_sites: int = 0, host_profile: bool = False,
         host_sample: bool = False, launch_stats: bool = False):
    ops = ops_for(mode)
    policy = Qwen3ForCausalLM(cfg, ops, torch.bfloat16).to(dev)
    if mode == "invariant":   # as rlk run trains: weights held in bf16, fp32 main_grad beside
        policy.hold_matmul_weights()
    policy.load_tensors({k: v.to(dev) for k, v in weights.items()})
    policy.recompute = recompute
    ref = None
    if kl:
        ref = Qwen3ForCausalLM(cfg, ops, torch.bfloat16).to(dev).requires_grad_(False)
        ref.load_tensors({k: v.to(dev) for k, v in weights.items()})
        ref.hold_matmul_weights()
    opt = AdamW({n: p.detach() for n, p in policy.logical_params().items()}, AdamWParams(lr=1e-6))
    exp = invariant_exp if mode == "invariant" else torch.exp
    per = [len(s.prompt_ids) + len(s.response_ids) + 64 for s in samples]
    budget = sum(per) if not micro_samples else sum(per[:micro_samples])

    def step():
        compute_gradients(policy, ref, samples, temperature=1.0,
                          coefs=LossCoefs(0.2, 0.01 if kl else 0.0, 0.0, "k3"),
                          micro_batch_tokens=budget,
                          pad_id=PAD, exp=exp)
        grads = gradients(policy)
        norms.append(opt.clip(grads, 1.0).norm)
        opt.step(grads)
        policy.load_master_shards(opt.weights(torch.bfloat16))

    times, norms = [], []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    host = []
    for _ in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)   # the host back (after any sync inside)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    warm = min(range(1, len(times)), key=times.__getitem__) if len(times) > 1 else 0
    out = {"step_s": times, "warm_step_s": times[warm], "peak_gib": peak,
           "host_issue_s": host, "warm_host_issue_s": host[warm], "first_grad_norm": norms[0]}
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof
        with prof(activities=[ProfilerActivity.CUDA]) as pr:
            step()
            _sync(dev)
        rows = sorted(pr.key_averages(), key=lambda e: -e.device_time_total)[:40]
        out["top_kernels"] = [{"name": e.key[:120], "calls": e.count,
                               "ms": e.device_time_total / 1e3} for e in rows]
        out["profiled_total_ms"] = sum(e.device_time_total for e in pr.key_averages()) / 1e3
    if trace:
        out["trace"] = _traced_step(step, dev)
    if sync_sites:
        out["sync_sites"] = _sync_sites(step, dev)
    if kernel_sites:
        out["kernel_sites"] = _kernel_sites(step, dev, kernel_sites)
    if host_profile:
        out["host_profile"] = _host_profile(step, dev)
    if host_sample:
        out["host_samples"] = _host_samples(step, dev)
    if launch_stats:
        out["launch_stats"] = _launch_stats(step, dev)
    del policy, ref, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _hf_model(cfg, weights, dev: torch.device):
    """transformers' Qwen3ForCausalLM in bf16 with SDPA attention on our weights (tied LM head
    as the config says): what a user trains with in a stock stack."""
    import transformers
    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "torch_dtype")}
    hcfg = transformers.Qwen3Config(**d)
    hcfg._attn_implementation = "sdpa" if dev.type == "cuda" else "eager"
    with torch.device(dev):
        m = transformers.Qwen3ForCausalLM(hcfg).to(torch.bfloat16)
    sd = {k: v.to(dev, torch.bfloat16) for k, v in weights.items()}
    missing, unexpected = m.load_state_dict(sd, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"transformers arm: weights do not match ({missing}, {unexpected})")
    return m.train()


def _hf_response_logprobs(m, ids: torch.Tensor, p_len: int) -> torch.Tensor:
    """transformers' logprobs of the response tokens: ids [b, P+R] -> [b, R] fp32, the token at
    t scored by the logits of position t - 1 (log-softmax in fp32, temperature 1)."""
    logits = m(input_ids=ids).logits[:, p_len - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, p_len:, None])[..., 0]


def _transformers_arm(cfg, weights, samples, steps: int, dev: torch.device,
                      micro_samples: int = 0, kernel_sites: int = 0):
    """The stock stack users run: transformers bf16 (SDPA, torch autograd), the same samples
    as padded-free [b, P+R] rows (all samples have one length), the same clipped-ratio loss
    over response tokens (token mean), grads widened to fp32 masters, grad-norm clip 1.0 and
    torch's fused AdamW on the masters, weights copied back to bf16. Reports the step and its
    forward + backward alone (the figure REFERENCES.md quotes for this stack)."""
    m = _hf_model(cfg, weights, dev)
    params = [p for p in m.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in params]
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(masters, lr=1e-6, weight_decay=0.0, fused=fused)
    p_len = len(samples[0].prompt_ids)
    ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids) for s in samples], device=dev)
    old = torch.stack([s.rollout_logprobs for s in samples]).to(dev)
    adv = torch.tensor([s.advantage for s in samples], device=dev)
    n_tok = old.numel()
    mb = micro_samples or len(samples)

    def fwd_bwd():
        for a in range(0, len(samples), mb):
            x = ids[a:a + mb]
            lp = _hf_response_logprobs(m, x, p_len)
            ratio = torch.exp(lp - old[a:a + mb])
            A = adv[a:a + mb, None]
            pg = -torch.minimum(ratio * A, ratio.clamp(0.8, 1.2) * A)
            (pg.sum() / n_tok).backward()

    def step():
        fwd_bwd()
        for w, p in zip(masters, params):
            w.grad = p.grad.float()
            p.grad = None
        norms.append(torch.nn.utils.clip_grad_norm_(masters, 1.0, foreach=True))
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params, masters)

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, fb, norms = [], [], []
    for _ in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    for _ in range(max(steps - 1, 1)):
        _sync(dev)
        t0 = time.perf_counter()
        fwd_bwd()
        _sync(dev)
        fb.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    out = {"step_s": times, "warm_step_s": min(times[1:] or times), "peak_gib": peak,
           "fwd_bwd_s": fb, "warm_fwd_bwd_s": min(fb), "micro_samples": mb,
           "first_grad_norm": float(norms[0])}
    if kernel_sites:
        out["kernel_sites"] = _kernel_sites(step, dev, kernel_sites)
    del m, opt, masters, params
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _profiled(step, dev: torch.device, with_stack: bool = False) -> tuple[list[dict], float]:
    """(Chrome-trace events, wall seconds) of one step under torch.profiler, host and device."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile as prof

    from benchmarks import profile_trace

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
              with_stack=with_stack) as pr:
        t0 = time.perf_counter()
        step()
        _sync(dev)
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        pr.export_chrome_trace(os.path.join(d, "trace.json"))
        return profile_trace.load(os.path.join(d, "trace.json")), wall


def _traced_step(step, dev: torch.device) -> dict:
    """One step under torch.profiler (host ops and kernels): profile_trace.summarize with the
    phases train.forward / train.backward (labels put around Qwen3ForCausalLM.hidden and
    autograd's backward for this step only), and where the host was while the device idled."""
    from unittest import mock

    from torch.profiler import record_function

    from benchmarks import profile_trace
    from rlkernel.train import step as step_mod

    def labelled(name, fn):
        def run(*a, **k):
            with record_function(name):
                return fn(*a, **k)
        return run
    hidden = Qwen3ForCausalLM.hidden
    with mock.patch.object(Qwen3ForCausalLM, "hidden", labelled("train.forward", hidden)), \
            mock.patch.object(step_mod.torch.autograd, "backward",
                              labelled("train.backward", torch.autograd.backward)):
        events, wall = _profiled(step, dev)
    out = profile_trace.summarize(events, wall, "train.")
    out["wall_s"] = wall
    out["idle"] = profile_trace.idle_attribution(events)
    return out


SYNC_CAT, SYNC_NAME = "cuda_runtime", "Synchronize"
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")   # cudaLaunchKernel, cuLaunchKernel (Triton) ...


def _frame_sites(xs: list[dict], depth: int):
    """site(tid, ts): the innermost `depth` rlkernel frames (python_function events of the
    trace, enclosing time ts on thread tid) joined by " < ", innermost first, or "(outside)"."""
    import bisect

    frames: dict = {}
    for e in xs:
        if e.get("cat") == "python_function" and "rlkernel/" in e["name"]:
            frames.setdefault(e["tid"], []).append(e)
    for fs in frames.values():
        fs.sort(key=lambda e: e["ts"])
    starts = {t: [f["ts"] for f in fs] for t, fs in frames.items()}

    def site(tid, ts) -> str:
        fs, live = frames.get(tid, []), []
        i = bisect.bisect_right(starts.get(tid, []), ts) - 1
        while i >= 0 and len(live) < depth:   # the latest-starting frame around it is innermost
            if fs[i]["ts"] + fs[i]["dur"] >= ts:
                live.append(fs[i]["name"].split("rlkernel/")[-1])
            i -= 1
        return " < ".join(live) or "(outside)"
    return site


def _sync_sites(step, dev: torch.device, top: int = 30) -> list[dict]:
    """The host syncs of one step by call site: the step under torch.profiler with Python
    stacks; every cudaStreamSynchronize / cudaDeviceSynchronize is keyed by the innermost three
    rlkernel frames (python_function events on its thread) around it."""
    from collections import Counter

    events, _ = _profiled(step, dev, with_stack=True)
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    site = _frame_sites(xs, 3)
    sites: Counter = Counter(site(e["tid"], e["ts"]) for e in xs
                             if e.get("cat") == SYNC_CAT and SYNC_NAME in e["name"])
    return [{"site": k, "syncs": n} for k, n in sites.most_common(top)]


def _kernel_sites(step, dev: torch.device, top: int = 40, depth: int = 2) -> list[dict]:
    """Device time of one step by the code that launched it: every kernel is tied to its launch
    call (the trace's correlation id) and keyed by the innermost `depth` rlkernel frames around
    that call. Rows: site, kernels, device ms, and the site's costliest kernel name (80 chars);
    by device ms, largest first."""
    from collections import defaultdict

    events, _ = _profiled(step, dev, with_stack=True)
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    site = _frame_sites(xs, depth)
    launch = {e["args"]["correlation"]: site(e["tid"], e["ts"]) for e in xs
              if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    rows: dict = defaultdict(lambda: {"kernels": 0, "ms": 0.0, "by_name": defaultdict(float)})
    for e in xs:
        if e.get("cat") != "kernel":
            continue
        r = rows[launch.get(e.get("args", {}).get("correlation"), "(launch not found)")]
        r["kernels"] += 1
        r["ms"] += e["dur"] / 1e3
        r["by_name"][e["name"][:80]] += e["dur"] / 1e3
    out = [{"site": k, "kernels": r["kernels"], "ms": r["ms"],
            "top_kernel": max(r["by_name"], key=r["by_name"].get)} for k, r in rows.items()]
    return sorted(out, key=lambda r: -r["ms"])[:top]


def _package(path: str) -> str:
    """Where a profiled function lives: rlkernel/<subpackage>/<module>, triton, torch, or other."""
    if "rlkernel/" in path:
        return "rlkernel/" + path.split("rlkernel/")[-1]
    for pkg in ("triton", "torch"):
        if f"/{pkg}/" in path:
            return pkg
    return "other" if path != "~" else "builtins"


def _host_profile(step, dev: torch.device, top: int = 150) -> dict:
    """The host's time in one step by Python function (cProfile, so every Python call costs a
    little more than unprofiled): wall, the top functions by own time and by cumulative time,
    own time summed by package (`_package`), and the costliest builtins (torch's C calls: where
    the host waited on a sync or issued work) with their top callers. Functions are
    "file:line(name)", the file shortened to its last two path parts; builtins as cProfile
    names them."""
    import cProfile
    import pstats
    from collections import defaultdict

    pr = cProfile.Profile()
    _sync(dev)
    t0 = time.perf_counter()
    pr.enable()
    step()
    _sync(dev)
    pr.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(pr).stats

    def name(f) -> str:
        file, line, fn = f
        return f"{'/'.join(file.split('/')[-2:])}:{line}({fn})"
    rows = [{"fn": name(f), "calls": nc, "own_ms": tt * 1e3, "cum_ms": ct * 1e3}
            for f, (_cc, nc, tt, ct, _callers) in stats.items()]
    by_pkg: dict = defaultdict(float)
    for f, (_cc, _nc, tt, _ct, _callers) in stats.items():
        by_pkg[_package(f[0])] += tt * 1e3
    builtins = sorted((f for f in stats if f[0] == "~"), key=lambda f: -stats[f][2])[:10]
    callers = [{"fn": name(f), "own_ms": stats[f][2] * 1e3,
                "callers": [f"{name(c)} {t[2] * 1e3:.1f} ms {t[1]}x" for c, t in
                            sorted(stats[f][4].items(), key=lambda ct: -ct[1][2])[:4]]}
               for f in builtins]
    return {"wall_s": wall, "builtin_callers": callers,
            "by_own": sorted(rows, key=lambda r: -r["own_ms"])[:top],
            "by_cum": sorted(rows, key=lambda r: -r["cum_ms"])[:top],
            "by_package": sorted(({"package": k, "own_ms": v} for k, v in by_pkg.items()),
                                 key=lambda r: -r["own_ms"])[:top]}


# Frames where a thread waits in C for another (the main thread inside autograd's engine while
# the device thread runs the backward; idle helper threads): not host work of their own.
_WAITING = ("_engine_run_backward", "wait", "_wait_for_tstate_lock", "select", "sleep")


def _stack_keys(frame, depth: int) -> tuple[str, str, str, str] | None:
    """(site, line, own, op) of one sampled stack: site = the innermost `depth` rlkernel
    functions as "module(fn)" joined by " < " (innermost first; "(outside rlkernel)" if none),
    line = the innermost rlkernel frame as "module:line(fn)", own = the innermost frame of any
    code, op = the innermost rlkernel `forward`/`backward` frame (a module's forward or an
    autograd Function's) as "module(Class.fn)". None for a thread waiting (`_WAITING`)."""
    if frame is None or frame.f_code.co_name in _WAITING:
        return None

    def name(f, line: bool = True) -> str:
        file = f.f_code.co_filename
        short = ("rlkernel/" + file.split("rlkernel/")[-1]) if "rlkernel/" in file \
            else "/".join(file.split("/")[-2:])
        return f"{short}:{f.f_lineno}({f.f_code.co_name})" if line \
            else f"{short}({f.f_code.co_name})"
    own, ours, f, line, op = name(frame), [], frame, None, None
    while f is not None and op is None:
        if "rlkernel/" in f.f_code.co_filename:
            line = line or name(f)
            if len(ours) < depth:
                ours.append(name(f, line=False))
            if f.f_code.co_name in ("forward", "backward"):
                op = f"{name(f, line=False).split('(')[0]}" \
                     f"({getattr(f.f_code, 'co_qualname', f.f_code.co_name)})"
        f = f.f_back
    outside = "(outside rlkernel)"
    return " < ".join(ours) or outside, line or outside, own, op or outside


def _host_samples(step, dev: torch.device, interval_s: float = 2e-4, depth: int = 2,
                  top: int = 200) -> dict:
    """The host's time in one step by the rlkernel code running, from stack samples: a thread
    reads every other thread's Python stack each `interval_s` (the interpreter's switch interval
    set to match, so the GIL comes back in time). Unlike cProfile (`_host_profile`) a Python call
    costs nothing extra, so call-heavy code is not overcharged. Each running sample counts once
    for its innermost `depth` rlkernel functions (`by_site`: our code and all it called into:
    torch's ops, Triton's launcher), once for its innermost rlkernel line (`by_line`) and once
    for its innermost frame (`by_own`), once for its innermost rlkernel forward/backward
    (`by_op`: a module's or autograd Function's whole host time); a thread waiting in C for
    another (`_WAITING`) is not counted. ms = samples × wall / sampling rounds: a sample taken while a thread is in C (a
    kernel launch, a sync, a copy that waits) is charged to the Python line that called it;
    cpu_ms = the thread's CPU time since its previous sample (its POSIX thread CPU clock), so a
    line that waits on the device has ms but little cpu_ms — the host is bound where cpu_ms
    adds up to about the wall."""
    import sys
    import threading
    from collections import Counter

    tables = (Counter(), Counter(), Counter(), Counter())
    cpu_tables = (Counter(), Counter(), Counter(), Counter())
    rounds = [0]
    stop = threading.Event()
    me = []
    last_cpu: dict = {}

    def cpu_s(tid: int) -> float:
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(tid))
        except (OSError, AttributeError, OverflowError):   # a thread gone, or no such clock
            return 0.0

    def sample() -> None:
        me.append(threading.get_ident())
        while not stop.is_set():
            rounds[0] += 1
            for tid, frame in sys._current_frames().items():
                if tid == me[0]:
                    continue
                now = cpu_s(tid)
                used, last_cpu[tid] = now - last_cpu.get(tid, now), now
                keys = _stack_keys(frame, depth)
                for table, cpu_table, key in zip(tables, cpu_tables, keys or ()):
                    table[key] += 1
                    cpu_table[key] += used
            time.sleep(interval_s)
    old = sys.getswitchinterval()
    _sync(dev)
    sys.setswitchinterval(interval_s)
    th = threading.Thread(target=sample, daemon=True)
    t0 = time.perf_counter()
    th.start()
    try:
        step()
        _sync(dev)
    finally:
        wall = time.perf_counter() - t0
        stop.set()
        th.join()
        sys.setswitchinterval(old)
    per = wall * 1e3 / max(rounds[0], 1)

    def rows(c: Counter, cpu: Counter, key: str) -> list[dict]:
        return [{key: k, "samples": n, "ms": n * per, "cpu_ms": cpu[k] * 1e3}
                for k, n in c.most_common(top)]
    names = ("by_site", "by_line", "by_own", "by_op")
    cols = ("site", "line", "fn", "op")
    out = {"wall_s": wall, "rounds": rounds[0], "busy_ms": sum(tables[0].values()) * per,
           "cpu_ms": sum(cpu_tables[0].values()) * 1e3}
    out.update({n: rows(t, c, col) for n, t, c, col in zip(names, tables, cpu_tables, cols)})
    return out


def _launch_stats(step, dev: torch.device, top: int = 40) -> dict:
    """One step with Triton's launch path timed (perf_counter around each call: ~1 µs added
    per launch): every launch reaches the driver's launcher (`CudaLauncher.__call__`: its count
    and host ms), and a launch that takes Triton's usual path goes through `JITFunction.run`
    first (per kernel: launches and host ms — binding, specialisation, the launcher). Launches
    through kernels/triton_util.launch's direct path skip JITFunction.run, so `launches` minus
    the usual path's count is how many went direct."""
    from collections import defaultdict

    from triton.runtime.jit import JITFunction

    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except ImportError:     # a Triton without the NVIDIA backend: the usual path only
        CudaLauncher = None
    real = JITFunction.run
    real_call = CudaLauncher.__call__ if CudaLauncher is not None else None
    per: dict = defaultdict(lambda: [0, 0.0])
    driver = [0, 0.0]

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            row = per[getattr(self, "__name__", None) or str(self)]
            row[0] += 1
            row[1] += time.perf_counter() - t0

    def timed_call(self, *args):
        t0 = time.perf_counter()
        try:
            return real_call(self, *args)
        finally:
            driver[0] += 1
            driver[1] += time.perf_counter() - t0
    _sync(dev)
    JITFunction.run = timed
    if CudaLauncher is not None:
        CudaLauncher.__call__ = timed_call
    t0 = time.perf_counter()
    try:
        step()
        _sync(dev)
    finally:
        wall = time.perf_counter() - t0
        JITFunction.run = real
        if CudaLauncher is not None:
            CudaLauncher.__call__ = real_call
    rows = sorted(({"kernel": k, "launches": n, "host_ms": s * 1e3} for k, (n, s) in
                   per.items()), key=lambda r: -r["host_ms"])
    return {"wall_s": wall, "launches": driver[0], "driver_ms": driver[1] * 1e3,
            "usual_launches": sum(r["launches"] for r in rows),
            "usual_ms": sum(r["host_ms"] for r in rows), "by_kernel": rows[:top]}


def _print_launch_stats(h: dict) -> None:
    n = max(h["launches"], 1)
    each = 1e3 * h["driver_ms"] / n
    print(f"  triton launches: wall {h['wall_s']:.3f} s, {h['launches']} launches, "
          f"{h['driver_ms']:.0f} ms of host in the driver's launcher ({each:.1f} us each); "
          f"{h['usual_launches']} by JITFunction.run ({h['usual_ms']:.0f} ms), the rest direct")
    for r in h["by_kernel"][:25]:
        print(f"    {r['host_ms']:8.1f} ms {r['launches']:6d}x  {r['kernel']} (usual path)")


def _print_host_samples(h: dict) -> None:
    print(f"  host samples: wall {h['wall_s']:.3f} s, {h['rounds']} rounds, host in our code "
          f"{h['busy_ms']:.0f} ms, of it on a CPU {h['cpu_ms']:.0f} ms")
    for key, col in (("by_op", "op"), ("by_site", "site"), ("by_line", "line"),
                     ("by_own", "fn")):
        for row in h[key][:40]:
            print(f"    {key} {row['ms']:8.1f} ms (cpu {row['cpu_ms']:7.1f})  {row[col]}")


def _print_host_profile(h: dict) -> None:
    print(f"  host profile: wall {h['wall_s']:.3f} s (under cProfile)")
    for key, col in (("by_package", "package"), ("by_own", "fn"), ("by_cum", "fn")):
        for row in h[key][:30]:
            calls = f"{row['calls']:7d}x " if "calls" in row else ""
            cum = f" cum {row['cum_ms']:8.1f}" if "cum_ms" in row else ""
            print(f"    {key} own {row['own_ms']:8.1f} ms{cum} {calls} {row[col]}")
    for row in h["builtin_callers"]:   # a builtin's own time is where the host waited or issued
        print(f"    builtin {row['own_ms']:8.1f} ms {row['fn']}: " + "; ".join(row["callers"]))


def _print_trace(t: dict) -> None:
    print(f"  traced step: wall {t['wall_s']:.3f} s, device {t['device_s']:.3f} s "
          f"({t['device_over_wall'] or 0:.2f}), {t['kernels']} kernels, idle {t['idle']['idle_ms']:.0f} ms "
          f"in {t['idle']['gaps']} gaps")
    for name, p in t["phases"].items():
        print(f"    phase {name}: {p['calls']}x host {p['host_ms']:.0f} ms, {p['kernels']} kernels "
              f"{p['device_ms']:.0f} ms")
    for key in ("by_scope", "by_op"):
        for row in t["idle"][key][:12]:
            print(f"    idle {key} {row['idle_ms']:7.1f} ms  {row['name']}")
    for row in t["top_cpu_ops"][:15]:
        print(f"    host self {row['self_ms']:7.1f} ms {row['count']:6d}x  {row['name']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=448)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--arms", default="invariant,native",
                    help="comma list of invariant, native, transformers (transformers bf16 with "
                         "SDPA and torch AdamW on fp32 masters: the stock stack), "
                         "invariant-unfused (the invariant arm with the virtual-TP shard trees "
                         "as bmm partials + adds; run it last)")
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--native-micro-samples", type=int, default=0,
                    help="samples per microbatch of the native arm (0: all in one, as the "
                         "invariant arm, whose one-microbatch direct mode keeps no accumulators)")
    ap.add_argument("--invariant-micro-samples", type=int, default=0,
                    help="samples per microbatch of the invariant arm (0: all in one, direct "
                         "mode; N: several microbatches into the persistent exact "
                         "accumulators, as `rlk run` at its default --micro-batch-tokens)")
    ap.add_argument("--no-kl", action="store_true",
                    help="--kl-coef 0 as rlk run's default: no reference policy kept or run")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--trace", action="store_true",
                    help="one more invariant step under the host+device profiler: phases, host "
                         "ops, where the host was while the device idled")
    ap.add_argument("--sync-sites", action="store_true",
                    help="one more step with CUDA sync debugging: the host syncs by call site")
    ap.add_argument("--kernel-sites", type=int, nargs="?", const=40, default=0, metavar="ROWS",
                    help="one more profiled step: device time by the rlkernel code that "
                         "launched it, the largest ROWS sites (40 when no number is given)")
    ap.add_argument("--host-profile", action="store_true",
                    help="one more step under cProfile: the host's Python time by function and "
                         "by package")
    ap.add_argument("--host-sample", action="store_true",
                    help="one more step under a stack sampler: the host's time by the rlkernel "
                         "line running (torch and Triton calls included), without cProfile's "
                         "per-call cost")
    ap.add_argument("--launch-stats", action="store_true",
                    help="one more step with Triton's launcher timed: launches and host ms by "
                         "kernel")
    ap.add_argument("--device", default="cuda", help="cpu only to smoke-test the script")
    ap.add_argument("--ragged", action="store_true",
                    help="responses of lengths drawn from [R/2, R] (samples ending at their "
                         "EOS: the invariant attention reads the packed streams in place, the "
                         "native arm gathers per-sample tensors); not with the transformers arm")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.ragged and "transformers" in a.arms.split(","):
        ap.error("--ragged: the transformers arm takes equal-length samples only "
                 f"(--arms {a.arms})")
    dev = torch.device(a.device)
    if dev.type == "cuda":
        require_cuda()
    cfg = preset(a.model)
    weights = init_weights(cfg, 0)
    samples = _samples(a.samples, a.prompt_len, a.response_len, cfg.vocab_size, 1, a.ragged)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    n_params = sum(w.numel() for w in weights.values())
    res = {"env": env() if dev.type == "cuda" else {"device": "cpu"}, "model": a.model,
           "samples": a.samples, "prompt_len": a.prompt_len, "response_len": a.response_len,
           "ragged": a.ragged,
           "tokens": tokens, "parameters": n_params, "arms": {}}
    for mode in a.arms.split(","):
        if mode == "transformers":
            r = _transformers_arm(cfg, weights, samples, a.steps, dev, a.native_micro_samples,
                                  a.kernel_sites)
            r["peak_bytes_per_param"] = r["peak_gib"] * 2**30 / n_params
            res["arms"][mode] = r
            dump(a.out, res)
            print(f"{mode}: warm step {r['warm_step_s']:.3f} s ({tokens / r['warm_step_s']:.0f} "
                  f"tok/s), forward + backward {r['warm_fwd_bwd_s']:.3f} s, peak "
                  f"{r['peak_gib']:.2f} GiB, steps {[round(t, 3) for t in r['step_s']]}, first grad "
                  f"norm {r['first_grad_norm']!r}",
                  flush=True)
            for row in r.get("kernel_sites", []):
                print(f"    {row['ms']:8.1f} ms {row['kernels']:6d}x  {row['site']}  "
                      f"[{row['top_kernel']}]")
            continue
        if mode == "invariant-unfused":   # the invariant arm with the shard trees unfused
            from rlkernel.kernels import triton_shard_matmul as tsm
            tsm.fusable = lambda bounds: False   # worth_fusing then says no everywhere
        r = _arm(mode.split("-")[0], cfg, weights, samples, a.steps, a.recompute,
                 a.profile and mode == "invariant", dev,
                 a.native_micro_samples if mode == "native" else a.invariant_micro_samples,
                 not a.no_kl,
                 a.trace and mode == "invariant", a.sync_sites, a.kernel_sites,
                 a.host_profile and mode == "invariant",
                 a.host_sample and mode == "invariant",
                 a.launch_stats and mode == "invariant")
        # Peak bytes per parameter element: weights, grads, masters, moments and the step's
        # activations and workspace together (the arms keep the same model state).
        r["peak_bytes_per_param"] = r["peak_gib"] * 2**30 / n_params
        res["arms"][mode] = r
        dump(a.out, res)          # after each arm: a later arm's failure keeps this one
        print(f"{mode}: warm step {r['warm_step_s']:.3f} s ({tokens / r['warm_step_s']:.0f} tok/s), "
              f"{_host_share(r)}, "
              f"peak {r['peak_gib']:.2f} GiB ({r['peak_bytes_per_param']:.1f} B/param), steps "
              f"{[round(t, 3) for t in r['step_s']]}, first grad norm {r['first_grad_norm']!r}",
              flush=True)
        for k in r.get("top_kernels", [])[:25]:
            print(f"   {k['ms']:9.1f} ms {k['calls']:6d}x  {k['name']}")
        if "trace" in r:
            _print_trace(r["trace"])
        if "host_profile" in r:
            _print_host_profile(r["host_profile"])
        if "host_samples" in r:
            _print_host_samples(r["host_samples"])
        if "launch_stats" in r:
            _print_launch_stats(r["launch_stats"])
        for row in r.get("sync_sites", []):
            print(f"    syncs {row['syncs']:5d}  {row['site']}")
        for row in r.get("kernel_sites", []):
            print(f"    {row['ms']:8.1f} ms {row['kernels']:6d}x  {row['site']}  "
                  f"[{row['top_kernel']}]")
    if {"invariant", "native"} <= res["arms"].keys():
        res["ratio"] = res["arms"]["invariant"]["warm_step_s"] / res["arms"]["native"]["warm_step_s"]
        mb = (a.invariant_micro_samples or a.samples, a.native_micro_samples or a.samples)
        same = mb[0] == mb[1]
        res["ratio_same_packing"] = same
        print(f"ratio invariant / native: {res['ratio']:.2f}" + ("" if same else (
            f" (NOT the cost of invariance: the arms ran {mb[0]} and {mb[1]} samples per "
            "microbatch, and a stock step pays per microbatch; rerun with equal "
            "--invariant-micro-samples and --native-micro-samples)")))
    if {"invariant", "transformers"} <= res["arms"].keys():
        res["ratio_transformers"] = (res["arms"]["invariant"]["warm_step_s"]
                                     / res["arms"]["transformers"]["warm_step_s"])
        print(f"ratio invariant / transformers: {res['ratio_transformers']:.2f}")
    dump(a.out, res)


if __name__ == "__main__":
    main()
