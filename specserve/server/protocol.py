"""OpenAI request and response shapes (the subset specserve serves)."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


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
    repetition_penalty: float = 1.0
    # {"token id": bias}; its keys, values and ids are checked in server/api.py, so errors name `logit_bias`.
    logit_bias: dict | None = None
    # Structured output (server/structured.py): OpenAI's response_format, or one of SGLang's fields.
    response_format: dict | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None  # the schema's JSON text

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        _reject_lone_surrogates(data)
        return data

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class ChatMessage(BaseModel):
    # Any other role would go into the template verbatim, "system<|im_end|>..." included; `developer` is read as
    # `system` (server/api.py). `tool` messages and assistant `tool_calls` are read by server/tools.py.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Tool calling (server/tools.py).
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # Accepted so that they can be refused by name (server/api.py); defaults are no-ops.
    functions: list | None = None  # the deprecated form of tools
    function_call: str | dict | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16
    logprobs: int | None = None  # top alternatives per token; 0: the chosen token's only
    echo: bool = False
    best_of: int | None = None  # None: n
    suffix: str | None = None  # refused by name unless empty (vLLM has no suffix either)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # Extensions: speculative decoding for this request (zero / null when it never drafted).
    spec_steps: int = 0  # speculative steps (each verifies one draft tree)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_mean_acceptance_length: float | None = None
    spec_acceptance_simulated: bool = False  # --speculative-simulate-accept-len: not the model's output


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error the server answers, whatever its status (OpenAI's form)."""
    error: ErrorDetail


def _reject_lone_surrogates(data) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates, which are not Unicode and make the tokenizer raise.
    Walks the body without recursion, so a deeply nested body cannot exhaust the stack."""
    stack = [((), data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                at = ".".join(map(str, where)) or "body"
                raise ValueError(f"{at} holds a lone surrogate ({value[exc.start]!r}), which is not valid Unicode")
        elif isinstance(value, dict):
            stack.extend(((*where, k), v) for k, v in value.items())
            stack.extend(((*where, "<key>"), k) for k in value)
        elif isinstance(value, list):
            stack.extend(((*where, i), v) for i, v in enumerate(value))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
