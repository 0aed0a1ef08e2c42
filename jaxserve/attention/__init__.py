"""The attention backend interface the model calls, and the batch metadata it reads.

One flat ragged batch per step: decodes (one token each) and prefill chunks side by
side. The runner builds an :class:`AttentionMetadata`; the model writes each new
token's K/V through ``slot_mapping`` and attends over ``page_table`` / ``kv_lens``.
Backends: ``reference`` (pure JAX, CPU default). Pallas kernels plug in here.
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels.ragged_paged_attention import (
    get_kv_cache_shape,
    ref_ragged_paged_attention,
    ref_write_kv,
)

BACKENDS = ("reference",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-step metadata of the flat ragged batch (T tokens, S sequence slots)."""

    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    slot_mapping: jax.Array  # [T] int32, page * page_size + offset; padding -> page 0
    query_start_loc: jax.Array  # [S+1] int32; padding sequences have q_len 0
    kv_lens: jax.Array  # [S] int32, this step's tokens included
    page_table: jax.Array  # [S, pages_per_seq] int32
    logits_indices: jax.Array  # [S] int32, token row whose logits each sequence needs

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend {name!r} is not one of: {', '.join(BACKENDS)}")
    return name


def kv_cache_shape(
    backend: str, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    check_backend(backend)
    return get_kv_cache_shape(num_layers, num_pages, page_size, num_kv_heads, head_dim)


def write_kv(backend: str, kv_cache, layer, slot_mapping, k, v):
    check_backend(backend)
    return ref_write_kv(kv_cache, layer, slot_mapping, k, v)


def paged_attention(backend: str, q, kv_cache, layer, md: AttentionMetadata, sliding_window, *, sm_scale: float):
    check_backend(backend)
    return ref_ragged_paged_attention(
        q,
        kv_cache,
        layer,
        md.kv_lens,
        md.page_table,
        md.query_start_loc,
        sliding_window,
        sm_scale=sm_scale,
    )
