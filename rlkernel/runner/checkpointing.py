"""Run checkpoints for bitwise resume: save after a step, load the last complete one.

A checkpoint is everything the next step depends on — fp32 master weights, AdamW moments and step
count (all as *logical* tensors, so any topology can load them), and the step cursor (the prompt
source and the sampling noise are pure functions of (seed, step, sample id), so the cursor is the
whole data/sampler state). The evidence so far lives in evidence.json beside it.

Layout: RUN_DIR/checkpoints/step-000003/{state.safetensors, meta.json}. A checkpoint is written
into `step-000003.tmp-<pid>` and renamed into place only after both files are fsync'ed, and
meta.json carries the SHA-256 of state.safetensors: a half-written or corrupted checkpoint is
never loaded — `latest_checkpoint` takes the newest one that verifies.
Does not: decide when to save (loop.py) or merge configs (cli.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
from dataclasses import dataclass

import safetensors.torch
import torch
from safetensors import SafetensorError

from rlkernel import jsontext, readfile
from rlkernel.config import SIZE_LIMITS, RunConfig, flag_name
from rlkernel.model.config import Qwen3Config, param_shapes
from rlkernel.runner.watch import CKPT_DIR

_STATE = "state.safetensors"
_KINDS = ("master", "exp_avg", "exp_avg_sq")    # the optimizer state a checkpoint holds
_META = "meta.json"


class ResumeError(ValueError):
    """A run directory cannot be resumed (no valid checkpoint, or a config mismatch)."""


@dataclass
class Checkpoint:
    """next_step: the first step still to run; opt_steps: AdamW updates applied so far;
    tensors: logical fp32 tensors named master/<p>, exp_avg/<p>, exp_avg_sq/<p>;
    version: weight version after step next_step − 1 (checked on resume); path: its directory;
    skipped: newer checkpoints `latest_checkpoint` passed over, "NAME: why" each;
    settings: the run's RunConfig.resume_settings() when it was written (None: not recorded,
    or not a dict), compared with the manifest's on resume; inputs: `inputs_digest` of the
    manifest's inputs it was trained from (None: not recorded), compared likewise."""

    next_step: int
    opt_steps: int
    tensors: dict[str, torch.Tensor]
    version: str
    path: pathlib.Path
    skipped: tuple[str, ...] = ()
    settings: dict | None = None
    inputs: str | None = None


def inputs_digest(inputs) -> str | None:
    """SHA-256 of the content hashes of a manifest's `inputs` (its "files": path -> SHA-256 of
    every file the run reads), sorted, paths left out (a project folder moved with its run, or
    relative paths read from another directory, keep it); None when `inputs` holds no such
    mapping. Ties a checkpoint to the weights, prompts, reward and tokenizer it was trained
    from: a run's manifest hashes its inputs, but two runs with one set of flags can have read
    other contents at one path."""
    files = inputs.get("files") if isinstance(inputs, dict) else None
    if not isinstance(files, dict):
        return None
    return hashlib.sha256(json.dumps(sorted(map(str, files.values()))).encode()).hexdigest()


def fsync_dir(d: pathlib.Path) -> None:
    """Make a rename or a new file in directory `d` durable (fsync of the directory)."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_entry(path: pathlib.Path) -> None:
    """Remove `path`, a temporary this code made, whatever it is now, ignoring errors: a
    directory by rmtree, anything else (a file, a link, a FIFO swapped in) by unlink — rmtree
    would open a FIFO and block there, with the step's signals held."""
    try:
        if readfile.non_directory(path) is None:
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def replaced_directory_problem(path: pathlib.Path) -> str | None:
    """Why the directory `path`, which a run replaces (a checkpoint, final/), cannot be: what
    lies there instead of a directory ("PATH is a FIFO (named pipe), not a directory"); None
    when it is a directory or absent."""
    try:
        what = readfile.non_directory(path)
    except OSError as e:
        return f"{path} cannot be examined ({e.strerror or e})"
    return None if what is None else f"{path} is {what}, not a directory"


def check_checkpoint_dirs(run_dir: pathlib.Path) -> None:
    """Refuse, before a resume reads or writes anything, a `checkpoints/` that is not a real
    directory of the run (a link to another run's: the resume continued from its weights and
    wrote its next checkpoint there), and a `checkpoints/step-N` entry (N digits: the names
    save_checkpoint writes) that is not a real directory: the run replaces it after computing
    that step (rmtree blocked on a FIFO; a file or link failed the run there). Stale `.tmp-*`
    entries are removed instead (save_checkpoint); other names are not the run's.
    Raises ResumeError naming the entry."""
    root = pathlib.Path(run_dir) / CKPT_DIR
    why = replaced_directory_problem(root)
    if why is not None:
        raise ResumeError(f"{why}; a run keeps its checkpoints in its own directory (a resume "
                          "reads them and writes its next ones there): put the run's own "
                          "checkpoints/ there")
    for p in sorted(root.glob("step-*")) if root.is_dir() else []:
        ours = step_number(p.name) is not None
        why = replaced_directory_problem(p) if ours else None
        if why is not None:
            raise ResumeError(f"{why}; the run replaces it with a checkpoint: move it away")


def _unrecorded(ck: Checkpoint, what: str, part: str) -> str:
    """The refusal of a checkpoint whose meta.json lacks `what` (or holds it malformed), which
    ties it to manifest.json's `part`."""
    return (f"{ck.path / _META} records no {what} (a checkpoint of an older rl-kernel, or its "
            f"meta.json was edited): nothing ties it to manifest.json's {part}; finish the run "
            "with the code that wrote it (its manifest's git commit), or start a new run")


def check_settings(ck: Checkpoint, cfg: RunConfig) -> None:
    """Refuse a checkpoint written under other settings than the run's config `cfg` (its
    manifest's, with a resume's flags): a manifest edited since (--lr, --seed: resumed
    silently), or another run's checkpoint. A checkpoint that records none (written before
    checkpoints recorded them) is refused too, as a manifest without its canonical spec is:
    nothing shows it belongs to this config. Raises ResumeError naming the settings."""
    if ck.settings is None:
        raise ResumeError(_unrecorded(ck, "settings of the run that wrote it", "config"))
    diff = cfg.resume_differences(ck.settings)
    if diff:
        now = cfg.to_dict()
        what = ", ".join(f"{flag_name(k)} (checkpoint {ck.settings.get(k)!r}, manifest "
                         f"{now.get(k)!r})" for k in diff)
        raise ResumeError(f"{ck.path} was written under other settings than manifest.json's "
                          f"config: {what}; the manifest was edited or the checkpoint is "
                          "another run's: restore them, or start a new run")


def check_inputs(ck: Checkpoint, manifest_inputs) -> None:
    """Refuse a checkpoint trained from other inputs than the manifest records
    (`inputs_digest`): another run's checkpoint (and evidence, which check_continues ties to
    it) copied in from a run of the same flags whose model or prompts file held other contents
    at the same path — it resumed and continued the other run's weights under this manifest.
    A checkpoint that records none (written before checkpoints recorded it) is refused as one
    without settings is. Raises ResumeError."""
    if ck.inputs is None:
        raise ResumeError(_unrecorded(ck, "digest of the inputs it was trained from", "inputs"))
    if ck.inputs != inputs_digest(manifest_inputs):
        raise ResumeError(f"{ck.path} was trained from other inputs (weights, prompts, reward or "
                          "tokenizer contents) than manifest.json records: the checkpoint is "
                          "another run's; restore the run's own checkpoints/ and evidence.json, "
                          "or start a new run")


def check_continues(ck: Checkpoint, evidence: dict, path: pathlib.Path) -> None:
    """Refuse a checkpoint that does not continue the run's kept evidence (`evidence`, read from
    `path`; the caller has checked that it holds steps 0..next_step-1): the checkpoint's
    directory is named for the step its meta.json continues at, the evidence holds the init
    record every run writes before its first step, and the weight version the checkpoint holds
    is the one the evidence records after step next_step - 1 (the init's, before step 0). The
    checkpoint's own version is checked against its weights only after they are restored
    (loop.py); a checkpoint and evidence of two runs (one copied over the other) resumed into a
    broken chain of versions and was marked complete. Its optimizer update count must be the
    updates the evidence records as applied (`_applied_updates`). Raises ResumeError."""
    named = step_number(ck.path.name)
    if named != ck.next_step:
        shown = named if named is not None else repr(ck.path.name.removeprefix("step-"))
        raise ResumeError(f"{ck.path}: its meta.json continues at step {ck.next_step}, its name "
                          f"at step {shown}: renamed or copied in from elsewhere; move it away")
    init = evidence.get("init")
    if not isinstance(init, dict) or not isinstance(init.get("version"), str):
        raise ResumeError(f"{path} holds no init record (the initial weights' version, which "
                          "every run records before its first step): it was edited; restore "
                          "the run's own evidence.json")
    n = ck.next_step
    recorded = (evidence["steps"][n - 1] if n else init).get("version")
    if recorded != ck.version:
        after = f"after step {n - 1}" if n else "as its initial weights"
        raise ResumeError(f"{ck.path} holds weight version {ck.version[:12]}, but {path} records "
                          f"{str(recorded)[:12]} {after}: the checkpoint and the evidence are not "
                          "of one run (one copied over the other?); restore the run's own, or "
                          "start a new run")
    applied = _applied_updates(evidence["steps"][:n])
    if applied is not None and applied != ck.opt_steps:
        # AdamW's bias correction and the LR schedule count these: an edited count resumed into
        # other weights with nothing said (the version above is checked before the update).
        raise ResumeError(f"{ck.path / _META} records {ck.opt_steps} optimizer update(s), but "
                          f"{path} records {applied} applied in steps 0..{n - 1}: meta.json was "
                          "edited or is another run's; restore the run's own")


def check_state(ck: Checkpoint, model: Qwen3Config) -> None:
    """Refuse a checkpoint that does not hold the fp32 master, exp_avg and exp_avg_sq of every
    parameter of `model` at its logical shape (a matching SHA-256 says the file is the one its
    meta.json names, not that the run wrote it), or that holds any other tensor (a run saves
    those three per parameter only, so one more means another model's or an edited file).
    Raises ResumeError naming the tensor."""
    shapes = param_shapes(model)
    extra = sorted(set(ck.tensors) - {f"{kind}/{n}" for kind in _KINDS for n in shapes})
    if extra:
        raise ResumeError(f"{ck.path}: checkpoint holds tensor {extra[0]}"
                          f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}, which "
                          "this run's model and optimizer have no place for")
    for kind in _KINDS:
        for n, shape in shapes.items():
            t = ck.tensors.get(f"{kind}/{n}")
            if t is None:
                raise ResumeError(f"{ck.path}: checkpoint lacks tensor {kind}/{n}")
            if t.dtype != torch.float32 or tuple(t.shape) != tuple(shape):
                raise ResumeError(f"{ck.path}: tensor {kind}/{n} is {t.dtype} {tuple(t.shape)}, "
                                  f"expected torch.float32 {tuple(shape)}")


def check_values(ck: Checkpoint) -> None:
    """Refuse a checkpoint whose masters or moments hold NaN/Inf, or whose exp_avg_sq holds a
    negative value: a run never saves them (a non-finite update stops it or is skipped), so
    they mean an edited or damaged file, which a resume would report only after its first
    update, as a diverged one. One pass over every value: the CLI runs it once, before any work
    (the loop's `check_state` on each rank stays a shape check). Raises ResumeError naming the
    tensor."""
    for name, t in ck.tensors.items():
        kind = name.split("/", 1)[0]
        if kind not in _KINDS:
            continue
        if not bool(torch.isfinite(t).all()):
            what = f"{int((~torch.isfinite(t)).sum())} NaN or Inf values"
        elif kind == "exp_avg_sq" and bool((t < 0).any()):
            what = "negative values"
        else:
            continue
        raise ResumeError(f"{ck.path}: tensor {name} holds {what}, which a run never saves (the "
                          "checkpoint was edited or damaged)")


def _applied_updates(steps: list) -> int | None:
    """The optimizer updates the evidence's step records say were applied (a step's "updates"
    entries with applied true, or 1 per step whose single update was not skipped); None when a
    record does not say (an edited or older evidence: the version check stands alone)."""
    total = 0
    for rec in steps:
        ups = rec.get("updates") if isinstance(rec, dict) else None
        if isinstance(ups, list):
            total += sum(1 for u in ups if isinstance(u, dict) and u.get("applied") is True)
        elif isinstance(rec, dict) and isinstance(rec.get("update_skipped"), bool):
            total += not rec["update_skipped"]
        else:
            return None
    return total


