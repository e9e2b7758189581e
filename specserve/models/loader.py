"""Build a model from a checkpoint: Hugging Face directories (safetensors, sharded or not), GGUF files
(converted once to a cached HF directory), or random weights (`dummy`) for speed work without weights."""
from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from specserve.config import ModelConfig
from specserve.distributed.parallel import SINGLE, TensorParallel, rank_model_config
from specserve.layers.linear import Linear, can_prepack, norms_go_in_weights, prepack_linears
from specserve.layers.moe import FusedExperts
from specserve.layers.parallel import FIRST_RANK
from specserve.models.base import CausalLM, NormFoldable
from specserve.models.registry import model_class, model_config


def read_model_config(model_dir: Path) -> ModelConfig:
    """The config of the checkpoint in `model_dir`; ValueError if its architecture is not supported."""
    return model_config(json.loads((model_dir / "config.json").read_text()))


def build_model(
    cfg: ModelConfig,
    model_dir: Path | None,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    seed: int = 0,
    progress: bool = True,
    tp: TensorParallel = SINGLE,
) -> CausalLM:
    """Weights come from `model_dir`, or are random when `model_dir` is None (load format `dummy`). An
    unsupported architecture fails here, before any weights are read. Under tensor parallelism (`tp`, in a
    process whose torch.distributed group is already up) the model holds this rank's shard of each split
    tensor, and only that shard is read from safetensors."""
    with torch.device(device), _default_dtype(dtype):
        model = model_class(cfg.architecture)(cfg, max_positions, tp=tp)
    model.to(dtype=dtype)
    model.rotary.float()  # keep rotary angles in fp32
    if model_dir is None:
        _randomize(model, seed)
    elif tp.size == 1:
        _load_weights(model, iter_checkpoint(model_dir), progress)
    else:
        _load_weights(model, iter_checkpoint(model_dir, slices=True), progress, tp)
    model.eval().requires_grad_(False)
    if norms_go_in_weights(device, dtype):
        _move_norm_weights(model)
    if can_prepack(model):
        prepack_linears(model)
    return model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Parameters are created in `dtype` rather than in fp32 and then cast: a model would otherwise hold twice its
    bytes at once (a 30B MoE in bf16: 122 GB), and the fp32 blocks freed by the cast would stay in the CUDA
    cache, unseen by the KV pool's sizing."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _move_norm_weights(model: torch.nn.Module) -> None:
    """Each decoder layer's norm weights into the projections after them (models/base.py `NormFoldable`)."""
    for module in model.modules():
        if isinstance(module, NormFoldable):
            module.move_norm_weights_into_projections()


RANDOM_STD = 0.02  # of random (dummy) weights


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, RANDOM_STD, generator=generator)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"no safetensors or .bin weights in {model_dir}")
    return files


def iter_checkpoint(model_dir: Path, slices: bool = False) -> Iterator[tuple[str, object]]:
    """(name, tensor) of every checkpoint tensor. With `slices`, safetensors' tensors come not yet read, so a
    rank reads only its rows or columns (`_read_slice`); a pickled checkpoint's come whole either way."""
    for path in checkpoint_files(model_dir):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_slice(name) if slices else f.get_tensor(name)
        else:
            # Pickled checkpoints can run code on load; weights_only refuses anything but tensors.
            yield from torch.load(path, map_location="cpu", weights_only=True).items()


def _load_weights(model: torch.nn.Module, weights: Iterator[tuple[str, object]], progress: bool,
                  tp: TensorParallel = SINGLE) -> None:
    """Copies each checkpoint tensor into its parameter: whole, or under tensor parallelism (`weights` then
    from `iter_checkpoint(..., slices=True)`) only this rank's shard of it."""
    cfg = _model_config(model)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    loaded: set[str] = set()
    skips = getattr(model, "skips_checkpoint_tensor", lambda name: False)  # tensors a model has no use for
    for name, tensor in tqdm(weights, desc="loading weights", unit="tensor", disable=not progress, leave=False):
        target, shard = _target_of(model.stacked_params, cfg, name)
        if target is None or skips(name):
            continue
        if tp.size > 1:
            tensor = _rank_shard(model, tensor, target, shard, cfg, tp)
        if target in buffers and target not in params:  # e.g. an EAGLE-3 head's d2t / t2d maps
            buffers[target].copy_(tensor)
            loaded.add(target)
            continue
        _copy_into(params[target], tensor, shard, rank_model_config(cfg, tp), target)
        loaded.add(target if shard is None else f"{target}#{shard}")
    _check_complete(cfg, params, loaded)


