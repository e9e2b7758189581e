"""The Triton GEMV's forms against fp32 math, for the tests that run it in Triton's interpreter on a CPU
(tests/kernels/test_triton_interpreter.py): every form (plain, residual add, a norm folded with its weight in the
kernel or moved into the weight, gate/up plain and with either norm form; and with an fp8 weight and its scales).
fp16 throughout: the interpreter's bf16 dot is wrong. Importing this needs Triton; the interpreter must be on
(TRITON_INTERPRET=1) before the kernels are defined."""
from __future__ import annotations

import builtins

import torch

from specserve.kernels.triton import gemv as triton_gemv
from specserve.kernels.tuning.choices import Tile
from specserve.kernels.fp8 import quantize_fp8_rows

# fp16 inputs and outputs, fp32 accumulation: one fp16 step is ~1e-3 of a value (0.004 at 4-8; the gate/up
# products reach the hundreds), so the bound is relative, plus a floor for values near zero.
ATOL, RTOL = 1e-2, 4e-3


def interpreter_range(*bounds):
    """The kernel's main loop bounds arrive as interpreter tensors; the builtin range wants ints."""
    return builtins.range(*(int(b.handle.data.reshape(-1)[0]) if hasattr(b, "handle") else int(b) for b in bounds))


def forms(x, weight, gamma, residual, tile):
    """Each form's output and its fp32 reference."""
    xf, wf = x.float(), weight.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma.float()
    moved = (wf * gamma.float()).to(weight.dtype)

    def gemv(w, *args, **kwargs):
        return triton_gemv.gemv(x, w, tile, *args, **kwargs)

    yield "plain", gemv(weight), xf @ wf.T
    yield "add", gemv(weight, residual=residual), xf @ wf.T + residual.float()
    yield "norm, weight in kernel", gemv(weight, gamma, 1e-5), normed @ wf.T
    yield "norm, weight moved", gemv(moved, eps=1e-5, norm=True), normed @ wf.T
    if weight.shape[0] % 2 == 0:
        for name, out, product in (
                ("gate/up", gemv(weight, gate_up=True), xf @ wf.T),
                ("gate/up, norm weight in kernel", gemv(weight, gamma, 1e-5, gate_up=True), normed @ wf.T),
                ("gate/up, norm moved", gemv(moved, eps=1e-5, gate_up=True, norm=True), normed @ wf.T)):
            gate, up = product.to(x.dtype).float().chunk(2, dim=-1)
            yield name, out, torch.nn.functional.silu(gate) * up


def fp8_forms(x, weight, gamma, residual, tile):
    """Each form with the weight in fp8 and a scale per row (`Linear.quantize_fp8`), against fp32 math on the
    values it holds."""
    quantized, scale = quantize_fp8_rows(weight)
    wf, xf = quantized.float() * scale[:, None], x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma.float()

    def gemv(*args, **kwargs):
        return triton_gemv.gemv(x, quantized, tile, *args, scale=scale, **kwargs)

    yield "fp8", gemv(), xf @ wf.T
    yield "fp8, add", gemv(residual=residual), xf @ wf.T + residual.float()
    yield "fp8, norm", gemv(gamma, 1e-5), normed @ wf.T
    if weight.shape[0] % 2 == 0:
        gate, up = (normed @ wf.T).to(x.dtype).float().chunk(2, dim=-1)
        yield "fp8, gate/up, norm", gemv(gamma, 1e-5, gate_up=True), torch.nn.functional.silu(gate) * up


# Split tiles at interpreter sizes (the shipped ones are 128-256 wide along K): rows-left, swapped, and TMA, in two
# and three splits, the last with a shorter slice at width 600.
SPLIT_TILES = [Tile(32, 64, 4, 3, split_k=2), Tile(64, 64, 4, 3, swap=True, split_k=3),
               Tile(64, 64, 4, 3, swap=True, tma=True, split_k=2)]


def check(rows: int, tiles: list, shapes, calls: int = 1) -> list[dict]:
    """Every form of each tile (those whose splits all get columns) on random weights of each (out_features,
    width) in `shapes`, each form `calls` times (split tiles reset their counts for the next call): one record a
    form and call."""
    results = []
    for out_features, width in shapes:
        weight = (torch.randn(out_features, width) / width**0.5).half()
        x = (torch.randn(rows, width) * 5).half()
        gamma = (torch.rand(width) + 0.5).half()
        residual = torch.randn(rows, out_features).half()
        for tile in (t for t in tiles if triton_gemv.split_fits(width, t)):
            for call in range(calls):
                checked = [*forms(x, weight, gamma, residual, tile), *fp8_forms(x, weight, gamma, residual, tile)]
                for form, out, reference in checked:
                    error = (out.float() - reference).abs()
                    results.append({"rows": rows, "shape": [out_features, width], "tile": str(tile), "form": form,
                                    "call": call, "max_abs_error": round(error.max().item(), 5),
                                    "largest_value": round(reference.abs().max().item(), 2),
                                    "ok": bool((error <= ATOL + RTOL * reference.abs()).all())})
                    print(results[-1], flush=True)
    return results
