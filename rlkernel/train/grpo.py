"""GRPO group-normalised advantages (Shao et al., DeepSeekMath, arXiv 2402.03300 §4.1).

A_i = (r_i − mean(group)) / (std(group) + eps), std with Bessel's correction (as TRL's GRPO).
Sums are exact (math.fsum) and divided once, so every rank computes the same bits from the same
rewards in the same order.
"""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], group_size: int, eps: float = 1e-4) -> list[float]:
    """Advantages for rewards laid out as consecutive groups of `group_size` samples.

    Returns one float per reward; a group of one sample, or of equal rewards, gets zeros.
    Raises ValueError if len(rewards) is not a multiple of group_size.
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not form groups of {group_size}")
    out: list[float] = []
    for g in range(0, len(rewards), group_size):
        grp = rewards[g:g + group_size]
        mean = math.fsum(grp) / group_size
        if group_size == 1:
            out.append(0.0)
            continue
        var = math.fsum((r - mean) ** 2 for r in grp) / (group_size - 1)
        std = math.sqrt(var)
        out.extend((r - mean) / (std + eps) for r in grp)
    return out
