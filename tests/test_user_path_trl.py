"""The TRL user-path benchmark (``benchmarks/user_path_trl.py``) runs end to end on tiny models on the CPU: an
``SFTTrainer`` with padding-free packing and a plain PyTorch loop, each with and without attention KL, the distilled
cells' teacher pass and KL calls timed alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_cpu_smoke_run_times_every_cell(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("trl")
    bench = load_script(ROOT / "benchmarks" / "user_path_trl.py", "user_path_trl")
    monkeypatch.setattr(bench.up, "DEVICE", bench.up.DEVICE)  # (--cpu-smoke sets it: put it back afterwards)
    out = tmp_path / "run.json"
    data = bench.main(["--cpu-smoke", "--out", str(out)])
    assert json.loads(out.read_text())["cells"].keys() == data["cells"].keys() == set(bench.CELLS)
    cells = data["cells"]
    assert not [k for k, r in cells.items() if "error" in r or "breakdown_error" in r]
    assert all(r["step_s"] > 0 for r in cells.values())
    assert data["trl"] and {"attn_kl/t21_s15", "attn_kl/total", "loss"} <= cells["trl/four"]["log"].keys()
    assert "attn_kl/total" not in cells["trl/plain"]["log"]
    for four in (cells["trl/four"], cells["loop/four"]):
        assert four["teacher_s"] > 0 and len(four["kl_s"]) >= 1
    assert bench.table(data).count("\n| ") == 2  # one row per loop
