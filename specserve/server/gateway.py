"""What a gateway in front of several replicas reads from each (the Shepherd Model Gateway, `smg`, and SGLang's
router before it): load, a health check that generates, and model info. The shapes are the ones `smg` parses
from SGLang workers; fields it does not know are ignored there, so specserve adds its own beside them.

`smg` tells an SGLang worker from a vLLM one by probing `/server_info` (SGLang) and `/version` (vLLM): this
server answers the first and not the second, so it is read as SGLang and its load is taken from `/v1/loads`."""
from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from specserve.config import ServerConfig
from specserve.core import SamplingParams
from specserve.engine.async_engine import AsyncEngine, EngineError
from specserve.engine.engine import EngineStats
from specserve.server.metrics import Metrics, RecentTokens

# /health_generate passes without generating when a request produced a token this recently.
_RECENT_TOKEN_S = 5.0
_HEALTH_GENERATE_TIMEOUT_S = 20.0


def install_gateway_routes(app: FastAPI, config: ServerConfig, engine: AsyncEngine, metrics: Metrics,
                           model_name: str) -> None:
    sched = config.engine.scheduler

    @app.get("/v1/loads")
    async def loads() -> dict:
        """One data-parallel rank's load, as `smg` polls it (`?include=...` sections are all answered)."""
        snapshot = load_snapshot(engine.stats, metrics.recent, config.engine.cache.page_size,
                                 sched.max_running_requests, engine.num_in_flight)
        return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dp_rank_count": 1,
                "loads": [snapshot]}

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 once the engine has produced a token: recently for a request, or now for this probe."""
        if not engine.is_healthy():
            return JSONResponse({"status": engine.state, "error": engine.error}, status_code=503)
        if metrics.recent.any_since(_RECENT_TOKEN_S):
            return JSONResponse({"status": "ok"})
        try:
            await asyncio.wait_for(_one_token(engine), _HEALTH_GENERATE_TIMEOUT_S)
        except (EngineError, TimeoutError) as exc:
            return JSONResponse({"status": "failed", "error": str(exc) or "no token in time"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def model_info() -> dict:
        # No paths: the served name is what a client sends, and a gateway labels the worker with it.
        return {"model_id": model_name, "served_model_name": model_name, "is_generation": True,
                "has_image_understanding": False, "has_audio_understanding": False}

    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])


def load_snapshot(stats: EngineStats | None, recent: RecentTokens, page_size: int, max_running: int,
                  in_flight: int) -> dict:
    """SGLang's `/v1/loads` fields for one rank, plus specserve's `ms_per_output_token`.

    `gen_throughput` is the output tokens of the last window per second, accepted drafts included: `smg`'s
    least_load and expected-wait scores divide queued work by it, so a replica whose speculation pays is
    seen to drain faster. `ms_per_output_token` is the same after speculation from one request's side; `smg`
    does not read it (it is for dashboards and custom policies)."""
    stats = stats or EngineStats(num_running=0, num_waiting=0, pages_used=0, pages_total=0, num_preemptions=0)
    usage = stats.pages_used / stats.pages_total if stats.pages_total else 0.0
    # Requests the front-end holds that the engine has not admitted yet wait too.
    waiting = max(stats.num_waiting, in_flight - stats.num_running)
    ms_per_token = recent.ms_per_token()
    return {
        "dp_rank": 0,
        "num_running_reqs": stats.num_running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": stats.num_running + waiting,
        "num_used_tokens": stats.pages_used * page_size,
        "max_total_num_tokens": stats.pages_total * page_size,
        "token_usage": usage,
        "utilization": usage,
        "gen_throughput": recent.tokens_per_s(),
        "cache_hit_rate": stats.prefix_hit_tokens / max(stats.prefix_queried_tokens, 1),
        "max_running_requests": max_running,
        "ms_per_output_token": ms_per_token,
        "spec_drafting": stats.spec_drafting,
    }


async def _one_token(engine: AsyncEngine) -> None:
    token = engine.tokenizer.bos_token_id if engine.tokenizer is not None else None
    params = SamplingParams(max_tokens=1, temperature=0.0)
    generation = engine.generate(f"health-{time.monotonic_ns()}", [token or 0], params)
    try:
        async for _ in generation:
            pass
    finally:
        await generation.aclose()
