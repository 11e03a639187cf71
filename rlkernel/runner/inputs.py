"""What a run reads from disk, described for its manifest, and checked again on `--resume`.

`describe_inputs` records, under the manifest's "inputs":
- "files": the SHA-256 of every file the run reads — the model directory's config.json,
  safetensors index, *.safetensors and tokenizer.json, and the --prompts file — by path;
- "vocab": the model's vocab_size, the tokenizer's id bound, how many ids lie past it (a padded
  vocabulary: Qwen3 has 151,936 embedding rows for 151,669 tokenizer ids) and the rule applied to
  them (VOCAB_RULE, implemented in kernels/logprobs.py);
- "weights": the dtypes the checkpoint stores and whether `--dtype` rounds them (an fp16 or fp32
  checkpoint under the default bf16: `startup_notes` says so in one line).
A resumed run reloads every input from its path (the KL reference is the initial model), so a
file replaced under the same path would silently change the run: `check_unchanged` refuses the
resume, naming the file.

`input_paths` records, under the manifest's "input_paths" (beside "config", which keeps the
paths as typed: `rlk compare` and the config hash see those), where --model, --prompts and a
--reward file were when the run started: absolute, symbolic links resolved. A resume and
`rlk export` read the inputs there (`located`, export.py's `_input_model`), whatever their own
current directory; a manifest without the key (written before it) has its typed paths read
from the current directory, as before. Every other input lies in the model directory (tokenizer, chat template,
the KL reference, which is the initial model).

Does not: load tensors (only safetensors headers are read) or validate the model (the loader
reports a bad checkpoint, with its own message, before any step; what cannot be read here is left
out of "vocab"/"weights"), or import torch. Footgun: inputs are hashed when `rlk run` starts; a file
replaced after that and before the loop reads it (seconds) is not caught. Hashing reads every
byte once, one thread per file (~0.37 GB/s per core on this project's CPU: an 8B bf16
checkpoint's 16 GB in five shards takes ~10 s on 5+ cores, ~45 s on one).
Tests: `.venv/bin/python -m pytest -q tests/test_inputs.py`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import pathlib
import struct
from typing import Any

from rlkernel import jsontext, readfile
from rlkernel.config import INPUT_PATHS, ConfigError, RunConfig, flag_name, model_flag_error
from rlkernel.model.config import Qwen3Config

VOCAB_RULE = ("token ids >= the tokenizer's id bound (embedding rows past the tokenizer) have "
              "logit -inf in the canonical log-softmax of logits / T, by global id, in rollout "
              "and trainer: probability 0, never sampled, no gradient")
"""The padded-vocabulary rule, as recorded in every manifest."""

_MODEL_FILES = ("config.json", "model.safetensors.index.json", "tokenizer.json")
_ST_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
_RUN_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# Stored dtype -> the run dtypes that hold every value of it exactly (widening, or the same).
_EXACT_IN = {"bfloat16": ("bfloat16", "float32"), "float16": ("float32",), "float32": ("float32",)}
_CHUNK = 1 << 24


def input_files(cfg: RunConfig) -> list[pathlib.Path]:
    """The files `cfg`'s run reads, sorted: the model directory's config.json, safetensors index,
    every *.safetensors (stray ones too: over-inclusive is the safe side) and tokenizer.json, and
    the prompts file. Names with nothing there are left out (the loaders report them); anything
    else is listed, so that hashing refuses a FIFO, directory or link to nowhere before any work
    (is_file() skipped them, and a resume failed on them only after rewriting its evidence)."""
    out: list[pathlib.Path] = []
    if cfg.model is not None:
        d = pathlib.Path(cfg.model)
        out += [d / n for n in _MODEL_FILES if os.path.lexists(d / n)]
        out += list(d.glob("*.safetensors"))
    if cfg.prompts is not None and os.path.lexists(cfg.prompts):
        out.append(pathlib.Path(cfg.prompts))
    return sorted(out)


def input_paths(cfg: RunConfig) -> dict[str, str | None]:
    """The manifest's "input_paths" of `cfg`'s run (module doc): each INPUT_PATHS field resolved
    against the current directory now, symbolic links followed; None where the field is None. A
    reward spec keeps its ":FUNC" (its file made absolute); a "MODULE:FUNC" spec is kept as
    given: Python's module search finds it, not a path."""
    from rlkernel.data.rewards import reward_file

    out: dict[str, str | None] = {}
    for f in INPUT_PATHS:
        v = getattr(cfg, f)
        if f == "reward" and v is not None:
            where = reward_file(v)
            out[f] = v if where is None else f"{os.path.realpath(where)}:{v.rpartition(':')[2]}"
        else:
            out[f] = None if v is None else os.path.realpath(v)
    return out


