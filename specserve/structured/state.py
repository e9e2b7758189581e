"""One request's grammar state: an xgrammar GrammarMatcher over the tokens the request has emitted, and the
token masks it allows next: for the request itself, for each node of a draft tree (verification), and for each
draft path the search extends (drafting). Drafts never move the state for good: masks along a path are filled
after accepting the path's tokens, which are rolled back straight after, so the state always equals a fresh
matcher fed the emitted tokens. It also gives the tokens the grammar forces next (`forced_tokens`), which a
step verifies as drafts.

Masks are int32 bitmasks, one row of ceil(V / 32) words per logit row (bit j of word w: token 32 w + j
allowed), applied in sampling/grammar_mask.py.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class GrammarState:
    def __init__(self, compiled_grammar, vocab_size: int, stop_token_ids: tuple[int, ...],
                 encode: Callable[[str], list[int]] | None = None) -> None:
        """`encode`: the tokenizer's text -> token ids, without special tokens (for forced strings)."""
        import xgrammar

        self.vocab_size = vocab_size
        self.encode = encode
        self.matcher = xgrammar.GrammarMatcher(compiled_grammar, override_stop_tokens=list(stop_token_ids) or None)
        self.num_words = (vocab_size + 31) // 32

    def accept(self, token: int) -> bool:
        """Advances over an emitted token; False (state unchanged) if the grammar forbids it."""
        return self.matcher.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        """The grammar has accepted a stop token: nothing may follow."""
        return self.matcher.is_terminated()

    def empty_masks(self, num_rows: int) -> torch.Tensor:
        """[num_rows, words] int32, every token allowed."""
        return torch.full((num_rows, self.num_words), -1, dtype=torch.int32)

    def next_mask(self) -> torch.Tensor:
        """[1, words]: what may follow the emitted tokens."""
        masks = self.empty_masks(1)
        self.matcher.fill_next_token_bitmask(masks, 0)
        return _unconstrain_empty(masks)

    def forced_tokens(self, limit: int) -> list[int]:
        """The tokens the grammar forces after the emitted tokens, at most `limit`, to verify as drafts: the
        string it forces (xgrammar's jump-forward string: a schema's keys and punctuation) as the tokenizer
        encodes it, and a token it forces on its own (the one its mask allows: a stop token at the end). The
        model may split a forced string otherwise (`":` against `"` then `:`), so verification may reject a
        token of it, and output stays that of plain decoding either way; a token the grammar forbids ends the
        span. The state is left as it was."""
        forced: list[int] = []
        while len(forced) < limit and not self.matcher.is_terminated():
            taken = 0
            for token in self._forced_next()[: limit - len(forced)]:
                if not self.matcher.accept_token(token):
                    break
                forced.append(token)
                taken += 1
            if not taken:
                break
        self.rollback(len(forced))
        return forced

    def _forced_next(self) -> list[int]:
        """The forced text, encoded; else the one token the mask allows, looked for only where no text is
        forced and the grammar may end (a lone token without text is a stop token), or without a tokenizer."""
        if self.encode is None:
            return self._only_allowed()
        text = self.matcher.find_jump_forward_string()
        if text:
            return self.encode(text)
        return self._only_allowed() if self.matcher.is_completed() else []

    def _only_allowed(self) -> list[int]:
        """[the token], where the grammar allows exactly one token next; else []."""
        masks = self.empty_masks(1)
        self.matcher.fill_next_token_bitmask(masks, 0)
        token = _only_token(masks[0])
        return [token] if token is not None and token < self.vocab_size else []

    def path_masks(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """[len(paths), words]: what may follow the emitted tokens and then each path of drafts. A path the
        grammar forbids (or one ending in a stop token) leaves its row unconstrained: its tokens are never
        accepted, so its row never decides anything."""
        masks = self.empty_masks(len(paths))
        for row, path in enumerate(paths):
            accepted = 0
            for token in path:
                if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                    break
                accepted += 1
            if accepted == len(path) and not self.matcher.is_terminated():
                self.matcher.fill_next_token_bitmask(masks, row)
            self.rollback(accepted)
        return _unconstrain_empty(masks)

    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """[N, words] for a draft tree (tokens[0] the root, already emitted; parents[i] < i): row i is what may
        follow node i, the state after the drafts on the path to it. Rows of nodes the grammar forbids (and of
        their descendants) stay unconstrained, as in `path_masks`. xgrammar walks the tree in one call, rolling
        back as it goes."""
        n = len(tokens)
        first_child, next_sibling = [-1] * n, [-1] * n
        for node in range(n - 1, 0, -1):  # later siblings first, so each link points at the next one
            next_sibling[node] = first_child[parents[node]]
            first_child[parents[node]] = node
        masks = torch.zeros((n, self.num_words), dtype=torch.int32)
        self.matcher.traverse_draft_tree(torch.tensor(first_child, dtype=torch.int64),
                                         torch.tensor(next_sibling, dtype=torch.int64),
                                         torch.tensor(tokens, dtype=torch.int64), masks)
        return _unconstrain_empty(masks)


def _only_token(mask: torch.Tensor) -> int | None:
    """The token of a one-row bitmask with exactly one bit set, else None."""
    words = mask.nonzero()
    if len(words) != 1:
        return None
    word = int(words[0, 0])
    bits = int(mask[word]) & 0xFFFFFFFF
    if bits & (bits - 1):
        return None
    return 32 * word + bits.bit_length() - 1


def _unconstrain_empty(masks: torch.Tensor) -> torch.Tensor:
    """Rows that allow nothing (unreachable nodes, a state past its stop token) allow everything instead, so no
    row is all -inf: such rows are never sampled from, and this keeps their softmax finite."""
    view = masks.numpy()  # host masks, one call per fill: numpy's small reductions carry less overhead
    empty = ~view.any(axis=1)
    if empty.any():
        view[empty] = -1
    return masks
