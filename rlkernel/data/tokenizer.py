"""Tokenizers: the embedded byte tokenizer of the tiny model, and a thin wrapper over HF tokenizer.json.

Both classes share one small interface: `vocab_size`, `eos_id`, `pad_id`, `name`,
`encode(text) -> list[int]` and `decode(ids) -> str`. `load_tokenizer` picks one for a model
directory and checks that every id the tokenizer can produce is a valid row of the model's
embedding, so a bad pairing fails at start-up rather than as an index error mid-rollout.

`standin_tokenizer_files` writes a byte-level tokenizer.json (+ tokenizer_config.json) for a
randomly initialised model (`rlk init-model`) or a run of the embedded tiny model (`rlk export`),
so such a directory loads with `rlk run --model` and with transformers' AutoTokenizer.

Does not: apply chat templates (rlkernel/data/chat.py), add BOS/special tokens on encode, pad or
batch, or download anything.
Decoding is for logs and rewards only; training and rollout work on ids, never on re-encoded text.

Run its tests with: .venv/bin/python -m pytest -q tests/test_data.py
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import json

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from rlkernel import readfile

# Byte tokenizer layout: ids 0..255 are raw UTF-8 bytes, then specials, then reserved ids.
BYTE_VOCAB_SIZE = 264
BYTE_EOS_ID = 256  # "<|endoftext|>"
BYTE_PAD_ID = 257  # "<|pad|>"; 258..263 reserved
# The smallest model vocabulary the byte tokenizer can serve: bytes + EOS + pad.
BYTE_MIN_MODEL_VOCAB = BYTE_PAD_ID + 1

# Token strings tried, in order, when the model config does not name its EOS id.
_EOS_TOKENS = ("<|endoftext|>", "<|im_end|>")
_PAD_TOKENS = ("<|pad|>", "<pad>", "[PAD]")


class TokenizerError(ValueError):
    """A model directory's tokenizer cannot serve its model: tokenizer.json is unreadable, or it
    disagrees with config.json (EOS id, vocabulary); the message names the file and the value."""


class ByteTokenizer:
    """UTF-8 byte tokenizer, vocab 264: ids 0..255 bytes, 256 EOS, 257 pad, 258..263 reserved."""

    name = "bytes"

    def __init__(self) -> None:
        self.vocab_size = BYTE_VOCAB_SIZE
        self.eos_id = BYTE_EOS_ID
        self.pad_id = BYTE_PAD_ID

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of `text` as ids in [0, 256); no EOS is appended.

        Raises UnicodeEncodeError (a ValueError) if `text` holds an unpaired surrogate.
        """
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to (not including) the first EOS; pad/reserved ids are skipped.

        Byte sequences that are not valid UTF-8 (e.g. a character cut by a length limit) decode
        to U+FFFD. Raises ValueError for an id outside [0, 264).
        """
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < BYTE_VOCAB_SIZE:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocab [0, {BYTE_VOCAB_SIZE})")
            if i == BYTE_EOS_ID:
                break
            if i < 256:
                out.append(i)
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json, with the same interface as ByteTokenizer.

    `vocab_size` is the id bound: 1 + the largest id the tokenizer can produce (never less than
    `get_vocab_size()`), so a vocabulary with gaps in its ids is still bounded correctly.
    """

    def __init__(self, path: str | os.PathLike, eos_id: int | None = None,
                 eos_source: str | os.PathLike | None = None) -> None:
        """Load `path` (a tokenizer.json).

        `eos_id`: the model config's eos_token_id; when None, the id of "<|endoftext|>" or else
        "<|im_end|>". `eos_source`: the file `eos_id` was read from (the model's config.json),
        named when it is not an id of this tokenizer. Raises TokenizerError naming the file if it
        cannot be parsed, if no EOS can be found, or if `eos_id` is not an id of this tokenizer.
        """
        self.path = Path(path)
        try:
            readfile.require_regular(self.path)   # from_file opens by name: a FIFO blocks it
        except OSError as e:
            raise TokenizerError(f"{self.path}: cannot be read "
                                 f"({readfile.unreadable_reason(self.path, e)}); expected a "
                                 "Hugging Face tokenizer.json") from None
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception for any parse error
            raise TokenizerError(f"{self.path}: cannot load tokenizer ({e}); expected a Hugging "
                                 f"Face tokenizer.json") from e
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)
        self.name = f"hf:{self.path}"

        if eos_id is None:
            found = [self._tok.token_to_id(t) for t in _EOS_TOKENS]
            found = [i for i in found if i is not None]
            if not found:
                raise TokenizerError(f"{self.path}: no EOS token: the model config gives no "
                                     f"eos_token_id and the tokenizer has none of "
                                     f"{list(_EOS_TOKENS)}")
            eos_id = found[0]
        if isinstance(eos_id, bool) or not isinstance(eos_id, int) or not 0 <= eos_id < self.vocab_size:
            # The value is the config's: name that file, then the tokenizer it does not fit.
            where = (f"{eos_source}: eos_token_id {eos_id!r} is not a token id of the tokenizer "
                     f"{self.path}" if eos_source is not None else
                     f"{self.path}: eos_token_id {eos_id!r} is not a token id of this tokenizer")
            raise TokenizerError(f"{where} (ids are in [0, {self.vocab_size}))")
        self.eos_id = eos_id

        pad = self._tok.padding["pad_id"] if self._tok.padding else None
        if pad is None:
            found = [self._tok.token_to_id(t) for t in _PAD_TOKENS]
            pad = next((i for i in found if i is not None), None)
        self.pad_id = eos_id if pad is None else pad

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, without special tokens added (no BOS/EOS)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to (not including) the first EOS, special tokens skipped.

        Raises ValueError for an id outside [0, vocab_size) (the library would drop it silently).
        """
        cut: list[int] = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocab of {self.path} [0, {self.vocab_size})")
            if i == self.eos_id:
                break
            cut.append(i)
        return self._tok.decode(cut, skip_special_tokens=True)


def load_tokenizer(model_dir: str | os.PathLike | None, *, vocab_size: int,
                   eos_token_id: int | None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer for a model: `model_dir`/tokenizer.json if present, else the byte tokenizer.

    `vocab_size` and `eos_token_id` come from the model config (embedding rows, EOS id).
    Raises TokenizerError (a ValueError) naming the file the bad value is in when:
    - there is no tokenizer.json and `vocab_size` < 258 (the byte tokenizer needs ids 0..257),
      or `eos_token_id` is set to something other than the byte EOS (256) (config.json);
    - tokenizer.json is corrupt (tokenizer.json), or `eos_token_id` is not one of its ids
      (config.json);
    - the tokenizer can produce an id >= `vocab_size` (message names both numbers).
    """
    path = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
    # Where the model config's values come from, for messages about them.
    config = (f"{Path(model_dir) / 'config.json'}: the model directory" if model_dir is not None
              else "the model (no model directory)")
    # lexists: a link to nowhere is a broken tokenizer.json (HFTokenizer says so), not none
    # (exists() is False for it, and the byte tokenizer was used silently).
    if path is None or not os.path.lexists(path):
        if vocab_size < BYTE_MIN_MODEL_VOCAB:
            raise TokenizerError(f"{config} has no tokenizer.json and its vocab_size {vocab_size} "
                                 f"is too small for the byte tokenizer (needs >= "
                                 f"{BYTE_MIN_MODEL_VOCAB}: 256 bytes + EOS + pad); add a "
                                 f"tokenizer.json or use vocab_size >= {BYTE_MIN_MODEL_VOCAB}")
        if eos_token_id is not None and eos_token_id != BYTE_EOS_ID:
            raise TokenizerError(f"{config} has no tokenizer.json, so the byte tokenizer is used, "
                                 f"whose EOS id is {BYTE_EOS_ID}, but the model config says "
                                 f"eos_token_id={eos_token_id}")
        return ByteTokenizer()

    tok = HFTokenizer(path, eos_token_id, eos_source=Path(model_dir) / "config.json")
    if tok.vocab_size > vocab_size:
        raise TokenizerError(f"{path}: the tokenizer produces ids up to {tok.vocab_size - 1} "
                             f"(id bound {tok.vocab_size}) but the model's vocab_size is "
                             f"{vocab_size}; every token id must be < vocab_size")
    return tok


# ---------------------------------------------------------------------------------------------
# stand-in tokenizer files for models without a real tokenizer

QWEN_SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
"""Qwen3's special tokens at their real ids, so a stand-in for a Qwen3-shaped model keeps its EOS."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""ChatML, the turn format of Qwen models, for stand-ins that have its special tokens."""


def byte_symbols() -> list[str]:
    """The 256 printable characters that byte-level BPE uses for bytes 0..255 (index = byte).

    Printable Latin-1 bytes stand for themselves; the others (controls, space, DEL, NBSP, soft
    hyphen) take the characters U+0100, U+0101, ... in byte order. This is the mapping the
    `tokenizers` ByteLevel pre-tokenizer and decoder apply, so a vocabulary keyed by these
    characters gives byte b the id we choose for it.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) \
        | set(range(0xAE, 0xFF + 1))
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def _standin_specials(vocab_size: int, eos_token_id: int | None) -> tuple[dict[int, str], bool]:
    """(id -> special token, whether ids not listed are reserved specials) for a stand-in."""
    if eos_token_id in (None, BYTE_EOS_ID) and vocab_size >= BYTE_MIN_MODEL_VOCAB:
        # The byte tokenizer's layout: 256 EOS, 257 pad, the rest reserved (decode to nothing).
        return {BYTE_EOS_ID: "<|endoftext|>", BYTE_PAD_ID: "<|pad|>"}, True
    if vocab_size > max(QWEN_SPECIALS) and eos_token_id in QWEN_SPECIALS:
        return dict(QWEN_SPECIALS), False
    if eos_token_id is None or not 256 <= eos_token_id < vocab_size:
        raise ValueError(f"a stand-in byte tokenizer needs ids 0..255 for bytes and an EOS id in "
                         f"[256, vocab_size={vocab_size}); the model's eos_token_id is "
                         f"{eos_token_id!r}")
    return {eos_token_id: "<|endoftext|>"}, False


def standin_tokenizer_files(vocab_size: int, eos_token_id: int | None) -> dict[str, bytes]:
    """{"tokenizer.json": ..., "tokenizer_config.json": ...} of a byte-level stand-in tokenizer.

    Ids 0..255 are the bytes (id = byte value, as in ByteTokenizer), with no merges, so text
    encodes to its UTF-8 bytes. Special tokens: with eos_token_id 256 (or None) the byte
    tokenizer's layout (256 "<|endoftext|>", 257 "<|pad|>", every further id a reserved special
    token that decodes to nothing), so it encodes and decodes as ByteTokenizer does; for a
    Qwen3-shaped vocab, Qwen3's <|endoftext|> / <|im_start|> / <|im_end|> at their real ids and
    a ChatML chat template; otherwise "<|endoftext|>" at eos_token_id. Every other id is a filler
    token "<|xN|>" (so any id a random model samples decodes). Deterministic bytes.

    Raises ValueError when vocab_size < 257 or eos_token_id is not an id in [256, vocab_size).
    """
    if vocab_size <= 256:
        raise ValueError(f"a stand-in byte tokenizer needs vocab_size > 256 (256 bytes + EOS), "
                         f"got {vocab_size}")
    specials, reserved = _standin_specials(vocab_size, eos_token_id)
    vocab = {ch: i for i, ch in enumerate(byte_symbols())}
    for i in range(256, vocab_size):
        if i not in specials:
            specials_name = f"<|reserved_{i}|>" if reserved else f"<|x{i}|>"
            if reserved:
                specials[i] = specials_name
            else:
                vocab[specials_name] = i
    vocab.update({t: i for i, t in specials.items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for _, t in sorted(specials.items())])
    eos = specials[BYTE_EOS_ID if reserved else (eos_token_id or BYTE_EOS_ID)]
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                    "pad_token": specials[BYTE_PAD_ID] if reserved else eos,
                    "clean_up_tokenization_spaces": False, "add_bos_token": False}
    if "<|im_start|>" in specials.values():
        config["chat_template"] = CHATML_TEMPLATE
    return {"tokenizer.json": tok.to_str().encode("utf-8"),
            "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode("utf-8")}
