r"""Fused forward of the indexer loss (:func:`streamkl.indexer_kl`): per-head normalisers, then one streaming pass.

Notation: ``B`` batch, ``H`` main heads over ``H_kv`` key heads (``G = H / H_kv``), ``D`` main head dim, ``H_I``
indexer heads of dim ``D_I``, ``E = B·N_q·N_k`` (dense; ~half causal) or ``E = B·N_q·K`` (sparse) score elements.

Plan and cost per score element (tensor-core FLOPs; ``exp`` = one MUFU ``exp2``):

* **Pass 1, per-head log-sum-exps** (skipped when the caller passes ``lse``). Dense: ``_indexer_kl_dense_lse_kernel``,
  grid ``(⌈N_q/BLOCK_M⌉, B·H)``, the FlashAttention forward without the ``P·V`` product: a query tile stays in
  registers, key tiles stream, online max/sum. ``2·D·H`` FLOP and ``H`` exps per element. Sparse:
  ``_indexer_kl_sparse_lse_kernel``, grid ``(N_q, B·H_kv)``: one query token, the ``G`` heads that share a key head
  as the rows of the product (DSA's sparse attention shares the selection across heads), ``BLOCK_N`` gathered keys
  per step; same FLOPs per element.
* **Pass 2, the KL** (``_indexer_kl_dense_fwd_kernel``, grid ``(⌈N_q/BLOCK_M⌉, SPLITS, B)``: when ``B·N_q`` alone
  does not fill the GPU the keys are cut into ``SPLITS`` ranges whose row states merge exactly on the host, see
  :func:`merge_row_state`; ``_indexer_kl_sparse_fwd_kernel``, grid ``(N_q, B)``). Per key tile (dense: ``BLOCK_M`` query rows × ``BLOCK_N`` keys; sparse: one row × ``BLOCK_N``
  selected keys): ``p = (1/H) Σ_h exp2(s_h·c − lse2_h)`` over the heads (``2·D·H`` FLOP, ``H`` exps),
  ``I = Σ_j w_j ReLU(q_idx_j·k_idx)`` over the indexer heads (``2·D_I·H_I`` FLOP plus ``2·H_I`` ReLU/FMA on the CUDA
  cores), then one online log-sum-exp of ``I`` and three running sums per row: ``Σ p``, ``Σ p·log p`` and
  ``Σ p·(I − m)`` (rescaled when the running max ``m`` moves), so
  ``KL = Σ p·ln p − Σ p·(I − m) + ln(Z_I)·Σ p``. Dense: the main-head loop reloads each head's query tile per key
  tile (L2-resident), so the product's operand intensity is ``BLOCK_M·BLOCK_N/(BLOCK_M + BLOCK_N)`` FLOP/byte
  rather than FlashAttention's ``BLOCK_M``; sparse: the indexer query ``[H_I, D_I]`` stays in registers and each
  step gathers ``BLOCK_N`` key rows per key head.

Forward total: ``2·(2·H·D + H_I·D_I)`` FLOP per element (``2·(H·D + H_I·D_I)`` with ``lse``), e.g. at ``H = H_I =
64``, ``D = D_I = 128``: 48 kFLOP/element, 1.6 TFLOP for a causal ``N = 8192`` row block... per batch element
``E·48k``. Saved for the backward: ``lse_h [B, H, N_q]`` and ``lse_I``, ``Σ p`` per row (``O(N·H)``, no ``N²``).

Masks: ``NEG_BIG`` is the finite running-max sentinel; a row is valid iff its indexer sum ``Z_I > 0`` (one usable
key), and invalid rows get ``KL = 0``, ``lse_I = +inf``, ``Σ p = 0``. Under the CPU interpreter the dots run in
fp32 (``_dot``) and the tiles are the smallest ``tl.dot`` takes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._constants import LN2, LOG2E
from .._triton_common.interpreter import triton_interpreter_enabled
from .._triton_common.numerics import NEG_BIG
from ._helpers import _dot, _offset, dot_precision, needs_wide_offsets
from .configs import MIN_BLOCK, padded_head_dim


def _autotune_configs(candidates: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """``(BLOCK_M, BLOCK_N, warps, stages)`` candidates; one smallest config under the interpreter (it would run
    every config serially)."""
    if triton_interpreter_enabled():
        candidates = [(MIN_BLOCK, MIN_BLOCK, 1, 1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in candidates]


# Candidates for an H100 (D, D_I <= 128), not yet measured: 2-D fp32 tiles p, I, s, r of BLOCK_M x BLOCK_N live
# together. Kept short: every config is compiled and timed once per shape key (N is not part of the key).
DENSE_CONFIGS = _autotune_configs([(64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2)])
# Sparse: BLOCK_M is unused (one query row per program); BLOCK_N selected keys are gathered per step.
SPARSE_CONFIGS = _autotune_configs([(MIN_BLOCK, 32, 4, 2), (MIN_BLOCK, 64, 8, 2)])
SHAPE_KEY = ["H", "GROUP", "D", "H_I", "D_I", "IS_CAUSAL", "HAS_KEY_MASK"]


# ------------------------------------------------------------------------------------------------ helpers
@triton.jit
def _indexer_dense_allowed(rows, cols, km_ptr, stride_km_n, N_Q, N_K, IS_CAUSAL: tl.constexpr,
                           HAS_KEY_MASK: tl.constexpr):
    """Bool ``[BLOCK_M, BLOCK_N]``: key ``cols`` exists and row ``rows`` may use it (causal bottom-right, padding)."""
    allowed = (cols < N_K)[None, :] & (rows >= 0)[:, None]
    if IS_CAUSAL:
        allowed = allowed & (cols[None, :] <= rows[:, None] + (N_K - N_Q))
    if HAS_KEY_MASK:
        allowed = allowed & (tl.load(km_ptr + cols * stride_km_n, mask=cols < N_K, other=0) != 0)[None, :]
    return allowed


@triton.jit
def _indexer_sparse_slots(
    TOPK, km_ptr, stride_km_n, t, slots, N_SEL, N_Q, N_K,
    IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
):
    """``(keys, ok)`` of ``BLOCK_N`` slots of row ``t``: the key positions (0 where unusable) and whether the slot
    holds a selected key the row may use (not ``-1``, causal, not padding)."""
    keys = tl.load(TOPK + slots, mask=slots < N_SEL, other=-1).to(tl.int32)
    ok = keys >= 0
    if IS_CAUSAL:
        ok = ok & (keys <= t + (N_K - N_Q))
    keys = tl.where(ok, keys, 0)
    if HAS_KEY_MASK:
        ok = ok & (tl.load(km_ptr + keys * stride_km_n, mask=ok, other=0) != 0)
    return keys, ok


@triton.jit
def _online_lse_update(s, allowed, m, z):
    """Fold a tile of raw scores ``s`` (``[R, C]``, already scaled to base 2) into the running max/sum of each row."""
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    z = z * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
    return m_new, z


@triton.jit
def _indexer_kl_init_state(ROWS: tl.constexpr):
    """Empty row state ``(m, z, Σp, Σp·log2 p, Σp·(I − m))`` of ``ROWS`` rows (``m`` at the finite sentinel)."""
    zeros = tl.zeros((ROWS,), tl.float32)
    return zeros + NEG_BIG, zeros, zeros, zeros, zeros


@triton.jit
def _indexer_kl_update(p, logits, allowed, m, z, psum, plogp, acc):
    """Fold one tile of the target ``p`` and the indexer logits ``I`` (``[R, C]`` fp32, nats) into the row state.

    ``m``/``z``: running max and sum of ``exp(I − m)``; ``psum = Σ p``; ``plogp = Σ p·log2 p``;
    ``acc = Σ p·(I − m)``, moved along with ``m`` (``+ (m_old − m_new)·psum``).
    """
    p = tl.where(allowed, p, 0.0)
    x = tl.where(allowed, logits, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, 1))
    z = z * tl.exp2((m - m_new) * 1.4426950408889634) + tl.sum(
        tl.exp2((x - m_new[:, None]) * 1.4426950408889634), 1)
    acc = acc + (m - m_new) * psum + tl.sum(p * (logits - m_new[:, None]), 1)
    psum = psum + tl.sum(p, 1)
    plogp = plogp + tl.sum(p * tl.log2(tl.where(p > 0.0, p, 1.0)), 1)
    return m_new, z, psum, plogp, acc


@triton.jit
def _indexer_kl_store_state(STATE, b, split, rows, row_in, m, z, psum, plogp, acc, B, SPLITS, N_Q):
    """Write one key range's row state ``(m, z, Σp, Σp·log2 p, Σp·(I − m))`` to ``STATE [5, B, SPLITS, N_Q]``."""
    ptr = STATE + (b * SPLITS + split) * N_Q + rows
    plane = B * SPLITS * N_Q
    tl.store(ptr, m, mask=row_in)
    tl.store(ptr + plane, z, mask=row_in)
    tl.store(ptr + 2 * plane, psum, mask=row_in)
    tl.store(ptr + 3 * plane, plogp, mask=row_in)
    tl.store(ptr + 4 * plane, acc, mask=row_in)


