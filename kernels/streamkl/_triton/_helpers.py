"""``@triton.jit`` helpers shared by the forward and backward attention-KL kernels, and their host-side twins.

Index conventions (see :mod:`streamkl._problem`): every program works inside one sequence, with local query
indices ``0 <= i < n_q`` and key indices ``0 <= j < n_k``; query ``i`` is aligned to key ``i + n_k - n_q`` and sees
key ``j`` iff ``aligned - left <= j <= aligned + right`` (a bound is absent when its ``HAS_*`` flag is off; causal is
``right = 0``) and the key padding mask keeps ``j``. Dense problems are one sequence per batch row; packed ones
read their sequence's offsets from ``cu_seqlens``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common.numerics import FP16_TARGET_EXPONENT, LOG2E_C


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """``a @ b`` with fp32 accumulation. Under the interpreter the operands are upcast first: its bf16
    dot is wrong (triton-lang/triton#11584) and fp32 there is exact anyway."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _finite(x):
    """``x`` with NaN and ±inf replaced by 0: an operand whose masked terms must contribute exactly 0."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0)


@triton.jit
def _tanh(x):
    """``tanh`` from one ``exp2`` (no libdevice, so the interpreter runs it too); ±1 at the extremes, NaN kept."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E_C)) + 1.0)


@triton.jit
def _pre_exponent(raw, cap_scale, SOFTCAP: tl.constexpr):
    """The monotone quantity whose maximum and exponent each kernel tracks: the raw product, or ``tanh`` of the
    soft-capped side's pre-activation. Multiplied by the side's ``qk_scale`` it is the score in base 2."""
    if SOFTCAP:
        return _tanh(raw * cap_scale)
    else:
        return raw


@triton.jit
def _sequence(CU, s, total, IS_VARLEN: tl.constexpr, N):
    """``(start, length)`` of sequence ``s``: from the packed offsets (clamped to the tensor, so trusted offsets
    can never make a kernel read outside it), or ``(0, N)`` for a dense batch row."""
    if IS_VARLEN:
        start = tl.minimum(tl.maximum(tl.load(CU + s), 0), total)
        end = tl.minimum(tl.maximum(tl.load(CU + s + 1), start), total)
        return start, end - start
    else:
        return 0, N


@triton.jit
def _band(start, last, n_self, n_other, left, right, BLOCK: tl.constexpr, HAS_LEFT: tl.constexpr,
          HAS_RIGHT: tl.constexpr):
    """Tiles of the other axis that a tile ``[start, last]`` of this axis must visit, as ``(lo, b, c, hi)``:
    ``[lo, b)`` and ``[c, hi)`` need masking, ``[b, c)`` is allowed for every pair (and inside both lengths).

    Index ``t`` of this axis is aligned to ``t + n_other − n_self`` of the other and sees ``aligned − left ..
    aligned + right`` (queries → keys with the window; keys → queries with ``left``/``right`` exchanged).
    """
    off = n_other - n_self
    lo = 0
    hi = n_other
    full_lo = 0
    full_hi = (n_other // BLOCK) * BLOCK
    if HAS_LEFT:
        lo = (tl.maximum(start + off - left, 0) // BLOCK) * BLOCK
        full_lo = tl.cdiv(tl.maximum(last + off - left, 0), BLOCK) * BLOCK
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(last + off + right + 1, 0), n_other)
        full_hi = tl.minimum(full_hi, (tl.maximum(start + off + right + 1, 0) // BLOCK) * BLOCK)
    b = tl.minimum(tl.maximum(full_lo, lo), hi)
    c = tl.maximum(tl.minimum(full_hi, hi), b)
    return lo, b, c, hi


#: Positions a program reads per step when it looks for the first and last kept entry of a mask or row state.
SPAN_SCAN = tl.constexpr(1024)


@triton.jit
def _kept_span(ptr, stride, n, FINITE: tl.constexpr, SCAN: tl.constexpr):
    """``(first, end)``: the first kept position of ``n`` entries at ``ptr`` (stride ``stride``) and one past the last
    (``(n, 0)`` when none is): a uint8 mask's nonzero entries, or, with ``FINITE``, a row state's finite log-sum-exps
    (a row with no allowed key, or excluded, has ``+inf``). Tiles outside the span hold only padding, whose terms are
    exactly 0, so a loop may skip them (:func:`_clip_band`)."""
    offs = tl.arange(0, SCAN)
    first = tl.min(tl.zeros((SCAN,), tl.int32) + n, 0)
    end = tl.max(tl.zeros((SCAN,), tl.int32), 0)
    for s0 in range(0, n, SCAN):
        idx = s0 + offs
        if FINITE:
            kept = tl.load(ptr + idx * stride, mask=idx < n, other=float("inf")) != float("inf")
        else:
            kept = tl.load(ptr + idx * stride, mask=idx < n, other=0) != 0
        first = tl.minimum(first, tl.min(tl.where(kept, idx, n), 0))
        end = tl.maximum(end, tl.max(tl.where(kept, idx + 1, 0), 0))
    return first, end


@triton.jit
def _clip_band(lo, b, c, hi, first, end, BLOCK: tl.constexpr):
    """The band ``(lo, b, c, hi)`` of :func:`_band` without the tiles outside ``[first, end)`` of the other axis
    (:func:`_kept_span`): ``[lo, b)`` and ``[c, hi)`` still start on a tile boundary, ``[b, c)`` stays inside the
    full tiles, and what is dropped is only tiles with no kept position (the partial tiles at either end keep their
    masking). An empty span empties the band."""
    lo2 = tl.maximum(lo, (first // BLOCK) * BLOCK)
    hi2 = tl.minimum(hi, end)
    top = tl.cdiv(tl.maximum(hi2, 0), BLOCK) * BLOCK  # tiles at or past this hold no kept position
    b2 = tl.minimum(tl.maximum(b, lo2), top)
    c2 = tl.minimum(tl.maximum(c, b2), top)
    return lo2, b2, c2, hi2


@triton.jit
def _empty_band_if(skip, lo, b, c, hi):
    """The band ``(lo, b, c, hi)``, or an empty one starting at ``lo`` where ``skip`` (a tile whose rows or keys are
    all padding or excluded: it visits nothing and writes its empty results)."""
    return lo, tl.where(skip, lo, b), tl.where(skip, lo, c), tl.where(skip, lo, hi)


@triton.jit
def _allowed(rows, cols, key_ok, n_q, n_k, left, right, am_ptr, stride_am_q, stride_am_k, HAS_LEFT: tl.constexpr,
             HAS_RIGHT: tl.constexpr, MASKED: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_ATTN_MASK: tl.constexpr):
    """Bool mask broadcastable to the tile: key ``cols`` is allowed for query ``rows`` (local indices).

    ``key_ok`` is the loaded key padding mask (bool, shaped like ``cols``) or None; ``am_ptr`` points at the general
    ``attn_mask`` of this (batch, head) (with ``HAS_ATTN_MASK``; every tile is then masked). ``MASKED`` tiles check
    the window, the bounds and the general mask; the others only the padding mask (call it only if one applies).
    """
    if MASKED:
        allowed = cols < n_k
        aligned = rows + (n_k - n_q)
        if HAS_LEFT:
            allowed = allowed & (cols >= aligned - left)
        if HAS_RIGHT:
            allowed = allowed & (cols <= aligned + right)
        if HAS_KEY_MASK:
            allowed = allowed & key_ok
        if HAS_ATTN_MASK:
            inside = (rows < n_q) & (cols < n_k)
            allowed = allowed & (tl.load(am_ptr + rows * stride_am_q + cols * stride_am_k, mask=inside, other=0) != 0)
    else:
        allowed = key_ok
    return allowed


@triton.jit
def _pow2_scale(ds):
    """``(s, 1/s)``, exact powers of two that bring the tile's largest ``|ds|`` into [2^14, 2^15): fp16 gradient
    tiles are multiplied by ``s`` before the cast (no underflow of tiny ``g·(P_s − P_t)``) and the fp32 product
    by ``1/s`` after. Pure bit manipulation, so it is exact and the interpreter runs it."""
    largest = tl.max(tl.max(tl.abs(ds), 1), 0)
    exponent = ((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    k = tl.minimum(tl.maximum(FP16_TARGET_EXPONENT - exponent, -126), 126)
    s = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    return s, inv


@triton.jit
def _as_operand(ds, dtype: tl.constexpr, FP16: tl.constexpr):
    """``(tile, inv)``: ``ds`` cast to the tensor cores' operand dtype, and the factor its fp32 products must be
    multiplied by. fp16 tiles are scaled by a power of two first (``inv`` undoes it) so that small gradients do not
    flush to zero; otherwise ``inv`` is 1 and the caller skips the multiplication."""
    if FP16:
        s, inv = _pow2_scale(ds)
        return (ds * s).to(dtype), inv
    else:
        return ds.to(dtype), 1.0


@triton.jit
def _to_bf16_nearest_even(x):
    """fp32 ``x`` rounded to bf16, to nearest with ties to even, NaN kept NaN: the rounding of ``tensor.to(bfloat16)``
    in torch, written with integer operations so that Triton's interpreter (whose casts truncate) gives the GPU's
    bits."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)  # a NaN's payload could otherwise carry into the exponent
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _offset(index, stride, WIDE: tl.constexpr):
    """``index * stride`` inside one (batch, head) slice; 64-bit only when the slice can exceed 2^31
    elements (decided on the host by :func:`needs_wide_offsets`), 32-bit otherwise (fewer registers)."""
    if WIDE:
        return tl.cast(index, tl.int64) * stride
    else:
        return index * stride


@triton.jit
def _longest_first(pid, n_tiles, chunk):
    """``(rank, pair)`` of program ``pid`` of a one-dimensional grid of ``n_tiles`` tiles per (sequence, head) pair,
    ordered so that the longest tiles run first: pairs go in chunks of ``chunk`` consecutive pairs (whose keys fit in
    L2 together, :func:`longest_first_chunk`); within a chunk, rank 0 of every pair comes first, then rank 1, and so
    on. The caller maps rank 0 to its longest tile. With the pairs in the slow grid dimension (the order before v12),
    a causal grid ran the last head's longest tiles last, after the rest of the grid had drained (FlashAttention-3's
    longest-processing-time-first scheduler does the same)."""
    per_chunk = chunk * n_tiles
    first = (pid // per_chunk) * chunk
    width = tl.minimum(chunk, tl.num_programs(0) // n_tiles - first)
    r = pid - first * n_tiles
    rank = r // width
    return rank, first + r - rank * width


@triton.jit
def _longest_row_tile_first(pid, N_Q, BLOCK_M: tl.constexpr, chunk):
    """``(row tile, pair)`` of program ``pid`` of a causal query-stationary grid (:func:`_longest_first`): the last
    row tile sees the most keys, so it is rank 0."""
    n_row_tiles = tl.cdiv(N_Q, BLOCK_M)
    rank, pair = _longest_first(pid, n_row_tiles, chunk)
    return n_row_tiles - 1 - rank, pair


def needs_wide_offsets(*tensors: torch.Tensor) -> bool:
    """True when an in-slice offset ``row * stride_n`` of some ``(B, H, N, D)`` input can overflow int32."""
    return wide_offsets(*((x.shape, x.stride()) for x in tensors))


def wide_offsets(*geometries: tuple) -> bool:
    """:func:`needs_wide_offsets` from ``(shape, strides)`` pairs (the cached launch plans' keys)."""
    return any(
        shape[2] * max(abs(stride[2]), shape[3]) + shape[3] * abs(stride[3]) >= 2**31 for shape, stride in geometries
    )


def dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    """``tl.dot`` input precision: true fp32 ("ieee") for float32 unless TF32 is allowed."""
    return "tf32" if dtype != torch.float32 or allow_tf32 else "ieee"


def as_uint8_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Bool masks are passed to the kernels as uint8 views (no copy)."""
    return None if mask is None else mask.view(torch.uint8)


def attn_mask_view(mask: torch.Tensor | None) -> tuple[torch.Tensor | None, tuple[int, int, int, int]]:
    """A bool ``attn_mask`` as a uint8 view and its (b, h, q, k) strides, 0 on broadcast dims (no copy)."""
    if mask is None:
        return None, (0, 0, 0, 0)
    view = mask.view(torch.uint8)
    return view, broadcast_strides((view.shape, view.stride()))


def broadcast_strides(geometry: tuple | None) -> tuple[int, ...]:
    """The strides of an ``attn_mask`` given as ``(shape, strides)``, 0 on its broadcast (size-1) dims."""
    if geometry is None:
        return (0, 0, 0, 0)
    return tuple(0 if size == 1 else stride for size, stride in zip(*geometry))
