"""The KV page allocator: pure Python bookkeeping over page ids; the tensors live in the runner.

A page is in one of three states:
- free;
- in use, by one or more owners (requests): a page of a cached prefix is shared by every request that hit it;
- idle: held by the prefix index (kv/prefix.py) with no owner left, kept for a later hit until the pool runs
  short. Idle pages count as free for allocation: the least recently used is evicted when a page is needed.

A page goes back to the free list (or to idle) exactly once, when its last owner frees it; a page in use is never
evicted.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable


class OutOfPages(Exception):
    pass


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("need at least one page of at least one token")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._users: dict[int, set[str]] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._cached: set[int] = set()  # pages the prefix index holds, in use or idle
        # Set by the prefix index: drops a page from the index and returns it with every page that hangs on it
        # (its children could no longer be reached).
        self._evict: Callable[[int], list[int]] | None = None
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: free ones, and idle cached ones it would evict."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return len(self._users)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def cached_pages(self) -> set[int]:
        return set(self._cached)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, owner: str, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfPages(f"{owner} needs {count} pages, {self.num_free} free")
        pages = []
        for _ in range(count):
            if not self._free:
                self._evict_least_recent()
            page = self._free.popleft()
            self._users[page] = {owner}
            pages.append(page)
        return pages

    def share(self, owner: str, pages: list[int]) -> None:
        """`owner` uses cached `pages` too (a prefix hit); an idle page is back in use."""
        for page in pages:
            if page not in self._cached:
                raise RuntimeError(f"page {page} shared by {owner} but not cached")
            users = self._users.setdefault(page, set())
            if owner in users:
                raise RuntimeError(f"page {page} shared twice by {owner}")
            users.add(owner)
            self._idle.pop(page, None)

    def free(self, owner: str, pages: list[int]) -> None:
        """`owner` is done with `pages`. The last owner's release frees a page, or leaves a cached one idle.
        Released last page first, so that a prefix's tail is evicted before its head."""
        for page in reversed(pages):
            users = self._users.get(page)
            if users is None or owner not in users:
                raise RuntimeError(f"page {page} freed by {owner} but used by {sorted(users or ())}")
            users.remove(owner)
            if users:
                continue
            del self._users[page]
            if page in self._cached:
                self._idle[page] = None
            else:
                self._free.append(page)

    def cache(self, page: int) -> None:
        """The prefix index holds `page` (in use now): when its owners are done it stays, idle."""
        if page not in self._users:
            raise RuntimeError(f"page {page} cached while no request uses it")
        self._cached.add(page)

    def set_evictor(self, evict: Callable[[int], list[int]]) -> None:
        self._evict = evict

    def _evict_least_recent(self) -> None:
        page = next(iter(self._idle))
        dropped = self._evict(page) if self._evict is not None else [page]
        for dropped_page in dropped:
            if dropped_page not in self._idle:
                raise RuntimeError(f"evicting page {dropped_page}, which is in use or not cached")
            del self._idle[dropped_page]
            self._cached.discard(dropped_page)
            self._free.append(dropped_page)
        self.num_evicted += len(dropped)

    def users(self, page: int) -> set[str]:
        return set(self._users.get(page, ()))

    def owned_by(self, owner: str) -> list[int]:
        return [p for p, users in self._users.items() if owner in users]

    def check_invariants(self) -> None:
        """Every page is exactly one of free, in use (with at least one owner) or idle; idle pages are cached."""
        free, used, idle = set(self._free), self._users.keys(), self._idle.keys()
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & used and not free & idle and not used & idle, "a page is in two states"
        assert len(free) + len(used) + len(idle) == self.num_pages, "a page went missing"
        assert all(self._users.values()), "a page in use has no owner"
        assert idle <= self._cached and not free & self._cached, "an idle page is not cached, or a free one is"
