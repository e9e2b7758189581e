"""The tree program's selection and greedy-acceptance kernels (engine/triton_tree.py) timed alone on a GPU: a
top-4, 5-level search's 68 candidates -> 15 nodes, at batch 1 and 8, the selection at 1-16 warps, the acceptance
greedy and simulated (forced). Each figure is one call's share of a CUDA graph of 20 calls. The kernels are first
checked against their PyTorch forms. `--baseline FILE` also times the same functions from another copy of
triton_tree.py (an earlier version's) as "old".

    python benchmarks/tree_kernels_timing.py --out benchmarks/results/tree_kernels_timing_h200.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import _tree_candidates, _tree_program, check_tree_accept, check_tree_select  # noqa: E402

from profile_gpu_step import cuda_ms  # noqa: E402
from spec_step_parts import graphed  # noqa: E402
from specserve.kernels.triton import tree as triton_tree# noqa: E402

K, DEPTH, N = 4, 5, 15


def per_call_us(fn, calls: int = 20, replays: int = 50) -> float:
    replay, _ = graphed(lambda: [fn() for _ in range(calls)])
    return cuda_ms(replay, replays) * 1000 / calls


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("triton_tree_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_batch(bs: int, modules: dict, generator: torch.Generator) -> dict[str, float]:
    tokens, parents, scores = _tree_candidates(bs, K, DEPTH, generator)
    program = _tree_program(min(bs, 4), K, DEPTH, N)
    cuda = dict(device="cuda")
    candidates = {"tokens": tokens.cuda(), "parents": parents.cuda(), "scores": scores.cuda()}
    args = (candidates, program.candidate_depth.cuda(), torch.full((bs,), N, **cuda), 7 + torch.arange(bs, **cuda),
            70 + torch.arange(bs, **cuda), (1000 + torch.arange(bs * N, **cuda)).view(bs, N), DEPTH)
    roots = 300 + torch.arange(bs, **cuda)
    out = {}
    for name, module in modules.items():
        takes_roots = "root_pos" in module.select_nodes.__code__.co_varnames
        select_args = args + ((roots,) if takes_roots else ())
        for warps in (1, 2, 4, 8, 16) if name == "new" else (None,):
            if warps is not None:
                module.SELECT_WARPS = warps
            label = f"select {name}" + (f" w{warps}" if warps else "")
            out[f"{label} bs{bs}"] = per_call_us(lambda: module.select_nodes(*select_args))
        nodes = module.select_nodes(*select_args)
        best = torch.randint(0, 1000, (bs, N + 1), **cuda)
        real = (5000 + torch.arange(bs * DEPTH, **cuda)).view(bs, DEPTH)
        last_packed = torch.zeros(bs + 1, DEPTH + 2, dtype=torch.long, **cuda)
        last_root = torch.zeros(bs + 1, dtype=torch.long, **cuda)
        for forced in (None, torch.full((bs,), 3, **cuda)):
            out[f"accept {name} forced={forced is not None} bs{bs}"] = per_call_us(
                lambda: module.accept_tree(nodes, best, forced, real, 9999, roots, last_packed, last_root))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", metavar="FILE", help="an earlier triton_tree.py to time as 'old'")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    check_tree_select("cuda")
    check_tree_accept("cuda")
    modules = ({"old": load_module(args.baseline)} if args.baseline else {}) | {"new": triton_tree}
    generator = torch.Generator().manual_seed(3)
    results = {}
    for bs in (1, 8):
        results |= time_batch(bs, modules, generator)
    for key, us in results.items():
        print(f"{key:34s} {us:7.2f} us")
    report = {"benchmark": "tree_kernels_timing", "hardware": torch.cuda.get_device_name(),
              "unit": "us per call, one call's share of a CUDA graph of 20", "settings": vars(args),
              "results": results}
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
