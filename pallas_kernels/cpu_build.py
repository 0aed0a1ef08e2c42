"""Builds the project's C++ CPU kernels on first use and registers them with XLA's FFI.

One shared library holds every CPU kernel (they split their work the same way over XLA's
threads: ``cpu_threads.h``): the ragged paged attention kernel and the int8-weight matmul
(``cpu_int8.cc``, AMX) always, and the oneDNN matmul
(``cpu_matmul.cc``) where oneDNN's PyPI build is installed (x86-64 Linux). It is compiled
with the machine's C++ compiler (``$CXX`` or ``c++``; ``-O3 -march=native``) against the
FFI headers jaxlib ships, and cached under ``~/.cache/jaxserve/kernels`` keyed by the
sources, the compiler and its flags, jaxlib's and oneDNN's versions and the CPU's
feature flags: a library built for one CPU never loads on another.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading
from importlib import metadata

import jax
import jaxlib

# -ffp-contract=off: no fused multiply-adds unless a kernel asks for them where it is safe,
# so a vectorized loop and its scalar remainder round alike.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-std=c++17")


class BuildError(Exception):
    """The kernel could not be compiled or loaded; the message says why."""


def cache_dir() -> pathlib.Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "jaxserve" / "kernels"


def cpu_flags() -> str:
    """The CPU's feature flags line (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


ROOT = pathlib.Path(__file__).parent
ATTENTION = ROOT / "ragged_paged_attention" / "cpu_kernel.cc"
MATMUL = ROOT / "cpu_matmul.cc"
INT8 = ROOT / "cpu_int8.cc"
_ONEDNN_RUNTIME, _ONEDNN_HEADERS = "onednn-cpu-gomp", "onednn-devel-cpu-gomp"


def find_compiler() -> str:
    """The C++ compiler: ``$CXX``, else the first of c++, g++, clang++ on the PATH.

    Raises:
        BuildError: none found.
    """
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise BuildError("no C++ compiler found (set $CXX or install g++)")
    return compiler


