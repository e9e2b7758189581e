"""EAGLE-2 dynamic trees with an EAGLE-3 head as one device program per step, captured in CUDA graphs on a GPU.

The same search as `speculative/search.py` (top-k children per node, the k best new candidates fed back per
level, the best N candidates overall by cumulative draft log-probability; cumulative scores here are summed
in float32 rather than Python floats, which can only reorder exact near-ties), but with fixed shapes, so one
step is one program with one read-back:

1. catch the head up on the tokens the last step accepted (as the chain program does);
2. search: level 0 is the head's top-k after the root; each further level feeds the k best candidates of
   the level before, k rows per sequence, each attending to the context and to its own fed ancestors;
3. keep the N best candidates (parents come first, so every kept node's ancestors are kept);
4. verify root + N nodes with the target in one forward, each node attending to the context and its path;
5. accept on the device: the deepest node whose path matches the target's argmax at every step, then the
   target's own token after it; for a sampled row, speculative/verify.py's walk down the tree, drawn on the device
   (`accept_tree_sampled`);
6. move the accepted nodes' KV and taps from their scratch slots to the positions they now hold.

Tree nodes cannot take the slots of their positions (siblings share a position), so the target writes them
to a scratch region after its pages, and the head writes its fed nodes to the scratch region after its
mirrored pages. The paged decode kernel reaches them as each row's "tail": a short list of slots read after
the row's context. The root takes its own slot, so every node's context is the sequence up to the root.

Greedy requests and sampled requests without a seed (simulated acceptance too), as the chain program takes
them (speculative/programs/chain.py; steps with sampled rows run the program eagerly, not from a graph); seeded ones
take the general path. On a CPU the same program runs eagerly, with attention in PyTorch, which is how CI
checks it.
"""
from __future__ import annotations

from collections.abc import Generator
from functools import partial

import numpy as np
import torch

from specserve import envs
from specserve.speculative.accept import accept_tree_sampled
from specserve.speculative.programs.base import (
    ProgramSetup,
    SpecGraphs,
    pack_tokens,
    page_slots,
    put_where,
    table_slots,
)
from specserve.layers.attention import AttentionMetadata
from specserve.sampling.sampler import argmax, filtered_probs, race
from specserve.speculative.search import search_depth
from specserve.transfer import tensor_on


def log_softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities [rows, k] in fp32, token ids [rows, k]) of each row's k best, best first. On a GPU
    (unless SPECSERVE_FUSED_TOPK=0), two Triton kernels do it (kernels/triton/topk.py): the same values, ties
    ranked to the lower token id, where torch.topk leaves their order open."""
    if logits.is_cuda and envs.get().fused_topk:
        from specserve.kernels.triton import topk as triton_topk  # Triton: GPU machines only

        return triton_topk.fused_log_softmax_topk(logits, k)
    top = torch.log_softmax(logits, dim=-1, dtype=torch.float32).topk(k, dim=-1)
    return top.values, top.indices


def candidate_depths(topk: int, depth: int) -> torch.Tensor:
    """The depth of every candidate of a search, in candidate order: k at depth 1, then k * k per level."""
    sizes = [topk] + [topk * topk] * (depth - 1)
    return torch.cat([torch.full((size,), d + 1) for d, size in enumerate(sizes)])


def _fused_search_enabled(num_candidates: int) -> bool:
    from specserve.kernels.triton import tree as triton_tree  # Triton: GPU machines only

    return envs.get().fused_search and num_candidates <= triton_tree.MAX_CANDIDATES


def _drain(levels: Generator):
    """Runs a search (`TreeGraphs._search`) through every level; returns its candidates."""
    while True:
        try:
            next(levels)
        except StopIteration as done:
            return done.value


def fed_paths(tokens: torch.Tensor, parents: torch.Tensor, fed: torch.Tensor, level: int) -> torch.Tensor:
    """The target ids on the path from the root to each fed candidate: candidates' tokens and parents [bs, C]
    (parent -1: the root), fed candidates [bs, k] at depth `level` -> [bs, k, level], the root's child first."""
    steps, node = [], fed
    for _ in range(level):
        steps.append(tokens.gather(1, node))
        node = parents.gather(1, node).clamp(min=0)
    return torch.stack(steps[::-1], dim=-1)


