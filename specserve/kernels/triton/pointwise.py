"""Triton kernels for the elementwise steps that torch.compile's dynamic-shape kernels ran slowly on a GPU.

On a Llama-3.1-8B shape the compiled rotary and SiLU-and-multiply kernels took several times as long over a
long prefill chunk as their memory traffic needs (docs/performance.md); a decode step paid two KV-store
launches a layer. A decode step now folds the residual add into RMSNorm and the KV store into the rotary
kernel, so a layer launches three of these (two norms, one rotary) where it launched seven. Each kernel here
rounds where its PyTorch form (kernels/pointwise.py, `eager_*`) does (fp32 math, one cast per result), so outputs
match it to the last bit or within one rounding of it. None has a backward: callers that need gradients keep
the PyTorch forms. The fused ones launch with programmatic dependent launch (pdl.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.triton import pdl as triton_pdl
from specserve.kernels.triton.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _silu_and_mul_kernel(GATE_UP, OUT, stride_in, stride_out, WIDTH, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2^31 past ~75k tokens at 8B's MLP width
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < WIDTH
    gate = tl.load(GATE_UP + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(GATE_UP + row * stride_in + WIDTH + cols, mask=ok, other=0.0)
    # Eager PyTorch rounds silu(gate) to the model dtype before multiplying; so does this.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(OUT + row * stride_out + cols, out.to(OUT.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up, [..., I]. Leading dimensions are flattened into rows (a head's held-out
    evaluation passes [B, T, 2I])."""
    lead, width = gate_up.shape[:-1], gate_up.shape[-1] // 2
    gate_up = gate_up.reshape(-1, gate_up.shape[-1])
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows = gate_up.shape[0]
    out = gate_up.new_empty(rows, width)
    if rows:
        block = 1024
        _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                                width, BLOCK=block)
    return out.view(*lead, width)


