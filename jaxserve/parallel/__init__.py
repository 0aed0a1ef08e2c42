"""Tensor parallelism over a device mesh: the mesh, the logical-axis rules, and where
every parameter and the KV cache live.

The mesh has two axes, ``data`` and ``model``. Parameters are sharded Megatron-style on
``model``: the projections that fan out (q/k/v, gate/up, the LM head over the vocab)
are split by output columns, the ones that fan back in (o, down) by input rows, so one
all-reduce ends each attention and MLP block (GSPMD inserts it). Attention itself runs
per shard (``shard_map`` over KV heads, see ``jaxserve.attention``): each device holds
``1/N`` of the KV heads of every page.

Logical axes -> mesh axes::

    vocab -> model   embed -> (replicated)   q_heads -> model   kv_heads -> model
    mlp   -> model   layers -> (replicated)  head_dim -> (replicated)

When the model has fewer KV heads than the ``model`` axis, each KV head is replicated
``N / Hkv`` times at load time (as vLLM does), so every device still holds exactly one
KV head per page; the math is unchanged.

KV cache layout under N shards: axis 0 is N blocks of ``[K heads, V heads]`` of that
shard's KV heads (for N = 1 the plain ``[K heads, V heads]`` layout), so a contiguous
shard of axis 0 is exactly what a kernel on one device expects.

Data parallelism (``data > 1``) is served by running one engine per replica; a single
engine uses ``data = 1``.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MODEL = "model"
DATA = "data"
LOGICAL_RULES = {
    "vocab": MODEL,
    "embed": None,
    "q_heads": MODEL,
    "kv_heads": MODEL,
    "mlp": MODEL,
    "layers": None,
    "head_dim": None,
}
# Logical axes of every parameter (by name; per-layer ones have a leading "layers").
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "norm": ("embed",),
    "input_norm": ("layers", "embed"),
    "post_attention_norm": ("layers", "embed"),
    "q_proj": ("layers", "embed", "q_heads"),
    "k_proj": ("layers", "embed", "kv_heads"),
    "v_proj": ("layers", "embed", "kv_heads"),
    "o_proj": ("layers", "q_heads", "embed"),
    "q_bias": ("layers", "q_heads"),
    "k_bias": ("layers", "kv_heads"),
    "v_bias": ("layers", "kv_heads"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "gate_proj": ("layers", "embed", "mlp"),
    "up_proj": ("layers", "embed", "mlp"),
    "down_proj": ("layers", "mlp", "embed"),
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """``mesh: {data: 1, model: N}`` from the engine config."""

    data: int = 1
    model: int = 1

    @classmethod
    def from_option(cls, value) -> MeshConfig:
        """Parses the config value; raises ValueError naming the key and allowed values."""
        if value is None:
            return cls()
        if not isinstance(value, dict) or set(value) - {DATA, MODEL}:
            raise ValueError(f"mesh = {value!r}: must be a mapping with keys data, model (e.g. {{model: 4}})")
        for key, n in value.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"mesh.{key} = {n!r}: must be an integer >= 1")
        cfg = cls(**value)
        if cfg.data != 1:
            raise ValueError(
                f"mesh.data = {cfg.data}: must be 1; data parallelism means one engine (one "
                f"`jaxserve run`) per replica, each with its own mesh"
            )
        return cfg

    @property
    def size(self) -> int:
        return self.data * self.model


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """A ``(data, model)`` mesh over the first ``cfg.size`` devices (all processes')."""
    devices = list(devices if devices is not None else jax.devices())
    if cfg.size > len(devices):
        raise ValueError(
            f"mesh = {{data: {cfg.data}, model: {cfg.model}}} needs {cfg.size} devices, "
            f"but JAX sees {len(devices)} ({devices[0].platform})"
        )
    return Mesh(np.asarray(devices[: cfg.size]).reshape(cfg.data, cfg.model), (DATA, MODEL))


def check_divisible(num_heads: int, num_kv_heads: int, intermediate: int, model: int) -> int:
    """Validates a model against the ``model`` axis; returns the KV heads after replication.

    Raises:
        ValueError: naming what does not divide.
    """
    if model == 1:
        return num_kv_heads
    if num_heads % model:
        raise ValueError(f"mesh.model = {model}: must divide the model's {num_heads} attention heads")
    if intermediate % model:
        raise ValueError(f"mesh.model = {model}: must divide the model's intermediate size {intermediate}")
    if num_kv_heads % model == 0:
        return num_kv_heads
    if model % num_kv_heads:
        raise ValueError(
            f"mesh.model = {model}: must divide the model's {num_kv_heads} KV heads or be a multiple of it "
            f"(then KV heads are replicated)"
        )
    return model


def replicate_kv_heads(w: np.ndarray, num_kv_heads: int, factor: int, axis: int = -1) -> np.ndarray:
    """Repeats each KV head's block of ``axis`` ``factor`` times: [.., Hkv*D] -> [.., Hkv*factor*D].

    Head j of the result is original head ``j // factor``, so with query heads split
    evenly over shards each shard's query heads find their KV head locally.
    """
    if factor == 1:
        return w
    w = np.moveaxis(w, axis, -1)
    d = w.shape[-1] // num_kv_heads
    w = w.reshape(*w.shape[:-1], num_kv_heads, 1, d)
    w = np.broadcast_to(w, (*w.shape[:-3], num_kv_heads, factor, d)).reshape(*w.shape[:-3], -1)
    return np.moveaxis(w, -1, axis)


def param_sharding(mesh: Mesh, name: str, shape: tuple[int, ...]) -> NamedSharding:
    """Where parameter ``name`` lives; a dimension the axis does not divide stays replicated.
    An int8 weight's scales and offsets (``q_proj_scale``: ``[L, groups, N]``) split as the
    weight does: a group axis of 1 (per-channel scales) stays whole."""
    logical = PARAM_AXES[name.removesuffix("_scale").removesuffix("_offset")]
    axes = []
    for size, a in zip(shape, logical, strict=True):
        mesh_axis = LOGICAL_RULES[a]
        axes.append(mesh_axis if mesh_axis is None or size % mesh.shape[mesh_axis] == 0 else None)
    return NamedSharding(mesh, P(*axes))


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """The KV cache is split on axis 0 (per-shard [K heads, V heads] blocks)."""
    return NamedSharding(mesh, P(MODEL))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
