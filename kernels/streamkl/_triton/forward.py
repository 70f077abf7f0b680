"""Fused attention-KL forward: one pass over key tiles with online rescaling of both distributions.

For a tile of ``BLOCK_M`` query rows of one (sequence, head), the kernel streams ``BLOCK_N``-key tiles of
both sides through SRAM, computes the two score tiles with tensor-core products and keeps, per row,
the running max and sum of each distribution plus the coupled accumulator
``A = Σ e^(x - m_a)(x - y)`` (all in base 2). Only the key tiles inside some row's window are visited:
``[lo, b)`` and ``[c, hi)`` with masking, ``[b, c)`` without (:func:`_band`). Sinks are one more outcome per side,
merged after the keys. It writes three fp32 numbers per row: the KL and both log-sum-exps, which is the whole
state the two-pass backward needs. With ``FUSED_DQ`` (side a frozen) it also accumulates side b's query gradient per
unit upstream gradient, two more products per key tile (:func:`_fused_dq_fold`), so that the backward needs only
its key pass. No ``N_q × N_k`` tile leaves the chip.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .._problem import KLInputs, KLSpec
from .._triton_common.interpreter import triton_interpreter_enabled
from .._triton_common.launch import KernelLauncher, contiguous_or_none, tensor_geometry
from .._triton_common.numerics import LN2_C, LOG2E_C, NEG_BIG, side_scales
from .._triton_common.scheduling import key_bytes_per_head, l2_cache_bytes, longest_first_chunk
from .._triton_common.tiles import LaunchConfig
from ._helpers import (
    SPAN_SCAN,
    _allowed,
    _as_operand,
    _band,
    _clip_band,
    _dot,
    _empty_band_if,
    _finite,
    _kept_span,
    _longest_row_tile_first,
    _offset,
    _pre_exponent,
    _sequence,
    _to_bf16_nearest_even,
    as_uint8_mask,
    broadcast_strides,
    dot_precision,
    wide_offsets,
)
from .configs import forward_config, padded_head_dim

#: Lazy frames of the frozen-teacher forward (FUSED_DQ): a row's reference max moves only when a tile's max
#: exceeds it by more than this many powers of two (probabilities stay <= 2^8: fine in fp32, bf16 and fp16).
FRAME_SLACK = tl.constexpr(8.0)


@triton.jit
def _lazy_max(m, tile_max, qk_scale):
    """The reference pre-exponent max after a tile: moved to the running max only where the tile's max exceeds
    the current reference by more than :data:`FRAME_SLACK` powers of two (FlashAttention-4's conditional
    rescaling), so that on most tiles no row's frame moves. Returns ``(max, moved)``."""
    moved = tile_max * qk_scale > tl.maximum(m * qk_scale, NEG_BIG) + FRAME_SLACK
    return tl.where(moved, tl.maximum(m, tile_max), m), moved