@triton.jit
def _rotate_heads(X, OUT, t, stride_xt, stride_xh, stride_ot, stride_oh, HEADS, cos, sin,
                  HALF: tl.constexpr, HEADS_PAD: tl.constexpr, NORM_W, eps, NORM: tl.constexpr,
                  INTERLEAVED: tl.constexpr):
    """Rotates token t's heads, written as halves; NORM: RMS-normalises each head first (weight NORM_W), rounded
    where _rms_norm_kernel rounds, its sum of squares taken in two halves (Qwen3's q and k norms). INTERLEAVED:
    X holds the rotary pairs as (x0, x1), (x2, x3) (DeepSeek's), taken as halves first."""
    d = tl.arange(0, HALF)
    h = tl.arange(0, HEADS_PAD)
    ok = (h < HEADS)[:, None]
    if INTERLEAVED:
        first, second = 2 * d, 2 * d + 1
    else:
        first, second = d, d + HALF
    x_row = X + t * stride_xt + h[:, None] * stride_xh
    x1 = tl.load(x_row + first[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second[None, :], mask=ok, other=0.0).to(tl.float32)
    if NORM:
        dtype = OUT.dtype.element_ty
        scale = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(NORM_W + d).to(tl.float32)[None, :]
        w2 = tl.load(NORM_W + HALF + d).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o_offs = t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(OUT + o_offs, (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=ok)
    tl.store(OUT + o_offs + HALF, (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _cos_sin(COS_SIN, pos, stride_cs, HALF: tl.constexpr):
    """The angles of position `pos` as [1, HALF] rows (cos, sin), ready to broadcast over heads."""
    d = tl.arange(0, HALF)
    return tl.load(COS_SIN + pos * stride_cs + d)[None, :], tl.load(COS_SIN + pos * stride_cs + HALF + d)[None, :]


@triton.jit
def _rotary_kernel(X, OUT, POSITIONS, COS_SIN, stride_xt, stride_xh, stride_ot, stride_oh, stride_cs, HEADS,
                   HALF: tl.constexpr, HEADS_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(COS_SIN, tl.load(POSITIONS + t), stride_cs, HALF)
    _rotate_heads(X, OUT, t, stride_xt, stride_xh, stride_ot, stride_oh, HEADS, cos, sin, HALF, HEADS_PAD, X, 0.0,
                  False, False)


def _rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        _rotary_kernel[(tokens,)](x, out, positions, cos_sin, x.stride(0), x.stride(1), out.stride(0),
                                  out.stride(1), cos_sin.stride(0), heads, HALF=dim // 2,
                                  HEADS_PAD=triton.next_power_of_2(heads))
    return out


def rotary(positions: torch.Tensor, cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """Rotate-half rotary embedding of q [T, H, D] and k [T, Hkv, D] (strided views are fine)."""
    return _rotate(q, positions, cos_sin), _rotate(k, positions, cos_sin)


@triton.jit
def _store_kv_kernel(K, V, CACHE, SLOTS, stride_kt, stride_vt, stride_side, stride_slot, WIDTH,
                     BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < WIDTH
    k = tl.load(K + t * stride_kt + cols, mask=ok)
    v = tl.load(V + t * stride_vt + cols, mask=ok)
    tl.store(CACHE + slot * stride_slot + cols, k, mask=ok)
    tl.store(CACHE + stride_side + slot * stride_slot + cols, v, mask=ok)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes k, v [T, Hkv, D] (rows may be strided views) into kv_cache [2, slots, Hkv, D] at their slots."""
    tokens = k.shape[0]
    width = k.shape[1] * k.shape[2]
    if not (k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == k.shape[2]):
        raise ValueError("store_kv needs each token's heads laid out contiguously")
    if tokens:
        _store_kv_kernel[(tokens,)](k, v, kv_cache, slot_mapping, k.stride(0), v.stride(0), kv_cache.stride(0),
                                    kv_cache.stride(1), width, BLOCK=triton.next_power_of_2(width))


@triton.jit
def _rms_norm_kernel(X, RES, W, OUT, RES_OUT, stride_x, stride_r, stride_o, stride_ro, WIDTH, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < WIDTH
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        # Eager adds in the model dtype and normalises the rounded sum; so does this.
        x = (x.to(tl.float32) + tl.load(RES + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / WIDTH + eps)).to(OUT.dtype.element_ty)
    w = tl.load(W + cols, mask=ok, other=0.0)
    tl.store(OUT + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(OUT.dtype.element_ty),
             mask=ok)


@triton.jit(do_not_specialize=["stride_rows"])
def _rms_norm_pair_kernel(A, B, WA, WB, OUT, A_ROWS, stride_a, stride_b, stride_o, stride_rows, WIDTH, eps,
                          BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr, PDL: tl.constexpr):
    """Row t of [RMSNorm(A) | RMSNorm(B)]: program (t, 0) writes the first half, (t, 1) the second; rounded as
    _rms_norm_kernel rounds. HAS_ROWS: A's row A_ROWS[t] instead of row t (an embedding lookup)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row, half = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    ok = cols < WIDTH
    if half == 0:
        a_row = tl.load(A_ROWS + row * stride_rows).to(tl.int64) if HAS_ROWS else row
        x = tl.load(A + a_row * stride_a + cols, mask=ok, other=0.0)
        w = tl.load(WA + cols, mask=ok, other=0.0)
    else:
        x = tl.load(B + row * stride_b + cols, mask=ok, other=0.0)
        w = tl.load(WB + cols, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / WIDTH + eps)).to(OUT.dtype.element_ty)
    tl.store(OUT + row * stride_o + half * WIDTH + cols,
             (w.to(tl.float32) * normed.to(tl.float32)).to(OUT.dtype.element_ty), mask=ok)


def rms_norm_pair(a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor,
                  eps: float, a_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[RMSNorm(a) | RMSNorm(b)] for a and b [..., W] (each with its norm's weight, one eps), [..., 2W], in one
    kernel instead of two norms and a concatenation (an EAGLE-3 head's input, once per draft step). With `a_rows`
    (shaped like b's leading dimensions), a is a table [rows, W] whose rows a_rows take a's place: the head's
    token embedding, looked up in the same kernel."""
    shape_a = a.shape if a_rows is None else (*a_rows.shape, a.shape[-1])
    if b.shape != shape_a or b.dtype != a.dtype or b.device != a.device or (a_rows is not None and a.dim() != 2):
        raise ValueError(f"rms_norm_pair needs a and b alike, got {shape_a} {a.dtype} and {b.shape} {b.dtype}")
    width = a.shape[-1]
    b_flat = b.reshape(-1, width)
    a_flat = a.reshape(-1, width) if a_rows is None else a
    a_flat, b_flat = (t if t.stride(-1) == 1 else t.contiguous() for t in (a_flat, b_flat))
    # A chain's drafts are a column of its verify ids: read with their stride, not copied.
    rows = a_rows.reshape(-1) if a_rows is not None else b_flat[:, 0]  # (unread without HAS_ROWS)
    out = torch.empty(b_flat.shape[0], 2 * width, dtype=a.dtype, device=a.device)
    if b_flat.shape[0]:
        _rms_norm_pair_kernel[(b_flat.shape[0], 2)](a_flat, b_flat, weight_a, weight_b, out, rows, a_flat.stride(0),
                                                    b_flat.stride(0), out.stride(0), rows.stride(0), width, eps,
                                                    BLOCK=triton.next_power_of_2(width), HAS_ROWS=a_rows is not None,
                                                    **triton_pdl.launch_options(a))
    return out.view(*b.shape[:-1], 2 * width)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x [..., W]; with `residual`, of x + residual, returning (normed, x + residual) from one
    kernel (the residual stream is read once and written once instead of three times). x, the weight and
    the residual share a dtype (pointwise.py sends other mixes to the eager function)."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res_in = residual.reshape(-1, width).contiguous() if residual is not None else rows
    res_out = torch.empty_like(out) if residual is not None else out
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, res_in, weight, out, res_out, rows.stride(0), res_in.stride(0),
                                           out.stride(0), res_out.stride(0), width, eps,
                                           HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(width),
                                           **triton_pdl.launch_options(x))
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


@triton.jit
def _rotary_store_kernel(Q, K, V, Q_OUT, K_OUT, CACHE, POSITIONS, SLOTS, COS_SIN, Q_NORM_W, K_NORM_W,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_qot, stride_qoh, stride_kot, stride_koh, stride_side, stride_slot, stride_cs,
                         HEADS, KV_HEADS, eps, HALF: tl.constexpr, HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr,
                         NORM: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POSITIONS + t)
    slot = tl.load(SLOTS + t).to(tl.int64)
    cos, sin = _cos_sin(COS_SIN, pos, stride_cs, HALF)
    d = tl.arange(0, HALF)
    _rotate_heads(Q, Q_OUT, t, stride_qt, stride_qh, stride_qot, stride_qoh, HEADS, cos, sin, HALF, HEADS_PAD,
                  Q_NORM_W, eps, NORM, False)
    _rotate_heads(K, K_OUT, t, stride_kt, stride_kh, stride_kot, stride_koh, KV_HEADS, cos, sin, HALF, KV_PAD,
                  K_NORM_W, eps, NORM, False)
    # The rotated keys go to the cache too (a head's slot row is contiguous, heads one after another).
    _rotate_heads(K, CACHE + slot * stride_slot, t, stride_kt, stride_kh, 0, 2 * HALF, KV_HEADS, cos, sin,
                  HALF, KV_PAD, K_NORM_W, eps, NORM, False)
    h = tl.arange(0, KV_PAD)
    ok = (h < KV_HEADS)[:, None]
    for half in tl.static_range(2):
        cols = half * HALF + d[None, :]
        v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + cols, mask=ok)
        tl.store(CACHE + stride_side + slot * stride_slot + h[:, None] * (2 * HALF) + cols, v, mask=ok)


def rotary_store(positions: torch.Tensor, cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None):
    """Rotates q [T, H, D] and k [T, Hkv, D] and writes rotated k and v into kv_cache [2, slots, Hkv, D]:
    one launch where rotary and the KV store took three. `qk_norm` (q's norm weight, k's, eps): each head of q
    and k is RMS-normalised first, in the same launch. Returns the rotated (q, k)."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    if kv_cache.stride(2) != dim or kv_cache.stride(3) != 1:
        raise ValueError("rotary_store needs each cache slot's heads laid out contiguously")
    q_out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, kv_heads, dim, dtype=k.dtype, device=k.device)
    if tokens:
        q_weight, k_weight, eps = qk_norm if qk_norm is not None else (cos_sin, cos_sin, 0.0)  # unread without
        _rotary_store_kernel[(tokens,)](
            q, k, v, q_out, k_out, kv_cache, positions, slot_mapping, cos_sin, q_weight, k_weight,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), kv_cache.stride(0),
            kv_cache.stride(1), cos_sin.stride(0), heads, kv_heads, eps, HALF=dim // 2,
            HEADS_PAD=triton.next_power_of_2(heads), KV_PAD=triton.next_power_of_2(kv_heads),
            NORM=qk_norm is not None, **triton_pdl.launch_options(q))
    return q_out, k_out


@triton.jit
def _mla_rotary_store_kernel(Q_PE, LATENT, NORM_W, Q_OUT, CACHE, POSITIONS, SLOTS, COS_SIN, stride_qt, stride_qh,
                             stride_lt, stride_ot, stride_oh, stride_slot, stride_cs, HEADS, eps,
                             RANK: tl.constexpr, HALF: tl.constexpr, HEADS_PAD: tl.constexpr,
                             INTERLEAVED: tl.constexpr, PDL: tl.constexpr):
    """Token t of an MLA layer: its latent c (the first RANK of LATENT's row) RMS-normalised and its rotary key
    (the last 2 HALF) rotated, stored as the cache row [c | k_pe]; each head's q_pe rotated into the last 2 HALF
    columns of Q_OUT. INTERLEAVED: the rotary pairs are (x0, x1), (x2, x3), taken as halves first."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    cos, sin = _cos_sin(COS_SIN, tl.load(POSITIONS + t), stride_cs, HALF)
    dtype = CACHE.dtype.element_ty
    r = tl.arange(0, RANK)
    c = tl.load(LATENT + t * stride_lt + r).to(tl.float32)
    normed = (c * tl.rsqrt(tl.sum(c * c, 0) / RANK + eps)).to(dtype).to(tl.float32)
    tl.store(CACHE + slot * stride_slot + r, (tl.load(NORM_W + r).to(tl.float32) * normed).to(dtype))
    # k_pe, one head shared by all, rotated straight into the cache row; each head's q_pe into Q_OUT's last columns.
    _rotate_heads(LATENT + RANK, CACHE + slot * stride_slot + RANK, t, stride_lt, 0, 0, 0, 1, cos, sin, HALF, 1,
                  NORM_W, eps, False, INTERLEAVED)
    _rotate_heads(Q_PE, Q_OUT + RANK, t, stride_qt, stride_qh, stride_ot, stride_oh, HEADS, cos, sin, HALF,
                  HEADS_PAD, NORM_W, eps, False, INTERLEAVED)


def mla_rotary_store(positions: torch.Tensor, cos_sin: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                     norm_weight: torch.Tensor, eps: float, plane: torch.Tensor, slot_mapping: torch.Tensor,
                     q_out: torch.Tensor, interleaved: bool) -> None:
    """One launch for what an MLA layer does between its projections and attention: RMSNorm of each token's
    latent c, the rotation of its shared key k_pe and of every head's q_pe, the cache row [c | k_pe] stored at
    its slot of `plane` [slots, 1, rank + rope], the rotated q_pe into q_out[..., rank:]. latent [T, rank + rope]
    (kv_a_proj's output); q_pe [T, H, rope]; q_out [T, H, rank + rope]; `interleaved`: rotary pairs adjacent."""
    tokens, heads, rope = q_pe.shape
    rank = latent.shape[1] - rope
    if tokens:
        _mla_rotary_store_kernel[(tokens,)](
            q_pe, latent, norm_weight, q_out, plane, positions, slot_mapping, cos_sin, q_pe.stride(0),
            q_pe.stride(1), latent.stride(0), q_out.stride(0), q_out.stride(1), plane.stride(0),
            cos_sin.stride(0), heads, eps, RANK=rank, HALF=rope // 2, HEADS_PAD=triton.next_power_of_2(heads),
            INTERLEAVED=interleaved, **triton_pdl.launch_options(q_pe))


@triton.jit
def _resolve_placeholders_kernel(IDS, VALUES, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    ids = tl.load(IDS + offs, mask=ok, other=0)
    waiting = ids < 0
    known = tl.load(VALUES + (-ids - 1), mask=ok & waiting, other=0)
    tl.store(IDS + offs, tl.where(waiting, known, ids), mask=ok)


RESOLVE_BLOCK = 1024  # one program: the decode graphs' batches, and eager steps of up to this many tokens


def resolve_placeholders(ids: torch.Tensor, values: torch.Tensor) -> bool:
    """ids [N] int64, in place: a negative id -(i + 1) becomes values[i] (engine/futures.py). One launch where
    the PyTorch form takes six, which a decode step of one row notices. Returns False, doing nothing, for more
    than RESOLVE_BLOCK ids (long prefill chunks), which the caller resolves the PyTorch way."""
    n = ids.numel()
    if n > RESOLVE_BLOCK:
        return False
    if n:
        _resolve_placeholders_kernel[(1,)](ids, values, n, BLOCK=RESOLVE_BLOCK)
    return True
