"""The train step's logprob comparison (rlkernel/train/step.py): `logprob_compared` (the evidence's
`logprob_tokens`) counts the (trainer, rollout) pairs actually compared, not the planned count.

Run: `.venv/bin/python -m pytest -q tests/test_train_step.py`.
"""

from __future__ import annotations

import torch

from rlkernel.model.checkpoint import init_weights
from rlkernel.model.config import tiny
from rlkernel.model.ops import InvariantOps
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.rollout.engine import Request, RolloutEngine, SamplingParams
from rlkernel.train import step as step_mod
from rlkernel.train.losses import LossCoefs, invariant_exp
from rlkernel.train.step import TrainSample, compute_gradients

CFG = tiny()
W = init_weights(CFG, 0)
SP = SamplingParams(temperature=0.8, top_p=1.0, max_new_tokens=8, seed=3, eos_id=256)


def _model() -> Qwen3ForCausalLM:
    m = Qwen3ForCausalLM(CFG, InvariantOps, torch.bfloat16)
    m.load_tensors(W)
    return m


def _samples() -> list[TrainSample]:
    eng = RolloutEngine(CFG, InvariantOps, torch.bfloat16, pad_id=257)
    eng.load_weights(W)
    reqs = [Request(i, tuple(range(40 + i, 47 + 2 * i))) for i in range(3)]
    return [TrainSample(c.sample_id, c.prompt_ids, tuple(c.response_ids), c.logprob_tensor(), 0.5)
            for c in eng.generate(reqs, SP)]


def _stats(samples):
    ref = _model().requires_grad_(False)
    return compute_gradients(_model(), ref, samples, temperature=SP.temperature,
                             coefs=LossCoefs(0.2, 0.0, 0.0, "k1"), micro_batch_tokens=512, pad_id=257,
                             exp=invariant_exp)


def test_logprob_compared_counts_the_compared_pairs(monkeypatch):
    """every response token compared once -> compared == N, 0 mismatches; a layout that compares
    one token fewer per sample (loss_rows mutated) -> compared == N − samples, N unchanged."""
    samples = _samples()
    n = sum(len(s.response_ids) for s in samples)
    st = _stats(samples)
    assert (st.n_tokens, st.logprob_compared, st.logprob_mismatches) == (n, n, 0)

    real = step_mod.loss_rows

    def drop_last_row_of_each_sample(group, stream_len):
        targets, mask, old, adv = real(group, stream_len)
        rows = mask.nonzero(as_tuple=True)[0]
        ends = torch.cumsum(torch.tensor([len(s.response_ids) for s in group]), 0) - 1
        mask[rows[ends]] = False
        return targets, mask, old, adv

    monkeypatch.setattr(step_mod, "loss_rows", drop_last_row_of_each_sample)
    st = _stats(samples)
    assert st.n_tokens == n and st.logprob_compared == n - len(samples)
