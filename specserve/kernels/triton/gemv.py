"""Matrix-vector products for decode steps of a few rows, in Triton, used where they beat cuBLAS.

A decode step at batch 1 reads every weight once and does almost no math, so its speed is how close each
matmul comes to the GPU's memory bandwidth. cuBLAS gets there for wide matrices, but on an H200 it left a
third of the bandwidth unused on the narrower ones of an 8B Llama (attention output: 4096 x 4096, 2.6 of
4.3 TB/s timed in a CUDA graph, split over K with a separate reduction kernel). Here each program owns BLOCK_N output
features at a time and streams their rows over the whole K, so there is nothing to reduce afterwards. The MLP's
gate/up projection can apply SiLU-and-multiply to its outputs before it stores them (each program takes the
same features of both halves), which saves that kernel's launch and its trip through memory.

Which kernel, and which tile shape, runs for a weight shape is decided the first time the shape is seen, by
timing every candidate, cuBLAS included, inside a CUDA graph (the way decode steps run: without launch
overhead, which would otherwise hide a kernel of a few microseconds) over enough copies of the weight that
none of it is served from L2 (decode reads each weight once a step).
"""
from __future__ import annotations

import functools
import math
import os
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

try:  # host-built TMA descriptors (Triton 3.4 on); without them no TMA tile is a candidate
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

from specserve.kernels.tuning import choices as gemv_choices

from specserve.kernels.triton import pdl as triton_pdl
from specserve.layers.linear import FP8, dense_linear
from specserve.kernels.tuning.choices import Tile
from specserve.kernels.triton.pdl import gdc_launch_dependents, gdc_wait

MAX_ROWS = 16  # rows of x the kernel takes (padded to 16 for the tensor-core dot)
DTYPES = (torch.bfloat16, torch.float16)  # fp32 would go through TF32 in the dot
# Kernels of several rows let the next kernel launch (PDL) only once their main loop is done (by default; see
# TRIGGER_AT). Launched at their start instead, the next kernel's blocks take the SMs these leave free and wait
# there, so that kernel starts with many blocks crowded onto a few SMs: a 4-row down projection after the gate/up
# one ran 20-100 us slower in an 8B verify step than alone (benchmarks/verify_gemv_choices.py).
# SPECSERVE_GEMV_LATE_TRIGGER=0 is the A/B.
LATE_TRIGGER = os.environ.get("SPECSERVE_GEMV_LATE_TRIGGER", "1") != "0"
# Where in the main loop they trigger, as the fraction of it done (1: after it). Alone, each 2-16-row tile of an
# 8B shape takes ~2 us more than the one-row form, which triggers at its start; a trigger near the loop's end
# might win back part of that overlap without the crowding. Timed on an H200 it did not: at 0.9 and 0.75 a batch-1
# chain step took 5.24 and 5.39 ms against 5.12 at 1, so 1 stays the default.
TRIGGER_AT = float(os.environ.get("SPECSERVE_GEMV_TRIGGER_AT", "1.0"))
if not 0.0 < TRIGGER_AT <= 1.0:
    raise ValueError(f"SPECSERVE_GEMV_TRIGGER_AT must be in (0, 1], not {TRIGGER_AT}")


# One row: FMAs on CUDA cores; several rows: a tensor-core dot with the rows padded to 16.
ONE_ROW_TILES = [Tile(n, k, w, s) for n, k in ((4, 512), (8, 256), (8, 512), (16, 256), (16, 512), (32, 256))
                 for w, s in ((4, 3), (4, 5), (8, 4))]
# The row tiles that came within 2 % of the best on some 8B shape at 4 or 16 rows (the 128-wide ones for the
# gate/up form, which streams two weight tiles), and one narrow tile for small models.
ROWS_TILES = [Tile(16, 256, 4, 3), Tile(32, 128, 4, 3), Tile(32, 128, 4, 5), Tile(32, 256, 4, 4), Tile(32, 256, 4, 5),
              Tile(64, 128, 4, 3), Tile(64, 128, 4, 4), Tile(64, 256, 4, 4), Tile(128, 128, 4, 3),
              Tile(128, 128, 8, 3)]
