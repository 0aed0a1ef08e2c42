"""Step programs kept on disk and loaded without tracing: what a second start warms up from.

JAX's persistent compilation cache keys an executable by its lowered program, so a start
that uses it still traces and lowers every bucket and skips only XLA's compile: ~1.1 of
the ~1.5 s a SmolLM2 warm-up took on 2 cores (23 programs). This store keys an executable
by what produced it instead, and a start that finds it neither traces nor lowers:

- the process: jaxserve's and its kernels' source files, the versions of JAX, jaxlib, Flax
  and numpy, the backend, its version and devices, JAX's settings, and the environment
  variables that steer XLA, JAX, libtpu or jaxserve (:func:`process_material`);
- the runner: what the program's function closes over (``ModelRunner._contexts``): for the
  model's steps, its structure with its static fields (nnx's GraphDef, which holds the
  model config and dtypes), the attention backend and the mesh's device order; for the
  sampler only its sequence count and mesh, so engines of other models share it;
- the call: the program's name and its arguments' tree, types and placements.

A change to any of them is another key, so an executable built from other code, another
model or other flags is never loaded; a change that does not alter the program (an edited
server module) costs one cold start. The folder is per machine (``compile_cache``), as
XLA:CPU builds code for the host's instruction set.

Programs of other code can never be loaded by this one, and every version of jaxserve (for
a developer, every edit) compiles a new set: a test run writes ~400 programs, ~60 MB. So
the store keeps one folder per process key (``<directory>/<digest of
process_material>``), marks its own folder used when it opens it, and when it writes a
program it removes the least recently used other folders beyond ``KEEP_BYTES`` in all
(ccache's rule, by whole folders; the open one always stays). A second jaxserve installed
beside this one keeps its folder while it is used.

An executable is written only right after XLA compiled it. XLA:CPU (jaxlib 0.10) serializes
an executable it *loaded* without its kernels, and the copy then fails to run ("Function
... not found"), so this store cannot sit on top of JAX's cache: where it is in use, JAX's
cache is off (``compile_cache.use``), and a compile that JAX reports as a
cache hit anyway is not written.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any

import flax
import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

from jaxserve import caching
from jaxserve.runner import compile_counter
from pallas_kernels import cpu_build

FORMAT = 2  # of the files; part of every key (1: all programs in one folder)
KEEP_BYTES = 4 << 30  # the store's size above which other code's folders go, oldest use first
_ENV_PREFIXES = ("XLA_", "JAX_", "JAXSERVE_", "LIBTPU", "TPU_")


@functools.cache
def process_material() -> bytes:
    """What every program of this process shares in its key (computed once: ~10 ms)."""
    devices = jax.devices()
    settings = {
        k: repr(v)
        for k, v in jax.config.values.items()
        if "compilation_cache" not in k and "persistent_cache" not in k  # where, not what
    }
    parts = {
        "format": FORMAT,
        "versions": (jax.__version__, jaxlib.__version__, flax.__version__, np.__version__),
        "backend": (devices[0].platform, devices[0].client.platform_version, jax.process_count()),
        "devices": [(d.id, d.device_kind, d.process_index) for d in devices],
        "settings": sorted(settings.items()),
        "env": sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)),
        "source": caching.source_digest(),
    }
    return repr(parts).encode()


def _describe(x) -> tuple:
    """(shape, dtype, weak type, placement) of an array, or of a ``jax.ShapeDtypeStruct``
    standing for one (numpy arrays go to the default device)."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return tuple(x.shape), str(x.dtype), bool(x.weak_type), repr(x.sharding)
    x = np.asarray(x)
    return x.shape, str(x.dtype), False, None


def _signature(args: tuple) -> bytes:
    """The arguments' tree, and per leaf its type and placement: what the program was
    compiled for (a call with other shapes or placements is another program)."""
    leaves, tree = jax.tree_util.tree_flatten((args, {}))
    return pickle.dumps(tree) + repr([_describe(x) for x in leaves]).encode()


