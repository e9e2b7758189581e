"""No speculation, a chain that drafts in every step, and the same chain under the adaptive plan, side by side
in one process: the embedded SmolLM2 with its bundled head, waves of C MT-Bench first turns (greedy,
`ignore_eos`, 64 tokens each).

Docs figures it reproduces: the adaptive plan on the 2-core CPU (output tok/s against no speculation at wave
sizes 1-64, `adaptive_cpu_interleaved.json`); with `--temperature 0.7 --general-search --no-adaptive`, sampled
speculation through the chain program against the general search (`sampled_spec_cpu.json`).

With `--temperature T --general-search`, requests sample and a fourth engine drafts every step through the general
search instead of the chain program: its requests carry a seed each, and seeded requests, which draw from their
own generators, take the general search. The program's sampled acceptance against the search's, same run.

The engines take turns within each wave size, and the order flips every round, so a slow spell of a
shared machine lands on all of them alike (sequential runs of `specserve bench` on the 2-core CPU drifted by
up to 25 % within minutes). The adaptive engine keeps what it measured from one wave to the next, as a
server does. Writes JSON and a PNG to benchmarks/results.

    python benchmarks/adaptive_cpu.py [--levels 1 8 32 64] [--rounds 2] [--temperature 0.7 --general-search]
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import replace
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SEEDS = itertools.count()  # a fresh seed for every seeded request, so that rounds do not repeat each other's draws


def build(spec):
    from specserve.config import EngineConfig
    from specserve import LLM

    return LLM(config=EngineConfig(device="cpu", spec=spec), progress=False)


def generate(llm, prompts, params, seeded: bool):
    """`llm.generate`, or with `seeded`, each request with a seed of its own (which takes the general search)."""
    if not seeded:
        return llm.generate(prompts, params)
    trackers = [llm.add(p, replace(params, seed=next(SEEDS))) for p in prompts]
    while llm.engine.has_work():
        llm.step_and_track(trackers)
    return [t.output for t in trackers]


def run_waves(llm, prompts, size: int, params, seeded: bool = False) -> tuple[int, float, int, int]:
    """Output tokens, seconds, speculative steps and accepted drafts over waves of `size` prompts."""
    tokens = steps = accepted = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), size):
        for out in generate(llm, prompts[i:i + size], params, seeded):
            tokens += len(out.token_ids)
            steps += out.num_spec_steps
            accepted += out.num_accepted_tokens
    return tokens, time.perf_counter() - start, steps, accepted


def main() -> None:
    from specserve import draft_heads
    from specserve.bench.datasets import mt_bench_first_turns
    from specserve.bench.decode import hardware_info
    from specserve.config import SpecConfig
    from specserve import SamplingParams

    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--general-search", action="store_true",
                        help="also a chain drafting every step through the general search, not the program")
    parser.add_argument("--no-adaptive", action="store_true", help="leave out the adaptive engine")
    parser.add_argument("--no-every-step", action="store_true",
                        help="leave out the engine that drafts every step (the slowest, for a shorter run)")
    parser.add_argument("--out", default=str(RESULTS / "adaptive_cpu_interleaved.json"))
    args = parser.parse_args()
    if args.general_search and args.temperature == 0:
        parser.error("--general-search needs --temperature above 0: greedy requests take the program, seeded or not")

    head = str(draft_heads.SMOLLM2_HEAD)
    steps = draft_heads.SMOLLM2_DEFAULT_STEPS
    engines = {"no speculation": build(SpecConfig())}
    if not args.no_every_step:
        engines[f"chain {steps}, every step"] = build(SpecConfig("EAGLE3", head, steps))
    searched = f"chain {steps}, every step, general search"
    if args.general_search:
        engines[searched] = build(SpecConfig("EAGLE3", head, steps))
    if not args.no_adaptive:
        engines[f"chain {steps}, adaptive"] = build(SpecConfig("EAGLE3", head, steps, adaptive=True))
    first = next(iter(engines.values()))
    prompts = [first.chat_prompt(p.messages) for p in mt_bench_first_turns()]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True)
    for name, llm in engines.items():  # warm-up: kernels built on first use, costs first measured
        run_waves(llm, prompts[:2], 2, params, name == searched)
    results = []
    for size in args.levels:
        batch = prompts[: max(8, min(64, 4 * size))]
        totals = {name: [0, 0.0, 0, 0] for name in engines}
        for round_ in range(args.rounds):
            order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
            for name in order:
                figures = run_waves(engines[name], batch, size, params, name == searched)
                totals[name] = [a + b for a, b in zip(totals[name], figures)]
        base = totals["no speculation"][0] / totals["no speculation"][1]
        for name, (tokens, seconds, spec_steps, accepted) in totals.items():
            row = {"concurrency": size, "setting": name, "prompts": len(batch), "output_tokens": tokens,
                   "output_tok_s": tokens / seconds, "vs_no_speculation": tokens / seconds / base,
                   "spec_steps": spec_steps,
                   "mean_acceptance_length": 1 + accepted / spec_steps if spec_steps else None}
            results.append(row)
            print(json.dumps(row), flush=True)
    record = {"benchmark": "adaptive_cpu", "dataset": "mt-bench first turns", "max_tokens": args.max_tokens,
              "temperature": args.temperature,
              "rounds": args.rounds, "hardware": hardware_info(), "results": results}
    Path(args.out).write_text(json.dumps(record, indent=2))
    plot(results, Path(args.out).with_suffix(".png"))


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["setting"] for r in results):
        rows = [r for r in results if r["setting"] == name]
        ax.plot([r["concurrency"] for r in rows], [r["vs_no_speculation"] for r in rows], marker="o", label=name)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("wave size (concurrent requests)")
    ax.set_ylabel("output tok/s ÷ no speculation")
    ax.set_title("SmolLM2-135M + bundled head, 2-core CPU, interleaved")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
