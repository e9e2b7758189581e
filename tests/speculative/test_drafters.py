"""The drafters draft what their network predicts: every node of every tree proposed inside a running engine
(paged KV, scratch slots, lazy catch-up after steps without drafting, preemption) is one of the top-k
children of its parent under a plain reference computation with no cache at all.

Verification keeps output exact whatever is drafted, so a drafter bug would only show as lost speed; these
tests catch it directly."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from specserve.config import SpecConfig
from specserve.engine.factory import build_engine_core
from specserve.layers.attention import AttentionMetadata

from engine_runs import make_prompts, run_staggered, tight_config
from tiny_checkpoints import write_peaked_random_head

TOPK = 4


def _recorded_trees(target, spec: SpecConfig, seed: int = 0):
    """Runs staggered prompts with a random per-step draft plan; returns (context tokens, tree) per draft."""
    engine, _ = build_engine_core(replace(tight_config(str(target), 136), spec=spec), progress=False)
    proposer = engine.runner.proposer
    # Chains would otherwise run as one program (tested against this path in test_chain_program.py).
    engine.runner.program = None
    rng = random.Random(seed)
    engine.scheduler.draft_plan = lambda request: rng.choice([0, 0, 3, spec.max_drafts])
    records, propose = [], proposer.propose

    def recording(batch):
        trees = propose(batch)
        for i, tree in trees.items():
            records.append((list(engine.scheduler.requests[batch.seqs[i].request_id].token_ids), tree))
        return trees

    proposer.propose = recording
    run_staggered(engine, make_prompts(512, seed))
    assert engine.scheduler.num_preemptions > 0 and len(records) > 30
    return engine, records


def _path(tree, node: int) -> list[int]:
    tokens = []
    while node > 0:
        tokens.append(tree.tokens[node])
        node = tree.parents[node]
    return tokens[::-1]


def _check_every_node_is_a_top_k_child(records, next_logits, topk: int) -> None:
    for context, tree in records:
        assert tree.tokens[0] == context[-1]
        for node in range(1, len(tree.tokens)):
            logits = next_logits(context, _path(tree, tree.parents[node]))
            assert tree.tokens[node] in logits.topk(topk).indices.tolist(), (len(context), node)


@pytest.mark.parametrize("pass_tokens", [None, 7])
def test_draft_model_trees_follow_the_draft_model(tiny_checkpoint, pass_tokens, monkeypatch):
    from transformers import AutoModelForCausalLM

    if pass_tokens is not None:  # every catch-up longer than this runs in passes
        monkeypatch.setattr("specserve.speculative.drafters.base.CATCH_UP_PASS_TOKENS", pass_tokens)
    target = tiny_checkpoint("llama", True)
    _, records = _recorded_trees(target, SpecConfig("DRAFT_MODEL", str(target), 3, TOPK, 12))
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    @torch.no_grad()
    def next_logits(context, path):
        return hf(torch.tensor([context + path])).logits[0, -1]

    _check_every_node_is_a_top_k_child(records, next_logits, TOPK)


@pytest.fixture(scope="module")
def peaked_random_head(tiny_checkpoint, tmp_path_factory):
    """A random EAGLE-3 head whose logits are far apart, so top-k never hinges on rounding."""
    return write_peaked_random_head(tiny_checkpoint("llama", True), tmp_path_factory.mktemp("eagle3-peaked"))


def _fresh_cache(n: int, num_layers: int, cfg):
    """Attention metadata and a KV cache of its own for one whole sequence of n tokens."""
    meta = AttentionMetadata.build([n], [0], [[0]], n, torch.device("cpu"))
    return meta, torch.zeros(num_layers, 2, n, cfg.num_kv_heads, cfg.head_dim)


@pytest.mark.parametrize("topk,num_steps,num_draft_tokens,pass_tokens", [(1, 4, None, None), (TOPK, 3, 12, None),
                                                                        (TOPK, 3, 12, 7)])
def test_eagle3_drafts_follow_the_head(tiny_checkpoint, peaked_random_head, topk, num_steps, num_draft_tokens,
                                       pass_tokens, monkeypatch):
    """Reference: the target over the whole context gives the taps; the head runs over the whole sequence of
    (embedding of token j+1, taps of j), then over its own outputs for the path, recomputed from scratch.
    With `pass_tokens`, every catch-up longer than that (prompt chunks, lazy catch-ups) runs in passes."""
    if pass_tokens is not None:
        monkeypatch.setattr("specserve.speculative.drafters.base.CATCH_UP_PASS_TOKENS", pass_tokens)
    target = tiny_checkpoint("llama", True)
    engine, records = _recorded_trees(target, SpecConfig("EAGLE3", str(peaked_random_head), num_steps, topk,
                                                         num_draft_tokens), seed=1)
    model, head = engine.runner.model, engine.runner.proposer.drafter.head

    @torch.no_grad()
    def next_logits(context, path):
        n = len(context)
        meta, kv = _fresh_cache(n, model.config.num_layers, model.config)
        _, taps = model(torch.tensor(context), torch.arange(n), meta, kv, head.config.target_layers)
        hidden = head.project_taps(taps)[:-1]  # position j pairs the taps of j with token j+1
        tokens = context[1:]
        for step in range(len(path) + 1):
            meta, kv = _fresh_cache(len(tokens), 1, head.config.model)
            out = head(model.embed_tokens(torch.tensor(tokens)), hidden, torch.arange(len(tokens)), meta, kv)
            if step < len(path):
                tokens = tokens + [path[step]]
                hidden = torch.cat([hidden, out[-1:]])
        logits = head.compute_logits(out[-1])
        full = torch.full((model.config.vocab_size,), float("-inf"))
        return full.index_copy(0, head.to_target_ids(torch.arange(len(logits))), logits)

    if topk == 1:
        assert all(len(tree.tokens) - 1 == max(tree.depths()) for _, tree in records)  # chains
    _check_every_node_is_a_top_k_child(records, next_logits, topk)
