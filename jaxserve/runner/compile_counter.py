"""Counts XLA backend compiles through ``jax.monitoring`` (no patching of JAX internals).

Each program the step needs and does not have yet counts once, whether XLA compiles it
or it is loaded from a cache (JAX's persistent cache, or jaxserve's program store, which
reports its loads with :func:`record_load`): either way a step waited for it, so "no
compiles after warm-up" counts both. Loads are also counted on their own.
"""

from __future__ import annotations

import threading

import jax

_REQUEST = "/jax/core/compile/backend_compile_duration"  # compiled or loaded
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_counts = {_REQUEST: 0, _CACHE_HIT: 0}
_installed = False


def _listener(event: str, *args, **kwargs) -> None:
    if event in _counts:
        with _lock:
            _counts[event] += 1


def install() -> None:
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            jax.monitoring.register_event_listener(_listener)
            _installed = True


def record_load() -> None:
    """A program loaded from jaxserve's program store (``runner/programs.py``)."""
    install()
    with _lock:
        _counts[_REQUEST] += 1
        _counts[_CACHE_HIT] += 1


def num_compiles() -> int:
    """Programs compiled or loaded from the cache in this process since :func:`install`."""
    install()
    return _counts[_REQUEST]


def num_cache_loads() -> int:
    """Of those, the ones loaded from a cache (not compiled)."""
    install()
    return _counts[_CACHE_HIT]
