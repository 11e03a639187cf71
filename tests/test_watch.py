"""A run that can be watched (issue 13 item 3): start-up lines, progress inside a step, per-step
metrics.jsonl / completions.jsonl / TensorBoard, warnings, the summary, and `rlk report` plots.

Properties checked:
  - metrics rows are a pure function of the evidence record (so `rlk report` can draw old runs);
  - the JSON-lines files only ever hold whole lines: appends are whole lines, a torn last line
    (crash inside a write) is dropped by readers and by a resume, which keeps steps < its start;
  - a real run writes one metrics line per step and one completion line per sample whose
    rewards equal the evidence's, prints start-up lines and a summary around the step lines,
    warns once when every advantage is 0 and nothing else drives the gradient;
  - with several ranks only rank 0 writes (tests/test_ppo.py's CP2 run has one line per step);
  - on a terminal the phases (rollout, train update k/n, sync) are shown;
  - `rlk report` writes readable PNGs for one or several runs, from metrics.jsonl or from
    evidence.json alone, and refuses an unreadable run with one line, exit 2.

Run: `.venv/bin/python -m pytest -q tests/test_watch.py`.
"""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
import types

import pytest

from rlkernel.cli import main
from rlkernel.config import RunConfig
from rlkernel.runner.metrics import (MetricsSink, append_jsonl, metrics_row, read_jsonl,
                                     truncate_jsonl)
from rlkernel.runner.report import write_report
from rlkernel.runner.watch import RunWatch, config_warnings, display_run_dir, summary_lines

SMALL = ["--n-prompts", "2", "--n-samples-per-prompt", "2", "--max-response-len", "8",
         "--allow-dirty"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rec(step: int, **extra) -> dict:
    rec = {"step": step, "rewards": [1.0, 0.0, 0.0, 1.0], "reward_mean": 0.5,
           "n_samples": 4, "n_response_tokens": 40, "loss": 0.25, "pg_loss": 0.125, "kl": 0.01,
           "entropy": 5.5, "clip_frac": 0.0, "grad_norm": 0.75, "lr": 1e-5,
           "logprob_mismatches": 0, "logprob_tokens": 40, "update_skipped": False,
           "version_changed": True,
           "timings": {"rollout_s": 2.0, "reward_s": 0.25, "train_s": 1.5, "export_audit_s": 0.5,
                       "step_s": 4.0},
           "resources": {"peak_gpu_mem_gib": None}}
    rec.update(extra)
    return rec


# ---------------------------------------------------------------------------------------------
# metrics rows and JSON lines


def test_metrics_row_is_derived_from_the_evidence_record():
    row = metrics_row(_rec(3, updates=[{"grad_norm": 0.75}, {"grad_norm": 0.5}]))
    assert row["step"] == 3 and row["reward_mean"] == 0.5
    assert row["reward_std"] == 0.5  # population std of [1, 0, 0, 1]
    assert row["response_len_mean"] == 10.0
    assert row["tokens_per_s"] == 10.0 and row["rollout_tokens_per_s"] == 20.0
    assert (row["rollout_s"], row["reward_s"], row["train_s"], row["sync_s"], row["step_s"]) == \
        (2.0, 0.25, 1.5, 0.5, 4.0)
    assert row["grad_norms"] == [0.75, 0.5]
    assert "peak_gpu_mem_gib" not in row  # None on CPU: left out
    # evidence.json's strings for non-finite floats are read back as floats
    assert math.isnan(metrics_row(_rec(0, loss="nan"))["loss"])
    assert "grad_norms" not in metrics_row(_rec(0))


def test_metrics_row_of_huge_finite_rewards_is_finite_and_scaled_exactly():
    """Rewards past ~1e154 made (r - mean) ** 2 overflow (rlk report crashed); they are computed
    scaled by a power of two, so mean and std are the small values' scaled by that power exactly.
    Control: the plain formula does overflow on them."""
    small = [1.0, 0.0, 0.0, 1.0]
    big = [math.ldexp(r, 1000) for r in small]
    with pytest.raises(OverflowError):
        sum((r - 0.5 * 2.0 ** 1000) ** 2 for r in big)
    row = metrics_row(_rec(0, rewards=big))
    assert (row["reward_mean"], row["reward_std"]) == (math.ldexp(0.5, 1000),
                                                       math.ldexp(0.5, 1000))
    top = metrics_row(_rec(0, rewards=[1.7e308, -1.7e308]))
    assert top["reward_mean"] == 0.0 and top["reward_std"] == 1.7e308
    assert math.isinf(metrics_row(_rec(0, rewards=[math.inf, 1.0]))["reward_mean"])


def test_jsonl_whole_lines_torn_tail_dropped_and_resume_truncation(tmp_path):
    """append: whole lines; read: a last line without newline is dropped; truncate(k): steps < k."""
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, [{"step": 0, "x": math.inf}, {"step": 1}])
    append_jsonl(path, [{"step": 2}])
    assert path.read_bytes().endswith(b"\n")
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]
    assert read_jsonl(path)[0]["x"] == "inf"  # strict JSON, like evidence.json
    with open(path, "ab") as f:
        f.write(b'{"step": 3, "loss": 0.')  # a write cut by a crash
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]
    truncate_jsonl(path, 2)
    assert path.read_text() == '{"step": 0, "x": "inf"}\n{"step": 1}\n'
    sink = MetricsSink(tmp_path, start=1)  # a resume at step 1 drops the lines of steps >= 1
    assert [r["step"] for r in read_jsonl(path)] == [0]
    sink.record(_rec(1), [{"step": 1, "sample_id": 4}])
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]
    assert read_jsonl(tmp_path / "completions.jsonl") == [{"step": 1, "sample_id": 4}]
    sink.close()


