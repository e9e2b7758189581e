"""Rows under a grammar in the chain and tree programs (speculative/programs/base.py `_constrained_step`):
the drafts, read back, each constrained row's masks filled along its chain or tree, then masked verification.
Greedy output equals greedy output without speculation under the same grammars, sampled rows stay valid, and
unconstrained rows in the same batches are unaffected. Forced spans (which the general path verifies) are
off, so that the programs take every drafting step; the tree program runs on the CPU as on a GPU."""
from __future__ import annotations

import contextlib
import json

import jsonschema
import pytest

from specserve import envs
from specserve.bench.schemas import SCHEMAS
from specserve.config import SpecConfig
from specserve.core import Constraint, SamplingParams
from engine_runs import run_batch

INDICES = list(range(0, len(SCHEMAS), 3))
FREE = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
FREE_PROMPTS = ["Tell me a story.", "1, 2, 3,"]
SHAPES = {"off": None, "chain": (3, 1, None), "tree": (3, 2, 6)}


def schema_params(temperature: float) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=60, temperature=temperature,
                           constraint=Constraint("json_schema", json.dumps(SCHEMAS[i]))) for i in INDICES]


def prompts() -> list[str]:
    return [f"Answer in JSON following the schema {json.dumps(SCHEMAS[i])}" for i in INDICES]


def run(llm, prompts, params):
    return run_batch(llm, prompts, params)[0]


@contextlib.contextmanager
def threaded_fills():
    """Mask fills on host threads for batches of two or more, as a many-core host runs a large batch's."""
    from specserve.structured import step_masks

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_masks, "_FILL_THREADS", 3)
        patch.setattr(step_masks, "PARALLEL_MIN_JOBS", 2)
        yield


@pytest.fixture(scope="module")
def runs(tiny_chat_model, tiny_chat_head):
    """Per configuration (speculation off, a chain of 3, a tree of 6): the greedy batch with unconstrained
    requests, the sampled batch, the program's constrained steps, and the pages left in use."""
    from specserve.llm import LLM

    results = {}
    for name, shape in SHAPES.items():
        spec = {"spec": SpecConfig("EAGLE3", str(tiny_chat_head), *shape)} if shape else {}
        with envs.override(forced_drafts=False, tree_program_on_cpu=True), threaded_fills():
            llm = LLM(model=str(tiny_chat_model), max_total_tokens=8192, **spec)
            greedy = run(llm, prompts() + FREE_PROMPTS, schema_params(0.0) + [FREE] * len(FREE_PROMPTS))
            sampled = run(llm, prompts(), schema_params(1.0))
        program = llm.engine.runner.program
        results[name] = (greedy, sampled, program.num_masked_runs if program is not None else 0,
                         llm.engine.scheduler.allocator.num_used)
        llm.close()
    return results


@pytest.mark.parametrize("config", ["chain", "tree"])
def test_the_program_takes_the_constrained_steps(runs, config):
    assert runs[config][2] > 10


@pytest.mark.parametrize("config", ["chain", "tree"])
def test_greedy_in_the_program_equals_greedy_without_speculation(runs, config):
    (spec, _, _, _), (plain, _, _, _) = runs[config], runs["off"]
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.num_spec_steps for o in spec[:len(INDICES)]) > 0


@pytest.mark.parametrize("config", ["chain", "tree"])
def test_with_program_masks_off_the_general_path_takes_them_alike(runs, tiny_chat_model, tiny_chat_head, config):
    from specserve.llm import LLM

    with envs.override(forced_drafts=False, program_masks=False, tree_program_on_cpu=True), threaded_fills():
        llm = LLM(model=str(tiny_chat_model), max_total_tokens=8192,
                  spec=SpecConfig("EAGLE3", str(tiny_chat_head), *SHAPES[config]))
        greedy = run(llm, prompts() + FREE_PROMPTS, schema_params(0.0) + [FREE] * len(FREE_PROMPTS))
    assert llm.engine.runner.program.num_masked_runs == 0
    assert [o.token_ids for o in greedy] == [o.token_ids for o in runs["off"][0]]
    # Every draft level keeps to the grammar in the programs as in the general search: the same drafts, so the
    # same steps per request.
    assert [o.num_spec_steps for o in greedy] == [o.num_spec_steps for o in runs[config][0]]
    llm.close()


