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
