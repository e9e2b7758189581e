"""Multi-turn conversations with prefix caching on and off, offline: hit rate, TTFT, tok/s and acceptance.

Each conversation is replayed turn by turn, as a chat client does: turn t's prompt is the whole history (every
earlier question and the model's own answer) plus the next question, so with caching on it finds all but its
newest part in the cache. Conversations run `--concurrency` at a time; greedy, so both settings must produce the
same text (compared by a digest of every answer's token ids). TTFT is from a request's submission to the step
that returns its first token; tok/s is a turn's output tokens over its wall time. Two engines, caching on and
off, are built side by side and take turns, group by group of conversations, so that both see the same load on
a shared machine; each first replays an untimed warm-up conversation.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from specserve.bench.report import write_report
from specserve.bench.datasets import mt_bench_questions, read_jsonl_conversations, sharegpt_conversations
from specserve.bench.decode import hardware_info
from specserve.config import EngineConfig
from specserve.core import SamplingParams

DEFAULT_OUT = Path("benchmarks/results/prefix_cache_multiturn_cpu.json")


def conversations(data: str, num: int) -> list[list[str]]:
    """User turns per conversation: MT-Bench's two, ShareGPT's human turns, or a JSONL file's "turns"."""
    if data == "mt-bench":
        turns = [q["turns"] for q in mt_bench_questions()]
    elif data == "sharegpt":
        turns = list(sharegpt_conversations(num))
    else:
        turns = list(read_jsonl_conversations(Path(data).expanduser()))
    return turns[:num]


def _replay(llm, group: list[list[str]], params: SamplingParams, turns: dict) -> list[list[int]]:
    """Runs `group`'s conversations together, turn by turn; adds each turn's figures to `turns` and returns
    each conversation's answers (token ids)."""
    histories = [[] for _ in group]
    answers = [[] for _ in group]
    for turn in range(max(len(t) for t in group)):
        active = [i for i, t in enumerate(group) if turn < len(t)]
        for i in active:
            histories[i].append({"role": "user", "content": group[i][turn]})
        start = time.perf_counter()
        trackers = [llm.add(llm.chat_prompt(histories[i]), params) for i in active]
        first_token = [None] * len(trackers)
        while llm.engine.has_work():
            llm.step_and_track(trackers)
            now = time.perf_counter()
            for j, tracker in enumerate(trackers):
                if first_token[j] is None and tracker.output.token_ids:
                    first_token[j] = now - start
        seconds = time.perf_counter() - start
        figures = turns.setdefault(turn + 1, {"ttft_s": [], "prompt_tokens": 0, "cached_tokens": 0,
                                              "output_tokens": 0, "seconds": 0.0, "spec_steps": 0, "accepted": 0})
        figures["ttft_s"] += first_token
        figures["seconds"] += seconds
        for i, tracker in zip(active, trackers):
            out = tracker.output
            figures["prompt_tokens"] += len(out.prompt_token_ids)
            figures["cached_tokens"] += out.num_cached_tokens
            figures["output_tokens"] += len(out.token_ids)
            figures["spec_steps"] += out.num_spec_steps
            figures["accepted"] += out.num_accepted_tokens
            histories[i].append({"role": "assistant", "content": out.text})
            answers[i].append(out.token_ids)
    return answers


def _summary(llm, turns: dict[int, dict], digest) -> dict:
    rows = []
    for turn, f in sorted(turns.items()):
        rows.append({"turn": turn, "requests": len(f["ttft_s"]), "mean_ttft_s": statistics.fmean(f["ttft_s"]),
                     "median_ttft_s": statistics.median(f["ttft_s"]), "prompt_tokens": f["prompt_tokens"],
                     "cached_tokens": f["cached_tokens"], "hit_rate": f["cached_tokens"] / f["prompt_tokens"],
                     "prefill_tokens_computed": f["prompt_tokens"] - f["cached_tokens"],
                     "output_tokens": f["output_tokens"], "tok_s": f["output_tokens"] / f["seconds"],
                     "mean_acceptance_length": (f["accepted"] + f["spec_steps"]) / f["spec_steps"]
                     if f["spec_steps"] else None})
        print(f"  turn {turn}: {rows[-1]}", flush=True)
    cache = llm.engine.scheduler.prefix_cache
    return {"prefix_caching": cache is not None, "turns": rows,
            "engine_hit_rate": cache.hit_rate if cache else 0.0, "answers_sha256": digest.hexdigest()[:16]}


def run_multi_turn_bench(config: EngineConfig, args: argparse.Namespace) -> dict:
    from specserve.llm import LLM

    convs = conversations(args.data, args.num_conversations)
    engines = [LLM(config=replace(config, cache=replace(config.cache, enable_prefix_caching=caching)))
               for caching in (True, False)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    turns: list[dict[int, dict]] = [{}, {}]
    digests = [hashlib.sha256(), hashlib.sha256()]
    for llm in engines:
        _replay(llm, [["Say hello."]], SamplingParams(max_tokens=8, temperature=0.0), {})  # warm-up, untimed
    for first in range(0, len(convs), args.concurrency):
        for llm, figures, digest in zip(engines, turns, digests):
            for answers in _replay(llm, convs[first:first + args.concurrency], params, figures):
                digest.update(str(answers).encode())
    settings = []
    for caching, llm, figures, digest in zip(("on", "off"), engines, turns, digests):
        print(f"prefix caching {caching}:", flush=True)
        settings.append(_summary(llm, figures, digest))
    on, off = settings
    report = {
        "command": "specserve bench multi-turn", "date": dt.date.today().isoformat(), "hardware": hardware_info(),
        "model": config.model_path or "embedded SmolLM2-135M-Instruct", "speculative_algorithm": config.spec.algorithm,
        "data": args.data, "num_conversations": len(convs), "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "settings": settings,
        "identical_text": on["answers_sha256"] == off["answers_sha256"],
        "ttft_ratio_on_over_off": [a["mean_ttft_s"] / b["mean_ttft_s"] for a, b in zip(on["turns"], off["turns"])],
    }
    print(json.dumps({k: report[k] for k in ("identical_text", "ttft_ratio_on_over_off")}), flush=True)
    write_report(report, args.out or DEFAULT_OUT)
    return report
