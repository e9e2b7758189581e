#!/usr/bin/env bash
# CPU serving sweep of the embedded SmolLM2-135M: no speculation vs a random EAGLE-3 head (chain of 3) whose
# acceptance is simulated at tau = 3. Writes benchmarks/results/serving_cpu_*.jsonl/png and a comparison.
# Docs figure it reproduces: the CPU serving sweep through the OpenAI client (serving_cpu_compare.md and .png).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results
PORT=${PORT:-30555}
HEAD_DIR=$(mktemp -d)
python - "$HEAD_DIR" <<'PY'
import sys
from pathlib import Path
import torch
from specserve.config import EngineConfig
from specserve.engine.factory import resolve_model
from specserve.models.loader import load_eagle3_head, save_eagle3_head
cfg = resolve_model(EngineConfig()).model_cfg
save_eagle3_head(load_eagle3_head(None, cfg, torch.float32, torch.device("cpu"), 8192, draft_vocab_size=16384), Path(sys.argv[1]))
PY

run() {  # run LABEL [serve flags...]
  local label=$1; shift
  specserve serve --port "$PORT" "$@" > "/tmp/specserve-bench-$label.log" 2>&1 &
  local pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
  specserve bench --base-url "http://127.0.0.1:$PORT" --dataset sharegpt --concurrency 1,2,4,8,16 \
    --num-prompts 24 --max-tokens 48 --ignore-eos --label "$label" --out "$OUT/serving_cpu_$label.jsonl"
  kill "$pid"; wait "$pid" || true
}

run no-spec --speculative-algorithm NONE
run eagle3-sim-tau3 --speculative-algorithm EAGLE3 --speculative-draft-model-path "$HEAD_DIR" \
  --speculative-num-steps 3 --speculative-simulate-accept-len 3.0
specserve bench --compare "$OUT/serving_cpu_no-spec.jsonl" "$OUT/serving_cpu_eagle3-sim-tau3.jsonl" \
  --out "$OUT/serving_cpu_compare.png" | tee "$OUT/serving_cpu_compare.md"
