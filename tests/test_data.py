"""Tests of rlkernel/data: tokenizers, JSONL prompt files, the arithmetic task and the prompt source.

Fast and CPU-only. Run: .venv/bin/python -m pytest -q tests/test_data.py
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from rlkernel.data.prompts import Prompt, PromptFileError, load_jsonl, load_prompts
from rlkernel.data.tasks import arithmetic_prompts, prompt_source, reward, task_description
from rlkernel.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


# ---------------------------------------------------------------- tokenizers

def test_byte_tokenizer_layout():
    """vocab 264, EOS 256, pad 257, name "bytes"."""
    t = ByteTokenizer()
    assert (t.vocab_size, t.eos_id, t.pad_id, t.name) == (264, 256, 257, "bytes")


@pytest.mark.parametrize("text", ["", "Compute 37+45=", "héllo wörld", "日本語 🙂", "a\nb\x00c"])
def test_byte_round_trip(text):
    """decode(encode(s)) == s, and encode(s) == the UTF-8 bytes of s."""
    t = ByteTokenizer()
    ids = t.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert t.decode(ids) == text


def test_byte_decode_stops_at_eos_and_skips_specials():
    """Everything from the first EOS on is dropped; pad/reserved ids vanish; bad bytes -> U+FFFD."""
    t = ByteTokenizer()
    assert t.decode(t.encode("ab") + [256] + t.encode("cd")) == "ab"
    assert t.decode([257, 97, 258, 263, 98]) == "ab"
    assert t.decode([0xE6, 0x97]) == "\ufffd"  # a 3-byte character cut after 2 bytes
    with pytest.raises(ValueError, match="264"):
        t.decode([264])


def _write_hf_tokenizer(dirpath: Path, *, specials=("<|endoftext|>",), vocab=None, pad=None) -> Path:
    vocab = vocab or {"[UNK]": 0, "hello": 1, "world": 2, "7": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(specials))
    if pad is not None:
        tok.enable_padding(pad_id=tok.token_to_id(pad), pad_token=pad)
    path = dirpath / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_encode_decode(tmp_path):
    """Encode adds no specials; decode stops at EOS and skips specials; eos found by name; pad = eos."""
    path = _write_hf_tokenizer(tmp_path, specials=("<|endoftext|>", "<|im_end|>"))
    t = HFTokenizer(path)
    assert t.eos_id == 4 and t.pad_id == 4 and t.vocab_size == 6
    assert t.encode("hello world 7") == [1, 2, 3]
    assert t.encode("hello <|im_end|> world") == [1, 5, 2]
    assert t.decode([1, 2, 5, 3]) == "hello world 7"
    assert t.decode([1, 4, 2]) == "hello"
    with pytest.raises(ValueError, match="outside"):
        t.decode([6])


def test_hf_tokenizer_eos_choice(tmp_path):
    """eos_id argument wins; else <|endoftext|>, else <|im_end|>; none -> ValueError naming file."""
    path = _write_hf_tokenizer(tmp_path, specials=("<|im_end|>",))
    assert HFTokenizer(path).eos_id == 4
    assert HFTokenizer(path, eos_id=3).eos_id == 3
    with pytest.raises(ValueError, match="not a token id"):
        HFTokenizer(path, eos_id=99)
    (tmp_path / "none").mkdir()
    path2 = _write_hf_tokenizer(tmp_path / "none", specials=())
    with pytest.raises(ValueError, match=r"tokenizer\.json.*no EOS"):
        HFTokenizer(path2)


def test_hf_tokenizer_pad_token(tmp_path):
    """A padding config or a <|pad|> token gives pad_id; otherwise pad_id == eos_id."""
    path = _write_hf_tokenizer(tmp_path, specials=("<|endoftext|>", "<|pad|>"))
    assert HFTokenizer(path).pad_id == 5
    (tmp_path / "p").mkdir()
    path = _write_hf_tokenizer(tmp_path / "p", specials=("<|endoftext|>", "<x>"), pad="<x>")
    assert HFTokenizer(path).pad_id == 5


def test_hf_tokenizer_sparse_ids_bound(tmp_path):
    """vocab_size is 1 + the largest id, even when get_vocab_size() undercounts a gappy vocab."""
    path = _write_hf_tokenizer(tmp_path, vocab={"[UNK]": 0, "hello": 300})
    t = HFTokenizer(path)
    assert t.vocab_size == 301  # ids 0, 2 (<|endoftext|>), 300; get_vocab_size() says 3
    with pytest.raises(ValueError, match=r"id bound 301.*vocab_size is 264"):
        load_tokenizer(tmp_path, vocab_size=264, eos_token_id=None)


def test_load_tokenizer_choices(tmp_path):
    """None or a dir without tokenizer.json -> bytes; a dir with one -> HFTokenizer."""
    assert isinstance(load_tokenizer(None, vocab_size=264, eos_token_id=256), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path, vocab_size=258, eos_token_id=None), ByteTokenizer)
    _write_hf_tokenizer(tmp_path)
    t = load_tokenizer(str(tmp_path), vocab_size=64, eos_token_id=None)
    assert isinstance(t, HFTokenizer) and t.eos_id == 4


def test_load_tokenizer_errors(tmp_path):
    """Vocab too small for bytes; byte EOS mismatch; tokenizer ids past vocab; corrupt file."""
    with pytest.raises(ValueError, match=r"no tokenizer\.json.*vocab_size 257 is too small"):
        load_tokenizer(tmp_path, vocab_size=257, eos_token_id=None)
    with pytest.raises(ValueError, match="eos_token_id=5"):
        load_tokenizer(None, vocab_size=264, eos_token_id=5)
    _write_hf_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"id bound 5.*vocab_size is 4"):
        load_tokenizer(tmp_path, vocab_size=4, eos_token_id=None)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad/tokenizer\.json: cannot load"):
        load_tokenizer(bad, vocab_size=1000, eos_token_id=None)


# ---------------------------------------------------------------- JSONL prompts

def _write(tmp_path: Path, content: str | bytes, name: str = "p.jsonl") -> Path:
    p = tmp_path / name
    p.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return p


def test_load_jsonl_ok(tmp_path):
    """label/answer, numeric labels, blank lines, CRLF, BOM; index = position among prompts."""
    lines = ['\ufeff{"prompt": "1+1=", "label": "2"}', "", "   ",
             '{"prompt": "2+2=", "answer": 4, "extra": [1]}\r',
             '{"prompt": "half", "label": 0.5}', '{"prompt": "both", "label": "L", "answer": "A"}',
             '{"prompt": "float", "label": 2.0}', '{"prompt": "neg", "label": -0.0}',
             '{"prompt": "big", "label": 9007199254740991.0}', ""]
    got = load_jsonl(_write(tmp_path, "\n".join(lines)))
    assert got == [Prompt(0, "1+1=", "2"), Prompt(1, "2+2=", "4"), Prompt(2, "half", "0.5"),
                   Prompt(3, "both", "L"), Prompt(4, "float", "2"), Prompt(5, "neg", "0"),
                   Prompt(6, "big", "9007199254740991")]
    # an integral float label is the integer an answer states (it was "2.0": reward 0 for "2")
    assert reward("2", got[4].label) == 1.0 and reward("2.0", "2.0") == 1.0


GOOD = '{"prompt": "p", "label": "l"}\n'


@pytest.mark.parametrize("line, what", [
    (b"{not json}", "invalid JSON"),
    (b'{"a": NaN, "prompt": "p", "label": "l"}', "invalid JSON"),
    (b"[1, 2]", "expected a JSON object, got an array"),
    (b'"just a string"', "expected a JSON object, got a string"),
    (b'{"label": "x"}', 'missing "prompt"'),
    (b'{"prompt": "x"}', 'missing "label" (or "answer")'),
    (b'{"prompt": 3, "label": "x"}', '"prompt" must be a string, got a number'),
    (b'{"prompt": "  ", "label": "x"}', '"prompt" is empty'),
    (b'{"prompt": "x", "label": null}', '"label" must be a string or a number, got null'),
    (b'{"prompt": "x", "answer": true}', '"answer" must be a string or a number, got a boolean'),
    (b'{"prompt": "x", "label": ""}', '"label" is empty'),
    (b'{"prompt": "x", "label": 1e400}', "not finite"),
    (b'{"prompt": "x", "label": 1e20}', "a float at or past 2**53"),
    (b'{"prompt": "x", "label": -9007199254740992.0}', "a float at or past 2**53"),
    (b'{"prompt": "\\ud800", "label": "x"}', "unpaired surrogate"),
    (b'{"prompt": "\xff\xfe", "label": "x"}', "invalid UTF-8"),
    # json keeps the last of two values: a line trained on "b" silently (found by a breaker)
    (b'{"prompt": "a", "prompt": "b", "label": "x"}',
     'invalid JSON (duplicate key "prompt" in one object); '),
    (b'{"prompt": "a", "label": {"v": 1, "v": 2}}', 'invalid JSON (duplicate key "v" in one '
                                                    'object); '),
])
def test_load_jsonl_malformed_line(tmp_path, line, what):
    """A bad line 3 -> PromptFileError "FILE:3: <what is wrong>; <what is allowed>"."""
    path = _write(tmp_path, GOOD.encode() + b"\n" + line + b"\n" + GOOD.encode(), name="bad.jsonl")
    with pytest.raises(PromptFileError) as e:
        load_jsonl(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: ") and "bad.jsonl" in msg
    assert what in msg and "; " in msg


@pytest.mark.parametrize("data, what", [
    (b"\xfe\xff" + GOOD.encode("utf-16-be"),
     "is UTF-16 text (a big-endian byte-order mark), not JSONL or Parquet; save it as UTF-8"),
    (b"\x28\xb5\x2f\xfd" + bytes(16),
     "is zstd-compressed, not JSONL or Parquet; decompress it (unzstd) first"),
    (b"PK\x03\x04" + bytes(26),
     "is a zip archive, not JSONL or Parquet; extract the file from it first"),
])
def test_other_wrapped_prompts_files_are_named(tmp_path, data, what):
    """Big-endian UTF-16, zstd and zip prompts files, each named by its first bytes."""
    with pytest.raises(PromptFileError) as e:
        load_prompts(_write(tmp_path, data, name="p.jsonl"))
    assert str(e.value) == f"{tmp_path / 'p.jsonl'}: {what}"


def test_integer_labels_past_2_53_are_kept_exactly(tmp_path):
    """The 2**53 refusal is for floats only: JSON integers of any size are exact as written."""
    got = load_jsonl(_write(tmp_path, '{"prompt": "p", "label": 9007199254740993}\n'
                                      '{"prompt": "q", "label": -100000000000000000000}\n'))
    assert [p.label for p in got] == ["9007199254740993", "-100000000000000000000"]


@pytest.mark.parametrize("data, what", [
    ('{"prompt": "x", "label": "1"}\n'.encode("utf-16"),
     "is UTF-16 text (a little-endian byte-order mark), not JSONL or Parquet; save it as UTF-8"),
    (gzip.compress(GOOD.encode()), "is gzip-compressed, not JSONL or Parquet; decompress it "
                                 "(gunzip) first"),
])
def test_a_compressed_or_utf16_file_is_named_as_such(tmp_path, data, what):
    """A gzip or UTF-16 prompts file: the error says what its first bytes show (it said "invalid
    UTF-8 at byte 0 of the line"). Control: the same records as UTF-8 JSONL load."""
    with pytest.raises(PromptFileError) as e:
        load_prompts(_write(tmp_path, data, name="p.jsonl"))
    assert str(e.value) == f"{tmp_path / 'p.jsonl'}: {what}", str(e.value)
    plain = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data.decode("utf-16").encode()
    assert len(load_prompts(_write(tmp_path, plain, name="q.jsonl"))) == 1




@pytest.mark.parametrize("content, what", [(None, "file not found"), (b"", "no prompts"),
                                           (b"\n \n\r\n", "no prompts")])
def test_load_jsonl_file_errors(tmp_path, content, what):
    """Missing file / no prompts -> PromptFileError naming the file."""
    path = tmp_path / "f.jsonl" if content is None else _write(tmp_path, content, name="f.jsonl")
    with pytest.raises(PromptFileError, match=what) as e:
        load_jsonl(path)
    assert str(e.value).startswith(f"{path}: ")
    assert isinstance(e.value, ValueError)


def test_load_jsonl_directory(tmp_path):
    """A directory is unreadable as a file -> PromptFileError, not IsADirectoryError."""
    with pytest.raises(PromptFileError, match="cannot read"):
        load_jsonl(tmp_path)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(["prompt", "label", "answer", "x"]), c,
                                                        max_size=4),
    max_leaves=8)
