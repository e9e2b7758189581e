"""`specserve bench` through the smg gateway in front of 1 and then 2 replicas of the default server (the
embedded SmolLM2-135M drafting with its bundled EAGLE-3 head), on the CPU, closed loop at C = 8 and 32.

Docs figure it reproduces: the scale-out table in docs/scale-out.md (`scale_out_cpu.json`): output tok/s and
p99 TTFT per replica count and concurrency, and the 2-replica/1-replica throughput ratio.

Each replica gets an equal share of the cores (`--dp-size` sets OMP_NUM_THREADS), so 2 replicas can only beat
1 where one replica leaves cores idle or one engine's Python step loop is the bound: the ratio says how much
of the machine one replica leaves unused. The JSON records the core count and load average with the figures.

    python benchmarks/scale_out_cpu.py [--num-prompts 64] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specserve.distributed.ranks import free_port

RESULTS = Path(__file__).parent / "results"
# The launcher of `serve --dp-size`, callable for one replica too (the CLI runs a plain server for 1).
_LAUNCH = ("import sys\n"
           "from specserve.config import ScaleOutConfig, ServerConfig\n"
           "from specserve.server.replicas import serve_replicas\n"
           "sys.exit(serve_replicas(ServerConfig(port=int(sys.argv[1]), shutdown_timeout=5), "
           "ScaleOutConfig(int(sys.argv[2])), sys.argv[3:], on_cpu=True))\n")


def wait_ready(base: str, replicas: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the launcher exited"
        try:
            if httpx.get(base + "/readiness", timeout=2).json().get("healthy_workers") == replicas:
                return
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError("the replicas did not come up")


def run(replicas: int, args, log_dir: Path) -> list[dict]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with (log_dir / f"launcher-{replicas}.log").open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, str(port), str(replicas), *args.serve_flags],
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(base, replicas, proc)
        out = log_dir / f"bench-{replicas}.jsonl"
        subprocess.run([sys.executable, "-m", "specserve.cli", "bench", "--base-url", base, "--dataset",
                        args.dataset, "--concurrency", ",".join(map(str, args.concurrency)), "--num-prompts",
                        str(args.num_prompts), "--max-tokens", str(args.max_tokens), "--ignore-eos", "--quiet",
                        "--label", f"{replicas} replica(s) behind smg", "--out", str(out)], check=True)
        return [json.loads(line) for line in out.read_text().splitlines()]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dataset", default="mt-bench")
    p.add_argument("--serve-flags", nargs=argparse.REMAINDER, default=[],
                   help="flags for every replica (default: the default server)")
    p.add_argument("--out", default=str(RESULTS / "scale_out_cpu.json"))
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for replicas in (1, 2):
            for record in run(replicas, args, Path(tmp)):
                rows.append({"replicas": replicas, "concurrency": record["concurrency"],
                             "output_tok_s": record["output_tok_s"], "p99_ttft_ms": record["ttft_ms"]["p99"],
                             "completed": record["completed"], "errors": record["errors"],
                             "mean_acceptance_length": record["mean_acceptance_length"]})
                hardware = record["hardware"]
    ratio = {}
    for c in args.concurrency:
        one, two = ([r["output_tok_s"] for r in rows if r["replicas"] == n and r["concurrency"] == c][0]
                    for n in (1, 2))
        ratio[str(c)] = two / one
    result = {"what": "specserve bench through smg: 1 vs 2 replicas of the default server, CPU",
              "command": "python benchmarks/scale_out_cpu.py " + " ".join(sys.argv[1:]),
              "hardware": hardware, "dataset": args.dataset, "num_prompts": args.num_prompts,
              "max_tokens": args.max_tokens, "rows": rows, "throughput_ratio_2_over_1": ratio}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"rows": rows, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