def test_resume_truncation_keeps_lines_byte_for_byte_and_drops_undecodable_ones(tmp_path):
    """Lines an editor changed — NaN, 1e999, a key order or spacing of its own — are kept as they
    are (the rows were dumped again: NaN raised "Out of range float values are not JSON
    compliant" and the resume stopped); a line that is not UTF-8 is dropped as readers drop it
    (read_jsonl raised a codec error for the whole file)."""
    path = tmp_path / "metrics.jsonl"
    kept = [b'{"step": 0, "x": NaN}', b'{"x": 1e999,   "step": 1}', b'{"step":0}']
    path.write_bytes(b"\n".join([kept[0], b'\xff\xfe{"step": 1}', kept[1], b'{"step": 2}',
                                 b'{"step": true}', b"[1]", kept[2], b'{"step": 0, "cut']))
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2, True, 0]
    truncate_jsonl(path, 2)
    assert path.read_bytes() == b"".join(line + b"\n" for line in kept)
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 0]


def test_display_run_dir_and_warnings():
    assert display_run_dir("runs/x.tmp-123") == "runs/x" and display_run_dir("runs/y") == "runs/y"
    assert config_warnings(RunConfig()) == []
    assert config_warnings(RunConfig(ppo_epochs=2, clip_eps_high=0.28)) == []
    (w,) = config_warnings(RunConfig(save_every=3, steps=2))
    assert "--save-every 3 > --steps 2" in w


def test_flags_made_inert_by_another_flag_warn():
    """--model-seed with --model, --kl-estimator with --kl-coef 0, --clip-eps with both
    --clip-eps-low and --clip-eps-high: one warning each, naming both flags; at their defaults,
    or where they act, nothing."""
    (w,) = config_warnings(RunConfig(model="m", model_seed=5))
    assert w.startswith("--model-seed 5 is ignored with --model: it seeds only")
    (w,) = config_warnings(RunConfig(kl_estimator="k3"))
    assert w.startswith("--kl-estimator k3 is ignored with --kl-coef 0: no KL term is computed")
    both = dict(ppo_epochs=2, clip_eps_low=0.1, clip_eps_high=0.2)
    (w,) = config_warnings(RunConfig(clip_eps=0.5, **both))   # found by a breaker: silent
    assert w.startswith("--clip-eps 0.5 is ignored with both --clip-eps-low and --clip-eps-high")
    for cfg in (RunConfig(model="m"), RunConfig(model_seed=5), RunConfig(kl_estimator="k1"),
                RunConfig(kl_estimator="k3", kl_coef=0.01), RunConfig(**both),
                RunConfig(clip_eps=0.5, ppo_epochs=2, clip_eps_high=0.3),
                RunConfig(clip_eps=0.5, ppo_epochs=2, clip_eps_low=0.1)):
        assert config_warnings(cfg) == [], cfg


def test_summary_lines_tolerate_missing_keys():
    lines = summary_lines([_rec(0), _rec(1, reward_mean=0.75), {"step": 2}], "runs/r")
    assert lines[0].startswith("done: 3 steps in 8.0 s")
    assert "reward 0.5000 -> 0.7500" in lines[0] and "mismatches 0/80" in lines[0]
    assert "rlk report runs/r --out runs/r/plots" in lines[1]
    assert summary_lines([], "runs/r") == ["done: no steps recorded; run directory runs/r"]


def test_printed_commands_quote_a_run_directory_as_one_shell_word(tmp_path):
    """The closing line's `rlk report` command and the resume hint, for a run directory with a
    space, unicode and a quote: pasted into a shell, each path is one word (it split into
    several); a plain path is printed as it is."""
    import shlex

    from rlkernel.cli import _resume_hint

    d = tmp_path / "with space" / "é ü 日本'x"
    line = summary_lines([_rec(0)], str(d))[1]
    cmd = line.split("; plots: ")[1]
    assert shlex.split(cmd) == ["rlk", "report", str(d), "--out", f"{d}/plots"], cmd
    (d / "checkpoints" / "step-000001").mkdir(parents=True)
    hint = _resume_hint(d)
    assert shlex.split(hint.removeprefix("resume with: ")) == ["rlk", "run", "--resume", str(d)]
    assert summary_lines([_rec(0)], "runs/r")[1].endswith("plots: rlk report runs/r --out "
                                                           "runs/r/plots")