_near_valid = st.fixed_dictionaries(  # mostly-good records, so the fuzz also reaches the accept path
    {"prompt": st.text(max_size=12) | _json_values},
    optional={"label": st.text(max_size=6) | _json_values, "answer": st.text(max_size=6) | _json_values})
_lines = st.one_of(
    _near_valid.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=40),
    st.text(max_size=40).map(lambda s: s.encode("utf-8", errors="surrogatepass")),
    _json_values.map(lambda v: json.dumps(v).encode()),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_lines, max_size=6), sep=st.sampled_from([b"\n", b"\r\n", b"\r"]))
def test_jsonl_fuzz_parses_or_raises_prompt_file_error(tmp_path, lines, sep):
    """Any bytes either parse into valid Prompts or raise PromptFileError, never another exception."""
    path = _write(tmp_path, sep.join(lines), name="fuzz.jsonl")
    try:
        got = load_jsonl(path)
    except PromptFileError as e:
        assert str(e).startswith(str(path) + ":")
        return
    assert got and [p.index for p in got] == list(range(len(got)))
    for p in got:
        assert isinstance(p.text, str) and p.text.strip() and isinstance(p.label, str) and p.label.strip()
        p.text.encode("utf-8")  # valid Unicode (no lone surrogates), so tokenizable
        p.label.encode("utf-8")


