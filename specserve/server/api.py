"""OpenAI-compatible HTTP routes. Validation happens here, before anything reaches the engine."""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specserve import __version__
from specserve.config import ServerConfig
from specserve.engine.async_engine import AsyncEngine, EngineError, Generation, QueueFull
from specserve.engine.output import RequestOutput
from specserve.core import MAX_INT64, MAX_LOGPROBS, SamplingParams
from specserve.llm import chat_prompt_ids
from specserve.server.gateway import install_gateway_routes
from specserve.server.limits import BodyLimit
from specserve.server.logprobs import TokenStrings, chat_logprobs, completion_logprobs, total_logprob
from specserve.server.metrics import Metrics
from specserve.server.structured import ConstraintError, checked_constraint, constraint_of, front_end_grammars
from specserve.server import tools as tool_calls
from specserve.server.protocol import PromptTokensDetails
from specserve.server.protocol import (ChatCompletionRequest, CompletionRequest, ErrorResponse, Usage, error_body,
                                       new_id, now)

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def build_app(config: ServerConfig, engine: AsyncEngine, metrics: Metrics, model_name: str,
              vocab_size: int | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        yield
        engine.shutdown()

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    _install_error_handlers(app)
    # Inside the key check, so a client without the key cannot make the server read a body.
    app.add_middleware(BodyLimit, max_bytes=config.max_request_body_bytes, read_timeout_s=config.request_read_timeout)
    if config.api_key:
        _install_auth(app, config.api_key)
    limit = config.engine.scheduler.max_running_requests + config.engine.scheduler.max_queued_requests
    simulated = config.engine.spec.simulate_accept_len is not None

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": engine.state, "error": engine.error}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": now(), "owned_by": "specserve",
                "max_model_len": engine.context_length}
        return {"object": "list", "data": [card]}

    @app.get("/server_info")
    async def server_info() -> dict:
        """What a client, a gateway or a benchmark record needs to know of this server (SGLang has
        /get_server_info): the model's name, the limits a request must keep to, and how it drafts. No file
        paths and no device settings."""
        spec, sched = config.engine.spec, config.engine.scheduler
        return {"model": model_name, "version": __version__, "max_model_len": engine.context_length,
                "max_running_requests": sched.max_running_requests, "max_queued_requests": sched.max_queued_requests,
                "max_request_body_bytes": config.max_request_body_bytes,
                "speculative_acceptance_simulated": simulated,
                "spec": {"algorithm": spec.algorithm, "num_steps": spec.num_steps, "eagle_topk": spec.eagle_topk,
                         "num_draft_tokens": spec.num_draft_tokens, "adaptive": spec.adaptive, "policy": spec.policy,
                         "simulate_accept_len": spec.simulate_accept_len},
                # The names SGLang's /server_info gives them, which a gateway reads (server/gateway.py).
                "served_model_name": model_name, "context_length": engine.context_length, "dp_size": 1,
                "max_total_tokens": engine.stats.pages_total * config.engine.cache.page_size if engine.stats else None}

    app.add_api_route("/get_server_info", server_info, methods=["GET"])  # SGLang's older name
    install_gateway_routes(app, config, engine, metrics, model_name)

    # Tokenizing a long prompt takes a while: it runs on a thread of its own, so /health and the streams in flight
    # keep their event loop. One thread, as the fast tokenizer's split_special_tokens is state (specserve/llm.py).
    tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
    longest = _longest_token(engine.tokenizer)
    strings = TokenStrings(engine.tokenizer)
    grammars = front_end_grammars(engine.tokenizer, vocab_size or len(engine.tokenizer))
    tool_format = tool_calls.tool_format(engine.tokenizer)

    async def tokenize(fn, *args) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(tokenizing, fn, *args)

    @app.post("/v1/completions", responses=_ERROR_RESPONSES)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        _check_model(body.model, model_name)
        _check_request(body, vocab_size)
        _check_choices(body, limit)
        await tokenize(_check_constraint, body, grammars)
        prompt_ids = await tokenize(_completion_prompt, engine.tokenizer, body.prompt, engine.context_length, longest)
        echo = _echo_text(engine.tokenizer, body.prompt, prompt_ids) if body.echo else ""
        return await _serve(raw, engine, metrics, limit, body, prompt_ids, chat=False, model_name=model_name,
                            simulated=simulated, strings=strings, echo=echo)

    @app.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        _check_model(body.model, model_name)
        _check_request(body, vocab_size)
        _check_choices(body, limit)
        await tokenize(_check_constraint, body, grammars)
        tools = await tokenize(_check_tools, body, tool_format, grammars)
        prompt_ids = await tokenize(_chat_prompt, engine.tokenizer, body, engine.context_length, longest, tools)
        return await _serve(raw, engine, metrics, limit, body, prompt_ids, chat=True, model_name=model_name,
                            simulated=simulated, strings=strings, tools=tools)

    return app


