"""What a person sees of a run: start-up lines, progress inside a step, warnings, the summary.

`RunWatch` is rank 0's observer of the loop (other ranks get a `NullWatch` and write nothing):
  - start-up lines once the model, tokenizer and prompts are loaded and checked (model, ranks,
    device, run dir, the update plan), on stderr;
  - on a terminal, a transient rich progress line: step i/N, bar, the phase (loading, rollout,
    reward, train update k/n, sync) and the elapsed time; nothing of it reaches a log file;
  - warnings, one line each, "rlk run: warning: ...";
  - the per-step files through runner/metrics.py (metrics.jsonl, completions.jsonl, TensorBoard).
The per-step line itself ("step i/N reward ...") is runner/evidence.py's Progress, on the same
console, so the live line and the permanent lines never tear each other.

`config_warnings` (settings that are valid but cannot do what they say) and `summary_lines` (the
closing lines) are plain functions for the CLI; this module imports neither torch nor rich at
import time, so `rlk --help` stays fast.
Does not: decide anything about the run or its numbers.
Tests: `.venv/bin/python -m pytest -q tests/test_watch.py`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re
import shlex
from typing import Any

from rlkernel.config import DEFAULT_GPU_MEMORY_UTILIZATION
from rlkernel.distributed.topology import SHARE_GPUS_ENV, gpus_shared

TMP_SUFFIX = re.compile(r"\.tmp-[0-9]+$")   # ASCII: \d takes other scripts' digits too
"""cli.py writes a fresh run into `<final>.tmp-<pid>` and renames it at the end."""
CKPT_DIR = "checkpoints"
"""A run directory's folder of checkpoints (runner/checkpointing.py); here, beside TMP_SUFFIX, so
that the CLI's checks of output paths name it without importing torch."""
FINAL_DIR = "final"
"""A run directory's folder of final weights (runner/export.py writes it; a resume replaces it),
here for the same reason."""


def display_run_dir(path: str | os.PathLike) -> str:
    """The name a run directory will have when the CLI publishes it (the .tmp-<pid> removed)."""
    return TMP_SUFFIX.sub("", str(path))


def config_warnings(cfg) -> list[str]:
    """One line per valid setting of a RunConfig that cannot act as the user likely expects."""
    out = []
    if cfg.save_every > cfg.steps:
        out.append(f"--save-every {cfg.save_every} > --steps {cfg.steps}: no checkpoint will be "
                   "written, so this run cannot be resumed")
    if cfg.never_learns:
        out.append("--n-samples-per-prompt 1 makes every GRPO advantage 0 and --kl-coef and "
                   "--entropy-coef are 0: every gradient is 0, the run cannot learn")
    custom_clip = (cfg.clip_eps_low is not None or cfg.clip_eps_high is not None
                   or cfg.clip_eps != 0.2)
    if custom_clip and cfg.updates_per_step == 1:
        out.append("--clip-eps/--clip-eps-low/--clip-eps-high cannot act with one update per "
                   "rollout batch (the importance ratio is 1, exactly in --mode invariant); give "
                   "--ppo-epochs or --mini-batches > 1")
    if cfg.device == "cpu" and gpus_shared():
        out.append(f"{SHARE_GPUS_ENV}=1 has no effect with --device cpu: CPU ranks are "
                   "processes of their own")
    if cfg.device == "cpu" and cfg.gpu_memory_utilization != DEFAULT_GPU_MEMORY_UTILIZATION:
        out.append(f"--gpu-memory-utilization {cfg.gpu_memory_utilization} has no effect with "
                   "--device cpu: the CPU rollout's KV pool holds every sample of the step at "
                   "once")
    return out + _ignored_flags(cfg)


def prompt_warnings(cfg, prompts: dict) -> list[str]:
    """A line when the --prompts file (`prompts`: PromptSource.describe()) holds fewer prompts
    than a step takes: each step then repeats some of them (file prompts cycle in order)."""
    count = prompts.get("count")   # the task's is steps x --n-prompts: never fewer
    if not isinstance(count, int) or count >= cfg.n_prompts:
        return []
    return [f"--prompts {cfg.prompts!r} holds {count} prompt(s), fewer than --n-prompts "
            f"{cfg.n_prompts}: every step repeats some of them (the file's prompts cycle in "
            "order)"]


