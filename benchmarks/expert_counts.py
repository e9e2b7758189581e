"""Distinct experts a MoE layer touches per step, plain and speculative (`--count-experts` of `specserve bench
decode` and `bench spec`), collected into one results file.

On the CPU (the default) it writes a tiny random Qwen3-MoE with the 30B-A3B's routing shape (128 experts, 8 per
token; 4 layers, hidden 128) and runs both benches on it: plain decode at batch 1, 8 and 32, and at batch 1
plain, an EAGLE-3 chain of 3 and a tree (top-4, 5 steps, 16 tokens), with a random head and with a copy of the
target as draft model. Random weights route tokens almost uniformly across requests; a trained router touches
fewer experts. With `--gpu` it runs the same benches on one GPU for the shipped Qwen3-30B-A3B shape (random bf16
weights), batch 1, 16 and 64.

    python benchmarks/expert_counts.py --out benchmarks/results/expert_counts_tiny_moe_cpu.json
    python benchmarks/expert_counts.py --gpu --out benchmarks/results/expert_counts_qwen3_30b_a3b_h200.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TINY_MOE = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, num_experts=128,
                num_experts_per_tok=8, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[], tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
GPU_MODEL = ["--model-path", "qwen3-30b-a3b", "--load-format", "dummy", "--dtype", "bfloat16", "--device", "cuda"]


def write_tiny_moe(path: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", **TINY_MOE)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def bench(args: list[str], out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "specserve.cli", "bench", *args, "--count-experts", "--out", str(out)],
                   check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the Qwen3-30B-A3B shape on one GPU")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp())
    if args.gpu:
        model, batches, lengths = GPU_MODEL, ["1", "16", "64"], ["--prompt-len", "512", "--output-len", "128"]
        head = []
    else:
        write_tiny_moe(scratch / "tiny-moe")
        model = ["--model-path", str(scratch / "tiny-moe"), "--device", "cpu"]
        batches, lengths = ["1", "8", "32"], ["--prompt-len", "64", "--output-len", "32"]
        head = ["--draft-vocab-size", "2048"]  # the random head's vocabulary: the tiny target's whole one
    decode = bench(["decode", *model, "--no-hf", "--batch-sizes", *batches, *lengths, "--repeats", "1"],
                   scratch / "decode.json")
    spec = bench(["spec", *model, "--num-steps", "3", *lengths, "--repeats", "1", *head], scratch / "spec.json")
    result = {
        "benchmark": "expert_counts",
        "model": "qwen3-30b-a3b (random bf16)" if args.gpu else {"qwen3_moe, random fp32": TINY_MOE},
        "note": "mean distinct experts per MoE layer per step, by kind of step; random weights route near-uniformly "
                "across requests, a trained router touches fewer experts",
        "hardware": decode["hardware"],
        "decode": {r["batch_size"]: r["experts_touched"] for r in decode["results"]},
        "spec_batch_1": {r["config"]: {"experts_touched": r["experts_touched"], "decode_tok_s": r["decode_tok_s"],
                                       "mean_acceptance_length": r["mean_acceptance_length"]}
                         for r in spec["results"]},
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["decode"], indent=1), json.dumps(result["spec_batch_1"], indent=1))


if __name__ == "__main__":
    main()
