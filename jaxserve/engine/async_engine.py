"""The engine on its own thread, with thread-safe hand-off to asyncio callers.

One thread owns the Engine (and the device). Callers on an asyncio loop ``submit`` a
request and read :class:`Delta` objects from an ``asyncio.Queue``; ``abort`` ends a
request at the next step boundary and releases its pages. Commands travel over a plain
``queue.Queue``; deltas travel back with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

from jaxserve.engine.engine import Engine
from jaxserve.engine.request import Request
from jaxserve.errors import JaxServeError
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(JaxServeError):
    """Too many requests are waiting; retry later."""


@dataclasses.dataclass
class Delta:
    """What a request produced since its previous delta; the last one has ``finish_reason``."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None  # the engine failed this step: the request ended without a result


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request: Request | None = None
    sent_tokens: int = 0
    sent_text: int = 0
    submitted_at: float = 0.0
    first_token_at: float | None = None


class EngineThread:
    def __init__(self, engine: Engine, max_waiting_requests: int = 256, on_step: Callable | None = None):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.on_step = on_step  # called on the engine thread after each step (metrics)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._pending = 0  # submitted but not yet handed to the engine
        # request_id -> engine steps between abort() and the abort taking effect (metrics, tests)
        self.abort_delay_steps: dict[str, int] = {}
        self._abort_asked_at: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=30)

    @property
    def num_waiting(self) -> int:
        return self._pending + len(self.engine.scheduler.waiting)

    @property
    def num_active(self) -> int:
        return len(self._streams)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """Queues a request; returns the asyncio queue its deltas arrive on."""
        with self._lock:
            if self.num_waiting >= self.max_waiting_requests:
                raise QueueFullError(f"{self.num_waiting} requests are waiting (max_waiting_requests); retry later")
            if request_id in self._streams:
                raise JaxServeError(f"request_id {request_id!r} is already in use")
            stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), submitted_at=time.monotonic())
            self._streams[request_id] = stream
            self._pending += 1
        self._commands.put(("add", request_id, prompt_ids, params))
        return stream.queue

    def abort(self, request_id: str) -> bool:
        """Ends a request at the next step boundary; False if it is not running."""
        known = request_id in self._streams
        if known:
            self._abort_asked_at[request_id] = self.engine.counters["steps"]
            self._commands.put(("abort", request_id))
        return known

    # -- engine thread ---------------------------------------------------------------------
    def _push(self, stream: _Stream, delta: Delta) -> None:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)

    def _delta(self, request_id: str, stream: _Stream) -> Delta:
        r = stream.request
        tokens = r.output_token_ids[stream.sent_tokens :]
        n0 = stream.sent_tokens
        delta = Delta(
            request_id,
            list(tokens),
            r.output_text[stream.sent_text :],
            list(r.output_logprobs[n0:]) if r.params.logprobs is not None else [],
            list(r.output_top_logprobs[n0:]) if r.params.logprobs is not None else [],
        )
        stream.sent_tokens = len(r.output_token_ids)
        stream.sent_text = len(r.output_text)
        if r.status.is_finished:
            delta.finish_reason = r.finish_reason
            delta.stop_reason = r.stop_reason
            delta.prompt_tokens = len(r.prompt_token_ids)
            delta.completion_tokens = len(r.output_token_ids)
            delta.cached_tokens = r.num_cached_tokens
        return delta

    def _handle(self, command: tuple) -> None:
        if command[0] == "add":
            _, request_id, prompt_ids, params = command
            with self._lock:
                self._pending -= 1
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.request = self.engine.add_request(prompt_ids, params, request_id=request_id)
        elif command[0] == "abort":
            asked = self._abort_asked_at.pop(command[1], None)
            stream = self._streams.get(command[1])
            if stream is not None and stream.request is not None:
                self.engine.abort(command[1])
                self._finish(command[1], stream)
                if asked is not None:
                    self.abort_delay_steps[command[1]] = self.engine.counters["steps"] - asked
                    if len(self.abort_delay_steps) > 4096:  # keep the most recent only
                        del self.abort_delay_steps[next(iter(self.abort_delay_steps))]

    def _finish(self, request_id: str, stream: _Stream) -> None:
        self._push(stream, self._delta(request_id, stream))
        with self._lock:
            self._streams.pop(request_id, None)

    def _fail_all(self, message: str) -> None:
        for request_id, stream in list(self._streams.items()):
            if stream.request is None:
                continue
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine is already in trouble
                logger.exception("abort after a failed step")
            delta = self._delta(request_id, stream)
            delta.error = message
            self._push(stream, delta)
            with self._lock:
                self._streams.pop(request_id, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            try:
                command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
                self._handle(command)
                while True:  # everything that arrived meanwhile, before the next step
                    self._handle(self._commands.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                advanced, finished = self.engine.step()
            except Exception as e:  # noqa: BLE001 - no request may hang on a failed step
                logger.exception("engine step failed; ending the requests in flight")
                self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                continue
            now = time.monotonic()
            if self.on_step is not None:
                self.on_step(self, advanced, finished, now)
            done = {r.request_id for r in finished}
            for r in advanced:
                stream = self._streams.get(r.request_id)
                if stream is None:
                    continue
                if stream.first_token_at is None:
                    stream.first_token_at = now
                if r.request_id in done:
                    self._finish(r.request_id, stream)
                elif len(r.output_token_ids) > stream.sent_tokens:
                    self._push(stream, self._delta(r.request_id, stream))
        # shutting down: whatever is left ends with finish_reason abort
        for request_id, stream in list(self._streams.items()):
            if stream.request is not None:
                self.engine.abort(request_id)
                self._finish(request_id, stream)
