"""Trained weights out of a run (rlkernel/runner/export.py, `rlk export`).

Chain checked here, on one tiny run R (2 steps, --save-every 1, a KL term so the weights move):
  1. R/final holds the weights after the last step: their per-tensor SHA-256 == the evidence's
     last step (bytes, not a tolerance), and rlk_weights.json names that step and version.
  2. `rlk export R --out D` == a Hugging Face directory that transformers' Qwen3ForCausalLM and
     AutoTokenizer load; its fp32 logits == our model's fp32 logits on the same weights (1e-4
     relative, as tests/test_reference.py), and the tokenizer encodes == our byte tokenizer.
  3. `--step 0` (a checkpoint's fp32 masters, rounded to bf16) == the bytes the run hashed at step 0.
  4. A flipped bit in R/final, a step with no weights, an occupied --out, an unfinished run: a
     refusal (exit 1 naming the tensor, or exit 2 listing the steps that have weights), and no
     output directory.
Run: `.venv/bin/python -m pytest -q tests/test_export.py`.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from kernel_helpers import fifo_in_place_of
from safetensors.torch import load_file

from rlkernel.cli import main
from rlkernel.weights.hashing import state_hashes

FLAGS = ["--steps", "2", "--save-every", "1", "--kl-coef", "0.05", "--lr", "1e-3",
         "--n-prompts", "2", "--n-samples-per-prompt", "2", "--max-response-len", "12",
         "--allow-dirty"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("export") / "run"
    assert main(["run", *FLAGS, "--run-dir", str(d)]) == 0
    return d


def _evidence(run):
    return json.loads((run / "evidence.json").read_text())


def test_final_weights_are_the_last_steps_hashed_bytes(run):
    """hash(R/final tensors) == evidence step 1 tensor_hashes; meta names step 1 and its version;
    the weights moved (step 1 version != init version)."""
    ev = _evidence(run)
    last = ev["steps"][-1]
    tensors = load_file(str(run / "final" / "model.safetensors"))
    assert state_hashes(tensors) == {n: last["tensor_hashes"][n] for n in tensors}
    assert set(tensors) == set(last["tensor_hashes"])
    assert json.loads((run / "final" / "rlk_weights.json").read_text()) == {
        "step": 1, "version": last["version"]}
    assert last["version"] != ev["init"]["version"]
    assert json.loads((run / "final" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_export_loads_in_transformers_with_our_logits_and_tokenizer(run, tmp_path, capsys):
    """rlk export R --out D: transformers loads D (no missing/unexpected keys); its fp32 logits ==
    ours within 1e-4 relative; AutoTokenizer(D).encode == ByteTokenizer.encode."""
    transformers = pytest.importorskip("transformers")
    from rlkernel.data.tokenizer import ByteTokenizer
    from rlkernel.model.checkpoint import load_checkpoint
    from rlkernel.model.layout import packed_layout
    from rlkernel.model.ops import InvariantOps
    from rlkernel.model.qwen3 import Qwen3ForCausalLM

    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() == str(out)
    assert "evidence step 1 (the run's step 2)" in cap.err and "24 tensors match" in cap.err
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "rlk_weights.json"} <= {p.name for p in out.iterdir()}
    assert (out / "model.safetensors").read_bytes() == \
        (run / "final" / "model.safetensors").read_bytes()

    hf, info = transformers.Qwen3ForCausalLM.from_pretrained(out, output_loading_info=True,
                                                            dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    hf.config._attn_implementation = "eager"
    cfg, tensors = load_checkpoint(out)
    ours = Qwen3ForCausalLM(cfg, InvariantOps, torch.float32)
    ours.load_tensors({n: t.float() for n, t in tensors.items()})
    text = "Compute 37+45="
    ids = ByteTokenizer().encode(text)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids
    assert tok.eos_token_id == 256 and tok.pad_token_id == 257
    with torch.no_grad():
        lay = packed_layout([ids], 257)
        mine = ours.logits(ours.hidden(lay))[:len(ids)].double()
        ref = hf(torch.tensor([ids])).logits[0].double()
    assert torch.allclose(mine, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_export_of_a_checkpoint_step_is_the_bytes_hashed_at_that_step(run, tmp_path, capsys):
    """--step 0 comes from checkpoints/step-000001 (fp32 masters -> bf16): its hashes == the
    evidence's step 0 hashes, and differ from the final weights."""
    out = tmp_path / "s0"
    assert main(["export", str(run), "--step", "0", "--out", str(out)]) == 0
    assert "from step-000001" in capsys.readouterr().err
    tensors = load_file(str(out / "model.safetensors"))
    ev = _evidence(run)
    assert state_hashes(tensors) == {n: ev["steps"][0]["tensor_hashes"][n] for n in tensors}
    assert json.loads((out / "rlk_weights.json").read_text())["step"] == 0
    assert ev["steps"][0]["version"] != ev["steps"][1]["version"]


