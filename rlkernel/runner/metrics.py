"""Per-step files a user watches: metrics.jsonl, completions.jsonl and (optional) TensorBoard.

Only rank 0 writes them (rlkernel/runner/watch.py owns the sink). They are views for people and
plots, not evidence: evidence.json stays the record that `rlk compare` checks, and a metrics row
is a pure function of a step's evidence record (`metrics_row`), so `rlk report` can also draw a
run that has no metrics.jsonl.

Crash safety: each step's lines are encoded first and appended with one write on an O_APPEND
descriptor, then fsync'ed, so a crash between steps leaves whole lines. A write cut by a crash
inside it (a kill during a multi-page write, a full disk) can leave a last line without its
newline: readers (`read_jsonl`) drop such a line, and a resume rewrites each file atomically
keeping only the whole lines of the steps before its checkpoint (`truncate_jsonl`), because the
steps after it are recomputed.

metrics.jsonl, one object per step (floats as JSON numbers; NaN/Inf as "nan"/"inf"/"-inf"):
  step; reward_mean, reward_std (population std of the step's rewards); response_len_mean
  (tokens per sample); loss, pg_loss, kl, entropy (as the evidence: --loss-agg means, averaged
  over the step's updates); clip_frac (clipped tokens / tokens over the updates); grad_norm (first
  update), grad_norms (every update, when a step makes several); lr (first update);
  logprob_mismatches, logprob_tokens; tokens_per_s (response tokens / step seconds),
  rollout_tokens_per_s; rollout_s, reward_s (scoring, e.g. a --reward function), train_s,
  sync_s (export + reload + audit), step_s;
  update_skipped, version_changed, peak_gpu_mem_gib.
completions.jsonl, one object per sample: step, sample_id, prompt, response (decoded text),
  reward, advantage, response_tokens, finish_reason.
TensorBoard (--tensorboard): the numeric metrics as scalars under RUN_DIR/tensorboard, x = step.

Does not: print (watch.py), plot (report.py) or compare (compare.py).
Tests: `.venv/bin/python -m pytest -q tests/test_watch.py`.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any, Iterable, Iterator

from rlkernel import jsontext, readfile
from rlkernel.runner.evidence import naming_the_file, to_json_safe

METRICS = "metrics.jsonl"
COMPLETIONS = "completions.jsonl"
TENSORBOARD = "tensorboard"


def _num(v: Any) -> float | None:
    """A metric value as a float: numbers, and the "nan"/"inf"/"-inf" strings of evidence.json;
    None for anything else (a missing field)."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    return None


def _fsum(values) -> float:
    """Correctly rounded sum (math.fsum) of finite values; IEEE rules when one is not (no torch
    import: `rlk report` stays light)."""
    vals = list(values)
    return math.fsum(vals) if all(map(math.isfinite, vals)) else sum(vals)


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std of `values` (a non-empty list). Finite values give finite
    results however large: rewards past ~1e154 (an evidence file not written by rlk run, whose
    rewards stop at 1e100) made (r - mean) ** 2 raise OverflowError, which crashed `rlk report`;
    they are then computed scaled by a power of two. Ordinary values take the plain formula."""
    n = len(values)
    try:
        mean = _fsum(values) / n
        std = math.sqrt(_fsum((r - mean) ** 2 for r in values) / n)
    except OverflowError:
        mean = std = math.inf
    if (math.isfinite(mean) and math.isfinite(std)) or not all(map(math.isfinite, values)):
        return mean, std   # non-finite values: IEEE rules, as _fsum
    k = math.frexp(max(map(abs, values)))[1]   # every value / 2**k is in [-1, 1]
    scaled = [math.ldexp(r, -k) for r in values]
    m = math.fsum(scaled) / n
    sd = math.sqrt(math.fsum((x - m) ** 2 for x in scaled) / n)
    return _ldexp_or_inf(m, k), _ldexp_or_inf(sd, k)


def _ldexp_or_inf(x: float, k: int) -> float:
    try:
        return math.ldexp(x, k)
    except OverflowError:   # beyond float64 after rounding: the value's sign, as IEEE would
        return math.copysign(math.inf, x)


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or not math.isfinite(b):
        return None
    return a / b


def metrics_row(rec: dict[str, Any]) -> dict[str, Any]:
    """The metrics.jsonl row of one evidence step record (module doc lists the keys); keys whose
    source field is missing from `rec` are left out."""
    t = rec.get("timings") or {}
    rewards = [x for x in map(_num, rec.get("rewards") or []) if x is not None]
    n_tok, n_samples = _num(rec.get("n_response_tokens")), _num(rec.get("n_samples"))
    step_s, rollout_s = _num(t.get("step_s")), _num(t.get("rollout_s"))
    row: dict[str, Any] = {"step": rec.get("step")}
    if rewards:
        row["reward_mean"], row["reward_std"] = _mean_std(rewards)
    row["response_len_mean"] = _div(n_tok, n_samples)
    for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "grad_norm", "lr"):
        row[key] = _num(rec.get(key))
    if isinstance(rec.get("updates"), list):
        row["grad_norms"] = [_num(u.get("grad_norm")) for u in rec["updates"]]
    for key in ("logprob_mismatches", "logprob_tokens", "update_skipped", "version_changed"):
        row[key] = rec.get(key)
    row["tokens_per_s"] = _div(n_tok, step_s)
    row["rollout_tokens_per_s"] = _div(n_tok, rollout_s)
    row["rollout_s"], row["train_s"] = rollout_s, _num(t.get("train_s"))
    row["reward_s"] = _num(t.get("reward_s"))
    row["sync_s"], row["step_s"] = _num(t.get("export_audit_s")), step_s
    row["peak_gpu_mem_gib"] = _num((rec.get("resources") or {}).get("peak_gpu_mem_gib"))
    return {k: v for k, v in row.items() if v is not None}


# ---------------------------------------------------------------------------------------------
# JSON lines


def append_jsonl(path: pathlib.Path, rows: Iterable[dict[str, Any]]) -> None:
    """Append rows as whole JSON lines with one write call, then fsync (module doc). Raises
    OSError naming `path` on I/O failure."""
    data = "".join(json.dumps(to_json_safe(r), allow_nan=False) + "\n" for r in rows).encode()
    if not data:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        with naming_the_file(path):
            view = memoryview(data)
            while view:  # os.write may write less than asked (signals, pipes); finish the bytes
                view = view[os.write(fd, view):]
            os.fsync(fd)
    finally:
        os.close(fd)


def _object_lines(path: str | os.PathLike) -> Iterator[tuple[bytes, dict[str, Any]]]:
    """(line without its newline, its object) of each line of a JSON-lines file that is a UTF-8
    JSON object; a last line without its newline (a write cut by a crash) and other lines are
    skipped. Raises OSError if unreadable (readfile.NotRegularFileError for a FIFO, device or
    directory)."""
    for line in readfile.read_bytes(path).split(b"\n")[:-1]:   # the last piece: incomplete
        try:
            obj = jsontext.loads(line.decode("utf-8"))
        except ValueError:   # UnicodeDecodeError too: one bad line, not the whole file
            continue
        if isinstance(obj, dict):
            yield line, obj


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file (`_object_lines`: torn, non-UTF-8 and non-object lines
    dropped). Raises OSError if unreadable."""
    return [obj for _, obj in _object_lines(path)]


