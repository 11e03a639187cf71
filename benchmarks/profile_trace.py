"""Summary of a torch.profiler (Kineto) Chrome trace: where the host and the device spend a run.

`summarize(events, wall_s, label_prefix)` reads the trace's complete events (times in µs):
  device_s, device_over_wall  CUDA kernel time summed (copies and memsets apart) and its share of
                              the wall time (low: the GPU waits for the host)
  kernels, memcpys, memsets   how many ran
  top_kernels                 by total device time: name (first 100 characters), count, total ms
  top_cpu_ops                 by self host time (the op's time minus its children's): aten ops,
                              record_function labels (self = Python between their ops) and CUDA
                              runtime/driver calls (cudaLaunchKernel ...): name, count, self and
                              total ms
  host_outside_ops_s          the busiest host thread's time inside no recorded op or label
  phases                      per record_function label starting with label_prefix: calls, host
                              ms (its ranges summed), kernels launched inside them and their
                              device ms; "(outside the labels)" holds the other kernels
Does not: handle overlapping labels of that prefix (each kernel goes to the label range its
launch falls in), or split devices or streams (a single-GPU run on one stream is assumed).
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict

_HOST = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
_OUTSIDE = "(outside the labels)"


def load(path: str) -> list[dict]:
    """The trace's events (torch.profiler.profile.export_chrome_trace output)."""
    with open(path) as f:
        return json.load(f)["traceEvents"]


def _top(rows, top: int, key: str) -> list[dict]:
    return sorted(rows, key=lambda r: -r[key])[:top]


def _host_times(events: list[dict]) -> tuple[dict, float]:
    """Per op name: count, self µs, total µs, over all host threads; and the largest top-level
    time of one thread (the thread that ran the work)."""
    threads = defaultdict(list)
    for e in events:
        threads[(e["pid"], e["tid"])].append(e)
    agg = defaultdict(lambda: [0, 0.0, 0.0])
    busiest = 0.0
    for evs in threads.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack, selfs, top_level = [], [], 0.0         # stack: (index into selfs, end µs)
        for e in evs:
            end = e["ts"] + e["dur"]
            while stack and stack[-1][1] <= e["ts"]:
                stack.pop()
            if stack:
                selfs[stack[-1][0]][1] -= min(end, stack[-1][1]) - e["ts"]
            else:
                top_level += e["dur"]
            selfs.append([e, e["dur"]])
            stack.append((len(selfs) - 1, end))
        for e, s in selfs:
            a = agg[e["name"]]
            a[0], a[1], a[2] = a[0] + 1, a[1] + s, a[2] + e["dur"]
        busiest = max(busiest, top_level)
    return agg, busiest


def _phases(xs: list[dict], kernels: list[dict], label_prefix: str) -> dict:
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in xs
                    if e.get("cat") == "user_annotation" and e["name"].startswith(label_prefix))
    starts = [r[0] for r in ranges]
    launch = {e["args"]["correlation"]: e["ts"] for e in xs
              if e.get("cat") in ("cuda_runtime", "cuda_driver")
              and "correlation" in e.get("args", {})}
    out = defaultdict(lambda: {"calls": 0, "host_ms": 0.0, "kernels": 0, "device_ms": 0.0})
    for t0, t1, name in ranges:
        out[name]["calls"] += 1
        out[name]["host_ms"] += (t1 - t0) / 1e3
    for k in kernels:
        ts = launch.get(k.get("args", {}).get("correlation"))
        i = bisect.bisect_right(starts, ts) - 1 if ts is not None else -1
        name = ranges[i][2] if i >= 0 and ts < ranges[i][1] else _OUTSIDE
        out[name]["kernels"] += 1
        out[name]["device_ms"] += k["dur"] / 1e3
    return dict(out)


def summarize(events: list[dict], wall_s: float, label_prefix: str, top: int = 25) -> dict:
    """The summary described in the module doc; wall_s is the profiled region's wall time."""
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in xs if e.get("cat") == "kernel"]
    device_s = sum(e["dur"] for e in kernels) / 1e6
    kagg = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        a = kagg[e["name"][:100]]
        a[0], a[1] = a[0] + 1, a[1] + e["dur"] / 1e3
    host, busiest = _host_times([e for e in xs if e.get("cat") in _HOST])
    return {
        "device_s": device_s,
        "device_over_wall": device_s / wall_s if kernels else None,
        "kernels": len(kernels),
        "memcpys": sum(e.get("cat") == "gpu_memcpy" for e in xs),
        "memsets": sum(e.get("cat") == "gpu_memset" for e in xs),
        "host_outside_ops_s": wall_s - busiest / 1e6,
        "phases": _phases(xs, kernels, label_prefix),
        "top_kernels": _top([{"name": n, "count": c, "total_ms": t}
                                 for n, (c, t) in kagg.items()], top, "total_ms"),
        "top_cpu_ops": _top([{"name": n[:100], "count": c, "self_ms": s / 1e3,
                                  "total_ms": t / 1e3} for n, (c, s, t) in host.items()],
                                top, "self_ms"),
    }


def _idle_gaps(kernels: list[dict], min_us: float) -> list[tuple[float, float]]:
    """The device's idle intervals (µs) of at least min_us between its first and last kernel."""
    spans = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    gaps, end = [], spans[0][1] if spans else 0.0
    for t0, t1 in spans[1:]:
        if t0 - end >= min_us:
            gaps.append((end, t0))
        end = max(end, t1)
    return gaps


def idle_attribution(events: list[dict], min_gap_us: float = 20.0, top: int = 25) -> dict:
    """Where the host was while the device idled: every device gap of at least min_gap_us is
    charged, at its midpoint, to the innermost host op (`by_op`) and to the innermost
    autograd function or record_function label (`by_scope`) running then (µs summed, in ms).
    `idle_ms` is the gaps' total. Does not: split a gap across the ops it spans."""
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in xs if e.get("cat") == "kernel"]
    host = sorted((e for e in xs if e.get("cat") in ("cpu_op", "user_annotation")),
                  key=lambda e: e["ts"])
    starts = [e["ts"] for e in host]
    by_op, by_scope = defaultdict(float), defaultdict(float)
    gaps = _idle_gaps(kernels, min_gap_us)
    longest = max((e["dur"] for e in host), default=0.0)
    for g0, g1 in gaps:
        mid = (g0 + g1) / 2
        lo = bisect.bisect_left(starts, mid - longest)
        hi = bisect.bisect_right(starts, mid)
        live = sorted((e for e in host[lo:hi] if e["ts"] + e["dur"] >= mid),
                      key=lambda e: e["dur"])
        op = live[0]["name"][:80] if live else "(no host op)"
        scope = next((e["name"][:80] for e in live if e.get("cat") == "user_annotation"
                      or e["name"].startswith("autograd::engine")), "(none)")
        by_op[op] += (g1 - g0) / 1e3
        by_scope[scope] += (g1 - g0) / 1e3
    def rows(d: dict) -> list[dict]:
        return [{"name": n, "idle_ms": v} for n, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
    return {"idle_ms": sum(g1 - g0 for g0, g1 in gaps) / 1e3, "gaps": len(gaps),
            "by_op": rows(by_op), "by_scope": rows(by_scope)}
