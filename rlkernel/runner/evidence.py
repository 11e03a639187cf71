"""Run evidence on disk: manifest.json, evidence.json, and a one-line-per-step progress display.

`EvidenceWriter` owns a run directory's two files (DESIGN.md §4). `manifest.json` (config,
canonical spec, software/device versions, git state) is written once, at construction.
`evidence.json` ({"format", "init", "steps", "complete", "summary"}) is rewritten atomically after
every `record_init` / `record_step` / `finish`, so a crash leaves the last complete step on disk,
never a torn file. Non-finite floats are stored as the strings "nan", "inf", "-inf" (JSON has no
such numbers); every finite float is written by `repr`, which round-trips its exact bits.

Does not: decide what a step record contains (the RL loop does; the expected keys are listed on
`EvidenceWriter.record_step`), or compare runs (rlkernel/runner/compare.py).

Footgun: `versions()` asks torch for CUDA device names, which initialises CUDA in the calling
process; launchers must start workers with spawn, not fork (true of CUDA in general).

Tests: `.venv/bin/python -m pytest -q tests/test_cli_config.py tests/test_compare.py`.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import pathlib
import platform
import subprocess
import tempfile
from typing import Any

from rlkernel import readfile
from rlkernel.distributed.topology import gpus_shared

EVIDENCE_FORMAT = 1


# ---------------------------------------------------------------------------------------------
# atomic JSON


def to_json_safe(obj: Any) -> Any:
    """A copy of `obj` with non-finite floats replaced by "nan" / "inf" / "-inf", tuples as lists.

    Raises TypeError on a dict key that is not a str (JSON would silently stringify it).
    """
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"JSON object keys must be str, got {k!r} ({type(k).__name__})")
            out[k] = to_json_safe(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [to_json_safe(v) for v in obj]
    return obj


@contextlib.contextmanager
def naming_the_file(path: str | os.PathLike):
    """Re-raise an OSError that names no file (a write's or an fsync's: ENOSPC, EIO, EDQUOT) as
    one naming `path`: the run's one error line then says which file failed (a breaker saw a
    bare "[Errno 28] No space left on device" from a full disk)."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as JSON (indent=1) to `path` so readers see the old file or the new, never a mix
    (`write_bytes_atomic`). Raises TypeError for values JSON cannot hold, OSError on I/O
    failure."""
    text = json.dumps(to_json_safe(obj), indent=1, allow_nan=False) + "\n"
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so readers see the old file or the new, never a mix.

    Writes a temp file in the same directory, fsyncs it, `os.replace`s it over `path`, then fsyncs
    the directory. Raises OSError on I/O failure, naming `path` (the temp file is removed).
    """
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; evidence is meant to be shared, so use the umask's usual mode.
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with naming_the_file(path), os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open directories
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


# ---------------------------------------------------------------------------------------------
# environment


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict[str, Any]:
    """Software and device versions for the manifest.

    Keys: python, torch, triton (None when not installed), cuda (torch.version.cuda, None on CPU
    builds), platform, devices {"cpu": name, "cuda": [names]}, rlkernel. Imports torch."""
    import importlib.metadata

    import torch

    import rlkernel

    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    cuda_names = []
    if torch.cuda.is_available():
        cuda_names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
        "devices": {"cpu": _cpu_name(), "cuda": cuda_names},
        "rlkernel": rlkernel.__version__,
    }


