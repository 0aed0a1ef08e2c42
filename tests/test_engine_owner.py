"""One thread steps an engine: a served LLM's offline calls go through the engine thread,
and a second thread that tries to drive an engine someone else drives gets a clear error."""

from __future__ import annotations

import contextlib
import threading

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.client import Client
from jaxserve.engine.async_engine import Delta
from jaxserve.engine.engine import EngineBusyError
from jaxserve.errors import RequestError
from jaxserve.server.config import ServerConfig
from tests.conftest import rng_tokens, serve_llm, wait_until

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
OPTIONS = dict(dtype="float32", page_size=16, num_pages=300, max_num_seqs=8, max_num_batched_tokens=64)
SERVED = ServerConfig(port=0, http_port=None, metrics_port=None, warmup=False)  # gRPC only, no warm-up


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama3")[0]), progress=False, warmup=False, **OPTIONS)


def _in_thread(fn) -> tuple[threading.Thread, list[BaseException]]:
    """Starts ``fn`` on another thread; the list receives what it raised."""
    errors: list[BaseException] = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def _record_stepping_threads(llm) -> list[threading.Thread]:
    seen: list[threading.Thread] = []
    real = llm.engine.step

    def spy():
        seen.append(threading.current_thread())
        return real()

    llm.engine.step = spy  # an instance attribute shadows the method for every caller
    return seen


def test_a_served_llm_steps_only_on_the_engine_thread(llm):
    prompts = [rng_tokens(6 + 5 * i, 320, seed=i) for i in range(6)]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    expected_text = llm.generate([prompts[0]], GREEDY)[0].text
    with serve_llm(llm, SERVED) as (server, addr):
        seen = _record_stepping_threads(llm)
        try:
            assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
            assert "".join(llm.stream(prompts[0], GREEDY)) == expected_text
            with Client(addr) as c:
                assert (
                    list(c.generate(prompts[1], max_tokens=8, temperature=0.0, ignore_eos=True).token_ids)
                    == (expected[1])
                )
        finally:
            del llm.engine.step
        assert seen and {t.name for t in seen} == {"jaxserve-engine"}
        # Anyone else who tries to drive the served engine is refused, not interleaved.
        with pytest.raises(EngineBusyError, match="driven by the server's engine thread"):
            llm.engine.step()
        with pytest.raises(EngineBusyError):
            llm.engine.add_request([1, 2, 3], GREEDY)
    # Once the server has stopped, the LLM runs offline again on the caller's thread.
    assert [o.token_ids for o in llm.generate(prompts[:2], GREEDY)] == expected[:2]
    llm.scheduler.check_integrity()
    assert llm.stats()["kv_pages_held"] == 0


def test_offline_and_grpc_traffic_at_once_give_the_same_tokens(llm):
    """Many gRPC streams while the test thread also calls generate: every output matches its
    serial result, and the pool is whole afterwards (two steppers corrupt both)."""
    prompts = [rng_tokens(10 + 3 * i, 320, seed=50 + i) for i in range(12)]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    with serve_llm(llm, SERVED) as (_, addr):
        remote: list = []

        def client_side():
            with Client(addr) as c:
                for p in prompts:
                    remote.append(list(c.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids))

        clients = [threading.Thread(target=client_side) for _ in range(2)]
        for t in clients:
            t.start()
        offline = [[o.token_ids for o in llm.generate(prompts, GREEDY)] for _ in range(3)]
        for t in clients:
            t.join(timeout=300)
        assert offline == [expected] * 3
        assert remote and sorted(remote) == sorted(expected * 2)
    llm.scheduler.check_integrity()
    assert llm.stats()["kv_pages_held"] == 0


