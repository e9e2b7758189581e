"""EAGLE-3 chains as one program per step (speculative/programs/chain.py), run eagerly on the CPU: the same drafts,
acceptance and outputs as the general tree path, lossless against HF, and simulated acceptance unchanged."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specserve.config import SpecConfig
from specserve.speculative.programs.chain import accept_chain, accept_chain_sampled
from specserve.engine.factory import build_engine_core
from specserve.llm import LLM
from specserve.core import SamplingParams

from distribution_checks import assert_drawn_from
from engine_runs import (count_accepted, hf_greedy, make_prompts, run_mixed_sampling, run_staggered, tight_config,
                         watch_drafting_paths)
from tiny_checkpoints import write_peaked_random_head


def test_accept_chain_takes_the_matching_prefix_then_the_targets_token():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    best = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 6, 7, 8]])
    tokens, accepted = accept_chain(drafts, best)
    assert accepted.tolist() == [3, 1, 0]
    assert [t[: a + 1] for t, a in zip(tokens.tolist(), accepted.tolist())] == [[5, 6, 7, 8], [5, 9], [1]]
    tokens, accepted = accept_chain(drafts, best, forced=torch.tensor([2, 0, 3]))
    assert [t[: a + 1] for t, a in zip(tokens.tolist(), accepted.tolist())] == [[5, 6, 7], [5], [5, 6, 7, 8]]
    # A sequence scheduled with fewer drafts (near its max_tokens) accepts at most those.
    tokens, accepted = accept_chain(drafts, best, limit=torch.tensor([1, 3, 2]))
    assert [t[: a + 1] for t, a in zip(tokens.tolist(), accepted.tolist())] == [[5, 6], [5, 9], [1]]


def _chain_draws(probs: torch.Tensor, drafts: list[int], rows: int, limit: int | None = None) -> list[list[int]]:
    k = len(drafts)
    limits = None if limit is None else torch.full((rows,), limit)
    tokens, accepted = accept_chain_sampled(torch.tensor(drafts).expand(rows, k), probs.expand(rows, -1, -1),
                                            limit=limits)
    return [t[: a + 1] for t, a in zip(tokens.tolist(), accepted.tolist())]


def test_sampled_chain_acceptance_keeps_the_target_distribution():
    """The program's acceptance of a sampled row, on fixed target distributions p_0..p_3 after the root and each
    of 3 drafts: the first emitted token is drawn from p_0, and the token after the first i drafts (when the
    row emitted them) from p_i. With a limit of one draft (a request near its end) nothing comes after the
    second token, which is drawn from p_1 whole."""
    torch.manual_seed(0)
    vocab, rows = 7, 40_000
    probs = torch.softmax(torch.randn(4, vocab) * 1.5, dim=-1)
    probs[2, 3] = 0.0  # a token the target never takes at depth 2 (as top-k or top-p leave it)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    drafts = probs[:3].argmax(dim=-1).tolist()  # likely drafts, so enough rows reach depth 3
    drafts[1] = int(probs[1].argsort()[-2])  # and one less likely one
    emitted = _chain_draws(probs, drafts, rows)
    for depth in range(4):
        along = [e for e in emitted if e[:depth] == drafts[:depth]]
        assert all(len(e) > depth for e in along)
        assert_drawn_from([e[depth] for e in along], probs[depth])
    assert sum(len(e) == 4 for e in emitted) > 500
    limited = _chain_draws(probs, drafts, rows, limit=1)
    assert max(len(e) for e in limited) == 2
    assert_drawn_from([e[0] for e in limited], probs[0])
    assert_drawn_from([e[1] for e in limited if e[0] == drafts[0]], probs[1])


def test_sampled_requests_without_a_seed_take_the_chain_program(tmp_path, tiny_checkpoint):
    """Greedy rows, sampled rows and sampled rows with top-k 1 in one batch, all through the program (the general
    search never drafts): the greedy and top-k 1 rows equal HF's greedy output, the fully sampled rows differ
    from it, and every page comes back. Seeded requests keep the general path."""
    engine, path = _random_head_engine(tmp_path, tiny_checkpoint)
    general, _ = watch_drafting_paths(engine)
    prompts = make_prompts(512, seed=4)[:6]
    outputs = run_mixed_sampling(engine, prompts)
    reference = hf_greedy(path, prompts, max_tokens=24)
    assert all(len(out) == 24 for out in outputs)
    assert [out == ref for out, ref in zip(outputs, reference)] == [True, True, False] * 2
    assert engine.runner.program.num_runs > 5 and general and not any(general)
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages
    general.clear()
    engine.add_request("seeded", prompts[0], SamplingParams(max_tokens=24, temperature=1.5, seed=7, ignore_eos=True))
    while engine.has_work():
        engine.step()
    assert any(general)


def _generate(llm: LLM, prompts, params, chain: bool):
    runner = llm.engine.runner
    saved, runner.program = runner.program, runner.program if chain else None
    try:
        outs = llm.generate(prompts, params)
    finally:
        runner.program = saved
    return [(o.token_ids, o.num_spec_steps, o.num_accepted_tokens) for o in outs]


def test_chain_program_drafts_what_the_tree_search_drafts(smollm2_dir):
    """The bundled head on SmolLM2: equal outputs and equal acceptance per request mean equal drafts."""
    from specserve import draft_heads

    llm = LLM(model=str(smollm2_dir), max_total_tokens=4096, spec=SpecConfig("EAGLE3", str(draft_heads.SMOLLM2_HEAD), 3))
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in
               ("Name three planets.", "Write a haiku about rain.", "What is 12 times 7?")]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    chain = llm.engine.runner.program
    runs_before, short = chain.num_runs, []
    run = chain.launch
    chain.launch = lambda batch, timer: short.append(min(s.num_draft_tokens for s in batch.seqs) < 3) or run(batch, timer)
    fast = _generate(llm, prompts, params, chain=True)
    chain.launch = run
    assert chain.num_runs - runs_before > 10
    assert any(short)  # the last steps before max_tokens, scheduled with fewer drafts, ran as the program too
    assert fast == _generate(llm, prompts, params, chain=False)
    assert sum(accepted for _, _, accepted in fast) > 10


def _random_head_engine(tmp_path, tiny_checkpoint, **spec):
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    config = replace(tight_config(str(path), 200), spec=SpecConfig("EAGLE3", str(tmp_path), 3, **spec))
    engine, _ = build_engine_core(config, progress=False)
    return engine, path


def test_chain_program_is_lossless_under_preemption(tmp_path, tiny_checkpoint):
    engine, path = _random_head_engine(tmp_path, tiny_checkpoint)
    prompts = make_prompts(512, seed=4)
    outputs, _ = run_staggered(engine, prompts)
    assert engine.runner.program.num_runs > 10 and engine.scheduler.num_preemptions > 0
    assert outputs == hf_greedy(path, prompts)
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages


def test_simulated_acceptance_is_the_same_on_both_paths(tmp_path, tiny_checkpoint):
    prompts = make_prompts(512, seed=2)
    runs = []
    for chain in (True, False):
        engine, _ = _random_head_engine(tmp_path, tiny_checkpoint, simulate_accept_len=2.5)
        if not chain:
            engine.runner.program = None
        accepted = count_accepted(engine)
        outputs, _ = run_staggered(engine, prompts)
        assert (engine.runner.program is None) != chain
        if chain:
            assert engine.runner.program.num_runs > 3
        runs.append((outputs, accepted))
    assert runs[0] == runs[1]
    mean = 1 + sum(runs[0][1]) / len(runs[0][1])
    assert abs(mean - 2.5) < 0.25


@pytest.mark.parametrize("overlap", [False, True])
def test_every_drafting_step_is_one_program_while_requests_arrive(tmp_path, tiny_checkpoint, overlap):
    """Steps draft only when no prompt is pending, the head extends over prompt chunks and over what steps
    without drafts computed, and a request on its last token rides along with no drafts, so with staggered
    arrivals and preemption the tree search never drafts: every drafting step is the chain program. With overlap (forced on here; a GPU's default) the prompt steps are in flight
    when the next step is scheduled. Output stays HF's."""
    engine, path = _random_head_engine(tmp_path, tiny_checkpoint)
    engine.overlap = overlap
    general, _ = watch_drafting_paths(engine)
    prompts = make_prompts(512, seed=4)
    outputs, _ = run_staggered(engine, prompts)
    assert engine.runner.program.num_runs > 10 and engine.scheduler.num_preemptions > 0
    assert general and not any(general)
    assert outputs == hf_greedy(path, prompts)


def _shut_six_open_six():
    calls = [0]

    def gate(requests):
        calls[0] += 1
        return (calls[0] // 6) % 2 == 1
    return gate


@pytest.mark.parametrize("shape,overlap", [("chain", False), ("chain", True), ("tree", True)])
def test_a_head_left_behind_by_a_shut_gate_catches_up_before_the_program(tmp_path, tiny_checkpoint, shape,
                                                                          overlap, switches):
    """While the draft plan keeps steps from drafting, the head does not follow the decoders; the first step
    that drafts again finds it more tokens behind than the program's catch-up rows. The head catches up on
    the backlog first, so that step is still the program (never the general search), and output stays HF's."""
    from test_tree_program import _tree_engine

    if shape == "chain":
        engine, path = _random_head_engine(tmp_path, tiny_checkpoint)
    else:
        engine, path = _tree_engine(tmp_path, tiny_checkpoint, switches)
    engine.overlap = overlap
    engine.scheduler.draft_gate = _shut_six_open_six()
    general, backlogs = watch_drafting_paths(engine)
    program = engine.runner.program
    prompts = make_prompts(512, seed=4)
    outputs, _ = run_staggered(engine, prompts, max_tokens=40)
    assert program.num_runs > 10 and len(backlogs) > 2
    assert not any(general)
    assert outputs == hf_greedy(path, prompts, max_tokens=40)
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages


def test_after_a_shut_spell_the_program_drafts_what_the_tree_search_drafts(smollm2_dir):
    """The bundled head on SmolLM2, drafting in every other run of six steps: a head that caught up wrongly
    on its backlog would draft other tokens after each shut spell, and accept other counts."""
    from specserve import draft_heads

    llm = LLM(model=str(smollm2_dir), max_total_tokens=4096, spec=SpecConfig("EAGLE3", str(draft_heads.SMOLLM2_HEAD), 3))
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in
               ("Name three planets.", "Write a haiku about rain.", "What is 12 times 7?")]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    _, backlogs = watch_drafting_paths(llm.engine)
    runs = []
    for chain in (True, False):
        llm.engine.scheduler.draft_gate = _shut_six_open_six()
        runs.append(_generate(llm, prompts, params, chain=chain))
    assert len(backlogs) > 2
    assert runs[0] == runs[1]
    assert sum(accepted for _, _, accepted in runs[0]) > 10


def test_the_backlog_pass_as_decode_rows_writes_what_a_prefill_chunk_writes(tmp_path, tiny_checkpoint, monkeypatch):
    """The GPU's form of the backlog pass (every row attending like a decode row, through its page table) and
    the prefill chunk the CPU uses write the same head KV. Run here with the page-table form served by the
    PyTorch statement of the decode kernel's contract, so the rows, slots and tables it builds are checked
    without a GPU."""
    from specserve.layers.attention import AttentionMetadata
    from specserve.speculative.programs import base as program_base
    from specserve.speculative.drafters.base import catch_up_meta, eagle3_catch_up

    engine, _ = _random_head_engine(tmp_path, tiny_checkpoint)
    gate = {"open": False}
    engine.scheduler.draft_gate = lambda requests: gate["open"]
    engine.scheduler._gate_open = False  # the head follows the prompt chunks, not the decoders
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(512, seed=4)[:3]):
        engine.add_request(str(i), prompt, params)
    for _ in range(24):
        engine.step()
    engine._read_back()
    gate["open"] = True
    batch = engine.scheduler.schedule()
    program, drafter = engine.runner.program, engine.runner.proposer.drafter
    w = program.width
    behind = [replace(s, draft_catchup_ids=s.draft_catchup_ids[:-w]) for s in batch.seqs]
    assert len(behind) == 3 and min(len(s.draft_catchup_ids) for s in behind) > 10  # ~20 generated tokens each

    def page_table_form(positions, slots, tables, page_size, kv_heads, max_context=None):
        return AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=(positions + 1).to(torch.int32),
                                 page_size=page_size)
    monkeypatch.setattr(program_base, "decode_rows_meta", page_table_form)
    before = drafter.kv_cache.clone()
    rows_out = program._extend_head(behind)
    as_rows = drafter.kv_cache.clone()
    drafter.kv_cache.copy_(before)
    # The prefill chunk, as drafter.catch_up runs it, keeping every row's output (it returns the last ones).
    ids, positions, meta, _ = catch_up_meta([eagle3_catch_up(s) for s in behind], behind, batch.page_size,
                                             drafter.kv_cache.device)
    chunk_out = drafter.head(drafter.embed(ids), drafter.taps[meta.slot_mapping], positions, meta, drafter.kv_cache)
    torch.testing.assert_close(rows_out, chunk_out, atol=1e-4, rtol=1e-4)  # attention read the right contexts
    slots_written = lambda cache: (cache != before).transpose(0, 2).flatten(1).any(1)  # noqa: E731  [layers, 2, slots, ...]
    assert slots_written(as_rows).sum() > 30
    assert torch.equal(slots_written(as_rows), slots_written(drafter.kv_cache))
    torch.testing.assert_close(as_rows, drafter.kv_cache, atol=1e-5, rtol=1e-5)


