"""The canonical spec (DESIGN.md §1): constants that fix the numerical identity of a run.

Changing any of them is a different numerical run; all are recorded in every manifest. No torch.
"""

VIRTUAL_TP = 8
"""Every TP-sharded reduction is a fixed binary tree over this many virtual shards."""
VIRTUAL_CP = 8
"""CP degrees the contract covers: any CP dividing this (zig-zag segments of whole token leaves)."""
VIRTUAL_DP = 8
"""DP degrees the contract covers: any DP dividing this (and the samples of a mini-batch)."""
TOKEN_LEAF = 16
"""Tokens per leaf of every token reduction: a leaf is TOKEN_LEAF consecutive tokens of one sample
(sample-relative positions), summed in order in fp32; leaves are then added exactly
(numerics/fixedpoint.py), so microbatches, DP/CP/SP ranks and padding cannot change a gradient."""
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
CUDA_TOKEN_LEAF = 128
"""Tokens per leaf of the CUDA backend's linear dW (the LM head's too): a leaf partial is one
128-deep tensor-core dot (eight k16 steps, fp32 accumulation), so an eighth of TOKEN_LEAF's
exact additions, which bound that kernel (float64 units; 64 before NUMERICS_VERSION 7). Norm
weights and embedding rows keep TOKEN_LEAF on every backend (SP slices hold whole leaves of
those). On CUDA samples start at multiples of it and CP segments are whole leaves of it
(`stream_leaf`)."""
CUDA_DKV_LEAF = 64
"""Query positions per leaf of the CUDA attention backward's dK/dV sum (one 64-deep dot over a
leaf's queries): a divisor of CUDA_TOKEN_LEAF, so the stream's alignment holds whole ones."""
assert CUDA_TOKEN_LEAF % CUDA_DKV_LEAF == 0


def stream_leaf(device_type: str) -> int:
    """The leaf the packer aligns samples (and CP cuts) to on a backend ("cuda" or "cpu")."""
    return CUDA_TOKEN_LEAF if device_type == "cuda" else TOKEN_LEAF


NUMERICS_VERSION = 9
"""Bumped whenever the code changes the bits a configuration computes (1: before 2026-11-30
evening; 2: bf16 rounding points at the linears, the Triton attention backward on CUDA; 3: CUDA
d logits divided by T exactly (was torch's x·(1/T)): CUDA gradients change when T != 1; 4: bf16
runs round attention's q, k, v to bf16 (tensor-core attention, bf16 KV cache); 5: bf16 runs'
attention backward rounds P (for dV) and dS (for dQ, dK) to bf16 and runs its dots on the tensor
cores (CUDA); 6: CUDA's linear dW and attention dK/dV sum 64-token leaves (CUDA_TOKEN_LEAF), samples
start at multiples of 64 there; 7: CUDA's linear dW sums 128-token leaves, samples start at
multiples of 128 there (attention dK/dV keeps 64: CUDA_DKV_LEAF); 8: CUDA's AdamW update is one
fused kernel with every op correctly rounded (kernels/triton_adamw.py; torch's CUDA op sequence
differed in 0.15-4.3 % of masters per step on an H200); 9: the CPU AdamW update computes the
same correctly rounded ops in float64 rounded once per op (kernels/adamw.py: the CUDA kernel's
bytes; torch's fp32 CPU sqrt, not correctly rounded on AVX2, and its true division by the bias
correction are gone from CPU runs). A run resumes only under the version
that wrote it, so one run never mixes two meanings of a number."""
ROUNDING_POINTS = {
    "bf16": "bf16: each linear's input activation and incoming gradient (x before x·Wᵀ, dY "
            "before dX and dW), fp32 accumulation and outputs; attention's q, k, v (after "
            "RoPE) and output, P before P·V and the row sum, the output's incoming gradient, "
            "the backward's recomputed P before P·dO and dS before dS·K and dSᵀ·Q, and dQ, "
            "dK, dV (fp32 accumulation and softmax statistics); fp32 elsewhere",
    "fp32": "none (fp32 throughout)",
}
"""Where a run's fp32 values become bf16, by --dtype (docs/ARCHITECTURE.md "Precision")."""
