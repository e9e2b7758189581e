"""A batch-1 verify step (Llama-3.1-8B shape, random bf16 weights; the chain's 4 rows: root + 3 drafts, or with
--setup tree the tree's 16: root + 15 drafted nodes) under other GEMV choices for its row bucket's shapes: as
chosen, with the swapped-operand tiles also in the forms that scale x by a folded norm's weight (timed here, not
in serving), without the swapped tiles, without the tiles split over K, with the norms as kernels of their own,
and with cuBLAS throughout. With SPECSERVE_NORM_IN_WEIGHTS=1 the folds leave x as loaded, serving
times the swapped tiles for them too, and the first two variants are the same.

The chooser (layers/triton_gemv.py) times each shape alone, in a CUDA graph of copies of one kernel. This
replays the whole verify graph instead, recaptured for each variant: how a choice plays out among the
kernels around it is what a step pays. With --descend N it then chooses each key of the bucket by the verify's
own time, among the key's N fastest tiles alone and cuBLAS, one key after another (for finding where the
chooser's isolated timings mislead; on an H200 it took the chain verify from 4.45 to 4.34-4.37 ms).
--save-choices FILE then writes the bucket's decisions it chose, which a server takes with
SPECSERVE_GEMV_CHOICES=FILE (or which join the shipped ones).

    python benchmarks/verify_gemv_choices.py --out benchmarks/results/verify_gemv_choices_h200.json
    python benchmarks/verify_gemv_choices.py --setup tree --descend 3 --out ...
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from profile_gpu_step import cuda_ms
from spec_step_parts import BASE, CHAIN, TREE, graphed, place_at, plain_step
from specserve.bench.decode import hardware_info
from specserve.engine.factory import build_engine_core
from specserve.kernels.tuning import choices as gemv_choices
from specserve.kernels.triton import gemv as triton_gemv
from specserve.kernels.triton.gemv import Tile

ROWS = {"chain": 4, "tree": 16}  # the row bucket of each setup's batch-1 verify


def best_of(timings: dict[str, float], allowed, rows: int) -> Tile | None:
    """The chooser's pick from one key's timings among the tiles `allowed` admits (None: cuBLAS)."""
    tiles = triton_gemv.candidate_tiles(rows, norm=False)
    return triton_gemv.pick(timings, {str(tile): tile for tile in tiles if allowed(tile)})


def bucket_forms(timings: dict, rows_wanted: int) -> list[dict]:
    """Each key's timings alone at the bucket (microseconds): cuBLAS, the best tile with the rows as the dot's
    left operand, the best with the weight there (swapped), the best of those whose weight comes by TMA, and the
    best split over K."""
    forms = {"rows_left": triton_gemv.ROWS_TILES, "swapped": triton_gemv.SWAP_TILES, "tma": triton_gemv.TMA_TILES,
             "split": triton_gemv.SPLIT_ROWS_TILES + triton_gemv.SPLIT_TMA_TILES}
    forms = {form: {str(tile) for tile in tiles} for form, tiles in forms.items()}
    rows = []
    for (shape, _, rows_bucket, gate_up, norm, gamma), times in timings.items():
        if rows_bucket == rows_wanted:
            best = {form: min((t for n, t in times.items() if n in names), default=None)
                    for form, names in forms.items()}
            rows.append({"weight": list(shape), "gate_up": gate_up, "norm": norm, "gamma_in_kernel": gamma,
                         "cublas": round(times["cublas"], 2), **{form: t and round(t, 2) for form, t in best.items()}})
    return rows


def variants(chosen: dict, timings: dict, rows: int) -> dict[str, dict]:
    """Each variant's decisions for the bucket's keys (shape, dtype, rows, gate_up, norm, gamma in the kernel);
    a folded key set to None sends its layer's norm to a kernel of its own."""
    keys = [key for key in chosen if key[2] == rows]
    return {
        "as chosen": {key: best_of(timings[key], lambda t: not t.swap, rows) for key in keys if key[5]},
        "swapped tiles in the norm folds too": {},
        "without the swapped tiles": {key: best_of(timings[key], lambda t: not t.swap, rows) for key in keys},
        "without split tiles": {key: best_of(timings[key], lambda t: t.split_k == 1 and not (t.swap and key[5]),
                                             rows) for key in keys},
        "norms unfolded": {key: None for key in keys if key[4]},
        f"cuBLAS for every {rows}-row shape": {key: None for key in keys},
    }


def label(key: tuple) -> str:
    norm = (" +norm" if key[5] else " +norm (weight in W)") if key[4] else ""
    return f"{list(key[0])}{' gate_up' if key[3] else ''}{norm}"


