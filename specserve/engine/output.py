"""Incremental detokenization and stop strings, run outside the engine core (front-end side)."""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.core import SamplingParams, TokenLogprob


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    # Set when the request stops on a stop string, which the engine core must then be told to abort.
    stopped_by_string: bool = False
    num_spec_steps: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    # One per output token where the request asked (SamplingParams.logprobs), else None.
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per speculative step: accepted drafts plus the bonus token, cut at a stop."""
        if not self.num_spec_steps:
            return None
        return (self.num_accepted_tokens + self.num_spec_steps) / self.num_spec_steps

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Detokenizer:
    """Decodes a growing token list into text, holding back bytes that do not yet form a character."""

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # tokens before this give context only, so spaces decode right
        self.read_offset = 0  # tokens before this are already in `text`
        self.text = ""

    def push(self, new_token_ids: list[int]) -> str:
        """Appends tokens; returns the new text that is safe to emit."""
        self.token_ids.extend(new_token_ids)
        if self.tokenizer is None:
            return ""
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset:], skip_special_tokens=skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta


def find_stop(text: str, new_chars: int, stops: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts, searching only where new text could complete one."""
    if not stops:
        return None
    window_start = max(0, len(text) - new_chars - max(len(s) for s in stops) + 1)
    hits = [i for i in (text.find(s, window_start) for s in stops) if i >= 0]
    return min(hits) if hits else None


class OutputTracker:
    """Folds engine deltas into per-request outputs: text, stop strings and finish reasons."""

    def __init__(self, tokenizer, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.output = RequestOutput(request_id, list(prompt_token_ids),
                                    logprobs=[] if params.logprobs is not None else None)
        self.detok = Detokenizer(tokenizer, params)
        self.params = params

    def update(self, new_token_ids: list[int], finish_reason: str | None, step=None) -> str:
        """Returns the text delta to emit for these tokens. `step` (a TokenDelta) carries speculation counts."""
        out = self.output
        if out.finished:
            return ""
        if step is not None:
            out.num_cached_tokens = step.num_cached_tokens
        if step is not None and step.step_accepted is not None:
            out.num_spec_steps += 1
            out.num_drafted_tokens, out.num_accepted_tokens = step.num_drafted_tokens, step.num_accepted_tokens
        out.token_ids.extend(new_token_ids)
        if out.logprobs is not None and step is not None and step.logprobs:
            out.logprobs.extend(step.logprobs)
        text = self.detok.push(new_token_ids)
        stop_at = find_stop(self.detok.text, len(text), self.params.stop)
        if stop_at is not None:
            text = text[: max(0, len(text) - (len(self.detok.text) - stop_at))]
            stop_end = stop_at + max(len(s) for s in self.params.stop if self.detok.text.startswith(s, stop_at))
            self._drop_tokens_after(stop_end, len(new_token_ids))
            out.text = self.detok.text[:stop_at]
            out.finish_reason = "stop"
            out.stopped_by_string = True
            return text
        out.text = self.detok.text
        if finish_reason is not None:
            out.finish_reason = finish_reason
        return text

    def _drop_tokens_after(self, text_end: int, num_new: int) -> None:
        """A multi-token step (speculation) can run past a stop string: keep tokens only up to the one
        that completes it."""
        ids = self.output.token_ids
        skip = self.params.skip_special_tokens
        for n in range(len(ids) - num_new + 1, len(ids)):
            if len(self.detok.tokenizer.decode(ids[:n], skip_special_tokens=skip)) >= text_end:
                del ids[n:]
                if self.output.logprobs is not None:
                    del self.output.logprobs[n:]
                return
