"""The Triton fused MoE on a GPU against its PyTorch form (kernels/moe.py), on a Qwen3-30B-A3B layer's shape,
and inside a CUDA graph (it reads no count back to the host)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _layer(experts=128, hidden=2048, inter=768, dtype=torch.bfloat16):
    torch.manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device="cuda") / inter**0.5).to(dtype)
    return w13, w2


def _routing(tokens, experts=128, k=8):
    from specserve.layers.moe import softmax_topk

    return softmax_topk(torch.randn(tokens, experts, device="cuda") * 2, k, renormalize=True)


@pytest.mark.parametrize("tokens", [1, 4, 16, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_matches_the_pytorch_form(tokens, dtype):
    from specserve.kernels.moe import eager_fused_experts, fused_experts

    w13, w2 = _layer(dtype=dtype)
    x = torch.randn(tokens, 2048, device="cuda", dtype=dtype)
    weights, ids = _routing(tokens)
    with torch.no_grad():
        out, ref = fused_experts(x, w13, w2, weights, ids), eager_fused_experts(x, w13, w2, weights, ids)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), ref.float(), atol=tolerance, rtol=tolerance)


def test_fused_moe_replays_in_a_cuda_graph_with_new_routing():
    from specserve.kernels.moe import eager_fused_experts, fused_experts

    w13, w2 = _layer()
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    weights, ids = _routing(8)
    with torch.no_grad():
        fused_experts(x, w13, w2, weights, ids)  # compile before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_experts(x, w13, w2, weights, ids)
        for seed in range(3):
            torch.manual_seed(seed)
            x.copy_(torch.randn_like(x))
            new_weights, new_ids = _routing(8)
            weights.copy_(new_weights)
            ids.copy_(new_ids)
            graph.replay()
            ref = eager_fused_experts(x, w13, w2, weights, ids)
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def assert_same_layout(slots, blocks, ref_slots, ref_blocks, ids, block_m):
    """The same blocks and pads, every pair once, each in a block of its expert. Which of an expert's pairs
    fill which of its blocks is the atomics' order, and changes no result."""
    pairs = ids.reshape(-1)
    real = slots != pairs.numel()
    assert torch.equal(blocks, ref_blocks) and torch.equal(real, ref_slots != pairs.numel())
    assert torch.equal(slots[real].sort().values, torch.arange(pairs.numel(), device=slots.device))
    assert torch.equal(pairs[slots[real]], blocks.repeat_interleave(block_m)[real])


@pytest.mark.parametrize("tokens,experts,k", [(1, 128, 8), (33, 128, 8), (200, 64, 4)])
def test_routing_kernels_match_their_pytorch_forms(tokens, experts, k):
    from specserve.kernels.moe import _weighted_sum
    from specserve.kernels.triton import fused_moe, moe_routing

    torch.manual_seed(tokens)
    logits = torch.randn(tokens, experts, device="cuda") * 2
    weights, ids = moe_routing.softmax_topk(logits, k, renormalize=True)
    probs = torch.softmax(logits, dim=-1)
    ref_weights, ref_ids = torch.topk(probs, k, dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights / ref_weights.sum(-1, keepdim=True))
    slots, blocks = moe_routing.align(ids, experts, 16)
    assert_same_layout(slots, blocks, *fused_moe.align(ids, experts, 16), ids, 16)
    pair_out = torch.randn(tokens * k, 2048, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(moe_routing.weighted_sum(pair_out, weights, torch.bfloat16),
                               _weighted_sum(pair_out, weights, torch.bfloat16), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("experts,k,inter", [(128, 8, 768), (64, 6, 1408)])  # Qwen3-30B-A3B's, Moonlight's
def test_softmax_routed_experts_match_routing_then_the_pytorch_form(tokens, experts, k, inter):
    # At decode sizes the routing (and the block's norm) runs inside the first expert GEMV and the residual add
    # in the sum.
    from specserve.kernels.moe import PAIR_GEMV_TOKENS, eager_fused_experts, softmax_routed_experts
    from specserve.kernels.pointwise import eager_rms_norm
    from specserve.layers.moe import softmax_topk

    assert tokens <= PAIR_GEMV_TOKENS
    w13, w2 = _layer(experts=experts, inter=inter)
    x, add = (torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16) * 2
    gamma = torch.rand(2048, device="cuda", dtype=torch.bfloat16) + 0.5
    with torch.no_grad():
        out, ids = softmax_routed_experts(x, logits, w13, w2, k, renormalize=True, add=add)
        weights, ref_ids = softmax_topk(logits, k, renormalize=True)
        ref = eager_fused_experts(x, w13, w2, weights, ref_ids) + add
        normed_out, _ = softmax_routed_experts(x, logits, w13, w2, k, renormalize=True, norm=(gamma, 1e-6))
        normed_ref = eager_fused_experts(eager_rms_norm(x, gamma, 1e-6), w13, w2, weights, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(normed_out.float(), normed_ref.float(), atol=3e-2, rtol=2e-2)


def test_softmax_routed_experts_replay_in_a_cuda_graph_with_new_logits():
    from specserve.kernels.moe import eager_fused_experts, softmax_routed_experts
    from specserve.layers.moe import softmax_topk

    w13, w2 = _layer()
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(1, 128, device="cuda") * 2
    with torch.no_grad():
        softmax_routed_experts(x, logits, w13, w2, 8, renormalize=True)  # compile before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, ids = softmax_routed_experts(x, logits, w13, w2, 8, renormalize=True)
        for seed in range(3):
            torch.manual_seed(seed)
            x.copy_(torch.randn_like(x))
            logits.copy_(torch.randn_like(logits) * 2)
            graph.replay()
            weights, ref_ids = softmax_topk(logits, 8, renormalize=True)
            assert torch.equal(ids, ref_ids)
            ref = eager_fused_experts(x, w13, w2, weights, ref_ids)
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("experts,n_group,topk_group,k", [(256, 8, 4, 8), (64, 1, 1, 6), (384, 1, 1, 8)])
def test_grouped_topk_kernel_matches_the_pytorch_form(experts, n_group, topk_group, k):
    # DeepSeek-V3's, Moonlight's and Kimi-K2's routing shapes.
    from specserve.kernels.moe import eager_grouped_topk, grouped_topk

    torch.manual_seed(experts)
    logits, bias = torch.randn(33, experts, device="cuda") * 2, torch.randn(experts, device="cuda") * 0.1
    with torch.no_grad():
        weights, ids = grouped_topk(logits, bias, k, n_group, topk_group, True, 2.5)
    ref_weights, ref_ids = eager_grouped_topk(logits, bias, k, n_group, topk_group, True, 2.5)
    order, ref_order = ids.sort(dim=1), ref_ids.sort(dim=1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices))
