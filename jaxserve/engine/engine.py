"""The step loop: schedule -> run the jitted step -> apply tokens -> detokenize, stop.

One thread owns this object (and the device); requests come and go between steps. The
owner is explicit: ``claim`` / ``owned_by_current_thread`` bind one thread, and while one
is bound every other thread's ``step``, ``add_request`` and ``abort`` raise
:class:`EngineBusyError` instead of racing it (two steppers would interleave scheduler
updates and hand an already-donated KV cache to the device).
Text is produced here, incrementally and UTF-8-safe, and stop strings are matched across
token boundaries: text that could still become a stop string is held back until it
cannot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.errors import JaxServeError
from jaxserve.runner.batch import ScheduledSeq
from jaxserve.runner.model_runner import ModelRunner, SeqSampling
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one step computed: (request_id, num_tokens, is_decode) per sequence."""

    step: int
    seqs: tuple[tuple[str, int, bool], ...]
    num_preempted: int


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    for n in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0


class _TextState:
    """Per-request detokenizer plus the text held back for stop-string matching."""

    def __init__(self, tokenizer, request: Request):
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, request.params.skip_special_tokens)
        self.held = ""


class EngineBusyError(JaxServeError):
    """Another thread drives this engine; only its owner may step, add to or abort it."""


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer,
        eos_token_ids: set[int],
        keep_step_records: bool = False,
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.keep_step_records = keep_step_records
        self.step_records: list[StepRecord] = []
        self.requests: dict[str, Request] = {}
        self._text: dict[str, _TextState] = {}
        self._ids = itertools.count()
        self.counters = {"steps": 0, "prefill_tokens_computed": 0, "decode_tokens": 0, "recoveries": 0}
        # Cumulative seconds per phase of step(): scheduling (+ building the step's inputs
        # lists), the runner (see runner.timings: packing vs device), update + text.
        self.timings = {"schedule_s": 0.0, "update_s": 0.0, "step_s": 0.0}
        self._owner_lock = threading.Lock()
        self._owner: tuple[threading.Thread, str] | None = None
        # The serving hand-off (an EngineThread) while one owns this engine: offline callers
        # (LLM.generate) route their requests through it instead of stepping themselves.
        self.handoff: Any = None

    # -- ownership -------------------------------------------------------------------
    def claim(self, thread: threading.Thread, who: str, handoff: Any = None) -> None:
        """Makes ``thread`` the only one allowed to drive this engine until ``release``."""
        with self._owner_lock:
            if self._owner is not None and self._owner[0] is not thread:
                raise EngineBusyError(
                    f"the engine is driven by {self._owner[1]}; {who} cannot drive it at the same time "
                    "(serve it and send requests through the server, or wait for that call to end)"
                )
            self._owner = (thread, who)
            self.handoff = handoff

    def release(self, thread: threading.Thread) -> None:
        with self._owner_lock:
            if self._owner is not None and self._owner[0] is thread:
                self._owner = None
                self.handoff = None

    @contextlib.contextmanager
    def owned_by_current_thread(self, who: str) -> Iterator[None]:
        """Binds the calling thread for the block (re-entrant: an owner's nested call passes)."""
        me = threading.current_thread()
        if self._owner is not None and self._owner[0] is me:
            yield
            return
        self.claim(me, who)
        try:
            yield
        finally:
            self.release(me)

    def _check_owner(self, action: str) -> None:
        owner = self._owner
        if owner is not None and owner[0] is not threading.current_thread():
            raise EngineBusyError(
                f"engine.{action} called on thread {threading.current_thread().name!r}, but the engine "
                f"is driven by {owner[1]}; hand requests to that owner instead"
            )

    # -- requests --------------------------------------------------------------------
    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None, client: str = ""
    ) -> Request:
        """Queues a request; ``client`` names who asked (fair admission shares slots by it)."""
        self._check_owner("add_request")
        request_id = request_id or f"req-{next(self._ids)}"
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        request = Request(request_id, list(prompt_token_ids), params, seed, frozenset(stop), client=client)
        self.requests[request_id] = request
        self._text[request_id] = _TextState(self.tokenizer, request)
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> None:
        self._check_owner("abort")
        request = self.requests.pop(request_id, None)
        self._text.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request)

    def recover(self) -> bool:
        """After a failed step whose requests have all been ended: if the step had taken the
        donated KV cache with it, allocates a fresh cache and empties the prefix cache (its
        pages held the lost K/V). Returns whether it had to."""
        self._check_owner("recover")
        if not self.runner.kv_cache_lost:
            return False
        if self.scheduler.has_unfinished():
            raise RuntimeError("recover() needs every request ended first: their K/V went with the cache")
        self.runner.reset_kv_cache()
        if self.scheduler.cache is not None:
            self.scheduler.cache.clear()
        self.counters["recoveries"] += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _sampling(self, request: Request) -> SeqSampling:
        params = request.params
        blocked = tuple(sorted(request.stop_token_ids)) if len(request.output_token_ids) < params.min_tokens else ()
        if params.has_penalties:
            return SeqSampling(params, request.seed, request.all_token_ids, len(request.prompt_token_ids), blocked)
        return SeqSampling(params, request.seed, blocked_ids=blocked)

    def _emit_text(self, request: Request, token: int) -> None:
        """Detokenizes the request's newest token and applies stop strings."""
        state = self._text[request.request_id]
        params = request.params
        is_stop_token = request.status is RequestStatus.FINISHED_STOPPED and request.stop_reason == token
        buf = state.held + ("" if is_stop_token else state.detok.add(token))
        state.held = ""
        if params.stop:
            hits = [(buf.find(s), s) for s in params.stop if s in buf]
            if hits:
                at, stop = min(hits)
                request.output_text += buf[: at + len(stop)] if params.include_stop_str_in_output else buf[:at]
                request.stop_reason = stop
                if request.status.is_finished:  # it ended this step anyway (length, stop token)
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
                return
            if not request.status.is_finished:
                keep = _held_back(buf, params.stop)
                buf, state.held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        request.output_text += buf

    def step(self) -> tuple[list[Request], list[Request]]:
        """Runs one step; returns (requests that got a token, requests that finished)."""
        self._check_owner("step")
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return [], []
        seqs, sampling = [], []
        is_decode = [request.is_prefill_done for request, _ in out.scheduled]
        for request, n in out.scheduled:
            start = request.num_computed_tokens
            seqs.append(ScheduledSeq(request.all_token_ids[start : start + n], start, request.pages))
            sampling.append(self._sampling(request))
        if out.page_copies:
            self.runner.copy_pages(out.page_copies)
        t1 = time.perf_counter()
        result = self.runner.execute(seqs, sampling)
        t2 = time.perf_counter()
        before = {id(r): len(r.output_token_ids) for r, _ in out.scheduled}
        self.scheduler.update(out, result.tokens.tolist(), result.logprobs.tolist())
        advanced, finished = [], []
        for i, (request, _) in enumerate(out.scheduled):
            if len(request.output_token_ids) == before[id(request)]:
                continue
            if request.params.logprobs:
                n = request.params.logprobs
                request.output_top_logprobs.append(
                    list(zip(result.top_ids[i, :n].tolist(), result.top_logprobs[i, :n].tolist(), strict=True))
                )
            self._emit_text(request, request.output_token_ids[-1])
            advanced.append(request)
            if request.status.is_finished:
                finished.append(request)
                self.requests.pop(request.request_id, None)
                self._text.pop(request.request_id, None)
        self.timings["schedule_s"] += t1 - t0
        self.timings["update_s"] += time.perf_counter() - t2
        self.timings["step_s"] += time.perf_counter() - t0
        self.counters["steps"] += 1
        self.counters["decode_tokens"] += out.num_decode_tokens
        self.counters["prefill_tokens_computed"] += out.num_prefill_tokens
        if self.keep_step_records:
            seq_records = tuple((r.request_id, n, d) for (r, n), d in zip(out.scheduled, is_decode, strict=True))
            self.step_records.append(StepRecord(self.counters["steps"], seq_records, len(out.preempted)))
        return advanced, finished

    def stats(self) -> dict[str, int]:
        pool = self.scheduler.pool
        cache = self.scheduler.cache
        held_by_requests = {p for r in self.scheduler.running for p in r.pages}
        return {
            **self.counters,
            "prefix_cache_hit_tokens": cache.hit_tokens if cache else 0,
            "prefix_cache_queried_tokens": cache.queried_tokens if cache else 0,
            "pages_held_by_requests": len(held_by_requests),
            "pages_cached_only": pool.num_in_use - len(held_by_requests),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_compiles": self.runner.num_compiles,
            "pages_total": pool.num_usable,
            "pages_free": pool.num_free,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }
