"""--resume continues only a run whose parts belong together: its checkpoint, its evidence and its
manifest are one run's.

Chain: runs A (--seed 0) and B (--seed 1), 2 steps each, checkpointed after every step. A copy of
A with a part of B (evidence.json, checkpoints/), or with a part edited (manifest config, the
evidence's init), is refused by `rlk run --resume` with exit 2 and one line, before any work,
every file of both runs byte-identical. (Those resumes exited 0 and marked the run complete
with a broken chain of weight versions.) A legitimate resume of such a copy still runs.
Run: `.venv/bin/python -m pytest -q tests/test_resume_provenance.py`.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_resume import _snapshot

from rlkernel.cli import main

ARGS = ["--steps", "2", "--save-every", "1", "--kl-coef", "0.01", "--max-response-len", "16",
        "--n-prompts", "2", "--n-samples-per-prompt", "2", "--allow-dirty"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"A": seed 0, "B": seed 1}: two finished 2-step runs with checkpoints step-000001/2."""
    root = tmp_path_factory.mktemp("runs")
    for name, seed in (("A", "0"), ("B", "1")):
        assert main(["run", *ARGS, "--seed", seed, "--run-dir", str(root / name)]) == 0
    return {"A": root / "A", "B": root / "B"}


def _copy(runs, tmp_path):
    d = tmp_path / "C"
    shutil.copytree(runs["A"], d)
    return d


