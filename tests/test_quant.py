"""``quantization: int8``: GGUF blocks kept as the file has them, per-channel int8 for float
checkpoints, and the model on int8 weights against its float self."""

from __future__ import annotations

import codecs
import dataclasses
import this

import gguf
import numpy as np
import pytest
from gguf import quants

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.models.loading import int8_weights, weight_bytes
from jaxserve.models.quant import dequantize, gguf_blocks, quantize_per_channel
from pallas_kernels import cpu_int8
from tests.conftest import rng_tokens

# A fixed text that ships with every Python: the log-likelihood measure of quality.
ZEN = codecs.decode(this.s, "rot13")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_are_exactly_ggufs_own_dequantization(qtype):
    """Values, block scales and Q4_1's minimums, recombined, give gguf's dequantized float
    weights bit for bit: the int8 form adds no rounding of its own."""
    w = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)  # [out, in]
    data = quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    q, scale, offset = gguf_blocks(data, qtype, 24, 96)
    assert q.dtype == np.int8 and scale.dtype == np.float16 and scale.shape == (24, 3)
    assert (offset is not None) == (qtype == "Q4_1")
    expected = quants.dequantize(data, gguf.GGMLQuantizationType[qtype]).reshape(24, 96)
    got = dequantize(q.T, scale.T, None if offset is None else offset.T).T
    np.testing.assert_array_equal(got, expected)


