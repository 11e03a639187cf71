"""Profile every Python process of a multi-rank job (the spawned ranks included) with cProfile:
put this folder first on PYTHONPATH and set RLK_PROFILE_DIR; each process writes
RLK_PROFILE_DIR/<pid>.prof when it exits. Read them with benchmarks/profile_ranks.py.
Does nothing without RLK_PROFILE_DIR (a bench helper, never imported by rlkernel)."""

import atexit
import cProfile
import os

_DIR = os.environ.get("RLK_PROFILE_DIR")
if _DIR:
    _PROF = cProfile.Profile()

    def _dump() -> None:
        _PROF.disable()
        _PROF.dump_stats(os.path.join(_DIR, f"{os.getpid()}.prof"))

    atexit.register(_dump)
    _PROF.enable()
