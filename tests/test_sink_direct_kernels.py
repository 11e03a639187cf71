"""Direct-mode GradSink at the kernel level (rlkernel/distributed/tokensum.py): the embedding
lookup (vocab shard at an offset), RMSNorm and a column-parallel linear, in one process, give
the same gradient bytes with no sink, with a persistent sink, and with a direct sink whose
DIRECT_CHUNK_ELEMS cuts every weight into small row chunks (the chunk's row offset must reach
each kernel's partials). The embedding shard's gradient is the slice of the full-vocab one.
And compute_gradients picks direct mode from every DP replica's microbatch count (a stub model).
The `words_rows` hook (a kernel's chunk rounded from double words, or None): with a one-rank
scope group, chunks it rounds need no accumulator and a None chunk takes the digit path, the
bytes those of the digit-only and persistent paths; with two ranks it is never called. The hook
is driven here by a CPU model of the CUDA dW kernel's double words (TwoSum of the leaf
partials); tests/grad_weight_triton_checks.py drives it with the kernel under the interpreter,
tests/test_cuda_grad_weight.py through kernels/matmul.py on a GPU.
Late activation flags: the counter starts at 0 in each mini-batch on one device, and a count on
one rank is seen by every rank. Double words at finish (filled by hand): a one-rank group's are
rounded once per weight, a two-rank group's summed first — as words where every rank holds the
weight in words, else as digits. Direct chunks over two ranks in a late sink go as words (the
`word_rows` hook, a CPU model of `words_grad_weight_deferred`).
Run: .venv/bin/python -m pytest -q tests/test_sink_direct_kernels.py
"""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import run_ranks_sequentially

from rlkernel.distributed import tokensum
from rlkernel.distributed.comm import Comm
from rlkernel.kernels import matmul as mm
from rlkernel.kernels.embedding import embed
from rlkernel.kernels.matmul import column_parallel_linear
from rlkernel.kernels.norm import rms_norm
from rlkernel.numerics import fixedpoint as fx
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
    # persistent: the norm weight's leaf partials are kept for one pass at finish (add_later)
    assert (set(gs._done), set(gs._acc), set(gs._later)) == (
        (set(params), set(), set()) if sink == "direct"
        else (set(), set(params) - {"norm"}, {"norm"}))
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

    def begin_grads(model, direct=False, late=False):
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


