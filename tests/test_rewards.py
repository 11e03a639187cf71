"""User reward functions (rlkernel/data/rewards.py, `rlk run --reward`).

Properties:
  - load_reward("file.py:f") / ("module:f") == that function, described with the SHA-256 of its
    defining file (== hashlib over the file's bytes); a bad spec is a RewardError naming it.
  - score() returns the float; a raise, a bool, a non-number, a non-finite number or one beyond
    +-REWARD_LIMIT is a RewardError naming the function, the sample id and the value.
  - In a run: the manifest records the hash; the function is called on rank 0 only (a TP2 run's
    calls all come from one process, once per sample per step), so every rank holds rank 0's
    rewards; a failing reward stops the run with one line; a bad --reward is exit 2 before any
    work; a resumed run refuses a changed reward source.
Run: `.venv/bin/python -m pytest -q tests/test_rewards.py`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rlkernel.cli import main
from rlkernel.data.rewards import BUILTIN, REWARD_LIMIT, RewardError, load_reward

SMALL = ["--n-prompts", "2", "--n-samples-per-prompt", "2", "--max-response-len", "8",
         "--allow-dirty"]

REWARDS = textwrap.dedent('''
    import math
    import os

    CALLS = os.environ.get("RLK_TEST_REWARD_LOG")
    LIMIT = 3

    def length(prompt, completion, label):
        """Reward = completion length / 10; logs the calling process id and the prompt."""
        if CALLS:
            with open(CALLS, "a") as f:
                f.write(f"{os.getpid()} {prompt!r}\\n")
        return len(completion) / 10

    def boom(prompt, completion, label):
        raise KeyError("no such rubric")

    def quits(prompt, completion, label):
        import sys
        sys.exit(0)

    def raises_generator_exit(prompt, completion, label):
        raise GeneratorExit("odd")

    def raises_keyboard_interrupt(prompt, completion, label):
        raise KeyboardInterrupt("from the rubric")

    def nan(prompt, completion, label):
        return math.nan

    def huge(prompt, completion, label):
        return 1e300

    SEEN = []

    def at_the_limit_then_huge(prompt, completion, label):
        """+-1e100 (REWARD_LIMIT) for a step's first 4 samples, then 1e300."""
        SEEN.append(completion)
        return 1e300 if len(SEEN) > 4 else (-1e100, 1e100)[len(SEEN) % 2]

    def text(prompt, completion, label):
        return "1.0"

    def flag(prompt, completion, label):
        return True

    def two(prompt, completion):
        return 0.0

    class _NoFloat(float):
        def __float__(self):
            raise RuntimeError("no float today")

    def unconvertible(prompt, completion, label):
        return _NoFloat(0.5)

    def very_big(prompt, completion, label):
        return 10**400

    def very_big_beyond_repr(prompt, completion, label):
        return 10**5000

    def very_long_error(prompt, completion, label):
        raise ValueError("x" * 10000)

    STEP_1 = []

    def sleeps_in_step_1(prompt, completion, label):
        """0.0 for a step's 4 samples; then writes the file $RLK_TEST_MARK and sleeps."""
        STEP_1.append(completion)
        if len(STEP_1) > 4:
            import pathlib, time
            pathlib.Path(os.environ["RLK_TEST_MARK"]).write_text("sleeping")
            time.sleep(600)
        return 0.0

    class Judge:
        def __call__(self, prompt, completion, label):
            return 0.5

    judge = Judge()
