"""End to end over a real gRPC server on a free loopback port, with a real stub."""

from __future__ import annotations

import asyncio
import gc
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve import SamplingParams
from jaxserve.client import Client, build_request, wait_until_serving
from jaxserve.server.config import ServerConfig
from jaxserve.server.proto import jaxserve_pb2 as pb
from jaxserve.server.server import SERVICE_NAME
from tests.conftest import gated_server, rng_tokens, tiny_server, wait_until

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    path, _ = tiny_model_dir("llama3")
    cfg = ServerConfig(port=0, http_port=None, metrics_port=0, max_waiting_requests=64, drain_grace_seconds=5)
    with gated_server(path, cfg, str(path)) as (llm, server, port, open_gate):
        addr = f"127.0.0.1:{port}"
        with grpc.insecure_channel(addr) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            first = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME)).status
        open_gate()
        wait_until_serving(addr, timeout=300, service=SERVICE_NAME)
        yield llm, server, addr, first


def test_health_goes_not_serving_to_serving(served):
    _, _, addr, first = served
    assert first == health_pb2.HealthCheckResponse.NOT_SERVING
    with grpc.insecure_channel(addr) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_serving_freezes_what_start_up_left_and_a_stopped_server_unfreezes_it(served, tiny_model_dir):
    """At SERVING the server freezes the heap start-up left (gc.freeze: Python's full
    collections then never walk it; two of them had stopped a 16-stream run for 175 and
    97 ms), and unfreezes it when it has drained, so a process's next server can collect
    this one's cycles."""
    assert gc.get_freeze_count() > 0
    path, _ = tiny_model_dir("llama3")
    with tiny_server(path) as (_, _, addr):
        wait_until_serving(addr, timeout=300, service=SERVICE_NAME)
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_reflection_lists_the_service(served):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(served[2]) as ch:
        services = ProtoReflectionDescriptorDatabase(ch).get_services()
    assert SERVICE_NAME in services and "grpc.health.v1.Health" in services


@pytest.mark.parametrize(
    "prompt",
    [
        "The capital of France is",
        [5, 6, 7, 8, 9, 10],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ],
    ids=["text", "token_ids", "chat"],
)
def test_unary_and_stream_agree_with_offline(served, prompt):
    llm, _, addr, _ = served
    with Client(addr) as c:
        unary = c.generate(prompt, max_tokens=12, **GREEDY)
        parts = list(c.stream(prompt, max_tokens=12, **GREEDY))
    offline = llm.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0]
    assert list(unary.token_ids) == offline.token_ids
    assert unary.text == offline.text == "".join(p.text for p in parts)
    assert [t for p in parts for t in p.token_ids] == offline.token_ids
    assert parts[-1].finish_reason == pb.FINISH_REASON_LENGTH and all(p.finish_reason == 0 for p in parts[:-1])
    usage = unary.usage
    assert usage.prompt_tokens == len(offline.prompt_token_ids) and usage.completion_tokens == 12
    assert parts[-1].usage.completion_tokens == 12


def test_32_concurrent_streams_match_offline(served):
    llm, _, addr, _ = served
    prompts = [rng_tokens(5 + 7 * i, 320, seed=i) for i in range(32)]
    offline = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY))]

    async def run():
        async with grpc.aio.insecure_channel(addr) as ch:
            from jaxserve.server.proto import jaxserve_pb2_grpc as pb_grpc

            stub = pb_grpc.JaxServeStub(ch)

            async def one(p):
                return [
                    t async for m in stub.StreamGenerate(build_request(p, max_tokens=10, **GREEDY)) for t in m.token_ids
                ]

            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(run()) == offline


def test_cancelled_streams_are_aborted_within_two_steps_and_free_pages(tiny_model_dir):
    with tiny_server(tiny_model_dir("llama3")[0], num_pages=1500, max_num_seqs=32) as (llm, server, addr):
        _check_cancellation(server, addr)


