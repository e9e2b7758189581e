"""OpenAI request and response shapes (the subset specserve serves)."""
from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI clients send extras; known fields are type-checked strictly.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16
    echo: bool = False


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Extensions: speculative decoding for this request (zero / null when it never drafted).
    spec_steps: int = 0  # speculative steps (each verifies one draft tree)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_mean_acceptance_length: float | None = None
    spec_acceptance_simulated: bool = False  # --speculative-simulate-accept-len: not the model's output


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
