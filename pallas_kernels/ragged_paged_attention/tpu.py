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

8-bit caches (``QuantizedKV``: int8 or float8_e4m3fn values, one float32 scale per token
and head in ``scales[2*Hkv, L, num_pages, scale_lanes(page_size)]``): each page's scales
travel beside its values (one sublane row per page), are spread over the KV block's
lanes by selects (``_lane_scales``: Mosaic has no sublane-to-lane reshape), and
multiply the scores (K) and the probabilities (V); the values widen to the query's dtype
for the MXU, exactly. The write quantizes in XLA (``quantize_rows``), moves the 8-bit
rows with the same tile kernel as any cache (an 8-bit tile is 32 rows: ``page_size`` must
be a multiple of 32) and sets the scales' lanes with a second kernel, a page row at a time.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

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
    scales_shape,
)

LANES = 128
SUBLANES = 8


def get_kv_cache_shape(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """KV cache shape for the TPU kernels: head_dim padded to a multiple of 128."""
    padded = -(-head_dim // LANES) * LANES
    return kv_cache_shape(num_layers, num_pages, page_size, num_kv_heads, head_dim, head_dim_padded=padded)


def scale_lanes(page_size: int) -> int:
    """Lanes of one page's row of scales in an 8-bit cache: page_size rounded up to whole
    128-lane vectors. An array whose last dim is under 128 lanes gets a transposed layout
    from XLA's TPU compiler (less padding), which the kernels' operands do not take: XLA
    would copy the whole scales array into their layout at every call (measured: 0.9 GB of
    temporaries in Llama-3-8B's step). Padded, the scales array is laid out as the kernels
    read it. Price at page_size 32 and head_dim 128: 512 bytes beside a page's 4 KB of int8
    values (+12.5%, against +3% unpadded); page_size 128 pads nothing."""
    return -(-page_size // LANES) * LANES


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
    *refs,  # [8-bit: scales_hbm [2*Hkv, L, num_pages, scale_lanes] HBM], o_ref [R, D] (output), then
    # scratch: k_buf, v_buf [2, Kb, D], [8-bit: ks_buf, vs_buf [2, scale_rows, scale_lanes]], DMA sems [2]
    group: int,
    block_pages: int,
    pages_per_seq: int,
    sm_scale: float,
):
    quantized = len(refs) == 7
    if quantized:
        scales_hbm, o_ref, k_buf, v_buf, ks_buf, vs_buf, sems = refs
    else:
        (o_ref, k_buf, v_buf, sems), scales_hbm = refs, None
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
            if not quantized:
                yield index < seq_pages, k_copy, v_copy
                continue
            row, one = pl.ds(page, 1), pl.ds(i, 1)  # the page's scales: one sublane row
            ks_copy = pltpu.make_async_copy(scales_hbm.at[h, layer, row], ks_buf.at[slot, one], sems.at[slot])
            vs_copy = pltpu.make_async_copy(
                scales_hbm.at[num_kv_heads + h, layer, row], vs_buf.at[slot, one], sems.at[slot]
            )
            yield index < seq_pages, k_copy, v_copy, ks_copy, vs_copy

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
    key_lane = jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)

    def body(j, carry):
        m, denom, acc = carry
        slot = (j - lo) % 2

        @pl.when(j + 1 < hi)
        def _():
            start(j + 1, 1 - slot)

        wait(j, slot)
        # Matmuls take the cache dtype (8-bit values: the query's) and accumulate in float32.
        dot_dtype = q_ref.dtype if quantized else k_buf.dtype
        q = q_ref[...].astype(dot_dtype)
        # Rows of V past the sequence's end may hold another sequence's data or NaN
        # (a page beyond the end is never fetched): p is 0 there, but 0 * NaN is NaN.
        v = jnp.where(j * block_kv + v_row < kv_len, v_buf[slot].astype(dot_dtype), jnp.zeros((), dot_dtype))
        k = k_buf[slot].astype(dot_dtype)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = s * sm_scale
        if quantized:  # each key's and value's scale, along the block's lanes
            written = j * block_kv + key_lane < kv_len
            s = s * _lane_scales(ks_buf[slot], block_pages, page_size)
            v_scale = jnp.where(written, _lane_scales(vs_buf[slot], block_pages, page_size), 0.0)
        kv_pos = j * block_kv + col
        valid = (kv_pos <= row_pos) & ((window <= 0) | (kv_pos > row_pos - window)) & row_real
        s = jnp.where(valid, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
        p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + p.sum(axis=1, keepdims=True)
        pv = p * v_scale if quantized else p
        acc = acc * alpha + jnp.dot(pv.astype(v.dtype), v, preferred_element_type=jnp.float32)
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


def _lane_scales(scales: jax.Array, block_pages: int, page_size: int) -> jax.Array:
    """A KV block's scales ``[>= block_pages, scale_lanes]`` (a row per page, its first
    page_size lanes used) as one lane row ``[1, block_pages * page_size]``:
    ``out[i * page_size + c] = scales[i, c]``. Mosaic has no sublane-to-lane reshape, so
    each column of the page rows is broadcast to the lanes that take it (``page_size``
    selects), then a masked sum over the pages keeps each lane's own page. Selects, not a
    one-hot matmul: a NaN scale (NaN K/V) stays in its own lane instead of spreading as
    0 * NaN. Rows past ``block_pages`` (sublane padding) drop out."""
    rows, lanes = scales.shape
    shape = (rows, block_pages * page_size)
    if shape[1] == lanes and block_pages == 1:
        return scales[:1]
    lane = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    column = lane & (page_size - 1)  # page_size is a power of two: no vector division
    spread = jnp.zeros(shape, jnp.float32)
    for c in range(page_size):
        spread = jnp.where(column == c, scales[:, c : c + 1], spread)
    page = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    shift = page_size.bit_length() - 1
    return jnp.where(page == lane >> shift, spread, 0.0).sum(axis=0, keepdims=True)


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
    quantized = isinstance(kv_cache, QuantizedKV)
    caches = [kv_cache.values, kv_cache.scales] if quantized else [kv_cache]
    block_pages = min(block_sizes.block_pages, page_table.shape[1])
    if quantized and page_size & (page_size - 1):
        raise ValueError(f"page_size ({page_size}) must be a power of two for an 8-bit KV cache on TPU")
    if quantized and kv_cache.scales.shape != (want := scales_shape(kv_cache.shape, scale_lanes(page_size))):
        raise ValueError(
            f"an 8-bit KV cache on TPU needs scales {want} (page rows padded to 128 lanes: tpu.scale_lanes), "
            f"got {kv_cache.scales.shape}"
        )
    block_kv = block_pages * page_size
    # An 8-bit block's scales: a sublane row per page, padded to whole (8, 128) tiles.
    scale_rows = -(-block_pages // SUBLANES) * SUBLANES
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
                in_specs=[tile_spec] + [pl.BlockSpec(memory_space=pl.ANY)] * len(caches),
                out_specs=tile_spec,
                scratch_shapes=[
                    pltpu.VMEM((2, block_kv, d), kv_cache.dtype),
                    pltpu.VMEM((2, block_kv, d), kv_cache.dtype),
                    *[pltpu.VMEM((2, scale_rows, scale_lanes(page_size)), jnp.float32)] * (2 if quantized else 0),
                    pltpu.SemaphoreType.DMA((2,)),
                ],
            ),
            out_shape=jax.ShapeDtypeStruct(plan.tiles.shape, q.dtype),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
            interpret=_interpret_arg(interpret),
            name="ragged_paged_attention_decode" if decode else "ragged_paged_attention_chunk",
        )(plan.seq, plan.first_pos, plan.num_tokens, kv_lens, page_table.reshape(-1), params, plan.tiles, *caches)

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


def tile_rows(dtype) -> int:
    """Rows of one memory tile of ``dtype`` on a TPU: 8 rows of 32-bit words, and narrower
    types pack 2 (16-bit) or 4 (8-bit) rows per word. A DMA or slice along the rows must
    start at a multiple of this (Mosaic rejects a one-row bfloat16 write)."""
    return SUBLANES * 4 // jnp.dtype(dtype).itemsize


# VMEM held by one round of the write kernel's tile buffer; the window of new rows beside
# it is about the same size. Well under every chip's default scoped VMEM (16 MiB on v5e).
WRITE_TILE_BUFFER_BYTES = 2 * 2**20


@dataclasses.dataclass(frozen=True)
class WritePlan:
    """Where a step's K/V rows go, as whole memory tiles (``tile_rows`` rows of a page).

    Tokens are sorted by slot and duplicate slots dropped (padding tokens all write the
    scratch slot 0). The sorted tokens then fall into *tiles* (one tile of one page each)
    and, within a tile, into *segments*: runs of consecutive slots, which are consecutive
    sorted tokens too. All arrays are [T] (room for the worst case), valid up to the
    counts in ``counts``.

    Attributes:
        counts: [2] number of tiles, number of segments.
        tile_page, tile_row: each tile's page and first row in that page.
        tile_first_seg: [T + 1] each tile's first segment; entry ``num_tiles`` = num_segs.
        seg_tile, seg_row, seg_src, seg_len: each segment's tile, first row in the tile,
            first sorted token and length.
        order: [T] original token of each sorted position (kept tokens first).
    """

    counts: jax.Array
    tile_page: jax.Array
    tile_row: jax.Array
    tile_first_seg: jax.Array
    seg_tile: jax.Array
    seg_row: jax.Array
    seg_src: jax.Array
    seg_len: jax.Array
    order: jax.Array


def plan_write(slot_mapping: jax.Array, page_size: int, rows: int) -> WritePlan:
    """Builds the tile and segment lists of a write (integer work on [T] arrays)."""
    i32 = jnp.int32
    num_tokens = slot_mapping.shape[0]
    by_slot = jnp.argsort(slot_mapping, stable=True).astype(i32)
    slots = slot_mapping.astype(i32)[by_slot]
    keep = jnp.concatenate([jnp.ones((1,), bool), slots[1:] != slots[:-1]])
    pos = jnp.where(keep, jnp.cumsum(keep) - 1, num_tokens)  # compacted index; dropped -> out of range
    order = jnp.zeros(num_tokens, i32).at[pos].set(by_slot, mode="drop")
    slots = jnp.zeros(num_tokens, i32).at[pos].set(slots, mode="drop")
    valid = jnp.arange(num_tokens) < keep.sum()
    tile, row = slots // rows, slots % rows

    def starts(x):  # where x differs from the element before it
        return jnp.concatenate([jnp.ones((1,), bool), x[1:] != x[:-1]])

    new_tile = valid & starts(tile)
    new_seg = new_tile | (valid & jnp.concatenate([jnp.ones((1,), bool), row[1:] != row[:-1] + 1]))
    tile_id, seg_id = jnp.cumsum(new_tile) - 1, jnp.cumsum(new_seg) - 1
    num_tiles, num_segs = new_tile.sum().astype(i32), new_seg.sum().astype(i32)
    at_tile = jnp.where(new_tile, tile_id, num_tokens)
    at_seg = jnp.where(new_seg, seg_id, num_tokens)
    zeros = jnp.zeros(num_tokens, i32)
    first_slot = zeros.at[at_tile].set(tile * rows, mode="drop")
    tile_first_seg = jnp.zeros(num_tokens + 1, i32).at[at_tile].set(seg_id, mode="drop").at[num_tiles].set(num_segs)
    return WritePlan(
        counts=jnp.stack([num_tiles, num_segs]),
        tile_page=first_slot // page_size,
        tile_row=first_slot % page_size,
        tile_first_seg=tile_first_seg,
        seg_tile=zeros.at[at_seg].set(tile_id, mode="drop"),
        seg_row=zeros.at[at_seg].set(row, mode="drop"),
        seg_src=zeros.at[at_seg].set(jnp.arange(num_tokens, dtype=i32), mode="drop"),
        seg_len=zeros.at[jnp.where(valid, seg_id, num_tokens)].add(1, mode="drop"),
        order=order,
    )


def _write_kernel(
    # scalar prefetch (SMEM)
    counts_ref,  # [2] tiles, segments
    layer_ref,  # [1]
    tile_page_ref,  # [T]
    tile_row_ref,  # [T]
    tile_first_seg_ref,  # [T + 1]
    seg_tile_ref,  # [T]
    seg_row_ref,  # [T]
    seg_src_ref,  # [T]
    seg_len_ref,  # [T]
    # inputs
    new_hbm,  # [T + window, 2*Hkv*D] HBM: the kept tokens' rows in slot order, heads side by side
    cache_in,  # aliased to cache_hbm
    # output
    cache_hbm,  # [2*Hkv, L, num_pages, page_size, D] HBM
    # scratch
    tiles,  # [C, 2*Hkv, R, D] VMEM: one round of cache tiles
    window,  # [window, 2*Hkv*D] VMEM: the new rows one round reads
    sems,  # DMA semaphores [3]: tile reads, tile writes, window
):
    """Read-modify-write of whole memory tiles, in rounds of up to C tiles: DMA the
    round's tiles and its window of new rows into VMEM (all in flight at once), merge
    each segment's rows into its tile, DMA the tiles back. Every DMA starts at a
    multiple of R rows, so packed dtypes (bfloat16, 8-bit) write as cleanly as float32."""
    del cache_in
    two_hkv, _, _, _, head_dim = cache_hbm.shape
    max_tiles, _, rows, _ = tiles.shape
    window_rows = window.shape[0]
    num_tiles, layer = counts_ref[0], layer_ref[0]

    def tile_copies(t, c, to_cache: bool):
        page, row = tile_page_ref[t], pl.multiple_of(tile_row_ref[t], rows)
        for h in range(two_hkv):
            hbm = cache_hbm.at[h, layer, page, pl.ds(row, rows)]
            if to_cache:
                yield pltpu.make_async_copy(tiles.at[c, h], hbm, sems.at[1])
            else:
                yield pltpu.make_async_copy(hbm, tiles.at[c, h], sems.at[0])

    def each_tile(first, count, to_cache: bool, method: str):
        @pl.loop(0, count)
        def _(c):
            _for_each(tile_copies(first + c, c, to_cache), method)

    r_idx = jax.lax.broadcasted_iota(jnp.int32, (rows, 2 * rows), 0)
    c_idx = jax.lax.broadcasted_iota(jnp.int32, (rows, 2 * rows), 1)
    row_idx = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    precision = jax.lax.Precision.HIGHEST if window.dtype == jnp.float32 else None
    # 8-bit rows move as bfloat16 (every int8 and float8_e4m3fn value is one exactly).
    move_dtype = jnp.bfloat16 if window.dtype.itemsize == 1 else window.dtype

    def merge(base, first_tile):
        def body(s, carry):
            tile, row, src, length = seg_tile_ref[s] - first_tile, seg_row_ref[s], seg_src_ref[s], seg_len_ref[s]
            src_block = (src // rows) * rows
            new = window[pl.ds(pl.multiple_of(src_block - base, rows), 2 * rows), :]  # [2R, 2*Hkv*D]
            new = new.astype(move_dtype)
            # Row r of the tile takes new row (r - row + src - src_block): a one-hot matmul
            # moves the rows (exact: one product by 1.0 per output), no sublane shuffles.
            pick = (c_idx == r_idx - row + (src - src_block)) & (r_idx >= row) & (r_idx < row + length)
            moved = jax.lax.dot(
                pick.astype(new.dtype), new, precision=precision, preferred_element_type=jnp.float32
            ).astype(tiles.dtype)
            mine = (row_idx >= row) & (row_idx < row + length)
            for h in range(two_hkv):
                tiles[tile, h] = jnp.where(mine, moved[:, h * head_dim : (h + 1) * head_dim], tiles[tile, h])
            return carry

        return body

    @pl.loop(0, (num_tiles + max_tiles - 1) // max_tiles)
    def _(round_):
        first = round_ * max_tiles
        count = jnp.minimum(max_tiles, num_tiles - first)
        seg_lo, seg_hi = tile_first_seg_ref[first], tile_first_seg_ref[first + count]
        base = pl.multiple_of((seg_src_ref[seg_lo] // rows) * rows, rows)
        window_copy = pltpu.make_async_copy(new_hbm.at[pl.ds(base, window_rows)], window, sems.at[2])
        window_copy.start()
        each_tile(first, count, False, "start")
        window_copy.wait()
        each_tile(first, count, False, "wait")
        jax.lax.fori_loop(seg_lo, seg_hi, merge(base, first), 0)
        each_tile(first, count, True, "start")
        each_tile(first, count, True, "wait")


@functools.partial(jax.jit, static_argnames=("interpret", "tile_buffer_bytes"))
def write_kv(
    kv_cache: jax.Array | QuantizedKV,  # [2*Hkv, L, num_pages, page_size, D]
    layer: jax.Array,  # [] int32
    slot_mapping: jax.Array,  # [T] int32
    k: jax.Array,  # [T, Hkv, head_dim <= D]
    v: jax.Array,  # [T, Hkv, head_dim <= D]
    *,
    interpret: bool = False,
    tile_buffer_bytes: int = WRITE_TILE_BUFFER_BYTES,
) -> jax.Array | QuantizedKV:
    """Same contract as ``ref_write_kv``: returns the cache with this step's K/V written
    (in place: the cache is aliased to the output). Duplicate slots: the first token wins.
    An 8-bit cache's rows are quantized here (``quantize_rows``, as the reference does);
    their scales go in through the scales kernel (``_write_scales``).

    Cost: besides the rows themselves, each touched tile is read and written whole (up to
    ``tile_rows`` rows per page and head), and the rows are sorted by slot in XLA first.
    A decode step touches one tile per sequence; a prefill chunk ~tokens / tile_rows."""
    check_write_inputs(kv_cache, slot_mapping, k, v)
    new = jnp.concatenate([k, v], axis=1)  # [T, 2*Hkv, hd]
    if not isinstance(kv_cache, QuantizedKV):
        return _write_rows(kv_cache, layer, slot_mapping, new.astype(kv_cache.dtype), interpret, tile_buffer_bytes)
    values, scales = quantize_rows(new, kv_cache.dtype)
    values = _write_rows(kv_cache.values, layer, slot_mapping, values, interpret, tile_buffer_bytes)
    scales = _write_scales(
        kv_cache.scales, layer, slot_mapping, scales, kv_cache.shape[3], interpret, tile_buffer_bytes
    )
    return QuantizedKV(values, scales)


def _scales_kernel(
    # scalar prefetch (SMEM)
    params_ref,  # [2] rows touched, layer
    row_page_ref,  # [T] each row's page (ascending; unused rows past the end)
    # inputs
    new_hbm,  # [T + G, 2*Hkv, 1, lanes] HBM: each row's new scales at their lanes
    mine_hbm,  # [T + G, 1, 1, lanes] HBM: 1 at the lanes this step writes
    cache_in,  # aliased to cache_hbm
    # output
    cache_hbm,  # [2*Hkv, L, num_pages, lanes] HBM
    # scratch
    rows,  # [G, 2*Hkv, 1, lanes] VMEM: one round of the pages' rows
    new,  # [G, 2*Hkv, 1, lanes] VMEM
    mine,  # [G, 1, 1, lanes] VMEM
    sems,  # DMA semaphores [3]: row reads, row writes, this step's scales
):
    """Read-modify-write of the scales' page rows a step touches, in rounds of up to G
    rows: DMA the round's rows (every head at once) and their new lanes into VMEM, select
    the new lanes in, DMA the rows back. Each page is one row, so no two DMAs of a round
    meet."""
    del cache_in
    max_rows = rows.shape[0]
    count, layer = params_ref[0], params_ref[1]

    def row_copies(first, n, to_cache: bool, method: str):
        @pl.loop(0, n)
        def _(g):
            hbm = cache_hbm.at[:, layer, pl.ds(row_page_ref[first + g], 1)]
            copy = (
                pltpu.make_async_copy(rows.at[g], hbm, sems.at[1])
                if to_cache
                else pltpu.make_async_copy(hbm, rows.at[g], sems.at[0])
            )
            getattr(copy, method)()

    @pl.loop(0, (count + max_rows - 1) // max_rows)
    def _(round_):
        first = pl.multiple_of(round_ * max_rows, max_rows)
        n = jnp.minimum(max_rows, count - first)
        new_copy = pltpu.make_async_copy(new_hbm.at[pl.ds(first, max_rows)], new, sems.at[2])
        mine_copy = pltpu.make_async_copy(mine_hbm.at[pl.ds(first, max_rows)], mine, sems.at[2])
        new_copy.start()
        mine_copy.start()
        row_copies(first, n, False, "start")
        new_copy.wait()
        mine_copy.wait()
        row_copies(first, n, False, "wait")
        rows[...] = jnp.where(mine[...] > 0, new[...], rows[...])
        row_copies(first, n, True, "start")
        row_copies(first, n, True, "wait")


def _write_scales(cache, layer, slot_mapping, scales, page_size: int, interpret: bool, buffer_bytes: int) -> jax.Array:
    """Sets ``cache[h, layer, page, offset] = scales[t, h]`` at each token's slot with the
    scales kernel: every page the step touches once, as a whole row. Done in XLA (a
    scatter), the single-element updates made XLA's TPU compiler carry the array in another
    layout through the layer loop and copy it whole into the attention kernels' layout at
    every call (0.6 GB a call in Llama-3-8B's step). Padding tokens (slot 0) may collide:
    any of them wins, on the scratch page."""
    num_tokens = slot_mapping.shape[0]
    two_hkv, _, num_pages, lanes = cache.shape
    slots = slot_mapping.astype(jnp.int32)
    pages, offsets = slots // page_size, slots % page_size
    # One row per page touched, ascending; the unused rows name a page past the end.
    row_page, row_of = jnp.unique(pages, size=num_tokens, fill_value=num_pages, return_inverse=True)
    row_of = row_of.reshape(num_tokens)
    count = jnp.sum(row_page < num_pages).astype(jnp.int32)
    row_bytes = two_hkv * SUBLANES * lanes * 4  # a [2*Hkv, 1, lanes] row pads to 8 sublanes a head
    # A round's rows and their new lanes take about buffer_bytes of VMEM.
    max_rows = min(-(-num_tokens // SUBLANES), max(1, buffer_bytes // (2 * row_bytes * SUBLANES))) * SUBLANES
    padded = num_tokens + max_rows
    new = jnp.zeros((padded, two_hkv, 1, lanes), jnp.float32).at[row_of, :, 0, offsets].set(scales)
    mine = jnp.zeros((padded, 1, 1, lanes), jnp.float32).at[row_of, 0, 0, offsets].set(1.0)
    params = jnp.stack([count, jnp.asarray(layer, jnp.int32)])
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        _scales_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(1,),
            in_specs=[any_spec] * 3,
            out_specs=any_spec,
            scratch_shapes=[
                pltpu.VMEM((max_rows, two_hkv, 1, lanes), jnp.float32),
                pltpu.VMEM((max_rows, two_hkv, 1, lanes), jnp.float32),
                pltpu.VMEM((max_rows, 1, 1, lanes), jnp.float32),
                pltpu.SemaphoreType.DMA((3,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        input_output_aliases={4: 0},
        interpret=_interpret_arg(interpret),
        name="write_kv_scales",
    )(params, row_page.astype(jnp.int32), new, mine, cache)


def _write_rows(kv_cache, layer, slot_mapping, new, interpret: bool, tile_buffer_bytes: int) -> jax.Array:
    """Writes ``new [T, 2*Hkv, hd]`` (the cache's dtype) into its slots with the tile kernel."""
    two_hkv, _, _, page_size, head_dim = kv_cache.shape
    rows = tile_rows(kv_cache.dtype)
    if page_size % rows:
        raise ValueError(
            f"page_size {page_size} must be a multiple of {rows} for a {jnp.dtype(kv_cache.dtype).name} "
            f"KV cache on TPU (the rows of one memory tile)"
        )
    num_tokens = slot_mapping.shape[0]
    plan = plan_write(slot_mapping, page_size, rows)
    tile_bytes = two_hkv * rows * head_dim * jnp.dtype(kv_cache.dtype).itemsize
    max_tiles = max(1, min(num_tokens, tile_buffer_bytes // tile_bytes))
    # One round's segments start within max_tiles * rows sorted tokens of its first one,
    # and each reads 2 * rows from its aligned start: this window always covers them.
    window_rows = min(max_tiles + 2, -(-num_tokens // rows) + 2) * rows
    new = pad_head_dim(new, head_dim)[plan.order].reshape(num_tokens, two_hkv * head_dim)
    new = jnp.pad(new, ((0, window_rows), (0, 0)))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    scalars = (
        plan.counts,
        jnp.asarray(layer, jnp.int32).reshape(1),
        plan.tile_page,
        plan.tile_row,
        plan.tile_first_seg,
        plan.seg_tile,
        plan.seg_row,
        plan.seg_src,
        plan.seg_len,
    )
    return pl.pallas_call(
        _write_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(1,),
            in_specs=[any_spec, any_spec],
            out_specs=any_spec,
            scratch_shapes=[
                pltpu.VMEM((max_tiles, two_hkv, rows, head_dim), kv_cache.dtype),
                pltpu.VMEM((window_rows, two_hkv * head_dim), kv_cache.dtype),
                pltpu.SemaphoreType.DMA((3,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        input_output_aliases={len(scalars) + 1: 0},
        interpret=_interpret_arg(interpret),
        name="write_kv",
    )(*scalars, new, kv_cache)
