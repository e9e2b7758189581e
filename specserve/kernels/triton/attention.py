"""Paged decode attention in Triton: one query token per sequence, reading K/V straight from the paged pool.

The reference path gathers every sequence's context into a padded batch and runs SDPA, which moves the
context through memory several times (and, with grouped-query attention, expands K/V per query head). Here
each program owns one sequence, one KV head (all the query heads that share it, so K/V is read once) and
one slice of the context (flash-decoding: slices run in parallel so a single long sequence still fills the
GPU). Each slice keeps a running max and sum (online softmax); when a context is cut into more than one
slice, a second kernel merges them by their log-sum-exp (with one slice the first kernel writes the output).
Everything is shaped by tensors, not host values, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve import envs
from specserve.kernels.triton import pdl as triton_pdl
from specserve.kernels.triton.pdl import gdc_launch_dependents, gdc_wait

# (context tokens per inner iteration, warps, pipeline stages). One query row per sequence: graph-timed over a
# whole decode step, the longer tile with a deeper pipeline came closer to the KV's copy rate than (32, 4, 3),
# at large batches and at batch 1 alike. Runs of tree rows hold up to 64 query rows a program, and keep the
# smaller tile.
ROW_TILE = (64, 4, 4)
TREE_TILE = (32, 4, 3)


@triton.jit
def _attend_block(q, K, V, slot, load_ok, see, kv_head, stride_ks, stride_kh, m, l, acc, scale,
                  D: tl.constexpr, IEEE: tl.constexpr, MAYBE_EMPTY: tl.constexpr):
    """One block of slots folded into the running max m, sum l and output acc (online softmax). `load_ok`
    [N] says which slots exist, `see` [M, N] (or [1, N]) which query rows may attend to them."""
    d = tl.arange(0, D)
    kv_offs = slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
    k = tl.load(K + kv_offs, mask=load_ok[:, None], other=0.0)
    v = tl.load(V + kv_offs, mask=load_ok[:, None], other=0.0)
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(see, scores * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    if MAYBE_EMPTY:  # nothing visible so far (an empty tail, say) must leave the state as it was, not NaN
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
        p = tl.where(see, tl.exp(scores - m_new[:, None]), 0.0)
    else:  # context blocks always hold a valid slot for every row
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


# Kernels are compiled per value of every constexpr, and per integer argument that is 1 or a multiple of 16.
# The graphs' kernels are compiled at capture, but eager calls (decode rows of steps with prompts, the draft
# head's catch-up) see a new table width or slice count almost every time, and each new specialisation
# would compile inside a serving step, stalling it. So the arguments that vary with the batch are not
# specialised on (the table and tail widths, the chunk length, and the log-sum-exp strides, which are
# multiples of the slice count), the slice count is a plain argument (its power-of-two padding the only
# constexpr), and `warm_up` compiles every form the eager calls can take at startup.
@triton.jit(do_not_specialize=["stride_tb", "stride_tail", "stride_lb", "stride_lh", "CHUNK"])
def _partial_kernel(Q, K, V, TABLES, LENS, TAIL, TAIL_LENS, OUT, LSE, scale,
                    stride_qb, stride_qh, stride_ks, stride_kh, stride_tb, stride_tail, stride_ob, stride_oh,
                    stride_os, stride_lb, stride_lh, CHUNK,
                    GROUP: tl.constexpr, GROUP_POW2: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr,
                    D: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
                    DIRECT: tl.constexpr, PDL: tl.constexpr, TAIL_PAD: tl.constexpr, TAIL_WIDTH: tl.constexpr,
                    CLOSED_TAILS: tl.constexpr):
    """One program: one sequence's ROWS query rows (tree nodes share their context; 1 for plain decode) x
    the GROUP query heads of one KV head, over one slice of the context, so K/V are read once for all."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(LENS + seq * ROWS)  # the rows of one sequence share its context length
    i = tl.arange(0, M)
    row = i // GROUP_POW2
    g = i % GROUP_POW2
    ok = (row < ROWS) & (g < GROUP)
    rows = seq * ROWS + row
    heads = kv_head * GROUP + g
    d = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=ok[:, None],
                other=0.0)
    m = tl.full([M], float("-inf"), tl.float32)
    l = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    splits = tl.num_programs(2)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, seq_len)
    for off in range(start, end, BLOCK):
        t = off + tl.arange(0, BLOCK)
        valid = t < end
        page = tl.load(TABLES + seq * ROWS * stride_tb + t // PAGE, mask=valid, other=0)
        slot = (page * PAGE + t % PAGE).to(tl.int64)
        m, l, acc = _attend_block(q, K, V, slot, valid, valid[None, :], kv_head, stride_ks, stride_kh, m, l, acc,
                                  scale, D, IEEE, False)
    if CLOSED_TAILS:
        # Every slot in a run's tails is some row's own (the last of its tail: a tree's nodes, each seeing its
        # ancestors and itself). The run's own slots are one block, and each query row sees those in its tail,
        # so the whole tree is one pass of the last slice, not a block per row.
        if split == splits - 1:
            j = tl.arange(0, TAIL_PAD)
            own_len = tl.load(TAIL_LENS + seq * ROWS + j, mask=j < ROWS, other=0)
            has_own = own_len > 0
            own = tl.load(TAIL + (seq * ROWS + j) * stride_tail + own_len - 1, mask=has_own, other=0)
            row_len = tl.load(TAIL_LENS + rows, mask=ok, other=0)
            see = tl.zeros([M, TAIL_PAD], tl.int32)
            for t in tl.static_range(TAIL_WIDTH):
                listed = tl.load(TAIL + rows * stride_tail + t, mask=ok & (t < row_len), other=-1)
                see |= (listed[:, None] == own[None, :]).to(tl.int32)
            see = (see != 0) & has_own[None, :]
            m, l, acc = _attend_block(q, K, V, own.to(tl.int64), has_own, see, kv_head, stride_ks, stride_kh, m, l,
                                      acc, scale, D, IEEE, True)
    elif TAIL_PAD > 0:
        # Draft-tree rows: after the shared context, the slots of each row's ancestors and its own, listed
        # per row (scattered, so not reachable through the page table). Each row's tail is one block for one
        # slice, dealt from the last slice down: the last slices hold the least context, and one slice taking
        # every row's tail (17 blocks one after another for a 16-node tree) held the whole launch up.
        t = tl.arange(0, TAIL_PAD)
        for r in tl.static_range(ROWS):
            if (splits - 1 - split) == r % splits:
                valid = t < tl.load(TAIL_LENS + seq * ROWS + r)
                slot = tl.load(TAIL + (seq * ROWS + r) * stride_tail + t, mask=valid, other=0).to(tl.int64)
                see = (row == r)[:, None] & valid[None, :]
                m, l, acc = _attend_block(q, K, V, slot, valid, see, kv_head, stride_ks, stride_kh, m, l, acc,
                                          scale, D, IEEE, True)
    has = l > 0
    out = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    out_offs = OUT + rows[:, None] * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    if DIRECT:  # one slice: the final output, nothing to merge
        tl.store(out_offs, out.to(OUT.dtype.element_ty), mask=ok[:, None])
    else:
        lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
        tl.store(out_offs, out, mask=ok[:, None])
        tl.store(LSE + rows * stride_lb + heads * stride_lh + split, lse, mask=ok)


@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "SPLITS"])
def _merge_kernel(PART, LSE, OUT, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                  SPLITS, SPLITS_PAD: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D)
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + s, mask=s < SPLITS, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    # Slices past the context (its bucket's last ones) hold nothing: not read.
    part = tl.load(PART + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                   mask=((s < SPLITS) & (lse > float("-inf")))[:, None], other=0.0)
    out = tl.sum(part * weights[:, None], 0)
    tl.store(OUT + b * stride_ob + h * stride_oh + d, out.to(OUT.dtype.element_ty))


