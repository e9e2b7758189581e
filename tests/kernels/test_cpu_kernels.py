"""The compiled CPU kernels (kernels/cpu/csrc) against the PyTorch paths they replace.

They build wherever a C++ compiler and AVX2 are found (CI has both), so these tests skip only elsewhere.
"""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from specserve.layers import attention

from specserve.kernels.cpu import build as cpu_kernels
from specserve.layers.attention import AttentionMetadata, paged_attention
from specserve.layers.linear import Linear

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="no C++ compiler or no AVX2 to build the CPU kernels")


@pytest.fixture(scope="module")
def kernels():
    built = cpu_kernels.kernels()
    assert built is not None, "a compiler is present, so the CPU kernels must build"
    return built


@pytest.mark.parametrize("out_features,in_features,bias", [(960, 576, True), (37, 100, False), (49152, 64, False),
                                                           (8, 16, True), (3, 24, True)])
def test_packed_linear_matches_f_linear(kernels, out_features, in_features, bias):
    """Every row count (1, blocks of up to 6 rows over two panels, the 8-row blocks, their tails, prefill-sized),
    column counts that are not a multiple of the 8-column panel, with and without bias."""
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias=bias)
    layer.prepack()
    assert layer.packed_kernel is kernels
    for rows in (1, 2, 3, 4, 5, 6, 8, 9, 14, 16, 23, 130):
        x = torch.randn(rows, in_features)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    x = torch.randn(2, 3, in_features * 2)[..., ::2]  # non-contiguous, 3-D
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("out_features,in_features,bias", [(960, 576, True), (37, 100, False), (3, 24, True)])
def test_weights_with_bf16_values_stream_as_bf16_and_compute_the_same(kernels, out_features, in_features, bias):
    """A weight whose values are all bf16 numbers is packed as bf16 and widened in registers: the outputs
    are bit for bit those of its fp32 packing. Any other weight stays fp32."""
    torch.manual_seed(1)
    layer = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.bfloat16().float())
    layer.prepack()
    assert layer.packed_weight.dtype == torch.bfloat16
    as_fp32 = kernels.pack(layer.weight.detach())
    for rows in (1, 2, 5, 8, 9, 23):
        x = torch.randn(rows, in_features)
        with torch.no_grad():
            ours = layer(x)
        assert torch.equal(ours, kernels.linear(x, as_fp32, out_features, layer.bias))
        torch.testing.assert_close(ours, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        layer.weight[0, 0] += 1e-3  # no longer a bf16 number
    layer.prepack()
    assert layer.packed_weight.dtype == torch.float32


def test_linear_with_gradients_keeps_autograd(kernels):
    layer = Linear(16, 8)
    layer.prepack()
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def _cache_and_pages(seqs, kv_heads, dim, page, generator):
    """A KV pool with each sequence's context on scattered, reversed pages."""
    pages, next_page = [], 1
    for q, start in seqs:
        need = -(-(q + start) // page)
        pages.append(list(range(next_page, next_page + need))[::-1])
        next_page += need
    cache = torch.randn(2, (next_page + 1) * page, kv_heads, dim, generator=generator)
    return cache, pages


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 1, 16), (6, 2, 8)])
@pytest.mark.parametrize("seqs", [
    [(1, 7), (1, 130), (1, 0), (1, 33)],        # decode rows, one of them a one-token prompt
    [(4, 12), (1, 5), (6, 40), (16, 3)],        # chain verification: causal within the step, mixed lengths
    [(3, 9), (3, 9)],                           # equal lengths: no padding rows
])
def test_paged_attention_kernel_matches_sdpa(kernels, monkeypatch, heads, kv_heads, dim, seqs):
    g = torch.Generator().manual_seed(0)
    page = 16
    cache, pages = _cache_and_pages(seqs, kv_heads, dim, page, g)
    query_lens, starts = [q for q, _ in seqs], [s for _, s in seqs]
    meta = AttentionMetadata.build(query_lens, starts, pages, page, torch.device("cpu"))
    assert all(group.token_seq is not None for group in meta.groups)
    # Wide score ranges exercise the kernel's exp where softmax is far from uniform.
    q = 4 * torch.randn(sum(query_lens), heads, dim, generator=g)
    k, v = torch.randn(2, sum(query_lens), kv_heads, dim, generator=g)

    def no_sdpa(*args, **kwargs):
        raise AssertionError("short causal queries must not reach SDPA when the kernel is built")

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", no_sdpa)
    fast = paged_attention(q, k, v, cache.clone(), meta, dim ** -0.5)
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    reference = paged_attention(q, k, v, cache.clone(), meta, dim ** -0.5)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)


def test_trees_and_prefill_keep_the_reference_path(kernels):
    """Draft trees need their ancestor mask and prefill chunks SDPA's blocked kernels: no kernel metadata."""
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    meta = AttentionMetadata.build([3, 40], [5, 0], [[1], [2, 3, 4]], 16, torch.device("cpu"),
                                   tree_masks=[tree, None])
    assert all(group.token_seq is None for group in meta.groups)


def test_switched_off_by_environment(switches):
    switches(cpu_kernels=False)  # SPECSERVE_CPU_KERNELS=0
    cpu_kernels.kernels.cache_clear()
    try:
        assert cpu_kernels.kernels() is None
        layer = Linear(16, 8)
        layer.prepack()  # falls back to oneDNN's packed weight
        x = torch.randn(3, 16)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    finally:
        cpu_kernels.kernels.cache_clear()


