"""AttentionDistillationMixin: the same capture and loss, called from the module's own training_step."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lightning_streamkl import AttentionDistillationMixin, AttentionKLDivergence, StreamKLDistillation

from ._models import CausalLM, loader, tiny_llama, trainer
from .test_callback import LAST, Recorder, make_teacher


class DistilledLM(AttentionDistillationMixin, CausalLM):
    def __init__(self, teacher, **options):
        super().__init__(tiny_llama(hidden=16, heads=4, kv_heads=1, layers=2, seed=1), lr=0.05)
        self.configure_attention_distillation(teacher, pairs=[LAST], **options)

    def training_step(self, batch, batch_idx):
        task_loss = self.model(**batch).loss
        self.task_losses.append(float(task_loss.detach()))
        return task_loss + self.attention_distillation_loss()

    def validation_step(self, batch, batch_idx):
        self.model(**batch)
        self.log("val/kl", self.attention_distillation_loss())


def test_mixin_matches_the_callback_step_for_step():
    teacher = make_teacher()
    mixed = DistilledLM(teacher, weight=0.5, temperature=2.0)
    rec = Recorder("train/attn_kl/last_step", "train/attn_kl/total_step")
    trainer(max_steps=3, callbacks=[rec], log_every_n_steps=1).fit(mixed, loader(12, 4))

    plain = CausalLM(tiny_llama(hidden=16, heads=4, kv_heads=1, layers=2, seed=1), lr=0.05)
    cb = StreamKLDistillation(make_teacher(), pairs=[LAST], weight=0.5, temperature=2.0)
    trainer(max_steps=3, callbacks=[cb]).fit(plain, loader(12, 4))

    assert mixed.step_losses == pytest.approx(plain.step_losses, rel=1e-6)
    for task, step, total in zip(mixed.task_losses, mixed.step_losses, rec.values["train/attn_kl/total_step"]):
        assert step == pytest.approx(task + 0.5 * total, rel=1e-6)
    # the teacher is frozen and not a submodule (not in the checkpoint, not in the optimizer)
    assert not any(k.startswith("_streamkl") for k in mixed.state_dict())
    assert all(p.requires_grad is False for p in teacher.parameters())
    assert isinstance(mixed.train_attention_kl, AttentionKLDivergence)


def test_mixin_validation_and_epoch_metrics():
    model = DistilledLM(make_teacher())
    data = loader(8, 4)
    t = trainer(max_epochs=1, limit_val_batches=None)
    t.fit(model, data, data)
    assert {"val/attn_kl/last", "val/attn_kl/total", "train/attn_kl/last_epoch", "val/kl"} <= set(t.callback_metrics)
    assert float(t.callback_metrics["val/attn_kl/last"]) > 0


def test_mixin_with_manual_optimization():
    class Manual(DistilledLM):
        def __init__(self, teacher):
            super().__init__(teacher)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            task_loss = self.model(**batch).loss
            self.task_losses.append(float(task_loss.detach()))
            loss = task_loss + self.attention_distillation_loss()
            self.manual_backward(loss)
            opt.step()

    model = Manual(make_teacher())
    trainer(max_steps=2).fit(model, loader(8, 4))
    assert len(model.step_losses) == 2 and all(s > t for s, t in zip(model.step_losses, model.task_losses))


def test_mixin_errors():
    class Unconfigured(AttentionDistillationMixin, CausalLM):
        pass

    with pytest.raises(RuntimeError, match=r"configure_attention_distillation\(teacher, pairs=...\) first"):
        Unconfigured().attention_distillation_loss({})

    model = DistilledLM(make_teacher())
    with pytest.raises(RuntimeError, match="student's paired layers were not recorded"):
        model.attention_distillation_loss({"input_ids": torch.ones(1, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"Expected `weight` to be a finite number >= 0, but got -1.0"):
        DistilledLM(make_teacher(), weight=-1.0)


def test_mixin_outside_a_trainer():
    model = DistilledLM(make_teacher())
    batch = next(iter(loader(4, 4)))
    with model.capture_student_attention():
        task = model.model(**batch).loss
    loss = task + model.attention_distillation_loss(batch)
    loss.backward()
    assert model.model.model.layers[1].self_attn.q_proj.weight.grad is not None


def test_a_step_that_never_calls_the_loss_warns_once():
    class Forgetful(DistilledLM):
        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss  # attention_distillation_loss() forgotten

    with pytest.warns(UserWarning, match=r"Forgetful: training_step ran the student's paired layers but never called "
                                         r"self.attention_distillation_loss\(\), so nothing was distilled") as record:
        trainer(max_steps=3).fit(Forgetful(make_teacher()), loader(12, 4))
    assert sum("never called" in str(w.message) for w in record) == 1


def test_overriding_the_batch_hooks_without_super_still_distils_and_the_pairing_is_printed(caplog):
    """The mixin used to record the student from its own on_train_batch_start, so an override without super() lost
    the batch ("has no batch: pass it, or call it from a step" while in a step); its hooks now live in a callback
    that the module adds to the trainer. At the start of a fit it prints the pairing line the callback prints."""
    import logging

    class Overrides(DistilledLM):
        def on_train_batch_start(self, batch, batch_idx):
            pass

        def on_train_batch_end(self, outputs, batch, batch_idx):
            pass

    model = Overrides(make_teacher())
    with caplog.at_level(logging.INFO):
        trainer(max_steps=2).fit(model, loader(8, 4))
    assert all(s > t for s, t in zip(model.step_losses, model.task_losses)) and len(model.step_losses) == 2
    assert "StreamKL 'attn_kl': distilling 1 layer pair(s): last (model.layers.1.self_attn -> " \
           "model.model.layers.1.self_attn, fp32 (IEEE))" in caplog.text


def test_dropping_the_mixins_callback_says_what_is_missing():
    class NoCallbacks(DistilledLM):
        def configure_callbacks(self):
            return []

    with pytest.raises(RuntimeError, match=r"has no batch: pass it, or call it from a step: the mixin's batch hooks did "
                                           r"not run: .*return super\(\).configure_callbacks\(\)'s callbacks too"):
        trainer(max_steps=1).fit(NoCallbacks(make_teacher()), loader(4, 4))
