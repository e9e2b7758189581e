"""The engine core: one step is schedule -> run -> postprocess.

With overlap on, a step is launched before the previous one is read back: schedule N+1, launch N+1, then read
N's tokens and postprocess them while the device runs N+1. A decoding request's input for N+1 is then a
placeholder for the token N is still sampling (engine/futures.py). The price: a request that finishes at N
has already been given one more token of work at N+1, which is dropped.

Drafting steps overlap too when they run as the chain or tree program (speculative/programs/chain.py), whose inputs
the device can derive from the last step's results: while step N drafts, step N + 1 is built from what the
host knows (up to N's root: `Scheduler.follow`, with pages for the most N can accept) and launched, and N is
read back behind it. Anything else (a prompt arriving, the draft plan changing its mind, a request near its
end) makes the next step wait for N and be scheduled from exact state. A step that drafts by the general
search runs synchronously: the step in flight is read back first and its tokens replace the placeholders.
A plain step holding constrained requests overlaps in two halves: its forward is launched, the step in flight
read back (which advances the grammars), and only then are its masks built and its rows sampled
(structured/step_masks.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from specserve import envs
from specserve.core import FinishReason, Request, SamplingParams, ScheduledSeq, StepBatch, TokenLogprob
from specserve.engine.futures import has_placeholder
from specserve.engine.phases import NoTimer
from specserve.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class Runner(Protocol):
    overlap_masks: bool  # build grammar masks beside the forward (set with the engine's overlap)

    def launch(self, batch: StepBatch, publish: bool = False):
        """Queues a step; returns a StepOutput (engine/runner.py): for each sequence that samples, its new tokens
        (accepted drafts, then one sampled token) and their log-probabilities, read back when asked for. A step
        without drafts, or a chain or tree program's, is read back later."""
        ...


@dataclass(frozen=True)
class TokenDelta:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    # Speculation: drafts proposed and accepted this step (None if it did not draft), and running totals.
    # Accepted counts emitted tokens less one, so accepted + 1 is what the step output even when a stop
    # (EOS, a stop token, max_tokens) inside the accepted run cuts it short.
    step_drafted: int = 0
    step_accepted: int | None = None
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per new token, where the request asked
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    pages_used: int
    pages_total: int
    num_preemptions: int
    # Speculation configured and the draft plan letting decode steps draft (its last answer).
    spec_drafting: bool = False
    kv_bytes_per_token: int = 0  # what the target's pool keeps per token, every layer (MLA: its latent only)
    # Prefix caching, since start: prompt tokens admitted, and those served from the cache; pages it holds.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_cached_pages: int = 0
    dense_kv_bytes_per_token: int = 0  # kv_bytes_per_token with keys and values expanded per head (MLA's foil)


@dataclass(frozen=True)
class _InFlight:
    """A launched step not yet read back: its output and, per sampling sequence, the request and the index
    of the placeholder its token will replace; for a program step, its batch and requests instead."""

    output: object  # runner.StepOutput
    placeholders: list[tuple[Request, int]]
    kind: str  # StepBatch.kind
    batch: StepBatch | None = None
    requests: list[Request] | None = None


class StepObserver(Protocol):
    """What an adaptive draft plan learns from (speculative/plan.py)."""

    def observe_step(self, drafted: bool, batch_size: int, seconds: float) -> None: ...

    def observe_other_step(self) -> None: ...

    def observe_acceptance(self, request: Request, drafted: int, accepted: int, depth: int | None = None
                           ) -> None: ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: Runner, eos_token_ids: tuple[int, ...],
                 overlap: bool = False, observer: StepObserver | None = None, vocab_size: int | None = None,
                 grammars=None, dense_kv_bytes_per_token: int = 0) -> None:
        self.scheduler = scheduler
        self._dense_bytes_per_token = dense_kv_bytes_per_token
        self.vocab_size = vocab_size  # token ids past it have no embedding: refused at admission
        self.runner = runner
        self.grammars = grammars  # structured.grammar.Grammars: compiles constraints (None: refused)
        self.observer = observer
        self._last_step: tuple[StepBatch, float] | None = None  # for the observer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.timer = NoTimer()
        # With overlap, steps that draft by the general search still run synchronously (it reads the tokens on
        # the host); the chain and tree programs' steps overlap (`Scheduler.follow`).
        self.overlap = overlap
        self.in_flight: _InFlight | None = None
        self._known: dict[int, int] = {}  # placeholder -> token, from the last read-back

    @property
    def overlap(self) -> bool:
        return self._overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        # Under overlap scheduling the runner also builds a step's grammar masks beside its forward.
        self._overlap = self.runner.overlap_masks = on

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError for a request that can never run; the engine is unchanged then."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        self._check_token_ids(prompt_token_ids, "prompt")
        self._check_token_ids([t for t, _ in params.logit_bias], "logit_bias")
        room = self.max_model_len - len(prompt_token_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens leaves no room in a context of {self.max_model_len}")
        max_tokens = room if params.max_tokens is None else params.max_tokens
        request = Request(request_id, list(prompt_token_ids), params, max_tokens)
        if params.constraint is not None:
            if self.grammars is None:
                raise ValueError("structured output needs the model's tokenizer, and this engine has none")
            request.grammar = self.grammars.state(params.constraint)  # ValueError for an invalid grammar
        self.scheduler.add(request)

    def _check_token_ids(self, ids: list[int], what: str) -> None:
        if self.vocab_size is None:
            return
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{what}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def abort(self, request_ids: list[str]) -> list[TokenDelta]:
        aborted = [self.scheduler.abort(rid) for rid in request_ids]
        for request in aborted:
            while request is not None and has_placeholder(request.token_ids[-1:]):
                request.token_ids.pop()  # the token of a step in flight, never to be read
        return [_delta(r, []) for r in aborted if r is not None]

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    def step(self) -> list[TokenDelta]:
        start = time.perf_counter()
        if self.observer is not None:
            self._observe(start)
        deltas = []
        flight = self.in_flight
        if flight is not None and flight.batch is not None:  # a program step: follow it, or wait for it
            with self.timer.phase("schedule"):
                follow = self.scheduler.follow(flight.batch, flight.output.program_width)
            if follow is not None:
                launched = self._launch_program(follow)
                if launched is not None:
                    self.timer.steps += 1
                    deltas = self._read_back(reserve=flight.output.program_width)
                    self.in_flight = launched
                    self._last_step = (follow, start)
                    return deltas
            deltas = self._read_back()
        with self.timer.phase("schedule"):
            batch = self.scheduler.schedule()
        if not batch.seqs:
            return deltas + self._read_back()
        self.timer.steps += 1
        self.timer.step_started()  # the first step starts the clock of the step kinds (phases.py)
        deltas += self._run(batch)
        # A step after which the engine may sit idle has no next start to time it by.
        self._last_step = (batch, start) if self.has_work() else None
        return deltas

    def _observe(self, now: float) -> None:
        """Reports the last step's cost: the time from its start to this one's, so the host work between
        calls (outputs, detokenization) counts too. Under overlap a call launches its step and reads the
        previous one back, so in a run of like steps this is one step's cost either way."""
        if self._last_step is None:
            return
        (batch, start), self._last_step = self._last_step, None
        kind = batch.kind
        if kind == "prompt":
            self.observer.observe_other_step()
        else:
            self.observer.observe_step(kind == "drafting", len(batch.seqs), now - start)

    def _run(self, batch: StepBatch) -> list[TokenDelta]:
        # Drafting (the drafter's, or a grammar's forced tokens) reads the tokens on the host, and penalties
        # read the request's tokens so far, which under overlap may end in a placeholder: each such step
        # waits for the one in flight. A grammar's masks need its state past the newest token, so a
        # constrained plain step samples only after the step in flight is read back (`_step_overlapped`);
        # where the scheduler gives forced spans it waits instead, as it finds a span only from a current
        # grammar, and a span saves whole steps where overlapping saves part of one.
        wait_for_grammar = envs.get().forced_drafts and self.scheduler.forced_spans
        if self.overlap and not any(s.num_draft_tokens or s.forced_token_ids or s.history is not None
                                    or (s.grammar is not None and wait_for_grammar) for s in batch.seqs):
            return self._step_overlapped(batch)
        deltas = self._read_back()
        batch = self._with_known_tokens(batch)
        if not batch.seqs:
            return deltas
        try:
            output = self.runner.launch(batch)
            if self.overlap and output.program_width:  # read back behind the step that follows it
                self.in_flight = self._program_flight(output, batch)
                return deltas
            sampled = output.tokens()
        except Exception as error:
            log.exception("step failed; retrying its requests one by one")
            self._after_failed_step(batch, error)
            return deltas + self._step_each_alone(batch)
        self.timer.step_read(batch.kind)
        with self.timer.phase("postprocess"):
            return deltas + self._postprocess(batch, sampled, logprobs=output.logprobs(), verified=output.verified)

    def time_phases(self, timer) -> None:
        """Times each step's phases into `timer` (a PhaseTimer), runner phases included. With overlap the
        timer must not synchronise (that would serialise host and device), so "wait" is the host's idle time."""
        if self.overlap:
            timer.sync = False
        self.timer = self.runner.timer = timer

    # -- overlap ----------------------------------------------------------
    def _step_overlapped(self, batch: StepBatch) -> list[TokenDelta]:
        try:
            launched = self._launch(batch)
        except Exception as error:
            log.exception("step failed; retrying its requests one by one")
            self._after_failed_step(batch, error)
            deltas = self._read_back()
            return deltas + self._step_each_alone(batch)
        deltas = self._read_back()
        launched.output.finish()  # constrained rows: their masks, now that the grammars have N's tokens
        self.in_flight = launched
        return deltas

    def _launch(self, batch: StepBatch) -> _InFlight:
        """Queues the step and advances its requests as if it were done, with a placeholder per new token."""
        output = self.runner.launch(batch, publish=True)
        placeholders = iter(output.placeholders or ())  # none when no sequence samples (prefill chunks)
        pending = []
        for seq in batch.seqs:
            request = self.scheduler.requests[seq.request_id]
            request.num_computed_tokens += len(seq.token_ids)
            _advance_drafter(request, seq)  # it extended over its catch-up (no drafts, or this would not overlap)
            if seq.sample:
                request.token_ids.append(next(placeholders))
                pending.append((request, request.num_tokens - 1))
        return _InFlight(output, pending, batch.kind)

    def _launch_program(self, batch: StepBatch) -> _InFlight | None:
        """Launches a step that follows the program step in flight; None if the runner could not (the next
        step then waits for the one in flight, as any other would)."""
        try:
            return self._program_flight(self.runner.launch(batch), batch)
        except Exception:
            log.exception("a following drafting step failed to launch; scheduling from exact state instead")
            self.scheduler.hold_gate_answer()
            return None

    def _program_flight(self, output, batch: StepBatch) -> _InFlight:
        requests = [self.scheduler.requests[s.request_id] for s in batch.seqs]
        return _InFlight(output, [], batch.kind, batch, requests)

    def _read_back(self, reserve: int = 0) -> list[TokenDelta]:
        """Reads the step in flight back and replaces its placeholders; stop conditions apply as usual.
        `reserve`: tokens past each request's known ones that a step launched since may write KV for."""
        self._known = {}  # placeholder ids are reused: only the last read-back's may be looked up
        if self.in_flight is None:
            return []
        flight, self.in_flight = self.in_flight, None
        with self.timer.phase("wait"):
            sampled = flight.output.tokens()
        self.timer.step_read(flight.kind)
        logprobs = flight.output.logprobs() or [None] * len(sampled)
        if flight.batch is not None:
            with self.timer.phase("postprocess"):
                return self._postprocess(flight.batch, sampled, flight.requests, reserve, logprobs)
        deltas = []
        with self.timer.phase("postprocess"):
            for (request, index), (token,), token_logprobs in zip(flight.placeholders, sampled, logprobs):
                if request.finished:
                    continue  # finished or aborted after this step was launched: its token is dropped
                self._known[request.token_ids[index]] = token
                request.token_ids[index] = token
                reason = _grammar_finish(request, token) or self._finish_reason(request, token, index + 1)
                if reason is not None:
                    del request.token_ids[index + 1:]  # the placeholder of a step launched since
                    self.scheduler.finish(request, reason)
                # Counted up to this token: a placeholder of the step in flight may follow it.
                deltas.append(_delta(request, [token], num_output_tokens=index + 1 - request.num_prompt_tokens,
                                     logprobs=token_logprobs))
        return deltas

    def _with_known_tokens(self, batch: StepBatch) -> StepBatch:
        """The batch with the placeholders just read back replaced by their tokens, and without requests
        that finished on them."""
        if not self._known:
            return batch
        known = lambda ids: [self._known.get(t, t) for t in ids]  # noqa: E731
        seqs = [replace(s, token_ids=known(s.token_ids), draft_catchup_ids=known(s.draft_catchup_ids))
                for s in batch.seqs if s.request_id in self.scheduler.requests]
        self._known = {}
        return StepBatch(seqs, batch.page_size)

    def stats(self) -> EngineStats:
        s = self.scheduler
        kv = self.runner.kv_cache
        cache = s.prefix_cache
        return EngineStats(len(s.running), len(s.waiting), s.allocator.num_used, s.allocator.num_pages,
                           s.num_preemptions, s.draft_plan is not None and s.drafting_allowed,
                           kv[:, :, 0].numel() * kv.element_size(),
                           cache.queried_tokens if cache else 0, cache.hit_tokens if cache else 0,
                           s.allocator.num_cached, self._dense_bytes_per_token)

    def _postprocess(self, batch: StepBatch, sampled: list[list[int]], requests: list[Request] | None = None,
                     reserve: int = 0, logprobs: list[list[TokenLogprob] | None] | None = None,
                     verified: list[tuple[int, int] | None] | None = None) -> list[TokenDelta]:
        """`requests`: the batch's, for a step read back late (any may have finished since: their tokens are
        dropped); `reserve` as in `_read_back`; `logprobs`: per sampling sequence, its tokens' (or None);
        `verified`: per sampling sequence, the (drafts, depth) its tree kept (StepOutput.verified), if known."""
        deltas = []
        results = iter(sampled)
        token_logprobs = iter(logprobs or [None] * len(sampled))
        shapes = iter(verified or [None] * len(sampled))
        for i, seq in enumerate(batch.seqs):
            request = self.scheduler.requests[seq.request_id] if requests is None else requests[i]
            if request.finished:
                if seq.sample:
                    next(results)
                    next(token_logprobs)
                    next(shapes)
                continue
            if batch.follow is not None:  # the step's root was the host's newest known token
                request.num_draft_computed_tokens = request.num_computed_tokens + 1
            else:
                _advance_drafter(request, seq)
            if not seq.sample:
                request.num_computed_tokens += len(seq.token_ids)
                continue
            tokens, rows, shape = next(results), next(token_logprobs), next(shapes)
            accepted_drafts = len(tokens) - 1
            # KV is kept for the step's own tokens and the accepted drafts; the bonus token has none yet.
            request.num_computed_tokens += len(seq.token_ids) + accepted_drafts
            emitted = self._append_until_finished(request, tokens)
            # Counted from what is emitted: a stop inside the accepted run ends the step there, and the
            # drafts and bonus token after it are not output (with a stop, it takes the bonus token's place).
            emitted_drafts = len(emitted) - 1
            # Grammar-forced drafts count as drafts (a step that verifies them is a speculative step, with or
            # without a drafter); the plan learns only from the drafter's own, which follow them in the chain.
            forced = len(seq.forced_token_ids)
            drafted = seq.num_draft_tokens + forced
            # What pruning left of the drafter's tree: drafts it cut were never verified, and its depths past
            # the tree's were never reached, so neither counts as a rejection.
            depth = None
            if shape is not None:
                drafted, depth = min(drafted, shape[0]), shape[1] - forced
            if drafted:
                request.num_spec_steps += 1
                request.num_drafted_tokens += drafted
                request.num_accepted_tokens += emitted_drafts
            if seq.num_draft_tokens and self.observer is not None and accepted_drafts >= forced:
                # how well the drafter guesses, stop or not
                self.observer.observe_acceptance(request, seq.num_draft_tokens, accepted_drafts - forced, depth)
            if not request.finished:
                self.scheduler.trim(request, reserve)
            spec = (drafted, emitted_drafts) if drafted else (0, None)
            deltas.append(_delta(request, emitted, *spec, logprobs=rows[: len(emitted)] if rows else None))
        return deltas

    def _append_until_finished(self, request: Request, tokens: list[int]) -> list[int]:
        """Stop conditions apply inside an accepted run: nothing after a stop is ever emitted."""
        for i, token in enumerate(tokens):
            request.token_ids.append(token)
            reason = _grammar_finish(request, token) or self._finish_reason(request, token, request.num_tokens)
            if reason is not None:
                self.scheduler.finish(request, reason)
                return tokens[: i + 1]
        return tokens

    def _after_failed_step(self, batch: StepBatch, error: Exception) -> None:
        """A step that ran out of device memory while computing prompts: later steps take fewer prompt tokens
        (halved each time it happens), so the next wave of prompts does not fail again and fall back to one
        request at a time."""
        if not isinstance(error, torch.OutOfMemoryError):
            return
        prompt_tokens = sum(len(seq.token_ids) for seq in batch.seqs if len(seq.token_ids) > 1)
        cap = self.scheduler.cap_prompt_tokens(prompt_tokens)
        if cap is not None:
            log.warning("a step of %d prompt tokens ran out of device memory: steps take at most %d from now on",
                        prompt_tokens, cap)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _step_each_alone(self, batch: StepBatch) -> list[TokenDelta]:
        # A failure is pinned to the request that causes it; the others carry on as if nothing happened.
        deltas = []
        for seq in batch.seqs:
            if seq.request_id not in self.scheduler.requests:
                continue  # finished while the step was read back
            alone = StepBatch([seq], batch.page_size)
            try:
                output = self.runner.launch(alone)
                sampled = output.tokens()
            except Exception:
                log.exception("request %s failed", seq.request_id)
                request = self.scheduler.requests[seq.request_id]
                self.scheduler.finish(request, FinishReason.ERROR)
                deltas.append(_delta(request, []))
                continue
            deltas.extend(self._postprocess(alone, sampled, logprobs=output.logprobs(), verified=output.verified))
        return deltas

    def _finish_reason(self, request: Request, token: int, num_tokens: int) -> FinishReason | None:
        """Whether `token`, the request's `num_tokens`-th, ends it (counted by position: with overlap, a
        placeholder may already follow it)."""
        params = request.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if num_tokens - request.num_prompt_tokens >= request.max_tokens or num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def _grammar_finish(request: Request, token: int) -> FinishReason | None:
    """Advances a constrained request's grammar over an emitted token: STOP once the grammar has ended (it
    accepted a stop token, which ends the request even under ignore_eos), ERROR if it forbids the token (masks
    make that impossible unless something bypassed them)."""
    if request.grammar is None:
        return None
    if not request.grammar.accept(token):
        log.error("request %s: its grammar forbids emitted token %d", request.request_id, token)
        return FinishReason.ERROR
    return FinishReason.STOP if request.grammar.terminated else None


def _advance_drafter(request: Request, seq: ScheduledSeq) -> None:
    """The drafter's KV now covers the step's catch-up tokens. Drafters keep KV only for what they were given:
    KV of draft nodes is thrown away, and accepted drafts are caught up on with the true inputs next time."""
    if seq.draft_catchup_ids:
        request.num_draft_computed_tokens = seq.draft_start_pos + len(seq.draft_catchup_ids)


def _delta(request: Request, new_tokens: list[int], step_drafted: int = 0, step_accepted: int | None = None,
           num_output_tokens: int | None = None, logprobs: list[TokenLogprob] | None = None) -> TokenDelta:
    reason = request.finish_reason.value if request.finish_reason is not None else None
    outputs = request.num_output_tokens if num_output_tokens is None else num_output_tokens
    return TokenDelta(
        request.request_id, new_tokens, reason, request.num_prompt_tokens, outputs,
        step_drafted, step_accepted, request.num_drafted_tokens, request.num_accepted_tokens, logprobs,
        request.num_cached_tokens,
    )
