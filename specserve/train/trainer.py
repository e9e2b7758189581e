"""Training an EAGLE-3 head on recorded samples: AdamW, linear warm-up then cosine decay, gradient clipping,
bf16 autocast on a GPU, resumable checkpoints, and a progress bar with the loss and per-step accuracy."""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from specserve.config import ModelConfig
from specserve.models.eagle3 import Eagle3Config, Eagle3Head, default_target_layers, vocab_maps
from specserve.train.datagen import Sample
from specserve.train.ttt import TTTBatch, unrolled_loss

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    batch_size: int = 8
    max_len: int = 1024  # tokens per sample, longer ones are cut
    lr: float = 1e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_steps: int = 7  # unroll depth K
    step_decay: float = 0.8  # unroll step k's loss weighs step_decay**k
    seed: int = 0
    checkpoint_every: int = 200
    # Batches are cut from pools of this many batches' worth of shuffled samples, sorted by length, so a
    # batch pads to about its own samples' length rather than to the longest of a random draw (1: no sorting).
    length_pool: int = 64
    # When set, `steps` is fixed at the end of warm-up (whose learning rates do not depend on it) so that the
    # whole run takes about this many minutes at the speed measured during warm-up.
    minutes: float | None = None

    def __post_init__(self) -> None:
        if self.step_decay <= 0:
            raise ValueError("step_decay must be positive")
        if self.length_pool < 1:
            raise ValueError("length_pool must be at least 1")
        if self.minutes is not None and self.warmup_steps < 5:
            raise ValueError("a time-budgeted run measures its speed during warm-up: use at least 5 warm-up steps")


def new_head(target: torch.nn.Module, draft_ids: torch.Tensor, max_positions: int, seed: int) -> Eagle3Head:
    """A head shaped like one target layer, drafting over `draft_ids`; its output layers start from the
    target's own (final norm, and the lm_head rows of the draft vocabulary), so it begins as a useful
    guesser and training moves the layer in between."""
    cfg: ModelConfig = target.config
    head_cfg = Eagle3Config(cfg, len(draft_ids), cfg.hidden_size, default_target_layers(cfg.num_layers))
    torch.manual_seed(seed)
    device = target.embed_tokens.weight.device
    with torch.device(device):
        head = Eagle3Head(head_cfg, max_positions)
    head.float()
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
        head.norm.weight.copy_(target.norm.weight.float())
        head.lm_head.weight.copy_(_lm_head_weight(target)[draft_ids.to(device)].float())
        d2t, t2d = vocab_maps(draft_ids.cpu(), cfg.vocab_size)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    return head


