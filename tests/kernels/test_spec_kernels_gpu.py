"""The kernels of the speculative step programs on a GPU against their PyTorch forms: the tree search's
bookkeeping and top-k, the chain's acceptance and row inputs, and the argmax."""
from __future__ import annotations

import pytest
import torch

from kernel_checks import (check_accept_and_pack, check_argmax, check_chain_rows, check_tree_accept, check_tree_expand,
                           check_tree_move, check_tree_root_children, check_tree_select, check_tree_step_rows)

pytestmark = pytest.mark.gpu


def test_fused_tree_search_kernels_match_the_pytorch_forms():
    """A search level's bookkeeping (the first level's too), the tree's selection, a greedy step's acceptance, the
    step's row inputs and the accepted nodes' move (kernels/triton/tree.py) against the PyTorch forms."""
    check_tree_select("cuda")
    check_tree_accept("cuda")
    check_tree_step_rows("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        check_tree_expand("cuda", dtype)
        check_tree_root_children("cuda", dtype)
        check_tree_move("cuda", dtype)


@pytest.mark.parametrize("rows, vocab, k", [(4, 32000, 4), (1, 32000, 1), (12, 1000, 4), (3, 128256, 8), (2, 70, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_log_softmax_topk_matches_the_pytorch_form(rows, vocab, k, dtype):
    """The tree search's top-k kernels against log_softmax + topk: the same log-probabilities, and the same
    tokens in (value descending, token id ascending) order, ties at the top included; replayed in a graph."""
    from specserve.kernels.triton.topk import fused_log_softmax_topk

    gen = torch.Generator(device="cuda").manual_seed(rows * vocab + k)
    logits = (torch.randn(rows, vocab + 3, device="cuda", generator=gen) * 4).to(dtype)[:, :vocab]  # row stride
    logits[0, [5, vocab // 2, vocab - 1]] = logits[0].max() + 1  # a three-way tie for the best token
    if vocab > 4096:
        logits[-1, :2048] = float("-inf")  # a masked block of the vocabulary holds no mass
    values, indices = fused_log_softmax_topk(logits, k)
    ranked = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(indices, ranked)
    log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    torch.testing.assert_close(values, log_probs.gather(1, ranked), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values, log_probs.topk(k, dim=-1).values, atol=1e-5, rtol=1e-5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = fused_log_softmax_topk(logits, k)
    logits.copy_(logits.flip(-1))
    graph.replay()
    assert torch.equal(graphed[1], torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k])


def test_chain_acceptance_kernel_packs_like_accept_chain():
    check_accept_and_pack("cuda")


def test_chain_row_inputs_kernel_matches_pytorch():
    check_chain_rows("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_kernels_pick_like_torch_and_replay_in_a_graph(dtype):
    """The greedy-token kernels against torch.argmax (ties, NaN, -inf rows, strides, leading dimensions), then
    captured in a CUDA graph and replayed on new logits."""
    from specserve.kernels.triton.argmax import argmax

    check_argmax("cuda", dtype)
    logits = torch.randn(3, 128256, device="cuda").to(dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = argmax(logits)
    logits.copy_(logits.flip(-1))
    graph.replay()
    assert torch.equal(graphed, logits.argmax(dim=-1))
    if dtype == torch.bfloat16:  # after a kernel launched early (PDL), as after the lm_head's GEMV in a step
        from specserve.kernels.triton import gemv as triton_gemv
        from specserve.kernels.tuning.chooser import ROWS_TILES

        weight = torch.randn(32000, 4096, device="cuda", dtype=dtype)
        x = torch.randn(4, 4096, device="cuda", dtype=dtype)
        tile = ROWS_TILES[5]
        argmax(triton_gemv.gemv(x, weight, tile))  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = triton_gemv.gemv(x, weight, tile)
            graphed = argmax(logits)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            assert torch.equal(graphed, logits.argmax(dim=-1))
