"""Mixture-of-experts layers: one layer's routed experts with their weights stacked (`FusedExperts`), and the
routing functions that choose each token's experts and weights.

A MoE block is router -> routing function -> `FusedExperts` (plus, where an architecture has them, shared
experts added to the result); the blocks themselves are the model files' (models/qwen3_moe.py).

`ExpertCounts` (opt-in, for tests and benchmarks) counts the distinct experts each layer routes a forward's
rows to: the weights a fused MoE reads once per step.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from specserve.kernels import moe


class FusedExperts(nn.Module):
    """All routed experts of one layer, each a SiLU-gated MLP, stacked: `w13` [E, 2I, H] holds each expert's
    gate rows, then its up rows; `w2` [E, H, I] its down projection. Under tensor parallelism I is this rank's
    slice of every expert's intermediate rows and the output a partial sum (`tp_dims`: the dimension of each
    expert's checkpoint tensor that is sliced, for models/loader.py)."""

    tp_dims = {"w13": 0, "w2": 1}

    # One expert's projection in a checkpoint (`...experts.{e}.gate_proj.weight`) -> (stacked parameter, shard):
    # models/loader.py copies gate_proj into the first I rows of w13[e], up_proj into the last I, down_proj
    # into w2[e].
    CHECKPOINT_NAMES: dict[str, tuple[str, int | None]] = {
        "gate_proj": ("w13", 0),
        "up_proj": ("w13", 1),
        "down_proj": ("w2", None),
    }

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Only a layer built inside `ExpertCounts.building` counts the experts it touches.
        self.touched = _BUILDING[-1].layer(num_experts) if _BUILDING else None

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights [T, k] (fp32), topk_ids [T, k] (int64) -> [T, H]: per token, the sum over its
        k experts of weight * down(silu(gate(x)) * up(x)). Each touched expert runs once, over all its rows."""
        if self.touched is not None:
            self.touched.add(topk_ids)
        return moe.fused_experts(x, self.w13, self.w2, topk_weights, topk_ids)

    def folds_norm(self, x: torch.Tensor, add: torch.Tensor | None = None) -> bool:
        """Whether `softmax_routed` on x takes its norm inside the expert kernels (else it applies it first)."""
        return moe.pair_gemvs_take(x, self.w13, self.w2, add)

    def softmax_routed(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool,
                       add: torch.Tensor | None = None, norm=None) -> torch.Tensor:
        """`forward` of norm(x) (an RMSNorm, optional) with the experts and weights of `softmax_topk(router_logits,
        top_k, renormalize)`, plus `add` [T, H] where given; at decode sizes on a GPU the norm, the routing and
        the add fold into the expert kernels."""
        norm_args = None if norm is None else (norm.weight, norm.eps)
        out, ids = moe.softmax_routed_experts(x, router_logits, self.w13, self.w2, top_k, renormalize, add, norm_args)
        if self.touched is not None:
            self.touched.add(ids)
        return out


_BUILDING: list[ExpertCounts] = []  # the counts that FusedExperts built now report to (`ExpertCounts.building`)


class ExpertCounts:
    """The distinct experts MoE layers route each forward's rows to, per kind of step, summed on the device from
    the routing the layers compute anyway: no forward waits on the host, and `summary` reads them once.

    Layers built inside `building()` count (a model built there, CUDA graphs captured with it); others carry
    nothing. Each count goes to the kind `begin_step` set last, a device value, so a step replayed from a graph
    counts to its own kind. Rows that pad a batch to a captured size count too: the fused MoE reads their
    experts as well."""

    KINDS = ("other", "prompt", "decode", "drafting")  # "other": forwards outside steps (warm-up, capture)

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.kind = torch.zeros(1, dtype=torch.long, device=self.device)
        self.steps = dict.fromkeys(self.KINDS, 0)
        self.layers: list[LayerExpertCounts] = []

    @contextlib.contextmanager
    def building(self):
        _BUILDING.append(self)
        try:
            yield self
        finally:
            _BUILDING.pop()

    def layer(self, num_experts: int) -> LayerExpertCounts:
        counts = LayerExpertCounts(self.kind, num_experts, len(self.KINDS))
        self.layers.append(counts)
        return counts

    def begin_step(self, kind: str) -> None:
        """The forwards queued from now on count to `kind` ("prompt", "decode" or "drafting": StepBatch.kind)."""
        self.kind.fill_(self.KINDS.index(kind))
        self.steps[kind] += 1

    def reset(self) -> None:
        for counts in self.layers:
            counts.counts.zero_()
        self.steps = dict.fromkeys(self.KINDS, 0)
        self.kind.zero_()

    def summary(self, model: nn.Module) -> dict[str, dict]:
        """Per kind of step seen since the last reset, over `model`'s MoE layers (not a draft model's): steps,
        layer forwards, and the mean distinct experts per layer forward. Reads the device once."""
        layers = [m.touched.counts for m in model.modules() if isinstance(m, FusedExperts) and m.touched is not None]
        if not layers:
            return {}
        totals = torch.stack(layers).sum(dim=0).tolist()
        return {kind: {"steps": self.steps[kind], "layer_forwards": calls,
                       "mean_distinct_experts_per_layer": round(distinct / calls, 3)}
                for kind, (distinct, calls) in zip(self.KINDS, totals) if calls}


class LayerExpertCounts:
    """One layer's counts: `counts` [kinds, 2] holds, per kind of step, the distinct experts summed over the
    layer's forwards, and the forwards."""

    def __init__(self, kind: torch.Tensor, num_experts: int, num_kinds: int) -> None:
        self.kind, self.num_experts = kind, num_experts
        self.counts = torch.zeros(num_kinds, 2, dtype=torch.long, device=kind.device)
        self.one = torch.ones((), dtype=torch.long, device=kind.device)

    def add(self, topk_ids: torch.Tensor) -> None:
        touched = torch.zeros(self.num_experts, dtype=torch.long, device=topk_ids.device)
        touched.index_fill_(0, topk_ids.reshape(-1), 1)
        self.counts.index_add_(0, self.kind, torch.stack((touched.sum(), self.one)).unsqueeze(0))


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-MoE (and Mixtral) routing: softmax over all experts, the top_k largest, renormalised to sum to one
    where the config's `norm_topk_prob` says (kernels/moe.softmax_topk). Returns (weights [T, k] fp32, expert ids
    [T, k] int64)."""
    return moe.softmax_topk(router_logits, top_k, renormalize)
