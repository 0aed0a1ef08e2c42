"""A digest of jaxserve's own code, for caches whose entries that code produced."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

_SUFFIXES = (".py", ".cc", ".h", ".c", ".cpp")


@functools.cache
def digest() -> str:
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
