"""The adaptive draft plan: it drafts when measured costs and acceptance say a drafting step yields more
tokens per second than a plain one, stops when they say it does not, per step and per request, and in
steady state never gives up more than its occasional re-measurements cost. Driven by a cost model with a
fake clock; an engine test checks it end to end on a tiny model."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from specserve.config import SpecConfig
from specserve.engine.factory import build_engine_core
from specserve.core import Request
from specserve.core import SamplingParams
from specserve.speculative.plan import AdaptivePlan, bucket

from engine_runs import make_prompts, run_staggered, tight_config


def _requests(n: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=10_000), 10_000) for i in range(n)]


def _drive(plan: AdaptivePlan, requests: list[Request], plain_s, draft_s, accept_len, steps: int = 2000,
           seed: int = 0, switch_s=lambda batch, spell: 0.0):
    """Runs `steps` pure decode steps through the plan. plain_s(B) and draft_s(B) give a step's seconds;
    accept_len(request) the mean acceptance length of a request's drafts (drawn as two neighbouring
    integers); switch_s(B, n) what the first drafting step after n plain ones costs on top (the head's
    catch-up). Returns tokens per second and the share of steps that drafted."""
    rng = random.Random(seed)
    tokens, seconds, drafting_steps, spell = 0.0, 0.0, 0, 0
    for _ in range(steps):
        drafts = plan.step_drafts(requests)
        drafted_any = False
        for request in requests:
            k = plan.num_drafts(request) if drafts else 0
            drafted_any |= k > 0
            if k:
                mean = accept_len(request) - 1
                accepted = min(k, int(mean) + (rng.random() < mean - int(mean)))
                request.num_spec_steps += 1  # as the engine counts, before it reports
                request.num_accepted_tokens += accepted
                plan.observe_acceptance(request, k, accepted)
                tokens += 1 + accepted
            else:
                tokens += 1
        # What the engine reports: whether anything was drafted, not what the gate said.
        cost = draft_s(len(requests)) if drafted_any else plain_s(len(requests))
        if drafted_any and spell:
            cost += switch_s(len(requests), spell)
        spell = 0 if drafted_any else spell + 1
        plan.observe_step(drafted_any, len(requests), cost)
        seconds += cost
        drafting_steps += drafted_any
    return tokens / seconds, drafting_steps / steps


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 250)] == [1, 2, 4, 4, 8, 8, 16, 256]


# A GPU-like shape: a plain step's cost barely grows with the batch, a drafting one's grows 5x as fast.
PLAIN = lambda b: 10.0 + 0.02 * b  # noqa: E731
DRAFT = lambda b: 12.0 + 0.10 * b  # noqa: E731


@pytest.mark.parametrize("batch", [1, 8, 64, 250])
@pytest.mark.parametrize("tau", [1.0, 2.0, 3.0])
def test_throughput_is_within_probing_cost_of_the_better_side(batch, tau):
    plan = AdaptivePlan(max_drafts=3)
    got, drafted = _drive(plan, _requests(batch), PLAIN, DRAFT, lambda r: tau)
    plain_rate = batch / PLAIN(batch)
    draft_rate = batch * tau / DRAFT(batch)
    best = max(plain_rate, draft_rate)
    assert got >= 0.97 * best, (got, plain_rate, draft_rate, drafted)
    if draft_rate > 1.1 * plain_rate:
        assert drafted > 0.9
    if plain_rate > 1.1 * draft_rate:
        assert drafted < 0.1
    seen = plan.snapshot()  # what benchmark records show: the costs it learned, in ms
    size = bucket(batch)
    assert seen["cost_ms"][f"plain@{size}"] == pytest.approx(PLAIN(batch) * 1e3, rel=1e-3)
    assert seen["cost_ms"][f"draft@{size}"] == pytest.approx(DRAFT(batch) * 1e3, rel=1e-3)
    assert seen["samples"][f"plain@{size}"] >= 2 and seen["samples"][f"draft@{size}"] >= 2


def test_probes_of_drafting_are_spaced_by_what_the_catch_up_costs():
    """While the gate is shut the head follows nothing, so a probe of drafting first catches it up on what
    the running requests missed: more the longer the spell, up to their lifetime. Near the break-even a
    probe's own steps cost little; spaced by those alone, probes came every ~190 steps and each paid a
    catch-up of up to 5 plain steps (0.982x plain). Counting the last catch-up: 0.991x."""
    batch, tau = 64, 1.5  # a drafting step yields 92 % of a plain step's tokens per second
    # Per token missed, 1.7 % of a plain step of `batch`; a request has lived 300 steps at most.
    catch_up = lambda b, spell: 0.003 * b * min(spell, 300)  # noqa: E731
    plan = AdaptivePlan(max_drafts=3)
    got, drafted = _drive(plan, _requests(batch), PLAIN, DRAFT, lambda r: tau, steps=8000, switch_s=catch_up)
    assert got >= 0.985 * batch / PLAIN(batch), (got * PLAIN(batch) / batch, drafted)
    # The plan takes a plain step off what it measures: under overlap the switch waited for one in flight.
    assert plan.switch_cost[64] == pytest.approx(0.003 * batch * 300 - PLAIN(batch), rel=0.01)


@pytest.mark.parametrize("batch,tau", [(1, 3.0), (8, 2.5)])
def test_probes_of_plain_decode_are_charged_the_catch_up_after_them(batch, tau):
    """Where drafting wins, a probe of plain decode leaves the head behind, and the drafting step after it
    catches up. On the H200 at batch 1 that cost ~110 ms (~19 drafting steps); with probes spaced by their
    own steps alone (every ~64), a catch-up of 20 plain steps cost 11-12 % (0.89x)."""
    plan = AdaptivePlan(max_drafts=3)
    catch_up = lambda b, spell: 20 * PLAIN(b)  # noqa: E731
    got, drafted = _drive(plan, _requests(batch), PLAIN, DRAFT, lambda r: tau, steps=8000, switch_s=catch_up)
    assert got >= 0.985 * batch * tau / DRAFT(batch), (got * DRAFT(batch) / (batch * tau), drafted)


def test_it_follows_the_load_up_and_down():
    """The same plan, as the batch grows past the crossover and shrinks again (buckets keep their costs)."""
    plan = AdaptivePlan(max_drafts=3)
    shares = [_drive(plan, _requests(b), PLAIN, DRAFT, lambda r: 2.5, steps=600)[1] for b in (1, 250, 1)]
    assert shares[0] > 0.9 and shares[1] < 0.1 and shares[2] > 0.9


@pytest.mark.parametrize("tau,measured_at_once", [(1.5, False), (3.0, True)])
def test_a_larger_batch_is_not_measured_drafting_at_once_where_a_smaller_one_lost(tau, measured_at_once):
    """Waves grow the batch through buckets. Where drafting lost at 64 (tau 1.5: break-even 1.63), the
    larger bucket borrows that break-even and drafts only at its first probe, not in its first steps; where
    it won at 64 (tau 3), the larger bucket measures drafting first, as a fresh one does."""
    plan = AdaptivePlan(max_drafts=3)
    _drive(plan, _requests(64), PLAIN, DRAFT, lambda r: tau, steps=300)
    _, drafted = _drive(plan, _requests(250), PLAIN, DRAFT, lambda r: tau, steps=plan.config.probe_every)
    assert (drafted > 0) == measured_at_once
    _, drafted = _drive(plan, _requests(250), PLAIN, DRAFT, lambda r: tau, steps=300)
    assert (True, 256) in plan._samples  # measured at a probe all the same


def test_a_request_whose_drafts_fail_stops_drafting_alone():
    plan = AdaptivePlan(max_drafts=3)
    requests = _requests(4)
    hopeless = requests[0]
    counts = {r.request_id: 0 for r in requests}
    original = plan.num_drafts

    def counted(request):
        k = original(request)
        counts[request.request_id] += k > 0
        return k

    plan.num_drafts = counted
    _drive(plan, requests, PLAIN, DRAFT, lambda r: 1.0 if r is hopeless else 3.5, steps=1000)
    assert counts["r1"] > 900 and counts["r2"] > 900
    assert counts["r0"] < 100  # re-measured now and then, never more


def test_a_step_after_a_switch_is_not_timed():
    plan = AdaptivePlan(max_drafts=3)
    requests = _requests(2)
    assert plan.step_drafts(requests)  # nothing measured yet: drafting first
    plan.observe_step(True, 2, 100.0)  # the first of its side: paid for the switch
    assert (True, 2) not in plan.cost
    for seconds in (12.0, 14.0):  # two times, so that one outlier cannot be the cost
        assert plan.step_drafts(requests)
        plan.observe_step(True, 2, seconds)
    assert plan.cost[(True, 2)] == 12.0  # the lower median
    assert not plan.step_drafts(requests)  # the plain cost is still missing
    plan.observe_step(False, 2, 999.0)
    plan.observe_other_step()  # a prompt chunk in between starts a new streak
    assert not plan.step_drafts(requests)
    plan.observe_step(False, 2, 999.0)
    assert (False, 2) not in plan.cost


def _count_drafting_steps(engine) -> list[int]:
    """Wraps engine.step; the list holds how many steps drafted for some request."""
    counted, step = [0], engine.step

    def counting():
        deltas = step()
        counted[0] += any(d.step_accepted is not None for d in deltas)
        return deltas

    engine.step = counting
    return counted


@pytest.mark.parametrize("draft", ["random-eagle3", "target-itself"])
def test_engine_output_is_unchanged_and_useless_drafts_stop(tiny_checkpoint, random_eagle3_head, draft):
    """Greedy output with the plan equals output without speculation while requests arrive and finish, and no
    page leaks. With a random head (nothing accepted) drafting soon stops; with the target as its own draft
    (everything accepted) it goes on, given step costs where that pays."""
    target = tiny_checkpoint("llama", True)
    spec = (SpecConfig("EAGLE3", str(random_eagle3_head), 3, adaptive=True) if draft == "random-eagle3"
            else SpecConfig("DRAFT_MODEL", str(target), 3, adaptive=True))
    prompts = make_prompts(512, seed=5)
    plain, _ = build_engine_core(tight_config(str(target), 4000), progress=False)
    expected, plain_steps = run_staggered(plain, prompts, max_tokens=120)
    engine, _ = build_engine_core(replace(tight_config(str(target), 4000), spec=spec), progress=False)
    # Step times from a cost model, not this machine's clock: a drafting step costs 1.3 plain ones.
    observe = engine.observer.observe_step
    engine.observer.observe_step = lambda drafted, size, seconds: observe(drafted, size, 1.3 if drafted else 1.0)
    drafting_steps = _count_drafting_steps(engine)
    outputs, steps = run_staggered(engine, prompts, max_tokens=120)
    spec_steps = drafting_steps[0]
    assert outputs == expected
    assert engine.scheduler.allocator.num_used == 0
    if draft == "random-eagle3":
        assert spec_steps < 0.25 * steps, (spec_steps, steps)
    else:
        assert steps < 0.6 * plain_steps, (spec_steps, steps, plain_steps)


def test_while_the_gate_is_shut_drafters_stay_behind_and_catch_up_when_it_opens():
    """Steps the gate keeps from drafting give the drafter nothing to follow, not even a prompt chunk; the
    next drafting step catches up on everything."""
    from specserve.config import SchedulerConfig
    from specserve.kv.pages import PageAllocator
    from specserve.engine.scheduler import Scheduler

    gate = {"open": False}
    sched = Scheduler(SchedulerConfig(max_running_requests=4, chunked_prefill_size=12), PageAllocator(100, 4), 512,
                      draft_plan=lambda request: 3, max_draft_tokens=3, draft_gate=lambda requests: gate["open"])
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=20), 20)
    sched.add(a)
    assert sched.schedule().seqs[0].draft_catchup_ids == [1, 2, 3]  # a prompt chunk: the drafter follows
    a.num_computed_tokens = a.num_draft_computed_tokens = 3
    for token in (7, 8, 9):
        a.token_ids.append(token)
        (seq,) = sched.schedule().seqs
        assert (seq.num_draft_tokens, seq.draft_catchup_ids) == (0, [])
        a.num_computed_tokens += 1
    a.token_ids.append(10)
    sched.add(Request("b", [4, 5], SamplingParams(max_tokens=20), 20))
    seqs = sched.schedule().seqs  # b's prompt is pending; the gate was shut at the last decode step
    assert [(s.request_id, s.draft_catchup_ids) for s in seqs] == [("a", []), ("b", [])]
    a.num_computed_tokens += 1
    sched.requests["b"].num_computed_tokens = 2
    a.token_ids.append(11)
    sched.requests["b"].token_ids.append(12)
    gate["open"] = True
    seq_a, seq_b = sched.schedule().seqs
    assert (seq_a.num_draft_tokens, seq_a.draft_catchup_ids) == (3, [7, 8, 9, 10, 11])
    assert (seq_b.num_draft_tokens, seq_b.draft_catchup_ids) == (3, [4, 5, 12])


def test_drafting_pays_answers_from_the_measured_costs_without_planning():
    """What the scheduler asks in steps with prompts: unmeasured buckets count as paying (drafting is measured
    first there), measured ones by their costs, larger ones by a smaller bucket's losing break-even; asking
    changes nothing the plan does next."""
    plan = AdaptivePlan(max_drafts=3)
    assert not plan.drafting_pays([])
    assert plan.drafting_pays(_requests(4))  # nothing measured
    hopeless = _requests(16)
    _drive(plan, hopeless[:4], PLAIN, DRAFT, lambda r: 1.0, steps=200)  # drafting loses for them at batch 4
    assert not plan.drafting_pays(hopeless[:4])
    for request in hopeless[4:]:  # like the first four
        request.num_spec_steps, request.num_accepted_tokens = 50, 0
    assert not plan.drafting_pays(hopeless) and (True, 16) not in plan.cost  # borrowed from batch 4
    winning = AdaptivePlan(max_drafts=3)
    _drive(winning, _requests(4), PLAIN, DRAFT, lambda r: 3.5, steps=200)
    assert winning.drafting_pays(_requests(4)) and winning.drafting_pays(_requests(64))  # 64: unmeasured
    state = (dict(winning.cost), dict(winning._side), winning._planned, winning._streak, winning.break_even)
    winning.drafting_pays(_requests(4))
    assert (dict(winning.cost), dict(winning._side), winning._planned, winning._streak, winning.break_even) == state


def test_prompt_chunks_are_followed_only_if_the_batch_they_join_is_to_draft():
    """The gate's last answer belongs to the last pure decode step's batch (a wave's small tail, say); a
    step with prompts asks the follow gate about the batch it builds: the running requests and the waiting
    ones that fit beside them."""
    from specserve.config import SchedulerConfig
    from specserve.kv.pages import PageAllocator
    from specserve.engine.scheduler import Scheduler

    asked, pays = [], {"value": False}

    def follow_gate(requests):
        asked.append([r.request_id for r in requests])
        return pays["value"]

    sched = Scheduler(SchedulerConfig(max_running_requests=3, chunked_prefill_size=4), PageAllocator(100, 4), 512,
                      draft_plan=lambda request: 3, max_draft_tokens=3, draft_gate=lambda requests: True,
                      follow_gate=follow_gate)
    for name in "abcd":
        sched.add(Request(name, [1, 2, 3], SamplingParams(max_tokens=20), 20))
    first = sched.schedule().seqs  # a and b admitted (4-token budget: 3 + 1), c and d wait
    assert [s.request_id for s in first] == ["a", "b"] and asked == [["a", "b", "c"]]  # d does not fit
    assert all(s.draft_catchup_ids == [] for s in first)  # drafting would not pay: nothing followed
    pays["value"] = True
    sched.requests["a"].num_computed_tokens = 3
    sched.requests["a"].token_ids.append(9)  # a decodes now; b's prompt goes on, c's starts
    sched.requests["b"].num_computed_tokens = 1
    seqs = sched.schedule().seqs
    assert asked[-1] == ["a", "b", "c"]
    # Followed up to what is known: a's newest token and c's one-token chunk wait for a later step.
    assert [(s.request_id, s.draft_catchup_ids) for s in seqs] == [("a", [1, 2, 3]), ("b", [1, 2, 3]), ("c", [])]


def test_drafting_resumes_when_acceptance_comes_back():
    """Probes let every request draft, even those the last estimate put below the break-even, so a plan that
    stopped drafting for hopeless requests sees better ones when they come."""
    plan = AdaptivePlan(max_drafts=3)
    _, hopeless = _drive(plan, _requests(8), PLAIN, DRAFT, lambda r: 1.0, steps=1000)
    _, good = _drive(plan, _requests(8), PLAIN, DRAFT, lambda r: 3.5, steps=1500)
    assert hopeless < 0.05 and good > 0.7, (hopeless, good)


def test_a_step_cut_short_counts_for_the_load_it_was_planned_at():
    """The token budget may schedule fewer requests than the gate was asked about; the time still tells
    what that side costs at this load, or the plan would try to measure it forever."""
    plan = AdaptivePlan(max_drafts=3)
    requests = _requests(250)
    for _ in range(3):
        assert plan.step_drafts(requests)
        plan.observe_step(True, 128, 30.0)
    assert plan.cost == {(True, 256): 30.0}
    assert not plan.step_drafts(requests)  # on to the plain side


def test_a_probe_cut_by_a_prompt_step_runs_until_it_is_timed():
    """A prompt step after each probe step leaves every probe step untimed (each is the first of its streak):
    the probe goes on past `probe_len` steps, and gives up after 4x as many."""
    plan = AdaptivePlan(max_drafts=3)
    requests = _requests(64)
    _drive(plan, requests, PLAIN, DRAFT, lambda r: 1.5, steps=300)  # plain wins clearly at 64
    samples = plan._samples[(True, 64)]
    runs, run = [], 0
    for _ in range(2 * 4 * plan.config.probe_every):
        drafts = plan.step_drafts(requests)
        plan.observe_step(drafts, 64, DRAFT(64) if drafts else PLAIN(64))
        if drafts:
            plan.observe_other_step()
            run += 1
        elif run:
            runs, run = runs + [run], 0
    assert plan._samples[(True, 64)] == samples
    assert runs and all(r == 4 * plan.config.probe_len for r in runs), runs


def test_one_slow_step_does_not_stop_drafting():
    """A drafting step that ran long once (a kernel built on first use, a busy machine) must not shut the
    gate until the next probe: costs are the lower median of recent step times."""
    plan = AdaptivePlan(max_drafts=3)
    requests = _requests(4)
    _drive(plan, requests, PLAIN, DRAFT, lambda r: 3.0, steps=50)
    slow = iter([1000.0])
    _, share = _drive(plan, requests, PLAIN, lambda b: next(slow, DRAFT(b)), lambda r: 3.0, steps=200)
    assert share > 0.95


def test_a_lone_request_that_started_badly_is_tried_again_soon():
    """At batch 1 the gate is the request's own verdict. A request whose first drafts fail stops drafting; it
    is due again after `probe_every` steps, counted at the recent requests' mean, not at the next step-level
    probe (here ~90 steps away, by the probes' cost budget)."""
    plan = AdaptivePlan(max_drafts=3)
    plain, draft = (lambda b: 10.0), (lambda b: 13.0)  # break-even 1.3: a clear win for plain at tau 1
    _drive(plan, _requests(1), plain, draft, lambda r: 3.0, steps=200)  # earlier requests accepted well
    late_starter = _requests(1)
    drafted = []
    for step in range(400):  # its text is hard to predict for 40 steps, easy from then on
        drafted.append(_drive(plan, late_starter, plain, draft, lambda r: 1.0 if step < 40 else 3.0, steps=1,
                              seed=step)[1])
    pauses = "".join("1" if d else "0" for d in drafted).strip("0").split("1")
    longest_pause = max(len(p) for p in pauses)
    assert 0 < longest_pause <= plan.config.probe_every + 1, longest_pause
    assert sum(drafted[200:]) >= 200 - 2 * plan.config.probe_len  # then drafts on, but for a probe of plain steps


def test_probes_of_a_side_that_loses_by_far_cost_at_most_their_budget():
    """Where a drafting step costs 3.7 plain ones and yields 2 tokens (the 2-core CPU at batch 32), each probe
    gives up ~1.7 plain steps a step; probes are spaced so that they cost about `probe_budget` of the time
    (every 256 steps, as before, they cost 2 %)."""
    plan = AdaptivePlan(max_drafts=3)
    plain, draft = (lambda b: 10.0), (lambda b: 37.0)
    got, drafted = _drive(plan, _requests(32), plain, draft, lambda r: 2.0, steps=6000)
    best = 32 / plain(32)
    assert got >= (1 - plan.config.probe_budget) * best, (got / best, drafted)  # every 256 steps: 0.986
    assert 0 < drafted < 0.005


def test_drafts_cut_by_the_room_left_do_not_lower_the_recent_mean():
    """A request's last steps draft only what fits before its max_tokens, and accept at most that. On an
    H200 a wave of 30 requests finishing together drew the mean from 4.0 to 3.1, under the break-even, so
    the next wave's requests did not draft (tree at C = 30: 0.92x plain)."""
    plan = AdaptivePlan(max_drafts=4)
    request = _requests(1)[0]
    for _ in range(200):
        plan.observe_acceptance(request, 4, 3)
    assert plan.mean_accept_len == pytest.approx(4.0, abs=0.01)
    for _ in range(30):
        plan.observe_acceptance(request, 1, 1)  # the room left held one draft
    assert plan.mean_accept_len == pytest.approx(4.0, abs=0.01)
    assert request.steps_since_drafting == 0
    plan.observe_acceptance(request, 4, 0)  # a full draft that failed still counts
    assert plan.mean_accept_len < 3.95



def test_expected_tokens_follow_the_counts_within_a_step():
    # The plan keeps each request's expected tokens per shape for a step's decision; acceptance observed
    # meanwhile (under overlap, the step before's) must show in what it answers next.
    plan = AdaptivePlan(3, chains=(1, 2))
    a, b = _requests(2)
    plan.step_drafts([a, b])
    before = [plan._tokens(a, depth) for depth in (1, 2, 3)]
    assert before == [plan._tokens(b, depth) for depth in (1, 2, 3)]  # nothing counted yet: the prior
    for _ in range(20):
        plan.observe_acceptance(a, 3, 0)  # a's first drafts always rejected
    after = [plan._tokens(a, depth) for depth in (1, 2, 3)]
    assert all(x < y for x, y in zip(after, before))
    fresh = AdaptivePlan(3, chains=(1, 2))
    fresh.position_accept = list(plan.position_accept)
    assert after == [fresh._tokens(a, depth) for depth in (1, 2, 3)]  # the same as computed afresh


def test_an_unmeasured_catch_up_is_estimated_from_a_smaller_batchs():
    # The catch-up grows with the requests that missed tokens: a larger bucket's first probe of drafting is
    # spaced as if it cost the nearest smaller bucket's, scaled by the batch, not as if it were free.
    plan = AdaptivePlan(max_drafts=3)
    plan.switch_cost[128] = 0.15
    assert plan._switch_cost(128) == 0.15 and plan._switch_cost(64) == 0.0
    assert plan._switch_cost(256) == pytest.approx(0.30)
    plain, draft = 0.016, 0.036
    unknown = AdaptivePlan(max_drafts=3)._probe_interval(0.45, draft, plain, 256)
    assert plan._probe_interval(0.45, draft, plain, 256) > unknown


def test_a_buckets_first_catch_up_is_measured_once_its_drafting_cost_is_known():
    # A bucket whose drafting borrowed a smaller one's verdict runs plain; its first probe of drafting catches
    # the head up before its drafting cost is known. That catch-up (beyond a drafting step and the plain step
    # waited for) is the bucket's as soon as a drafting step there is timed, not at the next probe.
    plan = AdaptivePlan(max_drafts=3)
    _drive(plan, _requests(64), PLAIN, DRAFT, lambda r: 1.0, steps=300)  # drafting loses at 64
    requests, spell, catch_up = _requests(100), 0, 500.0
    for _ in range(3000):
        drafts = plan.step_drafts(requests)
        drafted = drafts and any(plan.num_drafts(r) for r in requests)
        for request in requests:
            if drafted:
                request.num_spec_steps += 1
                plan.observe_acceptance(request, 3, 0)
        cost = (DRAFT(100) + (catch_up if spell else 0.0)) if drafted else PLAIN(100)
        spell = 0 if drafted else spell + 1
        plan.observe_step(drafted, 100, cost)
        if plan._samples.get((True, 128), 0) >= 1:
            break
    assert plan._samples[(True, 128)] == 1
    assert plan.switch_cost[128] == pytest.approx(catch_up - PLAIN(100))
