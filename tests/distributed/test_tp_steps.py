"""The step description rank 0 broadcasts: every field the runner reads survives the round trip, and a
description longer than one broadcast's capacity too."""
from __future__ import annotations

from specserve.core import SamplingParams, ScheduledSeq, StepBatch
from specserve.distributed.steps import CAPACITY, STEP, STOP, decode, encode


def _seq(n_tokens: int, **kw) -> ScheduledSeq:
    params = kw.pop("params", SamplingParams(temperature=0.0))
    return ScheduledSeq("r", list(range(5, 5 + n_tokens)), 7, [3, 9, 4], params, True, None, **kw)


def test_a_batch_survives_encoding():
    sampled = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=2**70 + 3, logprobs=2,
                             presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3,
                             logit_bias={11: -2.5, 12: 100.0}, max_tokens=5, stop=("x",))
    seqs = [_seq(1, num_draft_tokens=3, draft_start_pos=5, draft_catchup_ids=[8, -3], output_index=4),
            ScheduledSeq("s", [-1], 20, [1, 2], sampled, True, 2**62, history=list(range(30)), num_prompt_tokens=9),
            _seq(12)]
    batch = StepBatch(seqs, 16, follow=[1, -1, 0])
    message = decode(encode(batch, publish=True))
    assert message.op == STEP and message.publish
    got = message.batch
    assert (got.page_size, got.follow) == (16, [1, -1, 0])
    for a, b in zip(got.seqs, seqs):
        for field in ("token_ids", "start_pos", "page_ids", "sample", "sample_seed", "num_draft_tokens",
                      "draft_start_pos", "draft_catchup_ids", "num_prompt_tokens", "output_index"):
            assert getattr(a, field) == getattr(b, field), field
    p = got.seqs[1].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.logprobs) == (0.7, 0.9, 40, 0.05, 2)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.3)
    assert p.logit_bias == ((11, -2.5), (12, 100.0))
    assert p.seed % (2**63 - 1) == sampled.seed % (2**63 - 1) and p.adjusts_logits and p.needs_host_logits
    assert got.seqs[1].history == list(range(21))  # what the sampled row reads: up to its last token
    assert got.seqs[0].params.greedy and got.seqs[0].history is None


def test_a_long_batch_and_stop():
    batch = StepBatch([_seq(CAPACITY + 100)], 8)
    words = encode(batch)
    assert len(words) > CAPACITY and decode(words).batch.seqs[0].token_ids == batch.seqs[0].token_ids
    assert decode(encode(None, op=STOP)).op == STOP
