"""Tests of RunConfig validation and `rlk run`: bad values, the flag budget, the run directory's life.

The RL loop is replaced by a fake that writes steps through the EvidenceWriter, so these tests are
fast and need no model. Every test runs in its own empty working directory, so "creates nothing"
is checked as "the directory is still empty".

Run: `.venv/bin/python -m pytest -q tests/test_cli_config.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
import typing

import pytest

from rlkernel import cli
from rlkernel.config import (ATTN_KV_BLOCK, TOKEN_LEAF, TOKEN_REDUCTION, ConfigError, RunConfig,
                             field_docs, flag_name)
from rlkernel.runner.evidence import git_state, write_json_atomic
from rlkernel.spec import NUMERICS_VERSION, ROUNDING_POINTS

# The reviewed `rlk run` surface (STYLE.md §12). Adding a flag means adding it here, in review.
REVIEWED_RUN_FLAGS = {
    "-h", "--help",
    "--model", "--model-seed", "--prompts",
    "--steps", "--seed", "--n-prompts", "--n-samples-per-prompt",
    "--temperature", "--top-p", "--max-response-len", "--max-prompt-len",
    "--kl-coef", "--kl-estimator", "--entropy-coef", "--clip-eps",
    "--lr", "--weight-decay", "--adam-beta1", "--adam-beta2", "--adam-eps", "--clip-grad",
    "--on-nonfinite",
    "--token-budget", "--dtype", "--mode",
    "--tp", "--cp", "--sp", "--recompute", "--rollout-tp", "--rollout-cp",
    "--run-dir", "--allow-dirty", "--require-updates", "--device", "--save-every", "--resume",
    # issue 13: user rewards and prompt data
    "--reward", "--input-key", "--label-key", "--apply-chat-template",
}
# Issue 13 (items 3, 4): updates per rollout batch, clip range, loss aggregation, LR schedule,
# TensorBoard.
REVIEWED_RUN_FLAGS |= {
    "--ppo-epochs", "--mini-batches", "--clip-eps-low", "--clip-eps-high", "--loss-agg",
    "--lr-warmup-steps", "--lr-schedule", "--tensorboard",
}
# Issue 14: data parallelism; the microbatch size became a memory knob (--token-budget, its old
# name, stays as an alias).
REVIEWED_RUN_FLAGS = (REVIEWED_RUN_FLAGS - {"--token-budget"}) | {"--dp", "--micro-batch-tokens"}
# Issue 12: the rollout KV pool's share of free GPU memory; decode steps without CUDA graphs.
REVIEWED_RUN_FLAGS |= {"--gpu-memory-utilization", "--enforce-eager"}
# Issue 12: the rollout's KV pool and decode graphs kept across steps.
REVIEWED_RUN_FLAGS |= {"--keep-rollout-state"}
# Booleans a resume may change also take a --no- form (a resume can turn them off again).
NO_FORMS = {"--no-sp", "--no-recompute", "--no-enforce-eager", "--no-allow-dirty",
            "--no-tensorboard", "--no-keep-rollout-state"}
REVIEWED_RUN_FLAGS |= NO_FORMS
# Second spellings of reviewed flags (cli.RUN_FLAG_ALIASES): not in the usage line, still surface.
REVIEWED_RUN_ALIASES = {"--learning-rate": "--lr", "--num-generations": "--n-samples-per-prompt",
                        "--rollout-temperature": "--temperature",
                        "--token-budget": "--micro-batch-tokens"}


def _step(i: int) -> dict:
    return {"step": i, "grad_norm": 1.5 + i, "grad_norm_hex": (1.5 + i).hex(), "grad_nonfinite": [],
            "update_skipped": False, "version": f"v{i + 1}", "tensor_hashes": {"w": f"{i + 1:064x}"},
            "version_changed": True, "tokens_hash": "t", "n_samples": 16, "n_response_tokens": 100,
            "logprob_mismatches": 0, "logprob_tokens": 100, "rewards": [1.0, 0.0],
            "reward_mean": 0.5, "loss": float("nan"), "pg_loss": 0.0, "kl": 0.0, "entropy": 1.0,
            "weight_audit": {"ok": True, "problems": []},
            "timings": {"rollout_s": 0.1, "train_s": 0.1, "export_audit_s": 0.1, "step_s": 0.3}}


def _fake_loop(cfg, run_dir, writer):
    writer.record_init({"version": "v0", "tensor_hashes": {"w": "0" * 64}})
    for i in range(cfg.steps):
        writer.record_step(_step(i))


@pytest.fixture
def loop(monkeypatch):
    """Replace rlkernel.runner.loop.run_loop (the module may not exist yet); returns a setter."""
    try:
        import rlkernel.runner.loop as mod
    except Exception:  # not written yet, or mid-edit by its author
        mod = types.ModuleType("rlkernel.runner.loop")
        monkeypatch.setitem(sys.modules, "rlkernel.runner.loop", mod)
    calls = []

    def set_loop(fn):
        def wrapped(cfg, run_dir, writer, read=None):
            calls.append((cfg, run_dir))
            return fn(cfg, run_dir, writer)
        monkeypatch.setattr(mod, "run_loop", wrapped, raising=False)

    set_loop(_fake_loop)
    return types.SimpleNamespace(set=set_loop, calls=calls)


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    d = tmp_path / "cwd"
    d.mkdir()
    monkeypatch.chdir(d)
    return d


def rlk(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------------------------
# bad values: exit 2, one message naming flag + value + what is allowed, nothing on disk

BAD = [
    (["--entropy-coef", "-1"], "--entropy-coef", "-1", ">= 0"),
    (["--entropy-coef", "nan"], "--entropy-coef", "nan", "finite"),
    (["--entropy-coef", "inf"], "--entropy-coef", "inf", "finite"),
    (["--top-p", "0"], "--top-p", "0", "(0, 1]"),
    (["--top-p", "1.5"], "--top-p", "1.5", "(0, 1]"),
    (["--top-p", "nan"], "--top-p", "nan", "(0, 1]"),
    (["--tp", "0"], "--tp", "0", "allowed: 1, 2, 4, 8"),
    (["--rollout-cp", "-2"], "--rollout-cp", "-2", "allowed: 1, 2, 4, 8"),
    (["--temperature", "0"], "--temperature", "0", ">= 1e-06"),
    (["--temperature", "-1"], "--temperature", "-1", ">= 1e-06"),
    # a positive T whose logits / T overflows fp32 (1e-40 failed at step 0 with an unnamed NaN)
    (["--temperature", "1e-40"], "--temperature", "1e-40", ">= 1e-06"),
    (["--temperature", "9e-07"], "--temperature", "9e-07", ">= 1e-06"),
    (["--kl-coef", "-0.1"], "--kl-coef", "-0.1", ">= 0"),
    (["--kl-estimator", "k4"], "--kl-estimator", "k4", "k1, k2, k3"),
    (["--tp", "3"], "--tp", "3", "1, 2, 4, 8"),
    (["--cp", "5"], "--cp", "5", "1, 2, 4, 8"),
    (["--sp"], "--sp", "--tp 1", "--tp 2, 4 or 8"),
    (["--sp", "--tp", "1"], "--sp", "--tp 1", "--tp 2, 4 or 8"),
    (["--steps", "0"], "--steps", "0", ">= 1"),
    (["--model", "no/such/model-dir"], "--model", "no/such/model-dir", "directory"),
    (["--prompts", "no-such-prompts.jsonl"], "--prompts", "no-such-prompts.jsonl", "JSONL"),
]
# Issue 13: the update-loop flags.
BAD += [
    (["--mini-batches", "3"], "--mini-batches", "3", "allowed: 1, 2, 4, 8, 16"),
    (["--mini-batches", "0"], "--mini-batches", "0", ">= 1"),
    (["--n-prompts", "3", "--mini-batches", "5"], "--mini-batches", "5",
     "--n-prompts 3 x --n-samples-per-prompt 4 = 12); allowed: 1, 2, 3, 4, 6, 12"),
    (["--ppo-epochs", "0"], "--ppo-epochs", "0", ">= 1"),
    (["--clip-eps-low", "-0.1"], "--clip-eps-low", "-0.1", "a number in [0, 1)"),
    # the lower bound 1 - eps can act only while > 0 (the ratio is > 0): --clip-eps-low 5 was
    # accepted with a bound of -4
    (["--clip-eps-low", "5"], "--clip-eps-low", "5.0", "must be a number in [0, 1) (the ratio, "
                                                        "always > 0, is clipped below at 1 - eps: "
                                                        "a bound <= 0 never acts)"),
    (["--clip-eps-low", "1"], "--clip-eps-low", "1.0", "[0, 1)"),
    (["--clip-eps-low", "nan"], "--clip-eps-low", "nan", "[0, 1)"),
    (["--clip-eps", "5"], "--clip-eps", "5.0", "must be a number in (0, 1) while it is also the "
                                               "lower clip range"),
    (["--clip-eps", "1", "--clip-eps-high", "0.3"], "--clip-eps", "1.0",
     "or give --clip-eps-low for the lower side"),
    (["--clip-eps-high", "nan"], "--clip-eps-high", "nan", "finite number >= 0"),
    (["--clip-eps-high", "inf"], "--clip-eps-high", "inf", "finite number >= 0"),
    (["--loss-agg", "sum"], "--loss-agg", "sum",
     "token-mean, seq-mean-token-sum, seq-mean-token-mean"),
    (["--lr-schedule", "step"], "--lr-schedule", "step", "constant, cosine, linear"),
    (["--lr-warmup-steps", "-1"], "--lr-warmup-steps", "-1", ">= 0"),
    (["--lr-warmup-steps", "4", "--steps", "2", "--mini-batches", "2"], "--lr-warmup-steps", "4",
     "--steps 2 x --ppo-epochs 1 x --mini-batches 2 = 4"),
]
# Issue 14: data parallelism.
BAD += [
    (["--dp", "3"], "--dp", "3", "virtual_dp=8; allowed: 1, 2, 4, 8"),
    (["--dp", "0"], "--dp", "0", ">= 1"),
    (["--dp", "8", "--n-prompts", "3"], "--dp", "8",
     "--n-prompts 3 x --n-samples-per-prompt 4 = 12), so every DP replica trains on as many "
     "samples; allowed: 1, 2, 4"),
    (["--dp", "4", "--mini-batches", "8"], "--dp", "4",
     "samples per mini-batch (16 samples per step / --mini-batches 8 = 2)"),
    (["--micro-batch-tokens", "100"], "--micro-batch-tokens", "100", ">= --max-prompt-len"),
    (["--token-budget", "100"], "--micro-batch-tokens", "100", "one whole sample"),
]
# AdamW's update scale: decoupled decay 1 - lr·wd must stay > 0, lr / (1 - beta1) within fp32.
BAD += [
    (["--lr", "0.1", "--weight-decay", "10"], "--weight-decay", "10.0", "must be below 1 / --lr"),
    (["--weight-decay", "3e38"], "--weight-decay", "3e+38", "would zero or flip them"),
    (["--lr", "3e38"], "--lr", "3e+38", "within fp32"),
    (["--lr", "3e37", "--adam-beta1", "0.99"], "--lr", "3e+37", "(--adam-beta1 0.99)"),
]
# Issue 12: the KV pool's fraction of free GPU memory: finite, in (0, 1].
BAD += [([f"--gpu-memory-utilization={v}"], "--gpu-memory-utilization", shown,
         "a number in (0, 1]")
        for v, shown in (("0", "0.0"), ("-0.5", "-0.5"), ("1.5", "1.5"), ("nan", "nan"),
                         ("inf", "inf"), ("-inf", "-inf"))]


@pytest.mark.parametrize("argv,flag,value,allowed", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_value_exits_2_names_flag_value_allowed_and_creates_nothing(
        capsys, cwd, loop, argv, flag, value, allowed):
    """rlk run <bad> == exit 2, stderr is one line naming flag, value and what is allowed, cwd empty."""
    code, out, err = rlk(capsys, "run", "--allow-dirty", *argv)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("rlk run: error: ")
    assert flag in lines[0] and value in lines[0] and allowed in lines[0], lines[0]
    assert list(cwd.iterdir()) == []
    assert loop.calls == []


@pytest.mark.parametrize("argv,flag,value", [
    (["run", "--steps", "1.5"], "--steps", "'1.5' is not an integer"),
    (["run", "--top-p", "abc"], "--top-p", "'abc' is not a number"),
    (["run", "--seed", ""], "--seed", "'' is not an integer"),
    (["run", "--steps"], "--steps", "expected one argument"),
    (["run", "--no-such-flag"], "--no-such-flag", "unknown flag"),
    (["init-model", "--preset", "tiny", "--out", "m", "--seed", "x"], "--seed", "not an integer"),
    # int() and float() read digit groups and any Unicode digit: '1_0' is 10, '١' is 1
    (["run", "--steps", "1_0"], "--steps", "'1_0' is not an integer (ASCII digits, no '_')"),
    (["run", "--lr", "1_0e-6"], "--lr", "'1_0e-6' is not a number (ASCII digits, no '_')"),
    (["run", "--seed", "\u0661"], "--seed", "is not an integer (ASCII digits"),
    (["run", "--kl-coef", "0.\u0661"], "--kl-coef", "is not a number (ASCII digits"),
    (["run", "--clip-grad", "0.000_1e-400"], "--clip-grad", "is not a number (ASCII digits"),
])
def test_argparse_errors_are_one_line_naming_the_flag(capsys, cwd, loop, argv, flag, value):
    """Every argparse error (type, missing value, unknown flag) == exit 2 and one stderr line naming
    the flag and the value: no usage block (README: bad flags give one line)."""
    code, out, err = rlk(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("rlk") and flag in lines[0] and value in lines[0], lines[0]
    assert list(cwd.iterdir()) == []


def test_help_says_which_logprob_is_recorded_under_top_p(capsys):
    """`rlk run --help` names the recorded logprob: the full-vocabulary log-softmax of logits / T."""
    code, out, _ = rlk(capsys, "run", "--help")
    text = " ".join(out.split())
    assert code == 0 and "full-vocabulary log-softmax of logits / T" in text
    assert "untruncated policy" in text


def test_help_says_what_gpu_memory_utilization_is_a_fraction_of(capsys):
    """`rlk run --help` shows --gpu-memory-utilization X: a fraction of the free CUDA memory (not
    vLLM's total), default 0.5, no effect on CPU."""
    code, out, _ = rlk(capsys, "run", "--help")
    text = " ".join(out.split())
    assert code == 0 and "--gpu-memory-utilization X" in text
    for words in ("Fraction in (0, 1] of the CUDA memory free when each step's rollout starts",
                  "not a fraction of the total", "--device cpu: no effect", "(default: 0.5)"):
        assert words in text, words


def test_run_help_is_in_sections_holding_every_flag_in_field_order(capsys):
    """`rlk run --help` lists its flags under the section titles of cli.RUN_FLAG_GROUPS, each
    section opening with its field's flag, every RunConfig field under exactly one title."""
    code, out, _ = rlk(capsys, "run", "--help")
    assert code == 0
    names = [f.name for f in dataclasses.fields(RunConfig)]
    assert set(cli.RUN_FLAG_GROUPS) <= set(names) and names[0] in cli.RUN_FLAG_GROUPS
    lines = out.splitlines()
    titles = [lines.index(t + ":") for t in cli.RUN_FLAG_GROUPS.values()]
    assert titles == sorted(titles)
    bounds = [*titles, len(lines)]
    for k, first in enumerate(cli.RUN_FLAG_GROUPS):
        body = lines[bounds[k] + 1:bounds[k + 1]]
        flags = [ln.split()[0].rstrip(",") for ln in body if ln.startswith("  --")]
        assert flags[0] == "--" + first.replace("_", "-"), (first, flags[:2])
    listed = [ln.split()[0].rstrip(",") for ln in lines[titles[0]:] if ln.startswith("  --")]
    assert listed == [cli.flag_name(n) for n in names], listed
    # The sections themselves, not only their consistency with the table: a few flags' titles.
    assert list(cli.RUN_FLAG_GROUPS.values()) == [
        "model, prompts and reward", "steps and sampling", "loss and PPO updates (GRPO/PPO)",
        "optimizer and non-finite gradients",
        "numerics and parallel layout", "rollout engine", "run directory, checks and device"]
    loss, opt = "loss and PPO updates (GRPO/PPO)", "optimizer and non-finite gradients"
    title_of, title = {}, None
    for ln in lines:
        if ln.endswith(":") and not ln.startswith(" "):
            title = ln[:-1]
        elif ln.startswith("  --"):
            title_of[ln.split()[0].rstrip(",")] = title
    expected = {"--model": "model, prompts and reward", "--reward": "model, prompts and reward",
                "--steps": "steps and sampling", "--top-p": "steps and sampling",
                "--kl-coef": loss, "--loss-agg": loss, "--ppo-epochs": loss,
                "--lr-warmup-steps": opt, "--lr": opt, "--on-nonfinite": opt,
                "--tp": "numerics and parallel layout",
                "--rollout-cp": "numerics and parallel layout",
                "--gpu-memory-utilization": "rollout engine",
                "--run-dir": "run directory, checks and device",
                "--device": "run directory, checks and device"}
    assert {f: title_of[f] for f in expected} == expected


# ---------------------------------------------------------------------------------------------
# the flag budget (STYLE.md §12)


def test_run_flags_are_exactly_the_reviewed_list(capsys):
    """The flags in `rlk run --help` == REVIEWED_RUN_FLAGS: a new flag fails until reviewed."""
    code, out, _ = rlk(capsys, "run", "--help")
    assert code == 0
    usage = out.split("\n\n")[0]
    flags = set(re.findall(r"(?:\[|\| )(-{1,2}[a-z0-9-]+)", usage)) | {"--help"}   # [--x | --no-x]
    assert flags - REVIEWED_RUN_FLAGS == set(), "unreviewed flag(s)"
    assert REVIEWED_RUN_FLAGS - flags == set(), "reviewed flag(s) gone"


def test_aliases_are_exactly_the_reviewed_list_and_set_the_same_field(capsys, cwd, loop):
    """Every option string of `rlk run` == REVIEWED_RUN_FLAGS | REVIEWED_RUN_ALIASES, and
    `--learning-rate X` == `--lr X` (same field, same value) for each alias."""
    run = cli._subparser(cli.build_parser(), "run")
    strings = {s for a in run._actions for s in a.option_strings}
    assert strings == REVIEWED_RUN_FLAGS | set(REVIEWED_RUN_ALIASES)
    for alias, flag in REVIEWED_RUN_ALIASES.items():
        a = cli.build_parser().parse_args(["run", alias, "3"])
        b = cli.build_parser().parse_args(["run", flag, "3"])
        assert vars(a) == vars(b)


@pytest.mark.parametrize("argv,line", [
    (["run", "--lerning-rate", "1"], "rlk run: error: unknown flag --lerning-rate; did you mean "
                                     "--learning-rate?"),
    (["run", "--num-generatons=4"], "rlk run: error: unknown flag --num-generatons; did you mean "
                                    "--num-generations?"),
    (["run", "--kl-coeff", "0.1"], "rlk run: error: unknown flag --kl-coeff; did you mean "
                                   "--kl-coef?"),
    (["run", "--temp", "0.7"], "rlk run: error: unknown flag --temp; did you mean "
                               "--temperature? (flags are not abbreviated)"),
    (["run", "--zzzz"], "rlk run: error: unknown flag --zzzz; rlk run --help lists every flag"),
    (["run", "stray"], "rlk run: error: unexpected argument 'stray'; see rlk run --help"),
    # a stray negative number is a value nobody took, not an unknown flag
    (["run", "--steps", "2", "-5"], "rlk run: error: unexpected argument '-5'; see rlk run --help"),
    (["run", "-1e-5"], "rlk run: error: unexpected argument '-1e-5'; see rlk run --help"),
    (["run", "--sp", "-nan"], "rlk run: error: unexpected argument '-nan'; see rlk run --help"),
    (["export", "r", "--out", "o", "--stp", "1"], "rlk export: error: unknown flag --stp; did "
                                                  "you mean --step?"),
    # other commands' name for the directory (spelling distance offered --tp for --out)
    (["run", "--out", "d"], "rlk run: error: unknown flag --out; did you mean --run-dir?"),
    (["run", "--output-dir=d"], "rlk run: error: unknown flag --output-dir; did you mean "
                                "--run-dir?"),
])
def test_unknown_flag_is_one_line_with_a_suggestion_exit_2(capsys, cwd, loop, argv, line):
    """An unknown flag == exit 2, one stderr line naming it and the closest real flag; no run.
    A prefix of a flag is unknown too (argparse would expand `--temp` to `--temperature`)."""
    code, out, err = rlk(capsys, *argv)
    assert (code, out, err.strip().splitlines()) == (2, "", [line])
    assert loop.calls == [] and list(cwd.iterdir()) == []


def test_version(capsys):
    """`rlk --version` prints the package and torch versions, exit 0."""
    import importlib.metadata

    import rlkernel
    code, out, _ = rlk(capsys, "--version")
    assert code == 0
    assert out.strip().startswith(f"rlk {rlkernel.__version__} (torch "
                                  f"{importlib.metadata.version('torch')}")


def test_every_config_field_is_a_flag_with_a_docstring():
    """{flag_name(f) for f in RunConfig} == REVIEWED_RUN_FLAGS - help; every field documented."""
    fields = [f.name for f in dataclasses.fields(RunConfig)]
    assert {flag_name(f) for f in fields} == REVIEWED_RUN_FLAGS - {"-h", "--help"} - NO_FORMS
    docs = field_docs()
    assert [f for f in fields if not docs.get(f)] == []


# ---------------------------------------------------------------------------------------------
# RunConfig itself


@pytest.mark.parametrize("kw", [
    {"steps": True}, {"steps": 2.0}, {"steps": "2"}, {"lr": "1e-5"}, {"lr": True}, {"sp": 1},
    {"seed": -1}, {"seed": 2**63}, {"model_seed": -1}, {"adam_beta1": 1.0}, {"adam_beta2": -0.1},
    {"clip_grad": -1.0}, {"clip_grad": math.inf}, {"adam_eps": 0.0}, {"dtype": "fp16"},
    {"mode": "fast"}, {"device": "mps"}, {"rollout_tp": 6}, {"rollout_cp": 0}, {"model": ""},
    {"micro_batch_tokens": 100}, {"weight_decay": -1e-9}, {"clip_eps": 0.0}, {"dp": 16},
    {"dp": 0}, {"dp": True}, {"gpu_memory_utilization": 0}, {"gpu_memory_utilization": -0.1},
    {"gpu_memory_utilization": 1.0000001}, {"gpu_memory_utilization": math.nan},
    {"gpu_memory_utilization": math.inf}, {"gpu_memory_utilization": True},
    {"gpu_memory_utilization": "0.5"}, {"gpu_memory_utilization": 10**400},
])
def test_invalid_config_raises_config_error_naming_the_flag(kw):
    (name, value), = kw.items()
    with pytest.raises(ConfigError) as e:
        RunConfig(**kw)
    assert flag_name(name) in str(e.value)
    assert isinstance(e.value, ValueError)


def test_config_keeps_values_verbatim_and_derives_in_properties():
    cfg = RunConfig(lr=1, clip_grad=0.0, n_prompts=3, n_samples_per_prompt=1, tp=2, sp=True,
                    cp=4, seed=2**63 - 1)
    d = cfg.to_dict()
    assert d["lr"] == 1 and type(d["lr"]) is int  # not rewritten to 1.0
    assert d["clip_grad"] == 0.0 and not cfg.grad_clipping
    assert cfg.samples_per_step == 3 and cfg.train_world_size == 8
    assert RunConfig.from_dict(d) == cfg
    assert set(d) == {f.name for f in dataclasses.fields(RunConfig)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 2.0  # type: ignore[misc]


def test_canonical_spec():
    """The spec records what the gradients depend on; --micro-batch-tokens and --dp are not in it
    (they never change a number), so two runs differing only there have the same spec."""
    spec = RunConfig(micro_batch_tokens=512, device="cpu").canonical_spec()
    assert spec == {"virtual_tp": 8, "virtual_cp": 8, "virtual_dp": 8, "backend": "cpu",
                    "matmul": "sequential-K fp32", "attention_kv_block": ATTN_KV_BLOCK,
                    "vocab_shards": 8, "token_leaf": TOKEN_LEAF,
                    "token_reduction": TOKEN_REDUCTION,
                    "rounding_points": ROUNDING_POINTS["bf16"],
                    "numerics_version": NUMERICS_VERSION}
    assert "--micro-batch-tokens" in TOKEN_REDUCTION and "--dp" in TOKEN_REDUCTION
    assert RunConfig(micro_batch_tokens=4096, dp=2).canonical_spec() == spec
    fp32 = RunConfig(dtype="fp32").canonical_spec()   # the dtype's rounding points are in it
    assert fp32["rounding_points"] == ROUNDING_POINTS["fp32"] != spec["rounding_points"]


def test_fingerprint_depends_on_every_value():
    assert RunConfig().fingerprint() == RunConfig().fingerprint()
    assert RunConfig().fingerprint() != RunConfig(seed=1).fingerprint()


# ---------------------------------------------------------------------------------------------
# a run: directory lifecycle


def test_run_writes_manifest_and_evidence_and_renames_tmp(capsys, cwd, loop):
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--steps", "3", "--tp", "2", "--sp")
    assert code == 0, err
    run_dir = cwd / out.strip()
    assert run_dir.parent == cwd / "runs" and run_dir.is_dir()
    assert [p.name for p in (cwd / "runs").iterdir()] == [run_dir.name]  # no .tmp- left
    assert sorted(p.name for p in run_dir.iterdir()) == ["evidence.json", "manifest.json"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    cfg = RunConfig(steps=3, tp=2, sp=True, allow_dirty=True)
    assert manifest["config"] == cfg.to_dict()
    assert manifest["canonical_spec"] == cfg.canonical_spec()
    assert set(manifest) >= {"versions", "git", "created_utc"}
    assert set(manifest["versions"]) >= {"python", "torch", "triton", "cuda", "platform", "devices",
                                         "rlkernel"}
    ev = json.loads((run_dir / "evidence.json").read_text())
    assert ev["complete"] is True and len(ev["steps"]) == 3
    assert ev["init"]["version"] == "v0"
    assert ev["steps"][0]["loss"] == "nan"  # non-finite floats stored as strings
    assert ev["steps"][1]["grad_norm"] == 2.5
    assert len([ln for ln in err.splitlines() if ln.startswith("step ")]) == 3  # progress lines
    assert loop.calls[0][1].name.startswith(run_dir.name + ".tmp-")


def test_run_into_given_empty_dir(capsys, cwd, loop):
    (cwd / "mine").mkdir()
    code, out, _ = rlk(capsys, "run", "--allow-dirty", "--run-dir", "mine")
    assert code == 0 and out.strip() == "mine"
    assert (cwd / "mine" / "evidence.json").is_file()
    assert sorted(p.name for p in cwd.iterdir()) == ["mine"]


def test_run_dir_not_empty_exit_2(capsys, cwd, loop):
    (cwd / "full").mkdir()
    (cwd / "full" / "x").write_text("x")
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "full")
    assert code == 2 and "--run-dir" in err and "full" in err
    assert loop.calls == []


def test_loop_value_error_before_first_step_leaves_nothing(capsys, cwd, loop):
    def bad(cfg, run_dir, writer):
        writer.record_init({"version": "v0", "tensor_hashes": {}})
        raise ValueError("prompts.jsonl line 3: not valid JSON\n(detail)")

    loop.set(bad)
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "a/b/run")
    assert code == 1 and out == ""
    assert err.strip().splitlines() == ["rlk run: error: prompts.jsonl line 3: not valid JSON (detail)"]
    assert list(cwd.iterdir()) == []  # nor the a/b parents it created


def test_loop_os_error_before_first_step_leaves_nothing_default_dir(capsys, cwd, loop):
    def bad(cfg, run_dir, writer):
        raise FileNotFoundError(2, "No such file or directory", "model.safetensors")

    loop.set(bad)
    code, _, err = rlk(capsys, "run", "--allow-dirty")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "model.safetensors" in err
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("flag", ["--run-dir", "--prompts", "--model"])
def test_a_path_that_is_not_utf8_is_refused_before_any_work(capsys, cwd, loop, flag):
    """A path whose bytes are not UTF-8 (Python's surrogate escapes, as argv gives them): exit 2
    naming the flag; it ran, and its run could then be neither exported nor plotted."""
    code, _, err = rlk(capsys, "run", "--allow-dirty", flag, "bad\udcffname")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert flag in lines[0] and "must be a UTF-8 path" in lines[0], lines[0]
    assert list(cwd.iterdir()) == [] and loop.calls == []


@pytest.mark.parametrize("argv,name", [
    (["init-model", "--preset", "tiny", "--out", "m\udcff"], "--out"),
    (["export", "r\udcff", "--out", "e"], "RUN"),
    (["export", "r", "--out", "e\udcff"], "--out"),
    (["report", "a", "b\udcff", "--out", "p"], "RUN"),
    (["report", "a", "--out", "p\udcff"], "--out"),
    (["compare", "a", "b\udcff"], "RUN_B"),
])
def test_every_command_refuses_a_path_that_is_not_utf8(capsys, cwd, argv, name):
    """The other commands keep run's rule: a path whose bytes are not UTF-8 is exit 2, one
    line naming the argument, before any work (init-model wrote a model `rlk run --model`
    then refused; export wrote its model and then failed printing where)."""
    code, out, err = rlk(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and out == "", err
    assert lines[0].startswith(f"rlk {argv[0]}: error: {name} ") and "must be a UTF-8 path" \
        in lines[0], lines[0]
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("argv,name", [
    (["report", "a", "--out", ""], "--out"),
    (["report", "", "--out", "p"], "RUN"),
    (["compare", "", "a"], "RUN_A"),
    (["compare", "a", ""], "RUN_B"),
    (["export", "", "--out", "e"], "RUN"),
    (["export", "a", "--out", ""], "--out"),
    (["init-model", "--preset", "tiny", "--out", ""], "--out"),
])
def test_every_command_refuses_an_empty_path(capsys, cwd, argv, name):
    """'' as a path of any command is exit 2, one line naming the argument, as for rlk run's
    --run-dir '': the file system reads it as the current directory, where report wrote its
    PNGs (exit 0) and compare and export read a run."""
    (cwd / "a").mkdir()
    for d in (cwd, cwd / "a"):   # both look like runs to report
        (d / "metrics.jsonl").write_text('{"step": 0, "reward": 0.5}\n')
    before = sorted(cwd.rglob("*"))
    code, out, err = rlk(capsys, *argv)
    assert code == 2 and out == "", err
    assert err.strip().splitlines() == [f"rlk {argv[0]}: error: {name} '': must be a non-empty "
                                        "path"]
    assert sorted(cwd.rglob("*")) == before


@pytest.mark.parametrize("argv,name,value", [
    (["run", "--allow-dirty", "--run-dir", " "], "--run-dir", " "),
    (["run", "--allow-dirty", "--prompts", "\t"], "--prompts", "\t"),
    (["run", "--allow-dirty", "--model", " \n"], "--model", " \n"),
    (["export", "a", "--out", "  "], "--out", "  "),
    (["report", "a", "--out", " "], "--out", " "),
    (["compare", " ", "a"], "RUN_A", " "),
    (["init-model", "--preset", "tiny", "--out", " "], "--out", " "),
])
def test_every_command_refuses_a_path_of_only_whitespace(capsys, cwd, loop, argv, name, value):
    """A path of only whitespace (a legal file name, but a quoting slip: `--run-dir "$DIR "`
    with DIR unset) is exit 2, one line naming the argument, before any work; `rlk run
    --run-dir ' '` made a run directory named ' ' (exit 0). Control: ' a' (not only
    whitespace) is a path these take."""
    (cwd / "a").mkdir()
    code, out, err = rlk(capsys, *argv)
    assert code == 2 and out == "", err
    want = (f"rlk {argv[0]}: error: {name} {value!r}: must be a path, not only whitespace"
            + (" (or left out)" if argv[0] == "run" else ""))
    assert err.strip().splitlines() == [want]     # one line, the value as it was given
    assert sorted(p.name for p in cwd.iterdir()) == ["a"] and loop.calls == []
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", " a/r")
    assert code == 0 and len(loop.calls) == 1, err


@pytest.mark.parametrize("argv,name,value", [
    (["run", "--allow-dirty", "--run-dir", "r/ "], "--run-dir", "r/ "),
    (["run", "--allow-dirty", "--prompts", "a/\t/p.jsonl"], "--prompts", "a/\t/p.jsonl"),
    (["export", "a", "--out", "out/  /m"], "--out", "out/  /m"),
    (["report", "a", "--out", " /"], "--out", " /"),
    (["compare", "a", "a/ "], "RUN_B", "a/ "),
    (["init-model", "--preset", "tiny", "--out", " /m"], "--out", " /m"),
])
def test_every_command_refuses_a_path_with_a_name_of_only_whitespace(capsys, cwd, loop, argv,
                                                                     name, value):
    """A path one of whose names is only whitespace ('r/ ', ' /m': a quoting slip in one part,
    e.g. `--run-dir "runs/$NAME "` with NAME unset) is exit 2, one line naming the argument and
    that name, before any work. Control: names with whitespace and something else (' a/r ')
    are paths these take."""
    (cwd / "a").mkdir()
    code, out, err = rlk(capsys, *argv)
    assert code == 2 and out == "", err
    part = next(p for p in value.split("/") if p and not p.strip())
    want = (f"rlk {argv[0]}: error: {name} {value!r}: has a name of only whitespace "
            f"({part!r}): a quoting slip, not a choice")
    assert err.strip().splitlines() == [want]
    assert sorted(p.name for p in cwd.iterdir()) == ["a"] and loop.calls == []
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", " a/r ")
    assert code == 0 and len(loop.calls) == 1, err


def test_errors_name_a_path_with_its_runs_of_blanks_as_given(capsys, cwd, loop):
    """An error names the value as it was typed: --run-dir 'sp  two' (two spaces) naming an
    occupied directory says 'sp  two' — the one-line error squeezed runs of blanks anywhere in
    the message, so it named 'sp two', another path. Line breaks in a message still become one
    space (one line)."""
    (cwd / "sp  two").mkdir()
    (cwd / "sp  two" / "x").write_text("")
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "sp  two")
    assert code == 2 and loop.calls == [], err
    assert err.strip().splitlines() == [
        "rlk run: error: --run-dir 'sp  two': exists and is not an empty directory; give a new "
        "or empty directory"], err
    assert cli._one_line("a  b\n  c\r\n\td ") == "a  b c d"


def _rlk_under_a_test_handler(capsys, num: int, *argv: str) -> tuple[int, str, str]:
    """rlk(*argv) with a handler of the test's own for signal `num`, which fails the test if the
    signal reaches it (what the default action got before rlk installed one); asserts rlk put
    it back on the way out."""
    import signal

    def unhandled(signum, frame):
        raise AssertionError(f"signal {signum} reached the test's handler: rlk {argv[0]} "
                             "installed none")

    before = signal.signal(num, unhandled)
    try:
        got = rlk(capsys, *argv)
        assert signal.getsignal(num) is unhandled    # restored on the way out
    finally:
        signal.signal(num, before)
    return got


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_signal_while_the_run_validates_releases_the_lock_and_says_so(capsys, cwd, loop,
                                                                       monkeypatch, sig):
    """SIGTERM/SIGHUP after the run directory is locked but before the run's own handling
    (validation, torch's import: ~1.5 s): exit 128 + signum, one line, no RUN.lock left (the
    default action killed it there silently, lock left behind), handlers restored."""
    import os
    import signal

    num = getattr(signal, sig)

    def signalled(cfg):
        assert (cwd / "r.lock").exists()   # the lock is held at this point
        os.kill(os.getpid(), num)          # the handler raises here, as a signal would

    monkeypatch.setattr(cli, "_check_inputs", signalled)
    code, out, err = _rlk_under_a_test_handler(capsys, num, "run", "--allow-dirty", "--run-dir",
                                               "r")
    assert code == 128 + num and out == "", (code, err)
    assert err.strip() == "rlk run: interrupted before the first step; nothing kept", err
    assert list(cwd.iterdir()) == [] and loop.calls == []


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_signal_while_init_model_writes_leaves_nothing(capsys, cwd, monkeypatch, sig):
    """SIGTERM/SIGHUP while `rlk init-model` writes model.safetensors: exit 128 + signum, one
    line, no staging directory left (the default action killed it there silently and left
    .OUT.tmp-PID-*, 487 MB for qwen3-0.6b, the model's size for qwen3-8b), handlers restored.
    rlk export writes through the same staging (save_checkpoint) under the same handler."""
    import os
    import signal

    from rlkernel.model import checkpoint

    num = getattr(signal, sig)
    real_save = checkpoint.save_file

    def signalled(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)   # the weights are on disk, staged
        assert list(cwd.glob(".m.tmp-*/model.safetensors"))
        os.kill(os.getpid(), num)          # the handler raises here, as a signal would

    monkeypatch.setattr(checkpoint, "save_file", signalled)
    code, out, err = _rlk_under_a_test_handler(capsys, num, "init-model", "--preset", "tiny",
                                               "--out", "m")
    assert (code, out) == (128 + num, ""), (code, err)
    assert err.splitlines() == ["rlk init-model: terminated"], err
    assert list(cwd.iterdir()) == []


def test_out_of_memory_before_the_first_step_is_one_line_naming_the_sizes(capsys, cwd, loop):
    """MemoryError inside the run (a batch the validators accept but the host cannot hold):
    exit 1, one line naming the flags that size a step, nothing left (was a traceback and a
    0-step run directory)."""
    def bad(cfg, run_dir, writer):
        raise MemoryError()

    loop.set(bad)
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r")
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert "out of host memory (MemoryError)" in lines[0] and "--n-prompts" in lines[0]
    assert list(cwd.iterdir()) == []


def test_loop_value_error_after_a_step_keeps_partial_evidence(capsys, cwd, loop):
    def bad(cfg, run_dir, writer):
        writer.record_step(_step(0))
        raise ValueError("weight audit failed")

    loop.set(bad)
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r")
    assert code == 1 and "weight audit failed" in err
    ev = json.loads((cwd / "r" / "evidence.json").read_text())
    assert ev["complete"] is False and len(ev["steps"]) == 1
    assert sorted(p.name for p in cwd.iterdir()) == ["r"]


def test_a_second_run_on_a_run_dir_in_use_is_refused_at_its_start(capsys, cwd, loop):
    """While a run writes --run-dir a/r (in a/r.tmp-<pid>), a second rlk run on a/r is one line,
    exit 2, before any work; the first publishes as usual and leaves no lock file (a/r.lock) or
    parent behind. The second crashed at publish, after its whole run ("Directory not empty"),
    leaving its a/r.tmp-<pid>."""
    second = []

    def first(cfg, run_dir, writer):
        _fake_loop(cfg, run_dir, writer)
        second.append(cli.main(["run", "--allow-dirty", "--run-dir", "a/r"]))

    loop.set(first)
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "a/r")
    assert (code, out.strip(), second) == (0, "a/r", [2])
    assert [ln for ln in err.splitlines() if "error" in ln] == [
        f"rlk run: error: --run-dir 'a/r': another rlk run (pid {os.getpid()}) is writing this "
        "directory (it holds a/r.lock); wait for it to end, or give another directory"]
    assert len(loop.calls) == 1 and sorted(p.name for p in (cwd / "a").iterdir()) == ["r"]
    # the lock is released: the same directory, emptied, takes a new run
    shutil.rmtree(cwd / "a" / "r")
    loop.set(_fake_loop)
    assert rlk(capsys, "run", "--allow-dirty", "--run-dir", "a/r")[0] == 0