@triton.jit
def _indexer_dense_target(
    Q, K, LSE_H,  # [B, H, N_Q, D] / [B, H_KV, N_K, D] inputs, [B, H, N_Q] fp32 per-head lse (nats), contiguous
    b, rows, n0, offs_n, offs_d,
    stride_q_b, stride_q_h, stride_q_n, stride_q_d,
    stride_k_b, stride_k_h, stride_k_n, stride_k_d,
    H, H_KV, GROUP, N_Q, N_K, qk_scale, inv_heads,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
):
    """``[BLOCK_M, BLOCK_N]`` head mean of the main attention's probabilities (not yet masked)."""
    keys = n0 + offs_n
    row_in = rows < N_Q
    p = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    q_rows = _offset(rows, stride_q_n, WIDE)[:, None] + offs_d[None, :] * stride_q_d
    k_cols = _offset(keys, stride_k_n, WIDE)[None, :] + offs_d[:, None] * stride_k_d
    q_mask = row_in[:, None] & (offs_d < D)[None, :]
    k_mask = (keys < N_K)[None, :] & (offs_d < D)[:, None]
    for g in range(0, H_KV):
        k_t = tl.load(K + b * stride_k_b + tl.cast(g, tl.int64) * stride_k_h + k_cols, mask=k_mask, other=0.0)
        for hh in range(0, GROUP):
            h = tl.cast(g * GROUP + hh, tl.int64)
            q = tl.load(Q + b * stride_q_b + h * stride_q_h + q_rows, mask=q_mask, other=0.0)
            lse2 = tl.load(LSE_H + (b * H + h) * N_Q + rows, mask=row_in, other=float("inf")) * 1.4426950408889634
            s = _dot(q, k_t, DOT_PRECISION, INTERPRET)
            p += tl.exp2(s * qk_scale - lse2[:, None])
    return p * inv_heads