def test_a_flipped_bit_is_refused_naming_the_tensor(run, tmp_path, capsys):
    """One bit of model.norm.weight flipped in R/final: exit 1, the message names that tensor,
    no --out directory."""
    from safetensors.torch import save_file

    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    tensors = load_file(str(bad / "final" / "model.safetensors"))
    t = tensors["model.norm.weight"]
    t.view(torch.int16)[3] ^= 1
    save_file(tensors, str(bad / "final" / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    assert main(["export", str(bad), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlk export: error: refusing to export")
    assert "'model.norm.weight' differs" in err[0]
    assert not out.exists()


def test_a_corrupt_config_json_is_one_line_naming_the_file(run, tmp_path, capsys):
    """R/final/config.json cut short: exit 1, one line naming that file, no --out directory."""
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    (bad / "final" / "config.json").write_text('{"vocab_size":')
    out = tmp_path / "out"
    assert main(["export", str(bad), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlk export: error: ")
    assert "config.json" in err[0] and "not valid JSON" in err[0]
    assert not out.exists()


def test_an_edited_architecture_in_final_config_json_is_refused(run, tmp_path, capsys):
    """R/final/config.json still valid but describing another model (rms_norm_eps, rope_theta
    changed): the tensors' hashes alone would pass, so the architecture is checked against the
    embedded tiny model's — exit 1 naming the fields, no --out directory. Control: the copy
    before the edit exports."""
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    assert main(["export", str(bad), "--out", str(tmp_path / "ok")]) == 0
    path = bad / "final" / "config.json"
    config = json.loads(path.read_text())
    config["rms_norm_eps"] = 0.5
    path.write_text(json.dumps(config))
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["export", str(bad), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "final/config.json: rms_norm_eps differ(s)" in err[0], err
    assert not out.exists()


def test_an_input_config_json_edited_after_the_run_is_refused(tmp_path, capsys, monkeypatch):
    """A --model run (the model given as a relative path, which the manifest keys its files by):
    final/config.json edited to another model is refused against the input model's config
    (exit 1 naming the field); with final/ gone, export takes the architecture from the input
    model's config.json, so after that file changes (its SHA-256 no longer the recorded one)
    export refuses, exit 1. Controls: each export before its edit works."""
    monkeypatch.chdir(tmp_path)
    assert main(["init-model", "--preset", "tiny", "--seed", "1", "--out", "model"]) == 0
    d = tmp_path / "run"
    assert main(["run", "--model", "model", "--steps", "2", "--save-every", "1",
                 "--n-prompts", "1", "--n-samples-per-prompt", "2", "--max-response-len", "4",
                 "--allow-dirty", "--run-dir", str(d)]) == 0
    assert main(["export", str(d), "--out", str(tmp_path / "ok")]) == 0

    def edited(path: pathlib.Path) -> None:
        config = json.loads(path.read_text())
        config["rms_norm_eps"] = 0.5
        path.write_text(json.dumps(config))

    edited(d / "final" / "config.json")
    capsys.readouterr()
    assert main(["export", str(d), "--out", str(tmp_path / "out1")]) == 1
    err = capsys.readouterr().err
    assert "final/config.json: rms_norm_eps differ(s) from " in err and "model/config" in err, err
    shutil.rmtree(d / "final")
    assert main(["export", str(d), "--step", "0", "--out", str(tmp_path / "ok2")]) == 0
    edited(tmp_path / "model" / "config.json")
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["export", str(d), "--step", "0", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "config.json changed since the run started" in err, err
    assert not out.exists() and not (tmp_path / "out1").exists()


@pytest.mark.parametrize("args,words", [
    (["--step", "7"], "--step 7: must be an evidence step of"),
    (["--step", "-1"], "--step -1: must be an evidence step of"),
])
def test_a_step_without_weights_is_a_usage_error_listing_the_steps(run, tmp_path, capsys, args,
                                                                   words):
    out = tmp_path / "out"
    assert main(["export", str(run), *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert words in err
    assert "steps with weights: 0 (checkpoint step-000001), 1 (final)" in err
    assert not out.exists()


def test_unfinished_run_and_missing_checkpoint(run, tmp_path, capsys):
    """A run without final/ (stopped early) has no default export; a step whose checkpoint is
    gone has no weights; an occupied --out is refused. Each: exit 2, nothing written."""
    d = tmp_path / "run"
    shutil.copytree(run, d)
    shutil.rmtree(d / "final")
    ev = _evidence(d)
    ev["complete"] = False
    (d / "evidence.json").write_text(json.dumps(ev))
    out = tmp_path / "out"
    assert main(["export", str(d), "--out", str(out)]) == 2
    assert "has no final weights" in capsys.readouterr().err
    shutil.rmtree(d / "checkpoints" / "step-000002")
    assert main(["export", str(d), "--step", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--step 1:" in err and "kept no weights for it" in err and "0 (checkpoint" in err
    shutil.rmtree(d / "checkpoints")
    assert main(["export", str(d), "--out", str(out)]) == 2
    err = capsys.readouterr().err   # no weights anywhere: no --step to suggest
    assert "nothing to export: this run kept no weights" in err and "give --step" not in err
    assert not out.exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["export", str(run), "--out", str(tmp_path / "full")]) == 2
    assert "--out" in capsys.readouterr().err
    ev["steps"] = []     # stopped before its first step was recorded
    (d / "evidence.json").write_text(json.dumps(ev))
    assert main(["export", str(d), "--step", "0", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--step 0: must be an evidence step of" in err and "recorded no step" in err
    assert "[0, 0)" not in err and not out.exists()


@pytest.mark.parametrize("flag", ["false", "yes", 1])
def test_a_completion_flag_that_is_not_json_true_is_no_completion(run, tmp_path, capsys, flag):
    """evidence.json's "complete" counts only as the JSON value true: an edited "false" (a
    truthy string), "yes" or 1 makes export refuse the default final/ weights ("did not finish
    all its steps"), as a run that stopped early."""
    d = tmp_path / "run"
    shutil.copytree(run, d)
    ev = _evidence(d)
    ev["complete"] = flag
    (d / "evidence.json").write_text(json.dumps(ev))
    assert main(["export", str(d), "--out", str(tmp_path / "out")]) == 2
    assert "did not finish all its steps" in capsys.readouterr().err


def test_export_copies_the_input_models_tokenizer_and_refuses_a_changed_one(tmp_path, capsys):
    """A run of `rlk init-model` output (with tokenizer files): the export's tokenizer files ==
    the input model's bytes; after the input's tokenizer.json changes, export refuses (exit 1)."""
    model = tmp_path / "model"
    assert main(["init-model", "--preset", "tiny", "--seed", "1", "--out", str(model)]) == 0
    d = tmp_path / "run"
    assert main(["run", "--model", str(model), "--steps", "1", "--n-prompts", "1",
                 "--n-samples-per-prompt", "2", "--max-response-len", "4", "--allow-dirty",
                 "--run-dir", str(d)]) == 0
    manifest = json.loads((d / "manifest.json").read_text())
    assert set(manifest["tokenizer_files"]) == {"tokenizer.json", "tokenizer_config.json"}
    out = tmp_path / "hf"
    assert main(["export", str(d), "--out", str(out)]) == 0
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / f).read_bytes() == (model / f).read_bytes()
    (model / "tokenizer.json").write_bytes((model / "tokenizer.json").read_bytes() + b" ")
    capsys.readouterr()
    assert main(["export", str(d), "--out", str(tmp_path / "hf2")]) == 1
    assert "tokenizer file(s) tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "hf2").exists()


def test_export_of_a_relative_model_works_from_any_directory(tmp_path, capsys, monkeypatch):
    """A run started in WD with --model m (relative): `rlk export WD/run` from another directory
    copies WD/m's tokenizer files (exit 0), from the absolute path the run recorded
    (input_paths). With WD/m moved away, exit 1 naming that recorded path. A manifest written
    before input_paths reads m from the current directory, as before. Before, the export
    looked for ./m and said it "no longer exists"."""
    wd = tmp_path / "wd"
    wd.mkdir()
    monkeypatch.chdir(wd)
    assert main(["init-model", "--preset", "tiny", "--seed", "1", "--out", "m"]) == 0
    assert main(["run", "--model", "m", "--steps", "1", "--n-prompts", "1",
                 "--n-samples-per-prompt", "2", "--max-response-len", "4", "--allow-dirty",
                 "--run-dir", "run"]) == 0
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "hf"
    assert main(["export", str(wd / "run"), "--out", str(out)]) == 0
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / f).read_bytes() == (wd / "m" / f).read_bytes()

    (wd / "m").rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(["export", str(wd / "run"), "--out", str(tmp_path / "hf2")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"directory {str(wd / 'm')!r}" in err, err
    assert "no longer exists" in err and not (tmp_path / "hf2").exists()
    (tmp_path / "moved").rename(wd / "m")

    path = wd / "run" / "manifest.json"
    m = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in m.items() if k != "input_paths"}))
    assert main(["export", str(wd / "run"), "--out", str(tmp_path / "hf3")]) == 1
    assert "directory 'm' (for its config.json and tokenizer files) no longer exists" in \
        capsys.readouterr().err
    monkeypatch.chdir(wd)
    assert main(["export", "run", "--out", str(tmp_path / "hf3")]) == 0


@pytest.mark.parametrize("text, why", [
    ('{"step": ', "is not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "is not valid JSON (nested too deeply"),
    ('{"step": -1}', "has no step"),
    ("[1, 2]", "has no step"),
])
def test_a_damaged_final_record_is_named_not_called_an_unfinished_run(run, tmp_path, capsys,
                                                                      text, why):
    """final/rlk_weights.json (which step final/ holds) unreadable in a complete run: exit 1
    naming that file and why, with the steps that do have weights (the message said the run
    "did not finish all its steps ... complete=True"); nothing written."""
    d = tmp_path / "run"
    shutil.copytree(run, d)
    (d / "final" / "rlk_weights.json").write_text(text)
    out = tmp_path / "out"
    assert main(["export", str(d), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "did not finish" not in err, err
    assert f"{d / 'final' / 'rlk_weights.json'} {why}" in err, err
    assert "give --step N; steps with weights: 0 (checkpoint step-000001)" in err, err
    assert not out.exists()
    # --step of the final step when only final/ held it: the broken record is named there
    # too, exit 1 (it said the run "kept no weights for it", exit 2, hiding the damage)
    shutil.rmtree(d / "checkpoints" / "step-000002")
    assert main(["export", str(d), "--step", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert f"{d / 'final' / 'rlk_weights.json'} {why}" in err and "unknown" in err, err
    assert not out.exists()


@pytest.mark.parametrize("name, text, words", [
    ("manifest.json", "[" * 100_000 + "]" * 100_000, "manifest.json is not valid JSON (nested"),
    ("manifest.json", "[1]", "manifest.json holds an array, not an object with 'config'"),
    ("manifest.json", '{"config": 5}', "manifest.json has 'config' as a number, not an object"),
    ("manifest.json", '{"run": 1}', "manifest.json has no 'config' object"),
    ("evidence.json", '{"steps": {}}', "evidence.json has 'steps' as an object, not an array"),
    ("evidence.json", '{"steps": null}', "evidence.json has 'steps' as null, not an array"),
    ("evidence.json", '{}', "evidence.json has no 'steps' array"),
    ("evidence.json", None, "evidence.json is missing"),
    ("manifest.json", "fifo", "manifest.json is not a regular file"),
])
def test_an_unreadable_run_names_the_file_and_why(run, tmp_path, capsys, name, text, words):
    """A run directory whose manifest or evidence cannot be used: exit 2, one line naming the
    file and the reason (was "no readable manifest.json and evidence.json" for every case); a
    FIFO in the manifest's place is refused, not read (which would block forever)."""
    d = tmp_path / "run"
    shutil.copytree(run, d)
    if text == "fifo":
        fifo_in_place_of(d / name)
    elif text is None:
        (d / name).unlink()
    else:
        (d / name).write_text(text)
    out = tmp_path / "out"
    assert main(["export", str(d), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"RUN {str(d)!r}: {words}" in err, err
    assert not out.exists()


@pytest.mark.parametrize("make, words", [
    (lambda p: None, "no such run directory"),
    (lambda p: p.write_text("{}"), "a file, not a run directory"),
    (lambda p: p.symlink_to(p.parent / "gone"), "a symbolic link that cannot be followed"),
])
def test_a_run_that_is_no_directory_is_named_so(tmp_path, capsys, make, words):
    """RUN missing, a file or a dangling link: one line saying what it is (a missing RUN read
    "manifest.json is missing", as if the directory were there), exit 2, nothing written."""
    d = tmp_path / "run"
    make(d)
    out = tmp_path / "out"
    assert main(["export", str(d), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"RUN {str(d)!r}: {words}" in err, err
    assert "manifest.json" not in err and not out.exists()


def test_export_of_a_padded_byte_tokenizer_model_keeps_the_padded_ids_masked(tmp_path):
    """A model with more embedding rows (512) than the byte tokenizer's 264 ids and no
    tokenizer.json: the run masks ids 264..511. Its export's stand-in tokenizer has the byte
    tokenizer's 264 ids, not 512, so a run on the exported directory masks the same 248 ids:
    the same policy (a 512-id stand-in, written before, unmasked them: another policy)."""
    import dataclasses

    from rlkernel.model.checkpoint import init_weights, save_checkpoint
    from rlkernel.model.config import tiny

    cfg = dataclasses.replace(tiny(), vocab_size=512)
    model = tmp_path / "m"
    save_checkpoint(model, cfg, init_weights(cfg, 0))
    small = ["--steps", "1", "--n-prompts", "1", "--n-samples-per-prompt", "2",
             "--max-response-len", "8", "--entropy-coef", "0.01", "--allow-dirty"]
    run = tmp_path / "run"
    assert main(["run", *small, "--model", str(model), "--run-dir", str(run)]) == 0
    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out)]) == 0
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() == 264
    again = tmp_path / "again"
    assert main(["run", *small, "--model", str(out), "--run-dir", str(again)]) == 0
    vocab = json.loads((again / "manifest.json").read_text())["inputs"]["vocab"]
    assert vocab["tokenizer_ids"] == 264 and vocab["masked_ids"] == 512 - 264


def _refused_inside(capsys, folder, what, cases) -> None:
    """Each (argv, flag, target) of `cases` exits 2 saying target lies in `folder`, `what`;
    nothing under `folder` changes."""
    before = sorted(str(p) for p in folder.rglob("*"))
    for argv, flag, target in cases:
        assert main([*argv, str(target)]) == 2, target
        err = capsys.readouterr().err
        assert f"{flag} {str(target)!r}: lies in {str(folder)!r}, {what}" in err, err
    assert sorted(str(p) for p in folder.rglob("*")) == before


def test_out_in_a_runs_checkpoints_is_refused(run, tmp_path, capsys):
    """--out (export, init-model, report) or --run-dir (run) at or under a run's checkpoints/: that run's
    saves replace a step-N entry there (a step-000009 export would be removed by the save of
    step 9). Exit 2, nothing written; a checkpoints/ that is not
    beside a manifest.json (not a run's) is taken, and a directory beside the run's checkpoints
    too."""
    ck = run / "checkpoints"
    _refused_inside(capsys, ck, f"the checkpoints directory of the run {str(run)!r}", (
        (["export", str(run), "--out"], "--out", ck / "step-000009"),
        (["export", str(run), "--out"], "--out", ck / "mine" / "deeper"),
        (["init-model", "--preset", "tiny", "--out"], "--out", ck / "model"),
        (["report", str(run), "--out"], "--out", ck / "step-000003"),
        (["run", "--steps", "1", "--allow-dirty", "--run-dir"], "--run-dir", ck / "r")))
    elsewhere = tmp_path / "not_a_run" / "checkpoints" / "out"
    assert main(["export", str(run), "--out", str(elsewhere)]) == 0
    assert (elsewhere / "model.safetensors").is_file()
    beside = run / "exported"
    try:
        assert main(["export", str(run), "--out", str(beside)]) == 0
    finally:
        shutil.rmtree(beside, ignore_errors=True)


def test_out_in_a_runs_final_weights_is_refused(run, capsys):
    """rlk report --out RUN/final (or under it, or export/run there): a resume replaces final/
    whole, so the PNGs a report wrote beside model.safetensors were deleted by the next
    resume (found by a breaker). Exit 2 naming the folder, nothing written. Control: the run's
    own folder beside final/ takes a report."""
    final = run / "final"
    assert (final / "model.safetensors").is_file()
    _refused_inside(capsys, final, f"the final weights directory of the run {str(run)!r}", (
        (["report", str(run), "--out"], "--out", final),
        (["report", str(run), "--out"], "--out", final / "plots"),
        (["export", str(run), "--out"], "--out", final / "copy"),
        (["run", "--steps", "1", "--allow-dirty", "--run-dir"], "--run-dir", final / "r")))
    _report_takes(run, "plots_here")


def test_out_at_a_runs_top_level_is_refused(run, capsys):
    """rlk report --out RUN: the PNGs went beside the run's evidence.json unwarned (a
    breaker). Exit 2 naming the run directory and offering RUN/plots; nothing written (export
    and init-model refuse it too, as an occupied directory). Control: RUN/plots takes the
    report."""
    before = sorted(str(p) for p in run.rglob("*"))
    assert main(["report", str(run), "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        f"rlk report: error: --out {str(run)!r}: is the run directory {str(run)!r} (its "
        "manifest.json is there), whose files are the run's record; give a directory beside or "
        f"under it, e.g. {str(run / 'plots')!r}"), err
    for argv in (["export", str(run), "--out"], ["init-model", "--preset", "tiny", "--out"]):
        assert main([*argv, str(run)]) == 2
    assert sorted(str(p) for p in run.rglob("*")) == before
    _report_takes(run, "plots")


def _report_takes(run, name: str) -> None:
    """`rlk report RUN --out RUN/name` draws its PNGs there (removed afterwards: the run is
    the module's)."""
    plots = run / name
    try:
        assert main(["report", str(run), "--out", str(plots)]) == 0
        assert list(plots.glob("*.png"))
    finally:
        shutil.rmtree(plots, ignore_errors=True)


@pytest.mark.parametrize("edit, code, words", [
    (lambda m, e: m["config"].update(dtype=["bf16"]), 2, 'records config dtype as ["bf16"]'),
    (lambda m, e: m["config"].update(model=5), 2, "records config model as 5, not a path"),
    (lambda m, e: e["steps"][-1]["tensor_hashes"].update({"model.norm.weight": 5}), 1,
     "records the hash of tensor 'model.norm.weight' as 5, not a SHA-256 string"),
])
def test_a_hand_edited_setting_or_hash_of_another_type_is_one_line(run, tmp_path, capsys, edit,
                                                                   code, words):
    """Manifest settings export reads (--dtype, --model) or a recorded tensor hash edited into
    another JSON type: one line naming the file and the value (each was a TypeError traceback),
    no --out directory."""
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    m = json.loads((bad / "manifest.json").read_text())
    e = json.loads((bad / "evidence.json").read_text())
    edit(m, e)
    (bad / "manifest.json").write_text(json.dumps(m))
    (bad / "evidence.json").write_text(json.dumps(e))
    out = tmp_path / "out"
    assert main(["export", str(bad), "--out", str(out)]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_a_checkpoint_named_with_other_digits_is_not_a_step(run, tmp_path, capsys):
    """checkpoints/step-² (str.isdigit is true, int() refuses it) and step-٠٠٠٠٠١ (Arabic-Indic
    digits, which int() reads as 1): neither is a checkpoint — export works as before (the
    first was a ValueError traceback, the second was taken for step 1's weights)."""
    from rlkernel.runner.export import available_steps
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    before = available_steps(bad)
    (bad / "checkpoints" / "step-²").mkdir()
    (bad / "checkpoints" / "step-٠٠٠٠٠١").mkdir()
    assert available_steps(bad) == before
    assert main(["export", str(bad), "--out", str(tmp_path / "out")]) == 0


@pytest.mark.parametrize("command", ["export", "init-model", "run"])
def test_out_as_the_current_directory_is_refused_before_any_work(run, tmp_path, monkeypatch,
                                                                 capsys, command):
    """--out . (rlk run: --run-dir .) in an empty current directory: a usage error, exit 2,
    before any work, in one wording for every command (export and init-model passed the checks
    as an empty directory, then failed at the rename after the whole export, exit 1, asking
    whether the directory "was filled meanwhile")."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for out in (".", "../here"):
        args = {"export": [str(run), "--out", out],
                "init-model": ["--preset", "tiny", "--out", out],
                "run": ["--steps", "1", "--allow-dirty", "--run-dir", out]}[command]
        assert main([command, *args]) == 2
        err = capsys.readouterr().err
        assert "must name a new directory, not the current one" in err, err
        assert list(here.iterdir()) == []


def test_a_run_whose_evidence_records_no_step_says_so(run, tmp_path, capsys):
    """Evidence edited to no steps, final/ still there: exit 2 saying the evidence records no
    step (it said final/ held step 1, "not the last step -1")."""
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    e = json.loads((bad / "evidence.json").read_text())
    e["steps"] = []
    (bad / "evidence.json").write_text(json.dumps(e))
    assert main(["export", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.replace(str(bad), "RUN")   # a tmp path may hold "-1"
    assert "its evidence records no step" in err and "-1" not in err, err