def _at(values: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """values [B, N + 1, V] at each row's node [B] -> [B, V]."""
    return values.gather(1, node[:, None, None].expand(-1, 1, values.shape[2]))[:, 0]


class TreeGraphs(SpecGraphs):
    fused = False  # the search's bookkeeping in Triton kernels (kernels/triton/tree.py): on a GPU, by default

    def __init__(self, target: torch.nn.Module, drafter, kv_cache: torch.Tensor, topk: int, num_steps: int,
                 num_drafts: int, scratch: tuple[int, int], setup: ProgramSetup) -> None:
        """`scratch` = (target_scratch, head_scratch): the target's KV pool holds `max_bs * num_drafts` scratch
        slots from `target_scratch`, the head's `max_bs * topk * (depth - 1)` from `head_scratch`."""
        target_scratch, head_scratch = scratch
        self.topk, self.num_drafts = topk, num_drafts
        self.max_drafts = num_drafts
        self.mask_rows = num_drafts + 1  # the root, then each node
        self.depth = search_depth(num_drafts, topk, num_steps)
        # Accepting a path of the full depth adds depth + 1 tokens, which the next catch-up feeds.
        super().__init__(target, drafter, kv_cache, self.depth + 1, setup)
        fed = topk * (self.depth - 1)
        self.target_scratch = target_scratch + torch.arange(self.max_bs * num_drafts, device=self.device).view(
            self.max_bs, num_drafts)
        self.head_scratch = head_scratch + torch.arange(self.max_bs * max(fed, 1), device=self.device).view(
            self.max_bs, max(fed, 1))
        self.candidate_depth = candidate_depths(topk, self.depth).to(self.device)
        # The tail length of every fed row at each level of the search (a level's rows hold `level` fed nodes).
        self.level_lens = torch.arange(self.depth, dtype=torch.int32, device=self.device)[:, None].repeat(
            1, self.max_bs * topk)
        self.fused = self.device.type == "cuda" and _fused_search_enabled(self.candidate_depth.numel())
        if self.fused:
            self._allocate_search(self.candidate_depth.numel())
        if setup.capture:
            self._capture(setup.progress, "capturing speculative tree graphs")

    def _allocate_search(self, num_candidates: int) -> None:
        """Static buffers of the fused search (kernels/triton/tree.py): the candidates, what each level feeds the
        next (two sets, a level reads one and writes the other), and the first level's paths."""
        b, k, depth = self.max_bs, self.topk, self.depth
        hidden, dtype = self.head.config.model.hidden_size, self.target.embed_tokens.weight.dtype
        long = dict(dtype=torch.long, device=self.device)
        self.candidates = {"tokens": torch.zeros(b, num_candidates, **long),
                           "parents": torch.full((b, num_candidates), -1, **long),  # level 0's stay -1
                           "scores": torch.zeros(b, num_candidates, dtype=torch.float32, device=self.device)}
        self.fed_sets = [{"tokens": torch.zeros(b, k, **long),
                          "scores": torch.zeros(b, k, dtype=torch.float32, device=self.device),
                          "frontier": torch.zeros(b, k, **long),
                          "states": torch.zeros(b * k, hidden, dtype=dtype, device=self.device),
                          "paths": [torch.zeros(b * k, level + 1, **long) for level in range(depth)]}
                         for _ in range(2)]
        self.first_frontier = torch.arange(k, **long).repeat(b, 1)
        # Level 1's rows' paths: their own slots (a one-level tree feeds no rows; its head scratch is one slot).
        self.first_path = self.head_scratch[:, :k].reshape(b * k, 1).clone() if depth > 1 else None
        # The step's row inputs (`_metas`), written by one kernel; page tables per context bucket.
        int32 = dict(dtype=torch.int32, device=self.device)
        self.row_inputs = {"catch_lens": torch.zeros(b * self.width, **int32),
                           "fed_pos": torch.zeros(max(depth - 1, 1), b * k, **long),
                           "fed_lens": torch.zeros(b * k, **int32)}
        self.table_rows = {"catch_tables": self.width, "fed_tables": k, "verify_tables": self.num_drafts + 1}
        self.row_tables = {n: {name: torch.zeros(b * r, t.shape[1], **int32) for name, r in self.table_rows.items()}
                           for n, t in self.tables.items()}

    def _buffer_shapes(self) -> dict[str, tuple[tuple[int, ...], int]]:
        b, w = self.max_bs, self.width
        return {"catch_ids": ((b, w), 0), "catch_pos": ((b, w), 0), "catch_slots": ((b, w), 0),
                "last_row": ((b,), 0), "root_ids": ((b,), 0), "root_pos": ((b,), 0), "root_slots": ((b,), 0),
                "real_slots": ((b, self.depth), 0), "limit": ((b,), 0), "forced": ((b,), 0)}

    def _describe(self, seqs, bs: int, width: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        ps, pad, depth = self.page_size, self.pad_slot, self.depth
        rows, tables = self._describe_catch_up(seqs, bs, width)
        root_ids = np.zeros(bs, np.int64)
        root_pos = np.zeros(bs, np.int64)
        root_slots = np.full(bs, pad, np.int64)
        real_slots = np.full((bs, depth), pad, np.int64)
        limit = np.zeros(bs, np.int64)
        for row, s in enumerate(seqs):
            pages = tables[row].astype(np.int64)
            root, d = s.start_pos, s.num_draft_tokens
            # Pages cover root + d for d scheduled drafts, and no more than d drafts are accepted.
            limit[row] = d
            root_ids[row], root_pos[row] = s.token_ids[0], root
            root_slots[row] = page_slots(pages, np.int64(root), ps)
            kept = min(d, depth)
            real_slots[row, :kept] = page_slots(pages, np.arange(root + 1, root + 1 + kept), ps)
        rows.update(root_ids=root_ids, root_pos=root_pos, root_slots=root_slots, real_slots=real_slots, limit=limit)
        return rows, tables

    def _follow_root(self, bs: int, on: torch.Tensor, root: torch.Tensor, table: torch.Tensor) -> None:
        """As `_describe` writes them: the root's position and slot, and the slots of root + 1.. that accepted
        nodes move to (as many as the limit and the depth allow)."""
        ps = self.page_size
        put_where(self.root_pos[:bs], on[:, 0], root)
        put_where(self.root_slots[:bs], on[:, 0], table_slots(table, root[:, None], ps)[:, 0])
        j = torch.arange(self.depth, device=self.device)[None, :]
        real = torch.where(j < self.limit[:bs, None], table_slots(table, root[:, None] + 1 + j, ps), self.pad_slot)
        put_where(self.real_slots[:bs], on, real)

    def _roots(self, bs: int) -> torch.Tensor:
        return self.root_pos[:bs]

    def _metas(self, bs: int, n: int) -> dict[str, torch.Tensor]:
        """What the step's attention reads that follows from the catch-up rows' positions and the roots: the
        catch-up rows' context lengths (int32, up to and including each row) and page tables (one per row);
        the fed rows' positions at each level [levels, bs * k] (level l's rows at root + l), context lengths
        (the roots, int32) and page tables; the verify's rows' page tables. With the fused search one kernel
        writes them (triton_tree.step_rows): in PyTorch they are ~8 graph kernels, each a launch's latency."""
        if self.fused:
            from specserve.kernels.triton import tree as triton_tree

            rows = self._static_rows(bs, n)
            triton_tree.step_rows(self.catch_pos[:bs], self.root_pos[:bs], self.tables[n][:bs], rows)
            return rows
        return self._step_rows(bs, n)

    def _static_rows(self, bs: int, n: int) -> dict[str, torch.Tensor]:
        """`_metas`' static buffers for bs sequences in context bucket n."""
        k = self.topk
        rows = {name: table[: bs * self.table_rows[name]] for name, table in self.row_tables[n].items()}
        return rows | {"catch_lens": self.row_inputs["catch_lens"][: bs * self.width],
                       "fed_pos": self.row_inputs["fed_pos"][:, : bs * k],
                       "fed_lens": self.row_inputs["fed_lens"][: bs * k]}

    def _step_rows(self, bs: int, n: int) -> dict[str, torch.Tensor]:
        """`_metas` in PyTorch: the CPU path, and the reference of the fused kernel."""
        k, table, root = self.topk, self.tables[n][:bs], self.root_pos[:bs]
        fed_root = root.repeat_interleave(k)
        return {"catch_lens": (self.catch_pos[:bs] + 1).view(-1).to(torch.int32),
                "catch_tables": table.repeat_interleave(self.width, 0),
                "fed_pos": fed_root[None, :] + self.level_lens[: max(self.depth - 1, 1), :1],
                "fed_lens": fed_root.to(torch.int32), "fed_tables": table.repeat_interleave(k, 0),
                "verify_tables": table.repeat_interleave(self.num_drafts + 1, 0)}

    # -- the program --------------------------------------------------------
    def _rows_meta(self, n: int, slots: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor, kv_heads: int,
                   tails: torch.Tensor | None = None, tail_lens: torch.Tensor | None = None, per_seq: int = 1,
                   closed: bool = False) -> AttentionMetadata:
        """Rows each one query over its page table (one per row) up to seq_lens (int32), then its tail.
        `per_seq` > 1: runs of that many rows share a context length, so the kernel reads it once for them all.
        `closed`: every tail slot is one of the run's rows' own (AttentionMetadata.closed_tails)."""
        return AttentionMetadata.for_decode_kernel(slots, tables, seq_lens, self.page_size, kv_heads, n,
                                                   tail_slots=tails, tail_lens=tail_lens, rows_per_seq=per_seq,
                                                   closed_tails=closed)

    def _drafts(self, bs: int, n: int, metas: dict) -> dict:
        return self._select(bs, *_drain(self._search(bs, n, metas)))

    def _target_logits(self, bs: int, n: int, nodes: dict, metas: dict) -> torch.Tensor:
        return self._verify_logits(bs, n, nodes, metas)

    def _accept_packed(self, bs: int, nodes: dict, logits: torch.Tensor, forced: torch.Tensor | None,
                       params=None) -> torch.Tensor:
        """With the fused search, a greedy step accepts and packs in one kernel (triton_tree.accept_tree)."""
        if params is not None or not self.fused:
            return self._keep_packed(bs, pack_tokens(*self._accept_logits(bs, nodes, logits, forced, params)))
        from specserve.kernels.triton import tree as triton_tree

        packed, src, dst = triton_tree.accept_tree(nodes, argmax(logits), forced, self.real_slots[:bs], self.pad_slot,
                                                   self._roots(bs), self.last_packed, self.last_root)
        triton_tree.move_slots(self.kv_cache, self.drafter.taps, src.view(-1), dst.view(-1), self.pad_slot)
        return packed

    def _accept_logits(self, bs: int, nodes: dict, logits: torch.Tensor, forced: torch.Tensor | None, params=None):
        """(tokens, accepted drafts) per row, the accepted path's KV and taps moved into place."""
        best = argmax(logits)
        leaf = self._leaf(bs, nodes, best, forced)
        after = best.gather(1, leaf[:, None])[:, 0]
        if params is not None:
            def dist(node: torch.Tensor) -> torch.Tensor:
                return filtered_probs(_at(logits, node), params)

            if forced is None:
                drawn_leaf, drawn = accept_tree_sampled(nodes, dist, self.depth, self.topk)
            else:  # simulated: the forced path, then a draw from the target after it
                drawn_leaf, drawn = leaf, race(dist(leaf))
            greedy = tensor_on([p.greedy for p in params], self.device)
            leaf, after = torch.where(greedy, leaf, drawn_leaf), torch.where(greedy, after, drawn)
        tokens, accepted, path = self._emit(nodes, leaf, after)
        self._move_accepted(bs, nodes, path, accepted)
        return tokens, accepted

    # -- rows under a grammar (`_constrained_step`) ---------------------------------------------------
    def _masked_parts(self, bs: int, n: int, params=None):
        """One part per search level, each within its rows' grammars: the first after the root, each further
        one after the path to each fed node (the host fills those masks between parts, `_fill_level`); the
        last part also selects the tree. Then the verification's two."""
        step = {}

        def level(i: int):
            def run():
                if i == 0:
                    step["metas"] = self._metas(bs, n)
                    step["levels"] = self._search(bs, n, step["metas"], masked=True)
                try:
                    return next(step["levels"])  # the paths of the nodes the next level feeds
                except StopIteration as done:
                    step["drafts"] = self._select(bs, *done.value)
                    return step["drafts"]
            return run
        return [level(i) for i in range(self.depth)], *self._verify_parts(bs, n, step, params)

    def _allocate_masks(self, words: int) -> None:
        """Besides the root's, one mask per fed row of a search level (`_fill_level`), and every verify row's
        (`_fill_masks`), each filled on the host once the drafts before it are read back."""
        super()._allocate_masks(words)
        pinned, fed = self.device.type == "cuda", self.max_bs * self.topk
        self.fed_masks = torch.full((fed, words), -1, dtype=torch.int32, device=self.device)
        self._host_fed = torch.empty(fed, words, dtype=torch.int32, pin_memory=pinned)
        self._host_masks = torch.empty(self.grammar_masks.shape, dtype=torch.int32, pin_memory=pinned)

    def _fill_level(self, seqs, bs: int, level: int, drafts: list) -> None:
        """Level 0: each root's verify row. A further level: per fed row, what the grammar allows after the
        path to its node (`drafts`: each sequence's fed paths), everything for a sequence without one."""
        if level == 0:
            return super()._fill_level(seqs, bs, level, drafts)
        k = self.topk
        jobs = {i: partial(seq.grammar.path_masks, drafts[i]) for i, seq in enumerate(seqs) if seq.grammar is not None}
        self._fill_rows(self._host_fed[: bs * k], self.fed_masks[: bs * k], k, jobs)

    def _fill_masks(self, seqs, bs: int, drafts: list) -> None:
        """Each constrained sequence's verify rows, per node of its tree (xgrammar's draft-tree traversal);
        nodes past the scheduled drafts never decide."""
        rows = self.mask_rows
        jobs = {i: partial(seq.grammar.tree_masks, *drafts[i]) for i, seq in enumerate(seqs) if seq.grammar is not None}
        self._fill_rows(self._host_masks[: bs * rows], self.grammar_masks[: bs * rows], rows, jobs)

    def _drafts_on_host(self, drafts, b: int) -> list:
        """A level's fed paths ([b][k][level] target ids), or the selected trees' (tokens, parents)."""
        if isinstance(drafts, torch.Tensor):
            return drafts[:b].tolist()
        return list(zip(drafts["tokens"][:b].tolist(), drafts["parent"][:b].tolist()))

    def _search(self, bs: int, n: int, rows: dict, masked: bool = False) -> Generator:
        """The search, level by level, as a generator: before each level past the first it yields what that
        level feeds, and it returns the candidates [bs, C] (target token, parent candidate or -1, cumulative
        log-prob) (`_drain` runs it through). `rows` as `_metas` makes them. `masked`: every level within each
        row's grammar, the first after the root (`_grammar_level`), each further one after the path to each
        fed node (`fed_masks`, which the host fills from the paths yielded: [bs, k, level] target ids);
        unmasked, it yields None."""
        head, drafter, k = self.head, self.drafter, self.topk
        embedding = self.target.embed_tokens.weight  # the head looks its tokens up as it norms them
        catch_slots = self.catch_slots[:bs].view(-1)
        meta = self._rows_meta(n, catch_slots, rows["catch_lens"], rows["catch_tables"], head.config.model.num_kv_heads)
        # [bs, H]: what the root's children are fed with, from each sequence's last catch-up row
        state = head(embedding, drafter.taps[catch_slots], self.catch_pos[:bs].view(-1), meta, drafter.kv_cache,
                     self.catch_ids[:bs].view(-1), rows=self.last_row[:bs])
        logits = head.compute_logits(state)
        if masked:
            logits = self._grammar_level(bs, logits)
        values, indices = log_softmax_topk(logits, k)
        if self.fused:
            return (yield from self._search_fused(bs, n, rows, state, values, indices, masked))
        tokens, scores = [head.to_target_ids(indices)], [values]
        parents = [torch.full((bs, k), -1, dtype=torch.long, device=self.device)]
        frontier = torch.arange(k, device=self.device).expand(bs, k)  # candidates fed next
        fed_tokens, fed_scores = tokens[0], scores[0]
        fed_states = state[:, None, :].expand(bs, k, state.shape[-1])
        path = torch.empty(bs, k, 0, dtype=torch.long, device=self.device)  # head scratch slots of fed nodes' paths
        for level in range(1, self.depth):
            yield fed_paths(torch.cat(tokens, 1), torch.cat(parents, 1), frontier, level) if masked else None
            own = self.head_scratch[:bs, (level - 1) * k: level * k]
            path = torch.cat([path, own[..., None]], dim=-1)
            out, values, indices = self._level_pass(bs, n, level, rows, fed_states.reshape(bs * k, -1),
                                                    fed_tokens.reshape(-1), path.reshape(bs * k, level), masked)
            child_scores = (fed_scores[..., None] + values.view(bs, k, k)).view(bs, k * k)
            child_tokens = head.to_target_ids(indices).view(bs, k * k)
            tokens.append(child_tokens)
            scores.append(child_scores)
            parents.append(frontier.repeat_interleave(k, dim=1))
            if level == self.depth - 1:
                break
            # The k best children are fed next (stable: ties go to the earlier candidate, as in the search).
            order = torch.sort(child_scores, dim=-1, descending=True, stable=True).indices[:, :k]
            parent = order // k
            frontier = k + (level - 1) * k * k + order
            fed_tokens, fed_scores = child_tokens.gather(1, order), child_scores.gather(1, order)
            fed_states = out.view(bs, k, -1).gather(1, parent[..., None].expand(-1, -1, out.shape[-1]))
            path = path.gather(1, parent[..., None].expand(-1, -1, level))
        return torch.cat(tokens, dim=1), torch.cat(parents, dim=1), torch.cat(scores, dim=1)

    def _level_pass(self, bs: int, n: int, level: int, rows: dict, states: torch.Tensor, tokens: torch.Tensor,
                    path: torch.Tensor, masked: bool = False):
        """The head over one level's fed rows (states [bs * k, H], tokens [bs * k], paths [bs * k, level] of head
        scratch slots, the last their own) -> (its output [bs * k, H], each row's k best children: log-probs and
        draft ids [bs * k, k]). `masked`: the children within each fed row's mask (`fed_masks`)."""
        head, k = self.head, self.topk
        own = self.head_scratch[:bs, (level - 1) * k: level * k]
        meta = self._rows_meta(n, own.reshape(-1), rows["fed_lens"], rows["fed_tables"], head.config.model.num_kv_heads,
                               path, self.level_lens[level, : bs * k], per_seq=k)
        out = head(self.target.embed_tokens.weight, states, rows["fed_pos"][level - 1], meta, self.drafter.kv_cache,
                   tokens)
        logits = head.compute_logits(out)
        if masked:
            logits = self._forbid_drafts(logits, self.fed_masks[: bs * k])
        return (out, *log_softmax_topk(logits, k))

    def _search_fused(self, bs: int, n: int, rows: dict, state: torch.Tensor, values: torch.Tensor,
                      indices: torch.Tensor, masked: bool = False) -> Generator:
        """`_search` after the head's catch-up (its state [bs, H] and top-k: log-probs and draft ids [bs, k]), with
        the first level's bookkeeping in one kernel (triton_tree.root_children) and each further level's in one
        (triton_tree.expand_level); the same candidates, in static buffers."""
        from specserve.kernels.triton import tree as triton_tree

        k = self.topk
        candidates = {name: buffer[:bs] for name, buffer in self.candidates.items()}
        d2t = getattr(self.head, "d2t", None)
        first = self.fed_sets[0]  # level 1 reads it and writes the other set
        fed = {"tokens": first["tokens"][:bs], "scores": first["scores"][:bs], "states": first["states"][: bs * k],
               "frontier": self.first_frontier[:bs],
               "path": None if self.first_path is None else self.first_path[: bs * k]}
        triton_tree.root_children(values, indices, d2t, state, candidates, fed)
        for level in range(1, self.depth):
            yield fed_paths(candidates["tokens"], candidates["parents"], fed["frontier"], level) if masked else None
            out, values, indices = self._level_pass(bs, n, level, rows, fed["states"], fed["tokens"].reshape(-1),
                                                    fed["path"], masked)
            last = level == self.depth - 1
            sets = self.fed_sets[level % 2]
            nxt = {name: sets[name][:bs] for name in ("tokens", "scores", "frontier")}
            nxt.update(states=sets["states"][: bs * k], path=sets["paths"][level][: bs * k])
            triton_tree.expand_level(values, indices, d2t, fed["scores"], fed["frontier"], out.contiguous(),
                                     fed["path"], self.head_scratch[:bs, level * k:], candidates,
                                     k + (level - 1) * k * k, level, last, nxt)
            fed = nxt
        return candidates["tokens"], candidates["parents"], candidates["scores"]

    def _select(self, bs: int, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> dict:
        """The N best candidates, parents first, as tree nodes 1..N under the root (node 0)."""
        if self.fused:
            from specserve.kernels.triton import tree as triton_tree

            candidates = {"tokens": tokens, "parents": parents, "scores": scores}
            return triton_tree.select_nodes(candidates, self.candidate_depth, self.limit[:bs], self.root_ids[:bs],
                                            self.root_slots[:bs], self.target_scratch[:bs], self.depth,
                                            self.root_pos[:bs])
        n = self.num_drafts
        ranked = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :n]
        kept = ranked.sort(dim=-1).values  # candidate order: parents before children
        node_of = torch.zeros_like(tokens)
        node_of.scatter_(1, kept, torch.arange(1, n + 1, device=self.device).expand(bs, n))
        kept_parents = parents.gather(1, kept)
        zero = torch.zeros(bs, 1, dtype=torch.long, device=self.device)
        parent = torch.cat([zero, torch.where(kept_parents < 0, 0, node_of.gather(1, kept_parents.clamp(min=0)))], 1)
        depth = torch.cat([zero, self.candidate_depth[kept]], dim=1)
        # A sequence scheduled with d < N drafts verifies the tree of its d best candidates (pages cover
        # root + d): the others are computed but never accepted.
        rank = torch.zeros_like(parent)
        rank.scatter_(1, node_of.gather(1, ranked), torch.arange(n, device=self.device).expand(bs, n))
        in_tree = rank < self.limit[:bs, None]
        in_tree[:, 0] = True
        # Each node's path, depth by depth: path[b, i, d] is node i's ancestor at depth d + 1 (itself last, 0
        # past it), taken from its ancestors 0, 1, .. levels up.
        ancestors = [torch.arange(n + 1, device=self.device).expand(bs, n + 1), parent]
        for _ in range(self.depth - 2):
            ancestors.append(parent.gather(1, ancestors[-1]))
        up = depth[..., None] - torch.arange(1, self.depth + 1, device=self.device)
        path = torch.where(up >= 0, torch.stack(ancestors[: self.depth], dim=-1).gather(2, up.clamp(min=0)), 0)
        return {"tokens": torch.cat([self.root_ids[:bs, None], tokens.gather(1, kept)], dim=1),
                "parent": parent, "depth": depth, "path": path, "in_tree": in_tree,
                "slots": torch.cat([self.root_slots[:bs, None], self.target_scratch[:bs]], dim=1)}

    def _verify_rows(self, bs: int, nodes: dict) -> dict:
        """What each of the verify's rows [bs * (N + 1)] reads besides its node: its tail (its path's slots,
        [., depth]), context length (the root's position + 1) and tail length in int32, and position. The fused
        selection writes these itself (triton_tree.select_nodes)."""
        width = self.num_drafts + 1
        root_pos = self.root_pos[:bs]
        return {"tails": nodes["slots"].gather(1, nodes["path"].view(bs, -1)).view(bs * width, self.depth),
                "seq_lens": (root_pos + 1).repeat_interleave(width).to(torch.int32),
                "tail_lens": nodes["depth"].reshape(-1).to(torch.int32),
                "positions": (root_pos[:, None] + nodes["depth"]).view(-1)}

    def _verify_logits(self, bs: int, n: int, nodes: dict, step_rows: dict) -> torch.Tensor:
        """The target's logits after every node [bs, N + 1, V]; stores the nodes' KV and taps in their slots.
        `step_rows` as `_metas` makes them."""
        width = self.num_drafts + 1
        rows = nodes["verify_rows"] if "verify_rows" in nodes else self._verify_rows(bs, nodes)
        meta = self._rows_meta(n, nodes["slots"].reshape(-1), rows["seq_lens"], step_rows["verify_tables"],
                               self.target.config.kv_entry_shape[1], rows["tails"], rows["tail_lens"], per_seq=width,
                               closed=True)
        hidden, captured = self.target(nodes["tokens"].reshape(-1), rows["positions"], meta, self.kv_cache,
                                       self.drafter.capture_layers)
        self.drafter.observe(captured, meta.slot_mapping)
        return self.target.compute_logits(hidden).view(bs, width, -1)

    def _accept(self, bs: int, nodes: dict, best: torch.Tensor, forced: torch.Tensor | None):
        """(tokens [bs, depth + 1], accepted drafts [bs], the accepted node's path [bs, depth]) for greedy rows."""
        leaf = self._leaf(bs, nodes, best, forced)
        return self._emit(nodes, leaf, best.gather(1, leaf[:, None])[:, 0])

    def _leaf(self, bs: int, nodes: dict, best: torch.Tensor, forced: torch.Tensor | None) -> torch.Tensor:
        """The accepted node [bs] of greedy rows: the deepest that matches the target's argmax all the way (with
        `forced`, simulated acceptance: `forced` levels down each node's first child among those whose subtree
        reaches that deep, or as deep as the tree goes)."""
        parent, depth, in_tree = nodes["parent"], nodes["depth"], nodes["in_tree"]
        if forced is None:
            # A node is reachable when its token is the target's choice after its parent, all the way up.
            matches = nodes["tokens"] == best.gather(1, parent)
            matches[:, 0] = True
            reachable = matches
            for _ in range(self.depth):
                reachable = matches & reachable.gather(1, parent)
            reachable &= in_tree
            leaf = (reachable * (depth + 1)).argmax(dim=1)  # siblings differ, so one node per depth at most
        else:  # simulated: `forced` levels down each node's first child among those whose subtree gets there
            width = self.num_drafts + 1
            deepest = torch.where(in_tree, depth, -1)  # the depth of each node's deepest descendant in the tree
            for _ in range(self.depth):
                deepest = deepest.scatter_reduce(1, parent[:, 1:], deepest[:, 1:], "amax")
            target = torch.minimum(forced, deepest[:, 0])
            first_child = torch.full((bs, width), width, dtype=torch.long, device=self.device)
            index = torch.arange(1, width, device=self.device).expand(bs, -1)
            reaches = in_tree[:, 1:] & (deepest[:, 1:] >= target[:, None])
            first_child.scatter_reduce_(1, parent[:, 1:], torch.where(reaches, index, width), "amin")
            leaf = torch.zeros(bs, dtype=torch.long, device=self.device)
            for d in range(self.depth):
                child = first_child.gather(1, leaf[:, None]).squeeze(1)
                leaf = torch.where((child < width) & (d < target), child, leaf)
        return leaf

    def _emit(self, nodes: dict, leaf: torch.Tensor, after: torch.Tensor):
        """(tokens [bs, depth + 1], accepted drafts [bs], the accepted node's path [bs, depth]): the tokens of
        the path to `leaf`, then `after`."""
        accepted = nodes["depth"].gather(1, leaf[:, None]).squeeze(1)
        path = nodes["path"].gather(1, leaf[:, None, None].expand(-1, 1, self.depth)).squeeze(1)
        tokens = torch.cat([nodes["tokens"].gather(1, path), torch.zeros_like(path[:, :1])], dim=1)
        tokens.scatter_(1, accepted[:, None], after[:, None])
        return tokens, accepted, path

    def _move_accepted(self, bs: int, nodes: dict, path: torch.Tensor, accepted: torch.Tensor) -> None:
        """The d-th accepted node's KV and taps go from its scratch slot to the slot of root + d."""
        keep = torch.arange(self.depth, device=self.device)[None, :] < accepted[:, None]
        src = torch.where(keep, nodes["slots"].gather(1, path), self.pad_slot).view(-1)
        dst = torch.where(keep, self.real_slots[:bs], self.pad_slot).view(-1)
        self._move_slots(src, dst)

    def _move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """In PyTorch: the CPU path, and the reference of the fused move (triton_tree.move_slots)."""
        self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src))
        self.drafter.move_slots(src, dst)
