"""One MoE layer of a shipped config (Qwen3-30B-A3B by default) on one GPU, random bf16 weights: the fused
Triton kernel against the PyTorch form, from 1 to 512 tokens a call.

Each row reports the distinct experts the call touched and the bytes their weights hold, the time per call, and
the bandwidth that time gives against those bytes: the distance to what reading the touched experts allows. The
kernel is timed over CUDA-graph replays (no launch overhead); the PyTorch form reads its row counts back to the
host, so it cannot be captured and its time includes that sync and its launches. Routing is random (softmax
of random logits), which spreads tokens over more experts than a trained router does; the row counts the experts
touched, so the figure can be read either way.

    python benchmarks/fused_moe.py --out benchmarks/results/fused_moe_qwen3_30b_a3b_h200.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from specserve.bench.decode import hardware_info
from specserve.config import ModelConfig
from specserve.engine.factory import shipped_config
from specserve.kernels.moe import eager_fused_experts, fused_experts
from specserve.layers.moe import softmax_topk

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def layer_weights(cfg: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    moe, hidden = cfg.moe, cfg.hidden_size
    w13 = torch.randn(moe.num_experts, 2 * moe.intermediate_size, hidden, device="cuda", dtype=dtype) * 0.02
    w2 = torch.randn(moe.num_experts, hidden, moe.intermediate_size, device="cuda", dtype=dtype) * 0.02
    return w13, w2


def device_us(call, replays: int, graph: bool) -> float:
    """Mean device microseconds per call, over CUDA-graph replays where `graph`, else over eager calls."""
    for _ in range(3):
        call()
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            call()
        call = captured.replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def measure(cfg: ModelConfig, tokens: int, w13: torch.Tensor, w2: torch.Tensor, replays: int) -> dict:
    moe = cfg.moe
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=w13.dtype)
    weights, ids = softmax_topk(torch.randn(tokens, moe.num_experts, device="cuda"), moe.top_k, moe.norm_topk_prob)
    touched = int(ids.unique().numel())
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    row = {"tokens": tokens, "experts_touched": touched, "touched_bytes": touched * expert_bytes}
    forms = {"triton": (lambda: fused_experts(x, w13, w2, weights, ids), True),
             "pytorch": (lambda: eager_fused_experts(x, w13, w2, weights, ids), False)}
    for name, (call, graph) in forms.items():
        us = device_us(call, replays, graph)
        row[f"{name}_us"] = round(us, 2)
        row[f"{name}_gb_per_s"] = round(row["touched_bytes"] / us / 1e3, 1)
    row["speedup"] = round(row["pytorch_us"] / row["triton_us"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-30b-a3b", help="a shipped config with MoE layers")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cfg = ModelConfig.from_hf_config(json.loads(shipped_config(args.model).read_text()))
    torch.manual_seed(0)
    w13, w2 = layer_weights(cfg, torch.bfloat16)
    rows = []
    with torch.inference_mode():
        for tokens in map(int, args.tokens.split(",")):
            rows.append(measure(cfg, tokens, w13, w2, args.replays))
            print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "fused_moe", "model": args.model, "dtype": "bfloat16", "routing": "random (uniform)",
              "hardware": hardware_info(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
