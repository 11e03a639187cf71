"""The checks behind tests/test_dlogits_triton.py, run in a subprocess with TRITON_INTERPRET=1
(Triton's CPU interpreter must be chosen before triton is imported, and must not leak into the
other tests' process). Each check compares the d-logits kernel (kernels/triton_dlogits.py) with
the torch path on CPU, logprobs._dlogits_by_rows (the reference: `_dlogits` per row chunk, cast
to the output dtype), as integer bits (swiglu_cases.same_bits: −0.0 counts, a NaN's payload
does not), on the inputs of tests/dlogits_cases.py.
What the interpreter shows: the kernel's sequence of IEEE operations (numpy runs each one,
correctly rounded, as typed) is the torch path's. What it cannot: code generation (fma
contraction, flush-to-zero, the division's lowering): the PTX test in tests/test_dlogits_triton.py
checks that; the GPU run, tests/test_cuda_backward.py.
Prints one JSON object {check name: "ok" or the failure}: the named checks, or all.
Run by hand: TRITON_INTERPRET=1 .venv/bin/python tests/dlogits_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("dlogits_triton_checks.py needs TRITON_INTERPRET=1")

import triton
import triton.language as tl
import triton_interpreter_compat  # noqa: F401 - numpy >= 2.3: before any launch
from dlogits_cases import dlogits_case
from kernel_helpers import LaunchRecorder, run_checks
from swiglu_cases import describe_diff, gate_values, same_bits

from rlkernel.kernels import triton_dlogits as td
from rlkernel.kernels.logprobs import _dlogits_by_rows
from rlkernel.kernels.triton_elementwise import bf16_rtne, exp32, neg32

CHECKS = {}
# numpy warns where the torch path also computes and then discards or keeps an IEEE special:
# p·(logp + ent) = 0·(−inf) under the p > 0 select, Inf − Inf, overflow to ±Inf.
warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)

V = 1000                       # not a multiple of the vocab block (512)
TEMPERATURES = (1.0, 0.7, 1e-3)
DTYPES = (torch.float32, torch.bfloat16)


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _want(case, temperature, dtype, with_ent=True):
    """The torch path on CPU: logprobs._dlogits_by_rows over the case's z."""
    _, z, tg, lse, ent, g_lp, g_ent = case
    return _dlogits_by_rows(lambda a, b: z[a:b], z.shape[1], tg, lse, ent, g_lp,
                            g_ent if with_ent else None, temperature, dtype)


def _got(case, temperature, dtype, with_ent=True, from_logits=False, live=None, **launch):
    logits, z, tg, lse, ent, g_lp, g_ent = case
    out = torch.empty(z.shape, dtype=dtype)
    return td.dlogits(logits if from_logits else z, tg, lse, ent, g_lp,
                      g_ent if with_ent else None, temperature, out, from_logits=from_logits,
                      live_vocab=live, **launch)


def _same(got, want, what):
    assert same_bits(got, want), f"{what}: {describe_diff(got.float(), want.float())}"


@check
def equals_torch_path_over_temperatures_masks_entropy_and_dtypes():
    """T ∈ {1, 0.7, 1e-3} × live_vocab ∈ {V, V − 37} × g_ent given / None × fp32 / bf16 out,
    on the special rows of dlogits_cases and random rows of scales 0.1 … 300 (N = 24)."""
    for t in TEMPERATURES:
        for live in (None, V - 37):
            case = dlogits_case(24, V, t, live, seed=1)
            for with_ent in (True, False):
                for dt in DTYPES:
                    _same(_got(case, t, dt, with_ent), _want(case, t, dt, with_ent),
                          f"T={t} live={live} ent={with_ent} {dt}")


@check
def the_cases_reach_every_branch():
    """The reference output of the T = 0.7, masked case holds what the cases are for: +0 and −0
    at masked ids, zeros at live ids (p underflow), fp32 subnormals, ±Inf and NaN."""
    case = dlogits_case(24, V, 0.7, V - 37, seed=1)
    want = _want(case, 0.7, torch.float32)
    bits = want.view(torch.int32)
    masked = bits[:, V - 37:]
    assert bool((masked == 0).any()) and bool((masked == -(1 << 31)).any()), "±0 at masked ids"
    assert bool((want[:, :V - 37] == 0).any()), "no underflowed p at a live id"
    sub = (want != 0) & (want.abs() < 2.0**-126)
    assert bool(sub.any()), "no subnormal d logit"
    assert bool((want == float("inf")).any()) and bool((want == -float("inf")).any()), "no ±Inf"
    assert bool(want.isnan().any()), "no NaN"


