"""Compile-only checks for TPUs: the real TPU compiler (libtpu, Mosaic included) runs here
against compile-only devices, so the tiling, alignment, VMEM and layout rules that
interpret mode never applies are enforced on every change. No TPU is needed.

- both TPU kernels (KV write + ragged paged attention) over a table of shapes, 8-bit
  caches included, for v5e, v6e and v5p;
- the engine's whole step (model, KV write, attention, sampler) at the largest bucket
  pair of the shipped v5e config, weights abstract and sharded over the config's mesh
  (the smallest pair: the guide's dry runs, tests/test_docs.py; `jaxserve compile`
  compiles every pair); int8 weights and an int8 KV cache on one v5e chip;
- ``jaxserve compile`` refuses a config that cannot fit (its table: tests/test_docs.py, which
  runs the TPU VM guide's dry runs).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("libtpu", reason="compile-only TPU checks need libtpu (pip install 'jax[tpu]')")

from jaxserve import aot  # noqa: E402
from jaxserve.errors import ConfigError  # noqa: E402
from pallas_kernels.ragged_paged_attention import tpu  # noqa: E402
from tests.compile_only import (  # noqa: E402
    ROOT,
    TPU_CHIPS,
    TPU_SHAPES,
    check_step_reports,
    compile_every_bucket,
    compile_fn,
    config_compiler,
    kernel_failures,
)


@pytest.mark.parametrize("chip", list(TPU_CHIPS))
def test_tpu_kernels_compile_over_the_shape_table(chip):
    """v5e (the smallest VMEM, no bfloat16 VPU) over the whole table and every 8-bit row
    (pages of 32 and more: an 8-bit tile); v5p and v6e over disjoint thirds of both (each
    third holds every dtype), to keep CI's time (`python -m tests.compile_only` runs the
    whole table on every chip: 16 rows each)."""
    table = TPU_SHAPES
    # v6e's third has no float8 row in this order: it takes the table's first one too.
    fp8 = next(row for row in table if row[5] == jnp.float8_e4m3fn)
    shapes = {"v5e": table, "v5p": table[::3], "v6e": [*table[1::3], fp8]}[chip]
    assert {row[5] for row in shapes} == {row[5] for row in table}, "a chip's share lacks a dtype"
    assert not kernel_failures(tpu, TPU_CHIPS[chip], shapes)


def _one_row_write(slots, new, cache):
    """The KV write this project shipped first: one DMA per token row."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(slots_ref, new_hbm, cache_in, cache_hbm, sem):
        del cache_in
        copy = pltpu.make_async_copy(new_hbm.at[0, pl.ds(0, 1)], cache_hbm.at[0, 1, 3, pl.ds(slots_ref[0], 1)], sem)
        copy.start()
        copy.wait()

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(1,),
            in_specs=[any_spec, any_spec],
            out_specs=any_spec,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        input_output_aliases={2: 0},
    )(slots, new, cache)


def test_the_check_catches_a_one_row_bfloat16_write():
    """The compiler enforces what interpret mode never does: a one-row bfloat16 DMA
    (rows pack in pairs) is rejected. The harness must fail on it, or the table above
    proves nothing."""
    cache = tpu.get_kv_cache_shape(2, 8, 16, 1, 128)
    slots = ((4,), jnp.int32)
    with pytest.raises(Exception, match="aligned to tiles"):
        compile_fn(_one_row_write, aot.target("v5e:2x2"), slots, ((2, 4, 128), jnp.bfloat16), (cache, jnp.bfloat16))
    compile_fn(_one_row_write, aot.target("v5e:2x2"), slots, ((2, 4, 128), jnp.float32), (cache, jnp.float32))


@pytest.mark.parametrize("config, topology", [("llama3-8b-tpu-v5e.yaml", "v5e:2x2")])
def test_shipped_tpu_configs_compile_their_largest_bucket_pair(config, topology):
    """The v5e config's whole step at its largest bucket pair (the most of every dimension:
    tokens, sequences, the attention plans' blocks) on the chip with the least HBM and
    VMEM, and its prompt-scoring variant. The smallest pair of both shipped TPU configs is the guide's dry run
    (tests/test_docs.py); the v6e config's largest pair (~50 s) and every pair of either
    (~2.5 min each) are left to `jaxserve compile --config configs/<config> --topology
    <topology> --arch llama3-8b`, to keep CI's time. The kernels' own rules per chip are
    checked over the shape table above. The penalised sampler is left to the dry runs, which
    compile it at the smallest bucket for both configs (~11 s here at the largest, a
    quarter of this test, for the same program with a longer token history)."""
    compiler = config_compiler(config, topology)
    assert compiler.plan.backend.name == "pallas_tpu" and compiler.plan.kv_dtype == "bfloat16"
    assert compiler.plan.runner.logits_chunk_rows is None  # whole on a TPU (a CPU's chunks add temporaries)
    pairs = [max(compiler.plan.runner.bucket_pairs)]
    forwards, samplers = compile_every_bucket(compiler, pairs, penalties=False)
    assert len(forwards) == 1 and samplers
    check_step_reports(compiler, forwards, pairs)
    # The step that scores prompts (every row's logits, log-softmax and top-n: [512, 128256]
    # floats), which warmup_scoring compiles at warm-up and prompt_logprobs on first use.
    scored = compiler.compile_scored(*pairs[0])
    assert scored.alias_bytes >= compiler.kv_cache_bytes
    assert scored.peak_bytes < compiler.target.chip.hbm_bytes, scored.peak_bytes


