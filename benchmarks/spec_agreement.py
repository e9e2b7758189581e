"""How often greedy output with speculation equals greedy output without it, token for token, in a given dtype.

In fp32 the two are equal (tests assert it on the CPU and on a GPU, under CUDA graphs and overlap). In bf16
they need not be: verification runs the target over k + 1 tokens a sequence (a chain) or 1 + N (a tree) where
plain decode runs one, so the matmuls take other kernels or tiles, sum in another order and round differently.
Where two candidates' logits are within that rounding, the argmax flips and the sequence goes its own way from
there. This measures how often, on the embedded SmolLM2-135M with its bundled EAGLE-3 head (real acceptance):
MT-Bench first turns, greedy, `ignore_eos`, every request of a batch at once.

For each setup against no speculation: the share of sequences that match entirely, and the share of tokens
before each sequence's first mismatch. For scale, the same comparison for no speculation with the requests run
one at a time (batch shapes alone change the rounding too). Writes JSON.

    python benchmarks/spec_agreement.py --device cuda --dtype bfloat16 --out benchmarks/results/spec_agreement_bf16_h200.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


ALONE = "no speculation, one request at a time"


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(reference: list[list[int]], other: list[list[int]]) -> dict:
    prefixes = [matching_prefix(a, b) for a, b in zip(reference, other)]
    total = sum(len(a) for a in reference)
    return {"sequences_equal": sum(a == b for a, b in zip(reference, other)) / len(reference),
            "tokens_before_first_mismatch": sum(prefixes) / total,
            "first_mismatch_at": [p for p, a in zip(prefixes, reference) if p < len(a)]}


def main() -> None:
    from specserve import draft_heads
    from specserve.bench.datasets import mt_bench_first_turns
    from specserve.bench.decode import hardware_info
    from specserve.config import EngineConfig, SpecConfig
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", default=None, help="SmolLM2-135M-Instruct's GGUF (default: the embedded one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    head, steps = str(draft_heads.SMOLLM2_HEAD), draft_heads.SMOLLM2_DEFAULT_STEPS
    setups = {"no speculation": SpecConfig(),
              f"EAGLE-3 chain {steps}": SpecConfig("EAGLE3", head, steps),
              "EAGLE-3 tree 4/5/16": SpecConfig("EAGLE3", head, 5, 4, 16)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outputs, acceptance, prompts = {}, {}, None
    for name, spec in setups.items():
        config = EngineConfig(model_path=args.model_path, device=args.device, dtype=args.dtype, spec=spec)
        llm = LLM(config=config, progress=False)
        if prompts is None:
            prompts = [llm.chat_prompt(p.messages) for p in mt_bench_first_turns()[: args.prompts]]
        results = llm.generate(prompts, params)
        outputs[name] = [r.token_ids for r in results]
        if not spec.algorithm:
            outputs[ALONE] = [llm.generate([p], params)[0].token_ids for p in prompts]
        spec_steps = sum(r.num_spec_steps for r in results)
        acceptance[name] = 1 + sum(r.num_accepted_tokens for r in results) / spec_steps if spec_steps else None
        del llm
    reference = outputs["no speculation"]
    rows = [{"setup": name, "mean_acceptance_length": acceptance.get(name), **compare(reference, outputs[name])}
            for name in outputs if name != "no speculation"]
    for row in rows:
        print(json.dumps(row), flush=True)
    record = {"benchmark": "spec_agreement", "dtype": args.dtype, "device": args.device,
              "model": "SmolLM2-135M-Instruct (embedded GGUF) with its bundled EAGLE-3 head",
              "prompts": f"MT-Bench first turns, the first {args.prompts}, all in one batch",
              "max_tokens": args.max_tokens, "hardware": hardware_info(), "results": rows}
    Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
