"""`specserve serve --tp-size 2` on the CPU (two gloo ranks), through the official `openai` client: it answers as
--tp-size 1 does, and a rank that dies takes the server down cleanly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specserve.core import SamplingParams
from specserve.distributed.ranks import WORKER_MODULE
from specserve.llm import LLM

from server_process import free_port, live_server, wait_until_healthy

MODEL = "tiny-tp"
PROMPT = "The capital of France is"


def test_the_server_answers_with_two_ranks(tiny_chat_model):
    import openai

    reference = LLM(model=str(tiny_chat_model), max_total_tokens=1024, page_size=8).generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].text
    with live_server("--model", str(tiny_chat_model), "--served-model-name", MODEL, "--max-total-tokens", "1024",
                     "--page-size", "8", "--tp-size", "2") as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                         extra_body={"ignore_eos": True})
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8)
        with pytest.raises(openai.BadRequestError, match="tp-size"):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                      extra_body={"regex": "[a-z]+"})
    assert done.choices[0].text == streamed == reference
    assert chat.choices[0].message.content is not None


def _descendants(pid: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (a zombie has exited; only its parent's wait is missing)."""
    alive = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.append(pid)
        except OSError:
            continue
    return alive


def _worker_of(server_pid: int) -> int:
    for pid in _descendants(server_pid):
        try:
            if WORKER_MODULE.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise AssertionError("no tensor-parallel worker under the server")


def test_a_dead_rank_takes_the_server_down_cleanly(tiny_chat_model):
    """A worker rank killed mid-stream: the stream ends with an error event, /health stops saying ok, and the
    server exits non-zero on its own, its processes all gone; nothing hangs."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", "--port", str(port), "--model",
                             str(tiny_chat_model), "--served-model-name", MODEL, "--max-total-tokens", "1024",
                             "--tp-size", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, proc)
        family = _descendants(proc.pid)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "temperature": 0.0, "stream": True,
                "ignore_eos": True}
        events = []
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 1:
                        os.kill(_worker_of(proc.pid), signal.SIGKILL)
        assert events[-1] == "[DONE]"
        # Either the engine died under the step (an error event) or the step's broadcast failed first (the
        # request finished with reason "error"); then the engine exits.
        last = json.loads(events[-2])
        assert "engine" in last["error"]["message"] if "error" in last else \
            last["choices"][0]["finish_reason"] == "error", events[-3:]
        assert len(events) < 900
        try:
            assert httpx.get(base + "/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass  # already gone
        assert proc.wait(timeout=60) != 0
        deadline = time.time() + 20
        while _alive(family) and time.time() < deadline:
            time.sleep(0.2)
        assert not _alive(family)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
