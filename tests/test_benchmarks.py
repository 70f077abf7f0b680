"""The benchmark scripts behind the docs' result tables: they run, their metrics are right, and the committed tables
are exactly what the scripts print from the committed raw results (so the docs cannot drift from the data)."""

from __future__ import annotations

import json
import math
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
    """`python benchmarks/report.py` with no argument (plots included) once crashed on the ablation results; it must
    skip the files that are not grids and write exactly the committed pages."""
    pytest.importorskip("matplotlib")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "perf-notes.md").write_text((ROOT / "docs" / "perf-notes.md").read_text())
    monkeypatch.setattr(report, "DOCS", str(docs))
    monkeypatch.setattr(report, "PERF_NOTES", str(docs / "perf-notes.md"))
    monkeypatch.setattr(report, "IMG", str(docs / "img"))
    report.main([])
    for page in ("benchmarks.md", "perf-notes.md"):
        assert (docs / page).read_text() == (ROOT / "docs" / page).read_text(), f"docs/{page} is not the report's"
    images = sorted(p.name for p in (docs / "img").iterdir())
    assert images == sorted(Path(p).name for p in report.plot_files("nvidia-h100-80gb-hbm3"))
    for image in images:  # every plot the page links is committed
        assert f"](img/{image})" in (docs / "benchmarks.md").read_text() or image == "readme_memory_time.png"
        assert (ROOT / "docs" / "img" / image).exists()


def test_a_grid_of_another_card_leaves_the_perf_notes_alone(report, tmp_path, monkeypatch):
    """The perf notes' tables come from the named H100 runs, not from the last grid passed or found."""
    other = json.loads((RESULTS / "nvidia-h100-80gb-hbm3.json").read_text())
    other["device"] = "Other GPU"
    other["ceilings"] = {k: 2 * v for k, v in other["ceilings"].items()}
    path = tmp_path / "zz-other-gpu.json"
    path.write_text(json.dumps(other))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "perf-notes.md").write_text((ROOT / "docs" / "perf-notes.md").read_text())
    monkeypatch.setattr(report, "DOCS", str(docs))
    monkeypatch.setattr(report, "PERF_NOTES", str(docs / "perf-notes.md"))
    report.main(["--no-plots", str(path)])
    assert "## Other GPU" in (docs / "benchmarks.md").read_text()
    assert (docs / "perf-notes.md").read_text() == (ROOT / "docs" / "perf-notes.md").read_text()


def test_perf_notes_tables_are_the_committed_json(report):
    text = (ROOT / "docs" / "perf-notes.md").read_text()
    for name in ("bounds", *report.TUNING_BLOCKS):
        assert f"<!-- {name}:start -->" in text
    grid, tuning = report.PERF_NOTES_GRID, report.PERF_NOTES_TUNING
    assert report.perf_notes(text, grid, tuning) == text
    edited = text.replace("| 64 | forward | 64×64, 4 warps, 3 stages | 0.958 |", "| 64 | forward | 64×64, 4 warps, 3 stages | 0.982 |")
    assert edited != text and report.perf_notes(edited, grid, tuning) == text


def test_perf_notes_gap_table_is_the_committed_runs(report):
    """The remaining-gap table is report.py's rendering of the latest training-call run (``PERF_NOTES_TRAINING``)
    against the grid's ceilings, and
    the work it charges the training call is the sum of the bounds table's fused forward and key pass."""
    text = (ROOT / "docs" / "perf-notes.md").read_text()
    assert "<!-- gap:start -->" in text
    paths = report.PERF_NOTES_GRID, report.PERF_NOTES_TUNING, report.PERF_NOTES_TRAINING
    assert report.perf_notes(text, *paths) == text
    edited = report.replace_block(text, "gap", "| N8192-D64 | 2.700 |")
    assert edited != text and report.perf_notes(edited, *paths) == text
    work = {name: (products, exps) for name, products, exps in report.PASSES}
    fused, key = work["forward accumulating dQ_s (v6, frozen teacher, with grad)"], \
        work["backward after it: the key pass, student only"]
    assert (fused[0] + key[0], fused[1] + key[1]) == report.TRAINING_CALL_WORK


def test_perf_notes_grid_refresh_table_is_the_two_committed_grids(report):
    """The "grid re-measured" table is report.py's rendering of the grid as published before (``PERF_NOTES_GRID``)
    against the full grid of v17 (``PERF_NOTES_CURRENT_GRID``), which is the one docs/benchmarks.md shows."""
    text = (ROOT / "docs" / "perf-notes.md").read_text()
    paths = (report.PERF_NOTES_GRID, report.PERF_NOTES_TUNING, report.PERF_NOTES_TRAINING,
             report.PERF_NOTES_CURRENT_GRID)
    assert report.perf_notes(text, *paths) == text
    edited = report.replace_block(text, "grid-refresh", "| 16 | 64 | False | 8192 | 1.00× → 1.00× | 1.00× → 1.00× |")
    assert edited != text and report.perf_notes(edited, *paths) == text
    assert report.find_results(report.is_grid) == [report.PERF_NOTES_CURRENT_GRID]


