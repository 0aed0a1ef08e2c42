"""Fixed shapes are a contract: after warm-up, no request mix compiles anything.

A property test over random mixes of sampling parameters (greedy and sampled, penalties,
logprobs, prompt logprobs (``warmup_scoring``), stop ids, min_tokens, seeds, ignore_eos, structured
output) and prompt / output lengths, with
prefix sharing and preemption in play, stepping through the same engine every time.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve import LLM, SamplingParams

VOCAB = 320


@pytest.fixture(scope="module")
def warm_llm(tiny_model_dir):
    # Few pages: long mixes preempt and recompute; prefix caching copies pages.
    llm = LLM(
        str(tiny_model_dir("llama3")[0]),
        dtype="float32",
        page_size=16,
        num_pages=40,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_mixed_batched_tokens=48,  # steps that decode: their own token bucket, warmed too
        warmup_scoring=True,  # prompt_logprobs below: their scoring steps are warmed too
        progress=False,
    )  # warmed up at construction
    return llm


sampling = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 40),
    temperature=st.sampled_from([0.0, 0.0, 0.7, 1.3]),
    top_k=st.sampled_from([0, 0, 1, 20]),
    top_p=st.sampled_from([1.0, 1.0, 0.9, 0.3]),
    min_p=st.sampled_from([0.0, 0.0, 0.1]),
    seed=st.one_of(st.none(), st.integers(0, 2**40)),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
    repetition_penalty=st.sampled_from([1.0, 1.0, 1.2]),
    presence_penalty=st.sampled_from([0.0, 0.0, 0.5]),
    frequency_penalty=st.sampled_from([0.0, 0.0, -0.3]),
    logprobs=st.sampled_from([None, None, 0, 5]),
    prompt_logprobs=st.sampled_from([None, None, None, 0, 3]),  # the scoring forward's variants
    regex=st.sampled_from([None, None, None, "[a-z ]{1,30}"]),  # structured output: its sampler variant
    logit_bias=st.sampled_from([(), (), ((5, 2.0), (9, -100.0))]),
)
requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=150),
        sampling,
        st.integers(0, 10),  # min_tokens, capped at max_tokens
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=requests, shared_prefix=st.lists(st.integers(0, VOCAB - 1), max_size=40))
def test_no_compile_after_warmup_for_any_request_mix(warm_llm, mix, shared_prefix):
    import dataclasses

    llm = warm_llm
    before = llm.stats()["num_compiles"]
    for prompt, params, min_tokens in mix:
        params = dataclasses.replace(params, min_tokens=min(min_tokens, params.max_tokens))
        llm.engine.add_request(shared_prefix + prompt, params)
    while llm.engine.has_unfinished():
        llm.engine.step()
        llm.scheduler.check_integrity()
    assert llm.stats()["num_compiles"] == before
    assert llm.stats()["kv_pages_held"] == 0


@pytest.mark.parametrize(
    "budget, seqs, smallest, mixed, max_model_len",
    [
        (256, 32, 8, None, 600),
        (64, 16, 1, None, 600),
        (20, 24, 8, None, 600),
        (512, 32, 64, None, 600),
        (8, 2, 8, None, 600),
        (512, 32, 8, 192, 600),
        (512, 32, 64, 32, 600),
        (256, 32, 8, 128, 600),
        # A context shorter than a step's budget: each sequence brings fewer tokens than
        # max_model_len (a crash of warm-up's stand-in batch at num_pages 2, max_model_len 16).
        (512, 32, 8, None, 16),
        (512, 32, 8, 96, 40),
        (64, 16, 1, None, 9),
    ],
)
def test_warm_up_covers_exactly_the_bucket_pairs_a_step_can_hit(budget, seqs, smallest, mixed, max_model_len):
    from jaxserve.runner.batch import pack, pick_bucket
    from jaxserve.runner.step import RunnerConfig, bucket_seqs

    cfg = RunnerConfig(16, 40, max_model_len, budget, seqs, min_token_bucket=smallest, max_mixed_batched_tokens=mixed)
    tokens, seq_buckets = cfg.buckets
    if mixed is not None:  # a step that decodes (at most `mixed` tokens) pads to no more than that
        assert pick_bucket(tokens, mixed) == max(mixed, smallest)
    reachable = {
        (pick_bucket(tokens, n), pick_bucket(seq_buckets, k))
        for n in range(1, budget + 1)
        for k in range(1, min(n, seqs) + 1)
        if n <= k * (max_model_len - 1)  # each sequence's share of a step: shorter than max_model_len
    }
    assert set(cfg.bucket_pairs) == reachable
    for t, s in cfg.bucket_pairs:  # and warm-up's stand-in batch really lands in each
        md = pack(bucket_seqs(cfg, t, s), 16, cfg.pages_per_seq, tokens, seq_buckets).md
        assert (len(md.input_ids), len(md.kv_lens)) == (t, s)


@pytest.mark.parametrize("budget, min_seq_bucket", [(1, 8), (4, 8), (6, 2), (64, 8)])
def test_the_samplers_stand_ins_fit_the_largest_token_bucket(budget, min_seq_bucket):
    """A sampler's program depends on its sequence bucket alone; warm-up's stand-in batch
    for it must still fit the token buckets: a budget of 1 token with sequence buckets of
    8 (oneDNN's smallest) asked for 8 tokens and failed warm-up with a ValueError."""
    from jaxserve.runner.batch import pack
    from jaxserve.runner.step import RunnerConfig, sampler_seqs

    cfg = RunnerConfig(16, 40, 600, budget, 32, min_token_bucket=1, min_seq_bucket=min_seq_bucket)
    tokens, seq_buckets = cfg.buckets
    for s in sorted({s for _, s in cfg.bucket_pairs}):
        md = pack(sampler_seqs(cfg, s), 16, cfg.pages_per_seq, tokens, seq_buckets).md
        assert len(md.kv_lens) == s and len(md.input_ids) <= budget
