"""Reading only regular files (rlkernel/readfile.py): a FIFO, device, socket or directory in a
file's place is refused before a byte is read, naming the path and what is there; a FIFO's
open never blocks. The FIFOs come from `kernel_helpers.fifo_in_place_of`, whose watchdog
unblocks a reader that does block, so a regression fails instead of hanging the suite.
Run: `.venv/bin/python -m pytest -q tests/test_readfile.py`.
"""

from __future__ import annotations

import json
import os
import re
import socket

import pytest
from kernel_helpers import fifo_in_place_of

from rlkernel import readfile
from rlkernel.readfile import NotRegularFileError

READERS = [readfile.read_bytes, readfile.read_text, readfile.read_json, readfile.require_regular]


@pytest.mark.parametrize("read", READERS)
def test_a_regular_file_is_read(tmp_path, read):
    """Control: a regular file (JSON, UTF-8) reads as its bytes, text, document."""
    p = tmp_path / "f.json"
    p.write_text('{"a": "\u00e9"}', encoding="utf-8")
    want = {readfile.read_bytes: p.read_bytes(), readfile.read_text: '{"a": "\u00e9"}',
            readfile.read_json: {"a": "\u00e9"}, readfile.require_regular: None}[read]
    assert read(p) == want


@pytest.mark.parametrize("read", READERS)
def test_a_fifo_is_refused_without_blocking(tmp_path, read):
    p = tmp_path / "evidence.json"
    fifo_in_place_of(p)
    with pytest.raises(NotRegularFileError) as e:
        read(p)
    assert str(e.value) == f"{p}: not a regular file but a FIFO (named pipe)"
    assert e.value.strerror == "not a regular file but a FIFO (named pipe)"
    assert isinstance(e.value, OSError)   # callers' `except OSError` still catch it


@pytest.mark.parametrize("read", READERS)
def test_a_directory_a_device_and_a_socket_are_refused(tmp_path, read):
    """A directory (read gave IsADirectoryError), /dev/null (a character device: /dev/zero
    would never end) and a UNIX socket (open fails ENXIO): each named for what it is."""
    (tmp_path / "d").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "s"))
        for path, kind in ((tmp_path / "d", "a directory"),
                           ("/dev/null", "a character device"), (tmp_path / "s", "a socket")):
            want = f"{path}: not a regular file but {kind}"
            with pytest.raises(NotRegularFileError, match=f"^{re.escape(want)}$"):
                read(path)
    finally:
        sock.close()


@pytest.mark.parametrize("read", READERS)
def test_a_missing_file_is_file_not_found(tmp_path, read):
    """A missing file: the usual FileNotFoundError (callers word "missing" themselves)."""
    with pytest.raises(FileNotFoundError):
        read(tmp_path / "nope.json")


def test_text_and_json_errors_are_the_usual_ones(tmp_path):
    """Not UTF-8: UnicodeDecodeError; not JSON, or nested past the recursion limit:
    json.JSONDecodeError (as jsontext.loads)."""
    p = tmp_path / "f"
    p.write_bytes(b"\xff")
    with pytest.raises(UnicodeDecodeError):
        readfile.read_text(p)
    for text in ("{", "[" * 100_000):
        p.write_text(text)
        with pytest.raises(json.JSONDecodeError):
            readfile.read_json(p)


def test_no_descriptor_is_left_open(tmp_path):
    """A refused path and a read file both close what they opened."""
    fifo_in_place_of(tmp_path / "p")
    (tmp_path / "f").write_text("x")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(NotRegularFileError):
            readfile.read_bytes(tmp_path / "p")
        readfile.read_bytes(tmp_path / "f")
    assert len(os.listdir("/proc/self/fd")) == before