@pytest.mark.parametrize("config", SHAPES)
def test_every_output_is_valid_and_nothing_leaks(runs, config):
    greedy, sampled, _, pages_in_use = runs[config]
    for outputs in (greedy[:len(INDICES)], sampled):
        for i, out in zip(INDICES, outputs, strict=True):
            if out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), SCHEMAS[i])
    assert sum(o.finish_reason == "stop" for o in greedy[:len(INDICES)] + sampled) >= len(INDICES)
    assert pages_in_use == 0


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["chain", "tree"])
def test_on_a_gpu_the_parts_replay_graphs_as_they_run_eagerly(tiny_chat_model, tiny_chat_head, config):
    """The parts' graphs, captured at each shape's first constrained step, give the eager parts' tokens and
    steps; the tree's, with its search in the Triton kernels (fed paths read from their buffers), those of the
    PyTorch search."""
    from specserve.llm import LLM

    spec = SpecConfig("EAGLE3", str(tiny_chat_head), *SHAPES[config])
    runs = {}
    for name, graphs, switches in (("graphs", True, {}), ("eager", False, {}),
                                   ("pytorch search", False, {"fused_search": False})):
        with envs.override(forced_drafts=False, **switches):
            llm = LLM(model=str(tiny_chat_model), max_total_tokens=8192, device="cuda", spec=spec,
                      disable_cuda_graph=not graphs)
            outputs = run(llm, prompts() + FREE_PROMPTS, schema_params(0.0) + [FREE] * len(FREE_PROMPTS))
        runs[name] = [(o.token_ids, o.num_spec_steps) for o in outputs]
        program = llm.engine.runner.program
        assert program.num_masked_runs > 10 and bool(program.last.masked_graphs) == graphs
        llm.close()
    assert runs["graphs"] == runs["eager"] == runs["pytorch search"]


@pytest.mark.parametrize("row", [0, 1])
def test_a_draft_level_keeps_to_the_grammar_of_its_verify_row(row):
    """`_grammar_level` reads each sequence's verify row `row` (the grammar after the drafts before the level)
    through the draft-to-target map: the head's best draft is one the grammar allows; a sequence that allows
    none of the head's tokens, and one without a grammar (all allowed), keep their logits."""
    import functools
    import types

    import torch

    from specserve.speculative.programs.base import SpecGraphs

    torch.manual_seed(row)
    bs, rows, vocab = 3, 2, 96
    draft_to_target = torch.tensor([1, 5, 8, 13, 40, 41, 77, 90])  # a draft vocabulary of 8
    allowed = torch.ones(bs * rows, vocab, dtype=torch.bool)  # rows other than `row` allow everything
    for seq in range(bs):
        allowed[seq * rows + row] = False
    allowed[row, [5, 40, 63]] = True  # draft ids 1 and 4 (63 is not in the draft vocabulary)
    allowed[rows + row, [2, 3]] = True  # none of the head's tokens
    allowed[2 * rows + row, :] = True  # unconstrained
    words = (allowed.view(bs * rows, -1, 32).long() << torch.arange(32)).sum(-1)
    program = types.SimpleNamespace(grammar_masks=words.to(torch.int32), mask_rows=rows,
                                    _draft_to_target=draft_to_target)
    program._forbid_drafts = functools.partial(SpecGraphs._forbid_drafts, program)
    logits = torch.randn(bs, len(draft_to_target))
    out = SpecGraphs._grammar_level(program, bs, logits, row)
    assert out[0].argmax().item() in (1, 4) and (out[0, [0, 2, 3, 5, 6, 7]] < -1000).all()
    assert torch.equal(out[1:], logits[1:])
