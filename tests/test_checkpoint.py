"""Tests of rlkernel/weights/hashing.py and rlkernel/model/checkpoint.py (CPU, a few seconds).

Properties: tensor hashes change with any bit, dtype or shape; the version hash is the documented
Merkle root; save -> load is bytewise identity; init is deterministic per seed; checkpoints go
both ways between us and transformers' Qwen3ForCausalLM; bad checkpoints fail with messages that
name the file and tensor. Run: `python -m pytest -q tests/test_checkpoint.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlkernel.model import checkpoint as ckpt
from rlkernel.model.checkpoint import (CheckpointError, init_model, init_weights, load_checkpoint,
                                       save_checkpoint)
from rlkernel.model.config import param_shapes, tiny
from rlkernel.weights import hashing
from rlkernel.weights.hashing import compare_hashes, state_hashes, tensor_hash, version_hash

EMB, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view with the same bytes, so torch.equal compares bits (NaN, -0.0 included)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(bits(a[name]), bits(b[name])), name


def write_raw(d: Path, cfg_dict: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """A checkpoint written without our validation, to build broken ones."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg_dict))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    return d


# ----------------------------------------------------------------------------------------------
# hashing


def _documented_hash(t: torch.Tensor, dtype: bytes, shape: bytes, chunk: int) -> str:
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    digests = b"".join(hashlib.sha256(raw[a:a + chunk]).digest() for a in range(0, len(raw), chunk))
    return hashlib.sha256(b"rlk-tensor-v2\0" + dtype + b"\0" + shape + b"\0"
                          + str(chunk).encode() + b"\0" + digests).hexdigest()


def test_tensor_hash_is_the_documented_sha256():
    t = torch.tensor([[1.0, -0.0, 2.5]], dtype=torch.bfloat16)
    assert tensor_hash(t) == _documented_hash(t, b"bfloat16", b"1,3", hashing.HASH_CHUNK_BYTES)
    empty = torch.zeros(0, 4)
    assert tensor_hash(empty) == hashlib.sha256(b"rlk-tensor-v2\0float32\0" b"0,4\0"
                                                + str(hashing.HASH_CHUNK_BYTES).encode()
                                                + b"\0").hexdigest()


@pytest.mark.parametrize("chunk", [2, 6, 7, 64])
def test_tensor_hash_chunks_cover_every_byte_once(monkeypatch, chunk):
    """Chunk boundaries inside and between elements, a short last chunk, one chunk: the hash is
    the documented two-level SHA-256, state_hashes (chunks on a thread pool) agrees with it, and a
    flipped bit in the last byte of any chunk changes it (no byte skipped at a boundary)."""
    monkeypatch.setattr(hashing, "HASH_CHUNK_BYTES", chunk)
    t = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))   # 60 bytes
    h = tensor_hash(t)
    assert h == _documented_hash(t, b"float32", b"5,3", chunk)
    many = {"a": t, "b": t.to(torch.bfloat16), "c": torch.arange(7, dtype=torch.int8)}
    assert hashing.state_hashes(many) == {n: tensor_hash(x) for n, x in many.items()}
    for end in range(chunk, 61, chunk):
        flipped = t.clone()
        flipped.reshape(-1).view(torch.uint8)[end - 1] ^= 1
        assert tensor_hash(flipped) != h


def test_tensor_hash_stable_across_copies_layouts_and_calls():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(33, 17, generator=g).to(torch.bfloat16)
    h = tensor_hash(t)
    assert h == tensor_hash(t) == tensor_hash(t.clone())
    assert tensor_hash(t.t().contiguous().t()) == h  # non-contiguous view, same logical content
    assert tensor_hash(t.clone().requires_grad_(True)) == h
    assert tensor_hash(torch.cat([torch.zeros(1, 17, dtype=t.dtype), t])[1:]) == h  # storage offset
    assert len(h) == 64 and int(h, 16) >= 0


