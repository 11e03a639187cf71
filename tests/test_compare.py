"""Tests of `rlk compare`: identical evidence -> exit 0 "IDENTICAL"; any bit of difference -> exit 1
naming the field (and tensor); timings and manifest config never decide the verdict.

Run directories are written with EvidenceWriter directly (no model, no loop).
Run: `.venv/bin/python -m pytest -q tests/test_compare.py`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import shutil
import sys

import pytest
from kernel_helpers import fifo_in_place_of

from rlkernel import cli, jsontext
from rlkernel.config import SAME_EVIDENCE_SETTINGS, RunConfig
from rlkernel.runner.compare import CompareError, compare_runs, format_report, same_value
from rlkernel.runner.evidence import EvidenceWriter

N_TENSORS = 399


def _hashes(step: int) -> dict[str, str]:
    return {f"model.layers.{i}.w": f"{(step * 1000 + i):064x}" for i in range(N_TENSORS)}


def _step(i: int) -> dict:
    g = 1.0 / 3.0 + i
    return {"step": i, "grad_norm": g, "grad_norm_hex": g.hex(), "grad_nonfinite": [],
            "update_skipped": False, "version": f"v{i + 1}", "tensor_hashes": _hashes(i + 1),
            "version_changed": True, "tokens_hash": "ab" * 32, "n_samples": 16,
            "n_response_tokens": 100, "logprob_mismatches": 0, "logprob_tokens": 100,
            "rewards": [1.0, 0.0, 0.5, -0.0], "reward_mean": 0.375, "loss": -0.25, "pg_loss": -0.25,
            "kl": 0.0, "entropy": 5.5, "weight_audit": {"ok": True, "problems": []},
            "timings": {"rollout_s": 0.1, "train_s": 0.2, "export_audit_s": 0.05, "step_s": 0.4}}


def _manifest(tp: int = 1, steps: int = 2) -> dict:
    return {"config": {"tp": tp, "steps": steps}, "canonical_spec": {"virtual_tp": 8},
            "versions": {"torch": "2.13.0"}, "git": {"commit": "c" * 40, "dirty": False},
            "created_utc": "2026-01-01T00:00:00Z"}


def write_run(d, steps, *, tp=1, init=None, complete=True):
    d.mkdir()
    w = EvidenceWriter(d, _manifest(tp, len(steps)))
    w.record_init(init or {"version": "v0", "tensor_hashes": _hashes(0)})
    for s in steps:
        w.record_step(s)
    if complete:
        w.finish({"steps": len(steps)})
    return d


def rlk_compare(capsys, a, b, *flags):
    code = cli.main(["compare", str(a), str(b), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_identical_runs_exit_0(tmp_path, capsys):
    """Same evidence, different topology config and timings -> exit 0, last line IDENTICAL."""
    a = write_run(tmp_path / "a", [_step(0), _step(1)], tp=2)
    b_steps = [_step(0), _step(1)]
    b_steps[1]["timings"]["step_s"] = 99.0
    b = write_run(tmp_path / "b", b_steps, tp=4)
    code, out, _ = rlk_compare(capsys, a, b)
    assert code == 0
    lines = out.splitlines()
    assert lines[-1] == "IDENTICAL"
    assert any("config: tp 2 vs 4" in ln for ln in lines)  # information only
    assert any("tensor_hashes" in ln and f"identical ({N_TENSORS} tensors)" in ln for ln in lines)
    assert not any("timings" in ln for ln in lines)
    assert any(ln.startswith("step 1") and "grad_norm " in ln and ln.endswith("identical")
               for ln in lines)


def test_a_run_compared_with_itself_is_refused(tmp_path, capsys):
    """rlk compare A A (or A and A/evidence.json, or A by another path), with or without
    --quiet: exit 2 and one line on stderr saying A and B are one run, nothing on stdout, so a
    script with a typo does not pass on a run's identity with itself (its IDENTICAL, exit 0,
    hid the info line under --quiet). The API still compares and says so in a caveat; two
    separate runs get neither. `rlk compare --help` lists the exit codes."""
    a = write_run(tmp_path / "a", [_step(0)])
    for other in (a, a / "evidence.json", tmp_path / "." / "a"):
        for quiet in ([], ["--quiet"]):
            code = cli.main(["compare", *quiet, str(a), str(other)])
            out, err = capsys.readouterr()
            assert code == 2 and out == "", out
            (line,) = err.splitlines()
            assert line.startswith(f"rlk compare: error: RUN_A and RUN_B are the same run "
                                   f"({a.resolve()})"), line
        report = compare_runs(a, other)
        assert report.identical and report.same_run == a.resolve()
        assert report.caveats[0].startswith("A and B are the same run")
    b = write_run(tmp_path / "b", [_step(0)])
    assert compare_runs(a, b).same_run is None
    code, out, err = rlk_compare(capsys, a, b)
    assert code == 0 and "same run" not in out + err
    assert cli.main(["compare", "--help"]) == 0
    usage = " ".join(capsys.readouterr().out.split())
    assert ("exit status: 0 identical, 1 different (an incomplete run included), 2 a usage "
            "error: a run that cannot be read, or RUN_A and RUN_B the same run") in usage, usage


def test_a_copied_run_is_said_to_be_a_copy(tmp_path, capsys):
    """B a copy of A (cp -r): IDENTICAL (exit 0, the evidence is the same) with an info line
    that one is a copy of the other — their wall-clock timings are the same too, which two runs
    never share — kept under --quiet (only it and the verdict). Control: the same evidence with another step time (a second run) gets no such
    line; nor does evidence without timings."""
    a = write_run(tmp_path / "a", [_step(0), _step(1)])
    shutil.copytree(a, tmp_path / "copy")
    code, out, _ = rlk_compare(capsys, a, tmp_path / "copy")
    assert code == 0 and out.splitlines()[-1] == "IDENTICAL"
    assert "one is a copy of the other, not a second run" in out, out
    code, out, _ = rlk_compare(capsys, a, tmp_path / "copy", "--quiet")
    assert code == 0 and out.splitlines() == [
        "info  A and B hold the same evidence.json down to its wall-clock timings: one is a "
        "copy of the other, not a second run", "IDENTICAL"], out
    second = [_step(0), _step(1)]
    second[0]["timings"]["step_s"] = 0.41
    b = write_run(tmp_path / "b", second)
    code, out, _ = rlk_compare(capsys, a, b)
    assert code == 0 and "copy" not in out, out
    untimed = [{k: v for k, v in _step(0).items() if k != "timings"}]
    c, d = write_run(tmp_path / "c", untimed), write_run(tmp_path / "d", untimed)
    assert not any("copy" in line for line in compare_runs(c, d).caveats)


def test_a_copy_is_said_once_even_with_an_edited_manifest(tmp_path, capsys):
    """The copy caveat is printed once, as the first info line, by `rlk compare` of a cp -r copy
    (and once under --quiet); the same run compared with itself (the API) gets only its own
    caveat, not the copy's too; the same evidence and timings with an edited manifest
    (created_utc, or relabelled tp 4) is still a copy, with or without --quiet: the timings
    are what two runs never share, and a relabelled copy must not pass for a TP4 run (found
    by a breaker; a manifest check made it read IDENTICAL alone). Found by mutation testing:
    the caveats printed twice without --quiet (once as caveats, once among the info lines),
    and a run compared with itself also called a copy, passed every test."""
    copy_line = ("info  A and B hold the same evidence.json down to its wall-clock timings: one "
                 "is a copy of the other, not a second run")
    a = write_run(tmp_path / "a", [_step(0), _step(1)])
    shutil.copytree(a, tmp_path / "copy")
    code, out, _ = rlk_compare(capsys, a, tmp_path / "copy")
    lines = out.splitlines()
    assert code == 0 and lines.count(copy_line) == 1, out
    assert [ln for ln in lines if ln.startswith("info  ")][0] == copy_line, out
    code, out, _ = rlk_compare(capsys, a, tmp_path / "copy", "--quiet")
    assert code == 0 and out.splitlines().count(copy_line) == 1, out
    report = compare_runs(a, a)
    assert len(report.caveats) == 1 and report.caveats[0].startswith("A and B are the same run")
    other = tmp_path / "other"
    shutil.copytree(a, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["created_utc"] = "2026-01-02T00:00:00Z"
    manifest["config"]["tp"] = 4
    (other / "manifest.json").write_text(json.dumps(manifest))
    assert compare_runs(a, other).caveats == [copy_line[len("info  "):]]
    for flags in ((), ("--quiet",)):
        code, out, _ = rlk_compare(capsys, a, other, *flags)
        assert code == 0 and out.splitlines().count(copy_line) == 1, out


def test_the_copy_caveat_comes_before_the_other_info_lines(tmp_path, capsys):
    """A cp -r copy whose manifest was relabelled (tp 4, another torch version) has info lines
    of its own: `rlk compare` prints the copy caveat first, then them, in that order; --quiet
    prints the caveat alone with the verdict. Found by mutation testing: the caveats printed
    after the other info lines passed every test (the other tests' copies had no other info
    line, so "first" held either way)."""
    a = write_run(tmp_path / "a", [_step(0)])
    other = tmp_path / "other"
    shutil.copytree(a, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["config"]["tp"] = 4
    manifest["versions"]["torch"] = "2.14.0"
    (other / "manifest.json").write_text(json.dumps(manifest))
    copy_line = ("info  A and B hold the same evidence.json down to its wall-clock timings: one "
                 "is a copy of the other, not a second run")
    code, out, _ = rlk_compare(capsys, a, other)
    assert code == 0 and out.splitlines()[-1] == "IDENTICAL", out
    assert [ln for ln in out.splitlines() if ln.startswith("info  ")] == [
        copy_line, "info  config: tp 1 vs 4", 'info  versions: torch "2.13.0" vs "2.14.0"'], out
    code, out, _ = rlk_compare(capsys, a, other, "--quiet")
    assert code == 0 and out.splitlines() == [copy_line, "IDENTICAL"], out


def _set_config(run, **settings):
    path = run / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["config"].update(settings)
    path.write_text(json.dumps(manifest))


def test_runs_of_other_sampling_settings_are_said_to_differ_in_configuration(tmp_path, capsys):
    """--temperature/--top-p differing: a note line before the per-field results says the runs
    are two configurations, so differing tokens are expected (the info lines alone read as a
    broken promise); the info lines and the verdict stay as they were; --quiet keeps the note
    (its first line) before the differing fields, so its DIFFERENT still says why."""
    s = _step(0)
    s["tokens_hash"] = "cd" * 32
    a = write_run(tmp_path / "a", [_step(0)], tp=2)
    b = write_run(tmp_path / "b", [s], tp=4)
    _set_config(a, temperature=1.0, top_p=1.0, seed=0)
    _set_config(b, temperature=0.7, top_p=0.9, seed=1)
    code, out, _ = rlk_compare(capsys, a, b)
    lines = out.splitlines()
    assert code == 1 and lines[-1] == "DIFFERENT: 1 field differs"
    assert "info  config: temperature 1.0 vs 0.7" in lines and "info  config: tp 2 vs 4" in lines
    (i, note), = [(i, ln) for i, ln in enumerate(lines) if ln.startswith("note  ")]
    assert note == ("note  A and B differ in configuration (sampling settings: --temperature, "
                    "--top-p; other settings: --seed): tokens and evidence may differ without "
                    "a reproducibility failure (identical evidence is promised for one "
                    "configuration across layouts)")
    assert i == max(j for j, ln in enumerate(lines) if ln.startswith("info  ")) + 1
    assert compare_runs(a, b).config_differences == ["temperature", "top_p", "seed"]
    assert cli.main(["compare", "--quiet", str(a), str(b)]) == 1
    quiet = capsys.readouterr().out.splitlines()
    assert quiet[0] == note and quiet[1].startswith("step 0") and len(quiet) == 3


def test_a_layout_difference_is_no_difference_of_configuration(tmp_path, capsys):
    """--tp (a layout setting, config.SAME_EVIDENCE_SETTINGS) differing: no note line. Those
    settings are RunConfig fields, and hold every one a resume may change but --steps."""
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    assert SAME_EVIDENCE_SETTINGS <= fields
    assert cli.RESUME_MAY_CHANGE - {"steps"} <= SAME_EVIDENCE_SETTINGS
    a = write_run(tmp_path / "a", [_step(0)], tp=2)
    b = write_run(tmp_path / "b", [_step(0)], tp=4)
    _set_config(b, micro_batch_tokens=8192)
    code, out, _ = rlk_compare(capsys, a, b)
    assert code == 0 and "note" not in out and compare_runs(a, b).config_differences == []


def test_an_input_path_typed_two_ways_is_no_difference_of_configuration(tmp_path, capsys):
    """--model m in one run and --model /w/m in the other, both resolved to /w/m (the
    manifests' input_paths), the same for --prompts and a --reward file: no note, no config
    difference. Control: input_paths naming two places keep the --model difference."""
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [_step(0)])
    paths = {"model": "/w/m", "prompts": "/w/p.jsonl", "reward": "/w/rr.py:score"}
    _set_config(a, model="m", prompts="p.jsonl", reward="rr.py:score")
    _set_config(b, model="/w/m", prompts="/w/p.jsonl", reward="/w/rr.py:score")
    _set_manifest(a, input_paths=paths)
    _set_manifest(b, input_paths=paths)
    code, out, _ = rlk_compare(capsys, a, b)
    assert code == 0 and "note" not in out and compare_runs(a, b).config_differences == []
    # Their files, keyed by the typed paths ("m/config.json", "/w/m/config.json"), are one file
    # each: no info line says a run lacks one (it said "<absent>" for every file of either).
    files = {"config.json": "c" * 64, "model.safetensors": "a" * 64}
    for run, model, prompts in ((a, "m", "p.jsonl"), (b, "/w/m", "/w/p.jsonl")):
        _set_manifest(run, inputs={"files": {**{f"{model}/{n}": h for n, h in files.items()},
                                             prompts: "p" * 64}})
    code, out, _ = rlk_compare(capsys, a, b)
    assert code == 0 and "inputs:" not in out and "<absent>" not in out, out
    _set_manifest(b, inputs={"files": {"/w/m/config.json": "c" * 64,
                                       "/w/m/model.safetensors": "b" * 64,
                                       "/w/p.jsonl": "p" * 64}})
    code, out, _ = rlk_compare(capsys, a, b)
    assert "info  inputs: files./w/m/model.safetensors" in out, out   # control: other weights
    _set_manifest(b, input_paths={**paths, "model": "/elsewhere/m"})
    assert compare_runs(a, b).config_differences == ["model"]


def _set_manifest(run, **sections):
    path = run / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(copy.deepcopy(sections))
    path.write_text(json.dumps(manifest))


def _inputs(weights="a", config="c", prompts="p", tokenizer="t", template="j"):
    """A manifest's inputs, reward and tokenizer_files for --model m --prompts p.jsonl
    --reward rr.py:score (each content as one repeated hex digit)."""
    return {"config": {"tp": 1, "steps": 1, "model": "m", "prompts": "p.jsonl",
                       "reward": "rr.py:score"},
            "inputs": {"files": {"m/config.json": config * 64, "m/model.safetensors": weights * 64,
                                 "m/tokenizer.json": tokenizer * 64, "p.jsonl": prompts * 64},
                       "vocab": None, "weights": {"stored_dtypes": ["bfloat16"]}},
            "tokenizer_files": {"tokenizer.json": tokenizer * 64, "chat_template.jinja": template * 64},
            "reward": {"spec": "rr.py:score", "function": "rr.py:score",
                       "source_file": "/w/rr.py", "source_sha256": "e" * 64}}


def test_inputs_whose_content_changed_are_named_in_the_note(tmp_path, capsys):
    """Same flags, other file contents (rr.py edited, model.safetensors replaced under its path,
    ...): the note says the runs read different inputs and names each, as it names differing
    settings, so a DIFFERENT is not read as a broken promise; --quiet keeps it. The info lines
    show the hashes (the reward and tokenizer_files sections too); the verdict is the
    evidence's. Same inputs: no note."""
    s = _step(0)
    s["rewards"] = [0.0, 0.0, 0.0, 0.0]
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [s])
    same = write_run(tmp_path / "same", [_step(0)])
    _set_manifest(a, **_inputs())
    _set_manifest(same, **_inputs())
    assert "note" not in rlk_compare(capsys, a, same)[1]

    changed = _inputs()
    changed["reward"]["source_sha256"] = "f" * 64
    _set_manifest(b, **changed)
    code, out, _ = rlk_compare(capsys, a, b)
    lines = out.splitlines()
    assert code == 1 and lines[-1] == "DIFFERENT: 1 field differs"
    assert f'info  reward: source_sha256 "{"e" * 64}" vs "{"f" * 64}"' in lines, out
    (note,) = [ln for ln in lines if ln.startswith("note  ")]
    assert note.startswith("note  A and B read different inputs (changed content: the --reward "
                           "source /w/rr.py): "), note
    assert compare_runs(a, b).input_differences == ["the --reward source /w/rr.py"]
    assert cli.main(["compare", "--quiet", str(a), str(b)]) == 1
    assert capsys.readouterr().out.splitlines()[0] == note

    _set_manifest(b, **_inputs(weights="b", config="d", prompts="q", template="k"))
    _set_config(b, temperature=0.5)
    code, out, _ = rlk_compare(capsys, a, b)
    (note,) = [ln for ln in out.splitlines() if ln.startswith("note  ")]
    assert note.startswith("note  A and B differ in configuration (sampling settings: "
                           "--temperature) and read different inputs (changed content: --model "
                           "weights (model.safetensors), --model config.json, --model tokenizer "
                           "(chat_template.jinja), the --prompts file p.jsonl): "), note
    assert "info  tokenizer_files: chat_template.jinja" in out


