"""The scheduler with a scripted fake runner: plain Python, milliseconds per test."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams
from tests.conftest import tight_pool


def _request(i: int, prompt_len: int, max_tokens: int) -> Request:
    """Prompts differ in their first token: identical ones would be forked (see the fork tests)."""
    prompt = [100 + i] + [7] * (prompt_len - 1)
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), seed=i)


def _run(sched: Scheduler, steps_limit: int = 10_000) -> list:
    """Drives the scheduler with a fake runner that always samples token 1."""
    records = []
    for _ in range(steps_limit):
        if not sched.has_unfinished():
            return records
        out = sched.schedule()
        sched.check_integrity()
        assert out.scheduled, "no progress"
        assert sum(n for _, n in out.scheduled) <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        for r, n in out.scheduled:
            assert len(r.pages) * sched.kv.pool.page_size >= r.num_computed_tokens + n
        records.append([(r.request_id, n, r.is_prefill_done) for r, n in out.scheduled])
        sched.update(out, [1] * out.num_rows)
        sched.check_integrity()
    raise AssertionError("did not finish")


def test_scheduler_modules_import_no_jax():
    code = (
        "import sys; import jaxserve.engine.scheduler, jaxserve.engine.kv_manager, jaxserve.engine.output; "
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_decodes_first_then_chunks_within_budget():
    sched = Scheduler(
        KVManager(100, 4, prefix_caching=False), max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64
    )
    a, b = _request(0, 3, 5), _request(1, 20, 2)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert [(r.request_id, n) for r, n in first.scheduled] == [("r0", 3), ("r1", 5)]
    sched.update(first, [1, 1])
    assert a.output_token_ids == [1] and b.output_token_ids == []  # b's chunk was partial
    second = sched.schedule()
    assert [(r.request_id, n) for r, n in second.scheduled] == [("r0", 1), ("r1", 7)]
    assert second.num_decode_tokens == 1 and second.num_prefill_tokens == 7


def test_every_request_finishes_and_pages_return():
    rng = random.Random(0)
    sched = Scheduler(
        KVManager(400, 4, prefix_caching=False), max_num_batched_tokens=16, max_num_seqs=5, max_model_len=128
    )
    reqs = [_request(i, rng.randint(1, 60), rng.randint(1, 20)) for i in range(30)]
    for r in reqs:
        sched.add(r)
    _run(sched)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert [len(r.output_token_ids) for r in reqs] == [r.params.max_tokens for r in reqs]
    assert sched.kv.pool.num_in_use == 0


def test_long_prompt_is_chunked_while_decodes_continue():
    sched = Scheduler(
        KVManager(400, 4, prefix_caching=False), max_num_batched_tokens=16, max_num_seqs=8, max_model_len=256
    )
    decoders = [_request(i, 4, 100) for i in range(3)]
    for r in decoders:
        sched.add(r)
    for _ in range(2):  # get them decoding
        out = sched.schedule()
        sched.update(out, [1] * out.num_rows)
    long = _request(9, 200, 1)
    sched.add(long)
    steps_with_long = 0
    while long.status is not RequestStatus.FINISHED_LENGTH:
        out = sched.schedule()
        ids = {r.request_id: n for r, n in out.scheduled}
        if "r9" in ids:
            steps_with_long += 1
            assert all(ids.get(r.request_id) == 1 for r in decoders), "a decode stalled behind the prefill"
        sched.update(out, [1] * out.num_rows)
    assert steps_with_long >= 200 // 13  # at most 16 - 3 prefill tokens per step


def test_a_step_that_decodes_takes_the_mixed_budget_a_lone_prompt_the_whole():
    sched = Scheduler(
        KVManager(400, 4, prefix_caching=False),
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=256,
        max_mixed_batched_tokens=12,
    )
    first = _request(0, 40, 50)
    sched.add(first)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 32)]  # nothing decodes: all 32
    sched.update(out, [1] * out.num_rows)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 8)]  # the prompt's rest
    sched.update(out, [1] * out.num_rows)
    second, third = _request(1, 30, 5), _request(2, 30, 5)
    sched.add(second)
    sched.add(third)
    sizes = []
    while second.status is RequestStatus.WAITING or not third.is_prefill_done:
        out = sched.schedule()
        sched.check_integrity()
        assert out.num_decode_tokens >= 1  # r0 decodes in every one of these steps
        sizes.append(out.num_decode_tokens + out.num_prefill_tokens)
        sched.update(out, [1] * out.num_rows)
    # 60 prompt tokens beside one decode (r0), then two (r1 too), 12 tokens a step:
    # 11 + 11 + (8 + 3) prompt tokens, then 10 + 10 + the last 7
    assert sizes == [12, 12, 12, 12, 12, 9]


def test_a_long_prompts_chunks_keep_a_step_that_decodes_within_the_long_budget():
    """A prompt with more uncached tokens than a whole step (32) gets chunks that keep a step
    that decodes within max_long_mixed_batched_tokens (8); a short prompt beside it still
    fills the mixed budget (16), and so does a long prompt whose prefix is cached; with
    nothing to decode a long prompt takes the whole step."""
    sched = Scheduler(
        KVManager(400, 4, prefix_caching=True),
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=256,
        max_mixed_batched_tokens=16,
        max_long_mixed_batched_tokens=8,
    )

    decodes = []

    def step() -> list[tuple[str, int]]:
        out = sched.schedule()
        sched.update(out, [1] * out.num_rows)
        sched.check_integrity()
        decodes.append(out.num_decode_tokens)
        return [(r.request_id, n) for r, n in out.scheduled]

    alone = _request(9, 40, 1)
    sched.add(alone)
    assert step() == [("r9", 32)]  # long (40 > 32) but nothing decodes: the whole step
    assert step() == [("r9", 8)]
    assert alone.status.is_finished
    streamer = _request(0, 10, 100)
    sched.add(streamer)
    assert step() == [("r0", 10)]
    long = _request(1, 100, 2)
    sched.add(long)
    assert step() == [("r0", 1), ("r1", 7)]  # 8 in all beside the decode
    short = _request(2, 20, 2)
    sched.add(short)
    assert step() == [("r0", 1), ("r1", 7), ("r2", 8)]  # the short one fills the mixed 16
    assert step() == [("r0", 1), ("r1", 7), ("r2", 8)]
    while not long.is_prefill_done:
        scheduled = dict(step())
        assert decodes[-1] + scheduled["r1"] <= 8, scheduled
    while not long.status.is_finished:
        step()
    # The same 96 tokens, then 14 of its own: 14 uncached, not long.
    cached = Request("r3", long.token_ids[:96] + [9] * 14, SamplingParams(max_tokens=2, temperature=0.0), seed=3)
    sched.add(cached)
    assert step() == [("r0", 1), ("r3", 14)]


def test_preemption_when_pages_run_out():
    # 12 usable pages of 4 tokens; each request may need up to ceil((10+30)/4) = 10 pages.
    sched = Scheduler(
        KVManager(13, 4, prefix_caching=False), max_num_batched_tokens=32, max_num_seqs=4, max_model_len=40
    )
    reqs = [_request(i, 10, 30) for i in range(4)]
    for r in reqs:
        sched.add(r)
    _run(sched)
    assert sched.num_preemptions > 0
    assert all(len(r.output_token_ids) == 30 for r in reqs)
    assert sched.kv.pool.num_in_use == 0


def test_abort_frees_pages():
    sched = Scheduler(
        KVManager(50, 4, prefix_caching=False), max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64
    )
    a, b = _request(0, 10, 50), _request(1, 10, 50)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update(out, [1, 1])
    sched.abort(a)
    sched.abort(b)
    assert a.status is RequestStatus.FINISHED_ABORTED and sched.kv.pool.num_in_use == 0
    assert not sched.has_unfinished()
    sched.check_integrity()


def test_two_long_prompts_in_a_pool_that_fits_one_at_a_time():
    sched = Scheduler(
        KVManager(21, 4, prefix_caching=False), max_num_batched_tokens=16, max_num_seqs=4, max_model_len=80
    )
    reqs = [_request(0, 70, 3), _request(1, 70, 3)]
    for r in reqs:
        sched.add(r)
    _run(sched)
    assert all(len(r.output_token_ids) == 3 for r in reqs)
    assert sched.kv.pool.num_in_use == 0


@pytest.mark.parametrize("prefix_match", ["token", "page"])
def test_a_cached_prefix_in_the_only_page_does_not_hold_off_its_twin(prefix_match):
    """One usable page of 16 tokens, two samples of a 3-token prompt: the first runs alone
    (no page to fork its twin into) and its 13 tokens are cached. The twin's match ends
    inside that page, and no page is free to copy it to: its lock kept the page from
    eviction at every retry, and the engine stepped forever with nothing scheduled. With
    nothing running to free a page, the twin is now computed anew."""
    sched = Scheduler(
        KVManager(2, 16, prefix_match=prefix_match), max_num_batched_tokens=16, max_num_seqs=4, max_model_len=16
    )
    reqs = _twins(2, 3, 10)
    for r in reqs:
        sched.add(r)
    _run(sched, steps_limit=100)
    assert all(len(r.output_token_ids) == 10 for r in reqs)
    usage = sched.kv.usage(())
    assert reqs[1].num_cached_tokens == 0 and (
        usage["kv_pages_held"],
        usage["kv_pages_free"] + usage["kv_pages_cached"],
    ) == (0, 1)


@pytest.mark.parametrize("prefix_match", ["token", "page"])
def test_every_request_finishes_in_pools_one_request_can_fill(prefix_match):
    """Random requests, most sharing a prefix, in pools where a request of max_model_len
    takes every page: each finishes. A request's own lock on its radix path kept pages it
    did not use (a prefix cached twice, a partly filled page it had copied), so it
    preempted itself, came back to the same lock and went round forever: 4 pools in 10
    here, before. (Only the scheduler runs: ~1 s.)"""
    for trial in range(300):
        sched, work = tight_pool(random.Random(trial), prefix_match)
        reqs = [Request(f"r{i}", prompt, params, seed=i) for i, (prompt, params) in enumerate(work)]
        for r in reqs:
            sched.add(r)
        _run(sched, steps_limit=2000)
        assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs), trial
        usage = sched.kv.usage(())
        assert usage["kv_pages_free"] + usage["kv_pages_cached"] == usage["kv_pages_total"]


def _step(sched: Scheduler) -> list[str]:
    out = sched.schedule()
    sched.update(out, [1] * out.num_rows)
    sched.check_integrity()
    return [r.request_id for r, _ in out.scheduled]


def test_a_second_client_is_not_starved_by_one_clients_long_streams():
    """Client a fills every slot with long streams and queues more; client b's short request
    runs within a few steps (a slot is reclaimed from a), not after a's streams end."""
    sched = Scheduler(KVManager(400, 4), max_num_batched_tokens=64, max_num_seqs=4, max_model_len=4096)
    hogs = [_request(i, 8, 3000) for i in range(6)]
    for r in hogs:
        r.client = "a"
        sched.add(r)
    for _ in range(5):
        _step(sched)
    assert len(sched.running) == 4
    short = _request(99, 8, 2)
    short.client = "b"
    sched.add(short)
    for _ in range(4):
        _step(sched)
    assert short.status.is_finished, "the short request of a second client waited behind the long streams"
    # a's victim resumes from the prefix cache, and a keeps the slots b does not need.
    victim = next(r for r in hogs if r.num_preemptions)
    for _ in range(3):
        _step(sched)
    assert victim.status.value == "running" and victim.num_cached_tokens > 8
    assert sum(r.client == "a" for r in sched.running) == 4


def test_admission_alternates_between_clients():
    sched = Scheduler(
        KVManager(400, 4, prefix_caching=False), max_num_batched_tokens=64, max_num_seqs=4, max_model_len=4096
    )
    for i in range(6):
        r = _request(i, 4, 50)
        r.client = "a"
        sched.add(r)
    for i in range(6, 8):
        r = _request(i, 4, 50)
        r.client = "b"
        sched.add(r)
    assert _step(sched) == ["r0", "r6", "r1", "r7"]


def _twins(n: int, prompt_len: int, max_tokens: int, first: int = 0) -> list[Request]:
    prompt = [9] * prompt_len
    return [Request(f"t{first + i}", prompt, SamplingParams(max_tokens=max_tokens), seed=i) for i in range(n)]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_twins_fork_from_the_request_finishing_their_prompt(prefix_caching):
    """Requests with one prompt (n > 1 samples, identical requests) compute it once: the
    others fork in the step that finishes it, share its whole pages, get a copy of its
    last partly filled page before the next step, and decode on their own from there."""
    sched = Scheduler(
        KVManager(200, 4, prefix_caching),
        max_num_batched_tokens=8,
        max_num_seqs=6,
        max_model_len=64,
        min_token_bucket=8,
    )
    reqs = _twins(4, 10, 5)
    for r in reqs:
        sched.add(r)
    computed, forked_at = 0, None
    for step in range(100):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.check_integrity()  # the reserved copy page is accounted for
        if step == forked_at:  # the step after the fork copies the parent's last page for each twin
            assert len(out.page_copies) == 3 and all(src == reqs[0].pages[2] for src, _ in out.page_copies)
        computed += sum(n for r, n in out.scheduled if not r.is_prefill_done or n > 1)
        if out.forks:
            assert [t.request_id for t, _, _ in out.forks] == ["t1", "t2", "t3"]
            assert all(p is reqs[0] for _, p, _ in out.forks) and forked_at is None
            forked_at = step + 1
        sched.update(out, [1] * out.num_rows)
        if out.forks:
            for twin in reqs[1:]:
                assert twin.pages[:2] == reqs[0].pages[:2] and twin.pages[2] != reqs[0].pages[2]
                assert twin.num_computed_tokens == 10 and twin.output_token_ids == [1]
        sched.check_integrity()
    assert computed == 10 and forked_at is not None
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == [1] * 5 for r in reqs)
    if not prefix_caching:  # (with it, the prompt and outputs stay cached)
        assert sched.kv.pool.num_in_use == 0
    assert not sched.kv.reserved and sched.num_forks == 3


