"""Weights from a :class:`Checkpoint` into a :class:`LlamaForCausalLM` on device.

The model is first built abstractly (``nnx.eval_shape``: no memory, no random init);
each parameter is then filled from the checkpoint: converted to the target dtype on the
host one tensor at a time, transposed to ``[in, out]``, written into its slot of the
stacked ``[L, ...]`` buffer, and put on device.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxserve.errors import ModelLoadError
from jaxserve.models import weight_cache
from jaxserve.models.checkpoint import Checkpoint
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import FUSED, INT8_BLOBS, LlamaForCausalLM, matmul_shapes
from jaxserve.models.quant import (
    GGUF_BLOCK,
    GGUF_NATIVE,
    GGUF_ROW_MULTIPLE,
    Int8Weights,
    gguf_layout,
    per_channel_layout,
    quantize_per_channel,
)
from jaxserve.parallel import MODEL, check_divisible, param_sharding, replicate_kv_heads
from pallas_kernels import cpu_int8, cpu_matmul

# Our parameter (under `layers`) -> (Hugging Face name under model.layers.N., transpose).
_LAYER_PARAMS = {
    "input_norm": ("input_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "post_attention_norm": ("post_attention_layernorm.weight", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
}
_GLOBAL_PARAMS = {
    "embed": ("model.embed_tokens.weight", False),
    "norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}

# Stored in weight_dtype, as 16-bit patterns when narrower than the activations (the
# layer scan; llama.weight). The embedding table keeps the activation dtype (the lookup
# reads a few rows); the LM head is weight_dtype as a real array (llama.py says why).
MATMUL_PARAMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KV_PARAMS = ("k_proj", "v_proj", "k_bias", "v_bias")  # last axis is [Hkv * head_dim]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _convert(w: np.ndarray, transpose: bool, shape: tuple[int, ...], dtype, name: str) -> np.ndarray:
    w = np.asarray(w)
    if transpose:
        w = w.T
    if w.shape != shape:
        raise ModelLoadError(
            f"tensor {name!r} has shape {w.shape[::-1] if transpose else w.shape}, expected {shape[::-1] if transpose else shape}"
        )
    return w.astype(dtype)


def _map_layers(load, num_layers: int, bar, tensors_per_layer: int = 1):
    """``(i, load(i))`` for every layer in order, loaded on a thread per core: reading a
    tensor is mostly numpy work (GGUF dequantization, transposes, packing) that runs
    without the GIL, so a 2-core machine loads SmolLM2 ~1.6x faster so."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for i, w in enumerate(pool.map(load, range(num_layers))):
            yield i, w
            bar.update(tensors_per_layer)


def _stack_layers(load, shape: tuple[int, ...], dtype, bar, tensors_per_layer: int = 1) -> np.ndarray:
    """``[load(0), ..., load(L - 1)]`` as one ``shape`` array (:func:`_map_layers`)."""
    stacked = np.empty(shape, dtype)
    for i, w in _map_layers(load, shape[0], bar, tensors_per_layer):
        stacked[i] = w
    return stacked


def int8_weights(
    cfg: ModelConfig, compute_dtype: str, ckpt: Checkpoint | None = None, fused: bool = False
) -> Int8Weights:
    """The int8 layout of each linear weight: a GGUF type kept as its own blocks where every
    layer's tensor has it (Q8_0, Q4_0, Q4_1, Q4_K), else per-output-channel scales computed at
    load (Hugging Face checkpoints, other GGUF types; ``ckpt`` None: an abstract model).
    ``fused`` (the AMX kernel's blobs): the weights one blob joins (``FUSED``) share a
    layout, per-channel where theirs differ; the fused names are listed too."""
    layouts = {}
    for name, (k, _) in matmul_shapes(cfg).items():
        suffix = _LAYER_PARAMS[name][0]
        types = {ckpt.tensor_type(f"model.layers.{i}.{suffix}") for i in range(cfg.num_layers)} if ckpt else set()
        (qtype,) = types if len(types) == 1 else (None,)
        native = qtype in GGUF_NATIVE and k % GGUF_ROW_MULTIPLE.get(qtype, GGUF_BLOCK) == 0
        layouts[name] = gguf_layout(qtype) if native else per_channel_layout(k)
    if fused:
        for joined, parts in FUSED.items():
            if len({layouts[p] for p in parts}) > 1:
                layouts.update({p: per_channel_layout(matmul_shapes(cfg)[p][0]) for p in parts})
            layouts[joined] = layouts[parts[0]]
    return Int8Weights(tuple(layouts.items()), compute_dtype)


