"""Trained weights out of a run: RUN/final at the end of every run, and `rlk export`.

Which weights a run keeps (and so what `rlk export RUN --step N` can export; N counts evidence
steps from 0, the weights after that step's update):
- RUN/final/: the weights after the last step, written by rank 0 when a run finishes all its
  steps: config.json + model.safetensors in the parameter dtype (the bytes the evidence hashed)
  + rlk_weights.json {"step", "version"}; written under a temporary name and renamed into place.
  A run that stops early (a failed check, Ctrl-C, a lost rank) has no final/.
- RUN/checkpoints/step-(N+1)/ (`--save-every`): fp32 masters, exported as the parameter dtype
  (the model's weights are rounded from exactly these masters, so the bytes are the same).
Any other step has no weights; export says which steps have.

`export_run` writes a Hugging Face directory (config.json, model.safetensors, the tokenizer files
of the run's input model, rlk_weights.json) after checking every tensor's SHA-256 against the
per-tensor hashes the run recorded in evidence.json for that step: a tensor that differs is named
and nothing is written. The input model is read where the run recorded it when it started (the
manifest's input_paths, runner/inputs.py), not relative to export's current directory.
Reuses model/checkpoint.py (strict safetensors load/save, atomic) and weights/hashing.py.

Does not: convert dtypes beyond master -> parameter dtype, shard, or merge LoRA (there is none).
Run its tests: `.venv/bin/python -m pytest -q tests/test_export.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import time
from dataclasses import dataclass

import torch

from rlkernel import readfile
from rlkernel.model.checkpoint import (CheckpointError, load_checkpoint, read_model_config,
                                       save_checkpoint)
from rlkernel.model.config import Qwen3Config, param_shapes, tiny
from rlkernel.runner.checkpointing import (ResumeError, checkpoint_dirs, fsync_dir,
                                          read_checkpoint, remove_entry)
from rlkernel.runner.inputs import recorded_paths, sha256_file, where_now
from rlkernel.runner.watch import FINAL_DIR
from rlkernel.weights.hashing import compare_hashes, state_hashes, version_hash

WEIGHTS_META = "rlk_weights.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")
"""Files copied from the run's input model directory into an export (those that exist)."""
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class ExportError(ValueError):
    """The run's weights cannot be exported (missing, or not the bytes the run recorded)."""


class ExportUsageError(ExportError):
    """A bad `rlk export` argument (run directory, --step, --out): exit 2."""


def save_final_weights(run_dir: str | os.PathLike, cfg: Qwen3Config,
                       tensors: dict[str, torch.Tensor], *, step: int,
                       version: str) -> pathlib.Path:
    """Write RUN/final (see module doc) from `tensors` (logical, parameter dtype, CPU), the
    weights after evidence step `step`, whose Merkle root the loop recorded as `version`.

    Replaces an older final/ (a resumed run that was extended) by rename, so a reader sees the
    old or the new directory, except for the instant between two renames. Returns its path.
    Raises CheckpointError for tensors that do not match `cfg`, OSError on I/O failure.
    """
    run_dir = pathlib.Path(run_dir)
    final = run_dir / FINAL_DIR
    staging = run_dir / f".{FINAL_DIR}.tmp-{os.getpid()}"
    meta = {"step": step, "version": version}
    save_checkpoint(staging, cfg, tensors,
                    extra_files={WEIGHTS_META: (json.dumps(meta, indent=1) + "\n").encode()})
    old = None
    if os.path.lexists(final):   # a link to nowhere too: renaming over it failed, after the run
        old = run_dir / f".{FINAL_DIR}.old-{os.getpid()}"
        os.rename(final, old)
    os.rename(staging, final)
    fsync_dir(run_dir)
    if old is not None:
        remove_entry(old)   # whatever it was: rmtree blocked on a FIFO
    return final


def tokenizer_file_hashes(model_dir: str | os.PathLike | None) -> dict[str, str]:
    """SHA-256 of each TOKENIZER_FILES file in `model_dir` ({} for None): recorded in the
    manifest at run start, checked again by `rlk export` before it copies them. Raises OSError
    (readfile's) for a name that is there but is no readable regular file: a FIFO, directory or
    link to nowhere was skipped, as if absent."""
    if model_dir is None:
        return {}
    d = pathlib.Path(model_dir)
    return {n: hashlib.sha256(readfile.read_bytes(d / n)).hexdigest()
            for n in TOKENIZER_FILES if os.path.lexists(d / n)}


