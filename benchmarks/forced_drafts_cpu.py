"""Forced drafts on against off (SPECSERVE_FORCED_DRAFTS), paired in one process: the embedded SmolLM2 with its
bundled head, the 24 JSON-schema prompts of `specserve bench structured` as one constrained greedy batch, with
speculation off, as a chain (3 steps) and as a tree (top-k 2, 3 steps, 6 tokens).

On each engine the two settings take turns, the order flipping every round, after one uncounted round of both
(the first constrained batch pays for compiling its grammars), so a slow spell of a shared machine lands on
both alike. Per run: the engine steps the batch took (from the step at which every request has its first
token: `decode_steps`), tok/s over that span, the acceptance length (emitted tokens per speculative step; a
step that verifies forced drafts is one) and whether the outputs equal the other setting's.

Docs figures it reproduces: "Forced drafts, on and off" in docs/structured.md (`forced_drafts_cpu.json`).

    python benchmarks/forced_drafts_cpu.py [--rounds 2] [--out benchmarks/results/forced_drafts_cpu.json]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

from specserve import envs
from specserve.bench.decode import hardware_info
from specserve.bench.report import write_report
from specserve.bench.structured import schema_prompts, spec_configs
from specserve.config import EngineConfig, SpecConfig
from specserve.core import Constraint, SamplingParams
from specserve.draft_heads import SMOLLM2_HEAD
from specserve.llm import LLM

OUT = Path(__file__).parent / "results" / "forced_drafts_cpu.json"


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], forced: bool) -> dict:
    with envs.override(forced_drafts=forced):
        trackers = [llm.add(p, q) for p, q in zip(prompts, params)]
        steps, since = 0, None
        while llm.engine.has_work():
            llm.step_and_track(trackers)
            if since is None and all(t.output.token_ids for t in trackers):
                since = time.perf_counter()
            elif since is not None:
                steps += 1
        seconds = time.perf_counter() - since
    outputs = [t.output for t in trackers]
    tokens = sum(len(o.token_ids) for o in outputs)
    spec_steps = sum(o.num_spec_steps for o in outputs)
    return {"forced_drafts": forced, "decode_steps": steps, "output_tokens": tokens,
            "tok_s": (tokens - len(outputs)) / seconds,
            "acceptance": (sum(o.num_accepted_tokens for o in outputs) + spec_steps) / spec_steps if spec_steps else None,
            "token_ids": [o.token_ids for o in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    messages, schemas = zip(*schema_prompts())
    params = [SamplingParams(max_tokens=160, temperature=0.0, constraint=Constraint("json_schema", json.dumps(s)))
              for s in schemas]
    rows = []
    for label, spec in spec_configs(str(SMOLLM2_HEAD), (2, 3, 6)):
        llm = LLM(config=EngineConfig(device="cpu", spec=spec or SpecConfig()))
        prompts = [llm.chat_prompt(m) for m in messages]
        for forced in (True, False):  # uncounted: grammars compiled, caches warm
            run(llm, prompts, params, forced)
        for round_ in range(args.rounds):
            pair = [run(llm, prompts, params, forced) for forced in ((True, False) if round_ % 2 == 0 else (False, True))]
            same = pair[0].pop("token_ids") == pair[1].pop("token_ids")
            for row in pair:
                rows.append({"config": label, "round": round_, "same_outputs": same, **row})
                print(f"{label:40s} forced {'on ' if row['forced_drafts'] else 'off'}  {row['decode_steps']:3d} steps  "
                      f"{row['tok_s']:6.1f} tok/s  acceptance {row['acceptance']}  same outputs {same}", flush=True)
    report = {"benchmark": "forced_drafts_cpu",
              "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "hardware": hardware_info(),
              "settings": {"model": "embedded SmolLM2-135M-Instruct", "head": "bundled", "batch_size": len(schemas),
                           "max_tokens": 160, "greedy": True, "rounds": args.rounds},
              "results": rows}
    print(f"wrote {write_report(report, args.out)}")


if __name__ == "__main__":
    main()
