"""How long the GPU waits for the host during steady decode: Llama-3.1-8B shape, random bf16 weights, C requests
(512-token prompts, 256 output tokens), with and without overlap scheduling.

Once every request is decoding, torch.profiler records the device's kernels over a run of steps; idle time is
the part of that span covered by no kernel (the gaps between steps, and any inside one).

    python benchmarks/gpu_idle.py --out benchmarks/results/gpu_idle_h200.json
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from specserve.bench.decode import hardware_info, make_prompts
from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
from specserve.engine.factory import build_engine_core
from specserve.sampling_params import SamplingParams


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


def measure(engine, concurrency: int, steps: int) -> dict:
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(concurrency, 512, 128256, seed=concurrency)):
        engine.add_request(f"{i}-{time.perf_counter()}", prompt, params)
    while engine.scheduler.waiting or any(r.num_output_tokens < 2 for r in engine.scheduler.running):
        engine.step()
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    idle, span_us = idle_fraction(kernel_intervals(prof))
    running = len(engine.scheduler.running)
    for request_id in list(engine.scheduler.requests):
        engine.abort([request_id])
    engine.step()
    return {"running": running, "steps": steps, "step_ms": round(1e3 * wall / steps, 3),
            "gpu_idle_fraction": round(idle, 4), "profiled_span_ms": round(span_us / 1e3, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, default=250)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    base = EngineConfig(model_path="llama-3.1-8b", load_format="dummy", dtype="bfloat16", device="cuda",
                        context_length=2048, cache=CacheConfig(max_total_tokens=300_000),
                        scheduler=SchedulerConfig(chunked_prefill_size=16384))
    rows = []
    for overlap in (True, False):
        engine, _ = build_engine_core(replace(base, disable_overlap=not overlap), progress=False)
        rows.append({"overlap": overlap, **measure(engine, args.concurrency, args.steps)})
        print(rows[-1], flush=True)
        del engine
        torch.cuda.empty_cache()
    report = {"benchmark": "gpu_idle", "hardware": hardware_info(),
              "model": "llama-3.1-8b shape, dummy bf16 weights", "settings": vars(args), "results": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
