"""`rlk compare RUN_A RUN_B`: is the evidence of two runs bitwise identical, field by field?

Compares the initial weights record (version, per-tensor hashes) and, step by step, every field
of every step record except `timings` and `resources` (measurements) and `nonfinite_ranks`
(global rank ids: the topology's). "Equal" means exactly equal JSON values: the same type,
floats with the same bits (`float.hex`, so 0.0 != -0.0), lists elementwise, dicts key by key.
A step present in one run only is a difference. Manifest differences (config, canonical spec,
inputs: file hashes, vocab, stored dtypes; the reward function's source hash, the tokenizer
files' hashes; versions, git commit) are reported as information: two topologies of one run are
*expected* to differ in config and to be identical in evidence.
A config difference outside config.SAME_EVIDENCE_SETTINGS (e.g. --temperature, --top-p, --seed)
makes two runs of different configurations, whose tokens and evidence may differ (a --model
path to the same weights as the embedded model's may still be IDENTICAL); so does an input whose
recorded content differs under the same flags (rr.py edited between two runs of
`--reward rr.py:score`, weights replaced under the same --model path: `_input_differences`):
the report says so, naming the settings and inputs, in a line before the per-field results.

Does not: read tensors or checkpoints (only evidence.json / manifest.json), or tolerate anything.

Run: `rlk compare runs/A runs/B` (exit 0 identical, 1 different, 2 unreadable run, or A and B
one run: the CLI refuses that, `compare_runs` reports it in `same_run`; `--quiet` prints only the
differing fields, the verdict, and whether B is a copy of A);
tests: `.venv/bin/python -m pytest -q tests/test_compare.py`.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

from rlkernel import jsontext, readfile
from rlkernel.config import (INPUT_FIELDS, SAME_EVIDENCE_SETTINGS, SAMPLING_SETTINGS,
                             SETTING_DEFAULTS, flag_name, reads_steps)
from rlkernel.runner.evidence import EVIDENCE_FORMAT
from rlkernel.runner.inputs import rekeyed

IGNORED_STEP_FIELDS = frozenset({"timings", "resources", "nonfinite_ranks"})
"""Step fields that are allowed to differ: wall-clock measurements, and where in the world a
non-finite gradient sat (global rank ids, which a topology decides; *which* parameters were
non-finite, `grad_nonfinite`, is compared)."""
HASH_FIELDS = frozenset({"tensor_hashes"})
"""Dict fields {tensor name: hash}, summarised by tensor name instead of printed whole."""
MAX_NAMES = 20
MAX_VALUE_CHARS = 80


class CompareError(ValueError):
    """A run directory cannot be compared (missing, unreadable or incomplete evidence)."""


@dataclass(frozen=True)
class FieldResult:
    """One compared field: `where` is "init" or "step N"; `detail` is the human-readable verdict."""

    where: str
    name: str
    same: bool
    detail: str


@dataclass
class CompareReport:
    """Everything `rlk compare` found. `results` decide the verdict; `info`,
    `config_differences` (the config fields, outside SAME_EVIDENCE_SETTINGS, whose values differ)
    and `input_differences` (the inputs whose recorded content differs, described) do not.
    `same_run`: the run's resolved directory when A and B are one run (compared with itself:
    IDENTICAL proves nothing), else None. `caveats`: what says an IDENTICAL proves nothing (one
    run, or a copy of one): printed first among the info lines, and under --quiet too."""

    a: str
    b: str
    results: list[FieldResult] = field(default_factory=list)
    info: list[str] = field(default_factory=list)
    config_differences: list[str] = field(default_factory=list)
    input_differences: list[str] = field(default_factory=list)
    same_run: pathlib.Path | None = None
    caveats: list[str] = field(default_factory=list)

    @property
    def n_differences(self) -> int:
        return sum(not r.same for r in self.results)

    @property
    def identical(self) -> bool:
        return self.n_differences == 0

    @property
    def exit_code(self) -> int:
        """0 when the evidence is identical, 1 otherwise."""
        return 0 if self.identical else 1


# ---------------------------------------------------------------------------------------------
# loading


def _load_json(path: pathlib.Path) -> Any:
    try:
        text = readfile.read_text(path)
    except readfile.NotRegularFileError as e:   # a FIFO would block, a device never end
        raise CompareError(f"{e}; not a file rlk run writes") from None
    except FileNotFoundError:
        raise CompareError(f"{path}: not found (is {path.parent} a run directory?)") from None
    except OSError as e:
        raise CompareError(f"{path}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise CompareError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); not a file "
                           "rlk run writes") from None
    try:
        # the comparison recurses; a field given twice would be compared by its last value
        return jsontext.loads(text, max_depth=jsontext.MAX_DEPTH, unique_keys=True)
    except jsontext.DuplicateKeyError as e:
        raise CompareError(f"{path}: {e.msg}; not a file rlk run writes (it was edited)") from None
    except json.JSONDecodeError as e:
        raise CompareError(f"{path}: not valid JSON ({jsontext.located(e)})") from None


def _run_path(run_dir: str | pathlib.Path) -> pathlib.Path:
    """The run directory that `load_run` reads: run_dir, or a given evidence.json's folder."""
    d = pathlib.Path(run_dir)
    return d.parent if d.name == "evidence.json" and d.is_file() else d


