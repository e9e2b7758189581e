"""The default server (`specserve serve`, which drafts with the bundled EAGLE-3 head) against the same server
with speculation off, one request at a time, greedy, on MT-Bench first turns; then waves of C concurrent
requests (32 and 64 by default, 64 tokens each) on each server in turn.

Docs figure it reproduces: the default server against speculation off through the server at batch 1 and at
C = 32 and 64 on the 2-core CPU (tok/s and their ratios, `default_server_cpu.json` and `.png`).

Both servers run side by side and take turns, prompt by prompt (the order flips every prompt), so a slow
spell of a shared machine lands on both alike; two runs measured back to back minutes apart differed by up
to 25 % on the same side. Writes JSON and a PNG of per-prompt decode speeds to benchmarks/results.

    python benchmarks/default_server_cpu.py [--num-prompts 24] [--concurrency 32 64]
        [--default-flags "--speculative-num-steps 5"]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path


from specserve.bench.datasets import mt_bench_first_turns
from specserve.bench.serving import LoadSettings, make_client, probe, run_closed_loop, wait_until_healthy

RESULTS = Path(__file__).parent / "results"


def start_server(port: int, flags: list[str], log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(port), *flags]
    with log.open("w") as sink:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} logical cores"
    return f"{os.cpu_count()} logical cores"


async def one_request(client, prompt, settings: LoadSettings):
    """One streamed request through the OpenAI client, timed chunk by chunk."""
    return (await run_closed_loop(client, [prompt], 1, settings))[0]


def decode_tok_s(result) -> float:
    return 1 / result.tpot


def summarize(results) -> dict:
    decode_s = sum(r.latency - r.ttft for r in results)
    steps = sum(r.spec_steps for r in results)
    return {
        "requests": len(results),
        "output_tokens": sum(r.output_tokens for r in results),
        "output_tok_s": sum(r.output_tokens for r in results) / sum(r.latency for r in results),
        "decode_tok_s": sum(r.output_tokens - 1 for r in results) / decode_s,
        "ttft_ms_median": 1000 * statistics.median(r.ttft for r in results),
        "mean_acceptance_length": (steps + sum(r.spec_accepted for r in results)) / steps if steps else None,
    }


async def run(args) -> dict:
    labels = ("spec-off", "default")
    ports = (args.port, args.port + 1)
    flags = (["--speculative-algorithm", "NONE"], shlex.split(args.default_flags))
    servers = []
    try:
        for port, f, label in zip(ports, flags, labels):
            servers.append(start_server(port, f, Path(f"/tmp/specserve-{label}.log")))
        for port, server in zip(ports, servers):
            wait_until_healthy(f"http://127.0.0.1:{port}", server, timeout_s=900)
        clients = [make_client(f"http://127.0.0.1:{port}", None, 1, 600) for port in ports]
        model = probe(f"http://127.0.0.1:{ports[0]}", None)[0]
        settings = LoadSettings("chat", model, args.max_tokens, 0.0, False)
        prompts = mt_bench_first_turns()[: args.num_prompts]
        for client in clients:  # warm-up: first-call allocations, kernel selection
            await one_request(client, prompts[0], LoadSettings("chat", model, 16, 0.0, False))
        results: dict[str, list] = {label: [] for label in labels}
        for i, prompt in enumerate(prompts):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for side in order:
                result = await one_request(clients[side], prompt, settings)
                if not result.ok:
                    raise RuntimeError(f"{labels[side]}: {result.error}")
                results[labels[side]].append(result)
            off, on = results["spec-off"][-1], results["default"][-1]
            if off.tpot and on.tpot:
                print(f"prompt {i}: {off.output_tokens} / {on.output_tokens} tokens, decode "
                      f"{decode_tok_s(off):.1f} / {decode_tok_s(on):.1f} tok/s", flush=True)
        waves = [await concurrent_waves(ports, labels, model, c, args, flip=k % 2 == 1)
                 for k, c in enumerate(args.concurrency)]
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    summary = {label: summarize(rs) for label, rs in results.items()}
    for wave in waves:
        print(f"C={wave['concurrency']}: {wave['ratio']:.3f}x of speculation off", flush=True)
    per_prompt = [decode_tok_s(b) / decode_tok_s(a) for a, b in zip(results["spec-off"], results["default"])
                  if a.tpot and b.tpot]
    return {
        "benchmark": "default_server_cpu", "dataset": "mt-bench first turns", "max_tokens": args.max_tokens,
        "default_flags": args.default_flags, "cpu": cpu_name(),
        "same_token_counts": all(a.output_tokens == b.output_tokens
                                 for a, b in zip(results["spec-off"], results["default"])),
        "summary": summary,
        "decode_speedup": summary["default"]["decode_tok_s"] / summary["spec-off"]["decode_tok_s"],
        "output_speedup": summary["default"]["output_tok_s"] / summary["spec-off"]["output_tok_s"],
        "per_prompt_decode_speedup": {"median": statistics.median(per_prompt), "min": min(per_prompt),
                                      "max": max(per_prompt)},
        "concurrent": waves,
        "per_prompt": [{"prompt": i, **{label: {"output_tokens": rs[i].output_tokens,
                                                "latency_s": rs[i].latency, "ttft_s": rs[i].ttft,
                                                "spec_steps": rs[i].spec_steps}
                                        for label, rs in results.items()}}
                       for i in range(len(prompts))],
    }


async def concurrent_waves(ports, labels, model: str, concurrency: int, args, flip: bool) -> dict:
    """`args.wave_rounds` × C requests kept C at a time (greedy, `ignore_eos`, `args.wave_max_tokens` tokens
    each), on each server in turn, `args.wave_repeats` times with the order flipped each time, after a warm-up
    wave of C short requests on each (as `specserve bench` warms each level; the adaptive plan meets a batch
    size it has not timed): output tok/s over the waves' wall time, and their ratio."""
    questions = mt_bench_first_turns()
    prompts = [questions[i % len(questions)] for i in range(args.wave_rounds * concurrency)]
    settings = LoadSettings("chat", model, args.wave_max_tokens, 0.0, True)
    clients = [make_client(f"http://127.0.0.1:{port}", None, concurrency, 600) for port in ports]
    for client in clients:
        await run_closed_loop(client, prompts[-concurrency:], concurrency, replace(settings, max_tokens=16))
    waves: dict[str, list] = {label: [] for label in labels}
    for repeat in range(args.wave_repeats):
        for side in ((1, 0) if flip != (repeat % 2 == 1) else (0, 1)):
            start = time.perf_counter()
            results = await run_closed_loop(clients[side], prompts, concurrency, settings)
            failed = [r.error for r in results if not r.ok]
            if failed:
                raise RuntimeError(f"{labels[side]} at C={concurrency}: {failed[0]}")
            waves[labels[side]].append((time.perf_counter() - start, results))
    rates = {label: _wave_rates(runs) for label, runs in waves.items()}
    return {"concurrency": concurrency, "requests_per_wave": len(prompts), "repeats": args.wave_repeats, **rates,
            "ratio": rates["default"]["output_tok_s"] / rates["spec-off"]["output_tok_s"]}


