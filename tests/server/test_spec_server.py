"""Speculation through the HTTP API: usage extension fields and Prometheus series."""
from __future__ import annotations


import openai
import pytest

from server_process import live_server
from test_server import _metric


@pytest.fixture(scope="module")
def spec_server(tiny_chat_model):
    with live_server("--model", str(tiny_chat_model), "--served-model-name", "tiny", "--max-total-tokens", "4096",
                     "--speculative-algorithm", "DRAFT_MODEL", "--speculative-draft-model-path", str(tiny_chat_model),
                     # Every step drafts, so the counts below are exact (the adaptive plan would time steps).
                     "--speculative-num-steps", "3", "--disable-speculative-adaptive") as base:
        yield {"base": base}


def test_usage_and_metrics_report_acceptance(spec_server):
    client = openai.OpenAI(base_url=spec_server["base"] + "/v1", api_key="none", max_retries=0)
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=17, temperature=0,
                                  extra_body={"ignore_eos": True})
    usage = r.usage.model_dump()
    assert r.usage.completion_tokens == 17
    # The draft is a copy of the target: every draft is accepted, 3 drafts + 1 bonus per step.
    assert usage["spec_draft_tokens"] == usage["spec_accepted_tokens"] == 12
    assert usage["spec_mean_acceptance_length"] == 4.0
    assert _metric(spec_server, "specserve_spec_draft_tokens_total") == 12
    assert _metric(spec_server, "specserve_spec_accepted_tokens_total") == 12
    assert _metric(spec_server, "specserve_spec_acceptance_length_count") == 4
    assert _metric(spec_server, "specserve_spec_drafting") == 1
