"""A Linear layer that packs its weight once for a faster CPU kernel, and takes the Triton GEMV on a GPU.

PyTorch's default fp32 GEMM re-lays-out the weight at every call, which dominates small-batch decode on CPU.
Packing at load keeps fp32 math and cuts that cost; the hand-written kernel (kernels/cpu) cuts it again, and
oneDNN is the fallback where that kernel cannot be built. A weight whose values are all bf16 numbers (loaded
from a bf16 checkpoint) is packed as bf16: same values, half the bytes to stream.
On a GPU, decode steps of at most 16 rows in bf16/fp16 go to the Triton GEMV (kernels/triton/gemv.py) for each
weight shape and row count where the chooser (kernels/tuning/chooser.py) timed it faster than cuBLAS; the MLP's
gate/up projection applies SiLU-and-multiply to its outputs inside that GEMV, and in bf16 a decoder layer whose
`qkv` projection takes it with its RMSNorm folded in folds its norms and residual adds into the GEMVs around
them (models/llama.py). Everything else uses plain `F.linear`. A draft head's weights may be quantized to fp8
(`Linear.quantize_fp8`): the GEMV reads them as they are; `F.linear` gets them widened first
(kernels/fp8.dense_linear). Switches (specserve/envs.py): SPECSERVE_TRITON_GEMV, SPECSERVE_FOLD_NORMS and
SPECSERVE_NORM_IN_WEIGHTS.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve import envs
from specserve.kernels import pointwise
from specserve.kernels.cpu import build as cpu_kernels
from specserve.kernels.fp8 import dense_linear, fp8_values, quantize_fp8_rows

# From this many rows on (prefill chunks) the weight is read from cache many times over, and MKL's blocked GEMM
# beats the streaming kernel.
LARGE_M = 256


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None
    packed_kernel = None  # the compiled CPU GEMM module when it packed the weight, else oneDNN
    # How the model calls it, so the GEMV choice can be made for those forms at startup (decide_gemv_tiles):
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
        return envs.get().fold_norms and x.dtype == torch.bfloat16 and self.gemv_tile(x, norm=True) is not None

    def gemv_tile(self, x: torch.Tensor, gate_up: bool = False, norm: bool = False):
        """The Triton GEMV tile that a call on x would run, or None where it takes cuBLAS."""
        rows = x.reshape(-1, x.shape[-1])
        if not (envs.get().triton_gemv and x.is_cuda and self.bias is None and rows.shape[0] <= 16
                and rows.stride(-1) == 1 and not torch.is_grad_enabled() and x.dtype == self.input_dtype):
            return None
        from specserve.kernels.triton.gemv import DTYPES
        from specserve.kernels.tuning.chooser import choice

        if x.dtype not in DTYPES:
            return None
        return choice.tile(rows, self.weight, gate_up, norm, gamma=not self.norm_in_weight)

    def _forward_gpu(self, x: torch.Tensor, gate_up: bool = False, norm=None, add=None) -> torch.Tensor:
        # Folds are bf16 only: unless that weight is in this one, they scale x by the norm's weight before the
        # reciprocal RMS, where fp16 could overflow.
        folds = norm is not None and x.dtype == torch.bfloat16 and envs.get().fold_norms
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
    """Whether a model loaded for `device` and `dtype` moves its norms' weights into its projections, so that a
    GEMV folding a norm in leaves its input as loaded and only scales its outputs (models/loader.py)."""
    switches = envs.get()
    return (switches.norm_in_weights and switches.fold_norms and switches.triton_gemv and device.type == "cuda"
            and dtype == torch.bfloat16)


def decide_gemv_tiles(model: nn.Module) -> None:
    """Decides every row bucket of the model's GEMV-eligible weights now, at startup: steps run untimed
    (`Choice.untimed`), and what their eager calls meet undecided takes cuBLAS for good (a draft model runs
    eagerly in every drafting step). Each is decided in the forms it is called in (`Linear.gated`,
    `Linear.takes_norm`): an MLP's gate/up projection with SiLU-and-multiply on its output, and in bf16 the
    projections a norm may fold into with and without the norm. Shapes already decided (by the graphs' warm-ups)
    cost nothing."""
    switches = envs.get()
    if not switches.triton_gemv:
        return
    from specserve.kernels.triton.gemv import DTYPES
    from specserve.kernels.tuning.chooser import ROW_BUCKETS, choice

    for linear in model.modules():
        if not isinstance(linear, Linear) or linear.bias is not None or linear.input_dtype not in DTYPES:
            continue
        folds = linear.takes_norm and switches.fold_norms and linear.input_dtype == torch.bfloat16
        for rows in ROW_BUCKETS:
            x = torch.zeros(rows, linear.in_features, dtype=linear.input_dtype, device=linear.weight.device)
            for norm in (False, True) if folds else (False,):
                choice.tile(x, linear.weight, linear.gated, norm, gamma=not linear.norm_in_weight)


def can_prepack(model: nn.Module) -> bool:
    weight = next(model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def prepack_linears(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepack()
