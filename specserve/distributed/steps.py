"""Each step's batch, from the scheduler on rank 0 to every other rank: one flat int64 tensor, broadcast once.

The encoding carries what the runner reads of a `StepBatch` and nothing else: each sequence's tokens,
positions, pages, draft shape and head catch-up, the settings its sampling reads (floats as their bits) and, for
a request whose penalties read its tokens, those tokens. Request ids, stop conditions and grammar state stay on
rank 0. Each worker decodes it into a `StepBatch` and runs the same step its runner would, so every rank reaches
the same collectives in the same order.

Page tables travel as changes (`HeldSequences`). Every rank holds the table of each sequence of the last step,
under a key rank 0 gives the request; a step names each of its sequences by key and carries only the pages past
the part of its table that is unchanged: a whole table for a sequence new to the step, the appended pages for
one that grew. A request's sampling settings, fixed for its life, travel the same way: with its first step. A
sequence absent from a step is dropped everywhere (finished, aborted, preempted, or left out of the step), and
comes back whole. Each description carries a checksum of every table rank 0 holds after it; a rank whose tables
hash differently stops (its engine then stops too, docs/parallel.md), so the ranks cannot run on different
pages. `StepEncoder.resync` makes the next step send every table whole.
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from specserve.core import SamplingParams, ScheduledSeq, StepBatch

# STEP: run the batch. STOP: leave. AUDIT: report a fingerprint of the state every rank holds whole.
STEP, STOP, AUDIT = 1, 2, 3
# Words broadcast every step; a longer description (a large prompt batch) sends the rest in a second broadcast.
CAPACITY = 4096
# op, length, page size, publish, sequences, follow length (-1: none), resend (1: tables whole), checksum
_HEADER = 8
_SEQ_WORDS = 15  # each sequence's fixed fields (`StepEncoder._encode_seq`), before its settings and lists
_SETTINGS_WORDS = 11  # `_settings`' fixed fields
_SEED_MOD = 2**63 - 1  # draw_seed works modulo this, so a seed's residue draws the same
_CHECK_MASK = 2**63 - 1


class StepDesync(RuntimeError):
    """A rank's page tables no longer match rank 0's: it cannot run the step on the right pages."""


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


class HeldSequences:
    """What every rank holds of each sequence of the last step, by key: its page table, a hash of (key, pages),
    its sampling settings and prompt length. Rank 0 and every other rank hold the same; `end_step`'s checksum
    condenses every table, so comparing it compares them all. A changed table is a new list, never the old one
    edited: earlier batches may still hold the old one."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[list[int], int, SamplingParams, int]] = {}
        self.next: dict[int, tuple[list[int], int, SamplingParams, int]] = {}

    def get(self, key: int) -> tuple[list[int], int, SamplingParams, int] | None:
        return self.held.get(key)

    def keep(self, key: int, entry: tuple) -> None:
        """The key's entry, unchanged this step."""
        self.next[key] = entry

    def put(self, key: int, table: list[int], params: SamplingParams, num_prompt: int) -> None:
        # Python hashes a tuple of ints the same way in every process (no per-process salt, unlike str), and
        # every rank runs the same interpreter, so equal tables hash equally on every rank.
        self.next[key] = (table, hash((key, *table)), params, num_prompt)

    def end_step(self) -> int:
        """Drops the sequences the step left out; returns the checksum of the tables left."""
        self.held, self.next = self.next, {}
        return sum(entry[1] for entry in self.held.values()) & _CHECK_MASK

    def clear(self) -> None:
        self.held, self.next = {}, {}


def _common_prefix(old: list[int], new: list[int]) -> int:
    n = len(old)
    if len(new) >= n and new[:n] == old:  # grown (or unchanged): the usual case
        return n
    n = min(n, len(new))
    if new[:n] == old[:n]:  # trimmed
        return n
    return next(i for i in range(n) if old[i] != new[i])


class StepEncoder:
    """Rank 0's side: each step's words, with page tables as changes against those the last step left."""

    def __init__(self) -> None:
        self.seqs = HeldSequences()
        self.keys: dict[str, int] = {}  # request id -> key, for the sequences of the last step
        self.next_key = 0
        self.resend = True

    def resync(self) -> None:
        """The next step sends every sequence whole, and every rank drops what it held first."""
        self.resend = True

    def encode(self, batch: StepBatch | None, publish: bool = False, op: int = STEP) -> list[int]:
        """The words of one message (`StepDecoder.decode` reads them back)."""
        if batch is None:
            return [op, _HEADER, 0, 0, 0, -1, 0, 0]
        resend, self.resend = self.resend, False
        if resend:
            self.seqs.clear()
            self.keys = {}
        follow = batch.follow
        words = [op, 0, batch.page_size, int(publish), len(batch.seqs), -1 if follow is None else len(follow),
                 int(resend), 0]
        keys = {}
        for s in batch.seqs:
            key = self.keys.get(s.request_id)
            if key is None:
                key, self.next_key = self.next_key, self.next_key + 1
            keys[s.request_id] = key
            self._encode_seq(words, key, s)
        self.keys = keys
        words[7] = self.seqs.end_step()
        words += follow or ()
        words[1] = len(words)
        return words

    def _encode_seq(self, words: list[int], key: int, s: ScheduledSeq) -> None:
        entry = self.seqs.get(key)
        held = None if entry is None else entry[0]
        same_settings = entry is not None and entry[2] is s.params and entry[3] == s.num_prompt_tokens
        if same_settings and held == s.page_ids:
            self.seqs.keep(key, entry)
            kept = len(held)
        else:
            kept = 0 if held is None else _common_prefix(held, s.page_ids)
            self.seqs.put(key, list(s.page_ids), s.params, s.num_prompt_tokens)
        new_pages = s.page_ids[kept:]
        history = s.history[: s.start_pos + len(s.token_ids)] if s.history is not None else None
        words += [key, kept, len(new_pages), int(not same_settings), len(s.token_ids), s.start_pos, int(s.sample),
                  *_optional(s.sample_seed), s.num_draft_tokens, s.draft_start_pos, len(s.draft_catchup_ids),
                  s.output_index, -1 if history is None else len(history), _bits(s.draft_min_prob)]
        bias = ()
        if not same_settings:
            settings, bias = _settings(s.params)
            words += settings
            words.append(s.num_prompt_tokens)
        words += s.token_ids
        words += new_pages
        words += s.draft_catchup_ids
        words += history or ()
        words += bias