def _check_cancellation(server, addr) -> None:
    engine = server.engine_thread

    async def run():
        async with grpc.aio.insecure_channel(addr) as ch:
            from jaxserve.server.proto import jaxserve_pb2_grpc as pb_grpc

            stub = pb_grpc.JaxServeStub(ch)
            calls = [
                stub.StreamGenerate(
                    build_request(rng_tokens(30, 320, seed=100 + i), request_id=f"cancel-{i}", max_tokens=900, **GREEDY)
                )
                for i in range(20)
            ]
            for call in calls:
                first = await call.read()  # every stream is generating
                assert first.token_ids and not first.finish_reason
            requests = [engine._streams[f"cancel-{i}"].request for i in range(20)]
            for call in calls:
                call.cancel()
            return requests

    requests = asyncio.run(run())
    ids = [f"cancel-{i}" for i in range(20)]

    # Read on the engine thread, between its commands: an abort is handled whole there
    # (read from here, a request could be seen finished before its delay was recorded).
    def settled(e):
        if not all(r.status.is_finished for r in requests):
            return None
        e.scheduler.check_integrity()
        return [engine.abort_delay_steps.get(i) for i in ids], e.stats()["kv_pages_held"]

    delays, pages_held = wait_until(lambda: engine.call(settled), "the cancelled requests to finish")
    # Once the server sees a cancellation, the engine ends the request within two steps
    # (how fast a client's cancel reaches the server is the network's business).
    assert None not in delays and max(delays) <= 2, delays
    assert all(r.finish_reason == "abort" and not r.pages for r in requests)
    assert all(len(r.output_token_ids) < 900 for r in requests)
    assert pages_held == 0


INVALID = [
    (dict(prompt=""), "text: the prompt is empty"),
    (dict(prompt=None), "prompt: one of text, token_ids or chat is required"),
    (dict(prompt=[]), "token_ids: the prompt is empty"),
    (dict(prompt=[1, 2, 999]), r"token_ids.ids\[2\] = 999: out of range; allowed 0..319"),
    (dict(prompt=[1, -1]), r"token_ids.ids\[1\] = -1"),
    (
        dict(prompt=[{"role": "wizard", "content": "hi"}]),
        r"chat.messages\[0\].role = 'wizard': must be one of system, user",
    ),
    (dict(prompt="hi", max_tokens=-1), "max_tokens = -1: must be an integer >= 0"),
    (dict(prompt="hi", max_tokens=-5), "max_tokens = -5"),
    (
        dict(prompt="hi", max_tokens=5000),
        r"max_tokens = 5000: prompt \(\d+ tokens\) \+ max_tokens must be <= max_model_len",
    ),
    (dict(prompt=[1] * 1100), r"^token_ids.ids: 1100 tokens; must be shorter than max_model_len \(1024\)$"),
    (dict(prompt="hi " * 1200), r"^text: \d+ tokens; must be shorter than max_model_len"),
    (dict(prompt=[{"role": "user", "content": "hi " * 1200}]), r"^chat.messages: \d+ tokens; must be shorter"),
    (dict(prompt="hi", temperature=-0.5), "temperature = -0.5: must be a number >= 0"),
    (dict(prompt="hi", top_p=0.0), r"top_p = 0.0: must be a number in \(0, 1\]"),
    (dict(prompt="hi", top_p=1.5), r"top_p = 1.5"),
    (dict(prompt="hi", top_k=-3), "top_k = -3: must be an integer in \\[-1, 2\\*\\*31\\)"),
    (dict(prompt="hi", min_p=2.0), r"min_p = 2.0: must be a number in \[0, 1\]"),
    (dict(prompt="hi", repetition_penalty=0.0), r"repetition_penalty = 0.0: must be a number in \(0, 10\]"),
    (dict(prompt="hi", logprobs=50), r"logprobs = 50: must be None or an integer in \[0, 20\]"),
    (dict(prompt="hi", stop=["x"] * 17), "stop = .*: must be at most 16 non-empty strings of at most 256 characters"),
    (dict(prompt="hi", stop=["y" * 300]), "stop = .*at most 256 characters"),
    (dict(prompt="hi", stop_token_ids=list(range(20))), "stop_token_ids = .*at most 16"),
    (dict(prompt="hi", min_tokens=9, max_tokens=3), r"min_tokens = 9: must be an integer in \[0, max_tokens\]"),
    (dict(prompt="hi", request_id="r" * 300), "request_id: 300 characters; at most 256"),
    (dict(prompt="x" * 1_000_001), "text: 1000001 characters; at most 1000000"),
    # Floats are checked as sent: 1e-30 was rounded to 0 (silently greedy), inf was accepted.
    (dict(prompt="hi", temperature=1e-30), r"temperature = 1e-30: must be .*at least 0.01"),
    (dict(prompt="hi", temperature=float("inf")), "temperature = inf: must be"),
    (dict(prompt="hi", top_p=float("nan")), "top_p = nan: must be"),
    # A huge bad value is not echoed back whole (it came back as RESOURCE_EXHAUSTED).
    (dict(prompt=[{"role": "r" * 1_000_000, "content": "hi"}]), r"role = 'r{40}\.\.\.': must be one of"),
    (dict(prompt="hi", stop=["s" * 1_000_000]), r"stop = \('s+\.\.\. \(1000005 characters\): must be"),
    (dict(prompt="hi", pin_s=0.0), r"pin_s = 0.0: must be a number of seconds in \(0, 3600\]"),
    (dict(prompt="hi", pin_s=float("nan")), r"pin_s = nan: must be a number of seconds"),
    (dict(prompt="hi", pin_s=1e9), r"pin_s = 1000000000.0: must be a number of seconds"),
    (dict(prompt="hi", truncate_prompt_tokens=-2), r"truncate_prompt_tokens = -2: must be -1 \(as many as the c"),
    (dict(prompt="hi", truncate_prompt_tokens=0), r"truncate_prompt_tokens = 0: must be -1 .* or from 1 to \d+"),
]


