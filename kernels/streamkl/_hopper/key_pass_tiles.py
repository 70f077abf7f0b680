"""Gluon pieces both Hopper key passes share (:mod:`streamkl._hopper.backward`, the one-warpgroup kernel, and
:mod:`streamkl._hopper.key_pass_ws`, the warp-specialised one): the row state of a step's queries, a transposed
``dSᵀ`` tile, the causal mask (with a sliding window's left bound), the query tiles a key tile meets and the ``dK_b``
store. Keeping one copy keeps the two kernels' arithmetic the same, which is what makes their gradients bitwise
equal."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .._triton_common.numerics import FP16_DS_SCALE, LOG2E_C


@gluon.jit
def _step_tile(step, h0, n_tiles, first_tile, masked_steps, n_masked, n_diagonal, PEELED: gl.constexpr):
    """Query head and query tile of a program's ``step``: head by head from ``first_tile``, or, ``PEELED``, its
    ``masked_steps`` first (``n_masked`` masked tiles per query head: the ``n_diagonal`` causal diagonal tiles from
    ``first_tile``, then, with a sliding window, the tiles past the full ones, whose last rows' windows start after
    some of the keys), then every head's full tiles (from ``first_tile + n_diagonal``)."""
    if not PEELED:
        return h0 + step // n_tiles, first_tile + step % n_tiles
    n_full = n_tiles - n_masked
    rest = step - masked_steps
    on_masked = step < masked_steps
    masked = step % gl.maximum(n_masked, 1)
    h = gl.where(on_masked, step // gl.maximum(n_masked, 1), rest // gl.maximum(n_full, 1))
    tile = gl.where(on_masked, masked + gl.where(masked < n_diagonal, 0, n_full),
                    n_diagonal + rest % gl.maximum(n_full, 1))
    return h0 + h, first_tile + tile


@gluon.jit
def _row_state(LSE_A, LSE_B, GRAD, h, tile, b, H, N_Q, q0, n_q, offs_m, BLOCK_M: gl.constexpr,
               SCALAR_GRAD: gl.constexpr):
    """Base-2 log-sum-exps of both sides and the upstream gradient of the query rows of head ``h``'s query tile
    ``tile`` (a column of the transposed tile) of the sequence whose ``n_q`` rows start at token ``q0`` of a batch row
    of ``N_Q``; rows past ``n_q`` read lse = +inf (P = 0) and g = 0."""
    rows = tile * BLOCK_M + offs_m
    row_in = rows < n_q
    at = (b.to(gl.int64) * H + h) * N_Q + q0 + rows
    lse2_a = gl.load(LSE_A + at, mask=row_in, other=float("inf")) * LOG2E_C
    lse2_b = gl.load(LSE_B + at, mask=row_in, other=float("inf")) * LOG2E_C
    if SCALAR_GRAD:  # applied once to dK at the end
        g = lse2_a  # unused
    else:
        g = gl.load(GRAD + at, mask=row_in, other=0.0)
    return lse2_a, lse2_b, g, rows


@gluon.jit
def _ds_tile(x, y, lse2_a, lse2_b, g, rows, keys, qk_scale_a, qk_scale_b, offset, window_left,
             MASKED: gl.constexpr, SCALAR_GRAD: gl.constexpr, HAS_LEFT: gl.constexpr):
    """``dSᵀ`` of one transposed tile ([keys, queries], fp32): ``g·(P_b − P_a)``, zero where the causal mask (and, with
    ``HAS_LEFT``, the window) forbids the pair (``MASKED``); without ``SCALAR_GRAD`` the per-row ``g`` is applied
    here."""
    p_a = gl.exp2(x * qk_scale_a - gl.expand_dims(lse2_a, 0))
    p_b = gl.exp2(y * qk_scale_b - gl.expand_dims(lse2_b, 0))
    ds = p_b - p_a
    if not SCALAR_GRAD:
        ds = ds * gl.expand_dims(g, 0)
    if MASKED:
        ds = _causal_mask(ds, keys, rows, offset, window_left, HAS_LEFT)
    return ds


@gluon.jit
def _ds_operand(ds, dtype: gl.constexpr):
    """``dSᵀ`` (fp32) as the tensor cores' operand of ``dtype``: fp16 tiles scaled by :data:`FP16_DS_SCALE` first
    (:func:`_store_dk` divides it out), so small gradients keep their bits."""
    if dtype == gl.float16:
        ds = ds * FP16_DS_SCALE
    return ds.to(dtype)


@gluon.jit
def _causal_mask(ds, keys, rows, offset, window_left, HAS_LEFT: gl.constexpr):
    """``ds`` ([keys, queries]) with zeros where key ``keys[i]`` lies past query ``rows[j]``'s diagonal or, with
    ``HAS_LEFT``, more than ``window_left`` keys before it."""
    diagonal = gl.expand_dims(rows, 0) + offset
    allowed = gl.expand_dims(keys, 1) <= diagonal
    if HAS_LEFT:
        allowed = allowed & (gl.expand_dims(keys, 1) >= diagonal - window_left)
    return gl.where(allowed, ds, 0.0)


@gluon.jit
def _query_tile_bounds(k0, keys_per_program, N_Q, offset, window_left, BLOCK_M: gl.constexpr,
                       HAS_LEFT: gl.constexpr):
    """The query tiles a causal key pass over keys ``k0 .. k0 + keys_per_program - 1`` sweeps, ``(first, end)``:
    from the first row whose diagonal reaches key ``k0`` to the last row that sees any of the keys (with ``HAS_LEFT``,
    the last whose window starts at or before the last key; else the last row). ``end <= first`` where no row sees
    them (a sliding window over keys far before the queries)."""
    first = gl.maximum(k0 - offset, 0) // BLOCK_M
    end = gl.cdiv(N_Q, BLOCK_M)
    if HAS_LEFT:
        last_row = k0 + keys_per_program - 1 + window_left - offset
        end = gl.where(last_row < 0, 0, gl.minimum(end, gl.maximum(last_row, 0) // BLOCK_M + 1))
    return first, end


@gluon.jit
def _full_tiles_end(k0, end, offset, window_left, BLOCK_M: gl.constexpr, HAS_LEFT: gl.constexpr):
    """The end of the query tiles whose every row's window holds key ``k0`` (and so every key from ``k0`` up to the
    rows' diagonals): ``end`` without ``HAS_LEFT``."""
    if HAS_LEFT:
        return gl.minimum(end, gl.maximum(k0 + window_left - offset + 1, 0) // BLOCK_M)
    return end


@gluon.jit
def _store_dk(dk, DK_B, pair, N_K, start, n_k, n_store, k0, grad_scale_b, GRAD, KEY_MASK, b, BLOCK_N: gl.constexpr,
              D_B: gl.constexpr, dk_layout: gl.constexpr, SCALAR_GRAD: gl.constexpr, FP16: gl.constexpr,
              HAS_KEY_MASK: gl.constexpr):
    """Store ``dK_b`` of keys ``k0 ..`` (fp32 ``dk``, ``dk_layout``) of the sequence whose ``n_k`` keys start at token
    ``start`` of row ``pair`` (of ``N_K`` tokens) of ``DK_B``, times side b's scale and, with ``SCALAR_GRAD``, the one
    upstream gradient (``FP16``: over the operand scale of :func:`_ds_operand`); keys from ``n_k`` up to ``n_store``
    are 0 (a right-padded batch row's padding), those past it are left out, and,
    with ``HAS_KEY_MASK``, the keys batch row ``b``'s key mask (``KEY_MASK``, ``[B, N_K]`` bytes) drops are 0: no
    row summed them, so their gradient is zero (whatever the sweep added for them is dropped: a key's gradient sums
    its own column only)."""
    scale = grad_scale_b
    if FP16:
        scale = scale / FP16_DS_SCALE
    if SCALAR_GRAD:
        scale = scale * gl.load(GRAD)
    out_keys = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dk_layout))
    cols = gl.arange(0, D_B, layout=gl.SliceLayout(0, dk_layout))
    at = (pair.to(gl.int64) * N_K + start + gl.expand_dims(out_keys, 1)) * D_B + gl.expand_dims(cols, 0)
    kept = out_keys < n_k
    if HAS_KEY_MASK:
        kept = kept & (gl.load(KEY_MASK + b.to(gl.int64) * N_K + start + out_keys, mask=kept, other=0) != 0)
    value = gl.where(gl.expand_dims(kept, 1), dk * scale, 0.0)
    gl.store(DK_B + at, value.to(DK_B.dtype.element_ty), mask=gl.expand_dims(out_keys < n_store, 1))
