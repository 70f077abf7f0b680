"""Hopper (sm_90) training forward with a frozen teacher, in Gluon: KL, both log-sum-exps and side b's query gradient
per unit upstream gradient in one pass, warp-specialised (a producer warp, two consumer warpgroups).

The portable fused forward (:func:`streamkl._triton.forward.attention_kl_fwd` with ``dq_b``; side a frozen,
:func:`streamkl.autograd.fuses_dq_b`) computes per key tile both score products, both softmaxes and two more
products into the ``[BLOCK_M, D_b]`` query-gradient accumulators ``v`` and ``w``
(:func:`streamkl._triton.forward._fused_dq_fold`). This kernel computes the same function, step for step (the same
lazy frames, ratio ``r = z_a / z_b`` and rounding of ``p_b·r − p_a``, the same 64-key tiles), so its outputs are
bitwise the portable kernel's; it is organised as :mod:`streamkl._hopper.key_pass_ws` organises the key pass:

* one program owns ``2·BLOCK_M`` query rows: each consumer warpgroup holds ``BLOCK_M`` rows of both sides, their
  running state and their accumulators, and takes its steps one at a time;
* a producer warp (24 registers) issues the TMA copies of both sides' key tiles into a ring of ``STAGES`` slots, each
  refilled once both consumers are done with it (an ``empty`` barrier of count 2), so a key tile is read once per
  ``2·BLOCK_M`` rows, and no consumer waits for a load or synchronises with the other;
* the register budget moves from the producer to the consumers (``setmaxnreg``: 240 each).

A causal grid is one-dimensional and runs the longest row tiles first, every (sequence, head) pair's before any
pair's second longest, in chunks of pairs whose keys fit in half of the L2 cache (v18, :func:`.forward.row_tile_grid`,
the portable forward's order since v12).

With a causal mask the first consumer's rows see fewer keys: its steps past its diagonal are masked to zero. On a
step past a row's diagonal a consumer copies side b's key tile into its own scratch tile with non-finite entries
replaced by 0 and takes the query-gradient products from there: a key a row must not see cannot reach it through
``0·inf``, and the ring slot, which the other consumer may need unchanged, is never written.

A causal sliding window (``window_left >= 0``) starts the program at the tile of the first row's first key; each
consumer masks the tiles that hold keys before some of its rows' windows (and contains them through the scratch copy,
as past the diagonal), runs its full tiles unmasked, then its diagonal ones. A consumer's tiles wholly before its
rows' windows add exact zeros. Where the portable kernel decides whether a frame moved over the same rows (head dim
64: 64 rows), the outputs are bitwise its own; at head dim 128 it decides over 128 rows, each consumer over its 64, so
rows whose windows start at different tiles round ``w`` differently: the query gradient then matches it within
rounding (KL and both lse bitwise).

What was measured (docs/concepts/kernels.md, tried and lost): one warpgroup per program (two
programs per SM, v17a) was slower than the portable kernel with every schedule tried, with and without products in
flight during the exponentials. In a scratch probe, consumers taking turns on the tensor cores (FlashAttention-3's
ping-pong) were slower than consumers that both compute at once. The softmax work of two distributions outweighs the
products here, so the kernel gains by keeping both consumers computing, not by overlapping them with the products.

fp16 inputs round the tile of ``p_b·r − p_a`` scaled by a power of two, as the portable kernel does; here each row
has its own, which moves only when it must, along with the softmax rescaling (:func:`_fp16_frame`), so fp16 outputs
match the portable kernel's within fp16's rounding, not bitwise.

Packed sequences (``cu_seqlens``, one offsets tensor for queries and keys) run in the same launch: a program reads its
sequence's offsets on the device (:func:`.forward._sequence_of`) and addresses the ``(1, H, total, D)`` view from the
sequence's first token; the grid spans the longest sequence (:func:`.forward.sequence_grid`) and a program past its
sequence's rows loads no key tile. The last key tile of a sequence holds the next one's first keys: masked, and
contained through the scratch copy as past the diagonal. A masked batch (``key_padding_mask``, ``query_mask``) runs the
same way, batch row by batch row from its first token, over the rows and keys :attr:`streamkl._problem.KLInputs.lengths`
gives each (computed on the device, :func:`streamkl._pieces.padded_lengths`): a right-padded row's real tokens, whose
programs also write its padding rows as empty rows; any other row (left padding, a key mask with holes) all its tokens,
every tile of it masked with the row's key mask (and contained through the scratch copy). Rows the query mask excludes
end empty (KL 0, lse +inf, no gradient).

Scope (:mod:`streamkl.dispatch` runs it only there, and anything else on the portable kernel): dense ``(B, H, N, D)``
bf16 or fp16 inputs TMA can address, or packed sequences with one offsets tensor, head dims 64 or 128, no masks but
``key_padding_mask`` and ``query_mask`` with their lengths, no soft-caps, causal only with ``N_k >= N_q`` (with or
without a sliding window; no other window), bf16 sinks or none (merged into each row's sums at its end, as the portable
kernel merges them; the outputs then match it within fp32 rounding). Gluon kernels have no CPU interpreter: CI checks
the selection, the GPU suite checks this kernel against the portable one (bf16 without sinks: bitwise) and the float64
oracle.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .._problem import KLInputs, KLSpec
from .._triton_common.launch import KernelLauncher, contiguous_or_none
from .._triton_common.numerics import FP16_TARGET_EXPONENT, NEG_BIG, side_scales
from .._triton_common.tiles import LaunchConfig
from .forward import (
    _descriptor,
    _issue_scores,
    _row_tile_start,
    _sequence_of,
    _store_kl_lse,
    _stored_extent,
    _tma_load,
    forward_outputs,
    mask_tensors,
    row_tile_grid,
    sequence_grid,
    sequence_tensors,
)

#: Lazy frames (the portable kernel's :data:`streamkl._triton.forward.FRAME_SLACK`): a row's reference max moves only
#: when a tile's max exceeds it by more than this many powers of two.
FRAME_SLACK = gl.constexpr(8.0)
#: Consumer warpgroups per program, each of ``BLOCK_M`` rows.
CONSUMERS = gl.constexpr(2)
#: Registers per thread of each consumer warpgroup and of the producer (``setmaxnreg``): one program (two consumer
#: warpgroups and a producer warp) fills the register file, 2·240 + 24 = 3·168.
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
KERNEL_REGS = 168
#: A CTA-wide barrier (inside a warp-specialised partition: that partition's warps): ``gl.thread_barrier`` in Triton
#: 3.6, ``gl.barrier`` later.
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
    window_left,  # HAS_LEFT: query i sees keys from i + offset - window_left on
    KEY_MASK, key_row_at,  # KEY_BITS: the batch's key masks (bytes, nonzero = real key) and this row's offset
    CAUSAL: gl.constexpr, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, KEY_BITS: gl.constexpr,
):
    """The softmax work of one key tile: the running state after it, and what the query-gradient step needs, the
    tiles ``p_b`` and ``p_b·r − p_a`` (fp32), the rescalings of ``w`` and ``v`` and whether any row's frame moved
    (``MASKED``: the causal mask, the window's left edge and, with ``KEY_BITS``, the key mask applied)."""
    diff = x * qk_scale_a - y * qk_scale_b
    if MASKED:
        allowed = gl.expand_dims(keys, 0) < n_k
        if CAUSAL:
            allowed = allowed & (gl.expand_dims(keys, 0) <= gl.expand_dims(rows, 1) + offset)
        if HAS_LEFT:
            allowed = allowed & (gl.expand_dims(keys, 0) >= gl.expand_dims(rows, 1) + offset - window_left)
        if KEY_BITS:
            kept = gl.load(KEY_MASK + key_row_at + keys, mask=keys < n_k, other=0) != 0
            allowed = allowed & gl.expand_dims(kept, 0)
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
def _fold_any(x, y, keys, rows, m_a, z_a, acc, m_b, z_b, rho, qk_scale_a, qk_scale_b, n_k, offset, window_left,
              KEY_MASK, key_row_at, full, CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, KEY_BITS: gl.constexpr):
    """:func:`_fold_scores` without masks when the tile is ``full`` (every key allowed for every row), else masked."""
    if full:
        m_a, z_a, acc, m_b, z_b, r, p_b, d, coef, alpha_a, alpha_b, moved = _fold_scores(
            x, y, keys, rows, m_a, z_a, acc, m_b, z_b, rho, qk_scale_a, qk_scale_b, n_k, offset, window_left,
            KEY_MASK, key_row_at, CAUSAL, False, HAS_LEFT, False)
    else:
        m_a, z_a, acc, m_b, z_b, r, p_b, d, coef, alpha_a, alpha_b, moved = _fold_scores(
            x, y, keys, rows, m_a, z_a, acc, m_b, z_b, rho, qk_scale_a, qk_scale_b, n_k, offset, window_left,
            KEY_MASK, key_row_at, CAUSAL, True, HAS_LEFT, KEY_BITS)
    return m_a, z_a, acc, m_b, z_b, r, p_b, d, coef, alpha_a, alpha_b, moved


#: A row's fp16 frame before it is set (:func:`_fp16_frame`): never a power of two, so never a frame once set.
FP16_FRAME_UNSET = gl.constexpr(1.5)


@gluon.jit
def _fp16_frame(d, s):
    """fp16 inputs: ``(d·s', s', s'/s, moved)`` per row, ``s`` the row's power of two (``w`` is kept in units of
    ``1/s``; :data:`FP16_FRAME_UNSET` before the row's first nonzero tile, which sets it to bring the tile's largest
    ``|d|`` to ``2^(FP16_TARGET_EXPONENT - 1)``). A set frame only moves down, where the row's largest ``|d|`` would
    reach ``2^15`` once scaled, so ``w`` never grows with it (a frame that moved up after large tiles could overflow
    ``w``); ``s'/s`` (exactly 1 elsewhere) is the factor ``w`` takes with the softmax rescaling (:func:`_rescale`), so
    a moving frame costs no cross-warp reduction of its own. The portable kernel scales every tile
    (:func:`streamkl._triton._helpers._as_operand`)."""
    big = gl.max(gl.abs(d), 1)
    scaled = big * s
    moved = (scaled >= 32768.0) | ((s == FP16_FRAME_UNSET) & (scaled < 64.0) & (big > 0.0))
    exponent = ((big.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127
    k = gl.minimum(gl.maximum(FP16_TARGET_EXPONENT - 1 - exponent, -126), 126)
    s_new = gl.where(moved, ((k + 127) << 23).to(gl.float32, bitcast=True), s)
    return d * gl.expand_dims(s_new, 1), s_new, s_new / s, moved


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
def _store_rows(m_a, z_a, acc, m_b, z_b, rho, v, w, w_scale, rows, KL, LSE_A, LSE_B, DQ_B, SINK_A, SINK_B, b, h, H,
                N_Q, q0, n_q, n_store, qk_scale_a, qk_scale_b, grad_scale_b, D_B: gl.constexpr, o_layout: gl.constexpr,
                HAS_SINKS: gl.constexpr, EXCLUDES_ROWS: gl.constexpr):
    """Write the KL, both log-sum-exps (:func:`streamkl._hopper.forward._store_kl_lse`, sinks merged there with
    ``HAS_SINKS``) and side b's query gradient per unit upstream gradient of rows ``rows`` of the sequence whose
    ``n_q`` rows start at token ``q0`` from their final running state (``w`` in units of ``1/w_scale``;
    ``grad_scale_b`` already over it); rows from ``n_q`` up to ``n_store`` as empty rows. ``EXCLUDES_ROWS``: the
    empty rows' gradient is 0 whatever their state (a padding or excluded row's inputs may be anything)."""
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    valid, z_a_safe, z_b_safe, alpha_a, alpha_b, out, stored = _store_kl_lse(
        m_a, z_a, acc, m_b, z_b, rows, KL, LSE_A, LSE_B, SINK_A, SINK_B, b, h, H, N_Q, q0, n_q, n_store, qk_scale_a,
        qk_scale_b, HAS_SINKS)
    if HAS_SINKS:  # the sinks move the ratio of the sums and the frames once more (the portable kernel's epilogue)
        coef = (z_a_safe / z_b_safe * alpha_b - rho * alpha_a) * w_scale
        w = (w * gl.expand_dims(gl.convert_layout(alpha_a, o_row_layout), 1)
             + gl.expand_dims(gl.convert_layout(coef, o_row_layout), 1) * v)
    # dQ_b / g = grad_scale_b · Σ_j (P_b − P_a)_ij k_j = grad_scale_b · w / z_a (0 on empty rows)
    scale = gl.expand_dims(gl.convert_layout(gl.where(valid, grad_scale_b / z_a_safe, 0.0), o_row_layout), 1)
    dq = w * scale
    if EXCLUDES_ROWS:  # (an empty row's scale is 0)
        dq = gl.where(scale != 0.0, dq, 0.0)
    out_o = gl.expand_dims(gl.convert_layout(out, o_row_layout), 1)
    stored_o = gl.expand_dims(gl.convert_layout(stored, o_row_layout), 1)
    cols = gl.expand_dims(gl.arange(0, D_B, layout=gl.SliceLayout(0, o_layout)), 0)
    gl.store(DQ_B + out_o * D_B + cols, dq.to(DQ_B.dtype.element_ty), mask=stored_o & (cols < D_B))


@gluon.jit
def _ws_fwd_producer(qa_desc, qb_desc, ka_desc, kb_desc, qa_smem, qb_smem, ka_ring, kb_ring, ready, empty, q_bar,
                     b, h, hk_a, hk_b, q0, k0, m0, t0, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr):
    """Load both consumers' query tiles once, then key tiles ``t0 .. n_tiles - 1`` of both sides, ``STAGES`` ahead of
    the slower consumer (the sequence's queries from token ``q0``, its keys from token ``k0``)."""
    mbarrier.expect(q_bar, CONSUMERS * (qa_desc.block_type.nbytes + qb_desc.block_type.nbytes))
    for c in gl.static_range(CONSUMERS):
        _tma_load(qa_desc, [b, h, q0 + m0 + c * BLOCK_M, 0], q_bar, qa_smem.index(c))
        _tma_load(qb_desc, [b, h, q0 + m0 + c * BLOCK_M, 0], q_bar, qb_smem.index(c))
    for t in range(t0, n_tiles):
        i = t - t0  # the ring's count
        stage = i % STAGES
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        bar = ready.index(stage)
        mbarrier.expect(bar, ka_desc.block_type.nbytes + kb_desc.block_type.nbytes)
        _tma_load(ka_desc, [b, hk_a, k0 + t * BLOCK_N, 0], bar, ka_ring.index(stage))
        _tma_load(kb_desc, [b, hk_b, k0 + t * BLOCK_N, 0], bar, kb_ring.index(stage))


@gluon.jit
def _finite_copy(kb_ring, stage, scratch, BLOCK_N: gl.constexpr, D_B: gl.constexpr):
    """Copy side b's key tile in ring slot ``stage`` into ``scratch`` with non-finite entries replaced by 0, visible
    to this warpgroup's next products."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    k = kb_ring.index(stage).reshape([BLOCK_N, D_B]).load(layout)
    scratch.store(gl.where(gl.abs(k.to(gl.float32)) < float("inf"), k, gl.zeros_like(k)))
    fence_async_shared()
    _cta_barrier()


@gluon.jit
def _ws_fwd_steps(lo, hi, t0, qa, qb, ka_ring, kb_ring, scratch, ready, empty, ME: gl.constexpr,
                  m_a, z_a, acc, m_b, z_b, rho, v, w, w_scale, zero, offs_n, rows, qk_scale_a, qk_scale_b, N_K,
                  offset, window_left, KEY_MASK, key_row_at, p_layout: gl.constexpr, o_row_layout: gl.constexpr,
                  BLOCK_N: gl.constexpr, D_A: gl.constexpr, D_B: gl.constexpr, STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, MASKED: gl.constexpr, SCRATCH: gl.constexpr, HAS_LEFT: gl.constexpr,
                  KEY_BITS: gl.constexpr):
    """Key tiles ``[lo, hi)`` of consumer ``ME`` (the ring's first is tile ``t0``), one step each: its score
    products, the softmax work, the rescaling of ``v`` and ``w``, its two query-gradient products (from the scratch
    copy with ``SCRATCH``); each slot released once this consumer's products are done with it. fp16 inputs keep each
    row of ``w`` in units of ``1/w_scale`` (:func:`_fp16_frame`, one power of two per row); bf16 ones leave
    ``w_scale`` at 1."""
    for t in range(lo, hi):
        stage = (t - t0) % STAGES
        mbarrier.wait(ready.index(stage), ((t - t0) // STAGES) & 1)
        x, y = _issue_scores(qa, qb, ka_ring, kb_ring, stage, zero, BLOCK_N, D_A, D_B)
        x, y = warpgroup_mma_wait(num_outstanding=0, deps=(x, y))
        m_a, z_a, acc, m_b, z_b, rho, p_b, d, coef, alpha_a, alpha_b, moved = _fold_any(
            x, y, t * BLOCK_N + offs_n, rows, m_a, z_a, acc, m_b, z_b, rho, qk_scale_a, qk_scale_b, N_K, offset,
            window_left, KEY_MASK, key_row_at, not MASKED, CAUSAL, HAS_LEFT, KEY_BITS)
        if kb_ring.dtype == gl.float16:
            d, w_scale, frame_ratio, frame_moved = _fp16_frame(d, w_scale)
            coef = coef * w_scale
            alpha_a = alpha_a * frame_ratio
            moved = moved | frame_moved
        p_op = gl.convert_layout(p_b.to(kb_ring.dtype), p_layout)
        d_op = gl.convert_layout(d.to(kb_ring.dtype), p_layout)
        v, w = _rescale(v, w, coef, alpha_a, alpha_b, moved, o_row_layout)
        if SCRATCH:
            _finite_copy(kb_ring, stage, scratch, BLOCK_N, D_B)
            kb = scratch
        else:
            kb = kb_ring.index(stage).reshape([BLOCK_N, D_B])
        v = warpgroup_mma(p_op, kb, v, is_async=True)
        w = warpgroup_mma(d_op, kb, w, is_async=True)
        v, w = warpgroup_mma_wait(num_outstanding=0, deps=(v, w))
        mbarrier.arrive(empty.index(stage))
    return m_a, z_a, acc, m_b, z_b, rho, v, w, w_scale


@gluon.jit
def _ws_fwd_sweep(qa, qb, ka_ring, kb_ring, scratch, ready, empty, ME: gl.constexpr, m_a, z_a, acc, m_b, z_b, rho, v, w,
                  w_scale, zero, offs_n, rows, qk_scale_a, qk_scale_b, N_K, offset, window_left, KEY_MASK,
                  key_row_at, t0, full_from, n_full, n_tiles, p_layout: gl.constexpr, o_row_layout: gl.constexpr,
                  BLOCK_N: gl.constexpr, D_A: gl.constexpr, D_B: gl.constexpr, STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, VARLEN: gl.constexpr, HAS_KEY_MASK: gl.constexpr):
    """A consumer's key tiles ``t0 .. n_tiles - 1`` masked only where they must be: with ``HAS_LEFT`` those before
    ``full_from`` (keys before some row's window), then the full ones up to ``n_full`` unmasked, then those past some
    row's diagonal or the sequence's end, with ``HAS_KEY_MASK`` also by the batch row's key mask (which keeps every
    key of those tiles but where the row reads its mask, and then every tile is one of them)."""
    if HAS_LEFT:  # the tiles before every row's window starts (contained through the scratch copy)
        m_a, z_a, acc, m_b, z_b, rho, v, w, w_scale = _ws_fwd_steps(
            t0, full_from, t0, qa, qb, ka_ring, kb_ring, scratch, ready, empty, ME, m_a, z_a, acc, m_b, z_b, rho, v,
            w, w_scale, zero, offs_n, rows, qk_scale_a, qk_scale_b, N_K, offset, window_left, KEY_MASK, key_row_at,
            p_layout, o_row_layout, BLOCK_N, D_A, D_B, STAGES, CAUSAL, True, True, HAS_LEFT, False)
    m_a, z_a, acc, m_b, z_b, rho, v, w, w_scale = _ws_fwd_steps(
        full_from, n_full, t0, qa, qb, ka_ring, kb_ring, scratch, ready, empty, ME, m_a, z_a, acc, m_b, z_b, rho, v,
        w, w_scale, zero, offs_n, rows, qk_scale_a, qk_scale_b, N_K, offset, window_left, KEY_MASK, key_row_at,
        p_layout, o_row_layout, BLOCK_N, D_A, D_B, STAGES, CAUSAL, False, False, HAS_LEFT, False)
    # The masked tiles: past the diagonal (contained through the scratch copy), or the last, partial one (whose keys
    # past N_K the copy engine filled with zeros; a packed sequence's are the next one's, a padded row's its padding:
    # contained too).
    m_a, z_a, acc, m_b, z_b, rho, v, w, w_scale = _ws_fwd_steps(
        gl.maximum(n_full, full_from), n_tiles, t0, qa, qb, ka_ring, kb_ring, scratch, ready, empty, ME, m_a, z_a,
        acc, m_b, z_b, rho, v, w, w_scale, zero, offs_n, rows, qk_scale_a, qk_scale_b, N_K, offset, window_left,
        KEY_MASK, key_row_at, p_layout, o_row_layout, BLOCK_N, D_A, D_B, STAGES, CAUSAL, True, CAUSAL or VARLEN != 0,
        HAS_LEFT, HAS_KEY_MASK)
    return m_a, z_a, acc, m_b, z_b, rho, v, w, w_scale


@gluon.jit
def _ws_fwd_consumer(qa_smem, qb_smem, ka_ring, kb_ring, scratch_ring, ready, empty, q_bar, ME: gl.constexpr,
                     KL, LSE_A, LSE_B, DQ_B, SINK_A, SINK_B, b, h, H, N_Q, q0, n_q, N_K, m0, t0, n_tiles, offset,
                     window_left, KEY_MASK, key_row_at, QUERY_MASK, reads, qk_scale_a, qk_scale_b, grad_scale_b,
                     CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_SINKS: gl.constexpr, VARLEN: gl.constexpr,
                     HAS_KEY_MASK: gl.constexpr, HAS_QUERY_MASK: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Consumer ``ME`` (0 or 1): rows ``m0 + ME·BLOCK_M ..`` of the sequence (``n_q`` rows from token ``q0`` of a
    batch row of ``N_Q``; ``N_K`` keys) over the program's key tiles ``t0 .. n_tiles - 1``, then their outputs. A
    masked batch's row that ``reads`` its key mask (``HAS_KEY_MASK``; its masks keep no prefixes) masks every tile
    with it; rows its query mask excludes (``HAS_QUERY_MASK``) end empty."""
    D_A: gl.constexpr = qa_smem.type.shape[4]
    D_B: gl.constexpr = qb_smem.type.shape[4]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D_B, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    row0 = m0 + ME * BLOCK_M
    if CAUSAL:  # tiles from n_full on hold keys past some row's diagonal (for the first consumer: past all of them)
        n_full = gl.minimum(gl.minimum((row0 + offset + 1) // BLOCK_N, N_K // BLOCK_N), n_tiles)
    else:  # (none in a program past its packed sequence's rows, which has no tile)
        n_full = gl.minimum(N_K // BLOCK_N, n_tiles)
    if HAS_LEFT:  # tiles before full_from hold keys before some row's window (for the second consumer's first tiles:
        # before all of them)
        full_from = gl.maximum(gl.minimum(gl.cdiv(gl.maximum(row0 + BLOCK_M - 1 + offset - window_left, 0), BLOCK_N),
                                          n_full), t0)
    else:
        full_from = t0
    rows = row0 + gl.arange(0, BLOCK_M, layout=row_layout)
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
    scratch = scratch_ring.index(ME).reshape([BLOCK_N, D_B])

    mbarrier.wait(q_bar, 0)
    qa = qa_smem.index(ME).reshape([BLOCK_M, D_A])
    qb = qb_smem.index(ME).reshape([BLOCK_M, D_B])
    if kb_ring.dtype == gl.float16:
        w_scale = gl.full([BLOCK_M], FP16_FRAME_UNSET, gl.float32, row_layout)  # one power of two per row, once set
    else:
        w_scale = grad_scale_b * 0.0 + 1.0  # (an fp32 scalar)
    if HAS_KEY_MASK:  # a row that reads its key mask: every tile masked (the last sweep below, with the mask)
        n_full = gl.where(reads != 0, t0, n_full)
        full_from = gl.where(reads != 0, t0, full_from)
    m_a, z_a, acc, m_b, z_b, rho, v, w, w_scale = _ws_fwd_sweep(
        qa, qb, ka_ring, kb_ring, scratch, ready, empty, ME, m_a, z_a, acc, m_b, z_b, rho, v, w, w_scale, zero,
        offs_n, rows, qk_scale_a, qk_scale_b, N_K, offset, window_left, KEY_MASK, key_row_at, t0, full_from, n_full,
        n_tiles, p_layout, o_row_layout, BLOCK_N, D_A, D_B, STAGES, CAUSAL, HAS_LEFT, VARLEN, HAS_KEY_MASK)
    if HAS_QUERY_MASK:  # rows the query mask excludes end empty: KL 0, lse +inf, no gradient
        kept = gl.load(QUERY_MASK + b.to(gl.int64) * N_Q + q0 + rows, mask=rows < n_q, other=0) != 0
        z_a = gl.where(kept, z_a, 0.0)
    if kb_ring.dtype == gl.float16:
        grad_scale_b = grad_scale_b / w_scale
    _store_rows(m_a, z_a, acc, m_b, z_b, rho, v, w, w_scale, rows, KL, LSE_A, LSE_B, DQ_B, SINK_A, SINK_B, b, h, H,
                N_Q, q0, n_q, _stored_extent(n_q, N_Q, VARLEN), qk_scale_a, qk_scale_b, grad_scale_b, D_B, o_layout,
                HAS_SINKS, HAS_QUERY_MASK or VARLEN == 2)


@gluon.jit
def _ws_fused_fwd_kernel(
    qa_desc, ka_desc, qb_desc, kb_desc,  # rank-4 TMA descriptors over [B, H | H_k, N, D], blocks [1, 1, BLOCK, D]
    KL, LSE_A, LSE_B,  # [B, H, N_Q] fp32 contiguous outputs (nats; lse +inf on an empty row)
    DQ_B,  # [B, H, N_Q, D_B] contiguous, fp32 or bf16: side b's query gradient per unit upstream gradient
    SINK_A, SINK_B,  # HAS_SINKS: [H] contiguous sink logits (nats) of each side; else None
    CU_Q, CU_K,  # VARLEN (sequence_tensors): [S + 1] int32 packed offsets (one tensor for both) or [B] row lengths
    KEY_MASK, QUERY_MASK, READS_MASKS,  # a masked batch's (mask_tensors): [B, N] bytes, [B] int32; else None
    H, N_Q, N_K, GROUP_A, GROUP_B,  # heads, tokens per batch row, query heads per key head of each side
    MAX_Q,  # query rows of the grid per sequence: N_Q, or the longest packed sequence (VARLEN)
    order_chunk,  # (sequence, head) pairs per longest-first chunk (CAUSAL, see _row_tile_start)
    window_left,  # HAS_LEFT (a causal sliding window): query i sees keys i + N_K - N_Q - window_left .. i + N_K - N_Q
    qk_scale_a, qk_scale_b, grad_scale_b,  # base-2 score = raw product * qk_scale (> 0); side b's dS multiplier
    CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_SINKS: gl.constexpr, VARLEN: gl.constexpr,
    HAS_KEY_MASK: gl.constexpr, HAS_QUERY_MASK: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    m0, pid_bh = _row_tile_start(MAX_Q, CONSUMERS * BLOCK_M, CAUSAL, order_chunk)
    h = pid_bh % H
    b, q0, n_q, k0, n_k = _sequence_of(CU_Q, CU_K, pid_bh // H, N_Q, N_K, VARLEN)
    hk_a = h // GROUP_A
    hk_b = h // GROUP_B
    offset = n_k - n_q
    if CAUSAL:
        hi = gl.minimum(n_k, m0 + CONSUMERS * BLOCK_M + offset)
    else:
        hi = n_k
    # >= 1 where the program has rows: every row has a key (n_k >= n_q when causal); none past a packed sequence's end
    n_tiles = gl.where(m0 < n_q, gl.cdiv(hi, BLOCK_N), 0)
    if HAS_LEFT:  # the first tile holding a key of the first row's window
        t0 = gl.minimum(gl.maximum(m0 + offset - window_left, 0) // BLOCK_N, n_tiles)
    else:
        t0 = 0
    key_row_at = b.to(gl.int64) * N_K  # (this batch row's key mask)
    if HAS_KEY_MASK:  # whether this batch row masks every tile with its key mask
        reads = gl.load(READS_MASKS + b)
    else:
        reads = b * 0

    dtype: gl.constexpr = qa_desc.dtype
    qa_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + qa_desc.block_type.shape, qa_desc.layout)
    qb_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + qb_desc.block_type.shape, qb_desc.layout)
    ka_ring = gl.allocate_shared_memory(dtype, [STAGES] + ka_desc.block_type.shape, ka_desc.layout)
    kb_ring = gl.allocate_shared_memory(dtype, [STAGES] + kb_desc.block_type.shape, kb_desc.layout)
    scratch_ring = gl.allocate_shared_memory(dtype, [CONSUMERS] + kb_desc.block_type.shape, kb_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)
    mbarrier.init(q_bar, count=1)

    # (the argument tuples are written out: a tuple held in a variable would turn its constexprs into tensors)
    gl.warp_specialize([
        (_ws_fwd_consumer, (qa_smem, qb_smem, ka_ring, kb_ring, scratch_ring, ready, empty, q_bar, 0, KL,
                            LSE_A, LSE_B, DQ_B, SINK_A, SINK_B, b, h, H, N_Q, q0, n_q, n_k, m0, t0, n_tiles, offset,
                            window_left, KEY_MASK, key_row_at, QUERY_MASK, reads, qk_scale_a, qk_scale_b, grad_scale_b,
                            CAUSAL, HAS_LEFT, HAS_SINKS, VARLEN, HAS_KEY_MASK, HAS_QUERY_MASK, BLOCK_M, BLOCK_N,
                            STAGES)),
        (_ws_fwd_consumer, (qa_smem, qb_smem, ka_ring, kb_ring, scratch_ring, ready, empty, q_bar, 1, KL,
                            LSE_A, LSE_B, DQ_B, SINK_A, SINK_B, b, h, H, N_Q, q0, n_q, n_k, m0, t0, n_tiles, offset,
                            window_left, KEY_MASK, key_row_at, QUERY_MASK, reads, qk_scale_a, qk_scale_b, grad_scale_b,
                            CAUSAL, HAS_LEFT, HAS_SINKS, VARLEN, HAS_KEY_MASK, HAS_QUERY_MASK, BLOCK_M, BLOCK_N,
                            STAGES)),
        (_ws_fwd_producer, (qa_desc, qb_desc, ka_desc, kb_desc, qa_smem, qb_smem, ka_ring, kb_ring, ready,
                            empty, q_bar, b, h, hk_a, hk_b, q0, k0, m0, t0, n_tiles, BLOCK_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def fused_forward_config(d_a: int, d_b: int) -> LaunchConfig:
    """Tiles of the fused Hopper forward, from an H100 sweep (bf16, the
    long-context shapes): ``block_m`` rows per consumer (a program holds two), ``block_n`` keys per tile (64, the
    portable kernel's, so that both give the same bits; 32-key tiles were slower on every shape), ``num_stages`` slots
    in the key ring (2: the fastest on three shapes, within the timing noise of 3 on the other two); ``num_warps`` is
    each consumer's (one warpgroup). At head dim 128 the consumers spill a little
    (``benchmarks/kernel_resources.py --hopper-fused-forward``) and are still faster than with 32-key tiles, which do
    not.

    Example:
        >>> fused_forward_config(128, 128)
        LaunchConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    """
    return LaunchConfig(64, 64, 4, 2)


_launch = KernelLauncher(_ws_fused_fwd_kernel)


def attention_kl_fused_fwd_hopper(
    inputs: KLInputs, spec: KLSpec, dq_b: torch.Tensor, config: LaunchConfig | None = None, dq_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused forward of :func:`streamkl._triton.forward.attention_kl_fwd` with ``dq_b`` (same outputs, ``(kl,
    lse_a, lse_b)``, each ``[B, H, N_q]`` fp32, nats, and ``dq_b`` filled with side b's query gradient per unit
    upstream gradient, times ``dq_scale``) on the Hopper kernel; only for problems in its scope (module docstring).

    Example (on an H100)::

        >>> from streamkl._triton.forward import new_dq_b_buffer
        >>> q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> inputs = KLInputs(q, q, q, q, None, None, None, None, None, None)  # doctest: +SKIP
        >>> dq_b = new_dq_b_buffer(inputs)  # doctest: +SKIP
        >>> kl, lse_a, lse_b = attention_kl_fused_fwd_hopper(inputs, KLSpec(0.125, 0.125), dq_b)  # doctest: +SKIP
    """
    q_a, k_a, q_b, k_b = inputs.q_a, inputs.k_a, inputs.q_b, inputs.k_b
    heads, n_q, d_a = q_a.shape[1:]
    n_k, d_b = k_a.shape[2], q_b.shape[-1]
    kl, lse_a, lse_b, empty = forward_outputs(inputs)
    if empty:
        dq_b.zero_()
        return kl, lse_a, lse_b
    cfg = config or fused_forward_config(d_a, d_b)
    (qk_a, _), (qk_b, _) = side_scales(spec.scale_a, 0.0), side_scales(spec.scale_b, 0.0)
    grid, order_chunk = row_tile_grid(inputs, spec, CONSUMERS * cfg.block_m)
    rows_per_sequence = sequence_grid(inputs, spec)[1]
    seq_q, seq_k, varlen = sequence_tensors(inputs)
    key_mask, query_mask, reads = mask_tensors(inputs)
    _launch(
        grid,
        (_descriptor(q_a, cfg.block_m), _descriptor(k_a, cfg.block_n), _descriptor(q_b, cfg.block_m),
         _descriptor(k_b, cfg.block_n), kl, lse_a, lse_b, dq_b, contiguous_or_none(inputs.sink_a),
         contiguous_or_none(inputs.sink_b), seq_q, seq_k, key_mask, query_mask, reads),
        (heads, n_q, n_k, heads // k_a.shape[1], heads // k_b.shape[1], rows_per_sequence, order_chunk,
         max(spec.window_left, 0), qk_a, qk_b, spec.grad_scale("b") * dq_scale),
        (("CAUSAL", spec.window_right == 0), ("HAS_LEFT", spec.window_left >= 0),
         ("HAS_SINKS", inputs.sink_a is not None), ("VARLEN", varlen), ("HAS_KEY_MASK", key_mask is not None),
         ("HAS_QUERY_MASK", query_mask is not None),
         ("BLOCK_M", cfg.block_m), ("BLOCK_N", cfg.block_n), ("STAGES", cfg.num_stages), ("num_warps", 4),
         ("maxnreg", KERNEL_REGS)),
    )
    return kl, lse_a, lse_b
