"""8-bit KV caches (``kv_cache_dtype: int8 | float8_e4m3fn``): the per-token scales at the
write, the reference, CPU, GPU and TPU (interpret) kernels reading them, and the engine
around them (page copies carry the scales, no compiles after warm-up, pages all returned).
The CPU kernel's batch invariance over 8-bit caches: tests/test_attention_kernels.py; the
TPU and GPU compilers' own rules: tests/test_tpu_compile.py, tests/test_gpu_compile.py."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.models.config import config_from_hf
from jaxserve.plan import resolve_plan
from pallas_kernels.ragged_paged_attention import BlockSizes, cpu, gpu, ref_ragged_paged_attention, ref_write_kv, tpu
from pallas_kernels.ragged_paged_attention.common import QuantizedKV, quantize_rows
from tests.conftest import TINY, rng_tokens
from tests.test_attention_kernels import _run, make_case

KV8 = ["int8", "float8_e4m3fn"]
TINY_CONFIG = config_from_hf({"model_type": "llama", **TINY})
needs_cpu_kernel = pytest.mark.skipif(not cpu.available(), reason="CPU attention kernel unavailable here")


def _dequantized(values, scales) -> np.ndarray:
    return np.asarray(values).astype(np.float32) * np.asarray(scales)[..., None]


@pytest.mark.parametrize("kv_dtype", KV8)
def test_a_rows_scale_maps_its_largest_value_and_the_rest_round_to_nearest(kv_dtype):
    """Each row (token, head) gets scale = max |x| / qmax; read back, int8 is within half
    a step of the row, float8_e4m3fn within its 3-bit mantissa (2^-4 relative) or its
    smallest subnormal step; a zero row has scale 0 and reads as zeros."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 3, 64)).astype(np.float32) * rng.uniform(0.01, 50, (7, 3, 1)).astype(np.float32)
    x[2, 1] = 0.0
    values, scales = quantize_rows(jnp.asarray(x), kv_dtype)
    assert values.dtype == jnp.dtype(kv_dtype) and scales.dtype == jnp.float32 and scales.shape == (7, 3)
    qmax = 127.0 if kv_dtype == "int8" else 448.0
    np.testing.assert_allclose(np.asarray(scales), np.abs(x).max(-1) / qmax, rtol=1e-7)
    back = _dequantized(values, scales)
    err = np.abs(back - x)
    scale = np.asarray(scales)[..., None]
    if kv_dtype == "int8":
        assert np.all(err <= scale * (0.5 + 1e-5))
    else:
        assert np.all(err <= np.maximum(np.abs(x) * 2**-4, scale * 2**-10) * (1 + 1e-5))
    assert scales[2, 1] == 0 and np.all(back[2, 1] == 0)
    # The largest magnitude of every row is held exactly (up to the scale's rounding).
    np.testing.assert_allclose(np.abs(back).max(-1), np.abs(x).max(-1), rtol=1e-6)


def _quantized_case(c, kv_dtype, scale_lanes=None):
    """The case's cache as an 8-bit cache (its unwritten rows' scales NaN, so a stray read
    shows; so are the padding lanes of ``scale_lanes``-wide rows), and the same case over a
    float32 cache holding exactly the dequantized values."""
    values, scales = quantize_rows(jnp.asarray(np.nan_to_num(c.kv_cache)), kv_dtype)
    unwritten = np.isnan(c.kv_cache).any(-1)
    scales = np.where(unwritten, np.nan, np.asarray(scales)).astype(np.float32)
    dequantized = np.where(unwritten[..., None], np.nan, _dequantized(values, scales))
    pad = (scale_lanes or scales.shape[-1]) - scales.shape[-1]
    scales = np.pad(scales, [(0, 0)] * 3 + [(0, pad)], constant_values=np.nan)

    def round_trip(x):
        return _dequantized(*quantize_rows(jnp.asarray(x), kv_dtype))

    as_float = dataclasses.replace(c, kv_cache=dequantized, k_new=round_trip(c.k_new), v_new=round_trip(c.v_new))
    return QuantizedKV(jnp.asarray(values), jnp.asarray(scales)), as_float


def _attend(write, attend, cache, c, window, interpret=False):
    """``c``'s write and attention over ``cache`` (test_attention_kernels' ``_run``: the
    Pallas kernels interpreted and the reference, both compiled without LLVM's optimizer)."""
    return _run(
        write, attend, dataclasses.replace(c, kv_cache=cache), window, BlockSizes(block_q=16, block_pages=2), interpret
    )


