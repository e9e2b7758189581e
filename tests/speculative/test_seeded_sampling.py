"""Seeded sampling with speculation: a seeded request's output is the same with or without drafts, and alone or in
a batch, because each position's token is the target's own seeded draw there (speculative/verify.py:
`verify_seeded`)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from specserve.config import SpecConfig
from specserve.core import SamplingParams
from specserve.engine.factory import build_engine_core

from engine_runs import count_accepted, make_prompts, tight_config

PARAMS = [SamplingParams(max_tokens=20, temperature=0.6, seed=seed, ignore_eos=True) for seed in (1, 2, 3)]
RIDER = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)  # unseeded, shares the batches


def _run(engine, prompts, params):
    outputs = {str(i): [] for i in range(len(prompts))}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    while engine.has_work():
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
    return [outputs[str(i)] for i in range(len(prompts))]


def _engine(target, spec: SpecConfig | None = None):
    config = tight_config(str(target), 400)
    engine, _ = build_engine_core(replace(config, spec=spec) if spec else config, progress=False)
    return engine


@pytest.fixture(scope="module")
def plain_seeded(tiny_checkpoint):
    target = tiny_checkpoint("llama", True)
    prompts = [make_prompts(512)[i] for i in (6, 0, 3)]
    return prompts, _run(_engine(target), prompts, PARAMS)


@pytest.mark.parametrize("num_steps, topk, num_draft_tokens", [(3, 1, None), (3, 2, 6)])
def test_seeded_output_with_drafts_equals_without_alone_or_batched(tiny_checkpoint, plain_seeded, num_steps, topk,
                                                                   num_draft_tokens):
    target = tiny_checkpoint("llama", True)
    # A copy of the target drafts its greedy choices, which a low temperature often samples too.
    engine = _engine(target, SpecConfig("DRAFT_MODEL", str(target), num_steps, topk, num_draft_tokens))
    prompts, expected = plain_seeded
    accepted = count_accepted(engine)
    batched = _run(engine, [*prompts, prompts[0]], [*PARAMS, RIDER])
    assert batched[:3] == expected
    assert sum(accepted) > 0, "some drafts must have been accepted"
    assert _run(engine, prompts[1:2], PARAMS[1:2]) == expected[1:2]
