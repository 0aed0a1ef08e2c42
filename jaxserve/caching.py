"""What jaxserve's on-disk caches share: a digest of the code that made an entry, and an
all-or-nothing write."""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

_SUFFIXES = (".py", ".cc", ".h", ".c", ".cpp")


@functools.cache
def source_digest() -> str:
    """sha256 over every source file of jaxserve and pallas_kernels (path and bytes), once
    per process (~10 ms): any edit, of a kernel or of the server, is another digest."""
    import jaxserve
    import pallas_kernels

    h = hashlib.sha256()
    for package in (jaxserve, pallas_kernels):
        root = Path(package.__file__).parent
        for path in sorted(p for p in root.rglob("*") if p.suffix in _SUFFIXES and p.is_file()):
            h.update(f"{package.__name__}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def write_atomically(path: Path, chunks: Iterable[bytes]) -> None:
    """Writes ``chunks`` to ``path`` whole or not at all (a temporary file, then a rename: a
    concurrent writer's copy replaces this one or is replaced). An unwritable cache is
    left alone: it only costs the next start its time."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
