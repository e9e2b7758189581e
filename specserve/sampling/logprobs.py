"""The target's log-probabilities of emitted tokens, from its raw logits (before penalties, bias and
temperature: vLLM's default "raw" mode), with the top alternatives a request asks for. With speculation the
rows come from the verify pass, one per emitted token: the row of the tree node the token follows."""
from __future__ import annotations

import torch

from specserve.core import TokenLogprob


class LogprobRows:
    """Log-probabilities of one token per logit row, left on the device until `to_host`, so a plain step's
    read-back stays its one synchronisation."""

    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor, num_top: list[int]) -> None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        self.chosen = logprobs.gather(1, tokens.view(-1, 1).long())[:, 0]
        self.num_top = num_top
        self.top = logprobs.topk(max(num_top), dim=-1) if max(num_top, default=0) > 0 else None
        self.tokens = tokens

    def to_host(self) -> list[TokenLogprob]:
        tokens, chosen = self.tokens.tolist(), self.chosen.tolist()
        top_values = self.top.values.tolist() if self.top is not None else None
        top_ids = self.top.indices.tolist() if self.top is not None else None
        rows = []
        for i, k in enumerate(self.num_top):
            top = tuple(zip(top_ids[i][:k], top_values[i][:k])) if k else ()
            rows.append(TokenLogprob(tokens[i], chosen[i], top))
        return rows