KERNELS = {
    "reference": (ref_write_kv, ref_ragged_paged_attention),
    "cpu": (cpu.write_kv, cpu.ragged_paged_attention),
    "pallas_gpu": (gpu.write_kv, gpu.ragged_paged_attention),  # interpret mode
    "pallas_tpu": (tpu.write_kv, tpu.ragged_paged_attention),  # interpret mode (slow: two cases)
}
LAYOUTS = {"pallas_gpu": gpu.get_kv_cache_shape, "pallas_tpu": tpu.get_kv_cache_shape}  # head_dim padded
BACKEND_NAMES = ["reference", pytest.param("cpu", marks=needs_cpu_kernel)]


SHAPES = [(9, 3, 64, 16, 0), (4, 2, 48, 8, 20)]  # (q heads, KV heads, head_dim, page_size, window)
# The TPU kernels move whole (32, 128) tiles of 8-bit pages: pages of 32 (and KV blocks of
# 2 pages, so the scales of several pages meet in one block).
TPU_CASES = [("int8", 9, 3, 64, 32, 0), ("float8_e4m3fn", 4, 2, 48, 32, 20)]


@pytest.mark.parametrize(
    "kv_dtype, backend, num_heads, num_kv_heads, head_dim, page_size, window",
    [
        *[
            pytest.param(d, b, *shape, marks=[needs_cpu_kernel] if b == "cpu" else [])
            for d in KV8
            for b in ["reference", "cpu", "pallas_gpu"]
            for shape in SHAPES
        ],
        *[(d, "pallas_tpu", *shape) for d, *shape in TPU_CASES],
    ],
)
def test_an_8bit_cache_reads_as_its_dequantized_values(
    kv_dtype, backend, num_heads, num_kv_heads, head_dim, page_size, window
):
    """Attention over an 8-bit cache equals the reference over a float32 cache holding the
    same values (values x scales) to float32 rounding (2e-5): the write quantizes this
    step's K/V per token and head, the readers multiply each row by its scale. head_dim
    48 takes the CPU kernel's generic path; NaN scales on unwritten rows catch stray reads."""
    write, attend = KERNELS[backend]
    seqs = [(1, 33), (12, 20), (1, 9), (16, 16), (3, 30), (1, 1), (9, 70)]  # decodes and chunks
    layout = {"cache_shape_fn": LAYOUTS[backend]} if backend in LAYOUTS else {}
    c = make_case(seqs, num_heads, num_kv_heads, head_dim, window=window, page_size=page_size, **layout)
    cache, as_float = _quantized_case(c, kv_dtype, tpu.scale_lanes(page_size) if backend == "pallas_tpu" else None)
    cache, out = _attend(write, attend, cache, c, window, interpret=backend.startswith("pallas"))
    _, expected = _attend(ref_write_kv, ref_ragged_paged_attention, as_float.kv_cache, as_float, window)
    n = c.num_real_tokens
    np.testing.assert_allclose(out[:n], expected[:n], atol=2e-5, rtol=2e-5)
    assert np.all(out[n:] == 0)
    # This step's rows went in as quantize_rows makes them, scales included.
    slots = c.slot_mapping[: c.num_written]
    page, offset = slots // page_size, slots % page_size
    kv = np.concatenate([c.k_new, c.v_new], axis=1)[: c.num_written].transpose(1, 0, 2)
    values, scales = quantize_rows(jnp.asarray(kv), kv_dtype)
    written = np.asarray(cache.values)[:, 1, page, offset]
    np.testing.assert_array_equal(written[..., : kv.shape[-1]], np.asarray(values))
    assert np.all(written[..., kv.shape[-1] :] == 0)  # padding lanes
    np.testing.assert_array_equal(np.asarray(cache.scales)[:, 1, page, offset], np.asarray(scales))
    # Against the unquantized K/V (naive float64 attention): the quantization's own error.
    tol = 0.05 if kv_dtype == "int8" else 0.25
    np.testing.assert_allclose(out[:n], c.expected, atol=tol)


