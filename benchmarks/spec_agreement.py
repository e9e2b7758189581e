"""How often greedy output with speculation equals greedy output without it, token for token, in a given dtype.

In fp32 the two are equal (tests assert it on the CPU and on a GPU, under CUDA graphs and overlap). In bf16
they need not be: verification runs the target over k + 1 tokens a sequence (a chain) or 1 + N (a tree) where
plain decode runs one, so the matmuls take other kernels or tiles, sum in another order and round differently.
Where two candidates' logits are within that rounding, the argmax flips and the sequence goes its own way from
there. This measures how often: greedy, `ignore_eos`, every request of a batch at once.

- Default: the embedded SmolLM2-135M (or its GGUF at --model-path) with its bundled EAGLE-3 head, real
  acceptance, MT-Bench first turns in the chat template.
- `--model-path llama-3.1-8b --load-format dummy`: the 8B shape with random weights and a random head (drafts
  are almost never accepted, but every drafting step still verifies 1 + k or 1 + N rows), random prompts.

For each setup against no speculation: the share of sequences that match entirely, and the share of tokens
before each sequence's first mismatch. For scale, the same comparison for no speculation with the requests run
one at a time (batch shapes alone change the rounding too). Writes JSON.

Docs figure it reproduces: bf16 greedy agreement with and without speculation (SmolLM2 with its head on the
H200, and the 8B shape with random weights: `gpu_h200.sh agreement`).

    python benchmarks/spec_agreement.py --device cuda --dtype bfloat16 --out benchmarks/results/spec_agreement_bf16_h200.json
"""
from __future__ import annotations

import argparse
import gc
import json
import random
from pathlib import Path

import torch

ALONE = "no speculation, one request at a time"


def compare(reference: list[list[int]], other: list[list[int]]) -> dict:
    from specserve.bench.decode import matching_prefix, token_agreement

    prefixes = [matching_prefix(a, b) for a, b in zip(reference, other)]
    return {"sequences_equal": sum(a == b for a, b in zip(reference, other)) / len(reference),
            "tokens_before_first_mismatch": token_agreement(reference, other),
            "first_mismatch_at": [p for p, a in zip(prefixes, reference) if p < len(a)]}


def generate(engine, prompts: list[list[int]], params) -> tuple[list[list[int]], float | None]:
    """Every prompt's output tokens, all requests at once, and the mean acceptance length of drafting steps."""
    outputs = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    steps = accepted = 0
    while engine.has_work():
        for delta in engine.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
            if delta.step_accepted is not None:
                steps, accepted = steps + 1, accepted + delta.step_accepted
    return [outputs[str(i)] for i in range(len(prompts))], (1 + accepted / steps if steps else None)


def prompts_for(args, llm) -> list[list[int]]:
    if args.load_format == "dummy":  # random weights: any tokens will do
        rng = random.Random(0)
        return [[rng.randrange(1000, 30000) for _ in range(rng.randrange(64, 512))] for _ in range(args.prompts)]
    from specserve.bench.datasets import mt_bench_first_turns

    return [llm.chat_prompt(p.messages) for p in mt_bench_first_turns()[: args.prompts]]


def main() -> None:
    from specserve import SamplingParams, draft_heads
    from specserve.bench.decode import hardware_info
    from specserve.config import EngineConfig, SpecConfig
    from specserve import LLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", default=None,
                        help="SmolLM2-135M-Instruct's GGUF (default: the embedded one), or a dummy shape's name")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights and a random head")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dummy = args.load_format == "dummy"
    head = None if dummy else str(draft_heads.SMOLLM2_HEAD)
    steps = 3 if dummy else draft_heads.SMOLLM2_DEFAULT_STEPS
    setups = {"no speculation": SpecConfig(),
              f"EAGLE-3 chain {steps}": SpecConfig("EAGLE3", head, steps),
              "EAGLE-3 tree 4/5/16": SpecConfig("EAGLE3", head, 5, 4, 16)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outputs, acceptance, prompts = {}, {}, None
    for name, spec in setups.items():
        config = EngineConfig(model_path=args.model_path, load_format=args.load_format, device=args.device,
                              dtype=args.dtype, spec=spec)
        llm = LLM(config=config, progress=False)
        prompts = prompts or prompts_for(args, llm)
        outputs[name], acceptance[name] = generate(llm.engine, prompts, params)
        if not spec.algorithm:
            outputs[ALONE] = [generate(llm.engine, [p], params)[0][0] for p in prompts]
        del llm
        gc.unfreeze()  # the engine's startup objects were kept out of the collector's view
        gc.collect()  # the next engine sizes its KV pool from the memory left
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    reference = outputs["no speculation"]
    rows = [{"setup": name, "mean_acceptance_length": acceptance.get(name), **compare(reference, outputs[name])}
            for name in outputs if name != "no speculation"]
    for row in rows:
        print(json.dumps(row), flush=True)
    model = ("Llama-3.1-8B shape, random weights, random EAGLE-3 head" if dummy else
             "SmolLM2-135M-Instruct (GGUF) with its bundled EAGLE-3 head")
    prompt_text = "random token ids" if dummy else "MT-Bench first turns"
    record = {"benchmark": "spec_agreement", "dtype": args.dtype, "device": args.device, "model": model,
              "prompts": f"{args.prompts} {prompt_text}, all in one batch", "max_tokens": args.max_tokens,
              "hardware": hardware_info(), "results": rows}
    Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
