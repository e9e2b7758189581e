"""One prompt step and one decode step of a model built for one rank of a tensor-parallel group, run directly
(attention metadata and a KV pool sized for the rank), for the tensor-parallel model tests."""
from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import torch
import torch.multiprocessing as mp

from specserve.distributed.parallel import TensorParallel, rank_model_config
from specserve.layers.attention import AttentionMetadata
from specserve.models.loader import build_model, read_model_config
from tiny_checkpoints import write_tiny_checkpoint

PAGE, PROMPTS = 4, ([5, 17, 42, 8, 3], [9, 1, 250, 77, 31, 64, 12])


def step_logits(path: Path, tp: TensorParallel, device: torch.device = torch.device("cpu"),
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of every row of a prompt step over two sequences, then of one decode row each; returned
    on the CPU."""
    cfg = read_model_config(path)
    model = build_model(cfg, path, dtype, device, 64, progress=False, tp=tp)
    planes, heads, dim = rank_model_config(cfg, tp).kv_entry_shape
    kv_cache = torch.zeros(cfg.num_layers, planes, 8 * PAGE, heads, dim, dtype=dtype, device=device)
    tables = [[0, 1, 2], [3, 4, 5]]
    lens = [len(p) for p in PROMPTS]
    ids = torch.tensor([t for p in PROMPTS for t in p], device=device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    meta = AttentionMetadata.build(lens, [0, 0], tables, PAGE, device)
    with torch.no_grad():
        prompt = model.compute_logits(model(ids, positions, meta, kv_cache)[0])
        last = prompt[[lens[0] - 1, sum(lens) - 1]].argmax(-1)
        meta = AttentionMetadata.build([1, 1], lens, tables, PAGE, device)
        decode = model.compute_logits(model(last, torch.tensor(lens, device=device), meta, kv_cache)[0])
    return prompt.cpu(), decode.cpu()


def sharded_checkpoints(tmp_path_factory, kinds: tuple[str, ...], prefix: str) -> dict[str, Path]:
    """A tiny checkpoint of each kind, saved as several safetensors files with an index."""
    paths = {}
    for kind in kinds:
        paths[kind] = tmp_path_factory.mktemp(f"{prefix}-{kind}")
        write_tiny_checkpoint(kind, paths[kind], sharded=True)
    return paths


def run_two_ranks(rank_fn, paths: list[str], out: Path, env: dict[str, str] | None = None) -> list[dict]:
    """Runs rank_fn(rank, 2, rendezvous, paths, out) in two processes, with `env` added to theirs; returns what
    each rank saved to out/rank{r}.pt."""
    with mock.patch.dict(os.environ, env or {}):  # inherited by the ranks
        mp.spawn(rank_fn, args=(2, f"file://{out / 'rendezvous'}", paths, str(out)), nprocs=2)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]
