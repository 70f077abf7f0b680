"""The real-batches benchmark (``benchmarks/real_batches.py``): its rows are the issue's, its logic runs end to end on
tiny shapes on the CPU (the op through the interpreter, SDPA's math backend), every ratio and ``met`` follow from the
times it records, and its docs block renders from a result or says that none exists. No time or ratio is held to a
threshold here."""

from __future__ import annotations

import doctest
import json
import math
from pathlib import Path

import pytest

from ._helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rb():
    return load_script(ROOT / "benchmarks" / "real_batches.py", "real_batches")


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_the_examples_run(rb):
    failed, attempted = doctest.testmod(rb)
    assert attempted and not failed


def test_the_rows_are_the_issues(rb):
    rows = {r.name: r for r in rb.rows()}
    lengths = {(r.shape.n, r.shape.causal) for r in rows.values() if r.shape.h == 16 and r.shape.d == 64
               and r.shape.b == 1 and not (r.docs or r.window)}
    assert {(n, c) for n in (5000, 8191, 12345) for c in (True, False)} <= lengths
    assert sum(r.group == "headline" for r in rows.values()) == 4
    packed = [r for r in rows.values() if r.docs]
    assert [r.on_cpu for r in packed] == [False, True]  # the offsets on the GPU, and on the CPU
    for r in packed:
        assert (r.docs, r.shape.n, sum(rb.doc_lengths(r.shape.n, r.docs))) == (8, 32768, 32768)
    (window,) = [r for r in rows.values() if r.window]
    assert (window.window, window.shape.n) == (4096, 32768)
    padded = [r for r in rows.values() if r.lengths]
    assert [(r.masks, r.on_cpu) for r in padded] == [(("key", "query"), False), (("key",), False),
                                                     (("key", "query"), True), (("key",), True)]
    assert all(r.dense_row in rows and r.shape == rows[r.dense_row].shape for r in padded)
    assert [r.shape.dtype for r in rows.values()].count("float16") == 1
    assert {(r.shape.n, r.shape.h_kt) for r in rows.values() if r.shape.h_kt} >= {(8191, 8), (12345, 8)}
    assert [(r.shape.d, r.shape.d_s) for r in rows.values() if r.shape.d_s] == [(128, 64)]
    assert sorted((r.pairs, r.fused) for r in rows.values() if r.against_sdpa_back_to_back) == [
        (1, False), (12, False), (12, True)]
    assert [r.name for r in rb.rows(smoke=True)] == list(rows)  # the smoke runs the same rows


def _result(rb) -> dict:
    """A result as a GPU run writes it, with made-up times (ours 2.5 ms, cuDNN 2.0 ms) and one row out of memory."""
    records = []
    for row in rb.rows():
        rec = {"name": row.name, "group": row.group, "targets": dict(row.targets), "dense_row": row.dense_row,
               "docs": row.docs, "allowed_elements": rb.allowed_elements(row), "ms": 2.5, "cudnn_ms": 2.0,
               "cudnn_backend": "cudnn", "kernels": {"training forward": "gluon_training_forward",
                                                     "key pass": "gluon_key_pass_warp_specialised"}}
        if row.docs or row.window:
            rec.update(separate_ms=1.8, separate_elements=rec["allowed_elements"])
        rec.update(host_ms=0.5, back_to_back_ms=2.4 * row.pairs, kernels_ms=2.3)
        if row.against_sdpa_back_to_back:
            rec.update(sdpa_back_to_back_ms=0.3 * row.pairs)
        records.append(rec)
    records[4]["ms"] = "OOM"
    return {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6", "complete": True,
            "rows": rb.derive(records)}


