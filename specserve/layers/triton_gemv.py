"""Matrix-vector products for decode steps of a few rows, in Triton, used where they beat cuBLAS.

A decode step at batch 1 reads every weight once and does almost no math, so its speed is how close each
matmul comes to the GPU's memory bandwidth. cuBLAS gets there for wide matrices, but on an H200 it left a
third of the bandwidth unused on the narrower ones of an 8B Llama (attention output: 4096 x 4096, 2.6 of
4.3 TB/s timed in a CUDA graph, split over K with a separate reduction kernel). Here each program owns BLOCK_N output
features and streams their rows over the whole K, so there is nothing to reduce afterwards. The MLP's down
projection can also take the gate/up projection as it comes and apply SiLU-and-multiply while loading it,
which saves that kernel's launch and its trip through memory.

Which kernel, and which tile shape, runs for a weight shape is decided the first time the shape is seen, by
timing every candidate, cuBLAS included, inside a CUDA graph (the way decode steps run: without launch
overhead, which would otherwise hide a kernel of a few microseconds) over enough copies of the weight that
none of it is served from L2 (decode reads each weight once a step).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specserve.layers import triton_pdl
from specserve.layers.triton_pdl import gdc_launch_dependents, gdc_wait

MAX_ROWS = 16  # rows of x the kernel takes (padded to 16 for the tensor-core dot)
DTYPES = (torch.bfloat16, torch.float16)  # fp32 would go through TF32 in the dot


@dataclass(frozen=True)
class Tile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# One row: FMAs on CUDA cores; several rows: a tensor-core dot with the rows padded to 16.
ONE_ROW_TILES = [Tile(n, k, w, s) for n, k in ((4, 512), (8, 256), (8, 512), (16, 256), (16, 512), (32, 256))
                 for w, s in ((4, 3), (4, 5), (8, 4))]
ROWS_TILES = [Tile(n, k, w, s) for n, k in ((16, 128), (16, 256), (32, 128), (32, 256), (64, 128))
              for w, s in ((4, 3), (4, 5))]


@triton.jit(do_not_specialize=["M"])  # eager calls take any row count: one form for one row, one for several
def _gemv_kernel(X, W, OUT, GAMMA, RES, M, N, K, stride_xm, stride_wn, stride_om, stride_rm, eps,
                 ROWS: tl.constexpr, ONE_ROW: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr,
                 ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                 PDL: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = W + n.to(tl.int64)[:, None] * stride_wn
    m = tl.arange(0, ROWS)
    if ONE_ROW:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        squares = tl.zeros([BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        squares = tl.zeros([ROWS, BLOCK_K], tl.float32)
    # The first weight tile does not depend on the kernel before: it is read while that one finishes.
    k = tl.arange(0, BLOCK_K)
    w = _load_w(w_rows, k, n_ok, K, EVEN)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc, squares = _accumulate(acc, squares, w, X, GAMMA, k, m, M, K, stride_xm, ONE_ROW, SILU_MUL, NORM)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        acc, squares = _accumulate(acc, squares, _load_w(w_rows, k, n_ok, K, EVEN), X, GAMMA, k, m, M, K,
                                   stride_xm, ONE_ROW, SILU_MUL, NORM)
    if ONE_ROW:
        out = tl.sum(acc, 1)
        if NORM:
            out = out * tl.rsqrt(tl.sum(squares, 0) / K + eps)
        if ADD:
            out += tl.load(RES + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(OUT + n, out.to(OUT.dtype.element_ty), mask=n_ok)
    else:
        ok = (m < M)[:, None] & n_ok[None, :]
        if NORM:
            acc = acc * tl.rsqrt(tl.sum(squares, 1) / K + eps)[:, None]
        if ADD:
            acc += tl.load(RES + m[:, None] * stride_rm + n[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + m[:, None] * stride_om + n[None, :], acc.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _accumulate(acc, squares, w, X, GAMMA, k, m, M, K, stride_xm, ONE_ROW: tl.constexpr, SILU_MUL: tl.constexpr,
                NORM: tl.constexpr):
    """With NORM, x is the residual stream before RMSNorm: its squares are summed (the reciprocal RMS scales
    the outputs at the end) and it is scaled by the norm's weight on the way in."""
    k_ok = k < K
    if ONE_ROW:
        x = _load_x(X, k, k_ok, K, SILU_MUL).to(tl.float32)
        if NORM:
            squares += x * x
            x = x * tl.load(GAMMA + k, mask=k_ok, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    else:
        x = _load_x(X + m[:, None] * stride_xm, k[None, :], (m < M)[:, None] & k_ok[None, :], K, SILU_MUL)
        if NORM:
            xf = x.to(tl.float32)
            squares += xf * xf
            x = (xf * tl.load(GAMMA + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(w.dtype)
        acc += tl.dot(x, tl.trans(w))
    return acc, squares


@triton.jit
def _load_w(w_rows, k, n_ok, K, EVEN: tl.constexpr):
    if EVEN:  # no masks: the loads vectorise
        return tl.load(w_rows + k[None, :])
    return tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _load_x(X, k, ok, K, SILU_MUL: tl.constexpr):
    """x at columns k; with SILU_MUL, X holds [gate | up] (2K wide) and x = silu(gate) * up, rounded where
    the unfused kernels round (silu(gate) to the model dtype, then the product)."""
    if SILU_MUL:
        gate = tl.load(X + k, mask=ok, other=0.0)
        up = tl.load(X + K + k, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(up.dtype)
        x = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    else:
        x = tl.load(X + k, mask=ok, other=0.0)
    return x


def gemv(x: torch.Tensor, weight: torch.Tensor, tile: Tile, silu_mul: bool = False,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None
         ) -> torch.Tensor:
    """x [M, K] (M <= 16, unit stride along K) @ weight [N, K]^T -> [M, N], accumulated in fp32. With
    `silu_mul`, x is [M, 2K] = [gate | up] and silu(gate) * up is multiplied instead. With `norm_weight`,
    RMSNorm(x) (that weight, `eps`) is multiplied instead of x, and `residual` [M, N] is added to the result:
    a decoder layer's norms fold into the GEMVs around them (layers/linear.py)."""
    rows = x.shape[0]
    out_features, width = weight.shape
    if (rows > MAX_ROWS or x.stride(1) != 1 or weight.stride(1) != 1 or x.dtype not in DTYPES
            or x.shape[1] != width * (2 if silu_mul else 1) or (silu_mul and norm_weight is not None)):
        raise ValueError("gemv takes at most 16 bf16/fp16 rows of the weight's width, each contiguous")
    if residual is not None and (residual.shape != (rows, out_features) or residual.stride(1) != 1):
        raise ValueError("the residual must be [rows, out_features] with unit stride")
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    even = width % tile.block_k == 0 and out_features % tile.block_n == 0
    _gemv_kernel[(triton.cdiv(out_features, tile.block_n),)](
        x, weight, out, norm_weight if norm_weight is not None else weight,
        residual if residual is not None else out, rows, out_features, width, x.stride(0), weight.stride(0),
        out.stride(0), residual.stride(0) if residual is not None else 0, eps, ROWS=MAX_ROWS,
        ONE_ROW=rows == 1, SILU_MUL=silu_mul, NORM=norm_weight is not None, ADD=residual is not None,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN=even, num_warps=tile.num_warps,
        num_stages=tile.num_stages, **triton_pdl.launch_options(x))
    return out


def _cublas(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    if silu_mul:
        from specserve.layers import triton_pointwise

        x = triton_pointwise.silu_and_mul(x)
    return F.linear(x, weight)


# Row counts are decided per bucket, each timed at its own size: cuBLAS and the tiles scale differently with
# the rows (an 8B Llama's SiLU-fused down projection: tiles win at one row, lose 3x at two to sixteen), so one
# decision for every count above one, timed at two rows, need not hold for a 4-row chain verify.
ROW_BUCKETS = (1, 2, 4, 8, 16)
# cuBLAS must beat the best tile by this factor to be chosen: timed alone it may win by a hair, but in a step
# it also breaks the chain of kernels launched early (PDL), which costs the next kernel its head start.
CUBLAS_MARGIN = float(os.environ.get("SPECSERVE_GEMV_CUBLAS_MARGIN", "1.0"))


class Choice:
    """Per (weight shape, dtype, row bucket, SiLU-and-multiply or not): the fastest Tile, or None where
    cuBLAS won. A call during CUDA-graph capture cannot time anything, so an undecided shape takes cuBLAS
    there (the graphs' warm-up runs decide the shapes they use before capturing); so does one inside
    `untimed()`, which serving steps run in: timing clones the weight, captures a graph and synchronises,
    which no step should wait for (`decide_all` decides every shape at startup instead)."""

    def __init__(self) -> None:
        self.best: dict[tuple, Tile | None] = {}
        self.timings: dict[tuple, dict[str, float]] = {}  # microseconds per call, for benchmarks to report
        self._timing_allowed = True

    @contextmanager
    def untimed(self):
        allowed, self._timing_allowed = self._timing_allowed, False
        try:
            yield
        finally:
            self._timing_allowed = allowed

    @staticmethod
    def key(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> tuple:
        rows = next(b for b in ROW_BUCKETS if x.shape[0] <= b)
        return tuple(weight.shape), weight.dtype, rows, silu_mul

    def tile(self, x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> Tile | None:
        key = self.key(x, weight, silu_mul)
        if key not in self.best:
            if torch.cuda.is_current_stream_capturing() or not self._timing_allowed:
                return None
            self.best[key] = self._measure(key, x, weight, silu_mul)
        return self.best[key]

    def _measure(self, key: tuple, x: torch.Tensor, weight: torch.Tensor, silu_mul: bool) -> Tile | None:
        copies = [weight] + [weight.clone() for _ in range(min(-(-256 * 2**20 // _nbytes(weight)), 400) - 1)]
        tiles = {str(tile): tile for tile in (ONE_ROW_TILES if x.shape[0] == 1 else ROWS_TILES)}
        candidates = {"cublas": lambda w: _cublas(x, w, silu_mul)}
        candidates |= {name: (lambda w, tile=tile: gemv(x, w, tile, silu_mul)) for name, tile in tiles.items()}
        times = {name: graph_time(fn, copies) * 1e3 for name, fn in candidates.items()}
        self.timings[key] = times
        del copies
        best_tile = min((name for name in times if name != "cublas"), key=times.get)
        return None if times["cublas"] * CUBLAS_MARGIN < times[best_tile] else tiles[best_tile]  # None: cuBLAS


def decide_all(module: torch.nn.Module) -> None:
    """Decides every row bucket of the module's GEMV-eligible weights now, at startup: steps run untimed
    (`Choice.untimed`), and what their eager calls meet undecided takes cuBLAS for good (a draft model runs
    eagerly in every drafting step). An MLP's down projection is decided with SiLU-and-multiply folded in,
    as it is called. Shapes already decided (by the graphs' warm-ups) cost nothing."""
    from specserve.layers.linear import TRITON_GEMV, Linear

    if not TRITON_GEMV:
        return
    for name, linear in module.named_modules():
        if not isinstance(linear, Linear) or linear.bias is not None or linear.weight.dtype not in DTYPES:
            continue
        silu_mul = name.endswith("mlp.down_proj")
        width = linear.in_features * (2 if silu_mul else 1)
        for rows in ROW_BUCKETS:
            x = torch.zeros(rows, width, dtype=linear.weight.dtype, device=linear.weight.device)
            choice.tile(x, linear.weight, silu_mul)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def graph_time(fn, weights: list[torch.Tensor], replays: int = 5) -> float:
    """Milliseconds per call of fn(w), run for each of `weights` in turn inside one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:  # compiles, and lets cuBLAS pick its kernel, outside the capture
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (replays * len(weights))


choice = Choice()
