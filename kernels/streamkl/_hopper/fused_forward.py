"""Hopper (sm_90) training forward with a frozen teacher, in Gluon: KL, both log-sum-exps and side b's query gradient
in one pass, the query-gradient products in flight while the warps evaluate the next tile's exponentials.

The portable fused forward (:func:`streamkl._triton.forward.attention_kl_fwd` with ``dq_b``) computes per key tile two
score products, both softmaxes, then two more products into the ``[BLOCK_M, D]`` query-gradient accumulators ``v`` and
``w`` (:func:`streamkl._triton.forward._fused_dq_fold`), each product waited for before the next step. At head dim
128 it runs two warpgroups per program whose steps the per-tile barriers keep in lockstep, so the tensor cores idle
during the exponentials (docs/perf-notes.md v17). This kernel computes the same function (the same lazy frames,
ratio ``r = z_a / z_b`` and rounding of the difference tile ``p_b·r − p_a``) with one warpgroup per program and the
key loop pipelined by hand:

* key tiles of both sides arrive by TMA into a ring of ``STAGES`` shared-memory slots, each slot refilled as soon as
  the products that read it complete;
* per tile ``t``: the softmax work of ``t`` runs while the two query-gradient products of tile ``t − 1`` are still
  on the tensor cores; then those are waited for, ``v`` and ``w`` rescaled, the score products of ``t + 1`` and the
  query-gradient products of ``t`` issued (the probability tiles are register operands, as in FlashAttention-3), and
  only the score products waited for;
* two programs fit on one SM, so one's exponentials also overlap the other's products.

Scope (anything else runs the portable kernel, :func:`supports`): the forward of a training call whose side a needs
no gradient (:func:`streamkl.autograd.fuses_dq_b`), dense ``(B, H, N, D)`` bf16 inputs TMA can address, head dims 64
or 128, no masks, windows, sinks, soft-caps or packing, causal only with ``N_k >= N_q``. Gluon kernels have no CPU
interpreter: CI checks the selection, the GPU suite this kernel against the float64 oracle and the portable kernel.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .._problem import KLInputs, KLSpec
from .._triton._helpers import LN2_C, NEG_BIG, side_scales
from .._triton._launch import KernelLauncher
from .._triton.configs import LaunchConfig
from .forward import (
    _allocate_tiles,
    _descriptor,
    _is_sm90,
    _issue_scores,
    _load_fixed,
    _load_keys,
)
from .forward import in_scope as _forward_in_scope

#: Lazy frames (the portable kernel's :data:`streamkl._triton.forward.FRAME_SLACK`): a row's reference max moves only
#: when a tile's max exceeds it by more than this many powers of two.
FRAME_SLACK = gl.constexpr(8.0)
#: A CTA-wide barrier: ``gl.thread_barrier`` in Triton 3.6, ``gl.barrier`` later.
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _lazy_max(m, tile_max, qk_scale):
    """Gluon's copy of :func:`streamkl._triton.forward._lazy_max`: ``(max, moved)``."""
    moved = tile_max * qk_scale > gl.maximum(m * qk_scale, NEG_BIG) + FRAME_SLACK
    return gl.where(moved, gl.maximum(m, tile_max), m), moved