# ---------------------------------------------------------------- arithmetic task and reward

def test_arithmetic_prompts_deterministic_and_seeded():
    """Same seed -> identical prompts; different seeds -> different prompts; index = position."""
    a, b, c = arithmetic_prompts(50, 0), arithmetic_prompts(50, 0), arithmetic_prompts(50, 1)
    assert a == b and a != c
    assert [p.index for p in a] == list(range(50))
    assert arithmetic_prompts(20, 0) == a[:20]  # a prefix does not depend on n


def test_arithmetic_labels_correct():
    """label == the evaluated expression; all three ops and some negatives occur."""
    ps = arithmetic_prompts(300, 7)
    ops = set()
    for p in ps:
        assert p.text.startswith("Compute ") and p.text.endswith("=")
        expr = p.text[len("Compute "):-1]
        assert all(ch in "0123456789+-*" for ch in expr)
        assert p.label == str(eval(expr))  # expr is digits and one operator: checked above
        ops |= {op for op in "+-*" if op in expr}
    assert ops == {"+", "-", "*"}
    assert any(p.label.startswith("-") for p in ps)


def test_arithmetic_prompts_rejects_bad_args():
    with pytest.raises(ValueError, match="seed"):
        arithmetic_prompts(3, -1)
    with pytest.raises(ValueError, match="n must be"):
        arithmetic_prompts(-1, 0)
    assert arithmetic_prompts(0, 0) == []


