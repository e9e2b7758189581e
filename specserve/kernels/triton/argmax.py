"""The greedy token of each row of logits (argmax over the vocabulary) in two small kernels.

PyTorch's argmax gives one row to few blocks, so a row of a large vocabulary takes many times as long as
reading it (docs/performance.md), once in every plain decode step and four times in every chain step. Here
blocks of 2,048 entries each find their best entry, and then one program per row picks the best of its
blocks. As with torch.argmax, ties go to the lower index and a NaN beats every number (the first NaN of a row
is its argmax).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.triton import pdl as triton_pdl
from specserve.kernels.triton.pdl import gdc_launch_dependents, gdc_wait

# Vocabulary entries a program of the first kernel takes: 16 per thread of 4 warps, and 63 programs for one row of
# a 128k vocabulary, enough to spread even a batch-1 row over the GPU.
BLOCK = 2048


# The row stride and the vocabulary are values, not specialisations: eager calls compile no new form.
@triton.jit(do_not_specialize=["stride_row", "vocab"])
def _argmax_block_kernel(X, PART_VALUE, PART_INDEX, stride_row, vocab, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One block of one row: its largest value and the lowest index that holds it, or NaN and its first NaN."""
    row, block = tl.program_id(0), tl.program_id(1)
    index = block * BLOCK + tl.arange(0, BLOCK)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    x = tl.load(X + row.to(tl.int64) * stride_row + index, mask=index < vocab, other=float("-inf")).to(tl.float32)
    value, first = _best(x, index, vocab)
    part = row * tl.num_programs(1) + block
    tl.store(PART_VALUE + part, value)
    tl.store(PART_INDEX + part, first)


@triton.jit
def _best(x, index, none):
    """The largest of x and the lowest index holding it; where x holds a NaN, NaN and the lowest index of one.
    Entries past the end carry -inf and an index above every real one (`none` where nothing is NaN)."""
    nan = x != x
    first_nan = tl.min(tl.where(nan, index, none), axis=0)
    top = tl.max(tl.where(nan, float("-inf"), x), axis=0)
    first_top = tl.min(tl.where(x == top, index, none), axis=0)
    return tl.where(first_nan < none, float("nan"), top), tl.where(first_nan < none, first_nan, first_top)


@triton.jit(do_not_specialize=["blocks", "stride_out"])
def _argmax_merge_kernel(PART_VALUE, PART_INDEX, OFFSETS, OUT, blocks, stride_out, BLOCKS_P2: tl.constexpr,
                         HAS_OFFSETS: tl.constexpr, PDL: tl.constexpr):
    """One row: the best of its blocks' picks, the lower index on a tie; plus OFFSETS at that index if given."""
    row = tl.program_id(0)
    b = tl.arange(0, BLOCKS_P2)
    if PDL:
        gdc_wait()
    values = tl.load(PART_VALUE + row * blocks + b, mask=b < blocks, other=float("-inf"))
    indices = tl.load(PART_INDEX + row * blocks + b, mask=b < blocks, other=2**31 - 1)
    _, first = _best(values, indices, 2**31 - 1)
    first = first.to(tl.int64)
    if HAS_OFFSETS:
        first += tl.load(OFFSETS + first)
    tl.store(OUT + row * stride_out, first)


MAX_VOCAB = 65535 * BLOCK  # a row's blocks are the launch grid's second dimension, at most 65,535


def supports(logits: torch.Tensor) -> bool:
    return logits.stride(-1) == 1 and 0 < logits.shape[-1] <= MAX_VOCAB


def argmax(logits: torch.Tensor, offsets: torch.Tensor | None = None, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for logits [..., vocab] with unit stride along the vocabulary; with
    `offsets` [vocab] (int64), each pick i plus offsets[i] (a draft vocabulary's ids mapped to the target's).
    `out`: where to write the picks (int64, the leading shape, a single stride; a fresh tensor if None)."""
    vocab = logits.shape[-1]
    if offsets is not None and (offsets.shape != (vocab,) or offsets.dtype != torch.int64 or offsets.stride(0) != 1):
        raise ValueError(f"offsets must be contiguous int64 of shape ({vocab},), got {offsets.dtype} "
                         f"{tuple(offsets.shape)} with stride {offsets.stride()}")
    if not supports(logits):
        raise ValueError(f"needs unit stride along a vocabulary of 1 to {MAX_VOCAB}, got {logits.stride()}, {vocab}")
    rows = logits.reshape(-1, vocab)  # a view wherever the leading dimensions allow one
    blocks = triton.cdiv(vocab, BLOCK)
    part_value = torch.empty(rows.shape[0], blocks, dtype=torch.float32, device=logits.device)
    part_index = torch.empty(rows.shape[0], blocks, dtype=torch.int32, device=logits.device)
    if out is None:
        out = torch.empty(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    elif out.shape != logits.shape[:-1] or out.dtype != torch.int64 or (out.dim() > 1 and not out.is_contiguous()):
        raise ValueError(f"out must be int64 of shape {tuple(logits.shape[:-1])}, one stride, got {out.dtype} "
                         f"{tuple(out.shape)} with strides {out.stride()}")
    stride_out = out.stride(0) if out.dim() == 1 else 1
    if rows.shape[0]:
        pdl = triton_pdl.launch_options(logits)
        _argmax_block_kernel[(rows.shape[0], blocks)](rows, part_value, part_index, rows.stride(0), vocab,
                                                      BLOCK=BLOCK, num_warps=4, **pdl)
        _argmax_merge_kernel[(rows.shape[0],)](part_value, part_index, out if offsets is None else offsets, out,
                                               blocks, stride_out, BLOCKS_P2=triton.next_power_of_2(blocks),
                                               HAS_OFFSETS=offsets is not None, num_warps=1, **pdl)
    return out
