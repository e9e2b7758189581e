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
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from specserve.config import EngineConfig
from specserve.engine.engine import EngineStats, TokenDelta
from specserve.engine.output import OutputTracker, RequestOutput
from specserve.core import SamplingParams

log = logging.getLogger(__name__)


def run_engine_core(config: EngineConfig, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """Entry point of the engine-core process. It exits when the front-end says "shutdown" or is gone."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    # The front-end owns this process's lifetime. Ctrl-C reaches the whole process group, and so does a
    # supervisor's SIGTERM (systemd's default KillMode): the front-end drains its streams and then stops the
    # engine, which must not die under them first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent(os.getppid())
    try:
        from specserve.engine.factory import build_engine_core

        core, _ = build_engine_core(config, progress=True)
    except Exception as exc:  # the front-end reports this on /health and at startup
        log.exception("engine failed to load")
        outbox.put(("failed", f"{type(exc).__name__}: {exc}"))
        return
    outbox.put(("ready", core.stats()))
    while True:
        messages = [] if core.has_work() else [inbox.get()]  # a gone front-end: _exit_with_parent
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


def _exit_with_parent(parent: int, period: float = 0.5) -> None:
    """Ends this process soon after the front-end is gone (SIGKILL gives it no chance to say goodbye), whatever
    the main thread is doing: stepping, or blocked on a full pipe to a reader that no longer exists."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period)
        log.error("the front-end (pid %d) is gone; the engine exits", parent)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _drain(inbox: mp.Queue) -> list:
    messages = []
    while True:
        try:
            messages.append(inbox.get_nowait())
        except queue.Empty:
            return messages


class EngineError(Exception):
    pass


class QueueFull(EngineError):
    """The server holds as many requests as it may (running plus queued)."""


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
        # Called (on the event loop) once the engine fails to load or dies; the server then exits non-zero.
        self.on_failure: Callable[[str], None] = lambda error: None

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

    def shutdown(self, timeout: float = 10.0) -> None:
        failed = self.state == "failed"
        self.state = "stopped"
        if self._process is not None and self._process.is_alive():
            self._inbox.put(("shutdown",))
            self._process.join(timeout=timeout)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout=5)
        if failed:
            self.state = "failed"

    def is_healthy(self) -> bool:
        return self.state == "ready" and self._process is not None and self._process.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- requests -----------------------------------------------------------
    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_in_flight: int | None = None
    ) -> "Generation":
        """Admits the request now, or raises QueueFull when `max_in_flight` requests are already held, and returns
        an async iterator of (text delta, output so far) until it finishes. Check and count are one synchronous
        step, so a burst of callers cannot all pass the check before any of them is counted."""
        if not self.is_healthy():
            raise EngineError("the engine is not running")
        if max_in_flight is not None and len(self._streams) >= max_in_flight:
            raise QueueFull("the server's request queue is full; retry later")
        stream = _Stream(OutputTracker(self.tokenizer, request_id, prompt_ids, params))
        self._streams[request_id] = stream
        self._inbox.put(("add", request_id, prompt_ids, params))
        return Generation(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        if self._inbox is not None and self.state != "stopped":
            self._inbox.put(("abort", [request_id]))

    def fail_all(self, message: str) -> None:
        """Ends every request in flight with an error (their streams close with an error event)."""
        for stream in self._streams.values():
            stream.deltas.put_nowait(EngineError(message))

    async def drain(self, timeout: float, forced: Callable[[], bool] = lambda: False) -> None:
        """Stops admitting (/health turns 503), waits up to `timeout` seconds for the requests in flight to
        finish, then fails those left."""
        if self.state == "ready":
            self.state = "draining"
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and not forced():
            await asyncio.sleep(0.05)
        if self._streams:
            log.warning("shutdown: %d request(s) still running; ending them with an error", len(self._streams))
            self.fail_all("the server is shutting down")

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
            self.state, self.error = "failed", f"the engine failed to load: {message[1]}"
            log.error("%s", self.error)
            self.on_failure(self.error)
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
        if self.state not in ("stopped", "failed"):
            self.state = "failed"
            self.error = f"the engine process died (exit code {self._process.exitcode})"
            log.error("%s; failing %d request(s) in flight", self.error, len(self._streams))
            self.on_failure(self.error)
        self.fail_all(self.error or "engine stopped")


class Generation:
    """One admitted request: `async for text, output in generation`. Closing it early (aclose, or dropping it
    unstarted, as a response that never ran does) aborts the request in the engine."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self._engine, self._request_id, self._stream = engine, request_id, stream
        self._done = False

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> tuple[str, RequestOutput]:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._stream.deltas.get()
        except BaseException:  # cancelled: the caller went away
            self._release()
            raise
        if isinstance(item, Exception):
            self._release()
            raise item
        tracker = self._stream.tracker
        text = tracker.update(item.new_token_ids, item.finish_reason, item)
        output = tracker.output
        if output.stopped_by_string and item.finish_reason is None:
            self._engine.abort(self._request_id)
        if output.finished:
            self._release()
        return text, output

    async def aclose(self) -> None:
        self._release()

    def __del__(self) -> None:
        self._release()

    def _release(self) -> None:
        if self._done:
            return
        self._done = True
        held = self._engine._streams.pop(self._request_id, None) is not None
        if held and not self._stream.tracker.output.finished:
            self._engine.abort(self._request_id)
