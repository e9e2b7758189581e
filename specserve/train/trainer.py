"""Training an EAGLE-3 head on recorded samples: AdamW, linear warm-up then cosine decay, gradient clipping,
bf16 autocast on a GPU, resumable checkpoints, and a progress bar with the loss and per-step accuracy."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

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
    seed: int = 0
    checkpoint_every: int = 200


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


class Trainer:
    def __init__(self, head: Eagle3Head, target: torch.nn.Module, samples: list[Sample], cfg: TrainConfig,
                 out_dir: Path) -> None:
        self.head, self.cfg, self.out_dir = head, cfg, out_dir
        self.embed = target.embed_tokens
        self.device = target.embed_tokens.weight.device
        draft_ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=head.d2t.device))
        self.draft_lm_head = _lm_head_weight(target)[draft_ids.to(self.device)].detach().float()
        self.samples = samples
        head.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0
        self.history: list[dict] = []

    # -- checkpoints ---------------------------------------------------------
    def save_checkpoint(self) -> Path:
        path = self.out_dir / CHECKPOINT
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                    "config": asdict(self.cfg), "history": self.history}, path)
        return path

    def resume(self) -> bool:
        """Continues from `out_dir/checkpoint.pt` if it exists: weights, optimizer moments, step and history."""
        path = self.out_dir / CHECKPOINT
        if not path.exists():
            return False
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.history = state["step"], state["history"]
        return True

    # -- training ------------------------------------------------------------
    def batch(self, step: int) -> TTTBatch:
        """The samples of `step` depend on the step alone, so a resumed run sees what it would have seen."""
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        picks = torch.randint(len(self.samples), (self.cfg.batch_size,), generator=g).tolist()
        chosen = [self.samples[i] for i in picks]
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

    def train(self, progress: bool = True) -> list[dict]:
        cfg = self.cfg
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else _nothing()
        bar = tqdm(total=cfg.steps, initial=self.step, desc="training draft head", disable=not progress)
        while self.step < cfg.steps:
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(self.step, cfg)
            with autocast:
                result = unrolled_loss(self.head, self.embed, self.batch(self.step), cfg.ttt_steps)
            self.optimizer.zero_grad(set_to_none=True)
            result.loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), cfg.grad_clip)
            self.optimizer.step()
            self.step += 1
            record = {"step": self.step, "loss": result.loss.item(), "lr": lr_at(self.step - 1, cfg),
                      "accuracy": result.accuracy, "kl": result.kl}
            self.history.append(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc="/".join(f"{a:.2f}" for a in result.accuracy[:4]))
            bar.update(1)
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                self.save_checkpoint()
        bar.close()
        return self.history


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