@needs_cpu_kernel
def test_cpu_kernel_refuses_8bit_values_without_their_scales():
    c = make_case([(1, 5)], 4, 2, 64, page_size=16)
    values, scales = quantize_rows(jnp.asarray(np.nan_to_num(c.kv_cache)), "int8")
    args = (c.kv_lens, c.page_table, c.query_start_loc)
    with pytest.raises(ValueError, match="or a QuantizedKV"):
        cpu.ragged_paged_attention(c.q, values, 1, *args, sm_scale=1.0)
    with pytest.raises(Exception, match="needs scales"):
        np.asarray(cpu.ragged_paged_attention(c.q, QuantizedKV(values, scales[:, :, :3]), 1, *args, sm_scale=1.0))


def test_8bit_cache_bytes_and_backends():
    """A page of an 8-bit cache is (head_dim + 4) / (2 head_dim) of bfloat16's; on the TPU
    backend (head_dim padded to 128) its scales take 128 lanes a page (the HBM tiling),
    and a page smaller than an 8-bit memory tile (32 rows) is refused by name."""
    plans = {
        dtype: resolve_plan(
            EngineConfig(num_pages=16, kv_cache_dtype=dtype, attention_backend="reference"), TINY_CONFIG
        )
        for dtype in ("bfloat16", "int8", "float8_e4m3fn")
    }
    d = TINY_CONFIG.head_dim
    for dtype in KV8:
        assert plans[dtype].kv_bytes_per_page * 2 * d == plans["bfloat16"].kv_bytes_per_page * (d + 4)
    # The same memory holds 2d / (d + 4) times the pages (1.6x at this head_dim 16, 1.88x at 64).
    gb = EngineConfig(kv_cache_memory_gb=0.01, kv_cache_dtype="int8", attention_backend="reference")
    pages = {
        dtype: resolve_plan(dataclasses.replace(gb, kv_cache_dtype=dtype), TINY_CONFIG).num_pages for dtype in plans
    }
    assert abs(pages["int8"] - pages["bfloat16"] * 2 * d / (d + 4)) <= 1
    on_tpu = EngineConfig(num_pages=16, kv_cache_dtype="int8", attention_backend="pallas_tpu", attention_interpret=True)
    with pytest.raises(
        ConfigError,
        match="page_size = 16: attention_backend 'pallas_tpu' needs a multiple of 32 for a int8 KV cache.*use page_size 32, 64, 128",
    ):
        resolve_plan(on_tpu, TINY_CONFIG)
    assert resolve_plan(dataclasses.replace(on_tpu, attention_backend="pallas_gpu"), TINY_CONFIG).kv_dtype == "int8"
    # Its scales keep the kernels' layout only in whole tiles of 8 pages.
    with pytest.raises(ConfigError, match="num_pages = 12: .* multiple of 8 .*use num_pages 8 or 16"):
        resolve_plan(dataclasses.replace(on_tpu, page_size=32, num_pages=12), TINY_CONFIG)
    gb_on_tpu = dataclasses.replace(on_tpu, page_size=32, num_pages=None, kv_cache_memory_gb=0.01)
    assert resolve_plan(gb_on_tpu, TINY_CONFIG).num_pages % 8 == 0
    layers, kv_heads = TINY_CONFIG.num_layers, TINY_CONFIG.num_kv_heads
    for dtype, values, scales in (("int8", 1, 4 * 128 / 32), ("bfloat16", 2, 0)):
        tpu_plan = resolve_plan(dataclasses.replace(on_tpu, page_size=32, kv_cache_dtype=dtype), TINY_CONFIG)
        # head_dim 16 padded to 128 lanes; the scales' row of 32 to 128 lanes.
        assert tpu_plan.kv_bytes_per_page == 2 * layers * kv_heads * 32 * (128 * values + scales)
    with pytest.raises(ConfigError, match="kv_cache_dtype.*int8, float8_e4m3fn"):
        EngineConfig(kv_cache_dtype="int4")


def _prompt_logprobs(llm, ids):
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return np.array(out.prompt_logprobs[1:])


def _serve_after_prefix(llm, prefix, prompts, params):
    """Serves ``prefix`` (cached from then on), then ``prompts`` at once, integrity checked
    after every step. Returns their requests, the pages copied on write meanwhile, and the
    compiles after the prefix."""
    copies = []
    copy_pages = llm.runner.copy_pages
    llm.runner.copy_pages = lambda pairs: (copies.extend(pairs), copy_pages(pairs))
    llm.generate([prefix], params)
    before = llm.stats()["num_compiles"]
    reqs = [llm.engine.add_request(p, params) for p in prompts]
    while llm.engine.has_unfinished():
        llm.engine.step()
        llm.scheduler.check_integrity()
    return reqs, copies, llm.stats()["num_compiles"] - before