def test_inputs_one_run_does_not_record_are_not_compared(tmp_path, capsys):
    """A run whose manifest records its inputs (inputs, reward, tokenizer_files) against one of
    the same config that records none (an older rl-kernel's), in either order: compared,
    IDENTICAL (exit 0), no input difference claimed."""
    a = write_run(tmp_path / "a", [_step(0)])
    old = write_run(tmp_path / "old", [_step(0)])
    _set_manifest(a, **_inputs())
    _set_manifest(old, config=_inputs()["config"])
    for x, y in ((a, old), (old, a)):
        code, out, err = rlk_compare(capsys, x, y)
        assert (code, err) == (0, "") and "note" not in out, (out, err)
        assert compare_runs(x, y).input_differences == []


def test_a_changed_built_in_reward_is_not_called_a_reward_flag(tmp_path, capsys):
    """Two runs without --reward whose built-in reward's source differs (two rl-kernel
    versions): the note names "the built-in reward's source" with its file, not a --reward
    flag neither run was given, and says evidence is promised only for the same inputs."""
    s = _step(0)
    s["rewards"] = [0.0, 0.0, 0.0, 0.0]
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [s])
    for run, sha in ((a, "e"), (b, "f")):
        sections = _inputs()
        sections["config"]["reward"] = None
        sections["reward"] = {"spec": None, "function": "rlkernel.data.tasks:reward",
                              "source_file": "/r/tasks.py", "source_sha256": sha * 64}
        _set_manifest(run, **sections)
    code, out, _ = rlk_compare(capsys, a, b)
    (note,) = [ln for ln in out.splitlines() if ln.startswith("note  ")]
    assert code == 1 and note == (
        "note  A and B read different inputs (changed content: the built-in reward's source "
        "/r/tasks.py): tokens and evidence may differ without a reproducibility failure "
        "(identical evidence is promised for one configuration of the same inputs across "
        "layouts)"), note


