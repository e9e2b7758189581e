"""`specserve train-draft` and `specserve eval-draft`: the orchestration around datagen, trainer and the engine."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.multiprocessing as mp
from multiprocessing.connection import wait

from specserve.bench.datasets import load_prompts, mt_bench_questions, read_jsonl_conversations
from specserve.config import EngineConfig, SpecConfig
from specserve.engine.factory import resolve_model, thaw_and_collect
from specserve.models.eagle3 import default_target_layers
from specserve.models.loader import save_eagle3_head
from specserve.core import SamplingParams
from specserve.train.datagen import draft_vocabulary, generate, read_shards
from specserve.train.trainer import TrainConfig, Trainer, hold_out, new_head


# eval-draft's tree when none is given: top-4, 8 levels, 16 tokens. Top-k and size are fixed; 8 levels gave
# the bundled head its longest acceptance on MT-Bench of 5, 7 and 8 (docs/training.md, "The bundled head").
DEFAULT_EVAL_TREE = (4, 8, 16)


def run_train_draft(engine_config: EngineConfig, args: argparse.Namespace) -> dict:
    from specserve.llm import LLM

    out = Path(args.out)
    started = time.time()
    # Speculation stays off while generating. On a GPU, decode steps replay CUDA graphs that also write the
    # taps and hidden states the recorder keeps; every batch size up to an engine's running limit gets a graph
    # (the graphs' logits buffers grow with it: ~10 GB for SmolLM2 at 1024), and no sequence outgrows --max-len.
    taps = default_target_layers(resolve_model(engine_config).model_cfg.num_layers)
    gen_config = replace(engine_config, spec=SpecConfig(), context_length=args.max_len,
                         cuda_graph_max_bs=engine_config.scheduler.max_running_requests)
    data_dir = out / "data"
    generating = not (data_dir / "complete").exists()  # generated once, in full; a resumed run reuses it
    if generating and args.dp_size == 1:
        llm = LLM(config=gen_config, progress=True, record_layers=taps)
    else:  # this process needs only the model and its tokenizer: no graphs, a small pool
        llm = LLM(config=replace(gen_config, disable_cuda_graph=True, cache=replace(gen_config.cache,
                                                                                   max_total_tokens=4096)))
    model = llm.engine.runner.model
    if generating:
        shards = _generate_data(llm, gen_config, taps, data_dir, args)
    else:
        shards = sorted(data_dir.glob("shard-*.safetensors"))
    device = llm.engine.runner.device
    del llm  # and its KV pool: the trainer needs only the model's embedding and lm_head
    _free_device_memory()
    samples, held_out = hold_out(read_shards(shards, _sample_device(device, shards)), args.eval_samples, args.seed)
    generated_at = time.time()
    vocab = model.config.vocab_size
    draft_ids = draft_vocabulary(samples, min(args.draft_vocab_size, vocab), vocab)
    # The unrolled steps reach max_len + ttt_steps positions, past the generation's context length.
    head = new_head(model, draft_ids, model.config.max_position_embeddings, args.seed)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, max_len=args.max_len, lr=args.lr,
                      warmup_steps=args.warmup_steps, ttt_steps=args.ttt_steps, step_decay=args.step_decay,
                      seed=args.seed, checkpoint_every=args.checkpoint_every, minutes=args.train_minutes,
                      length_pool=args.length_pool)
    trainer = Trainer(head, model, samples, cfg, out, held_out)
    num_samples, num_held_out = len(samples), len(held_out)
    num_answer_tokens = int(sum(s.loss_mask.sum() for s in samples))
    del samples, held_out  # the trainer holds them, on the device when they fit: no second copy in host memory
    resumed = trainer.resume()
    stop_at = started + args.stop_after_minutes * 60 if args.stop_after_minutes else None
    if not trainer.train(stop_at=stop_at):
        print(f"stopped at step {trainer.step} of {trainer.cfg.steps} (--stop-after-minutes); "
              f"the same command resumes from {out / 'checkpoint.pt'}")
        return {"stopped_at_step": trainer.step}
    history = trainer.history
    shipped = head.to(torch.bfloat16) if args.save_dtype == "bfloat16" else head
    save_eagle3_head(shipped, out, max_shard_bytes=args.max_shard_mib * 2**20)
    report = {
        "command": "specserve train-draft", "target": engine_config.model_path or "SmolLM2-135M-Instruct",
        "data": args.data, "num_samples": num_samples, "num_answer_tokens": num_answer_tokens,
        "draft_vocab_size": len(draft_ids), "train_config": vars(args) | {"resumed": resumed},
        "generation_s": generated_at - started, "training_s": trainer.train_seconds,
        "steps": trainer.cfg.steps,
        "final_loss": history[-1]["loss"] if history else None,
        "final_accuracy": history[-1]["accuracy"] if history else None, "history": history[-50:],
        "num_held_out": num_held_out, "held_out_evals": trainer.evals,
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    print(f"saved the head to {out}; {num_samples} samples, final loss {report['final_loss']}")
    return report


def _generate_data(llm, gen_config: EngineConfig, taps: tuple[int, ...], data_dir: Path,
                   args: argparse.Namespace) -> list[Path]:
    """Regenerates the answers to the prompts into shards under `data_dir`, through `llm` itself or through
    --dp-size worker engines, and marks the data complete."""
    for partial in data_dir.glob("shard-*.safetensors"):  # left by a run stopped while generating
        partial.unlink()
    prompts = [llm.chat_prompt(p.messages) for p in load_prompts(args.data, args.num_prompts, seed=args.seed)]
    # Training sees max_len tokens of a sample, so a prompt that leaves no room for its answer is useless.
    room = min(args.max_len, llm.engine.max_model_len)  # a target with fewer positions caps --max-len
    prompts = [p for p in prompts if len(p) + args.max_tokens <= room]
    if not prompts:
        raise ValueError(f"every prompt is longer than --max-len {args.max_len} minus --max-tokens")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.dp_size > 1:
        shards = _generate_in_workers(gen_config, args.dp_size, prompts, taps, params, data_dir, args.gen_batch)
    else:
        shards = generate(llm, prompts, taps, params, data_dir, shard_size=args.gen_batch)
    (data_dir / "complete").write_text(f"{len(shards)} shards\n")
    return shards


def _generate_in_workers(gen_config: EngineConfig, workers: int, prompts: list[list[int]], taps: tuple[int, ...],
                         params: SamplingParams, data_dir: Path, shard_size: int) -> list[Path]:
    """Data-parallel generation: `workers` engines on the same device (see `_worker_config`), each taking every
    workers-th prompt. A small target leaves a GPU mostly idle under one engine, whose per-request Python
    work bounds the step rate; several engines overlap that work. The first failure stops them all."""
    share = _worker_config(gen_config, workers)
    context = mp.get_context("spawn")
    procs = [context.Process(target=_generation_worker, daemon=True,
                             args=(rank, workers, share, prompts[rank::workers], taps, params, data_dir, shard_size))
             for rank in range(workers)]
    try:
        for proc in procs:
            proc.start()
        running = {proc.sentinel: proc for proc in procs}
        while running:
            for sentinel in wait(list(running)):
                proc = running.pop(sentinel)
                proc.join()  # the sentinel fires as the process exits, a moment before its exit code is known
                if proc.exitcode != 0:
                    failed = [rank for rank, p in enumerate(procs) if p.exitcode not in (0, None)]
                    raise RuntimeError(f"generation worker(s) {failed} failed; their errors are printed above")
    finally:
        for proc in procs:  # after a failure or an interrupt, no orphan keeps the device or writes shards
            if proc.is_alive():
                proc.terminate()
            proc.join()
    return sorted(data_dir.glob("shard-*.safetensors"))


def _worker_config(config: EngineConfig, workers: int) -> EngineConfig:
    """One generation worker's engine: 1/workers of the running requests, of the CUDA-graph batch sizes and
    of the pool. With --max-total-tokens the pool is that cap split evenly; without it, each worker takes
    mem_fraction_static / workers of the memory free when it starts, so later starters get somewhat less."""
    cache, sched = config.cache, config.scheduler
    running = sched.max_running_requests // workers
    tokens = None if cache.max_total_tokens is None else cache.max_total_tokens // workers
    if running < 1 or tokens == 0:
        raise ValueError(f"--dp-size {workers} leaves a worker no running request or no KV token")
    return replace(config, cuda_graph_max_bs=running,
                   cache=replace(cache, max_total_tokens=tokens, mem_fraction_static=cache.mem_fraction_static / workers),
                   scheduler=replace(sched, max_running_requests=running))


def _generation_worker(rank: int, workers: int, config: EngineConfig, prompts: list[list[int]],
                       taps: tuple[int, ...], params: SamplingParams, data_dir: Path, shard_size: int) -> None:
    from specserve.llm import LLM

    if not torch.cuda.is_available() or config.device == "cpu":  # the engines share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    llm = LLM(config=config, progress=rank == 0, record_layers=taps)
    generate(llm, prompts, taps, params, data_dir, shard_size=shard_size, progress=rank == 0,
             prefix=f"shard-{rank:02d}")


def _sample_device(device: torch.device, shards: list[Path]) -> torch.device | None:
    """The GPU when the samples fit on it twice over (the trainer then cuts batches there), else None: host
    memory. Shards load one by one, so host memory need not hold tens of GB of samples on the way."""
    if device.type != "cuda":
        return None
    size = sum(path.stat().st_size for path in shards)
    return device if torch.cuda.mem_get_info(device)[0] >= 2 * size else None


def _free_device_memory() -> None:
    """Hands the memory of dropped engines back to the device, so that the next engine's sizing sees it free."""
    thaw_and_collect()  # an engine's objects were frozen out of the collector's view when it was built
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _conversations(data: str, num: int | None) -> list[list[str]]:
    """User turns per conversation: MT-Bench's two turns, all turns of a JSONL line with "turns" (MT-Bench's own
    question file gives the same conversations), or one prompt per other JSONL line."""
    if data == "mt-bench":
        turns = [q["turns"] for q in mt_bench_questions()]
    else:
        turns = list(read_jsonl_conversations(Path(data)))
    return turns[:num] if num else turns


