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
  Q4_0 (``d * (q - 8)``) and Q4_1 (``d * q + m``) are all int8 values with float16 block
  scales (and Q4_1's minimums), so no second rounding: the weight a matmul sees is the one
  llama.cpp's dequantization gives. 4-bit values are held one per int8 rather than packed
  two per byte: every backend's dot takes int8 operands, while int4 arrays are not
  supported on all of XLA's backends (CPU among them); the price is 1.125-1.25 bytes per
  weight instead of 0.56-0.625.

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
GGUF_NATIVE = ("Q8_0", "Q4_0", "Q4_1")  # GGUF types held as their own int8 blocks


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
    return Layout(GGUF_BLOCK, offset=qtype == "Q4_1", scale_dtype="float16", source=f"{qtype} blocks")


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
    value ``d * nibble + m``.
    """
    if qtype not in GGUF_NATIVE:
        raise ValueError(f"GGUF type {qtype} has no int8 block form (kept: {', '.join(GGUF_NATIVE)})")
    if k % GGUF_BLOCK:
        raise ValueError(f"a row of {k} is not a whole number of {GGUF_BLOCK}-element blocks")
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
