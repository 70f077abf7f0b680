"""The indexer guide's worked example (examples/sparse_indexer.py) runs end to end in a tiny configuration, and its
committed run is a run of the example's current setup. (That the guide's tables are the scripts' rendering of the
committed files is tests/test_numbers.py's check.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._helpers import load_script

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_RESULTS = ROOT / "benchmarks" / "results" / "indexer_example_cpu.json"


@pytest.fixture(scope="module")
def example():
    return load_script(ROOT / "examples" / "sparse_indexer.py", "sparse_indexer_example")


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


def test_the_committed_example_run_is_of_the_current_setup(example):
    results = json.loads(EXAMPLE_RESULTS.read_text())
    assert results["config"] == "cpu" and results["setup"] == json.loads(json.dumps(example.Setup().__dict__))
    # what the guide's prose says of the run in words
    for layer, lengths in results["best"].items():
        for n, best in lengths.items():
            assert best > 0.5  # the attention's own top N/8 keys hold most of its mass
            assert results["before"]["indexer"][layer][n] < results["window"][layer][n]  # untrained < the window
            assert results["after"]["kl"][layer][n] < results["before"]["kl"][layer][n]  # the KL falls
