"""Prefix caching on a tiny model: token-level reuse, identical outputs, eviction, lpm."""

from __future__ import annotations

import random

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    opts = dict(
        dtype="float32",
        page_size=16,
        num_pages=200,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        progress=False,
        warmup=False,
    )
    opts.update(kw)
    return LLM(str(path), **opts)


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir):
    return tiny_model_dir("llama3")[0]


def test_reuse_reaches_the_exact_divergence_token(tiny_path):
    """The seed's example: B after A computes len(B) - lcp(A, B) prefill tokens."""
    llm = _llm(tiny_path)
    rng = random.Random(0)
    system = [rng.randrange(320) for _ in range(300)]
    a = system + [5, 6, 7, 8, 9] + [rng.randrange(320) for _ in range(20)]
    b = system + [5, 6, 7, 11, 12] + [rng.randrange(320) for _ in range(25)]
    shared = 303  # not a multiple of the page size (16)
    llm.generate([a], GREEDY)
    before = llm.stats()["prefill_tokens_computed"]
    out = llm.generate([b], GREEDY)[0]
    computed = llm.stats()["prefill_tokens_computed"] - before
    assert out.num_cached_tokens == shared
    assert computed == len(b) - shared
    # entirely cached: only the last prompt token is recomputed (its logits are needed)
    before = llm.stats()["prefill_tokens_computed"]
    again = llm.generate([b], GREEDY)[0]
    assert llm.stats()["prefill_tokens_computed"] - before == 1
    assert again.token_ids == out.token_ids
    # page matching reuses only whole pages: 303 -> 288
    page = _llm(tiny_path, prefix_match="page")
    page.generate([a], GREEDY)
    assert page.generate([b], GREEDY)[0].num_cached_tokens == 288
    llm.scheduler.check_integrity()


def _workloads(vocab: int):
    rng = random.Random(1)
    system = [rng.randrange(vocab) for _ in range(90)]
    shared = [system + [rng.randrange(vocab) for _ in range(rng.randint(3, 30))] for _ in range(10)]
    short = [[7, 8, 9] + [rng.randrange(vocab) for _ in range(rng.randint(3, 20))] for _ in range(6)]
    return shared, short


@pytest.mark.parametrize("mode", ["token", "page"])
def test_outputs_identical_with_and_without_caching(tiny_path, mode):
    shared, short = _workloads(320)
    off = _llm(tiny_path, enable_prefix_caching=False)
    on = _llm(tiny_path, prefix_match=mode)
    for work in (shared, short):
        assert [o.token_ids for o in on.generate(work, GREEDY)] == [o.token_ids for o in off.generate(work, GREEDY)]
    # multi-turn: each turn resends the history plus the model's answer
    chats_on, chats_off = [list(s[:40]) for s in shared[:3]], [list(s[:40]) for s in shared[:3]]
    for turn in range(3):
        outs_on = on.generate(chats_on, GREEDY)
        outs_off = off.generate(chats_off, GREEDY)
        assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off]
        if turn:
            assert all(o.num_cached_tokens > 0 for o in outs_on)
        for chat, o in zip(chats_on, outs_on, strict=True):
            chat += o.token_ids + [turn + 1, 2, 3]
        for chat, o in zip(chats_off, outs_off, strict=True):
            chat += o.token_ids + [turn + 1, 2, 3]
    on.scheduler.check_integrity()
    assert on.stats()["prefix_cache_hit_tokens"] > 0


def test_same_uncached_prefix_in_one_batch_is_computed_once(tiny_path):
    llm = _llm(tiny_path, max_num_batched_tokens=1024)  # room to admit all four in one step
    rng = random.Random(2)
    common = [rng.randrange(320) for _ in range(200)]
    prompts = [common + [i, i + 1, i + 2] for i in range(4)]
    llm.generate(prompts, GREEDY)
    computed = llm.stats()["prefill_tokens_computed"]
    assert computed < 200 + 4 * 3 + 4 * 16  # the 200 shared tokens once (plus page copies' tails)
    assert computed >= 200 + 4 * 3


