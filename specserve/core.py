"""What the engine and speculation share, at the bottom of the import graph: a request's sampling
settings, its state (two counters over one token list, not a phase flag), and the one-step batch the
scheduler hands the runner. Pure data, no torch.

`Request.num_computed_tokens` counts tokens whose KV is in the cache; `num_tokens` counts tokens known (prompt
plus outputs). Prefill, chunked prefill, decode and recompute after preemption are all "compute the gap".
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field


# OpenAI allows temperatures in [0, 2]; vLLM and SGLang check only that it is non-negative. The bound is far
# past any temperature in use; it keeps out infinities and absurd values such as 1e9.
MAX_TEMPERATURE = 100.0
MAX_INT64 = 2**63 - 1
# Top alternatives per token that `logprobs` may ask for (vLLM's default cap; OpenAI's chat allows 20).
MAX_LOGPROBS = 20
# OpenAI's ranges: penalties in [-2, 2], logit_bias values in [-100, 100]. A repetition penalty (HF's, a
# divisor of positive logits) must be positive; past 100 it is no longer a penalty but a ban.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_REPETITION_PENALTY = 100.0


CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True)
class Constraint:
    """Structured output: the grammar a request's output must match (structured/grammar.py compiles it).
    kind: "json_object" (any JSON object; no text), "json_schema" (text: the schema as JSON), "regex", or
    "ebnf" (xgrammar's EBNF, rule `root` first), or "structural_tag" (xgrammar's structural tag as JSON: tool
    calls, server/tools.py)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.text:
            raise ValueError(f"a {self.kind} constraint needs its text")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Penalties as vLLM applies them: presence and frequency over the output so far, repetition (HF's: positive
    # logits divided by it, negative ones multiplied) over prompt and output. Then `logit_bias` is added.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a dict is accepted too
    # Log-probabilities of each emitted token under the target (its raw logits, before penalties and
    # temperature), with this many top alternatives; None: not computed.
    logprobs: int | None = None
    # The grammar the output must match (None: free text). Tokens it forbids get no probability, drafts
    # included, and the request finishes ("stop") when the grammar ends.
    constraint: Constraint | None = None
    # SGLang's names for a constraint (its sampling_params and request fields): at most one of them, and not
    # beside `constraint`, which they become (the names then read None, so `replace` keeps one form).
    json_schema: str | dict | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "constraint", self._constraint())
        for name in ("json_schema", "regex", "ebnf"):
            object.__setattr__(self, name, None)
        # Normalise list inputs so params stay hashable and picklable as one value.
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or ()
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        errors = self.validation_errors()
        if errors:
            raise ValueError("; ".join(errors))

    def validation_errors(self) -> list[str]:
        errors = []
        if self.max_tokens is not None and self.max_tokens < 1:
            errors.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        # Comparisons with NaN are all false, so each range is written as "inside", and negated.
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            errors.append(f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            errors.append(f"min_p must be in [0, 1], got {self.min_p}")
        if not -1 <= self.top_k <= MAX_INT64:
            errors.append(f"top_k must be -1 or 0 (disabled) or a positive 64-bit integer, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                errors.append(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            errors.append(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        errors.extend(f"logit_bias for token {t} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {b}"
                      for t, b in self.logit_bias if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS)
        errors.extend(f"logit_bias names token {t}, which is negative" for t, _ in self.logit_bias if t < 0)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            errors.append(f"logprobs (top alternatives) must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        return errors

    def _constraint(self) -> Constraint | None:
        named = [(kind, text) for kind, text in (("json_schema", self.json_schema), ("regex", self.regex),
                                                 ("ebnf", self.ebnf)) if text is not None]
        if not named:
            return self.constraint
        if len(named) > 1 or self.constraint is not None:
            given = [kind for kind, _ in named] + (["constraint"] if self.constraint is not None else [])
            raise ValueError(f"a request takes one output constraint, got {', '.join(given)}")
        kind, text = named[0]
        return Constraint(kind, text if isinstance(text, str) else json.dumps(text))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or a bias change the target's logits before sampling and verification."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def needs_host_logits(self) -> bool:
        """Whether the step must see this request's logit rows (adjusting them, or reporting log-probabilities):
        the fixed-shape step programs and overlapped steps leave it to the general path."""
        return self.adjusts_logits or self.logprobs is not None or self.constraint is not None


def _as_tuple(stop: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(s for s in stop if s)



def draw_seed(seed: int, index: int) -> int:
    """The seed of a seeded request's draw of output token `index`: each draw gets its own, so a seeded request
    repeats exactly whatever else shares its batches, and with or without speculation."""
    return (seed * 1_000_003 + index * 7919 + 1) % (2**63 - 1)


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one emitted token, and its top alternatives, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # client went away or asked to cancel
    ERROR = "error"  # the engine failed while computing this request


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context length at admission
    arrival_index: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens whose KV the draft model holds (it lags the target after steps that did not draft).
    num_draft_computed_tokens: int = 0
    page_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Speculation counters: steps that drafted, tokens drafted, drafts accepted and emitted (see TokenDelta).
    num_spec_steps: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    # For the adaptive draft plan (speculative/plan.py): drafting steps since this request last drafted; and
    # per draft position, how often a draft there was verified with all before it accepted, and was accepted.
    steps_since_drafting: int = 0
    drafts_reached: list[int] = field(default_factory=list)
    drafts_kept: list[int] = field(default_factory=list)
    # The same counts for each tree size it drafted, by depth: tree drafts -> (reached, kept).
    tree_positions: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    # Structured output: the grammar state over the emitted tokens (structured.state.GrammarState, opaque
    # here), made at admission when params.constraint is set, dropped when the request finishes.
    grammar: object | None = None
    # Prefix caching (kv/prefix.py): prompt tokens served from the cache at first admission (reported in
    # usage), how many leading page_ids are indexed, and how many of those are marked as holding draft KV.
    num_cached_tokens: int = 0
    num_indexed_pages: int = 0
    num_drafted_pages: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step: compute KV for `token_ids` at positions start_pos.. and maybe sample."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    page_ids: list[int]
    params: SamplingParams
    # Set when this step reaches the end of the known tokens, so its last position yields a new token.
    sample: bool
    # Seed for this one sampling draw, derived from the request seed and output index (None: unseeded).
    sample_seed: int | None
    # Speculation, decided per step: how many draft tokens to propose and verify after token_ids[-1], and
    # the tokens the draft model must first catch up on (its KV starts at draft_start_pos). With catch-up
    # tokens and no drafts (a prompt chunk; a decoding request in a step that does not draft), the drafter
    # only extends its KV over them.
    num_draft_tokens: int = 0
    draft_start_pos: int = 0
    draft_catchup_ids: list[int] = field(default_factory=list)
    # The request's tokens (prompt, then output), where its params adjust logits from them (penalties): the
    # sampled row sees history[:start_pos + len(token_ids)]. The request's own list, read during the step only.
    history: list[int] | None = None
    num_prompt_tokens: int = 0
    # The output index of the token this step samples first: a seeded request draws output i with
    # draw_seed(seed, i), and a speculative step one such draw per position it verifies.
    output_index: int = 0
    # Drafts whose draft probability (their path's, the product down from the root) falls below this are
    # pruned from the request's tree: they would not pay for their verify row (speculative/plan.py). Only the
    # general search prunes; a step program's shapes are fixed.
    draft_min_prob: float = 0.0
    # The request's grammar state (Request.grammar) where it samples under a constraint: masks for this step's
    # rows are read from it, and it is not advanced during the step.
    grammar: object | None = None
    # Structured output: the tokens the grammar forces after token_ids[-1] (GrammarState.forced_tokens),
    # verified this step as the first drafts of the sequence's chain, before any of num_draft_tokens.
    forced_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepBatch:
    """Everything the runner needs for one step. It lives for one step only."""

    seqs: list[ScheduledSeq]
    page_size: int
    # An overlapped drafting step (`Scheduler.follow`): row i continues row follow[i] of the drafting step
    # launched last, not yet read back. Its inputs are derived on the device from that step's results; its
    # ScheduledSeq holds upper bounds (start_pos: the root if that step accepted everything) and pages for them.
    follow: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def kind(self) -> str:
        """"prompt" (computes prompt tokens; decoding requests may ride along), "drafting" or "decode"."""
        if not all(len(s.token_ids) == 1 and s.sample for s in self.seqs):
            return "prompt"
        return "drafting" if any(s.num_draft_tokens for s in self.seqs) else "decode"
