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
import shutil
import socket
import sys

import pytest
from cli_helpers import with_flags
from kernel_helpers import fifo_in_place_of

from rlkernel import readfile
from rlkernel.cli import main
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


def test_read_json_refuses_nesting_past_max_depth_not_at_it(tmp_path):
    """A document of exactly jsontext.MAX_DEPTH (64) nested lists around a number reads back;
    one list more is json.JSONDecodeError "nested too deeply (more than 64 levels)", the limit
    its message names. Found by mutation testing: refusing at the limit itself (`>=` for `>`),
    and counting the number inside as a level, both passed every test (the other tests nest
    30 or 400 deep)."""
    from rlkernel import jsontext

    assert jsontext.MAX_DEPTH == 64
    p = tmp_path / "f.json"
    p.write_text("[" * 64 + "0" + "]" * 64)
    value = readfile.read_json(p)
    for _ in range(64):
        (value,) = value
    assert value == 0
    p.write_text("[" * 65 + "0" + "]" * 65)
    with pytest.raises(json.JSONDecodeError) as e:
        readfile.read_json(p)
    assert e.value.msg == "nested too deeply (more than 64 levels)", e.value.msg


def test_read_json_refuses_an_integer_past_the_digit_limit_in_its_own_words(tmp_path):
    """An integer of exactly Python's digit limit for int conversion (4,300 by default) reads
    back; one digit more is json.JSONDecodeError in rl-kernel's words, without Python's advice
    to call sys.set_int_max_str_digits(), which a user of rlk cannot follow. Found by mutation
    testing: keeping that advice in the message passed every test."""
    limit = sys.get_int_max_str_digits()
    p = tmp_path / "f.json"
    p.write_text('{"n": ' + "9" * limit + "}")
    assert readfile.read_json(p) == {"n": int("9" * limit)}
    p.write_text('{"n": ' + "9" * (limit + 1) + "}")
    with pytest.raises(json.JSONDecodeError) as e:
        readfile.read_json(p)
    assert e.value.msg == f"an integer of more than {limit} digits", e.value.msg


def test_json_bytes_that_are_not_text_are_said_to_be_so():
    """jsontext.loads of bytes that no JSON encoding decodes (a safetensors header is read as
    bytes) is json.JSONDecodeError naming the decoding failure; it was reported as "a number
    too long", the message of the only other ValueError json raises."""
    from rlkernel import jsontext

    for raw, byte in [(b'"\xff"', 1), (b'{"a": "\xc3"}', 7)]:
        with pytest.raises(json.JSONDecodeError) as e:
            jsontext.loads(raw)
        assert e.value.msg.startswith("not UTF-8/16/32 text (") and f"at byte {byte})" in \
            e.value.msg, e.value.msg
    assert jsontext.loads('{"a": "\xff"}'.encode()) == {"a": "\xff"}


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


# ---------------------------------------------------------------------------------------------
# every command that reads a run directory: a FIFO in a file's place is an error, not a hang

FLAGS = ["--steps", "2", "--save-every", "1", "--n-prompts", "1", "--n-samples-per-prompt", "2",
         "--max-response-len", "8", "--allow-dirty"]
RESUME = ["run", "--resume", "{d}", "--steps", "3", "--allow-dirty"]   # 3: not already complete
FIFO = "not a regular file but a FIFO (named pipe)"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 2-step run with both checkpoints and final/ (about 2 s)."""
    d = tmp_path_factory.mktemp("fifo") / "run"
    assert main(["run", *FLAGS, "--run-dir", str(d)]) == 0
    return d


@pytest.mark.parametrize("name, drop, argv, code, words", [
    ("manifest.json", [], RESUME, 2, f"--resume '{{d}}': manifest.json is {FIFO}; give a run "),
    ("evidence.json", [], RESUME, 2, f"--resume '{{d}}': evidence.json is {FIFO}; give a run "),
    ("checkpoints/step-000002/state.safetensors", ["checkpoints/step-000001"], RESUME, 2,
     f"no complete checkpoint to resume from (skipped: step-000002: "
     f"{{d}}/checkpoints/step-000002/state.safetensors: {FIFO})"),
    ("checkpoints/step-000002/meta.json", ["checkpoints/step-000001"], RESUME, 2,
     f"(skipped: step-000002: {{d}}/checkpoints/step-000002/meta.json: {FIFO})"),
    ("metrics.jsonl", [], RESUME, 2, f"{{d}}/metrics.jsonl cannot be read ({FIFO})"),
    ("completions.jsonl", [], RESUME, 2, f"{{d}}/completions.jsonl cannot be read ({FIFO})"),
    ("evidence.json", ["metrics.jsonl"], ["report", "{d}", "--out", "{d}.plots"], 2,
     f"{{d}}/evidence.json: cannot be read ({FIFO})"),
    ("metrics.jsonl", [], ["report", "{d}", "--out", "{d}.plots"], 2,
     f"{{d}}/metrics.jsonl: cannot be read ({FIFO})"),
    ("final/model.safetensors", [], ["export", "{d}", "--out", "{d}.hf"], 1,
     f"{{d}}/final/model.safetensors: {FIFO}; expected a safetensors file"),
    ("final/config.json", [], ["export", "{d}", "--out", "{d}.hf"], 1,
     f"{{d}}/final/config.json: {FIFO}; expected a JSON file"),
    ("checkpoints/step-000001/state.safetensors", [],
     ["export", "{d}", "--step", "0", "--out", "{d}.hf"], 1,
     f"unreadable checkpoint ({{d}}/checkpoints/step-000001/state.safetensors: {FIFO})"),
    ("manifest.json", [], ["compare", "{d}", "{d}"], 2, f"{{d}}/manifest.json: {FIFO}"),
])
def test_a_fifo_in_a_run_file_is_an_error_naming_it(run, tmp_path, capsys, name, drop, argv,
                                                    code, words):
    """rlk run --resume, report, export and compare with a FIFO in place of one file of a run
    (each hung in open before): the command's own error (exit 2 usage, 1 a broken run's
    weights), one line naming the file, nothing resumed (the evidence is unchanged)."""
    d = tmp_path / "run"
    shutil.copytree(run, d)
    for p in drop:
        shutil.rmtree(d / p) if (d / p).is_dir() else (d / p).unlink()
    fifo_in_place_of(d / name)
    before = (d / "evidence.json").read_bytes() if name != "evidence.json" else None
    capsys.readouterr()
    assert main([a.format(d=d) for a in argv]) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words.format(d=d) in err, err
    if before is not None:
        assert (d / "evidence.json").read_bytes() == before


@pytest.mark.parametrize("name, words", [
    # Refused when the inputs are hashed, before the loaders (which refuse it too) run.
    *[(n, f"cannot read {{m}}/{n} ({FIFO}); inputs are hashed into the manifest")
      for n in ("config.json", "model.safetensors")],
    *[(n, f"cannot read {{m}}/{n} ({FIFO}); tokenizer files are hashed into the manifest")
      for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")],
])
def test_a_fifo_in_the_model_directory_is_a_usage_error(run, tmp_path, capsys, name, words):
    """rlk run --model DIR (the run's final/, a Hugging Face directory) with a FIFO in place of
    config.json, the weights or a tokenizer file: exit 2 naming the file (the loaders hung in
    open, config.json was called missing, tokenizer_config.json or chat_template.jinja were
    skipped as absent), no run directory left."""
    m = tmp_path / "model"
    shutil.copytree(run / "final", m)
    fifo_in_place_of(m / name)
    out = tmp_path / "r"
    capsys.readouterr()
    assert main(["run", *with_flags(FLAGS, "--steps", "1"), "--model", str(m),
                 "--run-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith(f"rlk run: error: --model '{m}': "), err
    assert words.format(m=m) in err.splitlines()[-1], err
    assert not out.exists()


@pytest.mark.parametrize("name, kind", [("chat_template.jinja", "FIFO"),
                                        ("chat_template.jinja", "directory"),
                                        ("tokenizer_config.json", "FIFO")])
def test_a_chat_template_file_that_is_no_file_is_named(run, tmp_path, capsys, name, kind):
    """--apply-chat-template with a FIFO or directory as chat_template.jinja, or a FIFO as
    tokenizer_config.json: exit 2 naming that file and what it is (is_file() skipped it, and
    the error said the model had no chat template)."""
    m = tmp_path / "model"
    shutil.copytree(run / "final", m)
    fifo_in_place_of(m / name) if kind == "FIFO" else (m / name).mkdir()
    capsys.readouterr()
    assert main(["run", *with_flags(FLAGS, "--steps", "1"), "--model", str(m),
                 "--apply-chat-template", "--run-dir", str(tmp_path / "r")]) == 2
    what = FIFO if kind == "FIFO" else "not a regular file but a directory"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rlk run: error: --apply-chat-template: {m / name}: cannot be read ({what})"]


def test_a_tokenizer_json_link_to_nowhere_is_an_error_not_the_byte_tokenizer(run, tmp_path,
                                                                            capsys):
    """tokenizer.json as a symbolic link to nowhere: exists() called it absent, so the run used
    the byte tokenizer silently. load_tokenizer raises naming it; rlk run exits 2."""
    from rlkernel.data.tokenizer import TokenizerError, load_tokenizer

    m = tmp_path / "model"
    shutil.copytree(run / "final", m)
    (m / "tokenizer.json").symlink_to("/nonexistent/x")
    why = "a symbolic link to '/nonexistent/x', which does not exist"
    with pytest.raises(TokenizerError, match=re.escape(f"{m}/tokenizer.json: cannot be read "
                                                       f"({why}); expected a Hugging Face")):
        load_tokenizer(m, vocab_size=300, eos_token_id=None)
    capsys.readouterr()
    assert main(["run", *with_flags(FLAGS, "--steps", "1"), "--model", str(m), "--run-dir",
                 str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rlk run: error: --model '{m}': cannot read {m}/tokenizer.json ({why}); tokenizer "
        "files are hashed into the manifest"]


def test_a_fifo_as_a_prompt_file_or_a_hashed_input_is_refused(tmp_path):
    """The loaders behind the CLI's is_file checks refuse a FIFO themselves (one swapped in
    after the check, or a caller of the API): the prompt file reader, an input's SHA-256."""
    from rlkernel.data.prompts import PromptFileError, load_prompts
    from rlkernel.runner.inputs import sha256_file

    p = tmp_path / "prompts.jsonl"
    fifo_in_place_of(p)
    with pytest.raises(PromptFileError, match=re.escape(f"{p}: cannot read ({FIFO})")):
        load_prompts(p)
    with pytest.raises(NotRegularFileError):
        sha256_file(p)


