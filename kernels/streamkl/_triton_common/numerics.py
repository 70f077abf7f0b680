"""The kernels' base-2 numerics, shared by the portable Triton and the Hopper Gluon kernels: the constants inside the
kernels and the score scales in their units."""

from __future__ import annotations

import triton.language as tl

from .._constants import LOG2E

#: Running-max sentinel: finite, so that ``exp2(m_old - m_new)`` is never ``exp2(-inf + inf)``; a row
#: that has seen no allowed key keeps this max and a zero sum, which marks it as empty.
NEG_BIG = tl.constexpr(-1.0e30)
#: log2(e) and ln(2) as kernel constants (the values of :mod:`streamkl._constants`).
LOG2E_C = tl.constexpr(LOG2E)
LN2_C = tl.constexpr(1.0 / LOG2E)
#: fp16 gradient tiles are scaled by a power of two that brings their largest magnitude to this exponent before the
#: cast to the tensor cores' operand dtype (fp16's largest finite value is just under 2^16), so that small gradients
#: keep their bits instead of flushing to zero.
FP16_TARGET_EXPONENT = tl.constexpr(14)
#: The fixed scale of the Hopper key passes' fp16 ``dS`` tiles: with one upstream gradient for every row (applied at
#: the end), ``|dS| = |P_b - P_a| <= 1``, so ``2^FP16_TARGET_EXPONENT`` never overflows and nothing above 2^-38 flushes.
FP16_DS_SCALE = tl.constexpr(2.0 ** FP16_TARGET_EXPONENT.value)


def side_scales(scale: float, softcap: float) -> tuple[float, float]:
    """``(qk_scale, cap_scale)`` of one side for the kernels: the score in base 2 is ``u · qk_scale`` with
    ``u = raw`` (no cap) or ``u = tanh(raw · cap_scale)`` (soft-capped), see
    :func:`streamkl._triton._helpers._pre_exponent`.

    Example:
        >>> side_scales(0.125, 0.0)[1], side_scales(0.125, 30.0)[1]
        (0.0, 0.125)
    """
    if softcap:
        return softcap * LOG2E, scale
    return scale * LOG2E, 0.0
