"""OpenAI's `logprobs` shapes, chat's and completions', built from the engine's TokenLogprob rows."""
from __future__ import annotations

from specserve.core import TokenLogprob

# JSON has no -inf; vLLM reports a token the model rules out with this floor too.
_FLOOR = -9999.0


class TokenStrings:
    """Each token id's text decoded alone, as vLLM shows it in logprobs (a token that holds part of a character
    shows U+FFFD); cached, as the same ids come back in every top list."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"
            self._cache[token_id] = text
        return text


def _value(logprob: float) -> float:
    return max(logprob, _FLOOR)


def chat_logprobs(rows: list[TokenLogprob], strings: TokenStrings) -> dict:
    """`choices[i].logprobs` of a chat completion (or of one chunk of its stream)."""
    def entry(token_id: int, logprob: float) -> dict:
        token = strings(token_id)
        return {"token": token, "logprob": _value(logprob), "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(row.token_id, row.logprob), "top_logprobs": [entry(t, lp) for t, lp in row.top]}
                        for row in rows]}


def completion_logprobs(rows: list[TokenLogprob], strings: TokenStrings, text_offset: int = 0) -> dict:
    """`choices[i].logprobs` of a completion (or of one chunk of its stream, whose first token starts at
    `text_offset` characters into the choice's text). Each top dict holds the chosen token and the top
    alternatives, best first, as in vLLM and OpenAI."""
    tokens, offsets = [], []
    for row in rows:
        tokens.append(strings(row.token_id))
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    top = [{strings(t): _value(lp) for t, lp in sorted(((row.token_id, row.logprob), *row.top), key=lambda e: -e[1])}
           for row in rows]
    return {"tokens": tokens, "token_logprobs": [_value(row.logprob) for row in rows], "top_logprobs": top,
            "text_offset": offsets}


def total_logprob(rows: list[TokenLogprob]) -> float:
    """A choice's score for best_of: the sum of its tokens' log-probabilities."""
    return sum(row.logprob for row in rows)
