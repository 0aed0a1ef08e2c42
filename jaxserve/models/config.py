"""The architecture-independent description of a Llama-family decoder.

Both checkpoint formats end here: a Hugging Face ``config.json`` and a GGUF file's
metadata are each turned into one frozen :class:`ModelConfig`. Everything else (the Flax
model, the weight loader, the KV page layout) reads only this object.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxserve.errors import ModelLoadError

# model_type in config.json -> what differs from plain Llama.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (Hugging Face's ``rope_parameters``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and flavour of a Llama-family decoder-only transformer."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: biases on q/k/v (never on o).
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope.
    # Per layer: attend to at most this many most recent positions (0 = unlimited).
    sliding_windows: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (0,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ModelLoadError("one sliding window entry per layer is required")


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older files have `rope_theta` and
    # `rope_scaling` at the top level.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError("partial_rotary_factor != 1 is not supported")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _sliding_windows_from_hf(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    window = cfg.get("sliding_window")
    if model_type == "mistral":
        return (int(window or 0),) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types:
        return tuple(int(window or 0) if t == "sliding_attention" else 0 for t in layer_types)
    if cfg.get("use_sliding_window") and window:
        # Qwen2/3 without layer_types: layers from max_window_layers on slide.
        first = int(cfg.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else 0 for i in range(num_layers))
    return (0,) * num_layers


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face ``config.json`` dictionary."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        arch = cfg.get("architectures") or [model_type]
        raise ModelLoadError(
            f"unsupported architecture {arch[0]!r} (model_type={model_type!r}); "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r}; supported: silu")
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            sliding_windows=_sliding_windows_from_hf(cfg, model_type, num_layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing required key {e.args[0]!r}") from None


# GGUF `general.architecture` -> our model_type.
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """Builds a ModelConfig from GGUF metadata (llama.cpp's key names)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata is missing {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_layers = int(key("block_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    rope = RopeConfig(theta=float(key("rope.freq_base", 10000.0)))
    if scaling == "linear":
        rope = dataclasses.replace(rope, rope_type="linear", factor=float(key("rope.scaling.factor")))
    elif scaling not in ("none", None):
        raise ModelLoadError(f"unsupported GGUF rope scaling {scaling!r}; supported: none, linear")
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError("GGUF files with rope_freqs (llama3 rope) are not supported yet")
    window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // num_heads)
    return ModelConfig(
        model_type=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope=rope,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_windows=(window,) * num_layers,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_as_tuple(eos),
    )


def rope_inv_freq(rope: RopeConfig, head_dim: int):
    """Inverse frequencies as float32 numpy, computed the way transformers does."""
    import numpy as np

    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(rope.theta) ** exponent)).astype(np.float32)
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)
    return inv_freq
