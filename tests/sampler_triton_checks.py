"""The checks behind tests/test_sampler_triton.py, run in a subprocess with TRITON_INTERPRET=1:
the sampler's Triton race (kernels/triton_sampler.py) against the torch sampler on CPU
(rollout/sampler.py, the reference), and the Triton log64 against elementwise.log64.
Tokens and flags are compared exactly; the per-element race scores and log64 as int64 bits.
What the interpreter shows: the kernels' sequence of IEEE and integer operations is the torch
path's. What it cannot: code generation (fma contraction, division lowering): the PTX test in
tests/test_sampler_triton.py checks that; on a GPU, tests/test_cuda_rollout.py.
Prints one JSON object {check name: "ok" or the failure}: the named checks, or all.
Run by hand: TRITON_INTERPRET=1 .venv/bin/python tests/sampler_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import torch

from kernel_helpers import interpreted_checks, run_checks

CHECKS, check = interpreted_checks(__file__)

import triton
import triton.language as tl
import triton_interpreter_compat  # noqa: F401 - numpy >= 2.3: before any launch

from rlkernel.kernels import elementwise as ew
from rlkernel.kernels import triton_elementwise as tew
from rlkernel.kernels import triton_sampler as ts
from rlkernel.rollout import sampler

# int64 products wrap (the hash), NaN -> int casts and overflows to Inf are the torch path's too
for msg in ("overflow encountered", "invalid value encountered"):
    warnings.filterwarnings("ignore", msg, RuntimeWarning)


def _bits_equal(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise: the same float64 bits, or both NaN."""
    return (got.view(torch.int64) == want.view(torch.int64)) | (got.isnan() & want.isnan())


@triton.jit
def _log64_kernel(X, Y, n, B: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(Y + o, tew.log64(tl.load(X + o, mask=o < n, other=1.0)), mask=o < n)


@triton.jit
def _scores_kernel(LP, SID, POS, OUT, V, h_seed, B: tl.constexpr):
    row = tl.program_id(0)
    h = ts.row_state(h_seed, tl.load(SID + row), tl.load(POS + row))
    ids = tl.arange(0, B).to(tl.int64)
    lp = tl.load(LP + row * V + ids, mask=ids < V, other=0.0).to(tl.float64)
    tl.store(OUT + row * V + ids, ts.race_scores(lp, h, ids), mask=ids < V)


def _logprobs(rows: int, v: int, gen: torch.Generator, scale: float = 3.0) -> torch.Tensor:
    """Canonical-looking fp32 log-softmax rows [rows, v] (random logits)."""
    return torch.log_softmax(torch.randn(rows, v, generator=gen) * scale, -1)


def _torch_tokens(lp, seed, sid, pos, top_p):
    """sample_tokens' torch ops (the reference). Under TRITON_INTERPRET=1 sampler._fused is true
    for fp32 rows, so sample_tokens would run the race itself: the dispatch is switched off."""
    fused = sampler._fused
    sampler._fused = lambda _: False
    try:
        return sampler.sample_tokens(lp, seed=seed, sample_ids=sid, positions=pos, top_p=top_p,
                                     validate=False)
    finally:
        sampler._fused = fused


def _ids(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    sid = torch.randint(-2**62, 2**62, (rows,), generator=gen)
    pos = torch.randint(0, 40000, (rows,), generator=gen)
    return sid, pos


@contextlib.contextmanager
def _split(split: int, block: int):
    old = ts.SPLIT, ts.BLOCK_V
    ts.SPLIT, ts.BLOCK_V = split, block
    try:
        yield
    finally:
        ts.SPLIT, ts.BLOCK_V = old


@check
def log64_equals_the_torch_log64():
    """Triton log64 == elementwise.log64 in float64 bits: uniform and heavy-tailed positives,
    √2 ± ulps (the mantissa fold), powers of two ± 1 ulp, subnormals, 0, −0, negatives, ±inf, NaN."""
    g = torch.Generator().manual_seed(1)
    sq = torch.tensor(2.0**0.5, dtype=torch.float64)
    near = [sq]
    for _ in range(3):
        near += [torch.nextafter(near[-1], torch.tensor(9.0, dtype=torch.float64))]
    lo = [sq]
    for _ in range(3):
        lo += [torch.nextafter(lo[-1], torch.tensor(0.0, dtype=torch.float64))]
    p2 = torch.tensor([2.0**k for k in range(-1074, 1024, 7)], dtype=torch.float64)
    x = torch.cat([
        torch.rand(4000, generator=g, dtype=torch.float64) * 10,
        torch.rand(2000, generator=g, dtype=torch.float64) ** 40,
        torch.stack(near + lo), p2, torch.nextafter(p2, torch.zeros_like(p2)),
        torch.tensor([0.0, -0.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e-310,
                      5e-324, 1.0, 1.7976931348623157e308, 2.220446049250313e-16],
                     dtype=torch.float64)])
    y = torch.empty_like(x)
    _log64_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), B=1024)
    ok = _bits_equal(y, ew.log64(x))
    assert bool(ok.all()), f"{int((~ok).sum())} values differ, e.g. x={x[~ok][:4].tolist()}"