def test_a_second_thread_cannot_drive_an_engine_in_use(llm):
    stream = llm.stream([5, 6, 7, 8], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    next(stream)  # this thread now drives the engine, mid-request
    t, errors = _in_thread(lambda: llm.generate([[1, 2, 3]], GREEDY))
    t.join(timeout=60)
    assert len(errors) == 1 and isinstance(errors[0], EngineBusyError)
    assert "an offline LLM.stream call" in str(errors[0])
    stream.close()  # ends the request and gives the engine back
    t, errors = _in_thread(lambda: llm.generate([[1, 2, 3]], GREEDY))
    t.join(timeout=60)
    assert not errors and not t.is_alive()
    assert llm.stats()["kv_pages_held"] == 0


def test_a_server_cannot_start_over_an_engine_in_use(llm):
    stream = llm.stream([5, 6, 7, 8], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    next(stream)
    with pytest.raises(EngineBusyError, match="an offline LLM.stream call"):
        with serve_llm(llm, SERVED):
            pass
    stream.close()
    assert llm.stats()["kv_pages_held"] == 0


def test_a_failed_warmup_ends_waiting_offline_calls(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama3")[0]), progress=False, warmup=False, **OPTIONS)
    from jaxserve.engine.async_engine import EngineThread
    from jaxserve.errors import EngineError

    gate = threading.Event()

    def failing_warmup():
        gate.wait(30)
        raise RuntimeError("simulated compile failure")

    thread = EngineThread(llm.engine)
    thread.start(failing_warmup)
    t, errors = _in_thread(lambda: llm.generate([[1, 2, 3]], GREEDY))
    wait_until(lambda: thread.num_waiting, "the offline call to queue behind warm-up on the engine thread")
    gate.set()
    with pytest.raises(RuntimeError, match="simulated compile failure"):
        thread.wait_ready()
    t.join(timeout=60)
    assert len(errors) == 1 and isinstance(errors[0], EngineError) and "warm-up failed" in str(errors[0])
    assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 8  # the engine is free again


def test_an_offline_step_that_fails_after_donation_leaves_a_working_engine(llm, monkeypatch):
    prompt = rng_tokens(30, 320, seed=11)
    expected = llm.generate([prompt], GREEDY)[0].token_ids
    real = llm.runner._call  # runs a compiled program by its key

    def fails_after_donation(key, *args):
        out = real(key, *args)  # the cache is donated, then the step fails
        if key[0] == "forward":
            raise RuntimeError("simulated device failure after donation")
        return out

    monkeypatch.setattr(llm.runner, "_call", fails_after_donation)
    with pytest.raises(RuntimeError, match="after donation"):
        llm.generate([prompt], GREEDY)
    monkeypatch.undo()
    assert llm.generate([prompt], GREEDY)[0].token_ids == expected
    assert llm.stats()["recoveries"] >= 1 and llm.stats()["kv_pages_held"] == 0
    llm.scheduler.check_integrity()


def _delta(tokens: list[int], **end) -> Delta:
    return Delta("r", list(tokens), "".join(f"<{t}>" for t in tokens), [-0.5] * len(tokens), [], **end)


def test_deltas_that_piled_up_are_read_as_one_and_an_error_stays_apart():
    import asyncio

    from jaxserve.server.submit import merged

    async def read(batches: list[list]) -> list[list[tuple[int, object]]]:
        queues = [asyncio.Queue() for _ in batches]
        for q, batch in zip(queues, batches, strict=True):
            for d in batch:
                q.put_nowait(d)
        return [(i, d) async for i, d in merged(queues)]

    end = dict(finish_reason="length", prompt_tokens=3, completion_tokens=4, cached_tokens=1, lease_id="L")
    [(i, d)] = asyncio.run(read([[_delta([1]), _delta([2, 3]), _delta([4], **end)]]))
    assert (i, d.token_ids, d.text, d.logprobs) == (0, [1, 2, 3, 4], "<1><2><3><4>", [-0.5] * 4)
    assert (d.finish_reason, d.prompt_tokens, d.completion_tokens, d.cached_tokens, d.lease_id) == (
        "length",
        3,
        4,
        1,
        "L",
    )
    # An engine error is its own delta, after the tokens before it, and ends the job.
    got = asyncio.run(read([[_delta([1]), _delta([2]), _delta([], finish_reason="abort", error="boom"), _delta([9])]]))
    assert [(d.token_ids, d.error) for _, d in got] == [([1, 2], None), ([], "boom")]
    # Several jobs (n > 1): each job's pile is gathered on its own.
    got = asyncio.run(read([[_delta([1]), _delta([2], **end)], [_delta([7]), _delta([8]), _delta([], **end)]]))
    assert sorted((i, d.token_ids, d.finish_reason) for i, d in got) == [(0, [1, 2], "length"), (1, [7, 8], "length")]


def test_a_step_wakes_an_event_loop_once_for_all_its_streams(llm):
    """The engine thread hands an event loop one step's deltas in one call (each call
    writes to the loop's wake-up pipe under the GIL); a reader that fell behind reads each
    stream's tokens as one delta, the same tokens as offline."""
    import asyncio

    from jaxserve.engine import async_engine
    from jaxserve.engine.async_engine import EngineThread
    from jaxserve.server.submit import merged

    prompts = [rng_tokens(20 + i, 320, seed=i) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    thread = EngineThread(llm.engine)
    thread.start()

    async def serve():
        loop = asyncio.get_running_loop()
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(callback, *args):
            nonlocal wakeups
            wakeups += (
                callback is async_engine._deliver or getattr(callback, "__func__", None) is asyncio.Queue.put_nowait
            )
            return real(callback, *args)

        loop.call_soon_threadsafe = counting
        steps = llm.engine.counters["steps"]
        queues = [thread.submit(f"s{i}", p, params) for i, p in enumerate(prompts)]

        # Not reading until every stream has finished: each one's deltas pile up. A stream
        # is forgotten just before its step's deltas are handed over: the engine thread's
        # next command (a no-op call) runs after that hand-off, which the loop then runs
        # before it resumes this coroutine.
        def finished():
            wait_until(lambda: thread.num_active == 0, "the streams to finish")
            thread.call(lambda engine: None)

        await loop.run_in_executor(None, finished)
        outs = [[d async for _, d in merged([q])] for q in queues]
        return outs, wakeups, llm.engine.counters["steps"] - steps

    try:
        outs, wakeups, steps = asyncio.run(serve())
    finally:
        thread.stop()
    assert [[(d.token_ids, d.finish_reason) for d in out] for out in outs] == [[(e, "length")] for e in expected]
    assert 12 <= wakeups <= steps, (wakeups, steps)  # one a step, not one a stream a step (~72)
    llm.scheduler.check_integrity()


def test_busy_steps_do_not_each_count_the_pages_held_and_the_idle_figures_are_exact(llm, monkeypatch):
    """The live figures count the pages every running request holds (~1.2 ms at 256
    requests of 100 pages): while requests run, at most every PUBLISH_EVERY_S (here: never),
    and exactly once the engine is idle."""
    from jaxserve.engine import async_engine
    from jaxserve.engine.async_engine import EngineThread

    monkeypatch.setattr(async_engine, "PUBLISH_EVERY_S", 1e9)
    counted = [0]
    real = llm.engine.stats
    monkeypatch.setattr(llm.engine, "stats", lambda: counted.__setitem__(0, counted[0] + 1) or real())
    thread = EngineThread(llm.engine)
    thread.start()
    try:
        steps = llm.engine.counters["steps"]
        sub = thread.submit_threadsafe("a", rng_tokens(20, 320, seed=3), SamplingParams(max_tokens=24, ignore_eos=True))
        while sub.deltas.get(timeout=60).finish_reason is None:
            pass
        wait_until(lambda: thread.snapshot.get("requests_running") == 0, "the idle figures")
        steps = llm.engine.counters["steps"] - steps
        assert steps >= 24 and counted[0] <= 4, (steps, counted[0])  # start, the add, idle
        assert thread.snapshot["kv_pages_held"] == 0 and thread.snapshot["steps"] == llm.engine.counters["steps"]
    finally:
        thread.stop()


def test_use_tqdm_counts_the_requests_offline_and_served(llm, capsys):
    """generate(..., use_tqdm=True), vLLM's argument: a bar of the requests finished, to all
    of them, offline and on a served LLM alike, with the outputs of a call without it."""
    prompts = [rng_tokens(6 + 3 * i, 320, seed=10 + i) for i in range(5)]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert "requests" not in capsys.readouterr().err
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=True)] == expected
    assert "requests: 100%" in capsys.readouterr().err
    with serve_llm(llm, SERVED):
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=True)] == expected
        assert "5/5" in capsys.readouterr().err


def test_vllms_prompt_dicts_and_each_outputs_prompt_offline_and_served(llm):
    """vLLM's {"prompt": text} and {"prompt_token_ids": ids}, alone or in a list beside
    plain prompts, run as the plain prompt would; each output's ``prompt`` is the text it
    came from (a chat's, as the template rendered it) or None for bare token ids, and its
    samples' ``index`` count them. Bad dicts: one error naming the prompt and the key."""
    text, ids = "the cat sat", rng_tokens(9, 320, seed=3)
    chat = [{"role": "user", "content": "hi"}]
    rendered = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    plain = llm.generate([text, ids, chat], GREEDY)
    assert [o.prompt for o in plain] == [text, None, rendered]
    as_dicts = [{"prompt": text}, {"prompt_token_ids": ids, "prompt": "its text"}, chat]
    for served in (False, True):
        with serve_llm(llm, SERVED) if served else contextlib.nullcontext():
            outs = llm.generate(as_dicts, GREEDY)
            assert [o.token_ids for o in outs] == [o.token_ids for o in plain], served
            assert [o.prompt for o in outs] == [text, "its text", rendered]
            assert llm.generate({"prompt_token_ids": ids}, GREEDY)[0].prompt is None
            n3 = llm.generate([{"prompt": text}], SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1))[0]
            assert [(s.index, s.prompt) for s in n3.outputs] == [(0, text), (1, text), (2, text)]
    for bad, message in [
        ({"prompt_ids": ids}, r"prompts\[0\]: a prompt dict .* got \['prompt_ids'\]"),
        ([{"prompt": text}, {"prompt": 3}], r"prompts\[1\].prompt: a string; got a int"),
        ({"prompt_token_ids": [1, "2"]}, r"prompts\[0\].prompt_token_ids: a non-empty list of token ids"),
        ({"prompt_token_ids": [1, 999]}, r"prompts\[0\].prompt_token_ids\[1\] = 999: out of range"),
        ({"prompt": ""}, r"prompts\[0\].prompt: the prompt is empty"),
    ]:
        with pytest.raises(RequestError, match=message):
            llm.generate(bad, GREEDY)
    llm.scheduler.check_integrity()
    assert llm.stats()["kv_pages_held"] == 0


