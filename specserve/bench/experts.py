"""`--count-experts` for `bench decode` and `bench spec`: the distinct experts each MoE layer of the target routes
a step's rows to, per kind of step (plain decode, drafting, prompt), averaged over the steps of a run.

A verify step routes each request's drafts as well as its last token, so it reads more experts' weights than a
plain step of the same batch; this makes that visible beside the tok/s. The counting adds a few small device ops
to every MoE layer, so a run's tok/s with it on is not the one to quote. Random weights route tokens almost
uniformly; a trained router concentrates them, and touches fewer.
"""
from __future__ import annotations

import contextlib

from specserve.config import EngineConfig
from specserve.layers.moe import ExpertCounts

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
