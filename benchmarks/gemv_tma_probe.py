"""Would TMA loads make the several-row GEMV faster? A probe, first written before the kernel had a TMA form.

A verify step's GEMVs of 4 and 16 rows stream their weights ~2-4 us slower a call than one row does (see the
H200 notebook). Every form tried so far loads the weight tile with ordinary loads (cp.async into shared memory
for the tensor-core dot). Here the weight tile comes through a host-built TMA descriptor instead: one bulk copy
per stage into swizzled shared memory, which the Hopper dot reads in place (triton_gemv's TMA form, over a
wider grid of tiles than the chooser's; gemv_tma_probe_h200.json came from a first, plain-product kernel of
this file's own). Each form is timed the way the chooser times (layers/triton_gemv.graph_time: inside a CUDA
graph, over enough weight copies that L2 holds none), for the 8B shapes' plain products (no norm, SiLU or
residual), at 1, 4 and 16 rows, against the kernel's every candidate tile and cuBLAS. Usage: python benchmarks/gemv_tma_probe.py [--check] --out FILE (a GPU with TMA: sm_90 or
later; --check: the kernel's own swapped tiles, TMA and not, against fp32 math in every form instead).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from specserve.bench.decode import hardware_info
from specserve.kernels.triton import gemv as triton_gemv, pointwise as triton_pointwise
from specserve.kernels.tuning.choices import Tile

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
TMA_GRID = [(n, k, s) for n in (64, 128) for k in (64, 128, 256) for s in (3, 4, 6) if n * k * s <= 128 * 128 * 6]


def time_forms(name: str, shape: tuple[int, int], rows: int) -> dict:
    triton_gemv.TMA_ON = True  # whatever SPECSERVE_GEMV_TMA says: the TMA form is what is probed
    weight = torch.randn(shape, device="cuda", dtype=torch.bfloat16) / shape[1] ** 0.5
    copies = [weight] + [weight.clone() for _ in range(max(1, -(-256 * 2**20 // (weight.numel() * 2))) - 1)]
    x = torch.randn(rows, shape[1], device="cuda", dtype=torch.bfloat16)
    reference = (x.float() @ weight.float().T)
    times = {"cublas": triton_gemv.graph_time(lambda w: F.linear(x, w), copies) * 1e3}
    for tile in triton_gemv.candidate_tiles(rows):
        times[f"tile {tile}"] = triton_gemv.graph_time(lambda w, t=tile: triton_gemv.gemv(x, w, t), copies) * 1e3
    if rows > 1:  # the kernel's TMA form over a wider grid of tiles than it takes as candidates
        for block_n, block_k, stages in TMA_GRID:
            tile = Tile(block_n, block_k, 4, stages, swap=True, tma=True)
            try:
                got = triton_gemv.gemv(x, weight, tile)
            except Exception as e:  # a tile this GPU's shared memory or TMA box cannot take
                print(f"tma {block_n}x{block_k}x{stages}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            error = ((got.float() - reference).abs().max() / reference.abs().max()).item()
            if error > 2e-2:
                raise AssertionError(f"TMA form wrong for {name} {rows} rows {block_n, block_k, stages}: {error}")
            times[f"tma {block_n}x{block_k}x{stages}"] = triton_gemv.graph_time(
                lambda w, t=tile: triton_gemv.gemv(x, w, t), copies) * 1e3
    copy_us = weight.numel() * 2 / 4.30e12 * 1e6
    best = {kind: min((v for k, v in times.items() if k.startswith(kind)), default=None)
            for kind in ("cublas", "tile", "tma")}
    result = {"weight": name, "shape": list(shape), "rows": rows, "copy_time_us_at_4.30TB/s": round(copy_us, 2),
              "best_us": {k: round(v, 2) for k, v in best.items() if v is not None},
              "times_us": {k: round(v, 2) for k, v in sorted(times.items(), key=lambda kv: kv[1])}}
    print(name, rows, result["best_us"], flush=True)
    return result


REPEATS = 5


def check_tiles(device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                shapes=((960, 576), (4096, 4096), (1000, 200), (576, 1536)), tiles=None) -> list[dict]:
    """The kernel's swapped tiles (`tiles`; by default the TMA ones and those with pointer loads, through gemv)
    in every form, on the shapes and inputs of the GPU fold test (same seed, same draws), each against fp32
    math with that test's bounds: on the H200 a TMA tile failed the moved-norm form on 960 x 576 at 3 and 16
    rows, and the test stopped there. This runs every tile and form to the end and keeps the size of each
    mismatch. (Triton's interpreter can run it on a CPU in fp16, given gemv_interpreter_check's
    interpreter_range as triton_gemv.range.)"""
    triton_gemv.TMA_ON = True
    tiles = tiles if tiles is not None else triton_gemv.TMA_TILES + triton_gemv.SWAP_TILES
    rows_out = []
    for shape in shapes:
        for rows in (3, 16):
            torch.manual_seed(rows)
            weight = torch.randn(*shape, device=device, dtype=dtype) / shape[1] ** 0.5
            x = torch.randn(rows, shape[1], device=device, dtype=dtype) * 3
            gamma = torch.rand(shape[1], device=device, dtype=dtype) + 0.5
            residual = torch.randn(rows, shape[0], device=device, dtype=dtype)
            xf = x.float()
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma.float()
            moved = (weight.float() * gamma.float()).to(dtype)
            folded_ref = normed @ weight.float().T
            gated_ref = triton_pointwise.silu_and_mul(folded_ref.to(dtype)).float()
            forms = {"plain": (dict(), weight, xf @ weight.float().T, 2e-2),
                     "add": (dict(residual=residual), weight, xf @ weight.float().T + residual.float(), 3e-2),
                     "norm, weight in kernel": (dict(norm_weight=gamma, eps=1e-5), weight, folded_ref, 2e-2),
                     "gate/up, norm weight in kernel": (dict(norm_weight=gamma, eps=1e-5, gate_up=True), weight,
                                                        gated_ref, 3e-2),
                     "norm, weight moved": (dict(norm=True, eps=1e-5), moved, folded_ref, 2e-2),
                     "gate/up, norm moved": (dict(norm=True, eps=1e-5, gate_up=True), moved, gated_ref, 3e-2)}
            for tile in tiles:
                for form, (kwargs, w, ref, atol) in forms.items():
                    row = {"shape": list(shape), "rows": rows, "tile": str(tile), "form": form}
                    try:
                        # A race shows in some calls only: the worst of several is kept.
                        error = torch.stack([(triton_gemv.gemv(x, w, tile, **kwargs).float() - ref).abs()
                                             for _ in range(REPEATS)]).amax(0)
                    except Exception as e:  # out of shared memory in the gate/up form, or a failure to report
                        rows_out.append({**row, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                        continue
                    rows_out.append({**row, "max_abs_error": round(error.max().item(), 5),
                                     "largest_value": round(ref.abs().max().item(), 3),
                                     "mismatched": int((error > atol + 2e-2 * ref.abs()).sum().item()),
                                     "ok": bool((error <= atol + 2e-2 * ref.abs()).all())})
                    if not rows_out[-1]["ok"]:
                        print("WRONG", rows_out[-1], flush=True)
    return rows_out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--check", action="store_true",
                   help="instead of timing, check the results of the kernel's swapped tiles, TMA and not")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.check:
        results = check_tiles()
        # Only a tile that outgrows shared memory in a form is let off (the chooser skips it the same way).
        report = {"check": "gemv_swapped_tiles", "hardware": hardware_info(), "results": results,
                  "compared": sum("ok" in r for r in results), "wrong": sum(not r.get("ok", True) for r in results),
                  "all_ok": all(r.get("ok", r.get("error", "").startswith("OutOfResources")) for r in results)}
    else:
        report = {"benchmark": "gemv_tma_probe", "unit": "us per call, graph-timed", "hardware": hardware_info(),
                  "results": [time_forms(name, shape, rows) for rows in args.rows for name, shape in SHAPES.items()]}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