def load_run(run_dir: str | pathlib.Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, evidence) of a run directory (or of the directory of a given evidence.json).

    Raises CompareError naming the file when either is missing or not valid JSON, or when the
    evidence is malformed, of another format, or incomplete (the run did not finish).
    """
    d = _run_path(run_dir)
    why = readfile.not_a_directory(d)   # "a character device, not a run directory", ...
    if why is not None and d.exists():
        raise CompareError(f"{d}: is {why} (give the directory a run wrote, or its "
                           "evidence.json)")
    if why is not None:                  # missing, or a link that cannot be followed
        raise CompareError(f"{d}: {why}")
    evidence = _load_json(d / "evidence.json")
    manifest = _load_json(d / "manifest.json")
    ev_path = d / "evidence.json"
    if not isinstance(evidence, dict) or not isinstance(evidence.get("steps"), list):
        raise CompareError(f"{ev_path}: not an rl-kernel evidence file (no 'steps' list)")
    fmt = evidence.get("format")
    # another meaning of the same fields; `true == 1` in Python, so the type is checked too
    if type(fmt) is not int or fmt != EVIDENCE_FORMAT:
        what = (f"evidence format {fmt!r}" if "format" in evidence else
                "no evidence 'format' number (every rlk run writes one)")
        raise CompareError(f"{ev_path}: {what}; this rlk reads format {EVIDENCE_FORMAT} only")
    if not isinstance(evidence.get("complete", False), bool):
        raise CompareError(f"{ev_path}: 'complete' is {readfile.json_kind(evidence['complete'])}"
                           ", not true or false as rlk run writes it (the file was edited)")
    if not all(isinstance(s, dict) for s in evidence["steps"]):
        raise CompareError(f"{ev_path}: every step record must be a JSON object")
    _check_step_order(ev_path, evidence["steps"])
    if not isinstance(manifest, dict):
        raise CompareError(f"{d / 'manifest.json'}: not an rl-kernel manifest (not a JSON object)")
    _check_step_count(ev_path, evidence, manifest)
    return manifest, evidence


def _check_step_order(ev_path: pathlib.Path, steps: list[dict[str, Any]]) -> None:
    """CompareError unless the records' "step" numbers are integers ≥ 0 in increasing order, as
    a run writes them (a resumed run continues the list): steps are compared by position, so a
    reordered or repeated record would be reported as a mere difference of its fields."""
    nums = [s.get("step") for s in steps]
    prev = -1
    for i, n in enumerate(nums):
        if not isinstance(n, int) or isinstance(n, bool) or n <= prev:
            before = nums[max(0, i - 2):i]
            after = f" after {', '.join(map(repr, before))}" if before else ""
            raise CompareError(f"{ev_path}: step record {i} has step {n!r}{after}: step "
                               "numbers must be integers >= 0 in increasing order (the file "
                               "was edited or damaged)")
        prev = n


def _check_step_count(ev_path: pathlib.Path, evidence: dict[str, Any],
                      manifest: dict[str, Any]) -> None:
    """CompareError when evidence marked complete holds another number of step records than
    its manifest's --steps: a run finishes only after its last step (a stopped one stays
    incomplete, a resume rewrites --steps first), so such a file was cut or padded — and a
    complete run cut to k steps would otherwise compare IDENTICAL to a genuine k-step run."""
    config = manifest.get("config")
    want = config.get("steps") if isinstance(config, dict) else None
    have = len(evidence["steps"])
    if evidence.get("complete") is not True:
        return
    if type(want) is not int:   # without it a cut file would pass: refused, not skipped
        where = ("has no config object" if not isinstance(config, dict) else
                 "records no --steps" if "steps" not in config else
                 f"records --steps as {json.dumps(want)[:40]}, not an integer")
        raise CompareError(f"{ev_path}: marked complete, but its manifest {where} to check its "
                           f"{have} step record(s) against (the manifest was edited or damaged)")
    if want != have:
        raise CompareError(f"{ev_path}: marked complete with {have} step record(s), but its "
                           f"manifest's --steps is {want} (the file was edited or damaged)")


# ---------------------------------------------------------------------------------------------
# equality and descriptions


def same_value(a: Any, b: Any) -> bool:
    """Exact JSON equality: same type, floats by their bits, lists elementwise, dicts by key."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a.hex() == b.hex()
    if isinstance(a, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


def _text(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False) if not isinstance(v, float) else repr(v)


def _short(v: Any) -> str:
    s = _text(v)
    return s if len(s) <= MAX_VALUE_CHARS else s[: MAX_VALUE_CHARS - 3] + "..."


def _pair(a: Any, b: Any) -> str:
    """'A vs B', each cut to MAX_VALUE_CHARS around where the two texts first differ, so a long
    shared prefix (a sentence with one clause changed) never hides the difference."""
    sa, sb = _text(a), _text(b)
    if len(sa) <= MAX_VALUE_CHARS and len(sb) <= MAX_VALUE_CHARS:
        return f"{sa} vs {sb}"
    i = next((j for j, (x, y) in enumerate(zip(sa, sb)) if x != y), min(len(sa), len(sb)))
    start = max(0, i - 20)

    def cut(t: str) -> str:
        head = "..." if start else ""
        body = t[start:start + MAX_VALUE_CHARS - 6]
        return head + body + ("..." if start + len(body) < len(t) else "")
    return f"{cut(sa)} vs {cut(sb)}"


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES])
    return shown + (f", ... ({len(names) - MAX_NAMES} more)" if len(names) > MAX_NAMES else "")


