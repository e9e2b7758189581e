"""The same correctness checks on a GPU, with CUDA graphs on. Skipped on machines without CUDA (CI has none)."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from specserve.config import SpecConfig
from specserve.engine.factory import build_engine_core
from specserve.core import SamplingParams

from conftest import (check_accept_and_pack, check_argmax, check_chain_rows, check_closed_tail_attention,
                      check_rms_norm_pair, check_tail_attention, check_tree_accept, check_tree_expand,
                      check_tree_move, check_tree_root_children, check_tree_select, check_tree_step_rows,
                      run_mixed_sampling, watch_drafting_paths, write_peaked_random_head)
from test_greedy_vs_hf import _check, _engine_greedy, _hf_greedy, _prompts, _tight_config, run_staggered

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_transformers_on_gpu_fp32(tiny_checkpoint, kind):
    path = tiny_checkpoint(kind)
    config = replace(_tight_config(str(path), max_total_tokens=200), device="cuda")
    _check(config, path, vocab=512, device="cuda")


def test_decode_steps_replay_cuda_graphs_and_match_eager(tiny_checkpoint):
    path = tiny_checkpoint("llama", True)
    prompts = _prompts(512, seed=5)
    config = replace(_tight_config(str(path), max_total_tokens=200), device="cuda")
    graphed, engine = _engine_greedy(config, prompts)
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 20
    eager, engine = _engine_greedy(replace(config, disable_cuda_graph=True), prompts)
    assert engine.runner.graphs is None
    assert graphed == eager == _hf_greedy(path, prompts, "cuda")


@pytest.mark.parametrize("algorithm,topk", [("DRAFT_MODEL", 1), ("DRAFT_MODEL", 4)])
def test_speculation_with_graphs_matches_the_reference_fp32(tiny_checkpoint, algorithm, topk):
    path = tiny_checkpoint("llama", True)
    prompts = _prompts(512, seed=6)
    reference = _hf_greedy(path, prompts, "cuda")
    spec = SpecConfig(algorithm, str(path), 3, topk, 8 if topk > 1 else None)
    engine, _ = build_engine_core(replace(_tight_config(str(path), 200), device="cuda", spec=spec), progress=False)
    rng = random.Random(0)
    engine.scheduler.draft_plan = lambda request: rng.choice([0, 0, 2, engine.scheduler.max_draft_tokens])
    ours, _ = run_staggered(engine, prompts)
    assert ours == reference
    assert engine.runner.graphs.num_replays > 0  # steps without drafts replayed graphs


def test_llama_8b_shaped_dummy_generates_in_bf16():
    config = replace(
        _tight_config("llama-3.1-8b", max_total_tokens=8192), device="cuda", dtype="bfloat16", load_format="dummy",
        context_length=4096,
    )
    engine, _ = build_engine_core(config, progress=False)
    assert engine.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 300, 1000, 17)):
        engine.add_request(str(i), list(range(1000, 1000 + n)), params)
    produced = {}
    while engine.has_work():
        for delta in engine.step():
            produced.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert all(len(v) == 8 and all(0 <= t < 128256 for t in v) for v in produced.values())
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 5, 16])
def test_triton_decode_attention_matches_the_reference(dtype, splits):
    """Paged decode kernel vs the gather + SDPA reference: scattered pages, lengths 1 to 1000, GQA 4:1, the
    context whole or cut into slices (some of them empty for the short sequences)."""
    from specserve.layers.attention import AttentionMetadata, paged_attention

    torch.manual_seed(0)
    page, heads, kv_heads, dim, lens = 16, 32, 8, 128, [1, 17, 300, 1000, 64]
    pages_per_seq = [-(-n // page) for n in lens]
    order = torch.randperm(sum(pages_per_seq) + 4).tolist()  # pages scattered through the pool
    tables, start = [], 0
    for n in pages_per_seq:
        tables.append(order[start:start + n])
        start += n
    slots = (sum(pages_per_seq) + 4) * page
    pool = torch.randn(2, slots, kv_heads, dim, device="cuda", dtype=dtype)
    q = torch.randn(len(lens), heads, dim, device="cuda", dtype=dtype)
    k_new = pool[0].new_zeros(len(lens), kv_heads, dim)
    positions = [n - 1 for n in lens]
    # Write each sequence's last K/V through the kernel path too, then compare against the reference.
    k_new.copy_(torch.stack([pool[0, t[p // page] * page + p % page] for t, p in zip(tables, positions)]))
    v_new = torch.stack([pool[1, t[p // page] * page + p % page] for t, p in zip(tables, positions)])
    reference = paged_attention(q, k_new, v_new, pool.clone(), AttentionMetadata.build(
        [1] * len(lens), positions, tables, page, torch.device("cuda"), decode_kernel=False), dim**-0.5)
    width = max(pages_per_seq)
    meta = replace(AttentionMetadata.build([1] * len(lens), positions, tables, page, torch.device("cuda"),
                                           decode_kernel=False),
                   block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                             device="cuda"),
                   seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"), page_size=page,
                   num_splits=splits)
    ours = paged_attention(q, k_new, v_new, pool.clone(), meta, dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), reference.float(), atol=tolerance, rtol=tolerance)


def _compiled_forms(kernel) -> int:
    """How many specialisations of a Triton kernel this process has compiled (or loaded)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(cache) for cache in kernel.cache.values())


