from __future__ import annotations

import pytest

from jaxserve.engine.page_pool import OutOfPagesError, PagePool


def test_allocate_release_refcounts_and_scratch_page():
    pool = PagePool(num_pages=6, page_size=16)
    assert pool.num_usable == 5 and pool.num_free == 5
    a = pool.allocate(3)
    assert 0 not in a and pool.num_in_use == 3
    pool.check_integrity()
    pool.retain(a[:1])
    pool.release(a)
    assert pool.num_in_use == 1 and pool.refcounts[a[0]] == 1
    pool.check_integrity()
    with pytest.raises(OutOfPagesError):
        pool.allocate(5)
    pool.release(a[:1])
    assert pool.num_free == 5
    pool.check_integrity()
    assert pool.pages_needed(0) == 0 and pool.pages_needed(16) == 1 and pool.pages_needed(17) == 2


def test_double_release_is_caught():
    pool = PagePool(num_pages=4, page_size=8)
    pages = pool.allocate(1)
    pool.release(pages)
    with pytest.raises(AssertionError):
        pool.release(pages)
