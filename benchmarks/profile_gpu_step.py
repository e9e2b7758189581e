"""Where a GPU step's time goes, kernel by kernel: Llama-3.1-8B shape (or --model), random bf16 weights, one GPU.

Times back-to-back CUDA-graph replays of a decode step (no host work in between, so this is the device's
floor for that step) at a few batch sizes, a prefill chunk run eagerly, and bf16 matrix-vector products of the
model's weight shapes, cuBLAS and the Triton GEMV, against the copy bandwidth. Prints the top kernels of each under torch.profiler.

    python benchmarks/profile_gpu_step.py --out benchmarks/results/profile_gpu_step_h200.json
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from specserve.bench.decode import hardware_info
from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
from specserve.engine.factory import build_engine_core
from specserve.layers.attention import AttentionMetadata


def cuda_ms(fn, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def top_kernels(fn, limit: int | None = 12) -> list[dict]:
    """fn's kernels under torch.profiler, by total device time (the `limit` largest; None: all)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if device_us > 0:
            rows.append({"kernel": event.key[:90], "calls": event.count, "total_us": round(device_us, 1)})
    rows.sort(key=lambda r: -r["total_us"])
    return rows[:limit]


def critical_path(fn, sequence: list | None = None) -> list[dict]:
    """fn's kernels under torch.profiler, each credited with the time it adds to the span: from the latest end
    of the kernels before it (or its own start, for the first) to its end, gaps included. Under PDL a kernel runs
    beside the one before, so its own duration overstates it; these add up to the span."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    totals: dict[str, dict] = {}
    last_end = kernels[0].time_range.start if kernels else 0.0
    for event in kernels:
        row = totals.setdefault(event.name[:90], {"kernel": event.name[:90], "calls": 0, "total_us": 0.0})
        row["calls"] += 1
        added = max(0.0, event.time_range.end - last_end)
        row["total_us"] += added
        if sequence is not None:
            sequence.append((event.name[:40], round(added, 2)))
        last_end = max(last_end, event.time_range.end)
    rows = sorted(totals.values(), key=lambda r: -r["total_us"])
    return [{**r, "total_us": round(r["total_us"], 1)} for r in rows]


# Kernel families by name, first match wins; the rest (PyTorch's small kernels: sorts, gathers, copies) is "other".
KERNEL_GROUPS = {"Triton GEMV": ("_gemv_",), "cuBLAS": ("gemm", "nvjet", "cutlass", "xmma"),
                 "top-k": ("topk",), "attention": ("_partial_kernel", "_merge_kernel", "attention", "flash"),
                 "norm, rotary, KV store, SiLU": ("rms", "rotary", "silu", "_norm", "store_kv"),
                 "follow": ("_follow_kernel",)}


def kernel_groups(rows: list[dict]) -> dict[str, dict]:
    """`top_kernels(fn, limit=None)` summed by family: calls and device microseconds. Under PDL kernels overlap,
    so the sums can exceed the step's time; they still show where it goes."""
    groups: dict[str, dict] = {}
    for row in rows:
        name = row["kernel"].lower()
        group = next((g for g, keys in KERNEL_GROUPS.items() if any(k in name for k in keys)), "other")
        total = groups.setdefault(group, {"calls": 0, "total_us": 0.0})
        total["calls"] += row["calls"]
        total["total_us"] = round(total["total_us"] + row["total_us"], 1)
    return groups