@pytest.mark.parametrize("kwargs, message", INVALID)
def test_invalid_input_is_rejected_by_name(served, kwargs, message):
    import re

    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt")
    request = pb.GenerateRequest() if prompt is None else build_request(prompt, **kwargs)
    with Client(served[2]) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.stub.Generate(request, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()[:300]
        assert re.search(message, err.value.details()), err.value.details()[:300]
        assert len(err.value.details()) < 1200
        assert len(c.generate("ok", max_tokens=2, **GREEDY).token_ids) == 2  # still serving


def test_full_queue_answers_resource_exhausted_then_recovers(tiny_model_dir):
    config = ServerConfig(port=0, http_port=None, metrics_port=None, max_waiting_requests=2, warmup=False)
    with tiny_server(tiny_model_dir("llama3")[0], config, num_pages=200, max_num_seqs=2) as (_, _, addr):
        _check_full_queue(addr)


def _check_full_queue(addr) -> None:
    async def run():
        async with grpc.aio.insecure_channel(addr) as ch:
            from jaxserve.server.proto import jaxserve_pb2_grpc as pb_grpc

            stub = pb_grpc.JaxServeStub(ch)

            async def one(i):
                try:
                    await stub.Generate(build_request([5, 6, 7 + i], max_tokens=40, **GREEDY))
                    return "ok"
                except grpc.aio.AioRpcError as e:
                    return e.code()

            return await asyncio.gather(*(one(i) for i in range(12)))

    codes = asyncio.run(run())
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and "ok" in codes
    with Client(addr) as c:  # retried once the queue has drained
        assert len(c.generate([5, 6, 7], max_tokens=3, **GREEDY).token_ids) == 3


def test_metrics_endpoint(served):
    import urllib.request

    _, server, addr, _ = served

    def generated() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
        return float(next(x.split()[1] for x in text.splitlines() if x.startswith("jaxserve_generation_tokens_total")))

    before = generated()
    with Client(addr) as c:
        c.generate("metrics", max_tokens=3, **GREEDY)
    assert generated() - before == 3
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    for name in (
        "jaxserve_requests_waiting",
        'jaxserve_kv_pages{state="held"}',
        'jaxserve_requests_aborted_total{reason="cancelled"}',
        'jaxserve_requests_rejected_total{reason="client_tokens"}',
        "jaxserve_time_to_first_token_seconds_bucket",
        "jaxserve_inter_token_latency_seconds_count",
        "jaxserve_generation_tokens_total",
        "jaxserve_compiles",
    ):
        assert name in text, name
    # The engine's own counts: every program made (compiled or loaded), and the loaded ones.
    figures = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("jaxserve_compiles"))
    stats = server.engine_thread.call(lambda e: e.stats())
    assert float(figures["jaxserve_compiles"]) == stats["num_compiles"] > 0
    assert float(figures["jaxserve_compiles_loaded"]) == stats["num_compiles_loaded"] <= stats["num_compiles"]