def recorded_paths(manifest: dict[str, Any]) -> dict[str, str | None] | None:
    """The manifest's "input_paths", or None when it has none (written before the key).
    Raises ValueError naming the key when it is there but not what `input_paths` writes."""
    paths = manifest.get("input_paths")
    if paths is None:
        return None
    if not (isinstance(paths, dict) and set(paths) == set(INPUT_PATHS)
            and all(v is None or (isinstance(v, str) and v) for v in paths.values())):
        raise ValueError(f"manifest.json input_paths {paths!r}: not a record of "
                         f"{', '.join(INPUT_PATHS)} paths, as rlk run writes")
    return paths


def input_on_disk(field: str, value: str | None) -> str | None:
    """The path an INPUT_PATHS field's value names on disk (a reward spec's file; None for a
    "MODULE:FUNC" reward or an unset field)."""
    from rlkernel.data.rewards import reward_file

    if value is None:
        return None
    return reward_file(value) if field == "reward" else value


def same_input(field: str, given: Any, saved: Any, recorded: str | None) -> bool:
    """Whether an INPUT_PATHS flag given to a resume (`given`) names the input the run reads:
    the file or directory the resume reads (`where_now` of the run's recorded path `recorded`,
    input_paths, and its typed value `saved`; the typed value from the current directory for a
    run without input_paths) — e.g. "/proj/m" for a run started in /proj with "m". The value
    typed at the start names it too when nothing is there from the current directory (a
    resume from elsewhere); a file of that name here that is another file does not. A reward
    spec must name the same function too; a "MODULE:FUNC" spec matches only itself."""
    if not (isinstance(given, str) and isinstance(saved, str)):
        return given == saved
    if field == "reward" and given.rpartition(":")[2] != saved.rpartition(":")[2]:
        return False
    here = input_on_disk(field, given)
    if here is None:                      # a MODULE:FUNC reward: imported by name
        return given == saved
    read = input_on_disk(field, saved if recorded is None else where_now(field, recorded, saved))
    if not os.path.lexists(here):
        return given == saved
    try:
        return read is not None and os.path.samefile(here, read)
    except OSError:   # what the run reads is gone: refused later, naming it
        return False


def located(cfg: RunConfig, paths: dict[str, str | None] | None) -> RunConfig:
    """`cfg` with its inputs where the run recorded them (`paths`: recorded_paths), for a resume
    to read them; `cfg` itself when nothing was recorded. An input gone from its recorded path
    but found at its typed path from the current directory (a project folder moved with its run
    and inputs) is read there: its SHA-256 is checked against the manifest's either way. Raises
    ValueError when `paths` leaves out an input `cfg` names."""
    if paths is None:
        return cfg
    gone = [f for f in INPUT_PATHS if getattr(cfg, f) is not None and paths[f] is None]
    if gone:
        raise ValueError(f"manifest.json input_paths records no {gone[0]} path, but the run's "
                         f"config names {flag_name(gone[0])} {getattr(cfg, gone[0])!r}")

    return dataclasses.replace(cfg, **{f: where_now(f, paths[f], getattr(cfg, f))
                                       for f in INPUT_PATHS if getattr(cfg, f) is not None})


def where_now(field: str, recorded: str | None, typed: str | None) -> str | None:
    """An input's value to read it by: the `recorded` one (input_paths), unless what it names is
    gone and what the `typed` one names from the current directory is there (a project folder
    moved with its run and inputs): its SHA-256 is checked against the manifest's either way."""
    on_disk, here = input_on_disk(field, recorded), input_on_disk(field, typed)
    if (on_disk is not None and not os.path.lexists(on_disk) and here is not None
            and os.path.lexists(here)):
        return typed
    return recorded


def check_located(where: RunConfig, run_dir: str) -> None:
    """Refuse a resume whose input, at the path the run recorded (`where`: `located`), is gone:
    named by that path, not by a flag of the resume's command line. Raises ConfigError."""
    for f, what in INPUT_PATHS.items():
        path = input_on_disk(f, getattr(where, f))
        if path is not None and not os.path.lexists(path):
            raise ConfigError(f"--resume {run_dir!r}: the run's {what} {path!r} (recorded in "
                              "manifest.json input_paths when the run started) no longer "
                              "exists, nor does its path as typed from this directory; "
                              "restore it there to resume, or start a new run")


