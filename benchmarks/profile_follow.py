"""Where the draft head's passes outside the step programs spend their time: the follow-along in steps with
prompts (`extend_drafter`) and the backlog pass before a drafting step (`catch_up_backlog`). Llama-3.1-8B
shape, random bf16 weights, an EAGLE-3 tree with simulated acceptance, C requests in a closed loop.

Each call is timed with a device synchronisation on either side; a few of them run under torch.profiler, and
their heaviest operators (host and device time) are printed and saved.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specserve.config import EngineConfig, SchedulerConfig, SpecConfig
from specserve.llm import LLM
from specserve.core import SamplingParams


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(name: str, fn, log: list, profiled: list, profile_calls: int):
    def wrapper(batch):
        tokens = sum(len(s.draft_catchup_ids) for s in batch.seqs)
        sync()
        start = time.perf_counter()
        if len(profiled) < profile_calls and tokens > 256:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                result = fn(batch)
                sync()
            table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60)
            profiled.append({"call": name, "seqs": len(batch.seqs), "tokens": tokens, "table": table})
        else:
            result = fn(batch)
        sync()
        log.append({"call": name, "seqs": len(batch.seqs), "tokens": tokens,
                    "ms": round(1e3 * (time.perf_counter() - start), 2)})
        return result
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=30)
    parser.add_argument("--requests", type=int, default=90)
    parser.add_argument("--profile-calls", type=int, default=3)
    parser.add_argument("--model-path", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", default="benchmarks/results/profile_follow_h200.json")
    args = parser.parse_args()
    config = EngineConfig(model_path=args.model_path, load_format="dummy", dtype="bfloat16", device=args.device,
                          context_length=2048, scheduler=SchedulerConfig(chunked_prefill_size=16384),
                          spec=SpecConfig("EAGLE3", None, 5, 4, 16, simulate_accept_len=4.0))
    llm = LLM(config=config)
    runner = llm.engine.runner
    log, profiled = [], []
    proposer = runner.proposer
    proposer.extend_drafter = timed("follow", proposer.extend_drafter, log, profiled, args.profile_calls)
    program = runner.spec_graphs  # none on a CPU, where trees take the general search
    if program is not None:
        program.catch_up_backlog = timed("backlog", program.catch_up_backlog, log, profiled, args.profile_calls)
    rng = random.Random(0)
    vocab = llm.model_info.model_cfg.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    pending, live = list(prompts), []
    while pending or live:
        while pending and len(live) < args.concurrency:
            live.append(llm.add(pending.pop(), params))
        llm.step_and_track(live)
        live = [t for t in live if not t.output.finished]
    for entry in profiled:
        print(f"--- {entry['call']}: {entry['seqs']} sequences, {entry['tokens']} tokens")
        print(entry["table"])
    for name in ("follow", "backlog"):
        calls = [e for e in log if e["call"] == name]
        if calls:
            total = sum(e["ms"] for e in calls)
            print(f"{name}: {len(calls)} calls, {total:.1f} ms, slowest {sorted(calls, key=lambda e: -e['ms'])[:5]}")
    with open(args.out, "w") as f:
        json.dump({"calls": log, "profiles": profiled}, f, indent=1)


if __name__ == "__main__":
    main()
