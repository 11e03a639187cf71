"""Prompt files: JSONL with one {"prompt": str, "label": str} object per line, parsed strictly.

Every problem in a prompt file is reported as a PromptFileError whose message reads
"FILE:LINE: what is wrong; what is allowed", so a user can fix the file without reading code.
The parser works on the file's bytes, which lets the caller hash exactly the bytes it parsed.

Does not: tokenize, apply chat templates, shuffle, deduplicate, or stream files larger than memory.
Keys other than "prompt", "label" and "answer" are ignored.

Run its tests with: .venv/bin/python -m pytest -q tests/test_data.py
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

_FORMAT = 'each non-blank line must be one JSON object like {"prompt": "...", "label": "..."}'


class PromptFileError(ValueError):
    """A prompt file is missing, unreadable or malformed; the message names file and line."""


@dataclass(frozen=True)
class Prompt:
    """One prompt and its reference label.

    `index`: 0-based position among the source's prompts (blank lines are not counted).
    `text`: the prompt text, passed to the tokenizer verbatim. `label`: the reference answer.
    `where`: "FILE:LINE" for a prompt read from a file ("" for generated ones), so later checks
    (e.g. the token-length limit) can point at the line; not part of equality.
    """

    index: int
    text: str
    label: str
    where: str = field(default="", compare=False)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def parse_jsonl(data: bytes, name: str) -> list[Prompt]:
    """Parse JSONL `data` (a file's bytes); `name` is the file name used in error messages.

    Lines are split on b"\\n"; a trailing b"\\r" and a UTF-8 BOM on line 1 are accepted.
    Labels may be strings or numbers (numbers become str(label)); "answer" is accepted when
    "label" is absent ("label" wins when both are present). Raises PromptFileError.
    """
    prompts: list[Prompt] = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{name}:{lineno}"
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PromptFileError(f"{where}: invalid UTF-8 at byte {e.start} of the line; "
                                  f"prompt files must be UTF-8 text") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            msg = str(e) if isinstance(e, ValueError) else "nested too deeply"
            raise PromptFileError(f"{where}: invalid JSON ({msg}); {_FORMAT}") from None
        if not isinstance(obj, dict):
            raise PromptFileError(f"{where}: expected a JSON object, got {type(obj).__name__}; {_FORMAT}")
        if "prompt" not in obj:
            raise PromptFileError(f'{where}: missing "prompt"; {_FORMAT}')
        text = obj["prompt"]
        if not isinstance(text, str):
            raise PromptFileError(f'{where}: "prompt" must be a string, got {type(text).__name__}; {_FORMAT}')
        if not text.strip():
            raise PromptFileError(f'{where}: "prompt" is empty; prompts must contain non-whitespace text')
        key = "label" if "label" in obj else "answer" if "answer" in obj else None
        if key is None:
            raise PromptFileError(f'{where}: missing "label" (or "answer"); {_FORMAT}')
        label = obj[key]
        if isinstance(label, bool) or not isinstance(label, (str, int, float)):
            raise PromptFileError(f'{where}: "{key}" must be a string or a number, '
                                  f'got {type(label).__name__}; {_FORMAT}')
        if isinstance(label, float) and not math.isfinite(label):  # e.g. 1e400 parses as inf
            raise PromptFileError(f'{where}: "{key}" is the number {label}, which is not finite; '
                                  f"labels must be strings or finite numbers")
        label = label if isinstance(label, str) else str(label)
        if not label.strip():
            raise PromptFileError(f'{where}: "{key}" is empty; labels must contain non-whitespace text')
        for field, value in (("prompt", text), (key, label)):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:  # a JSON escape like "\ud800" with no partner
                raise PromptFileError(f'{where}: "{field}" contains an unpaired surrogate escape; '
                                      f"strings must be valid Unicode") from None
        prompts.append(Prompt(index=len(prompts), text=text, label=label, where=where))
    if not prompts:
        raise PromptFileError(f"{name}: no prompts (the file is empty or only blank lines); {_FORMAT}")
    return prompts


def read_prompt_file(path: str | os.PathLike) -> bytes:
    """The bytes of a prompt file. Raises PromptFileError if it is missing or unreadable."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise PromptFileError(f"{path}: file not found; give the path of a JSONL prompt file") from None
    except OSError as e:
        raise PromptFileError(f"{path}: cannot read ({e.strerror or e}); give a readable JSONL file") from None


def load_jsonl(path: str | os.PathLike) -> list[Prompt]:
    """Prompts of the JSONL file at `path`, in file order. Raises PromptFileError (see parse_jsonl)."""
    return parse_jsonl(read_prompt_file(path), os.fspath(path))
