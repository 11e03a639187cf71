"""benchmarks/bench_train_step.py's diagnostics run on CPU, and profile_trace.idle_attribution
charges the device's idle gaps to the host op running then.

Properties: on a hand-made CUDA-shaped trace, every gap of at least min_gap_us between kernels
is counted once, at its midpoint, to the innermost host op and to the innermost autograd
function or label around it; shorter gaps and overlapping kernels add nothing. The CPU smoke
run of --trace reports the forward and backward phases; --sync-sites keys each synchronizing
event by the rlkernel frames around it (on CPU, with aten::nonzero standing in for CUDA's
synchronize calls, which a CPU run has none of); --host-profile names the step's functions,
their packages and the callers of the costliest builtins; --host-sample keys stack samples
by our frames and the op around them.
Run: `.venv/bin/python -m pytest -q tests/test_bench_train_step.py` (about 15 s).
"""

from __future__ import annotations

import json
import pathlib
import time

import torch

from benchmarks import bench_train_step, profile_trace


def _ev(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_idle_attribution_charges_each_gap_to_the_op_around_its_midpoint():
    events = [
        _ev("kernel", "k0", 0, 10), _ev("kernel", "k1", 5, 20),      # overlap: no gap
        _ev("kernel", "k2", 35, 5),                                  # gap 25..35 (10 us)
        _ev("kernel", "k3", 100, 5),                                 # gap 40..100 (60 us)
        _ev("kernel", "k4", 130, 5),                                 # gap 105..130 (25 us)
        _ev("user_annotation", "train.backward", 0, 200),
        _ev("cpu_op", "autograd::engine::evaluate_function: _RMSNormBackward", 50, 60),
        _ev("cpu_op", "_RMSNormBackward", 55, 40),
        _ev("cpu_op", "aten::nonzero", 60, 20),                      # holds 70, gap 1's middle
        _ev("cpu_op", "aten::add", 112, 10),                         # holds 117.5, gap 2's
    ]
    got = profile_trace.idle_attribution(events, min_gap_us=20.0)
    assert got["gaps"] == 2 and abs(got["idle_ms"] - 0.085) < 1e-12
    assert {r["name"]: round(r["idle_ms"], 6) for r in got["by_op"]} == {
        "aten::nonzero": 0.06, "aten::add": 0.025}
    assert {r["name"]: round(r["idle_ms"], 6) for r in got["by_scope"]} == {
        "autograd::engine::evaluate_function: _RMSNormBackward": 0.06, "train.backward": 0.025}


def _smoke(tmp_path, flag):
    out = tmp_path / "s.json"
    argv = ["bench_train_step.py", "--model", "tiny", "--samples", "2", "--prompt-len", "8",
            "--response-len", "24", "--steps", "1", "--device", "cpu", "--arms", "invariant",
            "--no-kl", flag, "--out", str(out)]
    import sys
    old = sys.argv
    sys.argv = argv
    try:
        bench_train_step.main()
    finally:
        sys.argv = old
    return json.loads(out.read_text())["arms"]["invariant"]


def test_trace_smoke_cpu_reports_the_forward_and_backward_phases(tmp_path):
    t = _smoke(tmp_path, "--trace")["trace"]
    assert {n: p["calls"] for n, p in t["phases"].items() if n.startswith("train.")} == {
        "train.forward": 1, "train.backward": 1}
    assert t["kernels"] == 0 and t["idle"]["gaps"] == 0 and t["top_cpu_ops"]


def test_sync_sites_keys_each_sync_by_its_rlkernel_frames(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_train_step, "SYNC_CAT", "cpu_op")
    monkeypatch.setattr(bench_train_step, "SYNC_NAME", "aten::nonzero")
    sites = _smoke(tmp_path, "--sync-sites")["sync_sites"]
    assert sites and all(r["syncs"] > 0 for r in sites)
    # The innermost frame first; each a "path(line): function" of rlkernel.
    assert all(r["site"] == "(outside)" or "(" in r["site"].split(" < ")[0] for r in sites)
    assert any(".py(" in r["site"] for r in sites)


def test_idle_gaps_a_kernel_inside_a_longer_one_opens_no_gap():
    """A short kernel running inside a longer one does not end the busy span: the gap starts
    at the longer kernel's end."""
    ks = [_ev("kernel", "long", 0, 50), _ev("kernel", "inside", 10, 5), _ev("kernel", "k", 60, 5)]
    assert profile_trace._idle_gaps(ks, 5.0) == [(50, 60)]
    assert profile_trace._idle_gaps(ks, 20.0) == []


def _stub_profiler(monkeypatch, events: list[dict]) -> None:
    """torch.profiler.profile replaced by a no-op whose trace is `events`."""
    import contextlib

    import torch.profiler

    class Prof(contextlib.nullcontext):
        def __init__(self, *a, **k):
            super().__init__(self)

        def export_chrome_trace(self, path):
            pass
    monkeypatch.setattr(torch.profiler, "profile", Prof)
    monkeypatch.setattr(profile_trace, "load", lambda path: events)


def test_sync_sites_keys_a_sync_by_the_frames_around_it_only(monkeypatch):
    """On a hand-made trace (the profiler stubbed): a sync is keyed by the rlkernel frames that
    enclose it, innermost first; a frame that ended before it is not one of them."""
    fr = lambda name, ts, dur: _ev("python_function", f"/x/rlkernel/{name}", ts, dur)
    events = [fr("a.py(1): outer", 0, 100), fr("b.py(2): done", 10, 5),
              fr("c.py(3): inner", 20, 30), _ev("cuda_runtime", "cudaStreamSynchronize", 30, 1)]

    _stub_profiler(monkeypatch, events)
    got = bench_train_step._sync_sites(lambda: None, torch.device("cpu"))
    assert got == [{"site": "c.py(3): inner < a.py(1): outer", "syncs": 1}]


def test_kernel_sites_charge_each_kernel_to_the_frames_around_its_launch(monkeypatch):
    """On a hand-made trace: a kernel's time goes to the site of the launch call with its
    correlation id (not to whatever ran on the host when the kernel ran); kernels of one site
    add up, the costliest kernel name is reported, and sites come out by device time."""
    fr = lambda name, ts, dur: _ev("python_function", f"/x/rlkernel/{name}", ts, dur)
    launch = lambda name, ts, cid: {**_ev("cuda_runtime", name, ts, 1),   # noqa: E731
                                    "args": {"correlation": cid}}
    kernel = lambda name, ts, dur, cid: {**_ev("kernel", name, ts, dur, tid=7),
                                         "args": {"correlation": cid}}
    events = [fr("opt.py(1): step", 0, 100), fr("norm.py(2): rms", 200, 100),
              launch("cudaLaunchKernel", 10, 1), launch("cuLaunchKernel", 20, 2),
              {**launch("cuLaunchKernel", 210, 3), "cat": "cuda_driver"},
              kernel("add", 250, 30, 1), kernel("mul", 290, 5, 2), kernel("rms_k", 300, 20, 3),
              kernel("orphan", 400, 1, 99)]

    _stub_profiler(monkeypatch, events)
    got = [{**r, "ms": round(r["ms"], 9)}
           for r in bench_train_step._kernel_sites(lambda: None, torch.device("cpu"))]
    assert got == [
        {"site": "opt.py(1): step", "kernels": 2, "ms": 0.035, "top_kernel": "add"},
        {"site": "norm.py(2): rms", "kernels": 1, "ms": 0.02, "top_kernel": "rms_k"},
        {"site": "(launch not found)", "kernels": 1, "ms": 0.001, "top_kernel": "orphan"}]


def _five_zeros() -> None:
    for _ in range(5):
        torch.zeros(3)


def test_host_profile_names_functions_packages_and_the_callers_of_builtins():
    """--host-profile's table (cProfile of one step): the step's Python function with its call
    count, own time summed by package (`_package`: rlkernel/<module>, triton, torch, builtins,
    other), and each costly builtin with the function that called it and how often."""
    h = bench_train_step._host_profile(_five_zeros, torch.device("cpu"))
    mine = [r for r in h["by_cum"] if r["fn"].endswith("(_five_zeros)")]
    assert len(mine) == 1 and mine[0]["calls"] == 1 and mine[0]["cum_ms"] >= mine[0]["own_ms"]
    zeros = [r for r in h["builtin_callers"] if "torch.zeros" in r["fn"]]
    assert len(zeros) == 1 and zeros[0]["callers"][0].startswith(
        "tests/test_bench_train_step.py:") and zeros[0]["callers"][0].endswith(" 5x")
    assert {r["package"] for r in h["by_package"]} <= {"builtins", "other", "torch"}
    assert bench_train_step._package("/x/rlkernel/kernels/norm.py") == "rlkernel/kernels/norm.py"
    assert bench_train_step._package("/x/site-packages/triton/runtime/jit.py") == "triton"
    assert bench_train_step._package("~") == "builtins"


def test_host_profile_smoke_cpu_profiles_the_invariant_step(tmp_path):
    h = _smoke(tmp_path, "--host-profile")["host_profile"]
    assert h["wall_s"] > 0 and any(r["fn"].endswith("(compute_gradients)") for r in h["by_cum"])
    assert any(r["package"].startswith("rlkernel/") for r in h["by_package"])


_FAKE = """
class _Fn:
    @staticmethod
    def backward(keys):
        return a(keys)
def a(keys):
    return b(keys)
def b(keys):
    return outside(keys)
"""


def _outside(keys):
    import sys
    return keys(sys._getframe(), 2)


def test_stack_keys_charge_a_sample_to_our_frames_and_the_op_around_them():
    """A sampled stack is keyed by its innermost `depth` (2) rlkernel functions — of three under
    the op, the innermost two; code outside rlkernel, here this test's `outside`, is skipped but
    stays the sample's own frame —, its innermost rlkernel line, and the innermost rlkernel
    forward/backward by its qualified name, found above the frames the site keeps; a thread
    waiting in autograd's engine or a lock is not a sample."""
    ns = {"outside": _outside}
    exec(compile(_FAKE, "/x/rlkernel/kernels/fake.py", "exec"), ns)
    site, line, own, op = ns["_Fn"].backward(bench_train_step._stack_keys)
    assert site == "rlkernel/kernels/fake.py(b) < rlkernel/kernels/fake.py(a)"
    assert line == "rlkernel/kernels/fake.py:9(b)"
    assert own.startswith("tests/test_bench_train_step.py:") and own.endswith("(_outside)")
    assert op == "rlkernel/kernels/fake.py(_Fn.backward)"
    import sys
    assert bench_train_step._stack_keys(sys._getframe(), 2)[0] == "(outside rlkernel)"
    waiting = compile("def _engine_run_backward(k):\n    import sys\n"
                      "    return k(sys._getframe(), 2)\n", "/x/torch/autograd/graph.py", "exec")
    ns2: dict = {}
    exec(waiting, ns2)
    assert ns2["_engine_run_backward"](bench_train_step._stack_keys) is None


def _busy(seconds: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


def test_host_samples_are_in_ms_of_the_wall_and_restore_the_switch_interval():
    """A step that runs Python for 0.3 s: the running samples add up to most of the wall in ms
    (not seconds), and the interpreter's switch interval is the caller's again afterwards."""
    import sys
    old = sys.getswitchinterval()
    h = bench_train_step._host_samples(lambda: _busy(0.3), torch.device("cpu"))
    assert sys.getswitchinterval() == old
    wall_ms = h["wall_s"] * 1e3
    assert 0.5 * wall_ms <= h["busy_ms"] <= 1.05 * wall_ms
    assert 0.5 * wall_ms <= sum(r["ms"] for r in h["by_own"])


def test_host_samples_charge_cpu_since_the_previous_sample(monkeypatch):
    """A thread already running before sampling starts is charged only the CPU it used since
    its first sample, not its lifetime (here every thread clock is 1,000 s ahead): at most two
    running threads' worth of the wall."""
    import threading
    real = time.clock_gettime
    monkeypatch.setattr(time, "clock_gettime", lambda c: real(c) + 1000.0)
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass
    th = threading.Thread(target=spin)
    th.start()
    try:
        h = bench_train_step._host_samples(lambda: _busy(0.2), torch.device("cpu"))
    finally:
        stop.set()
        th.join()
    assert h["cpu_ms"] <= 2.1 * h["wall_s"] * 1e3


def test_host_sample_smoke_cpu_samples_the_invariant_step(tmp_path):
    """--host-sample on the CPU step: the backward's autograd Functions appear by name, and the
    host's running time is within the sampled wall (one thread runs the CPU step)."""
    h = _smoke(tmp_path, "--host-sample")["host_samples"]
    ops = {r["op"] for r in h["by_op"]}
    assert "rlkernel/kernels/matmul.py(_ColumnParallelLinear.backward)" in ops
    assert h["rounds"] > 10 and 0 < h["busy_ms"] <= h["wall_s"] * 1e3 * 1.05
    assert all(r["ms"] > 0 for r in h["by_site"] + h["by_line"] + h["by_own"])
    # the CPU step computes on the host: its CPU time is most of the sampled time, no more
    assert 0.3 * h["busy_ms"] < h["cpu_ms"] <= h["wall_s"] * 1e3 * 1.05
    assert all(0 <= r["cpu_ms"] <= h["cpu_ms"] + 1e-9 for r in h["by_op"])


def test_transformers_arm_smoke_cpu_times_the_step_and_its_forward_backward(tmp_path):
    """The stock-stack arm (transformers bf16 + torch AdamW on fp32 masters) runs on the same
    samples and reports the step and the forward + backward alone, the latter inside the
    former (it does not include the optimizer) — and its loss is the native arm's: the same
    pre-clip gradient norm within bf16 tolerance (a reference-library comparison)."""
    import sys
    out = tmp_path / "t.json"
    old = sys.argv
    sys.argv = ["bench_train_step.py", "--model", "tiny", "--samples", "4", "--prompt-len", "8",
                "--response-len", "24", "--steps", "2", "--device", "cpu", "--arms",
                "native,transformers", "--no-kl", "--native-micro-samples", "2",
                "--out", str(out)]
    try:
        bench_train_step.main()
    finally:
        sys.argv = old
    arms = json.loads(out.read_text())["arms"]
    r, nat = arms["transformers"], arms["native"]["first_grad_norm"]
    assert nat > 0 and abs(r["first_grad_norm"] - nat) <= 0.02 * nat, (r["first_grad_norm"], nat)
    assert r["micro_samples"] == 2 and len(r["step_s"]) == 2 and len(r["fwd_bwd_s"]) == 1
    assert 0 < r["warm_fwd_bwd_s"] and 0 < r["warm_step_s"]


def test_transformers_arm_scores_each_response_token_as_our_model_does():
    """The transformers arm's loss reads the logprob of each response token from the previous
    position's logits: per token, within bf16 tolerance of our model's logprobs (bf16 weights,
    fp32 compute on CPU) on the same weights (a reference-library comparison; a gradient norm
    alone does not see a logits row shifted by one position on random tokens). Control: scoring each token from its own
    position instead is far off."""
    import torch
    from rlkernel.model.checkpoint import init_weights
    from rlkernel.model.config import tiny
    from rlkernel.model.ops import NativeOps
    from rlkernel.model.qwen3 import Qwen3ForCausalLM
    from rlkernel.train.step import trainer_logprobs
    cfg = tiny()
    weights = init_weights(cfg, 0)
    samples = bench_train_step._samples(3, 6, 10, cfg.vocab_size, 1)
    ours = Qwen3ForCausalLM(cfg, NativeOps, torch.bfloat16)   # bf16 values, fp32 on CPU
    ours.load_tensors(weights)
    want = torch.stack(trainer_logprobs(ours, samples, 1.0, bench_train_step.PAD))
    hf = bench_train_step._hf_model(cfg, weights, torch.device("cpu"))
    ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids) for s in samples])
    with torch.no_grad():
        got = bench_train_step._hf_response_logprobs(hf, ids, 6)
        shifted = torch.log_softmax(hf(input_ids=ids).logits[:, 6:].float(), -1).gather(
            -1, ids[:, 6:, None])[..., 0]
    assert got.shape == want.shape == (3, 10)
    assert float((got - want).abs().max()) < 0.02, (got - want).abs().max()
    assert float((shifted - want).abs().max()) > 0.5


