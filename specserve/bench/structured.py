"""Structured output: tok/s and acceptance length with JSON-schema constraints against without, with
speculation off, as a chain and as a tree, on the same prompts, and the constrained rows with overlap
scheduling off and on (`specserve bench structured`).

The workload is the schema suite of bench/schemas.py, each schema with a chat prompt asking for a JSON value
that follows it. Every configuration runs all prompts as one batch (greedy), or with `--batch-size B` the suite
cycled to 4 B requests with B in flight (each that finishes replaced by the next); tok/s is the output tokens
after each request's first over the time from the step at which the first batch all have their first token to
the end (later arrivals' prompts are in it); the
acceptance length is tokens emitted per speculative step over the whole batch. Constrained outputs are checked
against their schemas (`valid_share`).

Overlap scheduling is on by default only on a GPU; here it is set for each constrained row. With it, a step's
masks are built while the device runs its forward (structured/step_masks.py), and `mask_ready_share` is the
share of steps with constrained rows whose masks were ready before the device finished the forward.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import json
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from specserve.bench.report import follows_schema, write_report
from specserve.bench.decode import hardware_info
from specserve.bench.schemas import SCHEMAS, schema_request
from specserve.config import EngineConfig, SpecConfig
from specserve.core import Constraint, SamplingParams
from specserve.llm import LLM

DEFAULT_OUT = Path("benchmarks/results/structured_cpu.json")
# (constrained, overlap) per row of a configuration: free text without overlap, then the constraints without
# and with it. A fourth row, free text cut to the constrained outputs' lengths, with overlap (`SAME_LENGTHS`),
# is what the constrained rows are compared with: a batch's requests then end at the same steps, so occupancy
# and the share of prompt work are the same, and only what the constraints cost differs.
ROWS = ((False, False), (True, False), (True, True))
SAME_LENGTHS = (False, "same lengths")


def schema_prompts() -> list[tuple[list[dict], dict]]:
    """(chat messages, schema) per schema of the suite."""
    return [(schema_request(schema), schema) for schema in SCHEMAS]


RANDOM_HEAD = "random"  # --head random: a random head of the target's shape (only with --load-format dummy)


def spec_configs(head: str | None, tree: tuple[int, int, int]) -> list[tuple[str, SpecConfig | None]]:
    if head is None:
        return [("no speculation", None)]
    topk, steps, tokens = tree
    head = None if head == RANDOM_HEAD else head
    return [("no speculation", None), ("EAGLE-3 chain 3", SpecConfig("EAGLE3", head, 3)),
            (f"EAGLE-3 tree topk {topk} steps {steps} tokens {tokens}", SpecConfig("EAGLE3", head, steps, topk, tokens))]


def run_concurrent(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], concurrency: int
                   ) -> tuple[list, float]:
    """The requests with `concurrency` in flight (all of them: one batch), each one that finishes replaced by the
    next, as a serving load keeps them; the outputs in order, and the time from the step at which the first
    `concurrency` have their first token to the end: prompt work stays out of a single batch's, while later
    arrivals' prompts are in it, as under load."""
    trackers, active, waiting = [], [], list(zip(prompts, params))
    decoding_since = None
    while waiting or active:
        while waiting and len(active) < concurrency:
            trackers.append(llm.add(*waiting.pop(0)))
            active.append(trackers[-1])
        llm.step_and_track(active)
        if decoding_since is None and all(t.output.token_ids for t in trackers):
            decoding_since = time.perf_counter()
        active = [t for t in active if t.output.finish_reason is None]
    return [t.output for t in trackers], time.perf_counter() - decoding_since


def measure(llm: LLM, prompts: list[list[int]], schemas: list[dict], constrained: bool, max_tokens: int,
            overlap: bool = False, batch_size: int | None = None, lengths: list[int] | None = None) -> dict:
    """One row. `lengths`: free text, each request cut to its length (and past any stop token)."""
    llm.engine.overlap = overlap
    timing = llm.engine.runner.mask_timing
    timing.reset()
    if lengths is not None:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    else:
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                 constraint=Constraint("json_schema", json.dumps(s)) if constrained else None)
                  for s in schemas]
    outputs, seconds = run_concurrent(llm, prompts, params, batch_size or len(prompts))
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = sum(o.num_spec_steps for o in outputs)
    decoded = tokens - len(outputs)  # each request's first token comes with its prompt
    row = {"constrained": constrained, "overlap": overlap, "same_lengths": lengths is not None,
           "output_tokens": tokens, "decode_seconds": seconds, "lengths": [len(o.token_ids) for o in outputs],
           "tok_s": decoded / seconds,
           "mean_acceptance_length": (sum(o.num_accepted_tokens for o in outputs) + steps) / steps if steps else None,
           "finished_by_stop": sum(o.finish_reason == "stop" for o in outputs) / len(outputs)}
    if constrained:
        row["valid_share"] = sum(follows_schema(s, o.text) for o, s in zip(outputs, schemas)) / len(outputs)
        row["mask_steps"], row["mask_ready_share"] = timing.steps, timing.ready_share
    return row


