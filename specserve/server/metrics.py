"""Prometheus metrics, on a registry of their own so several servers can live in one process (tests)."""
from __future__ import annotations

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
