"""Speculative decoding inside continuous batching: greedy output with speculation equals the greedy
reference token for token, with a draft length that changes at every step and per request (0 included),
under staggered arrivals, chunked prefill and preemption; and no page leaks."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from specserve.config import SpecConfig
from specserve.engine.factory import build_engine_core
from specserve.speculative.search import search_depth

from engine_runs import engine_greedy, hf_greedy, make_prompts, run_staggered, tight_config
from tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def unrelated_draft(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft-unrelated")
    write_tiny_checkpoint("llama", path, seed=123)  # same shape and vocab, different weights: few accepts
    return path


@pytest.fixture(scope="module")
def drafts(tiny_checkpoint, random_eagle3_head, noisy_draft_model):
    """The three drafts the greedy check runs with: a random EAGLE-3 head (almost nothing accepted), a
    copy of the target (almost everything), and a noisy copy of the target (in between)."""
    target = tiny_checkpoint("llama", True)
    return {
        "eagle3-random": ("EAGLE3", random_eagle3_head),
        "copy": ("DRAFT_MODEL", target),
        "noisy-copy": ("DRAFT_MODEL", noisy_draft_model),
    }


def _spec_engine(target, draft, num_steps: int, max_total_tokens: int = 136, algorithm: str = "DRAFT_MODEL",
                 topk: int = 1, num_draft_tokens: int | None = None):
    spec = SpecConfig(algorithm, str(draft), num_steps, topk, num_draft_tokens)
    engine, _ = build_engine_core(replace(tight_config(str(target), max_total_tokens), spec=spec), progress=False)
    return engine


def _count_speculation(engine, topk: int = 1, num_steps: int = 1) -> dict[str, int]:
    """Sums drafted and accepted tokens over the run, and the most that could have been accepted: the
    depth of each step's tree."""
    totals = {"spec_steps": 0, "drafted": 0, "accepted": 0, "reachable": 0}
    step = engine.step

    def counted():
        deltas = step()
        for d in deltas:
            if d.step_accepted is not None:
                totals["spec_steps"] += 1
                totals["drafted"] += d.step_drafted
                totals["accepted"] += d.step_accepted
                totals["reachable"] += search_depth(d.step_drafted, topk, num_steps)
        return deltas

    engine.step = counted
    return totals


@pytest.fixture(scope="module")
def greedy_reference(tiny_checkpoint):
    prompts = make_prompts(512)
    return prompts, hf_greedy(tiny_checkpoint("llama", True), prompts)


# (topk, num_steps, num_draft_tokens): chains of 1, 3 and 5 drafts, and trees of 2 to 16 verified tokens.
SHAPES = [(1, 1, None), (1, 3, None), (1, 5, None), (2, 3, 8), (4, 3, 16), (4, 5, 16), (2, 5, 2)]


@pytest.mark.parametrize("draft_kind", ["eagle3-random", "copy", "noisy-copy"])
@pytest.mark.parametrize("topk,num_steps,num_draft_tokens", SHAPES)
def test_greedy_with_speculation_matches_the_reference(tiny_checkpoint, drafts, greedy_reference, draft_kind, topk,
                                                       num_steps, num_draft_tokens):
    target = tiny_checkpoint("llama", True)
    prompts, reference = greedy_reference
    algorithm, draft = drafts[draft_kind]
    engine = _spec_engine(target, draft, num_steps, algorithm=algorithm, topk=topk, num_draft_tokens=num_draft_tokens)
    totals = _count_speculation(engine, topk, num_steps)
    ours, _ = run_staggered(engine, prompts)
    assert ours == reference
    assert engine.scheduler.num_preemptions > 0
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages
    alloc.check_invariants()
    # Each draft sits where it claims on the acceptance scale: the share of the searched depth accepted. A
    # copy's greedy path fills a chain; in a tree, shallow siblings can outscore its deepest nodes.
    share = totals["accepted"] / totals["reachable"]
    expected = {"eagle3-random": (0.0, 0.05), "copy": (0.9 if topk == 1 else 0.5, 1.0), "noisy-copy": (0.15, 0.85)}
    assert expected[draft_kind][0] <= share <= expected[draft_kind][1], totals


def test_a_copy_of_the_target_saves_steps(tiny_checkpoint, greedy_reference):
    target = tiny_checkpoint("llama", True)
    prompts, _ = greedy_reference
    _, spec_steps = run_staggered(_spec_engine(target, target, num_steps=3), prompts)
    plain_engine, _ = build_engine_core(tight_config(str(target), 200), progress=False)
    _, plain_steps = run_staggered(plain_engine, prompts)
    assert spec_steps < 0.7 * plain_steps, (spec_steps, plain_steps)