def test_ragged_samples_smoke_cpu_takes_the_packed_attention(tmp_path, monkeypatch):
    """--ragged: responses of several lengths in [R/2, R] (fewer tokens than S·(P+R)), and the
    invariant arm's attention reads the packed streams in place (counted); with the
    transformers arm it is a usage error naming the arms (exit 2)."""
    import sys

    import pytest

    from rlkernel.model.ops import InvariantOps
    calls = []
    real = InvariantOps.attention_packed

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(InvariantOps, "attention_packed", staticmethod(counted))
    samples = bench_train_step._samples(6, 8, 24, 300, 1, ragged=True)
    lens = {len(s.response_ids) for s in samples}
    assert len(lens) > 1 and min(lens) >= 12 and max(lens) <= 24
    out = tmp_path / "r.json"
    argv = ["bench_train_step.py", "--model", "tiny", "--samples", "3", "--prompt-len", "8",
            "--response-len", "24", "--steps", "1", "--device", "cpu", "--arms", "invariant",
            "--no-kl", "--ragged", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_train_step.main()
    res = json.loads(out.read_text())
    assert res["ragged"] and res["tokens"] < 3 * 32 and calls
    monkeypatch.setattr(sys, "argv", argv[:-2] + ["--arms", "invariant,transformers"])
    with pytest.raises(SystemExit) as e:
        bench_train_step.main()
    assert e.value.code == 2


def test_ratio_says_when_the_arms_ran_different_microbatches(tmp_path, monkeypatch, capsys):
    """invariant / native is the cost of invariance only at one packing: a stock step pays per
    microbatch (twenty-second session: native 0.618 s in one microbatch, 0.908 s in four), so
    the ratio line says when the arms' samples per microbatch differ, and the JSON records it."""
    import sys
    out = tmp_path / "r.json"
    base = ["bench_train_step.py", "--model", "tiny", "--samples", "2", "--prompt-len", "8",
            "--response-len", "8", "--steps", "1", "--device", "cpu", "--arms",
            "invariant,native", "--no-kl", "--out", str(out)]
    for extra, same in (([], True), (["--native-micro-samples", "1"], False),
                        (["--native-micro-samples", "2"], True)):
        monkeypatch.setattr(sys, "argv", base + extra)
        bench_train_step.main()
        line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("ratio")][0]
        assert json.loads(out.read_text())["ratio_same_packing"] is same
        assert ("NOT the cost of invariance" in line) is (not same), line