def run_eval_draft(engine_config: EngineConfig, args: argparse.Namespace) -> dict:
    """Mean acceptance length and decode tok/s against no speculation, greedy, for a chain and a tree."""
    from specserve.llm import LLM

    conversations = _conversations(args.data, args.num_questions)
    settings = [("no speculation", SpecConfig()),
                (f"chain {args.chain_steps}", SpecConfig("EAGLE3", args.draft, args.chain_steps))]
    for topk, steps, tokens in args.tree or [DEFAULT_EVAL_TREE]:
        settings.append((f"tree topk {topk} steps {steps} tokens {tokens}",
                         SpecConfig("EAGLE3", args.draft, steps, topk, tokens)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows = []
    for label, spec in settings:
        # The previous setting's engine goes first: its KV pool would otherwise count as used memory when the
        # next one sizes its own, leaving it too little for its pool and graphs.
        llm = None
        _free_device_memory()
        llm = LLM(config=replace(engine_config, spec=spec))
        tokens, seconds, steps, accepted = 0, 0.0, 0, 0
        digest = hashlib.sha256()  # of every answer's token ids, so settings can be compared exactly
        for first in range(0, len(conversations), args.concurrency):
            group = conversations[first:first + args.concurrency]
            histories = [[] for _ in group]
            for turn in range(max(len(turns) for turns in group)):
                active = [i for i, turns in enumerate(group) if turn < len(turns)]
                for i in active:
                    histories[i].append({"role": "user", "content": group[i][turn]})
                t0 = time.perf_counter()
                outs = llm.generate([llm.chat_prompt(histories[i]) for i in active], params)
                seconds += time.perf_counter() - t0
                for i, out in zip(active, outs):
                    tokens += len(out.token_ids)
                    digest.update(str(out.token_ids).encode())
                    steps, accepted = steps + out.num_spec_steps, accepted + out.num_accepted_tokens
                    histories[i].append({"role": "assistant", "content": out.text})
        rows.append({"setting": label, "tok_s": tokens / seconds, "output_tokens": tokens,
                     "output_sha256": digest.hexdigest()[:16],
                     "mean_acceptance_length": (accepted + steps) / steps if steps else None})
        print(rows[-1], flush=True)
    for row in rows:
        row["speedup"] = row["tok_s"] / rows[0]["tok_s"]
    report = {"command": "specserve eval-draft", "draft": args.draft, "data": args.data,
              "num_conversations": len(conversations), "max_tokens": args.max_tokens,
              "concurrency": args.concurrency, "device": str(llm.engine.runner.device),
              "dtype": str(next(llm.engine.runner.model.parameters()).dtype), "results": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report