# ------------------------------------------------------------------ the words_rows hook
def _dw_operands(leaves: int = 6, n: int = 16, k: int = 10, seed: int = 4):
    """dy [L, n], x [L, k] fp32 (randn at a per-leaf scale) with row 9's leaf partials of
    column 4 planted as 2**100, 1.5·2**46, 2**-100: no double word holds that sum (a flagged
    tile on CUDA, None from the words model)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-8, 9, (leaves, 1), generator=g).float())
    dy = torch.randn(leaves * TOKEN_LEAF, n, generator=g) * scale.repeat_interleave(TOKEN_LEAF, 0)
    x = torch.randn(leaves * TOKEN_LEAF, k, generator=g)
    dy[:, 9], x[:, 4] = 0.0, 0.0
    for leaf, v in enumerate([2.0**100, 1.5 * 2.0**46, 2.0**-100]):
        t = leaf * TOKEN_LEAF
        dy[t, 9], x[t] = v, 0.0
        x[t, 4] = 1.0
    return dy, x


def _words_model(dy: torch.Tensor, x: torch.Tensor, calls: list):
    """A CPU stand-in for the CUDA kernel's `rounded_grad_weight` as a words_rows hook: rows
    [a, b) of dW's leaf partials added into double words with checked TwoSum, rounded by
    fixedpoint.round_double_words, or None when a check failed. Records (a, b, used)."""
    import fixedpoint_round_cases as rc

    def rows(a, b):
        parts = mm.token_leaf_partials(dy[:, a:b], x, dy.shape[0] // TOKEN_LEAF)
        words, ok = rc.two_sum_words(parts.reshape(parts.shape[0], -1))
        calls.append((a, b, bool(ok.all())))
        return fx.round_double_words(words).view(b - a, -1) if ok.all() else None
    return rows


def _finish(sink: tokensum.GradSink, w: torch.nn.Parameter, dy, x, words_rows, adds: list):
    sink.begin({"w": w}, direct=True)

    def add_rows(a, b, acc):
        adds.append((a, b))
        mm.accumulate_grad_weight_(acc, dy[:, a:b], x)
    assert tokensum.TokenSum(Comm.single("tokens"), sink=sink).finish_now(
        w, add_rows, "dw", words_rows=words_rows)
    return sink.finish()["w"]


def test_words_rows_rounds_one_rank_chunks_and_a_none_chunk_takes_the_digits(monkeypatch):
    """One-rank scope group, DIRECT_CHUNK_ELEMS = 30 (chunks of 3 rows of the [16, 10] weight):
    every chunk asks words_rows first; the five it rounds never reach add_rows, the one holding
    the planted row 9 gets None and goes through add_rows (digits). The gradient == the
    digit-only direct path (no hook) == the persistent sink, bytewise; the CPU path of
    kernels/matmul.py hands no hook (it has no double words)."""
    monkeypatch.setattr(tokensum, "DIRECT_CHUNK_ELEMS", 30)
    dy, x = _dw_operands()
    w = torch.nn.Parameter(torch.zeros(16, 10))
    calls, adds = [], []
    got = _finish(tokensum.GradSink.single(), w, dy, x, _words_model(dy, x, calls), adds)
    assert calls == [(0, 3, True), (3, 6, True), (6, 9, True), (9, 12, False), (12, 15, True),
                     (15, 16, True)]
    assert adds == [(9, 12)]
    digits_adds = []
    digits = _finish(tokensum.GradSink.single(), w, dy, x, None, digits_adds)
    assert len(digits_adds) == 6
    persistent = fx.round_fp32(mm.accumulate_grad_weight_(fx.zeros((16, 10)), dy, x))
    assert _same(got, digits) and _same(got, persistent)
    assert mm._rounded_rows(dy, x) is None


def test_words_rows_is_not_used_when_other_ranks_hold_tokens(monkeypatch):
    """Two ranks in the scope group (each with half of the leaves; ranks replayed one after
    another): words_rows is never called (their integers must be added first), every chunk goes
    through add_rows and sum_ints, and the gradient == one rank holding all leaves."""
    monkeypatch.setattr(tokensum, "DIRECT_CHUNK_ELEMS", 30)
    dy, x = _dw_operands()
    half = dy.shape[0] // 2
    calls = []

    def rank(r, comm):
        sink = tokensum.GradSink({"dp_cp": comm, "world": comm})
        w = torch.nn.Parameter(torch.zeros(16, 10))
        mine = slice(r * half, (r + 1) * half)
        return _finish(sink, w, dy[mine], x[mine], _words_model(dy[mine], x[mine], calls), [])

    got = run_ranks_sequentially(2, rank)
    assert calls == []
    whole = fx.round_fp32(mm.accumulate_grad_weight_(fx.zeros((16, 10)), dy, x))
    assert _same(got[0], whole) and _same(got[1], whole)


def _deferred_model(dy: torch.Tensor, x: torch.Tensor, calls: list):
    """`_words_model` as a deferred hook (the CUDA kernel's rounded_grad_weight_deferred): rows
    [a, b) and their flag count as a tensor, never None; a flagged chunk's rows are garbage
    (NaN), as the kernel's are where a tile was zeroed, so only its redo can make them right."""
    words = _words_model(dy, x, calls)

    def rows(a, b):
        out = words(a, b)
        if out is None:
            return torch.full((b - a, x.shape[1]), float("nan")), torch.tensor(1)
        return out, torch.tensor(0)
    return rows


def test_deferred_chunks_are_redone_by_the_digits_when_their_flag_is_set(monkeypatch):
    """A words_rows hook that leaves its flag count unread (a tensor): the sink writes every
    chunk's rows, queues the flags (GradSink._defer) and redoes the flagged chunk (row 9's)
    by add_rows before finish returns. The gradient == the digit-only direct path bytewise, and
    add_rows ran for that chunk alone."""
    monkeypatch.setattr(tokensum, "DIRECT_CHUNK_ELEMS", 30)
    dy, x = _dw_operands()
    w = torch.nn.Parameter(torch.zeros(16, 10))
    calls, adds = [], []
    got = _finish(tokensum.GradSink.single(), w, dy, x, _deferred_model(dy, x, calls), adds)
    assert [c[2] for c in calls].count(False) == 1 and adds == [(9, 12)]
    digits = _finish(tokensum.GradSink.single(), w, dy, x, None, [])
    assert _same(got, digits) and not bool(got.isnan().any())


class _Event:
    """A stand-in CUDA event: query() says whether it has passed; synchronize() records a wait."""

    def __init__(self, done: bool, waits: list):
        self.done, self.waits = done, waits

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits.append(self)


def test_deferred_chunks_resolve_in_order_waiting_only_beyond_the_lag():
    """GradSink._resolve(keep): chunks whose event has passed resolve without waiting; an
    unpassed one stops the walk while at most `keep` are queued, and is waited for when more
    are; a redo runs only for a nonzero count; finish waits for all."""
    sink = tokensum.GradSink.single()
    sink.begin({}, direct=True)
    waits, redone = [], []
    evs = [_Event(True, waits), _Event(False, waits), _Event(False, waits), _Event(True, waits)]
    for i, (ev, n) in enumerate(zip(evs, (1, 0, 1, 1))):
        sink._pending.append((ev, torch.tensor(n), lambda i=i: redone.append(i)))
    sink._resolve(3)
    assert redone == [0] and len(sink._pending) == 3      # stopped at the unpassed event 1
    sink._resolve(2)
    assert redone == [0] and len(sink._pending) == 2      # waited for 1 (count 0: no redo)
    assert waits[-1] is evs[1]
    sink.finish()
    assert redone == [0, 2, 3] and not sink._pending


@pytest.mark.parametrize("changed", ["dy", "x"])
def test_a_deferred_redo_refuses_operands_changed_in_place(monkeypatch, changed):
    """kernels/matmul.grad_weight's add_rows checks the version counters of dy and x: a
    deferred chunk redone after dy (or x) was changed in place raises instead of using other
    bytes."""
    monkeypatch.setattr(tokensum, "DIRECT_CHUNK_ELEMS", 30)
    dy, x = _dw_operands()
    monkeypatch.setattr(mm, "_rounded_rows", lambda d, xx: _deferred_model(d, xx, []))
    w = torch.nn.Parameter(torch.zeros(16, 10))
    sink = tokensum.GradSink.single()
    sink.begin({"w": w}, direct=True)
    tok = tokensum.TokenSum(Comm.single("tokens"), sink=sink)
    # The CPU stand-in's counts would resolve at once: hold them until finish (as a CUDA
    # event not yet passed does), so the redo comes after the change.
    real = sink._resolve
    monkeypatch.setattr(sink, "_resolve", lambda keep: real(keep) if keep == 0 else None)
    assert mm.grad_weight(dy, x, w, tok) is None
    {"dy": dy, "x": x}[changed].mul_(2.0)
    with pytest.raises(RuntimeError, match="changed in place"):
        sink.finish()


class _CarryKernel:
    """A stand-in for kernels/triton_grad_weight.py in kernels/matmul.py `_carry_words` (CPU:
    no kernel runs): every call leaves one tile flagged (count 1, on the "device"); the redo
    records its operands."""

    def __init__(self):
        self.redone = []

    def carry_grad_weight_deferred(self, words, dy, x, count):
        count += 1      # the kernel adds its flagged tiles into the sink's counter
        return [(0, words.shape[1], torch.tensor([1], dtype=torch.int32))], count

    def flagged_tiles(self, launches):
        return [(r0, r1, torch.nonzero(f).flatten()) for r0, r1, f in launches]

    def redo_into_digits_(self, acc, dy, x, left):
        self.redone.append((dy.clone(), x.clone(), left))


@pytest.mark.parametrize("changed", [None, "dy", "x"])
def test_a_carried_words_redo_refuses_operands_changed_in_place(monkeypatch, changed):
    """kernels/matmul._carry_words (persistent sink, the CUDA path's carried words): a flagged
    call's redo, run when its count is read (here: at finish, as behind a CUDA event not yet
    passed), checks the version counters of dy and x: changed in place meanwhile, it raises
    instead of adding other bytes. Control (nothing changed): the redo runs once, with this
    call's own dy and x and its flagged tile."""
    kernel = _CarryKernel()
    monkeypatch.setattr(mm, "_grad_weight_kernel", lambda: kernel)
    # The stand-in writes no words (they stay 0): their digits are 0, with no CUDA kernel.
    monkeypatch.setattr(tokensum, "_digits_of", lambda words: fx.zeros((words.shape[1],)))
    dy, x = _dw_operands()
    w = torch.nn.Parameter(torch.zeros(16, 10))
    sink = tokensum.GradSink.single()
    sink.begin({"w": w})
    tok = tokensum.TokenSum(Comm.single("tokens"), sink=sink)
    real = sink._resolve
    monkeypatch.setattr(sink, "_resolve", lambda keep: real(keep) if keep == 0 else None)
    assert mm._carry_words(dy, x, w, tok) is True and kernel.redone == []
    if changed is None:
        sink.finish()
        assert len(kernel.redone) == 1
        rdy, rx, left = kernel.redone[0]
        assert torch.equal(rdy, dy) and torch.equal(rx, x)
        assert [(a, b, t.tolist()) for a, b, t in left] == [(0, 16, [0])]
        return
    {"dy": dy, "x": x}[changed].mul_(2.0)
    with pytest.raises(RuntimeError, match="changed in place"):
        sink.finish()
    assert kernel.redone == []


def test_begin_drops_the_deferred_chunks_a_failed_backward_left():
    """A backward that raised between a deferred chunk and finish leaves it queued: the next
    begin drops it, so the next finish never runs the old mini-batch's redo (whose operands
    may since have changed)."""
    sink = tokensum.GradSink.single()
    sink.begin({}, direct=True)
    redone = []
    sink._pending.append((None, torch.tensor(1), lambda: redone.append("old")))
    sink.begin({}, direct=True)
    assert not sink._pending
    sink.finish()
    assert redone == []


def _tied_grads(w: torch.Tensor, ids: torch.Tensor, coef: torch.Tensor, offset: int,
                sink: str, split: bool = True):
    """Gradient of sum(coef * (embed(ids, W) @ Wᵀ)) for one tied W (the lookup, then the same
    weight as a dense head; the head's backward runs first), with `sink` = none | persistent |
    direct (W kept, as begin_grads keeps a tied embedding). split=False: rows not noted (the
    whole-weight accumulator of a kept weight). Returns (grad, the sink or None)."""
    p = torch.nn.Parameter(w.clone())
    gs = None
    if sink != "none":
        gs = tokensum.GradSink.single()
        gs.begin({"emb": p}, direct=sink == "direct", keep={"emb"})
        if not split:
            gs.note_rows = lambda *a, **k: None
    tok = tokensum.TokenSum(Comm.single("tokens"), sink=gs)
    h = embed(ids, p, offset=offset, tok=tok)
    (y,) = column_parallel_linear(h, [p], tok=tok)
    (y * coef).sum().backward()
    return (p.grad if gs is None else gs.finish()["emb"]), gs


@pytest.mark.parametrize("chunk", [1 << 23, 7])
def test_tied_weight_split_path_gives_the_persistent_bytes_without_its_accumulator(
        monkeypatch, chunk):
    """A kept (tied) weight in direct mode on one rank: the dense use finishes every row
    directly and keeps an accumulator of the looked-up rows only, the lookup adds into it —
    bytes == the persistent sink (both uses' partials summed exactly, rounded once) == the kept
    weight's persistent path in direct mode (split off), at a vocab shard offset and with row
    chunks of 1 row (DIRECT_CHUNK_ELEMS = 7). The split path made no [V, H] accumulator, its
    row accumulator held exactly the ids present. Controls: the head's gradient alone differs
    exactly on those rows; a split path that dropped the lookup's part would give it."""
    monkeypatch.setattr(tokensum, "DIRECT_CHUNK_ELEMS", chunk)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (3 * TOKEN_LEAF,), generator=g)
    w = torch.randn(ROWS, H, generator=g)
    coef = torch.randn(3 * TOKEN_LEAF, ROWS, generator=g)
    base, _ = _tied_grads(w, ids, coef, OFFSET, "persistent", split=False)
    seen = {}
    real = tokensum.GradSink.finish

    def spy(self):
        seen.update(acc=set(self._acc), split={n: r.clone() for n, (r, _) in self._split.items()})
        return real(self)
    monkeypatch.setattr(tokensum.GradSink, "finish", spy)
    got, _ = _tied_grads(w, ids, coef, OFFSET, "direct")
    assert seen["acc"] == set()
    local = ids - OFFSET
    want_rows = torch.unique(local[(local >= 0) & (local < ROWS)])
    assert torch.equal(seen["split"]["emb"], want_rows)
    assert 0 < want_rows.numel() < ROWS     # some rows looked up, some not (both paths used)
    assert _same(got, base)
    other, _ = _tied_grads(w, ids, coef, OFFSET, "direct", split=False)
    assert _same(other, base)
    head_only = torch.nn.Parameter(w.clone())
    (column_parallel_linear(embed(ids, w, offset=OFFSET), [head_only])[0] * coef).sum().backward()
    differs = ~(head_only.grad.view(torch.int32) == base.view(torch.int32)).all(1)
    assert torch.equal(torch.nonzero(differs)[:, 0], want_rows), "control"