def _describe(a: Any, b: Any) -> str:
    """Why `a` and `b` differ, in one readable line."""
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        bad = [i for i, (x, y) in enumerate(zip(a, b)) if not same_value(x, y)]
        i = bad[0]
        return (f"{len(bad)} of {len(a)} elements differ; first [{i}]: "
                f"{_pair(a[i], b[i])}")
    if isinstance(a, dict) and isinstance(b, dict):
        keys = list(a) + [k for k in b if k not in a]
        bad = [k for k in keys if k not in a or k not in b or not same_value(a[k], b[k])]
        return f"keys {_names(bad)}: {_short({k: a.get(k) for k in bad})} vs {_short({k: b.get(k) for k in bad})}"
    if type(a) is not type(b) and a == b:  # 1 vs 1.0, or true vs 1
        return f"{_short(a)} ({type(a).__name__}) vs {_short(b)} ({type(b).__name__})"
    return _pair(a, b)


def _compare_hashes(a: Any, b: Any) -> tuple[bool, str]:
    if not (isinstance(a, dict) and isinstance(b, dict)):
        same = same_value(a, b)
        return same, "identical" if same else f"DIFFERS ({_pair(a, b)})"
    names = list(a) + [n for n in b if n not in a]
    bad = []
    for n in names:
        if n not in b:
            bad.append(f"{n} (missing in B)")
        elif n not in a:
            bad.append(f"{n} (missing in A)")
        elif not same_value(a[n], b[n]):
            bad.append(n)
    if not bad:
        return True, f"identical ({len(names)} tensors)"
    return False, f"DIFFERS: {len(bad)} of {len(names)} tensors differ: {_names(bad)}"


def _compare_record(where: str, a: dict[str, Any], b: dict[str, Any],
                    ignored: frozenset[str]) -> list[FieldResult]:
    out = []
    for name in list(a) + [k for k in b if k not in a]:
        if name in ignored:
            continue
        if name not in a or name not in b:
            side = "A" if name not in a else "B"
            out.append(FieldResult(where, name, False, f"DIFFERS (missing in {side})"))
        elif name in HASH_FIELDS:
            same, detail = _compare_hashes(a[name], b[name])
            out.append(FieldResult(where, name, same, detail))
        elif same_value(a[name], b[name]):
            out.append(FieldResult(where, name, True, "identical"))
        else:
            out.append(FieldResult(where, name, False, f"DIFFERS ({_describe(a[name], b[name])})"))
    return out


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(_flatten(v, key) if isinstance(v, dict) else {key: v})
    return out


