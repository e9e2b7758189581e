"""The Triton kernels against their PyTorch forms in Triton's CPU interpreter, and their host-side logic, where
Triton is installed (it comes with xgrammar on Linux x86-64, so CI has it)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specserve import envs

triton = pytest.importorskip("triton")
# The four slowest interpret whole tree programs or sweep many tile shapes, more than CI's time budget leaves
# room for: they run where asked. Every kernel they cover is also tested on the GPU.
slow_in_interpreter = pytest.mark.skipif(
    not envs.get().triton_interpreter_tests,
    reason="slow in Triton's interpreter: set SPECSERVE_TRITON_INTERPRETER_TESTS=1 to run it")


# What every interpreter script starts with: torch, and the helpers of tests/ importable.
_PRELUDE = """
import sys
import torch
sys.path[:0] = ["tests"]
"""


def _run_in_interpreter(script: str, timeout: int) -> None:
    """Runs `script` under Triton's interpreter, which runs kernels on the CPU; it must be switched on before they
    are defined, hence a process of its own (from the repository root, after _PRELUDE)."""
    run = subprocess.run([sys.executable, "-c", _PRELUDE + script], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr[-2000:]


def test_chooser_takes_the_norm_apart_where_it_beats_every_folded_tile():
    # None for a folded norm's call means: the norm as a kernel of its own, then the best form without it
    # (Linear._forward_gpu), so the chooser returns None where that was timed faster than every folded tile.
    from specserve.kernels.tuning.chooser import NORM_APART, Tile, pick

    tiles = {"a": Tile(32, 256, 4, 4), "b": Tile(64, 128, 4, 3)}
    assert pick({"cublas": 90.0, "a": 55.0, "b": 50.0, NORM_APART: 39.0}, tiles) is None
    assert pick({"cublas": 90.0, "a": 55.0, "b": 38.0, NORM_APART: 39.0}, tiles) == tiles["b"]
    assert pick({"cublas": 90.0, "a": 55.0, "b": 50.0}, tiles) == tiles["b"]  # no unfolded tile was timed
    assert pick({"cublas": 40.0, "a": 55.0, NORM_APART: 45.0}, tiles) is None
    assert pick({"cublas": 40.0, "a": 55.0}, tiles, cublas_margin=float("inf")) == tiles["a"]  # tiles everywhere


_TOPK_IN_INTERPRETER = """
from specserve.kernels.triton.topk import fused_log_softmax_topk
torch.manual_seed(0)
for rows, vocab, k in [(4, 5000, 4), (3, 2048, 2), (2, 70, 8), (2, 4100, 3)]:
    x = (torch.randn(rows, vocab) * 4).half()
    x[0, [5, vocab // 2, vocab - 1]] = x[0].max() + 1
    if vocab > 4096:
        x[1, :2048] = float("-inf")  # a whole block masked
    values, indices = fused_log_softmax_topk(x, k)
    ranked = torch.sort(x.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(indices, ranked), (indices, ranked)
    expected = torch.log_softmax(x.float(), dim=-1).gather(1, ranked)
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=1e-5)
"""


def test_fused_topk_in_the_interpreter_ranks_like_a_stable_sort():
    # Several blocks a row, a vocabulary that is not a multiple of the block, ties.
    _run_in_interpreter(_TOPK_IN_INTERPRETER, timeout=600)


_FUSED_MOE_IN_INTERPRETER = """
from specserve.kernels.moe import _weighted_sum, eager_fused_experts
from specserve.kernels.triton.fused_moe import align, expert_outputs
from specserve.layers.moe import softmax_topk
slot_pairs, block_expert = align(torch.tensor([[3, 1], [1, 0], [3, 1], [2, 3]]), 5, block_m=16)
assert block_expert.tolist() == [0, 1, 2, 3, -1, -1]  # expert 4 untouched; spare blocks for the worst routing
assert slot_pairs[16:19].tolist() == [1, 2, 5] and (slot_pairs[19:32] == 8).all()  # expert 1's pairs, in order
from specserve.kernels.triton import moe_routing
for shape, experts, block_m in (((4, 2), 5, 16), ((300, 8), 128, 16), ((3000, 2), 4, 64)):  # the last: PyTorch's
    ids = torch.randint(0, experts, shape)
    slots, blocks = moe_routing.align(ids, experts, block_m)
    ref_slots, ref_blocks = align(ids, experts, block_m)
    real = slots != ids.numel()  # the same blocks and pads; every pair once, in a block of its expert
    assert torch.equal(blocks, ref_blocks) and torch.equal(real, ref_slots != ids.numel())
    assert torch.equal(slots[real].sort().values, torch.arange(ids.numel()))
    assert torch.equal(ids.reshape(-1)[slots[real]], blocks.repeat_interleave(block_m)[real])
logits = torch.randn(37, 128) * 2
for k, width, renormalize in ((8, 128, True), (4, 60, False)):
    weights, ids = moe_routing.softmax_topk(logits[:, :width].contiguous(), k, renormalize)
    ref_weights, ref_ids = softmax_topk(logits[:, :width], k, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights)
pair_out, pair_weights = torch.randn(37 * 8, 96), torch.rand(37, 8)
torch.testing.assert_close(moe_routing.weighted_sum(pair_out, pair_weights, torch.float32),
                           _weighted_sum(pair_out, pair_weights, torch.float32))
torch.manual_seed(0)
for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
    # One token; widths that are not multiples of the tiles; an expert with more rows than a block holds, in
    # blocks of 16 and of 64 rows.
    for tokens, k, experts, hidden, inter in ((1, 2, 8, 96, 40), (7, 4, 8, 64, 64), (40, 2, 4, 96, 40),
                                              (300, 2, 4, 64, 40)):
        w13 = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter) / inter**0.5).to(dtype)
        x = torch.randn(tokens, hidden).to(dtype)
        weights, ids = softmax_topk(torch.randn(tokens, experts) * 2, k, renormalize=True)
        out = moe_routing.weighted_sum(expert_outputs(x, w13, w2, ids), weights, dtype)
        reference = eager_fused_experts(x, w13, w2, weights, ids)
        torch.testing.assert_close(out.float(), reference.float(), atol=tolerance, rtol=tolerance)
