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


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_mla_layer_latent_kernels_equal_its_pytorch_row_form(dtype, tolerance, monkeypatch):
    # Moonlight's attention layer in a decode step: the fused norm, rotations and cache store, then the latent
    # kernel, against the same layer with both in PyTorch; the cache rows it stores too.
    import json

    from specserve.config import ModelConfig
    from specserve.engine.factory import shipped_config
    from specserve.layers.attention import AttentionMetadata
    from specserve.layers.mla import MultiHeadLatentAttention
    from specserve.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    cfg = ModelConfig.from_hf_config(json.loads(shipped_config("moonlight-16b-a3b").read_text()))
    layer = MultiHeadLatentAttention(cfg).to("cuda", dtype)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn_like(param) * 0.05 + (1.0 if param.dim() == 1 else 0.0))
    rotary = RotaryEmbedding(cfg.mla.qk_rope_head_dim, 4096, cfg.rope_theta, cfg.rope_scaling).cuda()
    page, lens = 16, [1, 40, 700]
    block_tables = torch.arange(3 * 64, dtype=torch.int32, device="cuda").view(3, 64)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    positions = seq_lens.long() - 1
    slots = block_tables.gather(1, (positions // page).view(-1, 1)).view(-1).long() * page + positions % page
    meta = AttentionMetadata(slot_mapping=slots, block_tables=block_tables, seq_lens=seq_lens, page_size=page)
    cache = torch.randn(1, 3 * 64 * page, 1, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim, device="cuda",
                        dtype=dtype)
    x = torch.randn(3, cfg.hidden_size, device="cuda", dtype=dtype)
    with torch.no_grad():
        fused_cache = cache.clone()
        assert layer._latent_kernels(layer.kv_a_proj_with_mqa(x), fused_cache, meta)
        fused = layer(x, positions, rotary, fused_cache, meta)
        monkeypatch.setattr(layer, "_latent_kernels", lambda *args: False)
        reference = layer(x, positions, rotary, cache, meta)
    torch.testing.assert_close(fused_cache, cache, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(fused.float(), reference.float(), atol=tolerance, rtol=tolerance)
