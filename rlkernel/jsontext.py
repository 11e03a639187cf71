"""JSON text to Python values, with every failure a `json.JSONDecodeError` (a ValueError); and
JSON strings for messages (`quoted`) that print no control or format character raw.

`json.loads` raises RecursionError, not a ValueError, for deeply nested input (about 1,000
levels in CPython), which callers that catch ValueError for a corrupt file turned into a
traceback. `loads` reports it as an invalid document instead, so the caller's own message for a
corrupt file (naming the file) applies. Does not: read files or validate the structure.
"""

from __future__ import annotations

import json
import sys
import unicodedata
from typing import Any

UNPRINTABLE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
"""Unicode categories a message must not print raw: controls (an escape sequence would reach
the terminal), format characters (bidi overrides), line/paragraph separators, and lone
surrogates (a JSON "\ud800" escape decodes to one; writing it to a UTF-8 stream raises)."""


def _hidden(c: str) -> bool:
    return unicodedata.category(c) in UNPRINTABLE


def unprintable(text: str) -> bool:
    """Whether text holds a character of an UNPRINTABLE category."""
    return any(map(_hidden, text))


def printable(text: str) -> str:
    """text with each UNPRINTABLE character written as \\uXXXX (the rest as it is), for a line
    a terminal shows."""
    return "".join(f"\\u{ord(c):04x}" if _hidden(c) else c for c in text)


def quoted(text: str) -> str:
    """text as a JSON string for a message: non-ASCII as typed, UNPRINTABLE characters as
    \\uXXXX (JSON escapes only the C0 ones)."""
    return printable(json.dumps(text, ensure_ascii=False))


MAX_DEPTH = 64
"""Nesting for a caller that walks a document recursively (readfile.read_json's manifests and
evidence, rlk compare) to refuse: rl-kernel's files nest a few levels, and such a walk must not
run out of stack on a forged or corrupt document the parser still accepted (~1,000 levels)."""


class DuplicateKeyError(json.JSONDecodeError):
    """`loads(unique_keys=True)` or `unique_pairs`: an object gave a key twice (msg names it)."""


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: the object, or DuplicateKeyError for a key given twice (json
    keeps the last value silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(f"duplicate key {quoted(k)} in one object", "", 0)
        out[k] = v
    return out


def located(e: json.JSONDecodeError, column: bool = False) -> str:
    """e's message with its place, "line L[, column C]: msg" — or the message alone for the
    errors this module raises after parsing (a duplicate key, nesting, a long integer), which
    carry no place (they said "line 1" of a duplicate on line 11)."""
    if not e.doc:
        return e.msg
    place = f"line {e.lineno}{f', column {e.colno}' if column else ''}"
    if e.msg.endswith(" at"):   # json's "Unterminated string starting at": the place ends it
        return f"{e.msg} {place}"
    return f"{place}: {e.msg}"


def loads(text: str | bytes, max_depth: int | None = None, unique_keys: bool = False) -> Any:
    """json.loads(text); json.JSONDecodeError for invalid JSON, nesting past the interpreter's
    recursion limit included ("nested too deeply", line 1 column 1), an integer past
    Python's digit limit for int conversion (sys.get_int_max_str_digits(), 4,300 by default; a
    ValueError of its own) and bytes that are not UTF-8/16/32 (a UnicodeDecodeError).
    `max_depth`: also refuse containers nested deeper than that (one pass over the document,
    so only where a recursive walk follows). `unique_keys`: also refuse an object that gives a
    key twice (DuplicateKeyError, a JSONDecodeError), which json.loads resolves silently to the last value — where
    a document is evidence, two values for one field are an edit, not a choice."""
    try:
        value = json.loads(text, object_pairs_hook=unique_pairs if unique_keys else None)
    except json.JSONDecodeError:   # DuplicateKeyError included
        raise
    except RecursionError:
        # no copy of the document in the error: it can be large
        raise json.JSONDecodeError("nested too deeply", "", 0) from None
    except UnicodeDecodeError as e:     # bytes given: json decodes them first
        raise json.JSONDecodeError(f"not UTF-8/16/32 text ({e.reason} at byte {e.start})",
                                   "", 0) from None
    except ValueError:      # the one left: an integer past int()'s digit limit
        raise json.JSONDecodeError("an integer of more than "
                                   f"{sys.get_int_max_str_digits()} digits", "", 0) from None
    if max_depth is not None and _depth(value) > max_depth:
        raise json.JSONDecodeError(f"nested too deeply (more than {max_depth} levels)", "", 0)
    return value


def _depth(value: Any) -> int:
    """Containers nested in value (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        deepest = max(deepest, d)
        stack.extend((x, d + 1) for x in items)
    return deepest
