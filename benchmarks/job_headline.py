"""Write the default job's tables, from its committed run, into README.md and docs/quickstart.md.

The run directory of ``./scripts/run`` (the built-in default config of ``streamkl-distill``) is committed as
``benchmarks/results/default_cpu/`` (``results.json``, ``report.md``, ``eval.csv``, ``config.yaml``, the plots). The
``job-headline`` block of both pages is :func:`lightning_streamkl.jobs.headline_table` of its ``results.json``; the
quickstart's ``job:eval`` block is its held-out accuracy per length (``eval.csv``)::

    ./scripts/run && cp runs/streamkl-distill/{results.json,report.md,eval.csv,config.yaml,*.png} \\
        benchmarks/results/default_cpu/ && python benchmarks/job_headline.py
"""

from __future__ import annotations

import csv
import json
import os
import sys

from lightning_streamkl.jobs import headline_table

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import ROOT, write_blocks  # noqa: E402

RUN = os.path.join(HERE, "results", "default_cpu")


def eval_table(results: dict, accuracy: dict[tuple[str, int], float]) -> str:
    """Held-out accuracy of the three models at every evaluated length (``accuracy``: (model, N) -> accuracy)."""
    n_train = results["setup"]["train_seq_len"]
    lines = ["| context length N | teacher | student with attention KL | student without |", "|---|---|---|---|"]
    for n in results["eval"]["lengths"]:
        cells = [f"{100 * accuracy[m, n]:.1f}%" for m in ("teacher", "student_kl", "student_base")]
        if n == n_train:
            lines.append(f"| **{n}** (training) | " + " | ".join(f"**{c}**" for c in cells) + " |")
        else:
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def blocks() -> dict[str, dict[str, str]]:
    """page -> block name -> markdown, from the committed run."""
    with open(os.path.join(RUN, "results.json")) as f:
        results = json.load(f)
    with open(os.path.join(RUN, "eval.csv")) as f:
        accuracy = {(r["model"], int(r["seq_len"])): float(r["accuracy"]) for r in csv.DictReader(f)}
    headline = headline_table(results)
    return {"README.md": {"job-headline": headline},
            "docs/quickstart.md": {"job-headline": headline, "job:eval": eval_table(results, accuracy)}}


def main() -> None:
    for page, named in blocks().items():
        write_blocks(os.path.join(ROOT, page), named)
        print(f"{page}: {', '.join(named)} written")


if __name__ == "__main__":
    main()