def _lm_head_weight(target: torch.nn.Module) -> torch.Tensor:
    return target.lm_head.weight  # the embedding itself when the two are tied


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to `lr`, then cosine decay to zero at `steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def length_sorted_batches(lengths: Sequence[int], batch_size: int, pool: int, seed: int) -> list[list[int]]:
    """One pass over the samples as batches of indices: shuffled, cut into pools of `pool` batches whose
    samples are sorted by length, so each batch holds samples of similar length, and the batches shuffled
    again. Each sample is in at most one batch; the remainder that does not fill a batch sits this pass out
    (all samples form one batch when there are fewer than `batch_size`)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(lengths), generator=g).tolist()
    # The remainder is cut from the shuffled order, before sorting: cut after, it would be the longest samples.
    order = order[:len(order) - len(order) % batch_size] or order
    batches = []
    for start in range(0, len(order), batch_size * pool):
        chunk = sorted(order[start:start + batch_size * pool], key=lambda i: lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def hold_out(samples: list[Sample], count: int, seed: int) -> tuple[list[Sample], list[Sample]]:
    """(train, held-out): `count` samples drawn by `seed` are kept out of training, at most a tenth of them,
    so the agreement measured on them is that on unseen text; the same data and seed give the same split."""
    count = max(0, min(count, len(samples) // 10))
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:count])
    return ([s for i, s in enumerate(samples) if i not in held], [samples[i] for i in sorted(held)])


class Trainer:
    def __init__(self, head: Eagle3Head, target: torch.nn.Module, samples: list[Sample], cfg: TrainConfig,
                 out_dir: Path, held_out: Sequence[Sample] = ()) -> None:
        self.head, self.cfg, self.out_dir = head, cfg, out_dir
        self.embed = target.embed_tokens
        self.device = target.embed_tokens.weight.device
        draft_ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=head.d2t.device))
        self.draft_lm_head = _lm_head_weight(target)[draft_ids.to(self.device)].detach().float()
        head.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        if self.device.type == "cuda":
            samples, held_out = _samples_on_gpu([*samples, *held_out], self.device, len(samples))
        if not samples:
            raise ValueError("no training samples")
        self.samples, self.held_out = samples, list(held_out)
        self._lengths = [len(s.input_ids) for s in samples]
        self._pass: tuple[int, list[list[int]]] | None = None  # (pass number, its batches)
        self.step = 0
        self.train_seconds = 0.0  # summed over resumed runs, evaluation excluded
        self.clock = time.perf_counter  # replaceable, so a test can fix the measured speed
        self.history: list[dict] = []
        self.evals: list[dict] = []  # agreement on the held-out samples, at each checkpoint

    # -- checkpoints ---------------------------------------------------------
    def save_checkpoint(self) -> Path:
        path = self.out_dir / CHECKPOINT
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                    "config": asdict(self.cfg), "history": self.history, "train_seconds": self.train_seconds,
                    "evals": self.evals, "num_held_out": len(self.held_out)},
                   path)
        return path

    def resume(self) -> bool:
        """Continues from `out_dir/checkpoint.pt` if it exists: weights, optimizer moments, step and history."""
        path = self.out_dir / CHECKPOINT
        if not path.exists():
            return False
        state = torch.load(path, map_location=self.device, weights_only=True)
        # The split and the draft vocabulary follow from the data and --eval-samples; batches are picked by
        # index, so a checkpoint made with others would go on training on different samples and logits.
        if state.get("num_held_out", 0) != len(self.held_out) or not torch.equal(state["head"]["d2t"],
                                                                                 self.head.d2t):
            raise ValueError(f"{path} was made with other training data or another --eval-samples "
                             f"({state.get('num_held_out', 0)} held out, now {len(self.held_out)})")
        # Batches are drawn from the seed, batch size and length pool: others would change the schedule midway.
        changed = [key for key in ("batch_size", "seed", "length_pool")
                   if state["config"].get(key, getattr(self.cfg, key)) != getattr(self.cfg, key)]
        if changed:
            raise ValueError(f"{path} was made with another {', '.join(changed)}")
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.history = state["step"], state["history"]
        self.train_seconds = state.get("train_seconds", 0.0)
        self.evals = state.get("evals", [])
        if self.cfg.minutes is not None and self.step >= self.cfg.warmup_steps:  # the length already settled on
            self.cfg = replace(self.cfg, steps=state["config"]["steps"])
        return True

    # -- training ------------------------------------------------------------
    def batch(self, step: int) -> TTTBatch:
        """The samples of `step` depend on the step alone, so a resumed run sees what it would have seen."""
        per_pass = max(1, len(self.samples) // self.cfg.batch_size)
        number, index = divmod(step, per_pass)
        if self._pass is None or self._pass[0] != number:
            self._pass = (number, length_sorted_batches(self._lengths, self.cfg.batch_size, self.cfg.length_pool,
                                                        self.cfg.seed * 1_000_003 + number))
        return self._collate([self.samples[i] for i in self._pass[1][index]])

    def _collate(self, chosen: list[Sample]) -> TTTBatch:
        length = min(self.cfg.max_len, max(len(s.input_ids) for s in chosen))

        def pad(t: torch.Tensor, value=0) -> torch.Tensor:
            t = t[:length]
            return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, length - len(t)), value=value)

        ids = torch.stack([pad(s.input_ids) for s in chosen]).to(self.device)
        taps = torch.stack([pad(s.taps) for s in chosen]).to(self.device).float()
        hidden = torch.stack([pad(s.hidden) for s in chosen]).to(self.device).float()
        mask = torch.stack([pad(s.loss_mask) for s in chosen]).to(self.device)
        with torch.no_grad():
            target_logits = hidden @ self.draft_lm_head.T
        return TTTBatch(ids, taps, target_logits, mask)

    def train(self, progress: bool = True, stop_at: float | None = None) -> bool:
        """Trains to the end of the schedule, checkpointing on the way. With `stop_at` (a time.time() value),
        it checkpoints and returns False once that time passes; running again resumes."""
        autocast = self._autocast()
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="training draft head", disable=not progress)
        first_step, warm_clock = self.step, None
        while self.step < self.cfg.steps:
            started = self.clock()
            record = self._train_step(autocast)
            self.train_seconds += self.clock() - started
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc="/".join(f"{a:.2f}" for a in record["accuracy"][:4]))
            bar.update(1)
            if self.step == first_step + 2:  # the first steps pay for allocation and kernel selection
                warm_clock = (self.train_seconds, self.step)
            if self.step == self.cfg.warmup_steps and self.cfg.minutes is not None:
                self._fix_schedule_length(warm_clock)
                bar.total = self.cfg.steps
            stopping = stop_at is not None and time.time() > stop_at and self.step < self.cfg.steps
            checkpoint = self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps
            if checkpoint and self.held_out:
                held = self.evaluate()
                if progress:
                    bar.write(f"step {self.step}: held-out agreement per step "
                              + "/".join("-" if a is None else f"{a:.2f}" for a in held["accuracy"]))
            if stopping or checkpoint:
                self.save_checkpoint()
            if stopping:
                bar.close()
                return False
        bar.close()
        return True

    def _train_step(self, autocast) -> dict:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.cfg)
        with autocast:
            result = unrolled_loss(self.head, self.embed, self.batch(self.step), self.cfg.ttt_steps,
                                   decay=self.cfg.step_decay)
        self.optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.step += 1
        record = {"step": self.step, "loss": result.loss.item(), "lr": lr_at(self.step - 1, self.cfg),
                  "accuracy": result.accuracy, "kl": result.kl}
        self.history.append(record)
        return record

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Per-step agreement and KL on the held-out samples, over all their positions that step reaches
        (None for a step no sample is long enough for)."""
        steps = self.cfg.ttt_steps
        accs, kls, counts = [0.0] * steps, [0.0] * steps, [0.0] * steps
        for first in range(0, len(self.held_out), self.cfg.batch_size):
            batch = self._collate(self.held_out[first:first + self.cfg.batch_size])
            with self._autocast():
                result = unrolled_loss(self.head, self.embed, batch, steps)
            for k, (acc, kl, count) in enumerate(zip(result.accuracy, result.kl, result.counts)):
                accs[k], kls[k], counts[k] = accs[k] + acc * count, kls[k] + kl * count, counts[k] + count
        record = {"step": self.step, "accuracy": [a / n if n else None for a, n in zip(accs, counts)],
                  "kl": [k / n if n else None for k, n in zip(kls, counts)]}
        self.evals.append(record)
        return record

    def _autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else _nothing()

    def _fix_schedule_length(self, warm_clock: tuple[float, int] | None) -> None:
        seconds, step = warm_clock if warm_clock and warm_clock[1] < self.step else (0.0, 0)
        per_step = (self.train_seconds - seconds) / max(1, self.step - step)
        left = self.cfg.minutes * 60 - self.train_seconds
        self.cfg = replace(self.cfg, steps=self.step + max(1, round(left / per_step)))


def _samples_on_gpu(samples: list[Sample], device: torch.device, split: int) -> tuple[list[Sample], list[Sample]]:
    """Batches are cut from device memory when the samples fit with room to spare, else from host memory.
    Returns the samples before and after `split`."""
    total = sum(t.numel() * t.element_size() for s in samples
                for t in (s.input_ids, s.taps, s.hidden, s.loss_mask))
    if torch.cuda.mem_get_info(device)[0] >= 2 * total:
        samples = [Sample(*(t.to(device) for t in (s.input_ids, s.taps, s.hidden, s.loss_mask))) for s in samples]
    return samples[:split], samples[split:]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
