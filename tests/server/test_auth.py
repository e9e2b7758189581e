"""--api-key and SPECSERVE_API_KEY: which routes need the key, and what /server_info tells."""
from __future__ import annotations

import httpx
import pytest

from server_process import live_server
from specserve import envs

KEY = "secret-from-the-environment"
MODEL = "tiny"


@pytest.fixture(scope="module")
def base(tiny_chat_model):
    # The key comes from the environment only: it is not on the command line, where `ps` would show it.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(envs.env_name("api_key"), KEY)
        with live_server("--model", str(tiny_chat_model), "--served-model-name", MODEL,
                         "--max-total-tokens", "4096") as url:
            yield url


def _get(base: str, path: str, key: str | None = None) -> httpx.Response:
    return httpx.get(base + path, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)


@pytest.mark.parametrize("path", ["/v1/models", "/server_info", "/openapi.json", "/docs", "/redoc", "/no/such/route"])
def test_every_route_but_health_and_metrics_needs_the_key(base, path):
    for key in (None, "wrong"):
        r = _get(base, path, key)
        assert r.status_code == 401, (path, key, r.status_code)
        assert r.json()["error"]["type"] == "AuthenticationError"
    assert _get(base, path, KEY).status_code == (404 if path == "/no/such/route" else 200)


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_health_and_metrics_stay_open_for_probes_and_scrapers(base, path):
    assert _get(base, path).status_code == 200


def test_a_completion_needs_the_key_from_the_environment(base):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert httpx.post(base + "/v1/completions", json=body, timeout=30).status_code == 401
    r = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_server_info_tells_limits_not_paths_or_engine_settings(base, tiny_chat_model):
    info = _get(base, "/server_info", KEY).json()
    assert info["model"] == MODEL and info["max_model_len"] == 1024 and info["version"]
    assert {"max_running_requests", "max_queued_requests", "max_request_body_bytes", "spec"} <= set(info)
    text = str(info)
    assert str(tiny_chat_model) not in text and "/" not in text, "a file path in /server_info"
    for leaked in ("model_path", "device", "dtype", "cache_dir", "mem_fraction_static", "draft_model_path"):
        assert leaked not in text


def test_the_flag_wins_over_the_environment(monkeypatch):
    from specserve import cli
    from specserve.server import launch

    seen = []
    monkeypatch.setattr(launch, "serve", seen.append)
    with envs.override(api_key="from-env"):
        cli.main(["serve", "--api-key", "from-flag"])
        cli.main(["serve"])
    with envs.override(api_key=""):
        cli.main(["serve"])
    assert [c.api_key for c in seen] == ["from-flag", "from-env", None]