def _median_run(runs: list[dict]) -> dict:
    """One row from repeated runs (greedy: the same tokens each time): the median tok/s, every run's, and
    the share of steps with masks ready first over all of them."""
    row = dict(runs[0])
    row["tok_s"] = statistics.median(r["tok_s"] for r in runs)
    row["tok_s_runs"] = [r["tok_s"] for r in runs]
    if "mask_steps" in row:
        row["mask_steps"] = sum(r["mask_steps"] for r in runs)
        row["mask_ready_share"] = sum(r["mask_ready_share"] * r["mask_steps"] for r in runs) / row["mask_steps"]
    return row


def _head_name(head: str | None) -> str | None:
    """The head as the report names it: the bundled one by name, so no local path is written."""
    from specserve import draft_heads

    if head is not None and Path(head).resolve() == Path(draft_heads.SMOLLM2_HEAD).resolve():
        return "bundled SmolLM2-135M-Instruct head"
    return head


def host_profile(run: Callable[[], object], top: int = 30) -> list[dict]:
    """The calling thread's functions by their own time while `run` runs (cProfile): where a constrained step's
    host time goes, and, in the waits, how long it waits for the device (a read-back) or for the threads that
    fill masks (which the profiler does not see inside)."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    stats = pstats.Stats(profiler).sort_stats("tottime")
    rows = [{"function": f"{path.rsplit('/', 1)[-1]}:{line}({name})", "calls": calls,
             "own_seconds": round(own, 4), "cumulative_seconds": round(cumulative, 4)}
            for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items()]
    return sorted(rows, key=lambda r: -r["own_seconds"])[:top]


def run_structured_bench(engine_config: EngineConfig, args: argparse.Namespace) -> dict:
    if engine_config.device == "auto":
        engine_config = replace(engine_config, device="cpu")
    messages, schemas = zip(*schema_prompts())
    if args.batch_size is not None:  # the suite cycled to four times the concurrency (at least once)
        count = max(4 * args.batch_size, len(schemas))
        messages, schemas = [messages[i % len(messages)] for i in range(count)], [schemas[i % len(schemas)]
                                                                                   for i in range(count)]
    rows, profiles = [], {}
    for label, spec in spec_configs(args.head, tuple(args.tree)):
        llm = LLM(config=replace(engine_config, spec=spec or SpecConfig()))
        prompts = [llm.chat_prompt(m) for m in messages]
        # warm-up: kernels, the tokenizer's table, the compiler, the mask worker
        for constrained, overlap in ROWS:
            measure(llm, prompts[:2], list(schemas[:2]), constrained, 8, overlap)
        runs = {key: [] for key in (*ROWS, SAME_LENGTHS)}
        for r in range(args.repeats):
            # Free text once; the constrained pair and the free text of their lengths take turns in an order
            # that alternates, so the machine's drift favours none. The first turn runs a constrained row
            # before the same-lengths one, which takes its lengths.
            turn = (*ROWS[1:], SAME_LENGTHS) if r % 2 == 0 else (SAME_LENGTHS, *ROWS[:0:-1])
            for key in ((ROWS[0],) if r == 0 else ()) + turn:
                if key == SAME_LENGTHS:
                    # overlap on, as the constrained rows' best
                    row = measure(llm, prompts, list(schemas), False, args.max_tokens, True, args.batch_size,
                                  runs[ROWS[1]][0]["lengths"])
                else:
                    row = measure(llm, prompts, list(schemas), key[0], args.max_tokens, key[1], args.batch_size)
                runs[key].append(row)
        if args.host_profile:  # one more constrained run with overlap, untimed, under the profiler
            profiles[label] = host_profile(lambda: measure(llm, prompts, list(schemas), True, args.max_tokens, True,
                                                           args.batch_size))
        llm.close()  # the next configuration's engine gets the whole device
        for key in (ROWS[0], SAME_LENGTHS, *ROWS[1:]):
            row = {"config": label, **_median_run(runs[key])}
            rows.append(row)
            constrained, overlap = key
            kind = (("constrained, overlap " + ("on" if overlap else "off")) if constrained else
                    "free, constrained lengths" if overlap == SAME_LENGTHS[1] else "free")
            print(f"{label:44s} {kind:23s} {row['tok_s']:7.1f} tok/s  acceptance {row['mean_acceptance_length']}  "
                  f"valid {row.get('valid_share', '-')}  masks ready first {row.get('mask_ready_share', '-')}",
                  flush=True)
    for row in rows:
        free = next(r for r in rows if r["config"] == row["config"] and r["same_lengths"])
        row["tok_s_ratio_to_free"] = row["tok_s"] / free["tok_s"]
    report = {
        "benchmark": "structured",
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware": hardware_info(),
        "settings": {"model": engine_config.model_path, "head": _head_name(args.head), "num_prompts": len(schemas),
                     "batch_size": args.batch_size or len(schemas), "max_tokens": args.max_tokens, "greedy": True,
                     "repeats": args.repeats,
                     "method": "one batch of every prompt per row; tok/s = output tokens after each request's "
                               "first / time from the step at which all have their first token to the end; "
                               "acceptance = emitted tokens per speculative step; the constrained rows run "
                               "`repeats` times, overlap off and on alternating in order, and report the median",
                     "mask_ready_share": "steps with constrained rows whose masks were built before the "
                                         "device finished the forward (a CPU: before the host came back "
                                         "from running it)"},
        "results": rows,
    }
    if profiles:
        report["host_profiles"] = profiles
    print(f"wrote {write_report(report, args.out or DEFAULT_OUT)}")
    return report