def test_ab_runs_both_builds_alternately_and_checks_the_first_grad_norm(tmp_path, capsys):
    """benchmarks/ab_train_step.py on CPU with this tree as both builds (tiny model, 2 steps, 2
    rounds): four processes, old and new alternating; each build's warm steps pooled (one per
    run: the steps after the first), mean/min and new/old ratios, and the first gradient norm
    the same float in every run. Control: summarize() of runs whose norms differ in one bit
    says they are not the same."""
    import math

    from benchmarks import ab_train_step as ab
    out = tmp_path / "ab.json"
    root = pathlib.Path(ab.__file__).resolve().parent.parent
    ab.main(["--old", str(root), "--rounds", "2", "--out", str(out), "--",
             "--model", "tiny", "--samples", "2", "--prompt-len", "8", "--response-len", "24",
             "--steps", "2", "--device", "cpu", "--arms", "invariant", "--no-kl"])
    res = json.loads(out.read_text())
    assert res["rounds_done"] == 2 and [len(res["runs"][b]) for b in ("old", "new")] == [2, 2]
    row = res["arms"]["invariant"]
    for b in ("old", "new"):
        assert len(row[b]["warm"]) == 2 and row[b]["min"] == min(row[b]["warm"])
    assert math.isclose(row["ratio_mean"], row["new"]["mean"] / row["old"]["mean"])
    assert res["same_first_grad_norm"] is True
    assert "first grad norm the same in every invariant run: True" in capsys.readouterr().out
    one = json.loads(json.dumps(res["runs"]["old"][0]))
    other = json.loads(json.dumps(one))
    g = other["arms"]["invariant"]["first_grad_norm"]
    other["arms"]["invariant"]["first_grad_norm"] = math.nextafter(g, math.inf)
    assert ab.summarize({"old": [one], "new": [other]})["same_first_grad_norm"] is False
    assert ab.summarize({"old": [one], "new": [one]})["same_first_grad_norm"] is True


