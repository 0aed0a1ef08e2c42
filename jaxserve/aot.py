"""Deviceless ahead-of-time compilation of the engine's step for a TPU (or GPU) topology.

The real TPU compiler (libtpu, Mosaic included) runs on any machine against compile-only
devices (``jax.experimental.topologies``); so does XLA's GPU compiler with a target
description. ``StepCompiler`` builds the engine's jitted step exactly as ``ModelRunner``
does (``make_forward`` and ``make_sample``), with weights, KV cache and step inputs as abstract
arrays sharded over the plan's mesh, and compiles it for every (token bucket, sequence
bucket) pair. No checkpoint is read and nothing is allocated. Each compile reports the
memory the device needs (``memory_analysis``) and the work XLA counts (``cost_analysis``).

Roofline: a step takes at least max(FLOPs / peak FLOP/s, bytes / HBM bandwidth) per
device. XLA's counts cannot give those (the layer loop's body is counted once, a Pallas
kernel's operands whole), so ``Workload`` counts them from the weights and the KV layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve import compile_cache
from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.models.config import ModelConfig, config_from_hf
from jaxserve.models.loading import MATMUL_PARAMS, abstract_model, int8_weights
from jaxserve.parallel import kv_cache_sharding, param_sharding
from jaxserve.plan import EnginePlan, resolve_plan
from jaxserve.runner.step import (
    bucket_seqs,
    greedy,
    make_forward,
    make_sample,
    make_scored_forward,
    sampler_seqs,
    step_inputs,
)

# Architectures by name, for sizing without a download: Llama-family config.json fields.
_PRESET_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
)  # fmt: skip
_PRESET_SHAPES = {
    "llama3-8b": (128256, 4096, 14336, 32, 32, 8, 500000.0, 8192, False),
    "llama2-7b": (32000, 4096, 11008, 32, 32, 32, 10000.0, 4096, False),
    "smollm2-135m": (49152, 576, 1536, 30, 9, 3, 100000.0, 8192, True),
}
PRESETS: dict[str, dict] = {
    name: {"model_type": "llama", "rms_norm_eps": 1e-5, **dict(zip(_PRESET_FIELDS, shape, strict=True))}
    for name, shape in _PRESET_SHAPES.items()
}
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
PRESETS["llama3.1-8b"] = {
    **PRESETS["llama3-8b"],
    "rope_scaling": {**_LLAMA3_ROPE, "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072,
}

# Peak dense bfloat16 FLOP/s, HBM bytes/s and HBM bytes per GPU (vendor datasheets, SXM).
GPU_CHIPS = {"h100": (989e12, 3.35e12, 80 * 10**9), "h200": (989e12, 4.8e12, 141 * 10**9)}
TPU_CHIPS = {"TPU v5 lite": "TPU_V5E", "TPU v5e": "TPU_V5E", "TPU v6 lite": "TPU_V6E", "TPU v5": "TPU_V5P"}


@dataclasses.dataclass(frozen=True)
class Chip:
    """One device's peak figures."""

    kind: str
    hbm_bytes: int
    peak_flops: float  # dense bfloat16
    hbm_bandwidth: float  # bytes / s


@dataclasses.dataclass(frozen=True)
class Target:
    """Compile-only devices of a topology, and what one of them can do."""

    name: str
    platform: str  # tpu | gpu
    devices: list
    chip: Chip


