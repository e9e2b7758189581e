"""Makes the GEMV decisions shipped for a GPU (specserve/kernels/tuning/decisions/<GPU name>.json), on the
Llama-3.1-8B shape with random bf16 weights and a random EAGLE-3 head: decisions depend on shapes, not values.

1. The chooser times every weight shape alone at startup, as a server with no decisions to take does.
2. The 4-row bucket (a batch-1 chain step's verify: root + 3 drafts; the head's catch-up) is then chosen by the
   step's own time, one key after another: each takes whichever of its --tries fastest tiles alone, or cuBLAS
   (or, for a folded norm, the norm apart), makes a batch-1 chain step fastest (device time of its graph
   replays, acceptance simulated at tau 3), the keys after it seeing that pick. Timed alone, a tile misses how
   it runs among its neighbours: launched early beside the kernel before it, sharing the caches. Each try
   builds the engine anew, so that its graphs are captured with the try's decisions.
3. An fp8 head's shapes (--speculative-draft-model-quantization fp8) are timed alone at startup.

The file written holds the decisions of 2 and 3, as the H200's shipped file does. A server takes it with
SPECSERVE_GEMV_CHOICES=FILE, or ships it under its GPU's name. Decisions are made under the chooser's default
switches and shipped ones are taken only under them.

Docs figure: none of its own; every H200 figure runs with the decisions it makes.

    SPECSERVE_GEMV_CHOICES=none python benchmarks/gemv_decisions.py --out NVIDIA_H200.json --report descent.json
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from spec_off_tax import BASE, CHAIN, build, decode_run, release
from specserve.bench.decode import hardware_info

ROWS = 4  # the row bucket chosen by the step's time
# Batch 1 only: graphs are captured for one row, and the KV pool holds one sequence, so each try builds fast.
STEP_ENGINE = replace(BASE, spec=CHAIN, cache=replace(BASE.cache, max_total_tokens=20_000),
                      scheduler=replace(BASE.scheduler, max_running_requests=1))


def chooser():
    """The GEMV chooser's module (it needs Triton, so it is imported only on a GPU machine)."""
    from specserve.kernels.tuning import chooser as module

    return module


def label(key: tuple) -> str:
    shape, dtype, rows, gate_up, norm, gamma = key
    folded = (" +norm" if gamma else " +norm (weight in W)") if norm else ""
    return f"{list(shape)} {str(dtype).removeprefix('torch.')} {rows} rows{' gate_up' if gate_up else ''}{folded}"


def step_ms(decisions: dict, args) -> float:
    """Device ms a batch-1 chain step, its engine built (its graphs captured) with the chooser holding `decisions`."""
    chooser().choice.best.update(decisions)
    llm = build(STEP_ENGINE)
    try:
        decode_run(llm.engine, 1, args.prompt_len, 8)  # warm-up
        runs = [decode_run(llm.engine, 1, args.prompt_len, args.output_len)["replay_device_ms"]
                for _ in range(args.repeats)]
    finally:
        del llm
        release()
    return sum(runs) / len(runs)


def descend(start: dict, timings: dict, args) -> tuple[dict, list[dict]]:
    """Each key of `start` in turn takes whichever of its `args.tries` fastest tiles alone (by `timings`, in
    microseconds), or None, makes the step fastest; the keys after it see that pick."""
    decisions, record = dict(start), []
    for key in start:
        tiles = {str(tile): tile for tile in chooser().candidate_tiles(key[2], key[4], key[5])}
        fastest = sorted((us, name) for name, us in timings[key].items() if name in tiles)[:args.tries]
        options = {"cublas": None} | {name: tiles[name] for _, name in fastest}
        times = {name: step_ms(decisions | {key: tile}, args) for name, tile in options.items()}
        decisions[key] = options[min(times, key=times.get)]
        record.append({"key": label(key), "was": str(start[key]), "kept": str(decisions[key]),
                       "step_ms": {name: round(ms, 4) for name, ms in times.items()}})
        print(record[-1], flush=True)
    return decisions, record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tries", type=int, default=3, help="tiles tried per key: its fastest alone, besides cuBLAS")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per try")
    p.add_argument("--out", required=True, help="the decisions file to write")
    p.add_argument("--report", help="also write the descent's record here (JSON)")
    args = p.parse_args()
    choice = chooser().choice
    if choice.saved is not None:  # a decisions file to take instead of timing
        p.error("run it with SPECSERVE_GEMV_CHOICES=none: it times every shape itself")
    llm = build(STEP_ENGINE)  # its startup times every shape alone
    del llm
    release()
    start = {key: tile for key, tile in choice.best.items()
             if key[2] == ROWS and key[1] == torch.bfloat16 and key in choice.timings}
    before = step_ms(start, args)
    decisions, record = descend(start, choice.timings, args)
    after = step_ms(decisions, args)
    llm = build(replace(STEP_ENGINE, spec=replace(CHAIN, draft_model_quantization="fp8")))
    del llm
    release()
    fp8 = {key: tile for key, tile in choice.best.items() if key[1] == torch.float8_e4m3fn}
    from specserve.kernels.tuning import choices

    choices.save(decisions | fp8, args.out, torch.cuda.get_device_name())
    print(f"batch-1 chain step: {before:.4f} ms with the decisions timed alone, {after:.4f} after the descent; "
          f"{len(decisions)} 4-row and {len(fp8)} fp8 decisions written to {args.out}", flush=True)
    if args.report:
        report = {"benchmark": "gemv_decisions", "hardware": hardware_info(), "settings": vars(args),
                  "step_ms_timed_alone": before, "step_ms_descended": after, "descent": record}
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