def truncate_jsonl(path: pathlib.Path, upto_step: int) -> None:
    """Keep only the whole lines of steps < upto_step, each byte for byte as it was (atomic
    rewrite); a line that is not UTF-8 or not a JSON object is dropped, as readers drop it; no
    file: nothing. (Rows were dumped again: a line an editor gave NaN or 1e999 raised "Out of
    range float values", a non-UTF-8 byte a codec error, and the resume stopped.)"""
    if not path.exists():
        return
    keep = [line + b"\n" for line, obj in _object_lines(path)
            if isinstance(obj.get("step"), int) and not isinstance(obj["step"], bool)
            and obj["step"] < upto_step]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(b"".join(keep))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# TensorBoard


def tensorboard_missing() -> str | None:
    """Why --tensorboard cannot work here (None when it can)."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        return f"the tensorboard package is not importable ({e})"
    return None


class MetricsSink:
    """Rank 0's metrics.jsonl, completions.jsonl and TensorBoard writer for one run directory.

    start: the first step this process will write (a resume's checkpoint step): later lines of
    an earlier process are dropped first, and TensorBoard purges its events from that step.
    """

    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = False,
                 start: int = 0) -> None:
        self.run_dir = pathlib.Path(run_dir)
        if start:
            for name in (METRICS, COMPLETIONS):
                truncate_jsonl(self.run_dir / name, start)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD),
                                    purge_step=start or None)

    def record(self, rec: dict[str, Any], completions: list[dict[str, Any]]) -> dict[str, Any]:
        """Write one step: its metrics row (returned), its completions, its scalars."""
        row = metrics_row(rec)
        append_jsonl(self.run_dir / METRICS, [row])
        append_jsonl(self.run_dir / COMPLETIONS, completions)
        if self.tb is not None:
            for key, v in row.items():
                if key != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(_TB_TAGS.get(key, key), v, row["step"])
            self.tb.flush()
        return row

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


_TB_TAGS = {
    "reward_mean": "reward/mean", "reward_std": "reward/std",
    "response_len_mean": "response/length_mean", "loss": "loss/total", "pg_loss": "loss/pg",
    "kl": "loss/kl", "entropy": "loss/entropy", "clip_frac": "ppo/clip_frac",
    "grad_norm": "optim/grad_norm", "lr": "optim/lr",
    "logprob_mismatches": "audit/logprob_mismatches", "logprob_tokens": "audit/logprob_tokens",
    "tokens_per_s": "perf/tokens_per_s", "rollout_tokens_per_s": "perf/rollout_tokens_per_s",
    "rollout_s": "time/rollout_s", "reward_s": "time/reward_s", "train_s": "time/train_s",
    "sync_s": "time/sync_s",
    "step_s": "time/step_s", "peak_gpu_mem_gib": "perf/peak_gpu_mem_gib",
}
