"""The reference paged attention: a step that mixes decode rows, a draft tree and prefill chunks is split into
one padded SDPA call for the short rows and one per long chunk; the result equals attending each sequence
alone over its own contiguous keys."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.layers import attention
from specserve.layers.attention import AttentionMetadata, paged_attention

HEADS, KV_HEADS, DIM, PAGE = 4, 2, 8, 4


def _dense_reference(q, k_ctx, v_ctx, start, mask=None):
    """Sequence attention with its whole context as dense tensors: causal unless `mask` ([q, q]) is given."""
    n = q.shape[0]
    allowed = torch.ones(n, start + n, dtype=torch.bool).tril(start)
    if mask is not None:
        allowed[:, start:] = mask
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_ctx.transpose(0, 1)[None],
                                         v_ctx.transpose(0, 1)[None], attn_mask=allowed[None, None],
                                         scale=DIM ** -0.5, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(n, HEADS * DIM)


TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


@pytest.mark.parametrize("seqs,tree_at,num_groups,fresh_groups", [
    # (query tokens this step, tokens already in the cache): prefill chunks of two sizes around decode rows
    # and a 4-node tree; the two 40-token chunks share a call.
    ([(40, 0), (1, 9), (1, 30), (4, 12), (23, 17), (40, 3)], 3, 3, 0),
    # Fresh prompts attend to their own keys, no gather: one length (causal) and mixed lengths (masked).
    ([(40, 0), (1, 0), (40, 0), (33, 0), (5, 0)], None, 2, 2),
    ([(24, 0), (24, 0)], None, 1, 1),
])
# With the decode kernel (a GPU's default), single-query rows leave the SDPA calls for the kernel, whose
# PyTorch contract runs here; the groups keep their count, as each case has other short rows.
@pytest.mark.parametrize("decode_kernel", [False, True])
def test_mixed_steps_attend_like_each_sequence_alone(seqs, tree_at, num_groups, fresh_groups, decode_kernel):
    g = torch.Generator().manual_seed(0)
    tree = TREE
    pages, next_page = [], 1
    for q, start in seqs:
        need = -(-(q + start) // PAGE)
        pages.append(list(range(next_page, next_page + need))[::-1])  # scattered, reversed pages
        next_page += need
    cache = torch.zeros(2, (next_page + 1) * PAGE, KV_HEADS, DIM)
    contexts = []
    for (q, start), table in zip(seqs, pages):
        k, v = torch.randn(2, start + q, KV_HEADS, DIM, generator=g)
        slots = torch.tensor([table[p // PAGE] * PAGE + p % PAGE for p in range(start)], dtype=torch.long)
        cache[0, slots], cache[1, slots] = k[:start], v[:start]
        contexts.append((k, v))
    query_lens, starts = [q for q, _ in seqs], [s for _, s in seqs]
    meta = AttentionMetadata.build(query_lens, starts, pages, PAGE, torch.device("cpu"),
                                   tree_masks=[tree if b == tree_at else None for b in range(len(seqs))],
                                   decode_kernel=decode_kernel)
    assert len(meta.groups) == num_groups
    singles = sum(q == 1 for q, _ in seqs)
    assert (0 if meta.decode_rows is None else len(meta.decode_rows.tokens)) == (singles if decode_kernel else 0)
    assert sum(group.self_attention for group in meta.groups) == fresh_groups
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=g)
    new_k = torch.cat([k[s:] for (k, _), s in zip(contexts, starts)])
    new_v = torch.cat([v[s:] for (_, v), s in zip(contexts, starts)])
    out = paged_attention(q, new_k, new_v, cache, meta, DIM ** -0.5)
    row = 0
    for b, ((n, start), (k, v)) in enumerate(zip(seqs, contexts)):
        expected = _dense_reference(q[row:row + n], k, v, start, tree if b == tree_at else None)
        torch.testing.assert_close(out[row:row + n], expected, rtol=1e-5, atol=1e-5)
        row += n


def test_a_step_of_decode_rows_alone_goes_to_the_kernel_whole():
    """Every row a single query (an eager decode step on a GPU): no SDPA group at all, the same answer."""
    g = torch.Generator().manual_seed(2)
    query_lens, starts, pages = [1, 1, 1], [9, 0, 30], [[3, 4, 5], [1], [6, 7, 8, 9, 10, 11, 12, 13]]
    cache = torch.randn(2, 14 * PAGE, KV_HEADS, DIM, generator=g)
    q = torch.randn(3, HEADS, DIM, generator=g)
    k, v = torch.randn(2, 3, KV_HEADS, DIM, generator=g)
    kernel = AttentionMetadata.build(query_lens, starts, pages, PAGE, torch.device("cpu"), decode_kernel=True)
    padded = AttentionMetadata.build(query_lens, starts, pages, PAGE, torch.device("cpu"), decode_kernel=False)
    assert kernel.groups == () and len(kernel.decode_rows.tokens) == 3
    torch.testing.assert_close(kernel.slot_mapping, padded.slot_mapping)
    a = paged_attention(q, k, v, cache.clone(), kernel, DIM ** -0.5)
    b = paged_attention(q, k, v, cache.clone(), padded, DIM ** -0.5)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_one_padded_call_gives_the_same_answer(monkeypatch):
    """Grouping changes only how the work is cut: one padded call over everything agrees."""
    g = torch.Generator().manual_seed(1)
    query_lens, starts, pages = [1, 20, 3], [7, 0, 5], [[1, 2], [3, 4, 5, 6, 7], [8, 9]]
    cache = torch.randn(2, 12 * PAGE, KV_HEADS, DIM, generator=g)
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=g)
    k, v = torch.randn(2, sum(query_lens), KV_HEADS, DIM, generator=g)
    grouped = AttentionMetadata.build(query_lens, starts, pages, PAGE, torch.device("cpu"))
    monkeypatch.setattr(attention, "SHORT_QUERY", 1000)
    single = AttentionMetadata.build(query_lens, starts, pages, PAGE, torch.device("cpu"))
    assert (len(grouped.groups), len(single.groups)) == (2, 1)
    torch.testing.assert_close(grouped.slot_mapping, single.slot_mapping)
    a = paged_attention(q, k, v, cache.clone(), grouped, DIM ** -0.5)
    b = paged_attention(q, k, v, cache.clone(), single, DIM ** -0.5)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
