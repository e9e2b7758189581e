"""Matrix-vector products for decode steps of a few rows, in Triton, used where they beat cuBLAS.

A decode step at batch 1 reads every weight once and does almost no math, so its speed is how close each
matmul comes to the GPU's memory bandwidth. cuBLAS gets there for wide matrices, but on an H200 it left a
third to a half of the bandwidth unused on the narrower ones of an 8B Llama (attention output: 4096 x 4096,
~2.1 of 4.3 TB/s, split over K with a separate reduction kernel). Here each program owns BLOCK_N output
features and streams their rows over the whole K, so there is nothing to reduce afterwards. Which of the two
runs for a weight shape is decided by timing both the first time the shape is seen (`Choice`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # rows of x the kernel takes (padded to 16 for the tensor-core dot)
DTYPES = (torch.bfloat16, torch.float16)  # fp32 would go through TF32 in the dot

_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk in ((8, 512), (16, 256), (16, 512), (32, 128), (32, 256)) for w in (4, 8) for s in (3, 5)]


@triton.autotune(configs=_CONFIGS, key=["N", "K", "ONE_ROW"])
@triton.heuristics({"EVEN": lambda a: a["K"] % a["BLOCK_K"] == 0 and a["N"] % a["BLOCK_N"] == 0})
@triton.jit
def _gemv_kernel(X, W, OUT, M, N, K, stride_xm, stride_wn, stride_om, ROWS: tl.constexpr,
                 ONE_ROW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = W + n.to(tl.int64)[:, None] * stride_wn
    m = tl.arange(0, ROWS)
    if ONE_ROW:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        if EVEN:  # no masks: the loads vectorise
            w = tl.load(w_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if ONE_ROW:
            x = tl.load(X + k, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        else:
            x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=(m < M)[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w))
    if ONE_ROW:
        tl.store(OUT + n, tl.sum(acc, 1).to(OUT.dtype.element_ty), mask=n_ok)
    else:
        tl.store(OUT + m[:, None] * stride_om + n[None, :], acc.to(OUT.dtype.element_ty),
                 mask=(m < M)[:, None] & n_ok[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= 16, unit stride along K) @ weight [N, K]^T -> [M, N], accumulated in fp32."""
    rows, width = x.shape
    out_features = weight.shape[0]
    if rows > MAX_ROWS or x.stride(1) != 1 or weight.stride(1) != 1 or x.dtype not in DTYPES:
        raise ValueError("gemv takes at most 16 bf16/fp16 rows, each contiguous")
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(out_features, meta["BLOCK_N"]),)  # noqa: E731
    _gemv_kernel[grid](x, weight, out, rows, out_features, width, x.stride(0), weight.stride(0), out.stride(0),
                       ROWS=MAX_ROWS, ONE_ROW=rows == 1)
    return out


class Choice:
    """Per (weight shape, dtype, one row or several): whether the Triton kernel beat cuBLAS when both were
    timed on the first call. A call during CUDA-graph capture cannot time anything, so an undecided shape
    takes cuBLAS there (the graphs' warm-up runs decide the shapes they use before capturing)."""

    def __init__(self) -> None:
        self.faster: dict[tuple, bool] = {}

    def use_triton(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        key = (tuple(weight.shape), weight.dtype, x.shape[0] == 1)
        decided = self.faster.get(key)
        if decided is None:
            if torch.cuda.is_current_stream_capturing():
                return False
            decided = self.faster[key] = _time(gemv, x, weight) < _time(torch.nn.functional.linear, x, weight)
        return decided


def _time(fn, x: torch.Tensor, weight: torch.Tensor) -> float:
    fn(x, weight)  # compiles and autotunes
    return triton.testing.do_bench(lambda: fn(x, weight), warmup=5, rep=20)


choice = Choice()
