"""Draft-head training throughput: samples per second of `Trainer` steps at several batch sizes, on a target of
a shipped shape with random weights and random samples: prompts of 20-383 tokens and answers of 64-256, drawn
uniformly (longer on average than ShareGPT's turns, so real data trains somewhat faster per step). Speed does not
depend on the values, so this needs no model file and no data generation; with --profile it also lists the
step's heaviest kernels under torch.profiler.

    python benchmarks/train_step.py --device cuda --batch-sizes 16 32 64 --out benchmarks/results/train_step_h200.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from specserve.bench.decode import hardware_info
from specserve.engine.factory import shipped_config
from specserve.config import ModelConfig
from specserve.models.loader import build_model
from specserve.train.datagen import Sample
from specserve.train.trainer import TrainConfig, Trainer, _samples_on_gpu, new_head


def random_samples(count: int, hidden: int, num_taps: int, vocab: int, seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        prompt = int(torch.randint(20, 384, (1,), generator=g))
        answer = int(torch.randint(64, 257, (1,), generator=g))
        n = prompt + answer
        mask = torch.zeros(n, dtype=torch.uint8)
        mask[prompt - 1:n - 1] = 1
        samples.append(Sample(torch.randint(vocab, (n,), generator=g),
                              torch.randn(n, num_taps * hidden, generator=g).to(torch.bfloat16),
                              torch.randn(n, hidden, generator=g).to(torch.bfloat16), mask))
    return samples


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(target, samples, batch_size: int, steps: int, draft_vocab: int, profile: bool) -> dict:
    """Times `steps` trainer steps after 5 untimed ones (allocation, kernel selection)."""
    warmup = 5
    cfg = TrainConfig(steps=warmup, batch_size=batch_size, max_len=640, lr=3e-4, warmup_steps=warmup,
                      checkpoint_every=10**9)
    head = new_head(target, torch.arange(draft_vocab), target.config.max_position_embeddings, 0)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(head, target, samples, cfg, Path(out))
        trainer.train(progress=False)
        trainer.cfg = replace(cfg, steps=warmup + steps)
        _sync()
        # The trainer's own clock counts steps only, not the checkpoint it writes at the end.
        before = trainer.train_seconds
        with profiler(profile) as prof:
            trainer.train(progress=False)
        seconds = trainer.train_seconds - before
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    record = {"batch_size": batch_size, "steps": steps, "ms_per_step": 1e3 * seconds / steps,
              "samples_per_s": batch_size * steps / seconds, "peak_memory_gib": peak, "profiled": profile}
    if profile:
        record["profile_top"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        print(record["profile_top"])
    return record


def profiler(enabled: bool):
    if not enabled:
        return contextlib.nullcontext()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return torch.profiler.profile(activities=activities)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a shipped config name")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--num-samples", type=int, default=2048)
    parser.add_argument("--draft-vocab-size", type=int, default=14336)
    parser.add_argument("--profile", action="store_true", help="profile the first batch size's steps")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = ModelConfig.from_hf_config(json.loads(shipped_config(args.model).read_text()))
    target = build_model(cfg, None, torch.bfloat16, device, 2048, progress=False)
    samples = random_samples(args.num_samples, cfg.hidden_size, 3, cfg.vocab_size, 0)
    if device.type == "cuda":  # once, where each batch size's trainer then finds them
        samples, _ = _samples_on_gpu(samples, device, len(samples))
    results = []
    for i, batch_size in enumerate(args.batch_sizes):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        record = measure(target, samples, batch_size, args.steps, args.draft_vocab_size, args.profile and i == 0)
        print(json.dumps({k: v for k, v in record.items() if k != "profile_top"}), flush=True)
        results.append(record)
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "draft-head training step", "model": args.model,
                                              "hardware": hardware_info(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