def relocated(recorded: Any, cfg: RunConfig, where: RunConfig) -> Any:
    """A manifest's "inputs" (recorded for `cfg`, its files keyed by the typed paths) with its
    files keyed as `describe_inputs(where)` keys them, `where` being `located(cfg, ...)`: so
    `check_unchanged` compares a file with itself. Anything else is returned as it is."""
    if where is cfg:
        return recorded
    return rekeyed(recorded, {"model": cfg.model, "prompts": cfg.prompts},
                   {"model": where.model, "prompts": where.prompts})


def rekeyed(recorded: Any, typed: dict[str, Any], now: dict[str, Any]) -> Any:
    """A manifest's "inputs" with its files, keyed by the paths `typed` ("model", "prompts":
    the config's), keyed by the paths `now` gives those fields instead (a model file by its
    name inside `now`'s model directory); keys of a field either lacks as a string stay.
    Anything but a dict of files is returned as it is."""
    files = recorded.get("files") if isinstance(recorded, dict) else None
    if not isinstance(files, dict):
        return recorded

    def moved(field: str) -> tuple[str, str] | None:
        a, b = typed.get(field), now.get(field)
        return (a, b) if isinstance(a, str) and isinstance(b, str) else None

    def key(k: str) -> str:
        p = pathlib.PurePath(k)
        prompts, model = moved("prompts"), moved("model")
        if prompts is not None and p == pathlib.PurePath(prompts[0]):
            return str(pathlib.Path(prompts[1]))
        if model is not None and p.parent == pathlib.PurePath(model[0]):
            return str(pathlib.Path(model[1]) / p.name)
        return k
    return {**recorded, "files": {key(k): v for k, v in files.items()}}


def sha256_file(path: str | pathlib.Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in 16 MiB chunks. Raises OSError."""
    h = hashlib.sha256()
    with readfile.open_binary(path) as f:   # a FIFO swapped in after the listing: refused
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stored_dtypes(files: list[pathlib.Path]) -> list[str] | None:
    """Sorted dtype names of every tensor in the *.safetensors files (from their JSON headers),
    or None when a header cannot be read (the checkpoint loader will say why)."""
    seen: set[str] = set()
    for p in files:
        if p.suffix != ".safetensors":
            continue
        try:
            with readfile.open_binary(p) as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > 100_000_000:
                    return None
                header = jsontext.loads(f.read(n))
            seen.update(_ST_DTYPES.get(v["dtype"], v["dtype"]) for k, v in header.items()
                        if k != "__metadata__")
        except (OSError, ValueError, KeyError, TypeError, struct.error, AttributeError):
            return None
    return sorted(seen)


def _vocab(cfg: RunConfig, mcfg: Qwen3Config | None) -> dict[str, Any] | None:
    """The manifest's padded-vocabulary record. Raises ConfigError (a usage error, before any
    work) when the model directory's tokenizer cannot serve its model."""
    from rlkernel.data.tokenizer import TokenizerError, load_tokenizer

    if mcfg is None:
        return None
    try:
        tok = load_tokenizer(cfg.model, vocab_size=mcfg.vocab_size,
                             eos_token_id=mcfg.eos_token_id)
    except TokenizerError as e:   # its message starts with the file
        raise ConfigError(model_flag_error(cfg.model, str(e))) from None
    live = min(tok.vocab_size, mcfg.vocab_size)
    return {"model_vocab_size": mcfg.vocab_size, "tokenizer": tok.name,
            "tokenizer_ids": tok.vocab_size, "masked_ids": mcfg.vocab_size - live,
            "rule": VOCAB_RULE}


def describe_inputs(cfg: RunConfig, mcfg: Qwen3Config | None) -> dict[str, Any]:
    """The manifest's "inputs" record (module doc) of `cfg`'s run; `mcfg` is the model config
    (None when config.json cannot be read: "vocab" is then null).

    Returns {"files": {path: sha256}, "vocab": {...} | None, "weights": {"stored_dtypes": [...]
    | None, "dtype": run dtype name, "rounded": bool | None}}.
    Raises ConfigError naming the file when an input cannot be read, or when the tokenizer
    does not fit the model (data/tokenizer.load_tokenizer).
    """
    files = input_files(cfg)
    hashes = {}
    # One thread per file (hashlib releases the GIL): a sharded checkpoint hashes in parallel.
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for p, fut in [(p, pool.submit(sha256_file, p)) for p in files]:
            try:
                hashes[str(p)] = fut.result()
            except OSError as e:
                what = (f"cannot read {p} ({readfile.unreadable_reason(p, e)}); inputs are hashed "
                        "into the manifest")
                if cfg.prompts is not None and p == pathlib.Path(cfg.prompts):
                    raise ConfigError(f"--prompts: {what}") from None
                raise ConfigError(model_flag_error(str(cfg.model), what)) from None
    stored = ["bfloat16"] if cfg.model is None else _stored_dtypes(files)  # tiny: init_weights
    run = _RUN_DTYPES[cfg.dtype]
    rounded = None if stored is None else any(run not in _EXACT_IN.get(d, ()) for d in stored)
    return {"files": hashes, "vocab": _vocab(cfg, mcfg),
            "weights": {"stored_dtypes": stored, "dtype": run, "rounded": rounded}}


