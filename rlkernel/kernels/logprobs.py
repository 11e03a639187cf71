"""Vocab-sharded log-softmax: token logprobs and entropy of logits / T, with backward.
CPU reference here; CUDA tensors dispatch to the Triton kernels.

z = logits / T in fp32 (the same division in rollout and trainer, DESIGN.md §3). The vocab is cut
into VIRTUAL_TP equal shards; per shard, in a fixed order: m = max z, s = Σ exp(z − m) and
t = Σ exp(z − m)·z (pairwise trees over the shard). Shards merge by the pairwise tree with
    m = max(m₁, m₂);  s = s₁·e^{m₁−m} + s₂·e^{m₂−m};  t likewise,
so a vocab-parallel TP group can merge rank subtrees with a tree all-reduce and get the same bits.
Then lse = m + log s, logprob(y) = z_y − lse, entropy = lse − t/s.
Padded vocabularies: with `live_vocab` = n < V (a tokenizer with fewer ids than the model's
embedding rows, e.g. 151,669 of Qwen3's 151,936), z of every id ≥ n is −inf — a select by global id
on the full-vocab row, so the same on every TP rank, in rollout and trainer — and those ids have
probability exactly 0: never sampled, no gradient, and no mass in lse or entropy.
Backward (per token, elementwise; p = exp(z − lse)):
    dz = g_lp·(onehot(y) − p) − g_ent·p·(z − lse + H);   dlogits = dz / T
`linear_token_logprobs_entropy` fuses the LM head: on CUDA its forward never forms the
[tokens, vocab] logits (kernels/triton_logprobs.py, the same bits as the unfused path); its backward
recomputes the logits of the call once, in row chunks (d logits is per token, so the float64
temporaries stay bounded: ROWS_ELEMS per chunk), and keeps d logits in the compute dtype. On
CUDA, d logits is one Triton pass per chunk (kernels/triton_dlogits.py, the same bits as
`_dlogits` on CPU), which also forms z = logits / T from the recomputed logits. With a
bf16 compute dtype the LM head has the linears' rounding points (kernels/matmul.py): h before
the logits product, d logits before the dh and dW products. CUDA tensors use the Triton
statistics kernel (its own chunk order; the shard tree and the formulas above are shared), and
the shard merge and lse / entropy run as one Triton launch (triton_logprobs.finish_stats, the
bits of `_finish_stats`'s torch ops on CPU; as CUDA torch ops they were hundreds of launches).
Vocab-parallel TP (`vocab_comm`): each rank's slice computes its virtual shards' statistics,
which the group all-gathers (3 floats per shard and token) and every rank merges by the same
tree, so no rank forms the [tokens, vocab] logits or gathers them (rollout sampling, which
needs the whole distribution, gathers logits through model.logits).
Does not: own a process group (the caller passes the TP group's Comm).
"""

from __future__ import annotations

import torch

from rlkernel.distributed.comm import Comm
from rlkernel.distributed.tokensum import TokenSum
from rlkernel.kernels.elementwise import exp32, log32
from rlkernel.kernels.matmul import (check_compute_dtype, column_parallel_dx, grad_weight,
                                     linear_nt, rounding_point, weight_point)
from rlkernel.spec import VIRTUAL_TP
from rlkernel.numerics.trees import tree_sum


