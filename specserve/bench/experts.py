"""`--count-experts` for `bench decode` and `bench spec`: the distinct experts each MoE layer of the target routes
a step's rows to, per kind of step (plain decode, drafting, prompt), averaged over the steps of a run.

A verify step routes each request's drafts as well as its last token, so it reads more experts' weights than a
plain step of the same batch; this makes that visible beside the tok/s. The counting adds a few small device ops
to every MoE layer, so a run's tok/s with it on is not the one to quote. Random weights route tokens almost
uniformly; a trained router concentrates them, and touches fewer.
"""
from __future__ import annotations

import contextlib

from torch import nn

from specserve.config import EngineConfig
from specserve.layers.moe import ExpertCounts, FusedExperts
from specserve.speculative.plan import expert_reads

# What a report's `experts_touched` setting says: the module's second paragraph.
NOTE = __doc__.split("\n\n")[1].replace("\n", " ")


def check_moe(model_cfg) -> None:
    if model_cfg.moe is None:
        raise ValueError("--count-experts needs a mixture-of-experts target (Qwen3-MoE, DeepSeek-V3)")


@contextlib.contextmanager
def counting(config: EngineConfig):
    """Models built inside count their experts (tensor parallelism: rank 0's layers, which route as every rank)."""
    from specserve.engine.factory import pick_device

    counts = ExpertCounts(pick_device(config))
    with counts.building():
        yield counts


def watch_steps(llm, counts: ExpertCounts) -> None:
    """Sets each step's kind as the engine launches it, so its forwards count to that kind (`counts.summary`)."""
    runner = llm.engine.runner
    launch = runner.launch

    def counted_launch(batch, publish: bool = False):
        counts.begin_step(batch.kind)
        return launch(batch, publish)

    runner.launch = counted_launch


def summary(llm, counts: ExpertCounts) -> dict[str, dict]:
    """Per kind of step since the last reset: steps, and the mean distinct experts per layer and step."""
    return counts.summary(llm.engine.runner.model)


def describe(touched: dict[str, dict]) -> str:
    """One line: the mean distinct experts per layer per step, for each kind of step counted."""
    return "distinct experts per MoE layer per step: " + ", ".join(
        f"{kind} {c['mean_distinct_experts_per_layer']:.2f} ({c['steps']} steps)" for kind, c in touched.items()
        if kind != "other")


def step_weight_bytes(model: nn.Module, distinct_per_layer: float) -> dict[str, int]:
    """The weight bytes a decode step reads: every parameter but the routed experts and an untied embedding
    table (a step reads one row of it), plus `distinct_per_layer` experts of each MoE layer."""
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    expert_params = {id(p) for m in experts for p in (m.w13, m.w2)}
    embedding = getattr(getattr(model, "embed_tokens", None), "weight", None)
    lm_head = getattr(model, "lm_head", None)
    skip = set(expert_params)
    if embedding is not None and (lm_head is None or lm_head.weight is not embedding):
        skip.add(id(embedding))
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    per_expert = sum((m.w13[0].numel() + m.w2[0].numel()) * m.w13.element_size() for m in experts[:1])
    routed = round(distinct_per_layer * per_expert * len(experts))
    return {"dense": dense, "routed_experts": routed, "total": dense + routed}


def bandwidth_row(llm, batch: int, decode_tok_s: float, touched: dict | None) -> dict:
    """For a MoE target: the weight bytes of a decode step of `batch` rows and the GB/s its step time gives
    against them. The experts touched are the counted ones where `touched` has decode steps, else what uniform
    routing gives (random weights route near-uniformly; exact at batch 1). Each distinct expert counts once: a
    lower bound where the pair GEMVs (a few rows) read an expert two rows share twice."""
    model = llm.engine.runner.model
    counted = (touched or {}).get("decode")
    distinct = (counted["mean_distinct_experts_per_layer"] if counted
                else expert_reads(llm.model_info.model_cfg).distinct(batch))
    weights = step_weight_bytes(model, distinct)
    return {"distinct_experts_per_layer": round(distinct, 2),
            "distinct_experts_from": "counted" if counted else "uniform routing",
            "step_weight_bytes": weights, "weight_gb_per_s": round(weights["total"] * decode_tok_s / batch / 1e9, 1)}
