"""Paged attention, plain PyTorch reference backend.

The KV pool of one layer is a tensor [2, num_slots, kv_heads, head_dim]; slot = page * page_size + offset.
Each step writes the new keys/values to their slots, then gathers every sequence's context into a padded
batch and runs SDPA with a mask that is causal within the step and open to everything before it. One token
per sequence and sixteen per sequence go through the same code. A step that mixes decode rows with prefill
chunks runs one SDPA call for the short rows and one per run of similar-sized chunks, so padding stays bounded.
On a GPU the single-query rows of such a step go to the paged decode kernel instead, which reads their
contexts in place.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specserve.kernels.cpu import build as cpu_kernels
from specserve.transfer import to_device


# SDPA for shapes that rarely repeat (the draft head's catch-ups): without cuDNN's backend, which builds an
# execution plan for every new shape, host time far beyond the call's device time (docs/performance.md).
# Flash serves causal calls; masked ones go to the memory-efficient kernel, with K/V heads repeated for it (it
# takes no grouped heads). The target keeps the default choice: its prompt steps repeat shapes, and repeating
# K/V heads for a step's decode rows made prompt steps with many decoding requests slower.
VARIED_SHAPE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# Sequences with at most this many queries (decode steps and verified draft trees) share one padded SDPA call;
# longer ones (prefill chunks) are padded only with chunks of similar size, not with every decode row.
SHORT_QUERY = 16


@dataclass(frozen=True)
class QueryGroup:
    """Sequences whose queries are padded to one length and attended in one SDPA call."""

    kv_slots: torch.Tensor  # [B, max_kv] slots of each sequence's context, padded with slot 0
    mask: torch.Tensor | None  # [B, 1, max_q, max_kv] True where a query may attend; None: attend to all
    query_rows: torch.Tensor | None  # [T_g] row in the padded [B * max_q] layout; None if all q lengths equal
    max_q: int
    tokens: torch.Tensor | None = None  # [T_g] which of the step's tokens are this group's; None: all
    # Fresh prompts (nothing cached before the step): keys and values come from the step itself, no gather.
    self_attention: bool = False
    causal: bool = False  # the mask is plain causality (equal lengths), so SDPA's causal kernels apply
    # CPU, short causal queries: the compiled kernel reads the cache directly. Per token (in the group's order):
    # its row of kv_slots, and how many of that row's slots it sees.
    token_seq: torch.Tensor | None = None
    token_kv_len: torch.Tensor | None = None
    varied_shapes: bool = False  # shapes that rarely repeat: SDPA keeps off cuDNN (VARIED_SHAPE_BACKENDS)


@dataclass(frozen=True)
class DecodeRows:
    """A step's single-query rows, attended by the paged decode kernel (its PyTorch contract on a CPU): in a
    step with prompt chunks they would otherwise gather their whole contexts into an SDPA call whose shape
    changes every step, and PyTorch's cuDNN backend builds a plan for each new shape (tens of ms of host time)."""

    tokens: torch.Tensor  # [R] which of the step's tokens
    block_tables: torch.Tensor  # [R, pages] int32
    seq_lens: torch.Tensor  # [R] int32: row r attends to positions [0, seq_lens[r])
    max_context: int


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each token computed this step
    groups: tuple[QueryGroup, ...] = ()  # the PyTorch reference path's SDPA calls
    # Set for the Triton decode kernel (one query per sequence, GPU): page tables and context lengths.
    block_tables: torch.Tensor | None = None  # [B, pages] int32
    seq_lens: torch.Tensor | None = None  # [B] int32
    page_size: int = 0
    num_splits: int = 1
    # Draft-tree rows (with block_tables): after positions [0, seq_lens), row b also attends to the first
    # tail_lens[b] slots of tail_slots[b] (its ancestors' and its own, which the page table cannot reach).
    tail_slots: torch.Tensor | None = None  # [B, T] int64
    tail_lens: torch.Tensor | None = None  # [B] int32
    # Rows come in runs of this many that share one page table and context length (a sequence's tree nodes):
    # the kernel reads that context once per run.
    rows_per_seq: int = 1
    # Every slot in a run's tails is one of its rows' own (a verified tree: ancestors and self), so the kernel
    # may attend to the run's tails as one block (unless SPECSERVE_CLOSED_TAILS=0).
    closed_tails: bool = False
    decode_rows: DecodeRows | None = None  # with groups: the step's single-query rows, by the decode kernel

    @classmethod
    def for_decode_kernel(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          page_size: int, kv_heads: int, max_context: int, **tails) -> "AttentionMetadata":
        """The paged decode kernel's form: each row of `block_tables` one query (or, with `rows_per_seq` in
        `tails`, runs of rows sharing a context), contexts up to `max_context` tokens cut into as many
        slices as fill the GPU (one elsewhere, where the kernel's PyTorch contract runs)."""
        splits = 1
        if block_tables.is_cuda:
            from specserve.kernels.triton.attention import num_splits  # Triton: GPU machines only

            splits = num_splits(block_tables.shape[0] // tails.get("rows_per_seq", 1), kv_heads, max_context)
        return cls(slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens, page_size=page_size,
                   num_splits=splits, **tails)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        start_positions: list[int],
        page_tables: list[list[int]],
        page_size: int,
        device: torch.device,
        tree_masks: list[torch.Tensor | None] | None = None,
        varied_shapes: bool = False,
        decode_kernel: bool | None = None,
    ) -> "AttentionMetadata":
        """`tree_masks[b]`, if given, is a [q, q] ancestor mask replacing causality among sequence b's step
        tokens (a draft tree stored parents-first, one slot per node). `varied_shapes`: see QueryGroup.
        `decode_kernel` (default: on a GPU): single-query rows go to the paged decode kernel (DecodeRows)."""
        trees = list(tree_masks or []) + [None] * (len(query_lens) - len(tree_masks or []))
        if decode_kernel is None:
            decode_kernel = device.type == "cuda"
        singles = [b for b, q in enumerate(query_lens) if decode_kernel and q == 1 and trees[b] is None]
        single = set(singles)
        short = [b for b, q in enumerate(query_lens) if q <= SHORT_QUERY and b not in single]
        long = [b for b, q in enumerate(query_lens) if q > SHORT_QUERY]
        kv_lens = [s + q for s, q in zip(start_positions, query_lens)]
        parts = ([short] if short else []) + _similar_runs(long, query_lens, kv_lens)
        if len(parts) == 1 and not singles:
            group, slot_mapping = _padded_group(query_lens, start_positions, page_tables, page_size, trees, device)
            return cls(slot_mapping=to_device(slot_mapping, device),
                       groups=(replace(group, varied_shapes=varied_shapes),))
        first_token = [0, *itertools.accumulate(query_lens)]
        groups, slot_mapping = [], torch.empty(first_token[-1], dtype=torch.long)
        for members in parts:
            group, slots = _padded_group([query_lens[b] for b in members], [start_positions[b] for b in members],
                                         [page_tables[b] for b in members], page_size,
                                         [trees[b] for b in members], device)
            tokens = torch.cat([torch.arange(first_token[b], first_token[b + 1]) for b in members])
            slot_mapping[tokens] = slots
            groups.append(replace(group, tokens=to_device(tokens, device), varied_shapes=varied_shapes))
        rows = None
        if singles:
            rows, slots = _decode_rows([first_token[b] for b in singles], [start_positions[b] for b in singles],
                                       [page_tables[b] for b in singles], page_size, device)
            slot_mapping[[first_token[b] for b in singles]] = slots
        return cls(slot_mapping=to_device(slot_mapping, device), groups=tuple(groups), decode_rows=rows,
                   page_size=page_size)

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
        group = QueryGroup(kv_slots=to_device(slots, device), mask=to_device(mask.unsqueeze(1), device),
                           query_rows=to_device(query_rows, device) if min(query_lens) < max_q else None,
                           max_q=max_q, varied_shapes=True)
        return cls(slot_mapping=to_device(slot_mapping, device), groups=(group,))