def _edit_json(path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _refused(capsys, d, *others) -> str:
    """Resume `d` (--steps 3): exit 2, one error line (returned), `d` and `others` unchanged."""
    before = [_snapshot(p) for p in (d, *others)]
    capsys.readouterr()
    assert main(["run", "--resume", str(d), "--steps", "3", "--allow-dirty"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rlk run: error: --resume '{d}': "), err
    assert [_snapshot(p) for p in (d, *others)] == before
    return err[0]


def test_resume_refuses_evidence_of_another_run(runs, tmp_path, capsys):
    """A's checkpoint step-000002 (weights after A's step 1) with B's evidence.json: the
    checkpoint's weight version is not the one the evidence records after step 1."""
    d = _copy(runs, tmp_path)
    shutil.copy(runs["B"] / "evidence.json", d / "evidence.json")
    ck = json.loads((d / "checkpoints" / "step-000002" / "meta.json").read_text())["version"]
    ev = json.loads((d / "evidence.json").read_text())["steps"][1]["version"]
    err = _refused(capsys, d, runs["B"])
    assert (f"{d / 'checkpoints' / 'step-000002'} holds weight version {ck[:12]}, but "
            f"{d / 'evidence.json'} records {ev[:12]} after step 1: the checkpoint and the "
            "evidence are not of one run") in err, err


def test_resume_refuses_evidence_without_its_init(runs, tmp_path, capsys):
    """evidence.json whose init record (written by every run before its first step) was
    deleted or nulled, or lost its weight version (resumed from a later checkpoint, whose
    version is the steps', it was not missed)."""
    d = _copy(runs, tmp_path)
    init = json.loads((d / "evidence.json").read_text())["init"]
    assert isinstance(init.get("version"), str)
    for edit in (lambda ev: ev.update(init={k: v for k, v in init.items() if k != "version"}),
                 lambda ev: ev.update(init={**init, "version": None}),
                 lambda ev: ev.pop("init"), lambda ev: ev.update(init=None)):
        _edit_json(d / "evidence.json", edit)
        err = _refused(capsys, d)
        assert f"{d / 'evidence.json'} holds no init record" in err, err


def test_resume_refuses_a_checkpoint_under_another_steps_name(runs, tmp_path, capsys):
    """checkpoints/step-000002 whose meta.json says it continues at step 1 (a checkpoint
    renamed or copied in): the name and the contents disagree."""
    d = _copy(runs, tmp_path)
    shutil.rmtree(d / "checkpoints" / "step-000002")
    shutil.copytree(d / "checkpoints" / "step-000001", d / "checkpoints" / "step-000002")
    err = _refused(capsys, d)
    assert (f"{d / 'checkpoints' / 'step-000002'}: its meta.json continues at step 1, its name "
            "at step 2") in err, err


def test_a_copied_run_still_resumes_to_the_same_weights(runs, tmp_path, capsys):
    """Control: the copy of A with its own parts, extended to 3 steps, resumes (exit 0), and
    the first two steps are A's."""
    d = _copy(runs, tmp_path)
    assert main(["run", "--resume", str(d), "--steps", "3", "--allow-dirty"]) == 0
    steps = json.loads((d / "evidence.json").read_text())["steps"]
    a = json.loads((runs["A"] / "evidence.json").read_text())["steps"]
    assert [s["version"] for s in steps[:2]] == [s["version"] for s in a] and len(steps) == 3


@pytest.mark.parametrize("linked", ["checkpoints", "checkpoints/step-000002"])
def test_resume_refuses_checkpoints_linked_to_another_run(runs, tmp_path, capsys, linked):
    """A copy of A whose checkpoints/ (or newest checkpoint) is a symbolic link to B's: refused
    before the checkpoint is read, naming the link; B untouched. (It continued from B's weights
    and wrote step-000003 into B's directory, exit 0.)"""
    d = _copy(runs, tmp_path)
    shutil.rmtree(d / linked)
    (d / linked).symlink_to(runs["B"] / linked)
    err = _refused(capsys, d, runs["B"])
    assert f"{d / linked} is a symbolic link, not a directory" in err, err


@pytest.mark.parametrize("kind", ["file", "dangling link"])
def test_resume_names_a_checkpoints_that_is_not_a_directory_as_such(runs, tmp_path, capsys,
                                                                     kind):
    """A copy of A whose checkpoints/ is a file, or a symbolic link to nowhere: refused naming
    what lies there, checked before any checkpoint is looked for (not "no complete checkpoint
    to resume from", which sends the user after checkpoints the run did write)."""
    d = _copy(runs, tmp_path)
    shutil.rmtree(d / "checkpoints")
    if kind == "file":
        (d / "checkpoints").write_text("x")
    else:
        (d / "checkpoints").symlink_to(tmp_path / "gone")
    err = _refused(capsys, d)
    assert f"{d / 'checkpoints'} is a " in err and "not a directory" in err, err
    assert "no complete checkpoint" not in err, err


@pytest.mark.parametrize("field, value, flag, was", [("lr", 0.5, "--lr", 1e-05),
                                                     ("seed", 1, "--seed", 0)])
def test_resume_refuses_a_manifest_config_edited_since_its_checkpoint(runs, tmp_path, capsys,
                                                                      field, value, flag, was):
    """manifest.json's config.lr or config.seed edited: the checkpoint records the settings it
    was written under (RunConfig.resume_settings), and they differ. (Resumed silently, exit 0.)"""
    d = _copy(runs, tmp_path)
    _edit_json(d / "manifest.json", lambda m: m["config"].update({field: value}))
    err = _refused(capsys, d)
    assert (f"{d / 'checkpoints' / 'step-000002'} was written under other settings than "
            f"manifest.json's config: {flag} (checkpoint {was!r}, manifest {value!r})") in err, err


def test_resume_refuses_another_runs_checkpoint_copied_in(runs, tmp_path, capsys):
    """B's checkpoint step-000002 copied (not linked) into a copy of A: its settings name the
    seed it was written under."""
    d = _copy(runs, tmp_path)
    shutil.rmtree(d / "checkpoints" / "step-000002")
    shutil.copytree(runs["B"] / "checkpoints" / "step-000002", d / "checkpoints" / "step-000002")
    err = _refused(capsys, d)
    assert "manifest.json's config: --seed (checkpoint 1, manifest 0)" in err, err


@pytest.mark.parametrize("edit", [lambda m: m.pop("settings"), lambda m: m.update(settings=None),
                                  lambda m: m.update(settings="lr=1e-05"),
                                  lambda m: m.update(settings=[["lr", 1e-05]])],
                         ids=["removed", "null", "a string", "a list"])
def test_resume_refuses_a_checkpoint_that_records_no_settings(runs, tmp_path, capsys, edit):
    """A checkpoint whose meta.json has no settings (as an older rl-kernel wrote them), or
    settings that are not a dict of them (edited: a string or a list raised AttributeError, a
    traceback): nothing ties it to the manifest, so it is refused, as a manifest without
    canonical_spec is."""
    d = _copy(runs, tmp_path)
    _edit_json(d / "checkpoints" / "step-000002" / "meta.json", edit)
    err = _refused(capsys, d)
    assert (f"{d / 'checkpoints' / 'step-000002' / 'meta.json'} records no settings of the run "
            "that wrote it (a checkpoint of an older rl-kernel, or its meta.json was edited)"
            ) in err, err


def test_resume_settings_are_what_a_resume_may_not_change():
    """RunConfig.resume_settings: every field but RESUME_MAY_CHANGE, run_dir and the input
    paths (INPUT_FIELDS: a resume reads them at their absolute input_paths), and --steps too
    under a decaying LR schedule (its horizon); resume_differences counts a field a recorded
    dict lacks at its default, names a recorded field the config has not, and ignores recorded
    input paths."""
    from rlkernel.config import INPUT_FIELDS, RESUME_MAY_CHANGE, RunConfig

    cfg = RunConfig(seed=3, tp=2, run_dir="x")
    kept = cfg.resume_settings()
    assert set(kept) == set(cfg.to_dict()) - RESUME_MAY_CHANGE - {"run_dir"} - INPUT_FIELDS
    assert cfg.resume_differences({**kept, "model": "/abs/m", "prompts": "/abs/p"}) == []
    assert "steps" in RunConfig(lr_schedule="cosine").resume_settings()
    assert cfg.resume_differences(kept) == []
    assert RunConfig(seed=3, tp=4, steps=9, run_dir="y").resume_differences(kept) == []
    assert RunConfig().resume_differences(kept) == ["seed"]
    assert cfg.resume_differences({k: v for k, v in kept.items() if k != "lr"}) == []
    assert cfg.resume_differences({**kept, "steps": 2}) == ["steps"]


@pytest.mark.parametrize("key, value", [("next_step", 10**30), ("next_step", 10**10),
                                        ("next_step", -1), ("next_step", True),
                                        ("opt_steps", "3")])
def test_a_checkpoint_with_an_impossible_step_count_is_skipped(runs, tmp_path, capsys, key,
                                                               value):
    """meta.json's next_step / opt_steps edited to what no run writes (10**30: an OverflowError
    traceback building range(next_step); 10**10: a list of 10**10 ints) make that checkpoint
    unreadable: the resume names it as skipped and takes the one before, exit 0."""
    a = _copy(runs, tmp_path)
    meta = a / "checkpoints" / "step-000002" / "meta.json"
    m = json.loads(meta.read_text())
    m[key] = value
    meta.write_text(json.dumps(m))
    assert main(["run", "--resume", str(a), "--steps", "2", "--allow-dirty"]) == 0
    assert f"skipped checkpoint step-000002: meta.json {key}" in capsys.readouterr().err


def test_resume_refuses_a_manifest_whose_resumes_is_not_a_list(runs, tmp_path, capsys):
    """manifest.json "resumes" edited to a string: exit 2 naming it, before any work (it was an
    AttributeError traceback after the run had been published)."""
    a = _copy(runs, tmp_path)
    m = json.loads((a / "manifest.json").read_text())
    m["resumes"] = "x"
    (a / "manifest.json").write_text(json.dumps(m))
    before = (a / "evidence.json").read_bytes()
    assert main(["run", "--resume", str(a), "--steps", "3", "--allow-dirty"]) == 2
    assert "'resumes' is str" in capsys.readouterr().err
    assert (a / "evidence.json").read_bytes() == before


def test_resume_refuses_another_runs_checkpoint_trained_from_other_contents(tmp_path, capsys):
    """Runs A and B with the same flags and one model path, which held other weights when B
    ran (init-model --seed 1, then --seed 2, then seed 1 again): a copy of A with B's
    checkpoints/ and evidence.json (one run's, so their version chain holds) passes every
    check of the flags and of the inputs on disk, and resumed B's weights under A's manifest.
    Now refused: the checkpoint records the digest of the input contents it was trained from
    (checkpointing.inputs_digest), B's is not A's manifest's. Control: A's copy with its own
    parts resumes."""
    model = tmp_path / "model"
    args = [*ARGS, "--model", str(model)]
    for name, seed in (("A", "1"), ("B", "2")):
        if model.exists():
            shutil.rmtree(model)
        assert main(["init-model", "--preset", "tiny", "--seed", seed, "--out", str(model)]) == 0
        assert main(["run", *args, "--run-dir", str(tmp_path / name)]) == 0
    shutil.rmtree(model)
    assert main(["init-model", "--preset", "tiny", "--seed", "1", "--out", str(model)]) == 0
    a, b = (json.loads((tmp_path / n / "manifest.json").read_text())["inputs"]["files"]
            for n in "AB")
    assert a.keys() == b.keys() and a != b      # one path, other contents
    d = tmp_path / "C"
    shutil.copytree(tmp_path / "A", d)
    shutil.rmtree(d / "checkpoints")
    shutil.copytree(tmp_path / "B" / "checkpoints", d / "checkpoints")
    shutil.copy(tmp_path / "B" / "evidence.json", d / "evidence.json")
    err = _refused(capsys, d, tmp_path / "B")
    assert (f"{d / 'checkpoints' / 'step-000002'} was trained from other inputs") in err, err
    own = tmp_path / "A2"
    shutil.copytree(tmp_path / "A", own)
    assert main(["run", "--resume", str(own), "--steps", "3", "--allow-dirty"]) == 0


def test_resume_refuses_a_checkpoint_that_records_no_inputs(runs, tmp_path, capsys):
    """A checkpoint whose meta.json has no inputs digest (or not a string: written before
    checkpoints recorded it, or edited) is refused as one without settings is."""
    for edit in (lambda m: m.pop("inputs_sha256"), lambda m: m.update(inputs_sha256=7)):
        d = _copy(runs, tmp_path)
        _edit_json(d / "checkpoints" / "step-000002" / "meta.json", edit)
        err = _refused(capsys, d)
        assert (f"{d / 'checkpoints' / 'step-000002' / 'meta.json'} records no digest of the "
                "inputs it was trained from (a checkpoint of an older rl-kernel, or its "
                "meta.json was edited)") in err, err
        shutil.rmtree(d)


@pytest.mark.parametrize("count", [7, 0, 1])
def test_resume_refuses_a_checkpoint_whose_update_count_was_edited(runs, tmp_path, capsys, count):
    """meta.json's opt_steps (AdamW's step count: its bias correction and the LR schedule read
    it) edited to another number: refused naming both counts — it resumed, exit 0, into other
    weights than a genuine resume's (found by a breaker). The unedited copy still resumes
    (test_a_copied_run_still_resumes_to_the_same_weights)."""
    d = _copy(runs, tmp_path)
    meta = d / "checkpoints" / "step-000002" / "meta.json"
    assert json.loads(meta.read_text())["opt_steps"] == 2
    _edit_json(meta, lambda m: m.update(opt_steps=count))
    err = _refused(capsys, d)
    assert (f"{meta} records {count} optimizer update(s), but {d / 'evidence.json'} records 2 "
            "applied in steps 0..1: meta.json was edited") in err, err


def test_applied_updates_count_what_the_evidence_says_was_applied():
    """The evidence's count of applied updates: one per step whose single update was not
    skipped, the `applied` entries of a multi-update step (a skipped one ends the step's list),
    None when a record does not say."""
    from rlkernel.runner.checkpointing import _applied_updates

    one = {"update_skipped": False}
    assert _applied_updates([]) == 0
    assert _applied_updates([one, {"update_skipped": True}, one]) == 2
    multi = {"update_skipped": True, "updates": [{"applied": True}, {"applied": False}]}
    assert _applied_updates([multi, {"updates": [{"applied": True}] * 4}]) == 5
    for bad in ({}, {"update_skipped": "no"}, {"updates": None}, None, []):
        assert _applied_updates([one, bad]) is None
    assert _applied_updates([{"updates": [{"applied": 1}, "x", {"applied": True}]}]) == 1


@pytest.mark.parametrize("content, why", [
    (b"[]", "meta.json holds a JSON list, not the object rlk run writes"),
    (b"\xff{}", "meta.json is not UTF-8 text (byte 0)"),
    (b"{", "meta.json is not valid JSON (line 1: "),
    (b'{"next_step": 2}', "meta.json lacks opt_steps, version, state_sha256")])
def test_a_checkpoint_whose_meta_is_not_an_object_is_skipped_saying_so(runs, tmp_path, capsys,
                                                                       content, why):
    """meta.json replaced by a list, non-UTF-8 bytes, broken JSON or an object without its keys:
    the resume skips that checkpoint with a sentence saying what the file is (it printed "list
    indices must be integers or slices, not str" or a raw codec error) and resumes from the one
    before, exit 0."""
    a = _copy(runs, tmp_path)
    (a / "checkpoints" / "step-000002" / "meta.json").write_bytes(content)
    capsys.readouterr()
    assert main(["run", "--resume", str(a), "--steps", "2", "--allow-dirty"]) == 0
    assert f"skipped checkpoint step-000002: {why}" in capsys.readouterr().err


@pytest.mark.parametrize("edit", ["drop", "fp16", "shape", "nan", "negative", "extra"])
def test_resume_refuses_checkpoint_tensors_that_are_not_the_models(runs, tmp_path, capsys, edit):
    """A checkpoint whose state file lost a tensor, holds one in fp16 or at another shape, or
    holds a NaN in exp_avg_sq or a negative second moment, or holds one tensor more (another
    layer's: it was ignored), with meta.json's SHA-256 made to match: exit 2, one line naming
    the tensor, before any work (exit 1 after the "resuming ... from" line before, as a failed
    run rather than a refused resume; a NaN moment was reported after the first resumed update
    as "the update diverged (lower --lr)")."""
    import hashlib

    import safetensors.torch
    import torch

    d = _copy(runs, tmp_path)
    ck = d / "checkpoints" / "step-000002"
    state = safetensors.torch.load((ck / "state.safetensors").read_bytes())
    name = "exp_avg_sq/model.norm.weight" if edit in ("nan", "negative") \
        else "exp_avg/model.norm.weight"
    if edit == "drop":
        del state[name]
    elif edit == "extra":
        name = "exp_avg/model.layers.99.mlp.up_proj.weight"
        state[name] = torch.zeros(4)
    elif edit in ("nan", "negative"):
        t = state[name].clone()
        t[3] = float("nan") if edit == "nan" else -1e-12
        state[name] = t
    else:
        t = state[name]
        state[name] = t.half() if edit == "fp16" else t[:-1].contiguous()
    blob = safetensors.torch.save(state)
    (ck / "state.safetensors").write_bytes(blob)
    _edit_json(ck / "meta.json", lambda m: m.update(state_sha256=hashlib.sha256(blob).hexdigest()))
    err = _refused(capsys, d)
    want = {"drop": "checkpoint lacks tensor", "nan": f"tensor {name} holds 1 NaN or Inf",
            "extra": f"checkpoint holds tensor {name}, which this run's model",
            "negative": f"tensor {name} holds negative values"}.get(
                edit, f"tensor {name} is torch.")
    assert f"{ck}: {want}" in err and name in err, err