def test_summary_lines_of_a_resume_say_what_this_invocation_ran():
    """A run resumed at evidence step 1 of 3 (each step 4 s): the totals stay the run's, and the
    first line says 2 of the steps, 8.0 s, were this resume's; without resumed_at, or at 0, no
    such clause."""
    recs = [_rec(0), _rec(1), _rec(2)]
    (first, _) = summary_lines(recs, "runs/r", resumed_at=1)
    assert first.startswith("done: 3 steps (2 of them in this resume, 8.0 s) in 12.0 s"), first
    assert "in this resume" not in summary_lines(recs, "runs/r")[0]
    assert summary_lines(recs, "runs/r", resumed_at=0)[0].startswith(
        "done: 3 steps (3 of them in this resume, 12.0 s) in 12.0 s")


@pytest.mark.parametrize("resumed_at", [3, 4, -1])
def test_summary_lines_of_a_resume_past_its_steps_add_no_clause(resumed_at):
    """resumed_at outside [0, n) (3 of 3 records: nothing of this invocation's; 4; -1): the lines
    are exactly those without resumed_at — no "(0 of them in this resume, 0.0 s)" (control:
    resumed_at 2 adds "(1 of them in this resume, 4.0 s)"). Found by mutation testing: a bound
    of `resumed_at <= n` passed every test."""
    recs = [_rec(0), _rec(1), _rec(2)]
    assert summary_lines(recs, "runs/r", resumed_at=resumed_at) == summary_lines(recs, "runs/r")
    assert summary_lines(recs, "runs/r", resumed_at=2)[0].startswith(
        "done: 3 steps (1 of them in this resume, 4.0 s) in 12.0 s")


# ---------------------------------------------------------------------------------------------
# the phases on a terminal


def test_phases_are_shown_on_a_terminal(tmp_path):
    """A forced terminal shows step i/N and each phase text as the loop announces it."""
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    watch = RunWatch(RunConfig(steps=3), tmp_path, console)
    watch.startup(model="m", n_params=1_000_000, tokenizer="T", prompts="p", world=1,
                  device="cpu")
    watch.step_started(0)
    for text in ("rollout", "train, update 2/4", "sync"):
        watch.phase(text)
    watch.record(_rec(0), [])
    watch.close()
    out = buf.getvalue()
    for text in ("model: m, 1.00M parameters", "run dir: ", "step 1/3", "rollout",
                 "train, update 2/4", "sync"):
        assert text in out, text


def test_nothing_live_when_not_a_terminal(tmp_path):
    from rich.console import Console

    buf = io.StringIO()
    watch = RunWatch(RunConfig(steps=3), tmp_path, Console(file=buf, force_terminal=False))
    watch.phase("rollout")
    watch.close()
    assert buf.getvalue() == ""


# ---------------------------------------------------------------------------------------------
# a real run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two steps, no KL/entropy term (the random tiny model's advantages are all 0), TensorBoard
    when the package is here; the run's stderr and directory."""
    import contextlib

    d = tmp_path_factory.mktemp("watch") / "run"
    tb = []
    try:
        import tensorboard  # noqa: F401
        tb = ["--tensorboard"]
    except ImportError:
        pass
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["run", *SMALL, "--steps", "2", "--run-dir", str(d), *tb])
    assert code == 0, err.getvalue()
    return types.SimpleNamespace(dir=d, err=err.getvalue(), tensorboard=bool(tb))


def test_run_writes_metrics_and_completions_per_step(run):
    ev = json.loads((run.dir / "evidence.json").read_text())
    lines = (run.dir / "metrics.jsonl").read_text().split("\n")
    assert lines[-1] == "" and len(lines) == 3  # two whole lines
    rows = [json.loads(ln) for ln in lines[:-1]]
    assert [r["step"] for r in rows] == [0, 1]
    for row, s in zip(rows, ev["steps"]):
        want = json.loads(json.dumps(metrics_row(s)))
        assert {k: v for k, v in row.items() if k not in ("tokens_per_s",)} == \
            {k: v for k, v in want.items() if k not in ("tokens_per_s",)}
        for key in ("reward_mean", "reward_std", "response_len_mean", "entropy",
                    "clip_frac", "grad_norm", "logprob_mismatches", "tokens_per_s", "step_s",
                    "rollout_s", "train_s", "sync_s", "lr"):
            assert key in row, key
        # --kl-coef 0 (the default): no reference policy, so no KL is measured or shown
        assert s["kl"] is None and "kl" not in row
    comps = read_jsonl(run.dir / "completions.jsonl")
    assert [c["sample_id"] for c in comps] == list(range(8))
    for c in comps:
        assert set(c) >= {"step", "sample_id", "prompt", "response", "reward", "advantage"}
        assert c["prompt"].startswith("Compute ") and isinstance(c["response"], str)
    assert [c["reward"] for c in comps] == ev["steps"][0]["rewards"] + ev["steps"][1]["rewards"]