def test_one_bit_of_grad_norm_differs(tmp_path, capsys):
    """grad_norm differing in its last mantissa bit -> exit 1, the field named."""
    s = _step(1)
    s["grad_norm"] = math.nextafter(s["grad_norm"], math.inf)
    a = write_run(tmp_path / "a", [_step(0), _step(1)])
    b = write_run(tmp_path / "b", [_step(0), s])
    code, out, _ = rlk_compare(capsys, a, b)
    assert code == 1
    bad = [ln for ln in out.splitlines() if "DIFFERS" in ln]
    assert len(bad) == 1 and bad[0].startswith("step 1") and "grad_norm " in bad[0]
    assert out.splitlines()[-1] == "DIFFERENT: 1 field differs"


def test_differing_tensor_hash_is_named(tmp_path, capsys):
    s = _step(0)
    s["tensor_hashes"]["model.layers.7.w"] = "f" * 64
    del s["tensor_hashes"]["model.layers.9.w"]
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [s])
    code, out, _ = rlk_compare(capsys, a, b)
    assert code == 1
    line = next(ln for ln in out.splitlines() if "tensor_hashes" in ln and "DIFFERS" in ln)
    assert f"2 of {N_TENSORS} tensors differ" in line
    assert "model.layers.7.w" in line and "model.layers.9.w (missing in B)" in line
    assert "model.layers.8.w" not in line


