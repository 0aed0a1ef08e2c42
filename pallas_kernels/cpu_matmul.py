"""Linear layers on the CPU through oneDNN, with weights packed once at load.

``pack`` reorders a ``[K, N]`` weight into the blocked layout oneDNN's kernels read (AMX
tiles, AVX-512 VNNI pairs), as ``slices()`` column slices, one per core (narrower on the
plain GEMM oneDNN runs float32 with on AVX2); the model holds
every layer's packed bytes as one ``[L, bytes]`` uint8 array; ``matmul(x, packed, layer,
n, dtype)`` runs ``x @ w[layer]`` in an XLA FFI call that reads the layer's bytes in
place, each slice on one of XLA's intra-op threads (``cpu_threads.h``). XLA:CPU's own
dots instead get a plain weight on every call (and, inside the layer scan, a copy of each
layer's slice first): on a 2-core AMX CPU a chain of SmolLM2's MLP matmuls runs 2-4x
faster so at 8-32 rows and ~1.15x at 512. ``swiglu`` runs the MLP's gate|up weight the
same way and returns ``silu(gate) * up`` from the same call (``pack_swiglu``'s slices each
hold their gate and up columns).
A decode's calls (up to 32 rows) of bfloat16 weights on an AMX CPU run the kernel's own
tile loop over the same packed bytes instead of oneDNN's primitive: it gives oneDNN's bits
(checked per shape; ``uses_tiles``) and streams the weight faster. Without AMX, fewer
than 8 rows in use (a decode's) run alone where oneDNN's call of that many rows gives its
8-row call's bits (checked per row count and shape; ``rows_computed``): 8 rows is the
fewest at which the layout keeps a row's bits independent of the call.

The library is oneDNN's CPU build from PyPI (``onednn-cpu-gomp``, headers in
``onednn-devel-cpu-gomp``; x86-64 Linux), compiled against on first use with the other
CPU kernels (``pallas_kernels.cpu_build``). :func:`available` says whether that worked.
"""

from __future__ import annotations

import ctypes
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels import cpu_build

__all__ = [
    "DTYPES",
    "add_rms_norm",
    "available",
    "build_error",
    "impl",
    "join_slices",
    "matmul",
    "matmul_slices",
    "pack",
    "pack_swiglu",
    "packed_bytes",
    "prepare",
    "rms_norm",
    "slices",
    "swiglu",
    "swiglu_part",
    "swiglu_slices",
    "uses_tiles",
]

TARGET = "jaxserve_matmul"
SWIGLU_TARGET = "jaxserve_matmul_swiglu"
NORM_TARGET = "jaxserve_add_rms_norm"
DTYPES = ("float32", "bfloat16")  # weight dtypes; x is cast to the weight's dtype


@functools.cache
def _lib() -> tuple[ctypes.CDLL | None, str]:
    """The library with the matmul kernel's C entry points typed, or (None, why not)."""
    k = cpu_build.kernels()
    if k.matmul_error:
        return None, k.matmul_error
    lib = k.lib
    lib.JaxservePackedBytes.restype = ctypes.c_int64
    lib.JaxservePackedBytes.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.JaxservePack.restype = ctypes.c_int
    lib.JaxservePack.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    ]  # fmt: skip
    lib.JaxserveMatmulImpl.restype = ctypes.c_char_p
    lib.JaxserveMatmulImpl.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.JaxserveRowsComputed.restype = ctypes.c_int64
    lib.JaxserveRowsComputed.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_int]
    lib.JaxserveFewRowsChecks.restype = ctypes.c_int64
    lib.JaxserveFewRowsChecks.argtypes = []
    lib.JaxservePrimitivesBuilt.restype = ctypes.c_int64
    lib.JaxservePrimitivesBuilt.argtypes = []
    lib.JaxserveLayoutQueries.restype = ctypes.c_int64
    lib.JaxserveLayoutQueries.argtypes = []
    lib.JaxservePrepareRows.restype = ctypes.c_int
    lib.JaxservePrepareRows.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib.JaxserveLingerCheck.restype = ctypes.c_int
    lib.JaxserveLingerCheck.argtypes = []
    lib.JaxserveMatmulTiles.restype = ctypes.c_int
    lib.JaxserveMatmulTiles.argtypes = [ctypes.c_int64] * 3
    lib.JaxserveSwiGluPart.restype = ctypes.c_int64
    lib.JaxserveSwiGluPart.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_int]
    lib.JaxserveCheckOperandValues.restype = ctypes.c_int64
    lib.JaxserveCheckOperandValues.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.JaxserveLastError.restype = ctypes.c_char_p
    return lib, ""


