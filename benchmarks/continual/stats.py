"""Paired significance tests of the continual-learning benchmarks (Split-Digits, the pretrained MiniLM).

Every method and its baseline ran on the same runs (same seed and order: same data, initialisation and batches), so
each comparison is paired by run. For each scenario, comparison and metric this gives the mean difference, its
standard error, the number of runs on which the method did better, and three two-sided p-values: the paired t-test
(``scipy.stats.ttest_rel``), the Wilcoxon signed-rank test (``scipy.stats.wilcoxon``, exact for small samples) and
the exact sign-flip permutation test of the mean (``common.sign_flip_p``, no scipy needed).
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.dirname(HERE))
from common import ALPHA, sign_flip_p  # noqa: E402


def quiet() -> None:
    """Silence Lightning's per-fit chatter (the benchmarks run hundreds of short fits)."""
    import logging

    from lightning.pytorch.utilities import disable_possible_user_warnings

    disable_possible_user_warnings()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*treespec, LeafSpec.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_streamkl").setLevel(logging.ERROR)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value).

    Example:
        >>> mean_std([1.0, 3.0])
        (2.0, 1.4142135623730951)
    """
    m = sum(values) / len(values)
    s = (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return m, s


def paired_tests(a: list[float], b: list[float]) -> dict[str, float | None]:
    """Two-sided p-values of the paired t-test, the Wilcoxon signed-rank test and the sign-flip test of a − b."""
    diffs = [x - y for x, y in zip(a, b)]
    out: dict[str, float | None] = {"p_sign_flip": sign_flip_p(diffs), "p_t": None, "t": None, "p_wilcoxon": None}
    if all(d == 0 for d in diffs):
        return {**out, "p_t": 1.0, "t": 0.0, "p_wilcoxon": 1.0}
    try:
        from scipy import stats
    except ImportError:  # the sign-flip test still stands
        return out
    t = stats.ttest_rel(a, b)
    out["t"], out["p_t"] = float(t.statistic), float(t.pvalue)
    if not math.isfinite(out["p_t"]):  # identical non-zero differences: no variance
        out["t"], out["p_t"] = None, None
    out["p_wilcoxon"] = float(stats.wilcoxon(a, b).pvalue)
    return out


def verdict(entry: dict[str, Any]) -> str:
    """Significant when the t-test and the sign-flip test both say p < ALPHA, not when both say p ≥ ALPHA."""
    ps = [p for p in (entry["p_t"], entry["p_sign_flip"]) if p is not None]
    if all(p < ALPHA for p in ps):
        return "significant"
    if all(p >= ALPHA for p in ps):
        return "not significant"
    return "borderline"


def compute(results: dict[str, Any], source: str, *, comparisons: tuple[tuple[str, str], ...],
            metric_fn: Callable[[Any], dict[str, float]], metric_names: dict[str, tuple[str, bool]]
            ) -> dict[str, Any]:
    """The paired comparisons of every scenario of ``results`` (``{"runs": [{"scenario", "method", "seed",
    "matrix"}]}``; runs of one ``seed`` are paired): each of ``comparisons`` on each metric of ``metric_names``
    (computed from a run's ``matrix`` by ``metric_fn``)."""
    runs = results["runs"]
    rows = []
    for scenario in dict.fromkeys(r["scenario"] for r in runs):
        by = {(r["method"], r["seed"]): metric_fn(r["matrix"]) for r in runs if r["scenario"] == scenario}
        for method, base in comparisons:
            seeds = sorted(s for m, s in by if m == method and (base, s) in by)
            if not seeds:
                continue
            for key, (_, higher) in metric_names.items():
                a = [by[method, s][key] for s in seeds]
                b = [by[base, s][key] for s in seeds]
                diffs = [x - y for x, y in zip(a, b)]
                mean, sd = mean_std(diffs)
                entry = {"scenario": scenario, "method": method, "baseline": base, "metric": key, "n": len(seeds),
                         "mean_difference": mean, "se": sd / len(seeds) ** 0.5,
                         "seeds_better": sum((d > 0) if higher else (d < 0) for d in diffs),
                         "seeds_tied": sum(d == 0 for d in diffs), **paired_tests(a, b)}
                entry["verdict"] = verdict(entry)
                rows.append(entry)
    return {"source": os.path.relpath(source, ROOT), "seeds": sorted({r["seed"] for r in runs}),
            "alpha": ALPHA, "tests": "two-sided: paired t-test (scipy.stats.ttest_rel), Wilcoxon signed-rank "
            "(scipy.stats.wilcoxon, exact), sign-flip permutation test of the mean (exact, all 2^n signs)",
            "comparisons": rows}


def p_text(p: float | None) -> str:
    """A p-value as the tables print it.

    Example:
        >>> p_text(None), p_text(0.0004), p_text(0.0512)
        ('–', '< 0.001', '0.051')
    """
    if p is None:
        return "–"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def markdown(stats: dict[str, Any], metric_keys: tuple[str, ...], *, names: dict[str, tuple[str, bool]],
             extra: tuple[str, Callable[[dict[str, Any]], str]] | None = None) -> str:
    """The paired tests as a table: a header line (replaced by each benchmark's own), then every comparison on
    ``metric_keys`` (named by ``names``) with its p-values and verdict, and an ``extra`` column
    ``(header, fn(entry) -> cell)`` before the verdict."""
    lines = [f"Paired over {len(stats['seeds'])} runs of `{stats['source']}`.", "",
             "| scenario | method vs baseline | metric | difference | seeds better | p, paired t | p, Wilcoxon "
             f"| p, sign-flip |{f' {extra[0]} |' if extra else ''} verdict |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if extra else "") + "---|"]
    for e in stats["comparisons"]:
        if e["metric"] not in metric_keys:
            continue
        name, higher = names[e["metric"]]
        more = f" {extra[1](e)} |" if extra else ""
        lines.append(f"| {e['scenario']} | {e['method']} vs {e['baseline']} | {name} {'↑' if higher else '↓'} | "
                     f"{100 * e['mean_difference']:+.1f} ± {100 * e['se']:.1f} | {e['seeds_better']}/{e['n']} | "
                     f"{p_text(e['p_t'])} | {p_text(e['p_wilcoxon'])} | {p_text(e['p_sign_flip'])} |{more} "
                     f"{e['verdict']} |")
    return "\n".join(lines)
