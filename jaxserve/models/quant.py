"""Int8 weights (``quantization: int8``): how a checkpoint's linear weights are held, and
the arithmetic that turns them back into a matmul.

A quantized ``[K, N]`` weight is three arrays per layer:

- ``q``: int8 ``[K, N]``;
- ``scale``: ``[G, N]``, one per output column and group of ``K / G`` input rows;
- ``offset`` (only where the source is affine): ``[G, N]``, added after scaling.

so ``w[k, n] = q[k, n] * scale[k // (K / G), n] (+ offset[...])``. Two layouts come out of
a checkpoint (:class:`Layout`):

- **per output channel** (``G = 1``, no offset), quantized here from float weights
  (Hugging Face checkpoints; GGUF types without a native form): ``scale = max |w[:, n]| /
  127``. The scale is applied to the dot's float32 result, ``(x @ q) * scale``, exact
  algebra: the weight itself is never widened beyond int8 -> the compute dtype.
- **GGUF blocks of 32** (``G = K / 32``), kept as the file has them: Q8_0 (``d * q``),
  Q4_0 (``d * (q - 8)``), Q4_1 (``d * q + m``) and Q4_K (``d * sc * q - dmin * m`` per
  32 of a 256-value super-block) are all int8 values with block scales (float16 as stored;
  float32 for Q4_K's products) and minimums, so no second rounding: the weight a matmul
  sees is the one llama.cpp's dequantization gives. 4-bit values are held one per int8
  rather than packed two per byte: every backend's dot takes int8 operands, while int4
  arrays are not supported on all of XLA's backends (CPU among them); the price is
  1.06-1.25 bytes per weight instead of 0.56-0.75. Q6_K (blocks of 16) and other types
  are requantized per channel.

Embeddings and the LM head stay in ``dtype`` / ``weight_dtype``: the lookup reads a few
rows, and the head's logits are where rounding shows first.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

QUANTIZATIONS = ("int8",)
GGUF_BLOCK = 32  # elements per block of the GGUF types kept as blocks
GGUF_NATIVE = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")  # GGUF types held as their own int8 blocks
GGUF_ROW_MULTIPLE = {"Q4_K": 256}  # a row of a K-quant is whole super-blocks


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one weight (the same for every layer) is quantized.

    Attributes:
        group: input rows per scale (``K`` for per-output-channel scales).
        offset: whether an offset is added after scaling (GGUF Q4_1's minimums).
        scale_dtype: of scales and offsets (float32 computed here; float16 as GGUF stores them).
        source: what it came from, for the load report ("per-channel", "Q4_1 blocks").
    """

    group: int
    offset: bool = False
    scale_dtype: str = "float32"
    source: str = "per-channel"

    def groups(self, k: int) -> int:
        return k // self.group


def per_channel_layout(k: int) -> Layout:
    return Layout(group=k)


def gguf_layout(qtype: str) -> Layout:
    # Q4_K's scales are products (a float16 super-block scale times a 6-bit one): float32.
    scale_dtype = "float32" if qtype == "Q4_K" else "float16"
    return Layout(GGUF_BLOCK, offset=qtype in ("Q4_1", "Q4_K"), scale_dtype=scale_dtype, source=f"{qtype} blocks")


def quantize_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float ``[K, N]`` weight as int8 ``[K, N]`` and float32 scales ``[1, N]``:
    symmetric, round to nearest, ``scale = max |w[:, n]| / 127`` (1 for an all-zero column)."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=0, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def gguf_blocks(data: np.ndarray, qtype: str, rows: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A GGUF tensor's raw blocks as ``(q int8 [rows, k], scale float16 [rows, k / 32],
    offset float16 [rows, k / 32] or None)``, in the file's ``[out, in]`` order.

    Block formats (ggml): Q8_0 is ``d`` (float16) then 32 int8 values; Q4_0 ``d`` then 16
    bytes, element ``i`` in the low nibble of byte ``i`` and element ``16 + i`` in its high
    nibble, value ``nibble - 8``; Q4_1 ``d``, ``m`` (float16), then the same nibbles,
    value ``d * nibble + m``. Q4_K: :func:`_q4_k_blocks`.
    """
    if qtype not in GGUF_NATIVE:
        raise ValueError(f"GGUF type {qtype} has no int8 block form (kept: {', '.join(GGUF_NATIVE)})")
    multiple = GGUF_ROW_MULTIPLE.get(qtype, GGUF_BLOCK)
    if k % multiple:
        raise ValueError(f"a row of {k} is not a whole number of {multiple}-element blocks")
    if qtype == "Q4_K":
        return _q4_k_blocks(np.ascontiguousarray(data).view(np.uint8).reshape(rows, k // 256, 144), rows, k)
    head = 4 if qtype == "Q4_1" else 2  # bytes of float16 fields before the values
    size = head + (GGUF_BLOCK if qtype == "Q8_0" else GGUF_BLOCK // 2)
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(rows, k // GGUF_BLOCK, size)
    scale = blocks[..., :2].copy().view(np.float16)[..., 0]
    offset = blocks[..., 2:4].copy().view(np.float16)[..., 0] if qtype == "Q4_1" else None
    values = blocks[..., head:]
    if qtype == "Q8_0":
        q = values.view(np.int8)
    else:
        q = np.concatenate([values & 0x0F, values >> 4], axis=-1).astype(np.int8)
        if qtype == "Q4_0":
            q -= 8
    return q.reshape(rows, k), scale, offset


def _q4_k_blocks(blocks: np.ndarray, rows: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks (144 bytes: ``d``, ``dmin`` float16, 12 bytes of 6-bit scales and
    minimums for its 8 blocks of 32, 128 bytes of nibbles) as int8 values, float32 scales
    ``d * sc`` and offsets ``-(dmin * m)``: ``value = nibble * scale + offset``, the two
    roundings of ggml's ``d * sc * nibble - dmin * m``.

    The 12 bytes hold, for blocks 0-3, the low 6 bits of scale (bytes 0-3) and minimum
    (bytes 4-7); for blocks 4-7, the low 4 bits in bytes 8-11 (scale low nibble, minimum
    high nibble) and the top 2 bits in the top 2 bits of bytes 0-3 (scale) and 4-7
    (minimum). Nibbles: 4 runs of 32 bytes, block 2j in a run's low nibbles, 2j + 1 in its
    high ones.
    """
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    lo, mid, top = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = np.concatenate([lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    scale = d[..., None] * sc.astype(np.float32)  # [rows, super-blocks, 8]
    offset = -(dmin[..., None] * mins.astype(np.float32))
    runs = blocks[..., 16:].reshape(rows, k // 256, 4, 1, 32)
    q = ((runs >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F).astype(np.int8)
    return q.reshape(rows, k), scale.reshape(rows, k // 32), offset.reshape(rows, k // 32)


def dequantize(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None = None) -> np.ndarray:
    """The float32 weight ``[K, N]`` that ``q``, ``scale`` (and ``offset``) stand for (numpy;
    tests and reports)."""
    k, n = q.shape
    g = scale.shape[0]
    w = q.reshape(g, k // g, n).astype(np.float32) * scale.astype(np.float32)[:, None, :]
    if offset is not None:
        w = w + offset.astype(np.float32)[:, None, :]
    return w.reshape(k, n)


def int8_dot(x: jax.Array, q: jax.Array, scale: jax.Array, offset: jax.Array | None, dtype, dot) -> jax.Array:
    """``x @ w`` for a quantized ``w`` (float32 result), with ``dot(x, w)`` the model's dot
    in the compute ``dtype``.

    Per-output-channel scales multiply the dot's result (``x @ (q * s) == (x @ q) * s``):
    the int8 weight widens only to ``dtype``, which XLA fuses into the dot's operand on
    accelerators. Group scales vary along the contraction, so the weight is rebuilt first,
    in float32 (exactly the GGUF dequantization), then rounded to ``dtype``.
    """
    k, n = q.shape
    g = scale.shape[0]
    if g == 1 and offset is None:
        return dot(x, q.astype(dtype)) * scale[0].astype(jnp.float32)
    w = q.reshape(g, k // g, n).astype(jnp.float32) * scale[:, None, :].astype(jnp.float32)
    if offset is not None:
        w = w + offset[:, None, :].astype(jnp.float32)
    return dot(x, w.reshape(k, n).astype(dtype))


@dataclasses.dataclass(frozen=True)
class Int8Weights:
    """The model's int8 linear weights: each one's layout (by parameter name) and the
    dtype the dot computes in (``weight_dtype``). Hashable: it is static model structure."""

    layouts: tuple[tuple[str, Layout], ...]
    compute_dtype: str

    def layout(self, name: str) -> Layout:
        return dict(self.layouts)[name]

    def report(self) -> str:
        """What start-up prints: each source of layouts and the weights it covers."""
        by_source: dict[str, list[str]] = {}
        for name, layout in self.layouts:
            by_source.setdefault(layout.source, []).append(name)
        parts = [f"{source} ({', '.join(names)})" for source, names in by_source.items()]
        return f"int8 layer weights, {'; '.join(parts)}; dots in {self.compute_dtype}"
