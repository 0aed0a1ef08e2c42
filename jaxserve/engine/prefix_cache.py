"""The prefix cache as the scheduler uses it: a request's view of the radix index.

* ``attach(request)`` on admission: find the longest cached prefix of the prompt (all but
  its last token, whose logits are needed), share the fully covered pages, and — when the
  match ends inside a page — copy that page for the request (copy-on-write), so reuse
  reaches the exact divergence token. ``prefix_match="page"`` rounds the match down to a
  page boundary instead (the block-hash behaviour of other engines, for comparison).
* ``publish(request)`` as prefill chunks complete and when a request finishes: insert
  the tokens whose K/V are computed, so later requests (and the next turn of a chat) reuse
  them; the request's lock moves to the deepest node.
* ``detach(request)`` when it leaves: unlock its path (its pages are released by the
  scheduler; cached nodes keep their own references).
"""

from __future__ import annotations

from jaxserve.engine.page_pool import PagePool
from jaxserve.engine.radix_index import RadixIndex
from jaxserve.engine.request import Request

PREFIX_MATCH_MODES = ("token", "page")


class PrefixCache:
    def __init__(self, pool: PagePool, prefix_match: str = "token"):
        if prefix_match not in PREFIX_MATCH_MODES:
            raise ValueError(f"prefix_match {prefix_match!r} is not one of: {', '.join(PREFIX_MATCH_MODES)}")
        self.pool = pool
        self.index = RadixIndex(pool)
        self.page_size = pool.page_size
        self.prefix_match = prefix_match
        self.hit_tokens = 0
        self.queried_tokens = 0

    def match_length(self, request: Request) -> int:
        """How many tokens of ``request`` are cached (for lpm ordering; no side effects
        beyond LRU touch)."""
        matched, _, _ = self.index.match(request.all_token_ids[:-1])
        return self._round(matched)

    def _round(self, matched: int) -> int:
        return matched - matched % self.page_size if self.prefix_match == "page" else matched

    def attach(self, request: Request) -> tuple[int, int] | None:
        """Gives a request with nothing computed its cached prefix.

        Returns a ``(src_page, dst_page)`` device copy to run before the step, or None. The
        caller must have ``1`` free page available when the match ends mid-page (it
        allocates it through ``allocate``).
        """
        tokens = request.all_token_ids
        matched, pages, node = self.index.match(tokens[:-1])
        matched = self._round(matched)
        self.queried_tokens += len(tokens)
        full = matched // self.page_size
        self.index.lock(node)
        request.cache_node = node
        request.pages = list(pages[:full])
        self.pool.retain(request.pages)
        copy = None
        if matched % self.page_size:
            if self.pool.num_free == 0:
                self.index.evict(1)  # the locked path is safe
            if self.pool.num_free == 0:
                matched = full * self.page_size  # no page for the copy: reuse whole pages only
            else:
                dst = self.pool.allocate(1)[0]
                copy = (pages[full], dst)
                request.pages.append(dst)
        request.num_computed_tokens = matched
        request.num_cached_tokens = matched
        self.hit_tokens += matched
        return copy

    def unattach(self, request: Request) -> None:
        """Undoes ``attach`` for a request that could not be admitted after all (the
        scheduler releases its pages)."""
        self.detach(request)
        self.hit_tokens -= request.num_cached_tokens
        self.queried_tokens -= request.num_tokens
        request.num_cached_tokens = 0

    def publish(self, request: Request) -> None:
        """Caches the request's computed tokens and moves its lock to their node."""
        n = request.num_computed_tokens
        if n == 0:
            return
        leaf = self.index.insert(request.all_token_ids[:n], request.pages)
        self.index.lock(leaf)
        if request.cache_node is not None:
            self.index.unlock(request.cache_node)
        request.cache_node = leaf

    def detach(self, request: Request) -> None:
        if request.cache_node is not None:
            self.index.unlock(request.cache_node)
            request.cache_node = None

    def clear(self) -> None:
        """Drops every cached prefix no request holds (after the KV cache was lost, their
        pages hold nothing valid)."""
        self.index.evict(self.pool.num_pages)

    def evict(self, num_free_pages: int) -> None:
        """Frees pages by evicting LRU unreferenced prefixes until ``num_free_pages`` are free."""
        self.index.evict(num_free_pages)