@gluon.jit
def _fold_scores(
    x, y,  # [BLOCK_M, BLOCK_N] fp32 raw products of both sides (MMA layout)
    keys, rows,  # key indices [BLOCK_N] and local query rows [BLOCK_M] of the tile
    m_a, z_a, acc, m_b, z_b, rho,  # [BLOCK_M] running state (see the portable kernel)
    qk_scale_a, qk_scale_b, n_k, offset,  # offset = n_k - n_q: the causal diagonal of query i is key i + offset
    CAUSAL: gl.constexpr, MASKED: gl.constexpr,
):
    """The softmax work of one key tile: the running state after it, and what the query-gradient step needs, the
    tiles ``p_b`` and ``p_b·r − p_a`` (fp32), the rescalings of ``w`` and ``v`` and whether any row's frame moved."""
    diff = x * qk_scale_a - y * qk_scale_b
    if MASKED:
        allowed = gl.expand_dims(keys, 0) < n_k
        if CAUSAL:
            allowed = allowed & (gl.expand_dims(keys, 0) <= gl.expand_dims(rows, 1) + offset)
        x = gl.where(allowed, x, float("-inf"))
        y = gl.where(allowed, y, float("-inf"))
        diff = gl.where(allowed, diff, 0.0)
    m_a_new, moved_a = _lazy_max(m_a, gl.max(x, 1), qk_scale_a)
    m_b_new, moved_b = _lazy_max(m_b, gl.max(y, 1), qk_scale_b)
    mc_a = gl.maximum(m_a_new * qk_scale_a, NEG_BIG)
    alpha_a = gl.exp2(gl.maximum(m_a * qk_scale_a, NEG_BIG) - mc_a)
    p_a = gl.exp2(x * qk_scale_a - gl.expand_dims(mc_a, 1))
    z_a = z_a * alpha_a + gl.sum(p_a, 1)
    acc = acc * alpha_a + gl.sum(p_a * diff, 1)
    mc_b = gl.maximum(m_b_new * qk_scale_b, NEG_BIG)
    alpha_b = gl.exp2(gl.maximum(m_b * qk_scale_b, NEG_BIG) - mc_b)
    p_b = gl.exp2(y * qk_scale_b - gl.expand_dims(mc_b, 1))
    z_b = z_b * alpha_b + gl.sum(p_b, 1)
    r = z_a / gl.where(z_b > 0.0, z_b, 1.0)
    coef = r * alpha_b - rho * alpha_a
    d = p_b * gl.expand_dims(r, 1) - p_a
    return m_a_new, z_a, acc, m_b_new, z_b, r, p_b, d, coef, alpha_a, alpha_b, moved_a | moved_b


@gluon.jit
def _fold_any(x, y, keys, rows, m_a, z_a, acc, m_b, z_b, rho, qk_scale_a, qk_scale_b, n_k, offset, full,
              CAUSAL: gl.constexpr):
    """:func:`_fold_scores` without masks when the tile is ``full`` (every key allowed for every row), else masked."""
    if full:
        m_a, z_a, acc, m_b, z_b, r, p_b, d, coef, alpha_a, alpha_b, moved = _fold_scores(
            x, y, keys, rows, m_a, z_a, acc, m_b, z_b, rho, qk_scale_a, qk_scale_b, n_k, offset, CAUSAL, False)
    else:
        m_a, z_a, acc, m_b, z_b, r, p_b, d, coef, alpha_a, alpha_b, moved = _fold_scores(
            x, y, keys, rows, m_a, z_a, acc, m_b, z_b, rho, qk_scale_a, qk_scale_b, n_k, offset, CAUSAL, True)
    return m_a, z_a, acc, m_b, z_b, r, p_b, d, coef, alpha_a, alpha_b, moved


@gluon.jit
def _rescale(v, w, coef, alpha_a, alpha_b, moved, row_layout: gl.constexpr):
    """``w ← α_a·w + coef·v`` and ``v ← α_b·v`` where a frame moved, else only ``w += coef·v`` (one FMA per
    element; see :func:`streamkl._triton.forward._fused_dq_fold`)."""
    coef = gl.expand_dims(gl.convert_layout(coef, row_layout), 1)
    if gl.max(moved.to(gl.int32), 0) > 0:
        w = w * gl.expand_dims(gl.convert_layout(alpha_a, row_layout), 1) + coef * v
        v = v * gl.expand_dims(gl.convert_layout(alpha_b, row_layout), 1)
    else:
        w += coef * v
    return v, w