def _freeze_utc(monkeypatch, when):
    """Make cli's clock (the default run directory's stamp) read `when`."""
    import datetime

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return when

    monkeypatch.setattr(cli, "datetime", types.SimpleNamespace(datetime=Frozen,
                                                               timezone=datetime.timezone))


def test_two_runs_of_one_config_in_the_same_second_get_two_default_dirs(
        capsys, cwd, loop, monkeypatch):
    """Without --run-dir, a second run of the same config started in the same second as a
    running one (same stamp and hash, the first not yet published) was refused ("another rlk
    run is writing this directory"); it now takes the name with -1, and a third, after both
    published, -2. Every run publishes; no .tmp- or .lock is left."""
    import datetime

    _freeze_utc(monkeypatch, datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc))
    base = f"runs/20250102T030405Z-{RunConfig(allow_dirty=True).fingerprint()[:10]}"
    second = []

    def first(cfg, run_dir, writer):
        _fake_loop(cfg, run_dir, writer)
        if not second:   # the first run is still writing runs/<base>.tmp-<pid>
            second.append(None)   # (the second run's loop is this one too: start it once)
            second[0] = cli.main(["run", "--allow-dirty"])

    loop.set(first)
    code, out, err = rlk(capsys, "run", "--allow-dirty")
    assert (code, second) == (0, [0]), err
    assert out.split() == [f"{base}-1", base] and "error" not in err
    assert rlk(capsys, "run", "--allow-dirty")[1].strip() == f"{base}-2"
    assert sorted(p.name for p in (cwd / "runs").iterdir()) == [
        n.removeprefix("runs/") for n in (base, f"{base}-1", f"{base}-2")]