def test_model_info_and_abort_unknown(served):
    with Client(served[2]) as c:
        info = c.model_info()
        assert info.vocab_size == 320 and info.page_size == 16 and info.max_model_len == 1024
        assert c.abort("no-such-request") is False


def test_generated_stubs_are_up_to_date():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "scripts" / "gen_protos.py"), "--check"], check=True)


def test_cli_generate_against_the_server(served, capsys):
    from jaxserve.cli import main

    llm, _, addr, _ = served
    assert main(["generate", "--server", addr, "The capital", "--raw", "--max-tokens", "6"]) == 0
    offline = llm.generate(["The capital"], SamplingParams(max_tokens=6, temperature=0.0))[0].text
    assert capsys.readouterr().out == offline + "\n"


def test_deadline_aborts_the_request_and_frees_its_pages(served):
    llm, server, addr, _ = served
    before = llm.stats()["decode_tokens"]
    with Client(addr) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.stub.Generate(build_request([9, 9, 9], request_id="deadline-1", max_tokens=900, **GREEDY), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stopped = lambda: not server.engine_thread.num_active and not llm.stats()["requests_running"]  # noqa: E731
    wait_until(stopped, "the request to end after its deadline", 30)
    assert llm.stats()["decode_tokens"] - before < 900  # stopped early, not run to max_tokens
    assert llm.stats()["kv_pages_held"] == 0


def test_a_failed_engine_step_ends_requests_with_internal_and_serving_continues(served, monkeypatch):
    llm, _, addr, _ = served
    real = llm.runner.dispatch
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.runner, "dispatch", flaky)
    with Client(addr) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate([1, 2, 3], max_tokens=4, **GREEDY, timeout=60)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "simulated device failure" in err.value.details()
        assert len(c.generate([1, 2, 3], max_tokens=4, **GREEDY, timeout=60).token_ids) == 4
    assert llm.stats()["kv_pages_held"] == 0


def test_a_step_that_fails_after_donation_recreates_the_kv_cache(tiny_model_dir, monkeypatch):
    """A step that fails after taking the donated KV cache used to poison the server for
    good (every later step: "Buffer has been deleted or donated"). Now the requests in
    flight end with INTERNAL, health reads NOT_SERVING while a fresh cache is made (and the
    prefix cache, whose pages held the lost K/V, is emptied), and the next request gets
    the same tokens as before the failure."""
    with tiny_server(tiny_model_dir("llama3")[0], num_pages=200) as (llm, server, addr):
        prompt = rng_tokens(40, 320, seed=7)
        with Client(addr) as c:
            expected = list(c.generate(prompt, max_tokens=6, **GREEDY).token_ids)
        statuses = []
        real_set, real_call = server.health.set, llm.runner._call  # runs a compiled program by its key

        async def record(service, status):
            if service == "":
                statuses.append(status)
            await real_set(service, status)

        def fails_once_after_donation(key, *args):
            out = real_call(key, *args)  # the cache is donated to the forward...
            if key[0] == "forward" and not statuses:
                raise RuntimeError("simulated device failure after donation")  # ...and lost
            return out

        monkeypatch.setattr(server.health, "set", record)
        monkeypatch.setattr(llm.runner, "_call", fails_once_after_donation)
        with Client(addr) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.generate(prompt, max_tokens=6, **GREEDY, timeout=60)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "simulated device failure after donation" in err.value.details()
            assert list(c.generate(prompt, max_tokens=6, **GREEDY, timeout=60).token_ids) == expected
            assert c.generate(prompt, max_tokens=6, **GREEDY, timeout=60).usage.cached_tokens > 0
        assert statuses == [health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING]
        assert llm.stats()["recoveries"] == 1
        assert llm.stats()["kv_pages_held"] == 0
        server.engine_thread.call(lambda e: e.scheduler.check_integrity())


