"""Ragged paged attention on the CPU: a C++ kernel (``cpu_kernel.cc``) called through
XLA's FFI, for the decode and prefill attention that XLA:CPU runs slowly in pure JAX
(its gathers and tiny batched matmuls cost ~0.5 ns per element; see docs/performance.md,
"Earlier figures").

Same contract and KV layout as ``reference.py``; ``write_kv`` is the reference's XLA
scatter, a bfloat16 cache is held as its bits (``reference.storage_dtype``), and an
8-bit cache is a ``QuantizedKV`` whose rows the kernel widens times their scales.
``write_and_attend`` takes a layer's unrotated q|k|v product (``QkvProduct``) instead: one
call rotates q and k as it reads them, writes k and v into a float32 or bfloat16 cache in
place, and attends.

The kernel is compiled on first use (``pallas_kernels.cpu_build``: the machine's C++
compiler, cached per source, flags, jaxlib and CPU). :func:`available` says whether that worked;
``attention_backend: auto`` falls back to the reference when it did not.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build
from pallas_kernels.ragged_paged_attention.common import (
    DEFAULT_BLOCK_SIZES,
    QUANTIZED_KV_DTYPES,
    BlockSizes,
    QkvProduct,
    QuantizedKV,
    check_attention_inputs,
)
from pallas_kernels.ragged_paged_attention.reference import get_kv_cache_shape, ref_write_kv, storage_dtype

__all__ = [
    "KV_DTYPES",
    "available",
    "build_error",
    "get_kv_cache_shape",
    "ragged_paged_attention",
    "storage_dtype",
    "uses_amx",
    "write_and_attend",
    "write_kv",
    "write_kv_product",
]

log = logging.getLogger(__name__)

# The cache dtypes the kernel reads (bfloat16 as bits; 8-bit ones with their scales).
KV_DTYPES = ("float32", "bfloat16", *QUANTIZED_KV_DTYPES)
TARGET = "jaxserve_ragged_paged_attention"
WRITE_TARGET = "jaxserve_write_and_attend"
WRITE_ONLY_TARGET = "jaxserve_write_kv"


def _build() -> tuple[bool, str]:
    """Builds (or finds cached) and registers the CPU kernel library, once per process
    (``pallas_kernels.cpu_build``). Returns (ok, why not)."""
    k = cpu_build.kernels()
    if k.attention_error:
        _warn_once(k.attention_error)
    return not k.attention_error, k.attention_error


@functools.cache
def _warn_once(error: str) -> None:
    log.warning("CPU attention kernel unavailable (attention_backend auto uses the reference): %s", error)


def available() -> bool:
    """Whether the kernel is built and registered (builds it on first call)."""
    return _build()[0]


def build_error() -> str:
    return _build()[1]


def uses_amx() -> bool:
    """Whether a bfloat16 cache is read with AMX tile products (built for a CPU with AMX,
    the process allowed to use it, ``JAXSERVE_CPU_AMX`` not ``0``; head_dim a multiple of
    32): ~1.7x the vector path on a 500-token prefill, within ~1e-5 of its results."""
    return available() and bool(cpu_build.kernels().lib.JaxserveAttentionAmx())


def write_kv(kv_cache, layer, slot_mapping, k, v, *, interpret: bool = False):
    """The reference's XLA scatter (in place when the cache is donated)."""
    del interpret
    return ref_write_kv(kv_cache, layer, slot_mapping, k, v)


def _operands(q, kv_cache, kv_lens, page_table, query_start_loc, out_dtype):
    """The FFI call's q operands (rows, cos, sin), cache operands (values, scales) and
    output type, after the checks of an attention call."""
    check_attention_inputs(q, kv_cache, kv_lens, page_table, query_start_loc)
    if kv_cache.shape[4] != q.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} must equal the cache's head_dim {kv_cache.shape[4]}")
    if isinstance(kv_cache, QuantizedKV):
        values, scales = kv_cache.values, kv_cache.scales
    elif kv_cache.dtype in (jnp.float32, jnp.uint16):
        values, scales = kv_cache, jnp.zeros((1,), jnp.float32)  # no scales to read
    else:
        raise ValueError(
            f"kv_cache must be float32, uint16 (bfloat16 bits) or a QuantizedKV (int8, float8_e4m3fn), "
            f"got {kv_cache.dtype}"
        )
    ok, error = _build()
    if not ok:
        raise RuntimeError(error)
    if isinstance(q, QkvProduct):
        rows, cos, sin = q.product, q.cos, q.sin
    else:  # one slice of [T, Hq * D], rotated already
        rows, cos = q.reshape(1, q.shape[0], -1), jnp.zeros((0, q.shape[2]), jnp.float32)
        sin = cos
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    native = out_dtype if out_dtype in (jnp.float32, jnp.bfloat16) else jnp.dtype(jnp.float32)
    f32 = jnp.float32
    return (rows.astype(f32), cos.astype(f32), sin.astype(f32)), (values, scales), native, out_dtype


