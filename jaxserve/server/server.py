"""Serving: the gRPC server (grpc.aio), the OpenAI-compatible HTTP API (uvicorn, same loop,
same engine thread), health, reflection, metrics, and graceful drain.

Start-up: bind, report NOT_SERVING, start the engine thread, which compiles every step
bucket (warm-up) before its first step, report SERVING. SIGTERM (or ``ServerHandle.stop``):
report NOT_SERVING, refuse new requests, let in-flight ones finish within the grace
period, end the rest with finish reason abort, stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import socket
import ssl
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from jaxserve.assembly import EngineHandle
from jaxserve.engine.async_engine import ClientLimits, EngineThread
from jaxserve.errors import ConfigError
from jaxserve.server.auth import TokenAuth, read_tokens
from jaxserve.server.config import ServerConfig, grpc_address
from jaxserve.server.interceptors import AuthInterceptor, DecodeInterceptor
from jaxserve.server.metrics import Metrics
from jaxserve.server.proto import jaxserve_pb2 as pb
from jaxserve.server.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.server.servicer import JaxServeServicer

logger = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # a response's; a request's is server.max_request_bytes


class Server:
    """One serving instance over an assembled engine (``jaxserve.assembly``)."""

    def __init__(
        self, handle: EngineHandle, cfg: ServerConfig, model_name: str, progress: bool = True, before_serving=None
    ):
        """``before_serving``: an optional coroutine function awaited after warm-up and
        before SERVING is reported (tests use it to observe the NOT_SERVING phase)."""
        self.handle = handle
        self.before_serving = before_serving
        self.cfg = cfg
        self.progress = progress
        self.metrics = Metrics(snapshot=lambda: self.engine_thread.snapshot)
        self.engine_thread = EngineThread(
            handle.engine,
            cfg.max_waiting_requests,
            on_step=self.metrics.on_step,
            on_recovery=self._on_recovery,
            client_limits=ClientLimits(cfg.max_requests_per_client, cfg.max_queued_tokens_per_client),
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self.auth = TokenAuth(read_tokens(cfg.auth_tokens_file)) if cfg.auth_tokens_file else None
        self.servicer = JaxServeServicer(handle, self.engine_thread, model_name, cfg, self.auth, self.metrics)
        self.health = HealthServicer()
        self.model_name = model_name
        self.http = None  # the OpenAIServer, once serving HTTP (server.http_port)
        self._http_server = None  # its uvicorn server
        self._http_socket: socket.socket | None = None
        self._http_task: asyncio.Task | None = None  # uvicorn's serve()
        self.port: int | None = None
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self.on_bound = None  # called once the port accepts calls (before warm-up)
        self._stop: asyncio.Event | None = None
        self._stop_now = False  # a second stop request: skip the rest of the grace period
        self._serving = False
        self._server: grpc.aio.Server | None = None

    def _state(self) -> str:
        """For the HTTP front end: warming_up, serving or draining."""
        if self._stop is not None and self._stop.is_set():
            return "draining"
        return "serving" if self._serving else "warming_up"

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _on_recovery(self, recovering: bool) -> None:
        """Engine thread: health is NOT_SERVING while a lost KV cache is re-created."""
        status = health_pb2.HealthCheckResponse.NOT_SERVING if recovering else health_pb2.HealthCheckResponse.SERVING
        if self._loop is None or (self._stop is not None and self._stop.is_set()):
            return  # not serving yet, or draining: health is NOT_SERVING already
        try:  # wait, so NOT_SERVING is visible before recovery proceeds
            asyncio.run_coroutine_threadsafe(self._set_health(status), self._loop).result(timeout=10)
        except Exception:  # noqa: BLE001 - the loop is closing; health no longer matters
            logger.warning("could not report health %s", status)

    async def start(self) -> None:
        # The engine is ours before anything is bound: a server over an LLM that another
        # thread is driving fails here, with nothing left listening.
        self.engine_thread.claim()
        try:
            await self._start()
        except BaseException:
            gc.unfreeze()  # frozen during warm-up (_start): this start's objects may go
            self.engine_thread.release()
            if self._server is not None:
                await self._server.stop(None)
            await self._stop_http()
            self.servicer.close()
            self.metrics.stop()
            raise

    async def _start(self) -> None:
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        options = [
            ("grpc.max_receive_message_length", self.cfg.max_request_bytes),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # gRPC sets SO_REUSEPORT by default: a second server on a taken port would start
            # and silently take part of the traffic. One port, one server.
            ("grpc.so_reuseport", 0),
        ]
        service = pb.DESCRIPTOR.services_by_name["JaxServe"]
        request_types = {m.name: getattr(pb, m.input_type.name) for m in service.methods}
        interceptors = [DecodeInterceptor(SERVICE_NAME, request_types)]
        if self.auth is not None:  # first: an unauthenticated body is never parsed
            interceptors.insert(0, AuthInterceptor(self.auth))
        self._server = server = grpc.aio.server(options=options, interceptors=interceptors)
        pb_grpc.add_JaxServeServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        self.port = self._bind(server)
        if self.cfg.metrics_port is not None:  # before warm-up: a taken port fails fast
            try:
                self.metrics_port = self.metrics.serve(self.cfg.metrics_port, self.cfg.host)
            except OSError as e:
                raise ConfigError(
                    f"server.metrics_port = {self.cfg.metrics_port}: cannot listen on "
                    f"{grpc_address(self.cfg.host, self.cfg.metrics_port)} ({e.strerror or e}); "
                    f"choose a free port, or null to turn metrics off"
                ) from None
        if self.cfg.http_port is not None:  # bound now (a taken port fails fast), served below
            self._bind_http()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        if self.on_bound is not None:
            self.on_bound()
        # Warm-up runs on the engine thread, which owns the engine from here on.
        warmup = functools.partial(self.handle.engine.runner.warmup, self.progress) if self.cfg.warmup else None
        self.engine_thread.start(warmup)
        if self._http_socket is not None:  # while the engine warms up: /health answers 503 until SERVING
            await self._serve_http()
        # Python's full collections walk every object that survived the last one: after
        # start-up ~240,000 (JAX, the model, the tokenizer), and two of them took 175 and 97
        # ms in one 16-stream run, every thread that needed the interpreter stopped, the
        # engine's included (SmolLM2, 2-core Xeon). Frozen, those objects are never walked
        # again (vLLM does the same); what the start made and dropped is collected first
        # (~80 ms: done here, while warm-up still runs, rather than after it). Unfrozen at
        # the end of the drain, so a process that starts another server (tests, notebooks)
        # can collect this one's cycles.
        gc.collect()
        gc.freeze()
        # Polled rather than awaited in an executor: Ctrl-C during warm-up must not wait for
        # a thread pool that is blocked until warm-up ends.
        while not self.engine_thread.ready:
            await asyncio.sleep(0.01)
        self.engine_thread.wait_ready()  # re-raises a failed warm-up
        if self.before_serving is not None:
            await self.before_serving()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._serving = True

    def _bind_http(self) -> None:
        cfg = self.cfg
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        # As uvicorn and gRPC do: a restarted server may bind while the last one's closed
        # connections linger (TIME_WAIT, a minute); a port some socket listens on stays refused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.http_port))
            sock.listen(128)  # connections queue here until uvicorn accepts them
        except OSError as e:
            sock.close()
            raise ConfigError(
                f"server.http_port = {cfg.http_port}: cannot listen on {grpc_address(cfg.host, cfg.http_port)} "
                f"({e.strerror or e}); choose a free port, or null to turn the HTTP API off"
            ) from None
        self._http_socket = sock
        self.http_port = sock.getsockname()[1]

    async def _serve_http(self) -> None:
        """The HTTP API on the bound socket. Imported here, not at start-up's beginning:
        FastAPI's ~0.2 s of imports then overlap the engine thread's warm-up."""
        import uvicorn

        from jaxserve.server.openai_api import OpenAIServer

        class EmbeddedUvicorn(uvicorn.Server):
            """uvicorn on our event loop, leaving the process's signals to ``jaxserve run``
            (whose SIGTERM drains both transports together)."""

            @contextlib.contextmanager
            def capture_signals(self):
                yield

        cfg = self.cfg
        self.http = OpenAIServer(
            self.handle, self.engine_thread, self.model_name, cfg, self._state, self.auth, self.metrics
        )
        sock = self._http_socket
        tls = {}
        if cfg.tls:  # the same certificate, and the same client CA, as gRPC's
            tls = dict(ssl_certfile=cfg.tls_cert_file, ssl_keyfile=cfg.tls_key_file)
            if cfg.tls_client_ca_file is not None:
                tls.update(ssl_ca_certs=cfg.tls_client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(
            self.http.app,
            log_config=None,
            lifespan="off",
            ws="none",  # no websockets: their protocol modules' import is start-up time for nothing
            timeout_graceful_shutdown=2,
            timeout_keep_alive=cfg.http_keep_alive_seconds,
            access_log=False,
            **tls,
        )
        self._http_server = http = EmbeddedUvicorn(config)
        self._http_task = task = asyncio.ensure_future(http.serve(sockets=[sock]))
        while not http.started:  # bound already; this waits for its accept loop
            if task.done():
                task.result()  # re-raises why it could not start
                raise ConfigError("server.http_port: the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)

    async def _stop_http(self) -> None:
        http, self._http_server = self._http_server, None
        if http is not None:
            http.should_exit = True  # its loop notices within 0.1 s, closes connections, returns
            await asyncio.gather(self._http_task, return_exceptions=True)  # a failed start is raised already
            self._http_task = None
        if self._http_socket is not None:
            self._http_socket.close()
            self._http_socket = None
        if self.http is not None:
            self.http.close()

    def _bind(self, server: grpc.aio.Server) -> int:
        cfg = self.cfg
        address = grpc_address(cfg.host, cfg.port)
        try:
            if cfg.tls:
                server_credentials = grpc.ssl_server_credentials(
                    [(_read(cfg.tls_key_file), _read(cfg.tls_cert_file))],
                    root_certificates=_read(cfg.tls_client_ca_file) if cfg.tls_client_ca_file else None,
                    require_client_auth=cfg.tls_client_ca_file is not None,
                )
                port = server.add_secure_port(address, server_credentials)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError:
            port = 0
        if port == 0:
            raise ConfigError(
                f"server.port = {cfg.port}: cannot listen on {address} (the port is taken, or "
                f"server.host is not an address of this machine)"
            )
        return port

    @property
    def serving(self) -> bool:
        """Warm-up is done and SERVING has been reported (or draining has begun)."""
        return self._serving

    def request_stop(self) -> None:
        """The first call drains within the grace period; a second ends the drain at once."""
        if self._stop is None:
            return
        if self._stop.is_set():
            self._stop_now = True
        self._stop.set()

    async def wait_and_drain(self) -> None:
        await self._stop.wait()
        self.servicer.accepting = False
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.drain_grace_seconds
        while self.engine_thread.num_active and loop.time() < deadline and not self._stop_now:
            await asyncio.sleep(0.05)
        # Past the grace period: the engine thread ends what is left with finish_reason abort.
        await loop.run_in_executor(None, self.engine_thread.stop)
        await asyncio.sleep(0.1)  # let the final messages reach their streams
        await self._server.stop(grace=1.0)
        await self._stop_http()
        self.servicer.close()
        self.metrics.stop()
        gc.unfreeze()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class ServerHandle:
    """Runs a Server on a background thread with its own event loop (tests, notebooks)."""

    def __init__(self, server: Server):
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jaxserve-grpc", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main():
            self.server.on_bound = self._ready.set
            try:
                await self.server.start()
            except BaseException as e:  # noqa: BLE001 - reported to the starting thread
                self._error = e
                self._ready.set()
                raise
            await self.server.wait_and_drain()

        try:
            self._loop.run_until_complete(main())
        except BaseException:  # noqa: BLE001 - already reported
            pass

    def start(self, timeout: float = 600) -> int:
        """Starts serving; returns once the port is bound (SERVING may come later)."""
        self._thread.start()
        self._ready.wait(timeout)
        if self._error is not None:
            raise self._error
        return self.server.port

    def stop(self, timeout: float = 120) -> None:
        self._loop.call_soon_threadsafe(self.server.request_stop)
        self._thread.join(timeout)
