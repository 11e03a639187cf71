"""One policy-gradient step's gradients: share, pack, forward, per-token losses, exact backward.

DP rank d of D takes samples [d·n/D, (d+1)·n/D) of the mini-batch (logical order); its samples are
packed in order into microbatches of at most --micro-batch-tokens tokens (data/packing.py), each
one token stream whose samples start at multiples of the backend's stream leaf (spec.stream_leaf:
TOKEN_LEAF on CPU, CUDA_TOKEN_LEAF on CUDA; model/layout.py). Row t of a
sample predicts token t+1, so the rows that predict response tokens carry the loss. The trainer's
logprobs of those tokens are compared byte for byte with the rollout's (the train/rollout
mismatch count of the evidence). The loss is normalised once over the WHOLE mini-batch (its
response-token count N, or per sample, --loss-agg), never per microbatch or rank: every token's
gradient coefficient is fixed before the first microbatch. Every weight gradient of every
microbatch is added exactly into the policy's GradSink and rounded once after the last one, summed
over DP and CP ranks as integers (distributed/tokensum.py): so D and the microbatch size never
change a bit (in --mode native autograd accumulates fp32 per microbatch and SUM all-reduces).
Does not: clip or update (train/optimizer.py, train/zero.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkernel.config import LOSS_AGGS
from rlkernel.data.packing import pack_by_budget
from rlkernel.distributed.comm import Comm
from rlkernel.distributed.parallel import ParallelCtx, cp_local_rows, stream_multiple
from rlkernel.model.layout import StreamLayout, cp_local_layout, packed_layout, upload
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.numerics.exact import exact_sum
from rlkernel.spec import TOKEN_LEAF, stream_leaf
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
    """One mini-batch's loss terms, aggregated like the loss (--loss-agg: exact sums divided
    once), the train/rollout logprob byte-mismatch count, the number of (trainer, rollout)
    logprob pairs actually compared (counted where they are compared, over every CP rank: N when
    every response token is compared once), and how many tokens the PPO clip cut off."""

    n_tokens: int
    loss: float
    pg_loss: float
    kl: float | None
    """None when no reference policy is kept (--kl-coef 0): not measured."""
    entropy: float
    logprob_mismatches: int
    n_microbatches: int
    logprob_compared: int
    n_clipped: int = 0


def agg_weights(lengths: list[int], agg: str) -> list[float]:
    """Gradient coefficient w_s of every response token of sample s (float64), per sample.

    lengths: response tokens R_s of each sample of one mini-batch, the set the loss is
    normalised over (never a microbatch or a rank's share). The mini-batch loss is
    sum_s sum_t w_s * l_st with, for N = sum R_s and S = samples with R_s > 0:
      token-mean           w_s = 1 / N          (DAPO's token-level loss, arXiv 2503.14476 §3.3)
      seq-mean-token-sum   w_s = 1 / S
      seq-mean-token-mean  w_s = 1 / (S * R_s)  (GRPO's per-sample mean, arXiv 2402.03300 eq. 3)
    Each w_s is one division of exact integers, hence the same on every rank. A sample without
    response tokens gets 0. Raises ValueError on an unknown agg or when N == 0.
    """
    n_tok = sum(lengths)
    n_seq = sum(1 for r in lengths if r > 0)
    if n_tok == 0:
        raise ValueError("no response tokens to train on")
    if agg == "token-mean":
        return [1.0 / n_tok for _ in lengths]
    if agg == "seq-mean-token-sum":
        return [1.0 / n_seq for _ in lengths]
    if agg == "seq-mean-token-mean":
        return [1.0 / (n_seq * r) if r else 0.0 for r in lengths]
    raise ValueError(f"--loss-agg {agg!r} is not known; allowed: {', '.join(LOSS_AGGS)}")


def aggregate(values: list[float], sample_of: list[int], lengths: list[int], agg: str) -> float:
    """The --loss-agg mean of per-token values (any order) whose samples are `sample_of`:
    exact sums (numerics/exact.py), each divided once, so any split over ranks gives the same
    bits. seq-mean-token-mean takes each sample's exact sum / R_s, then their exact sum / S."""
    n_seq = sum(1 for r in lengths if r > 0)
    if agg == "token-mean":
        return exact_sum(values) / sum(lengths)
    if agg == "seq-mean-token-sum":
        return exact_sum(values) / n_seq
    per: dict[int, list[float]] = {}
    for v, s in zip(values, sample_of):
        per.setdefault(s, []).append(v)
    return exact_sum(exact_sum(per[s]) / lengths[s] for s in per) / n_seq


def _offsets(lay: StreamLayout) -> list[int]:
    """Stream row where each sample of a packed layout starts (the row of its position 0)."""
    return lay.q_idx[:, 0].tolist()


def loss_rows(group: list[TrainSample], lay: StreamLayout):
    """Per row of `lay`, the packed stream of `group` (model/layout.packed_layout; its sample
    offsets are read from the layout, so the rows follow any alignment): target id [L] long,
    loss mask [L] bool (rows that predict a response token), rollout logprob [L] fp32,
    advantage [L] fp32."""
    stream_len = lay.tokens.shape[0]
    targets = torch.zeros(stream_len, dtype=torch.long)
    mask = torch.zeros(stream_len, dtype=torch.bool)
    old = torch.zeros(stream_len, dtype=torch.float32)
    adv = torch.zeros(stream_len, dtype=torch.float32)
    for s, off in zip(group, _offsets(lay)):
        p, r = len(s.prompt_ids), len(s.response_ids)
        idx = torch.arange(off + p - 1, off + p + r - 1)
        targets[idx] = torch.tensor(s.response_ids, dtype=torch.long)
        mask[idx] = True
        old[idx] = s.rollout_logprobs.to(torch.float32)
        adv[idx] = s.advantage
    return targets, mask, old, adv


def _row_samples(group: list[TrainSample], index: list[int], lay: StreamLayout) -> torch.Tensor:
    """[L] long: for each row of `lay` that predicts a response token, the mini-batch index of
    its sample (`index[i]` for group[i]); -1 elsewhere."""
    who = torch.full((lay.tokens.shape[0],), -1, dtype=torch.long)
    for s, i, off in zip(group, index, _offsets(lay)):
        p, r = len(s.prompt_ids), len(s.response_ids)
        who[off + p - 1:off + p + r - 1] = i
    return who


def dp_share(n: int, dp: Comm) -> range:
    """Indices of the mini-batch samples DP rank dp.rank trains on: [d·n/D, (d+1)·n/D).
    Raises ValueError when D does not divide n (config.RunConfig refuses such a run first)."""
    if n % dp.size:
        raise ValueError(f"--dp {dp.size} must divide the {n} samples of a mini-batch")
    k = n // dp.size
    return range(dp.rank * k, (dp.rank + 1) * k)


def microbatches(samples: list[TrainSample], micro_batch_tokens: int, pad_id: int,
                 pc: ParallelCtx, index: list[int] | None = None, leaf: int = TOKEN_LEAF
                 ) -> list[tuple[StreamLayout, tuple[torch.Tensor, ...], torch.Tensor]]:
    """The microbatches of `samples` as this rank holds them, in logical order (what
    compute_gradients runs): per microbatch (layout of this rank's rows — the CP-local view under
    CP —, per row: (target id, loss mask, rollout logprob, advantage, mini-batch index of the
    row's sample or -1), logical stream row [Lc] long of each). `index[i]`: the mini-batch index
    of samples[i] (default i). Grouping depends only on the samples and micro_batch_tokens; the
    stream's end padding on the CP/SP layout (parallel.stream_multiple) and samples start at
    multiples of `leaf` (spec.stream_leaf of the policy's backend). Neither changes a number.
    Raises ValueError if a sample exceeds micro_batch_tokens.
    """
    index = list(range(len(samples))) if index is None else index
    groups = pack_by_budget([len(s.prompt_ids) + len(s.response_ids) for s in samples],
                            micro_batch_tokens)
    out = []
    for g in groups:
        group = [samples[i] for i in g]
        seqs = [list(s.prompt_ids) + list(s.response_ids) for s in group]
        lay = packed_layout(seqs, pad_id, stream_multiple(pc, leaf), leaf)
        n_rows = lay.tokens.shape[0]
        per_row = (*loss_rows(group, lay), _row_samples(group, [index[i] for i in g], lay))
        local = torch.arange(n_rows)
        if pc.cp.size > 1:
            local = cp_local_rows(pc, local)
            lay = cp_local_layout(lay, local)
            per_row = tuple(t[local] for t in per_row)
        out.append((lay, per_row, local))
    return out


def _loss_rows_on_device(policy: Qwen3ForCausalLM, mbs):
    """Per microbatch of `microbatches`: (layout, target ids [L'], loss rows [n] long, rollout
    logprobs [n] fp32, advantages [n] fp32, sample index [n] long) on the policy's device, n the
    rows this rank holds that predict a response token; and those rows' sample indices as a
    host list. The rows are found on the host, where the packer made the mask (no sync)."""
    for lay, per_row, _ in mbs:
        targets, mask, old, adv, who = per_row
        rows = mask.nonzero(as_tuple=True)[0]
        dev = (targets, rows, old[rows], adv[rows], who[rows])
        yield (lay, *(upload(t, policy.device) for t in dev)), who[rows].tolist()


def _backward_passes(policy: Qwen3ForCausalLM, ref: Qwen3ForCausalLM | None, mbs,
                     w32: torch.Tensor, temperature: float, coefs: LossCoefs, exp):
    """Forward, per-token losses and backward of every microbatch into the open sink. Returns
    (per-token loss terms {"total", "pg", "kl", "ent"} -> float list, the sample index of each
    token, train/rollout mismatches, pairs compared, clipped tokens) of this rank. The counts
    and terms stay on the device until the last backward is queued: one host read at the end,
    not one per microbatch."""
    terms: dict[str, list[torch.Tensor]] = {"total": [], "pg": [], "kl": [], "ent": []}
    sample_of: list[int] = []
    counted = []
    for (lay, targets, rows, old, adv, who), who_host in _loss_rows_on_device(policy, mbs):
        lp_all, ent_all = policy.token_logprobs(policy.hidden(lay), targets, temperature)
        ref_lp = None
        if ref is not None:
            with torch.no_grad():
                ref_lp = ref.token_logprobs(ref.hidden(lay), targets, temperature)[0][rows]
        lp, ent = lp_all[rows], ent_all[rows]
        differs = lp.detach().view(torch.int32) != old.view(torch.int32)
        total, pg, kl, cut = token_losses(lp, old, ref_lp, ent, adv, coefs, exp)
        torch.autograd.backward(total, grad_tensors=w32[who])
        counted.append(torch.stack([differs.sum(), cut.sum()]))
        for key, t in (("total", total), ("pg", pg), ("kl", kl), ("ent", ent)):
            if t is not None:
                terms[key].append(t.detach().double())
        sample_of.extend(who_host)
    vals = {k: torch.cat(v).tolist() if v else [] for k, v in terms.items()}
    mismatches, clipped = (torch.stack(counted).sum(0).tolist() if counted else (0, 0))
    return vals, sample_of, int(mismatches), len(sample_of), int(clipped)


def _everyone(pc: ParallelCtx, obj, op: str) -> list:
    """obj of every rank holding other tokens of the mini-batch (CP ranks, then DP replicas)."""
    return [x for part in pc.dp.all_gather_object(pc.cp.all_gather_object(obj, op), op + ":dp")
            for x in part]


def compute_gradients(policy: Qwen3ForCausalLM, ref: Qwen3ForCausalLM | None,
                      samples: list[TrainSample],
                      *, temperature: float, coefs: LossCoefs, micro_batch_tokens: int,
                      pad_id: int, exp, agg: str = "token-mean") -> StepStats:
    """Set policy's fp32 gradients to d(loss)/dθ of the mini-batch `samples` (`.grad`, or
    `.main_grad` of bf16-held weights: read them with `gradients`) and return its stats.
    `ref`: the reference policy, or None when coefs.kl_coef is 0 (no KL term, kl not measured).

    Every rank passes the whole mini-batch; this rank's DP replica trains on its share
    (dp_share). The loss is normalised over all of it by `agg` (agg_weights), so every token's
    gradient coefficient is fixed before the first microbatch. Collective over the policy's
    groups. Raises ValueError if there is no response token, a sample exceeds
    micro_batch_tokens, or DP does not divide the samples.
    """
    lengths = [len(s.response_ids) for s in samples]
    weights = agg_weights(lengths, agg)
    pc = policy.pc
    share = list(dp_share(len(samples), pc.dp))
    mbs = microbatches([samples[i] for i in share], micro_batch_tokens, pad_id, pc, share,
                       stream_leaf(torch.device(policy.device).type))
    # One microbatch on every DP replica (CP/TP ranks share their replica's grouping): weights
    # can be finished inside the backward, without mini-batch accumulators. Same bytes.
    counts = pc.dp.all_gather_object(len(mbs), "microbatch-count")
    direct = all(c == 1 for c in counts)
    # fp32 coefficient per sample: the float64 weight rounded once (token-mean: fp32(1/N)).
    w32 = torch.tensor(weights, dtype=torch.float32, device=policy.device)
    # First with late activation flags (no host sync per attention backward); in the rare
    # mini-batch where a kernel counted one, again with every flag resolved on the spot
    # (GradSink "Late activation flags"): the gradients are those of the second pass only.
    for late in (True, False):
        policy.ops.begin_grads(policy, direct=direct, late=late)
        vals, sample_of, mismatches, compared, clipped = _backward_passes(
            policy, ref, mbs, w32, temperature, coefs, exp)
        if not policy.ops.late_flagged(policy):
            break
    policy.ops.sync_grads(policy)
    # Every CP rank and DP replica holds part of the tokens (TP ranks hold copies): gather,
    # then exact sums.
    everyone = _everyone(pc, (vals, sample_of, mismatches, compared, clipped), "step-stats")
    merged = {k: [x for e in everyone for x in e[0][k]] for k in vals}
    who_all = [s for e in everyone for s in e[1]]
    mean = {k: aggregate(v, who_all, lengths, agg) for k, v in merged.items()}
    if ref is None:
        mean["kl"] = None
    return StepStats(sum(lengths), mean["total"], mean["pg"], mean["kl"], mean["ent"],
                     sum(e[2] for e in everyone), len(mbs), sum(e[3] for e in everyone),
                     sum(e[4] for e in everyone))


@torch.no_grad()
def rollout_mismatches(policy: Qwen3ForCausalLM, samples: list[TrainSample], *,
                       temperature: float, micro_batch_tokens: int,
                       pad_id: int) -> tuple[int, int]:
    """(mismatches, pairs compared): train/rollout logprob byte mismatches over the response
    tokens of `samples`, and how many pairs were compared (over every CP rank and DP replica:
    each checks its dp_share), from a forward pass of the policy as it is now (no gradient),
    packed as compute_gradients packs; collective over the CP and DP groups. Used before the
    first update of a step, for the mini-batches that compute_gradients will only see after the
    policy has moved."""
    share = list(dp_share(len(samples), policy.pc.dp))
    mbs = microbatches([samples[i] for i in share], micro_batch_tokens, pad_id, policy.pc,
                       leaf=stream_leaf(torch.device(policy.device).type))
    counts = []
    compared = 0
    for (lay, targets, rows, old, _, _), _ in _loss_rows_on_device(policy, mbs):
        lp, _ = policy.token_logprobs(policy.hidden(lay), targets, temperature)
        counts.append((lp[rows].view(torch.int32) != old.view(torch.int32)).sum())
        compared += rows.numel()
    n = int(torch.stack(counts).sum()) if counts else 0     # one host read, after the last
    everyone = _everyone(policy.pc, (n, compared), "mismatch-count")
    return sum(e[0] for e in everyone), sum(e[1] for e in everyone)


@torch.no_grad()
def trainer_logprobs(policy: Qwen3ForCausalLM, samples: list[TrainSample], temperature: float,
                     pad_id: int) -> list[torch.Tensor]:
    """The trainer's logprobs of each sample's response tokens ([R_i] fp32 per sample, CPU),
    computed the way compute_gradients does: one packed stream, no KV cache (single process)."""
    seqs = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
    lay = packed_layout(seqs, pad_id)
    targets, mask, _, _ = loss_rows(samples, lay)
    lp, _ = policy.token_logprobs(policy.hidden(lay), targets.to(policy.device), temperature)
    return list(lp.cpu()[mask].split([len(s.response_ids) for s in samples]))


def gradients(policy: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """fp32 gradients by logical parameter name: `.grad`, or `.main_grad` for a weight held in
    bf16 (model/ops.InvariantOps.sync_grads); fp32 zeros for parameters without one."""
    out = {}
    for n, p in policy.logical_params().items():
        g = p.grad if p.grad is not None else getattr(p, "main_grad", None)
        out[n] = g if g is not None else torch.zeros(p.shape, dtype=torch.float32,
                                                     device=p.device)
    return out
