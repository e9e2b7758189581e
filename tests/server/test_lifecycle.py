"""The server's lifecycle under stress, each on a real server process: admission under a burst, the engine
process dying or failing to load, the front-end killed, and bounded shutdown on SIGTERM and SIGINT."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_process import free_port

# Tokens of a stream that outlasts every wait below: the tiny model makes a thousand tokens in well under a
# second on an idle CPU, so a stream must be far longer than that (`long_context_model`).
LONG = 30000
BURST = 1000  # tokens of each burst request: enough to keep it running while the burst arrives


class Server:
    """`specserve serve` in its own process group, its log in a file."""

    def __init__(self, model, tmp_path: Path, *args: str, wait_healthy: bool = True) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "specserve.cli", "serve", "--model", str(model), "--port", str(self.port),
               "--served-model-name", "tiny", "--max-total-tokens", "65536", "--page-size", "8", *args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait_healthy:
            self.wait_healthy()

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError("server never became healthy:\n" + self.log())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pid(self) -> int:
        """The engine-core process: the server's child started through multiprocessing's spawn."""
        for child in _children(self.proc.pid):
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        raise AssertionError("no engine process")

    def group_left(self) -> list[str]:
        """Processes of the server's group still running (zombies have exited: only reaping is left)."""
        out = subprocess.run(["pgrep", "-a", "-g", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [line for line in out.splitlines() if "<defunct>" not in line]

    def stop(self) -> list[str]:
        """SIGTERM if still up; returns what was left running, after killing it so no test leaks processes."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        left = [] if _wait_until(lambda: not self.group_left(), 10) is not None else self.group_left()
        if left or self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        return left


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent's reaping is left


def _wait_until(predicate, timeout: float) -> float | None:
    """Seconds until `predicate()` holds, or None if it never does within `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.02)
    return None


@pytest.fixture(scope="module")
def long_context_model(tiny_chat_model, tmp_path_factory):
    """The tiny chat model with room for a stream of LONG tokens (its weights are random: positions past the
    original context change nothing these tests look at)."""
    import shutil

    path = tmp_path_factory.mktemp("tiny-chat-long") / "model"
    shutil.copytree(tiny_chat_model, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 2 * LONG
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def serve(long_context_model, tmp_path):
    started = []

    def start(*args: str, **kwargs) -> Server:
        started.append(Server(long_context_model, tmp_path, *args, **kwargs))
        return started[-1]

    yield start
    for server in started:
        left = server.stop()
        assert not left, f"processes left behind: {left}"


class Stream:
    """A long streaming completion, read in a thread: its SSE events as they come."""

    def __init__(self, base: str, max_tokens: int = LONG) -> None:
        self.events: list[str] = []
        self.status: int | None = None
        self.first_token = threading.Event()
        self.closed = threading.Event()
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0.0}
        self._thread = threading.Thread(target=self._read, args=(base, body), daemon=True)
        self._thread.start()

    def _read(self, base: str, body: dict) -> None:
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        if len(self.events) >= 2:
                            self.first_token.set()
        except httpx.HTTPError:
            pass  # the server went away: the events so far say how the stream ended
        finally:
            self.first_token.set()
            self.closed.set()

    def errors(self) -> list[dict]:
        return [json.loads(e)["error"] for e in self.events if e != "[DONE]" and "error" in json.loads(e)]

    def finish_reason(self) -> str | None:
        for event in self.events:
            if event != "[DONE]" and json.loads(event).get("choices"):
                reason = json.loads(event)["choices"][0]["finish_reason"]
                if reason:
                    return reason
        return None


# -- 1: admission under a burst ------------------------------------------------------------------------------
def test_burst_admits_at_most_running_plus_queued(serve):
    """30 simultaneous streams on fresh connections: at most running + queued are admitted, the rest get 429
    with Retry-After and an OpenAI-style body. (Before: the check ran before the request was counted, and
    23-30 of 30 got in.)"""
    running, queued, clients = 4, 4, 30
    server = serve("--max-running-requests", str(running), "--max-queued-requests", str(queued))
    barrier, hold = threading.Barrier(clients), threading.Event()
    results: list[tuple[int, dict, str]] = []
    lock = threading.Lock()

    def one() -> None:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": BURST, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as client:  # a fresh connection each
            barrier.wait()
            with client.stream("POST", server.base + "/v1/completions", json=body) as response:
                payload = {} if response.status_code == 200 else json.loads(response.read())
                with lock:
                    results.append((response.status_code, payload, response.headers.get("retry-after")))
                if response.status_code == 200:
                    hold.wait(60)  # keep the admitted stream open until every answer is in

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for t in threads:
        t.start()
    assert _wait_until(lambda: len(results) == clients, 60) is not None, f"only {len(results)} answered"
    hold.set()
    for t in threads:
        t.join(60)
    admitted = sum(status == 200 for status, _, _ in results)
    print(f"burst: {admitted} of {clients} admitted (limit {running + queued})")
    assert 1 <= admitted <= running + queued
    refused = [(payload, retry) for status, payload, retry in results if status != 200]
    assert len(refused) == clients - admitted
    for payload, retry_after in refused:
        assert payload["error"]["type"] == "RateLimitError" and payload["error"]["code"] == 429
        assert retry_after is not None and int(retry_after) >= 1


# -- 2: the engine never outlives the front-end --------------------------------------------------------------
def test_engine_exits_when_the_front_end_is_killed_mid_stream(serve):
    """kill -9 of the server while the engine is busy with a long stream: the engine exits within seconds.
    (Before: it kept stepping, then blocked on its full pipe to the dead front-end, for good.)"""
    server = serve()
    stream = Stream(server.base)
    assert stream.first_token.wait(30) and stream.status == 200
    engine = server.engine_pid()
    os.kill(server.proc.pid, signal.SIGKILL)
    start = time.monotonic()
    gone = _wait_until(lambda: not _alive(engine), 15) is not None
    print(f"engine gone: {gone}, {time.monotonic() - start:.2f} s after the front-end was killed")
    assert gone, "the engine outlived its front-end"
    assert time.monotonic() - start < 5


# -- 3 and 15: the engine dies mid-stream ---------------------------------------------------------------------
def test_engine_killed_mid_stream_fails_the_stream_logs_and_exits_nonzero(serve):
    """Chaos: kill -9 the engine during a stream. The stream ends with an error event and [DONE], the server
    logs the death and exits non-zero for its supervisor to restart it, and nothing is left running.
    (Before: 503 forever, nothing logged, never exits.)"""
    server = serve()
    stream = Stream(server.base)
    assert stream.first_token.wait(30) and stream.status == 200
    os.kill(server.engine_pid(), signal.SIGKILL)
    start = time.monotonic()
    assert server.proc.wait(timeout=20) != 0
    print(f"server exited {time.monotonic() - start:.2f} s after the engine was killed")
    assert stream.closed.wait(10)
    assert stream.errors() and "engine" in stream.errors()[0]["message"], stream.events[-3:]
    assert stream.events[-1] == "[DONE]"
    assert "the engine process died" in server.log()
    assert _wait_until(lambda: not server.group_left(), 10) is not None


# -- 3a: a load failure exits -----------------------------------------------------------------------------------
def test_engine_that_fails_to_load_exits_nonzero_with_the_error(serve, tmp_path):
    """(Before: /health 503 forever.)"""
    missing = tmp_path / "no-such-draft"
    missing.mkdir()
    server = serve("--speculative-algorithm", "DRAFT_MODEL", "--speculative-draft-model-path", str(missing),
                   wait_healthy=False)
    assert server.proc.wait(timeout=120) != 0
    assert "no config.json in the draft model path" in server.log()
    assert "the engine failed to load" in server.log()


# -- 4: bounded shutdown ----------------------------------------------------------------------------------------
def test_sigterm_drains_for_the_timeout_then_ends_streams_with_an_error(serve):
    """SIGTERM lets the stream run for --shutdown-timeout, then ends it with an error event and [DONE]; the
    server exits 0 and takes the engine with it. (Before: no bound; it waited for the whole stream.)"""
    server = serve("--shutdown-timeout", "1")
    stream = Stream(server.base)
    assert stream.first_token.wait(30) and stream.status == 200
    engine = server.engine_pid()
    os.kill(server.proc.pid, signal.SIGTERM)
    start = time.monotonic()
    at_signal = len(stream.events)
    assert server.proc.wait(timeout=20) == 0
    took = time.monotonic() - start
    print(f"drain with --shutdown-timeout 1: the server exited {took:.2f} s after SIGTERM")
    assert stream.closed.wait(5)
    assert len(stream.events) > at_signal + 2, "the stream did not run on during the drain"
    assert stream.events[-1] == "[DONE]"
    assert stream.finish_reason() is None and "shutting down" in stream.errors()[0]["message"]
    assert 1 <= took < 8
    assert not _alive(engine)


def test_a_second_sigterm_exits_at_once(serve):
    """(Before: a second SIGTERM did nothing.)"""
    server = serve("--shutdown-timeout", "60")
    stream = Stream(server.base)
    assert stream.first_token.wait(30) and stream.status == 200
    engine = server.engine_pid()
    os.kill(server.proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert server.proc.poll() is None, "the first SIGTERM should drain, not exit"
    os.kill(server.proc.pid, signal.SIGTERM)
    start = time.monotonic()
    server.proc.wait(timeout=10)
    print(f"second SIGTERM: exited {time.monotonic() - start:.2f} s later, code {server.proc.returncode}")
    assert time.monotonic() - start < 5
    assert _wait_until(lambda: not _alive(engine), 5) is not None


def test_ctrl_c_ends_streams_with_an_error_event_and_stops_the_engine(serve):
    """Ctrl-C sends SIGINT to the whole process group, the engine included: the engine must not die under the
    streams, which end with an error event and [DONE] after the drain. (Before: streams cut with neither, and
    the engine orphaned.)"""
    server = serve("--shutdown-timeout", "0.5")
    stream = Stream(server.base)
    assert stream.first_token.wait(30) and stream.status == 200
    engine = server.engine_pid()
    os.killpg(server.proc.pid, signal.SIGINT)
    assert server.proc.wait(timeout=20) == 0
    assert stream.closed.wait(5)
    assert stream.events[-1] == "[DONE]"
    assert "shutting down" in stream.errors()[0]["message"]
    assert _wait_until(lambda: not _alive(engine), 5) is not None