def test_run_prints_startup_lines_progress_warning_and_summary(run):
    lines = run.err.splitlines()
    for prefix in ("model: embedded tiny Qwen3", "data: ", "ranks: 1 rank", "plan: 2 steps",
                   f"run dir: {run.dir}"):
        assert any(ln.startswith(prefix) for ln in lines), (prefix, run.err)
    assert lines.index(next(ln for ln in lines if ln.startswith("run dir: "))) < \
        lines.index(next(ln for ln in lines if ln.startswith("step 1/2")))
    warnings = [ln for ln in lines if ln.startswith("rlk run: warning: ")]
    assert len(warnings) == 1 and "evidence step 0: every GRPO advantage is 0" in warnings[0]
    assert lines[-2].startswith("done: 2 steps in ") and "mismatches 0/" in lines[-2]
    assert lines[-1].startswith(f"files: {run.dir}/evidence.json")


def test_run_writes_tensorboard_events(run):
    if not run.tensorboard:
        pytest.skip("tensorboard is not installed (pip install 'rl-kernel[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run.dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward/mean", "loss/entropy", "optim/grad_norm", "time/step_s"} <= tags
    assert "loss/kl" not in tags            # --kl-coef 0: KL not measured, nothing written
    assert [e.step for e in acc.Scalars("optim/grad_norm")] == [0, 1]


# ---------------------------------------------------------------------------------------------
# rlk report


def _png_ok(path: pathlib.Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000, path


def test_report_draws_one_and_several_runs(run, tmp_path, capsys):
    """rlk report RUN --out DIR: overview + one PNG per metric; two runs (one with evidence.json
    only) on the same axes."""
    capsys.readouterr()
    assert main(["report", str(run.dir), "--out", str(tmp_path / "one")]) == 0
    written = [pathlib.Path(p) for p in capsys.readouterr().out.split()]
    names = {p.name for p in written}
    assert {"overview.png", "reward.png", "entropy.png", "grad_norm.png",
            "step_time.png", "mismatches.png", "clip_frac.png", "lr.png"} <= names
    assert "kl.png" not in names             # --kl-coef 0: no KL measured, no empty plot
    for p in written:
        _png_ok(p)
    bare = tmp_path / "bare"  # a run directory without metrics.jsonl
    bare.mkdir()
    for name in ("evidence.json", "manifest.json"):
        (bare / name).write_bytes((run.dir / name).read_bytes())
    paths = write_report([str(run.dir), str(bare)], tmp_path / "two")
    _png_ok(paths[0])


def _huge_metrics_run(d: pathlib.Path) -> pathlib.Path:
    """A run directory whose metrics.jsonl (3 steps) has reward_mean 1e308 at every step,
    tokens_per_s -1e308 at step 1 and a second update's grad norm 1e308 at step 2."""
    rows = [metrics_row(_rec(i)) for i in range(3)]
    for r in rows:
        r["reward_mean"] = 1e308
    rows[1]["tokens_per_s"] = -1e308
    rows[2]["grad_norms"] = [0.75, 1e308]
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_report_of_huge_values_draws_the_rest_and_names_them(tmp_path, capsys):
    """Values past ±PLOT_LIMIT (1e300; matplotlib's tick arithmetic overflowed near 1e308: a
    ValueError traceback, no plot written) are gaps: exit 0, every PNG written and readable,
    and one warning line per run and metric on stderr naming the metric, its steps, the value
    and the plot it is missing from."""
    run = _huge_metrics_run(tmp_path / "huge")
    code = main(["report", str(run), "--out", str(tmp_path / "p")])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    names = {pathlib.Path(p).name for p in out.split()}
    assert {"overview.png", "reward.png", "throughput.png", "grad_norm.png", "loss.png"} <= names
    for p in out.split():
        _png_ok(pathlib.Path(p))
    assert err.splitlines() == [
        "rlk report: warning: huge: reward_mean at steps 0, 1, 2 (first 1e+308): past ±1e+300, "
        "which a plot's axis cannot span; left out of reward.png and overview.png (a gap)",
        "rlk report: warning: huge: grad_norms at step 2 (1e+308): past ±1e+300, which a plot's "
        "axis cannot span; left out of grad_norm.png and overview.png (a gap)",
        "rlk report: warning: huge: tokens_per_s at step 1 (-1e+308): past ±1e+300, which a "
        "plot's axis cannot span; left out of throughput.png and overview.png (a gap)"], err


def test_report_of_a_huge_reward_std_is_named_with_its_count_of_steps(tmp_path, capsys):
    """reward_std past ±PLOT_LIMIT (the ±std band around the reward curve) at 7 steps: the
    band is a gap there, and the warning names reward_std, the first 5 steps and how many
    there are; exit 0, reward.png written."""
    rows = [metrics_row(_rec(i)) for i in range(7)]
    for r in rows:
        r["reward_std"] = 1e308
    d = tmp_path / "std"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(d), "--out", str(tmp_path / "p")]) == 0
    out, err = capsys.readouterr()
    assert "reward.png" in out
    assert err.splitlines() == [
        "rlk report: warning: std: reward_std at steps 0, 1, 2, 3, 4, ... (7 steps) (first "
        "1e+308): past ±1e+300, which a plot's axis cannot span; left out of reward.png and "
        "overview.png (a gap)"], err


