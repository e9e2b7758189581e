"""`specserve serve` in a process of its own, on a free port."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

from specserve.distributed.ranks import free_port


def wait_until_healthy(base: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Polls `base`/health until it answers 200 (or `timeout` passes); fails at once if the server exits."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, "the server exited before it was healthy"
        time.sleep(0.1)


@contextmanager
def live_server(*serve_args: str):
    """`specserve serve` in its own process group on a free port; yields its base URL once /health is 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(port), *serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, proc)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@contextmanager
def self_drafting_client(model_dir, served_name: str):
    """An `openai` client of a live server whose model drafts for itself on every step (three drafts, the
    adaptive plan off), so each request exercises speculation."""
    import openai

    with live_server("--model", str(model_dir), "--served-model-name", served_name, "--max-total-tokens", "4096",
                     "--speculative-algorithm", "DRAFT_MODEL", "--speculative-draft-model-path", str(model_dir),
                     "--speculative-num-steps", "3", "--disable-speculative-adaptive") as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
