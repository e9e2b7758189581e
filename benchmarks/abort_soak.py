"""The abort soak: thousands of streamed requests that hang up early leave no KV page in use and do not grow
the engine's memory.

Starts `specserve serve` (the embedded default model unless --model-path, on the CPU unless --device) and opens
--streams streamed chat requests through the official `openai` client, --concurrency at a time, in waves. Each
request reads 0 to 4 chunks (by its index, so some hang up while queued or in prefill and most while decoding)
and then closes its connection, which aborts it in the engine. The engine process's RSS is read after
--warmup-waves uncounted waves and again at the end, once the server is idle; `/metrics` then gives the KV pages
in use, which must be 0.

Docs figure it reproduces: the abort soak in docs/reliability.md (`abort_soak_cpu.json`).

    python benchmarks/abort_soak.py --out benchmarks/results/abort_soak_cpu.json [--streams 2000]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import psutil

from specserve.bench.serving import wait_until_healthy

PROMPTS = [
    "Write a long story about a lighthouse keeper.",
    "Explain how a hash map works, step by step.",
    "List every country in Europe with its capital.",
    "Describe the water cycle in detail.",
    "What are the rules of chess? Explain each piece.",
]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} logical cores"
    return f"{platform.processor() or 'unknown CPU'}, {os.cpu_count()} logical cores"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_process(server: subprocess.Popen) -> psutil.Process:
    """The engine core: the server's child started through multiprocessing's spawn (not its resource tracker)."""
    for child in psutil.Process(server.pid).children(recursive=True):
        if "spawn_main" in " ".join(child.cmdline()):
            return child
    raise RuntimeError("no engine process under the server")


def read_metrics(base: str, headers: dict[str, str]) -> dict[str, float]:
    text = httpx.get(base + "/metrics", headers=headers, timeout=10).text
    values = {}
    for line in text.splitlines():
        if line.startswith("specserve_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = int(float(value)) if float(value).is_integer() else float(value)
    return values


def wait_idle(base: str, headers: dict[str, str], timeout_s: float) -> tuple[dict[str, float], float]:
    """Polls /metrics until nothing runs, waits or holds a page (or the timeout); returns the last reading and
    the seconds it took."""
    start = time.monotonic()
    while True:
        metrics = read_metrics(base, headers)
        busy = sum(metrics.get(name, 0.0) for name in ("specserve_num_requests_running",
                                                        "specserve_num_requests_waiting", "specserve_kv_pages_used"))
        if busy == 0 or time.monotonic() - start > timeout_s:
            return metrics, time.monotonic() - start
        time.sleep(0.2)


async def one_stream(client: openai.AsyncOpenAI, model: str, index: int, max_tokens: int) -> str:
    """Opens a streamed request, reads index % 5 chunks, then hangs up. Returns how it went."""
    chunks_to_read = index % 5
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
            max_tokens=max_tokens, temperature=0.0, stream=True)
    except openai.RateLimitError:
        return "rejected_429"
    except openai.APIError as exc:
        return f"error: {type(exc).__name__}"
    read = 0
    try:
        if chunks_to_read:
            async for _ in stream:
                read += 1
                if read >= chunks_to_read:
                    break
            else:
                return "finished"  # the stream ended before the client meant to hang up
    finally:
        await stream.close()  # closes the connection mid-stream: the server aborts the request
    return "aborted"


async def wave(client: openai.AsyncOpenAI, model: str, first: int, count: int, max_tokens: int) -> list[str]:
    return await asyncio.gather(*(one_stream(client, model, first + i, max_tokens) for i in range(count)))


async def soak(args, base: str, server: subprocess.Popen, headers: dict[str, str]) -> dict:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=args.api_key or "none", max_retries=0,
                                timeout=120,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=args.concurrency)))
    model = (await client.models.list()).data[0].id
    engine = engine_process(server)
    front_end = psutil.Process(server.pid)
    for w in range(args.warmup_waves):
        await wave(client, model, w * args.concurrency, args.concurrency, args.max_tokens)
    warm_metrics, _ = wait_idle(base, headers, args.idle_timeout)
    rss_before, front_before = engine.memory_info().rss, front_end.memory_info().rss
    print(f"after {args.warmup_waves} warm-up wave(s): engine RSS {rss_before / 2**20:.1f} MiB, "
          f"pages in use {warm_metrics.get('specserve_kv_pages_used')}", flush=True)

    outcomes: dict[str, int] = {}
    start = time.monotonic()
    opened = 0
    while opened < args.streams:
        count = min(args.concurrency, args.streams - opened)
        for outcome in await wave(client, model, opened, count, args.max_tokens):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        opened += count
        if opened % (10 * args.concurrency) == 0 or opened == args.streams:
            print(f"{opened} streams, {time.monotonic() - start:.0f} s, engine RSS "
                  f"{engine.memory_info().rss / 2**20:.1f} MiB, outcomes {outcomes}", flush=True)
    soak_s = time.monotonic() - start
    await client.close()

    metrics, idle_s = wait_idle(base, headers, args.idle_timeout)
    rss_after, front_after = engine.memory_info().rss, front_end.memory_info().rss
    return {
        "streams_opened": opened,
        "outcomes": outcomes,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "warmup_waves": args.warmup_waves,
        "kv_pages_used_end": metrics.get("specserve_kv_pages_used"),
        "kv_pages_total": metrics.get("specserve_kv_pages_total"),
        "requests_running_end": metrics.get("specserve_num_requests_running"),
        "requests_waiting_end": metrics.get("specserve_num_requests_waiting"),
        "seconds_to_idle_after_last_wave": round(idle_s, 2),
        "engine_rss_before_mib": round(rss_before / 2**20, 2),
        "engine_rss_after_mib": round(rss_after / 2**20, 2),
        "engine_rss_growth_pct": round(100 * (rss_after - rss_before) / rss_before, 3),
        "front_end_rss_before_mib": round(front_before / 2**20, 2),
        "front_end_rss_after_mib": round(front_after / 2**20, 2),
        "front_end_rss_growth_pct": round(100 * (front_after - front_before) / front_before, 3),
        "soak_seconds": round(soak_s, 1),
    }


def stop(server: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL of whatever of the server's process tree is left."""
    tree = [server.pid] + [child.pid for child in psutil.Process(server.pid).children(recursive=True)]
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(timeout=30)
    _, alive = psutil.wait_procs([p for p in map(_process_or_none, tree) if p is not None], timeout=15)
    for process in alive:
        process.kill()


