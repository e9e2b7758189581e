#!/usr/bin/env bash
# Trains the default model's EAGLE-3 head on one H200 and evaluates it on MT-Bench.
# Docs figures it reproduces: the bundled head's training (data, time, loss) and its acceptance length and speed
# on MT-Bench (train_report.json, eval_mtbench_h200.json).
#
# A call to the machine takes at most 64 MiB with the source tree, so the 94 MiB GGUF arrives in four parts
# and the job runs detached while later calls wait on it:
#   stage DIR    keep DIR's files under /tmp/smol: a GGUF part, and with the first, the prompts and wheels
#   launch DIR   stage DIR, join the GGUF, start the job in its own session, then wait like `wait`
#   wait [S]     up to S seconds (~9 minutes); prints the log's tail and copies what is finished to $OUT
#   wait-head [S] the same, but returns as soon as the head is saved (to evaluate it elsewhere)
# The prompts file is every distinct human turn of ShareGPT in file order (gzipped), so `--data` with it
# picks what `--data sharegpt-turns` does; MT-Bench's question.jsonl travels beside it (the machine lacks both
# dataset packages), and eval-draft asks both turns of each question from it.
set -uo pipefail
cd "$(dirname "$0")/.."
T=/tmp/smol
# The detached job runs from its own copy of the code, which later calls' file transfers leave alone.
export PYTHONPATH=/tmp/site:$T/src PYTHONUNBUFFERED=1 SPECSERVE_CPU_KERNELS=0

job() {
  local model=$T/smollm2.gguf out
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  df -h /tmp /dev/shm
  # Every ShareGPT human turn (54k; ~51k fit prompt + 256 <= 640 tokens) makes ~57 GB of taps: where the
  # disk has no room for them, they go to shared memory. Four engines generate side by side (one is bound by
  # its own CPU work at this model size).
  # A relaunch resumes where the data already is.
  out=$T/head
  if [[ -d /dev/shm/head/data ]] || { [[ ! -d $T/head/data ]] && (( $(df --output=avail -B1G /tmp | tail -1) < 75 )); }
  then out=/dev/shm/head; fi
  # Neither may have room (a smaller machine): stop here rather than fail an hour in, mid-generation.
  if [[ ! -d $out/data ]] && (( $(df --output=avail -B1G "$(dirname $out)" | tail -1) < ${NEED_GB:-65} )); then
    echo "no room for the taps: $(dirname $out) has under ${NEED_GB:-65} GB free" >&2; return 1
  fi
  ln -sfn $out $T/head_dir
  python3 -m specserve.cli train-draft --target "$model" --device cuda --dtype bfloat16 \
    --data $T/sharegpt_turns.jsonl --num-prompts ${NUM_PROMPTS:-54109} --max-tokens 256 --max-len 640 --dp-size 4 \
    --max-total-tokens 1000000 --max-running-requests 1024 --chunked-prefill-size 16384 --gen-batch 256 \
    --draft-vocab-size 14336 --batch-size ${BATCH_SIZE:-32} --lr ${LR:-4e-4} --warmup-steps 100 \
    --train-minutes ${TRAIN_MINUTES:-15} --checkpoint-every ${CHECKPOINT_EVERY:-2000} --eval-samples 512 --out $out || return 1
  touch $T/head_done
  python3 -m specserve.cli eval-draft --target "$model" --device cuda --dtype float32 --draft $out \
    --data $T/question.jsonl --concurrency 80 --max-tokens 256 --tree 4 8 16 --tree 4 5 16 \
    --out $T/eval_mtbench_h200.json
}

collect() {
  [[ -e $T/head_done ]] && cp $T/head_dir/*.safetensors $T/head_dir/*.json "$OUT"/ 2>/dev/null
  cp $T/eval_mtbench*_h200.json $T/head_dir/train_report.json "$OUT"/ 2>/dev/null
  tr '\r' '\n' < $T/job.log | grep -v -i warn > "$OUT/job.log"
  tail -25 "$OUT/job.log"
}

wait_job() {
  local until=$((SECONDS + ${1:-540})) stop_at=${2:-finished}
  while [[ ! -e $T/finished && ! -e $T/$stop_at && $SECONDS -lt $until ]]; do sleep 5; done
  collect
  [[ -e $T/finished ]] && echo "JOB FINISHED rc=$(cat $T/finished)" || echo "JOB RUNNING"
}

stage() {
  mkdir -p $T
  cp "$1"/gguf.part* $T/ || exit 1
  if ls "$1"/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$1"/*.whl
  fi
  if [[ -e $1/sharegpt_turns.jsonl.gz ]]; then gunzip -c "$1"/sharegpt_turns.jsonl.gz > $T/sharegpt_turns.jsonl; fi
  if [[ -e $1/question.jsonl ]]; then cp "$1"/question.jsonl $T/; fi
  ls -la $T
}

case ${1:-} in
  stage) stage "$2" ;;
  launch)
    stage "$2"
    cat $T/gguf.part? > $T/smollm2.gguf
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $T/smollm2.gguf" | sha256sum -c || exit 1
    mkdir -p $T/src && cp -r specserve benchmarks tests $T/src/
    setsid nohup bash -c "bash $T/src/benchmarks/train_smollm2_h200.sh job > $T/job.log 2>&1; echo \$? > $T/finished" > /dev/null 2>&1 < /dev/null &
    wait_job "${3:-420}"
    ;;
  job) job ;;
  wait) wait_job "${2:-540}" ;;
  wait-head) wait_job "${2:-540}" head_done ;;
  *) echo "usage: $0 stage DIR | launch DIR [SECONDS] | wait [SECONDS] | wait-head [SECONDS]"; exit 2 ;;
esac
