"""Speculative decoding on the CPU: decode tok/s and acceptance length against no speculation, same run.

Each configuration generates `output_len` greedy tokens for the same seeded prompt; tok/s is
(output_len - 1) / (time of the last token - time of the first), so prefill stays out, as in
`bench decode`. Two drafts bracket what any draft can do: a copy of the target as a draft model (nearly
everything accepted: the upper bound) and a random-weight EAGLE-3 head (nearly nothing: the lower bound,
which is the pure cost of drafting and verifying). Each drafts a chain per `--num-steps` and one tree."""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from specserve.bench import experts
from specserve.bench.report import write_report
from specserve.bench.decode import hardware_info, make_prompts
from specserve.config import EngineConfig, SpecConfig
from specserve.engine.factory import resolve_model
from specserve.llm import LLM
from specserve.core import SamplingParams

DEFAULT_OUT = Path("benchmarks/results/spec_cpu.json")


def _timed_run(llm: LLM, prompt: list[int], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    tracker = llm.add(prompt, params)
    stamps = []
    while llm.engine.has_work():
        llm.step_and_track([tracker])
        stamps.append((time.perf_counter(), len(tracker.output.token_ids)))
    first = next(t for t, n in stamps if n >= 1)
    out = tracker.output
    return {
        "decode_tok_s": (output_len - 1) / (stamps[-1][0] - first),
        "mean_acceptance_length": out.mean_acceptance_length,
        "tokens": out.token_ids,
    }


def _random_head(model_cfg, out_dir: Path, draft_vocab_size: int) -> Path:
    """A random head costs what a trained one of the same draft vocabulary costs, and accepts ~nothing."""
    import torch

    from specserve.models.loader import load_eagle3_head, save_eagle3_head

    head = load_eagle3_head(None, model_cfg, torch.float32, torch.device("cpu"), 4096,
                            draft_vocab_size=min(draft_vocab_size, model_cfg.vocab_size))
    save_eagle3_head(head, out_dir)
    return out_dir


def _spec_configs(args: argparse.Namespace, target_dir: str | None, head_dir: str) -> list[tuple[str, SpecConfig]]:
    """Without the target's weights (`--load-format dummy`) there is no copy of it to draft with: the upper
    bound is left out."""
    topk, steps, tokens = args.tree
    configs = [("no speculation", SpecConfig())]
    drafts = [("upper bound: draft model = target", "DRAFT_MODEL", target_dir)] if target_dir else []
    for name, algorithm, path in drafts + [("lower bound: random EAGLE-3 head", "EAGLE3", head_dir)]:
        configs += [(f"{name}, chain {k}", SpecConfig(algorithm, path, k)) for k in args.num_steps]
        configs.append((f"{name}, tree topk {topk} steps {steps} tokens {tokens}",
                        SpecConfig(algorithm, path, steps, topk, tokens)))
    return configs


def run_spec_bench(engine_config: EngineConfig, args: argparse.Namespace) -> dict:
    if engine_config.device == "auto":
        engine_config = replace(engine_config, device="cpu")
    resolved = resolve_model(engine_config)
    counting = getattr(args, "count_experts", False)
    if counting:
        experts.check_moe(resolved.model_cfg)
    scratch = tempfile.TemporaryDirectory()
    head_dir = _random_head(resolved.model_cfg, Path(scratch.name) / "random-eagle3", args.draft_vocab_size)
    target_dir = str(resolved.weights_dir) if resolved.weights_dir is not None else None
    configs = _spec_configs(args, target_dir, str(head_dir))
    prompt = make_prompts(1, args.prompt_len, resolved.model_cfg.vocab_size, 0)[0]
    rows, reference = [], None
    for label, spec in configs:
        config = replace(engine_config, spec=spec)
        with experts.counting(config) if counting else contextlib.nullcontext() as counts:
            llm = LLM(config=config)
        if counts is not None:
            experts.watch_steps(llm, counts)
        _timed_run(llm, prompt, 8)  # warm-up
        if counts is not None:
            counts.reset()
        runs = [_timed_run(llm, prompt, args.output_len) for _ in range(args.repeats)]
        reference = reference or runs[0]["tokens"]
        row = {
            "config": label,
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            "mean_acceptance_length": runs[0]["mean_acceptance_length"],
            "same_tokens_as_no_spec": runs[0]["tokens"] == reference,
        }
        if counts is not None:
            row["experts_touched"] = experts.summary(llm, counts)
        llm.close()  # the next configuration's engine gets the whole device
        rows.append(row)
        print(f"{label:64s} {row['decode_tok_s']:7.1f} tok/s  acceptance {row['mean_acceptance_length']}  "
              f"identical {row['same_tokens_as_no_spec']}", flush=True)
        if counts is not None:
            print(f"  {experts.describe(row['experts_touched'])}", flush=True)
    base = rows[0]["decode_tok_s"]
    for row in rows:
        row["ratio_to_no_spec"] = row["decode_tok_s"] / base
    report = {
        "benchmark": "spec_cpu",
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware": hardware_info(),
        "settings": {"model": resolved.name, "batch_size": 1, "random_head_draft_vocab": args.draft_vocab_size, "prompt_len": args.prompt_len,
                     "output_len": args.output_len, "repeats": args.repeats, "greedy": True,
                     "method": "decode tok/s = (output_len - 1) / (last token time - first token time), median",
                     "experts_touched": experts.NOTE if counting else None},
        "results": rows,
    }
    print(f"wrote {write_report(report, args.out or DEFAULT_OUT)}")
    return report
