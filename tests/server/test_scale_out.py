"""`specserve serve --dp-size 2`: two SmolLM2 replicas on loopback behind the real smg gateway.

One launch serves every test of the module (two model loads are the slow part on a small CPU); the test that
kills a replica comes last."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server_process import free_port
from specserve import envs

pytest.importorskip("smg", reason="the smg gateway is the optional `router` extra")

KEY = "scale-out-key"
MODEL = "smol"
# A long shared prefix (a system prompt): several full KV pages of it.
SYSTEM = ("You are a careful assistant for a shipping company. Answer in one short sentence, name the relevant "
          "policy section, never invent tracking numbers, and refer refund questions to the billing desk. " * 3)


@pytest.fixture(scope="module")
def gateway(smollm2_dir):
    port = free_port()
    env = {**os.environ, envs.env_name("api_key"): KEY}
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--model", str(smollm2_dir), "--served-model-name",
           MODEL, "--port", str(port), "--dp-size", "2", "--max-total-tokens", "8192", "--shutdown-timeout", "5"]
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _readiness(base).get("healthy_workers") == 2, launcher, 300)
        _wait_for(lambda: all("engine_load" in w for w in _workers(base)), launcher, 30)  # smg's first load poll
        yield base, launcher
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)


def _readiness(base: str) -> dict:
    try:
        return httpx.get(base + "/readiness", timeout=2).json()
    except (httpx.TransportError, ValueError):
        return {}


def _wait_for(condition, launcher: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert launcher.poll() is None, "the launcher exited"
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


def _workers(base: str) -> list[dict]:
    return httpx.get(base + "/workers", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).json()["workers"]


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return float(re.search(rf"^{name}(?:_total)? (\S+)$", text, re.M).group(1))


def _client(base: str, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=timeout)


def test_each_replica_is_registered_as_a_ready_worker_with_its_load(gateway):
    base, _ = gateway
    workers = _workers(base)
    assert len(workers) == 2 and all(w["status"] == "ready" and w["is_healthy"] for w in workers)
    for worker in workers:
        assert worker["models"][0]["id"] == MODEL and worker["runtime_type"] == "sglang"
        load = worker["engine_load"]["loads"][0]  # parsed by smg from /v1/loads
        assert load["max_total_num_tokens"] == 8192 and load["max_running_requests"] == 256


def test_requests_spread_across_both_replicas(gateway):
    base, _ = gateway
    urls = [w["url"] for w in _workers(base)]
    before = [_metric(u, "specserve_prompt_tokens") for u in urls]
    client = _client(base)

    def ask(i: int) -> str:
        return client.completions.create(model=MODEL, prompt=f"{i} apples and {i * 7} pears are", max_tokens=4,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        assert all(isinstance(text, str) for text in pool.map(ask, range(16)))
    served = [_metric(u, "specserve_prompt_tokens") - b for u, b in zip(urls, before)]
    assert all(s > 0 for s in served), served


def test_a_shared_long_prefix_goes_to_one_replica_and_hits_its_cache(gateway):
    base, _ = gateway
    urls = [w["url"] for w in _workers(base)]
    hits = [_metric(u, "specserve_prefix_cache_hits_tokens") for u in urls]
    prompts = [_metric(u, "specserve_prompt_tokens") for u in urls]
    client = _client(base)
    for question in ("Where is my parcel?", "Can I change the address?", "How do refunds work?",
                     "Do you ship abroad?", "What does express cost?", "Can I pick it up myself?"):
        client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    hit = [_metric(u, "specserve_prefix_cache_hits_tokens") - h for u, h in zip(urls, hits)]
    got = [_metric(u, "specserve_prompt_tokens") - p for u, p in zip(urls, prompts)]
    holder = max(range(2), key=lambda i: hit[i])
    # Every request after the first went where the prefix was, and was served from its cache there.
    assert got[1 - holder] == 0 and hit[1 - holder] == 0, (got, hit)
    assert hit[holder] >= 5 * 64, hit


def test_streaming_key_and_bad_input_behave_as_with_one_server(gateway):
    base, _ = gateway
    chunks = list(_client(base).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 5
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # (smg lists the models without a key; generating needs it)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).completions.create(
            model=MODEL, prompt="hi", max_tokens=2)
    assert httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi"}).status_code == 401
    client = _client(base)
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):  # refused by the replica, passed through by the gateway
        client.completions.create(model=MODEL, prompt="hi", max_tokens=100_000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)


def test_killing_a_replica_under_load_loses_no_request(gateway):
    """50 requests in flight, half streaming; one replica is killed. A request ends in an error only if its
    stream had begun; the others complete (smg retries them on the other replica), none hangs, and new
    requests succeed while the router's health shows one replica left, until the replica is back."""
    base, launcher = gateway
    client = _client(base, timeout=90)
    stream_began = [float("inf")] * 50  # when the response's head arrived

    def run(i: int) -> str:
        kwargs = dict(model=MODEL, prompt=f"Story {i}: once upon a time", max_tokens=24, temperature=0)
        try:
            if i % 2:
                stream = client.completions.create(stream=True, **kwargs)
                stream_began[i] = time.monotonic()
                for _ in stream:
                    pass
                return "ok"
            client.completions.create(**kwargs)
            return "ok"
        except openai.APIError as exc:
            return f"error: {type(exc).__name__}"

    victim = _workers(base)[0]["url"]
    with ThreadPoolExecutor(50) as pool:
        futures = [pool.submit(run, i) for i in range(50)]
        time.sleep(1.5)
        _replica_pid(launcher.pid, victim).kill()
        killed_at = time.monotonic()
        results = [f.result(timeout=120) for f in futures]
    failed = [i for i, r in enumerate(results) if r != "ok"]
    # A stream whose head the victim sent just before it died may reach the client a moment after.
    assert all(stream_began[i] < killed_at + 1.0 for i in failed), (failed, results)

    _wait_for(lambda: _readiness(base).get("healthy_workers") == 1, launcher, 30)
    assert [w["is_healthy"] for w in _workers(base) if w["url"] == victim] in ([False], [])
    for i in range(4):
        assert client.completions.create(model=MODEL, prompt=f"after {i}", max_tokens=3).choices[0].text is not None
    assert launcher.poll() is None, "one replica's death must not stop the launcher"
    # The launcher starts the replica again on its port, and smg's health checks take it back.
    _wait_for(lambda: _readiness(base).get("healthy_workers") == 2, launcher, 180)
    assert _replica_pid(launcher.pid, victim).is_running()


def _replica_pid(launcher_pid: int, url: str):
    import psutil

    port = url.rsplit(":", 1)[1]
    for child in psutil.Process(launcher_pid).children():
        cmd = child.cmdline()
        if "serve" in cmd and port in cmd:
            return child
    raise AssertionError(f"no replica on port {port}")


@pytest.mark.gpu
def test_each_replica_gets_a_gpu_of_its_own(smollm2_dir):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--model", str(smollm2_dir), "--served-model-name",
           MODEL, "--port", str(port), "--dp-size", "2", "--device", "cuda"]
    launcher = subprocess.Popen(cmd, env={**os.environ, envs.env_name("api_key"): KEY}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _readiness(base).get("healthy_workers") == 2, launcher, 600)
        gpus = {_replica_pid(launcher.pid, w["url"]).environ()["CUDA_VISIBLE_DEVICES"] for w in _workers(base)}
        assert len(gpus) == 2
        assert _client(base).completions.create(model=MODEL, prompt="Hi", max_tokens=4).usage.completion_tokens == 4
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=120)
