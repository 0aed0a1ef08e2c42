"""Typed, frozen engine configuration, validated with errors naming the key.

Each option is declared once, as a dataclass field made by :func:`option`: its type (the
annotation), default, allowed values (a :class:`Rule`) and doc. The YAML reader, ``--set``
and the offline API (``LLM(**options)``) all construct the dataclass, which checks every
field against its declaration; ``python -m jaxserve.config`` writes the options table of
docs/configuration.md from the same declarations (a test keeps the file current).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any

import yaml

from jaxserve.attention import BACKENDS
from jaxserve.engine.kv_manager import PREFIX_MATCH_MODES
from jaxserve.engine.scheduler import SCHEDULE_POLICIES
from jaxserve.errors import ConfigError
from jaxserve.models.quant import QUANTIZATIONS
from jaxserve.parallel import MeshConfig
from jaxserve.parallel.multihost import DistributedConfig
from pallas_kernels.ragged_paged_attention.common import QUANTIZED_KV_DTYPES

MATMUL_BACKENDS = ("auto", "xla", "onednn")

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
    """Checks every field of a config dataclass against its annotation, then against its
    option's rule, before any value is used: ``kv_cache_memory_gb: lots`` is one
    ConfigError naming the key, not a TypeError three modules later. ``X | None`` allows
    null (and the rule is not asked about null)."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        kinds = _kinds(hints[field.name])
        if not any(value is None if k is type(None) else _is(value, k) for k in kinds):
            allowed = " or ".join("null" if k is type(None) else _TYPE_NAMES.get(k, k.__name__) for k in kinds)
            if float in kinds and isinstance(value, float) and not math.isfinite(value):
                allowed += " (finite)"
            raise ConfigError(f"{prefix}{field.name} = {value!r}: must be {allowed}")
        rule = field.metadata.get("rule")
        if rule is not None and value is not None and not rule.ok(value):
            raise ConfigError(f"{prefix}{field.name} = {value!r}: must be {rule.describe(type(None) in kinds)}")


def _kinds(hint) -> tuple:
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


@dataclasses.dataclass(frozen=True)
class Rule:
    """The values an option allows: the check, and the words its error and the docs use."""

    ok: Callable[[Any], bool]
    allowed: str

    def describe(self, nullable: bool) -> str:
        return f"{self.allowed} (or null)" if nullable else self.allowed


def one_of(*values) -> Rule:
    return Rule(lambda v: v in values, "one of " + ", ".join(map(str, values)))


def at_least(n: int | float, what: str = "an integer") -> Rule:
    return Rule(lambda v: v >= n, f"{what} >= {n}")


def above(n: int | float, what: str = "a number") -> Rule:
    return Rule(lambda v: v > n, f"{what} > {n}")


# A step budget: a number of tokens, or auto (resolved by the platform, jaxserve.plan).
TOKENS_OR_AUTO = Rule(lambda v: v == "auto" if isinstance(v, str) else v >= 1, "an integer >= 1 or auto")


def option(default, doc: str, rule: Rule | None = None):
    """A config field: default, doc (one sentence or two) and the rule its values follow."""
    return dataclasses.field(default=default, metadata={"doc": doc, "rule": rule})


def options_table(cls, prefix: str = "") -> str:
    """The markdown table of a config dataclass's options (docs/configuration.md)."""
    hints = typing.get_type_hints(cls)
    rows = ["| option | type | default | allowed | what it does |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        kinds = _kinds(hints[f.name])
        kind = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        rule = f.metadata.get("rule")
        allowed = rule.describe(type(None) in kinds) if rule else ""
        default = "null" if f.default is None else repr(f.default).lower() if isinstance(f.default, bool) else f.default
        rows.append(f"| `{prefix}{f.name}` | {kind} | `{default}` | {allowed} | {f.metadata.get('doc', '')} |")
    return "\n".join(rows)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine options. ``None`` means "derive from the model and the platform"."""

    model: str = option(
        "smollm2-135m-instruct",
        "An alias (`jaxserve fetch --list`), a Hugging Face directory or a .gguf file.",
        Rule(lambda v: bool(v.strip()), "an alias, a Hugging Face directory or a .gguf path"),
    )
    dtype: str | None = option(
        None,
        "Activation dtype; null or auto (vLLM's word): float32 on CPU (exact against transformers), bfloat16 "
        "on accelerators.",
        one_of(*DTYPES, "auto"),
    )
    weight_dtype: str | None = option(
        None,
        "Storage and matmul dtype of the decoder layers' linear weights and the LM head (null: dtype; a tied "
        "head gets its own copy). The embedding table, norms and attention math keep dtype; on CPUs with "
        "bfloat16 units, bfloat16 under float32 activations runs the layers ~2.5x faster. auto: bfloat16 "
        "under float32 activations where the device has bfloat16 units (accelerators; CPUs with AVX-512 BF16 "
        "or AMX), else dtype.",
        one_of(*DTYPES, "auto"),
    )
    quantization: str | None = option(
        None,
        "int8: the decoder layers' linear weights held as int8 with scales (about half of bfloat16's bytes); the "
        "dots compute in weight_dtype. GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K tensors keep their own blocks of 32 and scales (the "
        "weights llama.cpp computes with); other checkpoints get per-output-channel scales at load. The embedding "
        "table and the LM head stay in dtype / weight_dtype. On one CPU device with AMX and bfloat16 dots, an "
        "int8 AMX kernel (matmul_backend auto); elsewhere XLA's dots. null: float weights (a GGUF file expanded "
        "to weight_dtype).",
        one_of(*QUANTIZATIONS),
    )
    kv_cache_dtype: str | None = option(
        None,
        "Storage dtype of the KV cache (null: dtype); attention widens it to float32. auto: as weight_dtype. "
        "int8 / float8_e4m3fn: 8-bit values with a float32 scale per token and KV head (max |x| / 127, or / 448), "
        "about half of bfloat16's bytes (every attention backend; on pallas_tpu page_size a multiple of 32).",
        one_of(*DTYPES, *QUANTIZED_KV_DTYPES, "auto"),
    )
    page_size: int = option(16, "Tokens per KV page.", one_of(8, 16, 32, 64, 128))
    num_pages: int | None = option(
        None, "KV pages, page 0 the scratch page (null: from kv_cache_memory_gb).", at_least(2)
    )
    kv_cache_memory_gb: float = option(2.0, "KV cache size when num_pages is null.", above(0))
    max_model_len: int | None = option(
        None,
        "Context limit (null: the model's, capped at 8192); either is capped at what the KV pages hold, which start-up then says.",
        at_least(1),
    )
    max_num_batched_tokens: int = option(
        256, "Tokens per step (the chunked-prefill budget); also the largest token bucket.", at_least(1)
    )
    max_mixed_batched_tokens: int | str | None = option(
        None,
        "Tokens per step when the step also decodes (null: max_num_batched_tokens). A prefill chunk makes "
        "that step, and so one inter-token gap of every running stream, longer: this bounds the gap while "
        "a step with nothing to decode (a lone prompt, a burst of arrivals) still takes max_num_batched_tokens. "
        "Also a token bucket. From max_num_seqs (room for a prefill token beside a full batch of decodes) "
        "up to max_num_batched_tokens. auto: by how fast the CPU prefills (128 where the linear layers run "
        "on AMX tiles, 96 on other CPUs; start-up reports it), null on accelerators.",
        TOKENS_OR_AUTO,
    )
    max_long_mixed_batched_tokens: int | str | None = option(
        None,
        "Tokens per step when the step decodes and carries a chunk of a long prompt: one whose uncached "
        "part is more than max_num_batched_tokens (even alone it takes several steps). Such a prompt makes "
        "many steps in a row long, deeper and dearer as its attention grows, so its chunks get this smaller "
        "step while short prompts keep max_mixed_batched_tokens (null: the same). Also a token bucket; from "
        "max_num_seqs up to max_num_batched_tokens. auto: on a CPU the largest power of two below the "
        "resolved max_mixed_batched_tokens (64 for 96 and 128; start-up reports it), null on accelerators.",
        TOKENS_OR_AUTO,
    )
    max_num_seqs: int = option(32, "Sequences per step; also the largest sequence bucket.", at_least(1))
    min_token_bucket: int | None = option(
        None,
        "Smallest token bucket (null: min(8, max_num_batched_tokens)). XLA:CPU computes each row of a matmul "
        "the same way at any row count, so a request's tokens do not depend on its batch; 64 restores the "
        "guarantee on XLA:CPU builds before YNNPACK, whose rows agreed only from 64 up.",
        at_least(1),
    )
    attention_backend: str = option(
        "auto", "auto: Pallas kernels on TPU / GPU, the C++ kernel on CPU.", one_of(*BACKENDS)
    )
    attention_interpret: bool = option(False, "Pallas kernels in interpret mode (CPU testing; slow).")
    matmul_backend: str = option(
        "auto",
        "The decoder layers' linear layers and the LM head. xla: XLA's dots. onednn: oneDNN with weights "
        "packed at load (one CPU device, x86-64 Linux; 2-4x XLA's dots at decode batch sizes on an AMX "
        "CPU); without AVX-512 the kernel's own AVX2 loop instead, for float32 and bfloat16 weights. auto: "
        "onednn on one CPU device where it builds, for float32 weights, or bfloat16 ones on a CPU with "
        "bfloat16 units or without AVX-512; else xla. With quantization int8, auto picks the int8 AMX "
        "kernel where it runs, else xla; onednn is refused.",
        one_of(*MATMUL_BACKENDS),
    )
    mesh: dict | None = option(
        None, "Tensor parallelism: `{data: 1, model: N}` shards weights and KV heads over N devices."
    )
    distributed: str | dict | None = option(
        None, "Multi-host: `auto` or `{coordinator_address, num_processes, process_id}`."
    )
    enable_prefix_caching: bool = option(True, "Reuse cached K/V of shared prefixes (radix tree, token granularity).")
    prefix_match: str = option(
        "token",
        "token: reuse up to the exact divergence token (copy-on-write of the last page); page: whole pages only.",
        one_of(*PREFIX_MATCH_MODES),
    )
    schedule_policy: str = option(
        "fcfs", "fcfs, or lpm: longest cached prefix first, with aging.", one_of(*SCHEDULE_POLICIES)
    )
    lpm_aging_steps: int = option(64, "lpm: a request that has waited this many steps goes first.", at_least(1))
    overlap_scheduling: bool = option(
        True,
        "Schedule and send step N+1 while step N runs on the device, and apply step N's tokens (stop checks, "
        "text, streams) while N+1 runs: host work hides behind device work. Outputs are the serial loop's; "
        "a request ended by a stop token or string computes one extra row. false: the serial loop.",
    )
    warmup_scoring: bool = option(
        False,
        "Warm-up also compiles the steps that score prompts (prompt_logprobs; echo with logprobs, as eval "
        "harnesses send; lang.select): one more program per bucket pair. false: each compiles on its first "
        "use, inside that step (and is kept in the compile cache).",
    )
    cache_dir: str | None = option(None, "Model cache (null: $XDG_CACHE_HOME/jaxserve).")
    compile_cache: bool = option(
        True,
        "Keep compiled step programs (and weights packed for the CPU's kernels) in cache_dir/xla (one folder "
        "per machine), so a later start loads them instead of tracing and compiling every bucket and "
        "converting the weights again.",
    )

    def __post_init__(self) -> None:
        check_types(self)
        if self.min_token_bucket is not None and self.min_token_bucket > self.max_num_batched_tokens:
            raise ConfigError(
                f"min_token_bucket = {self.min_token_bucket}: must be at most max_num_batched_tokens "
                f"({self.max_num_batched_tokens})"
            )
        for name in ("max_mixed_batched_tokens", "max_long_mixed_batched_tokens"):
            budget = getattr(self, name)
            if isinstance(budget, int) and not self.max_num_seqs <= budget <= self.max_num_batched_tokens:
                raise ConfigError(
                    f"{name} = {budget}: must be from max_num_seqs ({self.max_num_seqs}) to "
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}), auto or null"
                )
        try:
            MeshConfig.from_option(self.mesh)
            DistributedConfig.from_option(self.distributed)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        return from_options(cls, options, "engine")

    @classmethod
    def from_file(cls, path: str, **options) -> EngineConfig:
        """The engine options of a YAML file as ``jaxserve run --config`` takes (its
        ``server`` section is the server's), with ``options`` over them as ``--set``."""
        data = read_config_file(path)
        data.pop("server", None)
        return cls.from_options(**{**data, **options})


# vLLM's engine arguments that scripts ported from it pass, and what stands for each here:
# the refusal of one says so rather than leaving the reader to search the allowed list.
VLLM_ENGINE_ARGS = {
    "tensor_parallel_size": "tensor parallelism is mesh: {data: 1, model: N}",
    "gpu_memory_utilization": "the KV cache is sized by kv_cache_memory_gb or num_pages",
    "block_size": "a KV page's tokens are page_size",
    "enable_chunked_prefill": "prefill is always chunked, max_num_batched_tokens a step",
    "enforce_eager": "every step shape is compiled once (warm-up); there is no eager mode",
    "trust_remote_code": "no code is loaded from a checkpoint: the architectures are built in",
    "tokenizer": "the tokenizer is the model's own (its directory or GGUF file)",
    "download_dir": "downloads go to cache_dir",
    "seed": "a request's seed is SamplingParams(seed=...), whose tokens do not depend on the batch",
    "swap_space": "a preempted request is recomputed (from the prefix cache where it can be), never swapped out",
    "cpu_offload_gb": "weights are not offloaded",
    "pipeline_parallel_size": "there is no pipeline parallelism (mesh: tensor parallelism)",
}


def from_options(cls, options: dict[str, Any], what: str):
    """``cls(**options)``, an unknown key being one ConfigError that lists the allowed ones
    (and, for a vLLM engine argument, what stands for it here)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names)
    if unknown:
        vllm = [f"{k} is vLLM's: {VLLM_ENGINE_ARGS[k]}" for k in unknown if k in VLLM_ENGINE_ARGS and what == "engine"]
        raise ConfigError(
            f"unknown {what} option(s) {', '.join(unknown)}; "
            + "".join(f"{v}; " for v in vllm)
            + f"allowed: {', '.join(sorted(names))}"
        )
    return cls(**options)


class _Loader(yaml.SafeLoader):
    """YAML as PyYAML reads it, but ``1e9`` and ``5e-1`` are numbers, as YAML 1.2 (and
    JSON) has them: PyYAML follows YAML 1.1, whose floats need a dot, so
    ``kv_cache_memory_gb: 1e9`` was the string '1e9' and its error "must be a number"."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml(stream):
    return yaml.load(stream, Loader=_Loader)


def read_config_file(path: str | None, overrides: list[str] = ()) -> dict[str, Any]:
    """A YAML file's mapping (``{}`` without a file) with ``key=value`` overrides applied;
    dotted keys reach into sections (``server.port=50052``), values are parsed as YAML."""
    data: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as f:  # bytes: YAML finds the encoding and names a bad byte
                data = _yaml(f) or {}
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
        try:
            node[leaf] = _yaml(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML: {str(e).splitlines()[0]}") from None
    return data


def main() -> None:
    """Prints docs/configuration.md (``python -m jaxserve.config > docs/configuration.md``)."""
    from jaxserve.server.config import ServerConfig

    print(DOC_HEADER)
    print(options_table(EngineConfig))
    print(SERVER_DOC)
    print(options_table(ServerConfig, "server."))


DOC_HEADER = """# Configuration

Generated from the declarations in `jaxserve/config.py` and `jaxserve/server/config.py` by
`python -m jaxserve.config > docs/configuration.md` (a test fails when it is out of date).

Engine options are the top-level keys of a `jaxserve run --config` YAML file, `--set KEY=VALUE`
overrides (on `jaxserve run` and every `jaxserve bench` that builds an engine) and keyword
arguments of the offline `LLM(...)`. Unknown keys and bad values are rejected with one message
naming the key and what it allows. Values in the file and after `--set KEY=` are YAML, with
numbers as YAML 1.2 writes them (`1e9` and `5e-1` are numbers, not strings).

## Engine
"""

SERVER_DOC = """
## Server

The `server:` section of a `jaxserve run` config (`--set server.port=50052`).
"""


if __name__ == "__main__":
    main()
