"""Compile once per machine: a start loads the step programs an earlier start compiled,
instead of compiling every bucket again.

One process: jaxserve's program store (``runner/programs.py``), which loads a program
without tracing or lowering it; JAX's persistent cache is then off, as the store can only
keep programs XLA has just compiled. Several processes (multi-host): JAX's persistent
compilation cache, which keys an entry by the lowered program, the compile options and
XLA flags, jax's version, the backend's version and the devices' kind.

What JAX's key leaves out is the host: XLA:CPU builds code for the CPU's instruction set,
so a cache in a home folder shared by two machines must not hand one's programs to the
other. Both live in ``<cache_dir>/xla/<machine key>``, whose name adds the host CPU's model
and feature flags.

The setting is process-wide (JAX has one cache): the engine built last decides.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import jax
import jaxlib
from jax.experimental.compilation_cache import compilation_cache

from jaxserve.hardware import cpu_info
from jaxserve.models.fetch import default_cache_dir


def machine_key(devices: list) -> str:
    """``<platform>-<hash>`` of what must match for a compiled program to be reused here."""
    info = cpu_info()
    parts = [
        jax.__version__,
        jaxlib.__version__,
        devices[0].platform,
        devices[0].device_kind,
        str(len(devices)),
        info.get("model name", ""),
        info.get("flags", ""),
    ]
    return f"{devices[0].platform}-{hashlib.sha256('|'.join(parts).encode()).hexdigest()[:16]}"


def folder(cache_dir: str | Path | None, devices: list | None = None) -> Path:
    """``<cache_dir>/xla/<machine key>`` (default cache dir: $XDG_CACHE_HOME/jaxserve)."""
    return Path(cache_dir or default_cache_dir()) / "xla" / machine_key(devices or jax.devices())


def use(cache_dir: str | Path | None) -> Path | None:
    """Sets up the cache for the engine about to be built: the program store's folder to
    give its runner (one process; JAX's cache off), or None (JAX's cache on: multi-host)."""
    if jax.process_count() == 1:
        disable()
        return folder(cache_dir) / "programs"
    enable(cache_dir)
    return None


def enable(cache_dir: str | Path | None, devices: list | None = None) -> Path:
    """Turns JAX's persistent cache on in :func:`folder`; every program is kept, however
    fast it compiled."""
    path = folder(cache_dir, devices)
    if jax.config.jax_compilation_cache_dir != str(path):
        compilation_cache.reset_cache()  # JAX reads the folder once, at its first compile
        jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def disable() -> None:
    if jax.config.jax_compilation_cache_dir is not None:
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", None)
