"""Hopper (sm_90) attention-KL forward in Gluon: TMA loads and asynchronous tensor-core products in flight during
the exponentials.

The portable Triton forward (:mod:`streamkl._triton.forward`) runs each key tile as *products, then softmax*: Triton
waits for the ``wgmma`` group right after issuing it, so the tensor cores idle while the exponent unit works and vice
versa. This kernel computes the same function (the same online rescaling of both distributions, the same running
state and epilogue, see :func:`streamkl._triton.forward._attention_kl_fwd_keys`) but pipelines the key loop by hand:

* key tiles of both sides arrive by TMA into a ring of ``STAGES`` shared-memory buffers (one ``mbarrier`` each), issued
  ``STAGES`` tiles ahead;
* both score products of tile ``t + 1`` are issued asynchronously (``warpgroup_mma(..., is_async=True)``) *before*
  the softmax work of tile ``t`` and waited for only at the top of the next iteration, so the tensor cores run while
  the same warps evaluate the exponentials (FlashAttention-3's intra-warpgroup overlap).

A causal grid runs the longest row tiles first in chunks of (sequence, head) pairs, as the portable forward's does
(v18, :func:`row_tile_grid`; the fused training forward shares it).

Scope (:mod:`streamkl.dispatch` runs it only there, and anything else on the portable kernels): dense ``(B, H, N, D)``
inputs with unit head-dim stride and 16-byte aligned strides, bf16 or fp16 on both sides, head dims 64 or 128, no
masks, windows, sinks, soft-caps or packing, causal only with ``N_k >= N_q``. Gluon kernels have no CPU interpreter:
CI checks the selection (:mod:`streamkl.dispatch`), the GPU suite checks this kernel against the portable one and the
float64 oracle.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .._problem import KLInputs, KLSpec
from .._triton_common.launch import KernelLauncher
from .._triton_common.numerics import LN2_C, LOG2E_C, NEG_BIG, side_scales
from .._triton_common.scheduling import key_bytes_per_head, l2_cache_bytes, longest_first_chunk
from .._triton_common.tiles import LaunchConfig

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
#: The TMA tile load: ``async_copy_global_to_shared`` in Triton 3.6, renamed ``async_load`` later (3.9 raises on the
#: old name).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _fold_tile(
    x, y,  # [BLOCK_M, BLOCK_N] fp32 raw products of both sides (MMA layout)
    keys, rows,  # key indices [BLOCK_N] and local query rows [BLOCK_M] of the tile
    m_a, z_a, acc, m_b, z_b,  # [BLOCK_M] running state (see the portable kernel)
    qk_scale_a, qk_scale_b, n_k, offset,  # offset = n_k - n_q: the causal diagonal of query i is key i + offset
    CAUSAL: gl.constexpr, MASKED: gl.constexpr,
):
    """Fold one key tile into the running maxima, sums and coupled accumulator of both distributions (base 2)."""
    diff = x * qk_scale_a - y * qk_scale_b
    if MASKED:
        allowed = gl.expand_dims(keys, 0) < n_k
        if CAUSAL:
            allowed = allowed & (gl.expand_dims(keys, 0) <= gl.expand_dims(rows, 1) + offset)
        x = gl.where(allowed, x, float("-inf"))
        y = gl.where(allowed, y, float("-inf"))
        diff = gl.where(allowed, diff, 0.0)
    m_a_new = gl.maximum(m_a, gl.max(x, 1))
    mc_a = gl.maximum(m_a_new * qk_scale_a, NEG_BIG)
    alpha_a = gl.exp2(gl.maximum(m_a * qk_scale_a, NEG_BIG) - mc_a)
    p_a = gl.exp2(x * qk_scale_a - gl.expand_dims(mc_a, 1))
    z_a = z_a * alpha_a + gl.sum(p_a, 1)
    acc = acc * alpha_a + gl.sum(p_a * diff, 1)
    m_b_new = gl.maximum(m_b, gl.max(y, 1))
    mc_b = gl.maximum(m_b_new * qk_scale_b, NEG_BIG)
    alpha_b = gl.exp2(gl.maximum(m_b * qk_scale_b, NEG_BIG) - mc_b)
    p_b = gl.exp2(y * qk_scale_b - gl.expand_dims(mc_b, 1))
    z_b = z_b * alpha_b + gl.sum(p_b, 1)
    return m_a_new, z_a, acc, m_b_new, z_b


@gluon.jit
def _issue_scores(qa, qb, ka_ring, kb_ring, stage, zero,
                  BLOCK_N: gl.constexpr, D_A: gl.constexpr, D_B: gl.constexpr):
    """Issue both score products ``Q_a K_aᵀ`` and ``Q_b K_bᵀ`` of the key tile in ring slot ``stage`` (async)."""
    ka = ka_ring.index(stage).reshape([BLOCK_N, D_A]).permute((1, 0))
    kb = kb_ring.index(stage).reshape([BLOCK_N, D_B]).permute((1, 0))
    x = warpgroup_mma(qa, ka, zero, use_acc=False, is_async=True)
    y = warpgroup_mma(qb, kb, zero, use_acc=False, is_async=True)
    return x, y


@gluon.jit
def _load_keys(ka_desc, kb_desc, ka_ring, kb_ring, bars, tile, n_tiles, b, hk_a, hk_b,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Start the TMA copies of key tile ``tile`` of both sides into its ring slot (nothing past the last tile)."""
    stage = tile % STAGES
    pred = tile < n_tiles
    bar = bars.index(stage)
    mbarrier.expect(bar, ka_desc.block_type.nbytes + kb_desc.block_type.nbytes, pred=pred)
    _tma_load(ka_desc, [b, hk_a, tile * BLOCK_N, 0], bar, ka_ring.index(stage), pred=pred)
    _tma_load(kb_desc, [b, hk_b, tile * BLOCK_N, 0], bar, kb_ring.index(stage), pred=pred)


