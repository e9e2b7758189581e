"""The drafter proposes what the grammar allows: every draft a constrained request verifies is a token its
grammar allows after the drafts before it, unless the grammar allows none of the head's vocabulary there, or
every allowed one is already a sibling (a top-k level fills up with the rest). Checked where every path builds
its verify masks from the drafts (GrammarState.path_masks and tree_masks): the chain and tree programs, drafting
level by level under masks, and the general search."""
from __future__ import annotations

import json

import pytest
import torch

from specserve.bench.schemas import SCHEMAS
from specserve.config import SpecConfig
from specserve.core import Constraint, SamplingParams
from specserve.structured.state import GrammarState
from engine_runs import run_batch

PATHS = {"chain program": ((3, 1, None), True), "chain search": ((3, 1, None), False),
         "tree program": ((3, 2, 6), True), "tree search": ((3, 2, 6), False)}


def _allowed(mask_words: torch.Tensor, token: int) -> bool:
    return bool((int(mask_words[token // 32]) >> (token % 32)) & 1)


class DraftAudit:
    """Walks each verified tree in the request's grammar before its masks are built, counting the drafts and
    the forbidden ones that had an allowed head token left to take instead."""

    def __init__(self, head_tokens: torch.Tensor) -> None:
        self.head_tokens = head_tokens.tolist()
        self.path_masks = GrammarState.path_masks  # unwatched
        self.drafts = self.avoidable = 0

    def tree(self, state: GrammarState, tokens, parents) -> None:
        children: dict[int, list[int]] = {}
        for node in range(1, len(tokens)):
            children.setdefault(parents[node], []).append(tokens[node])
        for parent, kids in children.items():
            path = self._path(tokens, parents, parent)
            mask = self.path_masks(state, [path])[0]
            if not self._reachable(state, path):
                continue  # below a forbidden draft or past the grammar's end: never accepted
            self.drafts += len(kids)
            allowed_head = {t for t in self.head_tokens if _allowed(mask, t)}
            if any(not _allowed(mask, t) for t in kids) and not allowed_head <= set(kids):
                self.avoidable += 1

    def paths(self, state: GrammarState, paths) -> None:
        """Paths from one root (a level's parents, a tree's leaves) as one tree, so siblings meet."""
        tokens, parents, node_of = [None], [-1], {(): 0}
        for path in paths:
            for depth in range(1, len(path) + 1):
                prefix = tuple(path[:depth])
                if prefix not in node_of:
                    node_of[prefix] = len(tokens)
                    tokens.append(prefix[-1])
                    parents.append(node_of[prefix[:-1]])
        self.tree(state, tokens, parents)

    @staticmethod
    def _path(tokens, parents, node) -> list[int]:
        path = []
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        return path[::-1]

    @staticmethod
    def _reachable(state: GrammarState, path: list[int]) -> bool:
        accepted = 0
        for token in path:
            if state.matcher.is_terminated() or not state.matcher.accept_token(token):
                break
            accepted += 1
        reachable = accepted == len(path) and not state.matcher.is_terminated()
        state.rollback(accepted)
        return reachable


@pytest.mark.parametrize("name", PATHS)
def test_verified_drafts_are_ones_the_grammar_allows(tiny_chat_model, tiny_chat_head, switches, monkeypatch, name):
    from specserve.llm import LLM

    shape, program = PATHS[name]
    switches(forced_drafts=False, program_masks=program, tree_program_on_cpu=program)
    llm = LLM(model=str(tiny_chat_model), max_total_tokens=8192, spec=SpecConfig("EAGLE3", str(tiny_chat_head),
                                                                                 *shape))
    drafter = llm.engine.runner.proposer.drafter
    audit = DraftAudit(drafter.to_target_ids(torch.arange(len(drafter.head.d2t))))
    path_masks, tree_masks = audit.path_masks, GrammarState.tree_masks
    monkeypatch.setattr(GrammarState, "path_masks", lambda self, paths: (audit.paths(self, paths),
                                                                         path_masks(self, paths))[1])
    monkeypatch.setattr(GrammarState, "tree_masks", lambda self, tokens, parents: (
        audit.tree(self, tokens, parents), tree_masks(self, tokens, parents))[1])
    schemas = SCHEMAS[:6]
    prompts = [f"Answer in JSON following the schema {json.dumps(s)}" for s in schemas]
    outputs = []
    for temperature in (0.0, 1.0):  # greedy and sampled batches apart, as the programs take greedy rows
        params = [SamplingParams(max_tokens=60, temperature=temperature, seed=i,
                                 constraint=Constraint("json_schema", json.dumps(s))) for i, s in enumerate(schemas)]
        outputs += run_batch(llm, prompts, params)[0]
    program_runs = llm.engine.runner.program.num_masked_runs if llm.engine.runner.program is not None else 0
    llm.close()
    assert all(out.token_ids for out in outputs)
    assert audit.drafts > 100 and audit.avoidable == 0
    assert (program_runs > 5) == program
