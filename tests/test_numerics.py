"""What the plan's ``auto`` options choose by the device: weight_dtype / kv_cache_dtype (the
dtype policy), and max_mixed_batched_tokens (the budget of a step that decodes, by how fast
the CPU prefills; the scheduler and the runner's buckets get the same resolved value)."""

from __future__ import annotations

import pytest

from jaxserve import plan
from jaxserve.assembly import make_scheduler
from jaxserve.config import EngineConfig
from jaxserve.engine.kv_manager import KVManager
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


@pytest.mark.parametrize(("platform", "dtype"), [("cpu", "float32"), ("tpu", "bfloat16")])
def test_dtype_auto_is_the_platforms_choice_as_null(platform, dtype):
    """vLLM's dtype = auto (its default) picks what null picks: float32 on CPU, bfloat16 on
    accelerators."""
    for given in (None, "auto"):
        assert resolve_plan(EngineConfig(num_pages=16, dtype=given), TINY, platform=platform).dtype == dtype


def test_a_bad_dtype_names_auto_among_the_allowed():
    with pytest.raises(ConfigError, match="weight_dtype = 'fast': must be one of float32, bfloat16, float16, auto"):
        EngineConfig(weight_dtype="fast")


def _budget_plan(monkeypatch, impl: str = "brg:avx512_core_bf16", matmul: str = "onednn", **options):
    """A CPU plan whose oneDNN reports ``impl`` for the prefill's matmul (no library call)."""
    asked = []

    def fake_impl(m, k, n, dtype):
        asked.append((m, k, n, dtype))
        return impl

    monkeypatch.setattr(plan, "resolve_matmul", lambda *args, **kw: matmul)
    monkeypatch.setattr(plan.cpu_matmul, "impl", fake_impl)
    options = {"num_pages": 16, "max_num_batched_tokens": 512, "max_mixed_batched_tokens": "auto", **options}
    return resolve_plan(EngineConfig(**options), TINY, platform="cpu"), asked


@pytest.mark.parametrize(("impl", "budget"), [("brg:avx512_core_amx", 128), ("brg:avx512_core_bf16", 96)])
def test_mixed_budget_auto_is_larger_where_the_prefill_runs_on_amx_tiles(monkeypatch, impl, budget):
    p, asked = _budget_plan(monkeypatch, impl)
    assert p.runner.max_mixed_batched_tokens == budget
    # asked about the model's first packed weight (q|k|v: 64 -> 4 + 2 * 2 heads of 16) at the step's rows
    assert asked == [(512, 64, 128, p.weight_dtype)]
    assert p.budgets == f"up to 512 tokens a step, {budget} in a step that also decodes"


@pytest.mark.parametrize(("matmul", "budget"), [("xla", 96), ("amx", 128)])  # amx: int8 weights' AMX kernel
def test_mixed_budget_auto_without_onednn_asks_nothing(monkeypatch, matmul, budget):
    p, asked = _budget_plan(monkeypatch, matmul=matmul)
    assert (p.runner.max_mixed_batched_tokens, asked) == (budget, [])


def test_mixed_budget_auto_stays_within_max_num_seqs_and_max_num_batched_tokens(monkeypatch):
    assert (
        _budget_plan(monkeypatch, max_num_seqs=100, max_num_batched_tokens=256)[0].runner.max_mixed_batched_tokens
        == 100
    )
    p = _budget_plan(monkeypatch, max_num_batched_tokens=96)[0]  # no smaller budget: no extra bucket either
    assert (p.runner.max_mixed_batched_tokens, p.budgets) == (None, "up to 96 tokens a step")


def test_mixed_budget_integer_or_null_is_taken_as_given(monkeypatch):
    assert _budget_plan(monkeypatch, max_mixed_batched_tokens=200)[0].runner.max_mixed_batched_tokens == 200
    assert _budget_plan(monkeypatch, max_mixed_batched_tokens=None)[0].runner.max_mixed_batched_tokens is None


