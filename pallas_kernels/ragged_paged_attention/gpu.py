"""Ragged paged attention and KV write as Pallas GPU kernels (Triton backend).

Same plan as the TPU kernels (``common.plan_blocks``): a grid of (query block, KV head),
each program holding one dense query tile ``[tile_rows, D]`` and walking its sequence's
KV blocks with an online softmax. Triton has no scalar prefetch or DMA: the program
reads its block's metadata and page ids with scalar loads and gathers a KV block's
pages straight from global memory (``kv_cache[head, layer, pages]``), which Triton
turns into one pointer-arithmetic load of ``[block_pages, page_size, D]``.

An 8-bit cache (``common.QuantizedKV``) adds its scales ``[2*Hkv, L, num_pages,
page_size]``, gathered per KV block like the pages: scores are ``q . k_values`` times each
key's scale, and each value row's scale goes into the probabilities before ``p . v`` (the
8-bit values widen exactly to the query's dtype).

Triton wants every loaded tensor to have a power-of-two size and ``tl.dot`` operands
of at least 16 per side, so tiles are padded to a power of two >= 16 rows and
``get_kv_cache_shape`` pads ``head_dim`` to a power of two; block_pages and page_size
must be powers of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention.common import (
    DEFAULT_BLOCK_SIZES,
    MASKED,
    BlockSizes,
    QuantizedKV,
    attend_by_plan,
    check_write_inputs,
    kv_block_range,
    kv_cache_shape,
    pad_head_dim,
    quantize_rows,
)

MIN_DOT = 16
# Shared memory for one KV block (K and V), per pipeline stage. Hopper has 227 KiB per
# block; two stages of 64 KiB leave room for the query tile. Found by the compile-only
# H200 check: 128-token blocks of head_dim 256 asked for 320 KiB.
KV_BLOCK_BYTES = 64 * 1024


def _next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def get_kv_cache_shape(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """KV cache shape for the GPU kernels: head_dim padded to a power of two >= 16."""
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two for the GPU kernels, got {page_size}")
    padded = max(_next_pow2(head_dim), MIN_DOT)
    return kv_cache_shape(num_layers, num_pages, page_size, num_kv_heads, head_dim, head_dim_padded=padded)


def _attention_kernel(
    seq_ref,  # [G] block's sequence
    pos_ref,  # [G] position of the block's first token in its sequence
    count_ref,  # [G] real tokens in the block (0 = unused)
    kv_lens_ref,  # [S]
    page_table_ref,  # [S, pages_per_seq]
    params_ref,  # [2] layer, sliding window (0 = unlimited)
    q_ref,  # [R, D] this program's tile
    kv_ref,  # [2*Hkv, L, num_pages, page_size, D] the whole cache
    *refs,  # an 8-bit cache's scales [2*Hkv, L, num_pages, page_size]; then o_ref [R, D]
    group: int,
    block_pages: int,
    sm_scale: float,
):
    *scale_ref, o_ref = refs
    b, h = pl.program_id(0), pl.program_id(1)
    num_kv_heads, page_size = kv_ref.shape[0] // 2, kv_ref.shape[3]
    tile_rows, head_dim = q_ref.shape
    block_kv = block_pages * page_size
    seq, first, count = seq_ref[b], pos_ref[b], count_ref[b]
    layer, window = params_ref[0], params_ref[1]
    kv_len = kv_lens_ref[seq]
    lo, hi = kv_block_range(first, count, kv_len, window, block_kv)
    q = q_ref[...]
    dot_dtype = q.dtype if scale_ref else kv_ref.dtype  # 8-bit values widen to q's dtype
    row_tok = jnp.arange(tile_rows, dtype=jnp.int32) // group
    row_pos = (first + row_tok)[:, None]
    row_real = (row_tok < count)[:, None]

    def body(j, carry):
        m, denom, acc = carry
        pages = page_table_ref[seq, pl.ds(j * block_pages, block_pages)]
        k = kv_ref[h, layer, pages].reshape(block_kv, head_dim).astype(dot_dtype)
        v = kv_ref[num_kv_heads + h, layer, pages].reshape(block_kv, head_dim).astype(dot_dtype)
        kv_pos = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
        written = kv_pos < kv_len
        # V rows past the sequence's end may be another sequence's or NaN: 0 * NaN is NaN.
        v = jnp.where(written[:, None], v, jnp.zeros((), v.dtype))
        s = plgpu.dot(q.astype(dot_dtype), k, trans_b=True, allow_tf32=False) * sm_scale
        if scale_ref:
            k_scale = scale_ref[0][h, layer, pages].reshape(1, block_kv)
            v_scale = jnp.where(written, scale_ref[0][num_kv_heads + h, layer, pages].reshape(block_kv), 0.0)
            s = s * k_scale
        kv_pos = kv_pos[None, :]
        valid = (kv_pos <= row_pos) & ((window <= 0) | (kv_pos > row_pos - window)) & row_real
        s = jnp.where(valid, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + p.sum(axis=1)
        pv = p * v_scale[None, :] if scale_ref else p
        acc = acc * alpha[:, None] + plgpu.dot(pv.astype(v.dtype), v, allow_tf32=False)
        return m_new, denom, acc

    init = (
        jnp.full((tile_rows,), MASKED, jnp.float32),
        jnp.zeros((tile_rows,), jnp.float32),
        jnp.zeros((tile_rows, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(lo, hi, body, init)
    o_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret"))
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, head_dim]
    kv_cache: jax.Array | QuantizedKV,  # [2*Hkv, L, num_pages, page_size, D >= head_dim]
    layer: jax.Array,  # [] int32
    kv_lens: jax.Array,  # [S] int32, this step's tokens included
    page_table: jax.Array,  # [S, pages_per_seq] int32
    query_start_loc: jax.Array,  # [S+1] int32
    sliding_window: jax.Array | int = 0,  # [] int32, 0 = unlimited
    *,
    sm_scale: float,
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, head_dim]
    """Same contract as ``ref_ragged_paged_attention``; two kernel calls (decode blocks,
    prefill-chunk blocks) over the same cache."""
    num_kv_heads, page_size = kv_cache.shape[0] // 2, kv_cache.shape[3]
    caches = [kv_cache.values, kv_cache.scales] if isinstance(kv_cache, QuantizedKV) else [kv_cache]
    block_pages = min(block_sizes.block_pages, _next_pow2(page_table.shape[1]))
    if block_pages & (block_pages - 1) or page_size & (page_size - 1):
        raise ValueError(f"block_pages ({block_pages}) and page_size ({page_size}) must be powers of two")
    # K and V of one page; an 8-bit page also in its widened copy (found by the H200 check).
    itemsize = kv_cache.dtype.itemsize + (q.dtype.itemsize if len(caches) > 1 else 0)
    page_bytes = 2 * page_size * kv_cache.shape[4] * itemsize
    while block_pages > 1 and block_pages * page_bytes > KV_BLOCK_BYTES:
        block_pages //= 2
    num_stages = 2 if page_bytes <= KV_BLOCK_BYTES else 1  # a lone page over budget: no double buffer
    params = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(sliding_window, jnp.int32)])

    def attend(plan, tokens_per_block, page_table, kv_lens, decode):
        rows = max(_next_pow2(plan.tiles.shape[2]), MIN_DOT)
        tiles = jnp.pad(plan.tiles, ((0, 0), (0, 0), (0, rows - plan.tiles.shape[2]), (0, 0)))
        num_blocks, _, _, d = tiles.shape
        tile_spec = pl.BlockSpec((None, None, rows, d), lambda b, h: (b, h, 0, 0))
        whole = pl.no_block_spec
        kernel = functools.partial(
            _attention_kernel, group=q.shape[1] // num_kv_heads, block_pages=block_pages, sm_scale=sm_scale
        )
        return pl.pallas_call(
            kernel,
            grid=(num_blocks, num_kv_heads),
            in_specs=[whole] * 6 + [tile_spec] + [whole] * len(caches),
            out_specs=tile_spec,
            out_shape=jax.ShapeDtypeStruct(tiles.shape, q.dtype),
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=num_stages),
            interpret=interpret,
            name="ragged_paged_attention_decode" if decode else "ragged_paged_attention_chunk",
        )(plan.seq, plan.first_pos, plan.num_tokens, kv_lens, page_table, params, tiles, *caches)

    return attend_by_plan(
        q,
        kv_cache,
        kv_lens,
        page_table,
        query_start_loc,
        block_q=block_sizes.block_q,
        block_pages=block_pages,
        row_multiple=1,
        attend=attend,
    )


def _write_kernel(slots_ref, params_ref, *refs):
    """One program per token: stores its K/V row of every head into its slot (and, for an
    8-bit cache, its scale beside it)."""
    n = len(refs) // 3  # the new rows (and scales), the caches in (aliased to), the caches out
    new_refs, cache_refs = refs[:n], refs[2 * n :]
    t = pl.program_id(0)
    page_size = cache_refs[0].shape[3]
    slot, layer = slots_ref[t], params_ref[0]
    page, offset = slot // page_size, slot % page_size
    for head in range(new_refs[0].shape[0]):
        for new_ref, cache_ref in zip(new_refs, cache_refs, strict=True):
            cache_ref[head, layer, page, offset] = new_ref[head, t]


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(
    kv_cache: jax.Array | QuantizedKV,  # [2*Hkv, L, num_pages, page_size, D]
    layer: jax.Array,  # [] int32
    slot_mapping: jax.Array,  # [T] int32
    k: jax.Array,  # [T, Hkv, head_dim <= D]
    v: jax.Array,  # [T, Hkv, head_dim <= D]
    *,
    interpret: bool = False,
) -> jax.Array | QuantizedKV:
    """Same contract as ``ref_write_kv`` (in place: the cache is aliased to the output).
    Padding tokens all write page 0 (scratch). An 8-bit cache's rows are quantized here
    (``quantize_rows``, as the reference does) and stored with their scales."""
    check_write_inputs(kv_cache, slot_mapping, k, v)
    new = jnp.concatenate([k, v], axis=1).transpose(1, 0, 2)  # [2*Hkv, T, hd]
    if isinstance(kv_cache, QuantizedKV):
        values, scales = quantize_rows(new, kv_cache.dtype)
        news, caches = [pad_head_dim(values, kv_cache.shape[4]), scales], [kv_cache.values, kv_cache.scales]
    else:
        news, caches = [pad_head_dim(new.astype(kv_cache.dtype), kv_cache.shape[4])], [kv_cache]
    whole = pl.no_block_spec
    n = len(caches)
    out = pl.pallas_call(
        _write_kernel,
        grid=(new.shape[1],),
        in_specs=[whole] * (2 + 2 * n),
        out_specs=[whole] * n,
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        input_output_aliases={2 + n + i: i for i in range(n)},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="write_kv",
    )(slot_mapping.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1), *news, *caches)
    return QuantizedKV(*out) if isinstance(kv_cache, QuantizedKV) else out[0]