def test_reset_prefix_cache_drops_what_no_request_or_pin_keeps_offline_and_served(llm):
    """vLLM's reset_prefix_cache: the next run starts cold, but a pinned prefix stays; on a
    served LLM it runs on the engine thread. get_tokenizer is the model's tokenizer."""
    assert llm.get_tokenizer() is llm.tokenizer
    pinned, other = rng_tokens(40, 320, seed=21), rng_tokens(40, 320, seed=22)
    for served in (False, True):
        with serve_llm(llm, SERVED) if served else contextlib.nullcontext():
            lease = llm.pin(pinned)
            llm.generate([other], GREEDY)
            before = llm.stats()
            assert before["kv_pages_cached"] > before["kv_pages_pinned"] > 0
            assert llm.reset_prefix_cache() is True
            after = llm.stats()
            assert after["kv_pages_cached"] == after["kv_pages_pinned"] == before["kv_pages_pinned"], served
            hits = llm.stats()["prefix_cache_hit_tokens"]
            llm.generate([pinned + [5], other], GREEDY)
            assert llm.stats()["prefix_cache_hit_tokens"] - hits == 40  # the pinned prompt only
            assert llm.unpin(lease)
            llm.reset_prefix_cache()
            assert llm.stats()["kv_pages_cached"] == 0
    llm.scheduler.check_integrity()


def test_chat_takes_vllms_add_generation_prompt_and_continue_final_message(llm):
    """LLM.chat's conversation ends as vLLM's chat has it: the assistant's header (the
    default), the turn closed, or its last message left open for the model to continue (an
    assistant prefill), each the ids the HTTP API renders for the same body."""
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: {"}]
    encode = llm.handle.encode
    cases = [({}, {}), ({"add_generation_prompt": False}, {"add_generation_prompt": False})]
    cases.append(({"add_generation_prompt": False, "continue_final_message": True},) * 2)
    for given, rendered in cases:
        out = llm.chat(conv, GREEDY, **given)[0]
        assert out.prompt_token_ids == encode(conv, **rendered), given
    assert len({tuple(llm.chat(conv, GREEDY, **g)[0].prompt_token_ids) for g, _ in cases}) == 3
    assert llm.chat(conv, GREEDY, add_generation_prompt=False, continue_final_message=True)[0].prompt.endswith("{")
    with pytest.raises(RequestError, match="continue_final_message = true: only with add_generation_prompt = false"):
        llm.chat(conv, GREEDY, continue_final_message=True)
    assert llm.stats()["kv_pages_held"] == 0