"""


def test_fused_moe_in_the_interpreter_matches_the_pytorch_form():
    _run_in_interpreter(_FUSED_MOE_IN_INTERPRETER, timeout=600)


_MOE_DECODE_IN_INTERPRETER = """
from specserve.kernels import pointwise
from specserve.kernels.moe import eager_fused_experts
from specserve.kernels.triton import moe_decode
from specserve.kernels.triton.moe_decode import GemvTile
from specserve.layers.moe import softmax_topk
torch.manual_seed(0)
for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
    # Widths that are not multiples of the tiles; k not a power of two; an expert two tokens share.
    for tokens, k, experts, hidden, inter in ((1, 8, 16, 96, 40), (3, 6, 12, 64, 48), (4, 2, 3, 80, 24)):
        w13 = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter) / inter**0.5).to(dtype)
        x, add = torch.randn(tokens, hidden).to(dtype), torch.randn(tokens, hidden).to(dtype)
        logits = torch.randn(tokens, experts) * 2
        tiles = (GemvTile(16, 32, 4), GemvTile(32, 16, 4))
        for renormalize in (True, False):
            weights, ids = softmax_topk(logits, k, renormalize)
            reference = eager_fused_experts(x, w13, w2, weights, ids)
            act, routed_ids, routed_weights = moe_decode.gate_up(x, w13, k, router_logits=logits,
                                                                  renormalize=renormalize, tile=tiles[0])
            assert torch.equal(routed_ids, ids)
            torch.testing.assert_close(routed_weights, weights)
            out = moe_decode.down_sum(act, w2, routed_ids, routed_weights, dtype, tile=tiles[1])
            torch.testing.assert_close(out.float(), reference.float(), atol=tolerance, rtol=tolerance)
        act, _, _ = moe_decode.gate_up(x, w13, k, topk_ids=ids, tile=tiles[1])
        out = moe_decode.down_sum(act, w2, ids, weights, dtype, add=add, tile=tiles[0])
        torch.testing.assert_close(out.float(), (reference + add).float(), atol=tolerance, rtol=tolerance)
        gamma = (torch.rand(hidden) + 0.5).to(dtype)  # the block's RMSNorm taken inside the gate-up GEMV
        act, _, _ = moe_decode.gate_up(x, w13, k, topk_ids=ids, norm=(gamma, 1e-6), tile=tiles[0])
        out = moe_decode.down_sum(act, w2, ids, weights, dtype, tile=tiles[1])
        normed = eager_fused_experts(pointwise.eager_rms_norm(x, gamma, 1e-6), w13, w2, weights, ids)
        torch.testing.assert_close(out.float(), normed.float(), atol=tolerance, rtol=tolerance)
