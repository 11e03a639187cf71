"""The invariant trainer's policy with its 2-D weights held in bf16 (`hold_matmul_weights`, as
`rlk run` trains since 2026-12-04) computes the bytes of the fp32-held policy: every fp32
gradient (`.main_grad` beside a bf16 weight, `.grad` of an fp32 norm weight; read through
train/step.gradients) over several microbatches and in direct mode, the loss stats, and the
weights after an AdamW step rounded back. The held policy stores 2 bytes per weight element
instead of 4. Control: a held policy whose one weight moved by one bf16 ulp gives other
gradient bytes, so the comparison can fail. On CPU, and on CUDA when there is one (the Triton
kernels take the bf16 weight itself instead of a cast copy).
Run: `.venv/bin/python -m pytest -q tests/test_held_weights.py`.
"""

from __future__ import annotations

import pytest
import torch

from rlkernel.model.checkpoint import init_weights
from rlkernel.model.config import tiny
from rlkernel.model.ops import InvariantOps
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.train.losses import LossCoefs, invariant_exp
from rlkernel.train.optimizer import AdamW, AdamWParams
from rlkernel.train.step import TrainSample, compute_gradients, gradients

CFG = tiny()
W = init_weights(CFG, 0)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _samples(n: int = 4) -> list[TrainSample]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        p, r = 5 + i, 9 + 2 * i
        ids = torch.randint(1, 250, (p + r,), generator=g).tolist()
        out.append(TrainSample(i, tuple(ids[:p]), tuple(ids[p:]),
                               torch.full((r,), -5.0), 1.0 if i % 2 else -0.5))
    return out


def _policy(device: str, held: bool, weights=W) -> Qwen3ForCausalLM:
    m = Qwen3ForCausalLM(CFG, InvariantOps, torch.bfloat16).to(device)
    if held:
        m.hold_matmul_weights()
    m.load_tensors({k: v.to(device) for k, v in weights.items()})
    return m


def _step(pol: Qwen3ForCausalLM, micro_tokens: int):
    st = compute_gradients(pol, None, _samples(), temperature=0.9,
                           coefs=LossCoefs(0.2, 0.0, 0.01, "k1"), micro_batch_tokens=micro_tokens,
                           pad_id=257, exp=invariant_exp)
    grads = {n: g.clone() for n, g in gradients(pol).items()}
    return st, grads


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("micro_tokens", [64, 4096])   # several microbatches; one (direct)
def test_bf16_held_policy_has_the_fp32_held_policys_gradients_and_update(device, micro_tokens):
    full, held = _policy(device, False), _policy(device, True)
    mats = [n for n, p in held.logical_params().items() if p.dim() == 2]
    assert mats and all(held.get_parameter(n).dtype == torch.bfloat16 for n in mats)
    assert all(full.get_parameter(n).dtype == torch.float32 for n in mats)
    st_full, g_full = _step(full, micro_tokens)
    st_held, g_held = _step(held, micro_tokens)
    assert st_full == st_held
    assert g_full.keys() == g_held.keys()
    for n in g_full:
        assert g_held[n].dtype == torch.float32, n
        assert torch.equal(_bits(g_full[n]), _bits(g_held[n])), n
    assert any(bool(g.abs().sum() > 0) for g in g_held.values())
    # The update: AdamW on fp32 masters, rounded back into each policy's own storage.
    after = []
    for pol, grads in ((full, g_full), (held, g_held)):
        opt = AdamW({n: p.detach() for n, p in pol.logical_params().items()},
                    AdamWParams(lr=1e-2))
        opt.step(grads)
        pol.load_master_shards(opt.weights(torch.bfloat16))
        after.append(pol.export_tensors())
    assert all(torch.equal(_bits(after[0][n]), _bits(after[1][n])) for n in after[0])
    assert any(not torch.equal(after[1][n], W[n].to(after[1][n].dtype)) for n in mats)


@pytest.mark.parametrize("device", DEVICES)
def test_held_policy_stores_half_the_weight_bytes(device):
    full, held = _policy(device, False), _policy(device, True)

    def weight_bytes(m):
        return sum(p.numel() * p.element_size() for p in m.logical_params().values()
                   if p.dim() == 2)
    assert 2 * weight_bytes(held) == weight_bytes(full)


def test_control_one_ulp_in_one_weight_changes_gradient_bytes():
    name = "model.layers.0.mlp.down_proj.weight"
    w = dict(W)
    bumped = w[name].clone().to(torch.bfloat16)
    flat = bumped.view(-1).view(torch.int16)
    flat[0] += 1                       # the next bf16 value of one element
    w[name] = bumped.to(W[name].dtype)
    _, g = _step(_policy("cpu", True), 64)
    _, g_bumped = _step(_policy("cpu", True, w), 64)
    assert any(not torch.equal(_bits(g[n]), _bits(g_bumped[n])) for n in g)
