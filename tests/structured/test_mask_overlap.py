"""Grammar masks built while the device runs the step (structured/step_masks.py), with overlap scheduling
forced on (on a CPU it is on only when asked): greedy outputs under constraints are the same with overlap on and
off, without speculation, as a chain and as a tree, in batches that mix constrained and free requests; a
plain step's masks are built after the step before it is read back, and a drafting step's on the worker
while its forward runs."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from specserve.bench.schemas import SCHEMAS
from specserve.config import SpecConfig
from specserve.core import Constraint, SamplingParams
from specserve.structured.step_masks import MaskTiming, MaskWorker, StepMasks
from engine_runs import run_batch

REGEX = r"[a-z]{3,10}( [a-z]{3,10}){2,5}\."  # free letters: few steps have a forced token
CONFIGS = {"off": None, "chain": (3, 1, None), "tree": (3, 2, 6)}
FREE = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def make_llm(tiny_chat_model, tiny_chat_head, config: str, overlap: bool):
    from specserve.llm import LLM

    shape = CONFIGS[config]
    spec = {"spec": SpecConfig("EAGLE3", str(tiny_chat_head), *shape)} if shape else {}
    llm = LLM(model=str(tiny_chat_model), max_total_tokens=8192, **spec)
    llm.engine.overlap = overlap
    return llm


def mixed_batch() -> tuple[list[str], list[SamplingParams]]:
    schemas = [0, 5, 11, 17]
    prompts = [f"Answer in JSON following the schema {json.dumps(SCHEMAS[i])}" for i in schemas]
    params = [SamplingParams(max_tokens=50, temperature=0.0,
                             constraint=Constraint("json_schema", json.dumps(SCHEMAS[i]))) for i in schemas]
    prompts += ["Say something.", "Tell me a story.", "1, 2, 3,"]
    params += [SamplingParams(max_tokens=30, temperature=0.0, constraint=Constraint("regex", REGEX)), FREE, FREE]
    return prompts, params


def run(llm, prompts, params):
    return [(o.token_ids, o.finish_reason) for o in run_batch(llm, prompts, params)[0]]


@pytest.mark.parametrize("config, forced", [("off", False), ("chain", True), ("tree", False)])
def test_greedy_outputs_are_the_same_with_overlap_on_and_off(tiny_chat_model, tiny_chat_head, switches, config,
                                                              forced):
    """With grammar-forced drafts on, constrained steps wait for the step in flight (engine.py); off, plain
    ones are split."""
    switches(forced_drafts=forced)
    prompts, params = mixed_batch()
    outputs = {}
    for overlap in (False, True):
        llm = make_llm(tiny_chat_model, tiny_chat_head, config, overlap)
        outputs[overlap] = run(llm, prompts, params)
        timing = llm.engine.runner.mask_timing
        assert timing.steps > 0 and 0 <= timing.ready_first <= timing.steps
        alloc = llm.engine.scheduler.allocator
        assert llm.engine.in_flight is None and alloc.num_free == alloc.num_pages
    assert outputs[True] == outputs[False]


class SpyGrammar:
    """A request's grammar state that logs when it is advanced and when masks are read from it, and on which
    thread."""

    def __init__(self, state, log: list, built: threading.Event) -> None:
        self._state, self._log, self._built = state, log, built

    def __getattr__(self, name):
        return getattr(self._state, name)

    def accept(self, token: int) -> bool:
        self._log.append(("accept", threading.current_thread().name))
        return self._state.accept(token)

    def next_mask(self):
        masks = self._state.next_mask()
        self._log.append(("mask", threading.current_thread().name))
        self._built.set()
        return masks

    def path_masks(self, paths):
        masks = self._state.path_masks(paths)
        self._log.append(("path masks", threading.current_thread().name))
        return masks

    def tree_masks(self, tokens, parents):
        masks = self._state.tree_masks(tokens, parents)
        self._log.append(("tree masks", threading.current_thread().name))
        self._built.set()
        return masks


def spied_run(llm, prompts, params):
    """Runs the batch with every grammar and the target's forward logged. A forward of a step whose masks went
    to the worker waits (a while at most) for them: it finishes only if they were built while it ran."""
    log, built, submitted = [], threading.Event(), threading.Event()
    runner = llm.engine.runner
    submit = runner._mask_worker.submit

    def logged_submit(build):
        built.clear()
        submitted.set()
        return submit(build)

    runner._mask_worker.submit = logged_submit
    forward = runner.model.forward

    def logged_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        if submitted.is_set():
            log.append(("forward waited", built.wait(timeout=20)))
            submitted.clear()
        else:
            log.append(("forward", None))
        built.clear()
        return out

    runner.model.forward = logged_forward
    trackers = [llm.add(p, q) for p, q in zip(prompts, params)]
    for tracker in trackers:
        request = llm.engine.scheduler.requests[tracker.output.request_id]
        if request.grammar is not None:
            request.grammar = SpyGrammar(request.grammar, log, built)
    while llm.engine.has_work():
        llm.step_and_track(trackers)
    return log


def test_a_plain_step_builds_its_masks_after_the_step_before_is_read_back(tiny_chat_model, tiny_chat_head, switches):
    switches(forced_drafts=False)
    llm = make_llm(tiny_chat_model, tiny_chat_head, "off", overlap=True)
    log = spied_run(llm, ["Say something."], [SamplingParams(max_tokens=20, temperature=0.0,
                                                               constraint=Constraint("regex", REGEX))])
    kinds = [event for event, _ in log]
    # Step N+1's forward, then N's token read back into the grammar, then N+1's mask: the split step.
    split = [i for i in range(len(kinds) - 2) if kinds[i:i + 3] == ["forward", "accept", "mask"]]
    assert len(split) >= 5, kinds
    off = spied_run(make_llm(tiny_chat_model, tiny_chat_head, "off", overlap=False), ["Say something."],
                    [SamplingParams(max_tokens=20, temperature=0.0, constraint=Constraint("regex", REGEX))])
    assert "forward accept mask" not in " ".join(e for e, _ in off), "without overlap each step is whole"


def test_a_drafting_step_builds_its_masks_on_the_worker_while_its_forward_runs(tiny_chat_model, tiny_chat_head):
    llm = make_llm(tiny_chat_model, tiny_chat_head, "tree", overlap=True)
    prompts, params = mixed_batch()
    log = spied_run(llm, prompts[:2] + prompts[-1:], params[:2] + params[-1:])
    waits = [ok for event, ok in log if event == "forward waited"]
    assert len(waits) >= 3 and all(waits), "each such forward finished only once the masks were built"
    for kind in ("tree masks", "path masks"):  # the verify's, and the draft search's per level
        threads = {thread for event, thread in log if event == kind}
        assert threads and threading.main_thread().name not in threads, kind
    off = spied_run(make_llm(tiny_chat_model, tiny_chat_head, "tree", overlap=False), prompts[:2], params[:2])
    assert not any(event == "forward waited" for event, _ in off)
    assert {thread for event, thread in off if event.endswith("masks")} == {threading.main_thread().name}


class FakeGrammar:
    terminated = False

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate

    def next_mask(self):
        if self.gate is not None:
            assert self.gate.wait(timeout=20)
        return torch.full((1, 2), -1, dtype=torch.int32)


class FakeSeq:
    sample = True

    def __init__(self, grammar) -> None:
        self.grammar = grammar


def test_ready_first_counts_masks_done_before_the_forward_was():
    timing, worker = MaskTiming(), MaskWorker()
    early = StepMasks.for_step([FakeSeq(FakeGrammar())], {}, timing, worker)
    early.settle()  # built before the forward is marked done
    early.forward_queued(torch.device("cpu"))
    gate = threading.Event()
    late = StepMasks.for_step([FakeSeq(FakeGrammar(gate)), FakeSeq(None)], {}, timing, worker)
    late.forward_queued(torch.device("cpu"))  # on a CPU: the forward has run
    gate.set()
    assert [m is None for m in late.rows(1, 1)] == [True] and late.rows(0, 1)[0].shape == (1, 2)
    early.result()
    synchronous = StepMasks.for_step([FakeSeq(FakeGrammar())], {}, timing)
    synchronous.forward_queued(torch.device("cpu"))
    synchronous.result()
    assert (timing.steps, timing.ready_first) == (3, 1)
    assert StepMasks.for_step([FakeSeq(None)], {}, timing) is None


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["off", "chain"])
def test_on_a_gpu_overlap_gives_the_same_greedy_outputs_and_times_masks_by_event(tiny_chat_model, tiny_chat_head,
                                                                                 switches, config):
    """Overlap is on by default on a GPU: plain constrained steps (graphs' logits, sampled after the read-back;
    forced drafts off, so that they are split) and drafting ones (masks on the worker) give the synchronous
    engine's outputs; every step with constrained rows is timed against the CUDA event behind its forward."""
    from specserve.llm import LLM

    switches(forced_drafts=False)

    prompts, params = mixed_batch()
    shape = CONFIGS[config]
    spec = {"spec": SpecConfig("EAGLE3", str(tiny_chat_head), *shape)} if shape else {}
    llm = LLM(model=str(tiny_chat_model), max_total_tokens=8192, device="cuda", **spec)
    assert llm.engine.overlap
    overlapped = run(llm, prompts, params)
    timing = llm.engine.runner.mask_timing
    assert timing.steps > 0 and timing.ready_share is not None
    llm.engine.overlap = False
    assert run(llm, prompts, params) == overlapped
