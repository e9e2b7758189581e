"""Greedy decode throughput: specserve vs Hugging Face `generate`, same weights, prompts and process.

Timing method (identical for both systems): one run is timestamped every time a token for the whole batch
becomes known on the host. TTFT is the time from the start of the run to the first token (prefill plus one
sample); decode time is from the first token to the last, so decode tok/s = batch * (output_len - 1) /
decode time and prefill never leaks in. specserve is timed around `EngineCore.step()` (no detokenising,
which HF's `generate` does not do either); HF is timed by a streamer, whose `put` is called synchronously
after every step on CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from specserve.bench import experts
from specserve.bench.report import write_report
from specserve.config import EngineConfig
from specserve.core import SamplingParams

MAX_RETRIES = 3
CONTENDED_CORE_FRAC = 0.15
DEFAULT_OUT = Path("benchmarks/results/decode_cpu.json")
TIMING_METHOD = (
    "per-run token timestamps: ttft = first token of the batch known on host - run start; "
    "decode_tok_s = batch * (output_len - 1) / (last token time - first token time); "
    "specserve timed around EngineCore.step() (no detokenisation), HF timed by a BaseStreamer on generate(); "
    "one warm-up run per system and batch size, then median over repeats, the two systems interleaved per repeat; "
    "a run during which other processes used > 0.15 of a core (from /proc/stat) is re-run, up to 3 times "
    "(each run records other_procs_cores and retries)"
)


def hardware_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        # Other jobs on a 2-core box skew the figures; the load average at the start says whether they ran alone.
        "loadavg_at_start": os.getloadavg(),
    }


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    # Skip the low ids, where tokenizers keep their special tokens, so no prompt carries a stray EOS/BOS.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (batch, prompt_len), generator=g).tolist()


def _summary(ttft: float, t_first: float, t_last: float, batch: int, output_len: int) -> dict:
    decode_s = t_last - t_first
    return {
        "ttft_s": ttft,
        "decode_s": decode_s,
        "decode_tok_s": batch * (output_len - 1) / decode_s if decode_s > 0 else float("nan"),
        "e2e_s": ttft + decode_s,
        "e2e_tok_s": batch * output_len / (ttft + decode_s),
    }


_ids = itertools.count()


def run_specserve(llm, prompts: list[list[int]], output_len: int) -> tuple[dict, list[list[int]]]:
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    rids = [f"bench-{next(_ids)}" for _ in prompts]
    outputs: dict[str, list[int]] = {r: [] for r in rids}
    t0 = time.perf_counter()
    for rid, p in zip(rids, prompts):
        engine.add_request(rid, p, params)
    stamps = []  # time after each step that produced a token for every sequence
    while engine.has_work():
        deltas = engine.step()
        for d in deltas:
            outputs[d.request_id].extend(d.new_token_ids)
        if len(deltas) == len(prompts):
            stamps.append(time.perf_counter())
    # The whole batch must prefill in one step and decode in lockstep, or the method above does not hold.
    if len(stamps) != output_len:
        raise RuntimeError(f"expected {output_len} full-batch steps, saw {len(stamps)}; raise --chunked-prefill-size")
    return _summary(stamps[0] - t0, stamps[0], stamps[-1], len(prompts), output_len), [outputs[r] for r in rids]


class _StampStreamer:
    """BaseStreamer protocol: `put` gets the prompt first, then each step's new tokens [batch]."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.tokens: list[torch.Tensor] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.stamps.append(time.perf_counter())
        self.tokens.append(value.reshape(-1))

    def end(self) -> None:
        pass


