"""A bursty trace through the online server: Poisson arrivals whose rate switches between a low one and a
saturating one every `--period` seconds, sent by the official openai client (streaming chat, greedy,
`ignore_eos`), the same arrivals and prompts for every setting. Each setting is a fresh `specserve serve`:
plain decoding, static chains (and a static tree with `--tree`), SGLang's tiers and the adaptive plans (on-off
and goodput; with `--tree`, goodput configured for the tree too).

It reports per setting the goodput (output tokens per second from the first arrival to the last answer) and
p50 / p99 TPOT over requests. One server at a time, in a fixed order: on a shared machine, compare settings of
one run, never across runs, and repeat in reverse order (`--reverse`) so that a drifting machine shows.
Writes JSON to benchmarks/results.

Docs figure it reproduces: the CPU bursty trace in docs/speculative.md (`bursty_cpu.json`), with

    python benchmarks/bursty_trace.py --period 10 --duration 40 --low-rate 0.2 --high-rate 3 --max-tokens 32

(defaults: the embedded SmolLM2 with its bundled head, chains up to its 5 steps; on a GPU pass the target and
head flags after `--`, e.g. `-- --model-path M --speculative-draft-model-path H`; `--spec-flags` go to the
speculative settings alone, e.g. simulated acceptance for a random head: `benchmarks/gpu_h200.sh bursty_a`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def settings(steps: int, tree: list[int] | None = None) -> dict[str, list[str]]:
    """Setting name -> `specserve serve` flags. `tree` (top-k, steps, tokens): a static tree too, and a goodput
    plan configured for that tree (chains and smaller trees below it)."""
    chain = ["--speculative-algorithm", "EAGLE3"]
    static = {f"static chain {d}": [*chain, "--speculative-num-steps", str(d), "--disable-speculative-adaptive"]
              for d in sorted({1, 3, steps})}
    deepest = [*chain, "--speculative-num-steps", str(steps)]
    shapes = {"plain": ["--speculative-algorithm", "NONE"], **static}
    if tree:
        topk, depth, tokens = tree
        tree_flags = [*chain, "--speculative-num-steps", str(depth), "--speculative-eagle-topk", str(topk),
                      "--speculative-num-draft-tokens", str(tokens)]
        shapes[f"static tree {topk}/{depth}/{tokens}"] = [*tree_flags, "--disable-speculative-adaptive"]
    plans = {"sglang tiers": [*deepest, "--speculative-policy", "sglang-tiers"],
             "adaptive on-off": [*deepest, "--speculative-policy", "on-off"],
             "adaptive goodput": [*deepest, "--speculative-policy", "goodput"]}
    if tree:
        plans["adaptive goodput (tree)"] = [*tree_flags, "--speculative-policy", "goodput"]
    return {**shapes, **plans}


def arrivals(duration: float, period: float, low: float, high: float, seed: int) -> list[float]:
    """Poisson arrivals over `duration` seconds, at `low` per second in even periods and `high` in odd ones."""
    rng, times, t = random.Random(seed), [], 0.0
    while t < duration:
        switch = (int(t // period) + 1) * period
        arrival = t + rng.expovariate(high if int(t // period) % 2 else low)
        # Past the switch, draw afresh from it at the new rate: the process has no memory.
        t = min(arrival, switch)
        if arrival < min(switch, duration):
            times.append(arrival)
    return times


def run_setting(name: str, flags: list[str], extra: list[str], prompts, trace: list[float], args) -> dict:
    if name != "plain":
        extra = extra + args.spec_flags.split()
    from specserve.bench.report import distribution
    from specserve.bench.serving import LoadSettings, make_client, probe, run_arrivals, wait_until_healthy

    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(args.port), *flags, *extra]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_healthy(url, server)
        model, _ = probe(url, None)
        load = LoadSettings("chat", model, args.max_tokens, 0.0, True)

        async def go():
            client = make_client(url, None, 64, 600)
            await run_arrivals(client, prompts[:4], [0.0] * 4, load)  # warm-up: kernels, first costs
            return await run_arrivals(client, prompts, trace, load)
        results = asyncio.run(go())
    finally:
        server.terminate()
        server.wait()
    ok = [r for r in results if r.ok]
    span = max(r.end for r in ok) - min(r.start for r in results)
    tokens = sum(r.output_tokens for r in ok)
    steps, accepted = sum(r.spec_steps for r in ok), sum(r.spec_accepted for r in ok)
    tpot = distribution([r.tpot for r in ok if r.tpot is not None])  # in ms
    return {"setting": name, "requests": len(results), "failed": len(results) - len(ok), "output_tokens": tokens,
            "goodput_tok_s": tokens / span, "tpot_ms_p50": tpot.get("p50"), "tpot_ms_p99": tpot.get("p99"),
            "mean_acceptance_length": 1 + accepted / steps if steps else None, "flags": flags + extra}


def main() -> None:
    from specserve.bench.datasets import mt_bench_first_turns
    from specserve.bench.decode import hardware_info

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--period", type=float, default=20.0, help="seconds between rate switches")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    parser.add_argument("--low-rate", type=float, default=0.5, help="requests per second in quiet periods")
    parser.add_argument("--high-rate", type=float, default=20.0, help="requests per second in bursts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="the deepest chain (the bundled head's default: 5)")
    parser.add_argument("--tree", nargs=3, type=int, metavar=("TOPK", "STEPS", "TOKENS"),
                        help="add a static tree of this shape, and the goodput plan configured for it")
    parser.add_argument("--only", nargs="+", help="run only these settings (names as in the output)")
    parser.add_argument("--reverse", action="store_true",
                        help="run the settings in reverse order (a second run so drift lands on both ends)")
    parser.add_argument("--port", type=int, default=30571)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spec-flags", default="", help="flags the speculative settings get besides (one string)")
    parser.add_argument("--out", default=str(RESULTS / "bursty_cpu.json"))
    parser.add_argument("serve_flags", nargs=argparse.REMAINDER, help="after --: flags every server gets")
    args = parser.parse_args()
    extra = [f for f in args.serve_flags if f != "--"]
    trace = arrivals(args.duration, args.period, args.low_rate, args.high_rate, args.seed)
    questions = mt_bench_first_turns()
    prompts = [questions[i % len(questions)] for i in range(len(trace))]
    rows = []
    order = list(settings(args.steps, args.tree).items())
    for name, flags in reversed(order) if args.reverse else order:
        if args.only and name not in args.only:
            continue
        rows.append(run_setting(name, flags, extra, prompts, trace, args))
        print(json.dumps(rows[-1]), flush=True)
    record = {"benchmark": "bursty_trace", "dataset": "mt-bench first turns", "period_s": args.period,
              "duration_s": args.duration, "rates_per_s": [args.low_rate, args.high_rate],
              "max_tokens": args.max_tokens, "requests": len(trace), "hardware": hardware_info(), "results": rows}
    Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