def descend(verify, start: dict, timings: dict, tries: int, rows: int) -> tuple[dict, list[dict]]:
    """Choice by timing the step itself: from `start`, each key of the bucket the verify graph looks up takes, in
    turn, whichever of its `tries` fastest tiles alone (those serving may choose) or cuBLAS makes the verify
    fastest, the keys after it seeing that pick. `verify(decisions)` gives (ms, keys looked up); a pick that
    switches a layer's norms between folded and apart changes those keys, and any new ones are visited too."""
    decisions, steps, visited = dict(start), [], set()
    _, used = verify(decisions)
    while todo := [key for key in start if key in used and key[2] == rows and key not in visited]:
        key = todo[0]
        visited.add(key)
        allowed = {str(tile): tile for tile in triton_gemv.candidate_tiles(rows, key[4], key[5])
                   if not (tile.swap and key[5])}  # serving's rule, whatever SWAP_IN_FOLDS says here
        fastest = sorted((t, name) for name, t in timings[key].items() if name in allowed)[:tries]
        options = {"cublas": None} | {name: allowed[name] for _, name in fastest}
        times = {name: verify(decisions | {key: tile}) for name, tile in options.items()}
        decisions[key] = options[min(times, key=lambda name: times[name][0])]
        used = times[str(decisions[key]) if decisions[key] is not None else "cublas"][1]
        steps.append({"key": label(key), "was": str(start[key]), "kept": str(decisions[key]),
                      "verify_ms": {name: round(ms, 4) for name, (ms, _) in times.items()}})
        print(steps[-1], flush=True)
    return decisions, steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--setup", choices=sorted(ROWS), default="chain", help="whose batch-1 verify")
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--descend", type=int, default=0, metavar="TRIES",
                   help="then choose each key of the bucket by the verify's own time among its TRIES fastest tiles "
                   "and cuBLAS")
    p.add_argument("--save-choices", metavar="FILE",
                   help="with --descend: write the bucket's decisions it chose, for SPECSERVE_GEMV_CHOICES=FILE")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.save_choices and not args.descend:
        p.error("--save-choices needs --descend")
    if triton_gemv.Choice(triton_gemv.CHOICES_FILE).saved not in (None, "shipped"):
        p.error("unset SPECSERVE_GEMV_CHOICES: this benchmark times the decisions itself")
    triton_gemv.choice = triton_gemv.Choice()  # no shipped decisions: the variants and the descent start from timings
    triton_gemv.SWAP_CANDIDATES = triton_gemv.SWAP_IN_FOLDS = True
    rows = ROWS[args.setup]
    engine, _ = build_engine_core(replace(BASE, spec=CHAIN if args.setup == "chain" else TREE), progress=False)
    program = engine.runner.spec_graphs
    chosen = dict(triton_gemv.choice.best)
    results = []
    with torch.inference_mode():
        n = place_at(program, args.context)
        if args.setup == "chain":
            metas = program._metas(1, n)
            graphed(lambda: program._draft(1, metas))

            def verify_step():
                return program._verify(1, metas["verify"])
        else:
            step_rows = program._metas(1, n)
            _, nodes = graphed(lambda: program._select(1, *program._search(1, n, step_rows)))

            def verify_step():
                return program._verify(1, n, nodes, step_rows)
        plain_ms = cuda_ms(plain_step(engine.runner, args.context, BASE.cache.page_size), args.repeats)

        def verify_ms(decisions: dict) -> float:
            return verify_with_keys(decisions)[0]

        def verify_with_keys(decisions: dict) -> tuple[float, set]:
            """The verify's time under `decisions`, and the chooser keys its capture looked up."""
            triton_gemv.choice.best, looked_up, lookup = decisions, set(), triton_gemv.choice.tile

            def recording(x, weight, gate_up=False, norm=False, gamma=True):
                looked_up.add(triton_gemv.choice.key(x, weight, gate_up, norm, gamma))
                return lookup(x, weight, gate_up, norm, gamma)

            triton_gemv.choice.tile = recording  # shadows the method for this capture
            try:
                verify, _ = graphed(verify_step)
            finally:
                del triton_gemv.choice.tile
            return cuda_ms(verify, args.repeats), looked_up

        for name, change in variants(chosen, triton_gemv.choice.timings, rows).items():
            ms = verify_ms(chosen | change)
            results.append({"variant": name, "verify_ms": round(ms, 4),
                            "verify_minus_plain_ms": round(ms - plain_ms, 4),
                            "decisions": {label(k): str(v) for k, v in (chosen | change).items() if k[2] == rows}})
            print(results[-1], flush=True)
        descent = []
        if args.descend:
            start = chosen | variants(chosen, triton_gemv.choice.timings, rows)["as chosen"]
            decisions, descent = descend(verify_with_keys, start, triton_gemv.choice.timings, args.descend, rows)
            ms = verify_ms(decisions)
            results.append({"variant": "chosen by the verify's own time", "verify_ms": round(ms, 4),
                            "verify_minus_plain_ms": round(ms - plain_ms, 4),
                            "decisions": {label(k): str(v) for k, v in decisions.items() if k[2] == rows}})
            print(results[-1], flush=True)
            if args.save_choices:  # only the bucket's keys: this process timed the others by its own rules
                gemv_choices.save({k: v for k, v in decisions.items() if k[2] == rows}, args.save_choices,
                                  torch.cuda.get_device_name())
    triton_gemv.choice.best = chosen
    report = {"benchmark": "verify_gemv_choices", "hardware": hardware_info(), "plain_decode_ms": round(plain_ms, 4),
              "settings": {**vars(args), "model": "llama-3.1-8b dummy bf16, random EAGLE-3 head", "rows": rows},
              "results": results, "descent": descent,
              "bucket_forms_us": bucket_forms(triton_gemv.choice.timings, rows)}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
