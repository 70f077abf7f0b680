"""Every generated block of README.md and docs/, rendered afresh from its committed result file by its script.

A generated block is the text between ``<!-- name:start -->`` and ``<!-- name:end -->``; docs/benchmarks.md is
generated whole. :data:`SOURCES` lists, per script, how it renders its blocks from the committed results (page ->
block name -> markdown); nothing is measured or trained here. Measured figures live in these blocks only: prose around
them cites the tables, never a number.

    python benchmarks/blocks.py            # check: every block that differs from its rendering (exit status 1)
    python benchmarks/blocks.py --write    # rewrite the blocks (and docs/benchmarks.md) from the results

tests/test_numbers.py runs the check.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import RESULTS, ROOT, read_block, read_json, write_blocks  # noqa: E402

#: a page generated whole, and the script that writes it
WHOLE_PAGES = {"docs/benchmarks.md": "benchmarks/report.py"}
MARKER = re.compile(r"<!-- (\S+?):start -->")


def script(path: str):
    """The script at ``path`` (from the repository root), imported under its own name with its folder on
    ``sys.path`` (as when it runs); loaded once.

    Example:
        >>> script("benchmarks/common.py").gpu_tag("NVIDIA H200")
        'nvidia-h200'
    """
    name = "_blocks_" + re.sub(r"\W", "_", path.removesuffix(".py"))
    if name in sys.modules:
        return sys.modules[name]
    folder = os.path.dirname(os.path.join(ROOT, path))
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(folder)


def _result(name: str):
    return read_json(os.path.join(RESULTS, name))


def _sharding() -> dict:
    bench, name = script("benchmarks/bench_sharding.py"), "sharding_nvidia-h200.json"
    source = f"benchmarks/results/{name}"
    return {"docs/guides/sharding.md": {k: render(_result(name), source) for k, render in bench.DOCS_BLOCKS.items()}}


def _minilm_example() -> dict:
    example = script("examples/minilm_attention_transfer.py")
    return {"docs/examples.md": {"minilm:results": example.markdown(_result("minilm_cpu.json")),
                                 "minilm:relations": example.markdown(_result("minilm_relations_cpu.json"))}}


def _continual() -> dict:
    digits, minilm = script("benchmarks/continual/split_digits.py"), script("benchmarks/continual/minilm_sequence.py")
    d, m = _result("split_digits/results.json"), _result("continual_minilm/results.json")
    return {"docs/guides/continual.md": {**{k: f(d) for k, f in digits.BLOCKS.items()},
                                         **{k: f(m) for k, f in minilm.BLOCKS.items()}}}


def _user_path() -> dict:
    return {os.path.relpath(doc, ROOT): named
            for doc, named in script("benchmarks/user_path.py").committed_blocks().items()}


def _one(path: str, page: str, name: str, render: str, result: str, *extra) -> Callable[[], dict]:
    """One block: ``script(path).<render>(<the result file>, *extra)`` on ``page``."""
    return lambda: {page: {name: getattr(script(path), render)(_result(result), *extra)}}


def _named(path: str, page: str, result: str) -> Callable[[], dict]:
    """The blocks ``script(path).blocks(<the result file>)`` returns, on ``page``."""
    return lambda: {page: script(path).blocks(_result(result))}


#: script -> its blocks from the committed results (page -> block name -> markdown)
SOURCES: dict[str, Callable[[], dict[str, dict[str, str]]]] = {
    "benchmarks/report.py": lambda: {"docs/concepts/kernels.md": script("benchmarks/report.py").design_blocks(),
                                     **script("benchmarks/report.py").readme_blocks()},
    "benchmarks/kernel_profile.py": _named("benchmarks/kernel_profile.py", "docs/concepts/kernels.md",
                                           "nvidia-h100-80gb-hbm3-kernel-profile.json"),
    "benchmarks/bench_pairs.py": _named("benchmarks/bench_pairs.py", "docs/guides/lightning.md",
                                        "nvidia-h100-80gb-hbm3-pairs.json"),
    "benchmarks/bench_sharding.py": _sharding,
    "benchmarks/bench_indexer.py": _one("benchmarks/bench_indexer.py", "docs/guides/indexer.md", "indexer-gpu",
                                        "docs_block", "indexer_nvidia-h100-80gb-hbm3.json",
                                        "benchmarks/results/indexer_nvidia-h100-80gb-hbm3.json"),
    "examples/sparse_indexer.py": _one("examples/sparse_indexer.py", "docs/guides/indexer.md", "indexer-example",
                                       "markdown", "indexer_example_cpu.json"),
    "examples/minilm_attention_transfer.py": _minilm_example,
    "benchmarks/lora_memory.py": _one("benchmarks/lora_memory.py", "docs/guides/recipes.md", "lora:memory",
                                      "markdown", "lora_self_distillation_cpu.json"),
    "benchmarks/ablation.py": _one("benchmarks/ablation.py", "docs/guides/choosing.md", "ablation", "markdown",
                                   "ablation_cpu.json"),
    "benchmarks/continual": _continual,
    "benchmarks/long_context/tables.py": lambda: script("benchmarks/long_context/tables.py").blocks(),
    "benchmarks/job_headline.py": lambda: script("benchmarks/job_headline.py").blocks(),
    "benchmarks/user_path.py": _user_path,
    "benchmarks/user_path_trl.py": _one("benchmarks/user_path_trl.py", "docs/guides/trl.md", "user-path-trl",
                                        "markdown", "nvidia-h100-80gb-hbm3-user-path-trl.json"),
    "benchmarks/overhead.py": _named("benchmarks/overhead.py", "docs/concepts/kernels.md", "nvidia-h200-overhead.json"),
    "benchmarks/real_batches.py": lambda: {"docs/concepts/kernels.md": script("benchmarks/real_batches.py").blocks(
        script("benchmarks/real_batches.py").load())},
}


def render_all() -> dict[str, dict[str, str]]:
    """page -> block name -> its rendering, over every source.

    Example (not run here: it imports every script; tests/test_numbers.py runs it)::

        render_all()["docs/concepts/kernels.md"]["kernels:bounds"]
    """
    pages: dict[str, dict[str, str]] = {}
    for source in SOURCES.values():
        for page, named in source().items():
            pages.setdefault(page, {}).update(named)
    return pages


def whole_pages() -> dict[str, str]:
    """The pages generated whole: page -> text.

    Example (not run here: tests/test_numbers.py runs it)::

        whole_pages()["docs/benchmarks.md"].startswith("# Benchmarks")
    """
    return {"docs/benchmarks.md": script("benchmarks/report.py").page()}


def stale(texts: dict[str, str] | None = None) -> list[str]:
    """Every problem: a block that differs from its rendering or whose markers are missing, a marker in a page that no
    source renders, a whole page that differs. ``texts`` (page -> text) stands in for the committed pages.

    Example (not run here: tests/test_numbers.py runs it)::

        assert stale() == []
    """
    rendered, problems = render_all(), []
    pages = sorted({"README.md", *rendered, *(os.path.relpath(os.path.join(d, f), ROOT) for d, _, files in
                                              os.walk(os.path.join(ROOT, "docs")) for f in files if f.endswith(".md"))})
    for page in pages:
        if texts is not None and page in texts:
            text = texts[page]
        else:
            with open(os.path.join(ROOT, page)) as f:
                text = f.read()
        named = rendered.get(page, {})
        for name in MARKER.findall(text):
            if name not in named:
                problems.append(f"{page}: no source renders the block {name}")
        for name, body in named.items():
            found = read_block(text, name)
            if found is None:
                problems.append(f"{page}: the markers of {name} are missing")
            elif found != body:
                problems.append(f"{page}: {name} is not its script's rendering of the committed results")
        if page in WHOLE_PAGES and text != whole_pages()[page]:
            problems.append(f"{page}: not what {WHOLE_PAGES[page]} writes")
    return problems


def write() -> None:
    """Rewrite every generated block and every page generated whole from the committed results."""
    for page, named in render_all().items():
        write_blocks(os.path.join(ROOT, page), named)
    for page, text in whole_pages().items():
        with open(os.path.join(ROOT, page), "w") as f:
            f.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite every block from the committed results")
    args = parser.parse_args(argv)
    if args.write:
        write()
    problems = stale()
    print("\n".join(problems) or "every generated block is its script's rendering of the committed results")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