def _wave_rates(runs: list) -> dict:
    results = [r for _, rs in runs for r in rs]
    tokens = sum(r.output_tokens for r in results)
    seconds = sum(s for s, _ in runs)
    return {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "per_wave_tok_s": [sum(r.output_tokens for r in rs) / s for s, rs in runs],
            "mean_acceptance_length": summarize(results)["mean_acceptance_length"],
            "spec_steps": sum(r.spec_steps for r in results)}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["per_prompt"]
    speeds = {label: [(r[label]["output_tokens"] - 1) / (r[label]["latency_s"] - r[label]["ttft_s"]) for r in rows]
              for label in ("spec-off", "default")}
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.4
    for shift, (label, values) in zip((-width / 2, width / 2), speeds.items()):
        ax.bar([i + shift for i in range(len(values))], values, width, label=label)
    ax.set_xlabel("MT-Bench first turn")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"default server vs speculation off, batch 1, {report['cpu']}: "
                 f"{report['decode_speedup']:.2f}x decode, interleaved", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[32, 64],
                        help="after batch 1, waves at these concurrencies (none: batch 1 only)")
    parser.add_argument("--wave-rounds", type=int, default=2, help="a wave's requests, in multiples of C")
    parser.add_argument("--wave-max-tokens", type=int, default=64)
    parser.add_argument("--wave-repeats", type=int, default=2, help="waves per server and level, order flipped")
    parser.add_argument("--port", type=int, default=30556)
    parser.add_argument("--default-flags", default="", help="extra flags for the speculating server")
    parser.add_argument("--out", default=str(RESULTS / "default_server_cpu.json"))
    args = parser.parse_args()
    report = asyncio.run(run(args))
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    s = report["summary"]
    print(f"decode {s['spec-off']['decode_tok_s']:.1f} -> {s['default']['decode_tok_s']:.1f} tok/s "
          f"({report['decode_speedup']:.2f}x), output {report['output_speedup']:.2f}x, "
          f"tau {s['default']['mean_acceptance_length']}")


if __name__ == "__main__":
    main()
