"""Serving: the gRPC server (grpc.aio), health, reflection, metrics, and graceful drain.

Start-up: bind, report NOT_SERVING, start the engine thread, which compiles every step
bucket (warm-up) before its first step, report SERVING. SIGTERM (or ``ServerHandle.stop``):
report NOT_SERVING, refuse new requests, let in-flight ones finish within the grace
period, end the rest with finish reason abort, stop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from jaxserve.engine.async_engine import EngineThread
from jaxserve.server.config import ServerConfig
from jaxserve.server.metrics import Metrics
from jaxserve.server.proto import jaxserve_pb2 as pb
from jaxserve.server.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.server.servicer import JaxServeServicer

logger = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class Server:
    """One serving instance over an ``LLM`` (model loaded, engine built)."""

    def __init__(self, llm, cfg: ServerConfig, model_name: str, progress: bool = True, before_serving=None):
        """``before_serving``: an optional coroutine function awaited after warm-up and
        before SERVING is reported (tests use it to observe the NOT_SERVING phase)."""
        self.llm = llm
        self.before_serving = before_serving
        self.cfg = cfg
        self.progress = progress
        self.metrics = Metrics()
        self.engine_thread = EngineThread(
            llm.engine, cfg.max_waiting_requests, on_step=self.metrics.on_step, on_recovery=self._on_recovery
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self.servicer = JaxServeServicer(llm, self.engine_thread, model_name)
        self.health = HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.on_bound = None  # called once the port accepts calls (before warm-up)
        self._stop: asyncio.Event | None = None
        self._server: grpc.aio.Server | None = None

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
            self.engine_thread.release()
            if self._server is not None:
                await self._server.stop(None)
            self.metrics.stop()
            raise

    async def _start(self) -> None:
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        self._server = server = grpc.aio.server(options=options)
        pb_grpc.add_JaxServeServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        self.port = server.add_insecure_port(f"{self.cfg.host}:{self.cfg.port}")
        if self.port == 0:
            raise OSError(f"cannot bind {self.cfg.host}:{self.cfg.port}")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        if self.on_bound is not None:
            self.on_bound()
        if self.cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.cfg.metrics_port, self.cfg.host)
        # Warm-up runs on the engine thread, which owns the engine from here on.
        warmup = functools.partial(self.llm.runner.warmup, self.progress) if self.cfg.warmup else None
        self.engine_thread.start(warmup)
        await asyncio.get_running_loop().run_in_executor(None, self.engine_thread.wait_ready)
        if self.before_serving is not None:
            await self.before_serving()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def wait_and_drain(self) -> None:
        await self._stop.wait()
        self.servicer.accepting = False
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.drain_grace_seconds
        while self.engine_thread.num_active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        # Past the grace period: the engine thread ends what is left with finish_reason abort.
        await loop.run_in_executor(None, self.engine_thread.stop)
        await asyncio.sleep(0.1)  # let the final messages reach their streams
        await self._server.stop(grace=1.0)
        self.metrics.stop()


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
