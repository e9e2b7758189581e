"""A Linear layer that packs its weight once for a faster CPU kernel.

PyTorch's default fp32 GEMM re-lays-out the weight at every call, which dominates small-batch decode on CPU
(a 2-core EPYC spent 129 ms per SmolLM2 step at batch 8 in plain `F.linear`, 60 ms with oneDNN pre-packed
weights). Packing at load keeps fp32 math and cuts that cost; the hand-written kernel (cpu_kernels.py)
cuts it again, and oneDNN is the fallback where that kernel cannot be built. A weight whose values are all
bf16 numbers (loaded from a bf16 checkpoint) is packed as bf16: same values, half the bytes to stream.
On a GPU, decode steps of at most 16 rows in bf16/fp16 go to the Triton GEMV of triton_gemv.py for each weight
shape (and row count: one, or several) where it timed faster than cuBLAS; the MLP's gate/up projection applies
SiLU-and-multiply to its outputs inside that GEMV, and in bf16 a decoder layer whose `qkv` projection takes it
with its RMSNorm folded in folds its norms and residual adds into the GEMVs around them (models/llama.py).
Everything else uses plain `F.linear`. A draft head's weights may be quantized to fp8 (`Linear.quantize_fp8`):
the GEMV reads them as they are; `F.linear` gets them widened first (`dense_linear`).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels.cpu import build as cpu_kernels

# SPECSERVE_TRITON_GEMV=0 keeps cuBLAS for every shape (an A/B switch for benchmarks).

from specserve.kernels import pointwise
TRITON_GEMV = os.environ.get("SPECSERVE_TRITON_GEMV", "1") != "0"
# SPECSERVE_FOLD_NORMS=0 keeps a decoder layer's RMSNorms as kernels of their own (an A/B switch).
FOLD_NORMS = os.environ.get("SPECSERVE_FOLD_NORMS", "1") != "0"
# SPECSERVE_NORM_IN_WEIGHTS=1: where norms fold (bf16 on a GPU), a decoder layer's RMSNorm weights are multiplied
# into the projections after them at load (models/loader.py), so a GEMV that folds a norm in leaves its input as
# loaded and only scales its outputs. On an H200, batch 1: plain and chain steps even or faster, the tree's step
# 6.68 against 6.93 ms of device time (within the spread between processes); =0 is the A/B switch.
NORM_IN_WEIGHTS = os.environ.get("SPECSERVE_NORM_IN_WEIGHTS", "1") != "0"


FP8 = torch.float8_e4m3fn  # weights only (a draft model's: --speculative-draft-model-quantization fp8)

# From this many rows on (prefill chunks) the weight is read from cache many times over, and MKL's blocked GEMM
# beats the streaming kernel (measured: 283 vs 338 ms for 1024 rows through four SmolLM2 layers).
LARGE_M = 256


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None
    packed_kernel = None  # the compiled CPU GEMM module when it packed the weight, else oneDNN
    # How the model calls it, so the GEMV choice can be made for those forms at startup (triton_gemv.decide_all):
    gated = False  # through `forward_gated`: an MLP's [gate; up] projection
    takes_norm = False  # with an RMSNorm to fold in, where the layer folds
    norm_in_weight = False  # that norm's weight is multiplied into this weight (DecoderLayer, at load)
    weight_scale: torch.Tensor | None = None  # an fp8 weight's, one per output feature (`quantize_fp8`)
    _input_dtype: torch.dtype | None = None  # the dtype the weight had before that

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype of the inputs it takes (and of its outputs): its weight's, unless that was quantized."""
        return self._input_dtype or self.weight.dtype

    def quantize_fp8(self) -> None:
        """Weight-only fp8 (e4m3), one fp32 scale per output feature (the row's largest magnitude maps to
        e4m3's largest value): half the bytes a decode step streams. On a GPU the weight is stored in fp8 and the
        GEMV scales its sums; elsewhere (no fp8 kernels) it keeps its dtype and holds the same quantized values,
        so a CPU run shows what the rounding does to the outputs."""
        if self.weight_scale is not None or self.bias is not None:
            raise ValueError("quantize_fp8 takes an unquantized Linear without a bias")
        quantized, scale = quantize_fp8_rows(self.weight)
        if not self.weight.is_cuda:
            self.weight.data.copy_(fp8_values(quantized, scale))
            return
        self._input_dtype = self.weight.dtype
        self.weight = nn.Parameter(quantized, requires_grad=False)
        self.weight_scale = scale

    def forward(self, x: torch.Tensor, norm=None, add: torch.Tensor | None = None) -> torch.Tensor:
        """self(norm(x)) + add, with `norm` an RMSNorm and `add` the residual stream, each optional. Where the
        Triton GEMV runs (bf16 only for the norm: `folds_norm`), both happen inside it; elsewhere they are
        separate operations."""
        if x.is_cuda:
            return self._forward_gpu(x, norm=norm, add=add)
        if norm is not None:
            x = norm(x)
        out = self._forward_cpu(x)
        return out if add is None else out + add

    def _forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None or x.requires_grad:
            return F.linear(x, self.weight, self.bias)
        if self.packed_kernel is not None:
            rows = x.reshape(-1, x.shape[-1])
            if rows.shape[0] >= LARGE_M:
                return F.linear(x, self.weight, self.bias)
            out = self.packed_kernel.linear(rows, self.packed_weight, self.out_features, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def forward_gated(self, x: torch.Tensor, norm=None) -> torch.Tensor:
        """silu(gate) * up, where self(norm(x)) = [gate | up]; one kernel where the Triton GEMV runs."""
        if x.is_cuda:
            return self._forward_gpu(x, gate_up=True, norm=norm)
        return pointwise.silu_and_mul(self(x, norm=norm))

    def folds_norm(self, x: torch.Tensor) -> bool:
        """Whether a call on x with a norm would apply it inside the Triton GEMV (see `forward`)."""
        return FOLD_NORMS and x.dtype == torch.bfloat16 and self.gemv_tile(x, norm=True) is not None

    def gemv_tile(self, x: torch.Tensor, gate_up: bool = False, norm: bool = False):
        """The Triton GEMV tile that a call on x would run, or None where it takes cuBLAS."""
        rows = x.reshape(-1, x.shape[-1])
        if not (TRITON_GEMV and x.is_cuda and self.bias is None and rows.shape[0] <= 16 and rows.stride(-1) == 1
                and not torch.is_grad_enabled() and x.dtype == self.input_dtype):
            return None
        from specserve.kernels.triton import gemv as triton_gemv

        if x.dtype not in triton_gemv.DTYPES:
            return None
        return triton_gemv.choice.tile(rows, self.weight, gate_up, norm, gamma=not self.norm_in_weight)

    def _forward_gpu(self, x: torch.Tensor, gate_up: bool = False, norm=None, add=None) -> torch.Tensor:
        # Folds are bf16 only: unless that weight is in this one, they scale x by the norm's weight before the
        # reciprocal RMS, where fp16 could overflow.
        folds = norm is not None and x.dtype == torch.bfloat16 and FOLD_NORMS
        tile = self.gemv_tile(x, gate_up, norm=True) if folds else None
        if tile is None:  # no fold (or cuBLAS won against it): the norm apart, then the best form
            if norm is not None:
                x, norm = norm(x), None
            tile = self.gemv_tile(x, gate_up)
        if tile is not None:
            from specserve.kernels.triton import gemv as triton_gemv

            out_features = self.out_features // (2 if gate_up else 1)
            rows = x.reshape(-1, x.shape[-1])
            residual = None if add is None else add.reshape(-1, out_features)
            gamma = None if norm is None or self.norm_in_weight else norm.weight
            out = triton_gemv.gemv(rows, self.weight, tile, gamma, 0.0 if norm is None else norm.eps, residual,
                                   gate_up, norm=norm is not None, scale=self.weight_scale)
            return out.view(*x.shape[:-1], out_features)
        if self.weight_scale is not None:
            out = dense_linear(x, self.weight, self.weight_scale)
        else:
            out = F.linear(x, self.weight, self.bias)
        if gate_up:
            out = pointwise.silu_and_mul(out)
        return out if add is None else out + add

    def prepack(self, max_batch_hint: int = 8) -> None:
        weight = self.weight.detach()
        self.packed_kernel = cpu_kernels.kernels()
        if self.packed_kernel is not None:
            narrow = weight.to(torch.bfloat16)
            self.packed_weight = self.packed_kernel.pack(narrow if torch.equal(narrow.float(), weight) else weight)
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, max_batch_hint)


def norms_go_in_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model loaded for `device` and `dtype` moves its norms' weights into its projections."""
    return NORM_IN_WEIGHTS and FOLD_NORMS and TRITON_GEMV and device.type == "cuda" and dtype == torch.bfloat16


def can_prepack(model: nn.Module) -> bool:
    weight = next(model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def prepack_linears(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepack()


def quantize_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (fp8 e4m3 [N, K], fp32 scales [N]): each row's largest magnitude maps to e4m3's largest
    value (a row of zeros gets the smallest scale, not a division by zero)."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / torch.finfo(FP8).max
    return (weight / scale[:, None]).to(FP8), scale


def fp8_values(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values an fp8 weight holds: each row's e4m3 numbers times its scale (`quantize_fp8_rows`)."""
    return quantized.float() * scale[:, None]


def dense_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T by PyTorch; an fp8 weight (with its per-row `scale`) is first widened to its values in x's
    dtype, scaled in fp32 (scaling the sums instead would hold sums of unscaled e4m3 values in x's dtype, which
    overflow fp16). It reads the fp8 weight and writes and reads a 16-bit one: more bytes than a 16-bit weight,
    so it serves calls the GEMV does not take (more than 16 rows, or where cuBLAS was chosen)."""
    if scale is None:
        return F.linear(x, weight)
    return F.linear(x, fp8_values(weight, scale).to(x.dtype))