@dataclass(frozen=True)
class Exported:
    """What `export_run` wrote: out dir, evidence step, source dir, version, tensors verified."""

    out: pathlib.Path
    step: int
    source: pathlib.Path
    version: str
    n_tensors: int
    seconds: float


def _read_run(run: pathlib.Path) -> tuple[dict, dict]:
    why = readfile.not_a_directory(run)
    if why is not None:
        raise ExportUsageError(f"RUN {str(run)!r}: {why}; give a run directory written by rlk "
                               "run")
    docs = []
    for name, key, kind in (("manifest.json", "config", dict), ("evidence.json", "steps", list)):
        doc, why = readfile.json_holding_or_why(run / name, key, kind)
        if why is None and kind is dict:
            why = _odd_setting(doc[key])
        if why is not None:
            raise ExportUsageError(f"RUN {str(run)!r}: {name} {why}; give a run directory "
                                   "written by rlk run")
        docs.append(doc)
    return docs[0], docs[1]


def _odd_setting(config: dict) -> str | None:
    """Why the settings export reads from a manifest's config cannot be used (--model a path
    or null, --dtype a name), or None."""
    for key, ok, want in (("model", lambda v: v is None or isinstance(v, str), "a path or null"),
                          ("dtype", lambda v: isinstance(v, str), "a name")):
        if key in config and not ok(config[key]):
            return f"records config {key} as {json.dumps(config[key])[:40]}, not {want}"
    return None


