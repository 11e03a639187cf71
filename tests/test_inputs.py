"""What a run reads, recorded in its manifest (rlkernel/runner/inputs.py), and two kinds of input
end to end: a padded vocabulary (a tokenizer with fewer ids than the model's embedding rows, as
every real Qwen3 checkpoint: 151,669 of 151,936) and an fp16 checkpoint under the default bf16.

Chain for the padded vocabulary: the ids past the tokenizer get probability 0 in rollout and
trainer (tests/test_kernels_logprobs.py, tests/test_rollout.py), so a run on such a model never
samples an id the tokenizer cannot decode (it used to stop with "token id N is outside the vocab
of .../tokenizer.json"), has 0 train/rollout mismatches, and TP1 == TP2 (`rlk compare`).

Run: `.venv/bin/python -m pytest -q tests/test_inputs.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from rlkernel.cli import main
from rlkernel.config import ConfigError, RunConfig
from rlkernel.model.checkpoint import init_weights, save_checkpoint
from rlkernel.model.config import tiny
from rlkernel.runner.inputs import (VOCAB_RULE, check_unchanged, describe_inputs,
                                    read_twice_problem, startup_notes)

VOCAB, TOKENIZER_IDS = 512, 301
SMALL = ["--n-prompts", "2", "--n-samples-per-prompt", "2", "--max-response-len", "12",
         "--steps", "1", "--kl-coef", "0.01", "--allow-dirty"]


def _padded_model(d, dtype=torch.float16):
    """A tiny Qwen3 with 512 embedding rows, stored in `dtype`, and a tokenizer.json of 301 ids
    (300 words, then <|endoftext|> = 300): ids 301..511 are padding."""
    words = ["[UNK]", *"0123456789", "+", "-", "*", "=", "?", "What", "is"]
    words += [f"w{i}" for i in range(300 - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    cfg = dataclasses.replace(tiny(), vocab_size=VOCAB, eos_token_id=300)
    save_checkpoint(d, cfg, init_weights(cfg, 0, dtype=dtype))
    tok.save(str(d / "tokenizer.json"))
    return d


def test_describe_inputs_hashes_files_and_records_vocab_and_rounding(tmp_path):
    """files: SHA-256 of config.json, model.safetensors, tokenizer.json and the prompts file;
    vocab: 512 rows, 301 tokenizer ids, 211 masked, the rule; weights: float16 stored, rounded
    under bf16 (one start-up note naming it), exact under fp32 (no note)."""
    model = _padded_model(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "What is 1 + 1 ?", "label": "2"}\n')
    cfg = RunConfig(model=str(model), prompts=str(prompts))
    got = describe_inputs(cfg, dataclasses.replace(tiny(), vocab_size=VOCAB, eos_token_id=300))
    paths = [model / "config.json", model / "model.safetensors", model / "tokenizer.json", prompts]
    assert got["files"] == {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
    assert got["vocab"] == {"model_vocab_size": VOCAB, "tokenizer": f"hf:{model / 'tokenizer.json'}",
                            "tokenizer_ids": TOKENIZER_IDS, "masked_ids": VOCAB - TOKENIZER_IDS,
                            "rule": VOCAB_RULE}
    assert got["weights"] == {"stored_dtypes": ["float16"], "dtype": "bfloat16", "rounded": True}
    (note,) = startup_notes(cfg, got)
    assert "float16" in note and "--dtype bf16 rounds them to bfloat16" in note
    fp32 = dataclasses.replace(cfg, dtype="fp32")
    got32 = describe_inputs(fp32, None)
    assert got32["weights"]["rounded"] is False and got32["vocab"] is None
    assert startup_notes(fp32, got32) == []


def test_describe_inputs_of_the_embedded_model_reads_no_file():
    got = describe_inputs(RunConfig(), tiny())
    assert got["files"] == {} and got["weights"]["rounded"] is False
    assert got["vocab"]["masked_ids"] == 0 and got["vocab"]["tokenizer"] == "bytes"


@pytest.mark.parametrize("recorded, words", [
    ({"files": {"a": "1" * 64, "b": "2" * 64}}, "input a changed since the run started"),
    ({"files": {"b": "2" * 64}}, "input a was not there when the run started"),
    ({"files": {"a": "0" * 64, "b": "2" * 64, "c": "3" * 64}}, "input c is gone"),
    (None, "records no input hashes"),
    ({"files": []}, "records no input hashes"),
])
def test_check_unchanged_names_the_file(recorded, words):
    now = {"files": {"a": "0" * 64, "b": "2" * 64}}
    check_unchanged({"files": dict(now["files"])}, now, "r")
    with pytest.raises(ConfigError, match=words):
        check_unchanged(recorded, now, "r")


def test_padded_vocab_fp16_model_runs_notes_rounding_and_is_topology_invariant(tmp_path, capsys):
    """rlk run on the padded fp16 model: exit 0 (no id >= 301 sampled: every response is decoded
    for its reward), 0 logprob mismatches over every compared token, one start-up note line about
    the fp16 -> bf16 rounding before the first step, the manifest's vocab and weights records;
    the same run at --tp 2 --rollout-tp 2 is IDENTICAL."""
    model = _padded_model(tmp_path / "m")
    a, b = tmp_path / "tp1", tmp_path / "tp2"
    assert main(["run", *SMALL, "--model", str(model), "--run-dir", str(a)]) == 0
    err = capsys.readouterr().err.splitlines()
    notes = [ln for ln in err if ln.startswith("rlk run: note:")]
    assert len(notes) == 1 and "float16" in notes[0] and err.index(notes[0]) == 0, err
    manifest = json.loads((a / "manifest.json").read_text())
    assert manifest["inputs"]["vocab"]["masked_ids"] == VOCAB - TOKENIZER_IDS
    assert manifest["inputs"]["weights"]["rounded"] is True
    (step,) = json.loads((a / "evidence.json").read_text())["steps"]
    assert step["logprob_mismatches"] == 0
    assert step["logprob_tokens"] == step["n_response_tokens"] > 0

    assert main(["run", *SMALL, "--model", str(model), "--tp", "2", "--rollout-tp", "2",
                 "--run-dir", str(b)]) == 0
    capsys.readouterr()
    assert main(["compare", str(a), str(b)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("IDENTICAL")


def test_input_paths_are_absolute_and_outside_the_config(tmp_path, monkeypatch):
    """input_paths of --model m --prompts p.jsonl --reward r.py:score typed in WD == the
    absolute paths, a symbolic link resolved (the reward keeps :score); a MODULE:FUNC reward
    and left-out inputs as given; the config (and its hash) keep the typed paths, so runs typed
    alike from two directories have one configuration. located() puts the recorded paths in,
    relocated() keys the recorded file hashes as describe_inputs(located) does, and a
    malformed or incomplete record is refused naming the key."""
    from rlkernel.runner.inputs import input_paths, located, recorded_paths, relocated

    wd = tmp_path / "wd"
    (wd / "real").mkdir(parents=True)
    (wd / "m").symlink_to(wd / "real")
    monkeypatch.chdir(wd)
    cfg = RunConfig(model="m", prompts="p.jsonl", reward="r.py:score")
    paths = input_paths(cfg)
    assert paths == {"model": str(wd / "real"), "prompts": str(wd / "p.jsonl"),
                     "reward": f"{wd / 'r.py'}:score"}
    assert input_paths(RunConfig(reward="my_rewards:score")) == {
        "model": None, "prompts": None, "reward": "my_rewards:score"}
    assert cfg.to_dict()["model"] == "m"
    monkeypatch.chdir(tmp_path)
    assert RunConfig(model="m", prompts="p.jsonl", reward="r.py:score").fingerprint() == \
        cfg.fingerprint()

    where = located(cfg, recorded_paths({"input_paths": paths}))
    assert (where.model, where.prompts, where.reward) == tuple(paths.values())
    assert located(cfg, recorded_paths({})) is cfg
    recorded = {"files": {"m/config.json": "a", "p.jsonl": "b"}, "vocab": None}
    assert relocated(recorded, cfg, where) == {
        "files": {str(wd / "real" / "config.json"): "a", str(wd / "p.jsonl"): "b"}, "vocab": None}
    for bad in ({"model": 3}, {"model": str(wd), "prompts": None},
                {**paths, "tokenizer": None}, {**paths, "model": ""}, [str(wd)]):
        with pytest.raises(ValueError, match="manifest.json input_paths"):
            recorded_paths({"input_paths": bad})
    with pytest.raises(ValueError, match="records no prompts path"):
        located(cfg, {**paths, "prompts": None})


def _reads(prompts_sha: str | None, reward_sha: str = "r") -> dict:
    return {"prompts": {"source": "p.jsonl", "count": 1, "sha256": prompts_sha},
            "reward": {"source_file": "/x/rw.py", "source_sha256": reward_sha}}


def test_read_twice_problem_names_the_changed_file_and_the_rank():
    """The loop's reads against rlk run's start read, every rank held to rank 0's record: the
    same bytes -> None; prompts or reward changed -> the flag, file and both hashes; one rank
    of two reading other bytes -> that rank, even when no rank has the start's record (a
    torchrun follower without it)."""
    cfg = RunConfig(prompts="p.jsonl")
    a, b = "a" * 64, "b" * 64
    assert read_twice_problem(cfg, [(_reads(a), _reads(a))]) is None
    assert read_twice_problem(cfg, [(_reads(a), _reads(a)), (_reads(a), None)]) is None
    why = read_twice_problem(cfg, [(_reads(b), _reads(a))])
    assert why.startswith("--prompts 'p.jsonl': the file changed while the run was starting "
                          f"(SHA-256 {a[:12]}… when rlk run checked it, {b[:12]}… when the loop "
                          "read it)"), why
    why = read_twice_problem(cfg, [(_reads(a), _reads(a)), (_reads(b), _reads(a))])
    assert f"{b[:12]}… when the loop read it on rank 1)" in why, why
    why = read_twice_problem(cfg, [(_reads(a), None), (_reads(b), None)])
    assert why.startswith(f"--prompts 'p.jsonl': the file changed while the run was starting "
                          f"({b[:12]}… when the loop read it on rank 1)"), why
    why = read_twice_problem(cfg, [(_reads(a, "r2"), _reads(a))])
    assert why.startswith("--reward '/x/rw.py': the file changed"), why


def test_a_prompts_file_replaced_while_the_model_loads_is_refused(tmp_path, monkeypatch, capsys):
    """The --prompts file swapped after rlk run checked and hashed it, while the loop loads the
    model (seconds; minutes for a real checkpoint): exit 2 naming the file, nothing kept. It
    trained on the new prompts with the old file's hash in the manifest, exit 0, and `rlk
    compare` then reported differing tokens as if the run were not reproducible. Control: the
    same run without the swap completes."""
    from rlkernel.runner import loop
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    load = loop._load_model

    def swap_then_load(cfg):
        prompts.write_text('{"prompt": "0*7=", "label": "0"}\n')
        return load(cfg)

    args = ["run", "--steps", "1", "--max-response-len", "4", "--n-prompts", "1",
            "--n-samples-per-prompt", "2", "--prompts", str(prompts), "--allow-dirty"]
    monkeypatch.setattr(loop, "_load_model", swap_then_load)
    assert main([*args, "--run-dir", str(tmp_path / "swapped")]) == 2
    err = capsys.readouterr().err
    assert f"--prompts {str(prompts)!r}: the file changed while the run was starting" in err, err
    assert not (tmp_path / "swapped").exists()
    monkeypatch.setattr(loop, "_load_model", load)
    assert main([*args, "--run-dir", str(tmp_path / "kept")]) == 0
    manifest = json.loads((tmp_path / "kept" / "manifest.json").read_text())
    assert manifest["prompts"] == {"source": str(prompts), "count": 1,
                                   "sha256": hashlib.sha256(prompts.read_bytes()).hexdigest()}


def _prompts_file_run(tmp_path, *extra: str) -> tuple[list[str], pathlib.Path]:
    """`rlk run` arguments of a 1-step run on a 2-prompt file (written), and that file."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": "4"}\n')
    return ["run", "--steps", "1", "--max-response-len", "4", "--n-prompts", "2",
            "--n-samples-per-prompt", "2", "--prompts", str(prompts), "--allow-dirty",
            "--run-dir", str(tmp_path / "r"), *extra], prompts


def test_the_loop_refuses_another_ranks_different_read(tmp_path, monkeypatch, capsys):
    """The reads are gathered over the ranks: a second rank (simulated in the gather) that read
    other bytes than rank 0 is named, exit 2 — a loop that checked only its own read let each
    rank train on its own file. (From a mutation helper: skipping the gather passed.)"""
    from rlkernel.distributed import topology
    real = topology.single_comms

    def with_a_second_rank():
        comms = real()
        gather = comms.world.all_gather_object

        def gather_plus_one(obj, op):
            got = gather(obj, op)
            if op == "inputs-read":
                now, then = obj
                got = [*got, ({**now, "prompts": {**now["prompts"], "sha256": "f" * 64}}, then)]
            return got
        comms.world.all_gather_object = gather_plus_one
        return comms

    monkeypatch.setattr(topology, "single_comms", with_a_second_rank)
    args, _ = _prompts_file_run(tmp_path)
    assert main(args) == 2
    assert "f" * 12 + "… when the loop read it on rank 1)" in capsys.readouterr().err


def test_spawned_ranks_hold_their_reads_to_the_start(tmp_path, monkeypatch, capsys):
    """--dp 2: the prompts file replaced after rlk run read it and before the ranks start: the
    ranks' reads differ from the start's and the run is refused (the read reached the spawned
    ranks; without it they held each other only and ran, exit 0). Control: the same run with
    the file left alone completes."""
    import rlkernel.distributed.launch as launch_mod
    args, prompts = _prompts_file_run(tmp_path, "--dp", "2")
    real = launch_mod.launch

    def swap_then_launch(*a, **k):
        prompts.write_text('{"prompt": "0*7=", "label": "0"}\n{"prompt": "2+2=", "label": "4"}\n')
        return real(*a, **k)

    monkeypatch.setattr(launch_mod, "launch", swap_then_launch)
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and "the file changed while the run was starting" in err, (code, err)
    assert not (tmp_path / "r").exists()
    monkeypatch.setattr(launch_mod, "launch", real)
    assert main(args) == 0


def test_a_torchrun_follower_holds_its_reads_to_its_start(monkeypatch):
    """A non-zero torchrun rank runs the loop with what its own rlk run read at start."""
    from rlkernel import cli
    from rlkernel.runner import loop
    seen = {}
    monkeypatch.setattr(loop, "run_loop",
                        lambda cfg, run_dir, writer, read=None: seen.setdefault("read", read))
    manifest = {"prompts": {"source": "p.jsonl", "count": 1, "sha256": "a" * 64},
                "reward": {"source_file": None, "source_sha256": None}}
    assert cli._run_follower_rank(RunConfig(), manifest) == 0
    assert seen["read"] == {"prompts": manifest["prompts"], "reward": manifest["reward"]}
