"""Shared helpers of the kernel tests (tests/test_kernels_*.py): bit comparisons, float64-oracle
tolerances, seeded inputs, and in-process ranks (threads) that run the kernels' own cross-rank trees.

The rules every kernel test follows:
Each kernel is checked two ways:
- against a float64 oracle, with a tolerance (the only place tolerances appear);
- against itself under batch / offset / shard / rank-split changes, bitwise: results are compared as
  integer bit patterns (`assert_bitwise`), never with a tolerance, so -0.0 vs +0.0 and NaN payloads count.
Every invariance test carries a negative control: the stock torch path in the same situation is
asserted to *differ* (so the test can fail). Where no failing stock control exists on this CPU
(AVX512, torch 2.13, 2 threads) the test says so in its docstring instead of faking one.
CP/TP splits of token and head reductions run as in-process ranks (threads, `ThreadComm`) through
the kernels' own `tok=` / `kv_comm=` / `head_comm=` arguments; multi-process gloo runs are the
distributed tests' job.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import struct
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rlkernel.distributed.comm import Comm
from rlkernel.distributed.parallel import cp_segments
from rlkernel.distributed.tokensum import TokenSum

U32 = 2.0**-24  # unit roundoff of fp32
NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------ helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a float tensor as same-width ints (so -0.0 != +0.0, NaN == same NaN)."""
    t = t.detach().contiguous()
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64,
                   torch.bfloat16: torch.int16}[t.dtype])


def n_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of elements whose bytes differ (shapes and dtypes must match)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    return int((bits(a) != bits(b)).sum())


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    d = n_diff(a, b)
    assert d == 0, f"{d} of {a.numel()} elements differ bitwise"


def assert_stock_differs(a: torch.Tensor, b: torch.Tensor) -> None:
    """Negative control: the stock path really does change bits in this situation."""
    assert n_diff(a, b) > 0, "negative control: stock torch did not differ here"


def ulp_dist32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|ordinal(a) - ordinal(b)| of fp32 values (ordinal: monotone int map over -inf..inf)."""
    def ordinal(x):
        i = bits(x).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (ordinal(a) - ordinal(b)).abs()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed)) * scale


def assert_near(got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    """Oracle comparison (float64 reference): |got - ref| <= atol + rtol·|ref| elementwise."""
    got64, ref = got.detach().double(), ref.detach().double()
    assert torch.isfinite(got64).all()
    err = (got64 - ref).abs()
    lim = atol + rtol * ref.abs()
    worst = float((err - lim).max())
    assert worst <= 0, f"max err {float(err.max()):.3e} exceeds tolerance (by {worst:.3e})"


def assert_within_sum_bound(got: torch.Tensor, ref: torch.Tensor, absref: torch.Tensor, n: int) -> None:
    """Rigorous fp32 summation bound: |got - exact| <= γ_n · Σ|terms|, γ_n = n·u/(1 - n·u)."""
    gamma = n * U32 / (1 - n * U32)
    err = (got.double() - ref).abs()
    assert bool((err <= gamma * absref + 1e-30).all()), float((err / (absref + 1e-30)).max())


def attention_oracle64(q, k, v, q_pos, kv_len, d_out, scale: float):
    """float64 autograd of causal GQA attention with the kernels' masks (key j visible to the
    query at position p iff j <= p and j < kv_len; padding slots and keys past kv_len are zeroed
    first, so NaN garbage cannot enter; a row that sees no key outputs 0). Shapes as
    kernels/attention.attention, any device: (out, dq, dk, dv), float64."""
    here = (q_pos >= 0)[:, None, :, None]
    j = torch.arange(k.shape[2], device=k.device)
    kmask = j[None, :] < kv_len[:, None]                                     # [S, Tk]
    q64 = torch.where(here, q.double(), 0.0).requires_grad_()
    k64, v64 = (torch.where(kmask[:, None, :, None], t.double(), 0.0).requires_grad_()
                for t in (k, v))
    g = q.shape[1] // k.shape[1]
    s = q64 @ k64.repeat_interleave(g, 1).transpose(-1, -2) * scale
    vis = (j[None, None, :] <= q_pos[:, :, None]) & kmask[:, None, :]      # [S, Tq, Tk]
    row = vis.any(-1)[:, None, :, None]
    s = s.masked_fill(~vis[:, None], float("-inf")).masked_fill(~row, 0.0)
    o = (torch.softmax(s, -1) * row) @ v64.repeat_interleave(g, 1)
    o.backward(torch.where(here, d_out.double(), 0.0))
    return o.detach(), q64.grad, k64.grad, v64.grad


# ------------------------------------------------------------------ in-process ranks
# The kernels take a TokenSum / Comm for their cross-rank reductions. To test the CP/TP contract
# without processes, ranks run as threads and `ThreadComm` implements the primitives every Comm
# collective is built on (all_gather, all_gather_object, all_to_all, the integer sum) with a
# barrier. The kernels' own code (TokenSum.result/exact_sum, Comm.tree_all_reduce) is what runs.


class _ThreadGroup:
    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots: list = [None] * n

    def exchange(self, rank: int, op: str, obj):
        self.slots[rank] = (op, obj)
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        ops = {o for o, _ in got}
        assert len(ops) == 1, f"ranks made different collective calls: {ops}"
        return [o for _, o in got]


class ThreadComm(Comm):
    def __init__(self, group: _ThreadGroup, rank: int, name: str = "threads") -> None:
        super().__init__(name, None, tuple(range(group.n)), rank)
        self._g = group

    def all_gather(self, t, op):
        # A snapshot goes in: a rank may change its tensor (sum_ints in place) as soon as the
        # exchange returns, before a slower rank has copied it.
        return [x.clone() for x in self._g.exchange(self.rank, op, t.contiguous().clone())]

    def all_gather_object(self, obj, op):
        return self._g.exchange(self.rank, op, obj)

    def all_to_all(self, chunks, op):
        got = self._g.exchange(self.rank, op, [c.contiguous() for c in chunks])
        return [sent[self.rank].clone() for sent in got]

    def sum_ints(self, t, op, *, inplace=False):
        total = torch.stack(self.all_gather(t, op)).sum(0)   # int64: exact in any order
        return t.copy_(total) if inplace else total


def run_ranks(n: int, fn):
    """fn(rank, comm) on n threads sharing one ThreadComm group -> [result of rank 0..n-1]."""
    group = _ThreadGroup(n)
    results: list = [None] * n
    errors: list = []

    def work(r):
        try:
            results[r] = fn(r, ThreadComm(group, r))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def cp_tree(comm: Comm, cp: int) -> TokenSum:
    """The token reductions of a CP rank: the other tokens are on `comm`'s ranks (no sink)."""
    return TokenSum(comm)


