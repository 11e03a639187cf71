"""Small helpers shared by the Triton wrappers (rlkernel/kernels/triton_*.py).

`check_cuda` rejects tensors the kernels cannot read; `device_ctx` makes the tensor's GPU current
for the launch. With TRITON_INTERPRET=1 (Triton's CPU interpreter, used to check kernel logic on a
machine without a GPU) CPU tensors are accepted. Does not: launch anything.
"""

from __future__ import annotations

import contextlib
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def check_cuda(what: str, *ts: torch.Tensor) -> None:
    """ValueError unless every tensor is on one CUDA device (any device under the interpreter)."""
    devs = {t.device for t in ts}
    if len(devs) != 1:
        raise ValueError(f"{what}: tensors on different devices {sorted(map(str, devs))}")
    if not INTERPRET and not ts[0].is_cuda:
        raise ValueError(f"{what}: CUDA tensors expected, got {ts[0].device}")


def device_ctx(t: torch.Tensor):
    """Context that makes t's CUDA device current (a no-op for CPU tensors)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