@pytest.mark.parametrize("response, label, expected", [
    ("82", "82", 1.0), ("  82 is it", "82", 1.0), ("82.5", "82", 1.0), ("082", "82", 1.0),
    ("-7", "-7", 1.0), ("-0", "0", 1.0), ("7", "-7", 0.0), ("825", "82", 0.0),
    ("The answer is 82", "82", 0.0), ("", "82", 0.0), ("--82", "-82", 0.0), (" 82", " 82 ", 1.0),
    ("٨٢", "82", 0.0),  # Arabic-Indic digits are not 0-9
    ("9" * 5000, "9" * 5000, 1.0), ("9" * 5000, "9" * 4999, 0.0),  # past int()'s 4300-digit limit
    ("Paris", "Paris", 1.0), ("  Paris \n", "Paris", 1.0), ("Paris.", "Paris", 0.0), ("paris", "Paris", 0.0),
    ("0.5", "0.5", 1.0), ("0.50", "0.5", 0.0),
])
def test_reward(response, label, expected):
    assert reward(response, label) == expected


# ---------------------------------------------------------------- prompt source

def test_prompt_source_file_cycles_in_file_order(tmp_path):
    """Step k takes items k*n .. k*n+n-1 mod count; index is the file position; describe hashes bytes."""
    content = "".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n" for i in range(5))
    path = _write(tmp_path, content)
    src = prompt_source(str(path), n_prompts_per_step=2, steps=10, seed=123)
    assert [[p.index for p in src.batch(k)] for k in range(4)] == [[0, 1], [2, 3], [4, 0], [1, 2]]
    assert src.batch(2)[1] == Prompt(0, "q0", "0")
    wide = prompt_source(path, n_prompts_per_step=7, steps=1, seed=0)
    assert [p.index for p in wide.batch(0)] == [0, 1, 2, 3, 4, 0, 1]
    assert src.describe() == {"source": str(path), "count": 5,
                              "sha256": hashlib.sha256(content.encode()).hexdigest()}
    with pytest.raises(ValueError, match="step"):
        src.batch(10)


def test_prompt_source_task():
    """No file -> n*steps arithmetic prompts from the seed, sliced per step."""
    src = prompt_source(None, n_prompts_per_step=3, steps=4, seed=5)
    every = arithmetic_prompts(12, 5)
    assert [p for k in range(4) for p in src.batch(k)] == every
    assert src.describe() == {"source": "task:arithmetic", "count": 12, "seed": 5}
    # what rlk run records at start without generating the prompts (the loop's read must match)
    assert task_description(3, 4, 5) == src.describe()


