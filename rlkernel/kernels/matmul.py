"""Batch-invariant matmul, column- and row-parallel linears, and their canonical backward.
CPU reference here; CUDA tensors dispatch to the Triton kernels.

Why not BLAS: stock CPU GEMM picks blocking, vector paths and threading by shape, so an output row
changes when M grows (measured here: 932 of 1024 outputs of row 0 change from M=1 to M=8) or when N
is split. Here every output element is one fixed sequence of IEEE ops that depends only on K:
    acc = a[0]·b[0];  acc = acc + a[k]·b[k] for k = 1 .. K-1      (fp32, one product, one add)
Each step is a separate elementwise torch kernel over the whole [M, N] tile, and elementwise mul/add
are correctly rounded on every code path, so an element's value never depends on M, N, its row,
other rows or the thread count: invariant by construction. The GPU backend keeps the same contract
with a sequential-K Triton kernel.

Canonical reductions (DESIGN.md §1):
- column-parallel forward: one full-K sequence per output (`seq_matmul`).
- row-parallel forward: K cut into VIRTUAL_TP shards, each shard a sequential-K partial, the
  partials summed by the pairwise tree (`rlkernel.numerics.trees`): TP=t owns aligned subtrees.
- column-parallel dX: the same virtual-TP tree over N shards; row-parallel dX: local. N need not
  be a multiple of VIRTUAL_TP (k/v projections: N = kv_heads·head_dim, e.g. 12): virtual shard s
  holds rows [⌊s·N/8⌋, ⌊(s+1)·N/8⌋) (`virtual_shard_rows`), so shards differ by at most one row,
  empty shards are skipped (never added as zeros), and TP rank r of t owns exactly the rows
  [⌊r·N/t⌋, ⌊(r+1)·N/t⌋) — the same cut whatever t.
- dW = dYᵀ·X of every linear: a token reduction (distributed/tokensum.py) — the local stream is
  cut into leaves (each inside one sample; TOKEN_LEAF tokens on CPU, CUDA_TOKEN_LEAF on CUDA),
  tokens summed in order inside a leaf (`token_leaf_partials`), the leaf partials added exactly
  and rounded once. On CUDA the partials are made and added inside one kernel
  (kernels/triton_grad_weight.py), never written out per leaf. In direct mode with a one-rank scope group the kernel's
  double words are rounded straight to the fp32 gradient (`_rounded_rows`): the same bytes.

Compute dtype (`--dtype`, DESIGN.md "Precision"): the linears take `compute_dtype` (fp32, or bf16
for bf16 runs). With bf16 there are two rounding points per linear, the same on every rank and in
rollout and trainer: the input activation x is rounded to bf16 (round-to-nearest-even) before the
forward product, and the incoming gradient dY before the dX and dW products; weights already hold
bf16 values, so casting them is exact. Products accumulate in fp32 in the fixed K order and every
output (y, dX partials, dW leaf partials) is fp32. On CUDA the bf16 operands go to the tensor
cores; on CPU they are widened to fp32 (a bf16×bf16 product is exact in fp32), so the CPU runs
the same rounding points through its sequential fp32 chain and its topology matrix covers the
bf16 logic. The rounded x is what the backward keeps (half the bytes of fp32).

CUDA tensors dispatch to the Triton kernels of kernels/triton_matmul.py (same contract, its own
bits); the trees stay here. Does not: communicate (rlkernel/distributed/ adds the collectives).
"""

from __future__ import annotations

import torch

from typing import Sequence

from rlkernel.distributed.tokensum import TokenSum, leaves_of
from rlkernel.kernels.triton_util import cast
from rlkernel.numerics import fixedpoint as fx
from rlkernel.numerics.trees import tree_combine, tree_sum
from rlkernel.spec import VIRTUAL_TP

_CHUNK_ELEMS = 1 << 24  # bound on the [.., M, N] working set of one elementwise step


def _triton():
    from rlkernel.kernels import triton_matmul  # lazy: CPU installs need no triton
    return triton_matmul


def operand_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """The dtype two operands are multiplied in: their own when both share a 16-bit dtype
    (tensor cores on CUDA, fp32 accumulation), else float32 (the fp32 fma chain)."""
    if a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return a.dtype
    return torch.float32


def _shard_kernel():
    from rlkernel.kernels import triton_shard_matmul  # lazy, as _triton
    return triton_shard_matmul


