"""Hugging Face safetensors checkpoints of Qwen3: save (atomically), load (strictly), and init.

A checkpoint directory is what transformers writes and reads: `config.json` plus either one
`model.safetensors` or shards listed by `model.safetensors.index.json` (its "weight_map"). Tensors
are keyed by their Hugging Face names; the set of names and shapes is exactly
`param_shapes(cfg)`, so loading is strict: a missing, extra, misshapen or non-float tensor is a
`CheckpointError` naming the file and the tensor, never a silent partial load.

Does not: shard for tensor/context parallelism (each parameter loads its own shard elsewhere,
STYLE.md §9), convert dtypes (tensors come back as stored), make tokenizer files (a caller
passes them to `save_checkpoint` as `extra_files`), or touch the network. Test: `python -m pytest -q tests/test_checkpoint.py`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rlkernel import jsontext, readfile
from rlkernel.model.config import (Qwen3Config, assignments, defaulted_shape_keys, param_shapes,
                                   preset)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ALLOWED = ", ".join(str(d).removeprefix("torch.") for d in ALLOWED_DTYPES)
_MAX_LISTED = 8  # names listed per problem line before "and N more"


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded; the message names path, tensor and the fix."""


# ----------------------------------------------------------------------------------------------
# save


def save_checkpoint(out_dir: str | os.PathLike, cfg: Qwen3Config,
                    tensors: dict[str, torch.Tensor],
                    extra_files: dict[str, bytes] | None = None) -> None:
    """Write `config.json`, `model.safetensors` and `extra_files` into `out_dir`, all or nothing.

    Both files are written and fsynced in a sibling temp dir (`.<name>.tmp-*`), which is then
    renamed onto `out_dir` (POSIX rename replaces an empty directory atomically), so a reader
    never sees a half-written checkpoint. Parent directories are created.

    Args:
      cfg: its `to_hf_dict()` becomes config.json, with "torch_dtype" set to the tensors' dtype
        (transformers 5 loads with dtype="auto", i.e. casts to the config's dtype).
      tensors: name -> tensor, exactly the names and shapes of `param_shapes(cfg)`; any device,
        one dtype for all, from float32 / bfloat16 / float16. Not modified.
      extra_files: plain file name -> bytes, written beside them (tokenizer files, metadata);
        a name with a path separator, or config.json / model.safetensors, is refused.
    Raises CheckpointError: `out_dir` exists and is not an empty directory; a tensor is missing,
      extra, of the wrong shape or dtype; the dtypes are mixed; its parent cannot be created or
      written (read-only, full: the temp dir is removed); the final rename fails.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: refusing to write a checkpoint into an existing "
                              "non-empty path; allowed: a new or empty directory")
    problems = _check_tensors(cfg, tensors, origin={})
    if problems:
        raise CheckpointError(f"{out}: tensors do not match the model config: "
                              + "; ".join(problems))
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    if len(dtypes) > 1:
        raise CheckpointError(f"{out}: tensors have mixed dtypes {dtypes}; config.json records one "
                              "dtype, so all tensors must share it")
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = dtypes[0]
    extra = dict(extra_files or {})
    bad = [n for n in extra if Path(n).name != n or n in (".", "..", CONFIG_NAME, WEIGHTS_NAME)]
    if bad:
        raise CheckpointError(f"{out}: extra file name(s) {bad} not allowed; allowed: plain file "
                              f"names other than {CONFIG_NAME} and {WEIGHTS_NAME}")

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(tmp)  # not mkdtemp: that makes the final directory mode 0700
    except OSError as e:   # a read-only or missing parent: name it, not our temp name
        raise CheckpointError(f"{out}: cannot create it in {str(out.parent)!r} "
                              f"({e.strerror or e})") from None
    try:
        cfg_path = tmp / CONFIG_NAME
        cfg_path.write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
        _fsync(cfg_path)
        weights_path = tmp / WEIGHTS_NAME
        try:
            save_file(_host_tensors(cfg, tensors), str(weights_path), metadata={"format": "pt"})
        except SafetensorError as e:   # its I/O errors (a full disk) are not OSErrors
            raise CheckpointError(f"{out}: cannot write {WEIGHTS_NAME} ({e})") from None
        # safetensors creates the file 0600; a model directory is meant to be shared like the
        # config beside it, so give it the umask's usual mode.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(weights_path, 0o666 & ~umask)
        _fsync(weights_path)
        for name, data in extra.items():
            (tmp / name).write_bytes(data)
            _fsync(tmp / name)
        _fsync(tmp)
        try:
            os.replace(tmp, out)
        except OSError as e:
            raise CheckpointError(f"{out}: could not move the finished checkpoint into place "
                                  f"({e.strerror}); was the directory filled meanwhile?") from e
    except OSError as e:   # e.g. a full disk while writing a file: the temp dir is removed
        shutil.rmtree(tmp, ignore_errors=True)
        name = Path(e.filename).name if getattr(e, "filename", None) else "its files"
        raise CheckpointError(f"{out}: cannot write {name} ({e.strerror or e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(out.parent)


def _host_tensors(cfg: Qwen3Config, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors in canonical order, copying any that share storage.

    safetensors refuses aliased tensors (e.g. a caller passing one buffer under two names).
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in param_shapes(cfg):
        t = tensors[name].detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out[name] = t
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# load


def load_checkpoint(model_dir: str | os.PathLike) -> tuple[Qwen3Config, dict[str, torch.Tensor]]:
    """Read a Hugging Face Qwen3 checkpoint directory, strictly.

    Returns (cfg, tensors): tensors in `param_shapes(cfg)` order, on CPU, each of shape
    `param_shapes(cfg)[name]` and dtype as stored (float32, bfloat16 or float16; may differ per
    tensor). The tensors own their memory (copied out of the file mapping), so rewriting the
    files afterwards cannot corrupt them.

    A tied config (tie_word_embeddings=true) may still store `lm_head.weight` (some exporters do);
    it is accepted and dropped only when byte-equal to `model.embed_tokens.weight`.

    Raises CheckpointError, naming the file and tensor, when: the directory is missing; config.json
    is missing, not JSON, or not a supported dense Qwen3 config; there is no *.safetensors, or
    several without an index, or both model.safetensors and an index; the index is malformed,
    names a missing shard, or disagrees with the shards' contents; a safetensors file is
    truncated or corrupt; a file is not a regular file (a FIFO, a device); a tensor appears in
    two shards; any tensor is missing, unexpected, of the wrong shape, or not
    float32/bfloat16/float16.
    """
    d = Path(model_dir)
    if not d.exists():
        raise CheckpointError(f"{d}: model directory does not exist")
    if not d.is_dir():
        raise CheckpointError(f"{d}: is not a directory; expected a Hugging Face checkpoint "
                              f"directory with {CONFIG_NAME} and *.safetensors")
    cfg, taken = _config_and_defaults(d / CONFIG_NAME)

    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}  # tensor name -> file name, for messages
    for path, listed in _weight_files(d).items():
        loaded = _read_safetensors(path)
        for name, t in loaded.items():
            if name in tensors:
                raise CheckpointError(f"{path}: tensor {name!r} is also stored in "
                                      f"{origin[name]}; each tensor must be stored once")
            tensors[name] = t
            origin[name] = path.name
        if listed is not None:
            _check_shard_against_index(d / INDEX_NAME, path, listed, set(loaded))

    emb, head = "model.embed_tokens.weight", "lm_head.weight"
    if cfg.tie_word_embeddings and head in tensors and emb in tensors:
        if not _bytes_equal(tensors[head], tensors[emb]):
            raise CheckpointError(
                f"{d / origin[head]}: tensor {head!r} differs from {emb!r} but {CONFIG_NAME} has "
                "tie_word_embeddings=true; allowed: no lm_head.weight, or one byte-equal to the "
                "embedding (or set tie_word_embeddings=false)")
        del tensors[head]

    problems = _check_tensors(cfg, tensors, origin)
    if problems:
        hint = ""
        if taken and any(" has shape " in p for p in problems):   # the shape may be the default's
            hint = (f" ({CONFIG_NAME} does not set {', '.join(taken)}; transformers' defaults "
                    f"were taken: {assignments(taken)})")
        raise CheckpointError(f"{d}: checkpoint does not match its {CONFIG_NAME}: "
                              + "; ".join(problems) + hint)
    # A NaN/Inf weight would otherwise surface only mid-rollout as "logprobs contain NaN", with
    # no tensor named; a read-only scan is cheap next to the clone below.
    nonfinite = [f"{n!r} (in {origin[n]}, {k} value(s), first at index {i})"
                 for n in param_shapes(cfg) for k, i in [_nonfinite(tensors[n])] if k]
    if nonfinite:
        raise CheckpointError(f"{d}: non-finite (NaN or Inf) weights in tensor(s) "
                              + ", ".join(nonfinite[:_MAX_LISTED])
                              + (f" and {len(nonfinite) - _MAX_LISTED} more"
                                 if len(nonfinite) > _MAX_LISTED else ""))
    # clone: safetensors returns views of a memory-mapped file; a later in-place rewrite of that
    # file would otherwise crash this process with SIGBUS or silently change the weights.
    return cfg, {name: tensors[name].clone() for name in param_shapes(cfg)}


def read_model_config(model_dir: str | os.PathLike) -> Qwen3Config:
    """The Qwen3Config of `model_dir`/config.json, without reading any weights.

    Raises CheckpointError naming the file (missing, not JSON, not a dense Qwen3 config)."""
    return _read_config(Path(model_dir) / CONFIG_NAME)


def _read_json(path: Path):
    """Parsed JSON of `path`; CheckpointError naming the file (and line/column) otherwise."""
    try:
        return readfile.read_json(path)
    except readfile.NotRegularFileError as e:   # a FIFO would block, a device never end
        raise CheckpointError(f"{e}; expected a JSON file") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({jsontext.located(e, column=True)})"
                              ) from None
    except (UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{path}: cannot be read as UTF-8 JSON ({e})") from None


def _read_config(path: Path) -> Qwen3Config:
    return _config_and_defaults(path)[0]


def _config_and_defaults(path: Path) -> tuple[Qwen3Config, dict[str, object]]:
    """(the config, `defaulted_shape_keys` of the file): CheckpointError as `_read_config`."""
    if not path.exists():   # anything else there (a FIFO, a directory): _read_json says what
        raise CheckpointError(f"{path}: missing; a checkpoint directory needs a Hugging Face "
                              f"{CONFIG_NAME}")
    d = _read_json(path)
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: top level is a JSON {type(d).__name__}; expected an object")
    _check_hf_fields(d, path)
    try:
        return Qwen3Config.from_hf_dict(d, source=str(path)), defaulted_shape_keys(d)
    except (ValueError, TypeError) as e:
        msg = str(e)
        raise CheckpointError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None


def _check_hf_fields(d: dict, path: Path) -> None:
    """Reject transformers-5-style fields that change the math but Qwen3Config.from_hf_dict skips.

    transformers 5 writes RoPE as "rope_parameters" (no "rope_theta", no "rope_scaling") and
    per-layer attention as "layer_types"; a scaled RoPE or sliding window there would otherwise
    load silently as plain full-attention RoPE.
    """
    rp = d.get("rope_parameters")
    if rp is not None:
        if not isinstance(rp, dict):
            raise CheckpointError(f"{path}: rope_parameters must be an object, got {rp!r}")
        if rp.get("rope_type", rp.get("type", "default")) != "default":
            raise CheckpointError(f"{path}: rope_parameters {rp!r} is not supported; only "
                                  "rope_type 'default'")
        top, nested = d.get("rope_theta"), rp.get("rope_theta")
        if (isinstance(top, (int, float)) and isinstance(nested, (int, float))
                and float(top) != float(nested)):
            raise CheckpointError(f"{path}: rope_theta={top} disagrees with "
                                  f"rope_parameters.rope_theta={nested}; they must be equal")
    if d.get("use_sliding_window"):
        raise CheckpointError(f"{path}: use_sliding_window=true is not supported; only full "
                              "attention")
    layer_types = d.get("layer_types") or []
    if not isinstance(layer_types, list):  # iterating a number would raise TypeError (a crash)
        raise CheckpointError(f"{path}: layer_types must be a list, got {layer_types!r}")
    bad = sorted({t if isinstance(t, str) else repr(t) for t in layer_types
                  if t != "full_attention"})
    if bad:
        raise CheckpointError(f"{path}: layer_types {bad} are not supported; only "
                              "'full_attention'")


def _weight_files(d: Path) -> dict[Path, set[str] | None]:
    """Safetensors files to read -> the tensor names the index assigns them (None: no index)."""
    index, single = d / INDEX_NAME, d / WEIGHTS_NAME
    if index.exists() and single.exists():
        raise CheckpointError(f"{d}: has both {WEIGHTS_NAME} and {INDEX_NAME}, so it is ambiguous "
                              "which weights count; allowed: exactly one of them")
    if index.exists():
        return _read_index(index)
    if single.exists():
        return {single: None}
    found = sorted(d.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{d}: no *.safetensors file; allowed: {WEIGHTS_NAME}, or shards "
                              f"listed in {INDEX_NAME}")
    if len(found) > 1:
        raise CheckpointError(f"{d}: several safetensors files {[p.name for p in found]} but no "
                              f"{INDEX_NAME} saying which tensor is where; allowed: one file, or "
                              "shards with an index")
    return {found[0]: None}


def _read_index(index: Path) -> dict[Path, set[str] | None]:
    data = _read_json(index)
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                           for k, v in wm.items()):
        raise CheckpointError(f"{index}: needs a \"weight_map\" object of tensor name -> shard "
                              "file name")
    shards: dict[Path, set[str] | None] = {}
    for name, fname in wm.items():
        # Shards live next to the index; a path could escape the checkpoint directory.
        if Path(fname).name != fname or fname in (".", ".."):
            raise CheckpointError(f"{index}: tensor {name!r} maps to {fname!r}; allowed: a plain "
                                  "file name in the same directory")
        path = index.parent / fname
        if not path.exists():   # anything else there: _read_safetensors says what
            raise CheckpointError(f"{index}: tensor {name!r} is in shard {fname!r}, which is "
                                  "missing")
        names = shards.setdefault(path, set())
        assert names is not None
        names.add(name)
    return shards


def _check_shard_against_index(index: Path, shard: Path, listed: set[str], found: set[str]) -> None:
    if listed - found:
        raise CheckpointError(f"{index}: lists {_names(listed - found)} in {shard.name}, but that "
                              "file does not contain them")
    if found - listed:
        raise CheckpointError(f"{shard}: holds {_names(found - listed)}, which {INDEX_NAME} does "
                              "not list in it; the index must name every tensor's shard")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        readfile.require_regular(path)   # load_file opens by name: a FIFO would block it forever
        return load_file(str(path), device="cpu")
    except readfile.NotRegularFileError as e:
        raise CheckpointError(f"{e}; expected a safetensors file") from None
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): "
                              f"{e}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e})") from None


def _check_tensors(cfg: Qwen3Config, tensors: dict[str, torch.Tensor],
                   origin: dict[str, str]) -> list[str]:
    """Problems (one line each, naming tensor and file) against param_shapes(cfg); [] if none."""
    expected = param_shapes(cfg)

    def where(n: str) -> str:
        return f" in {origin[n]}" if n in origin else ""

    problems: list[str] = []
    missing = [n for n in expected if n not in tensors]
    if missing:
        problems.append(f"missing tensor(s) {_names(missing)}")
    extra = [n for n in tensors if n not in expected]
    if extra:
        hint = ""
        if "lm_head.weight" in extra:
            hint = " (lm_head.weight is only allowed when tie_word_embeddings=false)"
        problems.append(f"unexpected extra tensor(s) {_names(extra, origin)}{hint}")
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            problems.append(f"tensor {name!r}{where(name)} is a {type(t).__name__}, not a tensor")
            continue
        if tuple(t.shape) != shape:
            problems.append(f"tensor {name!r}{where(name)} has shape {tuple(t.shape)}; "
                            f"expected {shape}")
        if t.dtype not in ALLOWED_DTYPES:
            kind = "floating" if t.is_floating_point() else "non-floating"
            problems.append(f"tensor {name!r}{where(name)} has {kind} dtype "
                            f"{str(t.dtype).removeprefix('torch.')}; allowed: {_ALLOWED}")
    return problems


def _names(names, origin: dict[str, str] | None = None) -> str:
    names = sorted(names) if isinstance(names, set) else list(names)
    shown = [f"{n!r}" + (f" (in {origin[n]})" if origin and n in origin else "")
             for n in names[:_MAX_LISTED]]
    more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(shown) + more


def _nonfinite(t: torch.Tensor, chunk: int = 1 << 24) -> tuple[int, tuple[int, ...] | None]:
    """(count of NaN/Inf elements, index of the first one or None), scanning `chunk` elements at
    a time so the temporary mask stays small for embedding-sized tensors."""
    flat = t.reshape(-1)
    count, first = 0, None
    for s in range(0, flat.numel(), chunk):
        part = flat[s:s + chunk]
        if torch.isfinite(part.abs().amax()):  # fast path (amax propagates NaN): ~5x isfinite
            continue
        bad = ~torch.isfinite(part)
        n = int(bad.sum())
        if n and first is None:
            flat_i = s + int(bad.nonzero()[0, 0])
            first = tuple(int(x) for x in torch.unravel_index(torch.tensor(flat_i), t.shape))
        count += n
    return count, first


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (unlike torch.equal: NaN == NaN, -0.0 != +0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# init


def init_weights(cfg: Qwen3Config, seed: int,
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Deterministic random weights for `cfg`, in `param_shapes(cfg)` order, on CPU.

    Recipe (the bytes are a function of it; change it only with a new name):
      g = torch.Generator().manual_seed(seed), seeded once; then for each parameter in
      param_shapes(cfg) order: norm weights (names ending "norm.weight": input/post-attention
      layernorms, q_norm, k_norm, model.norm) are ones and draw nothing; every other (2-D)
      parameter is torch.empty(shape, float32).normal_(0, cfg.initializer_range, generator=g);
      each is then cast to `dtype` (round-to-nearest-even). This matches the distribution of
      transformers' Qwen3 `_init_weights` but not its bytes.

    Same (cfg, seed, dtype) -> same bytes on one machine and torch version. Footgun: torch's CPU
    normal_ is vectorised per CPU capability, and ATEN_CPU_CAPABILITY=default gives fp32 values a
    few ulp away from avx2/avx512 (about 1e-4 of bf16 elements then differ). To share an init
    across machines, share the checkpoint written by `init_model` and compare its hashes.

    Args: seed: int in [0, 2**64). dtype: float32, bfloat16 or float16.
    Raises ValueError: bad seed or dtype.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"--seed {seed!r} must be an integer in [0, 2**64)")
    if dtype not in ALLOWED_DTYPES:
        raise ValueError(f"init dtype {dtype} is not allowed; allowed: {_ALLOWED}")
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype)
        else:
            w = torch.empty(shape, dtype=torch.float32).normal_(0.0, cfg.initializer_range,
                                                               generator=g)
            out[name] = w.to(dtype)  # per tensor: peak memory is one fp32 matrix
    return out


def init_model(preset_name: str, seed: int, out_dir: str | os.PathLike) -> Path:
    """`init_weights(preset(preset_name), seed)` in bfloat16, saved with `save_checkpoint`
    together with a stand-in byte-level tokenizer (rlkernel/data/tokenizer.py
    `standin_tokenizer_files`), so `rlk run --model out_dir` works on it.

    Returns the checkpoint directory. Raises ValueError for an unknown preset or bad seed, and
    CheckpointError when `out_dir` exists and is not empty (checked before any weights are made).
    """
    cfg = preset(preset_name)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: refusing to write a checkpoint into an existing "
                              "non-empty path; allowed: a new or empty directory")
    from rlkernel.data.tokenizer import standin_tokenizer_files

    save_checkpoint(out, cfg, init_weights(cfg, seed),
                    extra_files=standin_tokenizer_files(cfg.vocab_size, cfg.eos_token_id))
    return out
