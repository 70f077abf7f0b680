"""Long runs: the captured queries and keys are released every step, and nothing the callback holds grows.

A probe callback checks after every training step that both captures are empty and no recording is open, keeps
weak references to every tensor handed to the captures and checks they are gone one step later, and counts the
live tensors (objects and bytes) at a few points of a 1,000-step run: after warm-up the count is flat.
"""

from __future__ import annotations

import gc
import weakref

import lightning as L
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("transformers")

from lightning_streamkl import StreamKLDistillation, record
from lightning_streamkl.capture.base import _RECORDING

from ._models import loader, trainer
from .test_callback import LAST, make_student, make_teacher


class TinyAttention(nn.Module):
    """One bidirectional attention layer that hands its (q, k) to record()."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, 1)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        record(self, q, k, causal=False)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, n, d)).squeeze(-1)


class TinyRegressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.attn = TinyAttention()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.attn(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def live_tensors() -> tuple[int, int]:
    """(number of live tensor objects, bytes of their distinct storages). Tensors without data (the fake tensors
    that an earlier test's ``torch.compile`` or flex-attention mask may leave in torch's caches) are not counted."""
    gc.collect()
    count, storages = 0, {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not is_fake(obj):
            count += 1
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return count, sum(storages.values())


class ReleaseProbe(L.Callback):
    def __init__(self, distill: StreamKLDistillation, count_at: tuple[int, ...]) -> None:
        self.distill, self.count_at = distill, count_at
        self.alive: list[weakref.ref] = []
        self.counts: dict[int, tuple[int, int]] = {}
        self.checked_steps = 0

    def on_train_start(self, trainer, pl_module):
        for capture in (self.distill._distiller.teacher_capture, self.distill._distiller.student_capture):
            original = capture.record

            def spy(name, q, k, *args, _original=original, **kwargs):
                self.alive += [weakref.ref(q), weakref.ref(k)]
                return _original(name, q, k, *args, **kwargs)

            capture.record = spy

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # everything captured during the previous step is gone (not held by the callback, the loss or the graph)
        assert all(ref() is None for ref in self.alive), f"step {trainer.global_step}: captured tensors still alive"
        self.alive = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        d = self.distill._distiller
        assert d.teacher_capture.records == {} and d.student_capture.records == {}
        assert not d.teacher_capture.is_recording and not d.student_capture.is_recording and _RECORDING == []
        assert len(self.alive) == 4 * len(self.distill.config.pairs)  # q and k of each side, once per step
        self.checked_steps += 1
        if trainer.global_step in self.count_at:
            self.counts[trainer.global_step] = live_tensors()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_memory_is_flat_over_1000_steps():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    try:
        teacher = nn.Sequential(TinyAttention())
        distill = StreamKLDistillation(teacher, pairs=[{"teacher": "0", "student": "attn", "name": "attn"}])
        probe = ReleaseProbe(distill, count_at=(100, 500, 1000))
        data = DataLoader(TensorDataset(torch.randn(32, 6, 8), torch.randn(32, 6)), batch_size=4)
        trainer(max_steps=1000, callbacks=[distill, probe], log_every_n_steps=50).fit(TinyRegressor(), data)
    finally:
        torch.set_num_threads(threads)
    assert probe.checked_steps == 1000
    assert probe.counts[500] == probe.counts[100] and probe.counts[1000] == probe.counts[100], probe.counts


def test_hugging_face_capture_releases_every_step():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    student, teacher = make_student(), make_teacher()
    distill = StreamKLDistillation(teacher, pairs=[LAST, {"teacher": 0, "student": 0, "name": "first"}])
    probe = ReleaseProbe(distill, count_at=(10, 30))
    registered = len(ALL_ATTENTION_FUNCTIONS)
    trainer(max_steps=30, callbacks=[distill, probe], log_every_n_steps=10).fit(student, loader(8, 2))
    assert probe.checked_steps == 30 and probe.counts[30] == probe.counts[10], probe.counts
    assert len(ALL_ATTENTION_FUNCTIONS) <= registered + 1  # one capturing implementation, registered once
    assert teacher.config._attn_implementation == student.model.config._attn_implementation == "sdpa"


def test_a_crashing_step_releases_everything_and_restores_the_module():
    """Lightning calls ``on_exception`` but not ``teardown`` when a run raises; the step wrapper used to stay
    installed, so the crashed module kept adding the old teacher's term (and a new callback with the same name was
    refused as a duplicate)."""
    student, teacher = make_student(), make_teacher()
    forward = student.model.forward

    def crash(*args, **kwargs):
        forward(*args, **kwargs)  # the student's paired layers are recorded, then the step dies
        raise RuntimeError("simulated crash")

    student.model.forward = crash
    distill = StreamKLDistillation(teacher, pairs=[LAST])
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer(max_steps=2, callbacks=[distill]).fit(student, loader(4, 2))
    d = distill._distiller
    assert d.teacher_capture.records == {} and d.student_capture.records == {} and _RECORDING == []
    assert "training_step" not in student.__dict__ and "_streamkl_step_wrappers" not in student.__dict__
    assert teacher.config._attn_implementation == student.model.config._attn_implementation == "sdpa"

    del student.model.forward
    trainer(max_steps=1).fit(student, loader(4, 2))  # without the callback: the task loss alone
    assert student.step_losses == student.task_losses
    trainer(max_steps=1, callbacks=[StreamKLDistillation(teacher, pairs=[LAST])]).fit(student, loader(4, 2))
    assert student.step_losses[-1] > student.task_losses[-1]