def decode_replays(runner, batch: int, context: int, page_size: int) -> dict:
    pages_per_seq = -(-(context + 1) // page_size)
    tables = [list(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(batch)]
    run = lambda: runner.graphs.run([1] * batch, [context] * batch, tables)  # noqa: E731
    ms = cuda_ms(run, 30)
    return {"batch": batch, "context": context, "step_ms": round(ms, 3), "tok_s": round(batch * 1e3 / ms, 1),
            "kernels": top_kernels(run)}


def prefill_chunk(model, kv_cache, seqs: int, prompt_len: int, page_size: int) -> dict:
    pages_per_seq = -(-prompt_len // page_size)
    tables = [list(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(seqs)]
    device = kv_cache.device
    ids = torch.randint(0, 1000, (seqs * prompt_len,), device=device)
    positions = torch.arange(prompt_len, device=device).repeat(seqs)

    def run():
        meta = AttentionMetadata.build([prompt_len] * seqs, [0] * seqs, tables, page_size, device)
        hidden, _ = model(ids, positions, meta, kv_cache)
        return model.compute_logits(hidden[-1:])

    with torch.inference_mode():
        ms = cuda_ms(run, 3)
        kernels = top_kernels(run)
    tokens = seqs * prompt_len
    params = sum(p.numel() for p in model.parameters()) - model.embed_tokens.weight.numel()
    return {"tokens": tokens, "ms": round(ms, 2), "tok_s": round(tokens * 1e3 / ms),
            "linear_tflop_s": round(2 * params * tokens / ms / 1e9, 1), "kernels": kernels}


def gemv_bandwidth(model) -> list[dict]:
    """Per weight shape: cuBLAS and the best Triton tile, each timed inside a CUDA graph over enough weight
    copies to defeat L2 (how the engine chooses between them)."""
    layer = model.layers[0]
    shapes = {"qkv": layer.self_attn.qkv_proj.weight, "o": layer.self_attn.o_proj.weight,
              "gate_up": layer.mlp.gate_up_proj.weight, "down": layer.mlp.down_proj.weight,
              "lm_head": model.lm_head.weight}
    copy_src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_gb_s = 2 * copy_src.numel() / cuda_ms(lambda: copy_dst.copy_(copy_src), 20) / 1e6
    rows = [{"what": "copy 1 GiB", "gb_s": round(copy_gb_s)}]
    from specserve.kernels.triton import gemv as triton_gemv

    gb = lambda w, us: round(w.numel() * w.element_size() / us / 1e3)  # noqa: E731
    for name, weight in shapes.items():
        for m in (1, 4, 16):
            x = torch.randn(m, weight.shape[1], dtype=weight.dtype, device="cuda")
            gate_up = name == "gate_up"  # as the model calls it: SiLU-and-multiply on the outputs
            # A fresh chooser, so this x (m rows) is what gets timed.
            choice = triton_gemv.Choice()
            tile = choice.tile(x, weight, gate_up)  # times cuBLAS and every tile in a CUDA graph
            times = choice.timings[choice.key(x, weight, gate_up)]
            best = min(v for k, v in times.items() if k != "cublas")
            rows.append({"what": f"{name} {tuple(weight.shape)} M={m}" + (" with SiLU·mul" if gate_up else ""),
                         "cublas_us": round(times["cublas"], 2), "cublas_gb_s": gb(weight, times["cublas"]),
                         "triton_us": round(best, 2), "triton_gb_s": gb(weight, best), "chosen": str(tile)})
    return rows


def attention_tiles(kv_cache, heads: int, batch: int, context: int, page_size: int) -> list[dict]:
    """The paged decode attention kernel of one layer under a few tile settings (graph-timed)."""
    from specserve.kernels.triton.attention import num_splits, paged_decode_attention
    from specserve.kernels.triton.gemv import graph_time

    layer_cache = kv_cache[0]
    pages = -(-(context + 1) // page_size)
    tables = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)
    lens = torch.full((batch,), context + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, layer_cache.shape[-1], dtype=layer_cache.dtype, device="cuda")
    splits = num_splits(batch, layer_cache.shape[2], pages * page_size)
    rows = []
    for block, warps, stages in ((32, 4, 3), (64, 4, 3), (64, 4, 4), (64, 4, 5), (64, 8, 4), (128, 4, 3)):
        run = lambda cache: paged_decode_attention(q, cache, tables, lens, 0.088, page_size, splits,  # noqa: E731
                                                   tile=(block, warps, stages))
        us = graph_time(run, [kv_cache[i] for i in range(8)]) * 1e3
        kv_bytes = 2 * batch * (context + 1) * layer_cache.shape[2] * layer_cache.shape[3] * 2
        rows.append({"batch": batch, "context": context, "splits": splits, "block": block, "warps": warps,
                     "stages": stages, "us": round(us, 1), "kv_gb_s": round(kv_bytes / us / 1e3)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, default=640)
    p.add_argument("--model", default="llama-3.1-8b", help="a shipped config name (dummy bf16 weights)")
    args = p.parse_args()
    config = EngineConfig(model_path=args.model, load_format="dummy", dtype="bfloat16", device="cuda",
                          context_length=2048, cache=CacheConfig(max_total_tokens=300_000),
                          scheduler=SchedulerConfig(chunked_prefill_size=16384))
    engine, _ = build_engine_core(config, progress=False)
    runner, page_size = engine.runner, config.cache.page_size
    report = {"benchmark": "profile_gpu_step", "hardware": hardware_info(),
              "model": f"{args.model} shape, dummy bf16 weights", "gemv": gemv_bandwidth(runner.model),
              "decode": [decode_replays(runner, b, args.context, page_size) for b in args.batch_sizes],
              "prefill": prefill_chunk(runner.model, runner.kv_cache, 32, 512, page_size),
              "attention_tiles": [row for b in args.batch_sizes
                                  for row in attention_tiles(runner.kv_cache, runner.model.config.num_heads, b,
                                                             args.context, page_size)]}
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
