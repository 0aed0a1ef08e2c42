"""Continuous batching with chunked prefill inside a per-step token budget (plain Python).

Every step:
  1. decodes first: each running request past its prefill gets one token;
  2. then prefill chunks: running requests still prefilling, then waiting ones, each
     taking ``min(tokens left, budget left)``, until ``max_num_batched_tokens`` or
     ``max_num_seqs`` is reached. Several chunks may share a step with the decodes.
Pages are allocated as tokens are scheduled and freed whole when a request ends. When
pages run out, unreferenced cached prefixes are evicted first; then the most recently
admitted running request is preempted (its pages freed; it recomputes later, reusing
what the prefix cache still holds) instead of failing.

Admission order: ``fcfs``, or ``lpm`` (longest cached prefix first) with an aging bound:
a request that has waited ``lpm_aging_steps`` steps goes first, so cache-cold requests
are never starved by a stream of cache-hot ones.

Fairness between clients (``Request.client``; one client offline, so nothing changes
there): admission takes the next request from the client running the fewest, and when
every slot is taken while a client runs fewer than its share (``max_num_seqs`` / clients
with work), the newest request of the client holding the most slots is preempted, one per
step. Its computed tokens go to the prefix cache first, so it resumes cheaply. Without
this, one client's long streams hold every slot until they end and a short request from
anyone else waits for all of them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque

from jaxserve.engine.page_pool import PagePool
from jaxserve.engine.prefix_cache import PrefixCache
from jaxserve.engine.request import Request, RequestStatus

SCHEDULE_POLICIES = ("fcfs", "lpm")


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]  # (request, num_scheduled_tokens), batch order
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    preempted: list[Request] = dataclasses.field(default_factory=list)
    page_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst), before the step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _common_prefix(a: list[int], b: list[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        static_batching: bool = False,
        prefix_cache: PrefixCache | None = None,
        schedule_policy: str = "fcfs",
        lpm_aging_steps: int = 64,
    ):
        """``static_batching`` (for comparison only): a batch of up to ``max_num_seqs``
        requests is admitted, and no other joins until every one of them has finished."""
        if schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy {schedule_policy!r} is not one of: {', '.join(SCHEDULE_POLICIES)}")
        self.pool = pool
        self.cache = prefix_cache
        self.schedule_policy = schedule_policy
        self.lpm_aging_steps = lpm_aging_steps
        self.static_batching = static_batching
        self._batch_slots_left = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the preemption victim
        self.num_preemptions = 0
        self.num_steps = 0

    # -- requests in and out ---------------------------------------------------------
    def add(self, request: Request) -> None:
        request.arrival = self.num_steps
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        if request.status.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a running request (e.g. a stop string matched) and frees its pages."""
        if request in self.running:
            self.running.remove(request)
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if self.cache is not None:
            if status is not RequestStatus.FINISHED_ABORTED:
                self.cache.publish(request)  # prompt + output so far: the next turn reuses it
            self.cache.detach(request)
        request.status = status
        self.pool.release(request.pages)
        request.pages = []

    def _grow(self, request: Request, num_new_tokens: int) -> bool:
        """Makes the request's pages cover ``num_computed + num_new_tokens`` tokens,
        evicting unreferenced cached prefixes if the pool is short."""
        need = self.pool.pages_needed(request.num_computed_tokens + num_new_tokens) - len(request.pages)
        if need <= 0:
            return True
        if need > self.pool.num_free and self.cache is not None:
            self.cache.evict(need)
        if need > self.pool.num_free:
            return False
        request.pages += self.pool.allocate(need)
        return True

    def _preempt(self, request: Request, keep_cached: bool = False) -> None:
        self.running.remove(request)
        if self.cache is not None:
            if keep_cached:  # its computed K/V stay reusable: resuming is a cache hit
                self.cache.publish(request)
            self.cache.detach(request)
        self.pool.release(request.pages)
        request.pages = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _reserve(self, request: Request, num_new_tokens: int, out: SchedulerOutput) -> bool:
        """Pages for ``num_new_tokens`` more tokens, preempting the newest running requests
        (undoing their share of this step) until they fit. False if ``request`` itself went."""
        while not self._grow(request, num_new_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            for i, (r, n) in enumerate(out.scheduled):
                if r is victim:
                    del out.scheduled[i]
                    if n == 1 and victim.output_token_ids:
                        out.num_decode_tokens -= 1
                    else:
                        out.num_prefill_tokens -= n
                    break
            if victim is request:
                return False
        return True

    # -- admission -------------------------------------------------------------------
    def _admission_order(self) -> list[Request]:
        if self.schedule_policy == "fcfs" or self.cache is None:
            order = list(self.waiting)
        else:
            aged = [r for r in self.waiting if self.num_steps - r.arrival >= self.lpm_aging_steps]
            fresh = [r for r in self.waiting if self.num_steps - r.arrival < self.lpm_aging_steps]
            fresh.sort(key=lambda r: -self.cache.match_length(r))  # stable: FCFS among equals
            order = aged + fresh
        return self._interleave_clients(order)

    def _interleave_clients(self, order: list[Request]) -> list[Request]:
        """``order`` with each next pick from the client that would then run the fewest
        (ties: the earlier in ``order``); one client keeps ``order`` as it is."""
        queues: dict[str, deque[Request]] = {}
        for r in order:
            queues.setdefault(r.client, deque()).append(r)
        if len(queues) < 2:
            return order
        load = Counter(r.client for r in self.running)
        rank = {id(r): i for i, r in enumerate(order)}
        out = []
        while queues:
            client = min(queues, key=lambda c: (load[c], rank[id(queues[c][0])]))
            out.append(queues[client].popleft())
            load[client] += 1
            if not queues[client]:
                del queues[client]
        return out

    def _reclaim_slot(self, out: SchedulerOutput) -> None:
        """Every slot is taken and a waiting client runs fewer than its share: preempts the
        newest request of the client running the most (one per step)."""
        if self.static_batching or len(self.running) < self.max_num_seqs or not self.waiting:
            return
        load = Counter(r.client for r in self.running)
        clients = set(load) | {r.client for r in self.waiting}
        if len(clients) < 2:
            return
        share = max(1, self.max_num_seqs // len(clients))
        if all(load[r.client] >= share for r in self.waiting):
            return
        greedy_client, held = load.most_common(1)[0]
        if held <= share:
            return
        victim = next(r for r in reversed(self.running) if r.client == greedy_client)
        self._preempt(victim, keep_cached=True)
        out.preempted.append(victim)

    def _shares_uncached_prefix(self, request: Request) -> bool:
        """True if a running request is still prefilling a prefix this one shares beyond
        what is cached: admitting it now would compute that prefix twice."""
        prefilling = [r for r in self.running if not r.is_prefill_done]
        if self.cache is None or not prefilling:
            return False  # skip the radix match: nothing to wait for
        tokens = request.all_token_ids
        shared = max(_common_prefix(tokens, other.prompt_token_ids) for other in prefilling)
        return shared - self.cache.match_length(request) >= self.pool.page_size

    def _admit(self, request: Request, out: SchedulerOutput, budget: int) -> bool:
        """Moves a waiting request into the batch with a first chunk; False if it cannot."""
        if request.num_computed_tokens == 0 and self.cache is not None:
            copy = self.cache.attach(request)
        else:
            copy = None
        n = min(request.num_tokens_to_compute, budget)
        if not self._grow(request, n):
            if self.cache is not None:  # undo the attach: try again later
                self.cache.unattach(request)
            self.pool.release(request.pages)
            request.pages = []
            request.num_computed_tokens = 0
            return False
        if copy is not None:
            out.page_copies.append(copy)
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append((request, n))
        out.num_prefill_tokens += n
        return True

    # -- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(scheduled=[])
        self.num_steps += 1

        def budget() -> int:
            return self.max_num_batched_tokens - out.num_decode_tokens - out.num_prefill_tokens

        self._reclaim_slot(out)

        # 1. Decodes, oldest first; preempt the newest when a page is missing.
        for request in list(self.running):
            if request not in self.running or not request.is_prefill_done or budget() == 0:
                continue
            if self._reserve(request, 1, out):
                out.scheduled.append((request, 1))
                out.num_decode_tokens += 1

        # 2. Prefill chunks of running requests, then admit waiting ones.
        scheduled = {id(r) for r, _ in out.scheduled}
        for request in list(self.running):
            if budget() == 0:
                break
            if request not in self.running or id(request) in scheduled or request.is_prefill_done:
                continue
            n = min(request.num_tokens_to_compute, budget())
            if self._reserve(request, n, out):
                out.scheduled.append((request, n))
                out.num_prefill_tokens += n
        if self.static_batching and not self.running:
            self._batch_slots_left = self.max_num_seqs  # the previous batch is done: open a new one
        for request in self._admission_order():
            if budget() == 0 or len(self.running) >= self.max_num_seqs:
                break
            is_new = request.status is RequestStatus.WAITING
            if self.static_batching and is_new and self._batch_slots_left == 0:
                break
            if self._shares_uncached_prefix(request):
                continue  # wait for the running request to cache the shared prefix
            if not self._admit(request, out, budget()):
                break
            if is_new:
                self._batch_slots_left -= 1
        return out

    def update(self, out: SchedulerOutput, tokens: list[int], logprobs: list[float]) -> list[Request]:
        """Applies one step's sampled tokens; returns the requests that finished."""
        finished = []
        for (request, n), token, logprob in zip(out.scheduled, tokens, logprobs, strict=True):
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += n
            if request.num_tokens_to_compute > 0:
                if self.cache is not None:
                    self.cache.publish(request)  # a prefill chunk: cache what is computed so far
                continue  # its sample is not a token
            if self.cache is not None and n > 1:
                self.cache.publish(request)
            request.output_token_ids.append(token)
            request.output_logprobs.append(logprob)
            status = self._stop_status(request, token)
            if status is not None:
                if status is RequestStatus.FINISHED_STOPPED:
                    request.stop_reason = token
                self.running.remove(request)
                self._finish(request, status)
                finished.append(request)
        return finished

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        generated = len(request.output_token_ids)
        if token in request.stop_token_ids and generated > params.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if generated >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def check_integrity(self) -> None:
        """Pool, tree and requests agree: every page reference is accounted for."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        if self.cache is not None:
            self.cache.index.check_integrity()
            refs = self.cache.index.page_refs()
        for r in self.running:
            for p in r.pages:
                refs[p] = refs.get(p, 0) + 1
        assert all(not r.pages for r in self.waiting), "a waiting request holds pages"
        for p in range(1, self.pool.num_pages):
            assert self.pool.refcounts[p] == refs.get(p, 0), (
                f"page {p}: refcount {self.pool.refcounts[p]} != {refs.get(p, 0)} users"
            )
        assert len(self.running) <= self.max_num_seqs
