"""Attention on a GPU: a mixed step's decode rows go to the paged kernel and give what SDPA gives."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


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
