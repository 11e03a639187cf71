"""Bad input, fuzzed (issue 5): configs, JSONL prompt files, model checkpoint directories and
resume directories, plus odd topologies through `rlk run`.

Every bad input must give a `ConfigError` / `PromptFileError` / `CheckpointError` /
`ResumeError` (or, through `rlk run`, exit 2 for bad usage / 1 for a failed run) whose one-line
message names what is wrong and where (flag, FILE:LINE, tensor); nothing but those exception
types may escape (no traceback for user errors), and no run directory or `.tmp-*` sibling may be
left behind. The property tests are Hypothesis-driven with `derandomize=True` (the same examples
on every machine, so CI is reproducible) and small `max_examples`; none of them starts a training
run: `rlk run` is fuzzed with `run_loop` replaced by a stub, and the loaders are called directly.
The concrete `rlk run` cases at the end run tiny single-process runs; the 8-rank layouts are
marked slow.

Run: `.venv/bin/python -m pytest -q tests/test_fuzz_inputs.py` (about 40 s on 2 cores; add
`-m "slow or not slow"` for the 8-rank layouts, about a minute more).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import pathlib
import re
import shutil
import tempfile
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from cli_helpers import with_flags

from rlkernel.cli import main
from rlkernel.config import ConfigError, RunConfig, flag_name
from rlkernel.data.prompts import PromptFileError, load_jsonl
from rlkernel.model.checkpoint import CheckpointError, init_weights, load_checkpoint
from rlkernel.data.tokenizer import standin_tokenizer_files
from rlkernel.model.config import param_shapes, tiny

FUZZ = settings(max_examples=40, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
"""Hypothesis settings of every property here: reproducible, small, no example database."""

SMALL = ["--n-prompts", "2", "--n-samples-per-prompt", "2", "--max-response-len", "8",
         "--steps", "1"]
"""Concrete runs: 4 samples of at most 8 tokens, one step."""

JSON_SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
                | st.text(max_size=8))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda c: st.lists(c, max_size=3)
                           | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6)
"""Any JSON value, NaN and +-Infinity included (Python's json writes and reads them)."""
EDGE_VALUES = st.sampled_from([0, -1, 1, 2.5, 64.0, math.inf, -math.inf, math.nan, 10**30, "64",
                               "false", "", True, False, None, [], [1], {}, {"type": "linear"}])
"""JSON values at the edges of what a config field may hold (types, signs, infinities)."""


# ---------------------------------------------------------------------------------------------
# helpers


def rlk(*argv: str) -> tuple[int, str]:
    """`rlk ARGV` in-process: (exit code, stderr). Any exception escaping main fails the test."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(list(argv))
    return rc, err.getvalue()


def error_line(stderr: str, cmd: str = "run") -> str:
    """The one `rlk CMD: error: ...` line of `stderr` (asserts there is exactly one, and no
    traceback), without its prefix."""
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith(f"rlk {cmd}: error: ")]
    assert len(lines) == 1, stderr
    return lines[0].removeprefix(f"rlk {cmd}: error: ")


def assert_nothing_left(run_dir: pathlib.Path) -> None:
    """Neither the run directory nor any `<name>.tmp-*` sibling exists."""
    assert not run_dir.exists(), f"{run_dir} was left behind"
    if run_dir.parent.exists():
        left = [p.name for p in run_dir.parent.iterdir() if p.name.startswith(run_dir.name)]
        assert not left, f"left behind next to {run_dir}: {left}"


@contextlib.contextmanager
def scratch():
    """A fresh temporary directory per Hypothesis example (tmp_path is per test, not example)."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="rlk-fuzz-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def stub_run_loop(cfg, run_dir, writer, read=None):
    """Stands in for the RL loop: writes a file into the run directory, then fails like a user
    error before the first step, so the CLI must discard the whole directory."""
    (pathlib.Path(run_dir) / "half-written").write_text("x")
    raise ValueError("stub: the RL loop would start here")


@functools.cache
def tiny_tensors() -> dict[str, torch.Tensor]:
    """Valid bf16 weights of the tiny model (do not modify: copy first)."""
    return init_weights(tiny(), 0)


@functools.cache
def tiny_safetensors() -> bytes:
    """The bytes of a valid model.safetensors for tiny()."""
    with scratch() as d:
        save_file(tiny_tensors(), str(d / "model.safetensors"))
        return (d / "model.safetensors").read_bytes()


def write_model(d: pathlib.Path, config: dict | str | bytes | None = None,
                tensors: dict[str, torch.Tensor] | None = None,
                weights: bytes | None = None) -> pathlib.Path:
    """A checkpoint directory: config.json (dict -> JSON; str/bytes verbatim; None: tiny's) and
    model.safetensors (`tensors`, or raw `weights` bytes, or tiny's valid weights)."""
    d.mkdir(parents=True, exist_ok=True)
    if config is None:
        config = tiny().to_hf_dict()
    if isinstance(config, dict):
        config = json.dumps(config)
    (d / "config.json").write_bytes(config.encode() if isinstance(config, str) else config)
    if tensors is not None:
        save_file(tensors, str(d / "model.safetensors"))
    else:
        (d / "model.safetensors").write_bytes(tiny_safetensors() if weights is None else weights)
    return d


# ---------------------------------------------------------------------------------------------
# JSONL prompt files


def _good_line(text: str, label: str) -> bytes:
    return json.dumps({"prompt": text, "label": label}).encode()


GOOD_LINES = st.builds(_good_line, st.text(min_size=1, max_size=12).filter(str.strip),
                       st.text(min_size=1, max_size=6).filter(str.strip))

BAD_LINES = st.sampled_from([
    (b'{"prompt": "a", "label": "1"', "invalid JSON"),
    (b'{"prompt": "a", "label": "1"}}', "invalid JSON"),
    (b"not json at all", "invalid JSON"),
    (b'{"prompt": NaN, "label": "1"}', "invalid JSON"),
    (b'[{"prompt": "a", "label": "1"}]', "expected a JSON object"),
    (b'"just a string"', "expected a JSON object"),
    (b"42", "expected a JSON object"),
    (b'{"label": "1"}', 'missing "prompt"'),
    (b'{"prompt": "a"}', 'missing "label"'),
    (b'{"prompt": "", "label": "1"}', '"prompt" is empty'),
    (b'{"prompt": " \\t\\n ", "label": "1"}', '"prompt" is empty'),
    (b'{"prompt": null, "label": "1"}', '"prompt" must be a string'),
    (b'{"prompt": ["a"], "label": "1"}', '"prompt" must be a string'),
    (b'{"prompt": "a", "label": ""}', '"label" is empty'),
    (b'{"prompt": "a", "answer": {"x": 1}}', '"answer" must be a string or a number'),
    (b'{"prompt": "a", "label": true}', '"label" must be a string or a number'),
    (b'{"prompt": "a", "label": 1e999}', "not finite"),
    (b'{"prompt": "\\ud800", "label": "1"}', "unpaired surrogate"),
    (b'{"prompt": "caf\xe9", "label": "1"}', "invalid UTF-8"),
    (b"\xff\xfe{}", "invalid UTF-8"),
    (b'{"prompt": "a", "label": "\xc3"}', "invalid UTF-8"),
    (b"[" * 100_000, "invalid JSON"),
])
"""(line, words the error must contain): malformed JSON, wrong types, missing keys, empty
prompts, invalid UTF-8, unpaired surrogates, non-finite labels, pathological nesting."""


@settings(FUZZ, max_examples=100)
@given(before=st.lists(GOOD_LINES | st.sampled_from([b"", b"   ", b"\r"]), max_size=6),
       bad=BAD_LINES, after=st.lists(GOOD_LINES, max_size=3),
       crlf=st.booleans())
def test_prompt_file_names_the_bad_line(before, bad, after, crlf):
    """One bad line anywhere among good and blank lines: PromptFileError "FILE:LINE: why"."""
    line, why = bad
    sep = b"\r\n" if crlf else b"\n"
    with scratch() as d:
        path = d / "prompts.jsonl"
        path.write_bytes(sep.join([*before, line, *after]) + sep)
        with pytest.raises(PromptFileError) as e:
            load_jsonl(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:{len(before) + 1}: "), msg
    assert why in msg and "\n" not in msg and len(msg) < 500, msg


@settings(FUZZ, max_examples=150)
@given(lines=st.lists(st.binary(max_size=30) | GOOD_LINES | st.builds(
    lambda v: json.dumps(v).encode(), JSON_VALUES), max_size=6))
def test_prompt_file_arbitrary_bytes(lines):
    """Any bytes: either valid prompts (non-blank text and label) or a PromptFileError naming the
    file and, when it is about one line, a line that exists."""
    data = b"\n".join(lines)
    with scratch() as d:
        path = d / "p.jsonl"
        path.write_bytes(data)
        try:
            prompts = load_jsonl(path)
        except PromptFileError as e:
            m = re.match(rf"{re.escape(str(path))}(?::(\d+))?: \S", str(e))
            assert m, str(e)
            assert m.group(1) is None or 1 <= int(m.group(1)) <= data.count(b"\n") + 1
            return
    for p in prompts:
        assert p.text.strip() and p.label.strip()
        assert p.where.startswith(f"{path}:")


def test_prompt_file_huge_lines(tmp_path):
    """A 4 MB prompt loads; a 4 MB line that is bad is reported by line without echoing it."""
    path = tmp_path / "huge.jsonl"
    path.write_bytes(_good_line("x" * 4_000_000, "1") + b"\n")
    assert len(load_jsonl(path)[0].text) == 4_000_000
    for line in (b"y" * 4_000_000, b'{"prompt": "' + b"z" * 4_000_000 + b'\xff", "label": "1"}'):
        path.write_bytes(_good_line("q", "1") + b"\n" + line + b"\n")
        with pytest.raises(PromptFileError, match=rf"^{re.escape(str(path))}:2: ") as e:
            load_jsonl(path)
        assert len(str(e.value)) < 500


@pytest.mark.parametrize("content, where", [
    (b"", ": no prompts"),
    (b"\n \n\r\n", ": no prompts"),
    (_good_line("ok", "1") + b"\n" + b'{"prompt": "a",}', ":2: invalid JSON"),
    (b"\xef\xbb\xbf" + _good_line("bom", "1") + b"\n\xc0\xaf\n", ":2: invalid UTF-8"),
])
def test_bad_prompt_file_through_rlk_run(tmp_path, content, where):
    """`rlk run --prompts BAD`: a usage error (exit 2), one line naming --prompts FILE[:LINE],
    nothing on disk (these were exit 1 from the loop, after the model had loaded)."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    run_dir = tmp_path / "runs" / "r"
    rc, err = rlk("run", "--prompts", str(path), "--allow-dirty", "--run-dir", str(run_dir))
    assert rc == 2
    assert error_line(err).startswith(f"--prompts {path}{where}"), err
    assert_nothing_left(run_dir)
    assert not (tmp_path / "runs").exists()  # the parent it created is removed too


def test_a_built_in_prompt_too_long_names_its_step_and_the_length_that_fits(tmp_path):
    """The built-in task's prompts have no file line: the error names the prompt's index and
    evidence step, and gives the longest prompt of the run as the --max-prompt-len that fits;
    given that value, the run goes past the check (exit 0)."""
    run_dir = tmp_path / "r"
    rc, err = rlk("run", *SMALL, "--max-prompt-len", "2", "--allow-dirty", "--run-dir",
                  str(run_dir))
    assert rc == 2, err
    line = error_line(err)
    assert line.startswith("prompt 0 (evidence step 0) has "), line
    longest = int(line.rsplit("give --max-prompt-len ", 1)[1].split()[0])
    assert longest > 2 and line.endswith(f"has {longest}: give --max-prompt-len {longest} or "
                                         "more"), line
    assert_nothing_left(run_dir)
    rc, err = rlk("run", *SMALL, "--max-prompt-len", str(longest), "--allow-dirty",
                  "--run-dir", str(run_dir))
    assert rc == 0, err


def test_prompt_longer_than_max_prompt_len_names_file_and_line(tmp_path):
    """The token-length limit is checked before any step and points at the prompt's line: a
    usage error (exit 2) prefixed --prompts as the file's other content errors are, with one
    process and with two ranks (the rank's error carries its type)."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join([_good_line("short", "1"), b"", _good_line("x" * 40, "2")]))
    for layout in ((), ("--tp", "2")):
        run_dir = tmp_path / f"r{len(layout)}"
        rc, err = rlk("run", *with_flags(SMALL, "--n-prompts", "3"), "--max-prompt-len", "16",
                      "--prompts", str(path), "--allow-dirty", "--run-dir", str(run_dir), *layout)
        assert rc == 2, err
        assert error_line(err).endswith(
            f"--prompts {path}:3: prompt has 40 tokens, more than --max-prompt-len 16; the "
            "longest prompt of the run's 1 step(s) has 40: give --max-prompt-len 40 or more"), err
        assert_nothing_left(run_dir)


def test_a_too_long_prompt_hint_names_the_micro_batch_tokens_the_longest_needs(tmp_path):
    """A 40-token prompt with --max-response-len 8 and --micro-batch-tokens 32 (--max-prompt-len
    16 + 8 fit it): --max-prompt-len 40 alone would be refused next (40 + 8 > 32), so the hint
    also asks for --micro-batch-tokens 48; given both, the run passes the check (exit 0).
    Control: with --micro-batch-tokens 48 already, the hint is the plain one."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(_good_line("x" * 40, "1"))
    base = (*with_flags(SMALL, "--n-prompts", "1"), "--prompts", str(path), "--allow-dirty")
    for budget, tail in (("32", ", and --micro-batch-tokens 48 or more (now 32: 40 + "
                                "--max-response-len 8 tokens must fit one microbatch)"),
                         ("48", "")):
        run_dir = tmp_path / f"r{budget}"
        rc, err = rlk("run", *base, "--max-prompt-len", "16", "--micro-batch-tokens", budget,
                      "--run-dir", str(run_dir))
        assert rc == 2, err
        assert error_line(err) == (
            f"--prompts {path}:1: prompt has 40 tokens, more than --max-prompt-len 16; the "
            f"longest prompt of the run's 1 step(s) has 40: give --max-prompt-len 40 or more"
            f"{tail}"), err
        assert_nothing_left(run_dir)
    rc, err = rlk("run", *base, "--max-prompt-len", "40", "--micro-batch-tokens", "48",
                  "--run-dir", str(tmp_path / "ok"))
    assert rc == 0, err


def test_a_prompt_too_long_for_the_model_is_said_to_be_so(tmp_path):
    """A 4,100-token prompt on the embedded tiny model (max_position_embeddings 4096) with
    --max-response-len 8: no --max-prompt-len can take it (4,108 positions), so the hint says
    so and gives the prompt length that fits (4,088), not flags the next check refuses (found
    by a mutation-testing helper). Control: a 4,088-token prompt gets the usual hint."""
    for n, tail in ((4100, ", and 4100 + --max-response-len 8 = 4108 passes the model's "
                           "max_position_embeddings 4096: with this --max-response-len a prompt "
                           "fits in 4088 tokens at most"),
                    (4088, ": give --max-prompt-len 4088 or more, and --micro-batch-tokens 4096 "
                           "or more (now 32: 4088 + --max-response-len 8 tokens must fit one "
                           "microbatch)")):
        path = tmp_path / f"p{n}.jsonl"
        path.write_bytes(_good_line("x" * n, "1"))
        run_dir = tmp_path / f"r{n}"
        rc, err = rlk("run", *with_flags(SMALL, "--n-prompts", "1"), "--prompts", str(path),
                      "--max-prompt-len", "16", "--micro-batch-tokens", "32", "--allow-dirty",
                      "--run-dir", str(run_dir))
        assert rc == 2, err
        assert error_line(err) == (
            f"--prompts {path}:1: prompt has {n} tokens, more than --max-prompt-len 16; the "
            f"longest prompt of the run's 1 step(s) has {n}{tail}"), err
        assert_nothing_left(run_dir)


def test_too_long_prompts_name_the_first_and_the_longest_of_every_step(tmp_path):
    """Three steps of one prompt each (20, 40 and 30 tokens, the longest in the middle step):
    --max-prompt-len 16 names the first too long (line 1, 20 tokens) and the run's longest, 40
    (not step 0's 20 nor the last step's 30); --max-prompt-len 39 (control) names line 2, 40
    tokens, with the same longest. Found by mutation testing: the longest taken from the first
    step or the last step only, and the first prompt's count given as the longest's, passed
    every test (the other tests' runs have one step, or the first too long is the longest)."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join([_good_line("x" * 20, "1"), _good_line("x" * 40, "2"),
                                 _good_line("x" * 30, "3")]))
    for limit, line, n in (("16", 1, 20), ("39", 2, 40)):
        run_dir = tmp_path / f"r{limit}"
        rc, err = rlk("run", *with_flags(SMALL, "--n-prompts", "1", "--steps", "3"),
                      "--max-prompt-len", limit, "--prompts", str(path), "--allow-dirty",
                      "--run-dir", str(run_dir))
        assert rc == 2, err
        assert error_line(err) == (
            f"--prompts {path}:{line}: prompt has {n} tokens, more than --max-prompt-len "
            f"{limit}; the longest prompt of the run's 3 step(s) has 40: give --max-prompt-len "
            "40 or more"), err
        assert_nothing_left(run_dir)


def test_the_micro_batch_tokens_hint_is_the_longests_not_the_first_too_longs(tmp_path):
    """Three steps of one prompt each (20, 40 and 30 tokens) with --max-prompt-len 16,
    --max-response-len 8 and --micro-batch-tokens 32: the first too long (line 1, 20 tokens)
    would fit (20 + 8 <= 32), the run's longest does not (40 + 8 > 32), so the hint asks for
    --micro-batch-tokens 48 and explains it by the longest, 40. Found by mutation testing: the
    budget computed, or explained, from the first too-long prompt instead of the longest passed
    every test (the other test's one prompt is both)."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join([_good_line("x" * 20, "1"), _good_line("x" * 40, "2"),
                                 _good_line("x" * 30, "3")]))
    run_dir = tmp_path / "r"
    rc, err = rlk("run", *with_flags(SMALL, "--n-prompts", "1", "--steps", "3"),
                  "--max-prompt-len", "16", "--micro-batch-tokens", "32", "--prompts", str(path),
                  "--allow-dirty", "--run-dir", str(run_dir))
    assert rc == 2, err
    assert error_line(err) == (
        f"--prompts {path}:1: prompt has 20 tokens, more than --max-prompt-len 16; the longest "
        "prompt of the run's 3 step(s) has 40: give --max-prompt-len 40 or more, and "
        "--micro-batch-tokens 48 or more (now 32: 40 + --max-response-len 8 tokens must fit one "
        "microbatch)"), err
    assert_nothing_left(run_dir)


# ---------------------------------------------------------------------------------------------
# configs: RunConfig and `rlk run` flags


RUN_FIELDS = [f.name for f in dataclasses.fields(RunConfig)]
ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(10**300, 10**310),
    st.floats(), st.text(max_size=6), st.lists(st.integers(), max_size=2),
    st.sampled_from([0, 1, 2, 3, 4, 8, 16, 0.5, 1e-9, "bf16", "k3", "cpu", "cuda"]))


@settings(FUZZ, max_examples=300)
@given(values=st.dictionaries(st.sampled_from(RUN_FIELDS), ODD_VALUES, max_size=3))
def test_run_config_rejects_with_the_flag_name(values):
    """RunConfig(**anything): valid, or a ConfigError that starts with the flag it is about."""
    try:
        RunConfig(**values)
    except ConfigError as e:
        assert str(e).startswith("--"), str(e)
        assert any(flag_name(k) in str(e) for k in values), (values, str(e))


FLAG_FIELDS = [f for f in ("model_seed", "steps", "seed", "n_prompts", "n_samples_per_prompt",
                           "temperature", "top_p", "max_response_len", "max_prompt_len",
                           "kl_coef", "kl_estimator", "entropy_coef", "clip_eps", "lr",
                           "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
                           "micro_batch_tokens", "dtype", "mode", "dp", "tp", "cp", "rollout_tp",
                           "rollout_cp", "device", "model", "prompts", "on_nonfinite",
                           "save_every")
               if f in RUN_FIELDS]
"""Value flags fuzzed through `rlk run` (not --run-dir / --resume, which pick where to write)."""
FLAG_TEXT = st.sampled_from(["0", "-1", "1", "2", "3", "4", "8", "16", "1e-9", "1e6", "nan",
                             "inf", "-inf", "1e309", "0.5", "", "abc", "1_0", " 7 ", "0x10",
                             "true", "k4", "fp16", "/", "."]) | st.text(max_size=6).filter(
                                 lambda s: "\x00" not in s)


@settings(FUZZ, max_examples=100)
@given(pairs=st.lists(st.tuples(st.sampled_from(FLAG_FIELDS), FLAG_TEXT), max_size=4),
       switches=st.lists(st.sampled_from(["--sp", "--recompute", "--require-updates"]),
                         max_size=2))
def test_rlk_run_flags_fuzzed(pairs, switches):
    """Random flag values: exit 2 naming a flag, or (when valid) the stubbed loop's failure,
    exit 1; never an exception, and never a run directory or temp sibling left behind."""
    with scratch() as d, mock.patch("rlkernel.runner.loop.run_loop", stub_run_loop):
        run_dir = d / "runs" / "r"
        argv = ["run", *(f"{flag_name(f)}={v}" for f, v in pairs), *switches, "--allow-dirty",
                "--run-dir", str(run_dir)]
        rc, err = rlk(*argv)
        assert "Traceback" not in err
        if rc == 2:  # argparse ("invalid int value") or our own validation
            assert "--" in err and ("rlk run: error: " in err or "usage:" in err), err
        else:
            assert rc == 1 and "stub: the RL loop" in error_line(err), (argv, err)
        assert_nothing_left(run_dir)
        assert not (d / "runs").exists()


@pytest.mark.parametrize("flags, words", [
    (["--tp", "3"], "--tp 3: must divide virtual_tp=8"),
    (["--cp", "16"], "--cp 16: must divide virtual_cp=8"),
    (["--sp"], "--sp (with --tp 1)"),
    (["--rollout-tp", "4"], "--rollout-tp 4 × --rollout-cp 1 = 4 must divide the training world"),
    (["--tp", "2", "--rollout-tp", "8"], "must divide the training world --dp 1 × --tp 2"),
    (["--rollout-cp", "4"], "--rollout-cp 4 = 4 must divide the training world"),
    (["--micro-batch-tokens", "100"], "--micro-batch-tokens 100: must be >= --max-prompt-len"),
    (["--token-budget", "100"], "--micro-batch-tokens 100: must be >= --max-prompt-len"),
    (["--dp", "6"], "--dp 6: must divide virtual_dp=8; allowed: 1, 2, 4, 8"),
    (["--dp", "2", "--tp", "2", "--rollout-tp", "8"], "must divide the training world --dp 2"),
    (["--max-prompt-len", "4000", "--max-response-len", "200", "--micro-batch-tokens", "5000"],
     "must be <= max_position_embeddings=4096"),
    (["--top-p", "0"], "--top-p 0.0: must be a number in (0, 1]"),
    (["--temperature", "inf"], "--temperature inf: must be a finite number >= 1e-06"),
    (["--lr", "nan"], "--lr nan"),
    (["--steps", "0"], "--steps 0: must be an integer >= 1"),
])
def test_refused_topologies_and_values(tmp_path, flags, words):
    """Invalid topologies and values are refused before any process or directory: exit 2."""
    run_dir = tmp_path / "r"
    rc, err = rlk("run", *flags, "--allow-dirty", "--run-dir", str(run_dir))
    assert rc == 2
    assert words in error_line(err)
    assert_nothing_left(run_dir)


@pytest.mark.parametrize("run_dir, words", [
    ("{file}/sub", "cannot be created, "),     # its parent named as the file it is
    ("{file}", "is a file, not a directory"),
])
def test_unusable_run_dir(tmp_path, run_dir, words):
    """A --run-dir that cannot be created is a usage error naming the flag (exit 2)."""
    f = tmp_path / "file"
    f.write_text("x")
    rd = run_dir.format(file=f)
    rc, err = rlk("run", "--allow-dirty", "--run-dir", rd)
    assert rc == 2
    msg = error_line(err)
    assert msg.startswith(f"--run-dir {rd!r}") and words in msg, msg
    if rd != str(f):
        assert f"{str(f)!r} is a file, not a directory" in msg, msg
    assert f.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("sub", ["", "/sub"])
def test_a_symlink_loop_as_run_dir_is_a_usage_error(tmp_path, sub):
    """--run-dir a symbolic link loop (or a path under one): one error line naming the flag,
    exit 2, nothing written (resolving the path raised RuntimeError: a traceback, exit 1)."""
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    rd = f"{loop}{sub}"
    rc, err = rlk("run", "--allow-dirty", "--run-dir", rd)
    assert rc == 2 and "Traceback" not in err
    assert error_line(err).startswith(f"--run-dir {rd!r}: "), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop"]


@pytest.mark.parametrize("cmd", ["export", "init-model"])
@pytest.mark.parametrize("out, words", [
    ("{loop}", "is a symbolic link to 'loop', which does not exist"),
    ("{loop}/sub", "cannot be created, '{loop}' is a symbolic link that leads nowhere"),
    ("{loop}/sub/deeper", "cannot be created, '{loop}' is a symbolic link that leads nowhere"),
    ("/proc/self/rlk-out", "cannot create a directory in '/proc/self'"),
    ("/proc/rlk-out", "cannot create a directory in '/proc'"),
])
def test_an_out_that_cannot_be_created_is_a_usage_error(tmp_path, cmd, out, words):
    """export / init-model --out a symbolic link loop, a path under one, or under /proc: one
    error line naming the flag, exit 2, before any work — export's RUN is not even read (they
    failed only when writing, exit 1, after the weights were made or verified)."""
    if out.startswith("/proc") and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    o = out.format(loop=loop)
    argv = (["export", str(tmp_path / "no-such-run")] if cmd == "export"
            else ["init-model", "--preset", "tiny"])
    rc, err = rlk(*argv, "--out", o)
    assert rc == 2
    assert error_line(err, cmd).startswith(f"--out {o!r}: {words.format(loop=loop)}"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop"]


@pytest.mark.parametrize("argv, flag", [
    (["run", "--allow-dirty", "--run-dir", "{long}"], "--run-dir"),
    (["run", "--allow-dirty", "--run-dir", "{long}/sub"], "--run-dir"),
    (["run", "--allow-dirty", "--run-dir", "{tmp}/r", "--prompts", "{long}"], "--prompts"),
    (["run", "--allow-dirty", "--run-dir", "{tmp}/r", "--model", "{long}"], "--model"),
    (["run", "--allow-dirty", "--resume", "{long}"], "--resume"),
    (["export", "{tmp}/no-run", "--out", "{long}"], "--out"),
    (["export", "{long}", "--out", "{tmp}/o"], "RUN"),
    (["init-model", "--preset", "tiny", "--out", "{long}"], "--out"),
    (["compare", "{long}", "{tmp}"], "RUN_A"),
    (["compare", "{tmp}", "{long}"], "RUN_B"),
    (["report", "{long}", "--out", "{tmp}/p"], "RUN"),
    (["report", "{tmp}", "--out", "{long}"], "--out"),
])
def test_a_name_longer_than_the_file_system_allows_is_a_usage_error(tmp_path, argv, flag):
    """A path with a 300-character name (ENAMETOOLONG) given to any command: one error line
    naming the flag and the path cut to its ends, exit 2, nothing written (the first
    exists()/is_dir() raised: a traceback, exit 1)."""
    long = str(tmp_path / ("n" * 300))
    argv = [a.format(long=long, tmp=tmp_path) for a in argv]
    rc, err = rlk(*argv)
    assert rc == 2
    msg = error_line(err, argv[0])
    assert msg.startswith(f"{flag} '{long[:48]}...") and msg.endswith(
        "characters): cannot be looked up (File name too long); give a shorter path"), msg
    assert len(msg) < 250 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cmd", ["export", "init-model"])
def test_an_out_name_too_long_for_its_staging_name_is_a_usage_error(tmp_path, cmd):
    """export / init-model --out with a 250-byte name: it fits the file system, but the output
    is written first under `.NAME.tmp-PID-HEX`, which does not (init-model failed after the
    work, exit 1): exit 2 before any work, naming the flag and the longest name allowed."""
    out = str(tmp_path / ("n" * 250))
    argv = ["export", str(tmp_path / "no-run")] if cmd == "export" else ["init-model",
                                                                         "--preset", "tiny"]
    rc, err = rlk(*argv, "--out", out)
    assert rc == 2
    assert error_line(err, cmd).endswith(
        "its last name has 250 bytes; the output is written first under that name and up to 32 "
        "bytes more, which must fit the 255 bytes a name may have here: give a name of at most "
        "223 bytes")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# model checkpoint directories: config.json


HF_KEYS = sorted(tiny().to_hf_dict()) + ["rope_scaling", "layer_types", "rope_parameters",
                                          "use_sliding_window"]


@settings(FUZZ, max_examples=150)
@given(changes=st.dictionaries(st.sampled_from(HF_KEYS),
                               EDGE_VALUES | JSON_VALUES | st.just("<delete>"),
                               min_size=1, max_size=3))
def test_config_json_fuzzed(changes):
    """config.json with random fields changed or deleted: it loads (and then every tensor
    matches), or a CheckpointError names the checkpoint; nothing else is raised."""
    cfg = tiny().to_hf_dict()
    for k, v in changes.items():
        if v == "<delete>":
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with scratch() as d:
        model = write_model(d / "m", cfg)
        try:
            mcfg, tensors = load_checkpoint(model)
        except CheckpointError as e:
            assert str(e).startswith(str(model)), str(e)
            assert "Traceback" not in str(e)
            return
    assert {n: tuple(t.shape) for n, t in tensors.items()} == param_shapes(mcfg)


@pytest.mark.parametrize("field, value, words", [
    ("num_attention_heads", 0, "num_attention_heads=0 must be a positive integer"),
    ("vocab_size", float("inf"), "vocab_size=inf must be an integer"),
    ("num_hidden_layers", 2.5, "num_hidden_layers=2.5 must be an integer"),
    ("hidden_size", "64", "hidden_size='64' must be an integer"),
    ("tie_word_embeddings", "false", "tie_word_embeddings='false' must be true or false"),
    ("rope_scaling", "linear", "rope_scaling must be an object or null"),
    ("layer_types", 7, "layer_types must be a list"),
    ("eos_token_id", "<eos>", "eos_token_id='<eos>' must be a token id"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps=nan must be finite"),
])
def test_config_json_type_errors(tmp_path, field, value, words):
    """Wrong JSON types are named, not coerced ("false" is not true, 2.5 layers are not 2) and
    never crash (0 heads used to raise ZeroDivisionError, Infinity OverflowError)."""
    cfg = tiny().to_hf_dict()
    cfg[field] = value
    model = write_model(tmp_path / "m", cfg)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(model)
    assert str(e.value).startswith(f"{model / 'config.json'}: ") and words in str(e.value)


@pytest.mark.parametrize("field, value, tensor", [
    ("num_hidden_layers", 3, "model.layers.2.input_layernorm.weight"),  # missing
    ("num_hidden_layers", 1, "model.layers.1.input_layernorm.weight"),  # extra
    ("tie_word_embeddings", False, "lm_head.weight"),                   # missing
    ("intermediate_size", 136, "model.layers.0.mlp.gate_proj.weight"),  # shape
    ("head_dim", 8, "model.layers.0.self_attn.q_norm.weight"),          # shape
])
def test_config_json_inconsistent_with_tensors(tmp_path, field, value, tensor):
    """A config.json that disagrees with the weights: the error names the tensor."""
    cfg = tiny().to_hf_dict()
    cfg[field] = value
    model = write_model(tmp_path / "m", cfg)
    with pytest.raises(CheckpointError, match="does not match its config.json") as e:
        load_checkpoint(model)
    assert repr(tensor) in str(e.value)


# ---------------------------------------------------------------------------------------------
# model checkpoint directories: tensors and files


BAD_DTYPES = [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool, torch.float64]
TENSOR_NAMES = list(param_shapes(tiny()))
MUTATION = st.one_of(
    st.tuples(st.just("drop"), st.sampled_from(TENSOR_NAMES), st.none()),
    st.tuples(st.just("extra"), st.sampled_from(["foo", "model.layers.9.mlp.up_proj.weight",
                                                  "model.embed_tokens.bias"]), st.none()),
    st.tuples(st.just("shape"), st.sampled_from(TENSOR_NAMES), st.integers(0, 3)),
    st.tuples(st.just("dtype"), st.sampled_from(TENSOR_NAMES), st.sampled_from(BAD_DTYPES)),
    st.tuples(st.just("nonfinite"), st.sampled_from(TENSOR_NAMES),
              st.sampled_from([float("nan"), float("inf"), float("-inf")])),
)


def _mutate(tensors: dict[str, torch.Tensor], kind: str, name: str, arg) -> None:
    t = tensors.get(name)
    if kind == "drop":
        del tensors[name]
    elif kind == "extra":
        tensors[name] = torch.zeros(3, dtype=torch.bfloat16)
    elif kind == "shape":  # one fewer row, one more row, flattened, or a scalar
        tensors[name] = [t[:-1], torch.cat([t, t[:1]]), t.reshape(-1)[None], t.reshape(-1)[0]][arg]
    elif kind == "dtype":
        tensors[name] = t.to(arg)
    else:
        t = t.clone()
        t.view(-1)[t.numel() // 2] = arg
        tensors[name] = t


@settings(FUZZ, max_examples=60)
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3, unique_by=lambda m: m[1]))
def test_checkpoint_tensors_fuzzed(mutations):
    """Missing, extra, misshapen, non-float or non-finite tensors: a CheckpointError naming the
    directory and every broken tensor (non-finite values are checked once the layout is right)."""
    tensors = {n: t.clone() for n, t in tiny_tensors().items()}
    for m in mutations:
        _mutate(tensors, *m)
    structural = [m for m in mutations if m[0] != "nonfinite"]
    with scratch() as d:
        model = write_model(d / "m", tensors={n: t.contiguous() for n, t in tensors.items()})
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(model)
    msg = str(e.value)
    assert msg.startswith(str(model)), msg
    for kind, name, _ in structural or mutations:
        assert repr(name) in msg, (kind, name, msg)


def test_nonfinite_weight_named_with_index(tmp_path):
    tensors = dict(tiny_tensors())
    t = tensors["model.layers.1.mlp.up_proj.weight"].clone()
    t[3, 5] = float("nan")
    tensors["model.layers.1.mlp.up_proj.weight"] = t
    model = write_model(tmp_path / "m", tensors=tensors)
    with pytest.raises(CheckpointError, match=re.escape(
            "'model.layers.1.mlp.up_proj.weight' (in model.safetensors, 1 value(s), first at "
            "index (3, 5))")):
        load_checkpoint(model)


def _header_len() -> int:
    return 8 + int.from_bytes(tiny_safetensors()[:8], "little")


@settings(FUZZ, max_examples=60)
@given(cut=st.integers(0, len(tiny_safetensors()) - 1),
       flips=st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 255)), max_size=4),
       in_header=st.booleans())
def test_safetensors_bytes_fuzzed(cut, flips, in_header):
    """A truncated file always fails naming model.safetensors; overwritten bytes either still
    load (a weight changed, and it is finite) or fail with a CheckpointError, never otherwise."""
    raw = tiny_safetensors()
    with scratch() as d:
        model = write_model(d / "t", weights=raw[:cut])
        with pytest.raises(CheckpointError, match=re.escape(str(model / "model.safetensors"))):
            load_checkpoint(model)
        b = bytearray(raw)
        span = _header_len() if in_header else len(b)
        for pos, byte in flips:
            b[pos % span] = byte
        model = write_model(d / "f", weights=bytes(b))
        try:
            _, tensors = load_checkpoint(model)
        except CheckpointError as e:
            assert str(e).startswith(str(model)), str(e)
            return
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values())


@pytest.mark.parametrize("setup, words", [
    (lambda d: (d / "config.json").unlink(), "config.json: missing"),
    (lambda d: (d / "config.json").write_bytes(b"\xff{"), "cannot be read as UTF-8 JSON"),
    (lambda d: (d / "config.json").write_text("[]"), "top level is a JSON list"),
    (lambda d: (d / "model.safetensors").unlink(), "no *.safetensors file"),
    (lambda d: (d / "model.safetensors.index.json").write_text("{}"), "has both"),
    (lambda d: ((d / "model.safetensors").rename(d / "a.safetensors"),
                (d / "model.safetensors.index.json").write_text(
                    json.dumps({"weight_map": {"x": "../a.safetensors"}}))),
     "allowed: a plain file name"),
    (lambda d: ((d / "model.safetensors").rename(d / "a.safetensors"),
                (d / "b.safetensors").write_bytes(tiny_safetensors())),
     "several safetensors files"),
])
def test_checkpoint_directory_layout(tmp_path, setup, words):
    model = write_model(tmp_path / "m")
    setup(model)
    with pytest.raises(CheckpointError, match=re.escape(words)) as e:
        load_checkpoint(model)
    assert str(e.value).startswith(str(model))


def _set_eos(d: pathlib.Path, eos: int) -> None:
    (d / "config.json").write_text(json.dumps({**tiny().to_hf_dict(), "eos_token_id": eos}))


@pytest.mark.parametrize("break_it, words", [
    (lambda d: (d / "config.json").write_text(json.dumps(
        {**tiny().to_hf_dict(), "num_attention_heads": 0})), "num_attention_heads=0"),
    (lambda d: (d / "model.safetensors").write_bytes(tiny_safetensors()[:1000]),
     "not a readable safetensors file"),
    (lambda d: save_file({**tiny_tensors(), "model.norm.weight": torch.full((64,), math.inf,
                                                                            dtype=torch.bfloat16)},
                         str(d / "model.safetensors")), "non-finite"),
    (lambda d: (d / "config.json").write_text(json.dumps(
        {**tiny().to_hf_dict(), "intermediate_size": 136})),
     "has shape (128, 64); expected (136, 64); tensor"),    # problems joined by "; "
    # the tokenizer: exit 1 before, and a bad eos_token_id named tokenizer.json, not config.json
    (lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", "model": {'),
     "tokenizer.json: cannot load tokenizer (EOF while parsing"),
    (lambda d: (d / "tokenizer.json").write_bytes(b"\xff\xfe garbage"),
     "tokenizer.json: cannot load tokenizer"),
    (lambda d: ((d / "tokenizer.json").write_bytes(standin_tokenizer_files(264, 256)[
        "tokenizer.json"]), _set_eos(d, 300)),
     "config.json: eos_token_id 300 is not a token id of the tokenizer "),
    (lambda d: _set_eos(d, 300),
     "config.json: the model directory has no tokenizer.json, so the byte tokenizer is used, "
     "whose EOS id is 256, but the model config says eos_token_id=300"),
])
def test_bad_model_through_rlk_run(tmp_path, break_it, words):
    """`rlk run --model BAD`: a usage error (exit 2, as a missing --model is) with the loader's
    one-line message prefixed `--model 'DIR': ` (as every --model error is) and naming the file
    the bad value is in, no run directory."""
    model = write_model(tmp_path / "m")
    break_it(model)
    run_dir = tmp_path / "r"
    rc, err = rlk("run", "--model", str(model), "--allow-dirty", "--run-dir", str(run_dir))
    assert rc == 2, err
    msg = error_line(err)
    assert msg.startswith(f"--model {str(model)!r}: ") and words in msg, msg
    assert_nothing_left(run_dir)


# ---------------------------------------------------------------------------------------------
# resume directories (no run needed: they fail before the loop)


def _resume_dir(d: pathlib.Path, config, meta=None) -> pathlib.Path:
    d.mkdir(parents=True)
    manifest = {"config": config}
    try:   # a valid config's manifest records its spec, as rlk run writes it
        manifest["canonical_spec"] = RunConfig.from_dict(config).canonical_spec()
    except Exception:   # noqa: BLE001 - the broken configs this file feeds
        pass
    (d / "manifest.json").write_text(json.dumps(manifest))
    if meta is not None:
        c = d / "checkpoints" / "step-000001"
        c.mkdir(parents=True)
        (c / "state.safetensors").write_bytes(b"")
        (c / "meta.json").write_text(json.dumps(meta))
    return d


_OK_META = {"next_step": 1, "opt_steps": 1, "version": "v",
            "state_sha256": hashlib.sha256(b"").hexdigest()}


@pytest.mark.skipif("resume" not in RUN_FIELDS, reason="no --resume in this version")
@pytest.mark.parametrize("config, meta, words", [
    ([], None, "manifest.json has 'config' as an array, not an object"),
    ("cfg", None, "manifest.json has 'config' as a string, not an object"),
    ({"steps": "2"}, None, "manifest.json holds an invalid config: --steps '2'"),
    ({"lr": 10**400}, None, "manifest.json holds an invalid config: --lr"),
    ({}, None, "no complete checkpoint"),
    ({}, [], "no complete checkpoint"),
    ({}, {**_OK_META, "next_step": None}, "no complete checkpoint"),
    ({}, {**_OK_META, "state_sha256": "0"}, "SHA-256 does not match"),
])
def test_bad_resume_directory(tmp_path, config, meta, words):
    """`rlk run --resume DIR` with a corrupt manifest or checkpoint: exit 2, one line."""
    d = _resume_dir(tmp_path / "run", config, meta)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    rc, err = rlk("run", "--resume", str(d), "--allow-dirty")
    assert rc == 2
    assert words in error_line(err)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("kind, words", [("file", "a file, not a run directory"),
                                         ("fifo", "a FIFO (named pipe), not a run directory"),
                                         ("missing", "no such run directory"),
                                         ("empty", "manifest.json is missing"),
                                         ("empty manifest", "manifest.json is empty"),
                                         ("blank manifest", "manifest.json holds only white "
                                                            "space")])
def test_resume_of_a_file_or_a_missing_path_says_which(tmp_path, kind, words):
    """`rlk run --resume PATH` where PATH is a file or does not exist: exit 2, one line saying
    so (both said "no readable manifest.json", which reads as a damaged run; found by a
    breaker). Control: an empty directory says its manifest is missing (in the words `rlk
    export` uses; it said "no readable manifest.json", export "manifest.json is missing")."""
    target = tmp_path / "target"
    if kind == "file":
        target.write_text("x")
    elif kind == "fifo":   # was "a file" too
        os.mkfifo(target)
    elif kind == "empty":
        target.mkdir()
    elif kind.endswith("manifest"):   # were "is not valid JSON (Expecting value)"
        target.mkdir()
        (target / "manifest.json").write_text("" if kind == "empty manifest" else " \n\t")
    rc, err = rlk("run", "--resume", str(target), "--allow-dirty")
    assert rc == 2 and error_line(err) == (f"--resume {str(target)!r}: {words}; "
                                           "give a run directory written by rlk run"), err


def test_resume_and_export_of_a_dangling_manifest_link_say_so(tmp_path):
    """manifest.json a symbolic link to nothing: `rlk run --resume` and `rlk export` both say
    it is a link whose target does not exist (both said "manifest.json is missing", of a file
    ls shows; breaker). Control: a run directory without the link says "is missing"."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "manifest.json").symlink_to(tmp_path / "gone.json")
    gone = str(tmp_path / "gone.json")
    link = f"manifest.json is a symbolic link to {gone!r}, which does not exist"
    rc, err = rlk("run", "--resume", str(d), "--allow-dirty")
    assert rc == 2 and link in error_line(err), err
    rc, err = rlk("export", str(d), "--out", str(tmp_path / "out"))
    assert rc == 2 and link in err, err
    (d / "manifest.json").unlink()
    rc, err = rlk("run", "--resume", str(d), "--allow-dirty")
    assert rc == 2 and "manifest.json is missing" in error_line(err), err


