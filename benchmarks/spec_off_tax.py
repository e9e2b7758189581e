"""Is speculation that is switched off free? On one GPU, Llama-3.1-8B shape with random bf16 weights:
plain decode vs the same engine with an EAGLE-3 head configured but a plan of 0 drafts (graphs replay and
the head's taps are stored), vs drafting a 3-token chain every step with acceptance simulated at tau = 3, vs a
top-4 tree of 15 drafts (16 verified tokens) over 5 levels at simulated tau = 4 (random head of the target's shape),
and the chain and tree again with the head's projections in fp8 (--speculative-draft-model-quantization). Per decode
step it also reports the wall time and the device time of the step's CUDA-graph replay (plain, chain and tree steps),
so the host's share of a step shows.

    python benchmarks/spec_off_tax.py --out benchmarks/results/spec_off_tax_h200.json
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from dataclasses import replace

import torch

from profile_gpu_step import top_kernels
from specserve.bench.decode import hardware_info, make_prompts
from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specserve.engine.factory import build_engine_core
from specserve.core import SamplingParams

BASE = EngineConfig(model_path="llama-3.1-8b", load_format="dummy", dtype="bfloat16", device="cuda",
                    context_length=2048, cache=CacheConfig(max_total_tokens=300_000),
                    scheduler=SchedulerConfig(chunked_prefill_size=40_000))
SETUPS = {
    "plain": (SpecConfig(), None),
    "EAGLE-3 configured, 0 drafts": (SpecConfig("EAGLE3", None, 3), 0),
    "EAGLE-3 chain 3, simulated tau 3": (SpecConfig("EAGLE3", None, 3, simulate_accept_len=3.0), None),
    "EAGLE-3 tree top-4, 5 steps, 16 tokens, simulated tau 4":
        (SpecConfig("EAGLE3", None, 5, 4, 16, simulate_accept_len=4.0), None),
    # The same with the head's projections in fp8 (--speculative-draft-model-quantization fp8): what that saves
    # a step. Acceptance is simulated, so its price shows only on a trained head (fp8_head_acceptance_cpu.sh).
    "EAGLE-3 chain 3, fp8 head, simulated tau 3":
        (SpecConfig("EAGLE3", None, 3, simulate_accept_len=3.0, draft_model_quantization="fp8"), None),
    "EAGLE-3 tree top-4, 5 steps, 16 tokens, fp8 head, simulated tau 4":
        (SpecConfig("EAGLE3", None, 5, 4, 16, simulate_accept_len=4.0, draft_model_quantization="fp8"), None),
}


class TimedGraph:
    """Wraps a captured graph so each replay's device time is recorded with CUDA events."""

    last_spec = None  # the speculative step graph replayed last, for --profile
    last_plain = None

    def __init__(self, graph, log: list, speculative: bool) -> None:
        self.graph, self.log, self.speculative = graph, log, speculative

    def replay(self) -> None:
        if self.speculative:
            TimedGraph.last_spec = self
        else:
            TimedGraph.last_plain = self
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.log.append((start, end))


def time_replays(engine) -> list:
    """Every graph replay of plain decode and speculative (chain or tree) steps from now on logs its device time."""
    log = []
    for graphs, speculative in ((engine.runner.graphs, False), (engine.runner.spec_graphs, True)):
        if graphs is not None:
            graphs.graphs = {shape: TimedGraph(getattr(g, "graph", g), log, speculative)
                             for shape, g in graphs.graphs.items()}
    return log