def build(
    sources: tuple[pathlib.Path, ...],
    name: str,
    compile_args: tuple[str, ...] = (),
    link_args: tuple[str, ...] = (),
    key_parts: tuple[str, ...] = (),
):
    """Compiles ``sources`` into one shared library (or finds it cached) and loads it.

    ``compile_args`` / ``link_args``: more arguments for compiling each source (include
    paths) / for linking them (libraries); ``key_parts``: anything else the library depends
    on (a library version). The sources compile in parallel, one compiler per core (the
    attention kernel alone takes ~25 s at -O3), and a process that finds another building
    the same library waits for it instead of building it again (two test workers, or two
    servers starting at once, on 2 cores).

    Raises:
        BuildError: no compiler, a failed compile, or a library that does not load.
    """
    compiler = find_compiler()
    key = hashlib.sha256()
    headers = sorted(ROOT.rglob("*.h"))  # the kernels' own folders' too
    parts = (*(p.read_bytes() for p in (*sources, *headers)), " ".join([compiler, *FLAGS, *compile_args, *link_args]))
    for part in (*parts, jaxlib.__version__, cpu_flags(), *key_parts):
        key.update(part if isinstance(part, bytes) else part.encode())
    library = cache_dir() / f"{name}_{key.hexdigest()[:16]}.so"
    try:
        if not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            with open(library.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the holder dies
                if not library.exists():  # not built meanwhile by the holder we waited for
                    _compile_and_link(compiler, sources, compile_args, link_args, library)
        return ctypes.cdll.LoadLibrary(str(library))
    except (OSError, subprocess.SubprocessError) as e:  # unwritable cache, unloadable library...
        raise BuildError(f"{type(e).__name__}: {e}") from None


def include_args() -> tuple[str, ...]:
    """The include paths every source compiles with: XLA's FFI headers, and this package's."""
    return (f"-I{jax.ffi.include_dir()}", f"-I{ROOT.parent}")


def _compile_and_link(compiler, sources, compile_args, link_args, library: pathlib.Path) -> None:
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        includes = include_args()
        objects = [pathlib.Path(tmp) / f"{i}_{source.stem}.o" for i, source in enumerate(sources)]
        commands = [
            [compiler, *FLAGS, "-fPIC", *includes, *compile_args, "-c", str(source), "-o", str(obj)]
            for source, obj in zip(sources, objects, strict=True)
        ]
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            procs = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), commands))
        for source, cmd, proc in zip(sources, commands, procs, strict=True):
            if proc.returncode != 0:
                raise BuildError(f"compiling {source.name} failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
        out = pathlib.Path(tmp) / library.name
        cmd = [compiler, *FLAGS, "-shared", *map(str, objects), "-o", str(out), *link_args, "-pthread"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"linking {library.name} failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
        os.replace(out, library)  # atomic: a process that did not wait never loads half a file


def register(lib, symbol: str, target: str) -> None:
    """Registers the library's FFI handler ``symbol`` as XLA CPU custom call ``target``."""
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


def onednn() -> tuple[pathlib.Path, pathlib.Path, str]:
    """(include dir, libdnnl.so path, version) of the installed oneDNN wheels.

    Raises:
        BuildError: not on x86-64 Linux, or the wheels are not installed.
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise BuildError(f"oneDNN's PyPI build is for x86-64 Linux, not {platform.system()} {platform.machine()}")
    try:
        headers = next(f for f in metadata.files(_ONEDNN_HEADERS) or () if str(f).endswith("oneapi/dnnl/dnnl.hpp"))
        runtime = metadata.files(_ONEDNN_RUNTIME) or ()
        library = next(f for f in runtime if pathlib.PurePath(f).name.startswith("libdnnl.so."))
    except (metadata.PackageNotFoundError, StopIteration):
        raise BuildError(f"oneDNN is not installed (pip install {_ONEDNN_RUNTIME} {_ONEDNN_HEADERS})") from None
    include = pathlib.Path(headers.locate()).parents[2]  # .../include/oneapi/dnnl/dnnl.hpp
    return include, pathlib.Path(library.locate()), metadata.version(_ONEDNN_RUNTIME)


def onednn_build_args() -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """(compile args, link args, oneDNN version) of the library that calls oneDNN.

    Raises:
        BuildError: as :func:`onednn`.
    """
    include, library, version = onednn()
    return (f"-I{include}", "-fopenmp"), (str(library), f"-Wl,-rpath,{library.parent}", "-fopenmp"), version


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The loaded library (None: not built) and why a kernel is missing ("" if present)."""

    lib: ctypes.CDLL | None
    attention_error: str
    matmul_error: str


_KERNELS_LOCK = threading.Lock()


def kernels() -> Kernels:
    """Builds (once per process) the library with every kernel this machine can have and
    registers their FFI targets: ``jaxserve_ragged_paged_attention``,
    ``jaxserve_int8_matmul`` and, with oneDNN, ``jaxserve_matmul`` and ``jaxserve_matmul_swiglu``. A matmul that fails to build leaves the attention kernel alone.
    Once even when threads ask at once (a warm start loads its programs on several)."""
    with _KERNELS_LOCK:
        return _kernels()


@functools.cache
def _kernels() -> Kernels:
    try:
        compile_args, link_args, version = onednn_build_args()
        lib = build((ATTENTION, INT8, MATMUL), "cpu_kernels_onednn", compile_args, link_args, (version,))
        matmul_error = ""
    except BuildError as e:
        matmul_error = str(e)
        try:
            lib = build((ATTENTION, INT8), "cpu_kernels")
        except BuildError as e2:
            return Kernels(None, str(e2), matmul_error)
    register(lib, "JaxserveRaggedPagedAttention", "jaxserve_ragged_paged_attention")
    register(lib, "JaxserveWriteAndAttend", "jaxserve_write_and_attend")
    register(lib, "JaxserveWriteKv", "jaxserve_write_kv")
    register(lib, "JaxserveInt8Matmul", "jaxserve_int8_matmul")
    if not matmul_error:
        register(lib, "JaxserveMatmul", "jaxserve_matmul")
        register(lib, "JaxserveMatmulSwiGlu", "jaxserve_matmul_swiglu")
        register(lib, "JaxserveAddRmsNorm", "jaxserve_add_rms_norm")
    return Kernels(lib, "", matmul_error)


def threads() -> int:
    """Threads the kernels split their work over (the process's cores); 1 without the library."""
    lib = kernels().lib
    return int(lib.JaxserveThreads()) if lib is not None else 1