def test_eager_decode_rows_compile_nothing_after_warm_up():
    """Eager calls of the decode kernel (decode rows of steps with prompts, the head's catch-ups) vary the
    batch, the table width and the slice count at almost every step; after the startup warm-up none of
    that may compile a new form of the kernels inside a step (each took ~0.1 s)."""
    from specserve.kernels.triton import attention as triton_attention
    from specserve.layers.attention import AttentionMetadata, attend

    page, heads, kv_heads, dim = 16, 32, 8, 128
    pool = torch.randn(2, 300 * page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    kernels = (triton_attention._partial_kernel, triton_attention._merge_kernel)
    for kernel in kernels:  # forget the forms earlier tests compiled: only the warm-up's may be there
        getattr(kernel, "device_caches", getattr(kernel, "cache", {})).clear()
    triton_attention.warm_up(heads, pool, page)
    before = [_compiled_forms(k) for k in kernels]
    assert all(before)
    seen_splits = set()
    for batch, width in ((1, 1), (1, 7), (1, 16), (2, 33), (3, 48), (5, 20), (9, 64), (17, 250), (40, 3), (64, 17)):
        tables = torch.randint(0, 300, (batch, width), dtype=torch.int32, device="cuda")
        lens = torch.randint(1, width * page + 1, (batch,), dtype=torch.int32, device="cuda")
        meta = AttentionMetadata.for_decode_kernel(lens, tables, lens, page, kv_heads, width * page)
        seen_splits.add(meta.num_splits)
        q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
        assert torch.isfinite(attend(q, q, q, pool, meta, dim**-0.5)).all()
    torch.cuda.synchronize()
    assert len(seen_splits) >= 5
    assert [_compiled_forms(k) for k in kernels] == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_steps_send_decode_rows_to_the_kernel_with_the_same_result(dtype):
    """A step of prompt chunks (fresh and continued), a 4-token row and decode rows of contexts 1 to 900:
    on a GPU the decode rows go to the paged kernel; the result matches all rows through SDPA."""
    from specserve.layers.attention import AttentionMetadata, paged_attention

    torch.manual_seed(1)
    page, heads, kv_heads, dim = 16, 32, 8, 128
    seqs = [(300, 0), (1, 0), (1, 899), (4, 40), (1, 77), (120, 200), (1, 16)]  # (step tokens, cached before)
    order = torch.randperm(200).tolist()
    tables, start = [], 0
    for q, cached in seqs:
        n = -(-(q + cached) // page)
        tables.append(order[start:start + n])
        start += n
    pool = torch.randn(2, 201 * page, kv_heads, dim, device="cuda", dtype=dtype)
    total = sum(q for q, _ in seqs)
    q = torch.randn(total, heads, dim, device="cuda", dtype=dtype)
    k, v = torch.randn(2, total, kv_heads, dim, device="cuda", dtype=dtype)
    args = ([n for n, _ in seqs], [c for _, c in seqs], tables, page, torch.device("cuda"))
    meta = AttentionMetadata.build(*args)
    assert meta.decode_rows is not None and len(meta.decode_rows.tokens) == 4
    reference = AttentionMetadata.build(*args, decode_kernel=False)
    assert reference.decode_rows is None
    torch.testing.assert_close(meta.slot_mapping, reference.slot_mapping)
    ours = paged_attention(q, k, v, pool.clone(), meta, dim**-0.5)
    expected = paged_attention(q, k, v, pool.clone(), reference, dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_eagle3_taps_stored_by_graphed_steps_draft_like_eager_ones(tiny_checkpoint, tmp_path):
    """Steps that draft nothing replay graphs, which also store the EAGLE-3 head's taps; the drafts made
    from them later equal those of a run with graphs off (a peaked random head, fp32)."""
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = _prompts(512, seed=8)
    runs = []
    for disable in (False, True):
        spec = SpecConfig("EAGLE3", str(tmp_path), 3, 2, 6)
        config = replace(_tight_config(str(path), 200), device="cuda", spec=spec, disable_cuda_graph=disable)
        engine, _ = build_engine_core(config, progress=False)
        rng = random.Random(0)
        engine.scheduler.draft_plan = lambda request: rng.choice([0, 0, 0, 5])
        trees, propose = [], engine.runner.proposer.propose
        engine.runner.proposer.propose = lambda batch: trees.append(propose(batch)) or trees[-1]
        outputs, _ = run_staggered(engine, prompts)
        runs.append((outputs, [{i: (t.tokens, t.parents) for i, t in step.items()} for step in trees]))
        assert (engine.runner.graphs is None) == disable
    assert runs[0] == runs[1]
    assert runs[0][0] == _hf_greedy(path, prompts, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_pointwise_kernels_match_the_eager_functions(dtype):
    """Rotary on strided q/k views, SiLU-and-multiply, and the KV store, against the eager reference."""
    from specserve.kernels import pointwise
    from specserve.kernels.triton import pointwise as triton_pointwise
    from specserve.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    tokens, heads, kv_heads, dim = 37, 32, 8, 128
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda", dtype=dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    positions = torch.randint(0, 4000, (tokens,), device="cuda")
    cos_sin = RotaryEmbedding(dim, 4096, 500000.0, None).cos_sin.cuda()
    ours, reference = triton_pointwise.rotary(positions, cos_sin, q, k), pointwise._EAGER["rotary"](positions, cos_sin, q, k)
    one_rounding = 1e-6 if dtype == torch.float32 else 1.6e-2
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, atol=one_rounding, rtol=one_rounding)
    gate_up = torch.randn(tokens, 2 * 1000, device="cuda", dtype=dtype) * 4
    torch.testing.assert_close(triton_pointwise.silu_and_mul(gate_up), pointwise._EAGER["silu_and_mul"](gate_up),
                               atol=one_rounding, rtol=one_rounding)
    batched = gate_up[:36].view(4, 9, -1)  # [B, T, 2I], as a head's held-out evaluation passes
    torch.testing.assert_close(triton_pointwise.silu_and_mul(batched), pointwise._EAGER["silu_and_mul"](batched),
                               atol=one_rounding, rtol=one_rounding)
    cache = torch.zeros(2, 500, kv_heads, dim, device="cuda", dtype=dtype)
    expected = cache.clone()
    slots = torch.randperm(500, device="cuda")[:tokens]
    triton_pointwise.store_kv(ours[1], v, cache, slots)
    expected[0].index_copy_(0, slots, ours[1])
    expected[1].index_copy_(0, slots, v)
    assert torch.equal(cache, expected)


def test_overlapped_steps_never_wait_for_the_device_and_match_transformers(tiny_checkpoint):
    """Greedy fp32 with overlap and graphs equals HF and the engine without overlap; launching a step (its
    scheduling, input copies, replay and sampling) makes no host-device synchronisation: CUDA's sync debug
    mode turns any into an error. The only one left is the read-back of the tokens."""
    path = tiny_checkpoint("llama", True)
    # Seed 9's prompts hit a near-tie where this GPU's fp32 rounding and HF's differ, overlap or not.
    prompts = _prompts(512, seed=5)
    config = replace(_tight_config(str(path), max_total_tokens=200), device="cuda")
    engine, _ = build_engine_core(config, progress=False)
    assert engine.overlap
    launch, checked = engine.runner.launch, []

    def launch_without_syncs(batch, publish=False):
        decode_only = all(len(s.token_ids) == 1 for s in batch.seqs)
        torch.cuda.set_sync_debug_mode("error" if decode_only else "default")
        try:
            output = launch(batch, publish)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(decode_only)
        return output

    engine.runner.launch = launch_without_syncs
    overlapped, _ = run_staggered(engine, prompts)
    assert sum(checked) > 20
    synchronous, _ = _engine_greedy(replace(config, disable_overlap=True), prompts)
    assert overlapped == synchronous == _hf_greedy(path, prompts, "cuda")


def test_graphed_steps_sample_seeded_rows_like_eager_steps(tiny_checkpoint):
    """Graphs take the greedy argmax themselves; a batch with sampled rows samples from the graph's logits
    instead. Seeded sampled rows and greedy rows in the same batches, under overlap: graphed equals eager."""
    path = tiny_checkpoint("llama", True)
    prompts = _prompts(512, seed=7)
    config = replace(_tight_config(str(path), max_total_tokens=200), device="cuda")

    def run(config):
        engine, _ = build_engine_core(config, progress=False)
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                                    seed=None if i % 2 else 100 + i)
            engine.add_request(str(i), prompt, params)
        outputs = {str(i): [] for i in range(len(prompts))}
        while engine.has_work():
            for delta in engine.step():
                outputs[delta.request_id] += delta.new_token_ids
        return [outputs[str(i)] for i in range(len(prompts))], engine

    graphed, engine = run(config)
    assert engine.overlap and engine.runner.graphs.num_replays > 5
    eager, engine = run(replace(config, disable_cuda_graph=True))
    assert engine.runner.graphs is None
    assert graphed == eager
    assert all(len(tokens) == 12 for tokens in graphed)


def test_placeholder_resolution_kernel_matches_the_torch_form():
    from specserve.engine.futures import FutureTokens
    from specserve.kernels.triton.pointwise import resolve_placeholders

    futures = FutureTokens(64, torch.device("cuda"))
    futures.values.copy_(torch.randperm(128, device="cuda") + 1000)
    for n in (1, 5, 64, 200, 1024, 3000):
        ids = torch.randint(-128, 5000, (n,), device="cuda")
        expected = torch.where(ids < 0, futures.values[(-ids - 1).clamp(min=0)], ids)
        resolved = ids.clone()
        futures.resolve(resolved)  # the kernel up to 1,024 ids, the PyTorch form above
        assert torch.equal(resolved, expected)
        assert resolve_placeholders(ids, futures.values) == (n <= 1024)
        assert torch.equal(ids, expected) == (n <= 1024)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 2, 5, 32])
