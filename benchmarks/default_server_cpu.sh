#!/usr/bin/env bash
# The default server on a CPU (`specserve serve`, which drafts with the bundled EAGLE-3 head) against the same
# server with speculation off, one request at a time on MT-Bench first turns, greedy, up to 256 tokens.
# Writes benchmarks/results/default_server_cpu_*.jsonl/png and a comparison table.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results
PORT=${PORT:-30556}

run() {  # run LABEL [serve flags...]
  local label=$1; shift
  specserve serve --port "$PORT" "$@" > "/tmp/specserve-default-$label.log" 2>&1 &
  local pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
  specserve bench --base-url "http://127.0.0.1:$PORT" --dataset mt-bench --concurrency 1 --num-prompts 12 \
    --max-tokens 256 --label "$label" --out "$OUT/default_server_cpu_$label.jsonl"
  kill "$pid"; wait "$pid" || true
}

run spec-off --speculative-algorithm NONE
run default
specserve bench --compare "$OUT/default_server_cpu_spec-off.jsonl" "$OUT/default_server_cpu_default.jsonl" \
  --out "$OUT/default_server_cpu_compare.png" | tee "$OUT/default_server_cpu_compare.md"