def cp_local_rows(length: int, cp: int, rank: int) -> torch.Tensor:
    """Stream indices of CP rank `rank`'s local stream (its segments' tokens, in order)."""
    seg = length // (2 * cp)
    return torch.cat([torch.arange(s * seg, (s + 1) * seg) for s in cp_segments(cp, rank)])




# ------------------------------------------------------------------ ranks run one after another
# Threads cannot run every kernel: the Triton interpreter keeps its launch state in globals, and
# autograd runs all CUDA backwards of one device on one worker thread. For code whose inputs to
# each collective are local (no collective result feeds a later collective's input), ranks can
# run one after another instead: pass 1 records what every rank hands each collective, pass 2
# runs them again and each collective returns what the real one would have, built from the log.


class _ReplayGroup:
    def __init__(self, n: int) -> None:
        self.n = n
        self.logs: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(n)]
        self.replay = False


class ReplayComm(Comm):
    """One rank of a `_ReplayGroup` (see above): all_gather, all_gather_object, all_to_all and
    sum_ints, the primitives of the collectives the attention backward and GradSink use
    (tree_all_reduce, TokenSum.round_exact, the finishing sums)."""

    def __init__(self, group: _ReplayGroup, rank: int) -> None:
        super().__init__("replay", None, tuple(range(group.n)), rank)
        self._g = group
        self._i = 0

    def _parts(self, op: str, t: torch.Tensor) -> list[torch.Tensor] | None:
        i, self._i = self._i, self._i + 1
        if not self._g.replay:
            self._g.logs[self.rank].append((op, t.detach().contiguous().clone()))
            return None
        parts = []
        for r in range(self._g.n):
            o, x = self._g.logs[r][i]
            assert o == op and x.shape == t.shape and x.dtype == t.dtype, \
                f"rank {r} call {i}: {o} {tuple(x.shape)} vs rank {self.rank}: {op} {tuple(t.shape)}"
            parts.append(x)
        assert torch.equal(parts[self.rank], t), f"rank {self.rank} is not deterministic at {op}"
        return parts

    def all_gather(self, t, op):
        parts = self._parts(op, t)
        return [t.contiguous()] * self.size if parts is None else parts

    def all_to_all(self, chunks, op):
        parts = self._parts(op, torch.stack(list(chunks)))   # equal-shaped chunks
        own = chunks[self.rank].contiguous()
        return [own] * self.size if parts is None else [p[self.rank] for p in parts]

    def sum_ints(self, t, op, *, inplace=False):
        parts = self._parts(op, t)
        return t if parts is None else torch.stack(parts).sum(0)   # int64: exact in any order

    def sum_ints_finished(self, t, op, finish):
        # one recorded call: the sliced form's second collective takes the first's output,
        # which the record pass cannot know (the same values: tests/test_dist.py)
        return finish(self.sum_ints(t, op).reshape(-1, t.shape[-1])).reshape(t.shape[:-1])

    def finish_words(self, words, op, finish):
        # one recorded gather, as sum_ints_finished (the same values: tests/test_dist.py)
        flat = words.reshape(words.shape[0], -1)
        return finish(self.all_gather(flat, op)).reshape(words.shape[1:])

    def all_gather_object(self, obj, op):
        i, self._i = self._i, self._i + 1
        if not self._g.replay:
            self._g.logs[self.rank].append((op, obj))
            return [obj] * self.size
        return [self._g.logs[r][i][1] for r in range(self._g.n)]


def run_ranks_sequentially(n: int, fn):
    """fn(rank, comm) for ranks 0..n-1, one after another, twice (record, then replay): the
    results of the replay pass, [rank 0..n-1], as n concurrent ranks would return them."""
    group = _ReplayGroup(n)
    for r in range(n):
        fn(r, ReplayComm(group, r))
    group.replay = True
    return [fn(r, ReplayComm(group, r)) for r in range(n)]


def interpreted_checks(script: str) -> tuple[dict, Callable]:
    """The start of a checks script that `run_interpreted_checks` runs, called before it imports
    triton: exit unless TRITON_INTERPRET=1 (the interpreter is chosen when triton is imported),
    then ({name: check}, the `@check` decorator that registers a function under its name)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(f"{Path(script).name} needs TRITON_INTERPRET=1")
    checks: dict[str, Callable] = {}

    def check(fn: Callable) -> Callable:
        checks[fn.__name__] = fn
        return fn
    return checks, check


def run_checks(checks: dict, names: list[str], skip: frozenset[str] | set[str] = frozenset()) -> None:
    """Run the named checks (or all but `skip`) of a checks script that a test runs in a
    subprocess (e.g. under TRITON_INTERPRET=1) and print one JSON line {name: "ok" or the
    traceback}: one failing check does not hide the others."""
    out = {}
    for name in names or [n for n in checks if n not in skip]:
        try:
            checks[name]()
            out[name] = "ok"
        except Exception:   # noqa: BLE001 - reported to the test, which fails on it
            out[name] = traceback.format_exc(limit=4)
    print(json.dumps(out))


class LaunchRecorder:
    """Stands in for a jitted kernel in a checks script: records each launch's positional and
    keyword arguments (`launches`: [(args, kwargs)]), then launches the kernel. For wrapper
    arguments the interpreter ignores (enable_fp_fusion, input_precision) or cannot show."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch

    @classmethod
    @contextlib.contextmanager
    def swapped_in(cls, module, name: str):
        """A recorder in place of `module.name` for the block (the kernel restored after)."""
        rec = cls(getattr(module, name))
        setattr(module, name, rec)
        try:
            yield rec
        finally:
            setattr(module, name, rec.kernel)


def check_ok(results: dict[str, str], name: str) -> None:
    """Assert that check `name` of a `run_interpreted_checks` result passed (its failure text
    otherwise)."""
    assert results.get(name) == "ok", results.get(name, f"check {name} did not run")


NEEDS_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton (interpreter / compiler)")
"""`pytestmark` of a test module whose checks need Triton (its CPU interpreter or compiler)."""


def checks_fixture(script: str):
    """A module-scoped `results` fixture: `run_interpreted_checks` of tests/<script>, run once
    for the module (assign it to `results` in the test module)."""
    @pytest.fixture(scope="module")
    def results() -> dict[str, str]:
        return run_interpreted_checks(Path(__file__).with_name(script))
    return results