def _inputs_by_place(m: dict[str, Any]) -> Any:
    """m's "inputs" with its files keyed by the absolute paths of its "input_paths" instead of
    the typed ones: one file typed two ways (`--model m`, `--model /w/m`) is one key, not a file
    each run lacks."""
    config, paths = _section(m, "config"), _section(m, "input_paths")
    if config is None or paths is None:
        return m.get("inputs")
    return rekeyed(m.get("inputs"), config, paths)


_SECTIONS = ("config", "canonical_spec", "inputs", "reward", "tokenizer_files", "versions", "git")


def _odd(m: dict[str, Any], section: str) -> bool:
    """Whether manifest `m` holds `section` as a scalar or list where a run writes an object."""
    return m.get(section) is not None and not isinstance(m[section], dict)


def _odd_sections(ma: dict[str, Any], mb: dict[str, Any]) -> list[str]:
    """A line for each manifest section that is a scalar or list in A or B where a run writes an
    object (an edited or damaged manifest): a caveat, shown under --quiet too, instead of a
    comparison key by key (a `config` list made the note call every setting different)."""
    out = []
    for section in _SECTIONS:
        odd = [side for side, m in (("A", ma), ("B", mb)) if _odd(m, section)]
        if odd:
            out.append(f"{section}: not a JSON object in {' and '.join(odd)}'s manifest "
                       f"({_pair(ma.get(section, '<absent>'), mb.get(section, '<absent>'))}; "
                       "the manifest was edited or damaged)")
    return out


def _manifest_info(ma: dict[str, Any], mb: dict[str, Any]) -> list[str]:
    info = []
    for section in _SECTIONS:
        if _odd(ma, section) or _odd(mb, section):
            continue    # _odd_sections names it
        if section == "inputs":
            fa, fb = (_flatten(_inputs_by_place(m) or {}) for m in (ma, mb))
        else:
            fa, fb = _flatten(ma.get(section) or {}), _flatten(mb.get(section) or {})
        for k in list(fa) + [k for k in fb if k not in fa]:
            if k == "dirty_files":
                continue
            va, vb = fa.get(k, "<absent>"), fb.get(k, "<absent>")
            if not same_value(va, vb):
                info.append(f"{section}: {k} {_pair(va, vb)}")
    return info


def _config_differences(ma: dict[str, Any], mb: dict[str, Any]) -> list[str]:
    """The config fields of A and B that differ and may change the evidence, in A's order. An
    input path typed two ways (`--model m` and `--model /abs/m`) that both manifests' resolved
    "input_paths" name as one file is no difference (its content is `_input_differences`');
    nor is --steps where neither run's LR schedule reads it (config.reads_steps) — the step
    counts are compared on their own. A field a manifest lacks counts at its default
    (config.SETTING_DEFAULTS)."""
    if _odd(ma, "config") or _odd(mb, "config"):
        return []   # not settings to compare: _odd_sections names the section
    ca, cb = (m.get("config") if isinstance(m.get("config"), dict) else {} for m in (ma, mb))
    pa, pb = (m.get("input_paths") if isinstance(m.get("input_paths"), dict) else {}
              for m in (ma, mb))
    keys = list(ca) + [k for k in cb if k not in ca]

    def same_place(k: str) -> bool:
        return (k in INPUT_FIELDS and isinstance(pa.get(k), str)
                and same_value(pa.get(k), pb.get(k)))
    ca, cb = ({**SETTING_DEFAULTS, **c} if c else c for c in (ca, cb))
    horizon_free = not any(reads_steps(c.get("lr_schedule")) for c in (ca, cb))
    return [k for k in keys if k not in SAME_EVIDENCE_SETTINGS and not same_place(k)
            and not (k == "steps" and horizon_free)
            and not same_value(ca.get(k, "<absent>"), cb.get(k, "<absent>"))]


def _section(m: dict[str, Any], name: str) -> dict[str, Any] | None:
    v = m.get(name)
    return v if isinstance(v, dict) else None


# Roles of the recorded input files, in the order the note names them.
_ROLES = ("--model weights", "--model config.json", "--model tokenizer", "the --prompts file",
          "the --reward source", "input")