def _similar_runs(members: list[int], query_lens: list[int], kv_lens: list[int]) -> list[list[int]]:
    """Long chunks of similar size share a call: padding stays under a quarter of each dimension."""
    runs: list[list[int]] = []
    for b in sorted(members, key=lambda b: (-query_lens[b], -kv_lens[b])):
        head = runs[-1][0] if runs else None
        if head is not None and 4 * query_lens[b] >= 3 * query_lens[head] and 4 * kv_lens[b] >= 3 * kv_lens[head]:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs


def _decode_rows(tokens: list[int], positions: list[int], page_tables: list[list[int]], page_size: int,
                 device: torch.device) -> tuple[DecodeRows, torch.Tensor]:
    """The decode kernel's metadata for single-query rows at `positions`, and their tokens' slots (host)."""
    width = max(len(p) for p in page_tables)
    tables = torch.tensor([p + [0] * (width - len(p)) for p in page_tables], dtype=torch.int32)
    pos = torch.tensor(positions)
    slots = tables[torch.arange(len(tokens)), pos // page_size].long() * page_size + pos % page_size
    rows = DecodeRows(tokens=to_device(torch.tensor(tokens), device), block_tables=to_device(tables, device),
                      seq_lens=to_device((pos + 1).to(torch.int32), device), max_context=max(positions) + 1)
    return rows, slots


def _padded_group(query_lens: list[int], start_positions: list[int], page_tables: list[list[int]],
                  page_size: int, trees: list[torch.Tensor | None], device: torch.device):
    """One SDPA call's metadata for these sequences, and the slots of their step tokens (host tensor)."""
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
    self_attention = max(start_positions) == 0 and all(tree is None for tree in trees)
    causal = self_attention and min(query_lens) == max_q
    mask = None  # causality (fresh prompts of one length) or nothing at all: SDPA's unmasked kernels are faster
    if not causal and not (max_q == 1 and min(kv_lens) == max_kv):
        q_offset = torch.arange(max_q)
        q_pos = starts[:, None] + q_offset[None, :]  # [B, max_q]
        valid_q = q_offset[None, :] < qlens[:, None]
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & valid_q[:, :, None]  # [B, max_q, max_kv]
        for b, tree in enumerate(trees):
            if tree is not None:
                q, start = query_lens[b], start_positions[b]
                mask[b, :q, start:start + q] = tree

    flat_pos = torch.cat([torch.arange(s, s + q) for s, q in zip(start_positions, query_lens)])
    seq_index = torch.repeat_interleave(torch.arange(batch), qlens)
    slots = kv_slots[seq_index, flat_pos]  # [T_g] in sequence order
    query_rows = None  # sequences of one length: the padded layout is the step's own order
    if min(query_lens) < max_q:
        query_rows = to_device(seq_index * max_q + (flat_pos - starts[seq_index]), device)
    direct = device.type == "cpu" and max_q <= SHORT_QUERY and not self_attention and all(t is None for t in trees)
    group = QueryGroup(kv_slots=to_device(kv_slots, device),
                       mask=None if mask is None else to_device(mask.unsqueeze(1), device),
                       query_rows=query_rows, max_q=max_q, self_attention=self_attention, causal=causal,
                       token_seq=seq_index if direct else None, token_kv_len=flat_pos + 1 if direct else None)
    return group, slots


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_slots, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Writes this step's k and v to their slots, then attends."""
    if kv_cache.is_cuda:
        from specserve.kernels.triton.pointwise import store_kv  # one launch for both, where Triton runs

        store_kv(k, v, kv_cache, meta.slot_mapping)
    else:
        kv_cache[0].index_copy_(0, meta.slot_mapping, k)
        kv_cache[1].index_copy_(0, meta.slot_mapping, v)
    return attend(q, k, v, kv_cache, meta, scale)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
           scale: float) -> torch.Tensor:
    """Attention of q [T, H, D] over the cache, whose slots already hold this step's k and v. [T, H * D]."""
    if meta.block_tables is not None:
        if not q.is_cuda:
            return attend_rows(q, kv_cache, meta, scale)
        from specserve.kernels.triton.attention import paged_decode_attention

        out = paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, meta.page_size,
                                     meta.num_splits, meta.tail_slots, meta.tail_lens, meta.rows_per_seq,
                                     closed_tails=meta.closed_tails)
        return out.view(q.shape[0], -1)
    if len(meta.groups) == 1 and meta.groups[0].tokens is None:
        return _attend(q, k, v, kv_cache, meta.groups[0], scale)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for group in meta.groups:
        out[group.tokens] = _attend(q[group.tokens], k[group.tokens], v[group.tokens], kv_cache, group, scale)
    if meta.decode_rows is not None:
        rows = meta.decode_rows
        out[rows.tokens] = _attend_decode_rows(q[rows.tokens], kv_cache, rows, meta.page_size, scale)
    return out


