"""MoE layers of a shipped config (Qwen3-30B-A3B by default) on one GPU, random bf16 weights: the routed experts'
forms from 1 to 512 tokens a call. `grouped`: the routing kernel, the grouped GEMMs over pairs laid out by
expert and the weighted sum (kernels/triton/fused_moe.py); `pairs` (at most 16 tokens): the per-pair GEMVs with
the routing and the sum inside them (kernels/triton/moe_decode.py); `pytorch`: the eager form, without the
routing.

Each row reports the distinct experts the call touched and the bytes their weights hold, the time per layer,
and the bandwidth that time gives against those bytes: the distance to what reading the touched experts allows.
A call runs `--layers` layers, each with its own weights, so a layer's experts are not still in L2 from the call
before. The Triton forms are timed over CUDA-graph replays (no launch overhead, but each launch's own start and
drain); the PyTorch form reads its row counts back to the host, so it cannot be captured and its time includes
that sync and its launches. Routing is random (softmax of random logits), which spreads tokens over more experts
than a trained router does; the row counts the experts touched, so the figure can be read either way.
`--sweep-tiles` also times each pair GEMV alone over a set of tiles at 1 and 4 tokens.

    python benchmarks/fused_moe.py --sweep-tiles --out benchmarks/results/fused_moe_qwen3_30b_a3b_h200.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from specserve import envs
from specserve.bench.decode import hardware_info
from specserve.config import ModelConfig
from specserve.engine.factory import shipped_config
from specserve.kernels.moe import eager_fused_experts, softmax_routed_experts
from specserve.layers.moe import softmax_topk

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PAIR_TOKENS = 16  # the most tokens the pair GEMVs are timed at
SWEEP_TOKENS = 4
SWEEP_TILES = [(n, k, w) for n, k, w in itertools.product((8, 16, 32), (128, 256, 512), (4, 8)) if n * k <= 8192]


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


def grouped(x, logits, layers, moe):
    """A call of every layer's routed experts in turn, the grouped GEMMs at every size."""
    def call():
        with envs.override(moe_pair_gemv=False):
            for w13, w2 in layers:
                softmax_routed_experts(x, logits, w13, w2, moe.top_k, moe.norm_topk_prob)
    return call


def pairs(x, logits, layers, moe):
    """The same through the pair GEMVs, at any size (the layers take them up to kernels/moe.PAIR_GEMV_TOKENS)."""
    from specserve.kernels.triton import moe_decode

    def call():
        for w13, w2 in layers:
            act, ids, weights = moe_decode.gate_up(x, w13, moe.top_k, router_logits=logits,
                                                   renormalize=moe.norm_topk_prob)
            moe_decode.down_sum(act, w2, ids, weights, x.dtype)
    return call


def measure(cfg: ModelConfig, tokens: int, layers: list, replays: int) -> dict:
    moe = cfg.moe
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=layers[0][0].dtype)
    logits = torch.randn(tokens, moe.num_experts, device="cuda") * 2
    weights, ids = softmax_topk(logits, moe.top_k, moe.norm_topk_prob)
    touched = int(ids.unique().numel())
    expert_bytes = (layers[0][0][0].numel() + layers[0][1][0].numel()) * layers[0][0].element_size()
    row = {"tokens": tokens, "experts_touched": touched, "touched_bytes": touched * expert_bytes}
    forms = {"grouped": (grouped(x, logits, layers, moe), True)}
    if tokens <= PAIR_TOKENS:
        forms["pairs"] = (pairs(x, logits, layers, moe), True)
    forms["pytorch"] = (lambda: [eager_fused_experts(x, w13, w2, weights, ids) for w13, w2 in layers], False)
    for name, (call, graph) in forms.items():
        us = device_us(call, replays, graph) / len(layers)
        row[f"{name}_us"] = round(us, 2)
        row[f"{name}_gb_per_s"] = round(row["touched_bytes"] / us / 1e3, 1)
    return row


def sweep_tiles(cfg: ModelConfig, tokens: int, layers: list, replays: int) -> dict:
    """Each pair GEMV alone, per tile: microseconds per layer."""
    from specserve.kernels.triton import moe_decode

    moe = cfg.moe
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=layers[0][0].dtype)
    logits = torch.randn(tokens, moe.num_experts, device="cuda") * 2
    act, ids, weights = moe_decode.gate_up(x, layers[0][0], moe.top_k, router_logits=logits,
                                           renormalize=moe.norm_topk_prob)
    result = {"tokens": tokens, "gate_up_us": {}, "down_sum_us": {}}
    for tile in map(lambda t: moe_decode.GemvTile(*t), SWEEP_TILES):
        def gate_up():
            for w13, _ in layers:
                moe_decode.gate_up(x, w13, moe.top_k, router_logits=logits, renormalize=moe.norm_topk_prob,
                                   tile=tile)

        def down_sum():
            for _, w2 in layers:
                moe_decode.down_sum(act, w2, ids, weights, x.dtype, tile=tile)
        key = ",".join(map(str, tile))
        result["gate_up_us"][key] = round(device_us(gate_up, replays, True) / len(layers), 2)
        result["down_sum_us"][key] = round(device_us(down_sum, replays, True) / len(layers), 2)
    for part in ("gate_up", "down_sum"):
        times = result[f"{part}_us"]
        result[f"best_{part}"] = min(times, key=times.get)
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_us")}), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-30b-a3b", help="a shipped config with MoE layers")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--layers", type=int, default=4, help="layers a call runs, each with its own weights")
    parser.add_argument("--sweep-tiles", action="store_true", help="time the pair GEMVs over a set of tiles")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cfg = ModelConfig.from_hf_config(json.loads(shipped_config(args.model).read_text()))
    torch.manual_seed(0)
    layers = [layer_weights(cfg, torch.bfloat16) for _ in range(args.layers)]
    rows, sweeps = [], []
    with torch.inference_mode():
        if args.sweep_tiles:
            sweeps = [sweep_tiles(cfg, tokens, layers, args.replays) for tokens in (1, SWEEP_TOKENS)]
        for tokens in map(int, args.tokens.split(",")):
            rows.append(measure(cfg, tokens, layers, args.replays))
            print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "fused_moe", "model": args.model, "dtype": "bfloat16", "routing": "random (uniform)",
              "layers_per_call": args.layers, "hardware": hardware_info(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows, "tile_sweeps": sweeps}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
