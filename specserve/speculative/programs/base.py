"""What the chain and tree step programs share (speculative/programs/chain.py, tree.py).

A program runs one whole speculative step of an EAGLE-3 head (catch up, draft, verify, accept) on the device with
fixed shapes, so it can be captured in CUDA graphs per (batch bucket, context bucket) and read back once. Its
per-step inputs live in one device buffer (one upload); rows of a step launched before the last one was read back
(overlap) derive their inputs from it on the device (`_follow`).
"""
from __future__ import annotations

import abc
import bisect
import functools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from tqdm import tqdm

from specserve import envs
from specserve.core import SamplingParams, StepBatch
from specserve.graph_shapes import batch_buckets, context_buckets
from specserve.layers.attention import AttentionMetadata
from specserve.sampling.grammar_mask import allowed_drafts, allowed_tokens
from specserve.speculative.drafters.base import eagle3_catch_up
from specserve.speculative.simulate import draw_num_accepted
from specserve.structured.step_masks import QueuedWork, run_jobs


log = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)  # the settings of a padding row
# The head's logit for a draft its row's grammar forbids (`_grammar_level`).
FORBIDDEN_DRAFT = -1e4

# Backlogs up to this many rows a sequence catch up as decode rows on a GPU; longer ones (the head left behind
# for a long shut spell) as a prefill chunk, which reads each context once instead of once per row.
DECODE_ROWS_BACKLOG = 64


@dataclass(frozen=True)
class ProgramSetup:
    """What every program is built with besides its networks and its draft shape."""

    pad_slot: int  # a target KV slot no request owns: padded rows write there
    max_bs: int  # the largest batch captured
    max_context: int  # the longest context captured
    page_size: int
    simulate_accept_len: float | None = None  # speed studies: drawn acceptance (speculative/simulate.py)
    rng: random.Random | None = None  # its draws, shared with the general path's
    capture: bool = False  # capture CUDA graphs (on a GPU); else every step runs eagerly
    progress: bool = True