# Programs (sequences x KV heads x context slices) that keep every multiprocessor of a large GPU busy.
TARGET_PROGRAMS = 264
MIN_SLICE = 64  # context tokens per slice, below which a slice costs more to merge than it saves
MAX_SPLITS = 32


def num_splits(batch: int, kv_heads: int, max_context: int) -> int:
    """Context slices per sequence: a small batch splits its contexts until the GPU is full; a large one
    fills it with sequences alone and needs no merge."""
    wanted = -(-TARGET_PROGRAMS // (batch * kv_heads))
    return max(1, min(wanted, max_context // MIN_SLICE, MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, page_size: int, splits: int,
                           tail_slots: torch.Tensor | None = None, tail_lens: torch.Tensor | None = None,
                           rows_per_seq: int = 1, tile: tuple[int, int, int] | None = None,
                           closed_tails: bool = False) -> torch.Tensor:
    """q [B, H, D]; kv_cache [2, slots, Hkv, D]; block_tables [B, pages] int32; seq_lens [B] int32 -> [B, H, D].
    Row b attends to positions [0, seq_lens[b]) through its page table, then (draft trees) to the first
    tail_lens[b] slots of tail_slots [B, T] (int64). With `rows_per_seq` = R, rows come in runs of R that
    share one sequence's page table and context length (a tree's nodes), and one program serves a run, so the
    context is read once for all R. `tile` (context tokens per inner iteration, warps, stages) is a tuning
    knob (default: ROW_TILE, or TREE_TILE for runs of rows). `closed_tails`: every slot in a run's tails is
    the last (own) slot of one of its rows, as in a verified tree, so the run's tails are attended as one block
    with each row's mask (unless SPECSERVE_CLOSED_TAILS=0), which reads them once for the run instead of once a
    row."""
    block, num_warps, num_stages = tile or (ROW_TILE if rows_per_seq == 1 else TREE_TILE)
    batch, heads, dim = q.shape
    kv_heads = kv_cache.shape[2]
    group = heads // kv_heads
    max_tokens = block_tables.shape[1] * page_size
    chunk = triton.cdiv(triton.cdiv(max_tokens, splits), block) * block
    direct = splits == 1  # large batches: the partial kernel writes the output itself, no merge launch
    out = torch.empty_like(q)
    part = out.view(batch, heads, 1, dim) if direct else torch.empty(batch, heads, splits, dim,
                                                                         dtype=torch.float32, device=q.device)
    lse = part if direct else torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    keys, values = kv_cache[0], kv_cache[1]
    assert batch % rows_per_seq == 0
    closed = closed_tails and envs.get().closed_tails and tail_slots is not None
    assert not closed or rows_per_seq > 1, "a run's tails are closed only over a run of rows"
    tail_width = tail_slots.shape[1] if closed else 0  # a constexpr of the closed form only (see above)
    tail_pad = 0 if tail_slots is None else max(16, triton.next_power_of_2(rows_per_seq if closed else
                                                                          tail_slots.shape[1]))
    if tail_slots is not None:  # the kernel steps through a row's tail with unit stride
        assert tail_slots.stride(1) == 1 and tail_lens.dtype == torch.int32
    else:  # unused pointers
        tail_slots, tail_lens = seq_lens, seq_lens
    group_pow2 = triton.next_power_of_2(group)
    _partial_kernel[(batch // rows_per_seq, kv_heads, splits)](
        q, keys, values, block_tables, seq_lens, tail_slots, tail_lens, part, lse, scale,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), block_tables.stride(0), tail_slots.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        chunk, GROUP=group, GROUP_POW2=group_pow2, M=max(16, triton.next_power_of_2(rows_per_seq * group_pow2)),
        ROWS=rows_per_seq, D=dim, PAGE=page_size, BLOCK=block, IEEE=q.dtype == torch.float32, DIRECT=direct,
        num_warps=num_warps, num_stages=num_stages, TAIL_PAD=tail_pad, TAIL_WIDTH=tail_width, CLOSED_TAILS=closed,
        **triton_pdl.launch_options(q),
    )
    if direct:
        return out
    _merge_kernel[(batch, heads)](
        part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), SPLITS=splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)), D=dim,
        **triton_pdl.launch_options(q),
    )
    return out


def warm_up(num_heads: int, kv_cache: torch.Tensor, page_size: int) -> None:
    """Compiles, at startup, every form an eager call with one query row per sequence can take for these
    heads and this cache ([2, slots, Hkv, D]): unsliced, and each padding of the slice count."""
    dim = kv_cache.shape[-1]
    q = torch.zeros(1, num_heads, dim, dtype=kv_cache.dtype, device=kv_cache.device)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=kv_cache.device)
    lens = torch.ones(1, dtype=torch.int32, device=kv_cache.device)
    splits = 1
    while splits <= MAX_SPLITS:
        paged_decode_attention(q, kv_cache, tables, lens, dim**-0.5, page_size, splits)
        splits *= 2