@triton.jit
def _fused_dq_fold(
    v, w, rho,  # [BLOCK_M, BLOCK_DB] fp32 accumulators and [BLOCK_M] ratio of the running sums before this tile
    p_a, p_b,  # [BLOCK_M, BLOCK_N] unnormalised probabilities of the tile (times 1 − tanh² on a soft-capped b)
    k_t,  # [BLOCK_N, BLOCK_DB] side b's key tile (input dtype)
    z_a, z_b, alpha_a, alpha_b,  # [BLOCK_M] running sums after this tile; rescalings of the frames by this tile
    moved,  # [BLOCK_M] whether a row's frame moved (alpha != 1)
    FP16: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Fold one key tile into the running ``dQ_b``; returns ``(v, w, rho)``.

    ``dQ_b ∝ Σ_j (P_b − P_a)_ij k_j``, and each side has its own running max and sum, so the difference is not one
    PV-style accumulator. Accumulating ``E_Pb[k]`` and ``E_Pa[k]`` apart would lose the gradient to cancellation
    once the student is close to the teacher (each product rounds its P tile to the operand dtype); the tile that
    is rounded must be the *difference*. In side a's unnormalised frame, with ``r = z_a / z_b`` the ratio of the
    running sums (the factor that takes side b's frame to side a's): ``v = Σ p_b k`` (side b's frame) and
    ``w = Σ (p_b·r − p_a) k``. The tile of ``w``, ``p_b·r' − p_a`` with the ratio after this tile, is formed in fp32
    and rounded once (fp16: scaled by a power of two), so its rounding error is relative to the gradient, as in the
    two-pass backward. When the ratio moves from ``r`` to ``r'`` and the frames by ``α_a``, ``α_b``:
    ``w ← α_a·w + (r'·α_b − r·α_a)·v`` and ``v ← α_b·v``. The frames move lazily (:func:`_lazy_max`), so on most
    tiles ``α = 1`` and the ``[BLOCK_M, D]`` update is one FMA per element, ``w += (r' − r)·v`` (one scalar branch
    per tile), where v10 and earlier rescaled both accumulators on every tile (three operations per element).
    """
    r = z_a / tl.where(z_b > 0.0, z_b, 1.0)
    coef = r * alpha_b - rho * alpha_a
    if tl.max(moved.to(tl.int32), 0) > 0:
        w = w * alpha_a[:, None] + coef[:, None] * v
        v = v * alpha_b[:, None]
    else:
        w += coef[:, None] * v
    v += _dot(p_b.to(k_t.dtype), k_t, DOT_PRECISION, INTERPRET)
    d, inv = _as_operand(p_b * r[:, None] - p_a, k_t.dtype, FP16)
    if FP16:
        w += _dot(d, k_t, DOT_PRECISION, INTERPRET) * inv
    else:
        w += _dot(d, k_t, DOT_PRECISION, INTERPRET)
    return v, w, r


@triton.jit
def _attention_kl_fwd_keys(
    lo, hi,  # key range [lo, hi) of this sweep, lo a multiple of BLOCK_N
    q_a, q_b,  # [BLOCK_M, BLOCK_DA], [BLOCK_M, BLOCK_DB] query tiles (input dtype)
    ka_ptrs, kb_ptrs,  # [BLOCK_DA, BLOCK_N], [BLOCK_DB, BLOCK_N] pointers of the transposed key tiles at key 0
    km_ptr, stride_km_n, stride_ka_n, stride_kb_n,
    am_ptr, stride_am_q, stride_am_k,  # general attn_mask of this (batch, head), or None
    offs_m, offs_n, da_in, db_in,  # local query rows [BLOCK_M]; key offsets [BLOCK_N]; head-dim masks
    m_a, z_a, acc, m_b, z_b,  # [BLOCK_M] running state: maxima of the pre-exponents, sums, coupled accumulator
    v, w, rho,  # [BLOCK_M, BLOCK_DB] fp32 dQ_b accumulators, [BLOCK_M] ratio (FUSED_DQ, see _fused_dq_fold), else 0
    qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b,
    n_q, n_k, left, right,
    SOFTCAP_A: tl.constexpr, SOFTCAP_B: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASKED: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_ATTN_MASK: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
    FUSED_DQ: tl.constexpr, FP16_B: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Fold the key tiles of ``[lo, hi)`` into the running state of both distributions.

    The running max is taken on the pre-exponents (their multipliers are > 0), so each exponent is one FMA:
    ``exp2(u·c − m·c)``. ``acc`` accumulates ``Σ e^(x−m)(x − y)`` in base-2 units. Padded keys are loaded as 0
    and masked entries of ``x − y`` are zeroed, so non-finite values a row never sees cannot reach it.
    """
    for n0 in range(lo, hi, BLOCK_N):
        keys = n0 + offs_n
        key_row = None
        if HAS_KEY_MASK:
            key_ok = tl.load(km_ptr + keys * stride_km_n, mask=keys < n_k, other=0) != 0
            key_load = key_ok[None, :] & da_in[:, None]
            key_row = key_ok[None, :]
            kb_load = key_ok[None, :] & db_in[:, None]
        elif MASKED:
            key_load = (keys < n_k)[None, :] & da_in[:, None]
            kb_load = (keys < n_k)[None, :] & db_in[:, None]
        else:  # a full tile is inside the sequence: no key bound to check
            key_load = da_in[:, None]
            kb_load = db_in[:, None]
        k_a = tl.load(ka_ptrs + _offset(n0, stride_ka_n, WIDE), mask=key_load, other=0.0)
        k_b = tl.load(kb_ptrs + _offset(n0, stride_kb_n, WIDE), mask=kb_load, other=0.0)
        x = _pre_exponent(_dot(q_a, k_a, DOT_PRECISION_A, INTERPRET), cap_scale_a, SOFTCAP_A)
        y = _pre_exponent(_dot(q_b, k_b, DOT_PRECISION_B, INTERPRET), cap_scale_b, SOFTCAP_B)
        diff = x * qk_scale_a - y * qk_scale_b
        cap_grad = 1.0
        if FUSED_DQ and SOFTCAP_B:
            cap_grad = 1.0 - y * y  # d tanh: finite before masking (masked entries have p = 0)
        if MASKED or HAS_KEY_MASK:
            allowed = _allowed(offs_m[:, None], keys[None, :], key_row, n_q, n_k, left, right, am_ptr, stride_am_q,
                               stride_am_k, HAS_LEFT, HAS_RIGHT, MASKED, HAS_KEY_MASK, HAS_ATTN_MASK)
            x = tl.where(allowed, x, float("-inf"))
            y = tl.where(allowed, y, float("-inf"))
            if MASKED:
                diff = tl.where(allowed, diff, 0.0)
        if FUSED_DQ:  # lazy frames: most tiles then leave the [BLOCK_M, D] accumulators alone
            m_a_new, moved_a = _lazy_max(m_a, tl.max(x, 1), qk_scale_a)
            m_b_new, moved_b = _lazy_max(m_b, tl.max(y, 1), qk_scale_b)
        else:
            m_a_new = tl.maximum(m_a, tl.max(x, 1))
            m_b_new = tl.maximum(m_b, tl.max(y, 1))
        mc_a = tl.maximum(m_a_new * qk_scale_a, NEG_BIG)  # the clamp keeps an empty row finite for any scale
        alpha_a = tl.exp2(tl.maximum(m_a * qk_scale_a, NEG_BIG) - mc_a)
        p_a = tl.exp2(x * qk_scale_a - mc_a[:, None])  # exactly 0 on masked keys
        z_a_new = z_a * alpha_a + tl.sum(p_a, 1)
        acc = acc * alpha_a + tl.sum(p_a * diff, 1)
        mc_b = tl.maximum(m_b_new * qk_scale_b, NEG_BIG)
        alpha_b = tl.exp2(tl.maximum(m_b * qk_scale_b, NEG_BIG) - mc_b)
        p_b = tl.exp2(y * qk_scale_b - mc_b[:, None])
        z_b_new = z_b * alpha_b + tl.sum(p_b, 1)
        if FUSED_DQ:
            if MASKED:  # a masked-out key's non-finite values must not reach a row through 0·inf
                kv_b = tl.trans(_finite(k_b).to(k_b.dtype))
            else:
                kv_b = tl.trans(k_b)
            v, w, rho = _fused_dq_fold(v, w, rho, p_a * cap_grad, p_b * cap_grad, kv_b, z_a_new, z_b_new, alpha_a,
                                       alpha_b, moved_a | moved_b, FP16_B, DOT_PRECISION_B, INTERPRET)
        z_a = z_a_new
        z_b = z_b_new
        m_a = m_a_new
        m_b = m_b_new
    return m_a, z_a, acc, m_b, z_b, v, w, rho


@triton.jit
def _attention_kl_fwd_rows(
    m_start,  # first local query row of this tile
    qa_base, qb_base,  # [1, BLOCK_DA], [1, BLOCK_DB] query pointers of (batch, head) at token 0, head-dim offsets
    ka_ptrs, kb_ptrs,  # transposed key tile pointers at key 0 of the sequence
    km_ptr, qm_ptr,  # key / query mask rows of this batch row, or None
    am_ptr, stride_am_q, stride_am_k,  # general attn_mask of this (batch, head), or None
    SINK_A, SINK_B, KL, LSE_A, LSE_B, DQ_B,
    stride_qa_n, stride_qb_n, stride_ka_n, stride_kb_n, stride_km_n, stride_qm_n,
    q_start, n_q, n_k, h, row_base,
    offs_n, offs_db, da_in, db_in,
    qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, grad_scale_b, left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_QUERY_MASK: tl.constexpr,
    HAS_SINKS: tl.constexpr, SOFTCAP_A: tl.constexpr, SOFTCAP_B: tl.constexpr, HAS_ATTN_MASK: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
    FUSED_DQ: tl.constexpr, FP16_B: tl.constexpr, BLOCK_DB: tl.constexpr, D_B: tl.constexpr,
):
    """One tile of ``BLOCK_M`` query rows: stream its key band, then write KL and both lse per row (and, with
    ``FUSED_DQ``, side b's query gradient per unit upstream gradient)."""
    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_in = offs_m < n_q
    rows = (q_start + offs_m).to(tl.int64)
    q_a = tl.load(qa_base + rows[:, None] * stride_qa_n, mask=row_in[:, None] & da_in[None, :], other=0.0)
    q_b = tl.load(qb_base + rows[:, None] * stride_qb_n, mask=row_in[:, None] & db_in[None, :], other=0.0)
    m_a = tl.full((BLOCK_M,), NEG_BIG, tl.float32)  # pre-exponent maxima (finite sentinel: see NEG_BIG)
    m_b = tl.full((BLOCK_M,), NEG_BIG, tl.float32)
    z_a = tl.zeros((BLOCK_M,), tl.float32)
    z_b = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M,), tl.float32)
    if FUSED_DQ:
        v = tl.zeros((BLOCK_M, BLOCK_DB), tl.float32)
        w = tl.zeros((BLOCK_M, BLOCK_DB), tl.float32)
        rho = tl.zeros((BLOCK_M,), tl.float32)
    else:
        v = 0.0
        w = 0.0
        rho = 0.0
    last = tl.minimum(m_start + BLOCK_M, n_q) - 1
    lo, b_full, c_full, hi = _band(m_start, last, n_q, n_k, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if HAS_ATTN_MASK:  # a general mask: every tile of the band is masked
        b_full = hi
        c_full = hi
    if HAS_KEY_MASK:  # padded keys: only the tiles from the first real key to the last (the others add exactly 0)
        k_first, k_end = _kept_span(km_ptr, stride_km_n, n_k, False, SPAN_SCAN)
        lo, b_full, c_full, hi = _clip_band(lo, b_full, c_full, hi, k_first, k_end, BLOCK_N)
    if HAS_QUERY_MASK:  # a tile of excluded rows visits no key: it writes their empty results only
        none_kept = tl.max(tl.load(qm_ptr + offs_m * stride_qm_n, mask=row_in, other=0).to(tl.int32), 0) == 0
        lo, b_full, c_full, hi = _empty_band_if(none_kept, lo, b_full, c_full, hi)
    if HAS_LEFT or HAS_ATTN_MASK:  # keys below the full tiles exist only with a left window bound
        m_a, z_a, acc, m_b, z_b, v, w, rho = _attention_kl_fwd_keys(
            lo, b_full, q_a, q_b, ka_ptrs, kb_ptrs, km_ptr, stride_km_n, stride_ka_n, stride_kb_n, am_ptr, stride_am_q,
            stride_am_k, offs_m, offs_n,
            da_in, db_in, m_a, z_a, acc, m_b, z_b, v, w, rho, qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, n_q, n_k,
            left, right, SOFTCAP_A, SOFTCAP_B, HAS_LEFT, HAS_RIGHT, True, HAS_KEY_MASK, HAS_ATTN_MASK,
            DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE, FUSED_DQ, FP16_B, BLOCK_N,
        )
    m_a, z_a, acc, m_b, z_b, v, w, rho = _attention_kl_fwd_keys(
        b_full, c_full, q_a, q_b, ka_ptrs, kb_ptrs, km_ptr, stride_km_n, stride_ka_n, stride_kb_n, am_ptr, stride_am_q,
            stride_am_k, offs_m,
        offs_n, da_in, db_in, m_a, z_a, acc, m_b, z_b, v, w, rho, qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, n_q,
        n_k, left, right, SOFTCAP_A, SOFTCAP_B, HAS_LEFT, HAS_RIGHT, False, HAS_KEY_MASK, HAS_ATTN_MASK,
        DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE, FUSED_DQ, FP16_B, BLOCK_N,
    )
    m_a, z_a, acc, m_b, z_b, v, w, rho = _attention_kl_fwd_keys(
        c_full, hi, q_a, q_b, ka_ptrs, kb_ptrs, km_ptr, stride_km_n, stride_ka_n, stride_kb_n, am_ptr, stride_am_q,
            stride_am_k, offs_m, offs_n,
        da_in, db_in, m_a, z_a, acc, m_b, z_b, v, w, rho, qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, n_q, n_k,
        left, right, SOFTCAP_A, SOFTCAP_B, HAS_LEFT, HAS_RIGHT, True, HAS_KEY_MASK, HAS_ATTN_MASK,
        DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE, FUSED_DQ, FP16_B, BLOCK_N,
    )

    valid = row_in & (z_a != 0.0)  # no allowed key; a NaN row stays valid so that its NaN shows
    if HAS_QUERY_MASK:
        qm = tl.load(qm_ptr + offs_m * stride_qm_n, mask=row_in, other=0)
        valid = valid & (qm != 0)
    mc_a = tl.maximum(m_a * qk_scale_a, NEG_BIG)
    mc_b = tl.maximum(m_b * qk_scale_b, NEG_BIG)
    if HAS_SINKS:  # one more outcome per side, never masked, merged like one more key
        s_a = tl.load(SINK_A + h).to(tl.float32) * LOG2E_C
        s_b = tl.load(SINK_B + h).to(tl.float32) * LOG2E_C
        mc_a_new = tl.maximum(mc_a, s_a)
        alpha_a = tl.exp2(mc_a - mc_a_new)
        w_a = tl.exp2(s_a - mc_a_new)
        z_a_new = z_a * alpha_a + w_a
        acc = acc * alpha_a + w_a * (s_a - s_b)
        mc_b_new = tl.maximum(mc_b, s_b)
        alpha_b = tl.exp2(mc_b - mc_b_new)
        z_b_new = z_b * alpha_b + tl.exp2(s_b - mc_b_new)
        sink_alpha_a = alpha_a  # a sink has no key vector: it only moves both frames and sums (FUSED_DQ)
        sink_alpha_b = alpha_b
        z_a = z_a_new
        z_b = z_b_new
        mc_a = mc_a_new
        mc_b = mc_b_new
    z_a_safe = tl.where(valid, z_a, 1.0)
    z_b_safe = tl.where(valid, z_b, 1.0)
    lse2_a = mc_a + tl.log2(z_a_safe)
    lse2_b = mc_b + tl.log2(z_b_safe)
    kl = tl.where(valid, (acc / z_a_safe - lse2_a + lse2_b) * LN2_C, 0.0)
    out = row_base + offs_m
    tl.store(KL + out, kl, mask=row_in)
    tl.store(LSE_A + out, tl.where(valid, lse2_a * LN2_C, float("inf")), mask=row_in)
    tl.store(LSE_B + out, tl.where(valid, lse2_b * LN2_C, float("inf")), mask=row_in)
    if FUSED_DQ:  # dQ_b / g = grad_scale_b · Σ_j (P_b − P_a)_ij k_j (0 on empty and excluded rows)
        if HAS_SINKS:  # a sink moves the ratio and the frames once more (_fused_dq_fold)
            coef = z_a_safe / z_b_safe * sink_alpha_b - rho * sink_alpha_a
            num = w * sink_alpha_a[:, None] + coef[:, None] * v
        else:  # rho is already the final ratio of the sums
            num = w
        dq = tl.where(valid[:, None], num * (grad_scale_b / z_a_safe)[:, None], 0.0)
        if DQ_B.dtype.element_ty == tl.bfloat16:  # a large buffer (saved_dq_b_dtype)
            dq = _to_bf16_nearest_even(dq)
        tl.store(DQ_B + out[:, None] * D_B + offs_db[None, :], dq, mask=row_in[:, None] & db_in[None, :])


@triton.jit
def _attention_kl_fwd_kernel(
    Q_A, K_A, Q_B, K_B,  # [B, H, N_Q, D_A], [B, H_KA, N_K, D_A], [B, H, N_Q, D_B], [B, H_KB, N_K, D_B]; any strides
    SINK_A, SINK_B,  # [H] sink logits in nats (score units), or None
    KEY_MASK, QUERY_MASK,  # [B, N_K], [B, N_Q] uint8 (1 = keep) or None
    CU_Q, CU_K,  # [S + 1] int32 packed-sequence offsets, or None (then a "sequence" is a batch row)
    ATTN_MASK,  # [B or 1, H or 1, N_Q, N_K] uint8 general mask (1 = allowed) or None
    KL, LSE_A, LSE_B,  # [B, H, N_Q] fp32, contiguous: per-row KL (nats) and log-sum-exps (nats, +inf if empty)
    DQ_B,  # [B, H, N_Q, D_B] contiguous, fp32 or bf16 (saved_dq_b_dtype): side b's query gradient per unit upstream
    # gradient (FUSED_DQ), or None
    stride_qa_b, stride_qa_h, stride_qa_n, stride_qa_d,
    stride_ka_b, stride_ka_h, stride_ka_n, stride_ka_d,
    stride_qb_b, stride_qb_h, stride_qb_n, stride_qb_d,
    stride_kb_b, stride_kb_h, stride_kb_n, stride_kb_d,
    stride_km_b, stride_km_n, stride_qm_b, stride_qm_n,
    stride_am_b, stride_am_h, stride_am_q, stride_am_k,  # 0 on broadcast dims
    H, N_Q, N_K,  # heads; queries and keys per batch row (packed: all tokens)
    GROUP_A, GROUP_B,  # query heads per key head: H // H_KA, H // H_KB
    qk_scale_a, qk_scale_b,  # base-2 score = pre-exponent * qk_scale (> 0)
    cap_scale_a, cap_scale_b,  # soft-capped side: pre-exponent = tanh(raw * cap_scale)
    left, right,  # window bounds (used when HAS_LEFT / HAS_RIGHT)
    grad_scale_b,  # side b's ds/dr multiplier (KLSpec.grad_scale), folded into DQ_B
    order_chunk,  # (sequence, head) pairs per longest-first chunk (LONGEST_FIRST, see _longest_first)
    D_A: tl.constexpr, D_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_QUERY_MASK: tl.constexpr,
    HAS_SINKS: tl.constexpr, IS_VARLEN: tl.constexpr, SOFTCAP_A: tl.constexpr, SOFTCAP_B: tl.constexpr,
    HAS_ATTN_MASK: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
    FUSED_DQ: tl.constexpr, FP16_B: tl.constexpr, LONGEST_FIRST: tl.constexpr,
):
    if LONGEST_FIRST:  # a right window bound (causal): the longest row tiles first
        pid_m, pid_bh = _longest_row_tile_first(tl.program_id(0), N_Q, BLOCK_M, order_chunk)
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
    seq = pid_bh // H
    h = pid_bh % H
    q_start, n_q = _sequence(CU_Q, seq, N_Q, IS_VARLEN, N_Q)
    k_start, n_k = _sequence(CU_K, seq, N_K, IS_VARLEN, N_K)
    if IS_VARLEN:
        b64 = 0  # packed sequences live in batch row 0
    else:
        b64 = seq.to(tl.int64)
    h64 = h.to(tl.int64)
    hk_a = (h // GROUP_A).to(tl.int64)
    hk_b = (h // GROUP_B).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_da = tl.arange(0, BLOCK_DA)
    offs_db = tl.arange(0, BLOCK_DB)
    da_in = offs_da < D_A
    db_in = offs_db < D_B
    qa_base = Q_A + b64 * stride_qa_b + h64 * stride_qa_h + offs_da[None, :] * stride_qa_d
    qb_base = Q_B + b64 * stride_qb_b + h64 * stride_qb_h + offs_db[None, :] * stride_qb_d
    ka_ptrs = (K_A + b64 * stride_ka_b + hk_a * stride_ka_h + _offset(k_start, stride_ka_n, WIDE)
               + offs_n.to(tl.int64)[None, :] * stride_ka_n + offs_da[:, None] * stride_ka_d)
    kb_ptrs = (K_B + b64 * stride_kb_b + hk_b * stride_kb_h + _offset(k_start, stride_kb_n, WIDE)
               + offs_n.to(tl.int64)[None, :] * stride_kb_n + offs_db[:, None] * stride_kb_d)
    if HAS_KEY_MASK:
        km_ptr = KEY_MASK + b64 * stride_km_b
    else:
        km_ptr = KEY_MASK
    if HAS_QUERY_MASK:
        qm_ptr = QUERY_MASK + b64 * stride_qm_b
    else:
        qm_ptr = QUERY_MASK
    if HAS_ATTN_MASK:
        am_ptr = ATTN_MASK + b64 * stride_am_b + h64 * stride_am_h
    else:
        am_ptr = ATTN_MASK
    row_base = (b64 * H + h64) * N_Q + q_start
    if IS_VARLEN:  # grid-stride: a packed sequence longer than the grid's max_seqlen_q is still covered
        for m_start in range(pid_m * BLOCK_M, n_q, tl.num_programs(0) * BLOCK_M):
            _attention_kl_fwd_rows(
                m_start, qa_base, qb_base, ka_ptrs, kb_ptrs, km_ptr, qm_ptr, am_ptr, stride_am_q, stride_am_k,
                SINK_A, SINK_B, KL, LSE_A, LSE_B, DQ_B,
                stride_qa_n, stride_qb_n, stride_ka_n, stride_kb_n, stride_km_n, stride_qm_n, q_start, n_q, n_k, h,
                row_base, offs_n, offs_db, da_in, db_in, qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b,
                grad_scale_b, left, right,
                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_KEY_MASK, HAS_QUERY_MASK, HAS_SINKS, SOFTCAP_A, SOFTCAP_B,
                HAS_ATTN_MASK, DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE, FUSED_DQ, FP16_B, BLOCK_DB, D_B,
            )
    else:
        _attention_kl_fwd_rows(
            pid_m * BLOCK_M, qa_base, qb_base, ka_ptrs, kb_ptrs, km_ptr, qm_ptr, am_ptr, stride_am_q, stride_am_k,
            SINK_A, SINK_B, KL, LSE_A, LSE_B, DQ_B,
            stride_qa_n, stride_qb_n, stride_ka_n, stride_kb_n, stride_km_n, stride_qm_n, q_start, n_q, n_k, h,
            row_base, offs_n, offs_db, da_in, db_in, qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b,
            grad_scale_b, left, right,
            BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_KEY_MASK, HAS_QUERY_MASK, HAS_SINKS, SOFTCAP_A, SOFTCAP_B,
            HAS_ATTN_MASK, DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE, FUSED_DQ, FP16_B, BLOCK_DB, D_B,
        )


@functools.lru_cache(maxsize=512)
def _forward_plan(geometry: tuple, dtypes: tuple, spec: KLSpec, optional: tuple, sequences: int, allow_tf32: bool,
                  config: LaunchConfig | None, fused_dq: bool = False, l2_bytes: int = 50 << 20,
                  dq_scale: float = 1.0):
    """``(grid, scalars, meta)`` of one forward launch: everything that depends only on shapes, strides, dtypes
    and options, computed once per problem geometry (the per-call work is then allocation and the launch).

    With a right window bound (causal) and without packing, the grid is one-dimensional and runs the longest row
    tiles first (``LONGEST_FIRST``, :func:`streamkl._triton._helpers._longest_first`) in chunks of heads whose keys
    fit in half of ``l2_bytes``."""
    (qa_g, ka_g, qb_g, kb_g, km_g, qm_g, am_g) = geometry
    (_, heads, n_q, d_a), d_b, n_k = qa_g[0], qb_g[0][-1], ka_g[0][2]
    has_sinks, varlen = optional
    dtype_a, dtype_b = dtypes
    esize = max(dtype_a.itemsize, dtype_b.itemsize)
    cfg = config or forward_config(d_a, d_b, esize, fused_dq)
    km_strides = km_g[1] if km_g is not None else (0, 0)
    qm_strides = qm_g[1] if qm_g is not None else (0, 0)
    am_strides = broadcast_strides(am_g)
    grid = (max(triton.cdiv(spec.max_seqlen_q if varlen else n_q, cfg.block_m), 1), sequences * heads)
    longest_first = spec.window_right >= 0 and not varlen
    order_chunk = 1
    if longest_first:
        grid = (grid[0] * grid[1], 1)
        key_bytes = key_bytes_per_head(n_k, heads, (d_a, dtype_a, ka_g[0][1]), (d_b, dtype_b, kb_g[0][1]))
        order_chunk = longest_first_chunk(key_bytes, l2_bytes, sequences * heads)
    (qk_a, cap_a), (qk_b, cap_b) = side_scales(spec.scale_a, spec.softcap_a), side_scales(spec.scale_b, spec.softcap_b)
    scalars = (
        *qa_g[1], *ka_g[1], *qb_g[1], *kb_g[1], *km_strides, *qm_strides, *am_strides,
        heads, n_q, n_k, heads // ka_g[0][1], heads // kb_g[0][1], qk_a, qk_b, cap_a, cap_b,
        spec.window_left, spec.window_right, spec.grad_scale("b") * dq_scale, order_chunk,
    )
    meta = dict(
        D_A=d_a, D_B=d_b, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_DA=padded_head_dim(d_a), BLOCK_DB=padded_head_dim(d_b),
        HAS_LEFT=spec.window_left >= 0, HAS_RIGHT=spec.window_right >= 0, HAS_KEY_MASK=km_g is not None,
        HAS_QUERY_MASK=qm_g is not None, HAS_SINKS=has_sinks, IS_VARLEN=varlen,
        SOFTCAP_A=bool(spec.softcap_a), SOFTCAP_B=bool(spec.softcap_b), HAS_ATTN_MASK=am_g is not None,
        DOT_PRECISION_A=dot_precision(dtype_a, allow_tf32), DOT_PRECISION_B=dot_precision(dtype_b, allow_tf32),
        INTERPRET=triton_interpreter_enabled(), WIDE=wide_offsets(qa_g, ka_g, qb_g, kb_g),
        FUSED_DQ=fused_dq, FP16_B=dtype_b == torch.float16, LONGEST_FIRST=longest_first,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return grid, scalars, tuple(meta.items())


_launch_forward = KernelLauncher(_attention_kl_fwd_kernel)


def attention_kl_fwd(
    inputs: KLInputs, spec: KLSpec, allow_tf32: bool = False, config: LaunchConfig | None = None,
    dq_b: torch.Tensor | None = None, dq_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the fused forward; returns ``(kl, lse_a, lse_b)``, each ``[B, H, N_q]`` fp32 (nats).

    Inputs are ``(B, H, N, D)`` views with any strides (packed: ``(1, H, total, D)``; nothing is copied); see
    :func:`streamkl.reference.chunked_attention_kl_fwd` for the exact semantics it reproduces.
    ``config`` overrides the tile heuristic (used by the tuning script). ``dq_b``, a buffer from
    :func:`new_dq_b_buffer`, makes the same pass also write side b's query gradient per unit
    upstream gradient, ``grad_scale_b · Σ_j (P_b − P_a)_ij k_b,j`` (see :func:`new_dq_b_buffer`), so that a
    backward with a frozen side a needs only the key pass; times ``dq_scale`` (an upstream gradient known now, such
    as a mean's ``1/rows``), applied before the store rounds.
    """
    q_a, k_a, q_b, k_b = inputs.q_a, inputs.k_a, inputs.q_b, inputs.k_b
    batch, heads, n_q, _ = q_a.shape
    kl = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q_a.device)
    lse_a = torch.empty_like(kl)
    lse_b = torch.empty_like(kl)
    if kl.numel() == 0:
        return kl, lse_a, lse_b
    cu_q = inputs.cu_seqlens_q
    varlen = cu_q is not None
    if varlen:
        kl.zero_()  # rows outside every sequence (none when the offsets are valid) read as empty rows
        lse_a.fill_(float("inf"))
        lse_b.fill_(float("inf"))
    km, qm = as_uint8_mask(inputs.key_padding_mask), as_uint8_mask(inputs.query_mask)
    am = None if inputs.attn_mask is None else inputs.attn_mask.view(torch.uint8)
    geometry = tensor_geometry(q_a, k_a, q_b, k_b, km, qm, am)
    sequences = cu_q.shape[0] - 1 if varlen else batch
    grid, scalars, meta = _forward_plan(geometry, (q_a.dtype, q_b.dtype), spec, (inputs.sink_a is not None, varlen),
                                        sequences, allow_tf32, config, dq_b is not None,
                                        l2_cache_bytes(q_a.device.index if q_a.is_cuda else -1), dq_scale)
    tensors = (q_a, k_a, q_b, k_b, contiguous_or_none(inputs.sink_a), contiguous_or_none(inputs.sink_b), km, qm, cu_q,
               inputs.cu_seqlens_k, am, kl, lse_a, lse_b, dq_b)
    _launch_forward(grid, tensors, scalars, meta)
    return kl, lse_a, lse_b


#: Saved query gradients (the buffer the frozen-teacher forward fills) of at least this many bytes in fp32 are
#: written as bf16 for bf16 inputs; smaller ones stay fp32, where the memory saved is small and one rounding fewer
#: keeps them bitwise the two-pass backward's.
NARROW_DQ_MIN_BYTES = 32 << 20


def saved_dq_b_dtype(dtype: torch.dtype, numel: int) -> torch.dtype:
    """The dtype the forward-accumulated query gradient of ``numel`` elements is *saved* in for inputs of ``dtype``.

    bf16 for bf16 inputs when its fp32 buffer would have at least :data:`NARROW_DQ_MIN_BYTES` (fp32's range; the
    backward's one multiplication by the upstream gradient runs in fp32 and rounds once more, so the result is within
    one bf16 ulp of the two-pass backward's, at half the saved memory); fp32 for smaller buffers and for every other
    dtype (fp16's range would flush the small gradients of a student close to its teacher). The kernel writes this
    dtype directly (rounding to nearest even, as a copy would): a bf16 store adds a few spills to the D = 64 kernel,
    all outside its key loop (``benchmarks/kernel_resources.py``), and saves the fp32 buffer and the narrowing copy
    kernel that ran before (commit 93c6d4b).

    Example:
        >>> saved_dq_b_dtype(torch.bfloat16, 1 << 30), saved_dq_b_dtype(torch.bfloat16, 1024)
        (torch.bfloat16, torch.float32)
    """
    if dtype == torch.bfloat16 and numel * 4 >= NARROW_DQ_MIN_BYTES:
        return torch.bfloat16
    return torch.float32


def new_dq_b_buffer(inputs: KLInputs, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The buffer :func:`attention_kl_fwd` fills with side b's query gradient per unit upstream gradient, in ``dtype``
    (default: the dtype it is saved in, :func:`saved_dq_b_dtype`), contiguous, shaped like ``q_b`` (zeroed for packed
    inputs, whose tokens outside every sequence are never written).

    Example:
        >>> q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
        >>> new_dq_b_buffer(KLInputs(q, q, q, q, *[None] * 6)).dtype  # small: fp32
        torch.float32
    """
    q_b = inputs.q_b
    alloc = torch.zeros if inputs.cu_seqlens_q is not None else torch.empty
    dtype = dtype or saved_dq_b_dtype(q_b.dtype, q_b.numel())
    return alloc(q_b.shape, dtype=dtype, device=q_b.device)
