"""The benchmark scripts behind the docs' result tables: they run, their metrics are right, and the committed tables
are exactly what the scripts print from the committed raw results (so the docs cannot drift from the data)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONTINUAL_DOC = (ROOT / "docs" / "guides" / "continual.md").read_text()


def _load(path: Path, name: str):
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


@pytest.fixture(scope="module")
def continual():
    return _load(ROOT / "benchmarks" / "continual" / "run.py", "continual_run")


def test_forgetting_metrics_on_a_known_matrix(continual):
    matrix = [[1.0, 0.5, 0.25], [None, 0.75, 0.5], [None, None, 1.0]]
    m = continual.metrics(matrix)
    assert m["final_accuracy"] == pytest.approx((0.25 + 0.5 + 1.0) / 3)
    # forgetting of task i: best accuracy before the last task minus the final one, averaged over old tasks
    assert m["forgetting"] == pytest.approx(((1.0 - 0.25) + (0.75 - 0.5)) / 2)
    assert m["learning_accuracy"] == pytest.approx((1.0 + 0.75 + 1.0) / 3)
    assert m["first_task_final"] == 0.25


@pytest.mark.slow
def test_one_short_run_of_every_method(continual):
    cfg = yaml.safe_load((ROOT / "benchmarks" / "continual" / "cpu.yaml").read_text())
    cfg.update(steps_per_task=3, train_size=128, test_size=64, batch_size=32)
    for scenario in cfg["scenarios"]:
        for method in cfg["methods"]:
            run = continual.run_one(cfg, scenario, method, seed=0)
            matrix = run["matrix"]
            assert len(matrix) == len(cfg["tasks"]) == 3
            for i in range(3):
                for j in range(3):
                    assert (matrix[i][j] is None) == (j < i)
                    if j >= i:
                        assert 0.0 <= matrix[i][j] <= 1.0


@pytest.mark.parametrize("tag", ["cpu", "cpu10", "sweep"])
def test_committed_continual_tables_are_the_scripts_output(continual, tag):
    results = json.loads((RESULTS / f"continual_{tag}.json").read_text())
    summary = continual.summarise(results["runs"])
    assert json.loads(json.dumps(summary)) == results["summary"]  # the summary is recomputable from the raw runs
    block = re.search(rf"<!-- continual-results:{tag}:start -->\n(.*?)\n<!-- continual-results:{tag}:end -->",
                      CONTINUAL_DOC, re.S).group(1)
    assert block == continual.markdown(results)
    seeds = {r["seed"] for r in results["runs"]}
    assert seeds == set(results["config"]["seeds"])


@pytest.fixture(scope="module")
def ablation():
    return _load(ROOT / "benchmarks" / "ablation.py", "ablation_run")


def test_committed_ablation_table_is_the_scripts_output(ablation):
    results = json.loads((RESULTS / "ablation_cpu.json").read_text())
    doc = (ROOT / "docs" / "guides" / "choosing.md").read_text()
    block = re.search(r"<!-- ablation:table -->\n(.*?)\n<!-- /ablation -->", doc, re.S).group(1)
    assert block == ablation.markdown(results)
    assert {r["variant"] for r in results["runs"]} == set(ablation.VARIANTS)


def test_every_ablation_variant_is_a_valid_job_command_line(ablation, capsys):
    pytest.importorskip("jsonargparse")
    from lightning_streamkl.jobs.cli import main

    for name, overrides in ablation.VARIANTS.items():
        with pytest.raises(SystemExit) as exit_info:
            main(ablation.COMMON + (overrides or []) + ["--print_config"])
        assert exit_info.value.code in (0, None), name
    printed = capsys.readouterr().out
    assert "direction: reverse" in printed and "temperature: 0.5" in printed
