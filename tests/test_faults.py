"""Runs that meet a fault (issues 5 and 10): weight-sync faults in transit and in the rollout
engine after the load, non-finite gradients, dead ranks.

Faults are injected through the RLK_FAULT test hook (rlkernel/runner/faults.py), never a flag.
Each end-to-end test drives the real command line and asserts four things: the exit code, the
message (tensor, step, rank), the evidence record, and that nothing is left behind (no process
carrying the test's environment marker, no temp directory, no `*.tmp-*` run directory).
Single-process runs call `rlkernel.cli.main` in-process; the dead-rank runs start a real
`rlk run --tp 2 --cp 2` in a subprocess, with RLK_DIST_TIMEOUT_S=20, and time its exit from the
moment the rank died (the line the hook prints just before SIGKILL).

Run: `.venv/bin/python -m pytest -q tests/test_faults.py` (about 2.5 minutes on 2 idle cores).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time
import uuid

import pytest
import torch

from rlkernel.cli import main
from rlkernel.config import ConfigError, RunConfig
from rlkernel.distributed.launch import GRACE_S
from rlkernel.model.checkpoint import init_weights
from rlkernel.model.config import tiny
from rlkernel.model.ops import ops_for
from rlkernel.rollout.engine import Request, RolloutEngine, SamplingParams
from rlkernel.runner import faults
from rlkernel.weights.hashing import state_hashes, version_hash
from rlkernel.weights.sync import merge_problems, sync_weights

T = "model.layers.0.mlp.up_proj.weight"              # TP-sharded (rows)
NORM = "model.layers.1.post_attention_layernorm.weight"  # replicated on every TP rank
SMALL = ["--max-response-len", "8", "--n-prompts", "2", "--n-samples-per-prompt", "2",
         "--steps", "2"]
TIMEOUT_S = 20


# ---------------------------------------------------------------------------------------------
# helpers


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A unique marker in the environment (inherited by every rank) and a private TMPDIR."""
    marker = f"rlk-faults-{uuid.uuid4().hex}"
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setenv("RLK_TEST_MARKER", marker)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("RLK_DIST_TIMEOUT_S", str(TIMEOUT_S))
    monkeypatch.delenv(faults.ENV, raising=False)
    return marker, tmp


def processes_with(marker: str) -> list[int]:
    """Pids (other than this one) whose environment holds `marker`. Not counted: this process's
    multiprocessing resource tracker (started by the first in-process launch, it lives as long
    as pytest does, by design)."""
    found = []
    for d in pathlib.Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker.encode() not in (d / "environ").read_bytes():
                    continue
                cmd = (d / "cmdline").read_bytes()
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if not (b"resource_tracker" in cmd and ppid == os.getpid()):
                found.append(int(d.name))
    return found


def assert_nothing_left(env, root: pathlib.Path, kept: str | None) -> None:
    """No rank process alive, the private TMPDIR empty, `root` holds only `kept` (or nothing)."""
    marker, tmp = env
    deadline = time.time() + 2
    while processes_with(marker) and time.time() < deadline:
        time.sleep(0.1)
    assert processes_with(marker) == [], "processes left behind"
    assert list(tmp.iterdir()) == [], f"temp files left: {list(tmp.iterdir())}"
    if kept is None:
        assert not root.exists(), f"{root} left behind"  # nor the parent the CLI made for it
        return
    assert sorted(p.name for p in root.iterdir()) == [kept]
    # evidence, manifest and the watch files of the recorded steps (runner/metrics.py); a run
    # that finished all its steps also keeps its weights (final/); no temp file
    complete = evidence(root / kept)["complete"]
    assert sorted(p.name for p in (root / kept).iterdir()) == (
        ["completions.jsonl", "evidence.json"] + (["final"] if complete else [])
        + ["manifest.json", "metrics.jsonl"])


def evidence(run_dir: pathlib.Path) -> dict:
    return json.loads((run_dir / "evidence.json").read_text())


def rlk_in_process(capfd, run_dir: pathlib.Path, *flags: str) -> tuple[int, str]:
    """`rlk run` in this process; (exit code, stderr of this process and of its ranks)."""
    code = main(["run", *SMALL, *flags, "--allow-dirty", "--run-dir", str(run_dir)])
    return code, capfd.readouterr().err


def error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("rlk run: error: ")]
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# RLK_FAULT itself


@pytest.mark.parametrize("spec,fields", [
    (f"sync:flip-bit:step=1:tensor={T}", dict(kind="sync", action="flip-bit", step=1, rank=None,
                                              tensor=T, index=0, bit=0)),
    (f"sync:flip-bit:step=0:tensor={T}:rank=1:index=5:bit=15", dict(rank=1, index=5, bit=15)),
    (f"sync:drop:step=0:tensor={T}", dict(action="drop")),
    (f"grad:inf:step=3:rank=1:tensor={T}", dict(kind="grad", action="inf", step=3, rank=1)),
    ("rank:kill:step=1:rank=2:where=collective", dict(kind="rank", rank=2, where="collective")),
    ("rank:raise:step=0:rank=0", dict(action="raise", where="step")),
    ("engine:stale:step=1", dict(kind="engine", action="stale", step=1, rank=None, tensor=None)),
    (f"engine:flip-bit:step=0:tensor={T}:rank=1:index=3:bit=20",
     dict(kind="engine", action="flip-bit", rank=1, tensor=T, index=3, bit=20)),
])
def test_valid_specs_parse(spec, fields):
    f = faults.parse(spec)
    assert {k: getattr(f, k) for k in fields} == fields


