"""benchmarks/bench_indexer.py cannot rot: its CPU smoke run works end to end, the fused and the materialised losses
it times agree, and the element and FLOP counts behind its floor fractions match what the kernels process."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_indexer", ROOT / "benchmarks" / "bench_indexer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_indexer"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["bench_indexer"]


def test_smoke_run_writes_results_and_table(bench, tmp_path, capsys):
    result = bench.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "indexer_smoke_cpu.json").read_text())
    assert saved["records"] == json.loads(json.dumps(result["records"]))
    shapes = {json.dumps(r["shape"], sort_keys=True) for r in saved["records"]}
    assert len(shapes) == len(bench.grid(smoke=True))
    for key in shapes:
        recs = {f"{r['provider']}/{r['mode']}": r for r in saved["records"] if json.dumps(r["shape"], sort_keys=True) == key}
        for name in ("fused/fwd", "fused/fwd-lse", "fused/bwd", "fused/fwd+bwd", "naive/fwd", "naive/fwd+bwd"):
            assert recs[name]["status"] == "ok" and recs[name]["ms"] > 0, name
        assert recs["fused/fwd"]["extra"]["loss_rel_diff_vs_naive"] < 1e-5
        assert recs["fused/fwd"]["extra"]["floor_fraction"] > 0
    printed = capsys.readouterr().out
    assert printed.count("| dense |") == 1 and printed.count("| sparse K=8 |") == 1


@pytest.mark.parametrize("topk", [None, 8, 64])
def test_element_count_is_what_the_selection_holds(bench, topk):
    shape = bench.Shape(n=40, h=2, topk=topk, d=16, h_i=2, d_i=16, dtype="float32")
    if topk is None:
        assert shape.elements() == 40 * 41 / 2
    else:
        selection = bench.make_topk(shape, "cpu", rows_per_chunk=16)
        assert int((selection >= 0).sum()) == shape.elements()
        rows = torch.arange(40)[:, None]
        assert bool(((selection <= rows) | (selection == -1)).all())  # only allowed keys
        ordered = selection.sort(-1).values
        assert not bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any())


def test_flop_counts(bench):
    shape = bench.Shape(n=8192, h=16)
    e = 8192 * 8193 / 2
    assert shape.flops("fwd") == pytest.approx(e * (2 * 2 * 16 * 128 + 2 * 64 * 128))
    assert shape.flops("fwd-lse") == pytest.approx(e * (2 * 16 * 128 + 2 * 64 * 128))
    assert shape.flops("bwd") == pytest.approx(e * (2 * 16 * 128 + 5 * 2 * 64 * 128))
    sparse = bench.Shape(n=8192, h=16, topk=2048)
    assert sparse.flops("bwd") == pytest.approx(sparse.elements() * (2 * 16 * 128 + 3 * 2 * 64 * 128))
