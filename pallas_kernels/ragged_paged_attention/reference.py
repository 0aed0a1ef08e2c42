"""Pure-JAX ragged paged attention: the CPU path and the oracle for the Pallas kernels.

KV cache layout (one array for all layers), head-major so that gathering a block of
pages for one head is a contiguous copy with no transpose::

    kv_cache[2 * num_kv_heads, num_layers, num_pages, page_size, head_dim]
             ^ K heads first, then V heads

A token's K/V lives at ``slot = page * page_size + offset`` in every head's plane. Page 0 is scratch:
padding tokens write there and no sequence reads it.

The flat ragged batch holds ``num_seqs`` sequences back to back; sequence ``s`` owns
query tokens ``query_start_loc[s]:query_start_loc[s+1]`` (its newest tokens) and
``kv_lens[s]`` cached tokens, this step's included, listed in ``page_table[s]``::

    tokens   | s0 chunk (prefill) | s1 | s2 | pad pad |
    s0 kv    [.....cached.....|chunk]      query i of s0 sits at kv position
                                           kv_lens[0] - q_len[0] + i

The reference tiles the work as the kernels do: blocks of up to ``block_q`` query tokens
of one sequence against blocks of ``block_pages`` pages, with an online softmax, for as
many KV blocks as the longest sequence in the batch needs. A KV block beyond a token's
position changes nothing bit for bit (its weights are exactly zero), so a token's output
does not depend on what else is in the batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite "minus infinity": fully masked rows stay NaN-free


def get_kv_cache_shape(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """Shape of the KV cache array for the reference backend."""
    return (2 * num_kv_heads, num_layers, num_pages, page_size, head_dim)


def ref_write_kv(
    kv_cache: jax.Array,  # [2*Hkv, L, num_pages, page_size, D]
    layer: jax.Array,  # [] int32
    slot_mapping: jax.Array,  # [T] int32
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
) -> jax.Array:
    """Writes this step's K/V into their slots (an in-place scatter when donated)."""
    page_size = kv_cache.shape[3]
    kv = jnp.concatenate([k, v], axis=1).astype(kv_cache.dtype).transpose(1, 0, 2)  # [2*Hkv, T, D]
    return (
        jnp.asarray(kv_cache)
        .at[:, layer, slot_mapping // page_size, slot_mapping % page_size]
        .set(kv, mode="promise_in_bounds")
    )


def _query_blocks(query_start_loc: jax.Array, is_mine: jax.Array, num_blocks: int, block_q: int):
    """Splits the query tokens of the sequences where ``is_mine`` into blocks of at most
    ``block_q`` tokens. Returns, per block: its sequence (``num_seqs`` when unused), first
    token index and number of real tokens. ``num_blocks`` must cover the worst case.
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
    return seq_c, used, start, length


def _attend(
    q, kv_cache, layer, kv_lens, page_table, query_start_loc, sliding_window, blocks, block_q, sm_scale, block_pages
):
    """Online-softmax attention of query blocks over their sequences' pages.

    Returns (token index of each output row [G*Bq], padding rows -> T; outputs [G*Bq, Hq, D]).
    """
    seq, used, start, length = blocks
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_cache.shape[0] // 2, kv_cache.shape[3]
    group = num_heads // num_kv_heads
    num_blocks = seq.shape[0]
    block_kv = block_pages * page_size
    rows = start[:, None] + jnp.arange(block_q)[None, :]  # [G, Bq] token index
    is_real = jnp.arange(block_q)[None, :] < length[:, None]
    rows = jnp.where(is_real, rows, num_tokens)  # padding rows -> a spare row
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    q_pos = (kv_lens[seq] - q_lens[seq] - query_start_loc[seq])[:, None] + rows  # position in the sequence
    lowest = jnp.where(sliding_window > 0, q_pos - sliding_window + 1, 0)
    seq_kv_lens = jnp.where(used, kv_lens[seq], 0)
    num_kv_blocks = (jnp.max(seq_kv_lens) + block_kv - 1) // block_kv

    q_pad = jnp.concatenate([q, jnp.zeros((1, num_heads, head_dim), q.dtype)])
    # Score-matmul rows: (query token, query head sharing this KV head).
    qb = (q_pad[rows].astype(jnp.float32) * sm_scale).reshape(num_blocks, block_q, num_kv_heads, group, head_dim)
    qb = qb.transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, num_blocks, block_q * group, head_dim)
    row_pos = jnp.repeat(q_pos, group, axis=1)[None, :, :, None]  # [1, G, R, 1]
    row_low = jnp.repeat(lowest, group, axis=1)[None, :, :, None]
    row_real = jnp.repeat(is_real, group, axis=1)[None, :, :, None]

    def body(j, carry):
        m, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(page_table, j * block_pages, block_pages, axis=1)[seq]
        # Head-major pages: one gather gives [2*Hkv, G, Kb, D] with no transpose.
        kv = kv_cache[:, layer, pages].reshape(2 * num_kv_heads, num_blocks, block_kv, head_dim).astype(jnp.float32)
        kv_pos = j * block_kv + jnp.arange(block_kv)
        valid = (kv_pos <= row_pos) & (kv_pos >= row_low) & row_real  # [1, G, R, Kb]
        # Zero V outside the sequence's written slots: p is 0 there, but 0 * NaN is NaN.
        written = kv_pos[None, :] < seq_kv_lens[:, None]
        v = jnp.where(written[None, :, :, None], kv[num_kv_heads:], 0.0)
        s = jnp.einsum("hgrd,hgkd->hgrk", qb, kv[:num_kv_heads])
        s = jnp.where(valid, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("hgrk,hgkd->hgrd", p, v)
        return m_new, denom, acc

    shape = (num_kv_heads, num_blocks, block_q * group)
    init = (
        jnp.full(shape, _MASKED, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_kv_blocks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    out = out.reshape(num_kv_heads, num_blocks, block_q, group, head_dim).transpose(1, 2, 0, 3, 4)
    return rows.reshape(-1), out.reshape(num_blocks * block_q, num_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "block_pages"))
def ref_ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array,  # [2*Hkv, L, num_pages, page_size, D]
    layer: jax.Array,  # [] int32
    kv_lens: jax.Array,  # [S] int32, this step's tokens included
    page_table: jax.Array,  # [S, pages_per_seq] int32
    query_start_loc: jax.Array,  # [S+1] int32
    sliding_window: jax.Array | int = 0,  # [] int32, 0 = unlimited
    *,
    sm_scale: float,
    block_q: int = 16,
    block_pages: int = 8,
) -> jax.Array:  # [T, Hq, D]
    """Causal attention of each query token over its own sequence's paged KV.

    Work is tiled as the kernels tile it: query blocks of one sequence against KV blocks
    of ``block_pages`` pages, with an online softmax. A sequence with one query token (a
    decode) is a block of its own; longer ones (prefill chunks) are cut into blocks of
    ``block_q`` tokens, so each block reads its sequence's pages once, not once per token.
    Both kinds give a token bit-identical results: XLA:CPU's score matmul rounds a row
    the same way for any row count >= 2, and a decode block has ``max(group, 2)`` rows.
    """
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = kv_cache.shape[0] // 2
    num_seqs, pages_per_seq = page_table.shape
    block_pages = min(block_pages, pages_per_seq)
    # Pad the page table so every KV block is a full slice; padded entries are never read
    # unmasked (they lie beyond every kv_len).
    page_table = jnp.pad(page_table, ((0, 0), (0, -pages_per_seq % block_pages)))
    is_decode = query_start_loc[1:] - query_start_loc[:-1] == 1
    decode_block = 1 if num_heads // num_kv_heads >= 2 else 2
    out = jnp.zeros((num_tokens + 1, *q.shape[1:]), jnp.float32)
    for mine, block, count in (
        (is_decode, decode_block, num_seqs),
        (~is_decode, block_q, num_tokens // block_q + num_seqs),
    ):
        blocks = _query_blocks(query_start_loc, mine, count, block)
        rows, res = _attend(
            q,
            kv_cache,
            layer,
            kv_lens,
            page_table,
            query_start_loc,
            sliding_window,
            blocks,
            block,
            sm_scale,
            block_pages,
        )
        out = out.at[rows].set(res)
    return out[:num_tokens].astype(q.dtype)
