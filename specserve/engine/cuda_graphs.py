"""CUDA graphs of the target's plain decode step (one token per sequence), captured at startup.

A decode step of a small batch is a few hundred tiny kernels; launching them one by one from Python leaves
the GPU idle most of the time. Replaying a captured graph launches them all at once. Graphs have fixed
shapes, so they are captured for batch-size buckets x context-length buckets, and a step is padded up to
the nearest of each: padded rows write their KV to one reserved slot and attend to one token, and the
context bucket only sizes the page table (attention reads each sequence's own length, with the Triton
paged decode kernel). Sampling stays outside the graph (it reads per-request settings and seeds).

Steps that prefill, or that verify drafts, run eagerly. For training-data generation, the graphs can also
write the tapped layer outputs and the final hidden state of every row to a buffer (`record_layers`).
"""
from __future__ import annotations

import bisect

import numpy as np
import torch
from tqdm import tqdm

from specserve.engine.futures import FutureTokens, has_placeholder
from specserve.layers.attention import AttentionMetadata


def batch_buckets(max_bs: int) -> list[int]:
    small = [1, 2, 4, 8, 12, 16, 24, 32]
    return sorted({b for b in small if b < max_bs} | set(range(48, max_bs, 16)) | {max_bs})


def context_buckets(max_context: int, page_size: int) -> list[int]:
    buckets, size = [], max(256, page_size)
    while size < max_context:
        buckets.append(size)
        size *= 2
    return buckets + [max_context]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, pad_slot: int, max_bs: int,
                 max_context: int, page_size: int, progress: bool = True, proposer=None,
                 record_layers: tuple[int, ...] = ()) -> None:
        """`pad_slot` is a KV slot no request owns: padded rows write there. A proposer that reads target
        layers (an EAGLE-3 head) observes them inside the graph. With `record_layers`, each replay also leaves
        [those layers' outputs, final normed hidden] per row in `recorded()`."""
        if proposer is not None and record_layers:
            raise ValueError("record training data with speculation off")
        self.model, self.kv_cache, self.pad_slot, self.page_size = model, kv_cache, pad_slot, page_size
        self.proposer = proposer
        self.record_layers = tuple(record_layers)
        self.capture_layers = proposer.capture_layers if proposer is not None else self.record_layers
        self.device = kv_cache.device
        self.batch_sizes = batch_buckets(max_bs)
        self.context_lens = context_buckets(max_context, page_size)
        self.max_bs = self.batch_sizes[-1]
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=self.device)
        self.positions = torch.zeros_like(self.input_ids)
        self.slot_mapping = torch.full_like(self.input_ids, pad_slot)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=self.device)
        # One page table per context bucket, so a batch's rows are a contiguous slice of it.
        self.tables = {n: torch.zeros(self.max_bs, -(-n // page_size), dtype=torch.int32, device=self.device)
                       for n in self.context_lens}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.num_replays = 0
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.records: dict[tuple[int, int], torch.Tensor] = {}
        self._last_shape: tuple[int, int] | None = None
        self._capture(progress)

    def _meta(self, bs: int, n: int) -> AttentionMetadata:
        return AttentionMetadata.for_decode_kernel(self.slot_mapping[:bs], self.tables[n][:bs], self.seq_lens[:bs],
                                                   self.page_size, self.model.config.num_kv_heads, n)

    def _forward(self, bs: int, n: int) -> torch.Tensor:
        meta = self._meta(bs, n)
        hidden, captured = self.model(self.input_ids[:bs], self.positions[:bs], meta, self.kv_cache,
                                      self.capture_layers)
        if self.proposer is not None and self.capture_layers:
            self.proposer.observe(captured, meta.slot_mapping)
        if self.record_layers:
            self.records[(bs, n)] = torch.cat([*captured, hidden], dim=-1)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self, progress: bool) -> None:
        pool = None
        shapes = [(bs, n) for n in reversed(self.context_lens) for bs in reversed(self.batch_sizes)]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Warm up outside capture: library handles, the GEMV choice for each row bucket (timing is impossible
        # during capture, where an undecided shape takes cuBLAS) and the attention kernels of each context
        # bucket. Triton variants of other batch sizes (the slice count depends on both) compile during
        # capture, which Triton allows: compiling launches no device work.
        from specserve.layers.triton_gemv import ROW_BUCKETS

        warm_shapes = {(1, n) for n in self.context_lens}
        warm_shapes |= {(min(rows, self.max_bs), self.context_lens[0]) for rows in ROW_BUCKETS}
        warm_shapes.add((self.max_bs, self.context_lens[-1]))
        with torch.cuda.stream(stream):
            for bs, n in sorted(warm_shapes) * 2:
                self._forward(bs, n)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for bs, n in tqdm(shapes, desc="capturing CUDA graphs", disable=not progress, leave=False):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[(bs, n)] = self._forward(bs, n)
            pool = graph.pool()
            self.graphs[(bs, n)] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, batch_size: int, context_len: int) -> bool:
        return batch_size <= self.max_bs and context_len <= self.context_lens[-1]

    def run(self, token_ids: list[int], positions: list[int], page_tables: list[list[int]],
            futures: FutureTokens | None = None) -> torch.Tensor:
        """Logits [B, V] for one decode token per sequence; position p's KV goes to its page-table slot.
        Placeholder ids are resolved from `futures` on the device. Inputs travel through pinned memory, so
        the host queues this step behind one still running instead of waiting for it."""
        b = len(token_ids)
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, b)]
        n = self.context_lens[bisect.bisect_left(self.context_lens, max(positions) + 1)]
        ps, width = self.page_size, self.tables[n].shape[1]
        pad = bs - b
        table = np.zeros((bs, width), dtype=np.int32)
        for row, pages in enumerate(page_tables):
            table[row, : min(len(pages), width)] = pages[:width]
        slots = [p[pos // ps] * ps + pos % ps for p, pos in zip(page_tables, positions)]
        # Dtypes match the device buffers: a converting copy would stage through pageable memory.
        host = np.array([token_ids + [0] * pad, positions + [0] * pad, slots + [self.pad_slot] * pad],
                        dtype=np.int64)
        host = torch.from_numpy(host).pin_memory()
        lens = torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32).pin_memory()
        self.input_ids[:bs].copy_(host[0], non_blocking=True)
        self.positions[:bs].copy_(host[1], non_blocking=True)
        self.slot_mapping[:bs].copy_(host[2], non_blocking=True)
        self.seq_lens[:bs].copy_(lens, non_blocking=True)
        self.tables[n][:bs].copy_(torch.from_numpy(table).pin_memory(), non_blocking=True)
        if futures is not None and has_placeholder(token_ids):
            futures.resolve(self.input_ids[:bs])
        self.graphs[(bs, n)].replay()
        self.num_replays += 1
        self._last_shape = (bs, n)
        return self.logits[(bs, n)][:b]

    def recorded(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last replay's taps [b, len(record_layers) * H] and final hidden states [b, H]: views of buffers
        the next replay overwrites."""
        rows = self.records[self._last_shape][:b]
        width = self.model.config.hidden_size
        return rows[:, :-width], rows[:, -width:]
