"""Paired comparisons over seeds: each seed trains both students from the same initial weights on the same batches,
so the comparison is paired by seed. With ``n = 3`` seeds the exact sign-flip test cannot go below ``2/8 = 0.25``: it
says how consistent the sign is; the paired t-test (2 degrees of freedom) gives the verdict.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import ALPHA, sign_flip_p, t_test_p


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