def _input_contents(m: dict[str, Any]) -> dict[str, dict[str, Any] | None]:
    """{role: {name: SHA-256}} of what a manifest records reading; a role is None where the
    manifest does not record it (written by an older rl-kernel). A model file is keyed by its
    name in the --model directory, the prompts file and the reward source by role alone, so the
    same content under another path is no difference (a path that differs is a config
    difference)."""
    config = _section(m, "config") or {}
    inputs, reward, tok = (_section(m, n) for n in ("inputs", "reward", "tokenizer_files"))
    files = inputs.get("files") if inputs is not None else None
    out: dict[str, dict[str, Any] | None] = dict.fromkeys(_ROLES)
    if isinstance(files, dict):
        out.update({role: {} for role in _ROLES})
        model, prompts = config.get("model"), config.get("prompts")
        for path, sha in files.items():
            p = pathlib.PurePath(path)
            if isinstance(prompts, str) and p == pathlib.PurePath(prompts):
                out["the --prompts file"][""] = sha
            elif isinstance(model, str) and p.parent == pathlib.PurePath(model):
                role = ("--model weights" if p.name.endswith((".safetensors", ".index.json"))
                        else "--model config.json" if p.name == "config.json"
                        else "--model tokenizer")
                out[role][p.name] = sha
            else:
                out["input"][path] = sha
    if tok is not None and out["--model tokenizer"] is not None:
        out["--model tokenizer"].update(tok)
    out["the --reward source"] = None if reward is None else {"": reward.get("source_sha256")}
    return out


def _input_differences(ma: dict[str, Any], mb: dict[str, Any]) -> list[str]:
    """The inputs whose recorded content (SHA-256) differs between A and B, each described with
    the files concerned ("--model weights (model.safetensors)", "the --reward source
    /w/rr.py"), in _ROLES order. What either manifest does not record is not compared."""
    ca, cb = _input_contents(ma), _input_contents(mb)
    out = []
    for role in _ROLES:
        a, b = ca[role], cb[role]
        if a is None or b is None:
            continue
        names = [n for n in list(a) + [n for n in b if n not in a]
                 if not same_value(a.get(n, "<absent>"), b.get(n, "<absent>"))]
        if not names:
            continue
        if role == "the --reward source":
            ra, rb = _section(ma, "reward") or {}, _section(mb, "reward") or {}
            if not (ra.get("spec") or rb.get("spec")):
                role = "the built-in reward's source"
            fa, fb = ra.get("source_file"), rb.get("source_file")
            out.append(f"{role} {fa}" if fa == fb else f"{role} {fa} vs {fb}")
        elif role == "the --prompts file":
            pa, pb = ((_section(m, "config") or {}).get("prompts") for m in (ma, mb))
            out.append(f"{role} {pa}" if pa == pb else f"{role} {pa} vs {pb}")
        elif role == "--model config.json":
            out.append(role)
        else:
            out.append(f"{role} ({_names(names)})" if role != "input" else
                       f"input {_names(names)}")
    return out


def _config_note(keys: list[str], inputs: list[str] | None = None) -> str:
    """The line that says A and B are two configurations, or read different inputs (`inputs`:
    _input_differences), so that a DIFFERENT below (their tokens, above all with other sampling
    settings) is not read as a broken promise."""
    sampling = [flag_name(k) for k in keys if k in SAMPLING_SETTINGS]
    other = [flag_name(k) for k in keys if k not in SAMPLING_SETTINGS]
    groups = [f"sampling settings: {', '.join(sampling)}"] if sampling else []
    groups += [f"{'other ' if sampling else ''}settings: {', '.join(other)}"] if other else []
    what = f"differ in configuration ({'; '.join(groups)})" if groups else ""
    if inputs:
        read = f"read different inputs (changed content: {', '.join(inputs)})"
        what = f"{what} and {read}" if what else read
    promise = "one configuration of the same inputs" if inputs else "one configuration"
    return (f"A and B {what}: tokens and evidence may differ without a reproducibility failure "
            f"(identical evidence is promised for {promise} across layouts)")


# ---------------------------------------------------------------------------------------------
# public API


def _timed(evidence: dict) -> bool:
    """Whether the evidence records a step's wall-clock time (a run's, never another run's)."""
    return any(isinstance(s, dict) and isinstance(s.get("timings"), dict)
               and s["timings"].get("step_s") for s in evidence.get("steps", []))