def _git(src_dir: pathlib.Path, *args: str) -> str | None:
    # surrogateescape: a file name that is not UTF-8 (raw with -z) round-trips to its bytes
    # instead of failing the decode.
    try:
        p = subprocess.run(["git", "-C", str(src_dir), *args], capture_output=True, text=True,
                           encoding="utf-8", errors="surrogateescape", timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


DIFF_LIMIT = 1 << 20
"""Most characters of `git diff` kept in the manifest; its SHA-256 always covers all of it."""


def _status_entries(porcelain_z: str) -> list[str]:
    """The entries of `git status --porcelain -z` as "XY PATH" lines with PATH as it is: without
    -z, git quotes and octal-escapes a name with non-ASCII bytes ("rlkernel/zz \\303\\251.py"),
    which named no file (its hash was recorded as None). A rename's or copy's source path, the
    item after its entry, is dropped."""
    items = iter(porcelain_z.split("\0"))
    out = []
    for item in items:
        if item:
            out.append(item)
            if "R" in item[:2] or "C" in item[:2]:
                next(items, None)
    return out


def git_state(src_dir: str | os.PathLike) -> dict[str, Any]:
    """Git commit and dirty state of the rl-kernel source checkout at `src_dir`.

    `src_dir` is the directory holding the `rlkernel` package. Dirty means a tracked file under
    `src_dir` differs from HEAD, or an untracked (not ignored) file sits inside the `rlkernel`
    package (it would be imported); other untracked files (a model or prompts folder, runs/) are
    the user's and do not count. Returns {"commit": sha, "dirty": bool, "dirty_files": [porcelain
    lines], "diff": `git diff HEAD --binary` text of the tracked changes (None past DIFF_LIMIT
    characters), "diff_sha256": hex SHA-256 of that whole text, "untracked_package_files":
    {path: SHA-256 of its bytes}} or, when `src_dir` is not a git checkout of rl-kernel
    (installed from a wheel, git missing, or the package is not tracked by the enclosing repo),
    the same keys with None (and [] / {}). Never raises for git failures.
    """
    src = pathlib.Path(src_dir).resolve()
    unknown: dict[str, Any] = {"commit": None, "dirty": None, "dirty_files": [], "diff": None,
                               "diff_sha256": None, "untracked_package_files": {}}
    # A venv inside some other repo would otherwise report that repo's state.
    if _git(src, "ls-files", "--error-unmatch", "--", "rlkernel/__init__.py") is None:
        return unknown
    commit = _git(src, "rev-parse", "HEAD")
    tracked = _git(src, "status", "--porcelain", "-z", "--untracked-files=no", "--", ".")
    package = _git(src, "status", "--porcelain", "-z", "--untracked-files=all", "--", "rlkernel")
    diff = _git(src, "diff", "HEAD", "--binary", "--", ".")
    top = _git(src, "rev-parse", "--show-toplevel")  # porcelain paths are relative to it
    if commit is None or tracked is None or package is None or diff is None or top is None:
        return unknown
    untracked = [line for line in _status_entries(package) if line.startswith("?? ")]
    dirty = _status_entries(tracked) + untracked
    hashes = {}
    for line in untracked:
        rel = line[3:]
        try:
            data = readfile.read_bytes(pathlib.Path(top.strip()) / rel)
            hashes[rel] = hashlib.sha256(data).hexdigest()
        except OSError:
            hashes[rel] = None
    return {"commit": commit.strip(), "dirty": bool(dirty), "dirty_files": dirty,
            "diff": diff if len(diff) <= DIFF_LIMIT else None,
            "diff_sha256": hashlib.sha256(diff.encode("utf-8", "surrogateescape")).hexdigest(),
            "untracked_package_files": hashes}


def utc_now() -> str:
    """Current UTC time as ISO 8601 with a Z, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_manifest(cfg: Any, git: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a run of `cfg` (a RunConfig): config verbatim, canonical spec, versions, git.
    A CUDA run whose ranks share GPUs (RLK_SHARE_GPUS=1, launch.py's validation mode) has
    "shared": true under versions' devices."""
    found = versions()
    if cfg.device == "cuda" and gpus_shared():
        found["devices"]["shared"] = True
    return {
        "config": cfg.to_dict(),
        "canonical_spec": cfg.canonical_spec(),
        "versions": found,
        "git": git,
        "created_utc": utc_now(),
    }


# ---------------------------------------------------------------------------------------------
# progress


class Progress:
    """One line per step on stderr: step i/N, reward mean, grad norm, logprob mismatches, seconds.

    Tolerates missing keys in a record (prints "-"). Plain text when stderr is not a terminal.
    """

    def __init__(self, total: int, console: Any = None) -> None:
        from rich.console import Console

        self.total = total
        self.done = 0
        self.console = console if console is not None else Console(stderr=True, highlight=False)

    def step(self, rec: dict[str, Any]) -> None:
        self.done += 1

        def num(key: str, fmt: str) -> str:
            v = rec.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"

        t = rec.get("timings") or {}
        secs = t.get("step_s")
        line = (f"step {self.done}/{self.total}  reward {num('reward_mean', '.4f')}  "
                f"grad_norm {num('grad_norm', '.6g')}  "
                f"mismatches {rec.get('logprob_mismatches', '-')}/{rec.get('logprob_tokens', '-')}  "
                f"{format(secs, '.2f') + 's' if isinstance(secs, (int, float)) else '-'}")
        if isinstance(rec.get("step"), int):
            line += f"  (evidence step {rec['step']})"
        if rec.get("update_skipped"):
            line += "  UPDATE SKIPPED"
        if isinstance(rec.get("weight_audit"), dict) and not rec["weight_audit"].get("ok", True):
            line += "  WEIGHT AUDIT FAILED"
        self.console.print(line, markup=False, soft_wrap=True)  # one line, however narrow

    def close(self) -> None:
        self.console.file.flush()


# ---------------------------------------------------------------------------------------------
# writer


class EvidenceWriter:
    """Owner of `run_dir/manifest.json` and `run_dir/evidence.json`.

    Writes manifest.json (atomically) and an empty evidence.json at construction; raises OSError
    if `run_dir` is missing or not writable, TypeError if `manifest` is not JSON-serialisable.
    `progress`, if given, is told about every step.
    """

    def __init__(self, run_dir: str | os.PathLike, manifest: dict[str, Any],
                 progress: Progress | None = None) -> None:
        self.run_dir = pathlib.Path(run_dir)
        self.manifest = to_json_safe(manifest)
        self.progress = progress
        self.init: dict[str, Any] | None = None
        self.steps: list[dict[str, Any]] = []
        self.complete = False
        self.summary: dict[str, Any] | None = None
        write_json_atomic(self.run_dir / "manifest.json", self.manifest)
        self._flush()

    @property
    def n_steps(self) -> int:
        """Step records written so far."""
        return len(self.steps)

    def record_init(self, init: dict[str, Any]) -> None:
        """Store the initial weights record, e.g. {"version": root, "tensor_hashes": {name: sha256}}."""
        self._check_open()
        self.init = to_json_safe(init)
        self._flush()

    def record_step(self, step: dict[str, Any]) -> None:
        """Append one step record and rewrite evidence.json.

        Records are free-form JSON dicts from the loop; expected keys: step, grad_norm,
        grad_norm_hex, grad_nonfinite, update_skipped, version, tensor_hashes, version_changed,
        tokens_hash, n_samples, n_response_tokens, logprob_mismatches, logprob_tokens, rewards,
        reward_mean, loss, pg_loss, kl, entropy, clip_frac, lr, weight_audit {"ok", "problems"},
        timings {"rollout_s", "reward_s", "train_s", "export_audit_s", "step_s", "sync" (rank 0's split of
        export_audit_s: trainer_export_s, trainer_hash_s, copy_load_s, engine_check_s,
        failure_path_s, check_s: weights/sync.py SyncAudit.timings)}, resources
        {"peak_gpu_mem_gib"}; with several optimizer updates per step, updates [one record per
        update, train/ppo.py Update.record].
        `rlk compare` compares every key except timings and resources, so anything
        non-deterministic belongs under one of those.
        Raises TypeError if `step` is not a dict, RuntimeError after `finish`.
        """
        self._check_open()
        if not isinstance(step, dict):
            raise TypeError(f"step record must be a dict, got {type(step).__name__}")
        self.steps.append(to_json_safe(step))
        self._flush()
        if self.progress is not None:
            self.progress.step(step)

    def finish(self, summary: dict[str, Any]) -> None:
        """Mark the evidence complete and store `summary`. Raises RuntimeError if called twice."""
        self._check_open()
        self.summary = to_json_safe(summary)
        self.complete = True
        self._flush()

    @classmethod
    def resume(cls, run_dir: str | os.PathLike, manifest: dict[str, Any], upto: int,
               progress: Progress | None = None) -> "EvidenceWriter":
        """Continue the evidence of `run_dir`: keep its init and its first `upto` steps (later ones
        are recomputed, bit for bit, from the checkpoint), rewrite manifest.json as given."""
        w = cls.__new__(cls)
        w.run_dir = pathlib.Path(run_dir)
        w.manifest = to_json_safe(manifest)
        w.progress = progress
        data = readfile.read_json(w.run_dir / "evidence.json")
        w.init = data.get("init")
        w.steps = list(data.get("steps") or [])[:upto]
        if progress is not None:  # progress counts on from the kept steps ("step 4/6", not 1/6)
            progress.done = upto
        w.complete = False
        w.summary = None
        # Evidence first: stopped between the two writes, the run is incomplete under its old
        # manifest (resumable). The other order left complete evidence under the new --steps,
        # which `rlk compare` rightly calls edited (found by a breaker).
        w._flush()
        write_json_atomic(w.run_dir / "manifest.json", w.manifest)
        return w

    def adopt(self) -> None:
        """Reload init/steps/completion from evidence.json as another process (rank 0 of a
        launched job) left it, so the CLI sees what was written. Missing or unreadable: no-op."""
        try:
            data = readfile.read_json(self.run_dir / "evidence.json")
        except (OSError, ValueError):
            return
        self.init = data.get("init")
        self.steps = list(data.get("steps") or [])
        self.complete = data.get("complete") is True   # "false" is no completion
        self.summary = data.get("summary")

    def _check_open(self) -> None:
        if self.complete:
            raise RuntimeError(f"{self.run_dir / 'evidence.json'}: already finished")

    def _flush(self) -> None:
        write_json_atomic(self.run_dir / "evidence.json", {
            "format": EVIDENCE_FORMAT,
            "init": self.init,
            "steps": self.steps,
            "complete": self.complete,
            "summary": self.summary,
        })