@pytest.mark.parametrize("draft_kind,topk,num_steps,num_draft_tokens", [("copy", 1, 7, None), ("noisy-copy", 4, 3, 16)])
def test_draft_length_can_change_every_step_and_per_request(tiny_checkpoint, drafts, draft_kind, topk, num_steps,
                                                            num_draft_tokens):
    target = tiny_checkpoint("llama", True)
    prompts = make_prompts(512, seed=3)
    reference, _ = engine_greedy(tight_config(str(target), 200), prompts)
    algorithm, draft = drafts[draft_kind]
    engine = _spec_engine(target, draft, num_steps, algorithm=algorithm, topk=topk, num_draft_tokens=num_draft_tokens)
    rng = random.Random(0)
    most = engine.scheduler.max_draft_tokens
    engine.scheduler.draft_plan = lambda request: rng.choice([0, 0, 1, 2, most // 2, most])
    ours, _ = run_staggered(engine, prompts)
    assert ours == reference
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_pages


@pytest.mark.parametrize("algorithm,topk", [("DRAFT_MODEL", 1), ("EAGLE3", 2)])
def test_thousands_of_speculative_steps_leak_no_pages(tiny_checkpoint, unrelated_draft, drafts, algorithm, topk):
    target = tiny_checkpoint("llama", True)
    draft = unrelated_draft if algorithm == "DRAFT_MODEL" else drafts["eagle3-random"][1]
    engine = _spec_engine(target, draft, num_steps=3, max_total_tokens=160, algorithm=algorithm, topk=topk,
                          num_draft_tokens=7)
    rng = random.Random(1)
    engine.scheduler.draft_plan = lambda request: rng.choice([0, 1, 3, 6])
    from specserve.core import SamplingParams

    steps, added = 0, 0
    while steps < 2000:
        if added < 150 and rng.random() < 0.2:
            n = rng.randint(1, 30)
            engine.add_request(f"r{added}", [rng.randrange(3, 512) for _ in range(n)],
                               SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 1.0]),
                                              ignore_eos=True))
            added += 1
        if engine.has_work():
            engine.step()
            engine.scheduler.allocator.check_invariants()
        if rng.random() < 0.01 and engine.scheduler.requests:
            engine.abort([rng.choice(list(engine.scheduler.requests))])
        steps += 1
        if added >= 150 and not engine.has_work():
            break
    while engine.has_work():
        engine.step()
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages


def test_offline_api_reports_speculation_figures(tiny_checkpoint):
    from specserve.llm import LLM
    from specserve.core import SamplingParams

    target = tiny_checkpoint("llama", True)
    llm = LLM(model=str(target), max_total_tokens=1024, spec=SpecConfig("DRAFT_MODEL", str(target), 4))
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True))[0]
    # A copy of the target is always accepted: 1 prefill token, then 4 steps of 4 drafts + 1 bonus.
    assert len(out.token_ids) == 21
    assert out.num_spec_steps == 4 and out.num_drafted_tokens == 16 and out.num_accepted_tokens == 16
    assert out.mean_acceptance_length == 5.0
    plain = LLM(model=str(target), max_total_tokens=1024).generate([[5, 6, 7, 8]],
                                                                  SamplingParams(max_tokens=21, temperature=0.0))[0]
    assert plain.num_spec_steps == 0 and plain.mean_acceptance_length is None


@pytest.mark.parametrize("target_kind,topk,num_steps,num_draft_tokens",
                         [("llama", 1, 1, None), ("llama", 2, 2, 4), ("qwen3-moe", 1, 1, None),
                          ("deepseek-v3", 2, 2, 4)])