def test_perf_notes_conclusions_hold_in_the_tuning_json(report):
    """The tuning section's sentences without a number (figures.py checks the numbers) against the committed sweep."""
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "perf-notes.md").read_text())
    tuning = json.loads(Path(report.PERF_NOTES_TUNING).read_text())
    assert "the atomic-free two-pass backward is faster than the one-pass atomic one at both head dims" in text
    for d in (64, 128):
        for causal in ("false", "true"):
            two_pass = min(tuning[f"bwd-det-{p}/D{d}/best"][causal]["ms"] for p in ("dk", "dq"))
            assert two_pass < tuning[f"bwd-atomic/D{d}/best"][causal]["ms"], (d, causal)
    assert "slower in every configuration of the sweep that has a plain twin" in text
    ratios = [float(row.split("|")[5].strip().rstrip("×")) for row in report.tuning_pipeline(tuning).splitlines()[2:]]
    assert ratios and min(ratios) > 1.0


# ------------------------------------------------------------------------------- bench_attention_kl.py's files
def _record(provider, mode, n, ms):
    shape = {"b": 1, "h": 16, "n": n, "d": 64, "causal": False, "dtype": "bfloat16", "h_kt": None, "d_s": None,
             "teacher_grad": False}
    return {"provider": provider, "mode": mode, "shape": shape, "ms": ms, "peak_bytes": None, "status": "ok",
            "extra": {}}


_PREVIOUS = {"device": "first GPU", "torch": "1st", "triton": "t", "host": "h",
             "ceilings": {"exp2_per_s": 1.0, "bf16_matmul_flops": 1.0, "copy_bytes_per_s": 1.0},
             "records": [_record("streamkl", "fwd", n, 9.0) for n in (1024, 2048, 8192, 16384, 32768)]}


@pytest.fixture
def bench(monkeypatch, tmp_path):
    """bench_attention_kl.py on the CPU: every measurement is faked (1 ms, 1 byte) on a "second GPU", and the default
    output folder is ``tmp_path``."""
    import torch

    bench = _load(ROOT / "benchmarks" / "bench_attention_kl.py", "bench_grid")
    monkeypatch.setattr(bench, "RESULTS", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "second GPU")
    monkeypatch.setattr(bench, "measure_ceilings", lambda: _PREVIOUS["ceilings"])
    monkeypatch.setattr(bench, "make_inputs", lambda shape: tuple(torch.zeros(1) for _ in range(4)))
    monkeypatch.setattr(bench, "sdpa_fn", lambda shape, backend: (None, ()))
    monkeypatch.setattr(bench, "naive_fn", lambda *args: None)
    monkeypatch.setattr(bench, "time_fwd_bwd", lambda provider, shape, fn, targets: [
        bench.Record(provider, mode, bench.asdict(shape), ms=1.0) for mode in ("fwd", "bwd")])
    monkeypatch.setattr(bench, "peak_memory", lambda provider, shape, make: bench.Record(
        provider, "mem", bench.asdict(shape), peak_bytes=1))
    return bench


def test_max_n_merges_into_the_existing_results_file(bench, tmp_path):
    """`--max-n` re-measures the short rows of an existing results file: the rows it did not re-measure, and the
    first run's metadata, must survive (it once overwrote the file with the new records only)."""
    out = tmp_path / "grid.json"
    out.write_text(json.dumps(_PREVIOUS))
    bench.main(["--max-n", "1024", "--out", str(out)])
    merged = json.loads(out.read_text())
    assert merged["device"] == "first GPU" and merged["torch"] == "1st"
    assert merged["notes"] and "--max-n 1024" in merged["notes"][-1]
    by_key = {(r["provider"], r["mode"], r["shape"]["n"], r["shape"]["d"], r["shape"]["causal"]): r["ms"]
              for r in merged["records"]}
    assert by_key[("streamkl", "fwd", 1024, 64, False)] == 1.0  # re-measured: replaced, once
    assert sum(1 for r in merged["records"] if r["shape"]["n"] == 1024 and r["shape"]["d"] == 64
               and not r["shape"]["causal"] and r["provider"] == "streamkl" and r["mode"] == "fwd") == 1
    assert {r["shape"]["n"] for r in merged["records"]} == {1024, 2048, 8192, 16384, 32768}
    assert all(r["ms"] == 9.0 for r in merged["records"] if r["shape"]["n"] > 1024)  # not re-measured: kept
    assert all(r["ms"] == 1.0 for r in merged["records"] if r["shape"]["n"] == 1024)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.json"]  # no progress file left


