"""When to draft: speculation that is never a loss, decided per step and per request. Pure Python.

A step that drafts costs more than a plain one and yields each request its acceptance length τ (accepted
drafts plus the bonus token) instead of one token. So a pure decode step of B requests drafts when

    (Σ τ_r over the requests that draft + one token for each that does not) / t_draft(B)  >  B / t_plain(B)

and a request drafts only while its own τ_r beats the step's break-even t_draft(B) / t_plain(B).

Costs are measured, not assumed: the engine reports every pure decode step's duration, by whether it
drafted and by batch-size bucket (powers of two). τ_r is the request's mean, drawn towards the recent
requests' mean while it has drafted little. Until both costs of a bucket are known, the plan measures them,
drafting first, unless a smaller bucket's costs already show drafting losing for these requests: the
larger bucket then borrows that break-even until probes have timed two of its drafting steps (a drafting
step's cost grows faster with the batch than a plain one's, so the break-even does not fall).
The side not in use goes stale, so now and then the other runs for at least `probe_len` steps, until one of
them is timed: the first step after a switch is not, since it also paid for the switch (under overlap
scheduling it waited for the step in flight). Probes come every `probe_every` steps of one side at least,
and as much less often as keeps their measured cost under `probe_budget` of the time: the time the losing
side gives up in `probe_len` + 1 steps, and the switch back to drafting that either probe brings about.
While the gate is shut the draft head follows no decode step; in steps with prompts it follows their chunks
only if drafting pays for the batch they join (`drafting_pays`, whatever the gate's last answer, which was
for the last decode step's batch, at the end of a wave a small one). The first drafting step catches it up on
all its requests missed (prompts included): its time beyond a drafting step's and the plain step before it (under
overlap scheduling it waits for that one) is measured per bucket and taken as the next probe's (before
that, a smaller bucket's, scaled by the batch). It grows
with the spell until the spell outlasts the requests, so after a cheap first probe of drafting the spacing
grows too, up to `max_probe_every`; a probe of plain decode, a short spell, is charged its catch-up all the
same.
A request held back from drafting is due to draft again after `probe_every` pure decode steps without
drafts (whether or not the step drafted): the gate then counts it at the recent requests' mean, so a lone
request that started badly is re-tried, while one due request among many does not open the gate alone.

Shapes (`--speculative-policy goodput`): besides the configured shape, chains of fewer drafts (`chains`) and
smaller trees (`trees`, SpecConfig.tree_sizes). A shape is named by its drafts: chains have 1..K, trees more.
A drafting step takes the shape with the most tokens per second: each request's expected tokens from a shape
of depth D, 1 + Σ_{i<=D} Π_{j<=i} p_j, with p_j its acceptance at depth j given it reached depth j - 1 (its
own counts for that shape's kind, drawn towards the recent requests' per depth: one set for all chains, whose
draft at a depth is the same token whatever their length, and one per tree size, whose width at each depth
differs), over the shape's measured step cost. A shape not yet measured in a bucket is estimated from the
plain step and the shapes measured there, as if a step's cost beyond a plain one's grew with its verified
rows, or on a MoE target with the weight bytes they read (`ExpertReads`): optimistic for short chains, so they
get tried, and their first two timed steps correct it. Each request then drafts the fewest of a chain's drafts
that keep all but a twentieth of a token it expects from them: a shorter row costs nothing less in the step,
but takes fewer KV pages. A tree is shrunk per request by its draft scores instead (`draft_min_prob`): where
the general search builds it, nodes whose path probability is below what a verify row costs in tokens are
pruned, as EAGLE-2 ranks nodes by that probability.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specserve.config import ModelConfig
from specserve.core import Request


@dataclass(frozen=True)
class AdaptiveConfig:
    probe_every: int = 64  # steps of one side at least before the other is measured again
    probe_budget: float = 0.01  # the share of time probes may cost, which spaces them out further
    max_probe_every: int = 2048  # but a losing side is measured again after this many steps at the latest
    probe_len: int = 2  # steps a probe lasts at least; the first after a switch is never timed
    window: int = 9  # step times kept per side and bucket; the cost is their lower median
    smoothing: float = 0.025  # weight of a new acceptance length in the recent requests' mean
    prior_steps: float = 8.0  # a request's acceptance counts as this many steps at the recent mean, plus its own

    def __post_init__(self) -> None:
        if self.probe_len < 2:
            raise ValueError("a probe must last at least two steps: the first after a switch is not timed")


@dataclass(frozen=True)
class ExpertReads:
    """What a MoE target reads per step, for estimating an unmeasured shape's cost: its routed experts'
    weights, read once per distinct expert a step's rows touch, and the rest, read once per step."""

    num_experts: int
    top_k: int
    expert_params: int  # one expert's weights, summed over the MoE layers
    other_params: int  # every other weight a step reads (attention, dense MLPs, shared experts, the LM head)

    def distinct(self, rows: int) -> float:
        """Expected distinct experts a layer's `rows` tokens touch, as if each picked top_k of them at random."""
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** rows)

    def effective_rows(self, rows: int, batch: int) -> float:
        """A step of `rows` rows over `batch` sequences, in plain rows of the same cost: the routed experts'
        share of what a plain step reads grows with the distinct experts, the rest with the rows (as for a
        dense target). Equals `batch` for a plain step."""
        routed = self.routed_share(batch)
        return (1.0 - routed) * rows + routed * batch * self.distinct(rows) / self.distinct(batch)

    def routed_share(self, batch: int) -> float:
        """The routed experts' share of the weights a plain step of `batch` rows reads."""
        experts = self.distinct(batch) * self.expert_params
        return experts / (experts + self.other_params)