class ProgramStore:
    """Executables in ``directory``, one file each, named by the hash of their key.

    ``context``: what the runner adds to every key; a call's ``context``: what that
    program's function closes over (see the module docstring)."""

    def __init__(self, directory: str | Path, context: bytes):
        self.root = Path(directory)
        self.directory = self.root / hashlib.sha256(process_material()).hexdigest()[:16]
        self._context = hashlib.sha256(process_material() + b"\0" + context).digest()
        self.loaded = 0  # programs this store loaded (the rest it compiled)
        self._lock = threading.Lock()
        self._pruned = False
        try:  # used now: the last folder pruning takes
            self.directory.mkdir(parents=True, exist_ok=True)
            os.utime(self.directory)
        except OSError:  # an unwritable cache: nothing is kept
            pass

    def _path(self, name: str, args: tuple, context: bytes) -> Path:
        parts = (self._context, hashlib.sha256(context).digest(), name.encode(), b"\0", _signature(args))
        key = hashlib.sha256(b"".join(parts)).hexdigest()
        return self.directory / f"{key}.bin"

    def load(self, name: str, args: tuple, context: bytes = b"") -> Any:
        """The stored program for ``name`` and ``args``, or None. Several threads may load
        at once (a warm start does: ``ModelRunner.compile_ahead``)."""
        loaded = self._load(self._path(name, args, context), args)
        if loaded is not None:
            with self._lock:
                self.loaded += 1
            compile_counter.record_load()  # a program a step waited for, as JAX counts its loads
        return loaded

    def compiled(self, name: str, fn, args: tuple, context: bytes = b"") -> jax.stages.Compiled:
        """``fn``'s program for ``args`` (a ``jax.jit`` function; an argument may be a
        ``jax.ShapeDtypeStruct`` with its sharding): loaded from the store if it holds one,
        else lowered, compiled and written to it."""
        loaded = self.load(name, args, context)
        if loaded is not None:
            return loaded
        path = self._path(name, args, context)
        hits = compile_counter.num_cache_loads()
        compiled = fn.lower(*args).compile()
        if compile_counter.num_cache_loads() == hits:  # XLA compiled it just now (see above)
            self._write(path, compiled)
        return compiled

    def _load(self, path: Path, args: tuple) -> Any:
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        try:
            if jax.devices()[0].platform == "cpu":
                # Loading resolves the kernels' FFI targets, which tracing would have registered.
                cpu_build.kernels()  # built and registered once per process (cached)
            record = pickle.loads(blob)
            by_id = {d.id: d for d in jax.devices()}
            devices = [by_id[i] for i in record["devices"]]
            in_tree = jax.tree_util.tree_structure((args, {}))
            return serialize_executable.deserialize_and_load(
                record["payload"], in_tree, record["out_tree"], execution_devices=devices
            )
        except Exception:  # truncated, from a jaxlib that wrote it otherwise: compile again
            path.unlink(missing_ok=True)
            return None

    def _write(self, path: Path, compiled) -> None:
        unloaded = getattr(compiled._executable, "_unloaded_executable", None)
        if unloaded is None:
            return  # this backend's executables do not serialize: nothing to keep
        try:
            payload, _, out_tree = serialize_executable.serialize(compiled)
            record = {"payload": payload, "out_tree": out_tree, "devices": [d.id for d in unloaded.device_list]}
            blob = pickle.dumps(record)
        except Exception:  # e.g. a program with host callbacks: it stays in memory only
            return
        caching.write_atomically(path, [blob])  # a concurrent writer's copy is the same
        if not self._pruned:  # once per store, on a start that compiles (a warm one writes nothing)
            self._pruned = True
            try:
                prune(self.root, keep=self.directory)
            except OSError:  # the cache's folder went away or is unreadable: nothing to prune
                pass


def _size(path: Path) -> int:
    """Bytes of the files under ``path`` (0 for what vanished meanwhile)."""
    total = 0
    for f in path.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            continue
    return total


def prune(root: Path, keep: Path, keep_bytes: int | None = None) -> list[Path]:
    """Removes, from ``root``, files of the earlier one-folder layout and then the least
    recently used program folders other than ``keep`` while all of them take more than
    ``keep_bytes`` (default ``KEEP_BYTES``); returns what it removed. A folder's use is its
    modification time, which a store sets when it opens it."""
    limit = KEEP_BYTES if keep_bytes is None else keep_bytes
    removed = []
    folders = []
    for entry in root.iterdir():
        try:
            if entry.is_dir():
                if entry != keep:
                    folders.append((entry.stat().st_mtime, entry))
            elif entry.suffix == ".bin":  # FORMAT 1's: no process of this version reads them
                entry.unlink()
                removed.append(entry)
        except OSError:
            continue
    if not folders:  # only the open one: nothing to weigh
        return removed
    sizes = {folder: _size(folder) for _, folder in folders}
    total = _size(keep) + sum(sizes.values())
    for _, folder in sorted(folders):  # oldest use first
        if total <= limit:
            break
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
        total -= sizes[folder]
    return removed
