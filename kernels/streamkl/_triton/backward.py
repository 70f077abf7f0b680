"""Fused attention-KL backward: recompute both probability tiles from the saved log-sum-exps.

With base-2 scores ``x·c_a``, ``y·c_b`` (``c = scale·log2 e``), the saved ``lse`` (nats) and per-row
upstream gradient ``g``, each tile forms

* ``P_a = exp2(x·c_a − lse_a·log2 e)``, ``P_b`` likewise (exactly 0 on masked keys and empty rows);
* ``dS_b = g (P_b − P_a)`` and ``dS_a = g P_a [(x_nat − lse_a) − (y_nat − lse_b) − KL]``;
* ``dQ = dS·K·scale``, ``dK = dSᵀ·Q·scale``.

Two passes share that tile math:

* ``_attention_kl_bwd_dk_kernel`` is key-stationary: one program per (key tile, batch, key head) loops
  over the query heads that share the key head and over all query tiles, so ``dK`` stays in registers
  with no atomics. With ``ATOMIC_DQ`` it also adds each tile's ``dQ`` into an fp32 buffer with atomic
  adds (4 products + 2 exponentials per score element: the fast default; the summation order of ``dQ``
  then varies between runs in the last bits).
* ``_attention_kl_bwd_dq_kernel`` is query-stationary and computes ``dQ`` with no atomics; it runs
  instead of the atomics when ``deterministic=True`` (6 products + 4 exponentials per element).

When both sides need gradients and they group their key heads differently (e.g. a GQA teacher and an
MHA student), the second side's ``dK`` is written per query head to an fp32 buffer and summed over the
group afterwards (``O(H·N_k·D)`` extra memory, never ``O(N²)``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._constants import LOG2E
from ._helpers import _allowed_keys, _dot, _offset, as_uint8_mask, dot_precision, needs_wide_offsets
from .configs import LaunchConfig, dk_config, dq_config, interpreting, padded_head_dim


@triton.jit
def _attention_kl_bwd_ds(
    x, y,  # raw products q_a·k_a and q_b·k_b of one tile (fp32), [BLOCK_M, BLOCK_N] or transposed
    allowed,  # bool mask broadcastable to the tile, or None when every key of the tile is allowed
    lse2_a, lse2_b,  # log-sum-exps in base 2 (+inf on empty rows), broadcastable to the tile
    kl, g,  # per-row KL (nats) and upstream gradient, broadcastable to the tile
    qk_scale_a, qk_scale_b,
    NEED_A: tl.constexpr, MASKED: tl.constexpr,
):
    """``(dS_a, dS_b)`` of one tile; ``dS_a`` is only formed when ``NEED_A`` (else ``dS_b`` is returned twice)."""
    xs = x * qk_scale_a
    ys = y * qk_scale_b
    p_a = tl.exp2(xs - lse2_a)
    p_b = tl.exp2(ys - lse2_b)
    if MASKED:
        p_a = tl.where(allowed, p_a, 0.0)
        p_b = tl.where(allowed, p_b, 0.0)
    ds_b = g * (p_b - p_a)
    if NEED_A:
        la = tl.where(lse2_a == float("inf"), 0.0, lse2_a)  # finite stand-ins: P_a is already 0 there
        lb = tl.where(lse2_b == float("inf"), 0.0, lse2_b)
        log_ratio = ((xs - la) - (ys - lb)) * 0.6931471805599453
        ds_a = (g * p_a) * (log_ratio - kl)
    else:
        ds_a = ds_b
    return ds_a, ds_b


@triton.jit
def _attention_kl_bwd_dk_tile(
    k_a, k_b,  # [BLOCK_N, BLOCK_DA], [BLOCK_N, BLOCK_DB] key tiles of this program (input dtype)
    qa_ptrs, qb_ptrs,  # [BLOCK_DA, BLOCK_M], [BLOCK_DB, BLOCK_M] transposed query pointers at row 0
    row_ptr,  # offset of (b, h, row 0) into the [B, H, N_Q] row-state arrays
    GRAD, KL, LSE_A, LSE_B,
    dqa_ptrs, dqb_ptrs,  # [BLOCK_M, BLOCK_D*] fp32 dQ accumulator pointers of the current head at row 0
    km_ptr, stride_km_n,
    m0, offs_m_base, keys, offs_da, offs_db,
    stride_qa_n, stride_qb_n,
    dk_a, dk_b,  # [BLOCK_N, BLOCK_D*] fp32 accumulators
    qk_scale_a, qk_scale_b, scale_a, scale_b,
    N_Q, N_K,
    D_A: tl.constexpr, D_B: tl.constexpr,
    IS_CAUSAL: tl.constexpr, CHECK_BOUNDS: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    NEED_A: tl.constexpr, NEED_B: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
):
    """One query tile against this program's key tile, computed transposed ([keys, queries])."""
    offs_m = m0 + offs_m_base
    row_in = offs_m < N_Q
    qt_a = tl.load(qa_ptrs + _offset(m0, stride_qa_n, WIDE), mask=row_in[None, :] & (offs_da < D_A)[:, None], other=0.0)
    qt_b = tl.load(qb_ptrs + _offset(m0, stride_qb_n, WIDE), mask=row_in[None, :] & (offs_db < D_B)[:, None], other=0.0)
    rows = row_ptr + offs_m
    lse2_a = tl.load(LSE_A + rows, mask=row_in, other=float("inf")) * 1.4426950408889634
    lse2_b = tl.load(LSE_B + rows, mask=row_in, other=float("inf")) * 1.4426950408889634
    g = tl.load(GRAD + rows, mask=row_in, other=0.0)
    if NEED_A:
        kl = tl.load(KL + rows, mask=row_in, other=0.0)[None, :]
    else:
        kl = g[None, :]
    xt = _dot(k_a, qt_a, DOT_PRECISION_A, INTERPRET)  # [BLOCK_N, BLOCK_M]
    yt = _dot(k_b, qt_b, DOT_PRECISION_B, INTERPRET)
    if CHECK_BOUNDS or HAS_KEY_MASK:
        allowed = _allowed_keys(offs_m[None, :], keys[:, None], km_ptr, stride_km_n, N_Q, N_K,
                                IS_CAUSAL, CHECK_BOUNDS, HAS_KEY_MASK)
    else:
        allowed = None
    dst_a, dst_b = _attention_kl_bwd_ds(xt, yt, allowed, lse2_a[None, :], lse2_b[None, :], kl, g[None, :],
                                        qk_scale_a, qk_scale_b, NEED_A, CHECK_BOUNDS or HAS_KEY_MASK)
    if NEED_B:
        ds = dst_b.to(qt_b.dtype)
        dk_b += _dot(ds, tl.trans(qt_b), DOT_PRECISION_B, INTERPRET)
        if ATOMIC_DQ:
            dq = _dot(tl.trans(ds), k_b, DOT_PRECISION_B, INTERPRET) * scale_b
            tl.atomic_add(dqb_ptrs + _offset(m0, D_B, WIDE), dq, mask=row_in[:, None] & (offs_db < D_B)[None, :], sem="relaxed")
    if NEED_A:
        ds = dst_a.to(qt_a.dtype)
        dk_a += _dot(ds, tl.trans(qt_a), DOT_PRECISION_A, INTERPRET)
        if ATOMIC_DQ:
            dq = _dot(tl.trans(ds), k_a, DOT_PRECISION_A, INTERPRET) * scale_a
            tl.atomic_add(dqa_ptrs + _offset(m0, D_A, WIDE), dq, mask=row_in[:, None] & (offs_da < D_A)[None, :], sem="relaxed")
    return dk_a, dk_b


