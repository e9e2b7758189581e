"""EAGLE-3 training-time test: the head is unrolled on its own predictions for K steps, as at inference.

Chain t starts at position t. Step 0 reads the target's taps at t (through `fc`) with the embedding of token
t+1 and predicts token t+2, exactly as a catch-up row does at inference. Step k reads the head's own output
of step k-1 for the same chain with the embedding of token t+1+k (at position t+k) and predicts token t+k+2.
Its attention sees the real prefix (step-0 keys at positions <= t) and its own chain's keys of steps 1..k,
which is what the draft KV holds while drafting. The loss at each step is the forward KL from the target's
next-token distribution, restricted to the draft vocabulary, to the head's; step k weighs `decay**k` (the
EAGLE-3 reference training's weights, here divided by their sum so the loss stays a mean), since a late step
only counts once every earlier one was accepted.

Only the math lives here: dense tensors [B, T, ...] and a padding mask, no paging.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels import pointwise


@dataclass(frozen=True)
class TTTBatch:
    input_ids: torch.Tensor  # [B, T] tokens
    taps: torch.Tensor  # [B, T, len(taps) * H] target layer outputs at each position
    target_logits: torch.Tensor  # [B, T, Vd] target logits over the draft vocabulary for the token after t
    loss_mask: torch.Tensor  # [B, T] 1 where the token after t is one to learn (an answer token)


@dataclass(frozen=True)
class TTTResult:
    loss: torch.Tensor  # scalar, the steps' masked mean KLs averaged with weights decay**k
    kl: list[float]  # per unroll step
    accuracy: list[float]  # per unroll step: head argmax == target argmax
    counts: list[float]  # per unroll step: the positions its KL and accuracy average over
    logits: list[torch.Tensor] | None = None  # per step [B, T, Vd], when asked for


def unrolled_loss(head, embed: torch.nn.Module, batch: TTTBatch, num_steps: int,
                  keep_logits: bool = False, decay: float = 1.0) -> TTTResult:
    """`head` is an Eagle3Head (trainable); `embed` the target's frozen token embedding."""
    ids, length = batch.input_ids, batch.input_ids.shape[1]
    # The target side is the same at every step, only shifted: normalised once, and read back (one host
    # sync) once at the end, so the device never waits for the host inside a step.
    target_logp = torch.log_softmax(batch.target_logits.float(), dim=-1)
    target_p = target_logp.exp()
    target_neg_entropy = (target_p * target_logp).sum(-1)
    target_argmax = target_logp.argmax(-1)
    del target_logp  # ~1 GB at batch 32: what the steps need is kept above
    mask = batch.loss_mask.float()
    hidden = head.fc(batch.taps)
    keys, values = [], []
    losses, sums, kept = [], [], []
    for step in range(num_steps):
        # Chain t reads token t+1+step; chains whose input or target runs past the sequence are masked.
        shift = 1 + step
        if shift >= length:
            break
        tokens = F.pad(ids[:, shift:], (0, shift), value=0)
        positions = torch.arange(length, device=ids.device) + step
        hidden = _layer(head, embed(tokens), hidden, positions, keys, values)
        logits = head.compute_logits(hidden).float()
        if keep_logits:
            kept.append(logits.detach())
        # Step k at chain t predicts token t+k+2: the target's distribution at position t+k+1. Chains past
        # length - shift have no target and are left out.
        logits = logits[:, :length - shift]
        step_mask = mask[:, shift:]
        kl = target_neg_entropy[:, shift:] - (target_p[:, shift:] * torch.log_softmax(logits, dim=-1)).sum(-1)
        agree = (logits.argmax(-1) == target_argmax[:, shift:]).float()
        count = step_mask.sum()
        losses.append((kl * step_mask).sum() / count.clamp(min=1.0))
        sums.append(torch.stack([count, losses[-1].detach(), (agree * step_mask).sum() / count.clamp(min=1.0)]))
    weights = decay ** torch.arange(len(losses), dtype=torch.float32, device=ids.device)
    loss = (torch.stack(losses) * weights).sum() / weights.sum()
    counts, kls, accs = (list(column) for column in zip(*torch.stack(sums).tolist()))
    return TTTResult(loss, kls, accs, counts, kept if keep_logits else None)


def _layer(head, embeds, hidden, positions, keys: list, values: list) -> torch.Tensor:
    """The head's decoder layer with training-time-test attention; appends this step's keys/values."""
    mid = head.midlayer
    attn = mid.self_attn
    x = torch.cat([mid.input_layernorm(embeds), mid.hidden_norm(hidden)], dim=-1)
    batch, length, _ = x.shape
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.reshape(batch * length, attn.num_heads, attn.head_dim)
    k = k.reshape(batch * length, attn.num_kv_heads, attn.head_dim)
    flat_positions = positions.repeat(batch)
    q, k = pointwise.rotary(flat_positions, head.rotary.cos_sin, q, k)
    q = q.view(batch, length, attn.num_heads, attn.head_dim).transpose(1, 2)  # [B, H, T, D]
    k = k.view(batch, length, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    v = v.reshape(batch, length, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    keys.append(k)
    values.append(v)
    out = _ttt_attention(q, keys, values, attn.scale)
    hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
    return hidden + mid.mlp(mid.post_attention_layernorm(hidden))


def _ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float):
    """q [B, H, T, D]; keys/values per step [B, Hkv, T, D]. Chain t sees step-0 keys at positions <= t and
    the keys of steps 1..k at t itself."""
    group = q.shape[1] // keys[0].shape[1]
    expand = (lambda x: x.repeat_interleave(group, dim=1)) if group > 1 else (lambda x: x)
    length = q.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    prefix = torch.einsum("bhtd,bhsd->bhts", q, expand(keys[0])).float() * scale
    prefix = prefix.masked_fill(~causal, float("-inf"))
    own = [(q * expand(k)).sum(-1, keepdim=True).float() * scale for k in keys[1:]]  # [B, H, T, 1] each
    weights = torch.softmax(torch.cat([prefix, *own], dim=-1), dim=-1).to(q.dtype)
    out = torch.einsum("bhts,bhsd->bhtd", weights[..., :length], expand(values[0]))
    for i, v in enumerate(values[1:]):
        out = out + weights[..., length + i:length + i + 1] * expand(v)
    return out
