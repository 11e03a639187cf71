"""Start the ranks of a job: `world_size` local processes, or this process as one torchrun rank.

`launch(fn, args, world_size=N)` runs `fn(rank, *args)` on every rank with the default
torch.distributed process group initialised (gloo on CPU; on CUDA "cpu:gloo,cuda:nccl", one GPU per
rank, so CUDA tensors go through NCCL and the CPU tensors of signatures and exact sums through gloo):

- Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) this process is one rank: the
  group is initialised from env:// and fn runs here; an exception of fn is re-raised as
  RankFailure/RankUserError for this rank, and torchrun's agent stops the other ranks.
- Otherwise N processes are started with the `spawn` start method. The parent hosts the rendezvous
  store on 127.0.0.1 (the OS picks a free port, so two launches never race for one) and each child
  gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT in its environment, one intra-op thread
  (2-core machines run up to 8 ranks) and gloo bound to loopback unless GLOO_SOCKET_IFNAME is set.

Failure handling (spawned mode): each child reports its exception (type, message, traceback) to
the parent through a pipe before it exits. The parent watches every child; at the first failure it
terminates the others (SIGTERM, then SIGKILL after GRACE_S; their finally blocks do not run: the
caller owns cleanup such as the run directory), waits for all of them, and raises
RankFailure naming the rank that failed first — or RankUserError (a ValueError) when that rank's
error was a user error (ValueError/OSError), so the CLI prints one line: "rank 3: <message>".
A rank that fails because a peer vanished or a collective timed out ("Connection closed by peer",
"Timed out waiting ...") is only blamed if no rank reports a primary error within SETTLE_S. A rank
still running timeout_s + GRACE_S after another finished is killed and blamed (a hang outside any
collective; inside one, the process-group timeout fires first); one that finished fn but has not
exited GRACE_S after the last rank finished is stopped without blame. Children die with the parent
(PR_SET_PDEATHSIG on Linux), ignore Ctrl-C (the parent stops them), and nothing outlives
`launch`, also when the parent is interrupted.

Footguns: `fn` is pickled by reference (and `args` by value), so fn must be a module-level
function of an importable module, and the main module must guard its script body with
`if __name__ == "__main__":` (spawn re-imports it). A one-rank job still starts one process; a
caller that wants no process group at all uses rlkernel.distributed.topology.single_comms() instead.

Ranks sharing GPUs (validation only): NCCL refuses two ranks on one GPU, so a machine with fewer
GPUs than ranks cannot run a multi-rank CUDA job as it would in production. With RLK_SHARE_GPUS=1
(`cuda_backend`) the group is "cpu:gloo,cuda:gloo": rank r uses GPU r mod the visible count and
CUDA payloads go through gloo, staged through host memory by rlkernel/distributed/comm.py (the same
bytes; slow). It exists so that one GPU can check the multi-rank code paths — the kernels, shard
trees and collectives' trees of TP/CP/DP — against TP1 bit for bit; it is not a way to train.

Does not: decide the topology (rlkernel/distributed/topology.py) or create subgroups (build_comms).
Tests: `.venv/bin/python -m pytest -q tests/test_dist.py`.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from rlkernel.config import ConfigError
from rlkernel.distributed.topology import gpus_shared, launcher_world_size

GRACE_S = 3.0
"""Seconds between SIGTERM and SIGKILL when the launcher stops ranks."""
SETTLE_S = 1.0
"""After a rank fails on a lost peer or a timeout, how long to wait for the rank that caused it."""
_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "Timed out waiting", "Socket Timeout", "timed out after")
_MAX_TEXT = 20_000


class RankFailure(RuntimeError):
    """A rank of a launched job failed. str(): "rank K: [Type: ]message" (+ its traceback).

    rank: the global rank that failed first. error_type: its exception's qualified name ('' when
    it died without one: exit code or signal). message: its message. child_traceback: its formatted
    traceback ('' when none).
    """

    def __init__(self, rank: int, error_type: str, message: str, child_traceback: str = "") -> None:
        self.rank = rank
        self.error_type = error_type
        self.message = message
        self.child_traceback = child_traceback
        super().__init__(self._text())

    def _text(self) -> str:
        text = f"rank {self.rank}: {self.error_type}: {self.message}" if self.error_type \
            else f"rank {self.rank}: {self.message}"
        if self.child_traceback:
            text += f"\n\n--- traceback of rank {self.rank} ---\n{self.child_traceback.rstrip()}"
        return text

    def __reduce__(self):
        return type(self), (self.rank, self.error_type, self.message, self.child_traceback)


class RankUserError(RankFailure, ValueError):
    """A rank failed on a user error (ValueError or OSError there: a bad input, a failed check).

    str() is one line, "rank K: message", like the ValueError it stands for; the rank's traceback
    is kept in child_traceback.
    """

    def _text(self) -> str:
        return f"rank {self.rank}: {self.message or self.error_type}"


def cuda_backend() -> str:
    """The process-group backend of a CUDA job: "cpu:gloo,cuda:nccl" (one GPU per rank), or
    "cpu:gloo,cuda:gloo" when `gpus_shared()`. ConfigError for a malformed RLK_SHARE_GPUS."""
    return "cpu:gloo,cuda:gloo" if gpus_shared() else "cpu:gloo,cuda:nccl"


def _on_cuda(backend: str) -> bool:
    """Whether a backend string carries CUDA tensors ("nccl", "cpu:gloo,cuda:nccl/gloo")."""
    return "nccl" in backend or "cuda:" in backend


def _rank_gpu(local_rank: int) -> int:
    """The GPU of a CUDA rank: its local rank, or round robin over the visible GPUs when they
    are shared (with NCCL each rank has a GPU of its own: the launcher's world check)."""
    return local_rank % max(torch.cuda.device_count(), 1)


def launch(fn: Callable[..., Any], args: tuple = (), *, world_size: int, backend: str = "gloo",
           timeout_s: float = 120.0) -> None:
    """Run fn(rank, *args) on `world_size` ranks (see module doc). Returns when all succeeded.

    fn: a module-level function (pickled by name). backend: "gloo" (CPU), or a backend string
    naming a CUDA backend (`cuda_backend()`: "cpu:gloo,cuda:nccl", rank r on GPU LOCAL_RANK; or
    "cpu:gloo,cuda:gloo", ranks sharing the GPUs round robin).
    timeout_s bounds every collective wait and the rendezvous.
    Raises RankFailure / RankUserError naming the failing rank; ConfigError when torchrun's
    WORLD_SIZE differs from world_size; TypeError when fn cannot be pickled by name.
    """
    qual = getattr(fn, "__qualname__", "")
    if not callable(fn) or "<locals>" in qual or "<lambda>" in qual:
        raise TypeError(f"launch: fn must be a module-level function (it is pickled by name for "
                        f"the spawned ranks), got {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"launch: world_size {world_size!r} must be an integer >= 1")
    if not timeout_s > 0:
        raise ConfigError(f"launch: timeout_s {timeout_s!r} must be > 0")
    world = launcher_world_size()
    if world is not None:
        _run_this_rank(fn, args, world, world_size, backend, timeout_s)
        return
    job = _Job(world_size, timeout_s)
    try:
        job.start(fn, args, backend)
        job.watch()
    finally:
        job.stop()
    failure = job.verdict()
    if failure is not None:
        raise failure


# ---------------------------------------------------------------------------------------------
# one rank under torchrun


def _run_this_rank(fn, args, world: int, world_size: int, backend: str, timeout_s: float) -> None:
    rank = int(os.environ["RANK"])
    if world != world_size:
        raise ConfigError(f"WORLD_SIZE={world} (from the launcher's environment) but this job "
                          f"needs {world_size} ranks")
    own = not dist.is_initialized()
    if own:
        if _on_cuda(backend):
            torch.cuda.set_device(_rank_gpu(int(os.environ.get("LOCAL_RANK", "0"))))
        dist.init_process_group(backend, init_method="env://",
                                timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, *args)
    except Exception as e:  # KeyboardInterrupt/SystemExit pass through unchanged
        r = _report(rank, e)
        cls = RankUserError if r["user"] else RankFailure
        raise cls(rank, r["type"], r["message"], r["traceback"]) from e
    if own:  # not after a failure: a pending collective can block the teardown
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# the child side of spawned mode


def _is_peer_loss(e: BaseException) -> bool:
    """An error that another rank's failure can cause: a lost peer or a timed-out collective."""
    if isinstance(e, (dist.DistError, ConnectionError)):
        return True
    return isinstance(e, RuntimeError) and any(p in str(e) for p in _PEER_LOSS)


def _report(rank: int, e: BaseException) -> dict[str, Any]:
    # A relayed error (another rank's failure raised here too, e.g. rank 0's reward error on
    # every rank: `relayed_from`) counts like a lost peer: the rank that failed first is named.
    relayed = getattr(e, "relayed_from", None) is not None
    peer_loss = _is_peer_loss(e)
    return {
        "rank": rank, "ok": False, "time": time.time(),
        "type": type(e).__qualname__ if type(e).__module__ == "builtins"
        else f"{type(e).__module__}.{type(e).__qualname__}",
        "message": str(e)[:_MAX_TEXT],
        "traceback": "".join(traceback.format_exception(e))[-_MAX_TEXT:],
        "user": isinstance(e, (ValueError, OSError)) and not peer_loss,
        "peer_loss": peer_loss or relayed,
    }


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored while a rank process is spawned, so that it starts ignoring it: an ignored
    signal stays ignored across exec, and Python keeps it so. Without it a Ctrl-C in the
    seconds a rank spends importing torch, before `_child` can ignore it, printed that rank's
    KeyboardInterrupt traceback. The parent's own handler is back as soon as the rank is
    started (a Ctrl-C within those milliseconds is lost). Main thread only (signal's rule)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _child(rank: int, world_size: int, backend: str, timeout_s: float, port: int, parent_pid: int,
           fn: Callable[..., Any], args: tuple, conn: mpc.Connection) -> None:
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if _on_cuda(backend):
            torch.cuda.set_device(_rank_gpu(rank))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        # Every rank through its init (gloo: its full mesh of connections) before any rank's
        # function runs: a rank whose function returns at once and exits closed its sockets
        # while a slower peer was still connecting, which then failed with gloo's "Connection
        # closed by peer" instead of running (seen on a loaded 2-core machine).
        store.set(f"rlk/initialised/{rank}", "1")
        store.wait([f"rlk/initialised/{r}" for r in range(world_size)], timeout)
        fn(rank, *args)
        dist.destroy_process_group()
    except SystemExit as e:
        if e.code not in (0, None):
            _fail(conn, rank, e)
    except BaseException as e:  # noqa: BLE001 — every failure is reported to the parent
        _fail(conn, rank, e)
    conn.send({"rank": rank, "ok": True, "time": time.time()})
    conn.close()


def _fail(conn: mpc.Connection, rank: int, e: BaseException) -> None:
    try:
        conn.send(_report(rank, e))
        conn.close()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Not a normal exit: interpreter teardown with a collective still pending can block or
        # abort ("terminate called without an active exception").
        os._exit(1)


# ---------------------------------------------------------------------------------------------
# the parent side of spawned mode


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return str(n)


class _Job:
    """The children of one launch, what they reported, and how they ended."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.n = world_size
        self.timeout_s = timeout_s
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.readers: dict[int, mpc.Connection] = {}
        self.reports: dict[int, dict[str, Any]] = {}
        self.exits: dict[int, tuple[int, float]] = {}  # rank -> (exitcode, seen at)
        self.stopped: set[int] = set()  # ranks this launcher terminated
        self.hung: tuple[int, int] | None = None  # (hung rank, rank that had finished)
        self.store: Any = None

    def start(self, fn, args: tuple, backend: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # The parent hosts the rendezvous store: port 0 lets the OS pick a free port, and the port
        # stays ours for the whole job (no pick-then-bind race between concurrent launches).
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout,
                                   wait_for_workers=False)
        for rank in range(self.n):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"rlk-rank{rank}",
                            args=(rank, self.n, backend, self.timeout_s, self.store.port,
                                  os.getpid(), fn, args, writer))
            self.readers[rank] = reader
            try:
                with _sigint_ignored():
                    p.start()
            finally:
                writer.close()  # the child holds the only write end: EOF when it dies
            self.procs.append(p)

    # -- watching
    def _poll(self) -> None:
        now = time.time()
        for rank, p in enumerate(self.procs):  # exits first: a report is sent before the exit
            if rank not in self.exits and p.exitcode is not None:
                self.exits[rank] = (p.exitcode, now)
        for rank, reader in list(self.readers.items()):
            try:
                while reader.poll():
                    self.reports[rank] = reader.recv()
            except (EOFError, OSError):
                reader.close()
                del self.readers[rank]

    def _failures(self) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
        """(primary, secondary) failures as (time, rank); secondary = lost peer or timeout."""
        primary, secondary = [], []
        for rank, rep in self.reports.items():
            if not rep["ok"]:
                (secondary if rep["peer_loss"] else primary).append((rep["time"], rank))
        for rank, (code, seen) in self.exits.items():
            # Died without a word: a signal, os._exit(n) — code 0 too, since a rank that ends
            # fn (or raises) always reports before it exits.
            if rank not in self.stopped and rank not in self.reports:
                primary.append((seen, rank))
        return sorted(primary), sorted(secondary)

    def _finished(self) -> dict[int, float]:
        """rank -> when it finished fn: its "ok" report."""
        return {r: rep["time"] for r, rep in self.reports.items() if rep["ok"]}

    def watch(self) -> None:
        """Return when every child has exited, or a failure (or hang) is decided."""
        while True:
            self._poll()
            running = [r for r in range(self.n) if r not in self.exits]
            if not running:
                return
            primary, secondary = self._failures()
            now = time.time()
            if primary or (secondary and now >= secondary[0][0] + SETTLE_S):
                return
            done = self._finished()
            unfinished = [r for r in running if r not in done]
            if done and not unfinished and now > max(done.values()) + GRACE_S:
                return  # every rank finished fn; one is slow to exit: stop() ends it
            if done and unfinished and now > min(done.values()) + self.timeout_s + GRACE_S:
                self.hung = (unfinished[0], min(done, key=done.__getitem__))
                return
            mpc.wait(list(self.readers.values()) + [self.procs[r].sentinel for r in running],
                     timeout=0.2)

    def stop(self) -> None:
        """Terminate every child still running (SIGTERM, SIGKILL after GRACE_S); reap all."""
        alive = [(r, p) for r, p in enumerate(self.procs) if p.exitcode is None]
        for r, p in alive:
            self.stopped.add(r)
            p.terminate()
        deadline = time.time() + GRACE_S
        while any(p.exitcode is None for _, p in alive) and time.time() < deadline:
            mpc.wait([p.sentinel for _, p in alive if p.exitcode is None],
                     timeout=max(0.0, deadline - time.time()))
        for _, p in alive:
            if p.exitcode is None:
                p.kill()
        for p in self.procs:
            p.join()
        self._poll()  # reports written before the children died
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()
        self.store = None

    # -- the verdict
    def verdict(self) -> RankFailure | None:
        """The failure to raise (the earliest primary one), or None when every rank succeeded."""
        primary, secondary = self._failures()
        stuck = sorted(r for r in self.stopped if r not in self.reports)
        if secondary and not primary and stuck:
            # Ranks timed out in a collective that a rank still running never reached: that
            # rank hung outside the collectives (e.g. in a reward function); blame it.
            _, waiter = secondary[0]
            return RankFailure(stuck[0], "", f"never reached the collective that rank {waiter} "
                                             f"waited {self.timeout_s:g} s in; killed (hung "
                                             "outside a collective, e.g. in a reward function?)")
        if primary or secondary:
            _, rank = (primary or secondary)[0]
            rep = self.reports.get(rank)
            if rep is not None and not rep["ok"]:
                cls = RankUserError if rep["user"] else RankFailure
                return cls(rank, rep["type"], rep["message"], rep["traceback"])
            code = self.exits[rank][0]
            how = f"exited with code {code}" if code >= 0 else f"killed by signal {_signame(-code)}"
            if code == 0:
                how += " before finishing (os._exit(0)?)"
            return RankFailure(rank, "", f"{how} without reporting an error")
        if self.hung is not None:
            rank, done = self.hung
            return RankFailure(rank, "", f"still running {self.timeout_s + GRACE_S:g} s after "
                                         f"rank {done} finished; killed (hung outside a "
                                         "collective?)")
        return None
