"""Hopper (sm_90) key pass of the attention-KL backward in Gluon: the student's key gradient with the score products
of the next query tile in flight during the exponentials of this one.

The training path with a frozen teacher (``direction="forward"``; docs/concepts/kernels.md) runs one backward kernel:
the portable key-stationary pass (:func:`streamkl._triton.backward._attention_kl_bwd_dk_kernel` with only side b's
gradient and no atomics). Per key tile it sweeps the query tiles of every query head that shares the student's key
head, recomputes both score tiles (transposed: keys × queries), forms

    dSᵀ = g · (P_b − P_a)ᵀ,   P = exp2(score · qk_scale − lse · log2 e),

and accumulates ``dK_b += dSᵀ · Q_b``: 3 products and 2 exponentials per score element. This kernel computes the
same thing with

* the student's and teacher's key tiles loaded once per program by TMA, and query tiles of both sides arriving by TMA
  into a ring of ``STAGES`` shared-memory buffers, issued ``STAGES`` tiles ahead over the flattened (query head,
  query tile) sequence of the program;
* both score products of step ``t + 1`` issued asynchronously before the exponentials of step ``t`` (two register
  sets, even and odd steps, as in :mod:`streamkl._hopper.forward`), so the tensor cores run during the exponentials;
* ``dSᵀ`` rounded to the input dtype in registers and fed to the tensor cores as the register operand of
  ``dK_b += dSᵀ · Q_b`` (no shared-memory round trip); fp16 tiles scaled by the fixed power of two
  :data:`streamkl._triton_common.numerics.FP16_DS_SCALE` first, divided out at the store;
* a scalar upstream gradient (``reduction="mean"``/``"sum"``) applied once to ``dK_b`` at the end instead of to every
  element (bf16 has fp32's range, and fp16 tiles stay within ``|dS| <= 1`` before their scale, so nothing underflows
  either way; fp16 with one upstream gradient per row, whose range is unknown, stays on the portable pass);
* with a causal mask, the program's diagonal tiles (masked) swept first, one at a time, then the full tiles through
  the pipelined loop, which never masks: both tile codes live in one loop would not fit 64-query steps in the
  registers (v14). A causal sliding window (``window_left >= 0``) ends the sweep at the last query tile whose
  windows reach the program's keys; the tiles past the full ones (some rows' windows start after some of the keys)
  are masked steps too, swept with the diagonal ones; a program whose keys no row's window reaches stores zeros.

Scope (:mod:`streamkl.dispatch` runs it only there, and anything else on the portable pass): bf16 inputs on both sides,
or fp16 with a scalar upstream gradient; dense ``(B, H, N, D)`` tensors TMA can address, or packed sequences with one
offsets tensor (each program reads its sequence's on the device, as the fused forward does; query rows past a sequence's
end read lse = +inf, so they add nothing, and keys past it are not stored; a masked batch's rows likewise, from their
lengths, rows its query mask excludes read the forward's lse = +inf, and the keys its key mask drops store 0: a key's
gradient sums its own column only), head dims 64 or 128, no masks but ``key_padding_mask`` and ``query_mask`` with their
lengths, no soft-caps, causal only with ``N_k >= N_q`` (with or without a sliding window; no other window), bf16 sinks
or none (they reach the pass through the saved log-sum-exps only), only side b's gradient, and key-head groupings that
divide one another (a teacher that groups more query heads per key head than the student, or fewer: then each student
key head is split over several programs, one per teacher key head, whose fp32 parts are summed in a fixed order, so the
result stays deterministic, :func:`streamkl._problem.key_head_split`). Gluon kernels have no CPU interpreter: CI checks
the selection, the GPU suite checks this pass against the portable one and the float64 oracle.

:func:`attention_kl_key_pass_hopper` launches this kernel or the warp-specialised one of
:mod:`streamkl._hopper.key_pass_ws` (same scope; the dispatch table takes it with a causal mask and a head dim above
64), and this one with its full steps pipelined or one at a time (the table: pipelined where side b's head dim is at
most 64; with a 128-wide dK accumulator two register sets of scores spill). The two kernels' key gradients
are bitwise equal wherever both sweep the query tiles in the same order: without a mask, or when a program sweeps one
query head; with a causal mask and several query heads per program this kernel sweeps every head's diagonal first,
which changes the order of the fp32 sums (both match the float64 oracle equally).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .._problem import KLInputs, KLSpec, key_head_split
from .._triton_common.launch import KernelLauncher
from .._triton_common.numerics import side_scales
from .._triton_common.scheduling import l2_cache_bytes, longest_first_chunk
from .._triton_common.tiles import LaunchConfig
from .forward import (
    _allocate_tiles,
    _descriptor,
    _load_fixed,
    _longest_first,
    _sequence_of,
    _stored_extent,
    _tma_load,
    mask_tensors,
    sequence_grid,
    sequence_tensors,
)
from .key_pass_tiles import (
    _ds_operand,
    _ds_tile,
    _full_tiles_end,
    _query_tile_bounds,
    _row_state,
    _step_tile,
    _store_dk,
)
from .key_pass_ws import KERNEL_REGS, _ws_dk_kernel, ws_key_pass_config


@gluon.jit
def _load_queries(qa_desc, qb_desc, qa_ring, qb_ring, bars, step, steps, b, q0, h0, n_tiles, first_tile, masked_steps,
                  n_masked, n_diagonal, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, PEELED: gl.constexpr):
    """Start the TMA copies of both sides' query tiles of ``step`` (its head and tile from :func:`_step_tile`) into
    its ring slot; nothing past the last step."""
    stage = step % STAGES
    pred = step < steps
    h, tile = _step_tile(step, h0, n_tiles, first_tile, masked_steps, n_masked, n_diagonal, PEELED)
    bar = bars.index(stage)
    mbarrier.expect(bar, qa_desc.block_type.nbytes + qb_desc.block_type.nbytes, pred=pred)
    _tma_load(qa_desc, [b, h, q0 + tile * BLOCK_M, 0], bar, qa_ring.index(stage), pred=pred)
    _tma_load(qb_desc, [b, h, q0 + tile * BLOCK_M, 0], bar, qb_ring.index(stage), pred=pred)


@gluon.jit
def _step_rows(LSE_A, LSE_B, GRAD, step, b, q0, h0, H, N_Q, n_q, n_tiles, first_tile, masked_steps, n_masked,
               n_diagonal, offs_m, BLOCK_M: gl.constexpr, SCALAR_GRAD: gl.constexpr, PEELED: gl.constexpr):
    """:func:`_row_state` of ``step``'s query rows."""
    h, tile = _step_tile(step, h0, n_tiles, first_tile, masked_steps, n_masked, n_diagonal, PEELED)
    return _row_state(LSE_A, LSE_B, GRAD, h, tile, b, H, N_Q, q0, n_q, offs_m, BLOCK_M, SCALAR_GRAD)


