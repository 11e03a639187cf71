"""Prompt files: JSONL (one object per line) or Parquet (one row per prompt), parsed strictly.

Each record gives the prompt text under `input_key` (default "prompt") and the reference label under
`label_key` (default "label"; with the default key, "answer" is accepted when "label" is absent).
Every problem is reported as a PromptFileError whose message reads "FILE:LINE: what is wrong; what
is allowed" (JSONL) or "FILE: row N: ..." (Parquet, N counted from 0), so a user can fix the file
without reading code. The parsers work on the file's bytes, which lets the caller hash exactly the
bytes it parsed. A file is Parquet when its bytes start and end with the magic b"PAR1", whatever
its name; anything else is read as JSONL. A name that claims the other format (.parquet on a file
that is not Parquet, .jsonl/.json/.ndjson on one that is) is refused, naming the mismatch: it is
most often the wrong or a truncated file, and the parser's error would speak of a format the user
did not mean ("invalid JSON" for a broken Parquet file).

Parquet needs pyarrow, an optional extra (`pip install 'rl-kernel[parquet]'`): it is a 40+ MB
wheel that JSONL users do not need; without it a Parquet file is refused with that command.

Does not: tokenize, apply chat templates (rlkernel/data/chat.py), shuffle, deduplicate, or stream
files larger than memory. Other keys/columns are ignored.

Run its tests with: .venv/bin/python -m pytest -q tests/test_data.py
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from rlkernel import jsontext, readfile

PARQUET_MAGIC = b"PAR1"
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_HINT = "pip install 'rl-kernel[parquet]' (or: pip install pyarrow)"


def _format(input_key: str = "prompt", label_key: str = "label") -> str:
    return (f'each non-blank line must be one JSON object like {{"{input_key}": "...", '
            f'"{label_key}": "..."}}')


_FORMAT = _format()


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


def _label_keys(label_key: str) -> tuple[str, ...]:
    """Keys tried for the label, in order: "answer" is a fallback of the default key only."""
    return ("label", "answer") if label_key == "label" else (label_key,)


def _key_list(obj: dict | list, most: int = 8) -> str:
    """A record's keys (or a table's columns) for a message: the first `most`, each cut to 40
    characters (a cut key ends in "…"), as `jsontext.quoted` writes them (non-ASCII as typed,
    control and format characters escaped: they would reach the terminal raw)."""
    keys = [jsontext.quoted(str(k) if len(str(k)) <= 40 else str(k)[:39] + "…")
            for k in list(obj)[:most]]
    more = f", and {len(obj) - most} more" if len(obj) > most else ""
    return (", ".join(keys) + more) if keys else "none"


def _record(obj: dict, where: str, index: int, input_key: str, label_key: str,
            fmt: str) -> Prompt:
    """One validated Prompt from a record (a JSON object or a Parquet row as a dict)."""
    if input_key not in obj:
        raise PromptFileError(f'{where}: missing "{input_key}" (its keys: {_key_list(obj)}); '
                              f"{fmt}")
    text = obj[input_key]
    if not isinstance(text, str):
        raise PromptFileError(f'{where}: "{input_key}" must be a string, got '
                              f"{readfile.json_kind(text)}; {fmt}")
    if not text.strip():
        raise PromptFileError(f'{where}: "{input_key}" is empty; prompts must contain '
                              "non-whitespace text")
    keys = _label_keys(label_key)
    key = next((k for k in keys if k in obj), None)
    if key is None:
        named = f'"{keys[0]}" (or "{keys[1]}")' if len(keys) > 1 else f'"{keys[0]}"'
        raise PromptFileError(f"{where}: missing {named} (its keys: {_key_list(obj)}); {fmt}")
    label = obj[key]
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise PromptFileError(f'{where}: "{key}" must be a string or a number, '
                              f"got {readfile.json_kind(label)}; {fmt}")
    if isinstance(label, float) and not math.isfinite(label):  # e.g. 1e400 parses as inf
        raise PromptFileError(f'{where}: "{key}" is the number {label}, which is not finite; '
                              f"labels must be strings or finite numbers")
    if isinstance(label, float) and abs(label) >= 2.0**53:
        raise PromptFileError(f'{where}: "{key}" is the number {label!r}, a float at or past '
                              "2**53, which may not be the integer written; write the label as a "
                              "string or an integer without a decimal point or exponent")
    label = label if isinstance(label, str) else _number_text(label)
    if not label.strip():
        raise PromptFileError(f'{where}: "{key}" is empty; labels must contain non-whitespace text')
    for name, value in ((input_key, text), (key, label)):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a JSON escape like "\ud800" with no partner
            raise PromptFileError(f'{where}: "{name}" contains an unpaired surrogate escape; '
                                  f"strings must be valid Unicode") from None
    return Prompt(index=index, text=text, label=label, where=where)


def _number_text(x: int | float) -> str:
    """A numeric label (a float below 2**53 in magnitude: `_record` refuses larger ones) as the
    text an answer is matched against: an integral float as its integer ("2.0" and Parquet's
    2.0 -> "2": pandas turns an int column with a missing value into floats, and "2.0" never
    matched the answer "2"); otherwise str(x) ("0.5", "17")."""
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x)


def parse_jsonl(data: bytes, name: str, *, input_key: str = "prompt",
                label_key: str = "label") -> list[Prompt]:
    """Parse JSONL `data` (a file's bytes); `name` is the file name used in error messages.

    Lines are split on b"\\n"; a trailing b"\\r" and a UTF-8 BOM on line 1 are accepted.
    The prompt is the string under `input_key`; the label is the string or number under
    `label_key` (numbers become text: `_number_text`); with the default label_key "label",
    "answer" is accepted when "label" is absent ("label" wins when both are present). Raises
    PromptFileError.
    """
    fmt = _format(input_key, label_key)
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
            # a key given twice: which prompt or label is meant? json would keep the last
            obj = json.loads(line, parse_constant=_reject_constant,
                             object_pairs_hook=jsontext.unique_pairs)
        except jsontext.DuplicateKeyError as e:
            raise PromptFileError(f"{where}: invalid JSON ({e.msg}); {fmt}") from None
        except (ValueError, RecursionError) as e:
            msg = str(e) if isinstance(e, ValueError) else "nested too deeply"
            raise PromptFileError(f"{where}: invalid JSON ({msg}); {fmt}") from None
        if not isinstance(obj, dict):
            raise PromptFileError(f"{where}: expected a JSON object, got "
                                  f"{readfile.json_kind(obj)}; {fmt}")
        prompts.append(_record(obj, where, len(prompts), input_key, label_key, fmt))
    if not prompts:
        raise PromptFileError(f"{name}: no prompts (the file is empty or only blank lines); {fmt}")
    return prompts


def is_parquet(data: bytes) -> bool:
    """True when `data` is framed like a Parquet file (magic b"PAR1" at both ends)."""
    return len(data) >= 8 and data[:4] == PARQUET_MAGIC and data[-4:] == PARQUET_MAGIC


def _pyarrow_parquet(name: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PromptFileError(f"{name}: is a Parquet file, and reading Parquet needs pyarrow, "
                              f"which is not installed; {PARQUET_HINT}") from None
    return pq


def parquet_columns(data: bytes, name: str) -> list[str]:
    """Column names of the Parquet file `data` (its schema only). Raises PromptFileError."""
    pq = _pyarrow_parquet(name)
    import pyarrow as pa
    try:
        return list(pq.read_schema(pa.BufferReader(data)).names)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise PromptFileError(f"{name}: not a readable Parquet file ({e})") from None


def parse_parquet(data: bytes, name: str, *, input_key: str = "prompt",
                  label_key: str = "label") -> list[Prompt]:
    """Parse Parquet `data` (a file's bytes): one prompt per row, in row order, from the columns
    `input_key` (string) and `label_key` (string or number; "answer" as for JSONL).

    Needs pyarrow. Raises PromptFileError for: no pyarrow (naming the install command), an
    unreadable file, a missing column (listing the file's columns), a null or mistyped value
    ("FILE: row N", N from 0), no rows.
    """
    _pyarrow_parquet(name)
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = parquet_columns(data, name)
    keys = _label_keys(label_key)
    label_col = next((k for k in keys if k in columns), None)
    fmt = (f'each row needs a string column "{input_key}" and a string or number column '
           f'"{label_key}"')
    for col, shown in ((input_key, f'"{input_key}"'),
                       (label_col, " or ".join(f'"{k}"' for k in keys))):
        if col is None or col not in columns:
            raise PromptFileError(f"{name}: no column {shown}; the file has columns "
                                  f"{_key_list(columns)}; name them with "
                                  "--input-key/--label-key")
        if columns.count(col) > 1:      # pyarrow cannot pick one: name the cause, not its error
            raise PromptFileError(f'{name}: column "{col}" appears {columns.count(col)} times; '
                                  "the columns read must each have one name of their own")
    try:
        table = pq.read_table(pa.BufferReader(data), columns=[input_key, label_col])
    except (pa.ArrowException, OSError, ValueError) as e:
        raise PromptFileError(f"{name}: not a readable Parquet file ({e})") from None
    texts, labels = (table.column(c).to_pylist() for c in (input_key, label_col))
    prompts = [_record({input_key: t, label_col: lab}, f"{name}: row {i}", i, input_key,
                       label_col, fmt) for i, (t, lab) in enumerate(zip(texts, labels))]
    if not prompts:
        raise PromptFileError(f"{name}: no prompts (the table has no rows); {fmt}")
    return prompts


def check_name_matches(data: bytes, name: str) -> None:
    """Refuse a file whose name claims the format its bytes are not (module doc): the content
    still decides the format, the name only catches a mix-up. Raises PromptFileError."""
    suffix = os.path.splitext(name)[1].lower()
    if suffix == ".parquet" and not is_parquet(data):
        if data.startswith(PARQUET_MAGIC):
            why, fix = "starts with PAR1 but does not end with it: truncated?", "give the whole file"
        else:
            why, fix = "no PAR1 header", "give a Parquet file, or name a JSONL file .jsonl"
        raise PromptFileError(f"{name}: named .parquet but not a Parquet file ({why}); {fix}")
    if suffix in JSONL_SUFFIXES and is_parquet(data):
        raise PromptFileError(f"{name}: named {suffix} but is a Parquet file (PAR1 magic at both "
                              "ends); name it .parquet, or give the JSONL file")


_WRAPPINGS = ((b"\x1f\x8b", "gzip-compressed", "decompress it (gunzip) first"),
              (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it (unzstd) first"),
              (b"PK\x03\x04", "a zip archive", "extract the file from it first"),
              (b"\xff\xfe", "UTF-16 text (a little-endian byte-order mark)", "save it as UTF-8"),
              (b"\xfe\xff", "UTF-16 text (a big-endian byte-order mark)", "save it as UTF-8"))


def _refuse_wrapped(data: bytes, name: str) -> None:
    """A compressed or UTF-16 file, named by what its first bytes show (it read as "invalid
    UTF-8 at byte 0 of the line"). Raises PromptFileError."""
    for magic, what, fix in _WRAPPINGS:
        if data.startswith(magic):
            raise PromptFileError(f"{name}: is {what}, not JSONL or Parquet; {fix}")


def parse_prompts(data: bytes, name: str, *, input_key: str = "prompt",
                  label_key: str = "label") -> list[Prompt]:
    """`parse_parquet` when `data` is Parquet (`is_parquet`), else `parse_jsonl`, after
    `check_name_matches` and `_refuse_wrapped`."""
    check_name_matches(data, name)
    _refuse_wrapped(data, name)
    parse = parse_parquet if is_parquet(data) else parse_jsonl
    return parse(data, name, input_key=input_key, label_key=label_key)


def load_prompts(path: str | os.PathLike, *, input_key: str = "prompt",
                 label_key: str = "label") -> list[Prompt]:
    """Prompts of the JSONL or Parquet file at `path` (`parse_prompts`). Raises PromptFileError."""
    return parse_prompts(read_prompt_file(path), os.fspath(path), input_key=input_key,
                         label_key=label_key)


def read_prompt_file(path: str | os.PathLike) -> bytes:
    """The bytes of a prompt file. Raises PromptFileError if it is missing or unreadable."""
    try:
        return readfile.read_bytes(path)   # a FIFO would block, a device never end
    except FileNotFoundError:
        raise PromptFileError(f"{path}: file not found; give the path of a JSONL or Parquet "
                              "prompt file") from None
    except OSError as e:
        raise PromptFileError(f"{path}: cannot read ({e.strerror or e}); give a readable JSONL or "
                              "Parquet file") from None


def load_jsonl(path: str | os.PathLike, **keys: str) -> list[Prompt]:
    """Prompts of the JSONL file at `path`, in file order; `keys`: input_key/label_key.
    Raises PromptFileError (see parse_jsonl)."""
    return parse_jsonl(read_prompt_file(path), os.fspath(path), **keys)