def test_arm_line_gives_the_warm_steps_host_issue_time(tmp_path, monkeypatch, capsys):
    """Each arm's line and JSON give when the host returned from the warm step (the fastest after
    the first) and its share of that step — an upper bound of the host's part (the step syncs on
    the gradient norm before the optimizer, so it is near 100 % on a GPU either way)."""
    import sys
    out = tmp_path / "h.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_train_step.py", "--model", "tiny", "--samples", "2", "--prompt-len", "8",
        "--response-len", "8", "--steps", "3", "--device", "cpu", "--arms", "invariant",
        "--no-kl", "--out", str(out)])
    bench_train_step.main()
    r = json.loads(out.read_text())["arms"]["invariant"]
    warm = min((1, 2), key=lambda i: r["step_s"][i])
    assert r["warm_step_s"] == r["step_s"][warm]
    assert r["warm_host_issue_s"] == r["host_issue_s"][warm] <= r["warm_step_s"]
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("invariant:")][0]
    share = round(100 * r["warm_host_issue_s"] / r["warm_step_s"])
    assert f"host returned after {r['warm_host_issue_s']:.3f} s ({share} % of it)" in line, line


def test_launch_stats_count_each_triton_launch_of_a_step(monkeypatch):
    """--launch-stats wraps Triton's launch path for one step: JITFunction.run (the usual path:
    three launches of one kernel and one of another, counted per kernel name, host time inside
    the wall) and the driver's launcher (every launch; here two direct ones, as
    triton_util.launch makes); both are restored afterwards. Both are stand-ins here (no GPU to
    launch on): run sleeps 1 ms a call."""
    from triton.runtime.jit import JITFunction

    def _one(x):
        pass

    def _two(x):
        pass
    calls = []

    def fake_run(self, *args, grid=None, warmup=False, **kwargs):
        calls.append(self.__name__)
        time.sleep(1e-3)
    monkeypatch.setattr(JITFunction, "run", fake_run)
    one, two = JITFunction(_one), JITFunction(_two)

    def step():
        for _ in range(3):
            one[(1,)](0)
        two[(1,)](0)
    from triton.backends.nvidia.driver import CudaLauncher
    real_call = CudaLauncher.__call__
    driven = []
    monkeypatch.setattr(CudaLauncher, "__call__", lambda self, *a: driven.append(a))
    fake_call = CudaLauncher.__call__

    def direct():                   # as triton_util.launch's direct path: the launcher only
        CudaLauncher.__call__(object.__new__(CudaLauncher), 1, 1, 1, 0, None)

    def step_with_direct():
        step()
        direct()
        direct()
    h = bench_train_step._launch_stats(step_with_direct, torch.device("cpu"))
    assert JITFunction.run is fake_run and calls == ["_one"] * 3 + ["_two"]
    assert CudaLauncher.__call__ is fake_call and len(driven) == 2 and real_call is not fake_call
    assert (h["launches"], h["usual_launches"]) == (2, 4)   # the fake run launches nothing
    assert [(r["kernel"], r["launches"]) for r in h["by_kernel"]] == [("_one", 3), ("_two", 1)]
    assert 4.0 <= h["usual_ms"] <= h["wall_s"] * 1e3 and h["driver_ms"] >= 0
