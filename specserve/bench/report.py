"""Turning timed requests into figures: per-level summaries, a markdown table, PNG plots, comparisons."""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

PERCENTILES = (50, 90, 99)


class BenchError(Exception):
    """A failure worth one line to the user (bad URL, dead server), not a traceback."""


@dataclass
class RequestResult:
    ok: bool
    start: float = 0.0
    ttft: float | None = None
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    spec_steps: int = 0  # speculative steps and drafts accepted in them, when the server reports them
    spec_accepted: int = 0
    acceptance_simulated: bool = False
    schema_valid: bool | None = None  # under a JSON schema: whether the reply parses and follows it
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def distribution(values: list[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds (None when there is nothing to measure)."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ordered = sorted(values)

    def pct(p: float) -> float:
        # Linear interpolation between closest ranks, as numpy's default.
        k = (len(ordered) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": 1e3 * statistics.fmean(ordered), **{f"p{p}": 1e3 * pct(p) for p in PERCENTILES}}


def summarize(results, duration_s: float) -> dict:
    """One level's figures from its RequestResults and the wall time from first send to last answer."""
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    # Acceptance length over the level: tokens emitted per speculative step (accepted drafts + the bonus).
    steps = sum(r.spec_steps for r in done)
    accepted = sum(r.spec_accepted for r in done)
    return {
        "num_requests": len(results),
        "completed": len(done),
        "errors": len(results) - len(done),
        "first_error": next((r.error for r in results if not r.ok), None),
        "duration_s": duration_s,
        "total_prompt_tokens": prompt,
        "total_output_tokens": output,
        "output_tok_s": output / duration_s if duration_s > 0 else 0.0,
        "total_tok_s": (output + prompt) / duration_s if duration_s > 0 else 0.0,
        "req_s": len(done) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": distribution([r.ttft for r in done]),
        "itl_ms": distribution([x for r in done for x in r.itls]),
        "tpot_ms": distribution([r.tpot for r in done if r.tpot is not None]),
        "e2e_latency_ms": distribution([r.latency for r in done]),
        "mean_acceptance_length": (accepted + steps) / steps if steps else None,
        "acceptance_simulated": any(r.acceptance_simulated for r in done),
        **_schema_validity(done),
    }


def follows_schema(schema: dict, text: str) -> bool:
    """Whether `text` parses as JSON that `schema` accepts."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _schema_validity(done) -> dict:
    """For a workload under JSON schemas (`--dataset json-schema`): the share of replies that follow theirs."""
    checked = [r.schema_valid for r in done if r.schema_valid is not None]
    return {"schema_valid_share": sum(checked) / len(checked)} if checked else {}


def level_name(record: dict) -> str:
    return f"rate {record['request_rate']}/s" if record.get("request_rate") else f"C={record['concurrency']}"


def markdown_table(records: list[dict]) -> str:
    head = ("| level | req | err | out tok/s | total tok/s | req/s | TTFT p50/p99 ms | TPOT p50/p99 ms | "
            "ITL p50 ms | e2e p50/p99 s | accept len |")
    lines = [head, "|" + "---|" * 11]
    for r in records:
        acc = r["mean_acceptance_length"]
        acc_text = "–" if acc is None else f"{acc:.2f}" + (" (simulated)" if r["acceptance_simulated"] else "")
        lines.append(
            f"| {level_name(r)} | {r['completed']} | {r['errors']} | {r['output_tok_s']:,.1f} | "
            f"{r['total_tok_s']:,.1f} | {r['req_s']:.2f} | {_ms(r['ttft_ms'], 'p50')}/{_ms(r['ttft_ms'], 'p99')} | "
            f"{_ms(r['tpot_ms'], 'p50')}/{_ms(r['tpot_ms'], 'p99')} | {_ms(r['itl_ms'], 'p50')} | "
            f"{_s(r['e2e_latency_ms'], 'p50')}/{_s(r['e2e_latency_ms'], 'p99')} | {acc_text} |"
        )
    valid = [f"{level_name(r)} {100 * r['schema_valid_share']:.0f} %" for r in records if "schema_valid_share" in r]
    if valid:
        lines.append(f"\nReplies that follow their JSON schema: {', '.join(valid)}")
    return "\n".join(lines)


def _ms(dist: dict, key: str) -> str:
    return "–" if dist[key] is None else f"{dist[key]:.1f}"


def _s(dist: dict, key: str) -> str:
    return "–" if dist[key] is None else f"{dist[key] / 1e3:.2f}"


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_label(records: list[dict], fallback: str) -> str:
    label = records[0].get("label") or fallback
    simulated = records[0].get("simulated_accept_len")
    return f"{label} (simulated τ={simulated})" if simulated else label


def plot(runs: list[tuple[str, list[dict]]], out: str | Path, title: str) -> None:
    """Output throughput, and p50/p99 end-to-end latency and TPOT, against load; one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for label, records in runs:
        # Joined sweeps need not list their levels in order; the lines must run along the axis.
        records = sorted(records, key=lambda r: r.get("request_rate") or r["concurrency"])
        xs = [r.get("request_rate") or r["concurrency"] for r in records]
        line = axes[0].plot(xs, [r["output_tok_s"] for r in records], marker="o", label=label)[0]
        for ax, key in ((axes[1], "e2e_latency_ms"), (axes[2], "tpot_ms")):
            scale = 1e-3 if key == "e2e_latency_ms" else 1.0
            ax.plot(xs, [_or_nan(r[key]["p50"], scale) for r in records], marker="o", color=line.get_color(),
                    label=f"{label} p50")
            ax.plot(xs, [_or_nan(r[key]["p99"], scale) for r in records], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{label} p99")
    by_rate = any(r.get("request_rate") for _, records in runs for r in records)
    xlabel = "request rate (req/s)" if by_rate else "concurrency"
    ticks = sorted({r.get("request_rate") or r["concurrency"] for _, records in runs for r in records})
    for ax, ylabel in zip(axes, ("output tok/s", "end-to-end latency (s)", "TPOT (ms)")):
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _or_nan(value, scale: float) -> float:
    return float("nan") if value is None else value * scale


def compare_table(runs: list[tuple[str, list[dict]]]) -> str:
    """Output tok/s of each run per level, with its ratio to the first run."""
    base_label = runs[0][0]
    all_records = sorted((r for _, records in runs for r in records),
                         key=lambda r: (bool(r.get("request_rate")), r.get("request_rate") or r["concurrency"]))
    levels = list(dict.fromkeys(level_name(r) for r in all_records))
    def short(label: str) -> str:
        return label.split(" (simulated")[0]

    head = "| level | " + " | ".join(label for label, _ in runs) + " | " + " | ".join(
        f"{short(label)} ÷ {short(base_label)}" for label, _ in runs[1:]) + " |"
    lines = [head, "|" + "---|" * (1 + len(runs) + len(runs) - 1)]
    for level in levels:
        values = []
        for _, records in runs:
            match = next((r for r in records if level_name(r) == level), None)
            values.append(None if match is None else match["output_tok_s"])
        cells = ["–" if v is None else f"{v:,.1f}" for v in values]
        ratios = ["–" if v is None or not values[0] else f"{v / values[0]:.2f}×" for v in values[1:]]
        lines.append(f"| {level} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def dumps(record: dict) -> str:
    return json.dumps(record, default=str)


def write_report(report: dict, out: str | Path) -> Path:
    """Writes a benchmark's report as indented JSON, making its folder first."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out
