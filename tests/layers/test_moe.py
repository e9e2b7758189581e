"""The MoE layer: stacked experts equal each expert run on its own, and Qwen-style routing picks and weighs as
transformers does."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.kernels.moe import eager_fused_experts, gathered_experts
from specserve.layers.moe import FusedExperts, softmax_topk


def per_expert_reference(x, w13, w2, topk_weights, topk_ids):
    """Token by token, expert by expert: the definition, in fp64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for weight, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += weight * (w2[e].double() @ (F.silu(gate) * up))
    return out


def _random_layer(num_experts=8, hidden=32, inter=24, seed=0):
    torch.manual_seed(seed)
    experts = FusedExperts(num_experts, hidden, inter)
    with torch.no_grad():
        experts.w13.normal_(0, 0.2)
        experts.w2.normal_(0, 0.2)
    return experts


@pytest.mark.parametrize("tokens,k", [(1, 2), (7, 2), (33, 4), (5, 8)])
def test_fused_experts_equal_each_expert_on_its_own(tokens, k):
    experts = _random_layer()
    x = torch.randn(tokens, 32)
    weights, ids = softmax_topk(torch.randn(tokens, 8) * 3, k, renormalize=True)
    expected = per_expert_reference(x, experts.w13, experts.w2, weights, ids)
    with torch.no_grad():
        torch.testing.assert_close(experts(x, weights, ids).double(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gathered_experts(x, experts.w13, experts.w2, weights, ids).double(), expected,
                                   atol=1e-5, rtol=1e-5)


def test_fused_experts_skip_untouched_experts_and_keep_dtype():
    experts = _random_layer().to(torch.bfloat16)
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    ids = torch.tensor([[3, 5]] * 6)  # two of eight experts touched
    weights = torch.full((6, 2), 0.5)
    with torch.no_grad():
        out = eager_fused_experts(x, experts.w13, experts.w2, weights, ids)
    assert out.dtype == torch.bfloat16
    expected = per_expert_reference(x.float(), experts.w13.float(), experts.w2.float(), weights, ids)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_softmax_topk_routes_as_transformers(norm_topk_prob):
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, num_experts=8, num_experts_per_tok=3,
                                  norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(config)
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        x = torch.randn(20, 32)
        _, hf_weights, hf_ids = router(x)
        weights, ids = softmax_topk(F.linear(x, router.weight), 3, norm_topk_prob)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
