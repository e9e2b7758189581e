"""Batch-1 (and batch-16/64) decode with speculation off, configured but idle, and drafting, on one GPU:
Llama-3.1-8B shape with random bf16 weights by default (`--model-path` takes another shipped config).

Docs figures it reproduces: plain decode at batch 1 (tok/s and device ms a step); speculation at batch 1,
EAGLE-3 chain and tree against plain, acceptance simulated (the chain 3 at tau 3, the top-4 tree of 16 tokens
over 5 levels at tau 4; over 256 output tokens with `--output-len 256`); the cost of speculation switched off
(an EAGLE-3 head configured but a plan of 0 drafts: the graphs replay and the head's taps are stored, against
plain); and the same chain and tree with the head's projections in fp8 (--speculative-draft-model-quantization).
The head is random, of the target's shape.

Per decode step it reports the wall time and the device time of the step's CUDA-graph replays, so the host's share
of a step shows. Engine steps replay their captured graphs through `torch.cuda.CUDAGraph.replay`; wrapping that
method for the timed run times a step's device work without reaching into the engine.

    python benchmarks/spec_off_tax.py --out benchmarks/results/spec_off_tax_h200.json
    python benchmarks/spec_off_tax.py --batch-sizes 1 --output-len 256 --out spec_bs1_256_h200.json
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import time
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from specserve import SamplingParams, envs
from specserve.bench.decode import hardware_info, make_prompts
from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig

BASE = EngineConfig(model_path="llama-3.1-8b", load_format="dummy", dtype="bfloat16", device="cuda",
                    context_length=2048, cache=CacheConfig(max_total_tokens=300_000),
                    scheduler=SchedulerConfig(chunked_prefill_size=40_000))
CHAIN = SpecConfig("EAGLE3", None, 3, simulate_accept_len=3.0)
TREE = SpecConfig("EAGLE3", None, 5, 4, 16, simulate_accept_len=4.0)
# name -> (speculation, drafts per step the plan allows; None: as configured)
SETUPS = {
    "plain": (SpecConfig(), None),
    "EAGLE-3 configured, 0 drafts": (SpecConfig("EAGLE3", None, 3), 0),
    "EAGLE-3 chain 3, simulated tau 3": (CHAIN, None),
    "EAGLE-3 tree top-4, 5 steps, 16 tokens, simulated tau 4": (TREE, None),
    # The same with the head's projections in fp8: what that saves a step. Acceptance is simulated, so its
    # price shows only on a trained head (fp8_head_acceptance_cpu.sh).
    "EAGLE-3 chain 3, fp8 head, simulated tau 3": (replace(CHAIN, draft_model_quantization="fp8"), None),
    "EAGLE-3 tree top-4, 5 steps, 16 tokens, fp8 head, simulated tau 4":
        (replace(TREE, draft_model_quantization="fp8"), None),
}


def build(config: EngineConfig, drafts: int | None = None):
    """An engine for `config`; with `drafts`, the scheduler's draft plan allows that many a step."""
    from specserve import LLM

    llm = LLM(config=config, progress=False)
    if drafts is not None:
        llm.engine.scheduler.draft_plan = lambda request: drafts
    return llm


def release() -> None:
    """Frees what an engine dropped by the caller held, so that the next one finds the GPU's memory free (an
    engine's startup objects are kept out of the collector's view until then)."""
    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()


@contextmanager
def timed_replays():
    """Yields a list that gets (graph, start event, end event) for every CUDA-graph replay in the block."""
    replay, log = torch.cuda.CUDAGraph.replay, []

    def timed(graph):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay(graph)
        end.record()
        log.append((graph, start, end))

    torch.cuda.CUDAGraph.replay = timed
    try:
        yield log
    finally:
        torch.cuda.CUDAGraph.replay = replay


