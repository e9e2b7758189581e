"""Paged MLA decode attention in Triton: absorbed queries over the latent cache, read in place.

Each cached row is [c | k_pe] (kv_lora_rank + qk_rope_head_dim values); every head attends over the same rows
(one KV head), with c as its value. So one program serves one sequence (or a run of tree rows sharing its
context) and all its query heads together, and reads each cached row once for all of them; a score is
q_latent . c + q_pe . k_pe, two dot products over power-of-two widths (512 and 64 in DeepSeek-V3). Contexts are
cut into slices as in kernels/triton/attention.py (flash-decoding), whose merge kernel joins them.

The PyTorch form it is held to is layers/attention.py's `attend_rows` over the plane passed as keys and values
(layers/mla.py), the output's first kv_lora_rank columns. Which widths it takes: layers/mla.py's
`latent_kernel_takes`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.triton import pdl as triton_pdl
from specserve.kernels.triton.attention import _merge_kernel
from specserve.kernels.triton.pdl import gdc_launch_dependents, gdc_wait

# (context rows per inner iteration, warps, stages): a [32, 576] block of the cache. Untimed so far (no GPU run
# yet): programs of 64 query rows take 8 warps, so their [64, 512] fp32 accumulator is not held by 4.
TILE = (32, 4, 2)
# Query rows (tree rows x heads) one program holds: its output accumulator is [rows, kv_lora_rank] in fp32.
MAX_ROWS = 64


@triton.jit
def _latent_block(q_lat, q_pe, CACHE, slot, load_ok, see, stride_s, m, l, acc, scale,
                  R: tl.constexpr, DR: tl.constexpr, IEEE: tl.constexpr, MAYBE_EMPTY: tl.constexpr):
    """One block of cached rows folded into the running max m, sum l and output acc (online softmax)."""
    base = CACHE + slot[:, None] * stride_s
    c = tl.load(base + tl.arange(0, R)[None, :], mask=load_ok[:, None], other=0.0)
    k_pe = tl.load(base + R + tl.arange(0, DR)[None, :], mask=load_ok[:, None], other=0.0)
    if IEEE:
        scores = (tl.dot(q_lat, tl.trans(c), input_precision="ieee")
                  + tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee"))
    else:
        scores = tl.dot(q_lat, tl.trans(c)) + tl.dot(q_pe, tl.trans(k_pe))
    scores = tl.where(see, scores * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    if MAYBE_EMPTY:  # nothing visible so far (an empty tail) must leave the state as it was, not NaN
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
        p = tl.where(see, tl.exp(scores - m_new[:, None]), 0.0)
    else:
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, c.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
    return m_new, l, acc


@triton.jit(do_not_specialize=["stride_tb", "stride_tail", "stride_lb", "stride_lh", "CHUNK"])
def _partial_kernel(Q, CACHE, TABLES, LENS, TAIL, TAIL_LENS, OUT, LSE, scale,
                    stride_qb, stride_qh, stride_s, stride_tb, stride_tail, stride_ob, stride_oh, stride_os,
                    stride_lb, stride_lh, CHUNK,
                    HEADS: tl.constexpr, HEADS_POW2: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr,
                    R: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                    IEEE: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr, TAIL_PAD: tl.constexpr):
    """One program: one sequence's ROWS query rows x all HEADS heads, over one slice of its context."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.load(LENS + seq * ROWS)  # the rows of one sequence share its context length
    i = tl.arange(0, M)
    row = i // HEADS_POW2
    head = i % HEADS_POW2
    ok = (row < ROWS) & (head < HEADS)
    rows = seq * ROWS + row
    q_base = Q + rows[:, None] * stride_qb + head[:, None] * stride_qh
    q_lat = tl.load(q_base + tl.arange(0, R)[None, :], mask=ok[:, None], other=0.0)
    q_pe = tl.load(q_base + R + tl.arange(0, DR)[None, :], mask=ok[:, None], other=0.0)
    m = tl.full([M], float("-inf"), tl.float32)
    l = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, R], tl.float32)
    splits = tl.num_programs(1)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, seq_len)
    for off in range(start, end, BLOCK):
        t = off + tl.arange(0, BLOCK)
        valid = t < end
        page = tl.load(TABLES + seq * ROWS * stride_tb + t // PAGE, mask=valid, other=0)
        slot = (page * PAGE + t % PAGE).to(tl.int64)
        m, l, acc = _latent_block(q_lat, q_pe, CACHE, slot, valid, valid[None, :], stride_s, m, l, acc, scale,
                                  R, DR, IEEE, False)
    if TAIL_PAD > 0:
        # Draft-tree rows: after the shared context, each row's ancestors' slots and its own, listed per row.
        # Each row's tail is one block for one slice, dealt from the last slice down (the least context).
        t = tl.arange(0, TAIL_PAD)
        for r in tl.static_range(ROWS):
            if (splits - 1 - split) == r % splits:
                valid = t < tl.load(TAIL_LENS + seq * ROWS + r)
                slot = tl.load(TAIL + (seq * ROWS + r) * stride_tail + t, mask=valid, other=0).to(tl.int64)
                see = (row == r)[:, None] & valid[None, :]
                m, l, acc = _latent_block(q_lat, q_pe, CACHE, slot, valid, see, stride_s, m, l, acc, scale,
                                          R, DR, IEEE, True)
    has = l > 0
    out = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    out_offs = OUT + rows[:, None] * stride_ob + head[:, None] * stride_oh + split * stride_os + tl.arange(0, R)[None, :]
    if DIRECT:  # one slice: the final output, nothing to merge
        tl.store(out_offs, out.to(OUT.dtype.element_ty), mask=ok[:, None])
    else:
        lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
        tl.store(out_offs, out, mask=ok[:, None])
        tl.store(LSE + rows * stride_lb + head * stride_lh + split, lse, mask=ok)


def mla_decode_attention(q: torch.Tensor, plane: torch.Tensor, rank: int, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, page_size: int, splits: int,
                         tail_slots: torch.Tensor | None = None, tail_lens: torch.Tensor | None = None,
                         rows_per_seq: int = 1) -> torch.Tensor:
    """q [B, H, rank + rope_dim] (latent queries, then rotated q_pe); plane [slots, 1, rank + rope_dim], one
    layer's cache -> [B, H, rank], each head's softmax-weighted mix of the latents c. Rows, page tables, context
    lengths, tails and runs of rows as `paged_decode_attention` takes them."""
    block, num_warps, num_stages = TILE
    batch, heads, dim = q.shape
    heads_pow2 = triton.next_power_of_2(heads)
    if rows_per_seq * heads_pow2 > MAX_ROWS:  # each row a program of its own: the context read once per row
        rows_per_seq = 1
    rope_dim = dim - rank
    max_tokens = block_tables.shape[1] * page_size
    chunk = triton.cdiv(triton.cdiv(max_tokens, splits), block) * block
    direct = splits == 1
    out = q.new_empty(batch, heads, rank)
    part = out.view(batch, heads, 1, rank) if direct else torch.empty(batch, heads, splits, rank,
                                                                     dtype=torch.float32, device=q.device)
    lse = part if direct else torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    assert batch % rows_per_seq == 0 and plane.stride(-1) == 1 and q.stride(-1) == 1
    tail_pad = 0 if tail_slots is None else max(16, triton.next_power_of_2(tail_slots.shape[1]))
    if tail_slots is not None:  # the kernel steps through a row's tail with unit stride
        assert tail_slots.stride(1) == 1 and tail_lens.dtype == torch.int32
    else:  # unused pointers
        tail_slots, tail_lens = seq_lens, seq_lens
    rows = max(16, triton.next_power_of_2(rows_per_seq * heads_pow2))
    num_warps = 8 if rows >= 64 else num_warps
    _partial_kernel[(batch // rows_per_seq, splits)](
        q, plane, block_tables, seq_lens, tail_slots, tail_lens, part, lse, scale,
        q.stride(0), q.stride(1), plane.stride(0), block_tables.stride(0), tail_slots.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), chunk,
        HEADS=heads, HEADS_POW2=heads_pow2, M=rows,
        ROWS=rows_per_seq, R=rank, DR=rope_dim, PAGE=page_size, BLOCK=block, IEEE=q.dtype == torch.float32,
        DIRECT=direct, TAIL_PAD=tail_pad, num_warps=num_warps, num_stages=num_stages,
        **triton_pdl.launch_options(q),
    )
    if direct:
        return out
    _merge_kernel[(batch, heads)](
        part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), SPLITS=splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)), D=rank,
        **triton_pdl.launch_options(q),
    )
    return out
