"""Rollout engine: continuous batching over a paged KV cache, sampling on the device.

One engine step is schedule → run → postprocess (STYLE.md §8): the scheduler (rollout/
scheduler.py, plain Python) picks each sequence's next chunk — prompt positions, recomputed
positions after a preemption, or one decode token — under a per-step token budget; `_run` does
one model pass over all chunks and samples where a chunk reaches its sequence's end; the
scheduler's postprocess advances counts, retires sequences and frees their blocks. K/V sit in
fixed-size blocks (rollout/kv_cache.py) that are the attention's absolute KV blocks; a block
table per sequence maps logical to physical blocks (block_manager.py: free list, reference
counts, prompt-prefix sharing for GRPO groups, copy-on-write).
Why the bytes do not move: every kernel is row-invariant and attention reads a sequence's keys in
logical order at absolute positions, so a sample's tokens and logprobs depend only on (weights,
prompt, seed, sample id) — not on its batch, its step, which physical blocks hold its keys,
whether its prompt blocks are shared, or how its positions were chunked or recomputed. The
logprob of a sampled token is read from the canonical log-softmax of logits / T — the trainer
recomputes exactly that value (DESIGN.md §3).
No host sync per token: token ids live in a device buffer (prompts written once, sampled tokens
scattered in), every step's inputs are gathered from it on the device, per-step index metadata is
one pinned host→device copy, sampled logprobs go to a preallocated device buffer, and EOS is
decided on the device; the host reads the EOS flags every `check_every` steps only to retire
sequences early (tokens past an EOS are computed and dropped; they never reach another sample).
Attention reads K/V through the block table (kernels/paged_attention.py: on CUDA the Triton
forward kernel compiled with PAGED; on CPU the blocks gathered in table order), so no dense copy
of the cache is made per layer on CUDA.
Decode steps (every chunk one token, no block copy) replay CUDA graphs captured per batch-size
bucket on CUDA at rollout TP = CP = 1 (rollout/cuda_graphs.py; same bytes as eager). The pool,
buffers and graphs live for one `generate` call, or from call to call with keep_state (a
serving engine; `prepare` makes them before the first call).
Does not: capture prefill steps or steps under rollout TP/CP; split prefill across rollout-CP ranks (under rollout CP every rank
computes every query and stores only its own KV blocks — KV memory per rank ~1/CP, compute
replicated — and each layer gathers the prefix across the CP group by an exact owner pick);
share prompt blocks across calls; validate the sampler's inputs per step (non-finite rows are
flagged on the device and raised at the next host check).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from rlkernel.distributed.parallel import ParallelCtx
from rlkernel.model.config import Qwen3Config
from rlkernel.model.layout import StreamLayout
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.rollout import cuda_graphs
from rlkernel.rollout.block_manager import BlockManager
from rlkernel.rollout.kv_cache import PagedKVCache
from rlkernel.rollout.sampler import draw
from rlkernel.rollout.scheduler import Scheduler, StepPlan
from rlkernel.rollout.sequence import Sequence
from rlkernel.spec import ATTN_KV_BLOCK, CUDA_ATTN_KV_BLOCK


@dataclass(frozen=True)
class Request:
    """One sample to generate: a global sample id (keys the sampling noise), its prompt ids and
    optionally its own response length cap (None: SamplingParams.max_new_tokens)."""

    sample_id: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int | None = None


@dataclass
class Completion:
    """Generated response: token ids, their fp32 logprobs [n] (CPU, a tensor of its own, so a
    completion pickles small) and why generation stopped ("eos" or "length")."""

    sample_id: int
    prompt_ids: tuple[int, ...]
    response_ids: list[int] = field(default_factory=list)
    logprobs: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    finish_reason: str = ""

    def logprob_tensor(self) -> torch.Tensor:
        """[n] fp32 logprobs of response_ids."""
        return self.logprobs


@dataclass(frozen=True)
class SamplingParams:
    """temperature > 0, top_p in (0, 1], max_new_tokens >= 1, seed >= 0, eos_id."""

    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    eos_id: int


def _largest_need(seqs: list[Sequence], probe: BlockManager) -> int:
    """Blocks per rank the largest sequence needs (positions ever written: prompt + max_new
    - 1; the last sampled token is never fed)."""
    return max(max(probe.blocks_for(s.capacity - 1)) for s in seqs)


def _baked(sp: SamplingParams) -> tuple:
    """What a decode graph records of the sampling params (`_step` reads these as constants;
    max_new_tokens only sizes the call)."""
    return sp.temperature, sp.top_p, sp.seed, sp.eos_id


def _pow2(x: int) -> int:
    """The smallest power of two >= x >= 1."""
    return 1 << (x - 1).bit_length()


def _positive(name: str, v, allow_none: bool = True) -> None:
    if v is None and allow_none:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"RolloutEngine: {name}={v!r} must be an integer >= 1"
                         + (" or None" if allow_none else ""))


class RolloutEngine:
    """Owns its own model copy (weights arrive by `load_weights`, as in a real weight sync).

    Scheduling (none of it changes a byte of any sample):
    prefill_chunk: max tokens one sequence feeds per step (None: the step budget).
    max_step_tokens: tokens fed per step, all sequences together (default 8192).
    max_seqs: sequences in the running batch (default 256).
    kv_blocks: physical KV blocks per rank. None: on CUDA, gpu_memory_utilization × the free
        device memory at each `generate` call; on CPU, as many as the call can use.
    gpu_memory_utilization: fraction in (0, 1] of the CUDA memory free at each `generate` call
        (torch.cuda.mem_get_info: what the driver reports free, so memory torch's allocator
        keeps cached counts as used) that the KV pool may take (default 0.5; the step's gathered
        K/V, logits and the trainer need the rest). Not vLLM's meaning (a fraction of the total
        memory): here the weights and optimizer state are already allocated when it is applied.
        `rlk run --gpu-memory-utilization`. Ignored on CPU and with kv_blocks.
    prefix_sharing: samples with the same prompt share its computed KV blocks (default True).
    check_every: steps between host reads of the on-device EOS flags (default 16).
    block_shuffle_seed: permute the free lists (tests: placement must not matter).
    paged_kernel: attention reads K/V through the block table (CUDA: the paged Triton kernel);
        False gathers each row's blocks first and runs the dense kernel. Same bytes either way.
    decode_graphs: "auto" (decode steps replay CUDA graphs on CUDA at rollout TP = CP = 1),
        "eager" (never; `rlk run --enforce-eager`) or "padded" (the graph path's padded steps
        run eagerly, any device: a test mode). Same bytes in every mode (rollout/cuda_graphs.py).
    keep_state: keep the KV pool, the token/logprob buffers and the decode graphs from one
        `generate` call to the next (a serving engine's lifetime: no pool allocation or graph
        capture per call; `prepare` does them up front, `release` frees them). The kept state
        is sized in powers of two of the call's sequences, positions and new tokens, its pool
        by the call that makes it (what that call can use, within gpu_memory_utilization: the
        whole budget would starve a trainer sharing the GPU); a call that needs more positions,
        sequences or tokens, or a larger pool for its longest sequence, makes a new one (after
        freeing the old); a call with more sequences than the pool holds at once only waits
        for blocks (admission, preemption), as any call does. Default False: the state lives for one call (freed at
        its end, for the trainer). Same bytes either way (tests/test_rollout_graphs.py).
    """

    def __init__(self, cfg: Qwen3Config, ops, param_dtype: torch.dtype, pad_id: int,
                 prefill_chunk: int | None = None, device: torch.device | str = "cpu",
                 pc: ParallelCtx | None = None, live_vocab: int | None = None, *,
                 max_step_tokens: int = 8192, max_seqs: int = 256, kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.5, prefix_sharing: bool = True,
                 check_every: int = 16, block_shuffle_seed: int | None = None,
                 paged_kernel: bool = True, decode_graphs: str = "auto",
                 keep_state: bool = False) -> None:
        """live_vocab: the tokenizer's id bound when below cfg.vocab_size (a padded vocabulary):
        ids >= it get probability 0 in the canonical log-softmax and are never sampled.
        ValueError on a scheduling or memory setting outside its range (named)."""
        for name, v in (("prefill_chunk", prefill_chunk), ("kv_blocks", kv_blocks)):
            _positive(name, v)
        for name, v in (("max_step_tokens", max_step_tokens), ("max_seqs", max_seqs),
                        ("check_every", check_every)):
            _positive(name, v, allow_none=False)
        if not (isinstance(gpu_memory_utilization, (int, float))
                and 0 < gpu_memory_utilization <= 1):
            raise ValueError(f"RolloutEngine: gpu_memory_utilization={gpu_memory_utilization!r} "
                             f"must be a fraction in (0, 1]")
        self.decode_graphs = cuda_graphs.check_mode(decode_graphs)
        self.cfg = cfg
        self.model = Qwen3ForCausalLM(cfg, ops, param_dtype, pc, live_vocab).to(device)
        self.model.requires_grad_(False)
        self.model.hold_matmul_weights()    # bf16 runs: 2-D weights stored in bf16 (same values)
        self.pad_id = pad_id
        self.prefill_chunk = prefill_chunk
        self.max_step_tokens, self.max_seqs = max_step_tokens, max_seqs
        self.kv_blocks, self.gpu_memory_utilization = kv_blocks, float(gpu_memory_utilization)
        self.prefix_sharing, self.check_every = prefix_sharing, check_every
        self.block_shuffle_seed = block_shuffle_seed
        self.paged_kernel = paged_kernel
        self.block = CUDA_ATTN_KV_BLOCK if self.model.device.type == "cuda" else ATTN_KV_BLOCK
        self.keep_state = bool(keep_state)
        self._kept: _State | None = None
        self.stats: dict = {}
        """Bookkeeping of the last `generate`: steps, preemptions, blocks, sharing, KV bytes."""

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
        TP shard on the engine's device; bf16 runs hold 2-D weights in bf16, norms in fp32),
        not copies."""
        return {n: p.detach() for n, p in self.model.logical_params().items()}

    def held_form(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """What `load_weights` puts into `held_weights()[name]` on this rank from logical `t`."""
        return self.model.local_param(name, t)

    # -- memory --------------------------------------------------------------------------------
    def _kv_heads(self) -> int:
        return self.model.model.layers[0].self_attn.kv_heads

    def _free_bytes(self) -> int | None:
        """Device memory free now, in bytes (CUDA); None on CPU, where the pool is sized by the
        call. The one place the engine asks the device (tests stand in a number on CPU)."""
        if self.model.device.type != "cuda":
            return None
        return torch.cuda.mem_get_info(self.model.device)[0]

    def _pool_blocks(self, seqs: list[Sequence], bm_probe: BlockManager) -> int:
        """Physical blocks per rank for this call (no more than it can use); ValueError when one
        sequence cannot fit."""
        c, pc = self.cfg, self.model.pc
        per_block = PagedKVCache.bytes_per_block(c.num_hidden_layers, self.block, self._kv_heads(),
                                                 c.head_dim, self.model.compute_dtype)
        # Positions ever written: prompt + max_new - 1 (the last sampled token is never fed).
        needs = [bm_probe.blocks_for(s.capacity - 1) for s in seqs]
        one = _largest_need(seqs, bm_probe)
        useful = max(sum(n[p] for n in needs) for p in range(bm_probe.pools))
        if self.kv_blocks is not None:
            cap, source, knob = self.kv_blocks, f"kv_blocks={self.kv_blocks}", "kv_blocks"
        elif (free := self._free_bytes()) is not None:
            cap = int(self.gpu_memory_utilization * free) // per_block
            for comm in (pc.tp, pc.cp):      # every rank of the replica must plan the same pool
                if comm.size > 1:
                    cap = min(comm.all_gather_object(cap, "kv-pool-size"))
            source = (f"--gpu-memory-utilization {self.gpu_memory_utilization} × {free} bytes "
                      f"free ({free / 2**30:.2f} GiB)"
                      + (", the smallest pool of the rollout TP/CP ranks" if pc.tp.size > 1
                         or pc.cp.size > 1 else ""))
            knob = "--gpu-memory-utilization (engine: gpu_memory_utilization)"
        else:
            cap, source, knob = useful, "CPU default: every sequence at once", "kv_blocks"
        if one > cap:
            worst = max(seqs, key=lambda s: s.capacity)
            raise ValueError(
                f"KV pool too small: sample {worst.sample_id} needs {len(worst.prompt)} prompt + "
                f"{worst.max_new - 1} fed response positions = {worst.capacity - 1} positions = "
                f"{one} blocks of {self.block} positions per rank ({per_block} bytes each) = "
                f"{one * per_block} bytes per sequence per rank, but the pool has {cap} blocks = "
                f"{cap * per_block} bytes available ({source}); raise {knob}, or lower "
                f"--max-response-len (engine: max_new_tokens) or the prompt length")
        return min(cap, useful)

    # -- generate --------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, requests: list[Request], sp: SamplingParams) -> list[Completion]:
        """Generate a completion for every request (same order).

        Raises ValueError on an empty prompt, on a KV pool that cannot hold one sequence (naming
        the numbers) and on non-finite logprobs (at the next host check). Collective over the
        rollout TP/CP group (every rank makes the same schedule from the same requests).
        """
        seqs = self._sequences(requests, sp)
        if not seqs:
            return []
        pc = self.model.pc
        st = self._state_for(seqs, sp)
        bm = BlockManager(st.cache.blocks, self.block, pc.cp.size, self.block_shuffle_seed,
                          self.prefix_sharing)
        sched = Scheduler(seqs, bm, self.max_step_tokens, self.max_seqs, self.prefill_chunk)
        self._reset(st, seqs)
        cache, bufs, graphs = st.cache, st.bufs, st.graphs
        steps0 = graphs.steps if graphs else 0
        capture0 = graphs.capture_s if graphs else 0.0
        while sched.has_work():
            plan = sched.schedule()
            if graphs is not None and cuda_graphs.is_decode(plan):
                graphs.step(plan)
            else:
                self._run(plan, cache, bufs, sp)
            sched.postprocess(plan)
            if sched.steps % self.check_every == 0:
                self._host_check(sched, bufs)
        self._host_check(sched, bufs)
        c = self.cfg
        self.stats = {"steps": sched.steps, "preemptions": sched.preemptions,
                      "graph_steps": graphs.steps - steps0 if graphs else 0,
                      "graph_buckets": graphs.used if graphs else [],
                      "graph_capture_s": graphs.capture_s - capture0 if graphs else 0.0,
                      "kept_state": self._kept is st,
                      "pool_blocks": cache.blocks * pc.cp.size, "peak_blocks": bm.peak_used,
                      "shared_block_refs": bm.shared_refs, "cow_copies": bm.cow_copies,
                      "blocks_saved": bm.shared_refs - bm.cow_copies, "block_positions": self.block,
                      "admissions": sched.admissions,
                      "peak_kv_bytes_per_rank": max(bm.peak_used // pc.cp.size, 1) *
                      PagedKVCache.bytes_per_block(c.num_hidden_layers, self.block,
                                                   self._kv_heads(), c.head_dim,
                                                   self.model.compute_dtype)}
        toks, lps = bufs.tokens.cpu(), bufs.logprobs.cpu()
        return [self._completion(r, s, toks, lps, sp) for r, s in zip(requests, seqs)]

    @torch.no_grad()
    def prepare(self, requests: list[Request], sp: SamplingParams) -> None:
        """keep_state engines: allocate now the state `generate(requests, sp)` will use (KV
        pool, buffers) and make its decode graphs for every batch size up to min(max_seqs,
        len(requests)) — a serving engine's start-up, so that no capture falls inside the
        calls (vLLM captures at start too). Changes no byte of any sample. ValueError without
        keep_state, and on what `generate` refuses."""
        if not self.keep_state:
            raise ValueError("RolloutEngine.prepare needs keep_state=True (without it the state "
                             "lives for one generate call only)")
        seqs = self._sequences(requests, sp)
        if not seqs:
            return
        st = self._state_for(seqs, sp)
        if st.graphs is not None:
            st.graphs.prepare(min(self.max_seqs, len(seqs), cuda_graphs.BUCKETS[-1]))

    def release(self) -> None:
        """Free the kept state (KV pool, buffers, graphs) of a keep_state engine; the next
        `generate` allocates anew. A no-op otherwise."""
        self._kept = None
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def _sequences(self, requests: list[Request], sp: SamplingParams) -> list[Sequence]:
        """One Sequence per request (slot = its index); ValueError on an empty prompt or a bad
        per-request length cap."""
        for r in requests:
            if not r.prompt_ids:
                raise ValueError(f"sample {r.sample_id}: empty prompt")
            m = r.max_new_tokens
            if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
                raise ValueError(f"sample {r.sample_id}: max_new_tokens={m!r} must be an integer "
                                 f">= 1 or None")
        return [Sequence(i, r.sample_id, tuple(r.prompt_ids), r.max_new_tokens or sp.max_new_tokens)
                for i, r in enumerate(requests)]

    def _state_for(self, seqs: list[Sequence], sp: SamplingParams) -> "_State":
        """The device state of a call over `seqs`: the kept one where it is large enough (new
        decode graphs if `sp` differs from the one they were made with in what they record),
        else a new one (kept if keep_state; the old one is freed first, so the new pool is
        sized without it)."""
        n = len(seqs)
        width = max(s.capacity for s in seqs)
        max_new = max(s.max_new for s in seqs)
        probe = BlockManager(1, self.block, self.model.pc.cp.size)
        one = _largest_need(seqs, probe)
        kept = self._kept
        if kept is not None and kept.fits(n, width, max_new, one):
            if _baked(kept.sp) != _baked(sp):
                kept.graphs = self._decode_graphs(kept.cache, kept.bufs, sp, kept.rows,
                                                  kept.width, kept.max_new)
                kept.sp = sp
            return kept
        if kept is not None:
            self.release()
        if self.keep_state:           # room for later calls: fewer re-allocations and captures
            n, width, max_new = (_pow2(x) for x in (n, width, max_new))
        n_blocks = self._pool_blocks(seqs, probe)
        c, pc = self.cfg, self.model.pc
        dev = self.model.device
        cache = PagedKVCache(c.num_hidden_layers, n_blocks, self.block, self._kv_heads(),
                             c.head_dim, dev, pc.cp, self.paged_kernel, self.model.compute_dtype)
        # Row n of each buffer is a dump row: padded graph rows write there (cuda_graphs.Pads).
        bufs = _Buffers(torch.full((n + 1, width), self.pad_id, dtype=torch.long, device=dev),
                        torch.zeros(n + 1, max_new, dtype=torch.float32, device=dev),
                        torch.zeros(n + 1, dtype=torch.bool, device=dev),
                        torch.zeros((), dtype=torch.bool, device=dev))
        graphs = self._decode_graphs(cache, bufs, sp, n, width, max_new)
        st = _State(cache, bufs, graphs, n, width, max_new, sp)
        if self.keep_state:
            self._kept = st
        return st

    def _reset(self, st: "_State", seqs: list[Sequence]) -> None:
        """Buffers to a call's start, in place (graphs point into them): prompts then padding
        in the token rows, zero logprobs, no EOS, no bad row."""
        host_tok = torch.full(tuple(st.bufs.tokens.shape), self.pad_id, dtype=torch.long)
        for s in seqs:
            host_tok[s.slot, :len(s.prompt)] = torch.tensor(s.prompt, dtype=torch.long)
        st.bufs.tokens.copy_(host_tok)
        for t in (st.bufs.logprobs, st.bufs.done, st.bufs.bad):
            t.zero_()

    def _completion(self, r: Request, s: Sequence, toks, lps, sp: SamplingParams) -> Completion:
        p = len(s.prompt)
        resp = toks[s.slot, p:p + s.n_generated].tolist()
        n, reason = len(resp), "length"
        if sp.eos_id in resp:
            n, reason = resp.index(sp.eos_id) + 1, "eos"
        return Completion(r.sample_id, r.prompt_ids, resp[:n], lps[s.slot, :n].clone(), reason)

    def _host_check(self, sched: Scheduler, bufs: "_Buffers") -> None:
        """The occasional host read: raise on a non-finite logprob row, retire sequences whose
        EOS the device has flagged. Changes no byte of any sample (only when they stop)."""
        if bool(bufs.bad):
            raise ValueError("rollout: a sampled row's logprobs contain NaN or +inf, or no finite "
                             "entry (non-finite weights or activations)")
        done = bufs.done.cpu()
        for seq in [*sched.running, *sched.waiting]:
            if done[seq.slot]:
                sched.retire(seq)

    # -- the model runner --------------------------------------------------------------------
    def _decode_graphs(self, cache: PagedKVCache, bufs: "_Buffers", sp: SamplingParams, n: int,
                       width: int, max_new: int) -> cuda_graphs.DecodeGraphs | None:
        """The decode-step runner of this call (module doc), or None where steps run eagerly."""
        pc, dev = self.model.pc, self.model.device
        mode = self.decode_graphs
        if mode == "eager" or pc.tp.size > 1 or pc.cp.size > 1:
            return None
        if mode == "auto" and dev.type != "cuda":
            return None
        pads = cuda_graphs.Pads(n, width, max_new, cache.dump_block * self.block,
                                cache.zero_block, -(-width // self.block))

        def metadata(plan: StepPlan) -> dict[str, torch.Tensor]:
            return _step_metadata(plan, self.block, cache, pc.cp, width, max_new).arrays

        def body(t: dict[str, torch.Tensor], tk: int, pos_bound: int) -> None:
            self._step(t, tk, pos_bound, cache, bufs, sp, real=t["real"] > 0)

        return cuda_graphs.DecodeGraphs(body, metadata, pads, self.block, dev,
                                        capture=mode == "auto")

    def _run(self, plan: StepPlan, cache: PagedKVCache, bufs: "_Buffers",
             sp: SamplingParams) -> None:
        """One eager step: the plan's metadata uploaded, any block copies, then `_step`.
        The record_function labels (rollout.metadata/hidden/logprobs/sample) name the phases in
        a torch.profiler trace (benchmarks/bench_rollout.py --profile); outside a profiler they
        cost a few microseconds a step and change nothing."""
        if not plan.chunks:
            return
        with record_function("rollout.metadata"):
            meta = _step_metadata(plan, self.block, cache, self.model.pc.cp,
                                  bufs.tokens.shape[1], bufs.logprobs.shape[1])
            t = _upload(meta.arrays, self.model.device)
        if plan.copies:
            cache.copy_blocks(t["copies"])
        self._step(t, meta.tk, meta.pos_bound, cache, bufs, sp, sample=meta.n_sample > 0)

    def _step(self, t: dict[str, torch.Tensor], tk: int, pos_bound: int, cache: PagedKVCache,
              bufs: "_Buffers", sp: SamplingParams, sample: bool = True,
              real: torch.Tensor | None = None) -> None:
        """One forward over a step's rows (index tensors t on the device; tk, pos_bound host
        ints), then sampling at rows t["rows"]: tokens, logprobs and EOS flags scattered into
        bufs. real [N] bool: rows whose non-finite logprobs count (None: all). No host sync, so
        a CUDA graph can record it (rollout/cuda_graphs.py)."""
        with record_function("rollout.hidden"):
            cache.set_step(t["slots"], t["table"], tk)
            lay = StreamLayout(bufs.tokens.view(-1)[t["src"]], t["positions"], t["q_idx"],
                               t["q_pos"], t["kv_len"], None, pos_bound=pos_bound)
            h = self.model.hidden(lay, cache)
        if not sample:
            return
        with record_function("rollout.logprobs"):
            logp = self.model.next_token_logprobs(h[t["rows"]], sp.temperature)    # [N, V]
        with record_function("rollout.sample"):
            toks, bad = draw(logp, seed=sp.seed, sample_ids=t["sample_ids"],
                             positions=t["sample_pos"], top_p=sp.top_p)
            # A flagged row's token is unspecified (a NaN row draws id V: out of range for the
            # gather and the next step's embedding, on CUDA a device-side assert); id 0 instead,
            # so the host check raises (a padding row's NaN is not counted and must not fail).
            toks = torch.where(bad, torch.zeros_like(toks), toks)
            lp = logp.gather(1, toks[:, None])[:, 0]
            bufs.tokens.view(-1).index_copy_(0, t["tok_dst"], toks)
            bufs.logprobs.view(-1).index_copy_(0, t["lp_dst"], lp)
            slots = t["slots_sampled"]
            bufs.done.index_copy_(0, slots,
                                  bufs.done.index_select(0, slots) | (toks == sp.eos_id))
            bufs.bad |= (bad if real is None else bad & real).any()


@dataclass
class _Buffers:
    """Device state of one generate call: token ids [n + 1, width] (prompt, then sampled tokens),
    sampled logprobs [n + 1, max_new] fp32, EOS seen [n + 1] bool (row n: the dump row of padded
    graph rows), a non-finite row seen (scalar bool)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    done: torch.Tensor
    bad: torch.Tensor


@dataclass
class _State:
    """The device state generate calls run on: KV pool, buffers (rows + 1 rows of width tokens
    and max_new logprobs) and the decode graphs made for `sp` (None: eager steps)."""

    cache: PagedKVCache
    bufs: _Buffers
    graphs: cuda_graphs.DecodeGraphs | None
    rows: int
    width: int
    max_new: int
    sp: SamplingParams

    def fits(self, n: int, width: int, max_new: int, blocks: int) -> bool:
        """Whether a call of n sequences, at most width positions and max_new new tokens each,
        the largest needing `blocks` blocks per rank, can run on this state."""
        return (n <= self.rows and width <= self.width and max_new <= self.max_new
                and blocks <= self.cache.blocks)


@dataclass
class _Meta:
    arrays: dict[str, torch.Tensor]
    tk: int
    pos_bound: int
    n_sample: int


def _step_metadata(plan: StepPlan, block: int, cache: PagedKVCache, cp, width: int,
                   max_new: int) -> _Meta:
    """Host-side index tensors of one step.

    Stream rows are the chunks' tokens packed back to back. Attention rows: each chunk is cut into
    pieces of at most `block` queries (a piece attends like its chunk: a query's bits depend only
    on its own position and the keys it sees), so a step that mixes a long prefill chunk with
    decodes pads every row to `block` queries, not to the longest chunk.
    """
    if cp.size == 1 and plan.is_decode:
        return _decode_metadata(plan, block, cache, width, max_new)
    return _piece_metadata(plan, block, cache, cp, width, max_new)


def _piece_metadata(plan: StepPlan, block: int, cache: PagedKVCache, cp, width: int,
                    max_new: int) -> _Meta:
    """`_step_metadata` of any step, piece by piece."""
    src, positions, rows_q, rows_pos, kv_len, slots, tables = [], [], [], [], [], [], []
    rows, sample_ids, sample_pos, tok_dst, lp_dst, slots_sampled = [], [], [], [], [], []
    p_size, rank = cp.size, cp.rank
    dump = cache.dump_block * block
    row = 0
    for c in plan.chunks:
        seq = c.seq
        local = [cache.zero_block if b % p_size != rank else bid % cache.blocks
                 for b, bid in enumerate(seq.blocks)]
        for p0 in range(c.start, c.start + c.n, block):
            m = min(block, c.start + c.n - p0)
            pos = list(range(p0, p0 + m))
            src += [seq.slot * width + p for p in pos]
            positions += pos
            rows_q.append(list(range(row, row + m)))
            rows_pos.append(pos)
            kv_len.append(p0 + m)
            slots.append([dump if (p // block) % p_size != rank
                          else local[p // block] * block + p % block for p in pos])
            tables.append(local[:-(-(p0 + m) // block)])
            row += m
        if c.samples:
            rows.append(row - 1)
            sample_ids.append(seq.sample_id)
            sample_pos.append(seq.num_tokens)
            tok_dst.append(seq.slot * width + seq.num_tokens)
            lp_dst.append(seq.slot * max_new + seq.n_generated)
            slots_sampled.append(seq.slot)
    t = max(len(q) for q in rows_q)
    nb = max(len(tb) for tb in tables)

    def pad(lists, n, fill):
        return torch.tensor([x + [fill] * (n - len(x)) for x in lists], dtype=torch.long)

    arrays = {"src": torch.tensor(src, dtype=torch.long),
              "positions": torch.tensor(positions, dtype=torch.long),
              "q_idx": pad(rows_q, t, -1), "q_pos": pad(rows_pos, t, -1),
              "kv_len": torch.tensor(kv_len, dtype=torch.long),
              "slots": pad(slots, t, dump), "table": pad(tables, nb, cache.zero_block)}
    if plan.copies:
        arrays["copies"] = torch.tensor([[s % cache.blocks, d % cache.blocks]
                                         for s, d in plan.copies
                                         if (s // cache.blocks) == rank], dtype=torch.long
                                        ).reshape(-1, 2)
    if rows:
        arrays.update(rows=torch.tensor(rows), sample_ids=torch.tensor(sample_ids),
                      sample_pos=torch.tensor(sample_pos), tok_dst=torch.tensor(tok_dst),
                      lp_dst=torch.tensor(lp_dst), slots_sampled=torch.tensor(slots_sampled))
    return _Meta(arrays, max(kv_len), max(kv_len), len(rows))


def _decode_metadata(plan: StepPlan, block: int, cache: PagedKVCache, width: int,
                     max_new: int) -> _Meta:
    """`_step_metadata` of a decode step at CP = 1 (every chunk one token that samples, no
    copies): the same arrays, built with a few list passes and tensor ops instead of the
    general per-piece loop (host time per decode step at 256 sequences of ~1k tokens: 3.2 ->
    0.6 ms on this project's CPU; tests/test_rollout_graphs.py checks equality with
    `_piece_metadata`)."""
    seqs = [c.seq for c in plan.chunks]
    n = len(seqs)
    pos = [c.start for c in plan.chunks]
    slot = torch.tensor([s.slot for s in seqs], dtype=torch.long)
    p = torch.tensor(pos, dtype=torch.long)
    nb_row = [q // block + 1 for q in pos]            # blocks up to and including position q
    nb = max(nb_row)
    flat = torch.tensor([b for s, k in zip(seqs, nb_row) for b in s.blocks[:k]],
                        dtype=torch.long) % cache.blocks
    table = torch.full((n, nb), cache.zero_block, dtype=torch.long)
    table[torch.arange(nb)[None, :] < torch.tensor(nb_row)[:, None]] = flat
    last = table.gather(1, (p // block)[:, None])[:, 0]   # the block holding position q
    num = torch.tensor([s.num_tokens for s in seqs], dtype=torch.long)
    rows = torch.arange(n)
    arrays = {"src": slot * width + p, "positions": p.clone(), "q_idx": rows[:, None].clone(),
              "q_pos": p[:, None].clone(), "kv_len": p + 1,
              "slots": (last * block + p % block)[:, None], "table": table,
              "rows": rows.clone(), "sample_ids": torch.tensor([s.sample_id for s in seqs]),
              "sample_pos": num, "tok_dst": slot * width + num,
              "lp_dst": slot * max_new + torch.tensor([s.n_generated for s in seqs]),
              "slots_sampled": slot.clone()}
    tk = max(pos) + 1
    return _Meta(arrays, tk, tk, n)


def _upload(arrays: dict[str, torch.Tensor], dev: torch.device) -> dict[str, torch.Tensor]:
    """All int64 arrays to `dev` in one copy: pinned and non-blocking on CUDA (no host sync)."""
    if dev.type != "cuda":
        return arrays
    flat = torch.cat([a.reshape(-1) for a in arrays.values()]).pin_memory()
    return cuda_graphs.split_flat(flat.to(dev, non_blocking=True),
                                  {k: tuple(a.shape) for k, a in arrays.items()})