# -- validation ---------------------------------------------------------------
def _check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(404, f"The model `{requested}` does not exist; this server serves `{served}`.",
                       "NotFoundError", "model")


def _longest_token(tokenizer) -> int:
    """The most characters of text one token stands for, at most (a byte-level token's string has a character
    per byte, and a text has no more characters than bytes)."""
    if tokenizer is None:
        return 1
    return max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t is not None)


def _check_chars(chars: int, context: int, longest: int, param: str) -> None:
    """Refuses, before tokenizing it, a text too long to be under `context` tokens: it has at least
    chars / longest tokens. The factor 4 leaves room for normalizers that join characters (NFKC)."""
    if chars > 4 * context * longest:
        raise APIError(400, f"the prompt has {chars} characters, more than a context of {context} tokens holds",
                       param=param)


def _completion_prompt(tokenizer, prompt, context: int, longest: int) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send token ids", param="prompt")
        _check_chars(len(prompt), context, longest, "prompt")
        return tokenizer.encode(prompt)
    return list(prompt)


def _chat_prompt(tokenizer, body: ChatCompletionRequest, context: int, longest: int,
                 tools: _Tools | None = None) -> list[int]:
    if tokenizer is None or tokenizer.chat_template is None:
        raise APIError(400, "this model has no chat template", param="messages")
    messages = [{"role": _ROLES[m.role], "content": _text_of(m.content),
                 **({"tool_calls": m.tool_calls} if m.tool_calls else {}),
                 **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})} for m in body.messages]
    _check_chars(sum(len(m["content"]) for m in messages), context, longest, "messages")
    template_tools, template_args = None, {}
    if tools is not None:
        try:
            messages = tool_calls.template_messages(messages, tools.format)
        except tool_calls.ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        if tools.tools and tools.format.native:
            template_tools = tools.tools
            if tools.format.thinks and tools.parses:  # the grammar has no thinking block (Qwen3): nor the prompt
                template_args = {"enable_thinking": False}
        elif tools.tools:
            messages = tool_calls.with_tool_system_prompt(messages, tools.tools)
    try:
        return chat_prompt_ids(tokenizer, messages, tools=template_tools, **template_args)
    except Exception as exc:  # jinja raises for conversations the template refuses
        raise APIError(400, f"chat template rejected the messages: {exc}", param="messages") from exc


# The roles a chat template is given. OpenAI's `developer` messages take the place of system messages; `tool`
# messages are rewritten for templates that know no such role (server/tools.py).
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclasses.dataclass(frozen=True)
class _Tools:
    """A chat request's tools: what the prompt shows, the grammar of the reply, and how to read calls back."""
    tools: list
    choice: object  # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    format: tool_calls.ToolFormat
    constraint: object  # core.Constraint, or None for "none"

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def _check_tools(body, fmt, grammars) -> _Tools | None:
    """The request's tools, checked and their grammar compiled (on the tokenizing thread), or None when it
    has neither tools nor messages about tool calls."""
    has_history = any(m.role == "tool" or m.tool_calls for m in body.messages)
    if not body.tools and body.tool_choice in (None, "none") and not has_history:
        return None
    try:
        tools, choice = tool_calls.checked_tools(body.tools, body.tool_choice)
        constraint = tool_calls.tool_constraint(tools, choice, fmt, body.parallel_tool_calls)
        if constraint is not None and constraint_of(body) is not None:
            raise tool_calls.ToolError("a request takes one output constraint: tool calls or response_format "
                                       "(regex, ebnf, json_schema), not both", param="tool_choice")
        if constraint is not None:
            grammars.compile(constraint)
    except tool_calls.ToolError as e:
        raise APIError(400, str(e), param=e.param) from None
    except ValueError as e:  # the grammar did not compile: a schema xgrammar cannot read
        raise APIError(400, f"tools: {e}", param="tools") from None
    return _Tools(tools, choice, fmt, constraint)