def test_a_tensor_only_in_b_is_named(tmp_path, capsys):
    """B's step holds a tensor hash A's does not: exit 1, named "(missing in A)"."""
    s = _step(0)
    s["tensor_hashes"]["model.extra.w"] = "d" * 64
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [s])
    code, out, _ = rlk_compare(capsys, a, b)
    assert code == 1
    line = next(ln for ln in out.splitlines() if "tensor_hashes" in ln and "DIFFERS" in ln)
    assert "model.extra.w (missing in A)" in line


@pytest.mark.parametrize("name", ["evidence.json", "manifest.json"])
def test_a_file_that_is_not_utf8_is_a_usage_error(tmp_path, capsys, name):
    """Bytes that are not UTF-8 in B's evidence or manifest: exit 2 (not 1, DIFFERENT), one
    line naming the file."""
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [_step(0)])
    (b / name).write_bytes(b"\xff\xfe{" + bytes(range(128, 256)))
    code, _, err = rlk_compare(capsys, a, b)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and name in lines[0] and "not UTF-8" in lines[0]


@pytest.mark.parametrize("name", ["evidence.json", "manifest.json"])
def test_json_nested_past_the_recursion_limit_is_a_usage_error(tmp_path, capsys, name):
    """100,000 nested lists in B's evidence or manifest: exit 2, one line naming the file (was
    a RecursionError traceback)."""
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [_step(0)])
    (b / name).write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = rlk_compare(capsys, a, b)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and name in lines[0] and "nested too deeply" in lines[0], lines


@pytest.mark.parametrize("where", ["step", "config"])
def test_json_the_parser_takes_but_nested_too_deep_to_compare_is_a_usage_error(tmp_path, capsys,
                                                                             where):
    """A step field (evidence) or a config entry (manifest) nested 400 lists deep in both runs:
    json parses it, but the comparison walks it recursively and ran out of stack (a
    RecursionError traceback, exit 1 — "different" to a script; found by a breaker). Now exit
    2, one line naming the file. Control: 30 levels compare (exit 0)."""
    for depth, code_wanted in ((400, 2), (30, 0)):
        runs = []
        for side in ("a", "b"):
            step = _step(0)
            deep = [0]
            for _ in range(depth - 1):
                deep = [deep]
            if where == "step":
                step["deep"] = deep
            run = write_run(tmp_path / f"{side}{depth}", [step])
            if where == "config":
                manifest = json.loads((run / "manifest.json").read_text())
                manifest["config"]["deep"] = deep
                (run / "manifest.json").write_text(json.dumps(manifest))
            runs.append(run)
        code, out, err = rlk_compare(capsys, *runs)
        assert code == code_wanted, (depth, out, err)
        if code_wanted == 2:
            name = "evidence.json" if where == "step" else "manifest.json"
            lines = err.strip().splitlines()
            assert len(lines) == 1 and name in lines[0] and "nested too deeply" in lines[0], lines