def model_config(arch: str) -> ModelConfig:
    """A preset name (``PRESETS``), a config.json, or a directory holding one."""
    if arch in PRESETS:
        return config_from_hf(PRESETS[arch])
    path = Path(arch)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"--arch {arch!r}: not a preset ({', '.join(PRESETS)}) nor a config.json or a directory holding one"
        )
    try:
        return config_from_hf(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ConfigError(f"--arch {arch}: {path} is not valid JSON ({e})") from None


def tpu_target(topology: str) -> Target:
    """Compile-only TPU devices, e.g. ``v5e:2x2``, ``v6e:2x2``, ``v5p:2x2x1`` (needs libtpu)."""
    from jax.experimental import topologies
    from jax.experimental.pallas import tpu as pltpu

    platforms = jax.config.jax_platforms
    if platforms and "tpu" not in platforms.split(","):
        # libtpu's one-process lock (/tmp/libtpu_lockfile) guards a TPU VM's chips. A process
        # whose JAX runs on the CPU drives none, so the lock would only make two compiles at
        # once refuse each other (two test workers; a compile beside another CPU process).
        # With JAX free to pick the TPU, the lock stays: that process may open the chips.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        topo = topologies.get_topology_desc(topology, "tpu")
    except Exception as e:  # noqa: BLE001 - libtpu's errors are plain RuntimeErrors
        first = str(e).splitlines()[0]
        hint = "names look like v5e:2x2, v6e:2x2, v5p:2x2x1, and need libtpu (pip install 'jax[tpu]')"
        if "lockfile" in first:
            hint = "another process holds libtpu's lock; compile-only devices need no chip: run with JAX_PLATFORMS=cpu"
        raise ConfigError(
            f"--topology {topology!r}: no compile-only TPU devices ({type(e).__name__}: {first}); {hint}"
        ) from None
    kind = topo.devices[0].device_kind
    if kind not in TPU_CHIPS:
        raise ConfigError(f"--topology {topology!r}: chip {kind!r} has no peak figures here; known: {set(TPU_CHIPS)}")
    info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion[TPU_CHIPS[kind]], 1 if "lite" in kind else 2)
    chip = Chip(kind, info.hbm_capacity_bytes, float(info.bf16_ops_per_second), float(info.mem_bw_bytes_per_second))
    return Target(topology, "tpu", list(topo.devices), chip)


def target(topology: str) -> Target:
    # A compile-only executable cannot be loaded back (no client to load it into): JAX's
    # persistent cache would only write entries and warn on reading them.
    compile_cache.disable()
    if topology.split(":")[0] in GPU_CHIPS:
        from jaxserve.aot_gpu import gpu_target

        return gpu_target(topology)
    return tpu_target(topology)


def _param_name(path) -> str:
    """A parameter's name (``q_proj``, ``embed``, ...) from its path in the model's state."""
    return [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]


