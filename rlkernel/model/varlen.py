"""Stock flash variable-length attention for the native arm: what users with remove-padding run.

FlashAttention-2 (Dao 2023, arXiv 2307.08691) takes packed q/k/v [L, heads, D] and cu_seqlens
(each sequence's first row, then the stream's end) and attends within each segment, with no
per-sample copies; torch exposes it as `torch.nn.attention.varlen.varlen_attn` (flash backend,
with autograd). `NativeOps.attention_packed` calls `flash_varlen_attention` on a layout's
`StreamLayout.packed_segments` where `usable` says it can run.
Its signature moved between torch releases, so the call is built from `inspect.signature`:
causality is window_size=(-1, 0) (2.11 on) or is_causal=True (2.10); GQA is enable_gqa=True
where the parameter exists, else K/V heads repeated to the query heads (repeat_interleave: query
head h reads KV head h // (Hq / Hkv), as SDPA's enable_gqa does); the scale is passed where
`scale` exists, else only torch's default 1/sqrt(D) can run.
Does not: run on CPU (flash is CUDA-only; the native arm gathers per-sample copies there), or
read a CP-gathered key stream (the segments then differ between queries and keys).
"""

from __future__ import annotations

import functools
import inspect
import math

import torch

from rlkernel.model.layout import PackedSegments

FLASH_DTYPES = (torch.bfloat16, torch.float16)
FLASH_MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=1)
def _varlen_attn():
    """(varlen_attn, its parameter names), or None where this torch has no varlen module."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


@functools.lru_cache(maxsize=16)
def _flash_capable(device: torch.device) -> bool:
    """FlashAttention-2 needs sm80 or newer (a host query, cached per device)."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def usable(q: torch.Tensor, k: torch.Tensor, seg: PackedSegments | None, scale: float,
           dtype: torch.dtype) -> bool:
    """Whether `flash_varlen_attention` can take q [L, Hq, D] and k [L, Hkv, D] in `dtype`
    over `seg`: CUDA on sm80+, varlen_attn importable, a 16-bit dtype, D a multiple of 8 up to
    256, Hkv dividing Hq, both streams seg's rows, and the scale expressible. Host-only checks
    (no device sync)."""
    found = _varlen_attn()
    if seg is None or found is None or not q.is_cuda or dtype not in FLASH_DTYPES:
        return False
    if not found[1] & {"window_size", "is_causal"}:
        return False                               # no way to ask for causal masking
    d, hq, hkv = q.shape[-1], q.shape[1], k.shape[1]
    if d % 8 or d > FLASH_MAX_HEAD_DIM or hq % hkv:
        return False
    if q.shape[0] != seg.n_rows or k.shape[0] != seg.n_rows:
        return False
    if "scale" not in found[1] and not math.isclose(scale, 1.0 / math.sqrt(d), rel_tol=1e-12):
        return False
    return _flash_capable(q.device)


def flash_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           seg: PackedSegments, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Causal attention of each segment of seg over its own rows: q [L, Hq, D], k/v [L, Hkv,
    D] (any float dtype; cast to `dtype`, bf16 or fp16) -> [L, Hq, D] in `dtype`, differentiable
    (flash's backward). Rows no sample owns (seg.owned False: padding and leading rows) are
    +0, as the gather path's scatter leaves them, and pass no gradient back. Check `usable`
    first."""
    fn, params = _varlen_attn()
    q, k, v = (t.to(dtype) for t in (q, k, v))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        kw["scale"] = scale
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu = seg.cu_seqlens
    out = fn(q, k, v, cu, cu, seg.max_len, seg.max_len, **kw)
    if seg.owned is None:
        return out
    return torch.where(seg.owned[:, None, None], out, out.new_zeros(()))
