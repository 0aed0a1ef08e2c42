"""dtype policy: weight_dtype / kv_cache_dtype ``auto`` choose by the device."""

from __future__ import annotations

import pytest

from jaxserve import plan
from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.models.config import config_from_hf
from jaxserve.plan import resolve_plan

TINY = config_from_hf(
    {
        "model_type": "llama",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    }
)


def _plan(bf16_units: bool, monkeypatch, **options):
    monkeypatch.setattr(plan, "has_bfloat16_units", lambda: bf16_units)
    cfg = EngineConfig(num_pages=16, weight_dtype="auto", kv_cache_dtype="auto", **options)
    return resolve_plan(cfg, TINY, platform="cpu")


def test_auto_is_bfloat16_on_a_cpu_with_bfloat16_units(monkeypatch):
    p = _plan(True, monkeypatch)
    assert (p.dtype, p.weight_dtype, p.kv_dtype) == ("float32", "bfloat16", "bfloat16")
    assert p.numerics.endswith("this CPU has bfloat16 units")


def test_auto_is_float32_on_a_cpu_without_them(monkeypatch):
    p = _plan(False, monkeypatch)
    assert (p.dtype, p.weight_dtype, p.kv_dtype) == ("float32", "float32", "float32")
    assert p.numerics.endswith("this CPU has no bfloat16 units")


@pytest.mark.parametrize("own", [True, False])
def test_start_up_says_when_the_matmuls_run_their_own_avx2_loop(monkeypatch, own):
    """Without AVX-512 the onednn backend runs the kernel's own loop (cpu_panels.h), not
    oneDNN's kernels: start-up says which."""
    p = _plan(False, monkeypatch)
    if p.matmul != "onednn":
        pytest.skip("no oneDNN matmul here")
    monkeypatch.setattr(plan.cpu_matmul, "own_loop", lambda dtype: own)
    assert ("layer weights float32 (onednn matmuls on its own AVX2 loop)" in p.numerics) == own, p.numerics


def test_auto_keeps_a_narrow_activation_dtype_and_explicit_values_win(monkeypatch):
    p = _plan(True, monkeypatch, dtype="float16")
    assert (p.weight_dtype, p.kv_dtype) == ("float16", "float16")
    monkeypatch.setattr(plan, "has_bfloat16_units", lambda: True)
    p = resolve_plan(EngineConfig(num_pages=16, weight_dtype="float32"), TINY, platform="cpu")
    assert (p.weight_dtype, p.kv_dtype) == ("float32", "float32")


def test_a_bad_dtype_names_auto_among_the_allowed():
    with pytest.raises(ConfigError, match="weight_dtype = 'fast': must be one of float32, bfloat16, float16, auto"):
        EngineConfig(weight_dtype="fast")
