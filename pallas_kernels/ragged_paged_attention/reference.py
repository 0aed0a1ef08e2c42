"""Pure-JAX ragged paged attention: the oracle for the Pallas and C++ kernels, and the
fallback on any platform.

KV cache layout (one array for all layers), head-major so that gathering a block of
pages for one head is a contiguous copy with no transpose::

    kv_cache[2 * num_kv_heads, num_layers, num_pages, page_size, head_dim]
             ^ K heads first, then V heads

A bfloat16 cache is stored as its raw bit patterns (``uint16``; ``storage_dtype``): held
as bfloat16, XLA:CPU converts the whole cache to float32 on every read instead of only
the gathered pages. Reading the bits and bitcasting per KV block is what makes a
bfloat16 cache (half the bytes of float32) faster, not slower, on CPU.

An 8-bit cache (int8, float8_e4m3fn) is a ``common.QuantizedKV``: the values in this
layout and a float32 scale per token and head (``quantize_rows`` at the write); a
gathered block is widened and multiplied by its rows' scales.

A token's K/V lives at ``slot = page * page_size + offset`` in every head's plane. Page 0 is scratch:
padding tokens write there and no sequence reads it. A backend may pad ``head_dim``
(``get_kv_cache_shape``); the padding lanes hold zeros.

The flat ragged batch holds ``num_seqs`` sequences back to back; sequence ``s`` owns
query tokens ``query_start_loc[s]:query_start_loc[s+1]`` (its newest tokens) and
``kv_lens[s]`` cached tokens, this step's included, listed in ``page_table[s]``::

    tokens   | s0 chunk (prefill) | s1 | s2 | pad pad |
    s0 kv    [.....cached.....|chunk]      query i of s0 sits at kv position
                                           kv_lens[0] - q_len[0] + i

The reference tiles the work as the kernels do (``common.plan_blocks``): blocks of up to
``block_q`` query tokens of one sequence against blocks of ``block_pages`` pages, with an
online softmax, for as many KV blocks as the longest sequence of each group of query
blocks needs. A KV block beyond a token's position changes nothing bit for bit (its
weights are exactly zero), so a token's output does not depend on what else is in the
batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.common import (
    DEFAULT_BLOCK_SIZES,
    MASKED,
    BlockPlan,
    BlockSizes,
    QuantizedKV,
    attend_by_plan,
    check_write_inputs,
    kv_cache_shape,
    pad_head_dim,
    quantize_rows,
)


def get_kv_cache_shape(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """Shape of the KV cache array for the reference backend (no padding)."""
    return kv_cache_shape(num_layers, num_pages, page_size, num_kv_heads, head_dim, head_dim_padded=head_dim)


def storage_dtype(kv_dtype) -> jnp.dtype:
    """The dtype the reference backend keeps a ``kv_dtype`` cache in (bfloat16 -> its bits;
    8-bit dtypes as themselves, in a ``QuantizedKV``)."""
    kv_dtype = jnp.dtype(kv_dtype)
    return jnp.dtype(jnp.uint16) if kv_dtype == jnp.bfloat16 else kv_dtype


def _to_cache(x: jax.Array, cache_dtype) -> jax.Array:
    if cache_dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(cache_dtype)


def _from_cache(x: jax.Array) -> jax.Array:
    """Cache values (gathered pages) as float32."""
    if x.dtype == jnp.uint16:
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x.astype(jnp.float32)


@jax.jit
def ref_write_kv(
    kv_cache: jax.Array | QuantizedKV,  # [2*Hkv, L, num_pages, page_size, D]
    layer: jax.Array,  # [] int32
    slot_mapping: jax.Array,  # [T] int32
    k: jax.Array,  # [T, Hkv, head_dim <= D]
    v: jax.Array,  # [T, Hkv, head_dim <= D]
) -> jax.Array | QuantizedKV:
    """Writes this step's K/V into their slots (an in-place scatter when donated)."""
    check_write_inputs(kv_cache, slot_mapping, k, v)
    page_size = kv_cache.shape[3]
    kv = jnp.concatenate([k, v], axis=1).transpose(1, 0, 2)  # [2*Hkv, T, head_dim]
    where = (slice(None), layer, slot_mapping // page_size, slot_mapping % page_size)
    if isinstance(kv_cache, QuantizedKV):
        values, scales = quantize_rows(kv, kv_cache.dtype)
        values = pad_head_dim(values, kv_cache.shape[4])
        return QuantizedKV(
            kv_cache.values.at[where].set(values, mode="promise_in_bounds"),
            kv_cache.scales.at[where].set(scales, mode="promise_in_bounds"),
        )
    kv = pad_head_dim(_to_cache(kv, kv_cache.dtype), kv_cache.shape[4])
    return jnp.asarray(kv_cache).at[where].set(kv, mode="promise_in_bounds")


def gather_pages(kv_cache: jax.Array | QuantizedKV, heads, layer, pages) -> jax.Array:
    """``kv_cache[heads, layer, pages]`` (one gather indexing all three, broadcast
    together) as float32 rows ``[..., page_size, D]``, 8-bit rows times their scales."""
    if isinstance(kv_cache, QuantizedKV):
        scales = kv_cache.scales[heads, layer, pages]
        return kv_cache.values[heads, layer, pages].astype(jnp.float32) * scales[..., None]
    return _from_cache(kv_cache[heads, layer, pages])


# Query blocks attended together (one batched matmul per KV block). A plan has room for
# its bucket's worst case (the chunk plan: T / block_q + S blocks), mostly unused.
BLOCKS_PER_GROUP = 8


def _attend(
    plan: BlockPlan,
    tokens_per_block,
    kv_cache,
    layer,
    kv_lens,
    page_table,
    sliding_window,
    sm_scale,
    block_pages,
):
    """Online-softmax attention of every block's tile over its sequence's pages.

    Blocks go in groups of ``BLOCKS_PER_GROUP``, for only as many groups as hold used
    blocks (the plan puts unused blocks last), and each group walks only as many KV
    blocks as its longest sequence needs: work follows the batch's real tokens, not its
    bucket. Returns outputs [G, Hkv, tile_rows, D] float32.
    """
    num_blocks = plan.tiles.shape[0]
    padded = -(-num_blocks // BLOCKS_PER_GROUP) * BLOCKS_PER_GROUP

    def pad(x):
        return jnp.pad(x, [(0, padded - num_blocks)] + [(0, 0)] * (x.ndim - 1))

    seq, first_pos, num_tokens, tiles = pad(plan.seq), pad(plan.first_pos), pad(plan.num_tokens), pad(plan.tiles)
    num_groups = (jnp.sum(num_tokens > 0) + BLOCKS_PER_GROUP - 1) // BLOCKS_PER_GROUP

    def group_body(i, out):
        part = [
            jax.lax.dynamic_slice_in_dim(x, i * BLOCKS_PER_GROUP, BLOCKS_PER_GROUP)
            for x in (seq, first_pos, num_tokens, tiles)
        ]
        res = _attend_group(
            *part, tokens_per_block, kv_cache, layer, kv_lens, page_table, sliding_window, sm_scale, block_pages
        )
        return jax.lax.dynamic_update_slice_in_dim(out, res, i * BLOCKS_PER_GROUP, axis=0)

    out = jax.lax.fori_loop(0, num_groups, group_body, jnp.zeros(tiles.shape, jnp.float32))
    return out[:num_blocks]


def _attend_group(
    seq,
    first_pos,
    num_tokens,
    tiles,
    tokens_per_block,
    kv_cache,
    layer,
    kv_lens,
    page_table,
    sliding_window,
    sm_scale,
    block_pages,
):
    """One group of query blocks against their sequences' KV blocks, all at once."""
    num_kv_heads, page_size = kv_cache.shape[0] // 2, kv_cache.shape[3]
    num_blocks, _, tile_rows, head_dim = tiles.shape
    group = tile_rows // tokens_per_block
    block_kv = block_pages * page_size
    # Score-matmul rows: (query token, query head sharing this KV head).
    qb = (tiles.astype(jnp.float32) * sm_scale).transpose(1, 0, 2, 3)  # [Hkv, G, R, D]
    row_tok = jnp.arange(tile_rows) // group
    row_pos = (first_pos[:, None] + row_tok[None, :])[None, :, :, None]  # [1, G, R, 1]
    row_low = jnp.where(sliding_window > 0, row_pos - sliding_window + 1, 0)
    row_real = (row_tok[None, :] < num_tokens[:, None])[None, :, :, None]
    seq_kv_lens = jnp.where(num_tokens > 0, kv_lens[seq], 0)
    num_kv_blocks = (jnp.max(seq_kv_lens) + block_kv - 1) // block_kv
    heads = jnp.arange(num_kv_heads)[:, None, None]

    def body(j, carry):
        m, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(page_table, j * block_pages, block_pages, axis=1)[seq]

        def load(first_head):
            # One gather per K and V, indexing head, layer and page at once, gives
            # [Hkv, G, Kb, D] in the dot's layout (slicing the cache first copies a layer).
            x = gather_pages(kv_cache, heads + first_head, layer, pages[None])
            return x.reshape(num_kv_heads, num_blocks, block_kv, head_dim)

        kv_pos = j * block_kv + jnp.arange(block_kv)
        valid = (kv_pos <= row_pos) & (kv_pos >= row_low) & row_real  # [1, G, R, Kb]
        s = jnp.einsum("hgrd,hgkd->hgrk", qb, load(0))
        s = jnp.where(valid, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + p.sum(axis=-1)
        # Zero V outside the sequence's written slots: p is 0 there, but 0 * NaN is NaN.
        written = kv_pos[None, :] < seq_kv_lens[:, None]
        v = jnp.where(written[None, :, :, None], load(num_kv_heads), 0.0)
        acc = acc * alpha[..., None] + jnp.einsum("hgrk,hgkd->hgrd", p, v)
        return m_new, denom, acc

    shape = (num_kv_heads, num_blocks, tile_rows)
    init = (
        jnp.full(shape, MASKED, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_kv_blocks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.transpose(1, 0, 2, 3)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes"))
def ref_ragged_paged_attention(
    q: jax.Array,  # [T, Hq, head_dim]
    kv_cache: jax.Array,  # [2*Hkv, L, num_pages, page_size, D >= head_dim]
    layer: jax.Array,  # [] int32
    kv_lens: jax.Array,  # [S] int32, this step's tokens included
    page_table: jax.Array,  # [S, pages_per_seq] int32
    query_start_loc: jax.Array,  # [S+1] int32
    sliding_window: jax.Array | int = 0,  # [] int32, 0 = unlimited
    *,
    sm_scale: float,
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,
) -> jax.Array:  # [T, Hq, head_dim]
    """Causal attention of each query token over its own sequence's paged KV.

    Work is tiled as the kernels tile it: query blocks of one sequence against KV blocks
    of ``block_pages`` pages, with an online softmax. A sequence with one query token (a
    decode) is a block of its own; longer ones (prefill chunks) are cut into blocks of
    ``block_q`` tokens, so each block reads its sequence's pages once, not once per token.
    Both kinds give a token bit-identical results: XLA:CPU's score matmul rounds a row
    the same way for any row count >= 2, and a decode block has ``max(group, 2)`` rows.
    """
    block_pages = min(block_sizes.block_pages, page_table.shape[1])

    def attend(plan, tokens_per_block, page_table, kv_lens, decode):
        return _attend(
            plan, tokens_per_block, kv_cache, layer, kv_lens, page_table, sliding_window, sm_scale, block_pages
        )

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
