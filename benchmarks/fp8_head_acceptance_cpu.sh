#!/usr/bin/env bash
# What an fp8 draft head costs in acceptance: SmolLM2-135M-Instruct with its bundled EAGLE-3 head, as shipped
# (bf16 values) and with --speculative-draft-model-quantization fp8 (a CPU keeps the head's quantized values in
# its dtype, so the drafts are the fp8 head's), greedy over MT-bench's 80 first turns, a chain of 3 and the
# top-4, 5-level tree of 16 tokens, drafting every step. Writes benchmarks/results/fp8_head_acceptance_cpu.json.
# Docs figure it reproduces: the acceptance length of the trained head in bf16 and in fp8.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
tmp=$(mktemp -d)
common=(--offline --device cpu --dataset mt-bench --num-prompts 80 --concurrency 8 --max-tokens 128 --quiet
        --speculative-algorithm EAGLE3)
for shape in "chain:--speculative-num-steps 3 --speculative-eagle-topk 1" \
             "tree:--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16"; do
  name=${shape%%:*}
  read -r -a flags <<< "${shape#*:}"
  specserve bench "${common[@]}" "${flags[@]}" --label "$name, bf16 head" --out "$tmp/${name}_bf16.jsonl"
  specserve bench "${common[@]}" "${flags[@]}" --speculative-draft-model-quantization fp8 \
    --label "$name, fp8 head" --out "$tmp/${name}_fp8.jsonl"
done
python - "$tmp" "$OUT/fp8_head_acceptance_cpu.json" <<'PY'
import json, sys
from pathlib import Path
from specserve.bench.decode import hardware_info
rows = []
for path in sorted(Path(sys.argv[1]).glob("*.jsonl")):
    for line in path.read_text().splitlines():
        r = json.loads(line)
        rows.append({k: r.get(k) for k in ("label", "concurrency", "completed", "output_tok_s",
                                           "mean_acceptance_length", "acceptance_simulated")})
report = {"benchmark": "fp8_head_acceptance_cpu", "hardware": hardware_info(),
          "settings": {"model": "SmolLM2-135M-Instruct (embedded) with its bundled EAGLE-3 head", "dataset": "mt-bench",
                       "prompts": 80, "max_tokens": 128, "concurrency": 8, "greedy": True},
          "note": "mean_acceptance_length: tokens per drafting step, the verified root's included (measured)",
          "results": rows}
Path(sys.argv[2]).write_text(json.dumps(report, indent=2))
for r in rows:
    print(f"{r['label']:20s} acceptance {r['mean_acceptance_length']:.3f}  ({r['completed']} requests)")
PY