# The same rows with the weight as the dot's left operand (M = BLOCK_N, at least 64: one warpgroup's rows): for
# Hopper that compiles to a wgmma with both operands in shared memory and fewer registers (60-78 %); with the
# rows on the left (above) it is an Ampere-style mma of 16 padded rows, its weight operand in registers.
SWAP_TILES = [Tile(n, k, w, s, swap=True) for n, k, w, s in
              ((64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3), (128, 64, 4, 5), (128, 128, 4, 3), (128, 128, 8, 4))]
# The swapped form with its weight tiles brought by the Hopper TMA (one bulk copy a stage, into the shared memory
# the dot reads) instead of loads by every thread (_gemv_tma_kernel). Graph-timed alone on an H200
# (benchmarks/gemv_tma_probe.py), the best of these beat every other tile on each 8B shape at 4 rows, by 0.4-1.9
# us a call; with the chooser timing them, a batch-1 chain step took 4.91 ms against 5.14 without them, a tree
# step 5.88 against 6.18 (benchmarks/spec_step_parts.py). SPECSERVE_GEMV_TMA=0 keeps them out of the chooser, and
# a decisions file's TMA tiles then run with ordinary loads. Needs sm_90 and a weight whose rows start 16-byte
# aligned.
TMA_TILES = [Tile(n, k, 4, s, swap=True, tma=True) for n, k, s in
             ((64, 128, 4), (64, 128, 6), (64, 256, 3), (64, 256, 4), (128, 128, 3), (128, 128, 6))]
# One-row tiles for fp8 weights (a draft head's), which bring half the bytes a tile: these keep as many in flight as
# the 16-bit ones above by reaching twice as far along K, and won on three of the 8B head's shapes on the H200
# (4096 x 14336: 16.8 us against 20.2). Several-row tiles twice as long along K (16-128 x 256-512, swapped or not)
# were timed there too and never won; they are not candidates, nor are several-row tiles of 8 warps (16-64 x
# 128-512, swapped or not), timed in a later version: none was chosen for a 4-row shape
# (benchmarks/results/spec_bs1_256_fp8_rows_tiles_h200.json).
FP8_ONE_ROW_TILES = [Tile(n, 1024, w, s) for n, w, s in ((4, 8, 4), (8, 4, 3), (16, 8, 4))]
TMA_ON = os.environ.get("SPECSERVE_GEMV_TMA", "1") != "0"
# Split over K (_store_split): each output tile's row slice reduced by `split_k` programs, the last one in adding
# up their partial sums. Unsplit, a weight of few output tiles leaves SMs idle or unevenly loaded (an H200 has 132:
# a 4096 x 4096 weight in 64-wide tiles is 64 programs; a 6144-wide one in 32-wide tiles, 192, a wave and a half),
# and each program streams a whole row; split, there are more, shorter programs. SPECSERVE_GEMV_SPLIT=0 keeps them
# out of the chooser (the A/B).
SPLIT_ON = os.environ.get("SPECSERVE_GEMV_SPLIT", "1") != "0"
SPLIT_ROWS_TILES = [replace(t, split_k=s) for t in (Tile(32, 256, 4, 4), Tile(64, 128, 4, 4)) for s in (2, 4)]
SPLIT_TMA_TILES = [replace(t, split_k=s) for t in (TMA_TILES[0], TMA_TILES[2], TMA_TILES[4]) for s in (2, 4)]
# fp8 weights widened by moving bits (_widen) on sm_90 on (its bf16x2 multiply needs one); SPECSERVE_GEMV_FP8_BITS=0
# takes Triton's conversion (the A/B).
FP8_BITS = os.environ.get("SPECSERVE_GEMV_FP8_BITS", "1") != "0"
# SPECSERVE_GEMV_SWAP_TILES=0 keeps them out of the chooser (the A/B switch; like every chooser switch, it also
# sets the shipped decisions aside: see Choice.tile).
SWAP_CANDIDATES = os.environ.get("SPECSERVE_GEMV_SWAP_TILES", "1") == "1"
# They are not timed for forms that scale x by a folded norm's weight: timed alone those won at 2-16 rows, yet on
# the H200 a 4-row chain verify took 4.55 ms with them against 4.44 with those norms as kernels of their own
# and swapped tiles elsewhere (benchmarks/verify_gemv_choices.py; the tree's 16-row verify took 5.22 ms either
# way). The benchmark sets this to keep timing them. Folds whose norm weight is in the projection's
# (SPECSERVE_NORM_IN_WEIGHTS=1) leave x as loaded, and they are timed there.
SWAP_IN_FOLDS = False


# Eager calls take any row count (one form for one row, one for several); where the trigger falls is a value.
@triton.jit(do_not_specialize=["M", "trigger_k"])
def _gemv_kernel(X, W, OUT, GAMMA, RES, SCALE, WS, COUNTERS, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_om,
                 stride_rm, eps, trigger_k, ROWS: tl.constexpr, ONE_ROW: tl.constexpr, SWAP: tl.constexpr,
                 GATE_UP: tl.constexpr, NORM: tl.constexpr, GAMMA_ON: tl.constexpr, ADD: tl.constexpr,
                 SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                 EVEN: tl.constexpr, PDL: tl.constexpr, LATE_TRIGGER: tl.constexpr, FP8_BITS: tl.constexpr):
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
        if ONE_ROW or not LATE_TRIGGER:
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
        if PDL and not ONE_ROW and LATE_TRIGGER:
            if k0 == trigger_k:  # (compiled for sm_90, the loop's loads stay pipelined with this inside it)
                gdc_launch_dependents()
    if PDL and not ONE_ROW and LATE_TRIGGER:
        if trigger_k >= K:
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
                # the next loads into it (masked loads past K write zeros; on an H200 a TMA tile gave wrong
                # results). The squares read x again instead, a differing eviction hint keeping the two loads
                # apart. (Feeding the dot a copy of x made in registers is also right, but slower: the dot
                # then waits for itself.)
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
        # (an fp8 weight by Triton's conversion: through bf16 by moving bits, one-row GEMVs on the H200 took 20-40 %
        # longer, the f32 FMAs and the integer work sharing the issue slots)
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
# conversion instructions, which an SM issues at a quarter of the rate of these: on an H200 a 4-row GEMV of an fp8
# weight was bound by them (4096 x 14336: 31 us, as slow as the bf16 weight it halves).
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
    """The swapped several-row form with the weight's tiles brought by TMA (W: the weight's descriptor, zeros
    past its edges). It waits for the kernel before it first and lets the next one launch after its loop (so
    TRIGGER_AT does not apply): loading the first tile before the wait, as _gemv_kernel does, made the chooser
    take these tiles for one shape only."""
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
    if tile.tma and TMA_ON and rows > 1 and _tma_ok(weight) and scale is None:
        _gemv_tma_kernel[grid](x, TensorDescriptor.from_tensor(weight, [tile.block_n, tile.block_k]), out, gamma, res,
                               ws, counters, rows, out_features, width, k_split, x.stride(0), out.stride(0), stride_rm,
                               eps, **form)
        return out
    # A split tile lets the next kernel launch after its loop: its trigger column is a whole row's.
    trigger = _trigger_column(width, tile.block_k, TRIGGER_AT) if split == 1 else width
    _gemv_kernel[grid](
        x, weight, out, gamma, res, weight if scale is None else scale, ws, counters, rows, out_features, width,
        k_split, x.stride(0), weight.stride(0), out.stride(0), stride_rm, eps, trigger,
        ONE_ROW=rows == 1, SWAP=tile.swap and rows > 1, SCALED=scale is not None,
        EVEN=width % tile.block_k == 0 and out_features % tile.block_n == 0, LATE_TRIGGER=LATE_TRIGGER,
        FP8_BITS=FP8_BITS and x.is_cuda and _sm90_or_later(x.device.index), **form)
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


def _tma_ok(weight: torch.Tensor) -> bool:
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