@triton.jit
def _attention_kl_bwd_dk_kernel(
    Q_A, K_A, Q_B, K_B,  # [B, H, N_Q, D_A], [B, H_KA, N_K, D_A], [B, H, N_Q, D_B], [B, H_KB, N_K, D_B]; any strides
    KEY_MASK,  # [B, N_K] uint8 or None
    GRAD, KL, LSE_A, LSE_B,  # [B, H, N_Q] fp32 contiguous: upstream gradient, saved KL and lse (nats)
    DK_A, DK_B,  # [B, H_KA, N_K, D_A] / [B, H_KB, N_K, D_B] contiguous, or [B, H, N_K, D] fp32 when *_PER_HEAD
    DQ_A, DQ_B,  # [B, H, N_Q, D_*] fp32 contiguous accumulators (ATOMIC_DQ), else None
    stride_qa_b, stride_qa_h, stride_qa_n, stride_qa_d,
    stride_ka_b, stride_ka_h, stride_ka_n, stride_ka_d,
    stride_qb_b, stride_qb_h, stride_qb_n, stride_qb_d,
    stride_kb_b, stride_kb_h, stride_kb_n, stride_kb_d,
    stride_km_b, stride_km_n,
    H, N_Q, N_K,
    GROUP_A, GROUP_B,  # H // H_KA, H // H_KB
    H_KG,  # key heads of the grouping side: one program per (key tile, batch, grouping key head)
    qk_scale_a, qk_scale_b, scale_a, scale_b,
    D_A: tl.constexpr, D_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    NEED_A: tl.constexpr, NEED_B: tl.constexpr, DK_A_PER_HEAD: tl.constexpr, DK_B_PER_HEAD: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // H_KG).to(tl.int64)
    hg = pid_bg % H_KG
    heads_per_group = H // H_KG

    n0 = pid_n * BLOCK_N
    keys = n0 + tl.arange(0, BLOCK_N)
    keys64 = keys.to(tl.int64)
    key_in = keys < N_K
    offs_m_base = tl.arange(0, BLOCK_M)
    rows64 = offs_m_base.to(tl.int64)
    offs_da = tl.arange(0, BLOCK_DA)
    offs_db = tl.arange(0, BLOCK_DB)
    if HAS_KEY_MASK:
        km_ptr = KEY_MASK + b * stride_km_b
    else:
        km_ptr = KEY_MASK

    # Query tiles before m_begin cannot see this key tile (causal); tiles in [m_begin, m_full) straddle
    # the causal band (or the tile has keys past N_K) and need bounds masking; the rest need none.
    if IS_CAUSAL:
        m_begin = (tl.maximum(n0 - (N_K - N_Q), 0) // BLOCK_M) * BLOCK_M
        m_full = tl.minimum(tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - (N_K - N_Q), 0), BLOCK_M) * BLOCK_M, N_Q)
        m_full = tl.maximum(m_full, m_begin)
    else:
        m_begin = 0
        m_full = 0
    m_full = tl.where(n0 + BLOCK_N > N_K, N_Q, m_full)

    dk_a = tl.zeros((BLOCK_N, BLOCK_DA), tl.float32)
    dk_b = tl.zeros((BLOCK_N, BLOCK_DB), tl.float32)
    for hh in range(0, heads_per_group):
        h = hg * heads_per_group + hh
        h64 = h.to(tl.int64)
        hk_a = (h // GROUP_A).to(tl.int64)
        hk_b = (h // GROUP_B).to(tl.int64)
        ka_ptrs = K_A + b * stride_ka_b + hk_a * stride_ka_h + keys64[:, None] * stride_ka_n + offs_da[None, :] * stride_ka_d
        kb_ptrs = K_B + b * stride_kb_b + hk_b * stride_kb_h + keys64[:, None] * stride_kb_n + offs_db[None, :] * stride_kb_d
        k_a = tl.load(ka_ptrs, mask=key_in[:, None] & (offs_da < D_A)[None, :], other=0.0)
        k_b = tl.load(kb_ptrs, mask=key_in[:, None] & (offs_db < D_B)[None, :], other=0.0)
        qa_ptrs = Q_A + b * stride_qa_b + h64 * stride_qa_h + rows64[None, :] * stride_qa_n + offs_da[:, None] * stride_qa_d
        qb_ptrs = Q_B + b * stride_qb_b + h64 * stride_qb_h + rows64[None, :] * stride_qb_n + offs_db[:, None] * stride_qb_d
        row_ptr = (b * H + h64) * N_Q
        if ATOMIC_DQ and NEED_A:
            dqa_ptrs = DQ_A + (row_ptr + rows64[:, None]) * D_A + offs_da[None, :]
        else:
            dqa_ptrs = DQ_A
        if ATOMIC_DQ and NEED_B:
            dqb_ptrs = DQ_B + (row_ptr + rows64[:, None]) * D_B + offs_db[None, :]
        else:
            dqb_ptrs = DQ_B
        for m0 in range(m_begin, m_full, BLOCK_M):
            dk_a, dk_b = _attention_kl_bwd_dk_tile(
                k_a, k_b, qa_ptrs, qb_ptrs, row_ptr, GRAD, KL, LSE_A, LSE_B, dqa_ptrs, dqb_ptrs,
                km_ptr, stride_km_n, m0, offs_m_base, keys, offs_da, offs_db, stride_qa_n, stride_qb_n,
                dk_a, dk_b, qk_scale_a, qk_scale_b, scale_a, scale_b, N_Q, N_K, D_A, D_B,
                IS_CAUSAL, True, HAS_KEY_MASK, NEED_A, NEED_B, ATOMIC_DQ,
                DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE,
            )
        # Programs start at different query tiles (staggered by key tile) so that their atomic dQ
        # updates do not all hit the same rows at the same time.
        num_full = tl.cdiv(N_Q - m_full, BLOCK_M)
        for i in range(0, num_full):
            m0 = m_full + ((i + pid_n) % num_full) * BLOCK_M
            dk_a, dk_b = _attention_kl_bwd_dk_tile(
                k_a, k_b, qa_ptrs, qb_ptrs, row_ptr, GRAD, KL, LSE_A, LSE_B, dqa_ptrs, dqb_ptrs,
                km_ptr, stride_km_n, m0, offs_m_base, keys, offs_da, offs_db, stride_qa_n, stride_qb_n,
                dk_a, dk_b, qk_scale_a, qk_scale_b, scale_a, scale_b, N_Q, N_K, D_A, D_B,
                IS_CAUSAL, False, HAS_KEY_MASK, NEED_A, NEED_B, ATOMIC_DQ,
                DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE,
            )
        # a side whose key heads are grouped differently writes its dK per query head
        if NEED_A and DK_A_PER_HEAD:
            ptrs = DK_A + ((b * H + h64) * N_K + keys64[:, None]) * D_A + offs_da[None, :]
            tl.store(ptrs, dk_a * scale_a, mask=key_in[:, None] & (offs_da < D_A)[None, :])
            dk_a = tl.zeros((BLOCK_N, BLOCK_DA), tl.float32)
        if NEED_B and DK_B_PER_HEAD:
            ptrs = DK_B + ((b * H + h64) * N_K + keys64[:, None]) * D_B + offs_db[None, :]
            tl.store(ptrs, dk_b * scale_b, mask=key_in[:, None] & (offs_db < D_B)[None, :])
            dk_b = tl.zeros((BLOCK_N, BLOCK_DB), tl.float32)

    hg64 = hg.to(tl.int64)
    if NEED_A and not DK_A_PER_HEAD:
        ptrs = DK_A + ((b * H_KG + hg64) * N_K + keys64[:, None]) * D_A + offs_da[None, :]
        tl.store(ptrs, (dk_a * scale_a).to(DK_A.dtype.element_ty), mask=key_in[:, None] & (offs_da < D_A)[None, :])
    if NEED_B and not DK_B_PER_HEAD:
        ptrs = DK_B + ((b * H_KG + hg64) * N_K + keys64[:, None]) * D_B + offs_db[None, :]
        tl.store(ptrs, (dk_b * scale_b).to(DK_B.dtype.element_ty), mask=key_in[:, None] & (offs_db < D_B)[None, :])


@triton.jit
def _attention_kl_bwd_dq_tile(
    q_a, q_b,  # [BLOCK_M, BLOCK_D*] query tiles (input dtype)
    ka_ptrs, kb_ptrs,  # [BLOCK_D*, BLOCK_N] transposed key pointers at key 0
    km_ptr, stride_km_n,
    n0, offs_m, offs_n, offs_da, offs_db, stride_ka_n, stride_kb_n,
    lse2_a, lse2_b, kl, g,  # [BLOCK_M, 1] row state
    dq_a, dq_b,  # [BLOCK_M, BLOCK_D*] fp32 accumulators
    qk_scale_a, qk_scale_b,
    N_Q, N_K,
    D_A: tl.constexpr, D_B: tl.constexpr,
    IS_CAUSAL: tl.constexpr, CHECK_BOUNDS: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    NEED_A: tl.constexpr, NEED_B: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
):
    keys = n0 + offs_n
    key_in = keys < N_K
    kt_a = tl.load(ka_ptrs + _offset(n0, stride_ka_n, WIDE), mask=key_in[None, :] & (offs_da < D_A)[:, None], other=0.0)
    kt_b = tl.load(kb_ptrs + _offset(n0, stride_kb_n, WIDE), mask=key_in[None, :] & (offs_db < D_B)[:, None], other=0.0)
    x = _dot(q_a, kt_a, DOT_PRECISION_A, INTERPRET)
    y = _dot(q_b, kt_b, DOT_PRECISION_B, INTERPRET)
    if CHECK_BOUNDS or HAS_KEY_MASK:
        allowed = _allowed_keys(offs_m[:, None], keys[None, :], km_ptr, stride_km_n, N_Q, N_K,
                                IS_CAUSAL, CHECK_BOUNDS, HAS_KEY_MASK)
    else:
        allowed = None
    ds_a, ds_b = _attention_kl_bwd_ds(x, y, allowed, lse2_a, lse2_b, kl, g, qk_scale_a, qk_scale_b,
                                      NEED_A, CHECK_BOUNDS or HAS_KEY_MASK)
    if NEED_A:
        dq_a += _dot(ds_a.to(kt_a.dtype), tl.trans(kt_a), DOT_PRECISION_A, INTERPRET)
    if NEED_B:
        dq_b += _dot(ds_b.to(kt_b.dtype), tl.trans(kt_b), DOT_PRECISION_B, INTERPRET)
    return dq_a, dq_b


@triton.jit
def _attention_kl_bwd_dq_kernel(
    Q_A, K_A, Q_B, K_B,  # as in the dK kernel
    KEY_MASK,  # [B, N_K] uint8 or None
    GRAD, KL, LSE_A, LSE_B,  # [B, H, N_Q] fp32 contiguous
    DQ_A, DQ_B,  # [B, H, N_Q, D_*] contiguous, input dtype (None when not needed)
    stride_qa_b, stride_qa_h, stride_qa_n, stride_qa_d,
    stride_ka_b, stride_ka_h, stride_ka_n, stride_ka_d,
    stride_qb_b, stride_qb_h, stride_qb_n, stride_qb_d,
    stride_kb_b, stride_kb_h, stride_kb_n, stride_kb_d,
    stride_km_b, stride_km_n,
    H, N_Q, N_K,
    GROUP_A, GROUP_B,
    qk_scale_a, qk_scale_b, scale_a, scale_b,
    D_A: tl.constexpr, D_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr, NEED_A: tl.constexpr, NEED_B: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    h64 = h.to(tl.int64)
    hk_a = (h // GROUP_A).to(tl.int64)
    hk_b = (h // GROUP_B).to(tl.int64)
    m_start = pid_m * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_da = tl.arange(0, BLOCK_DA)
    offs_db = tl.arange(0, BLOCK_DB)
    row_in = offs_m < N_Q
    rows64 = offs_m.to(tl.int64)
    keys64 = offs_n.to(tl.int64)

    qa_ptrs = Q_A + b * stride_qa_b + h64 * stride_qa_h + rows64[:, None] * stride_qa_n + offs_da[None, :] * stride_qa_d
    qb_ptrs = Q_B + b * stride_qb_b + h64 * stride_qb_h + rows64[:, None] * stride_qb_n + offs_db[None, :] * stride_qb_d
    q_a = tl.load(qa_ptrs, mask=row_in[:, None] & (offs_da < D_A)[None, :], other=0.0)
    q_b = tl.load(qb_ptrs, mask=row_in[:, None] & (offs_db < D_B)[None, :], other=0.0)
    ka_ptrs = K_A + b * stride_ka_b + hk_a * stride_ka_h + keys64[None, :] * stride_ka_n + offs_da[:, None] * stride_ka_d
    kb_ptrs = K_B + b * stride_kb_b + hk_b * stride_kb_h + keys64[None, :] * stride_kb_n + offs_db[:, None] * stride_kb_d
    if HAS_KEY_MASK:
        km_ptr = KEY_MASK + b * stride_km_b
    else:
        km_ptr = KEY_MASK
    row_ptr = (b * H + h64) * N_Q
    lse2_a = (tl.load(LSE_A + row_ptr + offs_m, mask=row_in, other=float("inf")) * 1.4426950408889634)[:, None]
    lse2_b = (tl.load(LSE_B + row_ptr + offs_m, mask=row_in, other=float("inf")) * 1.4426950408889634)[:, None]
    kl = tl.load(KL + row_ptr + offs_m, mask=row_in, other=0.0)[:, None]
    g = tl.load(GRAD + row_ptr + offs_m, mask=row_in, other=0.0)[:, None]

    dq_a = tl.zeros((BLOCK_M, BLOCK_DA), tl.float32)
    dq_b = tl.zeros((BLOCK_M, BLOCK_DB), tl.float32)
    full_end = (N_K // BLOCK_N) * BLOCK_N
    hi = N_K
    if IS_CAUSAL:
        first_row_limit = tl.maximum(m_start + (N_K - N_Q) + 1, 0)
        full_end = tl.minimum((first_row_limit // BLOCK_N) * BLOCK_N, full_end)
        hi = tl.maximum(tl.minimum(N_K, m_start + BLOCK_M + (N_K - N_Q)), 0)
    for n0 in range(0, full_end, BLOCK_N):
        dq_a, dq_b = _attention_kl_bwd_dq_tile(
            q_a, q_b, ka_ptrs, kb_ptrs, km_ptr, stride_km_n, n0, offs_m, offs_n, offs_da, offs_db,
            stride_ka_n, stride_kb_n, lse2_a, lse2_b, kl, g, dq_a, dq_b, qk_scale_a, qk_scale_b, N_Q, N_K,
            D_A, D_B, IS_CAUSAL, False, HAS_KEY_MASK, NEED_A, NEED_B, DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE,
        )
    for n0 in range(full_end, hi, BLOCK_N):
        dq_a, dq_b = _attention_kl_bwd_dq_tile(
            q_a, q_b, ka_ptrs, kb_ptrs, km_ptr, stride_km_n, n0, offs_m, offs_n, offs_da, offs_db,
            stride_ka_n, stride_kb_n, lse2_a, lse2_b, kl, g, dq_a, dq_b, qk_scale_a, qk_scale_b, N_Q, N_K,
            D_A, D_B, IS_CAUSAL, True, HAS_KEY_MASK, NEED_A, NEED_B, DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE,
        )
    if NEED_A:
        ptrs = DQ_A + (row_ptr + rows64[:, None]) * D_A + offs_da[None, :]
        tl.store(ptrs, (dq_a * scale_a).to(DQ_A.dtype.element_ty), mask=row_in[:, None] & (offs_da < D_A)[None, :])
    if NEED_B:
        ptrs = DQ_B + (row_ptr + rows64[:, None]) * D_B + offs_db[None, :]
        tl.store(ptrs, (dq_b * scale_b).to(DQ_B.dtype.element_ty), mask=row_in[:, None] & (offs_db < D_B)[None, :])


def attention_kl_bwd(
    grad_kl: torch.Tensor,
    q_a: torch.Tensor,
    k_a: torch.Tensor,
    q_b: torch.Tensor,
    k_b: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    kl: torch.Tensor,
    lse_a: torch.Tensor,
    lse_b: torch.Tensor,
    causal: bool,
    scale_a: float,
    scale_b: float,
    need_grad_a: bool,
    need_grad_b: bool,
    allow_tf32: bool = False,
    deterministic: bool = True,
    dk_launch: LaunchConfig | None = None,
    dq_launch: LaunchConfig | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward; returns ``(dq_a, dk_a, dq_b, dk_b)`` in the input dtypes (None if not needed).

    ``dk_launch``/``dq_launch`` override the tile heuristic of each pass (used by the tuning script).
    """
    batch, heads, n_q, d_a = q_a.shape
    d_b = q_b.shape[-1]
    h_ka, n_k = k_a.shape[1], k_a.shape[2]
    h_kb = k_b.shape[1]
    device = q_a.device
    if not (need_grad_a or need_grad_b):
        return None, None, None, None
    if batch * heads * n_q * n_k == 0:
        zeros = lambda x, need: torch.zeros_like(x, memory_format=torch.contiguous_format) if need else None
        return zeros(q_a, need_grad_a), zeros(k_a, need_grad_a), zeros(q_b, need_grad_b), zeros(k_b, need_grad_b)

    grad_kl = grad_kl.to(torch.float32).contiguous()
    esize = max(q_a.element_size(), q_b.element_size())
    atomic = not deterministic
    cfg = dk_launch or dk_config(d_a, d_b, causal, esize, atomic_dq=atomic)
    cfg_q = dq_launch or dq_config(d_a, d_b, causal, esize)
    km = as_uint8_mask(key_padding_mask)
    km_strides = km.stride() if km is not None else (0, 0)
    h_kg = h_kb if need_grad_b else h_ka
    dk_a_per_head = need_grad_a and h_ka != h_kg
    dk_b_per_head = False

    def dk_buffer(k, need, per_head):
        if not need:
            return None
        if per_head:
            return torch.empty((batch, heads, n_k, k.shape[-1]), dtype=torch.float32, device=device)
        return torch.empty(k.shape, dtype=k.dtype, device=device)

    dk_a = dk_buffer(k_a, need_grad_a, dk_a_per_head)
    dk_b = dk_buffer(k_b, need_grad_b, dk_b_per_head)
    dq_acc_a = torch.zeros(q_a.shape, dtype=torch.float32, device=device) if need_grad_a and atomic else None
    dq_acc_b = torch.zeros(q_b.shape, dtype=torch.float32, device=device) if need_grad_b and atomic else None
    strides = (*q_a.stride(), *k_a.stride(), *q_b.stride(), *k_b.stride(), *km_strides)
    common = dict(
        D_A=d_a, D_B=d_b, BLOCK_DA=padded_head_dim(d_a), BLOCK_DB=padded_head_dim(d_b),
        IS_CAUSAL=causal, HAS_KEY_MASK=km is not None, NEED_A=need_grad_a, NEED_B=need_grad_b,
        DOT_PRECISION_A=dot_precision(q_a.dtype, allow_tf32), DOT_PRECISION_B=dot_precision(q_b.dtype, allow_tf32),
        INTERPRET=interpreting(), WIDE=needs_wide_offsets(q_a, k_a, q_b, k_b),
    )
    launch_dk = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    launch_dq = dict(BLOCK_M=cfg_q.block_m, BLOCK_N=cfg_q.block_n, num_warps=cfg_q.num_warps,
                     num_stages=cfg_q.num_stages)
    scales = (scale_a * LOG2E, scale_b * LOG2E, scale_a, scale_b)
    _attention_kl_bwd_dk_kernel[(triton.cdiv(n_k, cfg.block_n), batch * h_kg)](
        q_a, k_a, q_b, k_b, km, grad_kl, kl, lse_a, lse_b, dk_a, dk_b, dq_acc_a, dq_acc_b, *strides,
        heads, n_q, n_k, heads // h_ka, heads // h_kb, h_kg, *scales,
        DK_A_PER_HEAD=dk_a_per_head, DK_B_PER_HEAD=dk_b_per_head, ATOMIC_DQ=atomic, **common, **launch_dk,
    )
    if atomic:
        dq_a = dq_acc_a.to(q_a.dtype) if need_grad_a else None
        dq_b = dq_acc_b.to(q_b.dtype) if need_grad_b else None
    else:
        dq_a = torch.empty(q_a.shape, dtype=q_a.dtype, device=device) if need_grad_a else None
        dq_b = torch.empty(q_b.shape, dtype=q_b.dtype, device=device) if need_grad_b else None
        _attention_kl_bwd_dq_kernel[(triton.cdiv(n_q, cfg_q.block_m), batch * heads)](
            q_a, k_a, q_b, k_b, km, grad_kl, kl, lse_a, lse_b, dq_a, dq_b, *strides,
            heads, n_q, n_k, heads // h_ka, heads // h_kb, *scales, **common, **launch_dq,
        )
    if dk_a_per_head:
        dk_a = dk_a.view(batch, h_ka, heads // h_ka, n_k, d_a).sum(2).to(k_a.dtype)
    return dq_a, dk_a, dq_b, dk_b