def compare_runs(a_dir: str | pathlib.Path, b_dir: str | pathlib.Path) -> CompareReport:
    """Compare the evidence of two runs (an incomplete run counts as a difference).

    Raises CompareError if either cannot be read.
    """
    ma, ea = load_run(a_dir)
    mb, eb = load_run(b_dir)
    report = CompareReport(a=str(a_dir), b=str(b_dir), info=_manifest_info(ma, mb),
                           config_differences=_config_differences(ma, mb),
                           input_differences=_input_differences(ma, mb))
    report.caveats += _odd_sections(ma, mb)
    same = _run_path(a_dir).resolve()
    if same == _run_path(b_dir).resolve():
        report.same_run = same
        report.caveats.append(f"A and B are the same run ({same}): this compares a run with "
                              "itself, not two runs")
    elif ea == eb and _timed(ea):
        # Two runs never share their wall-clock timings: B is a copy of A (cp -r), and its
        # IDENTICAL says nothing about reproducibility — whatever its manifest says (a copy
        # relabelled `tp 4` in its manifest is still the one run).
        report.caveats.append("A and B hold the same evidence.json down to its wall-clock "
                              "timings: one is a copy of the other, not a second run")

    ia, ib = ea.get("init"), eb.get("init")
    if ia is None and ib is None:
        report.info.append("init: not recorded in either run")
    elif isinstance(ia, dict) and isinstance(ib, dict):
        report.results += _compare_record("init", ia, ib, frozenset())
    else:
        report.results.append(FieldResult("init", "init", False,
                                          f"DIFFERS ({_pair(ia, ib)})"))

    sa, sb = ea["steps"], eb["steps"]
    for i in range(max(len(sa), len(sb))):
        label = (sa[i] if i < len(sa) else sb[i]).get("step", i)
        where = f"step {label}"
        if i >= len(sa) or i >= len(sb):
            side = "A" if i >= len(sa) else "B"
            report.results.append(FieldResult(where, "step", False, f"DIFFERS (missing in {side})"))
            continue
        report.results += _compare_record(where, sa[i], sb[i], IGNORED_STEP_FIELDS)
    if len(sa) != len(sb):
        report.info.append(f"step count: {len(sa)} vs {len(sb)}")
    # A run that stopped early is compared on the steps it has, and is never "identical".
    ca, cb = ea.get("complete") is True, eb.get("complete") is True
    if not (ca and cb):
        state = f"{'complete' if ca else 'INCOMPLETE'} vs {'complete' if cb else 'INCOMPLETE'}"
        verdict = "NOT IDENTICAL" if ca == cb else "DIFFERS"   # both incomplete: equal, not whole
        report.results.append(FieldResult("run", "complete", False, f"{verdict} ({state})"))
    return report


def format_report(report: CompareReport, quiet: bool = False) -> str:
    """Human-readable report: run paths, manifest information, a "note" line when the runs
    differ in configuration or inputs (report.config_differences, report.input_differences),
    one line per field, the verdict.

    quiet: only the caveats (a run compared with itself or with its copy), the note (if any),
    the fields that differ and the verdict (no paths or other information lines): a DIFFERENT
    of two configurations still says so, and an IDENTICAL of a copy too.
    The last line is "IDENTICAL" or "DIFFERENT: N fields differ". Every line is
    `jsontext.printable`: a key, value, tensor name or path from an edited file prints its
    control, bidi and lone-surrogate characters escaped (raw, they reached the terminal, and a
    lone surrogate made the print itself fail).
    """
    shown = [r for r in report.results if not (quiet and r.same)]
    lines = [] if quiet else [f"A: {report.a}", f"B: {report.b}"]
    lines += [f"info  {s}" for s in report.caveats + ([] if quiet else report.info)]
    if report.config_differences or report.input_differences:
        lines.append(f"note  {_config_note(report.config_differences, report.input_differences)}")
    width = max((len(r.where) for r in shown), default=0)
    name_width = max((len(r.name) for r in shown), default=0)
    for r in shown:
        lines.append(f"{r.where:<{width}}  {r.name:<{name_width}}  {r.detail}")
    n = report.n_differences
    if n == 0:
        lines.append("IDENTICAL")
    else:
        lines.append(f"DIFFERENT: {n} fields differ" if n > 1 else "DIFFERENT: 1 field differs")
    return "\n".join(map(jsontext.printable, lines))
