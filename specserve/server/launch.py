"""Bring the server up: resolve (and convert) the model, load the tokenizer, start the engine process
and uvicorn. The HTTP port opens before the weights load, so /health can say 503 meanwhile."""
from __future__ import annotations

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


def create_app(config: ServerConfig) -> FastAPI:
    resolved = resolve_model(config.engine)
    tokenizer = load_tokenizer(resolved.tokenizer_dir)
    context = context_length(config.engine, resolved.model_cfg)
    metrics = Metrics()
    engine = AsyncEngine(config.engine, tokenizer, context, metrics.on_stats, metrics.on_tokens, metrics.on_spec_step)
    name = config.served_model_name or resolved.name
    return build_app(config, engine, metrics, name, vocab_size=resolved.model_cfg.vocab_size)


def serve(config: ServerConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app = create_app(config)
    logging.getLogger(__name__).info("serving on http://%s:%d", config.host, config.port)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info", http=h11_protocol(config.request_read_timeout))
