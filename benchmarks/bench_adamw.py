"""One AdamW step over a model's parameter shapes: the fused Triton kernel
(kernels/triton_adamw.py, what AdamW.step runs on CUDA) vs the torch ops it replaces
(AdamW._step_torch: 13-14 launches per tensor) vs torch.optim.AdamW(fused=True) (reference speed
only: its own fused update, other bytes).

Shapes: rlkernel.model.config.param_shapes of the preset (qwen3-1.7b: 310 tensors, 1.72 B fp32
elements: 6.9 GB per fp32 copy; gradients plus two AdamW states ≈ 48 GB, ≈ 69 GB with --sweep).
Before timing, the kernel's p, m, v after one step are compared bytewise (int32 views) with the
torch ops' from the same state and the differing elements counted (the kernel rounds every op
correctly; torch's CUDA ops do not quite), and each torch CUDA op of the update is compared
with its correctly rounded result (float64, rounded once) on 4 M values: which op differs.
GB/s counts 28 bytes per element
(read p, g, m, v; write p, m, v), the least any one-pass update moves. `--sweep` also times
other (BLOCK, num_warps) launch shapes, each byte-checked (bytes cannot depend on the shape: every
element is its own computation).
Run (repository root, CUDA machine, ~1 min): PYTHONPATH=. python3 benchmarks/bench_adamw.py
    [--preset NAME] [--sweep] [--out FILE.json]
`--device cpu` is a smoke mode (a small preset, wall-clock medians): AdamW.step there is the
CPU path (kernels/adamw.adamw_rounded_: float64 ops rounded once per op, the kernel's bytes)
beside the torch ops and torch.optim.AdamW; no Triton arm. Does not: time clipping, the gradient
norm, or ZeRO's gather.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.common import cpu_median_ms, dump, env, median_ms, require_cuda
from rlkernel.model.config import param_shapes, preset
from rlkernel.train.optimizer import AdamW, AdamWParams

HP = AdamWParams(lr=3e-4, weight_decay=0.1)
SWEEP = ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 16))


def shapes(name: str) -> dict[str, tuple[int, ...]]:
    """The preset's parameter shapes by name (config.param_shapes)."""
    return param_shapes(preset(name))


def _tensors(sh: dict, device: str, seed: int, scale: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return {n: torch.randn(s, generator=gen, device=device) * scale for n, s in sh.items()}


def _n_diff(a: AdamW, b: AdamW) -> dict[str, int]:
    """Elements whose bytes differ, per state (master, exp_avg, exp_avg_sq), over all tensors."""
    return {k: sum(int((getattr(a, k)[n].view(torch.int32)
                        != getattr(b, k)[n].view(torch.int32)).sum()) for n in a.master)
            for k in ("master", "exp_avg", "exp_avg_sq")}


def _same_state(a: AdamW, b: AdamW) -> bool:
    return not any(_n_diff(a, b).values())


def _op_deviations(n: int = 1 << 22) -> dict[str, int]:
    """How many of n values each torch CUDA op of the update gives other bits than its correctly
    rounded result (the op in float64 on the same fp32 operands, rounded once to fp32)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(n, device="cuda", generator=g)
    b = torch.randn(n, device="cuda", generator=g).abs() + 1e-3
    v = a.square() * 1e-6
    rn = lambda f, *xs: f(*(x.double() for x in xs)).float()   # noqa: E731
    cases = {"sqrt(v)": (torch.sqrt(v), rn(torch.sqrt, v)),
             "m / d": (a / b, rn(torch.div, a, b)),
             "x * python scalar": (a * 0.999,
                                   rn(torch.mul, a, torch.tensor(0.999, device="cuda").float())),
             "x + y": (a + b, rn(torch.add, a, b))}
    return {k: int((x.view(torch.int32) != y.view(torch.int32)).sum())
            for k, (x, y) in cases.items()}


def _torch_optim(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], fused: bool):
    """torch.optim.AdamW over `params` (their .grad set to `grads`): its step function."""
    for n, p in params.items():
        p.grad = grads[n]
    opt = torch.optim.AdamW(list(params.values()), lr=HP.lr, betas=(HP.beta1, HP.beta2),
                            eps=HP.eps, weight_decay=HP.weight_decay, fused=fused)
    return opt.step


def _sweep(fused: AdamW, ref: AdamW, grads: dict) -> list[dict]:
    """Each launch shape: one step from ref's state == the default launch's step, then timed."""
    from rlkernel.kernels import triton_adamw as ta
    saved = ta.BLOCK, ta.NUM_WARPS
    nxt = AdamW(ref.master, HP)
    nxt.load_state(ref.master, ref.exp_avg, ref.exp_avg_sq, ref.steps)
    nxt.step(grads)
    rows = []
    try:
        for block, warps in SWEEP:
            ta.BLOCK, ta.NUM_WARPS = block, warps
            fused.load_state(ref.master, ref.exp_avg, ref.exp_avg_sq, ref.steps)
            fused.step(grads)
            same = _same_state(fused, nxt)
            rows.append({"block": block, "num_warps": warps, "same_bytes": same,
                         "ms": median_ms(lambda: fused.step(grads))})
            print(rows[-1], flush=True)
    finally:
        ta.BLOCK, ta.NUM_WARPS = saved
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=None, help="default qwen3-1.7b (cuda), tiny (cpu)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    if cuda:
        require_cuda()
        info = env()
    else:
        info = {"device": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads()}
    name = a.preset or ("qwen3-1.7b" if cuda else "tiny")
    sh = shapes(name)
    numel = sum(math.prod(s) for s in sh.values())
    print(f"{info} | {name}: {len(sh)} tensors, {numel:,} elements", flush=True)
    timer = median_ms if cuda else cpu_median_ms
    grads = _tensors(sh, a.device, 1, 1e-3)
    init = _tensors(sh, a.device, 0, 0.02)
    ops, fused = AdamW(init, HP), AdamW(init, HP)
    del init
    out = {"env": info, "preset": name, "tensors": len(sh), "elements": numel, "rows": []}
    ops._step_torch(grads)
    fused.step(grads)
    out["differing_elements_vs_torch_ops"] = _n_diff(fused, ops)
    arm = "fused kernel" if cuda else "float64 ops rounded per op"
    print(f"{arm} vs torch ops after one step, differing elements: "
          f"{out['differing_elements_vs_torch_ops']}", flush=True)
    if cuda:
        out["torch_cuda_op_deviations_of_4M"] = _op_deviations()
        print(f"torch CUDA ops vs correctly rounded, of 4M values: "
              f"{out['torch_cuda_op_deviations_of_4M']}", flush=True)
        if a.sweep:
            out["sweep"] = _sweep(fused, ops, grads)
    out["rows"].append({"arm": f"{arm} (AdamW.step)", "ms": timer(lambda: fused.step(grads))})
    del fused
    out["rows"].append({"arm": "torch ops (AdamW._step_torch)",
                        "ms": timer(lambda: ops._step_torch(grads))})
    step = _torch_optim(ops.master, grads, fused=True)
    out["rows"].append({"arm": "torch.optim.AdamW(fused=True) (other bytes)", "ms": timer(step)})
    for r in out["rows"]:
        r["GB_per_s"] = 28 * numel / (r["ms"] * 1e-3) / 1e9
        print(f"{r['arm']}: {r['ms']:.3f} ms ({r['GB_per_s']:.0f} GB/s at 28 B/element)",
              flush=True)
    dump(a.out, out)
    return out


if __name__ == "__main__":
    main()