def _metadata(layer, kv_lens, page_table, query_start_loc, sliding_window):
    i32 = jnp.int32
    return (
        jnp.asarray(layer, i32).reshape(()),
        kv_lens.astype(i32),
        page_table.astype(i32),
        query_start_loc.astype(i32),
        jnp.asarray(sliding_window, i32).reshape(()),
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret", "out_dtype"))
def ragged_paged_attention(
    q: jax.Array | QkvProduct,  # [T, Hq, D], or a qkv product to read (and rotate) q from
    kv_cache: jax.Array | QuantizedKV,  # [2*Hkv, L, num_pages, page_size, D], float32, uint16 (bfloat16 bits), 8-bit
    layer: jax.Array,  # [] int32
    kv_lens: jax.Array,  # [S] int32
    page_table: jax.Array,  # [S, pages_per_seq] int32
    query_start_loc: jax.Array,  # [S+1] int32
    sliding_window: jax.Array | int = 0,  # [] int32, 0 = unlimited
    *,
    sm_scale: float,
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,  # unused: the kernel tiles by itself
    interpret: bool = False,  # unused: there is nothing to interpret
    out_dtype=None,  # default q's; float32 and bfloat16 come from the kernel as they are
) -> jax.Array:  # [T, Hq, D]
    del block_sizes, interpret
    rows, cache, native, out_dtype = _operands(q, kv_cache, kv_lens, page_table, query_start_loc, out_dtype)
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, native))(
        *rows,
        *cache,
        *_metadata(layer, kv_lens, page_table, query_start_loc, sliding_window),
        sm_scale=np.float32(sm_scale),
    )
    return out.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "out_dtype"))
def write_and_attend(
    qkv: QkvProduct,
    kv_cache: jax.Array | QuantizedKV,
    layer: jax.Array,
    slot_mapping: jax.Array,  # [T] int32
    kv_lens: jax.Array,
    page_table: jax.Array,
    query_start_loc: jax.Array,
    sliding_window: jax.Array | int = 0,
    *,
    sm_scale: float,
    out_dtype=None,
) -> tuple[jax.Array, jax.Array | QuantizedKV]:
    """``write_kv`` of the product's k (rotated) and v, then ``ragged_paged_attention``:
    one kernel call for a float32 or bfloat16 cache, which it writes in place (the call
    aliases it); an 8-bit cache is quantized and written by the reference's scatter.
    Returns (output [T, Hq, D], kv_cache)."""
    if isinstance(kv_cache, QuantizedKV):
        kv_cache = write_kv_product(qkv, kv_cache, layer, slot_mapping, kv_lens, page_table, query_start_loc)
        out = ragged_paged_attention(
            qkv,
            kv_cache,
            layer,
            kv_lens,
            page_table,
            query_start_loc,
            sliding_window,
            sm_scale=sm_scale,
            out_dtype=out_dtype,
        )
        return out, kv_cache
    rows, cache, native, out_dtype = _operands(qkv, kv_cache, kv_lens, page_table, query_start_loc, out_dtype)
    if slot_mapping.shape != (qkv.shape[0],):
        raise ValueError(f"slot_mapping must be [T={qkv.shape[0]}], got shape {slot_mapping.shape}")
    out, kv_cache = jax.ffi.ffi_call(
        WRITE_TARGET,
        (jax.ShapeDtypeStruct(qkv.shape, native), jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype)),
        input_output_aliases={3: 1},  # kv_cache, written in place
    )(
        *rows,
        *cache,
        *_metadata(layer, kv_lens, page_table, query_start_loc, sliding_window),
        slot_mapping.astype(jnp.int32),
        sm_scale=np.float32(sm_scale),
    )
    return out.astype(out_dtype), kv_cache


@jax.jit
def write_kv_product(
    qkv: QkvProduct,
    kv_cache: jax.Array | QuantizedKV,
    layer: jax.Array,
    slot_mapping: jax.Array,  # [T] int32
    kv_lens: jax.Array,
    page_table: jax.Array,
    query_start_loc: jax.Array,
) -> jax.Array | QuantizedKV:
    """``write_and_attend``'s write alone: the sequences' tokens' k (rotated) and v into
    their slots, bitwise as ``write_and_attend`` writes them (the kernel's own rotation; an
    8-bit cache by the reference's scatter, as there). For a step whose attention runs for
    some rows only (``ragged_paged_attention`` of those). Returns kv_cache."""
    if isinstance(kv_cache, QuantizedKV):
        return write_kv(kv_cache, layer, slot_mapping, *qkv.keys_values())
    rows, cache, _, _ = _operands(qkv, kv_cache, kv_lens, page_table, query_start_loc, None)
    if slot_mapping.shape != (qkv.shape[0],):
        raise ValueError(f"slot_mapping must be [T={qkv.shape[0]}], got shape {slot_mapping.shape}")
    return jax.ffi.ffi_call(
        WRITE_ONLY_TARGET,
        jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        input_output_aliases={3: 0},  # kv_cache, written in place
    )(
        *rows,
        *cache,
        *_metadata(layer, kv_lens, page_table, query_start_loc, 0),
        slot_mapping.astype(jnp.int32),
        num_heads=np.int64(qkv.num_heads),
    )