def test_an_integer_past_pythons_digit_limit_is_a_usage_error(tmp_path, capsys):
    """A 5,000-digit integer in B's evidence: exit 2, one line naming the file and saying the
    number is too long (was a ValueError traceback and exit 1; found by a breaker)."""
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [_step(0)])
    text = (b / "evidence.json").read_text()
    (b / "evidence.json").write_text(text.replace('"loss": ', '"loss": ' + "9" * 5000 + ", "
                                                  '"was_loss": ', 1))
    code, _, err = rlk_compare(capsys, a, b)
    assert code == 2
    lines = err.strip().splitlines()
    limit = sys.get_int_max_str_digits()
    assert len(lines) == 1 and "evidence.json" in lines[0], lines
    assert f"an integer of more than {limit} digits" in lines[0], lines


@pytest.mark.parametrize("fmt", ["something-else/99", 2, None, True, 1.0])
def test_evidence_of_another_format_is_a_usage_error(tmp_path, capsys, fmt):
    """B's evidence says another format (or none): exit 2 naming the format, not a comparison
    of fields whose meaning may differ. `true` and `1.0` are not format 1 (`True == 1` in
    Python: true passed)."""
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [_step(0)])
    ev = json.loads((b / "evidence.json").read_text())
    if fmt is None:
        del ev["format"]
    else:
        ev["format"] = fmt
    (b / "evidence.json").write_text(json.dumps(ev))
    code, _, err = rlk_compare(capsys, a, b)
    assert code == 2 and "reads format 1" in err
    assert ("no evidence 'format' number" if fmt is None else f"evidence format {fmt!r}") in err


def _against_edited(tmp_path, capsys, edit) -> tuple[int, str, str]:
    """rlk compare of a one-step run A with a copy B whose evidence `edit(ev)` changed."""
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [_step(0)])
    ev = json.loads((b / "evidence.json").read_text())
    edit(ev)
    (b / "evidence.json").write_text(json.dumps(ev))
    return rlk_compare(capsys, a, b)


def test_step_order_error_shows_the_two_records_before(tmp_path, capsys):
    code, _, err = _against_edited(tmp_path, capsys, lambda ev: ev.update(
        steps=[dict(ev["steps"][0], step=n) for n in (0, 1, 2, 2)]))
    assert code == 2 and "step record 3 has step 2 after 1, 2: step numbers" in err, err


def test_format_null_is_named_as_null_not_as_missing(tmp_path, capsys):
    code, _, err = _against_edited(tmp_path, capsys, lambda ev: ev.update(format=None))
    assert code == 2 and "evidence format None; this rlk reads format 1 only" in err, err


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_complete_that_is_not_a_boolean_is_refused(tmp_path, capsys, value):
    """'complete' of another JSON type is an edited file: exit 2 naming it (a string "yes" was
    compared as INCOMPLETE and reported DIFFERENT, while a string step number was refused)."""
    code, out, err = _against_edited(tmp_path, capsys, lambda ev: ev.update(complete=value))
    kind = {"yes": "a string", 1: "a number", None: "null"}[value]
    assert (code, out) == (2, ""), err
    assert f"'complete' is {kind}, not true or false" in err, err


def test_differing_init_hash_is_named(tmp_path, capsys):
    h = _hashes(0)
    h["model.layers.3.w"] = "e" * 64
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [_step(0)], init={"version": "v0x", "tensor_hashes": h})
    report = compare_runs(a, b)
    assert report.exit_code == 1
    bad = {(r.where, r.name) for r in report.results if not r.same}
    assert bad == {("init", "version"), ("init", "tensor_hashes")}
    assert "model.layers.3.w" in format_report(report)


def test_missing_step_differs(tmp_path, capsys):
    a = write_run(tmp_path / "a", [_step(0), _step(1), _step(2)])
    b = write_run(tmp_path / "b", [_step(0), _step(1)])
    code, out, _ = rlk_compare(capsys, a, b)
    assert code == 1
    assert any(ln.startswith("step 2") and "missing in B" in ln for ln in out.splitlines())
    assert "step count: 3 vs 2" in out
    assert out.splitlines()[-1] == "DIFFERENT: 1 field differs"


def test_every_field_but_timings_is_compared(tmp_path):
    """Changing any one non-timing field (or adding/removing one) -> exactly that field differs."""
    base = _step(0)
    a = write_run(tmp_path / "a", [base])
    for i, (name, value) in enumerate([("rewards", [1.0, 0.0, 0.5, 0.0]),  # -0.0 -> 0.0
                                       ("n_samples", 16.0),  # int -> float
                                       ("update_skipped", 0),
                                       ("weight_audit", {"ok": False, "problems": ["x"]}),
                                       ("new_field", 1)]):
        s = copy.deepcopy(base)
        s[name] = value
        b = write_run(tmp_path / f"b{i}", [s])
        report = compare_runs(a, b)
        assert [(r.where, r.name) for r in report.results if not r.same] == [("step 0", name)]