def test_small_pool_evicts_lru_and_never_a_running_request(tiny_path):
    llm = _llm(tiny_path, num_pages=40)  # 39 usable pages of 16: far fewer than all prefixes
    rng = random.Random(3)
    prompts = [[rng.randrange(320) for _ in range(rng.randint(40, 120))] for _ in range(24)]
    reqs = [llm.engine.add_request(p, GREEDY) for p in prompts]
    while llm.engine.has_unfinished():
        llm.engine.step()
        llm.scheduler.check_integrity()  # pages of running requests are all accounted for
    assert all(len(r.output_token_ids) == 8 for r in reqs)
    index = llm.kv.index
    cached = [index.match(p)[0] for p in prompts]
    assert cached[-1] > 0 and cached[0] == 0  # the newest survive, the oldest went first


def _req(i: int, tokens: list[int]) -> Request:
    return Request(f"r{i}", tokens, SamplingParams(max_tokens=2, temperature=0.0), seed=i)


@pytest.mark.parametrize("aging, admitted", [(8, True), (10**6, False)])
def test_lpm_aging_admits_a_cold_request(aging, admitted):
    sched = Scheduler(KVManager(400, 4), 16, 2, 256, schedule_policy="lpm", lpm_aging_steps=aging)
    hot_prefix = list(range(40))
    warm = _req(0, hot_prefix + [99])
    sched.add(warm)
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, [1] * out.num_rows)
    cold = _req(1, [300 + i for i in range(40)])
    sched.add(cold)
    for step in range(40):
        for k in range(3):  # a stream of hot requests, more than the batch can take
            sched.add(_req(100 + 3 * step + k, hot_prefix + [200 + 3 * step + k]))
        out = sched.schedule()
        sched.update(out, [1] * out.num_rows)
        sched.check_integrity()
        if cold.status is not RequestStatus.WAITING:
            break
    assert (cold.status is not RequestStatus.WAITING) == admitted
    if admitted:
        assert step <= aging + 2


@pytest.mark.parametrize("overlap", [True, False])
def test_a_prefill_only_request_caches_its_prompt(tiny_path, overlap):
    """max_tokens 0: the prompt is computed (in chunks), cached, and the request ends
    with no token; the next request sharing it computes only what follows."""
    llm = _llm(tiny_path, overlap_scheduling=overlap)
    rng = random.Random(5)
    system = [rng.randrange(320) for _ in range(150)]
    warm = llm.generate([system], SamplingParams(max_tokens=0))[0]
    assert (warm.token_ids, warm.text, warm.finish_reason) == ([], "", "length")
    stats = llm.stats()
    assert stats["prefill_tokens_computed"] == 150 and stats["decode_tokens"] == 0
    assert stats["kv_pages_held"] == 0 and stats["kv_pages_cached"] == 150 // 16 + 1
    question = system + [rng.randrange(320) for _ in range(10)]
    out = llm.generate([question], GREEDY)[0]
    assert out.num_cached_tokens == 150
    assert llm.stats()["prefill_tokens_computed"] - stats["prefill_tokens_computed"] == 10
    assert out.token_ids == _llm(tiny_path, enable_prefix_caching=False).generate([question], GREEDY)[0].token_ids
    # beside running requests, in one step
    reqs = [llm.engine.add_request(question, GREEDY), llm.engine.add_request(system[:40], SamplingParams(max_tokens=0))]
    while llm.engine.has_unfinished():
        llm.engine.step()
        llm.scheduler.check_integrity()
    assert reqs[0].output_token_ids == out.token_ids and reqs[1].output_token_ids == []
    assert reqs[1].finish_reason == "length" and llm.stats()["kv_pages_held"] == 0


def _run_checked(llm, requests):
    while llm.engine.has_unfinished():
        llm.engine.step()
        llm.scheduler.check_integrity()
    return requests


