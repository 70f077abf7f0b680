"""The benchmark scripts behind the docs' result tables: they run, their metrics are right, and the committed tables
are exactly what the scripts print from the committed raw results (so the docs cannot drift from the data)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from ._helpers import load_script as _load

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONTINUAL_DOC = (ROOT / "docs" / "guides" / "continual.md").read_text()


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
def continual_stats():
    return _load(ROOT / "benchmarks" / "continual" / "stats.py", "continual_stats")


def test_the_sign_flip_test_is_exact(continual_stats):
    # five positive differences: only "all +" and "all −" of the 2^5 sign assignments reach the observed |mean|
    assert continual_stats.sign_flip_p([1.0, 2.0, 3.0, 4.0, 5.0]) == 2 / 32
    assert continual_stats.sign_flip_p([1.0, -1.0]) == 1.0
    assert continual_stats.sign_flip_p([0.0, 0.0, 0.0]) == 1.0
    assert continual_stats.sign_flip_p([3.0, -1.0, 2.0]) == 4 / 8  # |±3 ±1 ±2| ≥ 4: (+,−,+), (+,+,+) and their negatives


def test_committed_continual_stats_are_the_scripts_output(continual_stats):
    """The paired tests of the 10-seed continual results: recomputable from the raw runs, and the guide's table is
    the script's rendering of them."""
    pytest.importorskip("scipy")
    source = RESULTS / "continual_cpu10.json"
    committed = json.loads((RESULTS / "continual_cpu10_stats.json").read_text())
    recomputed = json.loads(json.dumps(continual_stats.compute(json.loads(source.read_text()), str(source))))
    assert recomputed.keys() == committed.keys() and len(recomputed["comparisons"]) == len(committed["comparisons"])
    for new, old in zip(recomputed["comparisons"], committed["comparisons"]):
        numbers = {k for k, v in old.items() if isinstance(v, float)}
        assert {k: v for k, v in new.items() if k not in numbers} == {k: v for k, v in old.items() if k not in numbers}
        assert {k: new[k] for k in numbers} == pytest.approx({k: old[k] for k in numbers}, rel=1e-9, abs=1e-12)
    block = re.search(r"<!-- continual-stats:cpu10:start -->\n(.*?)\n<!-- continual-stats:cpu10:end -->",
                      CONTINUAL_DOC, re.S).group(1)
    assert block == continual_stats.markdown(committed)
    by = {(c["scenario"], c["method"], c["baseline"], c["metric"]): c for c in committed["comparisons"]}
    # the two differences the guide calls noise
    assert by["task-incremental", "attention", "finetune", "final_accuracy"]["p_t"] == pytest.approx(0.17, abs=0.01)
    assert by["task-incremental", "attention+lwf", "lwf", "forgetting"]["p_t"] == pytest.approx(0.30, abs=0.01)


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


# ------------------------------------------------------------------------------------ the kernel benchmark tooling
@pytest.fixture(scope="module")
def report():
    return _load(ROOT / "benchmarks" / "report.py", "bench_report")


def test_report_reads_only_benchmark_grids(report):
    grids = report.find_results(report.is_grid)
    assert [Path(p).name for p in grids] == ["nvidia-h100-80gb-hbm3.json"]
    assert [Path(p).name for p in report.find_results(report.is_tuning)] == ["nvidia-h100-80gb-hbm3-tuning.json"]
    with pytest.raises(ValueError, match="not a benchmark grid"):
        report.load(str(RESULTS / "ablation_cpu.json"))