def _abstract(x, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


@dataclasses.dataclass
class Compiled:
    """One compiled program, per device."""

    compile_s: float
    argument_bytes: int  # weights + KV cache + inputs
    temp_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that reuse an argument (the donated KV cache)
    flops: float
    bytes_accessed: float

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    @classmethod
    def of(cls, jitted, *args) -> Compiled:
        t0 = time.perf_counter()
        compiled = jitted.lower(*args).compile()
        seconds = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        cost = compiled.cost_analysis() or {}  # None on the GPU path
        if isinstance(cost, list):  # older jax: one dict per program
            cost = cost[0] if cost else {}
        return cls(
            seconds,
            mem.argument_size_in_bytes,
            mem.temp_size_in_bytes,
            mem.output_size_in_bytes,
            mem.alias_size_in_bytes,
            float(cost.get("flops", 0.0)),
            float(cost.get("bytes accessed", 0.0)),
        )


class StepCompiler:
    """Compiles the plan's step for its buckets on a target's compile-only devices."""

    def __init__(self, plan: EnginePlan, target: Target):
        self.plan, self.target = plan, target
        mesh = plan.mesh or Mesh(np.asarray(target.devices[:1]).reshape(1, 1), ("data", "model"))
        self.mesh = mesh
        self.replicated = NamedSharding(mesh, P())
        # An abstract checkpoint: int8 weights get per-channel scales (a Hugging Face model).
        quant = int8_weights(plan.model_config, plan.weight_dtype) if plan.quantization == "int8" else None
        cfg, model = abstract_model(
            plan.model_config, plan.dtype, plan.weight_dtype, plan.mesh_config.model, quant=quant
        )
        self.graphdef, state = nnx.split(model)
        self.state = jax.tree_util.tree_map_with_path(self._param_spec, state)
        backend = plan.backend
        shape = backend.kv_cache_shape(
            cfg.num_layers, plan.num_pages, plan.runner.page_size, cfg.num_kv_heads, cfg.head_dim
        )
        sharding = kv_cache_sharding(mesh)
        self.kv_cache = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            jax.eval_shape(lambda: backend.new_kv_cache(shape, plan.kv_dtype)),
        )
        self.vocab_size = cfg.vocab_size
        self._forward = jax.jit(make_forward(self.graphdef, backend), donate_argnums=(1,))
        chunk_rows = plan.runner.logits_chunk_rows  # (the plan's: None on accelerators)
        self._scored = jax.jit(make_scored_forward(self.graphdef, backend, chunk_rows), donate_argnums=(1,))
        self._sample = jax.jit(make_sample(plan.runner.max_num_seqs, plan.mesh, chunk_rows))
        self.feed_tokens = jax.ShapeDtypeStruct((plan.runner.max_num_seqs,), np.int32, sharding=self.replicated)

    def _param_spec(self, path, x):
        if self.plan.mesh is None:
            return _abstract(x, self.replicated)
        return _abstract(x, param_sharding(self.mesh, _param_name(path), x.shape))

    def _inputs(self, tokens: int | None, seqs: int, penalties: bool = False):
        """Abstract step inputs of bucket (tokens, seqs); tokens None: the sampler's (``sampler_seqs``)."""
        cfg = self.plan.runner
        stand_ins = sampler_seqs(cfg, seqs) if tokens is None else bucket_seqs(cfg, tokens, seqs)
        _, inputs = step_inputs(cfg, stand_ins, greedy(seqs, penalties))
        return jax.tree.map(lambda x: _abstract(x, self.replicated), inputs)

    def compile_forward(self, tokens: int, seqs: int) -> Compiled:
        """The model half of the step for bucket (tokens, seqs)."""
        md, feed_rows, *_ = self._inputs(tokens, seqs)
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            return Compiled.of(self._forward, self.state, self.kv_cache, md, feed_rows, self.feed_tokens)

    def compile_scored(self, tokens: int, seqs: int) -> Compiled:
        """The model half of a step that also scores every row (prompt logprobs)."""
        md, feed_rows, *_ = self._inputs(tokens, seqs)
        targets = jax.ShapeDtypeStruct((tokens,), np.int32, sharding=self.replicated)
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            return Compiled.of(self._scored, self.state, self.kv_cache, md, feed_rows, self.feed_tokens, targets)

    def compile_sample(self, seqs: int, penalties: bool = False) -> Compiled:
        """The sampler for sequence bucket ``seqs`` (the penalised variant if asked)."""
        _, _, smd, pmd, _ = self._inputs(None, seqs, penalties)
        logits = jax.ShapeDtypeStruct((seqs, self.vocab_size), np.float32, sharding=self.replicated)
        words = (self.vocab_size + 31) // 32  # structured output's token bitmask
        allowed = jax.ShapeDtypeStruct((seqs, words), np.int32, sharding=self.replicated)
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            return Compiled.of(self._sample, logits, smd, pmd, self.feed_tokens, allowed)

    @property
    def kv_cache_bytes(self) -> int:
        """KV cache bytes on one device."""
        return self.plan.num_pages * self.plan.kv_bytes_per_page  # values and any scales