def decode_run(engine, batch: int, prompt_len: int, output_len: int) -> dict:
    """Decode tok/s after the first token, and per decode step: wall time and the device time of its replay."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(batch, prompt_len, 128256, batch)):
        engine.add_request(f"{batch}-{i}-{time.perf_counter()}", prompt, params)
    counts, counted, first, steps = 0, 0, None, 0
    log = time_replays(engine)
    while engine.has_work():
        new = sum(len(d.new_token_ids) for d in engine.step())
        counts += new
        if first is None and counts:
            first, counted = time.perf_counter(), counts
            log.clear()
        elif first is not None and new:  # a last call that only collects nothing is not a step
            steps += 1
    wall = time.perf_counter() - first
    torch.cuda.synchronize()
    replay_ms = [s.elapsed_time(e) for s, e in log]
    return {"decode_tok_s": (counts - counted) / wall, "steps": steps, "step_wall_ms": wall * 1e3 / max(steps, 1),
            "replay_device_ms": sum(replay_ms) / max(len(replay_ms), 1), "replays": len(replay_ms)}


def host_top(profiler: cProfile.Profile, limit: int = 25) -> list[dict]:
    """The functions the host spent most of its own time in (the profiler's overhead inflates them all)."""
    stats = pstats.Stats(profiler)
    rows = [{"function": f"{file.rsplit('/', 1)[-1]}:{line} {func}", "calls": calls, "self_ms": round(tt * 1e3, 2),
             "cumulative_ms": round(ct * 1e3, 2)}
            for (file, line, func), (_, calls, tt, ct, _) in stats.stats.items()]
    rows.sort(key=lambda r: -r["self_ms"])
    return rows[:limit]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS), metavar="NAME",
                   help="which rows to run (default: all); the first must be plain")
    p.add_argument("--profile", action="store_true",
                   help="after each setup's batch-1 run, list the kernels of its last step's graph (torch.profiler)")
    p.add_argument("--host-profile", action="store_true",
                   help="profile the host (cProfile) in each setup's batch-1 run and keep its top functions")
    p.add_argument("--save-choices", metavar="FILE",
                   help="write the GEMV decisions this run timed (shapes the shipped decisions lack, such as an fp8 "
                        "head's), in the form layers/gemv_decisions/ ships them")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = []
    # Graphs are captured for the batch sizes the run asks for, not for all up to 256.
    base = replace(BASE, scheduler=replace(BASE.scheduler, max_running_requests=max(args.batch_sizes)))
    for name in args.setups:
        spec, plan = SETUPS[name]
        engine, _ = build_engine_core(replace(base, spec=spec), progress=False)
        if plan is not None:
            engine.scheduler.draft_plan = lambda request: plan
        for batch in args.batch_sizes:
            decode_run(engine, batch, args.prompt_len, 8)  # warm-up
            profiler = cProfile.Profile() if args.host_profile and batch == 1 else None
            if profiler is not None:
                profiler.enable()
            rows.append({"setup": name, "batch_size": batch,
                         **decode_run(engine, batch, args.prompt_len, args.output_len)})
            if profiler is not None:
                profiler.disable()
                rows[-1]["host_functions"] = host_top(profiler)
            last = TimedGraph.last_spec if spec.algorithm else TimedGraph.last_plain
            if args.profile and batch == 1 and last is not None:
                # Replaying the last step again recomputes it in place: same shapes, same kernels.
                rows[-1]["kernels"] = top_kernels(last.graph.replay, limit=40)
            print(rows[-1], flush=True)
        del engine
    plain = {r["batch_size"]: r["decode_tok_s"] for r in rows if r["setup"] == "plain"}
    for r in rows:
        r["ratio_to_plain"] = r["decode_tok_s"] / plain[r["batch_size"]]
    from specserve.kernels.triton import gemv as triton_gemv

    gemv = triton_gemv.choice.report()
    if args.save_choices:
        from specserve.kernels.tuning import choices as gemv_choices

        timed = {key: tile for key, tile in triton_gemv.choice.best.items() if key in triton_gemv.choice.timings}
        gemv_choices.save(timed, args.save_choices, torch.cuda.get_device_name())
    report = {"benchmark": "spec_off_tax", "gemv_choices": gemv, "hardware": hardware_info(), "simulated": "the acceptance of the chain and tree rows",
              "settings": {**vars(args), "model": "llama-3.1-8b dummy bf16",
                                                  "max_running_requests": max(args.batch_sizes)}, "results": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