def test_no_fork_past_max_num_seqs_or_without_a_page_or_for_prompt_logprobs():
    # 3 slots: the parent and two twins fork; the fourth computes its own last token later.
    sched = Scheduler(
        KVManager(200, 4), max_num_batched_tokens=16, max_num_seqs=3, max_model_len=64, min_token_bucket=8
    )
    reqs = _twins(4, 10, 3)
    reqs[2].params = SamplingParams(max_tokens=3, prompt_logprobs=0)  # scores its prompt: computes it
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert [t.request_id for t, _, _ in out.forks] == ["t1", "t3"]
    sched.update(out, [1] * out.num_rows)
    sched.check_integrity()
    # No free page for the copy of a partial last page: no fork, nothing reserved.
    tight = Scheduler(
        KVManager(4, 4, prefix_caching=False),
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=64,
        min_token_bucket=8,
    )
    for r in _twins(2, 10, 2, first=10):
        tight.add(r)
    out = tight.schedule()
    assert not out.forks and not tight.kv.reserved
    tight.check_integrity()


def test_a_step_looks_at_a_few_of_a_long_waiting_queue_not_all(monkeypatch):
    """A 10,000-prompt offline batch waits in the queue at once. A step that found the
    batch full, or the prompts it finishes without a twin of the same length, used to walk
    the whole queue for twins and for its clients (~1 us a request: 8,000 tiny-model
    prompts in one call ran 8.2 ms a step, against 3.0 in calls of 500). Counted: the
    fork checks per step."""
    sched = Scheduler(KVManager(4000, 16), max_num_batched_tokens=64, max_num_seqs=4, max_model_len=512)
    for i in range(2000):
        sched.add(_request(i, 20 + i % 7, 8))
    checks = []
    real = Scheduler._fork
    monkeypatch.setattr(Scheduler, "_fork", lambda self, twin, *rest: checks.append(twin) or real(self, twin, *rest))
    for _ in range(40):
        checks.clear()
        out = sched.schedule()
        sched.check_integrity()
        assert len(checks) <= 5, len(checks)  # those admitted, and one that found no room
        sched.update(out, [1] * out.num_rows)
    assert sched.num_forks == 0 and len(sched.waiting) < 2000


