"""The acceptance length counts emitted tokens: when a stop (EOS, max_tokens) falls inside an accepted run, the
drafts and the bonus token after it are never output, and they are not counted either."""
from __future__ import annotations

import pytest

from specserve.config import SpecConfig
from specserve.core import SamplingParams


@pytest.fixture(scope="module")
def copy_draft_llm(tiny_checkpoint):
    """A copy of the target drafting 4 tokens: every draft is accepted, so each step emits 5 tokens."""
    from specserve.llm import LLM

    target = tiny_checkpoint("llama", True)
    return LLM(model=str(target), max_total_tokens=1024, spec=SpecConfig("DRAFT_MODEL", str(target), 4))


PROMPT = [5, 6, 7, 8]


def test_eos_accepted_inside_a_run_counts_only_emitted_tokens(copy_draft_llm):
    llm = copy_draft_llm
    free = llm.generate([PROMPT], SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True))[0].token_ids
    # Output 0 comes from the prefill; steps then emit outputs 1-5, 6-10, ... Make EOS a token first output
    # as the second draft of the second step: the step accepts it and the drafts and bonus token after it.
    at = next(i for i in (7, 8, 9) if free[i] not in free[:i])
    eos_before = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = frozenset({free[at]})
    try:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=21, temperature=0.0))[0]
    finally:
        llm.engine.eos_token_ids = eos_before
    assert out.token_ids == free[: at + 1] and out.finish_reason == "stop"
    assert out.num_spec_steps == 2 and out.num_drafted_tokens == 8
    # 5 tokens, then at - 5 of the second step's: counted as emitted, not as the 5 the step accepted.
    assert out.num_accepted_tokens == 4 + (at - 6)
    assert out.mean_acceptance_length == at / 2  # was 5.0: the bonus token after EOS was counted


def test_max_tokens_inside_a_run_counts_only_emitted_tokens(copy_draft_llm):
    out = copy_draft_llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    assert out.num_spec_steps == 2
    steps_emitted = len(out.token_ids) - 1  # the first token comes from the prefill
    assert out.mean_acceptance_length == steps_emitted / out.num_spec_steps
