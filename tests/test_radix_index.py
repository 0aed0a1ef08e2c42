"""RadixIndex against a naive model, property-based (hypothesis).

A simulated KV store records which token each page slot holds, so the test checks not
just match lengths but that the pages returned by a match really hold the matched
prefix, copy-on-write pages included.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.page_pool import PagePool
from jaxserve.engine.radix_index import RadixIndex


def _lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Sim:
    """The radix index plus simulated requests that compute and cache sequences."""

    def __init__(self, num_pages: int, page_size: int):
        self.pool = PagePool(num_pages, page_size)
        self.index = RadixIndex(self.pool)
        self.ps = page_size
        self.slots: dict[tuple[int, int], int] = {}  # (page, offset) -> token written there
        self.inserted: list[tuple[int, ...]] = []
        self.live: list[tuple[tuple[int, ...], list[int], object, int]] = []  # (tokens, pages, node, matched)

    def check(self) -> None:
        self.pool.check_integrity()
        self.index.check_integrity()
        want = self.index.page_refs()
        for _, pages, _, _ in self.live:
            for p in pages:
                want[p] = want.get(p, 0) + 1
        for p in range(1, self.pool.num_pages):
            assert self.pool.refcounts[p] == want.get(p, 0), f"page {p}"

    def read(self, pages: list[int], n: int) -> list[int | None]:
        return [self.slots.get((pages[i // self.ps], i % self.ps)) for i in range(n)]

    def start(self, tokens: tuple[int, ...]) -> bool:
        """Admits a request: reuse the cached prefix, compute the rest, cache it all."""
        matched, pages, node = self.index.match(tokens)
        assert matched <= max((_lcp(tokens, s) for s in self.inserted), default=0)
        assert self.read(pages, matched) == list(tokens[:matched]), "pages do not hold the matched prefix"
        full = matched // self.ps
        need = -(-len(tokens) // self.ps) - full
        # Lock the matched path before evicting, as PrefixCache.attach does, so eviction
        # cannot shorten the match this request is about to use.
        self.index.lock(node)
        if self.pool.num_free < need:
            self.index.evict(need)
            if self.pool.num_free < need:
                self.index.unlock(node)
                return False
        own = pages[:full]
        self.pool.retain(own)
        fresh = self.pool.allocate(need)
        if matched % self.ps:  # copy-on-write of the page the match ends in
            for off in range(self.ps):
                if (pages[full], off) in self.slots:
                    self.slots[(fresh[0], off)] = self.slots[(pages[full], off)]
        own = own + fresh
        for i in range(matched, len(tokens)):  # "compute" the rest
            self.slots[(own[i // self.ps], i % self.ps)] = tokens[i]
        leaf = self.index.insert(tokens, own)
        self.index.lock(leaf)
        self.index.unlock(node)
        self.inserted.append(tokens)
        self.live.append((tokens, own, leaf, matched))
        return True

    def finish(self, i: int) -> None:
        tokens, pages, leaf, _ = self.live.pop(i % len(self.live))
        self.index.unlock(leaf)
        self.pool.release(pages)


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
    for op, arg in ops:
        if op == "start":
            sim.start(arg)
        elif sim.live:
            sim.finish(arg)
        sim.check()
        # every live request's sequence is still fully cached and readable
        for tokens, _, _, _ in sim.live:
            matched, got, _ = sim.index.match(tokens)
            assert matched == len(tokens)
            assert sim.read(got, matched) == list(tokens)
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
    assert sim.live[-1][3] == 5
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