def test_report_without_arguments_regenerates_the_committed_pages(report, tmp_path, monkeypatch):
    """`python benchmarks/report.py` (no argument) once crashed on the ablation results; it must skip the files
    that are not grids and write exactly the committed pages."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "perf-notes.md").write_text((ROOT / "docs" / "perf-notes.md").read_text())
    monkeypatch.setattr(report, "DOCS", str(docs))
    monkeypatch.setattr(report, "PERF_NOTES", str(docs / "perf-notes.md"))
    report.main(["--no-plots"])
    for page in ("benchmarks.md", "perf-notes.md"):
        assert (docs / page).read_text() == (ROOT / "docs" / page).read_text(), f"docs/{page} is not the report's"


def test_perf_notes_tables_are_the_committed_json(report):
    text = (ROOT / "docs" / "perf-notes.md").read_text()
    for name in ("bounds", *report.TUNING_BLOCKS):
        assert f"<!-- {name}:start -->" in text
    grid, tuning = report.find_results(report.is_grid)[0], report.find_results(report.is_tuning)[0]
    assert report.perf_notes(text, grid, tuning) == text
    edited = text.replace("| 64 | forward | 64×64, 4 warps, 3 stages | 0.958 |", "| 64 | forward | 64×64, 4 warps, 3 stages | 0.982 |")
    assert edited != text and report.perf_notes(edited, grid, tuning) == text


def test_max_n_merges_into_the_existing_results_file(tmp_path, monkeypatch):
    """`--max-n` re-measures the short rows of an existing results file: the rows it did not re-measure, and the
    first run's metadata, must survive (it once overwrote the file with the new records only)."""
    import torch

    bench = _load(ROOT / "benchmarks" / "bench_attention_kl.py", "bench_grid")

    def record(provider, mode, n, ms):
        shape = {"b": 1, "h": 16, "n": n, "d": 64, "causal": False, "dtype": "bfloat16", "h_kt": None, "d_s": None,
                 "teacher_grad": False}
        return {"provider": provider, "mode": mode, "shape": shape, "ms": ms, "peak_bytes": None, "status": "ok",
                "extra": {}}

    previous = {"device": "first GPU", "torch": "1st", "triton": "t", "host": "h",
                "ceilings": {"exp2_per_s": 1.0, "bf16_matmul_flops": 1.0, "copy_bytes_per_s": 1.0},
                "records": [record("streamkl", "fwd", 1024, 9.0), record("streamkl", "fwd", 16384, 5.0)]}
    out = tmp_path / "grid.json"
    out.write_text(json.dumps(previous))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "second GPU")
    monkeypatch.setattr(bench, "measure_ceilings", lambda: previous["ceilings"])
    monkeypatch.setattr(bench, "make_inputs", lambda shape: tuple(torch.zeros(1) for _ in range(4)))
    monkeypatch.setattr(bench, "sdpa_fn", lambda shape, backend: (None, ()))
    monkeypatch.setattr(bench, "naive_fn", lambda *args: None)
    monkeypatch.setattr(bench, "time_fwd_bwd", lambda provider, shape, fn, targets: [
        bench.Record(provider, mode, bench.asdict(shape), ms=1.0) for mode in ("fwd", "bwd")])
    bench.main(["--max-n", "1024", "--out", str(out)])
    merged = json.loads(out.read_text())
    assert merged["device"] == "first GPU" and merged["torch"] == "1st"
    assert merged["notes"] and "--max-n 1024" in merged["notes"][-1]
    by_key = {(r["provider"], r["mode"], r["shape"]["n"], r["shape"]["d"], r["shape"]["causal"]): r["ms"]
              for r in merged["records"]}
    assert by_key[("streamkl", "fwd", 16384, 64, False)] == 5.0  # not re-measured: kept
    assert by_key[("streamkl", "fwd", 1024, 64, False)] == 1.0  # re-measured: replaced, once
    assert sum(1 for r in merged["records"] if r["shape"]["n"] == 1024 and r["shape"]["d"] == 64
               and not r["shape"]["causal"] and r["provider"] == "streamkl" and r["mode"] == "fwd") == 1
    assert {r["shape"]["n"] for r in merged["records"]} == {1024, 16384}
    assert all(r["ms"] == 1.0 for r in merged["records"] if r["shape"]["n"] == 1024)


def test_every_teacher_plateau_check_is_a_valid_job_command_line(capsys):
    pytest.importorskip("jsonargparse")
    from lightning_streamkl.jobs.cli import main

    plateau = _load(ROOT / "benchmarks" / "teacher_plateau.py", "teacher_plateau")
    for name, overrides in plateau.CHECKS.items():
        with pytest.raises(SystemExit) as exit_info:
            main([*plateau.COMMON, *overrides, "--job.run_dir=unused", "--print_config"])
        assert exit_info.value.code in (0, None), name
    assert "- 512" in capsys.readouterr().out


@pytest.mark.slow
def test_the_sharding_benchmark_runs_on_two_cpu_processes(tmp_path, monkeypatch):
    """``bench_sharding.py --smoke``: every layout and the sequence-sharded KL run end to end (2 gloo processes, tiny
    sizes), the layouts agree on the first step's KL and the sharded KL is exact; the JSON lands in the results
    folder and in $OUT."""
    bench = _load(ROOT / "benchmarks" / "bench_sharding.py", "bench_sharding")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    result = bench.main(["--smoke", "--results", str(tmp_path / "results")])
    assert json.loads((tmp_path / "results" / "sharding_cpu-smoke.json").read_text()) == json.loads(
        (tmp_path / "out" / "sharding_cpu-smoke.json").read_text()) == json.loads(json.dumps(result))
    assert set(result["layouts"]) == {"ddp", "fsdp", "ddp+sharded-teacher"}
    for name, layout in result["layouts"].items():
        assert layout["first_step_kl_max_rel_diff_vs_ddp"] < 1e-5, name
        shares = [g["teacher_params_on_this_gpu"] / g["teacher_params"] for g in layout["per_gpu"]]
        assert shares == pytest.approx([1.0, 1.0] if name == "ddp" else [0.5, 0.5], abs=0.05), (name, shares)
    exact = result["context_parallel"]["exactness_vs_one_gpu"]
    assert max(exact.values()) < 1e-5, exact
    for render in bench.DOCS_BLOCKS.values():  # the guide's tables render any run, memory or not (CPU: n/a)
        assert render(result, "sharding_cpu-smoke.json").count("\n| ") >= 3


def test_the_sharding_guide_shows_the_committed_h200_run():
    """docs/guides/sharding.md's ``sharding-gpu`` and ``sharding-gpu-context`` blocks are bench_sharding.py's
    rendering of the committed 2-GPU run (``--docs`` writes them); the prose figures are traced by
    benchmarks/figures.py."""
    bench = _load(ROOT / "benchmarks" / "bench_sharding.py", "bench_sharding")
    path = ROOT / "benchmarks" / "results" / "sharding_nvidia-h200.json"
    result = json.loads(path.read_text())
    assert result["device"] == "nvidia-h200" and result["world"] == 2
    guide = (ROOT / "docs" / "guides" / "sharding.md").read_text()
    for name, render in bench.DOCS_BLOCKS.items():
        found = re.search(rf"<!-- {name}:start -->\n(.*?)\n<!-- {name}:end -->", guide, re.S)
        assert found, f"docs/guides/sharding.md has no {name} block"
        assert found.group(1) == render(result, str(path.relative_to(ROOT))), f"{name}: run bench_sharding.py --docs"
