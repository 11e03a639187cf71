"""RMSNorm statistics for the CUDA backend (Triton): per row r = 1/sqrt(tree(x²)/H + eps), x·r.

Same contract as kernels/norm.py (Zhang & Sennrich 2019): the mean of squares is the canonical
pairwise tree over the row (adjacent pairs, level by level; the row is zero-padded to a power of
two, which leaves that tree unchanged because every square is >= +0). The tree is written as
reshape/split/add levels, each an elementwise IEEE add, so a row's bits never depend on the
tile, the warp layout or the other rows. Division and square root are the correctly rounded
`div_rn` / `sqrt_rn`; r = 1 / sqrt(ms + eps) is two roundings (the CPU backend rounds once from
float64: different backend, different bits, both invariant).

`rms_forward` returns (r, x̂, x̂·w) for the autograd path's forward in one pass (the weight
product as the separate torch op would round it); `rms_stats` only (r, x̂).
`rms_backward` is that path's backward in one pass per (leaf, head): dx with the bytes of the
torch ops it replaces (~20 launches per norm: the product, the log2(H) tree levels, the scaling),
and the weight gradient's per-leaf partials (the TOKEN_LEAF-token sums in order, which
kernels/norm.py then adds exactly through the token reduction).
`rms_norm_apply` is the inference pass (no autograd: the rollout engine's steps): (x̂)·w in the
same kernel, and for Qwen3's Q/K norms the RoPE rotation after it (kernels/rope.apply_rope:
y·cos + rot(y)·sin, rot(y) = [−y₂, y₁], each product and the sum one fp32 rounding, no fma:
enable_fp_fusion=False) — the bytes of the separate passes in one read and one write, instead
of ~7 launches per norm (statistics, weight product, negation, concatenation, two products, a
sum).
Does not: add the weight gradient's partials (kernels/norm.py, distributed/tokensum.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.triton_elementwise import bf16_rtne, neg32, rotate_half, tree_rows
from rlkernel.kernels.triton_util import check_cuda, device_ctx, launch, f32_reciprocal


@triton.jit
def _rstd(x, inv_h_num, eps, BLOCK_R: tl.constexpr, HP: tl.constexpr, LOG_HP: tl.constexpr):
    """r = 1/sqrt(tree(x²)/H + eps) per row of x [BLOCK_R, HP] (zero-padded past H)."""
    ms = tl.math.div_rn(tree_rows(x * x, BLOCK_R, HP, LOG_HP), inv_h_num)
    return tl.math.div_rn(tl.full((BLOCK_R,), 1.0, tl.float32), tl.math.sqrt_rn(ms + eps))


@triton.jit
def _rms_kernel(X, W, XH, Y, R, n_rows, H, inv_h_num, eps,
                HP: tl.constexpr, LOG_HP: tl.constexpr, BLOCK_R: tl.constexpr,
                APPLY: tl.constexpr):
    """r and x̂ = x·r per row; with APPLY also y = x̂·w (W [H] fp32), the training forward's
    output, so the weight product is not a second pass over x̂."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HP)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < H)
    off = rows.to(tl.int64)[:, None] * H + cols[None, :]
    x = tl.load(X + off, mask=ok, other=0.0)
    r = _rstd(x, inv_h_num, eps, BLOCK_R, HP, LOG_HP)
    xh = x * r[:, None]
    tl.store(XH + off, xh, mask=ok)
    tl.store(R + rows, r, mask=rows < n_rows)
    if APPLY:
        tl.store(Y + off, xh * tl.load(W + cols, mask=cols < H, other=0.0)[None, :], mask=ok)


