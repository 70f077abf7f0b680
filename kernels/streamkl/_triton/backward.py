"""Fused attention-KL backward: recompute both probability tiles from the saved log-sum-exps.

With base-2 scores ``x·c_a``, ``y·c_b`` (``c = qk_scale``, ``x``/``y`` the pre-exponents of
:func:`_pre_exponent`), the saved ``lse`` (nats, sinks included) and per-row upstream gradient ``g``, each tile
forms

* ``P_a = exp2(x·c_a − lse_a·log2 e)``, ``P_b`` likewise (exactly 0 on masked keys and empty rows);
* ``dS_b = g (P_b − P_a)`` and ``dS_a = g P_a [(x_nat − lse_a) − (y_nat − lse_b) − KL]``, times ``1 − tanh²`` on a
  soft-capped side;
* ``dQ = dS·K·s``, ``dK = dSᵀ·Q·s`` with ``s`` the side's :meth:`KLSpec.grad_scale`.

fp16 inputs: ``g·(P_b − P_a)`` is ~``1/(B·H·N²)`` under ``reduction="mean"``, far below fp16's range at long
context, so each dS tile is scaled by an exact power of two (:func:`_pow2_scale`) before it is cast for the
tensor cores and the fp32 product is scaled back. bf16 has fp32's range and needs none.

Two passes share that tile math:

* ``_attention_kl_bwd_dk_kernel`` is key-stationary: one program per (key tile, sequence, key head) loops
  over the query heads that share the key head and over the query tiles that can see the key tile
  (:func:`_band`), so ``dK`` stays in registers with no atomics. With ``ATOMIC_DQ`` (``deterministic=False``) it
  also adds each tile's ``dQ`` into an fp32 buffer with atomic adds (4 products + 2 exponentials per score
  element; the summation order of ``dQ`` then varies between runs in the last bits).
* ``_attention_kl_bwd_dq_kernel`` is query-stationary and computes ``dQ`` with no atomics: the default
  (``deterministic=True``), 6 products + 4 exponentials per element in all.

When both sides need gradients and they group their key heads differently (e.g. a GQA teacher and an
MHA student), side a's ``dK`` is written per query head to an fp32 buffer and summed over the group
afterwards (``O(H·N_k·D)`` extra memory, never ``O(N²)``).

Masked tiles (window edges, sequence ends) zero the non-finite entries of the operands they multiply by a
zero ``dS``, and padded keys and excluded rows are loaded as 0, so non-finite values a row never sees never
reach a gradient of an allowed entry; a row that does see one has NaN ``lse`` and passes it on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .._problem import KLInputs, KLSpec
from .._triton_common.interpreter import triton_interpreter_enabled
from .._triton_common.launch import KernelLauncher, tensor_geometry
from .._triton_common.numerics import LN2_C, LOG2E_C, side_scales
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
    _longest_first,
    _longest_row_tile_first,
    _offset,
    _pre_exponent,
    _sequence,
    as_uint8_mask,
    broadcast_strides,
    dot_precision,
    wide_offsets,
)
from .configs import dk_config, dq_config, padded_head_dim


@triton.jit
def _attention_kl_bwd_ds(
    x, y,  # pre-exponents of one tile (fp32), [BLOCK_M, BLOCK_N] or transposed
    allowed,  # bool mask broadcastable to the tile, or None when every pair of the tile is allowed
    lse2_a, lse2_b,  # log-sum-exps in base 2 (+inf on empty rows), broadcastable to the tile
    kl, g,  # per-row KL (nats) and upstream gradient, broadcastable to the tile
    qk_scale_a, qk_scale_b,
    NEED_A: tl.constexpr, MASKED: tl.constexpr, SOFTCAP_A: tl.constexpr, SOFTCAP_B: tl.constexpr,
):
    """``(dS_a, dS_b)`` of one tile w.r.t. the raw products (up to the side's grad scale); ``dS_a`` is only formed
    when ``NEED_A`` (else ``dS_b`` is returned twice)."""
    xs = x * qk_scale_a
    ys = y * qk_scale_b
    p_a = tl.exp2(xs - lse2_a)
    p_b = tl.exp2(ys - lse2_b)
    ds_b = g * (p_b - p_a)
    if SOFTCAP_B:
        ds_b = ds_b * (1.0 - y * y)
    if MASKED:
        ds_b = tl.where(allowed, ds_b, 0.0)
    if NEED_A:
        la = tl.where(lse2_a == float("inf"), 0.0, lse2_a)  # finite stand-ins: P_a is already 0 there
        lb = tl.where(lse2_b == float("inf"), 0.0, lse2_b)
        ds_a = (g * p_a) * (((xs - la) - (ys - lb)) * LN2_C - kl)
        if SOFTCAP_A:
            ds_a = ds_a * (1.0 - x * x)
        if MASKED:
            ds_a = tl.where(allowed, ds_a, 0.0)
    else:
        ds_a = ds_b
    return ds_a, ds_b


@triton.jit
def _attention_kl_bwd_dk_queries(
    lo, hi, shift,  # query tiles [lo, hi) of this sweep (lo a multiple of BLOCK_M), visited from tile `shift` on
    k_a, k_b,  # [BLOCK_N, BLOCK_DA], [BLOCK_N, BLOCK_DB] key tiles of this program (input dtype, finite)
    qa_base, qb_base,  # [BLOCK_DA, 1], [BLOCK_DB, 1] pointers of this head's queries at row 0 of the sequence
    stride_qa_n, stride_qb_n,
    row_base,  # offset of (batch, head, row 0 of the sequence) into the [B, H, N_Q] row-state arrays
    GRAD, KL, LSE_A, LSE_B,
    DQ_A, DQ_B,  # [B, H, N_Q, D_*] fp32 atomic accumulators (ATOMIC_DQ), else None
    keys, key_row,  # [BLOCK_N] local key indices; loaded key padding mask as a column, or None
    am_ptr, stride_am_q, stride_am_k,  # general attn_mask of this (batch, head), or None
    da_in, db_in,
    dk_a, dk_b,  # [BLOCK_N, BLOCK_D*] fp32 accumulators
    qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, grad_scale_a, grad_scale_b,
    n_q, n_k, left, right,
    D_A: tl.constexpr, D_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASKED: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    HAS_QUERY_MASK: tl.constexpr, HAS_ATTN_MASK: tl.constexpr, NEED_A: tl.constexpr, NEED_B: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    SOFTCAP_A: tl.constexpr, SOFTCAP_B: tl.constexpr, FP16_A: tl.constexpr, FP16_B: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
    SCALAR_GRAD: tl.constexpr,
):
    """Fold the query tiles of ``[lo, hi)`` into this key tile's ``dK`` accumulators, computed transposed
    ([keys, queries]); with ``ATOMIC_DQ`` also add their ``dQ``."""
    num = tl.cdiv(hi - lo, BLOCK_M)
    for i in range(0, num):
        m0 = lo + ((i + shift) % num) * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_in = offs_m < n_q
        rows = row_base + offs_m
        lse2_a = tl.load(LSE_A + rows, mask=row_in, other=float("inf")) * LOG2E_C
        lse2_b = tl.load(LSE_B + rows, mask=row_in, other=float("inf")) * LOG2E_C
        if SCALAR_GRAD:  # reduction="mean"/"sum": one upstream gradient for every row, read in place (stride 0)
            g = tl.load(GRAD + rows * 0, mask=row_in, other=0.0)
        else:
            g = tl.load(GRAD + rows, mask=row_in, other=0.0)
        if NEED_A:
            kl = tl.load(KL + rows, mask=row_in, other=0.0)[None, :]
        else:
            kl = g[None, :]
        if HAS_QUERY_MASK or MASKED:  # excluded and empty rows never meet their (possibly non-finite) queries
            row_ok = row_in & (lse2_a != float("inf"))
        else:  # every row of a full tile sees a key (the queries load without waiting for the row state)
            row_ok = row_in
        qt_a = tl.load(qa_base + _offset(offs_m, stride_qa_n, WIDE)[None, :], mask=row_ok[None, :] & da_in[:, None],
                       other=0.0)
        qt_b = tl.load(qb_base + _offset(offs_m, stride_qb_n, WIDE)[None, :], mask=row_ok[None, :] & db_in[:, None],
                       other=0.0)
        xt = _pre_exponent(_dot(k_a, qt_a, DOT_PRECISION_A, INTERPRET), cap_scale_a, SOFTCAP_A)  # [BLOCK_N, BLOCK_M]
        yt = _pre_exponent(_dot(k_b, qt_b, DOT_PRECISION_B, INTERPRET), cap_scale_b, SOFTCAP_B)
        if MASKED or HAS_KEY_MASK:
            allowed = _allowed(offs_m[None, :], keys[:, None], key_row, n_q, n_k, left, right, am_ptr, stride_am_q,
                               stride_am_k, HAS_LEFT, HAS_RIGHT, MASKED, HAS_KEY_MASK, HAS_ATTN_MASK)
        else:
            allowed = None
        dst_a, dst_b = _attention_kl_bwd_ds(xt, yt, allowed, lse2_a[None, :], lse2_b[None, :], kl, g[None, :],
                                            qk_scale_a, qk_scale_b, NEED_A, MASKED or HAS_KEY_MASK,
                                            SOFTCAP_A, SOFTCAP_B)
        if NEED_B:
            ds, inv = _as_operand(dst_b, qt_b.dtype, FP16_B)
            if FP16_B:
                dk_b += _dot(ds, tl.trans(qt_b), DOT_PRECISION_B, INTERPRET) * inv
            else:
                dk_b += _dot(ds, tl.trans(qt_b), DOT_PRECISION_B, INTERPRET)
            if ATOMIC_DQ:
                dq = _dot(tl.trans(ds), k_b, DOT_PRECISION_B, INTERPRET) * (inv * grad_scale_b)
                tl.atomic_add(DQ_B + rows.to(tl.int64)[:, None] * D_B + tl.arange(0, BLOCK_DB)[None, :], dq,
                              mask=row_in[:, None] & db_in[None, :], sem="relaxed")
        if NEED_A:
            ds, inv = _as_operand(dst_a, qt_a.dtype, FP16_A)
            if FP16_A:
                dk_a += _dot(ds, tl.trans(qt_a), DOT_PRECISION_A, INTERPRET) * inv
            else:
                dk_a += _dot(ds, tl.trans(qt_a), DOT_PRECISION_A, INTERPRET)
            if ATOMIC_DQ:
                dq = _dot(tl.trans(ds), k_a, DOT_PRECISION_A, INTERPRET) * (inv * grad_scale_a)
                tl.atomic_add(DQ_A + rows.to(tl.int64)[:, None] * D_A + tl.arange(0, BLOCK_DA)[None, :], dq,
                              mask=row_in[:, None] & da_in[None, :], sem="relaxed")
    return dk_a, dk_b


@triton.jit
def _attention_kl_bwd_dk_keys(
    n0, pid_n,  # first local key of this tile; the program's tile index (staggers the atomic dQ sweep)
    Q_A, K_A, Q_B, K_B, GRAD, KL, LSE_A, LSE_B, DK_A, DK_B, DQ_A, DQ_B, km_ptr,
    ATTN_MASK, stride_am_b, stride_am_h, stride_am_q, stride_am_k,
    stride_qa_b, stride_qa_h, stride_qa_n, stride_qa_d,
    stride_ka_b, stride_ka_h, stride_ka_n, stride_ka_d,
    stride_qb_b, stride_qb_h, stride_qb_n, stride_qb_d,
    stride_kb_b, stride_kb_h, stride_kb_n, stride_kb_d,
    stride_km_n,
    b64, hg, heads_per_group, H, N_Q, N_K, GROUP_A, GROUP_B, H_KG, q_start, k_start, n_q, n_k,
    offs_da, offs_db, da_in, db_in,
    qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, grad_scale_a, grad_scale_b, left, right,
    D_A: tl.constexpr, D_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_QUERY_MASK: tl.constexpr,
    HAS_ATTN_MASK: tl.constexpr,
    NEED_A: tl.constexpr, NEED_B: tl.constexpr, DK_A_PER_HEAD: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    SOFTCAP_A: tl.constexpr, SOFTCAP_B: tl.constexpr, FP16_A: tl.constexpr, FP16_B: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
    SCALAR_GRAD: tl.constexpr,
):
    """One key tile: sweep the query tiles of every head that shares its key head, then write its dK."""
    hg64 = hg.to(tl.int64)
    keys = n0 + tl.arange(0, BLOCK_N)
    key_in = keys < n_k
    keys64 = (k_start + keys).to(tl.int64)
    key_row = None
    if HAS_KEY_MASK:
        key_ok = tl.load(km_ptr + keys * stride_km_n, mask=key_in, other=0) != 0
        key_load = key_in & key_ok
        key_row = key_ok[:, None]
    else:
        key_load = key_in
    # query tiles [lo, b) and [c, hi) need masking, [b, c) none. Rows past n_q and keys past n_k need no mask
    # here: they load as 0 with lse = +inf (P = 0), and the dK of keys past n_k is never stored.
    last = tl.minimum(n0 + BLOCK_N, n_k) - 1
    lo, b_full, c_full, hi = _band(n0, last, n_k, n_q, right, left, BLOCK_M, HAS_RIGHT, HAS_LEFT)
    if not HAS_LEFT:
        c_full = hi
    if HAS_ATTN_MASK:  # a general mask: every tile of the band is masked
        b_full = hi
        c_full = hi
    if HAS_KEY_MASK:  # a tile of padded keys visits no query: its dK is 0
        none_kept = tl.max(key_ok.to(tl.int32), 0) == 0
        lo, b_full, c_full, hi = _empty_band_if(none_kept, lo, b_full, c_full, hi)
    if ATOMIC_DQ:  # programs start at different query tiles so their atomic dQ adds do not collide
        shift = pid_n
    else:
        shift = 0

    dk_a = tl.zeros((BLOCK_N, BLOCK_DA), tl.float32)
    dk_b = tl.zeros((BLOCK_N, BLOCK_DB), tl.float32)
    for hh in range(0, heads_per_group):
        h = hg * heads_per_group + hh
        h64 = h.to(tl.int64)
        hk_a = (h // GROUP_A).to(tl.int64)
        hk_b = (h // GROUP_B).to(tl.int64)
        ka_ptrs = K_A + b64 * stride_ka_b + hk_a * stride_ka_h + keys64[:, None] * stride_ka_n + offs_da[None, :] * stride_ka_d
        kb_ptrs = K_B + b64 * stride_kb_b + hk_b * stride_kb_h + keys64[:, None] * stride_kb_n + offs_db[None, :] * stride_kb_d
        k_a = _finite(tl.load(ka_ptrs, mask=key_load[:, None] & da_in[None, :], other=0.0))
        k_b = _finite(tl.load(kb_ptrs, mask=key_load[:, None] & db_in[None, :], other=0.0))
        qa_base = (Q_A + b64 * stride_qa_b + h64 * stride_qa_h + _offset(q_start, stride_qa_n, WIDE)
                   + offs_da[:, None] * stride_qa_d)
        qb_base = (Q_B + b64 * stride_qb_b + h64 * stride_qb_h + _offset(q_start, stride_qb_n, WIDE)
                   + offs_db[:, None] * stride_qb_d)
        row_base = (b64 * H + h64) * N_Q + q_start
        if HAS_ATTN_MASK:
            am_ptr = ATTN_MASK + b64 * stride_am_b + h64 * stride_am_h
        else:
            am_ptr = ATTN_MASK
        lo_h, b_h, c_h, hi_h = lo, b_full, c_full, hi
        if HAS_QUERY_MASK or HAS_KEY_MASK:  # only the query tiles from this head's first counted row to its last
            q_first, q_end = _kept_span(LSE_A + row_base, 1, n_q, True, SPAN_SCAN)
            lo_h, b_h, c_h, hi_h = _clip_band(lo, b_full, c_full, hi, q_first, q_end, BLOCK_M)
        if HAS_RIGHT or HAS_ATTN_MASK:  # rows above the full tiles exist only with a right bound (causal)
            dk_a, dk_b = _attention_kl_bwd_dk_queries(
                lo_h, b_h, 0, k_a, k_b, qa_base, qb_base, stride_qa_n, stride_qb_n, row_base,
                GRAD, KL, LSE_A, LSE_B, DQ_A, DQ_B, keys, key_row, am_ptr, stride_am_q, stride_am_k, da_in, db_in,
                dk_a, dk_b,
                qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, grad_scale_a, grad_scale_b, n_q, n_k, left, right,
                D_A, D_B, BLOCK_M, BLOCK_DA, BLOCK_DB, HAS_LEFT, HAS_RIGHT, True, HAS_KEY_MASK, HAS_QUERY_MASK,
                HAS_ATTN_MASK,
                NEED_A, NEED_B, ATOMIC_DQ, SOFTCAP_A, SOFTCAP_B, FP16_A, FP16_B,
                DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE, SCALAR_GRAD,
            )
        dk_a, dk_b = _attention_kl_bwd_dk_queries(
            b_h, c_h, shift, k_a, k_b, qa_base, qb_base, stride_qa_n, stride_qb_n, row_base,
            GRAD, KL, LSE_A, LSE_B, DQ_A, DQ_B, keys, key_row, am_ptr, stride_am_q, stride_am_k, da_in, db_in,
                dk_a, dk_b,
            qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, grad_scale_a, grad_scale_b, n_q, n_k, left, right,
            D_A, D_B, BLOCK_M, BLOCK_DA, BLOCK_DB, HAS_LEFT, HAS_RIGHT, False, HAS_KEY_MASK, HAS_QUERY_MASK,
                HAS_ATTN_MASK,
            NEED_A, NEED_B, ATOMIC_DQ, SOFTCAP_A, SOFTCAP_B, FP16_A, FP16_B,
            DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE, SCALAR_GRAD,
        )
        if HAS_LEFT:  # rows below the full tiles exist only with a left window bound
            dk_a, dk_b = _attention_kl_bwd_dk_queries(
                c_h, hi_h, 0, k_a, k_b, qa_base, qb_base, stride_qa_n, stride_qb_n, row_base,
                GRAD, KL, LSE_A, LSE_B, DQ_A, DQ_B, keys, key_row, am_ptr, stride_am_q, stride_am_k, da_in, db_in,
                dk_a, dk_b,
                qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, grad_scale_a, grad_scale_b, n_q, n_k, left, right,
                D_A, D_B, BLOCK_M, BLOCK_DA, BLOCK_DB, HAS_LEFT, HAS_RIGHT, True, HAS_KEY_MASK, HAS_QUERY_MASK,
                HAS_ATTN_MASK,
                NEED_A, NEED_B, ATOMIC_DQ, SOFTCAP_A, SOFTCAP_B, FP16_A, FP16_B,
                DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE, SCALAR_GRAD,
            )
        if NEED_A and DK_A_PER_HEAD:  # side a groups its key heads differently: write per query head
            ptrs = DK_A + ((b64 * H + h64) * N_K + keys64[:, None]) * D_A + offs_da[None, :]
            tl.store(ptrs, dk_a * grad_scale_a, mask=key_in[:, None] & da_in[None, :])
            dk_a = tl.zeros((BLOCK_N, BLOCK_DA), tl.float32)

    if NEED_A and not DK_A_PER_HEAD:
        ptrs = DK_A + ((b64 * H_KG + hg64) * N_K + keys64[:, None]) * D_A + offs_da[None, :]
        tl.store(ptrs, (dk_a * grad_scale_a).to(DK_A.dtype.element_ty), mask=key_in[:, None] & da_in[None, :])
    if NEED_B:
        ptrs = DK_B + ((b64 * H_KG + hg64) * N_K + keys64[:, None]) * D_B + offs_db[None, :]
        tl.store(ptrs, (dk_b * grad_scale_b).to(DK_B.dtype.element_ty), mask=key_in[:, None] & db_in[None, :])


@triton.jit
def _attention_kl_bwd_dk_kernel(
    Q_A, K_A, Q_B, K_B,  # [B, H, N_Q, D_A], [B, H_KA, N_K, D_A], [B, H, N_Q, D_B], [B, H_KB, N_K, D_B]; any strides
    KEY_MASK,  # [B, N_K] uint8 or None
    CU_Q, CU_K,  # [S + 1] int32 packed-sequence offsets, or None
    GRAD, KL, LSE_A, LSE_B,  # [B, H, N_Q] fp32 contiguous: upstream gradient (one number if SCALAR_GRAD), saved KL and lse (nats)
    DK_A, DK_B,  # [B, H_KA, N_K, D_A] / [B, H_KB, N_K, D_B] contiguous, or [B, H, N_K, D_A] fp32 when DK_A_PER_HEAD
    DQ_A, DQ_B,  # [B, H, N_Q, D_*] fp32 contiguous accumulators (ATOMIC_DQ), else None
    ATTN_MASK,  # [B or 1, H or 1, N_Q, N_K] uint8 general mask (1 = allowed) or None
    stride_am_b, stride_am_h, stride_am_q, stride_am_k,
    stride_qa_b, stride_qa_h, stride_qa_n, stride_qa_d,
    stride_ka_b, stride_ka_h, stride_ka_n, stride_ka_d,
    stride_qb_b, stride_qb_h, stride_qb_n, stride_qb_d,
    stride_kb_b, stride_kb_h, stride_kb_n, stride_kb_d,
    stride_km_b, stride_km_n,
    H, N_Q, N_K,
    GROUP_A, GROUP_B,  # H // H_KA, H // H_KB
    H_KG,  # key heads of the grouping side: one program per (key tile, sequence, grouping key head)
    qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, grad_scale_a, grad_scale_b,
    left, right,
    order_chunk,  # pairs per longest-first chunk (LONGEST_FIRST, see _longest_first)
    D_A: tl.constexpr, D_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_QUERY_MASK: tl.constexpr,
    HAS_ATTN_MASK: tl.constexpr, IS_VARLEN: tl.constexpr, NEED_A: tl.constexpr, NEED_B: tl.constexpr,
    DK_A_PER_HEAD: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    SOFTCAP_A: tl.constexpr, SOFTCAP_B: tl.constexpr, FP16_A: tl.constexpr, FP16_B: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
    SCALAR_GRAD: tl.constexpr, LONGEST_FIRST: tl.constexpr,
):
    if LONGEST_FIRST:  # a right window bound (causal): key tile 0 is seen by the most rows, so it goes first
        pid_n, pid_bg = _longest_first(tl.program_id(0), tl.cdiv(N_K, BLOCK_N), order_chunk)
    else:
        pid_n = tl.program_id(0)
        pid_bg = tl.program_id(1)
    seq = pid_bg // H_KG
    hg = pid_bg % H_KG
    heads_per_group = H // H_KG
    q_start, n_q = _sequence(CU_Q, seq, N_Q, IS_VARLEN, N_Q)
    k_start, n_k = _sequence(CU_K, seq, N_K, IS_VARLEN, N_K)
    if IS_VARLEN:
        b64 = 0  # packed sequences live in batch row 0
    else:
        b64 = seq.to(tl.int64)
    offs_da = tl.arange(0, BLOCK_DA)
    offs_db = tl.arange(0, BLOCK_DB)
    da_in = offs_da < D_A
    db_in = offs_db < D_B
    if HAS_KEY_MASK:
        km_ptr = KEY_MASK + b64 * stride_km_b
    else:
        km_ptr = KEY_MASK
    if IS_VARLEN:  # grid-stride: a packed sequence longer than the grid's max_seqlen_k is still covered
        for n0 in range(pid_n * BLOCK_N, n_k, tl.num_programs(0) * BLOCK_N):
            _attention_kl_bwd_dk_keys(
                n0, pid_n,
                Q_A, K_A, Q_B, K_B, GRAD, KL, LSE_A, LSE_B, DK_A, DK_B, DQ_A, DQ_B, km_ptr,
                ATTN_MASK, stride_am_b, stride_am_h, stride_am_q, stride_am_k, stride_qa_b, stride_qa_h, stride_qa_n, stride_qa_d, stride_ka_b, stride_ka_h, stride_ka_n, stride_ka_d,
                stride_qb_b, stride_qb_h, stride_qb_n, stride_qb_d, stride_kb_b, stride_kb_h, stride_kb_n, stride_kb_d,
                stride_km_n, b64, hg, heads_per_group, H, N_Q, N_K, GROUP_A, GROUP_B, H_KG, q_start, k_start, n_q, n_k,
                offs_da, offs_db, da_in, db_in, qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, grad_scale_a,
                grad_scale_b, left, right, D_A, D_B, BLOCK_M, BLOCK_N, BLOCK_DA, BLOCK_DB, HAS_LEFT, HAS_RIGHT,
                HAS_KEY_MASK, HAS_QUERY_MASK, HAS_ATTN_MASK, NEED_A, NEED_B, DK_A_PER_HEAD, ATOMIC_DQ, SOFTCAP_A, SOFTCAP_B, FP16_A,
                FP16_B, DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE, SCALAR_GRAD,
            )
    else:
        _attention_kl_bwd_dk_keys(
            pid_n * BLOCK_N, pid_n,
            Q_A, K_A, Q_B, K_B, GRAD, KL, LSE_A, LSE_B, DK_A, DK_B, DQ_A, DQ_B, km_ptr,
            ATTN_MASK, stride_am_b, stride_am_h, stride_am_q, stride_am_k, stride_qa_b, stride_qa_h, stride_qa_n, stride_qa_d, stride_ka_b, stride_ka_h, stride_ka_n, stride_ka_d,
            stride_qb_b, stride_qb_h, stride_qb_n, stride_qb_d, stride_kb_b, stride_kb_h, stride_kb_n, stride_kb_d,
            stride_km_n, b64, hg, heads_per_group, H, N_Q, N_K, GROUP_A, GROUP_B, H_KG, q_start, k_start, n_q, n_k,
            offs_da, offs_db, da_in, db_in, qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, grad_scale_a,
            grad_scale_b, left, right, D_A, D_B, BLOCK_M, BLOCK_N, BLOCK_DA, BLOCK_DB, HAS_LEFT, HAS_RIGHT,
            HAS_KEY_MASK, HAS_QUERY_MASK, HAS_ATTN_MASK, NEED_A, NEED_B, DK_A_PER_HEAD, ATOMIC_DQ, SOFTCAP_A, SOFTCAP_B, FP16_A,
            FP16_B, DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE, SCALAR_GRAD,
        )


@triton.jit
def _attention_kl_bwd_dq_keys(
    lo, hi,  # key tiles [lo, hi) of this sweep, lo a multiple of BLOCK_N
    q_a, q_b,  # [BLOCK_M, BLOCK_D*] query tiles (input dtype)
    ka_ptrs, kb_ptrs,  # [BLOCK_D*, BLOCK_N] transposed key pointers at key 0 of the sequence
    km_ptr, stride_km_n, stride_ka_n, stride_kb_n,
    am_ptr, stride_am_q, stride_am_k,  # general attn_mask of this (batch, head), or None
    offs_m, offs_n, da_in, db_in,
    lse2_a, lse2_b, kl, g,  # [BLOCK_M, 1] row state
    dq_a, dq_b,  # [BLOCK_M, BLOCK_D*] fp32 accumulators
    qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b,
    n_q, n_k, left, right,
    BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASKED: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, BANDED: tl.constexpr, HAS_ATTN_MASK: tl.constexpr, NEED_A: tl.constexpr,
    NEED_B: tl.constexpr,
    SOFTCAP_A: tl.constexpr, SOFTCAP_B: tl.constexpr, FP16_A: tl.constexpr, FP16_B: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
):
    """Fold the key tiles of ``[lo, hi)`` into this query tile's ``dQ`` accumulators."""
    for n0 in range(lo, hi, BLOCK_N):
        keys = n0 + offs_n
        key_row = None
        if HAS_KEY_MASK:
            key_ok = tl.load(km_ptr + keys * stride_km_n, mask=keys < n_k, other=0) != 0
            ka_load = key_ok[None, :] & da_in[:, None]
            kb_load = key_ok[None, :] & db_in[:, None]
            key_row = key_ok[None, :]
        elif MASKED:
            ka_load = (keys < n_k)[None, :] & da_in[:, None]
            kb_load = (keys < n_k)[None, :] & db_in[:, None]
        else:  # a full tile is inside the sequence: no key bound to check
            ka_load = da_in[:, None]
            kb_load = db_in[:, None]
        kt_a = tl.load(ka_ptrs + _offset(n0, stride_ka_n, WIDE), mask=ka_load, other=0.0)
        kt_b = tl.load(kb_ptrs + _offset(n0, stride_kb_n, WIDE), mask=kb_load, other=0.0)
        if MASKED and (BANDED or HAS_ATTN_MASK):  # a non-finite key that some row of the tile does not see must not meet its zero dS
            # (0 * NaN); a row that does see it has a NaN lse and stays NaN
            kt_a = _finite(kt_a)
            kt_b = _finite(kt_b)
        x = _pre_exponent(_dot(q_a, kt_a, DOT_PRECISION_A, INTERPRET), cap_scale_a, SOFTCAP_A)
        y = _pre_exponent(_dot(q_b, kt_b, DOT_PRECISION_B, INTERPRET), cap_scale_b, SOFTCAP_B)
        if MASKED or HAS_KEY_MASK:
            allowed = _allowed(offs_m[:, None], keys[None, :], key_row, n_q, n_k, left, right, am_ptr, stride_am_q,
                               stride_am_k, HAS_LEFT, HAS_RIGHT, MASKED, HAS_KEY_MASK, HAS_ATTN_MASK)
        else:
            allowed = None
        ds_a, ds_b = _attention_kl_bwd_ds(x, y, allowed, lse2_a, lse2_b, kl, g, qk_scale_a, qk_scale_b, NEED_A,
                                          MASKED or HAS_KEY_MASK, SOFTCAP_A, SOFTCAP_B)
        if NEED_A:
            ds, inv = _as_operand(ds_a, kt_a.dtype, FP16_A)
            if FP16_A:
                dq_a += _dot(ds, tl.trans(kt_a), DOT_PRECISION_A, INTERPRET) * inv
            else:
                dq_a += _dot(ds, tl.trans(kt_a), DOT_PRECISION_A, INTERPRET)
        if NEED_B:
            ds, inv = _as_operand(ds_b, kt_b.dtype, FP16_B)
            if FP16_B:
                dq_b += _dot(ds, tl.trans(kt_b), DOT_PRECISION_B, INTERPRET) * inv
            else:
                dq_b += _dot(ds, tl.trans(kt_b), DOT_PRECISION_B, INTERPRET)
    return dq_a, dq_b


@triton.jit
def _attention_kl_bwd_dq_rows(
    m_start,  # first local query row of this tile
    qa_base, qb_base, ka_ptrs, kb_ptrs, km_ptr,
    am_ptr, stride_am_q, stride_am_k,  # general attn_mask of this (batch, head), or None
    GRAD, KL, LSE_A, LSE_B, DQ_A, DQ_B,
    stride_qa_n, stride_qb_n, stride_ka_n, stride_kb_n, stride_km_n,
    q_start, n_q, n_k, row_base, offs_n, offs_da, offs_db, da_in, db_in,
    qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, grad_scale_a, grad_scale_b, left, right,
    D_A: tl.constexpr, D_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, BANDED: tl.constexpr, HAS_ATTN_MASK: tl.constexpr, NEED_A: tl.constexpr,
    NEED_B: tl.constexpr,
    SOFTCAP_A: tl.constexpr, SOFTCAP_B: tl.constexpr, FP16_A: tl.constexpr, FP16_B: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
    SCALAR_GRAD: tl.constexpr,
):
    """One tile of ``BLOCK_M`` query rows: stream its key band and write its dQ."""
    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_in = offs_m < n_q
    rows = row_base + offs_m
    lse2_a = tl.load(LSE_A + rows, mask=row_in, other=float("inf")) * LOG2E_C
    lse2_b = tl.load(LSE_B + rows, mask=row_in, other=float("inf")) * LOG2E_C
    kl = tl.load(KL + rows, mask=row_in, other=0.0)[:, None]
    if SCALAR_GRAD:  # reduction="mean"/"sum": one upstream gradient for every row, read in place (stride 0)
        g = tl.load(GRAD + rows * 0, mask=row_in, other=0.0)[:, None]
    else:
        g = tl.load(GRAD + rows, mask=row_in, other=0.0)[:, None]
    row_ok = row_in & (lse2_a != float("inf"))  # excluded rows never meet their (possibly non-finite) queries
    q_rows = (q_start + offs_m).to(tl.int64)[:, None]
    q_a = tl.load(qa_base + q_rows * stride_qa_n, mask=row_ok[:, None] & da_in[None, :], other=0.0)
    q_b = tl.load(qb_base + q_rows * stride_qb_n, mask=row_ok[:, None] & db_in[None, :], other=0.0)
    dq_a = tl.zeros((BLOCK_M, BLOCK_DA), tl.float32)
    dq_b = tl.zeros((BLOCK_M, BLOCK_DB), tl.float32)
    last = tl.minimum(m_start + BLOCK_M, n_q) - 1
    lo, b_full, c_full, hi = _band(m_start, last, n_q, n_k, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if HAS_ATTN_MASK:  # a general mask: every tile of the band is masked
        b_full = hi
        c_full = hi
    if HAS_KEY_MASK:  # padded keys: only the tiles from the first real key to the last (the others add exactly 0)
        k_first, k_end = _kept_span(km_ptr, stride_km_n, n_k, False, SPAN_SCAN)
        lo, b_full, c_full, hi = _clip_band(lo, b_full, c_full, hi, k_first, k_end, BLOCK_N)
        # a tile with no counted row (lse = +inf: excluded, or every key padded) visits no key: its dQ is 0
        none_kept = tl.max(row_ok.to(tl.int32), 0) == 0
        lo, b_full, c_full, hi = _empty_band_if(none_kept, lo, b_full, c_full, hi)
    if HAS_LEFT or HAS_ATTN_MASK:  # keys below the full tiles exist only with a left window bound
        dq_a, dq_b = _attention_kl_bwd_dq_keys(
            lo, b_full, q_a, q_b, ka_ptrs, kb_ptrs, km_ptr, stride_km_n, stride_ka_n, stride_kb_n, am_ptr,
            stride_am_q, stride_am_k, offs_m, offs_n,
            da_in, db_in, lse2_a[:, None], lse2_b[:, None], kl, g, dq_a, dq_b, qk_scale_a, qk_scale_b,
            cap_scale_a, cap_scale_b, n_q, n_k, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT, True, HAS_KEY_MASK, BANDED, HAS_ATTN_MASK,
            NEED_A, NEED_B, SOFTCAP_A, SOFTCAP_B, FP16_A, FP16_B, DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE,
        )
    dq_a, dq_b = _attention_kl_bwd_dq_keys(
        b_full, c_full, q_a, q_b, ka_ptrs, kb_ptrs, km_ptr, stride_km_n, stride_ka_n, stride_kb_n, am_ptr,
        stride_am_q, stride_am_k, offs_m, offs_n, da_in, db_in, lse2_a[:, None], lse2_b[:, None], kl, g, dq_a, dq_b, qk_scale_a, qk_scale_b,
        cap_scale_a, cap_scale_b, n_q, n_k, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT, False, HAS_KEY_MASK, BANDED, HAS_ATTN_MASK,
        NEED_A, NEED_B, SOFTCAP_A, SOFTCAP_B, FP16_A, FP16_B, DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE,
    )
    dq_a, dq_b = _attention_kl_bwd_dq_keys(
        c_full, hi, q_a, q_b, ka_ptrs, kb_ptrs, km_ptr, stride_km_n, stride_ka_n, stride_kb_n, am_ptr,
        stride_am_q, stride_am_k, offs_m, offs_n,
        da_in, db_in, lse2_a[:, None], lse2_b[:, None], kl, g, dq_a, dq_b, qk_scale_a, qk_scale_b,
        cap_scale_a, cap_scale_b, n_q, n_k, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT, True, HAS_KEY_MASK, BANDED, HAS_ATTN_MASK,
        NEED_A, NEED_B, SOFTCAP_A, SOFTCAP_B, FP16_A, FP16_B, DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE,
    )
    out = rows.to(tl.int64)[:, None]
    # an excluded row's zero query met every key of the unmasked tiles, non-finite ones included: its dQ is 0
    if NEED_A:
        dq_a = tl.where(row_ok[:, None], dq_a * grad_scale_a, 0.0)
        tl.store(DQ_A + out * D_A + offs_da[None, :], dq_a.to(DQ_A.dtype.element_ty),
                 mask=row_in[:, None] & da_in[None, :])
    if NEED_B:
        dq_b = tl.where(row_ok[:, None], dq_b * grad_scale_b, 0.0)
        tl.store(DQ_B + out * D_B + offs_db[None, :], dq_b.to(DQ_B.dtype.element_ty),
                 mask=row_in[:, None] & db_in[None, :])


@triton.jit
def _attention_kl_bwd_dq_kernel(
    Q_A, K_A, Q_B, K_B,  # as in the dK kernel
    KEY_MASK,  # [B, N_K] uint8 or None
    CU_Q, CU_K,  # [S + 1] int32 packed-sequence offsets, or None
    GRAD, KL, LSE_A, LSE_B,  # [B, H, N_Q] fp32 contiguous (GRAD: one number if SCALAR_GRAD)
    DQ_A, DQ_B,  # [B, H, N_Q, D_*] contiguous, input dtype (None when not needed)
    ATTN_MASK,  # [B or 1, H or 1, N_Q, N_K] uint8 general mask (1 = allowed) or None
    stride_am_b, stride_am_h, stride_am_q, stride_am_k,
    stride_qa_b, stride_qa_h, stride_qa_n, stride_qa_d,
    stride_ka_b, stride_ka_h, stride_ka_n, stride_ka_d,
    stride_qb_b, stride_qb_h, stride_qb_n, stride_qb_d,
    stride_kb_b, stride_kb_h, stride_kb_n, stride_kb_d,
    stride_km_b, stride_km_n,
    H, N_Q, N_K,
    GROUP_A, GROUP_B,
    qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, grad_scale_a, grad_scale_b,
    left, right,
    order_chunk,  # (sequence, head) pairs per longest-first chunk (LONGEST_FIRST, see _longest_first)
    D_A: tl.constexpr, D_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KEY_MASK: tl.constexpr, BANDED: tl.constexpr,
    HAS_ATTN_MASK: tl.constexpr, IS_VARLEN: tl.constexpr, NEED_A: tl.constexpr, NEED_B: tl.constexpr,
    SOFTCAP_A: tl.constexpr, SOFTCAP_B: tl.constexpr, FP16_A: tl.constexpr, FP16_B: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
    SCALAR_GRAD: tl.constexpr, LONGEST_FIRST: tl.constexpr,
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
    row_base = (b64 * H + h64) * N_Q + q_start
    if HAS_ATTN_MASK:
        am_ptr = ATTN_MASK + b64 * stride_am_b + h64 * stride_am_h
    else:
        am_ptr = ATTN_MASK

    if IS_VARLEN:  # grid-stride: a packed sequence longer than the grid's max_seqlen_q is still covered
        for m_start in range(pid_m * BLOCK_M, n_q, tl.num_programs(0) * BLOCK_M):
            _attention_kl_bwd_dq_rows(
                m_start,
                qa_base, qb_base, ka_ptrs, kb_ptrs, km_ptr, am_ptr, stride_am_q, stride_am_k, GRAD, KL, LSE_A,
                LSE_B, DQ_A, DQ_B,
                stride_qa_n, stride_qb_n, stride_ka_n, stride_kb_n, stride_km_n, q_start, n_q, n_k, row_base, offs_n,
                offs_da, offs_db, da_in, db_in, qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, grad_scale_a,
                grad_scale_b, left, right, D_A, D_B, BLOCK_M, BLOCK_N, BLOCK_DA, BLOCK_DB, HAS_LEFT, HAS_RIGHT, HAS_KEY_MASK,
                BANDED, HAS_ATTN_MASK, NEED_A,
                NEED_B, SOFTCAP_A, SOFTCAP_B, FP16_A, FP16_B, DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE, SCALAR_GRAD,
            )
    else:
        _attention_kl_bwd_dq_rows(
            pid_m * BLOCK_M,
            qa_base, qb_base, ka_ptrs, kb_ptrs, km_ptr, am_ptr, stride_am_q, stride_am_k, GRAD, KL, LSE_A,
                LSE_B, DQ_A, DQ_B,
            stride_qa_n, stride_qb_n, stride_ka_n, stride_kb_n, stride_km_n, q_start, n_q, n_k, row_base, offs_n,
            offs_da, offs_db, da_in, db_in, qk_scale_a, qk_scale_b, cap_scale_a, cap_scale_b, grad_scale_a,
            grad_scale_b, left, right, D_A, D_B, BLOCK_M, BLOCK_N, BLOCK_DA, BLOCK_DB, HAS_LEFT, HAS_RIGHT, HAS_KEY_MASK,
            BANDED, HAS_ATTN_MASK, NEED_A,
            NEED_B, SOFTCAP_A, SOFTCAP_B, FP16_A, FP16_B, DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE, SCALAR_GRAD,
        )


@functools.lru_cache(maxsize=512)
def _backward_plan(geometry: tuple, dtypes: tuple, spec: KLSpec, flags: tuple, sequences: int, allow_tf32: bool,
                   dk_launch: LaunchConfig | None, dq_launch: LaunchConfig | None, l2_bytes: int = 50 << 20):
    """Everything of one backward that depends only on shapes, strides, dtypes and options: the two grids, the
    scalar arguments and the constexprs of each pass. Computed once per problem geometry.

    With a right window bound (causal) and without packing, both grids are one-dimensional and run their longest
    tiles first (``LONGEST_FIRST``, as the forward: :func:`streamkl._triton.forward._forward_plan`), in chunks whose
    queries (key pass) or keys (query pass) fit in half of ``l2_bytes``."""
    qa_g, ka_g, qb_g, kb_g, km_g, am_g = geometry
    need_grad_a, need_grad_b, deterministic, has_query_mask, varlen, scalar_grad = flags
    (_, heads, n_q, d_a), d_b = qa_g[0], qb_g[0][-1]
    h_ka, n_k = ka_g[0][1], ka_g[0][2]
    h_kb = kb_g[0][1]
    dtype_a, dtype_b = dtypes
    esize = max(dtype_a.itemsize, dtype_b.itemsize)
    atomic = not deterministic
    masked = spec.banded or am_g is not None
    cfg = dk_launch or dk_config(d_a, d_b, masked, esize, atomic_dq=atomic)
    cfg_q = dq_launch or dq_config(d_a, d_b, masked, esize)
    km_strides = km_g[1] if km_g is not None else (0, 0)
    h_kg = h_kb if need_grad_b else h_ka
    dk_a_per_head = need_grad_a and h_ka != h_kg
    (qk_a, cap_a), (qk_b, cap_b) = side_scales(spec.scale_a, spec.softcap_a), side_scales(spec.scale_b, spec.softcap_b)
    scalars = (*broadcast_strides(am_g), *qa_g[1], *ka_g[1], *qb_g[1], *kb_g[1], *km_strides, heads, n_q, n_k,
               heads // h_ka, heads // h_kb)
    scales = (qk_a, qk_b, cap_a, cap_b, spec.grad_scale("a"), spec.grad_scale("b"), spec.window_left,
              spec.window_right)
    common = dict(
        D_A=d_a, D_B=d_b, BLOCK_DA=padded_head_dim(d_a), BLOCK_DB=padded_head_dim(d_b),
        HAS_LEFT=spec.window_left >= 0, HAS_RIGHT=spec.window_right >= 0, HAS_KEY_MASK=km_g is not None,
        HAS_ATTN_MASK=am_g is not None, IS_VARLEN=varlen, NEED_A=need_grad_a, NEED_B=need_grad_b,
        SOFTCAP_A=bool(spec.softcap_a), SOFTCAP_B=bool(spec.softcap_b),
        FP16_A=dtype_a == torch.float16, FP16_B=dtype_b == torch.float16,
        DOT_PRECISION_A=dot_precision(dtype_a, allow_tf32), DOT_PRECISION_B=dot_precision(dtype_b, allow_tf32),
        INTERPRET=triton_interpreter_enabled(), WIDE=wide_offsets(qa_g, ka_g, qb_g, kb_g), SCALAR_GRAD=scalar_grad,
        LONGEST_FIRST=spec.window_right >= 0 and not varlen,
    )
    max_k = spec.max_seqlen_k if varlen else n_k
    max_q = spec.max_seqlen_q if varlen else n_q
    dk_grid = (max(triton.cdiv(max_k, cfg.block_n), 1), sequences * h_kg)
    dk_meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DK_A_PER_HEAD=dk_a_per_head, ATOMIC_DQ=atomic,
                   HAS_QUERY_MASK=has_query_mask, **common, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    dq_grid = (max(triton.cdiv(max_q, cfg_q.block_m), 1), sequences * heads)
    dq_meta = dict(BLOCK_M=cfg_q.block_m, BLOCK_N=cfg_q.block_n, BANDED=spec.banded, **common,
                   num_warps=cfg_q.num_warps, num_stages=cfg_q.num_stages)
    chunk_k = chunk_q = 1
    if common["LONGEST_FIRST"]:
        dk_grid, dq_grid = (dk_grid[0] * dk_grid[1], 1), (dq_grid[0] * dq_grid[1], 1)
        query_bytes = heads // h_kg * n_q * (d_a * dtype_a.itemsize + d_b * dtype_b.itemsize)
        key_bytes = key_bytes_per_head(n_k, heads, (d_a, dtype_a, h_ka), (d_b, dtype_b, h_kb))
        chunk_k = longest_first_chunk(query_bytes, l2_bytes, sequences * h_kg)
        chunk_q = longest_first_chunk(key_bytes, l2_bytes, sequences * heads)
    return (dk_grid, (*scalars, h_kg, *scales, chunk_k), tuple(dk_meta.items()), dq_grid, (*scalars, *scales, chunk_q),
            tuple(dq_meta.items()), dk_a_per_head)


_launch_dk = KernelLauncher(_attention_kl_bwd_dk_kernel)
_launch_dq = KernelLauncher(_attention_kl_bwd_dq_kernel)


def attention_kl_bwd(
    grad_kl: torch.Tensor,
    inputs: KLInputs,
    spec: KLSpec,
    kl: torch.Tensor,
    lse_a: torch.Tensor,
    lse_b: torch.Tensor,
    need_grad_a: bool,
    need_grad_b: bool,
    allow_tf32: bool = False,
    deterministic: bool = True,
    dk_launch: LaunchConfig | None = None,
    dq_launch: LaunchConfig | None = None,
    dq_b: torch.Tensor | None = None,
    key_pass: Callable | None = None,
    grad_b_dtype: torch.dtype | None = None,
    dq_b_final: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward; returns ``(dq_a, dk_a, dq_b, dk_b)`` in the input dtypes (None if not needed), side b's in
    ``grad_b_dtype`` when given (only with ``dq_b``: a key pass of side b alone).

    ``dk_launch``/``dq_launch`` override the tile heuristic of each pass (used by the tuning script). ``dq_b`` is
    the query gradient per unit upstream gradient that the forward accumulated (``attention_kl_fwd(dq_b=...)``,
    only with ``need_grad_a=False``): then only the key pass runs (no atomics, deterministic) and side b's query
    gradient is that buffer times the upstream gradient (``dq_b_final``: the buffer as it is, in ``grad_b_dtype``, the
    forward having scaled it by the upstream gradient already). ``key_pass``, a function of ``(grad_kl, inputs, spec, lse_a,
    lse_b)`` returning side b's key gradient (a Hopper key pass, chosen by :mod:`streamkl.dispatch`; only with
    ``need_grad_a=False`` and no atomic query gradient), replaces the portable key pass.
    """
    if dq_b is not None and need_grad_a:
        raise ValueError("Expected `need_grad_a=False` with a forward-accumulated `dq_b`, but got need_grad_a=True.")
    if (grad_b_dtype is not None or dq_b_final) and dq_b is None:
        raise ValueError("Expected `grad_b_dtype` and `dq_b_final` only with a forward-accumulated `dq_b`, but got "
                         "dq_b=None.")
    q_a, k_a, q_b, k_b = inputs.q_a, inputs.k_a, inputs.q_b, inputs.k_b
    grad_b_dtype = grad_b_dtype or q_b.dtype
    if not (need_grad_a or need_grad_b):
        return None, None, None, None
    batch, heads, n_q, _ = q_a.shape
    n_k = k_a.shape[2]
    device = q_a.device
    cu_q = inputs.cu_seqlens_q
    varlen = cu_q is not None
    if batch * heads * n_q * n_k == 0:
        def zeros(x, need, dtype=None):
            return torch.zeros_like(x, dtype=dtype, memory_format=torch.contiguous_format) if need else None
        return (zeros(q_a, need_grad_a), zeros(k_a, need_grad_a), zeros(q_b, need_grad_b, grad_b_dtype),
                zeros(k_b, need_grad_b, grad_b_dtype))

    # the upstream gradient of reduction="mean"/"sum" is one number expanded over every row (stride 0): the
    # kernels read that number in place instead of a copied [B, H, N_Q] tensor
    scalar_grad = not any(grad_kl.stride())
    if scalar_grad:
        grad_kl = grad_kl.as_strided((1,), (1,))
    if grad_kl.dtype != torch.float32:
        grad_kl = grad_kl.to(torch.float32)
    if not scalar_grad:
        grad_kl = grad_kl.contiguous()
    km = as_uint8_mask(inputs.key_padding_mask)
    am = None if inputs.attn_mask is None else inputs.attn_mask.view(torch.uint8)
    geometry = tensor_geometry(q_a, k_a, q_b, k_b, km, am)
    fused = dq_b is not None
    deterministic = deterministic or fused  # the key pass alone needs no atomics
    flags = (need_grad_a, need_grad_b, deterministic, inputs.query_mask is not None, varlen, scalar_grad)
    sequences = cu_q.shape[0] - 1 if varlen else batch
    dk_grid, dk_scalars, dk_meta, dq_grid, dq_scalars, dq_meta, dk_a_per_head = _backward_plan(
        geometry, (q_a.dtype, q_b.dtype), spec, flags, sequences, allow_tf32, dk_launch, dq_launch,
        l2_cache_bytes(q_a.device.index if q_a.is_cuda else -1))
    atomic = not deterministic
    # packed tokens outside every sequence (none when the offsets are valid) get zero gradients
    alloc = torch.zeros if varlen else torch.empty

    def dk_buffer(k, need, per_head, dtype):
        if not need:
            return None
        if per_head:
            return alloc((batch, heads, n_k, k.shape[-1]), dtype=torch.float32, device=device)
        return alloc(k.shape, dtype=dtype, device=device)

    cu_k = inputs.cu_seqlens_k
    if key_pass is not None and (need_grad_a or atomic):
        raise ValueError("Expected `key_pass` only for side b's key gradient alone, with no atomic query gradient.")
    if key_pass is not None:
        dk_a, dk_b = None, key_pass(grad_kl, inputs, spec, lse_a, lse_b, dk_dtype=grad_b_dtype)
    else:
        dk_a = dk_buffer(k_a, need_grad_a, dk_a_per_head, k_a.dtype)
        dk_b = dk_buffer(k_b, need_grad_b, False, grad_b_dtype)
        dq_acc_a = torch.zeros(q_a.shape, dtype=torch.float32, device=device) if need_grad_a and atomic else None
        dq_acc_b = torch.zeros(q_b.shape, dtype=torch.float32, device=device) if need_grad_b and atomic else None
        _launch_dk(dk_grid, (q_a, k_a, q_b, k_b, km, cu_q, cu_k, grad_kl, kl, lse_a, lse_b, dk_a, dk_b, dq_acc_a,
                             dq_acc_b, am), dk_scalars, dk_meta)
    if fused:  # the forward's dQ_b, times the upstream gradient (a scalar or one per row) in one elementwise kernel
        dq_a = None
        if dq_b_final:
            dq_b = dq_b.to(grad_b_dtype)
        else:
            g = grad_kl if scalar_grad else grad_kl.unsqueeze(-1)
            dq_b = torch.mul(dq_b, g, out=torch.empty_like(dq_b, dtype=grad_b_dtype))  # never in place: retain_graph
    elif atomic:
        dq_a = dq_acc_a.to(q_a.dtype) if need_grad_a else None
        dq_b = dq_acc_b.to(q_b.dtype) if need_grad_b else None
    else:
        dq_a = alloc(q_a.shape, dtype=q_a.dtype, device=device) if need_grad_a else None
        dq_b = alloc(q_b.shape, dtype=q_b.dtype, device=device) if need_grad_b else None
        _launch_dq(dq_grid, (q_a, k_a, q_b, k_b, km, cu_q, cu_k, grad_kl, kl, lse_a, lse_b, dq_a, dq_b, am),
                   dq_scalars, dq_meta)
    if dk_a_per_head:
        h_ka, d_a = k_a.shape[1], q_a.shape[-1]
        dk_a = dk_a.view(batch, h_ka, heads // h_ka, n_k, d_a).sum(2).to(k_a.dtype)
    return dq_a, dk_a, dq_b, dk_b
