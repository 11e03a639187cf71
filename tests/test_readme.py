"""README.md stays honest about the command line and the project's scope (issue 13 item 6).

Properties: every `--flag` the README mentions is a real option of `rlk` or one of its
subcommands (a renamed or removed flag fails here, not for a new user); the README states the
method (GRPO, no critic), that DP is there and what is not there yet (PP), what the CPU path is
for, and the test suite's time as the rough figure it is.
Run: `.venv/bin/python -m pytest -q tests/test_readme.py`.
"""

from __future__ import annotations

import pathlib
import re

from rlkernel import cli

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


# Flags of other programs that the README quotes (`tensorboard --logdir RUN/tensorboard`, pip's
# `--extra-index-url`).
OTHER_TOOLS_FLAGS = {"--logdir", "--extra-index-url"}


def _all_flags() -> set[str]:
    parser = cli.build_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    for name in ("run", "compare", "report", "init-model", "export"):
        sub = cli._subparser(parser, name)
        assert sub is not parser, name
        flags |= {s for a in sub._actions for s in a.option_strings}
    return flags


def test_every_flag_in_the_readme_exists():
    """{--flags in README.md} <= {option strings of rlk and its subcommands}."""
    text = README.read_text(encoding="utf-8")
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    assert mentioned - _all_flags() - OTHER_TOOLS_FLAGS == set()


def test_readme_states_method_scope_cpu_purpose_and_test_time():
    text = " ".join(README.read_text(encoding="utf-8").split())
    for phrase in ("GRPO", "no critic", "data parallelism (DP)", "pipeline parallelism (PP)",
                   "The CPU path is for checking the contract"):
        assert phrase in text, phrase
    # A round number of minutes, no more precise than it is (measured from a clean clone).
    assert re.search(r"The suite takes about \d+ minutes on an idle 2-core machine\.", text)
