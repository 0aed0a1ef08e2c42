"""Security and fairness over a real server: TLS (and mutual TLS) with certificates made
here, bearer tokens, request ids owned by their client, an exclusive port, bodies that
do not parse, per-client limits, one client's long streams not starving another."""

from __future__ import annotations

import json
import socket
import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.client import Client, Credentials, build_request, open_channel
from jaxserve.errors import ConfigError
from jaxserve.server.config import ServerConfig
from jaxserve.server.proto import jaxserve_pb2 as pb
from jaxserve.server.server import Server, ServerHandle
from tests.certs import make_pki
from tests.conftest import engine_held, tiny_server, wait_until

GREEDY = dict(temperature=0.0, ignore_eos=True)
ALICE, BOB = "alice-token-0123456789abcdef", "bob-token-0123456789abcdef0"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    files = {}
    for name, pem in make_pki().items():
        (d / f"{name}.pem").write_bytes(pem)
        files[name] = d / f"{name}.pem"
    (d / "tokens").write_text(f"# identity token\nalice {ALICE}\nbob {BOB}\n")
    files["tokens"] = d / "tokens"
    return files


@pytest.fixture(scope="module")
def secured(tiny_model_dir, pki):
    """A server with mutual TLS and two token identities, and credentials for each."""
    cfg = ServerConfig(
        port=0,
        metrics_port=None,
        http_port=0,
        warmup=False,
        tls_cert_file=str(pki["server_cert"]),
        tls_key_file=str(pki["server_key"]),
        tls_client_ca_file=str(pki["ca_cert"]),
        auth_tokens_file=str(pki["tokens"]),
    )
    tls = dict(
        root_certificates=pki["ca_cert"].read_bytes(),
        private_key=pki["client_key"].read_bytes(),
        certificate_chain=pki["client_cert"].read_bytes(),
    )
    with tiny_server(tiny_model_dir("llama3")[0], cfg, max_num_seqs=4) as (llm, server, addr):
        yield server, addr.replace("127.0.0.1", "localhost"), tls