def test_report_of_an_int_past_float64_draws_a_gap(tmp_path, capsys):
    """metrics.jsonl with loss 10**400 (an int no float holds; math.isfinite raised
    OverflowError, a traceback): a gap, like Inf (the step is drawn as NaN, not left out, which
    would join its neighbours' line across it), and every PNG is written."""
    from rlkernel.runner.report import _values, load_metrics

    rows = [metrics_row(_rec(i)) for i in range(2)]
    d = tmp_path / "bigint"
    d.mkdir()
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (d / "metrics.jsonl").write_text(text.replace('"loss": 0.25', '"loss": 1' + "0" * 400, 1))
    assert read_jsonl(d / "metrics.jsonl")[0]["loss"] == 10 ** 400
    assert main(["report", str(d), "--out", str(tmp_path / "p")]) == 0
    out, err = capsys.readouterr()
    assert "loss.png" in out and "Traceback" not in err and err == "", err
    xs, ys = _values(load_metrics(d).rows, "loss")
    assert xs == [0, 1] and math.isnan(ys[0]) and ys[1] == 0.25


@pytest.mark.parametrize("step", ["18446744073709551616", "-9223372036854775809",
                                  "1" + "0" * 400, "-1", "true"])
def test_report_skips_a_row_whose_step_no_run_writes(tmp_path, capsys, step):
    """A metrics.jsonl row whose "step" is no step number (past int64: a TypeError/OverflowError
    traceback in numpy, and an empty plots/ left behind; negative; a bool) is not drawn; the
    other rows are, exit 0."""
    from rlkernel.runner.report import load_metrics

    d = tmp_path / "odd"
    d.mkdir()
    rows = [json.dumps(metrics_row(_rec(i))) for i in range(3)]
    rows[1] = rows[1].replace('"step": 1', f'"step": {step}', 1)
    (d / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    assert main(["report", str(d), "--out", str(tmp_path / "p")]) == 0
    out, err = capsys.readouterr()
    assert "reward.png" in out and "Traceback" not in err, err
    assert [r["step"] for r in load_metrics(d).rows] == [0, 2]


def test_report_leaves_out_a_panel_matplotlib_cannot_draw(tmp_path, capsys, monkeypatch):
    """Should a value still break matplotlib (here: PLOT_LIMIT lifted, so 1e308 reaches it), that
    panel is left out of its PNG and of overview.png with one warning naming it and the error;
    the other PNGs are written, and a reward.png an earlier report left in --out is removed
    (kept, it showed the earlier runs' plot as this report's). Control: the lifted limit does
    make matplotlib fail."""
    from rlkernel.runner import report

    monkeypatch.setattr(report, "PLOT_LIMIT", math.inf)
    run = _huge_metrics_run(tmp_path / "huge")
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "reward.png").write_bytes(PNG_MAGIC + b"an earlier report's plot")
    code = main(["report", str(run), "--out", str(tmp_path / "p")])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    names = {pathlib.Path(p).name for p in out.split()}
    assert "reward.png" not in names and {"overview.png", "loss.png", "lr.png"} <= names
    for p in out.split():
        _png_ok(pathlib.Path(p))
    assert not (tmp_path / "p" / "reward.png").exists()
    lines = [ln for ln in err.splitlines() if "reward.png" in ln]
    assert lines and lines[0].startswith("rlk report: warning: reward.png: not drawn "
                                         "(matplotlib: ValueError: "), err


def _metrics_run(d: pathlib.Path) -> pathlib.Path:
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(metrics_row(_rec(i))) + "\n"
                                             for i in range(2)))
    return d


