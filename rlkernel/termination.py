"""The exception `rlk run` raises in its SIGTERM / SIGHUP handler (cli._exit_on_sigterm).

A SystemExit, so everything that unwinds a run on one (publishing the partial run, the
"terminated after N step(s)" line, exit 128 + the signal number) still does; its own class, so
code that runs the user's functions and calls their SystemExit (sys.exit) a failure of theirs —
the reward function, the reward module's import — can tell the signal apart and let it through.
Does not: install handlers (cli.py) or defer signals (runner/loop.py).
"""

from __future__ import annotations


class Terminated(SystemExit):
    """SIGTERM or SIGHUP arrived: stop as for Ctrl-C. `code` is 128 + the signal number."""
