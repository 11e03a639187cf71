"""One policy-gradient step's gradients: pack, forward, per-token losses, canonical backward.

Samples are packed in logical order by the token budget (data/packing.py); each microbatch is
one padded token stream. Row t of a sample predicts token t+1, so the rows that predict response
tokens carry the loss. The trainer's logprobs of those tokens are compared byte for byte with the
rollout's (the train/rollout mismatch count of the evidence). The loss is normalised once by the
step's logical response-token count N: every token's gradient coefficient is exactly 1/N, so the
backward needs no reduction, and microbatch gradients accumulate in logical order.
Does not: clip or update (train/optimizer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkernel.data.packing import pack_by_budget, padded_stream_len
from rlkernel.distributed.parallel import ParallelCtx, cp_local_rows
from rlkernel.model.layout import StreamLayout, cp_local_layout, packed_layout
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.numerics.exact import exact_sum
from rlkernel.train.losses import LossCoefs, token_losses


@dataclass(frozen=True)
class TrainSample:
    """A rollout sample: prompt and response ids, the rollout's fp32 logprobs [R], its advantage."""

    sample_id: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    rollout_logprobs: torch.Tensor
    advantage: float


@dataclass(frozen=True)
class StepStats:
    """Exact means over the step's N response tokens, and the logprob byte-mismatch count."""

    n_tokens: int
    loss: float
    pg_loss: float
    kl: float
    entropy: float
    logprob_mismatches: int
    n_microbatches: int


def loss_rows(group: list[TrainSample], stream_len: int):
    """Per row of the packed stream of `group`: target id [L] long, loss mask [L] bool (rows
    that predict a response token), rollout logprob [L] fp32, advantage [L] fp32."""
    targets = torch.zeros(stream_len, dtype=torch.long)
    mask = torch.zeros(stream_len, dtype=torch.bool)
    old = torch.zeros(stream_len, dtype=torch.float32)
    adv = torch.zeros(stream_len, dtype=torch.float32)
    off = 0
    for s in group:
        p, r = len(s.prompt_ids), len(s.response_ids)
        idx = torch.arange(off + p - 1, off + p + r - 1)
        targets[idx] = torch.tensor(s.response_ids, dtype=torch.long)
        mask[idx] = True
        old[idx] = s.rollout_logprobs.to(torch.float32)
        adv[idx] = s.advantage
        off += p + r
    return targets, mask, old, adv


def compute_gradients(policy: Qwen3ForCausalLM, ref: Qwen3ForCausalLM, samples: list[TrainSample],
                      *, temperature: float, coefs: LossCoefs, token_budget: int, pad_id: int,
                      exp) -> StepStats:
    """Accumulate d(loss)/dθ into policy's .grad (fp32; zeroed first) and return the stats.

    Raises ValueError if there is no response token or a sample exceeds the token budget.
    """
    n_tok = sum(len(s.response_ids) for s in samples)
    if n_tok == 0:
        raise ValueError("no response tokens to train on")
    pc = policy.pc
    policy.zero_grad(set_to_none=True)
    vals: dict[str, list[float]] = {"total": [], "pg": [], "kl": [], "ent": []}
    mismatches = 0
    mbs = microbatches(samples, token_budget, pad_id, pc)
    for lay, per_row, _ in mbs:
        dev = policy.device
        targets, mask, old, adv = (t.to(dev) for t in per_row)
        rows = mask.nonzero(as_tuple=True)[0]
        old, adv = old[rows], adv[rows]
        lp_all, ent_all = policy.token_logprobs(policy.hidden(lay), targets, temperature)
        with torch.no_grad():
            ref_lp = ref.token_logprobs(ref.hidden(lay), targets, temperature)[0][rows]
        lp, ent = lp_all[rows], ent_all[rows]
        mismatches += int((lp.detach().view(torch.int32) != old.view(torch.int32)).sum().item())
        total, pg, kl = token_losses(lp, old, ref_lp, ent, adv, coefs, exp)
        coef = torch.full_like(total, 1.0 / n_tok)
        torch.autograd.backward(total, grad_tensors=coef)
        for key, t in (("total", total), ("pg", pg), ("kl", kl), ("ent", ent)):
            vals[key].extend(t.detach().double().tolist())
    policy.ops.sync_grads(policy)
    # Every CP rank holds part of the tokens (TP ranks hold copies): gather, then exact sums.
    everyone = pc.cp.all_gather_object((vals, mismatches), "step-stats")
    merged = {k: [x for v, _ in everyone for x in v[k]] for k in vals}
    mismatches = sum(m for _, m in everyone)
    mean = {k: exact_sum(v) / n_tok for k, v in merged.items()}
    return StepStats(n_tok, mean["total"], mean["pg"], mean["kl"], mean["ent"], mismatches,
                     len(mbs))


def microbatches(samples: list[TrainSample], token_budget: int, pad_id: int,
                 pc: ParallelCtx) -> list[tuple[StreamLayout, tuple[torch.Tensor, ...], torch.Tensor]]:
    """The step's microbatches as this rank holds them, in logical order (what compute_gradients
    runs): per microbatch (layout of this rank's rows — the CP-local view under CP —, loss_rows
    (targets, mask, rollout logprob, advantage) of those rows, logical stream row [Lc] long of
    each). Packing depends only on the samples and the token budget, never on the topology.
    Raises ValueError if a sample exceeds the token budget.
    """
    groups = pack_by_budget([len(s.prompt_ids) + len(s.response_ids) for s in samples], token_budget)
    out = []
    for g in groups:
        group = [samples[i] for i in g]
        seqs = [list(s.prompt_ids) + list(s.response_ids) for s in group]
        lay = packed_layout(seqs, padded_stream_len(sum(map(len, seqs))), pad_id)
        per_row = loss_rows(group, lay.tokens.shape[0])
        local = torch.arange(lay.tokens.shape[0])
        if pc.cp.size > 1:
            local = cp_local_rows(pc, local)
            lay = cp_local_layout(lay, local)
            per_row = tuple(t[local] for t in per_row)
        out.append((lay, per_row, local))
    return out


@torch.no_grad()
def trainer_logprobs(policy: Qwen3ForCausalLM, samples: list[TrainSample], temperature: float,
                     pad_id: int) -> list[torch.Tensor]:
    """The trainer's logprobs of each sample's response tokens ([R_i] fp32 per sample, CPU),
    computed the way compute_gradients does: one packed stream, no KV cache (single process)."""
    seqs = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
    lay = packed_layout(seqs, padded_stream_len(sum(map(len, seqs))), pad_id)
    targets, mask, _, _ = loss_rows(samples, lay.tokens.shape[0])
    lp, _ = policy.token_logprobs(policy.hidden(lay), targets.to(policy.device), temperature)
    return list(lp.cpu()[mask].split([len(s.response_ids) for s in samples]))


def gradients(policy: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """fp32 gradients by logical parameter name (zeros for parameters without one)."""
    out = {}
    for n, p in policy.logical_params().items():
        out[n] = p.grad if p.grad is not None else torch.zeros_like(p)
    return out