def expert_reads(cfg: ModelConfig) -> ExpertReads | None:
    """A MoE target's ExpertReads from its config (Qwen-MoE's and DeepSeek-V3's names, read in config.py);
    None for a dense one. Parameter counts stand in for bytes: every weight has the model's dtype."""
    moe = cfg.moe
    if moe is None:
        return None
    hidden, layers, sparse = cfg.hidden_size, cfg.num_layers, len(moe.sparse_layers)
    attention = hidden * cfg.head_dim * 2 * (cfg.num_heads + cfg.num_kv_heads)
    dense_mlp = 3 * hidden * cfg.intermediate_size * (layers - sparse)
    shared = 3 * hidden * moe.intermediate_size * moe.num_shared_experts * sparse
    expert = 3 * hidden * moe.intermediate_size * sparse
    return ExpertReads(moe.num_experts, moe.top_k, expert,
                       attention * layers + dense_mlp + shared + cfg.vocab_size * hidden)


def bucket(batch_size: int) -> int:
    """Batch sizes whose steps cost about the same: the next power of two."""
    return 1 << max(0, batch_size - 1).bit_length()


class AdaptivePlan:
    """The scheduler asks `step_drafts` once per pure decode step, then `num_drafts` per request, and
    `drafting_pays` in steps with prompts; the engine reports step times to `observe_step` and verdicts to
    `observe_acceptance`."""

    def __init__(self, max_drafts: int, config: AdaptiveConfig = AdaptiveConfig(), chains: tuple[int, ...] = (),
                 depth: int | None = None, trees: tuple[tuple[int, int], ...] = (),
                 experts: ExpertReads | None = None) -> None:
        self.max_drafts = max_drafts
        self.config = config
        # Chain depths a drafting step may take besides the configured shape (none: on or off only).
        self.chains = tuple(sorted(d for d in chains if d < max_drafts))
        self.depth = depth or max_drafts  # of the configured shape: a chain's drafts, a tree's steps
        # Tree sizes, drafts -> search levels: the configured tree (if it is one) and smaller ones.
        self.trees = dict(trees)
        if self.depth != max_drafts:
            self.trees.setdefault(max_drafts, self.depth)
        self.experts = experts  # a MoE target's weight reads, for cost estimates
        self.choosing = bool(self.chains) or len(self.trees) > 1  # among shapes, or on and off only
        self.shape = max_drafts  # the drafts of the shape this step takes
        self.position_accept = [0.7] * self.depth  # the recent requests' acceptance at each position, optimistic
        # The same per tree size and depth: a tree holds more than a chain's one draft at a depth.
        self.tree_accept = {drafts: [0.8] * levels for drafts, levels in self.trees.items()}
        self.min_prob = 0.0  # the draft probability a tree node needs this step to pay for its verify row
        self.shape_cost: dict[tuple[int, int], float] = {}  # (drafts, bucket) -> seconds per step
        self._shape_times: dict[tuple[int, int], deque[float]] = {}
        self._last_shape: tuple[int, int] | None = None  # the shape and bucket of the last drafting step observed
        # Optimistic until measured, so that drafting is tried: half the drafts accepted.
        self.mean_accept_len = 1.0 + max_drafts / 2
        self.cost: dict[tuple[bool, int], float] = {}  # (drafts, bucket) -> seconds per step
        self._times: dict[tuple[bool, int], deque[float]] = {}  # the latest step times, per key
        self._samples: dict[tuple[bool, int], int] = {}  # step times kept, per key
        # bucket -> the side its last steps took, how many in a row, and that side's samples when it began.
        self._side: dict[int, tuple[bool, int, int]] = {}
        self._planned: tuple[bool, int] | None = None  # the step planned last, until it is observed
        self._observed: tuple[bool, int] | None = None  # the last step observed, if it went as planned
        self._streak = 0  # planned steps in a row with the same side and bucket, the last one included
        # bucket -> seconds the last drafting step right after a plain one took beyond a drafting step and
        # the plain one it waited for (the head's catch-up on the spell)
        self.switch_cost: dict[int, float] = {}
        self._switch_seen: dict[int, tuple[float, float]] = {}  # bucket -> (switch step's time, plain cost then)
        self.break_even = 0.0  # t_draft / t_plain for this step's requests (0: every request drafts)
        self._expected_tokens: dict[tuple[int, int], float] = {}  # (request id, shape) -> `_tokens`, until `_forget`

    # -- planning ---------------------------------------------------------
    def step_drafts(self, requests: list[Request]) -> bool:
        """Whether this pure decode step over `requests` drafts."""
        self._forget()
        for request in requests:
            request.steps_since_drafting += 1
        size = bucket(len(requests))
        draft, plain = self.cost.get((True, size)), self.cost.get((False, size))
        borrowed = self._borrowed_break_even(requests, size)
        if borrowed is not None and not self._unmeasured(False, size):
            draft = borrowed * plain  # until probes have measured drafting here
        # A step that drafts to measure (not because it pays) lets every request draft (break-even 0):
        # otherwise requests below the break-even would draft nothing, and nothing would be measured.
        self.break_even = self.min_prob = 0.0
        self.shape = self.max_drafts
        if self._unmeasured(False, size) or (self._unmeasured(True, size) and borrowed is None):
            # Measure what is missing: drafting first, unless a smaller batch already showed that it loses.
            choice = self._unmeasured(True, size) and borrowed is None
        else:
            if self.choosing and borrowed is None:
                self.shape, draft = self._best_shape(requests, size, plain)
            gain = self._gain(requests, draft / plain)
            choice = self._probe(size, gain > 1, self._probe_interval(gain, draft, plain, size))
            if choice and gain > 1:
                self.break_even = draft / plain
                self.min_prob = self._row_price(requests, draft, plain)
        last, run, since = self._side.get(size, (None, 0, 0))
        if last != choice:
            run, since = 0, self._samples.get((choice, size), 0)
        self._side[size] = (choice, run + 1, since)
        key = (choice, size)
        self._streak = self._streak + 1 if self._observed == key else 1
        self._planned = key
        return choice

    def drafting_pays(self, requests: list[Request]) -> bool:
        """Whether a step drafting for `requests` would pay by what is measured now; plans nothing. Where a
        side of the bucket is unmeasured it counts as paying (the plan measures both before it settles, and
        measuring drafting needs the head caught up), unless a smaller bucket shows that drafting loses. The
        scheduler asks this in steps with prompts: the draft head follows their chunks only if the batch they
        join is to draft."""
        if not requests:
            return False
        self._forget()
        size = bucket(len(requests))
        if self._borrowed_break_even(requests, size) is not None:
            return False
        if self._unmeasured(True, size) or self._unmeasured(False, size):
            return True
        return self._gain(requests, self._measured_break_even(size)) > 1

    def _borrowed_break_even(self, requests: list[Request], size: int) -> float | None:
        """While drafting is unmeasured in this bucket: the break-even of the largest smaller bucket with both
        costs measured, if drafting loses there for these requests. A drafting step's cost grows with its
        rows faster than a plain step's, so the break-even does not fall as the batch grows, and measuring
        drafting at a load where it surely loses costs several of its slowest steps, a visible share of a
        short run at high concurrency."""
        if not self._unmeasured(True, size):
            return None
        known = [b for (drafted, b) in self.cost
                 if drafted and b < size and not self._unmeasured(True, b) and not self._unmeasured(False, b)]
        if not known:
            return None
        break_even = self._measured_break_even(max(known))
        return break_even if self._gain(requests, break_even) <= 1 else None

    def _measured_break_even(self, size: int) -> float:
        return self.cost[(True, size)] / self.cost[(False, size)]

    def _unmeasured(self, drafted: bool, size: int) -> bool:
        """Fewer than two step times: the lower median of two cannot be one outlier."""
        return self._samples.get((drafted, size), 0) < 2

    def num_drafts(self, request: Request) -> int:
        """A request drafts while it gains on its own, and now and then to learn whether it would again."""
        if self._tokens(request, self.shape) > self.break_even or self._due(request):
            return self._request_drafts(request)
        return 0

    def draft_min_prob(self, request: Request) -> float:
        """The draft probability below which the request's tree nodes are pruned this step (0: none). Taken
        as the chance that the node is accepted, as EAGLE-2 does: a head's confidence follows its acceptance
        closely. Chains are shortened per request by their counts instead (`num_drafts`)."""
        return self.min_prob if self.choosing and self._is_tree(self.shape) else 0.0

    def _row_price(self, requests: list[Request], draft: float, plain: float) -> float:
        """What a verify row costs in tokens of this step: the step's cost beyond a plain one, spread over its
        draft rows, over the time the step takes per token it is expected to yield. A node is worth its row
        when its chance of being accepted is at least this."""
        rows = len(requests) * self.shape
        tokens = sum(max(self._tokens(r, self.shape), 1.0) for r in requests)
        return min(1.0, max(draft - plain, 0.0) / rows * tokens / draft)

    def _request_drafts(self, request: Request) -> int:
        """The step's shape, or on a chain the fewest drafts that keep nearly all the tokens it expects."""
        if not self.choosing or self._is_tree(self.shape):
            return self.shape
        full = self._tokens(request, self.shape)
        return next(d for d in range(1, self.shape + 1) if self._tokens(request, d) >= full - 0.05)

    # -- shapes -------------------------------------------------------------
    def _tokens(self, request: Request, shape: int) -> float:
        """Expected tokens of a step of `shape` drafts for the request: by depth, where the plan picks among
        shapes; else the request's mean acceptance length. Kept until the counts change (`_forget`): a step's
        decision asks for each request and shape several times, and at a few hundred requests that is a
        visible share of a step's host time."""
        if not self.choosing:
            return self._accept_len(request)
        tokens = self._expected_tokens.get((request.request_id, shape))
        if tokens is not None:
            return tokens
        if self._is_tree(shape):
            reached, kept = request.tree_positions.get(shape, ((), ()))
            curve = self._curve(reached, kept, self.tree_accept[shape], self.trees[shape])
            self._expected_tokens[(request.request_id, shape)] = curve[-1]
            return curve[-1]
        # One pass gives every chain's: a chain's draft at a depth is the same token whatever its length.
        curve = self._curve(request.drafts_reached, request.drafts_kept, self.position_accept, self.depth)
        for depth in range(1, self.depth + 1):
            self._expected_tokens[(request.request_id, depth)] = curve[depth]
        return curve[shape]

    def _forget(self) -> None:
        """Drops the expected tokens kept: the counts or the recent means have moved, or a new step is decided."""
        self._expected_tokens.clear()

    def _is_tree(self, shape: int) -> bool:
        return shape in self.trees

    def _curve(self, reached, kept, recent: list[float], depth: int) -> list[float]:
        """[1 + Σ_{i<=d} Π_{j<=i} p_j for d = 0..depth]: the acceptance at each depth given the one before was
        reached, the request's own counts drawn towards the recent requests' as `_accept_len` draws its mean."""
        prior = self.config.prior_steps
        tokens, through = [1.0], 1.0
        for j in range(depth):
            seen = reached[j] if j < len(reached) else 0
            hits = kept[j] if j < len(kept) else 0
            through *= (hits + prior * recent[j]) / (seen + prior)
            tokens.append(tokens[-1] + through)
        return tokens

    def _best_shape(self, requests: list[Request], size: int, plain: float) -> tuple[int, float]:
        """The shape with the most tokens per second for `requests`, and its step cost (measured or estimated)."""
        best = None
        for shape in sorted({*self.chains, *self.trees, self.max_drafts}):
            cost = self._shape_cost(shape, size, plain)
            break_even = cost / plain
            tokens = sum(t if t > break_even else 1.0 for t in (self._tokens(r, shape) for r in requests))
            rate = tokens / cost
            if best is None or rate > best[0]:
                best = (rate, shape, cost)
        return best[1], best[2]

    def _shape_cost(self, shape: int, size: int, plain: float) -> float:
        """Measured, or estimated from the measured shapes of the bucket: a plain step plus a cost per verified
        row (the configured shape's, or the nearest measured one's). On a MoE target the rows count by what
        they read (`ExpertReads.effective_rows`): rows that touch no new expert read no new weights."""
        if (shape, size) in self.shape_cost:
            return self.shape_cost[(shape, size)]
        measured = [(d, c) for (d, b), c in self.shape_cost.items() if b == size]
        if not measured:
            measured = [(self.max_drafts, self.cost[(True, size)])]
        drafts, cost = min(measured, key=lambda m: abs(m[0] - shape))
        return plain + max(cost - plain, 0.0) * self._rows(shape, size) / self._rows(drafts, size)

    def _rows(self, drafts: int, size: int) -> float:
        """A drafting step's verified rows at `size` sequences, weighed by what they read on a MoE target."""
        rows = size * (drafts + 1)
        return rows if self.experts is None else self.experts.effective_rows(rows, size)

    def _due(self, request: Request) -> bool:
        return request.steps_since_drafting > self.config.probe_every

    def _gain(self, requests: list[Request], break_even: float) -> float:
        """Tokens per second of a drafting step over a plain one's, whose costs stand at `break_even`."""
        # A due request is hoped to do as well as recent requests, or as it did itself if that was better.
        lengths = (max(self.mean_accept_len, self._tokens(r, self.shape)) if self._due(r)
                   else self._tokens(r, self.shape) for r in requests)
        tokens = sum(length if length > break_even else 1.0 for length in lengths)
        return tokens / (len(requests) * break_even)

    def _probe_interval(self, gain: float, draft: float, plain: float, size: int) -> int:
        """Steps of the winning side between probes, in units of a winning step's time. A probe step costs
        the losing side's step time times the share of tokens per second it gives up: with r its step time
        over the winner's and g its speed over the winner's, r * (1 - g). Either probe also pays the head's
        catch-up, as long as the last one: a probe of drafting starts with it, a probe of plain decode
        leaves the head behind, and the drafting step after it catches up."""
        switch = self._switch_cost(size)
        if gain > 1:  # plain decode is probed: r = t_plain / t_draft, g = 1 / gain
            loss = (self.config.probe_len + 1) * (1 - 1 / gain) * plain / draft + switch / draft
        else:
            loss = (self.config.probe_len + 1) * draft / plain * (1 - gain) + switch / plain
        spacing = loss / self.config.probe_budget
        return int(min(max(self.config.probe_every, spacing), self.config.max_probe_every))

    def _switch_cost(self, size: int) -> float:
        """The head's catch-up when drafting resumes in this bucket: measured, or until then the nearest smaller
        bucket's scaled by the batch (it catches up on every request's missed tokens). Taken as nothing before
        any was measured, the first probe of a large batch came after a few hundred steps and paid a catch-up of
        a dozen plain steps three times over."""
        if size in self.switch_cost:
            return self.switch_cost[size]
        smaller = [b for b in self.switch_cost if b < size]
        return self.switch_cost[max(smaller)] * size / max(smaller) if smaller else 0.0

    def _probe(self, size: int, choice: bool, every: int) -> bool:
        """`choice`, unless the other side is due to be measured again, or the side taken last (a probe or
        a switch) has not run `probe_len` steps and kept a step time yet (a prompt step may cut a run
        short; after 4x `probe_len` steps it gives up)."""
        side, run, since = self._side.get(size, (None, 0, 0))
        if side is None:
            return choice
        measured = self._samples.get((side, size), 0) > since
        if side != choice and (run < self.config.probe_len or not measured and run < 4 * self.config.probe_len):
            return side
        if side == choice and run >= every:
            return not side
        return choice

    def _accept_len(self, request: Request) -> float:
        """The request's mean acceptance length, drawn towards the recent requests' mean while it has drafted
        little: a step's acceptance is noisy, and one unlucky run must not stop a good request."""
        prior = self.config.prior_steps
        total = request.num_spec_steps + request.num_accepted_tokens + prior * self.mean_accept_len
        return total / (request.num_spec_steps + prior)

    def snapshot(self) -> dict:
        """What the plan believes now, for benchmark records: step costs in ms by side and bucket (and by
        shape's drafts and bucket), the switch costs, the recent requests' mean acceptance length and the step
        times kept."""
        def name(key: tuple[bool, int]) -> str:
            return f"{'draft' if key[0] else 'plain'}@{key[1]}"

        return {"cost_ms": {name(k): round(s * 1e3, 3) for k, s in sorted(self.cost.items())},
                "shape_cost_ms": {f"{d}@{b}": round(s * 1e3, 3) for (d, b), s in sorted(self.shape_cost.items())},
                "switch_cost_ms": {str(b): round(s * 1e3, 3) for b, s in sorted(self.switch_cost.items())},
                "mean_accept_len": round(self.mean_accept_len, 3),
                "samples": {name(k): n for k, n in sorted(self._samples.items())}}

    # -- observing --------------------------------------------------------
    def observe_step(self, drafted: bool, batch_size: int, seconds: float) -> None:
        """A pure decode step's duration. Kept only for a step the plan made that followed one of the same
        side and bucket: the first after a switch paid for the switch, and steps held back from drafting
        while prompts were pending are not the plan's."""
        planned = self._planned
        # A step cut short by the token budget or preemption still shows what the planned side costs at
        # this load: it is kept under the planned bucket.
        key = planned if planned is not None and planned[0] == drafted else (drafted, bucket(batch_size))
        after_plain = self._observed is not None and not self._observed[0]
        if planned == key and drafted and after_plain:
            # Beyond a drafting step it also waited for the plain step in flight, under overlap scheduling. The
            # bucket's first switch comes before its drafting cost is known: it is settled once that is.
            self._switch_seen[key[1]] = (seconds, self.cost.get((False, self._observed[1]), 0.0))
        if planned == key and self._streak >= 2:
            self.cost[key] = _keep(self._times, key, seconds, self.config.window)
            self._samples[key] = self._samples.get(key, 0) + 1
        if drafted and key[1] in self._switch_seen and key in self.cost:
            switched, plain = self._switch_seen.pop(key[1])
            self.switch_cost[key[1]] = max(0.0, switched - self.cost[key] - plain)
        shape = (self.shape, key[1]) if planned == key and drafted else None
        if shape is not None and self.choosing and self._last_shape == shape and self._streak >= 2:
            self.shape_cost[shape] = _keep(self._shape_times, shape, seconds, self.config.window)
        self._last_shape = shape
        self._observed = key if planned == key else None
        self._planned = None

    def observe_other_step(self) -> None:
        """A step that computed prompt tokens: the next decode step starts a new streak."""
        self._planned = self._observed = None

    def observe_acceptance(self, request: Request, drafted: int, accepted: int, depth: int | None = None) -> None:
        """Called after the request's counters took this step in. `drafted`: the shape scheduled; `depth`: how
        deep its verified tree was, if pruning may have cut it (positions past it were not drafted)."""
        if drafted > 0:
            request.steps_since_drafting = 0
        if self.choosing:
            self._count_positions(request, drafted, accepted, depth)
            self._forget()
        # Fewer drafts than planned: cut by the room the request has left, which caps its acceptance too. Such
        # steps end every request, all at once at the end of a wave of like requests, and would drag the
        # recent mean (the new requests' prior) under the break-even just as the next wave starts.
        if drafted >= self.max_drafts:
            weight = self.config.smoothing
            self.mean_accept_len = (1 - weight) * self.mean_accept_len + weight * (1.0 + accepted)

    def _count_positions(self, request: Request, drafted: int, accepted: int, verified_depth: int | None) -> None:
        """Per depth: reached (all drafts before it accepted) and kept; the recent mean per depth too. A tree
        counts under its size; one cut short of a size by the room left (a request's last steps) does not."""
        if self._is_tree(drafted):
            depth = self.trees[drafted]
            reached, kept = request.tree_positions.setdefault(drafted, ([], []))
            recent = self.tree_accept[drafted]
        elif drafted <= self.depth:
            depth, reached, kept, recent = drafted, request.drafts_reached, request.drafts_kept, self.position_accept
        else:
            return
        while len(reached) < depth:
            reached.append(0)
            kept.append(0)
        weight = self.config.smoothing
        reached_depth = depth if verified_depth is None else min(depth, verified_depth)
        for j in range(min(accepted + 1, reached_depth)):
            hit = j < accepted
            reached[j] += 1
            kept[j] += hit
            recent[j] = (1 - weight) * recent[j] + weight * hit


def _keep(store: dict, key, seconds: float, window: int) -> float:
    """Adds a step time under `key`; returns the lower median of the latest `window`. Outliers only ever run
    long (a kernel built on first use, a collection, a busy machine): one slow step must not stop drafting
    until the next probe."""
    times = store.setdefault(key, deque(maxlen=window))
    times.append(seconds)
    return sorted(times)[(len(times) - 1) // 2]
