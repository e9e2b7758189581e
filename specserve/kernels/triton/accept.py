"""A greedy chain step's acceptance and packing on the GPU, in one kernel.

After the verify's argmax, `accept_chain` and `pack_tokens` (speculative/programs/) find each row's accepted drafts,
put the target's own token after them and pack tokens and count for the read-back; the program then keeps a copy of
the packed rows and of each root for a step that follows it. In PyTorch that is ~8 kernels of a few elements each,
every one a full launch latency inside the chain step's graph. Here one program per row does all of it, launched
early behind the argmax (PDL). The PyTorch form stays the CPU path and the reference a test holds this to.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.triton import pdl as triton_pdl
from specserve.kernels.triton.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _accept_kernel(DRAFTS, BEST, FORCED, LIMIT, ROOTS, PACKED, LAST_PACKED, LAST_ROOT, stride_drafts, stride_best,
                   stride_roots, stride_packed, stride_last, K: tl.constexpr, WIDTH_P2: tl.constexpr,
                   FORCE: tl.constexpr, PDL: tl.constexpr):
    """Row b: tokens [K + 1] (its drafts, the target's choice in place of the first one not accepted), then the
    count, written to PACKED and LAST_PACKED; its root to LAST_ROOT."""
    b = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    i = tl.arange(0, WIDTH_P2)
    drafts = tl.load(DRAFTS + b * stride_drafts + i, mask=i < K, other=0)
    best = tl.load(BEST + b * stride_best + i, mask=i < K + 1, other=0)
    if FORCE:
        accepted = tl.load(FORCED + b)
    else:  # the first draft the target did not choose (K: all of them were)
        accepted = tl.min(tl.where(drafts != best, i, K), 0)
    accepted = tl.minimum(accepted, tl.load(LIMIT + b))
    chosen = tl.sum(tl.where(i == accepted, best, 0), 0)
    packed = tl.where(i == accepted, chosen, drafts)
    packed = tl.where(i == K + 1, accepted, packed)
    tl.store(PACKED + b * stride_packed + i, packed, mask=i < K + 2)
    tl.store(LAST_PACKED + b * stride_last + i, packed, mask=i < K + 2)
    tl.store(LAST_ROOT + b, tl.load(ROOTS + b * stride_roots))


def accept_and_pack(drafts: torch.Tensor, best: torch.Tensor, forced: torch.Tensor | None, limit: torch.Tensor,
                    roots: torch.Tensor, last_packed: torch.Tensor, last_root: torch.Tensor) -> torch.Tensor:
    """`pack_tokens(*accept_chain(drafts, best, forced, limit))` [B, k + 2], also copied to last_packed[:B], with
    roots [B] copied to last_root[:B]. All int64."""
    bs, k = drafts.shape
    read_by_row = (drafts, best, limit, last_packed, last_root) + ((forced,) if forced is not None else ())
    if (any(t.dtype != torch.int64 for t in read_by_row + (roots,)) or best.shape != (bs, k + 1)
            or any(t.stride(-1) != 1 for t in read_by_row)):
        raise ValueError("accept_and_pack takes int64 tensors, rows with unit stride, best as [B, k + 1]")
    packed = torch.empty(bs, k + 2, dtype=torch.int64, device=drafts.device)
    _accept_kernel[(bs,)](drafts, best, forced if forced is not None else limit, limit, roots, packed, last_packed,
                          last_root, drafts.stride(0), best.stride(0), roots.stride(0), packed.stride(0),
                          last_packed.stride(0), K=k, WIDTH_P2=triton.next_power_of_2(k + 2),
                          FORCE=forced is not None, num_warps=1, **triton_pdl.launch_options(drafts))
    return packed