def _ignored_flags(cfg) -> list[str]:
    """Flags another flag makes inert, given away from their defaults (a flag left at its
    default cannot be told from one given at it, and warning on defaults would be noise)."""
    out = []
    if cfg.model is not None and _moved(cfg, "model_seed"):
        out.append(f"--model-seed {cfg.model_seed} is ignored with --model: it seeds only the "
                   "random weights of the embedded tiny model")
    if not cfg.kl_coef and _moved(cfg, "kl_estimator"):
        out.append(f"--kl-estimator {cfg.kl_estimator} is ignored with --kl-coef 0: no KL term "
                   "is computed; give --kl-coef > 0 for it to act")
    if (cfg.clip_eps_low is not None and cfg.clip_eps_high is not None
            and _moved(cfg, "clip_eps")):
        out.append(f"--clip-eps {cfg.clip_eps} is ignored with both --clip-eps-low and "
                   "--clip-eps-high given: they set the two clip ranges")
    return out


def _moved(cfg, name: str) -> bool:
    """True when field `name` of the RunConfig `cfg` is off its default."""
    default = next(f.default for f in dataclasses.fields(cfg) if f.name == name)
    return getattr(cfg, name) != default


def _fmt(v: Any, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def summary_lines(steps: list[dict[str, Any]], run_dir: str | os.PathLike,
                  resumed_at: int | None = None) -> list[str]:
    """The closing lines of a run from its evidence step records (tolerates missing keys).
    `resumed_at`: the evidence step a resume started at (the totals are the whole run's, so the
    first line also says how many steps, and how long, this invocation ran)."""
    d = str(run_dir)
    if not steps:
        return [f"done: no steps recorded; run directory {d}"]

    def series(key: str) -> list[float]:
        return [s[key] for s in steps
                if isinstance(s.get(key), (int, float)) and not isinstance(s.get(key), bool)]

    def timing(key: str, records: list[dict[str, Any]] = steps) -> float:
        return math.fsum((s.get("timings") or {}).get(key, 0.0) or 0.0 for s in records)

    total = timing("step_s")
    n = len(steps)
    rewards = series("reward_mean")
    reward = (f"reward {_fmt(rewards[0], '.4f')} -> {_fmt(rewards[-1], '.4f')}"
              if rewards else "reward -")
    mism, toks = sum(series("logprob_mismatches")), sum(series("logprob_tokens"))
    skipped = sum(1 for s in steps if s.get("update_skipped"))
    unchanged = sum(1 for s in steps if s.get("version_changed") is False
                    and not s.get("update_skipped"))
    this = ""
    if resumed_at is not None and 0 <= resumed_at < n:
        mine = timing("step_s", steps[resumed_at:])
        this = f" ({n - resumed_at} of them in this resume, {mine:.1f} s)"
    lines = [
        f"done: {n} step{'s' if n != 1 else ''}{this} in {total:.1f} s ({total / n:.2f} s/step: "
        f"rollout {timing('rollout_s') / n:.2f}, train {timing('train_s') / n:.2f}, "
        f"sync {timing('export_audit_s') / n:.2f}); {reward}; train/rollout logprob "
        f"mismatches {mism}/{toks}"
        + (f"; {skipped} update(s) skipped" if skipped else "")
        + (f"; {unchanged} step(s) left the weights unchanged" if unchanged else ""),
        f"files: {d}/evidence.json, manifest.json, metrics.jsonl, completions.jsonl"
        + (", final/ (weights)" if os.path.isdir(os.path.join(d, "final")) else "")
        + f"; plots: rlk report {shlex.quote(str(d))} --out {shlex.quote(f'{d}/plots')}",
    ]
    return lines


class NullWatch:
    """The watch of a rank that shows and writes nothing (every rank but 0)."""

    def startup(self, **kw: Any) -> None:
        pass

    def phase(self, text: str) -> None:
        pass

    def step_started(self, step: int) -> None:
        pass

    def warn(self, text: str) -> None:
        pass

    def zero_gradient(self, step: int) -> None:
        pass

    def record(self, rec: dict[str, Any], completions: list[dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


class RunWatch(NullWatch):
    """Rank 0's watch over one run (module doc). `console`: a rich Console (stderr), shared with
    the per-step Progress; `start`: the first step this process runs (resume)."""

    def __init__(self, cfg, run_dir: str | os.PathLike, console: Any, start: int = 0) -> None:
        from rlkernel.runner.metrics import MetricsSink

        self.cfg = cfg
        self.run_dir = pathlib.Path(run_dir)
        self.console = console
        self.start = start
        self.sink = MetricsSink(self.run_dir, tensorboard=cfg.tensorboard, start=start)
        # config_warnings already said so before the run (the CLI prints it): saying it again
        # at step 0 would be the same warning twice.
        self._warned_zero = cfg.never_learns
        self._live = None
        self._task = None
        self._step = start
        if getattr(console, "is_terminal", False):
            from rich.progress import (BarColumn, Progress, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn)

            self._live = Progress(SpinnerColumn(), TextColumn("step {task.fields[label]}"),
                                  BarColumn(bar_width=20), TextColumn("{task.description}"),
                                  TimeElapsedColumn(), console=console, transient=True)
            self._task = self._live.add_task("starting", total=cfg.steps, completed=start,
                                             label=f"{start + 1}/{cfg.steps}")
            self._live.start()

    # ---- console

    def _print(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def startup(self, *, model: str, n_params: int, tokenizer: str, prompts: str, world: int,
                device: str) -> None:
        """The start-up lines (see module doc); called once the inputs are loaded and checked."""
        c = self.cfg
        ranks = (f"{world} rank{'s' if world > 1 else ''}: trainer DP{c.dp} x TP{c.tp} x CP{c.cp}"
                 f"{' +SP' if c.sp else ''}, rollout TP{c.rollout_tp} x CP{c.rollout_cp} "
                 f"({world // (c.rollout_tp * c.rollout_cp)} replica(s))")
        lr = f"lr {c.lr:g} {c.lr_schedule}" + (f", {c.lr_warmup_steps} warmup updates"
                                               if c.lr_warmup_steps else "")
        plan = (f"{c.steps} step{'s' if c.steps != 1 else ''} x {c.samples_per_step} samples ({c.n_prompts} prompts x "
                f"{c.n_samples_per_prompt}), {c.updates_per_step} update(s)/step ({c.ppo_epochs} "
                f"epoch(s) x {c.mini_batches} mini-batch(es), --loss-agg {c.loss_agg}, clip "
                f"[1-{c.clip_low:g}, 1+{c.clip_high:g}]), {lr}")
        for line in (f"model: {model}, {n_params / 1e6:.2f}M parameters; tokenizer: {tokenizer}",
                     f"data: {prompts}",
                     f"ranks: {ranks}; device: {device}, {c.dtype}, --mode {c.mode}",
                     f"plan: {plan}",
                     f"run dir: {display_run_dir(self.run_dir)}"
                     + (f" (resuming at step {self.start + 1}/{c.steps}, evidence step {self.start})"
                        if self.start else "")):
            self._print(line)

    def phase(self, text: str) -> None:
        """What the run is doing now (shown on a terminal only)."""
        if self._live is not None:
            self._live.update(self._task, description=text)
            self._live.refresh()  # show it now, not at the next 1/10 s tick

    def step_started(self, step: int) -> None:
        self._step = step
        if self._live is not None:
            self._live.update(self._task, label=f"{step + 1}/{self.cfg.steps}",
                              completed=step)

    def warn(self, text: str) -> None:
        self._print(f"rlk run: warning: {text}")

    def zero_gradient(self, step: int) -> None:
        """Called at a step whose every advantage is 0 with no KL/entropy term: warn once."""
        if not self._warned_zero:
            self._warned_zero = True
            self.warn(f"evidence step {step}: every GRPO advantage is 0 (equal rewards within "
                      "each group) and --kl-coef and --entropy-coef are 0: the gradient is 0 "
                      "and the weights do not change (warned once)")

    def record(self, rec: dict[str, Any], completions: list[dict[str, Any]]) -> None:
        """Write the step's metrics and completions (after its evidence is on disk)."""
        self.sink.record(rec, completions)
        if self._live is not None:
            self._live.update(self._task, completed=rec.get("step", self._step) + 1)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        self.sink.close()


def completion_rows(step: int, prompts: list[Any], completions: list[Any], texts: list[str],
                    rewards: list[float], advantages: list[float], group: int) -> list[dict]:
    """completions.jsonl rows of one step: sample i answers prompts[i // group]."""
    return [{"step": step, "sample_id": c.sample_id, "prompt": prompts[i // group].text,
             "response": texts[i], "reward": rewards[i], "advantage": advantages[i],
             "response_tokens": len(c.response_ids), "finish_reason": c.finish_reason}
            for i, c in enumerate(completions)]
