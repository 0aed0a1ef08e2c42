"""The short soak and the fuzzers, against one tiny server: every call gets the status its
kind must get, the pool and the radix tree check out after every step, no page is left
held, and the server keeps serving. The long soak: ``python -m tests.soak`` (see there)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.client import Client
from jaxserve.server.config import ServerConfig
from jaxserve.server.proto import jaxserve_pb2 as pb
from tests.conftest import tiny_server
from tests.soak import check_every_step, soak, wait_idle

GREEDY = dict(temperature=0.0, ignore_eos=True)
# What a call may be answered with: OK, or a status that names the caller's mistake or a
# full queue. UNKNOWN, INTERNAL, UNAVAILABLE... are bugs.
CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def soaked(tiny_model_dir):
    cfg = ServerConfig(
        port=0, http_port=None, metrics_port=None, warmup=False, max_waiting_requests=32, max_tokens_limit=600
    )
    with tiny_server(tiny_model_dir("llama3")[0], cfg, max_num_seqs=4, num_pages=200) as (llm, server, addr):
        failures = check_every_step(server)
        yield llm, server, addr, failures


def _still_serving(addr: str) -> None:
    with Client(addr) as c:
        assert len(c.generate([5, 6, 7], max_tokens=3, timeout=120, **GREEDY).token_ids) == 3


def test_short_soak(soaked):
    llm, server, addr, failures = soaked
    vocab, context = llm.model_config.vocab_size, llm.max_model_len
    report = asyncio.run(soak(addr, seconds=20, rate=6, vocab=vocab, max_tokens=12, context=context))
    assert sum(report.counts.values()) >= 60 and all(report.counts.values()), report.counts
    assert report.unexpected == []
    snap = wait_idle(server)
    assert snap["kv_pages_held"] == 0
    assert failures == [], failures[:3]
    server.engine_thread.call(lambda e: e.scheduler.check_integrity())
    _still_serving(addr)


_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 1.0, 1e-30, -0.0, 2.0, 0.5])
)
_ints = st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-5, 40))
_sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": _ints,
        "temperature": _floats,
        "top_k": _ints,
        "top_p": _floats,
        "min_p": _floats,
        "seed": st.integers(0, 2**64 - 1),
        "stop_token_ids": st.lists(_ints, max_size=20),
        "stop": st.lists(st.text(max_size=300), max_size=20),
        "ignore_eos": st.booleans(),
        "min_tokens": _ints,
        "repetition_penalty": _floats,
        "presence_penalty": _floats,
        "frequency_penalty": _floats,
        "logprobs": _ints,
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
    },
)
_prompt = st.one_of(
    st.text(max_size=200),
    st.lists(_ints, max_size=40),
    st.lists(st.fixed_dictionaries({"role": st.text(max_size=12), "content": st.text(max_size=100)}), max_size=4),
)


def _request(prompt, request_id: str, sampling: dict) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.chat.messages.extend(pb.ChatMessage(**m) for m in prompt)
    else:
        req.token_ids.ids.extend(prompt)
    stop, stop_ids = sampling.pop("stop", []), sampling.pop("stop_token_ids", [])
    req.sampling_params.CopyFrom(pb.SamplingParams(**sampling))
    req.sampling_params.stop.extend(stop)
    req.sampling_params.stop_token_ids.extend(stop_ids)
    return req


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(prompt=_prompt, request_id=st.text(max_size=300), sampling=_sampling, stream=st.booleans())
def test_fuzz_messages(soaked, prompt, request_id, sampling, stream):
    """Any GenerateRequest the proto can carry gets OK or a status naming the problem."""
    _, _, addr, failures = soaked
    with Client(soaked[2]) as c:
        try:
            req = _request(prompt, request_id, sampling)
            if stream:
                list(c.stub.StreamGenerate(req, timeout=300))
            else:
                c.stub.Generate(req, timeout=300)
        except grpc.RpcError as e:
            assert e.code() in CLEAN or (e.code() == grpc.StatusCode.ALREADY_EXISTS and request_id), (
                e.code(),
                e.details()[:300],
            )
            assert len(e.details()) < 1200
    assert failures == []


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=st.binary(max_size=400), method=st.sampled_from(["Generate", "StreamGenerate", "Abort", "GetModelInfo"]))
def test_fuzz_bodies(soaked, body, method):
    """Raw bytes as any method's request: OK (bytes that happen to parse) or a clean status."""
    with grpc.insecure_channel(soaked[2]) as ch:
        path = f"/jaxserve.v1.JaxServe/{method}"
        try:
            if method == "StreamGenerate":
                list(ch.unary_stream(path)(body, timeout=300))
            else:
                ch.unary_unary(path)(body, timeout=300)
        except grpc.RpcError as e:
            assert e.code() in CLEAN, (e.code(), e.details()[:300])


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(junk=st.binary(min_size=1, max_size=2000), preface=st.booleans())
def test_fuzz_socket_bytes(soaked, junk, preface):
    """Garbage on the TCP socket (with or without the HTTP/2 preface) leaves the server serving."""
    host, port = soaked[2].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall((b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" if preface else b"") + junk)
        try:
            s.recv(4096)
        except OSError:
            pass


def test_still_serving_after_fuzzing(soaked):
    llm, server, addr, failures = soaked
    _still_serving(addr)
    assert wait_idle(server)["kv_pages_held"] == 0
    assert failures == []
