"""Pure-JAX ragged paged attention: the CPU path and the oracle for the Pallas kernels.

KV cache layout (one array for all layers)::

    kv_cache[num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim]
                                               ^ K heads first, then V heads

A token's K/V lives at ``slot = page * page_size + offset``. Page 0 is scratch:
padding tokens write there and no sequence reads it.

The flat ragged batch holds ``num_seqs`` sequences back to back; sequence ``s`` owns
query tokens ``query_start_loc[s]:query_start_loc[s+1]`` (its newest tokens) and
``kv_lens[s]`` cached tokens, this step's included, listed in ``page_table[s]``::

    tokens   | s0 chunk (prefill) | s1 | s2 | pad pad |
    s0 kv    [.....cached.....|chunk]      query i of s0 sits at kv position
                                           kv_lens[0] - q_len[0] + i

The reference walks the KV in blocks of ``block_pages`` pages with an online softmax,
for as many blocks as the longest sequence in the batch needs. A block beyond a
token's position changes nothing bit for bit (its weights are exactly zero), so a
token's output does not depend on what else is in the batch.
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
    return (num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim)


def ref_write_kv(
    kv_cache: jax.Array,  # [L, num_pages, page_size, 2*Hkv, D]
    layer: jax.Array,  # [] int32
    slot_mapping: jax.Array,  # [T] int32
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
) -> jax.Array:
    """Writes this step's K/V into their slots (an in-place scatter when donated)."""
    page_size = kv_cache.shape[2]
    kv = jnp.concatenate([k, v], axis=1).astype(kv_cache.dtype)
    return (
        jnp.asarray(kv_cache)
        .at[layer, slot_mapping // page_size, slot_mapping % page_size]
        .set(kv, mode="promise_in_bounds")
    )


def token_seq_ids(query_start_loc: jax.Array, num_tokens: int) -> jax.Array:
    """Sequence index of each token; ``num_seqs`` (out of range) for padding tokens."""
    return jnp.searchsorted(query_start_loc[1:], jnp.arange(num_tokens), side="right")


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_pages"))
def ref_ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array,  # [L, num_pages, page_size, 2*Hkv, D]
    layer: jax.Array,  # [] int32
    kv_lens: jax.Array,  # [S] int32, this step's tokens included
    page_table: jax.Array,  # [S, pages_per_seq] int32
    query_start_loc: jax.Array,  # [S+1] int32
    sliding_window: jax.Array | int = 0,  # [] int32, 0 = unlimited
    *,
    sm_scale: float,
    block_pages: int = 8,
) -> jax.Array:  # [T, Hq, D]
    """Causal attention of each query token over its own sequence's paged KV."""
    num_tokens, num_heads, head_dim = q.shape
    page_size = kv_cache.shape[2]
    num_kv_heads = kv_cache.shape[3] // 2
    group = num_heads // num_kv_heads
    num_seqs, pages_per_seq = page_table.shape
    block_pages = min(block_pages, pages_per_seq)
    block_tokens = block_pages * page_size

    seq = token_seq_ids(query_start_loc, num_tokens)
    is_real = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    # Absolute position of each query token inside its sequence.
    q_pos = kv_lens[seq] - q_lens[seq] + (jnp.arange(num_tokens) - query_start_loc[seq])
    lowest = jnp.where(sliding_window > 0, q_pos - sliding_window + 1, 0)
    # Pad the page table so every block is a full slice; padded entries are never read
    # unmasked (they lie beyond every kv_len).
    padded = -pages_per_seq % block_pages
    page_table = jnp.pad(page_table, ((0, 0), (0, padded)))
    num_blocks = (jnp.max(jnp.where(q_lens > 0, kv_lens, 0)) + block_tokens - 1) // block_tokens

    qf = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * sm_scale

    def body(j, carry):
        m, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(page_table, j * block_pages, block_pages, axis=1)
        kv = kv_cache[layer, pages[seq]]  # [T, block_pages, page_size, 2*Hkv, D]
        kv = kv.reshape(num_tokens, block_tokens, 2 * num_kv_heads, head_dim).astype(jnp.float32)
        kv_pos = j * block_tokens + jnp.arange(block_tokens)
        valid = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] >= lowest[:, None]) & is_real[:, None]  # [T, K]
        k = kv[:, :, :num_kv_heads]
        v = jnp.where(valid[:, :, None, None], kv[:, :, num_kv_heads:], 0.0)
        s = jnp.einsum("thgd,tkhd->thgk", qf, k)
        s = jnp.where(valid[:, None, None, :], s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(valid[:, None, None, :], jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("thgk,tkhd->thgd", p, v)
        return m_new, denom, acc

    init = (
        jnp.full((num_tokens, num_kv_heads, group), _MASKED, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