def test_a_quick_run_never_replaces_the_grid_and_merges_like_max_n(bench, tmp_path):
    """`--quick` once wrote its few rows over the merged grid `results/<gpu>.json` (its default output): it writes a
    run file of its own, and `--merge` (whose output defaults to the grid of the run's device) folds it in."""
    grid = tmp_path / "second-gpu.json"
    grid.write_text(json.dumps({**_PREVIOUS, "device": "second GPU"}))
    bench.main(["--quick"])
    assert json.loads(grid.read_text()) == {**_PREVIOUS, "device": "second GPU"}
    quick = tmp_path / "runs" / "second-gpu-quick.json"
    run_ = json.loads(quick.read_text())
    assert run_["device"] == "second GPU" and {r["shape"]["n"] for r in run_["records"]} == {8192, 16384}
    bench.main(["--merge", str(quick), "--note", "the quick rows of a kernel change"])
    merged = json.loads(grid.read_text())
    assert merged["notes"] == ["the quick rows of a kernel change"]
    assert len(merged["records"]) == len(run_["records"]) + 4  # the 8192 row replaced, the four others kept
    assert {r["shape"]["n"]: r["ms"] for r in merged["records"] if r["mode"] == "fwd" and r["provider"] == "streamkl"
            and r["shape"]["d"] == 64 and not r["shape"]["causal"]} == {1024: 9.0, 2048: 9.0, 8192: 1.0,
                                                                         16384: 9.0, 32768: 9.0}


def test_a_memory_only_run_measures_the_memory_rows_into_a_run_file_of_its_own(bench, tmp_path):
    """`--memory-only` re-measures the full grid's memory rows (after a change to what the op saves) and nothing
    else, into `runs/<gpu>-memory.json`, never over the grid; `--merge` folds them in like a quick run."""
    grid = tmp_path / "second-gpu.json"
    grid.write_text(json.dumps({**_PREVIOUS, "device": "second GPU"}))
    bench.main(["--memory-only"])
    assert json.loads(grid.read_text()) == {**_PREVIOUS, "device": "second GPU"}
    run_ = json.loads((tmp_path / "runs" / "second-gpu-memory.json").read_text())
    assert {r["mode"] for r in run_["records"]} == {"mem"}
    assert {(s.h, s.d, s.n) for s in bench.memory_grid(False)} == {
        (r["shape"]["h"], r["shape"]["d"], r["shape"]["n"]) for r in run_["records"]}
    with pytest.raises(SystemExit):
        bench.main(["--memory-only", "--quick"])


def test_an_interrupted_run_leaves_its_output_alone(bench, tmp_path, monkeypatch):
    """While measuring, records go to `<out>.partial`, never into the output; `--merge` folds the partial run in."""
    out = tmp_path / "grid.json"
    out.write_text(json.dumps(_PREVIOUS))
    def time_fwd_bwd(provider, shape, fn, targets):
        if shape.n > 1024:
            raise RuntimeError("the run stops here")
        return [bench.Record(provider, mode, bench.asdict(shape), ms=1.0) for mode in ("fwd", "bwd")]

    monkeypatch.setattr(bench, "time_fwd_bwd", time_fwd_bwd)
    with pytest.raises(RuntimeError, match="stops"):
        bench.main(["--max-n", "2048", "--out", str(out)])
    assert json.loads(out.read_text()) == _PREVIOUS
    partial = tmp_path / "grid.json.partial"
    assert {r["shape"]["n"] for r in json.loads(partial.read_text())["records"]} == {1024}
    bench.main(["--merge", str(partial), "--out", str(out)])
    assert {r["shape"]["n"]: r["ms"] for r in json.loads(out.read_text())["records"]
            if r["shape"]["d"] == 64 and not r["shape"]["causal"] and r["provider"] == "streamkl"
            and r["mode"] == "fwd"}[1024] == 1.0


