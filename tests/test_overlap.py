"""Overlap scheduling: step N+1 is scheduled and sent before step N's tokens are applied,
and the outputs are the serial loop's, whatever ends a request."""

from __future__ import annotations

import random

import pytest

from jaxserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    # 90 usable pages of 8 tokens for 40 requests of up to ~100 tokens: preemption happens.
    llm = LLM(
        str(path),
        dtype="float32",
        page_size=8,
        num_pages=91,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        progress=False,
    )
    llm.compiles_after_warmup = llm.stats()["num_compiles"]
    return llm


def _workload(llm: LLM) -> list[tuple[list[int], SamplingParams]]:
    """Prompts sharing prefixes (the prefix cache hits), greedy and seeded rows, and each
    way a request can end: length, a stop token, a stop string, max_model_len never."""
    rng = random.Random(3)
    shared = [rng.randrange(3, 320) for _ in range(40)]
    prompts = [
        shared[: rng.randint(0, 40)] + [rng.randrange(3, 320) for _ in range(rng.randint(1, 40))] for _ in range(40)
    ]
    free = [SamplingParams(max_tokens=rng.randint(1, 48), temperature=0.0, ignore_eos=True) for _ in prompts]
    outs = _run(llm, list(zip(prompts, free, strict=True)), overlap=False)
    work = []
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        kind = i % 5
        p = dict(max_tokens=free[i].max_tokens, ignore_eos=True)
        if kind == 1 and len(out.output_token_ids) > 4:  # a stop token met partway
            p.update(stop_token_ids=[out.output_token_ids[len(out.output_token_ids) // 2]])
        elif kind == 2 and len(out.output_text) > 8:  # a stop string met partway
            p.update(stop=[out.output_text[len(out.output_text) // 2 : len(out.output_text) // 2 + 3]])
        elif kind == 3:  # seeded sampling with min_tokens and logprobs
            p.update(temperature=0.8, top_p=0.9, seed=i, logprobs=2, min_tokens=2)
        elif kind == 4:  # penalties: the engine waits for the token history
            p.update(temperature=0.7, seed=i, presence_penalty=0.5, repetition_penalty=1.2)
        work.append((prompt, SamplingParams(**({"temperature": 0.0} | p))))
    return work


def _index(items: list, x) -> int:
    return next(i for i, y in enumerate(items) if y is x)


def _run(llm: LLM, work, overlap: bool, calls: list | None = None):
    """Everything submitted at once, integrity checked after every step."""
    engine = llm.engine
    engine.overlap = overlap
    if calls is not None:  # per fetch: how many steps were dispatched after the one it waits for
        dispatch, fetch, handles = engine.runner.dispatch, engine.runner.fetch, []
        engine.runner.dispatch = lambda *a: handles.append(dispatch(*a)) or handles[-1]
        engine.runner.fetch = lambda h: calls.append(len(handles) - 1 - _index(handles, h)) or fetch(h)
    try:
        with engine.owned_by_current_thread("test"):
            reqs = [engine.add_request(ids, p) for ids, p in work]
            while engine.has_unfinished():
                engine.step()
                llm.scheduler.check_integrity()
    finally:
        engine.overlap = True
        vars(engine.runner).pop("dispatch", None)
        vars(engine.runner).pop("fetch", None)
    assert all(r.num_pending == 0 for r in reqs)
    return reqs


def _summary(reqs):
    """What a user gets back. Logprobs to float32 rounding: a step's batch may differ (a row
    wasted on a request that had stopped), and the sampler's log-softmax is one program per
    sequence bucket, which may round the last bit differently (the tokens never differ)."""
    exact = [(r.output_token_ids, r.output_text, r.finish_reason, r.stop_reason) for r in reqs]
    tops = [[[t for t, _ in top] for top in r.output_top_logprobs] for r in reqs]
    values = [x for r in reqs for x in r.output_logprobs + [v for top in r.output_top_logprobs for _, v in top]]
    return exact, tops, values


def test_overlapped_outputs_are_the_serial_loops(llm):
    work = _workload(llm)
    preemptions = llm.stats()["num_preemptions"]
    serial = _summary(_run(llm, work, overlap=False))
    llm.engine.scheduler.kv.clear_cache()  # the same cache state for both runs
    calls = []
    overlapped = _summary(_run(llm, work, overlap=True, calls=calls))
    assert overlapped[:2] == serial[:2]
    assert overlapped[2] == pytest.approx(serial[2], rel=1e-5) and len(serial[2]) > 100  # logprobs came back
    reasons = [s[2] for s in serial[0]]
    assert reasons.count("stop") >= 10 and reasons.count("length") >= 10
    assert llm.stats()["num_preemptions"] > preemptions
    stats = llm.stats()
    assert stats["kv_pages_held"] == 0 and stats["num_compiles"] == llm.compiles_after_warmup
    # Overlapped, the next step goes out before the last one's tokens are waited for: each
    # fetch but the last finds one step dispatched after its own (serial: none).
    assert calls[:-1] == [1] * (len(calls) - 1) and calls[-1] == 0 and len(calls) > 50


def test_a_lone_stream_is_fed_from_the_device(llm):
    """A decode's input token comes from the step before without a host round trip:
    dispatch k+1 precedes fetch k for every step of a lone greedy stream."""
    calls = []
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    serial = _run(llm, [([5, 6, 7, 8], params)], overlap=False)[0].output_token_ids
    overlapped = _run(llm, [([5, 6, 7, 8], params)], overlap=True, calls=calls)[0].output_token_ids
    assert overlapped == serial and len(serial) == 12
    # 12 tokens, 12 steps (the last token's length limit is known when it is scheduled):
    # steps 2..12 went out before the tokens of the step before were waited for.
    assert calls == [1] * 11 + [0]


def test_abort_while_a_step_is_in_flight_frees_everything(llm):
    engine = llm.engine
    with engine.owned_by_current_thread("test"):
        reqs = [engine.add_request([9] * 20, SamplingParams(max_tokens=30, temperature=0.0)) for _ in range(4)]
        for _ in range(3):
            engine.step()
        assert engine._in_flight is not None
        for r in reqs[:2]:
            engine.abort(r.request_id)
        while engine.has_unfinished():
            engine.step()
            llm.scheduler.check_integrity()
    assert [r.finish_reason for r in reqs] == ["abort", "abort", "length", "length"]
    assert llm.stats()["kv_pages_held"] == 0


class _RandomTokens:
    """Stands in for the model runner: a random token for every sequence, no device."""

    num_compiles = 0

    def __init__(self, rng: random.Random):
        self.rng = rng

    def dispatch(self, seqs, sampling, *_):
        import numpy as np

        from jaxserve.runner.sampler import MAX_LOGPROBS, SamplerOutput

        n = len(seqs)
        tokens = np.asarray([self.rng.randint(3, 299) for _ in range(n)])
        return SamplerOutput(tokens, np.zeros(n), np.zeros((n, MAX_LOGPROBS), np.int32), np.zeros((n, MAX_LOGPROBS)))

    execute = dispatch

    def fetch(self, handle):
        return handle

    def copy_pages(self, copies):
        pass


def test_every_request_finishes_in_tight_pools_overlapped_or_not():
    """The engine (serial and overlapped) over pools that one request of max_model_len fills,
    with n > 1 samples and shared prefixes: every request gets its tokens, every page comes
    back. Before the scheduler's two fixes (tests/test_scheduler.py) 1009 of 1500 such pools
    never finished."""
    from jaxserve.engine.engine import Engine
    from tests.conftest import _tiny_tokenizer, tight_pool

    tok = _tiny_tokenizer()
    for trial in range(120):
        rng = random.Random(trial)
        sched, work = tight_pool(rng, rng.choice(["token", "page"]), samples=(1, 2, 3))
        engine = Engine(_RandomTokens(rng), sched, tok, {tok.eos_token_id}, overlap=trial % 2 == 1)
        reqs = [engine.add_request(prompt, sample) for prompt, params in work for sample in params.samples()]
        for _ in range(3000):
            if not engine.has_unfinished():
                break
            engine.step()
            sched.check_integrity()
        assert not engine.has_unfinished(), f"pool {trial} never finished"
        assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs), trial
        assert sched.kv.usage(())["kv_pages_held"] == 0
