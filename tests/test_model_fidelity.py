"""Tiny random-weight Llama-family models: our loader + paged step vs transformers."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.runner.batch import ScheduledSeq
from pallas_kernels import cpu_matmul
from tests.conftest import TINY_ARCHS, rng_tokens

needs_onednn = pytest.mark.skipif(not cpu_matmul.available("bfloat16"), reason="no oneDNN bfloat16 matmul here")


def _llm(path, **kw) -> LLM:
    opts = {
        "dtype": "float32",
        "page_size": 8,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 4,
        "num_pages": 64,
        "progress": False,
        "warmup": False,
    }
    opts.update(kw)
    return LLM(str(path), **opts)


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_prompt_logits_match_transformers(tiny_model_dir, arch):
    path, hf = tiny_model_dir(arch)
    llm = _llm(path)
    ids = rng_tokens(61, hf.config.vocab_size, seed=3)  # 61 tokens: 8 pages, the last one partial
    pages = llm.kv.pool.allocate(llm.kv.pool.pages_needed(len(ids)))
    ours = llm.runner.logits([ScheduledSeq(ids, 0, pages)])
    ref = _hf_logits(hf, ids)
    assert np.abs(ours - ref).max() < 1e-4


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_chunked_prefill_logits_match_transformers(tiny_model_dir, arch):
    """The same prompt in three chunks, each attending to the pages written before it."""
    path, hf = tiny_model_dir(arch)
    llm = _llm(path)
    ids = rng_tokens(50, hf.config.vocab_size, seed=4)
    pages = llm.kv.pool.allocate(llm.kv.pool.pages_needed(len(ids)))
    parts = [llm.runner.logits([ScheduledSeq(ids[a:b], a, pages)]) for a, b in ((0, 13), (13, 32), (32, 50))]
    ref = _hf_logits(hf, ids)
    assert np.abs(np.concatenate(parts) - ref).max() < 1e-4


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_continuation_matches_transformers(tiny_model_dir, arch):
    path, hf = tiny_model_dir(arch)
    # A 16-token budget forces chunked prefill; page_size 8 makes decode cross pages.
    llm = _llm(path, max_num_batched_tokens=16)
    for seed, n in ((5, 37), (6, 8), (7, 1)):
        ids = rng_tokens(n, hf.config.vocab_size, seed=seed)
        out = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, n:].tolist()
        assert out.token_ids == ref, f"prompt length {n}"
        assert out.finish_reason == "length"
    assert llm.stats()["kv_pages_held"] == 0
    llm.scheduler.check_integrity()


@pytest.mark.parametrize("kv_cache_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("matmul_backend", ["xla", pytest.param("onednn", marks=needs_onednn)])
def test_bfloat16_weights_with_float32_activations(tiny_model_dir, kv_cache_dtype, matmul_backend):
    """weight_dtype: layer matmul weights narrow; embedding, norms and activations stay
    float32; the KV cache too unless kv_cache_dtype narrows it."""
    path, hf = tiny_model_dir("llama")
    llm = _llm(path, weight_dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, matmul_backend=matmul_backend)
    assert llm.plan.matmul == matmul_backend
    layers = llm.runner.state["layers"]
    if matmul_backend == "xla":  # stored as bfloat16 bit patterns (see jaxserve.models.llama.weight)
        assert layers["q_proj"][...].dtype == jnp.uint16
    else:  # q, k, v fused and packed in oneDNN's layout, one [L, bytes] stack
        assert layers["qkv_proj"][...].dtype == jnp.uint8 and "q_proj" not in layers
    assert llm.runner.state["embed"][...].dtype == jnp.float32
    # a bfloat16 cache is held as its bits too (reference.storage_dtype)
    kv_dtype = jnp.uint16 if kv_cache_dtype else jnp.float32
    assert layers["input_norm"][...].dtype == jnp.float32 and llm.runner.kv_cache.dtype == kv_dtype
    ids = rng_tokens(40, hf.config.vocab_size, seed=5)
    pages = llm.kv.pool.allocate(llm.kv.pool.pages_needed(len(ids)))
    ours = llm.runner.logits([ScheduledSeq(ids, 0, pages)])
    assert ours.dtype == np.float32
    assert np.abs(ours - _hf_logits(hf, ids)).max() < 5e-2  # bfloat16 weight rounding (logits are O(1))


@needs_onednn
def test_onednn_layers_add_their_outputs_to_x_in_float32(tiny_model_dir):
    """With bfloat16 weights, oneDNN's layers hand their outputs to the float32 residual
    stream unrounded, as XLA's dots do, so the two backends' logits differ by the order of
    their sums only (the MLP's output once went through bfloat16 on the way: a mean
    difference of 1.8e-3 where it is now 4.8e-4, on a 2-core AMX Xeon)."""
    path, hf = tiny_model_dir("llama")
    ids = rng_tokens(40, hf.config.vocab_size, seed=5)
    logits = {}
    for backend in ("xla", "onednn"):
        llm = _llm(path, weight_dtype="bfloat16", matmul_backend=backend)
        pages = llm.kv.pool.allocate(llm.kv.pool.pages_needed(len(ids)))
        logits[backend] = llm.runner.logits([ScheduledSeq(ids, 0, pages)])
    assert np.abs(logits["xla"] - logits["onednn"]).mean() < 1e-3
