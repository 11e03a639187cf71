"""Diagnostic (2 GPUs): where CP2 / TP2+SP weight gradients leave TP1's bytes on CUDA.

    PYTHONPATH=.:tests python3 tests/diag_cuda_cp.py [cuda|cpu] OUT_DIR

Per rank, every fixedpoint.accumulate_ call is checked against the same add done on the CPU
(stage A: is the device accumulate_ exact?), sink accumulators get a CPU shadow (stage L: do
the leaf partials' exact sums over ranks equal TP1's?), and each attention dK/dV token sum
(`_sum_over_queries`) is recorded (stage Q: per layer, does it equal TP1's?).
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import tempfile

import torch

from rlkernel.distributed import tokensum as ts
from rlkernel.kernels import attention as att
from rlkernel.numerics import fixedpoint as fx

REC: dict = {"a_bad": [], "shadow": {}, "acc": {}, "q": [], "calls": 0}


def _install() -> None:
    if getattr(fx, "_diag2", False):
        return
    fx._diag2 = True
    orig_acc, orig_get, orig_finish = fx.accumulate_, ts.GradSink.accumulator, ts.GradSink.finish
    orig_soq = att._sum_over_queries
    bases: dict[int, tuple[str, torch.Tensor]] = {}

    def accumulator(self, w, scope):
        a = orig_get(self, w, scope)
        name = self._names[id(w)]
        bases[a.data_ptr()] = (name, a)
        if name not in REC["shadow"]:
            REC["shadow"][name] = fx.zeros(a.shape[:-1])
        return a

    def accumulate_(acc, x):
        before = acc.detach().cpu().clone()
        xc = x.detach().to(torch.float32).cpu().clone()
        out = orig_acc(acc, x)
        REC["calls"] += 1
        want = orig_acc(before.clone(), xc)
        got = fx.normalise_(acc.detach().cpu().clone())
        if not torch.equal(got, fx.normalise_(want)):
            if len(REC["a_bad"]) < 4:
                REC["a_bad"].append({"x": xc, "before": before, "got": got, "want": want})
            else:
                REC["a_bad"].append(None)
        for ptr, (name, base) in bases.items():
            if base.data_ptr() == ptr and ptr <= acc.data_ptr() < ptr + base.numel() * 8:
                first = (acc.data_ptr() - ptr) // (8 * fx.N_COLS)
                m = acc[..., 0].numel()
                orig_acc(REC["shadow"][name].view(-1, fx.N_COLS)[first:first + m], xc.reshape(xc.shape[0], -1))
                break
        return out

    def finish(self):
        REC["acc"] = {n: a.cpu().clone() for n, a in self._acc.items()}
        REC.setdefault("accs", []).append(REC["acc"])
        REC.setdefault("shadows", []).append({n: s.clone() for n, s in REC["shadow"].items()})
        REC["shadow"] = {}
        bases.clear()
        return orig_finish(self)

    def soq(w, x, q_pos, tok):
        r = orig_soq(w, x, q_pos, tok)
        REC["q"].append(r.detach().cpu().clone())
        return r

    fx.accumulate_ = accumulate_
    ts.GradSink.accumulator = accumulator
    ts.GradSink.finish = finish
    att._sum_over_queries = soq


def probe_rec(rank, cfg, job, out_dir):
    _install()
    import topology_probe
    topology_probe.probe(rank, cfg, job, out_dir)
    with open(f"{out_dir}/rec{rank}.pkl", "wb") as f:
        pickle.dump({k: REC[k] for k in ("a_bad", "accs", "shadows", "q", "calls") if k in REC}, f)


def _layout(job, tp, cp, sp, device):
    from rlkernel.config import RunConfig
    from rlkernel.distributed.launch import launch
    cfg = RunConfig(dp=1, tp=tp, cp=cp, sp=sp, mode="invariant", dtype="fp32", device=device,
                    n_prompts=len(job.samples), n_samples_per_prompt=1)
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as d:
        launch(probe_rec, (cfg, job, d), world_size=tp * cp, backend=backend, timeout_s=300)
        recs, outs = [], []
        for r in range(tp * cp):
            with open(f"{d}/rec{r}.pkl", "rb") as f:
                recs.append(pickle.load(f))
            with open(f"{d}/rank{r}.pkl", "rb") as f:
                outs.append(pickle.load(f))
    return recs, outs


def _val(a):
    return fx.normalise_(a.clone())


def _bits(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32),
                                              b.contiguous().view(torch.int32))


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    out_dir = sys.argv[2] if len(sys.argv) > 2 else "."
    _install()
    from test_topology import JOB
    from topology_probe import single_process
    job = dataclasses.replace(JOB, steps=1)
    base_out = single_process(job, device=device)
    base = {k: REC[k] for k in ("a_bad", "accs", "shadows", "q", "calls")}
    print(f"TP1: {base['calls']} accumulate_ calls, A-bad {len(base['a_bad'])}, "
          f"{len(base['accs'])} sink finishes, {len(base['q'])} dK/dV sums")
    dump = {"tp1": base}
    for label, (tp, cp, sp) in {"CP2": (1, 2, False), "TP2+SP": (2, 1, True)}.items():
        recs, outs = _layout(job, tp, cp, sp, device)
        gb = base_out["steps"][0]["grads"]
        g = outs[0]["steps"][0]["grads"]
        bad_g = [n for n in gb if not _bits(g[n], gb[n])]
        print(f"{label}: {len(bad_g)}/{len(gb)} grads differ: {bad_g}")
        for n in bad_g:
            d = (g[n] - gb[n]).abs()
            print(f"   {n}: {int((d > 0).sum())} elems differ, max |diff| {d.max().item():.3e}, "
                  f"max |g| {gb[n].abs().max().item():.3e}")
        for rk, r in enumerate(recs):
            print(f"  rank{rk}: {r['calls']} calls, A-bad {len(r['a_bad'])}")
        # L: per finish, exact sum over ranks of the shadows vs TP1's shadow
        for i, shb in enumerate(base["shadows"]):
            lbad = []
            for n, s in shb.items():
                parts = [r["shadows"][i].get(n) for r in recs]
                if any(p is None or p.shape != s.shape for p in parts):
                    continue
                tot = sum(parts[1:], parts[0].clone())
                if not torch.equal(_val(tot), _val(s)):
                    lbad.append(n)
            print(f"  L finish {i}: partial sums differ from TP1 for {lbad}")
            # device acc vs own shadow
            for rk, r in enumerate(recs):
                sbad = [n for n, a in r["accs"][i].items()
                        if n in r["shadows"][i] and not torch.equal(_val(a), _val(r["shadows"][i][n]))]
                if sbad:
                    print(f"  rank{rk} finish {i}: device acc != shadow for {sbad}")
        if cp > 1:
            qb, q0, q1 = base["q"], recs[0]["q"], recs[1]["q"]
            print(f"  Q: {len(qb)} TP1 dK/dV sums, {len(q0)}/{len(q1)} on ranks")
            for i, (a, b) in enumerate(zip(qb, q0)):
                same = a.shape == b.shape and _bits(a, b)
                r1 = i < len(q1) and q1[i].shape == b.shape and _bits(q1[i], b)
                if not same or not r1:
                    info = ""
                    if a.shape == b.shape:
                        dd = (a - b).abs()
                        idx = (dd > 0).nonzero()
                        info = f"{int((dd > 0).sum())} differ, max {dd.max().item():.3e}, first idx {idx[:4].tolist()}"
                    print(f"   sum {i}: shape TP1 {tuple(a.shape)} rank0 {tuple(b.shape)} "
                          f"ranks-equal {r1} {info}")
        dump[label] = recs
    with open(os.path.join(out_dir, "diag_cuda_cp.pkl"), "wb") as f:
        pickle.dump(dump, f)


if __name__ == "__main__":
    import diag_cuda_cp
    diag_cuda_cp.main()