def test_a_default_name_with_a_temporary_beside_it_is_not_reused(capsys, cwd, loop, monkeypatch):
    """A default name whose `<name>.tmp-<pid>` exists (a run writing it, or one killed) is
    passed over, so that run can still be published or resumed under its name."""
    import datetime

    _freeze_utc(monkeypatch, datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc))
    base = f"runs/20250102T030405Z-{RunConfig(allow_dirty=True).fingerprint()[:10]}"
    (cwd / f"{base}.tmp-{os.getpid()}").mkdir(parents=True)
    code, out, _ = rlk(capsys, "run", "--allow-dirty")
    assert (code, out.strip()) == (0, f"{base}-1")


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def test_a_run_warns_of_temporaries_that_killed_runs_left_and_deletes_nothing(
        capsys, cwd, loop):
    """`rlk run` names each `RUN.tmp-<pid>` beside its run directory whose pid is gone (a
    SIGKILLed run) in a warning with what to do: resume (it has a checkpoint) or delete it. A
    live pid's temporary (a run in progress) and directories that are no run's are not named,
    and nothing is deleted."""
    dead = _dead_pid()
    runs = cwd / "runs"
    resumable = runs / f"a.tmp-{dead}"
    (resumable / "checkpoints" / "step-000001").mkdir(parents=True)
    plain = runs / f"b.tmp-{dead}"
    live = runs / f"c.tmp-{os.getpid()}"
    for d in (resumable, plain, live):
        d.mkdir(parents=True, exist_ok=True)
        (d / "manifest.json").write_text("{}")
    (runs / f"d.tmp-{dead}").mkdir()                 # no manifest.json: no rlk run's
    for odd in ("e.tmp-²", "f.tmp-١٢", "g.tmp-abc"):   # no ASCII pid: no rlk run's ('²' was a
        (runs / odd).mkdir()                          # ValueError, '١٢' read as pid 12)
        (runs / odd / "manifest.json").write_text("{}")
    code, out, err = rlk(capsys, "run", "--allow-dirty")
    assert code == 0, err
    warnings = [ln for ln in err.splitlines() if ln.startswith("rlk run: warning: runs/")]
    assert warnings == [
        f"rlk run: warning: runs/a.tmp-{dead} was left by an rlk run that was killed (pid {dead} "
        f"is not running); resume it with: rlk run --resume runs/a.tmp-{dead}",
        f"rlk run: warning: runs/b.tmp-{dead} was left by an rlk run that was killed (pid {dead} "
        "is not running); it has no checkpoint to resume from; delete it, or rename it to keep "
        "its partial evidence"]
    assert sorted(p.name for p in runs.iterdir()) == sorted(
        [f"a.tmp-{dead}", f"b.tmp-{dead}", f"c.tmp-{os.getpid()}", f"d.tmp-{dead}",
         "e.tmp-²", "f.tmp-١٢", "g.tmp-abc", out.strip().removeprefix("runs/")])
    # only the run directory's own parent is looked at
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "elsewhere/r")
    assert code == 0 and "warning: runs/" not in err
    (runs / "a").mkdir()     # another run published the name since: resume it under another
    (runs / "a" / "manifest.json").write_text("{}")
    code, _, err = rlk(capsys, "run", "--allow-dirty")
    assert code == 0 and (
        f"rlk run: warning: runs/a.tmp-{dead} was left by an rlk run that was killed (pid "
        f"{dead} is not running); its name is the published run runs/a's: to resume it, move "
        f"it to a free name (e.g. mv runs/a.tmp-{dead} runs/a-resumed) and rlk run --resume "
        "that") in err.splitlines()


def test_many_stale_temporaries_are_named_three_then_counted(capsys, cwd, loop):
    dead = _dead_pid()
    for name in "abcde":
        (cwd / f"{name}.tmp-{dead}").mkdir()
        (cwd / f"{name}.tmp-{dead}" / "manifest.json").write_text("{}")
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r")
    warnings = [ln for ln in err.splitlines() if ln.startswith("rlk run: warning: ")
                and (".tmp-" in ln or "more such" in ln)]
    assert code == 0 and len(warnings) == 4, err
    assert [w.split()[3] for w in warnings[:3]] == [f"{n}.tmp-{dead}" for n in "abc"]
    assert warnings[3] == "rlk run: warning: and 2 more such directories in ."


HOLD_LOCK = """
import pathlib, sys, time
from rlkernel.runner.dirlock import run_dir_lock
with run_dir_lock(pathlib.Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_lock_of_a_live_process_refuses_and_one_a_killed_process_left_does_not(
        capsys, cwd, loop):
    """A lock held by another process names its pid (exit 2, nothing created); once that
    process is SIGKILLed, the lock file it left stops nobody: a run takes it over and removes
    it."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(cwd / "r")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        code, _, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r")
        assert code == 2 and loop.calls == []
        assert f"--run-dir 'r': another rlk run (pid {holder.pid}) is writing" in err
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in cwd.iterdir()) == ["r.lock"]   # left by the killed holder
    code, out, _ = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r")
    assert (code, out.strip()) == (0, "r") and sorted(p.name for p in cwd.iterdir()) == ["r"]