def _text_of(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported", param="messages")
        parts.append(part["text"])
    return "".join(parts)


def _check_request(body, vocab_size: int | None) -> None:
    """Refuses, before any tokenizing, what the server cannot honour: parameters it does not implement (by name,
    rather than ignoring them) and token ids the model has no embedding for."""
    for param, value, default in _unsupported(body):
        if value != default:  # NaN is unequal to everything: refused as well
            raise APIError(400, f"{param}={value!r} is not supported yet; leave it out or send {default!r}",
                           param=param)
    if vocab_size is not None and isinstance(body, CompletionRequest) and body.prompt \
            and isinstance(body.prompt[0], int):
        bad = next((t for t in body.prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="prompt")
    if getattr(body, "max_completion_tokens", None) is not None and body.max_completion_tokens < 1:
        raise APIError(400, f"max_completion_tokens must be at least 1, got {body.max_completion_tokens}",
                       param="max_completion_tokens")
    _check_logit_bias(body.logit_bias, vocab_size)
    _check_logprobs(body)


def _check_constraint(body, grammars) -> None:
    """Compiles the request's output constraint (on the tokenizing thread: a large schema takes a while), so an
    invalid one is a 400 that names what is wrong, before any compute."""
    try:
        checked_constraint(body, grammars)
    except ConstraintError as e:
        raise APIError(400, str(e), param=e.param) from None


def _check_logit_bias(bias: dict | None, vocab_size: int | None) -> None:
    """OpenAI's form: {"token id": bias in [-100, 100]}."""
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise APIError(400, f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})",
                           param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise APIError(400, f"logit_bias for token {key} must be a number in [-100, 100], got {value!r}",
                           param="logit_bias")


def _check_logprobs(body) -> None:
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
                           param="top_logprobs")
        return
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {body.logprobs}", param="logprobs")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs needs the prompt's log-probabilities, which this server does not "
                       "compute; send one or the other", param="echo")


def _check_choices(body, limit: int) -> None:
    """n choices (and best_of runs, of which the n best are returned) are that many requests to the engine:
    at most as many as the server may hold at once, and at most OpenAI's 128."""
    best_of = getattr(body, "best_of", None)
    most = min(limit, MAX_CHOICES)
    for param, value in (("n", body.n), ("best_of", best_of)):
        if value is not None and not 1 <= value <= most:
            raise APIError(400, f"{param} must be in [1, {most}], got {value}", param=param)
    if best_of is not None and best_of < body.n:
        raise APIError(400, f"best_of ({best_of}) must be at least n ({body.n})", param="best_of")
    if best_of is not None and best_of > body.n and body.stream:
        raise APIError(400, "best_of larger than n cannot stream: the best choices are known only at the end",
                       param="best_of")


def _unsupported(body) -> list[tuple[str, object, object]]:
    """(parameter, value sent, the value that does nothing) for each parameter accepted only at its no-op value.
    A parameter left out, or sent as null, counts as its no-op value."""
    def no_op(value, default):
        return default if value is None else value

    if isinstance(body, CompletionRequest):
        return [("suffix", body.suffix or "", "")]
    # The deprecated forms of tools and tool_choice.
    return [("functions", no_op(body.functions, []), []),
            ("function_call", no_op(body.function_call, "none"), "none")]


def _sampling_params(body, prompt_len: int, context: int) -> SamplingParams:
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty", param="prompt")
    if prompt_len >= context:
        raise APIError(400, f"the prompt has {prompt_len} tokens; the context length is {context}", param="prompt")
    # max_completion_tokens replaces max_tokens in OpenAI's chat API; null falls back to max_tokens, and 0 was
    # refused in _check_request rather than read as "unlimited".
    max_tokens = getattr(body, "max_completion_tokens", None)
    max_tokens = body.max_tokens if max_tokens is None else max_tokens
    if max_tokens is not None and max_tokens > context - prompt_len:
        raise APIError(
            400,
            f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds the context length {context}",
            param="max_tokens",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            min_p=body.min_p, seed=body.seed, stop=body.stop, stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias={int(token): float(bias) for token, bias in (body.logit_bias or {}).items()},
            logprobs=_logprobs_asked(body), constraint=constraint_of(body),
        )
    except ValueError as exc:
        param = next((name for name in _SAMPLING_FIELDS if str(exc).startswith(name)), None)
        raise APIError(400, str(exc), param=param) from exc


_SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
MAX_CHOICES = 128  # OpenAI's bound on n


def _logprobs_asked(body) -> int | None:
    """The top alternatives per token the client asked for; None: no logprobs."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def _echo_text(tokenizer, prompt, prompt_ids: list[int]) -> str:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt_ids) if tokenizer is not None else ""


# -- serving ------------------------------------------------------------------
async def _serve(raw: Request, engine: AsyncEngine, metrics: Metrics, limit: int, body, prompt_ids, *, chat: bool,
                 model_name: str, simulated: bool, strings: TokenStrings, echo: str = "",
                 tools: _Tools | None = None) -> Response:
    if not engine.is_healthy():
        raise APIError(503, "the model is still loading or the engine is down", "ServiceUnavailableError")
    params = _sampling_params(body, len(prompt_ids), engine.context_length)
    if tools is not None and tools.constraint is not None:
        params = dataclasses.replace(params, constraint=tools.constraint)
    _check_fits_in_pool(engine, len(prompt_ids), params)
    n = body.n
    runs = getattr(body, "best_of", None) or n
    if runs > n and params.logprobs is None:  # best_of ranks the runs by their log-probabilities
        run_params = dataclasses.replace(params, logprobs=0)
    else:
        run_params = params
    request_id = new_id("chatcmpl" if chat else "cmpl")
    # Admission: all runs or none. The check and the n generate() calls are one synchronous step, so no other
    # request is admitted in between.
    if engine.num_in_flight + runs > limit:
        return _queue_full(f"the server's request queue has no room for {runs} more requests; retry later")
    generations: list[Generation] = []
    try:
        for i in range(runs):
            run_id = request_id if runs == 1 else f"{request_id}-{i}"
            generations.append(engine.generate(run_id, prompt_ids, _seeded(run_params, i), max_in_flight=limit))
    except (QueueFull, EngineError) as exc:
        for generation in generations:
            await generation.aclose()
        if isinstance(exc, QueueFull):
            return _queue_full(str(exc))
        raise APIError(503, str(exc), "ServiceUnavailableError") from exc
    metrics.prompt_tokens.inc(len(prompt_ids) * runs)
    shape = _ChunkShape(request_id, model_name, chat, simulated, strings,
                        logprobs=params.logprobs is not None, echo=echo,
                        tool_format=tools.format if tools is not None and tools.parses else None)
    if body.stream:
        return StreamingResponse(_sse(generations, shape, body.include_usage), media_type="text/event-stream")
    return await _until_done_or_disconnect(raw, _collect(generations, shape, n))


def _queue_full(message: str) -> Response:
    response = _error_response(APIError(429, message, "RateLimitError"))
    response.headers["Retry-After"] = "1"
    return response


def _seeded(params: SamplingParams, i: int) -> SamplingParams:
    """The i-th of n runs: seed + i when a seed is given, so the n choices differ and the whole is reproducible."""
    if params.seed is None or i == 0:
        return params
    seed = params.seed + i
    return dataclasses.replace(params, seed=seed if seed <= MAX_INT64 else seed - MAX_INT64 - 1)


def _check_fits_in_pool(engine: AsyncEngine, prompt_len: int, params: SamplingParams) -> None:
    """A request that could not fit even in an empty KV pool is refused now, not after a 200."""
    capacity = engine.stats.pages_total * engine.config.cache.page_size
    needed = prompt_len + (params.max_tokens or engine.context_length - prompt_len)
    if needed > capacity:
        raise APIError(400, f"prompt plus max_tokens ({needed} tokens) exceeds the KV pool ({capacity} tokens)",
                       param="max_tokens")


async def _until_done_or_disconnect(raw: Request, work) -> Response:
    """Runs `work`, cancelling it (and so aborting the request) if the client hangs up first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(raw))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if task not in done:
        task.cancel()
        return Response(status_code=499)
    return task.result()


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class _ChunkShape:
    """Builds the response bodies and stream chunks of one request, whatever its number of choices."""

    def __init__(self, request_id: str, model: str, chat: bool, simulated: bool, strings: TokenStrings,
                 logprobs: bool = False, echo: str = "", tool_format=None) -> None:
        self.id, self.model, self.chat, self.created = request_id, model, chat, now()
        self.simulated = simulated  # acceptance is simulated: say so in every usage block
        self.strings = strings
        self.logprobs = logprobs  # the client asked for them (best_of may compute them for itself only)
        self.echo = echo  # completions' echo: the prompt's text, put before each choice's
        self.tool_format = tool_format  # chat with tools: replies are read for calls (server/tools.py)

    def _logprobs(self, rows, text_offset: int = 0) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(rows, self.strings)
        return completion_logprobs(rows, self.strings, text_offset)

    def chunk(self, index: int, text: str | None, finish: str | None, role: bool = False, rows=None,
              text_offset: int = 0, tool_calls: list | None = None) -> dict:
        logprobs = self._logprobs(rows, text_offset) if rows is not None else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [choice]}
        choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}

    def final(self, chosen: list[RequestOutput], every: list[RequestOutput]) -> dict:
        """The body for the `chosen` choices; usage counts `every` run (best_of's discarded ones too)."""
        choices = []
        for index, out in enumerate(chosen):
            logprobs = self._logprobs(out.logprobs or [])
            if self.chat:
                message, finish = {"role": "assistant", "content": out.text}, out.finish_reason
                if self.tool_format is not None:
                    message, finish = tool_calls.message_of(out.text, self.tool_format, finish)
                choices.append({"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs})
            else:
                choices.append({"index": index, "text": self.echo + out.text, "finish_reason": out.finish_reason,
                                "logprobs": logprobs})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": _usage(every, self.simulated).model_dump()}


def _usage(outputs: list[RequestOutput], simulated: bool) -> Usage:
    """One prompt, and the tokens and speculative steps of every run summed."""
    prompt = len(outputs[0].prompt_token_ids)
    completion = sum(len(out.token_ids) for out in outputs)
    steps = sum(out.num_spec_steps for out in outputs)
    drafted = sum(out.num_drafted_tokens for out in outputs)
    accepted = sum(out.num_accepted_tokens for out in outputs)
    cached = PromptTokensDetails(cached_tokens=max(out.num_cached_tokens for out in outputs))
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
        prompt_tokens_details=cached,
        spec_steps=steps, spec_draft_tokens=drafted, spec_accepted_tokens=accepted,
        spec_mean_acceptance_length=(accepted + steps) / steps if steps else None,
        spec_acceptance_simulated=simulated,
    )


async def _run_to_end(generation: Generation) -> RequestOutput:
    output = None
    try:
        async for _, output in generation:
            pass
    finally:
        await generation.aclose()  # on cancellation this aborts the request and frees its pages now, not at GC
    return output


async def _collect(generations: list[Generation], shape: _ChunkShape, n: int) -> Response:
    tasks = [asyncio.ensure_future(_run_to_end(g)) for g in generations]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # one run failed, or the client left: the others stop too
        for task in tasks:
            task.cancel()
        for generation in generations:
            await generation.aclose()
    failure = next((t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
    if isinstance(failure, ValueError):  # the engine refused the request
        return _error_response(APIError(400, str(failure)))
    if isinstance(failure, EngineError):
        return _error_response(APIError(500, f"generation failed: {failure}", "InternalServerError"))
    if failure is not None:
        raise failure
    outputs = [task.result() for task in tasks]
    if any(out.finish_reason == "error" for out in outputs):
        return _error_response(APIError(500, "the engine failed on this request", "InternalServerError"))
    chosen = outputs
    if len(outputs) > n:  # best_of: the n runs of highest total log-probability, best first
        chosen = sorted(outputs, key=lambda out: total_logprob(out.logprobs), reverse=True)[:n]
    return JSONResponse(shape.final(chosen, outputs))


_RUN_DONE = object()


async def _sse(generations: list[Generation], shape: _ChunkShape, include_usage: bool) -> AsyncIterator[str]:
    """One stream for all choices: each run's chunks as they come, marked by index. A chunk carries the
    logprobs of every token since its choice's last chunk (a token that ends inside a character adds no text)."""
    arrivals: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        # The output object keeps changing while its chunk waits in the queue: take what this step said now.
        try:
            async for text, output in generation:
                rows = None if output.logprobs is None else len(output.logprobs)
                arrivals.put_nowait((index, text, (output.finish_reason, rows, output)))
        except (EngineError, ValueError) as exc:
            arrivals.put_nowait((index, exc, None))
        finally:
            await generation.aclose()
            arrivals.put_nowait((index, _RUN_DONE, None))

    outputs: list[RequestOutput | None] = [None] * len(generations)
    sent_rows = [0] * len(generations)  # logprob rows already sent, per choice
    offsets = [len(shape.echo)] * len(generations)  # characters of text already sent, per choice
    readers = [tool_calls.ToolStream(shape.tool_format) if shape.tool_format else None for _ in generations]
    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        for index in range(len(generations)):
            if shape.chat:
                yield _event(shape.chunk(index, None, None, role=True))
            elif shape.echo:
                yield _event(shape.chunk(index, shape.echo, None))
        running = len(generations)
        while running:
            index, text, step = await arrivals.get()
            if text is _RUN_DONE:
                running -= 1
                continue
            if isinstance(text, Exception):
                yield _event(error_body(f"generation failed: {text}", "InternalServerError", 500))
                break
            finish, num_rows, outputs[index] = step
            if text or finish:
                rows = None
                if num_rows is not None:
                    rows = outputs[index].logprobs[sent_rows[index]:num_rows]
                    sent_rows[index] = max(sent_rows[index], num_rows)
                offsets[index] += len(text)
                if readers[index] is not None:  # tools: the text becomes content and tool_calls deltas
                    content, calls = readers[index].feed(text, finish is not None)
                    if finish == "stop" and readers[index].called:
                        finish = "tool_calls"
                    if content or calls or finish or rows:
                        yield _event(shape.chunk(index, content, finish, rows=rows, tool_calls=calls))
                    continue
                yield _event(shape.chunk(index, text, finish, rows=rows, text_offset=offsets[index] - len(text)))
    finally:  # a client that hangs up lands here: abort every run and free its pages
        for task in tasks:
            task.cancel()
        for generation in generations:
            await generation.aclose()
    done = [out for out in outputs if out is not None]
    if include_usage and done:
        usage_chunk = {**shape.chunk(0, None, None), "choices": [], "usage": _usage(done, shape.simulated).model_dump()}
        yield _event(usage_chunk)
    yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


# -- errors and auth -------------------------------------------------------------
def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.kind, err.status, err.param), status_code=err.status)


_ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": what} for status, what in (
    (400, "Invalid request"), (404, "Unknown model"), (429, "Queue full"), (503, "Engine not ready"))}
