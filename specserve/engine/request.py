"""A request's state is two counters over one token list, not a phase flag.

`num_computed_tokens` counts tokens whose KV is in the cache; `num_tokens` counts tokens known (prompt plus
outputs). Prefill, chunked prefill, decode and recompute after preemption are all "compute the gap".
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specserve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # client went away or asked to cancel
    ERROR = "error"  # the engine failed while computing this request


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context length at admission
    arrival_index: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens whose KV the draft model holds (it lags the target after steps that did not draft).
    num_draft_computed_tokens: int = 0
    page_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Speculation counters: steps that drafted, tokens drafted, drafts accepted.
    num_spec_steps: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    # For the adaptive draft plan (spec/plan.py): drafting steps since this request last drafted.
    steps_since_drafting: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
