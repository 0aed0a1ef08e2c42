"""Counts XLA backend compiles through ``jax.monitoring`` (no patching of JAX internals)."""

from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _listener(event: str, duration: float, **kwargs) -> None:
    global _count
    if event == _EVENT:
        with _lock:
            _count += 1


def install() -> None:
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


def num_compiles() -> int:
    """Backend compiles in this process since :func:`install` was first called."""
    install()
    return _count
