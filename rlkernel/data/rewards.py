"""User reward functions (`--reward MODULE:FUNC` or `--reward path/to/file.py:FUNC`), checked and
made auditable.

A reward function is any Python callable `FUNC(prompt, completion, label) -> float`: `prompt` is
the prompt text as the dataset gives it (before any chat template), `completion` the decoded
response (up to EOS, special tokens skipped), `label` the dataset's label string. It must return a
finite int or float of magnitude at most REWARD_LIMIT (numpy scalars count; bool does not):
anything else, or an exception, stops the run with a RewardError naming the function, the sample
id and the value.

Auditability: `RewardFn.describe()` goes into manifest.json: the spec as given, the function's
qualified name, the file that defines it and that file's SHA-256. Only that one file is hashed: a
helper module the function imports is not (keep a reward self-contained to make its hash mean
"same code"). The built-in exact match (rlkernel/data/tasks.py `reward`) is described the same way.

The contract (DESIGN.md §1: advantages from the same rewards in the same order on every rank): the
RL loop calls the function on rank 0 only, once per sample in sample order, and broadcasts the list
(`score_on_rank0`). So a reward that is slow, calls a service, or is not deterministic still
gives every rank the same rewards (a non-deterministic one makes two runs differ, which their
evidence shows: rewards are recorded per step).

Does not: sandbox the function (it runs with the trainer's rights), time it out, or batch calls.
Run its tests: `.venv/bin/python -m pytest -q tests/test_data.py -k reward`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import pathlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rlkernel import readfile
from rlkernel.data import tasks
from rlkernel.termination import Terminated, real_interrupt

BUILTIN = "builtin:exact_match"
"""How the manifest names the default reward (rlkernel.data.tasks.reward)."""
REWARD_LIMIT = 1e100
"""Largest |reward| accepted. A step's reward statistics are float64: GRPO's group variance, the
evidence's mean, metrics.jsonl's std (squares of deviations of up to 2**28 rewards, summed).
Past about 1e149 they overflow (a reward of 1e300 crashed the metrics after the step's evidence
was written, and made its group's advantages 0); 1e100 keeps a wide margin and is far beyond any
reward scale that means something."""


_ALLOWED = f"a finite int or float in [-{REWARD_LIMIT:g}, {REWARD_LIMIT:g}]"


_SHOWN_CHARS = 80
"""Longest text of a returned value or raised error a RewardError quotes whole."""


def _shown(x: Any, how: Callable[[Any], str] = repr) -> str:
    """`how(x)` (repr, or str for an error) for a message: cut past _SHOWN_CHARS (a reward of
    10**400 printed its 401 digits), or x's type when that text cannot be made (an int past
    Python's digit limit, a __repr__ that raises: the message itself failed, a traceback)."""
    try:
        text = how(x)
    except Exception:
        return f"<{type(x).__name__}: {how.__name__}() failed>"
    return text if len(text) <= _SHOWN_CHARS else f"{text[:60]}... ({len(text)} characters)"


class RewardError(ValueError):
    """A reward function that cannot be loaded or that returned/raised something unusable; the
    message names the function (and the sample id and value when scoring)."""


def _exact_match(prompt: str, completion: str, label: str) -> float:
    """The built-in reward in the user-function signature: exact match of completion and label."""
    return tasks.reward(completion, label)


@dataclass(frozen=True)
class RewardFn:
    """A loaded reward function and what the manifest records about it.

    spec: the --reward value (None for the built-in); name: "MODULE:QUALNAME" of the function
    (MODULE the module name, or the file path for a file spec), used in messages;
    source_file: the absolute path of the file defining it; source_sha256: hex SHA-256 of that
    file's bytes at load time.
    """

    fn: Callable[[str, str, str], Any]
    spec: str | None
    name: str
    source_file: str
    source_sha256: str

    def describe(self) -> dict[str, Any]:
        """For manifest.json: {"spec", "function", "source_file", "source_sha256"}."""
        return {"spec": self.spec, "function": self.name, "source_file": self.source_file,
                "source_sha256": self.source_sha256}

    def score(self, prompt: str, completion: str, label: str, sample_id: int) -> float:
        """The reward of one sample as a Python float.

        Raises RewardError naming this function, `sample_id` and the value when the function
        raises, or returns a bool, a non-number, or a non-finite number.
        """
        try:
            # stdout carries only the run directory (scripts read it): a print goes to stderr
            with contextlib.redirect_stdout(sys.stderr):
                v = self.fn(prompt, completion, label)
        except BaseException as e:
            if real_interrupt(e):   # Ctrl-C, SIGTERM or SIGHUP while the reward runs: the
                raise               # user's stop, not its failure
            # the user's code: anything else it raises (sys.exit too: exit code 0 must not
            # read as a finished run; KeyboardInterrupt of its own) is the reward's failure
            raise RewardError(f"reward {self.name} raised {type(e).__name__}: "
                              f"{_shown(e, str)} on sample {sample_id} (completion "
                              f"{completion[:60]!r})") from e
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise RewardError(f"reward {self.name} returned {_shown(v)} ({type(v).__name__}) "
                              f"for sample {sample_id}; allowed: {_ALLOWED}")
        try:
            f = float(v)
        except (OverflowError, TypeError, ValueError):
            f = math.nan
        except Exception as e:   # a Real whose __float__ fails otherwise: user code too
            raise RewardError(f"reward {self.name} returned {_shown(v)} ({type(v).__name__}) "
                              f"for sample {sample_id}, which float() cannot convert "
                              f"({type(e).__name__}: {_shown(e, str)}); allowed: {_ALLOWED}"
                              ) from e
        if not math.isfinite(f):
            raise RewardError(f"reward {self.name} returned {_shown(v)} for sample {sample_id}; "
                              f"allowed: {_ALLOWED}")
        if abs(f) > REWARD_LIMIT:
            raise RewardError(f"reward {self.name} returned {_shown(v)} for sample {sample_id}; "
                              f"allowed: {_ALLOWED} (the step's reward statistics are float64 "
                              "and would overflow); scale the reward down")
        return f


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _import_file(path: pathlib.Path, spec: str):
    """Import a .py file as a module named after its path's hash (two files named reward.py do
    not collide); it is registered in sys.modules so pickling and dataclasses inside it work.
    Executed afresh on every call, so the code run is the code whose bytes were just hashed."""
    mod_name = "rlk_reward_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    loader_spec = importlib.util.spec_from_file_location(mod_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise RewardError(f"--reward {spec!r}: cannot import {path} as Python source (a file "
                          "named by --reward must be a .py file: path/to/file.py:FUNC)")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[mod_name] = module
    try:
        with contextlib.redirect_stdout(sys.stderr):   # as RewardFn.score: stdout is rlk's
            loader_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    return module


def reward_file(spec: str) -> str | None:
    """The file part of a --reward "path/to/file.py:FUNC" spec as given, or None for a
    "MODULE:FUNC" spec (imported by name from the module search path). A spec names a file when
    the part before the last ":" ends in ".py", is an absolute path, or names an existing file."""
    where = spec.rpartition(":")[0]
    if where.endswith(".py") or os.path.isabs(where) or pathlib.Path(where).is_file():
        return where
    return None


def _no_file(where: str) -> str:
    """Why --reward's path `where` (not a regular file, or not one we may stat) names no file,
    for a message: `readfile.not_a_file`'s words, as --prompts says them ("'r.py': is a
    directory, not a file", a link to nothing or a link loop, a FIFO or device, "no such
    file")."""
    return f"{where!r}: {readfile.not_a_file(where) or 'is not a regular file'}"


def load_reward(spec: str | None) -> RewardFn:
    """The reward function of `spec` ("MODULE:FUNC", "path/to/file.py:FUNC"), or the built-in
    exact match for None.

    MODULE is imported as usual (the current directory is on the path, as for `python -m`); a
    spec that names a file (`reward_file`) is imported from that file. FUNC may be dotted (a
    class attribute). The function must accept three positional arguments. Raises RewardError
    naming `spec` and what is wrong: the file or module is missing, importing it raised (its
    error is named), FUNC is missing or not callable, its signature cannot take (prompt,
    completion, label), or it has no Python source file to hash.
    """
    if spec is None:
        src = inspect.getsourcefile(tasks.reward)
        assert src is not None
        return RewardFn(_exact_match, None, BUILTIN, os.path.abspath(src), _file_sha256(src))
    where, _, func = spec.rpartition(":")
    if not where or not func:
        raise RewardError(f"--reward {spec!r}: must be MODULE:FUNC or path/to/file.py:FUNC")
    path = pathlib.Path(where)
    try:
        if reward_file(spec) is not None:
            if not path.is_file():
                raise RewardError(f"--reward {spec!r}: {_no_file(where)}; give an existing "
                                  ".py file or an importable module")
            module = _import_file(path.resolve(), spec)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` does: local modules import
            with contextlib.redirect_stdout(sys.stderr):   # as _import_file
                module = importlib.import_module(where)
    except RewardError:
        raise
    except ModuleNotFoundError as e:
        raise RewardError(f"--reward {spec!r}: cannot import module {where!r} ({e}); give an "
                          "importable module or a path to a .py file") from None
    except BaseException as e:  # the module's own top-level code failed, unless a signal came
        if real_interrupt(e):
            raise
        raise RewardError(f"--reward {spec!r}: importing {where!r} raised {type(e).__name__}: "
                          f"{e}") from None
    obj: Any = module
    parts = func.split(".")
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            if i:   # a dotted FUNC: name the part that is missing, and from what
                raise RewardError(f"--reward {spec!r}: {'.'.join(parts[:i])!r} has no attribute "
                                  f"{part!r}")
            names = sorted(n for n in vars(module) if not n.startswith("_")
                           and callable(getattr(module, n)))
            raise RewardError(f"--reward {spec!r}: {where!r} has no attribute {func!r}; callables "
                              f"there: {', '.join(names[:12]) or 'none'}")
        obj = getattr(obj, part)
    if not callable(obj):
        what = "None" if obj is None else f"of type {type(obj).__name__}"
        raise RewardError(f"--reward {spec!r}: {func!r} is {what}, not callable; give a "
                          f"function called as {func}(prompt, completion, label) -> float")
    try:
        inspect.signature(obj).bind("prompt", "completion", "label")
    except TypeError:
        raise RewardError(f"--reward {spec!r}: {func}{inspect.signature(obj)} cannot be called as "
                          f"{func}(prompt, completion, label)") from None
    except ValueError:
        pass  # no signature available (some builtins): the call itself will tell
    src = _source_file(obj)
    if src is None:
        raise RewardError(f"--reward {spec!r}: {func!r} has no Python source file to hash (a "
                          "builtin or C function?); define the reward in a .py file")
    qual = getattr(obj, "__qualname__", type(obj).__qualname__)
    name = f"{where if path.is_file() else module.__name__}:{qual}"
    return RewardFn(obj, spec, name, os.path.abspath(src), _file_sha256(src))


def _source_file(obj: Any) -> str | None:
    """The file that defines `obj` (a function, method, class, or an instance of a class)."""
    for target in (obj, type(obj)):
        try:
            src = inspect.getsourcefile(target)
        except TypeError:
            continue
        if src and os.path.isfile(src):
            return src
    return None


def score_on_rank0(reward: RewardFn, items: Sequence[tuple[str, str, str, int]], rank: int,
                   world_comm) -> list[float]:
    """Rewards of `items` (prompt, completion, label, sample_id), computed on rank 0 in order and
    broadcast, so every rank holds the same list (DESIGN.md §1). `world_comm` is the world Comm
    (rlkernel/distributed/comm.py); this is a collective: call it on every rank.

    Raises RewardError on every rank when the function fails on rank 0 (rank 0's message), so no
    rank waits for a peer that has stopped.
    """
    if rank == 0:
        try:
            result: Any = [reward.score(p, c, lab, sid) for p, c, lab, sid in items]
        except RewardError as e:
            result = str(e)
    else:
        result = None
    result = world_comm.all_gather_object(result, "rewards")[0]
    if isinstance(result, str):
        err = RewardError(result)
        if rank != 0:
            err.relayed_from = 0    # the launcher then names rank 0, where the function ran
        raise err
    return result
