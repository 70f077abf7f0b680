"""The long-context experiment (benchmarks/long_context): the task, the whole GPU script at toy sizes on a CPU (every
phase, the JSON it writes, resuming), the paired statistics and the tables the guide is generated from."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ._helpers import load_script as _load

ROOT = Path(__file__).resolve().parents[1]
LC = ROOT / "benchmarks" / "long_context"


@pytest.fixture(scope="module")
def mqar():
    return _load(LC / "mqar.py", "mqar")


@pytest.fixture(scope="module")
def run():
    return _load(LC / "run.py", "long_context_run")


@pytest.fixture(scope="module")
def report():
    return _load(LC / "tables.py", "long_context_tables")


@pytest.fixture(scope="module")
def smoke(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("long_context")
    assert run.main(["--smoke", "--out", str(out)]) == 0
    return out


def test_mqar_batches_are_well_posed(mqar):
    task = mqar.MQAR(num_keys=16, num_values=16, num_noise=8, num_pairs=4, query_every=4)
    b = task.batch(8, 96, generator=torch.Generator().manual_seed(0))
    x, y, depth = b["input_ids"], b["labels"], b["depth"]
    assert task.queries(96) == (96 - 8) // 4
    for i in range(8):
        kv = dict(zip(x[i, 0:8:2].tolist(), x[i, 1:8:2].tolist()))
        assert len(kv) == 4 and len(set(kv.values())) == 4  # distinct keys, distinct values
        scored = (y[i] != mqar.IGNORE).nonzero().flatten()
        assert len(scored) == task.queries(96) and bool((scored >= 8).all())
        assert sorted(set(x[i, scored].tolist())) == sorted(kv)  # every key asked (Q > D)
        assert all(kv[int(x[i, p])] == int(y[i, p]) for p in scored)
        rest = x[i, 8:][y[i, 8:] == mqar.IGNORE]
        assert bool((rest >= 32).all())  # filler only from the noise tokens: no stray key or value
        assert torch.allclose(depth[i, scored], scored.float() / 96)


def test_nope_attention_sees_no_position(mqar):
    """Without the convolution, a one-layer NoPE model's output at a position is invariant to permuting the tokens
    before it: only the convolution tells positions apart, never their distance."""
    model = mqar.ModelConfig(d_model=16, num_heads=2, conv_kernel=1, num_layers=1).build(20).eval()
    x = torch.randint(0, 20, (1, 12))
    perm = torch.cat([torch.randperm(11), torch.tensor([11])])
    with torch.no_grad():
        assert torch.allclose(model(x)[0, -1], model(x[:, perm])[0, -1], atol=1e-5)


def test_length_scale_is_recorded_with_the_queries(mqar):
    from lightning_streamkl.capture import RecorderCapture

    model = mqar.ModelConfig(d_model=16, num_heads=2, length_scale=True).build(20)
    capture = RecorderCapture(model)
    with capture.recording():
        model(torch.randint(0, 20, (2, 9)))
    q = capture.records["blocks.0.attn"].q
    assert bool((q[:, :, 0] == 0).all())  # log(1) = 0: the first query attends to its only key uniformly


def test_the_smoke_run_writes_every_part(smoke, report):
    results = json.loads((smoke / "results.json").read_text())
    assert results["status"] == "complete" and results["smoke"] is True
    assert (smoke / "teacher.pt").exists() and results["teacher"]["status"] == "done"
    assert set(results["teacher"]["eval"]) == {"32", "64", "128"}
    seeds = results["students"]["seeds"]
    assert sorted(seeds) == ["0", "1", "2"]
    steps = results["students"]["steps"]
    for rec in seeds.values():
        assert rec["kl"]["steps"] == steps and rec["kl_all"]["steps"] == steps
        base = rec["base"]
        assert base["steps"] >= steps and base["time_matched_step"] >= steps  # on to the distilled student's time
        assert base["train_s"] >= rec["kl"]["train_s"] or base["steps"] == steps * 6
        assert set(base["eval_step"]) == set(base["eval_time"]) == set(rec["kl"]["eval"])
        assert set(rec["kl"]["attention_kl"]) == {"all", "queries"}
    comparison = results["comparison"]
    assert comparison == json.loads(json.dumps(report.summarise(results)))  # recomputable from the raw records
    assert comparison["n"] == 3 and set(comparison["step_matched"]) == {"32", "64", "128"}
    cost = results["cost"]["configs"]
    assert set(cost) == {"experiment", "wide"}
    assert set(cost["experiment"]["variants"]) == {"none", "queries", "all", "all-no-early-exit"}
    assert all(v["time_ratio"] > 0 for k, v in cost["experiment"]["variants"].items() if k != "none")


def test_a_second_call_resumes_without_redoing(run, smoke, tmp_path):
    before = json.loads((smoke / "results.json").read_text())
    out = tmp_path / "again"
    assert run.main(["--smoke", "--phase", "students", "--out", str(out), "--resume-from", str(smoke)]) == 0
    after = json.loads((out / "results.json").read_text())
    assert len(after["calls"]) == len(before["calls"]) + 1
    assert after["students"] == before["students"] and after["teacher"] == before["teacher"]


def test_students_need_a_teacher(run, tmp_path):
    assert run.main(["--smoke", "--phase", "students", "--out", str(tmp_path)]) == 2


def test_partial_results_render(run, smoke, report):
    results = json.loads((smoke / "results.json").read_text())
    del results["students"]["seeds"]["2"]
    results["status"] = "partial"
    text = report.findings(results)
    assert "2 of 3 seeds" in text and "partial" in text
    assert "| 64 |" in report.students_table(results)


def test_paired_statistics():
    stats = _load(LC / "paired.py", "long_context_paired")
    c = stats.paired([0.9, 0.8, 0.95], [0.1, 0.2, 0.15])
    assert c["wins"] == 3 and c["p_sign_flip"] == 0.25  # three seeds: never below 0.25
    t, p = stats.t_test_p([0.8, 0.6, 0.8])
    assert p == pytest.approx(1 - abs(t) / math.sqrt(t * t + 2))  # Student t, 2 degrees of freedom
    assert stats.paired([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])["significant"] is False


def test_the_cpu_checks_use_the_gpu_task(run):
    cpu = _load(LC / "cpu_check.py", "long_context_cpu_check")
    assert run.GPU["task"] == cpu.TASK
    assert cpu.STUDENT["num_heads"] == run.GPU["student"]["num_heads"]


def test_the_guide_and_readme_blocks_follow_the_results(smoke, report):
    """The README sentence and the setup table come from a results file's own config and seeds."""
    results = json.loads((smoke / "results.json").read_text())
    assert "with attention KL" in report.readme(results)
    setup = report.setup_table(results)
    assert f"{results['config']['student_train']['steps']} steps of 2 × 64" in setup


def test_the_cpu_checks_render_from_one_file(tmp_path):
    cpu = _load(LC / "cpu_check.py", "long_context_cpu_check_render")
    checks = json.loads((ROOT / "benchmarks" / "results" / "long_context_cpu.json").read_text())
    assert set(checks) <= set(cpu.CHECKS)
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"length_rope": checks["length_rope"]}))
    assert cpu.markdown(str(path)).count("\n| RoPE |") == 1
