"""Matrix-vector products for decode steps of a few rows, in Triton, used where they beat cuBLAS.

A decode step at batch 1 reads every weight once and does almost no math, so its speed is how close each
matmul comes to the GPU's memory bandwidth. cuBLAS gets there for wide matrices, but leaves much of the
bandwidth unused on the narrower ones of an 8B Llama (the attention output, 4096 x 4096), which it splits over
K with a separate reduction kernel. Here each program owns BLOCK_N output features at a time and streams their
rows over the whole K (or, split, over a slice of it, the last program in adding the slices up), so there is no
second kernel. The MLP's gate/up projection can apply SiLU-and-multiply to its outputs before it stores them
(each program takes the same features of both halves), and a decoder layer's RMSNorm and residual add can fold
in, which saves those kernels' launches and their trips through memory.

The PyTorch form these are held to is `x @ W^T` (kernels/fp8.dense_linear for an fp8 weight), with
kernels/pointwise's rms_norm and silu_and_mul around it. Which tile runs for a weight shape, or cuBLAS, is the
chooser's decision (kernels/tuning/chooser.py).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:  # host-built TMA descriptors (Triton 3.4 on); without them no TMA tile is a candidate
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

from specserve import envs
from specserve.kernels.fp8 import FP8
from specserve.kernels.triton import pdl as triton_pdl
from specserve.kernels.triton.pdl import gdc_launch_dependents, gdc_wait
from specserve.kernels.tuning.choices import Tile

MAX_ROWS = 16  # rows of x the kernel takes (padded to 16 for the tensor-core dot)
DTYPES = (torch.bfloat16, torch.float16)  # fp32 would go through TF32 in the dot


# One row: FMAs on CUDA cores, letting the next kernel launch (PDL) at the start. Several rows: a tensor-core dot
# with the rows padded to 16, letting the next kernel launch only once the main loop is done. Launched at their
# start instead, the next kernel's blocks take the SMs these leave free and wait there, so that kernel starts
# with many blocks crowded onto a few SMs. Eager calls take any row count (one form for one row, one for several).
@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(X, W, OUT, GAMMA, RES, SCALE, WS, COUNTERS, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_om,
                 stride_rm, eps, ROWS: tl.constexpr, ONE_ROW: tl.constexpr, SWAP: tl.constexpr,
                 GATE_UP: tl.constexpr, NORM: tl.constexpr, GAMMA_ON: tl.constexpr, ADD: tl.constexpr,
                 SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                 EVEN: tl.constexpr, PDL: tl.constexpr, FP8_BITS: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = W + n.to(tl.int64)[:, None] * stride_wn
    up_rows = w_rows + N * stride_wn  # GATE_UP: W holds [gate; up], 2N rows, and each program takes both halves
    m = tl.arange(0, ROWS)
    if ONE_ROW:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        squares = tl.zeros([BLOCK_K], tl.float32)
    else:
        if SWAP:
            acc = tl.zeros([BLOCK_N, ROWS], tl.float32)
        else:
            acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        squares = tl.zeros([ROWS, BLOCK_K], tl.float32)
    acc_up = acc
    k_start, k_end = _columns(K, K_SPLIT, SPLIT)
    # The first weight tile does not depend on the kernel before: it is read while that one finishes.
    k = k_start + tl.arange(0, BLOCK_K)
    w = _load_w(w_rows, k, n_ok, K, EVEN)
    if GATE_UP:
        w_up = _load_w(up_rows, k, n_ok, K, EVEN)
    else:
        w_up = w
    if PDL:
        if ONE_ROW:
            gdc_launch_dependents()
        gdc_wait()
    acc, acc_up, squares = _accumulate(acc, acc_up, squares, w, w_up, X, GAMMA, k, m, M, K, stride_xm, ONE_ROW,
                                       SWAP, GATE_UP, NORM, GAMMA_ON, FP8_BITS)
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = _load_w(w_rows, k, n_ok, K, EVEN)
        if GATE_UP:
            w_up = _load_w(up_rows, k, n_ok, K, EVEN)
        acc, acc_up, squares = _accumulate(acc, acc_up, squares, w, w_up, X, GAMMA, k, m, M, K, stride_xm,
                                           ONE_ROW, SWAP, GATE_UP, NORM, GAMMA_ON, FP8_BITS)
    if PDL and not ONE_ROW:
        gdc_launch_dependents()
    if ONE_ROW:
        out = tl.sum(acc, 1)
        if SCALED:
            out = out * tl.load(SCALE + n, mask=n_ok, other=0.0)
        if NORM:
            scale = tl.rsqrt(tl.sum(squares, 0) / K + eps)
            out = out * scale
        if GATE_UP:
            up = tl.sum(acc_up, 1)
            if SCALED:
                up = up * tl.load(SCALE + N + n, mask=n_ok, other=0.0)
            if NORM:
                up = up * scale
            out = _silu_times(out.to(OUT.dtype.element_ty), up.to(OUT.dtype.element_ty)).to(tl.float32)
        if ADD:
            out += tl.load(RES + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(OUT + n, out.to(OUT.dtype.element_ty), mask=n_ok)
    elif SPLIT > 1:
        _store_split(acc, acc_up, squares, WS, COUNTERS, OUT, RES, SCALE, m, n, n_ok, M, N, K, stride_om, stride_rm,
                     eps, SWAP, GATE_UP, NORM, ADD, SCALED, SPLIT, ROWS, BLOCK_N)
    else:
        _store_rows(acc, acc_up, squares, OUT, RES, SCALE, m, n, n_ok, M, N, K, stride_om, stride_rm, eps, SWAP,
                    GATE_UP, NORM, ADD, SCALED)


@triton.jit
def _columns(K, K_SPLIT, SPLIT: tl.constexpr):
    """The columns [start, end) of K this program reduces over: all of them, or its split's slice."""
    if SPLIT > 1:
        start = tl.program_id(1) * K_SPLIT
        end = tl.minimum(start + K_SPLIT, K)
    else:
        start = 0
        end = K
    return start, end


