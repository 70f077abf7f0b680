"""Paired significance tests over the seeds of a continual-learning results file.

Every method and its baseline ran on the same seeds (same data, same initialisation), so each comparison is paired by
seed. For each scenario, comparison and metric this gives the mean difference, its standard error, the number of seeds
on which the method did better, and three two-sided p-values:

- the paired t-test (``scipy.stats.ttest_rel``);
- the Wilcoxon signed-rank test, exact for small samples (``scipy.stats.wilcoxon``);
- the exact sign-flip permutation test of the mean difference (all 2^n sign assignments; no scipy needed).

Results go to ``benchmarks/results/continual_<tag>_stats.json`` and the table between the ``continual-stats:<tag>``
markers of ``docs/guides/continual.md``::

    python benchmarks/continual/stats.py                                          # the 10-seed results
    python benchmarks/continual/stats.py benchmarks/results/continual_cpu10.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

from run import mean_std, metrics, update_docs  # noqa: E402

DEFAULT = os.path.join(ROOT, "benchmarks", "results", "continual_cpu10.json")
DOC = os.path.join(ROOT, "docs", "guides", "continual.md")
#: (method, baseline) pairs compared within each scenario
COMPARISONS = (("attention", "finetune"), ("lwf", "finetune"), ("attention+lwf", "finetune"),
               ("attention+lwf", "lwf"))
#: metric -> (name in the table, higher is better)
METRICS = {"final_accuracy": ("final average accuracy", True), "forgetting": ("average forgetting", False),
           "learning_accuracy": ("accuracy right after learning", True),
           "first_task_final": ("first task at the end", True)}
ALPHA = 0.05


def sign_flip_p(diffs: list[float]) -> float:
    """Exact two-sided p-value of the mean of paired differences under the sign-flip null (each difference is as
    likely to have either sign): the share of the 2^n sign assignments whose |mean| is at least the observed one.
    All 2^n assignments are enumerated (vectorised with numpy from n = 12 on: 2^15 for 15 pairs)."""
    observed = abs(sum(diffs))
    if observed == 0:
        return 1.0
    if len(diffs) >= 12:
        import numpy as np

        bits = (np.arange(2 ** len(diffs))[:, None] >> np.arange(len(diffs))[None, :]) & 1
        sums = np.abs((1 - 2 * bits) @ np.asarray(diffs, dtype=np.float64))
        return float(np.count_nonzero(sums >= observed * (1 - 1e-12))) / 2 ** len(diffs)
    hits = sum(abs(sum(s * d for s, d in zip(signs, diffs))) >= observed * (1 - 1e-12)
               for signs in itertools.product((1, -1), repeat=len(diffs)))
    return hits / 2 ** len(diffs)


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


def compute(results: dict[str, Any], source: str, *, comparisons: tuple[tuple[str, str], ...] = COMPARISONS,
            metric_fn: Callable[[list[list[float | None]]], dict[str, float]] = metrics,
            metric_names: dict[str, tuple[str, bool]] = METRICS) -> dict[str, Any]:
    """The paired comparisons of every scenario of ``results`` (``{"runs": [{"scenario", "method", "seed",
    "matrix"}]}``; runs of one ``seed`` are paired): each of ``comparisons`` on each metric of ``metric_names``
    (computed from a run's accuracy matrix by ``metric_fn``). The defaults are those of the synthetic benchmark."""
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


def _p(p: float | None) -> str:
    if p is None:
        return "–"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


TABLE_METRICS = ("final_accuracy", "forgetting", "first_task_final")


def markdown(stats: dict[str, Any], metric_keys: tuple[str, ...] = TABLE_METRICS, *,
             names: dict[str, tuple[str, bool]] = METRICS,
             extra: tuple[str, Callable[[dict[str, Any]], str]] | None = None) -> str:
    """The table of the guide: every comparison on ``metric_keys`` (named by ``names``), with its p-values and
    verdict, and an ``extra`` column ``(header, fn(entry) -> cell)`` before the verdict."""
    lines = [f"Paired by seed over seeds {stats['seeds'][0]}–{stats['seeds'][-1]} ({len(stats['seeds'])} seeds) of "
             f"`{stats['source']}`; differences in points (method − baseline), mean ± s.e.; two-sided p-values; "
             f"*significant* when the paired t-test and the exact sign-flip test both give p < {stats['alpha']:g}, "
             "*not significant* when both give p ≥ it. Written by `python benchmarks/continual/stats.py` into "
             f"`{stats['source'].replace('.json', '_stats.json')}`.", "",
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
                     f"{_p(e['p_t'])} | {_p(e['p_wilcoxon'])} | {_p(e['p_sign_flip'])} |{more} {e['verdict']} |")
    return "\n".join(lines)


def stats_path(results_path: str) -> str:
    return os.path.splitext(results_path)[0] + "_stats.json"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", default=DEFAULT, help="a continual results file (default: cpu10)")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the table in the guide")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        stats = compute(json.load(f), args.results)
    with open(stats_path(args.results), "w") as f:
        json.dump(stats, f, indent=1)
    print(markdown(stats))
    if not args.no_docs:
        tag = os.path.splitext(os.path.basename(args.results))[0].removeprefix("continual_")
        update_docs(stats, DOC, tag, prefix="continual-stats", render=markdown)
    return stats


if __name__ == "__main__":
    main()