@pytest.mark.parametrize("kv_dtype", KV8)
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_engine_with_an_8bit_cache(tiny_model_dir, kv_dtype, backend):
    """A tiny model with an 8-bit cache: prompt log-probabilities near float32's; a request
    whose cached prefix ends inside a page (its copy-on-write copy must carry the scales)
    gives the tokens it gives with nothing cached; zero compiles after warm-up, integrity
    after every step, every page returned."""
    path, _ = tiny_model_dir("llama")
    opts = dict(dtype="float32", page_size=8, num_pages=96, max_num_batched_tokens=64, max_num_seqs=8, progress=False)
    opts["attention_backend"] = backend
    llm = LLM(str(path), kv_cache_dtype=kv_dtype, **opts)
    assert isinstance(llm.runner.kv_cache, QuantizedKV) and llm.runner.kv_cache.dtype == jnp.dtype(kv_dtype)
    vocab = llm.model_config.vocab_size
    ids = rng_tokens(90, vocab, seed=3)
    ref = LLM(str(path), warmup=False, **opts)
    # float8_e4m3fn keeps 3 mantissa bits to int8's ~7: a looser bound.
    atol = 0.05 if kv_dtype == "int8" else 0.15
    np.testing.assert_allclose(_prompt_logprobs(llm, ids), _prompt_logprobs(ref, ids), atol=atol)

    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prefix = rng_tokens(45, vocab, seed=4)
    tails = [rng_tokens(9 + i, vocab, seed=20 + i) for i in range(4)]
    prompts = [prefix[:43] + t for t in tails]  # each cached match ends inside page 5
    fresh = LLM(str(path), kv_cache_dtype=kv_dtype, enable_prefix_caching=False, warmup=False, **opts)
    expected = [fresh.generate([p], greedy)[0].token_ids for p in prompts]

    reqs, copies, compiles = _serve_after_prefix(llm, prefix, prompts, greedy)
    assert copies, "no copy-on-write page: the test does not test the scales' copy"
    assert [r.output_token_ids for r in reqs] == expected
    assert all(r.num_cached_tokens >= 40 for r in reqs)
    assert compiles == 0 and llm.stats()["kv_pages_held"] == 0


def test_the_tpu_kernels_serve_an_8bit_cache(tiny_model_dir):
    """The TPU kernels (interpret mode) in an engine with an int8 cache and the prefix
    cache on give the reference backend's greedy tokens and logprobs (nothing cached
    there): requests whose cached prefix ends inside a page (a copy-on-write page: its
    scale rows in the TPU's 128-lane layout must travel with its values), beside a fresh
    prompt whose prefill chunks share steps with their decodes; integrity after every
    step, every page returned."""
    path, _ = tiny_model_dir("llama")
    opts = dict(dtype="float32", page_size=32, num_pages=16, max_num_batched_tokens=32, min_token_bucket=32)
    opts.update(max_num_seqs=4, kv_cache_dtype="int8", progress=False, warmup=False)
    # Logprobs too: a page whose copy lost its scales reads as zeros, which greedy tokens
    # of a tiny random model may survive.
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    prefix = rng_tokens(62, TINY["vocab_size"], seed=62)
    tails = [rng_tokens(5 + i, TINY["vocab_size"], seed=50 + i) for i in range(2)]
    prompts = [prefix[:60] + t for t in tails]  # each cached match ends inside page 1
    prompts.append(rng_tokens(40, TINY["vocab_size"], seed=40))  # nothing of it cached
    ref = LLM(str(path), attention_backend="reference", enable_prefix_caching=False, **opts)
    expected = [ref.generate([p], greedy)[0] for p in prompts]

    llm = LLM(str(path), attention_backend="pallas_tpu", attention_interpret=True, **opts)
    assert isinstance(llm.runner.kv_cache, QuantizedKV)
    reqs, copies, _ = _serve_after_prefix(llm, prefix, prompts, greedy)  # warmup=False: it compiles
    assert copies, "no copy-on-write page: the test does not test the scales' copy"
    assert all(r.num_cached_tokens >= 56 for r in reqs[:2])
    assert [r.output_token_ids for r in reqs] == [o.token_ids for o in expected]
    for r, o in zip(reqs, expected, strict=True):
        np.testing.assert_allclose(r.output_logprobs, o.logprobs, atol=1e-4)
    assert llm.stats()["kv_pages_held"] == 0