@triton.jit
def _store_split(acc, acc_up, squares, WS, COUNTERS, OUT, RES, SCALE, m, n, n_ok, M, N, K, stride_om, stride_rm, eps,
                 SWAP: tl.constexpr, GATE_UP: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr,
                 SCALED: tl.constexpr, SPLIT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """A split tile's end: each of its SPLIT programs leaves its partial sums (and a folded norm's partial sums
    of squares) in WS and counts itself in at COUNTERS[tile]; the last one in adds them up, runs the epilogue,
    and sets the count back to zero for the next call. One launch, where cuBLAS's split-K takes a second
    kernel for the reduction."""
    if SWAP:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    tile = tl.program_id(0)
    parts = 2 if GATE_UP else 1
    record = parts * ROWS * BLOCK_N + ROWS  # one program's partial sums: acc, acc_up, the row sums of squares
    cell = m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    mine = WS + (tl.program_id(1) * tl.num_programs(0) + tile).to(tl.int64) * record
    tl.store(mine + cell, acc)
    if GATE_UP:
        tl.store(mine + ROWS * BLOCK_N + cell, acc_up)
    if NORM:
        tl.store(mine + parts * ROWS * BLOCK_N + m, tl.sum(squares, 1))
    tl.debug_barrier()  # every thread's partial stored before the count's release makes them visible
    if tl.atomic_add(COUNTERS + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        acc_up = acc
        row_squares = tl.zeros([ROWS], tl.float32)
        for split in tl.static_range(SPLIT):
            part = WS + (split * tl.num_programs(0) + tile).to(tl.int64) * record
            # (through L2: another SM wrote them, and this one's L1 may hold a line of an earlier call)
            acc += tl.load(part + cell, cache_modifier=".cg")
            if GATE_UP:
                acc_up += tl.load(part + ROWS * BLOCK_N + cell, cache_modifier=".cg")
            if NORM:
                row_squares += tl.load(part + parts * ROWS * BLOCK_N + m, cache_modifier=".cg")
        tl.store(COUNTERS + tile, 0)
        _store_rows(acc, acc_up, row_squares[:, None], OUT, RES, SCALE, m, n, n_ok, M, N, K, stride_om, stride_rm, eps,
                    False, GATE_UP, NORM, ADD, SCALED)


@triton.jit
def _store_rows(acc, acc_up, squares, OUT, RES, SCALE, m, n, n_ok, M, N, K, stride_om, stride_rm, eps,
                SWAP: tl.constexpr, GATE_UP: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr,
                SCALED: tl.constexpr):
    """A several-row tile's epilogue: an fp8 weight's scales, the folded norm's 1/rms, SiLU-and-multiply, the
    residual, the store."""
    if SWAP:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    ok = (m < M)[:, None] & n_ok[None, :]
    if SCALED:
        acc = acc * tl.load(SCALE + n, mask=n_ok, other=0.0)[None, :]
        if GATE_UP:
            acc_up = acc_up * tl.load(SCALE + N + n, mask=n_ok, other=0.0)[None, :]
    if NORM:
        scale = tl.rsqrt(tl.sum(squares, 1) / K + eps)[:, None]
        acc = acc * scale
    if GATE_UP:
        if NORM:
            acc_up = acc_up * scale
        acc = _silu_times(acc.to(OUT.dtype.element_ty), acc_up.to(OUT.dtype.element_ty)).to(tl.float32)
    if ADD:
        acc += tl.load(RES + m[:, None] * stride_rm + n[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + m[:, None] * stride_om + n[None, :], acc.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _accumulate(acc, acc_up, squares, w, w_up, X, GAMMA, k, m, M, K, stride_xm, ONE_ROW: tl.constexpr,
                SWAP: tl.constexpr, GATE_UP: tl.constexpr, NORM: tl.constexpr, GAMMA_ON: tl.constexpr,
                FP8_BITS: tl.constexpr):
    x, squares = _load_input(squares, X, GAMMA, k, m, M, K, stride_xm, X.dtype.element_ty, ONE_ROW, SWAP, NORM,
                             GAMMA_ON)
    acc = _product(acc, w, x, ONE_ROW, SWAP, FP8_BITS)
    if GATE_UP:
        acc_up = _product(acc_up, w_up, x, ONE_ROW, SWAP, FP8_BITS)
    return acc, acc_up, squares


@triton.jit
def _load_input(squares, X, GAMMA, k, m, M, K, stride_xm, dtype, ONE_ROW: tl.constexpr, SWAP: tl.constexpr,
                NORM: tl.constexpr, GAMMA_ON: tl.constexpr):
    """x at columns k, as the product takes it. With NORM, x is the residual stream before RMSNorm: its squares
    are summed (the reciprocal RMS scales the outputs at the end), and with GAMMA_ON it is scaled by the norm's
    weight; without, that weight is already in W and x reaches the dot as loaded. At several rows that is what
    keeps x's loads pipelined into shared memory: scaled, x goes through registers and back, with more
    registers (sm_90: 150 against 106 for a 64 x 128 tile, 198 against 128 for 32 x 256)."""
    k_ok = k < K
    if ONE_ROW:
        x = tl.load(X + k, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:
            squares += x * x
            if GAMMA_ON:
                x = x * tl.load(GAMMA + k, mask=k_ok, other=0.0).to(tl.float32)
    else:
        x_at = X + m[:, None] * stride_xm + k[None, :]
        x_ok = (m < M)[:, None] & k_ok[None, :]
        x = tl.load(x_at, mask=x_ok, other=0.0)
        if NORM:
            if SWAP and not GAMMA_ON:
                # The swapped dot must not share the shared buffer x's loads land in with the sum of squares:
                # Triton 3.6 then gives that buffer as many slots as the loads run ahead (3 at 4 stages),
                # counting the squares as its last reader, and the asynchronous wgmma still reading a slot races
                # the next loads into it (masked loads past K write zeros; a TMA tile gave wrong results).
                # The squares read x again instead, a differing eviction hint keeping the two loads apart.
                # (Feeding the dot a copy of x made in registers is also right, but slower: the dot then
                # waits for itself.)
                xf = tl.load(x_at, mask=x_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
            else:
                xf = x.to(tl.float32)
            squares += xf * xf
            if GAMMA_ON:
                x = (xf * tl.load(GAMMA + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
    return x, squares


@triton.jit
def _product(acc, w, x, ONE_ROW: tl.constexpr, SWAP: tl.constexpr, FP8_BITS: tl.constexpr):
    if ONE_ROW:  # FMAs on CUDA cores, summed over the tile's columns at the end
        # (an fp8 weight by Triton's conversion: moving bits, as _widen does, made one-row GEMVs slower, the f32
        # FMAs and the integer work sharing the issue slots)
        acc += w.to(tl.float32) * x[None, :]
    elif SWAP:  # the weight tile as the dot's left operand: [BLOCK_N, BLOCK_K] @ [BLOCK_K, ROWS]
        acc += tl.dot(_widen(w, x.dtype, FP8_BITS), tl.trans(x))
    else:
        acc += tl.dot(x, tl.trans(_widen(w, x.dtype, FP8_BITS)))
    return acc


# e4m3 -> bf16 or fp16, four values a 32-bit word, by moving bits instead of converting: each byte is placed at the
# top of a 16-bit lane (prmt), its exponent and mantissa are shifted down to the 16-bit type's fields and its sign
# kept (shr, and, lop3), and one multiply by a power of two moves the exponent's bias (e4m3: 7; bf16: 127, fp16:
# 15; e4m3's subnormals become the wider type's, which the multiply makes normal; its NaN codes would come out as
# +-480, and quantize_fp8_rows never writes them). Triton's own conversion goes through fp16 and fp32 with
# conversion instructions, which an SM issues at a quarter of the rate of these: a several-row GEMV of an fp8
# weight was bound by them, as slow as the 16-bit weight it halves.
_E4M3_TO_16 = """{{
.reg .b32 lo, hi, t, bias;
mov.b32 bias, {bias};
prmt.b32 lo, $2, 0, 0x1404;
prmt.b32 hi, $2, 0, 0x3424;
shr.b32 t, lo, {shift};
and.b32 t, t, {field};
lop3.b32 lo, t, 0x80008000, lo, 0xF8;
mul.rn.{kind} $0, lo, bias;
shr.b32 t, hi, {shift};
and.b32 t, t, {field};
lop3.b32 hi, t, 0x80008000, hi, 0xF8;
mul.rn.{kind} $1, hi, bias;
}}"""
# bf16: exponent and mantissa 4 bits down, times 2^120 (0x7B80); fp16: 1 bit down, times 2^8 (0x5C00).
_E4M3_TO_BF16 = tl.constexpr(_E4M3_TO_16.format(shift=4, field="0x07F007F0", kind="bf16x2", bias="0x7B807B80"))
_E4M3_TO_FP16 = tl.constexpr(_E4M3_TO_16.format(shift=1, field="0x3F803F80", kind="f16x2", bias="0x5C005C00"))


@triton.jit
def _widen(w, dtype: tl.constexpr, FP8_BITS: tl.constexpr):
    """w in `dtype` (bf16 or fp16; an fp8 weight's values are exactly both), by moving bits (_E4M3_TO_16) where
    FP8_BITS says the GPU runs PTX (Triton's interpreter does not), else by Triton's conversion."""
    if FP8_BITS and w.dtype == tl.float8e4nv:
        bits = w.to(tl.uint8, bitcast=True)
        if dtype == tl.bfloat16:
            wide = tl.inline_asm_elementwise(_E4M3_TO_BF16, "=r,=r,r", [bits], dtype=tl.bfloat16, is_pure=True, pack=4)
        else:
            wide = tl.inline_asm_elementwise(_E4M3_TO_FP16, "=r,=r,r", [bits], dtype=tl.float16, is_pure=True, pack=4)
    else:
        wide = w.to(dtype)
    return wide


@triton.jit
def _load_w(w_rows, k, n_ok, K, EVEN: tl.constexpr):
    if EVEN:  # no masks: the loads vectorise
        return tl.load(w_rows + k[None, :])
    return tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)


@triton.jit(do_not_specialize=["M"])
def _gemv_tma_kernel(X, W, OUT, GAMMA, RES, WS, COUNTERS, M, N, K, K_SPLIT, stride_xm, stride_om, stride_rm, eps,
                     ROWS: tl.constexpr, GATE_UP: tl.constexpr, NORM: tl.constexpr, GAMMA_ON: tl.constexpr,
                     ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                     PDL: tl.constexpr):
    """The swapped several-row form with the weight's tiles brought by the Hopper TMA (W: the weight's
    descriptor, zeros past its edges): one bulk copy a stage into the shared memory the dot reads, instead of
    loads by every thread. It waits for the kernel before it first and lets the next one launch after its loop:
    loading the first tile before the wait, as _gemv_kernel does, made these tiles lose to the others."""
    n0 = tl.program_id(0) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    m = tl.arange(0, ROWS)
    acc = tl.zeros([BLOCK_N, ROWS], tl.float32)
    acc_up = acc
    squares = tl.zeros([ROWS, BLOCK_K], tl.float32)
    k_start, k_end = _columns(K, K_SPLIT, SPLIT)
    if PDL:
        gdc_wait()
    for k0 in range(k_start, k_end, BLOCK_K):
        w = W.load([n0, k0])
        if GATE_UP:  # W holds [gate; up], 2N rows; each program takes both halves
            w_up = W.load([N + n0, k0])
        else:
            w_up = w
        acc, acc_up, squares = _accumulate(acc, acc_up, squares, w, w_up, X, GAMMA, k0 + tl.arange(0, BLOCK_K), m,
                                           M, K, stride_xm, False, True, GATE_UP, NORM, GAMMA_ON, False)
    if PDL:
        gdc_launch_dependents()
    if SPLIT > 1:
        _store_split(acc, acc_up, squares, WS, COUNTERS, OUT, RES, RES, m, n, n < N, M, N, K, stride_om, stride_rm, eps,
                     True, GATE_UP, NORM, ADD, False, SPLIT, ROWS, BLOCK_N)
    else:
        _store_rows(acc, acc_up, squares, OUT, RES, RES, m, n, n < N, M, N, K, stride_om, stride_rm, eps, True,
                    GATE_UP, NORM, ADD, False)


@triton.jit
def _silu_times(gate, up):
    """silu(gate) * up, rounded where the unfused kernels round (gate and up to the model dtype, as the
    projection stores them; silu(gate); then the product)."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(up.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)


def gemv(x: torch.Tensor, weight: torch.Tensor, tile: Tile, norm_weight: torch.Tensor | None = None,
         eps: float = 0.0, residual: torch.Tensor | None = None, gate_up: bool = False,
         norm: bool = False, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, unit stride along K) @ weight [N, K]^T -> [M, N], accumulated in fp32. With
    `gate_up`, the weight is [gate; up] and the result is silu(x @ gate^T) * (x @ up^T), [M, N/2]. With `norm_weight`,
    RMSNorm(x) (that weight, `eps`) is multiplied instead of x; with `norm` and no `norm_weight`, x / rms(x),
    for a weight that already holds the norm's (`DecoderLayer.move_norm_weights_into_projections`). `residual`
    is added to the result: a decoder layer's norms fold into the GEMVs around them (layers/linear.py). An fp8
    weight comes with `scale` (fp32, one per weight row: `Linear.quantize_fp8`), applied to each output."""
    rows = x.shape[0]
    out_features, width = weight.shape
    if (rows > MAX_ROWS or x.stride(1) != 1 or weight.stride(1) != 1 or x.dtype not in DTYPES
            or x.shape[1] != width or (gate_up and out_features % 2)):
        raise ValueError("gemv takes at most 16 bf16/fp16 rows of the weight's width, each contiguous")
    if (weight.dtype == FP8) != (scale is not None) or (weight.dtype not in (FP8, x.dtype)):
        raise ValueError("the weight must be x's dtype, or fp8 (e4m3) with a scale per row")
    if scale is not None and (scale.dtype != torch.float32 or scale.shape != (weight.shape[0],)):
        raise ValueError("an fp8 weight's scale must be fp32, one per weight row")
    out_features //= 2 if gate_up else 1
    if residual is not None and (residual.shape != (rows, out_features) or residual.stride(1) != 1):
        raise ValueError("the residual must be [rows, out_features] with unit stride")
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(out_features, tile.block_n)
    split = tile.split_k if rows > 1 else 1
    if split > 1 and not split_fits(width, tile):
        raise ValueError(f"{tile} leaves a split without columns of a {width}-wide weight")
    grid = (tiles, split)
    # Absent tensors are passed as some other tensor of the call, which the constexprs keep the kernels from reading.
    gamma = norm_weight if norm_weight is not None else weight
    res, stride_rm = (residual, residual.stride(0)) if residual is not None else (out, 0)
    ws, counters = _split_buffers(tiles, split, tile.block_n, gate_up, x.device) if split > 1 else (out, out)
    k_split = _split_columns(width, tile.block_k, split)
    form = dict(ROWS=MAX_ROWS, GATE_UP=gate_up, NORM=norm or norm_weight is not None, GAMMA_ON=norm_weight is not None,
                ADD=residual is not None, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SPLIT=split,
                num_warps=tile.num_warps, num_stages=tile.num_stages, **triton_pdl.launch_options(x))
    if tile.tma and rows > 1 and tma_ok(weight) and scale is None:
        _gemv_tma_kernel[grid](x, TensorDescriptor.from_tensor(weight, [tile.block_n, tile.block_k]), out, gamma, res,
                               ws, counters, rows, out_features, width, k_split, x.stride(0), out.stride(0), stride_rm,
                               eps, **form)
        return out
    _gemv_kernel[grid](
        x, weight, out, gamma, res, weight if scale is None else scale, ws, counters, rows, out_features, width,
        k_split, x.stride(0), weight.stride(0), out.stride(0), stride_rm, eps,
        ONE_ROW=rows == 1, SWAP=tile.swap and rows > 1, SCALED=scale is not None,
        EVEN=width % tile.block_k == 0 and out_features % tile.block_n == 0,
        FP8_BITS=envs.get().gemv_fp8_bits and x.is_cuda and _sm90_or_later(x.device.index), **form)
    return out


def split_fits(width: int, tile: Tile) -> bool:
    """Whether each of the tile's splits gets columns of a `width`-wide weight (its first tile is loaded
    unmasked)."""
    return (tile.split_k - 1) * _split_columns(width, tile.block_k, tile.split_k) < width


def _split_columns(width: int, block_k: int, split: int) -> int:
    """Columns a split reduces over: whole BLOCK_K steps, shared as evenly as they go."""
    return triton.cdiv(triton.cdiv(width, block_k), split) * block_k


# Where the programs of split tiles count themselves in: zeros, and zeros again after every call (its last
# program resets its tile's count). One array per GPU, made outside any CUDA graph capture: calls on one GPU run
# one after another (one stream; PDL's wait keeps a kernel's counts from the next kernel's).
SPLIT_COUNTERS = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}


def _split_buffers(tiles: int, split: int, block_n: int, gate_up: bool, device: torch.device):
    """The partial sums' workspace of one call (fp32: split x tiles records of _store_split's layout) and the
    GPU's counters."""
    if tiles > SPLIT_COUNTERS:
        raise ValueError(f"a split tile takes at most {SPLIT_COUNTERS} output tiles, not {tiles}")
    if device not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the first split GEMV on a GPU must run outside CUDA graph capture")
        _counters[device] = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
    record = (2 if gate_up else 1) * MAX_ROWS * block_n + MAX_ROWS
    return torch.empty(split * tiles * record, dtype=torch.float32, device=device), _counters[device]


def tma_ok(weight: torch.Tensor) -> bool:
    """Whether a TMA descriptor can cover the weight (else its tile runs with ordinary loads): Triton has them,
    a GPU has the unit (sm_90 on; Triton's interpreter on a CPU runs them too), and the weight's base and rows
    are 16-byte aligned."""
    return (TensorDescriptor is not None and _has_tma(weight.device) and weight.data_ptr() % 16 == 0
            and weight.stride(0) * weight.element_size() % 16 == 0)


def _has_tma(device: torch.device) -> bool:
    return device.type != "cuda" or _sm90_or_later(device.index if device.index is not None else
                                                   torch.cuda.current_device())


@functools.cache
def _sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)
