"""kernels/triton_util.launch on the GPU: the direct launch of a compiled kernel == the usual one.

The dW kernel's carried pass (kernels/triton_grad_weight.py, TMA descriptors and pointers among
its arguments) run three times on the same operands into fresh double words: the first launch
compiles through the usual path; the second goes straight to the compiled kernel's launcher
(JITFunction.run is never called); the third takes the usual path again because a launch hook is
set. The three words are the same bytes. Skipped without CUDA.
Run on the GPU machine: PYTHONPATH=.:tests python3 -m pytest -q tests/test_cuda_launch.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_direct_launch_gives_the_usual_launch_bytes(monkeypatch):
    from triton import knobs
    from triton.runtime.jit import JITFunction

    from rlkernel.kernels import triton_grad_weight as tgw

    g = torch.Generator().manual_seed(5)
    dy, x = (torch.randn(512, 320, generator=g).to(torch.bfloat16).cuda() for _ in range(2))

    def words_of_one_call():
        words = torch.zeros(2, 320, 320, dtype=torch.float64, device="cuda")
        _, flagged = tgw.carry_grad_weight_deferred(words, dy, x)
        assert int(flagged) == 0
        return words
    first = words_of_one_call()
    runs = []
    real_run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run",
                        lambda self, *a, **k: runs.append(self) or real_run(self, *a, **k))
    direct = words_of_one_call()
    assert runs == []                                       # both launches went direct
    hook, noop = knobs.runtime.launch_enter_hook, (lambda metadata: None)
    hook.add(noop)
    try:
        usual = words_of_one_call()
    finally:
        hook.remove(noop)
    assert len(runs) == 2                                   # first pass and retry, usual path
    for other in (direct, usual):
        assert torch.equal(first.view(torch.int64), other.view(torch.int64))
    assert first.abs().sum() > 0