def decode_run(engine, batch: int, prompt_len: int, output_len: int) -> dict:
    """Decode tok/s after the first token, and per decode step: wall time and the device time of its replays."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(batch, prompt_len, 128256, batch)):
        engine.add_request(f"{batch}-{i}-{time.perf_counter()}", prompt, params)
    counts, counted, first, steps = 0, 0, None, 0
    with timed_replays() as log:
        while engine.has_work():
            new = sum(len(d.new_token_ids) for d in engine.step())
            counts += new
            if first is None and counts:
                first, counted = time.perf_counter(), counts
                log.clear()
            elif first is not None and new:  # a last call that only collects nothing is not a step
                steps += 1
        wall = time.perf_counter() - first
    torch.cuda.synchronize()
    replay_ms = [start.elapsed_time(end) for _, start, end in log]
    return {"decode_tok_s": (counts - counted) / wall, "steps": steps, "step_wall_ms": wall * 1e3 / max(steps, 1),
            "replay_device_ms": sum(replay_ms) / max(len(replay_ms), 1), "replays": len(replay_ms)}


def step_kernels(engine, prompt_len: int, steps: int = 8, limit: int = 40) -> list[dict]:
    """The device kernels of `steps` batch-1 decode steps under torch.profiler, per step, largest first."""
    params = SamplingParams(max_tokens=8 * steps + 16, temperature=0.0, ignore_eos=True)
    engine.add_request(f"profiled-{time.perf_counter()}", make_prompts(1, prompt_len, 128256, 1)[0], params)
    while not any(d.new_token_ids for d in engine.step()):  # the prompt's step
        pass
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_work():
        engine.step()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if device_us > 0:
            rows.append({"kernel": event.key[:90], "calls_per_step": event.count / steps,
                         "us_per_step": round(device_us / steps, 1)})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:limit]


def host_top(profiler: cProfile.Profile, limit: int = 25) -> list[dict]:
    """The functions the host spent most of its own time in (the profiler's overhead inflates them all)."""
    stats = pstats.Stats(profiler)
    rows = [{"function": f"{file.rsplit('/', 1)[-1]}:{line} {func}", "calls": calls, "self_ms": round(tt * 1e3, 2),
             "cumulative_ms": round(ct * 1e3, 2)}
            for (file, line, func), (_, calls, tt, ct, _) in stats.stats.items()]
    rows.sort(key=lambda r: -r["self_ms"])
    return rows[:limit]


def measure(engine, batch: int, args) -> dict:
    """One setup at one batch size: a short warm-up run, then the timed run (host-profiled at batch 1 when asked)."""
    decode_run(engine, batch, args.prompt_len, 8)
    profiler = cProfile.Profile() if args.host_profile and batch == 1 else None
    if profiler is not None:
        profiler.enable()
    row = {"batch_size": batch, **decode_run(engine, batch, args.prompt_len, args.output_len)}
    if profiler is not None:
        profiler.disable()
        row["host_functions"] = host_top(profiler)
    if args.profile and batch == 1:
        row["kernels"] = step_kernels(engine, args.prompt_len)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS), metavar="NAME",
                   help="which rows to run (default: all); the first must be plain")
    p.add_argument("--profile", action="store_true",
                   help="after each setup's batch-1 run, list the kernels of its decode steps (torch.profiler)")
    p.add_argument("--host-profile", action="store_true",
                   help="profile the host (cProfile) in each setup's batch-1 run and keep its top functions")
    p.add_argument("--model-path", default=BASE.model_path, help="a shipped config (random weights) or a checkpoint")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.setups[0] != "plain":
        p.error("the first setup must be plain: the others are reported against it")
    # Graphs are captured for the batch sizes the run asks for, not for all up to 256.
    base = replace(BASE, model_path=args.model_path,
                   scheduler=replace(BASE.scheduler, max_running_requests=max(args.batch_sizes)))
    rows = []
    for name in args.setups:
        spec, drafts = SETUPS[name]
        llm = build(replace(base, spec=spec), drafts)
        for batch in args.batch_sizes:
            rows.append({"setup": name, **measure(llm.engine, batch, args)})
            print({k: v for k, v in rows[-1].items() if k not in ("kernels", "host_functions")}, flush=True)
        del llm
        release()
    plain = {r["batch_size"]: r["decode_tok_s"] for r in rows if r["setup"] == "plain"}
    for r in rows:
        r["ratio_to_plain"] = r["decode_tok_s"] / plain[r["batch_size"]]
    report = {"benchmark": "spec_off_tax", "hardware": hardware_info(),
              "simulated": "the acceptance of the chain and tree rows",
              "settings": {**vars(args), "model": f"{args.model_path} dummy bf16, random EAGLE-3 head",
                           "max_running_requests": max(args.batch_sizes),
                           "gemv_decisions": envs.get().gemv_choices},
              "results": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
