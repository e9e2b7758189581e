"""Tests for GGUF -> HF conversion, validated against transformers' own GGUF loader."""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from specserve.models import gguf as gc


@pytest.fixture(scope="module", autouse=True)
def fast_transformers_gguf() -> Iterator[None]:
    """Memoize pure GGUF helpers that transformers recomputes, keeping this file fast.

    transformers re-parses the GGUF for tokenizer, config and weights, and rebuilds
    the same tensor-name map per submodule; results are identical, only faster.
    """
    import gguf

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return gc.find_embedded_gguf()  # the embedded default is required: a missing package is a failure


@pytest.fixture(scope="module")
def converted(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    start = time.perf_counter()
    out = gc.convert_gguf_to_hf(gguf_path, tmp_path_factory.mktemp("conv") / "smollm2", progress=False)
    print(f"\nconversion took {time.perf_counter() - start:.1f}s")
    return out


@pytest.fixture(scope="module")
def ours(converted: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The forward permutation llama.cpp's converter applies to Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_hand_made() -> None:
    # One head of dim 4: HF rows [x0, x1, y0, y1] are stored by llama.cpp as [x0, y0, x1, y1].
    stored = np.array([[0.0], [2.0], [1.0], [3.0]])
    np.testing.assert_array_equal(gc.unpermute_qk(stored, 1)[:, 0], [0, 1, 2, 3])
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    np.testing.assert_array_equal(gc.unpermute_qk(llama_cpp_permute(w, 3), 3), w)
    bias = np.arange(24, dtype=np.float32)
    np.testing.assert_array_equal(gc.unpermute_qk(llama_cpp_permute(bias, 3), 3), bias)


def test_config_fields(converted: Path) -> None:
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["max_position_embeddings"] == 8192 and cfg["rope_theta"] == 100000.0
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["torch_dtype"] == "float32" and "rope_scaling" not in cfg
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2
    assert not list(converted.parent.glob(".*tmp*")), "temporary dir left behind"


def test_weights_match_transformers_loader(ours: torch.nn.Module, reference: torch.nn.Module) -> None:
    ref_state = reference.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, ref_state[name]), name  # same dequantizer: bit-identical


def test_logits_match_transformers_loader(ours: torch.nn.Module, reference: torch.nn.Module) -> None:
    ids = torch.tensor([[504, 3575, 282, 4649, 314, 355, 1345, 30, 378, 2012]])
    with torch.no_grad():
        got, want = ours(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_tokenizer_roundtrip_and_chat_template(converted: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    text = "Hello world, this is SmolLM2 speaking."
    assert tok.decode(tok(text).input_ids) == text
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_cached_conversion_converts_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def fake_convert(src: Path, out: Path) -> Path:
        calls.append(out)
        out.mkdir(parents=True)
        return out

    monkeypatch.setattr(gc, "convert_gguf_to_hf", fake_convert)
    src = tmp_path / "tiny.gguf"
    src.write_bytes(b"GGUF")
    first = gc.cached_conversion(src, tmp_path / "cache")
    assert gc.cached_conversion(src, tmp_path / "cache") == first and len(calls) == 1
    assert first.name.startswith("tiny-")
    src.write_bytes(b"GGUF v2")  # a changed file must get a fresh conversion
    assert gc.cached_conversion(src, tmp_path / "cache") != first and len(calls) == 2


def test_publish_replaces_existing_dir(tmp_path: Path) -> None:
    out, tmp = tmp_path / "out", tmp_path / ".out.tmp"
    out.mkdir()
    (out / "old").write_text("old")
    tmp.mkdir()
    (tmp / "new").write_text("new")
    gc._publish(tmp, out)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["new"]


class FakeField:
    def __init__(self, value: object) -> None:
        self.value = value

    def contents(self) -> object:
        return self.value


def fake_tensor(name: str, array: np.ndarray) -> SimpleNamespace:
    # GGUF reports shapes in ggml order (reversed); F32 data keeps numpy order.
    return SimpleNamespace(
        name=name, shape=np.array(array.shape[::-1]), data=array, tensor_type=GGMLQuantizationType.F32
    )


def fake_reader(arch: str, tensors: list[SimpleNamespace], **meta: object) -> SimpleNamespace:
    base = {"embedding_length": 8, "feed_forward_length": 16, "block_count": 1, "attention.head_count": 2,
            "attention.head_count_kv": 1, "context_length": 64, "vocab_size": 10}
    fields = {f"{arch}.{k}": FakeField(v) for k, v in {**base, **meta}.items()}
    fields["general.architecture"] = FakeField(arch)
    return SimpleNamespace(fields=fields, tensors=tensors)


def test_qwen_configs_and_no_permutation() -> None:
    q = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)
    tensors = [fake_tensor("blk.0.attn_q.weight", q), fake_tensor("blk.0.attn_q.bias", q[:, 0].copy()),
               fake_tensor("output.weight", q)]
    qwen2 = gc.build_config(fake_reader("qwen2", tensors))
    assert qwen2["architectures"] == ["Qwen2ForCausalLM"] and qwen2["attention_bias"]
    assert qwen2["tie_word_embeddings"] is False and qwen2["head_dim"] == 4
    out = gc._convert_tensors(fake_reader("qwen2", tensors), qwen2, torch.float32, progress=False)
    np.testing.assert_array_equal(out["model.layers.0.self_attn.q_proj.weight"].numpy(), q)
    assert set(out) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                        "lm_head.weight"}
    qwen3 = gc.build_config(fake_reader("qwen3", [], **{"attention.key_length": 16}))
    assert qwen3["architectures"] == ["Qwen3ForCausalLM"] and qwen3["head_dim"] == 16
    assert gc.hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    llama = gc.build_config(fake_reader("llama", tensors))
    out = gc._convert_tensors(fake_reader("llama", tensors), llama, torch.float32, progress=False)
    np.testing.assert_array_equal(out["model.layers.0.self_attn.q_proj.weight"].numpy(), gc.unpermute_qk(q, 2))


def test_unsupported_architecture_rejected() -> None:
    with pytest.raises(ValueError, match="gpt2"):
        gc.build_config(fake_reader("gpt2", []))
    with pytest.raises(ValueError, match="Unsupported GGUF tensor"):
        gc.hf_tensor_name("blk.0.ffn_gate_shexp.weight")  # Qwen2-MoE's shared expert


def test_llama3_rope_fit_recovers_parameters() -> None:
    theta, dim, factor, low, high, ctx = 500000.0, 128, 8.0, 1.0, 4.0, 8192
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < ctx / high:
            factors.append(1.0)
        elif wavelen > ctx / low:
            factors.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    fit = gc.fit_llama3_rope(np.array(factors, dtype=np.float32), theta, dim, None)
    assert fit == {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                   "high_freq_factor": high, "original_max_position_embeddings": ctx}


def test_qwen3_moe_experts_split_into_hf_names(tiny_checkpoint, tmp_path: Path) -> None:
    """A tiny Qwen3-MoE (layer 1 dense) laid out as llama.cpp writes it, each layer's experts stacked into one
    tensor per projection, converts back to a checkpoint our loader reads into the very same weights."""
    from safetensors.torch import load_file, save_file

    from specserve.models.loader import build_model, read_model_config

    source = tiny_checkpoint("qwen3-moe")
    hf_cfg = json.loads((source / "config.json").read_text())
    weights = load_file(str(source / "model.safetensors"))
    to_gguf = {f"{hf}.weight": stem for stem, hf in gc._BLOCK_NAMES.items()}
    tensors = [fake_tensor(gguf, weights[hf].numpy()) for gguf, hf in
               (("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight"),
                ("output.weight", "lm_head.weight"))]
    for layer in range(hf_cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        for name, tensor in weights.items():
            local = name.removeprefix(prefix)
            if name.startswith(prefix) and local in to_gguf:
                tensors.append(fake_tensor(f"blk.{layer}.{to_gguf[local]}.weight", tensor.numpy()))
        for stem, proj in gc._EXPERT_NAMES.items():
            experts = [weights[f"{prefix}mlp.experts.{e}.{proj}.weight"] for e in range(8)
                       if f"{prefix}mlp.experts.{e}.{proj}.weight" in weights]
            if experts:
                tensors.append(fake_tensor(f"blk.{layer}.{stem}.weight", torch.stack(experts).numpy()))
    meta = {"embedding_length": 64, "feed_forward_length": 128, "block_count": 4, "attention.head_count": 4,
            "attention.head_count_kv": 2, "attention.key_length": 32, "context_length": 512, "vocab_size": 512,
            "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32,
            "attention.layer_norm_rms_epsilon": hf_cfg["rms_norm_eps"], "rope.freq_base": 10000.0}
    reader = fake_reader("qwen3moe", tensors, **meta)
    config = gc.build_config(reader)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    assert config["mlp_only_layers"] == [1] and config["norm_topk_prob"] is True
    save_file(gc._convert_tensors(reader, config, torch.float32, progress=False), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    load = functools.partial(build_model, dtype=torch.float32, device=torch.device("cpu"), max_positions=64,
                             progress=False)
    ours, theirs = load(read_model_config(tmp_path), tmp_path), load(read_model_config(source), source)
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), name