@pytest.mark.parametrize("overlap", [True, False])
def test_a_pinned_prefix_survives_pool_pressure_while_leased(tiny_path, overlap):
    """LLM.pin computes a prompt and leases it: requests that need every other page evict
    around it, integrity holding every step; after unpin the same pressure evicts it."""
    llm = _llm(tiny_path, num_pages=40, overlap_scheduling=overlap)  # 39 usable pages of 16
    rng = random.Random(8)
    system = [rng.randrange(320) for _ in range(150)]  # 10 pages
    lease = llm.pin(system, ttl_s=600)
    assert (lease.num_tokens, lease.num_cached_tokens) == (150, 0)
    stats = llm.stats()
    assert stats["leases"] == 1 and stats["kv_pages_pinned"] == 10 and stats["kv_pages_held"] == 0
    assert stats["prefill_tokens_computed"] == 150

    def pressure():  # 4 x 150 unique tokens at once: 40 pages wanted, so the cache must give way
        prompts = [[rng.randrange(320) for _ in range(150)] for _ in range(4)]
        _run_checked(llm, [llm.engine.add_request(p, GREEDY) for p in prompts])

    def cached_of_system() -> int:
        request = llm.engine.add_request(system + [1, 2, 3], GREEDY)
        _run_checked(llm, [request])
        return request.num_cached_tokens

    pressure()
    assert cached_of_system() == 150  # nothing of it was evicted
    assert llm.stats()["kv_pages_pinned"] == 10
    assert llm.unpin(lease) and not llm.unpin(lease)  # a second unpin finds nothing
    assert llm.stats()["leases"] == 0 and llm.stats()["kv_pages_pinned"] == 0
    pressure()
    pressure()
    assert cached_of_system() < 150  # unpinned, the same pressure evicted it


def test_a_lease_that_is_not_released_expires(tiny_path):
    llm = _llm(tiny_path, num_pages=40)
    now = [1000.0]
    llm.kv.clock = lambda: now[0]
    rng = random.Random(9)
    system = [rng.randrange(320) for _ in range(100)]
    lease = llm.pin(system, ttl_s=5)
    assert llm.stats()["leases"] == 1
    now[0] += 4.9
    llm.generate([[1, 2, 3]], GREEDY)  # a schedule: leases are checked there
    assert llm.stats()["leases"] == 1
    now[0] += 0.2
    llm.generate([[1, 2, 3]], GREEDY)
    assert llm.stats()["leases"] == 0 and llm.stats()["kv_pages_pinned"] == 0
    assert not llm.unpin(lease)  # expired already
    llm.scheduler.check_integrity()
    # a pin of a prefix that is cached already computes only its last token, and reports it
    again = llm.pin(system, ttl_s=5)
    assert again.num_cached_tokens == 99 and again.lease_id != lease.lease_id


def test_pins_are_capped_at_half_the_pool_and_checked(tiny_path):
    from jaxserve.errors import RequestError

    llm = _llm(tiny_path, num_pages=40)  # 39 usable: leases may pin 19 pages
    rng = random.Random(10)
    first = llm.pin([rng.randrange(320) for _ in range(150)], ttl_s=60)  # 10 pages
    with pytest.raises(RequestError, match="leases may pin at most 19 of the 39"):
        llm.pin([rng.randrange(320) for _ in range(150)], ttl_s=60)
    assert llm.stats()["leases"] == 1  # the refused one's pages are plain cache, unpinned
    llm.scheduler.check_integrity()
    for bad in (0, -1, float("nan"), float("inf"), 1e9, "5", True):
        with pytest.raises(RequestError, match=r"pin_s = .*: must be a number of seconds in \(0, 3600\]"):
            llm.pin([1, 2, 3], ttl_s=bad)
    assert llm.unpin(first)
    with pytest.raises(RequestError, match="pin_s: pinning needs the prefix cache"):
        _llm(tiny_path, enable_prefix_caching=False).pin([1, 2, 3])