@check
def from_logits_equals_div_t_then_torch_path():
    """from_logits=True (the kernel forms z = _div_t(logits, T, live_vocab)) == the torch path
    on _div_t's z, for each T and live_vocab, fp32 and bf16."""
    for t in TEMPERATURES:
        for live in (None, V - 37, 1):
            case = dlogits_case(20, V, t, live, seed=2)
            for dt in DTYPES:
                _same(_got(case, t, dt, from_logits=True, live=live), _want(case, t, dt),
                      f"from logits T={t} live={live} {dt}")


@check
def one_row_tiny_vocabularies_and_empty():
    """N = 1 (random rows: no specials) at V = 1000, 1, 3, 513; N = 0 writes nothing."""
    for n, v in ((1, 1000), (1, 1), (3, 3), (5, 513)):
        case = dlogits_case(n, v, 0.7, seed=3)
        for dt in DTYPES:
            _same(_got(case, 0.7, dt), _want(case, 0.7, dt), f"N={n} V={v} {dt}")
    e = torch.empty(0)
    out = torch.empty(0, 7)
    assert td.dlogits(torch.empty(0, 7), e.long(), e, e, e, None, 0.7, out) is out


@check
def launch_shapes_and_strides_give_the_same_bytes():
    """block (rows × ids, warps) 1 × 256 × 1 and 8 × 1024 × 8 == the default launch; z
    as a column slice of a wider buffer (row stride > V) or transposed (copied), out as a row
    slice or a column slice of a larger buffer: the torch path's bytes."""
    case = dlogits_case(20, V, 0.7, V - 5, seed=4)
    _, z, tg, lse, ent, g_lp, g_ent = case
    want = _want(case, 0.7, torch.float32)
    for br, bv, w in ((1, 256, 1), (8, 1024, 8)):
        _same(_got(case, 0.7, torch.float32, block_r=br, block_v=bv, num_warps=w), want,
              (br, bv, w))
    for dt in DTYPES:
        want = _want(case, 0.7, dt)
        wide = torch.full((20, V + 24), 7.0)
        wide[:, 3:V + 3] = z
        zt = z.t().contiguous().t()                                  # strides (1, 20)
        for zz in (wide[:, 3:V + 3], zt):
            out = td.dlogits(zz, tg, lse, ent, g_lp, g_ent, 0.7, torch.empty(20, V, dtype=dt))
            _same(out, want, f"z strides {zz.stride()}")
        big = torch.zeros(27, V + 9, dtype=dt)
        td.dlogits(z, tg, lse, ent, g_lp, g_ent, 0.7, big[5:25, 4:V + 4])
        _same(big[5:25, 4:V + 4], want, "out a slice")
        assert not big[:5].any() and not big[25:].any() and not big[:, :4].any() \
            and not big[:, V + 4:].any(), "wrote outside out"
        g_exp = g_lp[:1].expand(20)                                  # autograd's expanded grads
        want_e = _dlogits_by_rows(lambda a, b: z[a:b], V, tg, lse, ent, g_exp, g_ent, 0.7, dt)
        _same(td.dlogits(z, tg, lse, ent, g_exp, g_ent, 0.7, torch.empty(20, V, dtype=dt)),
              want_e, "expanded g_lp")


@triton.jit
def _round_kernel(X, Y, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + o, bf16_rtne(tl.load(X + o, mask=o < n)), mask=o < n)