def plan_for(cfg: EngineConfig, arch: ModelConfig, tgt: Target) -> EnginePlan:
    """The engine plan on the target's devices (the config's mesh over the topology)."""
    mesh_size = (cfg.mesh or {}).get("model", 1) * (cfg.mesh or {}).get("data", 1)
    if mesh_size > len(tgt.devices):
        raise ConfigError(
            f"mesh = {cfg.mesh}: needs {mesh_size} devices, but topology {tgt.name} has {len(tgt.devices)}"
        )
    return resolve_plan(cfg, arch, devices=tgt.devices, platform=tgt.platform)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one device does per token: the analytic counts behind the roofline.

    XLA's ``cost_analysis`` counts the layer loop's body once and a Pallas kernel's
    operands whole, so it cannot give a step's real FLOPs and bytes; these counts do.
    """

    weight_bytes: int  # read once per step
    matmul_flops_per_token: float  # the decoder layers' linear layers
    head_flops_per_row: float  # LM head, per sequence that samples
    attention_flops_per_token_per_position: float  # QK and PV, all layers
    kv_bytes_per_token: float  # all layers

    @classmethod
    def of(cls, compiler: StepCompiler) -> Workload:
        plan = compiler.plan
        mcfg = plan.model_config
        per_device = {}
        for path, x in jax.tree_util.tree_flatten_with_path(compiler.state)[0]:
            per_device[_param_name(path)] = math.prod(x.sharding.shard_shape(x.shape)), x.dtype.itemsize
        weight_bytes = sum(n * size for n, size in per_device.values())
        linear = sum(per_device[n][0] for n in MATMUL_PARAMS if n in per_device)
        head = per_device["lm_head" if "lm_head" in per_device else "embed"][0]
        heads_per_device = mcfg.num_heads // plan.mesh_config.model
        return cls(
            weight_bytes=weight_bytes,
            matmul_flops_per_token=2.0 * linear,
            head_flops_per_row=2.0 * head,
            attention_flops_per_token_per_position=4.0 * heads_per_device * mcfg.head_dim * mcfg.num_layers,
            kv_bytes_per_token=plan.kv_bytes_per_page / plan.runner.page_size,
        )

    def step(self, tokens: int, seqs: int, context: int) -> tuple[float, float]:
        """(FLOPs, bytes) of a step of ``tokens`` over ``seqs`` sequences that each see
        ``context`` positions."""
        flops = (
            tokens * self.matmul_flops_per_token
            + seqs * self.head_flops_per_row
            + tokens * context * self.attention_flops_per_token_per_position
        )
        kv = (seqs * context + tokens) * self.kv_bytes_per_token  # read the context, write the new tokens
        return flops, self.weight_bytes + kv

    def seconds(self, chip: Chip, tokens: int, seqs: int, context: int) -> float:
        flops, nbytes = self.step(tokens, seqs, context)
        return max(flops / chip.peak_flops, nbytes / chip.hbm_bandwidth)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def check_fits(compiler: StepCompiler, weights: int, extra_bytes: int = 0) -> None:
    """Raises ConfigError naming the numbers when ``weights`` + KV (+ ``extra_bytes``) bytes
    per device exceed HBM."""
    plan, chip = compiler.plan, compiler.target.chip
    kv = compiler.kv_cache_bytes
    need = weights + kv + extra_bytes
    if need > chip.hbm_bytes:
        parts = f"weights {_gb(weights)} GB + KV cache {_gb(kv)} GB"
        if extra_bytes:
            parts += f" + temporaries {_gb(extra_bytes)} GB"
        raise ConfigError(
            f"does not fit: each {chip.kind} needs {_gb(need)} GB ({parts}) of its {_gb(chip.hbm_bytes)} GB HBM; "
            f"lower kv_cache_memory_gb (now {plan_kv_gb(plan)} GB per device) or raise mesh.model "
            f"(now {plan.mesh_config.model}, on {len(compiler.target.devices)} devices)"
        )


def sequences_that_fit(plan: EnginePlan, context: int) -> int:
    """Sequences of ``context`` tokens whose pages the cache holds at once (page 0 is scratch)."""
    return (plan.num_pages - 1) // -(-context // plan.runner.page_size)


def plan_kv_gb(plan: EnginePlan) -> str:
    return f"{plan.num_pages * plan.kv_bytes_per_page / 2**30:.2f}"


def report(
    compiler: StepCompiler,
    *,
    context: int,
    buckets: list[tuple[int, int]] | None = None,
    batch: int | None = None,
    out=print,
) -> None:
    """Compiles every bucket pair (or ``buckets``) and prints the table and the summary."""
    plan, tgt = compiler.plan, compiler.target
    chip = tgt.chip
    work = Workload.of(compiler)
    check_fits(compiler, work.weight_bytes)
    out(
        f"target {tgt.name}: {len(tgt.devices)} x {chip.kind} ({_gb(chip.hbm_bytes)} GB HBM, "
        f"{chip.peak_flops / 1e12:.0f} TFLOP/s bf16, {chip.hbm_bandwidth / 1e9:.0f} GB/s each)"
    )
    out(
        f"engine: {plan.backend.name}, mesh model={plan.mesh_config.model}, dtype {plan.dtype}, weights "
        f"{plan.weights}, KV {plan.kv_dtype}; {plan.num_pages} pages of {plan.runner.page_size} tokens "
        f"({plan_kv_gb(plan)} GiB per device), max_model_len {plan.max_model_len}"
    )
    out(f"per device: weights {_gb(work.weight_bytes)} GB, KV cache {_gb(compiler.kv_cache_bytes)} GB")
    out(
        f"{'tokens':>6} {'seqs':>4} {'compile s':>9} {'HBM GB':>7} {'of':>6} {'XLA GFLOP':>9} {'XLA GB':>7} "
        f"{'roofline ms':>11}   (roofline: every sequence at context {context})"
    )
    pairs = buckets or plan.runner.bucket_pairs
    peak = 0
    for tokens, seqs in pairs:
        c = compiler.compile_forward(tokens, seqs)
        peak = max(peak, c.peak_bytes)
        ms = 1e3 * work.seconds(chip, tokens, seqs, context)
        out(
            f"{tokens:>6} {seqs:>4} {c.compile_s:>9.1f} {_gb(c.peak_bytes):>7} {_gb(chip.hbm_bytes):>6} "
            f"{c.flops / 1e9:>9.1f} {c.bytes_accessed / 1e9:>7.2f} {ms:>11.2f}"
        )
        if plan.runner.warmup_scoring:  # warm-up compiles it too: it must fit as well
            c = compiler.compile_scored(tokens, seqs)
            peak = max(peak, c.peak_bytes)
            out(f"{'+score':>6} {seqs:>4} {c.compile_s:>9.1f} {_gb(c.peak_bytes):>7} {_gb(chip.hbm_bytes):>6}")
    for seqs in sorted({s for _, s in pairs}):
        for penalties, name in ((False, "sample"), (True, "+pen")):
            c = compiler.compile_sample(seqs, penalties)
            out(f"{name:>6} {seqs:>4} {c.compile_s:>9.1f} {_gb(c.peak_bytes):>7}")
    check_fits(compiler, work.weight_bytes, max(0, peak - work.weight_bytes - compiler.kv_cache_bytes))
    fit = sequences_that_fit(plan, plan.max_model_len)
    out(f"sequences that fit at max_model_len {plan.max_model_len}: {fit} (max_num_seqs {plan.runner.max_num_seqs})")
    out("XLA's FLOPs and bytes count the layer loop's body once and each Pallas kernel's operands whole;")
    out("the roofline uses the step's own counts: FLOPs / peak vs (weights + KV read + KV written) / bandwidth.")
    for ctx in sorted({context, plan.max_model_len}):
        seqs = min(batch or plan.runner.max_num_seqs, plan.runner.max_num_seqs, sequences_that_fit(plan, ctx))
        step = work.seconds(chip, seqs, seqs, ctx)
        out(
            f"decode roofline, {seqs} sequences at context {ctx}: {1e3 * step:.2f} ms per step, "
            f"{seqs / step:,.0f} tokens/s"
        )