def test_nonfinite_ranks_are_where_not_what(tmp_path):
    """A skipped update's `nonfinite_ranks` lists global rank ids, which differ between two
    topologies of one run: not compared. `grad_nonfinite` (which parameters) is."""
    base = dict(_step(0), grad_nonfinite=["w"], update_skipped=True, nonfinite_ranks={"w": [0]})
    a = write_run(tmp_path / "a", [base])
    b = write_run(tmp_path / "b", [dict(base, nonfinite_ranks={"w": [0, 1, 2, 3]})])
    assert compare_runs(a, b).identical
    c = write_run(tmp_path / "c", [dict(base, grad_nonfinite=["v"])])
    assert [r.name for r in compare_runs(a, c).results if not r.same] == ["grad_nonfinite"]


def test_incomplete_run_is_compared_and_never_identical(tmp_path, capsys):
    """a run that stopped early: its steps are compared, and the verdict is DIFFERENT."""
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [_step(0)], complete=False)
    code, out, _ = rlk_compare(capsys, a, b)
    assert code == 1 and "INCOMPLETE" in out and out.rstrip().splitlines()[-1].startswith("DIFF")


def test_same_value_is_bitwise():
    assert same_value(0.1, 0.1) and not same_value(0.0, -0.0)
    assert not same_value(1, 1.0) and not same_value(True, 1)
    assert same_value({"a": [1.5, "nan"]}, {"a": [1.5, "nan"]})
    assert not same_value([1.0], [1.0, 2.0])


@pytest.mark.parametrize("breakage,expect", [
    ("missing", "evidence.json: not found"),
    ("invalid", "not valid JSON"),
    ("fifo", "evidence.json: not a regular file"),
])
def test_unreadable_run_is_a_clear_error(tmp_path, capsys, breakage, expect):
    """Missing, invalid, or a FIFO in the evidence's place (reading it would block forever):
    exit 2 at once, one error line naming the file."""
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [_step(0)], complete=(breakage != "incomplete"))
    if breakage == "missing":
        (b / "evidence.json").unlink()
    elif breakage == "invalid":
        (b / "evidence.json").write_text("{\"steps\": [")
    elif breakage == "fifo":
        fifo_in_place_of(b / "evidence.json")
    with pytest.raises(CompareError, match=expect):
        compare_runs(a, b)
    code, out, err = rlk_compare(capsys, a, b)
    assert code == 2 and out == ""
    assert err.startswith("rlk compare: error: ") and str(b) in err and expect in err


@pytest.mark.parametrize("nums,expect", [
    ([1, 0], "step record 1 has step 0 after 1: step numbers"),   # reordered
    ([0, 0], "step record 1 has step 0 after 0: step numbers"),   # repeated
    ([0, "1"], "step record 1 has step '1'"),                    # not an integer
    ([None, 1], "step record 0 has step None: step numbers"),    # missing (it read
    ([-1, 1], "step record 0 has step -1: step numbers"),        # "after [None]")
    ([0, True], "step record 1 has step True"),                  # a bool is no step number
])
def test_steps_out_of_order_or_repeated_are_a_clear_error(tmp_path, capsys, nums, expect):
    """An evidence file whose step records are reordered, repeated or unnumbered was edited or
    damaged: rlk compare refuses it naming the record (exit 2), instead of comparing records by
    position and calling the runs DIFFERENT field by field. Control: the same records in
    order (and a resumed run's list starting past 0) compare."""
    a = write_run(tmp_path / "a", [_step(0), _step(1)])
    steps = [_step(0), _step(1)]
    for rec, n in zip(steps, nums):
        if n is None:
            del rec["step"]
        else:
            rec["step"] = n
    b = write_run(tmp_path / "b", steps)
    with pytest.raises(CompareError, match=re.escape(expect)):
        compare_runs(a, b)
    code, out, err = rlk_compare(capsys, a, b)
    assert code == 2 and out == "" and "in increasing order" in err
    c = write_run(tmp_path / "c", [_step(0), _step(1)])
    assert compare_runs(a, c).identical
    d = write_run(tmp_path / "d", [_step(3), _step(5)])
    assert not compare_runs(a, d).identical          # compared, not refused


@pytest.mark.parametrize("kept", [1, 3])
def test_complete_evidence_with_another_step_count_than_its_manifest_is_refused(
        tmp_path, capsys, kept):
    """A finished 2-step run whose evidence was cut to its first step (or padded with a third)
    and left marked complete: exit 2 naming the file and both counts. Cut, it compared
    IDENTICAL to a genuine 1-step run (only the config note told them apart). Controls: the
    genuine 1-step run compares with itself; the 2-step run as written compares; an incomplete
    (killed) run's fewer records are compared, reported INCOMPLETE, not refused."""
    two = write_run(tmp_path / "two", [_step(0), _step(1)])
    one = write_run(tmp_path / "one", [_step(0)])
    edited = write_run(tmp_path / "edited", [_step(0), _step(1)])
    ev = json.loads((edited / "evidence.json").read_text())
    ev["steps"] = [_step(0)] if kept == 1 else [_step(0), _step(1), _step(2)]
    (edited / "evidence.json").write_text(json.dumps(ev))
    with pytest.raises(CompareError, match=re.escape(
            f"marked complete with {kept} step record(s), but its manifest's --steps is 2")):
        compare_runs(one, edited)
    code, out, err = rlk_compare(capsys, one, edited)
    assert code == 2 and out == "" and str(edited) in err, err
    assert compare_runs(one, one).identical and compare_runs(two, two).identical
    killed = write_run(tmp_path / "killed", [_step(0)], complete=False)
    m = json.loads((killed / "manifest.json").read_text())
    m["config"]["steps"] = 2
    (killed / "manifest.json").write_text(json.dumps(m))
    report = compare_runs(two, killed)
    assert not report.identical
    assert any("INCOMPLETE" in r.detail for r in report.results), report.results