def abstract_model(
    cfg: ModelConfig,
    dtype: str = "float32",
    weight_dtype: str | None = None,
    model_axis: int = 1,
    packed: bool = False,
    quant: Int8Weights | None = None,
) -> tuple[ModelConfig, LlamaForCausalLM]:
    """The model's structure with abstract parameters (shapes and dtypes, no memory).

    Returns the config as the cache holds it (KV heads replicated up to ``model_axis``)
    and the abstract model. Matmul weights narrower than the activations are held as
    16-bit patterns (``llama.weight``); with ``packed``, in oneDNN's layout (``cpu_matmul``);
    with ``quant``, as int8 and scales (``jaxserve.models.quant``).

    Raises:
        ModelLoadError: a bad dtype, or a model the ``model`` axis does not divide.
    """
    weight_dtype = weight_dtype or dtype
    for key, value in (("dtype", dtype), ("weight_dtype", weight_dtype)):
        if value not in DTYPES:
            raise ModelLoadError(f"{key} {value!r} is not one of: {', '.join(DTYPES)}")
    try:
        kv_heads = check_divisible(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, model_axis)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    cfg = dataclasses.replace(cfg, num_kv_heads=kv_heads)
    jdtype, wdtype = DTYPES[dtype], DTYPES[weight_dtype]
    as_bits = jnp.dtype(wdtype) != jnp.dtype(jdtype) and jnp.dtype(wdtype).itemsize == 2
    model = nnx.eval_shape(
        lambda: LlamaForCausalLM(
            cfg,
            jdtype,
            rngs=nnx.Rngs(0),
            weight_dtype=weight_dtype if as_bits else None,
            packed=(INT8_BLOBS if quant is not None else weight_dtype) if packed else None,
            quant=quant,
            # The LM head stays weight_dtype under int8: packed for oneDNN where it runs.
            packed_head=weight_dtype if packed and quant is not None and cpu_matmul.available(weight_dtype) else None,
        )
    )
    return cfg, model


def weight_bytes(
    cfg: ModelConfig,
    dtype: str = "float32",
    weight_dtype: str | None = None,
    packed: bool = False,
    quant: Int8Weights | None = None,
) -> int:
    """Bytes of the model's parameters as loaded (all devices together), from shapes only."""
    _, model = abstract_model(cfg, dtype, weight_dtype, packed=packed, quant=quant)
    leaves = jax.tree_util.tree_leaves(nnx.state(model))
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)


