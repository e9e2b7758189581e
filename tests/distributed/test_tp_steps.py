"""The step description rank 0 broadcasts: every field the runner reads survives the round trip, a description
longer than one broadcast's capacity too, and page tables sent as changes rebuild the whole tables on the other
side over any run of steps, random or the scheduler's own (a rank that misses a change stops; a failed step
makes the next one resend them all)."""
from __future__ import annotations

import random

import pytest

from specserve.core import SamplingParams, ScheduledSeq, StepBatch
from specserve.distributed.steps import CAPACITY, STEP, STOP, StepDecoder, StepDesync, StepEncoder
from specserve.engine.factory import build_engine_core

from engine_runs import make_prompts, run_staggered, tight_config


def _seq(n_tokens: int, **kw) -> ScheduledSeq:
    params = kw.pop("params", SamplingParams(temperature=0.0))
    return ScheduledSeq(kw.pop("request_id", "r"), list(range(5, 5 + n_tokens)), 7, kw.pop("page_ids", [3, 9, 4]),
                        params, True, None, **kw)


def _round_trip(batch: StepBatch, publish: bool = False):
    return StepDecoder().decode(StepEncoder().encode(batch, publish))


def test_a_batch_survives_encoding():
    sampled = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=2**70 + 3, logprobs=2,
                             presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3,
                             logit_bias={11: -2.5, 12: 100.0}, max_tokens=5, stop=("x",))
    seqs = [_seq(1, num_draft_tokens=3, draft_start_pos=5, draft_catchup_ids=[8, -3], output_index=4,
                 draft_min_prob=0.0625),
            ScheduledSeq("s", [-1], 20, [1, 2], sampled, True, 2**62, history=list(range(30)), num_prompt_tokens=9),
            _seq(12, request_id="t")]
    batch = StepBatch(seqs, 16, follow=[1, -1, 0])
    message = _round_trip(batch, publish=True)
    assert message.op == STEP and message.publish
    got = message.batch
    assert (got.page_size, got.follow) == (16, [1, -1, 0])
    for a, b in zip(got.seqs, seqs):
        for field in ("token_ids", "start_pos", "page_ids", "sample", "sample_seed", "num_draft_tokens",
                      "draft_start_pos", "draft_catchup_ids", "num_prompt_tokens", "output_index",
                      "draft_min_prob"):
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
    words = StepEncoder().encode(batch)
    assert len(words) > CAPACITY and StepDecoder().decode(words).batch.seqs[0].token_ids == batch.seqs[0].token_ids
    assert StepDecoder().decode(StepEncoder().encode(None, op=STOP)).op == STOP


class _Pool:
    """Requests whose page tables change as the scheduler changes them: admitted (maybe on a shared prefix),
    grown, trimmed, a page swapped for a shared copy, finished or preempted, readmitted, left out of a step."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.next_id, self.next_page = rng, 0, 0
        self.tables: dict[str, list[int]] = {}
        self.params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3, logit_bias={4: 1.0})]
        self.settings: dict[str, SamplingParams] = {}

    def pages(self, n: int) -> list[int]:
        self.next_page += n
        return list(range(self.next_page - n, self.next_page))

    def admit(self) -> None:
        rid = f"req-{self.next_id}"
        self.next_id += 1
        shared = self.rng.choice([[], *self.tables.values()])[: self.rng.randrange(3)]
        self.tables[rid] = shared + self.pages(self.rng.randrange(1, 20))
        self.settings[rid] = self.rng.choice(self.params)

    def change(self, rid: str) -> None:
        table, roll = self.tables[rid], self.rng.random()
        if roll < 0.4:
            table += self.pages(self.rng.randrange(1, 4))
        elif roll < 0.55 and len(table) > 1:
            del table[self.rng.randrange(1, len(table)):]  # rejected drafts' pages back
        elif roll < 0.65:
            table[self.rng.randrange(len(table))] = self.pages(1)[0]  # a page indexed as another's copy
        elif roll < 0.7:
            self.tables[rid] = self.pages(self.rng.randrange(1, 8))  # preempted and readmitted

    def step(self) -> StepBatch:
        for rid in list(self.tables):
            if self.rng.random() < 0.1:
                del self.tables[rid]  # finished, aborted or preempted
            else:
                self.change(rid)
        for _ in range(self.rng.randrange(3)):
            self.admit()
        ids = [rid for rid in self.tables if self.rng.random() > 0.1]  # the rest sit this step out
        self.rng.shuffle(ids)
        return StepBatch([ScheduledSeq(rid, [1], 0, list(self.tables[rid]), self.settings[rid], True, None,
                                       num_prompt_tokens=len(rid)) for rid in ids], 16)


def _expected_words(batch: StepBatch, previous: dict[str, list[int]]) -> int:
    """A description's length if it carries, of each sequence, only the pages past those its table shares with
    the last step's, and its settings only when new to the step."""
    words = 8  # the header
    for s in batch.seqs:
        held = previous.get(s.request_id)
        kept = 0 if held is None else next((i for i, (a, b) in enumerate(zip(held, s.page_ids)) if a != b),
                                           min(len(held), len(s.page_ids)))
        words += 15 + len(s.token_ids) + len(s.page_ids) - kept
        words += 12 + 2 * len(s.params.logit_bias) if held is None else 0
    return words


