"""CUDA graphs of the target's plain decode step (one token per sequence), captured at startup.

A decode step of a small batch is a few hundred tiny kernels; launching them one by one from Python leaves
the GPU idle most of the time. Replaying a captured graph launches them all at once. Graphs have fixed
shapes, so they are captured for batch-size buckets x context-length buckets, and a step is padded up to
the nearest of each: padded rows write their KV to one reserved slot and attend to one token, and the
context bucket only sizes the page table (attention reads each sequence's own length, with the Triton
paged decode kernel). Each graph also swaps placeholder ids for the tokens they stand for (overlap scheduling,
engine/futures.py) and takes the greedy argmax, and a step uploads its inputs in one copy: at batch 1 a step
is little more than its weights' copy time, so every operation left outside a graph adds a launch's latency
to it. Other sampling stays outside (it reads per-request settings and seeds).

Steps that prefill, or that verify drafts, run eagerly. For training-data generation, the graphs can also
write the tapped layer outputs and the final hidden state of every row to a buffer (`record_layers`).
"""
from __future__ import annotations

import bisect
from typing import NamedTuple

import torch
from tqdm import tqdm

from specserve.engine.futures import FutureTokens
from specserve.graph_shapes import batch_buckets, context_buckets
from specserve.layers.attention import AttentionMetadata
from specserve.sampling.sampler import argmax


class StepInputs(NamedTuple):
    ids: torch.Tensor  # int64 [bs]
    positions: torch.Tensor  # int64 [bs]
    slots: torch.Tensor  # int64 [bs], KV slot of each row's new token
    seq_lens: torch.Tensor  # int32 [bs]
    table: torch.Tensor  # int32 [bs, pages]


def input_views(words: torch.Tensor, bs: int, pages: int) -> StepInputs:
    """A step's inputs as views of one int32 buffer, packed for its batch bucket and page-table width, so that
    one copy of the first `packed_words(bs, pages)` words uploads them all."""
    longs = words[:6 * bs].view(torch.int64)
    return StepInputs(longs[:bs], longs[bs:2 * bs], longs[2 * bs:], words[6 * bs:7 * bs],
                      words[7 * bs:7 * bs + bs * pages].view(bs, pages))


def packed_words(bs: int, pages: int) -> int:
    return bs * (7 + pages)