@pytest.mark.parametrize("name", ["evidence.json", "manifest.json"])
def test_a_field_given_twice_is_a_clear_error(tmp_path, capsys, name):
    """An evidence or manifest file with a key given twice in one object (JSON allows it; json
    keeps the last value, so a forged grad_norm placed after the real one would be compared
    instead of it): exit 2 naming the file and the key. Control: the file as written compares."""
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [_step(0)])
    assert compare_runs(a, b).identical
    path = b / name
    text = path.read_text()
    key = '"grad_norm": ' if name == "evidence.json" else '"tp": '
    at = text.index(key)
    path.write_text(text[:at] + key + "0.5, " + text[at:])
    with pytest.raises(CompareError, match=re.escape(f'{path}: duplicate key "{key[1:-3]}"')):
        compare_runs(a, b)
    code, out, err = rlk_compare(capsys, a, b)
    assert code == 2 and out == "" and "duplicate key" in err


@pytest.mark.parametrize("section,value", [("canonical_spec", "virtual_tp=8"),
                                           ("inputs", [["files", 1]])])
def test_a_manifest_section_that_is_not_an_object_is_named_once(tmp_path, capsys, section,
                                                                 value):
    """canonical_spec edited into a string (or inputs into a list) in B's manifest: one caveat
    naming the section and the side, printed under --quiet too (it printed an empty-key line,
    "canonical_spec:  ...", and was hidden by --quiet); the evidence is still compared. (A
    config that is no object is refused when the evidence is complete: its step count cannot
    be checked, test_complete_evidence_whose_manifest_has_no_step_count_is_refused.) Control:
    the manifest as written gives no such line."""
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [_step(0)])
    assert not [c for c in compare_runs(a, b).caveats if "not a JSON object" in c]
    m = json.loads((b / "manifest.json").read_text())
    m[section] = value
    (b / "manifest.json").write_text(json.dumps(m))
    rep = compare_runs(a, b)
    (line,) = [i for i in rep.caveats + rep.info if i.startswith(section)]
    assert line in rep.caveats and "not a JSON object in B's manifest" in line, rep.caveats
    assert f"{section}:  " not in " ".join(rep.info) and not rep.config_differences
    assert rep.identical
    code, out, _ = rlk_compare(capsys, a, b, "--quiet")
    assert code == 0 and "not a JSON object in B's manifest" in out and "note" not in out, out


def test_unprintable_characters_from_an_edited_file_print_escaped(tmp_path, capsys):
    """A step record given a key with an escape sequence and one with a lone surrogate (a JSON
    "\\ud800" escape), and a value with a bidi override: rlk compare prints each escaped as
    \\uXXXX, exit 1 — raw, the escape reached the terminal and the surrogate made the print
    fail with a UnicodeEncodeError traceback. Control: the same keys are the differing fields."""
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [_step(0)])
    path = b / "evidence.json"
    text = path.read_text()
    at = text.index('"loss": ')
    text = text[:at] + '"\\u001b[31mRED": 1, "lo\\ud800ss": 2, ' + text[at:]
    path.write_text(text.replace('"tokens_hash": "abab', '"tokens_hash": "ab\\u202ecd', 1))
    code, out, err = rlk_compare(capsys, a, b, "--quiet")
    assert code == 1 and err == "", err
    assert "\\u001b[31mRED" in out and "lo\\ud800ss" in out and "ab\\u202ecd" in out, out
    assert not any(jsontext.unprintable(line) for line in out.splitlines())
    out.encode("utf-8")                                   # printable as it is


def test_a_file_given_as_a_run_is_named_as_a_file(tmp_path, capsys):
    """rlk compare FILE B: says the path is a file, not a run directory (it said "no such run
    directory" of a path that exists); a missing path still says no such run directory."""
    a = write_run(tmp_path / "a", [_step(0)])
    f = tmp_path / "notes.txt"
    f.write_text("x")
    code, out, err = rlk_compare(capsys, f, a)
    assert (code, out) == (2, "") and f"{f}: is a file, not a run directory" in err
    code, _, err = rlk_compare(capsys, tmp_path / "gone", a)
    assert code == 2 and "no such run directory" in err and "give the directory" not in err
    code, _, err = rlk_compare(capsys, "/dev/null", a)     # it said "is a file"
    assert code == 2 and "/dev/null: is a character device, not a run directory" in err, err


def test_a_link_that_leads_nowhere_is_named_as_a_link(tmp_path, capsys):
    """rlk compare LINK B, LINK a symbolic link loop or a link to a missing directory: exit 2,
    the link named as one that cannot be followed, with the system's reason (it said "no
    such run directory" of a path that is there)."""
    a = write_run(tmp_path / "a", [_step(0)])
    loop, dangling = tmp_path / "loop", tmp_path / "dangling"
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "gone")
    for link, why in [(loop, "Too many levels of symbolic links"),
                      (dangling, "No such file or directory")]:
        code, out, err = rlk_compare(capsys, link, a)
        assert (code, out) == (2, ""), (code, out)
        assert f"{link}: a symbolic link that cannot be followed ({why})" in err, err