def _attend_decode_rows(q: torch.Tensor, kv_cache: torch.Tensor, rows: DecodeRows, page_size: int,
                        scale: float) -> torch.Tensor:
    # The kernel form; its slot mapping is not read (the step's KV is stored before attention).
    kernel_form = AttentionMetadata.for_decode_kernel(rows.tokens, rows.block_tables, rows.seq_lens, page_size,
                                                      kv_cache.shape[2], rows.max_context)
    if not decode_kernel_takes(q.shape[-1]):
        return attend_rows(q, kv_cache, kernel_form, scale)
    return attend(q, q, q, kv_cache, kernel_form, scale)


def decode_kernel_takes(head_dim: int) -> bool:
    """The decode kernel tiles the head dimension whole: powers of two only."""
    return head_dim & (head_dim - 1) == 0


def attend_rows(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The decode kernel's contract in PyTorch: row b (one query) attends to positions [0, seq_lens[b]) of its
    page table, then to its tail slots. Runs the graph programs on a CPU, and is the kernel tests' reference."""
    tables, page = meta.block_tables.long(), meta.page_size
    pos = torch.arange(tables.shape[1] * page, device=q.device)
    slots = tables[:, pos // page] * page + pos % page  # [B, L]
    valid = pos[None, :] < meta.seq_lens[:, None]
    if meta.tail_slots is not None:
        tail = torch.arange(meta.tail_slots.shape[1], device=q.device)
        slots = torch.cat([slots, meta.tail_slots], dim=1)
        valid = torch.cat([valid, tail[None, :] < meta.tail_lens[:, None]], dim=1)
    keys, values = kv_cache[0][slots], kv_cache[1][slots]  # [B, L, Hkv, D]
    out = F.scaled_dot_product_attention(q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True)
    return out.reshape(q.shape[0], -1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, group: QueryGroup,
            scale: float) -> torch.Tensor:
    """Gathers each sequence's context from its slots (or, for fresh prompts, takes the step's own keys
    and values) and runs SDPA over the padded batch. On CPU, short causal queries skip the gather and the
    padding: the compiled kernel reads the slots in place."""
    # The kernel reads planes laid out one after the other; MLA's latent plane, passed as keys and values
    # both (layers/mla.py), is gathered here instead.
    direct = group.token_seq is not None and kv_cache.dtype == torch.float32 and kv_cache.is_contiguous()
    kernels = cpu_kernels.kernels() if direct else None
    if kernels is not None and q.shape[-1] % 8 == 0:
        out = kernels.paged_attention(q, kv_cache, group.kv_slots, group.token_seq, group.token_kv_len, scale)
        return out.view(q.shape[0], -1)
    batch = group.kv_slots.shape[0]
    q_pad = _pad(q, group)
    if group.self_attention:
        keys, values = _pad(k, group), _pad(v, group)
    else:
        gather_shape = (*group.kv_slots.shape, *kv_cache.shape[2:])  # [B, max_kv, Hkv, D]
        flat_slots = group.kv_slots.view(-1)
        keys = kv_cache[0].index_select(0, flat_slots).view(gather_shape)
        values = kv_cache[1].index_select(0, flat_slots).view(gather_shape)
    out = _sdpa(q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), group.mask, group.causal,
                scale, group.varied_shapes)  # [B, H, max_q, D]
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = out.transpose(1, 2).reshape(batch * group.max_q, num_heads * head_dim)
    return out if group.query_rows is None else out[group.query_rows]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          scale: float, varied_shapes: bool) -> torch.Tensor:
    """SDPA over [B, heads, L, D] with grouped K/V heads."""
    if not (q.is_cuda and varied_shapes):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    if mask is not None:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with sdpa_kernel(VARIED_SHAPE_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=mask is None)


def _pad(x: torch.Tensor, group: QueryGroup) -> torch.Tensor:
    """[T_g, heads, D] in step order -> [B, max_q, heads, D], zero-padded."""
    batch = group.kv_slots.shape[0]
    if group.query_rows is None:
        return x.reshape(batch, group.max_q, *x.shape[1:])
    padded = x.new_zeros(batch * group.max_q, *x.shape[1:])
    padded[group.query_rows] = x
    return padded.view(batch, group.max_q, *x.shape[1:])
