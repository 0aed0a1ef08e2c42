"""The step loop: schedule -> run the jitted step -> apply tokens -> output stage.

Overlap scheduling (``overlap=True``, SGLang's overlap scheduler and vLLM's async
scheduling in spirit): ``step`` schedules and dispatches step N while step N-1 still runs
on the device, then waits for N-1's tokens and applies them (stop checks, text, streams)
while N runs. The host work of a step thus hides behind the device's. A decode in step
N whose input is N-1's token takes it from the device (``ScheduledSeq.feed_row``), so
nothing waits for it; each ``step`` returns the requests that got a token from N-1.
Outputs are the serial loop's: the same rows see the same inputs. The price: a request
that N-1's token stops (a stop token or string) has one wasted row in step N. A
penalised row's token history gets N-1's token on the device too (``feed_history``).
A structured-output request is the exception: its next token's bitmask is computed on
the host from every token so far, so a step with one in flight waits for it first.

One thread owns this object (and the device); requests come and go between steps. The
owner is explicit: ``claim`` / ``owned_by_current_thread`` bind one thread, and while one
is bound every other thread's ``step``, ``add_request`` and ``abort`` raise
:class:`EngineBusyError` instead of racing it (two steppers would interleave scheduler
updates and hand an already-donated KV cache to the device).
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

from jaxserve.engine.output import OutputStage
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Pending, Sampled, Scheduler, SchedulerOutput
from jaxserve.engine.structured import GrammarCompiler
from jaxserve.errors import JaxServeError, RequestError, check_prompt_ids, check_token_ids
from jaxserve.runner import compile_counter
from jaxserve.runner.batch import ScheduledSeq
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step import SeqSampling, TokenHistory
from jaxserve.sampling_params import SamplingParams

MAX_PIN_S = 3600.0  # the longest lease one request may ask for


class EngineBusyError(JaxServeError):
    """Another thread drives this engine; only its owner may step, add to or abort it."""


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose tokens are not applied yet."""

    pending: list[Pending]  # the rows that sample a token (Scheduler.commit)
    handle: Any  # the runner's, for fetch


