"""How long the GPU waits for the host during steady decode: Llama-3.1-8B shape, random bf16 weights, C requests
(512-token prompts, 256 output tokens), with and without overlap scheduling, and with each step's outputs
folded into per-request outputs in the same loop (as `specserve bench --offline` does), with a host profile.

Once every request is decoding, torch.profiler records the device's kernels over a run of steps; idle time is
the part of that span covered by no kernel (the gaps between steps, and any inside one).

    python benchmarks/gpu_idle.py --out benchmarks/results/gpu_idle_h200.json
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from specserve.bench.decode import hardware_info, make_prompts
from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
from specserve.llm import LLM
from specserve.core import SamplingParams


def kernel_intervals(prof) -> list[tuple[float, float]]:
    spans = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.time_range.elapsed_us() > 0:
            spans.append((event.time_range.start, event.time_range.end))
    return sorted(spans)


def idle_fraction(spans: list[tuple[float, float]]) -> tuple[float, float]:
    """(idle share of the span from the first kernel's start to the last one's end, that span in us)."""
    busy, cursor = 0.0, spans[0][0]
    for start, end in spans:
        if end > cursor:
            busy += end - max(start, cursor)
            cursor = end
    total = spans[-1][1] - spans[0][0]
    return 1 - busy / total, total


def measure(llm, concurrency: int, steps: int, trackers: bool, host_profile: bool) -> dict:
    """With `trackers`, each step's outputs are folded into per-request outputs (detokenized, stop strings
    checked) in the same loop, as `specserve bench --offline` does; otherwise the engine steps alone."""
    engine = llm.engine
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    live = [llm.add(prompt, params) for prompt in make_prompts(concurrency, 512, 128256, seed=concurrency)]
    step = (lambda: llm.step_and_track(live)) if trackers else engine.step
    while engine.scheduler.waiting or any(r.num_output_tokens < 2 for r in engine.scheduler.running):
        step()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    idle, span_us = idle_fraction(kernel_intervals(prof))
    row = {"trackers": trackers, "running": len(engine.scheduler.running), "steps": steps,
           "step_ms": round(1e3 * wall / steps, 3), "gpu_idle_fraction": round(idle, 4),
           "profiled_span_ms": round(span_us / 1e3, 1)}
    if host_profile:  # where the host's time goes, by function (cProfile slows Python down somewhat)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            step()
        profiler.disable()
        stats = pstats.Stats(profiler)
        top = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:30]  # by own time
        row["host_functions_ms_per_step"] = [
            {"function": f"{path.split('/')[-1]}:{line}({name})", "own": round(1e3 * tt / steps, 3),
             "cumulative": round(1e3 * ct / steps, 3), "calls_per_step": round(nc / steps, 1)}
            for (path, line, name), (_, nc, tt, ct, _) in top]
    for request_id in list(engine.scheduler.requests):
        engine.abort([request_id])
    engine.step()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, default=250)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--modes", default="engine,trackers,no_overlap",
                   help="engine: steps alone, overlap on; trackers: outputs folded in per step, as the offline "
                        "bench does, with a host profile; no_overlap: steps alone, overlap off")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    base = EngineConfig(model_path="llama-3.1-8b", load_format="dummy", dtype="bfloat16", device="cuda",
                        context_length=2048, cache=CacheConfig(max_total_tokens=300_000),
                        scheduler=SchedulerConfig(chunked_prefill_size=16384))
    rows, modes = [], args.modes.split(",")
    for overlap in (True, False):
        wanted = [m for m in modes if (m != "no_overlap") == overlap]
        if not wanted:
            continue
        llm = LLM(config=replace(base, disable_overlap=not overlap), progress=False)
        for mode in wanted:
            trackers = mode == "trackers"
            rows.append({"overlap": overlap, **measure(llm, args.concurrency, args.steps, trackers, trackers)})
            print({k: v for k, v in rows[-1].items() if k != "host_functions_ms_per_step"}, flush=True)
        del llm
        torch.cuda.empty_cache()
    report = {"benchmark": "gpu_idle", "hardware": hardware_info(),
              "model": "llama-3.1-8b shape, dummy bf16 weights", "settings": vars(args), "results": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
