"""The documentation stays true to the code: config listings equal the shipped config files, example excerpts are
lines of the example files, relative links point at files that exist, every page is in the mkdocs nav, and every
test the reliability page names exists.
(CI also builds the site with `mkdocs build --strict`.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))


def _fenced(text: str, marker: str) -> list[tuple[str, str]]:
    return re.findall(rf"<!-- {marker}: (\S+) -->\s*```(?:python|yaml)\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_listings_are_the_config_files(page):
    for file, shown in _fenced(page.read_text(), "config"):
        assert shown == (ROOT / file).read_text(), f"{page.name}: the listing of {file} is out of date"


@pytest.mark.parametrize("page", [*PAGES, ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_example_excerpts_are_example_code(page):
    for file, shown in _fenced(page.read_text(), "example"):
        source = iter(line.strip() for line in (ROOT / file).read_text().splitlines())
        for line in (s.strip() for s in shown.splitlines() if s.strip()):
            assert any(line == s for s in source), f"{page.name}: {line!r} is not (in order) in {file}"


def _links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # not inside code blocks
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", [*PAGES, ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for link in _links(page.read_text()):
        if re.match(r"[a-z]+://|mailto:|#", link):
            continue
        target = (page.parent / link.split("#")[0]).resolve()
        assert target.exists(), f"{page.relative_to(ROOT)} links to {link}, which does not exist"


def _nav_files(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [f for v in node.values() for f in _nav_files(v)]
    if isinstance(node, list):
        return [f for v in node for f in _nav_files(v)]
    return []


def test_every_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_files(config["nav"])
    assert len(nav) == len(set(nav))
    for file in nav:
        assert (DOCS / file).is_file(), f"mkdocs.yml lists {file}, which does not exist"
    missing = {str(p.relative_to(DOCS)) for p in PAGES} - set(nav)
    assert not missing, f"pages not in the mkdocs nav: {sorted(missing)}"


def test_readme_commands_exist():
    readme = (ROOT / "README.md").read_text()
    for script in ("scripts/run", "scripts/test"):
        assert f"./{script}" in readme and (ROOT / script).stat().st_mode & 0o111, script


def test_docstring_rst_is_converted_for_the_api_reference():
    pytest.importorskip("griffe")
    import importlib.util

    spec = importlib.util.spec_from_file_location("griffe_rst", DOCS / "griffe_rst.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.convert(
        "Title\n^^^^^\n\nSee :class:`~lightning_streamkl.LayerPair` and :math:`x^2`.\n\n    .. math::\n\n"
        "        a = b\n\n    Example::\n\n        >>> 1\n        1\n\n    .. tip:: Save it.\n")
    assert "**Title**" in text and '<autoref identifier="lightning_streamkl.LayerPair" optional>' in text
    assert "\\(x^2\\)" in text and "$$\n    a = b\n    $$" in text
    assert "    Examples:\n        >>> 1" in text and "!!! tip\n        Save it." in text


_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s+\S")


def lists_after_a_paragraph(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every list that starts on the line after a paragraph line. Python-Markdown (MkDocs)
    needs a blank line there; without it the list renders as one run-on paragraph (GitHub renders it either way)."""
    found, in_list, fence, prev = [], False, False, ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence, prev = not fence, line
            continue
        if fence:
            continue
        if _LIST_ITEM.match(line):
            if prev.strip() and not in_list and not prev.lstrip().startswith(("#", "|", "<!--")):
                found.append((number, line))
            in_list = True
        elif line.strip() and not line.startswith((" ", "\t")) and not prev.strip():
            in_list = False  # a new block after a blank line ends the list
        prev = line
    return found


def test_the_list_check_finds_a_list_glued_to_a_paragraph():
    assert lists_after_a_paragraph("Rules:\n- one\n- two\n") == [(2, "- one")]
    assert lists_after_a_paragraph("Rules:\n\n- one\n  more\n- two\n\n1. three\n") == []
    assert lists_after_a_paragraph("```\ntext\n- not a list\n```\n") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_lists_are_separated_from_the_paragraph_before(page):
    glued = lists_after_a_paragraph(page.read_text())
    assert not glued, f"{page.relative_to(ROOT)}: add a blank line before the list at line(s) {[n for n, _ in glued]}"