@triton.jit
def _indexer_dense_logits(
    QI, KI, W,  # [B, H_I, N_Q, D_I], [B, N_K, D_I], [B, N_Q, H_I]
    b, rows, n0, offs_n, offs_di,
    stride_qi_b, stride_qi_h, stride_qi_n, stride_qi_d,
    stride_ki_b, stride_ki_n, stride_ki_d,
    stride_w_b, stride_w_n, stride_w_h,
    H_I, N_Q, N_K,
    D_I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
):
    """``[BLOCK_M, BLOCK_N]`` indexer logits ``I = Σ_j w_j ReLU(q_idx_j · k_idx)`` (fp32)."""
    keys = n0 + offs_n
    row_in = rows < N_Q
    ki_t = tl.load(KI + b * stride_ki_b + _offset(keys, stride_ki_n, WIDE)[None, :] + offs_di[:, None] * stride_ki_d,
                   mask=(keys < N_K)[None, :] & (offs_di < D_I)[:, None], other=0.0)
    qi_rows = _offset(rows, stride_qi_n, WIDE)[:, None] + offs_di[None, :] * stride_qi_d
    qi_mask = row_in[:, None] & (offs_di < D_I)[None, :]
    w_rows = W + b * stride_w_b + _offset(rows, stride_w_n, WIDE)
    logits = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for j in range(0, H_I):
        qi = tl.load(QI + b * stride_qi_b + tl.cast(j, tl.int64) * stride_qi_h + qi_rows, mask=qi_mask, other=0.0)
        w = tl.load(w_rows + j * stride_w_h, mask=row_in, other=0.0).to(tl.float32)
        r = _dot(qi, ki_t, DOT_PRECISION, INTERPRET)
        logits += w[:, None] * tl.maximum(r, 0.0)
    return logits