def test_tied_split_rows_survive_a_deferred_redo_of_their_chunk(monkeypatch):
    """A split (tied) weight whose dense chunks are all deferred and flagged (their rows NaN
    until redone) and whose flags are read only at finish (a CUDA event not yet passed): finish
    redoes the chunks (dense part only) BEFORE it writes the split rows (dense + lookup), so
    the lookup's part is not overwritten: bytes == the persistent sink."""
    monkeypatch.setattr(tokensum, "DIRECT_CHUNK_ELEMS", 7 * H)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (3 * TOKEN_LEAF,), generator=g)
    w = torch.randn(ROWS, H, generator=g)
    coef = torch.randn(3 * TOKEN_LEAF, ROWS, generator=g)
    base, _ = _tied_grads(w, ids, coef, OFFSET, "persistent", split=False)
    monkeypatch.setattr(mm, "_rounded_rows", lambda d, xx: lambda a, b: (
        torch.full((b - a, xx.shape[1]), float("nan")), torch.tensor(1)))
    real = tokensum.GradSink._resolve
    monkeypatch.setattr(tokensum.GradSink, "_resolve",
                        lambda self, keep: real(self, keep) if keep == 0 else None)
    # finish runs with grad mode on: the redo must not (the CPU path's out= matmuls refuse an x
    # that requires grad) — GradSink._resolve turns it off.
    got, _ = _tied_grads(w, ids, coef, OFFSET, "direct")
    assert not bool(got.isnan().any()) and _same(got, base)


def _tied_microbatches(w, ids, coef, cuts, split: bool = True):
    """_tied_grads's loss over microbatches (ids and coef cut at the token rows `cuts`) into one
    persistent sink; returns (grad, rows of the split accumulator after each microbatch)."""
    p = torch.nn.Parameter(w.clone())
    gs = tokensum.GradSink.single()
    gs.begin({"emb": p}, keep={"emb"})
    if not split:
        gs.note_rows = lambda *a, **k: None
    tok = tokensum.TokenSum(Comm.single("tokens"), sink=gs)
    bounds, sizes = [0, *cuts, ids.numel()], []
    for a, b in zip(bounds, bounds[1:]):
        (y,) = column_parallel_linear(embed(ids[a:b], p, offset=OFFSET, tok=tok), [p], tok=tok)
        (y * coef[a:b]).sum().backward()
        sizes.append(gs._split["emb"][0].numel() if "emb" in gs._split else 0)
    return gs.finish()["emb"], sizes


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_tied_weight_split_over_microbatches_gives_the_whole_accumulator_bytes(
        monkeypatch, fraction):
    """A kept (tied) weight in a persistent sink over three one-leaf microbatches whose lookups
    bring new rows each time: the split accumulator grows to the union of the looked-up rows
    (the digits of the old rows carried into it), and finish adds the dense sum's rows to it —
    bytes == the whole-weight accumulator (split off) over the same microbatches == one
    microbatch. The lookups were chosen so that rows recur across microbatches and new ones
    come in each (a grow that dropped the old digits would lose a recurring row's part). With
    SPLIT_MAX_FRACTION 0.5 the second lookup's union (> 6 of 12 rows) ends the split: the
    weight takes its whole accumulator, the split digits added there; the same bytes."""
    monkeypatch.setattr(tokensum, "SPLIT_MAX_FRACTION", fraction)
    g = torch.Generator().manual_seed(7)
    local = torch.cat([torch.randint(0, 4, (TOKEN_LEAF,), generator=g),
                       torch.randint(2, 8, (TOKEN_LEAF,), generator=g),
                       torch.randint(5, ROWS + 3, (TOKEN_LEAF,), generator=g)])
    ids = local + OFFSET
    w = torch.randn(ROWS, H, generator=g)
    coef = torch.randn(3 * TOKEN_LEAF, ROWS, generator=g)
    cuts = [TOKEN_LEAF, 2 * TOKEN_LEAF]
    base, _ = _tied_grads(w, ids, coef, OFFSET, "persistent", split=False)
    whole, none = _tied_microbatches(w, ids, coef, cuts, split=False)
    got, sizes = _tied_microbatches(w, ids, coef, cuts)
    assert none == [0, 0, 0]
    if fraction == 1.0:
        assert sizes[0] < sizes[1] < sizes[2], sizes
        assert sizes[2] == torch.unique(local[local < ROWS]).numel()
    else:
        assert 0 < sizes[0] <= ROWS // 2 and sizes[1:] == [0, 0], sizes
    assert _same(whole, base) and _same(got, base)


def test_a_split_that_grew_into_the_whole_weight_stays_whole(monkeypatch):
    """SPLIT_MAX_FRACTION 0.5: the second lookup's union (8 of 12 rows) ends the split; the
    third lookup brings only 3 rows (few enough for a split of their own), and the weight stays
    whole (its rows are not noted again: no new split accumulator beside the whole one); the
    bytes of the whole-weight accumulator. A sink that forgot the weight went whole would split
    it again at the third lookup."""
    monkeypatch.setattr(tokensum, "SPLIT_MAX_FRACTION", 0.5)
    g = torch.Generator().manual_seed(8)
    local = torch.cat([torch.randint(0, 4, (TOKEN_LEAF,), generator=g),
                       torch.randint(2, 8, (TOKEN_LEAF,), generator=g),
                       torch.randint(0, 3, (TOKEN_LEAF,), generator=g)])
    ids = local + OFFSET
    w = torch.randn(ROWS, H, generator=g)
    coef = torch.randn(3 * TOKEN_LEAF, ROWS, generator=g)
    cuts = [TOKEN_LEAF, 2 * TOKEN_LEAF]
    assert torch.unique(local[:2 * TOKEN_LEAF]).numel() > ROWS // 2
    assert 0 < torch.unique(local[2 * TOKEN_LEAF:]).numel() <= ROWS // 2
    base, _ = _tied_grads(w, ids, coef, OFFSET, "persistent", split=False)
    got, sizes = _tied_microbatches(w, ids, coef, cuts)
    assert 0 < sizes[0] <= ROWS // 2 and sizes[1:] == [0, 0], sizes
    assert _same(got, base)


def test_split_rows_refuses_the_sparse_use_before_the_dense_one():
    """note_rows then the lookup's backward with no dense use before it: a RuntimeError, not a
    gradient that silently lacks the head's part; a frozen tensor's rows are ignored."""
    p = torch.nn.Parameter(torch.randn(ROWS, H))
    gs = tokensum.GradSink.single()
    gs.begin({"emb": p}, direct=True, keep={"emb"})
    gs.note_rows(torch.zeros(3), torch.tensor([1]), 0, "dp_cp")   # not a parameter: ignored
    tok = tokensum.TokenSum(Comm.single("tokens"), sink=gs)
    ids = torch.arange(TOKEN_LEAF) % ROWS
    h = embed(ids, p, tok=tok)
    with pytest.raises(RuntimeError, match="before its dense use"):
        h.sum().backward()


