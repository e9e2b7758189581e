"""The inputs of rows that follow the last launch, derived on the GPU in one kernel; and, in another, the chain
program's per-row attention inputs (`chain_rows`, below).

`SpecGraphs._follow` and the programs' `_follow_root` state in PyTorch what a following row's inputs are: the
head's catch-up on the last step's root and accepted drafts, the new root and its token, and every slot from
the page table. On a GPU that is ~60 kernels of a few elements each, in every program graph, each paying a
launch's latency: together about as long as the rest of a batch-1 chain step outside its forwards.
This kernel writes the same buffers in one launch, one program per row. The PyTorch form stays the CPU path
and is the reference a GPU test holds this to (SPECSERVE_FUSED_FOLLOW=0 runs it on a GPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _slot(table, pos, pages, page_size):
    """table_slots for one row: positions past the table take its last page (such rows are discarded)."""
    page = tl.minimum(pos // page_size, pages - 1)
    return tl.load(table + page).to(tl.int64) * page_size + pos % page_size


@triton.jit
def _follow_kernel(FOLLOW, LAST_PACKED, LAST_ROOT, TABLE, LIMIT, CATCH_IDS, CATCH_POS, CATCH_SLOTS, LAST_ROW,
                   ROOT_IDS, EXTEND_POS, EXTEND_SLOTS, VERIFY_POS, VERIFY_SLOTS, ROOT_POS, ROOT_SLOTS, REAL_SLOTS,
                   stride_packed, stride_table, stride_level, pages, page_size, pad_slot,
                   W: tl.constexpr, W_P2: tl.constexpr, MORE: tl.constexpr, MORE_P2: tl.constexpr,
                   TREE: tl.constexpr):
    """W: catch-up rows per sequence (also a chain's verified rows). MORE: a chain's extend levels (k - 1) or a
    tree's depth."""
    b = tl.program_id(0)
    src = tl.load(FOLLOW + b)
    if src >= 0:
        packed = LAST_PACKED + src * stride_packed  # the last step's tokens, then its accepted count
        table = TABLE + b * stride_table
        accepted = tl.load(packed + W)
        last_root = tl.load(LAST_ROOT + src)
        j = tl.arange(0, W_P2)
        in_w = j < W
        caught = (j <= accepted) & in_w
        pos = tl.where(caught, last_root + j, 0)
        tl.store(CATCH_IDS + b * W + j, tl.load(packed + j, mask=caught, other=0), mask=in_w)
        tl.store(CATCH_POS + b * W + j, pos, mask=in_w)
        tl.store(CATCH_SLOTS + b * W + j, tl.where(caught, _slot(table, pos, pages, page_size), pad_slot), mask=in_w)
        tl.store(LAST_ROW + b, b * W + accepted)
        tl.store(ROOT_IDS + b, tl.load(packed + accepted))
        root = last_root + accepted + 1
        drafts = tl.load(LIMIT + b)
        i = tl.arange(0, MORE_P2)
        in_more = i < MORE
        if TREE:  # the root's position and slot; the slots of root + 1.. that accepted nodes move to
            tl.store(ROOT_POS + b, root)
            tl.store(ROOT_SLOTS + b, _slot(table, root, pages, page_size))
            real = tl.where(i < drafts, _slot(table, root + 1 + i, pages, page_size), pad_slot)
            tl.store(REAL_SLOTS + b * MORE + i, real, mask=in_more)
        else:  # drafts at root + i (level-major rows), verified rows at root + j
            tl.store(EXTEND_POS + i * stride_level + b, root + i, mask=in_more)
            extend = tl.where(i < drafts, _slot(table, root + i, pages, page_size), pad_slot)
            tl.store(EXTEND_SLOTS + i * stride_level + b, extend, mask=in_more)
            tl.store(VERIFY_POS + b * W + j, root + j, mask=in_w)
            verify = tl.where(j <= drafts, _slot(table, root + j, pages, page_size), pad_slot)
            tl.store(VERIFY_SLOTS + b * W + j, verify, mask=in_w)


def follow_rows(program, bs: int, table: torch.Tensor) -> None:
    """What `program._follow(bs, n)` writes, for a chain or a tree program, in one kernel; `table` is the
    program's page table for the step's context bucket, [bs, pages] int32."""
    tree = hasattr(program, "real_slots")
    width = program.width
    more = program.depth if tree else program.k - 1
    for name in ("catch_ids", "catch_pos", "catch_slots") + (("real_slots",) if tree else ("verify_pos",
                                                                                            "verify_slots")):
        assert getattr(program, name).stride(0) == getattr(program, name).shape[1], name  # rows of W (or depth)
    assert tree or program.extend_pos.stride() == program.extend_slots.stride()
    unused = program.follow  # pointer arguments of the form not taken (never read or written)
    chain_buffers = (unused,) * 4 if tree else (program.extend_pos, program.extend_slots, program.verify_pos,
                                                 program.verify_slots)
    tree_buffers = (program.root_pos, program.root_slots, program.real_slots) if tree else (unused,) * 3
    _follow_kernel[(bs,)](
        program.follow, program.last_packed, program.last_root, table, program.limit, program.catch_ids,
        program.catch_pos, program.catch_slots, program.last_row, program.root_ids, *chain_buffers, *tree_buffers,
        program.last_packed.stride(0), table.stride(0), 0 if tree else program.extend_pos.stride(0), table.shape[1],
        program.page_size, program.pad_slot, W=width, W_P2=triton.next_power_of_2(width), MORE=more,
        MORE_P2=max(triton.next_power_of_2(max(more, 1)), 1), TREE=tree)


# The chain program's attention inputs that follow from its positions and slots (ChainGraphs._metas): in PyTorch
# a copy, an add and a cast per forward and more for shared contexts, ~10-20 kernels of a few elements in every
# step's graph. This kernel writes them in one launch.


@triton.jit
def _row_lens_and_tails(POS, SLOTS, LENS, TAILS, b, W: tl.constexpr, W_P2: tl.constexpr, SHARED: tl.constexpr):
    """Sequence b's W rows: each one's context length (SHARED: the context before the first row, and as its tail
    the rows up to itself, W slots a row of TAILS; else up to and including itself)."""
    j = tl.arange(0, W_P2)
    in_w = j < W
    if SHARED:
        tl.store(LENS + b * W + j, tl.load(POS + b * W).to(tl.int32), mask=in_w)
        slots = tl.load(SLOTS + b * W + j, mask=in_w, other=0)
        r = tl.arange(0, W_P2)[:, None]
        tl.store(TAILS + (b * W + r) * W + j[None, :], tl.broadcast_to(slots[None, :], (W_P2, W_P2)),
                 mask=(r < W) & in_w[None, :])
    else:
        tl.store(LENS + b * W + j, (tl.load(POS + b * W + j, mask=in_w, other=0) + 1).to(tl.int32), mask=in_w)


@triton.jit
def copy_table_rows(TABLE, OUT, stride_table, stride_out, b, pages, ROWS: tl.constexpr, ROWS_PAD: tl.constexpr,
                    PAGE_BLOCK: tl.constexpr):
    """Sequence b's page table as each of its ROWS rows' own (rows b * ROWS.. of OUT)."""
    r = tl.arange(0, ROWS_PAD)[:, None]
    for p0 in range(0, pages, PAGE_BLOCK):
        p = p0 + tl.arange(0, PAGE_BLOCK)
        row = tl.load(TABLE + b * stride_table + p, mask=p < pages, other=0)
        tl.store(OUT + (b * ROWS + r) * stride_out + p[None, :], tl.broadcast_to(row[None, :], (ROWS_PAD, PAGE_BLOCK)),
                 mask=(r < ROWS) & (p < pages)[None, :])


@triton.jit
def _chain_rows_kernel(TABLE, ROW_TABLE, ROOT_IDS, VERIFY_IDS, CATCH_POS, CATCH_SLOTS, CATCH_LENS, CATCH_TAILS,
                       VERIFY_POS, VERIFY_SLOTS, VERIFY_LENS, VERIFY_TAILS, EXTEND_POS, EXTEND_LENS, stride_table,
                       stride_row_table, stride_level, stride_lens_level, pages, W: tl.constexpr,
                       W_P2: tl.constexpr, MORE: tl.constexpr, MORE_P2: tl.constexpr, SHARED: tl.constexpr,
                       PAGE_BLOCK: tl.constexpr):
    """Sequence b's inputs of the chain program's forwards: see chain_rows. MORE: its draft levels (k - 1)."""
    b = tl.program_id(0)
    tl.store(VERIFY_IDS + b * W, tl.load(ROOT_IDS + b))  # the verify's first id; the drafts follow it
    _row_lens_and_tails(CATCH_POS, CATCH_SLOTS, CATCH_LENS, CATCH_TAILS, b, W, W_P2, SHARED)
    _row_lens_and_tails(VERIFY_POS, VERIFY_SLOTS, VERIFY_LENS, VERIFY_TAILS, b, W, W_P2, SHARED)
    i = tl.arange(0, MORE_P2)
    extend = tl.load(EXTEND_POS + i * stride_level + b, mask=i < MORE, other=0)
    tl.store(EXTEND_LENS + i * stride_lens_level + b, (extend + 1).to(tl.int32), mask=i < MORE)
    copy_table_rows(TABLE, ROW_TABLE, stride_table, stride_row_table, b, pages, W, W_P2, PAGE_BLOCK)


def chain_rows(program, bs: int, n: int, shared: bool) -> None:
    """Writes the chain program's per-row attention inputs for `bs` sequences in context bucket n: each catch-up and
    verified row's context length and (shared) tail, each draft level's context lengths, and the page table once
    per row (ChainGraphs._row_inputs names the buffers); and each root as the first of the verify's ids."""
    w, more = program.width, program.k - 1
    table, row_table = program.tables[n], program.row_tables[n]
    for name in ("catch_pos", "catch_slots", "verify_pos", "verify_slots", "verify_ids"):
        assert getattr(program, name).stride(0) == w, name
    _chain_rows_kernel[(bs,)](
        table, row_table, program.root_ids, program.verify_ids, program.catch_pos, program.catch_slots,
        program.row_lens["catch"], program.row_tails["catch"], program.verify_pos, program.verify_slots,
        program.row_lens["verify"], program.row_tails["verify"], program.extend_pos, program.extend_lens,
        table.stride(0), row_table.stride(0), program.extend_pos.stride(0), program.extend_lens.stride(0),
        table.shape[1], W=w, W_P2=triton.next_power_of_2(w), MORE=more,
        MORE_P2=max(triton.next_power_of_2(max(more, 1)), 1), SHARED=shared, PAGE_BLOCK=64)