def test_prompt_source_errors(tmp_path):
    with pytest.raises(ValueError, match="n_prompts_per_step"):
        prompt_source(None, n_prompts_per_step=0, steps=1, seed=0)
    with pytest.raises(ValueError, match="steps"):
        prompt_source(None, n_prompts_per_step=1, steps=0, seed=0)
    with pytest.raises(PromptFileError, match="file not found"):
        prompt_source(os.fspath(tmp_path / "nope.jsonl"), n_prompts_per_step=1, steps=1, seed=0)


# ---------------------------------------------------------------- issue 13: keys, Parquet

def _parquet(path: Path, columns: dict) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table(columns), path)
    return path


def test_jsonl_with_input_and_label_keys(tmp_path):
    """--input-key question --label-key solution: those keys are read; "answer" is no fallback
    for a non-default label key; messages name the keys."""
    path = _write(tmp_path, '{"question": "q1", "solution": 5, "prompt": "no"}\n'
                            '{"question": "q2", "solution": "x"}\n', name="k.jsonl")
    got = load_jsonl(path, input_key="question", label_key="solution")
    assert got == [Prompt(0, "q1", "5"), Prompt(1, "q2", "x")]
    with pytest.raises(PromptFileError, match=r'k.jsonl:1: missing "solution" \(its keys: '
                                              r'"question", "answer"\); each non-blank '
                                              r'line must be one JSON object like \{"question"'):
        load_jsonl(_write(tmp_path, '{"question": "q", "answer": "a"}\n', name="k.jsonl"),
                   input_key="question", label_key="solution")



@pytest.mark.parametrize("record, missing, keys", [
    ({"prompt": "q", **{f"k{i}": 0 for i in range(1, 10)}}, '"label" (or "answer")',
     '"prompt", "k1", "k2", "k3", "k4", "k5", "k6", "k7", and 2 more'),
    ({"prompt": "q", **{f"k{i}": 0 for i in range(1, 9)}}, '"label" (or "answer")',
     '"prompt", "k1", "k2", "k3", "k4", "k5", "k6", "k7", and 1 more'),
    ({"prompt": "q", **{f"k{i}": 0 for i in range(1, 8)}}, '"label" (or "answer")',
     '"prompt", "k1", "k2", "k3", "k4", "k5", "k6", "k7"'),
    ({"x" * 50: 1, "label": "1"}, '"prompt"', f'"{"x" * 39}…", "label"'),
    ({"y" * 40: 1, "label": "1"}, '"prompt"', f'"{"y" * 40}", "label"'),
    ({"z" * 41: 1, "label": "1"}, '"prompt"', f'"{"z" * 39}…", "label"'),
    ({"abcdefghij" * 5: 1, "label": "1"}, '"prompt"', f'"{"abcdefghij" * 3}abcdefghi…", "label"'),
    ({"réponse": 1, "label": "1"}, '"prompt"', '"réponse", "label"'),
    ({"é" * 40: 1, "label": "1"}, '"prompt"', f'"{"é" * 40}", "label"'),
    ({"é" * 41: 1, "label": "1"}, '"prompt"', f'"{"é" * 39}…", "label"'),
    ({"a\u202eb": 1, "c\u009bd\u2028": 2, "e\x1b[31m": 3}, '"prompt"',
     '"a\\u202eb", "c\\u009bd\\u2028", "e\\u001b[31m"'),
    ({"text": "q", "label": "1"}, '"prompt"', '"text", "label"'),
    ({}, '"prompt"', "none"),
], ids=["10 keys", "9 keys", "8 keys", "a long key", "a 40-character key", "a 41-character key",
        "a long key's head", "non-ASCII", "a 40-character non-ASCII key",
        "a 41-character non-ASCII key", "control and format characters", "no prompt key",
        "no keys"])
