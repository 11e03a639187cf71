"""JSON text to Python values, with every failure a `json.JSONDecodeError` (a ValueError).

`json.loads` raises RecursionError, not a ValueError, for deeply nested input (about 1,000
levels in CPython), which callers that catch ValueError for a corrupt file turned into a
traceback. `loads` reports it as an invalid document instead, so the caller's own message for a
corrupt file (naming the file) applies. Does not: read files or validate the structure.
"""

from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes) -> Any:
    """json.loads(text); json.JSONDecodeError for invalid JSON, nesting past the interpreter's
    recursion limit included ("nested too deeply", line 1 column 1)."""
    try:
        return json.loads(text)
    except RecursionError:
        # no copy of the document in the error: it can be large
        raise json.JSONDecodeError("nested too deeply", "", 0) from None
