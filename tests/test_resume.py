"""Checkpoint and resume are bitwise: a run killed anywhere and resumed == the uninterrupted run.

Chain: uninterrupted run U (3 steps, --save-every 1); run K killed with SIGKILL at a random point
(while a step, or a checkpoint write, is in flight) then `rlk run --resume K` → `rlk compare U K`
is IDENTICAL (every step's grad norm, tokens, tensor hashes) and the final weights hash the same.
Resuming onto another topology (saved at TP2/CP2, resumed at TP1/CP4 and TP4/CP1) gives the same
bytes too. A half-written or corrupted checkpoint is never loaded; the last complete one is.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

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
    `kill_after_steps` steps are in the evidence."""
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
    # The CLI publishes the run dir only at the end; a killed run is resumed from where it lies.
    if not d.exists():
        (tmp,) = list(d.parent.glob(f"{d.name}.tmp-*"))
        tmp.rename(d)


@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_then_resume_is_identical(tmp_path, capsys, uninterrupted, seed):
    """killed at a random point of step 1 or 2, resumed: evidence and weights == uninterrupted."""
    d = tmp_path / "run"
    _killed_run(d, kill_after_steps=1 + seed, seed=seed)
    if len(_steps(d)) == 3 and json.loads((d / "evidence.json").read_text())["complete"]:
        pytest.skip("the run finished before the kill landed")
    assert main(["run", "--resume", str(d), "--allow-dirty"]) == 0
    _identical(capsys, uninterrupted, d)


def test_resume_onto_other_topologies(tmp_path, capsys, uninterrupted):
    """saved at TP2/CP2 after step 1, resumed at TP1/CP4 and at TP4/CP1: == uninterrupted."""
    base = tmp_path / "tp2cp2"
    assert main(["run", *ARGS, "--steps", "1", "--tp", "2", "--cp", "2",
                 "--run-dir", str(base)]) == 0
    for extra in (["--tp", "1", "--cp", "4"], ["--tp", "4", "--cp", "1"]):
        d = tmp_path / ("r" + "".join(extra).replace("-", ""))
        shutil.copytree(base, d)
        assert main(["run", "--resume", str(d), "--steps", "3", "--allow-dirty", *extra]) == 0
        _identical(capsys, uninterrupted, d)


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
    assert latest_checkpoint(d).next_step == 1
    assert main(["run", "--resume", str(d), "--allow-dirty"]) == 0
    _identical(capsys, uninterrupted, d)


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
    assert [ln.split("  ")[0] for ln in err[1:]] == ["step 2/3", "step 3/3"]
    for f in ("model.safetensors", "rlk_weights.json"):
        assert (d / "final" / f).read_bytes() == (uninterrupted / "final" / f).read_bytes()
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == []  # no staging left


def test_ctrl_c_prints_one_line_whose_resume_command_works(tmp_path, capsys, uninterrupted):
    """SIGINT to the `rlk run` process group after step 1's checkpoint: exit 130, stderr has no traceback and
    ends with one line "... resume with: rlk run --resume D"; running that command gives a run
    IDENTICAL to the uninterrupted one."""
    d = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rlkernel.cli", "run", *ARGS, "--run-dir",
                             str(d)], start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if any((p / "checkpoints" / "step-000001").is_dir() for p in d.parent.glob(f"{d.name}*")):
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the run finished before Ctrl-C landed")
    assert proc.returncode == 130 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rlk run: interrupted (Ctrl-C) after ")
    assert last.endswith(f"; partial run kept in {d}; resume with: rlk run --resume {d}")
    assert main(["run", "--resume", str(d), "--allow-dirty"]) == 0
    _identical(capsys, uninterrupted, d)
