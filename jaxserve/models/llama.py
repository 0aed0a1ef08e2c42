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
from jaxserve.models.quant import Int8Weights, int8_dot
from jaxserve.parallel import MODEL
from pallas_kernels import cpu_int8, cpu_matmul
from pallas_kernels.ragged_paged_attention.common import QkvProduct
from pallas_kernels.ragged_paged_attention.common import rotate_half_rope as apply_rope


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


def matmul_shapes(cfg: ModelConfig, packed: bool = False) -> dict[str, tuple[int, int]]:
    """``[in, out]`` of each decoder layer's linear weight. Packed (oneDNN) layers fuse the
    weights that read the same input: ``qkv_proj`` is ``[q | k | v]`` and ``gate_up_proj``
    ``[gate | up]`` by output columns (4 kernel calls per layer instead of 7)."""
    e, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    if packed:
        return {
            "qkv_proj": (e, (hq + 2 * hkv) * d),
            "o_proj": (hq * d, e),
            "gate_up_proj": (e, 2 * f),
            "down_proj": (f, e),
        }
    return {
        "q_proj": (e, hq * d),
        "k_proj": (e, hkv * d),
        "v_proj": (e, hkv * d),
        "o_proj": (hq * d, e),
        "gate_proj": (e, f),
        "up_proj": (e, f),
        "down_proj": (f, e),
    }


PACKED_HEAD_ROWS = 8  # rows the packed LM head is always given (see LlamaForCausalLM)

# The weights each packed one concatenates by output columns, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


INT8_BLOBS = "int8"  # ``packed`` for int8 weights in the AMX kernel's blobs (``cpu_int8``)


def is_packed(path, variable) -> bool:
    """nnx filter: linear weights packed for a CPU kernel (uint8 bytes; ``cpu_matmul``,
    ``cpu_int8``)."""
    return getattr(variable, "dtype", None) == jnp.uint8