def test_report_out_that_is_a_file_or_a_link_is_refused(tmp_path, capsys, monkeypatch):
    """report --out naming a file, a path under a file, or a symbolic link (to a directory, or
    to nothing): one line, exit 2, nothing written, worded as run / export / init-model word
    theirs (a file said "cannot create it (File exists)"; a link was written through, which
    run and export refuse). A directory that holds files is still taken (PNGs replaced)."""
    monkeypatch.chdir(tmp_path)
    run = _metrics_run(tmp_path / "r")
    pathlib.Path("afile").write_text("x")
    pathlib.Path("tgt").mkdir()
    pathlib.Path("tgt/keep").write_text("x")
    pathlib.Path("link").symlink_to("tgt")
    pathlib.Path("dangling").symlink_to("gone")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    for out, why in (
            ("afile", "is a file, not a directory; give a directory"),
            ("afile/sub", "cannot be created, 'afile' is a file, not a directory; give a "
                          "directory"),
            ("link", f"is a symbolic link to 'tgt'; give a directory (e.g. its target "
                     f"{str(tmp_path / 'tgt')!r}), not a link"),
            ("dangling", "is a symbolic link to 'gone', which does not exist; give a "
                         "directory, not a link")):
        code = main(["report", str(run), "--out", out])
        o, err = capsys.readouterr()
        assert (code, o) == (2, ""), out
        assert err.splitlines() == [f"rlk report: error: --out {out!r}: {why}"], err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    assert main(["report", str(run), "--out", "tgt"]) == 0
    assert (tmp_path / "tgt" / "overview.png").is_file() and (tmp_path / "tgt" / "keep").exists()


def test_report_that_cannot_write_a_png_says_which(tmp_path, capsys):
    """--out holding a directory named reward.png (savefig raised IsADirectoryError, a
    traceback): one line naming the file and why, exit 2."""
    run = _metrics_run(tmp_path / "r")
    (tmp_path / "o" / "reward.png").mkdir(parents=True)
    code = main(["report", str(run), "--out", str(tmp_path / "o")])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err
    assert err.splitlines() == [f"rlk report: error: {tmp_path / 'o' / 'reward.png'}: cannot be "
                                "written (Is a directory)"], err


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_report_that_cannot_write_a_later_png_writes_none(tmp_path, capsys, kind):
    """--out holding a directory or a FIFO named kl.png (a panel drawn after reward.png and
    response_len.png): refused before any PNG is drawn, one line naming it, exit 2, and --out
    left as it was (reward.png and response_len.png were written first, then the error: a
    half-written report)."""
    run = _metrics_run(tmp_path / "r")
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    (out_dir / "kl.png").mkdir() if kind == "dir" else os.mkfifo(out_dir / "kl.png")
    code = main(["report", str(run), "--out", str(out_dir)])
    out, err = capsys.readouterr()
    why = "Is a directory" if kind == "dir" else "not a regular file"
    assert (code, out) == (2, "")
    assert err.splitlines() == [f"rlk report: error: {out_dir / 'kl.png'}: cannot be written "
                                f"({why})"], err
    assert sorted(p.name for p in out_dir.iterdir()) == ["kl.png"]


def test_report_never_writes_through_a_png_that_is_a_link(tmp_path, capsys):
    """--out/reward.png a symbolic link to another run's evidence.json: savefig wrote the PNG
    through it, replacing that evidence (exit 0). Now refused before any PNG is drawn, one line
    naming the link, exit 2; the link's target and --out are unchanged."""
    run = _metrics_run(tmp_path / "r")
    victim = tmp_path / "evidence.json"
    victim.write_text('{"steps": []}\n')
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    (out_dir / "reward.png").symlink_to(victim)
    code = main(["report", str(run), "--out", str(out_dir)])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.splitlines() == [f"rlk report: error: {out_dir / 'reward.png'}: is a symbolic "
                                f"link to {str(victim)!r}; remove it (rlk report writes its "
                                "PNGs as files, never through a link)"], err
    assert victim.read_text() == '{"steps": []}\n'
    assert [p.name for p in out_dir.iterdir()] == ["reward.png"]


