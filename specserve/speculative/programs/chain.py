"""EAGLE-3 chain speculation as one device program per step, captured in CUDA graphs on a GPU.

The general path (spec/proposer.py, spec/verify.py) searches trees in Python and reads results back after
every draft level; on a GPU those launches and syncs cost more than the drafts save. A chain of k drafts has
fixed shapes, so a whole step fits in one program, with one read-back at the end:

1. catch the head up on the tokens the last step accepted (at most k + 1 per sequence, padded to k + 1);
2. draft k tokens greedily, each fed back with the head's own state;
3. verify root + drafts with the target in one forward, storing the head's taps for all k + 1;
4. accept on the device: the longest prefix of drafts equal to the target's argmax, plus its next token; for
   a sampled row, each draft with the target's probability for it, then a draw from what is left
   (`accept_chain_sampled`).

Every row attends through its sequence's page table, so the paged decode kernel serves all three forwards: on a
GPU a sequence's catch-up rows and verified rows as one run over the context before them, each then seeing the
step's rows up to itself as its tail (SHARED_CONTEXT); otherwise, and the draft levels, each row like a decode
row, up to and including itself. The head's draft nodes take their KV at their own positions in the mirrored
pages, not in scratch slots: the next catch-up rewrites every position a later query can see.

Greedy requests, and sampled requests without a seed (a seeded request draws from its own generator in the
general path, so that its output does not depend on what shares its batches). Steps with sampled rows run the
program eagerly, not from a graph: their filtering branches on the requests' settings on the host, which
costs no sync. On a CPU the same program runs eagerly with the reference attention, which is how CI checks it.
"""
from __future__ import annotations

import bisect
import os
from dataclasses import replace

import numpy as np
import torch
from tqdm import tqdm

from specserve.engine.graphs import batch_buckets, context_buckets
from specserve.core import StepBatch
from specserve.layers.attention import AttentionMetadata
from specserve.sampling.sampler import argmax, filtered_probs, race
from specserve.core import SamplingParams
from specserve.speculative.drafters.base import eagle3_catch_up
from specserve.speculative.simulate import draw_num_accepted
from specserve.transfer import tensor_on


GREEDY = SamplingParams(temperature=0.0)  # the settings of a padding row

# On a GPU, a sequence's catch-up rows and verified rows attend as one run over the context before the step (read
# once for all of them), each row then seeing the step's rows up to itself as its tail, as a tree's verified nodes
# do; otherwise each row attends like a decode row, reading the context itself. On the H200 a batch-1 chain step
# took 4.756 ms with this against 4.806 (benchmarks/spec_step_parts.py). SPECSERVE_CHAIN_SHARED_CONTEXT=0 is the
# A/B switch.
SHARED_CONTEXT = os.environ.get("SPECSERVE_CHAIN_SHARED_CONTEXT", "1") == "1"

# Backlogs up to this many rows a sequence catch up as decode rows on a GPU; longer ones (the head left behind
# for a long shut spell) as a prefill chunk, which reads each context once instead of once per row.
DECODE_ROWS_BACKLOG = 64


def accept_chain(drafts: torch.Tensor, best: torch.Tensor, forced: torch.Tensor | None = None,
                 limit: torch.Tensor | None = None):
    """drafts [B, k], the target's choices best [B, k + 1] -> (tokens [B, k + 1], accepted drafts [B]).

    Row b's new tokens are tokens[b, :accepted[b] + 1]: the accepted drafts, then the target's own next
    token. `forced` replaces the greedy count (simulated acceptance); `limit` [B] caps it (a sequence
    scheduled with fewer than k drafts)."""
    k = drafts.shape[1]
    accepted = (drafts == best[:, :k]).int().cumprod(dim=1).sum(dim=1) if forced is None else forced
    if limit is not None:
        accepted = torch.minimum(accepted, limit)
    tokens = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1)
    tokens.scatter_(1, accepted[:, None], best.gather(1, accepted[:, None]))
    return tokens, accepted