def test_tls_and_token_auth(secured):
    server, addr, tls = secured
    with Client(addr, Credentials(token=ALICE, **tls)) as c:
        assert len(c.generate([5, 6, 7], max_tokens=3, **GREEDY).token_ids) == 3
    for creds in (Credentials(**tls), Credentials(token="wrong-token-0123456789abcdef", **tls)):
        with Client(addr, creds) as c, pytest.raises(grpc.RpcError) as err:
            c.generate([5, 6, 7], max_tokens=3, **GREEDY)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
    with Client(addr, Credentials(**tls)) as c, pytest.raises(grpc.RpcError) as err:
        list(c.stream([5, 6, 7], max_tokens=3, **GREEDY))  # streaming calls too
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Health stays open (load balancers probe it); plaintext and certificate-less clients fail.
    with open_channel(addr, Credentials(**tls)) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    no_client_cert = Credentials(token=ALICE, root_certificates=tls["root_certificates"])
    for creds in (Credentials(token=ALICE), no_client_cert):
        with Client(addr, creds) as c, pytest.raises(grpc.RpcError) as err:
            c.model_info()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_http_api_takes_the_same_tls_and_tokens(secured, pki):
    import ssl

    import httpx

    server, _, _ = secured
    url = f"https://localhost:{server.http_port}"
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, **GREEDY}
    mutual = ssl.create_default_context(cafile=str(pki["ca_cert"]))
    mutual.load_cert_chain(str(pki["client_cert"]), str(pki["client_key"]))
    with httpx.Client(verify=mutual, timeout=60) as http:
        ok = http.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {ALICE}"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789abcdef"}):
            refused = http.post(f"{url}/v1/completions", json=body, headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            # The caller first: a stranger's body is never parsed, a bad one says nothing of our fields.
            refused = http.post(f"{url}/v1/chat/completions", json={"messages": 5}, headers=headers)
            assert refused.status_code == 401, refused.text
            refused = http.post(f"{url}/v1/responses", json={"input": 5}, headers=headers)
            assert refused.status_code == 401, refused.text
        assert http.get(f"{url}/v1/models").status_code == 401
        assert http.get(f"{url}/v1/no-such-route").status_code == 401  # a stranger learns no routes
        for route in ("/metrics", "/version"):  # vLLM leaves them open; here a token, as the API's
            assert http.get(f"{url}{route}").status_code == 401
            assert http.get(f"{url}{route}", headers={"Authorization": f"Bearer {ALICE}"}).status_code == 200
        assert http.get(f"{url}/health").status_code == 200  # open, as gRPC health is
    no_client_cert = ssl.create_default_context(cafile=str(pki["ca_cert"]))
    for client in (httpx.Client(verify=no_client_cert), httpx.Client()):
        with client, pytest.raises(httpx.HTTPError):
            client.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {ALICE}"}).json()
    with httpx.Client() as plain, pytest.raises(httpx.HTTPError):  # no plaintext beside TLS
        plain.post(f"http://localhost:{server.http_port}/v1/completions", json=body).json()


def test_a_request_id_belongs_to_its_client(secured):
    _, addr, tls = secured
    alice, bob = Client(addr, Credentials(token=ALICE, **tls)), Client(addr, Credentials(token=BOB, **tls))
    try:
        stream = alice.stub.StreamGenerate(
            build_request([5, 6, 7], request_id="alices", max_tokens=900, **GREEDY), metadata=alice.credentials.metadata
        )
        next(stream)
        assert bob.abort("alices") is False  # reads as unknown: bob cannot see alice's ids
        assert next(stream).token_ids  # still generating
        assert alice.abort("alices") is True
        last = list(stream)[-1]
        assert last.finish_reason == pb.FINISH_REASON_ABORT
    finally:
        alice.close()
        bob.close()


def test_undecodable_bodies_are_invalid_argument(served_plain):
    _, addr = served_plain
    with grpc.insecure_channel(addr) as ch:
        for method in ("Generate", "StreamGenerate", "Abort", "GetModelInfo"):
            call = (ch.unary_stream if method == "StreamGenerate" else ch.unary_unary)(
                f"/jaxserve.v1.JaxServe/{method}"
            )
            with pytest.raises(grpc.RpcError) as err:
                result = call(b"\xff\xff\xff\xff\x0f", timeout=30)
                if method == "StreamGenerate":
                    list(result)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.value.code())
            assert "not a valid jaxserve.v1." in err.value.details()
    with Client(addr) as c:
        assert len(c.generate([5, 6], max_tokens=2, **GREEDY).token_ids) == 2


@pytest.fixture(scope="module")
def served_plain(tiny_model_dir):
    cfg = ServerConfig(
        port=0,
        http_port=0,
        metrics_port=None,
        warmup=False,
        max_requests_per_client=3,
        max_tokens_limit=500,
        max_request_bytes=4096,
    )
    with tiny_server(tiny_model_dir("llama3")[0], cfg, max_num_seqs=4) as (_, server, addr):
        yield server, addr


def test_an_idle_http_connection_outlives_common_clients_idle_times(served_plain):
    """A connection idle for 6 s still serves: uvicorn's own keep-alive (5 s) equals httpx's
    (the openai client's), so a request sent as the server closed the connection would race
    it ("connection reset"); server.http_keep_alive_seconds (75 s) is above both."""
    import http.client
    import time

    server, _ = served_plain
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        conn.request("GET", "/v1/models")
        assert conn.getresponse().read() and conn.sock is not None
        sock = conn.sock
        time.sleep(6)  # idle past uvicorn's and the clients' 5 s (a wait, not a timing)
        conn.request("GET", "/v1/models")  # on the same connection: it was not closed
        response = conn.getresponse()
        assert response.status == 200 and conn.sock is sock
        response.read()
    finally:
        conn.close()