def test_a_persistent_split_whose_dense_use_has_another_scope_is_refused():
    """Persistent mode: rows noted over dp_cp, the dense use's sum held over world — finish
    raises a RuntimeError naming both scopes rather than adding sums of two reductions."""
    p = torch.nn.Parameter(torch.randn(ROWS, H))
    gs = tokensum.GradSink.single()
    gs.begin({"emb": p}, keep={"emb"})
    gs.note_rows(p, torch.tensor([1, 3]), 0, "dp_cp")
    assert gs.add_split_rows(p, lambda rows, acc: None)
    gs.accumulator(p, "world")
    with pytest.raises(RuntimeError, match="rows noted over dp_cp.*reduced over world"):
        gs.finish()


def test_persistent_sink_casts_each_weight_once_per_mini_batch_and_again_after_a_change():
    """GradSink.compute_copy: in persistent mode one bf16 copy per weight serves every
    microbatch's forward and backward (kernels/matmul.weight_point) — the same values as a
    fresh cast; a weight changed in place is cast again; direct mode, a closed sink and a
    weight already in the compute dtype get None (the caller casts). Control: without the
    version check the stale copy would be returned, which the changed values expose."""
    w = torch.nn.Parameter(torch.randn(ROWS, H).to(torch.bfloat16).float())
    sink = tokensum.GradSink.single()
    assert sink.compute_copy(w, torch.bfloat16) is None           # closed
    sink.begin({"w": w}, direct=True)
    assert sink.compute_copy(w, torch.bfloat16) is None           # direct mode
    sink.begin({"w": w})
    first = sink.compute_copy(w, torch.bfloat16)
    assert first.dtype == torch.bfloat16 and torch.equal(first.view(torch.int16),
                                                         w.detach().to(torch.bfloat16).view(torch.int16))
    assert sink.compute_copy(w, torch.bfloat16) is first          # reused, not cast again
    assert sink.compute_copy(w, torch.float32) is None            # already fp32
    with torch.no_grad():
        w.mul_(2)
    again = sink.compute_copy(w, torch.bfloat16)
    assert again is not first and not torch.equal(again, first)
    assert torch.equal(again.view(torch.int16), w.detach().to(torch.bfloat16).view(torch.int16))
    tok = tokensum.TokenSum(Comm.single("tokens"), sink=sink)
    assert mm.weight_point(w, torch.bfloat16, tok) is again
    sink.finish()
    assert sink.compute_copy(w, torch.bfloat16) is None           # closed again
    assert mm.weight_point(w, torch.bfloat16, tok) is not again   # a fresh cast


# ---------------------------------------------------------------------------------------------
# lookup-only weights (an untied embedding): split over the looked-up rows, any scope group


