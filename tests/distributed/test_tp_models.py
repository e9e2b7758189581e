"""Sharded models: two ranks (gloo, CPU, fp32) give the logits one rank gives, for a prompt step and a decode
step, on Llama (KV heads split; one KV head copied to both ranks, with tied embeddings and an o_proj bias),
Qwen2 (qkv biases), Qwen3-MoE (experts split inside) and DeepSeek-V3 (MLA heads split, latent cache whole; with
and without q_lora). The checkpoints are written as several safetensors files with an index, and each rank reads
only its shards of them. One spawn of two ranks serves the whole module."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from specserve.distributed.parallel import SINGLE, TensorParallel
from specserve.layers.parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                       whole_embedding)
from specserve.models.loader import build_model, read_model_config
from tp_forward import run_two_ranks, sharded_checkpoints, step_logits

KINDS = ("llama", "llama-mqa", "qwen2", "qwen3-moe", "deepseek-v3", "deepseek-v3-qlora")


def _rank(rank: int, size: int, init: str, paths: list[str], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        tp = TensorParallel(rank, size)
        results = {kind: step_logits(Path(path), tp) for kind, path in zip(KINDS, paths)}
        results.update(_replicated_parts(Path(paths[KINDS.index("llama-mqa")]), tp))
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _replicated_parts(path: Path, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """The k rows of layer 0's qkv_proj (one KV head) and the embedding gathered whole."""
    cfg = read_model_config(path)
    model = build_model(cfg, path, torch.float32, torch.device("cpu"), 64, progress=False, tp=tp)
    q = cfg.num_heads // tp.size * cfg.head_dim
    return {"k rows": model.layers[0].self_attn.qkv_proj.weight[q:q + cfg.head_dim],
            "whole embedding": whole_embedding(model.embed_tokens).weight}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return sharded_checkpoints(tmp_path_factory, KINDS, "tp")


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory) -> list[dict]:
    return run_two_ranks(_rank, [str(checkpoints[k]) for k in KINDS], tmp_path_factory.mktemp("tp-out"))


def test_checkpoints_are_sharded_over_several_files(checkpoints):
    for path in checkpoints.values():
        assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 1


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_give_one_rank_logits(checkpoints, two_ranks, kind):
    prompt, decode = step_logits(checkpoints[kind], SINGLE)
    for rank in two_ranks:
        torch.testing.assert_close(rank[kind][0], prompt, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(rank[kind][1], decode, rtol=1e-4, atol=1e-4)


def test_a_single_kv_head_is_copied_to_every_rank(checkpoints, two_ranks):
    for rank in two_ranks:
        torch.testing.assert_close(rank["k rows"], _checkpoint_tensor(checkpoints["llama-mqa"], "k_proj"))


def test_the_embedding_gathers_whole_on_every_rank(checkpoints, two_ranks):
    for rank in two_ranks:
        torch.testing.assert_close(rank["whole embedding"], _checkpoint_tensor(checkpoints["llama-mqa"], "embed"))


def _checkpoint_tensor(path: Path, part: str) -> torch.Tensor:
    """Layer 0's `part` (or the embedding), read whole from the sharded checkpoint."""
    name = "model.embed_tokens.weight" if part == "embed" else f"model.layers.0.self_attn.{part}.weight"
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(path / index[name]), "pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("kind", ["llama-mqa", "deepseek-v3-qlora"])
def test_one_rank_builds_the_single_device_layers(checkpoints, kind):
    cfg = read_model_config(checkpoints[kind])
    model = build_model(cfg, None, torch.float32, torch.device("cpu"), 64, progress=False)
    parallel = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    assert not [name for name, module in model.named_modules() if isinstance(module, parallel)]


def test_heads_that_do_not_split_are_refused(checkpoints):
    path = checkpoints["llama"]
    with pytest.raises(ValueError, match="attention heads do not split evenly over 8"):
        build_model(read_model_config(path), path, torch.float32, torch.device("cpu"), 64, progress=False,
                    tp=TensorParallel(0, 8))


class _RecordingCheckpoint:
    """safe_open that records the shape of every slice read and refuses whole-tensor reads."""

    def __init__(self, reads: dict[str, tuple[int, ...]], path: str, framework: str) -> None:
        self.reads, self.file = reads, safe_open(path, framework)

    def __enter__(self):
        self.file.__enter__()
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def keys(self):
        return self.file.keys()

    def get_tensor(self, name: str):
        raise AssertionError(f"{name} was read whole")

    def get_slice(self, name: str):
        whole, reads = self.file.get_slice(name), self.reads

        class Slice:
            def get_shape(self):
                return whole.get_shape()

            def __getitem__(self, index):
                part = whole[index]
                reads[name] = tuple(part.shape)
                return part

        return Slice()


def test_a_rank_reads_only_its_slices(checkpoints, monkeypatch):
    """Loading needs no collective, so one rank's load runs here without a group."""
    import specserve.models.loader as loader

    reads = {}
    monkeypatch.setattr(loader, "safe_open", lambda path, framework: _RecordingCheckpoint(reads, path, framework))
    path = checkpoints["qwen3-moe"]
    cfg = read_model_config(path)
    build_model(cfg, path, torch.float32, torch.device("cpu"), 64, progress=False, tp=TensorParallel(1, 2))
    hidden, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = "model.layers.0"
    assert reads[f"{layer}.self_attn.q_proj.weight"] == (q // 2, hidden)
    assert reads[f"{layer}.self_attn.k_proj.weight"] == (kv // 2, hidden)
    assert reads[f"{layer}.self_attn.o_proj.weight"] == (hidden, q // 2)
    assert reads[f"{layer}.mlp.experts.3.up_proj.weight"] == (cfg.moe.intermediate_size // 2, hidden)
    assert reads[f"{layer}.mlp.experts.3.down_proj.weight"] == (hidden, cfg.moe.intermediate_size // 2)
    assert reads[f"{layer}.mlp.gate.weight"] == (cfg.moe.num_experts, hidden)  # the router, whole
    assert reads["model.embed_tokens.weight"] == (cfg.vocab_size // 2, hidden)
    assert reads["lm_head.weight"] == (cfg.vocab_size // 2, hidden)


def test_pickled_weights_shard_as_safetensors_do(checkpoints, tmp_path):
    """A .bin checkpoint comes whole and is cut in memory; each rank ends with the shards safetensors give."""
    from safetensors.torch import load_file

    src = checkpoints["llama-mqa"]
    state = {}
    for file in src.glob("*.safetensors"):
        state.update(load_file(str(file)))
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    cfg = read_model_config(src)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        from_bin = build_model(cfg, tmp_path, torch.float32, torch.device("cpu"), 64, progress=False, tp=tp)
        ours = build_model(cfg, src, torch.float32, torch.device("cpu"), 64, progress=False, tp=tp)
        for (name, a), b in zip(from_bin.state_dict().items(), ours.state_dict().values()):
            assert torch.equal(a, b), name
