"""Penalties, logit_bias and log-probabilities: their definitions against a reference written from the
definitions and against transformers, and speculation keeping them: greedy output with drafts equals greedy
output without, and the emitted tokens' log-probabilities (from the verify pass) equal plain decoding's."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specserve.config import SpecConfig
from specserve.core import SamplingParams
from specserve.engine.factory import build_engine_core
from specserve.sampling.penalties import RowContext, adjust_logits

from engine_runs import count_accepted, make_prompts, tight_config

MAX_TOKENS = 20


def _reference(logits: torch.Tensor, ctx: RowContext) -> torch.Tensor:
    """One row, straight from the definitions: bias, then HF's repetition penalty over prompt and output,
    then frequency (per occurrence) and presence (once) over the output."""
    row = logits.clone()
    for token, bias in ctx.params.logit_bias:
        row[token] += bias
    p = ctx.params
    for token in set(ctx.prompt) | set(ctx.output):
        row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
    for token in set(ctx.output):
        row[token] -= p.frequency_penalty * ctx.output.count(token) + p.presence_penalty
    return row


def test_adjust_logits_follows_the_definitions_row_by_row():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=generator) * 3
    contexts = [
        RowContext(SamplingParams(repetition_penalty=1.7), [1, 2, 2], [3, 4]),
        None,  # a row of a request without adjustments stays as it is
        RowContext(SamplingParams(frequency_penalty=0.5, presence_penalty=-0.3, logit_bias={7: 4.0, 1: -2.5}),
                   [1], [7, 7, 9, 1]),
        RowContext(SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=2.0),
                   [], [5, 5, 5, 0]),
    ]
    adjusted = adjust_logits(logits, contexts)
    torch.testing.assert_close(adjusted[1], logits[1])
    for row, ctx in enumerate(contexts):
        if ctx is not None:
            torch.testing.assert_close(adjusted[row], _reference(logits[row], ctx))


def _generate(engine, prompts: list[list[int]], params: list[SamplingParams]):
    """All requests at once; returns each one's tokens and log-probabilities (None where not asked)."""
    tokens = {str(i): [] for i in range(len(prompts))}
    logprobs = {str(i): [] for i in range(len(prompts))}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    while engine.has_work():
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
            logprobs[delta.request_id] += delta.logprobs or []
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages
    return [tokens[str(i)] for i in range(len(prompts))], [logprobs[str(i)] for i in range(len(prompts))]


def _hf_greedy_adjusted(model_dir, prompt: list[int], params: SamplingParams):
    """Greedy decoding with transformers' logits, adjusted by the reference definitions; also the raw
    log-probabilities of each chosen token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, out, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1]
            token = int(_reference(logits, RowContext(params, prompt, out)).argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
            out.append(token)
    return out, logprobs


PENALISED = [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, frequency_penalty=1.5,
                   presence_penalty=0.5, logprobs=3),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logit_bias={11: 6.0, 12: -50.0},
                   repetition_penalty=0.9, logprobs=0),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),  # rides along unadjusted
]


@pytest.fixture(scope="module")
def plain_run(tiny_checkpoint):
    target = tiny_checkpoint("llama", True)
    # The second prompt (one token) makes the tiny model repeat a token 14 times: there the frequency and
    # presence penalties bite.
    prompts = [make_prompts(512)[i] for i in (0, 6, 3, 2)]
    engine, _ = build_engine_core(tight_config(str(target), 400), progress=False)
    return prompts, _generate(engine, prompts, PENALISED)


def test_penalised_greedy_equals_transformers_with_the_reference_adjustments(tiny_checkpoint, plain_run):
    prompts, (tokens, logprobs) = plain_run
    target = tiny_checkpoint("llama", True)
    for i, (prompt, params) in enumerate(zip(prompts, PENALISED)):
        theirs, their_logprobs = _hf_greedy_adjusted(target, prompt, params)
        assert tokens[i] == theirs, f"request {i}"
        if params.logprobs is not None:
            assert [lp.token_id for lp in logprobs[i]] == tokens[i]
            torch.testing.assert_close([lp.logprob for lp in logprobs[i]], their_logprobs, atol=1e-4, rtol=0)
            assert all(len(lp.top) == params.logprobs for lp in logprobs[i])
    # The adjustments change the output: each adjusted request decodes otherwise without them.
    for i in range(3):
        assert tokens[i] != _hf_greedy_adjusted(target, prompts[i], PENALISED[3])[0], f"request {i}"


def test_repetition_penalty_greedy_equals_transformers_generate(tiny_checkpoint, plain_run):
    from transformers import AutoModelForCausalLM

    prompts, (tokens, _) = plain_run
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama", True), dtype=torch.float32).eval()
    ids = model.generate(torch.tensor([prompts[0]]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                         do_sample=False, repetition_penalty=1.3, attention_mask=torch.ones(1, len(prompts[0]),
                                                                                            dtype=torch.long))
    assert tokens[0] == ids[0, len(prompts[0]):].tolist()


@pytest.mark.parametrize("draft, num_steps, topk, num_draft_tokens", [
    ("copy", 3, 1, None),  # a chain from a copy of the target: long accepted runs, cut where penalties bite
    ("eagle3", 3, 1, None),  # a chain from the EAGLE-3 program's general path
    ("eagle3", 3, 2, 6),  # a tree: each node's row sees the drafts on its own path
])
def test_speculative_greedy_with_adjustments_equals_plain(tiny_checkpoint, random_eagle3_head, plain_run, draft,
                                                          num_steps, topk, num_draft_tokens):
    target = tiny_checkpoint("llama", True)
    algorithm, path = ("DRAFT_MODEL", target) if draft == "copy" else ("EAGLE3", random_eagle3_head)
    spec = SpecConfig(algorithm, str(path), num_steps, topk, num_draft_tokens)
    engine, _ = build_engine_core(replace(tight_config(str(target), 400), spec=spec), progress=False)
    prompts, (plain_tokens, plain_logprobs) = plain_run
    accepted = count_accepted(engine)
    tokens, logprobs = _generate(engine, prompts, PENALISED)
    assert tokens == plain_tokens
    for ours, theirs in zip(logprobs, plain_logprobs):
        assert [(lp.token_id, [t for t, _ in lp.top]) for lp in ours] == \
            [(lp.token_id, [t for t, _ in lp.top]) for lp in theirs]
        torch.testing.assert_close([lp.logprob for lp in ours], [lp.logprob for lp in theirs], atol=1e-4, rtol=0)
    assert accepted, "the requests must have drafted"
    if draft == "copy":
        assert sum(accepted) > len(accepted), "a copy of the target should have most of its drafts accepted"


def test_logprobs_under_overlap_equal_the_synchronous_engine(tiny_checkpoint, plain_run):
    target = tiny_checkpoint("llama", True)
    engine, _ = build_engine_core(tight_config(str(target), 400), progress=False)
    engine.overlap = True  # on by default only on a GPU; forced here so CI checks its bookkeeping
    prompts, expected = plain_run
    tokens, logprobs = _generate(engine, prompts, PENALISED)
    assert tokens == expected[0]
    assert [[lp.token_id for lp in row] for row in logprobs] == [[lp.token_id for lp in row] for row in expected[1]]
