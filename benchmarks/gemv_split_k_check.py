"""The split-over-K GEMV tiles the H200's decisions ship (an fp8 EAGLE-3 head's projections, the 8B target's
down projection), on a GPU at 2, 4 and 16 rows, against fp32 math on the values each weight holds (fp8: e4m3 times
its scale per row), each called three times: a split tile's last program resets its tile's count for the next
call, and the outputs must repeat bit for bit. tests/test_gpu.py runs every tile; this is the quick check.

    python benchmarks/gemv_split_k_check.py --out benchmarks/results/gemv_split_k_check_h200.json
"""
from __future__ import annotations

import argparse
import json

import torch

from specserve.bench.decode import hardware_info
from specserve.kernels.triton import gemv as triton_gemv
from specserve.kernels.tuning.choices import Tile
from specserve.layers.linear import quantize_fp8_rows

CASES = [((4096, 14336), Tile(32, 256, 4, 4, split_k=4)), ((6144, 8192), Tile(32, 256, 4, 4, split_k=2)),
         ((4096, 4096), Tile(32, 256, 4, 4, split_k=4)), ((4096, 12288), Tile(32, 256, 4, 4, split_k=4)),
         ((4096, 14336), Tile(64, 128, 4, 4, swap=True, tma=True, split_k=4))]


def check(shape: tuple[int, int], tile: Tile, rows: int) -> dict:
    n, k = shape
    weight = torch.randn(n, k, device="cuda") / k**0.5
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    if tile.tma:  # a bf16 weight (TMA tiles take no fp8)
        weight = weight.bfloat16()
        reference = x.float() @ weight.float().T
        outs = [triton_gemv.gemv(x, weight, tile).float() for _ in range(3)]
    else:
        quantized, scale = quantize_fp8_rows(weight.bfloat16())
        reference = x.float() @ (quantized.float() * scale[:, None]).T
        outs = [triton_gemv.gemv(x, quantized, tile, scale=scale).float() for _ in range(3)]
    error = max((out - reference).abs().max().item() for out in outs)
    repeats = all(torch.equal(out, outs[0]) for out in outs)
    return {"shape": list(shape), "rows": rows, "tile": str(tile), "max_abs_error": error,
            "largest_value": reference.abs().max().item(), "repeat_identical": repeats,
            "ok": repeats and error < 2e-2 * max(1.0, reference.abs().max().item())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    results = [check(shape, tile, rows) for shape, tile in CASES for rows in (2, 4, 16)]
    report = {"check": "gemv_split_k", "hardware": hardware_info(), "all_ok": all(r["ok"] for r in results),
              "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("all ok" if report["all_ok"] else "FAILED", flush=True)


if __name__ == "__main__":
    main()