@triton.jit
def _apply_kernel(X, W, COS, SIN, Y, n_rows, H, heads, inv_h_num, eps,
                  HP: tl.constexpr, LOG_HP: tl.constexpr, BLOCK_R: tl.constexpr,
                  ROPE: tl.constexpr, OUT_BF16: tl.constexpr):
    """y = (x·r)·w per row (rows = token·heads + head), then, with ROPE, the rotate-half
    rotation y·cos + rot(y)·sin of kernels/rope.apply_rope (cos/sin rows per token); with
    OUT_BF16 stored rounded to bf16 (round to nearest even, as torch's cast)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HP)
    row_ok = rows < n_rows
    ok = row_ok[:, None] & (cols[None, :] < H)
    off = rows.to(tl.int64)[:, None] * H + cols[None, :]
    x = tl.load(X + off, mask=ok, other=0.0)
    r = _rstd(x, inv_h_num, eps, BLOCK_R, HP, LOG_HP)
    y = (x * r[:, None]) * tl.load(W + cols, mask=cols < H, other=0.0)[None, :]
    if ROPE:        # H == HP here (a power of two): the partner of column i is i ± H/2
        half = HP // 2
        pc = (cols + half) % HP
        xp = tl.load(X + rows.to(tl.int64)[:, None] * H + pc[None, :], mask=ok, other=0.0)
        yp = (xp * r[:, None]) * tl.load(W + pc)[None, :]
        tok = (rows // heads).to(tl.int64)[:, None] * H + cols[None, :]
        y = rotate_half(y, yp, tl.load(COS + tok, mask=ok, other=0.0),
                        tl.load(SIN + tok, mask=ok, other=0.0), cols[None, :] < half)
    if OUT_BF16:
        tl.store(Y + off, bf16_rtne(y), mask=ok)
    else:
        tl.store(Y + off, y, mask=ok)


@triton.jit
def _bwd_kernel(DY, XH, R, W, DX, PART, n_tok, heads, H, inv_h,
                HP: tl.constexpr, LOG_HP: tl.constexpr, LEAF: tl.constexpr,
                WANT_PART: tl.constexpr):
    """Program (leaf, head): the leaf's LEAF tokens of one head, in order. Per row (token·heads
    + head): g = dy·w, dx = r·(g − x̂·(tree(g·x̂)·inv_h)); with WANT_PART the leaf's partial
    Σ_t dy·x̂ in token order into PART row leaf·heads + head."""
    leaf = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, HP)
    c_ok = cols < H
    w = tl.load(W + cols, mask=c_ok, other=0.0)
    # -0.0 is the additive identity (-0 + v == v for every v, +0 and -0 included): the padding
    # of the tree keeps tree_sum's carried odd elements, and the partial starts as its first
    # token's product, as _leaf_sums' clone does. Made by a sign flip: Triton turns a -0.0
    # literal into +0.0 (its constant folding compares the value with 0).
    neg_zero = neg32(tl.zeros((HP,), tl.float32))
    acc = neg_zero
    for i in range(LEAF):
        t = leaf * LEAF + i
        ok = c_ok & (t < n_tok)
        row = t.to(tl.int64) * heads + head
        off = row * H + cols
        dy = tl.load(DY + off, mask=ok, other=0.0)
        xh = tl.load(XH + off, mask=ok, other=0.0)
        r = tl.load(R + row, mask=t < n_tok, other=0.0)
        g = dy * w
        gx = tl.where(c_ok, g * xh, neg_zero)
        q = tree_rows(tl.reshape(gx, (1, HP)), 1, HP, LOG_HP) * inv_h
        tl.store(DX + off, r * (g - xh * q), mask=ok)
        if WANT_PART:
            acc = acc + dy * xh
    if WANT_PART:
        tl.store(PART + (leaf.to(tl.int64) * heads + head) * H + cols, acc, mask=c_ok)


def rms_backward(dy: torch.Tensor, xh: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                 leaf: int, want_part: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kernels/norm.py's RMSNorm backward on CUDA in one pass: (dx, part).

    dy, xh fp32 [L, H] or [L, heads, H] (x̂ = x·r of the forward), r fp32 [L] or [L, heads],
    w fp32 [H]. dx = r·(g − x̂·(tree_sum(g·x̂)/H)), g = dy·w, with the bytes of those torch ops
    on CUDA (`/ H` there is a multiply by fp32 1/H: PyTorch's CUDA division by a CPU scalar).
    part fp32 [L/leaf · heads, H] (want_part; L a multiple of leaf): row leaf·heads + head
    holds the leaf's Σ dy·x̂ over its tokens in order, kernels/norm._leaf_sums' bytes. None
    otherwise. ValueError on a shape or dtype mismatch.
    """
    check_cuda("rms_norm backward", dy, xh, r, w)
    h = _row_width(xh)
    n_tok = xh.shape[0]
    heads = xh.numel() // max(1, n_tok * h)
    if (dy.shape != xh.shape or r.numel() != n_tok * heads or tuple(w.shape) != (h,)
            or {t.dtype for t in (dy, r, w)} != {torch.float32}):
        raise ValueError(f"rms_norm backward: dy {tuple(dy.shape)} {dy.dtype}, x̂ "
                         f"{tuple(xh.shape)}, r {tuple(r.shape)} {r.dtype}, w {tuple(w.shape)} "
                         f"{w.dtype}: fp32, dy like x̂, r one per row, w [{h}] expected")
    if want_part and n_tok % leaf:
        raise ValueError(f"rms_norm backward: {n_tok} tokens are not whole leaves of {leaf}")
    dyc, xhc, rc, wc = dy.contiguous(), xh.contiguous(), r.contiguous(), w.contiguous()
    dx = torch.empty_like(xhc)
    leaves = triton.cdiv(n_tok, leaf)
    part = (torch.empty(leaves * heads, h, dtype=torch.float32, device=xh.device)
            if want_part else None)
    if n_tok == 0 or heads == 0:
        return dx, part
    hp = triton.next_power_of_2(h)
    inv_h = f32_reciprocal(float(h))     # the torch ops' `/ H` on CUDA
    with device_ctx(xh):
        launch(_bwd_kernel, (leaves, heads),
               dyc, xhc, rc, wc, dx, part if want_part else dx, n_tok, heads, h, inv_h, HP=hp,
               LOG_HP=hp.bit_length() - 1, LEAF=leaf, WANT_PART=want_part,
               num_warps=4 if hp >= 1024 else 1, enable_fp_fusion=False)
    return dx, part


