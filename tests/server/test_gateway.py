"""What a gateway reads from a replica (server/gateway.py): the load it routes by."""
from __future__ import annotations

import pytest

from specserve.engine.engine import EngineStats
from specserve.server.gateway import load_snapshot
from specserve.server.metrics import RecentTokens


def test_throughput_counts_accepted_drafts_and_forgets_old_tokens():
    recent = RecentTokens(window_s=10.0)
    recent.add(1, None, now=0.0)  # a first token
    recent.add(4, 0.1, now=1.0)  # a verify step that accepted three drafts: four tokens in 100 ms
    recent.add(1, 0.1, now=2.0)  # a step that accepted none
    assert recent.tokens_per_s(now=5.0) == pytest.approx(0.6)
    assert recent.ms_per_token(now=5.0) == pytest.approx(1000 * 0.2 / 5)
    assert recent.any_since(5.0, now=5.0) and not recent.any_since(1.0, now=5.0)
    assert recent.tokens_per_s(now=30.0) == 0 and recent.ms_per_token(now=30.0) is None


def test_load_snapshot_has_sglang_fields_and_counts_requests_not_yet_admitted():
    stats = EngineStats(num_running=3, num_waiting=1, pages_used=16, pages_total=64, num_preemptions=0,
                        spec_drafting=True, prefix_queried_tokens=400, prefix_hit_tokens=100)
    recent = RecentTokens()
    load = load_snapshot(stats, recent, page_size=16, max_running=256, in_flight=6)
    assert load["num_running_reqs"] == 3 and load["num_waiting_reqs"] == 3 and load["num_total_reqs"] == 6
    assert load["num_used_tokens"] == 256 and load["max_total_num_tokens"] == 1024
    assert load["token_usage"] == 0.25 and load["cache_hit_rate"] == 0.25 and load["max_running_requests"] == 256
    assert load["gen_throughput"] == 0 and load["ms_per_output_token"] is None and load["spec_drafting"] is True
    empty = load_snapshot(None, recent, page_size=16, max_running=8, in_flight=0)
    assert empty["token_usage"] == 0 and empty["num_total_reqs"] == 0
