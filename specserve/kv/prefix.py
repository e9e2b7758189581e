"""The prefix index: full pages of computed KV, found again by the tokens that made them. Pure Python.

A tree of pages, one page per node, stored as a dict: a node's key is its parent page (-1 at the root) and the
page's tokens plus the first token of the next page. Keys are exact token tuples, so no hash can collide; a
page-granular tree rather than a token-granular radix tree, because pages are the unit that is shared.

Why the next token is in the key: an EAGLE-3 head's KV at position p reads the embedding of token p + 1 (and the
head's taps at p are the target's own). A page's head KV is therefore valid only for continuations that agree on
the token after it, and keying on it makes every hit serve target KV, taps and head KV that are all valid for
the request (SGLang keys its radix tree on token pairs for the same reason).

The scheduler indexes a page once the target has computed all of it (its KV, and an EAGLE-3 head's taps, which
the target's steps store whether or not anything drafts), and marks it drafted once the drafter has computed
it too. A hit serves draft KV only over its leading drafted pages; the drafter catches up on the rest, as after
any spell without drafting. So a server whose drafting is paused (the adaptive plan under load) still caches
and reuses prompts. This module stores the mark; it knows nothing of drafters.

Evicting a page drops the pages under it too: their keys name it as parent, and its id is about to be reused.
No page under an idle page is in use, since a request holds every page of its prefix.
"""
from __future__ import annotations

from specserve.kv.pages import PageAllocator

ROOT = -1


class PrefixCache:
    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._pages: dict[tuple[int, tuple[int, ...]], int] = {}
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._children: dict[int, set[int]] = {}
        self._drafted: set[int] = set()  # indexed pages whose draft KV is computed
        allocator.set_evictor(self._drop)
        # Over every admission: tokens to compute, and tokens served from the cache instead.
        self.queried_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._key)

    def match(self, token_ids: list[int]) -> list[int]:
        """The cached pages of the longest indexed prefix of `token_ids` (every page keyed by its next token,
        so at least the last token is left to compute)."""
        size, parent, pages = self.page_size, ROOT, []
        while (len(pages) + 1) * size < len(token_ids):
            start = len(pages) * size
            page = self._pages.get((parent, tuple(token_ids[start:start + size + 1])))
            if page is None:
                break
            pages.append(page)
            parent = page
        return pages

    def insert(self, parent: int, tokens: list[int], page: int) -> int:
        """Indexes `page` (in use, fully computed) under `parent` with its tokens and the next one. Returns the
        page that holds that key: `page`, or one indexed before it with the same contents (requests that computed
        the same prefix at once), which the caller then uses in its place."""
        if len(tokens) != self.page_size + 1:
            raise ValueError(f"a page's key is {self.page_size + 1} tokens, got {len(tokens)}")
        if parent != ROOT and parent not in self._key:
            raise RuntimeError(f"parent page {parent} is not indexed")
        key = (parent, tuple(tokens))
        held = self._pages.get(key)
        if held is not None:
            return held
        if page in self._key:
            raise RuntimeError(f"page {page} is indexed twice")
        self.allocator.cache(page)
        self._pages[key] = page
        self._key[page] = key
        self._children.setdefault(parent, set()).add(page)
        return page

    def mark_drafted(self, page: int) -> None:
        if page not in self._key:
            raise RuntimeError(f"page {page} is not indexed")
        self._drafted.add(page)

    def is_drafted(self, page: int) -> bool:
        return page in self._drafted

    def drafted_prefix(self, pages: list[int]) -> int:
        """How many of `pages` (a match, in order) lead with draft KV."""
        count = 0
        while count < len(pages) and pages[count] in self._drafted:
            count += 1
        return count

    def record(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def _drop(self, page: int) -> list[int]:
        """Removes `page` and every page under it from the index; returns them (the allocator frees them)."""
        dropped, stack = [], [page]
        while stack:
            node = stack.pop()
            parent, _ = key = self._key.pop(node)
            del self._pages[key]
            self._drafted.discard(node)
            self._children[parent].discard(node)
            if not self._children[parent]:
                del self._children[parent]
            stack.extend(self._children.get(node, ()))
            dropped.append(node)
        return dropped

    def check_invariants(self) -> None:
        """Every indexed page is cached by the allocator, and its parent indexed."""
        assert len(self._pages) == len(self._key), "an index entry has no page"
        assert set(self._key) == self.allocator.cached_pages, "the index and the allocator disagree on cached pages"
        assert self._drafted <= set(self._key), "a page marked drafted is not indexed"
        for page, (parent, _) in self._key.items():
            assert parent == ROOT or parent in self._key, f"page {page} hangs on a dropped parent"