@functools.cache
def _probe(dtype: str) -> str:
    """The implementation oneDNN picks for ``dtype`` weights here ("" if none)."""
    return _checked().JaxserveMatmulImpl(32, 64, 64, _is_f32(dtype)).decode()


@functools.cache
def _unavailable(dtype: str) -> str:
    """Why the kernel cannot run ``dtype`` weights fast here ("" if it can)."""
    lib, error = _lib()
    if lib is None:
        return error
    # Without AVX-512 (an AVX2 CPU) both weight types run on the kernel's own AVX2 loop
    # ("jaxserve:panels:f32" / ":bf16", cpu_panels.h); with JAXSERVE_CPU_PANELS=0 float32
    # runs oneDNN 3.2's AVX2 GEMM ("gemm:jit:f32") and bfloat16 has no matmul at all.
    probe = _probe(dtype)
    if not probe or probe.startswith("ref"):
        return f"oneDNN has no fast {dtype} matmul on this CPU ({probe or 'none'})"
    return ""


def available(dtype) -> bool:
    """Whether the kernel is built, registered and fast here for ``dtype`` weights (builds
    it on first call)."""
    return jnp.dtype(dtype).name in DTYPES and not _unavailable(jnp.dtype(dtype).name)


def own_loop(dtype) -> bool:
    """Whether ``dtype`` weights run on the kernel's own loop here (cpu_panels.h: CPUs
    without AVX-512, where oneDNN has only its plain GEMM for float32 and nothing for
    bfloat16), not on oneDNN."""
    return available(dtype) and _probe(jnp.dtype(dtype).name).startswith("jaxserve:panels")


def build_error(dtype) -> str:
    name = jnp.dtype(dtype).name
    return _unavailable(name) if name in DTYPES else f"weights are one of {', '.join(DTYPES)}, not {name}"


def _checked() -> ctypes.CDLL:
    lib, error = _lib()
    if lib is None:
        raise RuntimeError(error)
    return lib


def _is_f32(dtype) -> int:
    name = jnp.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"packed weights are one of {', '.join(DTYPES)}, not {name}")
    return int(name == "float32")


# Column slice width without AVX-512 (oneDNN's plain GEMM, or the kernel's own loop that
# replaces it there): at most this many.
GEMM_SLICE_WIDTH = 384


def slices(n: int, dtype) -> int:
    """Column slices an ``n``-wide ``dtype`` weight is packed as: the most, up to the
    kernels' thread count (the cores), that divide ``n``; on oneDNN's plain GEMM, slices
    of at most 384 columns (a multiple of 8), as many as a multiple of the cores. That GEMM
    streams its weight once per block of ~24 rows: a slice of 384 columns (0.9 MB at
    K = 576) comes again from the cache, the LM head's half (24,576 columns, 57 MB) from
    memory. On an AVX2 Zen 2 (2 cores) the 32-row LM head took 15-19 ms instead of 30, and
    offline throughput rose ~15%; narrower slices (256) cost a lone decode ~10% in calls.
    The kernel's own loop (cpu_panels.h) that runs there now likewise streams a slice once
    per block of rows (~54 at K = 576), so it keeps the same slices."""
    threads = cpu_build.threads()
    if (own_loop(dtype) or _probe(jnp.dtype(dtype).name).startswith("gemm")) and n > GEMM_SLICE_WIDTH:
        # A multiple of the cores: 3 slices on 2 cores would take 2 rounds for 1.5 slices' work.
        widths = [w for w in range(8, GEMM_SLICE_WIDTH + 1, 8) if n % w == 0 and (n // w) % threads == 0]
        if widths:
            return n // max(widths)
    return max(s for s in range(1, threads + 1) if n % s == 0)


def packed_bytes(k: int, n: int, dtype, num_slices: int | None = None) -> int:
    """Bytes of a packed ``[k, n]`` weight of ``dtype`` (as ``num_slices`` column slices;
    default ``slices(n, dtype)``)."""
    lib = _checked()
    size = lib.JaxservePackedBytes(k, n, num_slices or slices(n, dtype), _is_f32(dtype))
    if size < 0:
        raise RuntimeError(f"oneDNN: {lib.JaxserveLastError().decode()}")
    return size


def pack(w: np.ndarray, num_slices: int | None = None) -> np.ndarray:
    """A row-major ``[K, N]`` float32 or bfloat16 weight in oneDNN's layout (uint8 bytes),
    as ``num_slices`` column slices (default ``slices(N, dtype)``)."""
    lib = _checked()
    if w.ndim != 2:
        raise ValueError(f"a weight to pack is [K, N], got shape {w.shape}")
    f32 = _is_f32(w.dtype)
    w = np.ascontiguousarray(w)
    k, n = w.shape
    s = num_slices or slices(n, w.dtype)
    out = np.empty(packed_bytes(k, n, w.dtype, s), np.uint8)
    if lib.JaxservePack(w.ctypes.data, k, n, s, f32, out.ctypes.data) != 0:
        raise RuntimeError(f"oneDNN: {lib.JaxserveLastError().decode()}")
    return out


def swiglu_slices(i: int, dtype) -> int:
    """Column slices of a SwiGLU weight with ``i`` outputs (``pack_swiglu``): as for an
    ``i``-wide weight, each slice then holding its gate and its up columns."""
    return slices(i, dtype)


def pack_swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``gate`` and ``up`` (``[K, I]`` each) packed for ``swiglu``: slice ``s`` is
    ``[gate | up]`` of the same ``I / slices`` columns, so the call that multiplies a slice
    also has both halves of its SwiGLU (``packed_bytes(K, 2 * I, dtype, swiglu_slices(I))``)."""
    if gate.shape != up.shape or gate.ndim != 2:
        raise ValueError(f"gate and up are [K, I] alike, got shapes {gate.shape} and {up.shape}")
    k, i = gate.shape
    s = swiglu_slices(i, gate.dtype)
    w = i // s
    halves = [h for j in range(s) for h in (gate[:, j * w : (j + 1) * w], up[:, j * w : (j + 1) * w])]
    return pack(np.concatenate(halves, axis=1), s)


def impl(m: int, k: int, n: int, dtype) -> str:
    """The oneDNN implementation that runs ``m`` rows of one slice (``brg:avx512_core_amx``...)."""
    return _checked().JaxserveMatmulImpl(m, k, n // slices(n, dtype), _is_f32(dtype)).decode()


def uses_tiles(m: int, k: int, n: int) -> bool:
    """Whether ``m``-row calls on one slice of an ``n``-wide bfloat16 ``[k, n]`` weight run
    on the kernel's own AMX loop (a decode's few rows: oneDNN's bits, checked once per
    shape, streamed faster) instead of oneDNN's primitive."""
    lib = _checked()
    used = lib.JaxserveMatmulTiles(m, k, n // slices(n, "bfloat16"))
    if used < 0:
        raise RuntimeError(f"oneDNN: {lib.JaxserveLastError().decode()}")
    return bool(used)


def check_operand_values(m: int, k: int, n: int, dtype) -> int:
    """Distinct values among the pseudo-random operands of the kernel's per-shape bit checks
    for ``m``-row calls on one ``[k, n]`` slice (bfloat16 patterns; float32's upper halves)."""
    values = _checked().JaxserveCheckOperandValues(m, k, n, _is_f32(dtype))
    if values < 0:
        raise RuntimeError(f"oneDNN: {_checked().JaxserveLastError().decode()}")
    return int(values)


def swiglu_part(m: int, k: int, i: int, dtype) -> int:
    """Columns of a slice that one work item of an ``m``-row ``swiglu`` call multiplies: all
    of the slice's ``i / swiglu_slices(i)``, or, for calls whose products would not stay in
    the core's cache, a part that oneDNN computes bitwise as the whole (cpu_matmul.cc)."""
    lib = _checked()
    part = lib.JaxserveSwiGluPart(m, k, i, swiglu_slices(i, dtype), _is_f32(dtype))
    if part < 0:
        raise RuntimeError(f"oneDNN: {lib.JaxserveLastError().decode()}")
    return int(part)


def rows_computed(rows: int, m: int, k: int, n: int, dtype) -> int:
    """Rows an ``m``-row call on a ``[k, n]`` weight computes when only the first ``rows``
    are in use (cpu_matmul.cc: RowsComputed): ``rows`` itself on the kernel's own loop (no
    AVX-512: cpu_panels.h); on oneDNN, ``rows`` rounded up to a multiple of 8 (32 on
    its plain GEMM), at most ``m``, or ``rows`` itself below 8 where oneDNN gives that many
    rows its 8-row call's bits (not on AMX's tiles, nor on the plain GEMM); all ``m`` where
    ``rows`` is out of range."""
    lib = _checked()
    done = lib.JaxserveRowsComputed(rows, m, k, n // slices(n, dtype), _is_f32(dtype))
    if done < 0:
        raise RuntimeError(f"oneDNN: {lib.JaxserveLastError().decode()}")
    return int(done)


def prepare(m: int, k: int, n: int, dtype, swiglu: bool = False) -> None:
    """Builds now, for calls of ``m`` rows (a bucket) with any number of them in use, what
    such calls build on first use: oneDNN's primitive per count of rows computed
    (``rows_computed``) and the kernel's checks, ~2-8 ms a count for SmolLM2's layers on a
    2-core AMX CPU, which a step would otherwise wait for. ``[k, n]``: a ``matmul``
    weight, or with ``swiglu`` a ``swiglu`` one of ``n`` outputs (``pack_swiglu``)."""
    lib = _checked()
    s = swiglu_slices(n, dtype) if swiglu else slices(n, dtype)
    if lib.JaxservePrepareRows(m, k, n // s, _is_f32(dtype), int(swiglu)) != 0:
        raise RuntimeError(f"oneDNN: {lib.JaxserveLastError().decode()}")


def few_rows_checks() -> int:
    """How many slice shapes have had the per-shape check that decides whether fewer than 8
    rows in use run alone (``rows_computed``) in this process: a model's warm-up does them
    all, so no request waits for one."""
    return int(_checked().JaxserveFewRowsChecks())


def primitives_built() -> int:
    """How many of the kernel's primitives (one per row count computed, slice shape and
    weight dtype, built on a call's first use of them) this process has built: a model's
    warm-up builds those of every step size (``prepare``), so no request waits for one."""
    return int(_checked().JaxservePrimitivesBuilt())


def layout_queries() -> int:
    """How many times this process has asked oneDNN for a packed layout (a matmul
    descriptor built, ~10 us each): a shape's first calls do, later ones reuse the answer."""
    return int(_checked().JaxserveLayoutQueries())


def linger_check() -> int:
    """The kernel library's own check that a helper thread lingering after a call takes the
    next call's work (cpu_threads.h): 0, or the number of the step that failed."""
    return int(_checked().JaxserveLingerCheck())


def _rows_in_use(rows: jax.Array | int | None, m: int) -> jax.Array:
    """The calls' ``rows`` operand: how many leading rows hold tokens (the rest pad a token
    bucket: computed as zeros); all ``m`` where None."""
    return jnp.asarray(m if rows is None else rows, jnp.int32).reshape(())


def matmul(
    x: jax.Array, packed: jax.Array, layer: jax.Array | int, n: int, dtype, rows: jax.Array | int | None = None
) -> jax.Array:
    """``x [M, K] @ w[layer] [K, N]`` accumulated in float32 (``[M, N]``), where ``packed``
    is ``[L, bytes]``: each layer's ``pack`` of a ``dtype`` weight. With ``rows``, only the
    first ``rows`` rows (``rows_computed``) are computed and the rest are zero."""
    out = join_slices(matmul_slices(x.reshape(-1, x.shape[-1]), packed, layer, n, dtype, rows))
    return out.reshape(*x.shape[:-1], n)


def matmul_slices(
    x: jax.Array, packed: jax.Array, layer: jax.Array | int, n: int, dtype, rows: jax.Array | int | None = None
) -> jax.Array:
    """``matmul`` of ``x [M, K]`` as the kernel stores it: ``[slices, M, N / slices]``, each
    column slice's product dense (``join_slices`` makes it ``[M, N]``)."""
    _checked()
    dtype = ml_dtypes.bfloat16 if jnp.dtype(dtype).name == "bfloat16" else jnp.float32
    m = x.shape[0]
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(slices_shape(m, n, dtype), jnp.float32))(
        x.astype(dtype), packed, jnp.asarray(layer, jnp.int32).reshape(()), _rows_in_use(rows, m)
    )


def slices_shape(m: int, n: int, dtype) -> tuple[int, int, int]:
    """The shape ``matmul_slices`` gives an ``[M, N]`` product of an ``n``-wide ``dtype``
    weight: ``[slices, M, N / slices]``."""
    s = slices(n, dtype)
    return s, m, n // s


def join_slices(out: jax.Array) -> jax.Array:
    """``[slices, M, N / slices]`` -> ``[M, N]``: each slice's columns, side by side."""
    s, m, w = out.shape
    return out.transpose(1, 0, 2).reshape(m, s * w)


def swiglu(
    x: jax.Array, packed: jax.Array, layer: jax.Array | int, i: int, dtype, rows: jax.Array | int | None = None
) -> jax.Array:
    """``silu(x @ gate) * (x @ up)``, ``[M, I]`` in ``dtype`` (the weights' dtype, which the
    next matmul reads), where ``packed`` is ``[L, bytes]``: each layer's ``pack_swiglu``.
    One call computes each block of rows' gate and up and their product while they are in
    the cache: XLA's SiLU fusion read the matmul's float32 output back from memory (~8% of
    a 500-token prefill on a 2-core AMX CPU)."""
    _checked()
    dtype = jnp.bfloat16 if jnp.dtype(dtype).name == "bfloat16" else jnp.float32
    m = math.prod(x.shape[:-1])
    out = jax.ffi.ffi_call(SWIGLU_TARGET, jax.ShapeDtypeStruct((m, i), dtype))(
        x.reshape(m, x.shape[-1]).astype(dtype),
        packed,
        jnp.asarray(layer, jnp.int32).reshape(()),
        _rows_in_use(rows, m),
        slices=np.int64(swiglu_slices(i, dtype)),
    )
    return out.reshape(*x.shape[:-1], i)


def add_rms_norm(
    x: jax.Array, y: jax.Array | None, weight: jax.Array, eps: float, dtype
) -> tuple[jax.Array, jax.Array]:
    """``x + join_slices(y)`` (x where y is None) and its RMSNorm, ``weight * (x *
    rsqrt(mean(x * x) + eps))`` in ``dtype`` (a matmul's weights': the next call reads it),
    from one pass over the rows: x ``[M, E]`` float32, y ``[slices, M, E / slices]`` as
    ``matmul_slices`` returns it."""
    _checked()
    m, e = x.shape
    dtype = jnp.bfloat16 if jnp.dtype(dtype).name == "bfloat16" else jnp.float32
    rows = m if y is not None else 0
    total, h = jax.ffi.ffi_call(
        NORM_TARGET, (jax.ShapeDtypeStruct((rows, e), jnp.float32), jax.ShapeDtypeStruct((m, e), dtype))
    )(
        x.astype(jnp.float32),
        jnp.zeros((0, m, e), jnp.float32) if y is None else y,
        weight.astype(jnp.float32),
        eps=np.float32(eps),
    )
    return (x if y is None else total), h


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype) -> jax.Array:
    """``add_rms_norm`` of x alone: its RMSNorm in ``dtype``."""
    return add_rms_norm(x, None, weight, eps, dtype)[1]
