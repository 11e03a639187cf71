"""`rlk`, the command line: `rlk run`, `rlk compare`, `rlk report`, `rlk init-model`, `rlk export`.

`rlk run` turns flags into a validated RunConfig (one flag per field, generated from the dataclass
so the two cannot drift), checks the environment (model dir, prompts file, reward, git state),
hashes every input into the manifest (runner/inputs.py), writes the run into `<dir>.tmp-<pid>` and
renames it to its final name when the loop returns or fails after its first step. A failure before
the first step that is the user's (ValueError/OSError: a bad model or prompts file) leaves nothing
on disk. `--resume <dir>` of a SIGKILLed run finds its `<dir>.tmp-<pid>` (pid gone) and renames it
first. Every usage error, argparse's included, is one line; an unknown flag gets a "did you mean"
suggestion. Exit codes: 0 ok, 1 the run or command failed, 2 bad usage (invalid flag value,
missing input, dirty checkout, occupied run dir, a run dir another run is writing: it holds
`<dir>.lock`, runner/dirlock.py; changed inputs on resume), 130 Ctrl-C (one line: what was kept
and how to resume).

The topology (--dp/--tp/--cp/--sp/--rollout-*) is checked against the model's head counts and, under
torchrun, WORLD_SIZE before anything is created (rlkernel/distributed/topology.py).

Does not: run the RL loop (rlkernel/runner/loop.py), launch processes (rlkernel/distributed/launch.py),
or set any global torch state; nothing happens at import.

Run: `rlk run --steps 2`; `rlk compare [--quiet] runs/A runs/B`; `rlk report runs/A runs/B --out
plots/`; `rlk init-model --preset tiny --seed 0 --out m/`; `rlk export runs/A --out hf/`. Set
RLK_DEBUG=1 to get the traceback instead of a one-line error.
Tests: `.venv/bin/python -m pytest -q tests/test_cli_config.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import decimal
import difflib
import errno
import glob
import itertools
import math
import os
import pathlib
import re
import shlex
import shutil
import sys
import tempfile
import typing
import unicodedata

import rlkernel
from rlkernel import readfile
from rlkernel.config import (FP32_MAX, INPUT_PATHS, RESUME_MAY_CHANGE, SEED_LIMIT, ConfigError,
                             RunConfig, SampleFitError, field_docs, flag_name,
                             model_flag_error, path_problem)
from rlkernel.distributed.topology import (RANKS_PER_SHARED_GPU, SHARE_GPUS_ENV, dist_timeout_s,
                                           gpus_shared, launcher_world_size, validate_topology)
from rlkernel.model.config import PRESETS, Qwen3Config, tiny
from rlkernel.runner.evidence import EvidenceWriter, Progress, build_manifest, git_state
from rlkernel.runner.inputs import (check_located, check_unchanged, describe_inputs, input_paths,
                                    located, recorded_paths, relocated, same_input, sha256_file,
                                    startup_notes)
from rlkernel.runner.watch import (CKPT_DIR, FINAL_DIR, TMP_SUFFIX, config_warnings,
                                   prompt_warnings, summary_lines)
from rlkernel.termination import CtrlC, Terminated

SRC_DIR = pathlib.Path(rlkernel.__file__).resolve().parent.parent
"""The directory that holds the rlkernel package: the checkout whose git state is recorded."""


def _debug() -> bool:
    return os.environ.get("RLK_DEBUG", "") not in ("", "0")


def _one_line(text: str) -> str:
    """text on one line: each line break, with the blanks around it, becomes one space. Runs of
    blanks elsewhere stay — they may be inside a quoted value the user gave (--run-dir 'a  b'),
    which an error must name as it was typed (a repr'd value shows its own breaks as \\n)."""
    return re.sub(r"[ \t]*[\r\n\v\f]+[ \t]*", " ", text).strip()


def _error(cmd: str, msg: object, code: int) -> int:
    text = _one_line(str(msg)) or type(msg).__name__
    print(f"rlk {cmd}: error: {text}", file=sys.stderr)
    return code


# ---------------------------------------------------------------------------------------------
# parser


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: `rlk run: error: --steps: '1.5' is not an integer (see
    rlk run --help)` instead of the whole usage block (README: bad flags give one line).
    Prefixes of long flags are not accepted (`--temp 0.7` is an error, not `--temperature`): a
    recorded run must name exactly the flags it was given, and a later flag sharing a prefix
    would silently change what an old command line means."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        text = _one_line(message).removeprefix("argument ")
        self.exit(2, f"{self.prog}: error: {text} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        # argparse takes a token for a value only if its regex calls it a negative number, and
        # that regex misses '-1e-5', '-inf', '-nan' ("expected one argument" for --lr -1e-5, so
        # RunConfig never says what range is allowed). The `--flag=value` form is argparse's own
        # documented way to pass a value that starts with '-'; subparsers come back through here.
        args = sys.argv[1:] if args is None else list(args)
        one_value = {s for a in self._actions if a.nargs is None for s in a.option_strings}
        return super().parse_known_args(_attach_negative_numbers(args, one_value), namespace)


def _attach_negative_numbers(args: list[str], one_value: set[str]) -> list[str]:
    """`--lr -1e-5` -> `--lr=-1e-5` for each flag in `one_value` (those taking one value) followed
    by a token float() reads that starts with '-'; nothing after a `--` is touched."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        if out and out[-1] in one_value and arg.startswith("-") and _is_float(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _plain_digits(value: str, what: str) -> None:
    """Refuse what Python's int()/float() read but no one means on a command line: digit
    groups ('1_0' is 10) and non-ASCII digits ('١' is 1), which a config hash then records as
    another number than the text shows. ArgumentTypeError."""
    if "_" in value or not value.isascii():
        raise argparse.ArgumentTypeError(f"{value!r} is not {what} (ASCII digits, no '_')")


def _integer(value: str) -> int:
    """An int flag value; ArgumentTypeError (argparse names the flag) for '1.5', 'x', '',
    '1_0', non-ASCII digits."""
    _plain_digits(value, "an integer")
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None


def _number(value: str) -> float:
    """A float flag value ('nan'/'inf' parse here; RunConfig says what range is allowed); -0 is
    +0.0. The one place every float flag is parsed. ArgumentTypeError for text that is not
    a number, digit groups ('1_0') and non-ASCII digits."""
    _plain_digits(value, "a number")
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if x == 0.0:
        if decimal.Decimal(value) != 0:
            # float() reads '1e-400' as 0.0 (underflow): `--clip-grad 1e-400` turned clipping off
            # while 1e-45 is refused. It stands for the smallest float64 of its sign, 5e-324:
            # every float field refuses that (below FP32_TINY) with its own allowed range.
            return _AsTyped(value, math.copysign(5e-324, x))
        # '-0' is 0: as -0.0 it was another config hash, and rlk compare called `--kl-coef 0`
        # and `--kl-coef -0` two configurations.
        return 0.0
    return x if math.isfinite(x) else _AsTyped(value)


class _AsTyped(float):
    """A flag value that RunConfig's message shows as the user typed it: repr() turns '-nan' and
    'NaN' into nan and '1e999' into inf, values nobody typed, and a literal that underflows
    stands for ±5e-324. Only those values get it: every float field refuses them, so none
    reaches a valid config."""

    def __new__(cls, text: str, value: float | None = None) -> _AsTyped:
        self = super().__new__(cls, text if value is None else value)
        self.text = text.strip()
        return self

    def __repr__(self) -> str:
        return self.text


# Spellings users bring from TRL/verl/OpenRLHF, accepted as second names of our flags (messages
# name the field's own flag). Reviewed like flags: tests/test_cli_config.py lists them.
RUN_FLAG_ALIASES = {
    "lr": ("--learning-rate",),
    "n_samples_per_prompt": ("--num-generations",),
    "temperature": ("--rollout-temperature",),
    # The name before issue 14, when the microbatch size was part of the canonical spec; it is
    # a memory knob now, so old command lines keep working and mean the same memory.
    "micro_batch_tokens": ("--token-budget",),
}


# `rlk run --help` in sections: the RunConfig field that opens each one (fields keep their
# dataclass order, which already runs theme by theme).
RUN_FLAG_GROUPS = {
    "model": "model, prompts and reward",
    "steps": "steps and sampling",
    "kl_coef": "loss and PPO updates (GRPO/PPO)",
    "lr_warmup_steps": "optimizer and non-finite gradients",
    "micro_batch_tokens": "numerics and parallel layout",
    "gpu_memory_utilization": "rollout engine",
    "run_dir": "run directory, checks and device",
}


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """One flag per RunConfig field, in the sections of RUN_FLAG_GROUPS. Defaults are left to the
    dataclass (SUPPRESS), and values are not constrained here (no argparse `choices`), so every
    check and message lives in RunConfig."""
    hints = typing.get_type_hints(RunConfig)
    docs = field_docs()
    group = p
    for f in dataclasses.fields(RunConfig):
        if f.name in RUN_FLAG_GROUPS:
            group = p.add_argument_group(RUN_FLAG_GROUPS[f.name])
        kind = _unoptional(hints[f.name])
        text = docs.get(f.name, "")
        names = (flag_name(f.name), *RUN_FLAG_ALIASES.get(f.name, ()))
        if kind is bool:
            # A flag a resume may change needs its --no- form too: else a resume that turned it
            # on could never turn it off again (resume applies only the flags given).
            action = (argparse.BooleanOptionalAction if f.name in RESUME_MAY_CHANGE
                      else "store_true")
            group.add_argument(*names, dest=f.name, action=action,
                               default=argparse.SUPPRESS, help=text.replace("%", "%%"))
            continue
        conv = {int: _integer, float: _number}.get(kind, str)
        metavar = {int: "N", float: "X"}.get(kind, f.name.split("_")[-1].upper())
        help_text = f"{text} (default: {f.default})".replace("%", "%%")
        group.add_argument(*names, dest=f.name, type=conv, metavar=metavar,
                           default=argparse.SUPPRESS, help=help_text)


def _unoptional(kind):
    """`float | None` -> float (a flag gives the value; leaving it out keeps the None default)."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if len(args) == 1 and type(None) in typing.get_args(kind) else kind


def _version() -> str:
    """`rlk --version`: the package and torch versions, without importing torch (slow)."""
    import importlib.metadata

    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"rlk {rlkernel.__version__} (torch {torch_version}, python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    """The `rlk` parser with its subcommands."""
    parser = _Parser(
        prog="rlk", description="Bitwise-reproducible RL post-training across parallel topologies.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run RL training and write its evidence",
                         description="Run RL training; writes manifest.json and evidence.json.")
    _add_run_flags(run)
    run.set_defaults(func=cmd_run)

    cmp = sub.add_parser("compare", help="compare the evidence of two runs (exit 0 iff identical)",
                         description="Compare two runs field by field; exit 0 iff identical.",
                         epilog="exit status: 0 identical, 1 different (an incomplete run "
                                "included), 2 a usage error: a run that cannot be read, or RUN_A "
                                "and RUN_B the same run (a run compared with itself proves "
                                "nothing).")
    cmp.add_argument("run_a", metavar="RUN_A")
    cmp.add_argument("run_b", metavar="RUN_B")
    cmp.add_argument("--quiet", action="store_true",
                     help="print only the fields that differ and the verdict line (and the "
                          "note when the runs are two configurations or read different "
                          "inputs)")
    cmp.set_defaults(func=cmd_compare)

    rep = sub.add_parser("report", help="draw PNG plots of the per-step metrics of runs",
                         description="Plot the per-step metrics (metrics.jsonl, else "
                                     "evidence.json) of one or several runs as PNG files.")
    rep.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    rep.add_argument("--out", required=True, metavar="DIR",
                     help="output directory (created if missing; PNGs in it are replaced; "
                          "not a symbolic link)")
    rep.set_defaults(func=cmd_report)

    init = sub.add_parser("init-model", help="write a randomly initialised model directory",
                          description="Write a Hugging Face-layout model with random weights.")
    init.add_argument("--preset", required=True, choices=list(PRESETS), help="model shapes")
    init.add_argument("--seed", type=_integer, default=0, help="initialisation seed (default: 0)")
    init.add_argument("--out", required=True, metavar="DIR",
                      help="output directory (must not exist, or be empty)")
    init.set_defaults(func=cmd_init_model)

    exp = sub.add_parser(
        "export", help="write a run's trained weights as a Hugging Face model directory",
        description="Write the weights of RUN after a step (default: the final weights) as a "
                    "Hugging Face directory (config.json, model.safetensors in the parameter "
                    "dtype, the input model's tokenizer files), after checking every tensor "
                    "against the SHA-256 the run recorded. Steps with weights: the last one "
                    "(RUN/final) and those with a --save-every checkpoint.")
    exp.add_argument("run", metavar="RUN", help="run directory written by rlk run")
    # No type=int: argparse's "invalid int value" names neither the rule nor the run's steps;
    # cmd_export parses it (export.parse_step).
    exp.add_argument("--step", default=None, metavar="N",
                     help="evidence step (from 0) whose weights to export (default: the final "
                          "weights of a complete run)")
    exp.add_argument("--out", required=True, metavar="DIR",
                     help="output directory (must not exist, or be empty)")
    exp.set_defaults(func=cmd_export)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser:
    """The parser of subcommand `name` (the top-level parser for None)."""
    for action in parser._actions:  # argparse keeps subparsers only there
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser


# Other commands' (and tools') names for `rlk run`'s output directory: spelling distance
# offered --tp for --out. (export, init-model and report require --out: argparse names it.)
_MEANT = {("run", "--out"): "--run-dir", ("run", "--output-dir"): "--run-dir",
          ("run", "--output"): "--run-dir"}


def _unknown_args(parser: argparse.ArgumentParser, command: str | None,
                  extras: list[str]) -> int:
    """One line for the first argument nobody took, with the closest flag when there is one."""
    sub = _subparser(parser, command)
    where = f"rlk {command}" if command else "rlk"
    arg = extras[0]
    if arg.startswith("-") and not _is_float(arg):   # '-5' is a stray value, not a flag
        flag = arg.split("=", 1)[0]
        known = sorted({s for a in sub._actions for s in a.option_strings})
        longer = [k for k in known if flag.startswith("--") and k.startswith(flag)]
        meant = _MEANT.get((command, flag))   # spelling distance finds no such flag
        close = longer or ([meant] if meant in known else []) \
            or difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        hint = (f"did you mean {' or '.join(close)}? (flags are not abbreviated)" if longer
                else f"did you mean {close[0]}?" if close else f"{where} --help lists every flag")
        msg = f"unknown flag {flag}; {hint}"
    else:
        msg = f"unexpected argument {arg!r}; see {where} --help"
    print(f"{where}: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of `rlk`. Returns the exit code (argparse usage errors included)."""
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
    except SystemExit as e:  # --help, --version, or an argparse usage error (already printed)
        return e.code if isinstance(e.code, int) else 2
    if extras:
        return _unknown_args(parser, getattr(args, "command", None), extras)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:   # every command: `init-model --preset tiny --preset qwen3-8b` wrote a 16 GB model
        _one_setting_per_field(_subparser(parser, args.command),
                               sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        return _error(args.command, e, 2)
    # SIGTERM/SIGHUP unwind every command from its first moment: killed silently by the default
    # action, a run validating its flags left RUN.lock, and init-model and export their staging
    # directory (.OUT.tmp-*, up to the model's size); unwinding releases and removes them.
    previous = _exit_on_sigterm()
    try:
        code = args.func(args)
        sys.stdout.flush()   # a closed pipe is seen here, not in the interpreter's exit
        return _lost_signal(previous, args.command, code)
    except Terminated as e:
        if _debug():
            raise
        print(f"rlk {args.command}: terminated", file=sys.stderr)
        return e.code
    except BrokenPipeError:  # `rlk compare A B | head`: the reader left; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())   # so the interpreter's final flush stays quiet
        return 141   # 128 + SIGPIPE, what a shell tool stopped by a closed pipe reports
    except KeyboardInterrupt:  # outside a run (rlk run reports its own): one line, no traceback
        if _debug():
            raise
        print(f"rlk {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        _restore_sigterm(previous)


# ---------------------------------------------------------------------------------------------
# rlk run


def _dir_is_free(d: pathlib.Path) -> bool:
    return not d.exists() or (d.is_dir() and not any(d.iterdir()))


def _why_not_free(d: pathlib.Path) -> str:
    """Why `d` (not _dir_is_free) cannot be a new directory: a file given by mistake is named as
    one, not as a directory that holds something."""
    if d.is_file():
        return "is a file, not a directory"
    if not d.is_dir():
        return "exists and is not a directory"
    return "exists and is not an empty directory"


def _non_utf8(*named: tuple[str, str]) -> str | None:
    """The usage error for the first (name, path) whose bytes are not UTF-8 (argv's surrogate
    escapes), None when all are: every command refuses them before any work, as `rlk run`'s
    validators do — the outputs record and print the paths, which a UTF-8 stream cannot carry
    (export wrote its model and then failed printing where)."""
    for name, value in named:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return (f"{name} {value!r}: must be a UTF-8 path (rlk records and prints the paths "
                    "it reads and writes)")
    return None


def _line_breaking(*named: tuple[str, str | None]) -> str | None:
    """The usage error for the first (name, path) of a path the command writes and prints on
    stdout (its one-line result) that holds a control character or a line or paragraph
    separator: `--run-dir 'a\\nb'` made the result two lines. None when none does (or is given)."""
    for name, value in named:
        bad = next((ch for ch in value or "" if unicodedata.category(ch) in ("Cc", "Zl", "Zp")),
                   None)
        if bad is not None:
            what = "control character" if unicodedata.category(bad) == "Cc" else "line separator"
            return (f"{name} {_shown(value)}: has the {what} {bad!r}; rlk prints this path as "
                    "one line of its output: give a name without control characters or line "
                    "separators")
    return None


_SHOWN_CHARS = 80
"""Longest path a usage error echoes whole; a longer one is cut in the middle."""


def _shown(value: str) -> str:
    """`value` quoted for a message, cut to its start and end when longer than _SHOWN_CHARS
    (a 300-character name took the terminal's screen), with its length."""
    if len(value) <= _SHOWN_CHARS:
        return repr(value)
    return f"{value[:48] + '...' + value[-24:]!r} ({len(value)} characters)"


def _unusable_path(*named: tuple[str, str | None]) -> str | None:
    """The usage error for the first (name, path) that cannot even be looked up, for a reason
    other than its absence or a link loop (each command's checks name those): a name longer
    than the file system allows (ENAMETOOLONG), a directory it may not search (EACCES).
    pathlib's exists/is_dir/is_file raise them: a traceback from the command's first check.
    None when every given path can be looked up."""
    for name, value in named:
        if not value:   # left out; '' has its own message
            continue
        try:
            os.lstat(value)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                continue
            hint = "; give a shorter path" if e.errno == errno.ENAMETOOLONG else ""
            return f"{name} {_shown(value)}: cannot be looked up ({e.strerror or e}){hint}"
    return None


_STAGING_BYTES = 32
"""Most bytes model/checkpoint.save_checkpoint adds to an output's name for the directory it
writes first (`.NAME.tmp-PID-HEX`, renamed to NAME at the end)."""


def _name_too_long(flag: str, value: str) -> str | None:
    """The usage error for a new-directory flag (export / init-model --out) whose last name fits
    the file system but not with the staging suffix (_STAGING_BYTES): the write failed after
    all the work (ENAMETOOLONG, exit 1). None when it fits."""
    out = pathlib.Path(os.path.abspath(value))
    parent = next((p for p in out.parents if p.is_dir()), pathlib.Path("/"))
    try:
        limit = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):   # no such limit known here
        return None
    size = len(os.fsencode(out.name))
    if size + _STAGING_BYTES <= limit:
        return None
    return (f"{flag} {_shown(value)}: its last name has {size} bytes; the output is written "
            f"first under that name and up to {_STAGING_BYTES} bytes more, which must fit the "
            f"{limit} bytes a name may have here: give a name of at most "
            f"{limit - _STAGING_BYTES} bytes")


def _bad_paths(*named: tuple[str, str]) -> str | None:
    """The usage error for the first of a command's (name, path) arguments that no command
    takes, before any work: '' (which the file system reads as the current directory: report
    wrote its PNGs there, compare and export read the run there), only whitespace or with a
    name of only whitespace ('r/ ': a name the file system takes, from a quoting slip), not
    UTF-8 (_non_utf8), or not looked up (_unusable_path). None when all are usable."""
    for name, value in named:   # worded as rlk run's RunConfig words --run-dir '' and ' '
        if (why := path_problem(value)) is not None:
            return f"{name} {value!r}: {why}"
    return _non_utf8(*named) or _unusable_path(*named)


def _not_a_directory(flag: str, value: str, give: str,
                     usable: typing.Callable[[pathlib.Path], bool]) -> str | None:
    """The usage error for an output-directory flag whose value cannot be that directory: an
    ancestor is a file (mkdir would fail with a bare OS error after the work), the value is a
    symbolic link (_why_not_a_link) or exists and is not a directory. None otherwise. `give`
    says what the flag takes ("a new or empty directory"); `usable(target)`: whether a link's
    target could be given instead."""
    d = pathlib.Path(value)
    blocked = next((p for p in d.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        return (f"{flag} {value!r}: cannot be created, {str(blocked)!r} is a file, not a "
                f"directory; give {give}")
    if d.is_symlink():
        return f"{flag} {value!r}: {_why_not_a_link(d, give, usable)}"
    if d.exists() and not d.is_dir():
        return f"{flag} {value!r}: {_why_not_free(d)}; give {give}"
    return None


def _occupied(flag: str, value: str) -> str | None:
    """The usage error for a new-directory flag (`--run-dir`, `--out`) whose value is taken, in
    one wording for every command; None when the directory is free."""
    d = pathlib.Path(value)
    wrong = _not_a_directory(flag, value, "a new or empty directory", _dir_is_free)
    if wrong is not None:
        return wrong
    if _is_cwd(d):     # empty, but its rename-into-place fails (busy) after all the work
        return (f"{flag} {value!r}: must name a new directory, not the current one (the "
                "output is built beside it and renamed into place)")
    if d.is_dir() and os.path.ismount(d):   # its rmdir fails (busy) after all the work
        return (f"{flag} {value!r}: is a mount point, which the output (built beside it and "
                f"renamed into place) cannot replace; give a new directory inside it")
    if _dir_is_free(d):
        return None
    return f"{flag} {value!r}: {_why_not_free(d)}; give a new or empty directory"


def _is_cwd(d: pathlib.Path) -> bool:
    # realpath, not Path.resolve: a symbolic link loop must reach the checks after this one
    # (it raised RuntimeError, a traceback instead of a usage error)
    try:
        return os.path.realpath(d) == os.path.realpath(pathlib.Path.cwd())
    except OSError:     # the current directory was removed: d cannot be it
        return False


def _in_run_owned(flag: str, value: str) -> str | None:
    """The usage error for an output directory at or under a run's checkpoints/ or final/ (a
    directory named so beside a manifest.json). That run's saves replace a step-N entry in
    checkpoints/ and remove step-*.tmp-* ones (an export to checkpoints/step-000009 was removed
    by the save of step 9), and a resume replaces final/ whole (a report's PNGs written there
    went with it), so both folders are left to the run; and the run's own top level, whose
    files are its record (a report's PNGs landed beside evidence.json unwarned: a breaker). None
    elsewhere (a folder under the run, e.g. RUN/plots, is free)."""
    real = pathlib.Path(os.path.realpath(value))
    try:
        top = (real / "manifest.json").is_file()
    except OSError:
        top = False
    if top:
        return (f"{flag} {value!r}: is the run directory {str(real)!r} (its manifest.json is "
                "there), whose files are the run's record; give a directory beside or under "
                f"it, e.g. {os.path.join(value, 'plots')!r}")
    for q in (real, *real.parents):
        try:
            ours = q.name in _RUN_OWNED and (q.parent / "manifest.json").is_file()
        except OSError:   # a folder we may not look into is not known to be a run's
            ours = False
        if ours:
            return (f"{flag} {value!r}: lies in {str(q)!r}, the {_RUN_OWNED[q.name]} of the "
                    f"run {str(q.parent)!r}, which that run's saves and resumes rewrite; give "
                    "a directory outside it")
    return None


_RUN_OWNED = {CKPT_DIR: "checkpoints directory", FINAL_DIR: "final weights directory"}


def _uncreatable(flag: str, value: str) -> str | None:
    """The usage error for a new-directory flag whose directory cannot be made where it is
    (export and init-model found out only when writing, after all the work: exit 1): an
    ancestor is a symbolic link that leads nowhere (a loop, a missing target), or the nearest
    existing one takes no new directory (/proc, /sys, read-only), which a probe directory made
    and removed there tells. None when it can be made."""
    for p in pathlib.Path(os.path.abspath(value)).parents:
        if p.is_symlink() and not p.exists():   # exists() is False for a loop, no error
            return (f"{flag} {value!r}: cannot be created, {str(p)!r} is a symbolic link that "
                    "leads nowhere (a loop, or a missing target); give a new or empty directory")
        if p.exists():
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".rlk-probe-", dir=p))
            except OSError as e:
                return (f"{flag} {value!r}: cannot create a directory in {str(p)!r} "
                        f"({e.strerror or e}); give a writable new directory")
            return None
    return None


def _why_not_a_link(d: pathlib.Path, give: str = "a new or empty directory",
                    usable: typing.Callable[[pathlib.Path], bool] = _dir_is_free) -> str:
    """Why the symbolic link `d` cannot be an output-directory flag's value: a new directory is
    built beside it and renamed into place, and a rename neither follows a link nor replaces one
    by a directory (it failed after all the work); and report writes where it is told, not
    where a link leads. Its target, when `usable`, is offered instead."""
    target = os.readlink(d)
    if not d.exists():
        return (f"is a symbolic link to {target!r}, which does not exist; give {give}, not a "
                "link")
    hint = f" (e.g. its target {str(d.resolve())!r})" if usable(d) else ""
    return f"is a symbolic link to {target!r}; give {give}{hint}, not a link"


def _choose_run_dir(cfg: RunConfig) -> pathlib.Path:
    """Final run directory: --run-dir, else the first free default name (_default_run_dirs).
    Raises ConfigError when --run-dir is occupied."""
    if cfg.run_dir is not None:
        d = pathlib.Path(cfg.run_dir)
        if TMP_SUFFIX.search(d.name):   # the name rlk run gives a run before it publishes it
            raise ConfigError(f"--run-dir {cfg.run_dir!r}: a name ending in .tmp-<digits> is "
                              "what an unfinished run lies under (a later --resume or run "
                              "would take it for a killed one); give another name")
        taken = _occupied("--run-dir", cfg.run_dir) or _in_run_owned("--run-dir",
                                                                            cfg.run_dir)
        if taken:
            raise ConfigError(taken)
        return d
    return next(_default_run_dirs(cfg))


def _cwd_shown() -> str:
    """" '/the/cwd'", or "" when the current directory is gone (getcwd fails)."""
    try:
        return f" {os.getcwd()!r}"
    except OSError:
        return ""


def _default_run_dirs(cfg: RunConfig) -> typing.Iterator[pathlib.Path]:
    """The free default run directories, in order: runs/<UTC second>-<config hash>, then that
    name with -1, -2, ... A name is taken while it exists, while a run writes it (its
    `<name>.tmp-<pid>` or `<name>.lock` is there: the same config started twice within one
    second, the first not yet published) or once a killed run left its temporary."""
    from rlkernel.runner.dirlock import lock_path

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = pathlib.Path("runs") / f"{stamp}-{cfg.fingerprint()[:10]}"
    for n in itertools.count():
        d = base if n == 0 else base.with_name(f"{base.name}-{n}")
        if not (d.exists() or d.is_symlink() or lock_path(d).exists()
                or any(d.parent.glob(f"{glob.escape(d.name)}.tmp-*"))):
            yield d


_STALE_LISTED = 3
"""Stale temporaries named one by one in the start-up warning (the rest are counted)."""


def _stale_temporaries(final: pathlib.Path) -> list[pathlib.Path]:
    """The `<name>.tmp-<pid>` run directories (holding a manifest.json) beside `final` whose
    rlk run is gone: SIGKILLed (or the machine went down) before it could publish them. A
    temporary whose pid is alive is a run in progress and is not listed."""
    parent = final.parent if str(final.parent) else pathlib.Path(".")
    try:
        found = sorted(parent.glob("*.tmp-*"))
    except OSError:
        return []
    return [p for p in found if _pid_of(p) is not None and p.is_dir()
            and (p / "manifest.json").is_file() and not _alive(_pid_of(p))]


def _warn_stale_temporaries(final: pathlib.Path) -> None:
    """One warning per stale temporary beside `final` (_stale_temporaries), naming it, the
    gone pid and what to do with it: `rlk run --resume <that directory>` when it holds a
    checkpoint (by its own path: its name may have several such temporaries; a name another
    run has published since must be moved away from first), else delete it (or keep its
    partial evidence). Nothing is deleted: it may be someone's data."""
    stale = _stale_temporaries(final)
    lines = []
    for p in stale[:_STALE_LISTED]:
        name = p.with_name(p.name.rpartition(".tmp-")[0])
        ckpt = p / "checkpoints"
        what = ("it has no checkpoint to resume from; delete it, or rename it to keep its "
                "partial evidence")
        if ckpt.is_dir() and any(ckpt.glob("step-*")):
            what = (f"resume it with: rlk run --resume {_sh(p)}"
                    if not (name / "manifest.json").exists() else
                    f"its name is the published run {name}'s: to resume it, move it to a free "
                    f"name (e.g. mv {_sh(p)} {_sh(f'{name}-resumed')}) and rlk run --resume "
                    "that")
        lines.append(f"{p} was left by an rlk run that was killed (pid {_pid_of(p)} is not "
                     f"running); {what}")
    if len(stale) > _STALE_LISTED:
        lines.append(f"and {len(stale) - _STALE_LISTED} more such directories in "
                     f"{stale[0].parent}")
    _warn(lines)


_MODEL_EXPECTED = ("give a Hugging Face model directory with config.json and *.safetensors "
                   "weights, or leave out --model for the embedded tiny model")


def _check_model_dir(model: str) -> None:
    """--model names a directory holding config.json and *.safetensors: refused here as a usage
    error, not by the checkpoint loader after the run has started (exit 1). Only existence is
    checked; what the files hold is the loader's to report. Raises ConfigError."""
    d = pathlib.Path(model)
    if not d.is_dir():
        what = "is a file, not a directory" if d.exists() else "no such directory"
        raise ConfigError(model_flag_error(model, f"{what}; {_MODEL_EXPECTED}"))
    missing = [what for what, present in (("no config.json", (d / "config.json").exists()),
                                          ("no *.safetensors weights",
                                           any(d.glob("*.safetensors"))))
               if not present]
    if missing:
        what = "is an empty directory" if not any(d.iterdir()) else " and ".join(missing)
        raise ConfigError(model_flag_error(model, f"{what}; {_MODEL_EXPECTED}"))


def _check_inputs(cfg: RunConfig) -> None:
    """Cheap existence checks before any work. Raises ConfigError."""
    if cfg.model is not None:
        _check_model_dir(cfg.model)
    what = None if cfg.prompts is None else readfile.not_a_file(cfg.prompts)
    if what is not None:
        raise ConfigError(f"--prompts {cfg.prompts!r}: {what}; give a JSONL or Parquet "
                          "prompts file, or leave out --prompts for the built-in arithmetic task")
    gpus_shared()   # a malformed RLK_SHARE_GPUS, on every device; before the no-GPU error
    dist_timeout_s()   # a malformed RLK_DIST_TIMEOUT_S, before a run directory exists
    if cfg.device == "cuda":
        _import_torch()
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device 'cuda': no CUDA device is available here; allowed: cpu")


def _check_data(cfg: RunConfig) -> dict[str, typing.Any]:
    """Load what the run reads besides weights, before any work: the reward function, the
    whole prompts file, the chat template (rendered once). Returns the manifest's additions
    {"reward": ..., "prompts": {"source", "count", "sha256" of the bytes parsed | "seed"},
    "tokenizer_files": ..., "input_paths": ...} (runner/inputs.input_paths).
    Raises ConfigError naming the flag and the value."""
    from rlkernel.data.chat import ChatTemplateError, load_chat_template
    from rlkernel.data.prompts import PromptFileError
    from rlkernel.data.rewards import RewardError, load_reward
    from rlkernel.data.tasks import prompt_source, task_description

    try:
        reward = load_reward(cfg.reward)
        # Parsed in full (the loop parses it again, and checks it read these bytes): a bad line
        # 2,000 is then a usage error now, not a failure after the model has loaded. The task's
        # prompts are the loop's to generate (steps x n of them).
        prompts = (task_description(cfg.n_prompts, cfg.steps, cfg.seed) if cfg.prompts is None
                   else prompt_source(cfg.prompts, n_prompts_per_step=cfg.n_prompts,
                                      steps=cfg.steps, seed=cfg.seed, input_key=cfg.input_key,
                                      label_key=cfg.label_key).describe())
        if cfg.apply_chat_template:
            load_chat_template(cfg.model).render("probe")
        tokenizer_files = _tokenizer_hashes(cfg)
    except PromptFileError as e:
        # Its message starts "FILE:LINE: " or "FILE: ": one prefix for every content problem.
        raise ConfigError(f"--prompts {e}") from None
    except ChatTemplateError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith("--") else f"--apply-chat-template: {msg}") \
            from None
    except (RewardError, OSError) as e:
        raise ConfigError(str(e)) from None
    return {"reward": reward.describe(), "prompts": prompts,
            "tokenizer_files": tokenizer_files, "input_paths": input_paths(cfg)}


def _resume_data(where: RunConfig, src: pathlib.Path) -> dict[str, typing.Any]:
    """`_check_data` for --resume. A MODULE:FUNC reward is imported by Python's module search
    from the current directory (it has no path to record); resumed from another directory it
    failed with advice to give another --reward, which a resume does not take. That failure
    names the run's module file as its manifest recorded it instead. Raises ConfigError."""
    try:
        return _check_data(where)
    except ConfigError as e:
        if "cannot import module" not in str(e) or not str(e).startswith("--reward"):
            raise
        try:
            reward = readfile.read_json(src / "manifest.json").get("reward")
            was = reward.get("source_file") if isinstance(reward, dict) else None
        except (OSError, ValueError, AttributeError):
            was = None
        spec = where.reward
        module = spec.rpartition(":")[0] if spec else spec
        where_was = f"; when the run started it was {was}" if isinstance(was, str) else ""
        raise ConfigError(f"--resume {str(where.resume)!r}: the run's --reward {spec!r} "
                          f"cannot be imported from here ({os.getcwd()}): module {module!r} is "
                          f"found by Python's module search, not by a recorded path{where_was}; "
                          "resume from that module's directory or put it on PYTHONPATH") \
            from None


def _tokenizer_hashes(cfg: RunConfig) -> dict[str, str]:
    """The manifest's "tokenizer_files". Raises ConfigError naming --model and the file that is
    there but cannot be read (a FIFO, a directory, a link to nowhere)."""
    # Imported only now: it pulls in torch (seconds), which the checks before do not need.
    _import_torch()
    from rlkernel.runner.export import tokenizer_file_hashes

    try:
        return tokenizer_file_hashes(cfg.model)
    except OSError as e:
        why = readfile.unreadable_reason(e.filename, e) if e.filename else str(e)
        raise ConfigError(model_flag_error(str(cfg.model), f"cannot read {e.filename} ({why}); "
                                           "tokenizer files are hashed into the manifest")
                          ) from None


def _model_shape(model: str | None) -> Qwen3Config | None:
    """The architecture of --model (`model`; None: the embedded tiny model) for the topology
    check; None when its config.json cannot be read (the checkpoint loader then reports it,
    with its own message, before any step). Raises ConfigError for a readable config whose
    shape the kernels cannot run exactly (model/config.validate_model_config), before any
    process starts."""
    if model is None:
        return tiny()
    path = pathlib.Path(model) / "config.json"
    try:
        d = readfile.read_json(path)
        return Qwen3Config.from_hf_dict(d, source=str(path)) if isinstance(d, dict) else None
    except ConfigError as e:   # a shape the kernels cannot run (its message names the file)
        raise ConfigError(model_flag_error(model, str(e))) from None
    except (OSError, ValueError):
        return None


def _model_where(model: str | None) -> str:
    return f"{model}/config.json" if model is not None else "the embedded tiny model"


def _check_positions(m: Qwen3Config | None, model: str | None, prompt_len: int,
                     response_len: int) -> None:
    """One whole sample must fit the model's max_position_embeddings: RoPE tables grow on
    demand, so nothing downstream refuses positions past it, and a too-long sample would
    silently run out of the trained range. Raises ConfigError."""
    if m is not None and prompt_len + response_len > m.max_position_embeddings:
        most = m.max_position_embeddings
        if most - prompt_len >= 1:
            allowed = (f"--max-response-len {most - prompt_len} at most with --max-prompt-len "
                       f"{prompt_len}")
        elif most - response_len >= 1:
            allowed = (f"--max-prompt-len {most - response_len} at most with "
                       f"--max-response-len {response_len}")
        else:
            allowed = f"the two at most {most} together"
        raise ConfigError(f"--max-prompt-len {prompt_len} + --max-response-len {response_len} "
                          f"= {prompt_len + response_len}: must be <= max_position_embeddings="
                          f"{most} of {_model_where(model)}; allowed: "
                          f"{allowed}")


def _new_config(given: dict) -> RunConfig:
    """RunConfig(**given); where its sample-fit check fails (a sample longer than
    --micro-batch-tokens), the model's positions are checked first (`_check_positions`): the
    fit check's offer to raise --micro-batch-tokens would be refused there next (found by a
    new-user trial). Raises ConfigError."""
    try:
        return RunConfig(**given)
    except SampleFitError as e:
        try:
            m = _model_shape(given.get("model"))
        except ConfigError:      # the model's own error comes later, in its place
            m = None
        _check_positions(m, given.get("model"), *e.sample_tokens)
        raise


def _check_topology(cfg: RunConfig) -> Qwen3Config | None:
    """--tp/--cp/--sp/--rollout-* against the model's heads and, under torchrun, WORLD_SIZE, the
    longest sample against the model's positions, and --device cuda against the head_dim the
    CUDA kernels take. Runs before any process starts or directory is made. Returns the model's
    shape it checked (`_model_shape`; the manifest's inputs describe it). Raises ConfigError."""
    m = _model_shape(cfg.model)
    where = _model_where(cfg.model)
    # The Triton attention kernel tiles a head as tl.arange(0, head_dim): a power of two. Refused
    # here, not at step 0 after every rank has loaded the model.
    if m is not None and cfg.device == "cuda" and (m.head_dim & (m.head_dim - 1)
                                                   or not 16 <= m.head_dim <= 256):
        raise ConfigError(f"--device cuda: head_dim={m.head_dim} of {where} must be a power of "
                          "two in [16, 256] for the CUDA attention kernel; allowed for this "
                          "model: --device cpu")
    _check_positions(m, cfg.model, cfg.max_prompt_len, cfg.max_response_len)
    _check_entropy_scale(m, cfg.model, cfg.entropy_coef,
                         cfg.max_response_len if cfg.loss_agg == "seq-mean-token-sum" else 1)
    heads = {} if m is None else dict(
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
        vocab_size=m.vocab_size, intermediate_size=m.intermediate_size)
    world = launcher_world_size()
    validate_topology(cfg.tp, cfg.cp, cfg.sp, cfg.rollout_tp, cfg.rollout_cp,
                      world=world, dp=cfg.dp, **heads)
    if world is None:
        _check_local_world(cfg)
    return m


def _check_entropy_scale(m: Qwen3Config | None, model: str | None, coef: float,
                         tokens: int = 1) -> None:
    """--entropy-coef times the largest entropy term a sample can have — ln(vocab_size) nats a
    token, times `tokens` (--max-response-len where --loss-agg seq-mean-token-sum sums a
    sample's tokens, else 1) — must be an fp32 number: past it the loss leaves fp32 (a loss of
    -inf in every step, and the run finished exit 0; found by a breaker). Raises ConfigError
    naming the bound."""
    if m is None or not coef:
        return
    term = math.log(m.vocab_size) * tokens
    most = FP32_MAX / term if term > 0 else math.inf
    if coef > most:
        per = f" x {tokens} tokens (--loss-agg seq-mean-token-sum)" if tokens > 1 else ""
        raise ConfigError(f"--entropy-coef {coef!r}: must be at most {_at_most(most)} for "
                          f"{_model_where(model)} (vocab_size {m.vocab_size}): the entropy term "
                          f"reaches --entropy-coef x ln({m.vocab_size}){per} = "
                          f"{coef * term:.6g}, past fp32's largest number {FP32_MAX:.6g}")


def _at_most(bound: float) -> str:
    """`bound` to 6 significant digits, rounded down, so that the number a message prints is
    itself allowed (2.0342267e37 printed as 2.03423e+37 was refused)."""
    mant, exp = f"{bound:.5e}".split("e")
    if float(f"{mant}e{exp}") > bound:
        mant = f"{float(mant) - 1e-5:.5f}"
    return f"{float(f'{mant}e{exp}'):.6g}"


def max_local_ranks(device: str) -> int:
    """Most ranks `rlk run` starts on this machine itself (without torchrun): one per GPU on
    CUDA (RANKS_PER_SHARED_GPU per GPU with RLK_SHARE_GPUS=1, the validation mode of
    distributed/launch.py); on CPU max(8, 4 × cores) gloo processes (each holds a torch
    runtime and a model copy). ConfigError for a malformed RLK_SHARE_GPUS."""
    if device == "cuda":
        import torch

        per_gpu = RANKS_PER_SHARED_GPU if gpus_shared() else 1
        return per_gpu * torch.cuda.device_count()
    return max(8, 4 * (os.cpu_count() or 1))


def _check_local_world(cfg: RunConfig) -> None:
    world = cfg.dp * cfg.tp * cfg.cp
    most = max_local_ranks(cfg.device)
    if most == 0:   # --device cuda without a visible GPU: the device check names that
        return
    if world > most:
        raise ConfigError(f"--dp {cfg.dp} × --tp {cfg.tp} × --cp {cfg.cp} = {world} ranks, but "
                          f"this machine has {_local_capacity(cfg.device, most)}; allowed: a "
                          f"world of at most {most} here, or start the ranks with torchrun "
                          "across machines")


def _local_capacity(device: str, most: int) -> str:
    """What bounds the local world, for _check_local_world's message."""
    if device != "cuda":
        return f"{os.cpu_count() or 1} CPU core(s): at most {most} local ranks"
    if gpus_shared():
        return (f"{most // RANKS_PER_SHARED_GPU} CUDA device(s) shared ({SHARE_GPUS_ENV}=1): "
                f"at most {RANKS_PER_SHARED_GPU} ranks each")
    return (f"{most} CUDA device(s) visible, one rank each ({SHARE_GPUS_ENV}=1 lets ranks share "
            "them to check a layout bit for bit, not to train)")


def _one_setting_per_field(cmd: argparse.ArgumentParser, argv: list[str]) -> None:
    """Each field is set once: a flag and its alias (e.g. --micro-batch-tokens and --token-budget)
    or its --no- form set one field, and so does a flag given twice (`--lr 1e-3 --lr 1e-4`); the
    last would silently win. A flag repeated with the value it already has (as typed, or as the
    value it reads as: 1e-3 and 0.001) is one setting. `cmd` is the subcommand's parser that
    took `argv` (append and count actions, meant to repeat, are left alone). Raises ConfigError
    naming both spellings, or both values."""
    actions = {s: a for a in cmd._actions for s in a.option_strings}
    args = _attach_negative_numbers(list(argv), {s for s, a in actions.items() if a.nargs is None})
    seen: dict[str, tuple[str, str | None, typing.Any]] = {}   # field -> (flag, text, value)
    i = 0
    while i < len(args):
        flag, eq, text = args[i].partition("=")
        i += 1
        if flag == "--":
            return
        action = actions.get(flag) if flag.startswith("--") else None
        if action is None or isinstance(action, (argparse._AppendAction, argparse._CountAction)):
            continue
        if action.nargs is None:   # one value: after '=' or the next argument
            if not eq:
                text, i = (args[i] if i < len(args) else ""), i + 1
            value = action.type(text) if callable(action.type) else text
        else:                      # on/off: what the spelling stores
            text = None
            value = (not flag.startswith("--no-")
                     if isinstance(action, argparse.BooleanOptionalAction) else action.const)
        first_flag, first_text, first_value = seen.setdefault(action.dest, (flag, text, value))
        if first_flag != flag:
            both = sorted({(first_flag, first_text), (flag, text)})
            named = " and ".join(f if t is None else f"{f} {_shown(t)}" for f, t in both)
            raise ConfigError(f"{named} set the same value ({flag_name(action.dest)}); give "
                              "only one of them")
        if first_text != text and first_value != value:
            raise ConfigError(f"{flag} given twice, {_shown(first_text)} and {_shown(text)}: the "
                              "last would silently win; give it once")


def _check_watch(cfg: RunConfig) -> None:
    """--tensorboard needs its package: refuse before any work rather than fail after step 0."""
    if cfg.tensorboard:
        from rlkernel.runner.metrics import tensorboard_missing

        why = tensorboard_missing()
        if why:
            raise ConfigError(f"--tensorboard: {why}; install it with pip install "
                              "'rl-kernel[tensorboard]' (or pip install tensorboard), or leave "
                              "out --tensorboard")


def _warn(lines: list[str]) -> None:
    for line in lines:
        print(f"rlk run: warning: {line}", file=sys.stderr)


def _summary(writer: EvidenceWriter | None, run_dir: pathlib.Path,
             resumed_at: int | None = None) -> None:
    """The closing lines of a finished run (stderr; stdout keeps only the run directory);
    `resumed_at`: a resume's first evidence step."""
    if writer is not None:
        for line in summary_lines(writer.steps, run_dir, resumed_at):
            print(line, file=sys.stderr)


def _missing_ancestors(d: pathlib.Path) -> list[pathlib.Path]:
    """Ancestors of `d` that do not exist yet, deepest first (mkdir(parents=True) creates them)."""
    out = []
    for parent in d.absolute().parents:
        if parent.exists():
            break
        out.append(parent)
    return out


def _discard(tmp: pathlib.Path, created: list[pathlib.Path]) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    _remove_empty(created)


def _remove_empty(created: list[pathlib.Path]) -> None:
    for parent in created:  # deepest first; only the empty ones we made
        try:
            parent.rmdir()
        except OSError:
            break


_DEFAULT_NAME_TRIES = 1000
"""Default run directory names tried (each taken by a run started meanwhile) before giving up."""


def _lock_run_dir(cfg: RunConfig, final: pathlib.Path | None,
                  held: contextlib.ExitStack) -> pathlib.Path | None:
    """Hold the lock (runner/dirlock.py) of the directory this run writes (`final`, or
    --resume's) until `held` closes: a second rlk run on it is refused at its start, not when
    both publish (a rename onto a full directory, after all its work). A default name (no
    --run-dir) another run took meanwhile is not an error: the next free one is locked instead.
    Returns the directory locked (`final`, or the default name that replaced it). Only the
    process that writes the directory locks it, not a torchrun rank other than 0. The parents
    the lock file needs are made here, and removed at the end if still empty. Raises
    ConfigError."""
    from rlkernel.runner.dirlock import LockHeld, run_dir_lock

    if _follower_rank():
        return final
    d, flag = (final, "--run-dir") if final is not None else (pathlib.Path(cfg.resume), "--resume")
    default = final is not None and cfg.run_dir is None
    names = _default_run_dirs(cfg) if default else iter(())
    held.callback(_remove_empty, _missing_ancestors(d))   # runs after the lock is released
    for _ in range(_DEFAULT_NAME_TRIES):
        with contextlib.ExitStack() as attempt:   # a lock not kept is released on `continue`
            try:
                d.parent.mkdir(parents=True, exist_ok=True)
                attempt.enter_context(run_dir_lock(d))
            except LockHeld as e:
                if default:   # the same config started within the same second: next name
                    d = next(names)
                    continue
                who = "another rlk run" + (f" (pid {e.pid})" if e.pid else "")
                raise ConfigError(f"{flag} {str(d)!r}: {who} is writing this directory (it "
                                  f"holds {e.path}); wait for it to end, or give another "
                                  "directory") from None
            except OSError as e:
                # a default name: the user gave no --run-dir, so say where it came from
                given = (f"{flag} {str(d)!r} (the default, under the current directory"
                         f"{_cwd_shown()})" if default else f"{flag} {str(d)!r}")
                raise ConfigError(f"{given}: cannot create its lock file beside it "
                                  f"({e.strerror or e}); give a writable new directory") from None
            # A run that ended between _choose_run_dir's check and the lock has published there.
            taken = _occupied(flag, str(d)) if final is not None else None
            if taken and default:
                d = next(names)
                continue
            if taken:
                raise ConfigError(taken)
            held.push(attempt.pop_all())
            return d
    raise ConfigError(f"no free default run directory after {_DEFAULT_NAME_TRIES} names like "
                      f"{str(d)!r}; give one with --run-dir")


def _follower_rank() -> bool:
    """A torchrun rank other than 0: it runs the loop but writes no run directory."""
    return launcher_world_size() is not None and os.environ.get("RANK", "0") != "0"


def _publish(tmp: pathlib.Path, final: pathlib.Path) -> None:
    if final.is_dir() and not any(final.iterdir()):
        final.rmdir()  # an empty --run-dir given by the user: take its place
    os.rename(tmp, final)


def _publish_run(tmp: pathlib.Path, final: pathlib.Path) -> pathlib.Path | None:
    """`_publish` a run's directory; if the move fails (e.g. a file appeared in the empty
    --run-dir meanwhile) say so in one line, naming where the run is kept, and return None;
    else return final."""
    try:
        _publish(tmp, final)
        return final
    except OSError as e:
        _error("run", f"cannot move the run from {tmp} to {final} ({e.strerror or e}); the run "
                      f"is kept in {tmp}", 1)
        return None


def _exit_on_sigterm():
    """Treat SIGTERM and SIGHUP (a closed terminal or SSH session) like Ctrl-C: unwind, so a
    partial run is published (not left as .tmp-* beside its lock). One the process was started
    ignoring (nohup) is left ignored.

    Returns the previous handlers (None when not on the main thread) for `_restore_sigterm`.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    current = signal.getsignal(signal.SIGTERM)
    # A nested install (a run's own) shares main's record of the signals that came.
    handler = _Unwind(current.received if isinstance(current, _Unwind) else [])
    # An ignored signal stays ignored: nohup (or `trap '' HUP`) asked the run to outlive its
    # terminal, and a handler here would turn that hangup into the run's end.
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    # Ctrl-C as CtrlC, so a KeyboardInterrupt the reward raises itself is told apart from it
    # (termination.real_interrupt); only over Python's own handler (not an ignored SIGINT).
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _ctrl_c)
    return previous


def _ctrl_c(signum, frame):
    """The SIGINT handler of `_exit_on_sigterm`: Python's own, with its own class."""
    raise CtrlC()


class _Unwind:
    """The SIGTERM / SIGHUP handler: raise Terminated(128 + signum) (not a plain SystemExit: the
    reward's sys.exit is one), and note the signal in `received` — an exception raised inside
    a garbage-collection callback, a __del__ or a library's catch-all is lost, and main then
    still ends the command with the signal's code (`_lost_signal`)."""

    def __init__(self, received: list[int]) -> None:
        self.received = received

    def __call__(self, signum, frame):
        self.received.append(signum)
        raise Terminated(128 + signum)


def _lost_signal(previous, command: str, code: int) -> int:
    """`code`, or — when a SIGTERM / SIGHUP came during the command but its Terminated was lost
    (the command returned another code) — one line and 128 + that signal's number. `previous`:
    what `_exit_on_sigterm` returned in main (the handler installed then is read back)."""
    import signal

    handler = signal.getsignal(signal.SIGTERM)
    if previous is None or not isinstance(handler, _Unwind) or not handler.received:
        return code
    expected = {128 + s for s in handler.received}
    if code in expected:
        return code
    print(f"rlk {command}: terminated (the signal arrived while it finished its work)",
          file=sys.stderr)
    return 128 + handler.received[0]


def _import_torch() -> None:
    """Import torch (with numpy and safetensors) with SIGINT, SIGTERM and SIGHUP blocked on this
    thread (and on the threads the import starts, which inherit the mask); one that arrives
    meanwhile is delivered when the import is done, to the handlers already installed. Called
    where a command first needs torch, after its cheap checks (a usage error must not wait
    seconds for it): `rlk run`'s CUDA check and data check (a resume's too), init-model and
    export; everything after those finds torch loaded. Why: torch imports numpy inside a try
    that catches any exception, so the Terminated (or KeyboardInterrupt) a handler raised there
    was swallowed — the run went on as if never signalled, or failed later on a half-imported
    numpy (found by a breaker: a signal in the first ~0.3 s)."""
    import importlib
    import signal

    names = [n for n in ("numpy", "torch", "safetensors.torch") if n not in sys.modules]
    if not names:
        return
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _restore_sigterm(previous) -> None:
    import signal

    for sig, handler in (previous or {}).items():
        signal.signal(sig, handler)


def _run_follower_rank(cfg: RunConfig, manifest: dict) -> int:
    """A non-zero rank under torchrun: run the loop, keep no files (rank 0 writes the evidence)."""
    import tempfile

    from rlkernel.runner.loop import run_loop

    with tempfile.TemporaryDirectory(prefix="rlk-rank-") as d:
        try:
            run_loop(cfg, pathlib.Path(d), EvidenceWriter(d, manifest),
                     read=_read_at_start(manifest))
        except (ValueError, OSError) as e:
            if _debug():
                raise
            return _error("run", e, 1)
    return 0


def _read_at_start(inputs: dict[str, typing.Any]) -> dict[str, typing.Any]:
    """What `_check_data` read, which the loop's own reads must match (run_loop's `read`)."""
    return {"prompts": inputs["prompts"], "reward": inputs["reward"]}


def _pid_of(tmp: pathlib.Path) -> int | None:
    pid = tmp.name.rpartition(".tmp-")[2]
    return int(pid) if pid.isascii() and pid.isdigit() else None   # not "²": int() refuses it


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _resume_target(d: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(the run --resume continues, the directory its files lie in). Given a run's name, that
    name and `_resume_source`'s answer. Given a killed run's `X.tmp-<pid>` (a run directory
    before its publishing rename): X and that directory — so the resume takes X's lock and
    publishes X, as `--resume X` does, instead of writing the temporary directory unlocked and
    leaving it there. Raises ConfigError when that pid still runs, or when X is a published
    run too."""
    cut = TMP_SUFFIX.search(d.name)
    if cut is None or not (d / "manifest.json").is_file():
        return d, _resume_source(d)
    base = d.with_name(d.name[:cut.start()])
    pid = _pid_of(d)
    if pid is not None and _alive(pid):
        raise ConfigError(f"--resume {str(d)!r}: its run is still going (pid {pid} is alive); "
                          f"wait for it to end, or stop it (if that pid is no rlk run, rename "
                          f"the directory to {base} yourself)")
    if (base / "manifest.json").exists():
        raise ConfigError(f"--resume {str(d)!r}: a killed run left it beside the published run "
                          f"{base}; resume {base}, or move one of the two away")
    return base, d


def _resume_source(d: pathlib.Path) -> pathlib.Path:
    """Where --resume's run lies: `d` itself, or — when `d` has no manifest — the `d.tmp-<pid>`
    a killed `rlk run` left behind (a run is published under its name only when it ends; SIGKILL
    leaves it under the temporary one). Raises ConfigError when that process still runs, or when
    several killed runs left one (which to continue is the user's call)."""
    if (d / "manifest.json").exists() or not d.parent.is_dir():
        return d
    left = sorted(p for p in d.parent.glob(f"{glob.escape(d.name)}.tmp-*")
                  if p.is_dir() and _pid_of(p) is not None and (p / "manifest.json").is_file())
    running = [p for p in left if _alive(_pid_of(p))]
    if running:
        raise ConfigError(f"--resume {str(d)!r}: its run is still going in {running[0]} (pid "
                          f"{_pid_of(running[0])} is alive); wait for it to end, or stop it "
                          f"(if that pid is no rlk run, rename the directory to {d} yourself)")
    if len(left) > 1:
        raise ConfigError(f"--resume {str(d)!r}: several killed runs left "
                          f"{', '.join(map(str, left))}; rename the one to continue to {d}")
    return left[0] if left else d


def _resume_config(given: dict[str, typing.Any], src: pathlib.Path) -> RunConfig:
    """The saved config of --resume's run (read from `src`, see _resume_source) with the allowed
    flags applied."""
    d = pathlib.Path(given["resume"])
    why = readfile.not_a_directory(src)
    if why is not None:
        raise ConfigError(f"--resume {str(d)!r}: {why}; give a run directory written by rlk "
                          "run")
    # worded as export's; "config": [] would crash in saved.get below
    manifest, why = readfile.json_holding_or_why(src / "manifest.json", "config", dict)
    if why is not None:
        raise ConfigError(f"--resume {str(d)!r}: manifest.json {why}; give a run directory "
                          "written by rlk run")
    saved = manifest["config"]
    try:  # validate the saved config itself, before comparing its values with the flags
        RunConfig.from_dict(saved)
    except ConfigError as e:
        raise ConfigError(f"--resume {str(d)!r}: manifest.json holds an invalid config: {e}") from None
    was = saved.get("device", "cpu")
    if given.get("device", was) != was:
        raise ConfigError(f"--device {given['device']!r}: a resumed run cannot change backend "
                          f"(saved --device {was!r}); bitwise identity is promised within one "
                          f"backend only, so its evidence would mix {was} and {given['device']} "
                          f"steps; resume with --device {was}, or start a new run")
    try:
        recorded = recorded_paths(manifest) or {}
    except ValueError:   # refused with its own message by _resume_inputs
        recorded = {}
    # An input typed another way (an absolute path for the relative one the run started with)
    # is the same input: the saved value stays, so the config and checkpoints still match.
    # An input flag left in `given` names another input than the run's, even typed as saved (a
    # file of that name in this directory that is not the run's).
    given = {k: v for k, v in given.items()
             if k not in INPUT_PATHS or not same_input(k, v, saved.get(k), recorded.get(k))}
    changed = sorted(k for k in given if k not in RESUME_MAY_CHANGE
                     and (k in INPUT_PATHS or given[k] != saved.get(k)))
    if changed:
        what = ", ".join(f"{flag_name(k)} {given[k]!r} (saved {saved.get(k)!r}"
                         + (", but here it names another input than the run's"
                            if given[k] == saved.get(k) else "") + ")" for k in changed)
        may = sorted(flag_name(k) for k in RESUME_MAY_CHANGE if k != "resume")
        raise ConfigError(f"--resume: {what} cannot change when resuming; only "
                          f"{', '.join(may)} may")
    if given.get("steps", saved.get("steps", 1)) < saved.get("steps", 1):
        raise ConfigError(f"--steps {given['steps']}: a resumed run can only be extended "
                          f"(saved --steps {saved.get('steps')})")
    if given.get("steps", saved.get("steps")) != saved.get("steps") and \
            saved.get("lr_schedule", "constant") != "constant":
        # The schedule's horizon is the run's update count: extending it would change the LR
        # of steps after the checkpoint, so the resumed run would not equal any single run.
        raise ConfigError(f"--steps {given['steps']}: a run with --lr-schedule "
                          f"{saved['lr_schedule']} cannot be extended on resume (its LR decays "
                          f"over the saved --steps {saved.get('steps')}); start a new run")
    try:
        cfg = RunConfig.from_dict({**saved, **given, "run_dir": str(d)})
    except SampleFitError as e:   # the lengths are the run's: only the budget moves
        p, r = e.sample_tokens
        mbt = given.get("micro_batch_tokens", saved.get("micro_batch_tokens"))
        raise ConfigError(f"--micro-batch-tokens {mbt}: must be >= {p + r}, the run's "
                          f"--max-prompt-len {p} + --max-response-len {r}, which a resume "
                          "keeps (one whole sample must fit in one microbatch)") from None
    except ConfigError as e:   # a flag given now clashes with one the run was saved with
        inherited = sorted(flag_name(k) for k in RESUME_MAY_CHANGE - set(given)
                           if k in saved and flag_name(k) in str(e))
        if not inherited:
            raise
        hint = ", e.g. --no-sp" if "--sp" in inherited else ""
        raise ConfigError(f"{e} ({', '.join(inherited)}: from the resumed run's saved config; "
                          f"a resume may set it again{hint})") from None
    _check_same_spec(manifest.get("canonical_spec"), cfg.canonical_spec(), d)
    return cfg


def _resume_inputs(cfg: RunConfig, src: pathlib.Path) -> RunConfig:
    """`cfg` (--resume's) with its inputs where its manifest recorded them when the run started
    (runner/inputs.located): a resume reads them there, from any directory. A manifest written
    before input_paths gives `cfg` itself, its paths read from the current directory as before.
    Raises ConfigError naming a recorded input that is gone."""
    d = str(cfg.resume)
    try:
        paths = recorded_paths(readfile.read_json(src / "manifest.json"))
        where = located(cfg, paths)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume {d!r}: {e}") from None
    if paths is not None:
        check_located(where, d)
    return where


def _check_same_spec(saved: typing.Any, now: dict[str, typing.Any], d: pathlib.Path) -> None:
    """Refuse to resume a run whose manifest records another canonical spec than this code
    computes for it (e.g. written before a kernel changed its bits, spec.NUMERICS_VERSION): its
    steps and the resumed ones would not be one run. Raises ConfigError naming the fields."""
    if not isinstance(saved, dict):
        raise ConfigError(f"--resume {str(d)!r}: its manifest records no canonical_spec, so "
                          f"nothing shows it computes the bits this code does; start a new run")
    diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if diff:
        what = "; ".join(f"{k}: saved {saved.get(k)!r}, this code {now.get(k)!r}" for k in diff)
        raise ConfigError(f"--resume {str(d)!r}: the run was written under another numerical "
                          f"spec ({what}); its steps and resumed ones would not be one run — "
                          f"finish it with the code that wrote it (its manifest's git commit) "
                          f"or start a new run")


def _read_evidence(path: pathlib.Path, d: pathlib.Path) -> dict[str, typing.Any]:
    """--resume's evidence.json at `path`: a dict with a list of steps. Raises ValueError naming
    the file when it cannot be read or has no such list."""
    evidence, why = readfile.json_holding_or_why(path, "steps", list)   # worded as export's
    if why is not None:
        raise ValueError(f"--resume {str(d)!r}: {path.name} {why}; give a run directory "
                         "written by rlk run")
    return evidence


def _check_not_finished(evidence: dict[str, typing.Any], path: pathlib.Path, cfg: RunConfig,
                        d: pathlib.Path, next_step: int) -> None:
    """Refuse --resume when the evidence (`evidence`, read from `path`) lacks a step before its
    checkpoint's `next_step`, or when that checkpoint already ends the run's --steps and the
    evidence holds them all (nothing to do; an earlier checkpoint, e.g. after a corrupt last
    one, re-runs the steps after it). Raises ValueError."""
    steps = evidence["steps"]
    # A run records each step before its checkpoint: the checkpoint's steps are all there, in
    # order (an edited file resumed into a gap or a repeat and was marked complete).
    for i, s in enumerate(steps[:next_step]):
        if not isinstance(s, dict):
            raise ValueError(f"--resume {str(d)!r}: {path.name}'s steps[{i}] is "
                             f"{readfile.json_kind(s)}, not a step's object: the evidence was "
                             "edited; give a run directory written by rlk run")
    kept = [s.get("step") for s in steps[:next_step]]
    if kept != list(range(next_step)):
        raise ValueError(f"--resume {str(d)!r}: {path} holds steps {_span(kept)} but the "
                         f"checkpoint continues at step {next_step} after steps 0..{next_step - 1}"
                         ": the evidence was cut or edited; resuming would leave a gap in it")
    if next_step >= cfg.steps and evidence.get("complete") is True and len(steps) >= cfg.steps:
        raise ValueError(f"--resume {str(d)!r}: the run is already complete ({len(steps)}/"
                         f"{cfg.steps} steps); to go on, extend it with --steps N "
                         f"(N > {len(steps)})")


def _check_checkpoint_is_the_runs(ck, cfg: RunConfig, evidence: dict[str, typing.Any],
                                  path: pathlib.Path, d: pathlib.Path) -> None:
    """The checkpoint `ck` was written under the manifest's config `cfg`
    (checkpointing.check_settings) and continues the evidence read from `path`
    (checkpointing.check_continues). Raises ResumeError naming --resume."""
    from rlkernel.runner.checkpointing import ResumeError, check_continues, check_settings

    try:
        check_settings(ck, cfg)
        check_continues(ck, evidence, path)
    except ResumeError as e:
        raise ResumeError(f"--resume {str(d)!r}: {e}") from None


def _check_checkpoint_inputs(ck, manifest: typing.Any, shape: Qwen3Config | None,
                             d: pathlib.Path) -> None:
    """The checkpoint `ck` was trained from the inputs the manifest records
    (checkpointing.check_inputs) and holds the fp32 masters and moments of the model `shape`
    (checkpointing.check_state; None: unread, the loop's own check stands), values a run saves
    (check_values), so a file that is not the run's is refused before any work, not after
    "resuming". Raises ResumeError naming --resume."""
    from rlkernel.runner.checkpointing import (ResumeError, check_inputs, check_state,
                                               check_values)

    try:
        check_inputs(ck, manifest.get("inputs") if isinstance(manifest, dict) else None)
        if shape is not None:
            check_state(ck, shape)
        check_values(ck)
    except ResumeError as e:
        raise ResumeError(f"--resume {str(d)!r}: {e}") from None


def _check_rewritten_file(path: pathlib.Path, d: pathlib.Path) -> None:
    """metrics.jsonl / completions.jsonl: the loop rewrites them after the evidence, so one that
    cannot be read failed the resume there, half done (a FIFO; a link to nowhere, which
    exists() called absent: exit 1 after a step). Absent is fine: the loop writes a new one.
    Raises ValueError naming the file."""
    if not os.path.lexists(path):
        return
    try:
        readfile.require_regular(path)
    except OSError as e:
        raise ValueError(f"--resume {str(d)!r}: {path} cannot be read "
                         f"({readfile.unreadable_reason(path, e)}); the resume rewrites it: "
                         "restore it, or move it away") from None


def _check_replaced_dirs(src: pathlib.Path, d: pathlib.Path) -> None:
    """A resume reads checkpoints/ and replaces checkpoints/step-* and final/ only after
    computing steps: refuse what is not a real directory there now, before anything is read or
    written (a link to another run's checkpoints/ continued from its weights and wrote into it;
    a FIFO hung the run with its signals held; a file or link failed it after the work).
    Raises ResumeError."""
    from rlkernel.runner.checkpointing import (ResumeError, check_checkpoint_dirs,
                                               replaced_directory_problem)

    try:
        check_checkpoint_dirs(src)
        why = replaced_directory_problem(src / FINAL_DIR)
        if why is not None:
            raise ResumeError(f"{why}; the run replaces it with its final weights: move it away")
    except ResumeError as e:
        raise ResumeError(f"--resume {str(d)!r}: {e}") from None


def _span(steps: list) -> str:
    """A short view of a list of step indices: [] , [0, 1, 2] or [0, 1, ..., 7] (n)."""
    if len(steps) <= 4:
        return str(steps)
    return f"[{steps[0]}, {steps[1]}, ..., {steps[-1]}] ({len(steps)})"


def _sh(path: str | os.PathLike) -> str:
    """`path` as one shell word, for a command line a user pastes (a run directory with spaces
    or quotes broke the printed command into several words)."""
    return shlex.quote(str(path))


def _resume_hint(d: pathlib.Path) -> str:
    """How to continue the run in `d`, or why it cannot be continued."""
    from rlkernel.runner.checkpointing import checkpoint_dirs

    if checkpoint_dirs(d):
        return f"resume with: rlk run --resume {_sh(d)}"
    try:
        every = readfile.read_json(d / "manifest.json")["config"].get("save_every")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        every = None
    if every:
        return (f"not resumable: no checkpoint was written yet (--save-every {every} writes the "
                f"first after step {every})")
    return "not resumable: it has no checkpoint (runs keep them with --save-every N)"


def _interrupted(e: BaseException, d: pathlib.Path, n_steps: int) -> int:
    """One line for Ctrl-C (KeyboardInterrupt) or SIGTERM / SIGHUP (SystemExit from
    _exit_on_sigterm) during a run whose directory `d` holds `n_steps` steps; returns the exit
    code."""
    what = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else "terminated"
    if _evidence_complete(d):   # the signal came while the ranks shut down, after the last step
        print(f"rlk run: {what} after the run finished; its {n_steps} step(s) are complete in "
              f"{d}", file=sys.stderr)
    else:
        print(f"rlk run: {what} after {n_steps} step(s); partial run kept in {d}; "
              f"{_resume_hint(d)}", file=sys.stderr)
    return _signal_code(e)


def _signal_code(e: BaseException) -> int:
    """The exit code of an interruption: 130 for Ctrl-C, 128 + the signal's number for
    SIGTERM / SIGHUP (the Terminated code)."""
    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, int) else 1
    return 130


def _evidence_complete(d: pathlib.Path) -> bool:
    """Whether run `d`'s evidence.json says the run finished (False when it cannot be read)."""
    try:
        evidence = readfile.read_json(d / "evidence.json")
    except (OSError, ValueError):
        return False
    return isinstance(evidence, dict) and evidence.get("complete") is True


def _check_reward_unchanged(saved: dict[str, typing.Any], reward: dict[str, typing.Any]) -> None:
    """A resumed run must score with the same reward code: its source hash is in the manifest."""
    before = saved.get("reward")
    if isinstance(before, dict) and before.get("source_sha256") != reward["source_sha256"]:
        raise ConfigError(f"--resume: the reward function's source {reward['source_file']} changed "
                          f"since the run started (SHA-256 {str(before.get('source_sha256'))[:12]}"
                          f"... then, {reward['source_sha256'][:12]}... now); restore it to "
                          "resume, or start a new run")


def _check_tokenizer_unchanged(saved: dict[str, typing.Any], now: dict[str, str]) -> None:
    """A resumed run must tokenize (and template) prompts as it did: the SHA-256 of every
    tokenizer file of the model directory (chat_template.jinja, tokenizer_config.json, ...) is
    in the manifest. Raises ConfigError naming the files that changed, appeared or went."""
    before = saved.get("tokenizer_files")
    if not isinstance(before, dict) or before == now:
        return
    changed = sorted(n for n in set(before) | set(now) if before.get(n) != now.get(n))
    what = ", ".join(f"{n} ({'added' if n not in before else 'removed' if n not in now else 'changed'})"
                     for n in changed)
    raise ConfigError(f"--resume: tokenizer files of the model directory differ from the run's "
                      f"start: {what}; restore them to resume, or start a new run")


def _check_model_config_unchanged(cfg: RunConfig, where: RunConfig, src: pathlib.Path) -> None:
    """ConfigError when --resume's model config.json differs from the one its manifest hashed:
    run when the model's shape was refused (a head count or a length that no longer fits), so
    the cause — the file changed since the run started — is named rather than its symptom.
    Nothing when it is unchanged, unrecorded or unreadable (the full check follows later)."""
    if where.model is None:
        return
    path = str(pathlib.Path(where.model) / "config.json")
    try:
        recorded = relocated(readfile.read_json(src / "manifest.json").get("inputs"), cfg,
                             where).get("files")
        now = sha256_file(path) if isinstance(recorded, dict) and path in recorded else None
    except (OSError, ValueError, AttributeError):   # damaged or odd: the full check says so
        return
    if now is not None:
        check_unchanged({"files": {path: recorded[path]}}, {"files": {path: now}},
                        str(cfg.resume))


def _cmd_resume(cfg: RunConfig, where: RunConfig, git: dict[str, typing.Any],
                src: pathlib.Path, inputs: dict[str, typing.Any],
                shape: Qwen3Config | None) -> int:
    """Continue --resume's run. `cfg` is its config as recorded (paths as typed); `where` the
    same with the inputs where the run recorded them (_resume_inputs), which the run reads;
    `shape` the model's, as `_check_topology` read it."""
    from rlkernel.runner.checkpointing import ResumeError, latest_checkpoint
    from rlkernel.runner.evidence import utc_now, versions
    from rlkernel.runner.loop import run_loop
    from rlkernel.runner.metrics import COMPLETIONS, METRICS

    d = pathlib.Path(cfg.resume)
    try:
        _check_replaced_dirs(src, d)   # first: a linked checkpoints/ is not read from
        ck = latest_checkpoint(src)
        evidence = _read_evidence(src / "evidence.json", d)
        _check_not_finished(evidence, src / "evidence.json", cfg, d, ck.next_step)
        _check_checkpoint_is_the_runs(ck, cfg, evidence, src / "evidence.json", d)
        for name in (METRICS, COMPLETIONS):
            _check_rewritten_file(src / name, d)
        manifest = readfile.read_json(src / "manifest.json")
        check_unchanged(relocated(manifest.get("inputs"), cfg, where),
                        describe_inputs(where, shape), str(d))
        _check_checkpoint_inputs(ck, manifest, shape, d)   # the inputs on disk: the manifest's
        _check_reward_unchanged(manifest, inputs["reward"])
        _check_tokenizer_unchanged(manifest, inputs["tokenizer_files"])
        if not isinstance(manifest.get("resumes", []), list):
            raise ValueError(f"--resume {str(d)!r}: manifest.json 'resumes' is "
                             f"{type(manifest['resumes']).__name__}, not the list of the "
                             "run's resumes it writes: the manifest was edited")
    except (ResumeError, OSError, ValueError) as e:
        return _error("run", e, 2)
    if src != d:  # a killed run's temporary directory: publish it under the name it was given
        try:
            _publish(src, d)
        except OSError as e:
            return _error("run", f"--resume {str(d)!r}: cannot rename {src} (left by a killed "
                                 f"run) to it ({e.strerror or e}); move {d} away first", 2)
        print(f"rlk run: {src} (left by a killed run) is now {d}", file=sys.stderr)
    # The manifest's config is the one the run now follows (e.g. the extended --steps); what
    # changed, from which step, and with which code and versions is kept in "resumes".
    old = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    new = cfg.to_dict()
    manifest["config"] = new
    # Where the inputs were found now (hashes checked above) is where the run's later resumes
    # and exports look first: after a project folder moved with its run, the recorded paths
    # were gone and an export from elsewhere failed. The resume's entry keeps the paths the
    # manifest named before, when they differ (and a run written before input_paths gets them).
    before = manifest.get("input_paths")
    manifest["input_paths"] = inputs["input_paths"]
    manifest["prompts"] = inputs["prompts"]   # as the config: the task's count follows --steps
    moved = {"input_paths_before": before} if before not in (None, inputs["input_paths"]) else {}
    manifest.setdefault("resumes", []).append(
        {"from_step": ck.next_step, "changed": {k: [old.get(k), v] for k, v in new.items()
                                                if old.get(k) != v},
         "git": git, "versions": versions(), "utc": utc_now(), **inputs, **moved})
    for why in ck.skipped:   # a newer checkpoint that is half written or corrupt
        print(f"rlk run: skipped checkpoint {why}", file=sys.stderr)
    print(f"rlk run: resuming {d} from {ck.path.relative_to(src)} at step {ck.next_step + 1}/"
          f"{cfg.steps} (evidence step {ck.next_step}; the {ck.next_step} step(s) before it "
          "are kept)", file=sys.stderr)
    progress = Progress(total=cfg.steps)
    writer: EvidenceWriter | None = None
    before = _rewritten_files(d)
    previous_sigterm = _exit_on_sigterm()
    try:
        writer = EvidenceWriter.resume(d, manifest, ck.next_step, progress)
        run_loop(where, d, writer, read=_read_at_start(inputs))
        if not writer.complete:
            writer.finish({"steps": writer.n_steps})
    except (ValueError, OSError) as e:
        if _debug():
            raise
        if writer is not None:
            writer.adopt()          # the steps a launched run's rank 0 recorded
        if writer is None or writer.n_steps <= ck.next_step:
            return _resume_failed_before_its_steps(e, d, before)
        return _error("run", f"{e} (evidence of {writer.n_steps} step(s) kept in {d})", 1)
    except (KeyboardInterrupt, SystemExit) as e:
        if _debug():
            raise
        if writer is not None:
            writer.adopt()
        if writer is None or writer.n_steps <= ck.next_step:   # no step of its own yet
            _put_back(before)
            print(f"rlk run: interrupted before the resume's first step; {d} is left as it "
                  "was", file=sys.stderr)
            return _signal_code(e)
        return _interrupted(e, d, writer.n_steps)
    except Exception:   # a bug (or an injected fault): the run as it was, or what it recorded
        if writer is not None:
            writer.adopt()
        if writer is None or writer.n_steps <= ck.next_step:
            _put_back(before)   # a finished run stays complete, as after a ValueError
            print(f"rlk run: the resume failed before its first step; {d} is left as it was",
                  file=sys.stderr)
        else:
            print(f"rlk run: partial run kept in {d} (evidence of {writer.n_steps} step(s))",
                  file=sys.stderr)
        raise
    finally:
        _restore_sigterm(previous_sigterm)
        progress.close()
    return _finished(writer, d, ck.next_step)


def _finished(writer: EvidenceWriter | None, d: pathlib.Path,
              resumed_at: int | None = None) -> int:
    """The closing lines and the run directory on stdout, exit 0 — or, for a signal meanwhile
    (the run is published and complete), one line saying so and the signal's code (it said
    "interrupted before the first step; nothing kept")."""
    try:
        _summary(writer, d, resumed_at)
        print(d)
        return 0
    except (KeyboardInterrupt, SystemExit) as e:
        print(f"rlk run: interrupted after the run finished; it is complete in {d}",
              file=sys.stderr)
        return _signal_code(e)


def _rewritten_files(d: pathlib.Path) -> dict[pathlib.Path, bytes | None]:
    """The files of run `d` that a resume rewrites before its first step (the manifest, the
    evidence cut to the checkpoint's steps, the metrics and completions lines past it), as
    they are now (None: absent)."""
    from rlkernel.runner.metrics import COMPLETIONS, METRICS

    return {d / name: (d / name).read_bytes() if (d / name).is_file() else None
            for name in ("manifest.json", "evidence.json", METRICS, COMPLETIONS)}


def _resume_failed_before_its_steps(e: BaseException, d: pathlib.Path,
                                    before: dict[pathlib.Path, bytes | None]) -> int:
    """A resume that failed before recording a step: put back the files it rewrote
    (`_rewritten_files`), so the run is as it was — a finished run stays complete — and say so.
    A bad input (a prompt longer than the run's --max-prompt-len among the steps an extended
    --steps added) is a usage error, exit 2; anything else exit 1."""
    _put_back(before)
    bad_input = _input_error(e)
    kept = (f"{d} is left as it was" if bad_input is None else
            f"{d} is left as it was; a resume cannot change the flags that decide what the run "
            "computes: start a new run to change them")
    return _error("run", f"{e if bad_input is None else bad_input} ({kept})",
                  1 if bad_input is None else 2)


def _put_back(before: dict[pathlib.Path, bytes | None]) -> None:
    """Write back the files `_rewritten_files` saved (None: remove the file)."""
    from rlkernel.runner.evidence import write_bytes_atomic

    for path, data in before.items():
        if data is None:
            path.unlink(missing_ok=True)
        else:
            write_bytes_atomic(path, data)


def _input_error(e: BaseException) -> str | None:
    """The message of a bad input the run found after it started (runner/loop.InputError: the
    model checkpoint's contents, a prompt's length), raised here or by any rank of a launched
    run (its RankUserError carries the type's name); None for other errors."""
    from rlkernel.runner.loop import InputError

    if isinstance(e, InputError):
        return str(e)
    if getattr(e, "error_type", "").rsplit(".", 1)[-1] == "InputError":
        return getattr(e, "message", "") or str(e)
    return None


def _device_oom() -> type[BaseException]:
    """torch's out-of-memory error (a RuntimeError) once torch is loaded, else MemoryError (the
    CLI imports torch only to run)."""
    torch = sys.modules.get("torch")
    return getattr(torch, "OutOfMemoryError", MemoryError) if torch is not None else MemoryError


def _out_of_memory(e: BaseException) -> str:
    """One line for a run that ran out of host or device memory, naming the flags that size it."""
    where = "host" if isinstance(e, MemoryError) else "device"
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return (f"out of {where} memory ({type(e).__name__}{': ' + first if first else ''}); a step "
            "holds --n-prompts x --n-samples-per-prompt samples of up to --max-prompt-len + "
            "--max-response-len tokens: lower them, or --micro-batch-tokens")


def cmd_run(args: argparse.Namespace) -> int:
    # SIGTERM/SIGHUP (main's handler) unwind from the first moment: the lock is released on the
    # way out.
    try:
        with contextlib.ExitStack() as held:   # the run directory's lock, on every way out
            return _cmd_run(args, held)
    except SystemExit as e:   # a signal before the run's own handling began: nothing was written
        if _debug():
            raise
        resume = getattr(args, "resume", None)   # flags left out are absent (SUPPRESS)
        kept = f"{resume} is left as it was" if resume else "nothing kept"
        print(f"rlk run: interrupted before the first step; {kept}", file=sys.stderr)
        return e.code if isinstance(e.code, int) else 1


def _cmd_run(args: argparse.Namespace, held: contextlib.ExitStack) -> int:
    names = {f.name for f in dataclasses.fields(RunConfig)}
    try:
        given = {k: v for k, v in vars(args).items() if k in names}
        bad = (_line_breaking(*[(flag_name(k), given.get(k)) for k in ("run_dir", "resume")])
               or _unusable_path(*[(flag_name(k), given.get(k))
                                   for k in ("run_dir", "resume", "model", "prompts")]))
        if bad:
            raise ConfigError(bad)
        src = None
        if given.get("resume"):
            name, src = _resume_target(pathlib.Path(given["resume"]))
            given["resume"] = str(name)
        cfg = _resume_config(given, src) if src is not None else _new_config(given)
        where = cfg if src is None else _resume_inputs(cfg, src)
        # An occupied --run-dir is refused first, before the slower checks (a resume writes into
        # its own directory).
        final = _choose_run_dir(cfg) if src is None else None
        final = _lock_run_dir(cfg, final, held)
        _check_inputs(where)
        try:
            shape = _check_topology(where)
        except ConfigError:
            if src is not None:   # an edited model explains a resume's refusal first
                _check_model_config_unchanged(cfg, where, src)
            raise
        _check_watch(cfg)
        inputs = _check_data(where) if src is None else _resume_data(where, src)
    except ConfigError as e:
        return _error("run", e, 2)

    git = git_state(SRC_DIR)
    if git["dirty"] and not cfg.allow_dirty:
        files = git["dirty_files"]
        return _error("run", f"the rl-kernel checkout {SRC_DIR} has uncommitted changes to its "
                             f"tracked files or package ({len(files)} path(s), e.g. "
                             f"{files[0].strip()!r}); commit them so the run can be reproduced "
                             "from its commit, or pass --allow-dirty (the diff is then recorded "
                             "in the manifest)", 2)
    _warn(config_warnings(cfg) + prompt_warnings(cfg, inputs["prompts"]))
    if src is not None:
        return _cmd_resume(cfg, where, git, src, inputs, shape)
    if not _follower_rank():
        _warn_stale_temporaries(final)

    from rlkernel.runner.loop import run_loop  # the loop pulls in torch: import it only to run

    manifest = {**build_manifest(cfg, git), **inputs}
    if _follower_rank():
        return _run_follower_rank(cfg, manifest)
    try:  # every input's SHA-256 (for --resume), the vocab rule, the weights' stored dtypes
        manifest["inputs"] = describe_inputs(cfg, shape)
    except ConfigError as e:
        return _error("run", e, 2)
    for note in startup_notes(cfg, manifest["inputs"]):
        print(f"rlk run: note: {note}", file=sys.stderr)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    created = _missing_ancestors(tmp)
    progress = Progress(total=cfg.steps)
    writer: EvidenceWriter | None = None
    previous_sigterm = _exit_on_sigterm()
    try:
        try:
            tmp.mkdir(parents=True)
        except OSError as e:  # e.g. a parent is a file or read-only: name the flag, usage error
            _discard(tmp, created)
            return _error("run", f"--run-dir {str(final)!r}: cannot create {tmp} "
                                 f"({e.strerror or e}); give a writable new directory", 2)
        writer = EvidenceWriter(tmp, manifest, progress)
        run_loop(cfg, tmp, writer, read=_read_at_start(inputs))
        if not writer.complete:
            writer.finish({"steps": writer.n_steps})
    except (ValueError, OSError, MemoryError, _device_oom()) as e:
        if not isinstance(e, (ValueError, OSError)):   # host or device out of memory
            e = _out_of_memory(e)
        if writer is None or writer.n_steps == 0:
            _discard(tmp, created)
            if _debug():
                raise
            bad_input = _input_error(e)   # found before step 1: a usage error
            return _error("run", e if bad_input is None else bad_input,
                          1 if bad_input is None else 2)
        kept = _publish_run(tmp, final) or tmp
        if _debug():
            raise
        _error("run", f"{e} (evidence of {writer.n_steps} step(s) kept in {kept})", 1)
        return 1
    except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C, or SIGTERM via _exit_on_sigterm
        if _debug():
            raise
        if writer is None or writer.n_steps == 0:  # nothing worth keeping yet
            _discard(tmp, created)
            print("rlk run: interrupted before the first step; nothing kept", file=sys.stderr)
            return _signal_code(e)
        return _interrupted(e, _publish_run(tmp, final) or tmp, writer.n_steps)
    except BaseException:  # a bug: keep whatever was written, under the final name, and raise
        if tmp.exists():
            print(f"rlk run: partial run kept in {_publish_run(tmp, final) or tmp}",
                  file=sys.stderr)
        raise
    finally:
        _restore_sigterm(previous_sigterm)
        progress.close()
    if _publish_run(tmp, final) is None:
        return 1
    return _finished(writer, final)


# ---------------------------------------------------------------------------------------------
# rlk compare / rlk init-model / rlk export


def cmd_compare(args: argparse.Namespace) -> int:
    from rlkernel.runner.compare import CompareError, compare_runs, format_report

    named = (("RUN_A", args.run_a), ("RUN_B", args.run_b))
    bad = _bad_paths(*named)
    if bad:
        return _error("compare", bad, 2)
    try:
        report = compare_runs(args.run_a, args.run_b)
    except CompareError as e:
        if _debug():
            raise
        return _error("compare", e, 2)
    if report.same_run is not None:   # a typo in a script: its IDENTICAL would be a false pass
        return _error("compare", f"RUN_A and RUN_B are the same run ({report.same_run}); "
                                 "comparing a run with itself proves nothing: give two run "
                                 "directories", 2)
    print(format_report(report, quiet=args.quiet))
    return report.exit_code



def cmd_report(args: argparse.Namespace) -> int:
    from rlkernel.runner.report import ReportError, write_report

    named = (*[("RUN", r) for r in args.runs], ("--out", args.out))
    # --out may hold files (its PNGs are replaced), but is refused as run / export refuse
    # theirs when it is a file, lies under one, or is a symbolic link.
    bad = (_bad_paths(*named) or _line_breaking(("--out", args.out))
           or _not_a_directory("--out", args.out, "a directory", pathlib.Path.is_dir)
           or _in_run_owned("--out", args.out)
           or (None if os.path.isdir(args.out) else _uncreatable("--out", args.out)))
    if bad:
        return _error("report", bad, 2)
    try:
        paths = write_report(args.runs, args.out,
                             warn=lambda line: print(f"rlk report: warning: {line}",
                                                     file=sys.stderr))
    except ReportError as e:
        if _debug():
            raise
        return _error("report", e, 2)
    for p in paths:
        print(p)
    return 0


def cmd_init_model(args: argparse.Namespace) -> int:
    if not 0 <= args.seed < SEED_LIMIT:
        return _error("init-model", f"--seed {args.seed}: must be an integer in [0, 2**63)", 2)
    taken = (_bad_paths(("--out", args.out)) or _line_breaking(("--out", args.out))
             or _occupied("--out", args.out) or _in_run_owned("--out", args.out)
             or _uncreatable("--out", args.out) or _name_too_long("--out", args.out))
    if taken:
        return _error("init-model", taken, 2)
    out = pathlib.Path(args.out)
    _import_torch()
    from rlkernel.model.checkpoint import init_model

    try:
        init_model(args.preset, args.seed, out)
    except (ValueError, OSError) as e:
        if _debug():
            raise
        return _error("init-model", e, 1)
    print(out)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    # Worded as --run-dir and init-model's --out are (a file is named as one); export_run keeps
    # its own check for callers of the API.
    named = (("RUN", args.run), ("--out", args.out))
    taken = (_bad_paths(*named) or _line_breaking(("--out", args.out))
             or _occupied("--out", args.out) or _in_run_owned("--out", args.out)
             or _uncreatable("--out", args.out) or _name_too_long("--out", args.out))
    if taken:
        return _error("export", taken, 2)
    _import_torch()   # after the cheap checks: a taken --out must not wait seconds for torch
    from rlkernel.model.checkpoint import CheckpointError
    from rlkernel.runner.export import ExportError, ExportUsageError, export_run, parse_step
    try:
        info = export_run(args.run, args.out, parse_step(args.step, args.run))
    except ExportUsageError as e:
        if _debug():
            raise
        return _error("export", e, 2)
    except (ExportError, CheckpointError, OSError) as e:   # e.g. a corrupt config.json
        if _debug():
            raise
        return _error("export", e, 1)
    # --step and the evidence count from 0, `rlk run`'s progress from 1: name both
    print(f"rlk export: evidence step {info.step} (the run's step {info.step + 1}) of "
          f"{args.run} from {info.source.name}: "
          f"{info.n_tensors} tensors match the run's recorded SHA-256 (version "
          f"{info.version[:12]}...); {info.seconds:.1f}s", file=sys.stderr)
    print(info.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