def test_report_removes_an_earlier_reports_png_of_a_metric_it_has_not(tmp_path, capsys):
    """A report of runs with no KL (--kl-coef 0: kl null) into an --out where an earlier
    report of a run with KL left kl.png: that kl.png is removed (kept, it showed the earlier
    run's KL as this report's, with no legend to tell), the PNGs drawn are listed, exit 0."""
    with_kl = _metrics_run(tmp_path / "kl")
    no_kl = tmp_path / "nokl"
    no_kl.mkdir()
    (no_kl / "metrics.jsonl").write_text("".join(json.dumps(metrics_row(_rec(i, kl=None))) + "\n"
                                                 for i in range(2)))
    out_dir = tmp_path / "o"
    assert main(["report", str(with_kl), "--out", str(out_dir)]) == 0
    assert (out_dir / "kl.png").is_file()
    capsys.readouterr()
    assert main(["report", str(no_kl), "--out", str(out_dir)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and str(out_dir / "kl.png") not in out.split()
    assert not (out_dir / "kl.png").exists()
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(pathlib.Path(p).name
                                                               for p in out.split())


def test_report_refuses_an_unreadable_run(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "missing", tmp_path / "empty"):
        code = main(["report", str(target), "--out", str(tmp_path / "o")])
        out, err = capsys.readouterr()
        assert code == 2 and out == ""
        (line,) = err.strip().splitlines()
        assert line.startswith("rlk report: error: ") and str(target) in line



def test_require_updates_with_a_zero_gradient_names_the_causes(tmp_path, capsys):
    """--require-updates on a run whose gradient is exactly 0 (the random tiny model's
    advantages are all 0, no KL or entropy term): exit 1 after step 0, and the message names
    both ways the KL/entropy terms can give nothing — zero coefficients or a saturated softmax
    (a fresh-user pass hit it at --temperature 1e-6 with --kl-coef set)."""
    code = main(["run", *SMALL, "--steps", "2", "--require-updates", "--run-dir",
                 str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "evidence step 0: --require-updates" in err and "exactly 0" in err
    assert "coefficients 0" in err and "--temperature" in err


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_require_updates_below_resolution_names_the_runs_dtype(tmp_path, capsys, dtype):
    """--require-updates with --lr 1e-30 (a nonzero gradient through the KL term's first
    update is too small to move any weight): the message names the run's --dtype (it said
    bf16 under --dtype fp32; found by a breaker)."""
    code = main(["run", *SMALL, "--steps", "1", "--require-updates", "--kl-coef", "0.01",
                 "--entropy-coef", "0.01", "--lr", "1e-30", "--dtype", dtype, "--run-dir",
                 str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"the update was below {dtype} resolution" in err, err


def test_report_of_a_link_loop_says_it_is_a_link(tmp_path):
    """rlk report LOOP, LOOP a symbolic link to itself: the link is named as one that cannot be
    followed (it said "no such run directory" of a path that is there, which read as a typo);
    a missing path still says no such run directory."""
    from rlkernel.runner.report import ReportError, load_metrics

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(ReportError) as e:
        load_metrics(loop)
    assert str(e.value) == (f"{loop}: a symbolic link that cannot be followed (Too many levels "
                            "of symbolic links)"), str(e.value)
    with pytest.raises(ReportError) as e:
        load_metrics(tmp_path / "gone")
    assert str(e.value) == f"{tmp_path / 'gone'}: no such run directory"


def test_report_draws_a_run_named_twice_once(tmp_path, capsys):
    """rlk report R R/ LINK (LINK -> R): one run, drawn once, each repeat named in a warning
    (two curves of one run, the second over the first, read as two runs that agree); two
    distinct runs are both drawn, with no warning."""
    run = _metrics_run(tmp_path / "r")
    other = _metrics_run(tmp_path / "s")
    (tmp_path / "link").symlink_to(run)
    names = [str(run), str(run) + "/", str(tmp_path / "link")]
    warned: list[str] = []
    write_report(names, tmp_path / "o", warn=warned.append)
    real = os.path.realpath(run)
    assert warned == [f"{n}: the same run as {run} ({real}); drawn once" for n in names[1:]]
    code = main(["report", *names, str(other), "--out", str(tmp_path / "p")])
    out, err = capsys.readouterr()
    assert code == 0 and (tmp_path / "p" / "overview.png").is_file()
    assert err.splitlines() == [f"rlk report: warning: {w}" for w in warned]
    warned.clear()
    write_report([str(run), str(other)], tmp_path / "q", warn=warned.append)
    assert warned == []


@pytest.mark.parametrize("text, why", [
    ('{"step": 0, "rew', "holds no complete line"),
    ('{"step": 0, "rew\n[1, 2]\n\n{"st', "holds 2 complete lines, none of them a step's row"),
    ('{"step": 0, "rew\n', "holds 1 complete line, none of them a step's row")])
def test_report_of_a_metrics_file_with_no_step_says_why(tmp_path, text, why):
    """A run killed in its first step (metrics.jsonl holds a torn line) or a damaged metrics.jsonl
    (complete lines that are not steps' rows), with no evidence.json: the message says which,
    counting the damaged lines (it said "neither metrics.jsonl nor evidence.json" of a directory
    holding metrics.jsonl, then "no complete line" of complete ones). Without metrics.jsonl: the
    directory is not a run's."""
    from rlkernel.runner.report import NoStepError, ReportError, load_metrics

    d = tmp_path / "r"
    d.mkdir()
    (d / "metrics.jsonl").write_text(text)
    with pytest.raises(NoStepError) as e:
        load_metrics(d)
    assert str(e.value) == (f"{d}: no step recorded yet (metrics.jsonl {why}, and there is no "
                            "evidence.json)")
    (d / "metrics.jsonl").unlink()
    with pytest.raises(ReportError) as e:
        load_metrics(d)
    assert str(e.value).startswith(f"{d}: neither metrics.jsonl nor evidence.json")


def test_report_leaves_out_a_run_with_no_step_while_another_has_steps(tmp_path, capsys):
    """Several runs, one just started (no step in metrics.jsonl, no evidence.json): the others
    are drawn and the empty one is named in a warning (it aborted the whole report). Alone, or
    with only other empty runs, it is still an error; an unreadable run still aborts."""
    from rlkernel.cli import main
    from rlkernel.runner.report import NoStepError, write_report

    run = _metrics_run(tmp_path / "a")
    fresh = tmp_path / "b"
    fresh.mkdir()
    (fresh / "metrics.jsonl").write_text('{"step": 0, "rew')
    warned: list[str] = []
    paths = write_report([str(fresh), str(run)], tmp_path / "o", warn=warned.append)
    assert (tmp_path / "o" / "overview.png") in paths
    assert warned == [f"{fresh}: no step recorded yet (metrics.jsonl holds no complete line, "
                      "and there is no evidence.json); left out of the plots"]
    code = main(["report", str(run), str(fresh), "--out", str(tmp_path / "p")])
    out, err = capsys.readouterr()
    assert code == 0 and (tmp_path / "p" / "overview.png").is_file()
    assert err.splitlines() == [f"rlk report: warning: {warned[0]}"]
    other = tmp_path / "c"
    other.mkdir()
    (other / "metrics.jsonl").write_text("")
    with pytest.raises(NoStepError) as e:
        write_report([str(fresh), str(other)], tmp_path / "q")
    assert str(e.value).startswith(f"{fresh}: no step recorded yet")
    with pytest.raises(NoStepError):
        write_report([str(fresh)], tmp_path / "q")
    assert not (tmp_path / "q").exists()
    code = main(["report", str(run), str(fresh), str(tmp_path / "missing"),
                 "--out", str(tmp_path / "s")])
    out, err = capsys.readouterr()
    assert code == 2 and "missing" in err and not (tmp_path / "s").exists()


def test_report_takes_the_evidence_when_no_metrics_line_is_a_step_and_names_bad_utf8(run,
                                                                                      tmp_path):
    """metrics.jsonl whose lines carry no usable step ("0", -5, 0.5, true, none) beside an intact
    evidence.json: the evidence's steps are drawn (the run was called "no step recorded yet").
    An evidence.json that is not UTF-8 is named so (a raw codec message before)."""
    from rlkernel.runner.report import ReportError, load_metrics

    d = tmp_path / "r"
    d.mkdir()
    for name in ("evidence.json", "manifest.json"):
        (d / name).write_bytes((run.dir / name).read_bytes())
    steps = len(json.loads((run.dir / "evidence.json").read_text())["steps"])
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": 1.0}) + "\n"
                                             for s in ("0", -5, 0.5, True, None)))
    m = load_metrics(d)
    assert m.source == str(d / "evidence.json") and [r["step"] for r in m.rows] == \
        list(range(steps))
    (d / "metrics.jsonl").unlink()
    (d / "evidence.json").write_bytes(b"\xff" + (run.dir / "evidence.json").read_bytes())
    with pytest.raises(ReportError) as e:
        load_metrics(d)
    assert str(e.value) == (f"{d / 'evidence.json'}: not UTF-8 text (byte 0: invalid start "
                            "byte); not a file rlk run writes"), str(e.value)


def test_a_failed_write_names_its_file(tmp_path, monkeypatch):
    """A full disk (ENOSPC from write or fsync: an OSError naming no file) fails the run with
    the file named — metrics.jsonl / completions.jsonl appends and the atomic evidence write —
    where a breaker saw a bare "[Errno 28] No space left on device"; the atomic write leaves no
    temp file. An error that already names its file is unchanged."""
    import errno

    from rlkernel.runner.evidence import write_bytes_atomic

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    path = tmp_path / "metrics.jsonl"
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as e:
        append_jsonl(path, [{"step": 0}])
    assert str(e.value) == f"[Errno 28] No space left on device: {str(path)!r}"
    monkeypatch.undo()
    monkeypatch.setattr(os, "fsync", full)
    ev = tmp_path / "evidence.json"
    with pytest.raises(OSError) as e:
        write_bytes_atomic(ev, b"{}")
    assert str(e.value) == f"[Errno 28] No space left on device: {str(ev)!r}"
    assert list(tmp_path.iterdir()) == [path]          # no temp file, no evidence.json
    monkeypatch.undo()
    with pytest.raises(OSError) as e:
        append_jsonl(tmp_path / "no" / "such.jsonl", [{"step": 0}])
    assert e.value.filename == str(tmp_path / "no" / "such.jsonl")
