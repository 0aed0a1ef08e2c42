"""What the ragged paged attention implementations share: block sizes, the KV layout,
input validation and the query-block plan the kernels run over.

The plan cuts the flat ragged batch into query blocks, each holding tokens of one
sequence only, and gathers each block's queries into a dense tile per KV head::

    tokens  | s0 chunk (20 tokens)          | s1 | s2 | pad |
    blocks  [ s0[0:16] ][ s0[16:20] ]  [ s1 ][ s2 ]  [unused ...]
            chunk blocks (block_q tokens)    decode blocks (1 token)

    tile[block, kv_head] = [block_q * group rows, head_dim]
                            row r = (token r // group, query head r % group)

so one kernel program reads each KV page of its sequence once for all the query heads
that share the KV head (GQA) and all the block's tokens. Decodes and chunks are two
kernel calls with different tile heights, so a decode never pays for ``block_q`` rows.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_matmul

MASKED = -1e30  # finite "minus infinity": fully masked rows stay NaN-free


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of one attention call. Chosen by the caller, never derived from the device.

    Attributes:
        block_q: query tokens per block of a prefill chunk.
        block_pages: KV pages per KV block (one online-softmax step; one DMA batch).
    """

    block_q: int = 16
    # 4 pages of 16 = 64-token KV blocks: the fastest for the XLA:CPU reference
    # (scripts/profile_step.py: decode 170 ms vs 196 ms with 8 pages). The Pallas
    # backends choose their own (jaxserve.attention).
    block_pages: int = 4

    def __post_init__(self):
        for name in ("block_q", "block_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")


DEFAULT_BLOCK_SIZES = BlockSizes()


