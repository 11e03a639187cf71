"""Inputs for the d-logits kernel (kernels/triton_dlogits.py) that reach every branch of
logprobs._dlogits; used by tests/dlogits_triton_checks.py (interpreter) and
tests/test_cuda_backward.py (GPU).

`dlogits_case(n, v, T, live)`: (logits, z, targets, lse, ent, g_lp, g_ent) for n >= 1 rows:
z = logprobs._div_t(logits, T, live) (ids >= live are −inf: p = 0, d logit ±0), lse and ent
from the forward (logprobs._forward_stats), random logits of scales 0.1 … 300 (at 300 and at
small T most p underflow to 0), and with n >= SPECIAL_ROWS these rows first:
  0 target at column 0;  1 target at column v − 1 (a masked id when live < v)
  2 logits ramp so that logp spans [−120, 0]: p through the fp32 subnormals down to 0
  3 lse set below max z by 700 … 720: logp crosses exp64's clamp at 709 (p = +Inf)
  4 lse set above max z by 800: logp < −745, exp64's zero branch
  5 lse set so that logp spans [87, 89]: p crosses fp32 overflow (88.72) from finite float64
  6 … 12 g_lp = 0, −0, 3e38, −1e30, 1e-40 (subnormal), −2.5, 1; g_ent = −0, 2, 1e30, 0, 1,
    −3e38, 0.3 (their products and the division by a small T overflow to ±Inf)
  13 target at column live − 1;  14 all logits equal;  15 one logit (the target's) 1e4 above
The lse/ent overrides make rows that no consistent forward gives: the kernel must follow the
torch path on them too (its inputs are not checked). Does not: run anything (no triton import).
"""

from __future__ import annotations

import torch

from rlkernel.kernels.logprobs import _div_t, _forward_stats

SPECIAL_ROWS = 16
_SCALES = (0.1, 1.0, 3.0, 30.0, 300.0)


def dlogits_case(n: int, v: int, temperature: float, live: int | None = None, seed: int = 0,
                 device: str = "cpu"):
    """(logits, z, targets, lse, ent, g_lp, g_ent) on `device`; see the module docstring."""
    g = torch.Generator().manual_seed(seed)
    n_live = v if live is None else live
    scale = torch.tensor([_SCALES[i % len(_SCALES)] for i in range(n)])
    logits = torch.randn(n, v, generator=g) * scale[:, None]
    targets = torch.randint(0, n_live, (n,), generator=g)
    g_lp = torch.randn(n, generator=g)
    g_ent = torch.randn(n, generator=g) * 0.3
    special = n >= SPECIAL_ROWS
    if special:
        targets[0], targets[1], targets[13] = 0, v - 1, n_live - 1
        logits[2] = torch.linspace(-120.0, 0.0, v) * temperature
        logits[3] = torch.linspace(-20.0, 0.0, v) * temperature
        logits[5] = torch.linspace(-2.0, 0.0, v) * temperature
        logits[14] = 0.5
        logits[15, targets[15]] = logits[15].max() + 1e4 * temperature
        g_lp[6:13] = torch.tensor([0.0, -0.0, 3e38, -1e30, 1e-40, -2.5, 1.0])
        g_ent[6:13] = torch.tensor([-0.0, 2.0, 1e30, 0.0, 1.0, -3e38, 0.3])
    logits = logits.to(device)
    z = _div_t(logits, temperature, live)
    lse, ent = _forward_stats(z, 1)
    if special:
        zmax = z[:, :n_live].amax(1)
        lse[3] = zmax[3] - 720.0
        lse[4] = zmax[4] + 800.0
        lse[5] = zmax[5] - 89.0
    return logits, z, targets.to(device), lse, ent, g_lp.to(device), g_ent.to(device)
