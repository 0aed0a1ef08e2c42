"""Typed, frozen engine configuration, validated with errors naming the key."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

import yaml

from jaxserve.attention import BACKENDS
from jaxserve.errors import ConfigError
from jaxserve.parallel import MeshConfig
from jaxserve.parallel.multihost import DistributedConfig

DTYPES = ("float32", "bfloat16", "float16")
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a mapping"}


def _is(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:  # YAML's `true` is not a count, and 16.0 is not a page size
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:  # an integer is a fine number; infinities and NaN are not
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind)


def check_types(config, prefix: str = "") -> None:
    """Checks every field of a config dataclass against its annotation, before any value
    is used: ``kv_cache_memory_gb: lots`` is one ConfigError naming the key, not a
    TypeError three modules later. ``X | None`` allows null."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        hint = hints[field.name]
        kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if any(value is None if k is type(None) else _is(value, k) for k in kinds):
            continue
        allowed = " or ".join("null" if k is type(None) else _TYPE_NAMES.get(k, k.__name__) for k in kinds)
        if float in kinds and isinstance(value, float) and not math.isfinite(value):
            allowed += " (finite)"
        raise ConfigError(f"{prefix}{field.name} = {value!r}: must be {allowed}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine options. ``None`` means "derive from the model and the platform"."""

    model: str = "smollm2-135m-instruct"
    dtype: str | None = None  # float32 on CPU, bfloat16 on accelerators
    # Storage + matmul dtype of the decoder layers' linear weights (default: dtype); the
    # embedding, LM head, norms, residuals and attention math keep dtype. On CPUs with
    # bfloat16 units (AMX, AVX512-BF16), bfloat16 under float32 activations runs the
    # layers' matmuls ~2.5x faster (README, Performance).
    weight_dtype: str | None = None
    # Storage dtype of the KV cache (default: dtype). bfloat16 under float32 activations
    # halves the bytes attention reads; attention widens them to float32.
    kv_cache_dtype: str | None = None
    page_size: int = 16
    num_pages: int | None = None  # derived from kv_cache_memory_gb when unset
    kv_cache_memory_gb: float = 2.0
    max_model_len: int | None = None  # the model's context, capped at 8192
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 32
    # Smallest token bucket. On XLA:CPU a matmul's rows are bitwise identical for every
    # row count >= 64, so 64 makes a request's tokens independent of what else is batched
    # (at the cost of 64 rows of work for a lone decode). None = min(64, max_num_batched_tokens).
    min_token_bucket: int | None = None
    # auto: Pallas kernels on TPU / GPU, the pure-JAX reference on CPU.
    attention_backend: str = "auto"
    attention_interpret: bool = False  # Pallas kernels in interpret mode (CPU testing; slow)
    # Tensor parallelism: {data: 1, model: N} shards weights and KV heads over N devices.
    mesh: dict | None = None
    # Multi-host: 'auto' or {coordinator_address, num_processes, process_id} (multihost.py).
    distributed: str | dict | None = None
    static_batching: bool = False  # baseline for benchmarks: no request joins a running batch
    enable_prefix_caching: bool = True
    prefix_match: str = "token"  # token (radix, exact divergence point) | page (whole pages only)
    schedule_policy: str = "fcfs"  # fcfs | lpm (longest cached prefix first, with aging)
    lpm_aging_steps: int = 64  # lpm: a request waiting this many steps goes first
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        check_types(self)

        def need(key: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"{key} = {getattr(self, key)!r}: must be {allowed}")

        def positive_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v > 0

        need("dtype", self.dtype is None or self.dtype in DTYPES, f"one of {', '.join(DTYPES)}")
        need("weight_dtype", self.weight_dtype is None or self.weight_dtype in DTYPES, f"one of {', '.join(DTYPES)}")
        need(
            "kv_cache_dtype",
            self.kv_cache_dtype is None or self.kv_cache_dtype in DTYPES,
            f"one of {', '.join(DTYPES)}",
        )
        need("page_size", self.page_size in (8, 16, 32, 64, 128), "one of 8, 16, 32, 64, 128")
        need(
            "num_pages",
            self.num_pages is None or (positive_int(self.num_pages) and self.num_pages >= 2),
            "an integer >= 2",
        )
        need("model", bool(self.model.strip()), "an alias, a Hugging Face directory or a .gguf path")
        need("kv_cache_memory_gb", self.kv_cache_memory_gb > 0, "a number > 0")
        need("max_model_len", self.max_model_len is None or positive_int(self.max_model_len), "an integer >= 1")
        need("max_num_batched_tokens", positive_int(self.max_num_batched_tokens), "an integer >= 1")
        need("max_num_seqs", positive_int(self.max_num_seqs), "an integer >= 1")
        need(
            "min_token_bucket",
            self.min_token_bucket is None
            or (positive_int(self.min_token_bucket) and self.min_token_bucket <= self.max_num_batched_tokens),
            "an integer in [1, max_num_batched_tokens]",
        )
        need("attention_backend", self.attention_backend in BACKENDS, f"one of {', '.join(BACKENDS)}")
        need("prefix_match", self.prefix_match in ("token", "page"), "one of token, page")
        need("schedule_policy", self.schedule_policy in ("fcfs", "lpm"), "one of fcfs, lpm")
        need("lpm_aging_steps", positive_int(self.lpm_aging_steps), "an integer >= 1")
        try:
            MeshConfig.from_option(self.mesh)
            DistributedConfig.from_option(self.distributed)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")
        return cls(**options)


def read_config_file(path: str | None, overrides: list[str] = ()) -> dict[str, Any]:
    """A YAML file's mapping (``{}`` without a file) with ``key=value`` overrides applied;
    dotted keys reach into sections (``server.port=50052``), values are parsed as YAML."""
    data: dict[str, Any] = {}
    if path:
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of option: value")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        *sections, leaf = key.strip().split(".")
        node = data
        for k in sections:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {k} is not a section")
        node[leaf] = yaml.safe_load(raw)
    return data
