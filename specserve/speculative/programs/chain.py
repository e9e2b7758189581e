"""EAGLE-3 chain speculation as one device program per step, captured in CUDA graphs on a GPU.

The general path (speculative/search.py, speculative/verify.py) searches trees in Python and reads results back after
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
step's rows up to itself as its tail (unless SPECSERVE_CHAIN_SHARED_CONTEXT=0); otherwise, and the draft
levels, each row like a decode row, up to and including itself. The head's draft nodes take their KV at their
own positions in the mirrored pages, not in scratch slots: the next catch-up rewrites every position a later
query can see.

Greedy requests, and sampled requests without a seed (a seeded request draws from its own generator in the
general path, so that its output does not depend on what shares its batches). Requests under a grammar too
(`_constrained_step`): step 2 runs one level at a time, each draft read back so that the host fills the next
level's mask, and step 3's logits are masked before acceptance; on a GPU each part replays a graph of its
own. Steps with sampled rows run the program eagerly, not from a graph: their filtering branches on the
requests' settings on the host, which costs no sync. On a CPU the same program runs eagerly with the
reference attention, which is how CI checks it.
"""
from __future__ import annotations

import numpy as np
import torch

from specserve import envs
from specserve.core import SamplingParams
from specserve.layers.attention import AttentionMetadata
from specserve.sampling.sampler import argmax, filtered_probs
from specserve.speculative.accept import accept_chain, accept_chain_sampled
from specserve.speculative.programs.base import (
    ProgramSetup,
    SpecGraphs,
    pack_tokens,
    decode_rows_meta,
    page_slots,
    put_where,
    table_slots,
)
from specserve.transfer import tensor_on


