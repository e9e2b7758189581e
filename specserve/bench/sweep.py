"""`specserve bench`: online sweeps against a server, offline sweeps in-process, and comparisons.

Every level becomes one JSON Lines record (the command, the server's settings when it publishes them, the
hardware, the figures); the run ends with a markdown table and a PNG plot next to the JSONL file.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import shlex
import sys
import time
from pathlib import Path

from tqdm import tqdm

from specserve.bench.datasets import BenchPrompt, load_prompts
from specserve.bench.report import (
    BenchError,
    RequestResult,
    compare_table,
    dumps,
    follows_schema,
    markdown_table,
    plot,
    read_jsonl,
    run_label,
    summarize,
)

DEFAULT_CONCURRENCY = [1, 2, 5, 10, 30, 70, 100, 250]
WARMUP_MAX_TOKENS = 8


def levels(args: argparse.Namespace) -> list[tuple[str, float]]:
    if args.request_rate:
        return [("request_rate", rate) for rate in args.request_rate]
    return [("concurrency", c) for c in args.concurrency]


def num_requests(args: argparse.Namespace, kind: str, value: float) -> int:
    if args.num_prompts:
        return args.num_prompts
    if getattr(args, "waves", None) and kind == "concurrency":
        return args.waves * int(value)
    return max(50, 4 * int(value)) if kind == "concurrency" else max(50, int(20 * value))


def _base_record(args: argparse.Namespace, mode: str) -> dict:
    from specserve.bench.decode import hardware_info

    return {
        "command": "specserve " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "label": args.label,
        "mode": mode,
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "dataset": args.dataset,
        "api": args.api,
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "hardware": hardware_info(),
    }


def _out_path(args: argparse.Namespace, mode: str) -> Path:
    if args.out:
        return Path(args.out)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(f"bench-{mode}-{stamp}.jsonl")


def _finish(records: list[dict], out: Path, title: str) -> None:
    print(markdown_table(records))
    png = out.with_suffix(".png")
    plot([(run_label(records, out.stem), records)], png, title)
    print(f"wrote {out} and {png}")


# -- online -----------------------------------------------------------------

def run_online(args: argparse.Namespace) -> list[dict]:
    from specserve.bench.serving import LoadSettings, probe

    base = args.base_url.rstrip("/")
    model, info = probe(base, args.api_key)
    settings = LoadSettings(args.api, model, args.max_tokens, args.temperature, args.ignore_eos)
    simulated = _simulated_accept_len(info)
    out = _out_path(args, "online")
    out.parent.mkdir(parents=True, exist_ok=True)
    records = []
    with out.open("w") as sink:
        for kind, value in levels(args):
            prompts = load_prompts(args.dataset, num_requests(args, kind, value), seed=args.seed,
                                   input_len=args.random_input_len, output_len=args.random_output_len,
                                   vocab_size=args.random_vocab_size)
            results, duration, before, after = asyncio.run(_online_level(base, args, settings, prompts, kind, value))
            record = {**_base_record(args, "online"), "base_url": base, "model": model, "server_info": info,
                      kind: value, "simulated_accept_len": simulated, **summarize(results, duration)}
            if record["mean_acceptance_length"] is None:
                record["mean_acceptance_length"] = _acceptance_from_metrics(before, after)
            record["acceptance_simulated"] = record["acceptance_simulated"] or simulated is not None
            records.append(record)
            sink.write(dumps(record) + "\n")
            sink.flush()
            if record["completed"] == 0:
                raise BenchError(f"every request failed at {kind} {value}: {record['first_error']}")
    _finish(records, out, f"{model} @ {base} — {args.dataset}")
    return records


async def _online_level(base, args, settings, prompts: list[BenchPrompt], kind: str, value: float):
    from specserve.bench.serving import (
        LoadSettings,
        make_client,
        metrics_snapshot,
        run_closed_loop,
        run_poisson,
    )

    concurrency = int(value) if kind == "concurrency" else 64
    client = make_client(base, args.api_key, concurrency, settings.timeout_s)
    warm = LoadSettings(settings.api, settings.model, WARMUP_MAX_TOKENS, settings.temperature, settings.ignore_eos)
    await run_closed_loop(client, prompts[:concurrency], concurrency, warm)
    before = metrics_snapshot(base)
    progress = tqdm(total=len(prompts), desc=f"{kind} {value:g}", unit="req", leave=False, disable=args.quiet)
    start = time.perf_counter()
    if kind == "concurrency":
        results = await run_closed_loop(client, prompts, concurrency, settings, progress)
    else:
        results = await run_poisson(client, prompts, value, settings, args.seed, progress)
    duration = time.perf_counter() - start
    progress.close()
    await client.close()
    return results, duration, before, metrics_snapshot(base)


def _simulated_accept_len(info: dict | None) -> float | None:
    spec = (info or {}).get("spec") or {}
    return spec.get("simulate_accept_len") or (info or {}).get("speculative_simulate_accept_len")


def _acceptance_from_metrics(before: dict, after: dict) -> float | None:
    total = after.get("specserve_spec_acceptance_length_sum", 0.0) - before.get("specserve_spec_acceptance_length_sum", 0.0)
    count = after.get("specserve_spec_acceptance_length_count", 0.0) - before.get("specserve_spec_acceptance_length_count", 0.0)
    return total / count if count else None


# -- offline ----------------------------------------------------------------

def run_offline(engine_config, args: argparse.Namespace) -> list[dict]:
    """The engine in this process, no HTTP: tok/s and where each step's time goes."""
    from specserve.engine.factory import pick_device
    from specserve.engine.phases import NoTimer, PhaseTimer
    from specserve.llm import LLM

    llm = LLM(config=engine_config, progress=not args.quiet)
    out = _out_path(args, "offline")
    out.parent.mkdir(parents=True, exist_ok=True)
    vocab = llm.model_info.model_cfg.vocab_size
    simulated = engine_config.spec.simulate_accept_len
    records = []
    with out.open("w") as sink:
        for kind, value in levels(args):
            if kind != "concurrency":
                raise BenchError("--request-rate needs a server: offline runs closed-loop waves only")
            prompts = load_prompts(args.dataset, num_requests(args, kind, value), seed=args.seed,
                                   input_len=args.random_input_len, output_len=args.random_output_len,
                                   vocab_size=vocab)
            token_prompts = [_tokenize(llm, p) for p in prompts]
            _offline_wave(llm, token_prompts[: int(value)], prompts, int(value), args, warmup=True)
            timer = PhaseTimer(pick_device(engine_config))
            llm.engine.time_phases(timer)
            results, duration = _offline_wave(llm, token_prompts, prompts, int(value), args)
            timer.stop()
            llm.engine.time_phases(NoTimer())
            record = {**_base_record(args, "offline"), "model": llm.model_info.name,
                      "engine_config": dataclasses.asdict(engine_config), kind: value, "simulated_accept_len": simulated,
                      **summarize(results, duration), "step_ms": timer.per_step_ms(), "num_steps": timer.steps,
                      "step_kinds": timer.step_kinds()}
            record["kv_pool"] = _kv_pool(llm.engine.stats(), engine_config.cache.page_size)
            if hasattr(llm.engine.observer, "snapshot"):
                record["plan"] = llm.engine.observer.snapshot()
            record["acceptance_simulated"] = simulated is not None
            records.append(record)
            sink.write(dumps(record) + "\n")
            sink.flush()
            steps = ", ".join(f"{k} {v:.2f}" for k, v in record["step_ms"].items())
            kinds = ", ".join(f"{k} {v['steps']} x {v['mean_ms']:.2f}" for k, v in record["step_kinds"].items())
            print(f"C={int(value)}: {record['output_tok_s']:,.1f} out tok/s; per step (ms): {steps}; steps (ms): {kinds}",
                  flush=True)
    _finish(records, out, f"{llm.model_info.name} offline — {args.dataset}")
    return records


