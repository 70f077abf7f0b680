"""Hopper (sm_90) key pass of the attention-KL backward, warp-specialised: a producer warp streams query tiles, two
consumer warpgroups take turns on the tensor cores (FlashAttention-3's ping-pong).

Same result as :mod:`streamkl._hopper.backward` (the frozen teacher's key pass, ``dK_b += dSᵀ·Q_b`` with
``dSᵀ = g·(P_b − P_a)ᵀ``), same scope, organised differently:

* one program owns ``2·BLOCK_N`` keys: each of two consumer warpgroups holds its own ``BLOCK_N`` keys of both sides
  and its own ``dK_b`` accumulator, and both sweep the same (query head, query tile) steps;
* a producer warp (24 registers) issues the TMA copies of both sides' query tiles into a ring of ``STAGES`` slots;
  a slot is refilled once both consumers have released it (an ``empty`` barrier of count 2), so each query tile is
  read from L2 once per ``2·BLOCK_N`` keys instead of once per ``BLOCK_N``;
* the consumers take turns issuing their products (two ``turn`` barriers): a consumer issues step ``t``'s two score
  products and step ``t − 1``'s ``dK`` product, hands the turn over, waits for them and then runs its
  exponentials, while the other consumer's products run on the tensor cores. The register budget moves from the
  producer to the consumers (``setmaxnreg``: 240 each), which is what lets each hold its tile, accumulator and the
  previous step's ``dSᵀ`` without spilling.

With a causal mask the two consumers' keys start at different query tiles: both sweep the first consumer's steps,
and the second one's extra steps (query rows that see none of its keys) are masked to zero, a few steps per head.
With a causal sliding window (``window_left >= 0``) the sweep ends at the last query tile whose windows reach the
second consumer's keys; each consumer masks the tiles whose rows' windows start after some of its keys.
Each consumer accumulates its keys' products in the same order as the one-warpgroup kernel, so the two give bitwise
the same gradient. :func:`streamkl._hopper.backward.attention_kl_key_pass_hopper` launches it (:mod:`streamkl.dispatch`
selects it for causal problems with a head dim above 64); tried without the turns and with the one-warpgroup kernel's
in-flight score products per consumer, it was no faster (docs/concepts/kernels.md, tried and lost).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .._triton_common.tiles import LaunchConfig
from .forward import _longest_first, _sequence_of, _stored_extent, _tma_load
from .key_pass_tiles import (
    _causal_mask,
    _ds_operand,
    _ds_tile,
    _full_tiles_end,
    _query_tile_bounds,
    _row_state,
    _store_dk,
)

#: Registers per thread of each consumer warpgroup and of the producer (``setmaxnreg``); the kernel's limit is set
#: so that one program (three warpgroups) fills the register file: 2·240 + 24 = 3·168.
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
KERNEL_REGS = 168


@gluon.jit
def _producer(qa_desc, qb_desc, ka_desc, kb_desc, qa_ring, qb_ring, k_smem_a, k_smem_b, ready, empty, k_bar, turns,
              b, q0, k0, h0, hk_a, hk_b, n0, n_tiles, first_tile, steps,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Load both consumers' key tiles once, then every step's query tiles of both sides, ``STAGES`` ahead of the
    slower consumer (the sequence's queries from token ``q0``, its keys from token ``k0``)."""
    mbarrier.expect(k_bar, 2 * (ka_desc.block_type.nbytes + kb_desc.block_type.nbytes))
    for c in gl.static_range(2):
        _tma_load(ka_desc, [b, hk_a, k0 + n0 + c * BLOCK_N, 0], k_bar, k_smem_a.index(c))
        _tma_load(kb_desc, [b, hk_b, k0 + n0 + c * BLOCK_N, 0], k_bar, k_smem_b.index(c))
    for t in range(steps):
        stage = t % STAGES
        mbarrier.wait(empty.index(stage), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        h = h0 + t // n_tiles
        m0 = q0 + (first_tile + t % n_tiles) * BLOCK_M
        bar = ready.index(stage)
        mbarrier.expect(bar, qa_desc.block_type.nbytes + qb_desc.block_type.nbytes)
        _tma_load(qa_desc, [b, h, m0, 0], bar, qa_ring.index(stage))
        _tma_load(qb_desc, [b, h, m0, 0], bar, qb_ring.index(stage))


@gluon.jit
def _ws_ds_tile(x, y, LSE_A, LSE_B, GRAD, t, b, q0, h0, H, N_Q, n_q, n_tiles, first_tile, keys, offs_m, full_from,
                full_end, qk_scale_a, qk_scale_b, offset, window_left, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr,
                SCALAR_GRAD: gl.constexpr, HAS_LEFT: gl.constexpr):
    """``dSᵀ`` ([keys, queries], fp32) of step ``t`` from its score tiles, masked on the steps before ``full_from``
    and from ``full_end`` on (a consumer's steps are the first consumer's, so whether a step is masked is known only
    here)."""
    tile = first_tile + t % n_tiles
    lse2_a, lse2_b, g, rows = _row_state(LSE_A, LSE_B, GRAD, h0 + t // n_tiles, tile, b, H, N_Q, q0, n_q, offs_m,
                                         BLOCK_M, SCALAR_GRAD)
    ds = _ds_tile(x, y, lse2_a, lse2_b, g, rows, keys, qk_scale_a, qk_scale_b, offset, window_left, False,
                  SCALAR_GRAD, HAS_LEFT)
    if CAUSAL and (tile < full_from or tile >= full_end):
        ds = _causal_mask(ds, keys, rows, offset, window_left, HAS_LEFT)
    return ds


@gluon.jit
def _consumer(qa_ring, qb_ring, k_smem_a, k_smem_b, ready, empty, k_bar, turns, ME: gl.constexpr,
              LSE_A, LSE_B, GRAD, DK_B, b, q0, h0, H, N_Q, n_q, N_K, k_start, n_k, n_store, n0, pair, n_tiles,
              first_tile, steps, offset, window_left, KEY_MASK, qk_scale_a, qk_scale_b, grad_scale_b,
              CAUSAL: gl.constexpr, SCALAR_GRAD: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_KEY_MASK: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Consumer ``ME`` (0 or 1): ``dK_b`` of keys ``n0 + ME·BLOCK_N ..`` of the sequence (``n_q`` queries from token
    ``q0``, ``n_k`` keys from token ``k_start`` of batch rows of ``N_Q`` and ``N_K`` tokens) over every step,
    products issued in turn with the other consumer, stored at the end (into row ``pair`` of ``DK_B``)."""
    D_A: gl.constexpr = qa_ring.type.shape[4]
    D_B: gl.constexpr = qb_ring.type.shape[4]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D_B, 16])
    dot_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout, k_width=2)
    k0 = n0 + ME * BLOCK_N
    if CAUSAL:  # query tiles from this one see every key of this consumer (earlier ones: masked), up to full_end (a
        # window's: later ones see only some, or none)
        full_from = gl.cdiv(gl.maximum(k0 + BLOCK_N - 1 - offset, 0), BLOCK_M)
        full_end = _full_tiles_end(k0, first_tile + n_tiles, offset, window_left, BLOCK_M, HAS_LEFT)
    else:
        full_from = 0
        full_end = first_tile + n_tiles
    keys = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([BLOCK_N, D_B], gl.float32, dk_layout)

    mbarrier.wait(k_bar, 0)
    ka = k_smem_a.index(ME).reshape([BLOCK_N, D_A])
    kb = k_smem_b.index(ME).reshape([BLOCK_N, D_B])
    if steps > 0:  # (none where a window's rows see none of the program's keys: their gradient is zero)
        dk = _steps_in_turn(ka, kb, qa_ring, qb_ring, ready, empty, turns, ME, dk, zero, dot_layout, LSE_A, LSE_B,
                            GRAD, b, q0, h0, H, N_Q, n_q, n_tiles, first_tile, steps, keys, offs_m, full_from, full_end,
                            qk_scale_a, qk_scale_b, offset, window_left, BLOCK_M, D_A, D_B, STAGES, CAUSAL,
                            SCALAR_GRAD, HAS_LEFT)
    _store_dk(dk, DK_B, pair, N_K, k_start, n_k, n_store, k0, grad_scale_b, GRAD, KEY_MASK, b, BLOCK_N, D_B,
              dk_layout, SCALAR_GRAD, qb_ring.dtype == gl.float16, HAS_KEY_MASK)


@gluon.jit
def _steps_in_turn(ka, kb, qa_ring, qb_ring, ready, empty, turns, ME: gl.constexpr, dk, zero, dot_layout: gl.constexpr,
                   LSE_A, LSE_B, GRAD, b, q0, h0, H, N_Q, n_q, n_tiles, first_tile, steps, keys, offs_m, full_from,
                   full_end, qk_scale_a, qk_scale_b, offset, window_left, BLOCK_M: gl.constexpr, D_A: gl.constexpr,
                   D_B: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, SCALAR_GRAD: gl.constexpr,
                   HAS_LEFT: gl.constexpr):
    """Every step of consumer ``ME``: wait for the query tiles and the turn, issue this step's score products and
    the previous step's ``dK`` product, hand the turn over, then the exponentials; returns ``dK_b`` (fp32)."""
    OTHER: gl.constexpr = 1 - ME
    if ME == 1:
        mbarrier.arrive(turns.index(0))  # consumer 0 issues first

    # Step 0: only its score products.
    mbarrier.wait(ready.index(0), 0)
    mbarrier.wait(turns.index(ME), 0)
    x = warpgroup_mma(ka, qa_ring.index(0).reshape([BLOCK_M, D_A]).permute((1, 0)), zero, use_acc=False,
                      is_async=True)
    y = warpgroup_mma(kb, qb_ring.index(0).reshape([BLOCK_M, D_B]).permute((1, 0)), zero, use_acc=False,
                      is_async=True)
    mbarrier.arrive(turns.index(OTHER))
    x, y = warpgroup_mma_wait(num_outstanding=0, deps=(x, y))
    ds = _ws_ds_tile(x, y, LSE_A, LSE_B, GRAD, 0, b, q0, h0, H, N_Q, n_q, n_tiles, first_tile, keys, offs_m, full_from,
                     full_end, qk_scale_a, qk_scale_b, offset, window_left, BLOCK_M, CAUSAL, SCALAR_GRAD, HAS_LEFT)
    ds = gl.convert_layout(_ds_operand(ds, qb_ring.dtype), dot_layout)
    for t in range(1, steps):
        stage = t % STAGES
        prev = (t - 1) % STAGES
        mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
        mbarrier.wait(turns.index(ME), t & 1)
        x = warpgroup_mma(ka, qa_ring.index(stage).reshape([BLOCK_M, D_A]).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
        y = warpgroup_mma(kb, qb_ring.index(stage).reshape([BLOCK_M, D_B]).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
        dk = warpgroup_mma(ds, qb_ring.index(prev).reshape([BLOCK_M, D_B]), dk, is_async=True)
        mbarrier.arrive(turns.index(OTHER))
        x, y, dk = warpgroup_mma_wait(num_outstanding=0, deps=(x, y, dk))
        mbarrier.arrive(empty.index(prev))  # both products of step t - 1 are done with its slot
        ds = _ws_ds_tile(x, y, LSE_A, LSE_B, GRAD, t, b, q0, h0, H, N_Q, n_q, n_tiles, first_tile, keys, offs_m,
                         full_from, full_end, qk_scale_a, qk_scale_b, offset, window_left, BLOCK_M, CAUSAL, SCALAR_GRAD,
                         HAS_LEFT)
        ds = gl.convert_layout(_ds_operand(ds, qb_ring.dtype), dot_layout)
    last = (steps - 1) % STAGES
    dk = warpgroup_mma(ds, qb_ring.index(last).reshape([BLOCK_M, D_B]), dk, is_async=True)
    dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
    mbarrier.arrive(empty.index(last))
    return dk


@gluon.jit
def _ws_dk_kernel(
    qa_desc, ka_desc, qb_desc, kb_desc,  # rank-4 TMA descriptors over [B, H | H_k, N, D], blocks [1, 1, BLOCK, D]
    GRAD, LSE_A, LSE_B, DK_B, CU_Q, CU_K, KEY_MASK,  # as in streamkl._hopper.backward._hopper_dk_kernel
    H, H_KB, N_Q, N_K, GROUP_A, GROUP_B, MAX_K, SPLIT, order_chunk, window_left,
    qk_scale_a, qk_scale_b, grad_scale_b,
    CAUSAL: gl.constexpr, SCALAR_GRAD: gl.constexpr, HAS_LEFT: gl.constexpr, VARLEN: gl.constexpr,
    HAS_KEY_MASK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    if CAUSAL:  # the longest sweeps first (see streamkl._triton._helpers._longest_first)
        rank, pid_bh = _longest_first(gl.program_id(0), gl.cdiv(MAX_K, 2 * BLOCK_N), order_chunk)
        n0 = rank * 2 * BLOCK_N
    else:
        n0 = gl.program_id(0) * 2 * BLOCK_N
        pid_bh = gl.program_id(1)
    part = pid_bh % SPLIT
    hk_b = (pid_bh // SPLIT) % H_KB
    b, q0, n_q, k0, n_k = _sequence_of(CU_Q, CU_K, pid_bh // (SPLIT * H_KB), N_Q, N_K, VARLEN)
    pair = (b * H_KB + hk_b) * SPLIT + part
    n_store = _stored_extent(n_k, N_K, VARLEN)
    heads = GROUP_B // SPLIT
    h0 = hk_b * GROUP_B + part * heads
    hk_a = h0 // GROUP_A
    offset = n_k - n_q
    if CAUSAL:  # (with a window, maybe no row sees the program's keys)
        first_tile, end_tile = _query_tile_bounds(n0, 2 * BLOCK_N, n_q, offset, window_left, BLOCK_M, HAS_LEFT)
    else:
        first_tile = 0
        end_tile = gl.cdiv(n_q, BLOCK_M)
    # (none past a packed sequence's keys)
    n_tiles = gl.where(n0 < n_k, gl.maximum(end_tile - first_tile, 0), 0)
    steps = heads * n_tiles

    dtype: gl.constexpr = qa_desc.dtype
    k_smem_a = gl.allocate_shared_memory(dtype, [2] + ka_desc.block_type.shape, ka_desc.layout)
    k_smem_b = gl.allocate_shared_memory(dtype, [2] + kb_desc.block_type.shape, kb_desc.layout)
    qa_ring = gl.allocate_shared_memory(dtype, [STAGES] + qa_desc.block_type.shape, qa_desc.layout)
    qb_ring = gl.allocate_shared_memory(dtype, [STAGES] + qb_desc.block_type.shape, qb_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    for s in gl.static_range(2):
        mbarrier.init(turns.index(s), count=1)
    mbarrier.init(k_bar, count=1)

    # (the argument tuples are written out: a tuple held in a variable would turn its constexprs into tensors)
    gl.warp_specialize([
        (_consumer, (qa_ring, qb_ring, k_smem_a, k_smem_b, ready, empty, k_bar, turns, 0, LSE_A, LSE_B, GRAD, DK_B,
                     b, q0, h0, H, N_Q, n_q, N_K, k0, n_k, n_store, n0, pair, n_tiles, first_tile, steps, offset,
                     window_left, KEY_MASK, qk_scale_a, qk_scale_b, grad_scale_b, CAUSAL, SCALAR_GRAD, HAS_LEFT,
                     HAS_KEY_MASK, BLOCK_M, BLOCK_N, STAGES)),
        (_consumer, (qa_ring, qb_ring, k_smem_a, k_smem_b, ready, empty, k_bar, turns, 1, LSE_A, LSE_B, GRAD, DK_B,
                     b, q0, h0, H, N_Q, n_q, N_K, k0, n_k, n_store, n0, pair, n_tiles, first_tile, steps, offset,
                     window_left, KEY_MASK, qk_scale_a, qk_scale_b, grad_scale_b, CAUSAL, SCALAR_GRAD, HAS_LEFT,
                     HAS_KEY_MASK, BLOCK_M, BLOCK_N, STAGES)),
        (_producer, (qa_desc, qb_desc, ka_desc, kb_desc, qa_ring, qb_ring, k_smem_a, k_smem_b, ready, empty, k_bar,
                     turns, b, q0, k0, h0, hk_a, hk_b, n0, n_tiles, first_tile, steps, BLOCK_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def ws_key_pass_config(d_a: int, d_b: int) -> LaunchConfig:
    """Tiles of the warp-specialised key pass, the fastest of an H100 sweep (
    bf16, causal, N = 8192): ``block_n`` keys per consumer (64; a program holds two consumers), ``block_m`` queries
    per step and ``num_stages`` the depth of the shared query ring: 128 queries and 2 slots at head dim 64, 64 and 3
    at head dim 128 (128 queries spill there). ``num_warps`` is each consumer's (one warpgroup).

    Example:
        >>> ws_key_pass_config(64, 64)
        LaunchConfig(block_m=128, block_n=64, num_warps=4, num_stages=2)
        >>> ws_key_pass_config(128, 64).block_m
        64
    """
    if max(d_a, d_b) <= 64:
        return LaunchConfig(128, 64, 4, 2)
    return LaunchConfig(64, 64, 4, 3)
