"""`rlk report RUN [RUN ...] --out DIR`: PNG plots of the per-step metrics of one or several runs.

Each run contributes its metrics.jsonl (runner/metrics.py) or, when it has none (older runs, or
a run directory copied without it) or none of its lines is a step's row, the rows derived from
its evidence.json by the same `metrics_row`. One curve per run (colour) on each panel, x = RL step:
  overview.png   every panel below on one page
  reward.png     reward mean, with a ±1 std band
  response_len.png, kl.png, entropy.png, loss.png, clip_frac.png, lr.png,
  grad_norm.png  first update's exact norm; with several updates per step, update i of n as a
                 dot at step + i/n
  mismatches.png train/rollout logprob byte mismatches (0 is the contract in --mode invariant)
  throughput.png response tokens per second of the whole step
  step_time.png  rollout (solid), train (dashed), sync (dotted) seconds per step
A run named twice (the same directory by another path or through a link) is drawn once, with a
warning; a run with no step yet (just started, or killed in its first step) is left out, with a
warning, while another run has steps. A panel with no value in any run is left out (and its PNG
from an earlier report in --out removed). A PNG name in --out taken by a directory, a FIFO or a
symbolic link is refused before any PNG is drawn. NaN/Inf values are gaps in a curve, and so
are values past ±PLOT_LIMIT (an axis cannot span them: matplotlib's tick arithmetic overflowed
near 1e308, a traceback), each named in a warning (`warn`). Should matplotlib still fail on a
panel, that panel is left out of its PNG and of overview.png, with a warning, and the rest is
drawn.

Matplotlib is driven through its object API with the Agg canvas: no pyplot, no global backend
switch, no display needed.
Does not: compare runs bit for bit (`rlk compare` does) or read tensors.
Tests: `.venv/bin/python -m pytest -q tests/test_watch.py -k report`.
"""

from __future__ import annotations

import math
import os
import pathlib
from dataclasses import dataclass
from typing import Any, Callable

from rlkernel import readfile
from rlkernel.runner.metrics import METRICS, metrics_row, read_jsonl


PLOT_LIMIT = 1e300
"""Largest |value| drawn. matplotlib's tick arithmetic overflowed from about 7e307 (an axis from
-v to v) with a ValueError; rewards are bounded far below (data/rewards.REWARD_LIMIT, 1e100), so a
value past this is a broken metric or an edited file, shown as a gap."""
_SHOWN_STEPS = 5


class ReportError(ValueError):
    """A run cannot be plotted, or the output directory cannot be written."""


class NoStepError(ReportError):
    """A readable run directory that holds no step yet (a run in its first step, or killed
    there): left out, with a warning, when other runs are drawn."""


@dataclass(frozen=True)
class RunMetrics:
    """One run's rows (sorted by step) and the label of its curves."""

    label: str
    rows: list[dict[str, Any]]
    source: str


def load_metrics(run_dir: str | os.PathLike) -> RunMetrics:
    """A run's metrics rows: metrics.jsonl, else derived from evidence.json.

    Raises NoStepError naming the directory when neither holds a step, ReportError when the
    directory or a file in it cannot be read.
    """
    d = pathlib.Path(run_dir)
    if d.exists() and not d.is_dir():
        raise ReportError(f"{d}: is a file, not a run directory")
    if not d.is_dir():
        raise ReportError(f"{d}: {readfile.missing_directory(d)}")
    path = d / METRICS
    rows: list[dict[str, Any]] = []
    source = str(path)
    try:
        if path.exists():   # a FIFO too: read_jsonl refuses it (skipping it hid the reason)
            rows = [r for r in read_jsonl(path) if _is_step(r.get("step"))]
        if not rows:   # none, or none a step's: the evidence's steps, when it has them
            source = str(d / "evidence.json")
            ev = readfile.read_json(d / "evidence.json")
            steps = ev.get("steps") if isinstance(ev, dict) else None
            rows = [r for r in (metrics_row(s) for s in steps or [] if isinstance(s, dict))
                    if _is_step(r.get("step"))]
    except FileNotFoundError:
        if path.exists():   # a run killed in its first step: its lines are torn or absent
            raise NoStepError(f"{d}: no step recorded yet ({METRICS} {_no_rows(path)}, and "
                              "there is no evidence.json)") from None
        raise ReportError(f"{d}: neither {METRICS} nor evidence.json; give a directory written "
                          "by rlk run") from None
    except UnicodeDecodeError as e:
        raise ReportError(f"{source}: not UTF-8 text (byte {e.start}: {e.reason}); not a file "
                          "rlk run writes") from None
    except (OSError, ValueError) as e:   # strerror: the OSError's text without the path again
        raise ReportError(f"{source}: cannot be read ({getattr(e, 'strerror', None) or e})") \
            from None
    rows = sorted(rows, key=lambda r: r["step"])
    if not rows:
        raise NoStepError(f"{d}: no step recorded yet (in {source})")
    return RunMetrics(d.name or str(d), rows, source)


