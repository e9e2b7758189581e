"""DeepSeek-V3 (Kimi-K2's and Moonlight's architecture): greedy output equals transformers token for token
(fp32, CPU) under continuous batching, chunked prefill and preemption; the KV pool keeps only the latent; MLA's
absorbed form equals the expanded one; speculative greedy output equals plain greedy output."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from specserve.config import SpecConfig
from specserve.engine.factory import build_engine_core, shipped_config
from specserve.kv.pool import dense_kv_bytes_per_token, kv_bytes_per_token
from specserve.layers.attention import AttentionMetadata
from specserve.layers.mla import MultiHeadLatentAttention
from specserve.layers.rotary import RotaryEmbedding
from specserve.models.loader import build_model, load_eagle3_head, read_model_config, save_eagle3_head
from specserve.models.registry import model_config
from specserve.server.metrics import Metrics

from engine_runs import check_matches_hf, count_accepted, hf_greedy, make_prompts, run_staggered, tight_config

KINDS = ["deepseek-v3", "deepseek-v3-qlora"]


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_deepseek_v3_matches_transformers(tiny_checkpoint, kind):
    path = tiny_checkpoint(kind)
    check_matches_hf(tight_config(str(path), max_total_tokens=200), path, vocab=512)


def test_the_pool_keeps_only_the_latent_per_token_and_layer(tiny_checkpoint, caplog):
    path = tiny_checkpoint("deepseek-v3")
    cfg = read_model_config(path)
    with caplog.at_level("INFO", logger="specserve.engine.factory"):
        engine, _ = build_engine_core(tight_config(str(path), max_total_tokens=200), progress=False)
    latent = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    kv_cache = engine.runner.kv_cache
    assert kv_cache.shape[:2] == (cfg.num_layers, 1) and kv_cache.shape[3:] == (1, latent)
    per_token = cfg.num_layers * latent * 4
    assert kv_bytes_per_token(cfg, torch.float32) == per_token
    m = cfg.mla
    dense = cfg.num_layers * cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 4
    assert f"the target's latent: {per_token}; expanded keys and values would be {dense})" in caplog.text
    assert engine.stats().dense_kv_bytes_per_token == dense > per_token
    metrics = Metrics()
    metrics.on_stats(engine.stats())
    assert f"specserve_kv_cache_bytes_per_token {per_token}.0" in metrics.render().decode()


def test_moonlight_config_is_shipped_with_a_latent_cache():
    import json

    cfg = model_config(json.loads(shipped_config("moonlight-16b-a3b").read_text()))
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.mla.q_lora_rank is None
    assert cfg.kv_entry_shape == (1, 1, 512 + 64)
    # 31,104 bytes per token in bf16; its heads' keys (192 wide) and values (128) expanded would take 276,480.
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 27 * 576 * 2
    assert dense_kv_bytes_per_token(cfg, torch.bfloat16) == 27 * 16 * (192 + 128) * 2 == 276_480
    assert cfg.moe.sparse_layers == tuple(range(1, 27)) and cfg.moe.num_shared_experts == 2


def test_random_weights_and_bf16_build_and_run(tiny_checkpoint):
    """`--load-format dummy` builds the model from its config alone; in bf16 the router stays in fp32."""
    path = tiny_checkpoint("deepseek-v3")
    config = replace(tight_config(str(path), max_total_tokens=200), load_format="dummy")
    outputs, _ = run_staggered(build_engine_core(config, progress=False)[0], make_prompts(512), max_tokens=4)
    assert all(len(out) == 4 for out in outputs)
    model = build_model(read_model_config(path), None, torch.bfloat16, torch.device("cpu"), 64, progress=False)
    router = model.layers[1].mlp.gate
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
    assert model.layers[1].mlp.experts.w13.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def mla_layer(tiny_checkpoint):
    cfg = read_model_config(tiny_checkpoint("deepseek-v3-qlora"))
    torch.manual_seed(0)
    layer = MultiHeadLatentAttention(cfg)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.3 * torch.randn_like(param))
    rotary = RotaryEmbedding(cfg.mla.qk_rope_head_dim, 256, cfg.rope_theta, cfg.rope_scaling)
    return cfg, layer.eval().requires_grad_(False), rotary


def _expanded_reference(layer, q_nope, q_pe, latents, scale):
    """One sequence's last len(q) queries over its whole context, from keys and values expanded per head."""
    c, k_pe = latents.split([layer.rank, layer.rope_dim], dim=-1)
    k_nope, v = layer.kv_b_proj(c).view(len(c), layer.num_heads, -1).split([layer.nope_dim, layer.v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, layer.num_heads, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    past = len(c) - len(q)
    mask = torch.arange(len(c))[None, :] <= past + torch.arange(len(q))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(len(q), -1)


def test_absorbed_attention_equals_the_expanded_form(mla_layer):
    """Prompts of 5 and 11 tokens, then one decode row each and a chunk of 3 for the first: the absorbed form
    (latent queries over cached latents) against keys and values expanded per head."""
    cfg, layer, rotary = mla_layer
    page, lens = 4, [5, 11]
    tables = [[0, 1, 2], [3, 4, 5, 6]]
    kv_cache = torch.zeros(1, 7 * page, 1, cfg.mla.latent_dim)  # one layer's plane
    x = torch.randn(sum(lens), cfg.hidden_size)
    positions = torch.cat([torch.arange(n) for n in lens])
    prompts = AttentionMetadata.build(lens, [0, 0], tables, page, torch.device("cpu"))
    expanded = layer(x, positions, rotary, kv_cache, prompts)
    absorbed_kv = torch.zeros_like(kv_cache)
    absorbed = layer.o_proj(_absorbed(layer, x, positions, rotary, absorbed_kv, prompts))
    torch.testing.assert_close(absorbed, expanded, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(absorbed_kv, kv_cache)

    step_lens, starts = [3, 1], [5, 11]
    x = torch.randn(sum(step_lens), cfg.hidden_size)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, step_lens)])
    meta = AttentionMetadata.build(step_lens, starts, tables, page, torch.device("cpu"))
    out = _absorbed(layer, x, positions, rotary, kv_cache, meta)
    q_nope, q_pe = _queries(layer, x, positions, rotary)
    first = 0
    for n, start, table in zip(step_lens, starts, tables):
        pos = torch.arange(start + n)
        slots = torch.tensor(table)[pos // page] * page + pos % page
        ref = _expanded_reference(layer, q_nope[first:first + n], q_pe[first:first + n], kv_cache[0, slots, 0],
                                  layer.scale)
        torch.testing.assert_close(out[first:first + n], ref, rtol=1e-4, atol=1e-4)
        first += n


def _queries(layer, x, positions, rotary):
    q = layer._queries(x).view(len(x), layer.num_heads, -1)
    q_nope, q_pe = q.split([layer.nope_dim, layer.rope_dim], dim=-1)
    k_dummy = torch.zeros(len(x), 1, layer.rope_dim)
    return q_nope, rotary(positions, layer._halved(q_pe), k_dummy)[0]


def _absorbed(layer, x, positions, rotary, kv_cache, meta):
    """The layer's absorbed form on any step, stored latents included."""
    q_nope, q_pe = _queries(layer, x, positions, rotary)
    c, k_pe = layer.kv_a_proj_with_mqa(x).split([layer.rank, layer.rope_dim], dim=-1)
    k_pe = rotary(positions, torch.zeros(len(x), 1, layer.rope_dim), layer._halved(k_pe).view(len(x), 1, -1))[1]
    entry = torch.cat([layer.kv_a_layernorm(c), k_pe.view(len(x), -1)], dim=-1).view(len(x), 1, -1)
    kv_cache[0].index_copy_(0, meta.slot_mapping, entry)
    return layer.attend_absorbed(q_nope, q_pe, entry, kv_cache, meta)


SPEC_TOKENS = 12  # per request: a few speculative steps each, a short run


@pytest.fixture(scope="module")
def greedy_reference(tiny_checkpoint):
    target = tiny_checkpoint("deepseek-v3")
    prompts = make_prompts(512)
    return target, prompts, hf_greedy(target, prompts, max_tokens=SPEC_TOKENS)


@pytest.fixture(scope="module")
def eagle3_head(tiny_checkpoint, tmp_path_factory):
    """A random EAGLE-3 head shaped like one layer of the tiny DeepSeek-V3 (its heads v_head_dim wide)."""
    head_dir = tmp_path_factory.mktemp("deepseek-eagle3")
    target = read_model_config(tiny_checkpoint("deepseek-v3"))
    save_eagle3_head(load_eagle3_head(None, target, torch.float32, torch.device("cpu"), 512, seed=7), head_dir)
    return head_dir


# (algorithm, topk, num_steps, num_draft_tokens, tree program): an EAGLE-3 head's chain (its step program) and
# tree (the general search, and the tree program), and a dense draft model's tree (the general search, whose
# verify rows carry tree masks; its chains take the same path).
SPEC_SHAPES = [("EAGLE3", 1, 3, None, False), ("EAGLE3", 4, 3, 16, False), ("EAGLE3", 4, 3, 16, True),
               ("DRAFT_MODEL", 2, 3, 8, False)]


@pytest.mark.parametrize("algorithm,topk,num_steps,num_draft_tokens,tree_program", SPEC_SHAPES)
def test_speculative_greedy_equals_plain_greedy(tiny_checkpoint, greedy_reference, eagle3_head, switches, algorithm,
                                                topk, num_steps, num_draft_tokens, tree_program):
    switches(tree_program_on_cpu=tree_program)
    target, prompts, reference = greedy_reference
    # The draft model is a dense tiny Llama of the same vocabulary: it keeps its own dense cache.
    draft = eagle3_head if algorithm == "EAGLE3" else tiny_checkpoint("llama", True)
    spec = SpecConfig(algorithm, str(draft), num_steps, topk, num_draft_tokens)
    engine, _ = build_engine_core(replace(tight_config(str(target), 136), spec=spec), progress=False)
    accepted = count_accepted(engine)
    ours, _ = run_staggered(engine, prompts, max_tokens=SPEC_TOKENS)
    assert ours == reference
    assert accepted, "no step speculated"
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_pages
