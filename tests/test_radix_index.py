"""The KV manager and its radix index against a naive model, property-based (hypothesis).

A simulated KV store records which token each page slot holds, so the test checks not
just match lengths but that the pages returned by a match really hold the matched
prefix, copy-on-write pages included.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.radix_index import common_prefix
from jaxserve.engine.request import Request
from jaxserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Sim:
    """The KV manager, driven as the scheduler drives it, by simulated requests that
    compute their sequence in one chunk and cache it."""

    def __init__(self, num_pages: int, page_size: int):
        self.kv = KVManager(num_pages, page_size)
        self.pool, self.index = self.kv.pool, self.kv.index
        self.ps = page_size
        self.slots: dict[tuple[int, int], int] = {}  # (page, offset) -> token written there
        self.inserted: list[tuple[int, ...]] = []  # sequences the cache has been given
        self.live: list[tuple[Request, int]] = []  # (request, tokens its cached part must keep)

    def check(self) -> None:
        self.kv.check_integrity([r for r, _ in self.live])
        for r, _ in self.live:  # eviction never touches a live request's pages
            assert self.read(r.pages, r.num_computed_tokens) == r.token_ids[: r.num_computed_tokens]

    def read(self, pages: list[int], n: int) -> list[int | None]:
        return [self.slots.get((pages[i // self.ps], i % self.ps)) for i in range(n)]

    def start(self, tokens: tuple[int, ...]) -> bool:
        """Admits a request: reuse the cached prefix, compute the rest, cache it."""
        r = Request(f"r{len(self.inserted)}", list(tokens), GREEDY, seed=0)
        admitted = self.kv.admit(r, budget=len(tokens))
        if admitted is None:
            assert not r.pages and r.num_computed_tokens == 0, "a failed admission left state behind"
            return False
        n, copy = admitted
        matched = r.num_computed_tokens
        assert matched <= max((_lcp(tokens[:-1], s) for s in self.inserted), default=0)
        if copy is not None:  # the device copy the scheduler would run before the step
            for off in range(self.ps):
                if (copy[0], off) in self.slots:
                    self.slots[(copy[1], off)] = self.slots[(copy[0], off)]
        assert self.read(r.pages, matched) == list(tokens[:matched]), "pages do not hold the matched prefix"
        assert n == len(tokens) - matched
        for i in range(matched, len(tokens)):  # "compute" the rest
            self.slots[(r.pages[i // self.ps], i % self.ps)] = tokens[i]
        self.kv.commit(r, n)
        if n > 1:  # a prefill chunk is cached at once (a lone token waits for free)
            self.inserted.append(tokens)
        self.live.append((r, len(tokens) if n > 1 else matched))
        return True

    def play(self, ops, after=lambda: None) -> None:
        """Starts and finishes requests as ``ops`` say, calling ``after`` after each."""
        for op, arg in ops:
            if op == "start":
                self.start(arg)
            elif self.live:
                self.finish(arg)
            after()

    def finish(self, i: int) -> None:
        r, _ = self.live.pop(i % len(self.live))
        self.kv.free(r, keep_cached=True)
        self.inserted.append(tuple(r.token_ids))


seqs = st.lists(st.integers(0, 2), min_size=1, max_size=14).map(tuple)
ops = st.lists(
    st.one_of(st.tuples(st.just("start"), seqs), st.tuples(st.just("finish"), st.integers(0, 99))), max_size=40
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, page_size=st.sampled_from([1, 2, 3, 4]))
def test_match_equals_longest_common_prefix_without_eviction(ops, page_size):
    sim = Sim(num_pages=2000, page_size=page_size)
    for op, arg in ops:
        if op == "start":
            expected = max((_lcp(arg, s) for s in sim.inserted), default=0)
            assert sim.index.match(arg)[0] == expected
            assert sim.start(arg)
        elif sim.live:
            sim.finish(arg)
        sim.check()


@settings(max_examples=300, deadline=None)
@given(ops=ops, page_size=st.sampled_from([2, 3, 4]))
def test_eviction_under_pressure_keeps_live_prefixes(ops, page_size):
    sim = Sim(num_pages=16, page_size=page_size)

    def still_cached():
        sim.check()
        # what every live request cached (or took from the cache) is still cached and readable
        for r, kept in sim.live:
            matched, got, _ = sim.index.match(r.token_ids)
            assert matched >= kept
            assert sim.read(got, matched) == r.token_ids[:matched]

    sim.play(ops, still_cached)
    while sim.live:
        sim.finish(0)
    sim.index.evict(10**6)
    sim.check()
    assert sim.pool.num_in_use == 0 and len(sim.index.nodes()) == 1


def test_token_level_match_ends_mid_page():
    sim = Sim(num_pages=64, page_size=4)
    a = (1, 2, 3, 4, 5, 6, 7)
    b = (1, 2, 3, 4, 5, 9)
    assert sim.start(a)
    matched, pages, _ = sim.index.match(b)
    assert matched == 5  # not rounded down to the page boundary (4)
    assert sim.start(b)
    assert sim.live[-1][0].num_cached_tokens == 5
    sim.check()


def test_lru_order_and_in_use_protection():
    sim = Sim(num_pages=9, page_size=2)  # 8 usable pages
    for seq in [(1, 1, 1, 1), (2, 2, 2, 2), (3, 3, 3, 3)]:
        sim.start(seq)
    sim.finish(0)  # (1,1,1,1) done first -> oldest
    sim.finish(0)  # (2,2,2,2)
    sim.index.match((2, 2, 2, 2))  # touch: now (1,...) is least recently used
    sim.index.evict(sim.pool.num_free + 2)
    assert sim.index.match((1, 1, 1, 1))[0] == 0
    assert sim.index.match((2, 2, 2, 2))[0] == 4
    sim.index.evict(10**6)  # (3,3,3,3) is still in use: never evicted
    assert sim.index.match((3, 3, 3, 3))[0] == 4
    assert sim.index.match((2, 2, 2, 2))[0] == 0
    sim.check()


@settings(max_examples=300, deadline=None)
@given(ops=ops, touches=st.lists(seqs, max_size=8), page_size=st.sampled_from([1, 2, 3]))
def test_each_eviction_takes_the_least_recently_used_unreferenced_leaf(ops, touches, page_size):
    """The candidates heap (kept as the tree changes, stale entries skipped) against a walk
    of the whole tree, which is what eviction did before it."""
    sim = Sim(num_pages=24, page_size=page_size)
    sim.play(ops)
    for t in touches:
        sim.index.match(t)
    for i in range(len(sim.live) // 2):  # some stay live: their paths are never candidates
        sim.finish(i)
    sim.check()
    while leaves := sim.index.evictable_leaves():
        victim = sim.index._lru_leaf()
        assert victim is not None and victim.last_access == min(n.last_access for n in leaves)
        sim.index._remove(victim)
        sim.check()
    assert sim.index._lru_leaf() is None


@settings(max_examples=500, deadline=None)
@given(
    a=st.lists(st.integers(0, 2), max_size=700),
    b=st.lists(st.integers(0, 2), max_size=700),
    b_from=st.integers(0, 5),
    as_tuple=st.booleans(),
)
def test_common_prefix_in_blocks_is_token_by_token(a, b, b_from, as_tuple):
    """The block comparison (and a tuple edge against a list of tokens) against the plain loop."""
    b = [0] * b_from + (a[:600] if len(b) % 2 else []) + b  # long shared runs, past a block
    limit = min(len(a), len(b) - b_from)
    n = 0
    while n < limit and a[n] == b[b_from + n]:
        n += 1
    assert common_prefix(tuple(a) if as_tuple else a, b, limit, b_from) == n
