"""Does charging plain probes their catch-up change the adaptive plan on the CPU? Three engines side by side
(no speculation; the plan as shipped; the same plan with plain probes not charged), taking turns prompt by
prompt on 24 MT-Bench first turns at batch 1, greedy, up to 256 tokens, in one process (no HTTP). Prints,
per prompt, each engine's tok/s and drafting steps and both plans' switch costs, then the totals, and writes
them to benchmarks/results/probe_charge_ab_cpu.json.

    python benchmarks/probe_charge_ab_cpu.py
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from adaptive_cpu import RESULTS, build


def without_plain_probe_charge(plan) -> None:
    """The plan as it was before: a probe of plain decode (drafting winning) pays no switch cost."""
    charged = type(plan)._probe_interval

    def interval(gain, draft, plain, size):
        if gain <= 1:
            return charged(plan, gain, draft, plain, size)
        saved = dict(plan.switch_cost)
        plan.switch_cost.pop(size, None)
        try:
            return charged(plan, gain, draft, plain, size)
        finally:
            plan.switch_cost.clear()
            plan.switch_cost.update(saved)

    plan._probe_interval = interval


def main() -> None:
    from specserve import draft_heads
    from specserve.bench.datasets import mt_bench_first_turns
    from specserve.bench.decode import hardware_info
    from specserve.config import SpecConfig
    from specserve.core import SamplingParams

    spec = SpecConfig("EAGLE3", str(draft_heads.SMOLLM2_HEAD), draft_heads.SMOLLM2_DEFAULT_STEPS, adaptive=True)
    engines = {"none": build(SpecConfig()), "charged": build(spec), "not charged": build(spec)}
    without_plain_probe_charge(engines["not charged"].engine.observer)
    prompts = [engines["none"].chat_prompt(p.messages) for p in mt_bench_first_turns()][:24]
    params = SamplingParams(max_tokens=256, temperature=0.0)
    for llm in engines.values():  # kernels built, first costs measured
        llm.generate(prompts[:1], SamplingParams(max_tokens=16, temperature=0.0))
    totals = {name: {"tokens": 0, "seconds": 0.0, "spec_steps": 0} for name in engines}
    rows = []
    for i, prompt in enumerate(prompts):
        row = {"prompt": i}
        for name in engines if i % 2 == 0 else reversed(engines):
            start = time.perf_counter()
            out = engines[name].generate([prompt], params)[0]
            seconds = time.perf_counter() - start
            for key, value in (("tokens", len(out.token_ids)), ("seconds", seconds), ("spec_steps", out.num_spec_steps)):
                totals[name][key] += value
            row[name] = {"tok_s": round(len(out.token_ids) / seconds, 1), "spec_steps": out.num_spec_steps}
        row["switch_cost_ms"] = {n: engines[n].engine.observer.snapshot()["switch_cost_ms"] for n in ("charged", "not charged")}
        rows.append(row)
        print(row, flush=True)
    base = totals["none"]["tokens"] / totals["none"]["seconds"]
    for name, t in totals.items():
        t["tok_s"] = t["tokens"] / t["seconds"]
        t["vs_no_speculation"] = t["tok_s"] / base
        print(f"{name}: {t['tok_s']:.1f} tok/s ({t['vs_no_speculation']:.3f}x), {t['spec_steps']} drafting steps")
    out = RESULTS / "probe_charge_ab_cpu.json"
    out.write_text(json.dumps({"benchmark": "probe_charge_ab_cpu", "hardware": hardware_info(), "totals": totals,
                               "per_prompt": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