@pytest.mark.parametrize("rank,locks", [("0", True), ("1", False)])
def test_only_the_rank_that_writes_the_run_dir_locks_it(cwd, monkeypatch, rank, locks):
    """Under torchrun only rank 0 writes the run directory, so only it takes the lock: ranks on
    one host would otherwise refuse each other."""
    for k, v in dict(RANK=rank, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29500").items():
        monkeypatch.setenv(k, v)
    with contextlib.ExitStack() as held:
        cli._lock_run_dir(RunConfig(run_dir="r"), cwd / "r", held)
        assert (cwd / "r.lock").exists() is locks
    assert list(cwd.iterdir()) == []


def test_loop_bug_is_raised_and_dir_kept_under_final_name(capsys, cwd, loop):
    def bug(cfg, run_dir, writer):
        raise RuntimeError("bug")

    loop.set(bug)
    with pytest.raises(RuntimeError):
        cli.main(["run", "--allow-dirty", "--run-dir", "r"])
    assert (cwd / "r" / "manifest.json").is_file()
    assert sorted(p.name for p in cwd.iterdir()) == ["r"]


def test_rlk_debug_reraises(capsys, cwd, loop, monkeypatch):
    def bad(cfg, run_dir, writer):
        raise ValueError("boom")

    loop.set(bad)
    monkeypatch.setenv("RLK_DEBUG", "1")
    with pytest.raises(ValueError, match="boom"):
        cli.main(["run", "--allow-dirty"])
    assert list(cwd.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# git state


def test_dirty_checkout_is_refused_without_allow_dirty(capsys, cwd, loop, monkeypatch):
    monkeypatch.setattr(cli, "git_state", lambda src: {"commit": "c" * 40, "dirty": True,
                                                       "dirty_files": [" M rlkernel/x.py"]})
    code, _, err = rlk(capsys, "run")
    assert code == 2 and "--allow-dirty" in err and "commit" in err
    assert list(cwd.iterdir()) == [] and loop.calls == []


def test_not_a_checkout_is_recorded_as_null_and_not_refused(capsys, cwd, loop, monkeypatch):
    monkeypatch.setattr(cli, "git_state", lambda src: {"commit": None, "dirty": None,
                                                       "dirty_files": []})
    code, out, _ = rlk(capsys, "run", "--run-dir", "r")
    assert code == 0
    assert json.loads((cwd / "r" / "manifest.json").read_text())["git"]["commit"] is None


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_git_state_of_a_checkout(tmp_path):
    repo = tmp_path / "src"
    (repo / "rlkernel").mkdir(parents=True)
    (repo / "rlkernel" / "__init__.py").write_text("")
    (repo / ".gitignore").write_text("")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (repo / "runs" / "r1").mkdir(parents=True)  # untracked runs/ is not dirt
    (repo / "runs" / "r1" / "evidence.json").write_text("{}")
    st = git_state(repo)
    assert len(st["commit"]) == 40 and st["dirty"] is False
    (repo / "rlkernel" / "__init__.py").write_text("x = 1\n")
    assert git_state(repo)["dirty"] is True
    assert git_state(tmp_path / "src" / "runs")["commit"] is None  # rlkernel not tracked there
    assert git_state(tmp_path) == {"commit": None, "dirty": None, "dirty_files": [],
                                   "diff": None, "diff_sha256": None,
                                   "untracked_package_files": {}}


def test_git_state_ignores_the_users_untracked_files_and_records_the_diff(tmp_path):
    """Untracked files outside the package (a model or prompts folder) == clean; an untracked
    file inside rlkernel/ == dirty (it would be imported), recorded with its SHA-256; a tracked
    change == dirty, with `git diff HEAD` text and its SHA-256 in the state."""
    import hashlib

    repo = tmp_path / "src"
    (repo / "rlkernel").mkdir(parents=True)
    (repo / "rlkernel" / "__init__.py").write_text("")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (repo / "my-model").mkdir()
    (repo / "my-model" / "config.json").write_text("{}")
    (repo / "prompts.jsonl").write_text("{}\n")
    st = git_state(repo)
    assert st["dirty"] is False and st["dirty_files"] == [] and st["diff"] == ""
    (repo / "rlkernel" / "extra.py").write_text("X = 1\n")
    st = git_state(repo)
    assert st["dirty"] is True and st["dirty_files"] == ["?? rlkernel/extra.py"]
    assert st["untracked_package_files"] == {
        "rlkernel/extra.py": hashlib.sha256(b"X = 1\n").hexdigest()}
    (repo / "rlkernel" / "extra.py").unlink()
    (repo / "rlkernel" / "__init__.py").write_text("y = 2\n")
    st = git_state(repo)
    assert st["dirty"] is True and st["dirty_files"] == [" M rlkernel/__init__.py"]
    assert "+y = 2" in st["diff"]
    assert st["diff_sha256"] == hashlib.sha256(st["diff"].encode()).hexdigest()


def test_git_state_records_package_files_under_their_own_names(tmp_path):
    """Untracked package files named with non-ASCII bytes (UTF-8 or not) are recorded under
    their names with their SHA-256, and a staged rename is one entry: without -z git quotes and
    octal-escapes such names ('rlkernel/zz \\303\\251.py'), which named no file (hash None);
    with it, a name that is not UTF-8 comes raw and must still decode to its bytes."""
    import hashlib

    repo = tmp_path / "src"
    (repo / "rlkernel").mkdir(parents=True)
    (repo / "rlkernel" / "__init__.py").write_text("")
    (repo / "rlkernel" / "a.py").write_text("")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (repo / "rlkernel" / "zz \u00e9.py").write_text("A = 1\n")
    open(os.fsencode(repo / "rlkernel") + b"/b\xff.py", "wb").write(b"B = 2\n")
    _git(repo, "mv", "rlkernel/a.py", "rlkernel/\u00e4.py")
    st = git_state(repo)
    odd = os.fsdecode(b"rlkernel/b\xff.py")
    assert st["dirty_files"] == ["R  rlkernel/\u00e4.py", f"?? {odd}", "?? rlkernel/zz \u00e9.py"]
    assert st["untracked_package_files"] == {
        odd: hashlib.sha256(b"B = 2\n").hexdigest(),
        "rlkernel/zz \u00e9.py": hashlib.sha256(b"A = 1\n").hexdigest()}


# ---------------------------------------------------------------------------------------------
# Ctrl-C and resume lines


@pytest.mark.parametrize("save_every,hint", [
    (0, "not resumable: it has no checkpoint (runs keep them with --save-every N)"),
    (1, "resume with: rlk run --resume r"),
    (2, "not resumable: no checkpoint was written yet (--save-every 2 writes the first after "
        "step 2)")])
def test_ctrl_c_is_one_line_with_the_resume_hint(capsys, cwd, loop, save_every, hint):
    """Ctrl-C after a recorded step == exit 130, one stderr line (no traceback) saying what was
    kept and how to resume (or why it cannot be: no --save-every, or none written yet); the run
    directory keeps the step."""
    def interrupted(cfg, run_dir, writer):
        _fake_loop(cfg.__class__(steps=1, allow_dirty=True), run_dir, writer)
        if cfg.save_every == 1:
            (run_dir / "checkpoints" / "step-000001").mkdir(parents=True)
        raise KeyboardInterrupt

    loop.set(interrupted)
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r", "--steps", "3",
                         "--save-every", str(save_every))
    lines = [ln for ln in err.splitlines() if not ln.startswith("step ")]
    assert code == 130 and out == ""
    assert lines == [f"rlk run: interrupted (Ctrl-C) after 1 step(s); partial run kept in r; {hint}"]
    ev = json.loads((cwd / "r" / "evidence.json").read_text())
    assert ev["complete"] is False and len(ev["steps"]) == 1


def test_ctrl_c_before_the_first_step_keeps_nothing(capsys, cwd, loop):
    def interrupted(cfg, run_dir, writer):
        raise KeyboardInterrupt

    loop.set(interrupted)
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "a/r")
    assert code == 130
    assert err.strip().splitlines() == ["rlk run: interrupted before the first step; nothing kept"]
    assert list(cwd.iterdir()) == []


def test_a_signal_after_the_last_step_says_the_run_is_complete(capsys, cwd, loop):
    """SIGTERM once the evidence is complete (a launched run's ranks shutting down): exit 143,
    one line saying the run finished and is complete — not "partial run kept" with a resume
    command that would be refused (found by a breaker on a TP2 run). Control: the same signal
    one step short of the end keeps a partial run."""
    from rlkernel.termination import Terminated

    def finished_then_signalled(cfg, run_dir, writer):
        _fake_loop(cfg, run_dir, writer)
        writer.finish({"steps": writer.n_steps})
        raise Terminated(143)

    loop.set(finished_then_signalled)
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r", "--steps", "2")
    lines = [ln for ln in err.splitlines() if not ln.startswith("step ")]
    assert (code, out) == (143, "") and lines == [
        "rlk run: terminated after the run finished; its 2 step(s) are complete in r"], lines
    assert json.loads((cwd / "r" / "evidence.json").read_text())["complete"] is True

    def one_short(cfg, run_dir, writer):
        _fake_loop(cfg.__class__(steps=1, allow_dirty=True), run_dir, writer)
        raise Terminated(143)

    loop.set(one_short)
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r2", "--steps", "2")
    assert code == 143 and "terminated after 1 step(s); partial run kept in r2" in err, err


def test_write_json_atomic_non_finite(tmp_path):
    write_json_atomic(tmp_path / "x.json", {"a": [math.inf, -math.inf, math.nan, 0.1], "b": (1, 2)})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": ["inf", "-inf", "nan", 0.1],
                                                             "b": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


# ---------------------------------------------------------------------------------------------
# issue 13: settings that cannot act are warned about; --tensorboard needs its package


@pytest.mark.parametrize("argv,needle", [
    (["--save-every", "5", "--steps", "2"], "--save-every 5 > --steps 2"),
    (["--n-samples-per-prompt", "1"], "--n-samples-per-prompt 1"),
    (["--clip-eps-high", "0.28"], "--ppo-epochs or --mini-batches"),
    (["--clip-eps", "0.1"], "cannot act with one update"),
    (["--kl-estimator", "k3"], "--kl-estimator k3 is ignored with --kl-coef 0"),
])
def test_setting_that_cannot_act_warns_one_line_and_runs(capsys, cwd, loop, argv, needle):
    """A valid setting that can do nothing == one 'warning' line on stderr, and the run goes on."""
    code, _, err = rlk(capsys, "run", "--allow-dirty", *argv)
    assert code == 0, err
    warnings = [ln for ln in err.splitlines() if ln.startswith("rlk run: warning: ")]
    assert len(warnings) == 1 and needle in warnings[0], err
    assert len(loop.calls) == 1


def test_gpu_memory_utilization_on_cpu_warns_and_is_recorded(capsys, cwd, loop):
    """--device cpu --gpu-memory-utilization 0.8 == one warning (the CPU pool ignores it), the run
    goes on, and the manifest's config holds 0.8 verbatim; the default value does not warn."""
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--gpu-memory-utilization", "0.8")
    assert code == 0, err
    (w,) = [ln for ln in err.splitlines() if ln.startswith("rlk run: warning: ")]
    assert "--gpu-memory-utilization 0.8 has no effect with --device cpu" in w
    manifest = json.loads((cwd / out.strip() / "manifest.json").read_text())
    assert manifest["config"]["gpu_memory_utilization"] == 0.8
    assert "gpu_memory_utilization" not in json.dumps(manifest["canonical_spec"])
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--gpu-memory-utilization", "0.5")
    assert code == 0 and "warning" not in err


def test_gpu_memory_utilization_reaches_the_rollout_engine(capsys, cwd, monkeypatch):
    """rlk run --gpu-memory-utilization 0.7 == RolloutEngine(..., gpu_memory_utilization=0.7) in
    the real loop (stopped there by a stand-in engine: exit 1, nothing left on disk)."""
    import rlkernel.runner.loop as loop_mod

    seen = []

    def stand_in(*args, **kw):
        seen.append(kw.get("gpu_memory_utilization"))
        raise ValueError("stand-in engine: stop before step 0")

    monkeypatch.setattr(loop_mod, "RolloutEngine", stand_in)
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--steps", "1", "--n-prompts", "1",
                       "--gpu-memory-utilization", "0.7")
    assert seen == [0.7]
    assert code == 1 and "stand-in engine" in err
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("flags,want", [([], False), (["--keep-rollout-state"], True)])
def test_keep_rollout_state_reaches_the_rollout_engine(capsys, cwd, monkeypatch, flags, want):
    """rlk run [--keep-rollout-state] == RolloutEngine(..., keep_state=False/True) in the real
    loop (a stand-in engine stops it, as above); a non-bool value is refused by name. (A run
    with the flag is IDENTICAL to one without, test_run.py, so only this sees it dropped.)"""
    import rlkernel.runner.loop as loop_mod

    seen = []

    def stand_in(*args, **kw):
        seen.append(kw.get("keep_state"))
        raise ValueError("stand-in engine: stop before step 0")

    monkeypatch.setattr(loop_mod, "RolloutEngine", stand_in)
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--steps", "1", "--n-prompts", "1", *flags)
    assert seen == [want] and code == 1 and "stand-in engine" in err
    with pytest.raises(ConfigError, match="keep.rollout.state"):
        RunConfig(keep_rollout_state="yes")


def test_resume_may_change_gpu_memory_utilization(tmp_path):
    """--resume --gpu-memory-utilization F is allowed (a memory knob, like --micro-batch-tokens),
    also for a run whose manifest predates the flag; --seed still cannot change."""
    d = tmp_path / "r"
    d.mkdir()
    saved = RunConfig().to_dict()
    del saved["gpu_memory_utilization"]                      # a manifest from before issue 12
    (d / "manifest.json").write_text(json.dumps({"config": saved, "canonical_spec":
                                                 RunConfig().canonical_spec()}))
    cfg = cli._resume_config({"resume": str(d), "gpu_memory_utilization": 0.9}, d)
    assert cfg.gpu_memory_utilization == 0.9 and cfg.seed == saved["seed"]
    assert cli._resume_config({"resume": str(d)}, d).gpu_memory_utilization == 0.5
    with pytest.raises(ConfigError, match="--seed"):
        cli._resume_config({"resume": str(d), "gpu_memory_utilization": 0.9, "seed": 7}, d)


def test_a_run_dir_named_like_an_unfinished_run_is_refused(capsys, cwd):
    """--run-dir X.tmp-<digits> is the name an unfinished run lies under: a run published there
    would later be taken for a killed one (a resume renamed it to X). Refused up front, exit 2,
    nothing made."""
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--steps", "1", "--run-dir", "z.tmp-99")
    assert code == 2 and "--run-dir 'z.tmp-99': a name ending in .tmp-<digits>" in err
    assert list(cwd.iterdir()) == []


