"""Where a batch-1 speculative step's device time goes, part by part: Llama-3.1-8B shape, random bf16 weights,
a random EAGLE-3 head of matching shape, one GPU.

Each part of the chain and tree programs (the head's catch-up and drafting; the target's verification) is
captured in a CUDA graph of its own, from the program's own buffers, and replayed back to back (no host work
in between), beside a plain batch-1 decode step of the same context. The whole program (`_step`: with the
inputs of rows that follow the last launch, and what it leaves for the next) against the sum of the parts shows
what the rest costs; the parts against plain decode show what speculation adds to a step.

    python benchmarks/spec_step_parts.py --out benchmarks/results/spec_step_parts_h200.json
"""
from __future__ import annotations

import argparse
import bisect
import json
from dataclasses import replace

import torch

from profile_gpu_step import critical_path, cuda_ms, kernel_groups, top_kernels
from specserve.bench.decode import hardware_info
from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specserve.engine.factory import build_engine_core

BASE = EngineConfig(model_path="llama-3.1-8b", load_format="dummy", dtype="bfloat16", device="cuda",
                    context_length=2048, cache=CacheConfig(max_total_tokens=20_000),
                    scheduler=SchedulerConfig(chunked_prefill_size=4096))
CHAIN = SpecConfig("EAGLE3", None, 3, simulate_accept_len=3.0)
TREE = SpecConfig("EAGLE3", None, 5, 4, 16, simulate_accept_len=4.0)


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up outside it); returns (replay, the captured outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def place_at(program, context: int) -> int:
    """Points the program's batch-1 inputs at one sequence of `context` tokens on pages 0.. (its writes go to
    the padding slot: the slot inputs are left as allocated); returns the context bucket."""
    n = program.context_lens[bisect.bisect_left(program.context_lens, context + program.width)]
    w = program.width
    table = program.tables[n]
    table[0] = torch.arange(table.shape[1], dtype=table.dtype, device=table.device)
    program.catch_pos[0] = torch.arange(context - w, context, device=table.device)
    program.last_row[0] = w - 1
    program.limit[0] = w - 1
    program.forced[0] = w - 2
    if hasattr(program, "verify_pos"):  # chain
        program.verify_pos[0] = torch.arange(context, context + w, device=table.device)
        program.extend_pos[:, 0] = torch.arange(context, context + program.extend_pos.shape[0],
                                                device=table.device)
    else:  # tree
        program.root_pos[0] = context
    return n


def chain_parts(program, n: int) -> dict:
    metas = program._metas(1, n)
    draft, _ = graphed(lambda: program._draft(1, metas))
    verify, _ = graphed(lambda: program._verify(1, metas["verify"]))
    whole, _ = graphed(lambda: program._step(1, n, program.forced[:1]))
    return {"draft: head catch-up + k drafts": draft, "verify: target over root + k": verify, "whole step": whole}


def tree_parts(program, n: int) -> dict:
    rows = program._metas(1, n)  # the step's row inputs, made once for the parts' graphs
    search, nodes = graphed(lambda: program._select(1, *program._search(1, n, rows)))
    verify, _ = graphed(lambda: program._verify(1, n, nodes, rows))
    whole, _ = graphed(lambda: program._step(1, n, program.forced[:1]))
    return {"draft: head catch-up + search + select": search, "verify: target over root + N": verify,
            "whole step": whole}


def plain_step(runner, context: int, page_size: int):
    table = list(range(-(-(context + 1) // page_size)))
    return lambda: runner.graphs.run([1], [context], [table])


def measure(spec: SpecConfig, context: int, repeats: int, kernels: bool) -> dict:
    engine, _ = build_engine_core(replace(BASE, spec=spec), progress=False)
    runner = engine.runner
    program = runner.spec_graphs
    with torch.inference_mode():
        n = place_at(program, context)
        parts = (chain_parts if spec.eagle_topk == 1 else tree_parts)(program, n)
        parts["plain decode step"] = plain_step(runner, context, BASE.cache.page_size)
        times = {name: round(cuda_ms(fn, repeats), 4) for name, fn in parts.items()}
        if kernels:  # each part's kernels inside its graph, by total device time, and by family
            listed = {name: top_kernels(fn, limit=None) for name, fn in parts.items()}
            times["kernels"] = {name: rows[:25] for name, rows in listed.items()}
            times["kernel_groups"] = {name: kernel_groups(rows) for name, rows in listed.items()}
            # The same, each kernel credited only with what it adds to the part's span (overlap under PDL removed).
            sequences = {name: [] for name in parts}
            added = {name: critical_path(fn, sequences[name]) for name, fn in parts.items()}
            times["critical_path"] = {name: rows[:25] for name, rows in added.items()}
            times["critical_path_sequence"] = sequences
            times["critical_path_groups"] = {name: kernel_groups(rows) for name, rows in added.items()}
    drafting = next(v for k, v in times.items() if k.startswith("draft"))
    verify = next(v for k, v in times.items() if k.startswith("verify"))
    times["verify - plain"] = round(verify - times["plain decode step"], 4)
    times["whole - (draft + verify)"] = round(times["whole step"] - drafting - verify, 4)
    del engine, runner, program
    torch.cuda.empty_cache()
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=600, help="tokens before the step's root")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--setups", nargs="+", choices=["chain", "tree"], default=["chain", "tree"])
    p.add_argument("--kernels", action="store_true", help="also list each part's top kernels (torch.profiler)")
    p.add_argument("--fp8-head", action="store_true", help="the head's projections in fp8 "
                   "(--speculative-draft-model-quantization fp8)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    results = {}
    quantization = "fp8" if args.fp8_head else None
    setups = {"chain": ("chain 3 drafts", replace(CHAIN, draft_model_quantization=quantization)),
              "tree": ("tree top-4, 5 steps, 16 tokens", replace(TREE, draft_model_quantization=quantization))}
    for name, spec in (setups[s] for s in args.setups):
        results[name] = measure(spec, args.context, args.repeats, args.kernels)
        print(name, {k: v for k, v in results[name].items()
                    if k == "critical_path_groups" or ("kernel" not in k and "critical" not in k)}, flush=True)
    from specserve.kernels.triton import gemv as triton_gemv

    gemv = triton_gemv.choice.report()
    report = {"benchmark": "spec_step_parts", "unit": "ms of device time per replay", "hardware": hardware_info(),
              "settings": {**vars(args), "model": "llama-3.1-8b dummy bf16, random EAGLE-3 head", "batch_size": 1,
                           "acceptance": "simulated"},
              "results": results, "gemv_choices": gemv}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
