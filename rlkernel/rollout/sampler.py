"""Batch-invariant token sampling: counter-based noise, exact top-p, exponential race.

What it is: the rollout engine's sampler under the canonical contract (DESIGN.md §3). Given the
canonical log-softmax of ``logits / T`` (computed elsewhere), it draws one token per sample so that
a sample's token is a pure function of (its logprob row, seed, sample id, position, top_p): the
same bits whatever batch row it sits in, however many other samples share the batch, and in
whatever order rows are processed.

How:
- Noise is counter-based: u(seed, sample_id, position, token_id) in (0, 1) is a 64-bit
  splitmix64-style hash of the four integers (see ``counter_uniform``); no RNG state exists. This is
  the idea behind Philox counter-based generators and SGLang's deterministic-inference sampler,
  which derives sampling noise from a hash of (seed, position, token) instead of a stateful
  generator (paraphrased; no code taken).
- Sampling is an exponential race, as in vLLM's sampler: with q = -log(u) ~ Exp(1) independently
  per token, argmax_i p_i / q_i is distributed as Categorical(p). Here in log space:
  argmax_i (logp_i - log q_i), ties to the smallest token id.
- Top-p keeps a token iff the probability mass of the tokens strictly before it in the total order
  (p desc, token id asc) is < top_p; the running sum is done exactly in 60-bit fixed point, so it
  does not depend on summation order.
- exp/log come from ``rlkernel.kernels.elementwise`` (fixed IEEE op sequences), never torch.exp /
  torch.log, whose CPU vectorised body and scalar tail can differ by an ulp.

Devices: fp32 rows on CUDA are drawn by one Triton pass (kernels/triton_sampler.py: the same
operations, so the same tokens as the torch ops here on any device; top-p's sort stays torch);
everything else by the torch ops below.

What it does not do: temperature or log-softmax (the caller passes canonical logprobs), top-k,
min-p, repetition penalties or logit bias.
"""

from __future__ import annotations

import math
import operator

import torch

from rlkernel.kernels import triton_util
from rlkernel.kernels.elementwise import exp64, log64

__all__ = ["counter_uniform", "draw", "invalid_rows", "sample_tokens", "sampled_logprobs"]

_MASK64 = (1 << 64) - 1
# splitmix64 constants (Steele, Lea & Flood 2014; public-domain reference by S. Vigna).
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB

# Fixed-point scale for the exact top-p cumulative sum: p is stored as round(p * 2**60).
_FIX_BITS = 60
_FIX_ONE = 1 << _FIX_BITS

# Rows per chunk in sample_tokens are chosen so that a chunk holds at most this many [row, token]
# elements (bounds the float64/int64 temporaries). Rows are independent, so chunking never changes
# a result.
_CHUNK_ELEMS = 1 << 21


def _signed64(c: int) -> int:
    """The int64 value whose two's-complement bits equal the unsigned 64-bit integer c mod 2**64."""
    c &= _MASK64
    return c - (1 << 64) if c >= (1 << 63) else c


