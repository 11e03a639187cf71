"""Built-in verifiable task (seeded integer arithmetic), its reward, and the per-step prompt source.

`arithmetic_prompts` generates problems like "Compute 37+45=" / "82" from `random.Random(seed)`,
so a seed fully determines them. `reward` is exact match: no partial credit, no tolerance, and the
same response always scores the same, so rewards are evidence that two runs can compare.
`prompt_source` hands out each step's prompts from a JSONL or Parquet file or from the task.

Does not: shuffle file prompts (they cycle in file order), format chat templates, repeat prompts
for GRPO groups (the RL loop does that), or call out to a model or a sandbox to grade.

Run its tests with: .venv/bin/python -m pytest -q tests/test_data.py
"""

from __future__ import annotations

import hashlib
import os
import random
import re

from rlkernel.data.prompts import Prompt, parse_prompts, read_prompt_file

# re.ASCII: only 0-9 count as digits (\d would also match e.g. Arabic-Indic digits).
_INT = re.compile(r"-?\d+", re.ASCII)
_OPS = ("+", "-", "*")
_ADD_SUB_MAX = 99  # operands of + and - are in [0, 99]
_MUL_MAX = 12      # operands of * are in [0, 12]


def arithmetic_prompts(n: int, seed: int) -> list[Prompt]:
    """`n` integer arithmetic prompts, deterministic for `seed`; index i is the i-th generated.

    Each prompt is "Compute {a}{op}{b}=" with op in +, -, * (a, b in [0, 99] for +/-, [0, 12]
    for *); the label is the exact result as a decimal string (negative for some subtractions).
    Raises ValueError if n < 0 or seed < 0 (random.Random uses abs(seed): -s and s would collide).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r} "
                         f"(random.Random(seed) ignores the sign, so seeds s and -s would give the same prompts)")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        op = _OPS[rng.randrange(len(_OPS))]
        hi = _MUL_MAX if op == "*" else _ADD_SUB_MAX
        a, b = rng.randrange(hi + 1), rng.randrange(hi + 1)
        result = a + b if op == "+" else a - b if op == "-" else a * b
        out.append(Prompt(index=i, text=f"Compute {a}{op}{b}=", label=str(result)))
    return out


def _int_key(s: str) -> tuple[bool, str]:
    """(negative, digits without leading zeros) of an integer string; -0 == 0.

    Compares integers without int(), which refuses strings over 4300 digits (sys.int_info).
    """
    neg = s.startswith("-")
    digits = s.lstrip("-").lstrip("0") or "0"
    return (neg and digits != "0", digits)


def reward(response: str, label: str) -> float:
    """Exact-match reward in {0.0, 1.0}.

    If `label` (stripped) is an integer (-?[0-9]+): 1.0 iff `response`, after leading whitespace,
    starts with an integer equal to it ("82 because..." matches "82"; "The answer is 82" and
    "825" do not). Otherwise: 1.0 iff response.strip() == label.strip().
    """
    lab = label.strip()
    if _INT.fullmatch(lab):
        m = _INT.match(response.lstrip())
        return 1.0 if m is not None and _int_key(m.group()) == _int_key(lab) else 0.0
    return 1.0 if response.strip() == lab else 0.0


class PromptSource:
    """The prompts of every step of a run; build it with `prompt_source`."""

    def __init__(self, prompts: list[Prompt], *, n_prompts_per_step: int, steps: int,
                 description: dict) -> None:
        self._prompts = tuple(prompts)
        self.n_prompts_per_step = n_prompts_per_step
        self.steps = steps
        self._description = description

    def batch(self, step: int) -> list[Prompt]:
        """The `n_prompts_per_step` prompts of `step` (0-based), in order.

        Item i is prompt (step*n + i) mod count: file prompts cycle in file order (a step may wrap
        around, and repeats a prompt when n > count); each keeps its source `index`.
        Raises ValueError if step is outside [0, steps).
        """
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < self.steps:
            raise ValueError(f"step must be an int in [0, {self.steps}), got {step!r}")
        n, count = self.n_prompts_per_step, len(self._prompts)
        return [self._prompts[(step * n + i) % count] for i in range(n)]

    def describe(self) -> dict:
        """For the run manifest: {"source": path | "task:arithmetic", "count": int, and
        "sha256": hex of the file bytes (file) or "seed": int (task)}."""
        return dict(self._description)


def task_description(n_prompts_per_step: int, steps: int, seed: int) -> dict:
    """`PromptSource.describe()` of the arithmetic task's prompts, without generating them:
    {"source": "task:arithmetic", "count": n_prompts_per_step * steps, "seed": seed}."""
    return {"source": "task:arithmetic", "count": n_prompts_per_step * steps, "seed": seed}


def prompt_source(prompts_path: str | os.PathLike | None, *, n_prompts_per_step: int, steps: int,
                  seed: int, input_key: str = "prompt", label_key: str = "label") -> PromptSource:
    """Prompts from the JSONL or Parquet file `prompts_path` (read by `input_key`/`label_key`,
    rlkernel/data/prompts.py), or `n_prompts_per_step * steps` arithmetic prompts generated from
    `seed` when it is None (`seed` and the keys are unused then).

    The file is read once; its SHA-256 is of exactly the bytes that were parsed.
    Raises ValueError for n_prompts_per_step < 1 or steps < 1, PromptFileError for a bad file.
    """
    for name, v in (("n_prompts_per_step", n_prompts_per_step), ("steps", steps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if prompts_path is None:
        prompts = arithmetic_prompts(n_prompts_per_step * steps, seed)
        desc = task_description(n_prompts_per_step, steps, seed)
    else:
        data = read_prompt_file(prompts_path)
        prompts = parse_prompts(data, os.fspath(prompts_path), input_key=input_key,
                                label_key=label_key)
        desc = {"source": os.fspath(prompts_path), "count": len(prompts),
                "sha256": hashlib.sha256(data).hexdigest()}
    return PromptSource(prompts, n_prompts_per_step=n_prompts_per_step, steps=steps, description=desc)