@triton.jit
def _indexer_sparse_target(
    Q, K, LSE_H, b, t, keys, ok, offs_g, offs_d,
    stride_q_b, stride_q_h, stride_q_n, stride_q_d,
    stride_k_b, stride_k_h, stride_k_n, stride_k_d,
    H, H_KV, GROUP, N_Q, qk_scale, inv_heads,
    D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    """``[BLOCK_N]`` head mean of the main attention's probabilities on the gathered keys of row ``t``."""
    p = tl.zeros((BLOCK_N,), tl.float32)
    k_cols = keys.to(tl.int64)[None, :] * stride_k_n + offs_d[:, None] * stride_k_d
    k_mask = ok[None, :] & (offs_d < D)[:, None]
    head_in = offs_g < GROUP
    for g in range(0, H_KV):
        heads = (g * GROUP + offs_g).to(tl.int64)
        k_t = tl.load(K + b * stride_k_b + tl.cast(g, tl.int64) * stride_k_h + k_cols, mask=k_mask, other=0.0)
        q = tl.load(Q + b * stride_q_b + heads[:, None] * stride_q_h + t.to(tl.int64) * stride_q_n
                    + offs_d[None, :] * stride_q_d, mask=head_in[:, None] & (offs_d < D)[None, :], other=0.0)
        lse2 = tl.load(LSE_H + (b * H + heads) * N_Q + t, mask=head_in, other=float("inf")) * 1.4426950408889634
        s = _dot(q, k_t, DOT_PRECISION, INTERPRET)
        p += tl.sum(tl.exp2(s * qk_scale - lse2[:, None]), 0)
    return p * inv_heads


@triton.jit
def _indexer_sparse_logits(qi, w, KI, b, keys, ok, offs_di, stride_ki_b, stride_ki_n, stride_ki_d,
                           D_I: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """``(I [BLOCK_N], R [BLOCK_HI, BLOCK_N], k_idx tile [BLOCK_DI, BLOCK_N])`` on the gathered keys of one row."""
    ki_t = tl.load(KI + b * stride_ki_b + keys.to(tl.int64)[None, :] * stride_ki_n + offs_di[:, None] * stride_ki_d,
                   mask=ok[None, :] & (offs_di < D_I)[:, None], other=0.0)
    r = _dot(qi, ki_t, DOT_PRECISION, INTERPRET)
    return tl.sum(w[:, None] * tl.maximum(r, 0.0), 0), r, ki_t


# ------------------------------------------------------------------------------------------------ kernels
@triton.autotune(configs=DENSE_CONFIGS, key=["GROUP", "D", "IS_CAUSAL", "HAS_KEY_MASK"])
@triton.jit
def _indexer_kl_dense_lse_kernel(
    Q, K,  # [B, H, N_Q, D], [B, H_KV, N_K, D]; any strides
    KEY_MASK,  # [B, N_K] uint8 (1 = real key) or None
    LSE_H,  # [B, H, N_Q] fp32 contiguous out: log-sum-exp of each head's scores (nats), +inf on empty rows
    stride_q_b, stride_q_h, stride_q_n, stride_q_d,
    stride_k_b, stride_k_h, stride_k_n, stride_k_d,
    stride_km_b, stride_km_n,
    H, GROUP, N_Q, N_K, qk_scale,  # qk_scale = scale * log2(e)
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    m_start = pid_m * BLOCK_M
    rows = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_in = rows < N_Q
    q = tl.load(Q + b * stride_q_b + h * stride_q_h + _offset(rows, stride_q_n, WIDE)[:, None]
                + offs_d[None, :] * stride_q_d, mask=row_in[:, None] & (offs_d < D)[None, :], other=0.0)
    k_base = K + b * stride_k_b + (h // GROUP) * stride_k_h + offs_d[:, None] * stride_k_d
    km_ptr = KEY_MASK + b * stride_km_b if HAS_KEY_MASK else KEY_MASK
    m = tl.full((BLOCK_M,), NEG_BIG, tl.float32)
    z = tl.zeros((BLOCK_M,), tl.float32)
    hi = N_K
    if IS_CAUSAL:
        hi = tl.maximum(tl.minimum(N_K, m_start + BLOCK_M + (N_K - N_Q)), 0)
    for n0 in range(0, hi, BLOCK_N):
        keys = n0 + offs_n
        k_t = tl.load(k_base + _offset(keys, stride_k_n, WIDE)[None, :],
                      mask=(keys < N_K)[None, :] & (offs_d < D)[:, None], other=0.0)
        s = _dot(q, k_t, DOT_PRECISION, INTERPRET) * qk_scale
        allowed = _indexer_dense_allowed(rows, keys, km_ptr, stride_km_n, N_Q, N_K, IS_CAUSAL, HAS_KEY_MASK)
        m, z = _online_lse_update(s, allowed, m, z)
    valid = z > 0.0
    lse = tl.where(valid, (m + tl.log2(tl.where(valid, z, 1.0))) * 0.6931471805599453, float("inf"))
    tl.store(LSE_H + pid_bh.to(tl.int64) * N_Q + rows, lse, mask=row_in)


@triton.autotune(configs=SPARSE_CONFIGS, key=["GROUP", "D", "IS_CAUSAL", "HAS_KEY_MASK"])
@triton.jit
def _indexer_kl_sparse_lse_kernel(
    Q, K,  # [B, H, N_Q, D], [B, H_KV, N_K, D]; any strides
    TOPK,  # [B, N_Q, K] int32/int64 contiguous: selected keys, -1 = empty slot
    KEY_MASK,  # [B, N_K] uint8 or None
    LSE_H,  # [B, H, N_Q] fp32 contiguous out: lse over each row's selected usable keys (nats), +inf if none
    stride_q_b, stride_q_h, stride_q_n, stride_q_d,
    stride_k_b, stride_k_h, stride_k_n, stride_k_d,
    stride_km_b, stride_km_n,
    H, H_KV, GROUP, N_Q, N_K, N_SEL, qk_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    t = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // H_KV).to(tl.int64)
    g = (pid_bg % H_KV).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    head_in = offs_g < GROUP
    heads = g * GROUP + offs_g
    q = tl.load(Q + b * stride_q_b + heads[:, None] * stride_q_h + t.to(tl.int64) * stride_q_n
                + offs_d[None, :] * stride_q_d, mask=head_in[:, None] & (offs_d < D)[None, :], other=0.0)
    k_base = K + b * stride_k_b + g * stride_k_h + offs_d[:, None] * stride_k_d
    km_ptr = KEY_MASK + b * stride_km_b if HAS_KEY_MASK else KEY_MASK
    topk_row = TOPK + (b * N_Q + t) * N_SEL
    m = tl.full((BLOCK_G,), NEG_BIG, tl.float32)
    z = tl.zeros((BLOCK_G,), tl.float32)
    for i0 in range(0, N_SEL, BLOCK_N):
        keys, ok = _indexer_sparse_slots(topk_row, km_ptr, stride_km_n, t, i0 + tl.arange(0, BLOCK_N), N_SEL, N_Q, N_K,
                                         IS_CAUSAL, HAS_KEY_MASK)
        k_t = tl.load(k_base + keys.to(tl.int64)[None, :] * stride_k_n, mask=ok[None, :] & (offs_d < D)[:, None],
                      other=0.0)
        s = _dot(q, k_t, DOT_PRECISION, INTERPRET) * qk_scale
        m, z = _online_lse_update(s, ok[None, :], m, z)
    valid = z > 0.0
    lse = tl.where(valid, (m + tl.log2(tl.where(valid, z, 1.0))) * 0.6931471805599453, float("inf"))
    tl.store(LSE_H + (b * H + heads) * N_Q + t, lse, mask=head_in)


@triton.autotune(configs=DENSE_CONFIGS, key=SHAPE_KEY)
@triton.jit
def _indexer_kl_dense_fwd_kernel(
    Q, K,  # [B, H, N_Q, D], [B, H_KV, N_K, D]; any strides
    QI, KI, W,  # [B, H_I, N_Q, D_I], [B, N_K, D_I], [B, N_Q, H_I]; any strides
    KEY_MASK,  # [B, N_K] uint8 or None
    LSE_H,  # [B, H, N_Q] fp32 contiguous: per-head lse (nats)
    STATE,  # [5, B, SPLITS, N_Q] fp32 contiguous out: the row state of each key range (merged on the host)
    stride_q_b, stride_q_h, stride_q_n, stride_q_d,
    stride_k_b, stride_k_h, stride_k_n, stride_k_d,
    stride_qi_b, stride_qi_h, stride_qi_n, stride_qi_d,
    stride_ki_b, stride_ki_n, stride_ki_d,
    stride_w_b, stride_w_n, stride_w_h,
    stride_km_b, stride_km_n,
    B, SPLITS, SPLIT_N,  # the keys are cut into SPLITS ranges of SPLIT_N (a multiple of every BLOCK_N)
    H, H_KV, GROUP, H_I, N_Q, N_K, qk_scale, inv_heads,
    D: tl.constexpr, D_I: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_PRECISION_I: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    m_start = pid_m * BLOCK_M
    rows = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_di = tl.arange(0, BLOCK_DI)
    km_ptr = KEY_MASK + b * stride_km_b if HAS_KEY_MASK else KEY_MASK
    m, z, psum, plogp, acc = _indexer_kl_init_state(BLOCK_M)
    hi = N_K
    if IS_CAUSAL:
        hi = tl.maximum(tl.minimum(N_K, m_start + BLOCK_M + (N_K - N_Q)), 0)
    for n0 in range(split * SPLIT_N, tl.minimum(hi, (split + 1) * SPLIT_N), BLOCK_N):
        p = _indexer_dense_target(
            Q, K, LSE_H, b, rows, n0, offs_n, offs_d, stride_q_b, stride_q_h, stride_q_n, stride_q_d,
            stride_k_b, stride_k_h, stride_k_n, stride_k_d, H, H_KV, GROUP, N_Q, N_K, qk_scale, inv_heads,
            D, BLOCK_M, BLOCK_N, DOT_PRECISION, INTERPRET, WIDE,
        )
        logits = _indexer_dense_logits(
            QI, KI, W, b, rows, n0, offs_n, offs_di, stride_qi_b, stride_qi_h, stride_qi_n, stride_qi_d,
            stride_ki_b, stride_ki_n, stride_ki_d, stride_w_b, stride_w_n, stride_w_h, H_I, N_Q, N_K,
            D_I, BLOCK_M, BLOCK_N, DOT_PRECISION_I, INTERPRET, WIDE,
        )
        allowed = _indexer_dense_allowed(rows, n0 + offs_n, km_ptr, stride_km_n, N_Q, N_K, IS_CAUSAL, HAS_KEY_MASK)
        m, z, psum, plogp, acc = _indexer_kl_update(p, logits, allowed, m, z, psum, plogp, acc)
    _indexer_kl_store_state(STATE, b, split, rows, rows < N_Q, m, z, psum, plogp, acc, B, SPLITS, N_Q)


@triton.autotune(configs=SPARSE_CONFIGS, key=SHAPE_KEY)
@triton.jit
def _indexer_kl_sparse_fwd_kernel(
    Q, K,  # [B, H, N_Q, D], [B, H_KV, N_K, D]; any strides
    QI, KI, W,  # [B, H_I, N_Q, D_I], [B, N_K, D_I], [B, N_Q, H_I]; any strides
    TOPK,  # [B, N_Q, K] int32/int64 contiguous, -1 = empty slot
    KEY_MASK,  # [B, N_K] uint8 or None
    LSE_H,  # [B, H, N_Q] fp32 contiguous: per-head lse over the selected keys (nats)
    STATE,  # [5, B, 1, N_Q] fp32 contiguous out: the row state (finished on the host)
    stride_q_b, stride_q_h, stride_q_n, stride_q_d,
    stride_k_b, stride_k_h, stride_k_n, stride_k_d,
    stride_qi_b, stride_qi_h, stride_qi_n, stride_qi_d,
    stride_ki_b, stride_ki_n, stride_ki_d,
    stride_w_b, stride_w_n, stride_w_h,
    stride_km_b, stride_km_n,
    B, H, H_KV, GROUP, H_I, N_Q, N_K, N_SEL, qk_scale, inv_heads,
    D: tl.constexpr, D_I: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_PRECISION_I: tl.constexpr, INTERPRET: tl.constexpr,
):
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_di = tl.arange(0, BLOCK_DI)
    offs_j = tl.arange(0, BLOCK_HI)
    j_in = offs_j < H_I
    qi = tl.load(QI + b * stride_qi_b + offs_j.to(tl.int64)[:, None] * stride_qi_h + t.to(tl.int64) * stride_qi_n
                 + offs_di[None, :] * stride_qi_d, mask=j_in[:, None] & (offs_di < D_I)[None, :], other=0.0)
    w = tl.load(W + b * stride_w_b + t.to(tl.int64) * stride_w_n + offs_j * stride_w_h, mask=j_in,
                other=0.0).to(tl.float32)
    km_ptr = KEY_MASK + b * stride_km_b if HAS_KEY_MASK else KEY_MASK
    topk_row = TOPK + (b * N_Q + t) * N_SEL
    m, z, psum, plogp, acc = _indexer_kl_init_state(1)
    for i0 in range(0, N_SEL, BLOCK_N):
        keys, ok = _indexer_sparse_slots(topk_row, km_ptr, stride_km_n, t, i0 + tl.arange(0, BLOCK_N), N_SEL, N_Q, N_K,
                                         IS_CAUSAL, HAS_KEY_MASK)
        logits, _, _ = _indexer_sparse_logits(qi, w, KI, b, keys, ok, offs_di, stride_ki_b, stride_ki_n,
                                              stride_ki_d, D_I, DOT_PRECISION_I, INTERPRET)
        p = _indexer_sparse_target(
            Q, K, LSE_H, b, t, keys, ok, offs_g, offs_d, stride_q_b, stride_q_h, stride_q_n, stride_q_d,
            stride_k_b, stride_k_h, stride_k_n, stride_k_d, H, H_KV, GROUP, N_Q, qk_scale, inv_heads,
            D, BLOCK_N, DOT_PRECISION, INTERPRET,
        )
        m, z, psum, plogp, acc = _indexer_kl_update(p[None, :], logits[None, :], ok[None, :], m, z, psum, plogp,
                                                    acc)
    row = t + tl.arange(0, 1)
    _indexer_kl_store_state(STATE, b, 0, row, row < N_Q, m, z, psum, plogp, acc, B, 1, N_Q)


# ------------------------------------------------------------------------------------------------ launcher
def strides4(x: torch.Tensor | None) -> tuple[int, ...]:
    """Strides of an optional mask (zeros for None)."""
    return (0, 0) if x is None else tuple(x.stride())


def launch_common(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor,
                  key_padding_mask: torch.Tensor | None, causal: bool, scale: float) -> dict:
    """Scalars, strides and constexprs shared by the dense and sparse pass-2 and backward launches."""
    batch, heads, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    h_i, d_i = q_idx.shape[1], q_idx.shape[3]
    return dict(
        strides=(*q.stride(), *k.stride(), *q_idx.stride(), *k_idx.stride(), *w_idx.stride(),
                 *strides4(key_padding_mask)),
        H=heads, H_KV=h_kv, GROUP=heads // h_kv, H_I=h_i, N_Q=n_q, N_K=n_k,
        qk_scale=scale * LOG2E, inv_heads=1.0 / heads,
        D=d, D_I=d_i, BLOCK_D=padded_head_dim(d), BLOCK_DI=padded_head_dim(d_i),
        IS_CAUSAL=causal, HAS_KEY_MASK=key_padding_mask is not None,
        DOT_PRECISION=dot_precision(q.dtype, False), DOT_PRECISION_I=dot_precision(q_idx.dtype, False),
        INTERPRET=triton_interpreter_enabled(),
        WIDE=needs_wide_offsets(q, k, q_idx, k_idx.unsqueeze(1), w_idx.unsqueeze(1)),
        batch=batch,
    )


def key_splits(batch: int, n_q: int, n_k: int, device: torch.device) -> tuple[int, int]:
    """``(SPLITS, SPLIT_N)`` of the dense forward: enough (row block, key range) programs to fill the GPU twice
    over at ``BLOCK_M = 64`` when ``B·N_q`` alone does not; ``SPLIT_N`` is a multiple of 128 (of every ``BLOCK_N``).
    Under the interpreter the ranges are two smallest tiles, so the tests exercise the merge."""
    if triton_interpreter_enabled():
        split_n = 2 * MIN_BLOCK
    else:
        programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
        splits = max(1, min(triton.cdiv(programs, batch * triton.cdiv(n_q, 64)), triton.cdiv(n_k, 128)))
        split_n = triton.cdiv(triton.cdiv(n_k, splits), 128) * 128
    return triton.cdiv(n_k, split_n), split_n


def merge_row_state(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kl, lse_index, psum)`` ``[B, N_q]`` from the per-key-range row states ``[5, B, SPLITS, N_q]``.

    Ranges merge exactly: ``M = max m``, ``Z = Σ z·e^(m−M)``, ``Σp`` and ``Σp·log2 p`` add, and
    ``Σ p·(I − M) = Σ [acc + (m − M)·Σp]``; then ``KL = ln2·Σp log2 p − acc + ln(Z)·Σp`` and ``lse_I = M + ln Z``.
    Rows with ``Z = 0`` (no usable key) get ``(0, +inf, 0)``.
    """
    m, z, psum, plogp, acc = state.unbind(0)
    m_max = m.amax(1, keepdim=True)
    z_all = (z * torch.exp(m - m_max)).sum(1)
    psum_all, plogp_all = psum.sum(1), plogp.sum(1)
    acc_all = (acc + (m - m_max) * psum).sum(1)
    valid = z_all > 0
    log_z = torch.log(torch.where(valid, z_all, 1.0))
    kl = torch.where(valid, plogp_all * LN2 - acc_all + log_z * psum_all, 0.0)
    lse_index = torch.where(valid, m_max.squeeze(1) + log_z, float("inf"))
    return kl, lse_index, torch.where(valid, psum_all, 0.0)


def indexer_kl_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    lse: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward; returns ``(kl, lse_h, lse_index, psum)`` (fp32, nats), as
    :func:`streamkl.indexer_reference.chunked_indexer_kl_fwd` defines them. Inputs are the canonical views with any
    strides (nothing is copied but ``topk_indices``, which is made contiguous)."""
    batch, heads, n_q, _ = q.shape
    n_k = k.shape[2]
    device = q.device
    if batch * n_q == 0 or n_k == 0:
        rows = torch.zeros((batch, n_q), dtype=torch.float32, device=device)
        lse_h = torch.full((batch, heads, n_q), float("inf"), dtype=torch.float32, device=device)
        return rows, lse_h, torch.full_like(rows, float("inf")), rows.clone()
    km = None if key_padding_mask is None else key_padding_mask.view(torch.uint8)
    c = launch_common(q, k, q_idx, k_idx, w_idx, km, causal, scale)
    strides = c.pop("strides")
    c.pop("batch")
    q_strides, k_strides, km_strides = strides[:4], strides[4:8], strides[-2:]
    topk = None if topk_indices is None else topk_indices.contiguous()
    if lse is not None:
        lse_h = lse.to(torch.float32).contiguous()
    else:
        lse_h = torch.empty((batch, heads, n_q), dtype=torch.float32, device=device)
        flags = dict(D=c["D"], BLOCK_D=c["BLOCK_D"], IS_CAUSAL=causal, HAS_KEY_MASK=km is not None,
                     DOT_PRECISION=c["DOT_PRECISION"], INTERPRET=c["INTERPRET"])
        if topk is None:
            grid = lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), batch * heads)
            _indexer_kl_dense_lse_kernel[grid](
                q, k, km, lse_h, *q_strides, *k_strides, *km_strides, heads, c["GROUP"], n_q, n_k, c["qk_scale"],
                WIDE=c["WIDE"], **flags,
            )
        else:
            _indexer_kl_sparse_lse_kernel[(n_q, batch * c["H_KV"])](
                q, k, topk, km, lse_h, *q_strides, *k_strides, *km_strides, heads, c["H_KV"], c["GROUP"], n_q, n_k,
                topk.shape[2], c["qk_scale"], BLOCK_G=padded_head_dim(c["GROUP"]), **flags,
            )
    if topk is None:
        splits, split_n = key_splits(batch, n_q, n_k, device)
        state = torch.empty((5, batch, splits, n_q), dtype=torch.float32, device=device)
        grid = lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), splits, batch)
        _indexer_kl_dense_fwd_kernel[grid](q, k, q_idx, k_idx, w_idx, km, lse_h, state, *strides, batch, splits,
                                           split_n, **c)
    else:
        c.pop("WIDE")
        state = torch.empty((5, batch, 1, n_q), dtype=torch.float32, device=device)
        _indexer_kl_sparse_fwd_kernel[(n_q, batch)](
            q, k, q_idx, k_idx, w_idx, topk, km, lse_h, state, *strides, batch, N_SEL=topk.shape[2],
            BLOCK_G=padded_head_dim(c["GROUP"]), BLOCK_HI=padded_head_dim(c["H_I"]), **c,
        )
    kl, lse_index, psum = merge_row_state(state)
    return kl, lse_h, lse_index, psum
