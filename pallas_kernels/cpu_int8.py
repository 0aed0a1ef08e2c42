"""Int8-weight matmuls on the CPU's AMX tiles (``quantization: int8``, ``cpu_int8.cc``).

``pack(q, scale, offset)`` lays one layer's int8 weight ``[K, N]`` and its float scales
(and offsets) out as one blob of bytes in the order the kernel reads (AMX pair order, 32 x
16 blocks); the model holds every layer's blob as one ``[L, bytes]`` uint8 array, and
``matmul(x, blobs, layer, ...)`` runs ``x @ w[layer]`` in an XLA FFI call that reads the
layer's blob in place and widens its int8 to bfloat16 tiles once per call.

Arithmetic: the same weights as XLA's path (``jaxserve.models.quant.int8_dot``, bfloat16
dots): per-column scales multiply the float32 result, group scales (GGUF blocks of 32)
rebuild ``bf16(q * scale + offset)``. Only the order of the float32 sums differs (the tile
unit's), and it is the same for every row whatever its batch.

Where the library has no AMX (or Linux refuses the tiles), :func:`available` is false and
XLA's dots serve.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build

TARGET = "jaxserve_int8_matmul"


@functools.cache
def available() -> bool:
    """Whether the kernel is built and AMX tiles are usable in this process."""
    lib = cpu_build.kernels().lib
    return lib is not None and bool(lib.JaxserveInt8Amx())


def fits(k: int, n: int, group: int) -> bool:
    """Whether the kernel takes a ``[k, n]`` weight with ``group`` rows per scale."""
    return k % 32 == 0 and n % 16 == 0 and group in (k, 32)


def blob_bytes(k: int, n: int, group: int, offset: bool) -> int:
    """Bytes of one layer's blob: the int8 values, then float32 scales (and offsets)."""
    if not fits(k, n, group):
        raise ValueError(f"the int8 kernel takes K % 32 == 0, N % 16 == 0, group K or 32; got {k}, {n}, {group}")
    groups = n if group == k else (k // 32) * n
    return k * n + 4 * groups * (2 if offset else 1)


def pack(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None = None) -> np.ndarray:
    """One layer's blob from int8 ``q [K, N]``, ``scale [G, N]`` and ``offset [G, N]`` (G = 1:
    per column; G = K / 32: per block of 32 rows)."""
    k, n = q.shape
    g = scale.shape[0]
    group = k // g
    blob = np.empty(blob_bytes(k, n, group, offset is not None), np.uint8)
    # [K, N] -> [N/16 blocks][K/32 chunks][16 pair rows][16 columns][2]
    tiles = q.reshape(k // 32, 16, 2, n // 16, 16).transpose(3, 0, 1, 4, 2)
    blob[: k * n] = np.ascontiguousarray(tiles).reshape(-1).view(np.uint8)
    parts = [scale] + ([offset] if offset is not None else [])
    at = k * n
    for part in parts:
        part = np.asarray(part, np.float32)
        if g > 1:  # [K/32, N] -> [N/16][K/32][16]
            part = part.reshape(g, n // 16, 16).transpose(1, 0, 2)
        data = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
        blob[at : at + data.size] = data
        at += data.size
    return blob


def matmul(x: jax.Array, blobs: jax.Array, layer: jax.Array | int, k: int, n: int, group: int, offset: bool):
    """``x [M, K] @ w[layer] [K, N]`` (float32 ``[M, N]``), ``x`` taken as bfloat16."""
    if not available():  # also what registers the FFI target
        raise RuntimeError("the int8 AMX kernel is not available here (no AMX, or the CPU kernels did not build)")
    m = x.shape[0]
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))(
        x.astype(jnp.bfloat16), blobs, jnp.asarray(layer, jnp.int32).reshape(()), group=np.int64(group), offset=offset
    )
