"""The KV page allocator: pure Python bookkeeping over page ids; the tensors live in the runner."""
from __future__ import annotations

from collections import deque


class OutOfPages(Exception):
    pass


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("need at least one page of at least one token")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, owner: str, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(f"{owner} needs {count} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._owner[page] = owner
        return pages

    def free(self, owner: str, pages: list[int]) -> None:
        for page in pages:
            if self._owner.get(page) != owner:
                raise RuntimeError(f"page {page} freed by {owner} but owned by {self._owner.get(page)}")
            del self._owner[page]
            self._free.append(page)

    def owned_by(self, owner: str) -> list[int]:
        return [p for p, o in self._owner.items() if o == owner]

    def check_invariants(self) -> None:
        """Every page is either free or owned, exactly once."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & self._owner.keys(), "a page is both free and owned"
        assert len(free) + len(self._owner) == self.num_pages, "a page went missing"