def test_sampling_with_speculation_keeps_the_target_distribution(tmp_path, target_kind, topk, num_steps,
                                                                 num_draft_tokens):
    """Chi-square on a 16-token vocabulary: the joint law of the first two sampled tokens equals the
    target's exact one (computed with transformers), while the second token comes out of speculative
    verification against an unrelated draft (a chain, or a tree with two children at the root), in one
    continuous batch of thousands of requests. The target is dense, or mixture-of-experts (each verify row
    routed to its own experts), or DeepSeek-V3 (tree rows verified over the latent cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tiny_checkpoints import TINY_BASE, TINY_CONFIGS
    from specserve.core import SamplingParams

    vocab, trials, prompt = 16, 4000, [3, 7, 1, 12]
    target, draft = tmp_path / "target", tmp_path / "draft"
    for path, seed, kind in ((target, 0, target_kind), (draft, 5, "llama")):
        _write_small_vocab(path, vocab, seed, TINY_BASE, TINY_CONFIGS[kind])
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
        follow = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = torch.softmax(hf(follow).logits[:, -1], -1)
    expected = p1[:, None] * p2 * trials

    spec = SpecConfig("DRAFT_MODEL", str(draft), num_steps, topk, num_draft_tokens)
    config = replace(tight_config(str(target), 4 * trials * 8), spec=spec)
    config = replace(config, scheduler=replace(config.scheduler, max_running_requests=512, chunked_prefill_size=4096))
    engine, _ = build_engine_core(config, progress=False)
    torch.manual_seed(0)
    params = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)
    for i in range(trials):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {}
    drafted = 0
    while engine.has_work():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            drafted += delta.step_drafted
    assert drafted >= trials  # every request's second token went through verification
    counts = torch.zeros(vocab, vocab)
    for seq in tokens.values():
        counts[seq[0], seq[1]] += 1
    cells = expected > 5
    chi2 = ((counts - expected)[cells] ** 2 / expected[cells]).sum().item()
    dof = int(cells.sum()) - 1
    z = 3.090  # 0.999 quantile, Wilson-Hilferty
    assert chi2 < dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3, (chi2, dof)


def _write_small_vocab(path, vocab: int, seed: int, base: dict, kind: dict) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {**base, **kind, "vocab_size": vocab, "bos_token_id": 0, "eos_token_id": 1,
                "initializer_range": 0.1}
    model_type = settings.pop("model_type")
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **settings)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


class BranchingOracle:
    """Proposes trees where every level holds a wrong sibling before the target's own next token, and the
    truth is sometimes cut off, so the accepted path is nodes 2, 4, 6... and KV must be compacted."""

    def __init__(self, full_sequences: dict[str, list[int]], seed: int) -> None:
        from specserve.speculative.tree import DraftTree

        self.full, self.rng, self.tree_type = full_sequences, random.Random(seed), DraftTree
        self.capture_layers = ()

    def observe(self, captured, slot_mapping):
        pass

    def extend_drafter(self, batch):
        pass

    def move_slots(self, src, dst):
        pass

    def propose(self, batch):
        trees = {}
        for i, seq in enumerate(batch.seqs):
            if not seq.num_draft_tokens:
                continue
            truth = self.full[seq.request_id][seq.start_pos + 1:]
            tokens, parents, node = [seq.token_ids[-1]], [-1], 0
            for depth in range(seq.num_draft_tokens // 2):
                if depth >= len(truth) or self.rng.random() < 0.15:
                    break
                tokens += [(truth[depth] + 1) % 512, truth[depth]]
                parents += [node, node]
                node = len(tokens) - 1
            trees[i] = self.tree_type(tokens, parents)
        return trees


def test_tree_verification_with_kv_compaction_matches_the_reference(tiny_checkpoint):
    target = tiny_checkpoint("llama", True)
    prompts = make_prompts(512, seed=7)
    reference = hf_greedy(target, prompts)
    engine, _ = build_engine_core(tight_config(str(target), 136), progress=False)
    engine.runner.proposer = BranchingOracle({str(i): p + r for i, (p, r) in enumerate(zip(prompts, reference))}, 0)
    rng = random.Random(2)
    engine.scheduler.draft_plan = lambda request: rng.choice([0, 2, 5, 8])
    engine.scheduler.max_draft_tokens = 8
    ours, steps = run_staggered(engine, prompts)
    assert ours == reference
    plain_engine, _ = build_engine_core(tight_config(str(target), 136), progress=False)
    assert steps < run_staggered(plain_engine, prompts)[1]  # the accepted branches did save steps
    assert engine.scheduler.num_preemptions > 0
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages
    alloc.check_invariants()


def test_sglang_flags_build_the_spec_config():
    from specserve.cli import build_parser, engine_config

    args = build_parser().parse_args([
        "serve", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "head",
        "--speculative-num-steps", "5", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16",
    ])
    spec = engine_config(args).spec
    assert spec == SpecConfig("EAGLE3", "head", 5, 4, 16) and spec.max_drafts == 15
    assert SpecConfig("EAGLE3", "head", 3, 1, 9).num_draft_tokens == 4  # a chain verifies steps + 1, as in SGLang
    with pytest.raises(ValueError, match="num-draft-tokens"):
        SpecConfig("EAGLE3", "head", 1, 2, 8)  # one level of top-2 offers two drafts
    with pytest.raises(ValueError, match="draft-model-path"):
        SpecConfig("DRAFT_MODEL")
    args = build_parser().parse_args(["serve", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                                      "head", "--speculative-draft-model-quantization", "fp8"])
    assert engine_config(args).spec.draft_model_quantization == "fp8"
    with pytest.raises(ValueError, match="applies to an EAGLE3 head"):  # asked for with speculation off
        engine_config(build_parser().parse_args(["serve", "--speculative-draft-model-quantization", "fp8"]))
    with pytest.raises(ValueError, match="applies to an EAGLE3 head"):
        SpecConfig("DRAFT_MODEL", "draft", draft_model_quantization="fp8")
    with pytest.raises(ValueError, match="unsupported draft model quantization"):
        SpecConfig("EAGLE3", "head", draft_model_quantization="int4")


def test_the_embedded_default_model_speculates_with_the_bundled_head_by_default():
    from specserve import draft_heads
    from specserve.cli import build_parser, engine_config

    head = str(draft_heads.SMOLLM2_HEAD)

    def spec_of(*argv, command="serve"):
        args = build_parser().parse_args([command, "--device", "cpu", *argv])
        return engine_config(args, bundled_head=command in ("serve", "generate")).spec

    default = spec_of()
    assert default == SpecConfig("EAGLE3", head, draft_heads.SMOLLM2_DEFAULT_STEPS, draft_heads.SMOLLM2_DEFAULT_TOPK,
                                 adaptive=True)
    assert spec_of("--speculative-num-steps", "5", "--speculative-eagle-topk", "4",
                   "--speculative-num-draft-tokens", "16") == SpecConfig("EAGLE3", head, 5, 4, 16, adaptive=True)
    assert not spec_of("--disable-speculative-adaptive").adaptive
    # Benchmarks draft every step unless asked to adapt; the head is found.
    assert spec_of("--speculative-algorithm", "EAGLE3", command="bench") == replace(default, adaptive=False)
    assert spec_of("--speculative-algorithm", "EAGLE3", "--speculative-adaptive", command="bench") == default
    assert spec_of(command="bench").algorithm is None  # benchmarks measure what their flags ask for
    assert spec_of("--speculative-algorithm", "NONE").algorithm is None
    assert spec_of("--model-path", "some-model").algorithm is None  # no head is known for other models
    assert spec_of("--load-format", "dummy").algorithm is None
    with pytest.raises(ValueError, match="at least 1"):
        spec_of("--speculative-num-steps", "0")
    gpu = build_parser().parse_args(["serve", "--device", "cuda"])
    assert engine_config(gpu, bundled_head=True).spec.algorithm is None  # measured to lose under load there
    gpu_head = build_parser().parse_args(["serve", "--device", "cuda", "--speculative-algorithm", "EAGLE3"])
    assert engine_config(gpu_head, bundled_head=True).spec.adaptive  # asked for: it adapts on any device


@pytest.mark.parametrize("topk, num_steps, num_draft_tokens, quantization",
                         [(1, 3, None, None), (4, 5, 16, None), (1, 3, None, "fp8")])
def test_the_bundled_head_is_small_lossless_and_accepts(smollm2_dir, topk, num_steps, num_draft_tokens,
                                                          quantization):
    """The shipped head: bf16 shards of at most 16 MiB, a draft vocabulary of at most 16k tokens, greedy
    output identical to plain decoding of the embedded model, and real acceptance (a random head gets 1.0);
    also with its projections quantized to fp8 (the output is the target's all the same)."""
    import json

    import torch

    from specserve import draft_heads
    from specserve.llm import LLM
    from specserve.core import SamplingParams

    head = draft_heads.SMOLLM2_HEAD
    assert all(p.stat().st_size <= 16 * 2**20 for p in head.glob("*.safetensors"))
    assert json.loads((head / "config.json").read_text())["draft_vocab_size"] <= 16384
    llm = LLM(model=str(smollm2_dir), max_total_tokens=2048)
    messages = [[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                [{"role": "user", "content": "Write a short poem about the sea."}]]
    prompts = [llm.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = llm.generate(prompts, params)
    spec_llm = LLM(model=str(smollm2_dir), max_total_tokens=2048,
                   spec=SpecConfig("EAGLE3", str(head), num_steps, topk, num_draft_tokens,
                                   draft_model_quantization=quantization))
    if quantization:  # the head drafting here holds fp8 values (a CPU keeps them in its dtype: Linear.quantize_fp8)
        from specserve.layers.linear import quantize_fp8_rows

        drafted_with = spec_llm.engine.runner.proposer.drafter.head.midlayer.mlp.down_proj.weight
        quantized, scale = quantize_fp8_rows(drafted_with)
        assert torch.equal(drafted_with.float(), quantized.float() * scale[:, None])
    spec = spec_llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    steps = sum(o.num_spec_steps for o in spec)
    tau = (sum(o.num_accepted_tokens for o in spec) + steps) / steps
    assert tau > 1.3, tau  # 1.46 for the chain, measured; a random head gives 1.0