class DecodeOutput(NamedTuple):
    logits: torch.Tensor  # [b, V]
    greedy: torch.Tensor  # [b] argmax of each row, int64


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, pad_slot: int, max_bs: int,
                 max_context: int, page_size: int, progress: bool = True, proposer=None,
                 record_layers: tuple[int, ...] = (), futures: FutureTokens | None = None) -> None:
        """`pad_slot` is a KV slot no request owns: padded rows write there. A proposer that reads target
        layers (an EAGLE-3 head) observes them inside the graph. With `record_layers`, each replay also leaves
        [those layers' outputs, final normed hidden] per row in `recorded()`. Placeholder ids name `futures`."""
        if proposer is not None and record_layers:
            raise ValueError("record training data with speculation off")
        self.model, self.kv_cache, self.pad_slot, self.page_size = model, kv_cache, pad_slot, page_size
        self.proposer, self.futures = proposer, futures
        self.record_layers = tuple(record_layers)
        self.capture_layers = proposer.capture_layers if proposer is not None else self.record_layers
        self.device = kv_cache.device
        self.batch_sizes = batch_buckets(max_bs)
        self.context_lens = context_buckets(max_context, page_size)
        self.max_bs = self.batch_sizes[-1]
        shapes = [(bs, n) for n in self.context_lens for bs in self.batch_sizes]
        words = max(packed_words(bs, self._pages(n)) for bs, n in shapes)
        # Every graph reads its inputs from the same device words, laid out for its own shape.
        self.staged = torch.zeros(words, dtype=torch.int32, device=self.device)
        self.inputs = {(bs, n): input_views(self.staged, bs, self._pages(n)) for bs, n in shapes}
        # Two pinned host copies in turn: the host fills one while the other's upload may still be queued.
        self._host = [torch.zeros(words, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._host_inputs = [{shape: StepInputs(*(v.numpy() for v in input_views(h, shape[0], self._pages(shape[1]))))
                              for shape in shapes} for h in self._host]
        self._uploaded = [torch.cuda.Event() for _ in range(2)]
        self._turn = 0
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.num_replays = 0
        self.outputs: dict[tuple[int, int], DecodeOutput] = {}
        self.records: dict[tuple[int, int], torch.Tensor] = {}
        self._last_shape: tuple[int, int] | None = None
        self._capture(progress)

    def _pages(self, context_len: int) -> int:
        return -(-context_len // self.page_size)

    def _meta(self, bs: int, n: int) -> AttentionMetadata:
        x = self.inputs[(bs, n)]
        return AttentionMetadata.for_decode_kernel(x.slots, x.table, x.seq_lens, self.page_size,
                                                   self.model.config.kv_entry_shape[1], n)

    def _forward(self, bs: int, n: int) -> DecodeOutput:
        x, meta = self.inputs[(bs, n)], self._meta(bs, n)
        if self.futures is not None:
            self.futures.resolve(x.ids)
        hidden, captured = self.model(x.ids, x.positions, meta, self.kv_cache, self.capture_layers)
        if self.proposer is not None and self.capture_layers:
            self.proposer.observe(captured, meta.slot_mapping)
        if self.record_layers:
            self.records[(bs, n)] = torch.cat([*captured, hidden], dim=-1)
        logits = self.model.compute_logits(hidden)
        return DecodeOutput(logits, argmax(logits))

    def _pad_inputs(self, bs: int, n: int) -> None:
        """Inputs of a batch of padding rows, for warm-up runs: token 0 at position 0, written to the padding
        slot. (The shapes' layouts overlap, so each run sets its own.)"""
        x = self.inputs[(bs, n)]
        for view, value in zip(x, (0, 0, self.pad_slot, 1, 0)):
            view.fill_(value)

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
        from specserve.kernels.tuning.chooser import ROW_BUCKETS

        warm_shapes = {(1, n) for n in self.context_lens}
        warm_shapes |= {(min(rows, self.max_bs), self.context_lens[0]) for rows in ROW_BUCKETS}
        warm_shapes.add((self.max_bs, self.context_lens[-1]))
        with torch.cuda.stream(stream):
            for bs, n in sorted(warm_shapes) * 2:
                self._pad_inputs(bs, n)
                self._forward(bs, n)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for bs, n in tqdm(shapes, desc="capturing CUDA graphs", disable=not progress, leave=False):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[(bs, n)] = self._forward(bs, n)
            pool = graph.pool()
            self.graphs[(bs, n)] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, batch_size: int, context_len: int) -> bool:
        return batch_size <= self.max_bs and context_len <= self.context_lens[-1]

    def run(self, token_ids: list[int], positions: list[int], page_tables: list[list[int]]) -> DecodeOutput:
        """Logits [B, V] and greedy tokens for one decode token per sequence; position p's KV goes to its
        page-table slot. Placeholder ids are resolved on the device. Inputs travel through pinned memory, so
        the host queues this step behind one still running instead of waiting for it."""
        b = len(token_ids)
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, b)]
        n = self.context_lens[bisect.bisect_left(self.context_lens, max(positions) + 1)]
        turn, self._turn = self._turn, self._turn ^ 1
        self._uploaded[turn].synchronize()  # two steps back: read back already, so this never waits
        host = self._host_inputs[turn][(bs, n)]
        ps, width = self.page_size, host.table.shape[1]
        host.ids[:b], host.ids[b:] = token_ids, 0
        host.positions[:b], host.positions[b:] = positions, 0
        host.slots[:b] = [p[pos // ps] * ps + pos % ps for p, pos in zip(page_tables, positions)]
        host.slots[b:] = self.pad_slot
        host.seq_lens[:b], host.seq_lens[b:] = [p + 1 for p in positions], 1
        host.table[...] = 0
        for row, pages in enumerate(page_tables):
            host.table[row, : min(len(pages), width)] = pages[:width]
        words = packed_words(bs, width)
        self.staged[:words].copy_(self._host[turn][:words], non_blocking=True)
        self._uploaded[turn].record()
        self.graphs[(bs, n)].replay()
        self.num_replays += 1
        self._last_shape = (bs, n)
        logits, greedy = self.outputs[(bs, n)]
        return DecodeOutput(logits[:b], greedy[:b])

    def recorded(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last replay's taps [b, len(record_layers) * H] and final hidden states [b, H]: views of buffers
        the next replay overwrites."""
        rows = self.records[self._last_shape][:b]
        width = self.model.config.hidden_size
        return rows[:, :-width], rows[:, -width:]
