"""Per-shard log-softmax statistics (m, s, t) for the finish kernel
(kernels/triton_logprobs.finish_stats) and its reference, the torch path on CPU; used by
tests/logprobs_finish_triton_checks.py (interpreter) and tests/test_cuda.py (GPU).

`finish_want(m, s, t)`: logprobs.merge_shard_stats, then lse = m + log32(s), entropy = lse − t/s,
spelt out in torch ops (the reference the kernel must match bitwise).
`finish_case(n, shards, seed)`: m, s, t [n, shards] fp32. Random rows: m = N(0, 1)·scale
(scales 0.1 … 300), s in [1, 1000], t = s·N(0, 1)·10 (as Σ e·z would be). With n >= SPECIAL_ROWS
these rows first:
  0 every shard masked (m = −inf, s = t = 0: the all-masked row, lse = −inf, entropy NaN)
  1 every shard masked but the last (the odd carry of 3 or 5 shards);  2 … but the first
  3 s = 0 in every shard with finite m (log 0 = −inf)
  4 m of very different magnitudes: ±1e30, ±800 (exp64's clamp), ±88, ±1e-30 in turn
  5 m = +inf in shard 0 (exp(+inf) = +inf: Inf·0 and Inf − Inf downstream)
  6 m = NaN in the last shard (torch.maximum propagates it);  7 s and t NaN in shard 0
  8 s = 3e38 in every shard (the merged sums overflow to +inf);  9 s subnormal (1e-45, 1e-40)
  10 m = ±0 in turn (the merged max's zero sign: see triton_logprobs), t = ±0
  11 s = +inf in the last shard;  12 t = ±3e38 (t·f overflows)
then SPECIAL_ROWS plain random rows, and past those (or from row 0 when n < SPECIAL_ROWS) rows
whose every entry is random (90 %) or one of the special entries above.
Does not: run anything (no triton import).
"""

from __future__ import annotations

import torch

from rlkernel.kernels.elementwise import log32
from rlkernel.kernels.logprobs import merge_shard_stats

SPECIAL_ROWS = 13
_SCALES = (0.1, 1.0, 3.0, 30.0, 300.0)
INF, NAN = float("inf"), float("nan")
# (m, s, t) entries a random row may draw
_SPECIAL = ((-INF, 0.0, 0.0), (-INF, 0.0, -0.0), (2.5, 0.0, 0.0), (1e30, 1.0, 1e30),
            (-1e30, 7.0, -7e30), (800.0, 3.0, 2400.0), (-800.0, 3.0, -2400.0), (88.0, 2.0, 1.0),
            (INF, 1.0, 1.0), (NAN, 1.0, 1.0), (1.0, NAN, 2.0), (1.0, 2.0, NAN), (0.0, 1.0, -0.0),
            (-0.0, 1.0, 0.0), (3.0, 3e38, -3e38), (-2.0, 1e-45, 1e-40), (0.5, INF, 1.0),
            (4.0, 1.5, INF))


def finish_want(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor):
    """The torch path on CPU: (lse, entropy) [N] of the stats [N, shards]."""
    mm, ss, tt = merge_shard_stats(m.cpu(), s.cpu(), t.cpu())
    lse = mm + log32(ss)
    return lse, lse - tt / ss


def _special_rows(shards: int) -> torch.Tensor:
    """[SPECIAL_ROWS, shards, 3]: the rows 0 … 12 of the module docstring."""
    r = torch.empty(SPECIAL_ROWS, shards, 3)
    r[:] = torch.tensor([1.5, 10.0, 4.0])
    r[:, :, 0] += torch.arange(shards) * 0.75            # distinct maxima
    r[0:3] = torch.tensor([-INF, 0.0, 0.0])
    r[1, -1] = r[2, 0] = torch.tensor([2.0, 5.0, -3.0])
    r[3, :, 1:] = 0.0
    mags = (1e30, -1e30, 800.0, -800.0, 88.0, -88.0, 1e-30, -1e-30)
    r[4, :, 0] = torch.tensor([mags[i % len(mags)] for i in range(shards)])
    r[5, 0, 0] = INF
    r[6, -1, 0] = NAN
    r[7, 0, 1:] = NAN
    r[8, :, 1] = 3e38
    r[9, :, 1] = torch.tensor([(1e-45, 1e-40)[i % 2] for i in range(shards)])
    r[10, :, 0] = torch.tensor([(0.0, -0.0)[i % 2] for i in range(shards)])
    r[10, :, 2] = torch.tensor([(-0.0, 0.0)[i % 2] for i in range(shards)])
    r[11, -1, 1] = INF
    r[12, :, 2] = torch.tensor([(3e38, -3e38)[i % 2] for i in range(shards)])
    return r


def finish_case(n: int, shards: int, seed: int = 0, device: str = "cpu"):
    """(m, s, t) [n, shards] fp32 on `device`; see the module docstring."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([_SCALES[i % len(_SCALES)] for i in range(n)])
    m = torch.randn(n, shards, generator=g) * scale[:, None]
    s = 1.0 + torch.rand(n, shards, generator=g) * 999.0
    t = s * torch.randn(n, shards, generator=g) * 10.0
    x = torch.stack([m, s, t], -1)
    k = SPECIAL_ROWS if n >= SPECIAL_ROWS else 0
    if k:
        x[:k] = _special_rows(shards)
    pick = torch.randint(0, len(_SPECIAL), (n, shards), generator=g)
    mixed = (torch.rand(n, shards, generator=g) < 0.1) & (torch.arange(n) >= 2 * k)[:, None]
    x = torch.where(mixed[..., None], torch.tensor(_SPECIAL)[pick], x)
    return tuple(x[..., i].contiguous().to(device) for i in range(3))
