"""Every figure in README.md and the docs is traced to a committed result file (benchmarks/figures.py): the prose
quotes exactly what the files say, the generated tables are their scripts' output, and a figure that nothing backs
fails. Only committed files are read; nothing is re-run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ._helpers import load_script as _load

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def figures():
    return _load(ROOT / "benchmarks" / "figures.py", "docs_figures")


@pytest.fixture(scope="module")
def pages(figures):
    return figures.read_pages()


def test_every_figure_is_traced_to_a_committed_file(figures, pages):
    problems = figures.check(pages)
    assert not problems, "\n".join(problems)


def test_every_page_with_prose_is_checked(figures):
    checked = set(figures.PAGES)
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        rel = str(page.relative_to(ROOT))
        if rel.startswith("docs/api/") or rel == "docs/benchmarks.md":  # docstrings; generated whole by report.py
            continue
        assert rel in checked, f"{rel} is not in benchmarks/figures.py PAGES"


@pytest.mark.parametrize(("page", "old", "new"), [
    ("README.md", "peaked at 32.4 GiB", "peaked at 28 GiB"),  # the figure the last review found
    ("docs/guides/continual.md", "p = 0.172", "p = 0.017"),
    ("docs/quickstart.md", "needed 473 steps", "needed 450 steps"),
    ("docs/perf-notes.md", "201 µs per forward", "180 µs per forward"),
])
def test_a_number_edited_by_hand_fails(figures, pages, page, old, new):
    assert old in pages[page]
    problems = figures.check({**pages, page: pages[page].replace(old, new)})
    assert any(page in p for p in problems), problems


def test_a_new_unsourced_figure_fails(figures, pages):
    edited = pages["docs/faq.md"] + "\nThe fused loss is 3.7× faster than it was last week.\n"
    problems = figures.check({**pages, "docs/faq.md": edited})
    assert any("3.7×" in p for p in problems), problems


def test_a_generated_table_edited_by_hand_fails(figures, pages):
    page = "docs/quickstart.md"
    edited = pages[page].replace("| 82.9% |", "| 85.0% |", 1)
    assert edited != pages[page]
    assert any("figures:quickstart-eval" in p for p in figures.check({**pages, page: edited}))


@pytest.mark.parametrize(("results_file", "block", "recipes"), [
    ("minilm_cpu.json", "minilm:results", ["with_kl", "without_kl"]),
    ("minilm_relations_cpu.json", "minilm:relations", ["with_kl", "relations"]),
])
def test_the_minilm_tables_are_the_examples_output(results_file, block, recipes):
    example = _load(ROOT / "examples" / "minilm_attention_transfer.py", "minilm_example")
    results = json.loads((ROOT / "benchmarks" / "results" / results_file).read_text())
    found = re.search(rf"<!-- {block}:start -->\n(.*?)\n<!-- {block}:end -->",
                      (ROOT / "docs" / "examples.md").read_text(), re.S).group(1)
    assert found == example.markdown(results)
    assert [r["seed"] for r in results["runs"]] == results["args"]["seeds"] == [0, 1, 2]
    assert results["args"].get("recipes", ["with_kl", "without_kl"]) == recipes


def test_the_lora_memory_table_is_the_scripts_output():
    script = _load(ROOT / "benchmarks" / "lora_memory.py", "lora_memory")
    results = json.loads((ROOT / "benchmarks" / "results" / "lora_self_distillation_cpu.json").read_text())
    block = re.search(r"<!-- lora:memory:start -->\n(.*?)\n<!-- lora:memory:end -->",
                      (ROOT / "docs" / "guides" / "recipes.md").read_text(), re.S).group(1)
    assert block == script.markdown(results)
    assert [r["mode"] for r in results["runs"]] == ["frozen_copy", "adapters_off"]
