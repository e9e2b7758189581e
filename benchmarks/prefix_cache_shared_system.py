"""A shared system prompt before many requests, prefix caching on and off, offline: prefill tokens computed and
output tok/s.

Every request is the same `--system-len`-token system prompt followed by `--user-len` tokens of its own (seeded
random ids), greedy, `--output-len` tokens with EOS ignored, all submitted at once and run `--concurrency` at a
time (max_running_requests). Prefill tokens computed are the prompt tokens admitted less those served from the
cache (the engine's own counters, so recomputes after preemption count too). The two settings run one after the
other in this process, each after an untimed warm-up.

    # H200, the 8B dummy (issue's figure): 2,000-token system prompt, 250 requests at C = 250
    python benchmarks/prefix_cache_shared_system.py --model-path llama-3.1-8b --load-format dummy \\
        --out benchmarks/results/prefix_cache_shared_system_h200.json
    # CPU, small: SmolLM2, 200-token system prompt, 16 requests
    python benchmarks/prefix_cache_shared_system.py --device cpu --system-len 200 --num-requests 16 \\
        --concurrency 16 --output-len 32 --out benchmarks/results/prefix_cache_shared_system_cpu.json
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import torch

from specserve.bench.decode import hardware_info
from specserve.cli import add_engine_args, engine_config
from specserve.core import SamplingParams
from specserve.llm import LLM


def _prompts(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(100, vocab) for _ in range(args.system_len)]
    return [system + [rng.randrange(100, vocab) for _ in range(args.user_len)] for _ in range(args.num_requests)]


def _run(config, args) -> dict:
    llm = LLM(config=config)
    vocab = llm.engine.vocab_size
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up, untimed
    scheduler = llm.engine.scheduler
    cache = scheduler.prefix_cache
    queried0, hit0 = (cache.queried_tokens, cache.hit_tokens) if cache else (0, 0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(_prompts(args, vocab), params)
    seconds = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    queried = cache.queried_tokens - queried0 if cache else prompt_tokens
    hit = cache.hit_tokens - hit0 if cache else 0
    output_tokens = sum(len(o.token_ids) for o in outs)
    return {"prefix_caching": config.cache.enable_prefix_caching, "seconds": seconds,
            "prompt_tokens": prompt_tokens, "admitted_tokens": queried, "cached_tokens": hit,
            "prefill_tokens_computed": queried - hit, "output_tokens": output_tokens,
            "output_tok_s": output_tokens / seconds, "preemptions": scheduler.num_preemptions,
            "device": str(llm.engine.runner.device)}


def _release() -> None:
    """Frees the finished engine's memory for the next one (an engine keeps its startup objects out of the
    collector's view until then)."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(parser)
    parser.add_argument("--system-len", type=int, default=2000)
    parser.add_argument("--user-len", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=250)
    parser.add_argument("--concurrency", type=int, default=250)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/prefix_cache_shared_system.json")
    args = parser.parse_args()
    args.max_running_requests = args.concurrency
    base = engine_config(args)
    rows = []
    for caching in (True, False):
        config = replace(base, cache=replace(base.cache, enable_prefix_caching=caching))
        rows.append(_run(config, args))
        print(json.dumps(rows[-1]), flush=True)
        _release()
    on, off = rows
    report = {"command": "python benchmarks/prefix_cache_shared_system.py", "date": dt.date.today().isoformat(),
              "hardware": hardware_info(), "model": base.model_path or "embedded SmolLM2-135M-Instruct",
              "load_format": base.load_format, "speculative_algorithm": base.spec.algorithm,
              "system_len": args.system_len, "user_len": args.user_len, "num_requests": args.num_requests,
              "concurrency": args.concurrency, "output_len": args.output_len, "results": rows,
              "prefill_computed_drop": 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"],
              "throughput_ratio_on_over_off": on["output_tok_s"] / off["output_tok_s"]}
    print(json.dumps({k: report[k] for k in ("prefill_computed_drop", "throughput_ratio_on_over_off")}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