def _shard_stats(z: torch.Tensor, shards: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, v = z.shape
    if v % shards:
        raise ValueError(f"log-softmax: vocab {v} is not a multiple of {shards} vocab shards")
    if z.is_cuda:   # the Triton kernel (kernels/triton_logprobs.py): CUDA chunk order
        from rlkernel.kernels import triton_logprobs
        return triton_logprobs.shard_stats(z, 1.0, shards)[:3]
    zs = z.reshape(n, shards, v // shards)
    m = zs.amax(-1)
    # −inf logits (masked tokens) contribute exactly 0 to s and t; an all-masked shard has m = −inf.
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = exp32(zs - m_safe[..., None])
    ez = torch.where(e > 0, e * zs, torch.zeros_like(e))
    return m, tree_sum(e, -1), tree_sum(ez, -1)


def _merge(a, b):
    (m1, s1, t1), (m2, s2, t2) = a, b
    m = torch.maximum(m1, m2)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    f1, f2 = exp32(m1 - m_safe), exp32(m2 - m_safe)
    return m, s1 * f1 + s2 * f2, t1 * f1 + t2 * f2


def merge_shard_stats(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor):
    """Pairwise-tree merge over the shard dim (last) of per-shard (max, sumexp, Σe·z) -> [N] each."""
    level = [(m[..., i], s[..., i], t[..., i]) for i in range(m.shape[-1])]
    while len(level) > 1:
        nxt = [_merge(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def check_live_vocab(live_vocab: int | None, vocab: int) -> int:
    """The live-id bound n of a [*, vocab] row: `vocab` when None; ValueError unless 1 <= n <= V."""
    if live_vocab is None:
        return vocab
    if (isinstance(live_vocab, bool) or not isinstance(live_vocab, int)
            or not 1 <= live_vocab <= vocab):
        raise ValueError(f"live_vocab {live_vocab!r} must be an integer in [1, {vocab}] (the "
                         f"model's vocab)")
    return live_vocab


def _div_t(logits: torch.Tensor, temperature: float, live_vocab: int | None = None) -> torch.Tensor:
    """z = logits / T, correctly rounded, with z = −inf for ids >= live_vocab (a select: exact).
    On CUDA by the Triton kernel: torch's CUDA `x / scalar` multiplies by the reciprocal, which
    the fused kernel (div_rn) would not reproduce."""
    return _div_t_live(logits, temperature, check_live_vocab(live_vocab, logits.shape[-1]))


def _div_t_live(logits: torch.Tensor, temperature: float, n_live: int) -> torch.Tensor:
    """`_div_t` with the live bound as a column count in [0, V]: a vocab slice of a TP rank may
    hold no live id at all (its whole slice past the tokenizer's ids)."""
    if logits.is_cuda:
        from rlkernel.kernels import triton_logprobs
        z = triton_logprobs.div_scalar(logits, temperature)
    else:
        z = logits / temperature
    if n_live < z.shape[-1]:
        z[..., n_live:] = float("-inf")
    return z


def _vocab_slice(vocab_comm: Comm | None, v_local: int, targets: torch.Tensor,
                 live_vocab: int | None) -> tuple[torch.Tensor, int]:
    """What a vocab-parallel rank needs of global ids: (targets as local column indices, live
    ids of its slice in [0, v_local]). A target another rank holds gets a local index outside
    [0, v_local), which matches no column here (rank 0's -1 included)."""
    off = 0 if vocab_comm is None else vocab_comm.rank * v_local
    live = v_local * (1 if vocab_comm is None else vocab_comm.size) \
        if live_vocab is None else live_vocab
    return targets - off, min(max(live - off, 0), v_local)


def _finish_stats(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor):
    """(lse, entropy) [N] of per-shard stats [N, shards]: merge_shard_stats, lse = m + log s,
    entropy = lse − t/s. On CUDA one Triton launch (kernels/triton_logprobs.finish_stats, the
    same bits; the torch ops would be ~120 small launches per call)."""
    if m.is_cuda:
        from rlkernel.kernels import triton_logprobs
        return triton_logprobs.finish_stats(m, s, t)
    m, s, t = merge_shard_stats(m, s, t)
    lse = m + log32(s)
    return lse, lse - t / s


def _forward_stats(z: torch.Tensor, shards: int):
    return _finish_stats(*_shard_stats(z, shards))


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, shards: int,
                live_vocab: int | None):
        z = _div_t(logits.to(torch.float32), temperature, live_vocab)
        lse, ent = _forward_stats(z, shards)
        lp = z.gather(1, targets[:, None])[:, 0] - lse
        ctx.save_for_backward(z, targets, lse, ent)
        ctx.temperature = temperature
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor, g_ent: torch.Tensor):
        z, targets, lse, ent = ctx.saved_tensors
        dz = _dlogits_by_rows(lambda a, b: z[a:b], z.shape[1], targets, lse, ent, g_lp, g_ent,
                              ctx.temperature, torch.float32)
        return dz, None, None, None, None


ROWS_ELEMS = 1 << 25
"""Logit elements per chunk of the d-logits computation (its float64 temporaries: 256 MiB each)."""


def _dlogits_by_rows(rows, v, targets, lse, ent, g_lp, g_ent, temperature, out_dtype,
                     live_vocab=None, from_logits=False):
    """`_dlogits` over row chunks: rows(a, b) gives z [b - a, v] of rows [a, b) (from_logits:
    the logits, and z = _div_t(logits, T, live_vocab), live_vocab here a column count in [0, v]);
    the result is [N, v] in out_dtype (rows are independent, so the chunking changes no bit).
    A target outside [0, v) (a vocab slice's row whose target another rank holds) adds to no
    column. CUDA chunks run the Triton kernel (kernels/triton_dlogits.py: the same bits,
    without the float64 temporaries)."""
    n = lse.shape[0]
    live = v if live_vocab is None else live_vocab
    out = torch.empty(n, v, dtype=out_dtype, device=lse.device)
    step = max(1, ROWS_ELEMS // max(1, v))
    for a in range(0, n, step):
        b = min(n, a + step)
        gent = None if g_ent is None else g_ent[a:b]
        x = rows(a, b)
        if x.is_cuda:
            from rlkernel.kernels import triton_dlogits
            triton_dlogits.dlogits(x, targets[a:b], lse[a:b], ent[a:b], g_lp[a:b], gent,
                                   temperature, out[a:b], from_logits=from_logits,
                                   live_vocab=live_vocab)
            continue
        z = _div_t_live(x, temperature, live) if from_logits else x
        out[a:b] = _dlogits(z, targets[a:b], lse[a:b], ent[a:b], g_lp[a:b], gent, temperature)
    return out


def _dlogits(z, targets, lse, ent, g_lp, g_ent, temperature):
    """d loss / d logits [N, V] from z = logits / T and the forward's lse, entropy [N]; a masked
    id (z = −inf) has p = 0, so its d logit is ±0. A target outside [0, V) (held by another
    vocab-parallel rank) adds g_lp nowhere: no add at all, not an add of zero, which could turn
    a −0.0 into +0.0."""
    logp = z - lse[:, None]
    p = exp32(logp)
    dz = -(g_lp[:, None] * p)
    here = ((targets >= 0) & (targets < z.shape[1])).nonzero(as_tuple=True)[0]
    cols = targets[here]
    dz[here, cols] = dz[here, cols] + g_lp[here]
    if g_ent is not None:
        pl = torch.where(p > 0, p * (logp + ent[:, None]), torch.zeros_like(p))
        dz = dz - g_ent[:, None] * pl
    return dz / temperature


class _LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, targets, temperature, shards, tok, live_vocab, cd, vocab_comm):
        hr, wr = rounding_point(h, cd), weight_point(w, cd, tok)
        local, n_live = _vocab_slice(vocab_comm, w.shape[0], targets, live_vocab)
        if h.is_cuda:
            from rlkernel.kernels import triton_logprobs
            m, s, t, z_y = triton_logprobs.linear_shard_stats(hr, wr, local, temperature,
                                                              shards, n_live)
        else:
            z = _div_t_live(linear_nt(hr, wr), temperature, n_live)
            m, s, t = _shard_stats(z, shards)
            held = (local >= 0) & (local < z.shape[1])
            z_y = torch.where(held, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0],
                              float("-inf"))
        if vocab_comm is not None and vocab_comm.size > 1:
            m, s, t, z_y = _gather_vocab_stats(vocab_comm, w.shape[0], targets, m, s, t, z_y)
        lse, ent = _finish_stats(m, s, t)
        ctx.save_for_backward(hr, w, local, lse, ent)
        ctx.temperature, ctx.shards, ctx.tok, ctx.param = temperature, shards, tok, w
        ctx.n_live, ctx.cd = n_live, cd
        return z_y - lse, ent

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor, g_ent: torch.Tensor):
        h, w, local, lse, ent = ctx.saved_tensors
        w = weight_point(ctx.param, ctx.cd, ctx.tok)
        # recomputed row by row, divided by T and masked the same way: the same bits as forward
        dlogits = _dlogits_by_rows(lambda a, b: linear_nt(h[a:b], w), w.shape[0], local, lse,
                                   ent, g_lp, g_ent, ctx.temperature, ctx.cd,
                                   live_vocab=ctx.n_live, from_logits=True)
        dh = column_parallel_dx(dlogits, w, ctx.shards) if ctx.needs_input_grad[0] else None
        dw = grad_weight(dlogits, h, ctx.param, ctx.tok) if ctx.needs_input_grad[1] else None
        return dh, dw, None, None, None, None, None, None, None