def test_page_table_changes_rebuild_the_tables_over_random_steps():
    rng = random.Random(0)
    pool, encoder, decoder, previous = _Pool(rng), StepEncoder(), StepDecoder(), {}
    for step in range(300):
        if step % 97 == 96:
            encoder.resync()  # as after a step that failed
            previous = {}
        batch = pool.step()
        words = encoder.encode(batch)
        got = decoder.decode(words).batch
        assert [s.page_ids for s in got.seqs] == [s.page_ids for s in batch.seqs], step
        assert [(s.params.temperature, s.params.logit_bias, s.num_prompt_tokens) for s in got.seqs] == \
            [(s.params.temperature, s.params.logit_bias, s.num_prompt_tokens) for s in batch.seqs]
        assert len(words) == _expected_words(batch, previous), step
        previous = {s.request_id: s.page_ids for s in batch.seqs}
    assert decoder.seqs.held.keys() == encoder.seqs.held.keys() and len(encoder.seqs.held) == len(previous)


def test_an_unchanged_step_carries_no_pages_and_a_lost_change_stops_the_rank():
    encoder, decoder = StepEncoder(), StepDecoder()
    batch = StepBatch([_seq(1, request_id=str(i), page_ids=list(range(i * 50, i * 50 + 40))) for i in range(8)], 16)
    first = encoder.encode(batch)
    decoder.decode(first)
    again = encoder.encode(batch)
    assert len(again) == len(first) - 8 * 40 - 8 * 12  # neither pages nor settings again
    assert decoder.decode(again).batch.seqs[3].page_ids == list(range(150, 190))
    grown = StepBatch([_seq(1, request_id=str(i), page_ids=list(range(i * 50, i * 50 + 41))) for i in range(8)], 16)
    encoder.encode(grown)  # a description this rank never applies
    with pytest.raises(StepDesync):
        decoder.decode(encoder.encode(StepBatch(grown.seqs[:4], 16)))


def test_a_real_run_rebuilds_every_table_and_a_failed_step_resends_them(tiny_checkpoint):
    """The scheduler's own tables (prompts in chunks, preemption, finishes) through the encoder and a decoder,
    as rank 0 sends them; a step that fails makes the next description send every table whole."""
    engine, _ = build_engine_core(tight_config(str(tiny_checkpoint("llama", True)), 160), progress=False)
    encoder, decoder, sent = StepEncoder(), StepDecoder(), []

    class Sender:  # rank 0's side, without other ranks
        def send(self, batch, publish):
            words = encoder.encode(batch, publish)
            got = decoder.decode(words).batch
            assert [s.page_ids for s in got.seqs] == [s.page_ids for s in batch.seqs]
            sent.append((words[6], len(batch.seqs)))  # resend flag, sequences

        resync = encoder.resync

    engine.runner.step_sender = Sender()
    launch, failed = engine.runner._launch, []

    def fail_once(batch, publish):
        if len(batch.seqs) > 2 and not failed:
            failed.append(len(sent) - 1)
            raise RuntimeError("injected fault")
        return launch(batch, publish)

    engine.runner._launch = fail_once
    run_staggered(engine, make_prompts(512), max_tokens=8)
    at = failed[0]
    assert sent[at][0] == 0 and sent[at + 1] == (1, 1)  # the first retry, alone, sent whole
    assert sum(flag for flag, _ in sent) == 2 and engine.scheduler.num_preemptions > 0
