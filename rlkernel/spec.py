"""The canonical spec (DESIGN.md §1): constants that fix the numerical identity of a run.

Changing any of them is a different numerical run; all are recorded in every manifest. No torch.
"""

VIRTUAL_TP = 8
"""Every TP-sharded reduction is a fixed binary tree over this many virtual shards."""
VIRTUAL_CP = 8
"""Token reductions use trees whose leaf groups any CP dividing this can own whole."""
TOKEN_LEAVES = 128
"""Fine token leaves per microbatch stream: 2·VIRTUAL_CP CP leaves × 8 SP sub-leaves."""
ATTN_KV_BLOCK = 16
"""Keys per online-softmax block of attention, at absolute positions."""
MATMUL_ORDER = "sequential-K fp32"
"""Order of every matmul's K reduction on the CPU backend."""
