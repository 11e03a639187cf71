"""The checks behind tests/test_vocab_slice_triton.py, run in a subprocess with TRITON_INTERPRET=1
(Triton's CPU interpreter must be chosen before triton is imported, and must not leak into the
other tests' process): the two Triton kernels of the vocab-parallel LM head
(kernels/logprobs.py `linear_token_logprobs_entropy(..., vocab_comm=)`) on a TP rank's vocab
slice — the fused statistics (`triton_logprobs.linear_shard_stats`) and the d-logits pass
(`triton_dlogits.dlogits`, from logits) — given what `logprobs._vocab_slice` gives a rank: its
local target indices (outside [0, V/tp) when another rank holds the target) and its live
column count (0 for a slice wholly past a padded vocabulary's live ids).
Property: the ranks' per-shard statistics, concatenated in rank order, are the full
vocabulary's bytes; the target's z comes from its owner only (−inf elsewhere); the ranks'
d-logits slices, concatenated, are the full d-logits' bytes. That is what the GPU test
(tests/test_cuda.py -k vocab_parallel_fused) checks end to end with the GPU's own dot order;
here the kernels' masking by global id, local targets and dead slices are checked without one.
Prints one JSON object {check name: "ok" or the failure}: the named checks, or all.
Run by hand: TRITON_INTERPRET=1 .venv/bin/python tests/vocab_slice_triton_checks.py [NAME ...]
"""

from __future__ import annotations

import sys
import warnings

import torch
from kernel_helpers import interpreted_checks, run_checks

CHECKS, check = interpreted_checks(__file__)

import triton_interpreter_compat  # noqa: F401,E402 - after the TRITON_INTERPRET check

from rlkernel.kernels import triton_dlogits as td  # noqa: E402
from rlkernel.kernels import triton_logprobs as tlp  # noqa: E402
from rlkernel.kernels.logprobs import _vocab_slice  # noqa: E402
from rlkernel.spec import VIRTUAL_TP  # noqa: E402

for _what in ("invalid value", "overflow", "divide by zero"):
    warnings.filterwarnings("ignore", f"{_what} encountered", RuntimeWarning)

N, K = 24, 64
V = VIRTUAL_TP * 2 * tlp.VOCAB_CHUNK      # 2 chunks per virtual shard: 2048 ids
T = 0.7
# live ids: every id; inside the last TP8 slice; leaving TP4's ranks 2 and 3 (and TP8's 4-7) dead
LIVES = (V, V - 37, 700)


