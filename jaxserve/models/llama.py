"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) in Flax NNX.

The model consumes the engine's flat ragged token batch directly; there is no separate
prefill path. Layers are stacked (every per-layer parameter has a leading ``[L]`` axis)
and run under ``jax.lax.scan``, so compile time does not grow with depth; the KV cache
(layout: ``jaxserve.attention``) rides in the scan carry and is updated in place.

Parameter layout: linear kernels are ``[in, out]`` (Hugging Face stores ``[out, in]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.attention import REFERENCE, AttentionBackend, AttentionMetadata
from jaxserve.models.config import ModelConfig, rope_inv_freq
from jaxserve.parallel import MODEL


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, scale: float = 0.02) -> nnx.Param:
    return nnx.Param((scale * jax.random.normal(rngs.params(), shape)).astype(dtype))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, as transformers does, then cast back."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def weight(w: jax.Array, dtype: str | None) -> jax.Array:
    """A matmul weight in its compute dtype.

    Weights narrower than the activations (``weight_dtype: bfloat16`` with float32
    activations) are stored as their raw 16-bit patterns (uint16) and bitcast here, per
    layer. Stored as bfloat16, XLA:CPU hoists a float32 conversion of every stacked
    weight out of the layer scan, which is 2x slower than plain float32; sliced as bits,
    each layer's matmul runs on the CPU's bfloat16 units (AMX / AVX512-BF16), 2.5x faster
    than float32.
    """
    return jax.lax.bitcast_convert_type(w, jnp.dtype(dtype)) if w.dtype == jnp.uint16 else w


def dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` in ``w``'s dtype, accumulated in float32. A single row goes in as two:
    XLA:CPU (YNNPACK) runs a one-row bfloat16 dot ~10x slower than two rows (29 against
    2.8 ms for the SmolLM2 head); the padded row costs next to nothing anywhere."""
    if x.shape[0] != 1:
        return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    return jnp.dot(jnp.pad(x, ((0, 1), (0, 0))).astype(w.dtype), w, preferred_element_type=jnp.float32)[:1]


def linear(x: jax.Array, w: jax.Array, dtype: str | None = None) -> jax.Array:
    """``x @ w`` in the weight's dtype, accumulated in float32, back in ``x``'s dtype."""
    return dot(x, weight(w, dtype)).astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half ("NeoX") rotary embedding; x [T, H, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class DecoderLayer(nnx.Module):
    """One pre-norm block: attention then SwiGLU MLP, each with a residual."""

    def __init__(self, cfg: ModelConfig, dtype, *, rngs: nnx.Rngs, weight_dtype: str | None = None):
        self.weight_dtype = weight_dtype  # static: see weight()
        e, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        hq, hkv = cfg.num_heads, cfg.num_kv_heads
        self.input_norm = nnx.Param(jnp.ones((e,), dtype))
        self.q_proj = _param(rngs, (e, hq * d), dtype)
        self.k_proj = _param(rngs, (e, hkv * d), dtype)
        self.v_proj = _param(rngs, (e, hkv * d), dtype)
        self.o_proj = _param(rngs, (hq * d, e), dtype)
        if cfg.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((hq * d,), dtype))
            self.k_bias = nnx.Param(jnp.zeros((hkv * d,), dtype))
            self.v_bias = nnx.Param(jnp.zeros((hkv * d,), dtype))
        if cfg.qk_norm:
            self.q_norm = nnx.Param(jnp.ones((d,), dtype))
            self.k_norm = nnx.Param(jnp.ones((d,), dtype))
        self.post_attention_norm = nnx.Param(jnp.ones((e,), dtype))
        self.gate_proj = _param(rngs, (e, f), dtype)
        self.up_proj = _param(rngs, (e, f), dtype)
        self.down_proj = _param(rngs, (f, e), dtype)
        self.cfg = cfg

    def __call__(
        self,
        x: jax.Array,  # [T, E]
        kv_cache: jax.Array,
        layer: jax.Array,  # [] int32
        sliding_window: jax.Array,  # [] int32
        cos: jax.Array,
        sin: jax.Array,
        md: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        t = x.shape[0]
        eps = cfg.rms_norm_eps
        with jax.named_scope("attention"):
            h = rms_norm(x, self.input_norm[...], eps)
            wd = self.weight_dtype
            q, k, v = linear(h, self.q_proj[...], wd), linear(h, self.k_proj[...], wd), linear(h, self.v_proj[...], wd)
            if cfg.attention_bias:
                q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
            q = q.reshape(t, cfg.num_heads, cfg.head_dim)
            k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q, k = rms_norm(q, self.q_norm[...], eps), rms_norm(k, self.k_norm[...], eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o, kv_cache = backend.write_and_attend(
                q, k, v, kv_cache, layer, md, sliding_window, sm_scale=cfg.head_dim**-0.5
            )
            x = x + linear(o.reshape(t, -1), self.o_proj[...], wd)
        with jax.named_scope("mlp"):
            h = rms_norm(x, self.post_attention_norm[...], eps)
            x = x + linear(
                jax.nn.silu(linear(h, self.gate_proj[...], wd)) * linear(h, self.up_proj[...], wd),
                self.down_proj[...],
                wd,
            )
        return x, kv_cache


class LlamaForCausalLM(nnx.Module):
    """Embedding, ``num_layers`` stacked decoder layers, final norm and LM head."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs, weight_dtype: str | None = None):
        """``weight_dtype``: set when matmul weights are stored as 16-bit patterns (weight())."""
        self.weight_dtype = weight_dtype
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, dtype, rngs=rngs, weight_dtype=weight_dtype)

        self.layers = make_layers(rngs)
        self.norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        # Narrow layer weights bring a narrow LM head, tied or not: its own [E, V] copy in
        # weight_dtype (a real bfloat16 array: outside the layer scan nothing hoists a
        # widening, and a bitcast of a whole parameter is a copy). On an AMX CPU a [32,
        # 576] x [576, 49152] head runs 2.6x faster so (3.0 against 7.7 ms) than a float32
        # x @ embed.T; the lookup keeps the float32 table.
        if not cfg.tie_word_embeddings or weight_dtype is not None:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), weight_dtype or dtype)

    def __call__(
        self, kv_cache: jax.Array, md: AttentionMetadata, backend: AttentionBackend = REFERENCE
    ) -> tuple[jax.Array, jax.Array]:
        """Runs one step. Returns (logits [S, V] float32 at ``md.logits_indices``, kv_cache)."""
        cfg = self.cfg
        embed = self.embed[...]
        x = embed[md.input_ids].astype(self.norm[...].dtype)  # activations: the norms' dtype
        inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)  # numpy, a trace-time constant
        freqs = md.positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)

        graphdef, layer_state = nnx.split(self.layers)

        def body(carry, xs):
            h, cache = carry
            state, layer, window = xs
            block = nnx.merge(graphdef, state)
            h, cache = block(h, cache, layer, window, cos, sin, md, backend)
            return (h, cache), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        windows = jnp.asarray(np.asarray(cfg.sliding_windows, np.int32))
        (x, kv_cache), _ = jax.lax.scan(body, (x, kv_cache), (layer_state, layer_ids, windows))
        x = x[md.logits_indices]
        x = rms_norm(x, self.norm[...], cfg.rms_norm_eps)
        head = self.lm_head[...] if hasattr(self, "lm_head") else embed.T
        logits = dot(x, head)
        if backend.mesh is not None:
            # Each device computes the logits of its vocabulary shard. Left to itself, GSPMD
            # all-gathers the whole LM head (1 GB for Llama-3-8B) every step instead.
            logits = jax.lax.with_sharding_constraint(logits, NamedSharding(backend.mesh, P(None, MODEL)))
        return logits, kv_cache
