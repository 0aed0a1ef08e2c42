"""Compile-only checks for NVIDIA GPUs: XLA's GPU compiler (the jax CUDA plugin, Triton
included) compiles for a described H100 / H200 without one (``jaxserve.aot_gpu``).

Runs where the plugin is installed (``pip install -e ".[gpu-compile]"``) and JAX_PLATFORMS=cpu;
skipped elsewhere.
"""

from __future__ import annotations

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="compile-only GPU checks need the jax CUDA plugin")

from jaxserve import aot  # noqa: E402
from pallas_kernels.ragged_paged_attention import gpu  # noqa: E402
from tests.compile_only import (  # noqa: E402
    KV8_SHAPES,
    check_step_reports,
    compile_every_bucket,
    compile_kernels,
    config_compiler,
    kernel_failures,
)


@pytest.fixture(scope="module")
def h200():
    return aot.target("h200")


def test_gpu_kernels_compile_over_the_shape_table(h200):
    assert not kernel_failures(gpu, "h200")


def test_gpu_kernels_read_8bit_caches(h200):
    """int8 and float8_e4m3fn caches with their scales: the KV write (values and scales in
    one aliased call) and both attention kernels compile for H200."""
    assert not kernel_failures(gpu, "h200", KV8_SHAPES)


def test_the_check_catches_a_kernel_triton_rejects(h200):
    """A tile that is not a power of two is legal in interpret mode and refused by Triton:
    a head_dim of 96 given to the kernel unpadded must fail to compile."""
    shape = ("d96", 8, 2, 96, 16, "bfloat16", 64, 64, 0)
    original = gpu.get_kv_cache_shape
    try:
        gpu.get_kv_cache_shape = lambda L, n, p, h, d: (2 * h, L, n, p, d)  # no padding to a power of two
        with pytest.raises(Exception, match="power of 2"):
            compile_kernels(gpu, h200, shape)
    finally:
        gpu.get_kv_cache_shape = original


def test_shipped_h200_config_compiles_every_bucket_pair():
    compiler = config_compiler("llama3-8b-h200.yaml", "h200")
    assert compiler.plan.backend.name == "pallas_gpu" and compiler.plan.kv_dtype == "bfloat16"
    forwards, samplers = compile_every_bucket(compiler)
    assert len(forwards) >= 30 and samplers
    check_step_reports(compiler, forwards)
    # The step that scores prompts (warmup_scoring; prompt_logprobs), at the largest pair.
    scored = compiler.compile_scored(*max(compiler.plan.runner.bucket_pairs))
    assert scored.alias_bytes >= compiler.kv_cache_bytes
    assert scored.peak_bytes < compiler.target.chip.hbm_bytes, scored.peak_bytes


def test_int8_weights_compile_for_h200_without_a_weight_sized_temporary():
    """``quantization: int8`` on the H200 config: the weights take 9.1 GB against 16.1 in
    bfloat16, and XLA's GPU compiler fuses the int8 widening into the dots: each program's
    temporaries stay below the bfloat16 program's (its cuBLAS workspaces and activations;
    measured 74 / 116 MB against 133 / 141). With the widened weight forced into memory
    they reach 133 / 174 MB."""
    int8 = config_compiler("llama3-8b-h200.yaml", "h200", overrides=("quantization=int8",))
    bf16 = config_compiler("llama3-8b-h200.yaml", "h200")
    assert 9.0e9 < aot.Workload.of(int8).weight_bytes < 9.2e9 and aot.Workload.of(bf16).weight_bytes > 16e9
    for (tokens, seqs), margin in (((64, 8), 20e6), ((512, 64), 0)):
        ours, theirs = int8.compile_forward(tokens, seqs), bf16.compile_forward(tokens, seqs)
        assert ours.temp_bytes <= theirs.temp_bytes - margin, (tokens, seqs, ours.temp_bytes, theirs.temp_bytes)
