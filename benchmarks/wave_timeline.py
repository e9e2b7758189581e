"""Where the device's time goes over whole offline waves: Llama-3.1-8B shape, random bf16 weights, the offline
bench's closed loop (`specserve bench --offline`: random 512-token prompts, 256 output tokens, ignore_eos).

Each step the runner launches is bracketed by two CUDA events on the stream, and each decode graph's replay by
two more. An event completes when the device reaches it, so per step this gives its device span (from the end
of the work queued before it to the end of its own) and the gap before it (the device waiting for the host).
Unlike a profiler trace, this adds nothing to the device's work. The report sums spans and gaps per step kind,
and decode steps per (batch bucket, context bucket), against the whole run's wall time.

    python benchmarks/wave_timeline.py --concurrency 250 --num-prompts 1000 --out benchmarks/results/x.json
"""
from __future__ import annotations

import argparse
import bisect
import gc
import json
import time
from collections import defaultdict

import torch

from specserve.bench.datasets import load_prompts
from specserve.bench.decode import hardware_info
from specserve.bench.sweep import _offline_wave
from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
from specserve.llm import LLM


class Timeline:
    """CUDA events around every launched step and every graph replay of a runner."""

    def __init__(self, runner) -> None:
        self.steps: list[dict] = []
        self.replays: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._wrap_launch(runner)
        if runner.graphs is not None:
            self._wrap_replays(runner.graphs)

    @staticmethod
    def _event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _wrap_launch(self, runner) -> None:
        launch = runner.launch

        def timed(batch, publish=False):
            start = self._event()
            output = launch(batch, publish)
            tokens = sum(len(s.token_ids) for s in batch.seqs)
            self.steps.append({"kind": batch.kind, "rows": len(batch.seqs), "tokens": tokens,
                               "context": max(s.start_pos + len(s.token_ids) for s in batch.seqs),
                               "start": start, "end": self._event()})
            return output
        runner.launch = timed

    def _wrap_replays(self, graphs) -> None:
        for shape, graph in graphs.graphs.items():
            replay = graph.replay

            def timed(replay=replay):
                start = self._event()
                replay()
                self.replays.append((start, self._event()))
            graph.replay = timed

    def report(self, graphs) -> dict:
        torch.cuda.synchronize()
        kinds = defaultdict(lambda: {"steps": 0, "device_ms": 0.0, "gap_before_ms": 0.0})
        transitions = defaultdict(lambda: {"count": 0, "gap_ms": 0.0, "over_1ms": 0, "max_ms": 0.0})
        decode_shapes = defaultdict(lambda: {"steps": 0, "device_ms": 0.0})
        previous = None
        for step in self.steps:
            span = step["start"].elapsed_time(step["end"])
            gap = previous["end"].elapsed_time(step["start"]) if previous is not None else 0.0
            kind = kinds[step["kind"]]
            kind["steps"] += 1
            kind["device_ms"] += span
            kind["gap_before_ms"] += gap
            if previous is not None:
                t = transitions[f"{previous['kind']}->{step['kind']}"]
                t["count"] += 1
                t["gap_ms"] += gap
                t["over_1ms"] += gap > 1.0
                t["max_ms"] = max(t["max_ms"], gap)
            if step["kind"] == "decode" and graphs is not None:
                bs = graphs.batch_sizes[bisect.bisect_left(graphs.batch_sizes, step["rows"])]
                n = graphs.context_lens[bisect.bisect_left(graphs.context_lens, step["context"])]
                shape = decode_shapes[f"{bs}x{n}"]
                shape["steps"] += 1
                shape["device_ms"] += span
            previous = step
        for t in transitions.values():
            t["gap_ms"], t["max_ms"] = round(t["gap_ms"], 1), round(t["max_ms"], 2)
        for row in [*kinds.values(), *decode_shapes.values()]:
            row["mean_ms"] = round(row["device_ms"] / row["steps"], 3)
            for key in ("device_ms", "gap_before_ms"):
                if key in row:
                    row[key] = round(row[key], 1)
        replay_ms = sum(a.elapsed_time(b) for a, b in self.replays)
        rows = [s["rows"] for s in self.steps if s["kind"] == "decode"]
        contexts = [s["context"] for s in self.steps if s["kind"] == "decode"]
        return {"kinds": dict(kinds), "gaps": dict(transitions), "decode_shapes": dict(decode_shapes),
                "graph_replays": len(self.replays), "graph_replay_ms": round(replay_ms, 1),
                "decode_mean_rows": round(sum(rows) / max(len(rows), 1), 1),
                "decode_mean_context": round(sum(contexts) / max(len(contexts), 1), 1),
                "span_ms": round(self.steps[0]["start"].elapsed_time(self.steps[-1]["end"]), 1)}


