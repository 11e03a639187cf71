"""Shared pieces of the rollout engine tests (CPU and CUDA): the tiny model, requests, and the
bytes a sample is compared by. Not a test module."""

from __future__ import annotations

import torch

from rlkernel.model.checkpoint import init_weights
from rlkernel.model.config import tiny
from rlkernel.rollout.engine import Request, RolloutEngine, SamplingParams

CFG = tiny()
W = init_weights(CFG, 0)
PAD = 257


def engine(ops, device="cpu", **kw) -> RolloutEngine:
    """A RolloutEngine on the tiny model with the fixed weights W (bf16 parameters)."""
    e = RolloutEngine(CFG, ops, torch.bfloat16, pad_id=PAD, device=device, **kw)
    e.load_weights(W)
    return e


def requests(n: int, start: int = 0, lo: int = 3, hi: int = 30) -> list[Request]:
    """n requests with sample ids start.. and random printable prompts of lo..hi-1 tokens."""
    g = torch.Generator().manual_seed(start + 1)
    return [Request(start + i, tuple(torch.randint(32, 127, (int(torch.randint(lo, hi, (1,),
            generator=g)),), generator=g).tolist())) for i in range(n)]


def group(n: int, prompt_len: int, start: int, seed: int = 5) -> list[Request]:
    """n samples (ids start..) of one prompt of prompt_len tokens: a GRPO group."""
    g = torch.Generator().manual_seed(seed)
    prompt = tuple(torch.randint(32, 127, (prompt_len,), generator=g).tolist())
    return [Request(start + i, prompt) for i in range(n)]


def bits(c) -> tuple[list[int], list[int], str]:
    """A completion's token ids, the int32 bits of its logprobs, and its finish reason."""
    return c.response_ids, c.logprob_tensor().view(torch.int32).tolist(), c.finish_reason


def sp(max_new: int = 12, eos: int = 256, top_p: float = 0.95) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=top_p, max_new_tokens=max_new, seed=11,
                          eos_id=eos)
