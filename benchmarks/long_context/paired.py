"""Paired comparisons over seeds, with no dependency beyond the standard library (scipy is used when present).

Each seed trains both students from the same initial weights on the same batches, so the comparison is paired by
seed: the differences ``with − without`` per seed, their mean and standard error, how many seeds favour attention KL,
and two two-sided p-values:

- the paired t-test (``t = mean / (sd / √n)`` with ``n − 1`` degrees of freedom); for ``n = 3`` the Student
  distribution with 2 degrees of freedom has the closed form ``p = 1 − |t| / √(t² + 2)``;
- the exact sign-flip test of the mean difference (all ``2^n`` sign assignments); with ``n = 3`` its smallest possible
  p-value is ``2/8 = 0.25``, so three seeds can never reach significance by it: it says how consistent the sign is.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

ALPHA = 0.05


def sign_flip_p(diffs: Sequence[float]) -> float:
    """Exact two-sided p-value of the mean of paired differences under the sign-flip null: the share of the ``2^n``
    sign patterns (bit ``i`` of ``mask`` flips difference ``i``) whose sum is at least as far from 0 as the observed.

    Example:
        >>> sign_flip_p([0.5, 0.4, 0.3])
        0.25
    """
    n, observed = len(diffs), abs(sum(diffs))
    if observed == 0:
        return 1.0
    extreme = [abs(sum(-d if mask >> i & 1 else d for i, d in enumerate(diffs))) >= observed * (1 - 1e-12)
               for mask in range(1 << n)]
    return sum(extreme) / len(extreme)


def t_test_p(diffs: Sequence[float]) -> tuple[float | None, float | None]:
    """``(t, two-sided p)`` of the paired t-test; ``(None, None)`` with fewer than 2 differences; ``p = 0`` when every
    difference is the same non-zero value (zero spread), ``1`` when all are 0.

    Example:
        >>> t, p = t_test_p([0.30, 0.32, 0.28])
        >>> round(t, 1), round(p, 4)
        (26.0, 0.0015)
    """
    n = len(diffs)
    if n < 2:
        return None, None
    mean, sd = statistics.mean(diffs), statistics.stdev(diffs)
    if sd == 0:
        return (math.copysign(math.inf, mean), 0.0) if mean else (0.0, 1.0)
    t = mean / (sd / math.sqrt(n))
    df = n - 1
    try:
        from scipy import stats as sstats

        return t, float(2 * sstats.t.sf(abs(t), df))
    except ImportError:
        pass
    if df == 2:
        return t, 1 - abs(t) / math.sqrt(t * t + 2)
    if df == 1:
        return t, 1 - 2 * math.atan(abs(t)) / math.pi
    return t, None


def paired(kl: Sequence[float], base: Sequence[float]) -> dict[str, Any]:
    """The paired comparison of ``kl`` against ``base`` (same seeds, same order).

    Example:
        >>> c = paired([0.9, 0.8, 0.95], [0.1, 0.2, 0.15])
        >>> c["n"], c["wins"], round(c["mean_diff"], 3), c["p_sign_flip"], c["significant"]
        (3, 3, 0.733, 0.25, True)
    """
    diffs = [a - b for a, b in zip(kl, base)]
    n = len(diffs)
    t, p_t = t_test_p(diffs)
    se = statistics.stdev(diffs) / math.sqrt(n) if n >= 2 else None
    return {"n": n, "kl": list(kl), "base": list(base), "diffs": diffs,
            "mean_kl": statistics.mean(kl) if n else None, "mean_base": statistics.mean(base) if n else None,
            "mean_diff": statistics.mean(diffs) if n else None, "se_diff": se,
            "wins": sum(d > 0 for d in diffs), "losses": sum(d < 0 for d in diffs),
            "t": t, "p_t": p_t, "p_sign_flip": sign_flip_p(diffs) if n else None,
            "significant": p_t is not None and p_t < ALPHA}
