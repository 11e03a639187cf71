"""Read a file of a run or model directory only when it is a regular file.

A FIFO (named pipe) in a file's place makes `open` block until a writer comes, so the command
hung with no message; a character device such as /dev/zero never ends; a directory fails with a
bare IsADirectoryError. Every reader here opens with O_NONBLOCK (an open of a FIFO returns at
once; regular files ignore the flag), checks the open descriptor with fstat, so the file checked
is the file read (no window to swap it in between), and raises NotRegularFileError naming the
path and what it is. That error is an OSError: callers' `except OSError` turn it into their own
error type as they do an unreadable file.
`require_regular` serves libraries that open by name (safetensors, tokenizers): their own open
comes after the check, a window only a file swapped in on purpose fits through.
`non_directory` says what is in a directory's place before it is removed or replaced.
Does not: parse (beyond JSON text, via jsontext) or write.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import IO, Any

from rlkernel import jsontext

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


_ENTRY_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISREG, "a regular file"), *_KINDS)


def non_directory(path: str | os.PathLike) -> str | None:
    """What lies at `path` when something is there that is not a real directory, by lstat (a
    symbolic link is one, even to a directory): "a FIFO (named pipe)", "a symbolic link", ...;
    None when `path` is a directory or nothing. For code that is about to rmtree or replace a
    directory it made: rmtree opens its path (the open of a FIFO blocks, with signals held) and
    refuses a link, both after the work. Raises lstat's OSError other than a missing path."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(mode):
        return None
    return next((k for test, k in _ENTRY_KINDS if test(mode)), "a file of another kind")


def not_a_file(path: str | os.PathLike) -> str | None:
    """Why `path` is no input file to read, for a message after "PATH: ", or None when it is a
    regular file (or a link to one): "no such file"; "is a directory, not a file"; "is a FIFO
    (named pipe), not a regular file" and the other kinds; "is a symbolic link to 'T', which
    does not exist" / "is a symbolic link that cannot be followed (Too many levels of symbolic
    links)" — the link is there, so "no such file" read as a typo."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if not os.path.islink(path):
            return "no such file" if isinstance(e, FileNotFoundError) else e.strerror or str(e)
        reason = unreadable_reason(path, e)
        return (f"is {reason}" if reason.startswith("a symbolic link") else
                f"is a symbolic link that cannot be followed ({reason})")
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    kind = next((k for test, k in _KINDS if test(mode)), "a file of another kind")
    return f"is {kind}, not a regular file"


def missing_directory(path: str | os.PathLike) -> str:
    """Why `path`, not a directory and not an existing file, is no directory, for a message:
    "no such run directory" of a missing path; "a symbolic link that cannot be followed (Too
    many levels of symbolic links)" of a link loop or a link to nothing — the link is there,
    so "no such" read as a typo."""
    if not os.path.islink(path):
        return "no such run directory"
    try:
        os.stat(path)
    except OSError as e:
        return f"a symbolic link that cannot be followed ({e.strerror})"
    return "not a run directory"


def not_a_directory(path: str | os.PathLike) -> str | None:
    """Why `path` is no run directory, for a message, or None when it is a directory: "a file,
    not a run directory" of anything else that exists ("a FIFO (named pipe), not a run
    directory" and so on for the other kinds), else `missing_directory`'s reason."""
    if os.path.isdir(path):
        return None
    if not os.path.exists(path):
        return missing_directory(path)
    try:   # a FIFO or a device is no "file" to a user; a symbolic link: what it points to
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0
    kind = next((k for test, k in _KINDS if test(mode)), "a file")
    return f"{kind}, not a run directory"


