"""The shapes CUDA graphs are captured for: batch-size buckets x context-length buckets. A step is padded up to
the nearest of each. Shared by the plain decode graphs (engine/graphs.py) and the speculative step programs."""
from __future__ import annotations


def batch_buckets(max_bs: int) -> list[int]:
    small = [1, 2, 4, 8, 12, 16, 24, 32]
    return sorted({b for b in small if b < max_bs} | set(range(48, max_bs, 16)) | {max_bs})


def context_buckets(max_context: int, page_size: int) -> list[int]:
    buckets, size = [], max(256, page_size)
    while size < max_context:
        buckets.append(size)
        size *= 2
    return buckets + [max_context]