def _hf_peer(resolved, llm, dtype: torch.dtype):
    """HF transformers on the same device: the same checkpoint, or random weights of the same shape for
    `--load-format dummy` (then tokens cannot be compared, only speed). fp32 on a CPU, else specserve's dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = next(llm.engine.runner.model.parameters()).device
    hf_dtype = torch.float32 if device.type == "cpu" else dtype
    if resolved.weights_dir is not None:
        return AutoModelForCausalLM.from_pretrained(str(resolved.weights_dir), dtype=hf_dtype).to(device).eval()
    fields = json.loads(resolved.config_file.read_text())
    config = AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)
    with torch.device(device):  # random init where the model lives: fast on a GPU
        return AutoModelForCausalLM.from_config(config, dtype=hf_dtype).eval()


def run_hf(model, prompts: list[list[int]], output_len: int, pad_token_id: int) -> tuple[dict, list[list[int]]]:
    input_ids = torch.tensor(prompts, device=model.device)
    streamer = _StampStreamer()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),  # equal lengths: no padding anywhere
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=pad_token_id,
            streamer=streamer,
        )
    if len(streamer.stamps) != output_len:
        raise RuntimeError(f"HF streamed {len(streamer.stamps)} steps, expected {output_len}")
    tokens = torch.stack(streamer.tokens, dim=1).tolist()  # [batch, output_len]
    return _summary(streamer.stamps[0] - t0, streamer.stamps[0], streamer.stamps[-1], len(prompts), output_len), tokens


def _busy_cpu_s() -> float:
    # Busy CPU-seconds of the whole machine (all but idle and iowait); 0 where /proc/stat is missing.
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def _timed(fn, *a):
    """Runs fn, re-running it (up to MAX_RETRIES) while other processes took CPU from it.

    On a small, shared machine another job taking one of its cores can cut tok/s several-fold, which would
    say nothing about either system. A run counts as contended if other processes used more than
    CONTENDED_CORE_FRAC of a core on average during it."""
    for attempt in range(MAX_RETRIES + 1):
        b0, c0, w0 = _busy_cpu_s(), time.process_time(), time.perf_counter()
        result, tokens = fn(*a)
        wall = time.perf_counter() - w0
        other = max(0.0, (_busy_cpu_s() - b0) - (time.process_time() - c0)) / wall
        result["other_procs_cores"] = round(other, 3)
        result["retries"] = attempt
        if other <= CONTENDED_CORE_FRAC:
            break
    return result, tokens


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0] if k not in ("retries", "other_procs_cores")}


def matching_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for u, v in zip(a, b):
        if u != v:
            break
        n += 1
    return n


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    # Fraction of sequences' positions that match before the first divergence: greedy fp32 should agree
    # closely; a low figure means the two systems are not doing the same work.
    total = sum(len(x) for x in a)
    return sum(matching_prefix(x, y) for x, y in zip(a, b)) / total if total else float("nan")


def run_decode_bench(engine_config: EngineConfig, args: argparse.Namespace) -> dict:
    from specserve.engine.factory import resolve_model
    from specserve.llm import LLM

    # This is a CPU comparison against an fp32 HF model on CPU; "auto" would pick a GPU if there were one.
    if engine_config.device == "auto":
        engine_config = replace(engine_config, device="cpu")
    prompt_len, output_len, repeats = args.prompt_len, args.output_len, args.repeats
    out = Path(args.out) if args.out else DEFAULT_OUT
    hw = hardware_info()

    counting = getattr(args, "count_experts", False)
    if counting:
        experts.check_moe(resolve_model(engine_config).model_cfg)
    with experts.counting(engine_config) if counting else contextlib.nullcontext() as counts:
        llm = LLM(config=engine_config)
    if counts is not None:
        experts.watch_steps(llm, counts)
    dtype = next(llm.engine.runner.model.parameters()).dtype
    vocab = llm.model_info.model_cfg.vocab_size
    hf = None
    if not args.no_hf:
        hf = _hf_peer(resolve_model(engine_config), llm, dtype)
        pad = hf.generation_config.pad_token_id
        pad = pad if pad is not None else (hf.generation_config.eos_token_id or 0)
        if isinstance(pad, list):
            pad = pad[0]

    results = []
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, prompt_len, vocab, engine_config.random_seed + batch)
        run_specserve(llm, prompts, output_len)  # warm-up: allocator, oneDNN kernel selection, caches
        if counts is not None:
            counts.reset()
        if hf is not None:
            run_hf(hf, prompts, output_len, pad)
        ss_runs, hf_runs = [], []
        for _ in range(repeats):
            # Interleaved so slow drift on a shared machine hits both systems alike.
            r, ss_tokens = _timed(run_specserve, llm, prompts, output_len)
            ss_runs.append(r)
            if hf is not None:
                r, hf_tokens = _timed(run_hf, hf, prompts, output_len, pad)
                hf_runs.append(r)
        row = {"batch_size": batch, "specserve": _median(ss_runs), "specserve_runs": ss_runs}
        if counts is not None:
            row["experts_touched"] = experts.summary(llm, counts)
        if llm.model_info.model_cfg.moe is not None:
            row["moe_bandwidth"] = experts.bandwidth_row(llm, batch, row["specserve"]["decode_tok_s"],
                                                         row.get("experts_touched"))
        if hf is not None:
            row["hf"] = _median(hf_runs)
            row["hf_runs"] = hf_runs
            row["decode_ratio"] = row["specserve"]["decode_tok_s"] / row["hf"]["decode_tok_s"]
            row["ttft_ratio_hf_over_specserve"] = row["hf"]["ttft_s"] / row["specserve"]["ttft_s"]
            if llm.model_info.weights_dir is not None:  # random weights differ between the two
                row["greedy_token_agreement"] = token_agreement(ss_tokens, hf_tokens)
        results.append(row)
        _print_row(row)

    report = {
        "benchmark": f"decode_{engine_config.device}",
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware": hw,
        "settings": {
            "model": llm.model_info.name,
            "weights_dir": str(llm.model_info.weights_dir),
            "device": engine_config.device,
            "specserve_dtype": str(dtype).removeprefix("torch."),
            "hf_dtype": str(next(hf.parameters()).dtype).removeprefix("torch.") if hf is not None else None,
            "hf_weights": "random (same shape)" if llm.model_info.weights_dir is None else "the same checkpoint",
            "hf_attn_implementation": getattr(hf.config, "_attn_implementation", None) if hf is not None else None,
            "batch_sizes": list(args.batch_sizes),
            "prompt_len": prompt_len,
            "output_len": output_len,
            "repeats": repeats,
            "prompt_seed": f"random_seed + batch_size ({engine_config.random_seed} + b)",
            "chunked_prefill_size": engine_config.scheduler.chunked_prefill_size,
            "page_size": engine_config.cache.page_size,
            "method": TIMING_METHOD,
            "experts_touched": experts.NOTE if counting else None,
            "greedy_token_agreement": "fraction of output tokens before each sequence's first mismatch, last repeat; "
            "HF's min_new_tokens masks EOS while specserve's ignore_eos emits it and goes on, so a sequence whose "
            "greedy pick is EOS diverges there even when the models agree",
        },
        "results": results,
        "ratios": {str(r["batch_size"]): r.get("decode_ratio") for r in results},
    }
    report["hardware"]["loadavg_at_end"] = os.getloadavg()
    _print_table(report)
    write_report(report, out)
    png = out.with_suffix(".png")
    _plot(report, png)
    print(f"wrote {out} and {png}")
    return report


def _print_row(row: dict) -> None:
    s = row["specserve"]
    msg = f"batch {row['batch_size']}: specserve {s['decode_tok_s']:.1f} tok/s (ttft {s['ttft_s'] * 1e3:.0f} ms)"
    if "hf" in row:
        msg += f", hf {row['hf']['decode_tok_s']:.1f} tok/s (ttft {row['hf']['ttft_s'] * 1e3:.0f} ms), ratio {row['decode_ratio']:.2f}x"
    print(msg, flush=True)
    if "experts_touched" in row:
        print(f"  {experts.describe(row['experts_touched'])}", flush=True)
    if "moe_bandwidth" in row:
        bw = row["moe_bandwidth"]
        print(f"  {bw['step_weight_bytes']['total'] / 1e9:.2f} GB of weights a step ({bw['distinct_experts_per_layer']} "
              f"experts a layer, {bw['distinct_experts_from']}): {bw['weight_gb_per_s']} GB/s", flush=True)


def _print_table(report: dict) -> None:
    hw, st = report["hardware"], report["settings"]
    print(f"\nCPU: {hw['cpu']} | cores {hw['usable_cores']} (logical {hw['logical_cores']}) | torch threads "
          f"{hw['torch_threads']} | torch {hw['torch']} | transformers {hw['transformers']}")
    print(f"model {st['model']} | dtype specserve {st['specserve_dtype']}, HF {st['hf_dtype']} | prompt "
          f"{st['prompt_len']}, output {st['output_len']}, median of {st['repeats']}")
    head = f"{'batch':>5} | {'specserve tok/s':>15} | {'HF tok/s':>9} | {'ratio':>6} | {'ss TTFT ms':>10} | {'HF TTFT ms':>10} | {'agree':>5}"
    print(head)
    print("-" * len(head))
    for r in report["results"]:
        s, h = r["specserve"], r.get("hf")
        print(f"{r['batch_size']:>5} | {s['decode_tok_s']:>15.1f} | "
              + (f"{h['decode_tok_s']:>9.1f} | {r['decode_ratio']:>5.2f}x | " if h else f"{'-':>9} | {'-':>6} | ")
              + f"{s['ttft_s'] * 1e3:>10.0f} | " + (f"{h['ttft_s'] * 1e3:>10.0f} | {r.get('greedy_token_agreement', float('nan')):>5.2f}" if h else f"{'-':>10} | {'-':>5}"))


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on servers or in CI
    import matplotlib.pyplot as plt

    rows = report["results"]
    xs = range(len(rows))
    has_hf = all("hf" in r for r in rows)
    width = 0.38 if has_hf else 0.6
    fig, ax = plt.subplots(figsize=(6, 4))
    ss = [r["specserve"]["decode_tok_s"] for r in rows]
    ax.bar([x - width / 2 if has_hf else x for x in xs], ss, width, label="specserve")
    if has_hf:
        hf = [r["hf"]["decode_tok_s"] for r in rows]
        ax.bar([x + width / 2 for x in xs], hf, width, label="HF transformers generate")
        for x, r in zip(xs, rows):
            ax.annotate(f"{r['decode_ratio']:.2f}x", (x, max(r["specserve"]["decode_tok_s"], r["hf"]["decode_tok_s"])),
                        xytext=(0, 4), textcoords="offset points", ha="center", fontsize=9)
    ax.set_xticks(list(xs), [f"batch {r['batch_size']}" for r in rows])
    ax.set_ylabel("greedy decode tok/s (prefill excluded)")
    hw, st = report["hardware"], report["settings"]
    ax.set_title(f"{st['model']} {st['specserve_dtype']}, {hw['cpu']}, {hw['torch_threads']} threads\n"
                 f"prompt {st['prompt_len']}, output {st['output_len']}; labels: specserve / HF", fontsize=9)
    ax.margins(y=0.15)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
