"""Rollout engine: batched generation with a KV cache and counter-based sampling.

One engine step is schedule → run → postprocess (STYLE.md §8): `_schedule` decides what each
sample feeds next (a prompt chunk, its last sampled token, or nothing once finished), `_run` does
one model pass over all samples, `_postprocess` samples and records. Every sample keeps its own
cache row and its own absolute positions, and every kernel is row-invariant, so a sample's tokens
and logprobs do not depend on its batch, its row or on how its prompt was chunked. The logprob of
a sampled token is read from the canonical log-softmax of logits / T — the trainer recomputes
exactly that value (DESIGN.md §3).
Does not: continuous batching across calls, paged KV memory, or TP (rlkernel/distributed shards the model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlkernel.distributed.parallel import ParallelCtx, cp_assemble, cp_local_rows, stream_multiple
from rlkernel.model.config import Qwen3Config
from rlkernel.model.layout import chunk_layout, cp_local_layout, packed_layout
from rlkernel.model.qwen3 import KVCache, Qwen3ForCausalLM
from rlkernel.rollout.sampler import sample_tokens


@dataclass(frozen=True)
class Request:
    """One sample to generate: a global sample id (keys the sampling noise) and its prompt ids."""

    sample_id: int
    prompt_ids: tuple[int, ...]


@dataclass
class Completion:
    """Generated response: token ids, their fp32 logprobs [n] and why generation stopped."""

    sample_id: int
    prompt_ids: tuple[int, ...]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str = ""

    def logprob_tensor(self) -> torch.Tensor:
        """[n] fp32 logprobs of response_ids."""
        return torch.stack(self.logprobs) if self.logprobs else torch.zeros(0)


@dataclass(frozen=True)
class SamplingParams:
    """temperature > 0, top_p in (0, 1], max_new_tokens >= 1, seed >= 0, eos_id."""

    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    eos_id: int


class RolloutEngine:
    """Owns its own model copy (weights arrive by `load_weights`, as in a real weight sync)."""

    def __init__(self, cfg: Qwen3Config, ops, param_dtype: torch.dtype, pad_id: int,
                 prefill_chunk: int | None = None, device: torch.device | str = "cpu",
                 pc: ParallelCtx | None = None, live_vocab: int | None = None) -> None:
        """live_vocab: the tokenizer's id bound when below cfg.vocab_size (a padded vocabulary):
        ids >= it get probability 0 in the canonical log-softmax and are never sampled."""
        self.cfg = cfg
        self.model = Qwen3ForCausalLM(cfg, ops, param_dtype, pc, live_vocab).to(device)
        self.model.requires_grad_(False)
        self.pad_id = pad_id
        self.prefill_chunk = prefill_chunk

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.model.load_tensors(tensors)

    def exported_weights(self) -> dict[str, torch.Tensor]:
        """The logical tensors this rank's engine now computes with (for the weight audit):
        reassembled from every rollout-TP rank's shard, replicated tensors from this rank's own
        copy, in param_dtype unless a value needs more (Qwen3's export_tensors), on the engine's
        device. Collective over the rollout-TP group."""
        return self.model.export_tensors(as_held=True, on_device=True)

    def held_weights(self) -> dict[str, torch.Tensor]:
        """This rank's own parameters by logical name: the very tensors its forward reads (its
        TP shard, fp32, on the engine's device), not copies."""
        return {n: p.detach() for n, p in self.model.logical_params().items()}

    def held_form(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """What `load_weights` puts into `held_weights()[name]` on this rank from logical `t`."""
        return self.model.local_param(name, t)

    @torch.no_grad()
    def generate(self, requests: list[Request], sp: SamplingParams) -> list[Completion]:
        """Generate a completion for every request (same order). Raises ValueError on empty prompts."""
        for r in requests:
            if not r.prompt_ids:
                raise ValueError(f"sample {r.sample_id}: empty prompt")
        longest = max(len(r.prompt_ids) for r in requests)
        kv_heads = self.model.model.layers[0].self_attn.kv_heads
        pc = self.model.pc
        cache = KVCache(self.cfg, len(requests), longest + sp.max_new_tokens, self.model.device,
                        kv_heads, pc.cp)
        outs = [Completion(r.sample_id, r.prompt_ids) for r in requests]
        fed = [0] * len(requests)                  # tokens of each sequence already in the cache
        if pc.cp.size > 1:
            prompts = [list(r.prompt_ids) for r in requests]
            self._postprocess(requests, outs, fed, prompts, self._prefill_cp(prompts, cache), sp)
        while True:
            chunks = self._schedule(requests, outs, fed)
            if not any(chunks):
                return outs
            h_last = self._run(chunks, fed, cache)
            self._postprocess(requests, outs, fed, chunks, h_last, sp)

    def _schedule(self, requests, outs, fed) -> list[list[int]]:
        chunks = []
        for r, c, n in zip(requests, outs, fed):
            if c.finish_reason:
                chunks.append([])
            elif n < len(r.prompt_ids):
                step = self.prefill_chunk or len(r.prompt_ids)
                chunks.append(list(r.prompt_ids[n:n + step]))
            else:
                chunks.append([c.response_ids[-1]])
        return chunks

    def _prefill_cp(self, prompts: list[list[int]], cache: KVCache) -> torch.Tensor:
        """Prefill context parallelism: the packed prompt stream is cut into the CP zig-zag
        segments (query partition), K/V are gathered in logical order per layer, every rank keeps
        its blocks of the cache, and the last prompt rows are gathered (output gather).
        Returns [S, H] hidden of each prompt's last token."""
        pc = self.model.pc
        lay = packed_layout(prompts, self.pad_id, stream_multiple(pc))
        local = cp_local_rows(pc, torch.arange(lay.tokens.shape[0]))
        h_local = self.model.hidden(cp_local_layout(lay, local), cache)
        h_full = cp_assemble(pc, pc.cp.all_gather(h_local.contiguous(), "prefill-output-gather"))
        last = torch.tensor([len(p) - 1 for p in prompts])
        rows = lay.q_idx[torch.arange(len(prompts)), last]
        return h_full[rows.to(h_full.device)]

    def _run(self, chunks, fed, cache) -> torch.Tensor:
        lay = chunk_layout(chunks, list(fed), self.pad_id)
        h = self.model.hidden(lay, cache)
        last = torch.tensor([max(len(c) - 1, 0) for c in chunks])
        rows = lay.q_idx[torch.arange(len(chunks)), last].clamp(min=0)
        return h[rows.to(h.device)]

    def _postprocess(self, requests, outs, fed, chunks, h_last, sp: SamplingParams) -> None:
        ready = [i for i, (r, c) in enumerate(zip(requests, chunks))
                 if c and fed[i] + len(c) >= len(r.prompt_ids)]
        for i, c in enumerate(chunks):
            fed[i] += len(c)
        if not ready:
            return
        idx = torch.tensor(ready, device=h_last.device)
        logp = self.model.next_token_logprobs(h_last[idx], sp.temperature)
        dev = logp.device
        positions = torch.tensor([fed[i] for i in ready], dtype=torch.long, device=dev)
        sample_ids = torch.tensor([requests[i].sample_id for i in ready], dtype=torch.long, device=dev)
        toks = sample_tokens(logp, seed=sp.seed, sample_ids=sample_ids, positions=positions,
                             top_p=sp.top_p)
        for j, i in enumerate(ready):
            t = int(toks[j])
            outs[i].response_ids.append(t)
            outs[i].logprobs.append(logp[j, t].cpu())
            if t == sp.eos_id:
                outs[i].finish_reason = "eos"
            elif len(outs[i].response_ids) >= sp.max_new_tokens:
                outs[i].finish_reason = "length"