def accept_chain_sampled(drafts: torch.Tensor, probs: torch.Tensor, forced: torch.Tensor | None = None,
                         limit: torch.Tensor | None = None):
    """drafts [B, k], probs [B, k + 1, V] (the target's filtered distribution after root + each draft) ->
    (tokens [B, k + 1], accepted drafts [B]), as `accept_chain` packs them.

    spec/verify.py's rule for a chain, on the device with no host branching: draft i + 1 is accepted with
    probability p_i(draft), and the first rejection ends the chain; the last token is drawn from p_n with the
    rejected draft's mass removed (from p_n itself when every scheduled draft was accepted), by the
    exponential race. Each emitted token is thereby distributed as the target's own draw."""
    k, vocab = drafts.shape[1], probs.shape[2]
    limit = torch.full_like(drafts[:, 0], k) if limit is None else limit
    draft_probs = probs[:, :k].gather(2, drafts[:, :, None])[:, :, 0]
    if forced is None:
        accepted = (torch.rand_like(draft_probs) < draft_probs).int().cumprod(dim=1).sum(dim=1)
    else:
        accepted = forced
    accepted = torch.minimum(accepted, limit)
    rest = probs.gather(1, accepted[:, None, None].expand(-1, 1, vocab))[:, 0]
    rejected = drafts.gather(1, accepted.clamp(max=k - 1)[:, None])
    removed = torch.where((accepted < limit)[:, None], 0.0, rest.gather(1, rejected))
    left = rest.scatter(1, rejected, removed)
    # A forced rejection (simulated acceptance) of a draft that held all the mass leaves nothing: keep p_n.
    rest = torch.where(left.sum(dim=1, keepdim=True) > 0, left, rest)
    tokens = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1)
    tokens.scatter_(1, accepted[:, None], race(rest)[:, None])
    return tokens, accepted