def test_a_resume_clash_with_a_saved_flag_says_where_it_came_from(tmp_path):
    """A run saved with --tp 2 --sp resumed with --tp 1 only: the --sp error says --sp is the
    saved run's setting and how to change it (--no-sp); with --no-sp the resume is accepted."""
    d = tmp_path / "r"
    d.mkdir()
    saved = {**RunConfig().to_dict(), "tp": 2, "sp": True}
    (d / "manifest.json").write_text(json.dumps({"config": saved, "canonical_spec":
                                                 RunConfig().canonical_spec()}))
    with pytest.raises(ConfigError, match=r"\(--sp: from the resumed run's saved config; a "
                                          r"resume may set it again, e.g. --no-sp\)"):
        cli._resume_config({"resume": str(d), "tp": 1}, d)
    cfg = cli._resume_config({"resume": str(d), "tp": 1, "sp": False}, d)
    assert cfg.tp == 1 and not cfg.sp
    with pytest.raises(ConfigError) as e:     # the user's own --sp: no note
        cli._resume_config({"resume": str(d), "tp": 1, "sp": True}, d)
    assert "saved config" not in str(e.value)


def test_resume_may_change_enforce_eager(tmp_path):
    """--resume --enforce-eager is allowed (how decode runs, not what it computes), also for a
    run whose manifest predates the flag; a non-bool value is refused by name."""
    d = tmp_path / "r"
    d.mkdir()
    saved = RunConfig().to_dict()
    del saved["enforce_eager"]                               # a manifest from before the flag
    (d / "manifest.json").write_text(json.dumps({"config": saved, "canonical_spec":
                                                 RunConfig().canonical_spec()}))
    assert cli._resume_config({"resume": str(d), "enforce_eager": True}, d).enforce_eager
    assert not cli._resume_config({"resume": str(d)}, d).enforce_eager
    with pytest.raises(ConfigError, match="enforce.eager"):
        RunConfig(enforce_eager="yes")


def test_a_resume_can_turn_a_boolean_flag_off_again(tmp_path):
    """A run resumed with --enforce-eager (saved true) can be resumed with --no-enforce-eager:
    the --no- form parses to False and the resume applies it; flags a resume may not change
    have no --no- form."""
    d = tmp_path / "r"
    d.mkdir()
    saved = {**RunConfig().to_dict(), "enforce_eager": True, "recompute": True}
    (d / "manifest.json").write_text(json.dumps({"config": saved, "canonical_spec":
                                                 RunConfig().canonical_spec()}))
    ns = cli.build_parser().parse_args(["run", "--resume", str(d), "--no-enforce-eager",
                                        "--no-recompute"])
    given = {k: v for k, v in vars(ns).items() if k in {"resume", "enforce_eager", "recompute"}}
    assert given["enforce_eager"] is False and given["recompute"] is False
    cfg = cli._resume_config(given, d)
    assert not cfg.enforce_eager and not cfg.recompute
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "--no-require-updates"])


def test_settings_that_act_do_not_warn(capsys, cwd, loop):
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--clip-eps-high", "0.28", "--ppo-epochs",
                       "2", "--save-every", "2", "--steps", "2")
    assert code == 0 and "warning" not in err


def test_tensorboard_missing_is_a_usage_error(capsys, cwd, loop, monkeypatch):
    """--tensorboard without the package == exit 2 before any work, one line naming the fix."""
    import rlkernel.runner.metrics as metrics

    monkeypatch.setattr(metrics, "tensorboard_missing", lambda: "no module named 'tensorboard'")
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--tensorboard")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("rlk run: error: --tensorboard: ") and "rl-kernel[tensorboard]" in line
    assert list(cwd.iterdir()) == [] and loop.calls == []


def test_resume_cannot_extend_a_decaying_lr_schedule(capsys, cwd, loop):
    """--resume --steps N of a cosine run: refused (its LR horizon is the saved --steps)."""
    assert rlk(capsys, "run", "--allow-dirty", "--run-dir", "r", "--lr-schedule", "cosine")[0] == 0
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--resume", "r", "--steps", "4")
    assert code == 2
    assert "--lr-schedule cosine" in err and "--steps 4" in err and len(err.strip().splitlines()) == 1


def test_clip_ranges_that_can_act_are_accepted():
    """The edges of the clip ranges: a lower eps of 0 (clip at 1), an upper one above 1, and a
    --clip-eps >= 1 once --clip-eps-low takes the lower side (it is then the upper range only)."""
    for kw in ({"clip_eps_low": 0.0}, {"clip_eps_low": 0.999}, {"clip_eps_high": 5.0},
               {"clip_eps_high": 0.0}, {"clip_eps": 5.0, "clip_eps_low": 0.2},
               {"clip_eps": 0.999}):
        cfg = RunConfig(**kw)
        assert 1 - cfg.clip_low > 0 and cfg.clip_high >= 0


def test_optional_float_flags_parse_as_floats():
    """--clip-eps-low/high are `float | None` fields: the flag gives a float, absent keeps None."""
    args = cli.build_parser().parse_args(["run", "--clip-eps-high", "0.28"])
    assert args.clip_eps_high == 0.28 and not hasattr(args, "clip_eps_low")
    cfg = RunConfig(clip_eps=0.3, clip_eps_high=0.28)
    assert (cfg.clip_low, cfg.clip_high) == (0.3, 0.28)


@pytest.mark.parametrize("head_dim, refused", [(12, True), (8, True), (512, True), (16, False),
                                               (128, False)])
def test_cuda_refuses_a_head_dim_the_triton_attention_cannot_tile(tmp_path, head_dim, refused):
    """--device cuda with a model whose head_dim is not a power of two in [16, 256] is refused
    before any process starts, naming the flag, the value and the file; CPU accepts the model."""
    from rlkernel.model.config import tiny

    (tmp_path / "config.json").write_text(json.dumps(tiny().replace(head_dim=head_dim).to_hf_dict()))
    cli._check_topology(RunConfig(model=str(tmp_path)))
    cuda = RunConfig(model=str(tmp_path), device="cuda")
    if not refused:
        cli._check_topology(cuda)
        return
    with pytest.raises(ConfigError) as info:
        cli._check_topology(cuda)
    msg = str(info.value)
    assert msg.startswith(f"--device cuda: head_dim={head_dim} of {tmp_path}/config.json"), msg
    assert "allowed for this model: --device cpu" in msg


@pytest.mark.parametrize("change, words", [
    (dict(num_attention_heads=12, num_key_value_heads=4), "num_attention_heads=12 must be a multiple"),
    (dict(head_dim=5), "head_dim=5 must be even"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3 must divide num_attention_heads=8"),
])
def test_model_dir_with_a_shape_the_kernels_cannot_run_is_refused_before_any_process(
        capsys, tmp_path, change, words):
    """rlk run --model DIR whose config.json has a refused shape: exit 2 naming the file, the
    field and the value; no process starts and no run directory is made."""
    from rlkernel.model.config import tiny

    model = tmp_path / "m"
    model.mkdir()
    hf = tiny().to_hf_dict() | change
    (model / "config.json").write_text(json.dumps(hf))
    (model / "model.safetensors").write_bytes(b"")   # present: the shape is refused before it is read
    run_dir = tmp_path / "r"
    code, _, err = rlk(capsys, "run", "--model", str(model), "--allow-dirty", "--run-dir",
                       str(run_dir))
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"rlk run: error: --model {str(model)!r}: config.json: model config: "
                           f"{words}"), line
    assert not run_dir.exists()


# ---------------------------------------------------------------------------------------------
# upper bounds: a mistyped huge value is refused at once


FP = "3.4028234663852886e+38"   # FP32_MAX in full
FP32_LIMIT = (f"must be at most {FP}, the largest fp32 number (the losses, the optimizer and "
              "the sampler compute in fp32); allowed: ")


@pytest.mark.parametrize("flag,value,want", [
    # without --clip-eps-low, --clip-eps is the lower range too: (0, 1), not the fp32 limit
    ("--clip-eps", "1e39", "--clip-eps 1e+39: must be a number in (0, 1) while it is also the "
                           "lower clip range"),
    ("--clip-eps-high", "1e39", f"--clip-eps-high 1e+39: {FP32_LIMIT}[0, {FP}]"),
    ("--kl-coef", "3.5e38", f"--kl-coef 3.5e+38: {FP32_LIMIT}[0, {FP}]"),
    # the temperature's rule for small T says nothing of this limit (it read "... overflow to
    # inf) within the fp32 range")
    ("--temperature", "1e39", f"--temperature 1e+39: {FP32_LIMIT}[1e-06, {FP}]"),
    ("--lr", "1e39", f"--lr 1e+39: {FP32_LIMIT}(0, {FP}]"),
    # the limit in full: 3.4028235e+38 (8 digits) is beyond it
    ("--lr", "3.4028235e38", f"--lr 3.4028235e+38: {FP32_LIMIT}(0, {FP}]"),
    ("--steps", "99999999999999999999999", "--steps 99999999999999999999999: must be at most "
                                           "1,000,000"),
    ("--n-prompts", "1000000000", "--n-prompts 1000000000: must be at most 65,536"),
    ("--n-samples-per-prompt", "1000000000", "must be at most 4,096"),
    ("--ppo-epochs", "1000000000", "--ppo-epochs 1000000000: must be at most 1,024")])
def test_huge_values_are_refused_before_any_work(capsys, cwd, flag, value, want):
    """Values beyond fp32 (which the losses would overflow in step 0) and counts no run needs
    (which would exhaust memory preparing prompts) get one line and exit 2, no run directory."""
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r", flag, value)
    assert code == 2 and want in err and len(err.strip().splitlines()) == 1
    assert not (cwd / "r").exists()


@pytest.mark.parametrize("flag,value,zero_ok", [("--kl-coef", "1e-300", True),
                                                ("--entropy-coef", "1e-40", True),
                                                ("--lr", "1e-45", False)])
def test_values_that_fp32_would_make_0_are_refused_before_any_work(capsys, cwd, flag, value,
                                                                   zero_ok):
    """A nonzero coefficient below the smallest normal fp32 (1e-300 was 0 in the losses: a run
    that silently could not learn) gets one line and exit 2, naming the bound (and 0, where 0
    is allowed); no run directory."""
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r", flag, value)
    want = ("must be 0 or at least " if zero_ok else "must be at least ") + "1.1754943508222875e-38"
    assert code == 2 and f"{flag} {value}: {want}" in err and len(err.strip().splitlines()) == 1
    assert not (cwd / "r").exists()
    tiny = 1.1754943508222875e-38      # the bound itself is accepted
    assert RunConfig(lr=tiny, kl_coef=tiny, entropy_coef=tiny).kl_coef == tiny


def test_a_tiny_gpu_memory_fraction_is_refused_without_an_fp32_reason(capsys, cwd):
    """--gpu-memory-utilization 1e-400 / 1e-50: refused below the smallest normal fp32 like every
    float flag, but the message says what the flag is (a fraction of the free GPU memory), not
    that the losses compute it in fp32 (they never see it)."""
    for value in ("1e-400", "1e-50"):
        code, _, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r",
                           "--gpu-memory-utilization", value)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"--gpu-memory-utilization {value}: must be at least 1.1754943508222875e-38" in err
        assert "fraction of the free GPU memory" in err and "losses" not in err, err
    assert not (cwd / "r").exists()


# Every float flag and the interval its messages must name (the fp32 limit closes the unbounded
# ones; --clip-eps is (0, 1) while it is also the lower clip range).
FLOAT_FLAG_RANGES = {
    "--lr": f"(0, {FP}]", "--adam-eps": f"(0, {FP}]", "--temperature": f"[1e-06, {FP}]",
    "--kl-coef": f"[0, {FP}]", "--entropy-coef": f"[0, {FP}]", "--weight-decay": f"[0, {FP}]",
    "--clip-grad": f"[0, {FP}]", "--clip-eps-high": f"[0, {FP}]", "--clip-eps": "(0, 1)",
    "--top-p": "(0, 1]", "--gpu-memory-utilization": "(0, 1]", "--adam-beta1": "[0, 1)",
    "--adam-beta2": "[0, 1)", "--clip-eps-low": "[0, 1)",
}


def test_float_flag_ranges_list_every_float_field():
    """FLOAT_FLAG_RANGES covers every float (or float | None) field of RunConfig: a new float
    flag fails here until its nan/inf message is checked below."""
    hints = typing.get_type_hints(RunConfig)
    floats = {flag_name(f.name) for f in dataclasses.fields(RunConfig)
              if cli._unoptional(hints[f.name]) is float}
    assert floats == set(FLOAT_FLAG_RANGES)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999"])
@pytest.mark.parametrize("flag", sorted(FLOAT_FLAG_RANGES))
def test_every_float_flag_refuses_nan_and_inf_naming_flag_value_and_its_real_range(
        capsys, cwd, loop, flag, value):
    """`rlk run --FLAG nan|inf|-inf`: exit 2, one line naming the flag, the value as typed and
    the interval the flag really allows (--clip-eps nan said "> 0", but without --clip-eps-low
    only (0, 1) is allowed; --lr nan said "> 0" without the fp32 limit it also has)."""
    code, out, err = rlk(capsys, "run", "--allow-dirty", f"{flag}={value}")
    assert (code, out) == (2, "")
    (line,) = err.strip().splitlines()
    assert line.startswith(f"rlk run: error: {flag} {value}: must be "), line
    assert FLOAT_FLAG_RANGES[flag] in line, line
    assert list(cwd.iterdir()) == [] and loop.calls == []


@pytest.mark.parametrize("value,want", [
    ("nan", f"--clip-eps nan: must be a finite number > 0; allowed: (0, {FP}]"),
    ("0", f"--clip-eps 0.0: must be a finite number > 0; allowed: (0, {FP}]"),
    ("1e39", f"--clip-eps 1e+39: {FP32_LIMIT}(0, {FP}]")])
def test_clip_eps_with_clip_eps_low_names_its_upper_only_range(capsys, cwd, loop, value, want):
    """With --clip-eps-low, --clip-eps sets only the upper clip range: finite > 0 up to the fp32
    limit, and its refusals name that interval (not (0, 1)); 5 is accepted."""
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--clip-eps-low", "0.2", f"--clip-eps={value}")
    assert code == 2 and err.strip().splitlines() == [f"rlk run: error: {want}"], err
    assert RunConfig(clip_eps=5.0, clip_eps_low=0.2).clip_high == 5.0


def test_the_fp32_limit_itself_is_accepted():
    """The largest value the fp32 message allows is accepted, for every rule it closes (--lr
    with --adam-beta1 0, so that the first Adam step lr / (1 - beta1) is that value too)."""
    top = 3.4028234663852886e38
    cfg = RunConfig(lr=top, adam_beta1=0.0, kl_coef=top, temperature=top, clip_eps_high=top)
    assert (cfg.lr, cfg.kl_coef, cfg.temperature, cfg.clip_eps_high) == (top,) * 4


def test_prompts_per_run_are_bounded(capsys, cwd):
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r", "--steps", "100000",
                       "--n-prompts", "64")
    assert code == 2 and "6,400,000 prompts; at most 1,048,576" in err
    from rlkernel.config import RunConfig
    assert RunConfig(steps=16384, n_prompts=64).steps == 16384   # exactly 2**20: accepted


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_signals_wait_for_the_end_of_a_step_record(sig):
    """SIGINT, or SIGTERM/SIGHUP under `rlk run`'s handler (cli._exit_on_sigterm), inside
    _signals_deferred (recording a step and its checkpoint) is delivered when the block ends,
    not in the middle; outside it (the control) it interrupts at once."""
    import os
    import signal

    from rlkernel.cli import _exit_on_sigterm, _restore_sigterm
    from rlkernel.runner.loop import _signals_deferred
    # Ctrl-C's usual handler: a shell's background job may have left SIGINT ignored; and the
    # default for SIGTERM/SIGHUP, which `_exit_on_sigterm` leaves ignored when the process was
    # started so (a suite run under nohup ignores SIGHUP: that case is
    # tests/test_nohup.py's).
    before = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
              signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL),
              signal.SIGHUP: signal.signal(signal.SIGHUP, signal.SIG_DFL)}
    previous = _exit_on_sigterm()
    num = getattr(signal, sig)
    raised = KeyboardInterrupt if sig == "SIGINT" else SystemExit
    try:
        reached = []
        with pytest.raises(raised):
            with _signals_deferred():
                os.kill(os.getpid(), num)
                for _ in range(1000):   # bytecodes where a Python signal handler would run
                    reached.append(1)
                reached.append("end")
        assert reached[-1] == "end"
        reached.clear()
        with pytest.raises(raised):
            os.kill(os.getpid(), num)
            for _ in range(10**6):
                reached.append(1)
        assert len(reached) < 10**6
    finally:
        _restore_sigterm(previous)
        for n, handler in before.items():
            signal.signal(n, handler)