@check
def race_scores_equal_the_torch_scores():
    """Per element, the kernel's float64(logp) − log64(−log64(u)) == the torch sampler's score
    (counter_uniform, log64) in bits, for extreme sample ids (negative, > 2**62) and positions."""
    g = torch.Generator().manual_seed(2)
    rows, v = 6, 1000
    lp = _logprobs(rows, v, g)
    sid, pos = _ids(rows, g)
    sid[0], pos[0] = -1, 0
    for seed in (0, 12345, 2**64 - 1, -7):
        out = torch.empty(rows, v, dtype=torch.float64)
        h = sampler._signed64(sampler._seed_state(seed))
        _scores_kernel[(rows,)](lp, sid, pos, out, v, h, B=1024)
        u = sampler.counter_uniform(seed, sid, pos, v)
        want = lp.to(torch.float64) - ew.log64(-ew.log64(u))
        ok = _bits_equal(out, want)
        assert bool(ok.all()), f"seed {seed}: {int((~ok).sum())} scores differ"


@check
def race_tokens_equal_the_torch_sampler():
    """Tokens == sample_tokens (torch, CPU) at top-p 1 and < 1, V not a multiple of the piece,
    several pieces per row, rows with −inf ids (a padded vocabulary), tied logprobs (so the
    cut's id matters) and tied race scores (ties to the smallest id within a block, across the
    blocks of a piece and across pieces); the top-p cut computed in chunks of rows. The
    reference is the torch ops, never the race."""
    g = torch.Generator().manual_seed(3)
    rows, v = 9, 1000
    lp = _logprobs(rows, v, g)
    lp[1, 700:] = float("-inf")
    lp[2] = torch.log_softmax(torch.randint(0, 3, (v,), generator=g).float(), -1)   # ties
    lp[3] = torch.log_softmax(torch.zeros(v), -1)                                     # all tied
    lp[4] = torch.log_softmax(torch.randn(v, generator=g) * 30, -1)                   # peaked
    # Equal scores: −1e30 − log q rounds to −1e30 for every q. With 128-id blocks and 256-id
    # pieces: two ties in block 0, two in block 1 (same piece), more in pieces 1 and 3.
    lp[5] = float("-inf")
    lp[5, [900, 300, 140, 131, 110, 100, 700]] = -1e30
    sid, pos = _ids(rows, g)
    with _split(256, 128):
        for top_p in (1.0, 0.999, 0.9, 0.5, 0.1, 1e-9):
            for seed in (0, 99):
                got = sampler.draw(lp, seed=seed, sample_ids=sid, positions=pos, top_p=top_p)
                want = _torch_tokens(lp, seed, sid, pos, top_p)
                assert torch.equal(got[0], want), f"top_p {top_p} seed {seed}: {got[0]} vs {want}"
                assert int(want[5]) == 100, want[5]
                assert not bool(got[1].any()), "a valid row flagged"
    chunk = sampler._CHUNK_ELEMS
    sampler._CHUNK_ELEMS = 4 * v        # the race's top-p cut computed 4 rows at a time
    try:
        with _split(256, 128):
            got = sampler.draw(lp, seed=7, sample_ids=sid, positions=pos, top_p=0.5)[0]
    finally:
        sampler._CHUNK_ELEMS = chunk
    want = _torch_tokens(lp, 7, sid, pos, 0.5)
    assert torch.equal(got, want), f"chunked cut: {got} vs {want}"


