"""`nohup rlk run ...`: a hangup the user asked to ignore must not stop the run.

nohup (and `trap '' HUP`, and daemon launchers) start the program with SIGHUP set to SIG_IGN, so
that closing the terminal or SSH session leaves it running. `rlk run` installs its own SIGHUP
handler at start-up (cli._exit_on_sigterm: "treat SIGHUP like SIGTERM"); it used to do so
without looking at the inherited disposition, so the ignored hangup became SystemExit(129) and
the run stopped after the steps it had (which a run without --save-every cannot resume).
Found by a breaker session (2026-12-05).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from rlkernel.cli import main

ARGS = ["--steps", "3", "--max-response-len", "8", "--n-prompts", "1",
        "--n-samples-per-prompt", "2", "--kl-coef", "0.01", "--allow-dirty"]


def test_exit_on_sigterm_keeps_an_ignored_sighup_ignored():
    """The start-up handler must leave SIGHUP ignored when it was ignored (nohup)."""
    from rlkernel import cli

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        previous = cli._exit_on_sigterm()
        try:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, (
                "rlk run replaced an ignored SIGHUP (nohup) with a handler that stops the run")
        finally:
            cli._restore_sigterm(previous)
    finally:
        signal.signal(signal.SIGHUP, before)


def _ignore_sighup():   # what nohup does before exec
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def test_nohup_run_survives_a_hangup_with_the_uninterrupted_bytes(tmp_path, capsys):
    """`rlk run` started with SIGHUP ignored, SIGHUP to its process group once step 1 is in
    the evidence: it finishes all 3 steps (exit 0) and `rlk compare` with an uninterrupted run
    says IDENTICAL (before the fix: exit 129, "terminated after 1 step(s)", 1 step kept)."""
    d = tmp_path / "hup"
    proc = subprocess.Popen([sys.executable, "-m", "rlkernel.cli", "run", *ARGS, "--run-dir",
                             str(d)], start_new_session=True, preexec_fn=_ignore_sighup,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    sent = False
    while time.time() < deadline and proc.poll() is None:
        for m in d.parent.glob(f"{d.name}*/metrics.jsonl"):
            if m.read_text().count("\n") >= 1:
                proc.send_signal(signal.SIGHUP)
                sent = True
                break
        if sent:
            break
        time.sleep(0.05)
    _, err = proc.communicate(timeout=240)
    assert sent, "the run ended before the hangup could be sent"
    assert proc.returncode == 0, (proc.returncode, err.strip().splitlines()[-1:])
    assert len(json.loads((d / "evidence.json").read_text())["steps"]) == 3

    u = tmp_path / "u"
    assert main(["run", *ARGS, "--run-dir", str(u)]) == 0
    capsys.readouterr()
    assert main(["compare", "--quiet", str(u), str(d)]) == 0, capsys.readouterr().out


# A signal sent to the process itself the moment torch starts importing numpy (in-process, so
# the timing is exact rather than the breaker's ~0.3 s window of a real kill).
_SIGNAL_AT_NUMPY = """
import os, signal, sys
# As a terminal would deliver it, whatever the test runner inherited: a runner started under
# nohup, or in the background of a shell without job control, ignores SIGHUP / SIGINT, and rlk
# keeps an ignored signal ignored (test_exit_on_sigterm_keeps_an_ignored_sighup_ignored): the
# run went on to exit 0 in a CI launched so.
_sig = getattr(signal, sys.argv[1])
signal.signal(_sig, signal.default_int_handler if _sig == signal.SIGINT else signal.SIG_DFL)
class _Finder:
    fired = False
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" and not _Finder.fired:
            _Finder.fired = True
            os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        return None
