"""Fused attention-KL forward: one pass over key tiles with online rescaling of both distributions.

For a tile of ``BLOCK_M`` query rows of one (batch, head), the kernel streams ``BLOCK_N``-key tiles of
both sides through SRAM, computes the two score tiles with tensor-core products and keeps, per row,
the running max and sum of each distribution plus the coupled accumulator
``A = Σ e^(x - m_a)(x - y)`` (all in base 2). It writes three fp32 numbers per row: the KL and both
log-sum-exps, which is the whole state the backward needs. No ``N_q × N_k`` tile leaves the chip.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._constants import LOG2E
from ._helpers import NEG_BIG, _allowed_keys, _dot, _offset, as_uint8_mask, dot_precision, needs_wide_offsets
from .configs import LaunchConfig, forward_config, interpreting, padded_head_dim


@triton.jit
def _attention_kl_fwd_scores(
    q_a, q_b,  # [BLOCK_M, BLOCK_DA], [BLOCK_M, BLOCK_DB] query tiles (input dtype)
    ka_ptrs, kb_ptrs,  # [BLOCK_DA, BLOCK_N], [BLOCK_DB, BLOCK_N] pointers of the transposed key tiles at key 0
    n0, offs_n, offs_da, offs_db, stride_ka_n, stride_kb_n, N_K,
    D_A: tl.constexpr, D_B: tl.constexpr, CHECK_BOUNDS: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
):
    """Load one key tile of each side and return the raw products ``(q_a·k_aᵀ, q_b·k_bᵀ)`` (fp32)."""
    keys = n0 + offs_n
    if CHECK_BOUNDS:
        kmask_a = (keys < N_K)[None, :] & (offs_da < D_A)[:, None]
        kmask_b = (keys < N_K)[None, :] & (offs_db < D_B)[:, None]
    else:
        kmask_a = (offs_da < D_A)[:, None]
        kmask_b = (offs_db < D_B)[:, None]
    k_a = tl.load(ka_ptrs + _offset(n0, stride_ka_n, WIDE), mask=kmask_a, other=0.0)
    k_b = tl.load(kb_ptrs + _offset(n0, stride_kb_n, WIDE), mask=kmask_b, other=0.0)
    x = _dot(q_a, k_a, DOT_PRECISION_A, INTERPRET)
    y = _dot(q_b, k_b, DOT_PRECISION_B, INTERPRET)
    return x, y


@triton.jit
def _attention_kl_fwd_update(
    x, y,  # [BLOCK_M, BLOCK_N] raw products of one key tile (fp32)
    km_ptr, stride_km_n, n0, offs_m, offs_n,
    m_a, z_a, acc, m_b, z_b,  # [BLOCK_M] running state: maxima of the raw products, sums, coupled accumulator
    qk_scale_a, qk_scale_b,  # scale * log2(e), > 0
    N_Q, N_K,
    IS_CAUSAL: tl.constexpr, CHECK_BOUNDS: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
):
    """Fold one key tile into the running state of both distributions.

    The running max is taken on the raw products (the scales are > 0), so each exponent is one FMA:
    ``exp2(x·c − m·c)``. ``acc`` accumulates ``Σ e^(x−m)(x·c_a − y·c_b)`` in base-2 units.
    """
    if CHECK_BOUNDS or HAS_KEY_MASK:
        allowed = _allowed_keys(offs_m[:, None], (n0 + offs_n)[None, :], km_ptr, stride_km_n, N_Q, N_K,
                                IS_CAUSAL, CHECK_BOUNDS, HAS_KEY_MASK)
        x_m = tl.where(allowed, x, float("-inf"))
        y_m = tl.where(allowed, y, float("-inf"))
    else:
        x_m = x
        y_m = y
    m_a_new = tl.maximum(m_a, tl.max(x_m, 1))
    mc_a = tl.maximum(m_a_new * qk_scale_a, NEG_BIG)  # the clamp keeps an empty row finite for any scale
    alpha_a = tl.exp2(tl.maximum(m_a * qk_scale_a, NEG_BIG) - mc_a)
    p_a = tl.exp2(x_m * qk_scale_a - mc_a[:, None])  # exactly 0 on masked keys
    z_a = z_a * alpha_a + tl.sum(p_a, 1)
    acc = acc * alpha_a + tl.sum(p_a * (x * qk_scale_a - y * qk_scale_b), 1)  # raw scores: 0·finite when masked
    m_b_new = tl.maximum(m_b, tl.max(y_m, 1))
    mc_b = tl.maximum(m_b_new * qk_scale_b, NEG_BIG)
    alpha_b = tl.exp2(tl.maximum(m_b * qk_scale_b, NEG_BIG) - mc_b)
    z_b = z_b * alpha_b + tl.sum(tl.exp2(y_m * qk_scale_b - mc_b[:, None]), 1)
    return m_a_new, z_a, acc, m_b_new, z_b


@triton.jit
def _attention_kl_fwd_kernel(
    Q_A, K_A, Q_B, K_B,  # [B, H, N_Q, D_A], [B, H_KA, N_K, D_A], [B, H, N_Q, D_B], [B, H_KB, N_K, D_B]; any strides
    KEY_MASK, QUERY_MASK,  # [B, N_K], [B, N_Q] uint8 (1 = keep) or None
    KL, LSE_A, LSE_B,  # [B, H, N_Q] fp32, contiguous: per-row KL (nats) and log-sum-exps (nats, +inf if empty)
    stride_qa_b, stride_qa_h, stride_qa_n, stride_qa_d,
    stride_ka_b, stride_ka_h, stride_ka_n, stride_ka_d,
    stride_qb_b, stride_qb_h, stride_qb_n, stride_qb_d,
    stride_kb_b, stride_kb_h, stride_kb_n, stride_kb_d,
    stride_km_b, stride_km_n, stride_qm_b, stride_qm_n,
    H, N_Q, N_K,
    GROUP_A, GROUP_B,  # query heads per key head: H // H_KA, H // H_KB
    qk_scale_a, qk_scale_b,  # scale * log2(e) of each side
    D_A: tl.constexpr, D_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_QUERY_MASK: tl.constexpr,
    DOT_PRECISION_A: tl.constexpr, DOT_PRECISION_B: tl.constexpr, INTERPRET: tl.constexpr,
    PIPELINE: tl.constexpr, WIDE: tl.constexpr,
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

    qa_ptrs = Q_A + b * stride_qa_b + h64 * stride_qa_h + rows64[:, None] * stride_qa_n + offs_da[None, :] * stride_qa_d
    qb_ptrs = Q_B + b * stride_qb_b + h64 * stride_qb_h + rows64[:, None] * stride_qb_n + offs_db[None, :] * stride_qb_d
    q_a = tl.load(qa_ptrs, mask=row_in[:, None] & (offs_da < D_A)[None, :], other=0.0)
    q_b = tl.load(qb_ptrs, mask=row_in[:, None] & (offs_db < D_B)[None, :], other=0.0)
    keys64 = offs_n.to(tl.int64)
    ka_ptrs = K_A + b * stride_ka_b + hk_a * stride_ka_h + keys64[None, :] * stride_ka_n + offs_da[:, None] * stride_ka_d
    kb_ptrs = K_B + b * stride_kb_b + hk_b * stride_kb_h + keys64[None, :] * stride_kb_n + offs_db[:, None] * stride_kb_d
    if HAS_KEY_MASK:
        km_ptr = KEY_MASK + b * stride_km_b
    else:
        km_ptr = KEY_MASK

    m_a = tl.full((BLOCK_M,), NEG_BIG, tl.float32)  # raw-product maxima (finite sentinel: see NEG_BIG)
    m_b = tl.full((BLOCK_M,), NEG_BIG, tl.float32)
    z_a = tl.zeros((BLOCK_M,), tl.float32)
    z_b = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M,), tl.float32)

    # Key tiles [0, full_end) need no bounds or causal masking; [full_end, hi) do.
    full_end = (N_K // BLOCK_N) * BLOCK_N
    hi = N_K
    if IS_CAUSAL:
        first_row_limit = tl.maximum(m_start + (N_K - N_Q) + 1, 0)  # keys < this are visible to every row
        full_end = tl.minimum((first_row_limit // BLOCK_N) * BLOCK_N, full_end)
        hi = tl.maximum(tl.minimum(N_K, m_start + BLOCK_M + (N_K - N_Q)), 0)
    if PIPELINE:
        # software pipelining: the products of tile j+1 are issued before the softmax work of tile j
        x, y = _attention_kl_fwd_scores(q_a, q_b, ka_ptrs, kb_ptrs, 0, offs_n, offs_da, offs_db, stride_ka_n,
                                        stride_kb_n, N_K, D_A, D_B, True, DOT_PRECISION_A, DOT_PRECISION_B,
                                        INTERPRET, WIDE)
        for n0 in range(0, full_end - BLOCK_N, BLOCK_N):
            x_next, y_next = _attention_kl_fwd_scores(
                q_a, q_b, ka_ptrs, kb_ptrs, n0 + BLOCK_N, offs_n, offs_da, offs_db, stride_ka_n, stride_kb_n,
                N_K, D_A, D_B, False, DOT_PRECISION_A, DOT_PRECISION_B, INTERPRET, WIDE,
            )
            m_a, z_a, acc, m_b, z_b = _attention_kl_fwd_update(
                x, y, km_ptr, stride_km_n, n0, offs_m, offs_n, m_a, z_a, acc, m_b, z_b, qk_scale_a, qk_scale_b,
                N_Q, N_K, IS_CAUSAL, False, HAS_KEY_MASK,
            )
            x = x_next
            y = y_next
        if full_end > 0:
            m_a, z_a, acc, m_b, z_b = _attention_kl_fwd_update(
                x, y, km_ptr, stride_km_n, full_end - BLOCK_N, offs_m, offs_n, m_a, z_a, acc, m_b, z_b,
                qk_scale_a, qk_scale_b, N_Q, N_K, IS_CAUSAL, False, HAS_KEY_MASK,
            )
    else:
        for n0 in range(0, full_end, BLOCK_N):
            x, y = _attention_kl_fwd_scores(q_a, q_b, ka_ptrs, kb_ptrs, n0, offs_n, offs_da, offs_db,
                                            stride_ka_n, stride_kb_n, N_K, D_A, D_B, False, DOT_PRECISION_A,
                                            DOT_PRECISION_B, INTERPRET, WIDE)
            m_a, z_a, acc, m_b, z_b = _attention_kl_fwd_update(
                x, y, km_ptr, stride_km_n, n0, offs_m, offs_n, m_a, z_a, acc, m_b, z_b, qk_scale_a, qk_scale_b,
                N_Q, N_K, IS_CAUSAL, False, HAS_KEY_MASK,
            )
    for n0 in range(full_end, hi, BLOCK_N):
        x, y = _attention_kl_fwd_scores(q_a, q_b, ka_ptrs, kb_ptrs, n0, offs_n, offs_da, offs_db, stride_ka_n,
                                        stride_kb_n, N_K, D_A, D_B, True, DOT_PRECISION_A, DOT_PRECISION_B,
                                        INTERPRET, WIDE)
        m_a, z_a, acc, m_b, z_b = _attention_kl_fwd_update(
            x, y, km_ptr, stride_km_n, n0, offs_m, offs_n, m_a, z_a, acc, m_b, z_b, qk_scale_a, qk_scale_b,
            N_Q, N_K, IS_CAUSAL, True, HAS_KEY_MASK,
        )

    valid = row_in & (z_a > 0.0)
    if HAS_QUERY_MASK:
        qm = tl.load(QUERY_MASK + b * stride_qm_b + offs_m * stride_qm_n, mask=row_in, other=0)
        valid = valid & (qm != 0)
    z_a_safe = tl.where(valid, z_a, 1.0)
    z_b_safe = tl.where(valid, z_b, 1.0)
    lse2_a = m_a * qk_scale_a + tl.log2(z_a_safe)
    lse2_b = m_b * qk_scale_b + tl.log2(z_b_safe)
    kl = tl.where(valid, (acc / z_a_safe - lse2_a + lse2_b) * 0.6931471805599453, 0.0)
    out = pid_bh.to(tl.int64) * N_Q + offs_m
    tl.store(KL + out, kl, mask=row_in)
    tl.store(LSE_A + out, tl.where(valid, lse2_a * 0.6931471805599453, float("inf")), mask=row_in)
    tl.store(LSE_B + out, tl.where(valid, lse2_b * 0.6931471805599453, float("inf")), mask=row_in)


def attention_kl_fwd(
    q_a: torch.Tensor,
    k_a: torch.Tensor,
    q_b: torch.Tensor,
    k_b: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    causal: bool,
    scale_a: float,
    scale_b: float,
    allow_tf32: bool = False,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the fused forward; returns ``(kl, lse_a, lse_b)``, each ``[B, H, N_q]`` fp32 (nats).

    Inputs are ``(B, H, N, D)`` views with any strides (nothing is copied); see
    :func:`streamkl.reference.chunked_attention_kl_fwd` for the exact semantics it reproduces.
    ``config`` overrides the tile heuristic (used by the tuning script).
    """
    batch, heads, n_q, d_a = q_a.shape
    d_b = q_b.shape[-1]
    n_k = k_a.shape[2]
    kl = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q_a.device)
    lse_a = torch.empty_like(kl)
    lse_b = torch.empty_like(kl)
    if kl.numel() == 0:
        return kl, lse_a, lse_b
    cfg = config or forward_config(d_a, d_b, causal, max(q_a.element_size(), q_b.element_size()))
    km, qm = as_uint8_mask(key_padding_mask), as_uint8_mask(query_mask)
    km_strides = km.stride() if km is not None else (0, 0)
    qm_strides = qm.stride() if qm is not None else (0, 0)
    grid = (triton.cdiv(n_q, cfg.block_m), batch * heads)
    _attention_kl_fwd_kernel[grid](
        q_a, k_a, q_b, k_b, km, qm, kl, lse_a, lse_b,
        *q_a.stride(), *k_a.stride(), *q_b.stride(), *k_b.stride(), *km_strides, *qm_strides,
        heads, n_q, n_k, heads // k_a.shape[1], heads // k_b.shape[1],
        scale_a * LOG2E, scale_b * LOG2E,
        D_A=d_a, D_B=d_b, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_DA=padded_head_dim(d_a), BLOCK_DB=padded_head_dim(d_b),
        IS_CAUSAL=causal, HAS_KEY_MASK=km is not None, HAS_QUERY_MASK=qm is not None,
        DOT_PRECISION_A=dot_precision(q_a.dtype, allow_tf32), DOT_PRECISION_B=dot_precision(q_b.dtype, allow_tf32),
        INTERPRET=interpreting(), PIPELINE=cfg.pipeline, WIDE=needs_wide_offsets(q_a, k_a, q_b, k_b),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return kl, lse_a, lse_b