class CollectorPauses:
    """The garbage collector's pauses, per generation, while active."""

    def __init__(self) -> None:
        self.pauses = defaultdict(list)
        self._started = None
        self.active = False
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if not self.active:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pauses[info["generation"]].append(1e3 * (time.perf_counter() - self._started))

    def report(self) -> dict:
        return {f"gen{g}": {"count": len(p), "total_ms": round(sum(p), 1), "max_ms": round(max(p), 2)}
                for g, p in sorted(self.pauses.items())}


def find_syncs(runner) -> list[str]:
    """Wraps the runner's launch so that the first step that computes a prompt chunk reports, with the Python
    stack, every operation that made the host wait for the device."""
    import traceback
    import warnings

    found: list[str] = []
    launch = runner.launch

    def checked(batch, publish=False):
        if found or batch.kind != "prompt":
            return launch(batch, publish)
        def record(message, *args, **kwargs):
            found.append(f"{message}\n" + "".join(traceback.format_stack(limit=12)[:-1]))

        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():  # restores showwarning on the way out
                warnings.simplefilter("always")
                warnings.showwarning = record
                return launch(batch, publish)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            found.append("end of the checked step")
    runner.launch = checked
    return found


def page_layouts(runner, batch: int = 256, context: int = 640, replays: int = 20) -> list[dict]:
    """A batch-256 decode graph's device time with the rows' pages laid out in different ways, at one context
    for every row or contexts spread around it, as a wave's rows are."""
    import random

    graphs = runner.graphs
    page_size = graphs.page_size
    num_pages = runner.kv_cache.shape[2] // page_size - 1
    rng = random.Random(0)
    spread = [rng.randint(context - 127, context + 128) for _ in range(batch)]
    per_row = -(-(context + 129) // page_size)
    layouts = {
        "contiguous": [list(range(r * per_row, (r + 1) * per_row)) for r in range(batch)],
        "interleaved": [[j * batch + r for j in range(per_row)] for r in range(batch)],
        "random": [list(p) for p in zip(*[iter(rng.sample(range(num_pages), batch * per_row))] * per_row)],
    }
    rows = []
    for name, tables in layouts.items():
        for contexts_name, contexts in (("uniform", [context] * batch), ("spread", spread)):
            run = lambda: graphs.run([1] * batch, contexts, tables)  # noqa: E731
            for _ in range(3):
                run()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                run()
            end.record()
            torch.cuda.synchronize()
            rows.append({"pages": name, "contexts": contexts_name, "step_ms": round(start.elapsed_time(end) / replays, 3)})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, default=250)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--chunked-prefill-size", type=int, default=16384)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--gc-unfreeze", action="store_true", help="undo the engine's gc.freeze() (A/B)")
    p.add_argument("--page-layouts", action="store_true", help="also time a decode graph under page layouts")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    config = EngineConfig(model_path="llama-3.1-8b", load_format="dummy", dtype="bfloat16", device="cuda",
                          context_length=2048, cache=CacheConfig(page_size=args.page_size),
                          scheduler=SchedulerConfig(chunked_prefill_size=args.chunked_prefill_size))
    llm = LLM(config=config, progress=False)
    if args.gc_unfreeze:  # the A/B switch: as before the engine froze its startup objects
        gc.unfreeze()
    layouts = page_layouts(llm.engine.runner) if args.page_layouts else None
    syncs = find_syncs(llm.engine.runner)
    prompts = load_prompts("random", args.num_prompts, seed=0, input_len=512, vocab_size=llm.model_info.model_cfg.vocab_size)
    token_prompts = [p.token_ids for p in prompts]
    wave = argparse.Namespace(max_tokens=256, temperature=0.0, ignore_eos=True, quiet=True)
    _offline_wave(llm, token_prompts[: args.concurrency], prompts, args.concurrency, wave, warmup=True)
    timeline = Timeline(llm.engine.runner)
    pauses = CollectorPauses()
    pauses.active = True
    start = time.perf_counter()
    results, duration = _offline_wave(llm, token_prompts, prompts, args.concurrency, wave)
    wall = time.perf_counter() - start
    pauses.active = False
    output_tokens = sum(r.output_tokens for r in results)
    report = {"benchmark": "wave_timeline", "hardware": hardware_info(),
              "model": "llama-3.1-8b shape, dummy bf16 weights", "settings": vars(args),
              "wall_s": round(wall, 3), "output_tok_s": round(output_tokens / duration, 1),
              **timeline.report(llm.engine.runner.graphs), "syncs_in_a_prompt_step": syncs,
              "gc_pauses": pauses.report(),
              "page_layouts": layouts}
    print(json.dumps({k: v for k, v in report.items() if k not in ("hardware", "syncs_in_a_prompt_step")}), flush=True)
    print("\n".join(syncs[:4]), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