def _check_targets(targets: torch.Tensor, vocab: int) -> None:
    """Targets must be ids in [0, vocab): no rank would hold another, and it would silently get
    logprob −inf and no gradient term. CPU: ValueError naming one. CUDA: a device-side assert
    (no host sync; the unfused path's gather fails the same way)."""
    if targets.is_cuda:
        torch._assert_async(((targets >= 0) & (targets < vocab)).all())
        return
    bad = ((targets < 0) | (targets >= vocab)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"fused logprobs: target {int(targets[i])} at row {i} is not a token id "
                         f"of the {vocab}-id vocabulary")


def _gather_vocab_stats(vocab_comm: Comm, v_local: int, targets: torch.Tensor, m, s, t, z_y):
    """Every rank's shard statistics [N, local shards] → [N, all shards] in rank order (rank r's
    slice holds the virtual shards [r·S/tp, (r+1)·S/tp)), and the target's z from the rank whose
    slice holds it (an exact pick): per token 3·S + 1 floats cross the group, not V logits."""
    parts = vocab_comm.all_gather(torch.stack([m, s, t]), "vocab-shard-stats")
    m, s, t = torch.cat(parts, dim=2).unbind(0)
    owner = torch.div(targets, v_local, rounding_mode="floor").clamp(0, vocab_comm.size - 1)
    return m, s, t, vocab_comm.select_owner(z_y, owner, "vocab-target-logit")


