"""Qwen3 dense model config: the fields of Hugging Face's `config.json` that define the math.

Presets are functions returning a config (STYLE.md §12), not flags. `to_hf_dict` / `from_hf_dict`
round-trip the Hugging Face layout so a checkpoint written here loads in transformers and back.
Does not: hold parallel or run settings (see rlkernel/config.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from rlkernel.config import ConfigError
from rlkernel.spec import VIRTUAL_CP, VIRTUAL_TP  # noqa: F401  (re-exported)


HF_DEFAULTS: dict[str, Any] = {"head_dim": 128, "num_key_value_heads": 32,
                               "max_position_embeddings": 32768, "rope_theta": 10_000.0}
"""What transformers' Qwen3Config takes for these keys when a config.json does not set them
(tests/test_checkpoint.py compares them with transformers'): `from_hf_dict` reads a file as the
reference reads it. (It took hidden/heads, the query heads, 40960 and 1e6 — the Qwen3
checkpoints' values —, so a file without rope_theta gave other logits than transformers'.)"""


@dataclass(frozen=True, kw_only=True)
class Qwen3Config:
    """Architecture of a dense Qwen3 causal LM (Qwen3 technical report, arXiv 2505.09388 §2)."""

    vocab_size: int
    """Rows of the embedding / LM head. Must be a multiple of VIRTUAL_TP (vocab shards)."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """SwiGLU inner width. Multiple of VIRTUAL_TP (row-parallel down_proj K shards)."""
    num_hidden_layers: int
    num_attention_heads: int
    """Query heads. Multiple of VIRTUAL_TP so every virtual TP shard owns whole heads."""
    num_key_value_heads: int
    """KV heads (GQA). Divides num_attention_heads. Any TP must divide it (KV heads split) or be a
    multiple of it (each KV head replicated whole over TP / kv_heads ranks)."""
    head_dim: int
    """Per-head width (Qwen3 decouples it from hidden_size / heads). Even (RoPE rotates pairs);
    kv_heads·head_dim need not be a multiple of VIRTUAL_TP (the dX virtual shards of k/v are cut
    by floor bounds, kernels/matmul.virtual_shard_rows). --device cuda: a power of two in [16, 256]."""
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        validate_model_config(self)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` dict that transformers' Qwen3Config reads."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "bfloat16",
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> "Qwen3Config":
        """Build from a Hugging Face `config.json` dict.

        Raises ValueError naming `source` and the field when the dict is not a dense Qwen3 config,
        and nothing else (whatever JSON the file holds). Types are checked, never coerced: sizes
        and token ids must be JSON integers, rope_theta / rms_norm_eps / initializer_range
        numbers, tie_word_embeddings a boolean (coercing would read "false" as True, 2.5 layers as
        2, and an Infinity size would raise OverflowError).
        """
        if not isinstance(d, dict):
            raise ValueError(f"{source}: top level is a JSON {type(d).__name__}; expected an object")
        if d.get("model_type") not in ("qwen3", None):
            raise ValueError(f"{source}: model_type {d.get('model_type')!r} is not supported; "
                             "only dense 'qwen3' is")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {d['hidden_act']!r} is not supported; only 'silu'")
        if d.get("attention_bias") not in (None, False):
            raise ValueError(f"{source}: attention_bias={d['attention_bias']!r} is not supported; "
                             "only false (Qwen3 has none)")
        rope_theta, theta_key = d.get("rope_theta"), "rope_theta"
        if rope_theta is None:   # transformers 5 keeps it under rope_parameters
            theta_key = "rope_parameters.rope_theta"
            rp = d.get("rope_parameters") or {}
            if not isinstance(rp, dict):
                raise ValueError(f"{source}: rope_parameters must be an object, got {rp!r}")
            rope_theta = rp.get("rope_theta", HF_DEFAULTS["rope_theta"])
        scaling = d.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ValueError(f"{source}: rope_scaling must be an object or null, got {scaling!r}")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"{source}: rope_scaling {scaling!r} is not supported; only default RoPE")
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"{source}: missing required field(s) {missing}")

        def integer(key: str, default: Any = None) -> Any:
            v = d.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{source}: {key}={v!r} must be an integer")
            return v

        def number(key: str, v: Any) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{source}: {key}={v!r} must be a number")
            try:
                return float(v)
            except OverflowError:  # an int too large for a float
                raise ValueError(f"{source}: {key}={v!r} must be a finite number") from None

        def token_id(key: str) -> int | None:
            v = d.get(key)
            if isinstance(v, list):  # HF allows several EOS ids; the first one is used
                v = v[0] if v else None
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{source}: {key}={d.get(key)!r} must be a token id (an integer "
                                 ">= 0), a list of them, or null")
            return v

        heads = integer("num_attention_heads")
        hidden = integer("hidden_size")
        if heads <= 0 or hidden <= 0:
            bad = "num_attention_heads" if heads <= 0 else "hidden_size"
            raise ValueError(f"{source}: {bad}={d[bad]!r} must be a positive integer")
        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ValueError(f"{source}: tie_word_embeddings={tie!r} must be true or false")
        try:
            return cls(
                vocab_size=integer("vocab_size"),
                hidden_size=hidden,
                intermediate_size=integer("intermediate_size"),
                num_hidden_layers=integer("num_hidden_layers"),
                num_attention_heads=heads,
                # null: as many as the query heads (transformers' __post_init__)
                num_key_value_heads=heads if d.get("num_key_value_heads", 0) is None
                else integer("num_key_value_heads", HF_DEFAULTS["num_key_value_heads"]),
                head_dim=integer("head_dim", HF_DEFAULTS["head_dim"]),
                rope_theta=number(theta_key, rope_theta),
                rms_norm_eps=number("rms_norm_eps", d.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=integer("max_position_embeddings",
                                                HF_DEFAULTS["max_position_embeddings"]),
                tie_word_embeddings=tie,
                initializer_range=number("initializer_range", d.get("initializer_range", 0.02)),
                bos_token_id=token_id("bos_token_id"),
                eos_token_id=token_id("eos_token_id"),
            )
        except ValueError as e:   # a ConfigError (validate_model_config) stays one
            msg = str(e)
            msg = msg if msg.startswith(f"{source}:") else f"{source}: {msg}"
            taken = defaulted_shape_keys(d)
            if taken:   # a value the file does not hold would read as the file's
                msg += f" (not set in {source}, so transformers' default: {assignments(taken)})"
            raise type(e)(msg) from None

    def replace(self, **changes: Any) -> "Qwen3Config":
        return dataclasses.replace(self, **changes)


def defaulted_shape_keys(d: dict[str, Any]) -> dict[str, Any]:
    """{key: transformers' default} of each HF_DEFAULTS key that changes a weight's shape and
    that the config dict `d` does not set: for messages, where a value the file does not hold
    would otherwise read as the file's."""
    return {k: v for k, v in HF_DEFAULTS.items()
            if k not in d and k != "rope_theta"}   # rope_theta changes no shape


def assignments(values: dict[str, Any]) -> str:
    """values as "key=value, ..." (repr values), for messages."""
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def validate_model_config(c: Qwen3Config) -> None:
    """Reject configs the canonical contract cannot shard. Raises ConfigError (a ValueError) whose
    message names the field, its value and what is allowed."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
        v = getattr(c, name)
        if not isinstance(v, int) or v <= 0:
            raise ConfigError(f"model config: {name}={v!r} must be a positive integer")
    if c.head_dim % 2:
        raise ConfigError(f"model config: head_dim={c.head_dim} must be even (RoPE rotates pairs)")
    if c.num_attention_heads % c.num_key_value_heads:
        raise ConfigError(f"model config: num_key_value_heads={c.num_key_value_heads} must divide "
                          f"num_attention_heads={c.num_attention_heads}")
    for name in ("vocab_size", "intermediate_size", "num_attention_heads"):
        v = getattr(c, name)
        if v % VIRTUAL_TP:
            raise ConfigError(f"model config: {name}={v} must be a multiple of virtual_tp="
                              f"{VIRTUAL_TP} (each virtual TP shard owns an equal whole part)")
    if not (math.isfinite(c.rope_theta) and c.rope_theta > 0):
        raise ConfigError(f"model config: rope_theta={c.rope_theta} must be finite and > 0")
    if not (math.isfinite(c.rms_norm_eps) and c.rms_norm_eps > 0):
        raise ConfigError(f"model config: rms_norm_eps={c.rms_norm_eps} must be finite and > 0")


def tiny() -> Qwen3Config:
    """Test-sized Qwen3: byte vocabulary (264), 8 query / 4 KV heads so TP=8 is possible."""
    return Qwen3Config(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                       max_position_embeddings=4096, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=256)


def qwen3_0_6b() -> Qwen3Config:
    """Qwen/Qwen3-0.6B shapes (hub config.json)."""
    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=True, bos_token_id=151643,
                       eos_token_id=151645)


def qwen3_1_7b() -> Qwen3Config:
    """Qwen/Qwen3-1.7B shapes (hub config.json)."""
    return Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=True, bos_token_id=151643,
                       eos_token_id=151645)


def qwen3_8b() -> Qwen3Config:
    """Qwen/Qwen3-8B shapes (hub config.json)."""
    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=False, bos_token_id=151643,
                       eos_token_id=151645)


PRESETS = {"tiny": tiny, "qwen3-0.6b": qwen3_0_6b, "qwen3-1.7b": qwen3_1_7b, "qwen3-8b": qwen3_8b}


def preset(name: str) -> Qwen3Config:
    """Config of a named preset. Raises ValueError listing the allowed names."""
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r} is not known; allowed: {', '.join(PRESETS)}")
    return PRESETS[name]()


def param_shapes(c: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every logical parameter, by its Hugging Face name, in canonical (load/export/hash) order."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
        shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes
