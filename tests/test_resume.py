"""Checkpoint and resume are bitwise: a run killed anywhere and resumed == the uninterrupted run.

Chain: uninterrupted run U (3 steps, --save-every 1); run K killed with SIGKILL at a random point
(while a step, or a checkpoint write, is in flight) then `rlk run --resume K` → `rlk compare U K`
is IDENTICAL (every step's grad norm, tokens, tensor hashes) and the final weights hash the same.
Resuming onto another topology (saved at TP2/CP2, resumed at TP1/CP4 and TP4/CP1) gives the same
bytes too. A half-written or corrupted checkpoint is never loaded; the last complete one is.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest
from cli_helpers import with_flags
from kernel_helpers import fifo_in_place_of

from rlkernel.cli import main
from rlkernel.runner.checkpointing import latest_checkpoint

ARGS = ["--steps", "3", "--save-every", "1", "--kl-coef", "0.01", "--max-response-len", "16",
        "--n-prompts", "2", "--n-samples-per-prompt", "2", "--allow-dirty"]


def _steps(d) -> list[dict]:
    try:
        with open(f"{d}/evidence.json") as f:
            return json.load(f)["steps"]
    except (OSError, ValueError):
        return []


def _identical(capsys, a, b) -> None:
    capsys.readouterr()
    assert main(["compare", str(a), str(b)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("IDENTICAL")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("u") / "run"
    assert main(["run", *ARGS, "--run-dir", str(d)]) == 0
    return d


def _killed_run(d, extra=(), kill_after_steps: int = 1, seed: int = 0) -> None:
    """Start `rlk run` in its own process group, SIGKILL the group at a random point after
    `kill_after_steps` steps are in the evidence. The run usually lies in `d.tmp-<pid>` then (it
    is published under its name only when it ends): `--resume d` must find it."""
    proc = subprocess.Popen([sys.executable, "-m", "rlkernel.cli", "run", *ARGS, "--run-dir",
                             str(d), *extra], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp_glob = d.parent.glob(f"{d.name}.tmp-*")
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        live = [p for p in d.parent.glob(f"{d.name}*") if p.is_dir()]
        if any(len(_steps(p)) >= kill_after_steps for p in live):
            break
        time.sleep(0.05)
    time.sleep(random.Random(seed).uniform(0.0, 0.5))  # lands inside the next step or its save
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    del tmp_glob


@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_then_resume_is_identical(tmp_path, capsys, uninterrupted, seed):
    """killed at a random point of step 1 or 2, resumed by the name the user gave (the killed
    run's RUN.tmp-<pid> is adopted): evidence and weights == uninterrupted."""
    d = tmp_path / "run"
    _killed_run(d, kill_after_steps=1 + seed, seed=seed)
    if d.exists() and json.loads((d / "evidence.json").read_text())["complete"]:
        pytest.skip("the run finished before the kill landed")
    assert main(["run", "--resume", str(d), "--allow-dirty"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no .tmp- left
    _identical(capsys, uninterrupted, d)


def test_resume_onto_other_topologies(tmp_path, capsys, uninterrupted):
    """saved at TP2/CP2 after step 1, resumed at TP1/CP4 and at TP4/CP1: == uninterrupted."""
    base = tmp_path / "tp2cp2"
    assert main(["run", *with_flags(ARGS, "--steps", "1"), "--tp", "2", "--cp", "2",
                 "--run-dir", str(base)]) == 0
    for extra in (["--tp", "1", "--cp", "4"], ["--tp", "4", "--cp", "1"]):
        d = tmp_path / ("r" + "".join(extra).replace("-", ""))
        shutil.copytree(base, d)
        assert main(["run", "--resume", str(d), "--steps", "3", "--allow-dirty", *extra]) == 0
        _identical(capsys, uninterrupted, d)
        # the manifest records the config the run now follows, and the history
        m = json.loads((d / "manifest.json").read_text())
        assert m["config"]["steps"] == 3 and m["config"]["tp"] == int(extra[1])
        (resumed,) = m["resumes"]
        assert resumed["from_step"] == 1 and resumed["changed"]["steps"] == [1, 3]
        assert resumed["changed"]["tp"] == [2, int(extra[1])] and "torch" in resumed["versions"]


def test_half_written_and_corrupt_checkpoints_are_never_loaded(tmp_path, capsys, uninterrupted):
    """a stray .tmp checkpoint and a corrupted newest one are skipped; the last good one is used."""
    d = tmp_path / "run"
    shutil.copytree(uninterrupted, d)
    ck = d / "checkpoints"
    shutil.rmtree(ck / "step-000003")
    (ck / "step-000003.tmp-4242").mkdir()
    (ck / "step-000003.tmp-4242" / "state.safetensors").write_bytes(b"\x00" * 100)
    state = ck / "step-000002" / "state.safetensors"
    data = bytearray(state.read_bytes())
    data[-1] ^= 1
    state.write_bytes(bytes(data))
    found = latest_checkpoint(d)
    assert found.next_step == 1 and [w.split(":")[0] for w in found.skipped] == ["step-000002"]
    capsys.readouterr()
    assert main(["run", "--resume", str(d), "--allow-dirty"]) == 0
    assert "rlk run: skipped checkpoint step-000002: " in capsys.readouterr().err   # said, not silent
    _identical(capsys, uninterrupted, d)


def test_a_state_file_that_is_no_safetensors_is_named_when_its_checkpoint_is_skipped(
        tmp_path, uninterrupted):
    """The newest checkpoint's state.safetensors replaced by garbage with meta.json's SHA-256
    edited to match (so the hash check passes): skipped, the reason naming state.safetensors
    (it was safetensors' bare header message). Control: the same checkpoint unedited loads."""
    d = tmp_path / "run"
    shutil.copytree(uninterrupted, d)
    assert latest_checkpoint(d).next_step == 3
    ck = d / "checkpoints" / "step-000003"
    garbage = b"\xff" * 64
    (ck / "state.safetensors").write_bytes(garbage)
    meta = json.loads((ck / "meta.json").read_text())
    meta["state_sha256"] = hashlib.sha256(garbage).hexdigest()
    (ck / "meta.json").write_text(json.dumps(meta))
    found = latest_checkpoint(d)
    (why,) = found.skipped
    assert found.next_step == 2 and why.startswith("step-000003:"), found.skipped
    assert "state.safetensors is not a safetensors file" in why, why


def test_resume_refuses_changed_numerics_and_missing_checkpoints(tmp_path, capsys, uninterrupted):
    """--lr on --resume, or a run without checkpoints: exit 2 with a message, nothing changed."""
    d = tmp_path / "run"
    shutil.copytree(uninterrupted, d)
    before = (d / "evidence.json").read_bytes()
    assert main(["run", "--resume", str(d), "--lr", "0.5", "--allow-dirty"]) == 2
    assert "--lr" in capsys.readouterr().err
    shutil.rmtree(d / "checkpoints")
    assert main(["run", "--resume", str(d), "--allow-dirty"]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert (d / "evidence.json").read_bytes() == before


def test_resume_refuses_a_finished_run_and_names_unreadable_evidence(tmp_path, capsys,
                                                                     uninterrupted):
    """--resume of a run that already holds all its steps: exit 2, "already complete", nothing
    rewritten; an evidence.json that is not JSON is named (exit 2), not a bare parser message."""
    d = tmp_path / "run"
    shutil.copytree(uninterrupted, d)
    before = {f: (d / f).read_bytes() for f in ("evidence.json", "manifest.json")}
    assert main(["run", "--resume", str(d), "--allow-dirty"]) == 2
    assert "already complete (3/3 steps); to go on, extend it with --steps N (N > 3)" in \
        capsys.readouterr().err
    assert {f: (d / f).read_bytes() for f in before} == before
    (d / "evidence.json").write_text("{")
    assert main(["run", "--resume", str(d), "--steps", "4", "--allow-dirty"]) == 2
    err = capsys.readouterr().err
    assert f"--resume {str(d)!r}: evidence.json is not valid JSON (line 1: " in err


def test_resume_refuses_evidence_shorter_than_its_checkpoint(tmp_path, capsys, uninterrupted):
    """evidence.json cut to 1 step, or holding step 0 three times, while the newest checkpoint
    continues at step 3 (a run records each step before its checkpoint, so only an edit does
    this): exit 2 naming the file and the steps, nothing rewritten (it resumed, wrote steps
    [0, 3] or [0, 0, 0, 3] and marked the run complete)."""
    d = tmp_path / "run"
    shutil.copytree(uninterrupted, d)
    ev = json.loads((d / "evidence.json").read_text())
    ev["steps"] = ev["steps"][:1]
    ev["complete"] = False
    (d / "evidence.json").write_text(json.dumps(ev))
    before = {f: (d / f).read_bytes() for f in ("evidence.json", "manifest.json")}
    assert main(["run", "--resume", str(d), "--steps", "4", "--allow-dirty"]) == 2
    err = capsys.readouterr().err
    assert "holds steps [0] but the checkpoint continues at step 3" in err, err
    assert {f: (d / f).read_bytes() for f in before} == before
    ev["steps"] = [ev["steps"][0]] * 3            # as many steps, one of them three times
    (d / "evidence.json").write_text(json.dumps(ev))
    assert main(["run", "--resume", str(d), "--steps", "4", "--allow-dirty"]) == 2
    assert "holds steps [0, 0, 0] but the checkpoint continues at step 3" in \
        capsys.readouterr().err
    ev["steps"] = [ev["steps"][0], ev["steps"][0], None]   # the checkpoint's last kept entry
    (d / "evidence.json").write_text(json.dumps(ev))
    assert main(["run", "--resume", str(d), "--steps", "4", "--allow-dirty"]) == 2
    assert "evidence.json's steps[2] is null, not a step's object" in capsys.readouterr().err
    ev["steps"] = [ev["steps"][0], 1, ev["steps"][0]]   # an entry that is not a step object
    (d / "evidence.json").write_text(json.dumps(ev))
    assert main(["run", "--resume", str(d), "--steps", "4", "--allow-dirty"]) == 2
    assert "evidence.json's steps[1] is a number, not a step's object" in \
        capsys.readouterr().err
    assert (d / "manifest.json").read_bytes() == before["manifest.json"]


def _run_with_inputs(tmp_path):
    """A 1-step run of an init-model checkpoint on a prompts file, checkpointed after step 1."""
    model, prompts = tmp_path / "model", tmp_path / "prompts.jsonl"
    assert main(["init-model", "--preset", "tiny", "--seed", "1", "--out", str(model)]) == 0
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+3=", "label": "5"}\n')
    d = tmp_path / "run"
    assert main(["run", *with_flags(ARGS, "--steps", "1"), "--model", str(model),
                 "--prompts", str(prompts), "--run-dir", str(d)]) == 0
    return d, model, prompts


def test_a_prompts_file_replaced_while_a_resume_loads_is_refused(tmp_path, capsys, monkeypatch):
    """--resume checks the inputs against the manifest, then the loop reads them again after
    the model loads: a prompts file replaced in between is refused, exit 2 (the resume handed
    the loop no start read, and it trained on the new file)."""
    from rlkernel.runner import loop
    d, _, prompts = _run_with_inputs(tmp_path)
    capsys.readouterr()
    load = loop._load_model

    def swap_then_load(cfg):
        prompts.write_text('{"prompt": "0*7=", "label": "0"}\n')
        return load(cfg)

    monkeypatch.setattr(loop, "_load_model", swap_then_load)
    assert main(["run", "--resume", str(d), "--steps", "2", "--allow-dirty"]) == 2
    assert "the file changed while the run was starting" in capsys.readouterr().err


def test_resume_refuses_inputs_that_changed_naming_the_file(tmp_path, capsys):
    """The manifest holds every input's SHA-256; --resume after the prompts file or the model's
    weights were replaced under the same path == exit 2 naming that file, nothing written;
    with the inputs restored it resumes (exit 0). A manifest without hashes is refused."""
    d, model, prompts = _run_with_inputs(tmp_path)
    files = json.loads((d / "manifest.json").read_text())["inputs"]["files"]
    assert set(files) == {str(prompts), str(model / "config.json"),
                          str(model / "model.safetensors"), str(model / "tokenizer.json")}
    assert files[str(prompts)] == hashlib.sha256(prompts.read_bytes()).hexdigest()
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    capsys.readouterr()

    good = prompts.read_bytes()
    prompts.write_bytes(good.replace(b"2+3", b"3+3"))
    assert main(["run", "--resume", str(d), "--steps", "2", "--allow-dirty"]) == 2
    err = capsys.readouterr().err
    assert f"input {prompts} changed" in err and len(err.strip().splitlines()) == 1, err
    prompts.write_bytes(good)

    weights = model / "model.safetensors"
    good = weights.read_bytes()
    shutil.rmtree(model)
    assert main(["init-model", "--preset", "tiny", "--seed", "2", "--out", str(model)]) == 0
    capsys.readouterr()
    assert main(["run", "--resume", str(d), "--steps", "2", "--allow-dirty"]) == 2
    assert f"input {weights} changed" in capsys.readouterr().err
    weights.write_bytes(good)
    assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file()} == before

    m = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({k: v for k, v in m.items() if k != "inputs"}))
    assert main(["run", "--resume", str(d), "--steps", "2", "--allow-dirty"]) == 2
    assert "records no input hashes" in capsys.readouterr().err
    (d / "manifest.json").write_text(json.dumps(m))
    assert main(["run", "--resume", str(d), "--steps", "2", "--allow-dirty"]) == 0


def test_resume_names_an_edited_model_config_before_the_shape_it_no_longer_fits(tmp_path,
                                                                               capsys):
    """The model's config.json edited after the run started so that its own shape no longer
    fits the run (max_position_embeddings below the run's prompt + response length, or a head
    count --tp cannot divide): the refusal names the changed file (it named the symptom — the
    length or the heads — as if the run's flags were wrong). Control: a new run on the edited
    model is still refused for the shape itself; restored, the resume runs."""
    d, model, _ = _run_with_inputs(tmp_path)
    path = model / "config.json"
    good = path.read_bytes()
    cfg = json.loads(good)
    for edit in ({"max_position_embeddings": 8}, {"num_attention_heads": 3}):
        path.write_text(json.dumps({**cfg, **edit}))
        capsys.readouterr()
        assert main(["run", "--resume", str(d), "--steps", "2", "--allow-dirty"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"input {path} changed since the run started" in err[0], err
        assert main(["run", *with_flags(ARGS, "--steps", "1"), "--model", str(model),
                     "--run-dir", str(tmp_path / "new")]) == 2
        err = capsys.readouterr().err
        assert "changed since" not in err and str(model) in err and "config.json" in err, err
    path.write_bytes(good)
    assert main(["run", "--resume", str(d), "--steps", "2", "--allow-dirty"]) == 0


_REWARD = "def score(prompt, completion, label):\n    return float(label in completion)\n"


def _relative_inputs(wd):
    """`wd` with a model m/, a prompts file pr.jsonl and a reward r.py, for runs that name them
    relative to `wd`."""
    wd.mkdir()
    assert main(["init-model", "--preset", "tiny", "--seed", "1", "--out", str(wd / "m")]) == 0
    (wd / "pr.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n'
                                 '{"prompt": "2+3=", "label": "5"}\n')
    (wd / "r.py").write_text(_REWARD)
    return ["--model", "m", "--prompts", "pr.jsonl", "--reward", "r.py:score"]


def test_a_run_of_relative_inputs_resumes_from_any_directory(tmp_path, capsys, monkeypatch):
    """A run started in WD with --model m --prompts pr.jsonl --reward r.py:score records them as
    typed (config) and as absolute paths (input_paths); `rlk run --resume WD/run` from another
    directory reads them there (exit 0), a second resume from a third takes the first one's
    checkpoint as the run's own, and the result == a 3-step run of copies of the same inputs
    started in a fourth directory: `rlk compare` IDENTICAL, with no difference of
    configuration (the typed paths are the same). Before, the resume looked for ./m and failed
    with `--model 'm': no such directory`."""
    wd, other, elsewhere = tmp_path / "wd", tmp_path / "other", tmp_path / "elsewhere"
    inputs = _relative_inputs(wd)
    monkeypatch.chdir(wd)
    assert main(["run", *with_flags(ARGS, "--steps", "1"), *inputs, "--run-dir", "run"]) == 0
    m = json.loads((wd / "run" / "manifest.json").read_text())
    assert (m["config"]["model"], m["config"]["prompts"], m["config"]["reward"]) == \
        ("m", "pr.jsonl", "r.py:score")
    assert m["input_paths"] == {"model": str(wd / "m"), "prompts": str(wd / "pr.jsonl"),
                                "reward": f"{wd / 'r.py'}:score"}

    shutil.copytree(wd, other, ignore=shutil.ignore_patterns("run*"))
    monkeypatch.chdir(other)
    assert main(["run", *with_flags(ARGS, "--steps", "3"), *inputs, "--run-dir", "run"]) == 0
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["run", "--resume", str(wd / "run"), "--steps", "2", "--allow-dirty"]) == 0
    m = json.loads((wd / "run" / "manifest.json").read_text())
    assert m["config"]["model"] == "m" and "model" not in m["resumes"][0]["changed"]
    # Resumed again: the checkpoint the first resume wrote (under the absolute input paths) is
    # the run's own (it was refused as "written under other settings: --model '/…/m' vs 'm'").
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--resume", str(wd / "run"), "--steps", "3", "--allow-dirty"]) == 0
    capsys.readouterr()
    assert main(["compare", str(other / "run"), str(wd / "run")]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("IDENTICAL") and "differ in configuration" not in out, out


def test_a_resume_may_name_the_runs_inputs_by_another_path(tmp_path, capsys, monkeypatch):
    """Inputs typed relative to WD (m, pr.jsonl, r.py:score) and given again to the resume as
    absolute paths, or through a symlink, are the same inputs: the resume runs (exit 0) and the
    saved config keeps the typed values (no change recorded). A copy of the model elsewhere
    (same bytes, another directory), another reward function in the same file, or a model
    directory that does not exist is a change and is refused (exit 2, naming --model or
    --reward), as before."""
    wd = tmp_path / "wd"
    inputs = _relative_inputs(wd)
    monkeypatch.chdir(wd)
    assert main(["run", *with_flags(ARGS, "--steps", "1"), *inputs, "--run-dir", "run"]) == 0
    shutil.copytree(wd / "m", tmp_path / "copy")
    (tmp_path / "link").symlink_to(wd / "m")
    (wd / "r.py").write_text(_REWARD + "other = score\n")   # content change: refused later
    capsys.readouterr()
    for flags in (["--model", str(tmp_path / "copy")], ["--reward", "r.py:other"],
                  ["--model", str(tmp_path / "nowhere")]):
        assert main(["run", "--resume", "run", "--steps", "2", "--allow-dirty", *flags]) == 2
        err = capsys.readouterr().err
        assert f"{flags[0]} {flags[1]!r} (saved" in err, err
        assert "cannot change when resuming" in err, err
    (wd / "r.py").write_text(_REWARD)
    monkeypatch.chdir(tmp_path)
    same = ["--model", str(wd / "m"), "--prompts", str(wd / "pr.jsonl"),
            "--reward", f"{wd / 'r.py'}:score"]
    assert main(["run", "--resume", str(wd / "run"), "--steps", "2", "--allow-dirty",
                 *same]) == 0
    assert main(["run", "--resume", str(wd / "run"), "--steps", "3", "--allow-dirty",
                 "--model", str(tmp_path / "link")]) == 0
    m = json.loads((wd / "run" / "manifest.json").read_text())
    assert (m["config"]["model"], m["config"]["prompts"], m["config"]["reward"]) == \
        ("m", "pr.jsonl", "r.py:score")
    assert [r["changed"]["steps"] for r in m["resumes"]] == [[1, 2], [2, 3]]
    assert not {"model", "prompts", "reward"} & {k for r in m["resumes"] for k in r["changed"]}



def test_a_moved_project_may_name_its_inputs_by_their_new_absolute_paths(tmp_path, capsys,
                                                                          monkeypatch):
    """WD (a run of inputs typed m, pr.jsonl, r.py:score) moved to WD2: the recorded absolute
    paths are gone, so `--model WD2/m --prompts WD2/pr.jsonl --reward WD2/r.py:score` from WD2
    match the inputs only as typed from the current directory (m is WD2/m): the same inputs,
    the resume runs (exit 0) and the config keeps the typed values. Control: a copy of m in
    another directory is still a change (exit 2). Found by mutation testing: comparing with the
    recorded path only passed every test."""
    wd, wd2 = tmp_path / "wd", tmp_path / "wd2"
    inputs = _relative_inputs(wd)
    monkeypatch.chdir(wd)
    assert main(["run", *with_flags(ARGS, "--steps", "1"), *inputs, "--run-dir", "run"]) == 0
    shutil.copytree(wd / "m", tmp_path / "copy")
    monkeypatch.chdir(tmp_path)
    wd.rename(wd2)
    monkeypatch.chdir(wd2)
    capsys.readouterr()
    assert main(["run", "--resume", "run", "--steps", "2", "--allow-dirty",
                 "--model", str(tmp_path / "copy")]) == 2
    err = capsys.readouterr().err
    assert f"--model {str(tmp_path / 'copy')!r} (saved 'm')" in err, err
    assert "cannot change when resuming" in err, err
    assert main(["run", "--resume", "run", "--steps", "2", "--allow-dirty",
                 "--model", str(wd2 / "m"), "--prompts", str(wd2 / "pr.jsonl"),
                 "--reward", f"{wd2 / 'r.py'}:score"]) == 0, capsys.readouterr().err
    m = json.loads((wd2 / "run" / "manifest.json").read_text())
    assert (m["config"]["model"], m["config"]["prompts"], m["config"]["reward"]) == \
        ("m", "pr.jsonl", "r.py:score")
    assert [r["changed"]["steps"] for r in m["resumes"]] == [[1, 2]]
    assert not {"model", "prompts", "reward"} & set(m["resumes"][0]["changed"])


def test_a_resume_may_not_swap_a_module_reward_for_another_module(tmp_path, capsys,
                                                                   monkeypatch):
    """--reward rmod:score (MODULE:FUNC, no file) resumed with --reward rmod2:score, a module of
    the same function name and bytes: another input, refused (exit 2, naming --reward and the
    saved 'rmod:score'); a MODULE:FUNC spec matches only itself. Control: --reward rmod:score
    given again resumes (exit 0). Found by mutation testing: taking two specs that name no file
    for the same input passed every test."""
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "rmod.py").write_text(_REWARD)
    (wd / "rmod2.py").write_text(_REWARD)
    monkeypatch.chdir(wd)
    monkeypatch.syspath_prepend(str(wd))
    try:
        assert main(["run", *with_flags(ARGS, "--steps", "1"), "--reward", "rmod:score",
                     "--run-dir", "run"]) == 0
        capsys.readouterr()
        assert main(["run", "--resume", "run", "--steps", "2", "--allow-dirty",
                     "--reward", "rmod2:score"]) == 2
        err = capsys.readouterr().err
        assert "--reward 'rmod2:score' (saved 'rmod:score') cannot change" in err, err
        assert main(["run", "--resume", "run", "--steps", "2", "--allow-dirty",
                     "--reward", "rmod:score"]) == 0, capsys.readouterr().err
    finally:
        sys.modules.pop("rmod", None)
        sys.modules.pop("rmod2", None)

def test_a_module_reward_resumed_from_elsewhere_names_the_runs_module(tmp_path, capsys,
                                                                      monkeypatch):
    """--reward rmod:score (MODULE:FUNC: imported by Python's module search from the current
    directory, no path recorded) resumed from another directory: exit 2, one line naming the
    run's reward, the directory it was looked up from and the module file the manifest recorded
    (it said "give an importable module or a path to a .py file", a flag a resume does not
    take); nothing written. From the run's directory it resumes (exit 0)."""
    wd, elsewhere = tmp_path / "wd", tmp_path / "elsewhere"
    wd.mkdir()
    elsewhere.mkdir()
    (wd / "rmod.py").write_text(_REWARD)
    monkeypatch.chdir(wd)
    monkeypatch.syspath_prepend(str(wd))
    assert main(["run", *with_flags(ARGS, "--steps", "1"), "--reward", "rmod:score",
                 "--run-dir", "run"]) == 0
    monkeypatch.undo()
    sys.modules.pop("rmod", None)
    monkeypatch.chdir(elsewhere)
    before = _snapshot(wd / "run")
    capsys.readouterr()
    assert main(["run", "--resume", str(wd / "run"), "--steps", "2", "--allow-dirty"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"rlk run: error: --resume '{wd / 'run'}': the run's --reward "
                           f"'rmod:score' cannot be imported from here ({elsewhere})"), line
    assert f"when the run started it was {wd / 'rmod.py'}" in line, line
    assert _snapshot(wd / "run") == before
    monkeypatch.chdir(wd)
    monkeypatch.syspath_prepend(str(wd))     # teardown restores sys.path (the import adds cwd)
    assert main(["run", "--resume", str(wd / "run"), "--steps", "2", "--allow-dirty"]) == 0
    sys.modules.pop("rmod", None)


@pytest.mark.parametrize("name, what", [("m", "model directory"), ("pr.jsonl", "prompts file"),
                                        ("r.py", "reward file")])
def test_a_resume_names_the_recorded_input_that_is_gone(tmp_path, capsys, monkeypatch, name,
                                                         what):
    """An input moved away after the run started: `rlk run --resume` (from another directory)
    exits 2 with one line naming the absolute path the run recorded (not a flag of this command,
    `--model 'm': no such directory`), the run untouched; put back, it resumes (exit 0)."""
    wd = tmp_path / "wd"
    inputs = _relative_inputs(wd)
    monkeypatch.chdir(wd)
    assert main(["run", *with_flags(ARGS, "--steps", "1"), *inputs, "--run-dir", "run"]) == 0
    monkeypatch.chdir(tmp_path)
    before = _snapshot(wd / "run")
    (wd / name).rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(["run", "--resume", str(wd / "run"), "--steps", "2", "--allow-dirty"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        f"rlk run: error: --resume {str(wd / 'run')!r}: the run's {what} {str(wd / name)!r} "
        "(recorded in manifest.json input_paths when the run started) no longer exists, nor "
        "does its path as typed from this directory; restore it there to resume, or start a "
        "new run"], err
    assert _snapshot(wd / "run") == before
    (tmp_path / "moved").rename(wd / name)
    assert main(["run", "--resume", str(wd / "run"), "--steps", "2", "--allow-dirty"]) == 0


def test_a_project_folder_moved_with_its_run_resumes_and_exports(tmp_path, capsys,
                                                                   monkeypatch):
    """WD (its run and its relative inputs) moved to WD2: the recorded absolute paths are gone,
    the typed ones are found from WD2, whose content matches the manifest's hashes: `rlk run
    --resume` and `rlk export` from WD2 work (both were refused: 'the run's model directory
    '/…/wd/m' … no longer exists'), and the resumed run is IDENTICAL to an uninterrupted one."""
    wd, wd2, other = tmp_path / "wd", tmp_path / "wd2", tmp_path / "other"
    inputs = _relative_inputs(wd)
    monkeypatch.chdir(wd)
    assert main(["run", *with_flags(ARGS, "--steps", "1"), *inputs, "--run-dir", "run"]) == 0
    shutil.copytree(wd, other, ignore=shutil.ignore_patterns("run*"))
    monkeypatch.chdir(other)
    assert main(["run", *with_flags(ARGS, "--steps", "2"), *inputs, "--run-dir", "run"]) == 0
    wd.rename(wd2)
    monkeypatch.chdir(wd2)
    assert main(["run", "--resume", "run", "--steps", "2", "--allow-dirty"]) == 0, \
        capsys.readouterr().err
    assert main(["export", "run", "--out", "exported"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["compare", str(other / "run"), "run"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("IDENTICAL")
    # The resume recorded where it found the inputs: an export from any other directory reads
    # them there (it looked at the start's paths, gone, and failed with exit 1); the resume's
    # entry keeps the start's paths.
    m = json.loads((wd2 / "run" / "manifest.json").read_text())
    assert m["input_paths"]["model"] == str(wd2 / "m")
    assert m["resumes"][-1]["input_paths_before"]["model"] == str(wd / "m")
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(wd2 / "run"), "--out", "exported2"]) == 0, \
        capsys.readouterr().err


def test_a_run_without_input_paths_resolves_its_inputs_as_before(tmp_path, capsys, monkeypatch):
    """A manifest written before input_paths (the key removed): its typed relative inputs are
    read from the current directory, as they were — from elsewhere `--model 'm': no such
    directory` (exit 2), from WD it resumes (exit 0), and then records input_paths."""
    wd = tmp_path / "wd"
    inputs = _relative_inputs(wd)
    monkeypatch.chdir(wd)
    assert main(["run", *with_flags(ARGS, "--steps", "1"), *inputs, "--run-dir", "run"]) == 0
    path = wd / "run" / "manifest.json"
    m = json.loads(path.read_text())
    del m["input_paths"]
    path.write_text(json.dumps(m))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["run", "--resume", str(wd / "run"), "--steps", "2", "--allow-dirty"]) == 2
    assert "--model 'm': no such directory" in capsys.readouterr().err
    monkeypatch.chdir(wd)
    assert main(["run", "--resume", "run", "--steps", "2", "--allow-dirty"]) == 0
    m = json.loads(path.read_text())
    assert m["input_paths"]["model"] == str(wd / "m")


def test_an_extended_resume_records_the_prompts_it_follows(tmp_path, capsys, uninterrupted):
    """The manifest's "prompts" follows the resumed config as "config" does: the task's 2 x 3
    prompts become 2 x 4 when --steps 4 extends the run (it kept the first run's count, so a
    resumed run's manifest differed from an uninterrupted 4-step run's; found by a new-user
    helper); the resume's entry records the same."""
    d = tmp_path / "run"
    shutil.copytree(uninterrupted, d)
    m = json.loads((d / "manifest.json").read_text())
    assert m["prompts"] == {"source": "task:arithmetic", "count": 6, "seed": 0}
    assert main(["run", "--resume", str(d), "--steps", "4", "--allow-dirty"]) == 0
    m = json.loads((d / "manifest.json").read_text())
    want = {"source": "task:arithmetic", "count": 8, "seed": 0}
    assert m["prompts"] == want and m["resumes"][-1]["prompts"] == want


def test_resume_refuses_a_run_written_under_another_numerical_spec(tmp_path, capsys, uninterrupted):
    """A manifest from code that computed other bits (an older numerics_version, or none at all:
    written before the field existed) or with no canonical_spec is refused with exit 2, one line
    naming the field, and nothing changed; the untouched manifest resumes (control)."""
    d = tmp_path / "run"
    shutil.copytree(uninterrupted, d)
    before = (d / "evidence.json").read_bytes()
    m = json.loads((d / "manifest.json").read_text())
    for old in ({**m["canonical_spec"], "numerics_version": 1},
                {k: v for k, v in m["canonical_spec"].items()
                 if k not in ("numerics_version", "rounding_points")}):
        (d / "manifest.json").write_text(json.dumps({**m, "canonical_spec": old}))
        assert main(["run", "--resume", str(d), "--steps", "4", "--allow-dirty"]) == 2
        err = capsys.readouterr().err.strip()
        assert "another numerical spec (numerics_version: saved " in err, err
        assert len(err.splitlines()) == 1
        assert (d / "evidence.json").read_bytes() == before
    (d / "manifest.json").write_text(json.dumps({k: v for k, v in m.items()
                                                 if k != "canonical_spec"}))
    assert main(["run", "--resume", str(d), "--steps", "4", "--allow-dirty"]) == 2
    assert "records no canonical_spec" in capsys.readouterr().err
    (d / "manifest.json").write_text(json.dumps(m))
    assert main(["run", "--resume", str(d), "--steps", "4", "--allow-dirty"]) == 0


def test_resume_refuses_another_device_naming_the_reason(tmp_path, capsys, uninterrupted):
    """--resume with --device cuda on a cpu run == exit 2, one line naming --device and why."""
    assert main(["run", "--resume", str(uninterrupted), "--device", "cuda", "--allow-dirty"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlk run: error: --device 'cuda'") and "within one backend" in err
    assert len(err.splitlines()) == 1


def test_resume_finds_a_killed_runs_tmp_dir_only_when_its_process_is_gone(tmp_path, capsys,
                                                                          uninterrupted):
    """RUN missing, RUN.tmp-<pid> present: a live pid (this process) is refused ('still going');
    two dead ones are refused (ambiguous); one dead one is renamed to RUN and resumed."""
    d = tmp_path / "run"
    mine = tmp_path / f"run.tmp-{os.getpid()}"
    shutil.copytree(uninterrupted, mine)
    assert main(["run", "--resume", str(d), "--allow-dirty"]) == 2
    assert "still going" in capsys.readouterr().err
    dead = [subprocess.Popen(["true"]) for _ in range(2)]
    for p in dead:
        p.wait()
    shutil.rmtree(mine)
    for p in dead:   # killed before the end: the last checkpoint was not written yet
        shutil.copytree(uninterrupted, tmp_path / f"run.tmp-{p.pid}")
        shutil.rmtree(tmp_path / f"run.tmp-{p.pid}" / "checkpoints" / "step-000003")
    assert main(["run", "--resume", str(d), "--allow-dirty"]) == 2
    assert "several killed runs" in capsys.readouterr().err
    shutil.rmtree(tmp_path / f"run.tmp-{dead[1].pid}")
    assert main(["run", "--resume", str(d), "--allow-dirty"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_resume_by_a_killed_runs_tmp_path_continues_and_publishes_the_run(tmp_path, capsys,
                                                                          uninterrupted):
    """--resume RUN.tmp-<pid> (the path a killed run left, pid gone) is --resume RUN: the run is
    renamed to RUN, takes RUN's lock (a second resume by either name is then refused, not
    renamed under it) and is published there with the uninterrupted run's final bytes; with the
    pid alive it is refused ('still going'), and beside a published RUN it is ambiguous."""
    d = tmp_path / "run"
    gone = subprocess.Popen(["true"])
    gone.wait()
    tmp = tmp_path / f"run.tmp-{gone.pid}"
    shutil.copytree(uninterrupted, tmp)
    shutil.rmtree(tmp / "checkpoints" / "step-000003")
    live = tmp_path / f"run.tmp-{os.getpid()}"
    shutil.copytree(tmp, live)
    assert main(["run", "--resume", str(live), "--allow-dirty"]) == 2
    err = capsys.readouterr().err
    assert "still going" in err and str(live) in err
    # The directory named is the one resumed, though another killed run's lies beside it
    # (--resume RUN would have to ask which).
    assert main(["run", "--resume", str(tmp), "--allow-dirty"]) == 0
    shutil.rmtree(live)
    assert f"{tmp} (left by a killed run) is now {d}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]   # published, no lock left
    for f in ("model.safetensors", "rlk_weights.json"):
        assert (d / "final" / f).read_bytes() == (uninterrupted / "final" / f).read_bytes()
    shutil.copytree(uninterrupted, tmp)
    assert main(["run", "--resume", str(tmp), "--allow-dirty"]) == 2
    assert "beside the published run" in capsys.readouterr().err
    # What the start-up warning advises then: move it to a free name and resume that.
    shutil.rmtree(tmp / "checkpoints" / "step-000003")
    shutil.rmtree(tmp / "final")
    ev = json.loads((tmp / "evidence.json").read_text())
    ev["complete"] = False
    (tmp / "evidence.json").write_text(json.dumps(ev))
    moved = tmp.rename(tmp_path / "run-resumed")
    assert main(["run", "--resume", str(moved), "--allow-dirty"]) == 0, capsys.readouterr().err
    for f in ("model.safetensors", "rlk_weights.json"):
        assert (moved / "final" / f).read_bytes() == (uninterrupted / "final" / f).read_bytes()


def test_resume_by_either_name_takes_the_runs_one_lock(tmp_path, capsys, uninterrupted):
    """While a resume of RUN holds RUN.lock, a resume given RUN.tmp-<pid> of a killed run is
    refused at its start (it locked RUN.tmp-<pid>.lock and renamed the directory from under the
    first, which then failed writing its evidence)."""
    from rlkernel.runner.dirlock import run_dir_lock

    gone = subprocess.Popen(["true"])
    gone.wait()
    tmp = tmp_path / f"run.tmp-{gone.pid}"
    shutil.copytree(uninterrupted, tmp)
    with run_dir_lock(tmp_path / "run"):
        assert main(["run", "--resume", str(tmp), "--allow-dirty"]) == 2
    assert "is writing this directory" in capsys.readouterr().err
    assert tmp.is_dir()


@pytest.mark.parametrize("cwd, spelling", [("run", "."), ("run/checkpoints", "..")])
def test_resume_from_inside_the_run_takes_the_runs_one_lock(tmp_path, capsys, uninterrupted,
                                                             monkeypatch, cwd, spelling):
    """`rlk run --resume .` inside RUN (a ValueError traceback: '.' has no name to lock) and
    `--resume ..` from RUN/checkpoints (it locked checkpoints/...lock, so a resume of RUN by its
    name ran beside it) take RUN.lock: refused while another resume holds it, exit 0 after."""
    from rlkernel.runner.dirlock import run_dir_lock

    d = tmp_path / "run"
    shutil.copytree(uninterrupted, d)
    shutil.rmtree(d / "checkpoints" / "step-000003")
    monkeypatch.chdir(tmp_path / cwd)
    with run_dir_lock(d):
        assert main(["run", "--resume", spelling, "--allow-dirty"]) == 2
    assert "is writing this directory" in capsys.readouterr().err
    assert main(["run", "--resume", spelling, "--allow-dirty"]) == 0, capsys.readouterr().err
    assert not list(tmp_path.glob("**/*.lock"))


def test_resume_says_where_it_resumes_and_counts_on(tmp_path, capsys, uninterrupted):
    """Resuming at evidence step 1 of 3 prints one "resuming ... at step 2/3" line, then progress
    "step 2/3", "step 3/3" (not 1/3); the replaced RUN/final holds the same bytes as the
    uninterrupted run's."""
    d = tmp_path / "run"
    shutil.copytree(uninterrupted, d)
    for name in ("step-000002", "step-000003"):
        shutil.rmtree(d / "checkpoints" / name)
    capsys.readouterr()
    assert main(["run", "--resume", str(d), "--allow-dirty"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"rlk run: resuming {d} from checkpoints/step-000001 at step 2/3 (evidence "
                      "step 1; the 1 step(s) before it are kept)")
    # Then the start-up lines and the closing summary (runner/watch.py); the progress lines:
    assert [ln.split("  ")[0] for ln in err[1:] if ln.startswith("step ")] == ["step 2/3",
                                                                             "step 3/3"]
    # The closing line counts the run's 3 steps and says 2 of them, and their seconds (evidence
    # steps 1 and 2), were this resume's (found by mutation testing: no resumed_at passed to the
    # summary, or the checkpoint's step + 1, passed every test).
    mine = math.fsum(s["timings"]["step_s"] for s in _steps(d)[1:])
    assert [ln for ln in err if ln.startswith("done: ")][0].startswith(
        f"done: 3 steps (2 of them in this resume, {mine:.1f} s) in "), err
    for f in ("model.safetensors", "rlk_weights.json"):
        assert (d / "final" / f).read_bytes() == (uninterrupted / "final" / f).read_bytes()
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == []  # no staging left


def _signal_after_first_checkpoint(d, sig):
    """Start `rlk run` (ARGS) into `d` in its own process group, send `sig` to the group once
    step 1's checkpoint exists: (the finished process, its stderr). Skips the test when the run
    finished before the signal landed."""
    proc = subprocess.Popen([sys.executable, "-m", "rlkernel.cli", "run", *ARGS, "--run-dir",
                             str(d)], start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if any((p / "checkpoints" / "step-000001").is_dir() for p in d.parent.glob(f"{d.name}*")):
            break
        time.sleep(0.05)
    os.killpg(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip(f"the run finished before {signal.Signals(sig).name} landed")
    return proc, err


@pytest.mark.parametrize("where", ["loop", "evidence"])
def test_a_resume_interrupted_before_its_first_step_leaves_the_run_as_it_was(
        tmp_path, capsys, monkeypatch, uninterrupted, where):
    """A finished 3-step run resumed to 5 steps and signalled before the resume's first step
    (in the loop, or between the evidence and manifest rewrites): exit 143, one line saying the
    run is left as it was, every file byte-identical, and it still compares IDENTICAL with the
    uninterrupted run. It was left incomplete under the new --steps ("partial run kept"), and
    a stop between the two rewrites left complete evidence under the new --steps, which
    `rlk compare` calls edited (found by a breaker)."""
    from rlkernel.runner import evidence, loop
    from rlkernel.termination import Terminated

    d = tmp_path / "run"
    shutil.copytree(uninterrupted, d)
    before = _snapshot(d)

    def stop(*args, **kwargs):
        raise Terminated(143)
    real, writes = evidence.write_json_atomic, []

    def second_write_stops(path, obj):   # the evidence is rewritten, then the signal
        writes.append(os.path.basename(path))
        if len(writes) == 2:
            stop()
        real(path, obj)
    if where == "loop":
        monkeypatch.setattr(loop, "run_loop", stop)
    else:
        monkeypatch.setattr(evidence, "write_json_atomic", second_write_stops)
    capsys.readouterr()
    assert main(["run", "--resume", str(d), "--steps", "5", "--allow-dirty"]) == 143
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (f"rlk run: interrupted before the resume's first step; {d} is left as "
                       "it was") and "Traceback" not in "".join(err), err
    assert _snapshot(d) == before
    assert where == "loop" or writes == ["evidence.json", "manifest.json"], writes
    monkeypatch.undo()
    _identical(capsys, uninterrupted, d)


def test_ctrl_c_prints_one_line_whose_resume_command_works(tmp_path, capsys, uninterrupted):
    """SIGINT to the `rlk run` process group after step 1's checkpoint: exit 130, stderr has no traceback and
    ends with one line "... resume with: rlk run --resume D"; running that command gives a run
    IDENTICAL to the uninterrupted one."""
    d = tmp_path / "run"
    proc, err = _signal_after_first_checkpoint(d, signal.SIGINT)
    assert proc.returncode == 130 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rlk run: interrupted (Ctrl-C) after ")
    assert last.endswith(f"; partial run kept in {d}; resume with: rlk run --resume {d}")
    assert main(["run", "--resume", str(d), "--allow-dirty"]) == 0
    _identical(capsys, uninterrupted, d)


def test_sighup_publishes_the_partial_run_as_sigterm_does(tmp_path, uninterrupted, capsys):
    """SIGHUP (a closed terminal) after step 1's checkpoint: exit 129, the run published under
    its name with "terminated after" and a resume hint, no RUN.tmp-PID or RUN.lock left beside
    it (they were, silently); resuming gives the uninterrupted run's evidence."""
    d = tmp_path / "run"
    proc, err = _signal_after_first_checkpoint(d, signal.SIGHUP)
    assert proc.returncode == 129 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rlk run: terminated after ") and f"resume with: rlk run --resume {d}" in last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert main(["run", "--resume", str(d), "--allow-dirty"]) == 0
    _identical(capsys, uninterrupted, d)


# ---------------------------------------------------------------------------------------------
# what a resume replaces (checkpoints/step-*, final/) is checked before any work


def _rlk_process(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`rlk ARGV` in a process of its own, killed after `timeout` s with the test failed: a run
    blocked in the open of a FIFO while it holds its signals is stopped only by SIGKILL."""
    try:
        return subprocess.run([sys.executable, "-m", "rlkernel.cli", *argv], timeout=timeout,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail(f"rlk {' '.join(argv)} hung for {timeout} s")


def _snapshot(d) -> dict[str, object]:
    """Every entry under `d` by relative path: a regular file's bytes, else its file type (a FIFO
    is never opened)."""
    out: dict[str, object] = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = os.path.join(root, name)
            mode = os.lstat(p).st_mode
            out[os.path.relpath(p, d)] = (open(p, "rb").read() if stat.S_ISREG(mode)
                                          else stat.S_IFMT(mode))
    return out


def _put(p, kind: str) -> None:
    """A `kind` entry at `p`, which is free."""
    if kind == "FIFO":
        os.mkfifo(p)
    elif kind == "file":
        p.write_text("not a checkpoint\n")
    elif kind == "link to a directory":
        p.symlink_to(p.parent)
    elif kind == "link to nowhere":
        p.symlink_to("/nonexistent/x")
    else:   # a link to itself: a loop
        p.symlink_to(p.name)


@pytest.mark.parametrize("name, kind, what", [
    ("checkpoints/step-000003", "FIFO", "a FIFO (named pipe)"),
    ("checkpoints/step-000003", "file", "a regular file"),
    ("checkpoints/step-000003", "link to a directory", "a symbolic link"),
    ("final", "FIFO", "a FIFO (named pipe)"),
    ("final", "link to nowhere", "a symbolic link"),
    ("final", "loop", "a symbolic link"),
])
def test_resume_refuses_a_non_directory_it_would_replace_before_any_work(tmp_path,
                                                                        uninterrupted, name,
                                                                        kind, what):
    """A checkpoint directory the resume rewrites, or final/, replaced by a FIFO, file or link:
    exit 2 with one line naming it, the run byte-identical. The resume computed the step first,
    then hung in rmtree's open of the FIFO with its signals held (SIGTERM could not stop it),
    or failed with a bare errno (exit 1) after the work."""
    d = tmp_path / "run"
    shutil.copytree(uninterrupted, d)
    shutil.rmtree(d / name)
    if name == "final":   # step 3 is re-run, so checkpoints/step-000003 is rewritten too
        shutil.rmtree(d / "checkpoints" / "step-000003")
    _put(d / name, kind)
    before = _snapshot(d)
    p = _rlk_process("run", "--resume", str(d), "--steps", "4", "--allow-dirty")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"rlk run: error: --resume '{d}': {d / name} is {what}, not a directory; the run "
        f"replaces it with {'its final weights' if name == 'final' else 'a checkpoint'}: move "
        "it away"], p.stderr
    assert _snapshot(d) == before


def test_resume_removes_stale_checkpoint_temporaries_of_any_kind(tmp_path, uninterrupted):
    """checkpoints/step-*.tmp-* entries (a killed run's half-written checkpoint) that are a FIFO
    or a file are unlinked, not opened (rmtree of the FIFO hung, signals held); a file whose
    name is no checkpoint's is left alone; the resume finishes with the uninterrupted run's
    weights."""
    d = tmp_path / "run"
    shutil.copytree(uninterrupted, d)
    shutil.rmtree(d / "checkpoints" / "step-000003")
    os.mkfifo(d / "checkpoints" / "step-000009.tmp-1")
    (d / "checkpoints" / "step-000008.tmp-2").write_text("x")
    (d / "checkpoints" / "step-notes.txt").write_text("not the run's: left alone")
    p = _rlk_process("run", "--resume", str(d), "--allow-dirty")
    assert p.returncode == 0, p.stderr
    assert sorted(q.name for q in (d / "checkpoints").iterdir()) == [
        "step-000001", "step-000002", "step-000003", "step-notes.txt"]
    for f in ("model.safetensors", "rlk_weights.json"):
        assert (d / "final" / f).read_bytes() == (uninterrupted / "final" / f).read_bytes()


def test_resume_reads_only_checkpoints_named_by_their_step(tmp_path, capsys, uninterrupted):
    """A copy checkpoints/step-000002.bak (a user's backup) is not the run's checkpoint: the
    resume takes step-000002 and finishes with the uninterrupted run's weights (it read the
    .bak, the newest name by string order, and refused it: 'its name at step 000002.bak')."""
    d = tmp_path / "run"
    shutil.copytree(uninterrupted, d)
    shutil.rmtree(d / "checkpoints" / "step-000003")
    shutil.copytree(d / "checkpoints" / "step-000002", d / "checkpoints" / "step-000002.bak")
    assert main(["run", "--resume", str(d), "--allow-dirty"]) == 0, capsys.readouterr().err
    for f in ("model.safetensors", "rlk_weights.json"):
        assert (d / "final" / f).read_bytes() == (uninterrupted / "final" / f).read_bytes()


def test_writing_a_checkpoint_or_final_never_opens_a_fifo(tmp_path):
    """The writers themselves (a FIFO swapped in during a run): save_checkpoint refuses a
    non-directory where its checkpoint goes, in one line; save_final_weights replaces whatever
    final/ is (a FIFO, a link to nowhere) by rename and unlinks it. In a process of its own:
    rmtree blocked in the FIFO's open for good."""
    script = """
import os, pathlib, sys
from rlkernel.model.checkpoint import init_weights
from rlkernel.model.config import tiny
from rlkernel.runner.checkpointing import save_checkpoint
from rlkernel.runner.export import save_final_weights
d = pathlib.Path(sys.argv[1])
os.makedirs(d / "checkpoints")
os.mkfifo(d / "checkpoints" / "step-000001")
try:
    save_checkpoint(d, 1, 1, {"x": init_weights(tiny(), 0)["model.norm.weight"]}, "v",
                    settings={}, inputs=None)
except NotADirectoryError as e:
    print(e)
for kind in ("fifo", "nowhere"):
    os.mkfifo(d / "final") if kind == "fifo" else (d / "final").symlink_to("/nonexistent/x")
    save_final_weights(d, tiny(), init_weights(tiny(), 0), step=0, version="v")
    assert (d / "final" / "rlk_weights.json").is_file()
    assert sorted(p.name for p in d.iterdir()) == ["checkpoints", "final"], list(d.iterdir())
    import shutil; shutil.rmtree(d / "final")
print("ok")
"""
    ck = tmp_path / "checkpoints" / "step-000001"
    try:
        p = subprocess.run([sys.executable, "-c", script, str(tmp_path)], timeout=120,
                           capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail("a checkpoint or final/ writer hung on a FIFO")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        f"cannot write checkpoint {ck}: {ck} is a FIFO (named pipe), not a directory; move it "
        "away", "ok"], p.stdout


@pytest.mark.parametrize("name", ["metrics.jsonl", "completions.jsonl"])
@pytest.mark.parametrize("kind", ["link to nowhere", "loop"])
def test_resume_refuses_a_metrics_file_it_cannot_rewrite(tmp_path, capsys, uninterrupted, name,
                                                         kind):
    """metrics.jsonl or completions.jsonl as a symbolic link to nowhere or a loop (exists()
    calls both absent): exit 2 with one line naming the file, the run byte-identical; the
    resume computed a step, then failed rewriting it (exit 1, ENOENT)."""
    d = tmp_path / "run"
    shutil.copytree(uninterrupted, d)
    (d / name).unlink()
    _put(d / name, kind)
    before = _snapshot(d)
    capsys.readouterr()
    assert main(["run", "--resume", str(d), "--steps", "4", "--allow-dirty"]) == 2
    why = ("a symbolic link to '/nonexistent/x', which does not exist"
           if kind == "link to nowhere" else "Too many levels of symbolic links")
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rlk run: error: --resume '{d}': {d / name} cannot be read ({why}); the resume rewrites it: restore it, "
        "or move it away"]
    assert _snapshot(d) == before


@pytest.mark.parametrize("kind", ["FIFO", "link to nowhere"])
def test_resume_refuses_an_unreadable_model_file_before_rewriting_the_run(tmp_path, capsys,
                                                                          kind):
    """A FIFO or a link to nowhere as the model's model.safetensors.index.json (not an input of
    the run, which had one weights file): exit 2 naming it, the finished run byte-identical. The
    inputs' listing skipped what is_file() refused, so the resume started, rewrote its evidence
    as unfinished (complete=false) and failed in the loader, exit 1."""
    d, model, _ = _run_with_inputs(tmp_path)
    index = model / "model.safetensors.index.json"
    fifo_in_place_of(index) if kind == "FIFO" else index.symlink_to("/nonexistent/x")
    before = _snapshot(d)
    capsys.readouterr()
    assert main(["run", "--resume", str(d), "--steps", "2", "--allow-dirty"]) == 2
    why = ("not a regular file but a FIFO (named pipe)" if kind == "FIFO"
           else "a symbolic link to '/nonexistent/x', which does not exist")
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rlk run: error: --model '{model}': cannot read {index} ({why}); inputs are hashed "
        "into the manifest"]
    assert _snapshot(d) == before


def test_a_resume_budget_too_small_names_only_the_budget(tmp_path, capsys):
    """A run with --max-prompt-len 4100 --micro-batch-tokens 5000 on a model of 8,192
    positions, resumed with --micro-batch-tokens 4096 (its default value): exit 2, one line
    naming --micro-batch-tokens and the run's lengths, which a resume keeps (the fit check's
    own message asked for --max-prompt-len 4032, which the resume then refused; found by a
    breaker); following it (--micro-batch-tokens 4116) resumes, exit 0."""
    model = tmp_path / "model"
    assert main(["init-model", "--preset", "tiny", "--seed", "1", "--out", str(model)]) == 0
    conf = json.loads((model / "config.json").read_text())
    conf["max_position_embeddings"] = 8192
    (model / "config.json").write_text(json.dumps(conf))
    d = tmp_path / "run"
    assert main(["run", *with_flags(ARGS, "--steps", "1"), "--model", str(model),
                 "--max-prompt-len", "4100", "--micro-batch-tokens", "5000",
                 "--run-dir", str(d)]) == 0
    capsys.readouterr()
    assert main(["run", "--resume", str(d), "--steps", "2", "--micro-batch-tokens", "4096",
                 "--allow-dirty"]) == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert line == ("rlk run: error: --micro-batch-tokens 4096: must be >= 4116, the run's "
                    "--max-prompt-len 4100 + --max-response-len 16, which a resume keeps (one "
                    "whole sample must fit in one microbatch)"), line
    assert main(["run", "--resume", str(d), "--steps", "2", "--micro-batch-tokens", "4116",
                 "--allow-dirty"]) == 0


def test_a_manifest_nested_too_deep_is_refused_by_resume_not_a_traceback(tmp_path, capsys):
    """A finished run whose manifest.json's "git" value is a list nested 900 deep (valid JSON,
    under the parser's limit) resumed with more --steps: exit 2, one line saying the run has no
    readable manifest.json, nothing rewritten. Was a RecursionError traceback, exit 1, once the
    depth check was left to rlk compare alone (re-serialising the manifest recurses; found by a
    breaker)."""
    d = tmp_path / "run"
    assert main(["run", *with_flags(ARGS, "--steps", "1"), "--run-dir", str(d)]) == 0
    manifest = json.loads((d / "manifest.json").read_text())
    deep = [0]
    for _ in range(899):
        deep = [deep]
    manifest["git"] = deep
    (d / "manifest.json").write_text(json.dumps(manifest))
    before = _snapshot(d)
    capsys.readouterr()
    assert main(["run", "--resume", str(d), "--steps", "2", "--allow-dirty"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and err[0].endswith(
        "manifest.json is not valid JSON (nested too deeply (more than 64 levels)); "
        "give a run directory written by rlk run"), err
    assert _snapshot(d) == before


@pytest.mark.parametrize("name", ["manifest.json", "evidence.json"])
def test_a_key_given_twice_is_refused_by_resume_not_resolved_to_its_last_value(
        tmp_path, capsys, name):
    """A finished 1-step run whose manifest.json (or evidence.json) gives a key twice in one
    object, resumed with more --steps: exit 2, one line naming the file and the key, nothing
    rewritten. json kept the last value silently, so a forged value placed after the real one
    resumed the run under it (rlk compare already refused such a file)."""
    d = tmp_path / "run"
    assert main(["run", *with_flags(ARGS, "--steps", "1"), "--run-dir", str(d)]) == 0
    text = (d / name).read_text()
    head = '"config": {' if name == "manifest.json" else '"steps": ['
    assert text.count(head) == 1
    text = text.replace(head, head + '"seed": 7, ') if name == "manifest.json" else \
        text.replace(head, '"complete": false, ' + head)
    (d / name).write_text(text)
    # the control: the stock parser takes the file, keeping one of the two values
    assert isinstance(json.loads(text), dict)
    before = _snapshot(d)
    capsys.readouterr()
    assert main(["run", "--resume", str(d), "--steps", "2", "--allow-dirty"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    key = "seed" if name == "manifest.json" else "complete"
    assert len(err) == 1 and name in err[0] and f'duplicate key "{key}"' in err[0], err
    assert "line 1" not in err[0], err   # the hook knows no place: none is claimed
    assert _snapshot(d) == before


def test_a_resume_that_meets_a_too_long_prompt_leaves_the_run_as_it_was(tmp_path, capsys):
    """A finished 1-step run (--max-prompt-len 8) extended by a resume to 2 steps whose second
    step takes a prompts-file line longer than that: exit 2 (a bad input, as at a run's start),
    one line naming the line, the --max-prompt-len a new run needs and saying the run is left
    as it was; every file of the run is
    byte-identical to before (it had rewritten manifest.json with the extended --steps, cut
    the evidence to complete: false and could then be neither resumed nor put back), and the
    run still compares IDENTICAL with a copy taken before."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+3=", "label": "5"}\n'
                       + json.dumps({"prompt": "9" * 40, "label": "1"}) + "\n")
    d, copy = tmp_path / "run", tmp_path / "copy"
    assert main(["run", *with_flags(ARGS, "--steps", "1"), "--prompts", str(prompts),
                 "--max-prompt-len", "8", "--run-dir", str(d)]) == 0
    shutil.copytree(d, copy)
    before = _snapshot(d)
    capsys.readouterr()
    assert main(["run", "--resume", str(d), "--steps", "2", "--allow-dirty"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and f"--prompts {prompts}:3: prompt has" in err[0], err
    assert f"{d} is left as it was" in err[0], err
    # the hint is for a new run: a resume refuses --max-prompt-len (found by a breaker: "give
    # --max-prompt-len 40 or more" was then refused as a flag a resume cannot change)
    assert ": a new run needs --max-prompt-len 40 or more" in err[0], err
    assert "give --max-prompt-len" not in err[0], err
    assert _snapshot(d) == before
    assert json.loads((d / "evidence.json").read_text())["complete"] is True
    _identical(capsys, copy, d)


def test_the_typed_value_given_again_elsewhere_names_what_is_there(tmp_path, capsys,
                                                                   monkeypatch):
    """A run started in WD with --prompts pr.jsonl --model m, resumed from WD/sub with the same
    typed values: where sub/pr.jsonl (or sub/m) is another file with other contents, the flag
    names that file, not the run's, and is refused (exit 2, naming it; it was accepted as the
    same string and the run read WD's file); where nothing of that name is in sub/, the typed
    value is the run's own (exit 0)."""
    wd = tmp_path / "wd"
    inputs = _relative_inputs(wd)
    monkeypatch.chdir(wd)
    assert main(["run", *with_flags(ARGS, "--steps", "1", "--save-every", "1"), *inputs,
                 "--run-dir", "run"]) == 0
    (wd / "sub").mkdir()
    (wd / "sub" / "pr.jsonl").write_text('{"prompt": "7+7=", "label": "14"}\n')
    shutil.copytree(wd / "m", wd / "sub" / "m")
    monkeypatch.chdir(wd / "sub")
    capsys.readouterr()
    for flag, value in (("--prompts", "pr.jsonl"), ("--model", "m")):
        assert main(["run", "--resume", "../run", "--steps", "2", "--allow-dirty",
                     flag, value]) == 2
        err = capsys.readouterr().err
        assert (f"{flag} {value!r} (saved {value!r}, but here it names another input than the "
                "run's) cannot change") in err, err
    (wd / "sub" / "pr.jsonl").unlink()
    assert main(["run", "--resume", "../run", "--steps", "2", "--allow-dirty",
                 "--prompts", "pr.jsonl"]) == 0, capsys.readouterr().err