def test_a_request_over_max_request_bytes_is_refused_unparsed(served_plain):
    """An HTTP body over the cap is 413 before anything parses it: a declared length is not
    even read, a chunked body is read only up to the cap; gRPC's messages have the same cap."""
    server, addr = served_plain
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"

    def body(n: int) -> bytes:  # n bytes of padding in a field the server ignores
        return json.dumps({"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "user": "x" * n}).encode()

    def chunked(data: bytes):
        yield from (data[i : i + 1000] for i in range(0, len(data), 1000))

    big, small = body(300_000), body(4000)
    assert len(small) < 4096 < len(big)
    headers = {"content-type": "application/json"}
    for content in (big, chunked(big)):
        r = httpx.post(url, content=content, headers=headers, timeout=60)
        assert r.status_code == 413, (r.status_code, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "at most 4096 (server.max_request_bytes)" in error["message"], error
    for content in (small, chunked(small)):  # under the cap, chunked or not: served
        r = httpx.post(url, content=content, headers=headers, timeout=60)
        assert r.status_code == 200, (r.status_code, r.text)
        assert r.json()["usage"]["completion_tokens"] == 2
    with Client(addr) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate([300] * 3000, max_tokens=2, **GREEDY)  # 2 bytes an id: 6 KB
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert len(c.generate([5, 6], max_tokens=2, **GREEDY).token_ids) == 2


def test_a_second_server_on_a_taken_port_fails_naming_it(served_plain, tiny_model_dir):
    from jaxserve import LLM

    server, _ = served_plain
    taken = server.port
    llm = LLM(
        str(tiny_model_dir("llama3")[0]), dtype="float32", num_pages=64, max_num_seqs=2, progress=False, warmup=False
    )
    # A taken gRPC, metrics or HTTP port: each fails naming it.
    for ports, refusal in (
        (
            dict(port=taken, http_port=None, metrics_port=None),
            rf"server.port = {taken}: cannot listen on 127.0.0.1:{taken}",
        ),
        (dict(port=0, http_port=None, metrics_port=taken), rf"server.metrics_port = {taken}: cannot listen"),
        (
            dict(port=0, http_port=taken, metrics_port=None),
            rf"server.http_port = {taken}: cannot listen on 127.0.0.1:{taken}",
        ),
    ):
        handle = ServerHandle(Server(llm.handle, ServerConfig(warmup=False, **ports), "tiny", progress=False))
        with pytest.raises(ConfigError, match=refusal):
            handle.start()
        handle.stop()
    with Client(f"127.0.0.1:{taken}") as c:  # the first server still owns its engine and port
        assert len(c.generate([5, 6], max_tokens=2, **GREEDY).token_ids) == 2


def _port_in_time_wait() -> int:
    """A free port whose last connection lingers in TIME_WAIT, as after a server's restart:
    the listening side closed first."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()
    client.recv(1)  # the close has reached it
    client.close()
    listener.close()
    with pytest.raises(OSError):  # a plain bind is refused until the TIME_WAIT ends
        with socket.socket() as plain:
            plain.bind(("127.0.0.1", port))
    return port


def test_a_restarted_server_binds_its_http_port_at_once(tiny_model_dir):
    from jaxserve import LLM

    llm = LLM(
        str(tiny_model_dir("llama3")[0]), dtype="float32", num_pages=64, max_num_seqs=2, progress=False, warmup=False
    )
    port = _port_in_time_wait()
    config = ServerConfig(port=0, http_port=port, metrics_port=None, warmup=False)
    handle = ServerHandle(Server(llm.handle, config, "tiny", progress=False))
    try:
        handle.start()
        assert handle.server.http_port == port
    finally:
        handle.stop()


def test_per_client_limits(served_plain):
    server, addr = served_plain
    with Client(addr) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate([5, 6], max_tokens=501, **GREEDY)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 500 (server.max_tokens_limit)" in err.value.details()
        streams = [c.stream([5, 6, i], max_tokens=400, **GREEDY) for i in range(3)]
        for s in streams:
            next(s)
        with pytest.raises(grpc.RpcError) as err:
            c.generate([5, 6], max_tokens=2, **GREEDY)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_requests_per_client" in err.value.details()
        for s in streams:
            s.cancel()
        stats = _settled_stats(c)
        assert stats.requests_rejected["client_requests"] >= 1
        assert stats.requests_rejected["invalid_argument"] >= 1


def _settled_stats(client: Client) -> pb.ServerStats:
    """Stats once the cancels have reached the engine (they act at a step boundary)."""
    return _wait_for_stats(
        client, lambda s: s.requests_running == 0 and s.requests_waiting == 0, "requests still in flight", seconds=30
    )


def test_gauges_are_exact_after_a_cancel_storm(tiny_model_dir):
    cfg = ServerConfig(port=0, http_port=None, metrics_port=None, warmup=False)
    with tiny_server(tiny_model_dir("llama3")[0], cfg, max_num_seqs=4, num_pages=120) as (llm, server, addr):
        with Client(addr) as c:
            before = c.server_stats()
            # The engine is held between steps until all 24 calls have reached it: calls on one
            # channel may arrive in any order, and a first wave that finished while the last
            # calls were still arriving (800 steps) would leave nothing to cancel.
            with engine_held(server.engine_thread):
                streams = [c.stream([5, 6, 7 + i] * 20, max_tokens=800, **GREEDY) for i in range(24)]
                wait_until(lambda: server.engine_thread.num_active == 24, "all 24 calls in the engine's queue")
            stats = _wait_for_stats(c, lambda s: s.requests_running == 4, "4 running")
            assert stats.requests_waiting == 20  # and the rest wait
            for s in streams:
                s.cancel()
            stats = _settled_stats(c)
            # Nothing runs, nothing waits, no page is held by a request; cached pages are
            # counted apart from held ones, so a leak would show as held > 0.
            assert stats.kv_pages_held == 0
            assert stats.kv_pages_cached + stats.kv_pages_free == stats.kv_pages_total
            aborted = stats.requests_aborted["cancelled"] - before.requests_aborted["cancelled"]
            assert aborted == 24
            server.engine_thread.call(lambda e: e.scheduler.check_integrity())


def _wait_for_stats(client: Client, condition, what: str, seconds: float = 60) -> pb.ServerStats:
    last = []

    def met():
        last[:] = [client.server_stats()]
        return last[0] if condition(last[0]) else None

    return wait_until(met, what, seconds, detail=lambda: last[0])


def _drain(stream) -> None:
    try:
        for _ in stream:
            pass
    except grpc.RpcError:
        pass  # cancelled at the end of the test


def test_one_clients_long_streams_do_not_starve_another(secured):
    """alice fills every slot (and the queue) with long streams; bob's short request gets
    its first token within a few scheduler steps of reaching the engine, not after alice's
    streams end (~900 steps). Counted in steps, so a loaded machine does not change it."""
    server, addr, tls = secured
    thread = server.engine_thread
    waited: list[int] = []
    on_step = thread.on_step

    def watch(t, advanced, finished, now):  # on the engine thread
        for r in advanced:
            if r.client == "id:bob" and not waited:
                waited.append(t.engine.scheduler.num_steps - r.arrival)
        if on_step is not None:
            on_step(t, advanced, finished, now)

    thread.on_step = watch
    alice, bob = Client(addr, Credentials(token=ALICE, **tls)), Client(addr, Credentials(token=BOB, **tls))
    try:
        streams = [alice.stream([5, 6, 7, i], max_tokens=900, **GREEDY) for i in range(6)]
        for s in streams:
            threading.Thread(target=_drain, args=(s,), daemon=True).start()
        wait_until(lambda: len(thread.engine.scheduler.running) >= 4, "alice's streams to fill the slots", 120)
        reply = bob.generate([9, 10, 11], max_tokens=4, **GREEDY)
        assert len(reply.token_ids) == 4
        assert waited and waited[0] <= 3, f"bob's first token came {waited} steps after he arrived"
        for s in streams:
            s.cancel()
        _settled_stats(alice)
    finally:
        thread.on_step = on_step
        alice.close()
        bob.close()