def _count_following(engine) -> list[int]:
    """Wraps the runner's launch to collect the size of every step that followed a program step in flight."""
    following, launch = [], engine.runner.launch

    def counted(batch, publish=False):
        if batch.follow is not None:
            following.append(len(batch.seqs))
        return launch(batch, publish)
    engine.runner.launch = counted
    return following


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_overlapped_drafting_steps_follow_each_other_and_stay_lossless(tmp_path, tiny_checkpoint, shape,
                                                                       switches):
    """With overlap, a drafting step is launched before the one in flight is read back, its inputs derived
    on the device from that step's results. Staggered arrivals (which make the next step wait for the one in
    flight), preemption, and requests finishing while a step that includes them is in flight: the output is
    HF's, and every page comes back."""
    from test_tree_program import _tree_engine

    if shape == "chain":
        engine, path = _random_head_engine(tmp_path, tiny_checkpoint)
    else:
        engine, path = _tree_engine(tmp_path, tiny_checkpoint, switches)
    engine.overlap = True
    following = _count_following(engine)
    prompts = make_prompts(512, seed=4)
    outputs, _ = run_staggered(engine, prompts, max_tokens=48)
    assert len(following) > 10 and max(following) > 1 and engine.scheduler.num_preemptions > 0
    assert outputs == hf_greedy(path, prompts, max_tokens=48)
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages and not engine.has_work()


