"""The checks behind tests/test_logprobs_finish_triton.py, run in a subprocess with
TRITON_INTERPRET=1 (Triton's CPU interpreter must be chosen before triton is imported, and must
not leak into the other tests' process). Each check compares the finish kernel
(kernels/triton_logprobs.finish_stats) with the torch path on CPU (tests/logprobs_finish_cases
.finish_want: merge_shard_stats, lse = m + log32(s), entropy = lse − t/s) as int32 bits
(swiglu_cases.same_bits: −0.0 counts, a NaN's payload and sign do not — the torch path's NaN
bits depend on which operand x86 propagates, a GPU returns its canonical NaN), on the stats of
tests/logprobs_finish_cases.py and on real shard statistics of random logits.
What the interpreter shows: the kernel's sequence of IEEE operations (numpy runs each one,
correctly rounded, as typed) and its tree are the torch path's. What it cannot: code generation
(fma contraction, flush-to-zero, the division's lowering, max's NaN rule): the PTX test in
tests/test_logprobs_finish_triton.py checks that; the GPU run, tests/test_cuda.py.
Prints one JSON object {check name: "ok" or the failure}: the named checks, or all.
Run by hand: TRITON_INTERPRET=1 .venv/bin/python tests/logprobs_finish_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import sys
import warnings

import torch
from kernel_helpers import LaunchRecorder, bits, interpreted_checks, run_checks

CHECKS, check = interpreted_checks(__file__)

import triton  # after the TRITON_INTERPRET check
import triton.language as tl
import triton_interpreter_compat  # noqa: F401 - numpy >= 2.3: before any launch
from logprobs_finish_cases import SPECIAL_ROWS, finish_case, finish_want
from swiglu_cases import describe_diff, same_bits

from rlkernel.kernels import elementwise as ew
from rlkernel.kernels import triton_elementwise as tew
from rlkernel.kernels import triton_logprobs as tlp
from rlkernel.kernels.logprobs import _div_t, _finish_stats, _shard_stats

# numpy warns where the torch path computes the same IEEE specials (Inf − Inf, 0·Inf, 0/0,
# overflow to ±Inf, a NaN cast to int64 in exp64 whose result is then replaced by the NaN).
for _what in ("invalid value", "overflow", "divide by zero"):
    warnings.filterwarnings("ignore", f"{_what} encountered", RuntimeWarning)

SHARDS = (1, 2, 3, 5, 8, 16)


def _same(m, s, t, what, **launch):
    """Kernel (lse, entropy) == the torch path on CPU, bitwise; returns the kernel's."""
    got = tlp.finish_stats(m, s, t, **launch)
    for name, g, w in zip(("lse", "entropy"), got, finish_want(m, s, t), strict=True):
        assert same_bits(g, w), f"{what} {name}: {describe_diff(g, w)}"
    return got


@check
def equals_torch_path_on_random_and_real_stats():
    """Shard counts 1, 2, 3, 5, 8, 16 (and 7, 64): random stats (37 rows, no special rows), and
    the CPU shard statistics (logprobs._shard_stats) of random logits at scales 0.3 … 30, with a
    padded vocabulary's −inf tail (ids >= 17: whole masked shards from 2 shards on)."""
    for shards in (*SHARDS, 7, 64):
        m, s, t = finish_case(37, shards, seed=shards)
        _same(m, s, t, f"random shards={shards}")
        for scale, live in ((0.3, None), (3.0, 30 * shards - 5), (30.0, 17)):
            logits = torch.randn(12, 40 * shards, generator=torch.Generator().manual_seed(9))
            z = _div_t(logits * scale, 0.7, live)
            _same(*_shard_stats(z, shards), f"real shards={shards} scale={scale} live={live}")


