"""Fixed-size KV pages: a free list and per-page reference counts (plain Python).

Page 0 is reserved as scratch (padding tokens write there) and is never handed out.
A page is free (refcount 0, on the free list) or in use (refcount >= 1).
"""

from __future__ import annotations

from collections import deque

from jaxserve.errors import JaxServeError


class OutOfPagesError(JaxServeError):
    """The pool cannot satisfy an allocation."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcounts = [0] * num_pages
        self._free: deque[int] = deque(range(1, num_pages))

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.num_usable - self.num_free

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self.refcounts[p] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcounts[p] > 0, f"retain of free page {p}"
            self.refcounts[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcounts[p] > 0, f"release of free page {p}"
            self.refcounts[p] -= 1
            if self.refcounts[p] == 0:
                self._free.append(p)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert 0 not in free and self.refcounts[0] == 0, "scratch page 0 was handed out"
        for p in range(1, self.num_pages):
            assert self.refcounts[p] >= 0, f"page {p} has a negative refcount"
            assert (self.refcounts[p] == 0) == (p in free), f"page {p}: refcount {self.refcounts[p]} vs free list"
        assert self.num_free + self.num_in_use == self.num_usable