@check
def flags_equal_invalid_rows_and_nan_rows_draw_v():
    """bad == invalid_rows: rows with a NaN, a +inf, only −inf, and valid rows; a NaN row's
    token is V (the torch argmax of a NaN row), the others' the torch sampler's."""
    g = torch.Generator().manual_seed(4)
    rows, v = 6, 600
    lp = _logprobs(rows, v, g)
    lp[0, 17] = float("nan")
    lp[1, 599] = float("inf")
    lp[2] = float("-inf")
    lp[3, 300] = float("nan")
    lp[3, 301] = float("inf")
    sid, pos = _ids(rows, g)
    with _split(256, 128):
        tok, bad = sampler.draw(lp, seed=5, sample_ids=sid, positions=pos, top_p=1.0)
    assert torch.equal(bad, sampler.invalid_rows(lp)), bad
    assert bad.tolist() == [True, True, True, True, False, False]
    assert tok[0] == v and tok[3] == v, tok
    want = _torch_tokens(lp, 5, sid, pos, 1.0)
    assert torch.equal(tok[[1, 2, 4, 5]], want[[1, 2, 4, 5]]), (tok, want)


@check
def sample_tokens_on_the_race_validates():
    """sample_tokens(validate=True) on fp32 rows (drawn by the race) refuses what the torch path
    refuses — NaN, +inf, a row without a finite entry, an unnormalised row at top-p < 1 — and
    draws the race's tokens otherwise."""
    g = torch.Generator().manual_seed(7)
    lp = _logprobs(3, 300, g)
    sid, pos = _ids(3, g)
    kw = dict(seed=3, sample_ids=sid, positions=pos)
    for row, value, top_p in ((1, float("nan"), 1.0), (2, float("inf"), 1.0),
                              (0, float("-inf"), 1.0), (1, 0.0, 0.9)):
        bad = lp.clone()
        bad[row] = value
        try:
            sampler.sample_tokens(bad, top_p=top_p, **kw)
        except ValueError:
            continue
        raise AssertionError(f"row of {value} at top_p {top_p} accepted")
    got = sampler.sample_tokens(lp, top_p=0.9, **kw)
    assert torch.equal(got, sampler.draw(lp, top_p=0.9, **kw)[0])
    assert torch.equal(got, _torch_tokens(lp, 3, sid, pos, 0.9))


@check
def pieces_blocks_and_batch_change_no_token():
    """Tokens are the same with any piece/block split (1, 2, 4 or 8 pieces per row) and for a
    row drawn alone or among 1, 6 or 12 other rows."""
    g = torch.Generator().manual_seed(5)
    rows, v = 13, 1024
    lp = _logprobs(rows, v, g)
    sid, pos = _ids(rows, g)
    ref = None
    for split, block in ((1024, 1024), (512, 256), (256, 64), (128, 128)):
        with _split(split, block):
            for top_p in (1.0, 0.7):
                tok = sampler.draw(lp, seed=1, sample_ids=sid, positions=pos, top_p=top_p)[0]
                ref = ref or {}
                ref.setdefault(top_p, tok)
                assert torch.equal(tok, ref[top_p]), f"split {split}/{block} top_p {top_p}"
    with _split(256, 128):
        for n in (1, 7, 13):
            tok = sampler.draw(lp[:n], seed=1, sample_ids=sid[:n], positions=pos[:n],
                               top_p=0.7)[0]
            assert torch.equal(tok, ref[0.7][:n]), f"batch of {n}"


@check
def negative_controls_differ():
    """The comparisons can fail: another seed draws other tokens on most rows; a top-p cut that
    ignores the cut id (keeps every token tied with the last kept one) changes tied rows."""
    g = torch.Generator().manual_seed(6)
    rows, v = 16, 512
    lp = _logprobs(rows, v, g)
    sid, pos = _ids(rows, g)
    with _split(256, 128):
        tok = sampler.draw(lp, seed=1, sample_ids=sid, positions=pos, top_p=1.0)[0]
    other = _torch_tokens(lp, 2, sid, pos, 1.0)
    assert int((tok != other).sum()) >= rows // 2, (tok, other)
    tied = torch.log_softmax(torch.zeros(rows, v), -1)
    real_cut = sampler._top_p_cut
    try:
        sampler._top_p_cut = lambda p, t: (real_cut(p, t)[0],
                                           torch.full((p.shape[0],), v - 1, dtype=torch.int64))
        with _split(256, 128):
            loose = sampler.draw(tied, seed=1, sample_ids=sid, positions=pos, top_p=0.05)[0]
    finally:
        sampler._top_p_cut = real_cut
    want = _torch_tokens(tied, 1, sid, pos, 0.05)
    assert not torch.equal(loose, want), "ignoring the cut id changed nothing"
    assert int(want.max()) < int(0.05 * v) + 1 and int(loose.max()) >= int(0.05 * v) + 1


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