def load_model(
    ckpt: Checkpoint,
    dtype: str = "float32",
    progress: bool = True,
    mesh: Mesh | None = None,
    weight_dtype: str | None = None,
    packed: bool = False,
    quant: Int8Weights | None = None,
    cache: str | Path | None = None,
) -> LlamaForCausalLM:
    """Builds the model described by ``ckpt`` and loads its weights in ``dtype``.

    With a ``mesh``, every tensor goes straight to its shards (``jaxserve.parallel``):
    each device receives only its slice. KV heads fewer than the ``model`` axis are
    replicated first, and the returned model's config counts the replicated heads.

    ``weight_dtype`` (default: ``dtype``) stores the decoder layers' linear kernels and
    the LM head; the embedding table, norms and biases keep ``dtype``, the activation
    dtype. ``packed`` (one CPU device): the layers' kernels go in oneDNN's layout.
    ``quant`` (from :func:`int8_weights`): the layers' kernels go in as int8 and scales.
    ``cache``: a folder where packed weights are kept for the next load (``weight_cache``).

    Raises:
        ModelLoadError: a bad checkpoint, dtype, or a model the mesh does not divide.
    """
    if packed and mesh is not None:
        raise ModelLoadError("packed (oneDNN) weights are for one CPU device, not a mesh")
    cfg, abstract = abstract_model(
        ckpt.config, dtype, weight_dtype, mesh.shape[MODEL] if mesh is not None else 1, packed=packed, quant=quant
    )
    kv_factor = cfg.num_kv_heads // ckpt.config.num_kv_heads
    orig_kv_heads = ckpt.config.num_kv_heads
    act_np = np.dtype(DTYPES[dtype])
    weight_np = np.dtype(DTYPES[weight_dtype or dtype])
    as_bits = abstract.weight_dtype is not None

    def put(name: str, w: np.ndarray) -> jax.Array:
        if as_bits and name in MATMUL_PARAMS and quant is None:
            w = w.view(np.uint16)
        if mesh is None:
            return jax.device_put(w)
        return jax.device_put(w, param_sharding(mesh, name, w.shape))

    graphdef, state = nnx.split(abstract)
    kept = None
    if cache is not None and packed:  # only packed weights are kept (weight_cache says why)
        kept = weight_cache.entry(Path(cache), ckpt.path, (dtype, weight_dtype, repr(quant)), graphdef)
        params = weight_cache.load(kept.path, kept.key)
        if params is not None:
            nnx.replace_by_pure_dict(state, params)
            return nnx.merge(graphdef, state)
    shapes = nnx.to_pure_dict(state)
    params: dict = {"layers": {}}
    names = set(ckpt.tensor_names())
    per_layer = sum(k in shapes["layers"] or (packed and k in MATMUL_PARAMS) for k in _LAYER_PARAMS)
    total = sum(k in shapes for k in _GLOBAL_PARAMS) + per_layer * cfg.num_layers
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress, leave=False)
    read = functools.lru_cache(maxsize=2)(ckpt.read)  # a tied head reads the embedding again
    for ours, (hf_name, transpose) in _GLOBAL_PARAMS.items():
        if ours not in shapes:
            continue
        if ours == "lm_head" and hf_name not in names:
            if not cfg.tie_word_embeddings:
                raise ModelLoadError(f"{ckpt.path} has no {hf_name} but the config does not tie embeddings")
            hf_name = _GLOBAL_PARAMS["embed"][0]  # tied, held apart in weight_dtype: embed.T
        shape = tuple(shapes[ours].shape)
        np_dtype = weight_np if ours in MATMUL_PARAMS or ours == "lm_head" else act_np
        if ours == "lm_head" and abstract.packed_head:
            w = _convert(read(hf_name), transpose, (cfg.hidden_size, cfg.vocab_size), np_dtype, hf_name)
            params[ours] = jax.device_put(cpu_matmul.pack(w)[None])
        else:
            params[ours] = put(ours, _convert(read(hf_name), transpose, shape, np_dtype, hf_name))
        bar.update()
    for ours, (suffix, transpose) in _LAYER_PARAMS.items():
        if ours not in shapes["layers"] or (packed and ours in MATMUL_PARAMS):
            continue
        if quant is not None and ours in MATMUL_PARAMS:
            factor = kv_factor if ours in _KV_PARAMS else 1
            params["layers"].update(_int8_layers(ckpt, ours, shapes["layers"], quant, factor, orig_kv_heads, put, bar))
            continue
        shape = tuple(shapes["layers"][ours].shape)
        per_head_kv = ours in _KV_PARAMS and kv_factor > 1
        file_shape = (*shape[1:-1], shape[-1] // kv_factor) if per_head_kv else shape[1:]
        np_dtype = weight_np if ours in MATMUL_PARAMS else act_np

        def layer(i, suffix=suffix, transpose=transpose, file_shape=file_shape, np_dtype=np_dtype, kv=per_head_kv):
            hf_name = f"model.layers.{i}.{suffix}"
            w = _convert(ckpt.read(hf_name), transpose, file_shape, np_dtype, hf_name)
            return replicate_kv_heads(w, orig_kv_heads, kv_factor) if kv else w

        params["layers"][ours] = put(ours, _stack_layers(layer, shape, np_dtype, bar))
    if packed:  # one device: no KV-head replication
        plain = matmul_shapes(cfg)
        for ours in matmul_shapes(cfg, packed=True):
            names = FUSED.get(ours, (ours,))

            def packed_layer(i: int, names=names) -> np.ndarray:
                parts = []
                for name in names:
                    suffix, transpose = _LAYER_PARAMS[name]
                    hf_name = f"model.layers.{i}.{suffix}"
                    if quant is not None:  # [q, scale, (offset)], each joined by output columns
                        parts.append(_int8_parts(ckpt, hf_name, quant.layout(name), plain[name]))
                    else:
                        parts.append(_convert(ckpt.read(hf_name), transpose, plain[name], weight_np, hf_name))
                if quant is not None:
                    return cpu_int8.pack(*(np.concatenate(p, axis=1) for p in zip(*parts, strict=True)))
                if names == FUSED["gate_up_proj"]:  # the SwiGLU kernel's slices (llama.DecoderLayer)
                    return cpu_matmul.pack_swiglu(*parts)
                return cpu_matmul.pack(np.concatenate(parts, axis=1))

            shape = tuple(shapes["layers"][ours].shape)
            params["layers"][ours] = jax.device_put(_stack_layers(packed_layer, shape, np.uint8, bar, len(names)))
    bar.close()
    if kept is not None:
        weight_cache.save(kept.path, kept.key, params, kept.files)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def _int8_parts(ckpt: Checkpoint, hf_name: str, layout, shape: tuple[int, int]) -> list[np.ndarray]:
    """One layer's weight ``hf_name`` as ``[q, scale]`` (``+ [offset]``), ``[in, out]``: per
    output channel from the float tensor, or the file's own blocks."""
    k, n = shape
    if layout.group == k:
        return list(quantize_per_channel(_convert(ckpt.read(hf_name), True, shape, np.float32, hf_name)))
    parts = [p.T for p in ckpt.read_blocks(hf_name) if p is not None]  # [out, in] -> [in, out]
    if parts[0].shape != shape or parts[1].shape != (k // layout.group, n):
        raise ModelLoadError(f"tensor {hf_name!r} has shape {parts[0].shape[::-1]}, expected {shape[::-1]}")
    return parts


def _int8_layers(ckpt, ours, shapes, quant, kv_factor, kv_heads, put, bar) -> dict[str, jax.Array]:
    """Linear weight ``ours`` of every layer as int8 ``[L, K, N]``, its scales (and
    offsets) ``[L, G, N]``, each put on device (``ours``, ``ours_scale``, ``ours_offset``)."""
    suffix, _ = _LAYER_PARAMS[ours]
    layout = quant.layout(ours)
    _, k, n = shapes[ours].shape

    def layer(i: int) -> list[np.ndarray]:
        parts = _int8_parts(ckpt, f"model.layers.{i}.{suffix}", layout, (k, n // kv_factor))
        return [replicate_kv_heads(p, kv_heads, kv_factor) for p in parts]

    names = [ours, f"{ours}_scale"] + ([f"{ours}_offset"] if layout.offset else [])
    stacked = [np.empty(shapes[name].shape, shapes[name].dtype) for name in names]
    for i, parts in _map_layers(layer, shapes[ours].shape[0], bar):
        for array, part in zip(stacked, parts, strict=True):
            array[i] = part
    return {name: put(name, array) for name, array in zip(names, stacked, strict=True)}