class DecoderLayer(nnx.Module):
    """One pre-norm block: attention then SwiGLU MLP, each with a residual.

    ``packed`` (CPU, ``matmul_backend: onednn``): the linear weights (fused: see
    ``matmul_shapes``) are in oneDNN's layout (``pallas_kernels.cpu_matmul``) as uint8
    bytes, of dtype ``packed``. Such a weight is never sliced per layer: the layer scan
    hands the block the whole ``[L, bytes]`` stack and the kernel reads layer ``layer``'s
    bytes in place.

    ``quant`` (``quantization: int8``): each linear weight ``name`` is int8, with
    ``name_scale`` (and ``name_offset``) beside it (``jaxserve.models.quant``); with
    ``packed`` ``"int8"`` too, each (fused) weight is one blob per layer for the AMX kernel
    (``pallas_kernels.cpu_int8``), read in place as oneDNN's are.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        dtype,
        *,
        rngs: nnx.Rngs,
        weight_dtype: str | None = None,
        packed: str | None = None,
        quant: Int8Weights | None = None,
    ):
        self.weight_dtype = weight_dtype  # static: see weight()
        self.packed = packed
        self.quant = quant
        self.shapes = matmul_shapes(cfg, packed is not None)
        e, d = cfg.hidden_size, cfg.head_dim
        hq, hkv = cfg.num_heads, cfg.num_kv_heads
        for name, (k, n) in self.shapes.items():
            if quant is not None and packed is not None:
                layout = quant.layout(name)
                nbytes = cpu_int8.blob_bytes(k, n, layout.group, layout.offset)
                setattr(self, name, nnx.Param(jnp.zeros((nbytes,), jnp.uint8)))
            elif quant is not None:
                layout = quant.layout(name)
                setattr(self, name, nnx.Param(jnp.zeros((k, n), jnp.int8)))
                groups = (layout.groups(k), n)
                setattr(self, f"{name}_scale", nnx.Param(jnp.ones(groups, layout.scale_dtype)))
                if layout.offset:
                    setattr(self, f"{name}_offset", nnx.Param(jnp.zeros(groups, layout.scale_dtype)))
            elif packed is None:  # as 16-bit patterns where narrower than dtype (weight())
                setattr(self, name, _param(rngs, (k, n), jnp.uint16 if weight_dtype else dtype))
            else:  # gate_up_proj packed for the SwiGLU kernel: slices of [gate | up] (swiglu())
                s = cpu_matmul.swiglu_slices(n // 2, packed) if name == "gate_up_proj" else None
                setattr(self, name, nnx.Param(jnp.zeros((cpu_matmul.packed_bytes(k, n, packed, s),), jnp.uint8)))
        self.input_norm = nnx.Param(jnp.ones((e,), dtype))
        if cfg.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((hq * d,), dtype))
            self.k_bias = nnx.Param(jnp.zeros((hkv * d,), dtype))
            self.v_bias = nnx.Param(jnp.zeros((hkv * d,), dtype))
        if cfg.qk_norm:
            self.q_norm = nnx.Param(jnp.ones((d,), dtype))
            self.k_norm = nnx.Param(jnp.ones((d,), dtype))
        self.post_attention_norm = nnx.Param(jnp.ones((e,), dtype))
        self.cfg = cfg

    def linear(self, x: jax.Array, name: str, layer: jax.Array, out_dtype=None, rows=None) -> jax.Array:
        """``x @ w`` of weight ``name``, accumulated in float32, in ``out_dtype`` (default x's).
        ``rows``: the leading rows that hold tokens (the oneDNN kernel computes those only;
        the rest, a token bucket's padding, come out zero)."""
        w = getattr(self, name)[...]
        out_dtype = out_dtype or x.dtype
        if self.quant is not None and self.packed is not None:
            layout, (k, n) = self.quant.layout(name), self.shapes[name]
            return cpu_int8.matmul(x, w, layer, k, n, layout.group, layout.offset).astype(out_dtype)
        if self.quant is not None:
            scale = getattr(self, f"{name}_scale")[...]
            offset = getattr(self, f"{name}_offset")[...] if self.quant.layout(name).offset else None
            return int8_dot(x, w, scale, offset, self.quant.compute_dtype, dot).astype(out_dtype)
        if self.packed is None:
            return dot(x, weight(w, self.weight_dtype)).astype(out_dtype)
        return cpu_matmul.matmul(x, w, layer, self.shapes[name][1], self.packed, rows).astype(out_dtype)

    def product_slices(self, x: jax.Array, name: str, layer: jax.Array, rows) -> jax.Array:
        """``linear`` of oneDNN weight ``name`` as the kernel stores it, by column slice
        (``cpu_matmul.matmul_slices``), for a kernel that reads it so (attention's q|k|v,
        ``add_rms_norm``'s residual) instead of an XLA pass joining the slices."""
        return cpu_matmul.matmul_slices(x, getattr(self, name)[...], layer, self.shapes[name][1], self.packed, rows)

    def first_pending(self, m: int) -> jax.Array:
        """What the first layer's norm adds in place of a layer before's MLP output (the
        shape of this layer's down_proj ``product_slices`` for ``m`` rows): negative zeros,
        as x + -0.0 is x, bit for bit (+0.0 would turn a -0.0 of x into +0.0)."""
        shape = cpu_matmul.slices_shape(m, self.shapes["down_proj"][1], self.packed)
        return jnp.full(shape, -0.0, jnp.float32)

    def o_input(self) -> str | None:
        """The dtype o_proj reads the attention output in, where its kernel casts it (oneDNN
        weights: their dtype), else None: attention then returns it as bfloat16 itself
        instead of a float32 copy cast by another pass."""
        return self.packed if self.packed is not None and self.quant is None else None

    def projections(self, x: jax.Array, fused: str, layer: jax.Array) -> list[jax.Array]:
        """The outputs of the weights ``fused`` stands for (one kernel call when packed)."""
        names = FUSED[fused]
        if self.packed is None:
            return [self.linear(x, name, layer) for name in names]
        widths = [matmul_shapes(self.cfg)[name][1] for name in names]
        return jnp.split(self.linear(x, fused, layer), np.cumsum(widths)[:-1].tolist(), axis=-1)

    def norms_in_kernel(self, x: jax.Array) -> bool:
        """Whether the RMSNorms (and the residual add before the MLP's) run as
        ``cpu_matmul.add_rms_norm``, one pass over the rows that hands the next oneDNN call
        its input in the weights' dtype: oneDNN weights and float32 activations."""
        return self.o_input() is not None and x.dtype == jnp.float32

    def rope_in_attention(self, x: jax.Array, backend: AttentionBackend) -> bool:
        """Whether q, k and v go to attention unrotated, in the qkv call's product
        (QkvProduct): oneDNN weights, float32 activations, nothing between projection and
        RoPE (no bias, no q/k norm), and the CPU attention kernel on one device, which
        reads them there."""
        cfg = self.cfg
        plain = not cfg.attention_bias and not cfg.qk_norm
        return self.norms_in_kernel(x) and plain and backend.reads_products

    def __call__(
        self,
        x: jax.Array,  # [T, E]
        pending: jax.Array | None,
        kv_cache: jax.Array,
        layer: jax.Array,  # [] int32
        sliding_window: jax.Array,  # [] int32
        cos: jax.Array,
        sin: jax.Array,
        md: AttentionMetadata,
        backend: AttentionBackend,
        logits_rows_only: bool = False,
    ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """Returns (x, pending, kv_cache). With the norms in kernels (norms_in_kernel),
        ``pending`` is the MLP's output of the layer before, as ``matmul_slices`` gave it,
        not yet added to x: the first norm adds it in its own pass over the rows (XLA's
        add had been a pass of its own, ~2% of a 500-token prefill), and this layer hands
        on its own MLP output the same way. Otherwise None, in and out.

        ``logits_rows_only``: every token's K and V are written, but attention and all
        after it run for the rows of ``md.logits_indices`` only (the model's last layer:
        no layer reads the other rows' output); returns those rows, [S, E]."""
        cfg = self.cfg
        t = x.shape[0]
        eps = cfg.rms_norm_eps
        kernels_norm = self.norms_in_kernel(x)
        # The step's tokens lead its rows; the oneDNN calls skip the bucket's padding rows
        # (a 300-token prompt in the 512-token bucket ran 512 rows of every matmul).
        rows = md.query_start_loc[-1]
        attend = dict(sm_scale=cfg.head_dim**-0.5, out_dtype=self.o_input(), logits_rows_only=logits_rows_only)
        with jax.named_scope("attention"):
            if kernels_norm:
                x, h = cpu_matmul.add_rms_norm(x, pending, self.input_norm[...], eps, self.packed)
            else:
                h = rms_norm(x, self.input_norm[...], eps)
            if self.rope_in_attention(x, backend):
                # q, k and v stay in the product: the attention kernel reads (and rotates) them there.
                product = self.product_slices(h, "qkv_proj", layer, rows)
                qkv = QkvProduct(product, cos, sin, cfg.num_heads, cfg.num_kv_heads)
                o, kv_cache = backend.write_and_attend_product(qkv, kv_cache, layer, md, sliding_window, **attend)
            else:
                q, k, v = self.projections(h, "qkv_proj", layer)
                if cfg.attention_bias:
                    q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
                q = q.reshape(t, cfg.num_heads, cfg.head_dim)
                k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
                v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
                if cfg.qk_norm:
                    q, k = rms_norm(q, self.q_norm[...], eps), rms_norm(k, self.k_norm[...], eps)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                o, kv_cache = backend.write_and_attend(q, k, v, kv_cache, layer, md, sliding_window, **attend)
            if logits_rows_only:  # from here on the logits rows only
                x, t = x[md.logits_indices], o.shape[0]
                rows = t if md.num_logits is None else md.num_logits
            if kernels_norm:
                product = self.product_slices(o.reshape(t, -1), "o_proj", layer, rows)
                x, h = cpu_matmul.add_rms_norm(x, product, self.post_attention_norm[...], eps, self.packed)
            else:
                x = x + self.linear(o.reshape(t, -1), "o_proj", layer, x.dtype)
        with jax.named_scope("mlp"):
            if not kernels_norm:
                h = rms_norm(x, self.post_attention_norm[...], eps)
            if self.packed is not None and self.quant is None:  # oneDNN: SiLU and product in the kernel
                gated = cpu_matmul.swiglu(h, self.gate_up_proj[...], layer, cfg.intermediate_size, self.packed, rows)
            else:
                gate, up = self.projections(h, "gate_up_proj", layer)
                gated = jax.nn.silu(gate) * up
            # Added in float32, as it left the matmul: the oneDNN SwiGLU's output is bfloat16
            # (down_proj's input), and rounding down_proj's output to it too put these logits
            # 4x further from XLA's (test_onednn_layers_add_their_outputs_to_x_in_float32).
            if kernels_norm:  # added by the next norm
                return x, self.product_slices(gated, "down_proj", layer, rows), kv_cache
            x = x + self.linear(gated, "down_proj", layer, x.dtype, rows)
        return x, None, kv_cache


class LlamaForCausalLM(nnx.Module):
    """Embedding, ``num_layers`` stacked decoder layers, final norm and LM head."""

    # A step with fewer sequence slots than token rows runs its last layer past the K/V
    # write for the rows whose logits it needs only (__call__); False: for every row (for
    # the tests: their logits are the same bits).
    last_layer_rows_only = True

    def __init__(
        self,
        cfg: ModelConfig,
        dtype=jnp.float32,
        *,
        rngs: nnx.Rngs,
        weight_dtype: str | None = None,
        packed: str | None = None,
        quant: Int8Weights | None = None,
        packed_head: str | None = None,
    ):
        """``weight_dtype``: set when matmul weights are stored as 16-bit patterns (weight());
        ``packed``: the dtype of layer weights packed for oneDNN, or ``INT8_BLOBS``
        (DecoderLayer), or None; ``quant``: int8 layer weights (DecoderLayer), or None;
        ``packed_head``: the dtype of an LM head packed for oneDNN, or None (default: as
        the layers when they are packed for oneDNN)."""
        self.weight_dtype = weight_dtype
        self.packed = packed
        self.packed_head = packed_head or (packed if packed is not None and quant is None else None)
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, dtype, rngs=rngs, weight_dtype=weight_dtype, packed=packed, quant=quant)

        self.layers = make_layers(rngs)
        self.norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        # Narrow layer weights bring a narrow LM head, tied or not: its own [E, V] copy in
        # weight_dtype (a real bfloat16 array: outside the layer scan nothing hoists a
        # widening, and a bitcast of a whole parameter is a copy). On an AMX CPU a [32,
        # 576] x [576, 49152] head runs 2.6x faster so (3.0 against 7.7 ms) than a float32
        # x @ embed.T; the lookup keeps the float32 table.
        if self.packed_head:  # oneDNN's layout, as a one-"layer" stack
            nbytes = cpu_matmul.packed_bytes(cfg.hidden_size, cfg.vocab_size, self.packed_head)
            self.lm_head = nnx.Param(jnp.zeros((1, nbytes), jnp.uint8))
        elif not cfg.tie_word_embeddings or weight_dtype is not None:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), weight_dtype or dtype)

    def matmul_calls(self) -> list[tuple[int, int, str, bool, bool]]:
        """The CPU matmul kernel's weights a step multiplies (``pallas_kernels.cpu_matmul``):
        ``(K, N, dtype, swiglu, head)`` per packed weight, N being the outputs of a SwiGLU
        call, ``head`` for the LM head (given the step's sequences' rows, not its tokens');
        empty where nothing is packed for that kernel."""
        calls = []
        layers = self.layers.o_input()  # the layers' oneDNN dtype, if theirs is that kernel
        if layers is not None:
            for name, (k, n) in matmul_shapes(self.cfg, packed=True).items():
                swiglu = name == "gate_up_proj"
                calls.append((k, n // 2 if swiglu else n, layers, swiglu, False))
        if self.packed_head:
            calls.append((self.cfg.hidden_size, self.cfg.vocab_size, self.packed_head, False, True))
        return calls

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

        # Packed weights stay whole (the kernel indexes them by layer); the rest is indexed
        # by layer as the scan goes (what scanning over it would do, without the slice of
        # the stack that leaving out the last layer would copy).
        graphdef, packed, layer_state = nnx.split(self.layers, is_packed, ...)

        def run_layer(h, pending, cache, layer, window, logits_rows_only=False):
            block = nnx.merge(graphdef, packed, jax.tree.map(lambda a: a[layer], layer_state))
            return block(h, pending, cache, layer, window, cos, sin, md, backend, logits_rows_only)

        def body(carry, xs):
            return run_layer(*carry, *xs), None

        pending = self.layers.first_pending(x.shape[0]) if self.layers.norms_in_kernel(x) else None

        layer_ids = np.arange(cfg.num_layers, dtype=np.int32)
        windows = np.asarray(cfg.sliding_windows, np.int32)
        # Fewer sequences than token rows (a prefill chunk in the step): the last layer
        # computes the rows whose logits the step needs, the others only their K and V. A
        # 500-token prompt's last layer ran its attention, o, MLP on 500 rows for one.
        last_rows_only = self.last_layer_rows_only and md.logits_indices.shape[0] < md.input_ids.shape[0]
        scanned = cfg.num_layers - 1 if last_rows_only else cfg.num_layers
        xs = (jnp.asarray(layer_ids[:scanned]), jnp.asarray(windows[:scanned]))
        (x, pending, kv_cache), _ = jax.lax.scan(body, (x, pending, kv_cache), xs)
        if last_rows_only:
            x, pending, kv_cache = run_layer(
                x, pending, kv_cache, jnp.int32(scanned), jnp.int32(windows[scanned]), True
            )
        if pending is not None:
            x = x + cpu_matmul.join_slices(pending)
        if not last_rows_only:
            x = x[md.logits_indices]
        x = rms_norm(x, self.norm[...], cfg.rms_norm_eps)
        if self.packed_head:
            # At least 8 rows: oneDNN's kernel for a [K, 24576] slice changes between 4
            # and 5 rows, and a row's logits must not depend on how many share the step.
            # Of those, the kernel computes the sequences' rows (rows_computed: a lone
            # decode's one where that keeps its bits), not the padding's: the head streams
            # its 57 MB once a step, 2.4 ms for one row against 3.5 for eight (2-core Xeon,
            # AMX off; a lone decode 21.0 -> 20.2 ms/token).
            rows = x.shape[0]
            x = jnp.pad(x, ((0, max(0, PACKED_HEAD_ROWS - rows)), (0, 0)))
            head = self.lm_head[...]
            logits = cpu_matmul.matmul(x, head, 0, cfg.vocab_size, self.packed_head, md.num_logits)[:rows]
        else:
            logits = dot(x, self.lm_head[...] if hasattr(self, "lm_head") else embed.T)
        if backend.mesh is not None:
            # Each device computes the logits of its vocabulary shard. Left to itself, GSPMD
            # all-gathers the whole LM head (1 GB for Llama-3-8B) every step instead.
            logits = jax.lax.with_sharding_constraint(logits, NamedSharding(backend.mesh, P(None, MODEL)))
        return logits, kv_cache