class StepDecoder:
    """Every other rank's side: rebuilds each step's batch, its page tables from the changes rank 0 sent."""

    def __init__(self) -> None:
        self.seqs = HeldSequences()

    def decode(self, words: list[int]) -> StepMessage:
        op, _, page_size, publish, num_seqs, follow_len, resend, checksum = words[:_HEADER]
        if op != STEP:
            return StepMessage(op)
        if resend:
            self.seqs.clear()
        at, seqs = _HEADER, []
        for _ in range(num_seqs):
            seq, at = self._decode_seq(words, at)
            seqs.append(seq)
        if self.seqs.end_step() != checksum:
            raise StepDesync("this rank's page tables differ from rank 0's; it stops rather than run on wrong "
                             "pages")
        follow = words[at:at + follow_len] if follow_len >= 0 else None
        return StepMessage(STEP, StepBatch(seqs, page_size, follow), bool(publish))

    def _decode_seq(self, words: list[int], at: int) -> tuple[ScheduledSeq, int]:
        head = words[at:at + _SEQ_WORDS]
        key, kept, n_new, has_settings, n_tok, start, sample, has_sample_seed, sample_seed = head[:9]
        drafts, draft_start, n_catch, output_index, n_history, min_prob = head[9:]
        at += _SEQ_WORDS
        settings = None
        if has_settings:
            settings, at = words[at:at + _SETTINGS_WORDS + 1], at + _SETTINGS_WORDS + 1
        token_ids = words[at:at + n_tok]
        at += n_tok
        new_pages = words[at:at + n_new]
        at += n_new
        catch_up = words[at:at + n_catch]
        at += n_catch
        history = None
        if n_history >= 0:
            history, at = words[at:at + n_history], at + n_history
        if settings is not None:
            n_bias = settings[_SETTINGS_WORDS - 1]
            params = _params(tuple(settings[:_SETTINGS_WORDS - 1]), tuple(words[at:at + 2 * n_bias]))
            at += 2 * n_bias
            page_ids, _, params, num_prompt = self._hold(key, kept, new_pages, params, settings[-1])
        else:
            page_ids, _, params, num_prompt = self._hold(key, kept, new_pages)
        seq = ScheduledSeq("", token_ids, start, page_ids, params, bool(sample),
                           sample_seed if has_sample_seed else None, drafts, draft_start, catch_up, history,
                           num_prompt, output_index, _float(min_prob))
        return seq, at

    def _hold(self, key: int, kept: int, new_pages: list[int], params: SamplingParams | None = None,
              num_prompt: int = 0) -> tuple:
        """The key's entry after this step: its table with `kept` pages kept and `new_pages` after them, and the
        settings sent, or those held."""
        entry = self.seqs.get(key)
        held = None if entry is None else entry[0]
        if kept > (0 if held is None else len(held)) or (params is None and entry is None):
            raise StepDesync(f"rank 0 keeps {kept} pages and the settings of sequence {key}, which this rank "
                             f"{'does not hold' if held is None else f'holds {len(held)} pages of'}")
        if params is None and kept == len(held) and not new_pages:
            self.seqs.keep(key, entry)
            return entry
        if params is None:
            params, num_prompt = entry[2], entry[3]
        self.seqs.put(key, held[:kept] + new_pages if kept else new_pages, params, num_prompt)
        return self.seqs.next[key]


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
        self.buffer.numpy()[: len(head)] = head  # numpy converts a list of ints faster than torch.tensor
        dist.broadcast(self.buffer, src=0, group=self.group)
        if len(words) > CAPACITY:
            dist.broadcast(torch.from_numpy(np.array(words[CAPACITY:], dtype=np.int64)), src=0, group=self.group)

    def receive(self) -> list[int]:
        dist.broadcast(self.buffer, src=0, group=self.group)
        length = int(self.buffer[1])
        words = self.buffer[: min(length, CAPACITY)].tolist()
        if length > CAPACITY:
            rest = torch.empty(length - CAPACITY, dtype=torch.long)
            dist.broadcast(rest, src=0, group=self.group)
            words += rest.tolist()
        return words
