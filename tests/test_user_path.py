"""The user-path benchmark (``benchmarks/user_path.py``): the docs show exactly what its committed run says, it covers
the matrix it promises, and its logic runs end to end (a Lightning fit with and without the callback, the teacher's
pass and the op's calls timed alone) on tiny models on the CPU."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from ._helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def user_path():
    return load_script(ROOT / "benchmarks" / "user_path.py", "user_path")


def _block(text: str, name: str) -> str:
    match = re.search(rf"<!-- {re.escape(name)}:start -->\n(.*?)\n<!-- {re.escape(name)}:end -->", text, re.S)
    assert match, f"the markers of {name} are missing"
    return match.group(1)


def test_the_docs_show_the_committed_run(user_path):
    for doc, named in user_path.committed_blocks().items():
        text = Path(doc).read_text()
        for name, body in named.items():
            assert _block(text, name) == body, f"{name} in {Path(doc).relative_to(ROOT)} is not a fresh render"


def test_the_parts_cover_the_matrix(user_path):
    """The full matrix at N = 16384 (every precision, sdpa and flex, with and without compile, plain, four pairs and
    uniform_pairs); bf16-mixed and bf16-true with sdpa and four pairs at N = 4096 and 32768; the KD without the op."""
    full = {(c.precision, c.attention, c.compiled, c.pairs) for part in ("n16384", "n16384-compile")
            for c in user_path.part_cells(part) if c.n == 16384}
    assert full == {(p, a, c, pairs) for p in user_path.PRECISIONS for a in ("sdpa", "flex_attention")
                    for c in (False, True) for pairs in ("plain", "four", "uniform")}
    ends = {(c.n, c.precision, c.pairs) for c in user_path.part_cells("ends")}
    assert ends == {(n, p, pairs) for n in (4096, 32768) for p in ("bf16-mixed", "bf16-true")
                    for pairs in ("plain", "four")}
    assert {c.pairs for c in user_path.part_cells("naive")} == {"plain", "naive"}
    offload = {(c.n, c.precision, c.attention, c.compiled, c.pairs, c.teacher_device)
               for c in user_path.part_cells("offload")}
    assert offload == {(n, "bf16-mixed", "sdpa", False, pairs, device) for n in (16384, 32768)
                       for pairs, device in (("plain", "student"), ("four", "student"), ("four", "offload"))} | {
        (16384, "bf16-mixed", "sdpa", False, "uniform", device) for device in ("student", "offload")}
    compiled_teacher = {(c.n, c.precision, c.attention, c.compiled, c.pairs, c.teacher_compiled)
                        for c in user_path.part_cells("compiled-teacher")}
    assert compiled_teacher == {(4096, "bf16-mixed", "sdpa", student, pairs, teacher) for student in (False, True)
                                for pairs, teacher in (("plain", False), ("four", False), ("four", True))}
    windowed = {(c.n, c.precision, c.attention, c.compiled, c.pairs, c.window) for c in user_path.part_cells("windowed")}
    assert windowed == {(8192, "bf16-mixed", "sdpa", False, pairs, window) for pairs in ("plain", "four")
                        for window in (0, user_path.WINDOW)}
    padded = {(c.n, c.precision, c.attention, c.compiled, c.pairs, c.batch, c.padded)
              for c in user_path.part_cells("padded")}
    assert padded == {(4096, "bf16-mixed", "sdpa", False, pairs, 4, p) for pairs in ("plain", "four")
                      for p in (False, True)}
    packed = {(c.n, c.precision, c.attention, c.compiled, c.pairs, c.batch, c.documents)
              for c in user_path.part_cells("packed")}
    assert packed == {(16384, "bf16-mixed", "sdpa", False, pairs, 1, d) for pairs in ("plain", "four")
                      for d in (1, user_path.PACKED_DOCUMENTS)}
    fp16 = {(c.n, c.precision, c.attention, c.compiled, c.pairs, c.teacher_device) for c in user_path.part_cells("fp16")}
    assert fp16 == {(16384, "16-mixed", "sdpa", False, pairs, device) for pairs, device in (
        ("plain", "student"), ("four", "student"), ("uniform", "student"), ("uniform", "offload"))}


def test_a_cell_key_names_the_teacher_only_when_it_is_not_resident(user_path):
    """The keys of the runs before ``teacher_device`` and ``teacher_compiled`` are unchanged; an offloaded or a
    compiled teacher's cell has a key of its own, read back by ``--peak``."""
    resident = user_path.Cell(16384, "bf16-mixed", "sdpa", False, "four")
    offloaded = user_path.Cell(16384, "bf16-mixed", "sdpa", False, "four", "offload")
    compiled = user_path.Cell(16384, "bf16-mixed", "sdpa", False, "four", teacher_compiled=True)
    assert resident.key == "N16384/bf16-mixed/sdpa/eager/four"
    assert offloaded.key == "N16384/bf16-mixed/sdpa/eager/four/teacher-offload"
    assert compiled.key == "N16384/bf16-mixed/sdpa/eager/four/teacher-compiled"
    assert offloaded.baseline == resident.baseline == compiled.baseline == user_path.Cell(16384, "bf16-mixed", "sdpa",
                                                                                         False, "plain")
    windowed = user_path.Cell(8192, "bf16-mixed", "sdpa", False, "four", window=2048)
    assert windowed.key == "N8192/bf16-mixed/sdpa/eager/four/window-2048"
    assert windowed.baseline == user_path.Cell(8192, "bf16-mixed", "sdpa", False, "plain", window=2048)
    padded = user_path.Cell(4096, "bf16-mixed", "sdpa", False, "four", batch=4, padded=True)
    assert padded.key == "N4096/bf16-mixed/sdpa/eager/four/batch-4/padded"
    assert padded.baseline == user_path.Cell(4096, "bf16-mixed", "sdpa", False, "plain", batch=4, padded=True)
    packed = user_path.Cell(16384, "bf16-mixed", "sdpa", False, "four", documents=8)
    assert packed.key == "N16384/bf16-mixed/sdpa/eager/four/packed-8" and packed.baseline.documents == 8
    for cell in (resident, offloaded, compiled, windowed, padded, packed, user_path.Cell(64, "32-true", "sdpa", False, "four", batch=2),
                 user_path.Cell(16384, "bf16-mixed", "sdpa", True, "four", "offload", teacher_compiled=True),
                 user_path.Cell(512, "bf16-mixed", "sdpa", True, "four", "offload", True, 128)):
        assert user_path.Cell.from_key(cell.key) == cell


