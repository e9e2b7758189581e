"""The general draft search: `TreeProposer`, the `Proposer` (speculative/base.py) of every drafter.

`propose(batch) -> {sequence index: DraftTree}` for every sequence with `num_draft_tokens > 0`, rooted at the
sequence's last token, with `num_draft_tokens` drafts, less those pruned by the sequence's `draft_min_prob`
(nodes whose path's draft probability is below it; the draft plan sets it where a verify row costs more than
such a node is expected to yield). Drafts are chosen deterministically (top-k of the draft's distribution),
which is what makes `speculative.verify` lossless for them; pruning only removes some.

A budget past the deepest chain (`chain_max`) takes the levels of the smallest tree size that holds it
(`tree_sizes`: the draft plan picks among trees of several sizes, SpecConfig.tree_sizes); others search
`num_steps` levels, or fewer for a small budget.

One search serves both kinds of drafter (an EAGLE-3 head, or a standalone draft model): EAGLE-2's dynamic
tree. From the root, take the top-k next tokens; feed those k nodes back, take the top-k children of each,
and keep the k best of the k*k by cumulative log-probability as the next nodes to feed; after `num_steps`
levels keep the `num_draft_tokens` best candidates overall. With topk = 1 this is a greedy chain.

Under a grammar (structured output), each draft row is masked in the draft vocabulary by what the grammar
allows after the root and the drafts on the path to the row's node, so the search never proposes a token the
target's masked distribution could not emit; where the grammar allows a single token, the chain drafts it.
Only a node with fewer allowed tokens than topk gets forbidden children (at -inf: ranked last, and rejected
by verification if a budget still keeps them). Tokens the grammar forces next (`ScheduledSeq.forced_token_ids`)
come first, as a chain: each is fed as the one node of its level, with no top-k and no mask, and the search
goes on from the last one; the scheduler takes them from the sequence's draft budget, so a chain feeds no more
levels than without them.

A drafter's KV pool mirrors the target's page layout (same page ids, its own tensors), so drafting needs no
pages of its own: position p of a request lives at the same slot in both pools. Nodes fed back while
searching live in a scratch region after the mirrored slots; their KV is thrown away after the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch

from specserve.core import ScheduledSeq, StepBatch
from specserve.layers.attention import AttentionMetadata
from specserve.sampling.grammar_mask import allowed_drafts
from specserve.speculative.drafters.base import Drafter
from specserve.speculative.tree import DraftTree, best_first_tree
from specserve.structured.step_masks import MaskJob, MaskWorker, run_jobs


class _LevelMasks:
    """One search level's grammar masks: built on the worker from the start if there is one, else at
    `result`."""

    def __init__(self, rows: list[int], jobs: list, worker: MaskWorker | None) -> None:
        self.rows, self._jobs = rows, jobs
        self._masks: list[torch.Tensor] | None = None
        self._job = MaskJob(self._build, worker)

    def _build(self) -> None:
        self._masks = run_jobs(self._jobs)

    def result(self) -> tuple[list[int], list[torch.Tensor]]:
        self._job.wait()
        return self.rows, self._masks

    def settle(self) -> None:
        self._job.settle()


def search_depth(num_drafts: int, topk: int, num_steps: int) -> int:
    """Levels needed to offer `num_drafts` candidates: a chain is as deep as its drafts; a tree searches
    `num_steps` levels (fewer for a small budget), each level offering topk * topk candidates."""
    if topk == 1:
        return num_drafts
    depth = max(1, min(num_steps, num_drafts))
    while topk + (depth - 1) * topk * topk < num_drafts:
        depth += 1
    return depth


def scratch_slots(topk: int, num_steps: int, max_drafts: int) -> int:
    """Scratch slots one sequence needs: every level of the deepest search but the last is fed back, after
    the nodes of a forced chain shorter than the budget (a longer one is verified without the drafter)."""
    return topk * (search_depth(max_drafts, topk, num_steps) - 1) + max_drafts - 1


@dataclass
class _Search:
    """One sequence's tree search. Candidates are (target token, parent candidate or -1, cumulative logp)."""

    root_token: int
    root_pos: int
    num_drafts: int
    depth: int
    context_slots: torch.Tensor  # drafter KV slots of the context the nodes attend to
    scratch_base: int
    min_logp: float = -math.inf  # candidates scoring less are pruned
    candidates: list[tuple[int, int, float]] = field(default_factory=list)
    frontier: list[int] = field(default_factory=list)  # candidates to feed next
    fed: list[int] = field(default_factory=list)  # candidates already fed, in feed order
    # Row of the drafter's latest output whose state a candidate is fed with: its parent's row.
    state_row: dict[int, int] = field(default_factory=dict)
    grammar: object | None = None  # the request's grammar state (structured/state.py), if constrained
    forced: list[int] = field(default_factory=list)  # tokens the grammar forces first: levels 1..len(forced)

    def path(self, candidate: int) -> list[int]:
        """The draft tokens from the root down to `candidate` (-1: the root itself, no tokens)."""
        tokens = []
        while candidate != -1:
            tokens.append(self.candidates[candidate][0])
            candidate = self.candidates[candidate][1]
        return tokens[::-1]

    def add_level(self, parents: list[int], first_row: int, tokens: list[list[int]], logps: list[list[float]],
                  topk: int) -> None:
        """Adds each parent's top-k children and makes the k best new candidates the next frontier."""
        first = len(self.candidates)
        for row, (parent, toks, lps) in enumerate(zip(parents, tokens, logps), start=first_row):
            base = 0.0 if parent == -1 else self.candidates[parent][2]
            for t, lp in zip(toks, lps):
                self.state_row[len(self.candidates)] = row
                self.candidates.append((t, parent, base + lp))
        new = range(first, len(self.candidates))
        self.frontier = sorted(new, key=lambda c: (-self.candidates[c][2], c))[:topk]

    def add_forced(self, level: int, row: int) -> None:
        """The forced token of `level` (0: the root's child) as the one child of the frontier, certain."""
        parent = self.frontier[0] if level else -1
        self.state_row[len(self.candidates)] = row
        self.candidates.append((self.forced[level], parent, 0.0))
        self.frontier = [len(self.candidates) - 1]

    def feed_mask(self) -> torch.Tensor:
        """[k, context + fed] for the frontier just appended to `fed`: the context, its ancestors, itself."""
        column = {c: i for i, c in enumerate(self.fed)}
        mask = torch.zeros(len(self.frontier), len(self.context_slots) + len(self.fed), dtype=torch.bool)
        mask[:, : len(self.context_slots)] = True
        for row, node in enumerate(self.frontier):
            while node != -1:
                mask[row, len(self.context_slots) + column[node]] = True
                node = self.candidates[node][1]
        return mask

    def tree(self) -> DraftTree:
        # Forced nodes score 0 (certain), so the best-first cut keeps them all, before any drafted node.
        return best_first_tree(self.root_token, self.candidates, len(self.forced) + self.num_drafts, self.min_logp)


