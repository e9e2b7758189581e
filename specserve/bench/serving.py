"""`specserve bench --base-url URL`: load any OpenAI-compatible server across concurrency levels.

Each level warms up with one short wave, then sends its requests closed-loop at concurrency C (or open-loop
with Poisson arrivals at `--request-rate`), streaming, and times every chunk. Token counts come from the
server's `usage` (it also gives the acceptance length, when the server reports it), so a chunk that carries
several tokens (an accepted speculative run) is counted right.
"""
from __future__ import annotations

import asyncio
import random
import subprocess
import time
from dataclasses import dataclass

import httpx
import openai
from tqdm import tqdm

from specserve.bench.datasets import BenchPrompt
from specserve.bench.report import BenchError, RequestResult, follows_schema


@dataclass(frozen=True)
class LoadSettings:
    api: str  # "chat" | "completions"
    model: str
    max_tokens: int | None
    temperature: float
    ignore_eos: bool
    timeout_s: float = 600.0


def probe(base_url: str, api_key: str | None) -> tuple[str, dict | None]:
    """The served model name and the server's settings if it publishes them; BenchError if unreachable."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as err:
        raise BenchError(f"cannot reach {base_url}: {type(err).__name__}: {err}") from None
    if r.status_code != 200:
        raise BenchError(f"{base_url}/v1/models answered {r.status_code}: {r.text[:200]}")
    try:
        model = r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError):
        raise BenchError(f"{base_url}/v1/models did not list a model") from None
    info = None
    for path in ("/server_info", "/get_server_info"):  # specserve, SGLang
        try:
            got = httpx.get(base_url + path, headers=headers, timeout=10)
        except httpx.HTTPError:
            continue
        if got.status_code == 200:
            info = got.json()
            break
    return model, info


def wait_until_healthy(base_url: str, server: subprocess.Popen | None = None, timeout_s: float = 600) -> None:
    """Polls `/health` until it answers 200 (a specserve server says 503 while its model loads); raises if
    `server`, the process serving it, exits first, or after `timeout_s`."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if server is not None and server.poll() is not None:
            raise BenchError(f"the server at {base_url} exited with {server.returncode} before it was healthy")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise BenchError(f"the server at {base_url} was not healthy within {timeout_s:g} s")


async def _one(client: openai.AsyncOpenAI, prompt: BenchPrompt, s: LoadSettings) -> RequestResult:
    max_tokens = s.max_tokens or prompt.output_len or 256
    extra = {"ignore_eos": True} if s.ignore_eos else {}
    if prompt.schema is not None:  # completions take it as an extra field, as specserve and SGLang read it
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": prompt.schema}}
    result = RequestResult(ok=False, start=time.perf_counter())
    common = dict(model=s.model, max_tokens=max_tokens, temperature=s.temperature, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra)
    text = []
    try:
        if prompt.token_ids is not None or s.api == "completions":
            stream = await client.completions.create(prompt=prompt.token_ids or prompt.text, **common)
        else:
            stream = await client.chat.completions.create(messages=prompt.messages, **common)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and _chunk_text(chunk.choices[0]):
                if result.ttft is None:
                    result.ttft = now - result.start
                result.chunk_times.append(now)
                text.append(_chunk_text(chunk.choices[0]))
            if getattr(chunk, "usage", None) is not None:
                _read_usage(result, chunk.usage)
        result.end = time.perf_counter()
        result.ok = result.ttft is not None and result.output_tokens > 0
        if prompt.schema is not None:
            result.schema_valid = follows_schema(prompt.schema, "".join(text))
        if not result.ok:
            result.error = "no tokens or no usage in the stream"
    except openai.OpenAIError as err:
        result.end = time.perf_counter()
        result.error = f"{type(err).__name__}: {err}"[:300]
    return result


def _chunk_text(choice) -> str:
    delta = getattr(choice, "delta", None)
    return (delta.content or "") if delta is not None else (getattr(choice, "text", "") or "")


def _read_usage(result: RequestResult, usage) -> None:
    result.prompt_tokens = usage.prompt_tokens
    result.output_tokens = usage.completion_tokens
    extra = usage.model_extra or {}
    result.spec_steps = extra.get("spec_steps") or 0
    result.spec_accepted = extra.get("spec_accepted_tokens") or 0
    result.acceptance_simulated = bool(extra.get("spec_acceptance_simulated"))


async def run_closed_loop(client, prompts: list[BenchPrompt], concurrency: int, s: LoadSettings,
                          progress: tqdm | None = None) -> list[RequestResult]:
    """Keeps `concurrency` requests in flight until every prompt is sent."""
    queue = iter(prompts)
    results: list[RequestResult] = []

    async def worker():
        for prompt in queue:
            results.append(await _one(client, prompt, s))
            if progress is not None:
                progress.update(1)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return results


async def run_poisson(client, prompts: list[BenchPrompt], rate: float, s: LoadSettings, seed: int,
                      progress: tqdm | None = None) -> list[RequestResult]:
    """Open loop: request i is sent at the i-th arrival of a Poisson process of `rate` per second."""
    rng = random.Random(seed)
    tasks = []

    async def send(prompt):
        result = await _one(client, prompt, s)
        if progress is not None:
            progress.update(1)
        return result

    for prompt in prompts:
        tasks.append(asyncio.create_task(send(prompt)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def run_arrivals(client, prompts: list[BenchPrompt], arrivals: list[float], s: LoadSettings
                       ) -> list[RequestResult]:
    """Open loop: prompt i is sent `arrivals[i]` seconds after the start (a trace, as benchmarks/ replay)."""
    start = time.perf_counter()

    async def send(prompt, at):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        return await _one(client, prompt, s)

    return list(await asyncio.gather(*(send(p, at) for p, at in zip(prompts, arrivals))))


def make_client(base_url: str, api_key: str | None, concurrency: int, timeout_s: float) -> openai.AsyncOpenAI:
    limits = httpx.Limits(max_connections=max(concurrency, 1) + 8, max_keepalive_connections=max(concurrency, 1) + 8)
    http = httpx.AsyncClient(limits=limits, timeout=timeout_s)
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key or "none", max_retries=0, http_client=http)


def metrics_snapshot(base_url: str) -> dict[str, float]:
    """Counters from /metrics (Prometheus text), for acceptance figures a server reports only there."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                pass
    return values
