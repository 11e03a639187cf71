"""An exclusive lock beside a run directory, so that two `rlk run`s never write one directory.

`run_dir_lock(d)` holds an flock(2) on the file `d.lock` (which holds the holder's pid) while its
block runs, and removes the file when the block ends. The kernel drops an flock when its process
dies, so the file a SIGKILLed run leaves behind stops nobody: the next run on `d` locks it, and
removes it in turn.

Footgun: the holder removes the file before it unlocks, so a process that opened the file just
before the removal may lock an inode that no longer has the name; `_lock` checks that the name
still leads to the inode it locked, and starts over if not (the usual flock-and-unlink protocol).

Does not: create `d` or its parent (the caller does), or wait: a held lock is refused at once.
Tests: `.venv/bin/python -m pytest -q tests/test_cli_config.py -k lock`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
from typing import Iterator


class LockHeld(Exception):
    """Another process holds the lock `path`; `pid` is the one it recorded (None if unreadable)."""

    def __init__(self, path: pathlib.Path, pid: int | None) -> None:
        super().__init__(f"{path} is held by pid {pid}")
        self.path, self.pid = path, pid


def lock_path(d: pathlib.Path) -> pathlib.Path:
    """The lock file of run directory `d`: its sibling `<name>.lock`, of `d` normalised first
    (made absolute where it ends in `.` or `..`), so that `.`, `..` and `x/../run` name the file
    `run`'s other spellings lock (`.` has no name: `--resume .` raised ValueError, and `--resume
    ..` from checkpoints/ locked `checkpoints/...lock`, beside a resume that took `run.lock`)."""
    n = pathlib.Path(os.path.normpath(d))
    if n.name in ("", ".", ".."):
        n = pathlib.Path(os.path.abspath(d))
    return n.with_name(f"{n.name}.lock")


@contextlib.contextmanager
def run_dir_lock(d: pathlib.Path) -> Iterator[pathlib.Path]:
    """Hold the lock of `d` while the block runs (yields the lock file's path). Raises LockHeld
    when another process holds it, OSError when the lock file cannot be created."""
    path = lock_path(d)
    fd = _lock(path)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)   # before unlocking (module doc)
        os.close(fd)


def _lock(path: pathlib.Path) -> int:
    """A descriptor of `path` holding its flock, with this pid written into the file."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _recorded_pid(fd)
            os.close(fd)
            raise LockHeld(path, pid) from None
        except BaseException:
            os.close(fd)
            raise
        if _names(path, fd):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)   # its holder removed it meanwhile: lock the file under the name now


def _names(path: pathlib.Path, fd: int) -> bool:
    """Whether `path` still leads to the file open as `fd`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _recorded_pid(fd: int) -> int | None:
    text = os.read(fd, 32).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None