class TreeProposer:
    def __init__(self, drafter: Drafter, topk: int, num_steps: int, max_drafts: int, scratch_start: int,
                 device: torch.device, tree_sizes: tuple[tuple[int, int], ...] = (), chain_max: int = 0) -> None:
        """The drafter's scratch region starts at slot `scratch_start` and holds `scratch_slots(topk,
        num_steps, max_drafts)` slots per sequence of a batch. `tree_sizes`: (drafts, levels) of each tree a
        step may take (none: the configured one only)."""
        self.drafter = drafter
        self.topk = topk
        self.num_steps = num_steps
        self.tree_sizes = sorted(tree_sizes)
        self.chain_max = chain_max
        self.scratch_start = scratch_start
        self.scratch_stride = scratch_slots(topk, num_steps, max_drafts)
        self.device = device
        self.capture_layers = drafter.capture_layers
        self._draft_to_target: torch.Tensor | None = None  # every draft id's target id, for grammar masks
        # Builds each level's grammar masks beside the drafter's forward (under overlap scheduling; None:
        # in the search's own thread).
        self.mask_worker: MaskWorker | None = None

    def observe(self, captured: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
        self.drafter.observe(captured, slot_mapping)

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.drafter.move_slots(src, dst)

    @torch.inference_mode()
    def extend_drafter(self, batch: StepBatch) -> None:
        """After the target's forward: the drafter extends its KV over the catch-up tokens of the step's
        sequences that do not draft (prompt chunks; decoding requests in a step held back from drafting),
        whose taps are stored by now."""
        seqs = [s for s in batch.seqs if s.draft_catchup_ids and not s.num_draft_tokens]
        if seqs:
            self.drafter.catch_up(seqs, batch.page_size)

    @torch.inference_mode()
    def propose(self, batch: StepBatch) -> dict[int, DraftTree]:
        spec = [(i, s) for i, s in enumerate(batch.seqs) if s.num_draft_tokens > 0]
        if not spec:
            return {}
        seqs = [s for _, s in spec]
        searches = [self._start(j, s, batch.page_size) for j, s in enumerate(seqs)]
        active = list(range(len(searches)))
        parents = [[-1] for _ in active]
        # Each level's grammar masks are known before the drafter's forward for it: the worker (if any)
        # builds them beside it.
        masks = self._level_masks(searches, active, parents, 0)
        try:
            logits, states = self.drafter.catch_up(seqs, batch.page_size)
            self._grow(searches, active, parents, logits, 0, masks)
            for level in range(1, max(x.depth for x in searches)):
                active = [j for j in active if searches[j].depth > level]
                parents = [list(searches[j].frontier) for j in active]
                masks = self._level_masks(searches, active, parents, level)
                logits, states = self._feed(searches, active, level, states)
                self._grow(searches, active, parents, logits, level, masks)
        finally:
            masks.settle()  # no worker may touch the grammars after the search, even a failed one
        return {i: x.tree() for (i, _), x in zip(spec, searches)}

    def _start(self, j: int, seq: ScheduledSeq, page_size: int) -> _Search:
        root_pos = seq.start_pos + len(seq.token_ids) - 1
        context_len = root_pos + 1 - self.drafter.shift
        pos = torch.arange(context_len)
        table = torch.tensor(seq.page_ids)
        return _Search(
            root_token=seq.token_ids[-1],
            root_pos=root_pos,
            num_drafts=seq.num_draft_tokens,
            depth=len(seq.forced_token_ids) + search_depth(seq.num_draft_tokens, self.topk,
                                                           self.levels(seq.num_draft_tokens)),
            context_slots=table[pos // page_size] * page_size + pos % page_size,
            scratch_base=self.scratch_start + j * self.scratch_stride,
            min_logp=math.log(seq.draft_min_prob) if seq.draft_min_prob > 0 else -math.inf,
            grammar=seq.grammar,
            forced=list(seq.forced_token_ids),
        )

    def levels(self, num_drafts: int) -> int:
        """Levels to search for a budget of `num_drafts`: those of the smallest tree size that holds it."""
        if num_drafts > self.chain_max:
            for drafts, levels in self.tree_sizes:
                if num_drafts <= drafts:
                    return min(levels, self.num_steps)
        return self.num_steps

    def _grow(self, searches: list[_Search], active: list[int], parents: list[list[int]], logits: torch.Tensor,
              level: int, masks: _LevelMasks) -> None:
        """`logits` has one row per parent, in order; each parent gets its top-k children, or its forced one."""
        drafting = self._drafting(searches, active, level)
        logits = self._mask_drafts(logits.float(), *masks.result())
        top = torch.log_softmax(logits, dim=-1).topk(self.topk, dim=-1)
        tokens = self.drafter.to_target_ids(top.indices).tolist()
        values = top.values.tolist()
        row = 0
        for j, ps in zip(active, parents):
            if j in drafting:
                searches[j].add_level(ps, row, tokens[row:row + len(ps)], values[row:row + len(ps)], self.topk)
            else:
                searches[j].add_forced(level, row)
            row += len(ps)

    @staticmethod
    def _drafting(searches: list[_Search], active: list[int], level: int) -> set[int]:
        return {j for j in active if level >= len(searches[j].forced)}

    def _level_masks(self, searches: list[_Search], active: list[int], parents: list[list[int]], level: int
                     ) -> _LevelMasks:
        """The grammar masks of a level's draft rows: the rows (one per parent, in order) of constrained
        searches, and per such search its rows' masks, the grammar after the path to each parent. The paths
        are read here; only the grammars are left to the worker."""
        drafting = self._drafting(searches, active, level)
        rows, jobs, first = [], [], 0
        for j, ps in zip(active, parents):
            grammar = searches[j].grammar
            if grammar is not None and j in drafting:  # a forced level's row needs no mask
                rows.extend(range(first, first + len(ps)))
                jobs.append(partial(grammar.path_masks, [searches[j].path(p) for p in ps]))
            first += len(ps)
        return _LevelMasks(rows, jobs, self.mask_worker if jobs else None)

    def _mask_drafts(self, logits: torch.Tensor, rows: list[int], masks: list[torch.Tensor]) -> torch.Tensor:
        """The draft rows `rows` (of constrained searches) with the tokens their grammar forbids at -inf (read in
        the draft vocabulary through the drafter's id map, `allowed_drafts`)."""
        if not rows:
            return logits
        if self._draft_to_target is None or len(self._draft_to_target) != logits.shape[-1]:
            ids = torch.arange(logits.shape[-1], device=logits.device)
            self._draft_to_target = self.drafter.to_target_ids(ids)
        allowed = allowed_drafts(torch.cat(masks), self._draft_to_target)
        index = torch.tensor(rows, device=logits.device)
        logits = logits.clone()
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        return logits

    def _feed(self, searches: list[_Search], active: list[int], level: int, states: torch.Tensor | None):
        """Feeds each active search's frontier (its nodes at depth `level`) to the drafter."""
        tokens, positions, kv_slots, masks, rows = [], [], [], [], []
        for j in active:
            x = searches[j]
            x.fed.extend(x.frontier)
            tokens += [x.candidates[c][0] for c in x.frontier]
            positions += [x.root_pos + level - self.drafter.shift] * len(x.frontier)
            rows += [x.state_row[c] for c in x.frontier]
            kv_slots.append(torch.cat([x.context_slots, torch.arange(x.scratch_base, x.scratch_base + len(x.fed))]))
            masks.append(x.feed_mask())
        meta = AttentionMetadata.from_slots(kv_slots, masks, self.device)
        fed_states = None if states is None else states[torch.tensor(rows, device=self.device)]
        return self.drafter.extend(
            torch.tensor(tokens, device=self.device), fed_states, torch.tensor(positions, device=self.device), meta
        )