def _no_rows(path: pathlib.Path) -> str:
    """Why a metrics.jsonl gave no row: it holds no complete line (a write cut in the first
    step), or its complete lines are not steps' rows (not UTF-8 JSON objects with a step
    number: an edited or damaged file)."""
    try:
        n = sum(1 for line in readfile.read_bytes(path).split(b"\n")[:-1] if line.strip())
    except OSError:
        n = 0
    if not n:
        return "holds no complete line"
    return f"holds {n} complete line{'s' * (n > 1)}, none of them a step's row"


def load_runs(run_dirs: list[str],
              warn: Callable[[str], None]) -> tuple[list[str], list[RunMetrics]]:
    """(run_dirs, their metrics) less the runs with no step yet, each named in a warning — unless
    none has a step, which raises the first one's NoStepError; any other ReportError raises."""
    kept, runs, empty = [], [], []
    for d in run_dirs:
        try:
            runs.append(load_metrics(d))
            kept.append(d)
        except NoStepError as e:
            empty.append(e)
    if not runs:
        raise empty[0]
    for e in empty:
        warn(f"{e}; left out of the plots")
    return kept, runs


def _is_step(v: object) -> bool:
    """A step number a run writes: an int in [0, 2**53) (a float64 x holds it exactly; 2**64 or
    10**400 made numpy raise, a traceback). Other rows are not steps and are not drawn."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**53


def _plottable(v: float) -> float:
    """v, or NaN (a gap) when it is not finite or past ±PLOT_LIMIT."""
    return v if math.isfinite(v) and abs(v) <= PLOT_LIMIT else math.nan


def _number(v: Any) -> float | None:
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:   # an int past float64 (metrics.jsonl edited by hand)
            return math.inf if v > 0 else -math.inf
    return None


def _values(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = _number(r.get(key))
        if v is not None:
            xs.append(r["step"])
            ys.append(_plottable(v))
    return xs, ys


# (file stem, title, y label, keys with line styles)
PANELS = [
    ("reward", "reward (mean, ±1 std)", "reward", [("reward_mean", "-")]),
    ("response_len", "response length", "tokens per sample", [("response_len_mean", "-")]),
    ("kl", "KL to the reference policy", "KL estimate", [("kl", "-")]),
    ("entropy", "entropy", "nats per token", [("entropy", "-")]),
    ("loss", "loss", "loss (--loss-agg)", [("loss", "-")]),
    ("clip_frac", "PPO clip fraction", "clipped tokens / tokens", [("clip_frac", "-")]),
    ("grad_norm", "gradient norm (exact, before clipping; dots: every update)", "L2 norm",
     [("grad_norm", "-")]),
    ("lr", "learning rate", "lr", [("lr", "-")]),
    ("mismatches", "train/rollout logprob byte mismatches", "tokens", [("logprob_mismatches", "-")]),
    ("throughput", "throughput", "response tokens / s", [("tokens_per_s", "-")]),
    ("step_time", "step time (rollout -, train --, sync :)", "seconds",
     [("rollout_s", "-"), ("train_s", "--"), ("sync_s", ":")]),
]


def _out_of_range(runs: list[RunMetrics]) -> list[str]:
    """One line per run and metric with finite values past ±PLOT_LIMIT (drawn as gaps): its
    steps, its first such value and the PNG it is missing from, in PANELS order."""
    keys = [(k, stem) for stem, _, _, ks in PANELS for k, _ in ks]
    keys.insert(1, ("reward_std", "reward"))
    keys.insert(next(i for i, (_, s) in enumerate(keys) if s == "grad_norm") + 1,
                ("grad_norms", "grad_norm"))
    lines = []
    for run in runs:
        for key, stem in keys:
            bad = []
            for r in run.rows:
                vs = r.get(key) if isinstance(r.get(key), list) else [r.get(key)]
                big = [v for v in map(_number, vs) if v is not None and math.isfinite(v)
                       and abs(v) > PLOT_LIMIT]
                if big:
                    bad.append((r["step"], big[0]))
            if not bad:
                continue
            steps = ", ".join(str(s) for s, _ in bad[:_SHOWN_STEPS])
            more = f", ... ({len(bad)} steps)" if len(bad) > _SHOWN_STEPS else ""
            first = "first " if len(bad) > 1 else ""
            lines.append(f"{run.label}: {key} at step{'s' if len(bad) > 1 else ''} {steps}{more} "
                         f"({first}{bad[0][1]:g}): past ±{PLOT_LIMIT:g}, which a plot's axis "
                         f"cannot span; left out of {stem}.png and overview.png (a gap)")
    return lines


def _draw(ax, runs: list[RunMetrics], panel, colors) -> bool:
    """Draw one panel; False when no run has a value for it."""
    from matplotlib.ticker import MaxNLocator

    stem, title, ylabel, keys = panel
    drawn = False
    for run, color in zip(runs, colors):
        for key, style in keys:
            xs, ys = _values(run.rows, key)
            if not xs:
                continue
            drawn = True
            marker = "o" if len(xs) <= 20 else None
            label = run.label if key == keys[0][0] else None
            ax.plot(xs, ys, style, color=color, marker=marker, markersize=3, label=label)
            if key == "reward_mean":
                sx, sd = _values(run.rows, "reward_std")
                if sx == xs:
                    ax.fill_between(xs, [_plottable(y - s) for y, s in zip(ys, sd)],
                                    [_plottable(y + s) for y, s in zip(ys, sd)], color=color,
                                    alpha=0.15)
        if stem == "grad_norm":  # update i of n at x = step + i/n: the first sits on the line
            pts = [(r["step"] + i / len(r["grad_norms"]), _plottable(_number(g)))
                   for r in run.rows if isinstance(r.get("grad_norms"), list)
                   for i, g in enumerate(r["grad_norms"]) if _number(g) is not None]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=8, color=color, alpha=0.6)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL step", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if drawn and len(runs) > 1:
        ax.legend(fontsize=7)
    return drawn


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def write_report(run_dirs: list[str], out_dir: str | os.PathLike,
                 warn: Callable[[str], None] = lambda line: None) -> list[pathlib.Path]:
    """Draw the PNGs (module doc) of `run_dirs` into `out_dir` (created if missing); returns the
    files written. `warn` gets one line per value left out of a plot (past ±PLOT_LIMIT), per
    panel matplotlib could not draw and per run with no step yet (`load_runs`: left out while
    another run has steps). Raises ReportError for an unreadable run, runs none of which has a
    step, an unwritable out_dir or a PNG that cannot be written there."""
    run_dirs, runs = load_runs(_distinct_runs(run_dirs, warn), warn)
    labels = [r.label for r in runs]
    if len(set(labels)) < len(labels):  # same directory name in different places: use paths
        runs = [RunMetrics(str(d), r.rows, r.source) for d, r in zip(run_dirs, runs)]
    out = pathlib.Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"--out {str(out)!r}: cannot create it ({e.strerror or e})") from None
    try:
        from matplotlib import colormaps
    except ImportError as e:
        raise ReportError(f"matplotlib is needed for rlk report ({e}); pip install matplotlib") \
            from None
    import numpy

    bad = _unwritable_png(out)
    if bad:
        raise ReportError(bad)
    cmap = colormaps["tab10"]
    colors = [cmap(i % 10) for i in range(len(runs))]
    for line in _out_of_range(runs):
        warn(line)
    # Large values within PLOT_LIMIT can still overflow inside matplotlib's tick arithmetic,
    # which numpy reported as a RuntimeWarning on stderr; the plots themselves come out right,
    # so that noise is silenced while drawing.
    with numpy.errstate(over="ignore", invalid="ignore"):
        return _draw_all(runs, out, colors, warn)


def _distinct_runs(run_dirs: list[str], warn: Callable[[str], None]) -> list[str]:
    """run_dirs less each one that names a run given before it (the same directory through
    another path or a link: two curves of one run, one hiding the other, read as two runs that
    agree), each named in a warning."""
    kept: dict[str, str] = {}
    for d in run_dirs:
        real = os.path.realpath(d)
        if real in kept:
            warn(f"{d}: the same run as {kept[real]} ({real}); drawn once")
        else:
            kept[real] = d
    return list(kept.values())


def _unwritable_png(out: pathlib.Path) -> str | None:
    """Why one of the PNGs this report may write cannot be written, checked before any is drawn
    (found at its turn, the PNGs before it were already replaced: a half-written --out), or
    None. A name taken by a directory or a FIFO, or a symbolic link (savefig wrote through it:
    a link to a run's evidence.json replaced that file with a PNG)."""
    for stem in ["overview"] + [panel[0] for panel in PANELS]:
        path = out / f"{stem}.png"
        if path.is_symlink():
            return (f"{path}: is a symbolic link to {os.readlink(path)!r}; remove it (rlk report "
                    "writes its PNGs as files, never through a link)")
        if path.exists() and not path.is_file():
            why = "Is a directory" if path.is_dir() else "not a regular file"
            return f"{path}: cannot be written ({why})"
    return None


def _draw_all(runs: list[RunMetrics], out: pathlib.Path, colors,
              warn: Callable[[str], None]) -> list[pathlib.Path]:
    written = []
    shown = []
    for panel in PANELS:
        fig = _figure(7, 4)
        if _draw(fig.add_subplot(), runs, panel, colors):
            path = out / f"{panel[0]}.png"
            try:
                _save(fig, path, 110)
            except ReportError:   # a ValueError too, but the file's, not the values'
                raise
            except (ValueError, OverflowError) as e:   # matplotlib's arithmetic on a value
                warn(f"{path.name}: not drawn (matplotlib: {type(e).__name__}: {e}); left out "
                     "of overview.png too")
                path.unlink(missing_ok=True)
                continue
            written.append(path)
            shown.append(panel)
        else:   # no run has this metric: an earlier report's PNG would pass for this one's
            (out / f"{panel[0]}.png").unlink(missing_ok=True)
    cols = 3
    n_rows = max(1, -(-len(shown) // cols))
    fig = _figure(5 * cols, 3.2 * n_rows)
    for i, panel in enumerate(shown):
        _draw(fig.add_subplot(n_rows, cols, i + 1), runs, panel, colors)
    fig.suptitle("rl-kernel: " + ", ".join(r.label for r in runs), fontsize=11)
    path = out / "overview.png"
    _save(fig, path, 90)
    return [path] + written


def _save(fig, path: pathlib.Path, dpi: int) -> None:
    """fig as PNG at `path`. Raises ReportError when the file cannot be written (a directory of
    that name, a full disk); matplotlib's own errors pass through."""
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as e:
        raise ReportError(f"{path}: cannot be written ({e.strerror or e})") from None