@pytest.mark.parametrize("spec,says", [
    ("", "unknown fault kind ''"),
    ("net:drop:step=0", "unknown fault kind 'net'; allowed: sync, grad, rank, engine"),
    ("sync:erase:step=0:tensor=x", "unknown sync action 'erase'; allowed: flip-bit, drop, shape"),
    ("grad:nan:tensor=x", "grad faults need step=..."),
    ("rank:kill:step=1", "rank faults need rank=..."),
    ("grad:nan:step=-1:tensor=x", "step='-1' must be an integer >= 0"),
    ("grad:nan:step=0:tensor=x:where=step", "unknown key 'where' for grad"),
    ("sync:drop:step=0:tensor", "'tensor' is not key=value"),
    ("sync:drop:step=0:step=1:tensor=x", "key 'step' given twice"),
    ("rank:kill:step=0:rank=1:where=bed", "where='bed'; allowed: step, collective"),
    ("rank:raise:step=0:rank=1:where=collective", "rank:raise happens where=step only"),
    ("engine:reload:step=0", "unknown engine action 'reload'; allowed: stale, flip-bit"),
    ("engine:stale:step=0:tensor=x", "unknown key 'tensor' for engine:stale; allowed: rank, step"),
    ("engine:flip-bit:step=0", "engine:flip-bit faults need tensor=..."),
    ("engine:stale:rank=1", "engine:stale faults need step=..."),
])
def test_invalid_specs_are_rejected_naming_what_is_wrong(spec, says):
    with pytest.raises(faults.FaultSpecError) as e:
        faults.parse(spec)
    assert says in str(e.value) and f"RLK_FAULT={spec!r}" in str(e.value)


def test_check_rejects_unreachable_step_rank_and_single_process_collective(monkeypatch):
    for spec, steps, world, says in [
            ("rank:kill:step=2:rank=0", 2, 4, "step=2 is never reached: the run has --steps 2"),
            ("rank:kill:step=0:rank=4", 2, 4, "rank=4 does not exist: the run has 4 rank(s)"),
            ("rank:kill:step=0:rank=0:where=collective", 2, 1, "needs a multi-rank run")]:
        monkeypatch.setenv(faults.ENV, spec)
        with pytest.raises(faults.FaultSpecError, match=re.escape(says)):
            faults.check(steps, world)
    monkeypatch.delenv(faults.ENV)
    faults.check(1, 1)


