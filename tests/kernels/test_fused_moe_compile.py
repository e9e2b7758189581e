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


@pytest.mark.parametrize("kernel,route", [("_gate_up_kernel", True), ("_gate_up_kernel", False),
                                          ("_down_sum_kernel", False)])
def test_moe_decode_gemvs_compile_for_sm90(kernel, route):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specserve.kernels.triton import moe_decode

    fn = getattr(moe_decode, kernel)
    tile = moe_decode.DEFAULT_TILES[0 if kernel == "_gate_up_kernel" else 1]
    # Qwen3-30B-A3B's expert shapes, with PDL as a Hopper launch takes it.
    constants = dict(I=768, H=2048, TOPK=8, TOPK_POW2=8, E=128, E_POW2=128, ROUTE=route, RENORMALIZE=True,
                     NORM=route, ADD=True,
                     BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, PDL=True)
    types = dict(X="*bf16", W13="*bf16", W2="*bf16", ACT="*bf16", OUT="*bf16", RES="*bf16", IDS="*i64",
                 WEIGHTS="*fp32", LOGITS="*bf16", GAMMA="*bf16", eps="fp32")
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in fn.arg_names}
    constants = {name: value for name, value in constants.items() if name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm


def test_grouped_topk_kernel_compiles_for_sm90():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specserve.kernels.triton.moe_routing import _grouped_topk_kernel

    # DeepSeek-V3's routing: 256 experts in 8 groups of 32, 4 groups, 8 experts.
    constants = dict(PER_GROUP=32, N_GROUP=8, TOPK_GROUP=4, K=8, K_POW2=8, G_POW2=8, PER_POW2=32, RENORMALIZE=True)
    types = dict(LOGITS="*fp32", BIAS="*fp32", WEIGHTS="*fp32", IDS="*i64", stride_l="i32", scale="fp32")
    signature = {name: "constexpr" if name in constants else types[name] for name in _grouped_topk_kernel.arg_names}
    compiled = triton.compile(ASTSource(_grouped_topk_kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm


def test_mla_rotary_store_kernel_compiles_for_sm90():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specserve.kernels.triton.pointwise import _mla_rotary_store_kernel

    # Moonlight's (and DeepSeek-V3's) latent: kv_lora_rank 512, rotary 64, interleaved pairs; PDL as on Hopper.
    constants = dict(RANK=512, HALF=32, HEADS_PAD=16, INTERLEAVED=True, PDL=True)
    types = dict(Q_PE="*bf16", LATENT="*bf16", NORM_W="*bf16", Q_OUT="*bf16", CACHE="*bf16", POSITIONS="*i64",
                 SLOTS="*i64", COS_SIN="*fp32", eps="fp32")
    fn = _mla_rotary_store_kernel
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm
