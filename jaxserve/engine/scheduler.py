"""Continuous batching with chunked prefill inside a per-step token budget (plain Python).

Every step:
  1. decodes first: each running request past its prefill gets one token;
  2. then prefill chunks: running requests still prefilling, then waiting ones, each
     taking ``min(tokens left, budget left)``, until ``max_num_batched_tokens`` or
     ``max_num_seqs`` is reached. Several chunks may share a step with the decodes. A
     step that decodes has the smaller budget ``max_mixed_batched_tokens`` when set: its
     length is an inter-token gap of every running stream (Sarathi-Serve's token budget),
     while a step with nothing to decode (a lone prompt) still takes the whole budget.
     A long prompt's chunk (more uncached tokens than ``max_num_batched_tokens``) keeps
     such a step within ``max_long_mixed_batched_tokens``, smaller still: it makes many
     such steps in a row, each dearer than the last as its attention deepens, while a
     short prompt's first token is a chunk or two away (vLLM's long_prefill_token_threshold
     likewise caps a long prompt's chunks).
Pages come from the KV manager (``kv_manager.py``), the only code that touches them: as
tokens are scheduled, and back whole when a request ends. When pages run out, it evicts
unreferenced cached prefixes first; then the most recently admitted running request is
preempted (its pages freed; it recomputes later, reusing what the prefix cache still
holds) instead of failing.

A step's results come back in two halves. ``commit`` (right after the step is sent to
the device) records its tokens as computed and gives each row that samples a pending
token (``Request.num_pending``). ``resolve`` (once the sampled ids are on the host)
turns those into tokens and says what happened: per request, the token it got and
whether that ended it (a stop token, a length limit). ``update`` is both at once, the
serial loop. Between the two halves the next step may be scheduled (overlap scheduling,
``engine.py``): a decode then runs on its pending token, which the device feeds from the
step before; a request that the pending token will end by length is not scheduled, one
that it ends by a stop token wastes one row. Text is not the scheduler's business: the
output stage reports a matched stop string back through ``stop``.

Twins: a waiting request whose prompt is the very prompt a request finishes in this step
(the samples of ``n`` > 1, identical requests) is forked from it instead of admitted: no
tokens of its own, its first token sampled from the same logits row (which batch
invariance makes the row it would have computed itself), the whole prompt pages shared
and the last, partly filled one copied before the next step. So ``n`` samples of a
500-token prompt compute 500 tokens, not 500 + n - 1.

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
import logging
from collections import Counter, deque

from jaxserve.engine.kv_manager import KVManager, PageCopy
from jaxserve.engine.radix_index import common_prefix
from jaxserve.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def _finishes_prompt(request: Request, n: int) -> bool:
    """Whether ``n`` tokens scheduled this step end the request's prompt (no token sampled yet)."""
    return request.num_sampled == 0 and request.num_computed_tokens + n == request.num_prompt_tokens


SCHEDULE_POLICIES = ("fcfs", "lpm")


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]  # (request, num_scheduled_tokens), batch order
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    preempted: list[Request] = dataclasses.field(default_factory=list)
    page_copies: list[PageCopy] = dataclasses.field(default_factory=list)  # before the step
    # Twins: (waiting request, the scheduled request finishing the same prompt, page for
    # its copy of the last page or 0). Rows after ``scheduled``'s: no tokens, the parent's
    # last row's logits, their own sampling.
    forks: list[tuple[Request, Request, int]] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_rows(self) -> int:
        """Rows the step samples: the scheduled sequences', then the twins'."""
        return len(self.scheduled) + len(self.forks)


@dataclasses.dataclass(frozen=True)
class Sampled:
    """A token a step gave a request (a prefill chunk that leaves prompt to compute gets none)."""

    request: Request
    row: int  # the request's row in the step: where the sampler's other outputs for it are
    token: int
    finished: bool  # the token ended it (a stop token, max_tokens or max_model_len)


@dataclasses.dataclass(frozen=True)
class Pending:
    """A row of a committed step that will sample a request's next token."""

    request: Request
    row: int


@dataclasses.dataclass
class Committed:
    pending: list[Pending]  # the rows that will sample a token
    ended: list[Request]  # prefill-only requests (max_tokens 0) whose prompt is now computed


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        schedule_policy: str = "fcfs",
        lpm_aging_steps: int = 64,
        min_token_bucket: int = 1,
        max_mixed_batched_tokens: int | None = None,
        max_long_mixed_batched_tokens: int | None = None,
    ):
        """``min_token_bucket``: the runner's smallest token bucket. A step's sequences
        (twins included) never outnumber its tokens padded to it: the shapes compiled.
        ``max_mixed_batched_tokens``: the budget of a step that decodes (None: the same);
        at least ``max_num_seqs``, so a prefill always has room beside the decodes.
        ``max_long_mixed_batched_tokens``: likewise, where a long prompt's chunk is in it."""
        if schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy {schedule_policy!r} is not one of: {', '.join(SCHEDULE_POLICIES)}")
        self.kv = kv
        self.schedule_policy = schedule_policy
        self.lpm_aging_steps = lpm_aging_steps
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_mixed_batched_tokens = max_mixed_batched_tokens or max_num_batched_tokens
        self.max_long_mixed_batched_tokens = max_long_mixed_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.min_token_bucket = min_token_bucket
        self.waiting: deque[Request] = deque()
        # How many waiting requests each client has: per step the scheduler asks which
        # clients wait, and a walk of the queue cost ~1 us a request (a 10,000-prompt
        # offline batch: ~10 ms a step).
        self._waiting_clients: Counter[str] = Counter()
        self.running: list[Request] = []  # in admission order: the last is the preemption victim
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_forks = 0
        self._fork_copies: list[PageCopy] = []  # twins' last-page copies, for the next step

    # -- requests in and out ---------------------------------------------------------
    def add(self, request: Request) -> None:
        request.arrival = self.num_steps
        self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(request)
        self._waiting_clients[request.client] += 1

    def _dequeue(self, request: Request) -> None:
        self.waiting.remove(request)
        self._waiting_clients[request.client] -= 1
        if not self._waiting_clients[request.client]:
            del self._waiting_clients[request.client]

    def abort(self, request: Request) -> None:
        if not request.status.is_finished:
            self._end(request, RequestStatus.FINISHED_ABORTED)

    def stop(self, request: Request, stop_string: str) -> None:
        """The output stage matched a stop string in the text of the request's newest
        token: it ends as stopped, also when that token had ended it otherwise."""
        request.stop_reason = stop_string
        if request.status.is_finished:
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self._end(request, RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _end(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self._dequeue(request)
        # prompt + output so far go to the prefix cache: the next turn of a chat reuses them
        finished = status is not RequestStatus.FINISHED_ABORTED
        self.kv.free(request, keep_cached=finished, pin_s=request.pin_s if finished else None)
        request.status = status

    def _preempt(self, request: Request, keep_cached: bool = False) -> None:
        """``keep_cached``: its computed K/V stay reusable, so resuming is a cache hit."""
        self.running.remove(request)
        self.kv.free(request, keep_cached)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

    def _reserve(self, request: Request, num_new_tokens: int, out: SchedulerOutput) -> bool:
        """Pages for ``num_new_tokens`` more tokens, preempting the newest running requests
        (undoing their share of this step) until they fit. False if ``request`` itself went."""
        while not self.kv.grow(request, num_new_tokens):
            victim = self.running[-1]
            if victim is request and request.cache_node is not None:
                # Before it preempts itself: its own lock may be what holds the pages it
                # needs (a prefix cached twice, its path holding both copies). Preempted, it
                # would come back to the same lock, and round again forever.
                self.kv.unlock_path(request)
                continue
            self._preempt(victim)
            out.preempted.append(victim)
            for i, (r, n) in enumerate(out.scheduled):
                if r is victim:
                    del out.scheduled[i]
                    if n == 1 and victim.num_sampled:
                        out.num_decode_tokens -= 1
                    else:
                        out.num_prefill_tokens -= n
                    break
            if victim is request:
                return False
        return True

    # -- admission -------------------------------------------------------------------
    def _admission_order(self) -> list[Request]:
        if self.schedule_policy == "fcfs" or not self.kv.prefix_caching:
            order = list(self.waiting)
        else:
            aged = [r for r in self.waiting if self.num_steps - r.arrival >= self.lpm_aging_steps]
            fresh = [r for r in self.waiting if self.num_steps - r.arrival < self.lpm_aging_steps]
            fresh.sort(key=lambda r: -self.kv.cached_length(r))  # stable: FCFS among equals
            order = aged + fresh
        return self._interleave_clients(order)

    def _interleave_clients(self, order: list[Request]) -> list[Request]:
        """``order`` with each next pick from the client that would then run the fewest
        (ties: the earlier in ``order``); one client keeps ``order`` as it is."""
        if len(self._waiting_clients) < 2:  # (order is the waiting queue)
            return order
        queues: dict[str, deque[Request]] = {}
        for r in order:
            queues.setdefault(r.client, deque()).append(r)
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
        if len(self.running) < self.max_num_seqs or not self.waiting:
            return
        load = Counter(r.client for r in self.running)
        clients = set(load) | set(self._waiting_clients)
        if len(clients) < 2:
            return
        share = max(1, self.max_num_seqs // len(clients))
        if all(load[c] >= share for c in self._waiting_clients):
            return
        greedy_client, held = load.most_common(1)[0]
        if held <= share:
            return
        victim = next(r for r in reversed(self.running) if r.client == greedy_client)
        self._preempt(victim, keep_cached=True)
        out.preempted.append(victim)

    def _shares_uncached_prefix(self, request: Request, prefilling: list[Request]) -> bool:
        """True if a running request (of ``prefilling``, those still prefilling) is computing
        a prefix this one shares beyond what is cached: admitting it now would compute that
        prefix twice."""
        if not prefilling:
            return False  # skip the radix match: nothing to wait for
        tokens = request.token_ids
        shared = max(
            common_prefix(tokens, other.token_ids, min(len(tokens), other.num_prompt_tokens)) for other in prefilling
        )
        return shared - self.kv.cached_length(request) >= self.kv.page_size

    def _long_budget(self, request: Request, cached: int | None = None) -> int | None:
        """``max_long_mixed_batched_tokens`` if ``request``'s prompt is long: more uncached
        tokens (``cached``: of its prompt, asked of the prefix cache if None) than a whole
        step's budget; else None."""
        long = self.max_long_mixed_batched_tokens
        if long is None or request.num_prompt_tokens <= self.max_num_batched_tokens:
            return None
        if cached is None:
            cached = self.kv.cached_length(request)
        return long if request.num_prompt_tokens - cached > self.max_num_batched_tokens else None

    def _admit(self, request: Request, out: SchedulerOutput, budget: int) -> bool:
        """Moves a waiting request into the batch with a first chunk; False if it cannot."""
        admitted = self.kv.admit(request, budget)
        if admitted is None and not self.running:
            # Nothing running will free a page, and the match's lock keeps its pages: a
            # cached prefix ending inside a page the pool has no room to copy stayed locked
            # by every retry (1 usable page, n = 2: the twin waited forever). Computed anew,
            # the prefix's pages can be evicted.
            admitted = self.kv.admit(request, budget, reuse=False)
        if admitted is None:
            return False  # nothing changed: it tries again in a later step
        n, copy = admitted
        if copy is not None:
            out.page_copies.append(copy)
        self._dequeue(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append((request, n))
        out.num_prefill_tokens += n
        return True

    def _fork(self, twin: Request, out: SchedulerOutput, finishing: dict[int, list[Request]]) -> bool:
        """Forks ``twin`` from a request whose prompt this step finishes (``finishing``, by
        prompt length), if one has the same prompt: it then computes none of it (its first
        token is sampled from that row's logits, which batch invariance makes the ones it
        would compute itself)."""
        if (
            twin.num_prompt_tokens not in finishing
            or twin.num_pending
            or twin.num_tokens != twin.num_prompt_tokens  # preempted with output: not a twin
            or twin.params.prompt_logprobs is not None
            or twin.params.max_tokens == 0
            or not self._room_to_fork(out)
        ):
            return False
        for parent in finishing[twin.num_prompt_tokens]:
            if parent.token_ids == twin.token_ids:
                page = self.kv.reserve_fork(parent)
                if page is None:
                    return False
                out.forks.append((twin, parent, page))
                return True
        return False

    def _room_to_fork(self, out: SchedulerOutput) -> bool:
        return (
            len(self.running) + len(out.forks) < self.max_num_seqs
            # a step never has more sequences than its padded tokens (the compiled bucket pairs)
            and len(out.scheduled) + len(out.forks)
            < max(out.num_decode_tokens + out.num_prefill_tokens, self.min_token_bucket)
        )

    # -- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(scheduled=[], page_copies=self._fork_copies)
        self._fork_copies = []
        self.num_steps += 1
        if self.kv.leases:
            self.kv.expire_leases()

        def budget(long: int | None = None) -> int:
            """Tokens left in the step; ``long``: a long prompt's budget (_long_budget) for its chunk."""
            if not out.num_decode_tokens:
                limit = self.max_num_batched_tokens
            else:
                limit = min(self.max_mixed_batched_tokens, long) if long else self.max_mixed_batched_tokens
            return max(0, limit - out.num_decode_tokens - out.num_prefill_tokens)

        self._reclaim_slot(out)

        # 1. Decodes, oldest first; preempt the newest when a page is missing. (A request
        # preempted meanwhile is no longer RUNNING: asking the list was O(running) each.)
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or not request.is_prefill_done or budget() == 0:
                continue
            if request.num_pending and self._ends_by_length(request):
                continue  # the token in flight is its last
            if self._reserve(request, 1, out):
                out.scheduled.append((request, 1))
                out.num_decode_tokens += 1

        # 2. Prefill chunks of running requests, then admit waiting ones.
        scheduled = {id(r) for r, _ in out.scheduled}
        for request in list(self.running):
            if budget() == 0:
                break
            if request.status is not RequestStatus.RUNNING or id(request) in scheduled or request.is_prefill_done:
                continue
            n = min(request.num_tokens_to_compute, budget(self._long_budget(request, request.num_cached_tokens)))
            if n and self._reserve(request, n, out):
                out.scheduled.append((request, n))
                out.num_prefill_tokens += n
        # The requests whose prompt this step finishes, by prompt length: a twin's possible
        # parents. Not the decodes (scheduled first; they have sampled), so a waiting
        # request looks at a few rows, not at every row of a 256-sequence step.
        finishing: dict[int, list[Request]] = {}
        for request, n in out.scheduled[out.num_decode_tokens :]:
            if _finishes_prompt(request, n):
                finishing.setdefault(request.num_prompt_tokens, []).append(request)
        # Kept as admissions add to it, not gathered for each waiting request: O(running) each.
        prefilling = [r for r in self.running if not r.is_prefill_done] if self.kv.prefix_caching else []
        order, forked = self._admission_order(), set()
        for request in order:
            if self._fork(request, out, finishing):
                forked.add(id(request))
                continue
            if budget() == 0 or len(self.running) + len(out.forks) >= self.max_num_seqs:
                break
            if request.num_pending:
                continue  # preempted with a token in flight: admitted once it is known
            if self._shares_uncached_prefix(request, prefilling):
                continue  # wait for the running request to cache the shared prefix
            # (the prefix cache is asked how much of a long prompt it holds only beside decodes)
            n = budget(self._long_budget(request)) if out.num_decode_tokens else budget()
            if not n:
                break  # a long prompt with no room left beside the decodes: first in line next step
            if not self._admit(request, out, n):
                break
            admitted, n = out.scheduled[-1]
            if self.kv.prefix_caching and not admitted.is_prefill_done:
                prefilling.append(admitted)
            if _finishes_prompt(admitted, n):
                finishing.setdefault(admitted.num_prompt_tokens, []).append(admitted)
        # 3. Twins of the prompts this step finishes (n > 1 samples, identical requests),
        # also past where admission stopped: they take no budget. Only a waiting request
        # as long as such a prompt can be one, and none once the step is full (a walk of
        # the whole queue every step cost ~1 us a request).
        for request in order if finishing else ():
            if not self._room_to_fork(out):
                break
            if (
                request.num_prompt_tokens in finishing
                and id(request) not in forked
                and request.status is not RequestStatus.RUNNING  # not admitted above
            ):
                self._fork(request, out, finishing)
        return out

    def update(self, out: SchedulerOutput, tokens: list[int]) -> list[Sampled]:
        """Applies one step's sampled tokens (one per scheduled row); returns who got one."""
        pending = self.commit(out).pending
        return self.resolve(pending, [tokens[p.row] for p in pending])

    def commit(self, out: SchedulerOutput) -> Committed:
        """The step's tokens are computed (it is on the device); returns the rows that
        sample a token (each such request gets a pending token until ``resolve``) and the
        prefill-only requests (``max_tokens`` 0) whose prompt is now computed: they end
        here, FINISHED_LENGTH, their prompt's K/V in the prefix cache."""
        pending, ended = [], []
        twins: dict[int, list[tuple[int, Request, int]]] = {}
        for j, (twin, parent, page) in enumerate(out.forks):
            twins.setdefault(id(parent), []).append((len(out.scheduled) + j, twin, page))
        for row, (request, n) in enumerate(out.scheduled):
            if request.status is not RequestStatus.RUNNING:
                for _, _, page in twins.pop(id(request), ()):
                    self.kv.unreserve(page)  # its twins stay waiting: admitted as usual later
                continue  # ended (aborted, or by the step before) since it was scheduled
            assert not request.num_pending, "commit of a request whose last token is unresolved"
            self.kv.commit(request, n)
            for twin_row, twin, page in twins.pop(id(request), ()):
                if twin.status.is_finished:
                    self.kv.unreserve(page)
                    continue
                copy = self.kv.fork(twin, request, page)
                if copy is not None:
                    self._fork_copies.append(copy)
                self._dequeue(twin)
                twin.status = RequestStatus.RUNNING
                self.running.append(twin)
                twin.num_pending = 1
                pending.append(Pending(twin, twin_row))
                self.num_forks += 1
            if request.num_tokens_to_compute > 0:
                continue  # a prefill chunk with prompt left: its sample is not a token
            if request.params.max_tokens == 0:
                self._end(request, RequestStatus.FINISHED_LENGTH)
                ended.append(request)
                continue
            request.num_pending = 1
            pending.append(Pending(request, row))
        return Committed(pending, ended)

    def resolve(self, pending: list[Pending], tokens: list[int]) -> list[Sampled]:
        """The sampled ids of ``commit``'s rows, in order: appends each, applies stop checks."""
        got = []
        for p, token in zip(pending, tokens, strict=True):
            request = p.request
            if request.status.is_finished:
                continue  # aborted (or stopped by text) while the step ran
            request.num_pending = 0
            request.token_ids.append(token)
            status = self._stop_status(request, token)
            if status is not None:
                if status is RequestStatus.FINISHED_STOPPED and token in request.stop_token_ids:
                    request.stop_reason = token  # (a completed grammar's last token is output, no reason)
                self._end(request, status)
            got.append(Sampled(request, p.row, token, status is not None))
        return got

    def _ends_by_length(self, request: Request) -> bool:
        return request.num_sampled >= request.params.max_tokens or request.num_tokens >= self.max_model_len

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        if request.constraint is not None and request.constraint.error:
            # The grammar failed computing this token's mask (llguidance's lexer limits),
            # which then allowed only EOS: the output does not satisfy it, so not "stop".
            logger.warning(
                "request %s: its structured-output constraint failed after %d tokens, ended as abort: %s",
                request.request_id,
                request.num_output_tokens,
                request.constraint.error.split("\n", 1)[0],
            )
            return RequestStatus.FINISHED_ABORTED
        if token in request.stop_token_ids and request.num_output_tokens > request.params.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if request.constraint is not None:
            request.constraint.advance(token)
            if request.constraint.done:  # the grammar is complete: nothing more may follow
                return RequestStatus.FINISHED_STOPPED
        if self._ends_by_length(request):
            return RequestStatus.FINISHED_LENGTH
        return None

    def check_integrity(self) -> None:
        """Pages, tree and requests agree; queues within their limits."""
        self.kv.check_integrity(self.running)
        assert all(not r.pages and r.num_computed_tokens == 0 for r in self.waiting), "a waiting request holds pages"
        assert self._waiting_clients == Counter(r.client for r in self.waiting), "waiting clients miscounted"
        assert len(self.running) <= self.max_num_seqs
