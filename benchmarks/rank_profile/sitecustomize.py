"""Profile every Python process of a multi-rank job (the spawned ranks included) with cProfile:
put this folder first on PYTHONPATH and set RLK_PROFILE_DIR; each process writes
RLK_PROFILE_DIR/<pid>.prof — a rank when it reports its function done to the launcher, any
other process when it exits. Read them with benchmarks/profile_ranks.py.
Why at the report: the launcher stops a rank still exiting GRACE_S after every rank finished
(distributed/launch.py), and a CUDA rank's teardown outlasted that, so an exit-time dump of a
rank was never written (thirty-eighth session, one H100).
Does nothing without RLK_PROFILE_DIR (a bench helper, never imported by rlkernel)."""

import atexit
import cProfile
import os

_DIR = os.environ.get("RLK_PROFILE_DIR")
if _DIR:
    import multiprocessing.connection as _mpc

    _PROF = cProfile.Profile()
    _DONE = []

    def _dump() -> None:
        if _DONE:
            return
        _DONE.append(True)
        _PROF.disable()
        _PROF.dump_stats(os.path.join(_DIR, f"{os.getpid()}.prof"))

    _send = _mpc.Connection.send

    def _send_after_dump(self, obj):
        # A rank's last word to the launcher (distributed/launch.py _child): {"ok": True, ...}
        if isinstance(obj, dict) and obj.get("ok") is True and "rank" in obj:
            _dump()
        return _send(self, obj)

    _mpc.Connection.send = _send_after_dump
    atexit.register(_dump)
    _PROF.enable()