def test_a_missing_key_message_lists_the_records_keys(tmp_path, record, missing, keys):
    """A record without the prompt or label key: the message lists the record's keys in order,
    the first 8, each cut to 40 characters (39 and "…" where it was longer; non-ASCII as
    typed, but control and format characters — a bidi override, a C1 CSI, a line separator,
    ESC — escaped, so none reaches the terminal: found by a breaker), then ", and N more" for
    the rest (8 keys: no such tail); an empty record's keys
    are "none". Found by mutation testing: dropping "and N more",
    miscounting it, listing 9 keys, not cutting a key, an empty list for {} and a missing
    prompt key without its list all passed every test; and (a second round, once keys were cut
    to 39 and "…") cutting only keys over 41 or 45 characters, keeping a cut key's tail instead
    of its head, and counting a key's length in UTF-8 bytes (a 40-character "é" key cut) too:
    the 41-character, distinct-character and 40/41-character non-ASCII keys catch them."""
    path = _write(tmp_path, json.dumps(record) + "\n")
    with pytest.raises(PromptFileError) as e:
        load_jsonl(path)
    assert str(e.value).split("; ")[0] == f"{path}:1: missing {missing} (its keys: {keys})"

def test_parquet_prompts_equal_jsonl_prompts(tmp_path):
    """The same records as Parquet and as JSONL give the same Prompts (text, label, index) and
    prompt_source hashes the Parquet file's bytes."""
    texts, labels = ["Compute 1+1=", "héllo", "x"], ["2", "3", "4"]
    pq_path = _parquet(tmp_path / "p.parquet", {"q": texts, "a": [2, 3, 4], "other": [0, 0, 0]})
    jl = _write(tmp_path, "".join(json.dumps({"q": t, "a": int(lab)}) + "\n"
                                  for t, lab in zip(texts, labels)))
    src = prompt_source(pq_path, n_prompts_per_step=3, steps=1, seed=0, input_key="q",
                        label_key="a")
    assert src.batch(0) == load_jsonl(jl, input_key="q", label_key="a")
    assert src.batch(0)[1].where == f"{pq_path}: row 1"
    assert src.describe()["sha256"] == hashlib.sha256(pq_path.read_bytes()).hexdigest()


def test_parquet_decimal_label_is_named_by_its_type(tmp_path):
    """A Parquet cell of a type JSON has no word for is named by its Python type (it read
    "got null" when json_kind said null for anything it did not know)."""
    import decimal
    pa = pytest.importorskip("pyarrow")
    path = _parquet(tmp_path / "d.parquet",
                    {"prompt": ["a"], "label": pa.array([decimal.Decimal("2.5")])})
    with pytest.raises(PromptFileError,
                       match=r'row 0: "label" must be a string or a number, got Decimal'):
        load_prompts(path)


def test_parquet_float_label_column_is_matched_as_integers(tmp_path):
    """A float label column (what pandas writes for an int column with a missing value) reads
    as the integers an answer states: 2.0 -> "2", reward 1 for the answer "2" (it was "2.0",
    reward 0 for every answer, with no warning); a non-integral 2.5 stays "2.5"."""
    path = _parquet(tmp_path / "f.parquet", {"prompt": ["a", "b"], "label": [2.0, 2.5]})
    got = prompt_source(path, n_prompts_per_step=2, steps=1, seed=0).batch(0)
    assert [p.label for p in got] == ["2", "2.5"]
    assert reward("2", got[0].label) == 1.0 and reward("2.5", got[1].label) == 1.0


@pytest.mark.parametrize("columns,keys,words", [
    ({"prompt": ["a", None], "label": ["1", "2"]}, {},
     'row 1: "prompt" must be a string, got null'),
    ({"prompt": ["a", "b"], "label": [1.5, float("inf")]}, {}, 'row 1: "label" is the number inf'),
    ({"prompt": ["a"], "label": [[1]]}, {},
     'row 0: "label" must be a string or a number, got an array'),
    ({"text": ["a"], "label": ["1"]}, {}, 'no column "prompt"; the file has columns "text", "label"'),
    ({f"c{i}": ["a"] for i in range(20)}, {}, 'no column "prompt"; the file has columns "c0", "c1", '
                                          '"c2", "c3", "c4", "c5", "c6", "c7", and 12 more;'),
    ({"prompt": ["a"], "sol": ["1"]}, {}, 'no column "label" or "answer"'),
    ({"prompt": ["a"], "answer": ["1"]}, {"label_key": "gold"}, 'no column "gold"'),
    ("empty", {}, "no rows"),
])
def test_parquet_errors_name_file_row_and_column(tmp_path, columns, keys, words):
    if columns == "empty":
        pa = pytest.importorskip("pyarrow")
        columns = {k: pa.array([], type="string") for k in ("prompt", "label")}
    path = _parquet(tmp_path / "bad.parquet", columns)
    with pytest.raises(PromptFileError) as e:
        prompt_source(path, n_prompts_per_step=1, steps=1, seed=0, **keys)
    assert str(e.value).startswith(str(path)) and words in str(e.value)


