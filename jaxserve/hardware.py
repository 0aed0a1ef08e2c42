"""What the host CPU is: its model for every speed figure, its features for the numerics
it runs fast (``dtype: auto``) and for where compiled programs may be reused."""

from __future__ import annotations

import functools
import os
import platform


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first processor's ``/proc/cpuinfo`` fields (model name, cpu family, model,
    flags); elsewhere only a model name from the platform module."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if not sep:
                    if info:  # the blank line after the first processor
                        break
                    continue
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info or {"model name": platform.processor() or platform.machine()}


def cpu_model() -> str:
    """The CPU model and core count (speed figures mean little without them)."""
    info = cpu_info()
    family = (
        f" (family {info['cpu family']}, model {info['model']})" if "cpu family" in info and "model" in info else ""
    )
    return f"{info.get('model name', 'unknown')}{family}; {os.cpu_count()} cores"


def cpu_flags() -> frozenset[str]:
    return frozenset(cpu_info().get("flags", "").split())


def has_bfloat16_units() -> bool:
    """AVX-512 BF16 or AMX: XLA:CPU's bfloat16 dots then run several times faster than
    float32 ones; without them bfloat16 is converted in software and is slower."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