sys.meta_path.insert(0, _Finder())
from rlkernel import cli
{setup}
sys.exit(cli.main(sys.argv[2:]))
"""


# The control: torch imported without the signals held, and main's check for a lost signal
# off (it would report the swallowed signal after the command: the test below).
_NEITHER_GUARD = "cli._import_torch = lambda: None; cli._lost_signal = lambda p, c, code: code"


@pytest.mark.parametrize("sig,code,last", [
    ("SIGTERM", 143, "rlk run: interrupted before the first step; nothing kept"),
    ("SIGHUP", 129, "rlk run: interrupted before the first step; nothing kept"),
    ("SIGINT", 130, "rlk run: interrupted")])
def test_a_signal_while_torch_imports_numpy_ends_the_run_before_any_work(tmp_path, sig, code,
                                                                         last):
    """SIGTERM, SIGHUP or SIGINT arriving while `rlk run` imports torch (which imports numpy
    inside a try that swallows any exception): exit 128 + signal, one line, no run directory.
    It was swallowed with the handler's exception: the run went on to exit 0, or failed late on
    a half-imported numpy (found by a breaker). Control: the same hook with the signals not
    held during the import (cli._import_torch a no-op) runs to the end, exit 0."""
    d = tmp_path / "run"
    run = ["run", "--steps", "1", *ARGS[2:], "--run-dir", str(d)]

    def rlk(setup: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _SIGNAL_AT_NUMPY.format(setup=setup), sig,
                               *run], capture_output=True, text=True, timeout=300)
    p = rlk("")
    assert p.returncode == code, (p.returncode, p.stderr[-2000:])
    assert p.stderr.strip().splitlines()[-1] == last and "Traceback" not in p.stderr, \
        p.stderr[-2000:]
    assert not list(tmp_path.iterdir())
    control = rlk(_NEITHER_GUARD)
    assert control.returncode == 0 and (d / "evidence.json").is_file(), control.stderr[-2000:]


@pytest.mark.parametrize("argv, last", [
    (["init-model", "--preset", "tiny", "--out", "{out}"], "rlk init-model: terminated"),
    (["export", "{missing}", "--out", "{out}"], "rlk export: terminated"),
    (["run", "--device", "cuda", "--steps", "1", "--allow-dirty", "--run-dir", "{out}"],
     "rlk run: interrupted before the first step; nothing kept")])
def test_a_signal_while_torch_loads_ends_init_model_export_and_a_cuda_run(tmp_path, argv, last):
    """The same signal at numpy's import for init-model, export and `run --device cuda` (whose
    first torch import is the CUDA check, before the data checks): exit 143, one line, nothing
    written — before the CUDA run's "no CUDA device" check on a machine without one. Control:
    init-model with cli._import_torch a no-op runs to the end (the signal swallowed)."""
    out, missing = tmp_path / "out", tmp_path / "not_a_run"
    missing.mkdir()   # passes export's cheap path checks, so torch is imported after them
    argv = [a.format(out=out, missing=missing) for a in argv]

    def rlk(setup: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _SIGNAL_AT_NUMPY.format(setup=setup),
                               "SIGTERM", *argv], capture_output=True, text=True, timeout=300)
    p = rlk("")
    assert p.returncode == 143, (p.returncode, p.stderr[-2000:])
    assert p.stderr.strip().splitlines()[-1] == last and "Traceback" not in p.stderr, p.stderr
    assert not out.exists()
    if argv[0] == "init-model":
        control = rlk(_NEITHER_GUARD)
        assert control.returncode == 0 and (out / "config.json").is_file(), control.stderr


def test_import_torch_holds_the_three_signals_and_restores_the_mask(monkeypatch):
    """Every module `_import_torch` imports is imported with SIGINT, SIGTERM and SIGHUP blocked
    (a signal meanwhile waits for the import to end), and the mask is as before afterwards."""
    import importlib

    from rlkernel import cli

    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    seen = []
    for name in ("numpy", "torch", "safetensors.torch"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(importlib, "import_module",
                        lambda n: seen.append((n, signal.pthread_sigmask(signal.SIG_BLOCK, []))))
    cli._import_torch()
    assert [n for n, _ in seen] == ["numpy", "torch", "safetensors.torch"], seen
    assert all(held <= mask for _, mask in seen), seen
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


def test_a_signal_whose_exception_is_lost_still_ends_the_command_with_its_code(
        tmp_path, capsys, monkeypatch):
    """SIGTERM whose Terminated is swallowed inside the command (as a garbage-collection
    callback or a library's catch-all does: `rlk report` exited 0 after "Exception ignored ...
    Terminated: 143"; found by a breaker): the command finishes, then exits 143 with one line.
    Control: the same command without the signal exits 0 (a signal the command handles keeps
    its own code and line: the tests above)."""
    import os

    from rlkernel.runner import report

    run = tmp_path / "r"
    assert main(["run", "--steps", "1", *ARGS[2:], "--run-dir", str(run)]) == 0
    real = report.write_report

    def swallowing(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)   # the handler runs here and its exception is caught below
        except BaseException:
            pass
        return real(*args, **kwargs)
    capsys.readouterr()
    assert main(["report", str(run), "--out", str(tmp_path / "p0")]) == 0
    monkeypatch.setattr(report, "write_report", swallowing)
    assert main(["report", str(run), "--out", str(tmp_path / "p1")]) == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "rlk report: terminated (the signal arrived while it finished its work)"
