"""The Triton GEMV on a GPU: every tile against cuBLAS, with the norm, the residual add and the gate/up
activation folded in, and fp8 weights against their dequantized values."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (4096, 4096), (1000, 200)])
def test_triton_gemv_matches_cublas(rows, shape):
    """Every tile shape the chooser may pick, plain and in the gate/up form (SiLU-and-multiply applied to the
    two halves' outputs before they are stored), on shapes that divide the tiles and shapes that do not."""
    from specserve.kernels.triton import gemv as triton_gemv, pointwise as triton_pointwise
    from specserve.kernels.tuning import chooser

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
    if rows > 1 and tma_here:
        assert triton_gemv.tma_ok(weight), "the TMA tiles above ran with ordinary loads"
    choice = chooser.Choice()  # no decisions file: the shipped ones hold some of these shapes untimed
    tile = choice.tile(x, weight)
    assert tile is None or isinstance(tile, chooser.Tile)
    assert "cublas" in choice.timings[choice.key(x, weight)]


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_fp8_weights_in_the_gemv_match_their_dequantized_values(rows):
    """A Linear quantized to fp8 (a draft head's --speculative-draft-model-quantization fp8) computes with the
    values it holds, e4m3 times a scale per row: every tile (the TMA ones with ordinary loads), plain and in
    the gate/up form, with a norm folded in and with a residual, then the chooser's pick through the Linear (in
    inference mode, as steps run: with autograd on it takes PyTorch's matmul), eagerly and in a CUDA graph."""
    from specserve.kernels.fp8 import FP8
    from specserve.kernels.triton import gemv as triton_gemv, pointwise as triton_pointwise
    from specserve.layers.linear import Linear, decide_gemv_tiles

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
        decide_gemv_tiles(linear)
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
def test_fp8_weights_widen_to_their_exact_values_for_every_code(dtype, bits, switches):
    """Several-row GEMVs widen fp8 weights by moving bits on sm_90 on (triton_gemv._widen), or by Triton's
    conversion (SPECSERVE_GEMV_FP8_BITS=0, as one-row GEMVs do): every e4m3 code but the two NaNs, at each of the
    four places in a 32-bit word, must come out as its exact value (subnormals, zeros and signs included). Row n
    of the weight holds the codes n, n+1, ... (mod 256), and each of x's rows picks one column (the first four:
    each place in a word), so each output is one weight times 1, exact in fp32 and in bf16 and fp16."""
    from specserve.kernels.fp8 import FP8
    from specserve.kernels.triton import gemv as triton_gemv

    if bits and not triton_gemv._sm90_or_later(torch.cuda.current_device()):
        pytest.skip("moving bits needs sm_90 (bf16x2 multiply)")
    switches(gemv_fp8_bits=bits)
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


def _every_tile(rows: int, width: int, fp8: bool = False):
    """Every tile the kernel takes for `rows` of a `width`-wide weight, whether the chooser times it for every
    form or not: the TMA tiles, and the split ones whose splits all get columns; with `fp8`, one row's for fp8
    weights too."""
    from specserve.kernels.triton.gemv import split_fits
    from specserve.kernels.tuning import chooser as c

    if rows == 1:
        return c.ONE_ROW_TILES + (c.FP8_ONE_ROW_TILES if fp8 else [])
    tiles = c.ROWS_TILES + c.SWAP_TILES + c.SPLIT_ROWS_TILES + c.TMA_TILES + c.SPLIT_TMA_TILES
    return [tile for tile in tiles if split_fits(width, tile)]


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
