"""``@triton.jit`` helpers shared by the forward and backward attention-KL kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Running-max sentinel: finite, so that ``exp2(m_old - m_new)`` is never ``exp2(-inf + inf)``; a row
#: that has seen no allowed key keeps this max and a zero sum, which marks it as empty.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """``a @ b`` with fp32 accumulation. Under the interpreter the operands are upcast first: its bf16
    dot is wrong (triton-lang/triton#11584) and fp32 there is exact anyway."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _allowed_keys(
    rows,  # query indices, broadcastable against `cols` (e.g. [BLOCK_M, 1], or [1, BLOCK_M] transposed)
    cols,  # key indices, e.g. [1, BLOCK_N]
    km_ptr,  # key padding mask row of this batch (uint8, 1 = real key) or None
    stride_km_n,
    N_Q,
    N_K,
    IS_CAUSAL: tl.constexpr,
    CHECK_BOUNDS: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr,
):
    """Bool mask, broadcastable to the tile: key ``cols`` is allowed for query ``rows``.

    Causal masking is aligned to the bottom-right corner: key ``j`` is allowed for query ``i`` iff
    ``j <= i + N_K - N_Q``. ``CHECK_BOUNDS`` is False on tiles known to be inside the sequence and off
    the causal band, where only the padding mask applies (call it only if one of the two is set).
    """
    if CHECK_BOUNDS:
        allowed = cols < N_K
        if IS_CAUSAL:
            allowed = allowed & (cols <= rows + (N_K - N_Q))
        if HAS_KEY_MASK:
            allowed = allowed & (tl.load(km_ptr + cols * stride_km_n, mask=cols < N_K, other=0) != 0)
    else:
        allowed = tl.load(km_ptr + cols * stride_km_n, mask=cols < N_K, other=0) != 0
    return allowed


@triton.jit
def _offset(index, stride, WIDE: tl.constexpr):
    """``index * stride`` inside one (batch, head) slice; 64-bit only when the slice can exceed 2^31
    elements (decided on the host by :func:`needs_wide_offsets`), 32-bit otherwise (fewer registers)."""
    if WIDE:
        return tl.cast(index, tl.int64) * stride
    else:
        return index * stride


def needs_wide_offsets(*tensors: torch.Tensor) -> bool:
    """True when an in-slice offset ``row * stride_n`` of some ``(B, H, N, D)`` input can overflow int32."""
    return any(
        x.shape[2] * max(abs(x.stride(2)), x.shape[3]) + x.shape[3] * abs(x.stride(3)) >= 2**31 for x in tensors
    )


def dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    """``tl.dot`` input precision: true fp32 ("ieee") for float32 unless TF32 is allowed."""
    return "tf32" if dtype != torch.float32 or allow_tf32 else "ieee"


def as_uint8_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Bool masks are passed to the kernels as uint8 views (no copy)."""
    return None if mask is None else mask.view(torch.uint8)
