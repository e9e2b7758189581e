"""The k best draft tokens of each row with their log-probabilities, in two small kernels.

Each level of the tree program's search takes the head's logits of the fed rows ([rows, draft vocab]) to fp32,
applies log_softmax and keeps the top k. In PyTorch that is a cast, a softmax and a radix top-k: about a dozen
small kernels in the program's graph, five times a step, each paying a launch's latency. Here it takes two
launches: blocks of each row find their max, their sum of exponentials and their k best entries, then one
program per row merges them. Each pick takes the largest value ranked after the last
pick in (value descending, index ascending) order, so ties keep the lower token id. The PyTorch form,
`log_softmax_topk` in speculative/programs/tree.py, is the CPU path; a GPU test holds this to its values and to a
stable sort's ranking.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # vocabulary entries a program of the first kernel keeps in registers


@triton.jit
def _after(x, index, last_value, last_index, valid):
    """Which entries rank after (last_value, last_index) in (value descending, index ascending) order."""
    return valid & ((x < last_value) | ((x == last_value) & (index > last_index)))


@triton.jit
def _best(x, index, after, sentinel):
    """The first of the entries marked `after`: its value and index (sentinel and -inf where none is)."""
    x = tl.where(after, x, float("-inf"))
    value = tl.max(x, axis=0)
    return value, tl.min(tl.where(after & (x == value), index, sentinel), axis=0)


@triton.jit
def _topk_chunk_kernel(X, PART_VALUES, PART_INDICES, PART_MAX, PART_SUM, stride_row, vocab: tl.constexpr,
                  K: tl.constexpr, BLOCK: tl.constexpr):
    """One block of one row: its max, its sum of exp(x - max) and its k best entries."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    part = row * tl.num_programs(1) + chunk
    index = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = index < vocab
    x = tl.load(X + row.to(tl.int64) * stride_row + index, mask=valid, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)  # a NaN compares false everywhere: it would leave no valid pick
    top = tl.max(x, axis=0)
    tl.store(PART_MAX + part, top)
    # A block of -inf logits (a masked vocabulary) holds no mass; exp(-inf - -inf) would be NaN.
    tl.store(PART_SUM + part, tl.where(top == float("-inf"), 0.0, tl.sum(tl.exp(x - top), axis=0)))
    last_value, last_index = float("inf"), -1
    for j in tl.static_range(K):
        last_value, last_index = _best(x, index, _after(x, index, last_value, last_index, valid), vocab)
        tl.store(PART_VALUES + part * K + j, last_value)
        tl.store(PART_INDICES + part * K + j, last_index)


@triton.jit
def _topk_merge_kernel(PART_VALUES, PART_INDICES, PART_MAX, PART_SUM, VALUES, INDICES, vocab: tl.constexpr,
                  K: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, CANDIDATES_P2: tl.constexpr):
    """One row: the log-sum-exp from the blocks' parts, then the k best of the blocks' candidates."""
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_P2)
    tops = tl.load(PART_MAX + row * CHUNKS + c, mask=c < CHUNKS, other=float("-inf"))
    sums = tl.load(PART_SUM + row * CHUNKS + c, mask=c < CHUNKS, other=0.0)
    top = tl.max(tops, axis=0)
    log_total = tl.log(tl.sum(sums * tl.exp(tops - top), axis=0))
    i = tl.arange(0, CANDIDATES_P2)
    valid = i < CHUNKS * K
    x = tl.load(PART_VALUES + row * CHUNKS * K + i, mask=valid, other=float("-inf"))
    index = tl.load(PART_INDICES + row * CHUNKS * K + i, mask=valid, other=vocab)
    last_value, last_index = float("inf"), -1
    for j in tl.static_range(K):
        last_value, last_index = _best(x, index, _after(x, index, last_value, last_index, valid), vocab)
        tl.store(VALUES + row * K + j, (last_value - top) - log_total)  # top apart: no rounding of a sum
        tl.store(INDICES + row * K + j, last_index.to(tl.int64))


def fused_log_softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`speculative.programs.tree.log_softmax_topk` in two Triton launches (blocks of each row, then each row),
    ties to the lower index; logits [rows, vocab] with unit stride along the vocabulary."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1 or not 0 < k <= vocab:
        raise ValueError(f"needs unit stride along the vocabulary and 0 < k <= vocab, got {logits.stride()}, k={k}")
    chunks = triton.cdiv(vocab, BLOCK)
    device = logits.device
    part_values = torch.empty(rows, chunks, k, dtype=torch.float32, device=device)
    part_indices = torch.empty(rows, chunks, k, dtype=torch.int32, device=device)
    part_max = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    part_sum = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    values = torch.empty(rows, k, dtype=torch.float32, device=device)
    indices = torch.empty(rows, k, dtype=torch.int64, device=device)
    _topk_chunk_kernel[(rows, chunks)](logits, part_values, part_indices, part_max, part_sum, logits.stride(0),
                                  vocab=vocab, K=k, BLOCK=BLOCK, num_warps=4)
    _topk_merge_kernel[(rows,)](part_values, part_indices, part_max, part_sum, values, indices, vocab=vocab, K=k,
                           CHUNKS=chunks, CHUNKS_P2=triton.next_power_of_2(chunks),
                           CANDIDATES_P2=triton.next_power_of_2(chunks * k), num_warps=1)
    return values, indices
