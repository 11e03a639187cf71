"""Microbatch packing by a fixed token budget, independent of topology.

Samples are taken in logical order (their sample ids) and packed greedily: a microbatch takes the
next sample while its logical tokens stay within `token_budget`. The stream is then padded at its
end to a multiple of TOKEN_LEAVES so the canonical token tree can cut it into equal leaves
(DESIGN.md §1); padding never shifts a real token. Nothing here looks at TP/CP/DP.
Does not: place tokens on CP ranks (rlkernel/distributed does that from the same stream).
"""

from __future__ import annotations

from rlkernel.kernels.matmul import TOKEN_LEAVES


def pack_by_budget(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sample indices (in order) into microbatches of at most token_budget tokens.

    Raises ValueError naming the sample when one sample alone exceeds the budget.
    """
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if n > token_budget:
            raise ValueError(f"sample {i} has {n} tokens, more than --token-budget {token_budget}; "
                             "raise --token-budget or lower --max-prompt-len/--max-response-len")
        if cur and used + n > token_budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


def padded_stream_len(n_tokens: int) -> int:
    """Smallest positive multiple of TOKEN_LEAVES holding n_tokens."""
    return max(1, -(-n_tokens // TOKEN_LEAVES)) * TOKEN_LEAVES