def test_a_slow_tokenization_does_not_stall_other_calls(served, monkeypatch):
    """Validation (tokenizing, chat templates) runs off the event loop, and large prompts
    queue apart from small ones: while three large prompts' tokenization is held up, model
    info, small streams and small prompts all answer."""
    llm, _, addr, _ = served
    release, entered = threading.Event(), threading.Event()
    encode = llm.tokenizer.encode

    def slow_encode(text, **kw):
        if text.startswith("SLOW"):
            entered.set()
            release.wait(120)
            return encode(text[:50], **kw)
        return encode(text, **kw)

    monkeypatch.setattr(llm.tokenizer, "encode", slow_encode)
    results = []
    big = "SLOW " + "x" * 100_000
    with Client(addr) as c:
        slow = [
            threading.Thread(target=lambda: results.append(c.generate(big, max_tokens=2, **GREEDY))) for _ in range(3)
        ]
        for t in slow:
            t.start()
        try:
            assert entered.wait(60)
            assert c.model_info(timeout=20).vocab_size == 320  # a stalled loop times out here
            assert len(list(c.stream([5, 6, 7], max_tokens=5, timeout=60, **GREEDY))) >= 1
            assert c.generate("fast prompt", max_tokens=2, timeout=60, **GREEDY).token_ids
        finally:
            release.set()
            for t in slow:
                t.join(120)
    assert [len(r.token_ids) for r in results] == [2, 2, 2]


def test_a_chat_template_that_refuses_the_messages_is_invalid_argument(served, monkeypatch):
    llm, _, addr, _ = served
    refusing = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must start with user') }}{% endif %}x"
    monkeypatch.setattr(llm.tokenizer, "chat_template", refusing)
    with Client(addr) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate([{"role": "assistant", "content": "hi"}], max_tokens=2, **GREEDY)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "chat template refuses them: roles must start with user" in err.value.details()


def test_a_prefill_only_request_over_grpc(served):
    """max_tokens 0: no token, finish reason length, the prompt cached for the next call."""
    llm, _, addr, _ = served
    prompt = rng_tokens(70, 320, seed=21)
    with Client(addr) as c:
        warm = c.generate(prompt, max_tokens=0, **GREEDY, timeout=60)
        assert list(warm.token_ids) == [] and warm.finish_reason == pb.FINISH_REASON_LENGTH
        assert warm.usage.prompt_tokens == 70 and warm.usage.completion_tokens == 0
        parts = list(c.stream(prompt, max_tokens=0, **GREEDY, timeout=60))
        assert parts[-1].finish_reason == pb.FINISH_REASON_LENGTH and not any(p.token_ids for p in parts)
        assert c.generate(prompt + [5, 6], max_tokens=3, **GREEDY, timeout=60).usage.cached_tokens == 70
    assert llm.stats()["kv_pages_held"] == 0


def test_truncate_prompt_tokens_over_grpc(served):
    """vLLM's truncate_prompt_tokens over gRPC, as over HTTP: only the prompt's last k
    tokens are computed (-1: as many as the context holds), so a longer prompt is answered,
    from text, token ids or a chat."""
    llm, _, addr, _ = served
    room = llm.handle.max_model_len - 1
    long = rng_tokens(room + 40, 320, seed=23)
    with Client(addr) as c:
        got = c.generate(long, max_tokens=4, truncate_prompt_tokens=50, **GREEDY, timeout=60)
        assert got.usage.prompt_tokens == 50
        assert list(got.token_ids) == list(c.generate(long[-50:], max_tokens=4, **GREEDY, timeout=60).token_ids)
        with pytest.raises(grpc.RpcError, match="must be shorter than max_model_len"):
            c.generate(long, max_tokens=1, **GREEDY, timeout=60)
        whole = c.generate(long, max_tokens=1, truncate_prompt_tokens=-1, **GREEDY, timeout=60)
        assert whole.usage.prompt_tokens == room
        assert c.generate("one two three", max_tokens=1, truncate_prompt_tokens=2, timeout=60).usage.prompt_tokens == 2
        chat = [{"role": "user", "content": "hi there"}]
        assert c.generate(chat, max_tokens=1, truncate_prompt_tokens=3, timeout=60).usage.prompt_tokens == 3
    assert llm.stats()["kv_pages_held"] == 0


