"""The one door to KV pages: the page pool and the prefix cache behind four calls.

Only this module (with the pool and the radix index under it) touches pages, refcounts
and a request's ``pages`` / ``num_computed_tokens`` / ``cache_node``. The scheduler
decides who runs and how many tokens; for pages it asks:

* ``admit(request, budget)``, all or nothing: a request with nothing computed gets its
  longest cached prefix (all but its last token, whose logits are needed), shares the
  pages the match covers fully, and gets a copy of the page the match ends in
  (copy-on-write), so reuse reaches the exact divergence token; then pages for a first
  chunk. ``prefix_match="page"`` rounds the match down to a page boundary instead (the
  block-hash behaviour of other engines, for comparison). If the chunk's pages cannot be
  found, nothing of this happened.
* ``grow(request, n)``: pages for ``n`` more tokens, evicting least recently used
  unreferenced prefixes when the pool is short.
* ``commit(request, n)``: ``n`` more tokens were computed; prefill chunks go to the
  prefix cache at once, so later requests (and the next turn of a chat) reuse them, and
  the request's lock on the radix tree moves to the deepest node.
* ``free(request, keep_cached, pin_s)``: the pages go back (cached nodes keep their own
  references); its computed tokens are cached first when ``keep_cached``, and with
  ``pin_s`` the request's lock on them passes to a lease instead of being dropped.

And for twins (the scheduler's forks: a waiting request whose prompt another request
finishes computing in this step), ``reserve_fork`` then ``fork``: the twin shares the
prompt's pages without computing any of it.

Leases pin a cached prefix (a frontend warms a shared prefix with a prefill-only request,
then runs a batch against it): the lease holds a lock on the prefix's radix path, as a
running request does, so nothing on it is evicted until ``unpin`` or until it expires
(``expire_leases``, called every schedule: a client that never unpins cannot hold
memory for longer than the lease it asked for). Leases together pin at most
``MAX_PINNED_FRACTION`` of the pool; a pin past that is refused, not queued.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable

from jaxserve.engine.page_pool import PagePool
from jaxserve.engine.radix_index import RadixIndex, RadixNode
from jaxserve.engine.request import Request

PREFIX_MATCH_MODES = ("token", "page")

PageCopy = tuple[int, int]  # (src, dst), run on the device before the step
MAX_PINNED_FRACTION = 0.5  # of the usable pages, over all leases


@dataclasses.dataclass
class Lease:
    """A pinned prefix: its radix path is locked until ``expires_at`` (``clock`` seconds)."""

    lease_id: str
    node: RadixNode
    num_tokens: int
    expires_at: float
    client: str = ""  # who made it (the request's client): only they may end it


class KVManager:
    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True, prefix_match: str = "token"):
        if prefix_match not in PREFIX_MATCH_MODES:
            raise ValueError(f"prefix_match {prefix_match!r} is not one of: {', '.join(PREFIX_MATCH_MODES)}")
        self.pool = PagePool(num_pages, page_size)
        self.page_size = page_size
        self.index = RadixIndex(self.pool) if prefix_caching else None
        self.prefix_match = prefix_match
        self.hit_tokens = 0  # prompt tokens admissions took from the cache
        self.queried_tokens = 0  # tokens of the admitted requests
        self.leases: dict[str, Lease] = {}
        self._lease_ids = itertools.count(1)
        self.reserved: set[int] = set()  # pages reserve_fork gave a step's twins, until it commits
        self.clock: Callable[[], float] = time.monotonic  # lease expiry (tests set their own)

    @property
    def prefix_caching(self) -> bool:
        return self.index is not None

    def cached_length(self, request: Request) -> int:
        """How many of the request's tokens are cached (no side effect but an LRU touch)."""
        return 0 if self.index is None else self._match(request)[0]

    def _match(self, request: Request) -> tuple[int, list[int], object]:
        """(tokens, pages, node) of the longest cached prefix of all but the request's last
        token (its logits are needed), rounded down to a page in ``page`` mode."""
        limit = len(request.token_ids) - 1
        if request.params.prompt_logprobs is not None:  # the rows scoring tokens >= score_from are computed
            limit = min(limit, max(request.score_from - 1, 0))
        matched, pages, node = self.index.match(request.token_ids[:limit])
        if self.prefix_match == "page":
            matched -= matched % self.page_size
        return matched, pages, node

    # -- the four calls ----------------------------------------------------------------
    def admit(self, request: Request, budget: int, reuse: bool = True) -> tuple[int, PageCopy | None] | None:
        """The cached prefix (``reuse``) and pages for a first chunk of at most ``budget``
        tokens. Returns (chunk size, page copy or None), or None with nothing changed."""
        assert not request.pages and request.num_computed_tokens == 0, "admit of a request holding pages"
        copy = self._attach(request) if self.index is not None and reuse else None
        n = min(request.num_tokens_to_compute, budget)
        if not self.grow(request, n):
            self.free(request, keep_cached=False)
            return None
        request.num_cached_tokens = request.num_computed_tokens
        self.hit_tokens += request.num_cached_tokens
        self.queried_tokens += request.num_tokens
        return n, copy

    def _attach(self, request: Request) -> PageCopy | None:
        matched, pages, node = self._match(request)
        full = matched // self.page_size
        self.index.lock(node)  # before any eviction below: the match must survive it
        request.cache_node = node
        request.pages = list(pages[:full])
        self.pool.retain(request.pages)
        copy = None
        if matched % self.page_size:
            if self.pool.num_free == 0:
                self.index.evict(1)
            if self.pool.num_free == 0:
                matched = full * self.page_size  # no page for the copy: reuse whole pages only
            else:
                dst = self.pool.allocate(1)[0]
                copy = (pages[full], dst)
                request.pages.append(dst)
        request.num_computed_tokens = matched
        return copy

    def grow(self, request: Request, num_new_tokens: int) -> bool:
        """Makes the request's pages cover ``num_computed + num_new_tokens`` tokens."""
        need = self.pool.pages_needed(request.num_computed_tokens + num_new_tokens) - len(request.pages)
        if need <= 0:
            return True
        if need > self.pool.num_free and self.index is not None:
            self.index.evict(need)
        if need > self.pool.num_free:
            return False
        request.pages += self.pool.allocate(need)
        return True

    def unlock_path(self, request: Request) -> None:
        """Lets go of the request's lock on its radix path; it keeps its pages (the next
        ``commit`` or ``free`` caches them again). Pages the path holds that the request
        does not (an earlier copy of a prefix it computed anew, a partly filled page it
        copied) become evictable: for a request that cannot grow otherwise."""
        if self.index is not None and request.cache_node is not None:
            self.index.unlock(request.cache_node)
            request.cache_node = None

    def commit(self, request: Request, num_tokens: int) -> None:
        """Records ``num_tokens`` more computed tokens. A prefill chunk is cached now; a
        lone decode token is not (a tree walk per token for little gain: ``free`` caches
        the whole sequence at the end)."""
        request.num_computed_tokens += num_tokens
        if num_tokens > 1 or request.num_tokens_to_compute > 0:
            self._publish(request)

    def free(self, request: Request, keep_cached: bool, pin_s: float | None = None) -> None:
        """Releases the request's pages, caching its computed tokens first if asked; with
        ``pin_s`` (and ``keep_cached``) they stay pinned for that many seconds: the lease's
        id goes to ``request.lease_id``, or why not to ``request.pin_refused``."""
        if self.index is not None:
            if keep_cached:
                self._publish(request)
            if request.cache_node is not None:
                if not (keep_cached and pin_s is not None and self._lease(request, pin_s)):
                    self.index.unlock(request.cache_node)
                request.cache_node = None
        self.pool.release(request.pages)
        request.pages = []
        request.num_computed_tokens = 0

    def _publish(self, request: Request) -> None:
        n = request.num_computed_tokens
        if self.index is None or n == 0:
            return
        leaf = self.index.insert(request.token_ids[:n], request.pages)
        self.index.lock(leaf)
        if request.cache_node is not None:
            self.index.unlock(request.cache_node)
        request.cache_node = leaf

    # -- forks -------------------------------------------------------------------------
    def reserve_fork(self, parent: Request) -> int | None:
        """For a twin of ``parent`` (the same prompt, computed by ``parent`` this step):
        the page its copy of the prompt's last, partly filled page goes to (0: the prompt
        fills whole pages, none needed), or None if no page can be had."""
        if parent.num_prompt_tokens % self.page_size == 0:
            return 0
        if self.pool.num_free == 0 and self.index is not None:
            self.index.evict(1)
        if not self.pool.num_free:
            return None
        page = self.pool.allocate(1)[0]
        self.reserved.add(page)
        return page

    def fork(self, twin: Request, parent: Request, page: int) -> PageCopy | None:
        """Gives ``twin`` the prompt ``parent`` has just computed: its whole pages shared,
        the last partly filled one copied into ``page`` (``reserve_fork``; the returned
        copy runs before the next step, after the step that writes it)."""
        assert not twin.pages and twin.num_computed_tokens == 0, "fork into a request holding pages"
        n = parent.num_prompt_tokens
        full = n // self.page_size
        twin.pages = list(parent.pages[:full])
        self.pool.retain(twin.pages)
        copy = None
        if page:
            self.reserved.remove(page)
            twin.pages.append(page)
            copy = (parent.pages[full], page)
        twin.num_computed_tokens = twin.num_cached_tokens = n
        if self.index is not None and parent.cache_node is not None:
            self.index.lock(parent.cache_node)  # the prompt's radix path, as its parent holds it
            twin.cache_node = parent.cache_node
        self.hit_tokens += n
        self.queried_tokens += n
        return copy

    def unreserve(self, page: int) -> None:
        if page:
            self.reserved.remove(page)
            self.pool.release([page])

    # -- leases ------------------------------------------------------------------------
    def _lease(self, request: Request, pin_s: float) -> bool:
        """Turns the request's lock on its cached tokens into a lease, if the pinned pages
        stay within MAX_PINNED_FRACTION of the pool."""
        node, n = request.cache_node, request.num_computed_tokens
        pinned = self._pinned_pages()
        path = set(self.index.path_pages(node))
        limit = int(self.pool.num_usable * MAX_PINNED_FRACTION)
        if len(pinned | path) > limit:
            request.pin_refused = (
                f"pinning its {n} tokens would pin {len(pinned | path)} KV pages; leases may pin at most "
                f"{limit} of the {self.pool.num_usable} (unpin others first)"
            )
            return False
        lease = Lease(f"lease-{next(self._lease_ids)}", node, n, self.clock() + pin_s, request.client)
        self.leases[lease.lease_id] = lease
        request.lease_id = lease.lease_id
        return True

    def unpin(self, lease_id: str, client: str | None = None) -> bool:
        """Ends a lease now; False if there is none by that id (ended or expired) or, with
        ``client``, it is another client's."""
        lease = self.leases.get(lease_id)
        if lease is None or (client is not None and lease.client != client):
            return False
        del self.leases[lease_id]
        self.index.unlock(lease.node)
        return True

    def expire_leases(self) -> int:
        """Ends every lease past its time; returns how many."""
        now = self.clock()
        expired = [i for i, lease in self.leases.items() if lease.expires_at <= now]
        for lease_id in expired:
            self.unpin(lease_id)
        return len(expired)

    def _pinned_pages(self) -> set[int]:
        return {p for lease in self.leases.values() for p in self.index.path_pages(lease.node)}

    # -- the whole cache -----------------------------------------------------------------
    def clear_cache(self) -> None:
        """Drops every lease and every cached prefix no request holds (e.g. after the device
        KV cache was lost: their pages hold nothing valid)."""
        if self.index is not None:
            for lease_id in list(self.leases):
                self.unpin(lease_id)
        self.drop_unpinned_prefixes()

    def drop_unpinned_prefixes(self) -> None:
        """Evicts every cached prefix that no request holds and no lease pins."""
        if self.index is not None:
            self.index.evict(self.pool.num_pages)

    def usage(self, holders: Iterable[Request]) -> dict[str, int]:
        held = len({p for r in holders for p in r.pages})
        return {
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_queried_tokens": self.queried_tokens,
            "kv_pages_held": held,
            "kv_pages_cached": self.pool.num_in_use - held,
            "kv_pages_total": self.pool.num_usable,
            "kv_pages_free": self.pool.num_free,
            "kv_pages_pinned": len(self._pinned_pages()) if self.index is not None else 0,
            "leases": len(self.leases),
        }

    def check_integrity(self, holders: Iterable[Request]) -> None:
        """Pool, tree and requests agree: every page reference is accounted for."""
        self.pool.check_integrity()
        refs = Counter()
        if self.index is not None:
            self.index.check_integrity()
            refs = self.index.page_refs()
            # Node locks: the root's own, one per running request's node and one per lease,
            # each along its whole path.
            locks = Counter({id(self.index.root): 1})
            for node in [r.cache_node for r in holders if r.cache_node is not None] + [
                lease.node for lease in self.leases.values()
            ]:
                while node is not None:
                    locks[id(node)] += 1
                    node = node.parent
            for node in self.index.nodes():
                assert node.ref == locks[id(node)], f"radix node ref {node.ref} != {locks[id(node)]} locks"
        for r in holders:
            assert r.num_computed_tokens <= len(r.pages) * self.page_size, f"{r.request_id}: computed beyond its pages"
            refs.update(r.pages)
        refs.update(self.reserved)
        for p in range(1, self.pool.num_pages):
            assert self.pool.refcounts[p] == refs[p], f"page {p}: refcount {self.pool.refcounts[p]} != {refs[p]} users"