def rms_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(r [...], x̂ = x·r [..., H]) for fp32 x [..., H] on CUDA; H <= 65536.

    Raises ValueError for a non-fp32 input or an oversized row.
    """
    r, xh, _ = _stats(x, None, eps)
    return r, xh


def rms_forward(x: torch.Tensor, w: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(r [...], x̂ [..., H], y = x̂·w [..., H]) in one pass: the training forward of
    kernels/norm.py, the bytes of `rms_stats` then the product as a torch op. x fp32 [..., H] on
    CUDA, w fp32 [H] on x's device. Raises ValueError for other dtypes, shapes or an oversized
    row."""
    return _stats(x, w, eps)


def _stats(x: torch.Tensor, w: torch.Tensor | None,
           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`rms_stats` (w None) or `rms_forward`: checks, then one launch of _rms_kernel."""
    check_cuda("rms_norm", x, *(() if w is None else (w,)))
    h = _row_width(x, w)
    xc = x.contiguous()
    n = xc.numel() // h
    xh = torch.empty_like(xc)
    y = None if w is None else torch.empty_like(xc)
    r = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if n == 0:
        return r, xh, y
    hp, block_r, warps = _launch_shape(h)
    wc = xc if w is None else w.contiguous()     # a placeholder pointer when no weight
    with device_ctx(x):
        launch(_rms_kernel, (triton.cdiv(n, block_r),),
               xc, wc, xh, xh if y is None else y, r, n, h, float(h), float(eps), HP=hp,
               LOG_HP=hp.bit_length() - 1, BLOCK_R=block_r, APPLY=w is not None, num_warps=warps,
               enable_fp_fusion=False)
    return r, xh, y


def _row_width(x: torch.Tensor, w: torch.Tensor | None = None) -> int:
    """H of fp32 rows x [..., H]; ValueError for another dtype, H outside [1, 65536], or a
    weight w (when given) that is not fp32 [H]."""
    if x.dtype != torch.float32:
        raise ValueError(f"rms_norm: float32 input expected, got {x.dtype}")
    h = x.shape[-1]
    if not 1 <= h <= 65536:
        raise ValueError(f"rms_norm: row width {h} not in [1, 65536]")
    if w is not None and (w.dtype != torch.float32 or tuple(w.shape) != (h,)):
        raise ValueError(f"rms_norm: float32 w [{h}] expected, got {w.dtype} {tuple(w.shape)}")
    return h


def _launch_shape(h: int) -> tuple[int, int, int]:
    """(HP, BLOCK_R, num_warps) of a row width h."""
    hp = triton.next_power_of_2(h)
    block_r = max(1, min(64, 4096 // hp))
    return hp, block_r, 4 if hp * block_r <= 4096 else 8


def rms_norm_apply(x: torch.Tensor, w: torch.Tensor, eps: float,
                   cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(x·r)·w for fp32 x [..., H] on CUDA and w [H] fp32, in one pass: the bytes of
    `rms_stats` then `x̂ * w` (kernels/norm.py's forward). With cos, sin [L, H] fp32 (x [L,
    heads, H], H a power of two): then kernels/rope.apply_rope's rotation, same bytes.
    out_dtype bf16: the result rounded as `.to(torch.bfloat16)` does (a linear's rounding point,
    taken here instead of by another pass). No autograd (inference: the rollout engine and
    no-grad passes). ValueError on bad input."""
    check_cuda("rms_norm", x, w)
    h = _row_width(x, w)
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"rms_norm: out_dtype {out_dtype} not in (float32, bfloat16)")
    rope = cos is not None
    heads = 1
    if rope:
        if (x.dim() != 3 or h & (h - 1) or h < 2 or sin is None
                or tuple(cos.shape) != (x.shape[0], h) or cos.shape != sin.shape
                or cos.dtype != torch.float32 or sin.dtype != torch.float32):
            raise ValueError(f"rms_norm+rope: x [L, heads, D] with D a power of two and fp32 "
                             f"cos/sin [L, D] expected, got x {tuple(x.shape)}, cos "
                             f"{None if cos is None else tuple(cos.shape)}")
        heads = x.shape[1]
        cos, sin = cos.contiguous(), sin.contiguous()
    xc, wc = x.contiguous(), w.contiguous()
    y = torch.empty_like(xc, dtype=out_dtype)
    n = xc.numel() // h
    if n == 0:
        return y
    hp, block_r, warps = _launch_shape(h)
    with device_ctx(x):
        launch(_apply_kernel, (triton.cdiv(n, block_r),),
               xc, wc, cos if rope else wc, sin if rope else wc, y, n, h, heads, float(h),
               float(eps), HP=hp, LOG_HP=hp.bit_length() - 1, BLOCK_R=block_r, ROPE=rope,
               OUT_BF16=out_dtype == torch.bfloat16, num_warps=warps, enable_fp_fusion=False)
    return y
