"""A verified tree's attention tails, a block per row or one block for the tree, A/B in one process: Llama-3.1-8B
shape, random bf16 weights, a random EAGLE-3 head of matching shape in fp8, batch 1, one GPU, the tree of the
issue (top-4, 5 levels, 16 verified tokens, simulated acceptance).

The 16 verified rows share one context, and each row's tail is its ancestors and itself. Shipped before, each
row's tail was one block of the attention kernel, dealt over the context slices; with SPECSERVE_CLOSED_TAILS the
tree's own slots are one block, each query row masked to those in its tail. For each form, alternately, the
verify and the whole step are captured in CUDA graphs and replayed back to back from the same state (a context of
600 tokens), beside a plain decode step; the verify's logits are compared with the first form's (same math,
other rounding).

    python benchmarks/tree_verify_attention.py --out benchmarks/results/tree_verify_attention_h200.json
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from profile_gpu_step import critical_path, cuda_ms, kernel_groups
from spec_step_parts import BASE, graphed, place_at, plain_step
from specserve.bench.decode import hardware_info
from specserve.config import SpecConfig
from specserve.engine.factory import build_engine_core
from specserve.layers import triton_attention

TREE = SpecConfig("EAGLE3", None, 5, 4, 16, simulate_accept_len=4.0, draft_model_quantization="fp8")
FORMS = {"a block per row": False, "one block for the tree": True}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=600, help="tokens before the step's root")
    p.add_argument("--repeats", type=int, default=100, help="verify replays; the whole step replays a fifth as many")
    p.add_argument("--rounds", type=int, default=2, help="times each form is captured and timed, alternately")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    engine, _ = build_engine_core(replace(BASE, spec=TREE, cuda_graph_max_bs=1), progress=False)
    program = engine.runner.spec_graphs
    results, reference = [], None
    with torch.inference_mode():
        n = place_at(program, args.context)
        search, nodes = graphed(lambda: program._select(1, *program._search(1, n)))
        plain = plain_step(engine.runner, args.context, BASE.cache.page_size)
        draft_ms = cuda_ms(search, args.repeats)
        draft_path = critical_path(search)
        for round_ in range(args.rounds):
            for name, closed in FORMS.items():
                triton_attention.CLOSED_TAILS = closed
                verify, logits = graphed(lambda: program._verify_logits(1, n, nodes))
                whole, _ = graphed(lambda: program._step(1, n, program.forced[:1]))
                place_at(program, args.context)  # the step's replays move the root on: back to the same state
                search()
                verify_ms = cuda_ms(verify, args.repeats)
                if reference is None:
                    reference = logits.float().clone()
                row = {"form": name, "round": round_, "verify_ms": round(verify_ms, 4),
                       "whole_step_ms": round(cuda_ms(whole, max(1, args.repeats // 5)), 4),
                       "plain_step_ms": round(cuda_ms(plain, args.repeats), 4),
                       "max_logit_diff_vs_first": round((logits.float() - reference).abs().max().item(), 4),
                       "argmax_agreement_vs_first": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()}
                place_at(program, args.context)
                search()
                if round_ == 0:
                    row["verify_critical_path_groups"] = kernel_groups(critical_path(verify))
                results.append(row)
                print(row, flush=True)
                del verify, whole
    report = {"benchmark": "tree_verify_attention", "unit": "ms of device time per replay", "hardware": hardware_info(),
              "simulated": "acceptance of the whole step (tau 4)",
              "settings": {**vars(args), "model": "llama-3.1-8b dummy bf16, random EAGLE-3 head in fp8",
                           "tree": "top-4, 5 steps, 16 tokens", "batch_size": 1},
              "draft_ms": round(draft_ms, 4), "draft_critical_path": draft_path[:30],
              "draft_critical_path_groups": kernel_groups(draft_path), "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
