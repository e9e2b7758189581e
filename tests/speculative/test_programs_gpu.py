"""The chain and tree step programs on a GPU, in graphs and eagerly, in each of their forms, with an fp8 head
and with sampled rows: greedy output equals transformers'; the following-rows kernel writes what the
PyTorch form writes."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specserve.config import SpecConfig
from specserve.engine.factory import build_engine_core

from engine_runs import hf_greedy, make_prompts, run_mixed_sampling, run_staggered, tight_config
from tiny_checkpoints import write_peaked_random_head

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("new_forms", [False, True], ids=["tails-per-row-pytorch-search", "one-block-fused-search"])
def test_eagle3_tree_program_forms_match_transformers(tiny_checkpoint, tmp_path, switches, new_forms):
    """The tree program, in graphs and eagerly, gives HF's greedy output with its verified tree's tails attended
    a block per row or as one block (SPECSERVE_CLOSED_TAILS), and its search's bookkeeping in PyTorch or in
    Triton kernels (SPECSERVE_FUSED_SEARCH): both on by default."""
    switches(closed_tails=new_forms, fused_search=new_forms)
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = make_prompts(512, seed=5)
    for disable in (False, True):
        spec = SpecConfig("EAGLE3", str(tmp_path), 4, 3, 9)
        config = replace(tight_config(str(path), 200), device="cuda", spec=spec, disable_cuda_graph=disable)
        engine, _ = build_engine_core(config, progress=False)
        outputs, _ = run_staggered(engine, prompts)
        program = engine.runner.program
        assert program.num_runs > 3 and program.fused == new_forms
        assert outputs == hf_greedy(path, prompts, "cuda")


@pytest.mark.parametrize("fused_topk", [False, True], ids=["pytorch-topk", "fused-topk"])
@pytest.mark.parametrize("simulate", [None, 2.5])
def test_eagle3_tree_program_in_graphs_matches_eager_and_transformers(tiny_checkpoint, tmp_path, switches,
                                                                      simulate, fused_topk):
    """EAGLE-2 tree steps replayed as one graph each equal the same program run eagerly, and (greedy) HF; with
    the search's top-k in PyTorch or in the fused kernels (SPECSERVE_FUSED_TOPK)."""
    from specserve.speculative.programs.tree import TreeGraphs

    switches(fused_topk=fused_topk)

    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = make_prompts(512, seed=5)
    runs = []
    for disable in (False, True):
        spec = SpecConfig("EAGLE3", str(tmp_path), 4, 3, 9, simulate_accept_len=simulate)
        config = replace(tight_config(str(path), 200), device="cuda", spec=spec, disable_cuda_graph=disable)
        engine, _ = build_engine_core(config, progress=False)
        outputs, _ = run_staggered(engine, prompts)
        tree = engine.runner.program
        assert isinstance(tree, TreeGraphs) and tree.num_runs > 3 and bool(tree.graphs) != disable
        alloc = engine.scheduler.allocator
        assert alloc.num_free == alloc.num_pages
        runs.append(outputs)
    assert runs[0] == runs[1]
    if simulate is None:
        assert runs[0] == hf_greedy(path, prompts, "cuda")


@pytest.mark.parametrize("shared", [False, True], ids=["rows-apart", "shared-context"])
@pytest.mark.parametrize("simulate", [None, 2.5])
def test_eagle3_chain_program_in_graphs_matches_eager_and_transformers(tiny_checkpoint, tmp_path, switches,
                                                                       simulate, shared):
    """EAGLE-3 chain steps replayed as one graph each equal the same program run eagerly, and (greedy) HF; with
    each sequence's rows attending apart and as one run over a shared context (SPECSERVE_CHAIN_SHARED_CONTEXT)."""
    switches(chain_shared_context=shared)
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = make_prompts(512, seed=5)
    runs = []
    for disable in (False, True):
        spec = SpecConfig("EAGLE3", str(tmp_path), 3, simulate_accept_len=simulate)
        config = replace(tight_config(str(path), 200), device="cuda", spec=spec, disable_cuda_graph=disable)
        engine, _ = build_engine_core(config, progress=False)
        outputs, _ = run_staggered(engine, prompts)
        chain = engine.runner.program
        assert chain.num_runs > 3 and bool(chain.graphs) != disable
        runs.append(outputs)
    assert runs[0] == runs[1]
    if simulate is None:
        assert runs[0] == hf_greedy(path, prompts, "cuda")


@pytest.mark.parametrize("spec_args", [(3,), (1,), (4, 3, 9)], ids=["chain", "chain-of-one", "tree"])
def test_following_rows_from_one_kernel_equal_the_pytorch_form(tiny_checkpoint, tmp_path, switches, spec_args):
    """The fused kernel (kernels/triton/follow.py) writes what SpecGraphs._follow's PyTorch form writes."""
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    config = replace(tight_config(str(path), 200), device="cuda", spec=SpecConfig("EAGLE3", str(tmp_path), *spec_args),
                     disable_cuda_graph=True)
    engine, _ = build_engine_core(config, progress=False)
    switches(fused_follow=False)
    check_fused_follow(engine.runner.program)


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
def test_programs_sample_unseeded_rows_without_syncs(tiny_checkpoint, tmp_path, switches, shape):
    """Unseeded sampled rows take the chain or tree program (eagerly, beside its graphs) under overlap, and
    launching such a step makes no host-device synchronisation (CUDA's sync debug mode turns any into an error).
    Greedy rows and top-k 1 rows equal HF's greedy output, fully sampled rows do not, and every page comes back."""
    switches(fused_topk=shape == "tree-fused-topk")
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    spec = SpecConfig("EAGLE3", str(tmp_path), 3) if shape == "chain" else SpecConfig("EAGLE3", str(tmp_path), 4, 3, 9)
    config = replace(tight_config(str(path), 200), device="cuda", spec=spec)
    engine, _ = build_engine_core(config, progress=False)
    assert engine.overlap
    program, launch, checked = engine.runner.program, engine.runner.launch, []

    def launch_without_syncs(batch, publish=False):
        sampled_program = program.fits(batch) and not all(s.params.greedy for s in batch.seqs)
        torch.cuda.set_sync_debug_mode("error" if sampled_program else "default")
        try:
            return launch(batch, publish)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(sampled_program)

    engine.runner.launch = launch_without_syncs
    prompts = make_prompts(512, seed=4)[:6]
    outputs = run_mixed_sampling(engine, prompts)
    reference = hf_greedy(path, prompts, "cuda", max_tokens=24)
    assert [out == ref for out, ref in zip(outputs, reference)] == [True, True, False] * 2
    assert sum(checked) > 5
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages


def test_eagle3_programs_with_an_fp8_head_match_transformers(tiny_checkpoint, tmp_path):
    """A head quantized to fp8 drafts with other numbers; the output never changes: the chain and tree programs,
    replayed in graphs, equal HF greedy (fp32, where the head's fp8 weights are widened for PyTorch's matmul)."""
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = make_prompts(512, seed=5)
    for spec_args in ((3,), (4, 3, 9)):
        spec = SpecConfig("EAGLE3", str(tmp_path), *spec_args, draft_model_quantization="fp8")
        engine, _ = build_engine_core(replace(tight_config(str(path), 200), device="cuda", spec=spec), progress=False)
        assert engine.runner.proposer.drafter.head.fc.weight.dtype == torch.float8_e4m3fn
        outputs, _ = run_staggered(engine, prompts)
        program = engine.runner.program
        assert program.num_runs > 3 and program.graphs
        assert outputs == hf_greedy(path, prompts, "cuda")