def _final_meta(run: pathlib.Path) -> tuple[int | None, str | None]:
    """(the step final/ holds, None), (None, None) when there is no final/ record, or (None,
    why the record that is there cannot be used)."""
    path = run / FINAL_DIR / WEIGHTS_META
    meta, why = readfile.json_or_why(path)
    if why == "is missing":
        return None, None
    if why is None:
        step = meta.get("step") if isinstance(meta, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            return step, None
        why = "has no step (a non-negative integer)"
    return None, f"{path} {why}"


def _final_step(run: pathlib.Path) -> int | None:
    return _final_meta(run)[0]


def available_steps(run: str | os.PathLike) -> dict[int, pathlib.Path]:
    """Evidence step -> the directory holding its weights: final/ and every checkpoint."""
    run = pathlib.Path(run)
    out = {next_step - 1: p for next_step, p in checkpoint_dirs(run).items() if next_step >= 1}
    f = _final_step(run)
    if f is not None:
        out[f] = run / FINAL_DIR  # final/ wins: it holds the parameter-dtype bytes themselves
    return dict(sorted(out.items()))


def _steps_text(avail: dict[int, pathlib.Path]) -> str:
    if not avail:
        return ("this run kept no weights (final/ is written when a run finishes all its steps; "
                "--save-every N keeps checkpoints)")
    shown = [f"{s} ({p.name if p.name == FINAL_DIR else 'checkpoint ' + p.name})"
             for s, p in avail.items()]
    return "steps with weights: " + ", ".join(shown)


def _input_model(run: pathlib.Path, manifest: dict) -> str | None:
    """The run's input model directory: where the run recorded it when it started (the
    manifest's input_paths, absolute), else — a run written before that record, or one moved
    with its inputs away from there — its --model as typed, read from the current directory
    (the tokenizer files' SHA-256 is checked against the manifest's either way). None for the
    embedded model."""
    try:
        paths = recorded_paths(manifest)
    except ValueError as e:
        raise ExportError(f"{run / 'manifest.json'}: {e}") from None
    typed = manifest["config"].get("model")
    if paths is None or paths["model"] is None:
        return typed
    return where_now("model", paths["model"], typed)


def _gone(model: str, why: str) -> str:
    return (f"the run's input model directory {model!r} ({why}) no longer exists; restore it, "
            "or export from a copy of the run whose manifest names a directory that exists")


def _model_config(run: pathlib.Path, manifest: dict, model: str | None) -> Qwen3Config:
    """The run's architecture, checked: the input model's config.json (its SHA-256 against the
    one the manifest recorded, when it did) or the embedded tiny model's; final/config.json,
    where present, must describe the same model. Raises ExportError naming the file otherwise
    (an edited config.json would export the run's weights under another model)."""
    if model is None:
        want, source = tiny(), "the embedded tiny model's"
    else:
        path = pathlib.Path(model) / "config.json"
        if not pathlib.Path(model).is_dir():
            raise ExportError(_gone(model, "for its config.json and tokenizer files"))
        if not path.is_file():
            raise ExportError(f"cannot find the model's config.json: the run's input model "
                              f"directory {model!r} has none")
        typed = manifest["config"].get("model")
        inputs = manifest.get("inputs")
        files = inputs.get("files") if isinstance(inputs, dict) else None
        recorded = (files.get(str(pathlib.Path(typed) / "config.json"))
                    if isinstance(files, dict) and isinstance(typed, str) else None)
        if isinstance(recorded, str) and sha256_file(path) != recorded:
            raise ExportError(f"{path} changed since the run started (manifest.json inputs); "
                              "refusing to export under an architecture the run did not use")
        want, source = read_model_config(model), f"{path}'s"
    final = run / FINAL_DIR
    if (final / "config.json").is_file():
        got = read_model_config(final)
        if got != want:
            fields = [f for f in vars(want) if getattr(got, f, None) != getattr(want, f)]
            raise ExportError(f"{final / 'config.json'}: {', '.join(fields)} differ(s) from "
                              f"{source} (the model the run trained); refusing to export")
    return want


def _tokenizer_files(model: str | None, manifest: dict, cfg: Qwen3Config) -> dict[str, bytes]:
    """The tokenizer files for the export: the input model's (checked against the manifest's
    hashes when it has them), or the byte tokenizer's stand-in when the run used that."""
    from rlkernel.data.tokenizer import BYTE_VOCAB_SIZE, standin_tokenizer_files

    if model is None or not (pathlib.Path(model) / "tokenizer.json").is_file():
        if model is not None and not pathlib.Path(model).is_dir():
            raise ExportError(_gone(model, "for its tokenizer files"))
        # The run encoded with the byte tokenizer (no tokenizer.json): write its equivalent —
        # its ids only, so embedding rows past them stay masked (probability 0) in whatever
        # loads the export, as they were in the run (loop.run: live = min(tokenizer, vocab)).
        return standin_tokenizer_files(min(BYTE_VOCAB_SIZE, cfg.vocab_size), cfg.eos_token_id)
    d = pathlib.Path(model)
    files = {n: (d / n).read_bytes() for n in TOKENIZER_FILES if (d / n).is_file()}
    recorded = manifest.get("tokenizer_files")
    if isinstance(recorded, dict):
        now = {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
        changed = sorted(n for n in set(recorded) | set(now) if recorded.get(n) != now.get(n))
        if changed:
            raise ExportError(f"tokenizer file(s) {', '.join(changed)} in {d} changed, "
                              "appeared or went since the run started (manifest.json "
                              "tokenizer_files, which export copies); refusing to export a "
                              "tokenizer the run did not use")
    return files


def _load_weights(src: pathlib.Path, cfg: Qwen3Config,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Parameter-dtype logical tensors of final/ or of a checkpoint's fp32 masters."""
    if src.name == FINAL_DIR:
        try:
            _, tensors = load_checkpoint(src)
        except CheckpointError as e:
            raise ExportError(f"{src}: {e}") from None
        return tensors
    try:
        ck = read_checkpoint(src)
    except ResumeError as e:
        raise ExportError(str(e)) from None
    out = {}
    for name in param_shapes(cfg):
        m = ck.tensors.get(f"master/{name}")
        if m is None:
            raise ExportError(f"{src}: checkpoint lacks tensor master/{name}")
        out[name] = m.to(dtype)  # the same rounding that makes the model's weights (qwen3.py)
    return out


def parse_step(text: str | None, run: str | os.PathLike) -> int | None:
    """`rlk export --step` as typed -> an int (None when not given). A negative or too large
    integer is left to export_run, which names the range. Raises ExportUsageError for text that
    is no integer, naming the steps of `run` that have weights (when it has any)."""
    if text is None:
        return None
    if text.isascii() and "_" not in text:     # int() reads '1_0' as 10 and any Unicode digit
        try:
            return int(text)
        except ValueError:
            pass
    avail = available_steps(run)
    which = f"; {_steps_text(avail)}" if avail else ""
    raise ExportUsageError(f"--step {text!r}: must be a non-negative integer, an evidence step "
                           f"(counted from 0) of {str(run)!r} that kept weights{which}")


def export_run(run: str | os.PathLike, out: str | os.PathLike,
               step: int | None = None) -> Exported:
    """Export the weights of `run` after evidence step `step` (None: the final weights of a
    complete run) to the Hugging Face directory `out`, verified against the run's evidence.

    `out` gets config.json (torch_dtype = the parameter dtype), model.safetensors (parameter
    dtype, logical tensors; no lm_head.weight when tied), the tokenizer files, and
    rlk_weights.json {"run", "step", "version", "source"}; it is written under a temporary name
    and renamed into place, so a failed export leaves nothing.
    Raises ExportUsageError (exit 2): `out` exists and is not empty, `run` is not a run
    directory, `step` is out of range or has no weights (the message lists the steps that have);
    ExportError (exit 1): a tensor's SHA-256 differs from the one the run recorded (named), the
    weights or tokenizer files are missing or unreadable.
    """
    t0 = time.perf_counter()
    run, out = pathlib.Path(run), pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportUsageError(f"--out {str(out)!r}: exists and is not an empty directory; give a "
                               "new or empty directory")
    manifest, evidence = _read_run(run)
    steps = evidence["steps"]
    avail = available_steps(run)
    if step is None:
        last = len(steps) - 1
        done = evidence.get("complete") is True   # a JSON true, not any truthy value
        if not done or avail.get(last) != run / FINAL_DIR:
            damaged = _final_meta(run)[1]
            if damaged is not None:     # a file of the run is broken, not the user's call
                raise ExportError(f"{damaged}: cannot tell which step final/ holds; "
                                  + (f"give --step N; {_steps_text(avail)}" if avail else
                                     "and the run kept no checkpoints"))
            held = _final_step(run)
            why = (f"it did not finish all its steps: {len(steps)} recorded"
                   if not done else "its final/ weights are missing"
                   if held is None else "its evidence records no step" if not steps
                   else f"final/ holds step {held}, not the last step {last}")
            raise ExportUsageError(f"RUN {str(run)!r} has no final weights ({why}); "
                                   + (f"give --step N; {_steps_text(avail)}" if avail else
                                      f"nothing to export: {_steps_text(avail)}"))
        step = last
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < len(steps):
        where = (f"in [0, {len(steps)})" if steps else
                 "which has none (it recorded no step)")
        raise ExportUsageError(f"--step {step!r}: must be an evidence step of {str(run)!r}, "
                               f"{where}; {_steps_text(avail)}")
    if step not in avail:
        damaged = _final_meta(run)[1]    # final/ may hold it, but its record is broken
        if damaged is not None:
            raise ExportError(f"--step {step}: {str(run)!r} kept no checkpoint for it, and "
                              f"{damaged}, so which step final/ holds is unknown; "
                              f"{_steps_text(avail)}")
        raise ExportUsageError(f"--step {step}: {str(run)!r} kept no weights for it; "
                               f"{_steps_text(avail)}")
    src = avail[step]
    config = manifest["config"]
    model = _input_model(run, manifest)
    cfg = _model_config(run, manifest, model)
    dtype = _DTYPES.get(config.get("dtype", "bf16"))
    if dtype is None:
        raise ExportError(f"{run / 'manifest.json'}: dtype {config.get('dtype')!r} is not one of "
                          f"{', '.join(_DTYPES)}")
    tensors = _load_weights(src, cfg, dtype)

    record = steps[step]
    expected = record.get("tensor_hashes") if isinstance(record, dict) else None
    if not isinstance(expected, dict) or not expected:
        raise ExportError(f"{run / 'evidence.json'}: step {step} records no tensor_hashes to "
                          "verify against")
    odd = next((n for n, h in expected.items() if not isinstance(h, str)), None)
    if odd is not None:
        raise ExportError(f"{run / 'evidence.json'}: step {step} records the hash of tensor "
                          f"{odd!r} as {json.dumps(expected[odd])[:40]}, not a SHA-256 string "
                          "(the file was edited or damaged)")
    hashes = state_hashes({n: tensors[n] for n in param_shapes(cfg)})
    problems = compare_hashes(expected, hashes)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ExportError(f"refusing to export {src}: {problems[0]}{more}; these are not the "
                          f"weights the run recorded at evidence step {step} (the run's step "
                          f"{step + 1}; evidence.json)")
    version = version_hash(hashes)
    if version != record.get("version"):
        raise ExportError(f"refusing to export {src}: version {version[:16]}... differs from "
                          f"the recorded {str(record.get('version'))[:16]}... of evidence step "
                          f"{step} (the run's step {step + 1})")

    files = _tokenizer_files(model, manifest, cfg)
    meta = {"run": str(run.resolve()), "step": step, "version": version,
            "source": str(src.relative_to(run))}
    files[WEIGHTS_META] = (json.dumps(meta, indent=1) + "\n").encode()
    try:
        save_checkpoint(out, cfg, tensors, extra_files=files)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    return Exported(out, step, src, version, len(hashes), time.perf_counter() - t0)

