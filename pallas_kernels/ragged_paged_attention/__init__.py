"""Ragged paged attention over one flat batch of prefill chunks and decodes."""

from pallas_kernels.ragged_paged_attention.reference import (
    get_kv_cache_shape,
    ref_ragged_paged_attention,
    ref_write_kv,
)

__all__ = ["get_kv_cache_shape", "ref_ragged_paged_attention", "ref_write_kv"]