# ---------------------------------------------------------------------------------------------
# from a breaker pass: two spellings of one flag, the local world, huge microbatches


@pytest.mark.parametrize("argv, values", [
    (["--token-budget", "64", "--micro-batch-tokens", "128"], ("'128'", "'64'")),
    (["--micro-batch-tokens=128", "--token-budget=128"], ("'128'", "'128'"))])
def test_a_flag_and_its_alias_together_are_refused(capsys, cwd, loop, argv, values):
    """--token-budget is --micro-batch-tokens' old name: both given (even with equal values) is
    one line naming both with their values, exit 2, before any work (the last would silently
    win)."""
    code, out, err = rlk(capsys, "run", *argv)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"rlk run: error: --micro-batch-tokens {values[0]} and --token-budget {values[1]} set "
        "the same value (--micro-batch-tokens); give only one of them"]
    assert loop.calls == [] and list(cwd.iterdir()) == []


def test_more_local_ranks_than_the_machine_takes_are_refused(capsys, cwd, loop, monkeypatch):
    """`rlk run` spawns dp·tp·cp processes itself: beyond max_local_ranks (CPU: max(8, 4 ×
    cores)) it refuses up front, naming the world and the limit; at the limit it runs."""
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 2)
    code, _, err = rlk(capsys, "run", "--dp", "8", "--tp", "8", "--cp", "8")
    assert code == 2 and loop.calls == [] and list(cwd.iterdir()) == []
    assert ("--dp 8 × --tp 8 × --cp 8 = 512 ranks, but this machine has 2 CPU core(s): at most "
            "8 local ranks") in err
    assert rlk(capsys, "run", "--dp", "2", "--tp", "2", "--cp", "2", "--allow-dirty")[0] == 0
    assert len(loop.calls) == 1


def test_cuda_ranks_past_the_gpus_need_rlk_share_gpus(monkeypatch):
    """On CUDA one rank a GPU; RLK_SHARE_GPUS=1 (the validation mode) lets up to 8 ranks share
    each; any other value of it is refused naming the value and what is allowed."""
    import torch

    from rlkernel.distributed import launch
    from rlkernel.distributed.topology import SHARE_GPUS_ENV
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv(SHARE_GPUS_ENV, raising=False)
    two = RunConfig(device="cuda", tp=2)
    with pytest.raises(ConfigError) as e:
        cli._check_local_world(two)
    assert "2 ranks, but this machine has 1 CUDA device(s) visible, one rank each " \
           "(RLK_SHARE_GPUS=1 lets ranks share them" in str(e.value)
    assert launch.cuda_backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setenv(SHARE_GPUS_ENV, "1")
    cli._check_local_world(two)
    assert launch.cuda_backend() == "cpu:gloo,cuda:gloo"
    with pytest.raises(ConfigError, match=r"16 ranks, but this machine has 1 CUDA device\(s\) "
                       r"shared \(RLK_SHARE_GPUS=1\): at most 8 ranks each"):
        cli._check_local_world(RunConfig(device="cuda", tp=4, cp=4))
    monkeypatch.setenv(SHARE_GPUS_ENV, "yes")
    with pytest.raises(ConfigError, match=r"RLK_SHARE_GPUS='yes': allowed are 1 .* or 0 / unset"):
        cli._check_local_world(two)


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan", "inf", "1e30", "0.001", "1e6"])
def test_malformed_rlk_dist_timeout_s_is_refused_before_any_work(capsys, cwd, loop,
                                                                  monkeypatch, value):
    """RLK_DIST_TIMEOUT_S (every collective's bound) is checked with the flags: exit 2, one line
    naming it, its value and the allowed range, no run directory; a number inside the range (or
    nothing) runs."""
    from rlkernel.distributed.topology import DIST_TIMEOUT_ENV, dist_timeout_s
    monkeypatch.setenv(DIST_TIMEOUT_ENV, value)
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--tp", "2")
    assert code == 2, err
    assert err.strip().count("\n") == 0
    assert f"RLK_DIST_TIMEOUT_S={value!r}: must be a number of seconds in [1, 604800]" in err
    assert loop.calls == [] and list(cwd.iterdir()) == []
    monkeypatch.setenv(DIST_TIMEOUT_ENV, " 45.5 ")
    assert dist_timeout_s() == 45.5
    for edge in ("1", "604800"):   # both ends are allowed
        monkeypatch.setenv(DIST_TIMEOUT_ENV, edge)
        assert dist_timeout_s() == float(edge)
    monkeypatch.setenv(DIST_TIMEOUT_ENV, "")
    assert dist_timeout_s() == 300.0
    monkeypatch.delenv(DIST_TIMEOUT_ENV)
    assert dist_timeout_s() == 300.0
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--tp", "2")
    assert code == 0, err


def test_rlk_share_gpus_on_cpu_is_checked_warned_and_not_recorded(capsys, cwd, loop,
                                                                   monkeypatch):
    """On --device cpu a malformed RLK_SHARE_GPUS is refused too (exit 2, nothing written), a 1
    is one warning (CPU ranks are processes of their own) and the manifest does not say the
    GPUs were shared; a CUDA config's manifest does (build_manifest)."""
    from rlkernel.distributed.topology import SHARE_GPUS_ENV
    from rlkernel.runner import evidence as ev
    monkeypatch.setenv(SHARE_GPUS_ENV, "true")
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--tp", "2")
    assert code == 2 and "RLK_SHARE_GPUS='true': allowed are 1" in err
    assert loop.calls == [] and list(cwd.iterdir()) == []
    monkeypatch.setenv(SHARE_GPUS_ENV, "1")
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--tp", "2")
    assert code == 0, err
    (w,) = [ln for ln in err.splitlines() if ln.startswith("rlk run: warning: ")]
    assert "RLK_SHARE_GPUS=1 has no effect with --device cpu" in w
    manifest = json.loads((cwd / out.strip() / "manifest.json").read_text())
    assert "shared" not in manifest["versions"]["devices"]
    cuda = ev.build_manifest(RunConfig(device="cuda", tp=2), {})
    assert cuda["versions"]["devices"]["shared"] is True
    monkeypatch.setenv(SHARE_GPUS_ENV, "0")
    assert "shared" not in ev.build_manifest(RunConfig(device="cuda"), {})["versions"]["devices"]


def test_malformed_rlk_share_gpus_is_named_before_the_no_gpu_error(capsys, cwd, loop,
                                                                   monkeypatch):
    """--device cuda on a machine without a GPU and RLK_SHARE_GPUS='yes': the variable is named
    (the no-GPU error hid it: fixing that would only meet the variable's error next).
    Control: with the variable well formed, the no-GPU error is what is said."""
    import torch

    from rlkernel.distributed.topology import SHARE_GPUS_ENV
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(SHARE_GPUS_ENV, "yes")
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--device", "cuda")
    assert code == 2 and "RLK_SHARE_GPUS='yes': allowed are 1" in err, err
    monkeypatch.setenv(SHARE_GPUS_ENV, "1")
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--device", "cuda")
    assert code == 2 and "no CUDA device is available here" in err, err
    assert loop.calls == [] and list(cwd.iterdir()) == []


def test_micro_batch_tokens_has_an_upper_bound(capsys, cwd, loop):
    code, _, err = rlk(capsys, "run", "--micro-batch-tokens", str(2**31 + 1))
    assert code == 2 and "must be at most 2,147,483,648" in err and loop.calls == []


# ---------------------------------------------------------------------------------------------
# CLI input defects: negative numbers as separate argv items, a file as --run-dir, the
# microbatch limit blamed on the flag that was moved


@pytest.mark.parametrize("argv,want", [
    (["--lr", "-1e-5"], "--lr -1e-05: must be a finite number > 0"),
    (["--learning-rate", "-1e-5"], "--lr -1e-05: must be a finite number > 0"),
    (["--kl-coef", "-1e-3"], "--kl-coef -0.001: must be a finite number >= 0"),
    (["--temperature", "-1"], "--temperature -1.0: must be a finite number >= 1e-06"),
    (["--temperature", "-inf"], "--temperature -inf: must be a finite number >= 1e-06"),
    (["--clip-eps-low", "-2E+3"], "--clip-eps-low -2000.0: must be a number in [0, 1)"),
    (["--steps", "-1e5"], "--steps: '-1e5' is not an integer"),
])
def test_negative_number_as_its_own_argument_reaches_the_validator(capsys, cwd, loop, argv, want):
    """`--lr -1e-5` (two argv items) gets the same message as `--lr=-1e-5`, not argparse's
    "expected one argument" (its negative-number regex misses exponents, inf, nan)."""
    code, out, err = rlk(capsys, "run", "--allow-dirty", *argv)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"rlk run: error: {want}"), line
    assert list(cwd.iterdir()) == [] and loop.calls == []


FLOAT_FLAGS = [flag_name(f.name) for f in dataclasses.fields(RunConfig)
               if cli._unoptional(typing.get_type_hints(RunConfig)[f.name]) is float]


@pytest.mark.parametrize("flag", FLOAT_FLAGS)
@pytest.mark.parametrize("text", ["-nan", "NaN", "1e999", "-Infinity"])
def test_non_finite_value_is_echoed_as_typed(capsys, cwd, loop, flag, text):
    """`--top-p -nan` is refused as `--top-p -nan`, not `nan` (float's repr drops a NaN's sign
    and spelling, and shows 1e999 as inf); every float flag refuses every non-finite value."""
    code, out, err = rlk(capsys, "run", "--allow-dirty", flag, text)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"rlk run: error: {flag} {text}: must be "), line
    assert list(cwd.iterdir()) == [] and loop.calls == []


def test_negative_numbers_are_attached_to_value_flags_only():
    """Only a value flag takes the number; after `--` nothing is rewritten."""
    one = {"--lr"}
    assert cli._attach_negative_numbers(["--lr", "-1e-5", "--sp"], one) == ["--lr=-1e-5", "--sp"]
    assert cli._attach_negative_numbers(["--sp", "-1e-5"], one) == ["--sp", "-1e-5"]
    assert cli._attach_negative_numbers(["--lr", "-x"], one) == ["--lr", "-x"]
    assert cli._attach_negative_numbers(["--", "--lr", "-1"], one) == ["--", "--lr", "-1"]


@pytest.mark.parametrize("make,why", [
    (lambda p: p.write_text("x"), "is a file, not a directory"),
    (lambda p: (p.mkdir(), (p / "x").write_text("x")), "exists and is not an empty directory"),
])
def test_occupied_run_dir_says_what_is_there(capsys, cwd, loop, make, why):
    """--run-dir naming a file says it is a file (not "not an empty directory"); the file and
    everything else are left as they were."""
    make(cwd / "taken")
    before = sorted(p.name for p in cwd.rglob("*"))
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "taken")
    assert code == 2 and loop.calls == []
    assert err.strip().splitlines() == [
        f"rlk run: error: --run-dir 'taken': {why}; give a new or empty directory"]
    assert sorted(p.name for p in cwd.rglob("*")) == before


@pytest.mark.parametrize("target,why", [
    ("gone", "is a symbolic link to 'gone', which does not exist; give a new or empty "
             "directory, not a link"),
    ("empty", "is a symbolic link to 'empty'; give a new or empty directory (e.g. its target "
              "'{cwd}/empty'), not a link"),
    ("full", "is a symbolic link to 'full'; give a new or empty directory, not a link"),
])
def test_new_directory_that_is_a_symbolic_link_is_refused_before_any_work(capsys, cwd, loop,
                                                                          target, why):
    """--run-dir, init-model --out and export --out naming a symbolic link (dangling, or to a
    directory): one line, exit 2, before any work. The output is renamed into place, which
    cannot go through a link: it crashed at publish after the whole run, leaving RUN.tmp-<pid>."""
    (cwd / "empty").mkdir()
    (cwd / "full").mkdir()
    (cwd / "full" / "x").write_text("x")
    (cwd / "link").symlink_to(target)
    before = sorted(str(p) for p in cwd.rglob("*"))
    for argv, flag in ((("run", "--allow-dirty", "--run-dir", "link"), "--run-dir"),
                       (("init-model", "--preset", "tiny", "--out", "link"), "--out"),
                       (("export", "no-such-run", "--out", "link"), "--out")):
        code, out, err = rlk(capsys, *argv)
        assert (code, out) == (2, ""), argv
        assert err.strip().splitlines() == [
            f"rlk {argv[0]}: error: {flag} 'link': {why.format(cwd=cwd)}"], err
    assert loop.calls == [] and sorted(str(p) for p in cwd.rglob("*")) == before


def test_new_directories_under_a_file_name_the_file(capsys, cwd, loop):
    """--run-dir, init-model --out and export --out inside a path whose parent is a file: one
    line naming the flag, the value and the file, exit 2, before any work (it was a bare
    "[Errno 17] File exists" after the model was built); nothing is created."""
    (cwd / "f").write_text("x")
    want = ("'f/sub': cannot be created, 'f' is a file, not a directory; give a new or empty "
            "directory")
    for argv, flag in ((("run", "--allow-dirty", "--run-dir", "f/sub"), "--run-dir"),
                       (("init-model", "--preset", "tiny", "--out", "f/sub"), "--out"),
                       (("export", "no-such-run", "--out", "f/sub"), "--out")):
        code, out, err = rlk(capsys, *argv)
        assert (code, out) == (2, ""), argv
        assert err.strip().splitlines() == [f"rlk {argv[0]}: error: {flag} {want}"], err
    assert loop.calls == [] and sorted(p.name for p in cwd.iterdir()) == ["f"]


def test_init_model_out_naming_a_file_says_it_is_a_file(capsys, cwd):
    (cwd / "m").write_text("x")
    code, _, err = rlk(capsys, "init-model", "--preset", "tiny", "--out", "m")
    assert code == 2 and "--out 'm': is a file, not a directory" in err
    assert (cwd / "m").read_text() == "x"


def test_export_out_naming_a_file_says_it_is_a_file(capsys, cwd):
    """rlk export --out FILE: worded as --run-dir and init-model's --out (it said "exists and is
    not an empty directory"); checked before the run is read, the file left as it was."""
    (cwd / "m").write_text("x")
    code, out, err = rlk(capsys, "export", "no-such-run", "--out", "m")
    assert (code, out) == (2, "")
    assert err.strip().splitlines() == [
        "rlk export: error: --out 'm': is a file, not a directory; give a new or empty directory"]
    assert (cwd / "m").read_text() == "x"


