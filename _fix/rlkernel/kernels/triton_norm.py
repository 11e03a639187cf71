"""RMSNorm statistics for the CUDA backend (Triton): per row r = 1/sqrt(tree(x²)/H + eps), x·r.

Same contract as kernels/norm.py (Zhang & Sennrich 2019): the mean of squares is the canonical
pairwise tree over the row (adjacent pairs, level by level; the row is zero-padded to a power of
two, which leaves that tree unchanged because every square is >= +0). The tree is written as
reshape/split/add levels, each an elementwise IEEE add, so a row's bits never depend on the
tile, the warp layout or the other rows. Division and square root are the correctly rounded
`div_rn` / `sqrt_rn`; r = 1 / sqrt(ms + eps) is two roundings (the CPU backend rounds once from
float64: different backend, different bits, both invariant).

Does not: apply the weight or run the backward (kernels/norm.py does both with torch ops on the
returned x̂ and r, so the weight gradient keeps its token reduction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels.triton_util import check_cuda, device_ctx


@triton.jit
def _rms_kernel(X, XH, R, n_rows, H, inv_h_num, eps,
                HP: tl.constexpr, LOG_HP: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HP)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < H)
    off = rows.to(tl.int64)[:, None] * H + cols[None, :]
    x = tl.load(X + off, mask=ok, other=0.0)
    v = x * x
    for lvl in tl.static_range(LOG_HP):
        a, b = tl.split(tl.reshape(v, (BLOCK_R, HP >> (lvl + 1), 2)))
        v = a + b
    ss = tl.reshape(v, (BLOCK_R,))
    ms = tl.math.div_rn(ss, inv_h_num)
    r = tl.math.div_rn(tl.full((BLOCK_R,), 1.0, tl.float32), tl.math.sqrt_rn(ms + eps))
    tl.store(XH + off, x * r[:, None], mask=ok)
    tl.store(R + rows, r, mask=rows < n_rows)


def rms_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(r [...], x̂ = x·r [..., H]) for fp32 x [..., H] on CUDA; H <= 65536.

    Raises ValueError for a non-fp32 input or an oversized row.
    """
    check_cuda("rms_norm", x)
    if x.dtype != torch.float32:
        raise ValueError(f"rms_norm: float32 input expected, got {x.dtype}")
    h = x.shape[-1]
    if not 1 <= h <= 65536:
        raise ValueError(f"rms_norm: row width {h} not in [1, 65536]")
    xc = x.contiguous()
    n = xc.numel() // h
    xh = torch.empty_like(xc)
    r = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if n == 0:
        return r, xh
    hp = triton.next_power_of_2(h)
    block_r = max(1, min(64, 4096 // hp))
    warps = 4 if hp * block_r <= 4096 else 8
    with device_ctx(x):
        _rms_kernel[(triton.cdiv(n, block_r),)](xc, xh, r, n, h, float(h), float(eps),
                                                HP=hp, LOG_HP=hp.bit_length() - 1,
                                                BLOCK_R=block_r, num_warps=warps,
                                                enable_fp_fusion=False)
    return r, xh
