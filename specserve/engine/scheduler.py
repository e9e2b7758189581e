"""Continuous batching with chunked prefill and preemption by recompute. Pure Python, no torch.

Each step the scheduler fills a token budget: running requests first (oldest first), then waiting requests.
For each request it schedules the gap between known and computed tokens, capped by the remaining budget,
and allocates pages for exactly the tokens that step computes. If pages run out, the newest running
request is preempted: its pages are freed and it returns to the front of the queue to be recomputed.

With a prefix cache (kv/prefix.py), full pages that the target and the drafter have both computed are indexed as
they fill, and an admitted request starts from the longest cached run of pages that its tokens match: those
pages are shared, and it computes only the rest, always at least its last token, in pages of its own. Nothing
is ever written below a request's computed tokens (nor below the drafter's, less its lead), so shared pages stay
read-only without copying.
"""
from __future__ import annotations

import itertools
from collections import deque
from typing import Callable

from specserve import envs
from specserve.config import SchedulerConfig
from specserve.core import FinishReason, Request, ScheduledSeq, Status, StepBatch, draw_seed
from specserve.kv.pages import PageAllocator
from specserve.kv.prefix import ROOT, PrefixCache

# The most grammar-forced tokens one request verifies in a step: each is one more target row and one more mask
# filled on the host (finding it, and again in verification), and a span this long covers a schema's keys and
# punctuation between two values; a longer one takes the next step for the rest.
MAX_FORCED_TOKENS = 16


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        max_model_len: int,
        draft_plan: Callable[[Request], int] | None = None,
        max_draft_tokens: int = 0,
        draft_gate: Callable[[list[Request]], bool] | None = None,
        follow_gate: Callable[[list[Request]], bool] | None = None,
        prefix_cache: PrefixCache | None = None,
        draft_lead: int = 0,
        draft_prune: Callable[[Request], float] | None = None,
        forced_spans: bool = True,
    ) -> None:
        self.config = config
        self.prefix_cache = prefix_cache
        # How far the drafter's computed tokens must run past a page for its draft KV there to be valid: an
        # EAGLE-3 head's KV at position p reads token p + 1 (Drafter.shift); a draft model's reads token p.
        self.draft_lead = draft_lead
        # How many tokens to draft for a decoding request this step (at most max_draft_tokens, what the
        # proposer was sized for); None: never speculate.
        self.draft_plan = draft_plan
        # Whether a step of only decoding requests drafts at all (speculative/plan.py); None: whenever it can.
        self.draft_gate = draft_gate
        self._gate_open = True  # its last answer
        self._gate_answered = False  # asked already this step (by `follow`)
        # Whether drafting would pay for a batch, asked in steps with prompts: their chunks are worth following
        # only if the batch they join is to draft (speculative/plan.py); None: the gate's last answer decides.
        self.follow_gate = follow_gate
        self.max_draft_tokens = max_draft_tokens
        # The draft probability a drafting request's tree nodes need to be verified (speculative/plan.py);
        # None: no pruning.
        self.draft_prune = draft_prune
        # Whether a request may verify its grammar's forced span. A span sends its step to the general path (an
        # eager forward); where steps replay CUDA graphs (plain steps, and the step programs, which take rows
        # under a grammar), that forward costs more than the tokens the span saves.
        self.forced_spans = forced_spans
        self.allocator = allocator
        self.max_model_len = max_model_len
        # Prompt tokens a step may compute, below the budget after a prompt step ran out of device memory
        # (`cap_prompt_tokens`); None: the budget alone.
        self.prompt_token_cap: int | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        if request.num_tokens + request.max_tokens > self.max_model_len:
            raise ValueError("prompt plus max_tokens exceeds the context length")
        if self.allocator.pages_for(request.num_tokens + request.max_tokens) > self.allocator.num_pages:
            raise ValueError("request can never fit in the KV pool")
        request.arrival_index = self._arrivals
        self._arrivals += 1
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        if request.finished:
            return
        if request.status is Status.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if reason is not FinishReason.ERROR:  # a failed step may have left its KV unwritten
            self._index_pages(request)
        self._release(request)
        request.grammar = None  # its matcher's memory goes back with the pages
        request.status = Status.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, FinishReason.ABORT)
        return request

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------
    def schedule(self) -> StepBatch:
        """With speculation configured, a step drafts only when no prompt work is pending, so a drafting step
        holds decoding requests alone (the shape the chain and tree programs and their CUDA graphs take). While prompts
        are pending, decoding requests still join every step, without drafts: they never wait on prompts. A
        draft gate (the adaptive plan) may keep a step from drafting; while it does, drafters stay behind."""
        drafting = False
        prompts_pending = self.draft_plan is not None and self._prompt_work_pending()
        if self.draft_plan is not None and not prompts_pending:
            # A drafter left behind while the gate was shut catches up in the next step that drafts for it.
            drafting = self._gate_opens()
        for request in self.running:
            self._index_pages(request)
        budget = self.config.chunked_prefill_size
        prompt_budget = budget if self.prompt_token_cap is None else self.prompt_token_cap
        scheduled: list[tuple[Request, int, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._awaits_last_token(request) or (request.num_uncomputed_tokens > 1 and prompt_budget <= 0):
                index += 1
                continue
            count = min(request.num_uncomputed_tokens, budget)
            if count > 1:  # a prompt's chunk
                count = min(count, prompt_budget)
                prompt_budget -= count
            drafts = self._num_drafts(request, count, budget) if drafting else 0
            forced = self._forced_span(request, count, budget) if self.forced_spans else []
            drafts = max(0, drafts - len(forced))  # the drafter drafts on past them, within its budget
            if not self._make_room(request, count + drafts + len(forced)):
                preempted = True
                break  # `request` itself was preempted; everything after it is gone too.
            scheduled.append((request, count, drafts, forced))
            budget -= count + drafts + len(forced)
            index += 1
        # Admitting while evicting would thrash, so new work waits for a step without preemption; and for one
        # without drafts, so that a drafting step holds decoding requests alone.
        while self.waiting and min(budget, prompt_budget) > 0 and not preempted and not drafting:
            if len(self.running) >= self.config.max_running_requests:
                break
            request = self.waiting[0]
            hit = self._reuse_prefix(request)
            count = min(request.num_uncomputed_tokens, budget, prompt_budget)
            if not self._grow(request, count):
                self._release(request)  # the shared prefix too: it is matched again next time
                request.num_computed_tokens = request.num_draft_computed_tokens = 0
                break
            self._record_hit(request, hit)
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            scheduled.append((request, count, 0, []))
            budget -= count
            prompt_budget -= count
        # Drafters follow along only while drafting pays: otherwise they stay behind, and most requests finish
        # before it pays again.
        extend = self.draft_plan is not None and not drafting and self._follows(prompts_pending)
        self._gate_answered = False
        return StepBatch([self._describe(r, n, d, extend, f) for r, n, d, f in scheduled], self.allocator.page_size)

    def cap_prompt_tokens(self, failed_prompt_tokens: int) -> int | None:
        """A step that computed `failed_prompt_tokens` prompt tokens ran out of device memory: later steps take
        at most half as many (not below a page's worth), so a wave's prompts do not fail again. Returns the new
        cap, or None where it cannot go lower."""
        cap = max(self.allocator.page_size, failed_prompt_tokens // 2)
        if failed_prompt_tokens <= self.allocator.page_size or (
                self.prompt_token_cap is not None and self.prompt_token_cap <= cap):
            return None
        self.prompt_token_cap = cap
        return cap

    def follow(self, previous: StepBatch, width: int) -> StepBatch | None:
        """The next drafting step for the requests of `previous`, a drafting program step still in flight (each
        adds at most `width` tokens to a request and writes KV up to width - 1 positions past its root), built
        before it is read back. The host knows each request up to that step's root (num_computed_tokens), so
        the next root is at most `width` further, and its KV ends `2 * width` tokens past the known ones: pages
        are reserved for that. None when the next step must be scheduled from exact state instead: prompt work
        pending, the gate shut, a request the plan would not draft for in full, a row of `previous` whose head
        did not catch up to its root (it drafted nothing: the device would skip what it missed), a request
        `previous` left out, one near its max_tokens or the context end (its last steps run synchronously), one
        under a grammar, the budget or pages short."""
        if self.draft_plan is None or self._prompt_work_pending():
            return None
        if max(s.num_draft_tokens for s in previous.seqs) < self.max_draft_tokens:
            return None  # `previous` took a shorter shape than the configured one (a draft plan's choice)
        if any(s.draft_start_pos + len(s.draft_catchup_ids) != s.start_pos + 1 for s in previous.seqs):
            return None
        rows = [(row, self.requests.get(s.request_id)) for row, s in enumerate(previous.seqs)]
        rows = [(row, r) for row, r in rows if r is not None and r.status is Status.RUNNING]
        if any(r.grammar is not None for _, r in rows):
            return None  # a grammar's masks need its state after the step in flight
        reserve = 2 * width
        if (not rows or len(rows) != len(self.running)
                or len(rows) * (1 + self.max_draft_tokens) > self.config.chunked_prefill_size):
            return None
        for _, request in rows:
            if (request.max_tokens - request.num_output_tokens <= reserve
                    or request.num_computed_tokens + reserve > self.max_model_len):
                return None
        # The gate is asked once a step: if this step is scheduled after all, `schedule` takes its answer.
        opens, self._gate_answered = self._gate_opens(), True
        if not opens or any(self.draft_plan(r) < self.max_draft_tokens for _, r in rows):
            return None
        if not all(self._grow(request, reserve) for _, request in rows):
            return None
        self._gate_answered = False
        return StepBatch([self._describe_following(request, width) for _, request in rows],
                         self.allocator.page_size, follow=[row for row, _ in rows])

    def hold_gate_answer(self) -> None:
        """The gate was asked this step by a following step that was not launched after all: `schedule` takes
        that answer instead of asking again."""
        self._gate_answered = True

    def _describe_following(self, request: Request, width: int) -> ScheduledSeq:
        """A row whose inputs the device derives: the root at its upper bound, the newest known token standing
        in for the root and the head's catch-up (one row, ending at the root as a real step's does), all drafts
        scheduled."""
        root = request.num_computed_tokens + width
        last = request.token_ids[-1:]
        return ScheduledSeq(request.request_id, last, root, list(request.page_ids), request.params, sample=True,
                            sample_seed=None, num_draft_tokens=self.max_draft_tokens, draft_start_pos=root,
                            draft_catchup_ids=last)

    def _follows(self, prompts_pending: bool) -> bool:
        """Whether drafters follow this step. The gate's last answer was given for the last pure decode step's
        batch, which in a step with prompts may be long gone (the tail of the previous wave, small enough to
        draft, while the prompts make a batch too large to): so the follow gate is asked about the batch the
        prompts join, the running requests still to decode and as many waiting ones as the running limit
        leaves room for (by count: whether their pages fit is not asked)."""
        if self.follow_gate is None or not prompts_pending:
            return self._gate_open
        room = max(0, self.config.max_running_requests - len(self.running))
        return self.follow_gate(self._decoding() + list(itertools.islice(self.waiting, room)))

    def _prompt_work_pending(self) -> bool:
        """A running request still in its prompt, or a waiting one that could be admitted now."""
        if any(request.num_uncomputed_tokens > 1 for request in self.running):
            return True
        if not self.waiting or len(self.running) >= self.config.max_running_requests:
            return False
        first = self.waiting[0]
        count = min(first.num_uncomputed_tokens, self.config.chunked_prefill_size)
        return self.allocator.pages_for(count) <= self.allocator.num_free

    @property
    def drafting_allowed(self) -> bool:
        """The draft gate's last answer (always yes without a gate)."""
        return self._gate_open

    def _gate_opens(self) -> bool:
        """Asks the gate about the decoding requests (unless `follow` asked it this step); with none, there is
        nothing to ask and nothing to draft."""
        decoding = self._decoding()
        if self.draft_gate is not None and decoding and not self._gate_answered:
            self._gate_open = self.draft_gate(decoding)
        self._gate_answered = False
        return bool(decoding) and self._gate_open

    def _decoding(self) -> list[Request]:
        """The running requests that still need steps."""
        return [r for r in self.running if not self._awaits_last_token(r)]

    def _awaits_last_token(self, request: Request) -> bool:
        """With overlap, a request whose last allowed token is still being sampled needs no more steps."""
        return request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len

    def _num_drafts(self, request: Request, count: int, budget: int) -> int:
        """Draft only when decoding, and never past max_tokens, the context or the step's budget."""
        if self.draft_plan is None or count != request.num_uncomputed_tokens or count != 1:
            return 0
        room = min(
            self.max_draft_tokens,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens,
            budget - count,
        )
        return max(0, min(self.draft_plan(request), room))

    def _forced_span(self, request: Request, count: int, budget: int) -> list[int]:
        """The tokens a decoding request's grammar forces next (GrammarState.forced_tokens), to verify this step
        as the first drafts of its chain, with or without a drafter; never past max_tokens, the context or the
        step's budget. None while the newest token is a placeholder (negative: a plain step overlapped under
        overlap scheduling is still sampling it), which the grammar has not seen yet."""
        if (request.grammar is None or count != 1 or request.num_uncomputed_tokens != 1
                or request.token_ids[-1] < 0):
            return []
        room = min(MAX_FORCED_TOKENS, request.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens, budget - count)
        if room < 1 or not envs.get().forced_drafts:
            return []
        return request.grammar.forced_tokens(room)

    def trim(self, request: Request, reserve: int = 0) -> None:
        """Frees pages past the computed tokens (and `reserve` more: the KV a step in flight may write):
        slots of rejected drafts come back at once."""
        keep = self.allocator.pages_for(request.num_computed_tokens + reserve)
        if len(request.page_ids) > keep:
            self.allocator.free(request.request_id, request.page_ids[keep:])
            del request.page_ids[keep:]

    def _make_room(self, request: Request, count: int) -> bool:
        """Grow `request` by `count` tokens, preempting the newest running requests as needed."""
        while not self._grow(request, count):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _grow(self, request: Request, count: int) -> bool:
        needed = self.allocator.pages_for(request.num_computed_tokens + count) - len(request.page_ids)
        if needed <= 0:
            return True
        if needed > self.allocator.num_free:
            return False
        request.page_ids.extend(self.allocator.allocate(request.request_id, needed))
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._index_pages(request)  # recomputing it will hit them, unless they are evicted first
        self._release(request)
        request.num_computed_tokens = 0
        request.num_draft_computed_tokens = 0
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.allocator.free(request.request_id, request.page_ids)
        request.page_ids = []
        request.num_indexed_pages = request.num_drafted_pages = 0

    # -- prefix caching ---------------------------------------------------
    def _reuse_prefix(self, request: Request) -> int:
        """Starts `request` from the cached pages its tokens match, shared: the target's KV and taps there are
        valid for it (each page is keyed by the token after it too), and the drafter's KV over the leading pages
        marked drafted. Returns the tokens served from the cache."""
        if self.prefix_cache is None or request.page_ids:
            return 0
        pages = self.prefix_cache.match(request.token_ids[:self._real_tokens(request)])
        if not pages:
            return 0
        self.allocator.share(request.request_id, pages)
        size = self.allocator.page_size
        hit = len(pages) * size
        request.page_ids = list(pages)
        request.num_indexed_pages = len(pages)
        request.num_computed_tokens = hit
        # An EAGLE-3 head has seen the token after each drafted page (the lead); past them, it catches up.
        request.num_drafted_pages = self.prefix_cache.drafted_prefix(pages)
        request.num_draft_computed_tokens = request.num_drafted_pages * size + self.draft_lead
        return hit

    def _record_hit(self, request: Request, hit: int) -> None:
        if self.prefix_cache is None:
            return
        self.prefix_cache.record(request.num_tokens, hit)
        if request.num_preemptions == 0:
            request.num_cached_tokens = hit

    def _index_pages(self, request: Request) -> None:
        """Indexes the request's pages that are full and final: the target has computed all of a page and the
        token after it is known (not a placeholder of a step in flight). Where speculation is configured, marks
        those the drafter has computed too (with its lead) as drafted: a page computed while the drafter stayed
        behind is served all the same, and its hits catch the drafter up over it."""
        if self.prefix_cache is None:
            return
        size = self.allocator.page_size
        end = min(request.num_computed_tokens, self._real_tokens(request) - 1)
        for k in range(request.num_indexed_pages, min(end // size, len(request.page_ids))):
            parent = request.page_ids[k - 1] if k else ROOT
            own = request.page_ids[k]
            held = self.prefix_cache.insert(parent, request.token_ids[k * size:(k + 1) * size + 1], own)
            if held != own:
                # Another request computed the same page first: take its copy, so that this request's later
                # pages hang on a page it holds. Its own copy is free once a step in flight has read it: the
                # steps after that one run behind it.
                self.allocator.share(request.request_id, [held])
                self.allocator.free(request.request_id, [own])
                request.page_ids[k] = held
                if self.draft_plan is not None and not self.prefix_cache.is_drafted(held):
                    self._draft_from(request, k)  # the copy taken has no draft KV
            request.num_indexed_pages = k + 1
        if self.draft_plan is not None:
            drafted = min((request.num_draft_computed_tokens - self.draft_lead) // size, request.num_indexed_pages)
            for k in range(request.num_drafted_pages, drafted):
                self.prefix_cache.mark_drafted(request.page_ids[k])
            request.num_drafted_pages = max(request.num_drafted_pages, drafted)

    def _draft_from(self, request: Request, page: int) -> None:
        """The drafter's KV of `request` holds only before page `page`: it catches up from there."""
        size = self.allocator.page_size
        request.num_draft_computed_tokens = min(request.num_draft_computed_tokens, page * size + self.draft_lead)
        request.num_drafted_pages = min(request.num_drafted_pages, page)

    @staticmethod
    def _real_tokens(request: Request) -> int:
        """Tokens known for sure: under overlap the newest output may still be a placeholder."""
        return request.num_tokens - 1 if request.num_output_tokens else request.num_tokens

    def _describe(self, request: Request, count: int, drafts: int, extend: bool,
                  forced: list[int] | None = None) -> ScheduledSeq:
        start = request.num_computed_tokens
        sample = start + count == request.num_tokens
        seed = request.params.seed
        # What the drafter catches up on: everything up to the root when it drafts. While drafting pays
        # (`extend`: the gate's last answer, or in steps with prompts the follow gate's), also prompt chunks in
        # the step that computes them, and in a step held back from drafting by pending prompts, decoding
        # requests' known tokens (all but the newest, which under overlap may still be a placeholder), so the
        # next drafting step has at most the two newest to catch up on. Otherwise nothing: speculation that
        # does not pay costs nothing, and the next step that drafts for a request catches up on all it missed.
        catch_up_end = request.num_draft_computed_tokens
        if self.draft_plan is not None and (drafts > 0 or count > 1 and extend):
            catch_up_end = start + count
        elif extend:
            catch_up_end = start
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.token_ids[start:start + count],
            start_pos=start,
            page_ids=list(request.page_ids),
            params=request.params,
            sample=sample,
            sample_seed=None if seed is None else draw_seed(seed, request.num_output_tokens),
            output_index=request.num_output_tokens,
            num_draft_tokens=drafts,
            draft_min_prob=self.draft_prune(request) if drafts and self.draft_prune is not None else 0.0,
            draft_start_pos=request.num_draft_computed_tokens,
            draft_catchup_ids=request.token_ids[request.num_draft_computed_tokens:catch_up_end],
            history=request.token_ids if sample and request.params.adjusts_logits else None,
            num_prompt_tokens=request.num_prompt_tokens,
            grammar=request.grammar if sample else None,
            forced_token_ids=forced or [],
        )
