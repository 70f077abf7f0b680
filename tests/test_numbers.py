"""Every measured figure in README.md and the docs sits in a generated block, and every generated block is its script's
rendering of the committed results (``benchmarks/blocks.py``); docs/benchmarks.md is report.py's page, whole. Only
committed files are read; nothing is measured or trained."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def blocks():
    return load_script(ROOT / "benchmarks" / "blocks.py", "docs_blocks")


@pytest.fixture(scope="module")
def rendered(blocks):
    return blocks.render_all()


def test_every_generated_block_is_its_scripts_rendering(blocks):
    problems = blocks.stale()
    assert not problems, "run `python benchmarks/blocks.py --write`:\n" + "\n".join(problems)


def test_every_page_with_measurements_has_its_blocks(rendered):
    """The pages that show results: the kernel design page, the guides with benchmarks, README and the home page."""
    assert {"README.md", "docs/index.md", "docs/quickstart.md", "docs/concepts/kernels.md", "docs/guides/lightning.md",
            "docs/guides/long-context.md", "docs/guides/continual.md", "docs/guides/indexer.md",
            "docs/guides/sharding.md", "docs/guides/precision.md"} <= set(rendered)
    assert {"kernels:bounds", "kernels:headline", "kernels:tiles", "kernels:profile"} <= set(
        rendered["docs/concepts/kernels.md"])


def test_a_block_edited_by_hand_is_found(blocks, rendered):
    body = rendered["README.md"]["grid:summary"]
    text = (ROOT / "README.md").read_text().replace(body, body.replace("ms", "µs", 1))
    assert any("README.md: grid:summary" in p for p in blocks.stale({"README.md": text}))


def test_a_block_without_a_source_or_without_its_markers_is_found(blocks):
    page = "docs/faq.md"
    text = (ROOT / page).read_text() + "\n<!-- made-up:start -->\n| 1 |\n<!-- made-up:end -->\n"
    assert any("no source renders the block made-up" in p for p in blocks.stale({page: text}))
    guide = (ROOT / "docs/guides/lightning.md").read_text().replace("<!-- pairs:step:end -->", "")
    assert any("markers of pairs:step are missing" in p for p in blocks.stale({"docs/guides/lightning.md": guide}))


def test_the_benchmarks_page_is_generated_whole(blocks):
    text = (ROOT / "docs/benchmarks.md").read_text() + "\nA sentence added by hand.\n"
    assert any("docs/benchmarks.md" in p for p in blocks.stale({"docs/benchmarks.md": text}))
