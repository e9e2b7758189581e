"""The pointwise Triton kernels on a GPU against the eager functions: rotary, SiLU-and-multiply, the KV store,
the fused norms, rotary with the store, and the resolution of placeholder tokens."""
from __future__ import annotations

import pytest
import torch

from kernel_checks import check_rms_norm_pair

pytestmark = pytest.mark.gpu


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
    ours = triton_pointwise.rotary(positions, cos_sin, q, k)
    reference = pointwise.eager_rotary(positions, cos_sin, q, k)
    one_rounding = 1e-6 if dtype == torch.float32 else 1.6e-2
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, atol=one_rounding, rtol=one_rounding)
    gate_up = torch.randn(tokens, 2 * 1000, device="cuda", dtype=dtype) * 4
    torch.testing.assert_close(triton_pointwise.silu_and_mul(gate_up), pointwise.eager_silu_and_mul(gate_up),
                               atol=one_rounding, rtol=one_rounding)
    batched = gate_up[:36].view(4, 9, -1)  # [B, T, 2I], as a head's held-out evaluation passes
    torch.testing.assert_close(triton_pointwise.silu_and_mul(batched), pointwise.eager_silu_and_mul(batched),
                               atol=one_rounding, rtol=one_rounding)
    cache = torch.zeros(2, 500, kv_heads, dim, device="cuda", dtype=dtype)
    expected = cache.clone()
    slots = torch.randperm(500, device="cuda")[:tokens]
    triton_pointwise.store_kv(ours[1], v, cache, slots)
    expected[0].index_copy_(0, slots, ours[1])
    expected[1].index_copy_(0, slots, v)
    assert torch.equal(cache, expected)


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
    torch.testing.assert_close(triton_pointwise.rms_norm(x, weight, 1e-5), pointwise.eager_rms_norm(
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
    # Qwen3's per-head q and k norms folded in: the eager norms, then the rotation.
    q_weight, k_weight = (torch.rand(dim, device="cuda", dtype=dtype) + 0.5 for _ in range(2))
    q_rot, k_rot = triton_pointwise.rotary_store(positions, cos_sin, q, k, v, cache, slots, (q_weight, k_weight, 1e-6))
    q_normed, k_normed = pointwise.rms_norm(q, q_weight, 1e-6), pointwise.rms_norm(k, k_weight, 1e-6)
    torch.testing.assert_close(q_rot, pointwise._rotate(q_normed, cos, sin), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(k_rot, pointwise._rotate(k_normed, cos, sin), atol=tolerance, rtol=tolerance)
    assert torch.equal(cache[0, slots], k_rot)
