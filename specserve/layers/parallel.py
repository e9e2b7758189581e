"""Tensor-parallel forms of the linear layer and the embedding.

A column-parallel linear holds a block of its output rows (a rank's heads of a qkv projection, its slice of an
MLP's intermediate rows, its slice of the vocabulary in an lm_head) and needs no collective: its input is whole
on every rank. A row-parallel linear holds the matching block of input columns (o_proj, down_proj), so each rank
computes a partial sum of the output, all-reduced once. A vocab-parallel embedding holds a slice of the rows:
ids outside it look up zeros, and the all-reduce assembles each token's row.

The factories return today's `Linear` and `nn.Embedding` in a group of one, so a single device runs exactly the
layers it always has. `tp_dims` tells models/loader.py which dimension of each checkpoint tensor to slice
(`FIRST_RANK`: whole on rank 0 and zero elsewhere, for a bias added after a partial sum).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.parallel import TensorParallel
from specserve.layers.linear import Linear

FIRST_RANK = "first rank"


class ColumnParallelLinear(Linear):
    """This rank's block of output rows; `out_features` is the block's."""

    tp_dims = {"weight": 0, "bias": 0}


class RowParallelLinear(Linear):
    """This rank's block of input columns; `in_features` is the block's. The output is summed over the group
    unless `reduce` is False, where the caller sums it with other partial sums in one all-reduce."""

    tp_dims = {"weight": 1, "bias": FIRST_RANK}

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, bias: bool,
                 reduce: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp, self.reduce = tp, reduce

    def forward(self, x: torch.Tensor, norm=None, add: torch.Tensor | None = None) -> torch.Tensor:
        # The residual joins after the sum: added inside each rank's GEMV it would be counted once per rank.
        out = super().forward(x, norm=norm)
        if self.reduce:
            self.tp.all_reduce(out)
        return out if add is None else out + add


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + num_embeddings) of the embedding."""

    tp_dims = {"weight": 0}

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        self.vocab_start, rows = tp.shard(vocab_size, "vocabulary rows")
        super().__init__(rows, dim)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        return self.tp.all_reduce(rows.masked_fill(~inside.unsqueeze(-1), 0.0))


def column_linear(in_features: int, out_features: int, tp: TensorParallel, bias: bool = False) -> Linear:
    """A linear whose `out_features` (this rank's) are a block of the whole layer's output rows."""
    if tp.size == 1:
        return Linear(in_features, out_features, bias=bias)
    return ColumnParallelLinear(in_features, out_features, bias=bias)


def row_linear(in_features: int, out_features: int, tp: TensorParallel, bias: bool = False,
               reduce: bool = True) -> Linear:
    """A linear whose `in_features` (this rank's) are a block of the whole layer's input columns."""
    if tp.size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, tp, bias, reduce)


def vocab_embedding(vocab_size: int, dim: int, tp: TensorParallel) -> nn.Embedding:
    if tp.size == 1:
        return nn.Embedding(vocab_size, dim)
    return VocabParallelEmbedding(vocab_size, dim, tp)


def whole_embedding(embedding: nn.Embedding) -> nn.Embedding:
    """The whole [V, H] embedding on every rank, for readers that look rows up without a collective (a draft
    head replicated on every rank, whose fused kernels read the weight). The embedding itself when it is whole;
    else one all-gather of the rows, at startup."""
    if not isinstance(embedding, VocabParallelEmbedding):
        return embedding
    rows = embedding.tp.all_gather(embedding.weight.detach(), dim=0)
    return nn.Embedding.from_pretrained(rows, freeze=True)