def test_resume_of_a_manifest_that_is_not_json_names_the_line(tmp_path):
    """`rlk run --resume DIR` whose manifest.json breaks on its third line: exit 2, one line
    naming the file and that line."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "manifest.json").write_text('{\n\n  "config": }')
    rc, err = rlk("run", "--resume", str(d), "--allow-dirty")
    assert rc == 2 and error_line(err) == (f"--resume {str(d)!r}: manifest.json is not valid "
                                           "JSON (line 3: Expecting value); give a run "
                                           "directory written by rlk run"), err


# ---------------------------------------------------------------------------------------------
# odd but valid settings through real (tiny, one-step) runs


def _run_ok(base: pathlib.Path, capsys, *flags: str) -> dict:
    """A successful tiny run in a new directory `base`/r; returns its evidence."""
    base.mkdir()
    run_dir = base / "r"
    rc = main(["run", *with_flags(SMALL, *flags), "--allow-dirty", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert rc == 0 and "Traceback" not in err, err
    assert list(base.iterdir()) == [run_dir]  # published under its final name, no temp left
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["complete"] is True
    for s in evidence["steps"]:
        assert s["logprob_mismatches"] == 0
        assert all(math.isfinite(s[k]) for k in ("loss", "entropy", "grad_norm"))
        # kl: measured (finite) only when a reference policy is kept (--kl-coef > 0)
        assert s["kl"] is None if "--kl-coef" not in flags else math.isfinite(s["kl"])
    return evidence


def test_extreme_sampling(tmp_path, capsys):
    """--n-samples-per-prompt 1 --max-response-len 1 --top-p 1e-9 --temperature 1e-6: a
    greedy, one-token, one-sample run completes with finite statistics."""
    ev = _run_ok(tmp_path / "a", capsys, "--n-samples-per-prompt", "1", "--max-response-len", "1",
                 "--top-p", "1e-9", "--temperature", "1e-6", "--kl-coef", "0.01",
                 "--entropy-coef", "0.01")
    assert ev["steps"][0]["n_samples"] == 2 and ev["steps"][0]["n_response_tokens"] <= 2


def test_one_sample_per_prompt_warns_once(tmp_path, capsys):
    """--n-samples-per-prompt 1 without KL/entropy: the zero gradient is warned about once, before
    the run, not again when step 0 finds every advantage 0."""
    run_dir = tmp_path / "r"
    rc = main(["run", *with_flags(SMALL, "--n-samples-per-prompt", "1", "--max-response-len",
                                  "1"), "--allow-dirty", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert rc == 0, err
    warnings = [ln for ln in err.splitlines() if "warning:" in ln]
    assert len(warnings) == 1 and "--n-samples-per-prompt 1 makes every GRPO advantage 0" \
        in warnings[0], err


def test_require_updates_on_a_run_that_cannot_learn_is_refused_before_any_work(tmp_path,
                                                                              capsys):
    """--require-updates with --n-samples-per-prompt 1 and no KL or entropy term: exit 2, one
    error line saying why, no run directory (it warned, ran step 0's rollout and update, then
    failed with exit 1 and a partial run kept; found by a breaker). Control: the same flags
    with an entropy or a KL term validate."""
    run_dir = tmp_path / "r"
    flags = with_flags(SMALL, "--n-samples-per-prompt", "1", "--max-response-len", "1")
    rc = main(["run", *flags, "--require-updates", "--allow-dirty", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("rlk run: error: --require-updates with --n-samples-per-prompt 1")
    assert not list(tmp_path.iterdir())
    for term in ("entropy_coef", "kl_coef"):
        RunConfig.from_dict({"n_samples_per_prompt": 1, "require_updates": True, term: 0.01})


def test_an_entropy_coef_whose_term_overflows_fp32_is_refused_before_any_work(tmp_path,
                                                                             capsys):
    """--entropy-coef 3.4e38 (a finite fp32, so the flag's own check passes): coefficient x
    ln(vocab) overflows fp32, so the loss is -inf every step; exit 2 naming the bound for the
    model, no run directory (the run finished exit 0 with loss -inf in its evidence; found by a
    breaker). Control: a coefficient at the bound passes the check."""
    from rlkernel import cli
    from rlkernel.model.config import tiny

    run_dir = tmp_path / "r"
    rc = main(["run", *with_flags(SMALL, "--entropy-coef", "3.4e38"), "--allow-dirty",
               "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    bound = 3.4028234663852886e38 / math.log(tiny().vocab_size)
    assert rc == 2 and len(lines) == 1, err
    shown = lines[0].split("must be at most ")[1].split(" ")[0]
    assert lines[0].startswith("rlk run: error: --entropy-coef 3.4e+38: must be at most "
                               f"{shown} for the embedded tiny model"), lines
    assert abs(float(shown) - bound) <= 1e-5 * bound, shown
    assert not list(tmp_path.iterdir())
    # the printed bound is itself allowed (rounded down: 2.03423e+37 printed for 2.0342267e37
    # was refused, found by a breaker), also where rounding to 6 digits would go up
    cli._check_entropy_scale(tiny(), None, float(shown))
    for tokens in (3, 5, 9, 12, 13, 14, 16):
        with pytest.raises(ConfigError) as e:
            cli._check_entropy_scale(tiny(), None, 1e38, tokens=tokens)
        cli._check_entropy_scale(tiny(), None,
                                 float(str(e.value).split("must be at most ")[1].split(" ")[0]),
                                 tokens=tokens)
    cli._check_entropy_scale(tiny(), None, bound)
    with pytest.raises(ConfigError):
        cli._check_entropy_scale(tiny(), None, math.nextafter(bound, math.inf) * 1.000001)
    # --loss-agg seq-mean-token-sum sums a sample's tokens: the bound is per response
    cli._check_entropy_scale(tiny(), None, bound / 64, tokens=64)
    with pytest.raises(ConfigError, match=r"x 64 tokens \(--loss-agg seq-mean-token-sum\)"):
        cli._check_entropy_scale(tiny(), None, bound / 32, tokens=64)


def test_huge_temperature(tmp_path, capsys):
    _run_ok(tmp_path / "a", capsys, "--temperature", "1e6", "--entropy-coef", "0.01")


def test_single_prompt_file_cycles(tmp_path, capsys):
    """A JSONL with one prompt and --n-prompts 4: the prompt repeats; the run completes."""
    path = tmp_path / "one.jsonl"
    path.write_bytes(_good_line("What is 1+1?", "2") + b"\n")
    ev = _run_ok(tmp_path / "a", capsys, "--prompts", str(path), "--n-prompts", "4")
    assert ev["steps"][0]["n_samples"] == 8


def test_divergence_stops_cleanly(tmp_path, capsys):
    """--lr 3e37 blows the fp32 weights up after the first update: the run must stop with exit 1
    and a message about non-finite values, keeping the evidence so far (complete: false)."""
    run_dir = tmp_path / "r"
    rc = main(["run", *with_flags(SMALL, "--steps", "3"), "--lr", "3e37", "--dtype", "fp32",
               "--kl-coef", "0.01", "--entropy-coef", "0.01", "--allow-dirty", "--run-dir",
               str(run_dir)])
    err = capsys.readouterr().err
    assert rc == 1
    assert re.search(r"non-finite|NaN|[Ii]nf", error_line(err)), err
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["complete"] is False and 1 <= len(evidence["steps"]) <= 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_rollout_cp_with_one_token_prompts(tmp_path, capsys):
    """--cp 2 --rollout-cp 2 with prompts of one and two tokens (fewer tokens than zig-zag
    segments): two processes, same result as on one."""
    path = tmp_path / "tiny.jsonl"
    path.write_bytes(_good_line("a", "1") + b"\n" + _good_line("bc", "2") + b"\n")
    one = _run_ok(tmp_path / "a", capsys, "--prompts", str(path), "--kl-coef", "0.01")
    two = _run_ok(tmp_path / "b", capsys, "--prompts", str(path), "--kl-coef", "0.01",
                  "--cp", "2", "--rollout-cp", "2")
    for k in ("tokens_hash", "grad_norm_hex", "version"):
        assert one["steps"][0][k] == two["steps"][0][k], k


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    ["--tp", "8"],
    ["--cp", "8", "--rollout-cp", "8"],
    ["--tp", "4", "--cp", "2", "--rollout-tp", "8"],
])
def test_eight_rank_layouts_on_the_tiny_model(tmp_path, capsys, flags):
    """8 ranks for a 2-layer model with 8 heads and one-token prompts: completes, no mismatch."""
    path = tmp_path / "tiny.jsonl"
    path.write_bytes(_good_line("a", "1") + b"\n" + _good_line("bc", "2") + b"\n")
    _run_ok(tmp_path / "run", capsys, "--prompts", str(path), "--kl-coef", "0.01", *flags)
