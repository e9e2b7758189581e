"""A batch-1 chain verify step (Llama-3.1-8B shape, random bf16 weights, 4 rows: root + 3 drafts) under other
GEMV choices for its 4-row shapes, and with the next kernel launched at the start or the end of each GEMV.

The chooser (layers/triton_gemv.py) times each shape alone, in a CUDA graph of copies of one kernel. This
replays the whole verify graph instead, recaptured for each variant: how a choice plays out among the
kernels around it is what a step pays.

    python benchmarks/verify_gemv_choices.py --out benchmarks/results/verify_gemv_choices_h200.json
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from profile_gpu_step import cuda_ms
from spec_step_parts import BASE, CHAIN, graphed, place_at, plain_step
from specserve.bench.decode import hardware_info
from specserve.engine.factory import build_engine_core
from specserve.layers import triton_gemv
from specserve.layers.triton_gemv import Tile

ROWS = 4
SHAPES = {"qkv": ((6144, 4096), False), "o": ((4096, 4096), False), "gate_up": ((28672, 4096), True),
          "down": ((4096, 14336), False)}
VARIANTS = {
    "as chosen": {},
    "gate_up cuBLAS": {"gate_up": None},
    "down cuBLAS": {"down": None},
    "gate_up, down cuBLAS": {"gate_up": None, "down": None},
    "gate_up, down, o cuBLAS": {"gate_up": None, "down": None, "o": None},
    "gate_up tile 64x128 (4 warps, 3 stages)": {"gate_up": Tile(64, 128, 4, 3)},
    "gate_up tile 32x128 (4, 3)": {"gate_up": Tile(32, 128, 4, 3)},
    "gate_up tile 64x128 (4, 4)": {"gate_up": Tile(64, 128, 4, 4)},
    "down tile 32x128": {"down": Tile(32, 128, 4, 3)},
    "down tile 16x256": {"down": Tile(16, 256, 4, 3)},
    "qkv tile 32x256": {"qkv": Tile(32, 256, 4, 4)},
    "qkv tile 64x256": {"qkv": Tile(64, 256, 4, 4)},
    "every 4-row shape tile 32x128": {name: Tile(32, 128, 4, 3) for name in ("qkv", "o", "gate_up", "down")},
}


def key(name: str) -> tuple:
    """The chooser's key of a shape as the 4-row verify calls it: unfolded (on this shape the fold loses at 4
    rows, so the layers keep their norm kernels there; `main` checks)."""
    shape, gate_up = SHAPES[name]
    return shape, torch.bfloat16, ROWS, gate_up, False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    engine, _ = build_engine_core(replace(BASE, spec=CHAIN), progress=False)
    program = engine.runner.spec_graphs
    chosen = dict(triton_gemv.choice.best)
    assert chosen.get((SHAPES["qkv"][0], torch.bfloat16, ROWS, False, True)) is None, "4-row layers fold here"
    results = []
    with torch.inference_mode():
        n = place_at(program, args.context)
        metas = program._metas(1, n)
        _, drafts = graphed(lambda: program._draft(1, metas))
        plain_ms = cuda_ms(plain_step(engine.runner, args.context, BASE.cache.page_size), args.repeats)
        for late in (True, False):
            triton_gemv.LATE_TRIGGER = late
            for name, change in VARIANTS.items():
                triton_gemv.choice.best = chosen | {key(shape): tile for shape, tile in change.items()}
                verify, _ = graphed(lambda: program._verify(1, drafts, metas["verify"]))
                ms = cuda_ms(verify, args.repeats)
                results.append({"variant": name, "late_trigger": late, "verify_ms": round(ms, 4),
                                "verify_minus_plain_ms": round(ms - plain_ms, 4)})
                print(results[-1], flush=True)
    triton_gemv.choice.best = chosen
    report = {"benchmark": "verify_gemv_choices", "hardware": hardware_info(), "plain_decode_ms": round(plain_ms, 4),
              "settings": {**vars(args), "model": "llama-3.1-8b dummy bf16, random EAGLE-3 head", "rows": ROWS},
              "as_chosen": {name: str(chosen.get(key(name))) for name in SHAPES}, "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