def _mix64_ref(z: int) -> int:
    """splitmix64 finalizer on a Python int (taken mod 2**64); returns an int in [0, 2**64)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def _seed_state(seed: int) -> int:
    """First hash stage, h0 = mix(seed + GOLDEN), as an unsigned 64-bit Python int."""
    return _mix64_ref((seed + _GOLDEN) & _MASK64)


def _counter_uniform_reference(seed: int, sample_id: int, position: int, token_id: int) -> float:
    """Pure-Python definition of the noise; ``counter_uniform`` must equal it bit for bit.

    All arithmetic is on unsigned 64-bit integers (inputs taken mod 2**64, so negative ints use
    their two's-complement bits; ``mix`` is the splitmix64 finalizer)::

        h = mix(seed + G)
        h = mix((h ^ sample_id) + G)
        h = mix((h ^ position) + G)
        h = mix((h ^ token_id) + G)          # G = 0x9E3779B97F4A7C15
        k = h >> 12                          # top 52 bits, 0 <= k < 2**52
        u = (k + 0.5) * 2**-52               # exact in float64; 2**-53 <= u <= 1 - 2**-53

    Each stage is a bijection of h for fixed input and of the input for fixed h.
    """
    h = _seed_state(operator.index(seed))
    for v in (sample_id, position, token_id):
        h = _mix64_ref(((h ^ (operator.index(v) & _MASK64)) + _GOLDEN) & _MASK64)
    k = h >> 12
    return (float(k) + 0.5) * 2.0**-52


def _lshr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` on int64 is arithmetic: mask the sign copies)."""
    return torch.bitwise_and(torch.bitwise_right_shift(z, k), (1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 tensors; multiplication wraps modulo 2**64 (two's complement)."""
    z = torch.bitwise_xor(z, _lshr(z, 30)) * _signed64(_MUL1)
    z = torch.bitwise_xor(z, _lshr(z, 27)) * _signed64(_MUL2)
    return torch.bitwise_xor(z, _lshr(z, 31))


def _check_ids(name: str, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D [S], got shape {tuple(t.shape)}")
    return t.to(torch.int64)


def counter_uniform(
    seed: int, sample_ids: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Counter-based uniforms u[s, t] = U(seed, sample_ids[s], positions[s], t) for t < vocab_size.

    Args:
        seed: Python int (any size; used mod 2**64).
        sample_ids: integer tensor [S] (converted to int64; negative values use their
            two's-complement bits).
        positions: integer tensor [S], same length and device as ``sample_ids``.
        vocab_size: number of token ids V >= 1.

    Returns:
        float64 tensor [S, V] on ``sample_ids``' device, every value in the open interval (0, 1):
        exactly ``_counter_uniform_reference(seed, sample_ids[s], positions[s], t)`` (documented
        there). Values are multiples of 2**-52 offset by 2**-53, so 2**-53 <= u <= 1 - 2**-53. The
        top 52 (not 53) hash bits are used because (k + 0.5)·2**-53 is not representable in
        float64 for k >= 2**52 and could round to 1.0.

    Each element depends only on its four integers, never on S, the row, or other rows.
    Computed with int64 tensor ops: wrap-around add/mul, xor, and masked (logical) right shifts.

    Raises:
        TypeError: non-integer seed / ids / positions.
        ValueError: ids or positions not 1-D, lengths or devices differ, vocab_size < 1.
    """
    seed = operator.index(seed)
    vocab_size = operator.index(vocab_size)
    sid = _check_ids("sample_ids", sample_ids)
    pos = _check_ids("positions", positions)
    if sid.shape != pos.shape:
        raise ValueError(
            f"sample_ids and positions must have the same length, got {sid.shape[0]} and {pos.shape[0]}"
        )
    if sid.device != pos.device:
        raise ValueError(f"sample_ids on {sid.device} but positions on {pos.device}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    g = _signed64(_GOLDEN)
    h = torch.full_like(sid, _signed64(_seed_state(seed)))
    h = _mix64(torch.bitwise_xor(h, sid) + g)
    h = _mix64(torch.bitwise_xor(h, pos) + g)
    tok = torch.arange(vocab_size, dtype=torch.int64, device=sid.device)
    h = _mix64(torch.bitwise_xor(h[:, None], tok[None, :]) + g)
    k = _lshr(h, 12)  # < 2**52: exact in float64, and k + 0.5 is exact too
    return (k.to(torch.float64) + 0.5) * 2.0**-52


def _top_p_order(p: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [S, V] int64, kept [S, V] bool in that order) for float64 probabilities p [S, V].

    Order: tokens sorted by (p desc, token id asc), a total order (a stable sort of the id-ordered
    row on the key -p). Fixed point: P = round_half_even(p * 2**60) as int64; the product is exact
    (scaling by a power of two) and P <= 2**60 for p <= 1, so each token's error is <= 2**-61.
    C_before = the int64 sum of P over the tokens strictly before a token in that order (exact, so
    independent of summation order). A token is kept iff C_before < top_p * 2**60 as real numbers,
    i.e. iff C_before < ceil(top_p * 2**60) (top_p * 2**60 is exact in float64). The top token has
    C_before = 0 < ceil(...) >= 1, so it is always kept, and the kept tokens are a prefix of the
    order (C_before never decreases along it).
    Requires the row sum of p < 8 so the int64 sum cannot overflow (callers check).
    """
    fixed = torch.round(p * float(_FIX_ONE)).to(torch.int64)
    _, order = torch.sort(-p, dim=-1, stable=True)
    fixed_sorted = torch.gather(fixed, -1, order)
    before = torch.cumsum(fixed_sorted, dim=-1) - fixed_sorted
    return order, before < math.ceil(top_p * float(_FIX_ONE))


def _top_p_keep_mask(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus mask [S, V] bool for float64 probabilities p [S, V] (rows need not be normalised):
    the tokens `_top_p_order` keeps, in id order."""
    order, keep_sorted = _top_p_order(p, top_p)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def _top_p_cut(p: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The last kept token of each row in the order (p desc, id asc): (cut_p [S] float64, cut_id
    [S] int64). Token t is kept (`_top_p_keep_mask`) iff p_t > cut_p, or p_t = cut_p and
    t <= cut_id: the kept tokens are a prefix of the order (the Triton race's form)."""
    order, keep_sorted = _top_p_order(p, top_p)
    last = keep_sorted.sum(-1, keepdim=True) - 1
    cut_id = torch.gather(order, -1, last)
    return torch.gather(p, -1, cut_id)[:, 0], cut_id[:, 0]


def _argmax_lowest_id(score: torch.Tensor) -> torch.Tensor:
    """Per-row argmax of a float64 [S, V] tensor; among equal maxima the smallest column index.

    Explicit (max, then min index among the maxima) so that the tie rule does not depend on
    torch.argmax's implementation. Exact: max and integer min are order-independent.
    """
    best = torch.amax(score, dim=-1, keepdim=True)
    idx = torch.arange(score.shape[-1], dtype=torch.int64, device=score.device)
    cand = torch.where(score == best, idx, score.shape[-1])
    return torch.amin(cand, dim=-1)


def _validate_top_p(top_p: float) -> float:
    try:
        tp = float(top_p)
    except (TypeError, ValueError):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}") from None
    if not (0.0 < tp <= 1.0):  # also rejects NaN
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return tp


def sample_tokens(
    logprobs: torch.Tensor,
    *,
    seed: int,
    sample_ids: torch.Tensor,
    positions: torch.Tensor,
    top_p: float,
    validate: bool = True,
) -> torch.Tensor:
    """Draw one token per row from canonical logprobs, batch-invariantly.

    Args:
        logprobs: float tensor [S, V] (normally float32): the canonical log-softmax of
            ``logits / temperature`` over the full vocabulary; -inf marks impossible tokens.
        seed: run / request seed (Python int, used mod 2**64).
        sample_ids: integer tensor [S]: the logical sample id of each row.
        positions: integer tensor [S]: the position (token index) being sampled in each row.
        top_p: nucleus mass in (0, 1]; 1.0 keeps every token (no sort).
        validate: check the values of logprobs (NaN, +inf, rows without a finite entry, row
            sums). Each check reads a result on the host — a device sync on CUDA — so the
            rollout engine passes False and checks the same conditions itself on the device
            (`invalid_rows`), reading the flags once every few steps. Shapes, dtypes and top_p
            are checked either way. The drawn tokens do not depend on this flag.

    Returns:
        int64 tensor [S] of token ids on ``logprobs``' device.

    Algorithm, per row: p = exp64(float64(logp)); kept = top-p mask (see ``_top_p_keep_mask``:
    order (p desc, id asc), exact 60-bit fixed-point cumulative sum, keep iff mass strictly before
    < top_p); u = counter_uniform(...); q = -log64(u) ~ Exp(1); token = argmax over kept tokens of
    float64(logp) - log64(q) (= argmax p/q, the exponential race of vLLM's sampler), ties to the
    smallest id. Tokens with logp = -inf get score -inf and are never chosen. Every step is
    elementwise or an exact per-row reduction, so a row's token depends only on its own inputs.

    Raises:
        ValueError: top_p not in (0, 1] (incl. NaN), logprobs not 2-D floating, sample_ids /
            positions length != S or not 1-D, NaN or +inf in logprobs, a row with no finite
            logprob, or (top_p < 1) a row whose probabilities sum to more than 4 (not log-softmax).
        TypeError: sample_ids / positions not integer tensors.
    """
    tp, sid, pos = _check_args(logprobs, sample_ids, positions, top_p)
    S, V = logprobs.shape
    if validate and (torch.isnan(logprobs).any() or torch.isposinf(logprobs).any()):
        raise ValueError("logprobs contain NaN or +inf")
    if _fused(logprobs):
        if validate:   # per chunk of rows: its float64 temporaries stay bounded
            for r0, r1 in _row_chunks(S, V):
                _validate_rows(logprobs[r0:r1], tp)
        return _race(logprobs, seed, sid, pos, tp)[0]
    out = torch.empty(S, dtype=torch.int64, device=logprobs.device)
    for r0, r1 in _row_chunks(S, V):
        lp = logprobs[r0:r1].to(torch.float64)
        if validate:
            _validate_rows(lp, tp)
        keep = _top_p_keep_mask(exp64(lp), tp) if tp < 1.0 else None
        u = counter_uniform(seed, sid[r0:r1], pos[r0:r1], V)
        q = -log64(u)  # in (1.1e-16, 36.8): u is never 0 or 1
        score = lp - log64(q)
        if keep is not None:
            score = torch.where(keep, score, torch.full_like(score, float("-inf")))
        out[r0:r1] = _argmax_lowest_id(score)
    return out


def _row_chunks(S: int, V: int):
    """(r0, r1) row ranges of at most _CHUNK_ELEMS elements of an [S, V] row block (at least one
    row each): what bounds the float64/int64 temporaries. Rows are independent, so the cut
    changes no result."""
    rows = max(1, _CHUNK_ELEMS // V)
    return ((r0, min(S, r0 + rows)) for r0 in range(0, S, rows))


def _validate_rows(lp: torch.Tensor, tp: float) -> None:
    """The value checks of `sample_tokens(validate=True)` on rows lp [R, V] (host syncs)."""
    if not torch.isfinite(lp).any(dim=-1).all():
        raise ValueError("every row of logprobs needs at least one finite entry")
    # Guard for the int64 fixed-point sum (overflow needs a row sum >= 8); any log-softmax row
    # sums to ~1. Float summation order does not matter at this margin.
    if tp < 1.0 and (exp64(lp.to(torch.float64)).sum(dim=-1) > 4.0).any():
        raise ValueError("logprobs rows do not look normalised (sum of exp > 4)")


def _fused(logprobs: torch.Tensor) -> bool:
    """Whether the Triton race (kernels/triton_sampler.py) draws these rows: fp32 on CUDA (or
    anywhere under TRITON_INTERPRET=1, Triton's CPU interpreter: the tests' way to run it)."""
    return (logprobs.is_cuda or triton_util.INTERPRET) and logprobs.dtype == torch.float32


def _race(logprobs: torch.Tensor, seed: int, sid: torch.Tensor, pos: torch.Tensor,
          tp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, bad) by the Triton race: the torch path's tokens for rows `invalid_rows` does
    not flag. Top-p's cut is computed here per chunk of rows (a sort: torch ops)."""
    from rlkernel.kernels import triton_sampler   # lazy: CPU installs need no triton
    cut = None
    if tp < 1.0:
        S, V = logprobs.shape
        cut_p = torch.empty(S, dtype=torch.float64, device=logprobs.device)
        cut_id = torch.empty(S, dtype=torch.int64, device=logprobs.device)
        for r0, r1 in _row_chunks(S, V):
            cut_p[r0:r1], cut_id[r0:r1] = _top_p_cut(exp64(logprobs[r0:r1].to(torch.float64)), tp)
        cut = (cut_p, cut_id)
    return triton_sampler.race(logprobs, _signed64(_seed_state(seed)), sid, pos, cut)


def draw(logprobs: torch.Tensor, *, seed: int, sample_ids: torch.Tensor,
         positions: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens(..., validate=False)` and `invalid_rows(logprobs)` together, without a
    host sync: (tokens [S] int64, bad [S] bool). fp32 rows on CUDA take one Triton pass for
    both (kernels/triton_sampler.py); elsewhere the torch ops. A flagged row's token is
    unspecified (the torch path and the kernel may differ there: NaN, +inf, no finite entry).
    Raises as `sample_tokens` does on shapes, dtypes and top_p."""
    tp, sid, pos = _check_args(logprobs, sample_ids, positions, top_p)
    if _fused(logprobs):
        return _race(logprobs, seed, sid, pos, tp)
    toks = sample_tokens(logprobs, seed=seed, sample_ids=sid, positions=pos, top_p=tp,
                         validate=False)
    return toks, invalid_rows(logprobs)


def _check_args(logprobs: torch.Tensor, sample_ids: torch.Tensor, positions: torch.Tensor,
                top_p: float) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(top_p, sample ids, positions as int64 on the logprobs' device) after the shape, dtype
    and range checks `sample_tokens` documents (not the value checks)."""
    tp = _validate_top_p(top_p)
    if not isinstance(logprobs, torch.Tensor) or not logprobs.dtype.is_floating_point:
        raise ValueError("logprobs must be a floating-point torch.Tensor [S, V]")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be 2-D [S, V], got shape {tuple(logprobs.shape)}")
    S, V = logprobs.shape
    sid = _check_ids("sample_ids", sample_ids)
    pos = _check_ids("positions", positions)
    if sid.shape[0] != S or pos.shape[0] != S:
        raise ValueError(
            f"sample_ids ({sid.shape[0]}) and positions ({pos.shape[0]}) must have length S={S}"
        )
    if V < 1:
        raise ValueError("logprobs must have a non-empty vocabulary dimension")
    return tp, sid.to(logprobs.device), pos.to(logprobs.device)


def invalid_rows(logprobs: torch.Tensor) -> torch.Tensor:
    """[S] bool on logprobs' device, without a host sync: rows with a NaN or +inf, or with no
    finite entry (what `sample_tokens(validate=True)` rejects in a log-softmax row; the sum
    guard there is for inputs that are not a log-softmax)."""
    return (torch.isnan(logprobs).any(-1) | torch.isposinf(logprobs).any(-1)
            | ~torch.isfinite(logprobs).any(-1))


def sampled_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The logprob of each row's token: ``logprobs[s, tokens[s]]`` (a gather; exact, same dtype).

    Args:
        logprobs: float tensor [S, V].
        tokens: integer tensor [S] with 0 <= tokens[s] < V.

    Returns:
        tensor [S] with ``logprobs``' dtype and device.

    Raises:
        ValueError: logprobs not 2-D, tokens not 1-D of length S, or a token id out of range.
        TypeError: tokens not an integer tensor.
    """
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 2:
        raise ValueError("logprobs must be a 2-D torch.Tensor [S, V]")
    tok = _check_ids("tokens", tokens)
    S, V = logprobs.shape
    if tok.shape[0] != S:
        raise ValueError(f"tokens has length {tok.shape[0]}, expected S={S}")
    if S and (int(tok.min()) < 0 or int(tok.max()) >= V):
        raise ValueError(f"token ids must be in [0, {V}), got range [{int(tok.min())}, {int(tok.max())}]")
    return torch.gather(logprobs, 1, tok.to(logprobs.device)[:, None]).squeeze(1)
