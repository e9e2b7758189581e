#!/usr/bin/env bash
# Trains the default model's EAGLE-3 head on one H200, evaluates it on MT-Bench, and measures SmolLM2 decode.
#
# The machine takes at most 64 MiB per call, so the 94 MiB GGUF and the prompts arrive in two calls, and the
# job itself runs detached while later calls wait on it:
#   stage1 DIR   keep DIR's files under /tmp/smol: the first part of the GGUF, the prompts, wheels
#   launch DIR   add DIR's second GGUF part, start the job in its own session, then wait like `wait`
#   wait         up to ~9 minutes; prints the log's tail and copies what is finished to $OUT
# The prompts file is ShareGPT's first turns in file order, so `--data` with it picks what `--data sharegpt` does.
set -uo pipefail
cd "$(dirname "$0")/.."
T=/tmp/smol
# The detached job runs from its own copy of the code, which later calls' file transfers leave alone.
export PYTHONPATH=/tmp/site:$T/src PYTHONUNBUFFERED=1

job() {
  local model=$T/smollm2.gguf
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  python3 -m specserve.cli train-draft --target "$model" --device cuda --dtype bfloat16 \
    --data $T/sharegpt_first_turns.jsonl --num-prompts 6000 --max-tokens 320 --max-len 960 \
    --max-total-tokens 600000 --max-running-requests 256 --chunked-prefill-size 8192 --gen-batch 1024 \
    --draft-vocab-size 14336 --batch-size 16 --lr 3e-4 --warmup-steps 100 --train-minutes 11 \
    --checkpoint-every 500 --out $T/head || return 1
  touch $T/head_done
  python3 -m specserve.cli eval-draft --target "$model" --device cuda --dtype float32 --draft $T/head \
    --data mt-bench --concurrency 80 --max-tokens 256 --out $T/eval_mtbench_h200.json
  python3 -m specserve.cli bench decode --model-path "$model" --device cuda --dtype bfloat16 \
    --batch-sizes 1 64 --prompt-len 128 --output-len 128 --repeats 2 --out $T/decode_smollm2_h200.json
}

collect() {
  [[ -e $T/head_done ]] && cp $T/head/*.safetensors $T/head/*.json "$OUT"/ 2>/dev/null
  cp $T/eval_mtbench_h200.json $T/decode_smollm2_h200.json "$OUT"/ 2>/dev/null
  tr '\r' '\n' < $T/job.log | grep -v -i warn > "$OUT/job.log"
  tail -25 "$OUT/job.log"
}

wait_job() {
  local until=$((SECONDS + ${1:-540}))
  while [[ ! -e $T/finished && $SECONDS -lt $until ]]; do sleep 5; done
  collect
  [[ -e $T/finished ]] && echo "JOB FINISHED rc=$(cat $T/finished)" || echo "JOB RUNNING"
}

case ${1:-} in
  stage1)
    mkdir -p $T
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$2"/*.whl
    cp "$2"/gguf.part1 "$2"/sharegpt_first_turns.jsonl $T/ && ls -la $T && python3 -c "import gguf, specserve.llm"
    ;;
  launch)
    cat $T/gguf.part1 "$2"/gguf.part2 > $T/smollm2.gguf && sha256sum $T/smollm2.gguf
    mkdir -p $T/src && cp -r specserve benchmarks $T/src/
    setsid nohup bash -c "bash $T/src/benchmarks/train_smollm2_h200.sh job > $T/job.log 2>&1; echo \$? > $T/finished" > /dev/null 2>&1 < /dev/null &
    wait_job 530
    ;;
  job) job ;;
  wait) wait_job "${2:-540}" ;;
  *) echo "usage: $0 stage1 DIR | launch DIR | wait [SECONDS]"; exit 2 ;;
esac
