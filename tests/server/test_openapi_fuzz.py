"""Schemathesis against a live server's own /openapi.json: requests made from the schema, valid and not, and
no answer is ever a 5xx."""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from hypothesis.errors import Unsatisfiable  # noqa: E402

from server_process import live_server  # noqa: E402

EXAMPLES = 50  # per operation and generation mode
MODEL = "tiny"
MAX_TOKENS = 4  # generated bodies keep their small and bad values; larger, null or missing ones become this


@pytest.fixture(scope="module")
def fuzzed_server(tiny_chat_model):
    with live_server("--model", str(tiny_chat_model), "--served-model-name", MODEL, "--max-total-tokens", "4096",
                     "--page-size", "8") as base:
        yield base


def _served_model_small_generation(case) -> None:
    """A generated model name is a 404 before anything else is looked at: name the served model where the
    body gives a string. A generated max_tokens can be in the billions, and a missing one runs to the context
    length; the fuzz is about the answers, not long generations."""
    if isinstance(case.body, dict):
        if isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL
        if case.body.get("max_tokens") is None and case.body.get("max_completion_tokens") is None:
            case.body["max_tokens"] = MAX_TOKENS  # missing or null: no limit but the context
        for key in ("max_tokens", "max_completion_tokens"):
            value = case.body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
                case.body[key] = MAX_TOKENS


def test_no_server_errors(fuzzed_server):
    """Every operation, with bodies that fit the schema and bodies that do not: all cases are sent (the
    5xx are gathered, not stopped at), so a failure lists each distinct one."""
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(fuzzed_server + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path == "/v1/chat/completions" for op in operations)
    sent, server_errors, slowest = {}, {}, [0.0, "", ""]

    for operation in operations:
        label = f"{operation.method.upper()} {operation.path}"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            def send(case):
                _served_model_small_generation(case)
                response = case.call(timeout=60)
                sent[label] = sent.get(label, 0) + 1
                slowest[:] = max(slowest, [response.elapsed, label, repr(case.body)[:300]])
                if response.status_code >= 500:
                    key = (label, response.status_code, response.text[:200])
                    server_errors.setdefault(key, repr(case.body)[:1000])  # unfiltered, unlike its curl form

            try:
                send()
            except Unsatisfiable:  # nothing to make invalid: an operation without inputs
                assert mode == GenerationMode.NEGATIVE and not operation.body.items, label
    print(f"cases sent: {sum(sent.values())}", sent, "slowest:", slowest)
    # Operations without inputs have one case to send; those with a body get every example.
    assert all(n >= 2 * EXAMPLES for label, n in sent.items() if label.startswith("POST")), sent
    assert not server_errors, "\n\n".join(f"{k[0]} -> {k[1]} {k[2]!r}\n{body}" for k, body in server_errors.items())