def kv_cache_shape(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *, head_dim_padded: int
) -> tuple[int, ...]:
    """The head-major KV layout every implementation shares (see ``reference.py``)::

    kv_cache[2 * num_kv_heads, num_layers, num_pages, page_size, head_dim_padded]

    ``head_dim_padded >= head_dim``; the padding lanes hold zeros and never change a
    score or an output.
    """
    for name, value in (
        ("num_layers", num_layers),
        ("num_pages", num_pages),
        ("page_size", page_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_pages < 2:
        raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
    shape = (2 * num_kv_heads, num_layers, num_pages, page_size, max(head_dim, head_dim_padded))
    return tuple(int(x) for x in shape)


# 8-bit caches: the value and the largest magnitude it holds (a row's scale maps its
# largest |x| onto it).
QUANTIZED_KV_DTYPES = {"int8": 127.0, "float8_e4m3fn": 448.0}


def rotate_half_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half ("NeoX") rotary embedding of x ``[T, H, D]`` by cos, sin ``[T, D]``:
    ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QkvProduct:
    """A layer's q, k and v as their projection produced them, not yet rotated:
    ``product`` ``[slices, T, N / slices]`` is the float32 output of a ``[q | k | v]``
    linear layer by column slices (as ``cpu_matmul.matmul_slices`` returns it: column
    ``h * D + d`` of q's heads, then k's, then v's), and ``cos``, ``sin`` ``[T, D]`` the
    RoPE of q and k (``rotate_half_rope``). The CPU kernel reads each row where it lies
    and rotates it as it loads it, so no pass over the product gathers and rotates q and
    k first; elsewhere ``query()`` and ``keys_values()`` materialize them. Stands in for
    q (``shape``, ``dtype``) in the checks of an attention call."""

    product: jax.Array
    cos: jax.Array
    sin: jax.Array
    num_heads: int = dataclasses.field(metadata=dict(static=True))
    num_kv_heads: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.product.shape[1], self.num_heads, self.cos.shape[-1])

    @property
    def ndim(self) -> int:
        return 3

    @property
    def dtype(self):
        return self.product.dtype

    def _heads(self) -> list[jax.Array]:
        t, h, d = self.shape
        joined = cpu_matmul.join_slices(self.product)
        hkv = self.num_kv_heads
        q, k, v = jnp.split(joined, [h * d, (h + hkv) * d], axis=-1)
        return [q.reshape(t, h, d), k.reshape(t, hkv, d), v[:, : hkv * d].reshape(t, hkv, d)]

    def query(self) -> jax.Array:
        """q ``[T, Hq, D]``, rotated."""
        q = self._heads()[0]
        return rotate_half_rope(q, self.cos.astype(q.dtype), self.sin.astype(q.dtype))

    def keys_values(self) -> tuple[jax.Array, jax.Array]:
        """k (rotated) and v, ``[T, Hkv, D]`` each."""
        _, k, v = self._heads()
        return rotate_half_rope(k, self.cos.astype(k.dtype), self.sin.astype(k.dtype)), v


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """An 8-bit KV cache: ``values`` in the backend's KV layout (int8 or float8_e4m3fn)
    and one float32 scale per token and head, ``scales[2*Hkv, L, num_pages, page_size]``
    (on TPU each page's row padded to 128 lanes: ``scales_shape``); a row reads as
    ``values * scale``.

    Why per token and head: a page fills one token at a time, so a per-page scale fixed
    by its first token could not hold a later, larger one without rewriting the page's
    earlier rows, which the prefix cache may share read-only; a token's own scale is
    final when it is written. Its price is 4 bytes per head_dim values (6% at 64).
    Both arrays are indexed by page first after the layer, so copy-on-write copies, the
    prefix cache and the sharding over KV heads (axis 0) treat them alike.
    """

    values: jax.Array
    scales: jax.Array

    # The cache stands in for its values where only the layout is read (shape checks).
    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def dtype(self):
        return self.values.dtype


def is_quantized(kv_dtype) -> bool:
    return jnp.dtype(kv_dtype).name in QUANTIZED_KV_DTYPES


def quantize_rows(x: jax.Array, kv_dtype) -> tuple[jax.Array, jax.Array]:
    """Rows of ``x [..., D]`` as 8-bit values and their float32 scales ``[...]``:
    ``scale = max|row| / qmax`` (0 for a zero row), values ``round(row / scale)``."""
    name = jnp.dtype(kv_dtype).name
    qmax = QUANTIZED_KV_DTYPES[name]
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / qmax
    y = jnp.clip(x / jnp.where(scale > 0, scale, 1.0)[..., None], -qmax, qmax)
    values = jnp.round(y).astype(jnp.int8) if name == "int8" else y.astype(jnp.float8_e4m3fn)
    return values, scale


def scales_shape(shape: tuple[int, ...], scale_lanes: int | None = None) -> tuple[int, ...]:
    """The scales of an 8-bit cache of ``shape``: ``[2*Hkv, L, num_pages, scale_lanes]``,
    where a page's ``page_size`` scales come first in its row (``scale_lanes`` defaults to
    page_size; the TPU backend pads the row to whole 128-lane vectors)."""
    return (*shape[:3], scale_lanes or shape[3])


def new_kv_cache(shape: tuple[int, ...], storage_dtype, scale_lanes: int | None = None) -> jax.Array | QuantizedKV:
    """A zeroed cache of ``shape`` (the backend's KV layout); 8-bit dtypes with their scales."""
    if is_quantized(storage_dtype):
        scales = jnp.zeros(scales_shape(shape, scale_lanes), jnp.float32)
        return QuantizedKV(jnp.zeros(shape, storage_dtype), scales)
    return jnp.zeros(shape, storage_dtype)


def kv_cache_bytes(shape: tuple[int, ...], storage_dtype, scale_lanes: int | None = None) -> int:
    """Bytes of a cache of ``shape`` (the KV layout), a quantized cache's scales included."""
    values = math.prod(shape) * jnp.dtype(storage_dtype).itemsize
    return values + (math.prod(scales_shape(shape, scale_lanes)) * 4 if is_quantized(storage_dtype) else 0)


def _is_int(value) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_write_inputs(kv_cache, slot_mapping, k, v) -> None:
    """Static checks of a KV write; raises ValueError naming the argument."""
    if kv_cache.ndim != 5:
        raise ValueError(f"kv_cache must be [2*Hkv, L, num_pages, page_size, D], got shape {kv_cache.shape}")
    num_kv_heads = kv_cache.shape[0] // 2
    if k.ndim != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [T, Hkv, head_dim], got {k.shape} and {v.shape}")
    if k.shape[1] != num_kv_heads or k.shape[2] > kv_cache.shape[4]:
        raise ValueError(
            f"k is [T, Hkv, head_dim] = {k.shape}, but kv_cache {kv_cache.shape} holds "
            f"{num_kv_heads} KV heads of head_dim <= {kv_cache.shape[4]}"
        )
    if slot_mapping.shape != (k.shape[0],) or not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"slot_mapping must be int [T={k.shape[0]}], got {slot_mapping.dtype}{slot_mapping.shape}")


