"""Training EAGLE-3 heads: the training-time test computes what inference computes, vocabulary maps
round-trip, a resumed run continues the same schedule, and a tiny end-to-end run learns and drafts."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import pytest
import torch

from specserve.config import ModelConfig
from specserve.layers.attention import AttentionMetadata
from specserve.models.eagle3 import Eagle3Config, Eagle3Head
from specserve.train.datagen import Sample, draft_vocabulary
from specserve.train.ttt import TTTBatch, unrolled_loss

H, VOCAB, T = 64, 300, 12
CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=H, intermediate_size=96,
                  num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16)


def _head(seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config(CFG, VOCAB, H, (1, 3, 4)), 256)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.2)
    return head.eval()


def test_training_time_test_computes_what_drafting_computes():
    """Step 0 equals a catch-up pass over the sequence; steps 1 and 2 of chain t equal feeding the chain's
    nodes one by one on top of the catch-up KV (as TreeProposer does), with the head's own states."""
    head, embed = _head(), torch.nn.Embedding(VOCAB, H)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (1, T), generator=g)
    taps = torch.randn(1, T, 3 * H, generator=g)
    batch = TTTBatch(ids, taps, torch.randn(1, T, VOCAB, generator=g), torch.ones(1, T))
    with torch.no_grad():
        ttt = unrolled_loss(head, embed, batch, 3, keep_logits=True).logits
        kv = torch.zeros(1, 2, 64, CFG.num_kv_heads, CFG.head_dim)
        n = T - 1  # catch-up: position j pairs the taps of j with token j+1
        meta = AttentionMetadata.build([n], [0], [[0]], 64, torch.device("cpu"))
        states = head(embed(ids[0, 1:]), head.fc(taps[0, :n]), torch.arange(n), meta, kv)
        torch.testing.assert_close(head.compute_logits(states), ttt[0][0, :n], rtol=1e-4, atol=1e-4)
        for t in (0, 3, T - 4):
            state, chain_slots = states[t:t + 1], []
            for step in (1, 2):
                slot = 40 + step  # scratch slots after the context
                chain_slots.append(slot)
                context = torch.tensor(list(range(t + 1)) + chain_slots)
                meta = AttentionMetadata.from_slots([context], [torch.ones(1, len(context), dtype=torch.bool)],
                                                    torch.device("cpu"))
                state = head(embed(ids[0, t + 1 + step:t + 2 + step]), state, torch.tensor([t + step]), meta, kv)
                torch.testing.assert_close(head.compute_logits(state)[0], ttt[step][0, t], rtol=1e-4, atol=1e-4)


def test_unrolled_loss_shapes_and_masking():
    head, embed = _head(), torch.nn.Embedding(VOCAB, H)
    batch = TTTBatch(torch.randint(VOCAB, (2, T)), torch.randn(2, T, 3 * H), torch.randn(2, T, VOCAB),
                     torch.ones(2, T))
    result = unrolled_loss(head, embed, batch, 7, keep_logits=True)
    assert len(result.kl) == len(result.accuracy) == len(result.logits) == 7
    assert all(lg.shape == (2, T, VOCAB) for lg in result.logits)
    assert result.loss.ndim == 0 and result.loss.item() > 0
    result.loss.backward()
    assert head.fc.weight.grad is not None and head.midlayer.mlp.down_proj.weight.grad.abs().sum() > 0
    weighted = unrolled_loss(head, embed, batch, 7, decay=0.5)
    expected = sum(kl * 0.5**k for k, kl in enumerate(weighted.kl)) / sum(0.5**k for k in range(7))
    assert weighted.loss.item() == pytest.approx(expected, rel=1e-5)
    nothing = replace(batch, loss_mask=torch.zeros(2, T))
    assert unrolled_loss(head, embed, nothing, 7).loss.item() == 0.0