def test_int8_llama3_8b_fits_one_v5e_chip():
    """``quantization: int8``: Llama-3-8B's layer weights as int8 with per-channel scales
    (the embedding and LM head stay bfloat16) take 9.1 GB, so the model and a 5 GiB KV
    cache fit one v5e chip (bfloat16: 16.1 GB of weights, refused). The int8 weights
    widen inside the dots' fusions: no program holds a temporary the size of a layer's
    bfloat16 weights (gate + up: 117 MB). With ``kv_cache_dtype: int8`` the same 5 GiB
    holds 1.78x the pages (int8 values, a 128-lane row of float32 scales a page: 2272
    pages against 1280), and the scales stay in the layout the kernels read: no copy of
    them (0.6 GB a call when XLA relaid them out) among the temporaries."""
    overrides = ("quantization=int8", "mesh.model=1", "kv_cache_memory_gb=5")
    compiler = config_compiler("llama3-8b-tpu-v5e.yaml", "v5e:2x2", overrides=(*overrides, "kv_cache_dtype=int8"))
    weights = aot.Workload.of(compiler).weight_bytes
    assert 9.0e9 < weights < 9.2e9, weights
    aot.check_fits(compiler, weights)
    assert compiler.plan.kv_dtype == "int8" and compiler.plan.num_pages == 2272, compiler.plan.num_pages
    c = compiler.compile_forward(512, 64)  # the largest bucket pair
    assert c.peak_bytes < compiler.target.chip.hbm_bytes, c.peak_bytes
    assert c.alias_bytes >= compiler.kv_cache_bytes  # values and scales updated in place
    assert c.temp_bytes < 60e6, c.temp_bytes  # 8.5 MB; 125 MB with the widened weights, 630 MB with relaid scales
    bf16 = config_compiler("llama3-8b-tpu-v5e.yaml", "v5e:2x2", overrides=("mesh.model=1", "kv_cache_memory_gb=5"))
    assert bf16.plan.num_pages == 1280
    with pytest.raises(ConfigError, match="does not fit"):
        aot.check_fits(bf16, aot.Workload.of(bf16).weight_bytes)


def test_the_lm_head_is_never_gathered():
    """With the vocabulary sharded, each device computes its logit columns; the step must
    all-gather the logits ([S, V] floats), never the LM head's weights ([E, V])."""
    compiler = config_compiler("llama3-8b-tpu-v5e.yaml", "v5e:2x2")
    md, feed_rows, *_ = compiler._inputs(64, 64)
    with jax.sharding.use_abstract_mesh(compiler.mesh.abstract_mesh):
        lowered = compiler._forward.lower(compiler.state, compiler.kv_cache, md, feed_rows, compiler.feed_tokens)
        text = lowered.compile().as_text()
    gathered = re.findall(r"= \w+\[([\d,]+)\][^=]*? all-gather\(", text)
    assert gathered, "the logits' all-gather is missing from the step"
    sizes = [int(np.prod([int(d) for d in dims.split(",")])) for dims in gathered]
    assert max(sizes) <= 64 * 128256, gathered


def _compile_cli(*extra) -> list[str]:
    config = str(ROOT / "configs" / "llama3-8b-tpu-v5e.yaml")
    return ["compile", "--config", config, "--topology", "v5e:2x2", "--arch", "llama3-8b", *extra]


def test_jaxserve_compile_refuses_a_config_that_cannot_fit(capsys):
    from jaxserve.cli import main

    assert main(_compile_cli("--set", "kv_cache_memory_gb=14")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert re.search(
        r"does not fit: each TPU v5 lite needs [\d.]+ GB \(weights 4.02 GB \+ KV cache 15.03 GB\) of its "
        r"17.20 GB HBM; lower kv_cache_memory_gb \(now 14.00 GB per device\) or raise mesh.model \(now 4, on 4 devices\)",
        err,
    ), err
    assert main(_compile_cli("--set", "mesh.model=8")) == 2
    assert "needs 8 devices, but topology v5e:2x2 has 4" in capsys.readouterr().err


def test_unknown_topology_and_arch_are_one_line_errors():
    with pytest.raises(ConfigError, match="--topology 'v9z:1x1'"):
        aot.tpu_target("v9z:1x1")
    with pytest.raises(ConfigError, match="--arch 'nope': not a preset"):
        aot.model_config("nope")


_HOLD_LIBTPU = """
import os, sys
os.environ.pop("ALLOW_MULTIPLE_LIBTPU_LOAD", None)
from jax.experimental import topologies
topologies.get_topology_desc("v5e:2x2", "tpu")
print("held", flush=True)
sys.stdin.read()
"""


def test_a_compile_beside_a_process_holding_libtpu_still_gets_its_devices():
    """libtpu locks /tmp/libtpu_lockfile per process. Two compile-only processes (the suite's two
    workers, a compile beside a CPU server) must not refuse each other: CI failed on this once.
    The holder is a plain libtpu process; the compile runs in a second child, so neither is
    this worker, which may have loaded libtpu itself."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
    env["JAX_PLATFORMS"] = "cpu"
    with subprocess.Popen(
        [sys.executable, "-c", _HOLD_LIBTPU], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout.readline().strip() == "held"
            compile_only = subprocess.run(
                [sys.executable, "-c", "from jaxserve import aot; print(aot.tpu_target('v5e:2x2').chip.kind)"],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
        finally:
            holder.stdin.close()
            holder.wait(timeout=60)
    assert compile_only.returncode == 0, compile_only.stderr[-2000:]
    assert compile_only.stdout.strip() == "TPU v5 lite"
