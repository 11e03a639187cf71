"""The model's chat template (`--apply-chat-template`): find it, render one user turn with jinja2.

A Hugging Face model directory keeps its template in `chat_template.jinja` (transformers >= 4.43
writes it there) or under "chat_template" in `tokenizer_config.json` (a string, or a list of
{"name", "template"} of which "default" is used). `ChatTemplate.render(prompt)` renders
[{"role": "user", "content": prompt}] with add_generation_prompt=True, the way transformers'
`apply_chat_template(..., tokenize=False)` does: a sandboxed jinja2 environment with trim_blocks
and lstrip_blocks, the loop-controls extension, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII, and the tokenizer's special-token strings (bos_token, eos_token, ...) as
variables. The result is encoded without adding special tokens (the template writes them).

Does not: tokenize, support tools/documents/multi-turn input, or download templates.
Run its tests: `.venv/bin/python -m pytest -q tests/test_data.py -k chat`.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkernel import jsontext, readfile

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """No usable chat template; the message names the model directory and what was looked for."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's source, where it came from, and the special-token strings it may use."""

    source: str
    origin: str
    special_tokens: dict[str, str]

    def render(self, prompt: str) -> str:
        """The text of one user turn `prompt` followed by the assistant's generation prompt.

        Raises ChatTemplateError naming the template's origin when the template does not render
        (a jinja2 error, or the template's own raise_exception).
        """
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators=None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:
            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        try:
            return env.from_string(self.source).render(
                messages=[{"role": "user", "content": prompt}], add_generation_prompt=True,
                **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"{self.origin}: the chat template does not render: "
                                    f"{type(e).__name__}: {e}") from None


def _read_text(path: Path) -> str:
    """`path`'s UTF-8 text. Raises ChatTemplateError naming it when it cannot be read (a FIFO,
    directory or link to nowhere included: is_file() skipped them, and the error said there was
    no template) or is not UTF-8."""
    try:
        return readfile.read_text(path)
    except OSError as e:
        raise ChatTemplateError(f"{path}: cannot be read ({readfile.unreadable_reason(path, e)})"
                                ) from None
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"{path}: cannot be read ({e})") from None


def _read_json(path: Path) -> dict:
    try:
        # a key given twice (two chat_template values): json would take the last silently
        d = jsontext.loads(_read_text(path), unique_keys=True)
    except json.JSONDecodeError as e:   # DuplicateKeyError included (it has no place)
        raise ChatTemplateError(f"{path}: cannot be read as JSON "
                                f"({jsontext.located(e, column=True)})") from None
    if not isinstance(d, dict):
        raise ChatTemplateError(f"{path}: top level is a JSON {type(d).__name__}; expected an "
                                "object")
    return d


def _token_text(v: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": str, ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def load_chat_template(model_dir: str | os.PathLike | None) -> ChatTemplate:
    """The chat template of the model in `model_dir` (None: the embedded tiny model, which has
    none).

    Raises ChatTemplateError naming the directory and the two places looked in when there is no
    template, or when tokenizer_config.json is unreadable or its chat_template is malformed.
    """
    if model_dir is None:
        raise ChatTemplateError("--apply-chat-template: the embedded tiny model has no chat "
                                "template (its byte tokenizer has none); give --model DIR with "
                                f"a {TEMPLATE_FILE} or a chat_template in {TOKENIZER_CONFIG}, "
                                "or leave out --apply-chat-template")
    d = Path(model_dir)
    cfg_path = d / TOKENIZER_CONFIG
    tcfg = _read_json(cfg_path) if os.path.lexists(cfg_path) else {}
    special = {k: t for k in _SPECIAL_KEYS if (t := _token_text(tcfg.get(k))) is not None}
    file = d / TEMPLATE_FILE
    if os.path.lexists(file):
        return ChatTemplate(_read_text(file), str(file), special)
    tmpl = tcfg.get("chat_template")
    if isinstance(tmpl, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default")
        if tmpl is None:
            raise ChatTemplateError(f"{cfg_path}: chat_template lists templates "
                                    f"{sorted(map(str, named))} but none named 'default'")
    if tmpl is None:
        raise ChatTemplateError(f"--apply-chat-template: model directory {d} has no chat "
                                f"template (no {TEMPLATE_FILE}, no chat_template in "
                                f"{TOKENIZER_CONFIG}); add one, or leave out "
                                "--apply-chat-template")
    if not isinstance(tmpl, str) or not tmpl.strip():
        raise ChatTemplateError(f"{cfg_path}: chat_template must be a non-empty string, got "
                                f"{tmpl!r:.60}")
    return ChatTemplate(tmpl, f"{cfg_path} chat_template", special)
