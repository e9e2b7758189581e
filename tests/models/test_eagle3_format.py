"""EAGLE-3 heads in the public checkpoint format: load a third-party-style directory, save, round-trip."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from specserve.config import ModelConfig
from specserve.layers.attention import AttentionMetadata
from specserve.models.eagle3 import default_target_layers, vocab_maps
from specserve.models.loader import load_eagle3_head, save_eagle3_head

H, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, DRAFT_VOCAB, LAYERS = 64, 4, 2, 16, 96, 300, 120, 8

TARGET = ModelConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER,
                     num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)

PUBLIC_SHAPES = {
    "fc.weight": (H, 3 * H),
    "midlayer.input_layernorm.weight": (H,),
    "midlayer.hidden_norm.weight": (H,),
    "midlayer.post_attention_layernorm.weight": (H,),
    "midlayer.self_attn.q_proj.weight": (HEADS * HEAD_DIM, 2 * H),
    "midlayer.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
    "midlayer.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
    "midlayer.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
    "midlayer.mlp.gate_proj.weight": (INTER, H),
    "midlayer.mlp.up_proj.weight": (INTER, H),
    "midlayer.mlp.down_proj.weight": (H, INTER),
    "norm.weight": (H,),
    "lm_head.weight": (DRAFT_VOCAB, H),
    "d2t": (DRAFT_VOCAB,),
    "t2d": (VOCAB,),
}


def _third_party_head(path, taps=(1, 4, 6)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    target_ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    d2t, t2d = vocab_maps(target_ids, VOCAB)
    tensors = {name: torch.randn(shape, generator=g) * 0.1 for name, shape in PUBLIC_SHAPES.items()
               if name not in ("d2t", "t2d")}
    tensors.update(d2t=d2t, t2d=t2d, **{"embed_tokens.weight": torch.randn(VOCAB, H)})  # extra tensor, ignored
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": H,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(taps)},
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def _run(head, tokens: list[int]) -> torch.Tensor:
    n = len(tokens)
    kv = torch.zeros(1, 2, 16, KV_HEADS, HEAD_DIM)
    meta = AttentionMetadata.build([n], [0], [[0]], 16, torch.device("cpu"))
    embeds = torch.randn(n, H, generator=torch.Generator().manual_seed(1))
    taps = torch.randn(n, 3 * H, generator=torch.Generator().manual_seed(2))
    return head.compute_logits(head(embeds, head.project_taps([taps]), torch.arange(n), meta, kv))


def test_public_checkpoint_loads_and_round_trips(tmp_path):
    original = _third_party_head(tmp_path / "public")
    head = load_eagle3_head(tmp_path / "public", TARGET, torch.float32, torch.device("cpu"), 512)
    assert head.config.target_layers == (1, 4, 6)
    assert head.config.draft_vocab_size == DRAFT_VOCAB
    draft_ids = torch.arange(DRAFT_VOCAB)
    assert torch.equal(head.to_target_ids(draft_ids), original["t2d"].nonzero().squeeze(1))

    save_eagle3_head(head, tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in saved.items()} == PUBLIC_SHAPES
    for name in PUBLIC_SHAPES:
        assert torch.equal(saved[name], original[name]), name
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["target_hidden_size"] == H
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]

    again = load_eagle3_head(tmp_path / "saved", TARGET, torch.float32, torch.device("cpu"), 512)
    assert torch.equal(_run(head, [3, 4, 5]), _run(again, [3, 4, 5]))
    assert _run(head, [3, 4, 5]).shape == (3, DRAFT_VOCAB)


def test_random_head_uses_default_taps_and_the_full_vocabulary():
    head = load_eagle3_head(None, TARGET, torch.float32, torch.device("cpu"), 512)
    assert head.config.target_layers == default_target_layers(LAYERS) == (1, 3, 4)
    assert head.config.draft_vocab_size == VOCAB
    assert torch.equal(head.to_target_ids(torch.arange(VOCAB)), torch.arange(VOCAB))


def test_a_head_saved_in_shards_loads_the_same(tmp_path):
    original = load_eagle3_head(None, TARGET, torch.float32, torch.device("cpu"), 512, seed=4)
    save_eagle3_head(original, tmp_path, max_shard_bytes=40_000)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    assert all((tmp_path / s).stat().st_size <= 40_000 + 70_000 for s in shards)  # one big tensor may exceed
    loaded = load_eagle3_head(tmp_path, TARGET, torch.float32, torch.device("cpu"), 512)
    for (name, a), b in zip(original.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_head_looks_its_tokens_up_and_stops_rows_nobody_reads():
    # The draft programs pass the embedding table with token ids, and ask only for each sequence's last catch-up
    # row: the same numbers as embedding first and selecting after, and every row's KV is still stored.
    head = load_eagle3_head(None, TARGET, torch.float32, torch.device("cpu"), 512, seed=3)
    g = torch.Generator().manual_seed(5)
    table, ids = torch.randn(VOCAB, H, generator=g), torch.tensor([5, 299, 5, 17, 0])
    hidden = head.project_taps([torch.randn(5, 3 * H, generator=g)])
    meta = AttentionMetadata.build([3, 2], [0, 0], [[0], [1]], 16, torch.device("cpu"))
    caches = [torch.zeros(1, 2, 32, KV_HEADS, HEAD_DIM) for _ in range(2)]
    full = head(table[ids], hidden, torch.tensor([0, 1, 2, 0, 1]), meta, caches[0])
    rows = torch.tensor([2, 4])
    picked = head(table, hidden, torch.tensor([0, 1, 2, 0, 1]), meta, caches[1], ids, rows=rows)
    torch.testing.assert_close(picked, full[rows], atol=1e-6, rtol=1e-6)
    assert torch.equal(caches[0], caches[1]) and caches[1].abs().sum() > 0
