"""The paged decode attention kernel on a GPU against its PyTorch forms: whole contexts, contexts cut into
slices, draft-tree tails (a block per row and one block per tree), and nothing compiled after the warm-up."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernel_checks import check_closed_tail_attention, check_tail_attention

pytestmark = pytest.mark.gpu


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
