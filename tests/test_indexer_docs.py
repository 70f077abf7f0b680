"""The indexer guide's figures are its scripts' output: the worked example (examples/sparse_indexer.py) runs end to end
in a tiny configuration and its committed run is the table in docs/guides/indexer.md; the H100 table is
benchmarks/bench_indexer.py's rendering of the committed benchmark file. Only committed files are read for the docs;
the tiny run is the CI check that the example works."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ._helpers import load_script

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "indexer.md"
EXAMPLE_RESULTS = ROOT / "benchmarks" / "results" / "indexer_example_cpu.json"
GPU_RESULTS = ROOT / "benchmarks" / "results" / "indexer_nvidia-h100-80gb-hbm3.json"


@pytest.fixture(scope="module")
def example():
    return load_script(ROOT / "examples" / "sparse_indexer.py", "sparse_indexer_example")


def _block(name: str) -> str:
    found = re.search(rf"<!-- {name}:start -->\n(.*?)\n<!-- {name}:end -->", GUIDE.read_text(), re.S)
    assert found, f"docs/guides/indexer.md has no {name} block"
    return found.group(1)


def test_the_example_runs_tiny_end_to_end(example, tmp_path):
    out = tmp_path / "run.json"
    results = example.main(["--config", "tiny", "--threads", "1", "--output", str(out)])
    assert json.loads(out.read_text()) == results
    setup = results["setup"]
    assert [r["step"] for r in results["indexer"]["history"]][-1] == setup["dense_steps"] + setup["sparse_steps"]
    assert {r["sparse"] for r in results["indexer"]["history"]} == {0.0, 1.0}  # both stages ran
    for layer in ("l0", "l1"):
        for n in map(str, setup["eval_lengths"]):
            best = results["best"][layer][n]
            for part in (results["before"]["indexer"], results["after"]["indexer"], results["window"]):
                assert 0.0 <= part[layer][n] <= best + 1e-6 <= 1.0 + 1e-6  # no K keys capture more than the top K
            assert results["after"]["kl"][layer][n] < results["before"]["kl"][layer][n]  # the indexers learned
    rows = [line for line in example.markdown(results).splitlines() if line.startswith(("| l0 |", "| l1 |"))]
    assert len(rows) == 2 * len(setup["eval_lengths"])


def test_the_guide_shows_the_committed_example_run(example):
    results = json.loads(EXAMPLE_RESULTS.read_text())
    assert results["config"] == "cpu" and results["setup"] == json.loads(json.dumps(example.Setup().__dict__))
    assert _block("indexer-example") == example.markdown(results)
    # what the guide's prose says of the run in words
    for layer, lengths in results["best"].items():
        for n, best in lengths.items():
            assert best > 0.5  # the attention's own top N/8 keys hold most of its mass
            assert results["before"]["indexer"][layer][n] < results["window"][layer][n]  # untrained < the window
            assert results["after"]["kl"][layer][n] < results["before"]["kl"][layer][n]  # the KL falls


def test_the_guide_shows_the_committed_h100_run():
    bench = load_script(ROOT / "benchmarks" / "bench_indexer.py", "bench_indexer")
    result = json.loads(GPU_RESULTS.read_text())
    assert _block("indexer-gpu") == bench.docs_block(result, str(GPU_RESULTS.relative_to(ROOT)))
