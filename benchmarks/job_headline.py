"""Write the default job's headline table, from its committed run, into README.md and docs/quickstart.md.

The run directory of ``./scripts/run`` (the built-in default config of ``streamkl-distill``) is committed as
``benchmarks/results/default_cpu/`` (``results.json``, ``report.md``, ``eval.csv``, ``config.yaml``, the plots); this
replaces the text between the ``job-headline`` markers of both pages with
:func:`lightning_streamkl.jobs.headline_table` of its ``results.json``. ``tests/test_job_results.py`` checks it::

    ./scripts/run && cp runs/streamkl-distill/{results.json,report.md,eval.csv,config.yaml,*.png} \\
        benchmarks/results/default_cpu/ && python benchmarks/job_headline.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from lightning_streamkl.jobs import headline_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "default_cpu" / "results.json"
PAGES = [ROOT / "README.md", ROOT / "docs" / "quickstart.md"]
BLOCK = re.compile(r"(<!-- job-headline:start -->\n)(.*?)(<!-- job-headline:end -->)", re.S)


def main() -> None:
    table = headline_table(json.loads(RESULTS.read_text()))
    for page in PAGES:
        text, found = BLOCK.subn(lambda m: m.group(1) + table + "\n" + m.group(3), page.read_text())
        if found != 1:
            raise SystemExit(f"{page}: expected one job-headline block, found {found}")
        page.write_text(text)
        print(f"{page.relative_to(ROOT)}: headline table written")


if __name__ == "__main__":
    main()