def _kv_pool(stats, page_size: int) -> dict:
    """The KV pool: the tokens it holds, the bytes the target keeps a token (MLA: its latent, beside what
    expanded keys and values would take), and the pages still used after the wave (by the prefix cache's
    pages only, where it is on)."""
    return {"tokens": stats.pages_total * page_size, "target_bytes_per_token": stats.kv_bytes_per_token,
            "dense_bytes_per_token": stats.dense_kv_bytes_per_token,
            "pages_used_after_wave": stats.pages_used, "prefix_cached_pages": stats.prefix_cached_pages}


def _tokenize(llm, prompt: BenchPrompt) -> list[int]:
    if prompt.token_ids is not None:
        return prompt.token_ids
    return llm.chat_prompt(prompt.messages)


def _offline_wave(llm, token_prompts, prompts, concurrency: int, args, warmup: bool = False):
    """Closed loop in-process: keep `concurrency` requests running until all are done."""
    from specserve.core import SamplingParams

    def params(prompt: BenchPrompt) -> SamplingParams:
        max_tokens = WARMUP_MAX_TOKENS if warmup else (args.max_tokens or prompt.output_len or 256)
        return SamplingParams(max_tokens=max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos,
                              json_schema=prompt.schema)

    pending = list(zip(token_prompts, prompts))[::-1]
    live: dict = {}
    results: list[RequestResult] = []
    schemas: dict = {}  # tracker -> the JSON schema its reply must follow, or None
    progress = tqdm(total=len(pending), desc=f"C={concurrency}", unit="req", leave=False,
                    disable=args.quiet or warmup)
    start = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            ids, prompt = pending.pop()
            tracker = llm.add(ids, params(prompt))
            live[tracker] = RequestResult(ok=False, start=time.perf_counter(), prompt_tokens=len(ids))
            schemas[tracker] = prompt.schema
        trackers = list(live)
        counts = {t: len(t.output.token_ids) for t in trackers}
        llm.step_and_track(trackers)
        now = time.perf_counter()
        for tracker in trackers:
            result = live[tracker]
            if len(tracker.output.token_ids) > counts[tracker]:
                result.ttft = result.ttft if result.ttft is not None else now - result.start
                result.chunk_times.append(now)
            if tracker.output.finished:
                out = tracker.output
                result.end, result.ok, result.output_tokens = now, True, len(out.token_ids)
                result.spec_steps, result.spec_accepted = out.num_spec_steps, out.num_accepted_tokens
                if schemas[tracker] is not None:
                    result.schema_valid = follows_schema(schemas[tracker], out.text)
                results.append(live.pop(tracker))
                progress.update(1)
    progress.close()
    return results, time.perf_counter() - start


# -- compare ----------------------------------------------------------------

def run_compare(args: argparse.Namespace) -> None:
    runs = []
    for path in args.compare:
        if not Path(path).is_file():
            raise BenchError(f"no such file: {path}")
        records = read_jsonl(path)
        if not records:
            raise BenchError(f"{path} has no records")
        runs.append((run_label(records, Path(path).stem), records))
    print(compare_table(runs))
    out = Path(args.out) if args.out else Path("bench-compare.png")
    plot(runs, out.with_suffix(".png"), " vs ".join(label for label, _ in runs))
    print(f"wrote {out.with_suffix('.png')}")