@gluon.jit
def _fold_any(x, y, keys, rows, m_a, z_a, acc, m_b, z_b, qk_scale_a, qk_scale_b, n_k, offset, full,
              CAUSAL: gl.constexpr):
    """:func:`_fold_tile` without masks when the tile is ``full`` (every key allowed for every row), else masked."""
    if full:
        m_a, z_a, acc, m_b, z_b = _fold_tile(x, y, keys, rows, m_a, z_a, acc, m_b, z_b, qk_scale_a, qk_scale_b, n_k,
                                             offset, CAUSAL, False)
    else:
        m_a, z_a, acc, m_b, z_b = _fold_tile(x, y, keys, rows, m_a, z_a, acc, m_b, z_b, qk_scale_a, qk_scale_b, n_k,
                                             offset, CAUSAL, True)
    return m_a, z_a, acc, m_b, z_b


@gluon.jit
def _next_tile(qa, qb, ka_desc, kb_desc, ka_ring, kb_ring, bars, t, n_tiles, b, hk_a, hk_b, zero,
               BLOCK_N: gl.constexpr, D_A: gl.constexpr, D_B: gl.constexpr, STAGES: gl.constexpr):
    """With tile ``t``'s products complete (its ring slot free): start loading tile ``t + STAGES`` into that slot,
    wait for tile ``t + 1`` and issue its products (async); returns their accumulators."""
    _load_keys(ka_desc, kb_desc, ka_ring, kb_ring, bars, t + STAGES, n_tiles, b, hk_a, hk_b, BLOCK_N, STAGES)
    nxt = t + 1
    mbarrier.wait(bars.index(nxt % STAGES), (nxt // STAGES) & 1)
    return _issue_scores(qa, qb, ka_ring, kb_ring, nxt % STAGES, zero, BLOCK_N, D_A, D_B)


@gluon.jit
def _longest_first(pid, n_tiles, chunk):
    """Gluon's copy of :func:`streamkl._triton._helpers._longest_first` (a Gluon kernel cannot call a Triton
    function): ``(rank, pair)`` of program ``pid``, pairs in chunks of ``chunk``, rank-major within a chunk."""
    per_chunk = chunk * n_tiles
    first = (pid // per_chunk) * chunk
    width = gl.minimum(chunk, gl.num_programs(0) // n_tiles - first)
    r = pid - first * n_tiles
    rank = r // width
    return rank, first + r - rank * width


@gluon.jit
def _row_tile_start(N_Q, ROWS: gl.constexpr, CAUSAL: gl.constexpr, order_chunk):
    """``(first query row, (sequence, head) pair)`` of this program of a query-stationary forward whose programs own
    ``ROWS`` rows (:func:`row_tile_grid` launches it): a causal grid is one-dimensional and runs the longest row tiles
    first, every pair's before any pair's second longest, in chunks of ``order_chunk`` pairs (:func:`_longest_first`,
    as the portable forward does since v12); otherwise the grid is (row tiles, pairs)."""
    if CAUSAL:
        n_row_tiles = gl.cdiv(N_Q, ROWS)
        rank, pid_bh = _longest_first(gl.program_id(0), n_row_tiles, order_chunk)
        m_start = (n_row_tiles - 1 - rank) * ROWS
    else:
        m_start = gl.program_id(0) * ROWS
        pid_bh = gl.program_id(1)
    return m_start, pid_bh


def forward_outputs(inputs: KLInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """``(kl, lse_a, lse_b, empty)``: the ``[B, H, N_q]`` fp32 outputs of a Gluon forward, and whether the problem has
    no query row or no key, in which case they are already final (KL 0, both lse +inf) and no kernel launches. The
    outputs of packed sequences start as empty rows: tokens outside every sequence (none where the offsets cover every
    token) are never written.

    Example:
        >>> q = torch.randn(1, 2, 0, 64)
        >>> kl, lse_a, lse_b, empty = forward_outputs(KLInputs(q, q, q, q, None, None, None, None, None, None))
        >>> empty, tuple(kl.shape)
        (True, (1, 2, 0))
    """
    q_a = inputs.q_a
    kl = torch.empty(q_a.shape[:3], dtype=torch.float32, device=q_a.device)
    lse_a = torch.empty_like(kl)
    lse_b = torch.empty_like(kl)
    empty = kl.numel() == 0 or inputs.k_a.shape[2] == 0
    if empty or sequence_tensors(inputs)[2] == 1:  # (a right-padded batch's kernels write its padding rows)
        kl.zero_()
        lse_a.fill_(float("inf"))
        lse_b.fill_(float("inf"))
    return kl, lse_a, lse_b, empty


def row_tile_grid(inputs: KLInputs, spec: KLSpec, rows: int) -> tuple[tuple[int, int], int]:
    """``(grid, order_chunk)`` of a query-stationary Gluon forward whose programs own ``rows`` query rows
    (:func:`_row_tile_start`): (row tiles, pairs) without a mask; with one, a one-dimensional grid in longest-first
    chunks of as many (sequence, head) pairs as have their keys (both sides) within half of the L2 cache
    (:func:`streamkl._triton._helpers.longest_first_chunk`, the portable forward's chunks).

    Example (on a CPU tensor the L2 cache is taken as 50 MiB):
        >>> q = torch.randn(1, 16, 8192, 64, dtype=torch.bfloat16)
        >>> row_tile_grid(KLInputs(q, q, q, q, None, None, None, None, None, None), KLSpec(0.125, 0.125), 128)
        ((64, 16), 1)
        >>> row_tile_grid(KLInputs(q, q, q, q, None, None, None, None, None, None), KLSpec(0.125, 0.125,
        ...                                                                              window_right=0), 128)
        ((1024, 1), 8)
    """
    q_a, k_a, k_b = inputs.q_a, inputs.k_a, inputs.k_b
    sequences, n_q, n_k = sequence_grid(inputs, spec, check=False)
    heads = q_a.shape[1]
    grid = (triton.cdiv(n_q, rows), sequences * heads)
    if spec.window_right != 0:
        return grid, 1
    key_bytes = key_bytes_per_head(n_k, heads, (k_a.shape[-1], k_a.dtype, k_a.shape[1]),
                                   (k_b.shape[-1], k_b.dtype, k_b.shape[1]))
    l2_bytes = l2_cache_bytes(q_a.device.index if q_a.is_cuda else -1)
    return (grid[0] * grid[1], 1), longest_first_chunk(key_bytes, l2_bytes, grid[1])


@gluon.jit
def _allocate_tiles(fixed_a_desc, fixed_b_desc, ring_a_desc, ring_b_desc, STAGES: gl.constexpr):
    """Shared memory of one program: a tile of each side that stays for the whole sweep (one ``mbarrier``) and a ring
    of ``STAGES`` tiles of each side that streams through it (one ``mbarrier`` per slot), barriers initialised."""
    dtype: gl.constexpr = fixed_a_desc.dtype
    fixed_a = gl.allocate_shared_memory(dtype, fixed_a_desc.block_type.shape, fixed_a_desc.layout)
    fixed_b = gl.allocate_shared_memory(dtype, fixed_b_desc.block_type.shape, fixed_b_desc.layout)
    ring_a = gl.allocate_shared_memory(dtype, [STAGES] + ring_a_desc.block_type.shape, ring_a_desc.layout)
    ring_b = gl.allocate_shared_memory(dtype, [STAGES] + ring_b_desc.block_type.shape, ring_b_desc.layout)
    fixed_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(fixed_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    return fixed_a, fixed_b, ring_a, ring_b, fixed_bar, bars


@gluon.jit
def _load_fixed(a_desc, b_desc, b, h_a, h_b, row, bar, a_smem, b_smem):
    """Start the TMA copies of both sides' fixed tiles (rows from ``row`` of heads ``h_a``, ``h_b`` of sequence
    ``b``) on one barrier."""
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    _tma_load(a_desc, [b, h_a, row, 0], bar, a_smem)
    _tma_load(b_desc, [b, h_b, row, 0], bar, b_smem)


@gluon.jit
def _sequence_of(CU_Q, CU_K, s, N_Q, N_K, VARLEN: gl.constexpr):
    """``(b, q0, n_q, k0, n_k)`` of a program's sequence ``s`` (:func:`sequence_tensors`): with ``VARLEN == 1``,
    packed sequence ``s`` (batch row 0, queries ``q0 .. q0 + n_q - 1`` and keys ``k0 .. k0 + n_k - 1`` from the
    offsets ``CU_Q``, ``CU_K``); with ``VARLEN == 2``, batch row ``s`` of a masked batch, its first ``CU_Q[s]``
    queries and ``CU_K[s]`` keys; else batch row ``s``, all its ``N_Q`` queries and ``N_K`` keys."""
    if VARLEN == 1:
        q0 = gl.load(CU_Q + s)
        n_q = gl.load(CU_Q + s + 1) - q0
        k0 = gl.load(CU_K + s)
        n_k = gl.load(CU_K + s + 1) - k0
        b = s * 0
    elif VARLEN == 2:
        q0 = s * 0
        n_q = gl.load(CU_Q + s)
        k0 = q0
        n_k = gl.load(CU_K + s)
        b = s
    else:
        q0 = s * 0
        n_q = q0 + N_Q
        k0 = q0
        n_k = q0 + N_K
        b = s
    return b, q0, n_q, k0, n_k


@gluon.jit
def _stored_extent(n, N, VARLEN: gl.constexpr):
    """How far a program of a sequence of ``n`` rows (or keys) writes its outputs: ``n``, or, in a masked batch
    (``VARLEN == 2``), its batch row's ``N``: a right-padded row's programs also write its padding (empty rows, zero
    key gradients), which nothing else covers."""
    extent = n
    if VARLEN == 2:
        extent = n * 0 + N
    return extent


@gluon.jit
def _store_kl_lse(m_a, z_a, acc, m_b, z_b, rows, KL, LSE_A, LSE_B, SINK_A, SINK_B, b, h, H, N_Q, q0, n_q, n_store,
                  qk_scale_a, qk_scale_b, HAS_SINKS: gl.constexpr):
    """Write the KL and both log-sum-exps of rows ``rows`` (of the sequence whose ``n_q`` rows start at token ``q0``
    of a batch row of ``N_Q`` tokens; rows from ``n_q`` up to ``n_store`` as empty rows, a right-padded batch row's
    padding) from their final running state (the portable kernel's epilogue;
    ``HAS_SINKS``: head ``h``'s sink logits ``SINK_A[h]``, ``SINK_B[h]`` merged as one more outcome per side, as the
    portable kernel merges them); returns ``(valid, z_a_safe, z_b_safe, alpha_a, alpha_b, out, stored)``: which rows
    have a key, each side's sums (sinks included) with 1 elsewhere, how the sinks moved each side's frame (1
    without), the rows' flat output offsets and which rows are written."""
    row_in = rows < n_q
    valid = row_in & (z_a != 0.0)  # a NaN row stays valid so that its NaN shows
    mc_a = gl.maximum(m_a * qk_scale_a, NEG_BIG)
    mc_b = gl.maximum(m_b * qk_scale_b, NEG_BIG)
    if HAS_SINKS:  # a sink has no key vector: it moves both frames and sums once more
        s_a = gl.load(SINK_A + h).to(gl.float32) * LOG2E_C
        s_b = gl.load(SINK_B + h).to(gl.float32) * LOG2E_C
        mc_a_new = gl.maximum(mc_a, s_a)
        alpha_a = gl.exp2(mc_a - mc_a_new)
        w_a = gl.exp2(s_a - mc_a_new)
        z_a = z_a * alpha_a + w_a
        acc = acc * alpha_a + w_a * (s_a - s_b)
        mc_b_new = gl.maximum(mc_b, s_b)
        alpha_b = gl.exp2(mc_b - mc_b_new)
        z_b = z_b * alpha_b + gl.exp2(s_b - mc_b_new)
        mc_a = mc_a_new
        mc_b = mc_b_new
    else:
        alpha_a = gl.full_like(z_a, 1.0)
        alpha_b = alpha_a
    z_a_safe = gl.where(valid, z_a, 1.0)
    z_b_safe = gl.where(valid, z_b, 1.0)
    lse2_a = mc_a + gl.log2(z_a_safe)
    lse2_b = mc_b + gl.log2(z_b_safe)
    kl = gl.where(valid, (acc / z_a_safe - lse2_a + lse2_b) * LN2_C, 0.0)
    out = (b.to(gl.int64) * H + h) * N_Q + q0 + rows
    stored = rows < n_store
    gl.store(KL + out, kl, mask=stored)
    gl.store(LSE_A + out, gl.where(valid, lse2_a * LN2_C, float("inf")), mask=stored)
    gl.store(LSE_B + out, gl.where(valid, lse2_b * LN2_C, float("inf")), mask=stored)
    return valid, z_a_safe, z_b_safe, alpha_a, alpha_b, out, stored


@gluon.jit
def _hopper_fwd_kernel(
    qa_desc, ka_desc, qb_desc, kb_desc,  # rank-4 TMA descriptors over [B, H | H_k, N, D], blocks [1, 1, BLOCK, D]
    KL, LSE_A, LSE_B,  # [B, H, N_Q] fp32 contiguous outputs (nats; lse +inf on an empty row)
    H, N_Q, N_K, GROUP_A, GROUP_B,  # heads, sequence lengths, query heads per key head of each side
    order_chunk,  # (sequence, head) pairs per longest-first chunk (CAUSAL, see _row_tile_start)
    qk_scale_a, qk_scale_b,  # base-2 score = raw product * qk_scale (> 0)
    CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    D_A: gl.constexpr = qa_desc.block_type.shape[3]
    D_B: gl.constexpr = qb_desc.block_type.shape[3]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)

    m_start, pid_bh = _row_tile_start(N_Q, BLOCK_M, CAUSAL, order_chunk)
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
    offs_n = gl.arange(0, BLOCK_N, layout=col_layout)
    m_a = gl.full([BLOCK_M], NEG_BIG, gl.float32, row_layout)
    m_b = gl.full([BLOCK_M], NEG_BIG, gl.float32, row_layout)
    z_a = gl.zeros([BLOCK_M], gl.float32, row_layout)
    z_b = gl.zeros([BLOCK_M], gl.float32, row_layout)
    acc = gl.zeros([BLOCK_M], gl.float32, row_layout)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)

    mbarrier.wait(q_bar, 0)
    qa = qa_smem.reshape([BLOCK_M, D_A])
    qb = qb_smem.reshape([BLOCK_M, D_B])
    # Two register sets of score tiles, even tiles in (x0, y0) and odd ones in (x1, y1), so that the products in
    # flight never share registers with the tiles being folded: a loop-carried copy of an in-flight accumulator
    # makes ptxas serialise every wgmma (warning C7514).
    mbarrier.wait(bars.index(0), 0)
    x0, y0 = _issue_scores(qa, qb, ka_ring, kb_ring, 0, zero, BLOCK_N, D_A, D_B)
    pairs = (n_tiles - 1) // 2
    for p in range(pairs):
        t = 2 * p
        x0, y0 = warpgroup_mma_wait(num_outstanding=0, deps=(x0, y0))
        x1, y1 = _next_tile(qa, qb, ka_desc, kb_desc, ka_ring, kb_ring, bars, t, n_tiles, b, hk_a, hk_b, zero,
                            BLOCK_N, D_A, D_B, STAGES)
        m_a, z_a, acc, m_b, z_b = _fold_any(x0, y0, t * BLOCK_N + offs_n, rows, m_a, z_a, acc, m_b, z_b,
                                            qk_scale_a, qk_scale_b, N_K, offset, t < n_full, CAUSAL)
        x1, y1 = warpgroup_mma_wait(num_outstanding=0, deps=(x1, y1))
        x0, y0 = _next_tile(qa, qb, ka_desc, kb_desc, ka_ring, kb_ring, bars, t + 1, n_tiles, b, hk_a, hk_b, zero,
                            BLOCK_N, D_A, D_B, STAGES)
        m_a, z_a, acc, m_b, z_b = _fold_any(x1, y1, (t + 1) * BLOCK_N + offs_n, rows, m_a, z_a, acc, m_b, z_b,
                                            qk_scale_a, qk_scale_b, N_K, offset, t + 1 < n_full, CAUSAL)
    # One or two tiles are left: tile 2·pairs is in flight in (x0, y0); its successor, if any, is the last tile.
    last = 2 * pairs
    has_odd = last + 1 < n_tiles
    x0, y0 = warpgroup_mma_wait(num_outstanding=0, deps=(x0, y0))
    stage = (last + 1) % STAGES
    mbarrier.wait(bars.index(stage), ((last + 1) // STAGES) & 1, pred=has_odd)
    # Issued even without a last odd tile (then its result is discarded): no wgmma under a branch.
    x1, y1 = _issue_scores(qa, qb, ka_ring, kb_ring, stage, zero, BLOCK_N, D_A, D_B)
    m_a, z_a, acc, m_b, z_b = _fold_tile(x0, y0, last * BLOCK_N + offs_n, rows, m_a, z_a, acc, m_b, z_b,
                                         qk_scale_a, qk_scale_b, N_K, offset, CAUSAL, True)
    x1, y1 = warpgroup_mma_wait(num_outstanding=0, deps=(x1, y1))
    if has_odd:
        m_a, z_a, acc, m_b, z_b = _fold_tile(x1, y1, (last + 1) * BLOCK_N + offs_n, rows, m_a, z_a, acc, m_b, z_b,
                                             qk_scale_a, qk_scale_b, N_K, offset, CAUSAL, True)
    mbarrier.invalidate(q_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    _store_kl_lse(m_a, z_a, acc, m_b, z_b, rows, KL, LSE_A, LSE_B, None, None, b, h, H, N_Q, 0, N_Q, N_Q,
                  qk_scale_a, qk_scale_b, False)


def hopper_forward_config(d_a: int, d_b: int) -> LaunchConfig:
    """Tiles of the Hopper forward: the fastest of an H100 sweep (bf16, N = 8192,
    causal and not), 64×64 with one warpgroup; ``num_stages`` is the depth of the key ring."""
    if max(d_a, d_b) <= 64:
        return LaunchConfig(64, 64, 4, 3)
    return LaunchConfig(64, 64, 4, 2)


def sequence_tensors(inputs: KLInputs) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """``(CU_Q, CU_K, VARLEN)`` of a Gluon kernel (:func:`_sequence_of`): packed sequences' offsets (1), a masked
    batch's query and key lengths per batch row (2, :attr:`KLInputs.lengths`), or none (0).

    Example:
        >>> q = torch.randn(2, 4, 100, 64)
        >>> sequence_tensors(KLInputs(q, q, q, q, *[None] * 7, torch.tensor([[100, 60], [100, 60]])))[2]
        2
    """
    if inputs.cu_seqlens_q is not None:
        return inputs.cu_seqlens_q, inputs.cu_seqlens_k, 1
    if inputs.lengths is not None:
        return inputs.lengths[0], inputs.lengths[1], 2
    return None, None, 0


def mask_tensors(inputs: KLInputs) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(KEY_MASK, QUERY_MASK, READS_MASKS)`` of a Gluon training kernel: a masked batch's ``[B, N]`` masks as bytes
    (None where absent) and the row of :attr:`KLInputs.lengths` that says which batch rows read them per tile; all
    None without lengths (the masks then reach only the portable kernels).

    Example:
        >>> q, mask = torch.randn(2, 4, 8, 64), torch.arange(8) < torch.tensor([[8], [5]])
        >>> lengths = torch.tensor([[8, 5], [8, 5], [0, 0]], dtype=torch.int32)
        >>> key_mask, query_mask, reads = mask_tensors(KLInputs(q, q, q, q, None, None, mask, None, None, None,
        ...                                                     None, lengths))
        >>> key_mask.dtype, query_mask, reads.tolist()
        (torch.uint8, None, [0, 0])
    """
    if inputs.lengths is None:
        return None, None, None
    key_mask, query_mask = (None if m is None else m.contiguous().view(torch.uint8)
                            for m in (inputs.key_padding_mask, inputs.query_mask))
    return key_mask, query_mask, inputs.lengths[2]


def sequence_grid(inputs: KLInputs, spec: KLSpec, check: bool = True) -> tuple[int, int, int]:
    """``(sequences, n_q, n_k)`` a Gluon kernel's grid spans: the batch rows and their lengths, or, for packed
    sequences (``cu_seqlens``), their number and the longest query and key sequence (``spec.max_seqlen_*``; programs
    past a shorter sequence's end do nothing). With ``check``, a packed call checks on the device, without a
    synchronisation, that no sequence is longer than that: one that were would have rows no program computes, and
    the check fails the call (a CUDA device-side assert) instead.

    Example:
        >>> q = torch.randn(2, 4, 100, 64)
        >>> sequence_grid(KLInputs(q, q, q, q, *[None] * 6), KLSpec(0.125, 0.125))
        (2, 100, 100)
    """
    cu_q = inputs.cu_seqlens_q  # (the Gluon kernels take packed sequences with one offsets tensor for both sides)
    if cu_q is None:
        return inputs.q_a.shape[0], inputs.q_a.shape[2], inputs.k_a.shape[2]
    longest = min(spec.max_seqlen_q, spec.max_seqlen_k)
    if check:
        torch._assert_async(torch.diff(cu_q).max() <= longest,
                            f"a packed sequence is longer than max_seqlen_q/max_seqlen_k ({longest})")
    return cu_q.shape[0] - 1, spec.max_seqlen_q, spec.max_seqlen_k


@functools.lru_cache(maxsize=64)
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def _descriptor(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    block = (1, 1, block_rows, x.shape[-1])
    return TensorDescriptor(x, list(x.shape), list(x.stride()), list(block), _shared_layout(block, x.dtype))


_launch_fwd = KernelLauncher(_hopper_fwd_kernel)


def attention_kl_fwd_hopper(inputs: KLInputs, spec: KLSpec,
                            config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward of :func:`streamkl._triton.forward.attention_kl_fwd` (same outputs: ``(kl, lse_a, lse_b)``, each
    ``[B, H, N_q]`` fp32, nats) on the Hopper kernel; only for problems in its scope (module docstring).

    Example (on an H100)::

        >>> q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> kl, lse_a, lse_b = attention_kl_fwd_hopper(KLInputs(q, q, q, q, None, None, None, None, None, None),
        ...                                            KLSpec(0.125, 0.125))  # doctest: +SKIP
    """
    q_a, k_a, q_b, k_b = inputs.q_a, inputs.k_a, inputs.q_b, inputs.k_b
    heads, n_q, d_a = q_a.shape[1:]
    n_k, d_b = k_a.shape[2], q_b.shape[-1]
    kl, lse_a, lse_b, empty = forward_outputs(inputs)
    if empty:
        return kl, lse_a, lse_b
    cfg = config or hopper_forward_config(d_a, d_b)
    (qk_a, _), (qk_b, _) = side_scales(spec.scale_a, 0.0), side_scales(spec.scale_b, 0.0)
    grid, order_chunk = row_tile_grid(inputs, spec, cfg.block_m)
    _launch_fwd(
        grid,
        (_descriptor(q_a, cfg.block_m), _descriptor(k_a, cfg.block_n), _descriptor(q_b, cfg.block_m),
         _descriptor(k_b, cfg.block_n), kl, lse_a, lse_b),
        (heads, n_q, n_k, heads // k_a.shape[1], heads // k_b.shape[1], order_chunk, qk_a, qk_b),
        (("CAUSAL", spec.window_right == 0), ("BLOCK_M", cfg.block_m), ("BLOCK_N", cfg.block_n),
         ("STAGES", cfg.num_stages), ("num_warps", cfg.num_warps)),
    )
    return kl, lse_a, lse_b
