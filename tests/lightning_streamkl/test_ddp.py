"""The callback under 2-process DDP on CPU (gloo, ddp_spawn): one loss per rank, the epoch metric synced."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lightning_streamkl import StreamKLDistillation

from ._models import loader, trainer
from .test_callback import LAST, make_student, make_teacher, manual_kl


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_callback_under_ddp_spawn_syncs_the_validation_metric():
    teacher = make_teacher()
    student = make_student(lr=0.1)
    val = loader(8, 4)
    t = trainer(strategy="ddp_spawn", devices=2, max_steps=2, limit_val_batches=None,
                callbacks=[StreamKLDistillation(teacher, pairs=[LAST])])
    t.fit(student, loader(16, 4), val)

    # rank 0 saw only half of the validation set; the logged value is the row-weighted mean over both halves
    sums = rows = 0.0
    for batch in val:
        with torch.no_grad():
            _, kl = manual_kl(teacher, student.model, batch, "model.layers.1.self_attn", "model.layers.1.self_attn")
        n = float(batch["attention_mask"].sum() * 4)
        sums, rows = sums + float(kl) * n, rows + n
    assert float(t.callback_metrics["val/attn_kl/last"]) == pytest.approx(sums / rows, rel=1e-5)
    half = next(iter(val))
    with torch.no_grad():
        _, kl_half = manual_kl(teacher, student.model, {k: v[::2] for k, v in half.items()},
                               "model.layers.1.self_attn", "model.layers.1.self_attn")
    assert float(t.callback_metrics["val/attn_kl/last"]) != pytest.approx(float(kl_half), rel=1e-5)
