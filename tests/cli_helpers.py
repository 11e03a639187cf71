"""Shared piece of the tests that run `rlk run` from a base list of flags. Not a test module."""

from __future__ import annotations


def _settings(argv: list[str]) -> list[list[str]]:
    """`--flag value` and `--flag` (on/off) groups of `argv`, in order (no value starts '--')."""
    groups: list[list[str]] = []
    for arg in argv:
        if arg.startswith("--") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return groups


def with_flags(base: list[str], *flags: str) -> list[str]:
    """`base` with `flags` appended, each flag of `flags` taken out of `base` first: rlk run
    refuses a flag given twice with two values (`--steps 2 ... --steps 1`), so a test that moves
    one setting of its base must replace it, not repeat it."""
    given = {g[0].split("=", 1)[0] for g in _settings(list(flags))}
    kept = [g for g in _settings(base) if g[0].split("=", 1)[0] not in given]
    return [arg for g in kept for arg in g] + list(flags)