@pytest.mark.parametrize("weights,tail", [
    (False, "of 'r' that kept weights"),
    (True, "of 'r' that kept weights; steps with weights: 1 (final)"),
])
@pytest.mark.parametrize("text", ["x", "0_1", "\u0661"])
def test_export_step_that_is_no_integer_names_the_flag_value_and_the_steps(capsys, cwd, weights,
                                                                          tail, text):
    """rlk export --step x: one line naming --step, the value and what is allowed (argparse said
    "invalid int value: 'x'"), with the run's steps that have weights when it has any; digit
    groups and non-ASCII digits, which int() reads (0_1 as 1), are no integer either."""
    if weights:   # what available_steps reads: final/rlk_weights.json
        (cwd / "r" / "final").mkdir(parents=True)
        (cwd / "r" / "final" / "rlk_weights.json").write_text('{"step": 1, "version": "v"}')
    code, out, err = rlk(capsys, "export", "r", "--step", text, "--out", "o")
    assert (code, out) == (2, "")
    assert err.strip().splitlines() == [
        f"rlk export: error: --step {text!r}: must be a non-negative integer, an evidence step "
        f"(counted from 0) {tail}"]
    assert not (cwd / "o").exists()


@pytest.mark.parametrize("argv,want", [
    # --micro-batch-tokens left at its default: the length given is what is too large
    (["--max-response-len", "100000"],
     "--max-response-len 100000: must be at most 3840 (--micro-batch-tokens 4096, its default, "
     "minus --max-prompt-len 256: one whole sample must fit in one microbatch); or raise "
     "--micro-batch-tokens to 100256 or more"),
    (["--max-prompt-len", "5000"], "--max-prompt-len 5000: must be at most 4032 "
                                   "(--micro-batch-tokens 4096, its default, minus "
                                   "--max-response-len 64"),
    (["--max-prompt-len", "5000", "--max-response-len", "100"],
     "--max-prompt-len 5000 + --max-response-len 100 = 5100: must be at most "
     "--micro-batch-tokens 4096, its default"),
    # beyond the budget's own upper bound, raising the budget is not offered
    (["--max-response-len", str(2**32)], "must be at most 3840 (--micro-batch-tokens 4096, its "
                                         "default, minus --max-prompt-len 256: one whole sample "
                                         "must fit in one microbatch)"),
    # a budget that was set too small is still the one named
    (["--max-response-len", "100000", "--micro-batch-tokens", "5000"],
     "--micro-batch-tokens 5000: must be >= --max-prompt-len + --max-response-len = 100256"),
])
def test_sample_longer_than_the_microbatch_names_the_flag_that_was_moved(argv, want):
    """The config's own message (RunConfig): on the command line the embedded tiny model's
    4,096 positions refuse these samples first (next test)."""
    kwargs = {argv[i][2:].replace("-", "_"): int(argv[i + 1]) for i in range(0, len(argv), 2)}
    with pytest.raises(ConfigError) as e:
        RunConfig(**kwargs)
    line = str(e.value)
    assert want in line, line
    if want.endswith("microbatch)"):
        assert line.endswith(want), line
    assert e.value.sample_tokens == (kwargs.get("max_prompt_len", 256),
                                     kwargs.get("max_response_len", 64))


@pytest.mark.parametrize("argv", [
    ["--max-response-len", "3900"],
    ["--max-response-len", "3900", "--micro-batch-tokens", "4156"],
    ["--max-response-len", "3900", "--micro-batch-tokens", "100"],
    ["--max-prompt-len", "4000", "--max-response-len", "200"],
    ["--max-prompt-len", "4096", "--max-response-len", "8", "--micro-batch-tokens", "5000"],
])
def test_a_sample_past_the_models_positions_says_so_before_the_microbatch(capsys, cwd, loop,
                                                                          argv):
    """A sample longer than --micro-batch-tokens and than the model's max_position_embeddings
    (4,096, the embedded tiny model): the model's limit is the error, since raising
    --micro-batch-tokens as the budget's message offered was refused next (found by a
    new-user trial). Exit 2, nothing made, no run."""
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r", *argv)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    p = int(argv[argv.index("--max-prompt-len") + 1]) if "--max-prompt-len" in argv else 256
    r = int(argv[argv.index("--max-response-len") + 1])
    allowed = f"--max-response-len {4096 - p} at most with --max-prompt-len {p}" if p < 4096 \
        else f"--max-prompt-len {4096 - r} at most with --max-response-len {r}"
    assert line == (f"rlk run: error: --max-prompt-len {p} + --max-response-len {r} = {p + r}: "
                    "must be <= max_position_embeddings=4096 of the embedded tiny model; "
                    f"allowed: {allowed}"), line
    assert list(cwd.iterdir()) == [] and loop.calls == []


def test_a_sample_within_the_models_positions_keeps_the_budget_message(capsys, cwd, loop):
    """Control: 256 + 3,900 tokens fit a model of 8,192 positions, so the budget's own message
    (and its offer to raise --micro-batch-tokens) stands."""
    model = cwd / "m"
    assert cli.main(["init-model", "--preset", "tiny", "--out", str(model)]) == 0
    conf = json.loads((model / "config.json").read_text())
    conf["max_position_embeddings"] = 8192
    (model / "config.json").write_text(json.dumps(conf))
    capsys.readouterr()
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r", "--model", str(model),
                         "--max-response-len", "3900")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.endswith("or raise --micro-batch-tokens to 4156 or more"), line
    assert not (cwd / "r").exists() and loop.calls == []


def test_a_sample_of_exactly_the_models_positions_is_accepted(capsys, cwd, loop):
    """--max-prompt-len 256 + --max-response-len 3840 = 4,096, exactly the embedded tiny
    model's max_position_embeddings (and the default --micro-batch-tokens): the run starts
    (exit 0); one token more (3,841, with --micro-batch-tokens 4097 so the budget fits) is exit
    2 naming the model's limit, nothing made. Found by mutation testing: refusing a sample that
    fills the model's positions exactly (`>=` for `>`) passed every test."""
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "ok", "--steps", "1",
                         "--max-response-len", "3840")
    assert code == 0, err
    assert len(loop.calls) == 1 and loop.calls[0][0].max_response_len == 3840
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--run-dir", "r", "--steps", "1",
                         "--max-response-len", "3841", "--micro-batch-tokens", "4097")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line == ("rlk run: error: --max-prompt-len 256 + --max-response-len 3841 = 4097: "
                    "must be <= max_position_embeddings=4096 of the embedded tiny model; "
                    "allowed: --max-response-len 3840 at most with --max-prompt-len 256"), line
    assert not (cwd / "r").exists() and len(loop.calls) == 1


# ---------------------------------------------------------------------------------------------
# --prompts: every problem with the file's content is one usage error, before any work

GOOD_LINE = '{"prompt": "Compute 1+1=", "label": "2"}\n'
FORMAT = 'each non-blank line must be one JSON object like {"prompt": "...", "label": "..."}'


def _parquet_bytes(columns: dict) -> bytes:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("name,content,want", [
    # line 1 was checked at start-up already (exit 2); line 2 only in the loop (exit 1, no prefix)
    ("p.jsonl", "{bad\n", "--prompts p.jsonl:1: invalid JSON (Expecting property name"),
    ("p.jsonl", GOOD_LINE + "{bad\n", "--prompts p.jsonl:2: invalid JSON (Expecting property "
                                      f"name enclosed in double quotes: line 1 column 2 (char "
                                      f"1)); {FORMAT}"),
    ("p.jsonl", "", f"--prompts p.jsonl: no prompts (the file is empty or only blank lines); "
                    f"{FORMAT}"),
    ("p.jsonl", "\n  \n", "--prompts p.jsonl: no prompts"),
    ("p.jsonl", '{"prompt": 5, "label": "1"}\n',
     f'--prompts p.jsonl:1: "prompt" must be a string, got a number; {FORMAT}'),
    ("p.jsonl", GOOD_LINE + '{"prompt": 5, "label": "1"}\n',
     f'--prompts p.jsonl:2: "prompt" must be a string, got a number; {FORMAT}'),
    ("p.jsonl", GOOD_LINE * 3 + '{"prompt": "x"}\n',
     f'--prompts p.jsonl:4: missing "label" (or "answer") (its keys: "prompt"); {FORMAT}'),
    ("p.jsonl", GOOD_LINE + "[1]\n", "--prompts p.jsonl:2: expected a JSON object, got an array"),
    ("p.jsonl", GOOD_LINE.encode() + b"\xff\n", "--prompts p.jsonl:2: invalid UTF-8"),
    # item 3: a name claiming the other format is said to be the mismatch
    ("fake.parquet", "hello\n", "--prompts fake.parquet: named .parquet but not a Parquet file "
                                "(no PAR1 header); give a Parquet file, or name a JSONL file "
                                ".jsonl"),
    ("fake.parquet", GOOD_LINE, "--prompts fake.parquet: named .parquet but not a Parquet file"),
    ("cut.parquet", "parquet-head", "--prompts cut.parquet: named .parquet but not a Parquet "
                                    "file (starts with PAR1 but does not end with it: truncated?); "
                                    "give the whole file"),
    ("p.jsonl", "parquet", "--prompts p.jsonl: named .jsonl but is a Parquet file (PAR1 magic at "
                           "both ends); name it .parquet, or give the JSONL file"),
    ("p.JSON", "parquet", "--prompts p.JSON: named .json but is a Parquet file"),
    ("bad.parquet", "parquet-bad-row", '--prompts bad.parquet: row 1: "prompt" must be a string, '
                                       "got null"),
])
def test_prompts_file_content_errors_are_one_usage_line_before_any_work(
        capsys, cwd, loop, name, content, want):
    """Whatever is wrong inside the --prompts file, and on whichever line: exit 2, one stderr
    line `--prompts FILE[:LINE]: what; allowed`, nothing written and the loop never entered
    (errors past line 1 were exit 1 with no --prompts prefix, after the model had loaded)."""
    if content == "parquet":
        content = _parquet_bytes({"prompt": ["a"], "label": ["1"]})
    elif content == "parquet-head":
        content = _parquet_bytes({"prompt": ["a"], "label": ["1"]})[:-10]
    elif content == "parquet-bad-row":
        content = _parquet_bytes({"prompt": ["a", None], "label": ["1", "2"]})
    (cwd / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--prompts", name)
    assert (code, out) == (2, "")
    (line,) = err.strip().splitlines()
    assert line.startswith(f"rlk run: error: {want}"), line
    assert [p.name for p in cwd.iterdir()] == [name] and loop.calls == []


def test_prompts_file_with_an_extension_of_neither_format_is_read_by_content(capsys, cwd, loop):
    """The content decides the format: Parquet named .pq and JSONL named .txt both run."""
    (cwd / "p.pq").write_bytes(_parquet_bytes({"prompt": ["a"], "label": ["1"]}))
    (cwd / "p.txt").write_text(GOOD_LINE)
    for name in ("p.pq", "p.txt"):
        code, _, err = rlk(capsys, "run", "--allow-dirty", "--prompts", name)
        assert code == 0, err
    assert len(loop.calls) == 2


def test_fewer_prompts_than_a_step_takes_is_warned(capsys, cwd, loop):
    """A 1-prompt file with --n-prompts 3 repeats the prompt three times in every step: one
    warning line says so (it ran without a word); 3 prompts for --n-prompts 3: no warning."""
    (cwd / "one.jsonl").write_text(GOOD_LINE)
    (cwd / "three.jsonl").write_text(GOOD_LINE * 3)
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--prompts", "one.jsonl",
                       "--n-prompts", "3")
    assert code == 0, err
    assert ("rlk run: warning: --prompts 'one.jsonl' holds 1 prompt(s), fewer than --n-prompts "
            "3: every step repeats some of them (the file's prompts cycle in order)") in err
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--prompts", "three.jsonl",
                       "--n-prompts", "3")
    assert code == 0 and "warning" not in err, err


@pytest.mark.parametrize("make,what", [
    (lambda p: p.mkdir(), "is a directory, not a file"),
    (lambda p: (p.mkdir(), (p / "prompts.jsonl").write_text(GOOD_LINE)),
     "is a directory, not a file"),
    (lambda p: None, "no such file"),
    (lambda p: p.symlink_to("gone.jsonl"),        # these two said "no such file"
     "is a symbolic link to 'gone.jsonl', which does not exist"),
    (lambda p: p.symlink_to(p.name), "is a symbolic link that cannot be followed (Too many "
                                     "levels of symbolic links)"),
    (lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file"),
])
def test_prompts_that_is_a_directory_is_named_as_one(capsys, cwd, loop, make, what):
    """--prompts DIR (which exists) said "no such file": now one line, exit 2, saying it is a
    directory and that a JSONL or Parquet prompts file is expected; nothing written."""
    make(cwd / "pd")
    before = sorted(p.name for p in cwd.rglob("*"))
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--prompts", "pd")
    assert (code, out) == (2, "")
    assert err.strip().splitlines() == [
        f"rlk run: error: --prompts 'pd': {what}; give a JSONL or Parquet prompts file, or leave "
        "out --prompts for the built-in arithmetic task"]
    assert sorted(p.name for p in cwd.rglob("*")) == before and loop.calls == []


# ---------------------------------------------------------------------------------------------
# --model: a directory without config.json or weights is a usage error, like a missing one

MODEL_EXPECTED = ("give a Hugging Face model directory with config.json and *.safetensors "
                  "weights, or leave out --model for the embedded tiny model")


@pytest.mark.parametrize("make,what", [
    (lambda d: None, "no such directory"),
    (lambda d: d.write_text("x"), "is a file, not a directory"),
    (lambda d: d.mkdir(), "is an empty directory"),
    (lambda d: (d.mkdir(), (d / "README.md").write_text("x")),
     "no config.json and no *.safetensors weights"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text("{}")), "no *.safetensors weights"),
    (lambda d: (d.mkdir(), (d / "model.safetensors").write_bytes(b"")), "no config.json"),
])
def test_model_dir_without_config_or_weights_is_a_usage_error(capsys, cwd, loop, make, what):
    """--model DIR that is missing, a file, empty, or lacks config.json or *.safetensors: exit 2,
    one line naming --model, the path and what a model directory holds, before any work (an
    empty directory was exit 1 from the checkpoint loader, without the flag)."""
    make(cwd / "m")
    before = sorted(p.name for p in cwd.rglob("*"))
    code, out, err = rlk(capsys, "run", "--allow-dirty", "--model", "m")
    assert (code, out) == (2, "")
    assert err.strip().splitlines() == [f"rlk run: error: --model 'm': {what}; {MODEL_EXPECTED}"]
    assert sorted(p.name for p in cwd.rglob("*")) == before and loop.calls == []


def _tiny_config_json(**change) -> str:
    from rlkernel.model.config import tiny
    return json.dumps(tiny().to_hf_dict() | change)


@pytest.mark.parametrize("files,rest", [
    (None, "no such directory;"),
    ({}, "is an empty directory;"),
    ({"model.safetensors": ""}, "no config.json;"),
    # refused by the shape check before any work (was "m/config.json: model config: ...",
    # without the flag)
    ({"config.json": _tiny_config_json(num_key_value_heads=3), "model.safetensors": ""},
     "config.json: model config: num_key_value_heads=3 must divide num_attention_heads=8"),
])
def test_every_model_error_starts_with_the_flag_and_its_value(capsys, cwd, loop, files, rest):
    """Every refusal of --model DIR is one line `--model 'DIR': what` (the file inside DIR
    named relative to it), whichever check finds it; exit 2, nothing written."""
    if files is not None:
        (cwd / "m").mkdir()
        for name, text in files.items():
            (cwd / "m" / name).write_text(text)
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--model", "m/")
    (line,) = err.strip().splitlines()
    assert code == 2 and line.startswith(f"rlk run: error: --model 'm/': {rest}"), line
    assert loop.calls == [] and not (cwd / "runs").exists()


