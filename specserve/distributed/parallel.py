"""Where a model sits in its tensor-parallel group, and the collectives its layers call.

Models take a `TensorParallel` at construction; at size 1 (`SINGLE`) every collective is a no-op and every
layer runs exactly its single-device code. This module never creates process groups: the rank processes
initialise torch.distributed first and hand each model its place.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specserve.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group. `group` is a torch.distributed ProcessGroup, or None for
    the default group when size > 1."""

    rank: int = 0
    size: int = 1
    group: object | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in a group of size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; returns x."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        stacked = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # the ranks' x one after another in dim 0
        torch.distributed.all_gather_into_tensor(stacked, x.contiguous(), group=self.group)
        return stacked if dim % x.dim() == 0 else torch.cat(stacked.chunk(self.size), dim=dim)

    def shard(self, n: int, what: str = "") -> tuple[int, int]:
        """(start, length) of this rank's equal slice of n (`what` names them in the error)."""
        if n % self.size:
            raise ValueError(f"{n} {what or 'rows'} do not split evenly over {self.size} tensor-parallel ranks")
        length = n // self.size
        return self.rank * length, length

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds. With fewer KV heads than ranks each rank holds one,
        shared by the size/num_kv_heads consecutive ranks whose query heads read it (as vLLM and SGLang do)."""
        if num_kv_heads >= self.size:
            return self.shard(num_kv_heads, "KV heads")
        if self.size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {self.size} ranks")
        return self.rank // (self.size // num_kv_heads), 1


SINGLE = TensorParallel()


def rank_model_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The config as one rank sees it: its share of query and KV heads, which is what sizes its KV pool. MLA
    keeps its latent cache whole on every rank (every head reads all of it), so its cache shape is unchanged.
    Raises ValueError where the heads do not split over the group."""
    if tp.size == 1:
        return config
    _, heads = tp.shard(config.num_heads, "attention heads")
    _, kv_heads = tp.kv_heads(config.num_kv_heads)
    return dataclasses.replace(config, num_heads=heads, num_kv_heads=kv_heads)
