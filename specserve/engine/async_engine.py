"""The front-end half of the engine: the core runs in its own process and this side only moves messages,
tokenizes and detokenizes, so HTTP work never stalls a step.

Messages to the core:   ("add", request_id, prompt_ids, params) | ("abort", [ids]) | ("shutdown",)
Messages from the core: ("ready", stats) | ("failed", error) | ("step", [TokenDelta], stats)
                        | ("rejected", request_id, error)
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from specserve.config import EngineConfig
from specserve.engine.engine import EngineStats, TokenDelta
from specserve.engine.output import OutputTracker, RequestOutput
from specserve.core import SamplingParams

log = logging.getLogger(__name__)


def run_engine_core(config: EngineConfig, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """Entry point of the engine-core process."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    try:
        from specserve.engine.factory import build_engine_core

        core, _ = build_engine_core(config, progress=True)
    except Exception as exc:  # the front-end reports this on /health and at startup
        log.exception("engine failed to load")
        outbox.put(("failed", f"{type(exc).__name__}: {exc}"))
        return
    outbox.put(("ready", core.stats()))
    parent = os.getppid()
    while True:
        messages = [] if core.has_work() else _wait_for_message(inbox, parent)
        messages += _drain(inbox)
        deltas: list[TokenDelta] = []
        for message in messages:
            if message[0] == "shutdown":
                return
            if message[0] == "add":
                _, request_id, prompt_ids, params = message
                try:
                    core.add_request(request_id, prompt_ids, params)
                except ValueError as exc:
                    outbox.put(("rejected", request_id, str(exc)))
            elif message[0] == "abort":
                deltas += core.abort(message[1])
        if core.has_work():
            deltas += core.step()
        outbox.put(("step", deltas, core.stats()))


def _wait_for_message(inbox: mp.Queue, parent: int) -> list:
    # Wake up now and then to notice a front-end that died without saying goodbye (SIGKILL), so the
    # engine process never outlives it.
    while True:
        try:
            return [inbox.get(timeout=1.0)]
        except queue.Empty:
            if os.getppid() != parent:
                return [("shutdown",)]


def _drain(inbox: mp.Queue) -> list:
    messages = []
    while True:
        try:
            messages.append(inbox.get_nowait())
        except queue.Empty:
            return messages


class EngineError(Exception):
    pass


@dataclass
class _Stream:
    tracker: OutputTracker
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer,
        context_length: int,
        on_stats: Callable[[EngineStats], None] = lambda stats: None,
        on_tokens: Callable[[int, float | None, float | None], None] = lambda n, ttft, itl: None,
        on_spec_step: Callable[[int, int], None] = lambda drafted, accepted: None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.on_stats = on_stats
        self.on_tokens = on_tokens  # (new tokens, time to first token, inter-token latency)
        self.on_spec_step = on_spec_step  # (tokens drafted, drafts accepted) for each speculative step
        self.state = "loading"
        self.error: str | None = None
        self.stats: EngineStats | None = None
        self._streams: dict[str, _Stream] = {}
        self._process: mp.Process | None = None
        self._inbox: mp.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ----------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        ctx = mp.get_context("spawn")
        self._inbox, outbox = ctx.Queue(), ctx.Queue()
        self._process = ctx.Process(
            target=run_engine_core, args=(self.config, self._inbox, outbox), name="specserve-engine", daemon=True
        )
        self._process.start()
        threading.Thread(target=self._read_outbox, args=(outbox,), daemon=True, name="engine-reader").start()

    def shutdown(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._inbox.put(("shutdown",))
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
        self.state = "stopped"

    def is_healthy(self) -> bool:
        return self.state == "ready" and self._process is not None and self._process.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- requests -----------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[tuple[str, RequestOutput]]:
        """Yields (text delta, output so far) until the request finishes. Aborts it if the caller stops early."""
        if not self.is_healthy():
            raise EngineError("the engine is not running")
        stream = _Stream(OutputTracker(self.tokenizer, request_id, prompt_ids, params))
        self._streams[request_id] = stream
        self._inbox.put(("add", request_id, prompt_ids, params))
        try:
            while True:
                item = await stream.deltas.get()
                if isinstance(item, Exception):
                    raise item
                text = stream.tracker.update(item.new_token_ids, item.finish_reason, item)
                output = stream.tracker.output
                if output.stopped_by_string and item.finish_reason is None:
                    self.abort(request_id)
                yield text, output
                if output.finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None and not stream.tracker.output.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self._inbox is not None:
            self._inbox.put(("abort", [request_id]))

    # -- core -> front-end --------------------------------------------------
    def _read_outbox(self, outbox: mp.Queue) -> None:
        while True:
            try:
                message = outbox.get(timeout=1.0)
            except queue.Empty:
                if self._process is not None and not self._process.is_alive():
                    self._loop.call_soon_threadsafe(self._on_core_exit)
                    return
                continue
            self._loop.call_soon_threadsafe(self._dispatch, message)

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            self.state = "ready"
            self._set_stats(message[1])
        elif kind == "failed":
            self.state, self.error = "failed", message[1]
            log.error("engine failed to load: %s", message[1])
        elif kind == "rejected":
            stream = self._streams.get(message[1])
            if stream is not None:
                stream.deltas.put_nowait(ValueError(message[2]))
        elif kind == "step":
            for delta in message[1]:
                self._deliver(delta)
            self._set_stats(message[2])

    def _deliver(self, delta: TokenDelta) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is None:
            return
        now = time.monotonic()
        if delta.step_accepted is not None:
            self.on_spec_step(delta.step_drafted, delta.step_accepted)
        if delta.new_token_ids:
            first = stream.last_token_time is None
            self.on_tokens(
                len(delta.new_token_ids),
                now - stream.arrival if first else None,
                None if first else now - stream.last_token_time,
            )
            stream.last_token_time = now
        stream.deltas.put_nowait(delta)

    def _set_stats(self, stats: EngineStats) -> None:
        self.stats = stats
        self.on_stats(stats)

    def _on_core_exit(self) -> None:
        if self.state != "stopped":
            self.state = "failed"
            self.error = self.error or "the engine process exited"
        for stream in self._streams.values():
            stream.deltas.put_nowait(EngineError(self.error or "engine stopped"))