def test_parquet_without_pyarrow_names_the_install_command(tmp_path, monkeypatch):
    import sys as _sys

    path = _parquet(tmp_path / "p.parquet", {"prompt": ["a"], "label": ["1"]})
    monkeypatch.setitem(_sys.modules, "pyarrow.parquet", None)  # import now raises ImportError
    with pytest.raises(PromptFileError) as e:
        prompt_source(path, n_prompts_per_step=1, steps=1, seed=0)
    assert "pip install 'rl-kernel[parquet]'" in str(e.value) and str(path) in str(e.value)


def test_load_prompts_parses_every_line_and_row(tmp_path):
    """load_prompts (the CLI's start-up check): a bad record anywhere is caught, naming its
    line (JSONL) or row (Parquet); it used to look at record 1 and the schema only."""
    from rlkernel.data.prompts import load_prompts

    ok_then_bad = _write(tmp_path, '\ufeff\n{"q": "a", "a": "1"}\n{"q": 3, "a": "1"}\n')
    with pytest.raises(PromptFileError, match=r'p.jsonl:3: "q" must be a string, got a number'):
        load_prompts(ok_then_bad, input_key="q", label_key="a")
    with pytest.raises(PromptFileError, match=r':2: missing "prompt"'):
        load_prompts(ok_then_bad, input_key="prompt", label_key="a")
    pq_path = _parquet(tmp_path / "p.parquet", {"q": ["a", "b"], "a": ["1", None]})
    with pytest.raises(PromptFileError, match='row 1: "a" must be a string or a number'):
        load_prompts(pq_path, input_key="q", label_key="a")
    with pytest.raises(PromptFileError, match='no column "prompt"; the file has columns'):
        load_prompts(pq_path)


@pytest.mark.parametrize("name,parquet,words", [
    ("x.parquet", False, "x.parquet: named .parquet but not a Parquet file (no PAR1 header)"),
    ("x.jsonl", True, "x.jsonl: named .jsonl but is a Parquet file"),
    ("x.ndjson", True, "x.ndjson: named .ndjson but is a Parquet file"),
])
def test_a_name_claiming_the_other_format_is_refused_by_the_loader(tmp_path, name, parquet,
                                                                   words):
    """prompt_source (what the run loop reads) refuses the mix-up with the message the CLI's
    start-up check gives; content, not name, still picks the parser."""
    content = (_parquet(tmp_path / "src.parquet", {"prompt": ["a"], "label": ["1"]}).read_bytes()
               if parquet else b'{"prompt": "a", "label": "1"}\n')
    path = _write(tmp_path, content, name=name)
    with pytest.raises(PromptFileError) as e:
        prompt_source(path, n_prompts_per_step=1, steps=1, seed=0)
    assert str(e.value).startswith(str(tmp_path)) and words in str(e.value)