@gluon.jit
def _issue_scores(ka, kb, qa_ring, qb_ring, bars, step, zero,
                  BLOCK_M: gl.constexpr, D_A: gl.constexpr, D_B: gl.constexpr, STAGES: gl.constexpr):
    """Wait for ``step``'s query tiles and issue both transposed score products ``K_a Q_aᵀ`` and ``K_b Q_bᵀ``
    (async)."""
    stage = step % STAGES
    mbarrier.wait(bars.index(stage), (step // STAGES) & 1)
    qa = qa_ring.index(stage).reshape([BLOCK_M, D_A]).permute((1, 0))
    qb = qb_ring.index(stage).reshape([BLOCK_M, D_B]).permute((1, 0))
    x = warpgroup_mma(ka, qa, zero, use_acc=False, is_async=True)
    y = warpgroup_mma(kb, qb, zero, use_acc=False, is_async=True)
    return x, y


@gluon.jit
def _fold_step(x, y, dk, qb_ring, step, lse2_a, lse2_b, g, rows, keys, qk_scale_a, qk_scale_b, offset, window_left,
               dot_layout: gl.constexpr, BLOCK_M: gl.constexpr, D_B: gl.constexpr, STAGES: gl.constexpr,
               MASKED: gl.constexpr, SCALAR_GRAD: gl.constexpr, HAS_LEFT: gl.constexpr):
    """``dK_b += dSᵀ · Q_b`` for one step whose score tiles ``x``, ``y`` are complete (``MASKED``: a causal
    diagonal tile, or a tile some of whose rows' windows start after some of the keys)."""
    ds = _ds_tile(x, y, lse2_a, lse2_b, g, rows, keys, qk_scale_a, qk_scale_b, offset, window_left, MASKED,
                  SCALAR_GRAD, HAS_LEFT)
    qb = qb_ring.index(step % STAGES).reshape([BLOCK_M, D_B])
    dk = warpgroup_mma(gl.convert_layout(_ds_operand(ds, qb_ring.dtype), dot_layout), qb, dk, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(dk,))


@gluon.jit
def _hopper_dk_kernel(
    qa_desc, ka_desc, qb_desc, kb_desc,  # rank-4 TMA descriptors over [B, H | H_k, N, D], blocks [1, 1, BLOCK, D]
    GRAD, LSE_A, LSE_B,  # [B, H, N_Q] fp32 contiguous (GRAD: one number when SCALAR_GRAD); lse in nats
    DK_B,  # [B, H_KB, SPLIT, N_K, D_B] contiguous: the input dtype when SPLIT == 1, else fp32 parts to sum over SPLIT
    CU_Q, CU_K,  # VARLEN (sequence_tensors): [S + 1] int32 packed offsets (one tensor for both) or [B] row lengths
    KEY_MASK,  # HAS_KEY_MASK: a masked batch's [B, N_K] key mask as bytes (mask_tensors); else None
    H, H_KB, N_Q, N_K, GROUP_A, GROUP_B,  # heads, student key heads, tokens per batch row, query heads per key head
    MAX_K,  # keys of the grid per sequence: N_K, or the longest packed sequence (VARLEN)
    SPLIT,  # programs per student key head: each sweeps GROUP_B // SPLIT query heads that share a teacher key head
    order_chunk,  # (sequence, key head, part) triples per longest-first chunk (CAUSAL, see _longest_first)
    window_left,  # HAS_LEFT (a causal sliding window): query i' = i + n_k - n_q sees keys i' - window_left .. i'
    qk_scale_a, qk_scale_b, grad_scale_b,  # base-2 score = raw product * qk_scale; dK scale of side b
    CAUSAL: gl.constexpr, SCALAR_GRAD: gl.constexpr, HAS_LEFT: gl.constexpr, VARLEN: gl.constexpr,
    HAS_KEY_MASK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    OVERLAP: gl.constexpr,
    num_warps: gl.constexpr,
):
    D_A: gl.constexpr = qa_desc.block_type.shape[3]
    D_B: gl.constexpr = qb_desc.block_type.shape[3]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D_B, 16])
    dot_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout, k_width=2)

    if CAUSAL:  # key tile 0 is seen by every query row: the longest sweeps first, over all heads of a chunk
        rank, pid_bh = _longest_first(gl.program_id(0), gl.cdiv(MAX_K, BLOCK_N), order_chunk)
        n0 = rank * BLOCK_N
    else:
        n0 = gl.program_id(0) * BLOCK_N
        pid_bh = gl.program_id(1)
    part = pid_bh % SPLIT
    hk_b = (pid_bh // SPLIT) % H_KB
    b, q0, n_q, k0, n_k = _sequence_of(CU_Q, CU_K, pid_bh // (SPLIT * H_KB), N_Q, N_K, VARLEN)
    heads = GROUP_B // SPLIT
    h0 = hk_b * GROUP_B + part * heads  # the query heads h0 .. h0 + heads - 1 share this student key head
    hk_a = h0 // GROUP_A  # and one teacher key head (SPLIT makes it so, see key_head_split)
    offset = n_k - n_q
    if CAUSAL:  # query tiles from the first row that sees key n0 to the last that sees any key of the tile; full from
        # the first that sees the whole tile, up to the last whose every row's window holds it (HAS_LEFT)
        first_tile, end_tile = _query_tile_bounds(n0, BLOCK_N, n_q, offset, window_left, BLOCK_M, HAS_LEFT)
        full_from = gl.minimum(gl.cdiv(gl.maximum(n0 + BLOCK_N - 1 - offset, 0), BLOCK_M), end_tile)
        full_end = _full_tiles_end(n0, end_tile, offset, window_left, BLOCK_M, HAS_LEFT)
    else:
        first_tile = 0
        end_tile = gl.cdiv(n_q, BLOCK_M)
        full_from = 0
        full_end = end_tile
    # without a window key n0 < n_k = n_q + offset is seen by row n_q - 1 (n_tiles >= 1); with one, maybe by no row;
    # none past a packed sequence's keys
    n_tiles = gl.where(n0 < n_k, gl.maximum(end_tile - first_tile, 0), 0)
    n_diagonal = gl.minimum(gl.maximum(full_from - first_tile, 0), n_tiles)  # diagonal tiles per query head
    n_full = gl.minimum(gl.maximum(full_end - full_from, 0), n_tiles - n_diagonal)
    n_masked = n_tiles - n_full  # the diagonal tiles and those past the full ones (a window's), per query head
    masked_steps = heads * n_masked  # swept first, one at a time; then the full ones, pipelined
    steps = heads * n_tiles

    ka_smem, kb_smem, qa_ring, qb_ring, k_bar, bars = _allocate_tiles(ka_desc, kb_desc, qa_desc, qb_desc, STAGES)
    _load_fixed(ka_desc, kb_desc, b, hk_a, hk_b, k0 + n0, k_bar, ka_smem, kb_smem)
    for s in gl.static_range(STAGES):
        _load_queries(qa_desc, qb_desc, qa_ring, qb_ring, bars, s, steps, b, q0, h0, n_tiles, first_tile, masked_steps,
                      n_masked, n_diagonal, BLOCK_M, STAGES, CAUSAL)

    keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([BLOCK_N, D_B], gl.float32, dk_layout)

    mbarrier.wait(k_bar, 0)
    ka = ka_smem.reshape([BLOCK_N, D_A])
    kb = kb_smem.reshape([BLOCK_N, D_B])
    # The masked steps first (the causal diagonal, and a window's far edge), one step at a time: their masked tile
    # code is never live beside the pipelined loop's two register sets (with both, 64-query steps spill). Then the full
    # steps: pipelined (OVERLAP), or also one at a time where two register sets of scores beside a wide dK accumulator
    # would spill (head dim 128).
    if CAUSAL:
        dk = _single_steps(ka, kb, qa_desc, qb_desc, qa_ring, qb_ring, bars, dk, zero, keys, offs_m, LSE_A, LSE_B, GRAD,
                           b, q0, h0, H, N_Q, n_q, n_tiles, first_tile, masked_steps, n_masked, n_diagonal, 0,
                           masked_steps, steps, qk_scale_a, qk_scale_b, offset, window_left, dot_layout, BLOCK_M, D_A,
                           D_B, STAGES, SCALAR_GRAD, CAUSAL, True, HAS_LEFT)
        if masked_steps < steps:
            dk = _remaining_steps(ka, kb, qa_desc, qb_desc, qa_ring, qb_ring, bars, dk, zero, keys, offs_m, LSE_A,
                                  LSE_B, GRAD, b, q0, h0, H, N_Q, n_q, n_tiles, first_tile, masked_steps, n_masked,
                                  n_diagonal, steps, qk_scale_a, qk_scale_b, offset, window_left, dot_layout, BLOCK_M,
                                  D_A, D_B, STAGES, SCALAR_GRAD, CAUSAL, OVERLAP, HAS_LEFT)
    elif steps > 0:  # (none past a packed sequence's keys)
        dk = _remaining_steps(ka, kb, qa_desc, qb_desc, qa_ring, qb_ring, bars, dk, zero, keys, offs_m, LSE_A, LSE_B,
                              GRAD, b, q0, h0, H, N_Q, n_q, n_tiles, first_tile, masked_steps, n_masked, n_diagonal,
                              steps, qk_scale_a, qk_scale_b, offset, window_left, dot_layout, BLOCK_M, D_A, D_B, STAGES,
                              SCALAR_GRAD, CAUSAL, OVERLAP, HAS_LEFT)
    mbarrier.invalidate(k_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    _store_dk(dk, DK_B, (b * H_KB + hk_b) * SPLIT + part, N_K, k0, n_k, _stored_extent(n_k, N_K, VARLEN), n0,
              grad_scale_b, GRAD, KEY_MASK, b, BLOCK_N, D_B, dk_layout, SCALAR_GRAD, qb_desc.dtype == gl.float16,
              HAS_KEY_MASK)


@gluon.jit
def _remaining_steps(ka, kb, qa_desc, qb_desc, qa_ring, qb_ring, bars, dk, zero, keys, offs_m, LSE_A, LSE_B, GRAD,
                     b, q0, h0, H, N_Q, n_q, n_tiles, first_tile, masked_steps, n_masked, n_diagonal, steps, qk_scale_a,
                     qk_scale_b, offset, window_left, dot_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                     D_A: gl.constexpr, D_B: gl.constexpr, STAGES: gl.constexpr, SCALAR_GRAD: gl.constexpr,
                     PEELED: gl.constexpr, OVERLAP: gl.constexpr, HAS_LEFT: gl.constexpr):
    """``dK_b`` after the unmasked steps ``masked_steps .. steps - 1`` (at least one): pipelined (:func:`_full_steps`)
    with ``OVERLAP``, else one at a time (:func:`_single_steps`)."""
    if OVERLAP:
        dk = _full_steps(ka, kb, qa_desc, qb_desc, qa_ring, qb_ring, bars, dk, zero, keys, offs_m, LSE_A, LSE_B, GRAD,
                         b, q0, h0, H, N_Q, n_q, n_tiles, first_tile, masked_steps, n_masked, n_diagonal, steps,
                         qk_scale_a, qk_scale_b, offset, window_left, dot_layout, BLOCK_M, D_A, D_B, STAGES,
                         SCALAR_GRAD, PEELED, HAS_LEFT)
    else:
        dk = _single_steps(ka, kb, qa_desc, qb_desc, qa_ring, qb_ring, bars, dk, zero, keys, offs_m, LSE_A, LSE_B, GRAD,
                           b, q0, h0, H, N_Q, n_q, n_tiles, first_tile, masked_steps, n_masked, n_diagonal,
                           masked_steps, steps, steps, qk_scale_a, qk_scale_b, offset, window_left, dot_layout,
                           BLOCK_M, D_A, D_B, STAGES, SCALAR_GRAD, PEELED, False, HAS_LEFT)
    return dk


@gluon.jit
def _single_steps(ka, kb, qa_desc, qb_desc, qa_ring, qb_ring, bars, dk, zero, keys, offs_m, LSE_A, LSE_B, GRAD,
                  b, q0, h0, H, N_Q, n_q, n_tiles, first_tile, masked_steps, n_masked, n_diagonal, start, stop, steps,
                  qk_scale_a, qk_scale_b, offset, window_left, dot_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                  D_A: gl.constexpr, D_B: gl.constexpr, STAGES: gl.constexpr, SCALAR_GRAD: gl.constexpr,
                  PEELED: gl.constexpr, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr):
    """``dK_b`` after the steps ``start .. stop - 1``, one at a time: each step's score products are waited for
    before its exponentials, so one register set of scores is live (``MASKED``: the masked steps)."""
    for t in range(start, stop):
        x, y = _issue_scores(ka, kb, qa_ring, qb_ring, bars, t, zero, BLOCK_M, D_A, D_B, STAGES)
        lse2_a, lse2_b, g, rows = _step_rows(LSE_A, LSE_B, GRAD, t, b, q0, h0, H, N_Q, n_q, n_tiles, first_tile,
                                             masked_steps, n_masked, n_diagonal, offs_m, BLOCK_M, SCALAR_GRAD, PEELED)
        x, y = warpgroup_mma_wait(num_outstanding=0, deps=(x, y))
        dk = _fold_step(x, y, dk, qb_ring, t, lse2_a, lse2_b, g, rows, keys, qk_scale_a, qk_scale_b, offset,
                        window_left, dot_layout, BLOCK_M, D_B, STAGES, MASKED, SCALAR_GRAD, HAS_LEFT)
        _load_queries(qa_desc, qb_desc, qa_ring, qb_ring, bars, t + STAGES, steps, b, q0, h0, n_tiles, first_tile,
                      masked_steps, n_masked, n_diagonal, BLOCK_M, STAGES, PEELED)
    return dk


@gluon.jit
def _full_steps(ka, kb, qa_desc, qb_desc, qa_ring, qb_ring, bars, dk, zero, keys, offs_m, LSE_A, LSE_B, GRAD,
                b, q0, h0, H, N_Q, n_q, n_tiles, first_tile, masked_steps, n_masked, n_diagonal, steps, qk_scale_a,
                qk_scale_b, offset, window_left, dot_layout: gl.constexpr, BLOCK_M: gl.constexpr, D_A: gl.constexpr,
                D_B: gl.constexpr, STAGES: gl.constexpr, SCALAR_GRAD: gl.constexpr, PEELED: gl.constexpr,
                HAS_LEFT: gl.constexpr):
    """``dK_b`` after the unmasked steps ``masked_steps .. steps - 1`` (at least one), each step's score products
    issued before the previous step's exponentials."""
    start = masked_steps
    x0, y0 = _issue_scores(ka, kb, qa_ring, qb_ring, bars, start, zero, BLOCK_M, D_A, D_B, STAGES)
    lse2_a0, lse2_b0, g0, rows0 = _step_rows(LSE_A, LSE_B, GRAD, start, b, q0, h0, H, N_Q, n_q, n_tiles, first_tile,
                                             masked_steps, n_masked, n_diagonal, offs_m, BLOCK_M, SCALAR_GRAD, PEELED)
    # Even steps in (x0, y0), odd ones in (x1, y1): the products in flight never share registers with the tiles
    # being folded (a loop-carried in-flight accumulator makes ptxas serialise every wgmma, its warning C7514).
    pairs = (steps - start - 1) // 2
    for p in range(pairs):
        t = start + 2 * p
        x0, y0 = warpgroup_mma_wait(num_outstanding=0, deps=(x0, y0))
        x1, y1 = _issue_scores(ka, kb, qa_ring, qb_ring, bars, t + 1, zero, BLOCK_M, D_A, D_B, STAGES)
        lse2_a1, lse2_b1, g1, rows1 = _step_rows(LSE_A, LSE_B, GRAD, t + 1, b, q0, h0, H, N_Q, n_q, n_tiles, first_tile,
                                                 masked_steps, n_masked, n_diagonal, offs_m, BLOCK_M, SCALAR_GRAD,
                                                 PEELED)
        dk = _fold_step(x0, y0, dk, qb_ring, t, lse2_a0, lse2_b0, g0, rows0, keys, qk_scale_a, qk_scale_b, offset,
                        window_left, dot_layout, BLOCK_M, D_B, STAGES, False, SCALAR_GRAD, HAS_LEFT)
        _load_queries(qa_desc, qb_desc, qa_ring, qb_ring, bars, t + STAGES, steps, b, q0, h0, n_tiles, first_tile,
                      masked_steps, n_masked, n_diagonal, BLOCK_M, STAGES, PEELED)
        x1, y1 = warpgroup_mma_wait(num_outstanding=0, deps=(x1, y1))
        x0, y0 = _issue_scores(ka, kb, qa_ring, qb_ring, bars, t + 2, zero, BLOCK_M, D_A, D_B, STAGES)
        lse2_a0, lse2_b0, g0, rows0 = _step_rows(LSE_A, LSE_B, GRAD, t + 2, b, q0, h0, H, N_Q, n_q, n_tiles, first_tile,
                                                 masked_steps, n_masked, n_diagonal, offs_m, BLOCK_M, SCALAR_GRAD,
                                                 PEELED)
        dk = _fold_step(x1, y1, dk, qb_ring, t + 1, lse2_a1, lse2_b1, g1, rows1, keys, qk_scale_a, qk_scale_b, offset,
                        window_left, dot_layout, BLOCK_M, D_B, STAGES, False, SCALAR_GRAD, HAS_LEFT)
        _load_queries(qa_desc, qb_desc, qa_ring, qb_ring, bars, t + 1 + STAGES, steps, b, q0, h0, n_tiles, first_tile,
                      masked_steps, n_masked, n_diagonal, BLOCK_M, STAGES, PEELED)
    # One or two steps are left: step start + 2·pairs is in flight in (x0, y0); its successor, if any, is the last.
    last = start + 2 * pairs
    x0, y0 = warpgroup_mma_wait(num_outstanding=0, deps=(x0, y0))
    dk = _fold_step(x0, y0, dk, qb_ring, last, lse2_a0, lse2_b0, g0, rows0, keys, qk_scale_a, qk_scale_b, offset,
                    window_left, dot_layout, BLOCK_M, D_B, STAGES, False, SCALAR_GRAD, HAS_LEFT)
    if last + 1 < steps:
        x1, y1 = _issue_scores(ka, kb, qa_ring, qb_ring, bars, last + 1, zero, BLOCK_M, D_A, D_B, STAGES)
        lse2_a1, lse2_b1, g1, rows1 = _step_rows(LSE_A, LSE_B, GRAD, last + 1, b, q0, h0, H, N_Q, n_q, n_tiles,
                                                 first_tile, masked_steps, n_masked, n_diagonal, offs_m, BLOCK_M,
                                                 SCALAR_GRAD, PEELED)
        x1, y1 = warpgroup_mma_wait(num_outstanding=0, deps=(x1, y1))
        dk = _fold_step(x1, y1, dk, qb_ring, last + 1, lse2_a1, lse2_b1, g1, rows1, keys, qk_scale_a, qk_scale_b,
                        offset, window_left, dot_layout, BLOCK_M, D_B, STAGES, False, SCALAR_GRAD, HAS_LEFT)
    return dk


_launch_dk = KernelLauncher(_hopper_dk_kernel)
_launch_ws = KernelLauncher(_ws_dk_kernel)


def hopper_key_pass_config(d_a: int, d_b: int, causal: bool) -> LaunchConfig:
    """Tiles of the one-warpgroup key pass, the fastest of the H100 sweeps (bf16, N = 8192;
    docs/concepts/kernels.md): ``block_n`` keys per program (64, one warpgroup),
    ``block_m`` queries per step, ``num_stages`` the depth of the query ring. 64-query steps, with a ring of 6 at head
    dim 64 (3 with a causal mask) and of 2 at head dim 128 (a deeper ring leaves room for one program per SM only)."""
    if max(d_a, d_b) <= 64:
        return LaunchConfig(64, 64, 4, 3 if causal else 6)
    return LaunchConfig(64, 64, 4, 2)


def attention_kl_key_pass_hopper(grad_kl: torch.Tensor, inputs: KLInputs, spec: KLSpec, lse_a: torch.Tensor,
                                 lse_b: torch.Tensor, config: LaunchConfig | None = None, *, specialised: bool,
                                 overlap: bool, dk_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Side b's key gradient ``dK_b`` (``dk_dtype``, default the input dtype; shaped like ``k_b``) of the portable key
    pass, on a Hopper kernel;
    only for problems in its scope (module docstring). ``grad_kl`` is fp32: one number (a stride-0 view, as the
    portable backward passes it) or ``[B, H, N_q]`` contiguous. ``specialised`` runs the warp-specialised kernel,
    else the one-warpgroup one, whose full steps keep two register sets in flight with ``overlap`` (the variant
    :mod:`streamkl.dispatch` selects); ``config`` the tiles (default: the kernel's own choice).

    Example (on an H100)::

        >>> q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> inputs, spec = KLInputs(q, q, q, q, *[None] * 6), KLSpec(0.125, 0.125)  # doctest: +SKIP
        >>> kl, lse_a, lse_b = attention_kl_fwd(inputs, spec)  # doctest: +SKIP
        >>> dk_b = attention_kl_key_pass_hopper(torch.ones(1, device="cuda"), inputs, spec, lse_a, lse_b,
        ...                                     specialised=False, overlap=True)  # doctest: +SKIP
    """
    q_a, k_a, q_b, k_b = inputs.q_a, inputs.k_a, inputs.q_b, inputs.k_b
    batch, heads, n_q, d_a = q_a.shape
    h_kb, n_k, d_b = k_b.shape[1], k_b.shape[2], k_b.shape[3]
    group_a, group_b = heads // k_a.shape[1], heads // h_kb
    split = key_head_split(group_a, group_b)
    dk_dtype = dk_dtype or k_b.dtype
    # with a split, each program writes fp32 parts of its student key head's gradient, summed in a fixed order below;
    # packed keys outside every sequence (none where the offsets cover every token) are never written
    seq_q, seq_k, varlen = sequence_tensors(inputs)
    key_mask = mask_tensors(inputs)[0]
    alloc = torch.zeros if varlen == 1 else torch.empty
    dk_b = alloc((batch, h_kb, split, n_k, d_b), dtype=dk_dtype if split == 1 else torch.float32, device=k_b.device)
    if dk_b.numel() == 0 or n_q == 0:
        return dk_b.zero_().sum(2).to(dk_dtype)
    causal = spec.window_right == 0
    if specialised:  # two consumers of block_n keys each per program
        launch, cfg = _launch_ws, config or ws_key_pass_config(d_a, d_b)
        keys_per_program, extra = 2 * cfg.block_n, (("num_warps", 4), ("maxnreg", KERNEL_REGS))
    else:
        launch, cfg = _launch_dk, config or hopper_key_pass_config(d_a, d_b, causal)
        keys_per_program, extra = cfg.block_n, (("OVERLAP", overlap), ("num_warps", cfg.num_warps))
    (qk_a, _), (qk_b, _) = side_scales(spec.scale_a, 0.0), side_scales(spec.scale_b, 0.0)
    sequences, rows_per_sequence, keys_per_sequence = sequence_grid(inputs, spec)
    grid = (triton.cdiv(keys_per_sequence, keys_per_program), sequences * h_kb * split)
    order_chunk = 1
    if causal:  # one-dimensional, longest sweeps first (_longest_first)
        grid = (grid[0] * grid[1], 1)
        # the queries one program sweeps
        query_bytes = (group_b // split) * rows_per_sequence * (d_a + d_b) * q_a.element_size()
        order_chunk = longest_first_chunk(query_bytes, l2_cache_bytes(q_a.device.index), sequences * h_kb * split)
    launch(
        grid,
        (_descriptor(q_a, cfg.block_m), _descriptor(k_a, cfg.block_n), _descriptor(q_b, cfg.block_m),
         _descriptor(k_b, cfg.block_n), grad_kl, lse_a, lse_b, dk_b, seq_q, seq_k, key_mask),
        (heads, h_kb, n_q, n_k, group_a, group_b, keys_per_sequence, split, order_chunk, max(spec.window_left, 0),
         qk_a, qk_b, spec.grad_scale("b")),
        (("CAUSAL", causal), ("SCALAR_GRAD", grad_kl.numel() == 1), ("HAS_LEFT", spec.window_left >= 0),
         ("VARLEN", varlen), ("HAS_KEY_MASK", key_mask is not None), ("BLOCK_M", cfg.block_m), ("BLOCK_N", cfg.block_n),
         ("STAGES", cfg.num_stages)) + extra,
    )
    return dk_b.view(batch, h_kb, n_k, d_b) if split == 1 else dk_b.sum(2).to(dk_dtype)
