"""Turns one StepBatch into tensors, runs the model, samples. Holds the model and the KV pool, nothing
about requests beyond the step in hand."""
from __future__ import annotations

import contextlib
import random

import torch

from specserve.core import StepBatch, TokenLogprob, draw_seed
from specserve.engine.futures import FutureTokens, has_placeholder
from specserve.engine.phases import NoTimer
from specserve.layers.attention import AttentionMetadata
from specserve.sampling.grammar_mask import mask_logits
from specserve.sampling.logprobs import LogprobRows
from specserve.sampling.penalties import adjust_logits, seq_context
from specserve.sampling.sampler import sample
from specserve.speculative.base import Speculator
from specserve.speculative.programs.base import unpack
from specserve.speculative.simulate import simulated_verdict
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import Verdict, verify, verify_seeded
from specserve.structured.step_masks import MaskTiming, MaskWorker, StepMasks
from specserve.transfer import tensor_on, to_device


class StepOutput:
    """A step's new tokens per sampling sequence. A plain step leaves them on the device until asked, so the
    host can prepare the next step meanwhile; `placeholders` name them for that next step (engine/futures.py).

    On a GPU the copy back is queued right behind the step, into pinned memory, with an event: reading the
    tokens then waits for this step alone, not for the next one queued behind it on the same stream."""

    def __init__(self, ready: list[list[int]] | None = None, device_tokens: torch.Tensor | None = None,
                 placeholders: list[int] | None = None, program_width: int | None = None,
                 logprobs: "list[list[TokenLogprob] | None] | PlainLogprobs | None" = None,
                 verified: list[tuple[int, int] | None] | None = None) -> None:
        self._ready = ready
        self._logprobs = logprobs
        # Per sampling sequence of a step that searched its drafts on the host: (drafts, depth) of the tree it
        # verified, which pruning may have cut below what was scheduled (None: nothing drafted).
        self.verified = verified
        self.placeholders = placeholders
        # A chain or tree program's step: device_tokens are its packed rows (speculative/programs/base.py: unpack), and a
        # following step may continue it on the device (Scheduler.follow) with this many tokens per row.
        self.program_width = program_width
        self._host, self._copied = None, None
        self._hold(device_tokens)

    def _hold(self, device_tokens: torch.Tensor | None) -> None:
        self._host = device_tokens
        if device_tokens is not None and device_tokens.is_cuda:
            self._host = torch.empty(device_tokens.shape, dtype=device_tokens.dtype, pin_memory=True)
            self._host.copy_(device_tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def finish(self) -> None:
        """Queues what the step left for later (DeferredOutput); nothing for others."""

    def tokens(self) -> list[list[int]]:
        """Reads the tokens back: the step's one host-device synchronisation."""
        self.finish()
        if self._ready is None:
            if self._copied is not None:
                self._copied.synchronize()
            rows = self._host.tolist()
            self._ready = unpack(rows) if self.program_width else [[t] for t in rows]
        return self._ready

    def logprobs(self) -> list[list[TokenLogprob] | None] | None:
        """Per sampling sequence, the log-probabilities of its new tokens (None where it did not ask for them);
        None when no sequence asked. Read after `tokens`."""
        if isinstance(self._logprobs, PlainLogprobs):
            self._logprobs = self._logprobs.to_host()
        return self._logprobs


class DeferredOutput(StepOutput):
    """A plain step launched under overlap scheduling with constrained rows: its forward and logits are
    queued, and its rows are sampled at `finish`, once the engine has read the step before it back (which
    advances the grammars its masks come from). Its placeholders are handed out at launch."""

    def __init__(self, sample, placeholders: list[int] | None, futures: FutureTokens) -> None:
        super().__init__(placeholders=placeholders)
        self._sample, self._futures = sample, futures

    def finish(self) -> None:
        if self._sample is None:
            return
        (tokens, self._logprobs), self._sample = self._sample(), None
        if self.placeholders is not None:
            self._futures.store(self.placeholders, tokens)
        self._hold(tokens)


class PlainLogprobs:
    """A plain step's log-probabilities for the sequences that asked, on the device until read back."""

    def __init__(self, seqs, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        self.size = len(seqs)
        self.wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        rows = tensor_on(self.wanted, logits.device)
        self.rows = LogprobRows(logits[rows], tokens[rows], [seqs[i].params.logprobs for i in self.wanted])

    @classmethod
    def of(cls, seqs, logits: torch.Tensor, tokens: torch.Tensor) -> PlainLogprobs | None:
        return cls(seqs, logits, tokens) if any(s.params.logprobs is not None for s in seqs) else None

    def to_host(self) -> list[list[TokenLogprob] | None]:
        out: list[list[TokenLogprob] | None] = [None] * self.size
        for i, row in zip(self.wanted, self.rows.to_host()):
            out[i] = [row]
        return out


class ModelRunner:
    """One step: the speculative program if the algorithm has one that fits the batch, else the general path:
    the proposer's draft trees (if any sequence drafts), one target forward over every row (a captured decode
    graph when the step is plain decode), then sampling, or verification of the trees (speculative/verify.py)."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, device: torch.device, futures: FutureTokens,
                 speculator: Speculator | None = None, graphs=None, simulate_accept_len: float | None = None,
                 simulation_rng: random.Random | None = None, untimed_gemv=contextlib.nullcontext) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.futures = futures
        self.proposer = speculator.proposer if speculator is not None else None
        self.program = speculator.program if speculator is not None else None  # StepProgram
        self.graphs = graphs  # DecodeGraphs, on a GPU
        # Speed studies only: replaces verification's verdict (speculative/simulate.py).
        self.simulate_accept_len = simulate_accept_len
        self.simulation_rng = simulation_rng or random.Random(0)
        self.timer = NoTimer()
        self.recorder = None  # see `recording`
        # With CUDA graphs, the GEMV choices are made at startup; a step's eager calls take cuBLAS for shapes
        # still undecided rather than time them mid-step (kernels/tuning: `untimed`).
        self.untimed_gemv = untimed_gemv
        # Tensor parallelism, rank 0: sends each step to the other ranks before running it (distributed/steps.py).
        self.step_sender = None
        # Grammar masks (structured/step_masks.py): under overlap scheduling a step's are built on a worker
        # thread beside its forward, else after it; either way, whether they were ready first is counted.
        self.mask_timing = MaskTiming()
        self._mask_worker = MaskWorker()
        self.overlap_masks = False

    @property
    def overlap_masks(self) -> bool:
        return self._overlap_masks

    @overlap_masks.setter
    def overlap_masks(self, on: bool) -> None:
        self._overlap_masks = on
        if self.proposer is not None:  # the search's per-level masks, beside the drafter's forwards
            self.proposer.mask_worker = self._mask_worker if on else None

    @contextlib.contextmanager
    def recording(self, recorder):
        """Training-data capture (specserve.train.datagen): while open, `recorder` sees every computed token's
        taps and hidden state, and steps take the general path."""
        if self.step_sender is not None:  # the other ranks would not know to take it
            raise ValueError("training-data capture runs with --tp-size 1")
        self.recorder = recorder
        try:
            yield recorder
        finally:
            self.recorder = None

    def execute(self, batch: StepBatch) -> list[list[int]]:
        """Runs the step; for each sequence that samples, returns its accepted drafts plus one new token."""
        return self.launch(batch).tokens()

    def launch(self, batch: StepBatch, publish: bool = False) -> StepOutput:
        """Queues the step on the device. A step without drafts, or a program's step, returns before its tokens
        are read back; with `publish`, a step without drafts also stores them as futures that the next step's
        inputs may name, and its constrained rows wait for `StepOutput.finish` (their grammars may still lack
        the token of the step in flight). A batch with `follow` takes the program (its inputs are on the
        device)."""
        if self.step_sender is not None:
            self.step_sender.send(batch, publish)
        try:
            with self.untimed_gemv():
                return self._launch(batch, publish)
        except Exception:
            if self.step_sender is not None:  # the next step sends the other ranks every page table whole
                self.step_sender.resync()
            raise

    @torch.inference_mode()
    def _launch(self, batch: StepBatch, publish: bool) -> StepOutput:
        program = self.program if self.recorder is None else None
        if program is not None and program.fits(batch):
            tokens = program.launch(batch, self.timer)
            if any(s.grammar is not None for s in batch.seqs):
                self.mask_timing.steps += 1
                self.mask_timing.ready_first += program.masks_ready_first
            return StepOutput(device_tokens=tokens, program_width=program.width)
        if batch.follow is not None:  # only the program can derive its inputs
            raise ValueError("a following step needs the chain or tree program, at a shape it covers")
        seqs = batch.seqs
        with self.timer.phase("draft"):
            trees = self.proposer.propose(batch) if self.proposer is not None else {}
            trees.update(_forced_chains(batch))
        # The drafts are known: the masks of the rows that verify them can be built from here on.
        masks = StepMasks.for_step(seqs, trees, self.mask_timing, self._mask_worker if self.overlap_masks else None,
                                   deferred=publish and not trees)
        try:
            return self._forward_and_sample(batch, publish, trees, masks)
        except BaseException:
            if masks is not None:  # no worker may touch the grammars once the step is given up
                masks.settle()
            raise

    def _forward_and_sample(self, batch: StepBatch, publish: bool, trees: dict, masks: StepMasks | None
                            ) -> StepOutput:
        seqs = batch.seqs
        if not trees and self._graph_fits(seqs) and (self.recorder is None or self.graphs.record_layers):
            return self._graph_step(batch, publish, masks)
        with self.timer.phase("prepare"):
            input_ids, positions, meta, token_lists = self._prepare(batch, trees)
        with self.timer.phase("forward"):
            hidden = self._forward(seqs, input_ids, positions, meta)
        if self.proposer is not None:
            with self.timer.phase("follow"):
                self.proposer.extend_drafter(batch)
        with self.timer.phase("sample"):
            return self._sample_or_verify(batch, trees, token_lists, hidden, publish, masks)

    def _graph_step(self, batch: StepBatch, publish: bool, masks: StepMasks | None) -> StepOutput:
        """A plain decode step from a captured graph."""
        seqs = batch.seqs
        with self.timer.phase("forward"):
            out = self.graphs.run([s.token_ids[0] for s in seqs], [s.start_pos for s in seqs],
                                  [s.page_ids for s in seqs])
            if self.recorder is not None:
                taps, hidden = self.graphs.recorded(len(seqs))
                self.recorder.record(seqs, [taps], hidden)
        if masks is not None:
            masks.forward_queued(self.device)
        if self.proposer is not None:  # the graphs stored the taps; the drafter may follow along
            with self.timer.phase("follow"):
                self.proposer.extend_drafter(batch)
        with self.timer.phase("sample"):
            if all(s.params.greedy and not s.params.needs_host_logits for s in seqs):  # the graph took the argmax
                return self._plain_output(out.greedy, publish=publish)
            return self._sample_plain(seqs, out.logits.float(), publish, masks, range(len(seqs)))

    def _forward(self, seqs, input_ids, positions, meta) -> torch.Tensor:
        capture = self.proposer.capture_layers if self.proposer is not None else ()
        if self.recorder is not None:
            capture = self.recorder.capture_layers
        hidden, captured = self.model(input_ids, positions, meta, self.kv_cache, capture)
        if self.proposer is not None:
            self.proposer.observe(captured, meta.slot_mapping)
        if self.recorder is not None:
            self.recorder.record(seqs, captured, hidden)
        return hidden

    def _sample_or_verify(self, batch: StepBatch, trees: dict, token_lists, hidden, publish: bool,
                          masks: StepMasks | None) -> StepOutput:
        seqs = batch.seqs
        ends = torch.tensor([len(t) for t in token_lists]).cumsum(0).tolist()
        # Logit rows: the last row of a plain sequence; every tree node of a speculating one.
        rows, spans = [], []
        for i, s in enumerate(seqs):
            if s.sample:
                width = len(token_lists[i]) if i in trees else 1
                spans.append((i, len(rows), width))
                rows.extend(range(ends[i] - width, ends[i]))
        if not rows:
            return StepOutput(ready=[], placeholders=[])
        logits = self.model.compute_logits(hidden[tensor_on(rows, self.device)]).float()
        if masks is not None:
            masks.forward_queued(self.device)
        if not trees:
            plain = [i for i, _, _ in spans]
            return self._sample_plain([seqs[i] for i in plain], logits, publish, masks, plain)
        tokens, logprobs = self._choose(seqs, trees, logits, spans, batch.page_size, masks)
        verified = [(len(trees[i].tokens) - 1, max(trees[i].depths())) if i in trees else None for i, _, _ in spans]
        return StepOutput(ready=tokens, logprobs=logprobs, verified=verified)

    def _sample_plain(self, seqs, logits: torch.Tensor, publish: bool, masks: StepMasks | None = None,
                      indices=()) -> StepOutput:
        """One token per sequence, sampled without leaving the device, from the logits adjusted by each
        request's penalties and bias and masked by its grammar (`indices`: each sequence's index in the step,
        which its masks go by); log-probabilities (where asked) from the raw logits."""
        def sampled():
            tokens = _sample_rows(seqs, logits, [seq_context(s) for s in seqs], _row_masks(masks, indices))
            return tokens, PlainLogprobs.of(seqs, logits, tokens)
        if masks is not None and masks.deferred:
            return DeferredOutput(sampled, self.futures.reserve(len(seqs)) if publish else None, self.futures)
        return self._plain_output(*sampled(), publish=publish)

    def _plain_output(self, tokens: torch.Tensor, logprobs: PlainLogprobs | None = None, publish: bool = False
                      ) -> StepOutput:
        return StepOutput(device_tokens=tokens, placeholders=self.futures.publish(tokens) if publish else None,
                          logprobs=logprobs)

    def _graph_fits(self, seqs) -> bool:
        """A plain decode step (one sampled token per sequence) that a captured graph covers."""
        if self.graphs is None or not all(s.sample and len(s.token_ids) == 1 for s in seqs):
            return False
        return self.graphs.fits(len(seqs), max(s.start_pos for s in seqs) + 1)

    def _prepare(self, batch: StepBatch, trees: dict):
        # A speculating sequence computes its whole draft tree: one slot per node, in node order, each node
        # at position root + depth and attending to its ancestors only.
        seqs = batch.seqs
        token_lists = [trees[i].tokens if i in trees else s.token_ids for i, s in enumerate(seqs)]
        positions = to_device(torch.cat([
            torch.tensor(trees[i].depths()) + s.start_pos if i in trees
            else torch.arange(s.start_pos, s.start_pos + len(s.token_ids))
            for i, s in enumerate(seqs)
        ]), self.device)
        flat_ids = [t for tokens in token_lists for t in tokens]
        input_ids = tensor_on(flat_ids, self.device)
        if has_placeholder(flat_ids):
            self.futures.resolve(input_ids)
        meta = AttentionMetadata.build(
            [len(t) for t in token_lists], [s.start_pos for s in seqs], [s.page_ids for s in seqs],
            batch.page_size, self.device,
            tree_masks=[trees[i].ancestor_mask() if i in trees else None for i in range(len(seqs))] if trees else None,
        )
        return input_ids, positions, meta, token_lists

    def _choose(self, seqs, trees, logits, spans, page_size: int, masks: StepMasks | None):
        """Each sampling sequence's new tokens, and their log-probabilities where asked (else None for all)."""
        plain = [(i, first) for i, first, _ in spans if i not in trees]
        results: dict[int, list[int]] = {}
        logprobs: dict[int, list[TokenLogprob] | None] = {}
        if plain:
            plain_seqs = [seqs[i] for i, _ in plain]
            plain_logits = logits[[first for _, first in plain]]
            chosen = _sample_rows(plain_seqs, plain_logits, [seq_context(s) for s in plain_seqs],
                                  _row_masks(masks, [i for i, _ in plain]))
            rows = PlainLogprobs.of(plain_seqs, plain_logits, chosen)
            rows = rows.to_host() if rows is not None else [None] * len(plain)
            for (i, _), token, row in zip(plain, chosen.tolist(), rows):
                results[i], logprobs[i] = [token], row
        for i, first, width in spans:
            if i in trees:
                seq, tree, raw = seqs[i], trees[i], logits[first:first + width]
                adjusted = mask_logits(adjust_logits(raw, _tree_contexts(seq, tree)), _seq_masks(masks, i, width))
                verdict = self._verdict(adjusted, tree, seq)
                self._compact_kv(seq, verdict.accepted_nodes, page_size)
                results[i], logprobs[i] = verdict.tokens, _verdict_logprobs(seq, raw, verdict)
        tokens = [results[i] for i, _, _ in spans]
        if all(row is None for row in logprobs.values()):
            return tokens, None
        return tokens, [logprobs[i] for i, _, _ in spans]

    def _verdict(self, logits: torch.Tensor, tree, seq) -> Verdict:
        if self.simulate_accept_len is not None:
            return simulated_verdict(logits, tree, seq.params, self.simulate_accept_len, self.simulation_rng,
                                     seq.sample_seed)
        if seq.params.seed is not None and not seq.params.greedy:
            seeds = [draw_seed(seq.params.seed, seq.output_index + d) for d in range(max(tree.depths()) + 1)]
            return verify_seeded(logits, tree, seq.params, seeds)
        return verify(logits, tree, seq.params)

    def _compact_kv(self, seq, accepted_nodes: list[int], page_size: int) -> None:
        """Moves the KV of accepted tree nodes to the positions they now hold (node n was written at
        slot root + n, and the d-th accepted node belongs at root + d). A chain needs no move."""
        moves = [(n, d) for d, n in enumerate(accepted_nodes, start=1) if n != d]
        if not moves:
            return
        def slot(offset: int) -> int:
            pos = seq.start_pos + offset
            return seq.page_ids[pos // page_size] * page_size + pos % page_size
        src = torch.tensor([slot(n) for n, _ in moves], device=self.device)
        dst = torch.tensor([slot(d) for _, d in moves], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        self.proposer.move_slots(src, dst)


def _sample_rows(seqs, logits: torch.Tensor, contexts, masks: list) -> torch.Tensor:
    adjusted = mask_logits(adjust_logits(logits, contexts), masks)
    return sample(adjusted, [s.params for s in seqs], [s.sample_seed for s in seqs])


def _forced_chains(batch: StepBatch) -> dict[int, DraftTree]:
    """Sequences whose grammar forces their next tokens (scheduler.py `_forced_span`) and that do not draft
    verify those tokens alone, as a chain (the proposer puts them first in the trees of those that draft)."""
    return {i: DraftTree.chain(s.token_ids[-1], s.forced_token_ids)
            for i, s in enumerate(batch.seqs) if s.forced_token_ids and not s.num_draft_tokens}


def _row_masks(masks: StepMasks | None, indices) -> list:
    """One grammar mask (or None) per sampled row, for the step's sequences `indices`, one row each."""
    return [m for i in indices for m in _seq_masks(masks, i, 1)]


def _seq_masks(masks: StepMasks | None, index: int, num_rows: int) -> list:
    """Sequence `index`'s grammar mask per logit row (None per row where nothing in the step is constrained)."""
    return [None] * num_rows if masks is None else masks.rows(index, num_rows)


def _tree_contexts(seq, tree) -> list:
    """Each tree node's row context: the request's tokens, then the drafts on the path to the node."""
    if not seq.params.adjusts_logits:
        return [None] * len(tree.tokens)
    paths: list[list[int]] = [[]]
    for node in range(1, len(tree.tokens)):  # parents come before their children
        paths.append([*paths[tree.parents[node]], tree.tokens[node]])
    return [seq_context(seq, path) for path in paths]


def _verdict_logprobs(seq, raw_logits: torch.Tensor, verdict: Verdict) -> list[TokenLogprob] | None:
    """The emitted tokens' log-probabilities: each from the row of the node it follows (the root, then each
    accepted node)."""
    if seq.params.logprobs is None:
        return None
    rows = [0, *verdict.accepted_nodes]
    tokens = torch.tensor(verdict.tokens, device=raw_logits.device)
    return LogprobRows(raw_logits[rows], tokens, [seq.params.logprobs] * len(rows)).to_host()
