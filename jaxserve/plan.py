"""Resolve once: every value an engine derives from (EngineConfig, model config, devices).

``LLM`` builds a real engine from the plan; ``jaxserve compile`` (``jaxserve.aot``)
builds the same jitted step from it over compile-only TPU / GPU devices. Both read the
plan's fields; neither derives them again::

    EngineConfig + ModelConfig + devices ──resolve_plan──▶ EnginePlan
        dtypes (activation, weight, KV) · max_model_len · mesh · KV heads per shard
        attention backend · num_pages (from kv_cache_memory_gb) · RunnerConfig (buckets)
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from jaxserve.attention import AttentionBackend
from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.hardware import has_bfloat16_units
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import matmul_shapes
from jaxserve.parallel import MeshConfig, check_divisible, make_mesh
from jaxserve.runner.batch import MIN_TOKEN_BUCKET
from jaxserve.runner.sampler import CPU_CHUNK_ROWS
from jaxserve.runner.step import RunnerConfig
from pallas_kernels import cpu_int8, cpu_matmul
from pallas_kernels.ragged_paged_attention import cpu as cpu_attention


def default_dtype(platform: str) -> str:
    """float32 on CPU (exact against transformers; see weight_dtype for speed), bfloat16
    on accelerators."""
    return "float32" if platform == "cpu" else "bfloat16"


def storage_dtype(option: str | None, dtype: str, platform: str) -> str:
    """weight_dtype / kv_cache_dtype resolved: null is the activation dtype; ``auto`` is
    bfloat16 under float32 activations where the device computes bfloat16 fast (every
    accelerator; a CPU with AVX-512 BF16 or AMX: 2-4x float32's matmul speed), else dtype
    (a CPU without them converts bfloat16 in software, slower than float32)."""
    if option != "auto":
        return option or dtype
    fast = platform != "cpu" or has_bfloat16_units()
    return "bfloat16" if fast and dtype == "float32" else dtype


# max_mixed_batched_tokens: auto on a CPU. A step that decodes and carries a prefill chunk
# is an inter-token gap of every running stream; its chunk costs what the CPU's linear layers
# make of it. 16 streams of 200-token prompts (`jaxserve bench serve --workload random
# --num-requests 64 --concurrency 16 --input-len 200:200 --output-len 64:64`): on a 2-core
# AMX Xeon (~0.24 ms a prefill token) 128 kept the ITL p99 at 2.1-2.7x its p50, 160 and
# 192 went past 3x; on a 2-core Zen 4 (AVX-512 BF16, ~0.63 ms a token) 128 gave p99 3.1-4.6x
# p50 in five runs and 96 2.4-2.6x in four, p50 35-38 ms (64: p50 52-53 ms, most steps then
# carrying a chunk).
MIXED_BUDGET_AMX = 128
MIXED_BUDGET_CPU = 96


def mixed_budget(cfg: EngineConfig, mcfg: ModelConfig, platform: str, matmul: str, weight_dtype: str) -> int | None:
    """``max_mixed_batched_tokens`` resolved: ``auto`` on a CPU is MIXED_BUDGET_AMX where a
    prefill's linear layers run on AMX tiles (int8 weights on cpu_int8's kernel, or oneDNN's
    implementation for the model's first weight at max_num_batched_tokens rows), else
    MIXED_BUDGET_CPU, within max_num_seqs and max_num_batched_tokens; on accelerators null
    (every step's budget is max_num_batched_tokens)."""
    option = cfg.max_mixed_batched_tokens
    if option != "auto":
        return option
    if platform != "cpu":
        return None
    amx = matmul == "amx"
    if matmul == "onednn":
        k, n = next(iter(matmul_shapes(mcfg, packed=True).values()))
        amx = "amx" in cpu_matmul.impl(cfg.max_num_batched_tokens, k, n, weight_dtype)
    budget = max(MIXED_BUDGET_AMX if amx else MIXED_BUDGET_CPU, cfg.max_num_seqs)
    return budget if budget < cfg.max_num_batched_tokens else None


def long_mixed_budget(cfg: EngineConfig, platform: str, mixed: int | None) -> int | None:
    """``max_long_mixed_batched_tokens`` resolved against the resolved mixed budget: ``auto``
    on a CPU is the largest power of two below it (with the default buckets, one of them
    already), if that still leaves a prefill token beside max_num_seqs decodes; else, and
    on accelerators, null."""
    option = cfg.max_long_mixed_batched_tokens
    if option != "auto":
        return option if option is None or mixed is None else min(option, mixed)
    if platform != "cpu" or mixed is None:
        return None
    budget = 1 << ((mixed - 1).bit_length() - 1)
    return budget if budget >= cfg.max_num_seqs else None


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """The resolved engine: what the config leaves to "derive" is decided here.

    Attributes:
        model_config: the checkpoint's architecture (before any KV-head replication).
        dtype: activation dtype; ``weight_dtype`` the decoder layers' linear weights;
            ``kv_dtype`` the KV cache.
        max_model_len: the context limit after capping by the model and the KV pages.
        mesh: the device mesh with tensor parallelism (None on one device).
        num_kv_heads: KV heads held in the cache (replicated up to the ``model`` axis).
        num_pages: KV pages, page 0 the scratch page.
        runner: the runner's configuration (buckets, page table width, backend).
    """

    model_config: ModelConfig
    platform: str
    dtype: str
    weight_dtype: str
    kv_dtype: str
    max_model_len: int
    mesh_config: MeshConfig
    mesh: Mesh | None
    num_kv_heads: int
    backend: AttentionBackend
    num_pages: int
    runner: RunnerConfig
    matmul: str = "xla"  # xla | onednn (float weights packed for oneDNN) | amx (int8 blobs, cpu_int8)
    quantization: str | None = None  # int8: the layers' weights (jaxserve.models.quant)
    max_model_len_asked: int = 0  # before the KV pages capped it

    @property
    def context_cap(self) -> str | None:
        """What start-up reports when the KV cache holds less than max_model_len asked for
        (the context is cut to what one sequence can hold: every page but the scratch page)."""
        if self.max_model_len >= self.max_model_len_asked:
            return None
        return (
            f"max_model_len {self.max_model_len}, not {self.max_model_len_asked}: the KV cache's {self.num_pages - 1} "
            f"pages of {self.runner.page_size} tokens are all one sequence can hold (num_pages / kv_cache_memory_gb)"
        )

    @property
    def weights(self) -> str:
        """The layers' weights as held: their dtype, or int8 and the dots' dtype."""
        return f"{self.quantization} (dots in {self.weight_dtype})" if self.quantization else self.weight_dtype

    @property
    def numerics(self) -> str:
        """What start-up reports: the dtypes in use (and, on a CPU, what ``auto`` saw)."""
        units = (
            f"; this CPU has{'' if has_bfloat16_units() else ' no'} bfloat16 units" if self.platform == "cpu" else ""
        )
        amx = (
            self.backend.name == "cpu"
            and self.kv_dtype == "bfloat16"
            and self.model_config.head_dim % 32 == 0
            and cpu_attention.uses_amx()
        )
        # Without AVX-512 the onednn backend runs its own loop (cpu_panels.h), not oneDNN's.
        own = self.matmul == "onednn" and cpu_matmul.own_loop(self.weight_dtype)
        return (
            f"activations {self.dtype}, layer weights {self.weights} "
            f"({self.matmul} matmuls{' on its own AVX2 loop' if own else ''}), "
            f"KV cache {self.kv_dtype}{' (attention on AMX tiles)' if amx else ''}{units}"
        )

    @property
    def budgets(self) -> str:
        """What start-up reports of the chunked-prefill budgets (max_mixed_batched_tokens may be auto's)."""
        mixed, long = self.runner.max_mixed_batched_tokens, self.runner.max_long_mixed_batched_tokens
        beside = f", {mixed} in a step that also decodes" if mixed else ""
        if long:
            beside += f", {long} when that step carries a long prompt's chunk"
        return f"up to {self.runner.max_num_batched_tokens} tokens a step{beside}"

    @property
    def kv_bytes_per_page(self) -> int:
        """Bytes of one page on one device (all layers, that device's KV heads, padding)."""
        return _kv_bytes_per_page(
            self.backend, self.model_config, self.runner.page_size, self.num_kv_heads, self.kv_dtype, self.mesh_config
        )


def _kv_bytes_per_page(
    backend: AttentionBackend, mcfg: ModelConfig, page_size: int, kv_heads: int, kv_dtype: str, mesh_cfg: MeshConfig
) -> int:
    # A device holds 1/model of every page (its share of the KV heads).
    return backend.kv_bytes_per_page(mcfg.num_layers, page_size, kv_heads, mcfg.head_dim, kv_dtype) // mesh_cfg.model


def device_free_bytes(device) -> int | None:
    """Memory a device can still allocate: its allocator's limit less what is in use on
    accelerators; on CPU (no allocator statistics) the host's MemAvailable. None: unknown."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(plan: EnginePlan, weight_bytes: int, free_bytes: int | None) -> None:
    """Refuses, before anything is allocated, a KV cache that with the weights does not fit
    in the device's free memory (an OOM kill, or an allocator failure minutes later, says
    nothing about which option to change).

    Raises:
        ConfigError: naming num_pages / kv_cache_memory_gb and the figures.
    """
    if free_bytes is None:
        return
    kv = plan.num_pages * plan.kv_bytes_per_page
    headroom = 0.9 * free_bytes - weight_bytes / plan.mesh_config.model  # activations, compiles
    if kv <= headroom:
        return
    fits = max(int(headroom // plan.kv_bytes_per_page), 0)
    gib = 2**30
    raise ConfigError(
        f"num_pages = {plan.num_pages} ({kv / gib:.1f} GiB of KV cache per device) does not fit: the device has "
        f"{free_bytes / gib:.1f} GiB free and the weights take {weight_bytes / plan.mesh_config.model / gib:.1f} GiB; "
        f"at most ~{fits} pages (kv_cache_memory_gb <= {fits * plan.kv_bytes_per_page / gib:.2f}) fit"
    )


def resolve_plan(
    cfg: EngineConfig, mcfg: ModelConfig, *, devices: list | None = None, platform: str | None = None
) -> EnginePlan:
    """Resolves ``cfg`` for model ``mcfg`` on ``devices`` (default: JAX's devices).

    Raises:
        ConfigError: naming the option that does not fit the model or the devices.
    """
    devices = list(devices if devices is not None else jax.devices())
    platform = platform or devices[0].platform
    dtype = default_dtype(platform) if cfg.dtype in (None, "auto") else cfg.dtype
    max_model_len = cfg.max_model_len or min(mcfg.max_position_embeddings, 8192)
    if max_model_len > mcfg.max_position_embeddings:
        raise ConfigError(
            f"max_model_len = {max_model_len}: must be <= the model's "
            f"max_position_embeddings ({mcfg.max_position_embeddings})"
        )
    mesh_cfg = MeshConfig.from_option(cfg.mesh)
    try:
        mesh = make_mesh(mesh_cfg, devices) if mesh_cfg.size > 1 else None
        kv_heads = check_divisible(mcfg.num_heads, mcfg.num_kv_heads, mcfg.intermediate_size, mesh_cfg.model)
        backend = AttentionBackend.resolve(
            cfg.attention_backend,
            page_size=cfg.page_size,
            interpret=cfg.attention_interpret,
            mesh=mesh,
            platform=platform,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    kv_dtype = storage_dtype(cfg.kv_cache_dtype, dtype, platform)
    if backend.name == "cpu" and kv_dtype not in cpu_attention.KV_DTYPES:
        if cfg.attention_backend != "auto":
            raise ConfigError(
                f"kv_cache_dtype = {kv_dtype!r}: attention_backend 'cpu' holds one of "
                f"{', '.join(cpu_attention.KV_DTYPES)}; use attention_backend: reference for {kv_dtype}"
            )
        backend = AttentionBackend.resolve("reference", page_size=cfg.page_size, mesh=mesh, platform=platform)
    if why := backend.page_size_error(cfg.page_size, kv_dtype):
        raise ConfigError(why)
    num_pages, multiple = cfg.num_pages, backend.pages_multiple(kv_dtype)
    if num_pages is None:  # kv_cache_memory_gb is per device (finite and > 0: EngineConfig checks)
        budget = cfg.kv_cache_memory_gb * 2**30
        per_page = _kv_bytes_per_page(backend, mcfg, cfg.page_size, kv_heads, kv_dtype, mesh_cfg)
        num_pages = max(int(budget // per_page) // multiple * multiple, 2, multiple)
    elif num_pages % multiple:
        raise ConfigError(
            f"num_pages = {num_pages}: attention_backend {backend.name!r} needs a multiple of {multiple} for a "
            f"{kv_dtype} KV cache (its scales' memory tiles); use num_pages {num_pages // multiple * multiple or multiple} "
            f"or {-(-num_pages // multiple) * multiple}, or kv_cache_memory_gb"
        )
    # The context cannot outgrow the pages one sequence could hold (all but the scratch page).
    asked, max_model_len = max_model_len, min(max_model_len, (num_pages - 1) * cfg.page_size)
    weight_dtype = storage_dtype(cfg.weight_dtype, dtype, platform)
    if cfg.quantization is not None:
        matmul = resolve_int8_matmul(cfg.matmul_backend, mcfg, weight_dtype, platform, sharded=mesh is not None)
    else:
        matmul = resolve_matmul(cfg.matmul_backend, weight_dtype, platform, sharded=mesh is not None)
    mixed = mixed_budget(cfg, mcfg, platform, matmul, weight_dtype)
    runner = RunnerConfig(
        page_size=cfg.page_size,
        num_pages=num_pages,
        max_model_len=max_model_len,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        min_token_bucket=cfg.min_token_bucket or min(MIN_TOKEN_BUCKET, cfg.max_num_batched_tokens),
        # Accelerators: a TPU sublane tile, where a few padding rows cost nothing. oneDNN
        # matmuls pad the LM head to 8 rows anyway (cpu_matmul.py), so smaller sequence
        # buckets would only add programs to compile (and load at every start). XLA:CPU's
        # dots pay per row: 2 rows there.
        min_seq_bucket=2 if platform == "cpu" and matmul != "onednn" else 8,
        max_mixed_batched_tokens=mixed,
        max_long_mixed_batched_tokens=long_mixed_budget(cfg, platform, mixed),
        attention_backend=backend,
        kv_cache_dtype=kv_dtype,
        warmup_scoring=cfg.warmup_scoring,
        # A CPU's passes over [S, V] logits past ~32 rows read them from memory, not the
        # cache; on accelerators the chunks' loop would only add temporaries.
        logits_chunk_rows=CPU_CHUNK_ROWS if platform == "cpu" else None,
    )
    return EnginePlan(
        mcfg,
        platform,
        dtype,
        weight_dtype,
        kv_dtype,
        max_model_len,
        mesh_cfg,
        mesh,
        kv_heads,
        backend,
        num_pages,
        runner,
        matmul,
        cfg.quantization,
        asked,
    )


def resolve_int8_matmul(option: str, mcfg: ModelConfig, weight_dtype: str, platform: str, *, sharded: bool) -> str:
    """``matmul_backend`` under ``quantization: int8``: ``amx`` (the int8 kernel,
    ``pallas_kernels.cpu_int8``: one CPU device with AMX, bfloat16 dots, every layer
    weight's shape taken) where ``auto`` finds it, else ``xla``.

    Raises:
        ConfigError: ``onednn`` asked for (it packs float weights only).
    """
    if option == "onednn":
        raise ConfigError(
            "matmul_backend 'onednn' packs float weights; quantization 'int8' runs on the int8 AMX kernel or "
            "XLA's dots: use matmul_backend: auto or xla"
        )
    # Group scales need K % 32 == 0, which per-channel scales take too; the kernel's own rules.
    shapes_fit = all(cpu_int8.fits(k, n, 32) for k, n in matmul_shapes(mcfg, packed=True).values())
    fast = platform == "cpu" and not sharded and weight_dtype == "bfloat16" and shapes_fit and cpu_int8.available()
    return "amx" if option == "auto" and fast else "xla"


def resolve_matmul(option: str, weight_dtype: str, platform: str, *, sharded: bool) -> str:
    """``matmul_backend`` resolved: ``onednn`` needs one CPU device and the library; ``auto``
    picks it where it has a fast kernel for the weights: float32, or bfloat16 on a CPU with
    bfloat16 units (2-4x XLA's dots at decode batch sizes on an AMX CPU; float32 offline
    1.28x, with the same greedy tokens) or on the kernel's own loop (CPUs without AVX-512).

    Raises:
        ConfigError: ``onednn`` asked for where it cannot run.
    """
    if option == "xla":
        return "xla"
    why_not = None
    if platform != "cpu":
        why_not = f"it runs on the CPU only, but JAX's platform is {platform!r}"
    elif sharded:
        why_not = "it runs on one CPU device, not a mesh"
    elif weight_dtype not in cpu_matmul.DTYPES:
        why_not = f"weight_dtype {weight_dtype!r} is not one of {', '.join(cpu_matmul.DTYPES)}"
    elif not cpu_matmul.available(weight_dtype):
        why_not = cpu_matmul.build_error(weight_dtype)
    if option == "onednn":
        if why_not:
            raise ConfigError(f"matmul_backend 'onednn': {why_not}; use matmul_backend: xla or auto")
        return "onednn"
    # bfloat16 weights are fast on oneDNN with bfloat16 units, and on the kernel's own loop
    # without AVX-512 (widened in registers: half of float32's bytes to stream).
    fast = weight_dtype == "float32" or has_bfloat16_units() or cpu_matmul.own_loop(weight_dtype)
    return "onednn" if fast and why_not is None else "xla"
