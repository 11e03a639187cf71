"""Run configuration: one frozen dataclass, validated at construction, recorded verbatim.

`RunConfig` holds every setting of one `rlk run`; each field is the flag of the same name with
dashes (`n_samples_per_prompt` <-> `--n-samples-per-prompt`). `__post_init__` rejects every
invalid value with a `ConfigError` whose message names the flag as the user types it, the bad
value, and what is allowed. A value is never rewritten (the manifest records the config verbatim
and `rlk compare` diffs it); anything derived is a property.

The canonical-spec constants live in rlkernel/spec.py.

Does not: check the file system (model dir, prompts file: the CLI and the loaders do that), know
the model architecture (rlkernel/model/config.py), or import torch.

Run its tests: `.venv/bin/python -m pytest -q tests/test_cli_config.py`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import pathlib
import textwrap
from dataclasses import dataclass
from typing import Any

from rlkernel import jsontext
from rlkernel.spec import (ATTN_KV_BLOCK, CUDA_ATTN_KV_BLOCK, CUDA_BLOCK_K, CUDA_DKV_LEAF,
                           CUDA_TOKEN_LEAF, CUDA_VOCAB_CHUNK, MATMUL_ORDER, NUMERICS_VERSION,
                           ROUNDING_POINTS, TOKEN_LEAF, VIRTUAL_CP, VIRTUAL_DP, VIRTUAL_TP)


KL_ESTIMATORS = ("k1", "k2", "k3")
DTYPES = ("bf16", "fp32")
MODES = ("invariant", "native")
ON_NONFINITE = ("stop", "skip")
DEVICES = ("cpu", "cuda")
LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
LR_SCHEDULES = ("constant", "cosine", "linear")
TOKEN_REDUCTION = (
    "every token reduction (weight gradients, norm weights, embedding rows, attention dK/dV) sums "
    "the tokens of each leaf (token_leaf consecutive positions of one sample) in position "
    "order in fp32, adds the leaf partials exactly in fixed point and rounds once to fp32 "
    "(round-half-even) per mini-batch; so it depends on the samples of the mini-batch and their "
    "tokens only, not on --micro-batch-tokens, --dp, --tp, --cp, --sp, packing, padding or the "
    "order samples are added in")
SEED_LIMIT = 2**63
DEFAULT_GPU_MEMORY_UTILIZATION = 0.5
"""--gpu-memory-utilization when not given: the rollout engine's own default (RolloutEngine)."""
FP32_MAX = 3.4028234663852886e38
FP32_TINY = 1.1754943508222875e-38
"""The smallest normal fp32 number: a nonzero coefficient below it is 0 or subnormal in fp32."""
MIN_TEMPERATURE = 1e-6
"""Smallest --temperature: z = logits / T is fp32 in rollout and trainer, so T must keep it finite.
At T >= 1e-6 every |logit| < FP32_MAX · 1e-6 ≈ 3.4e32 (any working model's) stays finite; at
T = 1e-40 a logit of 1 is already inf, and the log-softmax NaN."""

SAME_EVIDENCE_SETTINGS = frozenset({
    "dp", "tp", "cp", "sp", "recompute", "rollout_tp", "rollout_cp", "micro_batch_tokens",
    "gpu_memory_utilization", "enforce_eager", "keep_rollout_state",
    "run_dir", "save_every", "resume", "allow_dirty", "require_updates", "tensorboard"})
"""RunConfig fields that never change a byte of the evidence (--mode invariant): where and how a
run executes (layout, memory, CUDA graphs) and its bookkeeping. `rlk compare` calls a difference
in any other field a difference of configuration, whose evidence is expected to differ."""
# Settings a resumed run may give again: where (on which ranks) and how it runs, not what it
# computes. Not --device: identity is promised within one backend only (DESIGN.md §1).
RESUME_MAY_CHANGE = frozenset({"dp", "tp", "cp", "sp", "recompute", "rollout_tp", "rollout_cp",
                               "micro_batch_tokens", "gpu_memory_utilization", "enforce_eager",
                               "keep_rollout_state",
                               "steps",
                               "save_every", "allow_dirty", "resume", "tensorboard"})
INPUT_PATHS = {"model": "model directory", "prompts": "prompts file", "reward": "reward file"}
"""The RunConfig fields that name inputs on disk (the reward: a "path/to/file.py:FUNC" spec's
file), and what each names, for messages (runner/inputs.py records where they were)."""
INPUT_FIELDS = frozenset(INPUT_PATHS)
"""Where a run's inputs are, not what they hold: a resume reads them at the manifest's absolute
`input_paths` while its config keeps them as typed, so checkpoints do not record these paths; the
inputs' content is checked by their SHA-256 in the manifest (runner/inputs.py)."""
SAMPLING_SETTINGS = ("temperature", "top_p")
"""The fields that choose which tokens are sampled from the same logits (named apart by compare)."""


class ConfigError(ValueError):
    """An invalid run setting; the message names the flag, the value and what is allowed."""


