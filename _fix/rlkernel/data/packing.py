"""Microbatch packing: which of a DP rank's samples share one forward/backward (a memory knob).

Samples are taken in logical order (their sample ids) and packed greedily: a microbatch takes the
next sample while its logical tokens stay within `micro_batch_tokens`. How samples are grouped
never changes a number: every token reduction is an exact sum over sample-relative leaves
(distributed/tokensum.py), and every other op is per token or per sample. The stream layout
(model/layout.py) starts each sample at a multiple of TOKEN_LEAF and pads the end for CP/SP.
Nothing here looks at TP/CP/DP.
"""

from __future__ import annotations


def pack_by_budget(lengths: list[int], micro_batch_tokens: int) -> list[list[int]]:
    """Group sample indices (in order) into microbatches of at most micro_batch_tokens tokens.

    Raises ValueError naming the sample when one sample alone exceeds the budget.
    """
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if n > micro_batch_tokens:
            raise ValueError(f"sample {i} has {n} tokens, more than --micro-batch-tokens "
                             f"{micro_batch_tokens}; raise --micro-batch-tokens or lower "
                             "--max-prompt-len/--max-response-len")
        if cur and used + n > micro_batch_tokens:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups
