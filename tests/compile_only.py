"""What the compile-only TPU and GPU checks share: the kernel shape table, and compiling a
kernel or the engine's step for compile-only devices.

One compile at a time: XLA's compiler already keeps both of CI's cores busy (two worker
processes measured no faster), and concurrent Mosaic compiles in one process crashed
libtpu (v5p).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve import aot
from jaxserve.server.config import load_run_config
from pallas_kernels.ragged_paged_attention import BlockSizes, tpu
from pallas_kernels.ragged_paged_attention.common import QuantizedKV, is_quantized, scales_shape

ROOT = Path(__file__).resolve().parent.parent

# (name, q heads, KV heads, head_dim, page_size, cache dtype, tokens, seqs, window)
# Pairwise cover of: GQA 1/4/8, head_dim 64/128/256, pages 16/32/64/128, bfloat16 and
# float32, decode-only (tokens == seqs) and mixed (tokens > seqs) buckets, sliding window
# on and off. The window and the decode/prefill split are runtime values inside one
# compiled program; the bucket shapes are what changes the program.
KERNEL_SHAPES = [
    ("gqa1-d64-p16-bf16-decode", 8, 8, 64, 16, jnp.bfloat16, 64, 64, 0),
    ("gqa4-d128-p32-bf16-mixed", 32, 8, 128, 32, jnp.bfloat16, 512, 64, 0),
    ("gqa8-d256-p64-bf16-decode-window", 64, 8, 256, 64, jnp.bfloat16, 32, 32, 1024),
    ("gqa1-d128-p128-f32-mixed-window", 8, 8, 128, 128, jnp.float32, 256, 16, 1024),
    ("gqa4-d256-p16-f32-decode", 16, 4, 256, 16, jnp.float32, 64, 64, 0),
    ("gqa8-d64-p32-f32-mixed", 16, 2, 64, 32, jnp.float32, 128, 8, 0),
    ("gqa1-d256-p32-bf16-mixed", 4, 4, 256, 32, jnp.bfloat16, 128, 32, 0),
    ("gqa4-d64-p64-f32-mixed-window", 12, 3, 64, 64, jnp.float32, 512, 32, 4096),
    ("gqa8-d128-p128-bf16-decode", 32, 4, 128, 128, jnp.bfloat16, 16, 16, 0),
    ("gqa4-d128-p16-bf16-mixed-window", 8, 2, 128, 16, jnp.bfloat16, 2048, 64, 4096),
    ("gqa8-d128-p64-f32-decode", 64, 8, 128, 64, jnp.float32, 128, 128, 0),
    ("gqa1-d64-p128-bf16-mixed", 2, 2, 64, 128, jnp.bfloat16, 256, 4, 0),
]


# 8-bit caches (a bfloat16 model around them). The TPU kernels take pages of 32 rows and
# more (an 8-bit memory tile): every row but the first (GPU only).
KV8_SHAPES = [
    ("gqa4-d128-p16-int8-mixed", 32, 8, 128, 16, jnp.int8, 512, 64, 0),
    ("gqa4-d128-p32-int8-mixed", 32, 8, 128, 32, jnp.int8, 512, 64, 0),
    ("gqa1-d64-p32-int8-decode-window", 8, 8, 64, 32, jnp.int8, 64, 64, 1024),
    ("gqa8-d256-p64-fp8-mixed", 64, 8, 256, 64, jnp.float8_e4m3fn, 256, 32, 0),
    ("gqa4-d128-p128-fp8-decode", 32, 8, 128, 128, jnp.float8_e4m3fn, 64, 64, 0),
]


def on_first_device(target):
    """(sharding, abstract mesh) of the target's first device."""
    mesh = Mesh(np.asarray(target.devices[:1]).reshape(1), ("x",))
    return NamedSharding(mesh, P()), mesh.abstract_mesh


def compile_fn(fn, target, *shapes_dtypes, scale_lanes: int | None = None):
    """Compiles ``fn`` for abstract arguments of the given (shape, dtype) on the target; an
    8-bit dtype's cache shape becomes an abstract ``QuantizedKV`` (values and scales, each
    page's row of scales ``scale_lanes`` wide: ``common.scales_shape``)."""
    sharding, abstract_mesh = on_first_device(target)

    def abstract(s, d):
        if is_quantized(d):
            return QuantizedKV(
                jax.ShapeDtypeStruct(s, d, sharding=sharding),
                jax.ShapeDtypeStruct(scales_shape(s, scale_lanes), jnp.float32, sharding=sharding),
            )
        return jax.ShapeDtypeStruct(s, d, sharding=sharding)

    args = [abstract(s, jnp.dtype(d)) for s, d in shapes_dtypes]
    with jax.sharding.use_abstract_mesh(abstract_mesh):
        return jax.jit(fn).lower(*args).compile()


def compile_kernels(kernel, target, shape) -> None:
    """The KV write then ragged paged attention of ``kernel`` (tpu / gpu module) at one
    row of ``KERNEL_SHAPES``, with the block sizes the engine uses."""
    _, hq, hkv, head_dim, page_size, dtype, tokens, seqs, window = shape
    kv_dtype, dtype = dtype, jnp.bfloat16 if is_quantized(dtype) else dtype  # 8-bit: a bfloat16 model
    pages_per_seq = 8192 // page_size
    # Whole sublane tiles, as the engine's TPU caches (AttentionBackend.pages_multiple).
    num_pages = -(-(seqs * pages_per_seq // 4 + 1) // tpu.SUBLANES) * tpu.SUBLANES
    cache = kernel.get_kv_cache_shape(2, num_pages, page_size, hkv, head_dim)
    sizes = BlockSizes(block_q=16, block_pages=max(1, 128 // page_size))

    def step(q, k, v, kv_cache, slot_mapping, kv_lens, page_table, query_start_loc):
        kv_cache = kernel.write_kv(kv_cache, 1, slot_mapping, k, v)
        out = kernel.ragged_paged_attention(
            q, kv_cache, 1, kv_lens, page_table, query_start_loc, window, sm_scale=0.1, block_sizes=sizes
        )
        return out, kv_cache

    i32 = jnp.int32
    compile_fn(
        step,
        target,
        ((tokens, hq, head_dim), dtype),
        ((tokens, hkv, head_dim), dtype),
        ((tokens, hkv, head_dim), dtype),
        (cache, kv_dtype),
        ((tokens,), i32),
        ((seqs,), i32),
        ((seqs, pages_per_seq), i32),
        ((seqs + 1,), i32),
        scale_lanes=tpu.scale_lanes(page_size) if kernel is tpu else None,
    )


@functools.cache
def _target(topology: str):
    return aot.target(topology)


# The rows whose pages are whole TPU memory tiles (the rule the plan enforces:
# AttentionBackend.page_size_error): all but the 16-row 8-bit page.
TPU_SHAPES = [shape for shape in KERNEL_SHAPES + KV8_SHAPES if shape[4] % tpu.tile_rows(shape[5]) == 0]
TPU_CHIPS = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1"}


def kernel_failures(kernel, topology: str, shapes=KERNEL_SHAPES) -> dict:
    """Compiles every row of ``shapes``; returns {row name: first error line} of failures."""
    failed = {}
    for shape in shapes:
        try:
            compile_kernels(kernel, _target(topology), shape)
        except Exception as e:  # noqa: BLE001 - collected: every failing shape is reported
            failed[shape[0]] = str(e).splitlines()[0][:300]
    return failed


@functools.cache
def config_compiler(config: str, topology: str, arch: str = "llama3-8b", overrides=()) -> aot.StepCompiler:
    """The step compiler of a shipped config (``overrides``: ``key=value`` as ``--set`` takes)."""
    engine_cfg, _ = load_run_config(str(ROOT / "configs" / config), list(overrides))
    tgt = _target(topology)
    return aot.StepCompiler(aot.plan_for(engine_cfg, aot.model_config(arch), tgt), tgt)


def compile_every_bucket(compiler: aot.StepCompiler, pairs=None, penalties: bool = True) -> tuple[list, list]:
    """Forward programs of every bucket pair (or of ``pairs``), samplers of every sequence
    bucket, and (``penalties``) the penalised sampler at the largest one (the same program
    as at smaller buckets, with the largest token history: compiling each would add ~1 min
    to CI for no new rule; `jaxserve compile` reports every one)."""
    pairs = pairs or compiler.plan.runner.bucket_pairs
    # One at a time: compiling (or lowering) step programs on several threads at once
    # crashed libtpu here (a segfault in a full CI run), so no thread pool.
    forwards = [compiler.compile_forward(*pair) for pair in pairs]
    seqs = sorted({s for _, s in pairs})
    samplers = [compiler.compile_sample(s) for s in seqs]
    if penalties:
        samplers.append(compiler.compile_sample(seqs[-1], penalties=True))
    return forwards, samplers


def check_step_reports(compiler: aot.StepCompiler, forwards: list, pairs=None) -> None:
    """Every bucket's program holds the weights and the donated cache, and fits the chip."""
    for (tokens, seqs), c in zip(pairs or compiler.plan.runner.bucket_pairs, forwards, strict=True):
        assert c.argument_bytes >= compiler.kv_cache_bytes, (tokens, seqs)
        assert c.alias_bytes >= compiler.kv_cache_bytes, (tokens, seqs)
        assert c.peak_bytes < compiler.target.chip.hbm_bytes, (tokens, seqs, c.peak_bytes)


if __name__ == "__main__":
    # The whole TPU table on every chip (CI splits it: tests/test_tpu_compile.py):
    #   python -m tests.compile_only [v5e v6e v5p]
    import sys

    failures = 0
    for chip in sys.argv[1:] or list(TPU_CHIPS):
        failed = kernel_failures(tpu, TPU_CHIPS[chip], TPU_SHAPES)
        failures += len(failed)
        print(f"{chip}: {len(TPU_SHAPES) - len(failed)} of {len(TPU_SHAPES)} shapes compile", flush=True)
        for name, error in failed.items():
            print(f"  {name}: {error}")
    sys.exit(1 if failures else 0)