def _rank_shard(model: torch.nn.Module, tensor, target: str, shard: Shard, cfg: ModelConfig,
                tp: TensorParallel) -> torch.Tensor:
    """This rank's part of a checkpoint tensor bound for parameter `target`: the slice its owning module's
    `tp_dims` names (layers/parallel.py), or all of it for a replicated parameter."""
    owner, _, param = target.rpartition(".")
    dim = getattr(model.get_submodule(owner), "tp_dims", {}).get(param)
    if dim is None:
        return _read_slice(tensor)
    if dim == FIRST_RANK:
        whole = _read_slice(tensor)
        return whole if tp.rank == 0 else torch.zeros_like(whole)
    shape = tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape()
    if "qkv_proj" in target and shard in (1, 2):  # k or v: this rank's KV heads, shared where fewer than ranks
        first, count = tp.kv_heads(cfg.num_kv_heads)
        start, length = first * cfg.head_dim, count * cfg.head_dim
    else:
        start, length = tp.shard(shape[dim])
    return _read_slice(tensor, dim, start, length)


def _read_slice(tensor, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of a safetensors slice or a tensor; all of it
    when `length` is None."""
    index = (slice(None),) * dim + (slice(start, None if length is None else start + length),)
    return tensor[index]


def _model_config(model: torch.nn.Module) -> ModelConfig:
    # A draft head wraps the ModelConfig of its one layer; a target model is described by it directly.
    return getattr(model.config, "model", model.config)


# One routed expert's projection: `layers.3.mlp.experts.17.gate_proj.weight`.
_EXPERT_NAME = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")

# A shard: a block of output rows of a fused parameter, or (expert, block or None) of a stacked expert weight.
Shard = int | tuple[int, int | None] | None


def _target_of(stacked: dict, cfg: ModelConfig, name: str) -> tuple[str | None, Shard]:
    name = name.removeprefix("model.")
    if "rotary_emb" in name:
        return None, None
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None, None
    expert = _EXPERT_NAME.fullmatch(name)
    if expert and expert[3] in FusedExperts.CHECKPOINT_NAMES:  # into the layer's FusedExperts
        stacked_name, block = FusedExperts.CHECKPOINT_NAMES[expert[3]]
        return f"{expert[1]}.{stacked_name}", (int(expert[2]), block)
    for ckpt_name, (fused, shard) in stacked.items():
        if f".{ckpt_name}." in name:
            return name.replace(ckpt_name, fused), shard
    return name, None


def _copy_into(param: torch.Tensor, tensor: torch.Tensor, shard: Shard, cfg: ModelConfig, name: str) -> None:
    dest = param.data
    if isinstance(shard, tuple):  # one expert's slice of the stacked weights
        expert, shard = shard
        dest = dest[expert]
    if shard is None:
        dest.copy_(tensor)
    else:
        sizes = _shard_sizes(cfg, name, dest.shape[0])
        dest.narrow(0, sum(sizes[:shard]), sizes[shard]).copy_(tensor)


def _shard_sizes(cfg: ModelConfig, fused_name: str, rows: int) -> list[int]:
    if "qkv_proj" in fused_name:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [q, kv, kv]
    return [rows // 2, rows // 2]  # [gate; up], of an MLP or of one expert


def _check_complete(cfg: ModelConfig, params: dict[str, torch.Tensor], loaded: set[str]) -> None:
    expected = set()
    for name in params:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            expected |= {f"{name}#{i}" for i in range(3)}
        elif name.endswith("gate_up_proj.weight"):
            expected |= {f"{name}#{i}" for i in range(2)}
        elif name.endswith((".experts.w13", ".experts.w2")):
            blocks = {b for s, b in FusedExperts.CHECKPOINT_NAMES.values() if name.endswith(s)}
            expected |= {f"{name}#{(e, b)}" for e in range(params[name].shape[0]) for b in blocks}
        else:
            expected.add(name)
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def load_eagle3_head(
    model_dir: Path | None,
    target_cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    seed: int = 0,
    draft_vocab_size: int | None = None,
    logit_std: float | None = None,
    quantization: str | None = None,
) -> torch.nn.Module:
    """An EAGLE-3 head from a public-format checkpoint directory (random weights when `model_dir` is None:
    then the head is shaped like one target layer, drafting over the first `draft_vocab_size` target ids,
    all of them by default, and `logit_std` sets the spread of its logits). `quantization` "fp8": its
    projections are quantized as loaded (`Linear.quantize_fp8`)."""
    from specserve.models.eagle3 import Eagle3Config, Eagle3Head

    if model_dir is None:
        hf = {**_target_as_hf(target_cfg), "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
              "draft_vocab_size": draft_vocab_size or target_cfg.vocab_size}
    else:
        hf = json.loads((model_dir / "config.json").read_text())
    cfg = Eagle3Config.from_hf_config(hf, target_cfg.num_layers)
    with torch.device(device):
        head = Eagle3Head(cfg, max_positions)
    head.to(dtype=dtype)
    head.rotary.float()
    if model_dir is None:
        _randomize(head, seed)
        if logit_std is not None:  # rows of std 0.02 over a unit-RMS hidden state give logits of std 0.02 * sqrt(H)
            head.lm_head.weight.data.mul_(logit_std / (RANDOM_STD * cfg.model.hidden_size**0.5))
        head.d2t.zero_()
        head.t2d.copy_(torch.arange(target_cfg.vocab_size, device=device) < cfg.draft_vocab_size)
    else:
        weights = ((n, t) for n, t in iter_checkpoint(model_dir) if not n.endswith("embed_tokens.weight"))
        _load_weights(head, weights, progress=False)
    head.eval().requires_grad_(False)
    if quantization not in (None, "fp8"):
        raise ValueError(f"unsupported draft model quantization {quantization!r} (fp8 or none)")
    if quantization == "fp8":
        for module in head.modules():
            if isinstance(module, Linear):
                module.quantize_fp8()
        if device.type == "cuda":  # the 16-bit weights' memory goes back before the KV pool is sized from what is free
            torch.cuda.empty_cache()
    if can_prepack(head):
        prepack_linears(head)
    return head


def save_eagle3_head(head: torch.nn.Module, out_dir: Path, max_shard_bytes: int | None = None) -> None:
    """Writes the public tensor names (unfused q/k/v and gate/up) and config that SGLang and vLLM load; split
    into shards of at most `max_shard_bytes` with a `model.safetensors.index.json` when it is given and the
    head is larger (a tensor larger than a shard gets one to itself)."""
    if any(isinstance(m, Linear) and m.weight_scale is not None for m in head.modules()):
        raise ValueError("a head quantized to fp8 on a GPU holds e4m3 codes and scales apart: save it unquantized")
    cfg = head.config.model
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    tensors = {}
    for name, tensor in head.state_dict().items():
        if "rotary" in name:
            continue
        if "qkv_proj" in name:
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                tensors[name.replace("qkv_proj", part)] = chunk
        elif "gate_up_proj" in name:
            for part, chunk in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                tensors[name.replace("gate_up_proj", part)] = chunk
        else:
            tensors[name] = tensor
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_safetensors({k: v.contiguous().cpu() for k, v in tensors.items()}, out_dir, max_shard_bytes)
    (out_dir / "config.json").write_text(json.dumps(head.config.to_hf_config(), indent=2))


def _write_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int | None) -> None:
    from safetensors.torch import save_file

    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, str(out_dir / "model.safetensors"))
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file))
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _target_as_hf(cfg: ModelConfig) -> dict:
    return {
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
    }
