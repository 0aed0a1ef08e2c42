"""Ragged paged attention over one flat batch of prefill chunks and decodes.

``reference`` (pure JAX; the oracle), ``tpu`` (Pallas Mosaic kernels), ``gpu`` (Pallas
Triton kernels) and ``cpu`` (a C++ kernel through XLA's FFI) share one contract: ``write_kv`` / ``ref_write_kv``
and ``ragged_paged_attention`` / ``ref_ragged_paged_attention`` take the same arguments
and return the same outputs, over the layout each module's ``get_kv_cache_shape`` gives.
"""

from pallas_kernels.ragged_paged_attention import cpu, gpu, tpu
from pallas_kernels.ragged_paged_attention.common import BlockSizes
from pallas_kernels.ragged_paged_attention.reference import (
    get_kv_cache_shape,
    ref_ragged_paged_attention,
    ref_write_kv,
)

__all__ = ["BlockSizes", "cpu", "get_kv_cache_shape", "gpu", "ref_ragged_paged_attention", "ref_write_kv", "tpu"]