def test_a_run_stopped_by_a_time_limit_resumes_where_it_stopped(bench, tmp_path, monkeypatch):
    """`--resume` measures only what `<out>.partial` lacks (the full grid outlasts one device call), keeps the first
    part's ceilings, and refuses a progress file of other rows or another card."""
    import torch

    out = tmp_path / "run.json"
    measured_after_resume: list[str] = []
    resumed = False

    def time_fwd_bwd(provider, shape, fn, targets):
        if resumed:
            measured_after_resume.append(shape.n)
        elif shape.n > 2048:
            raise TimeoutError("the call's time is up")
        return [bench.Record(provider, mode, bench.asdict(shape), ms=float(shape.n)) for mode in ("fwd", "bwd")]

    monkeypatch.setattr(bench, "time_fwd_bwd", time_fwd_bwd)
    with pytest.raises(TimeoutError):
        bench.main(["--out", str(out)])
    partial = json.loads((tmp_path / "run.json.partial").read_text())
    first = {json.dumps(r["shape"], sort_keys=True) for r in partial["records"] if r["mode"] != "mem"}
    assert {r["mode"] for r in partial["records"]} >= {"mem", "fwd"} and not out.exists()

    monkeypatch.setattr(bench, "measure_ceilings", lambda: pytest.fail("a resumed run keeps its ceilings"))
    with pytest.raises(SystemExit, match=r"--resume.*rows"):
        bench.main(["--quick", "--out", str(out), "--resume"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "third GPU")
    with pytest.raises(SystemExit, match=r"--resume.*third GPU"):
        bench.main(["--out", str(out), "--resume"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "second GPU")
    resumed = True
    bench.main(["--out", str(out), "--resume"])
    result = json.loads(out.read_text())
    assert result["ceilings"] == partial["ceilings"] and len(result["resumed_on"]) == 1
    timed = [json.dumps(bench.asdict(s), sort_keys=True) for s in bench.time_grid(False)]
    keys = [(json.dumps(r["shape"], sort_keys=True), r["provider"], r["mode"]) for r in result["records"]]
    assert len(keys) == len(set(keys))  # nothing measured twice
    assert {k[0] for k in keys if k[2] != "mem"} == set(timed)  # and nothing missing
    assert len(first) == 2 and not first & set(measured_after_resume)  # the first part is not measured again
    assert not (tmp_path / "run.json.partial").exists()
    with pytest.raises(SystemExit, match="does not exist"):
        bench.main(["--out", str(out), "--resume"])


def test_merging_needs_an_existing_results_file(bench, tmp_path):
    run_ = tmp_path / "run.json"
    run_.write_text(json.dumps(_PREVIOUS))
    with pytest.raises(SystemExit, match="does not exist"):
        bench.main(["--merge", str(run_)])  # the grid of "first GPU" is not there
    with pytest.raises(SystemExit, match="does not exist"):
        bench.main(["--max-n", "1024", "--out", str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--max-n", "1024"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


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


def _assert_perf_notes_blocks(blocks: dict[str, str], command: str) -> None:
    """Each ``<!-- name:start -->`` block of docs/perf-notes.md holds exactly what ``command`` renders."""
    notes = (ROOT / "docs" / "perf-notes.md").read_text()
    for name, body in blocks.items():
        found = re.search(rf"<!-- {name}:start -->\n(.*?)\n<!-- {name}:end -->", notes, re.S)
        assert found, f"docs/perf-notes.md has no {name} block"
        assert found.group(1) == body, f"{name}: run {command}"


def test_perf_notes_v6_tables_are_bench_fused_dq_output():
    """docs/perf-notes.md's v6 blocks are bench_fused_dq.py's rendering of the committed H100 run and tuning run
    (``--render`` writes them), and the committed run is internally consistent: both designs' gradients agree to
    bf16 rounding and every shape has the baselines its ratios divide by."""
    bench = _load(ROOT / "benchmarks" / "bench_fused_dq.py", "bench_fused_dq")
    data = json.loads(Path(bench.H100_RESULT).read_text())
    tuning = json.loads(Path(bench.H100_TUNING).read_text())
    _assert_perf_notes_blocks(bench.blocks(data, tuning), "benchmarks/bench_fused_dq.py --render")
    assert [r["shape"]["name"] for r in data["rows"]] == [s[0] for s in bench.SHAPES]
    for row in data["rows"]:
        assert row["agreement"]["dq rel L2"] < 1e-2 and row["agreement"]["dk rel L2"] < 1e-2, row["shape"]["name"]
        for key in ("op fwd+bwd fused", "op fwd+bwd two-pass", "sdpa-cudnn fwd+bwd", "kernel bwd fused"):
            assert row["ms"][key] > 0, (row["shape"]["name"], key)


def test_perf_notes_v7_tables_are_bench_hopper_output():
    """docs/perf-notes.md's v7 blocks are bench_hopper.py's rendering of the committed H100 run and tuning run
    (``--render`` writes them); in the committed run every correctness check ran the Hopper kernel and was as exact
    as the portable one, and the default selection picked it exactly for the head-dim-128 shapes."""
    bench = _load(ROOT / "benchmarks" / "bench_hopper.py", "bench_hopper")
    data = json.loads(Path(bench.H100_RESULT).read_text())
    tuning = json.loads(Path(bench.H100_TUNING).read_text())
    _assert_perf_notes_blocks(bench.blocks(data, tuning), "benchmarks/bench_hopper.py --render")
    assert all(c["ok"] for c in data["checks"]), [c["case"] for c in data["checks"] if not c["ok"]]
    assert [r["name"] for r in data["shapes"]] == [s[0] for s in bench.SHAPES]
    for row in data["shapes"]:
        assert row["default_picks_hopper"] == (row["d"] == 128), row["name"]
        assert row["rel_hopper_vs_portable"] < 1e-5, row["name"]


def test_perf_notes_v10_tables_are_bench_hopper_key_pass_output():
    """docs/perf-notes.md's v10 blocks are bench_hopper_key_pass.py's rendering of the committed H100 run (``--render``
    writes them; the run was made with ``--tune``, so it holds the tile sweep too); in that run every check ran the
    Hopper key pass, was as exact as the portable pass and left dQ_s bitwise unchanged, the default tile of every
    swept shape is among the candidates it timed (without a mask still the code's; the causal tiles moved in v14, whose
    run checks them), and the default selection took the Hopper pass exactly for the shapes of at least 2^28 score
    elements."""
    bench = _load(ROOT / "benchmarks" / "bench_hopper_key_pass.py", "bench_hopper_key_pass")
    data = json.loads(Path(bench.H100_RESULT).read_text())
    _assert_perf_notes_blocks(bench.blocks(data, data), "benchmarks/bench_hopper_key_pass.py --render")
    assert all(c["ok"] for c in data["checks"]), [c["case"] for c in data["checks"] if not c["ok"]]
    assert [c["case"] for c in data["checks"]] == [list(c) for c in bench.CHECKS]
    assert [r["name"] for r in data["shapes"]] == [s[0] for s in bench.SHAPES]
    from streamkl.dispatch import GLUON_MIN_SCORES, _module

    module = _module("_hopper.backward")  # None without a usable Gluon: the tiles of the code are then not checked
    for row in data["shapes"]:
        assert row["default_picks_hopper"] == (row["b"] * row["h"] * row["n"] ** 2 >= GLUON_MIN_SCORES), row["name"]
        if module is not None and not row["causal"]:  # the run used the tiles the code picks now (causal: v14's)
            tile = module.hopper_key_pass_config(row["d"], row["d"], row["causal"])
            assert row["default_tile"] == list(vars(tile).values()), row["name"]
        if "tiles" in row:
            assert row["default_tile"] in [t["tile"] for t in row["tiles"]], row["name"]
            assert all(t["rel_vs_portable"] < 1e-2 for t in row["tiles"]), row["name"]


def _assert_key_pass_run(script: str) -> dict:
    """A key-pass paired run's perf-notes blocks are ``script``'s rendering of its committed H100 run, whose shapes are
    the script's and whose checks are bench_hopper_key_pass's cases; returns the run."""
    bench = _load(ROOT / "benchmarks" / f"{script}.py", script)
    checks = _load(ROOT / "benchmarks" / "bench_hopper_key_pass.py", "bench_hopper_key_pass").CHECKS
    data = json.loads(Path(bench.H100_RESULT).read_text())
    _assert_perf_notes_blocks(bench.blocks(data, data), f"benchmarks/{script}.py --render")
    assert [r["shape"]["name"] for r in data["rows"]] == [s[0] for s in bench.SHAPES]
    assert {tuple(c["case"][:9]) for c in data["checks"]} <= {tuple(c[:9]) for c in checks}
    return data


def _assert_compiled_cases(name: str) -> None:
    """The offline resource file ``name`` holds every case kernel_resources.py compiles, for this version and the one
    it was compiled against."""
    resources = _load(ROOT / "benchmarks" / "kernel_resources.py", "kernel_resources")
    compiled = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
    for package in ("this", "against"):
        cases = [(r["d"], r["causal"], r["block_m"], r["stages"]) for r in compiled["rows"] if r["package"] == package]
        assert cases == resources.HOPPER_KEY_PASS_CASES, package


def test_perf_notes_v14_tables_are_bench_peeled_key_pass_output():
    """docs/perf-notes.md's v14 blocks are bench_peeled_key_pass.py's rendering of the committed H100 run, whose shapes
    and checks are the scripts'; the one-warpgroup kernel's causal tile at head dim 64 is the code's and was the
    fastest of its sweep; and the offline resource file holds every case kernel_resources.py compiles, for this
    version and v13's."""
    bench = _load(ROOT / "benchmarks" / "bench_peeled_key_pass.py", "bench_peeled_key_pass")
    data = _assert_key_pass_run("bench_peeled_key_pass")
    (d64,) = [r for r in data["rows"] if r["shape"]["name"] == "N8192-D64-causal"]
    assert [t["tile"] for t in d64["tiles"]] == [list(t) for t in bench.CANDIDATES[64]]
    from streamkl.dispatch import _module

    module = _module("_hopper.backward")
    if module is not None:
        best = min(d64["tiles"], key=lambda t: t["ms"])["tile"]
        assert best == list(vars(module.hopper_key_pass_config(64, 64, True)).values())
    _assert_compiled_cases("kernel-resources-hopper-key-pass.json")


def test_perf_notes_v15_tables_are_bench_bf16_dq_output():
    """docs/perf-notes.md's v15 blocks are bench_bf16_dq.py's rendering of the committed H100 run, whose shapes are
    the script's and whose checks cover v11's cases (the bf16 path forced) and every N = 8192 shape (by default)."""
    bench = _load(ROOT / "benchmarks" / "bench_bf16_dq.py", "bench_bf16_dq")
    data = json.loads(Path(bench.H100_RESULT).read_text())
    _assert_perf_notes_blocks(bench.blocks(data, data), "benchmarks/bench_bf16_dq.py --render")
    assert [r["shape"]["name"] for r in data["rows"]] == [s[0] for s in bench.SHAPES]
    forced = [c["case"] for c in data["checks"] if c["narrowing"] == "forced"]
    default = [c["case"][0] for c in data["checks"] if c["narrowing"] == "default"]
    assert forced == [list(c) for c in bench.CHECKS]
    assert default == [s[0] for s in bench.SHAPES if s[0].startswith("N8192")]


def test_the_run_to_run_spread_is_what_the_committed_runs_show(report):
    """docs/benchmarks.md marks ratio targets within RUN_SPREAD of their goal as unsettled: RUN_SPREAD is the largest
    movement of the same code's training-call ratio to cuDNN between two committed paired runs, rounded up to a whole
    percent, not a number picked by hand."""
    largest = max(report.same_code_movements().values())
    assert math.ceil(100 * largest) / 100 == report.RUN_SPREAD
    assert report.target_status(1.15 * (1 + report.RUN_SPREAD / 2), 1.15, False).endswith("run-to-run spread")
    assert report.target_status(1.15 * (1 + 2 * report.RUN_SPREAD), 1.15, False) == "**missed**"


def test_perf_notes_v8_table_is_bench_pairs_output():
    """docs/perf-notes.md's v8 block is bench_pairs.py's rendering of the committed H100 run (``--render`` writes
    it); in that run every setup was measured three times per column and the fused loss agreed with one call per
    pair (values and student gradients)."""
    bench = _load(ROOT / "benchmarks" / "bench_pairs.py", "bench_pairs")
    data = json.loads(Path(bench.H100_RESULT).read_text())
    _assert_perf_notes_blocks(bench.blocks(data), "benchmarks/bench_pairs.py --render")
    assert [r["name"] for r in data["rows"]] == [s[0] for s in bench.SHAPES]
    for row in data["rows"]:
        assert all(len(runs) == 3 and min(runs) > 0 for runs in row["runs_ms"].values()), row["name"]
        assert row["agreement"]["total rel"] < 1e-5, row["name"]
        assert row["agreement"]["grad rel L2 (max over tensors)"] < 1e-2, row["name"]
    assert all(len(runs) == data["step"]["rounds"] and min(runs) > 0 for runs in data["step"]["runs_ms"].values())
    from lightning_streamkl.terms import FUSE_MAX_BYTES

    for name, pairs, b, h, n, d, _ in bench.SHAPES:  # the notes say every setup runs as one call (bf16: 2 bytes)
        assert 4 * pairs * b * h * n * d * 2 <= FUSE_MAX_BYTES, name


def test_perf_notes_v12_tables_are_bench_causal_order_output():
    """docs/perf-notes.md's v12 blocks are bench_causal_order.py's rendering of the committed H100 run, whose checks
    and shapes are the script's."""
    bench = _load(ROOT / "benchmarks" / "bench_causal_order.py", "bench_causal_order")
    data = json.loads(Path(bench.H100_RESULT).read_text())
    _assert_perf_notes_blocks(bench.blocks(data, data), "benchmarks/bench_causal_order.py --render")
    assert [c["case"] for c in data["checks"]] == [list(c) for c in bench.CHECKS]
    assert [r["shape"]["name"] for r in data["rows"]] == [s[0] for s in bench.SHAPES]
    paths = json.loads(Path(bench.H100_PATHS_RESULT).read_text())
    _assert_perf_notes_blocks({"causal-order:paths": bench.paths_table(paths)},
                              "benchmarks/bench_causal_order.py --render")
    assert [r["shape"]["name"] for r in paths["rows"]] == [s[0] for s in bench.PATH_SHAPES]
    assert {k.rsplit(" ", 1)[0] for k in paths["rows"][0]["ms"]} == set(bench.PATHS)


def test_perf_notes_v11_tables_are_bench_lazy_frames_output():
    """docs/perf-notes.md's v11 blocks are bench_lazy_frames.py's rendering of the committed H100 run (made with
    ``--tune``), its checks and shapes are the script's, and the tiles that run tuned and used are the code's
    defaults for the frozen-teacher forward, as v11 says."""
    from dataclasses import asdict

    from streamkl._triton.configs import _fused_forward_config, _width

    bench = _load(ROOT / "benchmarks" / "bench_lazy_frames.py", "bench_lazy_frames")
    data = json.loads(Path(bench.H100_RESULT).read_text())
    _assert_perf_notes_blocks(bench.blocks(data, data), "benchmarks/bench_lazy_frames.py --render")
    assert [c["case"] for c in data["checks"]] == [list(c) for c in bench.CHECKS]
    assert [r["shape"]["name"] for r in data["rows"]] == [s[0] for s in bench.SHAPES]
    assert set(data["tile_used"]) == {"64", "128"}
    for d, tile in data["tile_used"].items():
        assert asdict(_fused_forward_config(_width(int(d), int(d), 2), 2)) == tile, d


def test_perf_notes_v13_tables_are_bench_ws_key_pass_output():
    """docs/perf-notes.md's v13 blocks are bench_ws_key_pass.py's rendering of the committed H100 run, whose shapes
    are the script's, whose checks are the script's cases in the kernels' scope, and whose default tiles are the ones
    the code uses for the warp-specialised key pass."""
    from streamkl._hopper.key_pass_ws import ws_key_pass_config

    bench = _load(ROOT / "benchmarks" / "bench_ws_key_pass.py", "bench_ws_key_pass")
    data = json.loads(Path(bench.H100_RESULT).read_text())
    _assert_perf_notes_blocks(bench.blocks(data, data), "benchmarks/bench_ws_key_pass.py --render")
    assert [r["shape"]["name"] for r in data["rows"]] == [s[0] for s in bench.SHAPES]
    assert {tuple(c["case"][:9]) for c in data["checks"]} <= {tuple(c[:9]) for c in bench.CHECKS}
    for row in data["rows"]:
        if row["shape"]["causal"] and row["shape"]["n"] == 8192:  # the sweep ws_key_pass_config names
            best = min(row["tiles"], key=lambda t: t["ms"])["tile"]
            d = row["shape"]["d"]
            assert best == list(vars(ws_key_pass_config(d, d)).values()), row["shape"]["name"]


def test_perf_notes_profile_table_is_kernel_profile_output():
    """docs/perf-notes.md's hardware-counter table is kernel_profile.py's rendering of the committed H100 run, which
    profiled the script's shapes (and v16's re-measure one of them), each with the training call's two kernels (the fused forward and the key pass) on
    one side of the marker and cuDNN's forward, backward and helper kernels on the other."""
    bench = _load(ROOT / "benchmarks" / "kernel_profile.py", "kernel_profile")
    data = json.loads(Path(bench.H100_RESULT).read_text())
    _assert_perf_notes_blocks(bench.blocks(data), "benchmarks/kernel_profile.py --render")
    assert [s["shape"]["name"] for s in data["shapes"]] == [s[0] for s in bench.SHAPES]
    remeasured = json.loads(Path(bench.H100_RESULT.replace(".json", "-v16.json")).read_text())  # v16's key pass
    assert [s["shape"]["name"] for s in remeasured["shapes"]] == ["N8192-D128"]
    for shape in data["shapes"] + remeasured["shapes"]:
        roles = {call: sorted({bench.role(k["name"]) for k in kernels} - {"other"})
                 for call, kernels in shape["calls"].items()}
        assert roles == {"training call": ["fused forward", "key pass"],
                         "cuDNN fwd+bwd": ["cuDNN backward", "cuDNN forward", "cuDNN other"]}, shape["shape"]["name"]


def test_kernel_profile_reads_ncu_raw_csv_and_splits_the_calls_at_the_marker():
    """The raw page's units row scales durations to nanoseconds (an unknown unit is an error, not a silent scale of
    1), ncu's own messages and metrics outside KEEP are dropped, and the kernels split at the one marker."""
    bench = _load(ROOT / "benchmarks" / "kernel_profile.py", "kernel_profile")
    stall = "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"
    text = "\n".join([
        "==PROF== Connected to process 1",
        f'"ID","Kernel Name","gpu__time_duration.sum","dram__bytes.sum","{stall}"',
        '"","","us","byte",""',
        '"0","_attention_kl_fwd_kernel","1,500.5","10","0.87"',
        '"1","void at::native::(anonymous namespace)::spin_kernel(long)","1","0","0"',
        '"2","cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma","0.25","0","1.5"',
    ])
    kernels = bench.parse_raw_csv(text)
    assert [k["name"][:8] for k in kernels] == ["_attenti", "void at:", "cudnn_ge"]
    assert kernels[0] == {"id": 0, "name": "_attention_kl_fwd_kernel", "gpu__time_duration.sum": 1500500.0,
                          stall: 0.87}
    calls = bench.split_calls(kernels)
    assert [bench.role(k["name"]) for k in calls["training call"]] == ["fused forward"]
    assert [bench.role(k["name"]) for k in calls["cuDNN fwd+bwd"]] == ["cuDNN forward"]
    with pytest.raises(ValueError, match=r"gpu__time_duration\.sum: expected a time unit"):
        bench.parse_raw_csv(text.replace('"us"', '"furlong"'))
    with pytest.raises(ValueError, match="expected one marker kernel"):
        bench.split_calls([k for k in kernels if "spin" not in k["name"]])


def test_perf_notes_v16_tables_are_bench_one_set_key_pass_output():
    """docs/perf-notes.md's v16 blocks are bench_one_set_key_pass.py's rendering of the committed H100 run, whose shapes
    are the script's and whose checks are bench_hopper_key_pass's cases; the offline resource file holds every case
    kernel_resources.py compiles, for this version and v15's, and the selection it compiled is the code's."""
    _assert_key_pass_run("bench_one_set_key_pass")
    _assert_compiled_cases("kernel-resources-hopper-key-pass-v16.json")
    import torch

    from streamkl import dispatch
    from streamkl._problem import KLInputs, KLSpec

    def pipelined(d):  # the one-warpgroup key pass the dispatch table runs at head dim d, with no causal mask
        q = torch.randn(1, 2, 64, d).to(torch.bfloat16)
        problem = dispatch.Problem(KLInputs(q, q, q, q, *[None] * 6), KLSpec(0.1, 0.1), need_b=True)
        return dispatch.in_scope("gluon_key_pass_pipelined", problem)

    assert [pipelined(d) for d in (64, 128)] == [True, False]


def test_perf_notes_v17_tables_are_bench_ws_fused_forward_output():
    """docs/perf-notes.md's v17 blocks are bench_ws_fused_forward.py's rendering of the committed H100 run, whose shapes
    are the script's and whose checks are bench_hopper_key_pass's cases; the code's tile is one of its sweep, and the
    run found the Gluon forward slower than the portable one on one shape only, the causal one at head dim 64 (which
    v18's run then found faster, test_perf_notes_v18_tables_are_bench_gluon_causal_order_output); the offline
    resource file holds every case kernel_resources.py compiles."""
    from streamkl._hopper.fused_forward import fused_forward_config

    bench = _load(ROOT / "benchmarks" / "bench_ws_fused_forward.py", "bench_ws_fused_forward")
    data = _assert_key_pass_run("bench_ws_fused_forward")
    slower = []
    for row in data["rows"]:
        shape = row["shape"]
        assert list(vars(fused_forward_config(shape["d"], shape["d"])).values()) in [t["tile"] for t in row["tiles"]]
        fwd = bench.paired(row, "fused fwd")
        if fwd["ratio"] > 1 and fwd["wins"] == 0:
            slower.append(shape["name"])
    assert slower == ["N8192-D64-causal"]
    resources = _load(ROOT / "benchmarks" / "kernel_resources.py", "kernel_resources")
    compiled = json.loads((ROOT / "benchmarks" / "results" / "kernel-resources-hopper-fused-forward.json").read_text())
    assert [(r["d"], r["causal"], r["block_m"], r["block_n"], r["stages"]) for r in compiled["rows"]] == \
        resources.HOPPER_FUSED_FORWARD_CASES


def test_perf_notes_v18_tables_are_bench_gluon_causal_order_output():
    """docs/perf-notes.md's v18 blocks are bench_gluon_causal_order.py's rendering of the committed H100 run, whose
    shapes are the script's and whose checks are bench_hopper_key_pass's cases, all bitwise; the Gluon training
    forward runs wherever it is in scope because the run found it faster than the portable one on every shape (in
    every round), and the training call faster with it at the one shape v17's selection had left it out of."""
    bench = _load(ROOT / "benchmarks" / "bench_gluon_causal_order.py", "bench_gluon_causal_order")
    data = _assert_key_pass_run("bench_gluon_causal_order")
    assert data["checks"] and all(c["bitwise_equal"] for c in data["checks"])
    for row in data["rows"]:
        gluon = bench.pair(row, "Gluon / portable fused fwd")
        assert gluon["ratio"] < 1 and gluon["wins"] == gluon["rounds"], row["shape"]["name"]
    (d64_causal,) = [r for r in data["rows"] if r["shape"]["name"] == "N8192-D64-causal"]
    forced = bench.pair(d64_causal, "training call, Gluon fwd forced")
    assert forced["ratio"] < 1 and forced["p"] < 0.05
    src = (ROOT / "kernels" / "streamkl" / "_hopper" / "__init__.py").read_text()
    assert "fused_forward_pays" not in src  # no rule left that keeps the Gluon training forward from a shape



def test_perf_notes_v19_tables_are_bench_exponent_difference_output():
    """docs/perf-notes.md's v19 blocks are bench_exponent_difference.py's rendering of the committed H100 run (its
    shapes, bench_hopper_key_pass's cases, all bitwise; the KL checks are bench_lazy_frames'); v19 is not kept because
    the run found the training call unmoved and the portable training forward slower at head dim 128 in every round,
    so the package computes the coupled sum's difference from the scores again."""
    bench = _load(ROOT / "benchmarks" / "bench_exponent_difference.py", "bench_exponent_difference")
    lazy = _load(ROOT / "benchmarks" / "bench_lazy_frames.py", "bench_lazy_frames")
    data = _assert_key_pass_run("bench_exponent_difference")
    assert data["checks"] and all(c["bitwise_equal"] for c in data["checks"])
    assert [tuple(c["case"]) for c in data["kl_checks"]] == [tuple(c) for c in lazy.CHECKS]
    for row in data["rows"]:
        training = bench.pair(row, "training call")
        assert abs(training["ratio"] - 1) <= 0.01, row["shape"]["name"]
        if row["shape"]["d"] == 128:
            portable = bench.pair(row, "portable fused fwd")
            assert portable["ratio"] > 1 and portable["wins"] == 0, row["shape"]["name"]
    for path in ("_triton/forward.py", "_hopper/forward.py", "_hopper/fused_forward.py"):
        src = (ROOT / "kernels" / "streamkl" / path).read_text()
        assert "diff = e_a - e_b" not in src and "* qk_scale_a - y * qk_scale_b" in src, path