class SampleFitError(ConfigError):
    """One whole sample (--max-prompt-len + --max-response-len tokens) does not fit one
    microbatch (--micro-batch-tokens). `sample_tokens`: (max_prompt_len, max_response_len), for
    a caller that knows more than the config: the model's max_position_embeddings, which the
    sample may pass too (cli._new_config), or a resume, where only the budget may move
    (cli._resume_config)."""

    def __init__(self, message: str, sample_tokens: tuple[int, int]) -> None:
        super().__init__(message)
        self.sample_tokens = sample_tokens

    def __reduce__(self):   # pickled with both arguments (Exception's default passes args)
        return type(self), (str(self), self.sample_tokens)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Every setting of one RL run. Raises ConfigError on any invalid value (see module doc)."""

    # ---- model and data
    model: str | None = None
    """Hugging Face-layout model directory (config.json + *.safetensors + tokenizer). None: the
    embedded tiny Qwen3, randomly initialised from --model-seed."""
    model_seed: int = 0
    """Seed of the random initialisation of the embedded tiny model (ignored with --model, which
    the run warns about)."""
    prompts: str | None = None
    """Prompts file: JSONL (one object per line) or Parquet (needs pyarrow), told apart by its
    bytes (a .parquet or .jsonl/.json name must agree with them), read by --input-key/--label-key.
    None: the built-in verifiable arithmetic task."""

    # ---- rewards and prompt data (issue 13)
    reward: str | None = None
    """Reward function MODULE:FUNC or path/to/file.py:FUNC, called as FUNC(prompt, completion,
    label) -> a finite float in [-1e100, 1e100] on rank 0 (results broadcast); its source file's
    SHA-256 goes into the manifest. None: the built-in exact match."""
    input_key: str = "prompt"
    """Key (JSONL) or column (Parquet) of the prompt text in --prompts."""
    label_key: str = "label"
    """Key or column of the label in --prompts (with the default, "answer" is accepted too)."""
    apply_chat_template: bool = False
    """Render each prompt as one user message through the model's chat template
    (tokenizer_config.json chat_template or chat_template.jinja), with the generation prompt."""

    # ---- RL loop
    steps: int = 2
    """Number of RL steps (rollout, train, update, export, audit)."""
    seed: int = 0
    """Run seed: the built-in task's prompts and the counter-based sampling noise (a --prompts
    file is read in file order, never shuffled). 0 <= seed < 2**63."""
    n_prompts: int = 4
    """Prompts per step."""
    n_samples_per_prompt: int = 4
    """Samples per prompt (GRPO group size). 1 is allowed, but then every advantage is 0."""

    # ---- sampling
    temperature: float = 1.0
    """Sampling temperature T >= 1e-6; logits / T in fp32, identically in rollout and training
    (a smaller T overflows ordinary logits to inf)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]; 1 keeps the full vocabulary. Top-p only restricts which
    tokens can be drawn: the logprob recorded for a sampled token is its full-vocabulary
    log-softmax of logits / T (the untruncated policy), because that is the policy the trainer
    recomputes and differentiates (ratio, KL), byte for byte; the truncated renormalisation exists
    only in the sampler (as vLLM's default raw logprobs). Samples then come from the truncated
    distribution: a small off-policy bias that --top-p 1 avoids."""
    max_response_len: int = 64
    """Most generated tokens per sample."""
    max_prompt_len: int = 256
    """Most prompt tokens per sample; a longer prompt is an error of the prompt loader."""

    # ---- loss
    kl_coef: float = 0.0
    """Weight of the KL penalty against the initial policy (>= 0). 0 disables it: no reference
    policy is kept (neither its memory nor its forward pass per microbatch) and the evidence's
    kl is null (not measured), as TRL's GRPO does at beta 0."""
    kl_estimator: str = "k1"
    """KL estimator (Schulman 2020): k1 (log ratio), k2 (half squared log ratio) or k3
    (ratio - 1 - log ratio). k1 is the default: its per-token gradient is non-zero even at the
    reference policy, so --kl-coef acts from the first step; k2 and k3 start with zero gradient."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (>= 0; 0 disables it)."""
    clip_eps: float = 0.2
    """PPO ratio clipping: the ratio is clipped to [1 - eps, 1 + eps] (each side unless
    --clip-eps-low/--clip-eps-high). eps in (0, 1) while it sets the lower side (1 - eps must be
    > 0 to act); with --clip-eps-low it sets the upper side only: finite > 0. Acts only with
    several updates per rollout batch."""

    # ---- policy updates per rollout batch (issue 13): epochs, mini-batches, clip, loss, LR
    ppo_epochs: int = 1
    """Passes over each step's rollout samples. With one pass and one mini-batch the update is
    exactly on-policy (importance ratio 1), so the clip range cannot act."""
    mini_batches: int = 1
    """Optimizer updates per pass: the step's samples are cut, in sample order, into this many
    equal mini-batches (must divide --n-prompts x --n-samples-per-prompt). Old logprobs are
    always the rollout's."""
    clip_eps_low: float | None = None
    """Lower PPO clip range eps_low in [0, 1): the ratio is clipped below at 1 - eps_low (the
    ratio is > 0, so a bound <= 0 could never act; 0 clips at 1). None: --clip-eps."""
    clip_eps_high: float | None = None
    """Upper PPO clip range: the ratio is clipped above at 1 + eps_high (finite >= 0); DAPO's
    clip-higher (Yu et al. 2025, arXiv 2503.14476) uses 0.28 with eps_low 0.2. None: --clip-eps."""
    loss_agg: str = "token-mean"
    """How per-token losses form a mini-batch's loss, normalised once over the whole mini-batch:
    token-mean (sum / response tokens), seq-mean-token-sum (sum / samples) or
    seq-mean-token-mean (mean over samples of each sample's token mean)."""
    lr_warmup_steps: int = 0
    """Optimizer updates of linear LR warmup (update k <= W uses lr*k/W); < the run's updates."""
    lr_schedule: str = "constant"
    """LR after warmup, over the run's optimizer updates (--steps x --ppo-epochs x --mini-batches):
    constant, cosine (to 0; Loshchilov & Hutter, arXiv 1608.03983, no restarts) or linear (to 0)."""

    # ---- optimizer (AdamW on fp32 master weights)
    lr: float = 1e-5
    """AdamW learning rate (> 0)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (>= 0)."""
    adam_beta1: float = 0.9
    """AdamW first-moment decay, in [0, 1)."""
    adam_beta2: float = 0.999
    """AdamW second-moment decay, in [0, 1)."""
    adam_eps: float = 1e-8
    """AdamW epsilon (> 0)."""
    clip_grad: float = 1.0
    """Clip the exact global gradient norm to this value; 0 means no clipping (the norm is still
    computed and recorded)."""
    on_nonfinite: str = "stop"
    """A NaN/Inf in any gradient (never clipped away): stop (record the step, exit 1 naming the
    parameters) or skip (no update on any rank that step, recorded as update_skipped; go on)."""
    micro_batch_tokens: int = 4096
    """Most logical tokens one training forward/backward holds (a memory knob: the gradients are
    the same bits for any value). Must hold one whole sample: >= max_prompt_len +
    max_response_len."""

    # ---- numerics
    dtype: str = "bf16"
    """Model dtype: bf16 (bf16 weights; each linear's input and incoming gradient and attention's
    q, k, v rounded to bf16, fp32 accumulation, a bf16 KV cache) or fp32. Optimizer master
    weights are always fp32."""
    mode: str = "invariant"
    """invariant: the canonical kernels and collectives; native: stock torch ops (the baseline)."""

    # ---- topology
    dp: int = 1
    """Data-parallel replicas (world = dp x tp x cp): each trains on its share of every
    mini-batch and serves its share of the rollout; a divisor of virtual_dp (8) and of the samples
    of a mini-batch. Gradients, weights and evidence are the same bits for every such dp."""
    tp: int = 1
    """Trainer tensor-parallel degree; a divisor of virtual_tp (8)."""
    cp: int = 1
    """Trainer context-parallel degree; a divisor of virtual_cp (8)."""
    sp: bool = False
    """Sequence parallelism inside the TP group (needs --tp > 1)."""
    recompute: bool = False
    """Activation checkpointing: keep only each decoder layer's input and recompute the layer,
    with the same layout and kernels, in backward (same bytes, less memory, more time)."""
    rollout_tp: int = 1
    """Rollout-engine tensor-parallel degree; a divisor of virtual_tp (8)."""
    rollout_cp: int = 1
    """Rollout-engine context-parallel degree; a divisor of virtual_cp (8)."""

    # ---- rollout memory (issue 12)
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    """Fraction in (0, 1] of the CUDA memory free when each step's rollout starts that the
    rollout's paged KV pool may take (free as torch.cuda.mem_get_info reports it: the weights,
    the optimizer state and memory torch keeps cached already count as used, so unlike vLLM's
    flag of this name it is not a fraction of the total). The pool is freed when the rollout
    ends; the rest of the free memory is for the step's activations and logits. A memory knob
    only: the pool's size changes scheduling and preemption, never a sample's bytes. If one
    sample (prompt + --max-response-len) cannot fit, the run stops naming the bytes it needs and
    the bytes the pool has. --device cpu: no effect (the CPU pool holds every sample of the step
    at once; a value other than the default is warned about)."""

    enforce_eager: bool = False
    """Run every rollout step eagerly: no CUDA graphs for decode steps (by default the engine
    replays one graph per decode batch-size bucket on CUDA at --rollout-tp 1 and --rollout-cp 1;
    other layouts and --device cpu always run eagerly). The same bytes either way; graphs make
    decode several times faster where the engine is launch-bound (docs/BENCHMARKS.md)."""

    keep_rollout_state: bool = False
    """Keep the rollout engine's KV pool, buffers and decode CUDA graphs from one step to the
    next (by default they are made in every step's rollout and freed after it, so the trainer
    gets that memory back). Saves the pool allocation and the graph captures of every step after
    the first, at the price of the pool (as large as the first step's rollout can use, within
    --gpu-memory-utilization of the memory free then) staying allocated while the trainer runs:
    the trainer has that much less memory. The same bytes either way."""

    # ---- run bookkeeping
    run_dir: str | None = None
    """Run directory (must not exist, or be empty; not a symbolic link; no control characters:
    rlk run prints it as one line). None: runs/<UTC time>-<config hash>."""
    save_every: int = 0
    """Write a resumable checkpoint (fp32 masters, AdamW state, step cursor) into
    RUN_DIR/checkpoints after every N steps; 0 = never."""
    resume: str | None = None
    """Continue the run in this directory (or the RUN.tmp-<pid> a killed run left) from its last
    complete checkpoint. Its saved config is used; only the layout and memory flags (--dp/--tp/
    --cp/--sp/--recompute/--rollout-tp/--rollout-cp, --micro-batch-tokens,
    --gpu-memory-utilization, --enforce-eager, --keep-rollout-state), --steps (to extend), --save-every, --tensorboard
    and --allow-dirty may be given again (the on/off ones also as --no-sp, --no-recompute,
    --no-enforce-eager, --no-keep-rollout-state, --no-tensorboard, --no-allow-dirty); its inputs (model files,
    tokenizer, prompts) must hash as recorded."""
    allow_dirty: bool = False
    """Run even if the rl-kernel checkout has uncommitted changes (recorded in the manifest)."""
    require_updates: bool = False
    """Fail the run if an applied update leaves the weights unchanged (a step skipped by
    --on-nonfinite skip is recorded as update_skipped, not failed)."""
    tensorboard: bool = False
    """Also write the per-step metrics as TensorBoard events into RUN_DIR/tensorboard (needs the
    tensorboard package: pip install 'rl-kernel[tensorboard]')."""
    device: str = "cpu"
    """cpu or cuda. Bitwise identity is promised within one backend, not across backends."""

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived values (never stored in a field)
    @property
    def grad_clipping(self) -> bool:
        """True when the gradient norm is clipped (clip_grad > 0)."""
        return self.clip_grad > 0

    @property
    def samples_per_step(self) -> int:
        """Rollout samples per step: n_prompts * n_samples_per_prompt."""
        return self.n_prompts * self.n_samples_per_prompt

    @property
    def clip_low(self) -> float:
        """Lower clip range in use: --clip-eps-low, else --clip-eps."""
        return self.clip_eps if self.clip_eps_low is None else self.clip_eps_low

    @property
    def clip_high(self) -> float:
        """Upper clip range in use: --clip-eps-high, else --clip-eps."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per RL step: ppo_epochs * mini_batches."""
        return self.ppo_epochs * self.mini_batches

    @property
    def total_updates(self) -> int:
        """Optimizer updates of the whole run (the LR schedule's horizon)."""
        return self.steps * self.updates_per_step

    @property
    def never_learns(self) -> bool:
        """One sample per prompt (every GRPO advantage 0) and no KL or entropy term: every
        gradient is 0 whatever the rewards, known before the run starts."""
        return self.n_samples_per_prompt == 1 and not self.kl_coef and not self.entropy_coef

    @property
    def train_world_size(self) -> int:
        """Trainer ranks: dp * tp * cp."""
        return self.dp * self.tp * self.cp

    @property
    def mini_batch_size(self) -> int:
        """Samples per optimizer update: samples_per_step / mini_batches."""
        return self.samples_per_step // self.mini_batches

    @property
    def rollout_world_size(self) -> int:
        """Rollout ranks: rollout_tp * rollout_cp."""
        return self.rollout_tp * self.rollout_cp

    def to_dict(self) -> dict[str, Any]:
        """Every field, verbatim, by field name (JSON-serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        """Rebuild from `to_dict()` output (e.g. a manifest's "config").

        Raises ConfigError on an unknown key or an invalid value; missing keys take the defaults.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**d)

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the canonical JSON of `to_dict()`; names default run directories."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def resume_settings(self) -> dict[str, Any]:
        """The settings a run's checkpoints are tied to (recorded in each, compared on resume):
        every field but those a resume may change (RESUME_MAY_CHANGE), run_dir (a copied
        run resumes under its new name) and the input paths (INPUT_FIELDS); --steps too under
        a decaying LR schedule, whose horizon sets every step's LR (a resume may not extend
        such a run)."""
        free = RESUME_MAY_CHANGE | {"run_dir"} | INPUT_FIELDS
        if reads_steps(self.lr_schedule):
            free = free - {"steps"}
        return {k: v for k, v in self.to_dict().items() if k not in free}

    def resume_differences(self, recorded: dict[str, Any]) -> list[str]:
        """The fields of resume_settings() whose value in `recorded` (a checkpoint's) differs
        from this config's. A field `recorded` lacks (one added to RunConfig since) counts at
        its default, as a manifest's does (from_dict)."""
        now = self.resume_settings()
        return [k for k in now if recorded.get(k, SETTING_DEFAULTS[k]) != now[k]] + \
            sorted(k for k in recorded if k not in now and k not in INPUT_FIELDS)

    def canonical_spec(self) -> dict[str, Any]:
        """The numerical contract of this run (DESIGN.md §1); recorded in every manifest."""
        spec = {
            "virtual_tp": VIRTUAL_TP,
            "virtual_cp": VIRTUAL_CP,
            "virtual_dp": VIRTUAL_DP,
            "backend": self.device,
            "matmul": MATMUL_ORDER,
            "attention_kv_block": ATTN_KV_BLOCK,
            "vocab_shards": VIRTUAL_TP,
            "token_leaf": TOKEN_LEAF,
            "token_reduction": TOKEN_REDUCTION,
            "rounding_points": ROUNDING_POINTS[self.dtype],
            "numerics_version": NUMERICS_VERSION,
        }
        if self.device == "cuda":
            spec.update(matmul=f"sequential-K fp32 accumulate, BLOCK_K {CUDA_BLOCK_K}",
                        attention_kv_block=CUDA_ATTN_KV_BLOCK, vocab_chunk=CUDA_VOCAB_CHUNK,
                        token_leaf={"linear_weights": CUDA_TOKEN_LEAF,
                                    "attention_dkv": CUDA_DKV_LEAF,
                                    "norm_weights": TOKEN_LEAF, "embedding_rows": TOKEN_LEAF})
        return spec


SETTING_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(RunConfig)}
"""Each RunConfig field's default: the value of a field a manifest or checkpoint lacks (one
added to RunConfig since it was written), wherever recorded settings are read."""