@pytest.mark.parametrize("text,rest", [
    ("{", "config.json: not valid JSON (line 1, column 2"),
    ("[]", "config.json: top level is a JSON list; expected an object"),
])
def test_model_errors_of_the_checkpoint_loader_share_the_prefix(tmp_path, monkeypatch, text,
                                                                rest):
    """The checkpoint loader's refusals (found after the run starts) are worded as the CLI's:
    `--model 'DIR': FILE: what`, not `--model DIR/FILE: what`."""
    from rlkernel.runner.loop import InputError, _load_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(text)
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    with pytest.raises(InputError) as e:
        _load_model(RunConfig(model="m"))
    assert str(e.value).startswith(f"--model 'm': {rest}"), str(e.value)


def test_model_flag_error_names_files_relative_to_the_directory():
    from rlkernel.config import model_flag_error

    assert model_flag_error("a/m/", "a/m/config.json: bad") == "--model 'a/m/': config.json: bad"
    assert model_flag_error("a/m", "a/m: no *.safetensors file") == \
        "--model 'a/m': no *.safetensors file"
    # another directory sharing the prefix, or a message about something else, is kept whole
    assert model_flag_error("a/m", "a/m2/x: bad") == "--model 'a/m': a/m2/x: bad"
    assert model_flag_error("m", "cannot read m/x") == "--model 'm': cannot read m/x"


def test_model_seed_with_model_warns_one_line_and_runs(capsys, cwd, loop, tmp_path):
    """--model DIR --model-seed 5: the seed cannot act (it seeds the embedded model only); one
    warning line on stderr and the run goes on (it was silently ignored)."""
    from rlkernel.model.config import tiny

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny().to_hf_dict()))
    (model / "model.safetensors").write_bytes(b"")   # never read: the loop is stubbed
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--model", str(model), "--model-seed", "5")
    assert code == 0, err
    warnings = [ln for ln in err.splitlines() if ln.startswith("rlk run: warning: ")]
    assert warnings == ["rlk run: warning: --model-seed 5 is ignored with --model: it seeds only "
                        "the random weights of the embedded tiny model"], err
    assert len(loop.calls) == 1


@pytest.mark.parametrize("case", ["occupied-run-dir", "bad-prompts-line"])
def test_cheap_input_errors_come_before_torch_is_imported(tmp_path, case):
    """An occupied --run-dir and a bad --prompts line are refused before anything imports torch
    (seconds on a loaded machine): one exit-2 line, checked in a fresh interpreter."""
    if case == "occupied-run-dir":
        (tmp_path / "r").mkdir()
        (tmp_path / "r" / "x").write_text("")
        argv = ["run", "--allow-dirty", "--run-dir", str(tmp_path / "r")]
    else:
        (tmp_path / "p.jsonl").write_text('{"prompt": 5}\n')
        argv = ["run", "--allow-dirty", "--prompts", str(tmp_path / "p.jsonl"),
                "--run-dir", str(tmp_path / "new")]
    code = ("import sys; from rlkernel.cli import main; rc = main(sys.argv[1:]); "
            "print('torch' in sys.modules); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.strip() == "False", proc.stdout
    assert proc.stderr.count("rlk run: error: ") == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "new").exists()


def test_startup_summary_names_the_reward_in_use():
    """The start-up line's data names the reward that scores the prompts: the built-in exact
    match by default, with or without --prompts, and --reward's MODULE:FUNC when given."""
    from rlkernel.runner.loop import _describe_prompts
    assert _describe_prompts(RunConfig()) == "built-in arithmetic task (exact-match reward)"
    assert _describe_prompts(RunConfig(prompts="p.jsonl")) == "p.jsonl (exact-match reward)"
    assert _describe_prompts(RunConfig(prompts="p.jsonl", reward="/tmp/rw.py:score")) == \
        "p.jsonl (/tmp/rw.py:score reward)"


def test_a_run_that_cannot_be_moved_into_place_is_one_line_naming_where_it_is_kept(tmp_path,
                                                                                  capsys):
    """The finished run's directory cannot replace --run-dir (a file appeared in it meanwhile):
    `_publish_run` returns None, prints one line naming both paths, and leaves the run where it
    was built; a free --run-dir gets it."""
    from rlkernel import cli
    tmp, final = tmp_path / "r.tmp-1", tmp_path / "r"
    tmp.mkdir()
    (tmp / "evidence.json").write_text("{}")
    final.mkdir()
    (final / "userfile").write_text("x")
    assert cli._publish_run(tmp, final) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlk run: error: cannot move the run from")
    assert f"kept in {tmp}" in err[0]
    assert (tmp / "evidence.json").exists() and not (final / "evidence.json").exists()
    (final / "userfile").unlink()
    assert cli._publish_run(tmp, final) == final and (final / "evidence.json").exists()


def test_tokens_hash_covers_every_sampled_token_and_sample_id():
    """The step's tokens_hash changes when only the last token of the last sample, or a sample
    id, changes (evidence must not miss a sampled token)."""
    from types import SimpleNamespace

    from rlkernel.runner.loop import _tokens_hash
    base = [SimpleNamespace(sample_id=i, response_ids=[5, 6, 7 + i]) for i in range(3)]
    last = [SimpleNamespace(sample_id=c.sample_id, response_ids=list(c.response_ids))
            for c in base]
    last[-1].response_ids[-1] += 1
    ids = [SimpleNamespace(sample_id=c.sample_id, response_ids=c.response_ids) for c in base]
    ids[0].sample_id = 9
    h = _tokens_hash(base)
    assert len({h, _tokens_hash(last), _tokens_hash(ids)}) == 3
    assert _tokens_hash(list(base)) == h


def test_a_mount_point_run_dir_is_refused_before_any_work(tmp_path, monkeypatch):
    """An empty --run-dir that is a mount point cannot be replaced by the finished run (its
    rmdir is refused as busy): `_occupied` names it and the fix; another empty dir is free."""
    from rlkernel import cli
    d = tmp_path / "mnt"
    d.mkdir()
    assert cli._occupied("--run-dir", str(d)) is None
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(d) or real(p))
    msg = cli._occupied("--run-dir", str(d))
    assert msg is not None and "is a mount point" in msg and "inside it" in msg


# ---------------------------------------------------------------------------------------------
# from a breaker pass: float literals that parse to 0, -0, a flag given twice, control
# characters in the paths a command prints


@pytest.mark.parametrize("flag", FLOAT_FLAGS)
@pytest.mark.parametrize("text", ["1e-400", "-1e-400", "0.0001e-400"])
def test_a_nonzero_literal_that_float_reads_as_0_is_refused(capsys, cwd, loop, flag, text):
    """`--clip-grad 1e-400` (float() underflows it to 0.0: no clipping) is refused like
    `--clip-grad 1e-45`: one line naming the flag, the value as typed and what is allowed,
    exit 2, nothing made; it never becomes 0 (or -0) and turns a term off."""
    code, out, err = rlk(capsys, "run", "--allow-dirty", flag, text)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"rlk run: error: {flag} {text}: must be "), line
    assert list(cwd.iterdir()) == [] and loop.calls == []


@pytest.mark.parametrize("text,want", [
    ("1e-400", "--clip-grad 1e-400: must be 0 or at least 1.1754943508222875e-38"),
    ("-1e-400", "--clip-grad -1e-400: must be a finite number >= 0; allowed: [0, "),
])
def test_an_underflowing_clip_grad_says_what_is_allowed(capsys, cwd, loop, text, want):
    """The refusal of an underflowing value is RunConfig's message for the tiny value typed."""
    code, _, err = rlk(capsys, "run", "--allow-dirty", "--clip-grad", text)
    assert code == 2 and err.startswith(f"rlk run: error: {want}"), err


ZERO_ALLOWED_FLOAT_FLAGS = ["--kl-coef", "--entropy-coef", "--weight-decay", "--clip-grad",
                            "--adam-beta1", "--adam-beta2", "--clip-eps-low", "--clip-eps-high"]


def _parsed_config(*argv: str) -> RunConfig:
    args = cli.build_parser().parse_args(["run", *argv])
    names = {f.name for f in dataclasses.fields(RunConfig)}
    return RunConfig(**{k: v for k, v in vars(args).items() if k in names})


@pytest.mark.parametrize("flag", ZERO_ALLOWED_FLOAT_FLAGS)
@pytest.mark.parametrize("text", ["-0", "-0.0", "-0e5", "-.0"])
def test_minus_zero_is_the_config_of_zero(flag, text):
    """`--kl-coef -0` == `--kl-coef 0`: the field is +0.0 and the config hash is the same (it was
    -0.0, another hash, and rlk compare called the two runs two configurations)."""
    field = flag[2:].replace("-", "_")
    minus, plus = _parsed_config(flag, text), _parsed_config(flag, "0")
    assert math.copysign(1.0, getattr(minus, field)) == 1.0
    assert minus.to_dict() == plus.to_dict() and minus.fingerprint() == plus.fingerprint()


@pytest.mark.parametrize("flag", FLOAT_FLAGS)
def test_every_float_flag_reads_minus_zero_as_plus_zero(flag):
    """`rlk run FLAG -0` parses to +0.0 for every float flag (one that refuses 0 refuses it as 0)."""
    value = getattr(cli.build_parser().parse_args(["run", flag, "-0"]), flag[2:].replace("-", "_"))
    assert value == 0.0 and math.copysign(1.0, value) == 1.0


def test_runs_of_kl_coef_0_and_minus_0_are_one_configuration(capsys, cwd, loop):
    """rlk compare of `--kl-coef 0` and `--kl-coef -0` notes no difference of configuration."""
    for name, value in (("a", "0"), ("b", "-0")):
        assert rlk(capsys, "run", "--allow-dirty", "--run-dir", name, "--kl-coef", value)[0] == 0
    code, out, _ = rlk(capsys, "compare", "a", "b")
    assert "differ in configuration" not in out and code == 0, out


@pytest.mark.parametrize("argv,want", [
    (["--lr", "1e-3", "--lr", "1e-4"], "--lr given twice, '1e-3' and '1e-4'"),
    (["--lr=1e-3", "--lr", "-1e-4"], "--lr given twice, '1e-3' and '-1e-4'"),
    (["--steps", "2", "--allow-dirty", "--steps=3"], "--steps given twice, '2' and '3'"),
    (["--run-dir", "a", "--run-dir", "b"], "--run-dir given twice, 'a' and 'b'"),
    (["--dtype", "bf16", "--dtype", "fp32"], "--dtype given twice, 'bf16' and 'fp32'"),
    (["--learning-rate", "1e-3", "--learning-rate", "1e-4"],
     "--learning-rate given twice, '1e-3' and '1e-4'"),
    (["--tp", "2", "--sp", "--no-sp"], "--no-sp and --sp set the same value (--sp)"),
])
def test_a_flag_given_twice_with_two_values_is_refused(capsys, cwd, loop, argv, want):
    """`--lr 1e-3 --lr 1e-4` (the last silently won) is one line naming both values, exit 2,
    before any work, as a flag and its alias are; so is --sp with --no-sp."""
    code, out, err = rlk(capsys, "run", "--allow-dirty", *argv)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"rlk run: error: {want}"), line
    assert loop.calls == [] and list(cwd.iterdir()) == []


@pytest.mark.parametrize("argv,want", [
    (["init-model", "--preset", "tiny", "--preset", "qwen3-8b", "--out", "m"],
     "rlk init-model: error: --preset given twice, 'tiny' and 'qwen3-8b'"),
    (["export", "r", "--step", "0", "--step", "1", "--out", "x"],
     "rlk export: error: --step given twice, '0' and '1'"),
    (["report", "r", "--out", "a", "--out", "b"],
     "rlk report: error: --out given twice, 'a' and 'b'"),
])
def test_every_command_refuses_a_flag_given_twice_with_two_values(capsys, cwd, argv, want):
    """Not only rlk run: `init-model --preset tiny --preset qwen3-8b` silently wrote a 16 GB
    qwen3-8b model, `export --step 0 --step 1` exported step 1, `report --out a --out b` wrote
    b. One line, exit 2, nothing made."""
    code, out, err = rlk(capsys, *argv)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(want), line
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("argv,field,value", [
    (["--lr", "1e-3", "--lr", "1e-3"], "lr", 1e-3),
    (["--lr", "1e-3", "--lr=0.001"], "lr", 1e-3),
    (["--kl-coef", "0", "--kl-coef", "-0"], "kl_coef", 0.0),
    (["--steps", "3", "--steps", "03"], "steps", 3),
    (["--tp", "2", "--sp", "--sp"], "sp", True),
])
def test_a_flag_given_twice_with_one_value_is_that_value(capsys, cwd, loop, argv, field, value):
    """A flag repeated with the same value (as typed, or as the number it reads as) runs with it."""
    code, _, err = rlk(capsys, "run", "--allow-dirty", *argv)
    assert code == 0, err
    assert getattr(loop.calls[0][0], field) == value


CONTROL_CHARS = ["\n", "\r", "\t", "\x1b", "\x7f", "\x85", "\u2028"]


@pytest.mark.parametrize("char", CONTROL_CHARS, ids=repr)
@pytest.mark.parametrize("argv,flag", [
    (["run", "--allow-dirty", "--run-dir", "a{c}b"], "--run-dir"),
    (["run", "--allow-dirty", "--resume", "a{c}b"], "--resume"),
    (["init-model", "--preset", "tiny", "--out", "a{c}b"], "--out"),
    (["export", "no-such-run", "--out", "a{c}b"], "--out"),
    (["report", "no-such-run", "--out", "a{c}b"], "--out"),
])
def test_a_path_the_command_prints_with_a_control_character_is_refused(capsys, cwd, loop, char,
                                                                       argv, flag):
    """--run-dir 'a\\nb' (its result line on stdout became two lines) is refused before any
    work: exit 2, stdout empty, one stderr line naming the flag, the path quoted and the
    character; so is every path a command writes and prints (--resume, --out)."""
    argv = [a.format(c=char) for a in argv]
    code, out, err = rlk(capsys, *argv)
    assert (code, out) == (2, "")
    (line,) = err.strip().split("\n")
    assert line.startswith(f"rlk {argv[0]}: error: {flag} {'a' + char + 'b'!r}: has the "), line
    assert f" {char!r}; rlk prints this path as one line of its output" in line, line
    assert loop.calls == [] and list(cwd.iterdir()) == []


def test_an_unwritable_default_run_dir_says_it_is_the_default(tmp_path, monkeypatch, capsys):
    """`rlk run` without --run-dir from a directory where nothing can be made (/proc): the error
    names --run-dir's default and the current directory (it named a --run-dir the user never
    gave; found by a breaker). Control: a given --run-dir there is named plainly."""
    monkeypatch.chdir("/proc")
    assert cli.main(["run", "--steps", "1", "--allow-dirty"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rlk run: error: --run-dir 'runs/") and \
        "(the default, under the current directory '/proc'): cannot create its lock file" \
        in line, line
    assert cli.main(["run", "--steps", "1", "--allow-dirty", "--run-dir", "given/r"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rlk run: error: --run-dir 'given/r'") and "default" not in line, line


def test_the_current_directory_gone_is_left_out_of_the_default_run_dir_message(monkeypatch):
    """A current directory that was removed (getcwd fails): the lock message leaves it out
    instead of failing with a traceback."""
    def gone():
        raise FileNotFoundError(2, "No such file or directory")
    assert cli._cwd_shown() == f" {os.getcwd()!r}"
    monkeypatch.setattr(os, "getcwd", gone)
    assert cli._cwd_shown() == ""