def test_the_site_loads_no_remote_assets():
    """Math is rendered by the KaTeX bundled under docs/vendor/katex: offline readers must not see raw TeX."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assets = [*config.get("extra_javascript", []), *config.get("extra_css", [])]
    assert any("katex" in a for a in assets)
    for asset in assets:
        assert not re.match(r"[a-z]+://|//", asset), f"mkdocs.yml loads {asset} from the network"
        assert (DOCS / asset).is_file(), f"mkdocs.yml loads {asset}, which is not under docs/"
    css = (DOCS / "vendor" / "katex" / "katex.min.css").read_text()
    fonts = set(re.findall(r"url\((fonts/[^)]+\.woff2)\)", css))
    assert fonts and all((DOCS / "vendor" / "katex" / font).is_file() for font in fonts)


@pytest.mark.parametrize("package", ["streamkl", "lightning_streamkl"])
def test_the_api_reference_documents_every_public_name(package):
    module = pytest.importorskip(package)
    api = " ".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    documented = {target.rsplit(".", 1)[-1] for target in re.findall(r"^::: ([\w.]+)", api, flags=re.M)}
    missing = sorted(set(module.__all__) - documented)
    assert not missing, f"docs/api/ has no `::: {package}.<name>` entry for {missing}"


def test_the_options_table_lists_every_option():
    """The Lightning guide's options table had no `teacher_sharding` (issue 34): every field of StreamKLConfig has a
    row (a row may name several options, `teacher_capture`, `student_capture`)."""
    import dataclasses

    from lightning_streamkl import StreamKLConfig

    text = (DOCS / "guides" / "lightning.md").read_text()
    table = text[text.index("| option | default | meaning |"):]
    rows = {name for line in table.splitlines() if line.startswith("| `")
            for name in re.findall(r"`(\w+)`", line.split("|")[1])}
    missing = [f.name for f in dataclasses.fields(StreamKLConfig) if f.name not in rows]
    assert not missing, f"docs/guides/lightning.md's options table has no row for {missing}"


def test_the_lightning_guide_shows_the_cli_yaml_whole():
    """The guide's copy of examples/lightning_cli.yaml dropped the teacher config's `init_args` (as an excerpt it
    passed the excerpt check) and, copied, built a default 6.7B Llama; it is now a listing of the whole file."""
    listings = dict(_fenced((DOCS / "guides" / "lightning.md").read_text(), "config"))
    assert listings.get("examples/lightning_cli.yaml") == (ROOT / "examples" / "lightning_cli.yaml").read_text()


def test_training_keys_are_named_as_they_are_logged():
    """index.md, quickstart.md, faq.md and choosing.md named `train/attn_kl/last` and `…/total`, but a training value
    logged per step and per epoch is logged as `…_step` and `…_epoch` (issue 34)."""
    history = {("docs/guides/cli.md", "train/attn_kl/<pair>")}  # the job's results.json keeps unsuffixed histories
    for page in [*PAGES, ROOT / "README.md"]:
        for key in re.findall(r"train/[\w<>]+/[^\s`'\")\]]*", page.read_text()):
            key = key.rstrip(",.;:")
            assert (str(page.relative_to(ROOT)), key) in history or key.endswith(("_step", "_epoch", "_{step,epoch}", "/", "...")), \
                f"{page.relative_to(ROOT)} names {key!r}: the logged key ends in _step or _epoch"


def test_the_pages_agree_that_windowed_and_soft_capped_layers_are_exact():
    """choosing.md told users to skip sliding-window and soft-capped layers as inexact, with a warning naming them;
    they are captured exactly (hf-models.md), and only biased layers are refused (issue 34)."""
    for page in [*PAGES, ROOT / "README.md"]:
        text = " ".join(page.read_text().split()).lower()
        assert "inexact layer" not in text, f"{page.relative_to(ROOT)} calls some layers inexact"


def _python_blocks(text: str) -> list[tuple[int, str]]:
    return [(m.start(), m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, flags=re.S)]


def test_the_readme_op_example_says_what_the_mean_is_over():
    """The op example passed only `key_padding_mask`, so padded query rows counted in the mean (issue 34)."""
    (op,) = [code for _, code in _python_blocks((ROOT / "README.md").read_text()) if "attention_kl(" in code]
    assert "query_mask=" in op


@pytest.mark.parametrize("page", ["quickstart.md", "guides/lightning.md"])
def test_the_first_loop_says_a_fresh_teacher_has_little_to_teach(page):
    """A first run with a freshly initialised teacher looks as if nothing happens; the trick the examples use
    (`initializer_range=0.3`) was only in examples/ (issue 34). Said before the page's second code block."""
    text = (DOCS / page).read_text()
    second = _python_blocks(text)[1][0]
    assert "initializer_range=0.3" in text[:second] and "uniform" in text[:second]


def test_the_recipes_guide_documents_what_a_step_gives_back():
    """`kd.terms` and `end_step`'s result were documented only in a docstring (issue 34)."""
    text = (DOCS / "guides" / "recipes.md").read_text()
    for field in ("`total`", "`per_pair`", "`kl_sums`", "`rows`", "kd.terms", "end_step"):
        assert field in text, field


def _reliability_references() -> list[tuple[str, str]]:
    """``(cell, test)`` for every test the reliability page names: ``file.py::test`` (a path below ``tests/``, or its
    tail) and the bare ``test_...`` names after it in the same cell, which are in the same file."""
    refs = []
    for line in (DOCS / "reliability.md").read_text().splitlines():
        if not line.startswith("| ") or line.startswith("|---"):
            continue
        cell, file = line.rstrip().rstrip("|").split(" | ")[-1], None
        for token in re.findall(r"`([^`]+)`", re.sub(r"\[[^\]`]*\]", "", cell)):
            named = re.fullmatch(r"([\w/]+\.py)::(?:\w+::)?(\w+)", token)
            if named:
                file, test = named.groups()
            elif file is None or not re.fullmatch(r"test_\w+", token):
                continue
            else:
                test = token
            refs.append((file, test))
    return refs


def test_every_test_the_reliability_page_names_exists():
    """docs/reliability.md ties each behaviour to tests by name: each of them is defined in a file below ``tests/``
    whose path ends as the page writes it (a renamed or removed test fails here, not silently in the page)."""
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "tests").rglob("*.py")}
    refs = _reliability_references()
    assert len(refs) > 50  # the page's tables were read
    for file, test in refs:
        files = [f for f in sources if f == file or f.endswith("/" + file)]
        assert files, f"reliability.md names {file}, which is no test file"
        assert any(re.search(rf"^\s*(?:def|class) {test}\b", sources[f], flags=re.M) for f in files), (
            f"reliability.md names {file}::{test}, which is not defined there")