def startup_notes(cfg: RunConfig, inputs: dict[str, Any]) -> list[str]:
    """One-line notes to print before the run: a checkpoint rounded by --dtype."""
    w = inputs.get("weights") or {}
    if not w.get("rounded"):
        return []
    lossy = [d for d in w["stored_dtypes"] if w["dtype"] not in _EXACT_IN.get(d, ())]
    keep = " (--dtype fp32 keeps them exact)" if cfg.dtype != "fp32" else ""
    return [f"--model {cfg.model!r}: stores {', '.join(lossy)} weights; --dtype {cfg.dtype} rounds "
            f"them to {w['dtype']} (recorded in manifest.json){keep}"]


def check_unchanged(recorded: Any, current: dict[str, Any], run_dir: str) -> None:
    """Refuse a resume whose inputs differ from those recorded when the run started.

    `recorded`: the saved manifest's "inputs" (anything: it is checked); `current`:
    describe_inputs() now. Raises ConfigError naming the first changed, missing or new file (and
    how many more), or saying that nothing was recorded.
    """
    rec = recorded.get("files") if isinstance(recorded, dict) else None
    if not isinstance(rec, dict):
        raise ConfigError(f"--resume {run_dir!r}: manifest.json records no input hashes (written "
                          "by an older rl-kernel), so the model and prompts cannot be checked; "
                          "start a new run")
    cur = current["files"]
    problems = []
    for path in sorted(set(rec) | set(cur)):
        if path not in cur:
            problems.append(f"input {path} is gone")
        elif path not in rec:
            problems.append(f"input {path} was not there when the run started")
        elif rec[path] != cur[path]:
            problems.append(f"input {path} changed since the run started (SHA-256 "
                            f"{cur[path][:12]}… now, {str(rec[path])[:12]}… recorded)")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(f"--resume {run_dir!r}: {problems[0]}{more}; a resumed run must read "
                          "the inputs it started with (it reloads them, the KL reference "
                          "included)")


def read_twice_problem(cfg: RunConfig, seen: list[tuple[dict[str, Any], Any]]) -> str | None:
    """Why the prompts or reward source the loop read are not the bytes `rlk run` read and
    recorded when it started, or None. `rlk run` parses the --prompts file and imports the
    --reward before any work (manifest "prompts" and "reward"); the loop reads both again after
    the model has loaded — seconds, or minutes for a real checkpoint — and, in a launched run,
    on every rank. A file replaced in between trained on inputs the manifest does not describe
    (and `rlk compare` then showed a reproducibility failure where an input had changed), and
    ranks could read different files.

    `seen`: every rank's (now, then) in rank order, now = {"prompts": prompt_source(...)
    .describe(), "reward": RewardFn.describe()} as the loop read them, then = the same as the
    start read them (None where a rank does not have it). Every rank passes the same list
    (gathered), so every rank decides alike."""
    for key, hash_key, flag in (("prompts", "sha256", "--prompts"),
                                ("reward", "source_sha256", "--reward")):
        start = next((then[key].get(hash_key) for _, then in seen if then is not None), None)
        want = start if start is not None else seen[0][0][key].get(hash_key)   # else rank 0's
        for rank, (now, _) in enumerate(seen):
            got = now[key].get(hash_key)
            if got != want:
                what = (f"SHA-256 {str(start)[:12]}… when rlk run checked it, "
                        if start is not None else "")
                where = f" on rank {rank}" if len(seen) > 1 else ""
                path = cfg.prompts if key == "prompts" else now[key].get("source_file")
                return (f"{flag} {str(path)!r}: the file changed while the run was starting "
                        f"({what}{str(got)[:12]}… when the loop read it{where}); keep the "
                        "inputs of a run unchanged until its first step, and start it again")
    return None
