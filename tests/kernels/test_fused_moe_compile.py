"""The fused MoE kernel compiles for an H100/H200 (sm_90) with no GPU present: Triton's interpreter, which the
numerical test runs in, accepts programs the real compiler refuses."""
from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("gated,block_m", [(True, 16), (False, 64)])
def test_fused_moe_kernel_compiles_for_sm90(gated, block_m):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specserve.kernels.triton.fused_moe import DEFAULT_TILES, _expert_gemm_kernel

    # Qwen3-30B-A3B's projections: [gate; up] from the hidden state (2048) to 2 x 768, then down to 2048.
    tile = DEFAULT_TILES[0 if gated else 1]
    constants = dict(N=768 if gated else 2048, K=2048 if gated else 768, TOPK=8, GATHER_A=gated, SCATTER_C=not gated,
                     GATED=gated, PRECISION="tf32", BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k)
    types = dict(A="*bf16", W="*bf16", C="*bf16", SLOT_PAIRS="*i64", BLOCK_EXPERT="*i64", NUM_PAIRS="i32",
                 stride_am="i32", stride_we="i32", stride_wn="i32", stride_cm="i32")
    signature = {name: "constexpr" if name in constants else types[name] for name in _expert_gemm_kernel.arg_names}
    compiled = triton.compile(ASTSource(_expert_gemm_kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm
