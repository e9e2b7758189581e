#!/usr/bin/env bash
# One H200: GPU correctness tests, then plain decode of a Llama-3.1-8B-shaped model (random bf16 weights)
# with CUDA graphs, against Hugging Face generate on the same GPU, and eager specserve for reference.
# Then an offline serving sweep (random 512-token prompts, 256 output tokens, ignore_eos) at C = 1..250.
# Then the cost of speculation switched off (benchmarks/spec_off_tax.py), a kernel-level profile of decode
# and prefill steps (benchmarks/profile_gpu_step.py), and the GPU's idle time at C = 250 (benchmarks/gpu_idle.py).
# specsweep: the offline sweep again with an EAGLE-3 chain (3 drafts, simulated tau 3) and a tree (top-4, 5 levels,
# 16 verified tokens, simulated tau 4), random head of the target's shape.
# smol: decode at batch 1 and 64 with SmolLM2-135M's shape; gemv_ab: 8B decode with the Triton GEMV off and on.
# timeline: the device's time over whole offline waves at C = 250, step by step (benchmarks/wave_timeline.py).
# agreement: bf16 greedy output with and without speculation, token for token (benchmarks/spec_agreement.py).
# fp8head: the draft head in fp8, its GPU tests and batch-1 chain and tree steps against the bf16 head, and the A/B
# of how its GEMVs widen fp8 weights (SPECSERVE_GEMV_FP8_BITS).
# treeforms: the tree step's attention tails as one block and its bookkeeping in Triton: their GPU tests, the A/B of
# the step's parts (benchmarks/tree_step_forms.py), and batch-1 decode over 256 tokens with them on.
# pending (only when named): the GPU tests and timings of what was written but has not run on a GPU yet.
# candidates: A/B of SPECSERVE_NORM_IN_WEIGHTS (on by default), serving with a fresh descent's GEMV decisions
# (SPECSERVE_GEMV_CHOICES; the H200's shipped ones by default), SPECSERVE_FUSED_TOPK (on by default) and
# SPECSERVE_GEMV_TRIGGER_AT (default 1).
# adaptsweep: the chain and tree sweeps with the adaptive draft plan on (--speculative-adaptive); chainadapt or
# treeadapt: one of them.
# Usage: OUT=dir bash benchmarks/gpu_h200.sh [tests] [decode] [sweep] [specsweep | chainsweep | treesweep] [adaptsweep | chainadapt | treeadapt]
#        [tax] [fp8head] [treeforms] [profile] [smol] [gemv_ab] [candidates] [agreement] [idle] [timeline] [pending]
#        (none: all)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# CPU reference runs in the GPU tests take the PyTorch paths: building the CPU kernels would cost GPU time,
# and CI tests those kernels.
export SPECSERVE_CPU_KERNELS=${SPECSERVE_CPU_KERNELS:-0}
modes=" ${*:-all} "
want() { [[ $modes == *" $1 "* || $modes == " all " ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu_info.txt"
if want tests; then
  python3 -m pytest tests/test_gpu.py tests/test_triton_host.py -q -x -p no:cacheprovider 2>&1 | grep --line-buffered -v DEBUG | tee "$OUT/gpu_tests.log"
fi
if want decode; then
  common=(--device cuda --model-path llama-3.1-8b --load-format dummy --dtype bfloat16 --context-length 2048
          --prompt-len 512 --output-len 128 --repeats 2 --chunked-prefill-size 32768)
  python3 -m specserve.cli bench decode "${common[@]}" --batch-sizes 1 8 32 64 --out "$OUT/decode_gpu_8b.json"
  python3 -m specserve.cli bench decode "${common[@]}" --batch-sizes 1 8 --no-hf --disable-cuda-graph \
    --out "$OUT/decode_gpu_8b_eager.json"
fi
# The offline waves: random 512-token prompts, 256 output tokens, 8B shape with random bf16 weights.
waves=(--device cuda --model-path llama-3.1-8b --load-format dummy --dtype bfloat16 --context-length 2048
       --chunked-prefill-size 16384 --offline --dataset random --random-input-len 512 --max-tokens 256
       --ignore-eos --quiet)
chain=(--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-simulate-accept-len 3.0)
tree=(--speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-eagle-topk 4
      --speculative-num-draft-tokens 16 --speculative-simulate-accept-len 4.0)
# sweep NAME FLAGS...: C = 1, 2, 5 (8 prompts each), then C = 10-250 in a second process, joined into
# $OUT/offline_8b_NAME.jsonl. SWEEP_LOW and SWEEP_HIGH replace the two lists (empty: that part is skipped).
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
  cat "$OUT/${name}"_c1.jsonl "$OUT/${name}"_c10.jsonl 2>/dev/null > "$OUT/offline_8b_${name}.jsonl"
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
# The same chain and tree sweeps with the adaptive draft plan (spec/plan.py) deciding per step and request.
if want adaptsweep || want chainadapt; then
  sweep chain_adaptive "${chain[@]}" --speculative-adaptive --label "EAGLE-3 chain 3 adaptive (simulated tau 3)"
fi
if want adaptsweep || want treeadapt; then
  sweep tree_adaptive "${tree[@]}" --speculative-adaptive --label "EAGLE-3 tree 4/5/16 adaptive (simulated tau 4)"
fi
if want tax; then
  python3 benchmarks/spec_off_tax.py --profile --host-profile --out "$OUT/spec_off_tax_h200.json"
fi
if want fp8head; then
  # The draft head's projections in fp8 (--speculative-draft-model-quantization fp8): its GPU tests; then batch-1
  # decode over 256 tokens, plain against the chain and tree with the head as loaded (bf16) and in fp8 (acceptance
  # simulated, so only the step's cost differs): first with the fp8 decisions timed at startup against the shipped
  # bf16 ones (saved: what gemv_decisions/NVIDIA_H200.json ships for fp8), then with the decisions as shipped;
  # then the A/B of how the GEMV widens fp8 weights (SPECSERVE_GEMV_FP8_BITS=0: Triton's conversion), its fp8
  # decisions timed at startup.
  python3 -m pytest tests/test_gpu.py -q -rA -p no:cacheprovider -k "fp8" 2>&1 | grep --line-buffered -v DEBUG \
    | tee "$OUT/gpu_tests_fp8_bits_h200.log"
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); d['decisions'] = [e for e in d['decisions']
    if e['dtype'] == 'bfloat16']; json.dump(d, open(sys.argv[2], 'w'))" \
    specserve/layers/gemv_decisions/NVIDIA_H200.json "$OUT/gemv_choices_bf16_only.json"
  both=("EAGLE-3 chain 3, simulated tau 3" "EAGLE-3 chain 3, fp8 head, simulated tau 3"
        "EAGLE-3 tree top-4, 5 steps, 16 tokens, simulated tau 4"
        "EAGLE-3 tree top-4, 5 steps, 16 tokens, fp8 head, simulated tau 4")
  SPECSERVE_GEMV_CHOICES="$OUT/gemv_choices_bf16_only.json" python3 benchmarks/spec_off_tax.py --batch-sizes 1 \
    --output-len 256 --setups plain "${both[@]}" --save-choices "$OUT/gemv_choices_fp8_bits_h200.json" \
    --out "$OUT/spec_bs1_256_fp8_bits_timing_h200.json"
  python3 benchmarks/spec_off_tax.py --batch-sizes 1 --output-len 256 --setups plain "${both[@]}" \
    --out "$OUT/spec_bs1_256_fp8_bits_h200.json"
  SPECSERVE_GEMV_CHOICES="$OUT/gemv_choices_bf16_only.json" SPECSERVE_GEMV_FP8_BITS=0 python3 \
    benchmarks/spec_off_tax.py --batch-sizes 1 --output-len 256 --setups plain \
    "EAGLE-3 chain 3, fp8 head, simulated tau 3" "EAGLE-3 tree top-4, 5 steps, 16 tokens, fp8 head, simulated tau 4" \
    --out "$OUT/spec_bs1_256_fp8_bits0_h200.json"
fi
if want treeforms; then
  python3 -m pytest tests/test_gpu.py -q -rA -p no:cacheprovider -k "one_block or fused_tree or tree_program or programs_sample_unseeded \
    or eagle3_programs_with_an_fp8_head or following_rows or adaptive_plan or speculation_with_graphs" 2>&1 \
    | grep --line-buffered -v DEBUG | tee "$OUT/gpu_tests_tree_forms.log"
  python3 benchmarks/tree_step_forms.py --out "$OUT/tree_step_forms_h200.json"
  python3 benchmarks/spec_off_tax.py --batch-sizes 1 --output-len 256 --setups plain \
    "EAGLE-3 tree top-4, 5 steps, 16 tokens, fp8 head, simulated tau 4" "EAGLE-3 chain 3, fp8 head, simulated tau 3" \
    "EAGLE-3 tree top-4, 5 steps, 16 tokens, simulated tau 4" --out "$OUT/spec_bs1_256_tree_forms_h200.json"
fi
if want profile; then
  python3 benchmarks/profile_gpu_step.py --out "$OUT/profile_gpu_step_h200.json" > "$OUT/profile.log" 2>&1
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
# The tree search's fused log_softmax + top-k (SPECSERVE_FUSED_TOPK, on by default), off and on: the tree's
# step parts.
fused_topk_ab() {
  for on in 0 1; do
    SPECSERVE_FUSED_TOPK=$on python3 benchmarks/spec_step_parts.py --setups tree --out "$OUT/spec_step_parts_fused_topk$on.json"
  done
}
if want candidates; then
  # The norm weights moved into the projections (SPECSERVE_NORM_IN_WEIGHTS), off and on: the verify step under
  # each GEMV choice, the batch-1 step parts, and batch-1 decode end to end (plain, chain, tree), every decision
  # timed in its own process (no shipped ones: they were made with the norm weights moved).
  # The default's descent (norm weights moved) also saves its 4-row decisions for SPECSERVE_GEMV_CHOICES below.
  for on in 0 1; do
    save=(); [[ $on == 1 ]] && save=(--save-choices "$OUT/gemv_choices_descent_h200.json")
    SPECSERVE_NORM_IN_WEIGHTS=$on python3 benchmarks/verify_gemv_choices.py --descend 3 "${save[@]}" \
      --out "$OUT/verify_gemv_norm_in_weights$on.json"
    SPECSERVE_GEMV_CHOICES=none SPECSERVE_NORM_IN_WEIGHTS=$on python3 benchmarks/spec_step_parts.py \
      --out "$OUT/spec_step_parts_norm_in_weights$on.json"
    SPECSERVE_GEMV_CHOICES=none SPECSERVE_NORM_IN_WEIGHTS=$on python3 benchmarks/spec_off_tax.py --batch-sizes 1 \
      --setups plain "EAGLE-3 chain 3, simulated tau 3" "EAGLE-3 tree top-4, 5 steps, 16 tokens, simulated tau 4" \
      --out "$OUT/spec_norm_in_weights$on.json"
  done
  # The 4-row GEMV decisions the descent chose, given to serving (SPECSERVE_GEMV_CHOICES): step parts and batch 1.
  SPECSERVE_GEMV_CHOICES="$OUT/gemv_choices_descent_h200.json" python3 benchmarks/spec_step_parts.py \
    --out "$OUT/spec_step_parts_descent_choices_h200.json"
  SPECSERVE_GEMV_CHOICES="$OUT/gemv_choices_descent_h200.json" python3 benchmarks/spec_off_tax.py --batch-sizes 1 \
    --setups plain "EAGLE-3 chain 3, simulated tau 3" --out "$OUT/spec_descent_choices_h200.json"
  fused_topk_ab
  # Where several-row GEMVs let the next kernel launch (SPECSERVE_GEMV_TRIGGER_AT): the batch-1 step parts.
  for at in 1.0 0.9 0.75; do
    SPECSERVE_GEMV_TRIGGER_AT=$at python3 benchmarks/spec_step_parts.py --out "$OUT/spec_step_parts_trigger_at$at.json"
  done
fi
if [[ $modes == *" pending "* ]]; then  # not part of "all": what was changed but has not run on a GPU since
  # The tree program's tests after its search's two forms came to share one head pass per level (host-side only;
  # they have since passed on an H200: gpu_tests_pending_tree_program_h200.log, and the whole GPU suite with the
  # chooser's norm-apart form: gpu_tests_norm_apart_all_h200.log).
  python3 -m pytest tests/test_gpu.py -q -rA -p no:cacheprovider -k "fused_tree or tree_program or one_block" 2>&1 \
    | grep --line-buffered -v DEBUG | tee "$OUT/gpu_tests_pending.log"
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
if want idle; then
  python3 benchmarks/gpu_idle.py --out "$OUT/gpu_idle_h200.json"
fi
if want timeline; then
  python3 benchmarks/wave_timeline.py --page-layouts --out "$OUT/wave_timeline_c250_h200.json"
fi
