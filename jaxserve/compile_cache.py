"""Compile once per machine: JAX's persistent compilation cache, in the jaxserve cache.

A start loads the step programs an earlier start compiled, instead of compiling every
bucket again. JAX keys each entry by the program itself (so a change of code is a new
entry), the compile options and XLA flags, jax's version, the backend's version and the
devices' kind. What its key leaves out is the host: XLA:CPU builds code for the CPU's
instruction set, so a cache in a home folder shared by two machines must not hand one's
programs to the other. The folder name adds the host CPU's model and feature flags.

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


def enable(cache_dir: str | Path | None, devices: list | None = None) -> Path:
    """Turns the cache on in ``<cache_dir>/xla/<machine key>`` (default cache dir:
    $XDG_CACHE_HOME/jaxserve); every program is kept, however fast it compiled."""
    path = Path(cache_dir or default_cache_dir()) / "xla" / machine_key(devices or jax.devices())
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