@gluon.jit
def _contain_keys(kb_ring, stage, BLOCK_N: gl.constexpr, D_B: gl.constexpr, num_warps: gl.constexpr):
    """Replace non-finite entries of side b's key tile in ring slot ``stage`` by 0, in place, before a masked tile's
    query-gradient products read it: a key a row must not see would otherwise reach it through ``0·inf``."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    tile = kb_ring.index(stage).reshape([BLOCK_N, D_B])
    k = tile.load(layout)
    tile.store(gl.where(gl.abs(k.to(gl.float32)) < float("inf"), k, gl.zeros_like(k)))
    fence_async_shared()
    _cta_barrier()


@gluon.jit
def _hopper_fused_fwd_kernel(
    qa_desc, ka_desc, qb_desc, kb_desc,  # rank-4 TMA descriptors over [B, H | H_k, N, D], blocks [1, 1, BLOCK, D]
    KL, LSE_A, LSE_B,  # [B, H, N_Q] fp32 contiguous outputs (nats; lse +inf on an empty row)
    DQ_B,  # [B, H, N_Q, D_B] contiguous, fp32 or bf16: side b's query gradient per unit upstream gradient
    H, N_Q, N_K, GROUP_A, GROUP_B,  # heads, sequence lengths, query heads per key head of each side
    qk_scale_a, qk_scale_b, grad_scale_b,  # base-2 score = raw product * qk_scale (> 0); side b's dS multiplier
    CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    OVERLAP: gl.constexpr, num_warps: gl.constexpr,
):
    D_A: gl.constexpr = qa_desc.block_type.shape[3]
    D_B: gl.constexpr = qb_desc.block_type.shape[3]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D_B, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    pid_bh = gl.program_id(1)
    if CAUSAL:  # the longest rows first
        m_start = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    else:
        m_start = gl.program_id(0) * BLOCK_M
    b = pid_bh // H
    h = pid_bh % H
    hk_a = h // GROUP_A
    hk_b = h // GROUP_B
    offset = N_K - N_Q
    if CAUSAL:
        hi = gl.minimum(N_K, m_start + BLOCK_M + offset)
        n_full = gl.minimum((m_start + offset + 1) // BLOCK_N, N_K // BLOCK_N)
    else:
        hi = N_K
        n_full = N_K // BLOCK_N
    n_tiles = gl.cdiv(hi, BLOCK_N)  # >= 1: every row has a key (N_K >= N_Q when causal)

    qa_smem, qb_smem, ka_ring, kb_ring, q_bar, bars = _allocate_tiles(qa_desc, qb_desc, ka_desc, kb_desc, STAGES)
    _load_fixed(qa_desc, qb_desc, b, h, h, m_start, q_bar, qa_smem, qb_smem)
    for s in gl.static_range(STAGES):
        _load_keys(ka_desc, kb_desc, ka_ring, kb_ring, bars, s, n_tiles, b, hk_a, hk_b, BLOCK_N, STAGES)

    rows = m_start + gl.arange(0, BLOCK_M, layout=row_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_a = gl.full([BLOCK_M], NEG_BIG, gl.float32, row_layout)
    m_b = gl.full([BLOCK_M], NEG_BIG, gl.float32, row_layout)
    z_a = gl.zeros([BLOCK_M], gl.float32, row_layout)
    z_b = gl.zeros([BLOCK_M], gl.float32, row_layout)
    acc = gl.zeros([BLOCK_M], gl.float32, row_layout)
    rho = gl.zeros([BLOCK_M], gl.float32, row_layout)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    v = gl.zeros([BLOCK_M, D_B], gl.float32, o_layout)
    w = gl.zeros([BLOCK_M, D_B], gl.float32, o_layout)

    mbarrier.wait(q_bar, 0)
    qa = qa_smem.reshape([BLOCK_M, D_A])
    qb = qb_smem.reshape([BLOCK_M, D_B])
    mbarrier.wait(bars.index(0), 0)
    x, y = _issue_scores(qa, qb, ka_ring, kb_ring, 0, zero, BLOCK_N, D_A, D_B)
    x, y = warpgroup_mma_wait(num_outstanding=0, deps=(x, y))
    if OVERLAP == 0:  # one step at a time: the softmax work of tile t, then its products and tile t + 1's scores
        for t in range(n_tiles):
            m_a, z_a, acc, m_b, z_b, rho, p_b, d, coef, alpha_a, alpha_b, moved = _fold_any(
                x, y, t * BLOCK_N + offs_n, rows, m_a, z_a, acc, m_b, z_b, rho, qk_scale_a, qk_scale_b, N_K, offset,
                t < n_full, CAUSAL)
            p_op = gl.convert_layout(p_b.to(gl.bfloat16), p_layout)
            d_op = gl.convert_layout(d.to(gl.bfloat16), p_layout)
            if t > 0:
                _load_keys(ka_desc, kb_desc, ka_ring, kb_ring, bars, t - 1 + STAGES, n_tiles, b, hk_a, hk_b, BLOCK_N,
                           STAGES)
            if CAUSAL and t >= n_full:
                _contain_keys(kb_ring, t % STAGES, BLOCK_N, D_B, num_warps)
            v, w = _rescale(v, w, coef, alpha_a, alpha_b, moved, o_row_layout)
            nxt = t + 1
            mbarrier.wait(bars.index(nxt % STAGES), (nxt // STAGES) & 1, pred=nxt < n_tiles)
            x, y = _issue_scores(qa, qb, ka_ring, kb_ring, nxt % STAGES, zero, BLOCK_N, D_A, D_B)
            kb = kb_ring.index(t % STAGES).reshape([BLOCK_N, D_B])
            v = warpgroup_mma(p_op, kb, v, is_async=True)
            w = warpgroup_mma(d_op, kb, w, is_async=True)
            x, y, v, w = warpgroup_mma_wait(num_outstanding=0, deps=(x, y, v, w))
    else:
        # Tile 0: its softmax work while tile 1's scores run (v = w = 0: nothing to rescale). The scores of a tile past
        # the last are issued on a stale slot and never read (no wgmma under a branch).
        mbarrier.wait(bars.index(1 % STAGES), (1 // STAGES) & 1, pred=n_tiles > 1)
        x_next, y_next = _issue_scores(qa, qb, ka_ring, kb_ring, 1 % STAGES, zero, BLOCK_N, D_A, D_B)
        m_a, z_a, acc, m_b, z_b, rho, p_b, d, coef, alpha_a, alpha_b, moved = _fold_any(
            x, y, offs_n, rows, m_a, z_a, acc, m_b, z_b, rho, qk_scale_a, qk_scale_b, N_K, offset, n_full > 0, CAUSAL)
        p_op = gl.convert_layout(p_b.to(gl.bfloat16), p_layout)
        d_op = gl.convert_layout(d.to(gl.bfloat16), p_layout)
        x, y = warpgroup_mma_wait(num_outstanding=0, deps=(x_next, y_next))
        if CAUSAL and n_full == 0:
            _contain_keys(kb_ring, 0, BLOCK_N, D_B, num_warps)
        for t in range(1, n_tiles):
            # In flight during tile t's softmax work: tile t - 1's query-gradient products (and tile t + 1's scores).
            nxt = t + 1
            if OVERLAP == 2:
                mbarrier.wait(bars.index(nxt % STAGES), (nxt // STAGES) & 1, pred=nxt < n_tiles)
                x_next, y_next = _issue_scores(qa, qb, ka_ring, kb_ring, nxt % STAGES, zero, BLOCK_N, D_A, D_B)
            kb = kb_ring.index((t - 1) % STAGES).reshape([BLOCK_N, D_B])
            v = warpgroup_mma(p_op, kb, v, is_async=True)
            w = warpgroup_mma(d_op, kb, w, is_async=True)
            m_a, z_a, acc, m_b, z_b, rho, p_b, d, coef, alpha_a, alpha_b, moved = _fold_any(
                x, y, t * BLOCK_N + offs_n, rows, m_a, z_a, acc, m_b, z_b, rho, qk_scale_a, qk_scale_b, N_K, offset,
                t < n_full, CAUSAL)
            p_op = gl.convert_layout(p_b.to(gl.bfloat16), p_layout)
            d_op = gl.convert_layout(d.to(gl.bfloat16), p_layout)
            if OVERLAP == 2:
                x, y, v, w = warpgroup_mma_wait(num_outstanding=0, deps=(x_next, y_next, v, w))
            else:
                v, w = warpgroup_mma_wait(num_outstanding=0, deps=(v, w))
            # Tile t - 1's slot is free: refill it. Tile t's products come next iteration: contain its keys, rescale.
            _load_keys(ka_desc, kb_desc, ka_ring, kb_ring, bars, t - 1 + STAGES, n_tiles, b, hk_a, hk_b, BLOCK_N,
                       STAGES)
            if CAUSAL and t >= n_full:
                _contain_keys(kb_ring, t % STAGES, BLOCK_N, D_B, num_warps)
            v, w = _rescale(v, w, coef, alpha_a, alpha_b, moved, o_row_layout)
            if OVERLAP == 1:
                mbarrier.wait(bars.index(nxt % STAGES), (nxt // STAGES) & 1, pred=nxt < n_tiles)
                x, y = _issue_scores(qa, qb, ka_ring, kb_ring, nxt % STAGES, zero, BLOCK_N, D_A, D_B)
                x, y = warpgroup_mma_wait(num_outstanding=0, deps=(x, y))
        kb = kb_ring.index((n_tiles - 1) % STAGES).reshape([BLOCK_N, D_B])
        v = warpgroup_mma(p_op, kb, v, is_async=True)
        w = warpgroup_mma(d_op, kb, w, is_async=True)
        v, w = warpgroup_mma_wait(num_outstanding=0, deps=(v, w))
    mbarrier.invalidate(q_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    row_in = rows < N_Q
    valid = row_in & (z_a != 0.0)  # a NaN row stays valid so that its NaN shows
    mc_a = gl.maximum(m_a * qk_scale_a, NEG_BIG)
    mc_b = gl.maximum(m_b * qk_scale_b, NEG_BIG)
    z_a_safe = gl.where(valid, z_a, 1.0)
    z_b_safe = gl.where(valid, z_b, 1.0)
    lse2_a = mc_a + gl.log2(z_a_safe)
    lse2_b = mc_b + gl.log2(z_b_safe)
    kl = gl.where(valid, (acc / z_a_safe - lse2_a + lse2_b) * LN2_C, 0.0)
    out = (b.to(gl.int64) * H + h) * N_Q + rows
    gl.store(KL + out, kl, mask=row_in)
    gl.store(LSE_A + out, gl.where(valid, lse2_a * LN2_C, float("inf")), mask=row_in)
    gl.store(LSE_B + out, gl.where(valid, lse2_b * LN2_C, float("inf")), mask=row_in)
    # dQ_b / g = grad_scale_b · Σ_j (P_b − P_a)_ij k_j = grad_scale_b · w / z_a (0 on empty rows)
    scale = gl.expand_dims(gl.convert_layout(gl.where(valid, grad_scale_b / z_a_safe, 0.0), o_row_layout), 1)
    dq = w * scale
    out_o = gl.expand_dims(gl.convert_layout(out, o_row_layout), 1)
    row_in_o = gl.expand_dims(gl.convert_layout(row_in, o_row_layout), 1)
    cols = gl.expand_dims(gl.arange(0, D_B, layout=gl.SliceLayout(0, o_layout)), 0)
    gl.store(DQ_B + out_o * D_B + cols, dq.to(DQ_B.dtype.element_ty), mask=row_in_o & (cols < D_B))


def hopper_fused_forward_config(d_a: int, d_b: int) -> LaunchConfig:
    """Tiles of the fused Hopper forward: 64 query rows, one warpgroup and a key ring small enough that two programs
    share an SM (shared memory: both query tiles and ``num_stages`` key tiles of both sides); 32-key tiles at head
    dim 128, where 64 would hold two ``[64, 64]`` score tiles beside two ``[64, 128]`` accumulators and spill."""
    if max(d_a, d_b) <= 64:
        return LaunchConfig(64, 64, 4, 4)
    return LaunchConfig(64, 32, 4, 4)  # v17a: the fastest of the sweep, still slower than the portable kernel


def overlap_depth(d_b: int) -> int:
    """What runs on the tensor cores during a tile's exponentials: 0 nothing (one step at a time), 1 the previous
    tile's query-gradient products, 2 those and the next tile's scores (two register sets of scores)."""
    return 0


def in_scope(inputs: KLInputs, spec: KLSpec) -> bool:
    """The kernel's scope (module docstring), from shapes, strides, dtypes and options alone (any device).

    Example:
        >>> q = torch.randn(1, 2, 256, 64, dtype=torch.bfloat16)
        >>> in_scope(KLInputs(q, q, q, q, None, None, None, None, None, None), KLSpec(0.125, 0.125))
        True
        >>> in_scope(KLInputs(q, q, q, q.half(), None, None, None, None, None, None), KLSpec(0.125, 0.125))
        False
    """
    return inputs.q_a.dtype == torch.bfloat16 and _forward_in_scope(inputs, spec)


def supports(inputs: KLInputs, spec: KLSpec) -> bool:
    """True when :func:`attention_kl_fused_fwd_hopper` computes this forward: CUDA tensors on an sm_90 device and
    :func:`in_scope`."""
    q_a = inputs.q_a
    return q_a.is_cuda and _is_sm90(q_a.device.index if q_a.device.index is not None else -1) \
        and in_scope(inputs, spec)


_launch = KernelLauncher(_hopper_fused_fwd_kernel)


def attention_kl_fused_fwd_hopper(inputs: KLInputs, spec: KLSpec, dq_b: torch.Tensor,
                                  config: LaunchConfig | None = None,
                                  overlap: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused forward of :func:`streamkl._triton.forward.attention_kl_fwd` with ``dq_b`` (same outputs: ``(kl,
    lse_a, lse_b)``, each ``[B, H, N_q]`` fp32, nats, and ``dq_b`` filled with side b's query gradient per unit
    upstream gradient) on the Hopper kernel; only for problems :func:`supports` accepts.

    Example (on an H100)::

        >>> from streamkl._triton.forward import new_dq_b_buffer
        >>> q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> inputs = KLInputs(q, q, q, q, None, None, None, None, None, None)  # doctest: +SKIP
        >>> dq_b = new_dq_b_buffer(inputs)  # doctest: +SKIP
        >>> kl, lse_a, lse_b = attention_kl_fused_fwd_hopper(inputs, KLSpec(0.125, 0.125), dq_b)  # doctest: +SKIP
    """
    q_a, k_a, q_b, k_b = inputs.q_a, inputs.k_a, inputs.q_b, inputs.k_b
    batch, heads, n_q, d_a = q_a.shape
    n_k, d_b = k_a.shape[2], q_b.shape[-1]
    kl = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q_a.device)
    lse_a = torch.empty_like(kl)
    lse_b = torch.empty_like(kl)
    if kl.numel() == 0 or n_k == 0:
        kl.zero_()
        lse_a.fill_(float("inf"))
        lse_b.fill_(float("inf"))
        dq_b.zero_()
        return kl, lse_a, lse_b
    cfg = config or hopper_fused_forward_config(d_a, d_b)
    (qk_a, _), (qk_b, _) = side_scales(spec.scale_a, 0.0), side_scales(spec.scale_b, 0.0)
    grid = (triton.cdiv(n_q, cfg.block_m), batch * heads)
    _launch(
        grid,
        (_descriptor(q_a, cfg.block_m), _descriptor(k_a, cfg.block_n), _descriptor(q_b, cfg.block_m),
         _descriptor(k_b, cfg.block_n), kl, lse_a, lse_b, dq_b),
        (heads, n_q, n_k, heads // k_a.shape[1], heads // k_b.shape[1], qk_a, qk_b, spec.grad_scale("b")),
        (("CAUSAL", spec.window_right == 0), ("BLOCK_M", cfg.block_m), ("BLOCK_N", cfg.block_n),
         ("STAGES", cfg.num_stages), ("OVERLAP", overlap_depth(d_b) if overlap is None else overlap),
         ("num_warps", cfg.num_warps)),
    )
    return kl, lse_a, lse_b
