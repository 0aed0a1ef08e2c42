"""The engine on its own thread, with thread-safe hand-off to asyncio callers.

One thread owns the Engine (and the device): ``start`` claims the engine for it, so no
other thread can step it while it serves (``LLM.generate`` on a served engine routes its
requests here), and warm-up runs on that same thread. Callers on an asyncio loop
``submit`` a request and read :class:`Delta` objects from an ``asyncio.Queue``; plain
threads ``submit_threadsafe`` and read a ``queue.Queue``. ``abort`` ends a request at the
next step boundary and releases its pages. Commands travel over a plain ``queue.Queue``;
deltas travel back with ``queue.put``, or to an event loop with one
``loop.call_soon_threadsafe`` a step carrying every stream's delta: each such call writes to
the loop's wake-up pipe, a system call under the GIL, and a step of 256 streams made 256.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable

from jaxserve.engine.engine import Engine
from jaxserve.engine.request import Request
from jaxserve.errors import JaxServeError
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# While requests run, the live figures are replaced at most this often (seconds).
PUBLISH_EVERY_S = 0.05

# Engine threads started and not yet stopped. They are daemons (a forgotten one must not
# keep a script alive), and the interpreter ends a daemon thread wherever it is at exit:
# one inside an XLA call aborts the process ("terminate called ...", exit 134). So the
# interpreter's exit stops them first, each between two steps (atexit runs before daemon
# threads are ended): e.g. a script that leaves a program's stream early.
_RUNNING: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    for thread in list(_RUNNING):
        thread.stop()


class QueueFullError(JaxServeError):
    """Too many requests are waiting, or this client has too much in flight; retry later."""

    def __init__(self, message: str, reason: str = "queue_full"):
        super().__init__(message)
        self.reason = reason  # queue_full | client_requests | client_tokens


class EngineStoppedError(JaxServeError):
    """The engine thread has stopped (shutting down, or a failed start)."""


class RequestIdInUseError(JaxServeError):
    """A request with this id is already in flight."""


@dataclasses.dataclass(frozen=True)
class ClientLimits:
    """What one client (an identity or a peer) may have in flight at once."""

    max_requests: int = 1 << 30
    max_tokens: int = 1 << 62  # prompt + max_tokens over its requests in flight


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
    lease_id: str | None = None  # asked to pin (pin_s): the lease, or None and why in pin_refused
    pin_refused: str = ""
    prompt_logprobs: list[float | None] | None = None  # final delta, when params.prompt_logprobs
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def absorb(self, later: Delta) -> None:
        """Appends ``later`` (the same request's next delta) to this one, so a reader that
        fell behind answers once for what has piled up, as vLLM's output collector does."""
        self.token_ids += later.token_ids  # (each delta's lists are its own)
        self.text += later.text
        self.logprobs += later.logprobs
        self.top_logprobs += later.top_logprobs
        if later.is_last:  # the end and what comes with it: counts, lease, prompt logprobs
            for name in _END_FIELDS:
                setattr(self, name, getattr(later, name))


# What only a request's last delta carries: all but the request and what streams.
_STREAMED = ("request_id", "token_ids", "text", "logprobs", "top_logprobs")
_END_FIELDS = tuple(f.name for f in dataclasses.fields(Delta) if f.name not in _STREAMED)


@dataclasses.dataclass
class Submission:
    """One submitted request: where its deltas go and, once the engine has it, the Request.

    ``request`` is set on the engine thread before the first delta is pushed, so a reader
    that has received the final delta may read it (the engine no longer touches it).
    """

    deltas: asyncio.Queue | queue.Queue
    loop: asyncio.AbstractEventLoop | None = None  # an asyncio reader's: a step's deltas go to it together
    client: str = ""  # who submitted it: only they may abort it
    tokens: int = 0  # prompt + max_tokens: its share of the client's token limit
    request: Request | None = None
    sent_tokens: int = 0
    sent_chunks: int = 0  # of request.output_chunks
    submitted_at: float = 0.0

    def push(self, delta: Delta) -> None:
        """Hands ``delta`` to the reader now (a step's deltas to a loop go together: ``_send``)."""
        if self.loop is None:
            self.deltas.put(delta)
        else:
            self.loop.call_soon_threadsafe(self.deltas.put_nowait, delta)


class EngineThread:
    def __init__(
        self,
        engine: Engine,
        max_waiting_requests: int = 256,
        on_step: Callable | None = None,
        on_recovery: Callable[[bool], None] | None = None,
        client_limits: ClientLimits = ClientLimits(),
    ):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.client_limits = client_limits
        self.on_step = on_step  # called on the engine thread after each step (metrics)
        # Called with True when a failed step lost the KV cache and recovery starts, with
        # False once the engine serves again (the server's health goes NOT_SERVING between).
        self.on_recovery = on_recovery
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, Submission] = {}
        self._pending = 0  # submitted but not yet handed to the engine
        # client -> [requests, tokens] in flight (under _lock)
        self._in_flight: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        # Requests ended before finishing, by why: cancelled (the caller went away or asked),
        # error (a failed step), shutdown (drain ran out, or the thread stopped).
        self.aborted: collections.Counter[str] = collections.Counter()
        # Live figures, replaced whole by the engine thread after every batch of commands, the
        # step that leaves it idle, and steps PUBLISH_EVERY_S apart between, so readers on
        # other threads (metrics, GetServerStats) see one moment.
        self.snapshot: dict[str, int] = {}
        self._published_at = float("-inf")
        # request_id -> engine steps between abort() and the abort taking effect (metrics, tests)
        self.abort_delay_steps: dict[str, int] = {}
        self._abort_asked_at: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._warmup: Callable[[], None] | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._closed = False

    def claim(self) -> None:
        """Makes the engine thread the engine's only driver (before it starts): from here on
        other threads' offline calls queue here. Raises EngineBusyError if someone drives it."""
        self.engine.claim(self._thread, "the server's engine thread", handoff=self)

    def release(self) -> None:
        """Gives back a claim whose thread never started (a server that failed to start)."""
        if not self._thread.is_alive():
            self._close("the server failed to start")

    def start(self, warmup: Callable[[], None] | None = None) -> None:
        """Starts the engine thread (claiming the engine if not yet done); ``warmup`` (e.g.
        compiling every step bucket) runs first on that thread. Requests submitted meanwhile wait."""
        self.claim()
        self._warmup = warmup
        _RUNNING.add(self)
        self._thread.start()

    @property
    def ready(self) -> bool:
        """Warm-up has ended (well or not)."""
        return self._ready.is_set()

    def wait_ready(self) -> None:
        """Blocks until warm-up is done; re-raises its error."""
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    def stop(self) -> None:
        _RUNNING.discard(self)
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def num_waiting(self) -> int:
        return self._pending + len(self.engine.scheduler.waiting)

    @property
    def num_active(self) -> int:
        return len(self._streams)

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        client: str = "",
        pin_s: float | None = None,
    ) -> asyncio.Queue:
        """Queues a request from an asyncio loop; returns the asyncio queue its deltas arrive on.

        Raises:
            QueueFullError: the wait queue, or this client's share of it, is full.
            RequestIdInUseError: ``request_id`` is in flight already.
            EngineStoppedError: the thread has stopped.
        """
        deltas: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        submission = Submission(
            deltas, loop, client, len(prompt_ids) + params.max_tokens, submitted_at=time.monotonic()
        )
        self._submit(submission, request_id, prompt_ids, params, True, pin_s)
        return deltas

    def submit_threadsafe(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        enforce_limit: bool = True,
        pin_s: float | None = None,
    ) -> Submission:
        """Queues a request from a plain thread; its deltas arrive on ``.deltas`` (a queue.Queue).
        ``enforce_limit=False``: the caller is a local offline batch, not a client to refuse."""
        deltas: queue.Queue = queue.Queue()
        submission = Submission(deltas, submitted_at=time.monotonic())
        self._submit(submission, request_id, prompt_ids, params, enforce_limit, pin_s)
        return submission

    def _submit(
        self,
        stream: Submission,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        enforce_limit: bool,
        pin_s: float | None = None,
    ) -> None:
        self.engine.check_pin(pin_s)  # on the caller's thread, before anything is queued
        self.engine.check_params(params)  # (remembered: the front ends' validation made it)
        with self._lock:
            if self._closed:
                raise EngineStoppedError("the engine thread has stopped; it takes no more requests")
            if enforce_limit:
                self._check_limits(stream)
            if request_id in self._streams:
                raise RequestIdInUseError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._pending += 1
            held = self._in_flight[stream.client]
            held[0] += 1
            held[1] += stream.tokens
        self._commands.put(("add", request_id, prompt_ids, params, pin_s))

    def _check_limits(self, stream: Submission) -> None:
        if self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting} requests are waiting (max_waiting_requests); retry later")
        requests, tokens = self._in_flight.get(stream.client, (0, 0))
        limits = self.client_limits
        if requests >= limits.max_requests:
            raise QueueFullError(
                f"this client has {requests} requests in flight (max_requests_per_client); retry later",
                "client_requests",
            )
        if tokens + stream.tokens > limits.max_tokens:
            raise QueueFullError(
                f"this client has {tokens} tokens in flight and this request adds {stream.tokens} "
                f"(prompt + max_tokens); max_queued_tokens_per_client is {limits.max_tokens}",
                "client_tokens",
            )

    def _forget(self, request_id: str) -> Submission | None:
        """Drops a request's stream and its share of its client's limits (under _lock)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            held = self._in_flight[stream.client]
            held[0] -= 1
            held[1] -= stream.tokens
            if held[0] == 0:
                del self._in_flight[stream.client]
        return stream

    def abort(self, request_id: str, client: str | None = None) -> bool:
        """Ends a request at the next step boundary; False if it is not in flight or, with
        ``client``, belongs to another client (whose request ids are not this caller's to see)."""
        stream = self._streams.get(request_id)
        if stream is None or (client is not None and stream.client != client):
            return False
        self._abort_asked_at[request_id] = self.engine.counters["steps"]
        self._commands.put(("abort", request_id))
        return True

    def call(self, fn: Callable[[Engine], object], timeout: float | None = 60) -> object:
        """Runs ``fn(engine)`` on the engine thread between steps and returns its result
        (e.g. the scheduler's ``check_integrity`` while serving: only that thread may look inside)."""
        if threading.current_thread() is self._thread:  # already between steps: queueing would wait on itself
            return fn(self.engine)
        if self._closed:
            raise EngineStoppedError("the engine thread has stopped")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, future))
        return future.result(timeout)

    # -- engine thread ---------------------------------------------------------------------
    def _delta(self, request_id: str, stream: Submission) -> Delta:
        r = stream.request
        n0 = stream.sent_tokens
        delta = Delta(
            request_id,
            r.token_ids[r.num_prompt_tokens + n0 :],
            "".join(r.output_chunks[stream.sent_chunks :]),
            list(r.output_logprobs[n0:]) if r.params.logprobs is not None else [],
            list(r.output_top_logprobs[n0:]) if r.params.logprobs is not None else [],
        )
        stream.sent_tokens = r.num_output_tokens
        stream.sent_chunks = len(r.output_chunks)
        if r.status.is_finished:
            delta.finish_reason = r.finish_reason
            delta.stop_reason = r.stop_reason
            delta.prompt_tokens = r.num_prompt_tokens
            delta.completion_tokens = r.num_output_tokens
            delta.cached_tokens = r.num_cached_tokens
            delta.lease_id = r.lease_id
            delta.pin_refused = r.pin_refused
            if r.params.prompt_logprobs is not None:
                delta.prompt_logprobs = list(r.prompt_logprobs)
                delta.prompt_top_logprobs = list(r.prompt_top_logprobs)
        return delta

    def _handle(self, command: tuple) -> None:
        if command[0] == "add":
            _, request_id, prompt_ids, params, pin_s = command
            with self._lock:
                self._pending -= 1
            stream = self._streams.get(request_id)
            if stream is not None:
                try:
                    stream.request = self.engine.add_request(
                        prompt_ids, params, request_id=request_id, client=stream.client, pin_s=pin_s
                    )
                except JaxServeError as e:  # refused by the engine: this request ends, the thread serves on
                    with self._lock:
                        self._forget(request_id)
                    stream.push(Delta(request_id, [], "", [], [], finish_reason="abort", error=str(e)))
        elif command[0] == "call":
            _, fn, future = command
            try:
                future.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 - the caller re-raises it
                future.set_exception(e)
        elif command[0] == "abort":
            asked = self._abort_asked_at.pop(command[1], None)
            stream = self._streams.get(command[1])
            if stream is not None and stream.request is not None:
                self.engine.abort(command[1])
                self.aborted["cancelled"] += 1
                if asked is not None:  # recorded before the client hears the end
                    self.abort_delay_steps[command[1]] = self.engine.counters["steps"] - asked
                    if len(self.abort_delay_steps) > 4096:  # keep the most recent only
                        del self.abort_delay_steps[next(iter(self.abort_delay_steps))]
                self._finish(command[1], stream)

    def _finish(self, request_id: str, stream: Submission, outbox: dict | None = None) -> None:
        delta = self._delta(request_id, stream)
        with self._lock:
            self._forget(request_id)
        _send(stream, delta, outbox)

    def _end_all(self, reason: str, error: str | None, started_only: bool = False) -> None:
        """Ends the requests here (``started_only``: those the engine has already) with a
        final delta carrying ``error``; counts them as aborted for ``reason``."""
        with self._lock:
            ids = [i for i, s in self._streams.items() if s.request is not None or not started_only]
            streams = [(i, self._forget(i)) for i in ids]
        self.aborted[reason] += len(streams)
        for request_id, stream in streams:
            if stream.request is None:  # its add command never ran
                delta = Delta(request_id, [], "", [], [], finish_reason="abort")
                delta.error = error or "the engine thread stopped before this request started"
            else:
                try:
                    self.engine.abort(request_id)
                except Exception:  # noqa: BLE001 - the engine is already in trouble
                    logger.exception("abort after a failed step")
                delta = self._delta(request_id, stream)
                delta.error = error
            stream.push(delta)

    def _recover(self) -> None:
        """Re-creates the KV cache if the failed step took it (requests are ended by now)."""
        if not self.engine.runner.kv_cache_lost:
            return
        if self.on_recovery is not None:
            self.on_recovery(True)
        self.engine.recover()
        logger.warning("the failed step had taken the KV cache: re-created it and emptied the prefix cache")
        if self.on_recovery is not None:
            self.on_recovery(False)

    def _run(self) -> None:
        try:
            if self._warmup is not None:
                self._warmup()
        except BaseException as e:  # noqa: BLE001 - reported to wait_ready's caller
            self._start_error = e
            self._close(f"warm-up failed: {type(e).__name__}: {e}")
            return
        finally:
            self._ready.set()
        try:
            self._serve()
        finally:
            self._close()

    def _close(self, error: str | None = None) -> None:
        """Ends every request still here (finish_reason abort, or ``error``), refuses new
        ones and gives the engine back, so offline calls may step it again."""
        with self._lock:
            self._closed = True
        self._end_all("error" if error else "shutdown", error)
        self._publish()
        self.engine.release(self._thread)

    def _publish(self, force: bool = True) -> None:
        """Replaces the live figures; ``force=False`` (after a step while requests run): only
        if PUBLISH_EVERY_S has passed, as counting the pages held walks every running
        request's pages (~1.2 ms at 256 requests of 100 pages, each step)."""
        now = time.monotonic()
        if not force and now - self._published_at < PUBLISH_EVERY_S:
            return
        self._published_at = now
        self.snapshot = {
            **self.engine.stats(),
            "requests_waiting": self.num_waiting,  # those not yet handed to the engine too
            **{f"aborted_{reason}": n for reason, n in self.aborted.items()},
        }

    def _serve(self) -> None:
        self._publish()
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            handled = False
            try:
                command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
                self._handle(command)
                handled = True
                while True:  # everything that arrived meanwhile, before the next step
                    self._handle(self._commands.get_nowait())
            except queue.Empty:
                pass
            if handled:  # adds and aborts change the figures even when no step follows
                self._publish()
            if not self.engine.has_unfinished():
                continue
            try:
                advanced, finished = self.engine.step()
            except Exception as e:  # noqa: BLE001 - no request may hang on a failed step
                logger.exception("engine step failed; ending the requests in flight")
                self._end_all("error", f"engine step failed: {type(e).__name__}: {e}", started_only=True)
                self._recover()
                self._publish()
                continue
            now = time.monotonic()
            self._publish(force=not self.engine.has_unfinished())  # idle: the final figures at once
            if self.on_step is not None:
                self.on_step(self, advanced, finished, now)
            done = {r.request_id for r in finished}
            outbox: dict[asyncio.AbstractEventLoop, list] = {}
            for r in advanced:
                stream = self._streams.get(r.request_id)
                if stream is None:
                    continue
                if r.request_id in done:
                    self._finish(r.request_id, stream, outbox)
                elif r.num_output_tokens > stream.sent_tokens:
                    _send(stream, self._delta(r.request_id, stream), outbox)
            for loop, items in outbox.items():
                loop.call_soon_threadsafe(_deliver, items)
        # shutting down: _close ends whatever is left with finish_reason abort


def _send(stream: Submission, delta: Delta, outbox: dict | None) -> None:
    """Pushes ``delta`` now, or (an asyncio reader, with ``outbox``) adds it to its loop's
    batch, which the step hands over in one call."""
    if outbox is None or stream.loop is None:
        stream.push(delta)
    else:
        outbox.setdefault(stream.loop, []).append((stream.deltas, delta))


def _deliver(items: list[tuple[asyncio.Queue, Delta]]) -> None:
    """On the event loop: one step's deltas to their readers."""
    for deltas, delta in items:
        deltas.put_nowait(delta)