def test_one_bit_flip_of_bf16_changes_hash():
    t = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    flipped = t.clone()
    flipped.view(torch.int16)[5, 7] ^= 1  # lowest mantissa bit of one element
    assert not torch.equal(bits(t), bits(flipped))
    assert tensor_hash(flipped) != tensor_hash(t)


def test_dtype_or_shape_change_changes_hash_with_same_bytes():
    t = torch.randn(8, 6, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    variants = [t, t.view(torch.int16), t.view(torch.float16), t.reshape(6, 8), t.reshape(48),
                t.reshape(1, 8, 6)]
    assert len({tensor_hash(v) for v in variants}) == len(variants)


def test_same_bytes_compares_bits_not_values():
    """same_bytes: 0.0 vs −0.0 differ (torch.equal calls them equal), one NaN equals its copy
    (torch.equal says not), NaNs of two payloads differ, bf16 too."""
    from rlkernel.weights.hashing import same_bytes
    zero, neg = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    assert torch.equal(zero, neg) and not same_bytes(zero, neg)
    assert not same_bytes(zero.bfloat16(), neg.bfloat16())
    nan = torch.tensor([float("nan"), 2.0])
    assert not torch.equal(nan, nan.clone()) and same_bytes(nan, nan.clone())
    other = nan.clone()
    other.view(torch.int32)[0] ^= 1   # another NaN payload
    assert not same_bytes(nan, other)


def test_tensor_hash_sees_signed_zero_and_nan_bits():
    assert tensor_hash(torch.tensor([0.0])) != tensor_hash(torch.tensor([-0.0]))
    nan = torch.tensor([float("nan")])
    assert tensor_hash(nan) == tensor_hash(nan.clone())
    assert tensor_hash(torch.tensor(3.0)) != tensor_hash(torch.tensor([3.0]))  # 0-d vs 1-d
    assert tensor_hash(torch.empty(0, 4)) != tensor_hash(torch.empty(4, 0))


def _leaf(name: str, h: str) -> bytes:
    return hashlib.sha256(f"{name}\0{h}".encode()).digest()


def test_version_hash_is_the_documented_merkle_root():
    hs = {"a": "11" * 32, "b": "22" * 32, "c": "33" * 32}
    la, lb, lc = _leaf("a", hs["a"]), _leaf("b", hs["b"]), _leaf("c", hs["c"])
    # 3 leaves: (a,b) pair up, c is carried up unchanged, then the two nodes pair.
    want = hashlib.sha256(hashlib.sha256(la + lb).digest() + lc).hexdigest()
    assert version_hash(hs) == want
    assert version_hash({"a": hs["a"]}) == la.hex()
    assert version_hash({}) == hashlib.sha256(b"").hexdigest()


def test_version_hash_is_order_name_and_content_sensitive():
    hs = {f"t{i}": tensor_hash(torch.full((3,), float(i))) for i in range(7)}
    root = version_hash(hs)
    assert version_hash(dict(hs)) == root
    assert version_hash(dict(reversed(hs.items()))) != root
    swapped = dict(hs)
    swapped["t3"], swapped["t4"] = hs["t4"], hs["t3"]
    assert version_hash(swapped) != root
    renamed = {("T0" if k == "t0" else k): v for k, v in hs.items()}
    assert version_hash(renamed) != root
    dropped = dict(hs)
    del dropped["t6"]  # the odd carried-up node must count too
    assert version_hash(dropped) != root
    with pytest.raises(ValueError, match="NUL"):
        version_hash({"a\0b": "00"})


def test_compare_hashes_names_every_problem():
    exp = {"a": "1" * 64, "b": "2" * 64, "c": "3" * 64}
    assert compare_hashes(exp, dict(exp)) == []
    act = {"a": "1" * 64, "b": "9" * 64, "d": "4" * 64}
    problems = compare_hashes(exp, act)
    assert len(problems) == 3
    assert any("missing tensor 'c'" in p for p in problems)
    assert any("unexpected extra tensor 'd'" in p for p in problems)
    assert any("tensor 'b' differs" in p and "2222" in p and "9999" in p for p in problems)
    reordered = {"b": exp["b"], "a": exp["a"], "c": exp["c"]}
    (order,) = compare_hashes(exp, reordered)
    assert "order" in order and "'a'" in order and "'b'" in order
    assert version_hash(exp) != version_hash(reordered)


# ----------------------------------------------------------------------------------------------
# save / load / init


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_save_load_round_trip_is_bytewise(tmp_path, dtype):
    cfg = tiny()
    tensors = init_weights(cfg, seed=5, dtype=dtype)
    save_checkpoint(tmp_path / "ck", cfg, tensors)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp dir left behind
    assert sorted(os.listdir(tmp_path / "ck")) == ["config.json", "model.safetensors"]
    modes = {f: (tmp_path / "ck" / f).stat().st_mode & 0o777
             for f in ("config.json", "model.safetensors")}
    assert modes["model.safetensors"] == modes["config.json"]   # shared alike (was 0600)
    stored = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert stored["torch_dtype"] == str(dtype).removeprefix("torch.")
    cfg2, loaded = load_checkpoint(tmp_path / "ck")
    assert cfg2 == cfg
    assert list(loaded) == list(param_shapes(cfg))
    assert_same_bytes(loaded, tensors)
    assert state_hashes(loaded) == state_hashes(tensors)


def test_round_trip_untied_has_lm_head(tmp_path):
    cfg = tiny().replace(tie_word_embeddings=False)
    tensors = init_weights(cfg, seed=1)
    assert list(tensors)[-1] == HEAD
    save_checkpoint(tmp_path / "ck", cfg, tensors)
    cfg2, loaded = load_checkpoint(tmp_path / "ck")
    assert cfg2 == cfg
    assert_same_bytes(loaded, tensors)


def test_loaded_tensors_do_not_alias_the_file(tmp_path):
    cfg = tiny()
    tensors = init_weights(cfg, seed=2)
    save_checkpoint(tmp_path / "ck", cfg, tensors)
    _, loaded = load_checkpoint(tmp_path / "ck")
    f = tmp_path / "ck" / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:  # same size in place: a memory-mapped result would change
        fh.seek(size // 2)
        fh.write(b"\0" * (size - size // 2))
    assert_same_bytes(loaded, tensors)


def test_save_refuses_non_empty_dir_and_accepts_empty_one(tmp_path):
    cfg = tiny()
    tensors = init_weights(cfg, seed=0)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"full.*non-empty"):
        save_checkpoint(tmp_path / "full", cfg, tensors)
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    save_checkpoint(tmp_path / "empty", cfg, tensors)
    assert_same_bytes(load_checkpoint(tmp_path / "empty")[1], tensors)
    save_checkpoint(tmp_path / "a" / "b" / "new", cfg, tensors)  # parents created
    with pytest.raises(CheckpointError, match="new.*non-empty"):
        init_model("tiny", 0, tmp_path / "a" / "b" / "new")


def test_save_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", boom)
    with pytest.raises(CheckpointError, match=r"ck: cannot write its files \(disk full\)"):
        save_checkpoint(tmp_path / "ck", tiny(), init_weights(tiny(), seed=0))
    assert os.listdir(tmp_path) == []  # neither the target nor the temp dir exists


def test_a_failed_write_names_the_checkpoint_and_file_not_the_temp_dir(tmp_path, monkeypatch):
    """ENOSPC while writing config.json: CheckpointError naming the checkpoint and the file
    (was an OSError naming `.ck.tmp-PID-hex/config.json`); the temp dir is gone."""
    real = Path.write_text

    def full(self, *a, **k):
        if self.name == "config.json":
            raise OSError(28, "No space left on device", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path / "ck", tiny(), init_weights(tiny(), seed=0))
    assert str(e.value) == f"{tmp_path / 'ck'}: cannot write config.json (No space left on device)"
    assert ".tmp-" not in str(e.value) and os.listdir(tmp_path) == []


def test_a_read_only_parent_is_named_not_the_temp_dir(tmp_path, monkeypatch):
    """The parent refuses the temp dir (read-only; root ignores chmod here, so os.mkdir is made
    to fail as it would): CheckpointError naming the checkpoint and its parent, nothing left."""
    def refuse(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(ckpt.os, "mkdir", refuse)
    with pytest.raises(CheckpointError) as e:
        init_model("tiny", 0, tmp_path / "m")
    assert str(e.value) == (f"{tmp_path / 'm'}: cannot create it in {str(tmp_path)!r} "
                            "(Permission denied)")
    assert os.listdir(tmp_path) == []


def test_save_rejects_wrong_tensors_and_names_them(tmp_path):
    cfg = tiny()
    good = init_weights(cfg, seed=0)
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    with pytest.raises(CheckpointError, match="missing.*'model.norm.weight'"):
        save_checkpoint(tmp_path / "a", cfg, missing)
    with pytest.raises(CheckpointError, match="extra.*'lm_head.weight'.*tie_word_embeddings"):
        save_checkpoint(tmp_path / "b", cfg, {**good, HEAD: good[EMB].clone()})
    bad_shape = {**good, "model.layers.1.mlp.up_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight'.*\(3, 3\)"):
        save_checkpoint(tmp_path / "c", cfg, bad_shape)
    mixed = {**good, "model.norm.weight": good["model.norm.weight"].float()}
    with pytest.raises(CheckpointError, match="mixed dtypes"):
        save_checkpoint(tmp_path / "d", cfg, mixed)
    assert os.listdir(tmp_path) == []


def test_save_accepts_aliased_tensors(tmp_path):
    cfg = tiny()
    tensors = init_weights(cfg, seed=0)
    norm0, norm1 = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"
    tensors[norm1] = tensors[norm0]
    save_checkpoint(tmp_path / "ck", cfg, tensors)  # safetensors alone refuses shared storage
    assert_same_bytes(load_checkpoint(tmp_path / "ck")[1], tensors)


def test_init_weights_deterministic_and_seed_sensitive():
    cfg = tiny().replace(tie_word_embeddings=False)
    a, b = init_weights(cfg, seed=7), init_weights(cfg, seed=7)
    assert_same_bytes(a, b)
    c = init_weights(cfg, seed=8)
    assert list(a) == list(param_shapes(cfg))
    for name, t in a.items():
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == param_shapes(cfg)[name]
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)) and torch.equal(c[name], t)
        else:
            assert not torch.equal(bits(t), bits(c[name])), name
    assert version_hash(state_hashes(a)) != version_hash(state_hashes(c))
    emb = a[EMB].float()
    assert abs(emb.mean().item()) < 0.002 and abs(emb.std().item() - cfg.initializer_range) < 0.002


def test_init_weights_recipe_draws_in_canonical_order():
    """Each matrix == bf16(normal_ drawn from one generator, seeded once, in param_shapes order)."""
    cfg = tiny()
    got = init_weights(cfg, seed=11)
    g = torch.Generator().manual_seed(11)
    for name, shape in param_shapes(cfg).items():
        if not name.endswith("norm.weight"):
            want = torch.empty(shape).normal_(0.0, cfg.initializer_range, generator=g)
            assert torch.equal(bits(got[name]), bits(want.to(torch.bfloat16))), name
    fp32 = init_weights(cfg, seed=11, dtype=torch.float32)
    assert_same_bytes({k: v.to(torch.bfloat16) for k, v in fp32.items()}, got)
    with pytest.raises(ValueError, match="seed"):
        init_weights(cfg, seed=-1)
    with pytest.raises(ValueError, match="allowed"):
        init_weights(cfg, seed=0, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# transformers interop


def test_init_model_loads_in_transformers_bytewise(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = init_model("tiny", 3, tmp_path / "tiny")
    assert out == tmp_path / "tiny"
    _, ours = load_checkpoint(out)
    model = transformers.Qwen3ForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    sd = model.state_dict()
    # transformers reports the tied head too; it is the embedding itself.
    assert set(sd) == set(ours) | {HEAD}
    assert_same_bytes({k: sd[k] for k in ours}, ours)
    assert torch.equal(bits(sd[HEAD]), bits(ours[EMB]))


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("shard", [False, True])
def test_transformers_save_pretrained_loads_bytewise(tmp_path, tie, shard):
    transformers = pytest.importorskip("transformers")
    cfg = tiny().replace(tie_word_embeddings=tie)
    torch.manual_seed(0)  # transformers' own init uses the global generator
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg.to_hf_dict()))
    kwargs = {"max_shard_size": "40KB"} if shard else {}
    model.save_pretrained(tmp_path / "hf", **kwargs)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == shard
    cfg2, ours = load_checkpoint(tmp_path / "hf")
    assert cfg2 == cfg
    sd = model.state_dict()
    assert_same_bytes(ours, {k: sd[k] for k in param_shapes(cfg)})
    assert all(t.dtype == torch.float32 for t in ours.values())


# ----------------------------------------------------------------------------------------------
# load errors


def test_load_missing_dir_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="nope.*does not exist"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json.*missing"):
        load_checkpoint(tmp_path / "empty")


def test_load_garbage_or_unsupported_config(tmp_path):
    d = tmp_path / "ck"
    save_checkpoint(d, tiny(), init_weights(tiny(), seed=0))
    good = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json.*not valid JSON.*line 1"):
        load_checkpoint(d)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json.*expected an object"):
        load_checkpoint(d)
    (d / "config.json").write_text(json.dumps({**good, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="config.json.*'llama' is not supported"):
        load_checkpoint(d)
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    (d / "config.json").write_text(json.dumps({**good, "rope_parameters": yarn}))
    with pytest.raises(CheckpointError, match="config.json.*rope_parameters.*yarn"):
        load_checkpoint(d)
    (d / "config.json").write_text(json.dumps({**good, "use_sliding_window": True}))
    with pytest.raises(CheckpointError, match="config.json.*sliding"):
        load_checkpoint(d)


def test_load_no_safetensors(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny().to_hf_dict()))
    with pytest.raises(CheckpointError, match=r"ck.*no \*\.safetensors"):
        load_checkpoint(d)


@pytest.mark.parametrize("keep", [0, 5, 100, -4])
def test_load_truncated_safetensors_names_file(tmp_path, keep):
    d = tmp_path / "ck"
    save_checkpoint(d, tiny(), init_weights(tiny(), seed=0))
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated or corrupt"):
        load_checkpoint(d)


def test_load_tensor_problems_name_tensor_and_file(tmp_path):
    cfg = tiny()
    good = init_weights(cfg, seed=0)
    hf = cfg.to_hf_dict()
    k_norm = "model.layers.0.self_attn.k_norm.weight"
    cases = {
        "missing": ({k: v for k, v in good.items() if k != k_norm},
                    r"missing tensor\(s\) 'model.layers.0.self_attn.k_norm.weight'"),
        "extra": ({**good, "model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)},
                  r"unexpected extra tensor\(s\) 'model.layers.9.mlp.up_proj.weight' "
                  r"\(in model.safetensors\)"),
        "shape": ({**good, "model.layers.1.self_attn.o_proj.weight": torch.zeros(64, 64)},
                  r"'model.layers.1.self_attn.o_proj.weight' in model.safetensors has shape "
                  r"\(64, 64\); expected \(64, 128\)"),
        "int": ({**good, "model.norm.weight": torch.ones(64, dtype=torch.int32)},
                r"'model.norm.weight' in model.safetensors has non-floating dtype int32; "
                "allowed: float32, bfloat16, float16"),
        "fp64": ({**good, "model.norm.weight": torch.ones(64, dtype=torch.float64)},
                 r"'model.norm.weight' in model.safetensors has floating dtype float64"),
    }
    for label, (tensors, pattern) in cases.items():
        d = write_raw(tmp_path / label, hf, tensors)
        with pytest.raises(CheckpointError, match=pattern) as info:
            load_checkpoint(d)
        assert str(d) in str(info.value)


def test_tied_lm_head_accepted_only_if_byte_equal(tmp_path):
    cfg = tiny()
    good = init_weights(cfg, seed=0)
    d = write_raw(tmp_path / "same", cfg.to_hf_dict(), {**good, HEAD: good[EMB].clone()})
    _, loaded = load_checkpoint(d)
    assert HEAD not in loaded
    assert_same_bytes(loaded, good)
    other = good[EMB].clone()
    other.view(torch.int16)[0, 0] ^= 1
    d = write_raw(tmp_path / "diff", cfg.to_hf_dict(), {**good, HEAD: other})
    with pytest.raises(CheckpointError, match=r"model.safetensors.*'lm_head.weight' differs.*"
                                              "tie_word_embeddings=true"):
        load_checkpoint(d)


def test_sharded_index_problems_name_index_and_shard(tmp_path):
    cfg = tiny()
    good = init_weights(cfg, seed=0)
    d = tmp_path / "ck"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    names = list(good)
    half = len(names) // 2
    save_file({k: good[k] for k in names[:half]}, str(d / "a.safetensors"))
    save_file({k: good[k] for k in names[half:]}, str(d / "b.safetensors"))
    with pytest.raises(CheckpointError, match="several safetensors files"):
        load_checkpoint(d)
    wm = {k: ("a.safetensors" if i < half else "b.safetensors") for i, k in enumerate(names)}
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    assert_same_bytes(load_checkpoint(d)[1], good)
    index.write_text(json.dumps({"weight_map": {**wm, names[0]: "c.safetensors"}}))
    with pytest.raises(CheckpointError, match=f"index.json.*'{names[0]}'.*c.safetensors.*missing"):
        load_checkpoint(d)
    index.write_text(json.dumps({"weight_map": {**wm, names[0]: "b.safetensors"}}))
    with pytest.raises(CheckpointError, match=f"index.json.*'{names[0]}'.*b.safetensors"):
        load_checkpoint(d)
    index.write_text(json.dumps({"weight_map": {**wm, names[0]: "../x.safetensors"}}))
    with pytest.raises(CheckpointError, match="plain file name"):
        load_checkpoint(d)


def test_a_full_disk_while_writing_the_weights_is_a_checkpoint_error(tmp_path, monkeypatch):
    """safetensors reports its write errors (a full disk) as SafetensorError, not OSError: the
    save raises CheckpointError naming the directory and the file, and leaves nothing behind
    (it was a traceback from `rlk run`'s final weights)."""
    from safetensors import SafetensorError

    def full(*a, **kw):
        raise SafetensorError("Error while serializing: No space left on device (os error 28)")
    monkeypatch.setattr(ckpt, "save_file", full)
    cfg = tiny()
    tensors = init_weights(cfg, seed=0)
    with pytest.raises(CheckpointError, match=r"cannot write model\.safetensors .*No space left"):
        save_checkpoint(tmp_path / "ck", cfg, tensors)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_writing_a_run_checkpoint_names_it_and_keeps_nothing(tmp_path,
                                                                              monkeypatch):
    """runner/checkpointing.save_checkpoint on a full disk: OSError naming the checkpoint and
    its size; no half-written step-*.tmp-* directory is left (a resume would clean one up, but
    nothing should need to)."""
    import errno

    from rlkernel.runner import checkpointing

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(checkpointing.os, "fsync", full)
    with pytest.raises(OSError, match=r"cannot write checkpoint .*step-000003 \(No space left"):
        checkpointing.save_checkpoint(tmp_path, 3, 3, {"w": torch.zeros(4)}, "v", settings={},
                                      inputs=None)
    assert list((tmp_path / checkpointing.CKPT_DIR).iterdir()) == []


def test_a_config_json_that_sets_few_keys_reads_as_transformers_reads_it():
    """A config.json with only the required keys: head_dim, num_key_value_heads,
    max_position_embeddings and rope_theta take transformers' Qwen3Config defaults (the
    reference reads the same file so), and a null num_key_value_heads means the query heads. It
    took hidden/heads, the query heads, 40960 and 1e6 before: a file without rope_theta gave
    other RoPE angles, so other logits, than transformers'. Control: keys that are set win."""
    from transformers import Qwen3Config as HFQwen3Config

    from rlkernel.model.config import HF_DEFAULTS, Qwen3Config

    base = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 8}
    hf = HFQwen3Config.from_dict(base)
    assert HF_DEFAULTS == {"head_dim": hf.head_dim, "num_key_value_heads": hf.num_key_value_heads,
                           "max_position_embeddings": hf.max_position_embeddings,
                           "rope_theta": hf.rope_parameters["rope_theta"]}
    ours = Qwen3Config.from_hf_dict({**base, "num_key_value_heads": 8})
    assert (ours.head_dim, ours.max_position_embeddings, ours.rope_theta) == (
        hf.head_dim, hf.max_position_embeddings, hf.rope_parameters["rope_theta"])
    null_kv = {**base, "num_key_value_heads": None}
    assert Qwen3Config.from_hf_dict(null_kv).num_key_value_heads == \
        HFQwen3Config.from_dict(null_kv).num_key_value_heads == 8
    with pytest.raises(ValueError) as e:   # 32 KV heads for 8 query heads: named as the default
        Qwen3Config.from_hf_dict({**base, "head_dim": 16}, source="m/config.json")
    assert str(e.value) == (
        "m/config.json: model config: num_key_value_heads=32 must divide num_attention_heads=8 "
        "(not set in m/config.json, so transformers' default: num_key_value_heads=32, "
        "max_position_embeddings=32768)"), str(e.value)
    set_ = {**base, "num_key_value_heads": 4, "head_dim": 16, "max_position_embeddings": 4096,
            "rope_theta": 1e6}
    c = Qwen3Config.from_hf_dict(set_)
    assert (c.num_key_value_heads, c.head_dim, c.max_position_embeddings, c.rope_theta) == (
        4, 16, 4096, 1e6)
    # transformers 5 writes rope_theta under rope_parameters: read there, and named there.
    nested = {**base, "num_key_value_heads": 4, "rope_parameters": {"rope_theta": 5e5}}
    assert Qwen3Config.from_hf_dict(nested).rope_theta == 5e5
    for where, bad in (("rope_parameters.rope_theta", {"rope_parameters": {"rope_theta": "x"}}),
                       ("rope_theta", {"rope_theta": "x"})):
        with pytest.raises(ValueError) as e:
            Qwen3Config.from_hf_dict({**base, **bad}, source="m/config.json")
        assert str(e.value).startswith(f"m/config.json: {where}='x' must be a number"), e.value


def test_weights_that_do_not_match_a_defaulted_head_dim_name_the_default(tmp_path):
    """A checkpoint whose config.json drops head_dim (weights made with head_dim 8): the shape
    mismatch ends by naming the keys the file does not set and the transformers defaults taken
    (head_dim=128 read as if it were the file's). Control: with head_dim set, the same weights
    load; a shape mismatch of a file that sets every such key adds no such note."""
    cfg = tiny()
    save_checkpoint(tmp_path / "ck", cfg, init_weights(cfg, seed=0))
    path = tmp_path / "ck" / "config.json"
    full = json.loads(path.read_text())
    assert full["head_dim"] != 128 and "max_position_embeddings" in full
    path.write_text(json.dumps({k: v for k, v in full.items() if k != "head_dim"}))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "ck")
    msg = str(e.value)
    assert " has shape " in msg, msg
    assert msg.endswith("(config.json does not set head_dim; transformers' defaults were taken: "
                        "head_dim=128)"), msg
    path.write_text(json.dumps(full))
    assert load_checkpoint(tmp_path / "ck")[0] == cfg
    path.write_text(json.dumps({**full, "hidden_size": full["hidden_size"] * 2}))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "ck")
    assert " has shape " in str(e.value) and "defaults were taken" not in str(e.value)
