"""Compile-only NVIDIA GPUs for ``jaxserve.aot``: XLA's GPU compiler (the jax CUDA plugin)
compiles for a described device without one.

Needs ``pip install jax-cuda12-plugin jax-cuda12-pjrt nvidia-cuda-nvcc-cu12`` (the
plugin, and ptxas / libdevice for Triton; ~700 MB, no other CUDA wheels) at the version
of jax, and ``JAX_PLATFORMS=cpu`` in the environment, since the plugin otherwise fails
at import looking for a driver. The device description below is the GPU's published
properties (those CUDA's deviceQuery prints), in XLA's ``GpuTargetConfigProto`` text form.
"""

from __future__ import annotations

from jaxserve.errors import ConfigError

# Per GPU: streaming multiprocessors, memory bytes as CUDA reports them, HBM bytes / s,
# L2 bytes, boost clock GHz, name. Both are SM 9.0 (Hopper) with the same SM.
_HOPPER = {
    "h100": (132, 84_978_434_048, 3_352_320_000_000, 52_428_800, 1.98, "NVIDIA H100 80GB HBM3"),
    "h200": (132, 150_754_820_096, 4_800_000_000_000, 52_428_800, 1.98, "NVIDIA H200"),
}


def target_config(gpu: str) -> str:
    """``GpuTargetConfigProto`` text for ``gpu`` (h100 | h200)."""
    sms, memory, bandwidth, l2, clock, name = _HOPPER[gpu]
    device = {
        "threads_per_block_limit": 1024,
        "threads_per_warp": 32,
        "shared_memory_per_block": 48 * 1024,
        "shared_memory_per_core": 228 * 1024,
        "threads_per_core_limit": 2048,
        "core_count": sms,
        "fpus_per_core": 128,
        "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "memory_bandwidth": bandwidth,
        "l2_cache_size": l2,
        "clock_rate_ghz": clock,
        "device_memory_size": memory,
        "shared_memory_per_block_optin": 227 * 1024,
        "registers_per_core_limit": 65536,
        "registers_per_block_limit": 65536,
    }
    fields = "\n".join(f"  {k}: {v}" for k, v in device.items())
    return (
        f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{\n    major: 9\n  }}\n}}\n"
        f'platform_name: "CUDA"\ndnn_version_info {{\n  major: 9\n}}\ndevice_description_str: "{name}"\n'
    )


def gpu_target(topology: str):
    """Compile-only GPUs: ``h100`` / ``h200``, optionally ``:N`` GPUs on one host."""
    from jax.experimental import topologies

    from jaxserve.aot import GPU_CHIPS, Chip, Target

    gpu, _, count = topology.partition(":")
    try:
        n = int(count or 1)
    except ValueError:
        raise ConfigError(f"--topology {topology!r}: expected GPU[:COUNT], e.g. h200 or h100:8") from None
    try:
        topo = topologies.get_topology_desc(gpu, "cuda", target_config=target_config(gpu), topology=f"1x1x{n}")
    except Exception as e:  # noqa: BLE001 - the plugin's errors are plain RuntimeErrors
        raise ConfigError(
            f"--topology {topology!r}: no compile-only GPU ({type(e).__name__}: {str(e).splitlines()[0]}); "
            "needs jax-cuda12-plugin, jax-cuda12-pjrt and nvidia-cuda-nvcc-cu12 at jax's version, "
            "and JAX_PLATFORMS=cpu"
        ) from None
    peak, bandwidth, memory = GPU_CHIPS[gpu]
    return Target(topology, "gpu", list(topo.devices)[:n], Chip(_HOPPER[gpu][5], memory, peak, bandwidth))