def test_a_parquet_column_named_twice_is_said_to_be(tmp_path):
    """Two columns named "prompt": the message names the column and its count (pyarrow's own
    error, "Multiple matches for FieldRef.Name(prompt) ...", was shown as an unreadable file;
    found by a breaker). Control: a duplicate of a column not read is no error."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    for names, ok in ((["prompt", "prompt", "label"], False), (["prompt", "x", "x", "label"], True)):
        path = tmp_path / f"d{len(names)}.parquet"
        pq.write_table(pa.Table.from_arrays([pa.array(["1+1="])] * len(names), names=names), path)
        if ok:
            assert prompt_source(path, n_prompts_per_step=1, steps=1, seed=0).batch(0)
            continue
        with pytest.raises(PromptFileError) as e:
            prompt_source(path, n_prompts_per_step=1, steps=1, seed=0)
        assert str(e.value) == (f'{path}: column "prompt" appears 2 times; the columns read '
                                "must each have one name of their own"), str(e.value)


def test_run_on_a_parquet_file_with_keys(tmp_path, capsys):
    """rlk run --prompts x.parquet --input-key question --label-key gold: a complete run; a
    missing column is exit 2 naming it, before any work."""
    from rlkernel.cli import main

    path = _parquet(tmp_path / "x.parquet", {"question": ["Compute 1+2=", "Compute 2*3="],
                                              "gold": ["3", "6"]})
    run = tmp_path / "run"
    args = ["run", "--prompts", str(path), "--steps", "1", "--n-prompts", "2",
            "--n-samples-per-prompt", "2", "--max-response-len", "4", "--allow-dirty"]
    assert main([*args, "--input-key", "question", "--label-key", "gold", "--run-dir",
                 str(run)]) == 0
    assert json.loads((run / "evidence.json").read_text())["complete"] is True
    capsys.readouterr()
    assert main([*args, "--input-key", "q", "--label-key", "gold", "--run-dir",
                 str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f'rlk run: error: --prompts {path}: no column "q"')
    assert '"question"' in err[0]
    assert not (tmp_path / "r2").exists()


def test_keys_without_a_prompts_file_are_refused():
    from rlkernel.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match="--input-key 'q': only applies to a --prompts file"):
        RunConfig(input_key="q")
    with pytest.raises(ConfigError, match="--label-key 'prompt': must differ from --input-key"):
        RunConfig(prompts="p.jsonl", label_key="prompt")


@pytest.mark.parametrize("key", ["a\x1b[31mb", "a\u202eb", "a\u009bb", "a\nb", "a\u2028b"])
def test_keys_with_control_or_format_characters_are_refused(key):
    """--input-key / --label-key with an escape sequence, a bidi override, a C1 control, a
    newline or a line separator: refused up front, the value shown escaped (messages quote the
    key as typed, so it reached the terminal raw; found by a breaker). Control: a non-ASCII
    key with none of them is accepted."""
    from rlkernel.config import ConfigError, RunConfig

    for field, flag in (("input_key", "--input-key"), ("label_key", "--label-key")):
        with pytest.raises(ConfigError, match=f"^{flag} .*: must be a key name without control "
                                              "or format characters$"):
            RunConfig(prompts="p.jsonl", **{field: key})
    assert RunConfig(prompts="p.jsonl", input_key="énoncé").input_key == "énoncé"


# ---------------------------------------------------------------- issue 13: stand-in tokenizer

def test_standin_byte_layout_equals_the_byte_tokenizer(tmp_path):
    """The stand-in for vocab 264 / EOS 256: encode == ByteTokenizer.encode (UTF-8 bytes), and
    decode == ByteTokenizer.decode (stops at EOS, reserved ids decode to nothing)."""
    from rlkernel.data.tokenizer import byte_symbols, standin_tokenizer_files

    assert set(byte_symbols()) == set(pre_tokenizers.ByteLevel.alphabet())
    for name, data in standin_tokenizer_files(264, 256).items():
        (tmp_path / name).write_bytes(data)
    hf, b = load_tokenizer(tmp_path, vocab_size=264, eos_token_id=256), ByteTokenizer()
    assert isinstance(hf, HFTokenizer) and (hf.vocab_size, hf.eos_id, hf.pad_id) == (264, 256, 257)
    for text in ["Compute 37+45=", "héllo wörld", "日本語 🙂", "a\nb\x00c \t  x", "<|pad"]:
        assert hf.encode(text) == b.encode(text)
    ids = b.encode("ok é") + [258, 263, 257, 65, 256, 66]
    assert hf.decode(ids) == b.decode(ids) == "ok éA"


def test_init_model_qwen_preset_tokenizer_serves_rlk_run(tmp_path):
    """The qwen3-0.6b stand-in (written by rlk init-model; weights not made here): load_tokenizer
    accepts it for that model (ids < 151936, EOS 151645 = <|im_end|>), bytes round-trip, and it
    carries a ChatML template."""
    from rlkernel.data.chat import load_chat_template
    from rlkernel.data.tokenizer import standin_tokenizer_files
    from rlkernel.model.config import qwen3_0_6b

    cfg = qwen3_0_6b()
    for name, data in standin_tokenizer_files(cfg.vocab_size, cfg.eos_token_id).items():
        (tmp_path / name).write_bytes(data)
    tok = load_tokenizer(tmp_path, vocab_size=cfg.vocab_size, eos_token_id=cfg.eos_token_id)
    assert tok.vocab_size == cfg.vocab_size and tok.eos_id == 151645
    assert tok.encode("héllo") == list("héllo".encode())
    assert tok.decode(tok.encode("héllo") + [151645, 65]) == "héllo"
    rendered = load_chat_template(tmp_path).render("hi")
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(rendered)[0] == 151644


def test_init_model_writes_a_tokenizer(tmp_path):
    """rlk init-model --preset tiny: tokenizer.json + tokenizer_config.json beside the weights."""
    from rlkernel.model.checkpoint import init_model

    out = init_model("tiny", 0, tmp_path / "m")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors",
                                               "tokenizer.json", "tokenizer_config.json"}
