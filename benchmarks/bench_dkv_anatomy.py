"""Where the attention backward's dK/dV time goes (issue 11, item 2): variants of
rlkernel/kernels/triton_attention_bwd.py that keep its loops and tiles but change one part,
built from the production module's source text (one substitution each, imported from a
temporary file so Triton can read the kernel's source) and timed in one process on the same
operands (bf16, Qwen3-8B heads 32/8, D = 128, one causal sequence):

- `full`: the production module (its table's tile);
- `cvt_add`: each leaf partial converted to float64 and added plainly (no exactness check);
- `asm_check`: the first pass's exactness test as one PTX block (bench_dw_anatomy's
  `check_asm_tma`: the comparisons joined by `setp`'s `.or`, one select; the same words);
- `mma`: the leaf partials summed in fp32 (no float64 in the loop: loads, dots, exp only);
- `leaf128`: the production kernel with 128-query leaf partials (CUDA_DKV_LEAF = 128: half the
  float64 adds and conversions, dots of K = 128 — another sum than the spec's);
- `leaf128_w8`: `leaf128` at 8 warps (the [64, 128] score tiles take twice the registers).
Only `full`, `asm_check` and `leaf128*` compute exact sums (`leaf128` of other partials, so
other bytes);
the others are speed probes. SDPA flash's backward is the scale. The whole backward is timed
(dQ and delta included: the same kernels in every variant); `dq_delta_ms` is theirs alone.
Run (repository root, one GPU, ~2 min): PYTHONPATH=. python3 benchmarks/bench_dkv_anatomy.py
    [--lengths 4096,8192] [--variants full,mma] [--out FILE.json]
Does not: run without CUDA. Speed only; nothing here is used by the model.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import math
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.bench_attention import HKV, HQ, D, _bwd_case, _sdpa_bwd, _timed
from benchmarks.common import dump, env, require_cuda

_FIRST_PASS = "hi = tfx.add_exact_or_nan(hi, part.to(tl.float64))"
_RETRY = "hi, lo, n_inexact = tfx.add_word_checked(hi, lo, n_inexact, part.to(tl.float64))"
_LEAF_IMPORT = "from rlkernel.spec import CUDA_ATTN_KV_BLOCK, CUDA_DKV_LEAF"
VARIANTS = {
    "full": ([], None),
    "cvt_add": ([(_FIRST_PASS, "hi = hi + part.to(tl.float64)")], None),
    "mma": ([(_FIRST_PASS, "hi = hi + part"), (_RETRY, "hi = hi + part"),
             ("hi = tl.zeros((BLOCK_N, DT), dtype=tl.float64)",
              "hi = tl.zeros((BLOCK_N, DT), dtype=tl.float32)"),
             ("lo = tl.zeros((BLOCK_N, DT), dtype=tl.float64)",
              "lo = tl.zeros((BLOCK_N, DT), dtype=tl.float32)")], None),
    "asm_check": ([(_LEAF_IMPORT, _LEAF_IMPORT + "\nfrom benchmarks.bench_dw_anatomy import "
                                 "_add_exact_or_nan_asm"),
                   (_FIRST_PASS, "hi = _add_exact_or_nan_asm(hi, part.to(tl.float64))")], None),
    "leaf128": ([(_LEAF_IMPORT, "from rlkernel.spec import CUDA_ATTN_KV_BLOCK\n"
                                "CUDA_DKV_LEAF = 128")], None),
    "leaf128_w8": ([(_LEAF_IMPORT, "from rlkernel.spec import CUDA_ATTN_KV_BLOCK\n"
                                   "CUDA_DKV_LEAF = 128")], (64, 128, 8, 1)),
}


def _variant_module(name: str, subs, tmp: Path):
    """The production module with `subs` (old, new) applied, imported from a file in tmp."""
    from rlkernel.kernels import triton_attention_bwd as tb
    src = inspect.getsource(tb)
    for old, new in subs:
        if src.count(old) != 1:
            raise ValueError(f"{name}: {old!r} occurs {src.count(old)} times")
        src = src.replace(old, new)
    path = tmp / f"dkv_variant_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="4096,8192")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out")
    args = ap.parse_args()
    require_cuda()
    from rlkernel.kernels import triton_attention_bwd as tb
    torch.manual_seed(0)
    sc = 1 / math.sqrt(D)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        mods = {n: _variant_module(n, VARIANTS[n][0], Path(d)) for n in args.variants.split(",")}
        for t in (int(x) for x in args.lengths.split(",")):
            q, k, v, pos, lens, out, lse, dout = _bwd_case(HQ, HKV, t, torch.bfloat16)
            ref = tb.attention_backward(q, k, v, out, lse, dout, pos, lens, sc)
            row = {"tokens": t, "sdpa_bf16_ms": _timed(_sdpa_bwd(q, k, v, dout)[0]),
                   "dq_delta_ms": _timed(lambda: tb._dq(
                       q, k, v, dout, lse.reshape(1, HQ, t), tb._delta(out, dout, pos), pos,
                       lens, sc, None))}
            for name, mod in mods.items():
                kw = {"kv_tile": VARIANTS[name][1]} if VARIANTS[name][1] else {}
                try:
                    got = mod.attention_backward(q, k, v, out, lse, dout, pos, lens, sc, **kw)
                    row[f"{name}_same_bytes"] = all(
                        torch.equal(a.view(torch.int16), b.view(torch.int16))
                        for a, b in zip(got, ref))
                    row[f"{name}_ms"] = _timed(lambda: mod.attention_backward(
                        q, k, v, out, lse, dout, pos, lens, sc, **kw), rep_ms=100)
                except Exception as e:  # noqa: BLE001  (a variant that does not compile)
                    row[f"{name}_error"] = repr(e)[:300]
                print(t, name, {k_: v_ for k_, v_ in row.items() if k_.startswith(name)},
                      flush=True)
            rows.append(row)
            print(row, flush=True)
            del q, k, v, out, lse, dout, ref
            torch.cuda.empty_cache()
    dump(args.out, {"env": env(), "rows": rows})


if __name__ == "__main__":
    main()
