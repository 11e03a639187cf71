"""The exceptions `rlk` raises in its signal handlers (cli._exit_on_sigterm): Terminated for
SIGTERM / SIGHUP, CtrlC for SIGINT.

Terminated is a SystemExit, so everything that unwinds a run on one (publishing the partial run, the
"terminated after N step(s)" line, exit 128 + the signal number) still does; its own class, so
code that runs the user's functions and calls their SystemExit (sys.exit) a failure of theirs —
the reward function, the reward module's import — can tell the signal apart and let it through.
CtrlC is a KeyboardInterrupt of its own class for the same reason: a reward that raises
KeyboardInterrupt itself failed, and was reported as the user's Ctrl-C (found by a breaker).
Does not: install handlers (cli.py) or defer signals (runner/loop.py).
"""

from __future__ import annotations

import signal


class Terminated(SystemExit):
    """SIGTERM or SIGHUP arrived: stop as for Ctrl-C. `code` is 128 + the signal number."""


class CtrlC(KeyboardInterrupt):
    """SIGINT arrived while rlk's handler was installed: stop as for any KeyboardInterrupt."""


def real_interrupt(e: BaseException) -> bool:
    """Whether `e`, caught around the user's code, is a stop signal to let through rather than
    that code's failure: Terminated, CtrlC, or a plain KeyboardInterrupt while SIGINT still has
    Python's default handler (outside `rlk`, where a Ctrl-C cannot be told apart). A plain
    KeyboardInterrupt under rlk's handler, or where SIGINT is ignored (a spawned rank: the
    launcher takes Ctrl-C), was raised by the code itself."""
    if isinstance(e, (Terminated, CtrlC)):
        return True
    return (isinstance(e, KeyboardInterrupt)
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