from specserve.kernels.moe import eager_grouped_topk
from specserve.kernels.triton import moe_routing
# DeepSeek-V3's 8 groups of 32 choosing 4 (k 8); Moonlight's one group of 64 (k 6); ties in the unbiased scores.
for experts, n_group, topk_group, k in ((256, 8, 4, 8), (64, 1, 1, 6), (24, 4, 2, 3)):
    logits, bias = torch.randn(9, experts) * 2, torch.randn(experts) * 0.1
    logits[0, :4] = 1.0
    for renormalize, scale in ((True, 2.5), (False, 1.0)):
        weights, ids = moe_routing.grouped_topk(logits, bias, k, n_group, topk_group, renormalize, scale)
        ref_weights, ref_ids = eager_grouped_topk(logits, bias, k, n_group, topk_group, renormalize, scale)
        order, ref_order = ids.sort(dim=1), ref_ids.sort(dim=1)
        assert torch.equal(order.values, ref_order.values)
        torch.testing.assert_close(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices))
"""


def test_moe_decode_gemvs_and_grouped_routing_in_the_interpreter_match_the_pytorch_forms():
    # Routed in the kernel (softmax top-k, renormalised or not) or from given ids; the sum with the residual.
    # DeepSeek-V3's grouped sigmoid top-k in one launch.
    _run_in_interpreter(_MOE_DECODE_IN_INTERPRETER, timeout=600)


_QK_NORM_ROTARY_IN_INTERPRETER = """
from specserve.kernels import pointwise
from specserve.kernels.triton import pointwise as triton_pointwise
from specserve.layers.rotary import RotaryEmbedding
torch.manual_seed(0)
heads, kv_heads, dim, tokens = 5, 3, 16, 4
for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    q, k, v = (torch.randn(tokens, h, dim).to(dtype) * 3 for h in (heads, kv_heads, kv_heads))
    cache = torch.zeros(2, 10, kv_heads, dim, dtype=dtype)
    positions, slots = torch.tensor([0, 3, 9, 2]), torch.tensor([9, 1, 4, 0])
    cos_sin = RotaryEmbedding(dim, 16, 10000.0, None).cos_sin
    q_weight, k_weight = (torch.rand(dim).to(dtype) + 0.5 for _ in range(2))
    q_rot, k_rot = triton_pointwise.rotary_store(positions, cos_sin, q, k, v, cache, slots, (q_weight, k_weight, 1e-6))
    reference_cache = torch.zeros_like(cache)
    expected_q, expected_k = pointwise.eager_rotary_store(positions, cos_sin, pointwise.eager_rms_norm(q, q_weight, 1e-6),
                                                          pointwise.eager_rms_norm(k, k_weight, 1e-6), v,
                                                          reference_cache, slots)
    torch.testing.assert_close(q_rot, expected_q, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(k_rot, expected_k, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(cache, reference_cache, atol=tolerance, rtol=tolerance)
"""


def test_qk_norms_folded_into_the_rotary_store_in_the_interpreter_match_the_eager_math():
    _run_in_interpreter(_QK_NORM_ROTARY_IN_INTERPRETER, timeout=300)


_MLA_ROTARY_STORE_IN_INTERPRETER = """
from specserve.kernels import pointwise
from specserve.kernels.triton import pointwise as triton_pointwise
from specserve.layers.rotary import RotaryEmbedding
torch.manual_seed(0)
heads, rank, rope, tokens, slots = 3, 32, 16, 4, 12
halves = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    for interleaved in (True, False):
        q = (torch.randn(tokens, heads, 8 + rope) * 2).to(dtype)  # [q_nope | q_pe] per head
        q_pe = q[..., 8:]
        latent, gamma = (torch.randn(tokens, rank + rope) * 2).to(dtype), (torch.rand(rank) + 0.5).to(dtype)
        positions, slot_mapping = torch.tensor([0, 5, 2, 9]), torch.tensor([11, 0, 4, 7])
        cos_sin = RotaryEmbedding(rope, 16, 10000.0, None).cos_sin
        plane, q_out = torch.zeros(slots, 1, rank + rope, dtype=dtype), torch.zeros(tokens, heads, rank + rope, dtype=dtype)
        triton_pointwise.mla_rotary_store(positions, cos_sin, q_pe, latent, gamma, 1e-6, plane, slot_mapping, q_out,
                                          interleaved)
        order = halves if interleaved else torch.arange(rope)
        c = pointwise.eager_rms_norm(latent[:, :rank], gamma, 1e-6)
        expected_q, k_pe = pointwise.eager_rotary(positions, cos_sin, q_pe[..., order],
                                                  latent[:, rank:][:, order].view(tokens, 1, rope))
        expected = torch.zeros_like(plane)
        expected[slot_mapping] = torch.cat([c, k_pe.view(tokens, rope)], dim=-1).view(tokens, 1, -1)
        torch.testing.assert_close(plane, expected, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(q_out[..., rank:], expected_q, atol=tolerance, rtol=tolerance)
        assert not q_out[..., :rank].any()  # the latent queries' columns are the caller's
# The layer's latent-kernel path (fused store, then the latent attention kernel) against its PyTorch row form.
import json
from dataclasses import replace
from specserve.config import ModelConfig
from specserve.engine.factory import shipped_config
from specserve.layers.attention import AttentionMetadata
from specserve.layers.mla import MultiHeadLatentAttention
cfg = ModelConfig.from_hf_config(json.loads(shipped_config("moonlight-16b-a3b").read_text()))
cfg = replace(cfg, hidden_size=64, num_heads=4, mla=replace(cfg.mla, kv_lora_rank=32, qk_rope_head_dim=16,
                                                              qk_nope_head_dim=16, v_head_dim=16))
layer = MultiHeadLatentAttention(cfg)
with torch.no_grad():
    for param in layer.parameters():
        param.copy_(torch.randn_like(param) * 0.1 + (1.0 if param.dim() == 1 else 0.0))
rotary = RotaryEmbedding(16, 256, cfg.rope_theta, cfg.rope_scaling)
page, lens = 4, [1, 9, 30]
block_tables = torch.arange(3 * 8, dtype=torch.int32).view(3, 8)
seq_lens = torch.tensor(lens, dtype=torch.int32)
positions = seq_lens.long() - 1
slot_mapping = block_tables.gather(1, (positions // page).view(-1, 1)).view(-1).long() * page + positions % page
meta = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens, page_size=page)
cache = torch.randn(1, 3 * 8 * page, 1, 48)
x = torch.randn(3, 64)
with torch.no_grad():
    fused_cache = cache.clone()
    layer._latent_kernels = lambda *args: True  # a CPU tensor, run by the interpreter
    fused = layer(x, positions, rotary, fused_cache, meta)
    layer._latent_kernels = lambda *args: False
    reference = layer(x, positions, rotary, cache, meta)
torch.testing.assert_close(fused_cache, cache, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(fused, reference, atol=1e-4, rtol=1e-4)
"""


def test_mla_rotary_store_in_the_interpreter_matches_the_eager_ops():
    # The latent's norm, the rotations of k_pe and q_pe (interleaved pairs or halves) and the cache row; then
    # the whole layer's decode step through it and the latent attention kernel.
    _run_in_interpreter(_MLA_ROTARY_STORE_IN_INTERPRETER, timeout=300)


_FP8_GEMV_IN_INTERPRETER = """
from gemv_checks import ATOL, RTOL, fp8_forms, interpreter_range
from specserve.kernels.triton import gemv as triton_gemv
from specserve.kernels.tuning import chooser
triton_gemv.range = interpreter_range
torch.manual_seed(0)
for rows, tiles in ((1, chooser.ONE_ROW_TILES[:1]),
                    (3, [chooser.ROWS_TILES[0], chooser.SWAP_TILES[0], chooser.TMA_TILES[0]])):
    for out_features, width in ((96, 64), (100, 600)):
        weight = (torch.randn(out_features, width) / width**0.5).half()
        weight[1] = 0.0  # a row of zeros gets the smallest scale, not a division by zero
        x = (torch.randn(rows, width) * 5).half()
        gamma, residual = (torch.rand(width) + 0.5).half(), torch.randn(rows, out_features).half()
        for tile in tiles:
            for form, out, reference in fp8_forms(x, weight, gamma, residual, tile):
                error = (out.float() - reference).abs()
                assert (error <= ATOL + RTOL * reference.abs()).all(), (rows, tile, form, error.max())
"""


def test_gemv_with_fp8_weights_in_the_interpreter_matches_the_dequantized_math():
    # One row on CUDA cores; several as a dot with the weight widened first (rows-left, swapped, and a TMA tile,
    # which an fp8 weight runs with ordinary loads); the scales applied before the norm, SiLU and residual.
    _run_in_interpreter(_FP8_GEMV_IN_INTERPRETER, timeout=900)


_SPLIT_GEMV_IN_INTERPRETER = """
from gemv_checks import SPLIT_TILES, check, interpreter_range
from specserve.kernels.triton import gemv as triton_gemv
triton_gemv.range = interpreter_range
torch.manual_seed(0)
for rows in (3, 16):
    results = check(rows, SPLIT_TILES, ((96, 256), (100, 600)), calls=2)  # twice: the counts are back at zero
    assert {r["tile"] for r in results} == {str(t) for t in SPLIT_TILES}
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]
    assert not triton_gemv._counters[torch.device("cpu")].any()
"""


@slow_in_interpreter
def test_gemv_split_over_k_in_the_interpreter_matches_the_unsplit_math():
    # Every form (norm folds, gate/up, residual, fp8 scales), rows-left, swapped and TMA tiles, in two and three
    # splits (the last one shorter at width 600), each twice: the last program in resets its tile's count.
    _run_in_interpreter(_SPLIT_GEMV_IN_INTERPRETER, timeout=900)


_TAILS_IN_INTERPRETER = """
from kernel_checks import check_tail_attention
from gemv_checks import interpreter_range
from specserve.kernels.triton import attention as triton_attention
triton_attention.range = interpreter_range
for dtype, tolerance in ((torch.float32, 1e-4), (torch.float16, 1e-2)):
    for splits in (1, 2, 5, 32):
        for per_seq in (1, 3, 6):
            check_tail_attention("cpu", dtype, splits, per_seq, tolerance, heads=8, kv_heads=2, dim=32)
"""


@slow_in_interpreter
def test_tree_tails_dealt_over_context_slices_in_the_interpreter():
    # Each tree row's tail is attended by one context slice (dealt from the last one down), which the merge
    # then weighs with the rest: 1 slice (no merge), 2 (rows wrap around the slices), 5, and 32 (most slices
    # hold no context, only a tail, or nothing at all for a row), with 1, 3 and 6 rows sharing a context.
    _run_in_interpreter(_TAILS_IN_INTERPRETER, timeout=900)


_CLOSED_TAILS_IN_INTERPRETER = """
from kernel_checks import check_closed_tail_attention
from gemv_checks import interpreter_range
from specserve.kernels.triton import attention as triton_attention
triton_attention.range = interpreter_range
for dtype, tolerance in ((torch.float32, 1e-4), (torch.float16, 1e-2)):
    for splits in (1, 3, 32):
        check_closed_tail_attention("cpu", dtype, splits, tolerance, heads=8, kv_heads=2, dim=32)
"""


@slow_in_interpreter
def test_verified_trees_tails_as_one_block_in_the_interpreter():
    # A tree's tails as one block of the run's own slots, each query row masked to its ancestors and itself,
    # with 1, 3 and 32 slices (the block goes to the last; with 32, most slices hold no context).
    _run_in_interpreter(_CLOSED_TAILS_IN_INTERPRETER, timeout=900)


_TREE_SEARCH_IN_INTERPRETER = """
from kernel_checks import (check_tree_accept, check_tree_expand, check_tree_move, check_tree_root_children,
                           check_tree_select, check_tree_step_rows)
from gemv_checks import interpreter_range
from specserve.kernels.triton import follow as triton_follow, tree as triton_tree
triton_tree.range = triton_follow.range = interpreter_range
check_tree_select("cpu")
check_tree_accept("cpu")
check_tree_step_rows("cpu")
for dtype in (torch.float32, torch.bfloat16):
    check_tree_expand("cpu", dtype)
    check_tree_root_children("cpu", dtype)
    check_tree_move("cpu", dtype)
"""


def test_fused_tree_search_kernels_in_the_interpreter_match_the_pytorch_forms():
    # A search level's bookkeeping (the first level's too), the tree's selection, a greedy step's acceptance, the
    # step's row inputs and the accepted nodes' move, each one kernel, against the PyTorch forms the CPU runs: equal
    # outputs, ties included.
    _run_in_interpreter(_TREE_SEARCH_IN_INTERPRETER, timeout=900)


_FUSED_TREE_PROGRAM_IN_INTERPRETER = """
from dataclasses import replace
from engine_runs import count_accepted, hf_greedy, make_prompts, run_staggered, tight_config
from gemv_checks import interpreter_range
from tiny_checkpoints import write_peaked_random_head
from specserve.config import SpecConfig
from specserve.kernels.triton import follow as triton_follow, tree as triton_tree
from specserve.engine.factory import build_engine_core
triton_tree.range = triton_follow.range = interpreter_range
from specserve import envs
tree_on_cpu = envs.override(tree_program_on_cpu=True)  # kept: the switch holds while it lives
tree_on_cpu.__enter__()
from pathlib import Path
path, head = Path({path!r}), Path({head!r})
write_peaked_random_head(path, head)
prompts = make_prompts(512, seed=4)
expected = hf_greedy(path, prompts)
for tree in (dict(num_steps=4, eagle_topk=3, num_draft_tokens=9), dict(num_steps=1, eagle_topk=3, num_draft_tokens=4)):
    runs = []
    for fused in (True, False):
        spec = SpecConfig("EAGLE3", str(head), **tree)
        engine, _ = build_engine_core(replace(tight_config(str(path), 200), spec=spec), progress=False)
        program = engine.runner.program
        if fused:
            program.fused = True
            program._allocate_search(program.candidate_depth.numel())
        accepted = count_accepted(engine)
        outputs, _ = run_staggered(engine, prompts)
        assert program.num_runs > 10
        runs.append((outputs, accepted))
    assert runs[0] == runs[1], tree
    assert runs[0][0] == expected, tree
"""


@slow_in_interpreter
def test_tree_program_with_the_fused_search_in_the_interpreter_is_lossless(tiny_checkpoint, tmp_path):
    # The tree program on the CPU with its search's bookkeeping, selection and acceptance in the Triton kernels (run
    # by the interpreter), five levels deep and one: HF's greedy output, and every step accepting what the PyTorch
    # form's step accepts.
    path = tiny_checkpoint("llama", True)
    _run_in_interpreter(_FUSED_TREE_PROGRAM_IN_INTERPRETER.format(path=str(path), head=str(tmp_path)), timeout=900)


_ARGMAX_IN_INTERPRETER = """
from kernel_checks import check_argmax
for dtype in (torch.float32, torch.float16):
    check_argmax("cpu", dtype)
"""


def test_argmax_kernels_in_the_interpreter_pick_like_torch():
    # The greedy token of each row in two kernels (blocks of a row, then the row): ties to the lowest index
    # across blocks, a NaN beating every number (+inf too), rows of -inf, strided rows and leading dimensions.
    _run_in_interpreter(_ARGMAX_IN_INTERPRETER, timeout=600)


_NORM_PAIR_IN_INTERPRETER = """
from kernel_checks import check_rms_norm_pair
check_rms_norm_pair("cpu", torch.float32, 1e-5)
check_rms_norm_pair("cpu", torch.float16, 1e-2)
"""


def test_rms_norm_pair_in_the_interpreter_matches_the_eager_norms():
    # An EAGLE-3 head's input: both norms, each into its half of one row, in one kernel.
    _run_in_interpreter(_NORM_PAIR_IN_INTERPRETER, timeout=300)


def test_chain_acceptance_kernel_in_the_interpreter_packs_like_accept_chain():
    # The greedy chain step's acceptance, packing and copies for a following step, in one kernel.
    _run_in_interpreter("from kernel_checks import check_accept_and_pack\ncheck_accept_and_pack('cpu')\n", timeout=300)


_CHAIN_ROWS_IN_INTERPRETER = """
from kernel_checks import check_chain_rows
from gemv_checks import interpreter_range
from specserve.kernels.triton import follow as triton_follow
triton_follow.range = interpreter_range
check_chain_rows("cpu")
"""


def test_chain_row_inputs_kernel_in_the_interpreter_matches_pytorch():
    # Context lengths, tails and per-row page tables of the chain program's three forwards, in one kernel.
    _run_in_interpreter(_CHAIN_ROWS_IN_INTERPRETER, timeout=300)


_SLOTS_FOR_SM90 = """
import itertools
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specserve.kernels.triton import gemv as triton_gemv

def alloc_slots(kernel, types, constants, stages):
    # Pointers, sizes and strides are given as multiples of 16, as serving's launches specialise them.
    signature = {name: "constexpr" if name in constants else types[name] for name in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if name not in constants
             and (types[name].startswith("*") or name in ("N", "K", "K_SPLIT") or name.startswith("stride"))}
    ir = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=4, num_stages=stages)).asm["ttgir"]
    return re.findall(r"ttg\\.local_alloc : \\(\\) -> !ttg\\.memdesc<(\\d+)x(\\d+)x(\\d+)xbf16", ir)

types = dict(X="*bf16", W="*bf16", OUT="*bf16", GAMMA="*bf16", RES="*bf16", SCALE="*fp32", WS="*fp32",
             COUNTERS="*i32", M="i32", N="i32", K="i32", K_SPLIT="i32", stride_xm="i32", stride_wn="i32",
             stride_om="i32", stride_rm="i32", eps="fp32")
for (block_n, block_k, stages), split in itertools.product(((64, 256, 4), (128, 128, 3)), (1, 2)):
    for gate_up in (False, True):
        form = dict(ROWS=16, GATE_UP=gate_up, NORM=True, GAMMA_ON=False, ADD=False, BLOCK_N=block_n,
                    BLOCK_K=block_k, SPLIT=split, PDL=True)
        descriptor = {**types, "W": f"tensordesc<bf16[{block_n},{block_k}]>"}
        checks = {("TMA",): alloc_slots(triton_gemv._gemv_tma_kernel, descriptor, form, stages)}
        for even in (True, False):
            checks["pointer loads", even] = alloc_slots(
                triton_gemv._gemv_kernel, types,
                {**form, "ONE_ROW": False, "SWAP": True, "EVEN": even, "SCALED": False, "FP8_BITS": False}, stages)
        for name, slots in checks.items():
            x_slots = {int(n) for n, rows, _ in slots if int(rows) == 16}
            w_slots = {int(n) for n, rows, _ in slots if int(rows) == block_n}
            assert len(x_slots) == 1 and len(w_slots) == 1, (name, slots)
            assert x_slots == w_slots, (name, block_n, block_k, stages, split, gate_up, slots)
"""


@pytest.mark.skipif(not triton.__version__.startswith("3.6."), reason="reads the IR of Triton 3.6's pipeliner")
def test_swapped_moved_norm_dot_has_as_many_slots_as_the_weight_compiled_for_sm90():
    # Compiled for sm_90 (no GPU needed), with pointers, sizes and strides multiples of 16 as in serving: in the
    # swapped form whose norm weight sits in the projection, x's shared buffer is the asynchronous wgmma's
    # operand, as the weight's is, so it needs as many slots. With the sum of squares reading that same buffer,
    # Triton 3.6 gave it one fewer and the next loads raced the dot in flight (wrong results on an H200).
    # Checked with PDL (as launched on sm_90), with and without the gate/up pair, with and without masks, whole
    # and split over K.
    run = subprocess.run([sys.executable, "-c", _SLOTS_FOR_SM90], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr[-2000:]


_MLA_DECODE_IN_INTERPRETER = """
from triton.runtime import interpreter
# Triton 3.6's interpreter takes a loop bound the kernel loaded (a context length) as int() of a one-element
# array, which numpy 2 refuses; its first element is the bound.
_patch = interpreter._patch_lang_tensor
def _patch_with_index(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interpreter._patch_lang_tensor = _patch_with_index

from specserve.kernels.triton.mla_attention import mla_decode_attention
from specserve.layers.attention import AttentionMetadata, attend_rows
torch.manual_seed(0)
rank, rope, page = 32, 16, 4
plane = torch.randn(160, 1, rank + rope)
decode = dict(block_tables=torch.tensor([[3, 0, 0, 0, 0, 0], [5, 6, 7, 0, 0, 0], [10, 11, 12, 13, 14, 15]],
                                        dtype=torch.int32), seq_lens=torch.tensor([1, 9, 23], dtype=torch.int32))
# One draft tree of 3 nodes over a 13-token context: each row sees its ancestors' slots and its own.
tree = dict(block_tables=torch.tensor([[20, 21, 22, 23]] * 3, dtype=torch.int32),
            seq_lens=torch.tensor([13, 13, 13], dtype=torch.int32),
            tail_slots=torch.tensor([[100, 0, 0], [100, 101, 0], [100, 102, 0]]),
            tail_lens=torch.tensor([1, 2, 2], dtype=torch.int32), rows_per_seq=3)
# 4 heads: the tree's rows share one program; 32 heads: too many rows for one, each row its own.
for heads, case in ((4, decode), (4, tree), (32, tree)):
    rows = case["block_tables"].shape[0]
    q = torch.randn(rows, heads, rank + rope)
    meta = AttentionMetadata(slot_mapping=torch.zeros(rows, dtype=torch.long), page_size=page, **case)
    expected = attend_rows(q, plane[None].expand(2, -1, -1, -1), meta, 0.3).view(rows, heads, -1)[..., :rank]
    for splits in (1, 2, 4):
        out = mla_decode_attention(q, plane, rank, case["block_tables"], case["seq_lens"], 0.3, page, splits,
                                   case.get("tail_slots"), case.get("tail_lens"), case.get("rows_per_seq", 1))
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
"""


def test_mla_decode_kernel_in_the_interpreter_equals_attend_rows_over_the_latent_plane():
    # Plain decode rows and a draft tree's rows (one program for the run, or one per row), whole contexts and
    # contexts cut into slices.
    _run_in_interpreter(_MLA_DECODE_IN_INTERPRETER, timeout=600)