def save_checkpoint(run_dir: pathlib.Path, next_step: int, opt_steps: int,
                    tensors: dict[str, torch.Tensor], version: str, *,
                    settings: dict, inputs: str | None) -> pathlib.Path:
    """Atomically write checkpoint `next_step` under run_dir/checkpoints; returns its path.
    `settings` (the run's RunConfig.resume_settings()) ties it to the run's config: a resume
    refuses a manifest whose config has other ones (check_settings); `inputs` (the manifest's
    `inputs_digest`) ties it to the run's input contents likewise (check_inputs)."""
    root = pathlib.Path(run_dir) / CKPT_DIR
    root.mkdir(exist_ok=True)
    for stale in root.glob("step-*.tmp-*"):           # left by a run killed mid-write
        remove_entry(stale)
    final = root / f"step-{next_step:06d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    blob = safetensors.torch.save({n: t.contiguous().cpu() for n, t in tensors.items()})
    meta = {"next_step": next_step, "opt_steps": opt_steps, "version": version,
            "state_sha256": hashlib.sha256(blob).hexdigest(), "settings": settings,
            "inputs_sha256": inputs}
    try:
        with open(tmp / _STATE, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp / _META, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
    except OSError as e:   # a full disk, say: name what could not be written, keep nothing half
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(e.errno, f"cannot write checkpoint {final} ({e.strerror or e}; "
                               f"{len(blob) / 2**20:.1f} MiB)") from None
    why = replaced_directory_problem(final)
    if why is not None:   # not rmtree'd: it would block on a FIFO and refuse a link
        raise NotADirectoryError(f"cannot write checkpoint {final}: {why}; move it away")
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(root)
    return final


def _meta(path: pathlib.Path) -> dict:
    """The checkpoint's meta.json as the object rlk run writes; ValueError saying what it is
    instead (a resume prints it beside the checkpoint it skips: a raw "list indices must be
    integers" or codec message named nothing)."""
    try:
        meta = readfile.read_json(path / _META)
    except UnicodeDecodeError as e:
        raise ValueError(f"{_META} is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{_META} is not valid JSON ({jsontext.located(e)})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{_META} holds a JSON {type(meta).__name__}, not the object rlk run "
                         "writes")
    missing = [k for k in ("next_step", "opt_steps", "version", "state_sha256") if k not in meta]
    if missing:
        raise ValueError(f"{_META} lacks {', '.join(missing)}")
    return meta


def _load(path: pathlib.Path) -> Checkpoint:
    meta = _meta(path)
    blob = readfile.read_bytes(path / _STATE)
    if hashlib.sha256(blob).hexdigest() != meta["state_sha256"]:
        raise ResumeError(f"{path / _STATE}: SHA-256 does not match meta.json (corrupted)")
    try:
        tensors = {n: t.clone() for n, t in safetensors.torch.load(blob).items()}
    except SafetensorError as e:   # its hash matched: meta.json was edited along with it
        raise ValueError(f"{_STATE} is not a safetensors file ({e})") from None
    settings, inputs = meta.get("settings"), meta.get("inputs_sha256")
    for key, most in (("next_step", SIZE_LIMITS["steps"]), ("opt_steps", None)):
        # range(next_step) is built on resume: an edited 10**30 overflowed, 10**10 filled memory
        n = meta[key]
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0
                and (most is None or n <= most)):
            raise ValueError(f"meta.json {key} {str(n)[:40]!r}: not a step count "
                             f"in [0, {most if most is not None else 'inf'}]")
    return Checkpoint(int(meta["next_step"]), int(meta["opt_steps"]), tensors,
                      str(meta["version"]), path,
                      settings=settings if isinstance(settings, dict) else None,
                      inputs=inputs if isinstance(inputs, str) else None)


def read_checkpoint(path: pathlib.Path) -> Checkpoint:
    """The checkpoint in directory `path`, verified against its SHA-256.

    Raises ResumeError naming the file when it is corrupted or unreadable.
    """
    try:
        return _load(pathlib.Path(path))
    except ResumeError:
        raise
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        raise ResumeError(f"{path}: unreadable checkpoint ({e})") from None


def checkpoint_dirs(run_dir: pathlib.Path) -> dict[int, pathlib.Path]:
    """next_step -> directory of every finished (renamed into place) checkpoint of `run_dir`,
    by directory name; contents are verified only when read."""
    root = pathlib.Path(run_dir) / CKPT_DIR
    out = {}
    for p in sorted(root.glob("step-*")) if root.is_dir() else []:
        n = step_number(p.name)
        if p.is_dir() and n is not None:
            out[n] = p
    return out


def step_number(name: str) -> int | None:
    """The step a checkpoint directory's name `step-NNNNNN` holds, or None for any other name:
    ASCII digits only (str.isdigit accepts '²' and other scripts' digits, which int() then
    refuses or reads as another number)."""
    m = re.fullmatch(r"step-([0-9]+)", name)
    return int(m.group(1)) if m else None


def latest_checkpoint(run_dir: pathlib.Path) -> Checkpoint:
    """The newest complete, verified checkpoint of `run_dir` (the newer ones it passed over, and
    why, in its `skipped`).

    Raises ResumeError naming the directory when there is none (listing why each was skipped).
    """
    # Only the run's own names (step-DIGITS), newest step first by number: a copy such as
    # step-000002.bak is not a checkpoint (export and the resume's pre-checks skip it too).
    dirs = checkpoint_dirs(run_dir)
    skipped = []
    for p in (dirs[n] for n in sorted(dirs, reverse=True)):
        try:
            return dataclasses.replace(_load(p), skipped=tuple(skipped))
        # TypeError: a meta.json of the wrong shape (e.g. a list); SafetensorError (not a
        # ValueError): a state file that matches its SHA-256 but does not parse.
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
            skipped.append(f"{p.name}: {e}")
    why = f" (skipped: {'; '.join(skipped)})" if skipped else ""
    raise ResumeError(f"{run_dir}: no complete checkpoint to resume from{why}; "
                      "runs write them with --save-every N")