def test_a_pinned_prefix_over_grpc(served):
    """pin_s leases the finished request's tokens; stats count them; Unpin ends the lease,
    once, and only for the client that made it (others read it as not found)."""
    llm, server, addr, _ = served
    prompt = rng_tokens(70, 320, seed=22)
    with Client(addr) as c:
        warm = c.pin(prompt, ttl_s=120, timeout=60)
        assert warm.lease_id.startswith("lease-") and not warm.pin_refused
        assert warm.usage.prompt_tokens == 70 and list(warm.token_ids) == []
        stats = c.server_stats()
        assert stats.leases == 1 and stats.kv_pages_pinned == 5  # 70 tokens, pages of 16
        assert c.generate(prompt + [7], max_tokens=2, **GREEDY, timeout=60).usage.cached_tokens == 70
        streamed = list(c.stream(prompt[:40], max_tokens=1, pin_s=30, **GREEDY, timeout=60))
        assert streamed[-1].lease_id and not any(p.lease_id for p in streamed[:-1])
        assert server.engine_thread.call(lambda e: e.unpin(streamed[-1].lease_id, client="someone else")) is False
        assert c.unpin(warm.lease_id) and not c.unpin(warm.lease_id)
        assert c.unpin(streamed[-1].lease_id)
        assert c.server_stats().leases == 0 and c.server_stats().kv_pages_pinned == 0
        assert not c.unpin("lease-nonexistent")
    server.engine_thread.call(lambda e: e.scheduler.check_integrity())


def test_prompt_logprobs_over_grpc_match_offline(served):
    import math

    llm, _, addr, _ = served
    prompt = rng_tokens(40, 320, seed=23)
    params = dict(max_tokens=2, prompt_logprobs=2, **GREEDY)
    offline = llm.generate([prompt], SamplingParams(**params))[0]
    with Client(addr) as c:
        got = c.generate(prompt, **params, timeout=60)
        streamed = list(c.stream(prompt, **params, timeout=60))
    assert len(got.prompt_logprobs) == 40 and math.isnan(got.prompt_logprobs[0])
    assert list(got.prompt_logprobs[1:]) == pytest.approx(offline.prompt_logprobs[1:], abs=1e-5)
    assert [[e.token_id for e in t.entries] for t in got.prompt_top_logprobs[1:]] == [
        [t for t, _ in top] for top in offline.prompt_top_logprobs[1:]
    ]
    assert not got.prompt_top_logprobs[0].entries
    assert list(streamed[-1].prompt_logprobs[1:]) == list(got.prompt_logprobs[1:])
    assert not any(m.prompt_logprobs for m in streamed[:-1])


def test_n_samples_over_grpc(served):
    llm, server, addr, _ = served
    prompt = rng_tokens(60, 320, seed=24)
    sampling = dict(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    offline = llm.generate([prompt], SamplingParams(n=3, **sampling))[0]
    with Client(addr) as c:
        got = c.generate(prompt, n=3, **sampling, timeout=60)
        assert [list(s.token_ids) for s in got.samples] == [s.token_ids for s in offline.samples]
        assert list(got.token_ids) == offline.samples[0].token_ids
        parts = list(c.stream(prompt, n=3, **sampling, timeout=60))
        by_index = {i: [t for p in parts if p.index == i for t in p.token_ids] for i in range(3)}
        assert [by_index[i] for i in range(3)] == [s.token_ids for s in offline.samples]
        assert sum(p.finish_reason != pb.FINISH_REASON_UNSPECIFIED for p in parts) == 3
    assert server.engine_thread.call(lambda e: e.stats()["kv_pages_held"]) == 0


def test_a_request_the_engine_refuses_ends_alone_and_serving_continues(served, monkeypatch):
    """An add the engine refuses (e.g. prompt_logprobs on a multi-host deployment) ends
    that request with its reason; the engine thread serves on."""
    from jaxserve.errors import RequestError

    llm, _, addr, _ = served
    real = llm.engine.add_request

    def add_request(ids, params, **kw):
        if params.max_tokens == 7:
            raise RequestError("refused for the test")
        return real(ids, params, **kw)

    monkeypatch.setattr(llm.engine, "add_request", add_request)
    with Client(addr) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate("hi", max_tokens=7, timeout=60)
        assert "refused for the test" in err.value.details()
        assert len(c.generate("ok", max_tokens=2, **GREEDY, timeout=60).token_ids) == 2
