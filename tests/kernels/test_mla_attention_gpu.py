"""The MLA decode kernel on a GPU, at DeepSeek-V3's widths (kv_lora_rank 512, rotary 64), against its PyTorch
form: `attend_rows` over the latent plane passed as keys and values."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads", [16, 64])  # Moonlight's, Kimi-K2's
def test_mla_decode_kernel_equals_attend_rows(dtype, tolerance, heads):
    from specserve.kernels.triton.mla_attention import mla_decode_attention
    from specserve.layers.attention import AttentionMetadata, attend_rows

    torch.manual_seed(0)
    rank, rope, page = 512, 64, 16
    plane = torch.randn(400 * page, 1, rank + rope, device="cuda", dtype=dtype)
    lens = [1, 17, 300, 2000]
    order = torch.randperm(400).tolist()
    tables, start = [], 0
    for n in lens:
        pages = -(-n // page)
        tables.append(order[start:start + pages] + [0] * (130 - pages))
        start += pages
    block_tables = torch.tensor(tables, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), heads, rank + rope, device="cuda", dtype=dtype)
    meta = AttentionMetadata(slot_mapping=seq_lens.long(), block_tables=block_tables, seq_lens=seq_lens,
                             page_size=page)
    scale = (128 + rope) ** -0.5
    expected = attend_rows(q.float(), plane.float()[None].expand(2, -1, -1, -1), meta, scale)
    expected = expected.view(len(lens), heads, -1)[..., :rank]
    for splits in (1, 4, 32):
        out = mla_decode_attention(q, plane, rank, block_tables, seq_lens, scale, page, splits)
        torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
