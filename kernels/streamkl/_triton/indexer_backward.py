r"""Fused backward of the indexer loss: recompute the target and the indexer logits tile by tile.

With the saved per-head ``lse_h``, the indexer's ``lse_I`` and ``Σ p`` of each row and the upstream gradient
``g``, the gradient w.r.t. the logits is ``dI = g (Σp·softmax(I) − p)``; through ``I = Σ_j w_j ReLU(R_j)``,
``R_j = q_idx_j·k_idx``:

* ``dw_j[t] = Σ_s dI·ReLU(R_j)``;
* ``dq_idx_j[t] = w_j Σ_s dI·1[R_j > 0]·k_idx[s]``;
* ``dk_idx[s] = Σ_t Σ_j dI·w_j·1[R_j > 0]·q_idx_j[t]``.

``dI`` couples all ``H_I`` indexer heads of a row, so a query-stationary program would need ``H_I`` accumulators
``[BLOCK_M, D_I]`` for ``dq_idx`` (2 MB at ``H_I = 64``, ``D_I = 128``, ``BLOCK_M = 64``). The two stages split the
work differently:

* **Dense**, three kernels per block of at most ``CHUNK`` query rows (sized so the ``[B, CHUNK, N_k]`` fp32 scratch
  stays under 64 MiB; never ``N_q × N_k``):

  1. ``_indexer_kl_dense_bwd_dlogits_kernel``, grid ``(⌈CHUNK/BLOCK_M⌉, ⌈N_k/BLOCK_N⌉, B)``, one tile per
     program (tiles past the causal band do nothing): recompute ``p`` and ``I`` exactly as the forward does
     (``2·(H·D + H_I·D_I)`` FLOP, ``H + 1`` exps per element) and store ``dI`` for the chunk;
  2. ``_indexer_kl_dense_bwd_dq_kernel``, grid ``(⌈CHUNK/BLOCK_M⌉, B·H_I)``: one indexer head per program,
     ``R_j`` recomputed and ``dq_idx_j += (dI·1[R_j>0])·k_idx`` (``4·D_I`` FLOP per element and head), ``dw_j``;
  3. ``_indexer_kl_dense_bwd_dk_kernel``, grid ``(⌈N_k/BLOCK_N⌉, ⌈CHUNK/SPLIT_M⌉, B)``: key-stationary over a
     range of the chunk's rows and all indexer heads, ``dk_idx += (dI·w_j·1[R_j>0])ᵀ·q_idx_j`` (``4·D_I`` FLOP per
     element and head), added once per program to an fp32 accumulator with atomics (``SPLIT_M`` is sized so the
     grid fills the GPU; the last bits of ``dk_idx`` may vary between runs).

  Backward total: ``2·(H·D + 5·H_I·D_I)`` FLOP per element, plus 12 bytes of ``dI`` traffic.
* **Sparse**, one kernel ``_indexer_kl_sparse_bwd_kernel``, grid ``(N_q, B)``: the row's ``dq_idx [H_I, D_I]`` and
  ``dw [H_I]`` fit in registers, the indexer heads are the rows of the products, and each step's ``dk_idx``
  contributions ``[BLOCK_N, D_I]`` are added to the gathered key rows with fp32 atomics (the selection is a
  scatter). ``2·(H·D + 3·H_I·D_I)`` FLOP per selected element, plus ``4·D_I`` bytes of atomics.

fp16 inputs: ``dI`` is tiny (``~g/N``, and ``g = 1/rows`` under ``reduction="mean"``), below fp16's range. Before
a tensor-core product each row of the ``dI``-weighted operand is scaled by a power of two so its largest entry is
in ``[1, 2)``, and the fp32 product is scaled back (``SCALE_DS``; bf16 and fp32 keep fp32's exponent range).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common.interpreter import triton_interpreter_enabled
from ._helpers import _dot, _offset
from .configs import MIN_BLOCK, padded_head_dim
from .indexer_forward import (
    DENSE_CONFIGS,
    SHAPE_KEY,
    SPARSE_CONFIGS,
    _indexer_dense_allowed,
    _indexer_dense_logits,
    _indexer_dense_target,
    _indexer_sparse_logits,
    _indexer_sparse_slots,
    _indexer_sparse_target,
    launch_common,
)

#: Bytes of the dense backward's ``dI`` scratch per chunk of query rows.
DLOGITS_SCRATCH_BYTES = 64 << 20


@triton.jit
def _scaled_dot(a, b, SCALE_DS: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """``a @ b`` with ``a`` (fp32) cast to ``b``'s dtype; with ``SCALE_DS`` each row of ``a`` is first scaled by a
    power of two that puts its largest magnitude in ``[1, 2)`` (no fp16 underflow), and the product is scaled back."""
    if SCALE_DS:
        amax = tl.max(tl.abs(a), 1)
        e = tl.where(amax > 0.0, tl.maximum(tl.floor(tl.log2(tl.where(amax > 0.0, amax, 1.0))), -120.0), 0.0)
        out = _dot((a * tl.exp2(-e)[:, None]).to(b.dtype), b, DOT_PRECISION, INTERPRET) * tl.exp2(e)[:, None]
    else:
        out = _dot(a.to(b.dtype), b, DOT_PRECISION, INTERPRET)
    return out


@triton.jit
def _indexer_bwd_row_state(GRAD, PSUM, LSE_I, offsets, mask):
    """Upstream gradient, ``Σp`` and the indexer lse in base 2 of some rows (``(0, 0, +inf)`` where masked)."""
    g = tl.load(GRAD + offsets, mask=mask, other=0.0)
    psum = tl.load(PSUM + offsets, mask=mask, other=0.0)
    return g, psum, tl.load(LSE_I + offsets, mask=mask, other=float("inf")) * 1.4426950408889634


@triton.autotune(configs=DENSE_CONFIGS, key=SHAPE_KEY)
@triton.jit
def _indexer_kl_dense_bwd_dlogits_kernel(
    Q, K, QI, KI, W,  # as in the forward
    KEY_MASK,  # [B, N_K] uint8 or None
    LSE_H, GRAD, LSE_I, PSUM,  # [B, H, N_Q], [B, N_Q] x3 fp32 contiguous: saved state and upstream gradient
    DI,  # [B, CHUNK, N_K] fp32 out: dKL/dI of rows ROW0..ROW_END (relative row index), for the visited key tiles
    stride_q_b, stride_q_h, stride_q_n, stride_q_d,
    stride_k_b, stride_k_h, stride_k_n, stride_k_d,
    stride_qi_b, stride_qi_h, stride_qi_n, stride_qi_d,
    stride_ki_b, stride_ki_n, stride_ki_d,
    stride_w_b, stride_w_n, stride_w_h,
    stride_km_b, stride_km_n,
    ROW0, ROW_END, CHUNK,
    H, H_KV, GROUP, H_I, N_Q, N_K, qk_scale, inv_heads,
    D: tl.constexpr, D_I: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_PRECISION_I: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    m_start = ROW0 + pid_m * BLOCK_M
    rows = m_start + tl.arange(0, BLOCK_M)
    row_in = rows < ROW_END
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_di = tl.arange(0, BLOCK_DI)
    km_ptr = KEY_MASK + b * stride_km_b if HAS_KEY_MASK else KEY_MASK
    state = b * N_Q + rows
    g, psum, lse_i2 = _indexer_bwd_row_state(GRAD, PSUM, LSE_I, state, row_in)
    di_rows = DI + b * CHUNK * N_K + (rows - ROW0).to(tl.int64)[:, None] * N_K
    hi = N_K
    if IS_CAUSAL:
        hi = tl.maximum(tl.minimum(N_K, m_start + BLOCK_M + (N_K - N_Q)), 0)
    # this program's key tile, unless the whole tile is past every row's causal limit (no iteration then)
    for n0 in range(pid_n * BLOCK_N, tl.minimum(hi, (pid_n + 1) * BLOCK_N), BLOCK_N):
        keys = n0 + offs_n
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
        allowed = _indexer_dense_allowed(rows, keys, km_ptr, stride_km_n, N_Q, N_K, IS_CAUSAL, HAS_KEY_MASK)
        q_prob = tl.exp2(logits * 1.4426950408889634 - lse_i2[:, None])
        di = tl.where(allowed, g[:, None] * (psum[:, None] * q_prob - p), 0.0)
        tl.store(di_rows + keys[None, :], di, mask=row_in[:, None] & (keys < N_K)[None, :])


@triton.autotune(configs=DENSE_CONFIGS, key=["H_I", "D_I", "IS_CAUSAL", "SCALE_DS"])
@triton.jit
def _indexer_kl_dense_bwd_dq_kernel(
    QI, KI, W,  # [B, H_I, N_Q, D_I], [B, N_K, D_I], [B, N_Q, H_I]; any strides
    DI,  # [B, CHUNK, N_K] fp32 from the dlogits kernel
    DQI,  # [B, H_I, N_Q, D_I] contiguous out, input dtype
    DW,  # [B, N_Q, H_I] fp32 contiguous out
    stride_qi_b, stride_qi_h, stride_qi_n, stride_qi_d,
    stride_ki_b, stride_ki_n, stride_ki_d,
    stride_w_b, stride_w_n, stride_w_h,
    ROW0, ROW_END, CHUNK, H_I, N_Q, N_K,
    D_I: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, SCALE_DS: tl.constexpr,
    DOT_PRECISION_I: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bj = tl.program_id(1)
    b = (pid_bj // H_I).to(tl.int64)
    j = (pid_bj % H_I).to(tl.int64)
    m_start = ROW0 + pid_m * BLOCK_M
    rows = m_start + tl.arange(0, BLOCK_M)
    row_in = rows < ROW_END
    offs_n = tl.arange(0, BLOCK_N)
    offs_di = tl.arange(0, BLOCK_DI)
    di_mask = offs_di < D_I
    qi = tl.load(QI + b * stride_qi_b + j * stride_qi_h + _offset(rows, stride_qi_n, WIDE)[:, None]
                 + offs_di[None, :] * stride_qi_d, mask=row_in[:, None] & di_mask[None, :], other=0.0)
    ki_base = KI + b * stride_ki_b + offs_di[:, None] * stride_ki_d
    di_rows = DI + b * CHUNK * N_K + (rows - ROW0).to(tl.int64)[:, None] * N_K
    dq = tl.zeros((BLOCK_M, BLOCK_DI), tl.float32)
    dw = tl.zeros((BLOCK_M,), tl.float32)
    hi = N_K
    if IS_CAUSAL:
        hi = tl.maximum(tl.minimum(N_K, m_start + BLOCK_M + (N_K - N_Q)), 0)
    for n0 in range(0, hi, BLOCK_N):
        keys = n0 + offs_n
        key_in = keys < N_K
        ki_t = tl.load(ki_base + _offset(keys, stride_ki_n, WIDE)[None, :], mask=key_in[None, :] & di_mask[:, None],
                       other=0.0)
        r = _dot(qi, ki_t, DOT_PRECISION_I, INTERPRET)
        di_ok = row_in[:, None] & key_in[None, :]
        if IS_CAUSAL:  # entries past the diagonal may be unwritten scratch
            di_ok = di_ok & (keys[None, :] <= rows[:, None] + (N_K - N_Q))
        di = tl.load(di_rows + keys[None, :], mask=di_ok, other=0.0)
        di = tl.where(di_ok, di, 0.0)
        dw += tl.sum(di * tl.maximum(r, 0.0), 1)
        dq += _scaled_dot(tl.where(r > 0.0, di, 0.0), tl.trans(ki_t), SCALE_DS, DOT_PRECISION_I, INTERPRET)
    w = tl.load(W + b * stride_w_b + _offset(rows, stride_w_n, WIDE) + j * stride_w_h, mask=row_in,
                other=0.0).to(tl.float32)
    out_rows = (b * H_I + j) * N_Q + rows.to(tl.int64)
    tl.store(DQI + out_rows[:, None] * D_I + offs_di[None, :], (dq * w[:, None]).to(DQI.dtype.element_ty),
             mask=row_in[:, None] & di_mask[None, :])
    tl.store(DW + (b * N_Q + rows.to(tl.int64)) * H_I + j, dw, mask=row_in)


@triton.autotune(configs=DENSE_CONFIGS, key=["H_I", "D_I", "IS_CAUSAL", "SCALE_DS"], restore_value=["DK"])
@triton.jit
def _indexer_kl_dense_bwd_dk_kernel(
    QI, KI, W,  # [B, H_I, N_Q, D_I], [B, N_K, D_I], [B, N_Q, H_I]; any strides
    DI,  # [B, CHUNK, N_K] fp32 from the dlogits kernel
    DK,  # [B, N_K, D_I] fp32 contiguous accumulator: each program adds its rows' contribution atomically
    stride_qi_b, stride_qi_h, stride_qi_n, stride_qi_d,
    stride_ki_b, stride_ki_n, stride_ki_d,
    stride_w_b, stride_w_n, stride_w_h,
    ROW0, ROW_END, CHUNK, SPLIT_M,  # this launch's rows ROW0..ROW_END, SPLIT_M (a multiple of BLOCK_M) per program
    H_I, N_Q, N_K,
    D_I: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, SCALE_DS: tl.constexpr,
    DOT_PRECISION_I: tl.constexpr, INTERPRET: tl.constexpr, WIDE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    n0 = pid_n * BLOCK_N
    keys = n0 + tl.arange(0, BLOCK_N)
    key_in = keys < N_K
    offs_m = tl.arange(0, BLOCK_M)
    offs_di = tl.arange(0, BLOCK_DI)
    di_mask = offs_di < D_I
    ki = tl.load(KI + b * stride_ki_b + _offset(keys, stride_ki_n, WIDE)[:, None] + offs_di[None, :] * stride_ki_d,
                 mask=key_in[:, None] & di_mask[None, :], other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_DI), tl.float32)
    row_lo = ROW0 + split * SPLIT_M
    row_hi = tl.minimum(ROW_END, row_lo + SPLIT_M)
    m_begin = row_lo
    if IS_CAUSAL:  # rows before n0 - (N_K - N_Q) cannot see this key tile
        m_begin = row_lo + (tl.maximum(n0 - (N_K - N_Q) - row_lo, 0) // BLOCK_M) * BLOCK_M
    for m0 in range(m_begin, row_hi, BLOCK_M):
        rows = m0 + offs_m
        row_in = rows < row_hi
        di_ok = key_in[:, None] & row_in[None, :]
        if IS_CAUSAL:
            di_ok = di_ok & (keys[:, None] <= rows[None, :] + (N_K - N_Q))
        di_t = tl.load(DI + b * CHUNK * N_K + (rows - ROW0).to(tl.int64)[None, :] * N_K + keys[:, None], mask=di_ok,
                       other=0.0)
        di_t = tl.where(di_ok, di_t, 0.0)  # [BLOCK_N, BLOCK_M]
        qi_rows = _offset(rows, stride_qi_n, WIDE)[:, None] + offs_di[None, :] * stride_qi_d
        w_rows = W + b * stride_w_b + _offset(rows, stride_w_n, WIDE)
        for j in range(0, H_I):
            qi = tl.load(QI + b * stride_qi_b + tl.cast(j, tl.int64) * stride_qi_h + qi_rows,
                         mask=row_in[:, None] & di_mask[None, :], other=0.0)
            w = tl.load(w_rows + j * stride_w_h, mask=row_in, other=0.0).to(tl.float32)
            r_t = _dot(ki, tl.trans(qi), DOT_PRECISION_I, INTERPRET)  # [BLOCK_N, BLOCK_M]
            ds_t = tl.where(r_t > 0.0, di_t * w[None, :], 0.0)
            dk += _scaled_dot(ds_t, qi, SCALE_DS, DOT_PRECISION_I, INTERPRET)
    if m_begin < row_hi:
        tl.atomic_add(DK + (b * N_K + keys.to(tl.int64))[:, None] * D_I + offs_di[None, :], dk,
                      mask=key_in[:, None] & di_mask[None, :], sem="relaxed")


@triton.autotune(configs=SPARSE_CONFIGS, key=[*SHAPE_KEY, "SCALE_DS"], reset_to_zero=["DK"])
@triton.jit
def _indexer_kl_sparse_bwd_kernel(
    Q, K, QI, KI, W,  # as in the forward
    TOPK,  # [B, N_Q, K] int32/int64 contiguous
    KEY_MASK,  # [B, N_K] uint8 or None
    LSE_H, GRAD, LSE_I, PSUM,  # [B, H, N_Q], [B, N_Q] x3 fp32 contiguous
    DQI,  # [B, H_I, N_Q, D_I] contiguous out, input dtype
    DW,  # [B, N_Q, H_I] fp32 contiguous out
    DK,  # [B, N_K, D_I] fp32 contiguous, zero-initialised: atomically accumulated
    stride_q_b, stride_q_h, stride_q_n, stride_q_d,
    stride_k_b, stride_k_h, stride_k_n, stride_k_d,
    stride_qi_b, stride_qi_h, stride_qi_n, stride_qi_d,
    stride_ki_b, stride_ki_n, stride_ki_d,
    stride_w_b, stride_w_n, stride_w_h,
    stride_km_b, stride_km_n,
    H, H_KV, GROUP, H_I, N_Q, N_K, N_SEL, qk_scale, inv_heads,
    D: tl.constexpr, D_I: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr, SCALE_DS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_PRECISION_I: tl.constexpr, INTERPRET: tl.constexpr,
):
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    t64 = t.to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_di = tl.arange(0, BLOCK_DI)
    offs_j = tl.arange(0, BLOCK_HI)
    j_in = offs_j < H_I
    di_mask = offs_di < D_I
    qi = tl.load(QI + b * stride_qi_b + offs_j.to(tl.int64)[:, None] * stride_qi_h + t64 * stride_qi_n
                 + offs_di[None, :] * stride_qi_d, mask=j_in[:, None] & di_mask[None, :], other=0.0)
    w = tl.load(W + b * stride_w_b + t64 * stride_w_n + offs_j * stride_w_h, mask=j_in, other=0.0).to(tl.float32)
    km_ptr = KEY_MASK + b * stride_km_b if HAS_KEY_MASK else KEY_MASK
    topk_row = TOPK + (b * N_Q + t) * N_SEL
    state = b * N_Q + t
    g, psum, lse_i2 = _indexer_bwd_row_state(GRAD, PSUM, LSE_I, state + tl.arange(0, 1), t + tl.arange(0, 1) < N_Q)
    dq = tl.zeros((BLOCK_HI, BLOCK_DI), tl.float32)
    dw = tl.zeros((BLOCK_HI,), tl.float32)
    for i0 in range(0, N_SEL, BLOCK_N):
        keys, ok = _indexer_sparse_slots(topk_row, km_ptr, stride_km_n, t, i0 + tl.arange(0, BLOCK_N), N_SEL, N_Q, N_K,
                                         IS_CAUSAL, HAS_KEY_MASK)
        logits, r, ki_t = _indexer_sparse_logits(qi, w, KI, b, keys, ok, offs_di, stride_ki_b, stride_ki_n,
                                                 stride_ki_d, D_I, DOT_PRECISION_I, INTERPRET)
        p = _indexer_sparse_target(
            Q, K, LSE_H, b, t, keys, ok, offs_g, offs_d, stride_q_b, stride_q_h, stride_q_n, stride_q_d,
            stride_k_b, stride_k_h, stride_k_n, stride_k_d, H, H_KV, GROUP, N_Q, qk_scale, inv_heads,
            D, BLOCK_N, DOT_PRECISION, INTERPRET,
        )
        di = tl.where(ok, g * (psum * tl.exp2(logits * 1.4426950408889634 - lse_i2) - p), 0.0)  # [BLOCK_N]
        dw += tl.sum(di[None, :] * tl.maximum(r, 0.0), 1)
        ds = tl.where(r > 0.0, di[None, :], 0.0)  # [BLOCK_HI, BLOCK_N]
        dq += _scaled_dot(ds, tl.trans(ki_t), SCALE_DS, DOT_PRECISION_I, INTERPRET)
        dk = _scaled_dot(tl.trans(ds * w[:, None]), qi, SCALE_DS, DOT_PRECISION_I, INTERPRET)  # [BLOCK_N, BLOCK_DI]
        tl.atomic_add(DK + (b * N_K + keys.to(tl.int64))[:, None] * D_I + offs_di[None, :], dk,
                      mask=ok[:, None] & di_mask[None, :], sem="relaxed")
    out_rows = (b * H_I + offs_j.to(tl.int64)) * N_Q + t64
    tl.store(DQI + out_rows[:, None] * D_I + offs_di[None, :], (dq * w[:, None]).to(DQI.dtype.element_ty),
             mask=j_in[:, None] & di_mask[None, :])
    tl.store(DW + state * H_I + offs_j, dw, mask=j_in)


def dense_chunk_rows(batch: int, n_q: int, n_k: int) -> int:
    """Query rows per dense backward chunk: the ``[B, rows, N_k]`` fp32 ``dI`` scratch stays within
    ``DLOGITS_SCRATCH_BYTES`` (at least 128 rows, and a multiple of 128)."""
    rows = DLOGITS_SCRATCH_BYTES // max(1, 4 * batch * n_k)
    return max(1, min(n_q, max(128, rows // 128 * 128)))


def row_splits(batch: int, rows: int, n_k: int, device: torch.device) -> int:
    """Rows per program of the key-stationary ``dk_idx`` kernel (a multiple of 128, of every ``BLOCK_M``): enough
    (key block, row range) programs to fill the GPU twice over at ``BLOCK_N = 64``. Under the interpreter, two
    smallest tiles, so the tests exercise the atomic sum."""
    if triton_interpreter_enabled():
        return 2 * MIN_BLOCK
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    splits = max(1, min(triton.cdiv(programs, batch * triton.cdiv(n_k, 64)), triton.cdiv(rows, 128)))
    return triton.cdiv(triton.cdiv(rows, splits), 128) * 128


def indexer_kl_bwd(
    grad_kl: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    lse_h: torch.Tensor,
    lse_index: torch.Tensor,
    psum: torch.Tensor,
    topk_indices: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward; returns ``(dq_idx, dk_idx, dw_idx)`` (``dq_idx`` in the input dtype, the others fp32,
    cast by the caller) for the state :func:`streamkl._triton.indexer_forward.indexer_kl_fwd` saved."""
    batch, _, n_q, _ = q.shape
    n_k = k.shape[2]
    device = q.device
    dq_idx = torch.empty(q_idx.shape, dtype=q_idx.dtype, device=device)
    dw = torch.empty(w_idx.shape, dtype=torch.float32, device=device)
    dk = torch.zeros(k_idx.shape, dtype=torch.float32, device=device)
    if batch * n_q == 0 or n_k == 0:
        return dq_idx.zero_(), dk, dw.zero_()
    km = None if key_padding_mask is None else key_padding_mask.view(torch.uint8)
    c = launch_common(q, k, q_idx, k_idx, w_idx, km, causal, scale)
    strides = c.pop("strides")
    c.pop("batch")
    grad_kl = grad_kl.to(torch.float32).contiguous()
    lse_h = lse_h.to(torch.float32).contiguous()
    scale_ds = q_idx.dtype == torch.float16
    if topk_indices is not None:
        c.pop("WIDE")
        topk = topk_indices.contiguous()
        _indexer_kl_sparse_bwd_kernel[(n_q, batch)](
            q, k, q_idx, k_idx, w_idx, topk, km, lse_h, grad_kl, lse_index, psum, dq_idx, dw, dk, *strides,
            N_SEL=topk.shape[2], BLOCK_G=padded_head_dim(c["GROUP"]), BLOCK_HI=padded_head_dim(c["H_I"]),
            SCALE_DS=scale_ds, **c,
        )
        return dq_idx, dk, dw
    chunk = dense_chunk_rows(batch, n_q, n_k)
    di = torch.empty((batch, chunk, n_k), dtype=torch.float32, device=device)
    index_strides = strides[8:18]  # q_idx, k_idx, w_idx
    index_flags = dict(H_I=c["H_I"], N_Q=n_q, N_K=n_k, D_I=c["D_I"], BLOCK_DI=c["BLOCK_DI"], IS_CAUSAL=causal,
                       SCALE_DS=scale_ds, DOT_PRECISION_I=c["DOT_PRECISION_I"], INTERPRET=c["INTERPRET"],
                       WIDE=c["WIDE"])
    split_m = row_splits(batch, min(chunk, n_q), n_k, device)
    for row0 in range(0, n_q, chunk):
        row_end = min(row0 + chunk, n_q)
        rows_grid = lambda meta, n=row_end - row0: (triton.cdiv(n, meta["BLOCK_M"]), triton.cdiv(n_k, meta["BLOCK_N"]),
                                                    batch)
        _indexer_kl_dense_bwd_dlogits_kernel[rows_grid](
            q, k, q_idx, k_idx, w_idx, km, lse_h, grad_kl, lse_index, psum, di, *strides, row0, row_end, chunk, **c,
        )
        heads_grid = lambda meta, n=row_end - row0: (triton.cdiv(n, meta["BLOCK_M"]), batch * c["H_I"])
        _indexer_kl_dense_bwd_dq_kernel[heads_grid](
            q_idx, k_idx, w_idx, di, dq_idx, dw, *index_strides, row0, row_end, chunk, **index_flags,
        )
        keys_grid = lambda meta, n=row_end - row0: (triton.cdiv(n_k, meta["BLOCK_N"]), triton.cdiv(n, split_m), batch)
        _indexer_kl_dense_bwd_dk_kernel[keys_grid](
            q_idx, k_idx, w_idx, di, dk, *index_strides, row0, row_end, chunk, split_m, **index_flags,
        )
    return dq_idx, dk, dw