def _eager(monkeypatch, fn, *args):
    """The same pointwise function with the compiled kernels switched off."""
    with monkeypatch.context() as patch:
        patch.setattr(cpu_kernels, "kernels", lambda: None)
        return fn(*args)


@torch.inference_mode()
def test_pointwise_kernels_match_eager(kernels, monkeypatch):
    from specserve.kernels import pointwise
    from specserve.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 576, generator=g) * 3
    weight = torch.randn(576, generator=g)
    torch.testing.assert_close(pointwise.rms_norm(x, weight, 1e-5),
                               _eager(monkeypatch, pointwise.rms_norm, x, weight, 1e-5))

    # SiLU over a wide range: large negative gates (exp underflow), large positive ones, zeros.
    gate_up = torch.cat([torch.linspace(-100, 100, 7 * 64).view(7, 64), torch.randn(7, 64, generator=g)], dim=1)
    gate_up[0, :5] = 0
    torch.testing.assert_close(pointwise.silu_and_mul(gate_up), _eager(monkeypatch, pointwise.silu_and_mul, gate_up))

    # Rotary in place on strided views of one projection, as the attention layer passes them.
    rotary = RotaryEmbedding(64, 4096, 10000.0, None)
    positions = torch.tensor([0, 5, 4095, 17])
    qkv = torch.randn(4, (9 + 2 * 3) * 64, generator=g)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(4, 9, 64), k.view(4, 3, 64)
    expected = _eager(monkeypatch, pointwise.rotary, positions, rotary.cos_sin, q.clone(), k.clone())
    actual = pointwise.rotary(positions, rotary.cos_sin, q, k)
    torch.testing.assert_close(actual, expected)
    with pytest.raises(RuntimeError, match="position out of range"):
        pointwise.rotary(torch.tensor([4096, 0, 0, 0]), rotary.cos_sin, q, k)


def test_pointwise_kernels_stay_out_of_autograd(kernels):
    from specserve.kernels import pointwise

    x = torch.randn(3, 16, requires_grad=True)
    pointwise.silu_and_mul(x).sum().backward()  # the eager path, so gradients flow
    assert x.grad is not None


@torch.inference_mode()
def test_nan_stays_nan(kernels):
    """A numerical blow-up must show: the kernel's exp keeps a NaN score NaN, as SDPA does."""
    g = torch.Generator().manual_seed(0)
    cache, pages = _cache_and_pages([(1, 20)], 2, 64, 16, g)
    meta = AttentionMetadata.build([1], [20], pages, 16, torch.device("cpu"))
    q = torch.randn(1, 4, 64, generator=g)
    q[0, 1, 3] = float("nan")
    k, v = torch.randn(2, 1, 2, 64, generator=g)
    out = paged_attention(q, k, v, cache, meta, 0.125).view(1, 4, 64)
    assert out[0, 1].isnan().all() and not out[0, 0].isnan().any()


def test_fp8_quantized_linear_holds_e4m3_values_with_a_scale_per_row():
    # Weight-only fp8 (the draft head's --speculative-draft-model-quantization fp8). On a CPU the weight keeps
    # its dtype and holds the quantized values: each row is e4m3 numbers times its scale, its largest magnitude
    # kept (to fp32 rounding), every value within e4m3's rounding (3 mantissa bits: half a step is 1/16 of a value, and
    # below e4m3's normal range, half the smallest step, scale * 2^-10). A row of zeros stays zeros.
    from specserve.kernels.fp8 import FP8, quantize_fp8_rows

    torch.manual_seed(0)
    linear = Linear(300, 40, bias=False)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-4, 1, 300)[None, :])  # magnitudes over five decades in each row
        linear.weight[3] = 0.0
    original = linear.weight.detach().clone()
    linear.quantize_fp8()
    quantized, scale = quantize_fp8_rows(original)
    assert quantized.dtype == FP8 and scale.shape == (40,) and linear.weight.dtype == torch.float32
    assert torch.equal(linear.weight, quantized.float() * scale[:, None])
    torch.testing.assert_close(linear.weight.abs().amax(dim=1), original.abs().amax(dim=1), rtol=1e-6, atol=0)
    bound = torch.maximum(original.abs() / 16, scale[:, None] * 2**-10)
    assert ((linear.weight - original).abs() <= bound * (1 + 1e-6)).all()
    assert not torch.equal(linear.weight, original) and not linear.weight[3].any()
    x = torch.randn(5, 300)
    torch.testing.assert_close(linear(x), x @ linear.weight.T)
    # What a GPU runs where the GEMV does not: the fp8 weight widened to its values in x's dtype. In fp16, sums
    # of the unscaled e4m3 values (up to 448 each) would overflow; these are ~0.3.
    from specserve.kernels.fp8 import dense_linear

    x16 = (torch.randn(3, 300) * 100).half()
    widened = dense_linear(x16, quantized, scale)
    assert widened.dtype == torch.float16 and widened.isfinite().all()
    torch.testing.assert_close(widened.float(), x16.float() @ linear.weight.T, atol=5e-2, rtol=5e-2)  # fp16 sums
    with pytest.raises(ValueError, match="without a bias"):
        Linear(8, 8, bias=True).quantize_fp8()
