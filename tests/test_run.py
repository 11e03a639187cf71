"""End-to-end tests of `rlk run` / `rlk compare` / `rlk init-model` (issue 2, "Acceptance").

Each test drives the real command line: `rlkernel.cli.main([...])` in-process (fast; output via
capsys), and the installed `rlk` console script in a subprocess for the acceptance command itself
(so its wall time includes start-up and imports, as a user would see it). Every run passes
`--allow-dirty` (the test checkout may have uncommitted changes) and a `--run-dir` under
tmp_path. Runs other than the acceptance command are kept small (2 prompts x 2 samples, 16
response tokens) so the file takes well under a minute on 2 cores.

Run: `.venv/bin/python -m pytest -q tests/test_run.py`.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import time

import pytest

from rlkernel.cli import main

ACCEPTANCE_FLAGS = ["--steps", "2", "--require-updates", "--temperature", "0.7", "--top-p", "0.95",
                    "--max-response-len", "64", "--kl-coef", "0.01"]
SMALL = ["--n-prompts", "2", "--n-samples-per-prompt", "2", "--max-response-len", "16"]
"""Small runs: 4 samples of at most 16 tokens per step."""
STEP_KEYS = {"step", "grad_norm", "grad_norm_hex", "grad_nonfinite", "update_skipped", "version",
             "tensor_hashes", "weight_audit", "version_changed", "tokens_hash", "n_samples",
             "n_response_tokens", "logprob_mismatches", "logprob_tokens", "rewards", "reward_mean",
             "loss", "pg_loss", "kl", "entropy", "timings"}
"""Keys DESIGN.md §4 and issue 2 ask of every step record (EvidenceWriter.record_step)."""
TIMING_KEYS = {"rollout_s", "train_s", "export_audit_s", "step_s"}


# ---------------------------------------------------------------------------------------------
# helpers


def rlk_run(run_dir: pathlib.Path, *flags: str) -> int:
    """`rlk run FLAGS --allow-dirty --run-dir RUN_DIR` in-process; returns the exit code."""
    return main(["run", *flags, "--allow-dirty", "--run-dir", str(run_dir)])


def load(run_dir: pathlib.Path) -> tuple[dict, dict]:
    """(manifest, evidence) of a finished run directory."""
    manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    evidence = json.loads((run_dir / "evidence.json").read_text(encoding="utf-8"))
    return manifest, evidence


def check_complete_evidence(evidence: dict, steps: int, *, invariant: bool = True) -> None:
    """`steps` complete step records with the §4 fields; audit ok; 0 mismatches if invariant."""
    assert evidence["complete"] is True
    init = evidence["init"]
    assert isinstance(init, dict), "no init record"
    assert isinstance(init["version"], str) and len(init["version"]) == 64
    assert init["tensor_hashes"] and all(len(h) == 64 for h in init["tensor_hashes"].values())
    assert init["weight_audit"]["ok"] is True
    assert [s["step"] for s in evidence["steps"]] == list(range(steps))
    for s in evidence["steps"]:
        missing = STEP_KEYS - set(s)
        assert not missing, f"step {s['step']} lacks {sorted(missing)}"
        assert TIMING_KEYS <= set(s["timings"])
        assert s["weight_audit"] == {"ok": True, "problems": []}
        assert s["update_skipped"] is False and s["grad_nonfinite"] == []
        assert isinstance(s["grad_norm"], float) and math.isfinite(s["grad_norm"])
        assert s["grad_norm_hex"] == s["grad_norm"].hex()
        assert set(s["tensor_hashes"]) == set(init["tensor_hashes"])
        assert isinstance(s["logprob_tokens"], int) and s["logprob_tokens"] > 0
        assert len(s["rewards"]) == s["n_samples"]
        if invariant:
            assert s["logprob_mismatches"] == 0, f"step {s['step']}: train/rollout logprobs differ"


def assert_no_run_dir(root: pathlib.Path, run_dir: pathlib.Path) -> None:
    """Nothing of the run is left: neither the run dir nor a `*.tmp-*` sibling, nor any parent
    directory that `rlk run` created for it (everything under `root` was made by the run)."""
    assert not run_dir.exists(), f"{run_dir} left behind"
    if run_dir.parent.exists():
        assert not list(run_dir.parent.glob("*.tmp-*")), f"temp run dir left next to {run_dir}"
    assert not root.exists(), f"{root} left behind: {sorted(map(str, root.rglob('*')))}"
    assert not list(root.parent.glob("*.tmp-*"))


def write_prompts(path: pathlib.Path, lines: list[str]) -> pathlib.Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


GOOD_PROMPTS = ['{"prompt": "Compute 1+1=", "label": "2"}',
                '{"prompt": "Compute 2*3=", "answer": 6}']


# ---------------------------------------------------------------------------------------------
# 1. the acceptance command, through the installed console script


def rlk_script() -> str:
    exe = pathlib.Path(sys.executable).parent / "rlk"
    if exe.exists():
        return str(exe)
    found = shutil.which("rlk")
    if found is None:
        pytest.skip("the rlk console script is not installed")
    return found


def test_acceptance_command(tmp_path):
    """`rlk run --steps 2 --require-updates --temperature 0.7 --top-p 0.95 --max-response-len 64
    --kl-coef 0.01` on the embedded tiny model: exit 0 in < 300 s, 2 complete steps, 0 byte
    mismatches, a new weight version after every update, a full manifest."""
    run_dir = tmp_path / "acceptance"
    t0 = time.perf_counter()
    p = subprocess.run([rlk_script(), "run", *ACCEPTANCE_FLAGS, "--allow-dirty",
                        "--run-dir", str(run_dir)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr
    assert elapsed < 300, f"acceptance run took {elapsed:.1f} s"
    assert p.stdout.strip() == str(run_dir)
    assert "Traceback" not in p.stderr
    assert not list(tmp_path.glob("*.tmp-*"))
    assert not (tmp_path / "runs").exists()  # --run-dir honoured

    manifest, evidence = load(run_dir)
    check_complete_evidence(evidence, steps=2)
    for s in evidence["steps"]:
        assert s["version_changed"] is True
    versions = [evidence["init"]["version"]] + [s["version"] for s in evidence["steps"]]
    assert len(set(versions)) == 3, "a step did not produce a new weight version"

    cfg = manifest["config"]
    assert cfg["steps"] == 2 and cfg["require_updates"] is True
    assert cfg["temperature"] == 0.7 and cfg["top_p"] == 0.95
    assert cfg["max_response_len"] == 64 and cfg["kl_coef"] == 0.01
    assert cfg["allow_dirty"] is True and cfg["run_dir"] == str(run_dir)
    assert manifest["canonical_spec"]["virtual_tp"] == 8
    assert manifest["canonical_spec"]["virtual_cp"] == 8
    assert manifest["canonical_spec"]["token_leaf"] == 16
    assert "micro_batch_tokens" not in manifest["canonical_spec"]
    assert manifest["canonical_spec"]["backend"] == "cpu"
    import torch

    assert manifest["versions"]["python"] == platform.python_version()
    assert manifest["versions"]["torch"] == torch.__version__
    assert {"commit", "dirty"} <= set(manifest["git"])
    print(f"\nacceptance run: {elapsed:.1f} s")


# ---------------------------------------------------------------------------------------------
# 2. compare


def test_compare_identical_and_different_seed(tmp_path, capsys):
    """Run b keeps the rollout engine's state across steps (--keep-rollout-state): a memory/
    speed knob, so still IDENTICAL to a; a different seed is not."""
    flags = [*SMALL, "--steps", "2", "--kl-coef", "0.01", "--lr", "1e-3", "--require-updates"]
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert rlk_run(a, *flags) == 0
    assert rlk_run(b, *flags, "--keep-rollout-state") == 0
    assert rlk_run(c, *flags, "--seed", "1") == 0
    capsys.readouterr()

    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == "IDENTICAL"
    assert "DIFFERS" not in out
    assert "info  config: run_dir" in out  # manifest differences are information only

    assert main(["compare", str(a), str(c)]) == 1
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("DIFFERENT: ")
    assert "info  config: seed 0 vs 1" in out
    differing = {line.split()[2] for line in out.splitlines()
                 if line.startswith("step ") and "DIFFERS" in line}
    assert {"tokens_hash", "tensor_hashes", "version", "grad_norm"} <= differing, out
    hash_lines = [line for line in out.splitlines() if "tensor_hashes" in line and "DIFFERS" in line]
    assert any("model." in line and "tensors differ" in line for line in hash_lines), hash_lines


def test_compare_unreadable_run(tmp_path, capsys):
    assert main(["compare", str(tmp_path / "nope"), str(tmp_path / "nope2")]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# 3. --mode native


def test_native_mode(tmp_path, capsys):
    """Same flags, same evidence format. Stock CPU ops compute the KV-cache decode and the
    trainer's full-sequence forward with different BLAS/SDPA reduction orders, so train/rollout
    logprob byte mismatches are expected (> 0) here, unlike --mode invariant (0)."""
    nat, inv = tmp_path / "native", tmp_path / "invariant"
    assert rlk_run(nat, "--mode", "native", *ACCEPTANCE_FLAGS) == 0
    assert rlk_run(inv, *SMALL, "--steps", "1") == 0
    mn, en = load(nat)
    _, ei = load(inv)
    assert mn["config"]["mode"] == "native"
    check_complete_evidence(en, steps=2, invariant=False)
    assert set(en) == set(ei)
    assert set(en["init"]) == set(ei["init"])
    for s in en["steps"]:
        assert set(s) == set(ei["steps"][0])
        assert set(s["timings"]) == set(ei["steps"][0]["timings"])
    counts = [s["logprob_mismatches"] for s in en["steps"]]
    tokens = [s["logprob_tokens"] for s in en["steps"]]
    assert all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
    assert all(n <= t for n, t in zip(counts, tokens))
    with capsys.disabled():
        print(f"\nnative-mode logprob mismatches per step: {counts} of {tokens} tokens")
    assert sum(counts) > 0, "stock CPU ops unexpectedly matched bytewise: negative control lost"


# ---------------------------------------------------------------------------------------------
# 4. other numerics and loss settings


def test_fp32_run(tmp_path):
    run_dir = tmp_path / "fp32"
    assert rlk_run(run_dir, *SMALL, "--steps", "2", "--dtype", "fp32", "--kl-coef", "0.01",
                   "--require-updates") == 0
    manifest, evidence = load(run_dir)
    assert manifest["config"]["dtype"] == "fp32"
    check_complete_evidence(evidence, steps=2)
    assert all(s["version_changed"] for s in evidence["steps"])


def test_entropy_and_k3(tmp_path):
    run_dir = tmp_path / "k3"
    assert rlk_run(run_dir, *SMALL, "--steps", "2", "--entropy-coef", "0.01",
                   "--kl-estimator", "k3", "--kl-coef", "0.01", "--require-updates") == 0
    manifest, evidence = load(run_dir)
    assert manifest["config"]["entropy_coef"] == 0.01
    assert manifest["config"]["kl_estimator"] == "k3"
    check_complete_evidence(evidence, steps=2)
    s0 = evidence["steps"][0]
    assert s0["entropy"] > 0
    assert s0["grad_norm"] > 0  # the entropy term acts from the first step (k3 starts at 0)
    assert s0["kl"] == 0.0  # policy == reference at step 0: k3 is exactly 0
    assert evidence["steps"][1]["kl"] > 0  # the policy moved: measured against the reference


# ---------------------------------------------------------------------------------------------
# 5. bad input: one clear line on stderr, non-zero exit, nothing left on disk


def _bad_input_cases(tmp_path: pathlib.Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (extra flags, substrings the error must contain)."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    model = inputs / "truncated-model"
    assert main(["init-model", "--preset", "tiny", "--seed", "0", "--out", str(model)]) == 0
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    malformed = write_prompts(inputs / "malformed.jsonl",
                              [GOOD_PROMPTS[0], '{"prompt": "Compute 3+4=", label: 7}'])
    empty = write_prompts(inputs / "empty.jsonl", [])
    return {
        "entropy-neg": (["--entropy-coef", "-1"], ["--entropy-coef", "-1", ">= 0"]),
        "entropy-nan": (["--entropy-coef", "nan"], ["--entropy-coef", "nan", ">= 0"]),
        "top-p-0": (["--top-p", "0"], ["--top-p", "0", "(0, 1]"]),
        "top-p-1.5": (["--top-p", "1.5"], ["--top-p", "1.5", "(0, 1]"]),
        "temperature-0": (["--temperature", "0"], ["--temperature", "0", ">= 1e-06"]),
        "temperature-neg": (["--temperature", "-1"], ["--temperature", "-1", ">= 1e-06"]),
        "model-missing": (["--model", "/nonexistent"], ["--model", "/nonexistent", "directory"]),
        "model-truncated": (["--model", str(model)],
                            [f"--model {str(model)!r}: {weights.name}: ", "truncated"]),
        "prompts-malformed": (["--prompts", str(malformed)], [f"{malformed}:2", "JSON"]),
        "prompts-empty": (["--prompts", str(empty)], [str(empty), "no prompts"]),
    }


def test_bad_input(tmp_path, capsys):
    cases = _bad_input_cases(tmp_path)
    capsys.readouterr()
    for name, (flags, expected) in cases.items():
        root = tmp_path / f"out-{name}"
        run_dir = root / "nested" / "run"  # parents that do not exist yet must not remain either
        code = rlk_run(run_dir, *SMALL, "--steps", "1", *flags)
        cap = capsys.readouterr()
        lines = cap.err.strip().splitlines()
        assert code != 0, name
        assert "Traceback" not in cap.err, f"{name}: {cap.err}"
        assert len(lines) == 1, f"{name}: expected one error line, got {lines}"
        assert lines[0].startswith("rlk run: error: "), f"{name}: {lines}"
        for s in expected:
            assert s in lines[0], f"{name}: {s!r} not in {lines[0]!r}"
        assert cap.out == "", f"{name}: {cap.out!r}"
        assert_no_run_dir(root, run_dir)


def test_bad_input_console_script_no_traceback(tmp_path):
    """The same through a real process: the message, exit code 2, no traceback, nothing on disk."""
    run_dir = tmp_path / "run"
    p = subprocess.run([rlk_script(), "run", "--top-p", "1.5", "--allow-dirty",
                        "--run-dir", str(run_dir)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == "rlk run: error: --top-p 1.5: must be a number in (0, 1]"
    assert not run_dir.exists() and not list(tmp_path.glob("*.tmp-*"))
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------
# 6. Hugging Face checkpoints both ways


def test_transformers_checkpoint_runs(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from rlkernel.model.config import tiny

    hf = tiny().to_hf_dict()
    cfg = transformers.Qwen3Config(**hf)
    torch.manual_seed(0)
    model_dir = tmp_path / "hf-model"
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(model_dir, safe_serialization=True)
    assert (model_dir / "model.safetensors").is_file()
    assert not (model_dir / "tokenizer.json").exists()  # so the byte tokenizer is used
    prompts = write_prompts(tmp_path / "prompts.jsonl", GOOD_PROMPTS)

    run_dir = tmp_path / "run"
    assert rlk_run(run_dir, "--model", str(model_dir), "--prompts", str(prompts), "--steps", "1",
                   *SMALL, "--kl-coef", "0.01", "--require-updates") == 0
    manifest, evidence = load(run_dir)
    assert manifest["config"]["model"] == str(model_dir)
    assert manifest["config"]["prompts"] == str(prompts)
    check_complete_evidence(evidence, steps=1)
    assert evidence["steps"][0]["version_changed"] is True


def test_init_model_runs_and_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from rlkernel.model.checkpoint import load_checkpoint

    model_dir = tmp_path / "rlk-model"
    assert main(["init-model", "--preset", "tiny", "--seed", "3", "--out", str(model_dir)]) == 0
    run_dir = tmp_path / "run"
    assert rlk_run(run_dir, "--model", str(model_dir), "--steps", "1", *SMALL) == 0
    check_complete_evidence(load(run_dir)[1], steps=1)

    model, info = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    _, tensors = load_checkpoint(model_dir)
    state = model.state_dict()
    for name, t in tensors.items():
        assert state[name].dtype == t.dtype and torch.equal(state[name], t), name


# ---------------------------------------------------------------------------------------------
# 7. progress


def test_progress_one_line_per_step(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert rlk_run(run_dir, *SMALL, "--steps", "3") == 0
    cap = capsys.readouterr()
    assert cap.out.strip() == str(run_dir)
    # Around them: start-up lines and the closing summary (tests/test_watch.py).
    lines = [line for line in cap.err.splitlines() if line.startswith("step ")]
    assert len(lines) == 3, cap.err
    for i, line in enumerate(lines, start=1):
        assert line.startswith(f"step {i}/3 "), line
        assert "mismatches 0/" in line, line