class _Rank:
    """What `_vocab_slice` gives TP rank r of tp (only .rank and .size are read)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def _case(dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, K, generator=g).to(dtype)
    w = (torch.randn(V, K, generator=g) * 0.3).to(dtype)
    return h, w


def _targets(live: int, seed: int) -> torch.Tensor:
    """Targets under `live`, one in each TP8 slice that holds a live id (every owner used)."""
    g = torch.Generator().manual_seed(seed)
    tg = torch.randint(0, live, (N,), generator=g)
    per = V // 8
    for r in range(8):
        if r * per < live:
            tg[r] = r * per + min(per, live - r * per) - 1
    return tg


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.int32 if a.element_size() == 4 else torch.int16),
        b.contiguous().view(torch.int32 if b.element_size() == 4 else torch.int16))


@check
def stats_of_vocab_slices_are_the_full_vocabularys():
    """TP 2, 4, 8 × live ∈ {V, V − 37, 700} × fp32 / bf16 operands: each rank's
    linear_shard_stats on its slice (VIRTUAL_TP/tp shards, local targets, live count) —
    m, s, t concatenated in rank order == the full vocabulary's, bytes; z_target from the
    owner == the full one, −inf on every other rank."""
    for dtype in (torch.float32, torch.bfloat16):
        h, w = _case(dtype, 1)
        for live in LIVES:
            tg = _targets(live, 2)
            fm, fs, ft, fz = tlp.linear_shard_stats(h, w, tg, T, VIRTUAL_TP, live)
            for tp in (2, 4, 8):
                vl = V // tp
                parts = []
                for r in range(tp):
                    local, n_live = _vocab_slice(_Rank(r, tp), vl, tg, live)
                    m, s, t, z = tlp.linear_shard_stats(h, w[r * vl:(r + 1) * vl], local, T,
                                                        VIRTUAL_TP // tp, n_live)
                    parts.append((m, s, t))
                    own = (tg // vl) == r
                    assert _same(z[own], fz[own]), (dtype, live, tp, r, "z_target")
                    assert bool((z[~own] == float("-inf")).all()), (dtype, live, tp, r)
                    if n_live == 0:
                        assert bool((m == float("-inf")).all()) and not s.any() and not t.any()
                for i, (name, full) in enumerate((("m", fm), ("s", fs), ("t", ft))):
                    got = torch.cat([p[i] for p in parts], dim=1)
                    assert _same(got, full), (dtype, live, tp, name)


@check
def dlogits_of_vocab_slices_are_the_full_vocabularys():
    """TP 2, 4, 8 × live ∈ {V, V − 37, 700} × fp32 / bf16 out, with and without the entropy
    term: each rank's dlogits from its logits slice (local targets, live count) concatenated
    == the full d-logits, bytes."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(N, V, generator=g) * 4
    lse = torch.randn(N, generator=g) + 6
    ent = torch.rand(N, generator=g) * 3
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    for live in LIVES:
        tg = _targets(live, 4)
        for dt in (torch.float32, torch.bfloat16):
            for ge in (g_ent, None):
                full = td.dlogits(logits, tg, lse, ent, g_lp, ge, T,
                                  torch.empty(N, V, dtype=dt), from_logits=True, live_vocab=live)
                for tp in (2, 4, 8):
                    vl = V // tp
                    got = []
                    for r in range(tp):
                        local, n_live = _vocab_slice(_Rank(r, tp), vl, tg, live)
                        got.append(td.dlogits(logits[:, r * vl:(r + 1) * vl], local, lse, ent,
                                              g_lp, ge, T, torch.empty(N, vl, dtype=dt),
                                              from_logits=True, live_vocab=n_live))
                    assert _same(torch.cat(got, dim=1), full), (live, dt, ge is None, tp)


@check
def negative_control_global_targets_on_a_slice_differ():
    """A rank given the global targets instead of its local indices (the offset forgotten) or
    its slice's columns all live past a padded vocabulary's end: z_target, the statistics or
    the d-logits differ from the full vocabulary's, so the checks above can fail."""
    h, w = _case(torch.float32, 1)
    tg = _targets(V - 37, 2)
    fz = tlp.linear_shard_stats(h, w, tg, T, VIRTUAL_TP, V - 37)[3]
    vl = V // 2
    z = tlp.linear_shard_stats(h, w[vl:], tg, T, VIRTUAL_TP // 2, vl - 37)[3]   # not local
    own = (tg // vl) == 1
    assert not _same(z[own], fz[own])
    full = tlp.linear_shard_stats(h, w, tg, T, VIRTUAL_TP, V - 37)[0]
    m = tlp.linear_shard_stats(h, w[vl:], tg - vl, T, VIRTUAL_TP // 2, vl)[0]  # no live bound
    assert not _same(m, full[:, VIRTUAL_TP // 2:])
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(N, V, generator=g) * 4
    lse, ent = torch.randn(N, generator=g) + 6, torch.rand(N, generator=g) * 3
    g_lp = torch.randn(N, generator=g)
    full_d = td.dlogits(logits, tg, lse, ent, g_lp, None, T, torch.empty(N, V),
                        from_logits=True, live_vocab=V - 37)
    d = td.dlogits(logits[:, vl:], tg, lse, ent, g_lp, None, T, torch.empty(N, vl),
                   from_logits=True, live_vocab=vl - 37)
    assert not _same(d, full_d[:, vl:])


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
