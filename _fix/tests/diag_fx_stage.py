"""Which stage of fixedpoint._add_chunk differs between CUDA and CPU (first bad call of TP1)."""
from __future__ import annotations

import dataclasses
import sys

import torch

import diag_cuda_cp as d
from rlkernel.numerics import fixedpoint as fx


def stages(flat, x):
    k, m = x.shape
    out = {}
    bits = x.contiguous().view(torch.int32)
    b = (bits >> (23 + 4)) & (fx._N_BINS - 1)
    out["b"] = b
    idx = torch.arange(0, m * fx._N_BINS, fx._N_BINS, device=x.device, dtype=torch.int64) + b
    bins = torch.zeros(m * fx._N_BINS, dtype=torch.float64, device=x.device)
    bins.index_add_(0, idx.reshape(-1), x.to(torch.float64).reshape(-1))
    out["bins"] = bins
    bins2 = torch.zeros(m * fx._N_BINS, dtype=torch.float64, device=x.device)
    for r in range(k):   # row by row: no duplicate index within one index_add_
        bins2.index_add_(0, idx[r], x[r].to(torch.float64))
    out["bins_rowwise"] = bins2
    bins = bins.view(m, fx._N_BINS)
    for j in (bins != 0).any(0).nonzero().flatten().tolist():
        s = bins[:, j]
        unit = max(fx._BIN_FIELDS * j, 1) - 150
        out[f"ldexp{j}"] = torch.ldexp(s, torch.tensor(float(-unit), dtype=torch.float64))
        out[f"mul{j}"] = s * (2.0 ** -unit)
    return out


def main():
    d._install()
    from test_topology import JOB
    from topology_probe import single_process
    torch.manual_seed(0)
    print("deterministic:", torch.are_deterministic_algorithms_enabled())
    single_process(dataclasses.replace(JOB, steps=1), device="cuda")
    bad = [a for a in d.REC["a_bad"] if a is not None]
    print("bad calls", len(d.REC["a_bad"]))
    a = bad[0]
    x = a["x"].reshape(a["x"].shape[0], -1)
    m = x.shape[1]
    rows = max(1, min(fx._BIN_ROWS, fx._CHUNK // m))
    xs = x[:rows]
    flat = torch.zeros(m, fx.N_COLS, dtype=torch.int64)
    c = stages(flat, xs)
    g = stages(flat.cuda(), xs.cuda())
    for key in c:
        same = torch.equal(c[key], g[key].cpu())
        print(key, "same" if same else "DIFFERENT", "" if same else
              f"{int((c[key] != g[key].cpu()).sum())} elems")
    # with deterministic algorithms on and off
    for det in (False, True):
        torch.use_deterministic_algorithms(det)
        g = stages(flat.cuda(), xs.cuda())
        print("det", det, "bins same:", torch.equal(c["bins"], g["bins"].cpu()),
              "ldexp same:", all(torch.equal(c[k], g[k].cpu()) for k in c if k.startswith("ldexp")))
    # random data check
    torch.manual_seed(1)
    r = torch.randn(4096, 513) * torch.exp2(torch.randint(-30, 10, (4096, 513)).float())
    a1 = fx.accumulate_(fx.zeros((513,)), r)
    a2 = fx.accumulate_(fx.zeros((513,), "cuda"), r.cuda()).cpu()
    print("random accumulate cpu==cuda:", torch.equal(fx.normalise_(a1), fx.normalise_(a2)))


if __name__ == "__main__":
    main()
