"""The attention backend interface the model calls, and the batch metadata it reads.

One flat ragged batch per step: decodes (one token each) and prefill chunks side by
side. The runner builds an :class:`AttentionMetadata`; the model writes each new
token's K/V through ``slot_mapping`` and attends over ``page_table`` / ``kv_lens``.

Backends (``attention_backend``):

- ``reference``: pure JAX (``pallas_kernels/ragged_paged_attention/reference.py``); the
  oracle, and the fallback anywhere.
- ``pallas_tpu``: Pallas Mosaic kernels (``.../tpu.py``).
- ``pallas_gpu``: Pallas Triton kernels (``.../gpu.py``).
- ``cpu``: a C++ kernel through XLA's FFI (``.../cpu.py``), compiled on first use.
- ``auto``: ``pallas_tpu`` on TPU, ``pallas_gpu`` on GPU, ``cpu`` on CPU (``reference``
  when the C++ kernel cannot be built).

The Pallas backends run on CPU only in interpret mode (``attention_interpret``), which
is how CI checks them. Each backend owns its KV layout (``kv_cache_shape``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.parallel import MODEL
from pallas_kernels.ragged_paged_attention import BlockSizes, cpu, gpu, reference, tpu
from pallas_kernels.ragged_paged_attention.common import (
    QkvProduct,
    QuantizedKV,
    is_quantized,
    kv_cache_bytes,
    new_kv_cache,
)

BACKENDS = ("auto", "reference", "pallas_tpu", "pallas_gpu", "cpu")
_KERNELS = {"pallas_tpu": tpu, "pallas_gpu": gpu, "cpu": cpu}
_PLATFORM_BACKEND = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "cpu": "cpu"}


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
    # [] int32: how many leading entries of logits_indices are in use (the step's sequences;
    # the rest pad S), so the LM head can skip the padding's rows; None: all of them
    num_logits: jax.Array | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def logits_rows(self) -> AttentionMetadata:
        """The step's attention for the rows whose logits it needs only (logits_indices):
        each row a one-token query of its own sequence at its own position, what a decode
        of it would be; the entries past num_logits are empty. A model's last layer needs
        no other row's output (LlamaForCausalLM), and the CPU kernel computes a token's
        output bit for bit alike however it is batched (decode or prefill chunk)."""
        rows = self.logits_indices
        s = rows.shape[0]
        used = s if self.num_logits is None else self.num_logits
        # Each row's sequence: how many sequences end at or before the row (a twin or a
        # padding slot has no tokens: it ends where the next sequence starts).
        seq = jnp.sum(self.query_start_loc[1:][None, :] <= rows[:, None], axis=1)
        live = jnp.arange(s) < used
        i32 = jnp.int32
        return AttentionMetadata(
            input_ids=self.input_ids[rows],
            positions=self.positions[rows],
            slot_mapping=self.slot_mapping[rows],
            query_start_loc=jnp.minimum(jnp.arange(s + 1), used).astype(i32),
            kv_lens=jnp.where(live, self.positions[rows] + 1, 0).astype(i32),
            page_table=self.page_table[jnp.minimum(seq, s - 1)],
            logits_indices=jnp.arange(s, dtype=i32),
            num_logits=self.num_logits,
        )


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """A resolved backend: hashable, so the jitted step closes over it as a constant.

    Attributes:
        name: ``reference``, ``pallas_tpu`` or ``pallas_gpu``.
        interpret: run the Pallas kernels in interpret mode (CPU testing).
        block_sizes: the kernels' tiling.
        mesh: with tensor parallelism, the device mesh: the KV write and attention then
            run per shard of KV heads (``shard_map`` over the ``model`` axis).
    """

    name: str = "reference"
    interpret: bool = False
    block_sizes: BlockSizes = BlockSizes()
    mesh: Mesh | None = None

    @classmethod
    def resolve(
        cls,
        name: str,
        *,
        page_size: int,
        interpret: bool = False,
        platform: str | None = None,
        mesh: Mesh | None = None,
    ):
        """Picks the backend for ``name`` on ``platform`` (default: JAX's default backend).

        Raises:
            ValueError: an unknown name, or a Pallas backend on a platform it cannot run
                on without ``interpret``.
        """
        if name not in BACKENDS:
            raise ValueError(f"attention_backend {name!r} is not one of: {', '.join(BACKENDS)}")
        platform = platform or jax.default_backend()
        if name == "auto":
            name = _PLATFORM_BACKEND.get(platform, "reference")
            if name == "cpu" and not cpu.available():
                name = "reference"
        if name == "reference":
            return cls("reference", False, BlockSizes(), mesh)
        if name == "cpu":
            if platform != "cpu":
                raise ValueError(f"attention_backend 'cpu' runs on the CPU only, but JAX's platform is {platform!r}")
            if not cpu.available():
                raise ValueError(f"attention_backend 'cpu': {cpu.build_error()}; use attention_backend: reference")
            return cls("cpu", False, BlockSizes(), mesh)
        needs = "tpu" if name == "pallas_tpu" else "gpu"
        if not interpret and _PLATFORM_BACKEND.get(platform) != name:
            raise ValueError(
                f"attention_backend {name!r} needs a {needs.upper()}, but JAX's platform is {platform!r}; "
                f"use attention_backend: reference or auto, or attention_interpret: true to run the "
                f"kernels in interpret mode (slow; for testing)"
            )
        # One KV block = 128 tokens; query tiles of about 128 (TPU) / 64 (GPU) rows.
        block_pages = max(1, 128 // page_size)
        return cls(name, interpret, BlockSizes(block_q=16, block_pages=block_pages), mesh)

    def kv_cache_shape(
        self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        mod = _KERNELS.get(self.name, reference)
        return mod.get_kv_cache_shape(num_layers, num_pages, page_size, num_kv_heads, head_dim)

    def kv_storage_dtype(self, kv_dtype) -> jnp.dtype:
        """The array dtype holding a ``kv_dtype`` cache (the reference keeps bfloat16 as bits)."""
        return reference.storage_dtype(kv_dtype) if self.name in ("reference", "cpu") else jnp.dtype(kv_dtype)

    def page_size_error(self, page_size: int, kv_dtype) -> str | None:
        """Why ``page_size`` cannot hold a ``kv_dtype`` cache here, or None. The TPU kernels
        move pages as whole memory tiles: 8 rows of 32-bit words, 16 of bfloat16, 32 of an
        8-bit dtype (a smaller page would be padded to a tile in HBM anyway)."""
        if self.name != "pallas_tpu":
            return None
        rows = tpu.tile_rows(self.kv_storage_dtype(kv_dtype))
        if page_size % rows == 0:
            return None
        return (
            f"page_size = {page_size}: attention_backend 'pallas_tpu' needs a multiple of {rows} for a "
            f"{jnp.dtype(kv_dtype).name} KV cache (one TPU memory tile of it); use page_size "
            f"{', '.join(str(n) for n in (8, 16, 32, 64, 128) if n % rows == 0)}"
        )

    def pages_multiple(self, kv_dtype) -> int:
        """What the page count must be a multiple of: on TPU an 8-bit cache's scales
        ``[..., num_pages, lanes]`` take XLA's default layout (the one the kernels read)
        only when num_pages fills whole 8-sublane tiles; otherwise XLA's TPU compiler lays
        the array out with another dim second-minor, and copies it whole into the kernels'
        layout at every call."""
        return tpu.SUBLANES if self.name == "pallas_tpu" and is_quantized(kv_dtype) else 1

    def scale_lanes(self, page_size: int) -> int:
        """Lanes of a page's row of scales in an 8-bit cache (``common.scales_shape``)."""
        return tpu.scale_lanes(page_size) if self.name == "pallas_tpu" else page_size

    def new_kv_cache(self, shape: tuple[int, ...], kv_dtype) -> jax.Array | QuantizedKV:
        """A zeroed cache of ``shape`` (``kv_cache_shape``) holding ``kv_dtype``."""
        return new_kv_cache(shape, self.kv_storage_dtype(kv_dtype), self.scale_lanes(shape[3]))

    def kv_bytes_per_page(self, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, kv_dtype):
        """Bytes one page takes across all layers and heads, padding and scales included."""
        shape = self.kv_cache_shape(num_layers, 2, page_size, num_kv_heads, head_dim)
        return kv_cache_bytes(shape, self.kv_storage_dtype(kv_dtype), self.scale_lanes(page_size)) // 2

    def write_kv(self, kv_cache, layer, slot_mapping, k, v):
        if self.name == "reference":
            return reference.ref_write_kv(kv_cache, layer, slot_mapping, k, v)
        return _KERNELS[self.name].write_kv(kv_cache, layer, slot_mapping, k, v, interpret=self.interpret)

    @property
    def reads_products(self) -> bool:
        """Whether ``write_and_attend_product`` takes a QkvProduct as it is (the CPU kernel
        on one device); elsewhere q, k and v are materialized first."""
        return self.name == "cpu" and self.mesh is None

    def write_and_attend_product(
        self,
        qkv: QkvProduct,
        kv_cache,
        layer,
        md: AttentionMetadata,
        sliding_window,
        *,
        sm_scale: float,
        out_dtype=None,
        logits_rows_only: bool = False,
    ):
        """``write_and_attend`` of a layer's unrotated qkv product (``QkvProduct``), with
        ``logits_rows_only`` as there."""
        if self.reads_products:
            args = (qkv, kv_cache, layer, md.slot_mapping, md.kv_lens, md.page_table, md.query_start_loc)
            if not logits_rows_only:
                return cpu.write_and_attend(*args, sliding_window, sm_scale=sm_scale, out_dtype=out_dtype)
            # Every token's K and V, the same bits as above; then the logits rows' q from the product.
            kv_cache = cpu.write_kv_product(*args)
            rows = md.logits_indices
            q = QkvProduct(qkv.product[:, rows], qkv.cos[rows], qkv.sin[rows], qkv.num_heads, qkv.num_kv_heads)
            out = self.attention(
                q, kv_cache, layer, md.logits_rows(), sliding_window, sm_scale=sm_scale, out_dtype=out_dtype
            )
            return out, kv_cache
        k, v = qkv.keys_values()
        return self.write_and_attend(
            qkv.query(),
            k,
            v,
            kv_cache,
            layer,
            md,
            sliding_window,
            sm_scale=sm_scale,
            out_dtype=out_dtype,
            logits_rows_only=logits_rows_only,
        )

    def write_and_attend(
        self,
        q,
        k,
        v,
        kv_cache,
        layer,
        md: AttentionMetadata,
        sliding_window,
        *,
        sm_scale: float,
        out_dtype=None,
        logits_rows_only: bool = False,
    ):
        """Writes this step's K/V, then attends. Returns (output [T, Hq, D] in ``out_dtype``,
        default q's, and kv_cache); with ``logits_rows_only``, every token's K/V is written
        but only the rows of ``md.logits_indices`` attend (``md.logits_rows()``): output
        [S, Hq, D].

        With a mesh, each device runs both on its own KV heads and query heads; the
        metadata is replicated. No communication happens inside attention.
        """

        def local(q, k, v, kv_cache, layer, md, sliding_window):
            kv_cache = self.write_kv(kv_cache, layer, md.slot_mapping, k, v)
            if logits_rows_only:
                q, md = q[md.logits_indices], md.logits_rows()
            out = self.attention(q, kv_cache, layer, md, sliding_window, sm_scale=sm_scale, out_dtype=out_dtype)
            return out, kv_cache

        if self.mesh is None:
            return local(q, k, v, kv_cache, layer, md, sliding_window)
        heads = P(None, MODEL, None)
        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(heads, heads, heads, P(MODEL), P(), P(), P()),
            out_specs=(heads, P(MODEL)),
            check_vma=False,
        )(q, k, v, kv_cache, layer, md, sliding_window)

    def attention(self, q, kv_cache, layer, md: AttentionMetadata, sliding_window, *, sm_scale: float, out_dtype=None):
        """Attention output [T, Hq, D] in ``out_dtype`` (default q's): the CPU kernel stores
        bfloat16 itself, the others' output is cast."""
        args = (q, kv_cache, layer, md.kv_lens, md.page_table, md.query_start_loc, sliding_window)
        if self.name == "cpu":
            return cpu.ragged_paged_attention(*args, sm_scale=sm_scale, out_dtype=out_dtype)
        if self.name == "reference":
            out = reference.ref_ragged_paged_attention(*args, sm_scale=sm_scale, block_sizes=self.block_sizes)
        else:
            out = _KERNELS[self.name].ragged_paged_attention(
                *args, sm_scale=sm_scale, block_sizes=self.block_sizes, interpret=self.interpret
            )
        return out.astype(out_dtype or out.dtype)


REFERENCE = AttentionBackend()
