"""Ragged paged attention on the CPU: a C++ kernel (``cpu_kernel.cc``) called through
XLA's FFI, for the decode and prefill attention that XLA:CPU runs slowly in pure JAX
(its gathers and tiny batched matmuls cost ~0.5 ns per element; see the README's
Performance section).

Same contract and KV layout as ``reference.py``; the KV write is the reference's XLA
scatter, and a bfloat16 cache is held as its bits (``reference.storage_dtype``).

The kernel is compiled on first use with the machine's C++ compiler (``$CXX`` or
``c++``; ``-O3 -march=native``) against the FFI headers jaxlib ships, and cached under
``~/.cache/jaxserve/kernels`` keyed by the source, the compiler flags, jaxlib's version
and the CPU's feature flags. :func:`available` says whether that worked;
``attention_backend: auto`` falls back to the reference when it did not.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from pallas_kernels.ragged_paged_attention.common import DEFAULT_BLOCK_SIZES, BlockSizes, check_attention_inputs
from pallas_kernels.ragged_paged_attention.reference import get_kv_cache_shape, ref_write_kv, storage_dtype

__all__ = [
    "KV_DTYPES",
    "available",
    "build_error",
    "get_kv_cache_shape",
    "ragged_paged_attention",
    "storage_dtype",
    "write_kv",
]

log = logging.getLogger(__name__)

KV_DTYPES = ("float32", "bfloat16")  # the cache dtypes the kernel reads (bfloat16 as bits)
SOURCE = pathlib.Path(__file__).with_name("cpu_kernel.cc")
TARGET = "jaxserve_ragged_paged_attention"
# -ffp-contract=off: no fused multiply-adds, so a vectorized loop and its scalar
# remainder round alike and a token's output never depends on where its row falls.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-std=c++17"]


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "jaxserve" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@functools.cache
def _build() -> tuple[bool, str]:
    """Compiles (or finds the cached) kernel library and registers it with XLA, once per
    process. Returns (ok, why not)."""
    try:
        ok, error = _compile_and_register()
    except (OSError, subprocess.SubprocessError) as e:  # unwritable cache, unloadable library...
        ok, error = False, f"{type(e).__name__}: {e}"
    if not ok:
        log.warning("CPU attention kernel unavailable (attention_backend auto uses the reference): %s", error)
    return ok, error


def _compile_and_register() -> tuple[bool, str]:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        return False, "no C++ compiler found (set $CXX or install g++)"
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join([compiler, *FLAGS]), jaxlib.__version__, _cpu_flags()):
        key.update(part if isinstance(part, bytes) else part.encode())
    library = _cache_dir() / f"ragged_paged_attention_{key.hexdigest()[:16]}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            out = pathlib.Path(tmp) / library.name
            cmd = [
                compiler,
                *FLAGS,
                "-shared",
                "-fPIC",
                f"-I{jax.ffi.include_dir()}",
                str(SOURCE),
                "-o",
                str(out),
                "-pthread",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                return False, f"compiling {SOURCE.name} failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}"
            os.replace(out, library)  # atomic: concurrent builders both end with a whole file
    lib = ctypes.cdll.LoadLibrary(str(library))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxserveRaggedPagedAttention), platform="cpu")
    return True, ""


def available() -> bool:
    """Whether the kernel is built and registered (builds it on first call)."""
    return _build()[0]


def build_error() -> str:
    return _build()[1]


def write_kv(kv_cache, layer, slot_mapping, k, v, *, interpret: bool = False):
    """The reference's XLA scatter (in place when the cache is donated)."""
    del interpret
    return ref_write_kv(kv_cache, layer, slot_mapping, k, v)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret"))
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array,  # [2*Hkv, L, num_pages, page_size, D], float32 or uint16 (bfloat16 bits)
    layer: jax.Array,  # [] int32
    kv_lens: jax.Array,  # [S] int32
    page_table: jax.Array,  # [S, pages_per_seq] int32
    query_start_loc: jax.Array,  # [S+1] int32
    sliding_window: jax.Array | int = 0,  # [] int32, 0 = unlimited
    *,
    sm_scale: float,
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,  # unused: the kernel tiles by itself
    interpret: bool = False,  # unused: there is nothing to interpret
) -> jax.Array:  # [T, Hq, D]
    del block_sizes, interpret
    check_attention_inputs(q, kv_cache, kv_lens, page_table, query_start_loc)
    if kv_cache.shape[4] != q.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} must equal the cache's head_dim {kv_cache.shape[4]}")
    if kv_cache.dtype not in (jnp.float32, jnp.uint16):
        raise ValueError(f"kv_cache must be float32 or uint16 (bfloat16 bits), got {kv_cache.dtype}")
    ok, error = _build()
    if not ok:
        raise RuntimeError(error)
    i32 = jnp.int32
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32),
        kv_cache,
        jnp.asarray(layer, i32).reshape(()),
        kv_lens.astype(i32),
        page_table.astype(i32),
        query_start_loc.astype(i32),
        jnp.asarray(sliding_window, i32).reshape(()),
        sm_scale=np.float32(sm_scale),
    )
    return out.astype(q.dtype)
