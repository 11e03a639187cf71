"""Direct-mode GradSink at the kernel level (rlkernel/distributed/tokensum.py): the embedding
lookup (vocab shard at an offset), RMSNorm and a column-parallel linear, in one process, give
the same gradient bytes with no sink, with a persistent sink, and with a direct sink whose
DIRECT_CHUNK_ELEMS cuts every weight into small row chunks (the chunk's row offset must reach
each kernel's partials). The embedding shard's gradient is the slice of the full-vocab one.
And compute_gradients picks direct mode from every DP replica's microbatch count (a stub model).
Run: .venv/bin/python -m pytest -q tests/test_sink_direct_kernels.py
"""

from __future__ import annotations

import pytest
import torch

from rlkernel.distributed import tokensum
from rlkernel.distributed.comm import Comm
from rlkernel.kernels.embedding import embed
from rlkernel.kernels.matmul import column_parallel_linear
from rlkernel.kernels.norm import rms_norm
from rlkernel.spec import TOKEN_LEAF

VOCAB, OFFSET, ROWS, H, N = 20, 6, 12, 10, 16


def _grads(w: dict[str, torch.Tensor], ids: torch.Tensor, coef: torch.Tensor, offset: int,
           sink: str) -> dict[str, torch.Tensor]:
    """Gradients of sum(coef * linear(norm(embed(ids)))) with `sink` = none | persistent |
    direct."""
    params = {n: torch.nn.Parameter(t.clone()) for n, t in w.items()}
    gs = None
    if sink != "none":
        gs = tokensum.GradSink.single()
        gs.begin(params, direct=sink == "direct")
    tok = tokensum.TokenSum(Comm.single("tokens"), sink=gs)
    h = embed(ids, params["emb"], offset=offset, tok=tok)
    h = rms_norm(h, params["norm"], 1e-6, tok=tok)
    (y,) = column_parallel_linear(h, [params["lin"]], tok=tok)
    (y * coef).sum().backward()
    if gs is None:
        return {n: p.grad for n, p in params.items()}
    assert all(p.grad is None for p in params.values())
    assert (set(gs._done), set(gs._acc)) == ((set(params), set()) if sink == "direct"
                                             else (set(), set(params)))
    return gs.finish()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("chunk", [1 << 23, 3])
def test_direct_row_chunks_equal_the_persistent_and_unsinked_bytes(monkeypatch, chunk):
    """no sink == persistent sink == direct sink (DIRECT_CHUNK_ELEMS = 3: chunks of 1 row of
    the [12, 10] embedding shard and [16, 10] linear, 3 elements of the norm weight), bytes;
    the shard at offset 6 == rows [6, 18) of the full-vocab embedding's gradient."""
    monkeypatch.setattr(tokensum, "DIRECT_CHUNK_ELEMS", chunk)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (3 * TOKEN_LEAF,), generator=g)
    ids[:ROWS] = torch.arange(OFFSET, OFFSET + ROWS)          # every shard row is used
    full = torch.randn(VOCAB, H, generator=g)
    w = {"emb": full[OFFSET:OFFSET + ROWS].clone(), "norm": 1 + torch.randn(H, generator=g),
         "lin": torch.randn(N, H, generator=g)}
    inside = ((ids >= OFFSET) & (ids < OFFSET + ROWS)).float()[:, None]
    coef = torch.randn(3 * TOKEN_LEAF, N, generator=g) * inside
    base = _grads(w, ids, coef, OFFSET, "none")
    for sink in ("persistent", "direct"):
        got = _grads(w, ids, coef, OFFSET, sink)
        assert [n for n in w if not _same(got[n], base[n])] == [], sink
    whole = _grads({**w, "emb": full}, ids, coef, 0, "none")
    assert _same(whole["emb"][OFFSET:OFFSET + ROWS], base["emb"])


@pytest.mark.parametrize("others,direct", [([1], True), ([2], False), ([1, 1, 3], False)])
def test_direct_mode_is_chosen_from_every_dp_replicas_microbatch_count(monkeypatch, others,
                                                                       direct):
    """compute_gradients opens the sink in direct mode only when EVERY DP replica has one
    microbatch (counts all-gathered over DP), not when this rank alone has one: a replica with
    two would otherwise finish its weights at `finish` while this one finishes them in the
    backward (mismatched collectives). The model is a stub that stops at begin_grads."""
    from types import SimpleNamespace

    from rlkernel.train import step

    class Stop(Exception):
        pass

    seen = []

    class DP:
        size, rank = 1 + len(others), 0

        def all_gather_object(self, obj, op):
            return [obj, *others] if op == "microbatch-count" else [obj] * self.size

    def begin_grads(model, direct=False):
        seen.append(direct)
        raise Stop

    policy = SimpleNamespace(pc=SimpleNamespace(dp=DP()), device="cpu",
                             ops=SimpleNamespace(begin_grads=begin_grads))
    monkeypatch.setattr(step, "microbatches", lambda *a, **k: ["one microbatch"])
    samples = [step.TrainSample(i, (1, 2), (3, 4), torch.zeros(2), 1.0)
               for i in range(DP.size)]
    with pytest.raises(Stop):
        step.compute_gradients(policy, None, samples, temperature=1.0, coefs=None,
                               micro_batch_tokens=64, pad_id=0, exp=torch.exp)
    assert seen == [direct]