class Engine:
    def __init__(
        self, runner: ModelRunner, scheduler: Scheduler, tokenizer, eos_token_ids: set[int], overlap: bool = False
    ):
        self.runner = runner
        self.overlap = overlap
        self._in_flight: _InFlight | None = None
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.output = OutputStage(tokenizer, scheduler)
        self.grammars = GrammarCompiler(tokenizer, getattr(runner, "vocab_size", None), self.eos_token_ids)
        self._ids = itertools.count()
        self.counters = {"steps": 0, "prefill_tokens_computed": 0, "decode_tokens": 0, "recoveries": 0}
        # Cumulative seconds per phase of step(): scheduling (+ building the step's inputs
        # lists), the runner (see runner.timings: packing vs device), update + text.
        # Overlapped, schedule_s and update_s run while the device computes the step before.
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
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        client: str = "",
        pin_s: float | None = None,
    ) -> Request:
        """Queues a request; ``client`` names who asked (fair admission shares slots by it).
        ``pin_s``: when it finishes, its tokens stay pinned in the prefix cache for that many
        seconds (``request.lease_id``; ``unpin`` ends it sooner).

        Raises:
            RequestError: an empty prompt, one of max_model_len tokens or more, an id outside
                the vocabulary (the front doors check these as they encode; a caller handing
                ids straight here met a ValueError inside a step, filling its page table),
                ``pin_s`` out of range, or pinning without a prefix cache.
        """
        self._check_owner("add_request")
        check_prompt_ids(prompt_token_ids, self.scheduler.max_model_len, self.grammars.vocab_size)
        if params.prompt_logprobs is not None and getattr(self.runner, "channel", None) is not None:
            raise RequestError(
                "sampling_params.prompt_logprobs: not available on a multi-host deployment "
                "(the scoring step is not replayed on the other processes)"
            )
        self.check_pin(pin_s)
        grammar = self.check_params(params)
        request_id = request_id or f"req-{next(self._ids)}"
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        request = Request(request_id, list(prompt_token_ids), params, seed, frozenset(stop), client=client, pin_s=pin_s)
        if grammar is not None:
            request.constraint = self.grammars.constraint(grammar)
        self.requests[request_id] = request
        self.output.add(request)
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> None:
        self._check_owner("abort")
        request = self.requests.pop(request_id, None)
        self.output.drop(request_id)
        if request is not None:
            self.scheduler.abort(request)

    def check_pin(self, pin_s: float | None) -> None:
        """Raises RequestError unless ``pin_s`` is None or a lease this engine can give: a
        number of seconds in (0, MAX_PIN_S], with a prefix cache. Reads configuration only,
        so any thread may call it (the engine thread's hand-off checks before queuing)."""
        if pin_s is None:
            return
        if not (isinstance(pin_s, int | float) and not isinstance(pin_s, bool) and 0 < pin_s <= MAX_PIN_S):
            raise RequestError(f"pin_s = {pin_s!r}: must be a number of seconds in (0, {MAX_PIN_S:g}]")
        if not self.scheduler.kv.prefix_caching:
            raise RequestError("pin_s: pinning needs the prefix cache (enable_prefix_caching: true)")

    def check_params(self, params: SamplingParams) -> str | None:
        """What SamplingParams cannot check alone: logit_bias and stop token ids within the
        vocabulary and the structured-output constraint (json_schema, regex...), whose
        grammar it returns (None: unconstrained). Raises RequestError naming the field and
        what is wrong. Any thread may call it: front ends do, on their workers, before
        queuing; grammars checked once are remembered."""
        vocab = self.grammars.vocab_size
        for token, _ in params.logit_bias:
            if token >= vocab:
                raise RequestError(
                    f"sampling_params.logit_bias: token id {token} is out of range; allowed 0..{vocab - 1}"
                )
        # An id that could never be sampled is a mistake, not a stop condition.
        check_token_ids(params.stop_token_ids, vocab, "sampling_params.stop_token_ids")
        if not params.is_constrained:
            return None
        if getattr(self.runner, "channel", None) is not None:
            raise RequestError(
                "sampling_params: structured output is not available on a multi-host deployment "
                "(the token masks are not replayed on the other processes)"
            )
        return self.grammars.check(params)

    def unpin(self, lease_id: str, client: str | None = None) -> bool:
        """Ends a lease (``add_request(pin_s=...)``); False if it has ended or expired
        already or, with ``client``, was made by another client."""
        self._check_owner("unpin")
        return self.scheduler.kv.prefix_caching and self.scheduler.kv.unpin(lease_id, client)

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
        self.scheduler.kv.clear_cache()
        self.counters["recoveries"] += 1
        return True

    def has_unfinished(self) -> bool:
        """Requests to run, or a dispatched step to apply."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def _sampling(self, request: Request) -> SeqSampling:
        params = request.params
        blocked = tuple(sorted(request.stop_token_ids)) if request.num_sampled < params.min_tokens else ()
        if params.has_penalties:  # its ids so far; the runner copies them into the step's input
            if request.history is None:
                request.history = TokenHistory()
            history = request.history.of(request.token_ids)
            return SeqSampling(params, request.seed, history, request.num_prompt_tokens, blocked)
        return SeqSampling(params, request.seed, blocked_ids=blocked)

    def step(self) -> tuple[list[Request], list[Request]]:
        """Runs one step; returns (requests that got a token or ended, requests that
        finished). Overlapped, the tokens are those of the step dispatched by the call
        before; a prefill-only request ends in the call that dispatched its last chunk."""
        self._check_owner("step")
        t0 = time.perf_counter()
        prev, self._in_flight = self._in_flight, None  # a failure below drops it with the step
        got, ended = [], []
        if prev is not None and any(p.request.constraint is not None for p in prev.pending):
            # A constrained row's next bitmask needs the token in flight: apply it first
            # (steps with structured output are not overlapped).
            got += self._apply(prev)
            prev = None
        out = self.scheduler.schedule()
        if out.is_empty and prev is None:
            return self._advanced(got, ended)
        t1 = time.perf_counter()
        if not out.is_empty:
            handle, scored = self._dispatch(out, prev)
            t1 = time.perf_counter()
        if prev is not None:
            got += self._apply(prev)
        if not out.is_empty and scored:  # prompt logprobs: waited for now, before commit ends anyone
            self._record_prompt_scores(out, self.runner.prompt_scores(handle))
        if not out.is_empty:
            committed = self.scheduler.commit(out)  # after prev's tokens: commits read them
            pending, ended = committed.pending, committed.ended
            step = _InFlight(pending, handle)
            if not self.overlap:
                got += self._apply(step)
            elif pending:  # else nothing to wait for: every row's request has ended
                self._in_flight = step
        self.timings["schedule_s"] += t1 - t0
        self.timings["step_s"] += time.perf_counter() - t0
        self.counters["steps"] += int(not out.is_empty)
        self.counters["decode_tokens"] += out.num_decode_tokens
        self.counters["prefill_tokens_computed"] += out.num_prefill_tokens
        return self._advanced(got, ended)

    def _advanced(self, got: list[Sampled], ended: list[Request]) -> tuple[list[Request], list[Request]]:
        """(requests that got a token or ended, those that ended); ``ended``: prefill-only
        requests whose prompt this step computed (no token)."""
        advanced = [s.request for s in got] + ended
        finished = [r for r in advanced if r.status.is_finished]
        for request in finished:
            self.requests.pop(request.request_id, None)
        for request in ended:
            self.output.drop(request.request_id)
        return advanced, finished

    def _dispatch(self, out: SchedulerOutput, prev: _InFlight | None) -> tuple[Any, bool]:
        """Packs the scheduled rows and sends the step; a row whose token is pending is fed
        from the step before on the device. Returns (the runner's handle, whether the step
        scores prompt tokens)."""
        seqs, sampling = [], []
        rows = {id(p.request): p.row for p in prev.pending} if prev is not None else {}
        for request, n in out.scheduled:
            start = request.num_computed_tokens
            x = self._sampling(request)
            if request.num_pending:  # only a decode: its token is prev's sample
                x.history_feed = row = rows[id(request)]
                seqs.append(ScheduledSeq([0], start, request.pages, feed_row=row))
            else:
                seqs.append(ScheduledSeq(request.token_ids[start : start + n], start, request.pages))
            sampling.append(x)
        # Twins (Scheduler._fork): no tokens, the logits of their parent's last row.
        ends = itertools.accumulate(n for _, n in out.scheduled)
        last_row = {id(r): end - 1 for (r, _), end in zip(out.scheduled, ends, strict=True)}
        for twin, parent, _ in out.forks:
            seqs.append(ScheduledSeq([], parent.num_prompt_tokens, [], logits_of=last_row[id(parent)]))
            sampling.append(self._sampling(twin))
        # Structured output: the bitmask of each constrained row that samples this step (a
        # prefill chunk with prompt left does not); its grammar has every token so far, as
        # a step with one in flight is not overlapped (see step).
        samples = [(r, r.num_computed_tokens + n >= r.num_tokens) for r, n in out.scheduled]
        samples += [(twin, True) for twin, _, _ in out.forks]
        constrained = [
            (x, request.constraint)
            for x, (request, sampled) in zip(sampling, samples, strict=True)
            if request.constraint is not None and sampled
        ]
        if constrained:
            masks = self.grammars.fill([c for _, c in constrained])
            for (x, _), mask in zip(constrained, masks, strict=True):
                x.allowed = mask
        if out.page_copies:
            self.runner.copy_pages(out.page_copies)
        if any(r.scores_prompt for r, _ in out.scheduled):
            targets = [self._targets(r, n) for r, n in out.scheduled] + [[] for _ in out.forks]
            return self.runner.dispatch(seqs, sampling, targets), True
        return self.runner.dispatch(seqs, sampling), False

    @staticmethod
    def _targets(request: Request, n: int) -> list[int]:
        """The token after each of the request's rows this step, where it is a prompt token."""
        if not request.scores_prompt:
            return []
        start, prompt = request.num_computed_tokens, request.num_prompt_tokens
        return [request.token_ids[p + 1] if p + 1 < prompt else 0 for p in range(start, start + n)]

    def _record_prompt_scores(self, out: SchedulerOutput, scores) -> None:
        """Each scored prompt token's logprob (and top-n) into its request, by position
        (a recomputation after preemption writes the same values again)."""
        for (request, n), (target, top_ids, top_lp) in zip(out.scheduled, scores[: len(out.scheduled)], strict=True):
            if not request.scores_prompt:
                continue
            want, prompt, start = request.params.prompt_logprobs, request.num_prompt_tokens, request.num_computed_tokens
            for row, p in enumerate(range(start, start + n)):
                if request.score_from <= p + 1 < prompt:
                    request.prompt_logprobs[p + 1] = float(target[row])
                    if want:
                        request.prompt_top_logprobs[p + 1] = list(
                            zip(top_ids[row, :want].tolist(), top_lp[row, :want].tolist(), strict=True)
                        )

    def _apply(self, step: _InFlight) -> list[Sampled]:
        """Waits for a dispatched step's tokens and applies them: stop checks, logprobs, text."""
        result = self.runner.fetch(step.handle)
        t0 = time.perf_counter()
        got = self.scheduler.resolve(step.pending, result.tokens[[p.row for p in step.pending]].tolist())
        self.output.apply(got, result)
        self.timings["update_s"] += time.perf_counter() - t0
        return got

    def stats(self) -> dict[str, int]:
        return {
            **self.counters,
            **self.scheduler.kv.usage(self.scheduler.running),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_forks": self.scheduler.num_forks,  # requests that took a twin's prompt (n > 1 samples)
            "num_compiles": self.runner.num_compiles,  # compiled or loaded from the compile cache
            "num_compiles_loaded": compile_counter.num_cache_loads(),
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
        }