@check
def equals_torch_path_on_adversarial_stats():
    """The rows of logprobs_finish_cases (masked shards and rows, s = 0, huge / subnormal s,
    m from ±1e30 to ±1e-30, ±Inf, NaN, ±0) and 287 mixed rows, each shard count."""
    for shards in SHARDS:
        _same(*finish_case(300, shards, seed=shards), f"adversarial shards={shards}")


@check
def the_cases_reach_every_branch():
    """The reference of the 5-shard case holds what the cases are for: lse −inf (all masked,
    s = 0), +inf and NaN; entropy NaN and ±Inf; and more than half the rows finite."""
    lse, ent = finish_want(*finish_case(300, 5))
    assert bool((lse[:SPECIAL_ROWS] == -float("inf")).sum() >= 2), "no −inf lse"
    assert bool((lse == float("inf")).any()) and bool(lse.isnan().any()), "no +inf / NaN lse"
    assert bool(ent.isnan().any()) and bool((ent == float("inf")).any()) \
        and bool((ent == -float("inf")).any()), "no NaN / ±Inf entropy"
    assert int(torch.isfinite(lse).sum()) > 150, "too few finite rows"


@check
def row_alone_equals_row_in_batch():
    """Rows 0, 3, 6 of a 7-row batch and rows 0, 31, 32, 200, 256 of a 257-row batch (program
    edges of the 32-row tile) alone == in the batch; block rows × warps 1 × 1 (7 rows) and
    128 × 8 give the default launch's bytes."""
    for n, rows in ((7, (0, 3, 6)), (257, (0, 31, 32, 200, 256))):
        for shards in (3, 8):
            m, s, t = finish_case(n, shards, seed=n + shards)
            lse, ent = _same(m, s, t, f"n={n} shards={shards}")
            for i in rows:
                one = tlp.finish_stats(m[i:i + 1], s[i:i + 1], t[i:i + 1])
                assert same_bits(one[0], lse[i:i + 1]) and same_bits(one[1], ent[i:i + 1]), i
            for br, w in ((1, 1), (128, 8))[n > 7:]:    # one row per program: the 7 rows only
                got = tlp.finish_stats(m, s, t, block_r=br, num_warps=w)
                assert same_bits(got[0], lse) and same_bits(got[1], ent), (br, w)


@check
def strided_empty_and_cpu_dispatch():
    """Column slices of wider stats (copied) == contiguous; N = 0 gives empty outputs; on CPU
    tensors logprobs._finish_stats is the torch path (finish_want)."""
    m, s, t = finish_case(40, 5, seed=3)
    wide = [torch.cat([x, x], 1)[:, :5] for x in (m, s, t)]
    _same(*wide, "column slices")
    e = torch.empty(0, 5)
    assert [tuple(x.shape) for x in tlp.finish_stats(e, e, e)] == [(0,), (0,)]
    for g, w in zip(_finish_stats(m, s, t), finish_want(m, s, t), strict=True):
        assert same_bits(g, w)


@triton.jit
def _log64_kernel(X, Y, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + o, tew.log64(tl.load(X + o, mask=o < n)), mask=o < n)


@check
def log64_equals_the_torch_path_in_float64():
    """triton_elementwise.log64 == elementwise.log64 bitwise in float64: ±0, ±Inf, NaN,
    negatives, subnormals, the smallest normal ±2 ulps, powers of two and √2·2**k ±3 ulps
    (the mantissa's fold), 1 ± ulps, random bit patterns of positive doubles (the finish
    kernel's lse rounds log64 to fp32, which hides few-ulp slips that this sees)."""
    g = torch.Generator().manual_seed(11)
    k = torch.arange(-1070, 1024, 7, dtype=torch.float64)
    anchors = torch.cat([2.0**k, ew._SQRT2 * 2.0**k[k < 1023],
                         torch.tensor([1.0, 2.2250738585072014e-308])])
    anchors = anchors[torch.isfinite(anchors) & (anchors > 0)]
    near = torch.cat([(anchors.view(torch.int64) + d).view(torch.float64) for d in range(-3, 4)])
    rand = (torch.randint(1, 0x7FF0000000000000, (20000,), generator=g)).view(torch.float64)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -1.0, -1e-310,
                            5e-324, 1e-310, 1.7976931348623157e308])
    x = torch.cat([special, near, rand])
    y = torch.empty_like(x)
    _log64_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    want = ew.log64(x)
    bad = (bits(y) != bits(want)).nonzero().flatten()
    assert not bad.numel(), f"{bad.numel()} differ, e.g. x={x[bad[:4]].tolist()}"