def check_attention_inputs(q, kv_cache, kv_lens, page_table, query_start_loc) -> None:
    """Static checks of an attention call; raises ValueError naming the argument."""
    if kv_cache.ndim != 5 or kv_cache.shape[0] % 2:
        raise ValueError(f"kv_cache must be [2*Hkv, L, num_pages, page_size, D], got shape {kv_cache.shape}")
    num_kv_heads = kv_cache.shape[0] // 2
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, head_dim], got shape {q.shape}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    if q.shape[2] > kv_cache.shape[4]:
        raise ValueError(f"q head_dim {q.shape[2]} exceeds the cache's head_dim {kv_cache.shape[4]}")
    if page_table.ndim != 2:
        raise ValueError(f"page_table must be [S, pages_per_seq], got shape {page_table.shape}")
    num_seqs = page_table.shape[0]
    if kv_lens.shape != (num_seqs,):
        raise ValueError(f"kv_lens must be [S={num_seqs}], got shape {kv_lens.shape}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [S+1={num_seqs + 1}], got shape {query_start_loc.shape}")
    for name, x in (("kv_lens", kv_lens), ("page_table", page_table), ("query_start_loc", query_start_loc)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {x.dtype}")


def query_blocks(query_start_loc: jax.Array, is_mine: jax.Array, num_blocks: int, block_q: int):
    """Splits the query tokens of the sequences where ``is_mine`` into blocks of at most
    ``block_q`` tokens. Returns, per block: its sequence (clamped), its first token index
    and its number of real tokens (0 when unused).
    ``num_blocks`` must cover the worst case.
    """
    num_seqs = query_start_loc.shape[0] - 1
    q_lens = jnp.where(is_mine, query_start_loc[1:] - query_start_loc[:-1], 0)
    per_seq = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(per_seq)
    block = jnp.arange(num_blocks)
    seq = jnp.searchsorted(ends, block, side="right")
    used = seq < num_seqs
    seq_c = jnp.minimum(seq, num_seqs - 1)
    index_in_seq = block - (ends[seq_c] - per_seq[seq_c])
    start = query_start_loc[seq_c] + index_in_seq * block_q
    length = jnp.where(used, jnp.clip(q_lens[seq_c] - index_in_seq * block_q, 0, block_q), 0)
    return seq_c, start, length


def decode_block_tokens(group: int) -> int:
    """Tokens per decode block: one, or two when a KV head has one query head (so the
    score matmul has >= 2 rows, which XLA:CPU rounds like any larger row count)."""
    return 1 if group >= 2 else 2


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """One kernel call's query blocks (``G`` of them) as dense per-KV-head tiles.

    Attributes:
        seq, first_pos, num_tokens: [G] int32 per block: its sequence, the position in
            that sequence of its first token, its real token count (0 = unused block).
        rows: [G, block_tokens] token index of each block row; padding rows -> T.
        tiles: [G, Hkv, tile_rows, D] queries, row r = (token r // group, head r % group),
            zero-padded to ``tile_rows``.
    """

    seq: jax.Array
    first_pos: jax.Array
    num_tokens: jax.Array
    rows: jax.Array
    tiles: jax.Array


def plan_blocks(
    q: jax.Array,  # [T, Hq, D] already padded to the cache's head_dim
    kv_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    num_kv_heads: int,
    decode: bool,
    block_q: int,
    row_multiple: int,
) -> tuple[BlockPlan, int]:
    """Builds the decode plan (``decode=True``) or the prefill-chunk plan of a batch.

    Returns the plan and its tokens per block.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = kv_lens.shape[0]
    group = num_heads // num_kv_heads
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    if decode:
        tokens_per_block, num_blocks, mine = decode_block_tokens(group), num_seqs, q_lens == 1
    else:
        tokens_per_block, num_blocks, mine = block_q, num_tokens // block_q + num_seqs, q_lens != 1
    seq, start, length = query_blocks(query_start_loc, mine, num_blocks, tokens_per_block)
    first_pos = kv_lens[seq] - q_lens[seq] + (start - query_start_loc[seq])
    offsets = jnp.arange(tokens_per_block)
    rows = jnp.where(offsets[None, :] < length[:, None], start[:, None] + offsets[None, :], num_tokens)
    q_pad = jnp.concatenate([q, jnp.zeros((1, num_heads, head_dim), q.dtype)])
    tiles = q_pad[rows].reshape(num_blocks, tokens_per_block, num_kv_heads, group, head_dim)
    tiles = tiles.transpose(0, 2, 1, 3, 4).reshape(num_blocks, num_kv_heads, tokens_per_block * group, head_dim)
    tile_rows = math.ceil(tokens_per_block * group / row_multiple) * row_multiple
    tiles = jnp.pad(tiles, ((0, 0), (0, 0), (0, tile_rows - tokens_per_block * group), (0, 0)))
    i32 = jnp.int32
    plan = BlockPlan(seq.astype(i32), first_pos.astype(i32), length.astype(i32), rows, tiles)
    return plan, tokens_per_block


def untile(out: jax.Array, tokens_per_block: int, group: int) -> jax.Array:
    """Tile outputs [G, Hkv, tile_rows, D] back to block rows [G * tokens_per_block, Hq, D],
    in the order of ``BlockPlan.rows``."""
    num_blocks, num_kv_heads, _, head_dim = out.shape
    out = out[:, :, : tokens_per_block * group]
    out = out.reshape(num_blocks, num_kv_heads, tokens_per_block, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(num_blocks * tokens_per_block, num_kv_heads * group, head_dim)


def attend_by_plan(q, kv_cache, kv_lens, page_table, query_start_loc, *, block_q, block_pages, row_multiple, attend):
    """What every implementation does around its attention core.

    Checks the inputs, pads the page table to whole KV blocks and ``q`` to the cache's
    head_dim, builds the decode plan and the prefill-chunk plan, calls
    ``attend(plan, tokens_per_block, page_table, kv_lens, decode) -> [G, Hkv, >= tile_rows, D]``
    for each, and scatters the tiles back to token rows. Returns [T, Hq, head_dim].
    """
    check_attention_inputs(q, kv_cache, kv_lens, page_table, query_start_loc)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[0] // 2
    page_table = pad_page_table(page_table, block_pages).astype(jnp.int32)
    kv_lens, query_start_loc = kv_lens.astype(jnp.int32), query_start_loc.astype(jnp.int32)
    q_padded = pad_head_dim(q, kv_cache.shape[4])
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    out = jnp.zeros((num_tokens + 1, num_heads, q_padded.shape[2]), jnp.float32)
    for decode in (True, False):

        def run(out, decode=decode):
            plan, tokens_per_block = plan_blocks(
                q_padded,
                kv_lens,
                query_start_loc,
                num_kv_heads=num_kv_heads,
                decode=decode,
                block_q=block_q,
                row_multiple=row_multiple,
            )
            tiles = attend(plan, tokens_per_block, page_table, kv_lens, decode)
            rows = untile(tiles, tokens_per_block, num_heads // num_kv_heads)
            return out.at[plan.rows.reshape(-1)].set(rows.astype(jnp.float32))

        # A decode-only step skips the chunk plan entirely, and a prefill-only step the
        # decode plan (building and scattering an unused plan costs ~10 ms on XLA:CPU).
        present = jnp.any(q_lens == 1) if decode else jnp.any(q_lens > 1)
        out = jax.lax.cond(present, run, lambda out: out, out)
    return out[:num_tokens, :, :head_dim].astype(q.dtype)


def kv_block_range(first_pos, num_tokens, kv_len, window, block_kv: int):
    """The KV blocks a query block can see, as [lo, hi): from the block holding the
    sliding window's first position for the block's first token, through the block
    holding its last token. Empty for an unused block. Scalar jnp ops, so kernels of
    every backend use it as is."""
    lowest = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)
    lo = lowest // block_kv
    hi = (jnp.minimum(first_pos + num_tokens, kv_len) + block_kv - 1) // block_kv
    return lo, jnp.where(num_tokens > 0, hi, lo)


def pad_page_table(page_table: jax.Array, block_pages: int) -> jax.Array:
    """Pads each row to a whole number of KV blocks with page 0 (scratch, never read
    unmasked: the padded entries lie beyond every kv_len)."""
    return jnp.pad(page_table, ((0, 0), (0, -page_table.shape[1] % block_pages)))


def pad_head_dim(x: jax.Array, head_dim: int) -> jax.Array:
    """Zero-pads the last axis to ``head_dim`` (zero lanes add nothing to a dot)."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, head_dim - x.shape[-1])])
