"""On one (or two) GPUs: a teacher that lives on another device than the student (its captured queries and keys
travel, not the model), and the continual regulariser's host-memory snapshots. Skipped without CUDA::

    python -m pytest -m gpu tests/lightning_streamkl/test_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lightning_streamkl import ContinualAttentionRegularizer, StreamKLDistillation

from ._models import loader
from .test_callback import LAST, Recorder, make_student, make_teacher
from .test_continual import fit
from .test_continual import make_student as continual_student
from .test_ddp_gpu import gpu_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _kl(teacher_device: str, teacher: torch.nn.Module) -> list[float]:
    rec = Recorder("train/attn_kl/last_step")
    cb = StreamKLDistillation(teacher, pairs=[LAST], teacher_device=teacher_device)
    gpu_trainer(max_steps=2, callbacks=[cb, rec], log_every_n_steps=1).fit(make_student(), loader(8, 4))
    return rec.values["train/attn_kl/last_step"]


@pytest.mark.timeout(300)
def test_a_teacher_on_the_host_sends_its_queries_and_keys_to_the_student():
    teacher = make_teacher()
    on_host = _kl("cpu", teacher)
    assert {p.device.type for p in teacher.parameters()} == {"cpu"}  # the model stayed where it was asked to run
    kept = _kl("keep", teacher)
    assert {p.device.type for p in teacher.parameters()} == {"cpu"}
    moved = _kl("student", teacher)
    assert {str(p.device) for p in teacher.parameters()} == {"cuda:0"}
    assert on_host == pytest.approx(moved, rel=1e-3) and kept == pytest.approx(moved, rel=1e-3)


@pytest.mark.timeout(300)
@pytest.mark.multi_gpu
def test_a_teacher_on_the_second_gpu():
    teacher = make_teacher()
    other = _kl("cuda:1", teacher)
    assert {str(p.device) for p in teacher.parameters()} == {"cuda:1"}
    assert other == pytest.approx(_kl("student", teacher), rel=1e-3)


@pytest.mark.timeout(300)
def test_cpu_offload_keeps_the_snapshot_on_the_host_with_the_same_losses():
    """``snapshot_device="cpu"``: the snapshot stays in (pinned) host memory and its weights are borrowed onto the
    GPU for each forward pass; the losses equal those of a snapshot kept on the GPU. Where the snapshot lives is
    read while the second task trains (after ``fit`` Lightning moves the model, and with it a new snapshot, to the
    host)."""
    from lightning.pytorch import Callback

    class Where(Callback):
        def __init__(self, reg):
            self.reg, self.seen = reg, []

        def on_train_batch_end(self, *args):
            snap = self.reg.snapshots[0]
            self.seen.append([(t.device.type, t.is_pinned()) for t in snap.state_dict().values() if t.numel()])

    losses = {}
    for device in ("same", "cpu"):
        student = continual_student()
        reg = ContinualAttentionRegularizer(snapshot_device=device, weight=2.0)
        fit(student, reg, loader(8, 4, seed=0), max_steps=2, accelerator="gpu")
        where = Where(reg)
        fit(student, reg, loader(8, 4, seed=1), where, max_steps=3, accelerator="gpu")
        losses[device] = student.step_losses
        assert len(where.seen) == 3 and all(where.seen)
        expected = ("cpu", True) if device == "cpu" else ("cuda", False)
        assert all(place == expected for step in where.seen for place in step), (device, where.seen[0][:3])
    assert losses["cpu"] == pytest.approx(losses["same"], rel=1e-5)