def test_mixed_budget_auto_on_an_accelerator_is_the_one_budget():
    cfg = EngineConfig(max_num_batched_tokens=512, max_mixed_batched_tokens="auto")
    assert plan.mixed_budget(cfg, TINY, "tpu", "xla", "bfloat16") is None


def test_the_scheduler_and_the_buckets_take_the_resolved_budget(monkeypatch):
    p, _ = _budget_plan(monkeypatch)
    cfg = EngineConfig(num_pages=16, max_num_batched_tokens=512, max_mixed_batched_tokens="auto")
    sched = make_scheduler(cfg, p, KVManager(p.num_pages, cfg.page_size, False))
    assert sched.max_mixed_batched_tokens == 96
    assert p.runner.buckets[0] == [8, 16, 32, 64, 96, 128, 256, 512]  # its step compiled, padded to itself


@pytest.mark.parametrize(("impl", "mixed"), [("brg:avx512_core_amx", 128), ("brg:avx512_core_bf16", 96)])
def test_long_mixed_budget_auto_is_the_power_of_two_below_the_mixed_one(monkeypatch, impl, mixed):
    p, _ = _budget_plan(monkeypatch, impl, max_long_mixed_batched_tokens="auto")
    assert (p.runner.max_mixed_batched_tokens, p.runner.max_long_mixed_batched_tokens) == (mixed, 64)
    assert p.budgets == (
        f"up to 512 tokens a step, {mixed} in a step that also decodes, 64 when that step carries a long prompt's chunk"
    )
    # 64 is a power of two: no bucket of its own, no program more to compile
    assert p.runner.buckets[0] == sorted({8, 16, 32, 64, mixed, 128, 256, 512})
    sched = make_scheduler(EngineConfig(num_pages=16, max_num_batched_tokens=512), p, KVManager(16, 16, False))
    assert sched.max_long_mixed_batched_tokens == 64


def test_long_mixed_budget_auto_is_null_without_room_or_on_an_accelerator_and_an_integer_is_a_bucket(monkeypatch):
    # 64 would leave no prefill token beside 100 decodes; without a mixed budget nothing to go below
    assert (
        _budget_plan(monkeypatch, max_num_seqs=100, max_long_mixed_batched_tokens="auto")[
            0
        ].runner.max_long_mixed_batched_tokens
        is None
    )
    p = _budget_plan(monkeypatch, max_num_batched_tokens=96, max_long_mixed_batched_tokens="auto")[0]
    assert p.runner.max_long_mixed_batched_tokens is None
    cfg = EngineConfig(
        max_num_batched_tokens=512, max_mixed_batched_tokens="auto", max_long_mixed_batched_tokens="auto"
    )
    assert plan.long_mixed_budget(cfg, "tpu", None) is None
    p = _budget_plan(monkeypatch, max_long_mixed_batched_tokens=48)[0]
    assert p.runner.max_long_mixed_batched_tokens == 48
    assert p.runner.buckets[0] == [8, 16, 32, 48, 64, 96, 128, 256, 512]  # its step padded to itself
    assert _budget_plan(monkeypatch, max_long_mixed_batched_tokens=200)[0].runner.max_long_mixed_batched_tokens == 96


def test_start_up_says_when_the_kv_pages_cut_max_model_len():
    """Four pages of 16 tokens hold one sequence of 48 (page 0 is scratch), not the 512
    asked: the context is cut, and start-up says so and why, instead of doing it silently."""
    p = resolve_plan(EngineConfig(num_pages=4, max_model_len=512), TINY, platform="cpu")
    assert p.max_model_len == 48 and p.runner.max_model_len == 48
    assert p.context_cap.startswith("max_model_len 48, not 512: the KV cache's 3 pages of 16 tokens"), p.context_cap
    assert resolve_plan(EngineConfig(num_pages=33, max_model_len=512), TINY, platform="cpu").context_cap is None