def reads_steps(lr_schedule: Any) -> bool:
    """Whether the LR schedule `lr_schedule` (a manifest's value) reads --steps: every one but
    "constant" takes the run's length as its horizon, which sets every step's LR. Where it
    does not, a resume may extend the run (RunConfig.resume_settings) and two runs that differ
    only in --steps share their common steps' bytes (runner/compare.py)."""
    return lr_schedule != "constant"


def flag_name(field: str) -> str:
    """The command-line flag of a RunConfig field: `top_p` -> `--top-p`."""
    return "--" + field.replace("_", "-")


def model_flag_error(model: str, msg: str) -> str:
    """The one wording of every error about `--model DIR`: `--model 'DIR': what`, where a
    loader's message that starts with the directory (`DIR/config.json: ...`, `DIR: no
    *.safetensors file`) names its file relative to DIR (`config.json: ...`); any other
    message follows the prefix whole."""
    root = str(pathlib.PurePath(model))
    if msg.startswith(root + "/"):
        msg = msg[len(root) + 1:]
    elif msg.startswith(root + ":"):
        msg = msg[len(root) + 1:].lstrip()
    return f"--model {model!r}: {msg}"


@functools.cache
def field_docs() -> dict[str, str]:
    """Field name -> the docstring written under it in RunConfig (for `rlk run --help`).

    Read from this file's source; returns {} when the source is not available (e.g. a .pyc-only
    install), so help text degrades but nothing breaks.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(RunConfig)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


# ---------------------------------------------------------------------------------------------
# validation


def _show(v: Any) -> str:
    """A value as the user would recognise it in a message: 1.5, nan, -inf, 'k4', True."""
    return repr(v)


def _fail(field: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{flag_name(field)} {_show(value)}: {allowed}")


def _check_int(c: RunConfig, field: str, lo: int, hi: int | None = None) -> None:
    v = getattr(c, field)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(field, v, f"must be an integer, not {type(v).__name__}")
    if v < lo or (hi is not None and v >= hi):
        bound = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi})"
        raise _fail(field, v, f"must be {bound}")


_FP32_TINY_WHY = ("the smallest normal fp32 number (the losses, the optimizer and the sampler "
                  "compute in fp32, where a smaller value is 0 or subnormal)")


def _check_float(c: RunConfig, field: str, rule: str, why: str = "",
                 tiny_why: str = _FP32_TINY_WHY) -> None:
    """rule: 'pos' (> 0), 'nonneg' (>= 0), 'unit_open0' ((0, 1]), 'unit_open1' ([0, 1)),
    'unit_open' ((0, 1)), 'temperature' (>= MIN_TEMPERATURE); `why`, when given, follows the
    range in the message. The unbounded rules also stop at FP32_MAX, a limit with its own
    message; their other messages (NaN, Inf, below the range) name that whole interval too, so
    every refusal says the real allowed range. A nonzero value below FP32_TINY is refused
    with `tiny_why` saying why (the fp32 compute, unless the field says otherwise)."""
    v = getattr(c, field)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _fail(field, v, f"must be a number, not {type(v).__name__}")
    # (what is allowed, the test, the whole interval of an unbounded rule, closed by FP32_MAX)
    top = f"{FP32_MAX!r}]"
    allowed = {
        "pos": ("a finite number > 0", lambda x: x > 0, f"(0, {top}"),
        "nonneg": ("a finite number >= 0", lambda x: x >= 0, f"[0, {top}"),
        "unit_open0": ("a number in (0, 1]", lambda x: 0 < x <= 1, None),
        "unit_open1": ("a number in [0, 1)", lambda x: 0 <= x < 1, None),
        "unit_open": ("a number in (0, 1)", lambda x: 0 < x < 1, None),
        "temperature": (f"a finite number >= {MIN_TEMPERATURE:g} (logits / T is computed in fp32, "
                        f"largest {FP32_MAX:.4g}; a smaller T makes ordinary logits overflow to "
                        "inf)", lambda x: x >= MIN_TEMPERATURE, f"[{MIN_TEMPERATURE:g}, {top}"),
    }[rule]
    interval = f"; allowed: {allowed[2]}" if allowed[2] is not None else ""
    try:
        finite = math.isfinite(v)
    except OverflowError:  # an int beyond float range (e.g. from a manifest via from_dict)
        finite = False
    if not (finite and allowed[1](v)):
        raise _fail(field, v, f"must be {allowed[0]}{why}{interval}")
    if 0 < abs(v) < FP32_TINY:   # would silently be 0 (or lose its precision) in fp32
        zero = "0 or " if allowed[1](0.0) else ""
        raise _fail(field, v, f"must be {zero}at least {FP32_TINY!r}, {tiny_why}")
    if abs(v) > FP32_MAX:   # the losses, the optimizer and the sampler compute in fp32
        # FP32_MAX in full (repr): rounded to fewer digits it would exceed itself, and a value
        # typed as shown would be refused.
        raise _fail(field, v, f"must be at most {FP32_MAX!r}, the largest fp32 number (the "
                              "losses, the optimizer and the sampler compute in fp32)"
                              f"{interval}")


def _check_choice(c: RunConfig, field: str, choices: tuple[str, ...]) -> None:
    v = getattr(c, field)
    if not isinstance(v, str) or v not in choices:
        raise _fail(field, v, f"must be one of {', '.join(choices)}")


def path_problem(path: str, optional: bool = False) -> str | None:
    """Why `path` is no path any command takes, or None: '' (the file system reads it as the
    current directory), only whitespace, or a '/'-separated name of only whitespace ('r/ ') —
    legal file names, but quoting slips, not choices. `optional`: the argument may be left out
    instead (said in the first two reasons, as rlk run's words them)."""
    tail = " (or left out)" if optional else ""
    if not path:
        return "must be a non-empty path" + tail
    if not path.strip():
        return "must be a path, not only whitespace" + tail
    part = next((p for p in path.split("/") if p and not p.strip()), None)
    if part is not None:
        return f"has a name of only whitespace ({part!r}): a quoting slip, not a choice"
    return None


def _check_path(c: RunConfig, field: str) -> None:
    v = getattr(c, field)
    if v is None:
        return
    if not isinstance(v, str):
        raise _fail(field, v, "must be a non-empty path (or left out)")
    if (why := path_problem(v, optional=True)) is not None:
        raise _fail(field, v, why)
    try:
        v.encode("utf-8")    # bytes the filesystem gave that are not UTF-8: surrogates
    except UnicodeEncodeError:
        raise _fail(field, v, "must be a UTF-8 path (the manifest, the exported model and "
                              "the reports record and reopen it)") from None


def _check_bool(c: RunConfig, field: str) -> None:
    v = getattr(c, field)
    if not isinstance(v, bool):
        raise _fail(field, v, f"must be a bool, not {type(v).__name__}")


def _validate(c: RunConfig) -> None:
    for f in ("model", "prompts", "run_dir", "resume"):
        _check_path(c, f)
    _check_int(c, "save_every", 0)
    for f in ("sp", "recompute", "allow_dirty", "require_updates", "tensorboard", "enforce_eager",
              "keep_rollout_state"):
        _check_bool(c, f)
    _check_int(c, "model_seed", 0, SEED_LIMIT)
    _check_int(c, "seed", 0, SEED_LIMIT)
    for f in ("steps", "n_prompts", "n_samples_per_prompt", "max_response_len", "max_prompt_len",
              "micro_batch_tokens"):
        _check_int(c, f, 1)
    for f in ("lr", "adam_eps"):
        _check_float(c, f, "pos")
    if c.clip_eps_low is None:   # --clip-eps is then the lower clip range too: below 1
        _check_float(c, "clip_eps", "unit_open", _CLIP_EPS_AS_LOWER)
    else:                        # the upper range only
        _check_float(c, "clip_eps", "pos")
    _check_float(c, "temperature", "temperature")
    for f in ("kl_coef", "entropy_coef", "weight_decay", "clip_grad"):
        _check_float(c, f, "nonneg")
    _check_float(c, "top_p", "unit_open0")
    _check_float(c, "gpu_memory_utilization", "unit_open0",
                 tiny_why="the smallest normal fp32 number, below which every float flag "
                          "is refused (this one is a fraction of the free GPU memory, in "
                          "(0, 1])")
    _check_float(c, "adam_beta1", "unit_open1")
    _check_float(c, "adam_beta2", "unit_open1")
    _validate_update_scale(c)
    _check_choice(c, "kl_estimator", KL_ESTIMATORS)
    _check_choice(c, "dtype", DTYPES)
    _check_choice(c, "mode", MODES)
    _check_choice(c, "on_nonfinite", ON_NONFINITE)
    _check_choice(c, "device", DEVICES)
    _validate_data(c)

    for f, virtual in (("tp", VIRTUAL_TP), ("rollout_tp", VIRTUAL_TP),
                       ("cp", VIRTUAL_CP), ("rollout_cp", VIRTUAL_CP)):
        v = getattr(c, f)
        if isinstance(v, int) and not isinstance(v, bool) and (v < 1 or virtual % v):
            divisors = ", ".join(str(d) for d in range(1, virtual + 1) if virtual % d == 0)
            kind = "virtual_tp" if "tp" in f else "virtual_cp"
            raise _fail(f, v, f"must divide {kind}={virtual}; allowed: {divisors}")
        _check_int(c, f, 1)
    if c.sp and c.tp == 1:
        raise ConfigError("--sp (with --tp 1): sequence parallelism splits sequences across the "
                          "TP group, so it needs --tp > 1; allowed: --sp with --tp 2, 4 or 8, "
                          "or leave out --sp")

    _validate_sample_fits(c)
    _validate_updates(c)
    _validate_dp(c)


def _validate_update_scale(c: RunConfig) -> None:
    """AdamW's fp32 update must stay meaningful: decoupled weight decay multiplies every weight
    by 1 - lr·weight_decay (at lr·weight_decay >= 1 it zeroes or flips the weights), and the
    first step divides lr by 1 - adam_beta1 (the bias correction; past the fp32 range it is
    inf). Loshchilov & Hutter 2019, Algorithm 2."""
    if c.lr * c.weight_decay >= 1.0:
        raise _fail("weight_decay", c.weight_decay,
                    f"must be below 1 / --lr = {1.0 / c.lr!r} (decoupled decay multiplies the "
                    f"weights by 1 - lr·weight_decay = {1.0 - c.lr * c.weight_decay!r}, which "
                    "would zero or flip them)")
    if c.lr / (1.0 - c.adam_beta1) > FP32_MAX:
        raise _fail("lr", c.lr, f"must keep the first update's step lr / (1 - adam_beta1) = "
                                f"{c.lr / (1.0 - c.adam_beta1)!r} (--adam-beta1 "
                                f"{c.adam_beta1!r}) within fp32, at most {FP32_MAX!r}")


def _validate_sample_fits(c: RunConfig) -> None:
    """One whole sample (--max-prompt-len + --max-response-len tokens) must fit in one
    microbatch (--micro-batch-tokens). The message leads with the flag the user most likely
    moved: --micro-batch-tokens when it is off its default (set too small), else the length(s)
    off theirs (--max-response-len 100000 must not read as an error of a flag never given).
    Raises SampleFitError."""
    need = c.max_prompt_len + c.max_response_len
    if c.micro_batch_tokens >= need:
        return
    raise SampleFitError(str(_sample_fit_error(c, need)), (c.max_prompt_len, c.max_response_len))


def _sample_fit_error(c: RunConfig, need: int) -> ConfigError:
    fits = "one whole sample must fit in one microbatch"
    if c.micro_batch_tokens != _default("micro_batch_tokens"):
        return _fail("micro_batch_tokens", c.micro_batch_tokens,
                     f"must be >= --max-prompt-len + --max-response-len = {need} ({fits})")
    moved = [f for f in ("max_response_len", "max_prompt_len") if getattr(c, f) != _default(f)]
    if len(moved) != 1:
        return ConfigError(f"--max-prompt-len {c.max_prompt_len} + --max-response-len "
                           f"{c.max_response_len} = {need}: must be at most --micro-batch-tokens "
                           f"{c.micro_batch_tokens}, its default ({fits})"
                           f"{_raise_budget_hint(need)}")
    # One length moved, the other at its default: the defaults fit the default budget, so the
    # moved one's limit is at least 1.
    field, = moved
    other = "max_prompt_len" if field == "max_response_len" else "max_response_len"
    return _fail(field, getattr(c, field),
                 f"must be at most {c.micro_batch_tokens - getattr(c, other)} (--micro-batch-tokens "
                 f"{c.micro_batch_tokens}, its default, minus {flag_name(other)} "
                 f"{getattr(c, other)}: {fits}){_raise_budget_hint(need)}")


def _raise_budget_hint(need: int) -> str:
    """The other way out, offered only where --micro-batch-tokens can go (SIZE_LIMITS)."""
    if need > SIZE_LIMITS["micro_batch_tokens"]:
        return ""
    return f"; or raise --micro-batch-tokens to {need} or more"


def _default(field: str) -> Any:
    return next(f.default for f in dataclasses.fields(RunConfig) if f.name == field)


SIZE_LIMITS = {"steps": 10**6, "n_prompts": 2**16, "n_samples_per_prompt": 2**12,
               "ppo_epochs": 2**10, "micro_batch_tokens": 2**31}
"""Largest accepted value of each count flag: far beyond any run of this code, small enough that
a mistyped value is refused at once instead of exhausting memory while prompts are prepared."""
MAX_RUN_PROMPTS = 2**20
"""Most prompts in one run (--steps x --n-prompts): every one is generated and encoded (and
checked) before the first step, about 10-20 s per million on one core."""


def _validate_sizes(c: RunConfig) -> None:
    """Upper bounds of the count flags (SIZE_LIMITS, MAX_RUN_PROMPTS)."""
    for f, hi in SIZE_LIMITS.items():
        if getattr(c, f) > hi:
            raise _fail(f, getattr(c, f), f"must be at most {hi:,}")
    if c.steps * c.n_prompts > MAX_RUN_PROMPTS:
        raise _fail("steps", c.steps, f"with --n-prompts {c.n_prompts} makes "
                                      f"{c.steps * c.n_prompts:,} prompts; at most "
                                      f"{MAX_RUN_PROMPTS:,} prompts fit one run (every prompt is "
                                      "prepared before step 1): fewer steps or prompts per step")


def _validate_updates(c: RunConfig) -> None:
    """--ppo-epochs, --mini-batches, --clip-eps-low/high, --loss-agg and the LR schedule."""
    _check_int(c, "ppo_epochs", 1)
    _check_int(c, "mini_batches", 1)
    _validate_sizes(c)
    n = c.samples_per_step
    if n % c.mini_batches:
        # List the divisors only for sizes a person types; never loop over a huge n.
        divisors = (", ".join(str(d) for d in range(1, n + 1) if n % d == 0) if n <= 4096
                    else f"a divisor of {n}")
        raise _fail("mini_batches", c.mini_batches,
                    f"must divide the samples per step (--n-prompts {c.n_prompts} x "
                    f"--n-samples-per-prompt {c.n_samples_per_prompt} = {n}); allowed: {divisors}")
    _validate_clip(c)
    _check_choice(c, "loss_agg", LOSS_AGGS)
    _check_choice(c, "lr_schedule", LR_SCHEDULES)
    _check_int(c, "lr_warmup_steps", 0)
    if c.lr_warmup_steps and c.lr_warmup_steps >= c.total_updates:
        raise _fail("lr_warmup_steps", c.lr_warmup_steps,
                    f"must be < the run's optimizer updates (--steps {c.steps} x --ppo-epochs "
                    f"{c.ppo_epochs} x --mini-batches {c.mini_batches} = {c.total_updates}), "
                    "or the learning rate never reaches --lr")
    if c.require_updates and c.never_learns:
        # runner.watch warns of this run without --require-updates; with it, its first step
        # would fail, after the work of a rollout and an update
        raise ConfigError("--require-updates with --n-samples-per-prompt 1 and --kl-coef and "
                          "--entropy-coef 0: every GRPO advantage is 0 and no other term "
                          "exists, so every gradient is 0 and the first step must fail; give "
                          "--n-samples-per-prompt >= 2, a --kl-coef or --entropy-coef > 0, or "
                          "leave out --require-updates")


_LOWER_CLIP = "the ratio, always > 0, is clipped below at 1 - eps: a bound <= 0 never acts"
_CLIP_EPS_AS_LOWER = (f" while it is also the lower clip range ({_LOWER_CLIP}); allowed: (0, 1), "
                      "or give --clip-eps-low for the lower side")


def _validate_clip(c: RunConfig) -> None:
    """--clip-eps-low, --clip-eps-high (--clip-eps is checked in _validate: in (0, 1) while it
    is the lower range too, else > 0): the ratio is clipped to [1 - low, 1 + high], so the lower
    eps in use must be < 1; the upper one only finite >= 0."""
    if c.clip_eps_low is not None:
        _check_float(c, "clip_eps_low", "unit_open1", f" ({_LOWER_CLIP})")
    if c.clip_eps_high is not None:
        _check_float(c, "clip_eps_high", "nonneg")


def _divisors_text(n: int) -> str:
    """The divisors of n for a message, listed only for sizes a person types."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) if n <= 4096 \
        else f"a divisor of {n}"


def _validate_dp(c: RunConfig) -> None:
    """--dp: a divisor of virtual_dp and of the samples of every mini-batch."""
    _check_int(c, "dp", 1)
    if VIRTUAL_DP % c.dp:
        raise _fail("dp", c.dp, f"must divide virtual_dp={VIRTUAL_DP}; allowed: "
                                f"{_divisors_text(VIRTUAL_DP)}")
    n, m = c.samples_per_step, c.mini_batch_size
    ok = [d for d in range(1, VIRTUAL_DP + 1) if VIRTUAL_DP % d == 0 and m % d == 0]
    if m % c.dp:
        what = (f"the samples per step (--n-prompts {c.n_prompts} x --n-samples-per-prompt "
                f"{c.n_samples_per_prompt} = {n})" if c.mini_batches == 1 else
                f"the samples per mini-batch ({n} samples per step / --mini-batches "
                f"{c.mini_batches} = {m})")
        raise _fail("dp", c.dp, f"must divide {what}, so every DP replica trains on as many "
                                f"samples; allowed: {', '.join(map(str, ok))}")


# Built-in defaults of --input-key/--label-key: a changed key needs a --prompts file to act on.
_DEFAULT_KEYS = {"input_key": "prompt", "label_key": "label"}


def _validate_data(c: RunConfig) -> None:
    """--reward syntax (not whether it imports: the CLI loads it), --input-key/--label-key,
    --apply-chat-template."""
    _check_bool(c, "apply_chat_template")
    if c.reward is not None:
        if not isinstance(c.reward, str) or ":" not in c.reward:
            raise _fail("reward", c.reward, "must be MODULE:FUNC or path/to/file.py:FUNC")
        where, func = c.reward.rsplit(":", 1)
        if not where or not all(part.isidentifier() for part in func.split(".")):
            raise _fail("reward", c.reward, "must be MODULE:FUNC or path/to/file.py:FUNC, FUNC a "
                                            "Python name (dotted for a class attribute)")
    for f in ("input_key", "label_key"):
        v = getattr(c, f)
        if not isinstance(v, str) or not v:
            raise _fail(f, v, "must be a non-empty key name")
        if jsontext.unprintable(v):
            # messages quote the key as typed: an escape sequence would reach the terminal
            raise _fail(f, v, "must be a key name without control or format characters")
        if c.prompts is None and v != _DEFAULT_KEYS[f]:
            raise _fail(f, v, "only applies to a --prompts file; give --prompts FILE or leave "
                              f"out {flag_name(f)}")
    if c.input_key == c.label_key:
        raise _fail("label_key", c.label_key, f"must differ from --input-key {c.input_key!r}")