@pytest.mark.parametrize("topk", [1, 4])
def test_overlapped_drafting_steps_draft_what_synchronous_steps_draft(smollm2_dir, switches, topk):
    """The bundled head on SmolLM2 (it accepts often): following steps, whose catch-up, root and slots the
    device derives, accept per request exactly what steps scheduled from exact state accept. A wrong catch-up
    would draft other tokens (the output would stay the target's: only the acceptance shows it)."""
    from specserve import draft_heads

    switches(tree_program_on_cpu=True)
    spec = SpecConfig("EAGLE3", str(draft_heads.SMOLLM2_HEAD), 3, topk, 8 if topk > 1 else None)
    llm = LLM(model=str(smollm2_dir), max_total_tokens=4096, spec=spec)
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in
               ("Name three planets.", "Write a haiku about rain.", "What is 12 times 7?")]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    runs = []
    for overlap in (True, False):
        llm.engine.overlap = overlap
        following = _count_following(llm.engine)
        runs.append(_generate(llm, prompts, params, chain=True))
        assert (len(following) > 5) == overlap
        del llm.engine.runner.launch  # the wrapper: the class's method again
    assert runs[0] == runs[1]
    assert sum(accepted for _, _, accepted in runs[0]) > 10


def test_a_row_that_drafted_nothing_is_not_followed(smollm2_dir):
    """A plan that holds one request back for the first 20 steps (no drafts, its head left behind) while the
    others draft, then lets it draft: the step after the one in which it was last held must catch its head up on
    all it missed, which only a step scheduled from exact state does. The plan decides by step count alone, so
    both runs make the same decisions, and each request accepts exactly what it accepts without overlap."""
    from specserve import draft_heads

    spec = SpecConfig("EAGLE3", str(draft_heads.SMOLLM2_HEAD), 3)
    llm = LLM(model=str(smollm2_dir), max_total_tokens=4096, spec=spec)
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in
               ("Name three planets.", "Write a haiku about rain.", "What is 12 times 7?")]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    scheduler, asked = llm.engine.scheduler, [0]

    def gate(requests):
        asked[0] += 1
        return True

    def plan(request):
        held = int(request.request_id) % 3 == 0 and asked[0] < 20
        return 0 if held else 3
    scheduler.draft_gate, scheduler.draft_plan = gate, plan
    runs = []
    for overlap in (True, False):
        llm.engine.overlap, asked[0] = overlap, 0
        following = _count_following(llm.engine)
        runs.append(_generate(llm, prompts, params, chain=True))
        assert (len(following) > 5) == overlap
        del llm.engine.runner.launch  # the wrapper: the class's method again
    assert runs[0] == runs[1]


def test_a_following_step_that_fails_to_launch_falls_back_to_a_scheduled_step(tmp_path, tiny_checkpoint):
    """If launching a following step raises, the engine waits for the step in flight and schedules the next
    from exact state, with the gate's answer of that step (asked once a step, as without overlap)."""
    engine, path = _random_head_engine(tmp_path, tiny_checkpoint)
    engine.overlap = True
    asked, failed, launch = [], [], engine.runner.launch

    def flaky(batch, publish=False):
        if batch.follow is not None and len(failed) % 2 == 0:
            failed.append(len(batch.seqs))
            raise RuntimeError("injected launch failure")
        if batch.follow is not None:
            failed.append(0)
        return launch(batch, publish)
    engine.runner.launch = flaky
    engine.scheduler.draft_gate = lambda requests: asked.append(1) or True
    step = engine.step

    def one_question_a_step():
        before = len(asked)
        deltas = step()
        assert len(asked) - before <= 1
        return deltas
    engine.step = one_question_a_step
    prompts = make_prompts(512, seed=4)
    outputs, _ = run_staggered(engine, prompts, max_tokens=48)
    assert sum(1 for n in failed if n) > 3 and 0 in failed
    assert outputs == hf_greedy(path, prompts, max_tokens=48)
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages
