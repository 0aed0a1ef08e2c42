"""Packed weights kept on disk: a later start reads them instead of converting them again.

For the CPU's kernels the loader dequantizes every tensor (SmolLM2's GGUF is Q4_1), casts,
transposes and packs it into oneDNN's layout: ~1.1-1.5 s of a ~4.5 s second start on 2
cores, for the same bytes every time. The loader keeps the result here and a later load
maps it (``_read``): on the CPU the parameters are the file's pages in the page cache,
with no copy.

One file per checkpoint and load options; its header holds the full key: the checkpoint's
files (path, size, modification time), the options, the model's structure (nnx GraphDef:
config and dtypes), jaxserve's and the kernels' source and oneDNN's version. The folder is
per machine (``compile_cache.folder``: oneDNN picks its layout for the CPU). A key that
differs rebuilds the file in place, so a new version of jaxserve replaces the old copy
instead of adding one. Only packed weights are kept: elsewhere the load is a cast and a
transpose, and a second copy of a large model is not worth its disk.

A file whose checkpoint was deleted, moved or rewritten can never be read again (its key
names the old files), so each save removes those (``prune``): a checkpoint converted
from a temporary folder (a test's random model, a fine-tune's scratch output) would
otherwise leave its packed copy in the cache for good; SmolLM2's is 651 MB in float32.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import pickle
import struct
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxserve import caching
from pallas_kernels import cpu_build

MAGIC = b"jaxserve-weights-1\n"
_ALIGN = 64  # bytes: each array starts on a cache line, as numpy and XLA like it
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: map every page now, not at first touch


def _identity(path: Path) -> tuple[str, int, int]:
    """(path, size, mtime_ns): what the key knows of one file. Raises OSError if it is gone."""
    st = path.stat()
    return str(path), st.st_size, st.st_mtime_ns


def _files(path: Path) -> list[tuple[str, int, int]]:
    """``_identity`` of the checkpoint's file, or of every file in its folder."""
    path = path.resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [_identity(p) for p in files]


class Entry(NamedTuple):
    path: Path  # the file for this checkpoint and these options
    key: str  # what its header must hold
    files: list  # the checkpoint's files: (path, size, mtime_ns) each


def entry(folder: Path, checkpoint: Path, options: tuple, graphdef) -> Entry:
    try:
        onednn = cpu_build.onednn()[2]
    except cpu_build.BuildError:
        onednn = None
    name = hashlib.sha256(repr((str(checkpoint.resolve()), options)).encode()).hexdigest()[:16]
    files = _files(checkpoint)
    material = repr((files, options, caching.source_digest(), onednn)).encode() + pickle.dumps(graphdef)
    return Entry(Path(folder) / f"{name}.bin", hashlib.sha256(material).hexdigest(), files)


def load(path: Path, key: str) -> dict | None:
    """The parameters (nested dict of arrays on the default device) that ``save`` wrote
    under ``key``, or None (no file, another key, a broken file)."""
    try:
        return _read(path, key)
    except Exception:  # truncated, another format: the caller converts the weights again
        return None


def _header(f) -> dict | None:
    """The header of the file open as ``f`` (None: not one of these files), read up to its
    data."""
    if f.read(len(MAGIC)) != MAGIC:
        return None
    (size,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(size))


def _read(path: Path, key: str) -> dict | None:
    with open(path, "rb") as f:
        header = _header(f)
        if header is None or header["key"] != key:
            return None
        start = _aligned(f.tell())  # the data starts on the next boundary
        if os.fstat(f.fileno()).st_size < start + header["bytes"]:
            return None  # cut short
        # Mapped, not read: on the CPU, device_put keeps an aligned array's memory instead of
        # copying it, so the parameters are this file's pages in the page cache. Reading
        # into fresh memory cost a second start ~1 s here (its page faults: 1.0-1.2 s for
        # SmolLM2's 651 MB on a 2-core Zen 3 VM) against ~0.01 s to map it. Safe because
        # no one writes these files in place: a save replaces one by renaming a new file
        # over it, and a prune unlinks; either way the mapped pages stay this file's.
        data = np.frombuffer(
            mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ),
            np.uint8,
            count=header["bytes"],
            offset=start,
        )
    flat = {}
    for names, name, shape, offset in header["arrays"]:
        dtype = jnp.dtype(name)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        flat[tuple(names)] = jax.device_put(data[offset : offset + nbytes].view(dtype).reshape(shape))
    return traverse_util.unflatten_dict(flat)


def save(path: Path, key: str, params: dict, files: list = ()) -> None:
    """Writes ``params`` (nested dict of arrays) under ``key``, atomically, naming the
    checkpoint's ``files`` (``Entry.files``); then prunes the folder. An unwritable cache
    only costs the next start its time."""
    arrays = [(list(names), np.ascontiguousarray(value)) for names, value in traverse_util.flatten_dict(params).items()]
    layout, offset = [], 0  # offsets from the start of the data, which is aligned too
    for names, value in arrays:
        layout.append([names, value.dtype.name, list(value.shape), offset])  # "bfloat16" too
        offset = _aligned(offset + value.nbytes)
    header = json.dumps({"key": key, "files": [list(f) for f in files], "arrays": layout, "bytes": offset}).encode()
    caching.write_atomically(path, _chunks(header, arrays))  # replaces another version's copy
    prune(path.parent, keep=path)


def _stale(files: list) -> bool:
    """Whether any of a checkpoint's files (path, size, mtime_ns) is gone or changed."""
    try:
        return any(_identity(Path(name)) != (name, size, mtime) for name, size, mtime in files)
    except OSError:  # gone
        return True


def prune(folder: Path, keep: Path | None = None) -> int:
    """Removes the files in ``folder`` whose checkpoint is gone or changed (they can never
    be read again); returns how many. So do files that name no checkpoint (an earlier
    jaxserve wrote them: its key holds another source digest, so this version rewrites
    them at their next load anyway). Files that are not ours, and ``keep``, are left alone."""
    removed = 0
    for path in Path(folder).glob("*.bin"):
        if path == keep:
            continue
        try:
            with open(path, "rb") as f:
                header = _header(f)
            if header is not None and (not header.get("files") or _stale(header["files"])):
                path.unlink()
                removed += 1
        except (OSError, ValueError):  # removed meanwhile, being written, not ours
            continue
    return removed


def _chunks(header: bytes, arrays: list):
    """The file's bytes: magic, header, then each array on an ``_ALIGN`` boundary."""
    at = len(MAGIC) + 8 + len(header)
    yield MAGIC + struct.pack("<Q", len(header)) + header
    for _, value in arrays:
        yield b"\0" * (_aligned(at) - at)
        yield value.reshape(-1).view(np.uint8)  # bfloat16 has no buffer format
        at = _aligned(at) + value.nbytes
    yield b"\0" * (_aligned(at) - at)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN
