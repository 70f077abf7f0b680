"""The living benchmark scripts run, merge and resume correctly, their shared helpers and the A/B tool work, and the
report regenerates the benchmarks page. Whether the committed docs show what the results say is tests/test_numbers.py's
check; nothing here asserts what a page or a source file contains."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ._helpers import load_script as _load

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def ablation():
    return _load(ROOT / "benchmarks" / "ablation.py", "ablation_run")


def test_every_ablation_variant_is_a_valid_job_command_line(ablation, capsys):
    pytest.importorskip("jsonargparse")
    from lightning_streamkl.jobs.cli import main

    for name, overrides in ablation.VARIANTS.items():
        with pytest.raises(SystemExit) as exit_info:
            main(ablation.COMMON + (overrides or []) + ["--print_config"])
        assert exit_info.value.code in (0, None), name
    printed = capsys.readouterr().out
    assert "direction: reverse" in printed and "temperature: 0.5" in printed


# ------------------------------------------------------------------------------------ the report
@pytest.fixture(scope="module")
def report():
    return _load(ROOT / "benchmarks" / "report.py", "bench_report")


def test_report_reads_only_benchmark_grids(report):
    assert [Path(p).name for p in report.find_results(report.is_grid)] == ["nvidia-h100-80gb-hbm3.json"]
    assert [Path(p).name for p in report.find_results(report.is_tuning)] == ["nvidia-h100-80gb-hbm3-tuning.json"]
    with pytest.raises(ValueError, match="not a benchmark grid"):
        report.load(str(RESULTS / "ablation_cpu.json"))


def test_report_without_arguments_regenerates_the_committed_pages(report, tmp_path, monkeypatch):
    """`python benchmarks/report.py` with no argument (plots included) skips the result files that are not grids and
    writes exactly the committed benchmarks page and the design page's blocks, and every plot it writes is
    committed."""
    pytest.importorskip("matplotlib")
    docs = tmp_path / "docs"
    (docs / "concepts").mkdir(parents=True)
    (docs / "concepts" / "kernels.md").write_text((ROOT / "docs/concepts/kernels.md").read_text())
    monkeypatch.setattr(report, "DOCS", str(docs))
    monkeypatch.setattr(report, "DESIGN_PAGE", str(docs / "concepts" / "kernels.md"))
    monkeypatch.setattr(report, "IMG", str(docs / "img"))
    report.main([])
    for page in ("benchmarks.md", "concepts/kernels.md"):
        assert (docs / page).read_text() == (ROOT / "docs" / page).read_text(), f"docs/{page} is not the report's"
    images = sorted(p.name for p in (docs / "img").iterdir())
    assert images == sorted(Path(p).name for p in report.plot_files("nvidia-h100-80gb-hbm3"))
    assert all((ROOT / "docs" / "img" / image).exists() for image in images)


def test_a_grid_of_another_card_leaves_the_design_page_alone(report, tmp_path, monkeypatch):
    """The design page's tables come from the named H100 runs, not from the last grid passed or found."""
    other = json.loads((RESULTS / "nvidia-h100-80gb-hbm3.json").read_text())
    other["device"] = "Other GPU"
    other["ceilings"] = {k: 2 * v for k, v in other["ceilings"].items()}
    path = tmp_path / "zz-other-gpu.json"
    path.write_text(json.dumps(other))
    page = tmp_path / "kernels.md"
    page.write_text((ROOT / "docs/concepts/kernels.md").read_text())
    monkeypatch.setattr(report, "DOCS", str(tmp_path))
    monkeypatch.setattr(report, "DESIGN_PAGE", str(page))
    report.main(["--no-plots", str(path)])
    assert "## Other GPU" in (tmp_path / "benchmarks.md").read_text()
    assert page.read_text() == (ROOT / "docs/concepts/kernels.md").read_text()


def test_the_bounds_charge_each_pass_its_work(report):
    """The exp bound is exponentials / exp rate, the matmul bound products · 2·D flop / matmul rate, per element."""
    meta = {"device": "a card", "ceilings": {"exp2_per_s": 1e12, "bf16_matmul_flops": 64e12}}
    rows = report.bounds_table(meta, h=1000, n=1000).splitlines()[4:]  # 1e9 elements
    forward = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert forward[2] == "2.00" and forward[3] == "4.00" and forward[5] == "4.00 (matmul)"  # 2 exp2, 2·4·64 flop


# ------------------------------------------------------------------------------------ shared helpers, A/B
@pytest.fixture(scope="module")
def common():
    return _load(ROOT / "benchmarks" / "common.py", "bench_common")


def test_paired_rounds_alternate_the_order(common):
    order = []
    common.paired_rounds({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 3,
                         timer=lambda fn: fn() or 1.0)
    assert order == ["a", "b", "b", "a", "a", "b"]


def test_compare_calls_a_difference_only_below_the_sign_tests_threshold(common):
    assert common.compare([1.0] * 7, [2.0] * 7)["verdict"] == "faster"
    assert common.compare([2.0] * 7, [1.0] * 7)["verdict"] == "slower"
    mixed = common.compare([1, 2, 1, 2, 1, 2, 1], [1.5] * 7)
    assert mixed["faster"] == 4 and mixed["verdict"] == "no difference"
    assert common.compare([1.0] * 5, [2.0] * 5)["verdict"] == "no difference"  # 5 rounds cannot reach p < 0.05


def test_sign_flip_and_t_test(common):
    assert common.sign_flip_p([0.1] * 12) == pytest.approx(2 / 2**12)  # the vectorised path
    assert common.sign_flip_p([1.0, -1.0]) == 1.0
    t, p = common.t_test_p([0.8, 0.6, 0.8])
    assert t > 0 and 0 < p < 0.05


def test_blocks_are_read_and_replaced_between_their_markers(common, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("a\n<!-- x:start -->\nold\n<!-- x:end -->\nb\n")
    common.write_blocks(str(page), {"x": "| new |"})
    assert page.read_text() == "a\n<!-- x:start -->\n| new |\n<!-- x:end -->\nb\n"
    assert common.read_block(page.read_text(), "x") == "| new |" and common.read_block("", "x") is None
    with pytest.raises(ValueError, match="missing"):
        common.replace_block("no markers", "x", "body")


@pytest.mark.parametrize("script", ["common.py", "ab.py", "blocks.py", "report.py", "bench_attention_kl.py", "overhead.py",
                                    "continual/stats.py", "long_context/paired.py", "long_context/tables.py"])
def test_the_examples_in_the_benchmark_helpers_run(script):
    """The suite collects doctests under kernels/ and lightning_streamkl/ only; these are the benchmarks' shared ones."""
    import doctest

    module = _load(ROOT / "benchmarks" / script, "doctest_" + script.replace("/", "_").removesuffix(".py"))
    failed, attempted = doctest.testmod(module)
    assert attempted and not failed


@pytest.fixture(scope="module")
def ab():
    return _load(ROOT / "benchmarks" / "ab.py", "bench_ab")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_ab_tool_runs_a_benchmark_against_another_revision(ab, tmp_path):
    """A throwaway repository holds a copy of kernels/streamkl at one commit; the tool checks it out into a worktree,
    imports it under another name beside this tree's streamkl and times the grid's CPU cases in paired rounds."""
    import streamkl

    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "kernels" / "streamkl", repo / "kernels" / "streamkl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    with ab.revision_tree("HEAD", repo=str(repo)) as tree:
        base = ab.load_revision(tree, "streamkl_ab_test")
        assert base.__name__ == "streamkl_ab_test" and base.attention_kl is not streamkl.attention_kl
        grid = _load(ROOT / "benchmarks" / "bench_attention_kl.py", "bench_grid_ab")
        cases = {k: v for k, v in grid.ab_cases("cpu").items() if k.endswith(" fwd")}
        results = ab.run(cases, streamkl, base, rounds=2, timer=ab.timer_for("cpu"))
    assert not Path(tree).exists()
    assert set(results) == set(cases) and all(r["rounds"] == 2 and r["verdict"] == "no difference"
                                              for r in results.values())
    assert "| case |" in ab.table(results)


# ------------------------------------------------------------------------------------ bench_attention_kl.py's files
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


@pytest.mark.slow
def test_the_sharding_benchmark_runs_on_two_cpu_processes(tmp_path):
    """``bench_sharding.py --smoke``: every layout and the sequence-sharded KL run end to end (2 gloo processes, tiny
    sizes), the layouts agree on the first step's KL and the sharded KL is exact; the JSON lands in the results
    folder."""
    bench = _load(ROOT / "benchmarks" / "bench_sharding.py", "bench_sharding")
    result = bench.main(["--smoke", "--results", str(tmp_path / "results")])
    assert json.loads((tmp_path / "results" / "sharding_cpu-smoke.json").read_text()) == json.loads(json.dumps(result))
    assert set(result["layouts"]) == {"ddp", "fsdp", "ddp+sharded-teacher"}
    for name, layout in result["layouts"].items():
        assert layout["first_step_kl_max_rel_diff_vs_ddp"] < 1e-5, name
        shares = [g["teacher_params_on_this_gpu"] / g["teacher_params"] for g in layout["per_gpu"]]
        assert shares == pytest.approx([1.0, 1.0] if name == "ddp" else [0.5, 0.5], abs=0.05), (name, shares)
    exact = result["context_parallel"]["exactness_vs_one_gpu"]
    assert max(exact.values()) < 1e-5, exact
    for render in bench.DOCS_BLOCKS.values():  # the guide's tables render any run, memory or not (CPU: n/a)
        assert render(result, "sharding_cpu-smoke.json").count("\n| ") >= 3


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


# ------------------------------------------------------------------------------------ the host path by stage
def test_the_host_stages_split_a_training_call_and_leave_the_op_as_it_was():
    """Under the interpreter, on a tiny problem: every stage of a frozen-teacher training call is timed (no Gluon
    kernel here, so no descriptors), the stages add up to the instrumented call, and the wrapped functions are the
    originals again afterwards."""
    import streamkl.api as api
    import streamkl.dispatch as dispatch
    from streamkl._triton_common.launch import KernelLauncher

    overhead = _load(ROOT / "benchmarks" / "overhead.py", "overhead_stages")
    before = (api.attention_kl_per_row, dispatch.forward, dispatch.backward, KernelLauncher.__call__)
    name = overhead.STAGE_ROWS[0]  # the N=5000 row, on its tiny CPU shape
    result = overhead.host_stages("cpu", calls=2, sync=lambda: None, rows={name: overhead.stage_shapes(True)[name]},
                                  rounds=1, warmup=1)
    row = result["rows"][name]
    stages = {name for name, _ in overhead.STAGES} - {"TMA descriptors"}
    assert stages == set(row["stages_us"]) and all(us > 0 for us in row["stages_us"].values())
    assert sum(row["stages_us"].values()) <= row["instrumented_host_us"] * 1.01
    assert (api.attention_kl_per_row, dispatch.forward, dispatch.backward, KernelLauncher.__call__) == before
    fake = {"host_stages": result, "env": {"device": "CPU", "torch": "x", "triton": "y"},
            "breakdown_us": {"noop_function_fwd_bwd": 1.0, "native_two_ops_fwd_bwd": 2.0}}
    assert overhead.stages_markdown(fake).count("\n| ") == len(overhead.STAGES) + 4
