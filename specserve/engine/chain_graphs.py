"""EAGLE-3 chain speculation as one device program per step, captured in CUDA graphs on a GPU.

The general path (spec/proposer.py, spec/verify.py) searches trees in Python and reads results back after
every draft level; on a GPU those launches and syncs cost more than the drafts save. A chain of k drafts has
fixed shapes, so a whole step fits in one program, with one read-back at the end:

1. catch the head up on the tokens the last step accepted (at most k + 1 per sequence, padded to k + 1);
2. draft k tokens greedily, each fed back with the head's own state;
3. verify root + drafts with the target in one forward, storing the head's taps for all k + 1;
4. accept on the device: the longest prefix of drafts equal to the target's argmax, plus its next token.

Every row attends like a decode row (its own context length, its sequence's page table), so the paged decode
kernel serves all three forwards. The head's draft nodes take their KV at their own positions in the
mirrored pages, not in scratch slots: the next catch-up rewrites every position a later query can see.

Greedy requests only (simulated acceptance too, for speed studies); anything else takes the general path.
On a CPU the same program runs eagerly with the reference attention, which is how CI checks it.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import numpy as np
import torch
from tqdm import tqdm

from specserve.engine.cuda_graphs import batch_buckets, context_buckets
from specserve.engine.scheduler import StepBatch
from specserve.layers.attention import AttentionMetadata
from specserve.spec.drafters import eagle3_catch_up
from specserve.spec.simulate import draw_num_accepted


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


@dataclass(frozen=True)
class _Rows:
    """Host-side description of one step's rows, in the static buffers' layout."""

    catch_ids: np.ndarray  # [B, k + 1] head inputs of the catch-up, padded
    catch_pos: np.ndarray
    catch_slots: np.ndarray
    last_row: np.ndarray  # [B] flat index of each sequence's last catch-up row
    extend_pos: np.ndarray  # [k - 1, B], level-major
    extend_slots: np.ndarray
    root_ids: np.ndarray  # [B]
    verify_pos: np.ndarray  # [B, k + 1]
    verify_slots: np.ndarray
    tables: np.ndarray  # [B, pages]
    limit: np.ndarray  # [B] drafts each sequence was scheduled with (the program always drafts k)
    forced: np.ndarray | None = None  # [B] simulated accepted counts


class ChainGraphs:
    def __init__(self, target: torch.nn.Module, drafter, kv_cache: torch.Tensor, num_drafts: int, pad_slot: int,
                 max_bs: int, max_context: int, page_size: int, simulate_accept_len: float | None, rng,
                 capture: bool, progress: bool = True) -> None:
        self.target, self.drafter, self.kv_cache = target, drafter, kv_cache
        self.head = drafter.head
        self.k, self.width = num_drafts, num_drafts + 1
        self.pad_slot, self.page_size = pad_slot, page_size
        self.simulate_accept_len, self.rng = simulate_accept_len, rng
        self.device = kv_cache.device
        self.batch_sizes = batch_buckets(max_bs)
        self.context_lens = context_buckets(max_context, page_size)
        self.max_bs = self.batch_sizes[-1]
        self.num_runs = 0
        self._allocate()
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        if capture:
            self._capture(progress)

    def _allocate(self) -> None:
        """The per-step inputs are views of one device buffer, so a step uploads them in one copy."""
        b, w, e = self.max_bs, self.width, max(self.k - 1, 1)
        shapes = {"catch_ids": (b, w), "catch_pos": (b, w), "catch_slots": (b, w), "last_row": (b,),
                  # Level-major, so one level's rows are contiguous (kernels index them as flat arrays).
                  "extend_pos": (e, b), "extend_slots": (e, b), "root_ids": (b,), "verify_pos": (b, w),
                  "verify_slots": (b, w), "limit": (b,), "forced": (b,)}
        total = sum(int(np.prod(shape)) for shape in shapes.values())
        self._flat = torch.zeros(total, dtype=torch.long, device=self.device)
        self._host = np.zeros(total, np.int64)
        self._host_views, offset = {}, 0
        for name, shape in shapes.items():
            size = int(np.prod(shape))
            setattr(self, name, self._flat[offset:offset + size].view(shape))
            self._host_views[name] = self._host[offset:offset + size].reshape(shape)
            offset += size
        self.tables = {n: torch.zeros(b, -(-n // self.page_size), dtype=torch.int32, device=self.device)
                       for n in self.context_lens}

    # -- which steps qualify ---------------------------------------------
    def fits(self, batch: StepBatch) -> bool:
        seqs = batch.seqs
        if not seqs or len(seqs) > self.max_bs:
            return False
        # Sequences with no drafts this step (their last token, say) ride along: nothing of theirs is accepted
        # but the target's own token, and their head catch-up waits for a step that drafts.
        if not any(s.num_draft_tokens for s in seqs):
            return False  # a plain step: the decode graphs take it
        for s in seqs:
            if not (s.sample and len(s.token_ids) == 1 and 0 <= s.num_draft_tokens <= self.k):
                return False
            if not s.params.greedy:  # the program's bonus token is the target's argmax
                return False
            catch_up = len(eagle3_catch_up(s)[0])
            if catch_up > self.width or (s.num_draft_tokens and not catch_up):
                return False
        return max(s.start_pos for s in seqs) + self.width <= self.context_lens[-1]

    # -- one step ----------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: StepBatch) -> list[list[int]]:
        seqs = batch.seqs
        b = len(seqs)
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, b)]
        n = self.context_lens[bisect.bisect_left(self.context_lens, max(s.start_pos for s in seqs) + self.width)]
        rows = self._describe(seqs, bs, self.tables[n].shape[1])
        forced = None
        if self.simulate_accept_len is not None:
            # One draw per drafting sequence, in order, as the tree path draws.
            drawn = [min(draw_num_accepted(self.simulate_accept_len, self.rng), s.num_draft_tokens)
                     if s.num_draft_tokens else 0 for s in seqs]
            rows = replace(rows, forced=np.array(drawn + [0] * (bs - b), np.int64))
            forced = self.forced[:bs]
        self._upload(rows, bs, n)
        if (bs, n) in self.graphs:
            self.graphs[(bs, n)].replay()
            tokens, accepted = self.outputs[(bs, n)]
        else:
            tokens, accepted = self._forward(bs, n, self._metas(bs, n, rows), forced)
        self.num_runs += 1
        tokens, accepted = tokens[:b].tolist(), accepted[:b].tolist()  # the step's one read-back
        return [t[: a + 1] for t, a in zip(tokens, accepted)]

    def _describe(self, seqs, bs: int, width: int) -> _Rows:
        k, w, ps, pad = self.k, self.width, self.page_size, self.pad_slot
        catch_ids = np.zeros((bs, w), np.int64)
        catch_pos = np.zeros((bs, w), np.int64)
        catch_slots = np.full((bs, w), pad, np.int64)
        last_row = np.arange(bs, dtype=np.int64) * w
        extend_pos = np.zeros((max(k - 1, 1), bs), np.int64)
        extend_slots = np.full((max(k - 1, 1), bs), pad, np.int64)
        root_ids = np.zeros(bs, np.int64)
        verify_pos = np.zeros((bs, w), np.int64)
        verify_slots = np.full((bs, w), pad, np.int64)
        tables = np.zeros((bs, width), np.int32)
        limit = np.zeros(bs, np.int64)
        for row, s in enumerate(seqs):
            pages = np.asarray(s.page_ids[:width], dtype=np.int64)
            tables[row, : len(pages)] = pages
            slot = lambda pos: pages[pos // ps] * ps + pos % ps  # noqa: E731
            ids, first = eagle3_catch_up(s)
            pos = np.arange(first, first + len(ids))
            catch_ids[row, : len(ids)], catch_pos[row, : len(ids)] = ids, pos
            catch_slots[row, : len(ids)] = slot(pos)
            last_row[row] = row * w + max(len(ids) - 1, 0)
            # Pages cover root + d for d scheduled drafts: rows past that write to the padding slot (their
            # outputs are never accepted).
            root, d = s.start_pos, s.num_draft_tokens
            limit[row] = d
            extend_pos[: k - 1, row] = np.arange(root, root + k - 1)
            extend_slots[: d, row] = slot(extend_pos[: d, row])
            root_ids[row] = s.token_ids[0]
            verify_pos[row] = np.arange(root, root + w)
            verify_slots[row, : d + 1] = slot(verify_pos[row, : d + 1])
        return _Rows(catch_ids, catch_pos, catch_slots, last_row, extend_pos, extend_slots, root_ids, verify_pos,
                     verify_slots, tables, limit)

    def _upload(self, rows: _Rows, bs: int, n: int) -> None:
        # Only the first bs rows are written: a graph of batch bucket bs reads no others.
        host = self._host
        for name, view in self._host_views.items():
            value = getattr(rows, name)
            if value is not None:
                (view[:, :bs] if name.startswith("extend") else view[:bs])[...] = value
        pinned = self.device.type == "cuda"
        for source, target in ((torch.from_numpy(host), self._flat),
                               (torch.from_numpy(rows.tables), self.tables[n][:bs])):
            target.copy_(source.pin_memory() if pinned else source, non_blocking=pinned)

    # -- the program --------------------------------------------------------
    def _metas(self, bs: int, n: int, rows: _Rows | None) -> dict[str, AttentionMetadata | list]:
        """Attention metadata of the three forwards: the Triton decode kernel's (static tensors, for capture)
        on a GPU, the reference path's (built from the host rows) elsewhere."""
        if self.device.type == "cuda":
            from specserve.layers.triton_attention import num_splits

            table = self.tables[n][:bs]
            row_table = table.repeat_interleave(self.width, dim=0)
            head_kv, target_kv = self.head.config.model.num_kv_heads, self.target.config.num_kv_heads

            def decode_meta(slots, positions, tables, kv_heads):
                return AttentionMetadata(slot_mapping=slots, block_tables=tables,
                                         seq_lens=(positions + 1).to(torch.int32), page_size=self.page_size,
                                         num_splits=num_splits(slots.numel(), kv_heads, n))
            return {
                "catch": decode_meta(self.catch_slots[:bs].view(-1), self.catch_pos[:bs].view(-1), row_table,
                                     head_kv),
                "extend": [decode_meta(self.extend_slots[i, :bs], self.extend_pos[i, :bs], table, head_kv)
                           for i in range(self.k - 1)],
                "verify": decode_meta(self.verify_slots[:bs].view(-1), self.verify_pos[:bs].view(-1), row_table,
                                      target_kv),
            }
        tables = [list(t) for t in rows.tables]
        row_tables = [t for t in tables for _ in range(self.width)]

        def reference_meta(positions, tables_):
            # Each row alone: one query at its position, attending to its sequence's slots up to there.
            positions = [int(p) for p in positions]
            return AttentionMetadata.build([1] * len(positions), positions, tables_, self.page_size, self.device)
        meta = {"catch": reference_meta(rows.catch_pos.reshape(-1), row_tables),
                "extend": [reference_meta(rows.extend_pos[i], tables) for i in range(self.k - 1)],
                "verify": reference_meta(rows.verify_pos.reshape(-1), row_tables)}
        # Padded rows write their KV to the padding slot, whatever position they claim.
        return {"catch": _with_slots(meta["catch"], self.catch_slots[:bs].view(-1)),
                "extend": [_with_slots(m, self.extend_slots[i, :bs]) for i, m in enumerate(meta["extend"])],
                "verify": _with_slots(meta["verify"], self.verify_slots[:bs].view(-1))}

    def _forward(self, bs: int, n: int, metas: dict, forced: torch.Tensor | None):
        head, target, drafter = self.head, self.target, self.drafter
        embed = target.embed_tokens
        catch_slots = self.catch_slots[:bs].view(-1)
        out = head(embed(self.catch_ids[:bs].view(-1)), drafter.taps[catch_slots], self.catch_pos[:bs].view(-1),
                   metas["catch"], drafter.kv_cache)
        state = out[self.last_row[:bs]]
        token = head.to_target_ids(head.compute_logits(state).argmax(dim=-1))
        drafts = [token]
        for i in range(self.k - 1):
            state = head(embed(token), state, self.extend_pos[i, :bs], metas["extend"][i], drafter.kv_cache)
            token = head.to_target_ids(head.compute_logits(state).argmax(dim=-1))
            drafts.append(token)
        drafts = torch.stack(drafts, dim=1)
        verify_ids = torch.cat([self.root_ids[:bs, None], drafts], dim=1).view(-1)
        meta = metas["verify"]
        hidden, captured = target(verify_ids, self.verify_pos[:bs].view(-1), meta, self.kv_cache,
                                  drafter.capture_layers)
        drafter.observe(captured, meta.slot_mapping)
        best = target.compute_logits(hidden).argmax(dim=-1).view(bs, self.width)
        return accept_chain(drafts, best, forced, self.limit[:bs])

    @torch.inference_mode()
    def _capture(self, progress: bool) -> None:
        shapes = [(bs, n) for n in reversed(self.context_lens) for bs in reversed(self.batch_sizes)]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        forced = self.forced if self.simulate_accept_len is not None else None
        with torch.cuda.stream(stream):  # compile every kernel outside capture
            for bs, n in sorted({(1, n) for n in self.context_lens} | {(self.max_bs, self.context_lens[-1])}) * 2:
                self._forward(bs, n, self._metas(bs, n, None), None if forced is None else forced[:bs])
        torch.cuda.current_stream(self.device).wait_stream(stream)
        pool = None
        for bs, n in tqdm(shapes, desc="capturing speculative graphs", disable=not progress, leave=False):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[(bs, n)] = self._forward(bs, n, self._metas(bs, n, None),
                                                      None if forced is None else forced[:bs])
            pool = graph.pool()
            self.graphs[(bs, n)] = graph
        torch.cuda.synchronize(self.device)


def _with_slots(meta: AttentionMetadata, slots: torch.Tensor) -> AttentionMetadata:
    return replace(meta, slot_mapping=slots)