def linear_token_logprobs_entropy(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor,
                                  temperature: float, shards: int = VIRTUAL_TP,
                                  tok: TokenSum | None = None, live_vocab: int | None = None,
                                  compute_dtype: torch.dtype = torch.float32,
                                  vocab_comm: Comm | None = None):
    """token_logprobs_entropy(h @ Wᵀ, targets, T, live_vocab=...) without keeping the logits.

    h [N, H] fp32 (every row of the TP group: under SP, already gathered), targets [N] long
    (global ids in [0, V)), temperature > 0, live_vocab in [1, V] or None (= V). w [V, H] is the full
    vocabulary, or with `vocab_comm` (the TP group; vocab-parallel LM head) this rank's slice
    [V/tp, H] of rows [r·V/tp, (r+1)·V/tp), `shards` then its local virtual shards
    (VIRTUAL_TP/tp). -> (logprobs [N], entropy [N]) fp32, identical on every rank of the group
    and bitwise equal to the unfused path on the full-vocab logits at any TP: each virtual
    shard's (max, Σe, Σe·z) is the same per-token chain on whichever rank holds it, the ranks
    all-gather those statistics (3 floats per shard and token) and the target's z, and every
    rank finishes the canonical shard tree (DESIGN.md §1, vocab-parallel log-softmax). The
    [N, V] logits are never gathered: each rank forms only its [N, V/tp] slice (on CUDA not
    even that in the forward). Backward: d logits of the slice recomputed once per call; dh
    this rank's subtree of the virtual-TP tree over its vocab shards (`parallel.enter_tp`
    finishes it across TP, as for the column-parallel LM head), dW by the token reduction
    through `tok` (N a multiple of TOKEN_LEAF), as the LM head's own backward. On CUDA the
    forward's extra memory is O(N · shards). compute_dtype: the LM head's operand dtype
    (kernels/matmul.py rounding points); the result equals column_parallel_linear(h, [w],
    compute_dtype=...) gathered and fed to token_logprobs_entropy.
    ValueError: live_vocab out of range, compute dtype not supported, shards not dividing the
    slice, a target outside [0, V) (on CUDA a device-side assert instead: no host sync).
    """
    vocab = w.shape[0] * (1 if vocab_comm is None else vocab_comm.size)
    check_live_vocab(live_vocab, vocab)
    check_compute_dtype(compute_dtype)
    if shards < 1 or w.shape[0] % shards:
        raise ValueError(f"fused logprobs: {w.shape[0]} vocab rows do not divide into {shards} "
                         f"virtual shards")
    _check_targets(targets, vocab)
    return _LinearTokenLogprobs.apply(h, w, targets, float(temperature), shards, tok, live_vocab,
                                      compute_dtype, vocab_comm)


def token_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                           shards: int = VIRTUAL_TP, live_vocab: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of `targets` and entropy under softmax(logits / temperature) over ids < live_vocab.

    logits [N, V] fp32 (the full vocab, global ids), targets [N] long, temperature > 0, live_vocab
    in [1, V] or None (= V; ids >= it have z = −inf) -> (logprobs [N] fp32, entropy [N] fp32) in
    nats; a target >= live_vocab has logprob −inf. Differentiable in `logits`.
    ValueError: live_vocab out of range, V not a multiple of `shards`.
    """
    return _TokenLogprobs.apply(logits, targets, float(temperature), shards, live_vocab)


def log_softmax(logits: torch.Tensor, temperature: float, shards: int = VIRTUAL_TP,
                live_vocab: int | None = None) -> torch.Tensor:
    """Canonical log-softmax of logits / T over the full vocab: [N, V] fp32 -> [N, V] fp32.

    Ids >= live_vocab (None: V) are −inf. Element y equals token_logprobs_entropy(...)[0] for
    target y, bitwise (same z and lse). ValueError: live_vocab out of range.
    """
    z = _div_t(logits.to(torch.float32), float(temperature), live_vocab)
    lse, _ = _forward_stats(z, shards)
    return z - lse[:, None]