class ChainGraphs(SpecGraphs):
    def __init__(self, target: torch.nn.Module, drafter, kv_cache: torch.Tensor, num_drafts: int,
                 setup: ProgramSetup) -> None:
        self.k = self.max_drafts = num_drafts
        self.mask_rows = num_drafts + 1  # the root, then each draft
        super().__init__(target, drafter, kv_cache, num_drafts + 1, setup)
        if setup.capture:
            self._capture(setup.progress, "capturing speculative graphs")

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
            return self._row_inputs(bs, n)
        self.verify_ids[:bs, 0] = self.root_ids[:bs]
        table = self.tables[n][:bs]
        row_table = table.repeat_interleave(self.width, dim=0)
        head_kv, target_kv = self.head.config.model.num_kv_heads, self.target.config.kv_entry_shape[1]

        def meta(slots, positions, tables_, kv_heads):
            return decode_rows_meta(positions, slots, tables_, self.page_size, kv_heads, n)

        def rows(slots, positions, kv_heads):
            return meta(slots.view(-1), positions.view(-1), row_table, kv_heads)
        return {
            "catch": rows(self.catch_slots[:bs], self.catch_pos[:bs], head_kv),
            "extend": [meta(self.extend_slots[i, :bs], self.extend_pos[i, :bs], table, head_kv)
                       for i in range(self.k - 1)],
            "verify": rows(self.verify_slots[:bs], self.verify_pos[:bs], target_kv),
        }

    def _row_inputs(self, bs: int, n: int) -> dict[str, AttentionMetadata | list]:
        """`_metas` on a GPU: one kernel writes every length, tail and row table, and the roots into the verify's
        ids (kernels/triton/follow.py). A sequence's catch-up rows and verified rows attend as one run over the
        context before the step (read once for all of them), each row then seeing the step's rows up to itself as
        its tail, as a tree's verified nodes do (SPECSERVE_CHAIN_SHARED_CONTEXT)."""
        from specserve.kernels.triton import follow as triton_follow

        shared = envs.get().chain_shared_context
        triton_follow.chain_rows(self, bs, n, shared)
        rows = bs * self.width
        row_table, table = self.row_tables[n][:rows], self.tables[n][:bs]
        head_kv, target_kv = self.head.config.model.num_kv_heads, self.target.config.kv_entry_shape[1]

        def meta(name, slots, kv_heads):
            tails = dict(tail_slots=self.row_tails[name][:rows], tail_lens=self.tail_lens[:rows],
                         rows_per_seq=self.width) if shared else {}
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

    def _drafts(self, bs: int, n: int, metas: dict) -> torch.Tensor:
        return self._draft(bs, metas)

    def _target_logits(self, bs: int, n: int, drafts: torch.Tensor, metas: dict) -> torch.Tensor:
        return self._verify_logits(bs, metas["verify"])

    def _accept_packed(self, bs: int, drafts: torch.Tensor, logits: torch.Tensor, forced: torch.Tensor | None,
                       params: list[SamplingParams] | None) -> torch.Tensor:
        """Acceptance of each root's drafts against the verify logits, packed and kept for a following step."""
        if params is not None or self.device.type != "cuda":
            return self._keep_packed(bs, pack_tokens(*self._accept(bs, drafts, logits, forced, params)))
        from specserve.kernels.triton import accept as triton_accept

        return triton_accept.accept_and_pack(drafts, argmax(logits), forced, self.limit[:bs], self._roots(bs),
                                             self.last_packed, self.last_root)

    # -- rows under a grammar (`_constrained_step`) ---------------------------------------------------
    def _masked_parts(self, bs: int, n: int, params: list[SamplingParams] | None = None):
        """One part per draft level, each within its rows' grammars (the masks after the drafts so far), then
        the verification's two."""
        step = {"drafts": self.verify_ids[:bs, 1:]}

        def level(i: int):
            def run() -> torch.Tensor:
                if i == 0:
                    step["metas"] = self._metas(bs, n)
                step["state"] = self._draft_level(bs, step["metas"], i, step.get("state"), masked=True)
                return self.verify_ids[:bs, 1: i + 2]
            return run
        return [level(i) for i in range(self.k)], *self._verify_parts(bs, n, step, params)

    def _drafts_on_host(self, drafts: torch.Tensor, b: int) -> list[list[int]]:
        return drafts[:b].tolist()

    def _fill_masks(self, seqs, bs: int, drafts: list[list[int]]) -> None:
        """Verify row j (j < k), the grammar after the first j drafts, is draft level j's mask, filled before
        that level (`_fill_level`); only row k, after every draft, is left."""
        self._fill_level(seqs, bs, self.k, drafts)

    def _accept(self, bs: int, drafts: torch.Tensor, logits: torch.Tensor, forced: torch.Tensor | None,
                params: list[SamplingParams] | None):
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
        state = None
        for i in range(self.k):
            state = self._draft_level(bs, metas, i, state)
        return self.verify_ids[:bs, 1:]

    def _draft_level(self, bs: int, metas: dict, i: int, state: torch.Tensor | None, masked: bool = False
                     ) -> torch.Tensor:
        """Draft i of each chain, straight into the verify's ids (in target ids, after the root `_metas` put
        there): the head catches up first (i = 0; of the catch-up rows only each sequence's last, its newest
        token, feeds the drafts), else it takes draft i - 1 with its state. `masked`: within each row's grammar
        after the drafts before (`_grammar_level`). Returns the head's state, for draft i + 1."""
        head, drafter = self.head, self.drafter
        embedding = self.target.embed_tokens.weight  # the head looks its tokens up as it norms them
        if i == 0:
            catch_slots = self.catch_slots[:bs].view(-1)
            state = head(embedding, drafter.taps[catch_slots], self.catch_pos[:bs].view(-1), metas["catch"],
                         drafter.kv_cache, self.catch_ids[:bs].view(-1), rows=self.last_row[:bs])
        else:
            state = head(embedding, state, self.extend_pos[i - 1, :bs], metas["extend"][i - 1], drafter.kv_cache,
                         self.verify_ids[:bs, i])
        logits = head.compute_logits(state)
        if masked:
            logits = self._grammar_level(bs, logits, i)
        argmax(logits, head.d2t, out=self.verify_ids[:bs, i + 1])
        return state

    def _verify_logits(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        """The target's logits after root + each draft [bs, k + 1, V] (the ids `_metas` and `_draft` left in
        verify_ids); stores their KV and the head's taps."""
        hidden, captured = self.target(self.verify_ids[:bs].view(-1), self.verify_pos[:bs].view(-1), meta,
                                       self.kv_cache, self.drafter.capture_layers)
        self.drafter.observe(captured, meta.slot_mapping)
        return self.target.compute_logits(hidden).view(bs, self.width, -1)
