"""Tests of the multi-process layer: launch, topology, groups and the validated collectives.

Multi-process tests run real ranks (gloo on CPU, 2–4 spawned processes) through
rlkernel.distributed.launch.launch. Rank bodies are module-level functions (they are pickled by name);
they write what they saw to files under tmp_path and the assertions run in the test process.
Each launch costs a few seconds of process start and `import torch` per rank, so related checks
share one launch.

Run: `.venv/bin/python -m pytest -q tests/test_dist.py`.
"""

from __future__ import annotations

import math
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from rlkernel import cli
from rlkernel.config import ConfigError
from rlkernel.distributed.comm import Comm, CollectiveMismatch
from rlkernel.distributed.launch import GRACE_S, SETTLE_S, RankFailure, RankUserError, launch
from rlkernel.distributed.topology import Topology, build_comms, single_comms, validate_topology
from rlkernel.numerics import fixedpoint as fx
from rlkernel.numerics.trees import tree_combine

TESTS_DIR = pathlib.Path(__file__).resolve().parent


def _world_comm(rank: int, world: int) -> Comm:
    return Comm("world", dist.group.WORLD, range(world), rank)


def _gone(pid: int) -> bool:
    """True when no process `pid` exists (reaped); a zombie counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _pids(d: pathlib.Path, n: int) -> list[int]:
    return [int((d / f"pid{r}").read_text()) for r in range(n)]


def _write_pid(out: str, rank: int) -> None:
    pathlib.Path(out, f"pid{rank}").write_text(str(os.getpid()))


# ---------------------------------------------------------------------------------------------
# collectives across ranks

WORLD = 4


def _adversarial_partials() -> torch.Tensor:
    """[4 ranks, n] fp32 partials whose sum depends on the order of additions.

    Every element places {1e8, 1, -1e8, 1} (plus a few other mixes) on the ranks in a different
    permutation, so whatever order a backend's sum uses, some element is rounded differently from
    the canonical pairwise tree ((x0 + x1) + (x2 + x3)).
    """
    import itertools

    cols = []
    for vals in ([1e8, 1.0, -1e8, 1.0], [3e7, -3e7, 0.75, 1.5], [1.0, 2.0**-24, 2.0**-24, -1.0]):
        cols += [list(p) for p in itertools.permutations(vals)]
    g = torch.Generator().manual_seed(0)
    rnd = (torch.randn(WORLD, 64, generator=g) * torch.logspace(-6, 6, 64)).tolist()
    return torch.cat([torch.tensor(cols, dtype=torch.float32).T, torch.tensor(rnd)], dim=1)


def _rank_input(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(*shape, generator=g) * 10.0 ** (rank * 3 - 4)


def _owner() -> torch.Tensor:
    return torch.arange(30).reshape(5, 6) * 7 % WORLD


def _collectives_rank(rank: int, out: str) -> None:
    comm = _world_comm(rank, WORLD)
    res: dict[str, object] = {}
    res["gather"] = comm.all_gather(torch.full((3,), float(rank)) + torch.arange(3.0), "g")
    res["gather_cat"] = comm.all_gather_cat(torch.full((2, 1), rank), "gc", dim=1)
    partials = _adversarial_partials()
    res["tree"] = comm.tree_all_reduce(partials[rank].clone(), "tree")
    stock = partials[rank].clone()
    dist.all_reduce(stock, op=dist.ReduceOp.SUM)  # the stock backend sum: the negative control
    res["stock"] = stock
    # select_owner: owner rank holds -0.0 at some places where the others hold +0.0
    t = _rank_input(rank, (5, 6))
    t[0] = torch.where(_owner()[0] == rank, -0.0, 0.0)
    res["select"] = comm.select_owner(t, _owner(), "sel")
    res["rs"] = comm.tree_reduce_scatter(_rank_input(rank, (8, 3)), "rs", dim=0)
    res["calls"] = comm._calls
    torch.save(res, pathlib.Path(out, f"rank{rank}.pt"))


def test_comm_collectives_across_4_ranks(tmp_path):
    """On 4 gloo ranks: all_gather is in rank order; tree_all_reduce == tree_combine(partials)
    bitwise on every rank while stock dist.all_reduce(SUM) differs; select_owner picks the owner's
    bits (sign of zero included); tree_reduce_scatter == rank's slice of the single-process tree."""
    launch(_collectives_rank, (str(tmp_path),), world_size=WORLD, timeout_s=20)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    partials = _adversarial_partials()
    tree = tree_combine(list(partials))
    rs_inputs = [_rank_input(r, (8, 3)) for r in range(WORLD)]
    rs_full = tree_combine(rs_inputs)
    sel_inputs = []
    for r in range(WORLD):
        t = _rank_input(r, (5, 6))
        t[0] = torch.where(_owner()[0] == r, -0.0, 0.0)
        sel_inputs.append(t)
    sel_expected = torch.stack(sel_inputs).gather(0, _owner().unsqueeze(0))[0]
    for r, got in enumerate(res):
        assert [x.tolist() for x in got["gather"]] == [[q, q + 1, q + 2] for q in range(WORLD)]
        assert got["gather_cat"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
        assert got["tree"].view(torch.int32).equal(tree.view(torch.int32)), f"rank {r}"
        assert got["select"].view(torch.int32).equal(sel_expected.view(torch.int32)), f"rank {r}"
        assert torch.signbit(got["select"][0]).equal(_owner()[0] == _owner()[0])  # all -0.0
        assert got["rs"].view(torch.int32).equal(rs_full[2 * r:2 * r + 2].view(torch.int32))
        assert got["calls"] == 5  # each validated call counted once
    # Negative control: the backend's own sum orders the adds differently on some element.
    stock = res[0]["stock"]
    assert all(x["stock"].equal(stock) for x in res)  # gloo is at least consistent across ranks
    assert not stock.view(torch.int32).equal(tree.view(torch.int32)), \
        "gloo's all_reduce happened to match the canonical tree on every adversarial element"
    differ = (stock.view(torch.int32) != tree.view(torch.int32)).sum().item()
    assert differ > 0


SLICED_SHAPES = [(1000,), (7, 129), (2, 3), (1,), (0, 5)]
"""numel divisible by no world size, 2-D, fewer elements than ranks (the gathered form), empty."""


def _sliced_partials(world: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Every rank's partial: the adversarial order-sensitive columns tiled over `shape`."""
    cols = _adversarial_partials()
    n = torch.Size(shape).numel()
    reps = -(-n // cols.shape[1]) if n else 0
    tiled = cols.repeat(-(-world // WORLD), reps)[:world, :n]
    return [tiled[r].reshape(shape).clone() for r in range(world)]


def _pick_owner(world: int, shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.arange(torch.Size(shape).numel()) * 7 % world).reshape(shape)


def _pick_input(world: int, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """Rank `rank`'s values for select_owner: −0.0 where it owns the element, +0.0 elsewhere
    on odd elements (a sum would give +0.0), random values on even ones."""
    n = torch.Size(shape).numel()
    g = torch.Generator().manual_seed(77 + rank)
    t = torch.randn(n, generator=g)
    own = _pick_owner(world, shape).reshape(-1) == rank
    odd = torch.arange(n) % 2 == 1
    t[odd] = torch.where(own[odd], -0.0, 0.0)
    return t.reshape(shape)


def _sliced_rank(rank: int, out: str) -> None:
    from rlkernel.distributed import comm as comm_mod
    world = dist.get_world_size()
    comm = _world_comm(rank, world)
    res = {}
    for shape in SLICED_SHAPES:
        mine = _sliced_partials(world, shape)[rank]
        pick = _pick_input(world, shape, rank)
        comm_mod.SLICED_MIN_ELEMS = 0          # the sliced form wherever it applies
        res[("sliced", shape)] = comm.tree_all_reduce(mine, f"s{shape}")
        res[("sliced-pick", shape)] = comm.select_owner(pick, _pick_owner(world, shape), "sp")
        comm_mod.SLICED_MIN_ELEMS = 1 << 62    # the gathered form
        res[("gathered", shape)] = comm.tree_all_reduce(mine, f"g{shape}")
        res[("gathered-pick", shape)] = comm.select_owner(pick, _pick_owner(world, shape), "gp")
    for dim in (0, 1):
        res[("rs", dim)] = comm.tree_reduce_scatter(_rank_input(rank, (world * 2, world * 3)),
                                                    f"rs{dim}", dim=dim)
    try:
        comm.tree_reduce_scatter(torch.zeros(world + 1, 2), "rs-bad", dim=0)
    except ValueError as e:
        res["rs-bad"] = str(e)
    torch.save(res, pathlib.Path(out, f"rank{rank}.pt"))


@pytest.mark.parametrize("world", [3, 4])
def test_sliced_tree_all_reduce_and_all_to_all_reduce_scatter_keep_the_tree_bits(tmp_path, world):
    """On 3 and 4 gloo ranks: tree_all_reduce in its sliced form (all-to-all of 1/size slices,
    each summed by the tree, all-gathered) == its gathered form == tree_combine of every rank's
    partial in one process, bitwise, for sizes no world divides, 2-D, smaller than the world and
    empty; select_owner by slices == gathered == the owner's bits (−0.0 where the owner holds
    it and the others +0.0); tree_reduce_scatter by all-to-all along dim 0 and dim 1 == this rank's slice of the
    one-process tree, and a dim that does not split evenly is a ValueError naming it. Control:
    the adversarial partials' tree over the ranks rotated by one gives other bits, so a slice
    summed in the wrong order would show (a mirrored order would not: a + b == b + a)."""
    launch(_sliced_rank, (str(tmp_path),), world_size=world, timeout_s=30)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for shape in SLICED_SHAPES:
        parts = _sliced_partials(world, shape)
        want = tree_combine(parts)
        picks = torch.stack([_pick_input(world, shape, r) for r in range(world)])
        want_pick = picks.gather(0, _pick_owner(world, shape).unsqueeze(0))[0]
        for r, got in enumerate(res):
            for form, w in (("sliced", want), ("gathered", want), ("sliced-pick", want_pick),
                            ("gathered-pick", want_pick)):
                t = got[(form, shape)]
                assert t.shape == w.shape and t.view(torch.int32).equal(w.view(torch.int32)), \
                    (form, shape, r)
    parts = _sliced_partials(world, (1000,))
    assert not tree_combine(parts[1:] + parts[:1]).view(torch.int32).equal(
        tree_combine(parts).view(torch.int32))
    full = tree_combine([_rank_input(r, (world * 2, world * 3)) for r in range(world)])
    for r, got in enumerate(res):
        for dim in (0, 1):
            n = full.shape[dim] // world
            want = full.narrow(dim, r * n, n)
            assert got[("rs", dim)].view(torch.int32).equal(want.contiguous().view(torch.int32))
        assert "does not split into" in got["rs-bad"]


INT_SHAPES = [(4096,), (4097,), (4095,), (65, 67), (3,), (0,)]
"""Rows of an integer accumulator [*S, 13]: the threshold, one past it (no world size divides
it: padded), one below (one all-reduce), 2-D, fewer rows than ranks, empty."""


def _int_acc(world: int, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """Rank `rank`'s int64 [*shape, 13] accumulator: values of either sign up to 2**40."""
    g = torch.Generator().manual_seed(1000 * world + rank)
    return torch.randint(-2**40, 2**40, (*shape, 13), generator=g, dtype=torch.int64)


def _finish(rows: torch.Tensor) -> torch.Tensor:
    """An elementwise finish [n, 13] -> [n] int64 that mixes every column (a stand-in for
    fixedpoint.round_fp32: any column lost or moved changes it)."""
    w = torch.arange(1, 14, dtype=torch.int64) * 1000003
    return (rows * w).sum(-1) ^ rows[:, 0]


def _positional(rows: torch.Tensor) -> torch.Tensor:
    """Not elementwise: row i's value depends on i within the call (the control)."""
    return _finish(rows) + torch.arange(rows.shape[0], dtype=torch.int64)


def _words(world: int, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """Rank `rank`'s float64 double words [2, *shape]: exact TwoSum accumulations of fp32
    values over 70 binades (fixedpoint_round_cases.two_sum_words), as the dW kernel leaves."""
    import fixedpoint_round_cases as rc
    g = torch.Generator().manual_seed(7000 * world + rank)
    n = math.prod(shape)
    x = torch.randn(6, n, generator=g) * torch.exp2(torch.randint(-35, 35, (6, n), generator=g))
    return rc.two_sum_words(x)[0].reshape(2, *shape)


def _round_words_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    from rlkernel.distributed.tokensum import _round_words_sum as finish
    return finish(parts)


def _positional_words(parts: list[torch.Tensor]) -> torch.Tensor:
    """Not elementwise (the control): column i gets + i·2**-10 within the call."""
    got = _round_words_sum(parts)
    return got + torch.arange(got.numel(), dtype=torch.float32) * 2.0**-10


def _ints_rank(rank: int, out: str) -> None:
    from rlkernel.distributed import comm as comm_mod
    world = dist.get_world_size()
    comm = _world_comm(rank, world)
    res = {}
    for shape in INT_SHAPES:
        acc = _int_acc(world, shape, rank)
        res[shape] = comm.sum_ints_finished(acc, f"i{shape}", _finish)
        res[("positional", shape)] = comm.sum_ints_finished(acc, f"p{shape}", _positional)
        assert torch.equal(acc, _int_acc(world, shape, rank)), "the caller's tensor changed"
        words = _words(world, shape, rank)
        res[("words", shape)] = comm.finish_words(words, f"w{shape}", _round_words_sum)
        res[("wpos", shape)] = comm.finish_words(words, f"q{shape}", _positional_words)
        assert torch.equal(words, _words(world, shape, rank)), "the caller's words changed"
    comm_mod.INT_SLICED_MIN_ELEMS = 1 << 62            # one all-reduce everywhere
    res["all-reduce"] = comm.sum_ints_finished(_int_acc(world, (4097,), rank), "a", _positional)
    res["gathered"] = comm.finish_words(_words(world, (4097,), rank), "g", _positional_words)
    try:
        comm.sum_ints_finished(torch.zeros(4096, 13), "float", _finish)
    except TypeError as e:
        res["float"] = str(e)
    torch.save(res, pathlib.Path(out, f"rank{rank}.pt"))


@pytest.mark.parametrize("world", [2, 3])
def test_sum_ints_finished_by_slices_equals_the_finished_all_reduce(tmp_path, world):
    """On 2 and 3 gloo ranks: Comm.sum_ints_finished (from INT_SLICED_MIN_ELEMS rows: each rank
    sums and finishes 1/size of the rows, all-gathered) == finish(Σ over ranks) computed in one
    process, identical on every rank, for a row count at the threshold, past it (padded), below
    it (one all-reduce), 2-D, below the world size and empty; the caller's accumulator is left
    as it was; a float tensor is a TypeError naming it. Control: a finish that is not
    elementwise (row i gets + i within the call) gives other values by slices than over all
    rows at once — the slices really were finished apart — while below the threshold and with
    the threshold lifted it matches the one-process value.
    The same for Comm.finish_words on every rank's float64 double words [2, *shape] finished by
    tokensum's exact sum (`_round_words_sum`): == round_fp32 of the sum of every rank's digits
    of its words, bytewise (int32 views), on every rank; the caller's words unchanged; the
    positional control differs by slices and matches below the threshold and lifted (every
    rank's words gathered)."""
    launch(_ints_rank, (str(tmp_path),), world_size=world, timeout_s=60)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for shape in INT_SHAPES:
        total = sum(_int_acc(world, shape, r) for r in range(world))
        want = _finish(total.reshape(-1, 13)).reshape(shape)
        for r, got in enumerate(res):
            assert got[shape].shape == want.shape and torch.equal(got[shape], want), (shape, r)
        positional = res[0][("positional", shape)]
        sliced = math.prod(shape) >= 4096
        same = torch.equal(positional, _positional(total.reshape(-1, 13)).reshape(shape))
        assert same != sliced, shape
    total = sum(_int_acc(world, (4097,), r) for r in range(world))
    assert all(torch.equal(got["all-reduce"], _positional(total)) for got in res)
    assert "expects int64, got torch.float32" in res[0]["float"]
    for shape in INT_SHAPES:
        words = [_words(world, shape, r).reshape(2, -1) for r in range(world)]
        digits = sum(fx.add_double_words_(fx.zeros((words[0].shape[1],)), w) for w in words)
        want = fx.round_fp32(digits).reshape(shape).view(torch.int32)
        for r, got in enumerate(res):
            assert got[("words", shape)].shape == shape, (shape, r)
            assert torch.equal(got[("words", shape)].view(torch.int32), want), (shape, r)
        own = _positional_words(words).reshape(shape)
        sliced = math.prod(shape) >= 4096
        assert torch.equal(res[0][("wpos", shape)], own) != sliced, shape
    every = [_words(world, (4097,), r).reshape(2, -1) for r in range(world)]
    assert all(torch.equal(got["gathered"], _positional_words(every)) for got in res)


def test_signatures_are_exchanged_on_the_cpu_when_the_group_has_a_cpu_backend(monkeypatch):
    """A device payload's call signature goes over the group's CPU backend when it has one
    ("cpu:gloo,cuda:nccl", what GPU runs use: no host sync per collective), over the payload's
    device when it has none (a bare NCCL group); CPU payloads and calls without a tensor always
    over the CPU. (A meta tensor stands for a CUDA one here.)"""
    t = torch.empty(3, device="meta")
    for config, want in (("cpu:gloo,cuda:nccl", "cpu"), ("cuda:nccl", "meta")):
        monkeypatch.setattr(dist, "get_backend_config", lambda group, c=config: c)
        comm = Comm("tp", object(), (0, 1), 0)
        assert comm._signature_device(t).type == want
        assert comm._signature_device(None).type == "cpu"
        assert comm._signature_device(torch.zeros(2)).type == "cpu"


def test_sliced_form_threshold_and_all_to_all_chunk_count():
    """The sliced form is taken from SLICED_MIN_ELEMS elements on more than two ranks (one
    fewer, or two ranks: the gathered form); all_to_all with a chunk count other than the
    group size is a ValueError naming both."""
    from rlkernel.distributed.comm import SLICED_MIN_ELEMS
    three, two = Comm("w", None, range(3), 0), Comm("w", None, range(2), 0)
    assert three._sliced_pays(torch.empty(SLICED_MIN_ELEMS))
    assert not three._sliced_pays(torch.empty(SLICED_MIN_ELEMS - 1))
    assert not two._sliced_pays(torch.empty(SLICED_MIN_ELEMS))
    t = torch.zeros(2)
    with pytest.raises(ValueError, match="2 chunks for 1 ranks"):
        Comm.single().all_to_all([t, t], "x")


def _cuda_rank(rank: int, out: str) -> None:
    world = dist.get_world_size()
    comm = _world_comm(rank, world)
    partials = [_rank_input(r, (8, 3)).cuda() for r in range(world)]
    got = comm.tree_all_reduce(partials[rank], "tree")
    direct = [torch.empty(2, device="cuda") for _ in range(world)]
    dist.all_gather(direct, torch.full((2,), float(rank), device="cuda"))  # a real NCCL call
    torch.save({"device": torch.cuda.current_device(), "tree": got.cpu(),
                "gather": [x.cpu() for x in direct]}, pathlib.Path(out, f"rank{rank}.pt"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_launch_nccl_one_rank_per_gpu(tmp_path):
    """backend nccl: rank r runs on GPU r; tree_all_reduce on CUDA tensors == tree_combine of the
    same partials on CUDA in one process, bitwise."""
    world = min(torch.cuda.device_count(), 4)
    launch(_cuda_rank, (str(tmp_path),), world_size=world, backend="nccl", timeout_s=60)
    expect = tree_combine([_rank_input(r, (8, 3)).cuda() for r in range(world)]).cpu()
    for r in range(world):
        res = torch.load(tmp_path / f"rank{r}.pt")
        assert res["device"] == r
        assert res["tree"].view(torch.int32).equal(expect.view(torch.int32))
        assert [x.tolist() for x in res["gather"]] == [[q, q] for q in range(world)]


# ---------------------------------------------------------------------------------------------
# call validation: a mismatched call fails on every rank, naming both sides


def _mismatch_rank(rank: int, out: str) -> None:
    comm = _world_comm(rank, 2)
    comm.all_gather(torch.zeros(4), "warmup")
    t = torch.zeros(4) if rank == 0 else torch.zeros(4, 5)
    op = "grad" if rank == 0 else "logits"
    t0 = time.time()
    try:
        comm.all_gather(t, op)
    except CollectiveMismatch as e:
        pathlib.Path(out, f"secs{rank}").write_text(str(time.time() - t0))
        pathlib.Path(out, f"msg{rank}").write_text(str(e))
        dist.barrier()  # both messages are on disk before the launcher stops the other rank
        if rank == 1:
            raise


def test_collective_mismatch_raises_on_every_rank_naming_both(tmp_path):
    """Rank 0 gathers grad (4,), rank 1 gathers logits (4, 5) at the same point: both ranks raise
    CollectiveMismatch naming both ranks and both shapes (no hang: each rank raised within 5 s of
    its call, where a hang would wait out the 10 s collective timeout; timed inside the ranks, so
    a slow start of the processes on a loaded machine does not count), and launch reports rank
    1's."""
    with pytest.raises(RankFailure, match="CollectiveMismatch") as info:
        launch(_mismatch_rank, (str(tmp_path),), world_size=2, timeout_s=10)
    assert all(float((tmp_path / f"secs{r}").read_text()) < 5 for r in range(2))
    assert not isinstance(info.value, ValueError)  # a program error, not a user error
    assert info.value.rank == 1 and info.value.error_type == "rlkernel.distributed.comm.CollectiveMismatch"
    for r in range(2):
        msg = (tmp_path / f"msg{r}").read_text()
        assert "rank 0" in msg and "rank 1" in msg, msg
        assert "shape (4,)" in msg and "shape (4, 5)" in msg, msg
        assert "call #2" in msg, msg


# ---------------------------------------------------------------------------------------------
# a failing rank: every rank exits with that rank's error within the timeout, nothing survives


def _fail_rank(rank: int, out: str, bad: int, how: str) -> None:
    _write_pid(out, rank)
    comm = _world_comm(rank, dist.get_world_size())
    comm.all_gather(torch.zeros(2), "step")
    if rank == bad:
        time.sleep(0.3)  # the others are already waiting in the next collective
        pathlib.Path(out, "failed_at").write_text(repr(time.time()))
        if how == "raise":
            raise ValueError("boom")
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit0":
            os._exit(0)
        if how == "hang":
            time.sleep(600)
    comm.all_gather(torch.zeros(2), "step")


def _relayed_rank(rank: int, out: str, relay: bool) -> None:
    """Rank 0 fails 0.3 s after rank 1 raises the same error relayed (as score_on_rank0 does:
    `relayed_from` set) — or, with relay False, the same error unmarked (the control)."""
    _world_comm(rank, dist.get_world_size()).all_gather(torch.zeros(2), "step")
    if rank == 0:
        time.sleep(0.3)
    err = ValueError("reward failed")
    if rank != 0 and relay:
        err.relayed_from = 0
    raise err


@pytest.mark.parametrize("relay", [True, False])
def test_a_relayed_error_names_the_rank_it_came_from(tmp_path, relay):
    """A rank that re-raises another rank's error (relayed_from, e.g. rank 0's reward error on
    every rank) does not take the blame for it even when it raises first: the launch names
    rank 0. Control: unmarked, the first to raise (rank 1) is named."""
    with pytest.raises(RankUserError) as info:
        launch(_relayed_rank, (str(tmp_path), relay), world_size=2, timeout_s=10)
    assert str(info.value) == f"rank {0 if relay else 1}: reward failed"


@pytest.mark.parametrize("bad", [1, 2])
def test_rank_raising_value_error_fails_the_launch_with_its_message(tmp_path, bad):
    """Rank k raises ValueError("boom") while the others wait in a collective → launch raises
    RankUserError (a RankFailure and a ValueError) "rank k: boom" well within timeout_s; every
    child process is gone."""
    with pytest.raises(RankUserError) as info:
        launch(_fail_rank, (str(tmp_path), bad, "raise"), world_size=3, timeout_s=10)
    elapsed = time.time() - float((tmp_path / "failed_at").read_text())
    e = info.value
    assert isinstance(e, ValueError) and isinstance(e, RankFailure)
    assert str(e) == f"rank {bad}: boom"
    assert e.rank == bad and e.error_type == "ValueError" and e.message == "boom"
    assert 'raise ValueError("boom")' in e.child_traceback
    assert elapsed < 10  # from the raise to launch's return, all ranks reaped
    assert all(_gone(p) for p in _pids(tmp_path, 3))


def test_rank_killed_by_sigkill_fails_the_launch(tmp_path):
    """Rank 2 dies of SIGKILL → RankFailure naming rank 2 and the signal (the others' "connection
    closed" errors are not blamed); every child process is gone."""
    with pytest.raises(RankFailure) as info:
        launch(_fail_rank, (str(tmp_path), 2, "sigkill"), world_size=3, timeout_s=10)
    e = info.value
    assert not isinstance(e, ValueError)
    assert str(e) == "rank 2: killed by signal SIGKILL without reporting an error"
    assert all(_gone(p) for p in _pids(tmp_path, 3))


def test_rank_that_exits_0_mid_run_is_the_one_blamed(tmp_path):
    """Rank 1 calls os._exit(0) between two collectives (no report): RankFailure naming rank 1
    as exiting with code 0 before finishing — not a peer's "connection reset" — and every child
    process is gone."""
    with pytest.raises(RankFailure) as info:
        launch(_fail_rank, (str(tmp_path), 1, "exit0"), world_size=3, timeout_s=10)
    assert str(info.value) == ("rank 1: exited with code 0 before finishing (os._exit(0)?) "
                               "without reporting an error")
    assert all(_gone(p) for p in _pids(tmp_path, 3))


def test_hung_rank_is_bounded_by_the_timeout(tmp_path):
    """Rank 1 sleeps outside any collective; the others' collective times out after timeout_s,
    launch raises within timeout_s + SETTLE_S + GRACE_S naming rank 1 (the one that never reached
    the collective, not a peer that timed out waiting for it), and the sleeping rank is killed."""
    with pytest.raises(RankFailure, match=r"^rank 1: never reached the collective that rank "
                                          r"[02] waited 3 s in; killed") as info:
        launch(_fail_rank, (str(tmp_path), 1, "hang"), world_size=3, timeout_s=3)
    elapsed = time.time() - float((tmp_path / "failed_at").read_text())
    assert info.value.rank == 1 and info.value.error_type == ""
    assert elapsed < 3 + SETTLE_S + GRACE_S + 2
    assert all(_gone(p) for p in _pids(tmp_path, 3))


def _straggler_rank(rank: int, out: str) -> None:
    _write_pid(out, rank)
    if rank == 1:
        time.sleep(600)  # outside any collective: no process-group timeout can fire


def test_rank_hanging_after_the_others_finished_is_killed_and_blamed(tmp_path):
    """Rank 0 returns, rank 1 sleeps outside any collective → after timeout_s + GRACE_S launch
    kills rank 1 and raises RankFailure naming it."""
    # timeout_s also bounds the rendezvous: 1 s was too little on a loaded 2-core machine.
    with pytest.raises(RankFailure, match=rf"^rank 1: still running {4 + GRACE_S:g} s after "
                                          "rank 0 finished"):
        launch(_straggler_rank, (str(tmp_path),), world_size=2, timeout_s=4)
    assert all(_gone(p) for p in _pids(tmp_path, 2))


def _sleep_rank(rank: int, out: str) -> None:
    _write_pid(out, rank)
    time.sleep(600)


_PARENT = """
import signal, sys
# A shell's background job starts with SIGINT ignored, and Python keeps it so: act like a
# terminal's foreground process, which is what this test is about.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
import test_dist
from rlkernel.distributed.launch import launch
launch(test_dist._sleep_rank, ({out!r},), world_size=2, timeout_s=60)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_no_rank_outlives_an_interrupted_or_killed_parent(tmp_path, sig):
    """The launching process gets Ctrl-C (it stops the ranks, then re-raises) or SIGKILL (the
    ranks die with it, PR_SET_PDEATHSIG): either way no rank process survives."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT.format(tests=str(TESTS_DIR),
                                                                     out=str(tmp_path))],
                              stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120  # a guard against a hang; spawning is slow on a loaded machine
    while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
        assert time.time() < deadline and parent.poll() is None, parent.stderr.read()
        time.sleep(0.1)
    time.sleep(0.2)
    pids = _pids(tmp_path, 2)
    parent.send_signal(sig)
    _, err = parent.communicate(timeout=GRACE_S + 10)
    if sig == signal.SIGINT:
        assert parent.returncode != 0 and "KeyboardInterrupt" in err
    deadline = time.time() + 5  # orphans are reaped by init, a moment after they die
    while not all(_gone(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)


def _ok_rank(rank: int, out: str) -> None:
    pathlib.Path(out, f"ran{rank}").write_text(f"{os.getpid()} {dist.get_world_size()}")


def test_under_torchrun_env_runs_one_rank_in_this_process(tmp_path, monkeypatch):
    """With RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, launch initialises env:// here and runs
    fn(rank) in this process; a user error comes back as RankUserError "rank 0: ..."; a world
    that differs from WORLD_SIZE is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    try:
        launch(_ok_rank, (str(tmp_path),), world_size=1, timeout_s=10)
        assert (tmp_path / "ran0").read_text() == f"{os.getpid()} 1"
        assert not dist.is_initialized()
        with pytest.raises(ConfigError, match="WORLD_SIZE=1 .* needs 2 ranks"):
            launch(_ok_rank, (str(tmp_path),), world_size=2)
        with pytest.raises(RankUserError, match=r"^rank 0: boom$"):
            launch(_fail_rank, (str(tmp_path), 0, "raise"), world_size=1, timeout_s=10)
    finally:
        if dist.is_initialized():  # left up after a failure, like a torchrun rank would
            dist.destroy_process_group()


def test_launch_refuses_a_local_function():
    def local(rank):
        pass

    with pytest.raises(TypeError, match="module-level"):
        launch(local, (), world_size=2)


# ---------------------------------------------------------------------------------------------
# topology validation (no processes)

INVALID = [
    (dict(tp=3), {}, ["--tp 3", "virtual_tp=8", "allowed: 1, 2, 4, 8"]),
    (dict(tp=16), {}, ["--tp 16", "virtual_tp=8", "allowed: 1, 2, 4, 8"]),
    (dict(rollout_tp=6), {}, ["--rollout-tp 6", "virtual_tp=8"]),
    (dict(cp=5), {}, ["--cp 5", "virtual_cp=8", "allowed: 1, 2, 4, 8"]),
    (dict(rollout_cp=3), {}, ["--rollout-cp 3", "virtual_cp=8"]),
    (dict(cp=0), {}, ["--cp 0", ">= 1"]),
    (dict(sp=True), {}, ["--sp", "--tp 1", "--tp > 1"]),
    (dict(tp=2, cp=4, world=6), {}, ["WORLD_SIZE=6", "--tp 2 × --cp 4 = 8",
                                     "a power of two up to 512); 6 is not"]),
    (dict(tp=2, cp=1, world=4), {}, ["WORLD_SIZE=4", "whose product is 4"]),
    (dict(tp=4, cp=1, world=8), {}, ["WORLD_SIZE=8", "--tp 4 × --cp 1 = 4"]),
    (dict(tp=4), dict(num_attention_heads=24, num_key_value_heads=3),
     ["--tp 4", "num_key_value_heads=3", "replicated", "allowed for this model: 1"]),
    (dict(tp=2), dict(num_attention_heads=24, num_key_value_heads=3),
     ["--tp 2", "num_key_value_heads=3", "allowed for this model: 1"]),
    (dict(tp=8), dict(num_attention_heads=8, num_key_value_heads=6),
     ["--tp 8", "num_key_value_heads=6", "allowed for this model: 1, 2"]),
    (dict(tp=8), dict(num_attention_heads=4, num_key_value_heads=4),
     ["--tp 8", "num_attention_heads=4", "allowed for this model: 1, 2, 4"]),
    (dict(rollout_tp=8), dict(num_attention_heads=4), ["--rollout-tp 8", "num_attention_heads=4"]),
    (dict(tp=2, rollout_tp=4), {}, ["--rollout-tp 4 × --rollout-cp 1 = 4", "--tp 2 × --cp 1 = 2",
                                    "allowed products: 1, 2"]),
    (dict(tp=2, cp=2, rollout_cp=8), {}, ["--rollout-cp 8 = 8", "--tp 2 × --cp 2 = 4"]),
    # issue 14: data parallelism
    (dict(dp=3), {}, ["--dp 3", "virtual_dp=8", "allowed: 1, 2, 4, 8"]),
    (dict(dp=0), {}, ["--dp 0", ">= 1"]),
    (dict(dp=2, tp=2, world=8), {}, ["WORLD_SIZE=8", "--dp 2 × --tp 2 × --cp 1 = 4"]),
    (dict(dp=2, rollout_tp=4), {}, ["--rollout-tp 4", "--dp 2 × --tp 1 × --cp 1 = 2"]),
]


@pytest.mark.parametrize("topo,model,parts", INVALID, ids=[str(t) + str(m) for t, m, _ in INVALID])
def test_invalid_topology_is_refused_naming_flag_value_and_allowed(topo, model, parts):
    kw = dict(tp=1, cp=1, sp=False, rollout_tp=1, rollout_cp=1, world=None) | topo
    with pytest.raises(ConfigError) as info:
        validate_topology(kw.pop("tp"), kw.pop("cp"), kw.pop("sp"), kw.pop("rollout_tp"),
                          kw.pop("rollout_cp"), **kw, **model)
    for p in parts:
        assert p in str(info.value), str(info.value)


VALID = [
    (dict(tp=8), dict(num_attention_heads=8, num_key_value_heads=4)),  # KV heads replicated
    (dict(tp=8, sp=True, world=8), dict(num_attention_heads=16, num_key_value_heads=8)),
    (dict(tp=2, cp=4, rollout_tp=4, world=8), dict(num_attention_heads=8, num_key_value_heads=4)),
    (dict(tp=4, cp=2, rollout_tp=2, rollout_cp=2), dict(num_attention_heads=8,
                                                         num_key_value_heads=1)),
    (dict(tp=2), dict(num_attention_heads=24, num_key_value_heads=6)),
    (dict(dp=2, tp=2, world=4), dict(num_attention_heads=8, num_key_value_heads=2)),
    (dict(dp=8, rollout_tp=8, world=8), dict(num_attention_heads=8, num_key_value_heads=2)),
]


@pytest.mark.parametrize("topo,model", VALID, ids=[str(t) + str(m) for t, m in VALID])
def test_valid_topology_is_accepted(topo, model):
    kw = dict(tp=1, cp=1, sp=False, rollout_tp=1, rollout_cp=1, world=None) | topo
    validate_topology(kw.pop("tp"), kw.pop("cp"), kw.pop("sp"), kw.pop("rollout_tp"),
                      kw.pop("rollout_cp"), **kw, **model)


def test_topology_ranks_and_groups_follow_the_documented_layout():
    """Training: rank = cp_rank * tp + tp_rank. Rollout: replica g = rank // (rtp * rcp), inside
    it rank = rollout_cp_rank * rtp + rollout_tp_rank. Every rank is in one group of each kind,
    at its own layout position."""
    t = Topology(world=8, rank=0, tp=2, cp=4, rollout_tp=2, rollout_cp=2)
    assert [(t.at(r).cp_rank, t.at(r).tp_rank) for r in range(8)] == \
        [(c, p) for c in range(4) for p in range(2)]
    assert [(t.at(r).rollout_dp_rank, t.at(r).rollout_cp_rank, t.at(r).rollout_tp_rank)
            for r in range(8)] == [(g, c, p) for g in range(2) for c in range(2) for p in range(2)]
    assert t.rollout_dp == 2
    g = t.groups()
    assert g["tp"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert g["cp"] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert g["tp_cp"] == g["world"] == [tuple(range(8))]
    assert g["rollout_tp"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert g["rollout_cp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert g["rollout_dp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    for r in range(8):
        tr = t.at(r)
        assert tr.group_ranks("tp").index(r) == tr.tp_rank
        assert tr.group_ranks("cp").index(r) == tr.cp_rank
        assert tr.group_ranks("rollout_tp").index(r) == tr.rollout_tp_rank
        assert tr.group_ranks("rollout_cp").index(r) == tr.rollout_cp_rank
        assert tr.group_ranks("rollout_dp").index(r) == tr.rollout_dp_rank
    with pytest.raises(ConfigError, match="WORLD_SIZE=6"):
        Topology(world=6, rank=0, tp=2, cp=4)
    with pytest.raises(ConfigError, match="--dp 3"):
        Topology(world=3, rank=0, dp=3)


def test_dp_topology_layout_and_groups():
    """rank = dp_rank * tp * cp + cp_rank * tp + tp_rank; tp/cp/tp_cp groups stay inside a DP
    replica; "dp" joins the ranks of one (tp_rank, cp_rank), "dp_cp" those of one tp_rank (the
    ranks that hold the other tokens of a mini-batch); rollout replicas span the whole world."""
    t = Topology(world=8, rank=0, dp=2, tp=2, cp=2)
    assert [(t.at(r).dp_rank, t.at(r).cp_rank, t.at(r).tp_rank) for r in range(8)] == \
        [(d, c, p) for d in range(2) for c in range(2) for p in range(2)]
    g = t.groups()
    assert g["tp"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert g["cp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert g["tp_cp"] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert g["dp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert g["dp_cp"] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert g["rollout_dp"] == [tuple(range(8))] and t.rollout_dp == 8
    for r in range(8):
        tr = t.at(r)
        assert tr.group_ranks("dp").index(r) == tr.dp_rank
        assert tr.group_ranks("tp").index(r) == tr.tp_rank
        assert tr.group_ranks("cp").index(r) == tr.cp_rank
        assert tr.group_ranks("dp_cp").index(r) == tr.dp_rank * 2 + tr.cp_rank
    with pytest.raises(ConfigError, match="rank 4"):
        Topology(world=4, rank=4, tp=2, cp=2)



def _cp_rank_ctx(cp: int, rank: int):
    """The one-process context with a CP comm of `cp` ranks seen from `rank` (layout math only:
    cp_local_rows reads the comm's size and rank, never its group)."""
    import dataclasses

    from rlkernel.distributed.parallel import ParallelCtx
    return dataclasses.replace(ParallelCtx.single(), cp=Comm("cp", None, range(cp), rank))


def _causal_work(rows: torch.Tensor) -> int:
    """Causal attention work of stream rows of one full-length sequence: row i sees i + 1 keys."""
    return int((rows + 1).sum())


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_ranks_hold_whole_zigzag_segments_with_equal_causal_work(cp):
    """DESIGN.md §1 (token reductions): the padded stream of L tokens is cut into 2·cp segments
    and CP rank r holds segments r and 2cp−1−r, in that order ("zig-zag for causal load
    balance"). Checked on parallel.cp_local_rows, the rows the train step and the rollout
    prefill give each CP rank: rank r's rows == segment r then segment 2cp−1−r; every row is held
    by exactly one rank; and the causal attention work Σ(i + 1) over a rank's rows is exactly
    equal on every rank (L in 128, 256, 1024). The bytes do not show the layout — the canonical
    token tree finishes segments by global id whoever holds them — so only this test pins it."""
    from rlkernel.distributed.parallel import cp_local_rows

    for length in (128, 256, 1024):
        seg = length // (2 * cp)
        full = torch.arange(length)
        held = [cp_local_rows(_cp_rank_ctx(cp, r), full) for r in range(cp)]
        for r, rows in enumerate(held):
            want = torch.cat([torch.arange(r * seg, (r + 1) * seg),
                              torch.arange((2 * cp - 1 - r) * seg, (2 * cp - r) * seg)])
            assert torch.equal(rows, want), (cp, r, length)
        assert torch.equal(torch.sort(torch.cat(held)).values, full)
        work = [_causal_work(rows) for rows in held]
        assert len(set(work)) == 1, (cp, length, work)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_negative_control_contiguous_or_r_plus_cp_split_is_unbalanced(cp):
    """Negative control for the test above: the contiguous split (rank r holds L/cp rows from
    r·L/cp) and the non-mirrored split (segments r and r + cp) give unequal causal work, so the
    work measure tells them from the zig-zag."""
    length = 1024
    seg = length // (2 * cp)
    contiguous = [torch.arange(r * 2 * seg, (r + 1) * 2 * seg) for r in range(cp)]
    shifted = [torch.cat([torch.arange(r * seg, (r + 1) * seg),
                          torch.arange((r + cp) * seg, (r + cp + 1) * seg)]) for r in range(cp)]
    for split in (contiguous, shifted):
        assert len({_causal_work(rows) for rows in split}) == cp


def test_single_comms_are_one_rank_groups():
    c = single_comms()
    for kind in ("world", "tp", "cp", "tp_cp", "rollout_tp", "rollout_cp", "rollout_dp", "dp",
                 "dp_cp"):
        comm = c.group(kind)
        assert comm.size == 1 and comm.rank == 0 and comm.group is None
        x = torch.randn(3)
        assert comm.tree_all_reduce(x, "x").equal(x)


def _comms_rank(rank: int, out: str, dp: int = 1) -> None:
    topo = Topology(world=4, rank=rank, dp=dp, tp=2, cp=2 // dp, rollout_tp=2, rollout_cp=1)
    comms = build_comms(topo)
    seen = {}
    for kind in ("world", "tp", "cp", "tp_cp", "rollout_tp", "rollout_cp", "rollout_dp", "dp",
                 "dp_cp"):
        comm = comms.group(kind)
        # the group really connects the ranks it claims, in that order
        members = comm.all_gather(torch.tensor([rank]), f"who-{kind}")
        seen[kind] = (comm.ranks, comm.rank, [int(m) for m in members])
    torch.save(seen, pathlib.Path(out, f"rank{rank}.pt"))


def test_build_comms_on_4_ranks_tp2_cp2(tmp_path):
    """tp 2, cp 2, rollout_tp 2 on 4 ranks: TP groups (0,1) (2,3); CP (0,2) (1,3); tp_cp and world
    (0..3); rollout_tp (0,1) (2,3); rollout_cp one rank each; rollout_dp (0,2) (1,3). A gather over
    each group returns exactly its members in that order."""
    launch(_comms_rank, (str(tmp_path),), world_size=4, timeout_s=20)
    expect = {"world": [(0, 1, 2, 3)], "tp": [(0, 1), (2, 3)], "cp": [(0, 2), (1, 3)],
              "tp_cp": [(0, 1, 2, 3)], "rollout_tp": [(0, 1), (2, 3)],
              "rollout_cp": [(0,), (1,), (2,), (3,)], "rollout_dp": [(0, 2), (1, 3)],
              "dp": [(0,), (1,), (2,), (3,)], "dp_cp": [(0, 2), (1, 3)]}
    _check_groups(tmp_path, expect)


def test_build_comms_on_4_ranks_dp2_tp2(tmp_path):
    """dp 2, tp 2 on 4 ranks: TP groups (0,1) (2,3) and tp_cp the same (one per DP replica); DP
    groups (0,2) (1,3), dp_cp the same (CP 1); CP one rank each. Gathers return the members."""
    launch(_comms_rank, (str(tmp_path), 2), world_size=4, timeout_s=20)
    expect = {"world": [(0, 1, 2, 3)], "tp": [(0, 1), (2, 3)], "cp": [(0,), (1,), (2,), (3,)],
              "tp_cp": [(0, 1), (2, 3)], "rollout_tp": [(0, 1), (2, 3)],
              "rollout_cp": [(0,), (1,), (2,), (3,)], "rollout_dp": [(0, 2), (1, 3)],
              "dp": [(0, 2), (1, 3)], "dp_cp": [(0, 2), (1, 3)]}
    _check_groups(tmp_path, expect)


def _check_groups(tmp_path, expect: dict) -> None:
    for r in range(4):
        seen = torch.load(tmp_path / f"rank{r}.pt")
        for kind, groups in expect.items():
            ranks, my_index, members = seen[kind]
            (group,) = [g for g in groups if r in g]
            assert ranks == group and my_index == group.index(r), (r, kind)
            assert members == list(group), (r, kind)


# ---------------------------------------------------------------------------------------------
# the CLI refuses invalid topologies before creating anything


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    d = tmp_path / "cwd"
    d.mkdir()
    monkeypatch.chdir(d)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    return d


def _model_dir(root: pathlib.Path, heads: int, kv_heads: int) -> pathlib.Path:
    import json

    from rlkernel.model.config import tiny

    d = root / "model"
    d.mkdir()
    hf = tiny().replace(num_attention_heads=heads, num_key_value_heads=kv_heads).to_hf_dict()
    (d / "config.json").write_text(json.dumps(hf))
    (d / "model.safetensors").write_bytes(b"")   # present: the layout is refused before it is read
    return d


def _rlk_run(capsys, *argv) -> tuple[int, str]:
    code = cli.main(["run", "--allow-dirty", *argv])
    out, err = capsys.readouterr()
    assert out == ""
    return code, err


def test_rlk_run_tp3_is_refused_before_any_directory(capsys, cwd):
    code, err = _rlk_run(capsys, "--tp", "3")
    assert code == 2 and err.startswith("rlk run: error: --tp 3") and "1, 2, 4, 8" in err
    assert list(cwd.iterdir()) == []


def test_rlk_run_refuses_tp_that_splits_kv_heads(capsys, cwd, tmp_path):
    model = _model_dir(tmp_path, heads=24, kv_heads=3)
    code, err = _rlk_run(capsys, "--model", str(model), "--tp", "4")
    assert code == 2 and "--tp 4" in err and "num_key_value_heads=3" in err
    assert len(err.strip().splitlines()) == 1
    assert list(cwd.iterdir()) == []


def test_rlk_run_refuses_world_size_that_is_not_dp_times_tp_times_cp(capsys, cwd, monkeypatch):
    """Under torchrun, WORLD_SIZE must be DP × TP × CP: 6 processes for --tp 2 --cp 4 (8), and
    for --dp 2 --tp 2 (4), are refused before anything is written, naming every factor."""
    for k, v in dict(RANK="0", WORLD_SIZE="6", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    code, err = _rlk_run(capsys, "--tp", "2", "--cp", "4")
    assert code == 2 and "WORLD_SIZE=6 but --dp 1 × --tp 2 × --cp 4 = 8" in err
    code, err = _rlk_run(capsys, "--dp", "2", "--tp", "2")
    assert code == 2 and "WORLD_SIZE=6 but --dp 2 × --tp 2 × --cp 1 = 4" in err
    assert list(cwd.iterdir()) == []


def test_rlk_run_refuses_rollout_group_not_dividing_the_world(capsys, cwd):
    code, err = _rlk_run(capsys, "--tp", "2", "--rollout-tp", "4")
    assert code == 2 and "--rollout-tp 4" in err and "must divide" in err
    assert list(cwd.iterdir()) == []


def test_rlk_run_prints_a_rank_user_error_in_one_line(capsys, cwd, monkeypatch):
    """A launched rank's ValueError reaches the CLI as RankUserError: exit 1, one line
    "rlk run: error: rank 3: boom", nothing left on disk (no step was recorded)."""
    import rlkernel.runner.loop as loop

    def failing_loop(cfg, run_dir, writer, read=None):
        raise RankUserError(3, "ValueError", "boom", "Traceback ...")

    monkeypatch.setattr(loop, "run_loop", failing_loop)
    code, err = _rlk_run(capsys, "--run-dir", "r")
    assert code == 1 and err.strip().splitlines() == ["rlk run: error: rank 3: boom"]
    assert list(cwd.iterdir()) == []
