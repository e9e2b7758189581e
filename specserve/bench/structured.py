"""Structured output: tok/s and acceptance length with JSON-schema constraints against without, with
speculation off, as a chain and as a tree, on the same prompts (`specserve bench structured`).

The workload is the schema suite of bench/schemas.py, each schema with a chat prompt asking for a JSON value
that follows it. Every configuration runs all prompts as one batch (greedy); tok/s is the batch's output tokens
after each request's first over the time from the step at which all have their first token to the end (prefill
stays out); the acceptance length is tokens emitted per speculative step over the whole batch. Constrained outputs are checked against their schemas (`valid_share`).

Masks are built on the host between steps; nothing of them overlaps the device yet, so the share of steps
whose mask was ready before the device finished is not measured (docs/structured.md).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from dataclasses import replace
from pathlib import Path

from specserve.bench.report import write_report
from specserve.bench.decode import hardware_info
from specserve.bench.schemas import SCHEMAS
from specserve.config import EngineConfig, SpecConfig
from specserve.core import Constraint, SamplingParams
from specserve.llm import LLM

DEFAULT_OUT = Path("benchmarks/results/structured_cpu.json")


def schema_prompts() -> list[tuple[list[dict], dict]]:
    """(chat messages, schema) per schema of the suite."""
    return [([{"role": "user", "content": "Reply with JSON that follows this JSON schema, and nothing else:\n"
               + json.dumps(schema)}], schema) for schema in SCHEMAS]


def spec_configs(head: str | None, tree: tuple[int, int, int]) -> list[tuple[str, SpecConfig | None]]:
    if head is None:
        return [("no speculation", None)]
    topk, steps, tokens = tree
    return [("no speculation", None), ("EAGLE-3 chain 3", SpecConfig("EAGLE3", head, 3)),
            (f"EAGLE-3 tree topk {topk} steps {steps} tokens {tokens}", SpecConfig("EAGLE3", head, steps, topk, tokens))]


def run_batch(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, float]:
    """The outputs, and the decode time: from the step at which every request has its first token to the
    end, so prompt work (and what the prefix cache saves of it) stays out."""
    trackers = [llm.add(p, q) for p, q in zip(prompts, params)]
    decoding_since = None
    while llm.engine.has_work():
        llm.step_and_track(trackers)
        if decoding_since is None and all(t.output.token_ids for t in trackers):
            decoding_since = time.perf_counter()
    return [t.output for t in trackers], time.perf_counter() - decoding_since


def measure(llm: LLM, prompts: list[list[int]], schemas: list[dict], constrained: bool, max_tokens: int) -> dict:
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0,
                             constraint=Constraint("json_schema", json.dumps(s)) if constrained else None)
              for s in schemas]
    outputs, seconds = run_batch(llm, prompts, params)
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = sum(o.num_spec_steps for o in outputs)
    decoded = tokens - len(outputs)  # each request's first token comes with its prompt
    row = {"constrained": constrained, "output_tokens": tokens, "decode_seconds": seconds,
           "tok_s": decoded / seconds,
           "mean_acceptance_length": (sum(o.num_accepted_tokens for o in outputs) + steps) / steps if steps else None,
           "finished_by_stop": sum(o.finish_reason == "stop" for o in outputs) / len(outputs)}
    if constrained:
        row["valid_share"] = sum(_valid(o.text, s) for o, s in zip(outputs, schemas)) / len(outputs)
    return row


def _valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_structured_bench(engine_config: EngineConfig, args: argparse.Namespace) -> dict:
    if engine_config.device == "auto":
        engine_config = replace(engine_config, device="cpu")
    messages, schemas = zip(*schema_prompts())
    rows = []
    for label, spec in spec_configs(args.head, tuple(args.tree)):
        llm = LLM(config=replace(engine_config, spec=spec or SpecConfig()))
        prompts = [llm.chat_prompt(m) for m in messages]
        for constrained in (False, True):  # warm-up: kernels, the tokenizer's table, the compiler
            measure(llm, prompts[:2], list(schemas[:2]), constrained, 8)
        for constrained in (False, True):
            row = {"config": label, **measure(llm, prompts, list(schemas), constrained, args.max_tokens)}
            rows.append(row)
            print(f"{label:44s} {'constrained' if constrained else 'free':11s} {row['tok_s']:7.1f} tok/s  "
                  f"acceptance {row['mean_acceptance_length']}  valid {row.get('valid_share', '-')}", flush=True)
    for row in rows:
        free = next(r for r in rows if r["config"] == row["config"] and not r["constrained"])
        row["tok_s_ratio_to_free"] = row["tok_s"] / free["tok_s"]
    report = {
        "benchmark": "structured_cpu",
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware": hardware_info(),
        "settings": {"model": engine_config.model_path, "head": args.head, "num_prompts": len(schemas),
                     "batch_size": len(schemas), "max_tokens": args.max_tokens, "greedy": True,
                     "method": "one batch of every prompt per row; tok/s = output tokens after each request's "
                               "first / time from the step at which all have their first token to the end; "
                               "acceptance = emitted tokens per speculative step",
                     "mask_overlap": "not measured: masks are built on the host between steps"},
        "results": rows,
    }
    print(f"wrote {write_report(report, args.out or DEFAULT_OUT)}")
    return report