def _grad_weight_kernel():
    from rlkernel.kernels import triton_grad_weight  # lazy, as _triton
    return triton_grad_weight


def seq_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with one fixed sequential fp32 order over K for every output element.

    Shapes: a [..., M, K], b [..., K, N] (batch dims broadcast) -> [..., M, N], fp32.
    Raises ValueError on mismatched K.
    """
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"seq_matmul: K mismatch {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.is_cuda:
        return _triton().seq_matmul(a, b)
    a = a.to(torch.float32)
    b = b.to(torch.float32)
    k_len = a.shape[-1]
    out_shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    if k_len == 0:
        return torch.zeros(out_shape, dtype=torch.float32, device=a.device)
    # Rows are independent, so cutting M into chunks cannot change any element.
    m = a.shape[-2]
    per_row = max(1, out_shape.numel() // max(m, 1))
    rows = max(1, _CHUNK_ELEMS // per_row)
    if m > rows:
        return torch.cat([seq_matmul(a[..., i:i + rows, :], b) for i in range(0, m, rows)], dim=-2)
    acc = a[..., :, 0:1] * b[..., 0:1, :]
    acc = acc.expand(out_shape).contiguous()
    tmp = torch.empty_like(acc)
    for k in range(1, k_len):
        torch.mul(a[..., :, k:k + 1], b[..., k:k + 1, :], out=tmp)
        acc.add_(tmp)
    return acc


COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes the linears compute in (operands; accumulation and outputs are always fp32)."""


def check_compute_dtype(compute_dtype: torch.dtype) -> None:
    """ValueError for a compute dtype outside COMPUTE_DTYPES, naming the allowed ones."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype {compute_dtype} is not supported; allowed: "
                         f"{', '.join(str(d) for d in COMPUTE_DTYPES)}")


def rounding_point(x: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """x rounded to the linears' compute dtype (round-to-nearest-even; a no-op for fp32).
    ValueError for a dtype outside COMPUTE_DTYPES."""
    check_compute_dtype(compute_dtype)
    return cast(x, compute_dtype)


def weight_point(w: torch.Tensor, compute_dtype: torch.dtype, tok: TokenSum | None) -> torch.Tensor:
    """Parameter w in the compute dtype for a product: `rounding_point(w, compute_dtype)`, or
    the open sink's copy kept for the mini-batch (GradSink.compute_copy: one cast per weight
    and mini-batch instead of two per microbatch). The same values either way."""
    sink = tok.sink if tok is not None else None
    held = sink.compute_copy(w, compute_dtype) if sink is not None else None
    return held if held is not None else rounding_point(w, compute_dtype)


def linear_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ wᵀ, full-K sequential (column-parallel forward). x [M, K], w [N, K] -> [M, N] fp32.
    Operands of one 16-bit dtype on CUDA take the tensor-core kernel (TMA at large M)."""
    if x.is_cuda and x.dtype == w.dtype and x.dtype != torch.float32:
        return _triton().linear_nt(x, w)
    return seq_matmul(x, w.t())


def row_parallel_nt(x: torch.Tensor, w: torch.Tensor, shards: int = VIRTUAL_TP) -> torch.Tensor:
    """x @ wᵀ with K cut into `shards` virtual-TP shards summed by the pairwise tree.

    x [M, K], w [N, K], K % shards == 0 -> [M, N] fp32. Equals the tree of per-shard partials that
    a TP group computes and tree-all-reduces (rlkernel.distributed). On CUDA the tree runs inside
    one kernel (kernels/triton_shard_matmul.py: the same bytes).
    """
    k = x.shape[-1]
    if x.is_cuda and shards in (1, 2, 4, 8) and k % shards == 0 and k >= shards:
        ks = k // shards
        if _shard_kernel().worth_fusing(operand_dtype(x, w),
                                        [[(s * ks, (s + 1) * ks)] for s in range(shards)],
                                        long_shards=False):
            return _shard_kernel().row_parallel_nt(x, w, shards)
    return shard_sum(row_parallel_partials(x, w, shards))


def shard_sum(p: torch.Tensor) -> torch.Tensor:
    """tree_sum(p, 0) of virtual-shard partials p [S, M, N] fp32: on CUDA, for a power-of-two S,
    one Triton pass of the same tree (triton_matmul.shard_tree_sum: the same bytes)."""
    n = p.shape[0]
    if p.is_cuda and p.dtype == torch.float32 and n & (n - 1) == 0 and 1 <= n <= 64:
        return _triton().shard_tree_sum(p)
    return tree_sum(p, 0)


