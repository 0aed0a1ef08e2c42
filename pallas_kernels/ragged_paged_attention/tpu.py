"""Ragged paged attention and KV write as Pallas TPU (Mosaic) kernels.

Written in the subset Pallas' TPU interpreter runs on CPU, so CI checks them: refs are
only sliced (never reshaped or bitcast); every reshape happens on values or in the
wrapper. The wrapper (``common.plan_blocks``) gathers each query block's rows into a
dense tile per KV head, and the kernel runs on a grid of (block, KV head)::

    scalar prefetch (SMEM): block seq / first position / token count, kv_lens,
                            page_table (flat), [layer, sliding_window]
    q tile (VMEM, by BlockSpec)      [tile_rows, D]
    kv_cache (HBM, manual DMA)       [2*Hkv, L, num_pages, page_size, D]
    K/V buffers (VMEM)               [2 slots, block_pages * page_size, D]

For each KV block of its sequence the program waits for that block's pages, starts the
DMAs of the next block into the other slot, and folds the block into an online softmax.
Only the KV blocks a tile can see are read: from the sliding window's first page to the
page holding the tile's last token. Pages past the sequence's end are never fetched.

Layout: ``get_kv_cache_shape`` pads ``head_dim`` to a multiple of 128 (the lane width),
as Mosaic tiles want; the padding lanes are zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.common import (
    DEFAULT_BLOCK_SIZES,
    MASKED,
    BlockSizes,
    attend_by_plan,
    check_write_inputs,
    kv_block_range,
    kv_cache_shape,
    pad_head_dim,
)

LANES = 128
SUBLANES = 8


def get_kv_cache_shape(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """KV cache shape for the TPU kernels: head_dim padded to a multiple of 128."""
    padded = -(-head_dim // LANES) * LANES
    return kv_cache_shape(num_layers, num_pages, page_size, num_kv_heads, head_dim, head_dim_padded=padded)


def _interpret_arg(interpret: bool):
    # TPU interpret mode simulates DMAs, semaphores and VMEM on CPU; unwritten VMEM reads
    # as NaN, so a kernel that reads a buffer it never filled fails its tests.
    return pltpu.InterpretParams(uninitialized_memory="nan") if interpret else False


def _for_each(copies, method: str) -> None:
    for copy in copies:
        getattr(copy, method)()


def _attention_kernel(
    # scalar prefetch (SMEM)
    block_seq_ref,  # [G]
    block_pos_ref,  # [G] position of the block's first token in its sequence
    block_len_ref,  # [G] real tokens in the block (0 = unused)
    kv_lens_ref,  # [S]
    page_table_ref,  # [S * pages_per_seq] (flat: 2-D SMEM arrays pad badly)
    params_ref,  # [2] layer, sliding window (0 = unlimited)
    # inputs
    q_ref,  # [R, D] VMEM
    kv_hbm,  # [2*Hkv, L, num_pages, page_size, D] HBM
    # output
    o_ref,  # [R, D]
    # scratch
    k_buf,  # [2, Kb, D]
    v_buf,  # [2, Kb, D]
    sems,  # DMA semaphores [2]
    *,
    group: int,
    block_pages: int,
    pages_per_seq: int,
    sm_scale: float,
):
    b, h = pl.program_id(0), pl.program_id(1)
    num_kv_heads = kv_hbm.shape[0] // 2
    page_size = kv_hbm.shape[3]
    tile_rows, head_dim = q_ref.shape
    block_kv = block_pages * page_size
    seq, first, count = block_seq_ref[b], block_pos_ref[b], block_len_ref[b]
    layer, window = params_ref[0], params_ref[1]
    kv_len = kv_lens_ref[seq]
    seq_pages = (kv_len + page_size - 1) // page_size
    lo, hi = kv_block_range(first, count, kv_len, window, block_kv)

    def page_copies(j, slot):
        """The DMAs of KV block j into buffer slot; each guarded by whether the page exists."""
        for i in range(block_pages):
            index = j * block_pages + i
            page = page_table_ref[seq * pages_per_seq + index]
            dst = pl.ds(i * page_size, page_size)
            k_copy = pltpu.make_async_copy(kv_hbm.at[h, layer, page], k_buf.at[slot, dst], sems.at[slot])
            v_copy = pltpu.make_async_copy(kv_hbm.at[num_kv_heads + h, layer, page], v_buf.at[slot, dst], sems.at[slot])
            yield index < seq_pages, k_copy, v_copy

    def start(j, slot):
        for exists, *copies in page_copies(j, slot):
            pl.when(exists)(functools.partial(_for_each, copies, "start"))

    def wait(j, slot):
        for exists, *copies in page_copies(j, slot):
            pl.when(exists)(functools.partial(_for_each, copies, "wait"))

    # Row r holds token r // group of the block (float floor: no vector integer division).
    row = jax.lax.broadcasted_iota(jnp.int32, (tile_rows, block_kv), 0).astype(jnp.float32)
    row_tok = jnp.floor((row + 0.5) * (1.0 / group)).astype(jnp.int32)
    row_pos = first + row_tok
    row_real = row_tok < count
    col = jax.lax.broadcasted_iota(jnp.int32, (tile_rows, block_kv), 1)
    v_row = jax.lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)

    def body(j, carry):
        m, denom, acc = carry
        slot = (j - lo) % 2

        @pl.when(j + 1 < hi)
        def _():
            start(j + 1, 1 - slot)

        wait(j, slot)
        # Matmuls take the cache dtype and accumulate in float32.
        q = q_ref[...].astype(k_buf.dtype)
        # Rows of V past the sequence's end may hold another sequence's data or NaN
        # (a page beyond the end is never fetched): p is 0 there, but 0 * NaN is NaN.
        v = jnp.where(j * block_kv + v_row < kv_len, v_buf[slot], jnp.zeros((), v_buf.dtype))
        s = jax.lax.dot_general(q, k_buf[slot], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = s * sm_scale
        kv_pos = j * block_kv + col
        valid = (kv_pos <= row_pos) & ((window <= 0) | (kv_pos > row_pos - window)) & row_real
        s = jnp.where(valid, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
        p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + p.sum(axis=1, keepdims=True)
        acc = acc * alpha + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, denom, acc

    @pl.when(hi > lo)
    def _():
        start(lo, 0)
        init = (
            jnp.full((tile_rows, 1), MASKED, jnp.float32),
            jnp.zeros((tile_rows, 1), jnp.float32),
            jnp.zeros((tile_rows, head_dim), jnp.float32),
        )
        _, denom, acc = jax.lax.fori_loop(lo, hi, body, init)
        o_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)).astype(o_ref.dtype)

    @pl.when(hi <= lo)
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret"))
def ragged_paged_attention(
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
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, head_dim]
    """Same contract as ``ref_ragged_paged_attention``; two kernel calls (decode blocks,
    prefill-chunk blocks) over the same cache."""
    num_kv_heads = kv_cache.shape[0] // 2
    block_pages = min(block_sizes.block_pages, page_table.shape[1])
    block_kv = block_pages * kv_cache.shape[3]
    params = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(sliding_window, jnp.int32)])

    def attend(plan, tokens_per_block, page_table, kv_lens, decode):
        num_blocks, _, tile_rows, d = plan.tiles.shape
        tile_spec = pl.BlockSpec((None, None, tile_rows, d), lambda b, h, *_: (b, h, 0, 0))
        kernel = functools.partial(
            _attention_kernel,
            group=q.shape[1] // num_kv_heads,
            block_pages=block_pages,
            pages_per_seq=page_table.shape[1],
            sm_scale=sm_scale,
        )
        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=6,
                grid=(num_blocks, num_kv_heads),
                in_specs=[tile_spec, pl.BlockSpec(memory_space=pl.ANY)],
                out_specs=tile_spec,
                scratch_shapes=[
                    pltpu.VMEM((2, block_kv, d), kv_cache.dtype),
                    pltpu.VMEM((2, block_kv, d), kv_cache.dtype),
                    pltpu.SemaphoreType.DMA((2,)),
                ],
            ),
            out_shape=jax.ShapeDtypeStruct(plan.tiles.shape, q.dtype),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
            interpret=_interpret_arg(interpret),
            name="ragged_paged_attention_decode" if decode else "ragged_paged_attention_chunk",
        )(plan.seq, plan.first_pos, plan.num_tokens, kv_lens, page_table.reshape(-1), params, plan.tiles, kv_cache)

    return attend_by_plan(
        q,
        kv_cache,
        kv_lens,
        page_table,
        query_start_loc,
        block_q=block_sizes.block_q,
        block_pages=block_pages,
        row_multiple=SUBLANES,
        attend=attend,
    )


def _write_kernel(slots_ref, layer_ref, new_hbm, cache_in, cache_hbm, sem):
    """Copies each token's K/V row of every head to its slot: one DMA per (token, head),
    all in flight at once, then all awaited. Padding tokens write page 0 (scratch)."""
    del cache_in  # aliased to cache_hbm
    two_hkv, num_tokens = new_hbm.shape[0], new_hbm.shape[1]
    page_size = cache_hbm.shape[3]
    layer = layer_ref[0]

    def copies(t):
        slot = slots_ref[t]
        page, offset = slot // page_size, slot % page_size
        for head in range(two_hkv):
            yield pltpu.make_async_copy(
                new_hbm.at[head, pl.ds(t, 1)], cache_hbm.at[head, layer, page, pl.ds(offset, 1)], sem
            )

    @pl.loop(0, num_tokens)
    def _(t):
        for copy in copies(t):
            copy.start()

    @pl.loop(0, num_tokens)
    def _(t):
        for copy in copies(t):
            copy.wait()


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(
    kv_cache: jax.Array,  # [2*Hkv, L, num_pages, page_size, D]
    layer: jax.Array,  # [] int32
    slot_mapping: jax.Array,  # [T] int32
    k: jax.Array,  # [T, Hkv, head_dim <= D]
    v: jax.Array,  # [T, Hkv, head_dim <= D]
    *,
    interpret: bool = False,
) -> jax.Array:
    """Same contract as ``ref_write_kv``: returns the cache with this step's K/V written
    (in place: the cache is aliased to the output)."""
    check_write_inputs(kv_cache, slot_mapping, k, v)
    new = jnp.concatenate([k, v], axis=1).astype(kv_cache.dtype).transpose(1, 0, 2)  # [2*Hkv, T, hd]
    new = pad_head_dim(new, kv_cache.shape[4])
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        _write_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(1,),
            in_specs=[any_spec, any_spec],
            out_specs=any_spec,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        input_output_aliases={3: 0},
        interpret=_interpret_arg(interpret),
        name="write_kv",
    )(slot_mapping.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1), new, kv_cache)
