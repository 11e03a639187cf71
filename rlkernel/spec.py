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

# CUDA backend (Triton kernels): the same contract with its own block sizes.
CUDA_ATTN_KV_BLOCK = 64
"""Keys per online-softmax block of the Triton attention kernels."""
CUDA_VOCAB_CHUNK = 128
"""Vocab ids per chunk of the fused LM-head + log-softmax kernel."""
CUDA_BLOCK_K = {"fp32": 32, "bf16": 64}
"""K-tile of the sequential-K Triton matmul per input dtype (the K order inside a tile is the
tensor core's; across tiles it is sequential)."""