class SpecGraphs:
    """What chain and tree programs share: per-step inputs in one device buffer (one upload), graphs captured
    per (batch bucket, context bucket), a launch that replays (or, on a CPU or with sampled rows, runs) the
    program and leaves each sequence's new tokens packed for one read-back, and rows that follow the last
    launch (`_follow`). Subclasses define the buffers, the rows and the program."""

    def __init__(self, target: torch.nn.Module, drafter, kv_cache: torch.Tensor, width: int, pad_slot: int,
                 max_bs: int, max_context: int, page_size: int, simulate_accept_len: float | None, rng) -> None:
        self.target, self.drafter, self.kv_cache = target, drafter, kv_cache
        self.head = drafter.head
        self.width = width  # catch-up rows per sequence; also the positions a step may add past its root
        self.pad_slot, self.page_size = pad_slot, page_size
        self.simulate_accept_len, self.rng = simulate_accept_len, rng
        self.device = kv_cache.device
        self.batch_sizes = batch_buckets(max_bs)
        self.context_lens = context_buckets(max_context, page_size)
        self.max_bs = self.batch_sizes[-1]
        self.num_runs = 0
        self._allocate()
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # per graph: its packed tokens and counts

    def _buffer_shapes(self) -> dict[str, tuple[tuple[int, ...], int]]:
        """Per-step input name -> (shape at the largest batch, which axis is the batch)."""
        raise NotImplementedError

    def _allocate(self) -> None:
        """The per-step inputs are views of one device buffer, so a step uploads them in one copy."""
        # follow[b]: the row of the last launch that row b continues (-1: its inputs come from the host).
        shapes = {**self._buffer_shapes(), "follow": ((self.max_bs,), 0)}
        total = sum(int(np.prod(shape)) for shape, _ in shapes.values())
        self._flat = torch.zeros(total, dtype=torch.long, device=self.device)
        # On a GPU the host side lives in pinned memory, written in place each step: a fresh pinned copy per
        # step cost host time (with steps in flight, the host rewrites it once the last upload is done).
        pinned = self.device.type == "cuda"
        self._host_tensor = torch.zeros(total, dtype=torch.long, pin_memory=pinned)
        self._host = self._host_tensor.numpy()
        self._host_views, self._batch_axis, offset = {}, {}, 0
        for name, (shape, axis) in shapes.items():
            size = int(np.prod(shape))
            setattr(self, name, self._flat[offset:offset + size].view(shape))
            self._host_views[name] = self._host[offset:offset + size].reshape(shape)
            self._batch_axis[name] = axis
            offset += size
        # Until a step writes them, slot inputs name the padding slot: warm-up and capture then write nowhere
        # that a request could own.
        for name, view in self._host_views.items():
            if name.endswith("slots"):
                view[...] = self.pad_slot
        self._host_views["follow"][...] = -1
        self._flat.copy_(self._host_tensor)
        # What the last launch left for a step that follows it: each row's packed tokens and count, and its root.
        self.last_packed = torch.zeros(self.max_bs, self.width + 1, dtype=torch.long, device=self.device)
        self.last_root = torch.zeros(self.max_bs, dtype=torch.long, device=self.device)
        self.tables = {n: torch.zeros(self.max_bs, -(-n // self.page_size), dtype=torch.int32, device=self.device)
                       for n in self.context_lens}
        self._host_tables = {n: torch.zeros(t.shape, dtype=torch.int32, pin_memory=pinned)
                             for n, t in self.tables.items()}
        self._uploaded = torch.cuda.Event() if pinned else None  # the last upload, done before a rewrite

    def _describe_catch_up(self, seqs, bs: int, width: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """What every program's rows begin with: each sequence's page table (`width` pages) and the head's
        catch-up rows, padded to `self.width` per sequence (padding writes to the padding slot)."""
        w = self.width
        rows = {"catch_ids": np.zeros((bs, w), np.int64), "catch_pos": np.zeros((bs, w), np.int64),
                "catch_slots": np.full((bs, w), self.pad_slot, np.int64),
                "last_row": np.arange(bs, dtype=np.int64) * w}
        tables = np.zeros((bs, width), np.int32)
        for row, s in enumerate(seqs):
            pages = np.asarray(s.page_ids[:width], dtype=np.int64)
            tables[row, : len(pages)] = pages
            ids, first = eagle3_catch_up(s)
            pos = np.arange(first, first + len(ids))
            rows["catch_ids"][row, : len(ids)], rows["catch_pos"][row, : len(ids)] = ids, pos
            rows["catch_slots"][row, : len(ids)] = page_slots(pages, pos, self.page_size)
            rows["last_row"][row] = row * w + max(len(ids) - 1, 0)
        return rows, tables

    def _rows_fit(self, batch: StepBatch, max_drafts: int) -> bool:
        """Decoding rows, greedy or sampled without a seed, at most `max_drafts` each, at least one row drafting
        (else a plain step: the decode graphs take it), and every head catch-up within the program's rows."""
        seqs = batch.seqs
        if not seqs or len(seqs) > self.max_bs or not any(s.num_draft_tokens for s in seqs):
            return False
        for s in seqs:
            if not (s.sample and len(s.token_ids) == 1 and 0 <= s.num_draft_tokens <= max_drafts):
                return False
            if not (s.params.greedy or s.params.seed is None):
                return False
            # Rows with no drafts this step (a request's last token, say) ride along: nothing of theirs is
            # accepted but the target's own token, and their head catch-up waits for a step that drafts.
            catch_up = len(eagle3_catch_up(s)[0])
            if catch_up > self.width or (s.num_draft_tokens and not catch_up):
                return False
        return max(s.start_pos for s in seqs) + self.width <= self.context_lens[-1]

    def without_backlog(self, batch: StepBatch) -> StepBatch:
        """The batch with each head catch-up cut to its last `width` rows: what the program takes once the
        head has caught up on the rest (`catch_up_backlog`)."""
        w = self.width
        seqs = [replace(s, draft_start_pos=s.draft_start_pos + len(s.draft_catchup_ids) - w,
                        draft_catchup_ids=s.draft_catchup_ids[-w:]) if len(eagle3_catch_up(s)[0]) > w else s
                for s in batch.seqs]
        return StepBatch(seqs, batch.page_size)

    @torch.inference_mode()
    def catch_up_backlog(self, batch: StepBatch) -> None:
        """After the draft plan held drafting back, the head is more tokens behind than the program's catch-up
        rows. It catches up on all but the last `width` first, in one eager pass, so the step still runs as
        the program (on `without_backlog(batch)`) instead of the general search."""
        w = self.width
        behind = [replace(s, draft_catchup_ids=s.draft_catchup_ids[:-w]) for s in batch.seqs
                  if len(eagle3_catch_up(s)[0]) > w]
        if not behind:
            return
        if self.device.type == "cuda" and max(len(eagle3_catch_up(s)[0]) for s in behind) <= DECODE_ROWS_BACKLOG:
            self._extend_head(behind)
        else:
            self.drafter.catch_up(behind, batch.page_size)

    def _extend_head(self, seqs) -> torch.Tensor:
        """The head over each sequence's catch-up, every row attending like a decode row (as the program's rows do
        without SHARED_CONTEXT); returns its output rows (the drafting state after each), in order.
        Prefill attention took 40-1,100 ms per call on the H200 for a few rows (new shapes each time: the
        context grows every step), where this takes the decode kernel the graphs already built. Each row
        reads its whole context, so it is kept to short backlogs."""
        ids, positions, slots = [], [], []
        pages = max(len(s.page_ids) for s in seqs)
        tables = []
        for s in seqs:
            chunk, first = eagle3_catch_up(s)
            table = np.zeros(pages, np.int64)
            table[: len(s.page_ids)] = s.page_ids
            pos = np.arange(first, first + len(chunk))
            ids.extend(chunk)
            positions.append(pos)
            slots.append(page_slots(table, pos, self.page_size))
            tables.extend([table] * len(chunk))
        to_device = lambda a, dtype=torch.long: torch.from_numpy(np.asarray(a)).to(self.device, dtype)  # noqa: E731
        positions, slots = to_device(np.concatenate(positions)), to_device(np.concatenate(slots))
        meta = decode_rows_meta(positions, slots, to_device(np.stack(tables), torch.int32), self.page_size,
                                self.head.config.model.num_kv_heads)
        drafter = self.drafter
        return self.head(self.target.embed_tokens(to_device(ids)), drafter.taps[slots], positions, meta,
                         drafter.kv_cache)

    # -- one step ----------------------------------------------------------
    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> torch.Tensor:
        """Queues the step; returns its packed results [b, width + 1] (each row's tokens, then its accepted
        draft count: `unpack`), a device tensor that the next launch of the same shape overwrites. Rows of a
        batch with `follow` continue rows of the last launch (`_follow`)."""
        seqs = batch.seqs
        b = len(seqs)
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, b)]
        n = self.context_lens[bisect.bisect_left(self.context_lens, max(s.start_pos for s in seqs) + self.width)]
        rows, tables = self._describe(seqs, bs, self.tables[n].shape[1])
        rows["follow"] = np.full(bs, -1, np.int64)
        if batch.follow is not None:
            rows["follow"][:b] = batch.follow
        forced = None
        if self.simulate_accept_len is not None:
            # One draw per drafting sequence, in order, as the general path draws.
            drawn = [min(draw_num_accepted(self.simulate_accept_len, self.rng), s.num_draft_tokens)
                     if s.num_draft_tokens else 0 for s in seqs]
            rows["forced"] = np.array(drawn + [0] * (bs - b), np.int64)
            forced = self.forced[:bs]
        self._upload(rows, tables, bs, n)
        params = None
        if not all(s.params.greedy for s in seqs):  # eager: filtering branches on the settings (`_forward`)
            params = [s.params for s in seqs] + [GREEDY] * (bs - b)
            packed = self._step(bs, n, forced, params)
        elif (bs, n) in self.graphs:
            self.graphs[(bs, n)].replay()
            packed = self.outputs[(bs, n)]
        else:
            packed = self._step(bs, n, forced)
        self.num_runs += 1
        return packed[:b]

    def _step(self, bs: int, n: int, forced: torch.Tensor | None, params: list[SamplingParams] | None = None
              ) -> torch.Tensor:
        """The whole program: inputs of following rows, the forwards, and what a following step reads. `params`
        (one per row) where some row samples; None: every row is greedy."""
        self._follow(bs, n)
        return self._forward_packed(bs, n, self._metas(bs, n), forced, params)

    def _forward_packed(self, bs: int, n: int, metas: dict, forced: torch.Tensor | None,
                        params: list[SamplingParams] | None) -> torch.Tensor:
        """The forwards and acceptance, packed (`_packed`), also kept with each row's root for a following step."""
        packed = _packed(*self._forward(bs, n, metas, forced, params))
        self.last_packed[:bs] = packed
        self.last_root[:bs] = self._roots(bs)
        return packed

    def _follow(self, bs: int, n: int) -> None:
        """Rows that continue a row of the last launch (overlapped drafting steps: the host launched this step
        before reading that one back) take their inputs from its results, on the device. The head catches up on
        that step's root and accepted drafts (position j pairs token j + 1 with the taps of j: the tokens are
        that step's new ones); the new root is the one after them, and its token is that step's last.
        Rows with follow = -1 keep the inputs the host wrote. On a GPU one kernel writes the same
        (engine/triton_follow.py)."""
        if self.device.type == "cuda":
            from specserve.kernels.triton import follow as triton_follow

            if triton_follow.ENABLED:
                triton_follow.follow_rows(self, bs, self.tables[n][:bs])
                return
        w, ps = self.width, self.page_size
        src = self.follow[:bs].clamp(min=0)
        on = self.follow[:bs, None] >= 0
        last = self.last_packed[src]
        accepted = last[:, -1:]
        j = torch.arange(w, device=self.device)[None, :]
        caught = j <= accepted
        table = self.tables[n][:bs]
        pos = torch.where(caught, self.last_root[src][:, None] + j, 0)
        put_where(self.catch_ids[:bs], on, torch.where(caught, last[:, :w], 0))
        put_where(self.catch_pos[:bs], on, pos)
        put_where(self.catch_slots[:bs], on, torch.where(caught, table_slots(table, pos, ps), self.pad_slot))
        put_where(self.last_row[:bs], on[:, 0], torch.arange(bs, device=self.device) * w + accepted[:, 0])
        put_where(self.root_ids[:bs], on[:, 0], last[:, :w].gather(1, accepted)[:, 0])
        self._follow_root(bs, on, self.last_root[src] + accepted[:, 0] + 1, table)

    def _follow_root(self, bs: int, on: torch.Tensor, root: torch.Tensor, table: torch.Tensor) -> None:
        """Writes the inputs that follow from each following row's root position [bs]."""
        raise NotImplementedError

    def _roots(self, bs: int) -> torch.Tensor:
        """Each row's root position in this step, for a step that follows it."""
        raise NotImplementedError

    def _upload(self, rows: dict[str, np.ndarray], tables: np.ndarray, bs: int, n: int) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last step's upload; the step before that has been read back
        # Only the first bs rows are written: a graph of batch bucket bs reads no others.
        for name, view in self._host_views.items():
            if name in rows:
                (view[:, :bs] if self._batch_axis[name] == 1 else view[:bs])[...] = rows[name]
        host_tables = self._host_tables[n][:bs]
        host_tables.numpy()[...] = tables
        pinned = self._uploaded is not None
        self._flat.copy_(self._host_tensor, non_blocking=pinned)
        self.tables[n][:bs].copy_(host_tables, non_blocking=pinned)
        if pinned:
            self._uploaded.record()

    @torch.inference_mode()
    def _capture(self, progress: bool, desc: str) -> None:
        shapes = [(bs, n) for n in reversed(self.context_lens) for bs in reversed(self.batch_sizes)]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        forced = self.forced if self.simulate_accept_len is not None else None
        # Compile every kernel outside capture, and let the GEMV choice time the weights at each row bucket a
        # small batch gives them (extends take bs rows, catch-up and verification bs * width).
        warm = {(1, n) for n in self.context_lens} | {(self.max_bs, self.context_lens[-1])}
        warm |= {(bs, self.context_lens[0]) for bs in self.batch_sizes if bs <= 16}
        with torch.cuda.stream(stream):
            for bs, n in sorted(warm) * 2:
                self._step(bs, n, None if forced is None else forced[:bs])
        torch.cuda.current_stream(self.device).wait_stream(stream)
        pool = None
        for bs, n in tqdm(shapes, desc=desc, disable=not progress, leave=False):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[(bs, n)] = self._step(bs, n, None if forced is None else forced[:bs])
            pool = graph.pool()
            self.graphs[(bs, n)] = graph
        torch.cuda.synchronize(self.device)


class ChainGraphs(SpecGraphs):
    def __init__(self, target: torch.nn.Module, drafter, kv_cache: torch.Tensor, num_drafts: int, pad_slot: int,
                 max_bs: int, max_context: int, page_size: int, simulate_accept_len: float | None, rng,
                 capture: bool, progress: bool = True) -> None:
        self.k = num_drafts
        super().__init__(target, drafter, kv_cache, num_drafts + 1, pad_slot, max_bs, max_context, page_size,
                         simulate_accept_len, rng)
        if capture:
            self._capture(progress, "capturing speculative graphs")

    def _buffer_shapes(self) -> dict[str, tuple[tuple[int, ...], int]]:
        b, w, e = self.max_bs, self.width, max(self.k - 1, 1)
        # Level-major extend rows, so one level's rows are contiguous (kernels index them as flat arrays).
        return {"catch_ids": ((b, w), 0), "catch_pos": ((b, w), 0), "catch_slots": ((b, w), 0),
                "last_row": ((b,), 0), "extend_pos": ((e, b), 1), "extend_slots": ((e, b), 1),
                "root_ids": ((b,), 0), "verify_pos": ((b, w), 0), "verify_slots": ((b, w), 0), "limit": ((b,), 0),
                "forced": ((b,), 0)}

    def _allocate(self) -> None:
        super()._allocate()
        # What the attention of each forward reads besides positions and slots, written each step from them
        # (`_row_inputs`): context lengths, tails, and the page table once per row. Static, for capture.
        b, w = self.max_bs, self.width
        i32 = dict(dtype=torch.int32, device=self.device)
        self.row_lens = {name: torch.zeros(b * w, **i32) for name in ("catch", "verify")}
        self.row_tails = {name: torch.zeros(b * w, w, dtype=torch.long, device=self.device)
                          for name in ("catch", "verify")}
        self.tail_lens = torch.arange(1, w + 1, **i32).repeat(b)  # row j of a sequence sees rows 0..j
        self.extend_lens = torch.zeros(self.extend_pos.shape, **i32)
        self.row_tables = {n: torch.zeros(b * w, t.shape[1], **i32) for n, t in self.tables.items()}
        self.verify_ids = torch.zeros(b, w, dtype=torch.long, device=self.device)  # each root, then its drafts

    def fits(self, batch: StepBatch) -> bool:
        return self._rows_fit(batch, self.k)

    def _describe(self, seqs, bs: int, width: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        k, w, ps, pad = self.k, self.width, self.page_size, self.pad_slot
        rows, tables = self._describe_catch_up(seqs, bs, width)
        extend_pos = np.zeros((max(k - 1, 1), bs), np.int64)
        extend_slots = np.full((max(k - 1, 1), bs), pad, np.int64)
        root_ids = np.zeros(bs, np.int64)
        verify_pos = np.zeros((bs, w), np.int64)
        verify_slots = np.full((bs, w), pad, np.int64)
        limit = np.zeros(bs, np.int64)
        for row, s in enumerate(seqs):
            pages = tables[row].astype(np.int64)
            # Pages cover root + d for d scheduled drafts: rows past that write to the padding slot (their
            # outputs are never accepted).
            root, d = s.start_pos, s.num_draft_tokens
            limit[row] = d
            extend_pos[: k - 1, row] = np.arange(root, root + k - 1)
            extend_slots[: d, row] = page_slots(pages, extend_pos[: d, row], ps)
            root_ids[row] = s.token_ids[0]
            verify_pos[row] = np.arange(root, root + w)
            verify_slots[row, : d + 1] = page_slots(pages, verify_pos[row, : d + 1], ps)
        rows.update(extend_pos=extend_pos, extend_slots=extend_slots, root_ids=root_ids, verify_pos=verify_pos,
                    verify_slots=verify_slots, limit=limit)
        return rows, tables

    def _follow_root(self, bs: int, on: torch.Tensor, root: torch.Tensor, table: torch.Tensor) -> None:
        """As `_describe` writes them: drafts at root + i, verified rows at root + j, slots up to the limit."""
        k, ps, pad = self.k, self.page_size, self.pad_slot
        drafts = self.limit[:bs, None]
        if k > 1:
            i = torch.arange(k - 1, device=self.device)[None, :]
            pos = root[:, None] + i
            put_where(self.extend_pos[: k - 1, :bs], on.T, pos.T)
            slots = torch.where(i < drafts, table_slots(table, pos, ps), pad)
            put_where(self.extend_slots[: k - 1, :bs], on.T, slots.T)
        j = torch.arange(self.width, device=self.device)[None, :]
        pos = root[:, None] + j
        put_where(self.verify_pos[:bs], on, pos)
        put_where(self.verify_slots[:bs], on, torch.where(j <= drafts, table_slots(table, pos, ps), pad))

    def _roots(self, bs: int) -> torch.Tensor:
        return self.verify_pos[:bs, 0]

    # -- the program --------------------------------------------------------
    def _metas(self, bs: int, n: int) -> dict[str, AttentionMetadata | list]:
        """Attention metadata of the three forwards, from the uploaded buffers (static tensors, for capture); also
        puts each root in the verify's ids, before the drafts."""
        if self.device.type == "cuda":
            from specserve.kernels.triton import follow as triton_follow

            if triton_follow.ROWS_ENABLED:
                return self._row_inputs(bs, n)
        self.verify_ids[:bs, 0] = self.root_ids[:bs]
        table = self.tables[n][:bs]
        row_table = table.repeat_interleave(self.width, dim=0)
        head_kv, target_kv = self.head.config.model.num_kv_heads, self.target.config.num_kv_heads

        def meta(slots, positions, tables_, kv_heads):
            return decode_rows_meta(positions, slots, tables_, self.page_size, kv_heads, n)

        def rows(slots, positions, kv_heads):
            if SHARED_CONTEXT and table.is_cuda:
                return self._shared_context_meta(slots, positions, row_table, kv_heads, n)
            return meta(slots.view(-1), positions.view(-1), row_table, kv_heads)
        return {
            "catch": rows(self.catch_slots[:bs], self.catch_pos[:bs], head_kv),
            "extend": [meta(self.extend_slots[i, :bs], self.extend_pos[i, :bs], table, head_kv)
                       for i in range(self.k - 1)],
            "verify": rows(self.verify_slots[:bs], self.verify_pos[:bs], target_kv),
        }

    def _row_inputs(self, bs: int, n: int) -> dict[str, AttentionMetadata | list]:
        """`_metas` on a GPU: one kernel writes every length, tail and row table, and the roots into the verify's
        ids (engine/triton_follow.py)."""
        from specserve.kernels.triton import follow as triton_follow

        triton_follow.chain_rows(self, bs, n, SHARED_CONTEXT)
        rows = bs * self.width
        row_table, table = self.row_tables[n][:rows], self.tables[n][:bs]
        head_kv, target_kv = self.head.config.model.num_kv_heads, self.target.config.num_kv_heads

        def meta(name, slots, kv_heads):
            tails = dict(tail_slots=self.row_tails[name][:rows], tail_lens=self.tail_lens[:rows],
                         rows_per_seq=self.width) if SHARED_CONTEXT else {}
            return AttentionMetadata.for_decode_kernel(slots[:bs].view(-1), row_table, self.row_lens[name][:rows],
                                                       self.page_size, kv_heads, n, **tails)
        return {
            "catch": meta("catch", self.catch_slots, head_kv),
            "extend": [AttentionMetadata.for_decode_kernel(self.extend_slots[i, :bs], table, self.extend_lens[i, :bs],
                                                           self.page_size, head_kv, n) for i in range(self.k - 1)],
            "verify": meta("verify", self.verify_slots, target_kv),
        }

    def _shared_context_meta(self, slots: torch.Tensor, positions: torch.Tensor, row_table: torch.Tensor,
                             kv_heads: int, n: int) -> AttentionMetadata:
        """A sequence's `width` rows (slots and positions [bs, width], consecutive) as one run over the context
        before its first row, read once for all, each row then attending to the rows up to itself as its tail."""
        bs, w = slots.shape
        tail_lens = torch.arange(1, w + 1, dtype=torch.int32, device=slots.device).repeat(bs)
        return AttentionMetadata.for_decode_kernel(
            slots.reshape(-1), row_table, positions[:, :1].to(torch.int32).repeat_interleave(w, 0).view(-1),
            self.page_size, kv_heads, n, tail_slots=slots.repeat_interleave(w, 0), tail_lens=tail_lens,
            rows_per_seq=w)

    def _forward_packed(self, bs: int, n: int, metas: dict, forced: torch.Tensor | None,
                        params: list[SamplingParams] | None) -> torch.Tensor:
        if params is not None or self.device.type != "cuda":
            return super()._forward_packed(bs, n, metas, forced, params)
        from specserve.kernels.triton import accept as triton_accept

        if not triton_accept.ENABLED:
            return super()._forward_packed(bs, n, metas, forced, params)
        drafts = self._draft(bs, metas)
        best = argmax(self._verify_logits(bs, metas["verify"]))
        return triton_accept.accept_and_pack(drafts, best, forced, self.limit[:bs], self._roots(bs), self.last_packed,
                                             self.last_root)

    def _forward(self, bs: int, n: int, metas: dict, forced: torch.Tensor | None,
                 params: list[SamplingParams] | None = None):
        drafts = self._draft(bs, metas)
        logits = self._verify_logits(bs, metas["verify"])
        greedy = accept_chain(drafts, argmax(logits), forced, self.limit[:bs])
        if params is None:
            return greedy
        probs = filtered_probs(logits.view(bs * self.width, -1), [p for p in params for _ in range(self.width)])
        sampled = accept_chain_sampled(drafts, probs.view(bs, self.width, -1), forced, self.limit[:bs])
        is_greedy = tensor_on([p.greedy for p in params], self.device)
        return tuple(torch.where(is_greedy.view(-1, *[1] * (g.dim() - 1)), g, s) for g, s in zip(greedy, sampled))

    def _draft(self, bs: int, metas: dict) -> torch.Tensor:
        """The head catches up, then drafts k tokens greedily: [bs, k] target ids, a view of `verify_ids` (which
        the next step overwrites)."""
        head, drafter = self.head, self.drafter
        embedding = self.target.embed_tokens.weight  # the head looks its tokens up as it norms them
        catch_slots = self.catch_slots[:bs].view(-1)
        # Of the catch-up rows, only each sequence's last (its newest token) feeds the drafts.
        state = head(embedding, drafter.taps[catch_slots], self.catch_pos[:bs].view(-1), metas["catch"],
                     drafter.kv_cache, self.catch_ids[:bs].view(-1), rows=self.last_row[:bs])
        # Each draft goes straight into the verify's ids (in target ids), after the root `_metas` put there.
        drafts = self.verify_ids[:bs, 1:]
        token = argmax(head.compute_logits(state), head.d2t, out=drafts[:, 0])
        for i in range(self.k - 1):
            state = head(embedding, state, self.extend_pos[i, :bs], metas["extend"][i], drafter.kv_cache, token)
            token = argmax(head.compute_logits(state), head.d2t, out=drafts[:, i + 1])
        return drafts

    def _verify(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        """The target's argmax after root + each draft [bs, k + 1]; stores their KV and the head's taps."""
        return argmax(self._verify_logits(bs, meta))

    def _verify_logits(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        """The target's logits after root + each draft [bs, k + 1, V] (the ids `_metas` and `_draft` left in
        verify_ids); stores their KV and the head's taps."""
        hidden, captured = self.target(self.verify_ids[:bs].view(-1), self.verify_pos[:bs].view(-1), meta,
                                       self.kv_cache, self.drafter.capture_layers)
        self.drafter.observe(captured, meta.slot_mapping)
        return self.target.compute_logits(hidden).view(bs, self.width, -1)


def decode_rows_meta(positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, page_size: int,
                     kv_heads: int, max_context: int | None = None) -> AttentionMetadata:
    """Rows that each attend like a decode row: to positions [0, position] through their own page-table row,
    writing their KV to `slots` (padded rows name the padding slot). On a GPU the Triton decode kernel's form;
    elsewhere one single-token query per row, which the CPU's short-query kernel serves (the page-table form
    would gather every row's context apart, which made a 64-request chain step several times slower)."""
    if slots.is_cuda:
        return AttentionMetadata.for_decode_kernel(slots, tables, (positions + 1).to(torch.int32), page_size, kv_heads,
                                                   max_context or tables.shape[1] * page_size)
    meta = AttentionMetadata.build([1] * len(positions), positions.tolist(), tables.tolist(), page_size, slots.device)
    return replace(meta, slot_mapping=slots)


def _packed(tokens: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """[B, width + 1]: each row's tokens, then its accepted draft count, so one copy reads both back."""
    return torch.cat([tokens, accepted[:, None].to(tokens.dtype)], dim=1)


def unpack(packed: list[list[int]]) -> list[list[int]]:
    """Each row's new tokens: its accepted drafts, then the target's own token."""
    return [row[: row[-1] + 1] for row in packed]


def put_where(buffer: torch.Tensor, on: torch.Tensor, value: torch.Tensor) -> None:
    """buffer = value where `on`, in place (programs and their graphs read the buffer itself)."""
    buffer.copy_(torch.where(on, value, buffer))


def page_slots(pages: np.ndarray, positions: np.ndarray, page_size: int) -> np.ndarray:
    return pages[positions // page_size] * page_size + positions % page_size


def table_slots(table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """page_slots on the device: table [B, pages] int32, positions [B, R] -> slots [B, R]. Positions past the
    table take its last page: only rows whose results are discarded (padding, rows that do not follow) reach
    past it."""
    page = (positions // page_size).clamp(max=table.shape[1] - 1)
    return table.gather(1, page).long() * page_size + positions % page_size