''')


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def test_load_from_file_and_module_records_the_source_hash(rewards_file, monkeypatch):
    """file.py:f and module:f load the same function; source_sha256 == sha256(file bytes)."""
    want = hashlib.sha256(rewards_file.read_bytes()).hexdigest()
    r = load_reward(f"{rewards_file}:length")
    assert r.score("p", "abcd", "l", 0) == 0.4
    assert r.describe() == {"spec": f"{rewards_file}:length",
                            "function": f"{rewards_file}:length",
                            "source_file": str(rewards_file), "source_sha256": want}
    monkeypatch.syspath_prepend(str(rewards_file.parent))
    m = load_reward("my_rewards:judge")
    assert m.score("p", "c", "l", 0) == 0.5 and m.source_sha256 == want
    builtin = load_reward(None)
    assert builtin.name == BUILTIN and builtin.score("Compute 1+1=", " 2", "2", 0) == 1.0
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize("spec,words", [
    ("{f}:two", "cannot be called as two(prompt, completion, label)"),
    ("{f}:missing", "has no attribute 'missing'; callables there: Judge, at_the_limit_then_huge, "
                    "boom, flag, huge"),
    ("{d}/nope.py:f", "no such file"),
    ("{d}/nope:f", "no such file"),          # an absolute path names a file, .py or not
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("math:floor", "cannot be called as"),
    ("{f}:CALLS", "'CALLS' is None, not callable; give a function called as "
                  "CALLS(prompt, completion, label) -> float"),      # said "is a NoneType"
    ("{f}:LIMIT", "'LIMIT' is of type int, not callable"),     # said "is a int"
    ("{f}:Judge.nope.deeper", "'Judge' has no attribute 'nope'"),   # named the whole path
    # each said "no such file":
    ("{d}/pkg.py:f", "'{d}/pkg.py': is a directory, not a file; give an existing .py file"),
    ("{d}/pipe.py:f", "'{d}/pipe.py': is a FIFO (named pipe), not a regular file; give an "),
    ("{d}/dangling.py:f", "'{d}/dangling.py': is a symbolic link to '{d}/gone.py', which does "
                          "not exist; give an existing"),
    # it said "a symbolic link to 'loop.py', which does not exist" of a link to itself
    ("{d}/loop.py:f", "'{d}/loop.py': is a symbolic link that cannot be followed (Too many "
                      "levels of symbolic links); give an existing"),
    ("{d}/rubric.txt:f", "must be a .py file: path/to/file.py:FUNC"),   # an existing non-.py file
])
def test_bad_spec_is_a_reward_error_naming_it(rewards_file, spec, words):
    (rewards_file.parent / "rubric.txt").write_text("def f(p, c, l):\n    return 0.0\n")
    (rewards_file.parent / "pkg.py").mkdir()
    os.mkfifo(rewards_file.parent / "pipe.py")
    (rewards_file.parent / "dangling.py").symlink_to(rewards_file.parent / "gone.py")
    (rewards_file.parent / "loop.py").symlink_to(rewards_file.parent / "loop.py")
    spec = spec.format(f=rewards_file, d=rewards_file.parent)
    words = words.format(d=rewards_file.parent)
    with pytest.raises(RewardError) as e:
        load_reward(spec)
    assert f"--reward {spec!r}" in str(e.value) and words in str(e.value)


@pytest.mark.parametrize("func,words", [
    ("boom", "raised KeyError: 'no such rubric' on sample 7"),
    ("nan", "returned nan for sample 7; allowed: a finite int or float"),
    ("huge", "returned 1e+300 for sample 7; allowed: a finite int or float in [-1e+100, 1e+100] "
             "(the step's reward statistics are float64 and would overflow); scale the reward "
             "down"),
    ("text", "returned '1.0' (str) for sample 7; allowed: a finite int or float"),
    ("flag", "returned True (bool) for sample 7"),
    ("quits", "raised SystemExit: 0 on sample 7"),    # sys.exit(0) is a failure, not an exit
    ("raises_generator_exit", "raised GeneratorExit: odd on sample 7"),
    # A long value or error is cut (10**400 printed 401 digits); one whose text cannot be made
    # (past Python's int digit limit) is named by its type (the message itself raised).
    ("very_big", f"returned {'1' + '0' * 59}... (401 characters) for sample 7; allowed: "),
    ("very_big_beyond_repr", "returned <int: repr() failed> for sample 7; allowed: "),
    ("very_long_error", f"raised ValueError: {'x' * 60}... (10000 characters) on sample 7 "),
    ("unconvertible", "returned 0.5 (_NoFloat) for sample 7, which float() cannot convert "
                      "(RuntimeError: no float today); allowed: a finite int or float"),
])
def test_bad_value_names_function_sample_and_value(rewards_file, func, words):
    r = load_reward(f"{rewards_file}:{func}")
    with pytest.raises(RewardError) as e:
        r.score("p", "c", "l", 7)
    assert str(e.value).startswith(f"reward {rewards_file}:{func} ") and words in str(e.value)


def test_rewards_at_the_limit_are_accepted():
    r = load_reward(None)
    for v in (REWARD_LIMIT, -REWARD_LIMIT):
        at = type(r)(lambda p, c, lab, v=v: v, "x", "x", r.source_file, r.source_sha256)
        assert at.score("p", "c", "l", 0) == v


def test_a_huge_reward_after_a_step_stops_with_one_line_and_whole_files(rewards_file, tmp_path,
                                                                        capsys):
    """Step 0 at +-REWARD_LIMIT runs correctly (finite advantages and metrics); 1e300 at step 1:
    exit 1, one line naming function, sample and value; the run keeps step 0 whole: evidence,
    metrics.jsonl and completions.jsonl agree. metrics.py crashed with an OverflowError
    traceback after step 1's evidence was written (and its group's advantages were 0)."""
    d = tmp_path / "run"
    assert main(["run", *SMALL, "--steps", "2", "--reward",
                 f"{rewards_file}:at_the_limit_then_huge", "--run-dir", str(d)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [ln for ln in err.splitlines() if " error: " in ln] == [
        f"rlk run: error: reward {rewards_file}:at_the_limit_then_huge returned 1e+300 for "
        "sample 4; allowed: a finite int or float in [-1e+100, 1e+100] (the step's reward "
        "statistics are float64 and would overflow); scale the reward down (evidence of 1 "
        f"step(s) kept in {d})"]
    ev = json.loads((d / "evidence.json").read_text())
    assert ev["complete"] is False and [s["rewards"] for s in ev["steps"]] == [
        [1e100, -1e100, 1e100, -1e100]]
    metrics = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["reward_mean"], m["reward_std"]) for m in metrics] == [(0, 0.0, 1e100)]
    rows = [json.loads(ln) for ln in (d / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * 4
    assert all(math.isfinite(r["advantage"]) and abs(r["advantage"]) > 0.5 for r in rows)


def test_numpy_scalars_are_numbers():
    np = pytest.importorskip("numpy")
    r = load_reward(None)
    r2 = type(r)(lambda p, c, lab: np.float32(0.25), "x", "x", r.source_file, r.source_sha256)
    assert r2.score("p", "c", "l", 0) == 0.25 and type(r2.score("p", "c", "l", 0)) is float


def test_run_calls_the_reward_on_rank_0_only_and_records_its_hash(rewards_file, tmp_path,
                                                                 monkeypatch):
    """TP2 run, 2 steps x 4 samples: 8 calls, all from one process (rank 0); the evidence's
    rewards == len(completion)/10 values (multiples of 0.1, at most 0.8); manifest hash ==
    sha256 of the file."""
    log = tmp_path / "calls.txt"
    monkeypatch.setenv("RLK_TEST_REWARD_LOG", str(log))
    d = tmp_path / "run"
    assert main(["run", *SMALL, "--steps", "2", "--tp", "2", "--reward",
                 f"{rewards_file}:length", "--run-dir", str(d)]) == 0
    calls = log.read_text().splitlines()
    assert len(calls) == 8 and len({c.split()[0] for c in calls}) == 1
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["reward"]["source_sha256"] == hashlib.sha256(REWARDS.encode()).hexdigest()
    ev = json.loads((d / "evidence.json").read_text())
    for s in ev["steps"]:
        assert all(0 <= r <= 0.8 and math.isclose(r * 10, round(r * 10)) for r in s["rewards"])


def test_a_failing_reward_stops_the_run_with_one_line(rewards_file, tmp_path, capsys):
    """boom at step 0: exit 1, one line naming function and sample 0, no run directory."""
    d = tmp_path / "run"
    assert main(["run", *SMALL, "--steps", "1", "--reward", f"{rewards_file}:boom",
                 "--run-dir", str(d)]) == 1
    # The start-up lines (model, ranks, ...) come first; the failure is one error line.
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if " error: " in ln]
    assert err == [f"rlk run: error: reward {rewards_file}:boom raised KeyError: 'no such "
                   f"rubric' on sample 0 (completion {err[0].split('(completion ')[1]}"]
    assert not d.exists()


def test_a_reward_that_calls_sys_exit_0_fails_the_run(rewards_file, tmp_path, capsys):
    """sys.exit(0) inside the reward: exit 1 and the reward named, not exit 0 (a run that never
    finished reading as a success) or "interrupted"."""
    d = tmp_path / "run"
    assert main(["run", *SMALL, "--steps", "1", "--reward", f"{rewards_file}:quits",
                 "--run-dir", str(d)]) == 1
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if " error: " in ln]
    assert len(err) == 1 and f"reward {rewards_file}:quits raised SystemExit: 0" in err[0], err
    assert not d.exists()


@pytest.mark.parametrize("spec", ["nocolon", "{f}:two", "{f}:1bad"])
def test_bad_reward_flag_exits_2_before_any_work(rewards_file, tmp_path, capsys, spec):
    spec = spec.format(f=rewards_file)
    d = tmp_path / "run"
    assert main(["run", *SMALL, "--reward", spec, "--run-dir", str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--reward" in err[0] and spec in err[0]
    assert not d.exists()


def test_resume_refuses_a_changed_reward_source(rewards_file, tmp_path, capsys):
    d = tmp_path / "run"
    args = [*SMALL, "--steps", "1", "--save-every", "1", "--reward", f"{rewards_file}:length"]
    assert main(["run", *args, "--run-dir", str(d)]) == 0
    rewards_file.write_text(REWARDS + "\n# edited\n")
    capsys.readouterr()
    assert main(["run", "--resume", str(d), "--steps", "2", "--allow-dirty"]) == 2
    assert "the reward function's source" in capsys.readouterr().err
    assert len(json.loads((d / "evidence.json").read_text())["steps"]) == 1


def test_rank_0s_reward_error_is_raised_relayed_on_the_other_ranks():
    """score_on_rank0: rank 0's RewardError comes back on every rank; on the others it is marked
    relayed from rank 0 (the launcher then names rank 0, where the function ran), on rank 0
    not."""
    from rlkernel.data.rewards import score_on_rank0

    class _Comm:      # a world whose rank 0 sent back the failure message
        def all_gather_object(self, obj, op):
            return ["reward f raised ValueError: boom on sample 0"]

    class _Bad:
        def score(self, *a):
            raise RewardError("reward f raised ValueError: boom on sample 0")
    for rank in (0, 1, 3):
        with pytest.raises(RewardError, match="boom on sample 0") as info:
            score_on_rank0(_Bad(), [("p", "c", "l", 0)], rank, _Comm())
        assert getattr(info.value, "relayed_from", None) == (None if rank == 0 else 0)


def test_a_reward_that_raises_keyboard_interrupt_fails_the_run(rewards_file, tmp_path, capsys):
    """A KeyboardInterrupt the reward raises itself (no Ctrl-C): exit 1 naming the reward, not
    exit 130 "interrupted before the first step" (found by a breaker); at the reward module's
    import likewise. A real Ctrl-C while the reward runs still stops the run: the SIGINT case
    of the signal test below."""
    d = tmp_path / "run"
    assert main(["run", *SMALL, "--steps", "1", "--reward",
                 f"{rewards_file}:raises_keyboard_interrupt", "--run-dir", str(d)]) == 1
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if " error: " in ln]
    assert len(err) == 1, err
    assert (f"reward {rewards_file}:raises_keyboard_interrupt raised KeyboardInterrupt: from "
            "the rubric on sample 0") in err[0]
    assert not d.exists()
    f = tmp_path / "stops.py"
    f.write_text("raise KeyboardInterrupt('at import')\ndef score(p, c, l):\n    return 0.0\n")
    assert main(["run", *SMALL, "--steps", "1", "--reward", f"{f}:score",
                 "--run-dir", str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rlk run: error: --reward '{f}:score': importing '{f}' raised "
                   "KeyboardInterrupt: at import"], err


def test_real_interrupt_tells_a_signal_from_the_code_s_own_keyboard_interrupt():
    """termination.real_interrupt: Terminated and CtrlC (rlk's handlers) are stops; a plain
    KeyboardInterrupt is one only under Python's default SIGINT handler (outside rlk), and the
    code's own where rlk's handler is installed or SIGINT is ignored (a spawned rank)."""
    from rlkernel.cli import _ctrl_c, _exit_on_sigterm, _restore_sigterm
    from rlkernel.termination import CtrlC, Terminated, real_interrupt
    before = signal.getsignal(signal.SIGINT)
    try:
        # rlk installs _ctrl_c over Python's default handler, and gives it back after
        signal.signal(signal.SIGINT, signal.default_int_handler)
        previous = _exit_on_sigterm()
        assert signal.getsignal(signal.SIGINT) is _ctrl_c
        _restore_sigterm(previous)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # an ignored SIGINT stays ignored
        _restore_sigterm(_exit_on_sigterm())
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        for handler, plain in ((signal.default_int_handler, True), (_ctrl_c, False),
                               (signal.SIG_IGN, False)):
            signal.signal(signal.SIGINT, handler)
            assert real_interrupt(KeyboardInterrupt()) is plain
            assert real_interrupt(CtrlC()) and real_interrupt(Terminated(143))
            assert not real_interrupt(SystemExit(0)) and not real_interrupt(ValueError())
        signal.signal(signal.SIGINT, _ctrl_c)
        with pytest.raises(CtrlC):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("sig,code,what", [
    ("SIGTERM", 143, "terminated"),
    ("SIGINT", 130, "interrupted (Ctrl-C)")])
def test_a_signal_while_the_reward_runs_stops_the_run_as_elsewhere(rewards_file, tmp_path, sig,
                                                                   code, what):
    """SIGTERM or Ctrl-C while the reward function runs (step 1, after step 0's checkpoint):
    exit 143 / 130 and the one "terminated / interrupted (Ctrl-C) after 1 step(s); ...; resume
    with: rlk run --resume D" line of that signal elsewhere. The SIGTERM handler's SystemExit
    was caught as the reward's own failure ("reward ... raised SystemExit: 143 on sample 4",
    exit 1, no resume hint); a Ctrl-C must not read as the reward's own KeyboardInterrupt."""
    d, mark = tmp_path / "run", tmp_path / "sleeping"
    # As a terminal delivers Ctrl-C, whatever the runner inherited: a suite started in the
    # background of a shell without job control ignores SIGINT, and rlk keeps it ignored.
    boot = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from rlkernel.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen(
        [sys.executable, "-c", boot, "run", *SMALL, "--steps", "2", "--save-every",
         "1", "--reward", f"{rewards_file}:sleeps_in_step_1", "--run-dir", str(d)],
        env={**os.environ, "RLK_TEST_MARK": str(mark)}, start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not mark.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert mark.exists(), f"the reward never reached step 1 (exit {proc.poll()})"
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=120)
    finally:   # the reward sleeps 10 minutes: never leave it behind
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == code and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (f"rlk run: {what} after 1 step(s); partial run "
                                            f"kept in {d}; resume with: rlk run --resume {d}")


def test_a_reward_that_prints_leaves_stdout_to_the_run_directory(tmp_path, capsys):
    """A reward module that prints at import and on every call: its lines go to stderr, and
    rlk run's stdout stays the one line it promises, the run directory (scripts read it)."""
    f = tmp_path / "chatty.py"
    f.write_text(textwrap.dedent('''
        print("loading the rubric")

        def score(prompt, completion, label):
            print("scoring", len(completion))
            return 0.0
    '''))
    d = tmp_path / "run"
    assert main(["run", *SMALL, "--steps", "1", "--reward", f"{f}:score",
                 "--run-dir", str(d)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{d}\n"
    assert "loading the rubric" in err and err.count("scoring ") == 4, err