def row_parallel_partials(x: torch.Tensor, w: torch.Tensor, shards: int = VIRTUAL_TP) -> torch.Tensor:
    """Per-virtual-shard partial products: [shards, M, N] fp32 (shard s uses K slice s)."""
    k = x.shape[-1]
    if k % shards:
        raise ValueError(f"row-parallel linear: K={k} is not a multiple of virtual_tp={shards}")
    if x.is_cuda:
        return _triton().row_parallel_partials(x, w, shards)
    ks = k // shards
    return torch.stack([linear_nt(x[:, s * ks:(s + 1) * ks], w[:, s * ks:(s + 1) * ks])
                        for s in range(shards)])


def virtual_shard_rows(n: int, shards: int = VIRTUAL_TP) -> tuple[tuple[int, int], ...]:
    """Canonical rows of each virtual shard when N rows are cut into `shards`: shard s holds
    [⌊s·n/shards⌋, ⌊(s+1)·n/shards⌋) — equal parts when shards divides n, else parts that differ
    by one row (some empty when n < shards).

    Why floor bounds: for any t dividing `shards`, the aligned block of shards/t shards of rank r
    covers rows [⌊r·n/t⌋, ⌊(r+1)·n/t⌋), and cutting a block of exactly n/t rows locally by this
    rule gives the global bounds shifted: the split is the same at every TP degree.
    Raises ValueError for n < 0 or shards < 1.
    """
    if n < 0 or shards < 1:
        raise ValueError(f"virtual_shard_rows: n={n} must be >= 0 and shards={shards} >= 1")
    return tuple((s * n // shards, (s + 1) * n // shards) for s in range(shards))


def column_parallel_dx(dy: torch.Tensor, w: torch.Tensor, shards: int = VIRTUAL_TP) -> torch.Tensor:
    """dX = dY @ W for a column-parallel weight: N cut into virtual-TP shards, tree-summed.

    dy [M, N], w [N, K] -> [M, K] fp32. Any N >= 1: shard s holds the rows of
    `virtual_shard_rows(N, shards)`; empty shards (N < shards) are absent leaves of the tree.
    """
    n = w.shape[0]
    if n < 1:
        raise ValueError(f"column-parallel linear: N={n} rows; at least one is needed")
    rows = virtual_shard_rows(n, shards)
    if dy.is_cuda and _shard_kernel().worth_fusing(operand_dtype(dy, w), [[r] for r in rows]):
        return _shard_kernel().column_dx([dy], [w], [rows])    # the tree in one kernel
    if dy.is_cuda and n % shards == 0:   # one launch; the same shards as the loop below
        return shard_sum(_triton().column_dx_partials(dy, w, shards))
    parts = [seq_matmul(dy[:, a:b], w[a:b]) if b > a else None for a, b in rows]
    return tree_combine(parts)  # type: ignore[return-value]  (n >= 1: some shard has a row)


def token_leaf_partials(dy: torch.Tensor, x: torch.Tensor, leaves: int) -> torch.Tensor:
    """Per-leaf dWᵀ partials of dW = dYᵀ·X: [leaves, N, K] fp32, tokens in order inside a leaf.

    dy [L, N], x [L, K], L % leaves == 0 (leaf i = rows [i·L/leaves, (i+1)·L/leaves)).
    """
    n_tok = dy.shape[0]
    if n_tok % leaves:
        raise ValueError(f"token leaves: stream length {n_tok} is not a multiple of {leaves} leaves")
    if dy.is_cuda:
        return _triton().token_leaf_partials(dy, x, leaves)
    m = n_tok // leaves
    dyl = dy.to(torch.float32).reshape(leaves, m, dy.shape[1])
    xl = x.to(torch.float32).reshape(leaves, m, x.shape[1])
    # [leaves, N, m] @ [leaves, m, K]: the sequential K-loop runs over the m tokens of each leaf.
    return seq_matmul(dyl.transpose(1, 2), xl)


def accumulate_grad_weight_(acc: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """acc [N, K, N_COLS] += exact Σ over the leaves of the stream of their dWᵀ partials (dy
    [L, N], x [L, K]; CPU: TOKEN_LEAF leaves, CUDA: CUDA_TOKEN_LEAF leaves, L a multiple of the
    backend's leaf; ValueError otherwise); returns acc."""
    if dy.is_cuda:   # partials made and added inside one kernel
        return _grad_weight_kernel().accumulate_grad_weight_(acc, dy, x)[0]
    leaves = leaves_of(dy.shape[0])
    n = dy.shape[1]
    rows = max(1, _CHUNK_ELEMS // max(1, leaves * x.shape[1]))   # rows of dW are independent
    for i in range(0, n, rows):
        fx.accumulate_(acc[i:i + rows], token_leaf_partials(dy[:, i:i + rows], x, leaves))
    return acc


def token_grad_weight(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dYᵀ·X over one stream on one rank, by the canonical token reduction (leaf partials
    added exactly, rounded once). dy [L, N], x [L, K] (L % TOKEN_LEAF == 0) -> [N, K] fp32."""
    acc = fx.zeros((dy.shape[1], x.shape[1]), dy.device)
    return fx.round_fp32(accumulate_grad_weight_(acc, dy, x))


def _rounded_rows(dy: torch.Tensor, x: torch.Tensor):
    """`words_rows` for TokenSum.finish_now: on CUDA, rows [a, b) of dW rounded straight from
    the fused kernel's double words, with the count of still-flagged tiles left on the device
    (a deferred chunk: the sink redoes it by the digit path if the count is not 0); None on
    CPU, whose path has no double words (it stays as it is)."""
    if not dy.is_cuda:
        return None
    kernel = _grad_weight_kernel()
    return lambda a, b: kernel.rounded_grad_weight_deferred(dy[:, a:b], x)


def _word_rows(dy: torch.Tensor, x: torch.Tensor):
    """`word_rows` for TokenSum.finish_now: on CUDA, rows [a, b) of dW as the fused kernel's
    double words with the count of still-flagged tiles on the device (summed over a scope group
    of several ranks as words, GradSink.finish_direct); None on CPU (no double words)."""
    if not dy.is_cuda:
        return None
    kernel = _grad_weight_kernel()
    return lambda a, b: kernel.words_grad_weight_deferred(dy[:, a:b], x)


def grad_weight(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                tok: TokenSum | None) -> torch.Tensor | None:
    """w's gradient dW = dYᵀ·X through `tok` (distributed/tokensum.py): None when tok's sink is
    open (the sink keeps the exact sum), else the exact sum over this rank's leaves and tok.comm,
    rounded, in w's dtype. dy [L, N], x [L, K] (L = this rank's local stream), w [N, K].
    A deferred chunk's redo may run after this returns (GradSink._defer): RuntimeError then if
    dy or x was changed in place meanwhile (their version counters)."""
    tok = tok or TokenSum.single()
    unchanged = _unchanged_since_now(dy, x)

    def add_rows(a: int, b: int, acc: torch.Tensor) -> None:
        unchanged()
        accumulate_grad_weight_(acc, dy[:, a:b], x)
    if tok.finish_now(w, add_rows, "token-sum-dw", words_rows=_rounded_rows(dy, x),
                      add_rows_at=lambda rows, acc: accumulate_grad_weight_(acc, dy[:, rows], x),
                      word_rows=_word_rows(dy, x)):
        return None
    if dy.is_cuda and _carry_words(dy, x, w, tok):
        return None
    acc = accumulate_grad_weight_(tok.accumulator(w), dy, x)
    return tok.result(w, acc, "token-sum-dw")


def _carry_words(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, tok: TokenSum) -> bool:
    """On CUDA with an open sink (several microbatches), add this call's dW into the sink's
    double words for w (kernels/triton_grad_weight.py `carry_grad_weight_deferred`) and return
    True; False when the sink holds w in digits (or there is no open sink). The kernel's flag
    count stays on the device (`TokenSum.defer_carry`): where a tile turned out unable to hold
    its sum, the sink later moves w to digits (the words added there) and adds that tile's
    partials of this call there — the same exact sum, so the same bytes. dy and x are kept for
    that redo (RuntimeError then if either was changed in place meanwhile)."""
    words = tok.words(w)
    if words is None:
        return False
    kernel = _grad_weight_kernel()
    launches, flagged = kernel.carry_grad_weight_deferred(words, dy, x,
                                                          count=tok.flag_count(dy.device))
    unchanged = _unchanged_since_now(dy, x)

    def redo(acc: torch.Tensor) -> None:
        unchanged()
        kernel.redo_into_digits_(acc, dy, x, kernel.flagged_tiles(launches))
    tok.defer_carry(w, flagged, redo)
    return True


def _unchanged_since_now(dy: torch.Tensor, x: torch.Tensor):
    """A check for a deferred redo of dy, x's dW: RuntimeError if either was changed in place
    since this call (their version counters), when the redo would add other partials."""
    versions = (dy._version, x._version)

    def check() -> None:
        if (dy._version, x._version) != versions:
            raise RuntimeError("grad weight: dy or x was changed in place before a deferred "
                               "dW chunk was redone")
    return check


def column_dx_by_shards(dys, ws, shard_rows, product=seq_matmul) -> torch.Tensor | None:
    """This rank's local subtree of a column-parallel dX, shard by shard: per local virtual
    shard s, the projections' partials product(dY_i[:, rows], W_i[rows]) (rows =
    shard_rows[i][s]) added in projection order — a projection with no row in the shard is
    skipped, not added as zeros — then the shards by the pairwise tree (tree_combine); the TP
    tree all-reduce (parallel.enter_tp) finishes it. dys [M, N_i], ws [N_i, K] -> [M, K] fp32,
    or None when no shard has a row. `product` (default seq_matmul) lets the Triton tests run
    the same loop on the interpreter's bmm; kernels/triton_shard_matmul.py fuses it."""
    parts = []
    for s in range(len(shard_rows[0])):
        acc = None
        for dy, w, rows in zip(dys, ws, shard_rows):
            a, b = rows[s]
            if b > a:
                p = product(dy[:, a:b], w[a:b])
                acc = p if acc is None else acc + p
        parts.append(acc)
    return tree_combine(parts)


class _ColumnParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard_rows, tok, cd, *ws):
        xr = rounding_point(x, cd)
        ctx.save_for_backward(xr, *ws)
        # The parameters themselves key the gradient sink: saved tensors may come back as other
        # objects (activation checkpointing unpacks recomputed ones).
        ctx.shard_rows, ctx.tok, ctx.params, ctx.cd = shard_rows, tok, ws, cd
        return tuple(linear_nt(xr, weight_point(w, cd, tok)) for w in ws)

    @staticmethod
    def backward(ctx, *dys):
        x, *_ = ctx.saved_tensors
        dx, dws = column_grads(x, dys, ctx.params, ctx.shard_rows, ctx.cd, ctx.tok,
                               ctx.needs_input_grad[0], ctx.needs_input_grad[4:])
        return (dx, None, None, None) + dws


def column_grads(xr: torch.Tensor, dys: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                 shard_rows, cd: torch.dtype, tok: TokenSum | None, need_dx: bool,
                 need_dw: Sequence[bool]) -> tuple[torch.Tensor | None, tuple]:
    """A column-parallel linear's backward (`column_parallel_linear`): (dX [M, K] fp32, this
    rank's local subtree, or None when not needed; each weight's dW through `tok`, or None).
    xr: the forward's rounded input; dys: the outputs' gradients (rounded here to cd)."""
    dys = tuple(rounding_point(dy, cd) for dy in dys)
    ws = [weight_point(w, cd, tok) for w in params]
    dx = None
    if need_dx and xr.is_cuda and _shard_kernel().worth_fusing(
            operand_dtype(dys[0], ws[0]),
            [[rows[s] for rows in shard_rows] for s in range(len(shard_rows[0]))]):
        dx = _shard_kernel().column_dx(dys, ws, shard_rows)   # the loop below, fused
    elif need_dx:
        dx = column_dx_by_shards(dys, ws, shard_rows)
        if dx is None:   # this rank owns no row of any projection (N < TP): no partial
            dx = torch.zeros(xr.shape, dtype=torch.float32, device=xr.device)
    dws = tuple(grad_weight(dy, xr, w, tok) if need else None
                for need, dy, w in zip(need_dw, dys, params))
    return dx, dws


class _RowParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, local_shards, tok, cd):
        xr = rounding_point(x, cd)
        ctx.save_for_backward(xr, w)
        ctx.tok, ctx.param, ctx.cd = tok, w, cd   # the parameter keys the sink (see column)
        ctx.x_dtype = x.dtype
        return row_parallel_nt(xr, weight_point(w, cd, tok), local_shards)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, _ = ctx.saved_tensors
        # dX in x's dtype: a bf16 x (the attention output) takes its gradient rounded to bf16
        # here, once (round to nearest even), as a widening cast's backward would.
        dx, dw = row_grads(x, dy, ctx.param, ctx.cd, ctx.tok, ctx.needs_input_grad[0],
                           ctx.needs_input_grad[1])
        return (None if dx is None else dx.to(ctx.x_dtype)), dw, None, None, None


def row_grads(xr: torch.Tensor, dy: torch.Tensor, param: torch.Tensor, cd: torch.dtype,
              tok: TokenSum | None, need_dx: bool, need_dw: bool):
    """A row-parallel linear's backward (`row_parallel_linear`): (dX [M, K_local] fp32 or None,
    dW through `tok` or None). xr: the forward's rounded input; dy rounded here to cd."""
    dy = rounding_point(dy, cd)
    dx = seq_matmul(dy, weight_point(param, cd, tok)) if need_dx else None
    dw = grad_weight(dy, xr, param, tok) if need_dw else None
    return dx, dw


def column_parallel_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], *,
                           shard_rows: Sequence[Sequence[tuple[int, int]]] | None = None,
                           local_shards: int = VIRTUAL_TP, tok: TokenSum | None = None,
                           compute_dtype: torch.dtype = torch.float32):
    """Invariant y_i = x·w_iᵀ for projections sharing x (QKV, gate/up, LM head).

    x [M, K] fp32, weights [N_i, K] (this rank's rows) -> tuple of [M, N_i] fp32.
    Backward: dX is this rank's *local subtree* of the virtual-TP tree over its `local_shards`
    virtual shards: per shard, the projections' partials over that shard's rows added in order,
    then the shards tree-summed; `parallel.enter_tp` finishes it across TP. `shard_rows[i][s]` =
    (start, stop) local rows of weight i in local shard s (model/sharding.dx_shard_rows: the
    canonical `virtual_shard_rows` of the logical tensor, which also says which rows of a
    replicated KV head this rank owns); default `virtual_shard_rows(N_i, local_shards)`, the
    canonical cut whenever the rank holds exactly its 1/TP block of rows. dW by the token
    reduction through `tok` (the local stream a multiple of TOKEN_LEAF rows). `compute_dtype`:
    fp32, or bf16 with x and dY rounded to bf16 at the products (module doc, rounding points).
    Raises ValueError when shard_rows does not give `local_shards` in-range row ranges per weight,
    or for a compute dtype outside COMPUTE_DTYPES.
    """
    if shard_rows is None:
        shard_rows = [virtual_shard_rows(w.shape[0], local_shards) for w in weights]
    shard_rows = tuple(tuple((int(a), int(b)) for a, b in rows) for rows in shard_rows)
    if len(shard_rows) != len(weights) or any(
            len(rows) != local_shards or any(not 0 <= a <= b <= w.shape[0] for a, b in rows)
            for rows, w in zip(shard_rows, weights)):
        raise ValueError(f"column_parallel_linear: shard_rows {shard_rows} must give "
                         f"{local_shards} row ranges inside each weight of rows "
                         f"{[w.shape[0] for w in weights]}")
    check_compute_dtype(compute_dtype)   # before any work
    return _ColumnParallelLinear.apply(x, shard_rows, tok, compute_dtype, *weights)


def row_parallel_linear(x: torch.Tensor, w: torch.Tensor, *, local_shards: int = VIRTUAL_TP,
                        tok: TokenSum | None = None,
                        compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's subtree of y = x·wᵀ with K cut into virtual-TP shards (o_proj, down_proj).

    x [M, K_local] fp32 (or already in the compute dtype: the attention output of bf16 runs),
    w [N, K_local] (K_local = local_shards shards) -> [M, N] fp32 partial;
    `parallel.exit_row` finishes the tree across TP (TP=1: the result). Backward: dX local
    (sequential over N) in x's dtype, dW by the token reduction through `tok`. `compute_dtype`: as
    column_parallel_linear (ValueError outside COMPUTE_DTYPES).
    """
    check_compute_dtype(compute_dtype)
    return _RowParallelLinear.apply(x, w, local_shards, tok, compute_dtype)
