"""Learning-rate schedule: linear warmup, then constant, cosine or linear decay to 0.

The rate of an optimizer update is a pure float64 function of the update's index in the run
(RL step × updates per step + position in the step), the base rate and the run's update count,
so every rank computes the same bits and a resumed run continues exactly where it stopped (the
index comes from the step cursor, not from state). A skipped update (--on-nonfinite skip) still
moves the schedule on, like a clock.

Update k = 1, 2, ..., T (T = --steps × --ppo-epochs × --mini-batches, W = --lr-warmup-steps < T):
  k <= W:  lr · k / W                                    (linear warmup; Goyal et al. 2017,
                                                          arXiv 1706.02677 §2.2)
  k > W:   p = (k − 1 − W) / (T − W), in [0, 1)
           constant: lr;  linear: lr · (1 − p);  cosine: lr · (1 + cos(π p)) / 2
                                                         (SGDR without restarts: Loshchilov &
                                                          Hutter, arXiv 1608.03983 eq. 5)
The first update after warmup uses the full rate and the last one a small positive rate, so no
update of the run is wasted at rate 0.
Does not: apply the rate (train/optimizer.py AdamW.step takes it).
Tests: `.venv/bin/python -m pytest -q tests/test_ppo.py -k schedule`.
"""

from __future__ import annotations

import math

from rlkernel.config import LR_SCHEDULES


def learning_rate(base: float, update: int, total: int, warmup: int = 0,
                  schedule: str = "constant") -> float:
    """The rate (float64) of 1-based optimizer update `update` of `total`.

    Raises ValueError if update is not in [1, total], warmup not in [0, total), or the schedule
    is unknown.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"--lr-schedule {schedule!r} is not known; allowed: "
                         f"{', '.join(LR_SCHEDULES)}")
    if not 1 <= update <= total:
        raise ValueError(f"optimizer update {update} is outside the run's 1..{total}")
    if not 0 <= warmup < total:
        raise ValueError(f"--lr-warmup-steps {warmup}: must be in [0, {total})")
    base = float(base)
    if update <= warmup:
        return base * update / warmup
    if schedule == "constant":
        return base
    p = (update - 1 - warmup) / (total - warmup)
    if schedule == "linear":
        return base * (1.0 - p)
    return base * (0.5 * (1.0 + math.cos(math.pi * p)))