def test_evidence_file_is_valid_strict_json(tmp_path):
    s = _step(0)
    s["grad_norm"] = math.inf
    a = write_run(tmp_path / "a", [s])
    ev = json.loads((a / "evidence.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert ev["steps"][0]["grad_norm"] == "inf" and ev["complete"] is True


# ---------------------------------------------------------------------------------------------
# --quiet (issue 13)


def test_quiet_prints_only_differences_and_the_verdict(tmp_path, capsys):
    """--quiet: the differing fields, then the verdict; no paths, info or identical fields."""
    s = _step(1)
    s["kl"] = 0.5
    s["tensor_hashes"]["model.layers.3.w"] = "e" * 64
    a = write_run(tmp_path / "a", [_step(0), _step(1)], tp=2)
    b = write_run(tmp_path / "b", [_step(0), s], tp=4)
    code = cli.main(["compare", "--quiet", str(a), str(b)])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert len(out) == 3, out
    # fields in record order: tensor_hashes comes before kl
    assert out[0].startswith("step 1") and "tensor_hashes" in out[0] and "model.layers.3.w" in out[0]
    assert out[1].startswith("step 1") and " kl " in out[1] and "0.5" in out[1]
    assert out[2] == "DIFFERENT: 2 fields differ"


def test_quiet_identical_prints_the_verdict_only(tmp_path, capsys):
    a = write_run(tmp_path / "a", [_step(0)], tp=2)
    second = _step(0)
    second["timings"]["step_s"] = 0.43       # a second run: its own wall-clock timings
    b = write_run(tmp_path / "b", [second], tp=4)
    assert cli.main(["compare", "--quiet", str(a), str(b)]) == 0
    assert capsys.readouterr().out == "IDENTICAL\n"


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """`rlk compare A B | head -1`: the closed pipe ends rlk quietly with 141 (128 + SIGPIPE),
    no BrokenPipeError traceback."""
    import subprocess
    import sys

    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, [_step(i) for i in range(2)])   # a few lines: they sit in stdout's buffer
    write_run(b, [_step(i) for i in range(2)])
    p = subprocess.Popen([sys.executable, "-m", "rlkernel.cli", "compare", str(a), str(b)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait() == 141 and "Traceback" not in err, err


def test_long_values_are_cut_where_they_differ():
    """A long shared prefix (a sentence with one clause added) never hides the difference, and
    non-ASCII text is shown as is (not as \\u escapes)."""
    from rlkernel.runner.compare import _pair
    head = "bf16: each linear's input activation and incoming gradient (x before x·Wᵀ), " * 2
    got = _pair(head + "fp32 elsewhere", head + "attention's q, k, v; fp32 elsewhere")
    a, b = got.split(" vs ")
    assert "fp32 elsewhere" in a and "attention's q, k, v" in b, got
    assert a.startswith("...") and "\\u" not in got
    assert _pair("x·y", "x·z") == '"x·y" vs "x·z"'


def test_steps_is_a_difference_of_configuration_only_under_a_decaying_schedule(tmp_path):
    """--steps differing under the constant LR schedule (which does not read it; a resume may
    extend such a run) is no difference of configuration: the step counts are compared on
    their own. Under cosine (its horizon sets every step's LR) it is one — the control."""
    a = write_run(tmp_path / "a", [_step(0), _step(1)], tp=2)
    b = write_run(tmp_path / "b", [_step(0), _step(1), _step(2)], tp=2)
    _set_config(a, steps=2, lr_schedule="constant")
    _set_config(b, steps=3, lr_schedule="constant")
    assert compare_runs(a, b).config_differences == []
    for run in (a, b):
        _set_config(run, lr_schedule="cosine")
    assert compare_runs(a, b).config_differences == ["steps"]
    _set_config(a, lr_schedule="constant")
    assert compare_runs(a, b).config_differences == ["steps", "lr_schedule"]


@pytest.mark.parametrize("edit, words", [
    (lambda m: m["config"].pop("steps"), "records no --steps"),
    (lambda m: m["config"].update(steps="1"), 'records --steps as "1", not an integer'),
    (lambda m: m.pop("config"), "has no config object"),
    (lambda m: m.update(config=[["tp", 1], ["steps", 1]]), "has no config object"),
    (lambda m: m["config"].update(steps=True), "records --steps as true, not an integer"),
])
def test_complete_evidence_whose_manifest_has_no_step_count_is_refused(tmp_path, edit, words):
    """A finished 2-step run cut to one step and left marked complete, its manifest's --steps
    removed or made a string (or the whole config): the count check cannot run, so compare
    refuses (it compared IDENTICAL to a genuine 1-step run). Control: an incomplete run whose
    manifest lacks --steps is compared, not refused."""
    one = write_run(tmp_path / "one", [_step(0)])
    cut = write_run(tmp_path / "cut", [_step(0)])
    m = json.loads((cut / "manifest.json").read_text())
    edit(m)
    (cut / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CompareError, match=re.escape(words)):
        compare_runs(one, cut)
    ev = json.loads((cut / "evidence.json").read_text())
    ev["complete"] = False
    (cut / "evidence.json").write_text(json.dumps(ev))
    assert not compare_runs(one, cut).identical


@pytest.mark.parametrize("old_side", ["a", "b"])
def test_a_setting_a_manifest_lacks_counts_at_its_default(tmp_path, old_side):
    """A manifest written before --lr-schedule existed (no lr_schedule key; A's or B's) against
    one with the default "constant": no configuration difference (a resume reads the absent
    field at its default too), and --steps, which that schedule does not read, is none either.
    Control: against "cosine" both are."""
    runs = {"a": write_run(tmp_path / "a", [_step(0), _step(1)]),
            "b": write_run(tmp_path / "b", [_step(0), _step(1), _step(2)])}
    _set_config(runs["a"], steps=2)
    _set_config(runs["b"], steps=3)
    old, new = runs[old_side], runs["b" if old_side == "a" else "a"]
    m = json.loads((old / "manifest.json").read_text())
    m["config"].pop("lr_schedule", None)
    (old / "manifest.json").write_text(json.dumps(m))
    _set_config(new, lr_schedule="constant")
    assert compare_runs(runs["a"], runs["b"]).config_differences == []
    _set_config(new, lr_schedule="cosine")
    assert sorted(compare_runs(runs["a"], runs["b"]).config_differences) == [
        "lr_schedule", "steps"]


def test_a_truncated_evidence_file_names_where_its_string_started(tmp_path, capsys):
    """An evidence.json cut inside a string: json's message ("Unterminated string starting at")
    ends with the place, not before it ("line 1: Unterminated string starting at" read as cut
    off); other messages keep "line L: msg"."""
    a = write_run(tmp_path / "a", [_step(0)])
    b = write_run(tmp_path / "b", [_step(0)])
    (b / "evidence.json").write_text('{"steps": [{"step": 0, "tokens_hash": "ab')
    assert cli.main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON (Unterminated string starting at line 1)" in err, err
    (b / "evidence.json").write_text('{"steps": [')
    assert cli.main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON (line 1: Expecting value)" in err, err