def test_a_twin_is_looked_for_among_the_prompts_a_step_finishes_not_among_its_decodes(monkeypatch):
    """A waiting request's fork check used to walk every row of the step (~1 us a row it
    asked "does it finish its prompt"): 256 decodes and a few prompts admitted a step
    cost ~3 ms. Counted: that question, asked once per prefill row a step."""
    from jaxserve.engine import scheduler

    sched = Scheduler(KVManager(4000, 16), max_num_batched_tokens=256, max_num_seqs=64, max_model_len=512)
    for i in range(200):
        sched.add(_request(i, 30, 40))  # one prompt length: every row a possible parent
    asked = []
    real = scheduler._finishes_prompt
    monkeypatch.setattr(scheduler, "_finishes_prompt", lambda r, n: asked.append(r) or real(r, n))
    decoding_steps = 0
    for _ in range(60):
        asked.clear()
        out = sched.schedule()
        sched.check_integrity()
        prefill_rows = len(out.scheduled) - out.num_decode_tokens
        assert len(asked) <= prefill_rows, (len(asked), prefill_rows, out.num_decode_tokens)
        decoding_steps += out.num_decode_tokens >= 32 and prefill_rows > 0
        sched.update(out, [1] * out.num_rows)
    assert decoding_steps >= 3  # the case in question: many decodes beside admissions


def test_admission_gathers_the_prefilling_requests_once_a_step(monkeypatch):
    """Whether a waiting request shares a prefix still being computed was asked of every
    running request, for each waiting request admission looked at (O(running) each).
    Counted: ``is_prefill_done`` asked per step, against the running requests."""
    sched = Scheduler(KVManager(4000, 16), max_num_batched_tokens=256, max_num_seqs=64, max_model_len=512)
    for i in range(200):
        sched.add(_request(i, 12, 40))
    asked = [0]
    real = Request.is_prefill_done
    monkeypatch.setattr(
        Request, "is_prefill_done", property(lambda r: asked.__setitem__(0, asked[0] + 1) or real.fget(r))
    )
    busy_steps = 0
    for _ in range(60):
        asked[0] = 0
        running = len(sched.running)
        out = sched.schedule()
        admitted = len(sched.running) - running
        assert asked[0] <= 3 * running + 2 * admitted + 2, (asked[0], running, admitted)
        busy_steps += running >= 32 and admitted >= 2
        sched.update(out, [1] * out.num_rows)
    sched.check_integrity()
    assert busy_steps >= 3  # the case in question: admissions beside many running requests