def test_non_directory_names_what_lies_in_a_directorys_place(tmp_path):
    """non_directory, by lstat (never an open: a FIFO's would block): None for a directory or
    nothing; a link counts as one, even to a directory."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("x")
    (tmp_path / "dirlink").symlink_to(tmp_path)
    (tmp_path / "loop").symlink_to("loop")
    want = {"fifo": "a FIFO (named pipe)", "file": "a regular file",
            "dirlink": "a symbolic link", "loop": "a symbolic link", "missing": None}
    assert {n: readfile.non_directory(tmp_path / n) for n in want} == want
    assert readfile.non_directory(tmp_path) is None
    assert readfile.non_directory("/dev/null") == "a character device"


def test_jsontext_unique_keys_refuses_a_key_given_twice_at_any_depth():
    """loads(unique_keys=True): a key given twice in one object, nested or not, is a
    JSONDecodeError naming the key (quoted, so a control character in it prints escaped);
    the same key in two different objects is fine; without the option json's last-wins stays."""
    import json

    from rlkernel import jsontext
    for text, key in (('{"a": 1, "a": 2}', '"a"'), ('{"s": [{"x": 1, "y": 2, "x": 3}]}', '"x"'),
                      ('{"\\u001b": 1, "\\u001b": 2}', '"\\u001b"')):
        with pytest.raises(json.JSONDecodeError, match=re.escape(f"duplicate key {key}")):
            jsontext.loads(text, unique_keys=True)
    assert jsontext.loads('{"a": {"k": 1}, "b": {"k": 2}}', unique_keys=True) == {
        "a": {"k": 1}, "b": {"k": 2}}
    assert jsontext.loads('{"a": 1, "a": 2}') == {"a": 2}


def test_not_a_file_names_each_kind(tmp_path):
    """--prompts' check: a regular file (or a link to one) -> None; a missing path "no such
    file"; a stat error other than a missing path by its own words (a path under a file)."""
    (tmp_path / "f").write_text("x")
    (tmp_path / "to_f").symlink_to("f")
    assert readfile.not_a_file(tmp_path / "f") is None
    assert readfile.not_a_file(tmp_path / "to_f") is None
    assert readfile.not_a_file(tmp_path / "gone.jsonl") == "no such file"
    assert readfile.not_a_file(tmp_path / "f" / "p.jsonl") == "Not a directory"
    assert readfile.not_a_file(tmp_path) == "is a directory, not a file"
