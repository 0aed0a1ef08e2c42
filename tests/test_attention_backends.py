"""Engine-level checks of the attention backends: the Pallas kernels in interpret mode
and the C++ CPU kernel give the reference backend's greedy tokens, with prefill chunks and decodes mixed in the
same steps; backend selection and its errors."""

from __future__ import annotations

import random

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.attention import AttentionBackend
from jaxserve.errors import ConfigError
from pallas_kernels.ragged_paged_attention import cpu
from tests.conftest import record_steps


def _llm(path, backend: str, **kw) -> LLM:
    opts = dict(
        dtype="float32",
        page_size=8,
        num_pages=64,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        min_token_bucket=32,
        enable_prefix_caching=False,
        progress=False,
        warmup=False,
        attention_backend=backend,
        attention_interpret=backend.startswith("pallas"),
    )
    return LLM(str(path), **{**opts, **kw})


@pytest.fixture(scope="module")
def work_and_reference(tiny_model_dir):
    path, hf = tiny_model_dir("mistral")  # sliding window 24, GQA 2:1
    rng = random.Random(0)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (45, 3, 17)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
    ref = _llm(path, "reference")
    expected = [o.token_ids for o in ref.generate(prompts, params)]
    return path, prompts, params, expected


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_pallas_backend_in_interpret_mode_matches_reference(work_and_reference, backend):
    path, prompts, params, expected = work_and_reference
    llm = _llm(path, backend)
    assert llm.attention_backend.name == backend and llm.attention_backend.interpret
    steps = record_steps(llm)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    # Some step ran a prefill chunk next to a decode.
    mixed = [seqs for seqs in steps if {is_decode for _, _, is_decode in seqs} == {True, False}]
    assert mixed
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_cpu_backend_matches_reference(work_and_reference):
    if not cpu.available():
        pytest.skip(f"the CPU kernel cannot be built here: {cpu.build_error()}")
    path, prompts, params, expected = work_and_reference
    llm = _llm(path, "cpu")
    assert llm.attention_backend.name == "cpu"
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_backend_selection():
    auto_cpu = AttentionBackend.resolve("auto", page_size=16, platform="cpu").name
    assert auto_cpu == ("cpu" if cpu.available() else "reference")
    assert AttentionBackend.resolve("auto", page_size=16, platform="tpu").name == "pallas_tpu"
    gpu = AttentionBackend.resolve("auto", page_size=16, platform="gpu")
    assert gpu.name == "pallas_gpu" and gpu.block_sizes.block_pages == 8
    with pytest.raises(ValueError, match="'pallas_tpu' needs a TPU.*attention_interpret: true"):
        AttentionBackend.resolve("pallas_tpu", page_size=16, platform="cpu")
    with pytest.raises(ValueError, match="not one of: auto, reference, pallas_tpu, pallas_gpu, cpu"):
        AttentionBackend.resolve("flash", page_size=16)
    with pytest.raises(ValueError, match="'cpu' runs on the CPU only"):
        AttentionBackend.resolve("cpu", page_size=16, platform="tpu")


def test_pallas_backend_without_interpret_on_cpu_is_a_config_error(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    with pytest.raises(ConfigError, match="'pallas_gpu' needs a GPU"):
        _llm(path, "pallas_gpu", attention_interpret=False)


def test_cpu_backend_and_a_float16_cache(tiny_model_dir):
    """The C++ kernel reads float32 or bfloat16: auto then takes the reference; asking for
    'cpu' is a config error naming kv_cache_dtype."""
    if not cpu.available():
        pytest.skip(f"the CPU kernel cannot be built here: {cpu.build_error()}")
    path, _ = tiny_model_dir("llama")
    assert _llm(path, "auto", kv_cache_dtype="float16").attention_backend.name == "reference"
    assert _llm(path, "auto", kv_cache_dtype="bfloat16").attention_backend.name == "cpu"
    with pytest.raises(ConfigError, match="kv_cache_dtype = 'float16': attention_backend 'cpu' holds one of"):
        _llm(path, "cpu", kv_cache_dtype="float16")