@check
def bf16_rounding_is_torch_cpu_cast():
    """triton_elementwise.bf16_rtne == torch's fp32 -> bf16 cast on CPU: the SwiGLU gate values
    (±0, subnormals, ±max, ±Inf, NaNs, random bit patterns), every rounding tie and its
    neighbours (low 16 bits 0x7FFF / 0x8000 / 0x8001, both parities) and the overflow edge."""
    ties = torch.randint(-2**15, 2**15, (512,), generator=torch.Generator().manual_seed(5))
    ties = (ties.to(torch.int32) << 16)
    edge = torch.tensor([0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x00008000, 0x00018000,
                         0x0000FFFF], dtype=torch.int32)
    x = torch.cat([gate_values(5)] + [(ties + d).view(torch.float32)
                                      for d in (0x7FFF, 0x8000, 0x8001, 0x18000)]
                  + [edge.view(torch.float32), -edge.view(torch.float32)])
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    _same(y, x.to(torch.bfloat16), "bf16 rounding")


@check
def bad_arguments_are_refused():
    case = dlogits_case(4, 8, 1.0, seed=6)
    _, z, tg, lse, ent, g_lp, g_ent = case
    good = {"z": z, "targets": tg, "lse": lse, "ent": ent, "g_lp": g_lp, "g_ent": g_ent,
            "temperature": 1.0, "out": torch.empty(4, 8)}
    bad = [{"z": z.double()}, {"z": z[0]}, {"targets": tg.int()}, {"targets": tg[:3]},
           {"lse": lse.double()}, {"g_ent": g_ent[:3]}, {"out": torch.empty(4, 8).half()},
           {"out": torch.empty(4, 9)}, {"out": torch.empty(8, 4).t()}]
    for b in bad:
        try:
            td.dlogits(**{**good, **b})
        except ValueError:
            continue
        raise AssertionError(f"accepted {list(b)}")


@check
def launch_disables_fp_fusion():
    rec = LaunchRecorder(td._dlogits_kernel)
    td._dlogits_kernel = rec
    try:
        _got(dlogits_case(2, 8, 1.0, seed=7), 1.0, torch.float32)
    finally:
        td._dlogits_kernel = rec.kernel
    assert [kw.get("enable_fp_fusion") for _, kw in rec.launches] == [False]


@triton.jit
def _exp_fp32(x):
    return tl.exp(x)                                  # in place of exp32


@triton.jit
def _neg_unary(x):
    return -x                                         # Triton's 0 − x: +0 where torch gives −0


@triton.jit
def _dz_reassociated(z, hit, lse, ent, g_lp, g_ent, temp, HAS_ENT: tl.constexpr):
    logp = z - lse
    p = exp32(logp)
    dz = neg32(g_lp * p)
    dz = tl.where(hit, dz + g_lp, dz)
    if HAS_ENT:                                       # (g_ent·p)·(logp + ent)
        dz = dz - tl.where(p > 0, (g_ent * p) * (logp + ent), 0.0)
    return tl.math.div_rn(dz, temp)


_DZ = td._dz                                          # the kernel's, for the fake below


@triton.jit
def _dz_reciprocal_t(z, hit, lse, ent, g_lp, g_ent, temp, HAS_ENT: tl.constexpr):
    # dz / 1 is dz, exactly; then torch's CUDA x / T: x·(1/T)
    return _DZ(z, hit, lse, ent, g_lp, g_ent, 1.0, HAS_ENT) * tl.math.div_rn(1.0, temp)


@check
def negative_control_other_formulas_differ():
    """The check can fail: exp in fp32 (tl.exp in place of exp32), −x as Triton's 0 − x (in
    place of neg32: the masked ids' −0 become +0), and in place of the kernel's `_dz` the
    entropy term as (g_ent·p)·(logp + ent) or dz·(1/T) for dz / T, each give other bytes than
    the torch path (T = 0.7, live V − 37, fp32); restored, the kernel matches again."""
    case = dlogits_case(24, V, 0.7, V - 37, seed=1)
    want = _want(case, 0.7, torch.float32)
    real = {name: getattr(td, name) for name in ("exp32", "neg32", "_dz")}
    try:
        for name, fake in (("exp32", _exp_fp32), ("neg32", _neg_unary),
                           ("_dz", _dz_reassociated), ("_dz", _dz_reciprocal_t)):
            setattr(td, name, fake)
            assert not same_bits(_got(case, 0.7, torch.float32), want), fake.__name__
            setattr(td, name, real[name])
    finally:
        for name, fn in real.items():
            setattr(td, name, fn)
    _same(_got(case, 0.7, torch.float32), want, "restored")


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