@pytest.mark.slow
def test_a_run_on_tiny_models_times_the_step_and_its_parts(user_path, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(user_path, "DEVICE", "cpu")
    out = tmp_path / "run.json"
    data = user_path.run_part("cpu-smoke", str(out), steps=1, warmup=1)
    assert json.loads(out.read_text())["cells"].keys() == data["cells"].keys()
    cells = data["cells"]
    assert not [r["key"] for r in cells.values() if "error" in r or "breakdown_error" in r]
    four = cells["N64/bf16-mixed/sdpa/eager/four"]
    # tiny layers: the four terms run as one call on their heads concatenated (the teacher's 8 heads each)
    assert four["step_s"] > 0 and four["teacher_s"] > 0 and len(four["kl_s"]) == len(four["kl_calls"]) >= 1
    assert sum(call["shapes"][0][1] for call in four["kl_calls"]) == 4 * 8
    assert all(call["dtypes"] == ["torch.bfloat16"] * 4 for call in four["kl_calls"])  # autocast reaches the op
    mixed = cells["N64/32-true/sdpa/eager/four"]["kl_calls"][0]["dtypes"]
    assert mixed == ["torch.bfloat16"] * 2 + ["torch.float32"] * 2  # the bf16 teacher beside the fp32 student
    assert sum(call["shapes"][0][1] for call in cells["N64/bf16-true/sdpa/eager/uniform"]["kl_calls"]) == 16 * 8
    offloaded = cells["N64/bf16-mixed/sdpa/eager/four/teacher-offload"]  # the option reached the callback's engine
    assert offloaded["teacher_device"] == "offload" and offloaded["teacher_s"] > 0
    assert "the teacher is streamed from host memory one block at a time" in offloaded["pairing"]
    assert "streamed" not in four["pairing"]
    assert all(call["window"] is None and not call["general_mask"] for call in four["kl_calls"])
    # Mistral models with a sliding window: the capture reads each layer's 4-D mask as the window, which the op takes
    windowed = cells["N64/bf16-mixed/sdpa/eager/four/window-16"]
    assert [call["window"] for call in windowed["kl_calls"]] == [[15, 0]] * len(windowed["kl_calls"])
    assert not any(call["general_mask"] for call in windowed["kl_calls"])
    assert user_path.derived(windowed, cells)["ratio"] > 0  # against the windowed plain cell
    # a right-padded batch: the capture reads each model's 4-D mask as key padding (and query masks), not a general mask
    padded = cells["N64/bf16-mixed/sdpa/eager/four/batch-4/padded"]
    assert all(call["key_padding"] and not call["general_mask"] and call["shapes"][0][0] == 4
               for call in padded["kl_calls"])
    assert not any(call["key_padding"] for call in four["kl_calls"])
    assert user_path.derived(padded, cells)["ratio"] > 0
    # packed documents: the capture reads the block-diagonal 4-D mask as the op's packed layout
    packed = cells["N64/bf16-mixed/sdpa/eager/four/packed-3"]
    assert all(call["packed"] and not call["key_padding"] and not call["general_mask"] for call in packed["kl_calls"])
    assert not any(call["packed"] for call in four["kl_calls"]) and user_path.derived(packed, cells)["ratio"] > 0
    derived = user_path.derived(four, cells)  # (on tiny models a distilled step may time below the plain one)
    assert derived["ratio"] > 0 and math.isfinite(derived["pipeline"]) and derived["irreducible_s"] > 0
    # a second run of the same part finds every cell done and runs none
    before = {k: r["wall_s"] for k, r in cells.items()}
    again = user_path.run_part("cpu-smoke", str(out), steps=1, warmup=1)
    assert {k: r["wall_s"] for k, r in again["cells"].items()} == before


def test_the_peak_table_sums_what_is_live_at_the_peak(user_path):
    """``--peak``: the allocations live at the traced peak (not at the end), summed by the frames that made them."""
    def alloc(addr, mib, where):
        return {"action": "alloc", "addr": addr, "size": mib << 20,
                "frames": [{"filename": f"/x/{where}.py", "line": 1, "name": "f"}]}

    def free(addr):
        return {"action": "free_completed", "addr": addr, "size": 0, "frames": []}

    events = [alloc(1, 4, "modeling_llama"), alloc(2, 2, "modeling_llama"), alloc(3, 8, "streamkl/api"), free(3),
              free(1), alloc(4, 1, "elsewhere")]
    gib, top = user_path.peak_allocations({"device_traces": [events]})
    assert gib == 14 / 1024
    assert top == [(8.0, "api.py:1 f"), (6.0, "modeling_llama.py:1 f")]