def _two_rank_lookups(seed: int, cols: int):
    """(w [ROWS, H], local rows per rank and microbatch, their ids at OFFSET, loss coefficients
    [TOKEN_LEAF, cols] per microbatch): rank 0 looks up rows 0-3 then 2-5, rank 1 rows 4-7
    then 5-10, one leaf each — rows on both ranks, rows on one, rows on neither; rank 1's
    second microbatch takes its rows past half of ROWS (a split with digits hands over)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(ROWS, H, generator=g)
    local = {0: [torch.randint(0, 4, (TOKEN_LEAF,), generator=g),
                 torch.randint(2, 6, (TOKEN_LEAF,), generator=g)],
             1: [torch.randint(4, 8, (TOKEN_LEAF,), generator=g),
                 torch.randint(5, 11, (TOKEN_LEAF,), generator=g)]}
    ids = {r: [x + OFFSET for x in mbs] for r, mbs in local.items()}
    coefs = {r: [torch.randn(TOKEN_LEAF, cols, generator=g) for _ in mbs]
             for r, mbs in ids.items()}
    return w, local, ids, coefs


def _lookup_only(rank, comm, ids_by_mb, w, coefs, sparse: bool, seen: dict):
    """One rank's gradient of Σ coef·embed(ids) over microbatches into a persistent sink whose
    scope groups are `comm` (the other ranks hold other tokens), with the weight declared
    lookup-only (sparse) or not; seen[rank] = (the sink's whole accumulators, split rows per
    microbatch) at finish."""
    p = torch.nn.Parameter(w.clone())
    gs = tokensum.GradSink({"dp_cp": comm, "world": comm})
    gs.begin({"emb": p}, sparse={"emb"} if sparse else set())
    tok = tokensum.TokenSum(comm, sink=gs)
    sizes = []
    for ids, coef in zip(ids_by_mb, coefs):
        (embed(ids, p, offset=OFFSET, tok=tok) * coef).sum().backward()
        sizes.append(gs._split["emb"][0].numel() if "emb" in gs._split else 0)
    real = gs._finish_split

    def spy(name, out, later):
        real(name, out, later)
        seen[rank] = (set(gs._acc), sizes)
    gs._finish_split = spy
    grad = gs.finish()["emb"]
    seen.setdefault(rank, (set(gs._acc), sizes))
    return grad


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_lookup_only_weight_split_over_ranks_gives_the_whole_accumulator_bytes(monkeypatch,
                                                                               fraction):
    """An untied embedding (lookup-only) on 2 ranks holding other tokens, 2 one-leaf
    microbatches each, rank 0 looking up rows 0-3 then 2-5 and rank 1 rows 4-9 (some rows on
    both ranks, some on neither): summed over the union of the ranks' rows, the gradient ==
    the whole-accumulator path's bytes on both ranks, with no [V, H] accumulator and each
    rank's split holding only its own rows. With SPLIT_MAX_FRACTION 0.5 rank 1's rows pass half
    at its second lookup and it takes the whole accumulator (its split digits carried there)
    while rank 0 (6 rows) stays split; at finish
    both finish whole (rank 0's split digits added into a whole accumulator): the same bytes.
    Control: one rank's part alone differs."""
    from kernel_helpers import run_ranks

    monkeypatch.setattr(tokensum, "SPLIT_MAX_FRACTION", fraction)
    w, local, ids, coefs = _two_rank_lookups(11, H)
    seen: dict = {}

    def run(sparse):
        return run_ranks(2, lambda r, comm: _lookup_only(r, comm, ids[r], w, coefs[r], sparse,
                                                         seen))
    base = run(False)
    got = run(True)
    for r in (0, 1):
        assert _same(got[r], base[r]) and _same(base[r], base[0])
    rank_rows = {r: torch.unique(torch.cat(local[r])).numel() for r in (0, 1)}
    if fraction == 1.0:
        assert all(seen[r][0] == set() for r in (0, 1)), seen      # no whole accumulator
        assert [seen[r][1][-1] for r in (0, 1)] == [rank_rows[0], rank_rows[1]]
    else:
        assert rank_rows[1] > ROWS // 2 >= rank_rows[0]
        assert 0 < seen[1][1][0] <= ROWS // 2 and seen[1][1][1] == 0   # split, then whole
        assert all(seen[r][0] == {"emb"} for r in (0, 1)), seen     # both whole at finish
    alone = run_ranks(2, lambda r, comm: _lookup_only(
        r, Comm.single("tokens"), ids[r], w, coefs[r], True, {}))
    assert not _same(alone[0], base[0]), "control"


def _tied_over_ranks(rank, comm, ids_by_mb, w, coefs, split: bool, seen: dict):
    """One rank's gradient of a tied weight (lookup, then the same weight as the LM head) over
    microbatches into a persistent sink whose scope groups are `comm`; split off: note_rows
    disabled (the whole accumulator). seen[rank] = the names finish wrote over the buckets."""
    p = torch.nn.Parameter(w.clone())
    gs = tokensum.GradSink({"dp_cp": comm, "world": comm})
    gs.begin({"emb": p}, keep={"emb"})
    if not split:
        gs.note_rows = lambda *a, **k: None
    tok = tokensum.TokenSum(comm, sink=gs)
    for ids, coef in zip(ids_by_mb, coefs):
        (y,) = column_parallel_linear(embed(ids, p, offset=OFFSET, tok=tok), [p], tok=tok)
        (y * coef).sum().backward()
    real = gs._finish_split

    def spy(name, out, later):
        real(name, out, later)
        seen[rank] = set(later)
    gs._finish_split = spy
    return gs.finish()["emb"]


def test_tied_weight_split_over_ranks_in_persistent_mode_gives_the_whole_accumulator_bytes(
        monkeypatch):
    """A tied weight on 2 ranks holding other tokens, 2 one-leaf microbatches each (persistent
    mode): each rank's lookups add to its rows' split, finish adds its dense (LM-head) sums of
    the union of both ranks' rows, sums over the ranks and writes those rows over the dense
    result — bytes == the whole accumulator (split off) on both ranks, and the union path ran.
    Control: without the union (each rank's own rows only) a row only the other rank looked
    up would miss that rank's lookup part."""
    from kernel_helpers import run_ranks

    monkeypatch.setattr(tokensum, "SPLIT_MAX_FRACTION", 1.0)
    w, _, ids, coefs = _two_rank_lookups(12, ROWS)
    seen: dict = {}

    def run(split):
        return run_ranks(2, lambda r, comm: _tied_over_ranks(r, comm, ids[r], w, coefs[r],
                                                             split, seen))
    base = run(False)
    assert seen == {0: set(), 1: set()}
    got = run(True)
    assert seen == {0: {"emb"}, 1: {"emb"}}
    for r in (0, 1):
        assert _same(got[r], base[r]) and _same(base[r], base[0])
    monkeypatch.setattr(tokensum, "_union_rows", lambda comm, rows, op: rows)
    try:
        mixed = run(True)
    except RuntimeError as e:   # 6 and 7 rows: the ranks' sums cannot even line up (a process
        assert "equal size" in str(e)   # group's signature check refuses the same call)
        mixed = None
    assert mixed is None or not all(_same(mixed[r], base[r]) for r in (0, 1)), "control"


def _direct_over_ranks(rank, comm, ids, w, coef, tied: bool, direct: bool, split: bool,
                       seen: dict, dp_cp=None):
    """One rank's gradient of an embedding over ONE microbatch (ids [2·TOKEN_LEAF]) into a sink
    whose scope groups are `comm`: tied (lookup, then the same weight as the LM head; kept) or
    lookup-only (sparse); direct or persistent mode; split off: note_rows disabled (and the
    untied weight not declared lookup-only: its whole accumulator, or direct mode's chunks).
    seen[rank] = (the names with a whole-weight accumulator or words, the split's rows) just
    before finish. dp_cp: that scope's group instead of `comm` (world stays `comm`)."""
    p = torch.nn.Parameter(w.clone())
    gs = tokensum.GradSink({"dp_cp": dp_cp or comm, "world": comm})
    gs.begin({"emb": p}, direct=direct, keep={"emb"} if tied else set(),
             sparse=set() if tied or not split else {"emb"})
    if not split:
        gs.note_rows = lambda *a, **k: None
    tok = tokensum.TokenSum(comm, sink=gs)
    h = embed(ids, p, offset=OFFSET, tok=tok)
    y = column_parallel_linear(h, [p], tok=tok)[0] if tied else h
    (y * coef).sum().backward()
    seen[rank] = (set(gs._acc) | set(gs._words),
                  gs._split["emb"][0].clone() if "emb" in gs._split else None)
    return gs.finish()["emb"]


@pytest.mark.parametrize("tied,fraction", [(True, 0.5), (False, 1.0), (False, 0.5)])
def test_direct_mode_splits_an_embedding_over_ranks_with_the_whole_accumulator_bytes(
        monkeypatch, tied, fraction):
    """Direct mode (one microbatch per rank) on 2 ranks holding other tokens: a tied embedding's
    LM-head use finishes every row directly and keeps its partials of the UNION of both ranks'
    looked-up rows, the lookups add there, finish sums that over the ranks; an untied one's
    lookup splits it over that union likewise — unless the union (11 of 12 rows here) passes
    SPLIT_MAX_FRACTION, when every rank finishes it by direct chunks instead. Bytes == the
    whole accumulator (split off) == persistent mode, on both ranks, with no whole-weight
    accumulator made. Control (tied): with each rank's own rows instead of the union, a row
    only the other rank looked up misses this rank's head part (or the ranks' sums cannot line
    up)."""
    from kernel_helpers import run_ranks

    monkeypatch.setattr(tokensum, "SPLIT_MAX_FRACTION", fraction)
    w, local, ids, coefs = _two_rank_lookups(13, ROWS if tied else H)
    ids = {r: torch.cat(x) for r, x in ids.items()}
    coef = {r: torch.cat(x) for r, x in coefs.items()}
    seen: dict = {}

    def run(direct, split):
        return run_ranks(2, lambda r, comm: _direct_over_ranks(r, comm, ids[r], w, coef[r],
                                                               tied, direct, split, seen))
    base = run(False, False)
    assert all(seen[r][0] == {"emb"} for r in (0, 1))     # the whole accumulator
    got = run(True, True)
    assert all(seen[r][0] == set() for r in (0, 1)), seen
    union = torch.unique(torch.cat([torch.cat(local[0]), torch.cat(local[1])]))
    assert union.numel() > ROWS // 2
    for r in (0, 1):
        if tied or fraction == 1.0:
            assert torch.equal(seen[r][1], union), (r, seen[r][1])
        else:
            assert seen[r][1] is None, (r, seen[r][1])
        assert _same(got[r], base[r]) and _same(base[r], base[0])
    assert _same(run(True, False)[0], base[0]) and _same(run(False, True)[1], base[0])
    if tied:
        real = tokensum._union_rows
        tokensum._union_rows = lambda comm, rows, op: rows
        try:
            mixed = run(True, True)
        except RuntimeError as e:
            assert "equal size" in str(e)
            mixed = None
        finally:
            tokensum._union_rows = real
        assert mixed is None or not all(_same(mixed[r], base[r]) for r in (0, 1)), "control"


@pytest.mark.parametrize("tied", [True, False])
def test_direct_split_is_over_the_embeddings_scope_group_not_the_world(monkeypatch, tied):
    """Direct mode on 2 ranks that are one rank each of dp_cp (TP ranks: other vocab shards,
    DP × CP of 1) but share the world group: the embedding's split covers this rank's own
    looked-up rows (4 of 12 each; their union over the world, 8, would pass SPLIT_MAX_FRACTION
    0.5) and is not summed over the world — each rank's bytes == its own one-process gradient
    (whole accumulator, split off). Control: with dp_cp the 2-rank group, the other rank's
    partials join (other bytes), so the data tells the groups apart."""
    from kernel_helpers import run_ranks

    monkeypatch.setattr(tokensum, "SPLIT_MAX_FRACTION", 0.5)
    w, local, ids, coefs = _two_rank_lookups(13, ROWS if tied else H)
    ids = {r: x[0] for r, x in ids.items()}      # rows 0-3 on rank 0, 4-7 on rank 1
    coef = {r: x[0] for r, x in coefs.items()}
    own = {r: torch.unique(local[r][0]) for r in (0, 1)}
    assert all(own[r].numel() <= ROWS // 2 for r in (0, 1))
    assert torch.unique(torch.cat([own[0], own[1]])).numel() > ROWS // 2
    seen: dict = {}
    want = [_direct_over_ranks(r, Comm.single("solo"), ids[r], w, coef[r], tied, False, False,
                               {}) for r in (0, 1)]
    got = run_ranks(2, lambda r, comm: _direct_over_ranks(
        r, comm, ids[r], w, coef[r], tied, True, True, seen, dp_cp=Comm.single("dp_cp")))
    for r in (0, 1):
        assert seen[r][0] == set() and seen[r][1] is not None, (r, seen[r])
        assert torch.equal(seen[r][1], own[r]), (r, seen[r][1])
        assert _same(got[r], want[r]), r
    summed = run_ranks(2, lambda r, comm: _direct_over_ranks(
        r, comm, ids[r], w, coef[r], tied, True, True, {}))
    assert not all(_same(summed[r], want[r]) for r in (0, 1)), "control"


@pytest.mark.parametrize("direct", [True, False])
def test_a_lookup_only_split_holds_at_exactly_split_max_fraction_of_the_rows(monkeypatch,
                                                                              direct):
    """SPLIT_MAX_FRACTION bounds the split inclusively ("past" it, the split ends): a
    lookup-only embedding whose one lookup touches exactly 6 of its 12 rows at fraction 0.5
    is split over those rows, in direct mode (GradSink._direct_split) as in persistent mode
    (_grow_split); with 7 rows (the control) it is not. Bytes == no sink either way."""
    monkeypatch.setattr(tokensum, "SPLIT_MAX_FRACTION", 0.5)
    g = torch.Generator().manual_seed(17)
    w = torch.randn(ROWS, H, generator=g)
    coef = torch.randn(TOKEN_LEAF, H, generator=g)
    for n_rows in (ROWS // 2, ROWS // 2 + 1):
        ids = torch.arange(TOKEN_LEAF) % n_rows + OFFSET     # each of rows 0..n_rows-1
        ref = torch.nn.Parameter(w.clone())
        (embed(ids, ref, offset=OFFSET) * coef).sum().backward()
        p = torch.nn.Parameter(w.clone())
        gs = tokensum.GradSink.single()
        gs.begin({"emb": p}, direct=direct, sparse={"emb"})
        tok = tokensum.TokenSum(Comm.single("tokens"), sink=gs)
        (embed(ids, p, offset=OFFSET, tok=tok) * coef).sum().backward()
        rows = gs._split["emb"][0].clone() if "emb" in gs._split else None
        assert _same(gs.finish()["emb"], ref.grad), n_rows
        if n_rows == ROWS // 2:
            assert rows is not None and torch.equal(rows, torch.arange(n_rows)), rows
        else:
            assert rows is None, rows


def test_union_rows_is_the_sorted_union_without_the_padding():
    """_union_rows over 2 thread ranks with 2 and 4 rows (the shorter padded with -1 for the
    gather): every rank gets [0, 1, 3, 5, 11] — no -1 (it would index the last row)."""
    from kernel_helpers import run_ranks

    rows = {0: torch.tensor([3, 11]), 1: torch.tensor([0, 1, 5, 11])}
    got = run_ranks(2, lambda r, comm: tokensum._union_rows(comm, rows[r], "u"))
    assert all(u.tolist() == [0, 1, 3, 5, 11] for u in got)


@pytest.mark.parametrize("later_bytes", [1, 96, 1 << 30])
def test_kept_leaf_partials_give_the_bytes_of_adding_them_at_once(monkeypatch, later_bytes):
    """GradSink.add_later (a norm weight's partials in persistent mode, kept and added in one
    pass): five microbatches' partials [k_i, H] of wide range, added as they come (the
    accumulator per call) == kept and added when they pass LATER_BYTES (1: every call; 96: every
    few; 2**30: at finish) == kept with an `accumulator` request in between (which adds them
    there), bitwise; the kept ones are really held until then. add_later refuses (False) a
    closed or direct sink. Control: the fp32 sum of the same partials in two orders differs."""
    monkeypatch.setattr(tokensum, "LATER_BYTES", later_bytes)
    g = torch.Generator().manual_seed(11)
    parts = [torch.randn(k, H, generator=g) * 2.0 ** torch.randint(-30, 30, (k, 1), generator=g)
             for k in (3, 1, 4, 2, 5)]
    w = torch.nn.Parameter(torch.ones(H))

    def run(mode: str) -> torch.Tensor:
        gs = tokensum.GradSink.single()
        gs.begin({"norm": w})
        for i, p in enumerate(parts):
            if mode == "now":
                fx.accumulate_(gs.accumulator(w, "dp_cp"), p)
                continue
            assert gs.add_later(w, p.clone(), "dp_cp")
            if later_bytes == 1 << 30 and (mode == "later" or i < 2):
                assert "norm" in gs._later and "norm" not in gs._acc     # kept, not added
            if mode == "asked" and i == 2:
                gs.accumulator(w, "dp_cp")
                assert "norm" not in gs._later
        return gs.finish()["norm"]

    now = run("now")
    for mode in ("later", "asked"):
        assert _same(run(mode), now), mode
    gs = tokensum.GradSink.single()
    assert not gs.add_later(w, parts[0], "dp_cp")               # closed
    gs.begin({"norm": w}, direct=True)
    assert not gs.add_later(w, parts[0], "dp_cp")               # direct: the kernel finishes
    flat = torch.cat(parts)
    fwd, bwd = flat.sum(0), flat.flip(0).sum(0)
    assert not _same(fwd, bwd), "control: the fp32 order does not matter here"


# ---------------------------------------------------------------------------------------------
# late activation flags (GradSink.begin(late=True)) and double words at finish


def test_late_counter_starts_at_zero_each_mini_batch_on_one_device():
    """A late sink's counter (GradSink.late_counter): int64 0 when first asked for, the same
    tensor for every kernel of the mini-batch, refused on another device in that mini-batch;
    the next begin starts from no count, so a flagged mini-batch does not make the next one run
    again. A sink opened without late hands out no counter and is never flagged."""
    sink = tokensum.GradSink.single()
    sink.begin({}, late=True)
    assert not sink.late_flagged()                 # no kernel asked for a counter
    c = sink.late_counter(torch.device("cpu"))
    assert c.dtype == torch.int64 and c.shape == () and int(c) == 0 and not sink.late_flagged()
    c.add_(3)
    assert sink.late_counter(torch.device("cpu")) is c and sink.late_flagged()
    with pytest.raises(RuntimeError, match="late flags on meta and cpu"):
        sink.late_counter(torch.device("meta"))
    sink.begin({}, late=True)
    assert not sink.late_flagged()
    assert int(sink.late_counter(torch.device("cpu"))) == 0 and not sink.late_flagged()
    sink.begin({})
    assert sink.late_counter(torch.device("cpu")) is None and not sink.late_flagged()
    sink.finish()
    assert sink.late_counter(torch.device("cpu")) is None and not sink.late_flagged()


def test_a_late_sink_counts_dw_tiles_instead_of_deferring_chunks():
    """A late sink hands every dW call its one int32 tile counter (GradSink.flag_count, the same
    tensor all mini-batch, 0 at begin) and `_defer` queues nothing: a count handed back is
    already in it, another count is added to it, no redo runs (the caller runs the mini-batch
    again instead), and late_flagged sees the tiles. Control: a sink not late hands out a new
    counter per call and redoes a chunk whose count it reads nonzero."""
    cpu = torch.device("cpu")
    sink = tokensum.GradSink.single()
    sink.begin({}, late=True)
    c = sink.flag_count(cpu)
    assert c.dtype == torch.int32 and c.shape == () and int(c) == 0
    assert sink.flag_count(cpu) is c and not sink.late_flagged()
    redone = []
    sink._defer(c, lambda: redone.append(1))            # the kernel counted nothing
    assert not sink._pending and not sink.late_flagged()
    c.add_(2)                                           # a kernel counted 2 tiles into it
    sink._defer(c, lambda: redone.append(2))
    sink._defer(torch.tensor(3, dtype=torch.int32), lambda: redone.append(3))   # its own count
    assert not sink._pending and int(c) == 5 and sink.late_flagged() and redone == []
    with pytest.raises(RuntimeError, match="late dW tiles on meta and cpu"):
        sink.flag_count(torch.device("meta"))
    sink.begin({}, late=True)
    assert not sink.late_flagged() and int(sink.flag_count(cpu)) == 0
    sink.begin({})                                      # control: not late
    a, b = sink.flag_count(cpu), sink.flag_count(cpu)
    assert a is not b
    a.add_(1)
    sink._defer(a, lambda: redone.append(4))     # a CPU count is readable at once: redone now
    assert redone == [4] and not sink.late_flagged()


@pytest.mark.parametrize("flags_first", [True, False])
def test_a_late_sink_keeps_its_two_counters_apart_and_reads_both(flags_first):
    """The attention's late flag counter (int64) and the dW tile counter (int32) are two
    tensors whichever is asked for first; a count in either one alone makes late_flagged say
    run again (a sink reading only one would skip the second pass with the other counted)."""
    cpu = torch.device("cpu")
    for counted in ("flags", "tiles"):
        sink = tokensum.GradSink.single()
        sink.begin({}, late=True)
        if flags_first:
            flags, tiles = sink.late_counter(cpu), sink.flag_count(cpu)
        else:
            tiles, flags = sink.flag_count(cpu), sink.late_counter(cpu)
        assert flags is not tiles and (flags.dtype, tiles.dtype) == (torch.int64, torch.int32)
        assert not sink.late_flagged()
        (flags if counted == "flags" else tiles).add_(1)
        assert sink.late_flagged()


def test_a_late_flag_on_one_rank_is_seen_by_every_rank():
    """late_flagged sums the counts over the world group (2 thread ranks): a count on rank 1
    only makes both answer True — a rank answering False would skip the second pass and leave
    the other alone in its collectives — and no count anywhere makes both answer False."""
    from kernel_helpers import run_ranks

    def rank(r, comm, flagged):
        sink = tokensum.GradSink({"dp_cp": Comm.single("dp_cp"), "world": comm})
        sink.begin({}, late=True)
        if r in flagged:
            sink.late_counter(torch.device("cpu")).add_(1)
        return sink.late_flagged()
    assert run_ranks(2, lambda r, comm: rank(r, comm, {1})) == [True, True]
    assert run_ranks(2, lambda r, comm: rank(r, comm, set())) == [False, False]


def _words(*pairs: tuple[float, float]) -> torch.Tensor:
    """float64 [2, n]: double words (hi, lo) per element, as the CUDA dW kernel carries them."""
    return torch.tensor(pairs, dtype=torch.float64).T.contiguous()


def test_finish_rounds_each_one_rank_weights_double_words_once(monkeypatch):
    """Two weights held in double words (GradSink.words, filled by hand as the CUDA dW kernel
    would), one per scope, both groups this rank alone: finish rounds each weight's hi + lo
    once — [1 + 2**-23, -3, +0.0]: hi + 2**-24 + 2**-60 rounds up, which rounding hi alone or
    hi + lo in float64 first (a tie, to even) would miss — the bytes of
    fixedpoint.round_double_words and of the bucket path it replaced (_round_own_words
    disabled). Controls: those two wrong roundings give 1.0."""
    words = {"a": _words((1.0, 2.0**-24 + 2.0**-60), (-3.0, 0.0), (0.0, 0.0)),
             "b": _words((2.0**-20, -2.0**-50), (5.0, 2.0**-30))}

    def finish():
        params = {n: torch.nn.Parameter(torch.zeros(w.shape[1])) for n, w in words.items()}
        sink = tokensum.GradSink.single()
        sink.begin(params)
        for (n, w), scope in zip(words.items(), tokensum.SCOPES):
            sink.words(params[n], scope).copy_(w)
        return sink.finish()
    got = finish()
    assert list(got) == ["a", "b"]
    assert got["a"].tolist() == [1.0 + 2.0**-23, -3.0, 0.0]
    assert _same(got["a"], torch.tensor([1.0 + 2.0**-23, -3.0, 0.0]))
    for n, w in words.items():
        assert _same(got[n], fx.round_double_words(w))
    assert words["a"][0, 0].float().item() == 1.0 == words["a"].sum(0)[0].float().item()
    monkeypatch.setattr(tokensum.GradSink, "_round_own_words", lambda self, scope, out: None)
    buckets = finish()
    assert all(_same(buckets[n], got[n]) for n in words)


def test_double_words_over_two_ranks_are_summed_before_rounding():
    """Double words over the world group of 2 thread ranks while the dp_cp group is each rank
    alone (as TP2 at DP1/CP1): finish sums the world weight's words over the ranks as integers
    and rounds once — 1 + 2**-24 (rank 0) and 2**-30 (rank 1) give 1 + 2**-23 on both, not
    each rank's own words rounded (1.0, 2**-30) — while the dp_cp weight is each rank's own
    words rounded."""
    from kernel_helpers import run_ranks
    mine = {0: _words((1.0, 2.0**-24), (2.0, 0.0)), 1: _words((2.0**-30, 0.0), (0.0, -0.5))}
    own = {0: _words((1.0, 2.0**-24)), 1: _words((4.0, 2.0**-21))}

    def rank(r, comm):
        params = {"v": torch.nn.Parameter(torch.zeros(1)), "w": torch.nn.Parameter(torch.zeros(2))}
        sink = tokensum.GradSink({"dp_cp": Comm.single("dp_cp"), "world": comm})
        sink.begin(params)
        sink.words(params["v"], "dp_cp").copy_(own[r])
        sink.words(params["w"], "world").copy_(mine[r])
        return sink.finish()
    got = run_ranks(2, rank)
    for r in (0, 1):
        assert got[r]["w"].tolist() == [1.0 + 2.0**-23, 1.5], (r, got[r])
        assert _same(got[r]["v"], fx.round_double_words(own[r]))
    assert got[0]["v"].item() == 1.0 and got[1]["v"].item() == 4.0 + 2.0**-21


def test_words_held_on_every_rank_are_summed_as_words_the_others_as_digits(monkeypatch):
    """Persistent finish over a world group of 2 thread ranks (dp_cp each rank alone): "w" held
    in double words on both ranks goes by Comm.finish_words (each rank's 16-byte words, the
    digits made where a slice is rounded), "u" in words on rank 0 but digits on rank 1 and "d"
    in digits on both go by sum_ints_finished (rank 0's words of "u" made digits first). Every
    gradient == round_fp32 of the sum of both ranks' exact values, on both ranks; "w" is 1 +
    2**-24 (rank 0) plus 2**-30 (rank 1) = 1 + 2**-23, not either rank's own words rounded.
    Spies: finish_words once with w's 2 elements, sum_ints_finished once with u's and d's 3.
    INT_SLICED_MIN_ELEMS lowered so both collectives run by slices."""
    from kernel_helpers import run_ranks
    from rlkernel.distributed import comm as comm_mod
    monkeypatch.setattr(comm_mod, "INT_SLICED_MIN_ELEMS", 2)
    words = {0: {"w": _words((1.0, 2.0**-24), (2.0, 0.0)), "u": _words((3.0, 2.0**-40))},
             1: {"w": _words((2.0**-30, 0.0), (0.0, -0.5))}}
    digits = {1: {"u": torch.tensor([[-1.0], [2.0**-41]]), "d": torch.tensor([[5.0, -2.0**-20]])},
              0: {"d": torch.tensor([[2.0**-10, 7.0]])}}
    calls = []
    for name in ("finish_words", "sum_ints_finished"):
        real = getattr(comm_mod.Comm, name)

        def spy(self, t, op, finish, real=real, name=name):
            calls.append((name, tuple(t.shape), op))
            return real(self, t, op, finish)
        monkeypatch.setattr(comm_mod.Comm, name, spy)

    def rank(r, comm):
        params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in (("w", 2), ("u", 1), ("d", 2))}
        sink = tokensum.GradSink({"dp_cp": Comm.single("dp_cp"), "world": comm})
        sink.begin(params)
        for n, w in words[r].items():
            sink.words(params[n], "world").copy_(w)
        for n, parts in digits[r].items():
            fx.accumulate_(sink.accumulator(params[n], "world"), parts)
        return sink.finish()
    got = run_ranks(2, rank)
    assert got[0]["w"].tolist() == [1.0 + 2.0**-23, 1.5]
    for n in ("w", "u", "d"):
        acc = fx.zeros(got[0][n].shape)
        for r in (0, 1):
            if n in words[r]:
                fx.add_double_words_(acc.view(-1, fx.N_COLS), words[r][n])
            if n in digits[r]:
                fx.accumulate_(acc, digits[r][n])
        for r in (0, 1):
            assert _same(got[r][n], fx.round_fp32(acc)), (n, r, got[r][n])
    assert sorted(set(calls)) == [("finish_words", (2, 2), "grad-sink:world:words"),
                                  ("sum_ints_finished", (3, fx.N_COLS), "grad-sink:world")]


def _late_direct(r: int, comm, dy, x, word_rows, late: bool, adds: list):
    """Rank r's gradient of w through a direct sink over `comm` (its world and dp_cp scope),
    opened late or not, the dW through finish_now with add_rows (the digits) and `word_rows`:
    (gradient or None when late_flagged, late_flagged)."""
    w = torch.nn.Parameter(torch.zeros(16, 10))
    sink = tokensum.GradSink({"dp_cp": comm, "world": comm})
    sink.begin({"w": w}, direct=True, late=late)

    def add_rows(a, b, acc):
        adds.append((r, a, b))
        mm.accumulate_grad_weight_(acc, dy[:, a:b], x)
    assert tokensum.TokenSum(comm, sink=sink).finish_now(w, add_rows, "dw",
                                                         word_rows=word_rows)
    flagged = sink.late_flagged()
    return (None if flagged else sink.finish()["w"]), flagged


def _word_model(dy: torch.Tensor, x: torch.Tensor, calls: list):
    """A CPU stand-in for the CUDA kernel's `words_grad_weight_deferred` as a word_rows hook:
    rows [a, b) of dW's leaf partials added into double words with checked TwoSum, and the
    count of elements whose checks failed (their words zeroed, as a flagged tile's are)."""
    import fixedpoint_round_cases as rc

    def rows(a, b):
        parts = mm.token_leaf_partials(dy[:, a:b], x, dy.shape[0] // TOKEN_LEAF)
        words, ok = rc.two_sum_words(parts.reshape(parts.shape[0], -1))
        calls.append((a, b))
        words = torch.where(ok, words, 0.0)
        return words.view(2, b - a, -1), (~ok).sum().to(torch.int32)
    return rows


@pytest.mark.parametrize("plant", [False, True])
def test_direct_chunks_over_two_ranks_go_as_words_in_a_late_sink(monkeypatch, plant):
    """Direct mode, DIRECT_CHUNK_ELEMS = 30 (3-row chunks of the [16, 10] weight), two thread
    ranks with half the leaves each, a late sink: every chunk comes from word_rows and is summed
    as words (Comm.finish_words), add_rows never runs, and the gradient == one rank holding all
    leaves by the digits, bytewise on both ranks. With row 9's planted partials (no double word
    holds their sum) a late sink counts the flagged element and late_flagged says run again on
    both ranks; the sink that is not late (the second pass) takes add_rows for every chunk and
    gives the same bytes. Control: rank 1's words dropped (zeros) give other bytes."""
    monkeypatch.setattr(tokensum, "DIRECT_CHUNK_ELEMS", 30)
    from kernel_helpers import run_ranks
    dy, x = _dw_operands()
    if not plant:
        dy[:, 9] = torch.randn(dy.shape[0], generator=torch.Generator().manual_seed(9))
    half = dy.shape[0] // 2
    whole = fx.round_fp32(mm.accumulate_grad_weight_(fx.zeros((16, 10)), dy, x))

    def run(late, drop=False):
        calls, adds = [], []

        def rank(r, comm):
            mine = slice(r * half, (r + 1) * half)
            hook = _word_model(dy[mine], x[mine], calls)
            if drop and r == 1:
                hook = (lambda h: lambda a, b: (torch.zeros_like(h(a, b)[0]),
                                                torch.tensor(0, dtype=torch.int32)))(hook)
            return _late_direct(r, comm, dy[mine], x[mine], hook, late, adds)
        return run_ranks(2, rank), calls, adds
    got, calls, adds = run(late=True)
    assert sorted(set(calls)) == [(a, min(16, a + 3)) for a in range(0, 16, 3)] and adds == []
    if plant:
        assert [g[1] for g in got] == [True, True]
        got, calls, adds = run(late=False)
        assert calls == [] and len(adds) == 2 * 6
    for grad, flagged in got:
        assert not flagged and _same(grad, whole)
    if not plant:
        dropped = run(late=True, drop=True)[0]
        assert not _same(dropped[0][0], whole)


def test_finish_refuses_ranks_that_hold_other_weights_before_any_sum():
    """Two thread ranks whose sinks hold different weight lists over one scope (rank 1's kernels
    never reached "v"): finish raises CollectiveMismatch on both ranks, naming the counts and the
    first name that differs, at the agreement on which weights go as words — before a bucket of
    one rank's weights is summed with another's."""
    from kernel_helpers import run_ranks

    from rlkernel.distributed.comm import CollectiveMismatch
    errors = {}

    def rank(r, comm, held):
        params = {n: torch.nn.Parameter(torch.zeros(2)) for n in ("v", "w", "x")}
        sink = tokensum.GradSink({"dp_cp": Comm.single("dp_cp"), "world": comm})
        sink.begin(params)
        for n in held[r]:
            sink.words(params[n], "world").copy_(_words((1.0, 0.0), (2.0, 0.0)))
        try:
            sink.finish()
        except CollectiveMismatch as e:
            errors[r] = str(e)
    run_ranks(2, lambda r, comm: rank(r, comm, [("v", "w"), ("w",)]))
    assert sorted(errors) == [0, 1]
    assert "finishes 2 weights, rank 1 1" in errors[0] and "0: v vs w" in errors[0]
    assert "finishes 1 weights, rank 0 2" in errors[1] and "0: w vs v" in errors[1]
    errors.clear()      # as many weights, other names: not one rank's words added to another's
    run_ranks(2, lambda r, comm: rank(r, comm, [("v", "w"), ("w", "x")]))
    assert sorted(errors) == [0, 1]
    assert "0: v vs w" in errors[0] and "0: w vs v" in errors[1]


def test_word_buckets_cut_a_weight_across_buckets_and_free_each_when_done(monkeypatch):
    """_WORD_BUCKET_ELEMS = 3: "a" (5 elements) and "b" (2), held in double words on 2 thread
    ranks, go in word buckets of 3, 3 and 1 elements (a cut inside "a" and across the two),
    each gradient == the rounded exact sum of both ranks' words on both ranks, and "a" is no
    longer held when the bucket after its last slice is sent (a spy on words_finished)."""
    from kernel_helpers import run_ranks
    monkeypatch.setattr(tokensum, "_WORD_BUCKET_ELEMS", 3)
    g = torch.Generator().manual_seed(3)
    scale = torch.tensor([[1.0], [2.0**-40]], dtype=torch.float64)
    mine = {r: {n: (torch.randn(2, k, generator=g, dtype=torch.float64) * scale * 2.0**60).round()
                * 2.0**-60 for n, k in (("a", 5), ("b", 2))} for r in (0, 1)}
    sinks, seen = {}, []
    real = tokensum.words_finished

    def spy(comm, words, op):
        seen.append((comm.rank, tuple(words.shape), sorted(sinks[comm.rank]._words)))
        return real(comm, words, op)
    monkeypatch.setattr(tokensum, "words_finished", spy)

    def rank(r, comm):
        params = {"a": torch.nn.Parameter(torch.zeros(5)), "b": torch.nn.Parameter(torch.zeros(2))}
        sinks[r] = tokensum.GradSink({"dp_cp": Comm.single("dp_cp"), "world": comm})
        sinks[r].begin(params)
        for n, w in mine[r].items():
            sinks[r].words(params[n], "world").copy_(w)
        return sinks[r].finish()
    got = run_ranks(2, rank)
    for n in ("a", "b"):
        acc = fx.zeros((mine[0][n].shape[1],))
        for r in (0, 1):
            fx.add_double_words_(acc, mine[r][n])
        assert all(_same(got[r][n], fx.round_fp32(acc)) for r in (0, 1)), n
    r0 = [s[1:] for s in seen if s[0] == 0]
    assert r0 == [((2, 3), ["a", "b"]), ((2, 3), ["a", "b"]), ((2, 1), ["b"])], r0