def test_a_result_renders_into_the_kernels_page(rb, tmp_path, monkeypatch):
    data = _result(rb)
    page = tmp_path / "kernels.md"
    page.write_text((ROOT / "docs" / "concepts" / "kernels.md").read_text())
    path = tmp_path / "result.json"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(rb, "DOC", str(page))
    rb.main(["--render", str(path)])
    block = rb.common.read_block(page.read_text(), rb.BLOCK)
    assert block == rb.table(data)
    lines = [line for line in block.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + len(rb.rows())
    by_name = {line.split(" | ")[0][2:]: line for line in lines[1:]}
    assert "| OOM |" in by_name[data["rows"][4]["name"]] and "| – |" in by_name[data["rows"][4]["name"]]
    assert "| 1.25× |" in by_name[data["rows"][5]["name"]] and "| met |" in by_name[data["rows"][5]["name"]]
    padded = next(r for r in data["rows"] if r["targets"].get("ratio_same_work") == rb.SAME_WORK_TARGET)
    assert padded["met"] is False and "**missed**" in by_name[padded["name"]]
    assert "back to back 2400 µs per pair, SDPA 300" in block and "`gluon_training_forward`" in block
    assert all("| 0.50 · 2.30 |" in line for line in lines[1:])
    data["after_profiler"] = {"row": rb.PROFILER_PROBE_ROW, "host_ms_before": 0.6, "host_ms_after": 0.9}
    assert f"the {rb.PROFILER_PROBE_ROW} row's host time per call was 0.60 ms before" in rb.table(data)
    assert "and 0.90 ms after" in rb.table(data)
    narrower = {"shape": {"d": 128, "d_s": 64}, "ratio_cudnn": 1.45}  # a student of half the teacher's head dim
    assert rb._other(narrower) == "products ÷ cuDNN's 1.29×; ÷ cuDNN × that: 1.13×"


def test_every_row_is_timed_before_the_profiler_takes_any_kernel_time(rb, tmp_path, monkeypatch):
    """No timing follows a use of torch's profiler: a run times every row (``measure``) before it takes the first
    kernel time (``add_kernel_time``), and every row gets one."""
    order = []
    made_up = {r["name"]: r for r in _result(rb)["rows"]}

    def measure(row, device):
        order.append("time")
        return {k: v for k, v in made_up[row.name].items() if k != "kernels_ms"}

    def add_kernel_time(rec, row, device):
        order.append("kernels")
        return {**rec, "kernels_ms": 1.0}

    monkeypatch.setattr(rb, "measure", measure)
    monkeypatch.setattr(rb, "add_kernel_time", add_kernel_time)
    data = rb.run(smoke=True, out=str(tmp_path / "rb.json"))
    n = len(rb.rows(smoke=True))
    assert order == ["time"] * n + ["kernels"] * n
    assert data["complete"] and all(r["kernels_ms"] == 1.0 for r in data["rows"])
    assert rb.PROFILER_PROBE_ROW in [r.name for r in rb.rows()]


def test_without_a_result_the_block_says_what_to_run(rb, tmp_path, monkeypatch):
    monkeypatch.setattr(rb, "RESULT", str(tmp_path / "missing.json"))
    assert rb.load() is None
    block = rb.blocks(None)[rb.BLOCK]
    assert "not been run on a GPU" in block and rb.COMMAND in block
    assert all(f"| {r.name} |" in block for r in rb.rows())
    assert " ms" not in block and "×" not in block  # no measurement is made up


@pytest.mark.slow
def test_the_smoke_run_measures_every_row(rb, tmp_path):
    out = tmp_path / "rb.json"
    rb.main(["--cpu-smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["complete"] and data["smoke"]
    assert [r["name"] for r in data["rows"]] == [r.name for r in rb.rows()]
    for r in data["rows"]:
        name = r["name"]
        assert _positive(r["ms"]) and _positive(r["cudnn_ms"]), (name, r["ms"], r["cudnn_ms"], r["cudnn_note"])
        assert r["ratio_cudnn"] == pytest.approx(r["ms"] / r["cudnn_ms"]) and r["cudnn_backend"] == "math"
        assert r["kernels"]["backend"] == "triton" and "key pass" in r["kernels"], name
        for key in ("ratio_separate", "ratio_same_work", "ratio_cudnn_same_work", "ratio_back_to_back",
                    "back_to_back_ms", "sdpa_back_to_back_ms"):
            assert key not in r or _positive(r[key]), (name, key, r.get(key))
        assert _positive(r["back_to_back_ms"]) and r["host_ms"] is None and r["kernels_ms"] is None, name
        if r["targets"]:
            assert r["met"] == all(r[k] <= goal for k, goal in r["targets"].items()), name
        else:
            assert r["met"] is None, name
    rows = {r["name"]: r for r in data["rows"]}
    packed = [r for r in rows.values() if r["docs"]]
    assert len(packed) == 2
    for r in packed:
        assert sum(r["doc_lengths"]) == r["shape"]["n"] and _positive(r["ratio_separate"])
    (window,) = [r for r in rows.values() if r["window"]]
    assert _positive(window["ratio_separate"]) and _positive(window["ratio_cudnn_same_work"])
    padded = [r for r in rows.values() if r["dense_row"]]
    assert sorted(round(r["allowed_fraction"], 2) for r in padded)[-1] == 1.0  # the all-True mask
    assert all(0 < r["allowed_fraction"] <= 1 and _positive(r["ratio_same_work"]) for r in padded)
    assert all(_positive(r["sdpa_back_to_back_ms"]) for r in rows.values() if "BERT" in r["name"])
    assert rb.table(data).count("\n| ") == len(rows) + 1
