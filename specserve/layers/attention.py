"""Paged attention, plain PyTorch reference backend.

The KV pool of one layer is a tensor [2, num_slots, kv_heads, head_dim]; slot = page * page_size + offset.
Each step writes the new keys/values to their slots, then gathers every sequence's context into a padded
batch and runs SDPA with a mask that is causal within the step and open to everything before it. One token
per sequence and sixteen per sequence go through the same code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each token computed this step
    kv_slots: torch.Tensor  # [B, max_kv] slots of each sequence's context, padded with slot 0
    mask: torch.Tensor | None  # [B, 1, max_q, max_kv] True where a query may attend; None: attend to all
    query_rows: torch.Tensor | None  # [T] row in the padded [B * max_q] query layout; None if T == B, max_q == 1
    max_q: int
    # Set for the Triton decode kernel (one query per sequence, GPU): page tables and context lengths.
    block_tables: torch.Tensor | None = None  # [B, pages] int32
    seq_lens: torch.Tensor | None = None  # [B] int32
    page_size: int = 0
    num_splits: int = 1

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        start_positions: list[int],
        page_tables: list[list[int]],
        page_size: int,
        device: torch.device,
        tree_masks: list[torch.Tensor | None] | None = None,
    ) -> "AttentionMetadata":
        """`tree_masks[b]`, if given, is a [q, q] ancestor mask replacing causality among sequence b's step
        tokens (a draft tree stored parents-first, one slot per node)."""
        batch = len(query_lens)
        max_q = max(query_lens)
        kv_lens = [s + q for s, q in zip(start_positions, query_lens)]
        max_kv = max(kv_lens)
        max_pages = max(len(p) for p in page_tables)
        table = torch.tensor([p + [0] * (max_pages - len(p)) for p in page_tables], dtype=torch.long)
        kv_pos = torch.arange(max_kv)
        kv_slots = table[:, kv_pos // page_size] * page_size + kv_pos % page_size  # [B, max_kv]

        starts = torch.tensor(start_positions)
        qlens = torch.tensor(query_lens)
        q_offset = torch.arange(max_q)
        q_pos = starts[:, None] + q_offset[None, :]  # [B, max_q]
        valid_q = q_offset[None, :] < qlens[:, None]
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & valid_q[:, :, None]  # [B, max_q, max_kv]
        for b, tree in enumerate(tree_masks or []):
            if tree is not None:
                q, start = query_lens[b], start_positions[b]
                mask[b, :q, start:start + q] = tree
        if max_q == 1 and min(kv_lens) == max_kv:
            mask = None  # every query sees its whole row; SDPA's unmasked path is faster

        flat_pos = torch.cat([torch.arange(s, s + q) for s, q in zip(start_positions, query_lens)])
        seq_index = torch.repeat_interleave(torch.arange(batch), qlens)
        slot_mapping = kv_slots[seq_index, flat_pos]
        query_rows = None
        if max_q > 1:
            query_rows = seq_index * max_q + (flat_pos - starts[seq_index])
        return cls(
            slot_mapping=slot_mapping.to(device),
            kv_slots=kv_slots.to(device),
            mask=None if mask is None else mask.unsqueeze(1).to(device),
            query_rows=None if query_rows is None else query_rows.to(device),
            max_q=max_q,
        )


    @classmethod
    def from_slots(
        cls, kv_slots: list[torch.Tensor], masks: list[torch.Tensor], device: torch.device
    ) -> "AttentionMetadata":
        """The general form, for drafting trees in scratch slots: sequence b attends over the slots
        `kv_slots[b]` ([L]) as `masks[b]` ([q, L]) allows, and its q step tokens are written to the last q
        of those slots."""
        batch = len(kv_slots)
        query_lens = [m.shape[0] for m in masks]
        max_q, max_kv = max(query_lens), max(len(s) for s in kv_slots)
        slots = torch.zeros(batch, max_kv, dtype=torch.long)
        mask = torch.zeros(batch, max_q, max_kv, dtype=torch.bool)
        for b, (row, m) in enumerate(zip(kv_slots, masks)):
            slots[b, : len(row)] = row
            mask[b, : m.shape[0], : len(row)] = m
        slot_mapping = torch.cat([row[len(row) - q:] for row, q in zip(kv_slots, query_lens)])
        query_rows = torch.cat([torch.arange(q) + b * max_q for b, q in enumerate(query_lens)])
        return cls(
            slot_mapping=slot_mapping.to(device),
            kv_slots=slots.to(device),
            mask=mask.unsqueeze(1).to(device),
            query_rows=query_rows.to(device) if max_q > 1 else None,
            max_q=max_q,
        )


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_slots, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    kv_cache[0].index_copy_(0, meta.slot_mapping, k)
    kv_cache[1].index_copy_(0, meta.slot_mapping, v)
    if meta.block_tables is not None:
        from specserve.layers.triton_attention import paged_decode_attention

        out = paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, meta.page_size,
                                     meta.num_splits)
        return out.view(q.shape[0], -1)
    batch = meta.kv_slots.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    if meta.query_rows is None:
        q_pad = q.unsqueeze(1)
    else:
        q_pad = q.new_zeros(batch * meta.max_q, num_heads, head_dim)
        q_pad[meta.query_rows] = q
        q_pad = q_pad.view(batch, meta.max_q, num_heads, head_dim)
    gather_shape = (*meta.kv_slots.shape, *kv_cache.shape[2:])  # [B, max_kv, Hkv, D]
    flat_slots = meta.kv_slots.view(-1)
    keys = kv_cache[0].index_select(0, flat_slots).view(gather_shape)
    values = kv_cache[1].index_select(0, flat_slots).view(gather_shape)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=meta.mask,
        scale=scale,
        enable_gqa=True,
    )  # [B, H, max_q, D]
    out = out.transpose(1, 2).reshape(batch * meta.max_q, num_heads * head_dim)
    return out if meta.query_rows is None else out[meta.query_rows]