class SpecGraphs(abc.ABC):
    """What chain and tree programs share: per-step inputs in one device buffer (one upload), graphs captured
    per (batch bucket, context bucket), a launch that replays (or, on a CPU or with sampled rows, runs) the
    program and leaves each sequence's new tokens packed for one read-back, and rows that follow the last
    launch (`_follow`). Subclasses define the buffers, the rows and the program."""

    def __init__(self, target: torch.nn.Module, drafter, kv_cache: torch.Tensor, width: int,
                 setup: ProgramSetup) -> None:
        self.target, self.drafter, self.kv_cache = target, drafter, kv_cache
        self.head = drafter.head
        self.width = width  # catch-up rows per sequence; also the positions a step may add past its root
        self.pad_slot, self.page_size = setup.pad_slot, setup.page_size
        self.simulate_accept_len, self.rng = setup.simulate_accept_len, setup.rng
        self.device = kv_cache.device
        self.batch_sizes = batch_buckets(setup.max_bs)
        self.context_lens = context_buckets(setup.max_context, setup.page_size)
        self.max_bs = self.batch_sizes[-1]
        self.num_runs = 0
        self._allocate()
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # per graph: its packed tokens and counts
        self.graph_pool = None  # the memory pool the graphs share (a later capture joins it)
        # Grammar masks of the verify rows (`_constrained_step`), allocated at the first such step, and per
        # shape its parts as graph replays: (the draft parts, the verify forward, the masked acceptance).
        self.grammar_masks: torch.Tensor | None = None
        self._host_level: torch.Tensor | None = None
        self._draft_to_target: torch.Tensor | None = None  # every draft id's target id
        self.masked_graphs: dict[tuple[int, int], tuple] = {}
        self.num_masked_runs = 0  # steps that held rows under a grammar
        self.masks_ready_first = False  # the last such step's verify masks, before its verify forward ended

    @abc.abstractmethod
    def _buffer_shapes(self) -> dict[str, tuple[tuple[int, ...], int]]:
        """Per-step input name -> (shape at the largest batch, which axis is the batch)."""

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

    def fits(self, batch: StepBatch) -> bool:
        """Whether the program takes the batch: as it is, or once the head has caught up on a backlog longer
        than the program's catch-up rows (`launch` does that first)."""
        if self._rows_fit(batch, self.max_drafts):
            return True
        drafting = any(s.num_draft_tokens for s in batch.seqs)
        return drafting and batch.follow is None and self._rows_fit(self.without_backlog(batch), self.max_drafts)

    def _behind(self, batch: StepBatch) -> bool:
        """Whether some head catch-up is longer than the program's rows."""
        return any(len(eagle3_catch_up(s)[0]) > self.width for s in batch.seqs)

    def _rows_fit(self, batch: StepBatch, max_drafts: int) -> bool:
        """Decoding rows, greedy or sampled without a seed and without penalties, bias or log-probabilities (the
        general path adjusts and reads logit rows on the host), at most `max_drafts` each, at least one row drafting
        (else a plain step: the decode graphs take it), and every head catch-up within the program's rows."""
        seqs = batch.seqs
        if not seqs or len(seqs) > self.max_bs or not any(s.num_draft_tokens for s in seqs):
            return False
        for s in seqs:
            if not (s.sample and len(s.token_ids) == 1 and 0 <= s.num_draft_tokens <= max_drafts):
                return False
            if not (s.params.greedy or s.params.seed is None) or not self._finishes_on_device(s):
                return False
            # Rows with no drafts this step (a request's last token, say) ride along: nothing of theirs is
            # accepted but the target's own token, and their head catch-up waits for a step that drafts.
            catch_up = len(eagle3_catch_up(s)[0])
            if catch_up > self.width or (s.num_draft_tokens and not catch_up):
                return False
        return max(s.start_pos for s in seqs) + self.width <= self.context_lens[-1]

    def _finishes_on_device(self, seq) -> bool:
        """Whether the program can take the row's logits: no penalties, bias or log-probabilities (the general
        path adjusts and reads them on the host); under a grammar (`_constrained_step`), with the target's
        acceptance (a drawn one would accept what the grammar forbids), without a forced span (the
        general path verifies those)."""
        params = seq.params
        if params.adjusts_logits or params.logprobs is not None:
            return False
        if seq.grammar is None:
            return True
        return envs.get().program_masks and self.simulate_accept_len is None and not seq.forced_token_ids

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
        Prefill attention builds a plan per new shape, and the shapes are new each time (the context grows
        every step), so a few rows cost far more host time than they need; this takes the decode kernel the
        graphs already built. Each row
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
    def launch(self, batch: StepBatch, timer) -> torch.Tensor:
        """A batch that `fits`: catches the head up on any backlog first, then queues the step (the timer's
        `catch_up` and `forward` phases)."""
        if batch.follow is None and self._behind(batch):
            with timer.phase("catch_up"):
                self.catch_up_backlog(batch)
            batch = self.without_backlog(batch)
        with timer.phase("forward"):
            return self._launch(batch)

    def _launch(self, batch: StepBatch) -> torch.Tensor:
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
        if any(s.grammar is not None for s in seqs):
            assert batch.follow is None, "a grammar needs the tokens of the step in flight"
            packed = self._constrained_step(seqs, bs, n, params)
        elif params is not None:
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
        """The forwards and acceptance, packed (`pack_tokens`), also kept with each row's root for a following step."""
        drafts = self._drafts(bs, n, metas)
        return self._accept_packed(bs, drafts, self._target_logits(bs, n, drafts, metas), forced, params)

    @abc.abstractmethod
    def _drafts(self, bs: int, n: int, metas: dict):
        """The head catches up and drafts: what the verify forward takes (a chain's tokens, a tree's nodes)."""

    @abc.abstractmethod
    def _target_logits(self, bs: int, n: int, drafts, metas: dict) -> torch.Tensor:
        """The target's logits after the root and each draft [bs, rows, V]; stores their KV and the head's taps."""

    @abc.abstractmethod
    def _accept_packed(self, bs: int, drafts, logits: torch.Tensor, forced: torch.Tensor | None,
                       params: list[SamplingParams] | None) -> torch.Tensor:
        """Acceptance against the verify logits, packed and kept for a following step (`_keep_packed`)."""

    def _keep_packed(self, bs: int, packed: torch.Tensor) -> torch.Tensor:
        self.last_packed[:bs] = packed
        self.last_root[:bs] = self._roots(bs)
        return packed

    def _follow(self, bs: int, n: int) -> None:
        """Rows that continue a row of the last launch (overlapped drafting steps: the host launched this step
        before reading that one back) take their inputs from its results, on the device. The head catches up on
        that step's root and accepted drafts (position j pairs token j + 1 with the taps of j: the tokens are
        that step's new ones); the new root is the one after them, and its token is that step's last.
        Rows with follow = -1 keep the inputs the host wrote. On a GPU one kernel writes the same
        (kernels/triton/follow.py)."""
        if self.device.type == "cuda" and envs.get().fused_follow:
            from specserve.kernels.triton import follow as triton_follow

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

    @abc.abstractmethod
    def _follow_root(self, bs: int, on: torch.Tensor, root: torch.Tensor, table: torch.Tensor) -> None:
        """Writes the inputs that follow from each following row's root position [bs]."""

    @abc.abstractmethod
    def _roots(self, bs: int) -> torch.Tensor:
        """Each row's root position in this step, for a step that follows it."""

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

    # -- rows under a grammar ----------------------------------------------------------------------
    mask_rows: int  # verify rows per sequence: a grammar mask each

    def _constrained_step(self, seqs, bs: int, n: int, params: list[SamplingParams] | None) -> torch.Tensor:
        """A step with rows under a grammar, in parts (`_masked_parts`). The draft parts, each followed by a
        read-back of the drafts so far and the host filling the next draft level's masks for them
        (`_fill_level`), so that each draft level keeps to the grammar. Then the verify forward, queued, while
        the host fills every verify row's mask (`_fill_masks`); then the masked acceptance, so that a draft the
        grammar forbids is never accepted and the bonus token is the masked argmax or a draw from the masked
        distribution. On a GPU a greedy batch replays each part's graph, captured at the shape's first such
        step; other batches run them eagerly. `_launch` uploaded the inputs; no row follows a launch (a grammar
        needs the tokens in flight)."""
        if self.grammar_masks is None:
            self._allocate_masks(next(s.grammar.num_words for s in seqs if s.grammar is not None))
        self._fill_level(seqs, bs, 0, [[] for _ in seqs])  # each root's row, for the first draft level
        captured = self._masked_graphs(bs, n) if params is None else None
        parts, forward, accept = captured if captured is not None else self._masked_parts(bs, n, params)
        for level, part in enumerate(parts, start=1):
            drafts = self._drafts_on_host(part(), len(seqs))
            if level < len(parts):
                self._fill_level(seqs, bs, level, drafts)
        forward()
        verify_forward = QueuedWork(self.device)
        self._fill_masks(seqs, bs, drafts)
        self.masks_ready_first = not verify_forward.done()
        self.num_masked_runs += 1
        return accept()

    @abc.abstractmethod
    def _masked_parts(self, bs: int, n: int, params: list[SamplingParams] | None = None
                      ) -> tuple[list[Callable[[], object]], Callable[[], object], Callable[[], torch.Tensor]]:
        """A constrained step's device work: the draft parts (each returns the drafts so far, for
        `_drafts_on_host`; a part's masked draft level reads the masks the host filled before it), then the
        verification's two (`_verify_parts`)."""

    def _verify_parts(self, bs: int, n: int, step: dict, params: list[SamplingParams] | None
                      ) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
        """The verify forward over `step`'s drafts, then acceptance against its logits with every verify row's
        grammar mask applied (returns the packed tokens). `step` holds the drafts and the metas by the time
        they run."""
        def forward() -> torch.Tensor:
            step["logits"] = self._target_logits(bs, n, step["drafts"], step["metas"])  # masked in place later
            return step["logits"]

        def accept() -> torch.Tensor:
            logits = step["logits"]
            forbidden = allowed_tokens(self.grammar_masks[: bs * self.mask_rows], logits.shape[-1], forbidden=True)
            logits.masked_fill_(forbidden.view(logits.shape), float("-inf"))
            return self._accept_packed(bs, step["drafts"], logits, None, params)
        return forward, accept

    def _allocate_masks(self, words: int) -> None:
        """One size for every grammar of an engine (the model's vocabulary)."""
        shape = (self.max_bs * self.mask_rows, words)
        self.grammar_masks = torch.full(shape, -1, dtype=torch.int32, device=self.device)
        self._host_level = torch.empty(self.max_bs, words, dtype=torch.int32,
                                       pin_memory=self.device.type == "cuda")
        self._draft_to_target = self.head.to_target_ids(torch.arange(len(self.head.d2t), device=self.device))

    def _grammar_level(self, bs: int, logits: torch.Tensor, row: int = 0) -> torch.Tensor:
        """The head's logits [bs, draft vocabulary] for one draft level, with the tokens each sequence's grammar
        forbids there pushed far down: its verify row `row`'s mask (the grammar after the root and the drafts
        before the level), read through the draft-to-target map. A large finite penalty rather than -inf keeps
        a tree's cumulative scores finite where a row allows fewer than top-k tokens."""
        return self._forbid_drafts(logits, self.grammar_masks[row: bs * self.mask_rows: self.mask_rows])

    def _forbid_drafts(self, logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """The head's logits [rows, draft vocabulary] with the tokens each row's mask [rows, words] forbids
        pushed down to FORBIDDEN_DRAFT, read through the draft-to-target map."""
        return logits.masked_fill(~allowed_drafts(masks, self._draft_to_target), FORBIDDEN_DRAFT)

    @abc.abstractmethod
    def _drafts_on_host(self, drafts, b: int) -> list:
        """The first b sequences' drafts as Python values, one per sequence (a sync)."""

    @abc.abstractmethod
    def _fill_masks(self, seqs, bs: int, drafts: list) -> None:
        """After the last draft part: every verify row's mask of each constrained sequence (`drafts`: its drafts
        as `_drafts_on_host` reads them), every other row allowing everything."""

    def _fill_level(self, seqs, bs: int, row: int, drafts: list) -> None:
        """Verify row `row` of every sequence alone (the mask of draft level `row`: the grammar after the root
        and the first `row` drafts), for a draft part; a sequence without a grammar, or with fewer than `row`
        drafts scheduled (the row never decides), allows everything."""
        jobs = {i: functools.partial(seq.grammar.path_masks, [drafts[i][:row]]) for i, seq in enumerate(seqs)
                if seq.grammar is not None and row <= seq.num_draft_tokens}
        self._fill_rows(self._host_level[:bs], self.grammar_masks[row: bs * self.mask_rows: self.mask_rows], 1, jobs)

    @staticmethod
    def _fill_rows(host: torch.Tensor, device_rows: torch.Tensor, per_seq: int,
                   jobs: dict[int, Callable[[], torch.Tensor]]) -> None:
        """Sequence i's `per_seq` mask rows of `host` from jobs[i] (built on host threads, `run_jobs`), every row
        of a sequence without a job allowing everything; then copied to `device_rows` behind the device's work.
        `host` (pinned on a GPU) is rewritten only once the drafts before it are read back, so the last copy
        from it is done."""
        host.fill_(-1)
        for i, masks in zip(jobs, run_jobs(list(jobs.values()))):
            host[i * per_seq: (i + 1) * per_seq] = masks
        device_rows.copy_(host, non_blocking=True)

    def _masked_graphs(self, bs: int, n: int) -> tuple | None:
        """`_masked_parts` at this shape as graph replays, captured now if this is its first constrained step;
        None where the program runs eagerly (a CPU, or graphs off)."""
        if not self.graphs:
            return None
        if (bs, n) not in self.masked_graphs:
            try:
                self.masked_graphs[(bs, n)] = self._capture_masked(bs, n)
            except Exception:  # the step runs eagerly, as every later one of this shape
                log.exception("capturing the constrained step's graphs at batch %d, context %d failed", bs, n)
                self.masked_graphs[(bs, n)] = None
        return self.masked_graphs[(bs, n)]

    def _capture_masked(self, bs: int, n: int) -> tuple:
        """Runs every part once on a side stream (writing only what the step's replay writes again: the
        buffers hold its inputs), then captures each into the program graphs' pool."""
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            parts, forward, accept = self._masked_parts(bs, n)
            for run in [*parts, forward, accept]:
                run()
        current.wait_stream(stream)
        parts, forward, accept = self._masked_parts(bs, n)
        replays = []
        for run in [*parts, forward, accept]:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                out = run()
            replays.append(functools.partial(_replay, graph, out))
        return replays[:-2], replays[-2], replays[-1]

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
            pool = self.graph_pool = graph.pool()
            self.graphs[(bs, n)] = graph
        torch.cuda.synchronize(self.device)


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


def pack_tokens(tokens: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
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


def _replay(graph: torch.cuda.CUDAGraph, out):
    graph.replay()
    return out