@functools.lru_cache(maxsize=None)
def _trigger_column(width: int, block_k: int, fraction: float) -> int:
    """The main loop's column k0 after whose step a several-row kernel triggers its dependents, `fraction` of
    its steps done (the step before the loop, at column 0, counts as the first); `width` (no loop step has it):
    after the loop."""
    steps = triton.cdiv(width, block_k)
    done = min(steps, max(2, math.ceil(fraction * steps)))
    return width if done == steps else (done - 1) * block_k


def _cublas(x: torch.Tensor, weight: torch.Tensor, gate_up: bool = False,
            norm_weight: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """What a call takes where no tile runs: the norm and SiLU-and-multiply as kernels of their own (an fp8
    weight widened to x's type first: `dense_linear`)."""
    from specserve.kernels import pointwise

    if norm_weight is not None:
        x = pointwise.rms_norm(x, norm_weight, 1e-5)
    out = dense_linear(x, weight, scale)
    return pointwise.silu_and_mul(out) if gate_up else out


# Row counts are decided per bucket, each timed at its own size: cuBLAS and the tiles scale differently with
# the rows (an 8B Llama's attention output: tiles win at one row by 28 %, at four by 10 %), so one decision
# for every count above one, timed at two rows, need not hold for a 4-row chain verify.
ROW_BUCKETS = (1, 2, 4, 8, 16)
# cuBLAS must beat the best tile by this factor to be chosen: timed alone it may win by a hair, but in a step
# it also breaks the chain of kernels launched early (PDL), which costs the next kernel its head start.
CUBLAS_MARGIN = float(os.environ.get("SPECSERVE_GEMV_CUBLAS_MARGIN", "1.0"))
NORM_APART = "norm apart"  # a folded norm's call timed as a norm kernel, then the best form without the norm
# SPECSERVE_GEMV_NORM_APART=0: folds are timed against cuBLAS alone, as before (the A/B).
NORM_APART_ON = os.environ.get("SPECSERVE_GEMV_NORM_APART", "1") != "0"
# Decisions taken instead of timed (layers/gemv_choices.py); shapes they lack are timed as usual. Unset: those
# shipped for this GPU, if any (for the H200, the 4-row decisions that verify_gemv_choices.py --descend chose by
# the chain verify's own time, TMA tiles among them; the descent is too slow for every start; and an fp8 EAGLE-3
# head's, as timed at startup by spec_off_tax.py --save-choices), unless a chooser
# switch is off its default. SPECSERVE_GEMV_CHOICES=FILE: a file saved before on this
# GPU (--save-choices writes one); "", "0", "none" or "off": time every shape here.
CHOICES_FILE = os.environ.get("SPECSERVE_GEMV_CHOICES", "shipped")
NO_FILE = ("", "0", "none", "off")


class Choice:
    """Per (weight shape, dtype, row bucket, gate/up form, RMSNorm folded or not, a folded norm's weight applied
    in the kernel or already in the weight): the fastest Tile, or None where cuBLAS won (or, for a folded
    norm, the norm apart did). Each candidate is timed as the call would run it: a call that folds a norm against
    cuBLAS after a norm kernel and against the best unfolded form after one, the gate/up form against cuBLAS and
    a SiLU-and-multiply kernel. A call during CUDA-graph capture cannot time anything, so an undecided shape takes
    cuBLAS there (the graphs' warm-up runs decide the shapes they use before capturing); so does one inside
    `untimed()`, which serving steps run in: timing clones the weight, captures a graph and synchronises, which
    no step should wait for (`decide_all` decides every shape at startup instead)."""

    def __init__(self, saved: str | None = None) -> None:
        self.best: dict[tuple, Tile | None] = {}
        self.timings: dict[tuple, dict[str, float]] = {}  # microseconds per call, for benchmarks to report
        self._timing_allowed = True
        # A decisions file, or "shipped" for this GPU's (read at the first decision, on the GPU it names; then
        # "shipped: NAME", or None where there are none); None: every shape is timed.
        self.saved = None if saved is None or saved.strip().lower() in NO_FILE else saved
        self._unread = self.saved

    @contextmanager
    def untimed(self):
        allowed, self._timing_allowed = self._timing_allowed, False
        try:
            yield
        finally:
            self._timing_allowed = allowed

    @staticmethod
    def key(x: torch.Tensor, weight: torch.Tensor, gate_up: bool = False, norm: bool = False,
            gamma: bool = True) -> tuple:
        """`gamma`: a folded norm's weight is applied in the kernel (False: it is in `weight` already)."""
        rows = next(b for b in ROW_BUCKETS if x.shape[0] <= b)
        return tuple(weight.shape), weight.dtype, rows, gate_up, norm, norm and gamma

    def tile(self, x: torch.Tensor, weight: torch.Tensor, gate_up: bool = False, norm: bool = False,
             gamma: bool = True) -> Tile | None:
        if self._unread:  # once, even if it fails: its error stops the startup that met it
            path, self._unread = self._unread, None
            device = torch.cuda.get_device_name(x.device)
            if path == "shipped":  # made under the chooser's defaults, so only taken under them
                path = gemv_choices.shipped(device) if chooser_at_defaults() else None
                self.saved = path and f"shipped: {path.name}"
            if path:
                self.best = {**gemv_choices.load(path, device), **self.best}
        key = self.key(x, weight, gate_up, norm, gamma)
        if key not in self.best:
            if torch.cuda.is_current_stream_capturing() or not self._timing_allowed:
                return None
            self.best[key] = self._measure(key, x, weight, gate_up, norm, key[-1])
        return self.best[key]

    def report(self) -> list[dict]:
        """Each decided call form: what was chosen and, where it was timed here, cuBLAS's time and the best
        tile's in microseconds (decisions from a file were not timed)."""
        rows_out = []
        for (shape, dtype, rows, gate_up, norm, gamma), tile in self.best.items():
            t = self.timings.get((shape, dtype, rows, gate_up, norm, gamma))
            row = {"weight": list(shape), "dtype": str(dtype).removeprefix("torch."), "rows": rows, "gate_up": gate_up,
                   "norm": norm, "gamma_in_kernel": gamma, "chosen": str(tile)}
            if t is None:  # taken from the decisions file, or set by a benchmark
                row["not_timed_here"] = True
                row["decisions_file"] = self.saved
            else:
                row["cublas_us"] = round(t["cublas"], 2)
                row["best_tile_us"] = round(min((v for n, v in t.items() if n not in ("cublas", NORM_APART)),
                                                default=float("nan")), 2)
                if NORM_APART in t:
                    row["norm_apart_us"] = round(t[NORM_APART], 2)
            rows_out.append(row)
        return rows_out

    def _measure(self, key: tuple, x: torch.Tensor, weight: torch.Tensor, gate_up: bool, norm: bool,
                 gamma: bool) -> Tile | None:
        # A folded norm is also timed as the norm in a kernel of its own before the best form without it, which is
        # what the call runs where no fold is chosen (Linear._forward_gpu): folded, x passes through registers to be
        # scaled, and on an H200 the fp8 head's lm_head (32000 x 4096) took 55 us at 4 rows against 38 apart.
        apart = self.tile(x, weight, gate_up) if norm and NORM_APART_ON else None
        copies = [weight] + [weight.clone() for _ in range(min(-(-256 * 2**20 // _nbytes(weight)), 400) - 1)]
        ones = torch.ones(x.shape[1], dtype=x.dtype, device=x.device) if norm else None
        in_kernel = ones if gamma else None
        scale = torch.ones(weight.shape[0], device=x.device) if weight.dtype == FP8 else None
        # TMA tiles need a 16-bit weight (else they would be timed as tiles with ordinary loads).
        tiles = {str(tile): tile for tile in candidate_tiles(x.shape[0], norm, gamma, scale is not None)
                 if (not tile.tma or (_tma_ok(weight) and scale is None)) and split_fits(weight.shape[1], tile)}
        candidates = {"cublas": lambda w: _cublas(x, w, gate_up, ones, scale)}
        candidates |= {name: (lambda w, tile=tile: gemv(x, w, tile, norm_weight=in_kernel, eps=1e-5,
                                                        gate_up=gate_up, norm=norm, scale=scale))
                       for name, tile in tiles.items()}
        if apart is not None:
            from specserve.kernels import pointwise

            candidates[NORM_APART] = lambda w: gemv(pointwise.rms_norm(x, ones, 1e-5), w, apart, gate_up=gate_up,
                                                    scale=scale)
        times = {}
        for name, fn in candidates.items():
            try:
                times[name] = graph_time(fn, copies) * 1e3
            except triton.runtime.errors.OutOfResources:  # a tile too large for this form (two weight tiles)
                continue
        self.timings[key] = times
        del copies
        return pick(times, tiles)


def chooser_at_defaults() -> bool:
    """Whether every switch of the chooser and the kernels is at its default: an A/B of one (swapped tiles off,
    TMA tiles off, another cuBLAS margin, another trigger) would otherwise be hidden by the shipped decisions for
    the shapes they hold. The norm switches count too: the decisions were made with the norms folded and their
    weights in the projections."""
    from specserve.layers import linear

    return (SWAP_CANDIDATES and TMA_ON and SPLIT_ON and NORM_APART_ON and FP8_BITS and CUBLAS_MARGIN == 1.0
            and LATE_TRIGGER and TRIGGER_AT == 1.0 and linear.FOLD_NORMS and linear.NORM_IN_WEIGHTS)


def pick(times: dict[str, float], tiles: dict[str, Tile]) -> Tile | None:
    """The fastest of `tiles` (by name) among those `times` holds, or None (cuBLAS, and a folded norm apart)
    where none was timed, or cuBLAS ("cublas" in `times`) beats it by CUBLAS_MARGIN, or the norm apart
    (NORM_APART) beats it."""
    timed = [name for name in times if name in tiles]
    if not timed:
        return None
    best = min(timed, key=times.get)
    if times.get(NORM_APART, float("inf")) < times[best]:
        return None
    return None if times["cublas"] * CUBLAS_MARGIN < times[best] else tiles[best]


def candidate_tiles(rows: int, norm: bool = False, gamma: bool = True, fp8: bool = False) -> list[Tile]:
    """The tiles the chooser times for a call of `rows` rows (`norm`: with a norm folded in; `gamma`: its
    weight applied in the kernel; `fp8`: an fp8 weight, which at one row also takes FP8_ONE_ROW_TILES)."""
    if rows == 1:
        return ONE_ROW_TILES + (FP8_ONE_ROW_TILES if fp8 else [])
    swapped = SWAP_CANDIDATES and (SWAP_IN_FOLDS or not (norm and gamma))
    tma = swapped and TMA_ON and TensorDescriptor is not None
    tiles = ROWS_TILES + (SWAP_TILES if swapped else []) + (TMA_TILES if tma else [])
    if SPLIT_ON:
        tiles += SPLIT_ROWS_TILES + (SPLIT_TMA_TILES if tma else [])
    return tiles


def decide_all(module: torch.nn.Module) -> None:
    """Decides every row bucket of the module's GEMV-eligible weights now, at startup: steps run untimed
    (`Choice.untimed`), and what their eager calls meet undecided takes cuBLAS for good (a draft model runs
    eagerly in every drafting step). Each is decided in the forms it is called in (`Linear.gated`,
    `Linear.takes_norm`): an MLP's gate/up projection with SiLU-and-multiply on its output, and in bf16 the
    projections a norm may fold into with and without the norm. Shapes already decided (by the graphs' warm-ups)
    cost nothing."""
    from specserve.layers.linear import FOLD_NORMS, TRITON_GEMV, Linear

    if not TRITON_GEMV:
        return
    for linear in module.modules():
        if not isinstance(linear, Linear) or linear.bias is not None or linear.input_dtype not in DTYPES:
            continue
        folds = linear.takes_norm and FOLD_NORMS and linear.input_dtype == torch.bfloat16
        for rows in ROW_BUCKETS:
            x = torch.zeros(rows, linear.in_features, dtype=linear.input_dtype, device=linear.weight.device)
            for norm in (False, True) if folds else (False,):
                choice.tile(x, linear.weight, linear.gated, norm, gamma=not linear.norm_in_weight)


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


choice = Choice(CHOICES_FILE)
