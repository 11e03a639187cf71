"""Batch-invariant Triton matmul for the CUDA backend (DESIGN.md §1, column/row-parallel linears).

Every output element is ONE fp32 accumulator that walks K from 0 to K-1 in chunks of BLOCK_K, in
order (`acc = dot(a_chunk, b_chunk, acc)`): no split-K, no atomics, no reduction across programs.
- fp32 inputs use `input_precision="ieee"`: Triton lowers that dot to one fused multiply-add per
  k, k ascending, so an element is the sequential fma chain over K whatever the tile.
- bf16 inputs use the tensor cores (wgmma on Hopper). On the H200 the bits of an element depend
  on the K order only, not on BLOCK_M/BLOCK_N/warps/stages (REFERENCES.md, re-tested by
  tests/test_cuda.py), so the tile may be picked per M from `_TILES`.
BLOCK_K is fixed per dtype and never depends on M or N: a K tail is zero-padded the same way for
every call with the same K. Rows beyond M / columns beyond N are masked; they never meet other
elements, so an output row is independent of the batch it sits in.
Batched form `bmm` (a [B, M, K] @ b [B, K, N], any strides, stride 0 for broadcast) serves the
per-virtual-shard partials of row-parallel forward and column-parallel dX, and the per-token-leaf
dW partials; the pairwise trees over those partials stay in rlkernel/numerics/trees.py.

Does not: run on CPU (rlkernel/kernels/matmul.py is the reference and dispatches here), fuse the
trees. Tile choice is a literal table (no autotuning); tests/test_cuda.py checks that every row
of the table gives the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.matmul import operand_dtype  # noqa: F401  (re-exported: callers import it here)
from rlkernel.kernels.triton_elementwise import tree_rows
from rlkernel.kernels.triton_util import cast, check_cuda, device_ctx, launch
from rlkernel.spec import CUDA_BLOCK_K

# (dtype) -> BLOCK_K: fixed, part of the backend's numerical identity.
BLOCK_K = {torch.bfloat16: CUDA_BLOCK_K["bf16"], torch.float16: CUDA_BLOCK_K["bf16"],
           torch.float32: CUDA_BLOCK_K["fp32"]}

# (dtype) -> [(max M, (BLOCK_M, BLOCK_N, num_warps, num_stages, GROUP_M)), ...]; the first row
# whose max M >= M is used. bf16 rows keep BLOCK_M >= 64 and warps % 4 == 0 so every call takes
# the same (wgmma) instruction path.
_TILES = {
    torch.bfloat16: [
        (64, (64, 64, 4, 4, 8)),
        (512, (128, 128, 8, 3, 8)),
        (1 << 62, (128, 256, 8, 3, 8)),
    ],
    torch.float32: [
        (64, (32, 64, 4, 2, 8)),
        (1 << 62, (64, 64, 4, 2, 8)),
    ],
}
_TILES[torch.float16] = _TILES[torch.bfloat16]


def tile_for(dtype: torch.dtype, m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, GROUP_M) for an M-row product of `dtype`."""
    for max_m, cfg in _TILES[dtype]:
        if m <= max_m:
            return cfg
    raise AssertionError("unreachable: the last row of _TILES covers every M")


@triton.jit
def _bmm_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped launch order (L2 reuse); it decides only WHICH tile a program owns.
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pm = first_m + (pid % per_group) % group_m
    pn = (pid % per_group) // group_m
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + batch * s_ab + rm.to(tl.int64)[:, None] * s_am
    b_cols = b_ptr + batch * s_bb + rn.to(tl.int64)[None, :] * s_bn
    m_ok = rm[:, None] < M
    n_ok = rn[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(a_rows + kk.to(tl.int64)[None, :] * s_ak, mask=m_ok & k_ok[None, :], other=0.0)
        y = tl.load(b_cols + kk.to(tl.int64)[:, None] * s_bk, mask=k_ok[:, None] & n_ok, other=0.0)
        acc = tl.dot(x, y, acc, input_precision=PREC)
    c = c_ptr + batch * s_cb + rm.to(tl.int64)[:, None] * s_cm + rn.to(tl.int64)[None, :] * s_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok & n_ok)


def _check(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    check_cuda(what, a, b)
    if a.dtype != b.dtype or a.dtype not in BLOCK_K:
        raise ValueError(f"{what}: dtypes must match and be one of float32/bfloat16/float16, "
                         f"got {a.dtype} and {b.dtype}")


def bmm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype = torch.float32,
        tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Batched a @ b with one sequential fp32 accumulator over K per element.

    a [B, M, K], b [B, K, N]: same dtype (float32 | bfloat16 | float16), same CUDA device, any
    strides (0 allowed: broadcast). Returns a new contiguous [B, M, N] tensor of `out_dtype`.
    `tile` overrides the table row (tests use it to show the bits do not depend on it).
    Raises ValueError on device, dtype or shape mismatch.
    """
    _check(a, b, "bmm")
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"bmm: shapes {tuple(a.shape)} @ {tuple(b.shape)} do not match "
                         "[B, M, K] @ [B, K, N]")
    bsz, m, k = a.shape
    n = b.shape[2]
    c = torch.empty(bsz, m, n, dtype=out_dtype, device=a.device)
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()
    bm, bn, warps, stages, group_m = tile or tile_for(a.dtype, m)
    prec = "ieee" if a.dtype == torch.float32 else "tf32"   # "tf32" is ignored for 16-bit dots
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), bsz)
    with device_ctx(a):
        launch(_bmm_kernel, grid,
               a, b, c, m, n, k, a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1),
               b.stride(2), c.stride(0), c.stride(1), c.stride(2), BLOCK_M=bm, BLOCK_N=bn,
               BLOCK_K=BLOCK_K[a.dtype], GROUP_M=group_m, PREC=prec, num_warps=warps,
               num_stages=stages)
    return c


def matmul(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype = torch.float32,
           tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N] `out_dtype` (see `bmm`; any strides)."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"matmul: 2-D operands expected, got {tuple(a.shape)} @ {tuple(b.shape)}")
    return bmm(a[None], b[None], out_dtype=out_dtype, tile=tile)[0]


def seq_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with broadcast batch dims: a [..., M, K], b [..., K, N] -> [..., M, N] fp32.

    The CUDA body of rlkernel.kernels.matmul.seq_matmul: operands in `operand_dtype(a, b)`.
    """
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"seq_matmul: K mismatch {tuple(a.shape)} @ {tuple(b.shape)}")
    dt = operand_dtype(a, b)
    a = cast(a, dt)
    b = cast(b, dt)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return bmm(a3, b3).reshape(*batch, a.shape[-2], b.shape[-1])


def linear_nt(x: torch.Tensor, w: torch.Tensor, *, out_dtype: torch.dtype = torch.float32,
              tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x @ wᵀ (column-parallel forward). x [M, K], w [N, K] -> [M, N] `out_dtype`.

    16-bit operands with M >= TMA_MIN_M that `tma_ok` accepts take the persistent TMA kernel,
    which gives the pointer kernel's bytes (tests/test_cuda.py), so the switch on M changes speed
    only, never a result.
    """
    if (tile is None and x.dim() == 2 and x.shape[0] >= TMA_MIN_M
            and out_dtype in (x.dtype, torch.float32)
            and tma_ok(x, w, out_dtype) and x.shape[1] == w.shape[1]):
        return linear_nt_tma(x, w, out_dtype=out_dtype)
    return matmul(x, w.t(), out_dtype=out_dtype, tile=tile)


def row_parallel_partials(x: torch.Tensor, w: torch.Tensor, shards: int) -> torch.Tensor:
    """Per-virtual-shard partials of x @ wᵀ in one launch: [shards, M, N] fp32.

    x [M, K], w [N, K], K % shards == 0; shard s reduces K slice [s·K/shards, (s+1)·K/shards).
    Operands in `operand_dtype(x, w)`.
    """
    k = x.shape[-1]
    if k % shards:
        raise ValueError(f"row-parallel linear: K={k} is not a multiple of virtual_tp={shards}")
    dt = operand_dtype(x, w)
    a = cast(x, dt).unflatten(1, (shards, k // shards)).permute(1, 0, 2)   # [s, M, ks]
    b = cast(w, dt).unflatten(1, (shards, k // shards)).permute(1, 2, 0)   # [s, ks, N]
    return bmm(a, b)


def column_dx_partials(dy: torch.Tensor, w: torch.Tensor, shards: int) -> torch.Tensor:
    """Per-virtual-shard partials of dY @ W: [shards, M, K] fp32 (shard s: rows of W in N slice s).

    dy [M, N], w [N, K], N % shards == 0. Operands in `operand_dtype(dy, w)`.
    """
    n = w.shape[0]
    if n % shards:
        raise ValueError(f"column-parallel linear: N={n} is not a multiple of virtual_tp={shards}")
    dt = operand_dtype(dy, w)
    a = cast(dy, dt).unflatten(1, (shards, n // shards)).permute(1, 0, 2)  # [s, M, ns]
    b = cast(w, dt).unflatten(0, (shards, n // shards))                    # [s, ns, K]
    return bmm(a, b)


def token_leaf_partials(dy: torch.Tensor, x: torch.Tensor, leaves: int) -> torch.Tensor:
    """Per-token-leaf partials of dW = dYᵀ·X: [leaves, N, K] fp32, tokens in order in a leaf.

    dy [L, N], x [L, K], L % leaves == 0. Operands in `operand_dtype(dy, x)`.
    """
    n_tok = dy.shape[0]
    if n_tok % leaves:
        raise ValueError(f"token leaves: stream length {n_tok} is not a multiple of {leaves} leaves")
    dt = operand_dtype(dy, x)
    a = cast(dy, dt).unflatten(0, (leaves, n_tok // leaves)).transpose(1, 2)  # [l, N, m]
    b = cast(x, dt).unflatten(0, (leaves, n_tok // leaves))                    # [l, m, K]
    return bmm(a, b)


# ------------------------------------------------------------------------------------------------
# Persistent TMA variant for 16-bit x @ wᵀ with K-contiguous operands (the column-parallel
# forward at large M). Same chain per element as _bmm_kernel: one accumulator, K ascending in
# BLOCK_K chunks, zero-padded tail (TMA fills out-of-bounds with zeros). tests/test_cuda.py checks
# that it gives the same bytes as _bmm_kernel.
_TMA_TILES = [
    (1 << 62, (128, 256, 8, 3, 8)),
]
_TMA_TILES_F32_OUT = [
    (1 << 62, (128, 128, 8, 3, 8)),   # an fp32 [128, 256] epilogue tile exceeds shared memory
]
_NUM_SMS: dict[int, int] = {}
TMA_MIN_M = 256
"""Rows from which linear_nt uses the TMA kernel (measured faster from M = 1024 on the H200)."""


@triton.jit
def _tma_kernel(a_desc, b_desc, c_desc, M, N, K,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_M * num_n
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=FLATTEN):
        group = tile // per_group
        first_m = group * GROUP_M
        group_m = tl.minimum(num_m - first_m, GROUP_M)
        pm = first_m + (tile % per_group) % group_m
        pn = (tile % per_group) // group_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_tiles):
            x = a_desc.load([pm * BLOCK_M, kt * BLOCK_K])
            y = b_desc.load([pn * BLOCK_N, kt * BLOCK_K])
            acc = tl.dot(x, y.T, acc)
        c_desc.store([pm * BLOCK_M, pn * BLOCK_N], acc.to(c_desc.dtype))


def tma_ok(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `linear_nt_tma` can take x [M, K], w [N, K] (16-bit, K-contiguous, 16-B aligned
    rows, and an output row of N elements of out_dtype that is a multiple of 16 bytes)."""
    return (x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and x.is_cuda
            and x.dim() == 2 and w.dim() == 2
            and x.stride(1) == 1 and w.stride(1) == 1 and (x.stride(0) * 2) % 16 == 0
            and (w.stride(0) * 2) % 16 == 0 and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and (w.shape[0] * out_dtype.itemsize) % 16 == 0)


def linear_nt_tma(x: torch.Tensor, w: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                  tile: tuple[int, int, int, int, int] | None = None,
                  flatten: bool = False) -> torch.Tensor:
    """x @ wᵀ by the persistent TMA kernel. x [M, K], w [N, K] 16-bit (see `tma_ok`) ->
    [M, N] `out_dtype` (bf16, fp16 or fp32; N·itemsize a multiple of 16 bytes)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    if not tma_ok(x, w, out_dtype) or x.shape[1] != w.shape[1]:
        raise ValueError("linear_nt_tma: needs 16-bit, K-contiguous, 16-byte aligned x [M, K] and "
                         f"w [N, K]; got {tuple(x.shape)} {x.dtype} and {tuple(w.shape)} {w.dtype}")
    m, k = x.shape
    n = w.shape[0]
    c = torch.empty(m, n, dtype=out_dtype, device=x.device)
    table = _TMA_TILES_F32_OUT if out_dtype == torch.float32 else _TMA_TILES
    bm, bn, warps, stages, group_m = tile or table[0][1]
    bk = BLOCK_K[x.dtype]
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if dev not in _NUM_SMS:
        _NUM_SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    sms = _NUM_SMS[dev]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    a_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    c_desc = TensorDescriptor.from_tensor(c, [bm, bn])
    with device_ctx(x):
        launch(_tma_kernel, (min(sms, tiles),),
               a_desc, b_desc, c_desc, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
               NUM_SMS=min(sms, tiles), FLATTEN=flatten, num_warps=warps, num_stages=stages)
    return c


@triton.jit
def _shard_sum_kernel(P, Y, mn, S: tl.constexpr, LOG_S: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = o < mn
    sh = tl.arange(0, S).to(tl.int64)
    v = tl.load(P + sh[None, :] * mn + o[:, None], mask=ok[:, None], other=0.0)   # [BLOCK, S]
    tl.store(Y + o, tree_rows(v, BLOCK, S, LOG_S), mask=ok)


def shard_tree_sum(p: torch.Tensor) -> torch.Tensor:
    """numerics.trees.tree_sum(p, 0) for fp32 p [S, ...] on CUDA, S a power of two <= 64, in one
    pass (the row-parallel linears' virtual-shard partials): the same pairwise tree — shards
    (0, 1), (2, 3), … level by level, each add one IEEE fp32 add of the same two values — so the
    same bytes, in one launch instead of log2(S) strided ones. ValueError otherwise."""
    check_cuda("shard sum", p)
    n = p.shape[0]
    if p.dtype != torch.float32 or n < 1 or n & (n - 1) or n > 64:
        raise ValueError(f"shard sum: fp32 [S, ...] with S a power of two <= 64 expected, got "
                         f"{p.dtype} {tuple(p.shape)}")
    pc = p.contiguous()
    y = torch.empty(p.shape[1:], dtype=torch.float32, device=p.device)
    mn = y.numel()
    if mn == 0 or n == 1:
        return pc[0].clone() if mn else y
    block = max(16, 2048 // n)
    with device_ctx(p):
        launch(_shard_sum_kernel, (triton.cdiv(mn, block),),
               pc, y, mn, S=n, LOG_S=n.bit_length() - 1, BLOCK=block, num_warps=4)
    return y