def test_hooks_are_no_ops_when_unset(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    grads = {T: torch.ones(2, 2)}
    assert faults.active() is None and faults.tamper(0, 0) is None and faults.load(0, 0) is None
    faults.corrupt_grads(0, 0, grads)
    faults.maybe_die(0, 0)
    assert torch.equal(grads[T], torch.ones(2, 2))
    monkeypatch.setenv(faults.ENV, f"grad:nan:step=1:rank=1:tensor={T}")  # other step / rank
    faults.corrupt_grads(0, 1, grads)
    faults.corrupt_grads(1, 0, grads)
    assert torch.equal(grads[T], torch.ones(2, 2))
    faults.corrupt_grads(1, 1, grads)
    assert math.isnan(grads[T][0, 0]) and torch.isfinite(grads[T]).sum() == 3


def test_invalid_spec_fails_the_run_before_it_starts(capfd, env, tmp_path, monkeypatch):
    """rlk run with a malformed RLK_FAULT: exit 1, one line naming RLK_FAULT, nothing on disk."""
    monkeypatch.setenv(faults.ENV, "sync:flip:step=0")
    root = tmp_path / "runs"
    code, err = rlk_in_process(capfd, root / "r")
    assert code == 1
    assert error_line(err) == ("rlk run: error: RLK_FAULT='sync:flip:step=0': unknown sync action "
                               "'flip'; allowed: flip-bit, drop, shape, dtype")
    assert not root.exists()


def test_on_nonfinite_is_validated():
    assert RunConfig().on_nonfinite == "stop"
    with pytest.raises(ConfigError, match="--on-nonfinite 'clip': must be one of stop, skip"):
        RunConfig(on_nonfinite="clip")


# ---------------------------------------------------------------------------------------------
# the audit, unit level


class _DictEngine:
    """A rollout engine that keeps what it loads (strict names and shapes, like Qwen3's), as
    bf16, unsharded: its held weights are its logical weights."""

    def __init__(self, like: dict[str, torch.Tensor]) -> None:
        self.shapes = {n: t.shape for n, t in like.items()}
        self.w = {n: t.clone() for n, t in like.items()}

    def load_weights(self, tensors):
        if set(tensors) != set(self.shapes):
            raise ValueError(f"missing {sorted(set(self.shapes) - set(tensors))}")
        for n, t in tensors.items():
            if t.shape != self.shapes[n]:
                raise ValueError(f"{n} has shape {tuple(t.shape)}")
            self.w[n] = t.to(torch.bfloat16)

    def exported_weights(self):
        return dict(self.w)

    def held_weights(self):
        return self.w

    def held_form(self, name, t):
        return t.to(torch.bfloat16)


@pytest.mark.parametrize("action,says", [
    ("flip-bit", f"tensor {T!r} differs"),
    ("drop", f"missing tensor {T!r}"),
    ("shape", f"tensor {T!r} arrived as bfloat16 (24,), expected bfloat16 (4, 6)"),
    ("dtype", f"tensor {T!r} arrived as float32 (4, 6), expected bfloat16 (4, 6)"),
])
def test_sync_audit_names_each_fault(monkeypatch, action, says):
    w = {"a": torch.randn(3, dtype=torch.bfloat16), T: torch.randn(4, 6, dtype=torch.bfloat16)}
    engine = _DictEngine(w)
    assert sync_weights(w, engine).problems == ()
    monkeypatch.setenv(faults.ENV, f"sync:{action}:step=2:tensor={T}")
    assert faults.tamper(1, 0) is None
    audit = sync_weights(w, engine, faults.tamper(2, 0))
    assert not audit.ok and any(says in p for p in audit.problems), audit.problems
    assert all(T in p for p in audit.problems)
    assert audit.record()["weight_audit"] == {"ok": False, "problems": list(audit.problems)}


def test_an_export_the_engine_cannot_hold_fails_the_audit():
    """An fp32 export loaded into an engine that holds bf16: its parameters are, byte for byte,
    held_form(export) (the local check's comparison), yet they are not the export's values; the
    audit takes the read-back path and names the version (control: a bf16 export passes)."""
    w = {"a": torch.tensor([1.0, 2.0 ** -12 + 1.0]), "b": torch.ones(3)}
    audit = sync_weights(w, _DictEngine(w))
    assert not audit.ok and audit.problems[0].startswith("rollout engine computes with weight "
                                                         "version ")
    assert "2 of 2 tensors differ" in audit.problems[0]
    bf = {n: t.to(torch.bfloat16) for n, t in w.items()}
    assert sync_weights(bf, _DictEngine(bf)).version == version_hash(state_hashes(bf))
    assert sync_weights(bf, _DictEngine(bf)).ok


def test_flip_bit_flips_exactly_the_named_bit(monkeypatch):
    t = torch.zeros(4, dtype=torch.bfloat16)
    monkeypatch.setenv(faults.ENV, f"sync:flip-bit:step=0:tensor={T}:index=2:bit=15")
    got = {T: t.clone()}
    faults.tamper(0, 0)(got)
    assert got[T].view(torch.int16).tolist() == [0, 0, -32768, 0]  # -0.0: only the sign bit


def test_merge_problems_names_ranks_only_on_multi_rank_runs():
    assert merge_problems([["x", "y"]]) == ("x", "y")
    assert merge_problems([[], ["x"], ["x", "y"]]) == ("x (ranks 1, 2)", "y (rank 2)")
    assert merge_problems([[], []]) == ()


# ---------------------------------------------------------------------------------------------
# the audit's reload half, unit level: a real (tiny, one-process) rollout engine


def _two_versions():
    """v0 and v1 of the tiny model's weights (bf16), every tensor different."""
    v0 = init_weights(tiny(), 0)
    return v0, {n: (t.float() + 2.0 ** -4).to(torch.bfloat16) for n, t in v0.items()}


def _engine_version(engine) -> str:
    return version_hash(state_hashes(engine.exported_weights()))


@pytest.mark.parametrize("spec", [
    "engine:stale:step=1",
    f"engine:flip-bit:step=1:tensor={T}",                 # bit 0 of a bf16-held weight
    f"engine:flip-bit:step=1:tensor={T}:index=7:bit=6",   # its top mantissa bit
    # a norm weight is held in fp32: bit 3 is below bf16's precision (rounding would hide it)
    f"engine:flip-bit:step=1:tensor={NORM}:index=2:bit=3",
])
def test_audit_checks_what_the_engine_holds_after_the_load(monkeypatch, spec):
    """The copy in transit is intact (no transit problem), but the engine ignored the load or a
    parameter changed after it: the audit fails with exactly a version line (expected = v1, found
    = the engine's version: v0 for a stale engine, said so) and a reload line, both naming the
    tensors; the record says weight_audit ok false."""
    v0, v1 = _two_versions()
    engine = RolloutEngine(tiny(), ops_for("invariant"), torch.bfloat16, pad_id=0)
    a0 = sync_weights(v0, engine)
    assert a0.ok, a0.problems
    monkeypatch.setenv(faults.ENV, spec)
    a1 = sync_weights(v1, engine, faults.tamper(1, 0), faults.load(1, 0), a0.version)
    found = _engine_version(engine)
    assert not a1.ok and len(a1.problems) == 2, a1.problems
    version_line, reload_line = a1.problems
    assert version_line.startswith(f"rollout engine computes with weight version {found[:16]}...")
    assert reload_line.startswith(f"rollout engine parameters differ from the weights sent to it "
                                  f"(version {a1.version[:16]}...) in ")
    if "stale" in spec:
        assert found == a0.version
        assert version_line.startswith(
            f"rollout engine computes with weight version {a0.version[:16]}... (the version before "
            f"this sync: the engine kept serving it), expected {a1.version[:16]}...: 24 of 24 "
            "tensors differ: tensor 'model.embed_tokens.weight' differs: expected hash ")
        assert version_line.endswith("; and 21 more")
        assert "in 24 of 24 tensors on this rank: 'model.embed_tokens.weight' (" in reload_line
    else:
        name = NORM if NORM in spec else T
        assert found not in (a0.version, a1.version)
        h1 = a1.tensor_hashes[name]
        assert version_line.endswith(f", expected {a1.version[:16]}...: 1 of 24 tensors differ: "
                                     f"tensor {name!r} differs: expected hash {h1[:16]}..., got "
                                     f"{state_hashes(engine.exported_weights())[name][:16]}...")
        assert f"in 1 of 24 tensors on this rank: {name!r} (holds shard hash " in reload_line
    assert a1.record()["weight_audit"] == {"ok": False, "problems": list(a1.problems)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_flipped_low_bit_changes_what_the_engine_computes(monkeypatch, dtype):
    """Why the audit must see the engine's held parameters, not their bf16 rounding: after bit 12
    of one element of an RMSNorm weight flips (held in fp32 by every engine: its products are
    fp32 elementwise math), the parameter still rounds to the loaded bf16 weight (rounded bytes
    == v0's), yet the engine's logprobs for the same requests change (bytes), in fp32 and bf16
    runs alike. A bf16 engine holds its 2-D weights in bf16 (Qwen3ForCausalLM.
    hold_matmul_weights): there every bit is a bf16 bit, and an fp32 engine's up_proj is fp32."""
    v0, _ = _two_versions()
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0, eos_id=256)
    requests = [Request(i, tuple(b"12+30=" * 3)) for i in range(4)]

    def logprobs(load):
        engine = RolloutEngine(tiny(), ops_for("invariant"), dtype, pad_id=0)
        load(engine, v0)
        out = torch.cat([c.logprob_tensor() for c in engine.generate(requests, sp)])
        return engine, out.view(torch.int32)

    clean_engine, clean = logprobs(lambda engine, w: engine.load_weights(w))
    assert clean_engine.held_weights()[T].dtype == dtype
    monkeypatch.setenv(faults.ENV, f"engine:flip-bit:step=0:tensor={NORM}:bit=12")
    engine, flipped = logprobs(faults.load(0, 0))
    p = engine.held_weights()[NORM]
    assert p.dtype == torch.float32
    assert torch.equal(p.to(torch.bfloat16).view(torch.int16), v0[NORM].view(torch.int16))
    assert not torch.equal(p.view(torch.int32), v0[NORM].float().view(torch.int32))
    assert not torch.equal(clean, flipped)


def test_engine_flip_bit_rejects_an_index_or_bit_the_tensor_lacks(monkeypatch):
    v0, _ = _two_versions()
    engine = RolloutEngine(tiny(), ops_for("invariant"), torch.bfloat16, pad_id=0)
    for spec, says in [(f"engine:flip-bit:step=0:tensor={T}:bit=16",
                        f"index=0, bit=16: {T} has 8192 elements of 16 bits"),
                       (f"engine:flip-bit:step=0:tensor={NORM}:bit=32",
                        f"index=0, bit=32: {NORM} has 64 elements of 32 bits"),
                       ("engine:flip-bit:step=0:tensor=lm_head.weight",
                        "tensor 'lm_head.weight' is not a parameter of this model")]:
        monkeypatch.setenv(faults.ENV, spec)
        with pytest.raises(faults.FaultSpecError, match=re.escape(says)):
            faults.load(0, 0)(engine, v0)


# ---------------------------------------------------------------------------------------------
# weight-sync faults, end to end


@pytest.mark.parametrize("action,says", [
    ("flip-bit", f"tensor {T!r} differs: expected hash"),
    ("drop", f"missing tensor {T!r}"),
    ("shape", f"tensor {T!r} arrived as bfloat16 (8192,), expected bfloat16 (128, 64)"),
    ("dtype", f"tensor {T!r} arrived as float32 (128, 64), expected bfloat16 (128, 64)"),
])
def test_sync_fault_stops_the_run_naming_tensor_and_step(capfd, env, tmp_path, monkeypatch,
                                                         action, says):
    """A corrupted copy at step 1: exit 1, one line naming step and tensor; step 0 is clean,
    step 1's record has weight_audit.ok false with the problems; complete false."""
    monkeypatch.setenv(faults.ENV, f"sync:{action}:step=1:tensor={T}")
    root = tmp_path / "runs"
    code, err = rlk_in_process(capfd, root / "r")
    assert code == 1
    line = error_line(err)
    assert line.startswith("rlk run: error: evidence step 1: weight sync audit failed: ")
    assert says in line
    assert line.endswith(f"(evidence of 2 step(s) kept in {root / 'r'})")
    ev = evidence(root / "r")
    assert ev["complete"] is False and [s["step"] for s in ev["steps"]] == [0, 1]
    assert ev["steps"][0]["weight_audit"] == {"ok": True, "problems": []}
    audit = ev["steps"][1]["weight_audit"]
    assert audit["ok"] is False and any(says in p for p in audit["problems"])
    assert all(T in p for p in audit["problems"])
    assert_nothing_left(env, root, "r")


def test_sync_fault_on_one_rank_is_caught_and_names_the_rank(capfd, env, tmp_path, monkeypatch):
    """--tp 2 --rollout-tp 2, rank 1's received copy has a wrong shape at step 1 (so rank 1's
    engine rejects it while rank 0's loads: the export collective must still line up). The
    problems gathered from every rank name rank 1; exit 1 well within the timeout."""
    monkeypatch.setenv(faults.ENV, f"sync:shape:step=1:tensor={T}:rank=1")
    root = tmp_path / "runs"
    t0 = time.monotonic()
    code, err = rlk_in_process(capfd, root / "r", "--tp", "2", "--rollout-tp", "2")
    assert time.monotonic() - t0 < TIMEOUT_S + 30
    assert code == 1
    line = error_line(err)
    assert line.startswith("rlk run: error: rank 0: evidence step 1: weight sync audit failed: "
                           "tensor "
                           f"{T!r} arrived as bfloat16 (8192,), expected bfloat16 (128, 64) "
                           "(rank 1); rollout engine rejected the weights: ")
    ev = evidence(root / "r")
    assert ev["complete"] is False and len(ev["steps"]) == 2
    problems = ev["steps"][1]["weight_audit"]["problems"]
    assert ev["steps"][1]["weight_audit"]["ok"] is False and problems
    assert all(p.endswith("(rank 1)") and T in p for p in problems)
    assert_nothing_left(env, root, "r")


# ---------------------------------------------------------------------------------------------
# rollout-engine faults (after the load), end to end. --kl-coef 0.01 makes step 1 change the
# weights (the default small run has zero gradients), so a stale engine is distinguishable.

UPDATES = ("--kl-coef", "0.01")


def changed(ev: dict, step: int) -> list[str]:
    """Tensors whose hash step `step` changed, in canonical order."""
    before = ev["steps"][step - 1]["tensor_hashes"] if step else ev["init"]["tensor_hashes"]
    return [n for n, h in ev["steps"][step]["tensor_hashes"].items() if before[n] != h]


@pytest.mark.parametrize("spec", ["engine:stale:step=1",
                                  f"engine:flip-bit:step=1:tensor={T}:bit=12"])
def test_engine_fault_stops_the_run_naming_tensors_and_versions(capfd, env, tmp_path, monkeypatch,
                                                                spec):
    """The engine ignores step 1's load, or one of its parameters changes right after it: exit 1,
    one line naming step 1, the version found (step 0's for a stale engine, said so), the
    version expected (step 1's) and the tensors; step 1's record has weight_audit ok false with
    those problems; step 0 is clean; nothing left behind."""
    monkeypatch.setenv(faults.ENV, spec)
    root = tmp_path / "runs"
    code, err = rlk_in_process(capfd, root / "r", *UPDATES)
    assert code == 1
    line = error_line(err)
    ev = evidence(root / "r")
    assert ev["complete"] is False and [s["step"] for s in ev["steps"]] == [0, 1]
    assert ev["steps"][0]["weight_audit"] == {"ok": True, "problems": []}
    v0, v1 = ev["steps"][0]["version"], ev["steps"][1]["version"]
    audit = ev["steps"][1]["weight_audit"]
    assert audit["ok"] is False and len(audit["problems"]) == 2
    assert line == ("rlk run: error: evidence step 1: weight sync audit failed: "
                    f"{'; '.join(audit['problems'])} (evidence of 2 step(s) kept in {root / 'r'})")
    version_line, reload_line = audit["problems"]
    assert reload_line.startswith(f"rollout engine parameters differ from the weights sent to it "
                                  f"(version {v1[:16]}...) in ")
    if "stale" in spec:
        names = changed(ev, 1)
        assert 0 < len(names) < 24, names  # so "k of 24" below counts exactly the changed ones
        assert version_line.startswith(
            f"rollout engine computes with weight version {v0[:16]}... (the version before this "
            f"sync: the engine kept serving it), expected {v1[:16]}...: {len(names)} of 24 "
            f"tensors differ: tensor {names[0]!r} differs: expected hash "
            f"{ev['steps'][1]['tensor_hashes'][names[0]][:16]}..., got "
            f"{ev['steps'][0]['tensor_hashes'][names[0]][:16]}...")
        assert f"in {len(names)} of 24 tensors on this rank: {names[0]!r} (" in reload_line
    else:
        h1 = ev["steps"][1]["tensor_hashes"][T][:16]
        m = re.fullmatch(rf"rollout engine computes with weight version ([0-9a-f]{{16}})\.\.\., "
                         rf"expected {v1[:16]}\.\.\.: 1 of 24 tensors differ: tensor "
                         rf"{re.escape(repr(T))} differs: expected hash {h1}\.\.\., got "
                         rf"([0-9a-f]{{16}})\.\.\.", version_line)
        assert m and m[1] not in (v0[:16], v1[:16]) and m[2] != h1, version_line
        assert f"in 1 of 24 tensors on this rank: {T!r} (holds shard hash " in reload_line
    assert_nothing_left(env, root, "r")


def line_ranks(problem: str) -> tuple[str, set[int]]:
    """(the problem without its rank suffix, the ranks that found it), from merge_problems."""
    m = re.fullmatch(r"(.*) \(ranks? ([\d, ]+)\)", problem)
    assert m, problem
    return m[1], {int(r) for r in m[2].split(", ")}


@pytest.mark.parametrize("spec,flags,found_by", [
    # rollout TP2: rank 1 ignores the load; both ranks' views mix versions; rank 1's shards are
    # stale
    ("engine:stale:step=1:rank=1", ("--tp", "2", "--rollout-tp", "2"),
     {"version": {0, 1}, "reload": {1}}),
    # rollout TP2: only rank 1's copy of a replicated norm changes; rank 0's view is clean
    (f"engine:flip-bit:step=1:rank=1:tensor={NORM}:bit=3", ("--tp", "2", "--rollout-tp", "2"),
     {"version": {1}, "reload": {1}}),
    # two TP1 rollout replicas: replica 1 keeps serving step 0's version
    ("engine:stale:step=1:rank=1", ("--tp", "2"), {"stale": {1}, "reload": {1}}),
    # two TP2 rollout replicas (ranks 0-1, 2-3): rank 3's shard of T changes; replica 0 is clean
    (f"engine:flip-bit:step=1:rank=3:tensor={T}", ("--tp", "2", "--cp", "2", "--rollout-tp", "2"),
     {"version": {2, 3}, "reload": {3}}),
])
def test_engine_fault_on_one_rank_names_the_rank(capfd, env, tmp_path, monkeypatch, spec, flags,
                                                 found_by):
    """A stale or mutated engine on one rank of a multi-process (gloo) run: exit 1; the audit
    problems gathered from every rank are version lines (expected = step 1's version) from
    exactly the ranks whose view of the engine is wrong (one line, or one per distinct view) and
    one reload line from the rank at fault only, each naming its ranks; weight_audit ok false."""
    monkeypatch.setenv(faults.ENV, spec)
    root = tmp_path / "runs"
    code, err = rlk_in_process(capfd, root / "r", *flags, *UPDATES)
    assert code == 1
    line = error_line(err)
    ev = evidence(root / "r")
    v0, v1 = ev["steps"][0]["version"], ev["steps"][1]["version"]
    audit = ev["steps"][1]["weight_audit"]
    assert audit["ok"] is False and ev["steps"][0]["weight_audit"]["ok"] is True
    assert line.startswith(f"rlk run: error: rank 0: evidence step 1: weight sync audit failed: "
                           f"{audit['problems'][0]}")
    starts = {"version": "rollout engine computes with weight version ",
              "stale": f"rollout engine computes with weight version {v0[:16]}... (the version "
                       f"before this sync: the engine kept serving it), expected {v1[:16]}...: ",
              "reload": f"rollout engine parameters differ from the weights sent to it (version "
                        f"{v1[:16]}...) in "}
    seen: dict[str, set[int]] = {}
    for p in audit["problems"]:
        text, ranks = line_ranks(p)
        kind = next(k for k in found_by if text.startswith(starts[k]))
        assert kind != "reload" or kind not in seen, "one reload line only"
        assert not (seen.get(kind, set()) & ranks), "one line per rank and kind"
        seen.setdefault(kind, set()).update(ranks)
        if kind == "version":
            assert f", expected {v1[:16]}...: " in p and v0[:16] not in p
    assert seen == found_by, audit["problems"]
    if "flip-bit" in spec:
        name = spec.split("tensor=")[1].split(":")[0]
        assert all("1 of 24 tensors" in p and name in p for p in audit["problems"])
    assert_nothing_left(env, root, "r")


# ---------------------------------------------------------------------------------------------
# non-finite gradients


def test_nonfinite_gradient_stop_names_parameter_rank_and_step(capfd, env, tmp_path, monkeypatch):
    """NaN in rank 1's shard of one gradient at step 0 (--tp 2), --on-nonfinite stop (default):
    exit 1 naming parameter, rank and step; step 0 recorded with grad_nonfinite, the rank,
    update_skipped true, a NaN norm and an unchanged weight version."""
    monkeypatch.setenv(faults.ENV, f"grad:nan:step=0:rank=1:tensor={T}")
    root = tmp_path / "runs"
    code, err = rlk_in_process(capfd, root / "r", "--tp", "2")
    assert code == 1
    assert error_line(err) == (
        f"rlk run: error: rank 0: evidence step 0: non-finite gradient in {T} (rank 1); update not "
        f"applied, run stopped (--on-nonfinite stop) (evidence of 1 step(s) kept in {root / 'r'})")
    ev = evidence(root / "r")
    assert ev["complete"] is False and len(ev["steps"]) == 1
    s = ev["steps"][0]
    assert s["grad_nonfinite"] == [T] and s["nonfinite_ranks"] == {T: [1]}
    assert s["update_skipped"] is True and s["grad_norm"] == "nan"
    assert s["version"] == ev["init"]["version"] and s["version_changed"] is False
    assert s["weight_audit"]["ok"] is True
    assert_nothing_left(env, root, "r")


def test_a_resumed_run_stopped_by_a_step_of_its_own_says_what_it_kept(capfd, env, tmp_path,
                                                                       monkeypatch):
    """A run of 2 steps saved at step 1, resumed to 3 steps with a NaN gradient planted at
    evidence step 2 (the resume's first step of its own): exit 1, and the error line ends with
    the evidence kept, as a run that was not resumed says it (a resume said only the error).
    Control: the resume's step 1 is not touched (evidence has 3 steps, the last one skipped)."""
    root = tmp_path / "runs"
    code, err = rlk_in_process(capfd, root / "r", "--save-every", "1")
    assert code == 0, err
    monkeypatch.setenv(faults.ENV, f"grad:nan:step=2:tensor={T}")
    code = main(["run", "--resume", str(root / "r"), "--steps", "3", "--allow-dirty"])
    err = capfd.readouterr().err
    assert code == 1, err
    line = error_line(err)
    assert f"non-finite gradient in {T}" in line, line
    assert line.endswith(f"(evidence of 3 step(s) kept in {root / 'r'})"), line
    ev = evidence(root / "r")
    assert len(ev["steps"]) == 3 and ev["steps"][2]["update_skipped"] is True
    assert ev["steps"][1].get("update_skipped") is not True
    assert [q.name for q in root.iterdir()] == ["r"] and (root / "r" / "checkpoints").is_dir()


def test_a_resume_that_raises_before_its_first_step_leaves_the_run_as_it_was(
        capfd, env, tmp_path, monkeypatch):
    """A finished 2-step run extended to 3 with an exception that is no ValueError raised at the
    resume's first step (RLK_FAULT rank:raise, an InjectedFault: what a bug would raise): the
    exception propagates, and the run's files are put back byte for byte — it stays complete
    with no "resumes" entry (they were left rewritten: evidence incomplete, the manifest naming
    a resume that recorded nothing; breaker). Control: the same resume without the fault adds a
    step and its resume entry."""
    root = tmp_path / "runs"
    code, err = rlk_in_process(capfd, root / "r", "--save-every", "1")
    assert code == 0, err
    files = ("evidence.json", "manifest.json", "metrics.jsonl", "completions.jsonl")
    before = {f: (root / "r" / f).read_bytes() for f in files}
    monkeypatch.setenv(faults.ENV, "rank:raise:step=2:rank=0")
    with pytest.raises(faults.InjectedFault):
        main(["run", "--resume", str(root / "r"), "--steps", "3", "--allow-dirty"])
    assert "the resume failed before its first step" in capfd.readouterr().err
    assert {f: (root / "r" / f).read_bytes() for f in files} == before
    monkeypatch.delenv(faults.ENV)
    assert main(["run", "--resume", str(root / "r"), "--steps", "3", "--allow-dirty"]) == 0
    ev = evidence(root / "r")
    assert ev["complete"] is True and len(ev["steps"]) == 3
    assert len(json.loads((root / "r" / "manifest.json").read_text())["resumes"]) == 1


def test_a_loss_that_overflows_fp32_stops_the_run_naming_its_terms(capfd, env, tmp_path):
    """--kl-coef 3e38 (accepted: the KL has no bound to check it against) with --lr 0.5: step 1's
    KL times the coefficient leaves fp32 and the loss is NaN while the gradients stay finite.
    The step is recorded, then the run stops (exit 1) naming the loss, its terms and the
    coefficients — it used to finish with exit 0 and "nan" losses in its evidence (breaker).
    Control: step 0 (KL 0, policy == reference) passes the same check."""
    root = tmp_path / "runs"
    code, err = rlk_in_process(capfd, root / "r", "--kl-coef", "3e38", "--lr", "0.5")
    assert code == 1, err
    line = error_line(err)
    assert line.startswith("rlk run: error: evidence step 1: the loss is nan (pg_loss ") and \
        "; --kl-coef 3e+38, --entropy-coef 0.0): a term times its coefficient overflows fp32; " \
        "lower that coefficient" in line, line
    ev = evidence(root / "r")
    assert ev["complete"] is False and [s["loss"] for s in ev["steps"]][1] == "nan"
    assert ev["steps"][0]["loss"] == 0.0 and ev["steps"][0]["kl"] == 0.0
    assert_nothing_left(env, root, "r")


def test_nonfinite_gradient_skip_skips_on_every_rank_and_continues(capfd, env, tmp_path,
                                                                   monkeypatch):
    """Inf in rank 1's shard at step 0, --on-nonfinite skip --require-updates: exit 0; step 0 is
    recorded as skipped (the version — gathered from both TP ranks' shards — equals the initial
    one, so neither rank updated) without failing --require-updates; step 1 updates."""
    monkeypatch.setenv(faults.ENV, f"grad:inf:step=0:rank=1:tensor={T}")
    root = tmp_path / "runs"
    code, err = rlk_in_process(capfd, root / "r", "--tp", "2", "--on-nonfinite", "skip",
                               "--require-updates", "--kl-coef", "0.01")
    assert code == 0, err
    progress = [ln for ln in err.splitlines() if ln.startswith("step ")]
    assert len(progress) == 2 and progress[0].startswith("step 1/2")
    assert progress[0].endswith("UPDATE SKIPPED") and "SKIPPED" not in progress[1]
    ev = evidence(root / "r")
    assert ev["complete"] is True and len(ev["steps"]) == 2
    s0, s1 = ev["steps"]
    assert s0["update_skipped"] is True and s0["grad_nonfinite"] == [T]
    # +Inf in a gradient is an infinite norm, recorded as "inf" (exact.py: IEEE rules), not "nan"
    assert s0["nonfinite_ranks"] == {T: [1]} and s0["grad_norm"] == "inf"
    assert s0["grad_norm_hex"] == "inf"
    assert s0["version"] == ev["init"]["version"] and s0["version_changed"] is False
    assert s0["weight_audit"] == {"ok": True, "problems": []}
    assert s1["update_skipped"] is False and s1["grad_nonfinite"] == []
    assert s1["version_changed"] is True and math.isfinite(s1["grad_norm"])
    assert s1["weight_audit"] == {"ok": True, "problems": []}
    assert_nothing_left(env, root, "r")


# ---------------------------------------------------------------------------------------------
# dead ranks: a real `rlk run --tp 2 --cp 2` in a subprocess


def rlk_subprocess(env, run_dir: pathlib.Path, spec: str) -> tuple[int, list[tuple[float, str]]]:
    """Run `rlk run --tp 2 --cp 2` with RLK_FAULT=spec; (exit code, [(seconds, stderr line)])."""
    marker, tmp = env
    child_env = {**os.environ, faults.ENV: spec, "RLK_TEST_MARKER": marker, "TMPDIR": str(tmp),
                 "RLK_DIST_TIMEOUT_S": str(TIMEOUT_S)}
    p = subprocess.Popen([sys.executable, "-m", "rlkernel.cli", "run", *SMALL, "--tp", "2",
                          "--cp", "2", "--allow-dirty", "--run-dir", str(run_dir)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env)
    lines = []
    try:
        for line in p.stderr:
            lines.append((time.monotonic(), line.rstrip("\n")))
        code = p.wait(timeout=TIMEOUT_S + 60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    lines.append((time.monotonic(), f"<exit {code}>"))
    return code, lines


def died_within_timeout(lines, rank: int, step: int) -> None:
    """The rank's death line is there, and the CLI exited within the timeout after it."""
    died = [t for t, ln in lines if ln.startswith(f"RLK_FAULT: rank {rank} SIGKILLs itself at "
                                                  f"step {step}")]
    assert len(died) == 1, lines
    assert lines[-1][0] - died[0] < TIMEOUT_S + GRACE_S, lines


@pytest.mark.parametrize("step,rank,where,kept", [(0, 3, "step", None),
                                                   (1, 2, "collective", "r")])
def test_dead_rank_stops_every_rank_names_it_and_leaves_nothing(env, tmp_path, step, rank, where,
                                                                kept):
    """Rank `rank` SIGKILLs itself mid-step (between collectives, step 0) or mid-collective
    (inside the gradient-norm all-gather, step 1): the CLI exits 1 within RLK_DIST_TIMEOUT_S with
    one line naming the lost rank; the steps already recorded are kept (complete false); no
    rank process and no temp file is left."""
    root = tmp_path / "runs"
    code, lines = rlk_subprocess(env, root / "r", f"rank:kill:step={step}:rank={rank}:where={where}")
    err = "\n".join(ln for _, ln in lines)
    assert code == 1, err
    assert "Traceback" not in err
    msg = f"rlk run: error: rank {rank}: killed by signal SIGKILL without reporting an error"
    assert error_line(err) == (msg if kept is None
                               else f"{msg} (evidence of 1 step(s) kept in {root / 'r'})")
    died_within_timeout(lines, rank, step)
    if kept:
        ev = evidence(root / "r")
        assert ev["complete"] is False and [s["step"] for s in ev["steps"]] == [0]
        assert ev["steps"][0]["weight_audit"]["ok"] is True
    assert_nothing_left(env, root, kept)


def test_rank_hanging_outside_a_collective_is_named_and_leaves_nothing(env, tmp_path):
    """Rank 1 hangs at step 0 outside any collective (a reward that never returns): its peers
    time out in the next collective, and the CLI exits 1 with ONE line naming rank 1 (not a
    peer that timed out waiting for it), no traceback, no run directory and no process left."""
    root = tmp_path / "runs"
    code, lines = rlk_subprocess(env, root / "r", "rank:hang:step=0:rank=1")
    err = "\n".join(ln for _, ln in lines)
    assert code == 1, err
    assert "Traceback" not in err
    # Which peer times out first is a race (any of ranks 0, 2, 3 waits for rank 1).
    assert re.fullmatch(rf"rlk run: error: rank 1: never reached the collective that rank [023] "
                        rf"waited {TIMEOUT_S:g} s in; killed \(hung outside a collective, e\.g\. "
                        r"in a reward function\?\)", error_line(err)), err
    assert_nothing_left(env, root, None)


def test_rank_raising_mid_step_propagates_its_error(env, tmp_path):
    """Rank 2 raises at step 1: the others are stopped within the timeout of the raise (timed
    from its announcement, not from the start: step 0's own time on a loaded machine is not the
    point), the CLI exits 1 with rank 2's error text and traceback (a raise stands for a bug),
    keeps step 0's evidence, leaves no process."""
    root = tmp_path / "runs"
    code, lines = rlk_subprocess(env, root / "r", "rank:raise:step=1:rank=2")
    err = "\n".join(ln for _, ln in lines)
    assert code == 1, err
    raised = [t for t, ln in lines if ln.startswith("RLK_FAULT: rank 2 raises at step 1")]
    assert len(raised) == 1, lines
    assert lines[-1][0] - raised[0] < TIMEOUT_S + GRACE_S, lines
    assert ("rlkernel.distributed.launch.RankFailure: rank 2: rlkernel.runner.faults.InjectedFault: "
            "RLK_FAULT: rank 2 raised at step 1 (rank:raise:step=1:rank=2)") in err
    assert "--- traceback of rank 2 ---" in err
    assert f"rlk run: partial run kept in {root / 'r'}" in err
    ev = evidence(root / "r")
    assert ev["complete"] is False and [s["step"] for s in ev["steps"]] == [0]
    assert_nothing_left(env, root, "r")


def test_a_rank_is_spawned_with_sigint_ignored_and_the_parent_handler_comes_back():
    """While launch spawns a rank, SIGINT is ignored (an ignored signal stays ignored across
    exec, so a Ctrl-C while the rank imports torch prints no KeyboardInterrupt traceback of
    it); the parent's own handler is back right after."""
    import signal

    from rlkernel.distributed import launch

    def mine(signum, frame):
        raise AssertionError("not reached")
    before = signal.signal(signal.SIGINT, mine)
    try:
        with launch._sigint_ignored():
            inside = signal.getsignal(signal.SIGINT)
            child = subprocess.run([sys.executable, "-c", "import signal; "
                                    "print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"],
                                   capture_output=True, text=True, check=True).stdout.strip()
        assert inside == signal.SIG_IGN and child == "True"
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, before)
