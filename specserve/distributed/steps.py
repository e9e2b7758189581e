"""Each step's batch, from the scheduler on rank 0 to every other rank: one flat int64 tensor, broadcast once.

The encoding carries what the runner reads of a `StepBatch` and nothing else: each sequence's tokens,
positions, pages, draft shape and head catch-up, the settings its sampling reads (floats as their bits) and, for
a request whose penalties read its tokens, those tokens. Request ids, stop conditions and grammar state stay on
rank 0. Each worker decodes it into a `StepBatch` and runs the same step its runner would, so every rank reaches
the same collectives in the same order.
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specserve.core import SamplingParams, ScheduledSeq, StepBatch

# STEP: run the batch. STOP: leave. AUDIT: report a fingerprint of the state every rank holds whole.
STEP, STOP, AUDIT = 1, 2, 3
# Words broadcast every step; a longer description (a large prompt batch) sends the rest in a second broadcast.
CAPACITY = 4096
_HEADER = 6  # op, length, page size, publish, sequences, follow length (-1: none)
_SEQ_WORDS = 23  # each sequence's fixed fields (`encode`), before its lists
_SEED_MOD = 2**63 - 1  # draw_seed works modulo this, so a seed's residue draws the same


@dataclass(frozen=True)
class StepMessage:
    op: int
    batch: StepBatch | None = None
    publish: bool = False


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _optional(x: int | None) -> list[int]:
    return [0, 0] if x is None else [1, x % _SEED_MOD]


@functools.lru_cache(maxsize=4096)
def _settings(p: SamplingParams) -> tuple[list[int], list[int]]:
    """A request's sampling settings as words (its fixed fields, then its bias pairs); computed once per settings."""
    fixed = [_bits(p.temperature), _bits(p.top_p), p.top_k, _bits(p.min_p), *_optional(p.seed),
             -1 if p.logprobs is None else p.logprobs, _bits(p.presence_penalty), _bits(p.frequency_penalty),
             _bits(p.repetition_penalty), len(p.logit_bias)]
    return fixed, [w for token, bias in p.logit_bias for w in (token, _bits(bias))]


def encode(batch: StepBatch | None, publish: bool = False, op: int = STEP) -> list[int]:
    """The words of one message (`decode` reads them back)."""
    if batch is None:
        return [op, _HEADER, 0, 0, 0, -1]
    follow = batch.follow
    words = [op, 0, batch.page_size, int(publish), len(batch.seqs), -1 if follow is None else len(follow)]
    for s in batch.seqs:
        history = s.history[: s.start_pos + len(s.token_ids)] if s.history is not None else None
        words += [len(s.token_ids), s.start_pos, len(s.page_ids), int(s.sample), *_optional(s.sample_seed),
                  s.num_draft_tokens, s.draft_start_pos, len(s.draft_catchup_ids), s.output_index,
                  s.num_prompt_tokens, -1 if history is None else len(history)]
        settings, bias = _settings(s.params)
        words += settings
        words += s.token_ids
        words += s.page_ids
        words += s.draft_catchup_ids
        words += history or ()
        words += bias
    words += follow or ()
    words[1] = len(words)
    return words


def decode(words: list[int]) -> StepMessage:
    op, _, page_size, publish, num_seqs, follow_len = words[:_HEADER]
    if op != STEP:
        return StepMessage(op)
    at, seqs = _HEADER, []
    for _ in range(num_seqs):
        head = words[at:at + _SEQ_WORDS]
        n_tok, start, n_pages, sample, has_sample_seed, sample_seed, drafts, draft_start, n_catch = head[:9]
        output_index, num_prompt, n_history, n_bias = head[9], head[10], head[11], head[22]
        at += _SEQ_WORDS
        token_ids, page_ids = words[at:at + n_tok], words[at + n_tok:at + n_tok + n_pages]
        at += n_tok + n_pages
        catch_up = words[at:at + n_catch]
        at += n_catch
        history = None
        if n_history >= 0:
            history, at = words[at:at + n_history], at + n_history
        params = _params(tuple(head[12:22]), tuple(words[at:at + 2 * n_bias]))
        at += 2 * n_bias
        seqs.append(ScheduledSeq("", token_ids, start, page_ids, params, bool(sample),
                                 sample_seed if has_sample_seed else None, drafts, draft_start, catch_up, history,
                                 num_prompt, output_index))
    follow = words[at:at + follow_len] if follow_len >= 0 else None
    return StepMessage(STEP, StepBatch(seqs, page_size, follow), bool(publish))


@functools.lru_cache(maxsize=4096)
def _params(words: tuple[int, ...], bias: tuple[int, ...]) -> SamplingParams:
    """The sampling settings of a description's words; requests mostly share a few, so each is built once."""
    temperature, top_p, top_k, min_p, has_seed, seed, logprobs, presence, frequency, repetition = words
    return SamplingParams(
        max_tokens=None, temperature=_float(temperature), top_p=_float(top_p), top_k=top_k, min_p=_float(min_p),
        seed=seed if has_seed else None, logprobs=None if logprobs < 0 else logprobs,
        presence_penalty=_float(presence), frequency_penalty=_float(frequency),
        repetition_penalty=_float(repetition),
        logit_bias=tuple((bias[i], _float(bias[i + 1])) for i in range(0, len(bias), 2)))


class StepChannel:
    """Rank 0 sends each step's words; every other rank receives them, in the same order. One broadcast of
    CAPACITY words per step (a second for the rest of a longer one), over the group's gloo group."""

    def __init__(self, group) -> None:
        self.group = group
        self.buffer = torch.zeros(CAPACITY, dtype=torch.long)

    def send(self, words: list[int]) -> None:
        head = words[:CAPACITY]
        self.buffer[: len(head)] = torch.tensor(head, dtype=torch.long)
        dist.broadcast(self.buffer, src=0, group=self.group)
        if len(words) > CAPACITY:
            dist.broadcast(torch.tensor(words[CAPACITY:], dtype=torch.long), src=0, group=self.group)

    def receive(self) -> list[int]:
        dist.broadcast(self.buffer, src=0, group=self.group)
        length = int(self.buffer[1])
        words = self.buffer[: min(length, CAPACITY)].tolist()
        if length > CAPACITY:
            rest = torch.empty(length - CAPACITY, dtype=torch.long)
            dist.broadcast(rest, src=0, group=self.group)
            words += rest.tolist()
        return words