@pytest.mark.parametrize("rows_per_seq", [1, 3])
def test_triton_decode_attention_with_tails_matches_the_row_reference(dtype, splits, rows_per_seq):
    """Draft-tree rows: the context through the page table, then a tail of scattered slots (none, one, many),
    against the PyTorch form of the same contract; with rows_per_seq > 1, runs of rows share a sequence's
    context and one program reads it for all of them. The tails are dealt over the context slices: with 2,
    rows wrap around them; with 32, some slices hold no context, only a tail."""
    check_tail_attention("cuda", dtype, splits, rows_per_seq, 1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3, 32])
def test_triton_decode_attention_with_a_trees_tails_as_one_block_matches_the_row_reference(dtype, splits):
    """Verified trees: each run's tails as one block of its rows' own slots, every query row masked to its
    ancestors and itself (SPECSERVE_CLOSED_TAILS), against the per-row PyTorch contract."""
    check_closed_tail_attention("cuda", dtype, splits, 1e-4 if dtype == torch.float32 else 2e-2)


def test_fused_tree_search_kernels_match_the_pytorch_forms():
    """A search level's bookkeeping (the first level's too), the tree's selection, a greedy step's acceptance, the
    step's row inputs and the accepted nodes' move (engine/triton_tree.py) against the PyTorch forms."""
    check_tree_select("cuda")
    check_tree_accept("cuda")
    check_tree_step_rows("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        check_tree_expand("cuda", dtype)
        check_tree_root_children("cuda", dtype)
        check_tree_move("cuda", dtype)


@pytest.mark.parametrize("new_forms", [False, True], ids=["tails-per-row-pytorch-search", "one-block-fused-search"])
def test_eagle3_tree_program_forms_match_transformers(tiny_checkpoint, tmp_path, monkeypatch, new_forms):
    """The tree program, in graphs and eagerly, gives HF's greedy output with its verified tree's tails attended
    a block per row or as one block (SPECSERVE_CLOSED_TAILS), and its search's bookkeeping in PyTorch or in
    Triton kernels (SPECSERVE_FUSED_SEARCH): both on by default."""
    from specserve.kernels.triton import tree as triton_tree
    from specserve.kernels.triton import attention as triton_attention

    monkeypatch.setattr(triton_attention, "CLOSED_TAILS", new_forms)
    monkeypatch.setattr(triton_tree, "ENABLED", new_forms)
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = _prompts(512, seed=5)
    for disable in (False, True):
        spec = SpecConfig("EAGLE3", str(tmp_path), 4, 3, 9)
        config = replace(_tight_config(str(path), 200), device="cuda", spec=spec, disable_cuda_graph=disable)
        engine, _ = build_engine_core(config, progress=False)
        outputs, _ = run_staggered(engine, prompts)
        program = engine.runner.spec_graphs
        assert program.num_runs > 3 and program.fused == new_forms
        assert outputs == _hf_greedy(path, prompts, "cuda")


@pytest.mark.parametrize("fused_topk", [False, True], ids=["pytorch-topk", "fused-topk"])
@pytest.mark.parametrize("simulate", [None, 2.5])
def test_eagle3_tree_program_in_graphs_matches_eager_and_transformers(tiny_checkpoint, tmp_path, monkeypatch,
                                                                      simulate, fused_topk):
    """EAGLE-2 tree steps replayed as one graph each equal the same program run eagerly, and (greedy) HF; with
    the search's top-k in PyTorch or in the fused kernels (SPECSERVE_FUSED_TOPK)."""
    from specserve.kernels.triton import topk as triton_topk
    from specserve.speculative.programs.tree import TreeGraphs

    monkeypatch.setattr(triton_topk, "ENABLED", fused_topk)

    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = _prompts(512, seed=5)
    runs = []
    for disable in (False, True):
        spec = SpecConfig("EAGLE3", str(tmp_path), 4, 3, 9, simulate_accept_len=simulate)
        config = replace(_tight_config(str(path), 200), device="cuda", spec=spec, disable_cuda_graph=disable)
        engine, _ = build_engine_core(config, progress=False)
        outputs, _ = run_staggered(engine, prompts)
        tree = engine.runner.spec_graphs
        assert isinstance(tree, TreeGraphs) and tree.num_runs > 3 and bool(tree.graphs) != disable
        alloc = engine.scheduler.allocator
        assert alloc.num_free == alloc.num_pages
        runs.append(outputs)
    assert runs[0] == runs[1]
    if simulate is None:
        assert runs[0] == _hf_greedy(path, prompts, "cuda")


@pytest.mark.parametrize("shared", [False, True], ids=["rows-apart", "shared-context"])
@pytest.mark.parametrize("simulate", [None, 2.5])
def test_eagle3_chain_program_in_graphs_matches_eager_and_transformers(tiny_checkpoint, tmp_path, monkeypatch,
                                                                       simulate, shared):
    """EAGLE-3 chain steps replayed as one graph each equal the same program run eagerly, and (greedy) HF; with
    each sequence's rows attending apart and as one run over a shared context (SHARED_CONTEXT)."""
    from specserve.speculative.programs import chain as chain_graphs

    monkeypatch.setattr(chain_graphs, "SHARED_CONTEXT", shared)
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = _prompts(512, seed=5)
    runs = []
    for disable in (False, True):
        spec = SpecConfig("EAGLE3", str(tmp_path), 3, simulate_accept_len=simulate)
        config = replace(_tight_config(str(path), 200), device="cuda", spec=spec, disable_cuda_graph=disable)
        engine, _ = build_engine_core(config, progress=False)
        outputs, _ = run_staggered(engine, prompts)
        chain = engine.runner.spec_graphs
        assert chain.num_runs > 3 and bool(chain.graphs) != disable
        runs.append(outputs)
    assert runs[0] == runs[1]
    if simulate is None:
        assert runs[0] == _hf_greedy(path, prompts, "cuda")


@pytest.mark.parametrize("spec_args", [(3,), (1,), (4, 3, 9)], ids=["chain", "chain-of-one", "tree"])
def test_following_rows_from_one_kernel_equal_the_pytorch_form(tiny_checkpoint, tmp_path, monkeypatch, spec_args):
    """The fused kernel (engine/triton_follow.py) writes what SpecGraphs._follow's PyTorch form writes."""
    from specserve.kernels.triton import follow as triton_follow

    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    config = replace(_tight_config(str(path), 200), device="cuda", spec=SpecConfig("EAGLE3", str(tmp_path), *spec_args),
                     disable_cuda_graph=True)
    engine, _ = build_engine_core(config, progress=False)
    monkeypatch.setattr(triton_follow, "ENABLED", False)
    check_fused_follow(engine.runner.spec_graphs)


def check_fused_follow(program) -> None:
    """On random last-step results, page tables and host-written inputs, for a batch of rows that follow and
    rows that do not (whose inputs must stay as the host wrote them), with positions past the page table
    among them: every per-step buffer after `triton_follow.follow_rows` equals it after `program._follow`
    (which must take its PyTorch form). Runs on any device Triton can launch on."""
    from specserve.kernels.triton import follow as triton_follow

    g = torch.Generator().manual_seed(0)
    bs = program.batch_sizes[-2]  # below the largest: rows past bs must stay untouched too
    n = program.context_lens[-1]
    table = program.tables[n]
    device = table.device

    def rand(low, high, shape):
        return torch.randint(low, high, shape, generator=g).to(device)

    program._flat.copy_(rand(0, 10_000, program._flat.shape))
    program.follow[:bs] = rand(-1, program.max_bs, (bs,))  # rows of the last launch, which may have been larger
    program.follow[0], program.follow[1] = -1, program.max_bs - 1
    width = program.width
    program.last_packed[:, :width] = rand(0, 500, (program.max_bs, width))
    program.last_packed[:, width] = rand(0, width, (program.max_bs,))
    program.last_root[:] = rand(0, n, (program.max_bs,))  # some past the table: their pages clamp
    table[:] = rand(0, 100, table.shape).to(table.dtype)
    drafts = program.depth if hasattr(program, "depth") else program.k
    program.limit[:bs] = rand(0, drafts + 1, (bs,))
    before = program._flat.clone()
    program._follow(bs, n)
    expected = program._flat.clone()
    program._flat.copy_(before)
    triton_follow.follow_rows(program, bs, table[:bs])
    assert torch.equal(program._flat, expected)
    assert not torch.equal(expected, before)  # some row followed


@pytest.mark.parametrize("shape", ["chain", "tree", "tree-fused-topk"])
def test_programs_sample_unseeded_rows_without_syncs(tiny_checkpoint, tmp_path, monkeypatch, shape):
    """Unseeded sampled rows take the chain or tree program (eagerly, beside its graphs) under overlap, and
    launching such a step makes no host-device synchronisation (CUDA's sync debug mode turns any into an error).
    Greedy rows and top-k 1 rows equal HF's greedy output, fully sampled rows do not, and every page comes back."""
    from specserve.kernels.triton import topk as triton_topk

    monkeypatch.setattr(triton_topk, "ENABLED", shape == "tree-fused-topk")
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    spec = SpecConfig("EAGLE3", str(tmp_path), 3) if shape == "chain" else SpecConfig("EAGLE3", str(tmp_path), 4, 3, 9)
    config = replace(_tight_config(str(path), 200), device="cuda", spec=spec)
    engine, _ = build_engine_core(config, progress=False)
    assert engine.overlap
    program, launch, checked = engine.runner.spec_graphs, engine.runner.launch, []

    def launch_without_syncs(batch, publish=False):
        sampled_program = program.fits(batch) and not all(s.params.greedy for s in batch.seqs)
        torch.cuda.set_sync_debug_mode("error" if sampled_program else "default")
        try:
            return launch(batch, publish)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(sampled_program)

    engine.runner.launch = launch_without_syncs
    prompts = _prompts(512, seed=4)[:6]
    outputs = run_mixed_sampling(engine, prompts)
    reference = _hf_greedy(path, prompts, "cuda", max_tokens=24)
    assert [out == ref for out, ref in zip(outputs, reference)] == [True, True, False] * 2
    assert sum(checked) > 5
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages


@pytest.mark.parametrize("topk,num_draft_tokens", [(1, None), (3, 9)])
def test_adaptive_plan_with_graphs_and_overlap_matches_transformers(tiny_checkpoint, tmp_path, topk,
                                                                    num_draft_tokens):
    """The adaptive plan on a GPU: the gate opens and shuts (step costs from a model that makes drafting pay
    for a while, then not), so steps alternate between overlapped plain graphs and chain or tree programs,
    and the first drafting step after a shut spell catches the head up on many tokens. Greedy output equals
    HF's, and every page is freed."""
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = _prompts(512, seed=5)
    spec = SpecConfig("EAGLE3", str(tmp_path), 4, topk, num_draft_tokens, adaptive=True)
    engine, _ = build_engine_core(replace(_tight_config(str(path), 1200), device="cuda", spec=spec), progress=False)
    assert engine.overlap
    observe, clock = engine.observer.observe_step, [0]

    def phased_costs(drafted, size, seconds):
        clock[0] += 1
        drafting_pays = (clock[0] // 10) % 2 == 0
        observe(drafted, size, (0.5 if drafting_pays else 5.0) if drafted else 1.0)

    engine.observer.observe_step = phased_costs
    engine.observer.config = replace(engine.observer.config, probe_every=8, max_probe_every=8)
    general, backlogs = watch_drafting_paths(engine)
    program = engine.runner.spec_graphs
    plain_replays = engine.runner.graphs.num_replays
    outputs, _ = run_staggered(engine, prompts, max_tokens=40)
    assert outputs == _hf_greedy(path, prompts, "cuda", max_tokens=40)
    assert program.num_runs > 3 and engine.runner.graphs.num_replays > plain_replays + 3
    assert backlogs and not any(general)  # every drafting step after a shut spell was still the program
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages


def test_training_data_recorded_through_graphs_equals_eager_recording(tiny_checkpoint, tmp_path):
    """Datagen on a GPU replays decode graphs that also write the taps and hidden states; the samples
    equal those recorded with graphs off (an fp32 model; the rows are stored in bf16)."""
    from test_train_draft import _assert_same_samples, _recorded_samples

    path = tiny_checkpoint("llama")
    prompts = _prompts(512, seed=3)
    runs = []
    for disable in (False, True):
        config = replace(_tight_config(str(path), 4096), device="cuda", disable_cuda_graph=disable)
        samples, engine = _recorded_samples(config, (0, 1), prompts, tmp_path / str(disable))
        assert disable or engine.runner.graphs.num_replays > 0
        runs.append(samples)
    _assert_same_samples(runs[0], runs[1], 1e-2)


def test_training_on_a_gpu_keeps_samples_on_the_device_and_measures_held_out_agreement(tmp_path):
    """The trainer's GPU path: samples and held-out samples move to the device, bf16 autocast trains, and the
    held-out agreement is measured at each checkpoint."""
    from test_train_draft import _fake_samples, _Target

    from specserve.train.trainer import TrainConfig, Trainer, new_head

    torch.manual_seed(0)
    target = _Target().requires_grad_(False).cuda()
    cfg = TrainConfig(steps=4, batch_size=3, lr=1e-3, warmup_steps=1, ttt_steps=3, checkpoint_every=2)
    trainer = Trainer(new_head(target, torch.arange(40), 256, 0), target, _fake_samples(10, 0), cfg, tmp_path,
                      _fake_samples(4, 1))
    assert trainer.samples[0].taps.is_cuda and trainer.held_out[0].taps.is_cuda and len(trainer.held_out) == 4
    assert trainer.train(progress=False)
    assert [e["step"] for e in trainer.evals] == [2, 4]
    assert all(len(e["accuracy"]) == 3 for e in trainer.evals)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_and_rotary_store_match_the_eager_math(dtype):
    """The residual add folded into RMSNorm, two norms side by side, and the KV store folded into rotary, against
    the unfused math."""
    from specserve.kernels import pointwise
    from specserve.kernels.triton import pointwise as triton_pointwise
    from specserve.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    x, res = (torch.randn(7, 576, device="cuda", dtype=dtype) for _ in range(2))
    weight = torch.rand(576, device="cuda", dtype=dtype) + 0.5
    normed, summed = triton_pointwise.rms_norm(x, weight, 1e-5, res)
    expected_sum = x + res
    xf = expected_sum.float()
    expected = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(summed, expected_sum)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(normed, expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(triton_pointwise.rms_norm(x, weight, 1e-5), pointwise._EAGER["rms_norm"](
        x.cpu(), weight.cpu(), 1e-5).cuda(), atol=tolerance, rtol=tolerance)
    check_rms_norm_pair("cuda", dtype, tolerance)  # an EAGLE-3 head's two input norms in one kernel

    heads, kv_heads, dim, tokens = 9, 3, 64, 5  # head counts that are not powers of two
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda", dtype=dtype)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    cache = torch.zeros(2, 40, kv_heads, dim, device="cuda", dtype=dtype)
    positions = torch.tensor([0, 3, 100, 7, 2], device="cuda")
    slots = torch.tensor([39, 1, 17, 5, 0], device="cuda")
    cos_sin = RotaryEmbedding(dim, 128, 10000.0, None).cos_sin.cuda()
    q_rot, k_rot = triton_pointwise.rotary_store(positions, cos_sin, q, k, v, cache, slots)
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    expected_q, expected_k = pointwise._rotate(q, cos, sin), pointwise._rotate(k, cos, sin)
    # Within a rounding: the kernel may fuse a multiply-add that eager rounds twice.
    torch.testing.assert_close(q_rot, expected_q, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(k_rot, expected_k, atol=tolerance, rtol=tolerance)
    assert torch.equal(cache[0, slots], k_rot) and torch.equal(cache[1, slots], v)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not cache[:, untouched.cuda()].any()


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (4096, 4096), (1000, 200)])
def test_triton_gemv_matches_cublas(rows, shape, monkeypatch):
    """Every tile shape the chooser may pick, plain and in the gate/up form (SiLU-and-multiply applied to the
    two halves' outputs before they are stored), on shapes that divide the tiles and shapes that do not; and
    with several-row kernels letting the next launch halfway through their loop (SPECSERVE_GEMV_TRIGGER_AT)."""
    from specserve.kernels.triton import gemv as triton_gemv, pointwise as triton_pointwise

    torch.manual_seed(rows)
    weight = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) / shape[1] ** 0.5
    x = torch.randn(rows, shape[1], device="cuda", dtype=torch.bfloat16)
    reference = x.float() @ weight.float().T
    gated_reference = triton_pointwise.silu_and_mul((x @ weight.T)).float()
    gated_tiles = 0
    for tile in _every_tile(rows, shape[1]):
        torch.testing.assert_close(triton_gemv.gemv(x, weight, tile).float(), reference, atol=2e-2, rtol=2e-2)
        gated = _gate_up_or_none(x, weight, tile)
        if gated is not None:
            assert gated.shape == (rows, shape[0] // 2)
            torch.testing.assert_close(gated.float(), gated_reference, atol=2e-2, rtol=2e-2)
            gated_tiles += 1
    assert gated_tiles >= 5
    tma_here = triton_gemv.TensorDescriptor is not None and triton_gemv._has_tma(weight.device)
    if triton_gemv.TMA_ON and rows > 1 and tma_here:
        assert triton_gemv._tma_ok(weight), "the TMA tiles above ran with ordinary loads"
    if rows > 1:  # results only: they cannot show where the trigger fell (tests/test_triton_host.py does)
        monkeypatch.setattr(triton_gemv, "TRIGGER_AT", 0.5)
        for tile in _every_tile(rows, shape[1]):
            torch.testing.assert_close(triton_gemv.gemv(x, weight, tile).float(), reference, atol=2e-2, rtol=2e-2)
        monkeypatch.undo()
    choice = triton_gemv.Choice()  # no decisions file: the shipped ones hold some of these shapes untimed
    tile = choice.tile(x, weight)
    assert tile is None or isinstance(tile, triton_gemv.Tile)
    assert "cublas" in choice.timings[choice.key(x, weight)]


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_fp8_weights_in_the_gemv_match_their_dequantized_values(rows):
    """A Linear quantized to fp8 (a draft head's --speculative-draft-model-quantization fp8) computes with the
    values it holds, e4m3 times a scale per row: every tile (the TMA ones with ordinary loads), plain and in
    the gate/up form, with a norm folded in and with a residual, then the chooser's pick through the Linear (in
    inference mode, as steps run: with autograd on it takes PyTorch's matmul), eagerly and in a CUDA graph."""
    from specserve.kernels.triton import gemv as triton_gemv, pointwise as triton_pointwise
    from specserve.layers.linear import FP8, Linear

    torch.manual_seed(rows)
    for out_features, in_features in ((4096, 4096), (1000, 200)):
        linear = Linear(in_features, out_features, bias=False, device="cuda", dtype=torch.bfloat16)
        torch.nn.init.normal_(linear.weight, std=in_features**-0.5)
        linear.quantize_fp8()
        assert linear.weight.dtype == FP8 and linear.input_dtype == torch.bfloat16
        values = linear.weight.float() * linear.weight_scale[:, None]
        x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
        gamma = torch.rand(in_features, device="cuda", dtype=torch.bfloat16) + 0.5
        residual = torch.randn(rows, out_features, device="cuda", dtype=torch.bfloat16)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * gamma.float()
        reference = x.float() @ values.T
        gated_reference = triton_pointwise.silu_and_mul(reference.to(torch.bfloat16)).float()
        scale = linear.weight_scale
        for tile in _every_tile(rows, in_features, fp8=True):
            out = triton_gemv.gemv(x, linear.weight, tile, scale=scale)
            torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)
            added = triton_gemv.gemv(x, linear.weight, tile, residual=residual, scale=scale)
            torch.testing.assert_close(added.float(), reference + residual.float(), atol=3e-2, rtol=2e-2)
            folded = triton_gemv.gemv(x, linear.weight, tile, gamma, 1e-5, scale=scale)
            torch.testing.assert_close(folded.float(), normed @ values.T, atol=3e-2, rtol=2e-2)
            gated = _gate_up_or_none(x, linear.weight, tile, scale=scale)
            if gated is not None:
                torch.testing.assert_close(gated.float(), gated_reference, atol=2e-2, rtol=2e-2)
        triton_gemv.decide_all(linear)
        with torch.inference_mode():
            assert linear.gemv_tile(x) is not None or out_features != 4096  # the H200's shipped decisions: a tile
            torch.testing.assert_close(linear(x).float(), reference, atol=2e-2, rtol=2e-2)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = linear(x)
            graph.replay()
            torch.testing.assert_close(replayed.float(), reference, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bits", [True, False], ids=["moved-bits", "triton-conversion"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_weights_widen_to_their_exact_values_for_every_code(dtype, bits, monkeypatch):
    """Several-row GEMVs widen fp8 weights by moving bits on sm_90 on (triton_gemv._widen), or by Triton's
    conversion (SPECSERVE_GEMV_FP8_BITS=0, as one-row GEMVs do): every e4m3 code but the two NaNs, at each of the
    four places in a 32-bit word, must come out as its exact value (subnormals, zeros and signs included). Row n
    of the weight holds the codes n, n+1, ... (mod 256), and each of x's rows picks one column (the first four:
    each place in a word), so each output is one weight times 1, exact in fp32 and in bf16 and fp16."""
    from specserve.kernels.triton import gemv as triton_gemv
    from specserve.layers.linear import FP8

    if bits and not triton_gemv._sm90_or_later(torch.cuda.current_device()):
        pytest.skip("moving bits needs sm_90 (bf16x2 multiply)")
    monkeypatch.setattr(triton_gemv, "FP8_BITS", bits)
    codes = (torch.arange(256)[:, None] + torch.arange(512)[None, :]) % 256
    codes[(codes & 0x7F) == 0x7F] = 0
    weight = codes.to(torch.uint8).view(FP8).cuda()
    values = weight.float()
    scale = torch.ones(256, device="cuda")
    columns = torch.tensor([0, 1, 2, 3, 5, 6, 7, 8, 130, 131, 257, 258, 384, 509, 510, 511], device="cuda")
    x = torch.nn.functional.one_hot(columns, 512).to(dtype)
    for tile in _every_tile(16, 512):
        out = triton_gemv.gemv(x, weight, tile, scale=scale).float()
        assert torch.equal(out, values[:, columns].T), tile
    for tile in _every_tile(1, 512, fp8=True):  # one row: Triton's conversion either way
        out = triton_gemv.gemv(x[1:2], weight, tile, scale=scale).float()
        assert torch.equal(out, values[:, columns[1:2]].T), tile


def test_eagle3_programs_with_an_fp8_head_match_transformers(tiny_checkpoint, tmp_path):
    """A head quantized to fp8 drafts with other numbers; the output never changes: the chain and tree programs,
    replayed in graphs, equal HF greedy (fp32, where the head's fp8 weights are widened for PyTorch's matmul)."""
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = _prompts(512, seed=5)
    for spec_args in ((3,), (4, 3, 9)):
        spec = SpecConfig("EAGLE3", str(tmp_path), *spec_args, draft_model_quantization="fp8")
        engine, _ = build_engine_core(replace(_tight_config(str(path), 200), device="cuda", spec=spec), progress=False)
        assert engine.runner.proposer.drafter.head.fc.weight.dtype == torch.float8_e4m3fn
        outputs, _ = run_staggered(engine, prompts)
        program = engine.runner.spec_graphs
        assert program.num_runs > 3 and program.graphs
        assert outputs == _hf_greedy(path, prompts, "cuda")


def _every_tile(rows: int, width: int, fp8: bool = False):
    """Every tile the kernel takes for `rows` of a `width`-wide weight, whether the chooser times it for every
    form or not; the TMA tiles where they are on (SPECSERVE_GEMV_TMA, on by default), and the split ones whose
    splits all get columns; with `fp8`, one row's for fp8 weights too."""
    from specserve.kernels.triton import gemv as triton_gemv

    if rows == 1:
        return triton_gemv.ONE_ROW_TILES + (triton_gemv.FP8_ONE_ROW_TILES if fp8 else [])
    tma = triton_gemv.TMA_TILES + triton_gemv.SPLIT_TMA_TILES if triton_gemv.TMA_ON else []
    tiles = triton_gemv.ROWS_TILES + triton_gemv.SWAP_TILES + triton_gemv.SPLIT_ROWS_TILES + tma
    return [tile for tile in tiles if triton_gemv.split_fits(width, tile)]


def _gate_up_or_none(x, weight, tile, **kwargs):
    """The gate/up form, or None where the tile outgrows shared memory in it (it streams two weight tiles;
    the chooser skips such tiles the same way)."""
    import triton

    from specserve.kernels.triton import gemv as triton_gemv

    try:
        return triton_gemv.gemv(x, weight, tile, gate_up=True, **kwargs)
    except triton.runtime.errors.OutOfResources:
        return None


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("shape", [(960, 576), (4096, 4096), (1000, 200)])
def test_triton_gemv_folds_rmsnorm_and_residual_add(rows, shape):
    """gemv(x, W, norm_weight, residual) = W @ RMSNorm(x) + residual, for every tile, against the unfused
    math in fp32 from the same bf16 inputs (the fold rounds less: no bf16 normed input in between); and the
    gate/up form with the norm folded in."""
    from specserve.kernels.triton import gemv as triton_gemv, pointwise as triton_pointwise

    torch.manual_seed(rows)
    weight = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) / shape[1] ** 0.5
    x = torch.randn(rows, shape[1], device="cuda", dtype=torch.bfloat16) * 3
    gamma = torch.rand(shape[1], device="cuda", dtype=torch.bfloat16) + 0.5
    residual = torch.randn(rows, shape[0], device="cuda", dtype=torch.bfloat16)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma.float()
    reference = normed @ weight.float().T
    gated_reference = triton_pointwise.silu_and_mul(reference.to(torch.bfloat16)).float()
    moved = (weight.float() * gamma.float()).to(torch.bfloat16)
    for tile in _every_tile(rows, shape[1]):
        folded = triton_gemv.gemv(x, weight, tile, norm_weight=gamma, eps=1e-5)
        torch.testing.assert_close(folded.float(), reference, atol=2e-2, rtol=2e-2)
        added = triton_gemv.gemv(x, weight, tile, residual=residual)
        torch.testing.assert_close(added.float(), xf @ weight.float().T + residual.float(), atol=3e-2, rtol=2e-2)
        gated = _gate_up_or_none(x, weight, tile, norm_weight=gamma, eps=1e-5)
        if gated is not None:
            torch.testing.assert_close(gated.float(), gated_reference, atol=3e-2, rtol=2e-2)
        # The norm's weight moved into W (SPECSERVE_NORM_IN_WEIGHTS): the kernel only scales by 1 / rms(x).
        folded = triton_gemv.gemv(x, moved, tile, eps=1e-5, norm=True)
        torch.testing.assert_close(folded.float(), reference, atol=2e-2, rtol=2e-2)
        gated = _gate_up_or_none(x, moved, tile, eps=1e-5, norm=True)
        if gated is not None:
            torch.testing.assert_close(gated.float(), gated_reference, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("in_weights", [False, True], ids=["norm-weights-apart", "norm-weights-in-projections"])
@pytest.mark.parametrize("rows", [1, 4])
def test_decoder_layers_with_folded_norms_match_the_unfolded_layers(tiny_checkpoint, monkeypatch, rows, in_weights):
    """A bf16 step of one row (decode) or four (a chain verify of three drafts) through the whole model, with
    norms and adds folded into the GEMVs and with separate norm kernels: each form's hidden states, taps and
    logits against the same step in fp32. With `in_weights` the bf16 model's norm weights are moved into its
    projections at load (SPECSERVE_NORM_IN_WEIGHTS), so the folds only scale by the reciprocal RMS."""
    from specserve.layers import linear
    from specserve.kernels.triton import gemv as triton_gemv

    monkeypatch.setattr(linear, "NORM_IN_WEIGHTS", in_weights)
    # A fresh choice that always takes a tile: the tiny shapes may time faster in cuBLAS.
    monkeypatch.setattr(triton_gemv, "choice", triton_gemv.Choice())
    monkeypatch.setattr(triton_gemv, "CUBLAS_MARGIN", float("inf"))
    monkeypatch.setattr(triton_gemv, "NORM_APART_ON", False)  # nor the norm apart
    path = tiny_checkpoint("llama", True)
    prompt = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.inference_mode():
        model, step = _prefilled_step(path, "bfloat16", prompt, rows)
        qkv_proj = model.layers[0].self_attn.qkv_proj
        assert qkv_proj.norm_in_weight == in_weights
        assert qkv_proj.folds_norm(torch.zeros(rows, model.config.hidden_size, device="cuda",
                                               dtype=torch.bfloat16)), "the tiny model's GEMVs should fold"
        gemv, fold_gammas = triton_gemv.gemv, []

        def recording_gemv(x, weight, tile, norm_weight=None, *args, **kwargs):
            if kwargs.get("norm"):
                fold_gammas.append(norm_weight)
            return gemv(x, weight, tile, norm_weight, *args, **kwargs)

        monkeypatch.setattr(triton_gemv, "gemv", recording_gemv)
        folded = step()
        # Moved, the folds scale by 1 / rms(x) alone; apart, they take the norm's weight.
        assert fold_gammas and all((gamma is None) == in_weights for gamma in fold_gammas)
        monkeypatch.setattr(linear, "FOLD_NORMS", False)
        unfolded = step()
        exact = _prefilled_step(path, "float32", prompt, rows)[1]()
    # Both bf16 forms carry the rounding of bf16 weights and activations, which grows through the layers (the
    # residual stream reaches |60| here, where one bf16 step is 0.25), and they round in different places (the
    # fold rounds the normed input and the o_proj/down outputs to bf16 once less; at several rows it rounds
    # the input times the norm's weight before the reciprocal RMS; with that weight moved into the projection,
    # the projection's weight is rounded once more instead), so neither equals the other or fp32: on
    # the H200 the folded 4-row step's first tap was off by 1.69 at most, the unfolded one's by 0.76. So each
    # tensor's error is measured as a whole, |a - ref| / |ref|, and held to 10 %. Measured on a CPU with this
    # checkpoint and prompt (PyTorch's bf16 path): 1-2 % at one row and at four; with one layer's norm weight
    # dropped, 35-45 %. (The same steps in fp32 through the GEMV kernels, run by Triton's interpreter on a
    # CPU with the kernel's dtype check widened to fp32 and the layers' GPU path copied into that script,
    # agree with plain PyTorch to 1e-4 at one row and at four, folded and unfolded.)
    for name, a, b, ref in zip(["hidden", "tap 0", "tap 1", "logits"], [folded[0], *folded[1], folded[2]],
                               [unfolded[0], *unfolded[1], unfolded[2]], [exact[0], *exact[1], exact[2]]):
        for form, out in (("folded", a), ("unfolded", b)):
            error = ((out.float() - ref).norm() / ref.norm()).item()
            assert error <= 0.1, (name, form, error)
    assert not torch.equal(folded[1][1], unfolded[1][1])  # the two forms did run


def _prefilled_step(path, dtype: str, prompt: torch.Tensor, rows: int):
    """The model of an engine on the checkpoint in `dtype`, with `prompt` prefilled on pages 0-1, and a step
    of `rows` tokens after it (returning hidden states, the taps of layers 0 and 1, and logits)."""
    from specserve.engine.factory import build_engine_core
    from specserve.layers.attention import AttentionMetadata

    config = replace(_tight_config(str(path), max_total_tokens=200), device="cuda", dtype=dtype,
                     disable_cuda_graph=True)
    engine, _ = build_engine_core(config, progress=False)
    model, kv_cache = engine.runner.model, engine.runner.kv_cache
    n = prompt.shape[0]
    model(prompt, torch.arange(n, device="cuda"), AttentionMetadata.build([n], [0], [[0, 1]], 8, prompt.device),
          kv_cache)

    def step():
        meta = AttentionMetadata.build([rows], [n], [[0, 1]], 8, prompt.device)
        ids, pos = torch.arange(7, 7 + rows, device="cuda"), torch.arange(n, n + rows, device="cuda")
        hidden, taps = model(ids, pos, meta, kv_cache, (0, 1))
        return hidden, taps, model.compute_logits(hidden)

    return model, step


@pytest.mark.parametrize("in_weights", [False, True], ids=["norm-weights-apart", "norm-weights-in-projections"])
def test_serving_steps_never_time_gemv_shapes(tiny_checkpoint, monkeypatch, in_weights):
    """With CUDA graphs the GEMV choices are made at startup, the eager draft model's included; a shape still
    undecided when a step runs takes cuBLAS (timing it clones the weight, captures a graph and synchronises
    mid-step). Outside steps it is timed as before. With the norm weights moved into the projections
    (SPECSERVE_NORM_IN_WEIGHTS), startup decides the forms without the norm's weight in the kernel."""
    from specserve.kernels.triton import gemv as triton_gemv
    from specserve.layers import linear as linear_module
    from specserve.layers.linear import Linear

    monkeypatch.setattr(linear_module, "NORM_IN_WEIGHTS", in_weights)
    path = tiny_checkpoint("llama", True)
    spec = SpecConfig("DRAFT_MODEL", str(path), 3)
    config = replace(_tight_config(str(path), max_total_tokens=400), device="cuda", dtype="bfloat16", spec=spec)
    engine, _ = build_engine_core(config, progress=False)
    draft = engine.runner.proposer.drafter.model
    assert draft.layers[0].mlp.gate_up_proj.norm_in_weight == in_weights
    for name, linear in draft.named_modules():
        if isinstance(linear, Linear):
            x = torch.zeros(16, linear.in_features, device="cuda", dtype=torch.bfloat16)
            for rows in triton_gemv.ROW_BUCKETS:
                for norm in (False, True) if linear.takes_norm and linear_module.FOLD_NORMS else (False,):
                    key = triton_gemv.choice.key(x[:rows], linear.weight, linear.gated, norm,
                                                 gamma=not linear.norm_in_weight)
                    assert key in triton_gemv.choice.best, name
    timed = []
    monkeypatch.setattr(triton_gemv.choice, "best", {})  # every shape undecided again
    monkeypatch.setattr(triton_gemv.Choice, "_measure", lambda self, key, *args: timed.append(key))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((3, 40, 9)):
        engine.add_request(str(i), list(range(10, 10 + n)), params)
    produced = {}
    while engine.has_work():
        for delta in engine.step():
            produced.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert len(produced) == 3 and all(len(tokens) == 6 for tokens in produced.values()) and timed == []
    weight = engine.runner.model.layers[0].mlp.down_proj.weight
    triton_gemv.choice.tile(torch.randn(2, weight.shape[1], device="cuda", dtype=weight.dtype), weight)
    assert len(timed) == 1


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

        weight = torch.randn(32000, 4096, device="cuda", dtype=dtype)
        x = torch.randn(4, 4096, device="cuda", dtype=dtype)
        tile = triton_gemv.ROWS_TILES[5]
        argmax(triton_gemv.gemv(x, weight, tile))  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = triton_gemv.gemv(x, weight, tile)
            graphed = argmax(logits)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            assert torch.equal(graphed, logits.argmax(dim=-1))


def test_eagle3_head_logits_fold_its_norm_and_map_drafts_in_bf16(monkeypatch):
    """An EAGLE-3 head's logits in bf16 with its final norm folded into the lm_head GEMV (a chooser that always
    takes a tile, so the fold runs at every row count), against the norm and the product apart in fp32; and the
    chain's argmax with the draft-to-target offsets against `to_target_ids` of torch.argmax."""
    from specserve.config import ModelConfig
    from specserve.kernels import pointwise
    from specserve.kernels.triton import gemv as triton_gemv
    from specserve.sampling.sampler import argmax
    from specserve.models.eagle3 import Eagle3Config, Eagle3Head

    monkeypatch.setattr(triton_gemv, "choice", triton_gemv.Choice())
    monkeypatch.setattr(triton_gemv, "CUBLAS_MARGIN", float("inf"))
    monkeypatch.setattr(triton_gemv, "NORM_APART_ON", False)
    cfg = ModelConfig("LlamaForCausalLM", 2000, 512, 1024, 1, 8, 2, 64, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config(cfg, 1000, 512, (0, 0, 0)), 256).cuda().to(torch.bfloat16)
    with torch.inference_mode():
        head.lm_head.weight.normal_(0, 512**-0.5)
        head.norm.weight.uniform_(0.5, 1.5)
        head.d2t.copy_(torch.randint(0, 1000, (1000,)))
        for rows in (1, 4):
            hidden = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16) * 3
            assert head.lm_head.folds_norm(hidden)
            logits = head.compute_logits(hidden)
            xf = hidden.float()
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * head.norm.weight.float()
            torch.testing.assert_close(logits.float(), normed @ head.lm_head.weight.float().T, atol=3e-2, rtol=2e-2)
            unfolded = head.lm_head(pointwise.rms_norm(hidden, head.norm.weight, 1e-5))
            assert torch.equal(argmax(unfolded, head.d2t), head.to_target_ids(unfolded.argmax(dim=-1)))


def test_gemv_decisions_shipped_for_this_gpu_are_taken_without_timing(monkeypatch):
    """Unless SPECSERVE_GEMV_CHOICES says otherwise, a GPU with decisions shipped in the package takes them
    (on an H200: the 8B chain verify's 4-row ones), and a GPU without any times the shape. A chooser switch off
    its default (here the swapped tiles) sets them aside, and so does SPECSERVE_GEMV_CHOICES=0."""
    import os

    from specserve.kernels.tuning import choices as gemv_choices

    from specserve.kernels.triton import gemv as triton_gemv

    if "SPECSERVE_GEMV_CHOICES" not in os.environ:
        assert triton_gemv.CHOICES_FILE == "shipped"
    name = torch.cuda.get_device_name()
    shipped = gemv_choices.shipped(name)
    weight = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")  # an 8B attention output
    x = torch.randn(4, 4096, dtype=torch.bfloat16, device="cuda")
    choice = triton_gemv.Choice("shipped")
    tile = choice.tile(x, weight)
    key = choice.key(x, weight)
    if shipped is None or not triton_gemv.chooser_at_defaults():  # an A/B switch set off its default
        assert key in choice.timings and choice.saved is None
    else:
        assert key not in choice.timings and tile == gemv_choices.load(shipped, name)[key]
        assert choice.saved == f"shipped: {shipped.name}"
    for saved in ("0", "none", "OFF", ""):
        choice = triton_gemv.Choice(saved)
        choice.tile(x, weight)
        assert key in choice.timings and choice.saved is None, saved
    monkeypatch.setattr(triton_gemv, "SWAP_CANDIDATES", False)
    choice = triton_gemv.Choice("shipped")
    choice.tile(x, weight)
    assert key in choice.timings and choice.saved is None


def test_gemv_decisions_from_a_file_are_taken_without_timing(tmp_path):
    """SPECSERVE_GEMV_CHOICES: a decision saved for this GPU is used as saved and not timed; a shape the file
    lacks is timed as usual."""
    from specserve.kernels.tuning import choices as gemv_choices
    from specserve.kernels.triton import gemv as triton_gemv

    weight = torch.randn(256, 512, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(4, 512, dtype=torch.bfloat16, device="cuda")
    key = triton_gemv.Choice.key(x, weight)
    odd_tile = triton_gemv.ROWS_TILES[0]  # whatever timing would say
    path = tmp_path / "choices.json"
    gemv_choices.save({key: odd_tile}, path, torch.cuda.get_device_name())
    choice = triton_gemv.Choice(str(path))
    assert choice.tile(x, weight) == odd_tile and key not in choice.timings
    other_weight = torch.randn(128, 512, dtype=torch.bfloat16, device="cuda")
    choice.tile(x, other_weight)
    assert choice.key(x, other_weight) in choice.timings