class NotRegularFileError(OSError):
    """A path that must be a regular file is a FIFO, device, socket or directory.
    str(): "PATH: not a regular file but a FIFO (named pipe)"; strerror: the part after PATH."""

    def __init__(self, path: str | os.PathLike, mode: int) -> None:
        kind = next((f" but {k}" for test, k in _KINDS if test(mode)), "")
        super().__init__(None, f"not a regular file{kind}", os.fspath(path))

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def open_fd(path: str | os.PathLike) -> int:
    """A read-only descriptor of the regular file `path` (the caller closes it).

    Raises NotRegularFileError when `path` is anything else, and open's OSError otherwise
    (FileNotFoundError, PermissionError, ...).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        if e.errno != errno.ENXIO:   # ENXIO: a socket, which open refuses
            raise
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):
            raise
        raise NotRegularFileError(path, mode) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(path, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_binary(path: str | os.PathLike) -> IO[bytes]:
    """`open(path, "rb")` of a regular file. Raises as `open_fd`."""
    return os.fdopen(open_fd(path), "rb")


def require_regular(path: str | os.PathLike) -> None:
    """Check that `path` is a regular file before a library that opens it by name (safetensors)
    does. Raises as `open_fd`."""
    os.close(open_fd(path))


def unreadable_reason(path: str | os.PathLike, e: OSError) -> str:
    """Why a reader here could not read `path` (it raised `e`), without the path, for messages:
    a symbolic link whose target is missing says so ("No such file or directory" named a file
    that ls shows), anything else is e's text."""
    if isinstance(e, FileNotFoundError) and os.path.islink(path):
        try:
            return f"a symbolic link to {os.readlink(path)!r}, which does not exist"
        except OSError:   # gone meanwhile
            pass
    return e.strerror or str(e)


def read_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of the regular file `path`. Raises as `open_fd`."""
    with open_binary(path) as f:
        return f.read()


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of the regular file `path`. Raises as `open_fd`, and UnicodeDecodeError."""
    return read_bytes(path).decode("utf-8")


def read_json(path: str | os.PathLike) -> Any:
    """The JSON document in the regular file `path`. Raises as `read_text`, and
    json.JSONDecodeError (jsontext.loads), nesting past jsontext.MAX_DEPTH included: the
    manifests, evidence and metadata read here are walked recursively afterwards (a resume
    re-serialises the manifest, compare compares it); an object that gives a key twice
    included (jsontext.DuplicateKeyError): json would keep its last value silently, and
    `rlk compare` refuses such a file, so every reader does (the files read here are written
    by rl-kernel or by transformers, one key each)."""
    return jsontext.loads(read_text(path), max_depth=jsontext.MAX_DEPTH, unique_keys=True)


def json_or_why(path: str | os.PathLike) -> tuple[Any, str | None]:
    """(document, None) as `read_json`, or (None, why it cannot be read) for a message that
    names the file before it: "is missing", "is a symbolic link to 'T', which does not exist",
    "is not a regular file but a FIFO (named pipe)", "is not UTF-8 text", "is not valid JSON
    (line L: msg)", "cannot be read (strerror)". Raises nothing of its own."""
    try:
        return read_json(path), None
    except FileNotFoundError as e:   # a dangling link is there for ls: not "missing"
        return None, ("is missing" if not os.path.islink(path)
                      else f"is {unreadable_reason(path, e)}")
    except NotRegularFileError as e:   # a FIFO would block, a device never end
        return None, f"is {e.strerror}"
    except UnicodeDecodeError:
        return None, "is not UTF-8 text"
    except json.JSONDecodeError as e:   # a key given twice and nesting too deep included
        if e.msg == "Expecting value" and not e.doc.strip():   # a file with nothing in it
            return None, "is empty" if not e.doc else "holds only white space"
        return None, f"is not valid JSON ({jsontext.located(e)})"
    except ValueError as e:
        return None, f"is not valid JSON ({e})"
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"


def json_holding_or_why(path: str | os.PathLike, key: str,
                        kind: type[dict] | type[list]) -> tuple[Any, str | None]:
    """`json_or_why` for a run file whose top-level object must hold `key` as a `kind` (dict or
    list: manifest.json's "config", evidence.json's "steps"): (document, None), or (None, why),
    "has no 'config' object", "has 'steps' as an object, not an array", "holds an array, not
    an object with 'config'" among the reasons."""
    doc, why = json_or_why(path)
    noun = "object" if kind is dict else "array"
    if why is not None:
        return None, why
    if not isinstance(doc, dict):
        return None, f"holds {json_kind(doc)}, not an object with {key!r}"
    if key not in doc:
        return None, f"has no {key!r} {noun}"
    if not isinstance(doc[key], kind):
        return None, f"has {key!r} as {json_kind(doc[key])}, not an {noun}"
    return doc, None


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words: "an array", "a string", "null", ...; a
    value JSON has no word for (a Parquet cell's Decimal) by its Python type's name."""
    for t, words in ((bool, "a boolean"), (dict, "an object"), (list, "an array"),
                     (str, "a string"), (int, "a number"), (float, "a number")):
        if isinstance(value, t):
            return words
    return "null" if value is None else type(value).__name__