def sm90_ptx(kernel, types, constexprs: dict, num_warps: int, fusion: bool) -> str:
    """PTX of a jitted kernel compiled for sm_90 on the CPU (no device needed): types, one per
    argument in order (a list zipped with the kernel's argument names, which it must match in
    number, or a {name: type} dict), constexprs by name, `fusion` = enable_fp_fusion."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = types if isinstance(types, dict) else dict(zip(kernel.arg_names, types, strict=True))
    assert list(sig) == list(kernel.arg_names), (list(sig), kernel.arg_names)
    k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "enable_fp_fusion": fusion})
    return k.asm["ptx"]


class FakeTensor:
    """A tensor argument for `sm90_as_launched`: its dtype and address (the alignment Triton
    specialises on), with no storage."""

    def __init__(self, dtype: torch.dtype, address: int = 0) -> None:
        self.dtype, self._address = dtype, address

    def data_ptr(self) -> int:
        return self._address


def fake_descriptor(dtype: torch.dtype, shape: list[int], block: list[int]):
    """A TMA descriptor argument of a contiguous [rows, cols] tensor for `sm90_as_launched`."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(FakeTensor(dtype), list(shape), [shape[1], 1], list(block))


def _sm90_compiled(kernel, args: list, kwargs: dict):
    """`kernel` compiled for sm_90 as `kernel[grid](*args, **kwargs)` would be on a GPU: Triton's
    own argument binder sees the values, so a stride of 1 becomes a constant and sizes divisible
    by 16 are marked, as on the device (`sm90_ptx` takes unspecialised types instead and can
    report other registers and spills). Tensors are FakeTensor / fake_descriptor stand-ins.
    Returns (Triton's compiled kernel, its options)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, opts)
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options=options.__dict__), options


def sm90_as_launched(kernel, args: list, kwargs: dict) -> str:
    """PTX of `kernel` for sm_90 specialised as its launch with `args`, `kwargs` would be
    (`_sm90_compiled`)."""
    return _sm90_compiled(kernel, args, kwargs)[0].asm["ptx"]


def sm90_registers(kernel, args: list, kwargs: dict) -> tuple[int, int]:
    """(registers per thread, spill store bytes) of `kernel` launched with `args`, `kwargs`
    (`_sm90_compiled`), as Triton's bundled ptxas reports them when it assembles the PTX the
    way Triton does for an H100/H200 (sm_90a, -lineinfo, --fmad=false unless the launch's
    enable_fp_fusion), on the CPU."""
    import tempfile

    import triton
    compiled, options = _sm90_compiled(kernel, args, kwargs)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(compiled.asm["ptx"])
        fmad = [] if options.enable_fp_fusion else ["--fmad=false"]
        p = subprocess.run([str(ptxas), "-lineinfo", *fmad, "-v", "--gpu-name=sm_90a", str(src),
                            "-o", str(Path(d) / "k.cubin")], capture_output=True, text=True,
                           timeout=300, check=True)
    regs = re.search(r"Used (\d+) registers", p.stderr)
    spill = re.search(r"(\d+) bytes spill stores", p.stderr)
    assert regs and spill, p.stderr
    return int(regs.group(1)), int(spill.group(1))


def ptx_double(x: float) -> str:
    """How PTX writes the float64 constant x exactly (0d + its 16 hex digits)."""
    return "0d" + struct.pack(">d", x).hex().upper()


def run_interpreted_checks(script: Path, *names: str) -> dict[str, str]:
    """Run a checks script (`run_checks` above) in a subprocess under TRITON_INTERPRET=1, with
    the repository root on PYTHONPATH; its {name: "ok" or the failure}. The interpreter is
    chosen before triton is imported, so it never leaks into the calling test process."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(script.parent.parent),
                                                       os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, str(script), *names], env=env, capture_output=True,
                       text=True, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


_UNBLOCKER = """
import os, stat, sys, time
path, (after, give_up), parent = sys.argv[1], map(float, sys.argv[2:4]), int(sys.argv[4])
time.sleep(after)
end = time.monotonic() + give_up
while time.monotonic() < end and os.getppid() == parent:
    try:
        if not stat.S_ISFIFO(os.lstat(path).st_mode):
            break
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except FileNotFoundError:
        break
    except OSError:   # ENXIO: nobody is reading now
        pass
    time.sleep(0.5)
"""


def fifo_in_place_of(path: Path, unblock_after_s: float = 20.0, give_up_s: float = 600.0) -> None:
    """Replace the file at `path` by a FIFO (what a reader must refuse, not read: opening it
    blocks until a writer comes). From `unblock_after_s` on, a watchdog process opens and
    closes its write end twice a second while the FIFO is there (for `give_up_s` at most, and
    while this process lives), so code that does read it gets an empty file and the test fails
    instead of hanging the suite. A process, not a thread: safetensors' load_file and
    tokenizers' from_file block in open holding the GIL, so a thread never ran; and every open
    is answered, not the first only (a command may read a file more than once)."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    subprocess.Popen([sys.executable, "-c", _UNBLOCKER, str(path), str(unblock_after_s),
                      str(give_up_s), str(os.getpid())], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
