"""Self-distillation data: the target regenerates answers through specserve's own engine, and the same
forward passes record what the head learns from, so there is no second target pass:

- the outputs of the tapped target layers at every position (the head's `fc` input),
- the final normed hidden state at every position (the target's next-token logits are lm_head of it),
- a mask of the positions whose next token is an answer token.

Samples are written to safetensors shards, one tensor per field and sample.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specserve.core import SamplingParams


@dataclass(frozen=True)
class Sample:
    input_ids: torch.Tensor  # [N] prompt then answer
    taps: torch.Tensor  # [N, len(layers) * H]; the last position's row is zero (no loss reads it)
    hidden: torch.Tensor  # [N, H] final normed hidden state; the last row is zero too
    loss_mask: torch.Tensor  # [N] 1 where the next token belongs to the answer

    @property
    def answer_ids(self) -> torch.Tensor:
        return self.input_ids[1:][self.loss_mask[:-1].bool()]


class TapRecorder:
    """Hooked into the runner: keeps every computed token's taps and hidden state, by request and position.
    Rows stay on the device they were computed on until a sample is written out, so a shard's worth must fit
    beside the KV pool: (len(layers) + 1) x H x 2 bytes per token, 4.6 KB for SmolLM2, 32 KB for an 8B model;
    size --gen-batch to match."""

    def __init__(self, capture_layers: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> None:
        self.capture_layers = tuple(capture_layers)
        self.dtype = dtype
        self.chunks: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def record(self, seqs, captured: list[torch.Tensor], hidden: torch.Tensor) -> None:
        """The tapped layers' outputs ([rows, H] each) and `hidden` [rows, H], the seqs' tokens in order.
        Copied (the cat always copies): a CUDA graph's output buffers are overwritten by its next replay."""
        taps, hidden = torch.cat(captured, dim=-1).to(self.dtype), hidden.to(self.dtype, copy=True)
        offset = 0
        for seq in seqs:
            n = len(seq.token_ids)
            # A chunk recomputed after preemption replaces the first one (same values, same positions).
            self.chunks.setdefault(seq.request_id, {})[seq.start_pos] = (taps[offset:offset + n],
                                                                         hidden[offset:offset + n])
            offset += n

    def take(self, request_id: str, token_ids: list[int], prompt_len: int) -> Sample:
        chunks = sorted(self.chunks.pop(request_id).items())
        n = len(token_ids)
        taps = _assemble([(start, t) for start, (t, _) in chunks], n)
        hidden = _assemble([(start, h) for start, (_, h) in chunks], n)
        mask = torch.zeros(n, dtype=torch.uint8)
        mask[prompt_len - 1:n - 1] = 1
        return Sample(torch.tensor(token_ids), taps.cpu(), hidden.cpu(), mask)

    def clear(self) -> None:
        """Drops rows of requests that were never taken, so a failed or partial batch cannot pile them up."""
        self.chunks.clear()


def _assemble(chunks: list[tuple[int, torch.Tensor]], n: int) -> torch.Tensor:
    """Rows 0..n-1 from chunks sorted by start, zero where nothing was computed. The last position's row is
    zeroed too: it is computed only when an overlapped step runs past the end, and no loss reads it."""
    ends = [start + len(t) for start, t in chunks]
    if chunks[0][0] == 0 and all(start == end for (start, _), end in zip(chunks[1:], ends)):
        rows = torch.cat([t for _, t in chunks])[:n]  # decode chunks tile the sequence: one copy
        rows = torch.nn.functional.pad(rows, (0, 0, 0, n - len(rows)))
    else:  # a chunk recomputed after preemption overlaps the others
        rows = chunks[0][1].new_zeros(n, chunks[0][1].shape[1])
        for start, t in chunks:
            end = min(start + len(t), n)
            if end > start:
                rows[start:end] = t[: end - start]
    rows[n - 1:] = 0
    return rows


def generate(llm, prompts: list[list[int]], capture_layers: tuple[int, ...], params: SamplingParams,
             out_dir: Path, shard_size: int = 256, progress: bool = True, prefix: str = "shard") -> list[Path]:
    """Runs every prompt through the engine (up to `shard_size` at a time) and writes one shard per batch,
    named `{prefix}-NNNNN.safetensors`."""
    runner = llm.engine.runner
    if runner.proposer is not None:
        raise ValueError("generate training data with speculation off")
    graphs = runner.graphs
    if graphs is not None and graphs.record_layers and graphs.record_layers != tuple(capture_layers):
        raise ValueError(f"the CUDA graphs record layers {graphs.record_layers}, not {capture_layers}")
    recorder = TapRecorder(capture_layers)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    bar = tqdm(total=len(prompts), desc="generating answers", unit="prompt", disable=not progress)
    with runner.recording(recorder), bar:
        for first in range(0, len(prompts), shard_size):
            trackers = [llm.add(p, params) for p in prompts[first:first + shard_size]]
            while llm.engine.has_work():
                llm.step_and_track(trackers)
            samples = [recorder.take(t.output.request_id, t.output.prompt_token_ids + t.output.token_ids,
                                     len(t.output.prompt_token_ids)) for t in trackers]
            recorder.clear()
            shards.append(write_shard(samples, out_dir / f"{prefix}-{len(shards):05d}.safetensors"))
            bar.update(len(trackers))
    return shards


def write_shard(samples: list[Sample], path: Path) -> Path:
    tensors = {}
    for i, s in enumerate(samples):
        tensors.update({f"{i}.input_ids": s.input_ids, f"{i}.taps": s.taps.contiguous(),
                        f"{i}.hidden": s.hidden.contiguous(), f"{i}.loss_mask": s.loss_mask})
    save_file(tensors, str(path))
    return path


def read_shards(paths: list[Path], device: torch.device | None = None) -> list[Sample]:
    """The samples of `paths`, loaded straight onto `device` when given, so host memory never holds them all."""
    samples = []
    for path in paths:
        tensors = load_file(str(path), device=str(device) if device is not None else "cpu")
        count = len({k.split(".")[0] for k in tensors})
        samples += [Sample(tensors[f"{i}.input_ids"], tensors[f"{i}.taps"], tensors[f"{i}.hidden"],
                           tensors[f"{i}.loss_mask"]) for i in range(count)]
    return samples


def draft_vocabulary(samples: list[Sample], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens, sorted by id: the ids the head may draft. If the answers
    use fewer distinct tokens, the rest is filled with the lowest unused ids so the shape is as asked."""
    counts = Counter()
    for s in samples:
        counts.update(s.answer_ids.tolist())
    chosen = [token for token, _ in counts.most_common(size)]
    if len(chosen) < size:
        used = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in used][: size - len(chosen)]
    return torch.tensor(sorted(chosen))