def test_draft_vocabulary_and_maps_round_trip(tmp_path):
    from specserve.models.loader import load_eagle3_head, save_eagle3_head
    from specserve.models.eagle3 import vocab_maps

    answers = [5] * 9 + [7] * 5 + [250] * 7 + [3] * 2
    ids = torch.tensor([1, 2] + answers)
    mask = torch.tensor([0] + [1] * (len(ids) - 2) + [0])
    sample = Sample(ids, torch.zeros(len(ids), 3 * H), torch.zeros(len(ids), H), mask)
    chosen = draft_vocabulary([sample], 3, VOCAB)
    assert chosen.tolist() == [5, 7, 250]  # the three most frequent answer tokens, sorted
    assert Counter(sample.answer_ids.tolist())[5] == 9
    head = _head()
    head = Eagle3Head(Eagle3Config(CFG, 3, H, (1, 3, 4)), 256)
    d2t, t2d = vocab_maps(chosen, VOCAB)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    assert head.to_target_ids(torch.arange(3)).tolist() == [5, 7, 250]
    save_eagle3_head(head, tmp_path)
    loaded = load_eagle3_head(tmp_path, CFG, torch.float32, torch.device("cpu"), 256)
    assert loaded.to_target_ids(torch.arange(3)).tolist() == [5, 7, 250]
    assert loaded.t2d.nonzero().squeeze(1).tolist() == [5, 7, 250]


def _fake_samples(count: int, seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(6, 14, (1,), generator=g))
        out.append(Sample(torch.randint(VOCAB, (n,), generator=g), torch.randn(n, 3 * H, generator=g),
                          torch.randn(n, H, generator=g), torch.ones(n, dtype=torch.uint8)))
    return out


class _Target(torch.nn.Module):
    """What the trainer reads from a target: config, embedding, lm_head and final norm."""

    def __init__(self) -> None:
        super().__init__()
        self.config = CFG
        self.embed_tokens = torch.nn.Embedding(VOCAB, H)
        self.lm_head = torch.nn.Linear(H, VOCAB, bias=False)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(H))


def test_held_out_samples_are_a_fixed_disjoint_tenth_at_most():
    from specserve.train.trainer import hold_out

    samples = _fake_samples(50, 0)
    train, held = hold_out(samples, 8, seed=3)
    assert len(held) == 5 and len(train) == 45  # capped at a tenth
    ids = {id(s) for s in train}
    assert not any(id(s) in ids for s in held) and {id(s) for s in samples} == ids | {id(s) for s in held}
    again, held_again = hold_out(samples, 8, seed=3)
    assert [id(s) for s in held_again] == [id(s) for s in held]
    assert [id(s) for s in hold_out(samples, 8, seed=4)[1]] != [id(s) for s in held]
    none_held = hold_out(samples, 0, seed=3)
    assert [id(s) for s in none_held[0]] == [id(s) for s in samples] and none_held[1] == []


def test_length_sorted_batches_cover_a_pass_once_with_little_padding():
    from specserve.train.trainer import length_sorted_batches

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 640, (1000,), generator=g).tolist()
    batches = length_sorted_batches(lengths, batch_size=8, pool=16, seed=5)
    flat = [i for b in batches for i in b]
    assert len(batches) == 125 and all(len(b) == 8 for b in batches) and sorted(flat) == list(range(1000))

    def padded_tokens(groups):
        return sum(len(b) * max(lengths[i] for i in b) for b in groups)

    shuffled = torch.randperm(1000, generator=g).tolist()
    random_batches = [shuffled[i:i + 8] for i in range(0, 1000, 8)]
    assert padded_tokens(batches) < 0.7 * padded_tokens(random_batches)
    assert padded_tokens(batches) < 1.1 * sum(lengths)
    # The batches of a pool are spread through the pass, not left in ascending order.
    first_pool = [max(lengths[i] for i in b) for b in batches[:16]]
    assert first_pool != sorted(first_pool)
    assert length_sorted_batches(lengths, 8, 16, seed=5) == batches != length_sorted_batches(lengths, 8, 16, seed=6)
    # The remainder sits the pass out, drawn at random: not always the longest samples.
    few = lengths[:21]
    sat_out = [set(range(21)) - {i for b in length_sorted_batches(few, 8, 16, seed) for i in b} for seed in range(20)]
    longest = set(sorted(range(21), key=few.__getitem__)[-5:])
    assert all(len(out) == 5 for out in sat_out) and set().union(*sat_out) != longest
    assert len({frozenset(out) for out in sat_out}) > 1
    # Fewer samples than a batch make one batch.
    assert sorted(length_sorted_batches(lengths[:5], 8, 16, 0)[0]) == list(range(5))
    # pool 1 sorts nothing across batches: each batch is one slice of the shuffled order.
    unsorted = length_sorted_batches(lengths, 8, 1, seed=5)
    assert padded_tokens(unsorted) > 0.9 * padded_tokens(random_batches)


def test_trainer_batches_walk_passes_in_order(tmp_path):
    from specserve.train.trainer import TrainConfig, Trainer, length_sorted_batches, new_head

    target, samples = _Target().requires_grad_(False), _fake_samples(10, 0)
    cfg = TrainConfig(steps=6, batch_size=3, warmup_steps=2, ttt_steps=2, length_pool=2, seed=1)
    trainer = Trainer(new_head(target, torch.arange(40), 256, 0), target, samples, cfg, tmp_path)
    lengths = [len(s.input_ids) for s in samples]
    for step in (0, 2, 3, 7, 1):  # out of order, across passes of 3 batches
        number, index = divmod(step, 3)
        expected = length_sorted_batches(lengths, 3, 2, 1 * 1_000_003 + number)[index]
        ids = trainer.batch(step).input_ids
        assert ids.shape == (3, max(lengths[i] for i in expected))
        torch.testing.assert_close(ids[:, :6], torch.stack([samples[i].input_ids[:6] for i in expected]))


def test_resuming_continues_the_same_schedule(tmp_path):
    from specserve.train.trainer import TrainConfig, Trainer, new_head

    torch.manual_seed(0)
    target, samples = _Target().requires_grad_(False), _fake_samples(10, 0)
    held = _fake_samples(4, 1)
    cfg = TrainConfig(steps=6, batch_size=3, lr=1e-3, warmup_steps=2, ttt_steps=3, checkpoint_every=3)
    straight = Trainer(new_head(target, torch.arange(40), 256, 0), target, samples, cfg, tmp_path / "a", held)
    straight.train(progress=False)
    first = Trainer(new_head(target, torch.arange(40), 256, 0), target, samples, replace(cfg, steps=3),
                    tmp_path / "b", held)
    first.train(progress=False)
    second = Trainer(new_head(target, torch.arange(40), 256, 1), target, samples, cfg, tmp_path / "b", held)
    assert second.resume() and second.step == 3
    second.train(progress=False)
    assert [h["lr"] for h in second.history] == [h["lr"] for h in straight.history]
    assert [h["loss"] for h in second.history] == pytest.approx([h["loss"] for h in straight.history], rel=1e-5)
    # Held-out agreement at each checkpoint, kept across the resume.
    assert [e["step"] for e in second.evals] == [e["step"] for e in straight.evals] == [3, 6]
    for ours, theirs in zip(second.evals, straight.evals):
        assert len(ours["accuracy"]) == 3 and ours["accuracy"] == pytest.approx(theirs["accuracy"], abs=1e-6)
        assert ours["kl"] == pytest.approx(theirs["kl"], rel=1e-4)
    for (name, a), b in zip(straight.head.state_dict().items(), second.head.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # A checkpoint made with another split (or other data) is refused, not silently continued.
    other = Trainer(new_head(target, torch.arange(40), 256, 0), target, samples, cfg, tmp_path / "b", held[:2])
    with pytest.raises(ValueError, match="eval-samples"):
        other.resume()
    # So is one whose batches were drawn otherwise.
    for change in ({"length_pool": 2}, {"batch_size": 2}, {"seed": 1}):
        other = Trainer(new_head(target, torch.arange(40), 256, 0), target, samples, replace(cfg, **change),
                        tmp_path / "b", held)
        with pytest.raises(ValueError, match=next(iter(change))):
            other.resume()


@pytest.mark.parametrize("dp_size", [1, 2])
def test_tiny_end_to_end_learns_and_drafts(tiny_chat_model, tmp_path, dp_size):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Tell me about the number {i}."}) for i in range(12)))
    out = tmp_path / "head"
    cmd = [sys.executable, "-m", "specserve.cli", "train-draft", "--target", str(tiny_chat_model), "--device", "cpu",
           "--max-total-tokens", "4096", "--data", str(prompts), "--num-prompts", "12", "--max-tokens", "24",
           "--steps", "60", "--batch-size", "4", "--lr", "3e-3", "--warmup-steps", "5", "--draft-vocab-size", "512",
           "--ttt-steps", "3", "--checkpoint-every", "30", "--dp-size", str(dp_size), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "train_report.json").read_text())
    losses = [h["loss"] for h in report["history"]]
    assert report["num_held_out"] == 1 and report["num_samples"] == 11
    assert [e["step"] for e in report["held_out_evals"]] == [30, 60]
    for e in report["held_out_evals"]:
        assert len(e["accuracy"]) == 3 and all(0.0 <= a <= 1.0 for a in e["accuracy"]) and min(e["kl"]) > 0
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:10]) / 10, losses
    assert (out / "checkpoint.pt").exists() and (out / "model.safetensors").exists()
    assert (out / "data" / "complete").exists()  # a rerun trains on this data instead of regenerating it

    from specserve.config import SpecConfig
    from specserve.llm import LLM
    from specserve.core import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 9]]
    plain = LLM(model=str(tiny_chat_model), max_total_tokens=4096).generate(prompt, params)[0]
    spec = LLM(model=str(tiny_chat_model), max_total_tokens=4096,
               spec=SpecConfig("EAGLE3", str(out), 3)).generate(prompt, params)[0]
    assert spec.token_ids == plain.token_ids and spec.num_spec_steps > 0

    # eval-draft, two conversations at a time: every setting decodes the same tokens, greedy.
    report_path = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "specserve.cli", "eval-draft", "--target", str(tiny_chat_model), "--device", "cpu",
           "--max-total-tokens", "4096", "--draft", str(out), "--data", str(prompts), "--num-questions", "3",
           "--max-tokens", "12", "--chain-steps", "3", "--tree", "2", "3", "6", "--tree", "2", "2", "4",
           "--concurrency", "2", "--out", str(report_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(report_path.read_text())["results"]
    assert [r["setting"] for r in rows[2:]] == ["tree topk 2 steps 3 tokens 6", "tree topk 2 steps 2 tokens 4"]
    assert [r["output_sha256"] for r in rows] == [rows[0]["output_sha256"]] * 4
    assert rows[0]["mean_acceptance_length"] is None
    assert all(1.0 <= r["mean_acceptance_length"] <= 4.0 for r in rows[1:])


def test_time_budget_fixes_the_schedule_at_the_end_of_warm_up_and_stopping_resumes(tmp_path):
    """--train-minutes sets the step count from the warm-up speed; --stop-after-minutes checkpoints and exits,
    and a resumed run keeps the step count the first run settled on."""
    from specserve.train.trainer import TrainConfig, Trainer, lr_at, new_head

    torch.manual_seed(0)
    target, samples = _Target().requires_grad_(False), _fake_samples(10, 0)
    cfg = TrainConfig(steps=10**6, batch_size=2, lr=1e-3, warmup_steps=6, ttt_steps=2, checkpoint_every=1000,
                      minutes=0.02)

    def trainer() -> Trainer:
        t = Trainer(new_head(target, torch.arange(40), 256, 0), target, samples, cfg, tmp_path)
        ticks = iter(range(10**6))
        t.clock = lambda: next(ticks) * 0.01  # every step measures 10 ms between its two reads
        return t

    first = trainer()
    assert first.train(progress=False, stop_at=0.0) is False  # stops after its first step
    assert first.step == 1 and (tmp_path / "checkpoint.pt").exists()
    second = trainer()
    assert second.resume() and second.cfg.steps == 10**6  # not settled yet: still in warm-up
    assert second.train(progress=False) is True
    # 1.2 s at 10 ms a step, 60 ms of it spent by the end of warm-up: 6 + 114 steps.
    assert second.cfg.steps == 120 and second.step == 120
    assert second.train_seconds == pytest.approx(1.2)
    third = trainer()
    assert third.resume() and third.cfg.steps == 120 and third.step == 120
    plain = replace(cfg, steps=120, minutes=None)  # the lr schedule of a plain 120-step run
    assert [h["lr"] for h in second.history] == [lr_at(i, plain) for i in range(120)]
    with pytest.raises(ValueError, match="warm-up"):
        replace(cfg, warmup_steps=2)


def test_engine_acceptance_equals_the_training_walk(smollm2_dir, tmp_path):
    """Walking 3-chains through the training-time test's logits, from where the engine started each of its
    chains, predicts what the engine accepted. This ties datagen's taps, training and inference together: a
    tap layer or position recorded differently from what the engine feeds the head at inference would pass
    the math check above and fail here. The two compute the head in different orders (dense and paged), so
    a draft whose two best logits are within rounding of each other may go either way: one such chain is
    allowed, and only where that near-tie decided it."""
    from specserve import draft_heads
    from specserve.config import SpecConfig
    from specserve.llm import LLM
    from specserve.models.loader import load_eagle3_head
    from specserve.core import SamplingParams
    from specserve.train.datagen import generate, read_shards

    head_dir = draft_heads.SMOLLM2_HEAD
    llm = LLM(model=str(smollm2_dir), max_total_tokens=2048)
    model = llm.engine.runner.model
    head = load_eagle3_head(head_dir, model.config, torch.float32, torch.device("cpu"), 2048)
    messages = [{"role": "user", "content": "List three uses of copper and explain each briefly."}]
    prompt = llm.chat_prompt(messages)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    spec_llm = LLM(model=str(smollm2_dir), max_total_tokens=2048, spec=SpecConfig("EAGLE3", str(head_dir), 3))
    spec_llm.add(prompt, params)
    answer, chains = [], []  # chains: (drafted, accepted) of each step that drafted, in order
    while spec_llm.engine.has_work():
        for delta in spec_llm.engine.step():
            answer += delta.new_token_ids
            if delta.step_accepted is not None:
                chains.append((delta.step_drafted, delta.step_accepted))
    sample = read_shards(generate(llm, [prompt], head.config.target_layers, params,
                                  tmp_path / "walk", progress=False))[0]
    ids = sample.input_ids
    assert ids[len(prompt):].tolist() == answer
    batch = TTTBatch(ids[None], sample.taps[None].float(), torch.zeros(1, len(ids), head.config.draft_vocab_size),
                     sample.loss_mask[None])
    with torch.no_grad():
        logits = unrolled_loss(head, model.embed_tokens, batch, 3, keep_logits=True).logits
    drafts = [head.to_target_ids(step[0].argmax(-1)) for step in logits]  # drafts[k][t]: chain t, step k
    t, near_ties = len(prompt) - 1, 0  # the first chain drafts after the first answer token, at position len(prompt)
    for drafted, accepted in chains:
        assert drafted == min(3, len(ids) - t - 3)  # the engine keeps one token of max_tokens for the bonus
        n = 0
        while n < drafted and drafts[n][t] == ids[t + n + 2]:
            n += 1
        if n != accepted:
            step = min(n, accepted)  # the first draft the two disagree on
            best_two = logits[step][0, t].topk(2)
            either = head.to_target_ids(best_two.indices).tolist()
            assert best_two.values[0] - best_two.values[1] < 1e-2 and int(ids[t + step + 2]) in either, \
                f"chain at {t}: the walk accepts {n}, the engine {accepted}"
            near_ties += 1
        t += accepted + 1
    assert t >= len(ids) - 3 and near_ties <= 1 and sum(a for _, a in chains) > 0


def _recorded_samples(config, layers, prompts, out):
    from specserve.llm import LLM
    from specserve.core import SamplingParams
    from specserve.train.datagen import generate, read_shards

    llm = LLM(config=config, record_layers=layers)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    samples = read_shards(generate(llm, prompts, layers, params, out, shard_size=4, progress=False))
    return samples, llm.engine


def _assert_same_samples(ours, theirs, tolerance: float) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        torch.testing.assert_close(a.taps.float(), b.taps.float(), atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(a.hidden.float(), b.hidden.float(), atol=tolerance, rtol=tolerance)


def test_recorded_samples_survive_preemption_and_chunking(tiny_checkpoint, tmp_path):
    """Datagen under a pool small enough to preempt (rows recomputed, chunks overlapping) and with tiny
    prefill chunks records what a roomy run records: every position's taps and hidden state, the last
    position's zeroed."""
    from engine_runs import make_prompts, tight_config

    path = tiny_checkpoint("llama")
    prompts = make_prompts(512, seed=3)
    layers = (0, 1)
    tight, engine = _recorded_samples(tight_config(str(path), 120), layers, prompts, tmp_path / "tight")
    assert engine.scheduler.num_preemptions > 0
    roomy_config = replace(tight_config(str(path), 4096), scheduler=replace(
        tight_config(None, 1).scheduler, max_running_requests=16, chunked_prefill_size=512))
    roomy, _ = _recorded_samples(roomy_config, layers, prompts, tmp_path / "roomy")
    _assert_same_samples(tight, roomy, 2e-2)
    for s in roomy:
        assert s.taps.shape == (len(s.input_ids), 2 * 64) and not s.taps[-1].any() and not s.hidden[-1].any()
        assert s.taps[:-1].abs().sum(-1).min() > 0  # no position left unrecorded


def test_data_parallel_generation_records_what_one_engine_records(tiny_checkpoint, tmp_path):
    """Two generation workers (separate processes, each with half the requests and pool) write samples equal
    to one engine's, every prompt exactly once."""
    from engine_runs import make_prompts, tight_config

    from specserve.core import SamplingParams
    from specserve.train.datagen import read_shards
    from specserve.train.run import _generate_in_workers

    path = tiny_checkpoint("llama")
    prompts = make_prompts(512, seed=5)
    layers = (0, 1)
    config = tight_config(str(path), 4096)
    one, _ = _recorded_samples(config, layers, prompts, tmp_path / "one")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    shards = _generate_in_workers(config, 2, prompts, layers, params, tmp_path / "two", shard_size=4)
    assert {s.name[:8] for s in shards} == {"shard-00", "shard-01"}
    two = read_shards(shards)
    index = {tuple(p): i for i, p in enumerate(prompts)}  # a sample is its prompt and 24 answer tokens
    two = sorted(two, key=lambda s: index[tuple(s.input_ids[:-24].tolist())])
    assert len(two) == len(prompts)
    _assert_same_samples(one, two, 2e-2)  # the tokens exactly; rows stored in bf16 (batches differ: last bits)


def test_worker_configs_split_requests_graphs_and_pool():
    from engine_runs import tight_config

    from specserve.train.run import _worker_config

    config = replace(tight_config(None, 4096), cuda_graph_max_bs=6)
    share = _worker_config(config, 3)
    assert share.scheduler.max_running_requests == share.cuda_graph_max_bs == 2
    assert share.cache.max_total_tokens == 1365
    assert share.cache.mem_fraction_static == pytest.approx(config.cache.mem_fraction_static / 3)
    uncapped = _worker_config(replace(config, cache=replace(config.cache, max_total_tokens=None)), 2)
    assert uncapped.cache.max_total_tokens is None
    with pytest.raises(ValueError, match="no running request"):
        _worker_config(config, 7)


def test_a_failing_generation_worker_fails_the_run(tmp_path):
    """Workers that cannot build their engine end the generation with an error, and none is left running."""
    from engine_runs import tight_config

    from specserve.core import SamplingParams
    from specserve.train.run import _generate_in_workers

    config = tight_config(str(tmp_path / "no-such-model"), 4096)
    with pytest.raises(RuntimeError, match="generation worker"):
        _generate_in_workers(config, 2, [[5, 6, 7]] * 4, (0, 1), SamplingParams(max_tokens=2), tmp_path / "d", 2)
    assert not list((tmp_path / "d").glob("shard-*"))


def test_assembling_recorded_chunks():
    """Decode chunks that tile the sequence, a row computed one past the end (an overlapped step), chunks
    recomputed after preemption that overlap the rest, and a gap: rows land at their positions, a gap and the
    last position stay zero."""
    from specserve.train.datagen import _assemble

    rows = torch.arange(1.0, 9.0)[:, None].repeat(1, 3)  # position p holds p + 1

    def chunk(start, end):
        return start, rows[start:end]

    expected = rows[:6].clone()
    expected[5] = 0
    assert torch.equal(_assemble([chunk(0, 3), chunk(3, 4), chunk(4, 5)], 6), expected)  # the last: never computed
    assert torch.equal(_assemble([chunk(0, 3), chunk(3, 4), chunk(4, 5), chunk(5, 6), chunk(6, 7)], 6), expected)
    assert torch.equal(_assemble([chunk(0, 2), chunk(0, 4), chunk(2, 3), chunk(4, 6)], 6), expected)  # overlap
    gap = expected.clone()
    gap[2:4] = 0
    assert torch.equal(_assemble([chunk(0, 2), chunk(4, 6)], 6), gap)
