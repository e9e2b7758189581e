"""Prometheus metrics, on a registry of their own so several servers can live in one process (tests)."""
from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specserve.engine.engine import EngineStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("specserve_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("specserve_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.pages_used = Gauge("specserve_kv_pages_used", "KV cache pages in use", registry=r)
        self.pages_total = Gauge("specserve_kv_pages_total", "KV cache pages in the pool", registry=r)
        self.kv_bytes_per_token = Gauge("specserve_kv_cache_bytes_per_token",
                                        "Bytes the target's KV pool keeps per token, all layers", registry=r)
        self.preemptions = Gauge("specserve_num_preemptions", "Preemptions since start", registry=r)
        self.prefix_queried = Gauge("specserve_prefix_cache_queries_tokens",
                                    "Prompt tokens admitted since start (recomputes after preemption too)", registry=r)
        self.prefix_hits = Gauge("specserve_prefix_cache_hits_tokens",
                                 "Admitted prompt tokens served from the prefix cache since start", registry=r)
        self.prefix_hit_rate = Gauge("specserve_prefix_cache_hit_rate", "Prefix cache hits over queries, in tokens",
                                     registry=r)
        self.prefix_pages = Gauge("specserve_prefix_cache_pages", "KV pages the prefix cache holds (in use or idle)",
                                  registry=r)
        self.spec_drafting = Gauge("specserve_spec_drafting",
                                   "1 while speculation is configured and its plan lets decode steps draft", registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("specserve_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "specserve_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.spec_drafted = Counter("specserve_spec_draft_tokens", "Draft tokens proposed", registry=r)
        self.spec_accepted = Counter("specserve_spec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.acceptance_length = Histogram(
            "specserve_spec_acceptance_length", "Tokens emitted per speculative step (cut at a stop)",
            buckets=tuple(range(1, 18)), registry=r,
        )
        self.itl = Histogram(
            "specserve_inter_token_latency_seconds", "Time between tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.recent = RecentTokens()

    def on_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.pages_used.set(stats.pages_used)
        self.pages_total.set(stats.pages_total)
        self.kv_bytes_per_token.set(stats.kv_bytes_per_token)
        self.preemptions.set(stats.num_preemptions)
        self.spec_drafting.set(int(stats.spec_drafting))
        self.prefix_queried.set(stats.prefix_queried_tokens)
        self.prefix_hits.set(stats.prefix_hit_tokens)
        self.prefix_hit_rate.set(stats.prefix_hit_tokens / max(stats.prefix_queried_tokens, 1))
        self.prefix_pages.set(stats.prefix_cached_pages)

    def on_tokens(self, count: int, ttft: float | None, itl: float | None) -> None:
        self.generation_tokens.inc(count)
        self.recent.add(count, itl)
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)

    def on_spec_step(self, drafted: int, accepted: int) -> None:
        self.spec_drafted.inc(drafted)
        self.spec_accepted.inc(accepted)
        self.acceptance_length.observe(accepted + 1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RecentTokens:
    """The output tokens of the last `window_s` seconds, for a gateway's load-aware routing: the rate this
    server drains work at, and the milliseconds one more token takes a running request. Both come after
    speculation (a verified step's accepted drafts arrive as tokens of one delta), so a replica whose drafts
    are accepted reports itself faster than one whose plan drafts nothing."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._deltas: deque[tuple[float, int, float | None]] = deque()  # (when, tokens, seconds since the last)
        self._lock = threading.Lock()  # written by the engine's reader thread, read by the event loop

    def add(self, count: int, itl: float | None, now: float | None = None) -> None:
        with self._lock:
            self._deltas.append((time.monotonic() if now is None else now, count, itl))

    def _recent(self, now: float | None) -> list[tuple[float, int, float | None]]:
        cutoff = (time.monotonic() if now is None else now) - self.window_s
        with self._lock:
            while self._deltas and self._deltas[0][0] < cutoff:
                self._deltas.popleft()
            return list(self._deltas)

    def tokens_per_s(self, now: float | None = None) -> float:
        return sum(count for _, count, _ in self._recent(now)) / self.window_s

    def ms_per_token(self, now: float | None = None) -> float | None:
        """Milliseconds per output token of one request, over the deltas that followed an earlier one: a
        delta of k accepted tokens after t seconds counts t / k. None when no request decoded lately."""
        timed = [(count, itl) for _, count, itl in self._recent(now) if itl is not None]
        tokens = sum(count for count, _ in timed)
        return 1000 * sum(itl for _, itl in timed) / tokens if tokens else None

    def any_since(self, seconds: float, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        recent = self._recent(now)
        return bool(recent) and recent[-1][0] >= now - seconds
