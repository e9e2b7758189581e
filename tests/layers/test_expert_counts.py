"""Counting the distinct experts MoE layers touch (`ExpertCounts`, `bench --count-experts`): the device-side count
equals the distinct ids of each router's top-k, step kind by step kind, and a chain step's verify rows touch at
least the experts of the plain step of the same batch."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specserve.bench import experts
from specserve.config import SpecConfig
from specserve.core import SamplingParams
from specserve.engine.factory import build_engine_core
from specserve.layers.moe import ExpertCounts, FusedExperts
from specserve.speculative.plan import ExpertReads

from engine_runs import make_prompts, tight_config

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class _Engine:
    """What `watch_steps` and `summary` read of an LLM."""

    def __init__(self, engine) -> None:
        self.engine = engine


def _counting_engine(config):
    with experts.counting(config) as counts:
        engine, _ = build_engine_core(config, progress=False)
    experts.watch_steps(_Engine(engine), counts)
    return engine, counts


def _router_reference(model, counts: ExpertCounts, kind: str) -> dict[str, list[int]]:
    """Per kind of step: the distinct experts of each MoE layer forward, from the router's own output (DeepSeek-V3's
    grouped top-k) or from a plain softmax top-k of the router's logits (Qwen3-MoE)."""
    reference = {k: [] for k in ExpertCounts.KINDS}
    for module in model.modules():
        if not hasattr(module, "experts") or not isinstance(module.experts, FusedExperts):
            continue

        def record(router, args, output, block=module):
            ids = output[1] if kind == "deepseek-v3" else output.softmax(-1).topk(block.top_k, dim=-1).indices
            reference[ExpertCounts.KINDS[int(counts.kind)]].append(ids.unique().numel())
        module.gate.register_forward_hook(record)
    return reference


@pytest.mark.parametrize("kind", ["qwen3-moe", "deepseek-v3"])
def test_counts_equal_the_routers_top_k(kind, tiny_checkpoint):
    engine, counts = _counting_engine(tight_config(str(tiny_checkpoint(kind)), 512))
    counts.reset()  # forwards before the first step (none on a CPU) count as "other"
    reference = _router_reference(engine.runner.model, counts, kind)
    for i, prompt in enumerate(make_prompts(512)[:5]):
        engine.add_request(str(i), prompt, PARAMS)
    while engine.has_work():
        engine.step()
    got = counts.summary(engine.runner.model)
    assert set(got) == {"prompt", "decode"}
    for step_kind, summary in got.items():
        assert summary["layer_forwards"] == len(reference[step_kind])
        assert summary["mean_distinct_experts_per_layer"] == round(sum(reference[step_kind]) / len(reference[step_kind]), 3)
    assert got["decode"]["steps"] == 5 and 2 <= got["decode"]["mean_distinct_experts_per_layer"] <= 8


def _first_step_after_prompts(config, prompts) -> list[int]:
    """Each target MoE layer's distinct experts in the first step after the prompts' (plain or drafting)."""
    engine, counts = _counting_engine(config)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, PARAMS)
    engine.step()
    layers = [m.touched for m in engine.runner.model.modules() if isinstance(m, FusedExperts)]
    for layer in layers:
        layer.counts.zero_()
    engine.step()
    kind = "drafting" if config.spec.algorithm else "decode"
    assert counts.steps[kind] == 1
    return [int(layer.counts[ExpertCounts.KINDS.index(kind), 0]) for layer in layers]


@pytest.mark.parametrize("kind", ["qwen3-moe", "deepseek-v3"])
def test_a_chain_step_touches_at_least_the_plain_steps_experts(kind, tiny_checkpoint):
    """The same batch, one step after the same prompts: the chain's verify rows are the plain step's row and its
    drafts (here the target's own: a draft model that is the target), so each layer touches a superset."""
    path = str(tiny_checkpoint(kind))
    config = tight_config(path, 512)
    config = replace(config, scheduler=replace(config.scheduler, chunked_prefill_size=256))  # prompts: one step
    prompts = make_prompts(512, seed=2)[:3]
    plain = _first_step_after_prompts(config, prompts)
    chain = _first_step_after_prompts(replace(config, spec=SpecConfig("DRAFT_MODEL", path, 3)), prompts)
    assert all(c >= p for c, p in zip(chain, plain)) and sum(chain) > sum(plain)


def test_layers_built_outside_counting_carry_nothing():
    assert FusedExperts(4, 8, 8).touched is None
    counts = ExpertCounts("cpu")
    with counts.building():
        layer = FusedExperts(4, 8, 8)
    ids = torch.tensor([[0, 3], [3, 0], [0, 3]])
    counts.begin_step("decode")
    layer.touched.add(ids)
    assert counts.summary(layer) == {"decode": {"steps": 1, "layer_forwards": 1,
                                                "mean_distinct_experts_per_layer": 2.0}}


@pytest.mark.parametrize("kind", ["qwen3-moe", "deepseek-v3"])
def test_a_steps_weight_bytes_are_the_dense_weights_and_the_touched_experts(kind, tiny_checkpoint):
    engine, _ = build_engine_core(tight_config(str(tiny_checkpoint(kind)), 512), progress=False)
    model = engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, FusedExperts)]
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    embedding = model.embed_tokens.weight
    untied = 0 if model.lm_head.weight is embedding else size(embedding)
    unread = sum(size(m.w13) + size(m.w2) for m in layers) + untied
    got = experts.step_weight_bytes(model, 2.5)
    assert got["dense"] == sum(size(p) for p in model.parameters()) - unread
    per_expert = (size(layers[0].w13) + size(layers[0].w2)) / layers[0].num_experts
    assert got["routed_experts"] == round(2.5 * len(layers) * per_expert)
    assert got["total"] == got["dense"] + got["routed_experts"]
    uniform = ExpertReads(num_experts=128, top_k=8, expert_params=0, other_params=0)  # what the bench assumes
    assert uniform.distinct(1) == pytest.approx(8)  # one token: exactly its k experts
    assert uniform.distinct(8) == pytest.approx(51.6, abs=0.05)