def _process_or_none(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=2000, help="streams opened and aborted, after the warm-up")
    parser.add_argument("--concurrency", type=int, default=50, help="streams open at once (one wave)")
    parser.add_argument("--warmup-waves", type=int, default=2, help="uncounted waves before the first RSS reading")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="each request's max_tokens: more than the chunks it reads, so it is aborted")
    parser.add_argument("--model-path", default=None, help="default: the embedded default model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--server-flags", default="", help="more `specserve serve` flags, one string")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--idle-timeout", type=float, default=60, help="seconds to wait for the server to go idle")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "abort_soak_cpu.json")
    args = parser.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(port), "--device", args.device,
               *(["--model-path", args.model_path] if args.model_path else []),
               *(["--api-key", args.api_key] if args.api_key else []), *shlex.split(args.server_flags)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    log = Path(tempfile.gettempdir()) / f"specserve-abort-soak-{port}.log"
    started = time.monotonic()
    with log.open("w") as sink:  # the child keeps its own copy of the descriptor
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(base, server)
        result = asyncio.run(soak(args, base, server, headers))
    finally:
        stop(server)
    result = {
        "what": "streamed chat requests that hang up after 0-4 chunks, in waves; KV pages in use once idle, "
                "and engine RSS after the warm-up waves against at the end",
        "command": " ".join(shlex.quote(part) for part in command[1:]),
        "model": args.model_path or "embedded default",
        "hardware": cpu_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **result,
        "duration_seconds": round(time.monotonic() - started, 1),
        "server_log": str(log),
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if result["kv_pages_used_end"] != 0:
        sys.exit(f"{result['kv_pages_used_end']} KV pages still in use after the soak")


if __name__ == "__main__":
    main()