@check
def bad_arguments_are_refused():
    m = torch.zeros(4, 8)
    bad = [(m.double(), m, m), (m[0], m[0], m[0]), (m, m[:, :4], m), (m, m, m[:3]),
           (m, m.half(), m), (torch.zeros(4, 0),) * 3]
    for args in bad:
        try:
            tlp.finish_stats(*args)
        except ValueError:
            continue
        raise AssertionError(f"accepted {[(tuple(a.shape), a.dtype) for a in args]}")


@check
def launch_disables_fp_fusion():
    with LaunchRecorder.swapped_in(tlp, "_finish_kernel") as rec:
        tlp.finish_stats(*finish_case(3, 5))
    assert [kw.get("enable_fp_fusion") for _, kw in rec.launches] == [False]


@triton.jit
def _tree_sequential(m, s, t, BR: tl.constexpr, P: tl.constexpr, LOG_P: tl.constexpr,
                     SHARDS: tl.constexpr):
    # left to right: ((0, 1), 2), 3), ... (a column taken out by a select and a sum with zeros)
    cols = tl.arange(0, P)[None, :]
    mm = tl.sum(tl.where(cols == 0, m, 0.0), 1)
    ss = tl.sum(tl.where(cols == 0, s, 0.0), 1)
    tt = tl.sum(tl.where(cols == 0, t, 0.0), 1)
    for j in tl.static_range(1, SHARDS):
        mj = tl.sum(tl.where(cols == j, m, 0.0), 1)
        sj = tl.sum(tl.where(cols == j, s, 0.0), 1)
        tj = tl.sum(tl.where(cols == j, t, 0.0), 1)
        mm, ss, tt = tlp._merge(mm, ss, tt, mj, sj, tj)
    return mm, ss, tt


@triton.jit
def _exp_fp32(x):
    return tl.exp(x)                                  # in place of exp32


@triton.jit
def _log_fp32(x):
    return tl.log(x)                                  # in place of log32


@check
def negative_control_other_trees_and_roundings_differ():
    """The checks can fail: a left-to-right merge in place of the pairwise tree (5 and 8
    random shards; at 3 the two trees coincide), fp32 exp (tl.exp for exp32) and fp32 log (tl.log for log32) each give other
    bytes than the torch path on some rows; restored, the kernel matches again. (Padding to a
    power of two with masked shards instead of carrying the odd entry is no control: merging
    with (−inf, 0, 0) is exact but for a zero's sign in s or t, which never reaches lse or
    entropy.)"""
    rand = {k: finish_case(64, k, seed=k) for k in (5, 8)}
    real = {name: getattr(tlp, name) for name in ("_tree_merge", "exp32", "log32")}
    try:
        for name, fake, shards in (("_tree_merge", _tree_sequential, 5),
                                   ("_tree_merge", _tree_sequential, 8),
                                   ("exp32", _exp_fp32, 8), ("log32", _log_fp32, 8)):
            setattr(tlp, name, fake)
            got = tlp.finish_stats(*rand[shards])
            assert not all(same_bits(g, w) for g, w in zip(got, finish_want(*rand[shards]))), \
                (fake.__name__, shards)
            setattr(tlp, name, real[name])
    finally:
        for name, fn in real.items():
            setattr(tlp, name, fn)
    for shards, case in rand.items():
        _same(*case, f"restored shards={shards}")

if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
