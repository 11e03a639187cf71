"""The model is the real Qwen3, and the RL gradient is the right one.

Chain checked here (transformers is the reference implementation, float64 the oracle):
  1. our fp32 logits (invariant ops) == transformers Qwen3ForCausalLM fp32 logits, within 1e-4 rel.
  2. our fp32 gradient of the RL loss (PPO-clip policy term + KL to a reference policy + entropy
     bonus, normalised by the response-token count) == float64 autograd of the same loss through
     transformers' Qwen3 on the same weights and batch, within 1e-5 relative per tensor
     (tied and untied embeddings, every KL estimator; every --loss-agg with the decoupled clip
     range of DAPO).
  3. our first AdamW update == torch.optim.AdamW's on the same gradients (tolerance: same formula,
     different but equally valid rounding order).
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rlkernel.model.config import param_shapes, tiny  # noqa: E402
from rlkernel.model.layout import packed_layout  # noqa: E402
from rlkernel.model.ops import InvariantOps  # noqa: E402
from rlkernel.model.qwen3 import Qwen3ForCausalLM  # noqa: E402
from rlkernel.train.losses import LossCoefs, invariant_exp  # noqa: E402
from rlkernel.train.optimizer import AdamW, AdamWParams  # noqa: E402
from rlkernel.train.step import TrainSample, compute_gradients, gradients  # noqa: E402

T = 0.7


def _weights(cfg, seed: int, scale: float = 0.15) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if "norm" in name:
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            out[name] = scale * torch.randn(shape, generator=g)
    return out


def _hf(cfg, tensors, dtype):
    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "torch_dtype")}
    hcfg = transformers.Qwen3Config(**d)
    hcfg._attn_implementation = "eager"
    m = transformers.Qwen3ForCausalLM(hcfg).to(dtype).eval()
    sd = {k: v.to(dtype) for k, v in tensors.items()}
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return m


def _ours(cfg, tensors):
    m = Qwen3ForCausalLM(cfg, InvariantOps, torch.float32)
    m.load_tensors(tensors)
    return m


def _batch(cfg, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = [(9, 13), (5, 20), (17, 7), (4, 11)]
    seqs = [(torch.randint(0, 256, (p,), generator=g).tolist(),
             torch.randint(0, cfg.vocab_size, (r,), generator=g).tolist()) for p, r in lens]
    advs = [1.3, -0.7, 0.25, -1.1]
    return seqs, advs


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers(tied):
    """our fp32 logits == transformers Qwen3ForCausalLM fp32 logits (1e-4 relative)."""
    cfg = tiny().replace(tie_word_embeddings=tied)
    tensors = _weights(cfg, 0)
    ours, hf = _ours(cfg, tensors), _hf(cfg, tensors, torch.float32)
    seqs = [list(range(3, 40)), list(range(100, 131)), [7] * 50]
    lay = packed_layout(seqs, 257)
    with torch.no_grad():
        logits = ours.logits(ours.hidden(lay))
        for i, s in enumerate(seqs):
            ref = hf(torch.tensor([s])).logits[0]
            o = int(lay.q_idx[i, 0])
            got = logits[o:o + len(s)]
            assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4


def _reference_grads(cfg, pol_w, ref_w, seqs, advs, old_lps, coefs: LossCoefs,
                     agg: str = "token-mean", dtype: torch.dtype = torch.float64):
    """float64 (or `dtype`) autograd of the same RL loss through transformers' Qwen3.

    agg, from its definition (N response tokens, S samples, R_s tokens of sample s):
    token-mean sum/N; seq-mean-token-sum sum/S; seq-mean-token-mean (sum_s sum_t/R_s)/S.
    """
    hf = _hf(cfg, pol_w, dtype)
    hf_ref = _hf(cfg, ref_w, dtype)
    n_tok = sum(len(r) for _, r in seqs)
    n_seq = len(seqs)
    total = torch.zeros((), dtype=torch.float64)
    for (p, r), adv, old in zip(seqs, advs, old_lps):
        ids = torch.tensor([p + r])
        rows = torch.arange(len(p) - 1, len(p) + len(r) - 1)
        tgt = torch.tensor(r)
        logp = torch.log_softmax(hf(ids).logits[0, rows] / T, -1)
        lp = logp.gather(1, tgt[:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)
        with torch.no_grad():
            ref_lp = torch.log_softmax(hf_ref(ids).logits[0, rows] / T, -1).gather(1, tgt[:, None])[:, 0]
        ratio = torch.exp(lp - old.double())
        pg = -torch.minimum(ratio * adv, ratio.clamp(1 - coefs.clip_low, 1 + coefs.clip_high) * adv)
        d = lp - ref_lp
        kl = {"k1": d, "k2": 0.5 * d * d, "k3": torch.exp(-d) + d - 1}[coefs.kl_estimator]
        seq = (pg + coefs.kl_coef * kl - coefs.entropy_coef * ent).sum()
        total = total + (seq / len(r) if agg == "seq-mean-token-mean" else seq)
    (total / (n_tok if agg == "token-mean" else n_seq)).backward()
    named = dict(hf.named_parameters())
    out = {n: named[n].grad for n in param_shapes(cfg)}
    if cfg.tie_word_embeddings:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight  # one tensor, two uses
    return out


@pytest.mark.parametrize("tied,estimator", [(True, "k3"), (False, "k1"), (True, "k2")])
def test_rl_gradient_matches_float64_transformers(tied, estimator):
    """our fp32 RL-loss gradient == float64 autograd through transformers (1e-5 rel per tensor)."""
    _check_gradient(tied, LossCoefs(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01,
                                    kl_estimator=estimator))


@pytest.mark.parametrize("tied,agg", [(True, "token-mean"), (False, "seq-mean-token-sum"),
                                      (True, "seq-mean-token-mean")])
def test_loss_aggregation_gradient_matches_float64_transformers(tied, agg):
    """--loss-agg AGG with the decoupled clip [1-0.2, 1+0.28]: our fp32 gradient == float64
    autograd through transformers of the loss as defined (1e-5 rel per tensor). The token budget
    cuts the mini-batch into several microbatches: the normalisation is over all of it."""
    _check_gradient(tied, LossCoefs(clip_eps=0.1, kl_coef=0.05, entropy_coef=0.01,
                                    kl_estimator="k3", clip_eps_low=0.2, clip_eps_high=0.28), agg)


SHIFTS = (0.0, 0.5, -0.5, -0.2151, 0.1625)
"""old - new logprob per token: ratios 1, 0.61, 1.65, 1.24 and 0.85. 1.24 is clipped by a
symmetric 0.2 but not by eps_high 0.28, and 0.85 by eps 0.1 but not by eps_low 0.2, so the
decoupled bounds decide gradients here."""


def _check_gradient(tied: bool, coefs: LossCoefs, agg: str = "token-mean") -> None:
    cfg = tiny().replace(tie_word_embeddings=tied)
    pol_w, ref_w = _weights(cfg, 1), _weights(cfg, 2)
    seqs, advs = _batch(cfg, 3)
    policy, ref = _ours(cfg, pol_w), _ours(cfg, ref_w)
    ref.requires_grad_(False)
    # Old logprobs: the policy's own, shifted (SHIFTS) so tokens land unclipped and clipped,
    # far from the clip boundaries (fp32 and float64 pick the same branch).
    with torch.no_grad():
        lay = packed_layout([p + r for p, r in seqs], 257)
        h = policy.hidden(lay)
    old_lps = []
    for i, (p, r) in enumerate(seqs):
        o = int(lay.q_idx[i, 0])
        rows = torch.arange(o + len(p) - 1, o + len(p) + len(r) - 1)
        with torch.no_grad():
            lp, _ = policy.token_logprobs(h[rows], torch.tensor(r), T)
        shift = torch.tensor([SHIFTS[j % len(SHIFTS)] for j in range(len(r))])
        old_lps.append((lp + shift).float())
    samples = [TrainSample(i, tuple(p), tuple(r), old, a)
               for i, ((p, r), old, a) in enumerate(zip(seqs, old_lps, advs))]
    # A small token budget forces several microbatches: accumulation is part of what is checked.
    compute_gradients(policy, ref, samples, temperature=T, coefs=coefs, micro_batch_tokens=40,
                      pad_id=257, exp=invariant_exp, agg=agg)
    ours = gradients(policy)
    want = _reference_grads(cfg, pol_w, ref_w, seqs, advs, old_lps, coefs, agg)
    for name, g in want.items():
        err = (ours[name].double() - g).norm() / g.norm()
        assert err < 1e-5, f"{name}: relative error {err:.3g}"


def test_first_adamw_update_matches_torch():
    """our AdamW step on fp32 masters == torch.optim.AdamW (foreach=False) on the same grads."""
    g = torch.Generator().manual_seed(5)
    masters = {"a": torch.randn(64, 33, generator=g), "b": torch.randn(17, generator=g)}
    grads = {n: 1e-3 * torch.randn(t.shape, generator=g) for n, t in masters.items()}
    hp = AdamWParams(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    ours = AdamW(masters, hp)
    ours.step({n: t.clone() for n, t in grads.items()})
    params = [torch.nn.Parameter(t.clone()) for t in masters.values()]
    opt = torch.optim.AdamW(params, lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                            weight_decay=hp.weight_decay, foreach=False)
    for p, gr in zip(params, grads.values()):
        p.grad = gr.clone()
    opt.step()
    for (name, t), p in zip(ours.master.items(), params):
        delta_ref = (p.detach() - masters[name]).double()
        delta = (t - masters[name]).double()
        assert ((delta - delta_ref).norm() / delta_ref.norm()).item() < 1e-5
        assert not torch.equal(t, masters[name])


def test_clip_uses_exact_norm_and_scales_like_torch():
    """clip: norm == exact oracle; scaled grads == torch.nn.utils.clip_grad_norm_ (1e-6 rel)."""
    g = torch.Generator().manual_seed(6)
    grads = {"a": torch.randn(300, generator=g), "b": torch.randn(7, 9, generator=g)}
    opt = AdamW({n: torch.zeros_like(t) for n, t in grads.items()}, AdamWParams(lr=1.0))
    mine = {n: t.clone() for n, t in grads.items()}
    stats = opt.clip(mine, max_norm=1.0)
    oracle = math.sqrt(math.fsum(float(v) ** 2 for t in grads.values() for v in t.flatten()))
    assert stats.norm == oracle
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads.values()]
    for p, t in zip(params, grads.values()):
        p.grad = t.clone()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    for p, t in zip(params, mine.values()):
        assert ((p.grad - t).norm() / p.grad.norm()).item() < 1e-6