def test_q4_k_super_blocks_are_exactly_ggufs_own_dequantization():
    """Q4_K (256-value super-blocks, 6-bit scales and minimums per 32): any bytes make a
    block, so random ones (with small finite float16 ``d``, ``dmin``) cover every bit of
    the scale packing."""
    rng = np.random.default_rng(0)
    rows, k = 6, 512
    blocks = rng.integers(0, 256, (rows, k // 256, 144)).astype(np.uint8)
    d = (0.01 * rng.random((rows, k // 256, 2))).astype(np.float16)
    blocks[..., :4] = d.view(np.uint8).reshape(rows, k // 256, 4)
    data = blocks.reshape(rows, -1)
    q, scale, offset = gguf_blocks(data, "Q4_K", rows, k)
    assert scale.dtype == np.float32 and scale.shape == offset.shape == (rows, k // 32)
    expected = quants.dequantize(data, gguf.GGMLQuantizationType.Q4_K).reshape(rows, k)
    np.testing.assert_array_equal(dequantize(q.T, scale.T, offset.T).T, expected)
    with pytest.raises(ValueError, match="not a whole number of 256-element blocks"):
        gguf_blocks(data[:, :72], "Q4_K", rows, 128)


def test_per_channel_quantization_is_within_half_a_step():
    w = np.random.default_rng(1).standard_normal((64, 40)).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero column keeps a usable scale
    q, scale = quantize_per_channel(w)
    assert q.dtype == np.int8 and scale.shape == (1, 40) and np.all(scale > 0)
    assert np.abs(q).max() == 127
    err = np.abs(dequantize(q, scale) - w)
    assert np.all(err <= scale / 2 + 1e-7), err.max()
    assert not np.any(dequantize(q, scale)[:, 3])


def test_bad_quantization_options_are_one_clear_error():
    with pytest.raises(ConfigError, match="quantization = 'int4': must be one of int8"):
        EngineConfig(quantization="int4")
    from jaxserve.plan import resolve_plan
    from tests.test_numerics import TINY

    cfg = EngineConfig(num_pages=16, quantization="int8", matmul_backend="onednn")
    with pytest.raises(ConfigError, match="matmul_backend 'onednn' packs float weights; quantization 'int8'"):
        resolve_plan(cfg, TINY, platform="cpu")
    assert resolve_plan(dataclasses.replace(cfg, matmul_backend="auto"), TINY, platform="cpu").matmul == "xla"


def _prompt_logprobs(llm, ids):
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return np.array(out.prompt_logprobs[1:])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_int8_weights_track_the_float_model(tiny_model_dir, arch):
    """Per-channel int8 (a Hugging Face checkpoint): every prompt token's log-probability
    within 0.05 of float32's, the layer weights a quarter of float32's bytes (plus one
    scale per column), zero compiles after warm-up, pages all returned."""
    path, _ = tiny_model_dir(arch)
    opts = dict(dtype="float32", num_pages=64, max_num_batched_tokens=64, max_num_seqs=4, progress=False)
    ref = LLM(str(path), warmup=False, **opts)
    llm = LLM(str(path), quantization="int8", **opts)
    assert "int8 layer weights, per-channel" in llm.handle.numerics
    ids = rng_tokens(90, llm.model_config.vocab_size, seed=3)
    np.testing.assert_allclose(_prompt_logprobs(llm, ids), _prompt_logprobs(ref, ids), atol=0.05)

    cfg = llm.model_config
    quant = int8_weights(cfg, "float32")
    float_bytes = weight_bytes(cfg, "float32")
    int8_bytes = weight_bytes(cfg, "float32", quant=quant)
    layer_params = sum(k * n for k, n in _shapes(cfg).values()) * cfg.num_layers
    scales = sum(n for _, n in _shapes(cfg).values()) * cfg.num_layers
    assert float_bytes - int8_bytes == layer_params * 3 - scales * 4

    before = llm.stats()["num_compiles"]
    for seed in range(6):
        llm.engine.add_request(rng_tokens(20 + 13 * seed, cfg.vocab_size, seed), SamplingParams(max_tokens=9))
    while llm.engine.has_unfinished():
        llm.engine.step()
        llm.scheduler.check_integrity()
    assert llm.stats()["num_compiles"] == before
    assert llm.stats()["kv_pages_held"] == 0


def _shapes(cfg):
    from jaxserve.models.llama import matmul_shapes

    return matmul_shapes(cfg)


SMOLLM2 = dict(max_num_batched_tokens=256, max_num_seqs=8, num_pages=128, progress=False, warmup=False)
HELD_OUT = [
    "The capital of France is",
    "def quicksort(arr):",
    "Write a haiku about autumn.",
    "The three laws of robotics are",
    "In 1969, Neil Armstrong",
    "Photosynthesis is the process",
    "import numpy as np\nx =",
    "Once upon a time, in a small village,",
]


def test_smollm2_gguf_blocks_give_the_float_models_logits(smollm2_path):
    """The shipped GGUF's Q4_1 blocks, held as int8 + float16 scales and minimums, are the
    very weights its float expansion gives: the same prompt log-probabilities (float32
    dots, XLA both ways) and the same greedy tokens, at ~0.6x the bytes of bfloat16."""
    flt = LLM(str(smollm2_path), dtype="float32", matmul_backend="xla", **SMOLLM2)
    q8 = LLM(str(smollm2_path), dtype="float32", quantization="int8", **SMOLLM2)
    assert "Q4_1 blocks (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)" in q8.handle.numerics
    ids = q8.encode(ZEN)
    np.testing.assert_allclose(_prompt_logprobs(q8, ids), _prompt_logprobs(flt, ids), atol=2e-5)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in q8.generate(HELD_OUT, params)] == [o.token_ids for o in flt.generate(HELD_OUT, params)]

    cfg = q8.model_config
    layers = sum(k * n for k, n in _shapes(cfg).values()) * cfg.num_layers
    held = weight_bytes(cfg, "float32", "bfloat16", quant=q8.handle.quant) - weight_bytes(
        cfg, "float32", "bfloat16", quant=None
    )
    assert held == -layers * (2 - 1 - 2 * 2 / 32)  # int8 + float16 scale and minimum per 32, against bfloat16


@pytest.fixture(scope="module")
def smollm2_float_reference(smollm2_hf_dir):
    """float32 SmolLM2 and what it says of the held-out text: the Zen's mean prompt
    log-likelihood, and its greedy continuations (32 tokens) of the held-out prompts."""
    ref = LLM(str(smollm2_hf_dir), dtype="float32", **SMOLLM2)
    zen = ref.encode(ZEN)
    prompts = [ref.encode(p) for p in HELD_OUT]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    conts = [o.token_ids for o in ref.generate(prompts, greedy)]
    return _prompt_logprobs(ref, zen).mean(), zen, list(zip(prompts, conts, strict=True))


def _quality(llm, reference) -> tuple[float, int, int]:
    """(mean log-likelihood of the Zen minus float32's, teacher-forced top-1 agreements
    with float32's greedy continuations, positions)."""
    zen_mean, zen, continuations = reference
    delta = _prompt_logprobs(llm, zen).mean() - zen_mean
    outs = llm.generate([p + c for p, c in continuations], SamplingParams(max_tokens=1, prompt_logprobs=1))
    agree = total = 0
    for (prompt, cont), out in zip(continuations, outs, strict=True):
        top = [t[0][0] for t in out.prompt_top_logprobs[len(prompt) :]]
        agree += sum(a == b for a, b in zip(top, cont, strict=True))
        total += len(cont)
    return delta, agree, total


# Measured (2-core Xeon, float32 activations): per-channel int8 weights -0.016 nats, 243/256
# (bfloat16 weights alone: +0.006, 253/256); int8 KV +0.020, 254/256; float8_e4m3fn KV
# -0.000, 246/256. Thresholds: 0.04 nats per token and 90% agreement for all of them.
@pytest.mark.parametrize(
    "options",
    [{"quantization": "int8"}, {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "float8_e4m3fn"}],
    ids=["int8-weights", "int8-kv", "fp8-kv"],
)
def test_smollm2_8bit_quality(smollm2_hf_dir, smollm2_float_reference, options):
    """8-bit weights (per channel, from float32) or an 8-bit KV cache, against float32 on
    held-out text: mean log-likelihood of the Zen of Python within 0.04 nats per token, and
    the float model's greedy continuations predicted (teacher-forced top-1) at >= 90% of
    the positions (8 prompts x 32 tokens)."""
    llm = LLM(str(smollm2_hf_dir), dtype="float32", **options, **SMOLLM2)
    delta, agree, total = _quality(llm, smollm2_float_reference)
    print(f"{options}: mean log-likelihood {delta:+.4f} nats/token, agreement {agree}/{total}")
    assert abs(delta) < 0.04, delta
    assert agree >= 0.9 * total, (agree, total)


@pytest.mark.skipif(not cpu_int8.available(), reason="needs a CPU with AMX")
def test_int8_on_amx_matches_xlas_path_and_is_batch_invariant(tiny_model_dir):
    """bfloat16 dots on a CPU with AMX: the layers' int8 blobs go through the AMX kernel
    (fused q/k/v and gate/up, as oneDNN's), giving XLA's int8 path's log-probabilities to
    float32 rounding, and every request the same greedy tokens batched as alone."""
    path, _ = tiny_model_dir("qwen2")
    opts = dict(dtype="float32", weight_dtype="bfloat16", quantization="int8", num_pages=96, progress=False)
    opts.update(max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=False)
    amx = LLM(str(path), **opts)
    xla = LLM(str(path), matmul_backend="xla", warmup=False, **opts)
    assert (amx.plan.matmul, xla.plan.matmul) == ("amx", "xla")
    ids = rng_tokens(90, amx.model_config.vocab_size, seed=5)
    np.testing.assert_allclose(_prompt_logprobs(amx, ids), _prompt_logprobs(xla, ids), atol=2e-3)

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    work = [rng_tokens(3 + 29 * i, amx.model_config.vocab_size, seed=10 + i) for i in range(7)]
    alone = [amx.generate([w], greedy)[0].token_ids for w in work]
    before = amx.stats()["num_compiles"]
    reqs = [amx.engine.add_request(w, greedy) for w in work]
    while amx.engine.has_unfinished():
        amx.engine.step()
        amx.scheduler.check_integrity()
    assert [r.output_token_ids for r in reqs] == alone
    assert amx.stats()["num_compiles"] == before and amx.stats()["kv_pages_held"] == 0
