"""Forms of the tree step, A/B in one process: Llama-3.1-8B shape, random bf16 weights, a random EAGLE-3 head of
matching shape in fp8, batch 1, one GPU, the tree of the issue (top-4, 5 levels, 16 verified tokens, simulated
acceptance).

- The verified tree's attention tails. The 16 verified rows share one context, and each row's tail is its ancestors
  and itself. Before, each row's tail was one block of the attention kernel, dealt over the context slices; with
  SPECSERVE_CLOSED_TAILS the tree's own slots are one block, each query row masked to those in its tail.
- The search's bookkeeping between the head's passes, the selection of the tree and a greedy step's acceptance: in
  PyTorch (~130 small kernels) or one Triton kernel a level, one for the selection and one for the acceptance
  (SPECSERVE_FUSED_SEARCH).

For each form, in turn and again, the drafting (head catch-up, search, selection), the verify and the whole step
are captured in CUDA graphs and replayed back to back from the same state (a context of 600 tokens, the step's
inputs and what the step writes to the padding slot restored), beside a plain decode step. Each form's verify
logits are compared with the first form's: the same tree, the same math (the attention's rounding may differ).
Correctness is the GPU tests' (each form's tree program against `transformers`).

    python benchmarks/tree_step_forms.py --out benchmarks/results/tree_step_forms_h200.json
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from profile_gpu_step import critical_path, cuda_ms, kernel_groups
from spec_step_parts import BASE, graphed, plain_step
from spec_step_parts import place_at as place_at_context
from specserve.bench.decode import hardware_info
from specserve.config import SpecConfig
from specserve.engine.factory import build_engine_core
from specserve.kernels.triton import attention as triton_attention

TREE = SpecConfig("EAGLE3", None, 5, 4, 16, simulate_accept_len=4.0, draft_model_quantization="fp8")
# name -> (tails as one block, fused search)
FORMS = {"before: tails a block per row, bookkeeping in PyTorch": (False, False),
         "tails as one block, bookkeeping in PyTorch": (True, False),
         "tails as one block, bookkeeping in Triton": (True, True)}


class StepState:
    """What a step's replays change that the next one reads: its inputs (rewritten for the step after them), and
    the padding slot, which the inputs left as allocated point at (the catch-up reads the head's taps there; the
    moves of nodes not accepted write it in no fixed order)."""

    def __init__(self, program) -> None:
        pad = program.pad_slot
        self.program, self.pad = program, pad
        self.saved = [program._flat.clone(), program.kv_cache[:, :, pad].clone(),
                      program.drafter.kv_cache[:, :, pad].clone(), program.drafter.taps[pad].clone()]

    def restore(self, context: int) -> int:
        program, pad = self.program, self.pad
        inputs, target_kv, head_kv, taps = self.saved
        program._flat.copy_(inputs)
        program.kv_cache[:, :, pad] = target_kv
        program.drafter.kv_cache[:, :, pad] = head_kv
        program.drafter.taps[pad] = taps
        return place_at_context(program, context)


def measure_form(engine, program, n: int, context: int, state: StepState, repeats: int, profile: bool
                 ) -> tuple[dict, torch.Tensor]:
    """Drafting, verify and whole-step device times of the program as it is set now, from one state; and the
    verify's logits from that state."""

    def place_at(program, context):
        return state.restore(context)
    place_at(program, context)
    rows = program._metas(1, n)
    search, nodes = graphed(lambda: program._select(1, *program._search(1, n, rows)))
    verify, logits = graphed(lambda: program._verify_logits(1, n, nodes, rows))
    whole, _ = graphed(lambda: program._step(1, n, program.forced[:1]))
    place_at(program, context)  # the step's replays move the root on: back to the same state
    program._metas(1, n)  # and the rows that follow from it
    search()
    row = {"draft_ms": cuda_ms(search, repeats), "verify_ms": cuda_ms(verify, repeats)}
    row["whole_step_ms"] = cuda_ms(whole, max(1, repeats // 5))
    row["plain_step_ms"] = cuda_ms(plain_step(engine.runner, context, BASE.cache.page_size), repeats)
    row = {name: round(value, 4) for name, value in row.items()}
    if profile:
        row["draft_critical_path_groups"] = kernel_groups(critical_path(search))
        row["verify_critical_path_groups"] = kernel_groups(critical_path(verify))
    place_at(program, context)
    search()
    verify()
    return row, logits.float().clone()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=600, help="tokens before the step's root")
    p.add_argument("--repeats", type=int, default=100, help="replays of each part; the whole step a fifth as many")
    p.add_argument("--rounds", type=int, default=2, help="times each form is captured and timed, in turn")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    engine, _ = build_engine_core(replace(BASE, spec=TREE, cuda_graph_max_bs=1), progress=False)
    program = engine.runner.spec_graphs
    if not program.fused:
        program._allocate_search(program.candidate_depth.numel())
    results, reference = [], None
    with torch.inference_mode():
        n = place_at_context(program, args.context)
        state = StepState(program)
        for round_ in range(args.rounds):
            for name, (closed, fused) in FORMS.items():
                triton_attention.CLOSED_TAILS, program.fused = closed, fused
                row, logits = measure_form(engine, program, n, args.context, state, args.repeats, round_ == 0)
                reference = logits if reference is None else reference
                row = {"form": name, "round": round_, **row,
                       "max_logit_diff_vs_first": round((logits - reference).abs().max().item(), 4),
                       "argmax_agreement_vs_first": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()}
                results.append(row)
                print(row, flush=True)
    report = {"benchmark": "tree_step_forms", "unit": "ms of device time per replay", "hardware": hardware_info(),
              "simulated": "acceptance of the whole step (tau 4)",
              "settings": {**vars(args), "model": "llama-3.1-8b dummy bf16, random EAGLE-3 head in fp8",
                           "tree": "top-4, 5 steps, 16 tokens", "batch_size": 1},
              "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
