"""Two versions of specserve on one GPU in one call: the check that a change leaves speed where it was.

Runs the figures a refactor must not move for a baseline copy of the package and for this tree, each
through the CLI (`specserve bench`), the versions interleaved per figure:
- 8B-shape decode at batch 1 (random bf16 weights, 512-token prompt, 128 output tokens);
- offline waves at C = 1, 10, 100, 250 (random 512-token prompts, 256 output tokens), plain and with the
  adaptive EAGLE-3 chain of 3 at simulated acceptance tau 3.
It then prints, and writes to OUT/compare_revisions.md and .json, each figure for both versions and their ratio;
each run's own report goes to OUT/runs/ (--keep-runs) or to a temporary folder.

The baseline is a copy of the package from another revision (its bundled draft head is not needed here):
    git archive REV specserve ':!specserve/draft_heads/*/*.safetensors' | tar -x -C BASE_DIR
    python benchmarks/compare_revisions.py --base BASE_DIR --out OUT_DIR
Both versions run with the same installed dependencies (the CLI needs the server's: fastapi, uvicorn, gguf).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--device", "cuda", "--model-path", "llama-3.1-8b", "--load-format", "dummy", "--dtype", "bfloat16",
         "--context-length", "2048"]
DECODE = ["bench", "decode", *MODEL, "--prompt-len", "512", "--output-len", "128", "--repeats", "2",
          "--chunked-prefill-size", "32768", "--batch-sizes", "1", "--no-hf"]
WAVES = ["bench", "--offline", *MODEL, "--chunked-prefill-size", "16384", "--dataset", "random",
         "--random-input-len", "512", "--max-tokens", "256", "--ignore-eos", "--quiet"]
ADAPTIVE_CHAIN = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                  "--speculative-simulate-accept-len", "3.0", "--speculative-adaptive"]
CONCURRENCY = "1,10,100,250"


def run_cli(package_root: Path, cli_args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(package_root), "PYTHONUNBUFFERED": "1"}
    subprocess.run([sys.executable, "-m", "specserve.cli", *cli_args], env=env, check=True, cwd=package_root)


def decode_tok_s(path: Path) -> dict[str, float]:
    rows = json.loads(path.read_text())["results"]
    return {f"decode bs={r['batch_size']}": r["specserve"]["decode_tok_s"] for r in rows}


def waves_tok_s(path: Path, name: str) -> dict[str, float]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {f"{name} C={int(r['concurrency'])}": r["output_tok_s"] for r in records}


def measure(versions: dict[str, Path], out: Path) -> dict[str, dict[str, float]]:
    figures: dict[str, dict[str, float]] = {name: {} for name in versions}
    for name, root in versions.items():
        path = out / f"decode_{name}.json"
        run_cli(root, [*DECODE, "--out", str(path)])
        figures[name].update(decode_tok_s(path))
    for setup, extra in (("plain", []), ("adaptive chain", ADAPTIVE_CHAIN)):
        for name, root in versions.items():
            path = out / f"waves_{setup.replace(' ', '_')}_{name}.jsonl"
            run_cli(root, [*WAVES, *extra, "--concurrency", CONCURRENCY, "--out", str(path)])
            figures[name].update(waves_tok_s(path, setup))
    return figures


def report(figures: dict[str, dict[str, float]]) -> str:
    base, new = figures["base"], figures["new"]
    lines = ["| figure | base tok/s | new tok/s | new / base |", "|---|---|---|---|"]
    for key in base:
        lines.append(f"| {key} | {base[key]:,.1f} | {new[key]:,.1f} | {new[key] / base[key]:.3f} |")
    for c in CONCURRENCY.split(","):
        plain, chain = f"plain C={c}", f"adaptive chain C={c}"
        lines.append(f"| adaptive chain ÷ plain, C={c} | {base[chain] / base[plain]:.2f}x | "
                     f"{new[chain] / new[plain]:.2f}x | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="a folder holding the baseline's specserve package")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the table")
    parser.add_argument("--keep-runs", action="store_true", help="keep each run's report in OUT/runs/")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        runs = out / "runs" if args.keep_runs else Path(scratch)
        runs.mkdir(exist_ok=True)
        figures = measure({"base": Path(args.base).resolve(), "new": ROOT}, runs)
    table = report(figures)
    (out / "compare_revisions.md").write_text(table)
    (out / "compare_revisions.json").write_text(json.dumps(figures, indent=1) + "\n")
    print(table)


if __name__ == "__main__":
    main()
