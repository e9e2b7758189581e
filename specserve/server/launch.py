"""Bring the server up: resolve (and convert) the model, load the tokenizer, start the engine process
and uvicorn. The HTTP port opens before the weights load, so /health can say 503 meanwhile."""
from __future__ import annotations

import asyncio
import logging

import uvicorn
from fastapi import FastAPI

from specserve.config import ServerConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.factory import context_length, resolve_model
from specserve.llm import load_tokenizer
from specserve.server.api import build_app
from specserve.server.limits import h11_protocol
from specserve.server.metrics import Metrics

log = logging.getLogger(__name__)


def create_app(config: ServerConfig) -> FastAPI:
    resolved = resolve_model(config.engine)
    tokenizer = load_tokenizer(resolved.tokenizer_dir)
    context = context_length(config.engine, resolved.model_cfg)
    metrics = Metrics()
    engine = AsyncEngine(config.engine, tokenizer, context, metrics.on_stats, metrics.on_tokens, metrics.on_spec_step)
    name = config.served_model_name or resolved.name
    return build_app(config, engine, metrics, name, vocab_size=resolved.model_cfg.vocab_size)


def serve(config: ServerConfig) -> None:
    """Runs until SIGTERM/SIGINT (exit 0 after the drain) or until the engine fails to load or dies: then it
    exits non-zero, so that a supervisor restarts it (docs/reliability.md says why not restart in-process)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app = create_app(config)
    engine: AsyncEngine = app.state.engine
    # uvicorn's own grace period is a backstop behind the drain, for connections that never finish.
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                               timeout_graceful_shutdown=config.shutdown_timeout + 5,
                               http=h11_protocol(config.request_read_timeout))
    server = _Server(uv_config, engine, config.shutdown_timeout)
    engine.on_failure = lambda error: setattr(server, "should_exit", True)
    log.info("serving on http://%s:%d", config.host, config.port)
    server.run()
    if engine.state == "failed":
        raise SystemExit(f"specserve: {engine.error}")


class _Server(uvicorn.Server):
    """uvicorn with a bounded drain. The first SIGTERM or SIGINT stops admitting and lets the requests in flight
    run for up to `drain_timeout` seconds; those left then end with an error event (and [DONE]). A second signal
    of either kind exits at once."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.drain_timeout = engine, drain_timeout

    def handle_exit(self, sig: int, frame) -> None:
        # Unlike uvicorn's, a second SIGTERM forces too, and the signal is not raised again on the way out:
        # the drain is the graceful ending, and its exit status is ours to set.
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.ensure_future(self.engine.drain(self.drain_timeout, forced=lambda: self.force_exit))
        await super().shutdown(sockets)
        if self.force_exit:  # uvicorn skips the lifespan's shutdown, which stops the engine
            self.engine.fail_all("the server is shutting down")
            await asyncio.sleep(0.1)  # let the streams write their error event and [DONE]
            self.engine.shutdown(timeout=2)
        drain.cancel()