_HTTP_ERROR_TYPES = {401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                     413: "invalid_request_error", 429: "RateLimitError", 503: "ServiceUnavailableError"}


def _openapi_with_400(app: FastAPI):
    """FastAPI documents a 422 for every route with a body; this server answers those errors with a 400 in
    OpenAI's form (ErrorResponse), so the schema says that instead."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def _install_error_handlers(app: FastAPI) -> None:
    app.openapi = _openapi_with_400(app)

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        message = f"{where}: {msg}" if where else msg
        return _error_response(APIError(400, message, param=where))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        # Starlette's own errors (404 unknown path, 405 wrong method, 400 a body that is not UTF-8 or nests too
        # deep for the JSON parser), in the same form as ours.
        kind = _HTTP_ERROR_TYPES.get(err.status_code, "InternalServerError" if err.status_code >= 500
                                     else "invalid_request_error")
        response = _error_response(APIError(err.status_code, str(err.detail), kind))
        response.headers.update(err.headers or {})
        return response

    @app.exception_handler(Exception)
    async def unexpected(_: Request, err: Exception) -> JSONResponse:
        log.exception("request failed")
        return _error_response(APIError(500, f"internal error: {type(err).__name__}", "InternalServerError"))


# Open with --api-key too, as in SGLang: probes and Prometheus scrapers rarely hold a key, and neither route
# shows a prompt, a path or a setting (/health says ok or why not; /metrics, counts and latencies).
_OPEN_PATHS = frozenset({"/health", "/metrics"})


def _install_auth(app: FastAPI, api_key: str) -> None:
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        given = request.headers.get("authorization", "").encode()
        if request.url.path not in _OPEN_PATHS and not hmac.compare_digest(given, expected):
            return _error_response(APIError(401, "invalid or missing API key", "AuthenticationError"))
        return await call_next(request)
